"""What the timing benchmarks share: interleaved rounds, and the CPUs they
run on.

``step_time.py``, ``communication.py`` and ``eager_calls.py`` time steps in
interleaved rounds (:func:`interleaved`), with an A/A control (one approach
timed twice; ``_report.timed_verdict`` says which goals it decides).
``--cpus`` keeps a run on chosen cores: :func:`pin` sets this process's CPU
affinity before JAX starts, and XLA sizes its CPU thread pools from it
(``taskset -c 0-3 python ...`` does the same from outside).
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax


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
  (``--cpus``; None: where it may run), before JAX's first computation; the
  CPUs it runs on (None where the platform does not say)."""
  if not hasattr(os, "sched_setaffinity"):  # not on Linux
    if cpus:
      raise SystemExit("--cpus needs os.sched_setaffinity (Linux); use taskset.")
    return None
  if cpus:
    os.sched_setaffinity(0, parse_cpus(cpus))
  return sorted(os.sched_getaffinity(0))


def time_ms(call: Callable[[], Any], repeats: int) -> float:
  """Milliseconds per call over ``repeats`` back-to-back calls, ended by
  ``jax.block_until_ready``."""
  start = time.perf_counter()
  for _ in range(repeats):
    out = call()
  jax.block_until_ready(out)
  return (time.perf_counter() - start) * 1e3 / repeats


def interleaved(
  calls: dict[str, Callable[[], Any]],
  *,
  rounds: int,
  min_sample_ms: float,
  max_repeats: int | None = None,
  after_round: Callable[[int], None] | None = None,
  started: dict[str, float] | None = None,
) -> tuple[dict[str, list[float]], dict[str, int]]:
  """Times ``calls`` in interleaved rounds: round ``r`` times each once, in
  an order rotated by ``r``, the garbage collector off. Each call is warmed
  up, a sample repeats it until it lasts ``min_sample_ms`` (at most
  ``max_repeats`` times), and one untimed round goes first (the first
  sample after the warmup ran slow). ``after_round(r)`` runs after round
  ``r``; ``started["timing"]`` gets the time the timed rounds start.

  Returns:
    Every call's samples (milliseconds per call) and its repeats per sample."""
  repeats = {}
  for name, call in calls.items():
    jax.block_until_ready(call())  # compile, warm up
    once = time_ms(call, 1)
    n = math.ceil(min_sample_ms / max(once, 1e-3))
    repeats[name] = max(1, min(max_repeats or n, n))
  names = list(calls)
  for name in names:
    time_ms(calls[name], repeats[name])
  samples: dict[str, list[float]] = {name: [] for name in names}
  if started is not None:
    started["timing"] = time.perf_counter()
  for r in range(rounds):
    shift = r % len(names)
    gc.collect()
    gc.disable()
    try:
      for name in names[shift:] + names[:shift]:
        samples[name].append(time_ms(calls[name], repeats[name]))
    finally:
      gc.enable()
    if after_round is not None:
      after_round(r)
  return samples, repeats


def quartiles(samples: list[float]) -> dict[str, float]:
  """The median, quartiles and minimum of ``samples`` (milliseconds)."""
  median = statistics.median(samples)
  q1, _, q3 = statistics.quantiles(samples, n=4) if len(samples) > 1 else [median] * 3
  return {"median_ms": median, "q1_ms": q1, "q3_ms": q3, "min_ms": min(samples)}
