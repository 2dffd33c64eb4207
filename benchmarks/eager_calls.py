"""What one eager (un-jitted) call costs: jaxaccum vs ``jax.value_and_grad``.

Eager ``jax.value_and_grad(loss)`` (``jax``, and again as ``jax_again``, the
A/A control), eager ``jaxaccum.value_and_grad(loss, k)``, which compiles its
step once per configuration and keeps it, and ``jax.jit`` of the first
(``jit``), timed in interleaved rounds on two of ``_models.py``'s models.
Outputs ``eager_calls.json`` in ``--out``.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import datetime
import functools
import json
import platform
import statistics
from collections.abc import Sequence
from typing import Any

import _models
import _paths
import _timing
import jax
from _report import aa_note, capital, columns, cpu_model, ms, ratio

import jaxaccum


def measure(
  model: _models.Model, k: int, rounds: int, min_sample_ms: float = 0.0
) -> dict[str, Any]:
  """The median milliseconds per call of each approach over ``rounds``
  interleaved rounds (``_timing.interleaved``), a sample repeating a call
  until it lasts ``min_sample_ms`` (one call with 0)."""
  approaches = {
    "jax": jax.value_and_grad(model.loss),
    "jax_again": jax.value_and_grad(model.loss),  # the A/A control
    "jaxaccum": jaxaccum.value_and_grad(model.loss, k),
    "jit": jax.jit(jax.value_and_grad(model.loss)),
  }
  samples, repeats = _timing.interleaved(
    {
      name: functools.partial(fun, model.params, model.batch)
      for name, fun in approaches.items()
    },
    rounds=rounds,
    min_sample_ms=min_sample_ms,
  )
  medians = {name: statistics.median(s) for name, s in samples.items()}
  return {
    "model": model.name,
    "k": k,
    "median_ms": medians,
    "ratio_to_jax": {n: m / medians["jax"] for n, m in medians.items()},
    "aa_ratio": medians["jax_again"] / medians["jax"],
    "repeats_per_sample": repeats,
    "samples_ms": samples,
  }


# ---------------------------------------------------------------- the manual's blocks


def eager_calls_table(results: dict[str, Any]) -> str:
  has_aa = any("aa_ratio" in r for r in results["rows"])
  cpus = str(results.get("cpu_count") or "–")
  if results.get("pinned"):
    cpus += f", pinned to {','.join(map(str, results['cpus']))}"
  load = results.get("load_average_at_start")
  sample = results.get("min_sample_ms")
  run = columns(
    [results],
    {
      "measured": lambda r: r["date"],
      "CPU": lambda r: r.get("cpu_model") or r["machine"],
      "cores": lambda r: cpus,
      "jax": lambda r: r["jax"],
      "load average": lambda r: f"{load[0]:.1f}" if load else "–",
      "rounds": lambda r: r["calls"],
      "sample, ms": lambda r: f"{sample:g}" if sample else "one call",
    },
  )
  spec = {
    "model": lambda r: r["model"],
    "k": lambda r: r["k"],
    "eager `jax.value_and_grad`": lambda r: ms(r["median_ms"]["jax"]),
    "A/A": lambda r: ratio(r.get("aa_ratio")),
    "eager `jaxaccum.value_and_grad`": lambda r: _vs_jax(r, "jaxaccum"),
    "`jax.jit(jax.value_and_grad)`": lambda r: _vs_jax(r, "jit"),
  }
  if not has_aa:
    del spec["A/A"]
    run += f"\n\n{capital(aa_note(None))}."
  return run + "\n\n" + columns(results["rows"], spec)


def _vs_jax(r: dict[str, Any], name: str) -> str:
  return f"{ms(r['median_ms'][name])} ({r['ratio_to_jax'][name]:.3f})"


#: The blocks written from ``eager_calls.json``, by name (for ``_report.py``).
BLOCKS = {
  "eager_calls table": eager_calls_table,
}


def main(argv: Sequence[str] | None = None) -> None:
  parser = _paths.parser(__doc__, quick="5 rounds, to the temporary folder", cpus=True)
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
  args = parser.parse_args(argv)
  args.calls = args.calls or (5 if args.quick else 30)
  cpus = _timing.pin(args.cpus)  # before JAX starts its threads
  load_at_start = list(os.getloadavg())
  rows = [
    measure(_models.build(name, args.preset), args.k, args.calls, args.min_sample_ms)
    for name in ("dispatch_mlp", "transformer")
  ]
  args.out.mkdir(parents=True, exist_ok=True)
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
  path = args.out / ("eager_calls_quick.json" if args.quick else "eager_calls.json")
  path.write_text(json.dumps(result, indent=1))
  print(eager_calls_table(result))
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
