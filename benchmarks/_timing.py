"""What the timing benchmarks share: the CPUs they run on.

``step_time.py``, ``communication.py`` and ``eager_calls.py`` time steps on
the host's CPUs in interleaved rounds, with an A/A control (one approach
timed twice; ``_report.timed_verdict`` says which goals it decides). On a
machine that runs other jobs beside them, ``--cpus`` keeps a run on chosen
cores: :func:`pin` sets this process's CPU affinity before JAX starts its
backends, and XLA sizes its CPU thread pools (intra-op and the devices'
executions) from that affinity, so that every thread it starts stays there.
``taskset -c 0-3 python ...`` does the same from outside.
"""

from __future__ import annotations

import argparse
import os


def add_cpus_argument(parser: argparse.ArgumentParser) -> None:
  """``--cpus``: the CPUs to run on, e.g. ``0-3`` or ``0,2``."""
  parser.add_argument(
    "--cpus",
    help="run on these CPUs only, e.g. 0-3 or 0,2 (before JAX starts; default: "
    "the CPUs this process may use)",
  )


def parse_cpus(text: str) -> list[int]:
  """``"0-2,5"`` -> ``[0, 1, 2, 5]``.

  >>> parse_cpus("0-2,5")
  [0, 1, 2, 5]
  """
  cpus: set[int] = set()
  for part in text.split(","):
    lo, _, hi = part.strip().partition("-")
    cpus.update(range(int(lo), int(hi or lo) + 1))
  return sorted(cpus)


def pin(cpus: str | None) -> list[int] | None:
  """Runs this process, and every thread it starts from now on, on ``cpus``
  (``--cpus``); with None it stays where it may run. Call it before JAX's
  first computation.

  Returns:
    The CPUs the process runs on (None where the platform does not say).
  """
  if not hasattr(os, "sched_setaffinity"):  # not on Linux
    if cpus:
      raise SystemExit("--cpus needs os.sched_setaffinity (Linux); use taskset.")
    return None
  if cpus:
    os.sched_setaffinity(0, parse_cpus(cpus))
  return sorted(os.sched_getaffinity(0))
