"""The step skeleton: the five moves every data-parallel step makes.

1. :meth:`Step.place`: each differentiated leaf as the loop takes it
   (:meth:`Step.before_loop`: as it is, gathered, cast and gathered, copied
   per device, typed ``reduced``);
2. :meth:`Step.loop`: the engine's ``lax.scan`` over the micro-batches, with
   this step's :meth:`Step.micro_step`;
3. :meth:`Step.hold`: in each micro step, the leaves whose gather belongs in
   the loop pass an optimization barrier;
4. :meth:`Step.accumulator`: each micro-batch's gradient summed into an
   accumulator laid out as :meth:`Step.leaf_sum` says
   (:func:`jaxaccum._accumulator.accumulator`);
5. :meth:`Step.reduce`: once, after the loop, each sum into the parameter's
   sharding (:meth:`Step.after_loop`), then the engine's normalization.

The per-device view (:mod:`~jaxaccum._parallel.device_view`), the global
view (:mod:`~jaxaccum._parallel.global_view`) and plain ``jit`` on JAX's
types (:mod:`~jaxaccum._parallel.unreduced`) fill in the moves; each leaf's
:class:`~jaxaccum._parallel.placement.Placement` says what they do with it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxaccum import _accumulator, _engine, _exact_plan, _split
from jaxaccum._engine import Engine
from jaxaccum._parallel import placement as _placement
from jaxaccum._parallel import types as _types
from jaxaccum._parallel.placement import Placement

PyTree = Any


class Step:
  """One traced data-parallel step of ``engine``, each leaf placed as
  ``placements`` say (one per leaf of the differentiated arguments), its
  batch split as ``split`` says. ``step(args, kwargs)`` gives the
  :class:`~jaxaccum._engine.Result`."""

  def __init__(
    self,
    engine: Engine,
    placements: Sequence[Placement],
    split: _split.MicroBatching,
  ):
    self.engine = engine
    self.options = engine.options
    self.placements = tuple(placements)
    self.split = split

  #: Whether ``fun`` sees one device's rows: its loss is then read on the
  #: whole batch's micro-batch where ``fun`` traces there
  #: (:meth:`jaxaccum._engine.Engine.made_exact`).
  per_device = False

  def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _engine.Result:
    diff_args = tuple(args[n] for n in self.options.argnums)
    paths = [
      jax.tree_util.keystr(path)
      for path, _ in jax.tree_util.tree_leaves_with_path(diff_args)
    ]
    self.placements = _placement.combined(
      self.placements, self.engine.rules(diff_args), paths
    )
    seen = as_fun_sees(args, self.options, self.placements)
    self.engine = self.engine.made_exact(
      seen, kwargs, self.split, per_device=self.per_device
    )
    placed = self.place(args)
    try:
      sums = self.loop(placed, kwargs)
    except _exact_plan.OtherSums as error:  # traced again, with equal weights
      self.engine = dataclasses.replace(self.engine, exact=None, unread=error)
      sums = self.loop(placed, kwargs)
    if self.engine.unread is not None:  # fun traced on its rows: say why once
      _engine.warn_unread(self.engine.unread)
    return self.reduce(sums, args)

  # -- 1. place the leaves before the loop --------------------------------------

  def place(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``args`` with each differentiated leaf as the loop takes it."""
    return self.with_leaves(self.before_loop, args)

  def before_loop(self, x: jax.Array, p: Placement) -> jax.Array:
    """One leaf as the loop takes it (by default, as it is)."""
    del p
    return x

  def with_leaves(
    self, fun: Callable[[jax.Array, Placement], jax.Array], args: tuple[Any, ...]
  ) -> tuple[Any, ...]:
    """``args`` with ``fun(leaf, placement)`` for each differentiated leaf."""
    return with_leaves(fun, args, self.options.argnums, self.placements)

  # -- 2. enter the loop ------------------------------------------------------------

  def loop(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _engine.Sums:
    """The engine's loop over the micro-batches of ``args`` (the leaves
    placed), with this step's micro step and accumulator."""
    return self.engine.sums(
      args,
      kwargs,
      self.split,
      step=self.micro_step(args, kwargs),
      accumulator=self.accumulator(),
    )

  def micro_step(
    self, args: tuple[Any, ...], kwargs: dict[str, Any]
  ) -> Callable[..., Any]:
    """``step(diff_args, micro, index, state) -> (MicroOut, grads)``: the
    engine's micro step on the global micro-batch, the leaves held
    (:meth:`hold`) on entry."""
    split = self.split
    base = self.engine.micro.step(
      args, kwargs, split, split.num_micro_batches, split.micro_batch_size
    )

    def step(diff_args, micro, index, state):
      return base(self.hold(diff_args, index), micro, index, state)

    return step

  # -- 3. hold the barrier ----------------------------------------------------------

  def hold(self, diff_args: PyTree, index: jax.Array) -> PyTree:
    """The leaves whose placement asks for it through an optimization
    barrier with the micro-batch index (:func:`barrier`)."""
    return barrier(diff_args, [p.barrier for p in self.placements], index)

  # -- 4. sum -----------------------------------------------------------------------

  def accumulator(self) -> _accumulator.Accumulator:
    """Float32 (or wider) sums, each leaf's kept as :meth:`leaf_sum` says."""
    return _accumulator.accumulator(
      self.options.accum_dtype,
      [self.leaf_sum(p) for p in self.placements],
      [p.combine for p in self.placements],
    )

  def leaf_sum(self, p: Placement) -> _accumulator.LeafSum:
    """How the sum of a leaf placed as ``p`` is kept (by default, as the
    gradients come)."""
    del p
    return _accumulator.LeafSum()

  # -- 5. reduce once, after the loop ----------------------------------------------

  def reduce(self, sums: _engine.Sums, args: tuple[Any, ...]) -> _engine.Result:
    """Each sum into its parameter's sharding (:meth:`after_loop`), then
    normalized (``args`` are the step's arguments, as they came)."""
    diff_args = tuple(args[n] for n in self.options.argnums)
    grads = self.map(self.after_loop, sums.grads, diff_args)
    return self.engine.finish(sums._replace(grads=grads), diff_args, args)

  def after_loop(self, acc: jax.Array, x: jax.Array, p: Placement) -> jax.Array:
    """One leaf's sum ``acc`` into the sharding of its parameter ``x`` (by
    default, as it is)."""
    del x, p
    return acc

  def map(self, fun: Callable[..., Any], *trees: PyTree) -> PyTree:
    """``fun(*leaves, placement)`` over the leaves of ``trees`` (shaped like
    the differentiated arguments) and their placements."""
    return _placement.each(fun, self.placements, *trees)


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


def as_fun_sees(
  args: tuple[Any, ...], options: Any, placements: Sequence[Placement]
) -> tuple[Any, ...]:
  """``args`` with each leaf gathered before the loop (``fsdp_gather``
  ``"once"`` or ``"cast_once"``) gathered, and cast, as ``fun`` sees it
  there: what the loss is read on (:meth:`jaxaccum._engine.Engine.made_exact`)."""

  def seen(x: jax.Array, p: Placement) -> jax.Array:
    if p.before_loop == "as_is" or p.spec is None:
      return x
    if p.before_loop == "cast_gather":
      x = x.astype(options.gather_dtype)
    return _types.constrain(x, p.spec.other_spec())

  return with_leaves(seen, args, options.argnums, placements)


def with_leaves(
  fun: Callable[[jax.Array, Placement], jax.Array],
  args: tuple[Any, ...],
  argnums: Sequence[int],
  placements: Sequence[Placement],
) -> tuple[Any, ...]:
  """``args`` with ``fun(leaf, placement)`` for each leaf of the
  differentiated arguments ``argnums``."""
  call_args = list(args)
  diff_args = tuple(args[n] for n in argnums)
  for n, x in zip(argnums, _placement.each(fun, placements, diff_args), strict=True):
    call_args[n] = x
  return tuple(call_args)
