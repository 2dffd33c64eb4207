"""The record of a clipped sum (:class:`ClipRecord`): what the step that
clipped hands :func:`jaxaccum.dp_noise`, marked as made by a clipped step
and, once it leaves jaxaccum, redeemable once."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxaccum import _compat
from jaxaccum._privacy import tickets as _tickets

PyTree = Any


class ClipRecord:
  """A clipped sum and how it was made: what :func:`dp_noise` checks it
  received, straight from the step that clipped.

  ``make_train_step`` (and ``jaxaccum.nnx.make_train_step``) hand one to the
  optimizer with the gradient (``clip_record=``), and :func:`accumulate` to
  its inner optimizer once per window; ``value_and_grad(...,
  clip_per_example=C, normalize="sum", clip_record=True)`` returns one in
  place of the gradient, for :func:`accumulate`'s ``update``. ``dp_noise``
  refuses a gradient that is not the record's very ``grads`` (any
  transformation before it made new arrays), a record clipped at another
  norm, and, in :func:`accumulate`, a record of anything but a clipped sum.
  ``dp_noise`` adds its noise to ``clipped_sum``, the sum itself: what it
  divides the noisy sum by is never the sum's private weight.

  Two more checks, for records that a loop of your own passes around:

  - **Made by a clipped step.** jaxaccum's steps mark the records they make
    in the record's static data; ``dp_noise`` and ``accumulate`` refuse a
    record without the mark, as one built with this constructor is (its
    arrays could be anything). A ``jax.tree.map`` over a real record keeps
    the mark, and so is not caught: map ``record.grads``, not the record.
  - **Used once.** A record that ``clip_record=True`` returns carries a
    serial number (an array leaf, so that it survives ``jax.jit``), issued
    on the host when the record is made (under a trace, by a host callback
    that runs on every call). The update that takes it (``accumulate``'s,
    or ``dp_noise``'s given the record itself) redeems it the same way, and
    a serial redeemed before is refused: a ``ValueError`` in an eager
    update, JAX's runtime error with the same message in a compiled one,
    raised before the update has a result. A record fed twice to one
    ``accumulate`` window would add its examples' clipped gradients twice.

  A pytree: ``grads``, ``divided_by``, ``examples``, ``clipped_sum`` and
  ``serial`` are its children, ``clip_norm``, ``normalize`` and the mark
  static.

  Attributes:
    grads: the clipped sum divided by ``divided_by``, as the step returns it
      (in the parameters' dtype).
    divided_by: what the clipped sum was divided by; shape=(), float32.
    examples: the real examples' count (their total weight with
      ``normalize="weighted"``); shape=(), float32.
    clip_norm: the norm each example's gradient was clipped to.
    normalize: the step's ``normalize``: ``"sum"``, ``"mean"`` or
      ``"weighted"``.
    clipped_sum: the clipped sum itself, in the accumulator's dtype (None in
      a record built by hand).
    serial: the record's serial number, shape=(), uint32, for a record that
      ``clip_record=True`` returned; None for one made and taken inside one
      step.
  """

  def __init__(
    self,
    grads: PyTree,
    divided_by: Any,
    examples: Any,
    clip_norm: float,
    normalize: str,
    *,
    clipped_sum: PyTree = None,
    serial: Any = None,
  ):
    self.grads = grads
    self.divided_by = divided_by
    self.examples = examples
    self.clip_norm = clip_norm
    self.normalize = normalize
    self.clipped_sum = clipped_sum
    self.serial = serial
    self._mark: _Mark | None = None

  def __repr__(self) -> str:
    return (
      f"ClipRecord(clip_norm={self.clip_norm}, normalize={self.normalize!r}, "
      f"examples={self.examples})"
    )


class _Mark:
  """The mark in the static data of a :class:`ClipRecord` that a jaxaccum
  step made."""

  def __repr__(self) -> str:
    return "<made by a clipped step>"


_MADE_BY_A_CLIPPED_STEP = _Mark()


def _flatten(r: ClipRecord) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
  children = (r.grads, r.divided_by, r.examples, r.clipped_sum, r.serial)
  return children, (r.clip_norm, r.normalize, r._mark)


def _unflatten(static: tuple[Any, ...], children: tuple[Any, ...]) -> ClipRecord:
  grads, by, examples, clipped_sum, serial = children
  clip_norm, normalize, mark = static
  record = ClipRecord(
    grads, by, examples, clip_norm, normalize, clipped_sum=clipped_sum, serial=serial
  )
  record._mark = mark
  return record


jax.tree_util.register_pytree_node(ClipRecord, _flatten, _unflatten)


def made_record(
  grads: PyTree,
  by: Any,
  examples: Any,
  clip_norm: float,
  normalize: str,
  *,
  clipped_sum: PyTree,
  serial: Any = None,
) -> ClipRecord:
  """A :class:`ClipRecord` with the mark of a clipped step: only jaxaccum's
  steps (and ``accumulate``'s window) make one."""
  record = ClipRecord(
    grads, by, examples, clip_norm, normalize, clipped_sum=clipped_sum, serial=serial
  )
  record._mark = _MADE_BY_A_CLIPPED_STEP
  return record


def record_of(
  grads: PyTree,
  total_weight: jax.Array,
  clip_norm: float,
  normalize: str,
  clipped_sum: PyTree,
  *,
  ticket: bool = False,
) -> ClipRecord:
  """The :class:`ClipRecord` of a clipped step's normalized gradient and its
  clipped sum; with ``ticket``, a serial number to be redeemed once
  (:mod:`jaxaccum._privacy.tickets`): the record leaves jaxaccum's hands."""
  examples = jnp.asarray(total_weight, jnp.float32)
  serial = None
  if ticket:
    traced = any(map(_compat.is_tracer, jax.tree.leaves((clipped_sum, examples))))
    serial = _tickets.issue(traced)
  return made_record(
    grads,
    divided_by(examples, normalize),
    examples,
    clip_norm,
    normalize,
    clipped_sum=clipped_sum,
    serial=serial,
  )


def clipped_sum_of(record: ClipRecord) -> PyTree:
  """What the noise is added to: the record's clipped sum in the
  accumulator's dtype (every record a jaxaccum step makes has one)."""
  return record.clipped_sum


def take(record: ClipRecord, *context: Any) -> None:
  """Redeems ``record``'s serial number: a record is taken by one update
  (:class:`ClipRecord`). ``context`` is the update's other inputs (its
  state): a tracer there means that the update is traced."""
  traced = any(map(_compat.is_tracer, jax.tree.leaves((record, context))))
  _tickets.take(record.serial, traced)


def check_made(record: ClipRecord, where: str) -> None:
  """Refuses a :class:`ClipRecord` that no clipped step made."""
  if record._mark is not _MADE_BY_A_CLIPPED_STEP:
    raise ValueError(
      f"{where} got a jaxaccum.ClipRecord that no clipped step made (built "
      "with its constructor): nothing says that its gradient was clipped, or "
      "what it was divided by. Use the record that value_and_grad(..., "
      "clip_per_example=C, clip_record=True) returns, as it is."
    )


def divided_by(total_weight: jax.Array, normalize: str) -> jax.Array:
  """What ``value_and_grad`` with ``clip_per_example`` divided the clipped
  sum by: the examples' count or weight, or 1 for ``"sum"``."""
  if normalize == "sum":
    return jnp.ones((), jnp.float32)
  return jnp.asarray(total_weight, jnp.float32)
