"""No silent answers: where the full batch gives NaN, skips or raises, so does
jaxaccum (issue 18).

- A total weight of 0 (a batch of padding only) skips the step in
  ``make_train_step`` as ``accumulate`` skips the window: parameters,
  optimizer state and threaded state come back as they went in.
- A NaN or Inf total weight gives a non-finite value, as the full batch's
  ``loss_sum / weight`` does, so the step is skipped and reports it.
- A NaN that the loss itself produced reaches the value in every mode.
- A threaded state leaf keeps its dtype, or the call raises.
- With one micro-batch in total the key reaches ``fun`` unchanged: jaxaccum at
  ``k = 1`` is the user's own step, bit for bit.
"""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxaccum

K, M, F = 2, 3, 4


def problem(mask=None):
  keys = jax.random.split(jax.random.key(0), 3)
  w = jax.random.normal(keys[0], (F,))
  x = jax.random.normal(keys[1], (K * M, F))
  y = jax.random.normal(keys[2], (K * M,))
  mask = jnp.ones(K * M) if mask is None else jnp.asarray(mask, jnp.float32)
  return w, (x, y, mask)


def masked_sum(w, batch):
  x, y, mask = batch
  return jnp.sum((jnp.tanh(x @ w) - y) ** 2 * mask), jnp.sum(mask)


def masked_sum_with_state(w, batch, state):
  """A BatchNorm-like running statistic, threaded through the micro-batches."""
  x, _, _ = batch
  new_state = {"mean": 0.9 * state["mean"] + 0.1 * jnp.mean(x, 0), "n": state["n"] + 1}
  return masked_sum(w, batch), (None, new_state)


def state0():
  return {"mean": jnp.zeros(F), "n": jnp.zeros((), jnp.int32)}


# -- 1. weighted normalization never turns "nothing" or NaN into a step -----


def test_a_batch_of_zero_total_weight_skips_the_train_step():
  """All padding: Adam's momentum would move the parameters and its count and
  schedule advance; the step must be skipped instead, as accumulate() skips
  such a window."""
  w, batch = problem(mask=np.zeros(K * M))
  tx = optax.adam(0.1)
  opt_state = tx.init(w)
  # A state in which Adam's momentum is not zero: a zero gradient would move.
  opt_state = tx.update(jnp.ones(F), opt_state, w)[1]
  step = jaxaccum.make_train_step(
    masked_sum_with_state,
    tx,
    K,
    normalize="weighted",
    state_argnum=2,
    has_aux=True,
    donate=False,
  )
  new_w, new_opt_state, (value, (_, new_state)) = step(w, opt_state, batch, state0())
  chex.assert_trees_all_equal(new_w, w)
  chex.assert_trees_all_equal(new_opt_state, opt_state)
  chex.assert_trees_all_equal(new_state, state0())
  assert float(value) == 0.0


def test_a_batch_of_positive_weight_takes_the_step():
  """The control: the same step with one real row moves."""
  w, batch = problem(mask=np.eye(K * M)[0])
  tx = optax.adam(0.1)
  step = jaxaccum.make_train_step(masked_sum, tx, K, normalize="weighted", donate=False)
  new_w, new_opt_state, _ = step(w, tx.init(w), batch)
  assert not np.array_equal(new_w, w)
  assert int(new_opt_state[0].count) == 1


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_nonfinite_total_weight_gives_a_nonfinite_value(bad):
  """The full batch's loss_sum / weight is not finite; neither is jaxaccum's
  value, nor its gradient (value 0 and gradient 0 hid it)."""
  w, batch = problem(mask=np.r_[bad, np.ones(K * M - 1)])
  value, grads = jaxaccum.value_and_grad(masked_sum, K, normalize="weighted")(w, batch)
  assert not np.isfinite(value)
  assert not np.all(np.isfinite(grads))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_nonfinite_total_weight_skips_the_step_and_reports_it(bad):
  w, batch = problem(mask=np.r_[np.ones(K * M - 1), bad])
  tx = optax.adam(0.1)
  opt_state = tx.init(w)
  step = jaxaccum.make_train_step(masked_sum, tx, K, normalize="weighted", donate=False)
  new_w, new_opt_state, value = step(w, opt_state, batch)
  assert not np.isfinite(value)
  chex.assert_trees_all_equal(new_w, w)
  chex.assert_trees_all_equal(new_opt_state, opt_state)


def nan_in_second_micro_batch(batch):
  x, y, mask = batch
  return x, y.at[K * M - 1].set(jnp.nan), mask


@pytest.mark.parametrize(
  ("normalize", "mask"),
  [("mean", None), ("sum", None), ("weighted", None), ("weighted", np.zeros(K * M))],
  ids=["mean", "sum", "weighted", "weighted-zero-total"],
)
def test_a_nan_the_loss_produced_is_never_hidden(normalize, mask):
  """In every mode a NaN in the loss reaches the value and the gradient, even
  where the total weight is zero."""
  w, batch = problem(mask=mask)
  batch = nan_in_second_micro_batch(batch)

  def loss(w, batch):
    loss_sum, weight = masked_sum(w, batch)
    x, y, _ = batch
    loss_sum = loss_sum + 0.0 * jnp.sum(y * (x @ w))  # a NaN row even when masked
    if normalize == "weighted":
      return loss_sum, weight
    return loss_sum / (M if normalize == "mean" else 1)

  value, grads = jaxaccum.value_and_grad(loss, K, normalize=normalize)(w, batch)
  assert np.isnan(value)
  assert np.any(np.isnan(grads))

  tx = optax.sgd(0.1)
  step = jaxaccum.make_train_step(loss, tx, K, normalize=normalize, donate=False)
  new_w, _, reported = step(w, tx.init(w), batch)
  assert np.isnan(reported), "a skipped step reports the loss that caused the skip"
  chex.assert_trees_all_equal(new_w, w)


# -- 2. threaded state keeps its type, or the call fails ---------------------


def counter_loss(w, batch, state):
  x, y, _ = batch
  return jnp.mean((x @ w - y) ** 2), (None, {"count": state["count"] + 0.5})


def test_a_state_leaf_returned_in_another_dtype_is_an_error():
  """An int32 counter plus 0.5 is a float32: it was cast back to 0 silently
  (k eager calls give 1.0). A scan carry would raise; so does jaxaccum, naming
  the leaf and both dtypes."""
  w, batch = problem()
  state = {"count": jnp.zeros((), jnp.int32)}
  fun = jaxaccum.value_and_grad(counter_loss, K, state_argnum=2, has_aux=True)
  want = (
    "fun returned the state leaf state['count'] as float32, but it came in as "
    "int32: a threaded state keeps its dtype"
  )
  with pytest.raises(ValueError, match="^" + re.escape(want)):
    fun(w, batch, state)


def test_a_state_leaf_returned_as_a_python_number_takes_the_state_dtype():
  """A Python number is weakly typed: it becomes the state's dtype, as in a
  scan carry, when that loses nothing (0 into float32)."""

  def reset(w, batch, state):
    x, y, _ = batch
    return jnp.mean((x @ w - y) ** 2), (None, {"mean": 0, "n": state["n"] + 1})

  w, batch = problem()
  fun = jaxaccum.value_and_grad(reset, K, state_argnum=2, has_aux=True)
  (_, (_, new_state)), _ = fun(
    w, batch, {"mean": jnp.ones(()), "n": jnp.zeros((), jnp.int32)}
  )
  assert new_state["mean"].dtype == jnp.float32 and float(new_state["mean"]) == 0.0
  assert not jax.typeof(new_state["mean"]).weak_type
  assert int(new_state["n"]) == K


# -- 5. k = 1 is the user's own step ----------------------------------------


def dropout_loss(w, batch, key):
  x, y, _ = batch
  keep = jax.random.bernoulli(key, 0.5, x.shape)
  return jnp.mean((jnp.where(keep, x / 0.5, 0.0) @ w - y) ** 2)


def test_at_one_micro_batch_the_key_reaches_fun_unchanged():
  w, batch = problem()
  key = jax.random.key(7)
  got = jaxaccum.value_and_grad(dropout_loss, 1, rng_argnum=2)(w, batch, key)
  want = jax.value_and_grad(dropout_loss)(w, batch, key)
  chex.assert_trees_all_equal(got, want)


def test_at_two_micro_batches_each_gets_its_own_folded_key():
  """The control: with k = 2, micro-batch i gets fold_in(key, i)."""
  w, batch = problem()
  key = jax.random.key(7)
  got, _ = jaxaccum.value_and_grad(dropout_loss, 2, rng_argnum=2)(w, batch, key)
  halves = [
    jax.tree.map(lambda b, i=i: b[i * M : (i + 1) * M], batch) for i in range(2)
  ]
  want = np.mean(
    [dropout_loss(w, h, jax.random.fold_in(key, i)) for i, h in enumerate(halves)]
  )
  np.testing.assert_allclose(got, want, rtol=1e-6)


def test_a_training_step_switched_to_k_1_is_bit_identical():
  """An existing jitted Adam step with dropout, switched to make_train_step at
  num_micro_batches=1: the same parameters, optimizer state and loss, bit for
  bit, over several steps."""
  w, batch = problem()
  tx = optax.adam(0.05)

  @jax.jit
  def own_step(w, opt_state, batch, key):
    loss, grads = jax.value_and_grad(dropout_loss)(w, batch, key)
    updates, opt_state = tx.update(grads, opt_state, w)
    return optax.apply_updates(w, updates), opt_state, loss

  step = jaxaccum.make_train_step(dropout_loss, tx, 1, rng_argnum=2, donate=False)
  mine, theirs = (w, tx.init(w)), (w, tx.init(w))
  for i in range(3):
    key = jax.random.fold_in(jax.random.key(1), i)
    *mine, loss_mine = step(*mine, batch, key)
    *theirs, loss_theirs = own_step(*theirs, batch, key)
    chex.assert_trees_all_equal((mine, loss_mine), (theirs, loss_theirs))


# mutmut: _tree.check_dtypes_kept (every leaf is checked; what counts as weak)
@pytest.mark.parametrize(
  ("returned", "kept"),
  [
    (lambda s: jnp.asarray(0.5), True),  # a weakly typed array: takes float32
    (lambda s: s.astype(jnp.float16), False),  # strongly typed, narrower
    (lambda s: s.astype(jnp.bfloat16), False),
  ],
  ids=["weak-array", "float16", "bfloat16"],
)
def test_every_state_leaf_is_checked_and_only_weak_types_adapt(returned, kept):
  """The first leaf keeps its dtype; the second is what fun returned for a
  float32 leaf. A weakly typed value takes the state's dtype, as in a scan
  carry; a strongly typed other dtype raises (even one that would promote to
  float32), also after a leaf that passed."""

  def two_leaves(w, batch, state):
    x, y, _ = batch
    new = {"a": state["a"] + 1, "b": returned(state["b"])}
    return jnp.mean((x @ w - y) ** 2), (None, new)

  w, batch = problem()
  state = {"a": jnp.zeros((), jnp.int32), "b": jnp.ones((), jnp.float32)}
  fun = jaxaccum.value_and_grad(two_leaves, K, state_argnum=2, has_aux=True)
  if kept:
    (_, (_, new)), _ = fun(w, batch, state)
    assert new["b"].dtype == jnp.float32 and float(new["b"]) == 0.5
    assert not jax.typeof(new["b"]).weak_type
    return
  have = jnp.dtype(returned(state["b"]).dtype).name
  want = (
    f"fun returned the state leaf state['b'] as {have}, but it came in as "
    "float32: a threaded state keeps its dtype (a lax.scan carry must). Cast "
    "it back yourself, e.g. new.astype(old.dtype), if that is what you mean."
  )
  with pytest.raises(ValueError, match="^" + re.escape(want)):
    fun(w, batch, state)
