"""The batch-size autopilot: the window grows with the measured critical batch.

McCandlish et al. (2018): the critical batch size ``B_crit ~ B_simple =
tr(Sigma) / |G|^2`` is small early in training and grows as the loss falls.
Below it, a larger batch cuts the optimizer steps almost in proportion;
above it, the extra examples are mostly wasted. :func:`jaxaccum.accumulate`
measures ``B_simple`` from the micro-batches it adds anyway
(``noise_stats``); :func:`auto_k`, passed as its ``every_k``, sets each
window's length from it:

- after every window that was applied, the window's :class:`GradientNoise`
  is folded into moving averages of ``S`` and ``|G|^2`` (``horizon``
  windows), and ``B_simple`` is their ratio, in the units of the weights
  (micro-batches without ``weight=``, e.g. tokens with it);
- it is converted to micro-batches with the window's own mean weight per
  micro-batch, so that a token-weighted LM gets ``k`` in micro-batches;
- the next window's length is ``clip(round(fraction * B_simple /
  micro-batch), min_k, max_k)`` (``fraction`` 1 by default), changed only
  after ``warmup`` measured windows and while the estimate is finite, by at
  most a factor ``growth`` per window, and never smaller than the last
  (unless ``shrink``);
- with ``lr_rule``, each window's updates are multiplied by ``(k / k0) ** p``
  (``k0`` the first window's length): ``p = 1/2`` for Adam-family
  optimizers (``"sqrt"``, Malladi et al. 2022), ``p = 1`` for SGD
  (``"linear"``, Goyal et al. 2017).

Changing ``k`` recompiles nothing: the window's length is a value in the
state, and the loop that fills it is the user's.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxaccum import _noise_scale

LR_RULES = {"sqrt": 0.5, "linear": 1.0, None: 0.0}


class AutoKState(NamedTuple):
  """The autopilot's part of :class:`jaxaccum.AccumulateState`.

  Attributes:
    noise: moving averages of ``S`` and ``|G|^2`` over windows
      (:class:`jaxaccum.NoiseScaleState`).
    b_simple: the latest smoothed ``B_simple``, in micro-batches; infinite
      before the first estimate (never NaN); shape=(), float32.
    k0: the first window's length, the reference of the learning-rate rule;
      shape=(), int32.
    lr_factor: the factor the current window's updates are multiplied by,
      ``(k / k0) ** p``; shape=(), float32.
  """

  noise: _noise_scale.NoiseScaleState
  b_simple: jax.Array
  k0: jax.Array
  lr_factor: jax.Array


@dataclasses.dataclass(frozen=True)
class AutoK:
  """The autopilot's settings; build it with :func:`auto_k`."""

  max_k: int
  min_k: int
  lr_rule: str | None
  horizon: float
  growth: float
  warmup: int
  shrink: bool
  fraction: float = 1.0

  @property
  def power(self) -> float:
    """``p`` of the learning-rate rule: the updates scale as ``(k/k0)**p``."""
    return LR_RULES[self.lr_rule]

  def init(self) -> AutoKState:
    """The state before the first window, whose length is ``min_k``."""
    return AutoKState(
      noise=_noise_scale.noise_scale_init(),
      b_simple=jnp.full((), jnp.inf, jnp.float32),
      k0=jnp.full((), self.min_k, jnp.int32),
      lr_factor=jnp.ones((), jnp.float32),
    )

  def next_window(
    self,
    state: AutoKState,
    k: jax.Array,
    noise: _noise_scale.GradientNoise,
    applied: jax.Array,
  ) -> tuple[jax.Array, AutoKState]:
    """The next window's length and state, after a window of length ``k``
    that was ``applied`` (its noise measured as ``noise``)."""
    measured = applied & noise.has_estimate()
    decay = 1.0 - 1.0 / self.horizon
    tracker = _noise_scale.noise_scale_update(state.noise, noise, decay=decay)
    tracker = jax.tree.map(
      lambda new, old: jnp.where(measured, new, old), tracker, state.noise
    )
    per_micro_batch = jnp.where(noise.b_small > 0, noise.b_small, 1.0)
    b_simple = _noise_scale.critical_batch_size(tracker) / per_micro_batch
    b_simple = jnp.where(measured, b_simple, state.b_simple)
    # An infinite estimate (the averaged |G|^2 not positive) says nothing
    # reliable from windows this small: hold the window rather than ratchet it.
    finite = jnp.isfinite(b_simple)
    target = jnp.where(finite, jnp.round(self.fraction * b_simple), 0)
    target = jnp.clip(target, self.min_k, self.max_k).astype(jnp.int32)
    cap = jnp.maximum(jnp.floor(k * self.growth).astype(jnp.int32), k + 1)
    target = jnp.minimum(target, cap)
    if not self.shrink:
      target = jnp.maximum(target, k)
    ready = measured & finite & (tracker.num_updates >= self.warmup)
    k_next = jnp.where(ready, target, k).astype(jnp.int32)
    factor = (k_next / state.k0).astype(jnp.float32) ** self.power
    return k_next, state._replace(noise=tracker, b_simple=b_simple, lr_factor=factor)


def auto_k(
  *,
  max_k: int,
  min_k: int = 2,
  lr_rule: str | None = None,
  horizon: float = 100.0,
  growth: float = 2.0,
  warmup: int = 5,
  shrink: bool = False,
  fraction: float = 1.0,
) -> AutoK:
  """A window length that follows the measured critical batch size: pass it
  as ``every_k`` of :func:`jaxaccum.accumulate`.

  Each window's length is ``clip(round(B_simple / micro-batch), min_k,
  max_k)``, with ``B_simple`` the gradient noise scale measured over the
  windows so far (McCandlish et al. 2018); see :mod:`jaxaccum._optim.autopilot`
  for the rule. Read the current length with :func:`jaxaccum.window_size`,
  and the measurements in ``state.autopilot``.

  Args:
    max_k: the longest window, e.g. what the step time or the data allow.
    min_k: the first and shortest window; at least 2, since one micro-batch
      measures no noise.
    lr_rule: scale each window's updates by ``(k / k0) ** p``: ``"sqrt"``
      (``p = 1/2``, for Adam, RMSprop, Lion, Adafactor), ``"linear"`` (``p =
      1``, for SGD with or without momentum), or None (no scaling). This is a
      learning-rate change exactly for optimizers whose update is the
      learning rate times a direction that does not depend on it: optax's
      ``sgd``, ``adam``, ``adamw`` (its weight decay is multiplied by the
      learning rate too), ``nadam``, ``radam``, ``adamax``, ``amsgrad``,
      ``lion``, ``rmsprop``, ``adagrad``, ``adafactor``, ``lamb``. Not for
      learning-rate-free methods (``prodigy``, ``dog``, ``dadapt``), line
      searches (``lbfgs``), ``polyak_sgd`` or schedule-free wrappers, whose
      state depends on the step size.
    horizon: the moving averages' horizon, in windows (decay ``1 -
      1/horizon``): longer is smoother and slower to follow. Windows of a
      few micro-batches give noisy single estimates (``|G|^2`` can come out
      negative, ``B_simple`` infinite), and a window that never shrinks
      ratchets up on that noise: on the examples a horizon of 10 drove the
      window to ``max_k`` by mid-run, 100 to 300 did equally well
      (``examples/autopilot.py``).
    growth: the largest factor by which one window may be longer than the
      last (at least one micro-batch more).
    warmup: measured windows before the first change: the first estimates
      are the noisiest.
    shrink: let the window get shorter again when ``B_simple`` falls (off
      by default: the critical batch grows as the loss falls).
    fraction: aim at ``fraction * B_simple``. Training at the critical batch
      is the trade-off point of McCandlish et al. (about twice the fewest
      examples for about twice the fewest steps); below 1 spends fewer
      examples per step for more steps.

  Returns:
    An :class:`AutoK`, for ``every_k``.

  Raises:
    ValueError: for ``min_k < 2``, ``max_k < min_k``, an unknown ``lr_rule``,
      ``horizon < 1``, ``growth <= 1``, a negative ``warmup`` or a
      ``fraction`` that is not positive.

  >>> import jax.numpy as jnp, optax, jaxaccum
  >>> tx = jaxaccum.accumulate(optax.adam(1e-3), jaxaccum.auto_k(max_k=16))
  >>> state = tx.init(jnp.zeros(3))
  >>> int(jaxaccum.window_size(state))  # the first window: min_k
  2
  """
  for name, value in (("max_k", max_k), ("min_k", min_k), ("warmup", warmup)):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
      raise TypeError(f"{name} must be an integer, got {value!r}.")
  if min_k < 2:
    raise ValueError(
      f"min_k must be at least 2, got {min_k=}: a window of one micro-batch "
      "measures no gradient noise."
    )
  if max_k < min_k:
    raise ValueError(f"max_k must be at least min_k, got {max_k=} and {min_k=}.")
  if lr_rule not in LR_RULES:
    raise ValueError(f"Unknown {lr_rule=}; choose 'sqrt', 'linear' or None.")
  if not horizon >= 1 or not math.isfinite(horizon):
    raise ValueError(f"horizon must be a number of windows >= 1, got {horizon=}.")
  if not growth > 1 or not math.isfinite(growth):
    raise ValueError(f"growth must be a factor > 1, got {growth=}.")
  if warmup < 0:
    raise ValueError(f"warmup must be >= 0, got {warmup=}.")
  if not fraction > 0 or not math.isfinite(fraction):
    raise ValueError(f"fraction must be a positive number, got {fraction=}.")
  return AutoK(
    int(max_k),
    int(min_k),
    lr_rule,
    float(horizon),
    float(growth),
    int(warmup),
    bool(shrink),
    float(fraction),
  )


def is_auto(every_k: Any) -> bool:
  return isinstance(every_k, AutoK)
