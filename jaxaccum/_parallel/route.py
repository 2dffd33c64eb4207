"""Which path runs a traced step: one function, :func:`route`.

The contexts in which a ``mesh=`` step is compiled (:func:`mesh_context`)
and ``fun`` is traced (:func:`tracing_context`) live here too.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax

from jaxaccum import _compat, _engine
from jaxaccum._engine import Engine
from jaxaccum._parallel import device_view as _device_view
from jaxaccum._parallel import devices as _devices
from jaxaccum._parallel import global_view as _global_view
from jaxaccum._parallel import layout as _layout
from jaxaccum._parallel import placement as _placement
from jaxaccum._parallel import unreduced as _unreduced


def route(
  engine: Engine,
  layout: _layout.Layout | None,
  args: tuple[Any, ...],
  kwargs: dict[str, Any],
) -> _engine.Result:
  """``engine``'s step on ``args``, traced, on the path its options and the
  arguments' types choose (``layout``: the leaves' split specs under
  ``mesh=``, :func:`jaxaccum._parallel.layout.layout`; None without):

  - **No** ``mesh=``, plain ``jit``: on Explicit axes that the batch's rows
    are sharded over (:func:`jaxaccum._parallel.unreduced.data_axes`), for
    a loop whose micro steps need no whole micro-batch gradient
    (:func:`jaxaccum._parallel.unreduced.applies`),
    :mod:`jaxaccum._parallel.unreduced` (parameters ``reduced``,
    accumulators ``unreduced``, one reduction after the loop); otherwise
    the engine's own step, whose reductions the partitioner places, its
    FSDP leaves entering as ``fsdp_gather`` says
    (:func:`jaxaccum._parallel.unreduced.partitioned`).
  - ``mesh=`` with ``view="global"``: on Explicit data axes that the batch
    is sharded over (all of them, and no other), where it applies, the same
    :mod:`jaxaccum._parallel.unreduced` step (``mesh=`` only names the data
    axes), the global view's step its fallback; otherwise
    :mod:`jaxaccum._parallel.global_view`, the partitioner's.
  - ``mesh=`` (``view="device"``, the default):
    :mod:`jaxaccum._parallel.device_view`, each device's rows its own.

  Should JAX refuse a ``reduced`` leaf in the unreduced step (a jaxaccum
  bug), the step falls back, with a warning, to the path it stands in for
  (:func:`jaxaccum._parallel.unreduced.run_or_fall_back`).
  """
  o = engine.options
  if o.mesh is None:
    axes = _unreduced.data_axes(o, args)
    _compat.refuse_jax_bugs(engine.fun, o, args, kwargs, data_axes=axes)
    if not axes:
      return engine.local(args, kwargs)
    engine.check_args(args)
    split = engine.plan(args)
    partitioned = _unreduced.partitioned(engine, axes, split)
    if not _unreduced.applies(o, split.num_micro_batches):
      return partitioned(args, kwargs)
    return _unreduced.run_or_fall_back(
      engine, axes, args, kwargs, split, fallback=partitioned
    )
  assert layout is not None and o.data_axes is not None
  devices = _devices.Devices(o.mesh, o.data_axes)
  with tracing_context(o.mesh):
    engine.check_args(args)
    _layout.warn_if_hidden(o, layout, args)
    placements = _placement.for_mesh(o, layout)
    if o.view == "device":
      return _device_view.step(devices, engine, placements, args)(args, kwargs)
    _compat.refuse_jax_bugs(
      engine.fun, o, args, kwargs, data_axes=devices.axes, mesh=o.mesh
    )
    if devices.explicit and set(_unreduced.data_axes(o, args)) == set(devices.axes):
      split = engine.plan(args)
      if _unreduced.applies(o, split.num_micro_batches):
        return _unreduced.run_or_fall_back(
          engine,
          devices.axes,
          args,
          kwargs,
          split,
          fallback=_global_view.runner(engine, placements),
        )
    return _global_view.runner(engine, placements)(args, kwargs)


def mesh_context(mesh: jax.sharding.Mesh | None) -> Any:
  """``jax.set_mesh(mesh)`` unless a mesh is set already (or ``mesh`` is
  None): where jaxaccum compiles a step with ``mesh=`` itself (an eager call,
  the planner), it runs in that mesh, as the user's ``jit`` would."""
  if mesh is None or not jax.sharding.get_mesh().empty:
    return contextlib.nullcontext()
  return jax.set_mesh(mesh)


def tracing_context(mesh: jax.sharding.Mesh) -> Any:
  """The mesh as the context in which ``fun`` is traced, as under plain
  ``jit`` in ``jax.set_mesh`` (annotations name axes by a bare
  ``PartitionSpec``); the caller's own mesh context if it has one."""
  if not jax.sharding.get_abstract_mesh().empty:
    return contextlib.nullcontext()
  return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)
