"""The normalization modes as values: how micro-batch results combine.

Every mode reduces to the same fold. Each micro-batch contributes a scalar to
differentiate and a weight; the engine sums both, and ``finalize`` turns the
sums into the result. A mode is therefore just two functions:

- ``mean``: the loss is a micro-batch mean, every micro-batch weighs 1, and the
  sums are divided by the total weight (the number of micro-batches).
- ``sum``: the loss is a sum, and the sums are returned as they are.
- ``weighted``: ``fun`` returns ``(loss_sum, weight)``; the sums are divided by
  the total weight, the exact full-batch token mean.

Dividing is the full batch's division, except where it is 0 / 0: a total
weight of zero gives zeros, never NaN, and a non-finite total weight gives a
non-finite result, as ``loss_sum / weight`` does over the whole batch. A NaN
or Inf that the loss itself produced always reaches the result. (The
value-level checks of the weights are in :mod:`jaxaccum._checks`.)

Where a differentiated leaf is not a gradient (an FP8 layer's amax,
:mod:`jaxaccum._accumulator`'s rules), the mean's division is applied
before each micro-batch's backward pass instead (:func:`seed`): an FP8
output-gradient amax is taken inside it and must see the full batch's
cotangents.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxaccum import _compat

PyTree = Any


class Normalization(NamedTuple):
  """One normalization mode.

  Attributes:
    name: the mode's name, as passed to ``normalize=``.
    loss_and_weight: maps the value ``fun`` returns to ``(loss, weight)``:
      the scalar to differentiate and the weight that it carries.
    divide: whether ``finalize`` divides the sums by the total weight.
  """

  name: str
  loss_and_weight: Callable[[Any], tuple[jax.Array, jax.Array]]
  divide: bool

  def finalize(self, total: PyTree, total_weight: jax.Array) -> PyTree:
    """Turns summed values or gradients into the normalized result."""
    if not self.divide:
      return total
    return safe_divide(total, total_weight)


def safe_divide(total: PyTree, weight: jax.Array) -> PyTree:
  """``total / weight`` leaf by leaf, as the full batch divides, but zeros
  where ``weight`` is zero.

  - A finite, non-zero weight divides exactly (negative too: the full batch
    would).
  - A zero weight gives zeros for finite sums, never the NaN of 0 / 0; a NaN
    or Inf that the loss itself produced is not hidden (it is multiplied by
    0, not selected away).
  - A NaN or Inf weight gives NaN: the full batch's ``loss_sum / weight`` is
    not finite either, and a step must not be taken on it.

  No elementwise select touches the (possibly large) sums: an elementwise
  select here cost a whole extra copy of the gradients on an H100 target,
  which XLA did not fuse into the optimizer update that reads the result; a
  scalar factor it does.

  >>> import jax.numpy as jnp
  >>> safe_divide({"a": jnp.array([2.0, 4.0])}, jnp.array(2.0))["a"].tolist()
  [1.0, 2.0]
  >>> safe_divide(jnp.array([1.0, jnp.nan]), jnp.array(0.0)).tolist()
  [0.0, nan]
  >>> safe_divide(jnp.array([1.0]), jnp.array(jnp.inf)).tolist()
  [nan]
  """
  zero = weight == 0
  denominator = jnp.where(zero, jnp.ones_like(weight), weight)
  # 1 for a finite non-zero weight, NaN for a non-finite one (Inf / Inf), and
  # 0 for a zero weight; never 0 / 0, so jax_debug_nans stays quiet.
  factor = jnp.where(zero, jnp.zeros_like(weight), denominator / denominator)
  return jax.tree.map(
    lambda t: (t / denominator.astype(t.dtype)) * factor.astype(t.dtype), total
  )


def result_dtype(x: Any) -> Any:
  """The dtype ``jax.grad`` gives for ``x``: float32 for a Python float, or
  for numpy float64 while 64-bit mode is off.

  >>> import numpy as np
  >>> str(result_dtype(2.0)), str(result_dtype(np.zeros(2)))
  ('float32', 'float32')
  """
  return jax.dtypes.canonicalize_dtype(jnp.result_type(x))


def check_accum_dtype(accum_dtype: Any) -> None:
  """Raises a ``ValueError`` unless ``accum_dtype`` is a floating dtype.

  >>> check_accum_dtype(jnp.int32)
  Traceback (most recent call last):
  ValueError: accum_dtype must be a floating dtype, got int32.
  """
  if not jnp.issubdtype(accum_dtype, jnp.floating):
    raise ValueError(
      f"accum_dtype must be a floating dtype, got {jnp.dtype(accum_dtype).name}."
    )


def accumulator_dtype(accum_dtype: Any, x: Any) -> Any:
  """The dtype of a sum of ``x``-like values: ``accum_dtype``, or ``x``'s own
  dtype where that is wider (float64 with 64-bit mode on).

  >>> import jax.numpy as jnp
  >>> str(accumulator_dtype(jnp.float32, jnp.zeros(2, jnp.bfloat16)))
  'float32'
  """
  return jax.dtypes.canonicalize_dtype(jnp.promote_types(accum_dtype, result_dtype(x)))


def _unit_weight(value: Any) -> tuple[jax.Array, jax.Array]:
  if isinstance(value, (tuple, list)):
    raise ValueError(
      f"fun returned a {type(value).__name__} of length {len(value)} as its "
      "value, where a scalar loss was expected. Did you mean has_aux=True "
      "(fun returns (loss, aux)), or normalize='weighted' (fun returns "
      "(loss_sum, weight))?"
    )
  _check_scalar_loss(value, "The loss")
  return value, jnp.ones((), jnp.float32)


def _pair(value: Any) -> tuple[jax.Array, jax.Array]:
  if not (isinstance(value, (tuple, list)) and len(value) == 2):
    if isinstance(value, (tuple, list)):
      got = f"a {type(value).__name__} of length {len(value)}"
    elif hasattr(value, "shape"):
      got = f"an array of shape={value.shape}"
    else:
      got = f"a {type(value).__name__}"
    raise ValueError(
      'normalize="weighted" needs fun to return the pair (loss_sum, weight) '
      f"as its value, got {got}. Return e.g. "
      "(jnp.sum(token_losses * mask), jnp.sum(mask))."
    )
  loss_sum, weight = value
  if isinstance(loss_sum, (tuple, list)):
    raise ValueError(
      'normalize="weighted" needs fun to return (loss_sum, weight) as its '
      f"value, but its first element is a {type(loss_sum).__name__}. Did you "
      "mean has_aux=True (fun returns ((loss_sum, weight), aux))?"
    )
  _check_scalar_loss(loss_sum, "loss_sum")
  weight = jnp.asarray(weight)
  if weight.shape != ():
    raise ValueError(f"The weight must be a scalar, got shape={weight.shape}.")
  return loss_sum, weight


def _check_scalar_loss(loss: Any, what: str) -> None:
  shape = jnp.shape(loss)
  if shape != ():
    raise ValueError(f"{what} must be a scalar, got shape={shape}.")


MEAN = Normalization("mean", _unit_weight, divide=True)
SUM = Normalization("sum", _unit_weight, divide=False)
WEIGHTED = Normalization("weighted", _pair, divide=True)
MODES = {mode.name: mode for mode in (MEAN, SUM, WEIGHTED)}


def get(normalize: str) -> Normalization:
  """Looks a mode up by name; raises ``ValueError`` for an unknown one."""
  try:
    return MODES[normalize]
  except (KeyError, TypeError):
    raise ValueError(f"Unknown {normalize=}; choose one of {sorted(MODES)}.") from None


def seed(normalize: str, total: int, named: Any, *, exact: bool) -> float:
  """The cotangent each of ``total`` micro-batches' backward passes starts
  from, where leaves ``named`` by their rules are not gradients: the mean's
  ``1 / total`` (none where an ``exact`` plan seeds them as the full
  batch's already), 1 for a sum.

  >>> seed("mean", 4, ["max"], exact=False), seed("sum", 4, ["max"], exact=False)
  (0.25, 1.0)
  """
  if normalize == "weighted":
    raise ValueError(
      f'normalize="weighted" divides by the total weight after the loop, '
      f"but {len(named)} differentiated leaves are not gradients (combined "
      f"by {sorted(set(named))}: FP8 scales and amax histories, or "
      "combine=), and an FP8 layer's output-gradient amax is taken inside "
      "each micro-batch's backward pass, which would see cotangents "
      "Σ weight times the full batch's. Write the weighted mean in fun "
      '(jnp.sum(losses * mask) / jnp.sum(mask)) with normalize="mean": '
      "jaxaccum reads it as the full batch's and seeds each backward pass "
      'with the full batch\'s cotangents; or use normalize="sum".'
    )
  return 1.0 / total if normalize == "mean" and not exact else 1.0


def seeded_value_and_grad(
  loss: Callable[..., Any], seed: float, *, vjp: bool = False
) -> Callable[..., Any]:
  """``jax.value_and_grad(loss, has_aux=True)`` whose backward pass starts
  from the cotangent ``seed`` (1 and not ``vjp``: ``jax.value_and_grad``
  itself; else by ``jax.vjp``, which also takes leaves of an extended dtype,
  Flax's ``fm32``, that ``jax.grad`` refuses)."""
  if seed == 1.0 and not vjp:
    return jax.value_and_grad(loss, has_aux=True)

  def value_and_grad(diff_args, *rest):
    value, backward, out = jax.vjp(lambda d: loss(d, *rest), diff_args, has_aux=True)
    (grads,) = backward(_compat.cotangent_full(value, seed))
    return (value, out), grads

  return value_and_grad
