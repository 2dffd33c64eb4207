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
  reported; the script never fails on them;
- an A/A control: the full batch timed a second time (``full_batch_again``)
  in the same rounds. Its median over the full batch's (``aa_ratio``) is the
  noise floor of every ratio of the configuration, and a time target counts
  as passed or missed only where it is within 3% of 1 (``decided``).

Everything runs in one process on JAX's default backend. The results go to
``<out>/step_time[_quick].json`` and one PNG per model (time and peak memory
against ``k``). On an accelerator the ``gpu`` preset sizes the models up; use
``--dtype bfloat16`` for the transformer and ``--micro-batch-sizes`` to sweep
micro-batch sizes instead of ``k``, e.g. on an H200::

  python benchmarks/step_time.py --models transformer --dtype bfloat16 \
    --micro-batch-sizes 1,4,16,64 --rounds 7 --device-note "H200"

On a CPU shared with other work, ``--cpus 0-3`` keeps the run (and XLA's
threads) on those cores, and more ``--rounds`` and a longer
``--min-time-ms`` narrow the spread.

``--approaches`` times only the approaches it names besides the full batch,
its A/A control and jaxaccum (``hand_scan``, a ``lax.scan`` written without
jaxaccum, runs only when named), and ``--dispatch-widths`` gives the
dispatch-bound MLP other layer widths; either makes a run of its own, which
needs ``--out``. Issue 46's dispatch-bound configuration::

  python benchmarks/step_time.py --models dispatch_mlp --ks 16 \
    --dispatch-widths 256,256,256,10 \
    --approaches jaxaccum_no_skip,optax_microbatch,hand_scan --out /tmp/st

(``dispatch_step.py`` runs it at two checkouts and prints the ratios.)

Compilation dominates the wall time (every approach compiles per ``k``), so
size the sweep to the time you have.
"""

# The manual's blocks below use its typography: multiplication signs, en
# dashes, minus signs.
# ruff: noqa: RUF001

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
from collections.abc import Callable, Sequence
from typing import Any

import _approaches
import _models
import _paths
import _timing
import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import optax
from _report import (
  AA_TOLERANCE,
  aa_decides,
  aa_note,
  bullet_list,
  by_k,
  capital,
  command_line,
  date,
  duration,
  format_bytes,
  ks_text,
  listing,
  ms,
  ratio,
  span,
  table,
)
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
  "aa_ratio": "the A/A control: full_batch_again (the full batch's step, timed "
  "a second time in the same interleaved rounds) over full_batch, median over "
  "median; a time target is decided (met or missed) only where it is within "
  "0.03 of 1",
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
  parser.add_argument(
    "--approaches",
    help="comma-separated approaches to time besides the full batch, its "
    f"A/A control and jaxaccum, of {','.join(APPROACH_NAMES)} (default: all "
    f"but {','.join(a.name for a in _approaches.OPTIONAL)})",
  )
  parser.add_argument(
    "--dispatch-widths",
    help="the dispatch-bound MLP's layer widths, input first and classes "
    "last, in place of the preset's, e.g. 256,256,256,10",
  )
  parser.add_argument("--rounds", type=int, help="timing rounds (default 11, quick 7)")
  parser.add_argument(
    "--min-time-ms",
    type=float,
    help="repeat a step within one timing until it lasts this long "
    "(default 20, quick 10); the time per step is the average",
  )
  _timing.add_cpus_argument(parser)
  parser.add_argument(
    "--device-note", default="", help="free text stored with the results"
  )
  parser.add_argument("--no-plots", action="store_true")
  args = parser.parse_args(argv)
  names = [n.strip() for n in (args.approaches or "").split(",") if n.strip()]
  unknown = sorted(set(names) - set(APPROACH_NAMES))
  if unknown:
    parser.error(f"unknown approaches {unknown}; choose from {APPROACH_NAMES}")
  if (args.approaches or args.dispatch_widths) and args.out is None and not args.quick:
    parser.error(
      "--approaches and --dispatch-widths make a run of their own: pass --out, "
      "so that benchmarks/results/step_time.json keeps the whole one"
    )
  return args


#: Every approach a run can time, by name (the full batch always runs).
APPROACH_NAMES = tuple(a.name for a in (*_approaches.APPROACHES, *_approaches.OPTIONAL))


def timed_approaches(names: str | None) -> tuple[type[_approaches.Approach], ...]:
  """The approaches a configuration times: the full batch and jaxaccum, the
  others named (default: every one of ``_approaches.APPROACHES``) and the
  A/A control last."""
  if not names:
    return TIMED
  chosen = {n.strip() for n in names.split(",")}
  chosen |= {_approaches.FullBatch.name, _approaches.JaxAccum.name}
  every = (*_approaches.APPROACHES, *_approaches.OPTIONAL)
  return (*(a for a in every if a.name in chosen), FullBatchAgain)


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


def machine_info(args: argparse.Namespace, cpus: list[int] | None) -> dict[str, Any]:
  """What ran the benchmark (``cpus``: the CPUs it ran on)."""
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
    "cpus": cpus,
    "pinned": bool(args.cpus),
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


class FullBatchAgain(_approaches.FullBatch):
  """The full batch's step, timed a second time in the same rounds: the A/A
  control. Its median over the full batch's is the noise floor of every
  ratio of its configuration."""

  name, label = "full_batch_again", "full batch again"


#: Every approach a configuration times, the A/A control last.
TIMED = (*_approaches.APPROACHES, FullBatchAgain)
#: The targets that compare times: decided only where the A/A ratio is
#: within ``_report.AA_TOLERANCE`` of 1.
TIMED_TARGETS = (
  "time <= 1.05 x best peer",
  "2x faster than MultiSteps",
  "time <= 1.10 x full batch",
)


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
  timed: Sequence[type[_approaches.Approach]] = (),
) -> dict[str, Any]:
  """Compiles, checks and times every approach of ``timed`` (default
  ``TIMED``) for one ``(model, k)``."""
  setup_start = time.perf_counter()
  approaches = [cls(model, tx, k) for cls in (timed or TIMED)]
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

  # One untimed round first: the first sample after the warmup ran slow
  # (the A/A control showed it, on the approach timed first).
  for a in approaches:
    time_step(a, repeats[a.name])

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
    "aa_ratio": results[FullBatchAgain.name]["ratio_to_full"],
    "jaxaccum_memory_bound": bound,
  }


# ---------------------------------------------------------------- targets


def evaluate_targets(model_name: str, config: dict[str, Any]) -> list[dict[str, Any]]:
  """The performance targets of one configuration; ``pass`` is None if n/a.
  A time target also says whether the A/A control decides it (``decided``):
  its ``pass`` counts only then."""
  res = config["approaches"]
  ms = {name: r["median_ms"] for name, r in res.items()}
  acc_ms = ms[_approaches.JaxAccum.name]
  peers = [
    name
    for name in (*_approaches.PEERS, *(a.name for a in _approaches.OPTIONAL))
    if name in ms
  ]
  targets = []

  def add(
    name: str, value: float, threshold: str, ok: bool | None, note: str = ""
  ) -> None:
    targets.append(
      {"target": name, "value": value, "threshold": threshold, "pass": ok, "note": note}
    )
    if name in TIMED_TARGETS:
      targets[-1]["decided"] = aa_decides(config["aa_ratio"])

  if peers:
    best_peer = min(peers, key=lambda name: ms[name])
    ratio = acc_ms / ms[best_peer]
    add(
      "time <= 1.05 x best peer",
      ratio,
      "<= 1.05",
      ratio <= 1.05,
      f"best peer: {res[best_peer]['label']}",
    )
  if model_name == "dispatch_mlp" and _approaches.OptaxMultiSteps.name in ms:
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
  if _approaches.OptaxMicrobatch.name not in res:
    return targets
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


# ---------------------------------------------------------------- the report:
# the text tables the script prints, and its plots


def _mark(ok: bool | None) -> str:
  return "n/a" if ok is None else ("PASS" if ok else "MISS")


def undecided(t: dict[str, Any], config: dict[str, Any]) -> bool:
  """Whether target ``t`` compares times that the configuration's A/A
  control leaves undecided (or that its run had no A/A control)."""
  return t["target"] in TIMED_TARGETS and not aa_decides(config.get("aa_ratio"))


def _fast_path(effects: list[str]) -> str:
  """``yes``, or ``no`` and the effects that rule out jit's C++ fast path."""
  return "no: " + ",".join(sorted(set(effects))) if effects else "yes"


def model_table(name: str, entry: dict[str, Any]) -> str:
  """One model's rows: time, ratio, memory and correctness per ``k``."""
  lines = [
    "",
    f"{entry['title']} [{name}]: B={entry['batch_size']}, "
    f"{entry['num_params']:,} params ({format_bytes(entry['param_bytes'])}), "
    f"batch {format_bytes(entry['batch_bytes'])}",
    f"{'k':>4} {'m':>5}  {'approach':<17} {'ms/step':>9} {'x full':>7} {'calls':>6} "
    f"{'peak':>11} {'x full':>7}  {'max|dp|':>9} {'check':>5}  fast path",
  ]
  for config in entry["configs"]:
    res = config["approaches"]
    full_peak = res["full_batch"]["peak_bytes"]
    for i, r in enumerate(res.values()):
      head = f"{config['k']:>4} {config['micro_batch_size']:>5}" if i == 0 else " " * 10
      check = r["correctness"]
      lines.append(
        f"{head}  {r['label']:<17} {r['median_ms']:>9.3f} {r['ratio_to_full']:>7.2f} "
        f"{r['calls_per_step']:>6} {format_bytes(r['peak_bytes']):>11} "
        f"{r['peak_bytes'] / full_peak:>7.2f}  {check['max_abs_diff']:>9.2e} "
        f"{_mark(check['pass']):>5}  {_fast_path(r['jaxpr_effects'])}"
      )
    bound = config["jaxaccum_memory_bound"]
    lines.append(
      f"{'':10}  jaxaccum bound {format_bytes(bound['bound_bytes'])} = micro-batch "
      f"step {format_bytes(bound['micro_step_peak_bytes'])} + f32 accumulator "
      f"{format_bytes(bound['accumulator_bytes'])} + rest of batch "
      f"{format_bytes(bound['rest_of_batch_bytes'])}; peak/bound "
      f"{bound['jaxaccum_peak_over_bound']:.3f}"
    )
    lines.append(
      f"{'':10}  noise floor: {aa_note(config.get('aa_ratio'))} (full batch again "
      "/ full batch; a time target is decided within 0.03 of 1)"
    )
    for t in config["targets"]:
      note = f" ({t['note']})" if t["note"] else ""
      mark = "UNDEC" if undecided(t, config) else _mark(t["pass"])
      lines.append(
        f"{'':10}  target {t['target']:<30} {t['value']:>7.3f} {t['threshold']:<7} "
        f"{mark}{note}"
      )
  return "\n".join(lines)


def summary(results: dict[str, Any]) -> str:
  """PASS/MISS/undecided counts per target, over all configurations."""
  counts: dict[str, list[int]] = {}
  misses: list[str] = []
  for name, entry in results["models"].items():
    for config in entry["configs"]:
      for t in config["targets"]:
        if t["pass"] is None:
          continue
        row = counts.setdefault(t["target"], [0, 0, 0])
        if undecided(t, config):
          row[2] += 1
          continue
        row[0 if t["pass"] else 1] += 1
        if not t["pass"]:
          misses.append(
            f"  MISS {name} k={config['k']}: {t['target']} = {t['value']:.3f}"
          )
  lines = ["", "targets (pass / miss / undecided over configurations):"]
  lines += [
    f"  {target:<32} {p:>3} / {m:<3} / {u:<3}" for target, (p, m, u) in counts.items()
  ]
  return "\n".join(lines + misses)


def tables(results: dict[str, Any]) -> str:
  """Every model's table and the target summary."""
  parts = [model_table(name, entry) for name, entry in results["models"].items()]
  return "\n".join([*parts, summary(results)])


def plots(
  results: dict[str, Any], out: pathlib.Path, suffix: str = ""
) -> list[pathlib.Path]:
  """One PNG per model: ms/step and peak bytes against ``k``, a line per approach."""
  import matplotlib  # noqa: PLC0415  (the manual's generator needs no plotting)

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  paths = []
  machine = results["machine"]
  for name, entry in results["models"].items():
    configs = entry["configs"]
    if not configs:
      continue
    ks = [c["k"] for c in configs]
    labels = {key: r["label"] for key, r in configs[0]["approaches"].items()}
    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, label in labels.items():
      ax_time.plot(
        ks, [c["approaches"][key]["median_ms"] for c in configs], "o-", label=label
      )
      ax_mem.plot(
        ks,
        [c["approaches"][key]["peak_bytes"] / 2**20 for c in configs],
        "o-",
        label=label,
      )
    ax_mem.plot(
      ks,
      [c["jaxaccum_memory_bound"]["bound_bytes"] / 2**20 for c in configs],
      "k--",
      label="jaxaccum bound",
    )
    for ax, ylabel in (
      (ax_time, "median ms / optimizer step"),
      (ax_mem, "XLA peak MiB"),
    ):
      ax.set_xscale("log", base=2)
      ax.set_yscale("log")
      ax.set_xticks(ks, [str(k) for k in ks])
      ax.set_xlabel(f"micro-batches k (B = {entry['batch_size']})")
      ax.set_ylabel(ylabel)
      ax.grid(True, which="both", alpha=0.3)
    ax_time.legend(fontsize=8)
    ax_mem.legend(fontsize=8)
    fig.suptitle(
      f"{entry['title']}: {entry['num_params']:,} params; {machine['backend']} "
      f"({machine['device_kind']}), {machine['date']}",
      fontsize=10,
    )
    fig.tight_layout()
    path = out / f"step_time_{name}{suffix}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
  return paths


# ---------------------------------------------------------------- the manual's blocks

STEP_TIME_COLUMNS = (
  "full_batch",
  "jaxaccum",
  "jaxaccum_no_skip",
  "optax_microbatch",
  "optax_multisteps",
  "naive_loop",
)
STEP_TIME_PEERS = ("optax_microbatch", "optax_multisteps", "naive_loop")
BOUND_TARGET = 1.05  # step_time.py's target: jaxaccum's peak <= 1.05 x its bound
PROSE_NAMES = {
  "dispatch_mlp": "the dispatch-bound MLP",
  "compute_mlp": "the compute-bound MLP",
  "transformer": "the transformer",
}


def _step_time_configs(results: dict[str, Any], model: str) -> list[dict[str, Any]]:
  entry = results["models"].get(model)
  return entry["configs"] if entry else []


def step_time_machine(results: dict[str, Any]) -> str:
  m, s = results["machine"], results["settings"]
  cores = f"{m['cpu_count']} cores"
  if m.get("pinned"):
    cores += f", pinned to CPUs {','.join(map(str, m['cpus']))}"
  elif m.get("cpu_affinity") not in (None, m["cpu_count"]):
    cores += f", {m['cpu_affinity']} usable"
  note = f" ({m['device_note']})" if m.get("device_note") else ""
  start, end = m["load_average_at_start"][0], m["load_average_at_end"][0]
  return (
    f"Measured on {date(m['date'])} with "
    f"`{command_line('python benchmarks/step_time.py', m.get('argv'))}`: "
    f"{m['cpu_model'] or m['machine']} ({cores}), {m['backend'].upper()} backend "
    f"({m['num_devices']} device){note}, jax {m['jax']}, optax {m['optax']}, "
    f"jaxaccum {m['jaxaccum']}; preset `{s['preset']}`, {s['rounds']} interleaved "
    f"rounds, samples of at least {s['min_time_ms']:g} ms, "
    f"`{s['optimizer']}` (learning rate {s['lr']:g}), {s['dtype']}. The "
    f"one-minute load average was {start:.1f} at the start and {end:.1f} at "
    f"the end; the run took {duration(results['wall_s'])}."
  )


def _step_time_table(results: dict[str, Any], model: str) -> str:
  entry = results["models"].get(model)
  if entry is None:
    return f"_`{model}` was not part of this run._"
  configs = entry["configs"]
  labels = {key: configs[0]["approaches"][key]["label"] for key in STEP_TIME_COLUMNS}
  head = (
    f"**{entry['title']}**, batch {entry['batch_size']:,} rows "
    f"({format_bytes(entry['batch_bytes'])}), {entry['num_params']:,} parameters "
    f"({format_bytes(entry['param_bytes'])}): median ms per step (× full batch), "
    "jaxaccum's peak memory against the full batch's, its bound's and "
    "optax.microbatch's, and the approaches whose parameters after one step "
    "equal the full batch's"
  )
  has_aa = any("aa_ratio" in c for c in configs)
  if has_aa:
    head += (
      "; A/A: the full batch timed twice in the same rounds, its second median "
      "over its first (the noise floor of the row's ratios; its time targets "
      f"count where it is within {AA_TOLERANCE:.0%} of 1)"
    )
  rows = []
  for c in configs:
    res = c["approaches"]
    full = res["full_batch"]
    cells = [ms(full["median_ms"])]
    cells += [
      f"{ms(res[key]['median_ms'])} ({ratio(res[key]['ratio_to_full'])})"
      for key in STEP_TIME_COLUMNS[1:]
    ]
    peak = res["jaxaccum"]["peak_bytes"]
    correct = sum(res[key]["correctness"]["pass"] for key in STEP_TIME_COLUMNS)
    rows.append(
      [
        c["k"],
        *cells,
        *([ratio(c.get("aa_ratio"))] if has_aa else []),
        ratio(peak / full["peak_bytes"]),
        ratio(c["jaxaccum_memory_bound"]["jaxaccum_peak_over_bound"]),
        ratio(peak / res["optax_microbatch"]["peak_bytes"]),
        f"{correct} / {len(STEP_TIME_COLUMNS)}",
      ]
    )
  header = [
    "k",
    *(labels[key] for key in STEP_TIME_COLUMNS),
    *(["A/A"] if has_aa else []),
    "jaxaccum peak / full",
    "/ bound",
    "/ microbatch",
    "correct",
  ]
  text = head + "\n\n" + table(header, rows)
  if not has_aa:
    text += f"\n\n_{capital(aa_note(None))}: its time targets are undecided._"
  return text


def step_time_dispatch_mlp(results: dict[str, Any]) -> str:
  return _step_time_table(results, "dispatch_mlp")


def step_time_compute_mlp(results: dict[str, Any]) -> str:
  return _step_time_table(results, "compute_mlp")


def step_time_transformer(results: dict[str, Any]) -> str:
  return _step_time_table(results, "transformer")


def step_time_targets(results: dict[str, Any]) -> str:
  counts: dict[str, list[int]] = {}
  misses: dict[str, list[str]] = {}
  for name, entry in results["models"].items():
    for c in entry["configs"]:
      for t in c["targets"]:
        if t["pass"] is None:
          continue
        row = counts.setdefault(t["target"], [0, 0, 0])
        if undecided(t, c):
          row[2] += 1
          continue
        row[0 if t["pass"] else 1] += 1
        if not t["pass"]:
          misses.setdefault(t["target"], []).append(
            f"{name} k={c['k']}: {t['value']:.2f}"
          )
  rows = [
    [f"`{target}`", p, m, u, "; ".join(misses.get(target, [])) or "–"]
    for target, (p, m, u) in counts.items()
  ]
  head = (
    "Over every configuration; a time target counts as passed or missed only "
    f"where the configuration's A/A ratio is within {AA_TOLERANCE:.0%} of 1."
    if _has_aa(results)
    else f"Over every configuration. {capital(aa_note(None))}: its time "
    "targets are undecided."
  )
  return (
    head
    + "\n\n"
    + table(["target", "pass", "miss", "undecided", "misses (value)"], rows)
  )


def _has_aa(results: dict[str, Any]) -> bool:
  return any(
    "aa_ratio" in c for entry in results["models"].values() for c in entry["configs"]
  )


def _ratios(
  configs: list[dict[str, Any]], num: str, den: str | Sequence[str], ks_from: int = 1
) -> dict[int, float]:
  """``k -> num's median over den's`` (or over the fastest of ``den``)."""
  out = {}
  for c in configs:
    if c["k"] < ks_from:
      continue
    res = c["approaches"]
    dens = (den,) if isinstance(den, str) else den
    out[c["k"]] = res[num]["median_ms"] / min(res[d]["median_ms"] for d in dens)
  return out


def step_time_summary(results: dict[str, Any]) -> str:
  models = {n: _step_time_configs(results, n) for n in PROSE_NAMES}
  models = {n: c for n, c in models.items() if c}
  return bullet_list(
    text
    for text in (
      _step_time_memory(models),
      _step_time_noise(models),
      _step_time_check(models),
      _step_time_dispatch(models),
      _step_time_speed(models),
      _step_time_correctness(models),
    )
    if text
  )


def _step_time_memory(models: dict[str, list[dict[str, Any]]]) -> str:
  vs_micro, vs_full_last, bound_rows, k1 = [], {}, [], []
  for name, configs in models.items():
    for c in configs:
      res = c["approaches"]
      peak = res["jaxaccum"]["peak_bytes"]
      over = c["jaxaccum_memory_bound"]["jaxaccum_peak_over_bound"]
      bound_rows.append((name, c["k"], over))
      if c["k"] >= 2:
        vs_micro.append(peak / res["optax_microbatch"]["peak_bytes"])
      if c["k"] == 1:
        k1.append(peak / res["jaxaccum_no_skip"]["peak_bytes"])
    last = configs[-1]["approaches"]
    vs_full_last[name] = (
      configs[-1]["k"],
      last["jaxaccum"]["peak_bytes"] / last["full_batch"]["peak_bytes"],
    )
  text = "**Memory.** "
  if vs_micro:
    below = sum(r < 1 for r in vs_micro)
    text += (
      f"From k = 2 on, jaxaccum's peak is below optax.microbatch's in {below} "
      f"of {len(vs_micro)} rows (jaxaccum's over microbatch's: {span(vs_micro)}). "
    )
  text += (
    "At the largest k its peak over the full batch's is "
    + listing(
      [
        f"{ratio(r)} for {PROSE_NAMES[n]} (k = {k})"
        for n, (k, r) in vs_full_last.items()
      ]
    )
    + ". "
  )
  above = [r for r in bound_rows if r[2] > BOUND_TARGET]
  text += (
    f"Its peak over the memory bound is at most {BOUND_TARGET:.2f} in "
    f"{len(bound_rows) - len(above)} of {len(bound_rows)} rows"
  )
  if above:
    text += "; above it: " + listing(
      [f"{PROSE_NAMES[n]} at k = {k} ({ratio(r)})" for n, k, r in above]
    )
  text += "."
  if k1:
    text += (
      " At k = 1 its peak with the finite check over its peak without it is "
      f"{span(k1)}."
    )
  return text


def _step_time_noise(models: dict[str, list[dict[str, Any]]]) -> str:
  """The A/A control: the noise floor of every ratio below."""
  aas = {n: [c["aa_ratio"] for c in cs if "aa_ratio" in c] for n, cs in models.items()}
  if not any(aas.values()):
    return (
      f"**Noise floor.** {capital(aa_note(None))} (the full batch timed "
      "twice in the same rounds), so the time targets below are undecided."
    )
  decided = sum(aa_decides(a) for v in aas.values() for a in v)
  return (
    "**Noise floor.** The full batch timed twice in the same rounds, its "
    "second median over its first (A/A): "
    + listing([f"{span(v)} on {PROSE_NAMES[n]}" for n, v in aas.items() if v])
    + f". Within {AA_TOLERANCE:.0%} of 1, where a time target counts as met "
    f"or missed, in {decided} of {sum(map(len, aas.values()))} configurations."
  )


def _goal(
  values: dict[int, float], ok: Callable[[float], bool], configs: list[dict[str, Any]]
) -> str:
  """``met at k = 2 and 4, missed at k = 8 and undecided at k = 16 (A/A
  1.07)``: a time target per k, decided where the A/A control decides."""
  aa = {c["k"]: c.get("aa_ratio") for c in configs}
  met = [k for k, v in values.items() if aa_decides(aa[k]) and ok(v)]
  missed = [k for k, v in values.items() if aa_decides(aa[k]) and not ok(v)]
  open_ = [k for k in values if not aa_decides(aa[k])]
  parts = [f"met at {ks_text(met)}"] if met else []
  parts += [f"missed at {ks_text(missed)}"] if missed else []
  if open_ and all(aa[k] is None for k in open_):
    parts.append(f"undecided at {ks_text(open_)}, with {aa_note(None)}")
  elif open_:
    parts.append(
      "undecided at " + listing([f"k = {k} ({aa_note(aa[k])})" for k in open_])
    )
  return listing(parts)


def _step_time_check(models: dict[str, list[dict[str, Any]]]) -> str:
  parts = [
    f"{span(_ratios(c, 'jaxaccum', 'jaxaccum_no_skip').values())} on {PROSE_NAMES[n]}"
    for n, c in models.items()
  ]
  text = (
    "**The finite check.** `make_train_step` checks that the loss and every "
    "gradient are finite and otherwise drops the update, which none of the "
    "peers does. jaxaccum's time with the check over its time without it "
    f"(`skip_nonfinite=False`) is {listing(parts)}."
  )
  if "dispatch_mlp" in models:
    configs = models["dispatch_mlp"]
    cost_us = statistics.median(
      1e3
      * (
        c["approaches"]["jaxaccum"]["median_ms"]
        - c["approaches"]["jaxaccum_no_skip"]["median_ms"]
      )
      for c in configs
    )
    with_check = _ratios(configs, "jaxaccum", STEP_TIME_PEERS)
    without = _ratios(configs, "jaxaccum_no_skip", STEP_TIME_PEERS)
    text += (
      " On the dispatch-bound MLP, whose full-batch step takes "
      f"{ms(configs[0]['approaches']['full_batch']['median_ms'])} ms, the check "
      f"costs {cost_us:.0f} µs per step (median over k), and jaxaccum's time "
      f"over the best peer's is {span(with_check.values())} with it, "
      f"{span(without.values())} without it."
    )
  return text


def _step_time_dispatch(models: dict[str, list[dict[str, Any]]]) -> str:
  configs = models.get("dispatch_mlp", [])
  with_check = {
    k: 1 / r for k, r in _ratios(configs, "jaxaccum", "optax_multisteps", 2).items()
  }
  without = {
    k: 1 / r
    for k, r in _ratios(configs, "jaxaccum_no_skip", "optax_multisteps", 2).items()
  }
  if not with_check:
    return ""
  return (
    "**Dispatch.** jaxaccum makes one call per step where optax.MultiSteps "
    "makes `k`. On the dispatch-bound MLP MultiSteps' time over jaxaccum's is "
    f"{by_k(with_check)} with the check "
    f"({listing([ratio(v) for v in without.values()])} without it). The "
    f"target, at least 2, is {_goal(with_check, lambda r: r >= 2, configs)}."
  )


def _step_time_speed(models: dict[str, list[dict[str, Any]]]) -> str:
  text = "**Speed.**"
  if "compute_mlp" in models:
    configs = models["compute_mlp"]
    vs_full = _ratios(configs, "jaxaccum", "full_batch")
    vs_peer = _ratios(configs, "jaxaccum", STEP_TIME_PEERS, 2)
    text += (
      " On the compute-bound MLP jaxaccum's time over the full batch's is "
      f"{by_k(vs_full)}"
    )
    if vs_peer:
      text += f", and over the best peer's {span(vs_peer.values())} from k = 2 on"
    text += (
      f". The target there, at most 1.10 × the full batch, is "
      f"{_goal(vs_full, lambda r: r <= 1.10, configs)}."
    )
  if "transformer" in models:
    configs = models["transformer"]
    vs_micro = _ratios(configs, "jaxaccum", "optax_microbatch")
    vs_full = _ratios(configs, "jaxaccum", "full_batch")
    text += (
      " On the transformer its time over optax.microbatch's is "
      f"{span(vs_micro.values())}, and over the full batch's {by_k(vs_full)}."
    )
  return text if text != "**Speed.**" else ""


def _step_time_correctness(models: dict[str, list[dict[str, Any]]]) -> str:
  checks = [
    c["approaches"][key]["correctness"]["pass"]
    for configs in models.values()
    for c in configs
    for key in STEP_TIME_COLUMNS
  ]
  return (
    f"**Correctness.** In {sum(checks)} of {len(checks)} (approach, k) pairs "
    "the parameters after one step equal the full batch's within float rounding."
  )


#: The generated blocks this file writes from ``step_time.json``, by name
#: (``_report.py`` puts each on its page).
BLOCKS = {
  "step_time machine": step_time_machine,
  "step_time dispatch_mlp": step_time_dispatch_mlp,
  "step_time compute_mlp": step_time_compute_mlp,
  "step_time transformer": step_time_transformer,
  "step_time targets": step_time_targets,
  "step_time summary": step_time_summary,
}


# ---------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark; returns (and writes) the results."""
  args = parse_args(argv)
  cpus = _timing.pin(args.cpus)  # before JAX starts its threads
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

  info = machine_info(args, cpus)
  print(
    f"jaxaccum step-time benchmark: {info['backend']} ({info['device_kind']}), "
    f"{info['cpu_count']} CPUs, jax {info['jax']}, preset {preset}, "
    f"{rounds} rounds, optimizer {args.optimizer}"
  )
  widths = tuple(_ints(args.dispatch_widths)) if args.dispatch_widths else None
  models = [
    _models.build(name, preset, args.dtype, widths if name == "dispatch_mlp" else None)
    for name in names
  ]
  timed = timed_approaches(args.approaches)
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
      "approaches": [a.name for a in timed],
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
          model=model,
          tx=tx,
          k=k,
          rounds=rounds,
          min_time_ms=min_time_ms,
          bar=bar,
          timed=timed,
        )
        config["targets"] = evaluate_targets(model.name, config)
        entry["configs"].append(config)
        gc.collect()
      entry["wall_s"] = sum(c["setup_s"] + c["timing_s"] for c in entry["configs"])
      results["models"][model.name] = entry
  results["machine"]["load_average_at_end"] = list(os.getloadavg())
  results["wall_s"] = time.perf_counter() - start

  print(tables(results))
  walls = ", ".join(f"{n} {e['wall_s']:.0f} s" for n, e in results["models"].items())
  print(f"\nwall time {results['wall_s']:.0f} s ({walls})")
  args.out = _paths.output_folder(args.out, args.quick)
  args.out.mkdir(parents=True, exist_ok=True)
  suffix = "_quick" if args.quick else ""
  path = args.out / f"step_time{suffix}.json"
  path.write_text(json.dumps(results, indent=1))
  print(f"\nwrote {path}")
  if not args.no_plots:
    for png in plots(results, args.out, suffix):
      print(f"wrote {png}")
  return results


if __name__ == "__main__":
  main()
