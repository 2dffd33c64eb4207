"""Choosing ``k`` before anything runs: :func:`plan_micro_batches`.

Each candidate ``k`` is lowered and compiled, never run, and measured with
the compiled step's memory (:mod:`jaxaccum._inspect.memory`); the planner
bisects over the candidates, since peak memory falls as ``k`` grows, and
where parameters are sharded over the data axes it searches the FSDP modes
too, choosing the plan that moves the fewest bytes.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax

from jaxaccum import _options, _split, _value_and_grad
from jaxaccum._inspect import hlo as _hlo
from jaxaccum._inspect import memory as _memory
from jaxaccum._inspect.memory import MemoryStats, compile_for, format_bytes
from jaxaccum._inspect.targets import CompileTarget
from jaxaccum._parallel import layout as _layout
from jaxaccum._parallel import route as _route
from jaxaccum._parallel.options import FSDP_MODES


class Candidate(NamedTuple):
  """One row of the planner's table.

  Attributes:
    num_micro_batches: ``k``.
    micro_batch_size: rows per micro-batch (per device with ``mesh=``).
    memory: the compiled step's memory; ``None`` when the compiler refused
      the step for want of device memory (XLA's TPU compiler does, for a
      step beyond the chip's memory).
    fits: whether ``memory.peak_bytes <= memory_limit_bytes``.
    seconds: how long the compilation took.
    fsdp_gather: the FSDP mode compiled (None where it was not searched).
    collective_bytes: the bytes the step communicates (collective results
      times loop trips, from the compiled HLO); None without ``mesh``.
  """

  num_micro_batches: int
  micro_batch_size: int
  memory: MemoryStats | None
  fits: bool
  seconds: float = 0.0
  fsdp_gather: str | None = None
  collective_bytes: int | None = None


class MicroBatchPlan(NamedTuple):
  """What :func:`plan_micro_batches` chose.

  Attributes:
    num_micro_batches: the smallest ``k`` (largest micro-batch) that fits.
    peak_bytes: the peak of that compiled step.
    table: every candidate compiled, by increasing ``k`` (and FSDP mode).
    memory_limit_bytes: the budget the candidates were held to.
    fsdp_gather: the FSDP mode chosen, where both were searched (parameters
      sharded over the data axes); pass it on with ``k``.
    reason: why this plan, in words.
  """

  num_micro_batches: int
  peak_bytes: int
  table: tuple[Candidate, ...]
  memory_limit_bytes: int = 0
  fsdp_gather: str | None = None
  reason: str = ""

  def __str__(self) -> str:
    modes = any(row.fsdp_gather for row in self.table)
    head = f"{'k':>6} {'micro-batch':>12} {'peak':>12}"
    head += f" {'fsdp_gather':>16} {'collectives':>12}" if modes else ""
    lines = [head + "  fits"]
    for row in self.table:
      mark = "yes" if row.fits else "no"
      if (row.num_micro_batches, row.fsdp_gather) == (
        self.num_micro_batches,
        self.fsdp_gather,
      ):
        mark += "  <- chosen"
      peak = "> device" if row.memory is None else format_bytes(row.memory.peak_bytes)
      line = f"{row.num_micro_batches:>6} {row.micro_batch_size:>12} {peak:>12}"
      if modes:
        moved = (
          "?" if row.collective_bytes is None else format_bytes(row.collective_bytes)
        )
        line += f" {row.fsdp_gather or '':>16} {moved:>12}"
      lines.append(f"{line}  {mark}")
    if self.reason:
      lines.append(self.reason)
    return "\n".join(lines)


def _is_step_builder(fun: Callable[..., Any]) -> bool:
  try:
    return "num_micro_batches" in inspect.signature(fun).parameters
  except (TypeError, ValueError):
    return False


def plan_micro_batches(
  fun: Callable[..., Any],
  args: Sequence[Any],
  *,
  memory_limit_bytes: int | None = None,
  candidates: Sequence[int] | None = None,
  step_batch_argnum: int | None = None,
  target: CompileTarget | None = None,
  print_fn: Callable[[str], Any] | None = print,
  **value_and_grad_kwargs: Any,
) -> MicroBatchPlan:
  """Chooses the smallest ``k`` whose compiled step fits ``memory_limit_bytes``.

  Candidates are lowered and compiled, never run, and measured with XLA's
  memory analysis (``argument + output + temp - alias``, device memory per
  device). Peak memory falls as ``k`` grows, so the planner bisects: for
  ``n`` candidates it compiles about ``log2(n) + 1`` of them, each once. With
  ``target`` (:func:`jaxaccum.compile_target`) the candidates are compiled
  for an accelerator this machine need not have, e.g. an H100 or a TPU v5e
  slice; see :func:`compiled_memory` for how the arguments are placed on it.

  How long a plan takes is the compile time of a step times the compiles:
  on a 2-core CPU, a 48M-parameter MLP compiles in about 65 s for the TPU
  v5e target, and a batch of 2**17 rows (18 powers of two) takes 6 compiles,
  about 7 minutes; the small models of the tests compile in about a second.
  One line per compile (``k``, peak, seconds) goes to ``print_fn``.

  ``fun`` is one of two things:

  - a loss: then each candidate compiles
    ``jaxaccum.value_and_grad(fun, k, **value_and_grad_kwargs)(*args)``;
  - a step builder, recognized by a ``num_micro_batches`` parameter: then each
    candidate compiles ``fun(num_micro_batches=k)(*args)``. Use this to count
    everything a real step holds, the optimizer state included, e.g.
    ``functools.partial(jaxaccum.make_train_step, loss_fn, tx)`` or your own
    ``def build(num_micro_batches): return jitted_step``.

  Args:
    fun: a loss, or a step builder.
    args: the step's arguments, arrays or ``jax.ShapeDtypeStruct``s, with the
      whole batch.
    memory_limit_bytes: the budget per device, e.g. 90% of the device's
      memory. Required without ``target``; with one it defaults to
      ``target.budget_bytes``: 75% of a GPU's memory (what JAX preallocates
      by default), 90% of a TPU's.
    candidates: the ``k`` to try; by default the powers of two that divide
      the batch size per device (the whole batch without ``mesh``, else its
      share of each device along ``data_axis``).
    step_batch_argnum: for a step builder, the position of the batch among
      the step's ``args``; by default the last. (For a loss, the batch is
      ``args[batch_argnums]``, as in :func:`jaxaccum.value_and_grad`.)
    target: a :class:`jaxaccum.CompileTarget` to compile for; by default
      JAX's default backend.
    print_fn: called with one line per compile; None for silence.
    **value_and_grad_kwargs: the options of :func:`jaxaccum.value_and_grad`;
      for a step builder, passed on to it with ``num_micro_batches``.

  Returns:
    A ``MicroBatchPlan``: the chosen ``k``, its peak bytes and the table of
    the candidates compiled.

  Raises:
    ValueError: if no candidate fits, naming the budget and the smallest peak;
      if neither ``memory_limit_bytes`` nor ``target`` is given.

  >>> import jax, jax.numpy as jnp, jaxaccum
  >>> def loss(w, x):
  ...   return jnp.mean(jnp.tanh(jnp.tanh(x @ w) @ w.T) ** 2)
  >>> args = (jnp.ones((64, 64)), jax.ShapeDtypeStruct((1024, 64), jnp.float32))
  >>> plan = jaxaccum.plan_micro_batches(loss, args, memory_limit_bytes=600_000, print_fn=None)
  >>> plan.num_micro_batches > 1, plan.peak_bytes <= 600_000
  (True, True)

  Every larger micro-batch (smaller ``k``) that was compiled was over the
  budget:

  >>> k = plan.num_micro_batches
  >>> any(row.fits for row in plan.table if row.num_micro_batches < k)
  False

  Planning for a TPU v5e chip, with the budget at its default, 90% of the
  chip's 16 GiB: an 8 GiB batch whose activations are as large again needs
  micro-batches there.

  >>> tpu = jaxaccum.compile_target("tpu-v5e")
  >>> big = (jnp.ones((2**16, 16)), jax.ShapeDtypeStruct((2**15, 2**16), jnp.float32))
  >>> plan = jaxaccum.plan_micro_batches(loss, big, target=tpu, candidates=[1, 8], print_fn=None)
  >>> plan.num_micro_batches, plan.memory_limit_bytes == tpu.budget_bytes
  (8, True)
  """
  memory_limit_bytes = _budget(memory_limit_bytes, target)
  builder = _is_step_builder(fun)
  value_and_grad_kwargs = _options.flat(value_and_grad_kwargs)
  options = _planning_options(value_and_grad_kwargs)
  batch_size = _batch_per_device(args, options, builder, step_batch_argnum)
  candidates = _candidates(candidates, batch_size)

  def compile_one(k: int, mode: str | None) -> Candidate:
    kwargs = dict(value_and_grad_kwargs)
    if mode is not None:
      kwargs["fsdp_gather"] = mode
      if mode != "cast_once":  # gather_dtype lets the search try cast_once
        kwargs.pop("gather_dtype", None)
    if builder:
      step = fun(num_micro_batches=k, **kwargs)
    else:
      if kwargs.get("clip_per_example") is not None:  # measured, not trained
        kwargs.setdefault("clip_without_noise", True)
      step = _value_and_grad.value_and_grad(fun, k, **kwargs)
    row = _measure(step, args, target, options, memory_limit_bytes)
    row = row._replace(num_micro_batches=k, micro_batch_size=batch_size // k)
    row = row._replace(fsdp_gather=mode)
    if print_fn is not None:
      print_fn(_progress_line(row))
    return row

  modes = _fsdp_modes(options, value_and_grad_kwargs, args, builder)
  tables = {
    mode: _bisect(sorted(set(candidates)), functools.partial(compile_one, mode=mode))
    for mode in modes
  }
  return _choose(tables, memory_limit_bytes)


def _budget(memory_limit_bytes: int | None, target: CompileTarget | None) -> int:
  """The budget per device: as given, else the target's."""
  if memory_limit_bytes is not None:
    return memory_limit_bytes
  if target is None:
    raise ValueError(
      "Give memory_limit_bytes, or a target whose memory sets the budget."
    )
  return target.budget_bytes


def _planning_options(kwargs: dict[str, Any]) -> _options.Options:
  """The options the plan reads (batch arguments, mesh, data axes); ``k``
  is the planner's, and ``gather_dtype`` its FSDP search's."""
  known = {
    name: value
    for name, value in kwargs.items()
    if name in _options.keywords()
    and name not in ("num_micro_batches", "micro_batch_size", "gather_dtype")
  }
  return _options.create(None, 1, **known)


def _batch_per_device(
  args: Sequence[Any],
  options: _options.Options,
  builder: bool,
  step_batch_argnum: int | None,
) -> int:
  """The rows of the batch (a step builder's ``step_batch_argnum``, by
  default its last argument; a loss's ``batch_argnums``) per data device."""
  if builder:
    nums: Sequence[int] = (
      len(args) - 1 if step_batch_argnum is None else step_batch_argnum,
    )
  elif step_batch_argnum is not None:
    raise ValueError(
      "step_batch_argnum is for a step builder; for a loss, pass batch_argnums."
    )
  else:
    nums = options.resolve(len(args)).batch_argnums
  batch_size = _split.leading_batch_size({f"args[{n}]": args[n] for n in nums})
  devices = options.data_devices
  if batch_size % devices:
    raise ValueError(
      f"The global {batch_size=} is not divisible by the {devices} devices "
      f"of data axes {options.data_axes}."
    )
  return batch_size // devices


def _candidates(candidates: Sequence[int] | None, batch_size: int) -> Sequence[int]:
  """The ``k`` to try: as given, else the powers of two dividing the batch."""
  if candidates is None:
    candidates = [
      2**i for i in range(batch_size.bit_length()) if batch_size % 2**i == 0
    ]
  if not candidates:
    raise ValueError("No candidate num_micro_batches to try.")
  return candidates


def _measure(
  step: Callable[..., Any],
  args: Sequence[Any],
  target: CompileTarget | None,
  options: _options.Options,
  memory_limit_bytes: int,
) -> Candidate:
  """One candidate compiled: its memory, whether it fits, and (with a mesh)
  the bytes it communicates."""
  start = time.perf_counter()
  moved = None
  try:
    with _route.mesh_context(options.mesh):
      compiled = compile_for(step, args, {}, target)
    memory: MemoryStats | None = _memory._memory_of(compiled, target)
    if options.mesh is not None:
      moved = _hlo.bytes_communicated(compiled.as_text())
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    memory = None  # the compiler itself found the step too large
  fits = memory is not None and memory.peak_bytes <= memory_limit_bytes
  return Candidate(0, 0, memory, fits, time.perf_counter() - start, None, moved)


def _progress_line(row: Candidate) -> str:
  peak = "> device" if row.memory is None else format_bytes(row.memory.peak_bytes)
  mode = f" fsdp_gather={row.fsdp_gather}" if row.fsdp_gather else ""
  return (
    f"plan_micro_batches: k={row.num_micro_batches}{mode} peak={peak} "
    f"({'fits' if row.fits else 'over budget'}) compiled in {row.seconds:.1f} s"
  )


def _fsdp_modes(
  options: _options.Options,
  kwargs: dict[str, Any],
  args: Sequence[Any],
  builder: bool,
) -> tuple[str | None, ...]:
  """The FSDP modes to search where parameters are sharded over the data
  axes and no mode was given: ``"per_micro_batch"`` and ``"once"``, and
  ``"cast_once"`` where a ``gather_dtype`` says that the weights may be
  gathered in it; otherwise the one given (or None: the option is left
  out)."""
  if "fsdp_gather" in kwargs or options.mesh is None:
    return (kwargs.get("fsdp_gather"),)
  params = options.replace(argnums=(0,)) if builder else options
  params = params.resolve(len(args))
  layout = _layout.layout(params, tuple(args))
  if not any(s is not None and s.sharded_dims() for s in layout):
    return (None,)
  if kwargs.get("gather_dtype") is not None:
    return FSDP_MODES
  return tuple(m for m in FSDP_MODES if m != "cast_once")


def _choose(
  tables: dict[str | None, list[Candidate]], memory_limit_bytes: int
) -> MicroBatchPlan:
  """Per mode the smallest ``k`` that fits; of those, the plan that moves the
  fewest bytes (then the smaller ``k``)."""
  table = [row for rows in tables.values() for row in rows]
  best = [
    next(row for row in rows if row.fits)
    for rows in tables.values()
    if any(r.fits for r in rows)
  ]
  if not best:
    peaks = [row.memory.peak_bytes for row in table if row.memory is not None]
    smallest = (
      f"the smallest compiled peak is {min(peaks)} bytes ({format_bytes(min(peaks))})"
      if peaks
      else "the compiler found every candidate too large for the device"
    )
    raise ValueError(
      f"No candidate fits {memory_limit_bytes=} ({format_bytes(memory_limit_bytes)}); "
      f"{smallest} among num_micro_batches="
      f"{sorted({row.num_micro_batches for row in table})}."
    )
  chosen = min(best, key=lambda r: (r.collective_bytes or 0, r.num_micro_batches))
  assert chosen.memory is not None
  reason = ""
  if len(best) > 1:
    each = "; ".join(
      f"fsdp_gather={r.fsdp_gather!r} fits at k={r.num_micro_batches} and moves "
      f"{format_bytes(r.collective_bytes or 0)} per step"
      for r in best
    )
    reason = f"{each}: the plan that moves the fewest bytes is chosen."
  elif len(tables) > 1:
    reason = f"Only fsdp_gather={chosen.fsdp_gather!r} fits the budget."
  table.sort(key=lambda r: (r.num_micro_batches, r.fsdp_gather or ""))
  return MicroBatchPlan(
    chosen.num_micro_batches,
    chosen.memory.peak_bytes,
    tuple(table),
    memory_limit_bytes,
    chosen.fsdp_gather,
    reason,
  )


def _bisect(
  candidates: Sequence[int], compile_one: Callable[[int], Candidate]
) -> list[Candidate]:
  """The candidates compiled to find the smallest that fits, each at most
  once, by increasing ``k``.

  Peak memory falls as ``k`` grows, so a bisection finds the smallest ``k``
  that fits with about ``log2(n)`` compiles. Where no bisection step fits
  (the peak can rise again at the largest ``k``, where the loop's own
  buffers outweigh a micro-batch of one row), the rest are tried in order.
  """
  rows: dict[int, Candidate] = {}

  def fits(i: int) -> bool:
    k = candidates[i]
    if k not in rows:
      rows[k] = compile_one(k)
    return rows[k].fits

  lo, hi, found = 0, len(candidates) - 1, False
  while lo <= hi:  # the smallest fitting index, if the peaks fall with k
    mid = (lo + hi) // 2
    if fits(mid):
      found, hi = True, mid - 1
    else:
      lo = mid + 1
  if not found:
    for i in range(len(candidates)):
      if fits(i):
        break
  return [rows[k] for k in sorted(rows)]
