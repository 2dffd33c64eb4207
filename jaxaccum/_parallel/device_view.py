"""``mesh=``'s default view (``view="device"``): each device accumulates its
own rows, ``fun`` sees one device's micro-batch.

Accumulating under plain ``jit`` on Auto axes leaves every decision to the
partitioner: it all-reduces a replicated parameter's gradient inside the
loop, ``k`` times per step. Here the step is laid out over the data axes
instead, in global view, in the five moves of
:class:`jaxaccum._parallel.skeleton.Step`:

1. **The batch** is laid out as ``(D, k, m / D, ...)``: one block per device,
   micro-batch ``i`` the ``i``-th slice of every device's shard, so no row
   moves (``_split``). Each leaf is placed as its
   :class:`~jaxaccum._parallel.placement.Placement` says: a copy per device
   along its copies' axes, gathered (and cast) first where it says so.
2. **The micro step** runs ``fun`` on one device's rows, ``vmap``-ped over the
   data axes with ``spmd_axis_name``, one ``vmap`` level per data axis
   (:meth:`jaxaccum._parallel.devices.Devices.nested_vmap`): ``fun`` sees
   one device's micro-batch and the mesh as under plain ``jit``, with the
   user's axis types (annotations on the other axes, a tensor-parallel
   ``"model"``, and constraints on the concrete mesh valid for one device's
   rows work as there). Device ``d``'s micro-batch ``i`` gets the key of
   global micro-batch ``d * k + i``; each device threads its own state.
3. **The gradient** is taken of the *sum* of the devices' losses. A leaf
   each device has its own copy of (a per-device input of the ``vmap``)
   gets its own gradient per device; a leaf shared by the devices of a data
   axis (FSDP: each device's block mapped, made whole inside by an
   ``all_gather`` over the ``vmap``'s axis that only reshapes, so it stays
   typed sharded; gathered before the loop by ``"cast_once"``, an unmapped
   input) gets the gradient summed over them, and the partitioner
   places that reduction, and each weight's gather, where plain ``jit`` would:
   inside the model's backward layer loop, a reduce-scatter per layer on a
   GPU or TPU; an optimization barrier keeps each gather in the loop. A leaf
   whose sharding is hidden (Auto axes under ``jit``, no ``param_specs``) is
   copied along the data axes and left to the partitioner along its own
   dimensions, never forced to replicated.
4. **The accumulator** of each leaf is laid out like the leaf in the loop:
   a copy per device along its copies' axes, sharded like the parameter
   along the others.
5. **After the loop**, one reduction: every per-device accumulator summed
   over its devices into the parameter's sharding.

The step keeps the user's axis types: no axis is re-typed. On Explicit axes
``fun`` sees a blocked (FSDP) leaf typed sharded over the data axes, as
under ``jax.value_and_grad`` on the same mesh, so it gathers such a weight
where it uses it (a ``reshard``), as it must there; on Auto axes the
partitioner places those gathers.

DP-SGD's micro steps (``clip_per_example``) live apart, in
:mod:`jaxaccum._parallel.clipped_steps`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxaccum import _accumulator, _compat, _engine, _micro, _split, _tree
from jaxaccum._engine import Engine
from jaxaccum._parallel import clipped_steps as _clipped
from jaxaccum._parallel import devices as _devices
from jaxaccum._parallel import placement as _placement
from jaxaccum._parallel import specs as _specs
from jaxaccum._parallel import types as _types
from jaxaccum._parallel.placement import Placement
from jaxaccum._parallel.skeleton import Step

PyTree = Any


def step(
  devices: _devices.Devices,
  engine: Engine,
  placements: Sequence[Placement],
  args: tuple[Any, ...],
) -> DeviceStep:
  """The :class:`DeviceStep` for ``args``: each device's share of the batch
  split into micro-batches, and checked that ``noise_stats`` has two in
  all (over the devices too, but for shared leaves, whose gradients are
  only ever summed over devices)."""
  split = engine.plan(args, devices=devices.count)
  step = DeviceStep(devices, engine, placements, split)
  total = split.num_micro_batches * (1 if step.shared else devices.count)
  _engine.check_noise_estimable(engine.options, total)
  return step


class DeviceStep(Step):
  """One traced step of the per-device view (module docstring). ``fun``
  sees one device's rows here; its loss is read on the whole batch's
  micro-batch, the sums' coefficients are the whole batch's, and each
  device's sums join the totals after the loop."""

  per_device = True

  def __init__(
    self,
    devices: _devices.Devices,
    engine: Engine,
    placements: Sequence[Placement],
    split: _split.MicroBatching,
  ):
    super().__init__(engine, placements, split)
    self.devices = devices
    self.shared = any(p.shared for p in self.placements)

  # -- 1. the leaves as the loop takes them -------------------------------------

  def before_loop(self, x: jax.Array, p: Placement) -> jax.Array:
    """Gathered (and cast) where the placement says so, then copied along
    the axes of its copies: ``(*copy sizes, *shape)``, one copy per
    device."""
    if p.before_loop != "as_is" and p.spec is not None:
      if p.before_loop == "cast_gather":
        x = x.astype(self.options.gather_dtype)
      x = _types.constrain(x, p.spec.other_spec())
    if not p.copies:
      return x
    sizes = tuple(self.devices.mesh.shape[a] for a in p.copies)
    copies = jnp.broadcast_to(x, (*sizes, *jnp.shape(x)))
    return _types.constrain(copies, P(*p.copies, *_inner_spec(p, jnp.ndim(x))))

  # -- 2. the loop and its micro step -------------------------------------------

  def loop(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _engine.Sums:
    """The loop over each device's block of every micro-batch, each device
    threading its own state."""
    o = self.options
    state = None if o.state_argnum is None else args[o.state_argnum]
    return self.engine.sums(
      args,
      kwargs,
      self.split,
      step=self.micro_step(args, kwargs),
      accumulator=self.accumulator(),
      state=None if state is None else self.devices.states(state),
      per_block=True,
    )

  def micro_step(
    self, args: tuple[Any, ...], kwargs: dict[str, Any]
  ) -> Callable[..., Any]:
    """``step(diff_args, micro, index, state)``: every device's micro-batch,
    the gradient of the sum of their losses (see the module docstring)."""
    o = self.options
    k = self.split.num_micro_batches
    offsets = _types.constrain(
      (jnp.arange(self.devices.count, dtype=jnp.int32) * k).reshape(self.devices.sizes),
      P(*self.devices.axes),
    )
    rows = self.split.micro_batch_size // self.split.shards
    if o.rule is not None and not o.rule.whole_gradients:
      return _clipped.ghost_micro_step(self, args, kwargs, offsets)
    if o.rule is not None:
      return _clipped.clipped_micro_step(self, args, kwargs, offsets, rows)
    loss = self.explained(
      self.engine.micro.loss(args, kwargs, self.split, self.devices.count * k), args
    )
    per_device = self.devices.nested_vmap(
      loss, self.placements, o.state_argnum is not None
    )
    diff = tuple(args[n] for n in o.argnums)
    scale = self.engine.micro.seed(diff, self.devices.count * k)

    def step(diff_args, micro, index, state):
      diff_args, micro, state = self.device_inputs(diff_args, micro, index, state)

      def total(diff_args):
        losses, (weights, aux, new_state) = per_device(
          diff_args, micro, offsets + index, state
        )
        return jnp.sum(losses), (losses, weights, aux, new_state)

      value, backward, out = jax.vjp(total, diff_args, has_aux=True)
      seed = jnp.full_like(value, scale)  # 1, or the mean's 1 / (D k)
      if k > 1:
        # In the loop, the backward pass starts after the loss is computed.
        # Left free, XLA's TPU scheduler put the loss's last step (a gather
        # of each label's float32 logit) beside the logits' cotangent, both
        # held at the peak (+2,000 MiB for a 1B Llama at k = 2), where the
        # hand-written scan's program happened to gather first. At k = 1
        # the step stays the full batch's program.
        out, seed = jax.lax.optimization_barrier((out, seed))
      (grads,) = backward(seed)
      losses, weights, aux, new_state = jax.tree.map(self.devices.flatten, out)
      noise = self._noise(grads, weights, rows) if o.noise_stats else None
      return _micro.MicroOut(losses, weights, aux, new_state, noise), grads

    return self.engine.micro.rematerialized(step)

  def device_inputs(
    self, diff_args: PyTree, micro: PyTree, index: jax.Array, state: PyTree
  ) -> tuple[PyTree, PyTree, PyTree]:
    """A micro step's inputs as the ``vmap`` over the devices takes them:
    the FSDP leaves held (:meth:`hold`), the micro-batch and the state with
    a leading axis per device."""
    diff_args = self.hold(diff_args, index)
    micro = jax.tree.map(self.devices.unflatten, micro)
    if state is not None:
      state = jax.tree.map(self.devices.unflatten, state)
    return diff_args, micro, state

  def explained(
    self, step: Callable[..., Any], args: tuple[Any, ...]
  ) -> Callable[..., Any]:
    """``step``, with two of JAX's refusals explained in jaxaccum's terms
    (:func:`explained`)."""
    return explained(step, args, self.options, self.placements, self.devices)

  def _noise(
    self, grads: tuple[PyTree, ...], weights: jax.Array, rows: int
  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The noise terms of each device's micro-batch; with shared leaves,
    whose gradients are only ever summed over devices, those of the global
    micro-batch (the devices' gradients, divisors and examples summed)."""
    o = self.options
    if not self.shared:
      flat = jax.tree.leaves(self.map(self.devices.flat_copies, grads))
      sq = jax.vmap(lambda *g: _tree.sq_norm(g))(*flat)
      return _micro.noise_terms(o, sq, weights, rows)
    summed = self.map(lambda g, p: jnp.sum(g, axis=tuple(range(len(p.copies)))), grads)
    _, divisors, examples = _micro.noise_terms(o, weights, weights, rows)
    ones = jnp.ones_like(weights)
    return (
      _tree.sq_norm(summed)[None],
      jnp.sum(divisors * ones)[None],
      jnp.sum(examples * ones)[None],
    )

  # -- 4. the sums: a copy per device ------------------------------------------------

  def leaf_sum(self, p: Placement) -> _accumulator.LeafSum:
    """Shaped and sharded like the leaf in the loop: a copy per device along
    its copies' axes, sharded like the parameter along the others (left to
    the partitioner where its sharding is hidden)."""

    def layout(x):
      if p.accumulator is None:  # hidden: left to the partitioner
        return _types.constrain(x, P(*p.copies, *_hidden(jnp.ndim(x) - len(p.copies))))
      return _types.constrain(x, P(*p.copies, *p.accumulator))

    return _accumulator.LeafSum(layout=layout)

  # -- 5. reduce once, after the loop -----------------------------------------------

  def reduce(self, sums: _engine.Sums, args: tuple[Any, ...]) -> _engine.Result:
    """Each accumulator summed over its copies; the aux and the weights in
    global micro-batch order; each device's state made one."""
    o = self.options
    diff_args = tuple(args[n] for n in o.argnums)
    state_in = None if o.state_argnum is None else args[o.state_argnum]
    sums = sums._replace(
      grads=self.map(self.after_loop, sums.grads, diff_args),
      aux=jax.tree.map(_devices.device_major, sums.aux),
      weights=_devices.device_major(sums.weights),
      state=None if state_in is None else _devices.reduce_state(sums.state, state_in),
    )
    return self.engine.finish(sums, diff_args, args)

  def after_loop(self, acc: jax.Array, x: jax.Array, p: Placement) -> jax.Array:
    """The accumulator summed over its copies, into the parameter's sharding:
    an all-reduce, or for a leaf gathered once a reduce-scatter over the
    axes it is sharded over (written as one, rather than left to the
    partitioner, which may all-reduce and slice)."""
    del x
    copies = len(p.copies)
    if p.before_loop == "gather" and p.spec is not None:
      acc = self._reduce_scatter(acc, p.spec)
      copies = len(_placement.kept_axes(p.spec, self.devices.axes))
    acc = p.combine.over(acc, copies)  # a sum, or an FP8 amax's max
    return acc if p.spec is None else _types.constrain(acc, p.spec.full_spec())

  def _reduce_scatter(self, acc: jax.Array, s: _specs.SplitSpec) -> jax.Array:
    """``(*data sizes, *shape)`` per-device sums, reduce-scattered over the
    data axes the leaf is sharded over: ``(*kept sizes, *shape)``, the
    copies along its kept data axes left for the sum after."""
    axes = self.devices.axes
    kept = _placement.kept_axes(s, axes)

    def scatter(local):
      x = local.reshape(local.shape[len(axes) :])
      for dim, names in s.sharded_dims():
        over = tuple(n for n in names if self.devices.mesh.shape[n] > 1)
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
      in_specs=P(*axes, *s.other_spec()),
      out_specs=P(*kept, *s.full_spec()),
      axis_names=set(mesh.axis_names),
    )(acc)


def explained(
  step: Callable[..., Any],
  args: tuple[Any, ...],
  options: Any,
  placements: Sequence[Placement],
  devices: _devices.Devices,
) -> Callable[..., Any]:
  """``step``, with two of JAX's refusals explained in jaxaccum's terms:
  an annotation that names a data axis, and on Explicit axes a use of a
  leaf sharded over them (fun sees it typed, as under
  ``jax.value_and_grad`` on the mesh) that JAX's types refuse."""
  o = options
  paths = [
    f"{o.names(n)}{jax.tree_util.keystr(path)}"
    for n in o.argnums
    for path, _ in jax.tree_util.tree_leaves_with_path(args[n])
  ]
  blocked = [
    f"{name} (over {', '.join(sorted(p.spec.data_axes_used()))})"
    for name, p in zip(paths, placements, strict=True)
    if p.blocked and p.spec is not None
  ]
  if len(blocked) > 3:
    blocked = [*blocked[:3], f"{len(blocked) - 3} more"]

  def on_types(*inputs):
    try:
      return step(*inputs)
    except _compat.SHARDING_TYPE_REFUSALS as error:
      if not (devices.explicit and blocked):
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

  return _named_data_axis_explained(on_types, devices.axes)


def _named_data_axis_explained(
  step: Callable[..., Any], axes: tuple[str, ...]
) -> Callable[..., Any]:
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


def _inner_spec(p: Placement, ndim: int) -> tuple[Any, ...]:
  """The spec of one copy of a leaf inside the loop: for a leaf whose
  sharding is hidden, left to the partitioner (a tensor-parallel leaf stays
  split), never forced to replicated."""
  if p.spec is None:
    return _hidden(ndim)
  return tuple(p.spec.full_spec() if p.before_loop == "as_is" else p.spec.other_spec())


def _hidden(ndim: int) -> tuple[Any, ...]:
  """The spec entries of a leaf whose sharding is hidden: left to the
  partitioner."""
  return (P.UNCONSTRAINED,) * ndim
