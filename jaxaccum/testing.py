"""Reading collectives out of compiled HLO text: what a step communicates.

For checking a data-parallel step the way jaxaccum's own tests do ("no
reduction over the data axes inside the loop") and measuring the bytes it
communicates: every collective's result size, times the trip counts of the
while loops around it.

>>> import jax, jax.numpy as jnp, jaxaccum
>>> from jaxaccum import testing
>>> loss = lambda w, x: jnp.mean((x @ w) ** 2)
>>> text = testing.compiled_text(jaxaccum.value_and_grad(loss, 4), jnp.ones(3), jnp.ones((8, 3)))
>>> [c.op for c in testing.collectives(text)]  # one device: nothing to say
[]

Each collective's replica groups are read too, in the three forms XLA prints
(explicit lists, iota ``[G,S]<=[dims]T(perm)``, and named mesh axes), so that
:meth:`Collective.spans` can say which mesh axes it communicates over.

:func:`cpu_devices` simulates several devices on a CPU, for tests and
examples, in a configuration whose collectives cannot deadlock.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from jaxaccum import _compat

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
    groups: its replica groups, each a tuple of partition numbers; None
      where the HLO does not list them.
  """

  op: str
  computation: str
  bytes: int
  executions: int
  in_loop: bool
  groups: tuple[tuple[int, ...], ...] | None = None

  def spans(self, mesh_shape: Sequence[int], axes: Sequence[int]) -> bool:
    """Whether a replica group holds devices that differ along mesh ``axes``.

    Partition ``p`` is the device at flat position ``p`` of the mesh (the
    order ``jit`` assigns devices over a mesh), so its coordinates are
    ``np.unravel_index(p, mesh_shape)``. Unknown groups count as spanning.

    >>> c = Collective("all-reduce", "main", 4, 1, False, ((0, 2), (1, 3)))
    >>> c.spans((2, 2), axes=[0]), c.spans((2, 2), axes=[1])
    (True, False)
    """
    if self.groups is None:
      return True
    for group in self.groups:
      coords = np.array(np.unravel_index(np.asarray(group), tuple(mesh_shape)))
      if any(len(set(coords[a].tolist())) > 1 for a in axes):
        return True
    return False


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
          Collective(
            op,
            name,
            _result_bytes(op, type_text),
            executions,
            in_loop,
            replica_groups(line),
          )
        )
      if op == "while":
        trips = _TRIP_COUNT.search(line)
        body = re.search(r"\bbody=%?([\w.\-]+)", line)
        cond = re.search(r"\bcondition=%?([\w.\-]+)", line)
        if trips:
          n = int(trips.group(1))
        else:  # e.g. TPU: read `counter < N` off the condition
          n = _condition_bound(bodies.get(cond.group(1), []) if cond else []) or 1
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


def compiled_text(
  fun: Callable[..., Any], *args: Any, target: Any = None, **kwargs: Any
) -> str:
  """The optimized HLO of ``jit(fun)(*args, **kwargs)``; nothing runs.

  With ``target`` (:func:`jaxaccum.compile_target`), the HLO that XLA's
  compiler for that accelerator makes, as :func:`jaxaccum.compiled_memory`
  compiles it.
  """
  from jaxaccum._memory import compile_for  # noqa: PLC0415

  return compile_for(fun, args, kwargs, target).as_text()


def bytes_communicated(hlo_text: str) -> int:
  """Collective result bytes per call, loop trip counts included."""
  return sum(c.bytes * c.executions for c in collectives(hlo_text))


_DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


def cpu_devices(
  count: int | None = None, *, environ: MutableMapping[str, str] | None = None
) -> int:
  """Simulates ``count`` CPU devices, with enough threads for their collectives.

  Sets ``--xla_force_host_platform_device_count`` in ``XLA_FLAGS`` (keeping
  a count already there when ``count`` is None; 8 if there is none) and
  ``PJRT_NPROC`` to at least twice the count, in ``os.environ`` (or in
  ``environ``, e.g. the environment of a process you start). Call it before
  the first computation: once JAX's backends have started, both are fixed.

  Why the threads: XLA's CPU client (jaxlib 0.10 to 0.12 at least) runs
  program launches and the devices' executions on one pool of
  ``max(PJRT_NPROC or the cores, devices)`` threads. A launch waits while
  its device has 32 programs in flight (the host ran that far ahead), and
  holds its thread meanwhile; a collective needs a thread for every one of
  its devices at once. With as many threads as devices, one waiting launch
  leaves a collective short of a thread for good, and XLA aborts the
  process after 40 seconds ("Expected 8 threads to join the rendezvous, but
  only 7 of them arrived"). Twice the devices leaves a thread per device
  for the executions even when every device's launch waits.
  ``tests/README.md`` gives the evidence and a reproduction without
  jaxaccum.

  Args:
    count: the number of CPU devices.
    environ: the environment to set (default ``os.environ``).

  Returns:
    The number of devices set.

  Raises:
    RuntimeError: when ``environ`` is this process's and JAX's backends have
      already started with other settings.

  >>> import os
  >>> n = cpu_devices()  # the suite's conftest.py set 8 before JAX started
  >>> n, int(os.environ["PJRT_NPROC"]) >= 2 * n
  (8, True)
  >>> env = {"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"}
  >>> cpu_devices(4, environ=env), env["PJRT_NPROC"]
  (4, '8')
  >>> env["XLA_FLAGS"]
  '--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=4'
  """
  here = environ is None
  env: MutableMapping[str, str] = os.environ if environ is None else environ
  flags = env.get("XLA_FLAGS", "")
  found = _DEVICE_COUNT.search(flags)
  if count is None:
    count = int(found.group(1)) if found else 8
  if isinstance(count, bool) or not isinstance(count, int) or count < 1:
    raise ValueError(f"count must be a positive int, got {count!r}.")
  threads = str(max(2 * count, int(env.get("PJRT_NPROC") or 0)))
  wanted = f"--xla_force_host_platform_device_count={count}"
  if found and found.group(0) == wanted and env.get("PJRT_NPROC") == threads:
    return count
  if here and _compat.backends_started():
    raise RuntimeError(
      f"cpu_devices({count}) must run before JAX's first computation: its "
      "backends have started, with their device count and threads fixed. Call "
      f"it first thing, or set XLA_FLAGS='{wanted}' and PJRT_NPROC={threads} "
      "in the environment."
    )
  flags = _DEVICE_COUNT.sub("", flags).strip()
  env["XLA_FLAGS"] = f"{flags} {wanted}".strip()
  env["PJRT_NPROC"] = threads
  return count
