"""Text tables and matplotlib plots of ``step_time.py``'s results."""

from __future__ import annotations

import pathlib
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def format_bytes(n: float) -> str:
  """Bytes in binary units, e.g. ``1.5 MiB``."""
  for unit in ("B", "KiB", "MiB", "GiB"):
    if abs(n) < 1024 or unit == "GiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
    n /= 1024
  raise AssertionError("unreachable")


def _mark(ok: bool | None) -> str:
  return "n/a" if ok is None else ("PASS" if ok else "MISS")


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
