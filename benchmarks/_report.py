"""The benchmarks' reports: ``step_time.py``'s text tables and plots, and the
generated blocks of ``benchmarks/README.md``.

Usage::

  python benchmarks/_report.py          # rewrite the generated blocks
  python benchmarks/_report.py --check  # exit 1 with a diff if one is stale

Every table in ``benchmarks/README.md``, and every number its prose states,
sits between a pair of markers::

  <!-- begin: step_time dispatch_mlp -->
  ...
  <!-- end: step_time dispatch_mlp -->

The first word names the JSON file (``benchmarks/results/step_time.json``),
the rest the block; :data:`BLOCKS` maps each name to the function that
writes it from that JSON. :func:`render` replaces what stands between the
markers and leaves the rest of the manual, which states no measured number,
as it is. A block whose JSON does not exist yet says so.
The top-level README.md has blocks of its own (:data:`PAGES`: the
README commands' times, the autopilot's outcome); ``main`` writes both
pages. ``tests/test_manuals.py`` checks that each committed page is what
:func:`render` writes.
"""

# The manual's typography: multiplication signs for ratios, en dashes for a
# missing value, a minus sign in a formula.
# ruff: noqa: RUF001

from __future__ import annotations

import argparse
import difflib
import importlib.util
import json
import pathlib
import platform
import re
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
MANUAL = HERE / "README.md"
RESULTS = HERE / "results"

Results = dict[str, Any]

# ---------------------------------------------------------------- the machine


def cpu_model() -> str:
  """The CPU's model name from ``/proc/cpuinfo`` (``platform.processor()``
  is often empty on Linux), for the JSON's record of the machine."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


# ---------------------------------------------------------------- formatting


def format_bytes(n: float) -> str:
  """Bytes in binary units, e.g. ``1.5 MiB``."""
  for unit in ("B", "KiB", "MiB", "GiB"):
    if abs(n) < 1024 or unit == "GiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
    n /= 1024
  raise AssertionError("unreachable")


def mib(n: float | None, digits: int = 0) -> str:
  """Bytes as MiB with thousands separators: ``2,400`` or ``4.02``."""
  return "–" if n is None else f"{n / 2**20:,.{digits}f}"


def gib(n: float | None, digits: int = 2) -> str:
  return "–" if n is None else f"{n / 2**30:,.{digits}f}"


def ratio(x: float | None) -> str:
  """A ratio, two decimals."""
  return "–" if x is None else f"{x:.2f}"


def ms(x: float) -> str:
  """Milliseconds to three significant digits (``0.138``, ``33.3``, ``1,540``)."""
  if x >= 100:
    return f"{x:,.0f}"
  if x >= 10:
    return f"{x:.1f}"
  if x >= 1:
    return f"{x:.2f}"
  return f"{x:.3f}"


def count(n: float) -> str:
  return f"{n:,.0f}"


def span(values: Iterable[float], fmt: Callable[[float], str] = ratio) -> str:
  """``lo to hi`` (or the one value) of ``values``."""
  values = list(values)
  lo, hi = fmt(min(values)), fmt(max(values))
  return lo if lo == hi else f"{lo} to {hi}"


def listing(items: Sequence[str], conj: str = "and") -> str:
  """``a``, ``a and b``, ``a, b and c``."""
  items = list(items)
  if len(items) <= 2:
    return f" {conj} ".join(items)
  return ", ".join(items[:-1]) + f" {conj} " + items[-1]


def ks_text(ks: Sequence[int]) -> str:
  return "k = " + listing([str(k) for k in ks])


def duration(seconds: float) -> str:
  """``45 s`` or ``7 minutes``."""
  return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} minutes"


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
  """A Markdown table."""
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)


def date(text: str) -> str:
  return text[:10]


def _command(command: str, argv: Sequence[str] | None) -> str:
  """``command`` and its arguments, less ``--out DIR`` (where it wrote)."""
  args = list(argv or [])
  while "--out" in args:
    i = args.index("--out")
    del args[i : i + 2]
  return " ".join([command, *args])


def _mark(ok: bool | None) -> str:
  return "n/a" if ok is None else ("PASS" if ok else "MISS")


def _met(ok: bool) -> str:
  return "met" if ok else "not met"


# ---------------------------------------------------------------- step_time.py:
# the text tables the script prints, and its plots


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
    for t in config["targets"]:
      note = f" ({t['note']})" if t["note"] else ""
      lines.append(
        f"{'':10}  target {t['target']:<30} {t['value']:>7.3f} {t['threshold']:<7} "
        f"{_mark(t['pass'])}{note}"
      )
  return "\n".join(lines)


def summary(results: dict[str, Any]) -> str:
  """PASS/MISS counts per target, over all configurations."""
  counts: dict[str, list[int]] = {}
  misses: list[str] = []
  for name, entry in results["models"].items():
    for config in entry["configs"]:
      for t in config["targets"]:
        if t["pass"] is None:
          continue
        row = counts.setdefault(t["target"], [0, 0])
        row[0 if t["pass"] else 1] += 1
        if not t["pass"]:
          misses.append(
            f"  MISS {name} k={config['k']}: {t['target']} = {t['value']:.3f}"
          )
  lines = ["", "targets (pass / miss over configurations):"]
  lines += [f"  {target:<32} {p:>3} / {m:<3}" for target, (p, m) in counts.items()]
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

#: ``"source name"`` -> the function writing that block from ``source.json``.
BLOCKS: dict[str, Callable[[Results], str]] = {}
#: The generated pages, and the blocks each holds (every block is on one).
PAGES: dict[str, pathlib.Path] = {
  "benchmarks": MANUAL,
  "readme": ROOT / "README.md",
  "guide": ROOT / "docs" / "guide.md",
}
PAGE_OF: dict[str, str] = {}


def block(
  name: str, page: str = "benchmarks"
) -> Callable[[Callable[[Results], str]], Callable[[Results], str]]:
  """Registers a block writer under ``name`` (``"<json stem> <block>"``),
  written into ``page`` (a key of :data:`PAGES`)."""

  def register(fn: Callable[[Results], str]) -> Callable[[Results], str]:
    BLOCKS[name] = fn
    PAGE_OF[name] = page
    return fn

  return register


def _bullets(items: Iterable[str]) -> str:
  return "\n".join(f"- {item}" for item in items)


# ---------------------------------------------------------------- step_time

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
MODEL_NAMES = {
  "dispatch_mlp": "the dispatch-bound MLP",
  "compute_mlp": "the compute-bound MLP",
  "transformer": "the transformer",
}


def _step_time_configs(results: Results, model: str) -> list[dict[str, Any]]:
  entry = results["models"].get(model)
  return entry["configs"] if entry else []


@block("step_time machine")
def step_time_machine(results: Results) -> str:
  m, s = results["machine"], results["settings"]
  cores = f"{m['cpu_count']} cores"
  if m.get("cpu_affinity") not in (None, m["cpu_count"]):
    cores += f", {m['cpu_affinity']} usable"
  note = f" ({m['device_note']})" if m.get("device_note") else ""
  start, end = m["load_average_at_start"][0], m["load_average_at_end"][0]
  return (
    f"Measured on {date(m['date'])} with "
    f"`{_command('python benchmarks/step_time.py', m.get('argv'))}`: "
    f"{m['cpu_model'] or m['machine']} ({cores}), {m['backend'].upper()} backend "
    f"({m['num_devices']} device){note}, jax {m['jax']}, optax {m['optax']}, "
    f"jaxaccum {m['jaxaccum']}; preset `{s['preset']}`, {s['rounds']} interleaved "
    f"rounds, samples of at least {s['min_time_ms']:g} ms, "
    f"`{s['optimizer']}` (learning rate {s['lr']:g}), {s['dtype']}. The "
    f"one-minute load average was {start:.1f} at the start and {end:.1f} at "
    f"the end; the run took {duration(results['wall_s'])}."
  )


def _step_time_table(results: Results, model: str) -> str:
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
    correct = sum(r["correctness"]["pass"] for r in res.values())
    rows.append(
      [
        c["k"],
        *cells,
        ratio(peak / full["peak_bytes"]),
        ratio(c["jaxaccum_memory_bound"]["jaxaccum_peak_over_bound"]),
        ratio(peak / res["optax_microbatch"]["peak_bytes"]),
        f"{correct} / {len(res)}",
      ]
    )
  header = [
    "k",
    *(labels[key] for key in STEP_TIME_COLUMNS),
    "jaxaccum peak / full",
    "/ bound",
    "/ microbatch",
    "correct",
  ]
  return head + "\n\n" + table(header, rows)


@block("step_time dispatch_mlp")
def step_time_dispatch_mlp(results: Results) -> str:
  return _step_time_table(results, "dispatch_mlp")


@block("step_time compute_mlp")
def step_time_compute_mlp(results: Results) -> str:
  return _step_time_table(results, "compute_mlp")


@block("step_time transformer")
def step_time_transformer(results: Results) -> str:
  return _step_time_table(results, "transformer")


@block("step_time targets")
def step_time_targets(results: Results) -> str:
  counts: dict[str, list[int]] = {}
  misses: dict[str, list[str]] = {}
  for name, entry in results["models"].items():
    for c in entry["configs"]:
      for t in c["targets"]:
        if t["pass"] is None:
          continue
        row = counts.setdefault(t["target"], [0, 0])
        row[0 if t["pass"] else 1] += 1
        if not t["pass"]:
          misses.setdefault(t["target"], []).append(
            f"{name} k={c['k']}: {t['value']:.2f}"
          )
  rows = [
    [f"`{target}`", p, m, "; ".join(misses.get(target, [])) or "–"]
    for target, (p, m) in counts.items()
  ]
  return table(["target", "pass", "miss", "misses (value)"], rows)


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


def _by_k(values: dict[int, float], fmt: Callable[[float], str] = ratio) -> str:
  """``a, b and c at k = 1, 2 and 4`` (``a at every k`` if they are equal)."""
  texts = {fmt(v) for v in values.values()}
  if len(texts) == 1 and len(values) > 1:
    return f"{texts.pop()} at every k"
  return (
    f"{listing([fmt(v) for v in values.values()])} at k = "
    f"{listing([str(k) for k in values])}"
  )


@block("step_time summary")
def step_time_summary(results: Results) -> str:
  models = {n: _step_time_configs(results, n) for n in MODEL_NAMES}
  models = {n: c for n, c in models.items() if c}
  return _bullets(
    text
    for text in (
      _step_time_memory(models),
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
        f"{ratio(r)} for {MODEL_NAMES[n]} (k = {k})"
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
      [f"{MODEL_NAMES[n]} at k = {k} ({ratio(r)})" for n, k, r in above]
    )
  text += "."
  if k1:
    text += (
      " At k = 1 its peak with the finite check over its peak without it is "
      f"{span(k1)}."
    )
  return text


def _step_time_check(models: dict[str, list[dict[str, Any]]]) -> str:
  parts = [
    f"{span(_ratios(c, 'jaxaccum', 'jaxaccum_no_skip').values())} on {MODEL_NAMES[n]}"
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
  met = [k for k, r in with_check.items() if r >= 2]
  missed = [k for k, r in with_check.items() if r < 2]
  verdict = [f"met at {ks_text(met)}"] if met else []
  verdict += [f"missed at {ks_text(missed)}"] if missed else []
  return (
    "**Dispatch.** jaxaccum makes one call per step where optax.MultiSteps "
    "makes `k`. On the dispatch-bound MLP MultiSteps' time over jaxaccum's is "
    f"{_by_k(with_check)} with the check "
    f"({listing([ratio(v) for v in without.values()])} without it). The "
    f"target, at least 2, is {listing(verdict)}."
  )


def _step_time_speed(models: dict[str, list[dict[str, Any]]]) -> str:
  text = "**Speed.**"
  if "compute_mlp" in models:
    configs = models["compute_mlp"]
    vs_full = _ratios(configs, "jaxaccum", "full_batch")
    vs_peer = _ratios(configs, "jaxaccum", STEP_TIME_PEERS, 2)
    met = [k for k, r in vs_full.items() if r <= 1.10]
    text += (
      " On the compute-bound MLP jaxaccum's time over the full batch's is "
      f"{_by_k(vs_full)} (the target, at most 1.10, is met at {len(met)} of "
      f"{len(vs_full)} k)"
    )
    if vs_peer:
      text += f", and over the best peer's {span(vs_peer.values())} from k = 2 on"
    text += "."
  if "transformer" in models:
    configs = models["transformer"]
    vs_micro = _ratios(configs, "jaxaccum", "optax_microbatch")
    vs_full = _ratios(configs, "jaxaccum", "full_batch")
    text += (
      " On the transformer its time over optax.microbatch's is "
      f"{span(vs_micro.values())}, and over the full batch's {_by_k(vs_full)}."
    )
  return text if text != "**Speed.**" else ""


def _step_time_correctness(models: dict[str, list[dict[str, Any]]]) -> str:
  checks = [
    r["correctness"]["pass"]
    for configs in models.values()
    for c in configs
    for r in c["approaches"].values()
  ]
  return (
    f"**Correctness.** In {sum(checks)} of {len(checks)} (approach, k) pairs "
    "the parameters after one step equal the full batch's within float rounding."
  )


# ---------------------------------------------------------------- eager_calls


@block("eager_calls table")
def eager_calls_table(results: Results) -> str:
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


# ---------------------------------------------------------------- communication

COMMUNICATION_APPROACHES = {
  "jaxaccum": "(a) jaxaccum, `mesh=`",
  "optax_microbatch": "(b) optax.microbatch",
  "hand_scan": "(c) hand-written scan",
}


def _machine_line(results: Results, command: str) -> str:
  m = results.get("machine", {})
  host = m.get("cpu_model") or "an unrecorded CPU"
  cores = f" ({m['cpu_count']} cores)" if m.get("cpu_count") else ""
  load = ""
  if "load_average_at_start" in m:
    load = f"; one-minute load average {m['load_average_at_start'][0]:.1f} at the start"
  took = results.get("seconds")
  took_text = f"; the run took {duration(took)}" if took else ""
  return (
    f"Measured on {date(results['date'])} with `{command}`: {results['num_devices']} "
    f"fake {results['backend'].upper()} devices on {host}{cores}, jax "
    f"{results['jax_version']}, optax {results['optax_version']}{load}{took_text}."
  )


@block("communication machine")
def communication_machine(results: Results) -> str:
  return _machine_line(results, "python benchmarks/communication.py")


@block("communication bytes")
def communication_bytes(results: Results) -> str:
  rows = []
  for name, label in COMMUNICATION_APPROACHES.items():
    for k in results["ks"]:
      r = results["results"][name][str(k)]
      ops = ", ".join(f"{op}" for op in r["bytes_by_op"]) or "none"
      rows.append(
        [
          label,
          k,
          mib(r["bytes_per_step"], 2),
          ratio(r["bytes_over_grad_bytes"]),
          ops,
          r["in_loop_executions_per_step"],
          ratio(r["compute_vs_data_parallel_est"]),
          f"{r['grads_rel_error']:.1e}",
        ]
      )
  model = results["model"]
  head = (
    f"{model['num_params']:,}-parameter MLP ({' → '.join(map(str, model['widths']))}), "
    f"batch {results['batch_size']} over {results['num_devices']} devices; the "
    f"gradient is {mib(results['grad_bytes'], 2)} MiB. Per device and step:"
  )
  header = [
    "approach",
    "k",
    "MiB communicated",
    "× gradient",
    "collectives",
    "run in the loop",
    "compute × data parallel (est.)",
    "grads rel. error",
  ]
  return head + "\n\n" + table(header, rows)


@block("communication summary")
def communication_summary(results: Results) -> str:
  res, ks = results["results"], results["ks"]
  acc = [res["jaxaccum"][str(k)] for k in ks]
  micro = {k: res["optax_microbatch"][str(k)] for k in ks}
  scan = {k: res["hand_scan"][str(k)] for k in ks}
  gathers = [
    k
    for k, r in scan.items()
    if any(op.startswith("all-gather") for op in r["bytes_by_op"])
  ]
  text = (
    "(c) The hand-written scan over a C-order reshape: its bytes over the "
    f"gradient's are {_by_k({k: r['bytes_over_grad_bytes'] for k, r in scan.items()})}, "
    "but its compute per device over the data-parallel step's is "
    f"{_by_k({k: r['compute_vs_data_parallel_est'] for k, r in scan.items()})}"
  )
  if gathers:
    text += (
      f": XLA all-gathers batch rows before the loop at {ks_text(gathers)}, and "
      "a device that holds every micro-batch computes them all"
    )
  return _bullets(
    [
      "(a) jaxaccum's bytes over the gradient's are "
      f"{span(r['bytes_over_grad_bytes'] for r in acc)} at every k from {ks[0]} "
      f"to {ks[-1]}, with {max(r['in_loop_executions_per_step'] for r in acc)} "
      "collectives run inside the loop.",
      "(b) optax.microbatch's bytes over the gradient's are "
      f"{_by_k({k: r['bytes_over_grad_bytes'] for k, r in micro.items()})}: its "
      "all-reduce runs inside the loop, "
      f"{listing([str(r['in_loop_executions_per_step']) for r in micro.values()])} "
      "times per step.",
      text + ".",
    ]
  )


PLAIN_ONE_DEVICE_CLOSE = 1.05  # "the loop costs nothing on one device"
PLAIN_LABELS = {
  "full_batch": "full batch, `jit(jax.value_and_grad(loss))`",
  "jaxaccum": "jaxaccum, plain `jit`, no `mesh=`",
  "jaxaccum_mesh": "jaxaccum, `mesh=`",
  "contiguous_scan": "contiguous split (hand-written scan)",
  "full_batch_one_device": "full batch, one device",
  "jaxaccum_one_device": "jaxaccum, one device (× the full batch on one device)",
}


@block("communication plain_jit")
def communication_plain_jit(results: Results) -> str:
  plain = results.get("plain_jit")
  if plain is None:
    return "_Not in this JSON: rerun `python benchmarks/communication.py`._"
  rows = []
  for name, r in plain["approaches"].items():
    moved = r["data_moving_collectives"]
    rows.append(
      [
        PLAIN_LABELS.get(name, name),
        ms(r["median_ms"]),
        f"{ms(r['q1_ms'])} to {ms(r['q3_ms'])}",
        ratio(r["ratio_to_full"]),
        ", ".join(sorted(set(moved))) if moved else "none",
        mib(r["bytes_per_step"], 2),
        r["in_loop_executions_per_step"],
        f"{r['grads_rel_error']:.1e}",
      ]
    )
  model = plain["model"]
  head = (
    f"A {model['num_params']:,}-parameter MLP "
    f"({' → '.join(map(str, model['widths']))}), batch {plain['batch_size']:,} "
    f"sharded over {results['num_devices']} devices, k = {plain['k']}: the median "
    f"of {plain['rounds']} interleaved rounds (samples of at least "
    f"{plain['min_sample_ms']:g} ms)."
  )
  header = [
    "approach",
    "median ms",
    "quartiles",
    "× full batch",
    "collectives that move batch rows",
    "MiB communicated",
    "collectives run in the loop",
    "grads rel. error",
  ]
  targets = _bullets(
    f"`{t['target']}`: {t['value']:.2f}, {_met(t['pass'])}"
    if isinstance(t["value"], float)
    else f"`{t['target']}`: {t['value']}, {_met(t['pass'])}"
    for t in plain["targets"]
  )
  return "\n\n".join(
    [head, table(header, rows), "Targets:", targets, _plain_jit_prose(plain)]
  )


def _plain_jit_prose(plain: Results) -> str:
  """What the plain-jit table says, in words."""
  res = plain["approaches"]
  full, acc = res["full_batch"], res["jaxaccum"]
  moved = acc["data_moving_collectives"]
  text = (
    "Under plain `jit` jaxaccum's compiled step holds "
    + (
      f"{len(moved)} collectives that move batch rows ({', '.join(sorted(set(moved)))})"
      if moved
      else "no collective that moves batch rows"
    )
    + f"; it communicates {ratio(acc['bytes_per_step'] / full['bytes_per_step'])} × "
    "the full batch's bytes, in "
    f"{acc['in_loop_executions_per_step']} collective executions inside the loop "
    "(the gradient reductions the partitioner places per micro-batch), and its "
    f"time over the full batch's is {ratio(acc['ratio_to_full'])}."
  )
  if "jaxaccum_mesh" in res:
    mesh = res["jaxaccum_mesh"]
    text += (
      " With `mesh=` the step runs "
      f"{mesh['collective_executions_per_step']} collective(s) per step, "
      f"{mesh['in_loop_executions_per_step']} of them in the loop, and its time "
      "over the full batch's is "
      f"{ratio(mesh['ratio_to_full'])}."
    )
  if "contiguous_scan" in res:
    scan = res["contiguous_scan"]
    gathered = scan["bytes_by_op"].get("all-gather", 0)
    text += (
      " The contiguous split puts micro-batch i on the devices that hold its "
      f"rows: XLA all-gathers {mib(gathered, 2)} MiB per device "
      f"and the step takes {ratio(scan['ratio_to_full'])} × the full batch's "
      "time."
    )
  if "jaxaccum_one_device" in res:
    one = res["jaxaccum_one_device"]["ratio_to_full"]
    text += (
      " On one device the same jaxaccum step takes "
      f"{ratio(one)} × the one-device full batch's time"
      + (
        ", so the difference on the mesh comes with running the loop over "
        "devices that share the host's cores (not profiled further)."
        if one <= PLAIN_ONE_DEVICE_CLOSE < res["jaxaccum"]["ratio_to_full"]
        else "."
      )
    )
  m = plain.get("load_average_at_end")
  if m:
    text += f" The one-minute load average was {m[0]:.1f} when the timing ended."
  return text


# ---------------------------------------------------------------- meshes

MESH_APPROACHES = {
  "jaxaccum": "jaxaccum",
  "jaxaccum_once": 'jaxaccum, `fsdp_gather="once"`',
  "optax_microbatch": "optax.microbatch",
  "hand_scan": "hand-written scan",
}
MESH_LAYOUTS = {"tp": "TP", "fsdp_tp": "FSDP + TP", "hsdp_tp": "HSDP + TP"}


def _mesh_name(results: Results, layout: str, mode: str) -> str:
  shape = ",".join(str(n) for n in results["layouts"][layout]["mesh_shape"])
  return f"({shape}) {MESH_LAYOUTS.get(layout, layout)}, {mode.capitalize()}"


def _mesh_rows(
  results: Results,
  cell: Callable[[dict[str, Any]], str],
  full_cell: Callable[[dict[str, Any]], str],
) -> list[list[str]]:
  rows = []
  for layout, modes in results["results"].items():
    for mode, entry in modes.items():
      name = _mesh_name(results, layout, mode)
      first = True
      for approach, label in MESH_APPROACHES.items():
        if approach not in entry:
          continue
        by_k = entry[approach]
        cells = []
        for k in results["ks"]:
          r = by_k[str(k)]
          cells.append(cell(r) if r["ok"] else f"fails (`{r['error']}`)")
        rows.append(
          [
            name if first else "",
            full_cell(entry["full_batch"]) if first else "",
            label,
            *cells,
          ]
        )
        first = False
  return rows


@block("meshes layouts")
def meshes_layouts(results: Results) -> str:
  rows = []
  for name, layout in results["layouts"].items():
    shape = ", ".join(str(n) for n in layout["mesh_shape"])
    axes = " × ".join(f"`{a}`" for a in layout["axis_names"])
    specs = layout["param_specs"]
    data_axis = layout["data_axis"]
    data_axis = (
      f'"{data_axis}"'
      if isinstance(data_axis, str)
      else "(" + ", ".join(f'"{a}"' for a in data_axis) + ")"
    )
    rows.append(
      [
        f"`{name}`: {MESH_LAYOUTS.get(name, name)}",
        f"({shape}) {axes}",
        ", ".join(f"`{leaf}` `{spec}`" for leaf, spec in specs.items()),
        f"`{layout['batch_spec']}`",
        f"`data_axis={data_axis}`",
      ]
    )
  return table(
    ["layout", "mesh", "parameters, per block", "batch", "what you write"], rows
  )


@block("meshes machine")
def meshes_machine(results: Results) -> str:
  model = results["model"]
  return (
    _machine_line(results, "python benchmarks/meshes.py")
    + f" The model: a {model['num_params']:,}-parameter {model['kind']} "
    f"({model['num_blocks']} blocks of {model['features']} → {model['hidden']} → "
    f"{model['features']}, {mib(model['param_bytes'], 2)} MiB), batch "
    f"{results['batch_size']:,} rows ({mib(results['batch_bytes'], 2)} MiB)."
  )


def _ks_header(results: Results) -> list[str]:
  return [f"k = {k}" for k in results["ks"]]


@block("meshes bytes")
def meshes_bytes(results: Results) -> str:
  def cell(r: dict[str, Any]) -> str:
    return (
      f"{ratio(r['bytes_over_data_axes_vs_full'])} / "
      f"{ratio(r['bytes_over_model_axis_vs_full'])}"
    )

  def full(r: dict[str, Any]) -> str:
    return f"{mib(r['bytes_over_data_axes'], 2)} / {mib(r['bytes_over_model_axis'], 2)}"

  header = ["mesh, axes", "full batch, MiB", "approach", *_ks_header(results)]
  return (
    "Bytes over the data axes / over the model axis, per device and step, × "
    "the full batch's on the same mesh:\n\n"
    + table(header, _mesh_rows(results, cell, full))
  )


@block("meshes peak")
def meshes_peak(results: Results) -> str:
  header = ["mesh, axes", "full batch, MiB", "approach", *_ks_header(results)]
  rows = _mesh_rows(
    results,
    lambda r: ratio(r["peak_bytes_vs_full"]),
    lambda r: mib(r["peak_bytes"], 2),
  )
  return (
    "Peak memory per device (`argument + output + temp − alias`), × the full "
    "batch's on the same mesh:\n\n" + table(header, rows)
  )


@block("meshes in_loop")
def meshes_in_loop(results: Results) -> str:
  header = ["mesh, axes", "full batch", "approach", *_ks_header(results)]
  rows = _mesh_rows(
    results,
    lambda r: str(r["in_loop_data_axis_executions"]),
    lambda r: str(r["in_loop_data_axis_executions"]),
  )
  return (
    "Data-axis collectives executed inside the micro-batch loop, per step "
    "(a collective in the loop counts once per micro-batch):\n\n" + table(header, rows)
  )


def _ok(
  results: Results, approach: str, layouts: Sequence[str], modes: Sequence[str]
) -> Iterable[tuple[str, str, int, dict[str, Any]]]:
  """Every measured ``(layout, mode, k, row)`` of ``approach``."""
  for layout in layouts:
    for mode in modes:
      entry = results["results"].get(layout, {}).get(mode, {})
      for k, r in entry.get(approach, {}).items():
        yield layout, mode, int(k), r


def _per_k(
  results: Results,
  approach: str,
  layouts: Sequence[str],
  modes: Sequence[str],
  key: str,
  *,
  fmt: Callable[[float], str] = ratio,
) -> str:
  """``a to b at k = 1, c at k = 2 and ...``: ``key``'s span per k over the
  configurations of ``approach`` that compiled."""
  by_k: dict[int, list[float]] = {}
  for _, _, k, r in _ok(results, approach, layouts, modes):
    if r["ok"]:
      by_k.setdefault(k, []).append(r[key])
  spans = {k: span(v, fmt) for k, v in sorted(by_k.items())}
  if len(set(spans.values())) == 1 and len(spans) > 1:
    return f"{next(iter(spans.values()))} at every k"
  return listing([f"{v} at k = {k}" for k, v in spans.items()])


def _fails(
  results: Results,
  approach: str,
  layouts: Sequence[str],
  modes: Sequence[str],
  k_min: int = 1,
) -> tuple[int, int, list[str]]:
  """How many configurations with ``k >= k_min`` fail, of how many, and why."""
  rows = [r for _, _, k, r in _ok(results, approach, layouts, modes) if k >= k_min]
  failed = [r for r in rows if not r["ok"]]
  return len(failed), len(rows), sorted({r["error"] for r in failed})


@block("meshes summary")
def meshes_summary(results: Results) -> str:
  layouts = list(results["results"])
  modes = ("auto", "explicit")
  fsdp = [name for name in layouts if name != "tp"]
  bullets = []
  if "tp" in layouts:
    bullets.append(
      "**Tensor parallel, jaxaccum.** Relative to the full batch on the same "
      "mesh (Auto and Explicit axes): data-axis bytes "
      f"{_per_k(results, 'jaxaccum', ['tp'], modes, 'bytes_over_data_axes_vs_full')}; "
      "model-axis bytes "
      f"{_per_k(results, 'jaxaccum', ['tp'], modes, 'bytes_over_model_axis_vs_full')}; "
      f"peak {_per_k(results, 'jaxaccum', ['tp'], modes, 'peak_bytes_vs_full')}. "
      "Data-axis collectives in the loop per step: "
      + _per_k(
        results, "jaxaccum", ["tp"], modes, "in_loop_data_axis_executions", fmt=count
      )
      + "."
    )
  for approach, name in (
    ("jaxaccum", 'jaxaccum\'s default, `fsdp_gather="per_micro_batch"`'),
    ("jaxaccum_once", 'jaxaccum, `fsdp_gather="once"`'),
  ):
    if not fsdp or not any(r["ok"] for *_, r in _ok(results, approach, fsdp, modes)):
      continue
    bullets.append(
      f"**FSDP and HSDP, {name}.** Relative to the full batch on the same mesh "
      "(both layouts, Auto and Explicit axes): data-axis bytes "
      f"{_per_k(results, approach, fsdp, modes, 'bytes_over_data_axes_vs_full')}; "
      f"peak {_per_k(results, approach, fsdp, modes, 'peak_bytes_vs_full')}. "
      "Data-axis collectives in the loop per step: "
      + _per_k(
        results, approach, fsdp, modes, "in_loop_data_axis_executions", fmt=count
      )
      + "."
    )
  failed, total, errors = _fails(results, "optax_microbatch", layouts, ["explicit"])
  text = "**optax.microbatch.**"
  if total:
    text += f" On Explicit axes it fails in {failed} of {total} configurations"
    text += f" ({', '.join(f'`{e}`' for e in errors)})." if errors else "."
  text += (
    " On Auto axes, relative to the full batch: data-axis bytes "
    f"{_per_k(results, 'optax_microbatch', layouts, ['auto'], 'bytes_over_data_axes_vs_full')}; "
    f"peak {_per_k(results, 'optax_microbatch', layouts, ['auto'], 'peak_bytes_vs_full')}."
  )
  bullets.append(text)
  failed, total, errors = _fails(results, "hand_scan", layouts, ["explicit"], 2)
  text = "**The hand-written scan.**"
  if total:
    text += (
      f" On Explicit axes it fails in {failed} of {total} configurations with k ≥ 2"
    )
    text += f" ({', '.join(f'`{e}`' for e in errors)})." if errors else "."
  text += (
    " On Auto axes its estimated compute per device over the full batch's is "
    f"{_per_k(results, 'hand_scan', layouts, ['auto'], 'compute_vs_full_est')} "
    "(the partitioner shards the micro-batch axis, and devices compute rows that "
    "are not theirs), its data-axis bytes "
    f"{_per_k(results, 'hand_scan', layouts, ['auto'], 'bytes_over_data_axes_vs_full')}."
  )
  bullets.append(text)
  measured = [
    r
    for approach in MESH_APPROACHES
    for *_, r in _ok(results, approach, layouts, modes)
    if r["ok"]
  ]
  sharded = sum(r["grads_sharded_like_params"] for r in measured)
  bullets.append(
    f"**Every step that compiles** ({len(measured)} of them) equals the full "
    "batch on one device within a relative error of "
    f"{max(r['grads_rel_error'] for r in measured):.1e}, and in {sharded} of them "
    "the grads come back sharded exactly like the parameters."
  )
  return _bullets(bullets)


# ---------------------------------------------------------------- fsdp

FSDP_APPROACHES = {
  "full_batch": "full batch",
  "full_batch_skip": "full batch + skip",
  "jaxaccum_per_micro_batch": 'jaxaccum (`"per_micro_batch"`)',
  "jaxaccum_once": 'jaxaccum (`"once"`)',
  "jaxaccum_cast_once": 'jaxaccum (`"cast_once"`)',
  "jaxaccum_global": 'jaxaccum (`view="global"`)',
  "hand_scan": "hand-written scan",
  "optax_microbatch": "optax.microbatch",
}


def _fsdp_cell(r: dict[str, Any] | None, scale: int) -> str:
  if r is None:
    return "–"
  if r.get("peak_bytes") is None:
    return "refused" if "RESOURCE_EXHAUSTED" in r.get("error", "") else "fails"

  def size(n: float | None) -> str:
    return "–" if n is None else f"{n / scale:,.2f}"

  loop = r.get("in_loop_collectives")
  return f"{size(r['peak_bytes'])} / {size(r.get('collective_bytes'))} / {'–' if loop is None else loop}"


@block("fsdp table")
def fsdp_table(results: Results) -> str:
  rows_in = results["rows"]
  peaks = [r["peak_bytes"] for r in rows_in if r.get("peak_bytes") is not None]
  unit, scale = ("GiB", 2**30) if max(peaks, default=0) >= 2**30 else ("MiB", 2**20)
  model = results["model"]
  parts = [
    f"Compile-only, {date(results['date'])}, jax "
    f"{results.get('versions', {}).get('jax', '?')}: a "
    f"{model['num_params']:,}-parameter `{model['name']}` on 8 devices. Each cell: "
    f"peak {unit} per device / collective {unit} per step per device / "
    "collectives inside the micro-batch loop."
  ]
  for target in dict.fromkeys(r["target"] for r in rows_in):
    mine = {(r["approach"], r["k"]): r for r in rows_in if r["target"] == target}
    names = [a for a in FSDP_APPROACHES if any(a == key[0] for key in mine)]
    ks = sorted({k for _, k in mine})
    title = results.get("targets", {}).get(target, {}).get("title", target)
    rows = [[k, *(_fsdp_cell(mine.get((a, k)), scale) for a in names)] for k in ks]
    parts.append(
      f"**{title}** × 8:\n\n" + table(["k", *(FSDP_APPROACHES[a] for a in names)], rows)
    )
  parts.append("![FSDP peak and collective bytes against k](results/fsdp.png)")
  return "\n\n".join(parts)


@block("fsdp summary")
def fsdp_summary(results: Results) -> str:
  rows = results["rows"]
  peak = {(r["target"], r["k"], r["approach"]): r.get("peak_bytes") for r in rows}
  moved = {
    (r["target"], r["k"], r["approach"]): r.get("collective_bytes") for r in rows
  }
  default = "jaxaccum_per_micro_batch"
  modes = [a for a in FSDP_APPROACHES if a.startswith("jaxaccum_")]
  peers = [
    a for a in FSDP_APPROACHES if a not in (*modes, "full_batch", "full_batch_skip")
  ]
  lines = []
  for target in dict.fromkeys(r["target"] for r in rows):
    ks = sorted({r["k"] for r in rows if r["target"] == target and r["k"] >= 2})
    ks = [k for k in ks if peak.get((target, k, default)) is not None]
    mine = {k: peak[(target, k, default)] for k in ks}
    full = {k: mine[k] / p for k in ks if (p := peak.get((target, k, "full_batch")))}
    lowest: dict[int, tuple[float, list[str]]] = {}
    for k in ks:
      theirs = {a: p for a in peers if (p := peak.get((target, k, a)))}
      if theirs:
        low = min(theirs.values())
        names = [FSDP_APPROACHES[a] for a, p in theirs.items() if p == low]
        lowest[k] = (mine[k] / low, names)
    title = results.get("targets", {}).get(target, {}).get("title", target)

    def each(values: dict[int, float]) -> str:
      return listing([ratio(v) for v in values.values()])

    text = (
      f"**{title}.** At k = {listing([str(k) for k in ks])}, jaxaccum's default "
      f"peak is {each(full)} × the full batch's and "
      f"{each({k: r for k, (r, _) in lowest.items()})} × the lowest peer's "
      f"({listing(sorted({n for _, ns in lowest.values() for n in ns}))})"
    )
    hand = {
      k: moved[(target, k, default)] / m
      for k in ks
      if moved.get((target, k, default)) and (m := moved.get((target, k, "hand_scan")))
    }
    if len(hand) == len(ks):
      text += (
        f"; it moves {each(hand)} × the hand-written scan's collective bytes per step"
      )
    lines.append(text + ".")
    for mode in modes:
      over = {
        k: (p / h, m / hm)
        for k in ks
        if (p := peak.get((target, k, mode)))
        and (h := peak.get((target, k, "hand_scan")))
        and (m := moved.get((target, k, mode))) is not None
        and (hm := moved.get((target, k, "hand_scan")))
      }
      if over:
        lines.append(
          f"{title}, {FSDP_APPROACHES[mode]} ÷ the hand-written scan at k = "
          f"{listing([str(k) for k in over])}: peak "
          f"{listing([f'{p:.3f}' for p, _ in over.values()])}, collective bytes "
          f"{listing([f'{m:.3f}' for _, m in over.values()])}."
        )
    one = {
      a: p
      for a in ("full_batch", "full_batch_skip", default)
      if (p := peak.get((target, 1, a)))
    }
    if len(one) == 3:
      lines.append(
        f"{title}, k = 1: jaxaccum's step is {one[default] / one['full_batch']:.3f}"
        f" × the full batch's peak and {one[default] / one['full_batch_skip']:.3f}"
        " × the full batch's with the same skip-non-finite select."
      )
  misread = sum(bool(r.get("misread_collectives")) for r in rows)
  if misread:
    lines.append(
      f"In {misread} of {len(rows)} steps the HLO holds a form of collective "
      "that `jaxaccum.testing` misreads; their collective numbers are left out "
      "(–) rather than understated (`misread_collectives` in the JSON)."
    )
  errors = [r for r in rows if r.get("error") and r.get("peak_bytes") is None]
  if errors:
    lines.append(
      f"{len(errors)} of {len(rows)} steps did not compile (refused: "
      f"{sum('RESOURCE_EXHAUSTED' in r['error'] for r in errors)}); the JSON "
      "keeps each error."
    )
  return _bullets(lines)


# ---------------------------------------------------------------- accelerator_memory

ACCELERATOR_MODELS = {
  "compute_mlp": "large MLP",
  "transformer": "transformer",
  "dispatch_mlp": "small MLP",
}


def _accelerator_rows(results: Results, target: str) -> list[dict[str, Any]]:
  return [r for r in results["rows"] if r["target"] == target]


ACCELERATOR_PEAKS = (
  "full_peak",
  "bound",
  "jaxaccum_peak",
  "streamed_peak",
  "streamed_peak_2x",
  "microbatch_peak",
)


def _accelerator_table(results: Results, target: str) -> str:
  """Per model and k, each peak in MiB (KiB for a model whose peaks stay
  below 16 MiB), jaxaccum's also over its bound."""
  title = results["targets"][target]["title"]
  rows = []
  for model, model_name in ACCELERATOR_MODELS.items():
    mine = [r for r in _accelerator_rows(results, target) if r["model"] == model]
    peaks = [r[key] for r in mine for key in ACCELERATOR_PEAKS if r[key] is not None]
    unit, scale = (
      ("MiB", 2**20) if max(peaks, default=0) >= 16 * 2**20 else ("KiB", 2**10)
    )
    for r in mine:

      def cell(key: str, r: dict[str, Any] = r, scale: int = scale) -> str:
        return "refused" if r[key] is None else f"{r[key] / scale:,.0f}"

      acc = cell("jaxaccum_peak")
      if r["jaxaccum_peak"] is not None and r["bound"]:
        acc += f" ({ratio(r['jaxaccum_peak'] / r['bound'])})"
      rows.append(
        [
          f"{model_name}, {unit}",
          r["k"],
          cell("full_peak"),
          cell("bound"),
          acc,
          cell("streamed_peak"),
          cell("streamed_peak_2x"),
          cell("microbatch_peak"),
        ]
      )
  header = [
    "model",
    "k",
    "full batch",
    "bound",
    "jaxaccum (× bound)",
    "streamed",
    "streamed, 2× batch",
    "optax.microbatch",
  ]
  return f"**{title}**, per device:\n\n" + table(header, rows)


@block("accelerator_memory machine")
def accelerator_memory_machine(results: Results) -> str:
  m, s = results["machine"], results["settings"]
  models = results["models"]

  def describe(name: str) -> str:
    c = models[name]
    if c["kind"] == "mlp":
      return (
        f"the {ACCELERATOR_MODELS[name]} ({' → '.join(map(str, c['widths']))}, "
        f"batch {c['batch_size']:,} rows)"
      )
    return (
      f"the {ACCELERATOR_MODELS[name]} ({c['num_layers']} layers, d_model "
      f"{c['d_model']}, {c['batch_size']} sequences of {c['seq_len']:,} tokens, "
      f"{c.get('dtype', s['dtype'])})"
    )

  return (
    f"Compiled on {date(m['date'])} with "
    f"`{_command('python benchmarks/accelerator_memory.py', m.get('argv'))}` "
    f"(jax {m['jax']}; preset "
    f"`{s['preset']}`, {s['dtype']}, {ks_text(s['ks'])}) for "
    + listing([describe(n) for n in ACCELERATOR_MODELS if n in models])
    + f"; the sweep took {duration(m['wall_s'])} of compiling."
  )


@block("accelerator_memory h100")
def accelerator_memory_h100(results: Results) -> str:
  return _accelerator_table(results, "h100")


@block("accelerator_memory tpu-v5e")
def accelerator_memory_tpu(results: Results) -> str:
  return _accelerator_table(results, "tpu-v5e")


@block("accelerator_memory summary")
def accelerator_memory_summary(results: Results) -> str:
  bullets = [
    _accelerator_target_bullet(results, target, info["title"])
    for target, info in results["targets"].items()
  ]
  bullets.append(_accelerator_streaming_bullet(results))
  bullets.append(_accelerator_checks_bullet(results))
  return _bullets(b for b in bullets if b)


def _accelerator_target_bullet(results: Results, target: str, title: str) -> str:
  mine = _accelerator_rows(results, target)
  over = [
    (r, r["jaxaccum_peak"] / r["bound"])
    for r in mine
    if r["jaxaccum_peak"] is not None and r["bound"]
  ]
  missed = [x for x in over if x[1] > BOUND_TARGET]
  text = (
    f"**{title}.** jaxaccum's peak over the bound is {span(x[1] for x in over)}, "
    f"at most {BOUND_TARGET:.2f} in {len(over) - len(missed)} of {len(over)} rows"
  )
  if missed:
    text += "; above it: " + listing(
      [
        f"the {ACCELERATOR_MODELS[r['model']]} at k = {r['k']} ({ratio(x)})"
        for r, x in missed
      ]
    )
  text += "."
  refused = sorted({r["model"] for r in mine if r["full_peak"] is None})
  if refused:
    fits = [
      min(
        (r["k"] for r in mine if r["model"] == m and r["jaxaccum_peak"] is not None),
        default=None,
      )
      for m in refused
    ]
    text += (
      " XLA refuses the full-batch step of the "
      + listing([ACCELERATOR_MODELS[m] for m in refused])
      + " (beyond the chip's memory); jaxaccum fits from "
      + listing([f"k = {k}" for k in fits if k is not None])
      + "."
    )
  pairs = [
    r
    for r in mine
    if r["jaxaccum_peak"] is not None
    and r["microbatch_peak"] is not None
    and r["k"] >= 2
  ]
  below = sum(r["jaxaccum_peak"] <= r["microbatch_peak"] for r in pairs)
  text += (
    f" For k ≥ 2 jaxaccum's peak is at or below optax.microbatch's in {below} "
    f"of {len(pairs)} rows"
  )
  bf16 = [
    r
    for r in pairs
    if r["model"] == "transformer" and r["jaxaccum_peak"] > r["microbatch_peak"]
  ]
  if bf16:
    text += (
      "; for the bfloat16 transformer it is "
      f"{span((r['jaxaccum_peak'] - r['microbatch_peak'] for r in bf16), mib)} MiB "
      "above it, where jaxaccum's float32 accumulator is "
      f"{mib(bf16[0]['param_bytes'])} MiB larger than microbatch's bfloat16 one"
    )
  return text + "."


def _accelerator_streaming_bullet(results: Results) -> str:
  rows = results["rows"]
  streamed = [
    r
    for r in rows
    if r["k"] >= 2
    and r["streamed_peak"] is not None
    and r["streamed_peak_2x"] is not None
  ]
  same = [
    r for r in streamed if abs(r["streamed_peak_2x"] / r["streamed_peak"] - 1) <= 0.02
  ]
  text = (
    "**Streaming.** With the batch in host memory, twice the batch at the same "
    f"micro-batch size gives the same device peak within 2% in {len(same)} of "
    f"{len(streamed)} rows with k ≥ 2."
  )
  saves = [
    r
    for r in rows
    if r["model"] == "compute_mlp"
    and r["k"] >= 2
    and r["streamed_peak"] is not None
    and r["jaxaccum_peak"] is not None
  ]
  if saves:
    titles = {t: i["title"] for t, i in results["targets"].items()}
    per_target = []
    for target in dict.fromkeys(r["target"] for r in saves):
      mine = {
        r["k"]: r["jaxaccum_peak"] - r["streamed_peak"]
        for r in saves
        if r["target"] == target
      }
      per_target.append(f"{_by_k(mine, mib)} on the {titles.get(target, target)}")
    text += (
      " Against the in-device step, streaming the large MLP's "
      f"{mib(saves[0]['batch_bytes'])} MiB batch saves (MiB; negative: costs) "
      + "; ".join(per_target)
      + "."
    )
  return text


def _accelerator_checks_bullet(results: Results) -> str:
  counts: dict[str, list[int]] = {}
  for r in results["rows"]:
    for name, check in r.get("checks", {}).items():
      if check["pass"] is None:
        continue
      counts.setdefault(name, [0, 0])[0 if check["pass"] else 1] += 1
  if not counts:
    return ""
  return (
    "**The script's targets** (passed / missed over the rows): "
    + listing([f"`{name}` {p} / {m}" for name, (p, m) in counts.items()])
    + "."
  )


# ---------------------------------------------------------------- input pipelines

PIPELINE_STEPS = {
  "resident": "batches already in device memory, cycled",
  "grain_batches_source": "Grain, whole shuffled batches as the source, per-batch augmentation",
  "python_loop": "a synchronous Python loop (numpy shuffle and augmentation, `device_put`)",
  "grain": "Grain, rows as the source (Grain batches them), per-batch augmentation",
  "grain_default_read_threads": "the same with Grain's default read options",
  "grain_1w": "the same with 1 worker process (`mp_prefetch`)",
  "grain_2w": "the same with 2 worker processes",
  "grain_per_example_0w": "Grain, rows, per-example augmentation, no workers",
  "grain_per_example_1w": "the same with 1 worker process",
  "grain_per_example_2w": "the same with 2 worker processes",
  "resident_loss_every_step": "resident batches, the loss read (`float(loss)`) after every step",
  "python_loop_loss_every_step": "the Python loop, the loss read after every step",
}
PIPELINE_ALONE = {
  "batches_per_batch": "whole batches, per-batch augmentation",
  "rows_no_augment": "rows, no augmentation",
  "rows_per_batch": "rows, per-batch augmentation",
  "rows_per_example_0w": "rows, per-example augmentation, no workers",
  "rows_per_example_1w": "the same with 1 worker process",
  "rows_per_example_2w": "the same with 2 worker processes",
}


@block("input_pipeline machine")
def input_pipeline_machine(runs: Results) -> str:
  parts = []
  for placement, r in runs.items():
    parts.append(f"`{r['command']}` ({placement}: {date(r['date'])})")
  first = next(iter(runs.values()))
  return (
    f"Measured on a {first['machine']}, jax "
    f"{first['jax']}, with " + listing(parts) + f": {first['steps']} training "
    f"steps of {first['batch_size']} images as {first['num_micro_batches']} "
    "micro-batches, then each feeding timed from fresh parameters."
  )


@block("input_pipeline steps")
def input_pipeline_steps(runs: Results) -> str:
  placements = list(runs)
  rows = []
  for key, label in PIPELINE_STEPS.items():
    if not all(key in r["steps_per_s"] for r in runs.values()):
      continue
    rows.append([label, *(f"{r['steps_per_s'][key]:.0f}" for r in runs.values())])
  header = ["fed from", *(f"steps/s, batch in `{p}` memory" for p in placements)]
  return table(header, rows)


@block("input_pipeline alone")
def input_pipeline_alone(runs: Results) -> str:
  placements = list(runs)
  rows = []
  for key, label in PIPELINE_ALONE.items():
    if not all(key in r["batches_per_s"] for r in runs.values()):
      continue
    rows.append(
      [
        label,
        *(f"{r['batches_per_s'][key]:,.0f}" for r in runs.values()),
        *(f"{1e3 * r['first_batch_s'][key]:,.0f}" for r in runs.values()),
      ]
    )
  header = [
    "pipeline alone",
    *(f"batches/s ({p} run)" for p in placements),
    *(f"ms to the first batch ({p} run)" for p in placements),
  ]
  return table(header, rows)


@block("input_pipeline summary")
def input_pipeline_summary(runs: Results) -> str:
  def each(fn: Callable[[Results], float], fmt: str = "{:.2f}") -> str:
    return " / ".join(fmt.format(fn(r)) for r in runs.values())

  def s(r: Results, key: str) -> float:
    return r["steps_per_s"][key]

  def b(r: Results, key: str) -> float:
    return r["batches_per_s"][key]

  order = " / ".join(runs)
  bullets = [
    "**A loader that keeps up costs little.** Whole-batch sources from Grain "
    "and the plain loop run at "
    + each(lambda r: s(r, "grain_batches_source") / s(r, "resident"))
    + " and "
    + each(lambda r: s(r, "python_loop") / s(r, "resident"))
    + f" × the speed of resident data ({order}). The step takes "
    + each(lambda r: 1e3 / s(r, "resident"), "{:.0f}")
    + " ms and a whole batch "
    + each(lambda r: 1e3 / b(r, "batches_per_batch"), "{:.1f}")
    + " ms to build.",
    "**Transform batches, not examples.** Per-example augmentation makes the "
    "pipeline alone "
    + each(lambda r: b(r, "rows_per_batch") / b(r, "rows_per_example_0w"), "{:.1f}")
    + " × slower than per-batch augmentation, and the training "
    + each(lambda r: s(r, "grain") / s(r, "grain_per_example_0w"))
    + " × slower.",
    "**Workers and threads help only when cores are free.** With nothing "
    "training, 2 worker processes make the per-example pipeline "
    + each(lambda r: b(r, "rows_per_example_2w") / b(r, "rows_per_example_0w"))
    + " × faster (after "
    + each(lambda r: r["first_batch_s"]["rows_per_example_2w"], "{:.1f}")
    + " s to start them); while the step runs, they make per-example training "
    + each(lambda r: s(r, "grain_per_example_2w") / s(r, "grain_per_example_0w"))
    + " × as fast, and Grain's default read threads make the row pipeline "
    + each(lambda r: s(r, "grain_default_read_threads") / s(r, "grain"))
    + " × as fast as no threads.",
    "**Keep the dispatch asynchronous.** Reading the loss after every step "
    "runs the Python loop at "
    + each(lambda r: s(r, "python_loop_loss_every_step") / s(r, "python_loop"))
    + " × and resident data at "
    + each(lambda r: s(r, "resident_loss_every_step") / s(r, "resident"))
    + " × its speed with the loss read every few steps.",
    "**Host placement.** The test accuracy after training is "
    + each(lambda r: r["test_accuracy"], "{:.3f}")
    + f" ({order}), the final training loss "
    + each(lambda r: r["final_loss"], "{:.4f}")
    + ", and training runs at "
    + each(lambda r: r["train_steps_per_s"], "{:.0f}")
    + " steps/s.",
  ]
  return _bullets(bullets)


# ---------------------------------------------------------------- autopilot


@block("autopilot table")
def autopilot_table(results: Results) -> str:
  parts = [
    f"Run on {results.get('date', '?')} ({results.get('machine', '?')}, "
    f"{results.get('backend', '?')} backend), jax {results.get('jax', '?')}, seeds "
    f"{', '.join(map(str, results.get('seeds', [])))}: the held-out loss after the "
    "whole budget (mean ± standard deviation over the seeds)."
  ]
  for task, result in results["tasks"].items():
    unit = result.get("token_unit", "tokens")
    rows = [
      [
        f"`{name}`",
        f"{r['final_loss_mean']:.4f} ± {r['final_loss_std']:.4f}",
        count(r["optimizer_steps"]),
        count(r["tokens"]),
      ]
      for name, r in result["runs"].items()
    ]
    text = f"**{task}**:\n\n" + table(
      ["run", "held-out loss", "optimizer steps", unit], rows
    )
    g = result.get("goal")
    if g:
      text += (
        "\n\nThe autopilot against `fixed_small`: loss "
        f"{g['loss_gap_to_small']:+.4f} (tolerance {g['loss_tolerance']:.4f}), "
        f"{g['steps_ratio']:.2f} × its optimizer steps (target at most "
        f"{g['steps_ratio_target']:g}); it "
        + ("beats" if g["beats_fixed_large"] else "does not beat")
        + " `fixed_large` and "
        + ("beats" if g["beats_hand_ramp"] else "does not beat")
        + " `hand_ramp`. The goal (both within the tolerance and the steps "
        "target) is " + _met(g["met"]) + "."
      )
    parts.append(text)
  parts.append(
    "![held-out loss against tokens and steps, and k](results/autopilot.png)"
  )
  return "\n\n".join(parts)


# ---------------------------------------------------------------- README.md


@block("readme_commands times", page="readme")
def readme_commands_times(results: Results) -> str:
  runs, m = results["runs"], results["machine"]

  def one(name: str, what: str) -> str:
    r = runs[name]
    outcome = "" if r["returncode"] == 0 else f", **exit {r['returncode']}**"
    return (
      f"{what} took {r['seconds'] / 60:.0f} min and made a "
      f"{r['venv_bytes'] / 2**30:.1f} GiB `.venv`{outcome}"
    )

  plugin = sum(len(r["plugin_error_lines"]) for r in runs.values())
  return (
    f"Measured by `python benchmarks/readme_commands.py` on {results['date']}, "
    "each in a fresh clone, on a "
    f"{m['cores']}-core {m['cpu']} (Python {m['python']}) with the wheels "
    "already in pip's cache (a first install also downloads them): "
    + one("demo", "the demo")
    + "; "
    + one("tests", "the tests")
    + f" (`{runs['tests']['last_line'].strip('= ')}`). The demo run again in the "
    "tests' venv took "
    f"{runs['demo_after_tests']['seconds'] / 60:.0f} min."
    + ("" if not plugin else f" A CUDA or TPU plugin printed {plugin} error lines.")
  )


@block("autopilot summary", page="guide")
def autopilot_summary(results: Results) -> str:
  lines = []
  for task, result in results["tasks"].items():
    g = result.get("goal")
    if not g:
      continue
    runs = result["runs"]
    lines.append(
      f"**{task}**: the autopilot reached a held-out loss of "
      f"{runs['autopilot']['final_loss_mean']:.3f} against "
      f"{runs['fixed_small']['final_loss_mean']:.3f} for the small fixed batch, "
      f"in {g['steps_ratio']:.2f} × its optimizer steps at equal "
      f"{result.get('token_unit', 'tokens')}."
    )
  return (
    f"On {listing(list(results['tasks']))}, {len(results.get('seeds', []))} "
    "seeds each, from `examples/autopilot.py`:\n\n"
    + _bullets(lines)
    + "\n\n![held-out loss against tokens and steps, and k for each schedule]"
    "(../benchmarks/results/autopilot.png)"
    + "\n\nThe four schedules, how they are compared and the goal each "
    "run is held to: "
    "[benchmarks/README.md](../benchmarks/README.md#the-batch-size-autopilot-examplesautopilotpy)."
  )


# ---------------------------------------------------------------- rendering

#: Benchmarks that render their own blocks (one file measures and renders):
#: the JSON stem -> the script in this folder whose ``BLOCKS`` maps each block
#: name to its writer. Registered on first use (importing them imports jax).
SELF_RENDERED = {"pipeline": "pipeline", "maxtext_llama": "maxtext_llama"}


def _register_self_rendered() -> None:
  import importlib.util  # noqa: PLC0415

  for stem, script in SELF_RENDERED.items():
    if any(name.split()[0] == stem for name in BLOCKS):
      continue
    spec = importlib.util.spec_from_file_location(
      f"_bench_{script}", HERE / f"{script}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    for name, writer in module.BLOCKS.items():
      block(name)(writer)


#: Blocks whose data is several JSON files, and their stems.
MULTI_SOURCES = {
  "input_pipeline": {
    "device": "input_pipeline_device",
    "pinned_host": "input_pipeline_pinned_host",
  },
}
COMMANDS = {
  "step_time": "python benchmarks/step_time.py",
  "eager_calls": "python benchmarks/eager_calls.py",
  "communication": "python benchmarks/communication.py",
  "meshes": "python benchmarks/meshes.py",
  "fsdp": "python benchmarks/fsdp.py",
  "accelerator_memory": "python benchmarks/accelerator_memory.py",
  "input_pipeline": "python examples/input_pipeline.py",
  "autopilot": "python examples/autopilot.py --write-results",
  "readme_commands": "python benchmarks/readme_commands.py",
  "dp": "python benchmarks/dp.py",
  "pipeline": "python benchmarks/pipeline.py",
  "maxtext_llama": "python benchmarks/maxtext_llama.py",
}
_MARKERS = re.compile(
  r"(<!-- begin: (?P<name>[\w\-]+ [\w\-]+) -->\n)(?P<body>.*?)(<!-- end: (?P=name) -->)",
  re.DOTALL,
)


def load(source: str, results_dir: pathlib.Path) -> Results | None:
  """The JSON of ``source`` (a stem of ``results_dir``), or None if absent."""
  if source in MULTI_SOURCES:
    runs = {}
    for key, stem in MULTI_SOURCES[source].items():
      path = results_dir / f"{stem}.json"
      if path.exists():
        runs[key] = json.loads(path.read_text())
    return runs or None
  path = results_dir / f"{source}.json"
  return json.loads(path.read_text()) if path.exists() else None


def write_block(name: str, results_dir: pathlib.Path = RESULTS) -> str:
  """The text of block ``name`` from the JSON in ``results_dir``."""
  _register_self_rendered()
  source = name.split(maxsplit=1)[0]
  data = load(source, results_dir)
  if data is None:
    return (
      f"_No results yet: `benchmarks/results/{source}.json` does not exist. "
      f"`{COMMANDS.get(source, source)}` writes it._"
    )
  return BLOCKS[name](data).strip("\n")


def render(
  text: str, results_dir: pathlib.Path = RESULTS, page: str = "benchmarks"
) -> str:
  """``text`` (the page ``page``) with every generated block rewritten from
  ``results_dir``.

  Raises:
    ValueError: for a block name :data:`BLOCKS` does not know or that
      belongs to another page, or a block of the page that the text lacks.
  """
  _register_self_rendered()
  found = [m.group("name") for m in _MARKERS.finditer(text)]
  mine = {name for name, p in PAGE_OF.items() if p == page}
  unknown = sorted(set(found) - mine)
  missing = sorted(mine - set(found))
  if unknown or missing:
    raise ValueError(
      f"{page}: blocks not written there by _report.py: {unknown}; "
      f"blocks missing: {missing}"
    )

  def replace(m: re.Match[str]) -> str:
    body = write_block(m.group("name"), results_dir)
    return f"{m.group(1)}\n{body}\n\n{m.group(4)}"

  return _MARKERS.sub(replace, text)


#: Benchmarks that write their own blocks: importing one registers them
#: (``@_report.block``), next to the code that measures what they show.
OWN_BLOCKS = ("dp",)


def _import_own_blocks() -> None:
  sys.modules.setdefault("_report", sys.modules[__name__])
  for stem in OWN_BLOCKS:
    if stem in sys.modules or f"{stem} memory" in BLOCKS:
      continue
    spec = importlib.util.spec_from_file_location(stem, HERE / f"{stem}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[stem] = module
    spec.loader.exec_module(module)


def main(argv: Sequence[str] | None = None) -> int:
  """Rewrites the pages (or, with ``--check``, diffs them); the exit code."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--check",
    action="store_true",
    help="write nothing; exit 1 and print a diff if a page is stale",
  )
  parser.add_argument("--results", type=pathlib.Path, default=RESULTS)
  args = parser.parse_args(argv)
  stale = False
  for page, path in PAGES.items():
    old = path.read_text()
    new = render(old, args.results, page)
    if old == new:
      print(f"{path}: up to date")
    elif args.check:
      sys.stdout.writelines(
        difflib.unified_diff(
          old.splitlines(keepends=True),
          new.splitlines(keepends=True),
          f"{path} (committed)",
          f"{path} (from {args.results})",
        )
      )
      print(f"\n{path} is stale: run `python benchmarks/_report.py`.")
      stale = True
    else:
      path.write_text(new)
      print(f"{path}: rewritten from {args.results}")
  return 1 if stale else 0


sys.path.insert(0, str(HERE))  # the benchmarks import each other by name
_import_own_blocks()

if __name__ == "__main__":
  sys.exit(main())
