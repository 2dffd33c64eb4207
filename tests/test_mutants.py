"""Tests written for mutants that survived ``mutmut`` (issue 13).

Each test is named for the behaviour it protects, and was watched failing on
its mutants. Its docstring names the mutated function and what the mutants
did, not their numbers: mutmut renumbers a function's mutants whenever the
function changes. (Mutants of the error checks are killed by
``tests/test_errors.py``, which matches each message whole, and of the value
checks by ``tests/test_checks.py``.)
"""

import re

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxaccum

K, M, F = 2, 3, 4


def data(seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  w = jax.random.normal(keys[0], (F,))
  x = jax.random.normal(keys[1], (K * M, F))
  y = jax.random.normal(keys[2], (K * M,))
  return w, (x, y)


def mse(w, batch):
  x, y = batch
  return jnp.mean((jnp.tanh(x @ w) - y) ** 2)


def micro(batch, i, m=M):
  return jax.tree.map(lambda b: b[i * m : (i + 1) * m], batch)


def threaded_loop(fun, w, batch, state):
  """The reference for ``state_argnum``: ``jax.value_and_grad`` on each
  micro-batch in turn, the state threaded; the mean value, the mean gradient
  and the final state."""
  values, all_grads = [], []
  for i in range(K):
    (v, (_, state)), g = jax.value_and_grad(fun, has_aux=True)(
      w, micro(batch, i), state
    )
    values.append(v)
    all_grads.append(g)
  return jnp.mean(jnp.stack(values)), jnp.mean(jnp.stack(all_grads), 0), state


# _engine: state_argnum


def test_state_aux_that_is_not_a_pair_is_a_clear_error():
  """_engine._unpack_state: a triple accepted (`and` -> `or`), the message."""

  def three(w, batch, state):
    return mse(w, batch), (None, state, "extra")

  w, batch = data()
  want = "state_argnum needs fun to return (value, (aux, new_state)), got an "
  want += "aux that is a tuple of length 3, not a pair."
  with pytest.raises(ValueError, match=re.escape(want)):
    jaxaccum.value_and_grad(three, K, state_argnum=2, has_aux=True)(
      w, batch, jnp.zeros(())
    )


def test_new_state_of_another_structure_is_a_clear_error():
  """_engine._match_state: the message."""

  def grows(w, batch, state):
    return mse(w, batch), (None, {**state, "extra": state["n"]})

  w, batch = data()
  with pytest.raises(
    ValueError,
    match="fun returned a new_state whose structure differs from the state it "
    "was given: ",
  ):
    jaxaccum.value_and_grad(grows, K, state_argnum=2, has_aux=True)(
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


@pytest.mark.parametrize("k", [1, K])
def test_new_state_comes_back_in_the_dtypes_of_the_state(k):
  """_tree.cast_like: no cast back of a weakly typed leaf, or a cast to
  astype(None)."""
  w, batch = data()
  state = {
    "avg": jnp.array(0.25, jnp.bfloat16),
    "count": jnp.array(3, jnp.int32),
    "seen": jnp.array(0.0, jnp.bfloat16),
  }
  (value, (means, final)), grads = jaxaccum.value_and_grad(
    running_stats, k, state_argnum=2, has_aux=True
  )(w, batch, state)

  # Reference: a Python loop that casts back after each micro-batch.
  m = K * M // k
  ref, values, all_grads, want_means = state, [], [], []
  for i in range(k):
    (v, (mean, new)), g = jax.value_and_grad(running_stats, has_aux=True)(
      w, micro(batch, i, m), ref
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
  """A BatchNorm-like running mean per feature: a state of shape (F,)."""
  x, _ = batch
  new_state = 0.5 * state + 0.5 * jnp.mean(x, axis=0) * w
  return mse(w, batch), (None, new_state)


def test_state_with_vector_leaves_is_threaded():
  """_engine._match_state: the shape check given None."""
  w, batch = data()
  state = jnp.linspace(-1.0, 1.0, F)
  (value, (_, final)), grads = jaxaccum.value_and_grad(
    feature_means, K, state_argnum=2, has_aux=True
  )(w, batch, state)

  chex.assert_trees_all_close(
    (value, grads, final),
    threaded_loop(feature_means, w, batch, state),
    rtol=1e-6,
    atol=1e-6,
  )


# _train_step


def keyed_loss(w, batch, state):
  """Advances a typed PRNG key held in the state; the gradient is NaN (while
  the loss is finite) when ``state["s"]`` is 0."""
  x, y = batch
  key, sub = jax.random.split(state["key"])
  noise = 0.01 * jax.random.normal(sub, y.shape)
  loss = jnp.mean((x @ w - y + noise) ** 2) + jnp.sqrt(state["s"] + 0.0 * w[0])
  return loss, (None, {"key": key, "s": state["s"]})


@pytest.mark.parametrize("finite", [True, False])
def test_a_skipped_step_keeps_the_state_and_its_prng_key(finite):
  """_train_step._select: the typed-key branch broken (some only for a
  non-default key impl); make_train_step: state_argnum lost, so a skipped
  step returned the new state."""
  w, batch = data()
  state = {
    "key": jax.random.key(7, impl="rbg"),
    "s": jnp.float32(1.0 if finite else 0.0),
  }
  tx = optax.sgd(0.1)
  step = jaxaccum.make_train_step(
    keyed_loss, tx, K, donate=False, state_argnum=2, has_aux=True
  )
  new_w, _, (value, (_, new_state)) = step(w, tx.init(w), batch, state)

  want_value, grads, ref = threaded_loop(keyed_loss, w, batch, state)
  assert bool(jnp.all(jnp.isfinite(grads))) == finite  # the premise
  chex.assert_trees_all_close(value, want_value, rtol=1e-6)
  if finite:
    want_w, want_key = w - 0.1 * grads, ref["key"]
  else:  # skipped: parameters and state as they came in
    want_w, want_key = w, state["key"]
  chex.assert_trees_all_close(new_w, want_w, rtol=1e-6, atol=1e-6)
  assert jax.random.key_impl(new_state["key"]) == jax.random.key_impl(want_key)
  np.testing.assert_array_equal(
    jax.random.key_data(new_state["key"]), jax.random.key_data(want_key)
  )
  assert not np.array_equal(
    jax.random.key_data(ref["key"]), jax.random.key_data(state["key"])
  )


def count_batches(params, batch, state):
  """No parameters to train: only the state (a running mean) moves."""
  del params
  x, _ = batch
  return jnp.mean(x**2), (None, {"mean": 0.5 * state["mean"] + 0.5 * jnp.mean(x)})


def test_a_step_without_parameters_is_not_skipped():
  """_train_step.all_finite: an empty grads tree counted as non-finite."""
  _, batch = data()
  tx = optax.adam(0.1)
  state = {"mean": jnp.float32(1.0)}
  step = jaxaccum.make_train_step(
    count_batches, tx, K, donate=False, state_argnum=2, has_aux=True
  )
  new_params, opt_state, (value, (_, new_state)) = step({}, tx.init({}), batch, state)

  ref = state
  for i in range(K):
    _, (_, ref) = count_batches({}, micro(batch, i), ref)
  assert new_params == {}
  chex.assert_trees_all_close(value, jnp.mean(batch[0] ** 2), rtol=1e-6)
  chex.assert_trees_all_close(new_state, ref, rtol=1e-6)
  assert int(opt_state[0].count) == 1  # the step was taken


def scaled_sgd(learning_rate=0.1):
  return jaxaccum.accumulate(
    optax.sgd(learning_rate), 1, loss_scale=jaxaccum.dynamic_loss_scale(2.0**4)
  )


def test_train_step_finds_the_loss_scale_inside_multisteps():
  """_train_step.find_loss_scale: MultiSteps not unwrapped."""
  w, batch = data()
  tx = optax.MultiSteps(scaled_sgd(), every_k_schedule=1)
  step = jaxaccum.make_train_step(mse, tx, K, donate=False)
  new_w, opt_state, value = step(w, tx.init(w), batch)

  want_value, grads = jax.value_and_grad(mse)(w, batch)
  chex.assert_trees_all_close(value, want_value, rtol=1e-6)
  chex.assert_trees_all_close(new_w, w - 0.1 * grads, rtol=1e-5, atol=1e-6)
  assert int(opt_state.inner_opt_state.step) == 1


def test_two_loss_scales_are_a_clear_error():
  """_train_step.find_loss_scale: `> 1` -> `> 2`, and the message."""
  w, batch = data()
  tx = optax.chain(scaled_sgd(), scaled_sgd())
  step = jaxaccum.make_train_step(mse, tx, K, donate=False)
  want = (
    "make_train_step multiplies the whole loss by the loss scale, so the "
    "jaxaccum.accumulate(..., loss_scale=...) that unscales it must see "
    "every gradient first: pass it as tx, or first in optax.chain. This "
    "opt_state holds 2 loss scale(s) elsewhere."
  )
  with pytest.raises(ValueError, match=f"^{re.escape(want)}"):
    step(w, tx.init(w), batch)


def test_train_step_with_other_argnums_is_a_clear_error():
  """_train_step.make_train_step: the argnums check reads another key, and
  the message."""
  with pytest.raises(
    ValueError,
    match=r"^make_train_step differentiates the parameters, argnums=0\.$",
  ):
    jaxaccum.make_train_step(mse, optax.sgd(0.1), K, argnums=1)


def loss_and_aux(w, batch):
  """The mean loss, and per-example residuals as aux (kept per micro-batch)."""
  x, y = batch
  residual = jnp.tanh(x @ w) - y
  return jnp.mean(residual**2), {"residual": residual}


def token_loss(w, batch):
  """``normalize="weighted"``: a loss sum and its weight (nonzero rows of y)."""
  x, y = batch
  mask = (y > 0).astype(jnp.float32)
  return jnp.sum(mask * (jnp.tanh(x @ w) - y) ** 2), jnp.sum(mask)


def token_loss_and_aux(w, batch):
  return token_loss(w, batch), {"weight": token_loss(w, batch)[1]}


@pytest.mark.parametrize("has_aux", [False, True])
@pytest.mark.parametrize("normalize", ["mean", "weighted"])
def test_loss_scaled_train_step_reports_the_unscaled_loss_and_its_aux(
  has_aux, normalize
):
  """_train_step.make_train_step: ``has_aux`` or ``weighted`` lost under a
  loss scale."""
  weighted = normalize == "weighted"
  loss_fn = {
    (False, False): mse,
    (True, False): loss_and_aux,
    (False, True): token_loss,
    (True, True): token_loss_and_aux,
  }[has_aux, weighted]
  w, batch = data()
  tx = scaled_sgd()
  step = jaxaccum.make_train_step(
    loss_fn, tx, K, donate=False, has_aux=has_aux, normalize=normalize
  )
  new_w, opt_state, value = step(w, tx.init(w), batch)

  def reference(w):  # the full-batch mean (token mean when weighted)
    out = loss_fn(w, batch)
    loss = out[0] if has_aux else out
    return loss[0] / loss[1] if weighted else loss

  want_loss, grads = jax.value_and_grad(reference)(w)
  loss = value[0] if has_aux else value
  assert loss.dtype == jnp.float32
  chex.assert_trees_all_close(loss, want_loss, rtol=1e-5)
  if has_aux:  # stacked, one entry per micro-batch
    auxes = [loss_fn(w, micro(batch, i))[1] for i in range(K)]
    want_aux = jax.tree.map(lambda *a: jnp.stack(a), *auxes)
    chex.assert_trees_all_close(value[1], want_aux, rtol=1e-6)
  chex.assert_trees_all_close(new_w, w - 0.1 * grads, rtol=1e-5, atol=1e-6)
  assert int(opt_state.step) == 1 and int(opt_state.num_skipped) == 0


def loss_and_log_residual(w, batch):
  """Finite loss and gradient; an aux metric that is -inf where y hits."""
  x, y = batch
  residual = jnp.tanh(x @ w) - y
  return jnp.mean(residual**2), jnp.log(jnp.abs(y - y[0]))


def test_a_nonfinite_aux_does_not_skip_the_step():
  """_train_step.make_train_step: only the loss and the gradient decide the
  skip, not the aux."""
  w, batch = data()
  tx = optax.sgd(0.1)
  step = jaxaccum.make_train_step(
    loss_and_log_residual, tx, K, donate=False, has_aux=True
  )
  new_w, _, (loss, aux) = step(w, tx.init(w), batch)

  (want_loss, want_aux), grads = jax.value_and_grad(
    loss_and_log_residual, has_aux=True
  )(w, batch)
  assert not np.all(np.isfinite(aux))  # the premise
  np.testing.assert_array_equal(aux[0], want_aux[:M])
  chex.assert_trees_all_close(loss, want_loss, rtol=1e-6)
  chex.assert_trees_all_close(new_w, w - 0.1 * grads, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scaled", [False, True])
def test_train_step_passes_keyword_arguments_on(scaled):
  """_train_step.make_train_step: keywords dropped, with and without a loss
  scale."""

  def weighted_mse(w, batch, *, factor):
    return factor * mse(w, batch)

  w, batch = data()
  tx = scaled_sgd() if scaled else optax.sgd(0.1)
  step = jaxaccum.make_train_step(weighted_mse, tx, K, donate=False)
  new_w, _, loss = step(w, tx.init(w), batch, factor=3.0)

  want_loss, grads = jax.value_and_grad(weighted_mse)(w, batch, factor=3.0)
  chex.assert_trees_all_close(loss, want_loss, rtol=1e-5)
  chex.assert_trees_all_close(new_w, w - 0.1 * grads, rtol=1e-5, atol=1e-6)


def test_a_nan_loss_with_finite_gradients_skips_the_step():
  """_train_step.make_train_step: only the gradient decides the skip."""

  def nan_loss(w, batch):
    return mse(w, batch) + jax.lax.stop_gradient(jnp.log(-1.0))

  w, batch = data()
  tx = optax.adam(0.1)
  step = jaxaccum.make_train_step(nan_loss, tx, K, donate=False)
  state = tx.init(w)
  new_w, new_state, loss = step(w, state, batch)

  assert np.all(np.isfinite(jax.grad(nan_loss)(w, batch)))  # the premise
  assert np.isnan(loss)
  chex.assert_trees_all_equal(new_w, w)
  chex.assert_trees_all_equal(new_state, state)


def test_train_step_passes_the_params_to_the_optimizer():
  """_train_step.make_train_step: tx.update without params (adamw's weight
  decay needs them)."""
  w, batch = data()
  tx = optax.adamw(0.1, weight_decay=0.5)
  step = jaxaccum.make_train_step(mse, tx, K, donate=False)
  new_w, new_state, _ = step(w, tx.init(w), batch)

  updates, want_state = tx.update(jax.grad(mse)(w, batch), tx.init(w), w)
  chex.assert_trees_all_close(
    new_w, optax.apply_updates(w, updates), rtol=1e-5, atol=1e-6
  )
  chex.assert_trees_all_close(new_state, want_state, rtol=1e-5, atol=1e-6)


def test_train_step_keeps_the_optimizer_state_dtypes():
  """_train_step.make_train_step: the optimizer state not cast back; float32
  updates into adam's bfloat16 moments would promote them."""
  w, batch = data()
  w = w.astype(jnp.bfloat16)
  to_float32 = optax.stateless(
    lambda updates, params: jax.tree.map(lambda u: u.astype(jnp.float32), updates)
  )
  tx = optax.chain(to_float32, optax.adam(0.1))
  state = tx.init(w)
  step = jaxaccum.make_train_step(mse, tx, K, donate=False)
  new_w, new_state, _ = step(w, state, batch)

  updates, want_state = tx.update(jax.grad(mse)(w, batch), state, w)
  assert want_state[1][0].mu.dtype == jnp.float32  # the premise: promoted
  want_state = jax.tree.map(lambda n, o: n.astype(o.dtype), want_state, state)
  chex.assert_trees_all_equal_dtypes(new_state, state)
  chex.assert_trees_all_close(new_state, want_state, rtol=1e-2, atol=1e-3)
  chex.assert_trees_all_close(
    new_w, optax.apply_updates(w, updates), rtol=1e-2, atol=1e-2
  )
  assert new_w.dtype == jnp.bfloat16


@pytest.mark.parametrize("k", [1, K])
def test_state_given_as_python_numbers_keeps_their_types(k):
  """_engine._cast_like: a weak-typed state leaf cast with astype(None), i.e.
  to float32 (the original also returned it weak-typed, which recompiled a
  jitted step)."""

  def count(w, batch, state):
    return mse(w, batch), (None, {"seen": state["seen"] + 1, "decay": 0.5})

  w, batch = data()
  (_, (_, final)), _ = jaxaccum.value_and_grad(count, k, state_argnum=2, has_aux=True)(
    w, batch, {"seen": 0, "decay": 1.0}
  )
  assert final["seen"].dtype == jnp.int32 and int(final["seen"]) == k
  assert final["decay"].dtype == jnp.float32 and float(final["decay"]) == 0.5


# _transform


def weak_counter():
  """An inner transformation whose init makes a weak-typed leaf."""

  def update(updates, state, params=None):
    del params
    return updates, {"n": state["n"] + 1}

  return optax.GradientTransformation(lambda params: {"n": jnp.asarray(0)}, update)


def avals(tree):
  return jax.tree.map(jax.typeof, tree)


@pytest.mark.parametrize("inner", ["sgd", "weak_counter"])
def test_accumulate_state_is_strongly_typed_and_updates_keep_its_types(inner):
  """_transform._scalar: weak-typed fields; _transform._cast_like: an inner
  state leaf left weak; _transform.accumulate: micro_step, step and
  num_skipped not int32."""
  w, batch = data()
  tx = jaxaccum.accumulate(optax.sgd(0.1) if inner == "sgd" else weak_counter(), K)
  state = tx.init(w)
  assert not any(jax.typeof(x).weak_type for x in jax.tree.leaves(state))
  assert state.micro_step.dtype == state.step.dtype == jnp.int32
  assert state.num_skipped.dtype == jnp.int32 and state.acc_weight.dtype == jnp.float32
  grads = jax.grad(mse)(w, batch)
  for _ in range(K):  # a window: both branches of the lax.cond
    _, new_state = jax.jit(tx.update)(grads, state, w)
    assert avals(new_state) == avals(state)
    state = new_state


def test_float32_gradients_on_bfloat16_params_keep_the_inner_state_dtypes():
  """_transform._cast_like: adam's promoted moments not cast back."""
  w, batch = data()
  w16 = w.astype(jnp.bfloat16)
  inner = optax.adam(0.1)
  tx = jaxaccum.accumulate(inner, K)
  state = tx.init(w16)
  grads = [jax.grad(mse)(w, micro(batch, i)) for i in range(K)]  # float32
  for g in grads:
    updates, state = tx.update(g, state, w16)

  want, want_state = inner.update(sum(grads) / K, inner.init(w16), w16)
  assert want_state[0].mu.dtype == jnp.float32  # the premise: promoted
  chex.assert_trees_all_equal_dtypes(state.inner_state, inner.init(w16))
  chex.assert_trees_all_close(updates, want, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(
    state.inner_state,
    jax.tree.map(lambda n, o: n.astype(o.dtype), want_state, inner.init(w16)),
    rtol=1e-2,
    atol=1e-3,
  )


def promoting_ema():
  """An inner transformation whose state starts in the parameters' dtype and
  comes out of ``update`` in float32 (a strong float32 factor promotes it);
  it checks the gradients' shape and needs the parameters."""

  def update(updates, state, params=None):
    chex.assert_equal_shape((updates, state["ema"]))
    ema = jnp.float32(0.5) * state["ema"] + jnp.float32(0.5) * updates
    ema = ema + jnp.float32(0.01) * params  # weight decay: needs the params
    return ema, {"ema": ema}

  return optax.GradientTransformation(
    lambda params: {"ema": jnp.zeros_like(params)}, update
  )


def test_inner_state_takes_the_dtypes_of_one_inner_update():
  """_transform._inner_init: the inner state keeps inner.init's dtypes where
  one update changes them."""
  w, batch = data()
  w16 = w.astype(jnp.bfloat16)
  inner = promoting_ema()
  _, after = inner.update(jax.grad(mse)(w16, batch), inner.init(w16), w16)
  assert inner.init(w16)["ema"].dtype == jnp.bfloat16  # the premise
  assert after["ema"].dtype == jnp.float32
  tx = jaxaccum.accumulate(inner, K)
  state = tx.init(w16)
  chex.assert_trees_all_equal_dtypes(state.inner_state, after)
  grads = [jax.grad(mse)(w16, micro(batch, i)) for i in range(K)]
  for g in grads:
    updates, state = tx.update(g, state, w16)
  want, want_state = inner.update(sum(grads) / K, inner.init(w16), w16)
  chex.assert_trees_all_equal_dtypes(state.inner_state, want_state)
  chex.assert_trees_all_close(
    (updates, state.inner_state), (want, want_state), rtol=1e-2, atol=1e-3
  )


def test_window_schedule_values_are_clamped_and_truncated_to_ints():
  """_transform._window_size: a float window size kept, or clamped to 2, not
  1."""
  w, batch = data()
  # Like an optax schedule: float values, and a 0 at step 1 (a traced value,
  # held at 1; a concrete 0 at step 0 is an error, tests/test_errors.py).
  tx = jaxaccum.accumulate(optax.sgd(0.1), lambda step: jnp.where(step == 1, 0.0, 2.7))
  state = tx.init(w)
  grads = jax.grad(mse)(w, batch)
  steps = []
  for _ in range(5):
    _, state = tx.update(grads, state, w)
    steps.append(int(state.step))
  assert steps == [0, 1, 2, 2, 3]  # a window of 2, one of 1, one of 2


@pytest.mark.parametrize("noise_stats", [False, True])
def test_noise_before_the_first_window_is_no_estimate(noise_stats):
  """_transform._no_noise: ones instead of zeros; _transform.accumulate:
  window sums that do not start at 0."""
  w, _ = data()
  tx = jaxaccum.accumulate(optax.sgd(0.1), K, noise_stats=noise_stats)
  state = tx.init(w)
  chex.assert_trees_all_equal(state.noise, jax.tree.map(jnp.zeros_like, state.noise))
  assert not bool(state.noise.last.has_estimate())


def test_accumulate_without_noise_stats_measures_nothing():
  """_transform.accumulate: noise_stats on by default."""
  w, batch = data()
  tx = jaxaccum.accumulate(optax.sgd(0.1), K)
  state = tx.init(w)
  for i in range(K):
    _, state = tx.update(jax.grad(mse)(w, micro(batch, i)), state, w)
  assert int(state.step) == 1
  chex.assert_trees_all_equal(state.noise, jax.tree.map(jnp.zeros_like, state.noise))


def test_accumulate_with_an_integer_accum_dtype_is_a_clear_error():
  """_transform.accumulate: the accum_dtype check (_normalize.check_accum_dtype)
  skipped, or its message."""
  with pytest.raises(
    ValueError, match=r"^accum_dtype must be a floating dtype, got int32\.$"
  ):
    jaxaccum.accumulate(optax.sgd(0.1), K, accum_dtype=jnp.int32)


def test_accumulator_has_the_accum_dtype():
  """_transform.accumulate: a float32 accumulator whatever accum_dtype says."""
  w, batch = data()
  w16 = w.astype(jnp.float16)
  tx = jaxaccum.accumulate(optax.sgd(0.1), K, accum_dtype=jnp.float16)
  state = tx.init(w16)
  assert state.acc_grads.dtype == jnp.float16
  g = jax.grad(mse)(w16, micro(batch, 0))
  _, state = tx.update(g, state, w16)
  assert state.acc_grads.dtype == jnp.float16
  np.testing.assert_array_equal(state.acc_grads, g)


def test_a_fresh_state_has_not_updated():
  """_transform.accumulate: ``updated`` starts True."""
  w, _ = data()
  state = jaxaccum.accumulate(optax.sgd(0.1), K).init(w)
  assert not bool(jaxaccum.has_updated(state))
  assert state.updated.dtype == jnp.bool_


@pytest.mark.parametrize("case", ["weight", "structure", "shape"])
def test_accumulate_update_errors_name_what_is_wrong(case):
  """_transform.accumulate: the weight, structure and shape messages."""
  w, batch = data()
  tx = jaxaccum.accumulate(optax.sgd(0.1), K)
  state = tx.init({"w": w})
  grads = {"w": jax.grad(mse)(w, batch)}
  if case == "weight":
    want = "weight must be a scalar, got shape=(2,)."
    call = lambda: tx.update(grads, state, weight=jnp.ones(2))  # noqa: E731
  elif case == "structure":
    want = "grads do not have the structure of the parameters accumulate() was "
    want += "initialized with: "
    call = lambda: tx.update({"v": grads["w"]}, state)  # noqa: E731
  else:
    want = "The gradient leaf grads['w'] has shape=(3,), but accumulate() was "
    want += "initialized with parameters whose leaf there has shape=(4,)."
    call = lambda: tx.update({"w": grads["w"][:3]}, state)  # noqa: E731
  with pytest.raises(ValueError, match=f"^{re.escape(want)}"):
    call()


def test_zero_and_fractional_weights_are_not_skipped():
  """_transform.accumulate: a weight of 0, or below 1, skipped."""
  w, batch = data()
  tx = jaxaccum.accumulate(optax.sgd(1.0), 3)
  state = tx.init(w)
  grads = [jax.grad(mse)(w, micro(batch, i)) for i in range(K)] + [jnp.ones(F)]
  for g, weight in zip(grads, [0.5, 2.0, 0.0], strict=True):
    updates, state = tx.update(g, state, w, weight=weight)
  assert int(state.num_skipped) == 0 and int(state.step) == 1
  want = -(grads[0] + grads[1] + grads[2]) / 2.5
  chex.assert_trees_all_close(updates, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("nan", [False, True])
def test_without_skip_nonfinite_every_gradient_is_accumulated(nan):
  """_transform.accumulate with skip_nonfinite=False: a NaN still skipped, or
  nothing accumulated."""
  w, batch = data()
  tx = jaxaccum.accumulate(optax.sgd(1.0), K, skip_nonfinite=False)
  state = tx.init(w)
  grads = [jax.grad(mse)(w, micro(batch, i)) for i in range(K)]
  if nan:
    grads[0] = grads[0].at[0].set(jnp.nan)
  for g in grads:
    updates, state = tx.update(g, state, w)
  assert int(state.num_skipped) == 0 and int(state.step) == 1
  chex.assert_trees_all_close(updates, -sum(grads) / K, rtol=1e-6, atol=1e-7)


def test_noise_counts_only_kept_micro_batches_of_positive_weight():
  """_transform.accumulate: a skipped NaN micro-batch counted, a weight-0
  micro-batch counted, a weight below 1 not counted, or |g / w|² computed
  otherwise."""
  w, batch = data()
  tx = jaxaccum.accumulate(optax.sgd(0.1), 5, noise_stats=True)
  state = tx.init(w)
  g1, g2 = (jax.grad(mse)(w, micro(batch, i)) for i in range(K))
  calls = [(g1, 2.0), (jnp.zeros(F), 0.0), (g2, 0.5), (jnp.full(F, jnp.nan), 1.0)]
  for grads, weight in calls:
    _, state = tx.update(grads, state, w, weight=weight)
  assert int(state.num_skipped) == 1 and int(state.micro_step) == 4
  assert float(state.noise.window.num_micro_batches) == 2.0
  want = jnp.sum((g1 / 2.0) ** 2) + jnp.sum((g2 / 0.5) ** 2)
  chex.assert_trees_all_close(state.noise.window.sq_norm, want, rtol=1e-6)


def test_each_window_measures_the_noise_of_its_own_micro_batches():
  """_transform.accumulate: |G_big|² of nothing, or the window sums not reset
  when a window ends; the second window's measurement must come from its own
  two gradients only."""
  w, batch = data()
  tx = jaxaccum.accumulate(optax.sgd(0.0), K, noise_stats=True)
  state = tx.init(w)
  grads = [jax.grad(mse)(w, micro(batch, i)) for i in range(K)]
  weights = (2.0, 3.0)
  for g in grads:  # the first window: plain gradients, weight 1
    _, state = tx.update(g, state, w)
  for g, weight in zip(grads[::-1], weights, strict=True):  # the second
    _, state = tx.update(g * weight, state, w, weight=weight)
  last = state.noise.last
  mean = (grads[1] * 2.0 + grads[0] * 3.0) / 5.0
  want = jaxaccum.GradientNoise(
    small_sq_norm=(jnp.sum(grads[1] ** 2) + jnp.sum(grads[0] ** 2)) / 2,
    big_sq_norm=jnp.sum(mean**2),
    b_small=jnp.float32(2.5),
    b_big=jnp.float32(5.0),
  )
  chex.assert_trees_all_close(last, want, rtol=1e-5)
  assert float(state.noise.window.num_micro_batches) == 0.0
  assert float(state.noise.window.sq_norm) == 0.0


def test_a_remat_policy_reaches_jax_checkpoint():
  """_engine.Engine.sums: the policy dropped (remat=policy treated as
  remat=True); the traced checkpoint carries the given policy."""
  w, batch = data()
  policy = jax.checkpoint_policies.everything_saveable
  step = jaxaccum.value_and_grad(mse, K, remat=policy)
  eqns = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      eqns.append(eqn)
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)

  walk(jax.make_jaxpr(step)(w, batch).jaxpr)
  policies = [e.params["policy"] for e in eqns if e.primitive.name == "remat2"]
  assert policies == [policy]
