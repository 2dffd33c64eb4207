"""The scan engine that everything else builds on.

One traced step splits the batch into ``k`` micro-batches (``_split``), runs
forward and backward on each inside a ``lax.scan``, and adds each gradient
into an accumulator of at least ``accum_dtype`` (float32 by default). The
per-micro-batch losses and weights leave the scan as ``k`` scalars; the
normalization mode (``_normalize``) turns the sums into the result once,
after the loop.

The step is a story in three chapters, each a method of :class:`Engine`:

1. :meth:`Engine.plan`: validate the batch and resolve ``k`` and ``m``;
2. :meth:`Engine.sums`: the loop, which returns raw :class:`Sums`, each
   micro-batch's forward and backward pass :attr:`Engine.micro`'s
   (:mod:`jaxaccum._micro`);
3. :meth:`Engine.finish`: normalize them into a :class:`Result`, and combine
   the aux of the micro-batches (:mod:`jaxaccum._aux`).

The data-parallel path (``_parallel``) runs the same loop with one block of
the batch per device, ``vmap``-ped over the devices: it passes its own micro
step and accumulator (:mod:`jaxaccum._accumulator`, where every path's
accumulator is built), and reduces over the devices between chapters 2 and
3. The public wrappers (``_value_and_grad``), the data-parallel path and
``verify_equivalence`` build on this module; it imports none of them.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from jaxaccum import (
  _accumulator,
  _aux,
  _checks,
  _compat,
  _exact_plan,
  _micro,
  _noise_scale,
  _split,
  _tree,
)
from jaxaccum._accumulator import Accumulator
from jaxaccum._accumulator import accumulator as new_accumulator
from jaxaccum._options import Options

PyTree = Any


class GradientRule(Protocol):
  """How a micro-batch's gradient is formed, where it is not
  ``jax.value_and_grad`` of ``fun`` on the micro-batch: a feature gives the
  engine one through the options (``Options.rule``; DP-SGD's
  ``jaxaccum.ClipPerExample`` is one), and the engine, the data-parallel
  steps and the split read no option of it.

  Attributes:
    whole_gradients: whether the rule needs each example's whole gradient
      on the device that holds the example (a leaf sharded over the data
      axes is then gathered once per step).
  """

  whole_gradients: bool

  def check_value(self, value: Any, options: Options) -> None:
    """Checks ``fun``'s value (a scalar per example)."""

  def value_and_grad(
    self, loss_fn: Callable[..., Any], options: Options, kwargs: dict[str, Any]
  ) -> Callable[..., Any]:
    """``loss_fn`` (``call_args -> (loss, (weight, aux, state))``) as
    ``call_args -> ((loss, (weight, aux, state)), grads)``, the rule's sum."""
    ...

  def objective(
    self, loss_fn: Callable[..., Any], options: Options, kwargs: dict[str, Any]
  ) -> Callable[..., Any]:
    """The rule as a loss whose gradient (with respect to :meth:`masters`)
    is its sum, for a caller that differentiates several together (the
    devices sharing an FSDP leaf)."""
    ...

  def masters(self, diff_args: PyTree, accum_dtype: Any) -> PyTree:
    """What :meth:`objective` is differentiated with respect to."""
    ...

  def kept_only(self, grads: PyTree, some: jax.Array, accum_dtype: Any) -> PyTree:
    """The sums in the accumulator's dtype, zero where nothing counted."""
    ...


class Sums(NamedTuple):
  """What the micro-batch loop produces, before any normalization.

  Attributes:
    loss: the sum of the micro-batch losses; shape=(), at least ``accum_dtype``.
    grads: the accumulated gradients, one tree per entry of ``argnums``.
    weight: the sum of the micro-batch weights; shape=(), at least float32.
    aux: ``fun``'s aux per micro-batch, each leaf with a leading axis ``k``
      (``(k, S, ...)``, one entry per block, in the data-parallel path, until
      it puts them in the global micro-batch order, ``(S * k, ...)``).
    state: the state after the last micro-batch (None without state).
    losses: the per-micro-batch losses; ``fun``'s loss dtype.
    noise: the noise sums (None unless ``noise_stats``).
    weights: the per-micro-batch weights, laid out like ``aux``'s leading
      axes.
    rows: the rows of one call of ``fun`` (one block's, per block).
    shards: the blocks whose slices one entry of ``aux`` holds (1 per block).
  """

  loss: jax.Array
  grads: tuple[PyTree, ...]
  weight: jax.Array
  aux: PyTree
  state: PyTree
  losses: jax.Array
  noise: _noise_scale.NoiseSums | None
  weights: jax.Array
  rows: int
  shards: int

  @classmethod
  def of(
    cls,
    out: _micro.MicroOut,
    grads: tuple[PyTree, ...],
    state: PyTree,
    split: _split.MicroBatching,
    accum_dtype: Any,
    *,
    per_block: bool,
  ) -> Sums:
    """The loop's sums from its micro-batches' outputs, stacked (``out``),
    the accumulated ``grads`` and the last ``state``."""
    return cls(
      loss=jnp.sum(out.loss.astype(jnp.promote_types(accum_dtype, out.loss.dtype))),
      grads=grads,
      weight=jnp.sum(
        out.weight.astype(jnp.promote_types(jnp.float32, out.weight.dtype))
      ),
      aux=out.aux,
      state=state,
      losses=out.loss,
      noise=None if out.noise is None else _noise_scale.NoiseSums.of(*out.noise),
      weights=out.weight,
      rows=split.micro_batch_size // split.shards
      if per_block
      else split.micro_batch_size,
      shards=1 if per_block else split.shards,
    )


class Result(NamedTuple):
  """One accumulated step, normalized.

  Attributes:
    value: the normalized loss, in ``fun``'s loss dtype.
    aux: the aux, combined over the micro-batches by ``aux=``
      (:mod:`jaxaccum._aux`); ``(aux, final_state)`` with ``state_argnum``.
    grads: one gradient tree per entry of ``argnums``, in the dtypes
      ``jax.grad`` gives.
    noise: the step's :class:`GradientNoise` (None unless ``noise_stats``).
    total_weight: the sum of the weights; shape=(), float32 (or wider).
    sums: with ``clip_per_example``, the clipped sums themselves, one tree
      per entry of ``argnums``, in the accumulator's dtype (float32 or
      wider), before any division or cast: what :func:`jaxaccum.dp_noise`
      adds its noise to (:class:`jaxaccum.ClipRecord`); None otherwise.
  """

  value: jax.Array
  aux: PyTree
  grads: tuple[PyTree, ...]
  noise: _noise_scale.GradientNoise | None
  total_weight: jax.Array
  sums: tuple[PyTree, ...] | None = None

  def arranged(self, options: Options) -> Any:
    """What ``jaxaccum.value_and_grad`` returns: ``(value, grads)``, with
    ``(value, aux)`` for ``has_aux``, the grads as one tree for an integer
    ``argnums``, and ``(that, noise)`` for ``noise_stats``."""
    value = (self.value, self.aux) if options.has_aux else self.value
    grads = self.grads[0] if options.tree_grads else self.grads
    return ((value, grads), self.noise) if options.noise_stats else (value, grads)


@dataclasses.dataclass(frozen=True)
class Engine:
  """``fun`` and its options, positions resolved (:meth:`Options.resolve`)."""

  fun: Callable[..., Any]
  options: Options
  #: The step's :class:`jaxaccum._exact_plan.Plan` where its loss is read as a
  #: function of sums over rows (``normalize="mean"``): ``fun``'s loss is
  #: then differentiated as the full batch's share of it.
  exact: Any = None
  #: Whether the loss was read (:meth:`made_exact`): a path that rewrites
  #: ``fun`` afterwards (plain ``jit``'s ``reduced`` leaves) reads it once.
  read: bool = False
  #: Why a ``fun`` that sees one device's rows was not read on the whole
  #: batch (:meth:`made_exact`), said once the step has traced there.
  unread: Exception | None = None

  def check_args(self, args: tuple[Any, ...]) -> None:
    """Trace-time checks of the call's positional arguments."""
    _checks.check_args(self.options, args)

  def plan(
    self, args: tuple[Any, ...], devices: int | None = None
  ) -> _split.MicroBatching:
    """Validates the batch arguments and resolves ``k`` and ``m``: for the
    batch as it is laid out (one device, or sharded over several), or, in
    the data-parallel path, for the share of each of ``devices``."""
    o = self.options
    batch = {o.names(i): args[i] for i in o.batch_argnums}
    size = _split.leading_batch_size(batch)
    leaf = _split.first_leaf(batch)
    if devices is None:
      shards = _split.batch_devices(list(batch.values()))
      try:
        split = _split.plan_split(
          size, o.num_micro_batches, o.micro_batch_size, shards, leaf=leaf
        )
      except ValueError:
        _split.refuse_rows(batch, o.num_micro_batches)  # a list of rows: say so
        raise
      _checks.warn_shared_args(o, args, size, split.num_micro_batches)
      return split
    where = f"the {devices} devices of data axes {o.data_axes}"
    if size % devices:
      _split.refuse_rows(batch)
      raise ValueError(f"The global batch_size={size} is not divisible by {where}.")
    try:
      local = _split.plan_split(
        size // devices,
        o.num_micro_batches,
        o.micro_batch_size,
        leaf=leaf,
        devices=devices,
      )
    except ValueError as error:
      _split.refuse_rows(batch, o.num_micro_batches)
      raise ValueError(
        f"The global batch_size={size} on {where} is {size // devices} rows per "
        f"device, and per device: {error}"
      ) from None
    k = local.num_micro_batches
    _checks.warn_shared_args(o, args, size, devices * k)
    return _split.MicroBatching(size, k, size // k, devices)

  # -- chapter 2: the loop ------------------------------------------------------

  @property
  def micro(self) -> _micro.Micro:
    """``fun`` on one micro-batch: its call, loss and step (:mod:`jaxaccum._micro`)."""
    return _micro.Micro(self.fun, self.options, self.exact)

  def rules(self, diff_args: tuple[PyTree, ...]) -> tuple[_accumulator.Rule, ...]:
    """Each differentiated leaf's combine rule (:meth:`jaxaccum._micro.Micro.rules`)."""
    return self.micro.rules(diff_args)

  def sums(
    self,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    split: _split.MicroBatching,
    *,
    step: Callable[..., Any] | None = None,
    accumulator: Accumulator | None = None,
    state: PyTree = None,
    per_block: bool = False,
  ) -> Sums:
    """Runs the ``lax.scan`` over the micro-batches of ``args``.

    Args:
      args: the positional arguments, with the whole batch.
      kwargs: keyword arguments, passed unchanged to every micro-batch.
      split: the resolved split of the batch.
      step: the micro step (default ``self.micro.step``); the data-parallel
        path passes it ``vmap``-ped over the blocks.
      accumulator: how gradients are summed (default: locally, in
        ``accum_dtype``).
      state: the initial threaded state (default ``args[state_argnum]``).
      per_block: hand the step micro-batches as ``(S, m / S, ...)``, one
        entry per block, instead of ``m`` rows.
    """
    o = self.options
    k = split.num_micro_batches
    step = step or self.micro.step(
      args, kwargs, split, split.num_micro_batches, split.micro_batch_size
    )
    diff_args = tuple(args[i] for i in o.argnums)
    accumulator = accumulator or new_accumulator(
      o.accum_dtype, rules=self.rules(diff_args)
    )
    batches = _split.MicroBatches(
      tuple(args[i] for i in o.batch_argnums), split, per_block=per_block
    )
    if state is None and o.state_argnum is not None:
      state = args[o.state_argnum]

    def body(carry, xs, first=False):
      acc, state, fetched = carry
      scanned, index = xs
      micro = batches.take(scanned, fetched, index)
      if batches.streamed:  # double buffering: copy the next one meanwhile
        fetched = batches.fetch(batches.next_index(index))
      out, grads = step(diff_args, micro, index, state)
      acc = accumulator.first(grads) if first else accumulator.add(acc, grads)
      return (acc, out.state, fetched), out._replace(state=None)

    init = (None if k == 1 else accumulator.init(diff_args), state, batches.fetch(0))
    xs = (batches.scanned(), jnp.arange(k, dtype=jnp.int32))
    if k == 1:
      # One micro-batch: no loop and no accumulator, exactly the full batch.
      carry, ys = body(init, jax.tree.map(lambda x: x[0], xs), first=True)
      ys = jax.tree.map(lambda y: jnp.expand_dims(y, 0), ys)
    else:
      carry, ys = jax.lax.scan(body, init, xs)
    (grads, state, _), out = carry, ys
    if o.value_checks:
      _checks.check_weights(out.weight)
    return Sums.of(out, grads, state, split, o.accum_dtype, per_block=per_block)

  # -- chapter 3: normalization -------------------------------------------------

  def finish(
    self, sums: Sums, diff_args: tuple[PyTree, ...], args: tuple[Any, ...] = ()
  ) -> Result:
    """Normalizes ``sums`` into the :class:`Result` (with an exact plan, the
    loss at the totals of its sums and their gradients, ``args`` the call's
    arguments for the rest of the loss)."""
    o = self.options
    norm = o.normalization
    rules = self.rules(diff_args)
    if self.exact is not None:
      aux, parts = sums.aux
      gradients = [r.normalized for r in rules]
      value, normalized = self.exact.finished(parts, sums.grads, args, gradients)
      sums = sums._replace(aux=aux)
      divide = lambda g: g  # noqa: E731
    else:
      value = norm.finalize(sums.loss, sums.weight).astype(sums.losses.dtype)
      normalized = sums.grads
      divide = lambda g: norm.finalize(g, sums.weight)  # noqa: E731
      if self.micro.seed(diff_args, sums.losses.size) != 1.0:  # divided before
        divide = lambda g: g  # noqa: E731
    grads = _accumulator.results(rules, normalized, divide, diff_args)
    if o.value_checks:
      _checks.check_total_weight(sums.weight, sums.grads)
    stacked = _aux.Stacked(sums.aux, sums.weights, sums.rows, sums.shards)
    aux = _aux.combine(o.aux, stacked)
    aux = aux if o.state_argnum is None else (aux, sums.state)
    noise = None
    if sums.noise is not None:
      big_sq_norm = _tree.sq_norm(jax.tree.map(divide, normalized))
      if not norm.divide:  # a sum over the batch's rows: its mean is sum / B_big
        big_sq_norm = big_sq_norm / sums.noise.examples**2
      noise = sums.noise.finalize(big_sq_norm)
    # The noise is added to the clipped sum in the accumulator's dtype: a sum
    # rounded to the parameters' dtype (bfloat16) and multiplied back by the
    # examples' count would carry an error that grows with the batch.
    clipped = None if o.rule is None else sums.grads
    return Result(value, aux, grads, noise, sums.weight, clipped)

  def local(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Result:
    """The whole step on one device: plan, loop, normalize."""
    self.check_args(args)
    split = self.plan(args)
    check_noise_estimable(self.options, split.num_micro_batches)
    diff_args = tuple(args[i] for i in self.options.argnums)
    engine = self.made_exact(args, kwargs, split)
    return engine.finish(engine.sums(args, kwargs, split), diff_args, args)

  def made_exact(
    self,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    split: _split.MicroBatching,
    *,
    per_device: bool = False,
  ) -> Engine:
    """This engine with its :class:`jaxaccum._exact_plan.Plan` where the step's
    loss is read as a function of sums over its rows, else itself.

    ``per_device``: ``fun`` sees one device's rows (``mesh=``'s default
    view) and is read on the whole batch's micro-batch here. A ``fun`` that
    traces on a device's rows only (a shape or a constraint that holds for
    those) is not read, and keeps why in ``unread``: each micro-batch's loss
    then weighs the same."""
    if self.read:
      return self
    # A fun that sees the whole batch raises a type error in the step's own
    # trace, explained where jaxaccum can explain it; one that sees a
    # device's rows may trace there only (a shape, an axis, a constraint --
    # an Explicit mesh's with_sharding_constraint asserts -- of those rows).
    refused = _compat.SHARDING_TYPE_ERRORS + (
      (TypeError, ValueError, IndexError, NameError, AssertionError)
      if per_device
      else ()
    )
    try:
      found = _exact_plan.for_step(self, args, kwargs, split)
    except refused as error:
      return dataclasses.replace(self, read=True, unread=error if per_device else None)
    return dataclasses.replace(self, exact=found, read=True)


def warn_unread(error: Exception) -> None:
  """Says once that ``fun``, which sees one device's rows, is not read as
  sums over rows on the whole batch (``error`` says why)."""
  warnings.warn(
    "jaxaccum: fun's loss is not read as sums over rows on the whole batch "
    f"({type(error).__name__}: {error}); fun sees one device's rows, and "
    "each micro-batch's loss weighs the same, which is the full batch's only "
    "where every micro-batch holds the same weight. For a token mean, return "
    '(loss_sum, weight) with normalize="weighted".',
    stacklevel=5,
  )


def check_noise_estimable(options: Options, total: int) -> None:
  """``noise_stats`` needs two micro-batches in ``total`` (over devices too)."""
  if options.noise_stats and total < 2:
    raise ValueError(
      f"noise_stats=True needs at least 2 micro-batches in total, got {total}: "
      "one micro-batch has no noise to measure."
    )
