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

from jaxaccum import _calls, _compat, _options, _tree, _value_and_grad
from jaxaccum._engine import Result
from jaxaccum._loss_scale import DynamicLossScale
from jaxaccum._opt_state import find_loss_scale

PyTree = Any


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
    skip_nonfinite: skip a step that has nothing to learn from: its value or
      a gradient is NaN or Inf, or (``normalize="weighted"``) its total
      weight is zero, a batch of padding only. The parameters and optimizer
      state come back unchanged (the update is computed and dropped by
      ``jnp.where``), with ``state_argnum`` the state too, and the value
      reported is the one that caused the skip.
      For float16, pass ``tx = jaxaccum.accumulate(inner, 1,
      loss_scale=jaxaccum.dynamic_loss_scale())``: the step then multiplies
      the loss by the current scale, and ``accumulate`` unscales the
      gradients, skips a step that overflowed and adjusts the scale once per
      step. Inside an ``optax.chain``, put that ``accumulate`` first, so that
      nothing sees the gradients before they are unscaled (anywhere else,
      e.g. under ``optax.masked``, the step raises a ``ValueError``). With
      ``noise_stats``, the noise is reported unscaled.
    donate: donate ``params`` and ``opt_state`` to the step, so that XLA
      writes the new values into their buffers. The arrays you passed are
      deleted by the call: use the ones it returns. Reading the old ones
      raises JAX's ``RuntimeError: Array has been deleted``, and passing them
      to the step again raises a ``ValueError`` saying so. ``donate=False``
      keeps them, at the cost of a second copy of both.
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
  options = _options.create(loss_fn, num_micro_batches, **value_and_grad_kwargs)
  plain = _value_and_grad.Step(loss_fn, options)
  scaled = _value_and_grad.Step(_scaled(loss_fn, options), options)

  def step(params, opt_state, /, *args, **kwargs):
    loss_scale = find_loss_scale(opt_state)
    if loss_scale is None:
      result = plain(params, *args, **kwargs)
    else:
      result = scaled(params, *args, _jaxaccum_loss_scale=loss_scale, **kwargs)
      result = _unscaled(result, loss_scale)
    engine_options = plain.engine(len(args) + 1).options
    ok = worth_a_step(result, options)
    if engine_options.state_argnum is not None and skip_nonfinite:
      # A skipped step leaves the threaded state (BatchNorm statistics) as it
      # was too: one bad batch must not poison every later step.
      old_state = args[engine_options.state_argnum - 1]
      aux, new_state = result.aux
      result = result._replace(aux=(aux, _tree.select(ok, new_state, old_state)))
    if not skip_nonfinite or loss_scale is not None:
      # float16: accumulate() unscales, skips overflowing windows and adjusts
      # the scale itself.
      params, opt_state = _apply(tx, params, opt_state, result.grads[0])
    else:
      # Select, do not branch: a lax.cond returning either the inputs or the
      # new values cannot update the donated buffers in place, and held a
      # second copy of the parameters and the optimizer state (+640 MiB for
      # a 109M-parameter Adam step on an H100 target). A skipped step's
      # update is computed from its non-finite gradient and dropped here;
      # zeroing that gradient first would cost another copy of it.
      new_params, new_state = _apply(tx, params, opt_state, result.grads[0])
      params = _tree.select(ok, new_params, params)
      opt_state = _tree.select(ok, new_state, opt_state)
    value = (result.value, result.aux) if options.has_aux else result.value
    return params, opt_state, ((value, result.noise) if options.noise_stats else value)

  jitted = _calls.JitWithStaticKwargs(step, donate_argnums=(0, 1) if donate else ())
  return _checked_donation(jitted) if donate else jitted


def _scaled(
  loss_fn: Callable[..., Any], options: _options.Options
) -> Callable[..., Any]:
  """``loss_fn`` with its loss (not its weight or aux) times the loss scale."""

  def scaled_loss_fn(*args, _jaxaccum_loss_scale, **kwargs):
    out = loss_fn(*args, **kwargs)
    value, aux = out if options.has_aux else (out, None)
    if options.normalize == "weighted":
      value = (_jaxaccum_loss_scale.scale_loss(value[0]), value[1])
    else:
      value = _jaxaccum_loss_scale.scale_loss(value)
    return (value, aux) if options.has_aux else value

  return scaled_loss_fn


def _unscaled(result: Result, loss_scale: DynamicLossScale) -> Result:
  """The value (float32, like the scaled loss) and the noise of a step run on
  a scaled loss, divided back. The gradients stay scaled: accumulate()
  unscales them."""
  return result._replace(
    value=result.value / loss_scale.scale,
    noise=None if result.noise is None else result.noise.unscaled(loss_scale.scale),
  )


def worth_a_step(result: Result, options: _options.Options) -> jax.Array:
  """The step is taken only if its value and gradients are finite and, with
  ``normalize="weighted"``, its total weight is not zero (a batch of padding
  only has nothing to learn from: Adam's momentum would still move)."""
  ok = _tree.all_finite(result.grads) & jnp.all(jnp.isfinite(result.value))
  if options.normalize == "weighted":
    ok = ok & (result.total_weight != 0)
  return ok


def _apply(
  tx: optax.GradientTransformation, params: PyTree, opt_state: PyTree, grads: PyTree
):
  updates, next_state = tx.update(grads, opt_state, params)
  # The state keeps its dtypes (adam's mu would come back promoted with the
  # gradients'): the select, donation and the next call need the same types.
  next_state = _tree.cast_like(next_state, opt_state)
  return optax.apply_updates(params, updates), next_state


def _checked_donation(step: _calls.JitWithStaticKwargs) -> Any:
  """``step``, raising a clear error when it is given parameters or an
  optimizer state that an earlier call already donated."""

  class DonatingStep:
    __wrapped__ = step.__wrapped__

    def __call__(self, params, opt_state, /, *args, **kwargs):
      for name, tree in (("params", params), ("opt_state", opt_state)):
        if _donated(tree):
          raise ValueError(
            f"make_train_step donates params and opt_state, and the {name} "
            "passed were donated to an earlier call: pass the ones that call "
            "returned, or build the step with donate=False."
          )
      return step(params, opt_state, *args, **kwargs)

    def lower(self, *args, **kwargs):
      return step.lower(*args, **kwargs)

    def trace(self, *args, **kwargs):
      return step.trace(*args, **kwargs)

  return DonatingStep()


def _donated(tree: PyTree) -> bool:
  """Whether ``tree`` was donated: one leaf tells (a donation takes all)."""
  x = next(iter(jax.tree.leaves(tree)), None)
  return isinstance(x, jax.Array) and not _compat.is_tracer(x) and x.is_deleted()
