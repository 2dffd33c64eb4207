"""BatchNorm's running averages over micro-batches, against the full batch's.

Threaded through ``k`` micro-batches, a running average moves ``k`` times per
step: momentum ``μ`` decays the old average by ``μ^k`` per step, not ``μ``.
``jaxaccum.micro_batch_momentum(μ, k) = μ^(1/k)`` keeps the full batch's
per-step momentum. Each step's batch here is ``k`` shuffles of the same rows,
so every micro-batch has the full batch's statistics: the running averages
built with ``μ^(1/k)`` must then be the full batch's, step after step, in
Flax Linen (``state_argnum``), Flax NNX (``jaxaccum.nnx.make_train_step``)
and Equinox (``eqx.nn.State`` through ``state_argnum``).
"""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxaccum

K, M, FEATURES, STEPS, MU = 4, 8, 3, 5, 0.9


def batches(seed=0):
  """Per step, ``K`` shuffles of the same ``M`` rows (shifted and scaled, so
  that the statistics move), as one batch of ``K * M`` rows."""
  out = []
  for step in range(STEPS):
    key = jax.random.fold_in(jax.random.key(seed), step)
    rows = 2.0 + 3.0 * jax.random.normal(key, (M, FEATURES))
    shuffles = [
      rows[jax.random.permutation(jax.random.fold_in(key, i + 1), M)] for i in range(K)
    ]
    out.append(jnp.concatenate(shuffles))
  return out


def linen_loss(momentum):
  bn = nn.BatchNorm(use_running_average=False, momentum=momentum)

  def loss(params, stats, x):
    y, updates = bn.apply(
      {"params": params, "batch_stats": stats}, x, mutable=["batch_stats"]
    )
    return jnp.mean(y**2), (None, updates["batch_stats"])

  return bn, loss


def linen_running_stats(momentum, k):
  bn, loss = linen_loss(momentum)
  variables = bn.init(jax.random.key(0), jnp.ones((1, FEATURES)))
  params, stats = variables["params"], variables["batch_stats"]
  trail = []
  for x in batches():
    if k is None:  # the full batch
      _, (_, stats) = loss(params, stats, x)
    else:
      fun = jaxaccum.value_and_grad(
        loss, k, has_aux=True, state_argnum=1, batch_argnums=2
      )
      (_, (_, stats)), _ = fun(params, stats, x)
    trail.append(stats)
  return trail


def assert_stats_close(got, want):
  for g, w in zip(got, want, strict=True):
    for gl, wl in zip(jax.tree.leaves(g), jax.tree.leaves(w), strict=True):
      np.testing.assert_allclose(gl, wl, rtol=1e-5, atol=1e-5)


def test_linen_running_stats_with_micro_batch_momentum_are_the_full_batchs():
  full = linen_running_stats(MU, None)
  kept = linen_running_stats(jaxaccum.micro_batch_momentum(MU, K), K)
  assert_stats_close(kept, full)


def test_linen_running_stats_move_k_times_per_step_without_it():
  """The docstring's numbers: momentum μ per micro-batch is μ^k per step, so
  the first step moves (1 - μ^k) / (1 - μ) = 3.44 times as far as the full
  batch's."""
  full = linen_running_stats(MU, None)[0]["mean"]
  moved = linen_running_stats(MU, K)[0]["mean"]  # from zero means
  np.testing.assert_allclose(moved / full, (1 - MU**K) / (1 - MU), rtol=1e-5)


class NNXNet(nnx.Module):
  def __init__(self, momentum, rngs):
    self.bn = nnx.BatchNorm(FEATURES, momentum=momentum, rngs=rngs)

  def __call__(self, x):
    return self.bn(x)


def test_nnx_make_train_step_with_micro_batch_momentum_keeps_the_full_batchs_stats():
  full = NNXNet(MU, nnx.Rngs(0))
  model = NNXNet(jaxaccum.micro_batch_momentum(MU, K), nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param)
  step = jaxaccum.nnx.make_train_step(
    lambda model, x: jnp.mean(model(x) ** 2), optimizer, K
  )
  for x in batches():
    full(x)
    step(model, x)
    np.testing.assert_allclose(model.bn.mean[...], full.bn.mean[...], rtol=1e-5)
    np.testing.assert_allclose(model.bn.var[...], full.bn.var[...], rtol=1e-5)


def eqx_loss(model, state, x):
  y, state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
    x, state
  )
  return jnp.mean(y**2), (None, state)


@pytest.mark.parametrize("mode", ["batch", "ema"])
def test_eqx_batchnorm_with_micro_batch_momentum_normalizes_as_the_full_batch(mode):
  """Equinox's "batch" mode debiases by 1 - μ^count, and count moves k
  times per step too: μ^(1/k) keeps both. The check is what inference
  reads: the running statistics' normalization of new rows."""

  def make(momentum):
    return eqx.nn.make_with_state(eqx.nn.BatchNorm)(
      FEATURES, "batch", momentum=momentum, mode=mode
    )

  full, full_state = make(MU)
  model, state = make(jaxaccum.micro_batch_momentum(MU, K))
  fun = jaxaccum.value_and_grad(
    eqx_loss, K, has_aux=True, state_argnum=1, batch_argnums=2
  )
  probe = jnp.linspace(-3.0, 3.0, 4 * FEATURES).reshape(4, FEATURES)

  def normalized(model, state):
    model = eqx.nn.inference_mode(model)
    return jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
      probe, state
    )[0]

  for x in batches():
    _, (_, full_state) = eqx_loss(full, full_state, x)
    (_, (_, state)), _ = fun(model, state, x)
    np.testing.assert_allclose(
      normalized(model, state), normalized(full, full_state), rtol=1e-5, atol=1e-5
    )
