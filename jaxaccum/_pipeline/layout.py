"""Where the stages lie: the mesh and its stage axis, the stacked layers'
placement on it, the data axes beside it and the rows each data shard
pipelines; on one device, the stacked leaves laid out by stage."""

from __future__ import annotations

import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp

from jaxaccum import _compat
from jaxaccum._pipeline.arguments import divisors
from jaxaccum._pipeline.schedule import Schedule

PyTree = Any


class ReplicatedLayersWarning(UserWarning):
  """Stacked layers that are not split over the stage axis: every device
  holds every stage's layers."""


def find_mesh(stacked: PyTree, stage_axis: str, stages: int) -> Any:
  """The mesh the stages run on: the context's (``jax.set_mesh``, jaxaccum's
  ``mesh=``), else the one the leaves' shardings name; None without one."""
  mesh: Any = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    meshes = (_leaf_mesh(leaf) for leaf in jax.tree.leaves(stacked))
    mesh = next((m for m in meshes if m is not None), None)
  if mesh is None:
    return None
  if stage_axis not in mesh.axis_names:
    raise ValueError(
      f"The mesh has no axis {stage_axis!r} for the stages: its axes are "
      f"{tuple(mesh.axis_names)}. Name the stage axis with stage_axis=, or "
      f"make a mesh with one of size num_stages={stages}."
    )
  if mesh.shape[stage_axis] != stages:
    raise ValueError(
      f"The mesh's stage axis {stage_axis!r} has {mesh.shape[stage_axis]} "
      f"devices and num_stages={stages}: one stage per device, so pass "
      f"num_stages={mesh.shape[stage_axis]} or resize the axis."
    )
  return mesh


def check_placement(
  stacked: PyTree, mesh: Any, axis: str, stages: int, repeats: int
) -> None:
  """Each stage's layers lie on its own devices: the stacked leaves' layer
  axis is split over the stage axis, where their sharding shows. On
  Explicit axes anything else is an error (``shard_map`` refuses it, with a
  message about specs); elsewhere replicated layers run (each stage slices
  its own out), but every device holds them all: a warning. Under ``jit``
  on Auto axes the sharding is hidden, and nothing is said."""
  dim = 0 if repeats == 1 else 1
  want = f"P({axis!r})" if repeats == 1 else f"P(None, {axis!r})"
  types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
  explicit = types[axis] == jax.sharding.AxisType.Explicit
  for path, leaf in jax.tree_util.tree_leaves_with_path(stacked):
    spec = _compat.explicit_spec(leaf) if explicit else None
    if spec is None and not _compat.is_tracer(leaf):
      spec = _compat.visible_spec(leaf)
    if spec is None or _on_stages(spec, jnp.ndim(leaf), dim, axis):
      continue
    name = f"stacked{jax.tree_util.keystr(path)}"
    layers = math.prod(jnp.shape(leaf)[: dim + 1])
    if explicit:
      where = (
        f"axis 0, of {layers} layers"
        if repeats == 1
        else f"axis 1, of {layers // repeats} layers per repeat"
      )
      raise ValueError(
        f"{name} lies {spec} on the mesh's Explicit axes, and each of the "
        f"{stages} stages holds its own layers: the layer axis ({where}) must "
        f"be split over the stage axis {axis!r}. Place the stacked layers "
        f"{want}: jax.device_put(stacked, NamedSharding(mesh, {want})) before "
        f"the step, jax.sharding.reshard(stacked, {want}) inside it, or "
        f"param_specs={want} under jaxaccum's mesh=."
      )
    warnings.warn(
      f"{name} lies {spec} on the mesh, so every device holds all {layers} "
      f"layers, and each of the {stages} stages uses {layers // stages} of "
      f"them: place the stacked layers {want} (jax.device_put(stacked, "
      f"NamedSharding(mesh, {want}))) so that each device holds its own "
      "stage's layers only.",
      ReplicatedLayersWarning,
      stacklevel=5,  # check_placement, on_mesh, __call__, pipelined, the caller
    )
    return


def _on_stages(spec: Any, ndim: int, dim: int, axis: str) -> bool:
  """Whether ``spec`` splits dimension ``dim``, and no other, over ``axis``."""
  entries = [*spec, *(None,) * (ndim - len(spec))]
  names = [e if isinstance(e, tuple) else (e,) for e in entries]
  return axis in names[dim] and not any(
    axis in n for d, n in enumerate(names) if d != dim
  )


def _leaf_mesh(leaf: Any) -> Any:
  """The mesh a leaf's sharding names, where it is visible: a concrete
  array's, or a traced one's type on Explicit axes."""
  sharding = None if _compat.is_tracer(leaf) else getattr(leaf, "sharding", None)
  if isinstance(sharding, jax.sharding.NamedSharding):
    return sharding.mesh
  if _compat.explicit_spec(leaf) is not None:
    return jax.typeof(leaf).sharding.mesh
  return None


def data_axes(
  given: tuple[str, ...] | None, x: PyTree, stage_axis: str
) -> tuple[str, ...]:
  """The data axes: as given, or the mesh axes that ``x``'s rows are
  sharded over where its type shows them (Explicit axes), the stage axis
  excepted."""
  if given is not None:
    return given
  found: list[str] = []
  for leaf in jax.tree.leaves(x):
    spec = _compat.explicit_spec(leaf)
    entry = spec[0] if spec else None
    names = entry if isinstance(entry, tuple) else (entry,)
    found.extend(n for n in names if n and n != stage_axis and n not in found)
  return tuple(found)


def check_data_axes(data: tuple[str, ...], mesh: Any, stage_axis: str) -> None:
  bad = [a for a in data if a not in mesh.axis_names or a == stage_axis]
  if bad:
    raise ValueError(
      f"data_axis={data} names {tuple(bad)}, which "
      + ("is the stage axis" if stage_axis in bad else "the mesh does not have")
      + f": the mesh's axes are {tuple(mesh.axis_names)}, the stages on "
      f"{stage_axis!r}. Name the axes the batch is sharded over besides it."
    )


def check_shard_rows(
  rows: int, shards: int, axes: tuple[str, ...], micro_batches: int
) -> None:
  """Each data shard pipelines its own rows: they split into the
  micro-batches."""
  if rows % shards:
    raise ValueError(
      f"The batch_size={rows} does not split over the {shards} devices of the "
      f"data axes {axes}: pass a batch whose size is a multiple of {shards}."
    )
  local = rows // shards
  if local % micro_batches:
    raise ValueError(
      f"Each of the {shards} data shards (axes {axes}) pipelines its own "
      f"{local} of the batch_size={rows} rows, and num_micro_batches="
      f"{micro_batches} does not divide {local}: choose a num_micro_batches "
      f"that does ({divisors(local)}), or a batch_size that is a multiple "
      f"of {shards * micro_batches}."
    )


def by_stage(schedule: Schedule, w: jax.Array) -> jax.Array:
  """A stacked leaf as ``(S, r, n, ...)``: the stages on one device."""
  S, r, n = schedule.stages, schedule.repeats, schedule.layers_per_stage
  w = w.reshape(r, S, n, *w.shape[(1 if r == 1 else 2) :])
  return jnp.moveaxis(w, 1, 0)
