"""Hyperparameter scaling for a larger effective batch.

Accumulating ``k`` micro-batches grows the effective batch from
``base_batch_size`` to ``batch_size``, a factor κ = batch_size / base_batch_size.
Hyperparameters that were tuned at the small batch must then change, or the
run trains differently. Which rule applies depends on the optimizer:

- SGD, with or without momentum: the linear scaling rule, lr → κ·lr
  (:func:`scale_lr_linear`; Goyal et al. 2017, "Accurate, Large Minibatch SGD:
  Training ImageNet in 1 Hour"). The larger learning rate is unstable in the
  first steps, so pair it with a gradual :func:`warmup` from the small-batch
  learning rate.
- Adam and RMSprop: the square-root rule (:func:`scale_adam_sqrt`; Malladi et
  al. 2022, "On the SDEs and Scaling Rules for Adaptive Gradient Algorithms"):
  lr → √κ·lr, 1-β1 → κ(1-β1), 1-β2 → κ(1-β2) and ε → ε/√κ. Scaling only the
  learning rate, linearly or by √κ, does not match the small-batch run.

Running averages (BatchNorm's statistics) threaded through the
micro-batches move once per micro-batch: :func:`micro_batch_momentum` gives
the momentum per micro-batch that keeps the full batch's per step.

Both rules assume the same number of epochs, so a run at batch size κ·B takes
κ times fewer optimizer steps; shorten step-based schedules to match. Both are
approximations that hold for moderate κ. Once the batch approaches the
critical batch size (where the gradient noise scale stops growing the useful
batch), no rule recovers the small-batch run.
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import NamedTuple, TypeGuard

import optax


class AdamHyperparams(NamedTuple):
  """Adam hyperparameters, in ``optax.adam``'s order: ``optax.adam(*hp)``.

  Attributes:
    learning_rate: the step size; a Python float.
    b1: the decay rate of the first-moment (mean) estimate; in [0, 1).
    b2: the decay rate of the second-moment estimate; in [0, 1).
    eps: added to the root of the second moment in the denominator; >= 0.
  """

  learning_rate: float  # the step size
  b1: float  # first-moment decay, in [0, 1)
  b2: float  # second-moment decay, in [0, 1)
  eps: float  # denominator term, >= 0


def _is_int(n: object) -> TypeGuard[numbers.Integral]:
  # numbers.Integral also admits numpy integers; bool is not a size.
  return isinstance(n, numbers.Integral) and not isinstance(n, bool)


def _is_positive_int(n: object) -> bool:
  return _is_int(n) and int(n) > 0


def kappa(base_batch_size: int, batch_size: int) -> float:
  """The batch-size ratio κ = ``batch_size / base_batch_size``.

  Args:
    base_batch_size: the batch size the hyperparameters were tuned at; a
      positive int.
    batch_size: the new effective batch size (micro-batch size times the
      number of micro-batches, times data-parallel devices); a positive int.

  Returns:
    κ as a float. It is below 1 when the batch shrinks.

  Raises:
    ValueError: if either size is not a positive int.

  >>> from jaxaccum._optim.scaling import kappa
  >>> kappa(256, 1024)
  4.0
  """
  if not (_is_positive_int(base_batch_size) and _is_positive_int(batch_size)):
    raise ValueError(
      f"Batch sizes must be positive ints, got {base_batch_size=} and {batch_size=}."
    )
  return int(batch_size) / int(base_batch_size)


def scale_lr_linear(
  learning_rate: float, base_batch_size: int, batch_size: int
) -> float:
  """The linear scaling rule for SGD: ``learning_rate * κ``.

  Goyal et al. 2017: when the batch grows by κ, multiply the learning rate by
  κ, keep the number of epochs, and warm the learning rate up over the first
  epochs (see :func:`warmup`). It also holds for shrinking the batch (κ < 1).
  It breaks down at very large batches; Goyal et al. report it up to a batch
  of 8k on ImageNet.

  Args:
    learning_rate: the learning rate tuned at ``base_batch_size``.
    base_batch_size: the batch size ``learning_rate`` was tuned at.
    batch_size: the new effective batch size.

  Returns:
    The scaled learning rate, a Python float.

  Raises:
    ValueError: if either batch size is not a positive int.

  >>> from jaxaccum._optim.scaling import scale_lr_linear
  >>> scale_lr_linear(0.1, base_batch_size=256, batch_size=1024)
  0.4
  """
  return float(learning_rate) * kappa(base_batch_size, batch_size)


def micro_batch_momentum(momentum: float, num_micro_batches: int) -> float:
  """The running-average momentum per micro-batch that keeps the full
  batch's per step: ``momentum ** (1 / num_micro_batches)``.

  A running average (BatchNorm's statistics) threaded through ``k``
  micro-batches (``state_argnum``, ``jaxaccum.nnx``) moves once per
  micro-batch: with momentum ``μ`` and micro-batch statistics ``s_0 ..
  s_{k-1}``, one step gives ``μ^k r + (1 - μ) Σ_i μ^(k-1-i) s_i`` where the
  full batch gives ``μ r + (1 - μ) s``. The old average decays by ``μ^k`` per
  step, not ``μ``: ``μ = 0.9`` at ``k = 4`` behaves like ``0.66``, and each
  step moves ``(1 - μ^k) / (1 - μ)`` (3.4) times as far.

  Built with ``μ' = μ^(1/k)`` instead, the layer decays the old average by
  exactly ``μ`` per step and moves it by ``1 - μ`` toward a mean of the
  micro-batches' statistics, weighted ``(1 - μ') μ'^(k-1-i) / (1 - μ)``
  (these sum to 1; later micro-batches weigh slightly more). Where the
  micro-batches' statistics are the full batch's, that is the full batch's
  running average, step for step. Otherwise it differs as the statistics of
  ``m`` rows differ from those of ``B``: a micro-batch's variance leaves out
  the spread between the micro-batches' means, as BatchNorm's forward pass
  on ``m`` rows does.

  Args:
    momentum: the momentum ``μ`` the full-batch step was tuned with, in
      ``[0, 1)`` (Flax's and Equinox's ``momentum``; PyTorch's ``momentum``
      is ``1 - μ``).
    num_micro_batches: ``k``, the micro-batches the state passes through in
      one step (under ``mesh=``, ``k`` per device: each device threads its
      own copy, and the copies are averaged after the loop).

  Returns:
    ``μ^(1/k)``, a Python float, to build the layer with
    (``nn.BatchNorm(momentum=...)``, ``nnx.BatchNorm(..., momentum=...)``,
    ``eqx.nn.BatchNorm(..., momentum=...)``).

  Raises:
    ValueError: for a momentum outside ``[0, 1)`` or a ``k`` that is not a
      positive int.

  >>> import jaxaccum
  >>> mu = jaxaccum.micro_batch_momentum(0.9, 4)
  >>> round(mu, 4), round(mu**4, 12)  # per micro-batch; per step, as the full batch
  (0.974, 0.9)
  """
  if not _is_positive_int(num_micro_batches):
    raise ValueError(
      f"num_micro_batches must be a positive int, got {num_micro_batches!r}."
    )
  if not 0.0 <= momentum < 1.0:
    raise ValueError(
      f"momentum must be in [0, 1), got {momentum}: the weight a running "
      "average keeps of its old value (Flax's and Equinox's convention)."
    )
  _ADJUSTED.add(int(num_micro_batches))
  return float(momentum) ** (1.0 / int(num_micro_batches))


# The ``k`` that :func:`micro_batch_momentum` was asked for in this process:
# a step over that many micro-batches takes its layers to be built with it.
_ADJUSTED: set[int] = set()


class RunningAverageWarning(UserWarning):
  """A train step threads state through ``k > 1`` micro-batches, and a
  running average in it (BatchNorm's statistics) would move ``k`` times per
  step.

  ``jaxaccum.make_train_step`` with ``state_argnum``, and
  ``jaxaccum.nnx.make_train_step`` for a model with ``nnx.BatchStat``
  variables, warn once per step function when they first trace it: momentum
  ``μ`` then acts as ``μ^k`` per step (0.9 at ``k = 8`` as 0.43: each step
  moves the average 5.7 times as far as the full batch's). Build the layers
  with ``momentum=jaxaccum.micro_batch_momentum(μ, k)``. The warning is left
  out where ``micro_batch_momentum`` was called for the step's ``k`` in this
  process; otherwise silence it with ``warnings.filterwarnings("ignore",
  category=jaxaccum.RunningAverageWarning)``, e.g. for state that holds no
  running average.

  >>> import warnings, jax.numpy as jnp, optax, jaxaccum
  >>> def loss(w, x, count):
  ...   return jnp.mean(x * w), (None, count + 1)
  >>> step = jaxaccum.make_train_step(
  ...   loss, optax.sgd(0.1), 3, has_aux=True, state_argnum=2
  ... )
  >>> with warnings.catch_warnings(record=True) as caught:
  ...   warnings.simplefilter("always")
  ...   _ = step(jnp.ones(()), optax.sgd(0.1).init(jnp.ones(())), jnp.ones(6), jnp.zeros(()))
  >>> caught[0].category.__name__
  'RunningAverageWarning'
  """


def warn_running_average(num_micro_batches: int, threaded: str) -> None:
  """Warns (:class:`RunningAverageWarning`) that ``threaded`` passes through
  ``num_micro_batches`` micro-batches per step, unless that is 1 or
  :func:`micro_batch_momentum` was asked for it."""
  k = int(num_micro_batches)
  if k <= 1 or k in _ADJUSTED:
    return
  warnings.warn(
    f"jaxaccum: {threaded} passes through k={k} micro-batches per step, so a "
    f"running average in it (BatchNorm's statistics) moves {k} times: momentum "
    f"0.9 acts as {0.9**k:.2f} per step, {(1 - 0.9**k) / 0.1:.1f}x as far as the "
    f"full batch's. Build the layers with momentum=jaxaccum.micro_batch_momentum"
    f"(μ, {k}); silence with warnings.filterwarnings('ignore', "
    "category=jaxaccum.RunningAverageWarning).",
    RunningAverageWarning,
    stacklevel=3,
  )


def _check_beta(name: str, beta: float) -> None:
  if not 0.0 <= beta < 1.0:
    raise ValueError(f"{name} must be in [0, 1), got {name}={beta}.")


def _scale_beta(name: str, beta: float, k: float) -> float:
  one_minus = k * (1.0 - beta)
  # isclose: kappa=10, b=0.9 gives 0.9999999999999998, a b of 2e-16.
  if one_minus >= 1.0 or math.isclose(one_minus, 1.0):
    raise ValueError(
      f"The square-root rule needs kappa*(1-{name}) < 1, got kappa={k:g} and "
      f"{name}={beta:g}: kappa*(1-{name})={one_minus:g}, which leaves no valid "
      f"{name}. The rule does not hold this far; use a smaller batch-size "
      f"ratio or a larger {name}."
    )
  return 1.0 - one_minus


def scale_adam_sqrt(
  learning_rate: float,
  base_batch_size: int,
  batch_size: int,
  *,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
) -> AdamHyperparams:
  """The square-root scaling rule for Adam and RMSprop (Malladi et al. 2022).

  With κ = ``batch_size / base_batch_size``, it maps

  - ``learning_rate`` → ``learning_rate * √κ``,
  - ``1 - b1`` → ``κ (1 - b1)`` and ``1 - b2`` → ``κ (1 - b2)``,
  - ``eps`` → ``eps / √κ``,

  so that Adam at the large batch follows the same SDE as at the small one.
  Keep the number of epochs: the run takes κ times fewer steps.

  The rule is an approximation validated for moderate κ, a small multiple of
  the base batch; it degrades as κ grows and fails outright when
  ``κ (1 - b) >= 1``, where no decay rate is left. That raises instead of
  clamping. κ < 1 (a smaller batch) is allowed. At κ = 1 the inputs are
  returned unchanged.

  Args:
    learning_rate: the learning rate tuned at ``base_batch_size``.
    base_batch_size: the batch size the hyperparameters were tuned at.
    batch_size: the new effective batch size.
    b1: the tuned first-moment decay rate, in [0, 1).
    b2: the tuned second-moment decay rate, in [0, 1).
    eps: the tuned ``eps``, >= 0.

  Returns:
    The scaled :class:`AdamHyperparams`; pass them on as
    ``optax.adam(**hp._asdict())``.

  Raises:
    ValueError: if a batch size is not a positive int, ``b1`` or ``b2`` is
      outside [0, 1), ``eps`` is negative, or ``κ (1 - b) >= 1``.

  >>> import optax
  >>> from jaxaccum._optim.scaling import scale_adam_sqrt
  >>> hp = scale_adam_sqrt(1e-3, base_batch_size=256, batch_size=1024)
  >>> hp.learning_rate, round(hp.b1, 6), round(hp.b2, 6), hp.eps
  (0.002, 0.6, 0.996, 5e-09)
  >>> tx = optax.adam(**hp._asdict())
  """
  k = kappa(base_batch_size, batch_size)
  if not eps >= 0.0:
    raise ValueError(f"eps must be >= 0, got {eps=}.")
  _check_beta("b1", b1)
  _check_beta("b2", b2)
  if k == 1.0:
    return AdamHyperparams(float(learning_rate), float(b1), float(b2), float(eps))
  root = math.sqrt(k)
  return AdamHyperparams(
    learning_rate=float(learning_rate) * root,
    b1=_scale_beta("b1", b1, k),
    b2=_scale_beta("b2", b2, k),
    eps=float(eps) / root,
  )


def warmup(
  peak_learning_rate: float,
  warmup_steps: int,
  *,
  init_learning_rate: float | None = None,
  decay_steps: int | None = None,
  end_learning_rate: float = 0.0,
) -> optax.Schedule:
  """Gradual warmup to a scaled learning rate (Goyal et al. 2017).

  The learning rate ramps linearly from ``init_learning_rate`` at step 0 to
  ``peak_learning_rate`` at step ``warmup_steps``. It then stays constant, or,
  with ``decay_steps``, follows a cosine decay to ``end_learning_rate`` over
  the next ``decay_steps`` steps and stays there.

  Goyal et al. start from the small-batch learning rate, but this function does
  not know it, so ``init_learning_rate`` defaults to 0. Pass the base learning
  rate to follow the paper:
  ``warmup(scale_lr_linear(lr, 256, 8192), 500, init_learning_rate=lr)``.

  Steps count optimizer updates. Under :func:`jaxaccum.accumulate`, the inner
  optimizer's step advances once per window, so give the steps in windows,
  not micro-batches.

  Args:
    peak_learning_rate: the learning rate after warmup, e.g. from
      :func:`scale_lr_linear`.
    warmup_steps: the length of the ramp; an int >= 0 (0: no warmup).
    init_learning_rate: the learning rate at step 0; None means 0.0.
    decay_steps: the length of the cosine decay after warmup (not counting
      warmup, unlike ``optax.warmup_cosine_decay_schedule``); a positive int,
      or None for a constant learning rate after warmup.
    end_learning_rate: the learning rate at the end of the decay.

  Returns:
    An ``optax.Schedule`` from the step count to the learning rate.

  Raises:
    ValueError: if ``warmup_steps`` is not an int >= 0, or ``decay_steps`` is
      neither None nor a positive int.

  >>> from jaxaccum._optim.scaling import warmup
  >>> schedule = warmup(0.4, warmup_steps=100, init_learning_rate=0.1)
  >>> [round(float(schedule(step)), 4) for step in (0, 50, 100, 1000)]
  [0.1, 0.25, 0.4, 0.4]
  >>> schedule = warmup(0.4, 100, decay_steps=900, end_learning_rate=0.004)
  >>> [round(float(schedule(step)), 4) for step in (0, 100, 550, 1000, 2000)]
  [0.0, 0.4, 0.202, 0.004, 0.004]
  """
  if not _is_int(warmup_steps) or warmup_steps < 0:
    raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps=}.")
  if decay_steps is not None and not _is_positive_int(decay_steps):
    raise ValueError(f"decay_steps must be None or a positive int, got {decay_steps=}.")
  init = 0.0 if init_learning_rate is None else init_learning_rate
  if decay_steps is None:
    if warmup_steps == 0:
      return optax.constant_schedule(peak_learning_rate)
    # linear_schedule holds end_value after transition_steps.
    return optax.linear_schedule(init, peak_learning_rate, warmup_steps)
  if warmup_steps == 0:
    alpha = 0.0 if peak_learning_rate == 0 else end_learning_rate / peak_learning_rate
    return optax.cosine_decay_schedule(peak_learning_rate, decay_steps, alpha)
  return optax.warmup_cosine_decay_schedule(
    init_value=init,
    peak_value=peak_learning_rate,
    warmup_steps=warmup_steps,
    decay_steps=warmup_steps + decay_steps,
    end_value=end_learning_rate,
  )
