"""Poisson sampling at one compiled size: :class:`PoissonSampler` draws each
example with probability ``q`` and pads the draw to one fixed size, so that
one compiled step serves every draw.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import numpy as np

from jaxaccum import _split
from jaxaccum._checks import check_number

PyTree = Any


class PoissonSampler:
  """Poisson sampling at one fixed, padded batch size.

  Each example of a data set of ``num_examples`` is drawn independently with
  probability ``q = expected_batch_size / num_examples``, the sampling that
  DP-SGD's privacy analysis assumes (and :func:`dp_epsilon` accounts for).
  The number drawn varies from step to step; each draw is padded to
  ``max_batch_size`` rows with :func:`jaxaccum.pad_batch` and comes with a
  row mask for ``example_mask=``, so one compiled step serves every draw.

  ``max_batch_size`` is the smallest multiple of ``multiple_of`` for which a
  draw exceeds it with probability at most ``overflow_probability`` per step
  (the binomial tail, from scipy); :attr:`overflow_probability` holds the
  exact tail at that size. A draw that does exceed it raises a
  ``RuntimeError``: truncating it, or drawing again, would bias the sample
  and void the guarantee.

  The draws use the numpy ``Generator`` you pass. The privacy analysis
  assumes true randomness; seed it from ``secrets.randbits(128)`` in
  production rather than from a fixed number.

  Args:
    num_examples: N, the size of the data set.
    expected_batch_size: ``q * N``, the mean number of examples per draw.
    overflow_probability: the largest acceptable probability, per step, of a
      draw larger than ``max_batch_size``.
    multiple_of: round ``max_batch_size`` up to a multiple of this (the
      number of micro-batches times the data-parallel devices).

  Attributes:
    num_examples: N, as given.
    expected_batch_size: ``q * N``, as given (a float); pass it to
      :func:`dp_noise` with ``normalize="poisson"``.
    sampling_rate: ``q = expected_batch_size / num_examples``, for
      :func:`dp_epsilon`.
    max_batch_size: the padded size of every draw (rows).
    overflow_probability: the exact probability, per step, of a draw larger
      than ``max_batch_size``.

  >>> import numpy as np, jaxaccum
  >>> sampler = jaxaccum.PoissonSampler(1000, 100, multiple_of=8)
  >>> sampler.sampling_rate, sampler.max_batch_size, sampler.overflow_probability < 1e-6
  (0.1, 152, True)
  >>> x = np.arange(1000.0)
  >>> batch, mask = sampler.sample(x, np.random.default_rng(0))
  >>> batch.shape, mask.shape, int(mask.sum()) == len(np.unique(batch[mask > 0]))
  ((152,), (152,), True)
  """

  def __init__(
    self,
    num_examples: int,
    expected_batch_size: float,
    *,
    overflow_probability: float = 1e-6,
    multiple_of: int = 1,
  ):
    from scipy import stats  # noqa: PLC0415 (jax depends on scipy)

    for name, n in (("num_examples", num_examples), ("multiple_of", multiple_of)):
      if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n <= 0:
        raise ValueError(f"{name} must be a positive integer, got {name}={n!r}.")
    check_number("expected_batch_size", expected_batch_size)
    if not 0 < expected_batch_size <= num_examples:
      raise ValueError(
        f"expected_batch_size must be in (0, num_examples], got "
        f"{expected_batch_size=} for {num_examples=}."
      )
    check_number("overflow_probability", overflow_probability)
    if not 0 < overflow_probability < 1:
      raise ValueError(
        f"overflow_probability must be in (0, 1), got {overflow_probability=}."
      )
    self.num_examples = int(num_examples)
    self.expected_batch_size = float(expected_batch_size)
    self.sampling_rate = self.expected_batch_size / self.num_examples
    binom = stats.binom(self.num_examples, self.sampling_rate)
    # The smallest size M with P(draw > M) <= overflow_probability.
    size = int(binom.isf(overflow_probability))
    while size > 0 and binom.sf(size - 1) <= overflow_probability:
      size -= 1
    while binom.sf(size) > overflow_probability:
      size += 1
    size = max(size, 1)
    multiple = int(multiple_of)
    self.max_batch_size = min(-(-size // multiple) * multiple, self._cap(multiple))
    #: P(a draw has more than max_batch_size examples), per step.
    self.overflow_probability = float(binom.sf(self.max_batch_size))

  def _cap(self, multiple: int) -> int:
    """No draw has more than every example: N, rounded up."""
    return -(-self.num_examples // multiple) * multiple

  def sample_indices(self, rng: np.random.Generator) -> np.ndarray:
    """The indices of one Poisson draw, in increasing order.

    Raises:
      RuntimeError: if more than ``max_batch_size`` examples were drawn.
    """
    drawn = np.flatnonzero(rng.random(self.num_examples) < self.sampling_rate)
    if drawn.size > self.max_batch_size:
      raise RuntimeError(
        f"The Poisson draw holds {drawn.size} examples, more than "
        f"max_batch_size={self.max_batch_size} (probability "
        f"{self.overflow_probability:.2g} per step). It is not truncated: that "
        "would break the privacy guarantee. Build the sampler with a smaller "
        "overflow_probability."
      )
    return drawn

  def sample(self, data: PyTree, rng: np.random.Generator) -> tuple[PyTree, Any]:
    """One draw from ``data`` (a pytree of arrays with ``num_examples``
    rows), padded to ``max_batch_size`` rows.

    Returns:
      ``(batch, mask)``: the drawn rows then padding (copies of the last
      drawn row, or of row 0 for an empty draw), and a float32 mask, 1 for
      drawn rows and 0 for padding; pass it as ``example_mask=``.
    """
    size = _split.leading_batch_size({"data": data})
    if size != self.num_examples:
      raise ValueError(
        f"The data has {size} rows, but the sampler was built for "
        f"num_examples={self.num_examples}."
      )
    drawn = self.sample_indices(rng)
    if drawn.size == 0:  # pad_batch needs a row to repeat; mask it all
      batch, _ = _split.pad_batch(
        jax.tree.map(lambda x: x[:1], data), micro_batch_size=self.max_batch_size
      )
      return batch, np.zeros(self.max_batch_size, np.float32)
    rows = jax.tree.map(lambda x: x[drawn], data)
    return _split.pad_batch(rows, micro_batch_size=self.max_batch_size)
