"""Dynamic loss scaling for float16 training, adjusted once per window.

float16 has a narrow range: small gradients underflow to zero. Multiplying the
loss by a large scale ``s`` lifts the gradients into range; they are divided
by ``s`` again (in float32) before the update. If any gradient overflowed to
Inf or NaN, the update is skipped and ``s`` is halved; after
``growth_interval`` clean updates in a row, ``s`` is doubled.

Under accumulation the unit is the *window*: every micro-batch of a window is
scaled by the same ``s``, the window is skipped as a whole if any of its
micro-batches overflowed, and ``s`` changes only between windows. Pass a
:class:`DynamicLossScale` to :func:`jaxaccum.accumulate` (``loss_scale=``), and
multiply your loss by ``state.loss_scale.scale``.

(``jmp``, DeepMind's mixed-precision library, has the same idea, but its last
release is from January 2023; this module is small and tested here.)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

PyTree = Any


class DynamicLossScale(NamedTuple):
  """The loss scale and its adjustment rule.

  Attributes:
    scale: the current scale; shape=(), float32.
    good_steps: windows in a row without overflow; shape=(), int32.
    growth_interval: clean windows before the scale doubles; shape=(), int32.
    factor: the growth and back-off factor; shape=(), float32.
    min_scale: the scale never drops below this; shape=(), float32.
  """

  scale: jax.Array
  good_steps: jax.Array
  growth_interval: jax.Array
  factor: jax.Array
  min_scale: jax.Array

  def scale_loss(self, loss: jax.Array) -> jax.Array:
    """``loss * scale``, computed and returned in float32 (or wider).

    The product stays in float32 because float16 cannot hold scales of
    2**16 and more. Compute the loss itself in float32 from float16 logits,
    as AMP does: a float16 scalar loss would pass the scale back into the
    float16 graph, where it overflows from 2**16 on.
    """
    wide = jnp.promote_types(loss.dtype, jnp.float32)
    return loss.astype(wide) * self.scale.astype(wide)

  def unscale(self, grads: PyTree) -> PyTree:
    """``grads / scale``, computed and returned in float32 (or wider)."""
    inverse = 1.0 / self.scale
    return jax.tree.map(
      lambda g: g.astype(jnp.promote_types(g.dtype, jnp.float32)) * inverse, grads
    )

  def adjust(self, finite: jax.Array) -> DynamicLossScale:
    """The next state after a window that was ``finite`` (or overflowed).

    >>> s = dynamic_loss_scale(8.0, growth_interval=2)
    >>> s = s.adjust(jnp.array(True)); float(s.scale)
    8.0
    >>> s = s.adjust(jnp.array(True)); float(s.scale)
    16.0
    >>> s = s.adjust(jnp.array(False)); float(s.scale), int(s.good_steps)
    (8.0, 0)
    """
    grown = self.good_steps + 1 >= self.growth_interval
    scale = jnp.where(
      finite,
      jnp.where(grown, self.scale * self.factor, self.scale),
      jnp.maximum(self.scale / self.factor, self.min_scale),
    )
    good_steps = jnp.where(finite & ~grown, self.good_steps + 1, 0)
    return self._replace(scale=scale, good_steps=good_steps.astype(jnp.int32))


def dynamic_loss_scale(
  initial_scale: float = 2.0**15,
  *,
  growth_interval: int = 2000,
  factor: float = 2.0,
  min_scale: float = 1.0,
) -> DynamicLossScale:
  """A :class:`DynamicLossScale` with the usual defaults (those of jmp/AMP).

  >>> s = dynamic_loss_scale()
  >>> float(s.scale), int(s.growth_interval)
  (32768.0, 2000)
  """
  if initial_scale <= 0 or min_scale <= 0 or factor <= 1 or growth_interval < 1:
    raise ValueError(
      "Need initial_scale > 0, min_scale > 0, factor > 1 and growth_interval >= 1; "
      f"got {initial_scale=}, {min_scale=}, {factor=}, {growth_interval=}."
    )
  return DynamicLossScale(
    scale=jnp.asarray(initial_scale, jnp.float32),
    good_steps=jnp.zeros((), jnp.int32),
    growth_interval=jnp.asarray(growth_interval, jnp.int32),
    factor=jnp.asarray(factor, jnp.float32),
    min_scale=jnp.asarray(min_scale, jnp.float32),
  )
