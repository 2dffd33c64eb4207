"""rng_argnum folds the micro-batch index into the key; state_argnum threads state.

The reference for both is a plain Python loop over the micro-batches.
"""

import re

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
    jaxaccum.value_and_grad(dropout_loss, K, rng_argnum=2, has_aux=True, aux="stack")
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
  (_, masks), _ = jaxaccum.value_and_grad(
    dropout_loss, K, rng_argnum=2, has_aux=True, aux="stack"
  )(w, x, key)
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
    jaxaccum.value_and_grad(
      batch_norm_loss, K, state_argnum=2, has_aux=True, aux="stack"
    )
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


# The tests below were written for mutants that survived mutmut (issue 13),
# each watched failing on them; the comment above each names the mutated
# function. They use a smaller problem: one weight vector of SMALL_F
# features, a batch (x, y) of SMALL_K micro-batches of SMALL_M rows.

SMALL_K, SMALL_M, SMALL_F = 2, 3, 4


def small_problem(seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  w = jax.random.normal(keys[0], (SMALL_F,))
  x = jax.random.normal(keys[1], (SMALL_K * SMALL_M, SMALL_F))
  y = jax.random.normal(keys[2], (SMALL_K * SMALL_M,))
  return w, (x, y)


def mse(w, batch):
  x, y = batch
  return jnp.mean((jnp.tanh(x @ w) - y) ** 2)


def small_micro(batch, i, m=SMALL_M):
  return jax.tree.map(lambda b: b[i * m : (i + 1) * m], batch)


def threaded_loop(fun, w, batch, state):
  """The reference for ``state_argnum``: ``jax.value_and_grad`` on each
  micro-batch in turn, the state threaded; the mean value, the mean gradient
  and the final state."""
  values, all_grads = [], []
  for i in range(SMALL_K):
    (v, (_, state)), g = jax.value_and_grad(fun, has_aux=True)(
      w, small_micro(batch, i), state
    )
    values.append(v)
    all_grads.append(g)
  return jnp.mean(jnp.stack(values)), jnp.mean(jnp.stack(all_grads), 0), state


# mutmut: _micro._unpack_state
def test_state_aux_that_is_not_a_pair_is_a_clear_error():
  """_micro._unpack_state: a triple accepted (`and` -> `or`), the message."""

  def three(w, batch, state):
    return mse(w, batch), (None, state, "extra")

  w, batch = small_problem()
  want = "state_argnum needs fun to return (value, (aux, new_state)), got an "
  want += "aux that is a tuple of length 3, not a pair."
  with pytest.raises(ValueError, match=re.escape(want)):
    jaxaccum.value_and_grad(three, SMALL_K, state_argnum=2, has_aux=True)(
      w, batch, jnp.zeros(())
    )


# mutmut: _micro._match_state
def test_new_state_of_another_structure_is_a_clear_error():
  """_micro._match_state: the message."""

  def grows(w, batch, state):
    return mse(w, batch), (None, {**state, "extra": state["n"]})

  w, batch = small_problem()
  with pytest.raises(
    ValueError,
    match="fun returned a new_state whose structure differs from the state it "
    "was given: ",
  ):
    jaxaccum.value_and_grad(grows, SMALL_K, state_argnum=2, has_aux=True)(
      w, batch, {"n": jnp.zeros(())}
    )


def running_stats(w, batch, state):
  """New state computed in float32 and cast back to the state's dtypes, and a
  leaf returned as a Python number (weakly typed), for a state held in other
  dtypes."""
  x, _ = batch
  mean = jnp.mean(x @ w)
  new_state = {
    "avg": (0.5 * state["avg"].astype(jnp.float32) + 0.5 * mean).astype(jnp.bfloat16),
    "count": state["count"] + 1,
    "seen": 1.0,  # a Python float, for a bfloat16 leaf
  }
  return mse(w, batch), (mean, new_state)


# mutmut: _tree.cast_like
@pytest.mark.parametrize("k", [1, SMALL_K])
def test_new_state_comes_back_in_the_dtypes_of_the_state(k):
  """_tree.cast_like: no cast back of a weakly typed leaf, or a cast to
  astype(None)."""
  w, batch = small_problem()
  state = {
    "avg": jnp.array(0.25, jnp.bfloat16),
    "count": jnp.array(3, jnp.int32),
    "seen": jnp.array(0.0, jnp.bfloat16),
  }
  (value, (means, final)), grads = jaxaccum.value_and_grad(
    running_stats, k, state_argnum=2, has_aux=True, aux="stack"
  )(w, batch, state)

  # Reference: a Python loop that casts back after each micro-batch.
  m = SMALL_K * SMALL_M // k
  ref, values, all_grads, want_means = state, [], [], []
  for i in range(k):
    (v, (mean, new)), g = jax.value_and_grad(running_stats, has_aux=True)(
      w, small_micro(batch, i, m), ref
    )
    ref = jax.tree.map(lambda n, o: jnp.asarray(n).astype(o.dtype), new, ref)
    values.append(v)
    all_grads.append(g)
    want_means.append(mean)
  chex.assert_trees_all_equal_dtypes(final, state)
  chex.assert_trees_all_close(final, ref, rtol=1e-6, atol=1e-6)
  assert int(final["count"]) == 3 + k
  chex.assert_trees_all_close(
    (value, grads, means),
    (
      jnp.mean(jnp.stack(values)),
      jnp.mean(jnp.stack(all_grads), 0),
      jnp.stack(want_means),
    ),
    rtol=1e-6,
    atol=1e-6,
  )


def feature_means(w, batch, state):
  """A BatchNorm-like running mean per feature: a state of shape (SMALL_F,)."""
  x, _ = batch
  new_state = 0.5 * state + 0.5 * jnp.mean(x, axis=0) * w
  return mse(w, batch), (None, new_state)


# mutmut: _micro._match_state
def test_state_with_vector_leaves_is_threaded():
  """_micro._match_state: the shape check given None."""
  w, batch = small_problem()
  state = jnp.linspace(-1.0, 1.0, SMALL_F)
  (value, (_, final)), grads = jaxaccum.value_and_grad(
    feature_means, SMALL_K, state_argnum=2, has_aux=True
  )(w, batch, state)

  chex.assert_trees_all_close(
    (value, grads, final),
    threaded_loop(feature_means, w, batch, state),
    rtol=1e-6,
    atol=1e-6,
  )


# mutmut: _tree.cast_like
@pytest.mark.parametrize("k", [1, SMALL_K])
def test_state_given_as_python_numbers_keeps_their_types(k):
  """_tree.cast_like: a weak-typed state leaf cast with astype(None), i.e.
  to float32 (the original also returned it weak-typed, which recompiled a
  jitted step)."""

  def count(w, batch, state):
    return mse(w, batch), (None, {"seen": state["seen"] + 1, "decay": 0.5})

  w, batch = small_problem()
  (_, (_, final)), _ = jaxaccum.value_and_grad(count, k, state_argnum=2, has_aux=True)(
    w, batch, {"seen": 0, "decay": 1.0}
  )
  assert final["seen"].dtype == jnp.int32 and int(final["seen"]) == k
  assert final["decay"].dtype == jnp.float32 and float(final["decay"]) == 0.5
