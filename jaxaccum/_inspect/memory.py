"""Compile-time memory analysis (with which :mod:`jaxaccum._inspect.planner`
chooses ``k`` before anything runs).

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

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax

from jaxaccum._inspect.targets import CompileTarget


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
