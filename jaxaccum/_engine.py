"""The scan engine that everything else builds on.

One traced step splits the batch into ``k`` micro-batches (``_split``), runs
forward and backward on each inside a ``lax.scan``, and adds each gradient
into an accumulator of at least ``accum_dtype`` (float32 by default). The
per-micro-batch losses and weights leave the scan as ``k`` scalars; the
normalization mode (``_normalize``) turns the sums into the result once,
after the loop.

The step is a story in three chapters, each a method of :class:`Engine`:

1. :meth:`Engine.plan`: validate the batch and resolve ``k`` and ``m``;
2. :meth:`Engine.sums`: the loop, which returns raw :class:`Sums`;
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
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from jaxaccum import (
  _aux,
  _checks,
  _compat,
  _exact_plan,
  _noise_scale,
  _normalize,
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


class MicroOut(NamedTuple):
  """What one micro-batch gives besides its gradient.

  Attributes:
    loss: the scalar that was differentiated.
    weight: its weight (1 unless ``normalize="weighted"``).
    aux: ``fun``'s aux.
    state: the new threaded state (None without ``state_argnum``).
    noise: ``(sq_norm, divisor, examples)`` for the noise statistics: the
      gradient's squared norm, what it sums over (its mean gradient is
      ``gradient / divisor``), and the examples (or units of weight) it holds
      (:meth:`jaxaccum.NoiseSums.of`); None unless ``noise_stats``.
  """

  loss: jax.Array
  weight: jax.Array
  aux: PyTree
  state: PyTree
  noise: tuple[jax.Array, jax.Array, jax.Array] | None


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

  def micro_loss(
    self,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    split: _split.MicroBatching,
    total: int,
  ) -> Callable[..., tuple[jax.Array, tuple[jax.Array, PyTree, PyTree]]]:
    """``loss(diff_args, micro, index, state) -> (loss, (weight, aux,
    new_state))``: ``fun`` on one micro-batch, whose key is ``fold_in(key,
    index)``, or the key itself when the step has one micro-batch in
    ``total`` (then jaxaccum is the user's own step, bit for bit). The
    data-parallel path differentiates it in its own way."""
    loss_fn = self._loss(args, kwargs, split.batch_size)
    assemble = self._call_args(args, total)

    def loss(diff_args, micro, index, state):
      value, (weight, aux, new_state) = loss_fn(
        *assemble(diff_args, micro, index, state)
      )
      users = aux if self.exact is None else aux[0]  # the sums ride with it
      return value, (weight, aux, self._kept_state(new_state, state, users))

    return loss

  def ghost_loss(
    self,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    split: _split.MicroBatching,
    total: int,
  ) -> Callable[..., Any]:
    """``loss((diff_args, masters), micro, index, state) -> (objective,
    ((loss, (weight, aux, new_state)), some))`` for ``clip_method="ghost"``:
    the objective's gradient with respect to ``masters`` (the differentiated
    arguments in the accumulator's dtype) is the micro-batch's clipped sum
    (:func:`jaxaccum._privacy.ghost_objective`). The data-parallel path
    differentiates the devices' objectives together, so that a leaf they
    share (FSDP) gets its clipped sums reduce-scattered in the backward
    pass, as without privacy."""
    o = self.options
    assert o.rule is not None
    objective = o.rule.objective(self._loss(args, kwargs, split.batch_size), o, kwargs)
    assemble = self._call_args(args, total)

    def loss(diff_and_masters, micro, index, state):
      diff_args, masters = diff_and_masters
      value, ((loss, (weight, aux, new_state)), some) = objective(
        *assemble(diff_args, micro, index, state), masters=masters
      )
      return value, (
        (loss, (weight, aux, self._kept_state(new_state, state, aux))),
        some,
      )

    return loss

  def micro_step(
    self,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    split: _split.MicroBatching,
    total: int,
    rows: int,
  ) -> Callable[..., tuple[MicroOut, tuple[PyTree, ...]]]:
    """``step(diff_args, micro, index, state) -> (MicroOut, grads)``: forward
    and backward on one micro-batch of ``rows`` rows (:meth:`micro_loss`);
    with a gradient rule (:class:`GradientRule`: DP-SGD's per-example
    clipping), the micro-batch's value and gradient as the rule forms
    them."""
    o = self.options
    if o.rule is None:
      value_and_grad = jax.value_and_grad(
        self.micro_loss(args, kwargs, split, total), has_aux=True
      )
    else:
      clipped = o.rule.value_and_grad(
        self._loss(args, kwargs, split.batch_size), o, kwargs
      )
      assemble = self._call_args(args, total)

      def value_and_grad(diff_args, micro, index, state):
        (value, (weight, aux, new_state)), grads = clipped(
          *assemble(diff_args, micro, index, state)
        )
        return (value, (weight, aux, self._kept_state(new_state, state, aux))), grads

    def step(diff_args, micro, index, state):
      (loss, (weight, aux, new_state)), grads = value_and_grad(
        diff_args, micro, index, state
      )
      noise = None
      if o.noise_stats:
        noise = noise_terms(o, _tree.sq_norm(grads), weight, rows)
      return MicroOut(loss, weight, aux, new_state, noise), grads

    return self.rematerialized(step)

  def _call_args(self, args: tuple[Any, ...], total: int) -> Callable[..., list[Any]]:
    """``(diff_args, micro, index, state) -> fun's positional arguments`` for
    one micro-batch: the differentiated and batch arguments in their places,
    the key folded with the micro-batch index (unless the step has one
    micro-batch in ``total``), the threaded state."""
    o = self.options
    fold = total > 1

    def assemble(diff_args, micro, index, state):
      call_args = list(args)
      for n, d in zip(o.argnums, diff_args, strict=True):
        call_args[n] = d
      for n, b in zip(o.batch_argnums, micro, strict=True):
        call_args[n] = b
      if o.rng_argnum is not None and fold:
        call_args[o.rng_argnum] = jax.random.fold_in(args[o.rng_argnum], index)
      if o.state_argnum is not None:
        call_args[o.state_argnum] = state
      return call_args

    return assemble

  def _kept_state(self, new_state: PyTree, state: PyTree, aux: PyTree) -> PyTree:
    """``fun``'s new state, checked against the one it was given (``aux``,
    the other half of the pair, tells a swapped pair)."""
    if self.options.state_argnum is None:
      return new_state
    return _match_state(new_state, state, aux)

  def rematerialized(self, step: Callable[..., Any]) -> Callable[..., Any]:
    """``step`` under ``jax.checkpoint`` as ``remat`` asks."""
    remat = self.options.remat
    if remat is False:
      return step
    policy = None if remat is True else remat
    return jax.checkpoint(step, prevent_cse=False, policy=policy)

  def _loss(
    self, args: tuple[Any, ...], kwargs: dict[str, Any], batch_size: int
  ) -> Callable[..., Any]:
    """``fun`` as ``args -> (loss, (weight, aux, new_state))`` for autodiff."""
    o = self.options

    def loss_fn(*call_args):
      if o.example_mask is not None:  # jaxaccum's own argument, last
        call_args = call_args[: o.example_mask]
      try:
        out = self.fun(*call_args, **kwargs)
      except (TypeError, ValueError) as error:
        hint = _checks.batch_argnums_hint(o, args, batch_size)
        if hint is not None:
          error.add_note(hint)
        raise
      value, aux = _unpack_aux(out, o)
      new_state = None
      if o.state_argnum is not None:
        aux, new_state = _unpack_state(aux)
      _checks.check_aux(aux)
      if o.rule is not None:
        o.rule.check_value(value, o)
      loss, weight = o.normalization.loss_and_weight(value)
      return loss, (weight, aux, new_state)

    return loss_fn if self.exact is None else self.exact.objective(loss_fn)

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
      step: the micro step (default :meth:`micro_step`); the data-parallel
        path passes it ``vmap``-ped over the blocks.
      accumulator: how gradients are summed (default: locally, in
        ``accum_dtype``).
      state: the initial threaded state (default ``args[state_argnum]``).
      per_block: hand the step micro-batches as ``(S, m / S, ...)``, one
        entry per block, instead of ``m`` rows.
    """
    o = self.options
    k = split.num_micro_batches
    step = step or self.micro_step(
      args, kwargs, split, split.num_micro_batches, split.micro_batch_size
    )
    accumulator = accumulator or new_accumulator(o.accum_dtype)
    diff_args = tuple(args[i] for i in o.argnums)
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
    return Sums(
      loss=jnp.sum(out.loss.astype(jnp.promote_types(o.accum_dtype, out.loss.dtype))),
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

  # -- chapter 3: normalization -------------------------------------------------

  def finish(
    self, sums: Sums, diff_args: tuple[PyTree, ...], args: tuple[Any, ...] = ()
  ) -> Result:
    """Normalizes ``sums`` into the :class:`Result` (with an exact plan, the
    loss at the totals of its sums and their gradients, ``args`` the call's
    arguments for the rest of the loss)."""
    o = self.options
    norm = o.normalization
    if self.exact is not None:
      aux, parts = sums.aux
      value, normalized = self.exact.finished(parts, sums.grads, args, diff_args)
      sums = sums._replace(aux=aux)
    else:
      value = norm.finalize(sums.loss, sums.weight).astype(sums.losses.dtype)
      normalized = norm.finalize(sums.grads, sums.weight)
    grads = jax.tree.map(
      lambda g, p: g.astype(_normalize.result_dtype(p)), normalized, diff_args
    )
    if o.value_checks:
      _checks.check_total_weight(sums.weight, sums.grads)
    stacked = _aux.Stacked(sums.aux, sums.weights, sums.rows, sums.shards)
    aux = _aux.combine(o.aux, stacked)
    aux = aux if o.state_argnum is None else (aux, sums.state)
    noise = None
    if sums.noise is not None:
      big_sq_norm = _tree.sq_norm(normalized)
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
    self, args: tuple[Any, ...], kwargs: dict[str, Any], split: _split.MicroBatching
  ) -> Engine:
    """This engine with its :class:`jaxaccum._exact_plan.Plan` where the step's
    loss is read as a function of sums over its rows, else itself."""
    if self.read:
      return self
    try:
      found = _exact_plan.for_step(self, args, kwargs, split)
    except _compat.SHARDING_TYPE_ERRORS:
      # fun refused on these types: not read; the step's own trace raises
      # the error, explained where jaxaccum can explain it
      found = None
    return dataclasses.replace(self, exact=found, read=True)


def noise_terms(
  options: Options, sq_norm: jax.Array, weight: jax.Array, rows: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """A micro-batch's noise terms (:class:`MicroOut`): its gradient's squared
  norm, what the gradient sums over (a mean: 1; a sum: ``rows``; weighted:
  its weight), and what it holds (``rows``, or its weight)."""
  name = options.normalize
  if name == "weighted":
    return sq_norm, weight, weight
  shape = jnp.shape(sq_norm)
  divisor = jnp.full(shape, 1.0 if name == "mean" else rows, jnp.float32)
  return sq_norm, divisor, jnp.full(shape, rows, jnp.float32)


def check_noise_estimable(options: Options, total: int) -> None:
  """``noise_stats`` needs two micro-batches in ``total`` (over devices too)."""
  if options.noise_stats and total < 2:
    raise ValueError(
      f"noise_stats=True needs at least 2 micro-batches in total, got {total}: "
      "one micro-batch has no noise to measure."
    )


def _unpack_aux(out: Any, options: Options) -> tuple[Any, Any]:
  if not options.has_aux:
    return out, None
  if isinstance(out, (tuple, list)) and len(out) == 2:
    return out[0], out[1]
  if options.normalize == "weighted":
    raise ValueError(
      'has_aux=True with normalize="weighted" needs fun to return '
      f"((loss_sum, weight), aux), got {_checks.describe(out)}."
    )
  got = _checks.describe(out)
  if hasattr(out, "shape"):
    got = f"one array of shape={tuple(out.shape)}"
  raise ValueError(f"has_aux=True needs fun to return a pair (value, aux), got {got}.")


def _like(tree: PyTree, state: PyTree) -> bool:
  """Whether ``tree`` has the structure, shapes and dtypes of ``state``."""
  tree_struct: Any = jax.tree.structure(tree)
  if tree_struct != jax.tree.structure(state):
    return False
  return all(
    jnp.shape(a) == jnp.shape(b) and jnp.result_type(a) == jnp.result_type(b)
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(state), strict=True)
  )


def _unpack_state(aux: Any) -> tuple[Any, Any]:
  if isinstance(aux, (tuple, list)) and len(aux) == 2:
    return aux[0], aux[1]
  got = _checks.describe(aux)
  if hasattr(aux, "shape"):
    got = f"one array of shape={tuple(aux.shape)}"
  raise ValueError(
    "state_argnum needs fun to return (value, (aux, new_state)), got an aux "
    f"that is {got}, not a pair."
  )


def _match_state(new_state: PyTree, state: PyTree, aux: PyTree = None) -> PyTree:
  """Checks that ``fun`` returned a state like the one it got: the same
  structure, shapes and dtypes (a Python number takes the state's dtype).
  A pair whose first half (``aux``) is state-like is called swapped."""
  new_struct: Any = jax.tree.structure(new_state)
  old_struct: Any = jax.tree.structure(state)
  if new_struct != old_struct:
    if _like(aux, state):
      raise ValueError(
        "state_argnum needs fun to return (value, (aux, new_state)), and fun "
        "returned (value, (new_state, aux)) it seems: the first of the pair "
        "has the state's structure, shapes and dtypes, the second does not "
        f"({_checks.describe(new_state)}, structure {new_struct}). Swap the "
        "pair: return value, (aux, new_state)."
      )
    raise ValueError(
      "fun returned a new_state whose structure differs from the state it "
      f"was given: {new_struct} vs {old_struct}. Under state_argnum fun "
      "returns (value, (aux, new_state)), new_state like the state it got."
    )
  for new, old in zip(jax.tree.leaves(new_state), jax.tree.leaves(state), strict=True):
    if jnp.shape(new) != jnp.shape(old):
      raise ValueError(
        "fun returned a new_state leaf of shape="
        f"{jnp.shape(new)} for a state leaf of shape={jnp.shape(old)}."
      )
  _tree.check_dtypes_kept(new_state, state, "state")
  return _tree.cast_like(new_state, state)
