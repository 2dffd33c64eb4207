"""A parameter's uses in ``fun``'s per-example program, found by the
one walker (:class:`jaxaccum._jaxpr.Walker`): each use tapped by its kind.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from jaxaccum import _jaxpr
from jaxaccum._privacy.ghost.kernel import kernel_tap

PyTree = Any

#: Operations that only move, cast or repeat a parameter's entries: a
#: parameter seen through them is still that parameter.
VIEW_PRIMITIVES = frozenset(
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
_NORM_KEEPING = VIEW_PRIMITIVES - {"broadcast_in_dim"}

#: Uses whose per-example gradient is as large as the activation they meet.
ACTIVATION_SIZED = frozenset(
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


class Walk(_jaxpr.Walker):
  """Evaluates a per-example jaxpr, following the parameters to their uses
  (the metadata beside a value: the :class:`Tag` of the leaf it views).

  With ``plan=None`` it only records the uses (no value is computed); with a
  plan (use number -> kind) it adds ``taps[n]`` at use ``n`` and keeps what
  the norms need in ``saved``.
  """

  rules: ClassVar[dict[str, str]] = {name: "view" for name in VIEW_PRIMITIVES}

  def __init__(self, plan: dict[int, str] | None = None, taps: Any = None):
    self.plan = plan
    self.taps = taps
    self.uses: list[Use] = []
    self.saved: dict[int, jax.Array] = {}

  def plain(self, eqn: Any, invals: list[Any]) -> list[Any]:
    if self.plan is None:
      return [None] * len(eqn.outvars)
    return _jaxpr.bind(eqn, invals)

  def view(self, eqn: Any, invals: list[Any], intags: list[Tag | None]):
    """An operation that only views the leaf: the tag follows it."""
    if intags[0] is None or any(t is not None for t in intags[1:]):
      return self.default(eqn, invals, intags)
    view = View(
      eqn.primitive.name,
      dict(eqn.params),
      tuple(eqn.invars[0].aval.shape),
      eqn.primitive,
    )
    tag = Tag(intags[0].leaf, (*intags[0].chain, view))
    return self.plain(eqn, invals), [tag]

  def default(self, eqn: Any, invals: list[Any], intags: list[Tag | None]):
    """A use of the leaf: recorded, and tapped where the plan says."""
    kind = _kind(eqn, intags)
    numbers = []
    for position, tag in enumerate(intags):
      if tag is not None:
        numbers.append(len(self.uses))
        aval = eqn.invars[position].aval
        shape = jax.ShapeDtypeStruct(aval.shape, aval.dtype)
        self.uses.append(Use(tag.leaf, kind, eqn, position, tag, shape))
    if self.plan is None:
      return self.plain(eqn, invals), [None] * len(eqn.outvars)
    invals = list(invals)
    kernel_taps = []
    for n in numbers:
      if self.plan[n] == "input":
        p = self.uses[n].position
        if is_conv_kernel(eqn, p):
          kernel_taps.append(n)
          continue
        invals[p] = jax.lax.add(
          invals[p], self.taps[n].astype(jnp.result_type(invals[p]))
        )
    outs = self.plain(eqn, invals)
    for n in kernel_taps:  # the kernel stays the same for every example
      outs[0] = jax.lax.add(outs[0], kernel_tap(eqn, invals[0], self.taps[n]))
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


def is_conv_kernel(eqn: Any, position: int) -> bool:
  """The operand is a convolution's kernel, tapped by :func:`kernel_tap`."""
  return (
    eqn.primitive.name == "conv_general_dilated"
    and position == 1
    and eqn.params["batch_group_count"] == 1
  )


def _saved(use: Use, invals: list[Any]) -> Any:
  """What the norm of a tapped ``dot`` or ``gather`` needs besides the
  output's cotangent: the activation, or the row each output slice took
  and the indices (for the embedding's clipped sum, :func:`kept_sums`)."""
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
    elif u.primitive not in ACTIVATION_SIZED:
      out.setdefault(u.leaf, f"used by {u.primitive}")
  return out


def tap_shape(use: Use, kind: str) -> jax.ShapeDtypeStruct:
  """The per-example shape and dtype of a use's tap: the operand's for an
  ``"input"`` tap, the output's for the others."""
  if kind == "input":
    return use.aval
  aval = use.eqn.outvars[0].aval
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype)
