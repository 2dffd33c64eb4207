"""The devices of ``mesh=``'s data axes, as the per-device view lays them
out: one block of the batch, one copy or block of each leaf and one state
per device, mapped by one ``vmap`` per data axis.

A per-device value has a leading dimension per data axis, ``(*sizes,
...)``, as the ``vmap`` levels take it, or one, ``(D, ...)``, as the loop
keeps it (``D`` the devices of the data axes). :class:`Devices` converts
between the two, splits a leaf into its devices' blocks and builds the
nested ``vmap``; the functions below bring the per-device results back (the
aux in global order, one state).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxaccum import _compat, _tree
from jaxaccum._parallel import placement as _placement
from jaxaccum._parallel import specs as _specs
from jaxaccum._parallel import types as _types
from jaxaccum._parallel.placement import Placement

PyTree = Any


class Devices:
  """The data ``axes`` of ``mesh``: their ``sizes``, the ``count`` of their
  devices (``D``) and whether one of them is ``explicit`` (then per-device
  values are typed laid out over them)."""

  def __init__(self, mesh: jax.sharding.Mesh, axes: tuple[str, ...]):
    self.mesh = mesh
    self.axes = axes
    self.sizes = tuple(mesh.shape[a] for a in axes)
    self.count = math.prod(self.sizes)
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    self.explicit = any(types[a] == AxisType.Explicit for a in axes)

  def unflatten(self, x: jax.Array) -> jax.Array:
    """``(D, ...)`` per device as ``(*data sizes, ...)``; on Explicit axes
    laid out over the data axes first (a batch that came replicated is
    sliced where it lies), so that every input the ``vmap`` maps is
    sharded alike."""
    shape = (*self.sizes, *x.shape[1:])
    if not self.explicit:
      return x.reshape(shape)
    x = _types.constrain(
      x, P(_specs.entry(self.axes), *(P.UNCONSTRAINED,) * (jnp.ndim(x) - 1))
    )
    rest = jax.typeof(x).sharding.spec.partitions[1:]
    return _types.reshaped(x, shape, P(*self.axes, *rest))

  def flatten(self, x: jax.Array) -> jax.Array:
    """``(*data sizes, ...)`` per device as ``(D, ...)``."""
    shape = (self.count, *x.shape[len(self.sizes) :])
    spec = _compat.explicit_spec(x)
    if spec is None or not self.explicit:
      return x.reshape(shape)
    rest = spec.partitions[len(self.sizes) :]
    return _types.reshaped(x, shape, P(_specs.entry(self.axes), *rest))

  def flat_copies(self, g: jax.Array, p: Placement) -> jax.Array:
    """A per-device gradient ``(*copy sizes, ...)`` as ``(D, ...)``."""
    return g.reshape(self.count, *g.shape[len(p.copies) :])

  def blocks(self, x: jax.Array, p: Placement) -> jax.Array:
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
    if self.explicit:
      x = _types.reshaped(x, tuple(shape), _types.explicit_only(P(*entries), self.mesh))
    else:
      x = x.reshape(shape)
    order = [position[a] for a in self.axes]
    return jnp.transpose(x, (*order, *(d for d in range(len(shape)) if d not in order)))

  def nested_vmap(
    self,
    loss: Callable[..., Any],
    placements: Sequence[Placement],
    has_state: bool,
    pairs: bool = False,
  ) -> Callable[..., Any]:
    """``loss`` on every device: one ``vmap`` per data axis. Each leaf of
    the differentiated arguments enters with a leading dimension per data
    axis (:meth:`blocks`): its copies, or for a shared (FSDP) leaf its
    blocks, which ``fun`` gets back whole by an ``all_gather`` over the
    ``vmap``'s axes. The gather only reshapes, typed sharded like the
    parameter, so the partitioner gathers each weight where it is used, as
    under plain ``jit``; its transpose is the reduce-scatter of the leaf's
    gradient over the devices that share it. With ``pairs``, ``diff_args``
    is a pair of such trees (ghost clipping's leaves and their masters),
    each taken so."""
    names = {a: f"jaxaccum:{a}" for a in self.axes}

    def whole(x, p):
      if not p.blocked:
        return x
      for dim, over in p.spec.sharded_dims():
        for a in reversed(over):  # the minor axis's blocks are adjacent
          x = jax.lax.all_gather(x, names[a], axis=dim, tiled=True)
      return x

    def each(f, diff_args):
      if pairs:
        return tuple(_placement.each(f, placements, d) for d in diff_args)
      return _placement.each(f, placements, diff_args)

    def on_device(diff_args, *rest):
      return loss(each(whole, diff_args), *rest)

    fun = on_device
    for axis in reversed(self.axes):
      diff_axes = [0 if p.mapped(axis) else None for p in placements]
      diff_axes = diff_axes * 2 if pairs else diff_axes
      fun = _vmap_level(fun, axis, names[axis], diff_axes, has_state)
    return lambda diff_args, *rest: fun(each(self.blocks, diff_args), *rest)

  def states(self, state: PyTree) -> PyTree:
    """Each device's copy of the state, ``(D, ...)``, with the device index
    folded into any typed PRNG key in it (e.g. an nnx RNG stream), so that
    devices draw different dropout masks."""
    devices = jnp.arange(self.count, dtype=jnp.int32)

    def per_device(x):
      if _tree.is_key(x):
        copies = jax.vmap(lambda d: _tree.fold_in(x, d))(devices)
      else:
        copies = jnp.broadcast_to(jnp.asarray(x), (self.count, *jnp.shape(x)))
      other = _specs.split_spec(_compat.visible_spec(x), jnp.ndim(x), self.axes)
      return _types.constrain(copies, P(_specs.entry(self.axes), *other.other_spec()))

    return jax.tree.map(per_device, state)


def device_major(x: jax.Array) -> jax.Array:
  """``(k, D, ...)`` per micro-batch and device to ``(D * k, ...)``: device
  ``d``'s micro-batches ``d*k .. d*k+k-1`` in global order."""
  x = jnp.swapaxes(x, 0, 1)
  return x.reshape((x.shape[0] * x.shape[1], *x.shape[2:]))


def reduce_state(state: PyTree, state_in: PyTree) -> PyTree:
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


def _replicated_rows(x: jax.Array) -> jax.Array:
  """``x`` with its leading (device) axis replicated, where its type shards
  it over Explicit axes (JAX slices no row out of a sharded axis)."""
  spec = _compat.explicit_spec(x)
  if spec is None or not spec.partitions or spec.partitions[0] is None:
    return x
  sharding = jax.typeof(x).sharding
  return jax.sharding.reshard(x, sharding.update(spec=P(None, *spec.partitions[1:])))


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
