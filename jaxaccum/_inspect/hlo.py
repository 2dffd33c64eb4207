"""Reading compiled HLO text: its computations and instructions, and the
collectives a step runs.

The one parser of XLA's HLO text in jaxaccum: :mod:`jaxaccum.testing`
re-exports what users need (:func:`collectives`, :func:`bytes_communicated`,
:func:`replica_groups`), :mod:`jaxaccum._inspect.planner` counts a planned step's
bytes with it, and :mod:`jaxaccum._inspect.agreement` follows values through it to
find decisions that could differ between devices.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

COLLECTIVES = (
  "all-reduce",
  "all-reduce-start",
  "reduce-scatter",
  "all-gather",
  "all-gather-start",
  "all-to-all",
  "all-to-all-start",
  "reduce-scatter-start",
  "collective-permute",
  "collective-permute-start",
)
"""The HLO ops that :func:`collectives` counts: XLA's collectives, and the
asynchronous start ops that stand for them."""

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
    "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1,
}  # fmt: skip

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_INSTRUCTION = re.compile(
  r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\("
)
_CALLED = re.compile(
  r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_GROUP_LISTS = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_GROUP_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_GROUP_MESH = re.compile(
  r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\]"
  r"(?:T\(([\d,]+)\))?\))?\s*\{([^}]*)\}"
)
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{[\d,]*\},?)*)\}")
_TRIP_COUNT = re.compile(r'known_trip_count[^0-9]*"?n"?\s*:\s*"?(\d+)')
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\dm\d\w*)?)\[([\d,]*)\]")


class Instruction(NamedTuple):
  """One HLO instruction, as printed.

  Attributes:
    name: its name, without ``%``.
    type: its result type, e.g. ``f32[4,8]{1,0}`` or a tuple ``(s32[], ...)``.
    op: the opcode, e.g. ``all-reduce``.
    operands: the names of its operands, in order.
    attributes: the text after the operand list (``replica_groups=...``,
      ``calls=...``, ``metadata=...``).
    root: whether it is its computation's root.
    arguments: the text of the operand list (a constant's value, a
      parameter's number).
  """

  name: str
  type: str
  op: str
  operands: tuple[str, ...]
  attributes: str
  root: bool
  arguments: str = ""

  def attribute(self, key: str) -> str | None:
    """The computation named by ``key=`` (``body``, ``condition``,
    ``calls``, ``to_apply``, ...), without ``%``.

    >>> parse_instruction("  %w = f32[] while(%t), condition=%c, body=%b").attribute("body")
    'b'
    """
    match = re.search(rf"\b{key}=%?([\w.\-]+)", self.attributes)
    return match.group(1) if match else None

  def branches(self) -> list[str]:
    """A conditional's branch computations, in order."""
    match = _BRANCHES.search(self.attributes)
    if match:
      return [b.strip().lstrip("%") for b in match.group(1).split(",")]
    return [
      c
      for c in (self.attribute("true_computation"), self.attribute("false_computation"))
      if c
    ]

  @property
  def op_name(self) -> str:
    """The JAX operation it came from (its ``metadata`` ``op_name``), or ''."""
    match = re.search(r'op_name="([^"]*)"', self.attributes)
    return match.group(1) if match else ""


class Module(NamedTuple):
  """An HLO module: its computations' instructions, in order, and the entry.

  Attributes:
    computations: per computation name, its instructions.
    entry: the ENTRY computation's name.
  """

  computations: dict[str, list[Instruction]]
  entry: str


def _closing(text: str, start: int) -> int:
  """The index of the bracket that closes the one at ``text[start]``."""
  depth = 0
  for i in range(start, len(text)):
    if text[i] in "([{":
      depth += 1
    elif text[i] in ")]}":
      depth -= 1
      if depth == 0:
        return i
  return len(text)


def parse_instruction(line: str) -> Instruction | None:
  r"""One line of HLO text as an :class:`Instruction` (None for other lines).

  >>> i = parse_instruction("  ROOT %r = f32[8]{0} add(f32[8]{0} %a, %b.1), metadata={op_name=\"x\"}")
  >>> i.name, i.type, i.op, i.operands, i.root, i.op_name
  ('r', 'f32[8]{0}', 'add', ('a', 'b.1'), True, 'x')
  """
  match = _INSTRUCTION.match(line)
  if not match:
    return None
  name, type_text, op = match.groups()
  open_at = match.end() - 1
  close_at = _closing(line, open_at)
  arguments = line[open_at + 1 : close_at]
  return Instruction(
    name=name,
    type=type_text,
    op=op,
    operands=tuple(re.findall(r"%([\w.\-]+)", arguments)),
    attributes=line[close_at + 1 :],
    root=line.lstrip().startswith("ROOT "),
    arguments=arguments,
  )


def parse(hlo_text: str) -> Module:
  """The computations of HLO text (``compiled.as_text()``).

  >>> m = parse('''
  ... ENTRY %main (a: f32[8]) -> f32[8] {
  ...   %a = f32[8]{0} parameter(0)
  ...   ROOT %n = f32[8]{0} negate(%a)
  ... }''')
  >>> m.entry, [i.op for i in m.computations["main"]]
  ('main', ['parameter', 'negate'])
  """
  computations: dict[str, list[Instruction]] = {}
  entry = None
  current = None
  for line in hlo_text.splitlines():
    match = _COMPUTATION.match(line)
    if match:
      current = match.group(1)
      computations[current] = []
      if line.startswith("ENTRY"):
        entry = current
      continue
    if current is None:
      continue
    instruction = parse_instruction(line)
    if instruction is not None:
      computations[current].append(instruction)
  if entry is None:
    raise ValueError("No ENTRY computation in the HLO text.")
  return Module(computations, entry)


class Collective(NamedTuple):
  r"""One collective instruction and how often it runs per call.

  Attributes:
    op: the HLO opcode, e.g. ``all-reduce``.
    computation: the computation that holds it.
    bytes: the size of its result, per execution.
    executions: how many times it runs per call (the product of the trip
      counts of the while loops around it; unknown trip counts count 1).
    in_loop: whether it sits inside a while loop's body.
    groups: its replica groups, each a tuple of partition numbers; ``()``
      for ``replica_groups={}``, one group of every device; a permute's
      source-target pairs, each pair a group; None where the HLO does not
      list them.
    loops: the names of the while loops around it, outermost first (their
      :class:`Loop`\ s give the trip counts); ``()`` outside every loop.
  """

  op: str
  computation: str
  bytes: int
  executions: int
  in_loop: bool
  groups: tuple[tuple[int, ...], ...] | None = None
  loops: tuple[str, ...] = ()

  def spans(self, mesh_shape: Sequence[int], axes: Sequence[int]) -> bool:
    """Whether a replica group holds devices that differ along mesh ``axes``.

    Partition ``p`` is the device at flat position ``p`` of the mesh (the
    order ``jit`` assigns devices over a mesh), so its coordinates are
    ``np.unravel_index(p, mesh_shape)``. Unknown groups count as spanning.

    >>> c = Collective("all-reduce", "main", 4, 1, False, ((0, 2), (1, 3)))
    >>> c.spans((2, 2), axes=[0]), c.spans((2, 2), axes=[1])
    (True, False)
    >>> Collective("all-reduce", "main", 4, 1, False, ()).spans((2, 2), axes=[1])
    True
    """
    if self.groups is None:
      return True
    groups = self.groups or (tuple(range(int(np.prod(mesh_shape)))),)
    for group in groups:
      coords = np.array(np.unravel_index(np.asarray(group), tuple(mesh_shape)))
      if any(len(set(coords[a].tolist())) > 1 for a in axes):
        return True
    return False

  def axes(self, mesh: Any) -> tuple[str, ...]:
    """The names of the axes of ``mesh`` (a ``Mesh`` or ``AbstractMesh``,
    the one the step was compiled for) that it communicates over, in the
    mesh's order: :meth:`spans` for each axis.

    >>> import jax
    >>> mesh = jax.sharding.AbstractMesh((2, 2), ("data", "model"))
    >>> Collective("all-reduce", "main", 4, 1, False, ((0, 2), (1, 3))).axes(mesh)
    ('data',)
    """
    names = tuple(mesh.axis_names)
    shape = tuple(mesh.shape[a] for a in names)
    return tuple(a for i, a in enumerate(names) if self.spans(shape, [i]))


class Loop(NamedTuple):
  """One while loop of a compiled program, where it runs.

  Attributes:
    name: the ``while`` instruction's name (``Collective.loops`` lists it).
    computation: the computation that holds it.
    trip_count: its trips each time it runs: XLA's ``known_trip_count``
      (CPU, GPU), else the ``N`` of its condition's ``counter < N`` (TPU);
      None where neither shows.
    executions: how many times it runs per call (the product of the trip
      counts of the loops around it; unknown ones count 1).
    outer: the names of the loops around it, outermost first; ``()`` for a
      loop outside every other.
    computations: the computations inside it: its body and condition and
      everything they call, nested loops included.
  """

  name: str
  computation: str
  trip_count: int | None
  executions: int
  outer: tuple[str, ...]
  computations: frozenset[str]


def _top_level(type_text: str) -> list[str]:
  """The elements of a tuple type ``(a, (b, c))`` -> ``['a', '(b, c)']``."""
  text = type_text.strip()
  if not text.startswith("("):
    return [text]
  parts, depth, start = [], 0, 1
  for i, ch in enumerate(text):
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    elif ch == "," and depth == 1:
      parts.append(text[start:i])
      start = i + 1
  parts.append(text[start : len(text) - 1])
  return [p.strip() for p in parts if p.strip()]


def _result_bytes(op: str, type_text: str) -> int:
  """Bytes a collective delivers. An asynchronous start returns ``(inputs,
  outputs)`` (a TPU permute adds two context scalars); only the outputs
  count.

  >>> _result_bytes("reduce-scatter-start", "(f32[64]{0}, f32[8]{0})")
  32
  >>> _result_bytes("collective-permute-start", "(f32[1024]{0}, f32[1024]{0}, u32[], u32[])")
  4096
  """
  if op in ("all-gather-start", "all-to-all-start", "reduce-scatter-start"):
    parts = _top_level(type_text)
    if len(parts) % 2 == 0:
      return sum(_shape_bytes(p) for p in parts[len(parts) // 2 :])
  if op == "collective-permute-start":
    # (operand, output) on GPU; (operand, output, u32[] context, u32[]
    # context) on TPU: the output is the second element either way.
    parts = _top_level(type_text)
    if len(parts) in (2, 4):
      return _shape_bytes(parts[1])
  return _shape_bytes(type_text)


def _shape_bytes(type_text: str) -> int:
  """Bytes of an HLO type such as ``f32[4,8]{1,0}`` or a tuple of them."""
  total = 0
  for dtype, dims in _ARRAY.findall(type_text):
    if dtype not in _DTYPE_BYTES:
      continue
    count = 1
    for d in filter(None, dims.split(",")):
      count *= int(d)
    total += count * _DTYPE_BYTES[dtype]
  return total


def _ints(text: str | None) -> list[int]:
  return [int(t) for t in (text or "").split(",") if t.strip()]


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
  ids = np.arange(int(np.prod(dims))).reshape(dims)
  return ids.transpose(perm) if perm else ids


def replica_groups(line: str) -> tuple[tuple[int, ...], ...] | None:
  """The replica groups of one HLO instruction, as partition ids.

  >>> replica_groups("x = all-reduce(y), replica_groups={{0,2},{1,3}}")
  ((0, 2), (1, 3))
  >>> replica_groups("x = all-reduce(y), replica_groups=[2,2]<=[2,2]T(1,0), to_apply=f")
  ((0, 2), (1, 3))
  >>> replica_groups("x = all-gather(y), replica_groups=mesh['a'=2,'b'=2] {'a'}, dimensions={0}")
  ((0, 2), (1, 3))
  """
  match = _GROUP_LISTS.search(line)
  if match:
    return tuple(tuple(_ints(g)) for g in re.findall(r"\{([\d,]*)\}", match.group(1)))
  match = _GROUP_IOTA.search(line)
  if match:
    shape, dims, perm = _ints(match.group(1)), _ints(match.group(2)), match.group(3)
    ids = _iota(dims, _ints(perm) if perm else None).reshape(shape)
    return tuple(tuple(int(i) for i in row) for row in ids)
  match = _GROUP_MESH.search(line)
  if match:
    axes = re.findall(r"'([^']+)'\s*=\s*(\d+)", match.group(1))
    names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
    order = (
      _iota(_ints(match.group(2)), _ints(match.group(3)) or None).reshape(-1)
      if match.group(2)
      else np.arange(int(np.prod(sizes)))
    )
    grid = order.reshape(sizes)
    over = [names.index(a) for a in re.findall(r"'([^']+)'", match.group(4))]
    rest = [i for i in range(len(names)) if i not in over]
    groups = grid.transpose(rest + over).reshape(
      -1, int(np.prod([sizes[i] for i in over]))
    )
    return tuple(tuple(int(i) for i in row) for row in groups)
  return None


def _condition_bound(lines: list[str]) -> int | None:
  """``N`` of a loop condition ``compare(counter, constant(N)), direction=LT``.

  >>> _condition_bound([
  ...   "%c = s32[] constant(4)",
  ...   "ROOT %lt = pred[] compare(%i, %c), direction=LT",
  ... ])
  4
  """
  constants = {}
  for line in lines:
    match = re.match(r"\s*%?([\w.\-]+)\s*=\s*s32\[\][^=]*constant\((\d+)\)", line)
    if match:
      constants[match.group(1)] = int(match.group(2))
  for line in lines:
    match = re.search(r"compare\(%?[\w.\-]+,\s*%?([\w.\-]+)\), direction=LT", line)
    if match and match.group(1) in constants:
      return constants[match.group(1)]
  return None


def collectives(hlo_text: str) -> list[Collective]:
  """Every collective in compiled HLO text, with its execution count.

  >>> text = '''
  ... %body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  ...   %ar = f32[8]{0} all-reduce(f32[8]{0} %x), to_apply=%add
  ... }
  ... ENTRY %main (a: f32[8]) -> f32[8] {
  ...   %w = (s32[], f32[8]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ...   %g = f32[16]{0} all-gather(f32[8]{0} %a), dimensions={0}
  ...   %s = (f32[8]{0}, f32[64]{0}) all-gather-start(f32[8]{0} %a), dimensions={0}
  ... }'''
  >>> [(c.op, c.bytes, c.executions, c.in_loop) for c in collectives(text)]  # doctest: +NORMALIZE_WHITESPACE
  [('all-reduce', 32, 4, True), ('all-gather', 64, 1, False), ('all-gather-start', 256, 1, False)]
  """
  return read(hlo_text)[0]


def loops(hlo_text: str) -> list[Loop]:
  """Every while loop in compiled HLO text, where it runs, outer loops first.

  >>> text = '''
  ... %inner (p: s32[]) -> s32[] {
  ...   ROOT %p = s32[] parameter(0)
  ... }
  ... %outer (p: s32[]) -> s32[] {
  ...   %p = s32[] parameter(0)
  ...   ROOT %w2 = s32[] while(%p), condition=%c, body=%inner, backend_config={"known_trip_count":{"n":"3"}}
  ... }
  ... ENTRY %main (a: s32[]) -> s32[] {
  ...   %a = s32[] parameter(0)
  ...   ROOT %w = s32[] while(%a), condition=%c, body=%outer, backend_config={"known_trip_count":{"n":"4"}}
  ... }'''
  >>> [(w.name, w.trip_count, w.executions, w.outer) for w in loops(text)]
  [('w', 4, 1, ()), ('w2', 3, 4, ('w',))]
  >>> sorted(loops(text)[0].computations)
  ['inner', 'outer']
  """
  return read(hlo_text)[1]


def read(hlo_text: str) -> tuple[list[Collective], list[Loop]]:
  """The collectives and the while loops of compiled HLO text, in one walk
  from the entry through every call site (a computation called twice is
  read twice; one that calls itself, once)."""
  module = parse(hlo_text)
  lines = _computation_lines(hlo_text)
  found: list[Collective] = []
  walked: list[tuple[Instruction, str, int | None, int, tuple[int, ...]]] = []
  inside: list[set[str]] = []

  def visit(
    name: str, executions: int, around: tuple[int, ...], seen: tuple[str, ...]
  ) -> None:
    if name in seen or name not in module.computations:
      return
    for index in around:
      inside[index].add(name)
    for i in module.computations[name]:
      if i.op in COLLECTIVES:
        found.append(
          Collective(
            i.op,
            name,
            _result_bytes(i.op, i.type),
            executions,
            bool(around),
            _groups(i),
            tuple(walked[j][0].name for j in around),
          )
        )
      if i.op == "while":
        trips = _trip_count(i, lines)
        walked.append((i, name, trips, executions, around))
        inside.append(set())
        within = (*around, len(walked) - 1)  # before the body adds its own
        for called in (i.attribute("body"), i.attribute("condition")):
          if called:
            visit(
              called,
              executions * (1 if trips is None else trips),
              within,
              (*seen, name),
            )
        continue
      for called in _called(i):
        visit(called, executions, around, (*seen, name))

  visit(module.entry, 1, (), ())
  found_loops = [
    Loop(
      i.name,
      name,
      trips,
      executions,
      tuple(walked[j][0].name for j in around),
      frozenset(inside[n]),
    )
    for n, (i, name, trips, executions, around) in enumerate(walked)
  ]
  return found, found_loops


def _groups(i: Instruction) -> tuple[tuple[int, ...], ...] | None:
  """A collective's groups of devices: its replica groups, or a permute's
  source-target pairs (each pair a group: the devices it connects).

  >>> _groups(parse_instruction("%p = f32[8]{0} collective-permute(%x), source_target_pairs={{0,1},{1,2}}"))
  ((0, 1), (1, 2))
  """
  if i.op.startswith("collective-permute"):
    match = _PAIRS.search(i.attributes)
    if match:
      return tuple(tuple(_ints(p)) for p in re.findall(r"\{([\d,]*)\}", match.group(1)))
  return replica_groups(i.attributes)


def _trip_count(loop: Instruction, lines: dict[str, list[str]]) -> int | None:
  """A while loop's trips: XLA's ``known_trip_count`` (GPU, CPU), else the
  bound of its condition's ``counter < N`` (TPU); None where neither shows."""
  trips = _TRIP_COUNT.search(loop.attributes)
  if trips:
    return int(trips.group(1))
  condition = loop.attribute("condition")
  # A bound of 0 reads as unknown, as it always has here.
  return _condition_bound(lines.get(condition, []) if condition else []) or None


def _called(i: Instruction) -> list[str]:
  """The computations an instruction calls (loops aside)."""
  names = _CALLED.findall(i.attributes)
  for branches in _BRANCHES.findall(i.attributes):
    names += [b.strip().lstrip("%") for b in branches.split(",")]
  return names


def _computation_lines(hlo_text: str) -> dict[str, list[str]]:
  """Per computation, its lines of text."""
  bodies: dict[str, list[str]] = {}
  current = None
  for line in hlo_text.splitlines():
    match = _COMPUTATION.match(line)
    if match:
      current = match.group(1)
      bodies[current] = []
    elif current is not None:
      bodies[current].append(line)
  return bodies


def bytes_communicated(hlo_text: str) -> int:
  """Collective result bytes per call, loop trip counts included."""
  return sum(c.bytes * c.executions for c in collectives(hlo_text))
