"""Step time and memory of jaxaccum against full batch and its peers.

Per model (``_models.py``) and ``k``, :func:`run_config` times, compiles and
checks the approaches of ``_approaches.py`` and the A/A control;
:func:`evaluate_targets` holds them to the targets. ``NOTES`` says what the
JSON's numbers mean. Outputs ``step_time[_quick].json`` and a PNG per model
in ``--out``; ``--cpus``, ``--rounds`` and ``--min-time-ms`` steady a run on
a shared machine.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import functools
import gc
import json
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
import _timing
import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import optax
from _report import (
  aa_decides,
  command_line,
  cpu_model,
  date,
  format_bytes,
  k_axis,
  ms,
  pyplot,
  ratio,
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
  "step (the whole batch, one update), after compilation and warmup; a sample "
  "is repeats_per_sample steps ended by jax.block_until_ready",
  "peak_bytes": "argument + output + temp - alias of the compiled step (the "
  "batch included); MultiSteps: its per-micro-batch call; naive loop: the "
  "larger of its grad and update calls (resident_bytes adds what stays alive)",
  "jaxaccum_memory_bound": "full-batch step compiled at B/k rows + float32 "
  "accumulator + input bytes of the other B - B/k rows",
  "correctness": "parameters after one step from the same init vs the full "
  "batch's; tolerance 1e-4 * max|update| + 4 ulp(max|param|)",
  "jaxpr_effects": "effects of the traced step; any effect disables jax.jit's "
  "C++ dispatch fast path",
  "micro_batches": "MultiSteps and the naive loop get their micro-batches "
  "pre-sliced (slicing is not timed)",
  "aa_ratio": "full_batch_again (the full batch timed again in the same rounds) "
  "over full_batch; a time target is decided only within 0.03 of 1",
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  """The command line."""
  parser = _paths.parser(
    __doc__,
    quick="fewer k, smaller models, fewer rounds",
    rounds="timing rounds (default 11, quick 7)",
    cpus=True,
  )
  parser.add_argument(
    "--models",
    default=",".join(MODEL_NAMES),
    help=f"comma-separated subset of {','.join(MODEL_NAMES)}",
  )
  sweep = parser.add_mutually_exclusive_group()
  sweep.add_argument(
    "--ks",
    type=_paths.ints,
    help="comma-separated numbers of micro-batches (default 1,2,4,8,16)",
  )
  sweep.add_argument(
    "--micro-batch-sizes",
    type=_paths.ints,
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


def resolve_ks(args: argparse.Namespace, batch_size: int) -> list[int]:
  """The numbers of micro-batches to sweep for a batch of ``batch_size``."""
  if args.micro_batch_sizes:
    ks = [batch_size // m for m in args.micro_batch_sizes if batch_size % m == 0]
  else:
    ks = args.ks or list(QUICK_KS if args.quick else DEFAULT_KS)
    ks = [k for k in ks if batch_size % k == 0]
  return sorted(set(ks))


def machine_info(args: argparse.Namespace, cpus: list[int] | None) -> dict[str, Any]:
  """What ran the benchmark (``cpus``: the CPUs it ran on)."""
  device = jax.devices()[0]
  try:
    affinity = len(os.sched_getaffinity(0))
  except AttributeError:  # not on Linux
    affinity = None
  return {
    "processor": platform.processor(),
    "cpu_model": cpu_model(),
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
  """One approach's parameters after a step against the full batch's, within
  float rounding: ``1e-4`` of the largest update plus four ulps of the
  largest parameter. A wrong normalization moves them by a sizeable part of
  the update."""
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


def memory_bound(
  model: _models.Model, tx: optax.GradientTransformation, k: int
) -> dict[str, int]:
  """jaxaccum's memory bound for ``k`` micro-batches: the full-batch step
  compiled at ``B / k`` rows, plus one float32 accumulator the size of the
  parameters, plus the other ``B - B / k`` rows of the batch."""
  micro_batch, accumulator, rest = _approaches.bound_terms(model.params, model.batch, k)
  step = _approaches.full_batch_step(model.loss, tx)
  micro_step = _approaches.compiled_stats(
    step,
    _approaches.shape_of(model.params),
    _approaches.shape_of(tx.init(model.params)),
    micro_batch,
  )
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
  approaches = [cls(model, tx, k) for cls in TIMED]
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

  started: dict[str, float] = {}

  def progress(r: int) -> None:
    bar.set_postfix_str(f"{model.name} k={k}: round {r + 1}/{rounds}")
    bar.update(1)

  samples, repeats = _timing.interleaved(
    {a.name: a.step for a in approaches},
    rounds=rounds,
    min_sample_ms=min_time_ms,
    max_repeats=1000,
    after_round=progress,
    started=started,
  )
  timing_start, end = started["timing"], time.perf_counter()
  full_ms = statistics.median(samples[_approaches.FullBatch.name])
  results = {}
  for a in approaches:
    stats = _timing.quartiles(samples[a.name])
    results[a.name] = {
      "label": a.label,
      **stats,
      "ratio_to_full": stats["median_ms"] / full_ms,
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
  best_peer = min(_approaches.PEERS, key=lambda name: ms[name])
  targets = []

  def add(
    name: str, value: float, threshold: str, ok: bool | None, note: str = ""
  ) -> None:
    targets.append(
      {"target": name, "value": value, "threshold": threshold, "pass": ok, "note": note}
    )
    if name in TIMED_TARGETS:
      targets[-1]["decided"] = aa_decides(config["aa_ratio"])

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


# ---------------------------------------------------------------- the report


def undecided(t: dict[str, Any], config: dict[str, Any]) -> bool:
  """Whether target ``t`` compares times that the configuration's A/A
  control leaves undecided (or that its run had no A/A control)."""
  return t["target"] in TIMED_TARGETS and not aa_decides(config.get("aa_ratio"))


def plots(
  results: dict[str, Any], out: pathlib.Path, suffix: str = ""
) -> list[pathlib.Path]:
  """One PNG per model: ms/step and peak bytes against ``k``, a line per approach."""
  plt = pyplot()
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
      for ax, metric, scale in (
        (ax_time, "median_ms", 1),
        (ax_mem, "peak_bytes", 2**20),
      ):
        points = [c["approaches"][key][metric] / scale for c in configs]
        ax.plot(ks, points, "o-", label=label)
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
      xlabel = f"micro-batches k (B = {entry['batch_size']})"
      k_axis(ax, ks, ylabel, xlabel=xlabel, logy=True)
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


def step_time_machine(results: dict[str, Any]) -> str:
  m, s = results["machine"], results["settings"]
  cpus = str(m["cpu_count"])
  if m.get("pinned"):
    cpus += f", pinned to {','.join(map(str, m['cpus']))}"
  elif m.get("cpu_affinity") not in (None, m["cpu_count"]):
    cpus += f", {m['cpu_affinity']} usable"
  backend = f"{m['backend'].upper()} ({m['num_devices']} device)"
  if m.get("device_note"):
    backend += f", {m['device_note']}"
  start, end = m["load_average_at_start"][0], m["load_average_at_end"][0]
  header = ["measured", "command", "CPU", "cores", "backend", "jax", "optax"]
  header += ["jaxaccum", "preset", "rounds", "sample, ms", "optimizer (lr)"]
  header += ["dtype", "load average, start / end", "wall time, s"]
  row = [date(m["date"])]
  row += [f"`{command_line('python benchmarks/step_time.py', m.get('argv'))}`"]
  row += [m["cpu_model"] or m["machine"], cpus, backend, m["jax"], m["optax"]]
  row += [m["jaxaccum"], f"`{s['preset']}`", s["rounds"], f"{s['min_time_ms']:g}"]
  row += [f"`{s['optimizer']}` ({s['lr']:g})", s["dtype"]]
  row += [f"{start:.1f} / {end:.1f}", f"{results['wall_s']:.0f}"]
  return table(header, [row])


def _step_time_table(results: dict[str, Any], model: str) -> str:
  entry = results["models"].get(model)
  if entry is None:
    return f"_`{model}` was not part of this run._"
  configs = entry["configs"]
  labels = {key: configs[0]["approaches"][key]["label"] for key in STEP_TIME_COLUMNS}
  head = (
    f"**{entry['title']}**, batch {entry['batch_size']:,} rows "
    f"({format_bytes(entry['batch_bytes'])}), {entry['num_params']:,} parameters "
    f"({format_bytes(entry['param_bytes'])})"
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
        ratio(c["aa_ratio"]),
        ratio(peak / full["peak_bytes"]),
        ratio(c["jaxaccum_memory_bound"]["jaxaccum_peak_over_bound"]),
        ratio(peak / res["optax_microbatch"]["peak_bytes"]),
        f"{correct} / {len(STEP_TIME_COLUMNS)}",
      ]
    )
  header = [
    "k",
    *(labels[key] for key in STEP_TIME_COLUMNS),
    "A/A",
    "jaxaccum peak / full",
    "/ bound",
    "/ microbatch",
    "correct",
  ]
  return head + "\n\n" + table(header, rows)


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
  return table(["target", "pass", "miss", "undecided", "misses (value)"], rows)


#: The blocks written from ``step_time.json``, by name (for ``_report.py``).
BLOCKS = {
  "step_time machine": step_time_machine,
  "step_time targets": step_time_targets,
  **{
    f"step_time {name}": functools.partial(_step_time_table, model=name)
    for name in MODEL_NAMES
  },
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
  adam = args.optimizer == "adam"  # the optimizer every approach uses
  tx = optax.adam(args.lr) if adam else optax.sgd(args.lr, momentum=0.9)
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

  print(*(block(results) for block in BLOCKS.values()), sep="\n\n")
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
