"""Reading a compiled step: what it communicates, in which loops, and its peak.

:func:`compile_step` (or :func:`read_compiled` of a step you compiled)
gives a :class:`CompiledStep`: every collective with its bytes, replica
groups (:meth:`Collective.axes`: the mesh axes it spans) and the while loops
around it, every loop with its trip count, and XLA's memory analysis with
the peak. The functions below read HLO text alone.

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
from typing import Any

import jax

from jaxaccum import _compat
from jaxaccum._inspect import agreement as _agreement
from jaxaccum._inspect import hlo as _hlo
from jaxaccum._inspect.agreement import Divergence
from jaxaccum._inspect.compiled import CompiledStep, compile_step, read_compiled
from jaxaccum._inspect.hlo import (
  Collective,
  Loop,
  bytes_communicated,
  collectives,
  loops,
  replica_groups,
)

COLLECTIVES = _hlo.COLLECTIVES
"""The HLO ops that :func:`collectives` counts: XLA's collectives, and the
asynchronous start ops that stand for them."""

__all__ = [
  "COLLECTIVES",
  "Collective",
  "CompiledStep",
  "Divergence",
  "Loop",
  "bytes_communicated",
  "collectives",
  "compile_step",
  "compiled_text",
  "cpu_devices",
  "divergent_decisions",
  "loops",
  "read_compiled",
  "replica_groups",
]


def compiled_text(
  fun: Callable[..., Any], *args: Any, target: Any = None, **kwargs: Any
) -> str:
  """The optimized HLO of ``jit(fun)(*args, **kwargs)``; nothing runs.

  With ``target`` (:func:`jaxaccum.compile_target`), the HLO that XLA's
  compiler for that accelerator makes, as :func:`jaxaccum.compiled_memory`
  compiles it.
  """
  from jaxaccum._inspect.memory import compile_for  # noqa: PLC0415

  return compile_for(fun, args, kwargs, target).as_text()


def divergent_decisions(
  compiled: Any, mesh: jax.sharding.Mesh, axes: str | Sequence[str] | None = None
) -> list[Divergence]:
  r"""Decisions of a compiled step that devices could take differently.

  Every device runs the same program on its own shard. A ``lax.cond``
  predicate, a ``while`` condition, or an output replicated over the
  devices, computed from a value that differs between devices (not reduced
  over them first) lets devices disagree: whether to apply an update, how
  long the next window is, whether to skip a step. On a GPU or TPU that can
  hang a collective; anywhere it splits the replicas' parameters. This
  follows every value of the compiled, partitioned HLO from its sources
  (sharded parameters, device ids) through the collectives that make it
  the same within their groups, and lists what could differ (see
  :mod:`jaxaccum._inspect.agreement` for the rules; it is conservative).

  Args:
    compiled: ``jax.jit(f).lower(...).compile()``, for ``mesh``'s devices.
    mesh: the mesh the step runs on.
    axes: the mesh axes to check (default: all of them).

  Returns:
    The :class:`Divergence`\ s; empty when every device must agree.

  >>> import jax, jax.numpy as jnp
  >>> from jax.sharding import NamedSharding, PartitionSpec as P
  >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  >>> x = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("data")))
  >>> def local_total(x):  # each device decides on its own rows' sum
  ...   total = jax.shard_map(lambda r: r.sum(), mesh=mesh, in_specs=P("data"),
  ...                         out_specs=P(), check_vma=False)(x)
  ...   return jax.lax.cond(total > 0, lambda: 1.0, lambda: 0.0)
  >>> [d.kind for d in divergent_decisions(jax.jit(local_total).lower(x).compile(), mesh)]
  ['conditional', 'output']
  >>> total = lambda x: jax.lax.cond(x.sum() > 0, lambda: 1.0, lambda: 0.0)
  >>> divergent_decisions(jax.jit(total).lower(x).compile(), mesh)
  []
  """
  names = (axes,) if isinstance(axes, str) else axes
  inputs = [_sharded_axes(s, mesh) for s in jax.tree.leaves(compiled.input_shardings)]
  outputs = [_sharded_axes(s, mesh) for s in jax.tree.leaves(compiled.output_shardings)]
  return _agreement.divergences(
    compiled.as_text(),
    mesh.devices.shape,
    mesh.axis_names,
    input_axes=inputs,
    output_axes=outputs,
    checked=names,
  )


def _sharded_axes(sharding: Any, mesh: jax.sharding.Mesh) -> frozenset[int] | None:
  """The mesh axes an output is sharded along (it may differ along them);
  None where that cannot be read."""
  if sharding.is_fully_replicated:
    return frozenset()
  spec = getattr(sharding, "spec", None)
  if spec is None or getattr(sharding, "mesh", None) is None:
    return None
  if tuple(sharding.mesh.axis_names) != tuple(mesh.axis_names):
    return None
  named: set[str] = set()
  for entry in spec:
    if entry is None or entry is jax.sharding.PartitionSpec.UNCONSTRAINED:
      continue
    named.update(entry if isinstance(entry, tuple) else (entry,))
  return frozenset(mesh.axis_names.index(n) for n in named)


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

  Why the threads: XLA's CPU client (jaxlib 0.10.2; 0.12.0.1 runs
  executions on a pool of their own) runs program launches and the
  devices' executions on one pool of
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
