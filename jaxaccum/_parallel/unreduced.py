"""Plain ``jit`` on an Explicit mesh: data parallelism on JAX's own sharding
types, one gradient reduction per step.

Accumulating under plain ``jit`` over a sharded batch leaves the reductions
to the partitioner, which all-reduces a replicated parameter's gradient
inside the loop, ``k`` times per step. On a mesh whose batch axes are
Explicit the types say more, and JAX's ``reduced`` and ``unreduced`` axes
say what the step needs:

- **The data axes** are the Explicit axes the batch's leading dimension is
  sharded over, read from the batch leaves' types (:func:`data_axes`).
- **A leaf replicated over them** (a replicated or tensor-parallel
  parameter) is made ``reduced`` over them on entry: no data moves, and its
  cotangent comes back ``unreduced``, each device holding its own rows'
  share. The float32 accumulator is ``unreduced`` too, so each micro-batch
  is added where it was computed, and one reshard into the parameter's own
  sharding after the loop is the step's one reduction. ``fun`` is
  evaluated from its jaxpr with each use of such a leaf rewritten into one
  JAX types (:mod:`jaxaccum._parallel.reduced`): a bias or a norm's scale is
  broadcast into the activations' rows, an embedding table gathered by
  them, and a use that has no rows (a penalty on the weights alone) takes
  the leaf made plain.
- **The loss**, a sum over the rows, is left ``unreduced`` too and reduced
  with the gradients, after the loop (:meth:`jaxaccum._parallel.reduced._Walk.plain`).
- **A leaf sharded over a data axis** (FSDP) keeps its modes
  (``fsdp_gather``): ``"per_micro_batch"`` leaves it as it is, so that each
  micro-batch's gradient is reduce-scattered where plain ``jit`` would,
  with an optimization barrier that keeps its gather inside the loop (HSDP's
  replica axes are reduced there too: JAX types a contraction's result as
  unreduced over all the axes its rows are sharded over, or none).
  ``"cast_once"`` casts and gathers it before the
  loop and reduce-scatters each micro-batch's gradient into a sharded
  accumulator; ``"once"`` gathers it before the loop, accumulates
  ``unreduced`` and reduce-scatters once after it.

``fun`` runs on the user's mesh with its own axis types, as under
``jax.value_and_grad``: its constraints and ``out_sharding``\\ s work as
written, and every rewrite is JAX's own typing of the same sums. An
unreduced value is only ever added to or scaled by a replicated factor: the
normalization, the skip of a non-finite step and every other decision read
the reduced gradients and loss after the loop. Steps that need a statistic of each micro-batch's
whole gradient (``noise_stats``, ``clip_per_example``) and one-micro-batch
steps keep plain ``jit``'s reductions (:func:`applies`).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxaccum import _accumulator, _compat, _engine, _split
from jaxaccum._engine import Engine
from jaxaccum._parallel import placement as _placement
from jaxaccum._parallel import reduced as _reduced
from jaxaccum._parallel import skeleton as _skeleton
from jaxaccum._parallel import specs as _specs
from jaxaccum._parallel import types as _types
from jaxaccum._parallel.placement import Placement
from jaxaccum._parallel.skeleton import Step

PyTree = Any


def data_axes(options: Any, args: tuple[Any, ...]) -> tuple[str, ...]:
  """The Explicit mesh axes the batch's leading dimension is sharded over,
  in the order the batch leaves name them; ``()`` for a batch replicated
  over every axis, on Auto axes or on no mesh (then the step is plain
  ``jit``'s, with the partitioner's reductions)."""
  axes: list[str] = []
  for n in options.batch_argnums:
    for x in jax.tree.leaves(args[n]):
      spec = _compat.explicit_spec(x)
      if spec is None or not jnp.ndim(x) or not spec.partitions:
        continue
      explicit = _types.explicit_axes(jax.typeof(x).sharding.mesh)
      axes += [
        a for a in _specs.names(spec.partitions[0]) if a in explicit and a not in axes
      ]
  return tuple(axes)


def applies(options: Any, num_micro_batches: int) -> bool:
  """Whether a plain-``jit`` step on a batch with data axes takes this path:
  a loop (``k >= 2``) whose micro steps need no whole micro-batch gradient
  (``noise_stats`` measures each one's norm, ``clip_per_example`` each
  example's)."""
  return num_micro_batches > 1 and not options.noise_stats and options.rule is None


def run(
  engine: Engine,
  axes: tuple[str, ...],
  args: tuple[Any, ...],
  kwargs: dict[str, Any],
  split: _split.MicroBatching,
) -> _engine.Result:
  """The step of the module docstring for ``engine``, whose batch lies on
  data ``axes`` of an Explicit mesh: each leaf placed
  (:func:`jaxaccum._parallel.placement.on_types`) as the probe of ``fun``'s
  uses finds it (:func:`reducible`)."""
  o = engine.options
  flat = jax.tree.leaves(tuple(args[n] for n in o.argnums))
  entry = [_placement.on_types(x, axes, o.fsdp_gather, True) for x in flat]
  seen = _skeleton.as_fun_sees(args, o, entry)
  engine = engine.made_exact(seen, kwargs, split)  # the user's fun, read
  engine, kept = reducible(engine, axes, args, kwargs, split)
  # a leaf that is not summed (an FP8 amax) never enters reduced: its
  # unreduced cotangent would be summed over the devices
  rules = engine.rules(tuple(args[n] for n in o.argnums))
  kept = [k and r.summed for k, r in zip(kept, rules, strict=True)]
  placements = [
    _placement.on_types(x, axes, o.fsdp_gather, r)
    for x, r in zip(flat, kept, strict=True)
  ]
  return UnreducedStep(engine, placements, split)(args, kwargs)


def reducible(
  engine: Engine,
  axes: tuple[str, ...],
  args: tuple[Any, ...],
  kwargs: dict[str, Any],
  split: _split.MicroBatching,
) -> tuple[Engine, list[bool]]:
  """The engine whose ``fun`` takes ``reduced`` leaves
  (:class:`jaxaccum._parallel.reduced.Evaluated`), and which leaves some
  use of ``fun``'s keeps reduced: those enter the loop reduced. Probed on
  the shapes of one micro-batch (nothing of it is computed)."""
  o = engine.options
  # the split's own checks first (a micro-batch that does not divide over
  # the devices of its rows), as the loop would meet them
  _split.MicroBatches(tuple(args[n] for n in o.batch_argnums), split)
  fun = _reduced.Evaluated(engine.fun, axes)
  evaluated = dataclasses.replace(engine, fun=fun)
  # fun's own uses, probed without the exact plan's objective (which traces
  # fun apart to find its sums, out of the probe's sight)
  plain = dataclasses.replace(evaluated, exact=None)
  loss = plain.micro.loss(args, kwargs, split, split.num_micro_batches)
  m = split.micro_batch_size

  def probe(x):
    aval = jax.typeof(x)
    return jax.ShapeDtypeStruct((m, *x.shape[1:]), x.dtype, sharding=aval.sharding)

  micro = tuple(jax.tree.map(probe, args[n]) for n in o.batch_argnums)
  state = None if o.state_argnum is None else args[o.state_argnum]
  index = jax.ShapeDtypeStruct((), jnp.int32)
  diff_args = tuple(args[n] for n in o.argnums)
  entry = [
    _placement.on_types(x, axes, o.fsdp_gather, True)
    for x in jax.tree.leaves(diff_args)
  ]
  # A use the walk cannot rewrite takes its leaf plain there alone; an
  # error here is fun's own (JAX's, as under jax.value_and_grad).
  kept = fun.probe(
    lambda *a: loss(*a)[0],
    lambda diff: _placement.each(lambda x, p: enter(x, p, o.gather_dtype), entry, diff),
    diff_args,
    micro,
    index,
    state,
  )
  return (evaluated if any(kept) else engine), kept


class UnreducedStep(Step):
  """The step of the module docstring, its leaves placed by
  :func:`jaxaccum._parallel.placement.on_types`."""

  def before_loop(self, x: jax.Array, p: Placement) -> jax.Array:
    """``x`` as the loop takes it (:func:`enter`)."""
    return enter(x, p, self.options.gather_dtype)

  def leaf_sum(self, p: Placement) -> _accumulator.LeafSum:
    """Each micro-batch's gradient resharded into the accumulator's type
    (``unreduced`` where the leaf entered ``reduced``) before it is added."""
    spec = p.accumulator
    if spec is None:
      return _accumulator.LeafSum()
    return _accumulator.LeafSum(term=lambda g: _types.reshard(g, spec))

  def reduce(self, sums: _engine.Sums, args: tuple[Any, ...]) -> _engine.Result:
    """The losses' one sum, and the aux's (an exact step's sums over rows),
    where they are ``unreduced``, then each gradient's (:meth:`after_loop`)."""
    checked = self.options.value_checks

    def reduced(x: Any) -> Any:
      spec = _compat.explicit_spec(x)
      return all_reduce(x, checked) if spec is not None and spec.unreduced else x

    aux = sums.aux
    if self.engine.exact is not None:  # its sums over rows ride with the aux
      aux, parts = aux
      parts = [reduced(jnp.sum(p, axis=0, keepdims=True)) for p in parts]
      aux = (jax.tree.map(reduced, aux), parts)
    else:
      aux = jax.tree.map(reduced, aux)
    sums = sums._replace(loss=reduced(sums.loss), losses=reduced(sums.losses), aux=aux)
    return super().reduce(sums, args)

  def after_loop(self, acc: jax.Array, x: jax.Array, p: Placement) -> jax.Array:
    """The accumulator in the parameter ``x``'s own sharding: the step's one
    reduction of an ``unreduced`` sum (an all-reduce, or for a leaf
    gathered once a reduce-scatter)."""
    del p
    own = _compat.explicit_spec(x)
    if own is None or jax.typeof(acc).sharding.spec == own:
      return acc
    spec = jax.typeof(acc).sharding.spec
    if spec.unreduced and spec.partitions == own.partitions:
      return all_reduce(acc, self.options.value_checks)
    return _types.reshard(acc, own)


def enter(x: jax.Array, p: Placement, gather_dtype: Any) -> jax.Array:
  """``x`` as the loop takes it: gathered (and cast to ``gather_dtype``)
  where ``p`` says, then ``reduced`` over its copies' axes (no data
  moves)."""
  spec = _compat.explicit_spec(x)
  if p.spec is None or spec is None:
    return x
  if p.before_loop != "as_is":
    if p.before_loop == "cast_gather":
      x = x.astype(gather_dtype)
    spec = p.spec.other_spec()
    x = _types.reshard(x, spec)
  if not p.copies:
    return x
  return _types.reshard(x, _specs.typed(spec, reduced=p.copies))


def all_reduce(x: jax.Array, checked: bool = False) -> jax.Array:
  """``x``, ``unreduced`` over some axes, summed over them: one all-reduce
  over all of them together (a reshard, on jax 0.12, reduces over one axis
  after the other, each time the whole array). Under ``checkify``
  (``checked``, ``value_checks=True``) a reshard: checkify's ``shard_map``
  rule builds its error flags in the Explicit context mesh, which JAX
  refuses inside the Manual region."""
  sharding = jax.typeof(x).sharding
  spec = sharding.spec
  if checked:
    return _types.reshard(x, P(*spec.partitions))
  axes = tuple(a for a in sharding.mesh.axis_names if a in spec.unreduced)
  return jax.shard_map(
    lambda local: jax.lax.psum(local, axes),
    mesh=sharding.mesh,
    in_specs=spec,
    out_specs=P(*spec.partitions),
  )(x)


def partitioned(
  engine: Engine, axes: tuple[str, ...], split: _split.MicroBatching
) -> Callable[[tuple[Any, ...], dict[str, Any]], _engine.Result]:
  """``run(args, kwargs)``: plain ``jit``'s step where the partitioner places
  every reduction (:func:`applies` is false, or JAX refused a type): the
  engine's own loop, each FSDP leaf entering it as ``fsdp_gather`` says
  (``"cast_once"``'s cast to ``gather_dtype`` and gathered before the
  loop, as on this path's other steps) and its gradient then in the
  parameter's sharding. With no FSDP cast, the engine's own step."""
  o = engine.options
  if o.fsdp_gather != "cast_once":
    return engine.local

  def run(args: tuple[Any, ...], kwargs: dict[str, Any]) -> _engine.Result:
    _engine.check_noise_estimable(o, split.num_micro_batches)
    placements = [
      _placement.on_types(x, axes, o.fsdp_gather, False)
      for x in jax.tree.leaves(tuple(args[n] for n in o.argnums))
    ]
    return UnreducedStep(engine, placements, split)(args, kwargs)

  return run


def run_or_fall_back(
  engine: Engine,
  axes: tuple[str, ...],
  args: tuple[Any, ...],
  kwargs: dict[str, Any],
  split: _split.MicroBatching,
  *,
  fallback: Callable[[tuple[Any, ...], dict[str, Any]], _engine.Result],
) -> _engine.Result:
  """:func:`run`. Each use the walk rewrites is checked where it
  is made, forward and backward (:mod:`jaxaccum._parallel.reduced`), and a
  use JAX refuses takes its leaf plain there alone; should JAX still refuse
  a ``reduced`` leaf in the step (a jaxaccum bug), a warning asking for a
  report and ``fallback``, the partitioner's step, as the last resort."""
  try:
    return run(engine, axes, args, kwargs, split)
  except _REFUSALS as error:
    text = str(error)
    if "reduced" not in text:  # not about JAX's types: the user's error
      raise
  warnings.warn(
    "jaxaccum: JAX refused a parameter typed reduced (replicated over the "
    f"batch's axes {axes}, its cotangent unreduced) in a use of fun's, so "
    "this step reduces every micro-batch's gradient, as plain jit does. "
    f"Please report it. JAX said: {text.splitlines()[0]}",
    stacklevel=3,
  )
  return fallback(args, kwargs)


#: What JAX raises when it refuses a type (its ``ShardingTypeError``, or a
#: rule it lacks) or a ``reshard`` of one (a ``ValueError``).
_REFUSALS: tuple[type[Exception], ...] = (*_compat.SHARDING_TYPE_ERRORS, ValueError)
