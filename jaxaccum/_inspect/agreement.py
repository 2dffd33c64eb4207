"""Do all devices take the same decisions? Values followed through HLO.

Every device of an SPMD program runs the same compiled code on its own
shard. A decision (the predicate of a ``conditional``, the condition of a
``while``) that one device takes on a value that differs between devices can
send devices down different paths: on a GPU or TPU, a collective that only
some of them reach hangs; without a collective, the replicas' parameters drift
apart silently. So every such predicate must be computed from values that are
the same on every device, i.e. reduced over the devices first, and so must
every output that is replicated.

This module reads that off the compiled, partitioned HLO text, for each mesh
axis: along which axes may a value differ between devices? It follows values
from their sources to the decisions and outputs:

- an entry parameter differs along the axes its sharding splits it over;
- ``partition-id`` differs along every axis, and the small integer
  computations made from it (offsets into constant tables, as the
  partitioner writes them) are evaluated per device, so that an offset that
  only moves along ``model`` counts as differing along ``model`` only;
- an ``all-reduce`` or ``all-gather`` makes its result the same within each
  replica group: it no longer differs along the axes its groups span; a
  ``reduce-scatter``, ``all-to-all`` or ``collective-permute`` makes it
  differ along them;
- every other instruction differs wherever one of its operands does; loops
  are followed to a fixed point, calls and fusions into their computations.

The analysis is conservative: what it cannot evaluate it assumes may differ.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, NamedTuple, Union

import numpy as np

from jaxaccum._inspect import hlo as _hlo

Axes = frozenset[int]
Taint = Union[Axes, tuple["Taint", ...]]  # noqa: UP007  (a recursive alias)

_NONE: Axes = frozenset()
_BOOLS = {"true": 1, "false": 0}
_MAX_ITERATIONS = 64
_MAX_TABLE = 4096

_SAME_WITHIN_GROUP = {
  "all-reduce",
  "all-reduce-start",
  "all-gather",
  "all-gather-start",
}
_SPLIT_WITHIN_GROUP = {
  "reduce-scatter",
  "reduce-scatter-start",
  "all-to-all",
  "all-to-all-start",
  "ragged-all-to-all",
}
_MOVING = {"collective-permute", "collective-permute-start", "collective-broadcast"}
_PASS_THROUGH = {
  "all-reduce-done",
  "all-gather-done",
  "collective-permute-done",
  "async-done",
  "async-update",
  "copy-start",
  "copy-done",
}
_PER_DEVICE_SOURCES = {"rng", "rng-get-and-update-state", "infeed", "recv", "recv-done"}

_BINARY = {
  "add": np.add,
  "subtract": np.subtract,
  "multiply": np.multiply,
  "maximum": np.maximum,
  "minimum": np.minimum,
  "and": np.bitwise_and,
  "or": np.bitwise_or,
  "xor": np.bitwise_xor,
  "shift-left": np.left_shift,
  "shift-right-logical": np.right_shift,
  "shift-right-arithmetic": np.right_shift,
  "remainder": np.fmod,
}
_UNARY = {"convert", "copy", "bitcast", "reshape", "broadcast", "bitcast-convert"}
_COMPARE = {
  "EQ": np.equal,
  "NE": np.not_equal,
  "LT": np.less,
  "LE": np.less_equal,
  "GT": np.greater,
  "GE": np.greater_equal,
}


class Divergence(NamedTuple):
  """A decision or a replicated output that devices could compute differently.

  Attributes:
    kind: ``"conditional"`` (its predicate or branch index), ``"while"``
      (its condition) or ``"output"`` (a result replicated over axes along
      which its value may differ).
    instruction: the HLO instruction (for an output, ``"output N"``).
    op_name: the JAX operation it came from, as XLA's metadata names it.
    axes: the mesh axes along which it may differ.
  """

  kind: str
  instruction: str
  op_name: str
  axes: tuple[str, ...]


class Grid(NamedTuple):
  """The devices of the program: partition ``p`` is the device at flat
  position ``p`` of a mesh of this shape (the order ``jit`` assigns)."""

  shape: tuple[int, ...]
  names: tuple[str, ...]

  @property
  def size(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64))

  @property
  def every_axis(self) -> Axes:
    return frozenset(range(len(self.shape)))

  def differs(self, per_device: np.ndarray) -> Axes:
    """The axes along which ``per_device`` (one row per partition) varies.

    >>> Grid((2, 4), ("data", "model")).differs(np.arange(8) % 4)
    frozenset({1})
    """
    values = np.asarray(per_device).reshape(*self.shape, -1)
    return frozenset(
      a
      for a in range(len(self.shape))
      if not np.array_equal(
        values, np.take(values, [0], axis=a).repeat(self.shape[a], axis=a)
      )
    )

  def spanned(self, groups: tuple[tuple[int, ...], ...] | None) -> Axes:
    """The axes along which every replica group holds whole lines of
    devices: a value made the same within each group no longer differs
    along them. ``()`` (XLA's ``replica_groups={}``) is one group of all.

    >>> g = Grid((2, 4), ("data", "model"))
    >>> sorted(g.spanned(((0, 4), (1, 5), (2, 6), (3, 7)))), sorted(g.spanned(()))
    ([0], [0, 1])
    """
    if groups is None:
      return _NONE
    if not groups:
      return self.every_axis
    label = np.full(self.size, -1)
    for g, members in enumerate(groups):
      label[list(members)] = g
    if (label < 0).any():
      return _NONE
    return self.every_axis - self.differs(label)


def flat(taint: Taint) -> Axes:
  """The union of a (tuple) taint's axes."""
  if isinstance(taint, tuple):
    return frozenset().union(*map(flat, taint)) if taint else _NONE
  return taint


def join(a: Taint, b: Taint) -> Taint:
  """The union of two taints, element by element where both are tuples of
  the same length."""
  if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
    return tuple(join(x, y) for x, y in zip(a, b, strict=True))
  return flat(a) | flat(b)


def _widen(taint: Taint, axes: Axes) -> Taint:
  if isinstance(taint, tuple):
    return tuple(_widen(t, axes) for t in taint)
  return taint | axes


class _Value(NamedTuple):
  """What is known of one instruction's result: the axes along which it may
  differ, and, for small integer values, its value on every device (one row
  per partition)."""

  taint: Taint
  per_device: np.ndarray | None = None


def sharding_taint(text: str | None, grid: Grid) -> Taint:
  """The axes along which a value with this HLO sharding differs.

  >>> g = Grid((2, 4), ("data", "model"))
  >>> sharding_taint("{devices=[2,1,4]<=[8] last_tile_dim_replicate}", g)
  frozenset({0})
  >>> sharding_taint("{devices=[4,2]<=[2,4]T(1,0) last_tile_dim_replicate}", g)
  frozenset({1})
  >>> sharding_taint("{{replicated}, {devices=[8]<=[8]}}", g)
  (frozenset(), frozenset({0, 1}))
  """
  if text is None:
    return _NONE if grid.size == 1 else grid.every_axis
  inner = text.strip()
  if inner.startswith("{") and inner.endswith("}"):
    inner = inner[1:-1].strip()
  if inner.startswith("{"):
    return tuple(sharding_taint(part, grid) for part in _hlo._top_level(f"({inner})"))
  if inner.startswith(("replicated", "maximal")) or not inner:
    return _NONE
  match = re.match(
    r"devices=\[([\d,]+)\](?:<=\[([\d,]+)\](?:T\(([\d,]+)\))?|([\d,]+))", inner
  )
  if not match:
    return grid.every_axis  # manual, unreduced, unknown: may differ anywhere
  tiles = _hlo._ints(match.group(1))
  if match.group(2):
    devices = _hlo._iota(_hlo._ints(match.group(2)), _hlo._ints(match.group(3)) or None)
  else:
    devices = np.asarray(_hlo._ints(match.group(4)))
  devices = devices.reshape(tiles)
  kinds = ["data"] * len(tiles)
  if "last_tile_dim_replicate" in inner:
    kinds[-1] = "replicated"
  subgroups = re.search(r"last_tile_dims=\{([^}]*)\}", inner)
  if subgroups:
    types = [t.strip() for t in subgroups.group(1).split(",")]
    kinds[len(kinds) - len(types) :] = types
  keep = [d for d, kind in enumerate(kinds) if kind != "replicated"]
  where = np.empty((grid.size, len(keep)), dtype=np.int64)
  for index in np.ndindex(*tiles):
    where[devices[index]] = [index[d] for d in keep]
  return grid.differs(where)


def _sharding_text(attributes: str) -> str | None:
  start = attributes.find("sharding={")
  if start < 0:
    return None
  open_at = start + len("sharding=")
  return attributes[open_at : _hlo._closing(attributes, open_at) + 1]


def _constant(i: _hlo.Instruction, grid: Grid) -> np.ndarray | None:
  """A small integer or boolean constant, one row per device."""
  if not re.match(r"(s|u)\d+\[|pred\[", i.type):
    return None
  text = i.arguments.replace("{", " ").replace("}", " ").replace(",", " ")
  words = text.split()
  if not words or len(words) > _MAX_TABLE:
    return None
  try:
    values = np.asarray([_BOOLS[w] if w in _BOOLS else int(w) for w in words])
  except ValueError:
    return None
  if values.size == 1:
    return np.full(grid.size, values[0])
  return np.tile(values, (grid.size, 1))


class _Analysis:
  """The fixed-point walk over one module."""

  def __init__(
    self, module: _hlo.Module, grid: Grid, inputs: Sequence[Axes | None] | None
  ):
    self.module = module
    self.grid = grid
    self.inputs = inputs
    self.decisions: dict[tuple[str, str], tuple[str, str, Axes]] = {}
    self._memo: dict[Any, _Value] = {}

  def run(self, name: str, params: Sequence[_Value] | None) -> _Value:
    """The root of computation ``name`` with these parameters (None: the
    entry, whose parameters come from their shardings)."""
    key = None
    if params is not None:
      key = (name, tuple((p.taint, _frozen(p.per_device)) for p in params))
      if key in self._memo:
        return self._memo[key]
    env: dict[str, _Value] = {}
    root = _Value(_NONE)
    for i in self.module.computations.get(name, []):
      value = self._instruction(name, i, env, params)
      env[i.name] = value
      if i.root:
        root = value
    if key is not None:
      self._memo[key] = root
    return root

  def _instruction(
    self,
    computation: str,
    i: _hlo.Instruction,
    env: dict[str, _Value],
    params: Sequence[_Value] | None,
  ) -> _Value:
    operands = [env.get(o, _Value(self.grid.every_axis)) for o in i.operands]
    if i.op == "parameter":
      return self._parameter(i, params)
    if i.op in ("while", "conditional"):
      return self._decision(computation, i, operands)
    for rule in (self._sources, _structure, self._communication, self._call):
      value = rule(i, operands)
      if value is not None:
        return value
    per_device = _evaluate(i, [o.per_device for o in operands])
    if per_device is not None:
      return _Value(self.grid.differs(per_device), per_device)
    return _Value(_union(operands))

  def _communication(
    self, i: _hlo.Instruction, operands: list[_Value]
  ) -> _Value | None:
    if i.op in _SAME_WITHIN_GROUP | _SPLIT_WITHIN_GROUP | _MOVING:
      return self._collective(i, operands)
    if i.op in _PASS_THROUGH:
      return _Value(_union(operands))
    return None

  def _call(self, i: _hlo.Instruction, operands: list[_Value]) -> _Value | None:
    """Fusions, calls and asynchronous starts: their computation's root."""
    called = i.attribute("calls") or (
      i.attribute("to_apply") if i.op == "call" else None
    )
    if called is None:
      return None
    inner = self.run(called, operands)
    if i.op == "custom-call":
      return _Value(join(inner.taint, _union(operands)))
    return inner

  def _parameter(self, i: _hlo.Instruction, params: Sequence[_Value] | None) -> _Value:
    """The entry's parameters differ as their shardings say (the program's
    input shardings, or the HLO's annotation); a called computation's are
    what its caller passed."""
    n = int(i.arguments.strip() or 0)
    if params is None:
      known = (
        self.inputs[n] if self.inputs is not None and n < len(self.inputs) else None
      )
      if known is not None:
        return _Value(known)
      return _Value(sharding_taint(_sharding_text(i.attributes), self.grid))
    return params[n] if n < len(params) else _Value(self.grid.every_axis)

  def _sources(self, i: _hlo.Instruction, operands: list[_Value]) -> _Value | None:
    """Values that come from nowhere else: constants, device ids, random
    state; None for other instructions."""
    del operands
    if i.op == "constant":
      return _Value(_NONE, _constant(i, self.grid))
    if i.op == "partition-id":
      ids = np.arange(self.grid.size)
      return _Value(self.grid.differs(ids), ids)
    if i.op == "replica-id":  # one replica: jit partitions, it does not replicate
      return _Value(_NONE, np.zeros(self.grid.size, dtype=np.int64))
    if i.op in _PER_DEVICE_SOURCES:
      return _Value(self.grid.every_axis)
    return None

  def _decision(
    self, computation: str, i: _hlo.Instruction, operands: list[_Value]
  ) -> _Value:
    if i.op == "while":
      return self._while(computation, i, operands[0])
    return self._conditional(computation, i, operands)

  def _collective(self, i: _hlo.Instruction, operands: list[_Value]) -> _Value:
    groups = _hlo.replica_groups(i.attributes)
    if "channel_id=" not in i.attributes and i.op != "collective-permute":
      groups = tuple((p,) for p in range(self.grid.size))  # within a replica: none
    if i.op in _MOVING:
      pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", i.attributes)
      moved = self.grid.every_axis
      if pairs:
        links = [
          tuple(map(int, p)) for p in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1))
        ]
        coords = np.array(np.unravel_index(np.arange(self.grid.size), self.grid.shape))
        moved = frozenset(
          a
          for a in range(len(self.grid.shape))
          for s, t in links
          if coords[a, s] != coords[a, t]
        )
      return _Value(_union(operands) | moved)
    spanned = self.grid.spanned(groups)
    if i.op in _SPLIT_WITHIN_GROUP:
      return _Value(_union(operands) | spanned)
    taints = tuple(flat(o.taint) - spanned for o in operands)
    if i.type.strip().startswith("(") and len(taints) > 1:
      return _Value(taints)
    return _Value(frozenset().union(*taints) if taints else _NONE)

  def _while(self, computation: str, i: _hlo.Instruction, init: _Value) -> _Value:
    body, condition = i.attribute("body"), i.attribute("condition")
    carry = init.taint
    for _ in range(_MAX_ITERATIONS):
      after = self.run(body, [_Value(carry)]).taint if body else carry
      widened = join(carry, after)
      if widened == carry:
        break
      carry = widened
    else:
      carry = _widen(carry, self.grid.every_axis)
    if condition:
      decided = self.run(condition, [_Value(carry)])
      self._decide("while", computation, i, flat(decided.taint))
    return _Value(carry)

  def _conditional(
    self, computation: str, i: _hlo.Instruction, operands: list[_Value]
  ) -> _Value:
    predicate = flat(operands[0].taint)
    self._decide("conditional", computation, i, predicate)
    result: Taint | None = None
    for n, branch in enumerate(i.branches()):
      argument = (
        operands[n + 1] if n + 1 < len(operands) else _Value(self.grid.every_axis)
      )
      root = self.run(branch, [argument]).taint
      result = root if result is None else join(result, root)
    return _Value(_widen(result if result is not None else _NONE, predicate))

  def _decide(
    self, kind: str, computation: str, i: _hlo.Instruction, axes: Axes
  ) -> None:
    key = (computation, i.name)
    old = self.decisions.get(key)
    self.decisions[key] = (kind, i.op_name, axes | (old[2] if old else _NONE))


def _structure(i: _hlo.Instruction, operands: list[_Value]) -> _Value | None:
  """Tuples and their elements, and the identities on them (a copy, an
  optimization barrier)."""
  if i.op == "tuple":
    return _Value(tuple(o.taint for o in operands))
  if i.op in ("opt-barrier", "copy") and len(operands) == 1:
    return operands[0]
  if i.op != "get-tuple-element":
    return None
  index = re.search(r"index=(\d+)", i.attributes)
  taint = operands[0].taint
  if isinstance(taint, tuple) and index:
    return _Value(taint[int(index.group(1))])
  return _Value(flat(taint))


def _frozen(per_device: np.ndarray | None) -> Any:
  return None if per_device is None else (per_device.shape, per_device.tobytes())


def _union(operands: Sequence[_Value]) -> Axes:
  return frozenset().union(*(flat(o.taint) for o in operands)) if operands else _NONE


def _evaluate(
  i: _hlo.Instruction, values: list[np.ndarray | None]
) -> np.ndarray | None:
  """The small integer computations made of device ids and constant tables,
  evaluated on every device (None where they are anything else)."""
  known = [v for v in values if v is not None]
  if not known or len(known) != len(values):
    return None
  evaluate = _EVALUATORS.get(i.op)
  if evaluate is None:
    return None
  try:
    with np.errstate(all="ignore"):
      return evaluate(i, known)
  except (TypeError, ValueError, IndexError):
    return None


def _elementwise(i: _hlo.Instruction, v: list[np.ndarray]) -> np.ndarray | None:
  if i.op in _UNARY:
    return v[0] if len(v) == 1 and v[0].ndim == 1 else None
  if i.op == "negate":
    return -v[0]
  if len(v) != 2 or v[0].shape != v[1].shape:
    return None
  if i.op == "divide":
    return np.trunc(v[0] / v[1]).astype(np.int64) if (v[1] != 0).all() else None
  if i.op == "compare":
    direction = re.search(r"direction=(\w+)", i.attributes)
    compare = _COMPARE.get(direction.group(1)) if direction else None
    return None if compare is None else compare(v[0], v[1]).astype(np.int64)
  return _BINARY[i.op](v[0], v[1])


def _choice(i: _hlo.Instruction, v: list[np.ndarray]) -> np.ndarray | None:
  if len(v) != 3:
    return None
  if i.op == "select":
    return np.where(v[0] != 0, v[1], v[2])
  return np.clip(v[1], v[0], v[2])  # clamp(lo, x, hi)


def _lookup(i: _hlo.Instruction, v: list[np.ndarray]) -> np.ndarray | None:
  """``dynamic-slice`` of one entry of a constant table."""
  del i
  if len(v) != 2 or v[0].ndim != 2 or v[1].ndim != 1:
    return None
  table, index = v
  index = np.clip(index, 0, table.shape[1] - 1).astype(np.int64)
  return table[np.arange(table.shape[0]), index]


_EVALUATORS = {
  **dict.fromkeys([*_BINARY, *_UNARY, "negate", "divide", "compare"], _elementwise),
  "select": _choice,
  "clamp": _choice,
  "dynamic-slice": _lookup,
}


def divergences(
  hlo_text: str,
  mesh_shape: Sequence[int],
  axis_names: Sequence[str],
  *,
  input_axes: Sequence[Axes | None] | None = None,
  output_axes: Sequence[Axes | None] | None = None,
  checked: Sequence[str] | None = None,
) -> list[Divergence]:
  """Decisions and replicated outputs of a compiled program that could
  differ between devices along the ``checked`` axes (default: all).

  Args:
    hlo_text: the compiled, partitioned HLO (``compiled.as_text()``).
    mesh_shape: the mesh's shape; partition ``p`` is its ``p``-th device.
    axis_names: the mesh's axis names.
    input_axes: per parameter of the entry computation, the axes its value
      is sharded along (None where unknown: then the HLO's own sharding
      annotation, which newer XLA versions leave out, or every axis).
    output_axes: per output of the entry computation, the axes it is sharded
      along (it may differ along those); None skips the outputs (or one).
    checked: the axis names to check.

  >>> text = '''
  ... ENTRY %main (a: f32[8]) -> f32[] {
  ...   %a = f32[1]{0} parameter(0), sharding={devices=[8]<=[8]}
  ...   %s = f32[] reduce(%a, %z), to_apply=%add
  ...   %r = f32[] all-reduce(%s), channel_id=1, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%add
  ...   %p = pred[] compare(%s, %s), direction=GT
  ...   ROOT %c = f32[] conditional(%p, %r, %r), true_computation=%t, false_computation=%f
  ... }'''
  >>> [(d.kind, d.instruction, d.axes) for d in divergences(text, (8,), ("data",))]
  [('conditional', 'c', ('data',))]
  """
  grid = Grid(tuple(int(n) for n in mesh_shape), tuple(axis_names))
  names = list(grid.names) if checked is None else list(checked)
  unknown = [n for n in names if n not in grid.names]
  if unknown:
    raise ValueError(f"Unknown mesh axes {unknown}; the mesh has {grid.names}.")
  wanted = frozenset(grid.names.index(n) for n in names)
  module = _hlo.parse(hlo_text)
  analysis = _Analysis(module, grid, input_axes)
  root = analysis.run(module.entry, None)
  found = [
    Divergence(kind, name, op_name, _named(axes & wanted, grid))
    for (_, name), (kind, op_name, axes) in analysis.decisions.items()
    if axes & wanted
  ]
  if output_axes is not None:
    outputs = list(root.taint) if isinstance(root.taint, tuple) else [root.taint]
    if len(outputs) != len(output_axes):
      raise ValueError(
        f"The program has {len(outputs)} outputs, but {len(output_axes)} "
        "output shardings were given."
      )
    for n, (taint, allowed) in enumerate(zip(outputs, output_axes, strict=True)):
      if allowed is None:
        continue
      axes = (flat(taint) - allowed) & wanted
      if axes:
        found.append(Divergence("output", f"output {n}", "", _named(axes, grid)))
  return found


def _named(axes: Axes, grid: Grid) -> tuple[str, ...]:
  return tuple(grid.names[a] for a in sorted(axes))
