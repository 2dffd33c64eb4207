"""The data-parallel path: local accumulation, ONE gradient reduction per step.

Accumulating under plain ``jit`` over a sharded batch leaves the reduction to
the partitioner, which places an all-reduce of the gradients inside the loop
body: ``k`` reductions per step. Here the step keeps one gradient per device
instead, in global view:

1. The batch, sharded over the data axes, is laid out as ``(D, k, m / D,
   ...)``: one block per device, so micro-batch ``i`` is the ``i``-th slice
   of every device's shard and no data moves (``_split``).
2. The micro step runs ``vmap``-ped over the blocks, with
   ``spmd_axis_name`` set to the data axes: every device computes the
   gradient of its own rows, ``(D, *shape)``, and nothing is summed over
   devices inside the loop. ``fun`` sees one device's micro-batch and the
   mesh as under plain ``jit``: its sharding annotations on the other axes
   (a tensor-parallel ``"model"``), flax's layers, concrete-mesh constraints
   all work as they do there.
3. After the loop, one reduction: the sum over devices, constrained to each
   parameter's sharding (a reduce-scatter for a parameter sharded over data
   axes, FSDP; an all-reduce otherwise).

FSDP leaves (parameters sharded over data axes) have two modes
(``fsdp_gather``):

- ``"per_micro_batch"`` (default): the forward uses the weight gathered
  where it is needed, as the full-batch step does, and each micro-batch's
  gradient is reduce-scattered over the FSDP axes into a float32 accumulator
  sharded like the parameter, ``P / D`` per device. Data axes the leaf is
  replicated over (HSDP's replica axes) are reduced once, after the loop.
- ``"once"``: the weight is gathered before the loop and the full gradient
  accumulated per device; one reduce-scatter after the loop, no collective
  inside it. Choose it when communication, not memory, is the limit.

The micro-batch index folded into the key is global: micro-batch ``i`` of
device ``d`` is ``d * k + i``, ``d`` counting the data axes' devices in the
order the batch is sharded. With ``D`` devices and ``k`` micro-batches per
device, the result therefore equals the single-device result with ``D * k``
micro-batches, keys included.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxaccum import _compat, _engine, _normalize, _sharding, _tree
from jaxaccum._engine import Engine
from jaxaccum._options import Options

PyTree = Any
Layout = tuple["_sharding.SplitSpec | None", ...]


class HiddenShardingWarning(UserWarning):
  """The parameters' shardings are not visible to ``mesh=`` (under ``jit`` on
  Auto axes, without ``param_specs``), and they are treated as replicated."""


class DataParallel:
  """Runs an :class:`Engine` data-parallel over the mesh's data axes."""

  def __init__(self, options: Options):
    assert options.mesh is not None and options.data_axes is not None
    self.options = options
    self.mesh = options.mesh
    self.axes = options.data_axes
    self.devices = options.data_devices
    self.sizes = tuple(self.mesh.shape[a] for a in self.axes)
    types = dict(zip(self.mesh.axis_names, self.mesh.axis_types, strict=True))
    self.explicit = any(types[a] == AxisType.Explicit for a in self.mesh.axis_names)

  # -- what a compiled step is for ------------------------------------------

  def layout(self, o: Options, args: tuple[Any, ...]) -> Layout:
    """Per leaf of the differentiated arguments, its split spec if known.

    From ``param_specs`` if given, else from the arrays: their sharding
    outside ``jit``, their type on Explicit axes inside it. Unknown (None)
    means replicated along the data axes. ``o`` are the options with their
    positions resolved for ``args``.
    """
    specs: list[Any] = []
    given = o.param_specs
    if given is not None and len(o.argnums) == 1:
      given = (given,)
    for j, n in enumerate(o.argnums):
      arg = args[n]
      if given is not None:
        leaf_specs = _broadcast_specs(given[j], arg, o.names(n))
      else:
        leaf_specs = [_known_spec(x) for x in jax.tree.leaves(arg)]
      for (path, x), spec in zip(
        jax.tree_util.tree_leaves_with_path(arg), leaf_specs, strict=True
      ):
        what = f"The parameter {o.names(n)}{jax.tree_util.keystr(path)}"
        specs.append(
          None
          if spec is None
          else _sharding.split_spec(spec, jnp.ndim(x), self.axes, what)
        )
    return tuple(specs)

  def _warn_if_hidden(self, o: Options, layout: Layout, args: tuple[Any, ...]) -> None:
    """Warns, once per traced step, where the parameters' shardings are not
    visible (under ``jit`` on Auto axes, without ``param_specs``) and they
    may well be sharded over the data axes: the mesh has devices beyond the
    data axes, or a parameter is large. Silent where the user cannot do
    better: small parameters on a mesh of data axes only."""
    unknown = [
      (path, x)
      for n in o.argnums
      for path, x in jax.tree_util.tree_leaves_with_path(args[n])
    ]
    unknown = [pair for pair, s in zip(unknown, layout, strict=True) if s is None]
    if not unknown:
      return
    large = [
      (path, x) for path, x in unknown if jnp.size(x) * jnp.dtype(x).itemsize >= 2**20
    ]
    if self.mesh.size == self.devices and not large:
      return
    path, _ = (large or unknown)[0]
    name = f"{o.names(o.argnums[0])}{jax.tree_util.keystr(path)}"
    more = f" and {len(unknown) - 1} more leaves" if len(unknown) > 1 else ""
    warnings.warn(
      f"jaxaccum: under jit on a mesh with Auto axes the parameters' shardings "
      f"are not visible, so {name}{more} count as replicated over the data "
      f"axes {self.axes}: a parameter sharded over them (FSDP) is gathered "
      "whole and its gradient comes back replicated. Pass "
      "param_specs=jax.tree.map(lambda x: x.sharding.spec, params), computed "
      "outside jit (or a tree prefix of PartitionSpecs), or use a mesh with "
      "Explicit axes (jax.make_mesh(..., axis_types=(AxisType.Explicit,) * n)). "
      "If they are replicated, param_specs=jax.sharding.PartitionSpec() says so "
      "and silences this.",
      HiddenShardingWarning,
      stacklevel=2,
    )

  # -- the traced step --------------------------------------------------------

  def __call__(
    self, engine: Engine, layout: Layout, args: tuple[Any, ...], kwargs: dict[str, Any]
  ) -> _engine.Result:
    """The step, traced: plan, gather, loop, reduce, normalize."""
    with _mesh_context(self.mesh):
      o = engine.options
      engine.check_args(args)
      self._warn_if_hidden(o, layout, args)
      split = engine.plan(args, devices=self.devices)
      _engine.check_noise_estimable(o, self.devices * split.num_micro_batches)
      diff_args = tuple(args[n] for n in o.argnums)
      call_args, kwargs = self._whole_on_every_device(o, args, kwargs)
      for n, d in zip(o.argnums, self._gather_once(diff_args, layout), strict=True):
        call_args[n] = d
      state_in = None if o.state_argnum is None else args[o.state_argnum]
      sums = engine.sums(
        tuple(call_args),
        kwargs,
        split,
        step=self._per_device_step(engine, tuple(call_args), kwargs, split, layout),
        accumulator=self._accumulator(o, layout),
        state=None if state_in is None else self._device_states(state_in),
        per_block=True,
      )
      sums = self._reduce(sums, layout, state_in)
      result = engine.finish(sums, diff_args)
      return result._replace(
        grads=_map_leaves(self._like_parameter, result.grads, layout)
      )

  def _whole_on_every_device(
    self, o: Options, args: tuple[Any, ...], kwargs: dict[str, Any]
  ) -> tuple[list[Any], dict[str, Any]]:
    """On Explicit axes, the batch sharded over the data axes, and the arrays
    that reach every micro-batch whole (those outside the batch, the
    parameters and the state) resharded off them: a ``vmap`` over the data
    axes wants its mapped axis sharded along them, and refuses an unmapped
    value sharded along them."""
    if not self.explicit:
      return list(args), kwargs
    keep = set(o.argnums) | {o.state_argnum}
    off = lambda tree: jax.tree.map(self._off_data_axes, tree)  # noqa: E731
    call_args = [
      self._on_data_axes(a) if n in o.batch_argnums else (a if n in keep else off(a))
      for n, a in enumerate(args)
    ]
    return call_args, off(kwargs)

  def _on_data_axes(self, batch: PyTree) -> PyTree:
    """Batch leaves with their leading axis sharded over the data axes, the
    other axes as they are."""

    def on(x):
      split = _sharding.split_spec(_compat.visible_spec(x), jnp.ndim(x), self.axes)
      if split.data[0] == self.axes:
        return x
      return self._constrain(x, P(_entry(self.axes), *tuple(split.other_spec())[1:]))

    return jax.tree.map(on, batch)

  def _off_data_axes(self, x: Any) -> Any:
    """``x`` with the data axes removed from its sharding (Explicit axes)."""
    spec = _compat.explicit_spec(x) if isinstance(x, jax.Array) else None
    if spec is None:
      return x
    split = _sharding.split_spec(spec, jnp.ndim(x), self.axes)
    return x if not split.sharded_dims() else self._constrain(x, split.other_spec())

  def _gather_once(self, diff_args: tuple[PyTree, ...], splits: Any) -> Any:
    """With ``fsdp_gather="once"``, FSDP leaves gathered over their data axes
    before the loop (the other axes keep their sharding)."""
    if self.options.fsdp_gather != "once":
      return diff_args
    return _map_leaves(
      lambda x, s: self._constrain(x, s.other_spec()) if _fsdp(s) else x,
      diff_args,
      splits,
    )

  def _per_device_step(
    self,
    engine: Engine,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    split: Any,
    layout: Layout,
  ) -> Callable[..., Any]:
    """The engine's micro step, ``vmap``-ped over the devices' blocks: device
    ``d``'s micro-batch ``i`` gets the key of global micro-batch ``d*k + i``.
    On Explicit axes the FSDP leaves enter it gathered, as a ``vmap`` over
    the data axes refuses an unmapped value sharded along them (on Auto axes
    the partitioner gathers them where they are used)."""
    k = split.num_micro_batches
    base = engine.micro_step(args, kwargs, split, self.devices * k)
    has_state = engine.options.state_argnum is not None
    vmapped = jax.vmap(
      _explained(base, self.axes),
      in_axes=(None, 0, 0, 0 if has_state else None),
      spmd_axis_name=self.axes,
    )
    offsets = self._constrain(
      jnp.arange(self.devices, dtype=jnp.int32) * k, P(_entry(self.axes))
    )

    def step(diff_args, micro, index, state):
      diff_args = self._gathered_per_micro_batch(diff_args, layout, index)
      return vmapped(diff_args, micro, offsets + index, state)

    return step

  def _gathered_per_micro_batch(
    self, diff_args: Any, layout: Layout, index: jax.Array
  ) -> Any:
    """FSDP leaves as each micro-batch's forward takes them.

    In ``"per_micro_batch"`` mode they pass an optimization barrier with the
    micro-batch index first: otherwise XLA sees a loop-invariant gather and
    hoists it out of the loop, holding every full weight through it (1.6x
    the full batch's peak on a parameter-dominated model). On Explicit axes
    they are then gathered (a ``vmap`` over the data axes refuses an
    unmapped value sharded along them); on Auto axes the partitioner gathers
    each where it is used, as in the full-batch step.
    """
    if not any(map(_fsdp, layout)):
      return diff_args
    if self.options.fsdp_gather == "per_micro_batch":
      leaves, treedef = jax.tree.flatten(diff_args)
      fsdp = [x for x, s in zip(leaves, layout, strict=True) if _fsdp(s)]
      fsdp, _ = jax.lax.optimization_barrier((fsdp, index))
      it = iter(fsdp)
      leaves = [
        next(it) if _fsdp(s) else x for x, s in zip(leaves, layout, strict=True)
      ]
      diff_args = jax.tree.unflatten(treedef, leaves)
    if self.explicit:
      diff_args = _map_leaves(
        lambda x, s: self._constrain(x, s.other_spec()) if _fsdp(s) else x,
        diff_args,
        layout,
      )
    return diff_args

  def _accumulator(self, options: Options, splits: Any) -> _engine.Accumulator:
    """Per leaf: a gradient per device, ``(D, *shape)``; or, for an FSDP
    leaf in ``"per_micro_batch"`` mode, each micro-batch's gradient summed
    over its FSDP axes (a reduce-scatter) into an accumulator sharded like
    the parameter, one entry per device of the other data axes."""
    reduced = self._scattered_in_loop

    def layout(x, s):
      """The accumulator's leading size and its spec."""
      kept = self._kept_axes(s) if reduced(s) else self.axes
      groups = math.prod(self.mesh.shape[a] for a in kept)
      if s is None:
        inner: tuple[Any, ...] = (P.UNCONSTRAINED,) * jnp.ndim(x)
      else:
        inner = tuple(s.full_spec() if reduced(s) else s.other_spec())
      return groups, P(_entry(kept), *inner)

    def dtype(x):
      return _normalize.accumulator_dtype(options.accum_dtype, x)

    def zeros(x, s):
      groups, spec = layout(x, s)
      return self._constrain(jnp.zeros((groups, *jnp.shape(x)), dtype(x)), spec)

    def fold(g, s):
      """One micro-batch's ``(D, *shape)`` gradient, as its accumulator holds it."""
      g = g.astype(dtype(g))
      return self._reduce_scatter(g, s) if reduced(s) else g

    return _engine.Accumulator(
      init=lambda diff: _map_leaves(zeros, diff, splits),
      first=lambda grads: _map_leaves(fold, grads, splits),
      add=lambda acc, grads: jax.tree.map(
        jnp.add, acc, _map_leaves(fold, grads, splits)
      ),
    )

  def _reduce_scatter(self, g: jax.Array, s: _sharding.SplitSpec) -> jax.Array:
    """``(D, *shape)`` per-device gradients summed over the leaf's FSDP axes
    and scattered to its sharding: ``(R, *shape)``, ``R`` the devices of the
    other data axes. A reduce-scatter, written as one (in a ``shard_map``
    over the data axes and the leaf's other axes) rather than left to the
    partitioner, which may all-reduce and slice."""
    kept = self._kept_axes(s)
    others = {n for names in s.other for n in names}
    in_spec = P(_entry(self.axes), *s.other_spec())
    out_spec = P(_entry(kept), *s.full_spec())

    def scatter(local):
      x = local[0]
      for dim, names in s.sharded_dims():
        over = tuple(n for n in names if self.mesh.shape[n] > 1)
        if over:
          x = jax.lax.psum_scatter(x, over, scatter_dimension=dim, tiled=True)
      return x[None]

    mapped = jax.shard_map(
      scatter,
      mesh=self.mesh,
      in_specs=in_spec,
      out_specs=out_spec,
      axis_names=set(self.axes) | others,
    )
    return mapped(g)

  def _scattered_in_loop(self, s: _sharding.SplitSpec | None) -> bool:
    """Whether a leaf's gradient is reduce-scattered in the loop: an FSDP
    leaf in ``"per_micro_batch"`` mode."""
    return self.options.fsdp_gather == "per_micro_batch" and _fsdp(s)

  def _kept_axes(self, s: _sharding.SplitSpec) -> tuple[str, ...]:
    """The data axes a leaf is replicated over (HSDP's replica axes)."""
    return tuple(a for a in self.axes if a not in s.data_axes_used())

  def _device_states(self, state: PyTree) -> PyTree:
    """Each device's copy of the state, ``(D, ...)``, with the device index
    folded into any typed PRNG key in it (e.g. an nnx RNG stream), so that
    devices draw different dropout masks."""
    devices = jnp.arange(self.devices, dtype=jnp.int32)

    def per_device(x):
      if _tree.is_key(x):
        copies = jax.vmap(lambda d: _tree.fold_in(x, d))(devices)
      else:
        copies = jnp.broadcast_to(jnp.asarray(x), (self.devices, *jnp.shape(x)))
      other = _sharding.split_spec(_compat.visible_spec(x), jnp.ndim(x), self.axes)
      return self._constrain(copies, P(_entry(self.axes), *other.other_spec()))

    return jax.tree.map(per_device, state)

  def _reduce(self, sums: _engine.Sums, splits: Any, state_in: PyTree) -> _engine.Sums:
    """The one reduction over devices, after the loop: the gradients summed
    into each parameter's sharding; the aux and its weights in device-major order; the
    devices' states made one."""
    grads = _map_leaves(self._sum_over_devices, sums.grads, splits)
    return sums._replace(
      grads=grads,
      aux=jax.tree.map(_device_major, sums.aux),
      weights=_device_major(sums.weights),
      state=None if state_in is None else _reduce_state(sums.state, state_in),
    )

  def _sum_over_devices(
    self, acc: jax.Array, s: _sharding.SplitSpec | None
  ) -> jax.Array:
    """An accumulator summed over its leading axis (devices), into the
    parameter's sharding: reduce-scattered over the leaf's FSDP axes where
    that was not done in the loop, all-reduced over the rest."""
    if s is not None and _fsdp(s) and not self._scattered_in_loop(s):
      acc = self._reduce_scatter(acc, s)
    return self._like_parameter(jnp.sum(acc, axis=0), s)

  def _like_parameter(self, g: jax.Array, s: _sharding.SplitSpec | None) -> jax.Array:
    """``g`` sharded like its parameter, where that is known."""
    return g if s is None else self._constrain(g, s.full_spec())

  def _constrain(self, x: jax.Array, spec: P) -> jax.Array:
    """``x`` laid out as ``spec`` on the mesh: a reshard on Explicit axes, a
    sharding constraint on Auto ones."""
    if self.explicit:
      return jax.sharding.reshard(
        x, NamedSharding(self.mesh, _explicit_only(spec, self.mesh))
      )
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))


def mesh_context(mesh: jax.sharding.Mesh | None) -> Any:
  """``jax.set_mesh(mesh)`` unless a mesh is set already (or ``mesh`` is
  None): where jaxaccum compiles a step with ``mesh=`` itself (an eager call,
  the planner), it runs in that mesh, as the user's ``jit`` would."""
  if mesh is None or not jax.sharding.get_mesh().empty:
    return contextlib.nullcontext()
  return jax.set_mesh(mesh)


def _mesh_context(mesh: jax.sharding.Mesh) -> Any:
  """The mesh as the context in which ``fun`` is traced, as under plain
  ``jit`` in ``jax.set_mesh`` (annotations name axes by a bare
  ``PartitionSpec``); the caller's own mesh context if it has one."""
  if not jax.sharding.get_abstract_mesh().empty:
    return contextlib.nullcontext()
  return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def _explicit_only(spec: P, mesh: jax.sharding.Mesh) -> P:
  """``spec`` without the axes that are not Explicit (a reshard names only
  those)."""
  types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))

  def keep(entry):
    if entry is None or entry is P.UNCONSTRAINED:
      return None
    names = entry if isinstance(entry, tuple) else (entry,)
    return _entry(tuple(n for n in names if types.get(n) == AxisType.Explicit))

  return P(*(keep(e) for e in spec))


def _entry(names: tuple[str, ...]) -> Any:
  if not names:
    return None
  return names[0] if len(names) == 1 else names


def _known_spec(x: Any) -> P | None:
  """``x``'s ``PartitionSpec`` where it can be known: its type or sharding;
  ``P()`` for a concrete array not sharded over a mesh; None for a value
  traced on Auto axes, whose sharding is hidden."""
  spec = _compat.visible_spec(x)
  if spec is None and not _compat.is_tracer(x):
    return P()
  return spec


def _fsdp(s: _sharding.SplitSpec | None) -> bool:
  """Whether a leaf is sharded over data axes (FSDP)."""
  return s is not None and bool(s.sharded_dims())


def _map_leaves(fun: Callable[..., Any], tree: PyTree, layout: Layout) -> PyTree:
  """``fun(leaf, split)`` over the leaves of ``tree`` and their split specs,
  one per leaf in order (None where unknown)."""
  leaves, treedef = jax.tree.flatten(tree)
  return jax.tree.unflatten(
    treedef, [fun(x, s) for x, s in zip(leaves, layout, strict=True)]
  )


def _device_major(x: jax.Array) -> jax.Array:
  """``(k, D, ...)`` per micro-batch and device to ``(D * k, ...)``: device
  ``d``'s micro-batches ``d*k .. d*k+k-1`` in global order."""
  x = jnp.swapaxes(x, 0, 1)
  return x.reshape((x.shape[0] * x.shape[1], *x.shape[2:]))


def _reduce_state(state: PyTree, state_in: PyTree) -> PyTree:
  """Makes each device's final state, ``(D, ...)``, one state.

  Floating statistics (BatchNorm's running averages) are averaged over
  devices. Integer counters advance identically on every device; their
  maximum is taken. PRNG keys, which came in with the device index folded
  in, go out as they came in if ``fun`` left them alone (an nnx RNG stream
  advances its counter, not its key), and otherwise as device 0's new key.
  Only typed keys (``jax.random.key``) are keys here: a raw ``uint32`` key
  is an integer array, the same on every device.
  """

  def reduce(new, old):
    if _tree.is_key(new):
      return _final_key(new, old)
    if jnp.issubdtype(jnp.result_type(new), jnp.floating):
      return jnp.mean(new, axis=0).astype(new.dtype)
    return jnp.max(new, axis=0)

  return jax.tree.map(reduce, state, state_in)


def _final_key(new: jax.Array, old: jax.Array) -> jax.Array:
  """``old`` if device 0 left its key as it got it, else device 0's key."""
  data = jax.random.key_data(new)
  if _compat.explicit_spec(data) is not None:  # device 0's entry, replicated
    data = jax.sharding.reshard(data, P())
  new_zero = jax.random.wrap_key_data(data[0], impl=jax.random.key_impl(new))
  changed = jnp.any(
    jax.random.key_data(new_zero) != jax.random.key_data(_tree.fold_in(old, 0))
  )
  return _tree.select(changed, new_zero, old)


def _broadcast_specs(spec_tree: Any, arg: PyTree, name: str) -> list[P | None]:
  """One spec per leaf of ``arg`` from ``spec_tree``, a tree prefix of it."""
  is_spec = lambda s: isinstance(s, P) or s is None  # noqa: E731
  specs: list[P | None] = []
  try:
    jax.tree.map(
      lambda s, sub: specs.extend([s] * len(jax.tree.leaves(sub))),
      spec_tree,
      arg,
      is_leaf=is_spec,
    )
  except ValueError as error:
    raise ValueError(
      f"param_specs does not match the structure of {name}: it must be a tree "
      "prefix of the differentiated argument, a PartitionSpec (or None) where "
      f"a subtree shares one. {error}"
    ) from None
  return specs


def _explained(step: Callable[..., Any], axes: tuple[str, ...]) -> Callable[..., Any]:
  """``step``, with JAX's refusal of an annotation that names a data axis
  explained in jaxaccum's terms."""

  def explained(*args):
    try:
      return step(*args)
    except Exception as error:
      if not _compat.names_spmd_axis(error, axes):
        raise
      raise ValueError(
        f"fun names the data axes {axes} in a sharding annotation. Inside "
        "jaxaccum's mesh path fun runs on one device's micro-batch, one "
        f"entry of a vmap over the data axes, whose sharding jaxaccum sets. "
        "Drop the data axes from the annotation (P(None, 'model') for "
        "P('data', 'model')), or read the batch axis from the input's type, "
        "which works under plain jit and inside jaxaccum alike: "
        f"P(jax.typeof(x).sharding.spec[0], ...). JAX said: {error}"
      ) from error

  return explained
