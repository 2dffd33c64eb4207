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

from jaxaccum import _noise_scale, _normalize, _privacy, _static, _tree
from jaxaccum._optim import autopilot as _autopilot
from jaxaccum._optim import every_k as _every_k
from jaxaccum._optim import window_rules as _rules
from jaxaccum._optim.loss_scale import DynamicLossScale

PyTree = Any


class WindowNoise(NamedTuple):
  """The gradient-noise measurements of :func:`accumulate`.

  Attributes:
    window: the current window's :class:`~jaxaccum._noise_scale.NoiseSums`: over
      its kept micro-batches of positive weight, ``|g_i / w_i|²`` and the
      weights (``w_i = 1`` without ``weight=``).
    last: the last completed window's :class:`GradientNoise`, in units of
      ``weight`` (micro-batches without ``weight=``: multiply ``B_simple``
      by the micro-batch size for examples); zeros before the first window
      (``has_estimate()`` is False, and ``noise_scale_update`` leaves it out).
  """

  window: _noise_scale.NoiseSums
  last: _noise_scale.GradientNoise


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
    window_size: the current window's length, in micro-batches; shape=(),
      int32. Read it with :func:`jaxaccum.window_size`.
    autopilot: with ``every_k=jaxaccum.auto_k(...)``, its
      :class:`~jaxaccum._optim.autopilot.AutoKState` (the smoothed ``B_simple``,
      the learning-rate factor); None otherwise.
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
  window_size: jax.Array
  autopilot: _autopilot.AutoKState | None


def _scalar(value: float, dtype: Any = jnp.float32) -> jax.Array:
  """A fresh scalar array. Every state field gets its own buffer: fields that
  shared one could not be donated (``donate_argnums``)."""
  return jnp.full((), value, dtype)


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
  return _tree.cast_like(state, after)


def _init_state(
  inner: optax.GradientTransformationExtraArgs,
  params: PyTree,
  accum_dtype: Any,
  loss_scale: DynamicLossScale | None,
  every_k: Any,
  *,
  combine: Any = None,
) -> AccumulateState:
  return AccumulateState(
    micro_step=_scalar(0, jnp.int32),
    step=_scalar(0, jnp.int32),
    acc_grads=_rules.zeros(_rules.rules(combine, params), params, accum_dtype),
    acc_weight=_scalar(0.0),
    inner_state=_inner_init(inner, params),
    num_skipped=_scalar(0, jnp.int32),
    noise=WindowNoise(_noise_scale.NoiseSums.zeros(), _noise_scale.no_estimate()),
    loss_scale=None if loss_scale is None else jax.tree.map(jnp.copy, loss_scale),
    window_finite=_scalar(True, jnp.bool_),
    updated=_scalar(False, jnp.bool_),
    window_size=_every_k.first(every_k),
    autopilot=every_k.init() if _autopilot.is_auto(every_k) else None,
  )


def _check_state(state: Any) -> None:
  """The state of an ``update`` call is an :class:`AccumulateState`."""
  if not isinstance(state, AccumulateState):
    raise TypeError(
      f"accumulate()'s update got a {type(state).__name__} as its state, not an "
      "AccumulateState: restore a checkpoint with tx.init(params) as the target "
      "(e.g. orbax's StandardRestore(tx.init(params))), so that it comes back "
      "with its type."
    )


def _check_update_args(grads: PyTree, state: Any, weight: Any) -> jax.Array:
  """Trace-time checks of one ``update`` call; returns the weight as a
  float32 scalar."""
  weight = jnp.asarray(1.0 if weight is None else weight, jnp.float32)
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
  return weight


class _Window(NamedTuple):
  """The window after one more micro-batch, before its end is decided."""

  acc_grads: PyTree
  acc_weight: jax.Array
  noise: WindowNoise
  finite: jax.Array  # this micro-batch is finite
  valid: jax.Array  # this micro-batch was added
  window_finite: jax.Array


def _add_micro_batch(
  state: AccumulateState,
  summand: PyTree,
  weight: jax.Array,
  *,
  drop_nonfinite: bool,
  noise_stats: bool,
  weight_decides: bool = True,
  rules: tuple[_rules.Rule, ...],
) -> _Window:
  """Adds one micro-batch's gradient to the window, or drops it (selected
  away, never multiplied: ``0 * nan`` is ``nan``) when it is not finite (nor
  its weight, unless ``weight_decides`` is False: under ``dp_noise`` with a
  public denominator the weight is private and enters no update, so it must
  not decide which clipped sums count either)."""
  finite = _tree.all_finite(_rules.gradients(rules, summand))
  if weight_decides:
    finite = finite & jnp.isfinite(weight) & (weight >= 0)
  valid = finite if drop_nonfinite else jnp.asarray(True)
  acc_grads = _rules.added(rules, state.acc_grads, summand, valid)
  noise = state.noise
  if noise_stats:
    counted = valid & (weight > 0)
    this = _noise_scale.NoiseSums.of(
      _tree.sq_norm(summand),
      jnp.where(counted, weight, 1.0),
      jnp.where(counted, weight, 0.0),
    )
    noise = noise._replace(window=noise.window + this)
  return _Window(
    acc_grads=acc_grads,
    acc_weight=jnp.where(valid, state.acc_weight + weight, state.acc_weight),
    noise=noise,
    finite=finite,
    valid=valid,
    window_finite=state.window_finite & finite,
  )


def accumulate(
  inner: optax.GradientTransformation,
  every_k: int | Callable[[jax.Array], Any] | _autopilot.AutoK,
  *,
  accum_dtype: Any = jnp.float32,
  skip_nonfinite: bool = True,
  noise_stats: bool = False,
  loss_scale: DynamicLossScale | None = None,
  combine: Any = None,
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

  ``init`` and ``update`` take an Equinox module as ``params``: its
  floating-point arrays, the leaves its gradients have (None elsewhere, as
  from ``eqx.filter_grad`` or :func:`value_and_grad`).

  Args:
    inner: the optimizer to run once per window, e.g. ``optax.adam(1e-3)``.
    every_k: micro-batches per window: an int; a callable from the
      optimizer step (``state.step``) to an int, for a batch-size ramp of
      your own; or :func:`jaxaccum.auto_k`, which follows the measured
      critical batch size (and turns ``noise_stats`` on). Each window's
      length is fixed when it starts; :func:`jaxaccum.window_size` reads it.
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
    combine: the rule of leaves that are not gradients, as
      :func:`jaxaccum.value_and_grad`'s ``combine=``; Flax's FP8 metadata
      takes ``"max"``. Such a leaf is combined over the window, never
      normalized, and its update on the window's last call writes the
      combined value over the parameter (``params`` is then required). For
      the full batch's output-gradient amax, differentiate each micro-batch's
      share of the window's loss (``loss / k``) and pass ``weight=1 / k``.

  DP-SGD: with :func:`jaxaccum.dp_noise` first in ``inner``, feed each
  micro-batch's clipped *sum* as the :class:`jaxaccum.ClipRecord` that
  ``grad(fun, k, clip_per_example=C, normalize="sum", clip_record=True)``
  returns, in place of the gradient; ``weight`` defaults to its number of
  real examples. Anything else is a ``ValueError`` at trace time: a plain
  gradient (unclipped, or its record lost), a record built by hand, a record
  clipped at another norm than the noise's ``clip_norm``, or of another
  ``normalize`` than ``"sum"`` (a mean would shrink the signal against the
  noise). A record is taken once: fed again (to this window or any other
  update) it raises (:class:`jaxaccum.ClipRecord` says how). The noise is
  added once per window, inside the branch that runs ``inner``, to the
  window's clipped sum, the records' float32 ``clipped_sum`` added up in
  ``accum_dtype`` (never their gradients rounded to the parameters' dtype);
  ``inner`` gets a record of it, so ``dp_noise``
  anywhere but first in ``inner`` is refused too. The window's noisy sum is
  divided by a public number, never by a private weight: ``dp_noise``'s
  ``expected_batch_size`` (``"poisson"``), the count of real examples
  (``"fixed"``: public at a fixed batch size), or, for a weighted window
  (``weight=`` given, e.g. token counts), ``dp_noise``'s
  ``expected_weight``, which ``weight=`` needs (and which needs
  ``weight=``). Under a public denominator a window without examples still
  applies its noise, and the weights decide nothing (a micro-batch is not
  dropped for its weight).

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
  _every_k.check(every_k)
  _normalize.check_accum_dtype(accum_dtype)
  _rules.check_combine(combine)
  noise_stats = noise_stats or _autopilot.is_auto(every_k)  # it steers by noise
  warned: list[bool] = []  # one ClipWithoutNoiseWarning per accumulate()

  def init_fn(params):
    return _init_state(inner, params, accum_dtype, loss_scale, every_k, combine=combine)

  def update_fn(grads, state, params=None, *, weight=None, flush=False, **extra_args):
    _check_state(state)
    noise_config = _privacy.find_noise(state.inner_state)
    rules = _rules.rules(combine, _privacy.gradient_of(grads))
    summand, window = _micro_batch(
      grads,
      state,
      weight,
      clip_record=extra_args.pop("clip_record", None),
      noise_config=noise_config,
      warned=warned,
      skip_nonfinite=skip_nonfinite,
      noise_stats=noise_stats,
      rules=rules,
    )
    done = (state.micro_step + 1 >= state.window_size) | jnp.asarray(flush)
    apply = _applies(done, window, noise_config, state.loss_scale)
    inner_update = _inner_update(
      inner,
      every_k,
      state=state,
      summand=summand,
      params=params,
      extra_args=extra_args,
      noise_config=noise_config,
      noise_stats=noise_stats,
      rules=rules,
    )
    updates, inner_state, noise = _inner_or_zeros(
      apply, inner_update, window, state.inner_state
    )
    new_state = _next_state(
      state, window, done, apply, (inner_state, noise), rules=rules
    )
    window_size, autopilot = _every_k.next_window(
      every_k, new_state, done, apply, noise.last
    )
    return updates, new_state._replace(window_size=window_size, autopilot=autopilot)

  return _partitioning(init_fn, update_fn)


def _micro_batch(
  grads: PyTree,
  state: AccumulateState,
  weight: Any,
  *,
  clip_record: Any,
  noise_config: Any,
  warned: list[bool],
  skip_nonfinite: bool,
  noise_stats: bool,
  rules: Any,
) -> tuple[PyTree, _Window]:
  """``(summand, window)``: one ``update`` call's gradient (unscaled by the
  loss scale), and the window after it joined (:func:`_add_micro_batch`).
  What joins the window's sum is that gradient, or a
  :class:`jaxaccum.ClipRecord`'s clipped sum as the step formed it, at
  its weight (by default the record's examples), checked. A record is
  taken once every check passed; one fed without ``dp_noise`` in ``inner``
  warns, once per :func:`accumulate` (``warned``)."""
  grads, record = _privacy.accumulated_record(
    grads, clip_record, noise_config, weight is not None
  )
  if record is not None and noise_config is None and not warned:
    warned.append(True)
    _privacy.warn_without_noise(
      "accumulate() was given a jaxaccum.ClipRecord, a clipped sum, but its "
      "inner optimizer holds no jaxaccum.dp_noise: each window's update is "
      "not private (accumulate(optax.chain(jaxaccum.dp_noise(...), ...), k) "
      "adds the noise once per window).",
      stacklevel=4,
    )
  if weight is None and record is not None:
    weight = record.examples
  weight = _check_update_args(grads, state, weight)
  if noise_config is not None and record is not None:
    _privacy.take(record, state)  # every check passed: the record is taken once
  scale = state.loss_scale
  summand = grads if scale is None else scale.unscale(grads)
  added = summand
  if scale is None and record is not None and record.normalize == "sum":
    # A clipped sum is added as the step formed it, in the accumulator's
    # dtype: its copy in the parameters' dtype (bfloat16) is rounded.
    added = _privacy.clipped_sum_of(record)
  public = noise_config is not None and noise_config.public_denominator is not None
  window = _add_micro_batch(
    state,
    added,
    weight,
    drop_nonfinite=skip_nonfinite or scale is not None,
    noise_stats=noise_stats,
    weight_decides=not public,
    rules=rules,
  )
  return summand, window


def _applies(done: jax.Array, window: Any, noise_config: Any, scale: Any) -> jax.Array:
  """Whether this call runs ``inner``: a window is done and holds weight (or,
  where ``dp_noise`` divides by a public number, whatever it holds: an empty
  Poisson draw is part of the mechanism, its update noise, and a private
  weight must decide nothing), and under a loss scale its sums are finite."""
  if noise_config is not None and noise_config.public_denominator is not None:
    apply = done
  else:
    apply = done & (window.acc_weight > 0)
  if scale is not None:
    apply = apply & window.window_finite
  return apply


def _inner_update(
  inner: optax.GradientTransformation,
  every_k: Any,
  *,
  state: Any,
  summand: PyTree,
  params: PyTree,
  extra_args: dict[str, Any],
  noise_config: Any,
  noise_stats: bool,
  rules: tuple[_rules.Rule, ...],
) -> Callable[..., Any]:
  """``inner_update(acc_grads, acc_weight, inner_state, noise)``: ``inner``
  run once on the window's normalized sum (the ``lax.cond``'s true branch)."""

  def inner_update(acc_grads, acc_weight, inner_state, noise):
    mean = _normalize.safe_divide(_rules.gradients(rules, acc_grads), acc_weight)
    # In the gradients' dtype, or float32 once unscaled from a loss scale
    # (a float16 mean would underflow where the scale had saved it).
    mean = jax.tree.map(lambda m, g: m.astype(g.dtype), mean, summand)
    extra = extra_args
    if noise_config is not None:  # the window's clipped sum, and its count
      weighted = noise_config.expected_weight is not None
      window_record = _privacy.made_record(
        mean,
        acc_weight,
        acc_weight,
        noise_config.clip_norm,
        "weighted" if weighted else "mean",
        clipped_sum=acc_grads,
      )
      extra = {**extra_args, "clip_record": window_record}
    updates, new_inner_state = inner.update(mean, inner_state, params, **extra)
    updates = _rules.overwritten(rules, updates, acc_grads, params)
    # The state keeps its dtypes, whatever the gradients' dtype promoted it to.
    new_inner_state = _tree.cast_like(new_inner_state, inner_state)
    if isinstance(every_k, _autopilot.AutoK) and every_k.power:
      # The learning rate follows the batch.
      factor = state.autopilot.lr_factor
      updates = jax.tree.map(lambda u: u * factor.astype(u.dtype), updates)
    if noise_stats:
      noise = noise._replace(last=noise.window.finalize(_tree.sq_norm(mean)))
    return updates, new_inner_state, noise

  return inner_update


def _inner_or_zeros(
  apply: jax.Array,
  inner_update: Callable[..., Any],
  window: _Window,
  inner_state: PyTree,
) -> tuple[PyTree, PyTree, WindowNoise]:
  """``(updates, inner_state, noise)``: ``inner_update`` on the window where
  ``apply``, else zero updates of its dtypes with the state and the noise
  as they are; one ``lax.cond``."""

  def no_update(acc_grads, acc_weight, inner_state, noise):
    shapes = jax.eval_shape(inner_update, acc_grads, acc_weight, inner_state, noise)
    zeros = jax.tree.map(jnp.zeros_like, shapes[0])
    return zeros, inner_state, noise

  return jax.lax.cond(
    apply,
    inner_update,
    no_update,
    window.acc_grads,
    window.acc_weight,
    inner_state,
    window.noise,
  )


def _partitioning(
  init_fn: Callable[..., Any], update_fn: Callable[..., Any]
) -> optax.GradientTransformationExtraArgs:
  """The transformation, taking parameters with leaves that ``jax.grad``
  refuses (an Equinox module) as their floating-point arrays, with None
  elsewhere: the tree that partitioned gradients have (:mod:`jaxaccum._static`)."""

  def init(params):
    return init_fn(_static.partition(params)[0])

  def update(grads, state, params=None, **kwargs):
    if params is not None:
      params = _static.partition(params)[0]
    return update_fn(grads, state, params, **kwargs)

  return optax.GradientTransformationExtraArgs(init, update)


def _next_state(
  state: AccumulateState,
  window: _Window,
  done: jax.Array,
  apply: jax.Array,
  applied: tuple[PyTree, WindowNoise],
  *,
  rules: tuple[_rules.Rule, ...],
) -> AccumulateState:
  """The state after one call: the window reset where it ended, the loss
  scale adjusted once per window; ``applied`` is the inner state and the
  noise after the (possibly skipped) inner update."""
  inner_state, noise = applied
  reset = lambda new, zero: jnp.where(done, zero, new)  # noqa: E731
  loss_scale = state.loss_scale
  if loss_scale is not None:
    adjusted = loss_scale.adjust(window.window_finite)
    loss_scale = jax.tree.map(
      lambda new, old: jnp.where(done, new, old), adjusted, loss_scale
    )
  return AccumulateState(
    micro_step=reset(state.micro_step + 1, 0),
    step=state.step + apply.astype(jnp.int32),
    acc_grads=_rules.reset(rules, done, window.acc_grads),
    acc_weight=reset(window.acc_weight, 0.0),
    inner_state=inner_state,
    num_skipped=state.num_skipped + (~window.valid).astype(jnp.int32),
    noise=noise._replace(
      window=jax.tree.map(lambda x: reset(x, jnp.zeros_like(x)), noise.window)
    ),
    loss_scale=loss_scale,
    window_finite=done | window.window_finite,
    updated=apply,
    window_size=state.window_size,
    autopilot=state.autopilot,
  )
