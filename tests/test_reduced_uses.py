"""Which leaves plain jit's step may type ``reduced``
(:func:`jaxaccum._unreduced.reducible_leaves`): read from the loss's jaxpr,
each leaf's every use must take a reduced operand. A leaf let through that
JAX refuses fails the step's trace (then it falls back, with a warning); a
leaf refused that JAX would take costs a reduction per micro-batch. Traced
only: no device, no compile.
"""

import jax
import jax.numpy as jnp
import pytest

from jaxaccum._unreduced import reducible_leaves

X = jnp.ones((4, 3))
W = jnp.ones((3, 3))


def uses(fun, *leaves, count=None):
  return reducible_leaves(jax.make_jaxpr(fun)(*leaves), count)


def test_matrix_products_through_casts_transposes_and_reshapes():
  def fun(w):
    v = w.astype(jnp.bfloat16).T.astype(jnp.float32).T.reshape(3, 3)
    return jnp.sum(X @ v) + jnp.sum(jnp.expand_dims(W, 0)[0] @ X.T)

  assert uses(fun, W) == [True]


@pytest.mark.parametrize(
  "use",
  [
    lambda w: X @ W + w[:1],  # a bias added to activations
    lambda w: X * jnp.sum(w),  # reduced over its own entries, then scaled
    lambda w: jnp.take(w, jnp.array([0, 2]), axis=0) @ W,  # a gather
    lambda w: X @ (w @ w),  # a product of the leaf with itself
    lambda w: X @ jax.nn.relu(w),  # a custom_jvp call
  ],
  ids=["bias", "elementwise", "gather", "self_product", "custom_jvp"],
)
def test_other_uses_are_refused(use):
  assert uses(lambda w: jnp.sum(use(w)), W) == [False]


def test_one_refused_use_refuses_the_leaf():
  assert uses(lambda w: jnp.sum(X @ w) + jnp.sum(w), W) == [False]


def test_a_leaf_returned_is_refused():
  assert uses(lambda w, v: (jnp.sum(X @ w), v), W, W) == [True, False]


def test_a_product_of_two_leaves_refuses_both_and_spares_a_third():
  def fun(a, b, c):
    return jnp.sum(X @ (a @ b)) + jnp.sum(X @ c)

  assert uses(fun, W, W, W) == [False, False, True]


def test_calls_are_followed_into_their_jaxprs():
  @jax.jit
  def inner(h, w):
    return h @ w

  def fun(w, v, u, t):
    h = inner(X, w)  # jit
    h = jax.checkpoint(lambda h: h @ v)(h)  # checkpoint
    h = jax.lax.cond(jnp.sum(h) > 0, lambda h: h @ u, lambda h: h @ u.T, h)  # cond
    h = jax.lax.cond(jnp.sum(h) > 0, lambda h: h + t[:1], lambda h: h, h)  # refused
    return jnp.sum(h)

  assert uses(fun, W, W, W, W) == [True, True, True, False]


def test_scan_takes_constants_and_scanned_layers_but_not_carries():
  stack = jnp.ones((2, 3, 3))

  def fun(layers, const, carried):
    def body(carry, layer):
      h, c = carry
      return (h @ layer @ const, c), None

    (h, c), _ = jax.lax.scan(body, (X, carried), layers)
    return jnp.sum(h) + jnp.sum(c)

  assert uses(fun, stack, W, W) == [True, True, False]


def test_only_the_first_count_inputs_are_leaves():
  """The micro-batch comes after the leaves: a product of a leaf with it is
  a use that takes a reduced operand, not a product of two leaves."""

  def fun(w, x):
    return jnp.sum(x @ w)

  assert uses(fun, W, X, count=1) == [True]
  assert uses(fun, W, X) == [False, False]


def test_a_leaf_a_call_returns_as_it_is_is_followed_after_it():
  """nnx.remat returns a layer's weights from its checkpoint: the leaf is
  followed to its uses after the call, not refused for leaving it."""

  @jax.jit
  def passes(w):
    return w

  def fun(w, v):
    h, w_again = jax.checkpoint(lambda h, w: (h @ w, w))(X, w)
    return jnp.sum(h @ w_again) + jnp.sum(X @ passes(v))

  assert uses(fun, W, W) == [True, True]


def test_a_leaf_a_scan_or_cond_returns_is_refused():
  def scanned(w):
    _, ws = jax.lax.scan(lambda c, _: (c, w), 0.0, None, length=2)
    return jnp.sum(X @ ws[0])

  def branched(w):
    return jnp.sum(X @ jax.lax.cond(True, lambda w: w, lambda w: w.T, w))

  assert uses(scanned, W) == [False]
  assert uses(branched, W) == [False]
