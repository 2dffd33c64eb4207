"""The data-parallel path (``mesh=``): each device accumulates its own rows.

Which path runs when:

- **No** ``mesh=``, plain ``jit``: on Explicit axes that the batch's rows
  are sharded over, :mod:`jaxaccum._parallel.unreduced` (parameters ``reduced``,
  accumulators ``unreduced``, one reduction after the loop); otherwise the
  engine's own step, whose reductions the partitioner places.
- ``mesh=`` with ``view="global"``: on Explicit data axes that the batch is
  sharded over, the same :mod:`jaxaccum._parallel.unreduced` step (``mesh=`` only
  names the data axes); otherwise :class:`_GlobalStep`, the partitioner's.
- ``mesh=`` (``view="device"``, the default): this module's
  :class:`_Step`, below.

Accumulating under plain ``jit`` on Auto axes leaves every decision to the
partitioner: it all-reduces a replicated parameter's gradient inside the
loop, ``k`` times per step. Here the step is laid out over the data axes
instead, in global view:

1. **The batch** is laid out as ``(D, k, m / D, ...)``: one block per device,
   micro-batch ``i`` the ``i``-th slice of every device's shard, so no row
   moves (``_split``).
2. **The micro step** runs ``fun`` on one device's rows, ``vmap``-ped over the
   data axes with ``spmd_axis_name``, one ``vmap`` level per data axis:
   ``fun`` sees one device's micro-batch and the mesh as under plain ``jit``,
   with the user's axis types (annotations on the other axes, a
   tensor-parallel ``"model"``, and constraints on the concrete mesh valid
   for one device's rows work as there). Device ``d``'s micro-batch ``i``
   gets the key of global micro-batch ``d * k + i``; each device threads
   its own state.
3. **The gradient** is taken of the *sum* of the devices' losses. A leaf
   each device has its own copy of (a per-device input of the ``vmap``)
   gets its own gradient per device; a leaf shared by the devices of a data
   axis (FSDP: each device's block mapped, made whole inside by an
   ``all_gather`` over the ``vmap``'s axis that only reshapes, so it stays
   typed sharded; gathered before the loop by ``"cast_once"``, an unmapped
   input) gets the gradient summed over them, and the partitioner
   places that reduction, and each weight's gather, where plain ``jit`` would:
   inside the model's backward layer loop, a reduce-scatter per layer on a
   GPU or TPU. Each parameter leaf has a :class:`Placement` that says which
   it is. A leaf whose sharding is hidden (Auto axes under ``jit``, no
   ``param_specs``) is copied along the data axes and left to the
   partitioner along its own dimensions, never forced to replicated.
4. **After the loop**, one reduction: every per-device accumulator summed
   over its devices into the parameter's sharding.

The placements, chosen in one place (:meth:`DataParallel.placements`):

- **replicated** leaves (not sharded over a data axis): a copy per device,
  reduced once, after the loop;
- **FSDP** leaves (sharded over data axes), by ``fsdp_gather``:

  - ``"per_micro_batch"`` (default): shared along the axes they are sharded
    over, so that each micro-batch's gradient is reduce-scattered inside
    the backward pass into a float32 accumulator sharded like the
    parameter; an optimization barrier keeps each weight's gather inside
    the loop, where the full-batch step has it. HSDP's replica axes (the
    data axes a leaf is replicated over) get a copy per replica, reduced
    once, after the loop.
  - ``"cast_once"``: cast to ``gather_dtype`` and gathered once per step,
    before the loop; shared and reduce-scattered per micro-batch as above.
  - ``"once"``: gathered once, in its own dtype; a copy per device, the
    whole gradient accumulated on each and reduce-scattered once after the
    loop. No collective inside the loop.

The step keeps the user's axis types: no axis is re-typed. On Explicit axes
``fun`` sees a blocked (FSDP) leaf typed sharded over the data axes, as
under ``jax.value_and_grad`` on the same mesh, so it gathers such a weight
where it uses it (a ``reshard``), as it must there; on Auto axes the
partitioner places those gathers.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxaccum import _compat, _engine, _normalize, _tree
from jaxaccum._engine import Engine
from jaxaccum._options import Options
from jaxaccum._parallel import specs as _sharding
from jaxaccum._parallel import unreduced as _unreduced
from jaxaccum._privacy import ghost as _ghost

PyTree = Any
Layout = tuple["_sharding.SplitSpec | None", ...]


class HiddenShardingWarning(UserWarning):
  """The parameters' shardings are not visible to ``mesh=`` (under ``jit`` on
  Auto axes, without ``param_specs``), and they are treated as replicated."""


class Placement(NamedTuple):
  """How one differentiated leaf reaches the micro step.

  Attributes:
    spec: its split spec (None where unknown: treated as replicated).
    copies: the data axes along which each device gets its own copy, whose
      gradient stays per device until the one reduction after the loop. The
      leaf's other data axes (those it is sharded over) share it: its
      gradient is summed over them inside the backward pass.
    before_loop: ``"as_is"``, ``"gather"`` (gathered over its data axes
      once, before the loop) or ``"cast_gather"`` (cast to ``gather_dtype``
      first).
    barrier: passes an optimization barrier with the micro-batch index in
      each micro step, so that its gather is not hoisted out of the loop.
  """

  spec: _sharding.SplitSpec | None
  copies: tuple[str, ...]
  before_loop: str = "as_is"
  barrier: bool = False

  @property
  def shared(self) -> bool:
    """Whether some data axes share the leaf (its gradient is summed over
    them inside the backward pass)."""
    return _fsdp(self.spec) and self.before_loop != "gather"

  @property
  def blocked(self) -> bool:
    """Whether the leaf reaches the micro step sharded over the data axes
    it is shared along (not gathered before the loop)."""
    return self.shared and self.before_loop == "as_is"

  def mapped(self, axis: str) -> bool:
    """Whether the ``vmap`` over ``axis`` maps the leaf: along its copies,
    and along the axes a blocked leaf is sharded over."""
    return axis in self.copies or self.blocked


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
    self.explicit = any(types[a] == AxisType.Explicit for a in self.axes)

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
        if spec is not None:
          self._check_divides(what, jnp.shape(x), spec)
        specs.append(
          None
          if spec is None
          else _sharding.split_spec(spec, jnp.ndim(x), self.axes, what)
        )
    return tuple(specs)

  def _check_divides(self, what: str, shape: tuple[int, ...], spec: P) -> None:
    """Each dimension of a parameter divides among the devices its spec
    shards it over (JAX's own error, before the loss runs, names neither
    the parameter nor ``param_specs``)."""
    for dim, (size, entry) in enumerate(zip(shape, spec.partitions, strict=False)):
      devices = 1
      for name in _names(entry):
        devices *= self.mesh.shape[name]
      if size % devices:
        raise ValueError(
          f"{what} has shape {shape}, and its spec {spec} shards dimension "
          f"{dim} (size {size}) over {devices} devices ({entry!r}), which do "
          f"not divide it: choose a size that {devices} divides, or another "
          "spec (param_specs=)."
        )

  def placements(self, layout: Layout) -> tuple[Placement, ...]:
    """Each leaf's :class:`Placement`: the one place the strategy is chosen
    (see the module docstring)."""
    mode = self.options.fsdp_gather
    o = self.options
    if (
      o.clip_per_example is not None and o.clip_method == "vmap" and o.view == "device"
    ):
      # Each example's gradient is clipped by its norm over every leaf, so
      # each device computes whole gradients: FSDP leaves gathered once.
      # Ghost clipping needs no per-example gradient: its weighted backward
      # pass is shared like the non-private step's (_ghost_micro_step).
      mode = "once"
    placed = []
    for s in layout:
      if s is None or not _fsdp(s):
        placed.append(Placement(s, self.axes))
      elif mode == "once":
        placed.append(Placement(s, self.axes, before_loop="gather"))
      elif mode == "cast_once":
        placed.append(Placement(s, _kept_axes(s, self.axes), "cast_gather"))
      else:
        placed.append(Placement(s, _kept_axes(s, self.axes), barrier=True))
    return tuple(placed)

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
      f"are not visible, so {name}{more} count as not sharded over the data "
      f"axes {self.axes}: a parameter sharded over them (FSDP) is gathered "
      "whole on every device (its sharding along other axes is left to the "
      "partitioner). Pass "
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
    """The step, traced: plan, place, loop, reduce, normalize."""
    with _mesh_context(self.mesh):
      o = engine.options
      engine.check_args(args)
      self._warn_if_hidden(o, layout, args)
      placements = self.placements(layout)
      if o.view == "global":
        return self._global(engine, placements, args, kwargs)
      split = engine.plan(args, devices=self.devices)
      step = _Step(self, engine, placements, split)
      total = split.num_micro_batches * (1 if step.shared else self.devices)
      _engine.check_noise_estimable(o, total)
      return step(args, kwargs)

  def _global(
    self,
    engine: Engine,
    placements: tuple[Placement, ...],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
  ) -> _engine.Result:
    """``view="global"``: on Explicit data axes that the batch's rows are
    sharded over, plain ``jit``'s step on JAX's types (:mod:`_unreduced`),
    for which ``mesh=`` only names the data axes; else :class:`_GlobalStep`."""
    o = engine.options
    _compat.refuse_jax_bugs(
      engine.fun, o, args, kwargs, data_axes=self.axes, mesh=self.mesh
    )
    if self.explicit and set(_unreduced.data_axes(o, args)) == set(self.axes):
      split = engine.plan(args)
      if _unreduced.applies(o, split.num_micro_batches):
        return _unreduced.run_or_fall_back(
          engine,
          self.axes,
          args,
          kwargs,
          split,
          fallback=_GlobalStep(self, engine, placements),
        )
    return _GlobalStep(self, engine, placements)(args, kwargs)

  def constrain(self, x: jax.Array, spec: P) -> jax.Array:
    """``x`` laid out as ``spec`` on the mesh of the context: a reshard
    along its Explicit axes (a mesh may mix the two), a sharding constraint
    along the others."""
    context = jax.sharding.get_abstract_mesh()
    explicit = {
      n
      for n, t in zip(context.axis_names, context.axis_types, strict=True)
      if t == AxisType.Explicit
    }
    entries = [*spec, *(None,) * (jnp.ndim(x) - len(spec))]
    if not explicit:
      return jax.lax.with_sharding_constraint(x, P(*entries))
    if all(e is P.UNCONSTRAINED for e in entries):
      return x
    now = [*(_compat.explicit_spec(x) or ()), *(None,) * jnp.ndim(x)]
    x = jax.sharding.reshard(
      x,
      P(
        *(
          now[d] if e is P.UNCONSTRAINED else _only(e, explicit)
          for d, e in enumerate(entries)
        )
      ),
    )
    rest = [
      P.UNCONSTRAINED
      if e is P.UNCONSTRAINED or _only(e, explicit)
      else _without(e, explicit)
      for e in entries
    ]
    if all(e is None or e is P.UNCONSTRAINED for e in rest):
      return x
    return jax.lax.with_sharding_constraint(x, P(*rest))


class _Step:
  """One traced step of the default view, in the chapters of
  :meth:`__call__`: the leaves as the loop takes them, the micro step, the
  accumulators and the one reduction after the loop."""

  def __init__(
    self,
    parallel: DataParallel,
    engine: Engine,
    placements: tuple[Placement, ...],
    split: Any,
  ):
    self.parallel = parallel
    self.engine = engine
    self.options = engine.options
    self.placements = placements
    self.split = split
    self.shared = any(p.shared for p in placements)
    self.mesh = parallel.mesh
    self.axes = parallel.axes
    self.sizes = parallel.sizes
    self.devices = parallel.devices

  def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _engine.Result:
    o = self.options
    diff_args = tuple(args[n] for n in o.argnums)
    call_args = list(args)
    for n, placed in zip(o.argnums, self._before_loop(diff_args), strict=True):
      call_args[n] = placed
    state_in = None if o.state_argnum is None else args[o.state_argnum]
    sums = self.engine.sums(
      tuple(call_args),
      kwargs,
      self.split,
      step=self._micro_step(tuple(call_args), kwargs),
      accumulator=self._accumulator(),
      state=None if state_in is None else self._device_states(state_in),
      per_block=True,
    )
    sums = sums._replace(
      grads=self._map(self._after_loop, sums.grads),
      aux=jax.tree.map(_device_major, sums.aux),
      weights=_device_major(sums.weights),
      state=None if state_in is None else _reduce_state(sums.state, state_in),
    )
    return self.engine.finish(sums, diff_args)

  # -- chapter 1: the leaves as the loop takes them ---------------------------

  def _before_loop(self, diff_args: tuple[PyTree, ...]) -> tuple[PyTree, ...]:
    """Gathered (and cast) where the placement says so, then copied along
    the axes of their copies: ``(*copy sizes, *shape)``, one copy per
    device."""

    def place(x, p):
      if p.before_loop != "as_is" and p.spec is not None:
        if p.before_loop == "cast_gather":
          x = x.astype(self.options.gather_dtype)
        x = self.parallel.constrain(x, p.spec.other_spec())
      if not p.copies:
        return x
      sizes = tuple(self.mesh.shape[a] for a in p.copies)
      copies = jnp.broadcast_to(x, (*sizes, *jnp.shape(x)))
      return self.parallel.constrain(copies, P(*p.copies, *_inner_spec(p, jnp.ndim(x))))

    return self._map(place, diff_args)

  # -- chapter 2: the micro step ------------------------------------------------

  def _micro_step(
    self, args: tuple[Any, ...], kwargs: dict[str, Any]
  ) -> Callable[..., Any]:
    """``step(diff_args, micro, index, state)``: every device's micro-batch,
    the gradient of the sum of their losses (see the module docstring)."""
    o = self.options
    k = self.split.num_micro_batches
    offsets = self.parallel.constrain(
      (jnp.arange(self.devices, dtype=jnp.int32) * k).reshape(self.sizes),
      P(*self.axes),
    )
    rows = self.split.micro_batch_size // self.split.shards
    if o.clip_per_example is not None and o.clip_method == "ghost":
      return self._ghost_micro_step(args, kwargs, offsets)
    if o.clip_per_example is not None:
      return self._clipped_micro_step(args, kwargs, offsets, rows)
    loss = self._explained(
      self.engine.micro_loss(args, kwargs, self.split, self.devices * k), args
    )
    per_device = self._nested_vmap(loss, o.state_argnum is not None)

    def step(diff_args, micro, index, state):
      diff_args, micro, state = self._device_inputs(diff_args, micro, index, state)

      def total(diff_args):
        losses, (weights, aux, new_state) = per_device(
          diff_args, micro, offsets + index, state
        )
        return jnp.sum(losses), (losses, weights, aux, new_state)

      value, backward, out = jax.vjp(total, diff_args, has_aux=True)
      seed = jnp.ones_like(value)
      if k > 1:
        # In the loop, the backward pass starts after the loss is computed.
        # Left free, XLA's TPU scheduler put the loss's last step (a gather
        # of each label's float32 logit) beside the logits' cotangent, both
        # held at the peak (+2,000 MiB for a 1B Llama at k = 2), where the
        # hand-written scan's program happened to gather first. At k = 1
        # the step stays the full batch's program.
        out, seed = jax.lax.optimization_barrier((out, seed))
      (grads,) = backward(seed)
      losses, weights, aux, new_state = jax.tree.map(self._flatten_devices, out)
      noise = self._noise(grads, weights, rows) if o.noise_stats else None
      return _engine.MicroOut(losses, weights, aux, new_state, noise), grads

    return self.engine.rematerialized(step)

  def _device_inputs(
    self, diff_args: PyTree, micro: PyTree, index: jax.Array, state: PyTree
  ) -> tuple[PyTree, PyTree, PyTree]:
    """A micro step's inputs as the ``vmap`` over the devices takes them:
    the FSDP leaves through the barrier that keeps their gather in the loop,
    the micro-batch and the state with a leading axis per device."""
    diff_args = _unreduced.barrier(
      diff_args, [p.barrier for p in self.placements], index
    )
    micro = jax.tree.map(self._unflatten_devices, micro)
    if state is not None:
      state = jax.tree.map(self._unflatten_devices, state)
    return diff_args, micro, state

  def _clipped_micro_step(
    self,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    offsets: jax.Array,
    rows: int,
  ) -> Callable[..., Any]:
    """DP-SGD's micro step by ``clip_method="vmap"``: the engine's clipped
    step on every device, each device's clipped sum its own (every leaf a
    copy per device, see :meth:`DataParallel.placements`)."""
    base = self.engine.micro_step(
      args, kwargs, self.split, self.devices * self.split.num_micro_batches, rows
    )
    per_device = self._nested_vmap(
      self._explained(base, args), self.options.state_argnum is not None
    )

    def step(diff_args, micro, index, state):
      micro = jax.tree.map(self._unflatten_devices, micro)
      if state is not None:
        state = jax.tree.map(self._unflatten_devices, state)
      out, grads = per_device(diff_args, micro, offsets + index, state)
      return jax.tree.map(self._flatten_devices, out), grads

    return step

  def _ghost_micro_step(
    self, args: tuple[Any, ...], kwargs: dict[str, Any], offsets: jax.Array
  ) -> Callable[..., Any]:
    """Ghost clipping's micro step: each device takes its own examples'
    norms (from activations and cotangents, which need no whole gradient),
    then the gradient of the sum of the devices' weighted losses is taken as
    the non-private step's is: a leaf the devices share (FSDP,
    ``fsdp_gather="per_micro_batch"``) gets its clipped sums summed over
    them inside the backward pass, into an accumulator sharded like it."""
    o = self.options
    k = self.split.num_micro_batches
    loss = self._explained(
      self.engine.ghost_loss(args, kwargs, self.split, self.devices * k), args
    )
    per_device = self._nested_vmap(loss, o.state_argnum is not None)

    def step(diff_args, micro, index, state):
      diff_args, micro, state = self._device_inputs(diff_args, micro, index, state)

      def total(diff_args):
        objectives, rest = per_device(diff_args, micro, offsets + index, state)
        return jnp.sum(objectives), rest

      (_, (out, some)), grads = jax.value_and_grad(total, has_aux=True)(diff_args)
      losses, (weights, aux, new_state) = jax.tree.map(self._flatten_devices, out)
      grads = _ghost.kept_only(grads, jnp.any(some), o.accum_dtype)
      return _engine.MicroOut(losses, weights, aux, new_state, None), grads

    return self.engine.rematerialized(step)

  def _explained(
    self, step: Callable[..., Any], args: tuple[Any, ...]
  ) -> Callable[..., Any]:
    """``step``, with two of JAX's refusals explained in jaxaccum's terms:
    an annotation that names a data axis, and on Explicit axes a use of a
    leaf sharded over them (fun sees it typed, as under
    ``jax.value_and_grad`` on the mesh) that JAX's types refuse."""
    o = self.options
    paths = [
      f"{o.names(n)}{jax.tree_util.keystr(path)}"
      for n in o.argnums
      for path, _ in jax.tree_util.tree_leaves_with_path(args[n])
    ]
    blocked = [
      f"{name} (over {', '.join(sorted(p.spec.data_axes_used()))})"
      for name, p in zip(paths, self.placements, strict=True)
      if p.blocked and p.spec is not None
    ]
    if len(blocked) > 3:
      blocked = [*blocked[:3], f"{len(blocked) - 3} more"]

    def explained(*inputs):
      try:
        return step(*inputs)
      except _compat.SHARDING_TYPE_REFUSALS as error:
        if not (self.parallel.explicit and blocked):
          raise
        raise ValueError(
          f"JAX's sharding types refuse an operation in fun, which uses "
          f"parameters sharded over data axes (FSDP): {', '.join(blocked)}. "
          "On Explicit axes fun sees such a leaf typed as it is, as under "
          "jax.value_and_grad on the same mesh, where this code fails too "
          "if the refused operation uses one: gather the weight where it is "
          "used (jax.sharding.reshard(w, P(...)) without the data axes), or "
          "name the result's sharding (out_sharding=). On Auto axes "
          "(param_specs= says how they are sharded) the partitioner places "
          f"the gathers itself. JAX said: {error}"
        ) from error

    return _explained(explained, self.axes)

  def _nested_vmap(
    self, loss: Callable[..., Any], has_state: bool
  ) -> Callable[..., Any]:
    """``loss`` on every device: one ``vmap`` per data axis. Each leaf of
    the differentiated arguments enters with a leading dimension per data
    axis (:meth:`_blocks`): its copies, or for a shared (FSDP) leaf its
    blocks, which ``fun`` gets back whole by an ``all_gather`` over the
    ``vmap``'s axes. The gather only reshapes, typed sharded like the
    parameter, so the partitioner gathers each weight where it is used, as
    under plain ``jit``; its transpose is the reduce-scatter of the leaf's
    gradient over the devices that share it."""
    names = {a: f"jaxaccum:{a}" for a in self.axes}

    def whole(x, p):
      if not p.blocked:
        return x
      for dim, over in p.spec.sharded_dims():
        for a in reversed(over):  # the minor axis's blocks are adjacent
          x = jax.lax.all_gather(x, names[a], axis=dim, tiled=True)
      return x

    def on_device(diff_args, *rest):
      return loss(self._map(whole, diff_args), *rest)

    fun = on_device
    for axis in reversed(self.axes):
      diff_axes = [0 if p.mapped(axis) else None for p in self.placements]
      fun = _vmap_level(fun, axis, names[axis], diff_axes, has_state)
    return lambda diff_args, *rest: fun(self._map(self._blocks, diff_args), *rest)

  def _blocks(self, x: jax.Array, p: Placement) -> jax.Array:
    """A leaf as the ``vmap`` levels take it, one leading dimension per data
    axis in their order: its copies ``(*copy sizes, ...)`` as they are, and
    for a blocked leaf each dimension it is sharded over split into the
    devices' blocks, those moved to the front (no data moves)."""
    if not p.blocked:
      return x
    assert p.spec is not None
    c = len(p.copies)
    shape, entries = list(x.shape[:c]), list[Any](p.copies)
    inner = tuple(p.spec.full_spec())
    position = {a: i for i, a in enumerate(p.copies)}
    sharded = dict(p.spec.sharded_dims())
    for dim, size in enumerate(x.shape[c:]):
      over = sharded.get(dim, ())
      for a in over:
        position[a] = len(shape)
        shape.append(self.mesh.shape[a])
        entries.append(a)
      shape.append(size // math.prod(self.mesh.shape[a] for a in over))
      entries.append(None if over else inner[dim])
    if self.parallel.explicit:
      x = _reshaped(x, tuple(shape), _explicit_only(P(*entries), self.mesh))
    else:
      x = x.reshape(shape)
    order = [position[a] for a in self.axes]
    return jnp.transpose(x, (*order, *(d for d in range(len(shape)) if d not in order)))

  def _noise(
    self, grads: tuple[PyTree, ...], weights: jax.Array, rows: int
  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The noise terms of each device's micro-batch; with shared leaves,
    whose gradients are only ever summed over devices, those of the global
    micro-batch (the devices' gradients, divisors and examples summed)."""
    o = self.options
    if not self.shared:
      flat = jax.tree.leaves(self._map(self._flat_copies, grads))
      sq = jax.vmap(lambda *g: _tree.sq_norm(g))(*flat)
      return _engine.noise_terms(o, sq, weights, rows)
    summed = self._map(lambda g, p: jnp.sum(g, axis=tuple(range(len(p.copies)))), grads)
    _, divisors, examples = _engine.noise_terms(o, weights, weights, rows)
    ones = jnp.ones_like(weights)
    return (
      _tree.sq_norm(summed)[None],
      jnp.sum(divisors * ones)[None],
      jnp.sum(examples * ones)[None],
    )

  def _flat_copies(self, g: jax.Array, p: Placement) -> jax.Array:
    """A per-device gradient ``(*copy sizes, ...)`` as ``(D, ...)``."""
    return g.reshape(self.devices, *g.shape[len(p.copies) :])

  def _unflatten_devices(self, x: jax.Array) -> jax.Array:
    """``(D, ...)`` per device as ``(*data sizes, ...)``; on Explicit axes
    laid out over the data axes first (a batch that came replicated is
    sliced where it lies), so that every input the ``vmap`` maps is
    sharded alike."""
    shape = (*self.sizes, *x.shape[1:])
    if not self.parallel.explicit:
      return x.reshape(shape)
    x = self.parallel.constrain(
      x, P(_entry(self.axes), *(P.UNCONSTRAINED,) * (jnp.ndim(x) - 1))
    )
    rest = jax.typeof(x).sharding.spec.partitions[1:]
    return _reshaped(x, shape, P(*self.axes, *rest))

  def _flatten_devices(self, x: jax.Array) -> jax.Array:
    shape = (self.devices, *x.shape[len(self.sizes) :])
    spec = _compat.explicit_spec(x)
    if spec is None or not self.parallel.explicit:
      return x.reshape(shape)
    rest = spec.partitions[len(self.sizes) :]
    return _reshaped(x, shape, P(_entry(self.axes), *rest))

  # -- chapter 3: accumulate, then reduce once --------------------------------

  def _accumulator(self) -> _engine.Accumulator:
    """Per leaf, a float32 (or wider) accumulator shaped and sharded like
    the leaf in the loop: a copy per device along its copies' axes, and
    sharded like the parameter along the others."""
    dtype = self.options.accum_dtype

    def spec(x, p):
      return P(*p.copies, *_accumulator_spec(p, jnp.ndim(x) - len(p.copies)))

    def fold(g, p):
      like = _normalize.accumulator_dtype(dtype, g)
      return self.parallel.constrain(g.astype(like), spec(g, p))

    return _engine.Accumulator(
      init=lambda diff: self._map(lambda x, p: fold(jnp.zeros_like(x), p), diff),
      first=lambda grads: self._map(fold, grads),
      add=lambda acc, grads: self._map(
        lambda a, g, p: self.parallel.constrain(a + g.astype(a.dtype), spec(a, p)),
        acc,
        grads,
      ),
    )

  def _after_loop(self, acc: jax.Array, p: Placement) -> jax.Array:
    """The accumulator summed over its copies, into the parameter's sharding:
    an all-reduce, or for a leaf gathered once a reduce-scatter over the
    axes it is sharded over (written as one, rather than left to the
    partitioner, which may all-reduce and slice)."""
    copies = len(p.copies)
    if p.before_loop == "gather" and p.spec is not None:
      acc = self._reduce_scatter(acc, p.spec)
      copies = len(_kept_axes(p.spec, self.axes))
    if copies:
      acc = jnp.sum(acc, axis=tuple(range(copies)))
    return acc if p.spec is None else self.parallel.constrain(acc, p.spec.full_spec())

  def _reduce_scatter(self, acc: jax.Array, s: _sharding.SplitSpec) -> jax.Array:
    """``(*data sizes, *shape)`` per-device sums, reduce-scattered over the
    data axes the leaf is sharded over: ``(*kept sizes, *shape)``, the
    copies along its kept data axes left for the sum after."""
    kept = _kept_axes(s, self.axes)

    def scatter(local):
      x = local.reshape(local.shape[len(self.axes) :])
      for dim, names in s.sharded_dims():
        over = tuple(n for n in names if self.mesh.shape[n] > 1)
        if over:
          x = jax.lax.psum_scatter(x, over, scatter_dimension=dim, tiled=True)
      return x.reshape((1,) * len(kept) + x.shape)

    # Manual over every axis of the mesh: on jax 0.12, psum_scatter in a
    # shard_map that leaves some Explicit axis to the partitioner fails to
    # compile (the axes the leaf does not use are replicated either way).
    mesh = jax.sharding.get_abstract_mesh()
    return jax.shard_map(
      scatter,
      mesh=mesh,
      in_specs=P(*self.axes, *s.other_spec()),
      out_specs=P(*kept, *s.full_spec()),
      axis_names=set(mesh.axis_names),
    )(acc)

  # -- the rest --------------------------------------------------------------

  def _map(self, fun: Callable[..., Any], *trees: PyTree) -> PyTree:
    return _map_placed(fun, self.placements, *trees)

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
      return self.parallel.constrain(copies, P(_entry(self.axes), *other.other_spec()))

    return jax.tree.map(per_device, state)


class _GlobalStep:
  """``view="global"``: ``fun`` on the global micro-batch, as under plain
  ``jit``, each micro-batch the ``i``-th slice of every device's rows (no row
  moves); the partitioner places every collective. The accumulator is kept
  sharded like the parameters, and FSDP leaves keep their gathers inside
  the loop (an optimization barrier), as in the default view."""

  def __init__(
    self, parallel: DataParallel, engine: Engine, placements: tuple[Placement, ...]
  ):
    if engine.options.fsdp_gather == "once":
      raise ValueError(
        "fsdp_gather='once' keeps a gradient per device until after the loop, "
        "which needs view='device' (fun on one device's rows); with "
        "view='global' choose fsdp_gather='per_micro_batch' or 'cast_once'."
      )
    self.parallel = parallel
    self.engine = engine
    self.placements = placements

  def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _engine.Result:
    o = self.engine.options
    split = self.engine.plan(args)
    _engine.check_noise_estimable(o, split.num_micro_batches)
    diff_args = tuple(args[n] for n in o.argnums)
    call_args = list(args)
    for n, placed in zip(
      o.argnums, self._map(self._before_loop, diff_args), strict=True
    ):
      call_args[n] = placed
    base = self.engine.micro_step(
      tuple(call_args), kwargs, split, split.num_micro_batches, split.micro_batch_size
    )

    def step(diff_args, micro, index, state):
      return base(
        _unreduced.barrier(diff_args, [p.barrier for p in self.placements], index),
        micro,
        index,
        state,
      )

    sums = self.engine.sums(
      tuple(call_args), kwargs, split, step=step, accumulator=self._accumulator()
    )
    result = self.engine.finish(sums, diff_args)
    return result._replace(grads=self._map(self._like_parameter, result.grads))

  def _before_loop(self, x: jax.Array, p: Placement) -> jax.Array:
    if p.before_loop != "cast_gather" or p.spec is None:
      return x
    gathered = x.astype(self.engine.options.gather_dtype)
    return self.parallel.constrain(gathered, p.spec.other_spec())

  def _accumulator(self) -> _engine.Accumulator:
    """Float32 (or wider) sums, sharded like the parameters."""
    dtype = self.engine.options.accum_dtype

    def fold(g, p):
      return self._like_parameter(g.astype(_normalize.accumulator_dtype(dtype, g)), p)

    return _engine.Accumulator(
      init=lambda diff: self._map(lambda x, p: fold(jnp.zeros_like(x), p), diff),
      first=lambda grads: self._map(fold, grads),
      add=lambda acc, grads: self._map(
        lambda a, g, p: self._like_parameter(a + g.astype(a.dtype), p), acc, grads
      ),
    )

  def _like_parameter(self, x: jax.Array, p: Placement) -> jax.Array:
    return x if p.spec is None else self.parallel.constrain(x, p.spec.full_spec())

  def _map(self, fun: Callable[..., Any], *trees: PyTree) -> PyTree:
    return _map_placed(fun, self.placements, *trees)


def _inner_spec(p: Placement, ndim: int) -> tuple[Any, ...]:
  """The spec of one copy of a leaf inside the loop: for a leaf whose
  sharding is hidden, left to the partitioner (a tensor-parallel leaf stays
  split), never forced to replicated."""
  if p.spec is None:
    return (P.UNCONSTRAINED,) * ndim
  return tuple(p.spec.full_spec() if p.before_loop == "as_is" else p.spec.other_spec())


def _accumulator_spec(p: Placement, ndim: int) -> tuple[Any, ...]:
  """The spec of one copy of a leaf's accumulator: sharded like the
  parameter, but for a leaf gathered once, whose whole gradient each device
  keeps until after the loop."""
  if p.spec is None:
    return (P.UNCONSTRAINED,) * ndim
  return tuple(p.spec.other_spec() if p.before_loop == "gather" else p.spec.full_spec())


def _map_placed(
  fun: Callable[..., Any], placements: tuple[Placement, ...], *trees: PyTree
) -> PyTree:
  """``fun(*leaves, placement)`` over the leaves of ``trees`` (shaped like
  the differentiated arguments) and their placements."""
  flat = [jax.tree.flatten(t) for t in trees]
  leaves = [
    fun(*xs, p) for *xs, p in zip(*(f[0] for f in flat), placements, strict=True)
  ]
  return jax.tree.unflatten(flat[0][1], leaves)


def _vmap_level(
  fun: Callable[..., Any],
  axis: str,
  name: str,
  diff_axes: list[int | None],
  has_state: bool,
) -> Callable[..., Any]:
  """One ``vmap`` level over data axis ``axis`` (named ``name`` for the
  gathers of blocked leaves): the micro-batch, the index and the state
  mapped; each differentiated leaf as ``diff_axes`` says."""

  def level(diff_args, micro, index, state):
    treedef = jax.tree.structure(diff_args)
    in_axes = (
      jax.tree.unflatten(treedef, diff_axes),
      0,
      0,
      0 if has_state else None,
    )
    return jax.vmap(fun, in_axes=in_axes, axis_name=name, spmd_axis_name=axis)(
      diff_args, micro, index, state
    )

  return level


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
  """``spec`` without the axes that are not Explicit (what a reshard, or a
  reshape's ``out_sharding``, names)."""
  explicit = {
    n
    for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
    if t == AxisType.Explicit
  }
  return P(*(_only(e, explicit) for e in spec))


def _only(entry: Any, axes: set[str]) -> Any:
  """A spec entry restricted to ``axes``."""
  return _entry(tuple(n for n in _names(entry) if n in axes))


def _without(entry: Any, axes: set[str]) -> Any:
  """A spec entry without ``axes``."""
  return _entry(tuple(n for n in _names(entry) if n not in axes))


def _names(entry: Any) -> tuple[str, ...]:
  if entry is None or entry is P.UNCONSTRAINED:
    return ()
  return entry if isinstance(entry, tuple) else (entry,)


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


def _kept_axes(s: _sharding.SplitSpec, axes: tuple[str, ...]) -> tuple[str, ...]:
  """The data axes a leaf is replicated over (HSDP's replica axes)."""
  return tuple(a for a in axes if a not in s.data_axes_used())


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
  new_zero = jax.random.wrap_key_data(
    _replicated_rows(jax.random.key_data(new))[0], impl=jax.random.key_impl(new)
  )
  changed = jnp.any(
    jax.random.key_data(new_zero) != jax.random.key_data(_tree.fold_in(old, 0))
  )
  return _tree.select(changed, new_zero, old)


def _reshaped(x: jax.Array, shape: tuple[int, ...], spec: P) -> jax.Array:
  """``x`` reshaped to ``shape``, typed ``spec`` on its mesh."""
  sharding = jax.typeof(x).sharding.update(spec=spec)
  return jax.lax.reshape(x, shape, out_sharding=sharding)


def _replicated_rows(x: jax.Array) -> jax.Array:
  """``x`` with its leading (device) axis replicated, where its type shards
  it over Explicit axes (JAX slices no row out of a sharded axis)."""
  spec = _compat.explicit_spec(x)
  if spec is None or not spec.partitions or spec.partitions[0] is None:
    return x
  sharding = jax.typeof(x).sharding
  return jax.sharding.reshard(x, sharding.update(spec=P(None, *spec.partitions[1:])))


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
        f"fun names the data axes {axes} in a sharding annotation. In "
        "jaxaccum's default view (view='device') fun runs on one device's "
        "micro-batch, one entry of a vmap over the data axes, whose sharding "
        "jaxaccum sets. Pass view='global' to run fun on the global "
        "micro-batch, as under plain jit, where such annotations are valid as "
        "written (MaxText's activation rules, for one); or drop the data axes "
        "from the annotation (P(None, 'model') for P('data', 'model')); on "
        "Explicit axes, P(jax.typeof(x).sharding.spec[0], ...) names the "
        f"batch axis in both views. JAX said: {error}"
      ) from error

  return explained
