"""rng_argnum folds the micro-batch index into the key; state_argnum threads state.

The reference for both is a plain Python loop over the micro-batches.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxaccum

K, M, F = 4, 3, 5


def problem():
  keys = jax.random.split(jax.random.key(1), 3)
  w = jax.random.normal(keys[0], (F,))
  x = jax.random.normal(keys[1], (K * M, F))
  return w, x, keys[2]


def dropout_loss(w, x, key):
  keep = jax.random.bernoulli(key, 0.5, x.shape)
  h = jnp.where(keep, x / 0.5, 0.0) @ w
  return jnp.mean(jnp.tanh(h) ** 2), keep


def test_micro_batch_i_gets_fold_in_key_i():
  w, x, key = problem()
  (value, masks), grads = jax.jit(
    jaxaccum.value_and_grad(dropout_loss, K, rng_argnum=2, has_aux=True)
  )(w, x, key)

  values, all_grads = [], []
  for i in range(K):
    (v, mask), g = jax.value_and_grad(dropout_loss, has_aux=True)(
      w, x[i * M : (i + 1) * M], jax.random.fold_in(key, i)
    )
    np.testing.assert_array_equal(masks[i], mask)
    values.append(v)
    all_grads.append(g)
  chex.assert_trees_all_close(
    (value, grads),
    (jnp.mean(jnp.stack(values)), jnp.mean(jnp.stack(all_grads), 0)),
    rtol=1e-5,
    atol=1e-6,
  )
  # Different micro-batches get different dropout masks.
  assert not np.array_equal(masks[0], masks[1])


def test_raw_uint32_keys_work_too():
  w, x, _ = problem()
  key = jax.random.PRNGKey(3)
  (_, masks), _ = jaxaccum.value_and_grad(dropout_loss, K, rng_argnum=2, has_aux=True)(
    w, x, key
  )
  _, mask1 = dropout_loss(w, x[M : 2 * M], jax.random.fold_in(key, 1))
  np.testing.assert_array_equal(masks[1], mask1)


def batch_norm_loss(w, x, stats):
  """A BatchNorm-like layer in training mode, with a running mean."""
  h = x @ w
  mean = jnp.mean(h)
  loss = jnp.mean((h - mean) ** 2) + 0.1 * jnp.mean(h - stats["running"]) ** 2
  new_stats = {
    "running": 0.9 * stats["running"] + 0.1 * mean,
    "count": stats["count"] + 1,
  }
  return loss, (mean, new_stats)


def test_state_is_threaded_in_micro_batch_order():
  w, x, _ = problem()
  stats = {"running": jnp.array(0.5), "count": jnp.array(0, jnp.int32)}
  (value, (means, final)), grads = jax.jit(
    jaxaccum.value_and_grad(batch_norm_loss, K, state_argnum=2, has_aux=True)
  )(w, x, stats)

  state, values, all_grads, want_means = stats, [], [], []
  for i in range(K):
    (v, (mean, state)), g = jax.value_and_grad(batch_norm_loss, has_aux=True)(
      w, x[i * M : (i + 1) * M], state
    )
    values.append(v)
    all_grads.append(g)
    want_means.append(mean)
  chex.assert_trees_all_close(
    (value, grads, means, final),
    (
      jnp.mean(jnp.stack(values)),
      jnp.mean(jnp.stack(all_grads), 0),
      jnp.stack(want_means),
      state,
    ),
    rtol=1e-5,
    atol=1e-6,
  )
  assert int(final["count"]) == K
  assert final["count"].dtype == jnp.int32


def test_rng_and_state_together():
  w, x, key = problem()

  def loss(w, x, key, stats):
    v, _ = dropout_loss(w, x, key)
    _, (_, new_stats) = batch_norm_loss(w, x, stats)
    return v, (None, new_stats)

  stats = {"running": jnp.array(0.0), "count": jnp.array(0, jnp.int32)}
  (value, (_, final)), _ = jaxaccum.value_and_grad(
    loss, K, rng_argnum=2, state_argnum=3, has_aux=True
  )(w, x, key, stats)
  want = np.mean(
    [
      dropout_loss(w, x[i * M : (i + 1) * M], jax.random.fold_in(key, i))[0]
      for i in range(K)
    ]
  )
  np.testing.assert_allclose(value, want, rtol=1e-6)
  assert int(final["count"]) == K


@pytest.mark.parametrize("k", [1, 2])
def test_state_comes_back_typed_like_the_state_passed_in(k):
  """A Python number returned as new state comes back a strong int32 / float32
  like the state passed in: a weak-typed state fed back into a jitted step
  would compile it again."""

  def fun(w, x, state):
    return jnp.sum(x @ w), (None, {"count": 0, "scale": 1.0})

  state = {"count": jnp.int32(5), "scale": jnp.float32(2.0)}
  (_, (_, new_state)), _ = jaxaccum.value_and_grad(
    fun, k, state_argnum=2, has_aux=True
  )(jnp.ones(3), jnp.ones((4, 3)), state)
  for name, leaf in new_state.items():
    assert jax.typeof(leaf) == jax.typeof(state[name]), name
