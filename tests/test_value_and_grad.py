"""Accumulated value and gradients equal full-batch ``jax.value_and_grad``."""

import warnings

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxaccum

# The unit roundoff u of float32: half the spacing of its numbers at 1.
U = float(jnp.finfo(jnp.float32).eps) / 2
# Roundings an element goes through besides the sums: tanh (XLA's
# approximation is off by a few ulps, and differently from one jax release to
# the next), the products of the chain rule and the mean's division.
ROUNDINGS = 4
FEATURES, HIDDEN = 5, 7


def mlp_loss(params, batch):
  x, y = batch
  h = jnp.tanh(x @ params["w1"] + params["b1"][None, :])
  return jnp.mean((h @ params["w2"] - y) ** 2)


def make_problem(batch_size=16, features=FEATURES, hidden=HIDDEN, seed=0):
  keys = jax.random.split(jax.random.key(seed), 5)
  params = {
    "w1": jax.random.normal(keys[0], (features, hidden)),
    "b1": jax.random.normal(keys[1], (hidden,)),
    "w2": jax.random.normal(keys[2], (hidden,)),
  }
  x = jax.random.normal(keys[3], (batch_size, features))
  y = jax.random.normal(keys[4], (batch_size,))
  return params, (x, y)


def summed_terms(rows, features=FEATURES, hidden=HIDDEN):
  """How many roundings an element of the MLP's value or gradient collects:
  the sum over the batch's rows (the accumulated path sums m rows, then k
  partial sums: fewer), the dot products over the features and the hidden
  units, and ROUNDINGS more."""
  return rows + features + hidden + ROUNDINGS


def assert_close(got, want, terms):
  """Each leaf of ``got`` within ``2 * terms * u`` of the largest magnitude
  in that leaf of ``want``, and of its shape and dtype.

  A sum of n terms in float32 is off by at most (n - 1) u times the sum of
  their magnitudes (Higham, Accuracy and Stability of Numerical Algorithms,
  2002, eq. 4.4), and the accumulated and the full-batch paths each round so:
  hence the 2. The leaf's largest magnitude stands for the size of its terms
  (tests/test_fuzz.py bounds them from the terms themselves), so an element
  that cancels to almost nothing, such as the gradient through a saturated
  tanh, may be off relative to itself, not relative to its leaf. A wrong
  normalization (a factor 1/k, a micro-batch missing) is off by a sizable
  fraction of the leaf: orders of magnitude beyond this.
  """
  chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
  paths_and_wants, _ = jax.tree_util.tree_flatten_with_path(want)
  for (path, want_leaf), got_leaf in zip(
    paths_and_wants, jax.tree.leaves(got), strict=True
  ):
    w = np.asarray(want_leaf, np.float64)
    atol = 2 * terms * U * np.max(np.abs(w))
    np.testing.assert_allclose(
      np.asarray(got_leaf, np.float64),
      w,
      rtol=0,
      atol=atol,
      err_msg=jax.tree_util.keystr(path),
    )


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2, 4, 8, 16])
def test_matches_full_batch(k):
  params, batch = make_problem(batch_size=16)
  got = jax.jit(jaxaccum.value_and_grad(mlp_loss, num_micro_batches=k))(params, batch)
  assert_close(got, jax.value_and_grad(mlp_loss)(params, batch), summed_terms(16))


@pytest.mark.slow
@pytest.mark.parametrize("m", [1, 3, 6, 12])
def test_micro_batch_size_path(m):
  params, batch = make_problem(batch_size=12)
  got = jaxaccum.value_and_grad(mlp_loss, micro_batch_size=m)(params, batch)
  assert_close(got, jax.value_and_grad(mlp_loss)(params, batch), summed_terms(12))


def test_sum_mode():
  params, batch = make_problem(batch_size=12)

  def sum_loss(p, b):
    return mlp_loss(p, b) * b[0].shape[0]

  got = jaxaccum.value_and_grad(sum_loss, 3, normalize="sum")(params, batch)
  assert_close(got, jax.value_and_grad(sum_loss)(params, batch), summed_terms(12))


def test_tuple_argnums_and_several_batch_args():
  params, (x, y) = make_problem(batch_size=8)
  scale = jnp.array(1.5)

  def loss(p, s, xs, ys, offset):
    h = jnp.tanh(xs @ p["w1"] + p["b1"][None, :])
    return jnp.mean((s * h @ p["w2"] + offset - ys) ** 2)

  offset = jnp.array(0.25)
  args = (params, scale, x, y, offset)
  got = jaxaccum.value_and_grad(loss, 4, argnums=(0, 1), batch_argnums=(2, 3))(*args)
  want = jax.value_and_grad(loss, argnums=(0, 1))(*args)
  assert_close(got, want, summed_terms(8))
  assert isinstance(got[1], tuple) and len(got[1]) == 2


def test_dict_batch_with_aux_and_kwargs():
  params, (x, y) = make_problem(batch_size=8)

  def loss(p, batch, *, temperature):
    h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"][None, :])
    err = (h @ p["w2"] - batch["y"]) / temperature
    return jnp.mean(err**2), {"max_err": jnp.max(jnp.abs(err))}

  batch = {"x": x, "y": y}
  # A max over rows is neither rows nor a mean: it is taken stacked.
  (value, aux), grads = jaxaccum.value_and_grad(loss, 4, has_aux=True, aux="stack")(
    params, batch, temperature=2.0
  )
  (want_value, _), want_grads = jax.value_and_grad(loss, has_aux=True)(
    params, batch, temperature=2.0
  )
  assert_close((value, grads), (want_value, want_grads), summed_terms(8))
  # Stacked per micro-batch: each entry is that micro-batch's aux.
  assert aux["max_err"].shape == (4,)
  for i in range(4):
    micro = jax.tree.map(lambda a, i=i: a[2 * i : 2 * i + 2], batch)
    _, want_aux = loss(params, micro, temperature=2.0)
    # One micro-batch's forward pass: no sum over rows.
    assert_close(aux["max_err"][i], want_aux["max_err"], summed_terms(0))


def test_grad_matches_jax_grad():
  params, batch = make_problem(batch_size=8)
  want = jax.grad(mlp_loss)(params, batch)
  assert_close(jaxaccum.grad(mlp_loss, 2)(params, batch), want, summed_terms(8))
  grads, aux = jaxaccum.grad(
    lambda p, b: (mlp_loss(p, b), jnp.ones(())), 2, has_aux=True
  )(params, batch)
  assert_close(grads, want, summed_terms(8))
  np.testing.assert_array_equal(aux, jnp.ones(2))


def test_python_and_numpy_parameter_leaves_like_jax():
  """Leaves that are Python floats or numpy float64 arrays (x64 off) get the
  grads jax.value_and_grad gives: float32, and no dtype warnings."""
  params, batch = make_problem(batch_size=8)
  params = {**params, "w2": np.asarray(params["w2"], np.float64)}

  def loss(p, batch):
    return p["scale"] * mlp_loss({n: v for n, v in p.items() if n != "scale"}, batch)

  params["scale"] = 2.0
  want = jax.value_and_grad(loss)(params, batch)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    got = jaxaccum.value_and_grad(loss, 4)(params, batch)
  # The scale multiplies the loss: one rounding more.
  assert_close(got, want, summed_terms(8) + 1)


def test_order_is_contiguous_rows():
  """Micro-batch i holds rows i*m .. (i+1)*m-1 (DESIGN's fixed split order)."""

  def first_row(w, x):
    return w * jnp.sum(x), x[:, 0]

  (_, aux), _ = jaxaccum.value_and_grad(
    first_row, 3, has_aux=True, normalize="sum", aux="stack"
  )(jnp.array(1.0), jnp.arange(12.0).reshape(6, 2))
  np.testing.assert_array_equal(aux, [[0.0, 2.0], [4.0, 6.0], [8.0, 10.0]])


@pytest.mark.slow
@hypothesis.settings(deadline=None, max_examples=10, derandomize=True)
@hypothesis.given(
  m=st.integers(1, 5),
  k=st.integers(1, 6),
  features=st.integers(1, 4),
  trailing=st.lists(st.integers(1, 3), max_size=2),
  seed=st.integers(0, 2**16),
)
def test_property_full_batch_equivalence(m, k, features, trailing, seed):
  """Over batch size, k and shapes (including trailing batch axes)."""
  keys = jax.random.split(jax.random.key(seed), 3)
  shape = (k * m, *trailing, features)
  x = jax.random.normal(keys[0], shape)
  y = jax.random.normal(keys[1], shape[:-1])
  w = jax.random.normal(keys[2], (features,))

  def per_example_loss(w, batch):
    xs, ys = batch
    return jnp.mean((jnp.sin(xs @ w) - ys) ** 2)

  got = jaxaccum.value_and_grad(per_example_loss, k)(w, (x, y))
  want = jax.value_and_grad(per_example_loss)(w, (x, y))
  # A linear model: the sum over all rows (trailing axes too) and the dot
  # product over the features.
  assert_close(got, want, y.size + features + ROUNDINGS)


def test_verify_equivalence_passes_and_catches_non_per_example_losses():
  params, batch = make_problem(batch_size=8)
  deviation = jaxaccum.verify_equivalence(mlp_loss, (params, batch), 4)
  assert deviation.grads < 1e-5 and deviation.value < 1e-5

  def batch_norm_loss(p, b):  # examples interact: not decomposable
    x, y = b
    h = x @ p["w1"]
    h = (h - h.mean(0, keepdims=True)) / (h.std(0, keepdims=True) + 1e-3)
    return jnp.mean((jnp.tanh(h) @ p["w2"] - y) ** 2)

  with pytest.raises(AssertionError, match="differ by up to"):
    jaxaccum.verify_equivalence(batch_norm_loss, (params, batch), 4)


def test_verify_equivalence_refuses_rng():
  params, batch = make_problem(batch_size=8)
  with pytest.raises(ValueError, match="rng_argnum"):
    jaxaccum.verify_equivalence(
      lambda p, b, key: mlp_loss(p, b),
      (params, batch, jax.random.key(0)),
      2,
      rng_argnum=2,
    )


def meta_gradient(remat, k=4):
  """The gradient of a gradient penalty: it differentiates *through* the
  accumulated gradient, where the remat policy decides what the outer
  backward pass keeps and what it recomputes."""

  def penalty(params, batch):
    grads = jaxaccum.grad(mlp_loss, k, remat=remat)(params, batch)
    return sum(jnp.sum(g**2) for g in jax.tree.leaves(grads))

  return jax.grad(penalty)


# mutmut: _micro.Micro.step
@pytest.mark.slow
def test_a_remat_policy_decides_what_is_saved_for_the_outer_backward_pass():
  """The policy dropped (remat=policy treated as remat=True), or remat
  ignored: a policy that saves everything then compiles to the memory of
  one that saves nothing (or the other way round), and a policy of the
  user's is never consulted."""
  params, batch = make_problem(batch_size=16)
  saveable = jax.checkpoint_policies
  nothing, everything = (
    jaxaccum.compiled_memory(meta_gradient(policy), params, batch).temp_bytes
    for policy in (saveable.nothing_saveable, saveable.everything_saveable)
  )
  plain = jaxaccum.compiled_memory(meta_gradient(False), params, batch).temp_bytes
  assert nothing < everything and nothing < plain, (nothing, everything, plain)

  consulted = []

  def save_nothing(primitive, *args, **params):
    del args, params
    consulted.append(primitive)
    return False

  got = meta_gradient(save_nothing)(params, batch)
  assert consulted  # what the outer backward pass keeps was asked of it
  # Recomputed, not changed: the same sums, rounded the same way twice over.
  assert_close(got, meta_gradient(False)(params, batch), 2 * summed_terms(16))
