"""Every JAX internal jaxaccum relies on, in one module.

Each use is pinned by a doctest here or a test in ``tests/test_compat.py``
that fails loudly when a JAX release moves it, instead of a silent change
of behaviour elsewhere:

- :func:`is_tracer`: whether a value is traced by an outer transformation
  (``jax.core.Tracer``, which JAX does not promise to keep public);
- :func:`explicit_spec`: the ``PartitionSpec`` in a value's type on Explicit
  mesh axes (the public ``jax.typeof(x).sharding``, read with the rule for
  which meshes make it a promise);
- :data:`SHARDING_TYPE_ERRORS`: what JAX raises for an operation its
  sharding types refuse (``ShardingTypeError``, not exported:
  :data:`SHARDING_TYPE_REFUSALS`) or have no rule for yet
  (``NotImplementedError``);
- :func:`names_spmd_axis`: whether an error is JAX's refusal of a sharding
  annotation that names a ``vmap``'s ``spmd_axis_name``, which has no API of
  its own, so its text is matched here and nowhere else;
- compiling for compile-only GPUs (:func:`compile_lowered`);
- whether JAX's backends have started (:func:`backends_started`), after
  which the CPU device count and XLA's thread pools are fixed;
- :func:`psum_scatter`: ``jax.lax.psum_scatter`` where JAX fails to lower
  it (in a ``shard_map`` that leaves an Explicit axis to the partitioner:
  0.12 always, 0.10.2 when the operand is sharded along such an axis), as an
  all-to-all and a sum;
- :func:`type_of` and :func:`cotangent_type`: a value's type, and the type
  of its cotangent (``reduced`` becomes ``unreduced``: JAX's
  ``to_ct_aval``), as ``ShapeDtypeStruct`` values for ``jax.eval_shape``;
- :func:`add_jaxvals` and :func:`zeros_like_jaxval`: autodiff's own
  addition and zero, which a JAX extended dtype defines for itself (Flax's
  FP8 meta dtype ``fm32`` adds by ``max``), under a trace;
- :func:`spmd_vmap_axes`: the mesh axes of the ``vmap``s (with
  ``spmd_axis_name``) that map a value, which a ``shard_map`` inside them
  must count among its manual axes (jaxaccum's ``mesh=`` path runs the loss
  in one; :func:`jaxaccum.pipeline` runs a ``shard_map`` inside it);
- :data:`JAX_BUGS`: bugs of JAX releases that compute a step wrong,
  silently, each with the releases it affects, the one that fixed it and how
  :func:`refuse_jax_bugs` sees that a step would meet it; jaxaccum raises
  there instead of passing the wrong numbers on.

Compile-only GPUs: XLA's compile-only GPU devices
(``jax.experimental.topologies`` with the CUDA plugin) have no memory kinds,
and ``NamedSharding(..., memory_kind="pinned_host")`` on them silently drops
the kind. So a batch in host memory cannot be expressed on them through the
public API. What works: trace and lower on CPU devices, which do have
``pinned_host``, for the ``cuda`` platform
(``Traced.lower(lowering_platforms=("cuda",))``), then compile that module
with the compile-only GPU client, device for device. The lowering is public;
the compilation is not: it reads the lowering's compile arguments and device
assignment (``Lowered._lowering``) and JAX's rule for which shardings XLA may
choose (``pxla.get_prop_to_input_output``), and builds the compile options
with jaxlib's ``xla_client.CompileOptions``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jaxlib.version
import numpy as np
from jaxlib import xla_client

with contextlib.suppress(ImportError):  # jax 0.10.2 to 0.12: jax._src.core
  from jax._src.core import ShardingTypeError

#: What JAX raises for an operation whose operands' sharding types it
#: refuses (not exported).
SHARDING_TYPE_REFUSALS: tuple[type[Exception], ...] = (
  (ShardingTypeError,) if "ShardingTypeError" in globals() else ()
)

#: What JAX raises for a ``reduced`` or ``unreduced`` operand an operation
#: refuses, or has no rule for.
SHARDING_TYPE_ERRORS: tuple[type[Exception], ...] = (
  NotImplementedError,
  *SHARDING_TYPE_REFUSALS,
)


@contextlib.contextmanager
def _internals() -> Iterator[None]:
  """Turns a moved JAX internal into an error that says what moved."""
  try:
    yield
  except (AttributeError, KeyError, ImportError, TypeError) as e:
    raise RuntimeError(
      f"JAX {jax.__version__} changed an internal that jaxaccum uses "
      f"(jaxaccum/_compat.py): {type(e).__name__}: {e}"
    ) from e


def backends_started() -> bool:
  """Whether JAX has created its backends (device count and thread pools are
  fixed from then on).

  >>> isinstance(backends_started(), bool)
  True
  """
  from jax._src import xla_bridge  # noqa: PLC0415

  with _internals():
    return bool(xla_bridge.backends_are_initialized())


def is_tracer(x: Any) -> bool:
  """Whether ``x`` is a tracer of a transformation (``jit``, ``vmap``, ...).

  >>> is_tracer(1.0), is_tracer(jax.numpy.ones(2))
  (False, False)
  """
  return isinstance(x, jax.core.Tracer)


def explicit_spec(x: Any) -> jax.sharding.PartitionSpec | None:
  """The ``PartitionSpec`` that ``x``'s type carries, where its mesh has
  Explicit axes (there the type is a promise); None otherwise.

  >>> explicit_spec(jax.numpy.ones(2)) is None
  True
  """
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if sharding is None or mesh is None or mesh.empty:
    return None
  if not any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
    return None
  return sharding.spec


def type_of(x: Any) -> jax.ShapeDtypeStruct:
  """``x``'s type, its sharding included (``reduced`` and ``unreduced`` axes
  too), as a ``ShapeDtypeStruct``.

  >>> type_of(jnp.ones(2))
  ShapeDtypeStruct(shape=(2,), dtype=float32...)
  """
  aval = jax.typeof(x)
  return jax.ShapeDtypeStruct(
    aval.shape, aval.dtype, sharding=aval.sharding, weak_type=aval.weak_type
  )


def cotangent_type(x: Any) -> jax.ShapeDtypeStruct:
  """The type of ``x``'s cotangent: ``float0`` for an integer, and on a
  mesh ``reduced`` and ``unreduced`` axes swapped (JAX's ``to_ct_aval``).

  >>> cotangent_type(jnp.ones(2, jnp.int32)).dtype
  dtype([('float0', 'V')])
  """
  aval = jax.typeof(x).to_ct_aval()
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=aval.sharding)


def add_jaxvals(x: Any, y: Any) -> Any:
  """``x + y`` as autodiff adds two cotangents: for a JAX extended dtype, the
  dtype's own addition (``jax._src.ad_util``; traced only: JAX has no eager
  rule for an extended array)."""
  with _internals():
    from jax._src import ad_util  # noqa: PLC0415

    return ad_util.add_jaxvals(x, y)


def zeros_like_jaxval(x: Any) -> Any:
  """Autodiff's zero for ``x``'s type: the identity of :func:`add_jaxvals`
  (``-inf`` for Flax's ``fm32``)."""
  with _internals():
    from jax._src import ad_util  # noqa: PLC0415

    return ad_util.zeros_like_jaxval(x)


def differentiable_extended(dtype: Any) -> bool:
  """Whether ``dtype`` is an extended dtype that is its own tangent dtype
  (Flax's ``fm32``, which autodiff differentiates; a key's tangent is
  ``float0``).

  >>> differentiable_extended(jax.random.key(0).dtype), differentiable_extended(jnp.float32)
  (False, False)
  """
  if not jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
    return False
  with _internals():
    from jax._src import core  # noqa: PLC0415

    return core.primal_dtype_to_tangent_dtype(dtype) == dtype


def is_extended(x: Any) -> bool:
  """Whether ``x``'s dtype is a JAX extended dtype (a key, Flax's ``fm32``).

  >>> is_extended(jnp.ones(2)), is_extended(jax.random.key(0))
  (False, True)
  """
  return jax.dtypes.issubdtype(jax.typeof(x).dtype, jax.dtypes.extended)


def cotangent_full(x: Any, fill: float) -> jax.Array:
  """A cotangent for ``x`` filled with ``fill``, of the type JAX's
  ``to_ct_aval`` gives (``reduced`` where ``x`` is ``unreduced``): the seed
  of a backward pass.

  >>> cotangent_full(jnp.ones(()), 0.5).tolist()
  0.5
  """
  aval = jax.typeof(x).to_ct_aval()
  out = jnp.full(aval.shape, fill, aval.dtype)
  sharding = getattr(aval, "sharding", None)
  if explicit_spec(x) is None or sharding is None:
    return out
  return jax.sharding.reshard(out, sharding)


def visible_spec(x: Any) -> jax.sharding.PartitionSpec | None:
  """The ``PartitionSpec`` that ``x`` is known to have, or None if unknown.

  A concrete array knows its sharding. A traced value knows it only where
  the mesh axes are Explicit (the sharding is part of its type); under
  ``jit`` on an Auto mesh it is unknown.
  """
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, jax.sharding.NamedSharding) and not is_tracer(x):
    return sharding.spec
  return explicit_spec(x)


def spmd_vmap_axes(tree: Any, *, explicit: bool = False) -> tuple[str, ...]:
  """The mesh axes that ``vmap``s with ``spmd_axis_name`` map ``tree``'s
  leaves over, innermost first; ``()`` outside such a ``vmap``. With
  ``explicit``, the Explicit mesh axes such ``vmap``s map over instead (JAX
  records those apart).

  Under ``jax.vmap(..., spmd_axis_name=a)`` a mapped value is a batch
  tracer whose trace names ``a``; autodiff may wrap it (a JVP or linearize
  tracer around it). A ``shard_map`` inside such a ``vmap`` gets ``a``
  added to the specs of its mapped arguments, and on Auto axes needs it
  among its manual axes (JAX has no public way to ask).

  >>> spmd_vmap_axes(jax.numpy.ones(2))
  ()
  >>> found = []
  >>> _ = jax.vmap(lambda v: found.append(spmd_vmap_axes(v)) or v, spmd_axis_name="d")(jax.numpy.ones(2))
  >>> found
  [('d',)]
  """
  from jax._src.interpreters import ad, batching  # noqa: PLC0415

  found: list[str] = []
  with _internals():
    for leaf in jax.tree.leaves(tree):
      value = leaf
      while isinstance(value, jax.core.Tracer):
        if isinstance(value, batching.BatchTracer):
          data = value._trace.axis_data
          names = data.explicit_mesh_axis if explicit else data.spmd_name
          if isinstance(value.batch_dim, int) and names:
            found.extend(n for n in names if n not in found)
          value = value.val
        elif isinstance(value, (ad.JVPTracer, ad.LinearizeTracer)):
          value = value.primal
        else:
          break
  return tuple(found)


def psum_scatter(x: jax.Array, axis: str, dim: int) -> jax.Array:
  """``jax.lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)``
  inside a ``shard_map`` manual over ``axis``.

  Where the ``shard_map`` leaves an Explicit mesh axis to the partitioner,
  JAX cannot lower ``psum_scatter``: 0.12.0.1 fails with ``ValueError:
  Length of sharding.spec (2) must be equal to aval's ndim (0)`` (the
  reduction's scalars keep the operand's sharding), and 0.10.2 fails an
  ``AssertionError`` when the operand is sharded along such an axis (FSDP
  inside a pipeline stage). There an all-to-all of the ``n`` blocks and a
  sum of the blocks each device receives give the same result for the same
  bytes on the wire; elsewhere it is ``psum_scatter`` itself.
  """
  if _psum_scatter_lowers(x):
    return jax.lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)
  return scatter_by_all_to_all(x, axis, dim)


def _psum_scatter_lowers(x: jax.Array) -> bool:
  """Whether this JAX lowers ``psum_scatter`` of ``x`` here (see
  :func:`psum_scatter`)."""
  mesh = jax.sharding.get_abstract_mesh()
  if jax.sharding.AxisType.Explicit not in mesh.axis_types:  # manual axes show Manual
    return True
  if jax.__version_info__ >= (0, 12):
    return False
  spec = getattr(jax.typeof(x).sharding, "spec", None) or ()
  return all(entry is None for entry in spec)


def scatter_by_all_to_all(x: jax.Array, axis: str, dim: int) -> jax.Array:
  """:func:`psum_scatter` as an all-to-all of ``x``'s blocks along ``dim``
  and a sum of the blocks each device receives."""
  n = jax.lax.axis_size(axis)
  blocks = x.reshape(*x.shape[:dim], n, x.shape[dim] // n, *x.shape[dim + 1 :])
  blocks = jax.lax.all_to_all(blocks, axis, split_axis=dim, concat_axis=dim)
  return jnp.sum(blocks, axis=dim)


def scan_operand_counts(params: dict[str, Any], operands: int) -> tuple[int, int]:
  """A ``scan`` equation's numbers of constant and carried operands, of its
  ``operands`` in all (the rest are scanned): ``num_consts`` and
  ``num_carry`` up to jax 0.11.0, after it the first two parts of the flat
  tree ``ft_in``."""
  if "num_consts" in params:
    return params["num_consts"], params["num_carry"]
  consts, carry, _ = params["ft_in"].update(list(range(operands))).unpack()
  return len(list(consts)), len(list(carry))


def names_spmd_axis(error: Exception, axes: Sequence[str]) -> bool:
  """Whether ``error`` is JAX's refusal of a sharding annotation inside a
  ``vmap`` whose ``spmd_axis_name`` (``axes``) the annotation names: a
  sharding constraint naming them (a ``ValueError`` that says so), an
  ``out_sharding=`` that does, which the ``vmap`` turns into a spec naming
  an axis twice (a ``DuplicateSpecError``)."""
  from jax._src.named_sharding import DuplicateSpecError  # noqa: PLC0415

  if isinstance(error, DuplicateSpecError):
    spec = tuple(error.pspec)
    named = [
      n
      for entry in spec
      if entry is not None
      for n in (entry if isinstance(entry, tuple) else (entry,))
    ]
    return any(named.count(a) > 1 for a in axes)
  text = str(error)
  return isinstance(error, ValueError) and "spmd_axis_name" in text and "spec" in text


def lowering_devices(lowered: jax.stages.Lowered) -> tuple[jax.Device, ...]:
  """The devices ``lowered`` was lowered for, in XLA's device-assignment order."""
  with _internals():
    device_list = lowered._lowering._device_list  # type: ignore[attr-defined]
  if device_list is None:
    raise ValueError("The lowered computation has no device assignment.")
  return tuple(device_list)


class CompiledForTarget:
  """A program compiled for compile-only devices, read like a
  ``jax.stages.Compiled``: its memory analysis and its optimized HLO."""

  def __init__(self, executable: Any):
    self._executable = executable

  def memory_analysis(self) -> Any:
    """XLA's ``CompiledMemoryStats``, per device."""
    return self._executable.get_compiled_memory_stats()

  def as_text(self) -> str:
    """The optimized HLO module's text."""
    with _internals():
      return self._executable.hlo_modules()[0].to_string()


def compile_lowered(
  lowered: jax.stages.Lowered, devices: Sequence[jax.Device]
) -> CompiledForTarget:
  """Compiles ``lowered`` for ``devices``: its memory and HLO text.

  Args:
    lowered: a computation lowered (for the platform of ``devices``) on other
      devices, e.g. CPU devices standing in for GPUs.
    devices: compile-only devices, one per device of ``lowered``'s device
      assignment, in that order.

  Returns:
    The compiled program (:class:`CompiledForTarget`).
  """
  lowered_on = lowering_devices(lowered)
  if len(devices) != len(lowered_on):
    raise ValueError(
      f"{len(devices)} target devices for a computation lowered on {len(lowered_on)}."
    )
  with _internals():
    from jax._src.interpreters import pxla  # noqa: PLC0415

    lowering: Any = lowered._lowering
    args = lowering.compile_args
    module = lowering.stablehlo()
    allow_in, allow_out = pxla.get_prop_to_input_output(
      args["in_shardings"], args["out_shardings"], len(args["ordered_effects"])
    )
    tuple_args = bool(args["tuple_args"])
  # The options jax.jit would build, from jaxlib's (stable) CompileOptions
  # rather than from JAX's private helper, whose signature changes between
  # releases (0.10.0 and 0.10.2 differ). What is left out are tuning knobs
  # from JAX's config (optimization effort levels); XLA_FLAGS still apply.
  options = xla_client.CompileOptions()
  options.num_replicas = 1
  options.num_partitions = len(devices)
  options.device_assignment = xla_client.DeviceAssignment.create(
    np.array([[d.id for d in devices]])
  )
  options.parameter_is_tupled_arguments = tuple_args
  build = options.executable_build_options
  build.use_spmd_partitioning = True
  build.use_shardy_partitioner = bool(jax.config.values["jax_use_shardy_partitioner"])
  build.allow_spmd_sharding_propagation_to_parameters = list(allow_in)
  build.allow_spmd_sharding_propagation_to_output = list(allow_out)
  client = devices[0].client
  executable = client.compile(
    module,
    executable_devices=xla_client.DeviceList(tuple(devices)),
    compile_options=options,
  )
  return CompiledForTarget(executable)


# -- JAX bugs that jaxaccum refuses to pass on ----------------------------------


class JaxBug(NamedTuple):
  """A bug of some JAX releases that computes a step wrong, silently.

  Attributes:
    what: what comes out wrong, and where.
    affected: the releases checked and found wrong.
    fixed: the first release checked and found right, as a version tuple of
      jaxlib (XLA), which each jax release pins.
    detected: how :func:`refuse_jax_bugs` sees that a step would meet it.
    test: the test that holds the entry on every version CI covers (the
      error where the bug is, exactness against the full batch where not).
  """

  what: str
  affected: tuple[str, ...]
  fixed: tuple[int, ...]
  detected: str
  test: str

  def present(self, version: tuple[int, ...] | None = None) -> bool:
    """Whether the installed jaxlib (or ``version``) has the bug.

    >>> GROUPED_CONV_KERNEL.present((0, 10, 2)), GROUPED_CONV_KERNEL.present((0, 12, 1))
    (True, False)
    """
    return (version or jaxlib.version.__version_info__) < self.fixed


GROUPED_CONV_KERNEL = JaxBug(
  what="a grouped or depthwise convolution's kernel gradient "
  "(feature_group_count > 1) is multiplied by the size of the mesh axes the "
  "batch is not sharded over, silently (x2 on a (4, 2) mesh with the batch "
  "on the first axis; plain jax.grad too: XLA's SPMD partitioner)",
  affected=("0.10.2", "0.11.0", "0.12.0", "0.12.0.1"),
  fixed=(0, 12, 1),
  detected="the gradient's jaxpr holds a convolution with batch_group_count "
  "> 1, JAX's form of a feature-grouped convolution's kernel gradient, on a "
  "mesh with an axis of size > 1 that the batch is not sharded over (with "
  "the batch on Auto axes, whose sharding a traced step cannot read, any "
  "two axes of size > 1)",
  test="tests/test_compat.py::test_a_grouped_convolutions_kernel_gradient_on_a_mesh",
)

#: Every bug that :func:`refuse_jax_bugs` refuses, newest last.
JAX_BUGS: tuple[JaxBug, ...] = (GROUPED_CONV_KERNEL,)


def refuse_jax_bugs(
  fun: Callable[..., Any],
  options: Any,
  args: tuple[Any, ...],
  kwargs: dict[str, Any],
  *,
  data_axes: tuple[str, ...],
  mesh: Any = None,
) -> None:
  """Raises a ``ValueError`` where this JAX would compute the gradient of
  ``fun(*args, **kwargs)`` wrong (:data:`JAX_BUGS`), naming the release that
  fixed it; returns at once on a release without the bug.

  Args:
    fun: the loss; ``options.argnums`` are differentiated and
      ``options.batch_argnums`` are the batch.
    args, kwargs: its arguments (traced or not).
    data_axes: the mesh axes the batch is known to be sharded over; ``()``
      for a batch on Auto axes, where a traced step cannot see it.
    mesh: the mesh; by default the batch's (None: on one device).
  """
  bug = GROUPED_CONV_KERNEL
  if not bug.present():
    return
  if mesh is None:
    mesh = _batch_mesh(tuple(args[n] for n in options.batch_argnums))
  others = _axes_besides(mesh, data_axes) if mesh is not None else ()
  if not others or not _kernel_gradient_of_grouped_conv(fun, options, args, kwargs):
    return
  fixed = ".".join(map(str, bug.fixed))
  unseen = "" if data_axes else ", the batch's axes unseen on Auto axes"
  raise ValueError(
    f"jax {jax.__version__}: {bug.what}. Here "
    f"{', '.join(f'{a}={mesh.shape[a]}' for a in others)}{unseen}. Upgrade to "
    f"jax>={fixed}, where it is right; on this jax, mesh=, data_axis= on an "
    "Auto mesh (view='device') computes it right."
  )


def _batch_mesh(batch: Any) -> Any:
  """The mesh of the batch's first leaf placed on one (None on one device)."""
  for x in jax.tree.leaves(batch):
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    if mesh is not None and not mesh.empty and mesh.size > 1:
      return mesh
  return None


def _axes_besides(mesh: Any, data_axes: tuple[str, ...]) -> tuple[str, ...]:
  """The mesh axes of size > 1 that the batch is not sharded over, when it
  is sharded over some: given ``data_axes``, the others; with none given on
  a mesh without Explicit axes (Auto: not visible), all of them if two or
  more (the batch may be on some of them)."""
  sized = tuple(a for a, n in mesh.shape.items() if n > 1)
  if data_axes:
    return tuple(a for a in sized if a not in data_axes)
  if jax.sharding.AxisType.Explicit in mesh.axis_types or len(sized) < 2:
    return ()  # on Explicit axes the batch is known replicated: right
  return sized


def _kernel_gradient_of_grouped_conv(
  fun: Callable[..., Any], options: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> bool:
  """Whether the gradient of ``fun``'s floating-point outputs with respect to
  ``options.argnums`` takes a feature-grouped convolution's kernel gradient
  (a convolution with ``batch_group_count > 1`` in its jaxpr, at any
  depth). Only traced, never run."""
  argnums = tuple(options.argnums)

  def total(*diff: Any) -> jax.Array:
    full = list(args)
    for n, d in zip(argnums, diff, strict=True):
      full[n] = d
    outs = jax.tree.leaves(fun(*full, **kwargs))
    floats = [
      jnp.sum(x)
      for x in outs
      if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    return sum(floats, jnp.float32(0.0))

  diff = tuple(args[n] for n in argnums)
  gradient = jax.make_jaxpr(jax.grad(total, argnums=tuple(range(len(argnums)))))
  try:  # a fun that takes one example (clip_per_example), not the batch
    jaxpr = gradient(*diff).jaxpr
  except Exception:  # not traceable so: the step says why
    return False
  return _has_kernel_gradient(jaxpr)


def _has_kernel_gradient(jaxpr: Any) -> bool:
  """A convolution with ``batch_group_count > 1`` in ``jaxpr`` or any jaxpr
  in its equations' parameters (``jit``, ``scan``, ``cond``, ``remat``,
  custom derivatives)."""
  for eqn in jaxpr.eqns:
    if (
      eqn.primitive.name == "conv_general_dilated"
      and eqn.params["batch_group_count"] > 1
    ):
      return True
    for value in eqn.params.values():
      for item in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(item, "jaxpr", item)
        if hasattr(inner, "eqns") and _has_kernel_gradient(inner):
          return True
  return False
