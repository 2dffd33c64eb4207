"""A compiled step, read: what it communicates, in which loops, and its peak.

:func:`read_compiled` puts together what :mod:`jaxaccum._inspect.hlo` reads from the
optimized HLO (every collective with its bytes, replica groups and the while
loops around it; every loop with its trip count) and what
:mod:`jaxaccum._inspect.memory` reads from XLA's memory analysis (the peak). It is
what jaxaccum's own structure tests and benchmarks check a step by, for a
user checking theirs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jaxaccum._inspect import hlo as _hlo
from jaxaccum._inspect import memory as _memory
from jaxaccum._inspect.hlo import Collective, Loop
from jaxaccum._inspect.memory import MemoryStats
from jaxaccum._inspect.targets import CompileTarget


@dataclasses.dataclass(frozen=True)
class CompiledStep:
  """A compiled step, read: its collectives and loops, and its memory.

  Attributes:
    compiled: the compiled program (a ``jax.stages.Compiled``, or for a
      ``target`` the compile-only program, which has ``as_text()`` and
      ``memory_analysis()`` only); None when read from HLO text.
    text: its optimized HLO text.
    collectives: every collective at every place it runs
      (:class:`Collective`: its op, bytes per execution, executions per
      call, replica groups, and the names of the loops around it).
    loops: every while loop where it runs (:class:`Loop`: its trip count,
      the loops around it, the computations inside it), outer loops first.
    memory: XLA's memory analysis, per device (:class:`jaxaccum.MemoryStats`);
      None for HLO text, or where the backend reports none.
  """

  compiled: Any
  text: str
  collectives: tuple[Collective, ...]
  loops: tuple[Loop, ...]
  memory: MemoryStats | None

  @property
  def peak_bytes(self) -> int | None:
    """The device memory the step needs at once, per device
    (``argument + output + temp - alias``); None without a memory analysis."""
    return None if self.memory is None else self.memory.peak_bytes

  @property
  def bytes_communicated(self) -> int:
    """Collective result bytes per call, the loops' trip counts included."""
    return sum(c.bytes * c.executions for c in self.collectives)

  def loop(self, name: str) -> Loop:
    """The loop named ``name`` (as ``Collective.loops`` names it); the
    first where it runs, if it runs in several places."""
    for found in self.loops:
      if found.name == name:
        return found
    raise KeyError(f"No while loop named {name!r}: {[w.name for w in self.loops]}.")

  def inside(self, loop: Loop | str) -> list[Collective]:
    """The collectives inside ``loop`` (a :class:`Loop` or its name),
    nested loops included."""
    name = loop if isinstance(loop, str) else loop.name
    return [c for c in self.collectives if name in c.loops]

  def op_names(self) -> dict[str, str]:
    """Per instruction name, the JAX operation it came from (its
    ``metadata`` ``op_name``), for the instructions that say."""
    module = _hlo.parse(self.text)
    return {
      i.name: i.op_name
      for instructions in module.computations.values()
      for i in instructions
      if i.op_name
    }


def read_compiled(
  compiled: Any, *, target: CompileTarget | None = None
) -> CompiledStep:
  """Reads a compiled step: its collectives, its loops and its peak memory.

  Args:
    compiled: ``jax.jit(f).lower(...).compile()``, the program
      :func:`compile_step` or ``target`` compiled, anything with
      ``as_text()`` and ``memory_analysis()``; or optimized HLO text (a
      ``str``, e.g. a file XLA dumped), which has no memory analysis.
    target: the :func:`jaxaccum.compile_target` it was compiled for, if
      any (the TPU's memory analysis is read differently).

  Returns:
    The :class:`CompiledStep`.

  A data-parallel step on 8 devices (jaxaccum's ``mesh=`` path): one
  all-reduce over the ``data`` axis (the gradient and the loss, 64 bytes),
  outside the micro-batch loop of 4 trips:

  >>> import jax, jax.numpy as jnp, jaxaccum
  >>> from jax.sharding import NamedSharding, PartitionSpec as P
  >>> mesh = jax.make_mesh((8,), ("data",))
  >>> loss = lambda w, x: jnp.mean((x @ w) ** 2)
  >>> w = jax.device_put(jnp.ones((3, 5)), NamedSharding(mesh, P()))
  >>> x = jax.device_put(jnp.ones((64, 3)), NamedSharding(mesh, P("data")))
  >>> fun = jaxaccum.value_and_grad(loss, 4, mesh=mesh, data_axis="data")
  >>> step = read_compiled(jax.jit(fun).lower(w, x).compile())
  >>> [(loop.trip_count, loop.outer) for loop in step.loops]
  [(4, ())]
  >>> [(c.op, c.bytes, c.executions, c.loops, c.axes(mesh)) for c in step.collectives]
  [('all-reduce', 64, 1, (), ('data',))]
  >>> step.bytes_communicated, step.peak_bytes == step.memory.peak_bytes > 0
  (64, True)
  """
  if isinstance(compiled, str):
    text, memory, compiled = compiled, None, None
  else:
    text = compiled.as_text()
    try:
      memory = _memory._memory_of(compiled, target)
    except RuntimeError:  # the backend reports no memory analysis
      memory = None
  found, loops = _hlo.read(text)
  return CompiledStep(compiled, text, tuple(found), tuple(loops), memory)


def compile_step(
  fun: Callable[..., Any],
  *args: Any,
  target: CompileTarget | None = None,
  **kwargs: Any,
) -> CompiledStep:
  """Compiles ``fun(*args, **kwargs)`` and reads it (:func:`read_compiled`);
  nothing runs.

  ``fun`` may already be jitted (with its own shardings and donation);
  otherwise it is wrapped in ``jax.jit``. The arguments may be arrays or
  ``jax.ShapeDtypeStruct``\\ s. With ``target``
  (:func:`jaxaccum.compile_target`), the step is compiled for that
  accelerator's compile-only devices, as :func:`jaxaccum.compiled_memory`
  compiles it, and the memory is per device of it.

  >>> import jax.numpy as jnp
  >>> step = compile_step(lambda x: x * 2, jnp.ones(256))
  >>> step.collectives, step.memory.argument_bytes, step.memory.output_bytes
  ((), 1024, 1024)
  """
  compiled = _memory.compile_for(fun, args, kwargs, target)
  return read_compiled(compiled, target=target)
