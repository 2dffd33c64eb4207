"""accumulate(): cross-call accumulation as an optax transformation."""

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
