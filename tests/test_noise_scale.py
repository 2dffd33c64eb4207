"""The gradient noise scale on linear regression, where it is known exactly.

With x ~ N(0, I_n), y = x·w* + ε, ε ~ N(0, σ²), and the per-example loss
½(x·w − y)², the per-example gradient at w is g = (xᵀd − ε) x with d = w − w*.
Its mean is G = d, and by Gaussian moments its covariance is
Σ = (|d|² + σ²) I + d dᵀ. So tr(Σ) = n(|d|² + σ²) + |d|² and |G|² = |d|²:
with n = 8, |d| = 1 and σ = 0.5, B_simple = tr(Σ)/|G|² = 11.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum

N, SIGMA, K, M = 8, 0.5, 8, 16
W_STAR = jnp.zeros(N)
W = jnp.ones(N) / np.sqrt(N)  # |d| = 1
B_SIMPLE = (N * (1 + SIGMA**2) + 1) / 1


def loss(w, batch):
  x, y = batch
  return jnp.mean(0.5 * (x @ w - y) ** 2)


def sample(key, rows):
  kx, ke = jax.random.split(key)
  x = jax.random.normal(kx, (rows, N))
  return x, x @ W_STAR + SIGMA * jax.random.normal(ke, (rows,))


STEPS, DECAY = 1500, 0.995


def test_in_step_estimate_within_ten_percent():
  grad_fn = jaxaccum.value_and_grad(loss, K, noise_stats=True)

  @jax.jit
  def run(key):
    def step(state, key):
      (_, _), noise = grad_fn(W, sample(key, K * M))
      return jaxaccum.noise_scale_update(state, noise, DECAY), noise

    return jax.lax.scan(step, jaxaccum.noise_scale_init(), jax.random.split(key, STEPS))

  state, noise = run(jax.random.key(0))
  assert float(noise.b_small[0]) == M and float(noise.b_big[0]) == K * M
  # Each raw estimate is unbiased: their means match the closed form too.
  np.testing.assert_allclose(np.mean(noise.sq_norm()), 1.0, rtol=0.1)
  np.testing.assert_allclose(np.mean(noise.trace()), N * (1 + SIGMA**2) + 1, rtol=0.1)
  b_simple = float(jaxaccum.critical_batch_size(state))
  assert abs(b_simple - B_SIMPLE) / B_SIMPLE < 0.1, b_simple


def test_cross_step_estimate_within_ten_percent():
  tx = jaxaccum.accumulate(optax.sgd(0.0), K, noise_stats=True)
  grad = jax.grad(loss)

  @jax.jit
  def run(key):
    def call(carry, key):
      opt_state, tracker = carry
      _, opt_state = tx.update(grad(W, sample(key, M)), opt_state, W)
      window_done = opt_state.micro_step == 0
      tracker = jax.lax.cond(
        window_done,
        lambda t: jaxaccum.noise_scale_update(t, opt_state.noise.last, DECAY),
        lambda t: t,
        tracker,
      )
      return (opt_state, tracker), None

    init = (tx.init(W), jaxaccum.noise_scale_init())
    return jax.lax.scan(call, init, jax.random.split(key, STEPS * K))[0]

  opt_state, tracker = run(jax.random.key(1))
  assert int(tracker.num_updates) == STEPS
  last = opt_state.noise.last
  assert float(last.b_small) == 1.0 and float(last.b_big) == K  # micro-batch units
  b_simple = float(jaxaccum.critical_batch_size(tracker)) * M  # to examples
  assert abs(b_simple - B_SIMPLE) / B_SIMPLE < 0.1, b_simple


def test_weighted_and_sum_modes_agree_with_mean_mode():
  x, y = sample(jax.random.key(2), K * M)

  def loss_sum(w, batch):
    x, y = batch
    return jnp.sum(0.5 * (x @ w - y) ** 2)

  def weighted(w, batch):
    return loss_sum(w, batch), jnp.asarray(batch[0].shape[0], jnp.float32)

  _, mean = jaxaccum.value_and_grad(loss, K, noise_stats=True)(W, (x, y))
  _, total = jaxaccum.value_and_grad(loss_sum, K, normalize="sum", noise_stats=True)(
    W, (x, y)
  )
  _, tokens = jaxaccum.value_and_grad(
    weighted, K, normalize="weighted", noise_stats=True
  )(W, (x, y))
  # Both norms are of per-example means, whatever the mode sums: the same
  # measurements, and so the same S, |G|² and B_simple.
  chex.assert_trees_all_close(total, mean, rtol=1e-5)
  chex.assert_trees_all_close(tokens, mean, rtol=1e-5)
  assert float(total.trace()) > 0 and float(total.sq_norm()) > 0


def test_grad_returns_the_grads_and_the_noise():
  batch = sample(jax.random.key(4), K * M)
  (_, grads), noise = jaxaccum.value_and_grad(loss, K, noise_stats=True)(W, batch)
  only_grads, only_noise = jaxaccum.grad(loss, K, noise_stats=True)(W, batch)
  chex.assert_trees_all_close(only_grads, grads)
  chex.assert_trees_all_close(only_noise, noise)
  chex.assert_trees_all_close(only_grads, jax.grad(loss)(W, batch), atol=1e-6)


def test_train_step_returns_the_noise():
  batch = sample(jax.random.key(5), K * M)
  tx = optax.sgd(0.1)
  step = jaxaccum.make_train_step(loss, tx, K, noise_stats=True, donate=False)
  new_w, _, (value, noise) = step(W, tx.init(W), batch)
  full_value, full_grads = jax.value_and_grad(loss)(W, batch)
  chex.assert_trees_all_close(value, full_value, atol=1e-6)
  chex.assert_trees_all_close(new_w, W - 0.1 * full_grads, atol=1e-6)
  _, expected = jaxaccum.value_and_grad(loss, K, noise_stats=True)(W, batch)
  chex.assert_trees_all_close(noise, expected, rtol=1e-5)


def test_one_micro_batch_has_no_noise_to_measure():
  """noise_stats with one micro-batch in total is an error (issue 18): it
  returned an empty estimate that looked like a measurement."""
  with pytest.raises(
    ValueError, match="noise_stats=True needs at least 2 micro-batches"
  ):
    jaxaccum.value_and_grad(loss, 1, noise_stats=True)(W, sample(jax.random.key(3), M))


def test_a_measurement_without_an_estimate_is_left_out():
  """GradientNoise with b_small == b_big (one micro-batch) holds no estimate:
  the tracker leaves it out, and B_simple stays infinite, never NaN."""
  noise = jaxaccum.GradientNoise(*map(jnp.asarray, (1.0, 1.0, float(M), float(M))))
  assert not bool(noise.has_estimate())
  state = jaxaccum.noise_scale_update(jaxaccum.noise_scale_init(), noise)
  assert int(state.num_updates) == 0
  assert float(jaxaccum.critical_batch_size(state)) == np.inf


@pytest.mark.slow
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_data_parallel_equals_single_device(axis_type):
  mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
  batch = sample(jax.random.key(4), 8 * 2 * M)
  sharded = jax.tree.map(
    lambda a: jax.device_put(a, NamedSharding(mesh, P("data"))), batch
  )
  (_, _), noise = jax.jit(
    jaxaccum.value_and_grad(loss, 2, noise_stats=True, mesh=mesh, data_axis="data")
  )(W, sharded)
  (_, _), want = jaxaccum.value_and_grad(loss, 16, noise_stats=True)(W, batch)
  chex.assert_trees_all_close(noise, want, rtol=1e-5)
