"""The schedule: which micro-batch and repeat each stage works on at each
iteration of the loop, and how many iterations the loop has."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


class PipelineBubbleWarning(UserWarning):
  """Fewer pipeline micro-batches than stages: most of the loop is bubble."""


@dataclasses.dataclass(frozen=True)
class Schedule:
  """The static numbers of one pipeline, and the loop they make.

  Attributes:
    stages: ``S``.
    repeats: ``r``, passes of every micro-batch through the stages.
    micro_batches: ``m``.
    layers_per_stage: ``n``, layers a stage runs per repeat.
  """

  stages: int
  repeats: int
  micro_batches: int
  layers_per_stage: int

  @property
  def period(self) -> int:
    """Iterations between a micro-batch's repeats at stage 0: ``m``, or ``S``
    when ``m < S`` (a micro-batch needs ``S`` iterations to come back)."""
    return max(self.micro_batches, self.stages)

  @property
  def iterations(self) -> int:
    """The loop's trip count, ``(r - 1)·period + m + S - 1``: ``r·m + S -
    1`` when ``m >= S`` or ``r = 1``, else ``r·S + m - 1``."""
    return (self.repeats - 1) * self.period + self.micro_batches + self.stages - 1

  @property
  def bubble(self) -> float:
    """The fraction of the iterations in which a stage idles."""
    return 1 - self.repeats * self.micro_batches / self.iterations

  def slot(self, iteration: jax.Array, stage: jax.Array | int) -> tuple[jax.Array, ...]:
    """What ``stage`` works on at ``iteration``: ``(micro_batch, repeat,
    real)``; outside ``real`` (the bubble) the indices are clipped to valid
    ones, and the work is thrown away."""
    p = iteration - stage
    micro, repeat = p % self.period, p // self.period
    real = (p >= 0) & (repeat < self.repeats) & (micro < self.micro_batches)
    return (
      jnp.clip(micro, 0, self.micro_batches - 1),
      jnp.clip(repeat, 0, self.repeats - 1),
      real,
    )
