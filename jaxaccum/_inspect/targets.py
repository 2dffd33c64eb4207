"""Compile-only accelerator targets: plan for an H100 or a TPU slice without one.

XLA compiles for a GPU or a TPU without the hardware: the CUDA compiler plugin
and ``libtpu`` (the ``targets`` extra, ``pip install "jaxaccum[targets]"``)
make compile-only devices from a description of the device
(``jax.experimental.topologies``). A program compiled for them is never run;
its memory analysis is what :func:`jaxaccum.compiled_memory`,
:func:`jaxaccum.memory_report` and :func:`jaxaccum.plan_micro_batches` read
when given ``target=``.

The device descriptions ship with jaxaccum as package data
(``jaxaccum/_inspect/_target_data``): a GPU's ``GpuTargetConfigProto`` text proto, a
TPU's name and per-chip memory. On a machine without a GPU or TPU set
``JAX_PLATFORMS=cpu`` before JAX starts: otherwise the CUDA plugin tries to
initialize a GPU, fails, and does not register its compiler. libtpu prints
warnings about the TPU it cannot find when it loads; they are harmless here.
When JAX_PLATFORMS leaves TPUs out, libtpu only compiles, and jaxaccum lets
several processes load it at once (``ALLOW_MULTIPLE_LIBTPU_LOAD=1``) instead
of the second failing on ``/tmp/libtpu_lockfile``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import importlib.util
import json
import math
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils, topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxaccum import _compat

_DATA = "_target_data"
_EXTRA = 'pip install "jaxaccum[targets]"'


@functools.cache
def _catalog() -> dict[str, dict[str, Any]]:
  text = (
    importlib.resources.files("jaxaccum._inspect") / _DATA / "targets.json"
  ).read_text()
  return json.loads(text)


def _data_file(name: str) -> str:
  return (importlib.resources.files("jaxaccum._inspect") / _DATA / name).read_text()


@dataclasses.dataclass(frozen=True, eq=False)
class CompileTarget:
  """Compile-only devices of an accelerator you may not have.

  Build one with :func:`compile_target`. Nothing compiled for it can run;
  pass it as ``target=`` to :func:`jaxaccum.compiled_memory`,
  :func:`jaxaccum.memory_report` or :func:`jaxaccum.plan_micro_batches`.

  Attributes:
    name: the catalog name, e.g. ``"h100"`` or ``"tpu-v5e"``.
    title: a readable description of one device.
    platform: the XLA platform compiled for, ``"cuda"`` or ``"tpu"``.
    topology: the device layout, in XLA's notation for the platform.
    devices: the compile-only devices.
    memory_bytes: the memory of one device, in bytes.
    budget_fraction: the share of ``memory_bytes`` that
      :attr:`budget_bytes` plans with.
  """

  name: str
  title: str
  platform: str
  topology: str
  devices: tuple[jax.Device, ...]
  memory_bytes: int
  budget_fraction: float
  # The devices that shardings name: the compile-only devices themselves, or
  # for a GPU CPU devices standing in for them (see _compat.py).
  _sharding_devices: tuple[jax.Device, ...] = dataclasses.field(repr=False)

  def __repr__(self) -> str:
    return (
      f"CompileTarget({self.name!r}, topology={self.topology!r}: "
      f"{len(self.devices)} x {self.device_kind}, "
      f"{self.memory_bytes / 2**30:.1f} GiB each)"
    )

  @property
  def device_kind(self) -> str:
    """The devices' ``device_kind``, as XLA's compiler sees them."""
    return self.devices[0].device_kind

  @property
  def budget_bytes(self) -> int:
    """The default memory budget of one device: ``memory_bytes * budget_fraction``.

    A GPU plans with 75% of its memory, what JAX preallocates by default
    (``XLA_PYTHON_CLIENT_MEM_FRACTION``); a TPU with 90%, leaving room for
    the runtime and fragmentation.
    """
    return int(self.memory_bytes * self.budget_fraction)

  def mesh(
    self,
    axis_shapes: Sequence[int] | None = None,
    axis_names: Sequence[str] = ("data",),
    *,
    axis_types: Any = None,
  ) -> Mesh:
    """A ``jax.sharding.Mesh`` over every device of the target.

    Shard arguments over it (or use :meth:`place`) and pass it as ``mesh=``
    to the data-parallel path. For a GPU target the mesh's devices are CPU
    devices standing in for the GPUs, position for position: XLA's
    compile-only GPU devices have no host memory, the CPU devices do, and
    compilation goes to the GPUs. (A GPU target of ``n`` devices needs ``n``
    CPU devices: ``jax.config.update("jax_num_cpu_devices", n)`` before JAX
    starts.)

    Args:
      axis_shapes: the mesh shape; by default one axis over all devices.
      axis_names: one name per axis.
      axis_types: passed to ``jax.sharding.Mesh``.

    Returns:
      The mesh.

    Raises:
      ValueError: if the shape does not hold exactly the target's devices.
    """
    shape = tuple(axis_shapes) if axis_shapes is not None else (len(self.devices),)
    if math.prod(shape) != len(self.devices) or len(shape) != len(axis_names):
      raise ValueError(
        f"A mesh of shape {shape} with axes {tuple(axis_names)} does not hold "
        f"the {len(self.devices)} devices of {self.name} {self.topology}."
      )
    if self.platform == "tpu":
      devices = mesh_utils.create_device_mesh(shape, list(self._sharding_devices))
    else:
      devices = np.array(self._sharding_devices, dtype=object).reshape(shape)
    kwargs = {} if axis_types is None else {"axis_types": axis_types}
    return Mesh(devices, tuple(axis_names), **kwargs)

  def place(
    self,
    tree: Any,
    spec: PartitionSpec | None = None,
    *,
    mesh: Mesh | None = None,
    memory_kind: str | None = None,
  ) -> Any:
    """``jax.ShapeDtypeStruct``s of ``tree``'s arrays, sharded on the target.

    Args:
      tree: a pytree of arrays or ``jax.ShapeDtypeStruct``s.
      spec: one ``PartitionSpec`` for every leaf; by default replicated.
      mesh: a mesh from :meth:`mesh`; by default the one-axis mesh.
      memory_kind: ``"pinned_host"`` for host memory (a batch the step
        streams); by default device memory.

    Returns:
      The same tree of ``jax.ShapeDtypeStruct``s.
    """
    sharding = NamedSharding(
      self.mesh() if mesh is None else mesh,
      PartitionSpec() if spec is None else spec,
      memory_kind=memory_kind,
    )
    return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree
    )

  def _on_target(self, tree: Any) -> Any:
    """Every array of ``tree`` as a ``ShapeDtypeStruct`` on the target.

    A ``ShapeDtypeStruct`` sharded on the target keeps its sharding. Other
    arrays are replicated on :meth:`mesh`, in host memory if they were in
    host memory.
    """
    own = set(self._sharding_devices)
    replicated = NamedSharding(self.mesh(), PartitionSpec())

    def leaf(x: Any) -> Any:
      if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        return x
      sharding = getattr(x, "sharding", None)
      if isinstance(x, jax.ShapeDtypeStruct) and sharding is not None:
        if not sharding.device_set <= own:
          raise ValueError(
            f"A ShapeDtypeStruct {x.shape} {x.dtype} is sharded on devices "
            f"{sorted(d.id for d in sharding.device_set)} of "
            f"{next(iter(sharding.device_set)).platform}, not on the target "
            f"{self.name}: shard it on target.mesh() or use target.place()."
          )
        return x
      kind = getattr(sharding, "memory_kind", None)
      on = replicated.with_memory_kind(kind) if kind == "pinned_host" else replicated
      weak = bool(getattr(x, "weak_type", False))
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on, weak_type=weak)

    return jax.tree.map(leaf, tree)

  def _compile(
    self, fun: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
  ) -> Any:
    """Compiles ``fun(*args, **kwargs)`` for the target: an object with
    ``memory_analysis()`` and ``as_text()``, like ``jax.stages.Compiled``."""
    jitted: Any = fun if hasattr(fun, "trace") else jax.jit(fun)
    args, kwargs = self._on_target((tuple(args), kwargs))
    if self.platform == "tpu":
      with warnings.catch_warnings():
        # JAX writes compile-only TPU executables to its persistent cache but
        # cannot read them back (no client to load them on): it warns, then
        # compiles again. The numbers are unaffected.
        warnings.filterwarnings("ignore", "Error reading persistent compilation cache")
        return jitted.lower(*args, **kwargs).compile()
    lowered = jitted.trace(*args, **kwargs).lower(lowering_platforms=(self.platform,))
    index = {d: i for i, d in enumerate(self._sharding_devices)}
    try:
      devices = [self.devices[index[d]] for d in _compat.lowering_devices(lowered)]
    except KeyError:
      raise ValueError(
        f"The computation was placed on devices that are not {self.name}'s: "
        "build shardings from target.mesh() or target.place()."
      ) from None
    return _compat.compile_lowered(lowered, devices)


def _missing(what: str) -> ImportError:
  return ImportError(
    f"Compile-only targets need {what}, from the optional extra: {_EXTRA}"
  )


def _gpu_devices(spec: dict[str, Any], topology: str) -> tuple[jax.Device, ...]:
  config = _data_file(spec["target_config"])
  try:
    desc = topologies.get_topology_desc(
      "jaxaccum", spec["platform"], target_config=config, topology=topology
    )
  except NotImplementedError as e:
    plugins = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")
    if not any(importlib.util.find_spec(p) for p in plugins):
      raise _missing("the CUDA compiler plugin (jax-cuda13-plugin)") from e
    raise RuntimeError(
      "The CUDA plugin is installed but did not register its compiler; on a "
      "machine without a GPU its start-up fails unless JAX_PLATFORMS=cpu is "
      "set before JAX starts."
    ) from e
  return tuple(desc.devices)


def _tpu_devices(spec: dict[str, Any], topology: str) -> tuple[jax.Device, ...]:
  if importlib.util.find_spec("libtpu") is None:
    raise _missing("libtpu")
  platforms = jax.config.values.get("jax_platforms") or ""
  if platforms and "tpu" not in platforms.split(","):
    # libtpu only compiles here, it drives no TPU: let other processes load it
    # too (two planning scripts, pytest workers) instead of failing on
    # /tmp/libtpu_lockfile.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  try:
    dims = [int(n) for n in topology.split("x")]
  except ValueError:
    dims = []
  if not 1 <= len(dims) <= 3 or min(dims) < 1:
    raise ValueError(f"A TPU topology is a chip grid such as '2x4'; got {topology!r}.")
  chips = [*dims, 1, 1][:3]
  host = spec["chips_per_host_bounds"]
  bounds = [min(d, b) for d, b in zip(chips, host, strict=True)]
  desc = topologies.get_topology_desc(
    f"{spec['tpu_name']}:{topology}", "tpu", chips_per_host_bounds=tuple(bounds)
  )
  return tuple(desc.devices)


@functools.cache
def _make(name: str, topology: str) -> CompileTarget:
  spec = _catalog()[name]
  if spec["platform"] == "tpu":
    devices = _tpu_devices(spec, topology)
    stand_ins = devices
  else:
    devices = _gpu_devices(spec, topology)
    cpus = jax.devices("cpu")
    if len(cpus) < len(devices):
      raise ValueError(
        f"{name} {topology} has {len(devices)} devices; compiling for it needs "
        f"as many CPU devices to stand in for them, and this process has "
        f"{len(cpus)}: call jax.config.update('jax_num_cpu_devices', "
        f"{len(devices)}) before JAX starts."
      )
    stand_ins = tuple(cpus[: len(devices)])
  return CompileTarget(
    name=name,
    title=spec["title"],
    platform=spec["platform"],
    topology=topology,
    devices=devices,
    memory_bytes=int(spec["memory_bytes"]),
    budget_fraction=float(spec["budget_fraction"]),
    _sharding_devices=stand_ins,
  )


def compile_target(name: str, *, topology: str | None = None) -> CompileTarget:
  """Compile-only devices of a GPU or TPU, for memory planning without one.

  Needs the ``targets`` extra (``pip install "jaxaccum[targets]"``: the CUDA
  compiler plugin and ``libtpu`` at the installed JAX's version). On a
  machine without a GPU or TPU, set ``JAX_PLATFORMS=cpu`` before JAX starts.

  Args:
    name: ``"h100"`` (NVIDIA H100 SXM5 80 GB) or ``"tpu-v5e"`` (TPU v5e,
      16 GiB per chip).
    topology: the devices, in XLA's notation: for a GPU
      ``"<slices>x<hosts>x<gpus per host>"`` (default ``"1x1x1"``, one
      GPU); for a TPU the chip grid, e.g. ``"2x4"`` for 8 chips (default
      ``"1x1"``).

  Returns:
    A :class:`CompileTarget`; the same object for the same arguments.

  Raises:
    ValueError: for an unknown name.
    ImportError: if the compiler plugin or ``libtpu`` is not installed.

  >>> tpu = jaxaccum.compile_target("tpu-v5e", topology="2x4")
  >>> len(tpu.devices), tpu.device_kind, tpu.memory_bytes // 2**30
  (8, 'TPU v5 lite', 16)
  >>> h100 = jaxaccum.compile_target("h100")
  >>> h100.device_kind, h100.budget_bytes == int(0.75 * h100.memory_bytes)
  ('NVIDIA H100 80GB HBM3', True)
  """
  catalog = _catalog()
  if name not in catalog:
    raise ValueError(f"Unknown target {name!r}; known targets: {sorted(catalog)}.")
  return _make(name, topology or catalog[name]["default_topology"])
