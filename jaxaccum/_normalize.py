"""The normalization modes as values: how micro-batch results combine.

Every mode reduces to the same fold. Each micro-batch contributes a scalar to
differentiate and a weight; the engine sums both, and ``finalize`` turns the
sums into the result. A mode is therefore just two functions:

- ``mean``: the loss is a micro-batch mean, every micro-batch weighs 1, and the
  sums are divided by the total weight (the number of micro-batches).
- ``sum``: the loss is a sum, and the sums are returned as they are.
- ``weighted``: ``fun`` returns ``(loss_sum, weight)``; the sums are divided by
  the total weight, the exact full-batch token mean.

Dividing is zero-safe: a total weight of zero gives zeros, never NaN. Masks
select with ``jnp.where``; they never multiply (``0 * nan`` is ``nan``).

The value-level checks of the weights (:func:`check_weights`,
:func:`check_total_weight`) live here too. They are written with
``checkify.debug_check`` and are off unless ``value_checks=True``: even as
no-ops they would put an effect on the step's jaxpr, which takes a jitted
step off JAX's fast C++ dispatch path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import checkify

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
  """``total / weight`` leaf by leaf, and zeros where ``weight`` is zero.

  Where the weight is zero the quotient is multiplied by 0, not selected
  away: the result is zero for a finite total, and a NaN or Inf that the loss
  itself produced is not hidden. (An elementwise select here also cost a
  whole extra copy of the gradients on an H100 target: XLA did not fuse it
  into the optimizer update that reads the result, a multiplication it did.)

  >>> import jax.numpy as jnp
  >>> safe_divide({"a": jnp.array([2.0, 4.0])}, jnp.array(2.0))["a"].tolist()
  [1.0, 2.0]
  >>> safe_divide(jnp.array([1.0]), jnp.array(0.0)).tolist()
  [0.0]
  """
  positive = weight > 0
  denominator = jnp.where(positive, weight, 1)
  return jax.tree.map(
    lambda t: (t / denominator.astype(t.dtype)) * positive.astype(t.dtype), total
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


def check_weights(weights: jax.Array) -> None:
  """Every micro-batch weight is finite and non-negative (under checkify)."""
  checkify.debug_check(
    jnp.all(jnp.isfinite(weights) & (weights >= 0)),
    "jaxaccum: micro-batch weights must be finite and >= 0, got {weights}.",
    weights=weights,
  )


def check_total_weight(total: jax.Array, grad_sums: PyTree) -> None:
  """The total weight is positive, or the summed gradients are zero (under
  checkify).

  ``grad_sums`` are the gradients before normalization. A zero total weight
  under a loss sum that still depends on the parameters means the weights and
  the loss disagree (a mask applied to one and not the other); the zero
  result would hide that.
  """
  zero = jnp.all(
    jnp.asarray([jnp.all(g == 0) for g in jax.tree.leaves(grad_sums)] or [True])
  )
  checkify.debug_check(
    (total > 0) | zero,
    "jaxaccum: total weight {total} is not positive, yet the summed gradient is "
    "not zero: the weights count no rows that the loss sums over.",
    total=total,
  )
