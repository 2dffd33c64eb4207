"""The value-level normalization checks: off by default, on for debugging."""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.experimental import checkify
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum


def weighted(w, batch):
  x, weights = batch
  return jnp.sum((x @ w) ** 2 * weights), jnp.sum(weights)


W = jnp.ones(2)
X = jnp.ones((8, 2))


def checked(k):
  """The accumulated function with value checks, under chexify, synchronous."""
  fun = jaxaccum.value_and_grad(weighted, k, normalize="weighted", value_checks=True)
  return chex.chexify(jax.jit(fun), async_check=False)


def test_checks_are_off_by_default_and_leave_no_effect():
  """No effect on the jaxpr, so jit keeps its fast C++ dispatch path."""
  fun = jaxaccum.value_and_grad(weighted, 4, normalize="weighted")
  assert not jax.make_jaxpr(fun)(W, (X, jnp.ones(8))).effects
  on = jaxaccum.value_and_grad(weighted, 4, normalize="weighted", value_checks=True)
  assert jax.make_jaxpr(on)(W, (X, jnp.ones(8))).effects
  bad = jnp.ones(8).at[3].set(-5.0)
  value, _ = jax.jit(fun)(W, (X, bad))  # not checked: no error
  assert jnp.isfinite(value)


def test_default_train_step_has_no_effects():
  tx = optax.adam(0.1)
  step = jaxaccum.make_train_step(lambda w, x: jnp.mean((x @ w) ** 2), tx, 2)
  assert not step.trace(W, tx.init(W), X).jaxpr.effects


def test_chexify_catches_a_negative_weight():
  checked(4)(W, (X, jnp.ones(8)))  # fine
  with pytest.raises(
    checkify.JaxRuntimeError,
    match=r"^jaxaccum: micro-batch weights must be finite and >= 0, got "
    r"\[ *2\. +-4\. +2\. +2\.\]\.",
  ):
    checked(4)(W, (X, jnp.ones(8).at[3].set(-5.0)))


def test_chexify_catches_a_nan_weight():
  with pytest.raises(checkify.JaxRuntimeError, match="weights must be finite"):
    checked(2)(W, (X, jnp.ones(8).at[0].set(jnp.nan)))


def test_zero_total_weight_passes_the_check_with_zero_grads():
  value, grads = checked(2)(W, (X, jnp.zeros(8)))
  assert float(value) == 0.0 and not jnp.any(grads)


def test_chexify_catches_a_zero_total_weight_under_a_loss_that_counts_rows():
  """The weights count no row, yet the loss sum depends on the parameters: the
  weights and the loss disagree (a mask applied to one and not the other), and
  the zero result would hide it."""

  def unmasked_loss(w, batch):
    x, mask = batch
    return jnp.sum((x @ w) ** 2), jnp.sum(mask)

  fun = jaxaccum.value_and_grad(
    unmasked_loss, 2, normalize="weighted", value_checks=True
  )
  step = chex.chexify(jax.jit(fun), async_check=False)
  step(W, (X, jnp.ones(8)))  # the weights count rows: fine
  with pytest.raises(
    checkify.JaxRuntimeError,
    match=r"^jaxaccum: total weight 0\.0 is not positive, yet the summed "
    r"gradient is not zero: the weights count no rows that the loss sums over\.",
  ):
    step(W, (X, jnp.zeros(8)))
  # A total below one is still positive (mutmut: _checks.check_total_weight).
  step(W, (X, jnp.full(8, 0.05)))


def test_no_gradient_leaves_count_as_zero_gradients():
  """(mutmut: _checks.check_total_weight, whose empty-tree default
  survived.)"""
  from jaxaccum import _checks  # noqa: PLC0415

  check = checkify.checkify(_checks.check_total_weight)
  err, _ = check(jnp.float32(0.0), {})
  assert err.get() is None
  err, _ = check(jnp.float32(0.0), {"w": jnp.ones(2)})
  assert "total weight 0.0 is not positive" in err.get()


def test_verify_equivalence_keeps_its_bfloat16_tolerance_under_weighted():
  """Its documented default is max(1e-5, 8 eps) of the leaf's dtype; with
  normalize="weighted" and bfloat16 parameters it applied about 1e-5 and
  always raised (Gemma's query norm scale: 1.2e-4 over an allowed 2.4e-8)."""
  keys = jax.random.split(jax.random.key(0), 3)
  w = jax.random.normal(keys[0], (16, 16)).astype(jnp.bfloat16)
  x = jax.random.normal(keys[1], (32, 16)).astype(jnp.bfloat16)
  mask = (jax.random.uniform(keys[2], (32,)) < 0.7).astype(jnp.float32)

  def weighted_bf16(w, batch):
    x, mask = batch
    per_row = jnp.sum(jnp.tanh(x @ w).astype(jnp.float32) ** 2, axis=-1)
    return jnp.sum(per_row * mask), jnp.sum(mask)

  deviation = jaxaccum.verify_equivalence(
    weighted_bf16, (w, (x, mask)), 4, normalize="weighted"
  )
  assert deviation.grads <= 8 * float(jnp.finfo(jnp.bfloat16).eps) * 10
  # And it still catches a real difference at that tolerance: a loss that is
  # not a sum over rows (the max row) differs between micro-batches and the
  # whole batch.

  def max_row(w, batch):
    x, mask = batch
    per_row = jnp.sum(jnp.tanh(x @ w).astype(jnp.float32) ** 2, axis=-1)
    return jnp.max(per_row * mask) * jnp.sum(mask), jnp.sum(mask)

  with pytest.raises(AssertionError, match="differ by up to"):
    jaxaccum.verify_equivalence(max_row, (w, (x, mask)), 4, normalize="weighted")


@pytest.mark.slow
@pytest.mark.parametrize(
  "axis_type", [jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto]
)
def test_verify_equivalence_with_mesh_takes_a_batch_sharded_on_explicit_axes(axis_type):
  """The full-batch reference of an ordinary MLP on a batch sharded over the
  data axis: on Explicit axes (jax.make_mesh's default) its weight gradient,
  a contraction over the sharded rows, failed with JAX's ShardingTypeError."""

  def loss(w, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ w["a"]) @ w["b"] - y) ** 2)

  w = {"a": jnp.ones((4, 8)) / 4, "b": jnp.linspace(-1.0, 1.0, 8)}
  mesh = jax.make_mesh(
    (4,), ("data",), devices=jax.devices()[:4], axis_types=(axis_type,)
  )
  x = jax.random.normal(jax.random.key(0), (32, 4))
  batch = jax.device_put((x, jnp.sin(x[:, 0])), NamedSharding(mesh, P("data")))
  deviation = jaxaccum.verify_equivalence(
    loss, (w, batch), 2, mesh=mesh, data_axis="data"
  )
  assert deviation.grads < 1e-5
