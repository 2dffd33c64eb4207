"""Privacy accounting: :func:`dp_epsilon` asks Google's ``dp-accounting``
package for epsilon; jaxaccum computes none itself.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from jaxaccum._checks import check_number

PyTree = Any


ACCOUNTANTS = ("pld", "rdp")
SAMPLINGS = ("poisson", "fixed")


def dp_epsilon(
  sampling_rate: float,
  noise_multiplier: float,
  steps: int,
  delta: float,
  *,
  accountant: str | None = None,
  value_discretization_interval: float = 1e-4,
  sampling: str = "poisson",
  num_examples: int | None = None,
) -> float:
  """Epsilon of DP-SGD, from Google's ``dp-accounting`` package.

  With ``sampling="poisson"`` (the default) the mechanism is ``steps``
  compositions of the Poisson-subsampled Gaussian mechanism
  (``dp_accounting.PoissonSampledDpEvent`` of a ``GaussianDpEvent``), under
  add-or-remove-one adjacency: what :class:`PoissonSampler`,
  ``clip_per_example`` and :func:`dp_noise` with a public denominator
  (``expected_batch_size``, or ``expected_weight``) implement.

  With ``sampling="fixed"`` it is ``steps`` compositions of the Gaussian
  mechanism on a batch of ``B = sampling_rate * num_examples`` examples drawn
  uniformly *without replacement*, afresh each step
  (``dp_accounting.SampledWithoutReplacementDpEvent``), under replace-one
  adjacency (the data set's size is public; one example is replaced by
  another), which is what a fixed batch size can be analysed under. One
  example replaced moves the clipped sum by up to ``2 C``, so the Gaussian
  event's noise multiplier is ``noise_multiplier / 2``. Only the Rényi DP
  accountant has this event. Batches taken by shuffling once per epoch are
  another mechanism, which this epsilon does not cover. jaxaccum computes
  nothing itself.

  Args:
    sampling_rate: q, each example's probability of being drawn per step
      (1 for the full batch every step).
    noise_multiplier: sigma of :func:`dp_noise`.
    steps: the number of steps (noise draws).
    delta: the target delta, e.g. 1e-5; below 1 / N for N examples.
    accountant: ``"pld"`` (privacy loss distributions: the tighter) or
      ``"rdp"`` (Rényi DP: an upper bound); by default ``"pld"`` for
      Poisson sampling and ``"rdp"`` for ``sampling="fixed"``, which only it
      accounts for.
    value_discretization_interval: the PLD accountant's grid of privacy loss
      values (``dp_accounting``'s default, 1e-4). Its arrays hold about
      ``(20 / sigma + 1 / sigma**2) / interval`` points, so a small sigma needs
      a coarser grid (or ``"rdp"``); more than :data:`PLD_MAX_POINTS` is
      refused before anything is allocated.
    sampling: ``"poisson"`` or ``"fixed"`` (batches of a fixed size drawn
      without replacement each step; needs ``num_examples``).
    num_examples: N, the data set's size, for ``sampling="fixed"``; the
      batch size ``sampling_rate * N`` must be a whole number.

  Returns:
    The smallest epsilon the accountant certifies at ``delta``.

  What it covers is in ``docs/privacy.md``, "Which epsilon covers which
  step": every step that jaxaccum accepts divides the noisy clipped sum by a
  public number, and is covered by one of the two samplings. The one
  combination jaxaccum cannot see is the sampling itself:
  ``dp_noise(..., normalize="fixed")`` divides by the count of real examples,
  which is public at a fixed batch size and private under Poisson sampling.

  >>> import jaxaccum
  >>> round(jaxaccum.dp_epsilon(0.01, 1.1, 1000, 1e-5), 2)
  1.52
  >>> round(jaxaccum.dp_epsilon(0.01, 1.1, 1000, 1e-5, sampling="fixed",
  ...   num_examples=10_000), 2)  # batches of 100, replace-one: weaker
  15.57
  """
  try:
    import dp_accounting  # noqa: PLC0415 (an optional dependency)
  except ImportError:
    raise ImportError(
      "dp_epsilon needs Google's dp-accounting package: "
      "pip install 'jaxaccum[dp]' (or pip install dp-accounting)."
    ) from None
  _check_arguments(sampling_rate, noise_multiplier, steps, delta, sampling)
  if accountant is None:
    accountant = "pld" if sampling == "poisson" else "rdp"
  if accountant not in ACCOUNTANTS:
    raise ValueError(f"Unknown {accountant=}; choose one of {list(ACCOUNTANTS)}.")
  if sampling == "fixed":
    return _without_replacement(
      dp_accounting,
      sampling_rate,
      noise_multiplier,
      steps,
      delta,
      accountant=accountant,
      num_examples=num_examples,
    )
  if num_examples is not None:
    raise ValueError(
      f"{num_examples=} is for sampling='fixed'; Poisson sampling needs only "
      "the sampling rate."
    )
  event = dp_accounting.PoissonSampledDpEvent(
    float(sampling_rate), dp_accounting.GaussianDpEvent(float(noise_multiplier))
  )
  if accountant == "pld":
    _check_pld_size(noise_multiplier, value_discretization_interval)
    counter = dp_accounting.pld.PLDAccountant(
      value_discretization_interval=float(value_discretization_interval)
    )
  else:
    counter = dp_accounting.rdp.RdpAccountant()
  counter.compose(dp_accounting.SelfComposedDpEvent(event, int(steps)))
  return float(counter.get_epsilon(float(delta)))


def _check_arguments(
  sampling_rate: float, noise_multiplier: float, steps: int, delta: float, sampling: str
) -> None:
  """Raises for an argument of :func:`dp_epsilon` out of its range, in the
  order of its signature."""
  check_number("sampling_rate", sampling_rate)
  if not 0 < sampling_rate <= 1:
    raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate=}.")
  check_number("noise_multiplier", noise_multiplier)
  if not noise_multiplier >= 0:
    raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier=}.")
  if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
    raise ValueError(
      f"steps must be an integer >= 1, the noise draws so far, got {steps=}: "
      "before the first step nothing was released and there is no epsilon to "
      "report."
    )
  check_number("delta", delta)
  if not 0 < delta < 1:
    raise ValueError(f"delta must be in (0, 1), got {delta=}.")
  if sampling not in SAMPLINGS:
    raise ValueError(f"Unknown {sampling=}; choose one of {list(SAMPLINGS)}.")


def _without_replacement(
  dp_accounting: Any,
  sampling_rate: float,
  noise_multiplier: float,
  steps: int,
  delta: float,
  *,
  accountant: str,
  num_examples: Any,
) -> float:
  """:func:`dp_epsilon` for batches of a fixed size drawn without
  replacement: ``dp_accounting``'s event, replace-one adjacency, sensitivity
  ``2 C``."""
  if accountant != "rdp":
    raise ValueError(
      f"sampling='fixed' is accounted for by dp-accounting's Rényi DP "
      f"accountant only (its PLD accountant has no sampling without "
      f"replacement): pass accountant='rdp' or leave it out, not {accountant=}."
    )
  if (
    isinstance(num_examples, bool)
    or not isinstance(num_examples, numbers.Integral)
    or num_examples < 1
  ):
    raise ValueError(
      "sampling='fixed' needs num_examples=N, the data set's size (a positive "
      f"integer), got {num_examples=}: the batch is sampling_rate * N examples "
      "drawn from N without replacement."
    )
  n = int(num_examples)
  size = float(sampling_rate) * n
  if abs(size - round(size)) > 1e-9 * n or round(size) < 1:
    raise ValueError(
      f"sampling='fixed' draws a batch of sampling_rate * num_examples = {size:g} "
      "examples, which must be a whole number >= 1: pass sampling_rate = "
      "batch_size / num_examples."
    )
  relation = dp_accounting.privacy_accountant.NeighboringRelation.REPLACE_ONE
  event = dp_accounting.SampledWithoutReplacementDpEvent(
    n,
    round(size),
    # One example replaced by another moves the clipped sum by up to 2 C.
    dp_accounting.GaussianDpEvent(float(noise_multiplier) / 2),
  )
  counter = dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)
  counter.compose(dp_accounting.SelfComposedDpEvent(event, int(steps)))
  return float(counter.get_epsilon(float(delta)))


#: The most points :func:`dp_epsilon` lets the PLD accountant's arrays hold
#: (float64: 40 MB each; its composition takes several such arrays). At the
#: default grid that admits sigma >= 0.065; sigma = 0.1 (3e6 points) takes
#: about 15 s on one CPU core for 100 steps, sigma = 0.03 (1.8e7) 230 s.
PLD_MAX_POINTS = 5_000_000


def pld_points(noise_multiplier: float, interval: float) -> float:
  """An upper bound on the points of the PLD of one Gaussian step (sampling
  rate 1: subsampling shrinks it): its privacy losses span about
  ``20 / sigma`` (the tails to a mass of e^-50) plus ``1 / sigma**2`` (the
  shift between the two Gaussians), in steps of ``interval``. Within 2x of
  ``dp_accounting``'s own sizes for sigma from 0.03 to 1.

  >>> f"{pld_points(1.0, 1e-4):.3g}", f"{pld_points(1e-3, 1e-4):.3g}"
  ('2.1e+05', '1.02e+10')
  """
  sigma = float(noise_multiplier)
  return (20 / sigma + 1 / sigma**2) / float(interval)


def _check_pld_size(noise_multiplier: float, interval: Any) -> None:
  """Refuses PLD settings whose arrays would not fit in memory, before
  ``dp_accounting`` allocates them (sigma = 1e-3 asked it for 38 GiB)."""
  check_number("value_discretization_interval", interval)
  if not (math.isfinite(interval) and interval > 0):
    raise ValueError(
      f"value_discretization_interval must be a positive number, got {interval=}."
    )
  if noise_multiplier == 0:  # no noise: dp_accounting reports infinity
    return
  points = pld_points(noise_multiplier, interval)
  if points > PLD_MAX_POINTS:
    coarser = pld_points(noise_multiplier, 1.0) / PLD_MAX_POINTS
    raise ValueError(
      f"The PLD accountant at noise_multiplier={noise_multiplier} and "
      f"value_discretization_interval={interval} would discretize about "
      f"{points:.2g} privacy loss values ({points * 8 / 2**30:.3g} GiB per "
      f"array, several arrays), more than PLD_MAX_POINTS={PLD_MAX_POINTS:.2g}. "
      f"Pass value_discretization_interval={_round_up(coarser):.2g} or coarser "
      "(epsilon then comes out slightly larger: still an upper bound), or "
      'accountant="rdp".'
    )


def _round_up(x: float) -> float:
  """``x`` rounded up to two significant digits."""
  scale = 10 ** (math.floor(math.log10(x)) - 1)
  return math.ceil(x / scale) * scale
