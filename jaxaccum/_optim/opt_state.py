"""Reading :func:`jaxaccum.accumulate`'s state from inside an optimizer state.

A training loop wants to know when the optimizer stepped: to log, to update
an EMA of the parameters, to count optimizer steps for a schedule. The
counters around it count calls instead: ``TrainState.step`` and
``nnx.Optimizer.step`` go up on every micro-batch. The
:class:`~jaxaccum.AccumulateState` knows, wherever it sits: alone, in an
``optax.chain``, under ``optax.inject_hyperparams``, in a flax
``TrainState`` or an ``nnx.Optimizer``.
"""

from __future__ import annotations

from typing import Any

import jax
import optax
from flax import nnx

from jaxaccum._optim.accumulate import AccumulateState
from jaxaccum._optim.loss_scale import DynamicLossScale

PyTree = Any


def _is_state(x: Any) -> bool:
  return isinstance(x, AccumulateState)


def find_accumulate_state(opt_state: PyTree) -> AccumulateState:
  """The one :class:`AccumulateState` inside ``opt_state``.

  Args:
    opt_state: an optimizer state (any pytree: ``optax.chain``'s tuple,
      ``inject_hyperparams``'s state, ...), or an object with an
      ``opt_state`` attribute: a flax ``TrainState``, an ``nnx.Optimizer``.

  Raises:
    ValueError: if ``opt_state`` holds no ``AccumulateState``, or several.
  """
  if not _is_state(opt_state) and hasattr(opt_state, "opt_state"):
    opt_state = opt_state.opt_state
  found = [
    (path, x)
    for path, x in jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=_is_state)[0]
    if _is_state(x)
  ]
  if len(found) != 1:
    where = ", ".join(f"opt_state{jax.tree_util.keystr(p)}" for p, _ in found)
    raise ValueError(
      "Expected exactly one jaxaccum.accumulate state inside the optimizer "
      f"state, found {len(found)}"
      + (f": {where}" if where else "")
      + ". "
      + (
        "Pass the one you mean."
        if found
        else "Is the optimizer built with jaxaccum.accumulate(...)?"
      )
    )
  return found[0][1]


def _value(x: Any) -> jax.Array:
  """The array of ``x``, also where ``x`` is an ``nnx`` variable (the leaves
  of an ``nnx.Optimizer``'s state)."""
  return x[...] if isinstance(x, nnx.Variable) else x


def has_updated(opt_state: PyTree) -> jax.Array:
  """Whether the last ``update`` ran the inner optimizer (a window ended and
  was applied).

  False on the other calls of a window, and for a window that was not
  applied (all its micro-batches non-finite, or a loss-scale overflow).

  Args:
    opt_state: an optimizer state that holds one
      :func:`jaxaccum.accumulate` state, anywhere (see
      :func:`find_accumulate_state`); or a flax ``TrainState`` or an
      ``nnx.Optimizer`` whole.

  Returns:
    A bool array of shape (); it works under ``jit``.

  Raises:
    ValueError: if ``opt_state`` holds no accumulate state, or several.

  >>> import jax.numpy as jnp, optax, jaxaccum
  >>> tx = optax.chain(optax.clip_by_global_norm(1.0),
  ...                  jaxaccum.accumulate(optax.sgd(0.1), every_k=2))
  >>> params = jnp.zeros(2)
  >>> state = tx.init(params)
  >>> for _ in range(3):
  ...   _, state = tx.update(jnp.ones(2), state, params)
  ...   print(bool(jaxaccum.has_updated(state)), int(jaxaccum.inner_step(state)))
  False 0
  True 1
  False 1
  """
  return _value(find_accumulate_state(opt_state).updated)


def inner_step(opt_state: PyTree) -> jax.Array:
  """The inner optimizer's updates so far: optimizer steps, one per applied
  window (``AccumulateState.step``), where ``TrainState.step`` and
  ``nnx.Optimizer.step`` count calls.

  Args:
    opt_state: as for :func:`has_updated`.

  Returns:
    An int32 array of shape ().

  Raises:
    ValueError: if ``opt_state`` holds no accumulate state, or several.

  >>> import jax.numpy as jnp, optax, jaxaccum
  >>> tx = optax.inject_hyperparams(
  ...   lambda learning_rate: jaxaccum.accumulate(optax.sgd(learning_rate), 4)
  ... )(learning_rate=0.1)
  >>> params = jnp.zeros(2)
  >>> state = tx.init(params)
  >>> for _ in range(8):
  ...   _, state = tx.update(jnp.ones(2), state, params)
  >>> int(jaxaccum.inner_step(state)), int(state.count)  # windows, calls
  (2, 8)
  """
  return _value(find_accumulate_state(opt_state).step)


def window_size(opt_state: PyTree) -> jax.Array:
  """The current window's length, in micro-batches: ``every_k`` of
  :func:`jaxaccum.accumulate`, the ramp's value, or what
  :func:`jaxaccum.auto_k` chose.

  Args:
    opt_state: as for :func:`has_updated`.

  Returns:
    An int32 array of shape ().

  Raises:
    ValueError: if ``opt_state`` holds no accumulate state, or several.

  >>> import jax.numpy as jnp, optax, jaxaccum
  >>> tx = optax.chain(optax.clip(1.0), jaxaccum.accumulate(optax.sgd(0.1), lambda step: 2 + step))
  >>> state = tx.init(jnp.zeros(2))
  >>> sizes = []
  >>> for _ in range(5):
  ...   _, state = tx.update(jnp.ones(2), state, jnp.zeros(2))
  ...   sizes.append(int(jaxaccum.window_size(state)))
  >>> sizes  # a window of 2, then one of 3
  [2, 3, 3, 3, 4]
  """
  return _value(find_accumulate_state(opt_state).window_size)


def find_loss_scale(opt_state: PyTree) -> DynamicLossScale | None:
  """The loss scale of the ``accumulate(..., loss_scale=...)`` that sees the
  gradients first: ``tx`` itself or the first link of an ``optax.chain``
  (also inside ``inject_hyperparams`` or ``MultiSteps``); None if there is
  no loss scale. A scale anywhere else would leave other gradients scaled,
  so it raises a ``ValueError``.
  """
  is_scale = lambda x: isinstance(x, DynamicLossScale)  # noqa: E731
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_scale) if is_scale(x)]
  if not found:
    return None
  first = _first_transformation(opt_state)
  if len(found) > 1 or not _is_state(first) or first.loss_scale is None:
    raise ValueError(
      "make_train_step multiplies the whole loss by the loss scale, so the "
      "jaxaccum.accumulate(..., loss_scale=...) that unscales it must see "
      "every gradient first: pass it as tx, or first in optax.chain. This "
      f"opt_state holds {len(found)} loss scale(s) elsewhere."
    )
  return first.loss_scale


def _first_transformation(opt_state: PyTree) -> Any:
  """The state of the transformation that sees the gradients first, through
  the wrappers that pass every gradient on: ``inject_hyperparams``,
  ``MultiSteps`` and ``optax.chain`` (its first link)."""
  first = opt_state
  while not _is_state(first):
    if isinstance(
      first, (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)
    ):
      first = first.inner_state
    elif isinstance(first, optax.MultiStepsState):
      first = first.inner_opt_state
    elif type(first) is tuple and first:  # optax.chain
      first = first[0]
    else:
      break
  return first
