"""Differentially private training (DP-SGD) over micro-batches.

Four pieces, each usable alone, one module each:

- :mod:`~jaxaccum._privacy.clipping`: each example's gradient clipped to
  ``C`` and summed (one ``vmap``), the gradient rule of ``clip_per_example``;
  :mod:`~jaxaccum._privacy.ghost` gives the same sum without per-example
  gradients (``clip_method="ghost"``);
- :mod:`~jaxaccum._privacy.noise`: :func:`dp_noise`, the Gaussian noise added
  once per logical batch, and the :class:`ClipRecord` it checks;
- :mod:`~jaxaccum._privacy.sampling`: :class:`PoissonSampler`;
- :mod:`~jaxaccum._privacy.options`: :class:`ClipPerExample`, the group of
  DP-SGD options;
- :mod:`~jaxaccum._privacy.accounting`: :func:`dp_epsilon`.

The names below are what the rest of jaxaccum uses; nothing else reaches
into the modules.
"""

from jaxaccum._privacy.accounting import PLD_MAX_POINTS as PLD_MAX_POINTS
from jaxaccum._privacy.accounting import dp_epsilon as dp_epsilon
from jaxaccum._privacy.accounting import pld_points as pld_points
from jaxaccum._privacy.clipping import MASK_KEYWORD as MASK_KEYWORD
from jaxaccum._privacy.clipping import check_mask as check_mask
from jaxaccum._privacy.clipping import (
  check_per_example_value as check_per_example_value,
)
from jaxaccum._privacy.clipping import check_public_args as check_public_args
from jaxaccum._privacy.clipping import clipped_value_and_grad as clipped_value_and_grad
from jaxaccum._privacy.clipping import ghost_objective as ghost_objective
from jaxaccum._privacy.clipping import public_fix as public_fix
from jaxaccum._privacy.ghost import GhostFallbackWarning as GhostFallbackWarning
from jaxaccum._privacy.noise import ClipWithoutNoiseWarning as ClipWithoutNoiseWarning
from jaxaccum._privacy.noise import DPNoiseState as DPNoiseState
from jaxaccum._privacy.noise import NoiseConfig as NoiseConfig
from jaxaccum._privacy.noise import accumulated_record as accumulated_record
from jaxaccum._privacy.noise import check_noise_matches as check_noise_matches
from jaxaccum._privacy.noise import dp_noise as dp_noise
from jaxaccum._privacy.noise import find_noise as find_noise
from jaxaccum._privacy.noise import gradient_of as gradient_of
from jaxaccum._privacy.noise import noise_config as noise_config
from jaxaccum._privacy.noise import warn_without_noise as warn_without_noise
from jaxaccum._privacy.options import ClipPerExample as ClipPerExample
from jaxaccum._privacy.record import ClipRecord as ClipRecord
from jaxaccum._privacy.record import clipped_sum_of as clipped_sum_of
from jaxaccum._privacy.record import made_record as made_record
from jaxaccum._privacy.record import record_of as record_of
from jaxaccum._privacy.record import take as take
from jaxaccum._privacy.sampling import PoissonSampler as PoissonSampler
