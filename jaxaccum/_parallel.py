"""The data-parallel path: local accumulation, ONE gradient reduction per step.

Accumulating under plain ``jit`` over a sharded batch leaves the reduction to
the partitioner, which places an all-reduce of the gradients inside the loop
body: ``k`` reductions per step. Here the step runs inside ``jax.shard_map``
over the data axes instead (one axis, or several for HSDP, e.g.
``("replica", "fsdp")``):

1. Each device splits its own shard of the batch locally, so micro-batch ``i``
   is the ``i``-th contiguous slice of every shard and no data moves.
2. Parameters sharded along data axes (FSDP) are all-gathered along them once,
   before the loop. All parameters are then cast to *varying* along the data
   axes (``lax.pcast``), so autodiff inserts no ``psum`` into the backward
   pass.
3. The ``lax.scan`` accumulates local gradient sums.
4. After the loop, one reduction: ``psum_scatter`` along the data axes a
   parameter is sharded over (its grads come back sharded like it) and
   ``psum`` along the others; ``psum`` of the loss and weight sums, so the
   weighted mode divides by the global token count; ``pmean`` of floating
   state.

Every other mesh axis (tensor parallel ``"model"``, say) keeps its sharding:
``shard_map`` makes only the data axes manual, and the parameters, the
accumulators and the grads stay sharded along the rest. On a mesh with
``Explicit`` axes, those axes are made ``Auto`` around the ``shard_map``
(whose lowering would otherwise replicate them at its boundary) and
``Explicit`` again around the loop, so that ``fun`` sees exactly the types it
sees under plain ``jit``, minus the manual data axes.

The micro-batch index folded into the key is global: micro-batch ``i`` of
device ``d`` is ``d * k + i``, ``d`` counting the data axes' devices in the
order the batch is sharded. With ``D`` devices and ``k`` micro-batches per
device, the result therefore equals the single-device result with ``D * k``
micro-batches, keys included.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxaccum import _calls, _sharding, _split, _stats
from jaxaccum._engine import Engine

PyTree = Any
Layout = tuple["_sharding.SplitSpec | None", ...]


def _data_axes(mesh: jax.sharding.Mesh, data_axis: Any) -> tuple[str, ...]:
  axes = (data_axis,) if isinstance(data_axis, str) else data_axis
  if (
    not isinstance(axes, tuple) or not axes or not all(isinstance(a, str) for a in axes)
  ):
    raise TypeError(
      "data_axis must be a mesh axis name or a non-empty tuple of them, got "
      f"{data_axis!r}."
    )
  for a in axes:
    if a not in mesh.axis_names:
      raise ValueError(
        f"data_axis {a!r} is not an axis of the mesh, whose axes are {mesh.axis_names}."
      )
  if len(set(axes)) != len(axes):
    raise ValueError(f"data_axis={data_axis!r} repeats an axis.")
  return axes


def _names_manual_axes(error: Exception, axes: Sequence[str]) -> bool:
  message = str(error)
  return "Manual" in message and any(
    re.search(rf"(?<![\w]){re.escape(a)}(?![\w])", message) for a in axes
  )


def _guard_manual_axes(fun: Callable[..., Any], axes: tuple[str, ...]):
  """``fun``, with JAX's error about a manual axis explained in our terms."""

  @functools.wraps(fun)
  def guarded(*args, **kwargs):
    try:
      return fun(*args, **kwargs)
    except Exception as error:
      if not _names_manual_axes(error, axes):
        raise
      raise ValueError(
        f"fun names the data axes {axes} in a sharding annotation, but "
        "jaxaccum runs fun inside shard_map, where the data axes are manual: "
        "each device sees only its own micro-batch. Read the batch axis from "
        "the input's type instead, which works in both views, e.g. "
        "out_sharding=P(jax.typeof(x).sharding.spec[0], None) (that entry is "
        "the data axis under plain jit and None inside jaxaccum). Annotations "
        "and collectives on the other mesh axes work as under plain jit. "
        f"JAX said: {error}"
      ) from error

  return guarded


class DataParallel:
  """Runs an :class:`Engine` data-parallel over ``mesh``'s data axes."""

  def __init__(
    self,
    engine: Engine,
    mesh: jax.sharding.Mesh,
    data_axis: str | tuple[str, ...],
    param_specs: PyTree | None,
  ):
    if not isinstance(mesh, jax.sharding.Mesh):
      raise TypeError(f"mesh must be a jax.sharding.Mesh, got {mesh!r}.")
    self.axes = _data_axes(mesh, data_axis)
    self.engine = dataclasses.replace(
      engine, fun=_guard_manual_axes(engine.fun, self.axes)
    )
    self.mesh = mesh
    self.num_devices = math.prod(mesh.shape[a] for a in self.axes)
    self.param_specs = param_specs
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    explicit = {a for a, t in types.items() if t == AxisType.Explicit}
    self.explicit = frozenset(explicit)
    # Explicit axes other than the data axes: Auto around the shard_map,
    # Explicit again around the loop.
    self.other_explicit = tuple(
      a for a in mesh.axis_names if a in explicit - set(self.axes)
    )

  @property
  def _batch_entry(self) -> Any:
    return self.axes[0] if len(self.axes) == 1 else self.axes

  # -- what a compiled step is for ------------------------------------------

  def layout(self, args: tuple[Any, ...]) -> Layout:
    """Per leaf of the differentiated arguments, its split spec if known.

    From ``param_specs`` if given, else from the arrays: their sharding
    outside ``jit``, their type on ``Explicit`` axes inside it. Unknown
    (``None``) means replicated along the data axes.
    """
    engine = self.engine
    specs: list[Any] = []
    given = self.param_specs
    if given is not None and len(engine.argnums) == 1:
      given = (given,)
    for j, n in enumerate(engine.argnums):
      arg = args[n]
      if given is not None:
        leaf_specs = _broadcast_specs(given[j], arg)
      else:
        leaf_specs = [_sharding.visible_spec(x) for x in jax.tree.leaves(arg)]
      for (path, x), spec in zip(
        jax.tree_util.tree_leaves_with_path(arg), leaf_specs, strict=True
      ):
        what = f"The parameter args[{n}]{jax.tree_util.keystr(path)}"
        specs.append(
          None
          if spec is None
          else _sharding.split_spec(spec, jnp.ndim(x), self.axes, what)
        )
    return tuple(specs)

  def check_global_batch(self, args: tuple[Any, ...]) -> None:
    batch = {f"args[{i}]": args[i] for i in self.engine.batch_argnums}
    size = _split.leading_batch_size(batch)
    where = f"the {self.num_devices} devices of data axes {self.axes}"
    if size % self.num_devices:
      raise ValueError(f"The global batch_size={size} is not divisible by {where}.")
    local = size // self.num_devices
    try:
      _split.plan_split(
        local, self.engine.num_micro_batches, self.engine.micro_batch_size
      )
    except ValueError as error:
      raise ValueError(
        f"The global batch_size={size} on {where} is {local} rows per device, "
        f"and per device: {error}"
      ) from None

  # -- the traced step --------------------------------------------------------

  def __call__(self, layout: Layout, /, *args: Any, **kwargs: Any) -> Any:
    """The step, traced: ``((value, aux), grads_tuple, noise)``."""
    engine, axes = self.engine, self.axes
    engine.check_args(args)
    self.check_global_batch(args)
    args = tuple(
      jax.tree.map(jnp.asarray, a) if n in engine.array_argnums else a
      for n, a in enumerate(args)
    )
    core = {n: args[n] for n in engine.array_argnums}
    others = {n: a for n, a in enumerate(args) if n not in core}
    statics, other_arrays = _calls.split_statics((others, kwargs))
    num_args = len(args)

    def rebuild(core, other_arrays):
      others, kwargs = statics.merge(other_arrays)
      merged = {**others, **core}
      return tuple(merged[n] for n in range(num_args)), kwargs

    # Per leaf of `core`: the split spec (data axes vs the rest).
    diff_layout = iter(layout)
    split_core: dict[int, Any] = {}
    for n in sorted(core):
      if n in engine.argnums:
        continue
      split_core[n] = jax.tree.map(
        lambda x, n=n: self._split_input(
          x, f"args[{n}]", batch=n in engine.batch_argnums
        ),
        core[n],
      )
    for n in engine.argnums:
      split_core[n] = jax.tree.map(
        lambda x: next(diff_layout) or _sharding.split_spec(None, jnp.ndim(x), axes),
        core[n],
      )
    split_others = [self._split_input(x, "a keyword argument") for x in other_arrays]
    is_split = lambda s: isinstance(s, _sharding.SplitSpec)  # noqa: E731
    explicit_specs = jax.tree.map(
      lambda s: s.other_spec(frozenset(self.other_explicit)),
      (split_core, split_others),
      is_leaf=is_split,
    )
    data_specs = jax.tree.map(
      lambda s: s.data_spec(), (split_core, split_others), is_leaf=is_split
    )
    diff_splits = tuple(split_core[n] for n in engine.argnums)

    def local_step(core, other_arrays):
      local_args, _ = rebuild(core, other_arrays)
      split = engine.plan(local_args)
      local_diff = tuple(local_args[n] for n in engine.argnums)
      device = jax.lax.axis_index(axes)
      call_core = dict(core)
      for n, arg, splits in zip(engine.argnums, local_diff, diff_splits, strict=True):
        call_core[n] = _sharding.to_varying(jax.tree.map(_gather, arg, splits), axes)
      state_in = None
      if engine.state_argnum is not None:
        # Each device threads its own copy of the state, with the device index
        # folded into any PRNG key in it (e.g. an nnx RNG stream), so devices
        # draw different dropout masks.
        state_in = core[engine.state_argnum]
        call_core[engine.state_argnum] = _sharding.to_varying(
          jax.tree.map(lambda x: _fold_key(x, device), state_in), axes
        )

      def accumulate(call_core, other_arrays, offset):
        call_args, kwargs = rebuild(call_core, other_arrays)
        return engine.sums(call_args, kwargs, split, index_offset=offset)

      sums = self._in_explicit_region(
        accumulate,
        (call_core, other_arrays, device * split.num_micro_batches),
        (*explicit_specs, P()),
      )
      grads = jax.tree.map(_reduce_grad(axes), sums.grads, diff_splits)
      sums = sums._replace(
        loss=jax.lax.psum(sums.loss, axes),
        weight=jax.lax.psum(sums.weight, axes),
        grads=grads,
        state=_reduce_state(sums.state, state_in, axes),
        noise=None if sums.noise is None else jax.lax.psum(sums.noise, axes),
      )
      return engine.finish(sums, local_diff, _sharded_sq_norm(diff_splits))

    out_specs = (
      self._value_aux_specs(),
      jax.tree.map(lambda s: s.data_spec(), diff_splits, is_leaf=is_split),
      P(),
    )
    mapped = jax.shard_map(
      local_step,
      mesh=None if self.other_explicit else self.mesh,
      in_specs=data_specs,
      out_specs=out_specs,
      axis_names=set(axes),
    )

    def step(core, other_arrays):
      inputs = self._reshard_data_axes((core, other_arrays), data_specs)
      return mapped(*inputs)

    if not self.other_explicit:
      value_aux, grads, noise = step(core, other_arrays)
      return value_aux, self._constrain_auto(grads, diff_splits), noise
    return self._auto_around(step, core, other_arrays, diff_splits, split_core)

  def _reshard_data_axes(self, inputs: Any, data_specs: Any) -> Any:
    """On Explicit data axes, ``shard_map`` wants each input sharded along
    them exactly as its ``in_specs`` say: reshard the inputs that are not
    (e.g. a keyword array sharded along the data axis, which every device
    gets whole)."""
    if not self.explicit & set(self.axes):
      return inputs
    mesh = self.mesh if not self.other_explicit else None

    def fix(x, spec):
      have = _sharding.split_spec(_sharding.visible_spec(x), jnp.ndim(x), self.axes)
      if have.data_spec() == spec:
        return x
      return jax.sharding.reshard(
        x, spec if mesh is None else NamedSharding(mesh, spec)
      )

    return jax.tree.map(fix, inputs, data_specs)

  def _split_input(self, x: Any, what: str, batch: bool = False) -> _sharding.SplitSpec:
    """The split spec of an input that is not differentiated: its visible
    sharding along the other axes; along the data axes, the batch axis for a
    batch leaf and replicated otherwise."""
    visible = _sharding.split_spec(
      _sharding.visible_spec(x), jnp.ndim(x), self.axes, what
    )
    other = visible.other
    if batch and other and other[0]:
      raise ValueError(
        f"Batch leaf {what} is sharded along {other[0]} in its batch "
        f"dimension; jaxaccum splits the batch dimension along the data axes "
        f"{self.axes} only."
      )
    data: tuple[tuple[str, ...], ...] = tuple(() for _ in other)
    if batch:
      data = (self.axes, *data[1:])
    return _sharding.SplitSpec(data, other)

  def _in_explicit_region(self, fun, inputs, specs) -> Any:
    """``fun(*inputs)`` with the other Explicit axes Explicit again, each
    input sharded along them by ``specs``."""
    if not self.other_explicit:
      return fun(*inputs)
    region = jax.sharding.explicit_axes(
      fun, axes=self.other_explicit, in_sharding=specs
    )
    return region(*inputs)

  def _auto_around(self, step, core, other_arrays, diff_splits, split_core):
    """Runs ``step`` with the other Explicit axes Auto, and gives its outputs
    back the shardings they have under plain ``jit``: the grads exactly the
    parameters'."""
    value_aux_specs = self._value_aux_specs(split_core)
    keep = self.explicit

    def full(s):
      only = lambda names: tuple(n for n in names if n in keep)  # noqa: E731
      spec = _sharding.SplitSpec(tuple(map(only, s.data)), tuple(map(only, s.other)))
      return NamedSharding(self.mesh, spec.full_spec())

    out_sharding = (
      jax.tree.map(
        lambda s: NamedSharding(self.mesh, s),
        value_aux_specs,
        is_leaf=lambda s: isinstance(s, P),
      ),
      jax.tree.map(
        full, diff_splits, is_leaf=lambda s: isinstance(s, _sharding.SplitSpec)
      ),
      NamedSharding(self.mesh, P()),
    )
    return jax.sharding.auto_axes(
      step, axes=self.other_explicit, out_sharding=out_sharding
    )(core, other_arrays)

  def _constrain_auto(self, grads: Any, diff_splits: Any) -> Any:
    """On an all-Auto mesh, pins the grads to the parameters' known specs."""
    if self.explicit:
      return grads

    def pin(g, s):
      if s is None or (not any(s.other) and not any(s.data)):
        return g
      return jax.lax.with_sharding_constraint(
        g, NamedSharding(self.mesh, s.full_spec())
      )

    return jax.tree.map(pin, grads, diff_splits)

  def _value_aux_specs(self, split_core: dict[int, Any] | None = None) -> Any:
    """Value: replicated. Aux: device-major along its micro-batch axis.

    The stacked aux of device ``d`` holds its micro-batches ``d*k .. d*k+k-1``,
    so concatenating along the leading axis gives them in global order. The
    state is replicated along the data axes (and, with ``split_core``, keeps
    its sharding along the other Explicit axes).
    """
    aux_spec: Any = P(self._batch_entry)
    n = self.engine.state_argnum
    if n is not None:
      if split_core is None:
        state_spec: Any = P()
      else:
        keep = frozenset(self.other_explicit)
        state_spec = jax.tree.map(
          lambda s: s.other_spec(keep),
          split_core[n],
          is_leaf=lambda s: isinstance(s, _sharding.SplitSpec),
        )
      aux_spec = (aux_spec, state_spec)
    return (P(), aux_spec)


def _broadcast_specs(spec_tree: Any, arg: PyTree) -> list[P | None]:
  """One spec per leaf of ``arg`` from ``spec_tree``, a tree prefix of it."""
  is_spec = lambda s: isinstance(s, P) or s is None  # noqa: E731
  specs: list[P | None] = []
  jax.tree.map(
    lambda s, sub: specs.extend([s] * len(jax.tree.leaves(sub))),
    spec_tree,
    arg,
    is_leaf=is_spec,
  )
  return specs


def _manual_along_others(
  fun: Callable[[jax.Array], jax.Array], x: jax.Array, split: _sharding.SplitSpec
) -> jax.Array:
  """``fun(x)`` with the other axes ``x`` is sharded along made manual too.

  A collective along the data axes inside the (partially manual) step would
  otherwise first replicate its operand along the other axes: an FSDP + TP
  parameter would be all-gathered along the tensor-parallel axis as well. In
  a nested ``shard_map`` over those axes, each device gathers or
  reduce-scatters just its own tensor-parallel shard.
  """
  others = frozenset(n for names in split.other for n in names)
  if not others:
    return fun(x)
  spec = split.other_spec()
  return jax.shard_map(fun, in_specs=spec, out_specs=spec, axis_names=set(others))(x)


def _gather(x: jax.Array, split: _sharding.SplitSpec) -> jax.Array:
  """An FSDP shard all-gathered along its data axes (once, before the loop)."""
  if not split.sharded_dims():
    return x

  def gather(x):
    for dim, names in split.sharded_dims():
      x = jax.lax.all_gather(x, names, axis=dim, tiled=True)
    return x

  return _manual_along_others(gather, x, split)


def _reduce_grad(axes: tuple[str, ...]) -> Callable[[jax.Array, Any], jax.Array]:
  """The one reduction of a gradient sum: reduce-scatter along the data axes
  its parameter is sharded over, all-reduce along the others."""

  def reduce(g, split):
    rest = tuple(a for a in axes if a not in split.data_axes_used())
    if not split.sharded_dims():
      return jax.lax.psum(g, rest)

    def scatter(g):
      for dim, names in split.sharded_dims():
        g = jax.lax.psum_scatter(g, names, scatter_dimension=dim, tiled=True)
      return jax.lax.psum(g, rest) if rest else g

    return _manual_along_others(scatter, g, split)

  return reduce


def _sharded_sq_norm(diff_splits: Any) -> Callable[[PyTree], jax.Array]:
  """The whole gradient's squared norm, from leaves some of which are sharded
  along data axes (each summed over the axes it is sharded over)."""

  def sq_norm(normalized):
    groups: dict[frozenset[str], list[jax.Array]] = {}
    splits = jax.tree.leaves(
      diff_splits, is_leaf=lambda s: isinstance(s, _sharding.SplitSpec)
    )
    for g, s in zip(jax.tree.leaves(normalized), splits, strict=True):
      groups.setdefault(s.data_axes_used(), []).append(g)
    total = jnp.zeros((), jnp.float32)
    for used, leaves in groups.items():
      part = _stats.sq_norm(leaves)
      total = total + (jax.lax.psum(part, tuple(sorted(used))) if used else part)
    return total

  return sq_norm


def _reduce_state(state: PyTree, state_in: PyTree, axes: tuple[str, ...]) -> PyTree:
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
  device = jax.lax.axis_index(axes)

  def reduce(new, old):
    if _is_key(new):
      return _final_key(new, old, device, axes)
    if jnp.issubdtype(jnp.result_type(new), jnp.floating):
      return jax.lax.pmean(new, axes)
    return jax.lax.pmax(new, axes)

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


def _final_key(new: Any, old: Any, device: jax.Array, axes: tuple[str, ...]) -> Any:
  """``old`` if device 0 left its key as it got it, else device 0's key."""
  new_data = jax.random.key_data(new)
  got = jax.random.key_data(_fold_key(old, device))
  on_zero = device == 0
  changed = jax.lax.psum((on_zero & jnp.any(new_data != got)).astype(jnp.int32), axes)
  key_zero = jax.lax.psum(jnp.where(on_zero, new_data, 0), axes)
  data = jnp.where(changed > 0, key_zero, jax.random.key_data(old))
  return jax.random.wrap_key_data(data, impl=jax.random.key_impl(old))
