"""``fun`` on one micro-batch: the call's arguments, the loss and the step.

:class:`Micro` is what every path's loop runs on one micro-batch: the
engine's own (:meth:`jaxaccum._engine.Engine.sums`) and the data-parallel
steps', which differentiate :meth:`Micro.loss` (or :meth:`Micro.ghost_loss`)
in their own way. ``fun``'s outputs are unpacked and checked here: the
aux, the threaded state, the value a gradient rule takes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxaccum import _accumulator, _checks, _normalize, _split, _tree
from jaxaccum._options import Options

PyTree = Any


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


@dataclasses.dataclass(frozen=True)
class Micro:
  """``fun``, its options and its exact plan (``Engine.exact``), on one
  micro-batch: :attr:`jaxaccum._engine.Engine.micro`."""

  fun: Callable[..., Any]
  options: Options
  exact: Any = None

  def loss(
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
    loss_fn = self.loss_fn(args, kwargs, split.batch_size)
    assemble = self.call_args(args, total)

    def loss(diff_args, micro, index, state):
      value, (weight, aux, new_state) = loss_fn(
        *assemble(diff_args, micro, index, state)
      )
      users = aux if self.exact is None else aux[0]  # the sums ride with it
      return value, (weight, aux, self.kept_state(new_state, state, users))

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
    objective = o.rule.objective(
      self.loss_fn(args, kwargs, split.batch_size), o, kwargs
    )
    assemble = self.call_args(args, total)

    def loss(diff_and_masters, micro, index, state):
      diff_args, masters = diff_and_masters
      value, ((loss, (weight, aux, new_state)), some) = objective(
        *assemble(diff_args, micro, index, state), masters=masters
      )
      return value, (
        (loss, (weight, aux, self.kept_state(new_state, state, aux))),
        some,
      )

    return loss

  def step(
    self,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    split: _split.MicroBatching,
    total: int,
    rows: int,
  ) -> Callable[..., tuple[MicroOut, tuple[PyTree, ...]]]:
    """``step(diff_args, micro, index, state) -> (MicroOut, grads)``: forward
    and backward on one micro-batch of ``rows`` rows (:meth:`loss`); with a
    gradient rule (:class:`jaxaccum._engine.GradientRule`: DP-SGD's
    per-example clipping), the micro-batch's value and gradient as the rule
    forms them."""
    o = self.options
    if o.rule is None:
      diff_args = tuple(args[n] for n in o.argnums)
      value_and_grad = _normalize.seeded_value_and_grad(
        self.loss(args, kwargs, split, total),
        self.seed(diff_args, total),
        vjp=any(r.name == "dtype" for r in self.rules(diff_args)),
      )
    else:
      clipped = o.rule.value_and_grad(
        self.loss_fn(args, kwargs, split.batch_size), o, kwargs
      )
      assemble = self.call_args(args, total)

      def value_and_grad(diff_args, micro, index, state):
        (value, (weight, aux, new_state)), grads = clipped(
          *assemble(diff_args, micro, index, state)
        )
        return (value, (weight, aux, self.kept_state(new_state, state, aux))), grads

    def step(diff_args, micro, index, state):
      (loss, (weight, aux, new_state)), grads = value_and_grad(
        diff_args, micro, index, state
      )
      noise = None
      if o.noise_stats:
        noise = noise_terms(o, _tree.sq_norm(grads), weight, rows)
      return MicroOut(loss, weight, aux, new_state, noise), grads

    return self.rematerialized(step)

  def rules(self, diff_args: tuple[PyTree, ...]) -> tuple[_accumulator.Rule, ...]:
    """Each differentiated leaf's combine rule, flattened
    (:func:`jaxaccum._accumulator.rules`)."""
    o = self.options
    return _accumulator.rules(o.combine, diff_args, o.tree_grads)

  def seed(self, diff_args: tuple[PyTree, ...], total: int) -> float:
    """The cotangent each micro-batch's backward pass starts from
    (:func:`jaxaccum._normalize.seed`): ``1 / total`` where a leaf is not a
    gradient and the mean's division would come after the loop."""
    o = self.options
    named = [r.name for r in self.rules(diff_args) if not r.normalized]
    if o.rule is not None or o.noise_stats or total < 2 or not named:
      return 1.0
    return _normalize.seed(o.normalize, total, named, exact=self.exact is not None)

  def call_args(self, args: tuple[Any, ...], total: int) -> Callable[..., list[Any]]:
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

  def kept_state(self, new_state: PyTree, state: PyTree, aux: PyTree) -> PyTree:
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

  def loss_fn(
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
