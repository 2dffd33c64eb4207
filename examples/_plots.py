"""Readable log axes for the examples' plots.

A helper of the examples, not one of them: ``from _plots import log_axis``
works when an example runs as ``python examples/NAME.py``, since Python puts
the script's folder on ``sys.path``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
from matplotlib.axes import Axes
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter


def log_axis(ax: Axes, *values: Iterable[float], axis: str = "y") -> None:
  """A log scale for ``values`` if they span a factor of 10 or more.

  The labels are plain numbers (0.05, 0.1, 0.2, 0.5, 1, 2) at 1, 2 and 5
  times the powers of 10, or at the powers of 10 alone over more than 4 of
  them; no minor tick is labeled. Over less than a factor of 10 the axis
  stays linear: a log axis there has one label or crowded ones.
  """
  flat = np.concatenate([np.ravel(np.asarray(v, np.float64)) for v in values])
  flat = flat[np.isfinite(flat) & (flat > 0)]
  if flat.size == 0 or flat.max() < 10 * flat.min():
    return
  decades = math.log10(flat.max() / flat.min())
  which = ax.yaxis if axis == "y" else ax.xaxis
  (ax.set_yscale if axis == "y" else ax.set_xscale)("log")
  which.set_major_locator(LogLocator(subs=(1.0,) if decades > 4 else (1.0, 2.0, 5.0)))
  which.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
  which.set_minor_formatter(NullFormatter())
