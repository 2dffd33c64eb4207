"""The loss as a function of sums over its rows, read from its jaxpr.

A loss ``L = F(s_1, ..., s_r, θ)`` built from sums over the batch's rows,
``s_j = Σ_rows g_j(θ, row)``, has the full batch's value and gradient from
the micro-batches' sums: ``L = F(Σ_micro s_j, θ)`` and
``∇L = Σ_micro Σ_j c_j ∇s_j + ∂F/∂θ`` with ``c_j = ∂F/∂s_j`` at the totals.
A mean, a masked or token-weighted mean, a sum, a ratio of sums and a sum
plus a penalty on the weights are all of that form; the mean of the
micro-batches' losses is not, unless ``F`` is affine in the sums with
constant coefficients.

:func:`read` traces ``fun`` on one micro-batch's types and on twice as many
rows, and reads:

1. **Rows.** Each value is *constant* over the batch (a parameter, a
   literal), holds *rows* along one dimension (:class:`Rows`: the slice at
   index ``j`` depends only on row ``j // block``), is a *sum* (computed
   from sums over rows and constants only), or is *mixed* (anything else:
   a batch statistic used per row, a sort over rows). A rule per primitive
   (``_ROW_RULES``) follows rows through elementwise operations, reshapes,
   contractions, gathers and the calls JAX inlines; a reduction or a
   contraction over the rows makes a *sum node*.
2. **The rest, F.** The equations the loss needs beyond the sum nodes. A
   literal that differs between the two traces (``jnp.mean``'s count) is
   a count of rows, scaled to the rows of the whole batch; one that
   differs anywhere else, or otherwise than in proportion, ends the read.
3. **Coefficients.** Whether ``∂F/∂s`` is constant (no pass before the
   loop), depends on sums that the parameters do not reach only (a masked
   mean's count: a pass over those sums alone first), or on sums they
   reach (a ratio of two means: a forward pass for the totals first).

Any other loss (a batch statistic used per row, a custom derivative around
the sum, a literal that scales otherwise) gives a :class:`Refusal` naming
why; the step then keeps the mean of the micro-batches' losses.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple

from jaxaccum import _compat, _jaxpr

#: A value computed from sums over the rows and constants only.
SUM = "sum"
#: A value that depends on the rows in a way that is not a sum over them.
MIXED = "mixed"


class Rows(NamedTuple):
  """A value holding the batch's rows along dimension ``dim``: the slice at
  index ``j`` depends only on row ``j // block`` (``block > 1`` after the
  rows were merged with another dimension, as ``reshape(-1, V)`` does)."""

  dim: int
  block: int = 1


#: Elementwise primitives: rows pass through where every operand that holds
#: rows holds them alike (scalars and constants broadcast).
ELEMENTWISE = frozenset(
  (  # noqa: SIM905 (a list of names reads better as words)
    "abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp conj "
    "convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv "
    "erfc exp exp2 expm1 floor ge gt igamma imag integer_pow is_finite le "
    "lgamma log log1p logistic lt max min mul ne neg nextafter not "
    "optimization_barrier or population_count pow random_bits random_unwrap "
    "random_wrap real reduce_precision rem reshard round rsqrt select_n "
    "sharding_constraint shift_left shift_right_arithmetic "
    "shift_right_logical sign sin sinh sqrt square stop_gradient sub tan tanh "
    "threefry2x32 xor"
  ).split()
)

#: Reductions that are not sums: over the rows they mix them.
_OTHER_REDUCTIONS = frozenset(
  {"reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or"}
  | {"argmax", "argmin", "reduce_xor"}
)
_CUMULATIVE = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})


class _Kinds(_jaxpr.Walker):
  """Reads each value's kind (module docstring); values are not computed.
  ``sum_nodes`` collects the equations whose output is a sum over rows."""

  rules: ClassVar[dict[str, str]] = {
    name: "nested"
    for name in (
      "custom_jvp_call",
      "custom_vjp_call",
      "scan",
      "cond",
      "while",
      *_jaxpr.REMAT,
    )
  }

  def __init__(self) -> None:
    self.sum_nodes: list[Any] = []

  def plain(self, eqn: Any, invals: list[Any]) -> list[Any]:
    del invals
    return [None] * len(eqn.outvars)

  def default(self, eqn: Any, invals: list[Any], meta: list[Any]):
    del invals
    n = len(eqn.outvars)
    kinds = [m for m in meta if m is not None]
    if MIXED in kinds:
      return [None] * n, [MIXED] * n
    if all(k == SUM for k in kinds):
      return [None] * n, [SUM] * n
    if SUM in kinds:  # a sum meeting rows: a batch statistic per row
      return [None] * n, [MIXED] * n
    out = _row_rule(eqn, meta)
    if out == SUM:
      self.sum_nodes.append(eqn)
    return [None] * n, [out] * n

  def nested(self, eqn: Any, invals: list[Any], meta: list[Any]):
    """A custom derivative, a ``checkpoint``, ``scan``, ``cond`` or
    ``while``: rows pass through its body, but a sum over rows inside it
    cannot be split from what follows, and a loop over rows mixes them."""
    del invals
    n = len(eqn.outvars)
    if all(m in (None, SUM) for m in meta):
      kinds = [SUM if any(m == SUM for m in meta) else None] * n
      return [None] * n, kinds
    outs = _nested_kinds(eqn, meta)
    return [None] * n, outs


def _nested_kinds(eqn: Any, meta: list[Any]) -> list[Any]:
  """The output kinds of a call-like equation from its body's."""
  name = eqn.primitive.name
  n = len(eqn.outvars)
  if name == "while" or any(m == SUM for m in meta):
    return [MIXED] * n
  if name in ("custom_jvp_call", "custom_vjp_call"):
    body = eqn.params["call_jaxpr"]
    return _body_kinds(body.jaxpr, body.consts, meta)
  if name in _jaxpr.REMAT:
    return _body_kinds(eqn.params["jaxpr"], (), meta)
  if name == "cond":
    if meta[0] is not None:
      return [MIXED] * n
    found = [_body_kinds(b.jaxpr, b.consts, meta[1:]) for b in eqn.params["branches"]]
    return [
      k if all(f[i] == k for f in found) else MIXED for i, k in enumerate(found[0])
    ]
  return _scan_kinds(eqn, meta)


def _body_kinds(jaxpr: Any, consts: Sequence[Any], meta: list[Any]) -> list[Any]:
  walk = _Kinds()
  _, outs = walk.run(jaxpr, consts, [None] * len(jaxpr.invars), meta)
  if walk.sum_nodes:
    return [MIXED if k == SUM else k for k in outs]
  return outs


def _scan_kinds(eqn: Any, meta: list[Any]) -> list[Any]:
  """A ``scan`` over layers or over time within rows: its carry keeps its
  kind through the body; a scan over the rows themselves mixes them."""
  p = eqn.params
  consts, carried = _compat.scan_operand_counts(p, len(eqn.invars))
  xs = meta[consts + carried :]
  if any(isinstance(m, Rows) and m.dim == 0 for m in xs):
    return [MIXED] * len(eqn.outvars)
  inner = [
    *meta[: consts + carried],
    *(Rows(m.dim - 1, m.block) if isinstance(m, Rows) else m for m in xs),
  ]
  outs = _body_kinds(p["jaxpr"].jaxpr, p["jaxpr"].consts, inner)
  if outs[:carried] != list(meta[consts : consts + carried]):
    return [MIXED] * len(eqn.outvars)
  ys = [Rows(m.dim + 1, m.block) if isinstance(m, Rows) else m for m in outs[carried:]]
  return [*outs[:carried], *ys]


def _row_rule(eqn: Any, meta: list[Any]) -> Any:
  """The kind of ``eqn``'s outputs where its inputs hold rows or are
  constant: rows, a sum over them, or mixed."""
  name = eqn.primitive.name
  rows = [m for m in meta if isinstance(m, Rows)]
  if name in ELEMENTWISE:
    return rows[0] if all(r == rows[0] for r in rows) else MIXED
  rule = _ROW_RULES.get(name)
  if rule is None:
    return MIXED
  try:
    return rule(eqn, meta)
  except (KeyError, IndexError, ValueError, TypeError):  # params we cannot read
    return MIXED


def _reduce(eqn: Any, meta: list[Any]) -> Any:
  (r,) = meta
  axes = tuple(eqn.params["axes"])
  if r.dim in axes:
    return SUM if eqn.primitive.name == "reduce_sum" else MIXED
  return Rows(r.dim - sum(a < r.dim for a in axes), r.block)


def _broadcast(eqn: Any, meta: list[Any]) -> Any:
  r = meta[0]
  if not isinstance(r, Rows) or any(m is not None for m in meta[1:]):
    return MIXED
  dim = eqn.params["broadcast_dimensions"][r.dim]
  same = eqn.invars[0].aval.shape[r.dim] == eqn.outvars[0].aval.shape[dim]
  return Rows(dim, r.block) if same else MIXED


def _reshape(eqn: Any, meta: list[Any]) -> Any:
  (r,) = meta[:1]
  if eqn.params.get("dimensions") is not None:
    return MIXED
  shape_in, shape_out = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
  if math.prod(shape_in[: r.dim]) != 1:
    return MIXED
  chunk = r.block * math.prod(shape_in[r.dim + 1 :])  # a row's elements, contiguous
  for dim, size in enumerate(shape_out):
    if size == 1 and dim < len(shape_out) - 1:
      continue
    stride = math.prod(shape_out[dim + 1 :])
    return Rows(dim, chunk // stride) if chunk % stride == 0 else MIXED
  return MIXED


def _transpose(eqn: Any, meta: list[Any]) -> Any:
  (r,) = meta
  return Rows(tuple(eqn.params["permutation"]).index(r.dim), r.block)


def _squeeze(eqn: Any, meta: list[Any]) -> Any:
  (r,) = meta
  dims = tuple(eqn.params["dimensions"])
  if r.dim in dims:
    return MIXED
  return Rows(r.dim - sum(d < r.dim for d in dims), r.block)


def _along(axis_param: str) -> Callable[[Any, list[Any]], Any]:
  """A rule for an operation along one axis (a cumulative sum, a sort): rows
  pass where the axis is not theirs."""

  def rule(eqn: Any, meta: list[Any]) -> Any:
    rows = [m for m in meta if isinstance(m, Rows)]
    if any(r != rows[0] for r in rows) or eqn.params[axis_param] == rows[0].dim:
      return MIXED
    return rows[0]

  return rule


def _dot(eqn: Any, meta: list[Any]) -> Any:
  """A contraction: over the rows it is a sum over them; rows on a free or
  a batch dimension pass to the output's."""
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  lhs, rhs = meta
  nl, nr = eqn.invars[0].aval.ndim, eqn.invars[1].aval.ndim
  lfree = [d for d in range(nl) if d not in lc and d not in lb]
  rfree = [d for d in range(nr) if d not in rc and d not in rb]
  if isinstance(lhs, Rows) and isinstance(rhs, Rows):
    if lhs.block != rhs.block:
      return MIXED
    for mine, theirs in ((lc, rc), (lb, rb)):
      paired = lhs.dim in mine and rhs.dim in theirs
      if paired and tuple(mine).index(lhs.dim) == tuple(theirs).index(rhs.dim):
        return SUM if mine is lc else Rows(tuple(lb).index(lhs.dim), lhs.block)
    return MIXED
  r, contracting, batch, free, offset = (
    (lhs, lc, lb, lfree, len(lb))
    if isinstance(lhs, Rows)
    else (rhs, rc, rb, rfree, len(lb) + len(lfree))
  )
  if r.dim in contracting:
    return SUM
  if r.dim in batch:
    return Rows(tuple(batch).index(r.dim), r.block)
  return Rows(offset + free.index(r.dim), r.block)


def _gather(eqn: Any, meta: list[Any]) -> Any:
  """A gather: by indices that hold rows (an embedding lookup), along a
  dimension other than the rows of an operand that holds them, or both
  along batching dimensions (``take_along_axis``)."""
  operand, indices = meta
  dims = eqn.params["dimension_numbers"]
  nd_out = eqn.outvars[0].aval.ndim
  nd_idx = eqn.invars[1].aval.ndim
  offset = tuple(dims.offset_dims)
  batch_out = [d for d in range(nd_out) if d not in offset]
  batch_idx = list(range(nd_idx - 1))  # the last is the index vector
  if isinstance(indices, Rows):
    if indices.dim == nd_idx - 1:
      return MIXED
    out = Rows(batch_out[batch_idx.index(indices.dim)], indices.block)
    if operand is None:
      return out
    pairs = zip(
      dims.operand_batching_dims, dims.start_indices_batching_dims, strict=True
    )
    if (operand.dim, indices.dim) in set(pairs) and operand.block == indices.block:
      return out
    return MIXED
  collapsed = set(dims.collapsed_slice_dims) | set(dims.operand_batching_dims)
  whole = (
    eqn.params["slice_sizes"][operand.dim] == eqn.invars[0].aval.shape[operand.dim]
  )
  if operand.dim in collapsed or operand.dim in dims.start_index_map or not whole:
    return MIXED
  kept = [d for d in range(eqn.invars[0].aval.ndim) if d not in collapsed]
  return Rows(offset[kept.index(operand.dim)], operand.block)


def _whole(eqn: Any, dim: int, meta: list[Any]) -> bool:
  """Whether a slice, a pad, a dynamic slice, a reversal or a concatenation
  leaves dimension ``dim`` whole (a dynamic slice's offsets constant)."""
  name, p = eqn.primitive.name, eqn.params
  size = eqn.invars[0].aval.shape[dim]
  if name == "slice":
    stride = (p.get("strides") or (1,) * eqn.invars[0].aval.ndim)[dim]
    return (p["start_indices"][dim], p["limit_indices"][dim], stride) == (0, size, 1)
  if name == "dynamic_slice":
    constant = all(m is None for m in meta[1:])
    return constant and p["slice_sizes"][dim] == size
  if name == "pad":
    return tuple(p["padding_config"][dim]) == (0, 0, 0)
  if name == "rev":
    return dim not in p["dimensions"]
  return p["dimension"] != dim  # concatenate


def _slice_like(eqn: Any, meta: list[Any]) -> Any:
  """A slice, a pad, a dynamic slice, a reversal or a concatenation: rows
  pass where the row dimension is left whole."""
  rows = [m for m in meta if isinstance(m, Rows)]
  r = rows[0]
  if any(x != r for x in rows) or not _whole(eqn, r.dim, meta):
    return MIXED
  return r


_ROW_RULES: dict[str, Callable[[Any, list[Any]], Any]] = {
  "reduce_sum": _reduce,
  **{name: _reduce for name in _OTHER_REDUCTIONS},
  "broadcast_in_dim": _broadcast,
  "reshape": _reshape,
  "transpose": _transpose,
  "squeeze": _squeeze,
  "dot_general": _dot,
  "gather": _gather,
  "sort": _along("dimension"),
  **{name: _along("axis") for name in _CUMULATIVE},
  **{name: _slice_like for name in ("slice", "dynamic_slice", "pad", "rev")},
  "concatenate": _slice_like,
}


def sum_nodes(closed: Any, rows_at: Sequence[Rows | None]) -> tuple[Any, list[Any]]:
  """The kind of ``closed``'s first output (the loss) and the equations
  whose output is a sum over rows, with ``closed``'s inputs holding rows as
  ``rows_at`` says (None: constant over the batch)."""
  walk = _Kinds()
  nargs = len(closed.jaxpr.invars)
  _, kinds = walk.run(closed.jaxpr, closed.consts, [None] * nargs, list(rows_at))
  return kinds[0], walk.sum_nodes
