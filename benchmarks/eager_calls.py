"""What one eager (un-jitted) call costs: jaxaccum vs ``jax.value_and_grad``.

Run: ``python benchmarks/eager_calls.py [--calls 30] [--out benchmarks/results]``.

``jax.value_and_grad(loss)(params, batch)`` called outside ``jit`` runs op by
op. ``jaxaccum.value_and_grad(loss, 4)`` called the same way compiles its
step once per configuration and keeps it (``jaxaccum/_calls.py``), and
validates its arguments once per configuration. Side by side, in one run and
interleaved call by call, on each benchmark model (``_models.py``):

- ``jax``: eager ``jax.value_and_grad(loss)``, the reference a drop-in is
  compared with;
- ``jaxaccum``: eager ``jaxaccum.value_and_grad(loss, k)``;
- ``jit``: ``jax.jit(jax.value_and_grad(loss))``, for scale.

The first call of each (compilation) is left out; the medians of the rest
are reported, with each approach's ratio to ``jax``. Outputs
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
import json
import pathlib
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import _models
import jax
from _report import cpu_model, ms, table

import jaxaccum


def _timed(fun: Callable[[], Any]) -> float:
  start = time.perf_counter()
  jax.block_until_ready(fun())
  return time.perf_counter() - start


def measure(model: _models.Model, k: int, calls: int) -> dict[str, Any]:
  approaches = {
    "jax": jax.value_and_grad(model.loss),
    "jaxaccum": jaxaccum.value_and_grad(model.loss, k),
    "jit": jax.jit(jax.value_and_grad(model.loss)),
  }
  samples: dict[str, list[float]] = {name: [] for name in approaches}
  for fun in approaches.values():  # compile / warm up
    _timed(lambda fun=fun: fun(model.params, model.batch))
  for _ in range(calls):  # interleaved, so drift hits every approach alike
    for name, fun in approaches.items():
      samples[name].append(_timed(lambda fun=fun: fun(model.params, model.batch)))
  medians = {name: statistics.median(s) for name, s in samples.items()}
  return {
    "model": model.name,
    "k": k,
    "median_ms": {n: 1e3 * m for n, m in medians.items()},
    "ratio_to_jax": {n: m / medians["jax"] for n, m in medians.items()},
    "samples_ms": {n: [1e3 * t for t in s] for n, s in samples.items()},
  }


# ---------------------------------------------------------------- the manual's blocks


def eager_calls_table(results: dict[str, Any]) -> str:
  rows = []
  for r in results["rows"]:
    t, x = r["median_ms"], r["ratio_to_jax"]
    rows.append(
      [
        r["model"],
        r["k"],
        ms(t["jax"]),
        f"{ms(t['jaxaccum'])} ({x['jaxaccum']:.3f})",
        f"{ms(t['jit'])} ({x['jit']:.3f})",
      ]
    )
  host = results.get("cpu_model") or results["machine"]
  if results.get("cpu_count"):
    host += f", {results['cpu_count']} cores"
  if results.get("load_average_at_start"):
    host += f", one-minute load average {results['load_average_at_start'][0]:.1f}"
  head = (
    f"Measured on {results['date']} ({host}), jax {results['jax']}, "
    f"the median of {results['calls']} interleaved calls after the first: ms per "
    "call (× eager `jax.value_and_grad`)."
  )
  header = [
    "model",
    "k",
    "eager `jax.value_and_grad`",
    "eager `jaxaccum.value_and_grad`",
    "`jax.jit(jax.value_and_grad)`",
  ]
  return head + "\n\n" + table(header, rows)


#: The generated blocks this file writes from ``eager_calls.json``, by name
#: (``_report.py`` puts each on its page).
BLOCKS = {
  "eager_calls table": eager_calls_table,
}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--calls", type=int, default=30)
  parser.add_argument("--k", type=int, default=4)
  parser.add_argument("--preset", default="cpu", choices=sorted(_models.PRESETS))
  parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"))
  args = parser.parse_args()
  load_at_start = list(os.getloadavg())
  rows = [
    measure(_models.build(name, args.preset), args.k, args.calls)
    for name in ("dispatch_mlp", "transformer")
  ]
  print(f"{'model':>14} {'approach':>10} {'median ms':>10} {'x jax':>7}")
  for row in rows:
    for name, median in row["median_ms"].items():
      print(
        f"{row['model']:>14} {name:>10} {median:>10.3g} {row['ratio_to_jax'][name]:>7.2f}"
      )
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  result = {
    "jax": jax.__version__,
    "date": datetime.date.today().isoformat(),
    "machine": platform.processor() or platform.machine(),
    "cpu_model": cpu_model(),
    "cpu_count": os.cpu_count(),
    "load_average_at_start": load_at_start,
    "calls": args.calls,
    "rows": rows,
  }
  (out / "eager_calls.json").write_text(json.dumps(result, indent=1))
  for row in rows:
    print(json.dumps({k: v for k, v in row.items() if k != "samples_ms"}))


if __name__ == "__main__":
  main()
