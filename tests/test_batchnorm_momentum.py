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

import warnings

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


def batches(seed=0, k=K):
  """Per step, ``k`` shuffles of the same ``M`` rows (shifted and scaled, so
  that the statistics move), as one batch of ``k * M`` rows."""
  out = []
  for step in range(STEPS):
    key = jax.random.fold_in(jax.random.key(seed), step)
    rows = 2.0 + 3.0 * jax.random.normal(key, (M, FEATURES))
    shuffles = [
      rows[jax.random.permutation(jax.random.fold_in(key, i + 1), M)] for i in range(k)
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


# -- The warning: a train step that threads state through k > 1 micro-batches


@pytest.fixture
def nothing_adjusted(monkeypatch):
  """No micro_batch_momentum asked for yet in this process (other tests ask
  for K's)."""
  from jaxaccum._optim import scaling  # noqa: PLC0415

  monkeypatch.setattr(scaling, "_ADJUSTED", set())


def linen_step(k, momentum=MU):
  bn, loss = linen_loss(momentum)
  variables = bn.init(jax.random.key(0), jnp.ones((1, FEATURES)))
  tx = optax.sgd(0.0)
  step = jaxaccum.make_train_step(
    loss, tx, k, has_aux=True, state_argnum=1, batch_argnums=2
  )
  params, stats = variables["params"], variables["batch_stats"]
  return step, params, tx.init(params), stats


def running_average_warnings(caught):
  return [w for w in caught if issubclass(w.category, jaxaccum.RunningAverageWarning)]


def test_make_train_step_with_state_warns_once_with_the_factor_it_measures(
  nothing_adjusted,
):
  """At k = 8 the running mean's first step moves 5.7 times as far as the full
  batch's: the warning says so, once per step function, however often it
  runs."""
  step, params, opt_state, stats = linen_step(8)
  x = batches(k=8)[0]  # every micro-batch with the full batch's statistics
  with pytest.warns(jaxaccum.RunningAverageWarning) as caught:
    params, opt_state, (_, (_, moved)) = step(params, opt_state, stats, x)
    params, opt_state, _ = step(params, opt_state, moved, x)
  (warning,) = running_average_warnings(caught)
  assert str(warning.message) == (
    "jaxaccum: state_argnum=1's state passes through k=8 micro-batches per "
    "step, so a running average in it (BatchNorm's statistics) moves 8 times: "
    "momentum 0.9 acts as 0.43 per step, 5.7x as far as the full batch's. Build "
    "the layers with momentum=jaxaccum.micro_batch_momentum(μ, 8); silence with "
    "warnings.filterwarnings('ignore', "
    "category=jaxaccum.RunningAverageWarning)."
  )
  _, (_, full) = linen_loss(MU)[1](params, stats, x)
  ratio = moved["mean"] / full["mean"]  # both from zero means
  np.testing.assert_allclose(ratio, (1 - MU**8) / (1 - MU), rtol=1e-5)
  assert f"{float(ratio[0]):.1f}x" in str(warning.message)


def test_no_warning_at_k_1_or_after_micro_batch_momentum_or_when_silenced(
  nothing_adjusted,
):
  x = batches()[0]
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    step, params, opt_state, stats = linen_step(1)
    step(params, opt_state, stats, x)
    step, params, opt_state, stats = linen_step(8, jaxaccum.micro_batch_momentum(MU, 8))
    step(params, opt_state, stats, x)
    warnings.filterwarnings("ignore", category=jaxaccum.RunningAverageWarning)
    step, params, opt_state, stats = linen_step(2)
    step(params, opt_state, stats, x)
  assert not running_average_warnings(caught)
  with pytest.warns(jaxaccum.RunningAverageWarning, match="k=2 micro-batches"):
    step, params, opt_state, stats = linen_step(2)  # 8 was asked for, not 2
    step(params, opt_state, stats, x)


def test_nnx_make_train_step_warns_for_batch_stats_a_training_step_updates(
  nothing_adjusted,
):
  def nnx_step(model):
    optimizer = nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param)
    return jaxaccum.nnx.make_train_step(
      lambda model, x: jnp.mean(model(x) ** 2), optimizer, K
    )

  x = batches()[0]
  model = NNXNet(MU, nnx.Rngs(0))
  step = nnx_step(model)
  with pytest.warns(jaxaccum.RunningAverageWarning) as caught:
    step(model, x)
    step(model, x)
  (warning,) = running_average_warnings(caught)
  assert str(warning.message).startswith(
    "jaxaccum: the model's nnx.BatchStat passes through k=4 micro-batches per step"
  )
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    frozen = NNXNet(MU, nnx.Rngs(0))
    frozen.eval()  # use_running_average=True: nothing moves
    nnx_step(frozen)(frozen, x)
    plain = nnx.Linear(FEATURES, 1, rngs=nnx.Rngs(0))  # no BatchStat
    nnx_step(plain)(plain, x)
  assert not running_average_warnings(caught)
