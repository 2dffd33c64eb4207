"""``jaxaccum.DataParallel``: the data-parallel options, as one group.

``value_and_grad(fun, k, parallel=jaxaccum.DataParallel(mesh, "data"))`` is
``value_and_grad(fun, k, mesh=mesh, data_axis="data")``: the flat keywords
are shorthands for this group's fields, and giving both is a ``TypeError``.
The group validates itself here, where its feature lives; the core reads
it through :class:`jaxaccum._options.Options`'s properties only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from jaxaccum import _options

PyTree = Any

FSDP_MODES = ("per_micro_batch", "cast_once", "once")
#: What ``fun`` sees under ``mesh=`` (``view=``): one device's rows, or the
#: global micro-batch.
FUN_VIEWS = ("device", "global")


@dataclasses.dataclass(frozen=True)
class DataParallel:
  """Data parallelism: each device accumulates its own rows, and the
  gradients are reduced across devices once per step.

  Without ``mesh``, under plain ``jit`` on an Explicit mesh, the data axes
  are the axes the batch's rows are sharded over, and only ``fsdp_gather``
  (with ``gather_dtype``) applies. With ``mesh`` and ``data_axis`` each
  device splits its own rows into micro-batches and ``fun`` sees one
  device's micro-batch (``view="device"``) or the global one
  (``view="global"``). See ``docs/guide.md`` ("Scaling out").

  Attributes:
    mesh: a ``jax.sharding.Mesh`` for data parallelism under ``mesh=``.
    data_axis: the mesh axis the batch is sharded along, or a tuple of
      them (HSDP: ``("replica", "fsdp")``).
    param_specs: ``PartitionSpec``\\ s of the differentiated arguments (a
      tree prefix per entry of ``argnums``), needed only under ``jit`` on an
      Auto mesh, where shardings are not visible at trace time.
    fsdp_gather: how parameters sharded over the data axes (FSDP) are
      gathered: ``"per_micro_batch"`` (default: where they are used, their
      gradients reduce-scattered in each backward pass into an accumulator
      sharded like them), ``"cast_once"`` (cast to ``gather_dtype`` and
      gathered once per step, before the loop) or ``"once"`` (gathered
      once, no collective inside the loop, a whole accumulator per device).
    gather_dtype: the dtype of ``"cast_once"``'s gather (which needs it).
    view: what ``fun`` sees under ``mesh=``: ``"device"`` or ``"global"``.
    keyword: ``"parallel"``, the keyword of ``value_and_grad`` that takes
      the group.
    shorthands: the flat keywords of ``value_and_grad`` that stand for the
      group's fields (``mesh=`` for ``mesh``, ...).

  >>> import jax, jaxaccum
  >>> mesh = jax.make_mesh((1,), ("data",))
  >>> jaxaccum.DataParallel(mesh, "data").data_axes
  ('data',)
  >>> jaxaccum.DataParallel(mesh, "data", view="local")
  Traceback (most recent call last):
  ValueError: Unknown view='local'; choose one of ['device', 'global'].
  """

  mesh: jax.sharding.Mesh | None = None
  data_axis: str | tuple[str, ...] | None = None
  param_specs: PyTree | None = None
  fsdp_gather: str = "per_micro_batch"
  gather_dtype: Any = None
  view: str = "device"

  #: The keyword of ``value_and_grad`` that takes the group.
  keyword: ClassVar[str] = "parallel"
  #: The flat keywords that are shorthands for the group's fields.
  shorthands: ClassVar[dict[str, str]] = {
    "mesh": "mesh",
    "data_axis": "data_axis",
    "param_specs": "param_specs",
    "fsdp_gather": "fsdp_gather",
    "gather_dtype": "gather_dtype",
    "view": "view",
  }

  def __post_init__(self) -> None:
    mesh, axes = _mesh_and_axes(self.mesh, self.data_axis)
    if self.fsdp_gather not in FSDP_MODES:
      raise ValueError(
        f"Unknown fsdp_gather={self.fsdp_gather!r}; choose one of {list(FSDP_MODES)}."
      )
    if self.view not in FUN_VIEWS:
      raise ValueError(f"Unknown view={self.view!r}; choose one of {list(FUN_VIEWS)}.")
    if self.param_specs is not None and mesh is None:
      raise ValueError("param_specs is for the data-parallel path; pass mesh= too.")
    if self.view != "device" and mesh is None:
      raise ValueError("view= says what fun sees under mesh=; pass mesh= too.")
    object.__setattr__(self, "data_axis", axes)
    object.__setattr__(
      self, "gather_dtype", _gather_dtype(self.fsdp_gather, self.gather_dtype)
    )

  @property
  def data_axes(self) -> tuple[str, ...] | None:
    """``data_axis`` as a tuple (None without a mesh)."""
    return self.data_axis  # type: ignore[return-value]  # made a tuple above

  @property
  def data_devices(self) -> int:
    """Devices the batch is split over under ``mesh=`` (1 without)."""
    if self.mesh is None or self.data_axes is None:
      return 1
    return math.prod(self.mesh.shape[a] for a in self.data_axes)

  def _check(self, options: _options.Options) -> None:
    """Checks against the other options: none constrain this group."""
    del options


_options.register(DataParallel)


def _gather_dtype(fsdp_gather: str, gather_dtype: Any) -> Any:
  """``gather_dtype`` checked: a floating dtype, given for ``"cast_once"``
  (which needs it) and only then."""
  if fsdp_gather != "cast_once":
    if gather_dtype is not None:
      raise ValueError(
        f"gather_dtype={gather_dtype!r} is for fsdp_gather='cast_once', not "
        f"{fsdp_gather=}."
      )
    return None
  if gather_dtype is None:
    raise ValueError(
      "fsdp_gather='cast_once' casts the FSDP leaves to gather_dtype before "
      "gathering them once per step: name it, e.g. gather_dtype=jnp.bfloat16 "
      "(exact when fun's first use of each FSDP leaf is that cast)."
    )
  dtype = jnp.dtype(gather_dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"gather_dtype must be a floating dtype, got {dtype}.")
  return dtype


def _mesh_and_axes(
  mesh: Any, data_axis: Any
) -> tuple[jax.sharding.Mesh | None, tuple[str, ...] | None]:
  """``mesh`` checked, and ``data_axis`` as a tuple of its axis names."""
  if mesh is None and data_axis is None:
    return None, None
  if mesh is None:
    raise ValueError(f"{data_axis=} needs mesh=, the mesh that holds that axis.")
  if data_axis is None:
    raise ValueError("mesh= needs data_axis=, the name of the mesh's data axis.")
  if not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {mesh!r}.")
  return mesh, data_axes(mesh, data_axis)


def data_axes(mesh: jax.sharding.Mesh, data_axis: Any) -> tuple[str, ...]:
  """``data_axis`` (a name or a tuple of names) checked against ``mesh``.

  >>> mesh = jax.make_mesh((1,), ("data",))
  >>> data_axes(mesh, "data")
  ('data',)
  """
  axes = (data_axis,) if isinstance(data_axis, str) else data_axis
  if (
    not isinstance(axes, Sequence)
    or isinstance(axes, str)
    or not axes
    or not all(isinstance(a, str) for a in axes)
  ):
    raise TypeError(
      "data_axis must be a mesh axis name or a non-empty tuple of them, got "
      f"{data_axis!r}."
    )
  axes = tuple(axes)
  for a in axes:
    if a not in mesh.axis_names:
      raise ValueError(
        f"data_axis {a!r} is not an axis of the mesh, whose axes are {mesh.axis_names}."
      )
  if len(set(axes)) != len(axes):
    raise ValueError(f"data_axis={data_axis!r} repeats an axis.")
  return axes
