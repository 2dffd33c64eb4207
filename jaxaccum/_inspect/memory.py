"""Compile-time memory analysis, and choosing ``k`` before anything runs.

Everything here lowers and compiles; nothing executes, so nothing can run out
of memory. The numbers come from XLA's buffer assignment
(``jit(f).lower(*args).compile().memory_analysis()``), which is the memory the
compiled step will ask the device for:

``peak = argument + output + temp - alias``

(``alias`` is the output memory that reuses donated argument buffers).
Every number is device memory; a batch in host memory (``pinned_host``) is
counted apart, in ``host_bytes``.

With ``target=`` (see :func:`jaxaccum.compile_target`) the step is compiled
for compile-only devices of an accelerator this machine does not have, an
H100 or a TPU slice, and the numbers are that accelerator's, per device.
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
from jaxaccum._inspect.targets import CompileTarget
from jaxaccum._parallel import layout as _layout
from jaxaccum._parallel import route as _route
from jaxaccum._parallel.options import FSDP_MODES


class MemoryStats(NamedTuple):
  """The device memory of one compiled function, in bytes.

  Attributes:
    argument_bytes: the inputs.
    output_bytes: the outputs.
    temp_bytes: XLA's scratch: activations, the accumulator, intermediates.
    alias_bytes: outputs that reuse donated input buffers.
    code_bytes: the generated code.
    host_bytes: host memory (``pinned_host``) of arguments, outputs and
      temporaries, less aliased host outputs; not part of ``peak_bytes``.

  On TPU, XLA's memory analysis reports ``temp_size_in_bytes`` as 0 for many
  programs that hold large intermediates, while its
  ``peak_memory_in_bytes`` counts them, together with host arguments and
  outputs. There ``temp_bytes`` is what that peak holds beyond the host
  memory and the device arguments and outputs, so that ``peak_bytes`` is
  the TPU compiler's own peak of device memory.
  """

  argument_bytes: int
  output_bytes: int
  temp_bytes: int
  alias_bytes: int
  code_bytes: int
  host_bytes: int = 0

  @property
  def peak_bytes(self) -> int:
    """``argument + output + temp - alias``: what the step needs at once."""
    return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes

  def __str__(self) -> str:
    rows = [
      ("arguments", self.argument_bytes),
      ("outputs", self.output_bytes),
      ("temporaries", self.temp_bytes),
      ("aliased (donated)", -self.alias_bytes),
      ("peak", self.peak_bytes),
    ]
    if self.host_bytes:
      rows.append(("host memory", self.host_bytes))
    return "\n".join(f"{name:>18}: {format_bytes(n):>10}" for name, n in rows)


def format_bytes(n: float) -> str:
  """Bytes in binary units.

  >>> format_bytes(1536), format_bytes(3 * 2**30), format_bytes(-512)
  ('1.5 KiB', '3.0 GiB', '-512 B')
  """
  sign, n = ("-" if n < 0 else ""), abs(n)
  for unit in ("B", "KiB", "MiB", "GiB"):
    if n < 1024 or unit == "GiB":
      return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.1f} {unit}"
    n /= 1024
  raise AssertionError("unreachable")


def _from_analysis(analysis: Any, platform: str) -> MemoryStats:
  """``MemoryStats`` of XLA's ``CompiledMemoryStats``; device memory only."""
  arguments = int(analysis.argument_size_in_bytes)
  outputs = int(analysis.output_size_in_bytes)
  alias = int(analysis.alias_size_in_bytes)
  temp = int(analysis.temp_size_in_bytes)
  host = sum(
    sign * int(getattr(analysis, f"host_{name}_size_in_bytes", 0))
    for sign, name in ((1, "argument"), (1, "output"), (1, "temp"), (-1, "alias"))
  )
  peak = int(getattr(analysis, "peak_memory_in_bytes", 0))
  if platform == "tpu" and peak:
    temp = max(0, peak - host - (arguments + outputs - alias))
  return MemoryStats(
    argument_bytes=arguments,
    output_bytes=outputs,
    temp_bytes=temp,
    alias_bytes=alias,
    code_bytes=int(analysis.generated_code_size_in_bytes),
    host_bytes=host,
  )


def _platform(compiled: jax.stages.Compiled) -> str:
  for sharding in jax.tree.leaves(compiled.input_shardings):
    return next(iter(sharding.device_set)).platform
  return jax.default_backend()


def compiled_memory(
  fun: Callable[..., Any],
  *args: Any,
  target: CompileTarget | None = None,
  **kwargs: Any,
) -> MemoryStats:
  """Compiles ``fun(*args, **kwargs)`` and returns XLA's memory analysis.

  ``fun`` may already be jitted (with its own ``donate_argnums`` and
  shardings); otherwise it is wrapped in ``jax.jit``. The arguments may be
  arrays or ``jax.ShapeDtypeStruct``s. Nothing runs.

  With ``target``, the step is compiled for that accelerator's compile-only
  devices and the numbers are per device of it. ``ShapeDtypeStruct``s
  sharded on the target (``target.place``, ``target.mesh()``) keep their
  sharding and memory kind; every other array is replicated on the target,
  in host memory if it was in host memory.

  >>> import jax, jax.numpy as jnp
  >>> stats = compiled_memory(lambda x: x * 2, jax.ShapeDtypeStruct((256,), jnp.float32))
  >>> stats.argument_bytes, stats.output_bytes
  (1024, 1024)

  The same on a TPU v5e chip, with a 1 MiB argument in host memory:

  >>> tpu = jaxaccum.compile_target("tpu-v5e")
  >>> x = tpu.place(jax.ShapeDtypeStruct((512, 512), jnp.float32), memory_kind="pinned_host")
  >>> stats = compiled_memory(lambda x: jax.device_put(x, jax.memory.Space.Device).sum(), x, target=tpu)
  >>> stats.argument_bytes, stats.host_bytes
  (0, 1048576)
  """
  return _memory_of(compile_for(fun, args, kwargs, target), target)


def compile_for(
  fun: Callable[..., Any],
  args: Sequence[Any],
  kwargs: dict[str, Any],
  target: CompileTarget | None,
) -> Any:
  """``fun(*args, **kwargs)`` compiled, for ``target`` or the default
  backend: an object with ``memory_analysis()`` and ``as_text()``."""
  if target is not None:
    return target._compile(fun, args, kwargs)
  jitted = fun if hasattr(fun, "lower") else jax.jit(fun)
  return jitted.lower(*args, **kwargs).compile()


def _memory_of(compiled: Any, target: CompileTarget | None) -> MemoryStats:
  analysis = compiled.memory_analysis()
  if analysis is None:  # some backends do not report
    raise RuntimeError(
      f"The {jax.default_backend()} backend reports no memory analysis."
    )
  platform = target.platform if target is not None else _platform(compiled)
  return _from_analysis(analysis, platform)


def memory_report(
  fun: Callable[..., Any],
  *args: Any,
  print_fn: Callable[[str], Any] = print,
  target: CompileTarget | None = None,
  **kwargs: Any,
) -> MemoryStats:
  """Prints ``compiled_memory(fun, *args, target=target, **kwargs)`` readably.

  Returns the ``MemoryStats`` it printed.

  >>> import jax, jax.numpy as jnp
  >>> _ = memory_report(lambda x: x * 2, jnp.ones(256))
           arguments:     1.0 KiB
             outputs:     1.0 KiB
         temporaries:       0 B
   aliased (donated):       0 B
                peak:     2.0 KiB
  """
  stats = compiled_memory(fun, *args, target=target, **kwargs)
  print_fn(str(stats))
  return stats


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
    memory: MemoryStats | None = _memory_of(compiled, target)
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
