"""The data-parallel path: local accumulation, ONE gradient reduction per step.

Accumulating under plain ``jit`` over a sharded batch leaves the reduction to
GSPMD, which places an all-reduce of the gradients inside the loop body: ``k``
reductions per step. Here the step runs inside ``jax.shard_map`` over the data
axis instead:

1. Each device splits its own shard of the batch (a free local reshape, so
   micro-batch ``i`` is the ``i``-th contiguous slice of every shard and no
   data moves).
2. The parameters are cast to *varying* along the data axis
   (``lax.pcast``), so autodiff treats them as per-device values and inserts
   no ``psum`` into the backward pass. Parameters sharded along the data axis
   (FSDP style) are all-gathered once, before the loop.
3. The ``lax.scan`` accumulates local gradient sums.
4. After the loop, one reduction: ``psum`` of the gradient sums, or
   ``psum_scatter`` for FSDP-sharded parameters so the grads come back sharded
   like them; ``psum`` of the loss and weight sums, so the weighted mode
   divides by the global token count; ``pmean`` of floating-point state.

The micro-batch index folded into the key is global: micro-batch ``i`` of
device ``d`` is ``d * k + i``. With ``D`` devices and ``k`` micro-batches per
device, the result therefore equals the single-device result with ``D * k``
micro-batches, keys included.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxaccum import _split, _stats

if TYPE_CHECKING:
  from jaxaccum._accumulate import _Engine

PyTree = Any


def varying_axes(x: Any) -> frozenset[str]:
  """The manual mesh axes that ``x`` varies over (empty outside shard_map)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)  # jax >= 0.9: the manual axis type
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()))


def _is_varying(x: Any, axis: str) -> bool:
  return axis in varying_axes(x)


def to_varying(tree: PyTree, axis: str) -> PyTree:
  """Casts every leaf to varying along ``axis`` (a no-op where it already is)."""
  return jax.tree.map(
    lambda x: x if _is_varying(x, axis) else jax.lax.pcast(x, axis, to="varying"),
    tree,
  )


def like_vma(x: jax.Array, like: Any) -> jax.Array:
  """``x`` cast to varying along every manual axis that ``like`` varies over.

  Outside ``shard_map`` nothing varies and ``x`` is returned as it is.
  """
  axes = tuple(sorted(varying_axes(like) - varying_axes(x)))
  return jax.lax.pcast(x, axes, to="varying") if axes else x


def _current_spec(x: Any) -> P | None:
  """The PartitionSpec that ``x`` is known to have, or None if unknown."""
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, NamedSharding) and not isinstance(x, jax.core.Tracer):
    return sharding.spec
  sharding = getattr(jax.typeof(x), "sharding", None)
  if isinstance(sharding, NamedSharding) and any(
    t == jax.sharding.AxisType.Explicit for t in sharding.mesh.axis_types
  ):
    return sharding.spec
  return None


def sharded_dim(spec: P | None, axis: str) -> int | None:
  """The dimension that ``spec`` shards along ``axis``, if any.

  >>> sharded_dim(P(None, "data"), "data"), sharded_dim(P("model"), "data")
  (1, None)
  """
  if spec is None:
    return None
  for dim, entry in enumerate(spec):
    names = entry if isinstance(entry, tuple) else (entry,)
    if axis in names:
      if len(names) > 1:
        raise ValueError(
          f"A parameter is sharded along {entry} in one dimension; jaxaccum "
          f"supports sharding along the data axis {axis!r} alone there."
        )
      return dim
  return None


def _data_spec(ndim: int, dim: int | None, axis: str) -> P:
  return P(*(axis if d == dim else None for d in range(ndim)))


class DataParallel:
  """Wraps an ``_Engine`` to run data-parallel over ``mesh[data_axis]``."""

  def __init__(
    self,
    engine: _Engine,
    mesh: jax.sharding.Mesh,
    data_axis: str,
    param_specs: PyTree | None,
  ):
    if not isinstance(data_axis, str):
      raise TypeError(f"data_axis must be a mesh axis name, got {data_axis!r}.")
    if data_axis not in mesh.axis_names:
      raise ValueError(
        f"{data_axis=} is not an axis of the mesh, whose axes are {mesh.axis_names}."
      )
    self.engine = engine
    self.mesh = mesh
    self.axis = data_axis
    self.num_devices = mesh.shape[data_axis]
    self.param_specs = param_specs
    self.explicit = (
      mesh.axis_types[mesh.axis_names.index(data_axis)]
      == jax.sharding.AxisType.Explicit
    )
    self._steps: dict[Any, Any] = {}

  def _diff_dims(self, diff_args: tuple[PyTree, ...]) -> tuple[PyTree, ...]:
    """Per parameter leaf: the dimension sharded along the data axis, or None."""
    if self.param_specs is not None:
      specs = self.param_specs
      if len(self.engine.argnums) == 1:
        specs = (specs,)
      return tuple(
        jax.tree.map(
          lambda _, s: sharded_dim(s, self.axis),
          arg,
          spec,
          is_leaf=lambda s: isinstance(s, P) or s is None,
        )
        if spec is not None
        else jax.tree.map(lambda _: None, arg)
        for arg, spec in zip(diff_args, specs, strict=True)
      )
    return jax.tree.map(lambda x: sharded_dim(_current_spec(x), self.axis), diff_args)

  def _check_global_batch(self, args: tuple[Any, ...]) -> None:
    batch = {f"args[{i}]": args[i] for i in self.engine.batch_argnums}
    size = _split.leading_batch_size(batch)
    if size % self.num_devices:
      raise ValueError(
        f"The global batch_size={size} is not divisible by the "
        f"{self.num_devices} devices of data axis {self.axis!r}."
      )
    local = size // self.num_devices
    _split.plan_split(
      local, self.engine.num_micro_batches, self.engine.micro_batch_size
    )

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    """Runs the step as one jitted program, compiled once per configuration.

    Under an outer ``jit`` it inlines. Called eagerly, the jitted step is
    cached on the parameter sharding and on the keyword arguments' structure
    and non-array values (static, as Python values are in ``fun``), so a loop
    compiles it once; arrays in keyword arguments are inputs.
    """
    self.engine.check_args(args)
    self._check_global_batch(args)
    dims = self._diff_dims(tuple(args[i] for i in self.engine.argnums))
    split, arrays = _split_kwargs(kwargs)
    flat_dims, dims_tree = jax.tree.flatten(dims, is_leaf=lambda x: x is None)
    key: Any = (dims_tree, tuple(flat_dims), split)
    try:
      step = self._steps.get(key)
    except TypeError:  # an unhashable keyword value: compile for this call
      key, step = None, None
    if step is None:
      step = jax.jit(functools.partial(self._step, dims, split))
      if key is not None:
        self._steps[key] = step
    return step(args, arrays)

  def _step(
    self,
    dims: tuple[PyTree, ...],
    split: _KwargsSplit,
    args: tuple[Any, ...],
    kwarg_arrays: list[Any],
  ) -> Any:
    """The ``shard_map`` of the local accumulation and its one reduction."""
    engine, axis = self.engine, self.axis
    diff_args = tuple(args[i] for i in engine.argnums)
    flat_dims = jax.tree.leaves(dims, is_leaf=lambda x: x is None)

    # in_specs: the batch along the data axis; parameters as they are sharded
    # (FSDP dims along the data axis, else replicated); everything else
    # replicated.
    specs: list[PyTree] = [jax.tree.map(lambda _: P(), a) for a in args]
    for i in engine.batch_argnums:
      specs[i] = jax.tree.map(lambda x: _data_spec(jnp.ndim(x), 0, axis), args[i])
    for i, arg_dims, arg in zip(engine.argnums, dims, diff_args, strict=True):
      specs[i] = jax.tree.map(
        lambda x, d: _data_spec(jnp.ndim(x), d, axis),
        arg,
        arg_dims,
        is_leaf=lambda x: x is None,
      )
    # Keyword arrays reach every device whole, as inputs (an Explicit mesh
    # allows no closing over them).
    kwarg_specs = [P()] * len(kwarg_arrays)
    if self.explicit:
      args, kwarg_arrays = jax.tree.map(
        lambda x, s: jax.sharding.reshard(x, NamedSharding(self.mesh, s)),
        (args, kwarg_arrays),
        (tuple(specs), kwarg_specs),
      )

    def local_step(local_args, local_kwarg_arrays):
      kwargs = split.merge(local_kwarg_arrays)
      micro = engine.plan(local_args)
      local_diff = tuple(local_args[i] for i in engine.argnums)
      full = jax.tree.map(
        lambda x, d: (
          x if d is None else jax.lax.all_gather(x, axis, axis=d, tiled=True)
        ),
        local_diff,
        dims,
        is_leaf=lambda x: x is None,
      )
      device = jax.lax.axis_index(axis)
      state_in = None
      if engine.state_argnum is not None:
        # Each device threads its own copy of the state, with the device index
        # folded into any PRNG key in it (e.g. an nnx RNG stream), so devices
        # draw different dropout masks.
        state_in = local_args[engine.state_argnum]
        call_args = list(local_args)
        call_args[engine.state_argnum] = to_varying(
          jax.tree.map(lambda x: _fold_key(x, device), state_in), axis
        )
        local_args = tuple(call_args)
      sums = engine.sums(
        local_args,
        kwargs,
        micro,
        diff_args=to_varying(full, axis),
        index_offset=device * micro.num_micro_batches,
      )
      grads = jax.tree.map(
        lambda g, d: (
          jax.lax.psum(g, axis)
          if d is None
          else jax.lax.psum_scatter(g, axis, scatter_dimension=d, tiled=True)
        ),
        sums.grads,
        dims,
      )
      sums = sums._replace(
        loss=jax.lax.psum(sums.loss, axis),
        weight=jax.lax.psum(sums.weight, axis),
        grads=grads,
        state=_reduce_state(sums.state, state_in, axis),
        noise=None if sums.noise is None else jax.lax.psum(sums.noise, axis),
      )

      def sq_norm(normalized):
        """The whole gradient's squared norm: sharded leaves summed over devices."""
        leaves = zip(jax.tree.leaves(normalized), flat_dims, strict=True)
        local: list[jax.Array] = []
        sharded: list[jax.Array] = []
        for g, d in leaves:
          (local if d is None else sharded).append(g)
        return _stats.sq_norm(local) + jax.lax.psum(_stats.sq_norm(sharded), axis)

      return engine.finish(sums, local_diff, sq_norm)

    out_specs = (
      self._value_aux_specs(),
      tuple(
        jax.tree.map(lambda x, d: _data_spec(jnp.ndim(x), d, axis), arg, arg_dims)
        for arg, arg_dims in zip(diff_args, dims, strict=True)
      ),
      P(),
    )
    return jax.shard_map(
      local_step,
      mesh=self.mesh,
      in_specs=(tuple(specs), kwarg_specs),
      out_specs=out_specs,
      axis_names={axis},
    )(args, kwarg_arrays)

  def _value_aux_specs(self) -> Any:
    """Value: replicated. Aux: device-major along its micro-batch axis.

    The stacked aux of device ``d`` holds its micro-batches ``d*k .. d*k+k-1``,
    so concatenating along the leading axis gives them in global order.
    """
    aux_spec: Any = P(self.axis)
    if self.engine.state_argnum is not None:
      aux_spec = (aux_spec, P())
    return (P(), aux_spec)


class _KwargsSplit(NamedTuple):
  """Keyword arguments without their arrays: what a compiled step is for.

  Attributes:
    treedef: the structure of the keyword arguments.
    is_array: per leaf, whether it is an array (an input of the step).
    static: per leaf, the leaf itself where it is not an array (a Python
      value that ``fun`` may branch on or use as a shape), else None.
  """

  treedef: Any
  is_array: tuple[bool, ...]
  static: tuple[Any, ...]

  def merge(self, arrays: Sequence[Any]) -> dict[str, Any]:
    """The keyword arguments, with ``arrays`` put back in their places."""
    it = iter(arrays)
    leaves = [
      next(it) if a else s for a, s in zip(self.is_array, self.static, strict=True)
    ]
    return jax.tree.unflatten(self.treedef, leaves)


def _split_kwargs(kwargs: dict[str, Any]) -> tuple[_KwargsSplit, list[Any]]:
  leaves, treedef = jax.tree.flatten(kwargs)
  is_array = tuple(isinstance(x, (jax.Array, np.ndarray, np.generic)) for x in leaves)
  static = tuple(None if a else x for x, a in zip(leaves, is_array, strict=True))
  arrays = [x for x, a in zip(leaves, is_array, strict=True) if a]
  return _KwargsSplit(treedef, is_array, static), arrays


def _reduce_state(state: PyTree, state_in: PyTree, axis: str) -> PyTree:
  """Makes each device's final state one replicated state.

  Every device threads its own state through its micro-batches. Floating
  statistics (BatchNorm's running averages) are averaged over devices.
  Integer counters advance identically on every device; their maximum is
  taken. PRNG keys, which came in with the device index folded in, go out as
  they came in if ``fun`` left them alone (an nnx RNG stream advances its
  counter, not its key), and otherwise as device 0's new key. Only typed keys
  (``jax.random.key``) are keys here: a raw ``uint32`` key is an integer
  array, the same on every device.
  """
  device = jax.lax.axis_index(axis)

  def reduce(new, old):
    if _is_key(new):
      return _final_key(new, old, device, axis)
    if jnp.issubdtype(jnp.result_type(new), jnp.floating):
      return jax.lax.pmean(new, axis)
    return jax.lax.pmax(new, axis)

  return jax.tree.map(reduce, state, state_in)


def _is_key(x: Any) -> bool:
  return jax.dtypes.issubdtype(jnp.result_type(x), jax.dtypes.prng_key)


def _fold_key(x: Any, device: jax.Array) -> Any:
  """``fold_in(x, device)`` for a key or an array of keys; ``x`` otherwise."""
  if not _is_key(x):
    return x
  fold = jax.random.fold_in
  for _ in range(jnp.ndim(x)):
    fold = jax.vmap(fold, in_axes=(0, None))
  return fold(x, device)


def _final_key(new: Any, old: Any, device: jax.Array, axis: str) -> Any:
  """``old`` if device 0 left its key as it got it, else device 0's key."""
  new_data = jax.random.key_data(new)
  got = jax.random.key_data(_fold_key(old, device))
  on_zero = device == 0
  changed = jax.lax.psum((on_zero & jnp.any(new_data != got)).astype(jnp.int32), axis)
  key_zero = jax.lax.psum(jnp.where(on_zero, new_data, 0), axis)
  data = jnp.where(changed > 0, key_zero, jax.random.key_data(old))
  return jax.random.wrap_key_data(data, impl=jax.random.key_impl(old))


def wrap(
  engine: _Engine,
  mesh: Any,
  data_axis: str | None,
  param_specs: PyTree | None,
) -> Callable[..., Any]:
  """The data-parallel ``f(*args)`` returning ``((value, aux), grads_tuple,
  noise)``, as ``_Engine.finish`` does."""
  if mesh is None:
    raise ValueError(f"{data_axis=} needs mesh=, the mesh that holds that axis.")
  if data_axis is None:
    raise ValueError("mesh= needs data_axis=, the name of the mesh's data axis.")
  return DataParallel(engine, mesh, data_axis, param_specs)
