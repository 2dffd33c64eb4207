"""Ghost clipping: DP-SGD's clipped sum without per-example gradients.

``clip_method="ghost"`` computes the same thing as the default
``clip_method="vmap"`` (:func:`jaxaccum._privacy.clipped_value_and_grad`):
the sum over a micro-batch of each example's gradient scaled to L2 norm at
most ``C``. It reads each example's gradient *norm* from the traced program
instead of materializing the gradient, in three steps:

1. **Trace.** ``fun`` on one example is traced to a jaxpr; each
   differentiated leaf is followed through the operations that only view it
   (reshape, transpose, cast, broadcast, nested ``jit``), and each other
   operation that reads it is a *use*.
2. **Tap.** The jaxpr is evaluated for every example (``vmap``) with a zero
   *tap* added at each use, and one backward pass gives each tap's
   cotangent per example:

   - a ``dot_general`` between the leaf and an activation ``a`` (a dense
     layer, an attention projection): the tap is on the product's output,
     whose cotangent ``g`` gives the norm of ``a``'s and ``g``'s product,
     ``sum_{s,t} <a_s, a_t><g_s, g_t>`` over the example's tokens (the Gram
     form), or that product itself where it is smaller (``2 S^2 > C F``,
     chosen per use as Bu et al. 2022's book-keeping does);
   - a ``gather`` of whole rows (an embedding lookup): the tap is on the
     rows gathered, ``sum_{s,t} [row_s = row_t] <g_s, g_t>``;
   - any other use (a bias add, a LayerNorm scale, a convolution kernel), and
     every use of a leaf used more than once: the tap is on the operand the
     use reads, whose cotangent is that use's per-example gradient, summed
     back to the leaf's shape. For an elementwise use it is as large as the
     activation it meets; for another use (a convolution, a ``scan``), or a
     leaf used more than once with a ``dot_general`` or a ``gather`` among its
     uses, it is the leaf's per-example gradient (the ``"vmap"`` cost, for
     that leaf only). Such leaves are named in a
     :class:`GhostFallbackWarning` at trace time. A convolution's kernel is
     not given a tap of its own per example: a zero added to the output
     whose backward pass takes the example's kernel gradient one window
     offset at a time (:func:`_kernel_tap`), so that no convolution is
     grouped over the examples.
3. **Weigh.** The squared norms are summed over the leaves, and a second
   forward and backward pass of ``fun`` over the rows, with example ``i``'s
   loss weighted by ``min(1, C / norm_i)`` (0 for a masked or non-finite
   row), gives the clipped sum. The first pass's activations are dead by
   then, so the peak is one pass's (plus the taps' cotangents, as large as
   the activations they meet), at the price of a second forward pass. In the
   second pass each row that is not kept is replaced by a kept one, so that
   its weight 0 multiplies finite numbers and it adds exactly zero.

   Where ``fun`` computes in a narrower dtype than the accumulator's
   (bfloat16 parameters, or a cast to bfloat16 in ``fun``), there is no
   second pass: its bfloat16 backward pass would round the factors and
   contract the rows in bfloat16, and it would not reproduce the first
   pass's bfloat16 values bit for bit (XLA keeps excess precision in a
   fusion as it sees fit: the clipped share of an outlier came out 0.27%
   below C). The clipped sum is formed instead from the first pass's own
   activations and cotangents (Bu et al. 2022's book-keeping), in float32,
   each row's share its factor times the very gradient its norm was taken
   from (:func:`_kept_sums`). The price: every tapped cotangent is held
   until the norms are known.

The clipped sum is the gradient of a loss, :func:`weighted_loss`, with
respect to the differentiated leaves in the accumulator's dtype (float32
masters of bfloat16 leaves): under ``mesh=`` the devices' losses are summed
and differentiated together, so that an FSDP leaf's clipped sums are
reduce-scattered inside the backward pass, as the non-private step's
gradients are, and no device holds a whole gradient of it (in float32, the
second pass's; in bfloat16, each device's book-kept sum of its rows).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

from jaxaccum import _compat, _normalize
from jaxaccum._privacy import closure as _closure

PyTree = Any

#: Operations that only move, cast or repeat a parameter's entries: a
#: parameter seen through them is still that parameter.
VIEWS = frozenset(
  {
    "reshape",
    "transpose",
    "convert_element_type",
    "copy",
    "copy_p",
    "squeeze",
    "expand_dims",
    "broadcast_in_dim",
    "sharding_constraint",
    "reshard",
  }
)

#: Views whose gradient has the parameter's norm (no broadcast: a broadcast
#: sums its gradient back, which changes the norm).
_NORM_KEEPING = VIEWS - {"broadcast_in_dim"}

#: Calls whose body is evaluated inline, so that a parameter passed in is
#: followed to its uses.
_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr"}

#: Uses whose per-example gradient is as large as the activation they meet.
ELEMENTWISE = frozenset(
  {"add", "add_any", "sub", "mul", "div", "max", "min", "neg", "select_n"}
)

METHODS = ("vmap", "ghost")


class GhostFallbackWarning(UserWarning):
  """``clip_method="ghost"`` computes a per-example gradient for some leaves:
  each is used by an operation other than a ``dot_general``, a ``gather`` of
  rows or an elementwise operation (a convolution, a ``scan``), or is used
  more than once with a ``dot_general`` or ``gather`` among its uses. The
  result is exact; those leaves cost what ``clip_method="vmap"`` costs."""


class View(NamedTuple):
  """One view of a parameter: the operation and its input's shape (and the
  primitive, to take the same view of the parameter's float32 master)."""

  primitive: str
  params: dict[str, Any]
  in_shape: tuple[int, ...]
  bind: Any = None


class Tag(NamedTuple):
  """A value that views the differentiated leaf ``leaf`` through ``chain``."""

  leaf: int
  chain: tuple[View, ...]


@dataclasses.dataclass(frozen=True)
class Use:
  """One operation that reads a parameter (through views).

  Attributes:
    leaf: the index of the differentiated leaf.
    kind: ``"dot"``, ``"gather"`` or ``"input"`` (see the module docstring).
    eqn: the jaxpr equation.
    position: which operand of ``eqn`` views the leaf.
    tag: the leaf and its views.
    aval: the per-example shape and dtype of the operand (or output) that
      views the leaf.
  """

  leaf: int
  kind: str
  eqn: Any
  position: int
  tag: Tag
  aval: jax.ShapeDtypeStruct

  @property
  def primitive(self) -> str:
    return self.eqn.primitive.name if self.eqn is not None else "output"


def check_method(clip_method: Any) -> str:
  """``clip_method``, checked.

  >>> check_method("ghosts")
  Traceback (most recent call last):
  ValueError: Unknown clip_method='ghosts'; choose one of ['vmap', 'ghost'].
  """
  if not isinstance(clip_method, str) or clip_method not in METHODS:
    raise ValueError(f"Unknown {clip_method=}; choose one of {list(METHODS)}.")
  return clip_method


# ---------------------------------------------------------------- the walk


class _Walk:
  """Evaluates a per-example jaxpr, following the parameters to their uses.

  With ``plan=None`` it only records the uses (``values`` are not computed);
  with a plan (use number -> kind) it adds ``taps[n]`` at use ``n`` and keeps
  what the norms need in ``saved``.
  """

  def __init__(self, plan: dict[int, str] | None = None, taps: Any = None):
    self.plan = plan
    self.taps = taps
    self.uses: list[Use] = []
    self.saved: dict[int, jax.Array] = {}

  def run(
    self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], tags: Sequence[Any]
  ):
    env: dict[Any, Any] = {}
    tag_env: dict[Any, Tag] = {}

    def read(v):
      return v.val if isinstance(v, jex_core.Literal) else env.get(v)

    def read_tag(v):
      return None if isinstance(v, jex_core.Literal) else tag_env.get(v)

    for v, x in zip(jaxpr.constvars, consts, strict=True):
      env[v] = x
    for v, x, t in zip(jaxpr.invars, args, tags, strict=True):
      env[v] = x
      if t is not None:
        tag_env[v] = t
    for eqn in jaxpr.eqns:
      outs, out_tags = self.eqn(
        eqn, [read(v) for v in eqn.invars], [read_tag(v) for v in eqn.invars]
      )
      for v, x, t in zip(eqn.outvars, outs, out_tags, strict=True):
        env[v] = x
        if t is not None:
          tag_env[v] = t
    return [read(v) for v in jaxpr.outvars], [read_tag(v) for v in jaxpr.outvars]

  def bind(self, eqn: Any, invals: list[Any]) -> list[Any]:
    if self.plan is None:
      return [None] * len(eqn.outvars)
    out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]

  def eqn(self, eqn: Any, invals: list[Any], intags: list[Tag | None]):
    name = eqn.primitive.name
    if all(t is None for t in intags):
      return self.bind(eqn, invals), [None] * len(eqn.outvars)
    if name in VIEWS and intags[0] is not None and all(t is None for t in intags[1:]):
      view = View(
        name, dict(eqn.params), tuple(eqn.invars[0].aval.shape), eqn.primitive
      )
      tag = Tag(intags[0].leaf, (*intags[0].chain, view))
      return self.bind(eqn, invals), [tag]
    if name in _CALLS:
      inner = eqn.params[_CALLS[name]]
      return self.run(inner.jaxpr, inner.consts, invals, intags)
    return self.use(eqn, invals, intags)

  def use(self, eqn: Any, invals: list[Any], intags: list[Tag | None]):
    kind = _kind(eqn, intags)
    numbers = []
    for position, tag in enumerate(intags):
      if tag is not None:
        numbers.append(len(self.uses))
        aval = eqn.invars[position].aval
        shape = jax.ShapeDtypeStruct(aval.shape, aval.dtype)
        self.uses.append(Use(tag.leaf, kind, eqn, position, tag, shape))
    if self.plan is None:
      return self.bind(eqn, invals), [None] * len(eqn.outvars)
    invals = list(invals)
    kernel_taps = []
    for n in numbers:
      if self.plan[n] == "input":
        p = self.uses[n].position
        if _is_conv_kernel(eqn, p):
          kernel_taps.append(n)
          continue
        invals[p] = jax.lax.add(
          invals[p], self.taps[n].astype(jnp.result_type(invals[p]))
        )
    outs = self.bind(eqn, invals)
    for n in kernel_taps:  # the kernel stays the same for every example
      outs[0] = jax.lax.add(outs[0], _kernel_tap(eqn, invals[0], self.taps[n]))
    if kind != "input" and self.plan[numbers[0]] != "input":
      (n,) = numbers
      outs[0] = jax.lax.add(outs[0], self.taps[n].astype(outs[0].dtype))
      self.saved[n] = _saved(self.uses[n], invals)
    return outs, [None] * len(eqn.outvars)

  def output(self, value: Any, tag: Tag, aval: Any) -> Any:
    """A parameter (view) that is itself ``fun``'s loss."""
    n = len(self.uses)
    shape = jax.ShapeDtypeStruct(aval.shape, aval.dtype)
    self.uses.append(Use(tag.leaf, "input", None, 0, tag, shape))
    if self.plan is None:
      return value
    return jax.lax.add(value, self.taps[n].astype(jnp.result_type(value)))


def _kind(eqn: Any, intags: list[Tag | None]) -> str:
  """``"dot"``, ``"gather"`` or ``"input"`` for a use of a parameter."""
  tagged = [p for p, t in enumerate(intags) if t is not None]
  if len(tagged) != 1:
    return "input"
  tag = intags[tagged[0]]
  assert tag is not None
  if not all(v.primitive in _NORM_KEEPING for v in tag.chain):
    return "input"
  name = eqn.primitive.name
  if name == "dot_general" and tagged[0] in (0, 1):
    return "dot"
  if name == "gather" and tagged == [0] and _is_row_gather(eqn):
    return "gather"
  return "input"


def _is_row_gather(eqn: Any) -> bool:
  """The gather takes whole rows of its operand (an embedding lookup)."""
  dims = eqn.params["dimension_numbers"]
  shape = eqn.invars[0].aval.shape
  return (
    tuple(dims.collapsed_slice_dims) == (0,)
    and tuple(dims.start_index_map) == (0,)
    and not tuple(dims.operand_batching_dims)
    and tuple(eqn.params["slice_sizes"]) == (1, *shape[1:])
  )


def _is_conv_kernel(eqn: Any, position: int) -> bool:
  """The operand is a convolution's kernel, tapped by :func:`_kernel_tap`."""
  return (
    eqn.primitive.name == "conv_general_dilated"
    and position == 1
    and eqn.params["batch_group_count"] == 1
  )


def _kernel_tap(eqn: Any, lhs: jax.Array, tap: jax.Array) -> jax.Array:
  """The convolution ``eqn`` of one example's ``lhs`` with a ZERO kernel tap:
  its value is zero, and its gradient with respect to ``tap`` is the
  example's kernel gradient, taken one kernel offset at a time.

  Adding the tap to the kernel itself would give every example its own
  kernel, and ``vmap`` turns each example's kernel gradient into one
  convolution grouped over the examples, which XLA's SPMD partitioner
  miscompiles where the examples are sharded over devices: every device but
  the first gets a zero gradient, silently (jax 0.10.2 and 0.12.1 on 8 CPU
  devices; under ``mesh=`` with a shared FSDP kernel at one row per device
  per micro-batch, the CNN's clipped sum was 2.6% off). Here the backward
  pass takes, for each offset of the kernel's window, the input that offset
  reads (a convolution with a one-hot kernel per channel, exact at HIGHEST,
  the same for every example) and its ``dot_general`` with the output's
  cotangent, in float32, in a loop over the offsets: one offset's inputs
  are live at a time, never all of them (the patches, as many times the
  input as the window has offsets).
  """
  params = eqn.params
  dims = params["dimension_numbers"]
  lhs_spec, rhs_spec, out_spec = dims
  groups = params["feature_group_count"]
  spatial = sorted(rhs_spec[2:])  # the kernel's window, in its own order
  window = [tap.shape[d] for d in spatial]
  channels = lhs.shape[lhs_spec[1]]
  out_aval = eqn.outvars[0].aval
  to_rows = [out_spec[0], *out_spec[2:], out_spec[1]]  # (batch, *spatial, C)
  kernel_order = [rhs_spec[0], rhs_spec[1], *spatial]  # (out, in, *window)

  def offset_grad(lhs, g, offset):
    """The kernel gradient at one offset of the window: (groups, out, in)."""
    one_hot = (jnp.arange(math.prod(window)) == offset).astype(lhs.dtype)
    picker = jnp.broadcast_to(one_hot.reshape(window), (channels, 1, *window))
    picker = jnp.moveaxis(picker, (0, 1), (rhs_spec[0], rhs_spec[1]))
    read = jax.lax.conv_general_dilated(
      lhs,
      picker,
      params["window_strides"],
      params["padding"],
      params["lhs_dilation"],
      params["rhs_dilation"],
      dims,
      feature_group_count=channels,
      precision=jax.lax.Precision.HIGHEST,
    )
    read = widened(jnp.transpose(read, to_rows))
    read = read.reshape(-1, groups, channels // groups)
    g = widened(jnp.transpose(g, to_rows))
    g = g.reshape(-1, groups, g.shape[-1] // groups)
    return jnp.einsum("sgi,sgo->goi", read, g, precision=jax.lax.Precision.HIGHEST)

  @jax.custom_vjp
  def tapped(lhs, tap):
    # Zero, read from the tap so that vmap maps it as the tap is mapped (an
    # unmapped output would get the examples' cotangents summed).
    del lhs
    zero = jnp.zeros((), out_aval.dtype) * jnp.sum(tap).astype(out_aval.dtype)
    return jnp.broadcast_to(zero, out_aval.shape)

  def forward(lhs, tap):
    return tapped(lhs, tap), lhs

  def backward(lhs, g):
    per_offset = jax.lax.map(
      lambda offset: offset_grad(lhs, g, offset), jnp.arange(math.prod(window))
    )  # (window, groups, out, in)
    grad = jnp.moveaxis(per_offset, 0, -1).reshape([tap.shape[d] for d in kernel_order])
    grad = jnp.transpose(grad, [kernel_order.index(d) for d in range(tap.ndim)])
    # At a zero tap the convolution does not depend on lhs.
    return jnp.zeros_like(lhs), grad.astype(tap.dtype)

  tapped.defvjp(forward, backward)
  return tapped(lhs, tap)


def _saved(use: Use, invals: list[Any]) -> Any:
  """What the norm of a tapped ``dot`` or ``gather`` needs besides the
  output's cotangent: the activation, or the row each output slice took
  and the indices (for the embedding's clipped sum, :func:`_kept_sums`)."""
  if use.kind == "dot":
    return invals[1 - use.position]
  operand = use.eqn.invars[0].aval
  rows = jax.lax.broadcasted_iota(jnp.float32, operand.shape, 0)
  params = use.eqn.primitive.get_bind_params(use.eqn.params)
  # An index out of bounds (mode FILL_OR_DROP, jnp.take's default) takes no
  # gradient: its row is NaN, which equals no row, itself included. The fill
  # is given explicitly: None lowers only where a batching rule replaces it,
  # so a gather whose indices are not the example's (positions) failed.
  params = {**params, "fill_value": math.nan}
  return use.eqn.primitive.bind(rows, invals[1], **params), invals[1]


# ---------------------------------------------------------------- the plan


def plan_uses(uses: list[Use], num_leaves: int) -> dict[int, str]:
  """Each use's tap: its own kind for a leaf used once, ``"input"`` for
  every use of a leaf used more than once (their gradients add up before
  the norm)."""
  count = [0] * num_leaves
  for u in uses:
    count[u.leaf] += 1
  return {n: (u.kind if count[u.leaf] == 1 else "input") for n, u in enumerate(uses)}


def fallbacks(uses: list[Use], plan: dict[int, str]) -> dict[int, str]:
  """The leaves whose per-example gradient is computed, with the reason."""
  out: dict[int, str] = {}
  for n, u in enumerate(uses):
    if plan[n] != "input":
      continue
    if u.kind != "input":
      used = sum(1 for v in uses if v.leaf == u.leaf)
      out.setdefault(u.leaf, f"used {used} times, by {u.primitive} among others")
    elif u.primitive not in ELEMENTWISE:
      out.setdefault(u.leaf, f"used by {u.primitive}")
  return out


def _tap_shape(use: Use, kind: str) -> jax.ShapeDtypeStruct:
  """The per-example shape and dtype of a use's tap: the operand's for an
  ``"input"`` tap, the output's for the others."""
  if kind == "input":
    return use.aval
  aval = use.eqn.outvars[0].aval
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype)


# ---------------------------------------------------------------- the norms


def _dot_sq(use: Use, a: jax.Array, g: jax.Array) -> jax.Array:
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


def _gather_sq(use: Use, rows: jax.Array, g: jax.Array) -> jax.Array:
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


def widened(x: jax.Array) -> jax.Array:
  """``x`` in float32 (or its own wider dtype), with exactly the value its
  own dtype holds: a bfloat16 value up-cast is rounded to bfloat16 again
  (``reduce_precision``), since XLA may drop a cast pair f32 -> bf16 -> f32
  and hand one reader the unrounded float32 value and another the rounded
  one (``xla_allow_excess_precision``). The norms and the clipped sum read
  the same values through it, so that each example's share of the sum has
  the norm its clip factor was taken from."""
  dtype = jnp.result_type(x)
  wide = jnp.promote_types(dtype, jnp.float32)
  x = x.astype(wide)
  if dtype == wide or not jnp.issubdtype(dtype, jnp.floating):
    return x
  info = jnp.finfo(dtype)
  return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def _per_example(use: Use, g: jax.Array) -> jax.Array:
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
      total = total + _dot_sq(u, saved[n], tap_grads[n])
    elif plan[n] == "gather":
      total = total + _gather_sq(u, saved[n][0], tap_grads[n])
    else:
      g = _per_example(u, tap_grads[n])
      by_leaf[u.leaf] = g if u.leaf not in by_leaf else by_leaf[u.leaf] + g
  for g in by_leaf.values():
    total = total + jnp.sum(jnp.square(g).reshape(rows, -1), axis=1)
  return total


# ---------------------------------------------------------------- the step


class _Traced(NamedTuple):
  """``fun`` on one example, traced, and what the walk found in it."""

  jaxpr: Any  # a ClosedJaxpr of (parameter, example, shared array leaves)
  out_def: Any  # the treedef of (loss, (weight, aux, state))
  tags: list[Tag | None]
  uses: list[Use]
  plan: dict[int, str]


def _trace(
  per_example: Callable[..., Any],
  leaves: list[Any],
  example: list[Any],
  shared: list[Any],
  closed_over: Sequence[Any] = (),
) -> _Traced:
  """``per_example(leaves, example, shared)`` traced once; an array it
  closes over that an enclosing transformation traces is refused
  (:mod:`jaxaccum._privacy.closure`), unless jaxaccum passed it
  (``closed_over``)."""
  closed, out_shape = jax.make_jaxpr(per_example, return_shape=True)(
    leaves, example, shared
  )
  _closure.refuse_traced_consts(closed, closed_over)
  tags: list[Tag | None] = [Tag(i, ()) for i in range(len(leaves))]
  tags += [None] * (len(example) + len(shared))
  walk = _Walk()
  _run_top(walk, closed, [None] * len(tags), tags)
  plan = plan_uses(walk.uses, len(leaves))
  return _Traced(closed, jax.tree.structure(out_shape), tags, walk.uses, plan)


def _run_top(
  walk: _Walk, closed: Any, args: list[Any], tags: list[Tag | None]
) -> list[Any]:
  outs, out_tags = walk.run(closed.jaxpr, closed.consts, args, tags)
  if out_tags and out_tags[0] is not None:  # the loss is a parameter
    outs[0] = walk.output(outs[0], out_tags[0], closed.jaxpr.outvars[0].aval)
  return outs


def _leaf_names(diff: Any) -> list[str]:
  return [
    jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(diff)[0]
  ]


def _has_convolution(params: Any) -> bool:
  """A jaxpr among an equation's parameters holds a convolution, at any depth."""
  for value in params.values() if isinstance(params, dict) else params:
    if isinstance(value, (tuple, list)):
      if _has_convolution(value):
        return True
      continue
    jaxpr = getattr(value, "jaxpr", value)
    for eqn in getattr(jaxpr, "eqns", ()):
      if eqn.primitive.name == "conv_general_dilated" or _has_convolution(eqn.params):
        return True
  return False


def _refuse_nested_convolutions(traced: _Traced, diff: Any) -> None:
  """A ``ValueError`` where a leaf's per-example gradient would pass through a
  convolution that :func:`_kernel_tap` cannot take, on several devices.

  The walk takes a convolution's kernel by :func:`_kernel_tap` only where it reaches the
  convolution; one inside ``jax.checkpoint``, ``scan``, ``cond`` or a custom
  derivative, or a kernel with ``batch_group_count``, gets a kernel per
  example, whose gradient ``vmap`` makes a convolution grouped over the
  examples: XLA's SPMD partitioner miscompiles it where the examples are
  sharded over devices (the whole clipped sum 2.6% off, silently, on 8 CPU
  devices). Whether this step's rows are sharded is not visible at trace
  time, so any process with more than one device is refused.
  """
  devices = jax.device_count()
  if devices == 1:
    return
  found: dict[int, str] = {}
  for n, u in enumerate(traced.uses):
    if traced.plan[n] != "input" or u.eqn is None or _is_conv_kernel(u.eqn, u.position):
      continue
    name = u.eqn.primitive.name
    if name == "conv_general_dilated" or _has_convolution(u.eqn.params):
      found.setdefault(u.leaf, name)
  if not found:
    return
  paths = _leaf_names(diff)
  named = "; ".join(
    f"args{paths[i]} (used by {why})" for i, why in sorted(found.items())
  )
  raise ValueError(
    f'clip_method="ghost" with {devices} devices: {named} '
    f"{'reaches' if len(found) == 1 else 'reach'} a convolution "
    "that ghost clipping cannot read directly (inside jax.checkpoint, a scan, a "
    "cond or a custom derivative, or with batch_group_count > 1), so each "
    "example would get its own kernel, and the gradient of that vmap forms, a "
    "convolution grouped over the examples, is miscompiled by XLA's SPMD "
    "partitioner where the examples are sharded over devices (every device but "
    "the first gets a zero gradient: the norms, and so the privacy guarantee, "
    'would be wrong; clip_method="vmap" computes the same form). Call the '
    "convolution outside that function (ghost takes the kernel gradient of a "
    "convolution it reaches one window offset at a time), or run in a process "
    "with one device."
  )


def _warn_fallbacks(traced: _Traced, diff: Any) -> None:
  """A :class:`GhostFallbackWarning` naming the leaves whose per-example
  gradient is computed."""
  found = fallbacks(traced.uses, traced.plan)
  if not found:
    return
  paths = _leaf_names(diff)
  named = "; ".join(f"args{paths[i]} ({why})" for i, why in sorted(found.items()))
  warnings.warn(
    f'clip_method="ghost" computes a per-example gradient for {len(found)} '
    f'leaves, as clip_method="vmap" does: {named}. The result is exact; '
    "only dot_general, gather (embedding) and elementwise uses of a leaf used "
    "once are computed without one.",
    GhostFallbackWarning,
    stacklevel=2,
  )


class Weighted(NamedTuple):
  """Ghost clipping's second pass, as a loss (:func:`weighted_loss`).

  Attributes:
    total: shape=(), whose gradient with respect to the differentiated
      leaves' masters is the sum of the kept rows' clipped gradients:
      ``sum_i factor_i * loss_i`` (the loss's dtype) in float32 models; in
      narrower ones the book-kept sums' inner product with the masters
      (float32), a number no one reads.
    losses: each row's loss, from the first pass, shape=(rows,).
    rest: each row's rest (weight, aux, state), stacked over the rows.
    kept: which rows count, shape=(rows,), bool: present, with a finite norm.
  """

  total: jax.Array
  losses: jax.Array
  rest: Any
  kept: jax.Array


def weighted_loss(
  loss_fn: Callable[..., Any],
  args: list[Any],
  *,
  argnums: tuple[int, ...],
  in_axes: list[int | None],
  present: jax.Array,
  clip_norm: float,
  masters: Any = None,
  closed_over: Sequence[Any] = (),
) -> Weighted:
  """Ghost clipping as a loss whose gradient is the clipped sum.

  ``loss_fn(*args)`` is ``fun`` on one example, returning ``(loss, rest)``;
  the arguments with ``in_axes`` 0 hold one row per example, the others are
  shared. The first pass (the norms) reads the differentiated arguments
  ``args[argnums]`` through ``stop_gradient``, so differentiating the
  result's ``total`` with respect to them runs only the second pass's
  backward. A caller that differentiates the sum of several such totals
  (the devices of a data axis, sharing an FSDP leaf) gets their clipped
  sums added inside that backward pass: each example's norm is taken over
  every leaf before the clip, and no device holds a per-example or whole
  gradient of a leaf beyond what the non-private step holds (but for the
  leaves that fall back, :class:`GhostFallbackWarning`).

  ``masters`` (:func:`masters`): the differentiated arguments in the
  accumulator's dtype, to differentiate the total with respect to; the
  leaves in ``args[argnums]`` are then only read. Where ``fun`` computes
  with every leaf in its master's dtype (float32 parameters), the second
  pass is ``fun`` again on the masters, each row's loss weighted by its
  factor. Where it does not (bfloat16 parameters, or a cast to bfloat16 in
  ``fun``), a second pass would seed its backward pass with rounded factors
  and contract the rows in bfloat16, and would not reproduce the first
  pass's bfloat16 values exactly (XLA may keep excess precision in one pass
  and not the other): the clipped sum is then formed in float32 from the
  first pass's own activations and cotangents (:func:`_kept_sums`, Bu et
  al. 2022's book-keeping), each row's share its factor times the very
  gradient whose norm gave the factor, and the total is its inner product
  with the masters.

  The arrays of the other arguments (public, shared, the model's other
  variables) are inputs of the traced program too, so that an array ``fun``
  closes over from an enclosing trace stands out, and is refused unless it
  is among ``closed_over`` (jaxaccum's own).
  """
  diff = tuple(args[n] for n in argnums)
  leaves, diff_def = jax.tree.flatten(diff)
  batched = [n for n, axis in enumerate(in_axes) if axis == 0]
  batch_leaves, batch_def = jax.tree.flatten([args[n] for n in batched])
  others = [n for n in range(len(args)) if n not in argnums and n not in batched]
  other_leaves, other_def = jax.tree.flatten([args[n] for n in others])
  dynamic = [i for i, x in enumerate(other_leaves) if _closure.is_array(x)]
  shared = [other_leaves[i] for i in dynamic]

  def per_example(param_leaves, example_leaves, shared_leaves):
    call = list(args)
    for n, d in zip(argnums, jax.tree.unflatten(diff_def, param_leaves), strict=True):
      call[n] = d
    for n, b in zip(
      batched, jax.tree.unflatten(batch_def, example_leaves), strict=True
    ):
      call[n] = b
    rest = list(other_leaves)
    for i, x in zip(dynamic, shared_leaves, strict=True):
      rest[i] = x
    for n, a in zip(others, jax.tree.unflatten(other_def, rest), strict=True):
      call[n] = a
    return loss_fn(*call)

  example = [jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in batch_leaves]
  traced = _trace(per_example, leaves, example, shared, closed_over)
  _refuse_nested_convolutions(traced, diff)
  _warn_fallbacks(traced, diff)
  first = _factors(
    traced,
    jax.lax.stop_gradient(leaves),
    batch_leaves,
    shared,
    present=present,
    clip_norm=clip_norm,
  )
  factor, kept, (losses, rest) = first.factor, first.kept, first.out
  wide = leaves if masters is None else jax.tree.leaves(masters)
  if _rounds(traced, leaves, wide):
    sums = _kept_sums(traced, first, wide)
    total = sum(
      (jnp.sum(jax.lax.stop_gradient(s) * w) for s, w in zip(sums, wide, strict=True)),
      start=jnp.zeros((), jnp.float32),
    )
    return Weighted(total, losses, rest, kept)
  # The second pass runs fun again (the first pass's activations are dead by
  # then: the peak is one pass's), on rows where each row not kept is
  # replaced by a kept one: its weight 0 then multiplies finite numbers.
  # Where no row is kept, a row with a finite norm stands in; where there is
  # none, zeros do (a device of a data axis whose rows all failed still adds
  # its zero to the leaves it shares with the others).
  batch = [
    _usable_rows(_take_rows(x, first.stand_in), first.usable) for x in batch_leaves
  ]
  again = jax.vmap(lambda p, b: per_example(p, b, shared)[0], in_axes=(None, 0))(
    wide, batch
  )
  total = jnp.sum(again * factor.astype(again.dtype))
  return Weighted(total, losses, rest, kept)


def masters(diff: PyTree, accum_dtype: Any) -> PyTree:
  """The differentiated arguments in the accumulator's dtype (float32 for
  bfloat16 leaves; a float32 leaf is itself), for :func:`weighted_loss`."""
  return jax.tree.map(
    lambda x: x.astype(_normalize.accumulator_dtype(accum_dtype, x)), diff
  )


def _rounds(traced: _Traced, leaves: list[Any], wide: list[Any]) -> bool:
  """Whether ``fun`` computes with a leaf in another dtype than its master
  (bfloat16 parameters, or a cast in ``fun``)."""
  if any(
    jnp.result_type(a) != jnp.result_type(b) for a, b in zip(leaves, wide, strict=True)
  ):
    return True
  return any(u.aval.dtype != jnp.result_type(wide[u.leaf]) for u in traced.uses)


def _kept_sums(traced: _Traced, first: _FirstPass, wide: list[Any]) -> list[jax.Array]:
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
      per = _kept_rows(first.kept, _per_example(u, g).astype(dtype))
      share = jnp.einsum(
        "m,m...->...",
        first.factor.astype(dtype),
        per,
        precision=_HIGHEST,
        out_sharding=_compat.explicit_spec(wide[u.leaf]),
      )
    else:
      ct = _kept_rows(first.kept, widened(g).astype(dtype))
      ct = ct * first.factor.astype(dtype).reshape((rows,) + (1,) * (ct.ndim - 1))
      saved = first.saved[n]
      if u.kind == "dot":  # the activation, whose rows not kept may be NaN
        saved = _kept_rows(first.kept, widened(saved).astype(dtype))
      share = _transposed(u, saved, ct, wide[u.leaf])
    sums[u.leaf] = share if sums[u.leaf] is None else sums[u.leaf] + share
  return [
    jnp.zeros(jnp.shape(w), jnp.result_type(w))
    if s is None
    else s.astype(jnp.result_type(w))
    for s, w in zip(sums, wide, strict=True)
  ]


_HIGHEST = jax.lax.Precision.HIGHEST


def _kept_rows(kept: jax.Array, x: jax.Array) -> jax.Array:
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


class _FirstPass(NamedTuple):
  """The first pass (:func:`_factors`).

  Attributes:
    factor: each row's clip factor ``min(1, C / norm)``, 0 where not kept;
      shape=(rows,), float32.
    kept: the rows that count: present, with a finite norm; shape=(rows,).
    stand_in: the row that stands in for each row in the second pass.
    usable: whether that row is usable (finite); shape=(), bool.
    out: ``(losses, rest)``, each row's loss and rest.
    tap_grads: each use's tap cotangent, per row.
    saved: what each ``dot`` and ``gather`` use kept (:func:`_saved`).
  """

  factor: jax.Array
  kept: jax.Array
  stand_in: jax.Array
  usable: jax.Array
  out: Any
  tap_grads: dict[int, jax.Array]
  saved: dict[int, Any]


def _factors(
  traced: _Traced,
  leaves: list[Any],
  batch_leaves: list[Any],
  shared: list[Any],
  *,
  present: jax.Array,
  clip_norm: float,
) -> _FirstPass:
  """The first pass: each row's clip factor, which rows are kept, the row
  that stands in for each row in the second pass, and what the norms were
  taken from (:class:`_FirstPass`)."""
  rows = present.shape[0]
  taps = {
    n: _rows_like_batch(jnp.zeros((rows, *s.shape), s.dtype), batch_leaves)
    for n, s in ((n, _tap_shape(traced.uses[n], k)) for n, k in traced.plan.items())
  }
  forward = _forward(traced)
  losses, tap_vjp, (rest, saved) = jax.vjp(
    lambda t: forward(leaves, t, batch_leaves, shared), taps, has_aux=True
  )
  (tap_grads,) = tap_vjp(jnp.ones_like(losses))
  norm = jnp.sqrt(squared_norms(traced.uses, traced.plan, tap_grads, saved, rows))
  finite = jnp.isfinite(norm)
  kept = present & finite
  clip = jnp.float32(clip_norm)
  factor = jnp.where(kept, clip / jnp.maximum(norm, clip), jnp.float32(0))
  stand_in = jnp.where(jnp.any(kept), kept, finite)
  index = jnp.where(kept, jnp.arange(rows), jnp.argmax(stand_in))
  return _FirstPass(
    factor, kept, index, jnp.any(stand_in), (losses, rest), tap_grads, saved
  )


def _usable_rows(x: jax.Array, usable: jax.Array) -> jax.Array:
  """``x``, or zeros where no row is usable (a key stays: it is never the
  reason a row is not finite)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    return x
  return jnp.where(usable, x, jnp.zeros_like(x))


def clipped_sum(
  loss_fn: Callable[..., Any],
  args: list[Any],
  *,
  argnums: tuple[int, ...],
  in_axes: list[int | None],
  present: jax.Array,
  clip_norm: float,
  accum_dtype: Any,
  closed_over: Sequence[Any] = (),
) -> tuple[tuple[jax.Array, Any], tuple[PyTree, ...]]:
  """The sum of the kept rows' clipped gradients, by ghost clipping: the
  gradient of :func:`weighted_loss`'s total.

  Returns ``((losses, rest), grads)``: each row's loss and rest (stacked),
  and a tuple (one per ``argnums``) of the clipped sums, in (at least)
  ``accum_dtype``. A row is kept when ``present`` and its norm is finite;
  the others add exactly zero.
  """

  def objective(wide):
    weighted = weighted_loss(
      loss_fn,
      args,
      argnums=argnums,
      in_axes=in_axes,
      present=present,
      clip_norm=clip_norm,
      masters=wide,
      closed_over=closed_over,
    )
    return weighted.total, weighted

  wide = masters(tuple(args[n] for n in argnums), accum_dtype)
  (_, weighted), grads = jax.value_and_grad(objective, has_aux=True)(wide)
  return (weighted.losses, weighted.rest), kept_only(
    grads, jnp.any(weighted.kept), accum_dtype
  )


def kept_only(grads: PyTree, some: jax.Array, accum_dtype: Any) -> PyTree:
  """``grads`` in (at least) ``accum_dtype``, or exactly zero where no row
  was kept (``some`` False: every weight was 0)."""
  return jax.tree.map(
    lambda g: jnp.where(some, g, jnp.zeros_like(g)).astype(
      _normalize.accumulator_dtype(accum_dtype, g)
    ),
    grads,
  )


def _take_rows(x: jax.Array, index: jax.Array) -> jax.Array:
  """``x[index]``, laid out as ``x`` on an Explicit mesh."""
  spec = _compat.explicit_spec(x)
  if spec is None:
    return jnp.take(x, index, axis=0)
  return x.at[index].get(out_sharding=spec)


def _rows_like_batch(x: jax.Array, batch_leaves: list[Any]) -> jax.Array:
  """``x`` with its rows sharded as the batch's, on an Explicit mesh (where
  ``vmap``'s mapped inputs must agree)."""
  for leaf in batch_leaves:
    spec = _compat.explicit_spec(leaf)
    if spec is not None and len(spec) and spec[0] is not None:
      row = jax.sharding.PartitionSpec(spec[0], *([None] * (x.ndim - 1)))
      return jax.sharding.reshard(x, row)
  return x


def _forward(traced: _Traced) -> Callable[..., Any]:
  """``(param_leaves, taps, batch_leaves, shared) -> (losses, (rest,
  saved))`` over every row: the tapped walk of the traced jaxpr, under
  ``vmap``."""

  def one(param_leaves, example_leaves, example_taps, shared):
    walk = _Walk(traced.plan, example_taps)
    outs = _run_top(
      walk, traced.jaxpr, [*param_leaves, *example_leaves, *shared], traced.tags
    )
    loss, rest = jax.tree.unflatten(traced.out_def, outs)
    return loss, (rest, walk.saved)

  def forward(param_leaves, taps, batch_leaves, shared):
    return jax.vmap(one, in_axes=(None, 0, 0, None))(
      param_leaves, batch_leaves, taps, shared
    )

  return forward
