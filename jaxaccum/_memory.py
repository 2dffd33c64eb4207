"""Compile-time memory analysis, and choosing ``k`` before anything runs.

Everything here lowers and compiles; nothing executes, so nothing can run out
of memory. The numbers come from XLA's buffer assignment
(``jit(f).lower(*args).compile().memory_analysis()``), which is the memory the
compiled step will ask the device for:

``peak = argument + output + temp - alias``

(``alias`` is the output memory that reuses donated argument buffers).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax

from jaxaccum import _accumulate, _split


class MemoryStats(NamedTuple):
  """The device memory of one compiled function, in bytes.

  Attributes:
    argument_bytes: the inputs.
    output_bytes: the outputs.
    temp_bytes: XLA's scratch: activations, the accumulator, intermediates.
    alias_bytes: outputs that reuse donated input buffers.
    code_bytes: the generated code.
  """

  argument_bytes: int
  output_bytes: int
  temp_bytes: int
  alias_bytes: int
  code_bytes: int

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


def compiled_memory(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> MemoryStats:
  """Compiles ``fun(*args, **kwargs)`` and returns XLA's memory analysis.

  ``fun`` may already be jitted (with its own ``donate_argnums`` and
  shardings); otherwise it is wrapped in ``jax.jit``. The arguments may be
  arrays or ``jax.ShapeDtypeStruct``s. Nothing runs.

  >>> import jax, jax.numpy as jnp
  >>> stats = compiled_memory(lambda x: x * 2, jax.ShapeDtypeStruct((256,), jnp.float32))
  >>> stats.argument_bytes, stats.output_bytes
  (1024, 1024)
  """
  jitted = fun if hasattr(fun, "lower") else jax.jit(fun)
  analysis = jitted.lower(*args, **kwargs).compile().memory_analysis()
  if analysis is None:  # some backends do not report
    raise RuntimeError(
      f"The {jax.default_backend()} backend reports no memory analysis."
    )
  return MemoryStats(
    argument_bytes=int(analysis.argument_size_in_bytes),
    output_bytes=int(analysis.output_size_in_bytes),
    temp_bytes=int(analysis.temp_size_in_bytes),
    alias_bytes=int(analysis.alias_size_in_bytes),
    code_bytes=int(analysis.generated_code_size_in_bytes),
  )


def memory_report(
  fun: Callable[..., Any],
  *args: Any,
  print_fn: Callable[[str], Any] = print,
  **kwargs: Any,
) -> MemoryStats:
  """Prints ``compiled_memory(fun, *args, **kwargs)`` readably and returns it.

  >>> import jax, jax.numpy as jnp
  >>> _ = memory_report(lambda x: x * 2, jnp.ones(256))
           arguments:     1.0 KiB
             outputs:     1.0 KiB
         temporaries:       0 B
   aliased (donated):       0 B
                peak:     2.0 KiB
  """
  stats = compiled_memory(fun, *args, **kwargs)
  print_fn(str(stats))
  return stats


class Candidate(NamedTuple):
  """One row of the planner's table.

  Attributes:
    num_micro_batches: ``k``.
    micro_batch_size: rows per micro-batch.
    memory: the compiled step's memory.
    fits: whether ``memory.peak_bytes <= memory_limit_bytes``.
  """

  num_micro_batches: int
  micro_batch_size: int
  memory: MemoryStats
  fits: bool


class MicroBatchPlan(NamedTuple):
  """What :func:`plan_micro_batches` chose.

  Attributes:
    num_micro_batches: the smallest ``k`` (largest micro-batch) that fits.
    peak_bytes: the peak of that compiled step.
    table: every candidate, by increasing ``k``.
  """

  num_micro_batches: int
  peak_bytes: int
  table: tuple[Candidate, ...]

  def __str__(self) -> str:
    lines = [f"{'k':>6} {'micro-batch':>12} {'peak':>12}  fits"]
    for row in self.table:
      mark = "yes" if row.fits else "no"
      if row.num_micro_batches == self.num_micro_batches:
        mark += "  <- chosen"
      lines.append(
        f"{row.num_micro_batches:>6} {row.micro_batch_size:>12} "
        f"{format_bytes(row.memory.peak_bytes):>12}  {mark}"
      )
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
  memory_limit_bytes: int,
  candidates: Sequence[int] | None = None,
  step_batch_argnum: int | None = None,
  **value_and_grad_kwargs: Any,
) -> MicroBatchPlan:
  """Chooses the smallest ``k`` whose compiled step fits ``memory_limit_bytes``.

  Every candidate is lowered and compiled, never run, and measured with XLA's
  memory analysis (``argument + output + temp - alias``).

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
    memory_limit_bytes: the budget, e.g. 90% of the device's memory.
    candidates: the ``k`` to try; by default every divisor of the batch size
      per device (the whole batch without ``mesh``, else its share of each
      device along ``data_axis``).
    step_batch_argnum: for a step builder, the position of the batch among
      the step's ``args``; by default the last. (For a loss, the batch is
      ``args[batch_argnums]``, as in :func:`jaxaccum.value_and_grad`.)
    **value_and_grad_kwargs: the options of :func:`jaxaccum.value_and_grad`;
      for a step builder, passed on to it with ``num_micro_batches``.

  Returns:
    A ``MicroBatchPlan``: the chosen ``k``, its peak bytes and the table of
    all candidates.

  Raises:
    ValueError: if no candidate fits, naming the budget and the smallest peak.

  >>> import jax, jax.numpy as jnp, jaxaccum
  >>> def loss(w, x):
  ...   return jnp.mean(jnp.tanh(jnp.tanh(x @ w) @ w.T) ** 2)
  >>> args = (jnp.ones((64, 64)), jax.ShapeDtypeStruct((1024, 64), jnp.float32))
  >>> plan = jaxaccum.plan_micro_batches(loss, args, memory_limit_bytes=600_000)
  >>> plan.num_micro_batches > 1, plan.peak_bytes <= 600_000
  (True, True)

  Every larger micro-batch (smaller ``k``) was over the budget:

  >>> k = plan.num_micro_batches
  >>> any(row.fits for row in plan.table if row.num_micro_batches < k)
  False
  """
  builder = _is_step_builder(fun)
  if builder:
    nums: Sequence[int] = (
      len(args) - 1 if step_batch_argnum is None else step_batch_argnum,
    )
  elif step_batch_argnum is not None:
    raise ValueError(
      "step_batch_argnum is for a step builder; for a loss, pass batch_argnums."
    )
  else:
    batch_argnums = value_and_grad_kwargs.get("batch_argnums", 1)
    nums = (batch_argnums,) if isinstance(batch_argnums, int) else batch_argnums
  batch_size = _split.leading_batch_size({f"args[{n}]": args[n] for n in nums})
  mesh, data_axis = (value_and_grad_kwargs.get(n) for n in ("mesh", "data_axis"))
  if mesh is not None and data_axis is not None:
    devices = mesh.shape[data_axis]
    if batch_size % devices:
      raise ValueError(
        f"The global {batch_size=} is not divisible by the {devices} devices "
        f"of data axis {data_axis!r}."
      )
    batch_size //= devices
  if candidates is None:
    candidates = [k for k in range(1, batch_size + 1) if batch_size % k == 0]
  if not candidates:
    raise ValueError("No candidate num_micro_batches to try.")

  table = []
  for k in sorted(set(candidates)):
    if builder:
      step = fun(num_micro_batches=k, **value_and_grad_kwargs)
    else:
      step = _accumulate.value_and_grad(fun, k, **value_and_grad_kwargs)
    memory = compiled_memory(step, *args)
    fits = memory.peak_bytes <= memory_limit_bytes
    table.append(Candidate(k, batch_size // k, memory, fits))

  fitting = [row for row in table if row.fits]
  if not fitting:
    smallest = min(row.memory.peak_bytes for row in table)
    raise ValueError(
      f"No candidate fits {memory_limit_bytes=} ({format_bytes(memory_limit_bytes)}); "
      f"the smallest compiled peak is {smallest} bytes ({format_bytes(smallest)}) "
      f"among num_micro_batches={[row.num_micro_batches for row in table]}."
    )
  chosen = fitting[0]
  return MicroBatchPlan(
    chosen.num_micro_batches, chosen.memory.peak_bytes, tuple(table)
  )
