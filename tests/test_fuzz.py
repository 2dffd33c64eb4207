"""Fuzzing bad input: every case ends in a clear error or a finite, correct result.

Never a silent NaN (a NaN where the full-batch reference has none) and never a
wrong shape or dtype.
"""

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxaccum

SETTINGS = hypothesis.settings(
  deadline=None,
  derandomize=True,  # the same cases on every run, in CI too
  max_examples=20,
  suppress_health_check=[hypothesis.HealthCheck.too_slow],
)
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def tolerance(dtype):
  return {jnp.float32: 1e-4, jnp.bfloat16: 5e-2, jnp.float16: 1e-2}[dtype]


@st.composite
def engine_cases(draw):
  rows = draw(st.integers(1, 12))
  return {
    "rows": rows,
    "other_rows": draw(st.sampled_from([rows] * 6 + [max(rows - 1, 1), rows + 2])),
    # Mostly sizes that split, sometimes anything at all.
    "k": draw(
      st.one_of(
        st.sampled_from([d for d in range(1, rows + 1) if rows % d == 0]),
        st.sampled_from([d for d in range(1, rows + 1) if rows % d == 0]),
        st.integers(-2, 13),
      )
    ),
    "by_size": draw(st.booleans()),
    "trailing": tuple(draw(st.lists(st.integers(1, 3), max_size=2))),
    "param_dtype": draw(st.sampled_from(DTYPES)),
    "normalize": draw(st.sampled_from(["mean", "sum", "weighted"])),
    "weights": draw(st.sampled_from(["ones", "some_zero", "all_zero", "random"])),
    "poison": draw(st.sampled_from([None] * 5 + ["nan_x", "inf_x", "nan_param"])),
    "seed": draw(st.integers(0, 2**16)),
  }


def build(case):
  keys = jax.random.split(jax.random.key(case["seed"]), 4)
  dtype = case["param_dtype"]
  x = jax.random.normal(keys[0], (case["rows"], *case["trailing"], 3))
  y = jax.random.normal(keys[1], (case["other_rows"], *case["trailing"]))
  w = jax.random.normal(keys[2], (3,)).astype(dtype)
  rows = case["other_rows"]
  weights = {
    "ones": jnp.ones(rows),
    "some_zero": (jnp.arange(rows) % 2).astype(jnp.float32),
    "all_zero": jnp.zeros(rows),
    "random": jax.random.uniform(keys[3], (rows,), maxval=3.0),
  }[case["weights"]]
  if case["poison"] == "nan_x":
    x = x.at[0].set(jnp.nan)
  elif case["poison"] == "inf_x":
    x = x.at[-1].set(jnp.inf)
  elif case["poison"] == "nan_param":
    w = w.at[1].set(jnp.nan)
  return w, (x, y, weights)


def per_row(w, batch):
  x, y, weights = batch
  err = (jnp.tanh(x.astype(w.dtype) @ w).astype(jnp.float32) - y) ** 2
  return jnp.mean(err.reshape(err.shape[0], -1), axis=1), weights


def fun_for(normalize, rows):
  def fun(w, batch):
    err, weights = per_row(w, batch)
    if normalize == "mean":
      return jnp.mean(err)
    if normalize == "sum":
      return jnp.sum(err)
    return jnp.sum(err * weights), jnp.sum(weights)

  return fun


def reference(case, w, batch):
  """Full-batch jax.value_and_grad of the same objective."""
  fun = fun_for(case["normalize"], case["rows"])
  if case["normalize"] != "weighted":
    return jax.value_and_grad(fun)(w, batch)

  def token_mean(w, batch):
    total, weight = fun(w, batch)
    return jnp.where(weight > 0, total / jnp.where(weight > 0, weight, 1.0), 0.0)

  return jax.value_and_grad(token_mean)(w, batch)


@SETTINGS
@hypothesis.given(engine_cases())
def test_value_and_grad_errors_clearly_or_is_right(case):
  w, batch = build(case)
  fun = fun_for(case["normalize"], case["rows"])
  k = case["k"]
  try:
    if case["by_size"]:
      grad_fn = jaxaccum.value_and_grad(
        fun, micro_batch_size=k, normalize=case["normalize"]
      )
    else:
      grad_fn = jaxaccum.value_and_grad(fun, k, normalize=case["normalize"])
    value, grads = jax.jit(grad_fn)(w, batch)
  except (ValueError, TypeError) as e:
    message = str(e)
    assert message, "an error must say what is wrong"
    bad_k = k <= 0 or case["rows"] % k != 0
    bad_rows = case["other_rows"] != case["rows"]
    assert bad_k or bad_rows, f"unexpected error: {message}"
    assert any(str(n) in message for n in (k, case["rows"], case["other_rows"])), (
      message
    )
    hypothesis.event("clear error")
    return
  assert k > 0 and case["rows"] % k == 0 and case["other_rows"] == case["rows"]
  want_value, want_grads = reference(case, w, batch)
  assert grads.shape == w.shape and grads.dtype == want_grads.dtype == w.dtype
  assert value.shape == () and value.dtype == want_value.dtype
  if case["normalize"] == "weighted" and float(jnp.sum(batch[2])) == 0:
    # No weight at all: zeros by contract, whatever the data holds.
    assert float(value) == 0 and not jnp.any(grads)
    hypothesis.event("zero total weight gives zeros")
    return
  finite = bool(jnp.isfinite(want_value)) and bool(jnp.all(jnp.isfinite(want_grads)))
  if not finite:  # the user's data holds a NaN or Inf: it is reported, not hidden
    assert not (bool(jnp.isfinite(value)) and bool(jnp.all(jnp.isfinite(grads))))
    hypothesis.event("non-finite input reported")
    return
  assert bool(jnp.isfinite(value)) and bool(jnp.all(jnp.isfinite(grads)))
  tol = tolerance(case["param_dtype"])
  scale = 1.0 + float(jnp.max(jnp.abs(want_grads.astype(jnp.float32))))
  np.testing.assert_allclose(
    np.asarray(grads, np.float32),
    np.asarray(want_grads, np.float32),
    atol=tol * scale,
    rtol=tol,
  )
  np.testing.assert_allclose(float(value), float(want_value), rtol=tol, atol=tol)
  hypothesis.event("finite and equal to the full batch")


@st.composite
def stream_cases(draw):
  n = draw(st.integers(1, 12))
  return {
    "every_k": draw(st.integers(1, 5)),
    "poison": draw(
      st.lists(
        st.sampled_from([None, None, None, "nan", "inf", "-inf"]),
        min_size=n,
        max_size=n,
      )
    ),
    "weights": draw(
      st.lists(
        st.sampled_from([None, 0.0, 1.0, 2.5, -1.0, float("nan")]),
        min_size=n,
        max_size=n,
      )
    ),
    "use_weights": draw(st.booleans()),
    "dtype": draw(st.sampled_from(DTYPES)),
    "seed": draw(st.integers(0, 2**16)),
  }


@functools.cache
def sgd_accumulate(every_k):
  """One transformation and one compiled update per window size."""
  tx = jaxaccum.accumulate(optax.sgd(0.1), every_k)
  return tx, jax.jit(tx.update)


@SETTINGS
@hypothesis.given(stream_cases())
def test_accumulate_never_lets_a_nan_reach_the_parameters(case):
  k = case["every_k"]
  tx, update = sgd_accumulate(k)
  params = jnp.ones(3, case["dtype"])
  state = tx.init(params)
  grads = jax.random.normal(
    jax.random.key(case["seed"]), (len(case["poison"]), 3)
  ).astype(case["dtype"])
  window_sum, window_weight = np.zeros(3), 0.0
  for i, (poison, weight) in enumerate(
    zip(case["poison"], case["weights"], strict=True)
  ):
    g = grads[i]
    if poison is not None:
      g = g.at[i % 3].set(float(poison))
    w = weight if case["use_weights"] else None
    updates, new_state = update(g, state, params, weight=w)
    params = optax.apply_updates(params, updates)
    assert np.all(np.isfinite(np.asarray(params, np.float32))), (i, case)
    assert np.all(np.isfinite(np.asarray(new_state.acc_grads)))
    assert updates.dtype == params.dtype and updates.shape == (3,)

    w_value = 1.0 if w is None else w
    valid = poison is None and np.isfinite(w_value) and w_value >= 0
    if valid:
      window_sum += np.asarray(g, np.float64)
      window_weight += w_value
    if int(new_state.micro_step) == 0:  # the window ended
      if window_weight > 0:
        want = -0.1 * window_sum / window_weight
        tol = tolerance(case["dtype"])
        np.testing.assert_allclose(
          np.asarray(updates, np.float64),
          want,
          rtol=tol,
          atol=tol * (1 + np.max(np.abs(want))),
        )
      else:
        assert not np.any(np.asarray(updates))
      window_sum, window_weight = np.zeros(3), 0.0
    state = new_state
