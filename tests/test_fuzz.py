"""Fuzzing bad input: every case ends in a clear error or a finite, correct result.

Never a silent NaN (a NaN where the full-batch reference has none) and never a
wrong shape or dtype.
"""

import collections
import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxaccum

SETTINGS = hypothesis.settings(
  deadline=None,
  derandomize=True,  # the same cases on every run, in CI too
  max_examples=30,
  suppress_health_check=[hypothesis.HealthCheck.too_slow],
)
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# Unit roundoff u: half the spacing of the dtype's numbers at 1.
UNIT_ROUNDOFF = {
  jnp.dtype(jnp.float32): 2.0**-24,
  jnp.dtype(jnp.bfloat16): 2.0**-8,
  jnp.dtype(jnp.float16): 2.0**-11,
}
# Roundings a per-row term goes through besides the sums: the cotangent's cast
# to the parameters' dtype and the products of the backward pass.
ROUNDINGS = 4

EQUAL = "finite and equal to the full batch"
ERROR = "clear error"
ZERO_WEIGHT = "zero total weight gives zeros"
NON_FINITE = "non-finite input reported"


def unit_roundoff(dtype):
  return UNIT_ROUNDOFF[jnp.dtype(dtype)]


@st.composite
def engine_cases(draw):
  """Shapes valid by construction (batch = k * m), with a few broken ones.

  Mostly k >= 2: k = 1 takes the engine's loop-free path, and only k >= 2
  exercises the accumulation this fuzz is for.
  """
  k = draw(st.sampled_from([1, 2, 2, 3, 3, 4, 4, 5]))
  m = draw(st.integers(1, 4))
  by_size = draw(st.booleans())
  broken = draw(st.sampled_from([None] * 21 + ["split", "nonpositive", "other_rows"]))
  if broken == "split":  # one row too many: divides by neither k >= 2 nor m >= 2
    k, m = (k, max(m, 2)) if by_size else (max(k, 2), m)
  rows = k * m + (broken == "split")
  split = draw(st.integers(-2, 0)) if broken == "nonpositive" else m if by_size else k
  normalize = draw(st.sampled_from(["mean", "sum", "weighted"]))
  return {
    "k": k,
    "m": m,
    "rows": rows,
    "other_rows": rows + 1 if broken == "other_rows" else rows,
    "by_size": by_size,
    "split": split,
    "broken": broken,
    "trailing": tuple(draw(st.lists(st.integers(1, 3), max_size=2))),
    "param_dtype": draw(st.sampled_from(DTYPES)),
    "normalize": normalize,
    "weights": draw(
      st.sampled_from(["ones", "random", "zero_micro_batch", "zero_rows", "all_zero"])
    )
    if normalize == "weighted"
    else "ones",
    "poison": draw(st.sampled_from([None] * 17 + ["nan_x", "inf_x", "nan_param"])),
    "seed": draw(st.integers(0, 2**16)),
  }


def expected_branch(case):
  """Where a case must end, decided from the case alone."""
  if case["broken"] is not None:
    return ERROR
  if case["weights"] == "all_zero":
    return ZERO_WEIGHT  # zeros by contract, whatever the data holds
  if case["poison"] is not None:
    return NON_FINITE
  return EQUAL


def build(case):
  """The parameters and the batch (numpy draws: no compilation per shape)."""
  rng = np.random.default_rng(case["seed"])
  rows, m = case["other_rows"], case["m"]
  x = rng.normal(size=(case["rows"], *case["trailing"], 3)).astype(np.float32)
  y = rng.normal(size=(rows, *case["trailing"])).astype(np.float32)
  w = rng.normal(size=3).astype(np.float32)
  weights = {
    "ones": np.ones(rows),
    "random": rng.uniform(0.0, 3.0, rows),
    "zero_micro_batch": rng.uniform(0.0, 3.0, rows),
    "zero_rows": np.arange(rows) % 2,
    "all_zero": np.zeros(rows),
  }[case["weights"]].astype(np.float32)
  if case["weights"] == "zero_micro_batch":
    start = rng.integers(max(rows // m, 1)) * m
    weights[start : start + m] = 0.0
  if case["poison"] == "nan_x":
    x[0] = np.nan
  elif case["poison"] == "inf_x":
    x[-1] = np.inf
  elif case["poison"] == "nan_param":
    w[1] = np.nan
  return jnp.asarray(w, case["param_dtype"]), jax.device_put((x, y, weights))


def per_row(w, batch):
  x, y, weights = batch
  err = (jnp.tanh(x.astype(w.dtype) @ w).astype(jnp.float32) - y) ** 2
  return jnp.mean(err.reshape(err.shape[0], -1), axis=1), weights


def fun_for(normalize):
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
  fun = fun_for(case["normalize"])
  if case["normalize"] != "weighted":
    return jax.jit(jax.value_and_grad(fun))(w, batch)

  def token_mean(w, batch):
    total, weight = fun(w, batch)
    return jnp.where(weight > 0, total / jnp.where(weight > 0, weight, 1.0), 0.0)

  return jax.jit(jax.value_and_grad(token_mean))(w, batch)


def tolerances(case, w, batch):
  """Worst-case bounds on |accumulated - full batch| for value and grads.

  Both are sums over the B = k * m rows of per-row terms. The full batch sums
  B terms; the accumulated step sums m per micro-batch and then k partial
  sums. A sum of n terms in a dtype of unit roundoff u is off by at most
  (n - 1) u times the sum of the terms' magnitudes (Higham, Accuracy and
  Stability of Numerical Algorithms, 2002, eq. 4.4), and each term carries
  ROUNDINGS more roundings. So each path is within (B + k + ROUNDINGS) u of
  the exact sum, measured in the terms' condition: how far a relative error
  u in each factor moves the term. For the loss (t - y)**2 with
  t = tanh(x @ w), rounding t by u|t| moves the term by 2|t||t - y| u, and
  the gradient term 2 (t - y)(1 - t**2) x by
  |t| |2 (1 - t**2) - 4 t (t - y)| |x| u (1 - t**2 cancels near |t| = 1).
  u is the parameters' dtype's: t and the backward pass are computed in it.
  """
  x, y, weights = (np.asarray(a, np.float64) for a in batch)
  x = x.astype(w.dtype).astype(np.float64)  # rounded as the loss sees it
  rows, u = x.shape[0], unit_roundoff(case["param_dtype"])
  coeff = {
    "mean": np.full(rows, 1.0 / rows),
    "sum": np.ones(rows),
    "weighted": weights / np.sum(weights),
  }[case["normalize"]]
  coeff = np.abs(coeff).reshape(rows, *[1] * len(case["trailing"])) / y[0].size
  t = np.tanh(x @ np.asarray(w, np.float64))
  d = t - y
  value_terms = coeff * (d**2 + 2 * np.abs(t * d))
  grad_terms = (
    coeff * (2 * np.abs(d * (1 - t**2)) + np.abs(t * (2 * (1 - t**2) - 4 * t * d)))
  )[..., None] * np.abs(x)
  bound = 2 * (rows + case["k"] + ROUNDINGS) * u  # two paths, each within it
  return (
    bound * np.sum(value_terms),
    bound * np.sum(grad_terms.reshape(-1, 3), axis=0),
  )


def check_case(case):
  """The fuzz's body: runs one case and returns the branch it ended in."""
  w, batch = build(case)
  fun = fun_for(case["normalize"])
  try:
    if case["by_size"]:
      grad_fn = jaxaccum.value_and_grad(
        fun, micro_batch_size=case["split"], normalize=case["normalize"]
      )
    else:
      grad_fn = jaxaccum.value_and_grad(fun, case["split"], normalize=case["normalize"])
    value, grads = jax.jit(grad_fn)(w, batch)
  except (ValueError, TypeError) as e:
    message = str(e)
    assert message, "an error must say what is wrong"
    assert case["broken"] is not None, f"unexpected error: {message}"
    sizes = (case["split"], case["rows"], case["other_rows"])
    assert any(str(n) in message for n in sizes), message
    return ERROR
  assert case["broken"] is None, "a broken case must raise"
  want_value, want_grads = reference(case, w, batch)
  assert grads.shape == w.shape and grads.dtype == want_grads.dtype == w.dtype
  assert value.shape == () and value.dtype == want_value.dtype
  if case["normalize"] == "weighted" and float(jnp.sum(batch[2])) == 0:
    # No weight at all: zeros by contract, whatever the data holds.
    assert float(value) == 0 and not jnp.any(grads)
    return ZERO_WEIGHT
  finite = bool(jnp.isfinite(want_value)) and bool(jnp.all(jnp.isfinite(want_grads)))
  if not finite:  # the user's data holds a NaN or Inf: it is reported, not hidden
    assert not (bool(jnp.isfinite(value)) and bool(jnp.all(jnp.isfinite(grads))))
    return NON_FINITE
  assert bool(jnp.isfinite(value)) and bool(jnp.all(jnp.isfinite(grads)))
  value_tol, grad_tol = tolerances(case, w, batch)
  err = np.abs(np.asarray(grads, np.float64) - np.asarray(want_grads, np.float64))
  assert np.all(err <= grad_tol), (err, grad_tol)
  assert abs(float(value) - float(want_value)) <= value_tol, (value, want_value)
  return EQUAL


def record(case, branch):
  """``hypothesis.event``s: what the fuzz reached (--hypothesis-show-statistics)."""
  hypothesis.event(branch)
  if branch == EQUAL:
    k = "k>=2" if case["k"] >= 2 else "k=1"
    hypothesis.event(f"equal, {k}")
    hypothesis.event(f"equal, {k}, {jnp.dtype(case['param_dtype']).name}")
    hypothesis.event(f"equal, normalize={case['normalize']}")
    if case["weights"] in ("zero_micro_batch", "zero_rows"):
      hypothesis.event(f"equal, weights {case['weights']}")


def low_precision_example(dtype, weights):
  return {
    "k": 3, "m": 2, "rows": 6, "other_rows": 6, "by_size": False, "split": 3,
    "broken": None, "trailing": (2,), "param_dtype": dtype, "normalize": "weighted",
    "weights": weights, "poison": None, "seed": 7,
  }  # fmt: skip


@pytest.mark.slow
@SETTINGS
@hypothesis.given(engine_cases())
@hypothesis.example(low_precision_example(jnp.bfloat16, "zero_micro_batch"))
@hypothesis.example(low_precision_example(jnp.float16, "random"))
@hypothesis.example(low_precision_example(jnp.float32, "all_zero"))
def test_value_and_grad_errors_clearly_or_is_right(case):
  branch = check_case(case)
  record(case, branch)
  assert branch == expected_branch(case), (branch, case)


def test_the_fuzz_mostly_compares_k_at_least_2_with_the_full_batch():
  """What the strategy feeds the fuzz above, counted over 300 cheap draws.

  The fuzz itself asserts that each case ends in ``expected_branch(case)``,
  so these counts are the branches it runs. Fails if the full-batch
  comparison stops seeing k >= 2 (a filter, a strategy that only draws
  k = 1), or stops seeing float16, bfloat16, weights that sum to zero, or a
  micro-batch of zero weight.
  """
  seen = collections.Counter()

  @hypothesis.settings(SETTINGS, max_examples=300, database=None)
  @hypothesis.given(engine_cases())
  def classify(case):
    branch = expected_branch(case)
    seen[branch] += 1
    if branch == EQUAL and case["k"] >= 2:
      seen["equal, k>=2"] += 1
      seen[f"equal, k>=2, {jnp.dtype(case['param_dtype']).name}"] += 1
      seen[f"equal, k>=2, weights {case['weights']}"] += 1

  classify()
  total = sum(seen[b] for b in (EQUAL, ERROR, ZERO_WEIGHT, NON_FINITE))
  assert total == 300
  assert seen["equal, k>=2"] > total / 2, seen
  for what in ("float16", "bfloat16"):
    assert seen[f"equal, k>=2, {what}"] >= 30, (what, seen)
  for what in ("weights zero_micro_batch", "weights zero_rows"):
    assert seen[f"equal, k>=2, {what}"] >= 3, (what, seen)
  for branch in (ERROR, ZERO_WEIGHT, NON_FINITE):
    assert seen[branch] >= 5, (branch, seen)


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


@pytest.mark.slow
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
  window_sum, window_abs, window_weight, count = np.zeros(3), np.zeros(3), 0.0, 0
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
      window_abs += np.abs(np.asarray(g, np.float64))
      window_weight += w_value
      count += 1
    if int(new_state.micro_step) == 0:  # the window ended
      if window_weight > 0:
        want = -0.1 * window_sum / window_weight
        # The float32 sum of `count` gradients is within count * 2**-24 of
        # the exact one, relative to the sum of magnitudes; the mean's cast to
        # the dtype and the -0.1 * mean in it are two roundings of u each.
        u = unit_roundoff(case["dtype"])
        tol = (2 * u + count * 2.0**-24) * 0.1 * window_abs / window_weight
        err = np.abs(np.asarray(updates, np.float64) - want)
        assert np.all(err <= tol + 1e-30), (err, tol, i)
      else:
        assert not np.any(np.asarray(updates))
      window_sum, window_abs, window_weight, count = np.zeros(3), np.zeros(3), 0.0, 0
    state = new_state
