"""Hyperparameter scaling rules for a larger effective batch."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxaccum._optim.scaling import (
  AdamHyperparams,
  kappa,
  scale_adam_sqrt,
  scale_lr_linear,
  warmup,
)


def test_kappa():
  assert kappa(256, 1024) == 4.0
  assert kappa(1024, 256) == 0.25
  assert kappa(np.int64(256), np.int32(512)) == 2.0


@pytest.mark.parametrize(
  ("base", "size"), [(0, 1024), (256, -1), (256.0, 1024), (True, 1024), (256, None)]
)
def test_bad_batch_sizes_raise_and_name_them(base, size):
  match = rf"base_batch_size={base!r} and batch_size={size!r}"
  with pytest.raises(ValueError, match=match):
    kappa(base, size)
  with pytest.raises(ValueError, match=match):
    scale_lr_linear(0.1, base, size)
  with pytest.raises(ValueError, match=match):
    scale_adam_sqrt(1e-3, base, size)


def test_linear_rule():
  assert scale_lr_linear(0.1, 256, 1024) == pytest.approx(0.4)
  assert scale_lr_linear(0.1, 256, 256) == 0.1
  # Shrinking the batch shrinks the learning rate.
  assert scale_lr_linear(0.4, 1024, 256) == pytest.approx(0.1)
  assert isinstance(scale_lr_linear(0.1, 256, 1024), float)


def test_adam_sqrt_rule_at_kappa_4():
  hp = scale_adam_sqrt(1e-3, 256, 1024, b1=0.9, b2=0.999, eps=1e-8)
  assert isinstance(hp, AdamHyperparams)
  assert hp.learning_rate == pytest.approx(2e-3)
  assert hp.b1 == pytest.approx(0.6)
  assert hp.b2 == pytest.approx(0.996)
  assert hp.eps == pytest.approx(5e-9)


def test_adam_sqrt_rule_defaults_are_optax_defaults():
  assert scale_adam_sqrt(1e-3, 256, 1024) == pytest.approx(
    scale_adam_sqrt(1e-3, 256, 1024, b1=0.9, b2=0.999, eps=1e-8)
  )


def test_adam_sqrt_rule_is_identity_at_kappa_1():
  assert scale_adam_sqrt(3e-4, 512, 512, b1=0.0, b2=0.95, eps=1e-6) == (
    3e-4,
    0.0,
    0.95,
    1e-6,
  )


def test_adam_sqrt_rule_inverts():
  hp = scale_adam_sqrt(1e-3, 256, 1024, b1=0.9, b2=0.999, eps=1e-8)
  back = scale_adam_sqrt(*hp[:1], 1024, 256, b1=hp.b1, b2=hp.b2, eps=hp.eps)
  assert back == pytest.approx((1e-3, 0.9, 0.999, 1e-8))


def test_adam_sqrt_rule_raises_where_it_breaks_down():
  # kappa = 10 and 1 - b1 = 0.1: kappa * (1 - b1) = 1, no b1 is left.
  with pytest.raises(ValueError, match=r"kappa=10 and b1=0\.9"):
    scale_adam_sqrt(1e-3, 100, 1000, b1=0.9)
  # kappa = 16: kappa * (1 - b1) = 1.6.
  with pytest.raises(ValueError, match=r"kappa=16 and b1=0\.9"):
    scale_adam_sqrt(1e-3, 64, 1024)
  # b2 breaks down first when it is the smaller decay rate.
  with pytest.raises(ValueError, match=r"kappa=4 and b2=0\.7"):
    scale_adam_sqrt(1e-3, 256, 1024, b1=0.99, b2=0.7)


@pytest.mark.parametrize(
  ("kwargs", "match"),
  [
    ({"b1": 1.0}, r"b1 must be in \[0, 1\), got b1=1\.0"),
    ({"b2": -0.1}, r"b2 must be in \[0, 1\), got b2=-0\.1"),
    ({"eps": -1e-8}, r"eps must be >= 0, got eps=-1e-08"),
  ],
)
def test_adam_sqrt_rule_rejects_bad_hyperparameters(kwargs, match):
  with pytest.raises(ValueError, match=match):
    scale_adam_sqrt(1e-3, 256, 256, **kwargs)


def test_scaled_adam_plugs_into_optax():
  hp = scale_adam_sqrt(1e-3, 32, 128)
  tx = optax.adam(**hp._asdict())
  params = {"w": jnp.ones((3,)), "b": jnp.zeros(())}
  grads = jax.grad(lambda p: jnp.sum((p["w"] * 2.0 + p["b"]) ** 2))(params)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  new_params = optax.apply_updates(params, updates)
  for leaf in jax.tree.leaves(updates):
    assert jnp.all(jnp.isfinite(leaf))
  # Adam's first step moves each coordinate by about the learning rate.
  assert jnp.allclose(new_params["w"], 1.0 - hp.learning_rate, rtol=1e-5)
  assert float(new_params["b"]) == pytest.approx(-hp.learning_rate, rel=1e-5)


def test_warmup_then_constant():
  schedule = warmup(0.4, 100, init_learning_rate=0.1)
  assert float(schedule(0)) == pytest.approx(0.1)
  assert float(schedule(50)) == pytest.approx(0.25)
  assert float(schedule(100)) == pytest.approx(0.4)
  assert float(schedule(101)) == pytest.approx(0.4)
  assert float(schedule(10_000)) == pytest.approx(0.4)


def test_warmup_defaults_to_zero_init():
  schedule = warmup(0.4, 100)
  assert float(schedule(0)) == 0.0
  assert float(schedule(25)) == pytest.approx(0.1)


def test_warmup_with_linear_rule_starts_at_base_lr():
  base_lr = 0.1
  schedule = warmup(scale_lr_linear(base_lr, 256, 8192), 5, init_learning_rate=base_lr)
  # optax computes (init - peak) + peak in float32: an error of ulp(peak).
  assert float(schedule(0)) == pytest.approx(base_lr, abs=1e-6)
  assert float(schedule(5)) == pytest.approx(3.2, rel=1e-6)


def test_warmup_then_cosine_decay():
  schedule = warmup(
    0.4, 100, init_learning_rate=0.1, decay_steps=900, end_learning_rate=0.004
  )
  assert float(schedule(0)) == pytest.approx(0.1)
  assert float(schedule(50)) == pytest.approx(0.25)
  assert float(schedule(100)) == pytest.approx(0.4)
  # Halfway through the decay the cosine factor is 1/2.
  assert float(schedule(550)) == pytest.approx((0.4 + 0.004) / 2)
  t = 300 / 900
  cosine = 0.004 + (0.4 - 0.004) * 0.5 * (1 + math.cos(math.pi * t))
  assert float(schedule(400)) == pytest.approx(cosine, rel=1e-5)
  assert float(schedule(1000)) == pytest.approx(0.004)
  assert float(schedule(5000)) == pytest.approx(0.004)


def test_warmup_zero_steps():
  assert float(warmup(0.4, 0)(0)) == pytest.approx(0.4)
  assert float(warmup(0.4, 0)(7)) == pytest.approx(0.4)
  decay = warmup(0.4, 0, decay_steps=10, end_learning_rate=0.1)
  assert float(decay(0)) == pytest.approx(0.4)
  assert float(decay(5)) == pytest.approx(0.25)
  assert float(decay(10)) == pytest.approx(0.1)


def test_warmup_schedule_runs_under_jit_and_in_optax():
  schedule = warmup(0.4, 10, init_learning_rate=0.1, decay_steps=10)
  values = jax.jit(jax.vmap(schedule))(jnp.arange(21))
  assert values.shape == (21,)
  assert float(values[10]) == pytest.approx(0.4)
  assert float(values[20]) == pytest.approx(0.0, abs=1e-7)
  tx = optax.sgd(schedule)
  params = jnp.ones(2)
  updates, _ = tx.update(jnp.ones(2), tx.init(params), params)
  assert updates.tolist() == pytest.approx([-0.1, -0.1])


@pytest.mark.parametrize(
  ("kwargs", "match"),
  [
    ({"warmup_steps": -1}, r"warmup_steps must be an int >= 0, got warmup_steps=-1"),
    ({"warmup_steps": 1.5}, r"warmup_steps=1\.5"),
    ({"warmup_steps": 10, "decay_steps": 0}, r"got decay_steps=0"),
  ],
)
def test_warmup_rejects_bad_steps(kwargs, match):
  with pytest.raises(ValueError, match=match):
    warmup(0.4, **kwargs)
