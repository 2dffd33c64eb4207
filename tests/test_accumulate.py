"""accumulate(): cross-call accumulation as an optax transformation."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxaccum

K, M, F = 4, 3, 5


def loss(w, batch):
  x, y = batch
  return jnp.mean((jnp.tanh(x @ w["a"]) + w["b"] - y) ** 2)


def data(windows=3, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  params = {"a": jax.random.normal(keys[0], (F,)), "b": jnp.array(0.1)}
  x = jax.random.normal(keys[1], (windows, K * M, F))
  y = jax.random.normal(keys[2], (windows, K * M))
  return params, x, y


def micro(x, y, i):
  return x[i * M : (i + 1) * M], y[i * M : (i + 1) * M]


@pytest.mark.slow
def test_k_calls_equal_one_accumulated_step_then_inner_update():
  params, x, y = data()
  inner = optax.adam(1e-2)

  # In-step: one value_and_grad over k micro-batches, then inner.update.
  ref_params, ref_state = params, inner.init(params)
  step = jax.jit(jaxaccum.grad(loss, K))
  for w in range(x.shape[0]):
    updates, ref_state = inner.update(step(ref_params, (x[w], y[w])), ref_state)
    ref_params = optax.apply_updates(ref_params, updates)

  # Cross-step: accumulate(inner, k) fed one micro-batch per call.
  tx = jaxaccum.accumulate(inner, K)
  state = tx.init(params)
  update = jax.jit(tx.update)
  for w in range(x.shape[0]):
    for i in range(K):
      grads = jax.grad(loss)(params, micro(x[w], y[w], i))
      updates, state = update(grads, state, params)
      params = optax.apply_updates(params, updates)
      if i < K - 1:
        assert all(not np.any(u) for u in jax.tree.leaves(updates))
  chex.assert_trees_all_close(params, ref_params, rtol=1e-5, atol=1e-6)
  assert int(state.step) == x.shape[0]
  assert int(state.micro_step) == 0


def counting(inner, calls):
  """Wraps ``inner`` so every executed ``update`` appends to ``calls``."""

  def update(updates, state, params=None):
    jax.debug.callback(lambda: calls.append(1))
    return inner.update(updates, state, params)

  return optax.GradientTransformation(inner.init, update)


def test_inner_update_runs_once_per_window():
  params, x, y = data()
  calls = []
  tx = jaxaccum.accumulate(counting(optax.sgd(0.1), calls), K)
  state = tx.init(params)
  update = jax.jit(tx.update)
  for i in range(3 * K):
    grads = jax.grad(loss)(params, micro(x[0], y[0], i % K))
    _, state = update(grads, state, params)
  jax.effects_barrier()
  assert len(calls) == 3
  assert int(state.step) == 3


def test_optax_multisteps_runs_inner_every_micro_step():
  """The contrast that motivates accumulate(): MultiSteps runs inner k times."""
  params, x, y = data()
  calls = []
  tx = optax.MultiSteps(counting(optax.sgd(0.1), calls), K)
  state = tx.init(params)
  update = jax.jit(tx.update)
  for i in range(K):
    _, state = update(jax.grad(loss)(params, micro(x[0], y[0], i)), state, params)
  jax.effects_barrier()
  assert len(calls) == K


def test_nan_micro_batch_is_skipped_and_counted():
  params, x, y = data()
  tx = jaxaccum.accumulate(optax.sgd(1.0), K)
  state = tx.init(params)
  update = jax.jit(tx.update)
  good = [jax.grad(loss)(params, micro(x[0], y[0], i)) for i in range(K)]
  bad = jax.tree.map(lambda g: jnp.full_like(g, jnp.nan), good[0])
  bad["a"] = good[0]["a"].at[2].set(jnp.inf)
  for i, grads in enumerate([good[0], bad, good[2], good[3]]):
    updates, state = update(grads, state, params)
    for leaf in jax.tree.leaves((state.acc_grads, updates)):
      assert np.all(np.isfinite(leaf)), i
  new_params = optax.apply_updates(params, updates)
  assert all(np.all(np.isfinite(p)) for p in jax.tree.leaves(new_params))
  assert int(state.num_skipped) == 1
  # The window is normalized by the three micro-batches that were kept.
  want = jax.tree.map(lambda a, b, c: -(a + b + c) / 3, good[0], good[2], good[3])
  chex.assert_trees_all_close(updates, want, rtol=1e-6)


def test_window_of_only_nan_applies_nothing():
  params, _, _ = data()
  tx = jaxaccum.accumulate(optax.adam(1.0), 2)
  state = tx.init(params)
  nan = jax.tree.map(lambda p: jnp.full_like(p, jnp.nan), params)
  for _ in range(2):
    updates, state = tx.update(nan, state, params)
  assert all(not np.any(u) for u in jax.tree.leaves(updates))
  assert int(state.step) == 0 and int(state.num_skipped) == 2
  chex.assert_trees_all_equal(state.inner_state, tx.init(params).inner_state)


def test_weighted_updates_are_the_window_token_mean():
  """grads of loss sums plus weight= give sum(g) / sum(w) over the window."""
  params, x, y = data()
  tokens = jnp.array([3.0, 0.0, 1.0, 2.0])  # real rows per micro-batch

  def loss_sum(w, batch, n):
    xs, ys = batch
    rows = jnp.arange(M) < n
    err = (jnp.tanh(xs @ w["a"]) + w["b"] - ys) ** 2
    return jnp.sum(jnp.where(rows, err, 0.0))

  tx = jaxaccum.accumulate(optax.sgd(1.0), K)
  state = tx.init(params)
  for i in range(K):
    g = jax.grad(loss_sum)(params, micro(x[0], y[0], i), tokens[i])
    updates, state = tx.update(g, state, params, weight=tokens[i])

  def window_mean(w):
    total = sum(loss_sum(w, micro(x[0], y[0], i), tokens[i]) for i in range(K))
    return total / jnp.sum(tokens)

  want = jax.tree.map(jnp.negative, jax.grad(window_mean)(params))
  chex.assert_trees_all_close(updates, want, rtol=1e-5, atol=1e-7)


def test_every_k_schedule():
  params, x, y = data()
  tx = jaxaccum.accumulate(
    optax.sgd(0.1), every_k=lambda step: jnp.where(step < 2, 2, 4)
  )
  state = tx.init(params)
  update = jax.jit(tx.update)
  applied = []
  for i in range(12):
    grads = jax.grad(loss)(params, micro(x[0], y[0], i % K))
    _, new_state = update(grads, state, params)
    applied.append(int(new_state.step) > int(state.step))
    state = new_state
  # Windows of 2, 2, then 4, 4.
  assert [i + 1 for i, a in enumerate(applied) if a] == [2, 4, 8, 12]


def test_inside_optax_chain_with_extra_args():
  params, x, y = data()
  tx = optax.chain(
    optax.clip_by_global_norm(1.0), jaxaccum.accumulate(optax.adam(1e-2), 2)
  )
  state = tx.init(params)
  for i in range(2):
    grads = jax.grad(loss)(params, micro(x[0], y[0], i))
    updates, state = tx.update(grads, state, params, weight=1.0)
  assert any(np.any(u) for u in jax.tree.leaves(updates))
  assert int(state[1].step) == 1


class Linear(nnx.Module):
  def __init__(self, rngs):
    self.dense = nnx.Linear(F, 1, rngs=rngs)

  def __call__(self, x):
    return self.dense(x)[:, 0]


def test_with_flax_nnx_optimizer():
  _, x, y = data()
  model = Linear(nnx.Rngs(0))
  reference = Linear(nnx.Rngs(0))
  optimizer = nnx.Optimizer(
    model, jaxaccum.accumulate(optax.adam(1e-2), K), wrt=nnx.Param
  )
  ref_optimizer = nnx.Optimizer(reference, optax.adam(1e-2), wrt=nnx.Param)

  def model_loss(m, xs, ys):
    return jnp.mean((m(xs) - ys) ** 2)

  @nnx.jit
  def train_step(m, opt, xs, ys):
    opt.update(m, nnx.grad(model_loss)(m, xs, ys))

  for w in range(2):
    for i in range(K):
      train_step(model, optimizer, *micro(x[w], y[w], i))
    train_step(reference, ref_optimizer, x[w], y[w])
  chex.assert_trees_all_close(
    nnx.state(model, nnx.Param),
    nnx.state(reference, nnx.Param),
    rtol=1e-5,
    atol=1e-6,
  )
  assert int(optimizer.opt_state.step[...]) == 2


@pytest.mark.parametrize(
  ("every_k", "error"), [(0, ValueError), (-2, ValueError), (2.5, TypeError)]
)
def test_bad_every_k(every_k, error):
  with pytest.raises(error, match="every_k"):
    jaxaccum.accumulate(optax.sgd(0.1), every_k)


def test_bf16_grads_accumulate_in_float32():
  params = jnp.ones(3, jnp.bfloat16)
  tx = jaxaccum.accumulate(optax.sgd(1.0), 256)
  state = tx.init(params)
  assert state.acc_grads.dtype == jnp.float32
  update = jax.jit(tx.update)
  g = jnp.full(3, 1.0 + 2.0**-6, jnp.bfloat16)  # representable in bf16
  for _ in range(256):
    updates, state = update(g, state, params)
  assert updates.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(updates, np.float32), -(1.0 + 2.0**-6))


def window_grads(params, x, y, w=0):
  return [jax.grad(loss)(params, micro(x[w], y[w], i)) for i in range(K)]


def mean_of(grads):
  return jax.tree.map(lambda *gs: sum(gs) / len(gs), *grads)


PARAM_READERS = {
  "adamw": lambda: optax.adamw(0.1, weight_decay=0.5),
  "add_decayed_weights": lambda: optax.chain(
    optax.add_decayed_weights(0.5), optax.sgd(0.1)
  ),
  # Decay only the matrices, a mask built from the parameters.
  "masked_decay": lambda: optax.chain(
    optax.masked(
      optax.add_decayed_weights(0.5),
      lambda p: jax.tree.map(lambda x: jnp.ndim(x) > 0, p),
    ),
    optax.sgd(0.1),
  ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", PARAM_READERS)
def test_inner_optimizer_sees_the_params(name):
  """accumulate() passes ``params`` to an inner optimizer that reads them
  (weight decay): each window's update is that of the inner optimizer run on
  the window mean with the same params."""
  params, x, y = data(windows=2)
  inner = PARAM_READERS[name]()
  tx = jaxaccum.accumulate(inner, K)
  state, ref_state = tx.init(params), inner.init(params)
  ref_params = params
  update = jax.jit(tx.update)
  for w in range(2):
    grads = window_grads(params, x, y, w)
    for g in grads:
      updates, state = update(g, state, params)
    ref_updates, ref_state = inner.update(mean_of(grads), ref_state, ref_params)
    chex.assert_trees_all_close(updates, ref_updates, rtol=1e-5, atol=1e-7)
    params = optax.apply_updates(params, updates)
    ref_params = optax.apply_updates(ref_params, ref_updates)
  # The decay is a visible part of the update: without params it would differ.
  decay_free = inner.update(
    mean_of(grads), ref_state, jax.tree.map(jnp.zeros_like, params)
  )
  assert not np.allclose(decay_free[0]["a"], ref_updates["a"])


def test_extra_arguments_reach_the_inner_optimizer():
  """``value=`` reaches optax.contrib.reduce_on_plateau: with window losses
  that stop improving, the scale drops after the patience runs out, on the
  same windows as with reduce_on_plateau run directly on them."""
  params, x, y = data(windows=5)
  inner = optax.chain(
    optax.sgd(0.1),
    optax.contrib.reduce_on_plateau(patience=1, factor=0.5, cooldown=0),
  )
  tx = jaxaccum.accumulate(inner, K)
  state, ref_state = tx.init(params), inner.init(params)
  update = jax.jit(tx.update)
  window_losses = [3.0, 2.0, 2.0, 2.0, 2.0]  # a plateau from window 2 on
  scales, ref_scales = [], []
  for w, value in enumerate(window_losses):
    grads = window_grads(params, x, y, w)
    for g in grads:
      updates, state = update(g, state, params, value=jnp.asarray(value))
    ref_updates, ref_state = inner.update(
      mean_of(grads), ref_state, params, value=jnp.asarray(value)
    )
    chex.assert_trees_all_close(updates, ref_updates, rtol=1e-5, atol=1e-7)
    scales.append(float(state.inner_state[1].scale))
    ref_scales.append(float(ref_state[1].scale))
  assert scales == ref_scales
  assert scales[0] == 1.0 and scales[-1] < 1.0


# The tests below were written for mutants that survived mutmut (issue 13),
# each watched failing on them; the comment above each names the mutated
# function. They use a smaller problem: one weight vector of SMALL_F
# features, and SMALL_K micro-batches of SMALL_M rows.

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


def weak_counter():
  """An inner transformation whose init makes a weak-typed leaf."""

  def update(updates, state, params=None):
    del params
    return updates, {"n": state["n"] + 1}

  return optax.GradientTransformation(lambda params: {"n": jnp.asarray(0)}, update)


def avals(tree):
  return jax.tree.map(jax.typeof, tree)


# mutmut: _accumulate._scalar, _tree.cast_like, _accumulate.accumulate
@pytest.mark.parametrize("inner", ["sgd", "weak_counter"])
def test_accumulate_state_is_strongly_typed_and_updates_keep_its_types(inner):
  """_accumulate._scalar: weak-typed fields; _tree.cast_like: an inner
  state leaf left weak; _accumulate.accumulate: micro_step, step and
  num_skipped not int32."""
  w, batch = small_problem()
  tx = jaxaccum.accumulate(
    optax.sgd(0.1) if inner == "sgd" else weak_counter(), SMALL_K
  )
  state = tx.init(w)
  assert not any(jax.typeof(x).weak_type for x in jax.tree.leaves(state))
  assert state.micro_step.dtype == state.step.dtype == jnp.int32
  assert state.num_skipped.dtype == jnp.int32 and state.acc_weight.dtype == jnp.float32
  grads = jax.grad(mse)(w, batch)
  for _ in range(SMALL_K):  # a window: both branches of the lax.cond
    _, new_state = jax.jit(tx.update)(grads, state, w)
    assert avals(new_state) == avals(state)
    state = new_state


# mutmut: _tree.cast_like
def test_float32_gradients_on_bfloat16_params_keep_the_inner_state_dtypes():
  """_tree.cast_like: adam's promoted moments not cast back."""
  w, batch = small_problem()
  w16 = w.astype(jnp.bfloat16)
  inner = optax.adam(0.1)
  tx = jaxaccum.accumulate(inner, SMALL_K)
  state = tx.init(w16)
  grads = [jax.grad(mse)(w, small_micro(batch, i)) for i in range(SMALL_K)]  # float32
  for g in grads:
    updates, state = tx.update(g, state, w16)

  want, want_state = inner.update(sum(grads) / SMALL_K, inner.init(w16), w16)
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


# mutmut: _accumulate._inner_init
def test_inner_state_takes_the_dtypes_of_one_inner_update():
  """_accumulate._inner_init: the inner state keeps inner.init's dtypes where
  one update changes them."""
  w, batch = small_problem()
  w16 = w.astype(jnp.bfloat16)
  inner = promoting_ema()
  _, after = inner.update(jax.grad(mse)(w16, batch), inner.init(w16), w16)
  assert inner.init(w16)["ema"].dtype == jnp.bfloat16  # the premise
  assert after["ema"].dtype == jnp.float32
  tx = jaxaccum.accumulate(inner, SMALL_K)
  state = tx.init(w16)
  chex.assert_trees_all_equal_dtypes(state.inner_state, after)
  grads = [jax.grad(mse)(w16, small_micro(batch, i)) for i in range(SMALL_K)]
  for g in grads:
    updates, state = tx.update(g, state, w16)
  want, want_state = inner.update(sum(grads) / SMALL_K, inner.init(w16), w16)
  chex.assert_trees_all_equal_dtypes(state.inner_state, want_state)
  chex.assert_trees_all_close(
    (updates, state.inner_state), (want, want_state), rtol=1e-2, atol=1e-3
  )


# mutmut: _accumulate._window_size
def test_window_schedule_values_are_clamped_and_truncated_to_ints():
  """_accumulate._window_size: a float window size kept, or clamped to 2, not
  1."""
  w, batch = small_problem()
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


# mutmut: _noise.no_estimate, _accumulate.accumulate
@pytest.mark.parametrize("noise_stats", [False, True])
def test_noise_before_the_first_window_is_no_estimate(noise_stats):
  """_noise.no_estimate: ones instead of zeros; _accumulate.accumulate:
  window sums that do not start at 0."""
  w, _ = small_problem()
  tx = jaxaccum.accumulate(optax.sgd(0.1), SMALL_K, noise_stats=noise_stats)
  state = tx.init(w)
  chex.assert_trees_all_equal(state.noise, jax.tree.map(jnp.zeros_like, state.noise))
  assert not bool(state.noise.last.has_estimate())


# mutmut: _accumulate.accumulate
def test_accumulate_without_noise_stats_measures_nothing():
  """_accumulate.accumulate: noise_stats on by default."""
  w, batch = small_problem()
  tx = jaxaccum.accumulate(optax.sgd(0.1), SMALL_K)
  state = tx.init(w)
  for i in range(SMALL_K):
    _, state = tx.update(jax.grad(mse)(w, small_micro(batch, i)), state, w)
  assert int(state.step) == 1
  chex.assert_trees_all_equal(state.noise, jax.tree.map(jnp.zeros_like, state.noise))


# mutmut: _accumulate.accumulate, _normalize.check_accum_dtype
def test_accumulate_with_an_integer_accum_dtype_is_a_clear_error():
  """_accumulate.accumulate: the accum_dtype check (_normalize.check_accum_dtype)
  skipped, or its message."""
  with pytest.raises(
    ValueError, match=r"^accum_dtype must be a floating dtype, got int32\.$"
  ):
    jaxaccum.accumulate(optax.sgd(0.1), SMALL_K, accum_dtype=jnp.int32)


# mutmut: _accumulate.accumulate
def test_accumulator_has_the_accum_dtype():
  """_accumulate.accumulate: a float32 accumulator whatever accum_dtype says."""
  w, batch = small_problem()
  w16 = w.astype(jnp.float16)
  tx = jaxaccum.accumulate(optax.sgd(0.1), SMALL_K, accum_dtype=jnp.float16)
  state = tx.init(w16)
  assert state.acc_grads.dtype == jnp.float16
  g = jax.grad(mse)(w16, small_micro(batch, 0))
  _, state = tx.update(g, state, w16)
  assert state.acc_grads.dtype == jnp.float16
  np.testing.assert_array_equal(state.acc_grads, g)


# mutmut: _accumulate.accumulate
def test_a_fresh_state_has_not_updated():
  """_accumulate.accumulate: ``updated`` starts True."""
  w, _ = small_problem()
  state = jaxaccum.accumulate(optax.sgd(0.1), SMALL_K).init(w)
  assert not bool(jaxaccum.has_updated(state))
  assert state.updated.dtype == jnp.bool_


# mutmut: _accumulate.accumulate
@pytest.mark.parametrize("case", ["weight", "structure", "shape"])
def test_accumulate_update_errors_name_what_is_wrong(case):
  """_accumulate.accumulate: the weight, structure and shape messages."""
  w, batch = small_problem()
  tx = jaxaccum.accumulate(optax.sgd(0.1), SMALL_K)
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


# mutmut: _accumulate.accumulate
def test_zero_and_fractional_weights_are_not_skipped():
  """_accumulate.accumulate: a weight of 0, or below 1, skipped."""
  w, batch = small_problem()
  tx = jaxaccum.accumulate(optax.sgd(1.0), 3)
  state = tx.init(w)
  grads = [jax.grad(mse)(w, small_micro(batch, i)) for i in range(SMALL_K)] + [
    jnp.ones(SMALL_F)
  ]
  for g, weight in zip(grads, [0.5, 2.0, 0.0], strict=True):
    updates, state = tx.update(g, state, w, weight=weight)
  assert int(state.num_skipped) == 0 and int(state.step) == 1
  want = -(grads[0] + grads[1] + grads[2]) / 2.5
  chex.assert_trees_all_close(updates, want, rtol=1e-6, atol=1e-7)


# mutmut: _accumulate.accumulate
@pytest.mark.parametrize("nan", [False, True])
def test_without_skip_nonfinite_every_gradient_is_accumulated(nan):
  """_accumulate.accumulate with skip_nonfinite=False: a NaN still skipped, or
  nothing accumulated."""
  w, batch = small_problem()
  tx = jaxaccum.accumulate(optax.sgd(1.0), SMALL_K, skip_nonfinite=False)
  state = tx.init(w)
  grads = [jax.grad(mse)(w, small_micro(batch, i)) for i in range(SMALL_K)]
  if nan:
    grads[0] = grads[0].at[0].set(jnp.nan)
  for g in grads:
    updates, state = tx.update(g, state, w)
  assert int(state.num_skipped) == 0 and int(state.step) == 1
  chex.assert_trees_all_close(updates, -sum(grads) / SMALL_K, rtol=1e-6, atol=1e-7)


# mutmut: _accumulate.accumulate
def test_noise_counts_only_kept_micro_batches_of_positive_weight():
  """_accumulate.accumulate: a skipped NaN micro-batch counted, a weight-0
  micro-batch counted, a weight below 1 not counted, or |g / w|² computed
  otherwise."""
  w, batch = small_problem()
  tx = jaxaccum.accumulate(optax.sgd(0.1), 5, noise_stats=True)
  state = tx.init(w)
  g1, g2 = (jax.grad(mse)(w, small_micro(batch, i)) for i in range(SMALL_K))
  calls = [
    (g1, 2.0),
    (jnp.zeros(SMALL_F), 0.0),
    (g2, 0.5),
    (jnp.full(SMALL_F, jnp.nan), 1.0),
  ]
  for grads, weight in calls:
    _, state = tx.update(grads, state, w, weight=weight)
  assert int(state.num_skipped) == 1 and int(state.micro_step) == 4
  assert float(state.noise.window.num_micro_batches) == 2.0
  want = jnp.sum((g1 / 2.0) ** 2) + jnp.sum((g2 / 0.5) ** 2)
  chex.assert_trees_all_close(state.noise.window.sq_norm, want, rtol=1e-6)


# mutmut: _accumulate.accumulate
def test_each_window_measures_the_noise_of_its_own_micro_batches():
  """_accumulate.accumulate: |G_big|² of nothing, or the window sums not reset
  when a window ends; the second window's measurement must come from its own
  two gradients only."""
  w, batch = small_problem()
  tx = jaxaccum.accumulate(optax.sgd(0.0), SMALL_K, noise_stats=True)
  state = tx.init(w)
  grads = [jax.grad(mse)(w, small_micro(batch, i)) for i in range(SMALL_K)]
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
