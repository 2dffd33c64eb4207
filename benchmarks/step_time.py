"""Step time and memory of jaxaccum against full batch and its peers.

Usage::

  python benchmarks/step_time.py [--quick] [--out benchmarks/results]

For every model and every number of micro-batches ``k`` the script builds six
approaches that all compute the same optimizer update for the same effective
batch of ``B`` rows (see ``_approaches.py``): full batch, jaxaccum (with and
without its finite check, ``skip_nonfinite``), optax.microbatch,
optax.MultiSteps and a naive Python loop. It reports:

- the median wall time of one optimizer step (the whole effective batch plus
  one update), after compilation and warmup, each timing ended by
  ``jax.block_until_ready``. The approaches of a configuration are timed in
  interleaved rounds: round ``r`` times every approach once, in an order
  rotated by ``r``, so machine noise hits them alike. Judge ratios, not
  absolute times, on a shared machine;
- the compiled peak memory, ``argument + output + temp - alias`` from
  ``compiled.memory_analysis()`` (for MultiSteps and the naive loop the peak
  of their per-call functions; see ``_approaches.py``);
- a correctness check: the parameters after one step from the same
  initialization, compared with the full batch's;
- jaxaccum's memory bound: the full-batch step compiled at the micro-batch
  size, plus one float32 accumulator, plus the rest of the batch;
- the performance targets, PASS or MISS per configuration. Misses are
  reported; the script never fails on them.

Everything runs in one process on JAX's default backend. The results go to
``<out>/step_time[_quick].json`` and one PNG per model (time and peak memory
against ``k``). On an accelerator the ``gpu`` preset sizes the models up; use
``--dtype bfloat16`` for the transformer and ``--micro-batch-sizes`` to sweep
micro-batch sizes instead of ``k``, e.g. on an H200::

  python benchmarks/step_time.py --models transformer --dtype bfloat16 \
    --micro-batch-sizes 1,4,16,64 --rounds 7 --device-note "H200"

Compilation dominates the wall time (every approach compiles per ``k``), so
size the sweep to the time you have.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import gc
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

import _approaches
import _models
import _paths
import _report
import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import optax
from tqdm import tqdm

import jaxaccum

PyTree = Any

DEFAULT_KS = (1, 2, 4, 8, 16)
QUICK_KS = (1, 8)
MODEL_NAMES = ("dispatch_mlp", "compute_mlp", "transformer")

#: What the numbers in the JSON mean; stored with the results.
NOTES = {
  "median_ms": "median over interleaved rounds of the wall time per optimizer "
  "step (the whole effective batch plus one update), after compilation and "
  "warmup; each sample times repeats_per_sample back-to-back steps ended by "
  "jax.block_until_ready, divided by the repeats",
  "peak_bytes": "argument + output + temp - alias of compiled.memory_analysis(); "
  "full batch, jaxaccum, optax.microbatch: the whole step (batch included); "
  "optax.MultiSteps: its per-micro-batch call (one micro-batch, params, "
  "MultiSteps state); naive loop: max of its micro-batch grad call and its "
  "update call (resident_bytes adds the live accumulator and optimizer state)",
  "jaxaccum_memory_bound": "full-batch step compiled at B/k rows + float32 "
  "accumulator (params in f32) + input bytes of the other B - B/k rows",
  "correctness": "parameters after one step from the same init vs the full "
  "batch's; tolerance 1e-4 * max|update| + 4 ulp(max|param|)",
  "jaxpr_effects": "effects of the traced step; any effect disables the C++ "
  "dispatch fast path of jax.jit (a Python-path overhead on every call)",
  "micro_batches": "MultiSteps and the naive loop get their micro-batches "
  "pre-sliced (slicing is not timed)",
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  """The command line."""
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument(
    "--quick", action="store_true", help="fewer k, smaller models, fewer rounds"
  )
  parser.add_argument(
    "--out",
    type=pathlib.Path,
    help="output folder (default: benchmarks/results; quick: the temporary folder)",
  )
  parser.add_argument(
    "--models",
    default=",".join(MODEL_NAMES),
    help=f"comma-separated subset of {','.join(MODEL_NAMES)}",
  )
  sweep = parser.add_mutually_exclusive_group()
  sweep.add_argument(
    "--ks", help="comma-separated numbers of micro-batches (default 1,2,4,8,16)"
  )
  sweep.add_argument(
    "--micro-batch-sizes",
    help="comma-separated micro-batch sizes m, e.g. 1,2,4,8,16,32,64; "
    "k = B / m per model (sizes that do not divide B are skipped)",
  )
  parser.add_argument(
    "--preset",
    choices=("auto", "cpu", "gpu"),
    default="auto",
    help="model sizes; auto: cpu on the CPU backend, gpu otherwise",
  )
  parser.add_argument(
    "--dtype",
    choices=("float32", "bfloat16"),
    default="float32",
    help="parameter and compute dtype of the transformer",
  )
  parser.add_argument(
    "--optimizer",
    choices=("momentum", "adam"),
    default="momentum",
    help="momentum: optax.sgd(lr, momentum=0.9), whose first update is "
    "-lr * grad, so the correctness check compares gradients directly",
  )
  parser.add_argument("--lr", type=float, default=1e-2)
  parser.add_argument("--rounds", type=int, help="timing rounds (default 11, quick 7)")
  parser.add_argument(
    "--min-time-ms",
    type=float,
    help="repeat a step within one timing until it lasts this long "
    "(default 20, quick 10); the time per step is the average",
  )
  parser.add_argument(
    "--device-note", default="", help="free text stored with the results"
  )
  parser.add_argument("--no-plots", action="store_true")
  return parser.parse_args(argv)


def _ints(text: str) -> list[int]:
  return [int(part) for part in text.split(",") if part.strip()]


def resolve_ks(args: argparse.Namespace, batch_size: int) -> list[int]:
  """The numbers of micro-batches to sweep for a batch of ``batch_size``."""
  if args.micro_batch_sizes:
    ks = [batch_size // m for m in _ints(args.micro_batch_sizes) if batch_size % m == 0]
  else:
    ks = _ints(args.ks) if args.ks else list(QUICK_KS if args.quick else DEFAULT_KS)
    ks = [k for k in ks if batch_size % k == 0]
  return sorted(set(ks))


def make_optimizer(name: str, lr: float) -> optax.GradientTransformation:
  """The optimizer every approach uses."""
  if name == "adam":
    return optax.adam(lr)
  return optax.sgd(lr, momentum=0.9)


def _cpu_model() -> str:
  """The CPU's model name from ``/proc/cpuinfo`` (``platform.processor()``
  is often empty on Linux)."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return ""


def machine_info(args: argparse.Namespace) -> dict[str, Any]:
  """What ran the benchmark."""
  device = jax.devices()[0]
  try:
    affinity = len(os.sched_getaffinity(0))
  except AttributeError:  # not on Linux
    affinity = None
  return {
    "processor": platform.processor(),
    "cpu_model": _cpu_model(),
    "machine": platform.machine(),
    "platform": platform.platform(),
    "python": platform.python_version(),
    "cpu_count": os.cpu_count(),
    "cpu_affinity": affinity,
    "load_average_at_start": list(os.getloadavg()),
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "optax": optax.__version__,
    "jaxaccum": jaxaccum.__version__,
    "backend": jax.default_backend(),
    "device_kind": device.device_kind,
    "num_devices": jax.device_count(),
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "device_note": args.device_note,
    "argv": sys.argv[1:],
  }


# ---------------------------------------------------------------- correctness


def to_host(tree: PyTree) -> list[np.ndarray]:
  """The leaves of ``tree`` as float64 NumPy arrays (a copy off the device)."""
  return [
    np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in jax.tree.leaves(tree)
  ]


def compare_params(
  params: list[np.ndarray],
  reference: list[np.ndarray],
  initial: list[np.ndarray],
  eps: float,
) -> dict[str, Any]:
  """Compares one approach's parameters after a step with the full batch's.

  The tolerance is float rounding: ``1e-4`` of the largest update, plus four
  units in the last place of the largest parameter (``p - lr * g`` rounds to
  the parameter's precision, and the gradients are summed in another order).
  A wrong normalization (a sum instead of a mean, a missing micro-batch)
  moves the parameters by a sizeable fraction of the update and fails.
  """
  max_diff = max(
    float(np.max(np.abs(a - b))) for a, b in zip(params, reference, strict=True)
  )
  update = max(
    float(np.max(np.abs(b - c))) for b, c in zip(reference, initial, strict=True)
  )
  scale = max(float(np.max(np.abs(b))) for b in reference)
  tolerance = 1e-4 * update + 4 * eps * scale
  return {
    "max_abs_diff": max_diff,
    "max_abs_update": update,
    "diff_over_update": max_diff / update if update else None,
    "tolerance": tolerance,
    "pass": bool(max_diff <= tolerance),
  }


# ---------------------------------------------------------------- timing


def time_step(approach: _approaches.Approach, repeats: int) -> float:
  """Milliseconds per step over ``repeats`` back-to-back steps."""
  start = time.perf_counter()
  for _ in range(repeats):
    out = approach.step()
  jax.block_until_ready(out)
  return (time.perf_counter() - start) * 1e3 / repeats


def memory_bound(
  model: _models.Model, tx: optax.GradientTransformation, k: int
) -> dict[str, int]:
  """jaxaccum's memory bound for ``k`` micro-batches.

  The full-batch step compiled at the micro-batch size (``B / k`` rows: the
  parameters, the optimizer state and one micro-batch's activations), plus one
  float32 accumulator the size of the parameters, plus the input bytes of the
  other ``B - B / k`` rows of the batch.
  """
  batch_size = model.batch_size
  micro = batch_size // k
  micro_batch = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct((micro, *x.shape[1:]), x.dtype), model.batch
  )
  step = _approaches.full_batch_step(model.loss, tx)
  micro_step = _approaches.compiled_stats(
    step,
    _approaches.shape_of(model.params),
    _approaches.shape_of(tx.init(model.params)),
    micro_batch,
  )
  accumulator = _approaches.tree_bytes(model.params, jnp.float32)
  rest = _approaches.tree_bytes(model.batch) * (batch_size - micro) // batch_size
  return {
    "micro_step_peak_bytes": micro_step["peak_bytes"],
    "accumulator_bytes": accumulator,
    "rest_of_batch_bytes": rest,
    "bound_bytes": micro_step["peak_bytes"] + accumulator + rest,
  }


def run_config(
  *,
  model: _models.Model,
  tx: optax.GradientTransformation,
  k: int,
  rounds: int,
  min_time_ms: float,
  bar: tqdm,
) -> dict[str, Any]:
  """Compiles, checks and times every approach for one ``(model, k)``."""
  setup_start = time.perf_counter()
  approaches = [cls(model, tx, k) for cls in _approaches.APPROACHES]
  bar.set_postfix_str(f"{model.name} k={k}: compiling")
  # Compile everything once, in parallel threads (XLA compiles outside the
  # GIL); the jit caches then serve the timed calls.
  with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
    futures = {a.name: pool.submit(a.memory) for a in approaches}
    bound_future = pool.submit(memory_bound, model, tx, k)
    memory = {name: future.result() for name, future in futures.items()}
    bound = bound_future.result()

  # Correctness: one step from the same initial parameters.
  bar.set_postfix_str(f"{model.name} k={k}: checking")
  initial = to_host(model.params)
  eps = max(float(jnp.finfo(x.dtype).eps) for x in jax.tree.leaves(model.params))
  after_one_step, first_step_s = {}, {}
  for a in approaches:
    a.reset()
    start = time.perf_counter()
    jax.block_until_ready(a.step())
    first_step_s[a.name] = time.perf_counter() - start
    after_one_step[a.name] = to_host(a.params)
  reference = after_one_step[_approaches.FullBatch.name]
  correctness = {
    name: compare_params(params, reference, initial, eps)
    for name, params in after_one_step.items()
  }

  # Warmup, then choose how many steps one timing repeats.
  repeats = {}
  for a in approaches:
    jax.block_until_ready(a.step())
    once = time_step(a, 1)
    repeats[a.name] = max(1, min(1000, math.ceil(min_time_ms / max(once, 1e-3))))

  timing_start = time.perf_counter()
  samples: dict[str, list[float]] = {a.name: [] for a in approaches}
  for r in range(rounds):
    bar.set_postfix_str(f"{model.name} k={k}: round {r + 1}/{rounds}")
    shift = r % len(approaches)
    gc.collect()
    gc.disable()
    try:
      for a in approaches[shift:] + approaches[:shift]:
        samples[a.name].append(time_step(a, repeats[a.name]))
    finally:
      gc.enable()
    bar.update(1)

  end = time.perf_counter()
  full_ms = statistics.median(samples[_approaches.FullBatch.name])
  results = {}
  for a in approaches:
    median = statistics.median(samples[a.name])
    quartiles = (
      statistics.quantiles(samples[a.name], n=4) if rounds > 1 else [median] * 3
    )
    results[a.name] = {
      "label": a.label,
      "median_ms": median,
      "min_ms": min(samples[a.name]),
      "q1_ms": quartiles[0],
      "q3_ms": quartiles[2],
      "ratio_to_full": median / full_ms,
      "samples_ms": samples[a.name],
      "repeats_per_sample": repeats[a.name],
      "calls_per_step": a.calls_per_step(),
      "first_step_s": first_step_s[a.name],
      "memory": memory[a.name],
      "peak_bytes": memory[a.name]["peak_bytes"],
      "jaxpr_effects": memory[a.name]["effects"],
      "correctness": correctness[a.name],
    }
  jaxaccum_peak = results[_approaches.JaxAccum.name]["peak_bytes"]
  bound["jaxaccum_peak_over_bound"] = jaxaccum_peak / bound["bound_bytes"]
  return {
    "k": k,
    "micro_batch_size": model.batch_size // k,
    "setup_s": timing_start - setup_start,
    "timing_s": end - timing_start,
    "approaches": results,
    "jaxaccum_memory_bound": bound,
  }


# ---------------------------------------------------------------- targets


def evaluate_targets(model_name: str, config: dict[str, Any]) -> list[dict[str, Any]]:
  """The performance targets of one configuration; ``pass`` is None if n/a."""
  res = config["approaches"]
  ms = {name: r["median_ms"] for name, r in res.items()}
  acc_ms = ms[_approaches.JaxAccum.name]
  best_peer = min(_approaches.PEERS, key=lambda name: ms[name])
  targets = []

  def add(
    name: str, value: float, threshold: str, ok: bool | None, note: str = ""
  ) -> None:
    targets.append(
      {"target": name, "value": value, "threshold": threshold, "pass": ok, "note": note}
    )

  ratio = acc_ms / ms[best_peer]
  add(
    "time <= 1.05 x best peer",
    ratio,
    "<= 1.05",
    ratio <= 1.05,
    f"best peer: {res[best_peer]['label']}",
  )
  if model_name == "dispatch_mlp":
    speedup = ms[_approaches.OptaxMultiSteps.name] / acc_ms
    if config["k"] == 1:
      add("2x faster than MultiSteps", speedup, ">= 2", None, "k=1: one call each")
    else:
      add("2x faster than MultiSteps", speedup, ">= 2", speedup >= 2)
  if model_name == "compute_mlp":
    ratio = acc_ms / ms[_approaches.FullBatch.name]
    add("time <= 1.10 x full batch", ratio, "<= 1.10", ratio <= 1.10)
  over = config["jaxaccum_memory_bound"]["jaxaccum_peak_over_bound"]
  add("peak <= 1.05 x memory bound", over, "<= 1.05", over <= 1.05)
  peak = res[_approaches.JaxAccum.name]["peak_bytes"]
  micro_peak = res[_approaches.OptaxMicrobatch.name]["peak_bytes"]
  add(
    "peak < optax.microbatch peak",
    peak / micro_peak,
    "< 1",
    peak < micro_peak,
    f"{peak} vs {micro_peak} bytes",
  )
  return targets


# ---------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark; returns (and writes) the results."""
  args = parse_args(argv)
  warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
  backend = jax.default_backend()
  preset = (
    args.preset if args.preset != "auto" else ("cpu" if backend == "cpu" else "gpu")
  )
  if args.quick:
    preset += "-quick"
  rounds = args.rounds or (7 if args.quick else 11)
  min_time_ms = args.min_time_ms or (10.0 if args.quick else 20.0)
  tx = make_optimizer(args.optimizer, args.lr)
  names = [n.strip() for n in args.models.split(",") if n.strip()]
  unknown = set(names) - set(MODEL_NAMES)
  if unknown:
    raise SystemExit(f"Unknown models {sorted(unknown)}; choose from {MODEL_NAMES}.")

  info = machine_info(args)
  print(
    f"jaxaccum step-time benchmark: {info['backend']} ({info['device_kind']}), "
    f"{info['cpu_count']} CPUs, jax {info['jax']}, preset {preset}, "
    f"{rounds} rounds, optimizer {args.optimizer}"
  )
  models = [_models.build(name, preset, args.dtype) for name in names]
  sweeps = {m.name: resolve_ks(args, m.batch_size) for m in models}
  total = rounds * sum(len(ks) for ks in sweeps.values())

  results: dict[str, Any] = {
    "machine": info,
    "settings": {
      "preset": preset,
      "rounds": rounds,
      "min_time_ms": min_time_ms,
      "optimizer": args.optimizer,
      "lr": args.lr,
      "dtype": args.dtype,
    },
    "models": {},
    "notes": NOTES,
  }
  start = time.perf_counter()
  with tqdm(total=total, unit="round", dynamic_ncols=True, mininterval=1.0) as bar:
    for model in models:
      entry = {
        "title": model.title,
        "config": model.config.describe(),
        "batch_size": model.batch_size,
        "num_params": model.num_params,
        "param_bytes": _approaches.tree_bytes(model.params),
        "batch_bytes": _approaches.tree_bytes(model.batch),
        "configs": [],
      }
      for k in sweeps[model.name]:
        config = run_config(
          model=model, tx=tx, k=k, rounds=rounds, min_time_ms=min_time_ms, bar=bar
        )
        config["targets"] = evaluate_targets(model.name, config)
        entry["configs"].append(config)
        gc.collect()
      entry["wall_s"] = sum(c["setup_s"] + c["timing_s"] for c in entry["configs"])
      results["models"][model.name] = entry
  results["machine"]["load_average_at_end"] = list(os.getloadavg())
  results["wall_s"] = time.perf_counter() - start

  print(_report.tables(results))
  walls = ", ".join(f"{n} {e['wall_s']:.0f} s" for n, e in results["models"].items())
  print(f"\nwall time {results['wall_s']:.0f} s ({walls})")
  args.out = _paths.output_folder(args.out, args.quick)
  args.out.mkdir(parents=True, exist_ok=True)
  suffix = "_quick" if args.quick else ""
  path = args.out / f"step_time{suffix}.json"
  path.write_text(json.dumps(results, indent=1))
  print(f"\nwrote {path}")
  if not args.no_plots:
    for png in _report.plots(results, args.out, suffix):
      print(f"wrote {png}")
  return results


if __name__ == "__main__":
  main()
