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
  with the gradients, after the loop (:meth:`_reduced._Walk.value`).
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
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxaccum import _compat, _engine, _normalize, _split
from jaxaccum._engine import Engine
from jaxaccum._parallel import reduced as _reduced

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
      mesh = jax.typeof(x).sharding.mesh
      explicit = {
        a
        for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if t == AxisType.Explicit
      }
      axes += [a for a in _names(spec.partitions[0]) if a in explicit and a not in axes]
  return tuple(axes)


def applies(options: Any, num_micro_batches: int) -> bool:
  """Whether a plain-``jit`` step on a batch with data axes takes this path:
  a loop (``k >= 2``) whose micro steps need no whole micro-batch gradient
  (``noise_stats`` measures each one's norm, ``clip_per_example`` each
  example's)."""
  return (
    num_micro_batches > 1
    and not options.noise_stats
    and options.clip_per_example is None
  )


class Leaf(NamedTuple):
  """How one differentiated leaf enters the loop and is accumulated.

  Attributes:
    spec: the leaf's own ``PartitionSpec`` (its type's), or None for a leaf
      with no Explicit sharding, left to the partitioner.
    reduced: the data axes it is ``reduced`` over in the loop (its gradient
      comes back ``unreduced`` over them).
    gather: ``"as_is"``, ``"gather"`` (over its data axes, before the loop)
      or ``"cast_gather"`` (cast to ``gather_dtype`` first).
    accumulator: the accumulator's ``PartitionSpec``.
    barrier: sharded over data axes in the loop: it passes an optimization
      barrier, so that its gather stays in the loop (:func:`barrier`).
  """

  spec: P | None
  reduced: frozenset[str]
  gather: str
  accumulator: P | None
  barrier: bool = False


def plan_leaf(x: Any, axes: tuple[str, ...], mode: str, reducible: bool) -> Leaf:
  """The :class:`Leaf` for ``x`` with the batch on data ``axes`` under
  ``fsdp_gather=mode``; ``reducible`` says whether some use of it in
  ``fun`` keeps it ``reduced`` (:meth:`jaxaccum._parallel.reduced.Evaluated.probe`)."""
  spec = _compat.explicit_spec(x)
  if spec is None:
    return Leaf(None, frozenset(), "as_is", None)
  used = _uses(spec, axes)
  if used and mode == "per_micro_batch":
    # HSDP's replica axes stay with the partitioner too: JAX types a
    # weight's cotangent from a contraction over rows sharded over
    # (replica, fsdp) as unreduced over all of them or none.
    return Leaf(spec, spec.reduced, "as_is", P(*spec.partitions), barrier=True)
  gather = "as_is" if not used else "gather" if mode == "once" else "cast_gather"
  inside = _gathered(spec, axes)
  if not reducible:  # the partitioner reduces each micro-batch's gradient
    return Leaf(spec, frozenset(), gather, P(*inside.partitions))
  reduced = frozenset(axes)
  if gather == "cast_gather":  # reduce-scattered into a sharded sum
    return Leaf(spec, reduced, gather, P(*spec.partitions))
  return Leaf(spec, reduced | spec.reduced, gather, _typed(inside, unreduced=reduced))


class UnreducedStep:
  """The step of the module docstring, for an :class:`Engine` whose batch
  lies on data ``axes`` of an Explicit mesh."""

  def __init__(self, engine: Engine, axes: tuple[str, ...]):
    self.engine = engine
    self.options = engine.options
    self.axes = axes

  def __call__(
    self, args: tuple[Any, ...], kwargs: dict[str, Any], split: Any
  ) -> _engine.Result:
    o = self.options
    diff_args = tuple(args[n] for n in o.argnums)
    flat = jax.tree.leaves(diff_args)
    engine, reducible = self._reducible(args, kwargs, split, flat)
    leaves = [
      plan_leaf(x, self.axes, o.fsdp_gather, r)
      for x, r in zip(flat, reducible, strict=True)
    ]
    call_args = list(args)
    entered = self._map(self._enter, leaves, diff_args)
    for n, placed in zip(o.argnums, entered, strict=True):
      call_args[n] = placed
    base = engine.micro_step(
      tuple(call_args), kwargs, split, split.num_micro_batches, split.micro_batch_size
    )
    held = [leaf.barrier for leaf in leaves]

    def step(diff, micro, index, state):
      return base(barrier(diff, held, index), micro, index, state)

    sums = engine.sums(
      tuple(call_args), kwargs, split, step=step, accumulator=self._accumulator(leaves)
    )
    if jax.typeof(sums.loss).sharding.spec.unreduced:  # the losses' one sum
      sums = sums._replace(loss=all_reduce(sums.loss), losses=all_reduce(sums.losses))
    grads = self._map(self._reduce, leaves, sums.grads)
    return self.engine.finish(sums._replace(grads=grads), diff_args)

  def _reducible(
    self, args: tuple[Any, ...], kwargs: dict[str, Any], split: Any, flat: list[Any]
  ) -> tuple[Engine, list[bool]]:
    """The engine whose ``fun`` takes ``reduced`` leaves
    (:class:`jaxaccum._parallel.reduced.Evaluated`), and which leaves some use of
    ``fun``'s keeps reduced: those enter the loop reduced. Probed on the
    shapes of one micro-batch (nothing of it is computed)."""
    o = self.options
    # the split's own checks first (a micro-batch that does not divide over
    # the devices of its rows), as the loop would meet them
    _split.MicroBatches(tuple(args[n] for n in o.batch_argnums), split)
    fun = _reduced.Evaluated(self.engine.fun, self.axes)
    engine = dataclasses.replace(self.engine, fun=fun)
    loss = engine.micro_loss(args, kwargs, split, split.num_micro_batches)
    m = split.micro_batch_size

    def probe(x):
      aval = jax.typeof(x)
      return jax.ShapeDtypeStruct((m, *x.shape[1:]), x.dtype, sharding=aval.sharding)

    micro = tuple(jax.tree.map(probe, args[n]) for n in o.batch_argnums)
    state = None if o.state_argnum is None else args[o.state_argnum]
    index = jax.ShapeDtypeStruct((), jnp.int32)
    diff_args = tuple(args[n] for n in o.argnums)
    entry = [plan_leaf(x, self.axes, o.fsdp_gather, True) for x in flat]
    try:
      kept = fun.probe(
        lambda *a: loss(*a)[0],
        lambda diff: self._map(self._enter, entry, diff),
        diff_args,
        micro,
        index,
        state,
      )
    except Exception as error:  # a program the walk does not know
      warnings.warn(
        "jaxaccum could not read fun's uses of its parameters, so this step "
        "reduces every micro-batch's gradient, as plain jit does. Please "
        f"report it. The walk said: {type(error).__name__}: {error}",
        stacklevel=4,
      )
      return self.engine, [False] * len(flat)
    return (engine if any(kept) else self.engine), kept

  # -- the leaves in the loop, their accumulators, the one reduction --------

  def _enter(self, x: jax.Array, leaf: Leaf) -> jax.Array:
    """``x`` as the loop takes it: gathered (and cast) where ``leaf`` says,
    then ``reduced`` over its replica axes (no data moves)."""
    if leaf.spec is None:
      return x
    spec = leaf.spec
    if leaf.gather != "as_is":
      if leaf.gather == "cast_gather":
        x = x.astype(self.options.gather_dtype)
      spec = _gathered(spec, self.axes)
      x = _reshard(x, spec)
    if not leaf.reduced:
      return x
    return _reshard(x, _typed(spec, reduced=leaf.reduced))

  def _accumulator(self, leaves: list[Leaf]) -> _engine.Accumulator:
    """Float32 (or wider) sums typed as each leaf's ``accumulator`` says."""
    dtype = self.options.accum_dtype

    def fold(g, leaf, acc=None):
      g = g.astype(_normalize.accumulator_dtype(dtype, g) if acc is None else acc.dtype)
      if leaf.accumulator is not None:
        g = _reshard(g, leaf.accumulator)
      return g if acc is None else acc + g

    def init(diff):
      return self._map(lambda x, leaf: fold(jnp.zeros_like(x), leaf), leaves, diff)

    return _engine.Accumulator(
      init=init,
      first=lambda grads: self._map(fold, leaves, grads),
      add=lambda acc, grads: self._map(
        lambda a, g, leaf: fold(g, leaf, a), leaves, acc, grads
      ),
    )

  def _reduce(self, acc: jax.Array, leaf: Leaf) -> jax.Array:
    """The accumulator in the parameter's own sharding: the step's one
    reduction of an ``unreduced`` sum (an all-reduce, or for a leaf
    gathered once a reduce-scatter)."""
    if leaf.spec is None or jax.typeof(acc).sharding.spec == leaf.spec:
      return acc
    spec = jax.typeof(acc).sharding.spec
    if spec.unreduced and spec.partitions == leaf.spec.partitions:
      return all_reduce(acc)
    return _reshard(acc, leaf.spec)

  def _map(self, fun: Callable[..., Any], leaves: list[Leaf], *trees: PyTree) -> PyTree:
    flat = [jax.tree.flatten(t) for t in trees]
    out = [
      fun(*xs, leaf) for *xs, leaf in zip(*(f[0] for f in flat), leaves, strict=True)
    ]
    return jax.tree.unflatten(flat[0][1], out)


def all_reduce(x: jax.Array) -> jax.Array:
  """``x``, ``unreduced`` over some axes, summed over them: one all-reduce
  over all of them together (a reshard, on jax 0.12, reduces over one axis
  after the other, each time the whole array)."""
  sharding = jax.typeof(x).sharding
  spec = sharding.spec
  axes = tuple(a for a in sharding.mesh.axis_names if a in spec.unreduced)
  return jax.shard_map(
    lambda local: jax.lax.psum(local, axes),
    mesh=sharding.mesh,
    in_specs=spec,
    out_specs=P(*spec.partitions),
  )(x)


def barrier(diff_args: PyTree, held: list[bool], index: jax.Array) -> PyTree:
  """The leaves marked in ``held`` pass an optimization barrier with the
  micro-batch index: otherwise XLA sees a loop-invariant gather of an FSDP
  weight and hoists it out of the loop, holding every full weight through
  it."""
  leaves, treedef = jax.tree.flatten(diff_args)
  kept = [x for x, h in zip(leaves, held, strict=True) if h]
  if not kept:
    return diff_args
  kept, _ = jax.lax.optimization_barrier((kept, index))
  it = iter(kept)
  return jax.tree.unflatten(
    treedef, [next(it) if h else x for x, h in zip(leaves, held, strict=True)]
  )


def _reshard(x: jax.Array, spec: P) -> jax.Array:
  """``x`` resharded to ``spec`` on its own mesh (no mesh context needed)."""
  return jax.sharding.reshard(x, jax.typeof(x).sharding.update(spec=spec))


def _typed(
  spec: P,
  reduced: frozenset[str] = frozenset(),
  unreduced: frozenset[str] = frozenset(),
) -> P:
  """``spec``'s partitions with ``reduced`` and ``unreduced`` axes."""
  return P(*spec.partitions, reduced=set(reduced), unreduced=set(unreduced))


def _uses(spec: P, axes: tuple[str, ...]) -> frozenset[str]:
  """The ``axes`` that ``spec`` shards a dimension over."""
  return frozenset(n for e in spec.partitions for n in _names(e) if n in axes)


def _gathered(spec: P, axes: tuple[str, ...]) -> P:
  """``spec`` without the data ``axes``: the leaf gathered over them."""
  return P(*(_without(e, set(axes)) for e in spec.partitions))


def _without(entry: Any, axes: set[str]) -> Any:
  names = tuple(n for n in _names(entry) if n not in axes)
  if not names:
    return None
  return names[0] if len(names) == 1 else names


def _names(entry: Any) -> tuple[str, ...]:
  if entry is None or entry is P.UNCONSTRAINED:
    return ()
  return entry if isinstance(entry, tuple) else (entry,)


def local(
  engine: Engine, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> _engine.Result:
  """Plain ``jit``'s step: on a batch with data axes (:func:`data_axes`)
  the step of the module docstring where it :func:`applies`, else the
  engine's own, whose reductions the partitioner places."""
  axes = data_axes(engine.options, args)
  _compat.refuse_jax_bugs(engine.fun, engine.options, args, kwargs, data_axes=axes)
  if not axes:
    return engine.local(args, kwargs)
  engine.check_args(args)
  split = engine.plan(args)
  if not applies(engine.options, split.num_micro_batches):
    return engine.local(args, kwargs)
  return run_or_fall_back(engine, axes, args, kwargs, split, fallback=engine.local)


def run_or_fall_back(
  engine: Engine,
  axes: tuple[str, ...],
  args: tuple[Any, ...],
  kwargs: dict[str, Any],
  split: Any,
  *,
  fallback: Callable[[tuple[Any, ...], dict[str, Any]], _engine.Result],
) -> _engine.Result:
  """:class:`UnreducedStep`; where JAX refuses a ``reduced`` leaf in a use
  :mod:`jaxaccum._parallel.reduced` let through, a warning and ``fallback`` (the
  partitioner's step, which reduces every micro-batch)."""
  try:
    return UnreducedStep(engine, axes)(args, kwargs, split)
  except _REFUSALS as error:
    text = str(error)
    if "reduced" not in text:  # not about JAX's types: the user's error
      raise
  warnings.warn(
    "jaxaccum: JAX refused a parameter typed reduced (replicated over the "
    f"batch's axes {axes}, its cotangent unreduced) in a use of fun's, so "
    "this step reduces every micro-batch's gradient, as plain jit does. JAX "
    f"said: {text.splitlines()[0]}",
    stacklevel=3,
  )
  return fallback(args, kwargs)


#: What JAX raises when it refuses a type (its ``ShardingTypeError``, or a
#: rule it lacks) or a ``reshard`` of one (a ``ValueError``).
_REFUSALS: tuple[type[Exception], ...] = (*_compat.SHARDING_TYPE_ERRORS, ValueError)
