"""The gradient noise scale (McCandlish et al. 2018), from micro-batch gradients.

"Is my effective batch worth it?" The simple noise scale

    B_simple = tr(Σ) / |G|²

(Σ the per-example gradient covariance, G the true gradient) estimates the
critical batch size. Below it, doubling the batch nearly halves the steps to a
given loss; well above it, a larger batch mostly wastes compute.

Accumulation gives the estimate for free: the micro-batch gradients are
small-batch gradients (``B_small`` examples each) and their normalized sum is
a big-batch gradient (``B_big``). With ``|G_small|²`` the mean squared norm of
the micro-batch gradients and ``|G_big|²`` the squared norm of the sum,

    |G|² ≈ (B_big |G_big|² - B_small |G_small|²) / (B_big - B_small)
    S    ≈ (|G_small|² - |G_big|²) / (1/B_small - 1/B_big)

are unbiased, and ``B_simple ≈ EMA(S) / EMA(|G|²)``: a ratio of averages, since
each single-step estimate is noisy and ``|G|²`` can even come out negative.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

PyTree = Any


class GradientNoise(NamedTuple):
  """One step's raw measurements; see the module docstring.

  Attributes:
    small_sq_norm: ``|G_small|²``, the mean over micro-batches of the squared
      norm of each micro-batch's mean gradient; shape=(), float32.
    big_sq_norm: ``|G_big|²``, the squared norm of the whole batch's mean
      gradient; shape=(), float32.
    b_small: examples (or weight units, e.g. tokens) per micro-batch;
      shape=(), float32.
    b_big: examples (or weight units) in the whole batch; shape=(), float32.
  """

  small_sq_norm: jax.Array
  big_sq_norm: jax.Array
  b_small: jax.Array
  b_big: jax.Array

  def has_estimate(self) -> jax.Array:
    """Whether these measurements hold an estimate, ``0 < b_small < b_big``:
    not with one micro-batch, nor in :func:`jaxaccum.accumulate`'s zeros
    before its first window; shape=(), bool."""
    return (self.b_small > 0) & (self.b_big > self.b_small)

  def sq_norm(self) -> jax.Array:
    """The unbiased estimate of ``|G|²`` (it can be negative when noisy);
    0 without an estimate (see :meth:`has_estimate`)."""
    ok = self.has_estimate()
    span = jnp.where(ok, self.b_big - self.b_small, 1.0)
    big, small = self.b_big * self.big_sq_norm, self.b_small * self.small_sq_norm
    return jnp.where(ok, (big - small) / span, 0.0)

  def trace(self) -> jax.Array:
    """The unbiased estimate of ``S = tr(Σ)``; 0 without an estimate (see
    :meth:`has_estimate`).

    >>> import jax.numpy as jnp
    >>> noise = GradientNoise(*map(jnp.asarray, (2.0, 1.25, 4.0, 16.0)))
    >>> float(noise.trace()), float(noise.sq_norm())
    (4.0, 1.0)
    >>> one = noise._replace(b_small=noise.b_big)  # one micro-batch
    >>> bool(one.has_estimate()), float(one.trace()), float(one.sq_norm())
    (False, 0.0, 0.0)
    """
    ok = self.has_estimate()
    # Safe stand-ins where there is no estimate: no 0/0 is ever computed,
    # so jax_debug_nans stays quiet.
    b_small = jnp.where(ok, self.b_small, 1.0)
    b_big = jnp.where(ok, self.b_big, 2.0)
    return jnp.where(
      ok, (self.small_sq_norm - self.big_sq_norm) / (1 / b_small - 1 / b_big), 0.0
    )

  def unscaled(self, scale: jax.Array) -> GradientNoise:
    """The measurements of gradients that were multiplied by ``scale`` (a
    loss scale), divided back: squared norms by ``scale**2``.

    >>> import jax.numpy as jnp
    >>> noise = GradientNoise(*map(jnp.asarray, (8.0, 4.0, 4.0, 16.0)))
    >>> float(noise.unscaled(jnp.array(2.0)).small_sq_norm)
    2.0
    """
    factor = jnp.asarray(scale, jnp.float32) ** 2
    return self._replace(
      small_sq_norm=self.small_sq_norm / factor, big_sq_norm=self.big_sq_norm / factor
    )


class NoiseScaleState(NamedTuple):
  """Exponential moving averages of ``S`` and ``|G|²``.

  Attributes:
    trace: the EMA of ``S``, without bias correction; shape=(), float32.
    sq_norm: the EMA of ``|G|²``, without bias correction; shape=(), float32.
    num_updates: the updates folded in so far; shape=(), int32.
  """

  trace: jax.Array
  sq_norm: jax.Array
  num_updates: jax.Array


def noise_scale_init() -> NoiseScaleState:
  """An empty tracker state (see :func:`noise_scale_update`).

  >>> state = noise_scale_init()
  >>> int(state.num_updates), float(critical_batch_size(state))
  (0, inf)
  """
  # Every field its own buffer: fields that shared one could not be donated.
  return NoiseScaleState(
    jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32)
  )


def noise_scale_update(
  state: NoiseScaleState, noise: GradientNoise, decay: float = 0.99
) -> NoiseScaleState:
  """Folds one step's :class:`GradientNoise` into the moving averages.

  Steps without an estimate (one micro-batch, ``B_small == B_big``; or
  :func:`jaxaccum.accumulate`'s zeros before its first window) and steps
  whose estimates are not finite are left out.

  Args:
    state: the tracker, from :func:`noise_scale_init` or a previous update.
    noise: one step's measurements, e.g. from ``jaxaccum.value_and_grad(...,
      noise_stats=True)``.
    decay: the EMAs' decay per step.

  Returns:
    The new tracker state.

  >>> import jax.numpy as jnp
  >>> one = GradientNoise(jnp.array(2.0), jnp.array(1.25), jnp.array(4.0), jnp.array(16.0))
  >>> state = noise_scale_update(noise_scale_init(), one, decay=0.5)
  >>> float(state.trace), float(state.sq_norm), int(state.num_updates)  # S=4, |G|²=1
  (2.0, 0.5, 1)
  >>> one_micro_batch = one._replace(b_small=jnp.array(16.0))
  >>> int(noise_scale_update(state, one_micro_batch).num_updates)  # left out
  1
  """
  trace, g2 = noise.trace(), noise.sq_norm()
  ok = noise.has_estimate() & jnp.isfinite(trace) & jnp.isfinite(g2)
  return NoiseScaleState(
    trace=jnp.where(ok, decay * state.trace + (1 - decay) * trace, state.trace),
    sq_norm=jnp.where(ok, decay * state.sq_norm + (1 - decay) * g2, state.sq_norm),
    num_updates=state.num_updates + ok.astype(jnp.int32),
  )


def critical_batch_size(state: NoiseScaleState) -> jax.Array:
  """``B_simple = EMA(S) / EMA(|G|²)``, in the units of ``b_small``.

  The bias corrections of the two averages cancel in the ratio. It is
  infinite while ``EMA(|G|²) <= 0``, and so also before the first update
  (``state.num_updates == 0``): nothing measured yet says that a bigger
  batch would stop paying off. It is never NaN, so that it can be logged
  under ``jax_debug_nans``.

  >>> import jax.numpy as jnp
  >>> noise = GradientNoise(jnp.array(2.0), jnp.array(1.25), jnp.array(4.0), jnp.array(16.0))
  >>> float(noise.trace()), float(noise.sq_norm())
  (4.0, 1.0)
  >>> state = noise_scale_update(noise_scale_init(), noise)
  >>> round(float(critical_batch_size(state)), 4)
  4.0
  """
  positive = state.sq_norm > 0
  ratio = state.trace / jnp.where(positive, state.sq_norm, 1.0)
  return jnp.where(positive, ratio, jnp.inf)


class NoiseSums(NamedTuple):
  """Sums toward one :class:`GradientNoise`, added up over micro-batches,
  devices or the calls of a window: the one noise accounting of jaxaccum.

  Each micro-batch contributes the squared norm of its *mean* gradient (its
  gradient divided by what it averages over) and the examples, or units of
  weight, it holds. A micro-batch holding none is left out.

  Attributes:
    sq_norm: the sum over micro-batches of the squared norm of each
      micro-batch's mean gradient; shape=(), float32.
    num_micro_batches: the micro-batches summed; shape=(), float32.
    examples: the examples (or units of weight) in them; shape=(), float32.
  """

  sq_norm: jax.Array
  num_micro_batches: jax.Array
  examples: jax.Array

  @classmethod
  def of(
    cls, sq_norms: jax.Array, divisors: jax.Array, examples: jax.Array
  ) -> NoiseSums:
    """The sums over micro-batches with gradients of squared norms
    ``sq_norms``, each the sum over ``divisors`` of what it averages (1 for
    a mean gradient) and holding ``examples``; any shape, one entry each.

    >>> import jax.numpy as jnp
    >>> sums = NoiseSums.of(jnp.array([4.0, 9.0]), jnp.array([2.0, 3.0]), jnp.array([2.0, 0.0]))
    >>> [float(x) for x in sums]  # the second holds nothing and is left out
    [1.0, 1.0, 2.0]
    """
    sq_norms = jnp.asarray(sq_norms, jnp.float32)
    examples = jnp.broadcast_to(jnp.asarray(examples, jnp.float32), sq_norms.shape)
    divisors = jnp.broadcast_to(jnp.asarray(divisors, jnp.float32), sq_norms.shape)
    valid = examples > 0
    safe = jnp.where(valid & (divisors != 0), divisors, 1.0)
    return cls(
      jnp.sum(jnp.where(valid, sq_norms / safe**2, 0.0)),
      jnp.sum(valid.astype(jnp.float32)),
      jnp.sum(jnp.where(valid, examples, 0.0)),
    )

  @classmethod
  def zeros(cls) -> NoiseSums:
    """Nothing summed yet; every field its own buffer (donatable)."""
    return cls(*(jnp.zeros((), jnp.float32) for _ in range(3)))

  def __add__(self, other: Any) -> NoiseSums:
    return NoiseSums(*(a + b for a, b in zip(self, other, strict=True)))

  def finalize(self, big_sq_norm: jax.Array) -> GradientNoise:
    """The :class:`GradientNoise` of the whole batch, whose mean gradient has
    the squared norm ``big_sq_norm`` (zeros but that when nothing was
    summed)."""
    count = jnp.where(self.num_micro_batches > 0, self.num_micro_batches, 1.0)
    return GradientNoise(
      small_sq_norm=self.sq_norm / count,
      big_sq_norm=jnp.asarray(big_sq_norm, jnp.float32),
      b_small=self.examples / count,
      b_big=self.examples,
    )


def no_estimate() -> GradientNoise:
  """Zeros: no estimate (``has_estimate()`` is False), and no NaN for
  ``jax_debug_nans`` to report; every field its own buffer."""
  return GradientNoise(*(jnp.zeros((), jnp.float32) for _ in range(4)))
