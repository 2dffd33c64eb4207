"""Each example's squared gradient norm from a use's tap, and, in
bfloat16, the clipped sum book-kept from the same values."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxaccum import _compat
from jaxaccum._privacy.ghost.kernel import widened
from jaxaccum._privacy.ghost.uses import Use, View

PyTree = Any


def dot_sq(use: Use, a: jax.Array, g: jax.Array) -> jax.Array:
  """Per-example squared norm of a ``dot_general``'s parameter gradient,
  from the activation ``a`` and the output's cotangent ``g`` (each with a
  leading example axis)."""
  (lc, rc), (lb, rb) = use.eqn.params["dimension_numbers"]
  a_is_lhs = use.position == 1
  ac, ab = (lc, lb) if a_is_lhs else (rc, rb)
  wc, wb = (rc, rb) if a_is_lhs else (lc, lb)
  a_free = [d for d in range(a.ndim - 1) if d not in ac and d not in ab]
  w_ndim = use.eqn.invars[use.position].aval.ndim
  w_free = [d for d in range(w_ndim) if d not in wc and d not in wb]
  nb, ns, nf = len(ab), len(a_free), len(w_free)
  # The output is (batch, lhs free, rhs free).
  batch = list(range(nb))
  s_out = list(range(nb, nb + ns)) if a_is_lhs else list(range(nb + nf, nb + nf + ns))
  f_out = list(range(nb + ns, nb + ns + nf)) if a_is_lhs else list(range(nb, nb + nf))
  m = a.shape[0]
  size = lambda dims, shape: math.prod(shape[d] for d in dims)  # noqa: E731
  a_shape, g_shape = a.shape[1:], g.shape[1:]
  B, S = size(ab, a_shape), size(a_free, a_shape)
  C, F = size(ac, a_shape), size(f_out, g_shape)
  perm_a = [0] + [1 + d for d in (*ab, *a_free, *ac)]
  perm_g = [0] + [1 + d for d in (*batch, *s_out, *f_out)]
  a = widened(jnp.transpose(a, perm_a).reshape(m, B, S, C))
  g = widened(jnp.transpose(g, perm_g).reshape(m, B, S, F))
  hi = jax.lax.Precision.HIGHEST
  if 2 * S * S <= C * F:  # the Gram form
    gram_a = jnp.einsum("mbsc,mbtc->mbst", a, a, precision=hi)
    gram_g = jnp.einsum("mbsf,mbtf->mbst", g, g, precision=hi)
    return jnp.sum(gram_a * gram_g, axis=(1, 2, 3))
  grad = jnp.einsum("mbsc,mbsf->mbcf", a, g, precision=hi)
  return jnp.sum(jnp.square(grad), axis=(1, 2, 3))


def gather_sq(use: Use, rows: jax.Array, g: jax.Array) -> jax.Array:
  """Per-example squared norm of an embedding table's gradient, from the
  row each output slice took and the output's cotangent ``g``."""
  offset = tuple(use.eqn.params["dimension_numbers"].offset_dims)
  m = g.shape[0]
  index_dims = [d for d in range(g.ndim - 1) if d not in offset]
  perm = [0] + [1 + d for d in (*index_dims, *offset)]
  g = widened(jnp.transpose(g, perm))
  rows = jnp.transpose(rows, perm)
  S = math.prod(g.shape[1 : 1 + len(index_dims)])
  g = g.reshape(m, S, -1)
  rows = rows.reshape(m, S, -1)[:, :, 0]
  same = rows[:, :, None] == rows[:, None, :]
  gram = jnp.einsum("msd,mtd->mst", g, g, precision=jax.lax.Precision.HIGHEST)
  return jnp.sum(jnp.where(same, gram, jnp.zeros_like(gram)), axis=(1, 2))


def per_example_grad(use: Use, g: jax.Array) -> jax.Array:
  """Each example's gradient of ``use``'s leaf from the cotangent ``g`` of
  its tapped operand, in float32: shape=(rows, *leaf)."""
  return jax.vmap(lambda x: _to_leaf(use.tag.chain, x))(g)


def _to_leaf(chain: tuple[View, ...], g: jax.Array) -> jax.Array:
  """One example's gradient with respect to a view of a leaf, as the
  gradient with respect to the leaf: each view undone, last first."""
  g = widened(g)
  for view in reversed(chain):
    if view.primitive == "transpose":
      perm = view.params["permutation"]
      g = jnp.transpose(g, [perm.index(d) for d in range(len(perm))])
    elif view.primitive == "broadcast_in_dim":
      kept = tuple(view.params["broadcast_dimensions"])
      g = jnp.sum(g, axis=tuple(d for d in range(g.ndim) if d not in kept))
      ones = tuple(j for j, n in enumerate(view.in_shape) if n == 1 and g.shape[j] != 1)
      g = jnp.sum(g, axis=ones, keepdims=True)
    g = g.reshape(view.in_shape)
  return g


def squared_norms(
  uses: list[Use],
  plan: dict[int, str],
  tap_grads: dict[int, Any],
  saved: dict[int, Any],
  rows: int,
) -> jax.Array:
  """Each example's squared gradient norm over every differentiated leaf."""
  total = jnp.zeros((rows,), jnp.float32)
  by_leaf: dict[int, jax.Array] = {}
  for n, u in enumerate(uses):
    if plan[n] == "dot":
      total = total + dot_sq(u, saved[n], tap_grads[n])
    elif plan[n] == "gather":
      total = total + gather_sq(u, saved[n][0], tap_grads[n])
    else:
      g = per_example_grad(u, tap_grads[n])
      by_leaf[u.leaf] = g if u.leaf not in by_leaf else by_leaf[u.leaf] + g
  for g in by_leaf.values():
    total = total + jnp.sum(jnp.square(g).reshape(rows, -1), axis=1)
  return total


def kept_sums(traced: Any, first: Any, wide: list[Any]) -> list[jax.Array]:
  """Each leaf's clipped sum over the kept rows, in its master's dtype, from
  what the first pass took the norms from (book-keeping): for a use tapped
  on its operand, the rows' gradients there; for a ``dot`` or a ``gather``,
  the transpose of the use itself, in float32 at full precision, applied to
  the rows' saved operands and output cotangents times their factors (the
  rows contracted in float32). A row not kept is selected away (its values
  may be NaN), never multiplied."""
  rows = first.kept.shape[0]
  sums: list[Any] = [None] * len(wide)
  for n, u in enumerate(traced.uses):
    dtype = jnp.result_type(wide[u.leaf])
    g = first.tap_grads[n]
    if traced.plan[n] == "input":
      per = kept_rows(first.kept, per_example_grad(u, g).astype(dtype))
      share = jnp.einsum(
        "m,m...->...",
        first.factor.astype(dtype),
        per,
        precision=_HIGHEST,
        out_sharding=_compat.explicit_spec(wide[u.leaf]),
      )
    else:
      ct = kept_rows(first.kept, widened(g).astype(dtype))
      ct = ct * first.factor.astype(dtype).reshape((rows,) + (1,) * (ct.ndim - 1))
      saved = first.saved[n]
      if u.kind == "dot":  # the activation, whose rows not kept may be NaN
        saved = kept_rows(first.kept, widened(saved).astype(dtype))
      share = _transposed(u, saved, ct, wide[u.leaf])
    sums[u.leaf] = share if sums[u.leaf] is None else sums[u.leaf] + share
  return [
    jnp.zeros(jnp.shape(w), jnp.result_type(w))
    if s is None
    else s.astype(jnp.result_type(w))
    for s, w in zip(sums, wide, strict=True)
  ]


_HIGHEST = jax.lax.Precision.HIGHEST


def kept_rows(kept: jax.Array, x: jax.Array) -> jax.Array:
  """``x`` with the rows not kept zeroed by a select."""
  which = kept.reshape((kept.shape[0],) + (1,) * (x.ndim - 1))
  return jnp.where(which, x, jnp.zeros_like(x))


def _transposed(use: Use, saved: Any, ct: jax.Array, master: jax.Array) -> jax.Array:
  """The sum over the rows of a ``dot`` or ``gather`` use's transpose with
  respect to the leaf, at the rows' saved operands and output cotangents
  ``ct``: the use evaluated on the leaf's ``master`` (seen through the same
  views, but in the master's dtype, float32) at full precision, so that the
  rows are contracted in float32; shaped and typed like ``master``."""
  dtype = jnp.result_type(master)
  params = dict(use.eqn.primitive.get_bind_params(use.eqn.params))
  if use.kind == "dot":
    other = saved  # the activation, widened
    params.update(preferred_element_type=jnp.dtype(dtype), precision=(_HIGHEST,) * 2)
  else:
    other = saved[1]  # the indices

  def one(view, operand):
    operands = [operand, operand]
    operands[use.position] = view
    return use.eqn.primitive.bind(*operands, **params)

  def over_rows(x):
    for view in use.tag.chain:  # the views, but not their casts
      if view.primitive != "convert_element_type":
        x = view.bind.bind(x, **view.bind.get_bind_params(view.params))
    return jax.vmap(one, in_axes=(None, 0))(x, other)

  (out,) = jax.linear_transpose(over_rows, jax.lax.stop_gradient(master))(ct)
  return out
