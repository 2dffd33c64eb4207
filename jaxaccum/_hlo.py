"""Reading collectives out of compiled HLO text.

Used to check the data-parallel contract ("no all-reduce inside the loop") and
to measure the bytes a step communicates: every collective's result size,
times the trip counts of the while loops around it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

COLLECTIVES = (
  "all-reduce",
  "all-reduce-start",
  "reduce-scatter",
  "all-gather",
  "all-gather-start",
  "all-to-all",
  "collective-permute",
  "collective-permute-start",
)

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
_TRIP_COUNT = re.compile(r'known_trip_count[^0-9]*"?n"?\s*:\s*"?(\d+)')
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\dm\d\w*)?)\[([\d,]*)\]")


class Collective(NamedTuple):
  """One collective instruction and how often it runs per call.

  Attributes:
    op: the HLO opcode, e.g. ``all-reduce``.
    computation: the computation that holds it.
    bytes: the size of its result, per execution.
    executions: how many times it runs per call (the product of the trip
      counts of the while loops around it; unknown trip counts count 1).
    in_loop: whether it sits inside a while loop's body.
  """

  op: str
  computation: str
  bytes: int
  executions: int
  in_loop: bool


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
  """Bytes a collective delivers. An async all-gather/permute start returns
  ``(inputs, outputs)``; only the outputs count."""
  if op in ("all-gather-start", "collective-permute-start"):
    parts = _top_level(type_text)
    if len(parts) % 2 == 0:
      return sum(_shape_bytes(p) for p in parts[len(parts) // 2 :])
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
  >>> [(c.op, c.bytes, c.executions, c.in_loop) for c in collectives(text)]
  [('all-reduce', 32, 4, True), ('all-gather', 64, 1, False), ('all-gather-start', 256, 1, False)]
  """
  bodies: dict[str, list[str]] = {}
  entry = None
  current = None
  for line in hlo_text.splitlines():
    match = _COMPUTATION.match(line)
    if match:
      current = match.group(1)
      bodies[current] = []
      if line.startswith("ENTRY"):
        entry = current
    elif current is not None:
      bodies[current].append(line)
  if entry is None:
    raise ValueError("No ENTRY computation in the HLO text.")

  found: list[Collective] = []

  def visit(name: str, executions: int, in_loop: bool, seen: tuple[str, ...]) -> None:
    if name in seen or name not in bodies:
      return
    for line in bodies[name]:
      match = _INSTRUCTION.match(line)
      if not match:
        continue
      _, type_text, op = match.groups()
      if op in COLLECTIVES:
        found.append(
          Collective(op, name, _result_bytes(op, type_text), executions, in_loop)
        )
      if op == "while":
        trips = _TRIP_COUNT.search(line)
        body = re.search(r"\bbody=%?([\w.\-]+)", line)
        cond = re.search(r"\bcondition=%?([\w.\-]+)", line)
        n = int(trips.group(1)) if trips else 1
        for called in (body, cond):
          if called:
            visit(called.group(1), executions * n, True, (*seen, name))
        continue
      called_names = _CALLED.findall(line)
      for branches in _BRANCHES.findall(line):
        called_names += [b.strip().lstrip("%") for b in branches.split(",")]
      for called in called_names:
        visit(called, executions, in_loop, (*seen, name))

  visit(entry, 1, False, ())
  return found


def compiled_text(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
  """The optimized HLO of ``jit(fun)(*args, **kwargs)``; nothing runs."""
  jitted = fun if hasattr(fun, "lower") else jax.jit(fun)
  return jitted.lower(*args, **kwargs).compile().as_text()


def bytes_communicated(hlo_text: str) -> int:
  """Collective result bytes per call, loop trip counts included."""
  return sum(c.bytes * c.executions for c in collectives(hlo_text))
