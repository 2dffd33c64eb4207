"""``accumulate()``: accumulation across calls, as an optax transformation.

Use it when the micro-batches arrive one call at a time (a data loader that
yields small batches, a generator, an RL rollout). Each ``update`` adds one
micro-batch gradient into a float32 accumulator; the call that completes a
window runs the inner optimizer once, under ``lax.cond``, on the normalized
sum. Unlike ``optax.MultiSteps``, the inner optimizer does not run on every
micro-step, and nothing is masked by multiplication.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxaccum import _normalize, _stats
from jaxaccum._loss_scale import DynamicLossScale

PyTree = Any


class WindowNoise(NamedTuple):
  """The gradient-noise measurements of :func:`accumulate`.

  Attributes:
    sq_norm_sum: the current window's sum of ``|g_i / w_i|²`` over its kept
      micro-batches (``w_i = 1`` without ``weight=``); shape=(), float32.
    num_micro_batches: the current window's kept micro-batches of positive weight;
      shape=(), float32.
    last: the last completed window's :class:`GradientNoise`, in units of
      ``weight`` (micro-batches without ``weight=``: multiply ``B_simple``
      by the micro-batch size for examples); zeros before the first window
      (``has_estimate()`` is False, and ``noise_scale_update`` leaves it out).
  """

  sq_norm_sum: jax.Array
  num_micro_batches: jax.Array
  last: _stats.GradientNoise


class AccumulateState(NamedTuple):
  """The state of :func:`accumulate`.

  Attributes:
    micro_step: calls seen in the current window; shape=(), int32.
    step: optimizer steps taken, i.e. inner updates; shape=(), int32.
    acc_grads: the window's gradient sum; like the parameters, at least
      ``accum_dtype``.
    acc_weight: the window's weight sum (1 per micro-batch without
      ``weight=``); shape=(), float32.
    inner_state: the inner transformation's state.
    num_skipped: non-finite micro-batches dropped so far; shape=(), int32.
    noise: gradient-noise measurements (zeros unless ``noise_stats``).
    loss_scale: the :class:`DynamicLossScale` (``None`` without one).
    window_finite: no micro-batch of the current window overflowed;
      shape=(), bool.
    updated: the last ``update`` ran the inner optimizer; shape=(), bool.
      Read it with :func:`jaxaccum.has_updated`, also from inside a chain,
      a ``TrainState`` or an ``nnx.Optimizer``.
  """

  micro_step: jax.Array
  step: jax.Array
  acc_grads: PyTree
  acc_weight: jax.Array
  inner_state: PyTree
  num_skipped: jax.Array
  noise: WindowNoise
  loss_scale: DynamicLossScale | None
  window_finite: jax.Array
  updated: jax.Array


def _window_size(
  every_k: int | Callable[[jax.Array], Any],
) -> Callable[[jax.Array], jax.Array]:
  if callable(every_k):
    return lambda step: jnp.maximum(jnp.asarray(every_k(step), jnp.int32), 1)
  if isinstance(every_k, bool) or not isinstance(every_k, int):
    raise TypeError(f"every_k must be an int or a callable, got {every_k!r}.")
  if every_k <= 0:
    raise ValueError(f"every_k must be positive, got {every_k=}.")
  return lambda step: jnp.asarray(every_k, jnp.int32)


def _all_finite(tree: PyTree) -> jax.Array:
  return jnp.all(jnp.asarray([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def _scalar(value: float, dtype: Any = jnp.float32) -> jax.Array:
  """A fresh scalar array. Every state field gets its own buffer: fields that
  shared one could not be donated (``donate_argnums``)."""
  return jnp.full((), value, dtype)


def _cast_like(tree: PyTree, like: PyTree) -> PyTree:
  """``tree`` with the dtypes of ``like`` (arrays or ``jax.ShapeDtypeStruct``s)
  and no weak types; a leaf that already has them is returned as it is."""

  def cast(x, target):
    aval = jax.typeof(x)
    if aval.dtype == target.dtype and not getattr(aval, "weak_type", False):
      return x
    return jax.lax.convert_element_type(x, target.dtype)

  return jax.tree.map(cast, tree, like)


def _inner_init(inner: optax.GradientTransformationExtraArgs, params: PyTree) -> PyTree:
  """``inner.init(params)`` at the dtypes that its state keeps.

  Many optimizers create their state in the parameters' dtype and return it
  in the dtype promoted with the gradients' (adam's ``mu``: float16 params
  and float32 gradients give a float32 ``mu``). A state that changes dtype
  cannot go through ``lax.cond``, a ``lax.scan`` carry or donation, so
  :func:`accumulate` fixes the inner state's dtypes here, once: those after
  one inner update on gradients in the parameters' dtype (what ``jax.grad``
  gives), which for optax's optimizers are the dtypes of ``inner.init``. Each
  window casts the inner state back to them, as ``optax.MultiSteps`` does.
  """
  state = inner.init(params)
  grads = jax.tree.map(
    lambda p: jax.ShapeDtypeStruct(jnp.shape(p), _normalize.result_dtype(p)), params
  )
  try:
    _, after = jax.eval_shape(inner.update, grads, state, params)
  except Exception:  # an inner update that needs keyword arguments (value=)
    after = state
  after_struct: Any = jax.tree.structure(after)
  if after_struct != jax.tree.structure(state):
    after = state
  return _cast_like(state, after)


def _no_noise() -> _stats.GradientNoise:
  """Zeros: no estimate (``has_estimate()`` is False), and no NaN for
  ``jax_debug_nans`` to report."""
  return _stats.GradientNoise(*(_scalar(0.0) for _ in range(4)))


def accumulate(
  inner: optax.GradientTransformation,
  every_k: int | Callable[[jax.Array], Any],
  *,
  accum_dtype: Any = jnp.float32,
  skip_nonfinite: bool = True,
  noise_stats: bool = False,
  loss_scale: DynamicLossScale | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Accumulates ``every_k`` micro-batch gradients, then runs ``inner`` once.

  ``update(grads, state, params=None, *, weight=None, flush=False, **extra)``
  adds one micro-batch gradient. The call that completes a window of
  ``every_k`` micro-batches runs ``inner.update`` once, under ``lax.cond``, on
  the normalized sum and returns its updates; the other calls return zeros
  and leave ``inner``'s state untouched.

  The normalized sum is the mean over the window's micro-batches, or
  ``sum(grads) / sum(weight)`` when ``weight`` is given (then ``grads`` are
  gradients of loss *sums*, e.g. over tokens, and ``weight`` is the token
  count). This is the exact token mean of the window, however the tokens
  fall into micro-batches.

  Args:
    inner: the optimizer to run once per window, e.g. ``optax.adam(1e-3)``.
    every_k: micro-batches per window: an int, or a callable from the
      optimizer step (``state.step``) to an int, for a batch-size ramp.
    accum_dtype: the dtype of the sums (float32 by default, also for bf16
      gradients); a wider gradient dtype is kept.
    skip_nonfinite: drop a micro-batch whose gradient or weight contains NaN
      or Inf (or whose weight is negative) from its window and count it in
      ``num_skipped``. The accumulator and the parameters stay finite. A
      window in which nothing valid was accumulated (total weight 0) applies
      no update and does not advance ``step``.
    noise_stats: measure the gradient noise scale: each call adds the squared
      norm of its (per-weight) gradient, and each completed window stores a
      :class:`GradientNoise` in ``state.noise.last``.
    loss_scale: float16 training with dynamic loss scaling: the initial
      :class:`DynamicLossScale`. Multiply your loss by
      ``state.loss_scale.scale`` before differentiating; ``update`` divides
      the gradients by it in float32, and ``inner`` gets the float32 mean.
      A window in which any micro-batch
      overflowed is skipped as a whole, and the scale is adjusted once per
      window, never within one.

  Dtypes: ``inner`` gets the window's mean in the dtype of the gradients
  passed (float32 with ``loss_scale``) and its updates come back as it makes
  them, zeros of those dtypes on the other calls. Its state keeps the dtypes
  of ``inner.init(params)`` (more exactly: those after one inner update on
  gradients in the parameters' dtype; the same for optax's optimizers), so
  that ``lax.cond``, a ``lax.scan`` carry and donation see one type: where
  gradients of another dtype would promote it (float32 gradients on bfloat16
  parameters make adam's ``mu`` float32), each window casts it back, as
  ``optax.MultiSteps`` does. Ask for a wider state with the optimizer's own
  option, e.g. ``optax.adam(..., mu_dtype=jnp.float32)``.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; its ``update`` also takes
    ``weight`` (a scalar) and ``flush`` (a bool: end the window now, e.g. at
    the end of an epoch, normalized by what it holds). Other keyword arguments
    are passed on to ``inner.update``: those of the call that completes the
    window (e.g. ``value=`` for ``optax.contrib.reduce_on_plateau`` should
    then be the window's loss).

  >>> import jax.numpy as jnp, optax, jaxaccum
  >>> tx = jaxaccum.accumulate(optax.sgd(1.0), every_k=2)
  >>> params = jnp.zeros(2)
  >>> state = tx.init(params)
  >>> u, state = tx.update(jnp.array([1.0, 2.0]), state, params)
  >>> u.tolist(), int(state.step)
  ([0.0, 0.0], 0)
  >>> u, state = tx.update(jnp.array([3.0, 4.0]), state, params)
  >>> u.tolist(), int(state.step)
  ([-2.0, -3.0], 1)
  """
  inner = optax.with_extra_args_support(inner)
  window_size = _window_size(every_k)
  _normalize.check_accum_dtype(accum_dtype)

  def init_fn(params):
    return AccumulateState(
      micro_step=_scalar(0, jnp.int32),
      step=_scalar(0, jnp.int32),
      acc_grads=jax.tree.map(
        lambda p: jnp.zeros(jnp.shape(p), _normalize.accumulator_dtype(accum_dtype, p)),
        params,
      ),
      acc_weight=_scalar(0.0),
      inner_state=_inner_init(inner, params),
      num_skipped=_scalar(0, jnp.int32),
      noise=WindowNoise(_scalar(0.0), _scalar(0.0), _no_noise()),
      loss_scale=None if loss_scale is None else jax.tree.map(jnp.copy, loss_scale),
      window_finite=_scalar(True, jnp.bool_),
      updated=_scalar(False, jnp.bool_),
    )

  def update_fn(grads, state, params=None, *, weight=None, flush=False, **extra_args):
    weight = jnp.ones((), jnp.float32) if weight is None else weight
    weight = jnp.asarray(weight, jnp.float32)
    if weight.shape != ():
      raise ValueError(f"weight must be a scalar, got shape={weight.shape}.")
    grads_struct: Any = jax.tree.structure(grads)
    params_struct: Any = jax.tree.structure(state.acc_grads)
    if grads_struct != params_struct:
      raise ValueError(
        "grads do not have the structure of the parameters accumulate() was "
        f"initialized with: {grads_struct} vs {params_struct}."
      )
    for (path, g), a in zip(
      jax.tree_util.tree_leaves_with_path(grads),
      jax.tree.leaves(state.acc_grads),
      strict=True,
    ):
      if jnp.shape(g) != jnp.shape(a):
        raise ValueError(
          f"The gradient leaf grads{jax.tree_util.keystr(path)} has "
          f"shape={jnp.shape(g)}, but accumulate() was initialized with "
          f"parameters whose leaf there has shape={jnp.shape(a)}."
        )
    summand = grads if state.loss_scale is None else state.loss_scale.unscale(grads)
    finite = _all_finite(summand) & jnp.isfinite(weight) & (weight >= 0)
    valid = (
      finite if (skip_nonfinite or state.loss_scale is not None) else jnp.asarray(True)
    )
    acc_grads = jax.tree.map(
      lambda a, g: jnp.where(valid, a + g.astype(a.dtype), a), state.acc_grads, summand
    )
    acc_weight = jnp.where(valid, state.acc_weight + weight, state.acc_weight)
    window_finite = state.window_finite & finite
    noise = state.noise
    if noise_stats:
      counted = valid & (weight > 0)
      per_weight = _stats.sq_norm(summand) / jnp.where(counted, weight, 1.0) ** 2
      noise = noise._replace(
        sq_norm_sum=jnp.where(
          counted, noise.sq_norm_sum + per_weight, noise.sq_norm_sum
        ),
        num_micro_batches=noise.num_micro_batches + counted.astype(jnp.float32),
      )

    micro_step = state.micro_step + 1
    window_done = (micro_step >= window_size(state.step)) | jnp.asarray(flush)
    apply = window_done & (acc_weight > 0)
    if state.loss_scale is not None:
      apply = apply & window_finite

    def inner_update(acc_grads, acc_weight, inner_state, noise):
      mean = _normalize.safe_divide(acc_grads, acc_weight)
      # In the gradients' dtype, or float32 once unscaled from a loss scale
      # (a float16 mean would underflow where the scale had saved it).
      updates, new_inner_state = inner.update(
        jax.tree.map(lambda m, g: m.astype(g.dtype), mean, summand),
        inner_state,
        params,
        **extra_args,
      )
      # The state keeps its dtypes, whatever the gradients' dtype promoted it to.
      new_inner_state = _cast_like(new_inner_state, inner_state)
      if noise_stats:
        noise = noise._replace(
          last=_stats.NoiseSums(
            noise.sq_norm_sum, noise.num_micro_batches, acc_weight
          ).finalize(_stats.sq_norm(mean))
        )
      return updates, new_inner_state, noise

    def no_update(acc_grads, acc_weight, inner_state, noise):
      shapes = jax.eval_shape(inner_update, acc_grads, acc_weight, inner_state, noise)
      zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes[0])
      return zeros, inner_state, noise

    updates, inner_state, noise = jax.lax.cond(
      apply, inner_update, no_update, acc_grads, acc_weight, state.inner_state, noise
    )
    zero = jnp.zeros((), jnp.float32)
    new_loss_scale = state.loss_scale
    if new_loss_scale is not None:
      adjusted = new_loss_scale.adjust(window_finite)
      new_loss_scale = jax.tree.map(
        lambda new, old: jnp.where(window_done, new, old), adjusted, new_loss_scale
      )
    new_state = AccumulateState(
      micro_step=jnp.where(window_done, 0, micro_step),
      step=state.step + apply.astype(jnp.int32),
      acc_grads=jax.tree.map(
        lambda a: jnp.where(window_done, jnp.zeros_like(a), a), acc_grads
      ),
      acc_weight=jnp.where(window_done, 0.0, acc_weight),
      inner_state=inner_state,
      num_skipped=state.num_skipped + (~valid).astype(jnp.int32),
      noise=noise._replace(
        sq_norm_sum=jnp.where(window_done, zero, noise.sq_norm_sum),
        num_micro_batches=jnp.where(window_done, zero, noise.num_micro_batches),
      ),
      loss_scale=new_loss_scale,
      window_finite=window_done | window_finite,
      updated=apply,
    )
    return updates, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
