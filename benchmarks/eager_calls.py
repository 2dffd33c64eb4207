"""What one eager (un-jitted) call costs: jaxaccum vs ``jax.value_and_grad``.

Run: ``python benchmarks/eager_calls.py [--rounds 30] [--out benchmarks/results]``
(``--quick``: 5 rounds, to the temporary folder; ``--min-sample-ms`` repeats
a call within a sample, ``--cpus`` pins the run).

``jax.value_and_grad(loss)(params, batch)`` called outside ``jit`` runs op by
op. ``jaxaccum.value_and_grad(loss, 4)`` called the same way compiles its
step once per configuration and keeps it (``jaxaccum/_calls.py``), and
validates its arguments once per configuration. Side by side, in one run and
interleaved call by call, on each benchmark model (``_models.py``):

- ``jax``: eager ``jax.value_and_grad(loss)``, the reference a drop-in is
  compared with;
- ``jax_again``: the same timed a second time, the A/A control: its median
  over ``jax``'s (``aa_ratio``) is the noise floor of the ratios;
- ``jaxaccum``: eager ``jaxaccum.value_and_grad(loss, k)``;
- ``jit``: ``jax.jit(jax.value_and_grad(loss))``, for scale.

The first call of each (compilation) and one untimed round are left out;
each round then times every approach once, in an order rotated by the
round, and the medians are
reported, with each approach's ratio to ``jax``. Outputs
``eager_calls.json`` in ``--out``.
"""

# The manual's blocks below use its typography: multiplication signs, en
# dashes, minus signs.
# ruff: noqa: RUF001

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import datetime
import functools
import json
import math
import pathlib
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import _models
import _paths
import _timing
import jax
from _report import aa_note, capital, cpu_model, ms, ratio, table

import jaxaccum


def _timed(fun: Callable[[], Any], repeats: int = 1) -> float:
  """Seconds per call over ``repeats`` back-to-back calls."""
  start = time.perf_counter()
  for _ in range(repeats):
    out = fun()
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / repeats


def measure(
  model: _models.Model, k: int, rounds: int, min_sample_ms: float = 0.0
) -> dict[str, Any]:
  """The median seconds per call of each approach over ``rounds``
  interleaved rounds, a sample repeating a call until it lasts
  ``min_sample_ms`` (one call with 0)."""
  approaches = {
    "jax": jax.value_and_grad(model.loss),
    "jax_again": jax.value_and_grad(model.loss),  # the A/A control
    "jaxaccum": jaxaccum.value_and_grad(model.loss, k),
    "jit": jax.jit(jax.value_and_grad(model.loss)),
  }
  calls = {
    name: functools.partial(fun, model.params, model.batch)
    for name, fun in approaches.items()
  }
  repeats = {}
  for name, call in calls.items():
    _timed(call)  # compile / warm up
    repeats[name] = max(1, math.ceil(min_sample_ms / 1e3 / max(_timed(call), 1e-6)))
  names = list(calls)
  for name in names:  # one untimed round: the first sample ran slow (A/A)
    _timed(calls[name], repeats[name])
  samples: dict[str, list[float]] = {name: [] for name in names}
  for r in range(rounds):  # interleaved, so drift hits every approach alike
    shift = r % len(names)
    for name in names[shift:] + names[:shift]:
      samples[name].append(_timed(calls[name], repeats[name]))
  medians = {name: statistics.median(s) for name, s in samples.items()}
  return {
    "model": model.name,
    "k": k,
    "median_ms": {n: 1e3 * m for n, m in medians.items()},
    "ratio_to_jax": {n: m / medians["jax"] for n, m in medians.items()},
    "aa_ratio": medians["jax_again"] / medians["jax"],
    "repeats_per_sample": repeats,
    "samples_ms": {n: [1e3 * t for t in s] for n, s in samples.items()},
  }


# ---------------------------------------------------------------- the manual's blocks


def eager_calls_table(results: dict[str, Any]) -> str:
  has_aa = any("aa_ratio" in r for r in results["rows"])
  rows = []
  for r in results["rows"]:
    t, x = r["median_ms"], r["ratio_to_jax"]
    rows.append(
      [
        r["model"],
        r["k"],
        ms(t["jax"]),
        *([ratio(r.get("aa_ratio"))] if has_aa else []),
        f"{ms(t['jaxaccum'])} ({x['jaxaccum']:.3f})",
        f"{ms(t['jit'])} ({x['jit']:.3f})",
      ]
    )
  host = results.get("cpu_model") or results["machine"]
  if results.get("cpu_count"):
    host += f", {results['cpu_count']} cores"
  if results.get("pinned"):
    host += f", pinned to CPUs {','.join(map(str, results['cpus']))}"
  if results.get("load_average_at_start"):
    host += f", one-minute load average {results['load_average_at_start'][0]:.1f}"
  head = (
    f"Measured on {results['date']} ({host}), jax {results['jax']}, "
    f"the median of {results['calls']} interleaved rounds after the first call ("
    + (
      f"a sample repeats a call until it lasts {results['min_sample_ms']:g} ms"
      if results.get("min_sample_ms")
      else "one call each"
    )
    + "): ms per call (× eager `jax.value_and_grad`). "
    + (
      "A/A: eager `jax.value_and_grad` timed twice in the same rounds, its "
      "second median over its first (the noise floor of the row's ratios)."
      if has_aa
      else f"{capital(aa_note(None))}."
    )
  )
  header = [
    "model",
    "k",
    "eager `jax.value_and_grad`",
    *(["A/A"] if has_aa else []),
    "eager `jaxaccum.value_and_grad`",
    "`jax.jit(jax.value_and_grad)`",
  ]
  return head + "\n\n" + table(header, rows)


#: The generated blocks this file writes from ``eager_calls.json``, by name
#: (``_report.py`` puts each on its page).
BLOCKS = {
  "eager_calls table": eager_calls_table,
}


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--quick", action="store_true", help="5 rounds, to the temporary folder"
  )
  parser.add_argument(
    "--rounds",
    "--calls",
    dest="calls",
    type=int,
    help="interleaved rounds, one sample of every approach each (default 30)",
  )
  parser.add_argument(
    "--min-sample-ms",
    type=float,
    default=0.0,
    help="repeat a call within a sample until it lasts this long (default: one call)",
  )
  parser.add_argument("--k", type=int, default=4)
  parser.add_argument("--preset", default="cpu", choices=sorted(_models.PRESETS))
  parser.add_argument(
    "--out",
    type=pathlib.Path,
    help="output folder (default: benchmarks/results; quick: the temporary folder)",
  )
  _timing.add_cpus_argument(parser)
  args = parser.parse_args(argv)
  args.calls = args.calls or (5 if args.quick else 30)
  cpus = _timing.pin(args.cpus)  # before JAX starts its threads
  load_at_start = list(os.getloadavg())
  rows = [
    measure(_models.build(name, args.preset), args.k, args.calls, args.min_sample_ms)
    for name in ("dispatch_mlp", "transformer")
  ]
  print(f"{'model':>14} {'approach':>10} {'median ms':>10} {'x jax':>7}")
  for row in rows:
    for name, median in row["median_ms"].items():
      print(
        f"{row['model']:>14} {name:>10} {median:>10.3g} {row['ratio_to_jax'][name]:>7.2f}"
      )
    print(f"{'':>14} noise floor: {aa_note(row['aa_ratio'])} (jax_again / jax)")
  out = _paths.output_folder(args.out, args.quick)
  out.mkdir(parents=True, exist_ok=True)
  result = {
    "jax": jax.__version__,
    "date": datetime.date.today().isoformat(),
    "machine": platform.processor() or platform.machine(),
    "cpu_model": cpu_model(),
    "cpu_count": os.cpu_count(),
    "load_average_at_start": load_at_start,
    "calls": args.calls,
    "min_sample_ms": args.min_sample_ms,
    "cpus": cpus,
    "pinned": bool(args.cpus),
    "rows": rows,
  }
  path = out / ("eager_calls_quick.json" if args.quick else "eager_calls.json")
  path.write_text(json.dumps(result, indent=1))
  print(f"wrote {path}")
  for row in rows:
    print(json.dumps({k: v for k, v in row.items() if k != "samples_ms"}))


if __name__ == "__main__":
  main()
