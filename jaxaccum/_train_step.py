"""``make_train_step``: one jitted, donated step of accumulation plus an update.

The step donates the parameters and the optimizer state (``donate_argnums``),
so XLA writes the new values into the old buffers instead of holding two
copies. A step whose loss or gradient is not finite is skipped: its update
is computed and dropped by a select (``jnp.where``), so parameters and
optimizer state come back unchanged and a NaN never reaches them. (A
``lax.cond`` would keep a second copy of both: its branches cannot update the
donated buffers in place.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxaccum import _accumulate, _calls
from jaxaccum._loss_scale import DynamicLossScale
from jaxaccum._transform import AccumulateState

PyTree = Any


def all_finite(tree: PyTree) -> jax.Array:
  """Whether every leaf of ``tree`` is finite; a scalar bool.

  >>> import jax.numpy as jnp
  >>> bool(all_finite({"a": jnp.ones(2), "b": jnp.array(jnp.nan)}))
  False
  """
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  return jnp.all(jnp.asarray(leaves)) if leaves else jnp.asarray(True)


def _select(pred: jax.Array, new: Any, old: Any) -> Any:
  """``new`` where ``pred``, else ``old`` (keys included), laid out as ``new``."""
  if jax.dtypes.issubdtype(jnp.result_type(new), jax.dtypes.prng_key):
    data = _select(pred, jax.random.key_data(new), jax.random.key_data(old))
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(new))
  new_sharding = getattr(jax.typeof(new), "sharding", None)
  if new_sharding is not None and jax.typeof(old).sharding != new_sharding:
    old = jax.sharding.reshard(old, new_sharding)
  return jnp.where(pred, new, old)


def find_loss_scale(opt_state: PyTree) -> DynamicLossScale | None:
  """The loss scale of the ``accumulate(..., loss_scale=...)`` that sees the
  gradients first: ``tx`` itself or the first link of an ``optax.chain``
  (also inside ``inject_hyperparams`` or ``MultiSteps``); None if there is
  no loss scale. A scale anywhere else would leave other gradients scaled,
  so it raises a ``ValueError``.
  """
  found = [
    x
    for x in jax.tree.leaves(
      opt_state, is_leaf=lambda x: isinstance(x, DynamicLossScale)
    )
    if isinstance(x, DynamicLossScale)
  ]
  if not found:
    return None
  first = opt_state
  while not isinstance(first, AccumulateState):
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
  if (
    len(found) > 1 or not isinstance(first, AccumulateState) or first.loss_scale is None
  ):
    raise ValueError(
      "make_train_step multiplies the whole loss by the loss scale, so the "
      "jaxaccum.accumulate(..., loss_scale=...) that unscales it must see "
      "every gradient first: pass it as tx, or first in optax.chain. This "
      f"opt_state holds {len(found)} loss scale(s) elsewhere."
    )
  return first.loss_scale


def make_train_step(
  loss_fn: Callable[..., Any],
  tx: optax.GradientTransformation,
  num_micro_batches: int | None = None,
  *,
  skip_nonfinite: bool = True,
  donate: bool = True,
  **value_and_grad_kwargs: Any,
) -> Any:
  """Builds ``step(params, opt_state, *args) -> (params, opt_state, value)``.

  The step runs ``jaxaccum.value_and_grad(loss_fn, num_micro_batches,
  **value_and_grad_kwargs)(params, *args)``, then ``tx.update`` once and
  ``optax.apply_updates``, inside one ``jax.jit``.

  Args:
    loss_fn: ``loss_fn(params, batch, ...)``, as for
      :func:`jaxaccum.value_and_grad` with ``argnums=0``; the batch is
      ``batch_argnums`` (default 1) of ``loss_fn``'s arguments.
    tx: the optimizer, run once per step.
    num_micro_batches: ``k``; or give ``micro_batch_size``.
    skip_nonfinite: if the value or a gradient is NaN or Inf, return the
      parameters and optimizer state unchanged (the update is computed and
      dropped by ``jnp.where``), and with ``state_argnum`` the state as it
      came in.
      For float16, pass ``tx = jaxaccum.accumulate(inner, 1,
      loss_scale=jaxaccum.dynamic_loss_scale())``: the step then multiplies
      the loss by the current scale, and ``accumulate`` unscales the
      gradients, skips a step that overflowed and adjusts the scale once per
      step. Inside an ``optax.chain``, put that ``accumulate`` first, so that
      nothing sees the gradients before they are unscaled (anywhere else,
      e.g. under ``optax.masked``, the step raises a ``ValueError``). With
      ``noise_stats``, the noise is reported unscaled.
    donate: donate ``params`` and ``opt_state`` to the step. Do not use the
      arrays you passed in after the call.
    **value_and_grad_kwargs: the options of :func:`jaxaccum.value_and_grad`
      (``micro_batch_size``, ``batch_argnums``, ``has_aux``, ``normalize``,
      ``rng_argnum``, ``state_argnum``, ``remat``, ``mesh``, ...).

  Returns:
    The jitted step. It is ``jax.jit``-like (``.lower(...)`` works on it),
    except that Python values passed by keyword (``train=False``) are static:
    ``loss_fn`` sees them as Python values and each value compiles once.
    Arrays passed by keyword are traced.
    ``value`` is what ``value_and_grad`` returns first: the loss, or
    ``(loss, aux)`` with ``has_aux``; with ``noise_stats=True`` it is
    ``(that, noise)``, the step's :class:`jaxaccum.GradientNoise`.

  >>> import jax.numpy as jnp, optax, jaxaccum
  >>> loss = lambda w, x: jnp.mean((x @ w - 1.0) ** 2)
  >>> step = jaxaccum.make_train_step(loss, optax.sgd(0.1), num_micro_batches=4)
  >>> w, x = jnp.zeros(2), jnp.ones((8, 2))
  >>> opt_state = optax.sgd(0.1).init(w)
  >>> w, opt_state, value = step(w, opt_state, x)
  >>> float(value), [round(float(v), 4) for v in w]
  (1.0, [0.2, 0.2])
  """
  if value_and_grad_kwargs.get("argnums", 0) != 0:
    raise ValueError("make_train_step differentiates the parameters, argnums=0.")
  has_aux = value_and_grad_kwargs.get("has_aux", False)
  weighted = value_and_grad_kwargs.get("normalize", "mean") == "weighted"
  noise_stats = value_and_grad_kwargs.get("noise_stats", False)
  state_argnum = value_and_grad_kwargs.get("state_argnum")

  def scaled_loss_fn(*args, _jaxaccum_loss_scale, **kwargs):
    """``loss_fn`` with its loss (not its weight or aux) times the scale."""
    out = loss_fn(*args, **kwargs)
    value, aux = out if has_aux else (out, None)
    if weighted:
      value = (_jaxaccum_loss_scale.scale_loss(value[0]), value[1])
    else:
      value = _jaxaccum_loss_scale.scale_loss(value)
    return (value, aux) if has_aux else value

  grad_fn = _accumulate.value_and_grad(
    loss_fn, num_micro_batches, **value_and_grad_kwargs
  )
  scaled_grad_fn = _accumulate.value_and_grad(
    scaled_loss_fn, num_micro_batches, **value_and_grad_kwargs
  )

  def step(params, opt_state, /, *args, **kwargs):
    loss_scale = find_loss_scale(opt_state)
    if loss_scale is None:
      out = grad_fn(params, *args, **kwargs)
    else:
      out = scaled_grad_fn(params, *args, _jaxaccum_loss_scale=loss_scale, **kwargs)
    (value, grads), noise = out if noise_stats else (out, None)
    loss = value[0] if has_aux else value
    if loss_scale is not None:
      loss = loss / loss_scale.scale  # float32, like the scaled loss
      value = (loss, value[1]) if has_aux else loss
      if noise is not None:  # measured on scaled gradients
        unscale = loss_scale.scale.astype(jnp.float32) ** 2
        noise = noise._replace(
          small_sq_norm=noise.small_sq_norm / unscale,
          big_sq_norm=noise.big_sq_norm / unscale,
        )
    finite = all_finite(grads) & all_finite(loss)
    if state_argnum is not None and skip_nonfinite:
      # A skipped step leaves the threaded state (BatchNorm statistics) as it
      # was too: one bad batch must not poison every later step.
      old_state = args[state_argnum - 1]
      aux, new_state = value[1]
      new_state = jax.tree.map(
        lambda new, old: _select(finite, new, old), new_state, old_state
      )
      value = (loss, (aux, new_state))

    def apply(params, opt_state, grads):
      updates, next_state = tx.update(grads, opt_state, params)
      # The state keeps its dtypes (adam's mu would come back promoted with the
      # gradients'): the select below, donation and the next call need the
      # same types.
      next_state = jax.tree.map(
        lambda new, old: (
          new
          if jnp.result_type(new) == jnp.result_type(old)
          else jnp.asarray(new).astype(jnp.result_type(old))
        ),
        next_state,
        opt_state,
      )
      return optax.apply_updates(params, updates), next_state

    if not skip_nonfinite or loss_scale is not None:
      # float16: accumulate() unscales, skips overflowing windows and adjusts
      # the scale itself.
      params, opt_state = apply(params, opt_state, grads)
    else:
      # Select, do not branch: a lax.cond returning either the inputs or the
      # new values cannot update the donated buffers in place, and held a
      # second copy of the parameters and the optimizer state (+640 MiB for
      # a 109M-parameter Adam step on an H100 target). A skipped step's
      # update is computed from its non-finite gradient and dropped here;
      # zeroing that gradient first would cost another copy of it.
      new_params, new_state = apply(params, opt_state, grads)
      keep = lambda new, old: _select(finite, new, old)  # noqa: E731
      params = jax.tree.map(keep, new_params, params)
      opt_state = jax.tree.map(keep, new_state, opt_state)
    return params, opt_state, ((value, noise) if noise_stats else value)

  return _calls.JitWithStaticKwargs(step, donate_argnums=(0, 1) if donate else ())
