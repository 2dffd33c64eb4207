"""has_updated() and inner_step(): when did the optimizer step? (issue 12)

``TrainState.step`` and ``nnx.Optimizer.step`` count calls; the
AccumulateState, wherever it sits, knows the windows.
"""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import jaxaccum

K, M, F = 3, 4, 5


def params0():
  return {"w": jnp.linspace(-1.0, 1.0, F), "b": jnp.array(0.2)}


def grads_of(i):
  key = jax.random.fold_in(jax.random.key(0), i)
  return {"w": jax.random.normal(key, (F,)), "b": jnp.asarray(0.1 * i)}


def run(tx, n, make_grads=grads_of, **kwargs):
  """``n`` calls; has_updated and inner_step after each, read under jit."""
  params = params0()
  state = tx.init(params)

  @jax.jit
  def call(state, grads):
    _, state = tx.update(grads, state, params, **kwargs)
    return state, jaxaccum.has_updated(state), jaxaccum.inner_step(state)

  updated, steps = [], []
  for i in range(n):
    state, u, s = call(state, make_grads(i))
    assert u.dtype == jnp.bool_ and u.shape == ()
    assert s.dtype == jnp.int32 and s.shape == ()
    updated.append(bool(u))
    steps.append(int(s))
  return state, updated, steps


WRAPPERS = {
  "alone": lambda acc: acc,
  "chain": lambda acc: optax.chain(optax.clip_by_global_norm(1.0), acc),
  "inject_hyperparams": lambda acc: optax.inject_hyperparams(
    lambda learning_rate: optax.chain(optax.scale(learning_rate), acc)
  )(learning_rate=0.5),
  "partition": lambda acc: optax.partition(
    {"acc": acc, "frozen": optax.set_to_zero()},
    {"w": "acc", "b": "frozen"},
  ),
}


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_has_updated_on_the_call_that_ends_each_window(wrapper):
  tx = WRAPPERS[wrapper](jaxaccum.accumulate(optax.adam(0.1), K))
  _, updated, steps = run(tx, 2 * K + 1)
  assert updated == [False, False, True] * 2 + [False]
  assert steps == [0, 0, 1, 1, 1, 2, 2]


def test_a_window_that_was_not_applied_is_no_update():
  """All of the second window non-finite: it ends, but nothing runs."""

  def make_grads(i):
    g = grads_of(i)
    return jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), g) if K <= i < 2 * K else g

  state, updated, steps = run(jaxaccum.accumulate(optax.sgd(0.1), K), 3 * K, make_grads)
  assert updated == [False, False, True, False, False, False, False, False, True]
  assert steps == [0, 0, 1, 1, 1, 1, 1, 1, 2]
  assert int(state.num_skipped) == K


def test_flush_ends_a_window_early():
  tx = jaxaccum.accumulate(optax.sgd(0.1), K)
  params = params0()
  state = tx.init(params)
  _, state = tx.update(grads_of(0), state, params, flush=True)
  assert bool(jaxaccum.has_updated(state)) and int(jaxaccum.inner_step(state)) == 1


def test_has_updated_agrees_with_the_updates():
  """The updates are non-zero exactly when has_updated says so."""
  tx = jaxaccum.accumulate(optax.sgd(0.1), K)
  params = params0()
  state = tx.init(params)
  for i in range(2 * K):
    updates, state = tx.update(grads_of(i + 1), state, params)
    nonzero = any(bool(jnp.any(u != 0)) for u in jax.tree.leaves(updates))
    assert bool(jaxaccum.has_updated(state)) == nonzero, i


def test_no_accumulate_state_is_a_clear_error():
  state = optax.adam(0.1).init(params0())
  with pytest.raises(
    ValueError, match=r"found 0\. Is the optimizer built with jaxaccum\.accumulate"
  ):
    jaxaccum.has_updated(state)


def test_several_accumulate_states_are_a_clear_error():
  tx = optax.partition(
    {
      "a": jaxaccum.accumulate(optax.sgd(0.1), 2),
      "b": jaxaccum.accumulate(optax.sgd(0.1), 3),
    },
    {"w": "a", "b": "b"},
  )
  with pytest.raises(ValueError, match=r"found 2: opt_state.*inner_states.*'a'.*'b'"):
    jaxaccum.inner_step(tx.init(params0()))


# Flax: a Linen TrainState, and an nnx.Optimizer.
class Linear(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(1)(x)[:, 0]


def batches(n, seed=1):
  keys = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(keys[0], (n, M, F))
  y = jax.random.normal(keys[1], (n, M))
  rows = jnp.array([4, 1, 0, 3, 2, 4, 2])[:n]  # real rows per micro-batch
  return x, y, rows


def linen_loss_sum(params, x, y, rows):
  """The loss summed over a micro-batch's real rows (padding masked)."""
  err = (Linear().apply({"params": params}, x) - y) ** 2
  return jnp.sum(jnp.where(jnp.arange(M) < rows, err, 0.0))


def apply_gradients(state, grads, **kwargs):
  """TrainState.apply_gradients, forwarding ``kwargs`` to ``tx.update``.

  flax's own treats its keyword arguments as fields to ``replace``: it cannot
  pass ``weight=`` or ``flush=`` on.
  """
  updates, opt_state = state.tx.update(grads, state.opt_state, state.params, **kwargs)
  return state.replace(
    step=state.step + 1,
    params=optax.apply_updates(state.params, updates),
    opt_state=opt_state,
  )


@pytest.mark.slow
def test_train_state_recipe_passes_weight_through():
  """A Linen/TrainState loop with token weights: each window's update is
  the inner optimizer run on that window's exact token mean."""
  x, y, rows = batches(2 * K)
  inner = optax.adam(0.05)
  params = Linear().init(jax.random.key(0), x[0])["params"]
  state = train_state.TrainState.create(
    apply_fn=None, params=params, tx=jaxaccum.accumulate(inner, K)
  )

  # flax's apply_gradients does not forward keyword arguments to tx.update.
  grads = jax.grad(linen_loss_sum)(params, x[0], y[0], rows[0])
  with pytest.raises(TypeError, match="weight"):
    state.apply_gradients(grads=grads, weight=rows[0])

  @jax.jit
  def train_step(state, x, y, rows):
    grads = jax.grad(linen_loss_sum)(state.params, x, y, rows)
    return apply_gradients(state, grads, weight=rows.astype(jnp.float32))

  ref_params, ref_opt = params, inner.init(params)
  for w in range(2):
    for i in range(w * K, (w + 1) * K):
      state = train_step(state, x[i], y[i], rows[i])
      # The TrainState passed whole; its step counts calls.
      assert bool(jaxaccum.has_updated(state)) == (i % K == K - 1)
      assert int(state.step) == i + 1
    assert int(jaxaccum.inner_step(state)) == w + 1

    def window_mean(p, w=w):
      window = range(w * K, (w + 1) * K)
      total = sum(linen_loss_sum(p, x[i], y[i], rows[i]) for i in window)
      return total / jnp.sum(rows[w * K : (w + 1) * K])

    updates, ref_opt = inner.update(jax.grad(window_mean)(ref_params), ref_opt)
    ref_params = optax.apply_updates(ref_params, updates)
    chex.assert_trees_all_close(state.params, ref_params, rtol=1e-5, atol=1e-6)


class NnxLinear(nnx.Module):
  def __init__(self, rngs):
    self.dense = nnx.Linear(F, 1, rngs=rngs)

  def __call__(self, x):
    return self.dense(x)[:, 0]


def test_nnx_optimizer_forwards_weight_and_reports_windows():
  x, y, rows = batches(K)
  model = NnxLinear(nnx.Rngs(0))
  optimizer = nnx.Optimizer(
    model, jaxaccum.accumulate(optax.sgd(0.1), K), wrt=nnx.Param
  )
  reference = nnx.clone(model)

  def loss_sum(m, x, y, rows):
    return jnp.sum(jnp.where(jnp.arange(M) < rows, (m(x) - y) ** 2, 0.0))

  @nnx.jit
  def train_step(m, opt, x, y, rows):
    opt.update(m, nnx.grad(loss_sum)(m, x, y, rows), weight=rows.astype(jnp.float32))
    # The nnx.Optimizer whole, and its opt_state, both under jit.
    return jaxaccum.has_updated(opt), jaxaccum.inner_step(opt.opt_state)

  seen = [train_step(model, optimizer, x[i], y[i], rows[i]) for i in range(K)]
  assert [bool(u) for u, _ in seen] == [False] * (K - 1) + [True]
  assert [int(s) for _, s in seen] == [0] * (K - 1) + [1]
  assert int(optimizer.step[...]) == K  # calls, not windows

  def window_mean(m):
    return sum(loss_sum(m, x[i], y[i], rows[i]) for i in range(K)) / jnp.sum(rows)

  grads = nnx.grad(window_mean)(reference)
  want = jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(reference, nnx.Param), grads)
  chex.assert_trees_all_close(nnx.state(model, nnx.Param), want, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(bool(jaxaccum.has_updated(optimizer)), True)
