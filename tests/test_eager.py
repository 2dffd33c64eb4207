"""Eager calls compile once per configuration; Python keyword values are static."""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import jaxaccum


def make_problem(seed=0):
  keys = jax.random.split(jax.random.key(seed), 2)
  w = jax.random.normal(keys[0], (3,))
  x = jax.random.normal(keys[1], (16, 3))
  return w, (x, jnp.sin(x[:, 0]))


#: Traces of fun per compiled step at k > 1: on one micro-batch (the loop
#: reuses it) and at twice its rows, to read the loss's sums and its counts
#: of rows (jaxaccum/_exact.py); 1 at k = 1.
TRACED = 2


def counted(traces):
  def loss(w, batch, mode="mse", *, train=True, scale=1.0):
    traces.append((mode, train))
    x, y = batch
    err = x @ w - y
    if not train:  # a Python branch: needs a Python bool
      err = jax.lax.stop_gradient(err) + (err - jax.lax.stop_gradient(err))
    value = jnp.mean(err**2) if mode == "mse" else jnp.mean(jnp.abs(err))
    return scale * value

  return loss


def test_eager_calls_trace_once():
  traces = []
  fun = jaxaccum.value_and_grad(counted(traces), 4)
  for seed in range(5):
    w, batch = make_problem(seed)
    got = fun(w, batch)
    chex.assert_trees_all_close(
      got, jax.value_and_grad(counted([]))(w, batch), rtol=1e-5, atol=1e-6
    )
  assert len(traces) == TRACED  # one compile, reused


def test_python_keyword_and_positional_values_are_static():
  traces = []
  loss = counted(traces)
  fun = jaxaccum.value_and_grad(loss, 4)
  w, batch = make_problem()
  for _ in range(2):
    for mode in ("mse", "mae"):
      for train in (True, False):
        got = fun(w, batch, mode, train=train, scale=jnp.float32(2.0))
        want = jax.value_and_grad(
          lambda w, b, m=mode, t=train: loss(w, b, m, train=t, scale=2.0)
        )(w, batch)
        chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
  # One compile per static configuration; the array `scale` never retraces.
  n = len(traces) - 8  # the references traced once each
  assert n == 4 * TRACED, traces
  fun(w, batch, "mse", train=True, scale=jnp.float32(3.0))
  assert len(traces) == 8 + 4 * TRACED


def test_make_train_step_takes_python_keyword_flags():
  traces = []
  loss = counted(traces)
  tx = optax.sgd(0.1)
  step = jaxaccum.make_train_step(loss, tx, 4, donate=False)
  w, batch = make_problem()
  for train in (False, True, False):
    new_w, _, value = step(w, tx.init(w), batch, train=train)
    want_value, want_grads = jax.value_and_grad(counted([]))(w, batch)
    chex.assert_trees_all_close(value, want_value, rtol=1e-5)
    chex.assert_trees_all_close(new_w, w - 0.1 * want_grads, rtol=1e-5, atol=1e-6)
  assert [t for _, t in traces] == [False] * TRACED + [True] * TRACED
  # As with jax.jit(static_argnames=...): the compiled program takes the same
  # arguments minus the static ones.
  scale = jnp.float32(2.0)
  compiled = step.lower(w, tx.init(w), batch, train=False, scale=scale).compile()
  _, _, value = compiled(w, tx.init(w), batch, scale=scale)
  chex.assert_trees_all_close(value, 2 * want_value, rtol=1e-5)


def test_make_train_step_calls_with_and_without_keywords_keep_their_programs():
  """A call without keyword arguments finds its program by the number of
  arguments alone: one program per configuration still, whichever call
  comes first, and each call gets its own."""
  traces = []
  loss = counted(traces)
  tx = optax.sgd(0.1)
  step = jaxaccum.make_train_step(loss, tx, 4, donate=False)
  w, batch = make_problem()
  want_value, want_grads = jax.value_and_grad(counted([]))(w, batch)
  for kwargs in ({}, {"train": False}, {}, {"scale": jnp.float32(2.0)}, {}):
    new_w, _, value = step(w, tx.init(w), batch, **kwargs)
    scale = 2.0 if "scale" in kwargs else 1.0
    chex.assert_trees_all_close(value, scale * want_value, rtol=1e-5)
    chex.assert_trees_all_close(
      new_w, w - 0.1 * scale * want_grads, rtol=1e-5, atol=1e-6
    )
  # three programs (no keywords, train=False, the array scale), each traced
  # TRACED times when it is built, none again
  assert [t for _, t in traces] == [True] * TRACED + [False] * TRACED + [True] * TRACED


def test_verify_equivalence_passes_fun_kwargs():
  w, batch = make_problem()
  dev = jaxaccum.verify_equivalence(
    counted([]), (w, batch), 4, fun_kwargs={"train": False, "mode": "mae"}
  )
  assert dev.grads < 1e-5


def test_unhashable_keyword_values_compile_per_call():
  class Config:
    __hash__ = None  # type: ignore[assignment]
    power = 2

  def loss(w, batch, *, config):
    x, y = batch
    return jnp.mean((x @ w - y) ** config.power)

  w, batch = make_problem()
  got = jaxaccum.value_and_grad(loss, 2)(w, batch, config=Config())
  chex.assert_trees_all_close(
    got,
    jax.value_and_grad(lambda w, b: loss(w, b, config=Config()))(w, batch),
    rtol=1e-5,
  )


@pytest.mark.parametrize("k", [1, 4])
def test_under_an_outer_jit_nothing_is_cached(k):
  traces = []
  fun = jax.jit(jaxaccum.value_and_grad(counted(traces), k))
  w, batch = make_problem()
  fun(w, batch)
  fun(w, batch)
  assert len(traces) == (TRACED if k > 1 else 1)  # jit's own cache
