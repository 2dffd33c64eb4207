"""Accelerator memory of jaxaccum and its peers, measured without an accelerator.

Compile-only (the ``targets`` extra): per target, model and ``k``, one Adam
step of each column of :func:`measure_row`, held to :func:`checks`; ``NOTES``
says how each backend's memory analysis reads. Outputs
``accelerator_memory[_quick].json`` and ``.png`` in ``--out``, and the rows
as the output's last lines. ``--causes`` compiles instead the control steps
of :func:`measure_causes` into ``accelerator_memory_causes.json``;
``--causes --live-peaks`` adds :func:`live_peaks` to it.
"""

from __future__ import annotations

import os

# Before JAX starts: without a GPU, the CUDA plugin must not try to start one
# (it would fail and not register its compiler).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import datetime
import functools
import itertools
import json
import pathlib
import platform
import re
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from typing import Any

import _approaches
import _compile
import _models
import _paths
import jax
import jaxlib
import optax
from _report import command_line, date, k_axis, mib, pyplot, ratio, table

import jaxaccum
from jaxaccum import testing

PyTree = Any

DEFAULT_KS = (1, 2, 4, 8, 16)
QUICK_KS = (1, 4)
MODEL_NAMES = ("dispatch_mlp", "compute_mlp", "transformer")
BOUND_TARGET = 1.05  # jaxaccum's peak at most 1.05 x its bound (checks)

NOTES = {
  "peaks": "per device: argument + output + temp - alias, device memory only "
  "(jaxaccum.MemoryStats.peak_bytes; a pinned_host batch is not in it)",
  "tpu": "XLA's TPU analysis reports temp 0 for many programs and counts host "
  "memory in its peak: the TPU peak is XLA's peak less host memory; a step "
  "beyond the chip's HBM is refused at compile time (null)",
  "h100": "a GPU target lowers on CPU stand-ins (the compile-only GPU devices "
  "have no memory kinds) and compiles with the compile-only GPU client",
  "bound": "full-batch step compiled at B/k rows + float32 accumulator + the "
  "other B - B/k rows of the batch",
  "streamed_peak_2x": "the streamed step at batch 2B, 2k micro-batches",
  "optimizer": "optax.adam(1e-3); params and optimizer state donated",
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  """The command line."""
  parser = _paths.parser(
    __doc__,
    quick="small models, k in 1,4",
    ks="comma-separated k (default 1,2,4,8,16)",
    targets=True,
  )
  parser.add_argument("--models", type=_paths.names, default=list(MODEL_NAMES))
  parser.add_argument(
    "--preset",
    choices=sorted(_models.PRESETS),
    help="model sizes (default gpu, quick: cpu-quick)",
  )
  parser.add_argument(
    "--dtype",
    choices=("float32", "bfloat16"),
    default="bfloat16",
    help="the transformer's parameter and compute dtype (the MLPs stay float32)",
  )
  parser.add_argument("--no-plots", action="store_true")
  parser.add_argument(
    "--causes",
    action="store_true",
    help="compile the control steps of the rows that miss (see above) instead",
  )
  parser.add_argument(
    "--live-peaks",
    action="store_true",
    help="with --causes: only the small MLP's live bytes at the peak (XLA's dump)",
  )
  parser.add_argument("--live-peak-of", help=argparse.SUPPRESS)  # a child's step
  parser.add_argument(
    "--fp8",
    action="store_true",
    help="only the FP8 row (H100, the transformer with FP8 dense layers), "
    "added to the existing accelerator_memory.json",
  )
  return parser.parse_args(argv)


def measure(
  step: Any, args: Sequence[Any], target: jaxaccum.CompileTarget
) -> dict[str, Any]:
  """Compiles ``step(*args)`` for ``target``: its device peak, or why not."""
  start = time.perf_counter()
  try:
    stats = jaxaccum.compiled_memory(step, *args, target=target)
  except Exception as e:  # reported; the sweep goes on
    error = _compile.error(e)
    return {"peak": None, "error": error, "compile_s": time.perf_counter() - start}
  return {
    "peak": stats.peak_bytes,
    "host_bytes": stats.host_bytes,
    "compile_s": time.perf_counter() - start,
  }


def measure_row(
  *,
  target: jaxaccum.CompileTarget,
  model: Any,
  doubled: Any,
  tx: optax.GradientTransformation,
  k: int,
  full: dict[str, Any],
) -> dict[str, Any]:
  """Every column of one (target, model, k) row; ``full``: the full-batch step's
  ``measure`` (the same for every ``k``)."""
  params, batch = model.params, model.batch
  state = jax.eval_shape(tx.init, params)
  size = model.batch_size
  micro = size // k
  batch_bytes = _approaches.tree_bytes(batch)
  micro_batch, accumulator, rest = _approaches.bound_terms(params, batch, k)
  full_step = _approaches.full_batch_step(model.loss, tx)
  accum_step = _approaches.JaxAccum(model, tx, k).fn
  on_host = target.place(batch, memory_kind="pinned_host")
  doubled_on_host = target.place(doubled.batch, memory_kind="pinned_host")
  results = {
    "full": full,
    "micro_step": measure(full_step, (params, state, micro_batch), target),
    "jaxaccum": measure(accum_step, (params, state, batch), target),
    "streamed": measure(accum_step, (params, state, on_host), target),
    "streamed_2x": measure(
      _approaches.JaxAccum(doubled, tx, 2 * k).fn,
      (params, state, doubled_on_host),
      target,
    ),
    "microbatch": measure(
      _approaches.OptaxMicrobatch(model, tx, k).fn, (params, state, batch), target
    ),
  }
  micro_peak = results["micro_step"]["peak"]
  row = {
    "target": target.name,
    "model": model.name,
    "k": k,
    "batch_size": size,
    "micro_batch_size": micro,
    "batch_bytes": batch_bytes,
    "micro_batch_bytes": batch_bytes // k,
    "param_bytes": _approaches.tree_bytes(params),
    "full_peak": results["full"]["peak"],
    "bound": None if micro_peak is None else micro_peak + accumulator + rest,
    "jaxaccum_peak": results["jaxaccum"]["peak"],
    "streamed_peak": results["streamed"]["peak"],
    "streamed_peak_2x": results["streamed_2x"]["peak"],
    "streamed_host_bytes": results["streamed"].get("host_bytes"),
    "microbatch_peak": results["microbatch"]["peak"],
    "compile_s": round(
      sum(r["compile_s"] for name, r in results.items() if name != "full"), 2
    ),
    "errors": {name: r["error"] for name, r in results.items() if "error" in r},
  }
  row["checks"] = checks(row)
  return row


def checks(row: dict[str, Any]) -> dict[str, dict[str, Any]]:
  """The three targets of one row: value, threshold, pass (None: n/a)."""

  def check(value: float | None = None, ok: bool | None = None) -> dict[str, Any]:
    return {"value": value, "pass": ok}

  peak, bound = row["jaxaccum_peak"], row["bound"]
  streamed, doubled = row["streamed_peak"], row["streamed_peak_2x"]
  need = 0.9 * (row["batch_bytes"] - row["micro_batch_bytes"])
  out = {"peak <= 1.05 x bound": check()}
  if peak is not None and bound is not None:
    out["peak <= 1.05 x bound"] = check(peak / bound, peak <= BOUND_TARGET * bound)
  # k=1 holds the whole batch, and 2k=2 streams: neither is comparable
  unknown = None if row["k"] < 2 else False
  saves, within = check(ok=unknown), check(ok=unknown)
  if row["k"] >= 2 and streamed is not None and peak is not None:
    saved = peak - streamed
    saves = check(saved / need if need else None, saved >= need)
  if row["k"] >= 2 and streamed is not None and doubled is not None:
    growth = doubled / streamed - 1
    within = check(growth, abs(growth) <= 0.02)
  out["streamed saves 0.9 x (batch - micro)"] = saves
  out["streamed within 2% at 2x batch"] = within
  return out


def plot(rows: list[dict[str, Any]], path: pathlib.Path, title: str) -> None:
  """One panel per (target, model): device peak against k, a line per column."""
  plt = pyplot()
  targets = list(dict.fromkeys(r["target"] for r in rows))
  models = list(dict.fromkeys(r["model"] for r in rows))
  fig, axes = plt.subplots(
    len(targets),
    len(models),
    figsize=(4.6 * len(models), 3.8 * len(targets)),
    squeeze=False,
  )
  columns = (
    ("full_peak", "full batch", "C0-o"),
    ("bound", "bound", "k--"),
    ("jaxaccum_peak", "jaxaccum", "C1-o"),
    ("streamed_peak", "jaxaccum, host batch", "C2-o"),
    ("microbatch_peak", "optax.microbatch", "C3-o"),
    ("batch_bytes", "the batch", "C7:"),
  )
  for i, target in enumerate(targets):
    for j, model in enumerate(models):
      ax = axes[i][j]
      mine = [r for r in rows if r["target"] == target and r["model"] == model]
      ks = [r["k"] for r in mine]
      for key, label, style in columns:
        points = [(r["k"], r[key] / 2**20) for r in mine if r[key] is not None]
        if points:
          ax.plot(*zip(*points, strict=True), style, label=label, markersize=4)
      k_axis(ax, ks, "device peak, MiB", xlabel="micro-batches k", logy=True)
      ax.set_title(f"{target}: {model}", fontsize=10)
  axes[0][0].legend(fontsize=7)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


# ---------------------------------------------------------------- the causes

CAUSE_MODELS = ("dispatch_mlp", "compute_mlp")
SMALL_SCAN_K = 16  # the small MLP's row above its bound on the TPU v5e


def scan_steps(
  name: str, preset: str, dtype: str, k: int
) -> tuple[dict[str, Any], tuple]:
  """Model ``name``'s jaxaccum step at ``k``, the same without its finite
  check, and a ``lax.scan`` written without jaxaccum
  (``_approaches.hand_scan``), all Adam steps jitted and donated; and their
  arguments."""
  tx = optax.adam(1e-3)
  model = _models.abstract(name, preset, dtype)
  args = (model.params, jax.eval_shape(tx.init, model.params), model.batch)
  steps = {
    "jaxaccum_peak": _approaches.JaxAccum(model, tx, k).fn,
    "no_skip_peak": _approaches.JaxAccumNoSkip(model, tx, k).fn,
    "scan_peak": _approaches.train_step(_approaches.hand_scan(model.loss, k), tx),
  }
  return steps, args


def measure_causes(preset: str, dtype: str, ks: Sequence[int]) -> dict[str, Any]:
  """The control steps on the TPU v5e (see the module's docstring)."""
  tpu = jaxaccum.compile_target("tpu-v5e")
  tx = optax.adam(1e-3)
  k1 = []
  for model_preset in dict.fromkeys(("cpu-quick", preset)):
    for name in CAUSE_MODELS:
      model = _models.abstract(name, model_preset, dtype)
      args = (model.params, jax.eval_shape(tx.init, model.params), model.batch)
      steps = {
        "full_peak": _approaches.full_batch_step(model.loss, tx),
        "jaxaccum_peak": _approaches.JaxAccum(model, tx, 1).fn,
        "no_skip_peak": _approaches.JaxAccumNoSkip(model, tx, 1).fn,
        "select_peak": _approaches.full_batch_select_step(model.loss, tx),
      }
      row = {"preset": model_preset, "model": name}
      row |= {key: measure(step, args, tpu)["peak"] for key, step in steps.items()}
      k1.append(row)
      print(json.dumps(row), file=sys.stderr, flush=True)
  model = _models.abstract("compute_mlp", preset, dtype)
  small = _models.abstract("dispatch_mlp", preset, dtype)
  small_k = max(k for k in (*ks, SMALL_SCAN_K) if small.batch_size % k == 0)
  scan = []
  for name, k in [
    *(("compute_mlp", k) for k in ks if k >= 2 and model.batch_size % k == 0),
    ("dispatch_mlp", small_k),
  ]:
    steps, args = scan_steps(name, preset, dtype, k)
    row = {"k": k} | {key: measure(s, args, tpu)["peak"] for key, s in steps.items()}
    scan.append(row)
    print(json.dumps(row), file=sys.stderr, flush=True)
  *scan, small_scan = scan
  return {
    "target": {"name": tpu.name, "title": tpu.title},
    "preset": preset,
    "model": model.config.describe(),
    "param_bytes": _approaches.tree_bytes(model.params),
    "batch_bytes": {
      key: _approaches.tree_bytes(leaf) for key, leaf in model.batch.items()
    },
    "k1": k1,
    "scan": scan,
    "small_scan": small_scan,
  }


# ---------------------------------------------------------------- the manual's blocks


ACCELERATOR_MODELS = {
  "compute_mlp": "large MLP",
  "transformer": "transformer",
  "dispatch_mlp": "small MLP",
}
ACCELERATOR_PEAKS = (
  "full_peak",
  "bound",
  "jaxaccum_peak",
  "streamed_peak",
  "streamed_peak_2x",
  "microbatch_peak",
)
SAVES = "streamed saves 0.9 x (batch - micro)"


def _accelerator_table(results: dict[str, Any], target: str) -> str:
  """Per model and k, each peak in MiB (KiB for a model whose peaks stay
  below 16 MiB), jaxaccum's also over its bound."""
  title = results["targets"][target]["title"]
  rows = []
  for model, model_name in ACCELERATOR_MODELS.items():
    mine = [r for r in results["rows"] if (r["target"], r["model"]) == (target, model)]
    peaks = [r[key] for r in mine for key in ACCELERATOR_PEAKS if r[key] is not None]
    unit, scale = (
      ("MiB", 2**20) if max(peaks, default=2**30) >= 16 * 2**20 else ("KiB", 2**10)
    )
    for r in mine:
      cells = [
        "refused" if r[key] is None else f"{r[key] / scale:,.0f}"
        for key in ACCELERATOR_PEAKS
      ]
      if r["jaxaccum_peak"] is not None and r["bound"]:
        cells[2] += f" ({ratio(r['jaxaccum_peak'] / r['bound'])})"
      rows.append([f"{model_name}, {unit}", r["k"], *cells])
  header = ["model", "k", "full batch", "bound", "jaxaccum (× bound)", "streamed"]
  header += ["streamed, 2× batch", "optax.microbatch"]
  return f"**{title}**, per device:\n\n" + table(header, rows)


def accelerator_memory_machine(results: dict[str, Any]) -> str:
  m, s = results["machine"], results["settings"]
  command = "python benchmarks/accelerator_memory.py"
  commands = [command_line(command, part["argv"]) for part in m.get("parts", [])]
  commands = commands or [command_line(command, m.get("argv"))]
  rows = [
    [
      name,
      " → ".join(map(str, c["widths"])) if c["kind"] == "mlp" else "–",
      "–" if c["kind"] == "mlp" else f"{c['num_layers']} × d_model {c['d_model']}",
      f"{c['batch_size']:,}" + ("" if c["kind"] == "mlp" else f" × {c['seq_len']:,}"),
      "float32" if c["kind"] == "mlp" else c.get("dtype", s["dtype"]),
    ]
    for key, name in ACCELERATOR_MODELS.items()
    if (c := results["models"].get(key))
  ]
  return "\n\n".join(
    [
      table(
        ["compiled", "commands", "jax", "preset", "k", "compiling, s"],
        [
          [
            date(m["date"]),
            "; ".join(f"`{c}`" for c in commands),
            m["jax"],
            f"`{s['preset']}`",
            ", ".join(map(str, s["ks"])),
            f"{m['wall_s']:,.0f}",
          ]
        ],
      ),
      table(["model", "widths", "layers", "batch", "dtype"], rows),
    ]
  )


def accelerator_memory_summary(results: dict[str, Any]) -> str:
  """The script's checks, passed and missed over each target's rows."""
  counts: dict[tuple[str, str], list[int]] = {}
  for r in results["rows"]:
    for name, check in r.get("checks", {}).items():
      if check["pass"] is not None:
        counts.setdefault((r["target"], name), [0, 0])[0 if check["pass"] else 1] += 1
  rows = [
    [results["targets"][target]["title"], f"`{name}`", passed, missed]
    for (target, name), (passed, missed) in counts.items()
  ]
  return table(["target", "check", "passed", "missed"], rows)


def size(n: float) -> str:
  """``n`` bytes in KiB, or in MiB from 16 MiB on."""
  return f"{mib(n)} MiB" if abs(n) >= 16 * 2**20 else f"{n / 2**10:,.0f} KiB"


def _sweep_row(sweep: dict[str, Any] | None, model: str, k: int) -> Any:
  """The TPU v5e row of ``model`` at ``k`` in the sweep, or None."""
  rows = (sweep or {}).get("rows", [])
  key = ("tpu-v5e", model, k)
  return next((r for r in rows if (r["target"], r["model"], r["k"]) == key), None)


def accelerator_causes_rows(results: dict[str, Any]) -> str:
  """The control steps of ``--causes`` (on the TPU v5e) and the streamed
  rows short of their target, a table each."""
  sweep, causes = results.get("sweep"), results.get("causes")
  parts = []
  if causes:
    parts += [
      _k1_table(causes),
      _scan_table(causes, sweep),
      _small_table(causes, sweep),
    ]
  if sweep:
    parts.append(_streaming_table(sweep))
  return "\n\n".join(parts)


def _k1_table(causes: dict[str, Any]) -> str:
  """k = 1: each step's peak less the full-batch step's (over its peak)."""
  keys = {"jaxaccum_peak": "jaxaccum", "no_skip_peak": "`skip_nonfinite=False`"}
  keys |= {"select_peak": "the select by hand", "barrier_peak": "with the barrier"}
  rows = []
  for r in causes["k1"]:
    if None in (r["jaxaccum_peak"], r["full_peak"]):
      continue
    cells = [
      f"{size(r[key] - r['full_peak'])} ({ratio(r[key] / r['full_peak'])})"
      if r.get(key) is not None
      else "–"
      for key in keys
    ]
    name = f"{ACCELERATOR_MODELS[r['model']]} of `{r['preset']}`"
    rows.append([name, size(r["full_peak"]), *cells])
  head = f"**k = 1 on the {causes['target']['title']}**, less the full-batch step:"
  return head + "\n\n" + table(["model", "full batch", *keys.values()], rows)


def _scan_table(causes: dict[str, Any], sweep: dict[str, Any] | None) -> str:
  """The large MLP: jaxaccum's step over a hand-written scan's and over its
  bound, and the bfloat16 copies the TPU compiler hoists out of the loop."""
  widths = causes["model"]["widths"]
  weights = sum(a * b for a, b in itertools.pairwise(widths)) * 4 // 2
  inputs = causes["batch_bytes"]["x"] // 2
  rows = []
  for r in causes["scan"]:
    if not (r["jaxaccum_peak"] and r["scan_peak"]):
      continue
    row = _sweep_row(sweep, "compute_mlp", r["k"])
    bound = row["bound"] if row and row["bound"] else None
    rows.append(
      [
        r["k"],
        mib(r["jaxaccum_peak"] - r["scan_peak"]),
        mib(r["no_skip_peak"] - r["scan_peak"]),
        "–" if bound is None else mib(r["jaxaccum_peak"] - bound),
        f"{mib(weights)} + {mib(inputs)} = {mib(weights + inputs)}",
      ]
    )
  header = ["k", "jaxaccum − scan", "`skip_nonfinite=False` − scan"]
  header += ["jaxaccum − bound", "bfloat16 weights + inputs"]
  head = f"**The large MLP on the {causes['target']['title']}**, MiB:"
  return head + "\n\n" + table(header, rows)


def _small_table(causes: dict[str, Any], sweep: dict[str, Any] | None) -> str:
  """The small MLP at its k: the peaks, the bound and the bytes live at
  each program's peak (``--causes --live-peaks``)."""
  r = causes.get("small_scan")
  if not r or None in (r["jaxaccum_peak"], r["scan_peak"]):
    return ""
  row = _sweep_row(sweep, "dispatch_mlp", r["k"])
  live = r.get("live_peak_bytes", {})
  steps = ("jaxaccum_peak", "no_skip_peak", "scan_peak")
  cells = [
    f"{r[key]:,} / " + (f"{live[key]:,}" if key in live else "–") for key in steps
  ]
  bound = f"{row['bound']:,}" if row and row["bound"] else "–"
  header = ["k", "jaxaccum", "`skip_nonfinite=False`", "hand-written scan", "bound"]
  head = (
    f"**The small MLP on the {causes['target']['title']}**, bytes: the peak / "
    "the bytes live at it:"
  )
  return head + "\n\n" + table(header, [[r["k"], *cells, bound]])


def _streaming_table(sweep: dict[str, Any]) -> str:
  """The rows whose streamed step saves less than 0.9 x (batch - one
  micro-batch): what it saved, what that is, and, for the large MLP, the
  batch less one micro-batch and one float32 activation of its widest
  layer."""
  rows = []
  for r in sweep["rows"]:
    if r["k"] < 2 or r["checks"][SAVES]["pass"] is not False:
      continue
    if None in (r["jaxaccum_peak"], r["streamed_peak"]):
      continue
    rest = r["batch_bytes"] - r["micro_batch_bytes"]
    widths = sweep["models"][r["model"]].get("widths")
    activation = r["micro_batch_size"] * max(widths[1:-1]) * 4 if widths else None
    rows.append(
      [
        sweep["targets"][r["target"]]["title"],
        ACCELERATOR_MODELS[r["model"]],
        r["k"],
        size(r["jaxaccum_peak"] - r["streamed_peak"]),
        size(0.9 * rest),
        size(rest - activation) if r["target"] == "h100" and activation else "–",
      ]
    )
  header = ["target", "model", "k", "saved", "0.9 × (batch − micro)"]
  header += ["batch − micro − one activation"]
  return "**Streamed rows short of their target:**\n\n" + table(header, rows)


# ---------------------------------------------------------------- the FP8 row

FP8_K = 4
OWG = "_overwrite_with_gradient"  # Flax's FP8 metadata collection


def fp8_full_step(loss: Any, tx: optax.GradientTransformation) -> Any:
  """The full-batch step as ``TrainState.apply_gradients`` takes it: ``tx``
  on ``params``, the FP8 metadata overwritten by its "gradient"."""

  def step(variables, opt_state, batch):
    grads = jax.grad(loss)(variables, batch)
    updates, opt_state = tx.update(grads["params"], opt_state, variables["params"])
    params = optax.apply_updates(variables["params"], updates)
    return {**variables, "params": params, OWG: grads[OWG]}, opt_state

  return jax.jit(step, donate_argnums=(0, 1))


def fp8_collectives(loss: Any, variables: Any, batch: Any) -> dict[str, Any]:
  """On 8 H100s (an Explicit data axis), each FP8 step's collectives over
  the data axis: in the loop and after it, ``mesh=``'s and plain ``jit``'s."""
  target = jaxaccum.compile_target("h100", topology="1x1x8")
  mesh = target.mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  P = jax.sharding.PartitionSpec
  placed = (
    jax.tree.map(lambda x: target.place(x, P(), mesh=mesh), variables),
    target.place(batch, P("data"), mesh=mesh),
  )
  out = {}
  for path, options in (("mesh", {"mesh": mesh, "data_axis": "data"}), ("plain", {})):
    step = jax.jit(jaxaccum.grad(loss, FP8_K, **options))
    with jax.set_mesh(mesh):
      colls = testing.collectives(testing.compiled_text(step, *placed, target=target))
    for where, inside in (("in_loop", True), ("after_loop", False)):
      mine = [c for c in colls if c.in_loop == inside]
      out[f"{path}_{where}"] = len(mine)
      out[f"{path}_{where}_bytes"] = sum(c.bytes * c.executions for c in mine)
  return out


def measure_fp8(preset: str) -> dict[str, Any]:
  """The FP8 row: one Adam step of the transformer with Flax's FP8 dense
  layers on one H100, compile-only, full batch, micro-batch and jaxaccum
  (``make_train_step`` on the Linen variables, k = :data:`FP8_K`), the bound
  as the sweep's; and its collectives on 8 (:func:`fp8_collectives`)."""
  cfg = _models.PRESETS[preset]["transformer"]
  variables, batch, loss = _models.fp8_transformer(cfg)
  tx = optax.adam(1e-3)
  state = jax.eval_shape(tx.init, variables["params"])
  size, k = batch.shape[0], FP8_K
  micro, accumulator, rest = _approaches.bound_terms(variables, batch, k)
  full = fp8_full_step(loss, tx)
  target = jaxaccum.compile_target("h100")
  steps = {
    "full_peak": (full, batch),
    "micro_peak": (full, micro),
    "jaxaccum_peak": (jaxaccum.make_train_step(loss, tx, k), batch),
  }
  row = {
    name: measure(s, (variables, state, b), target)["peak"]
    for name, (s, b) in steps.items()
  }
  row["bound"] = row["micro_peak"] + accumulator + rest
  row.update(
    target="h100", k=k, batch_size=size, seq_len=cfg.seq_len, layers=cfg.num_layers
  )
  row["d_model"] = cfg.d_model
  row["fp8_variables"] = len(jax.tree.leaves(variables[OWG]))
  return {**row, **fp8_collectives(loss, variables, batch)}


def accelerator_memory_fp8(results: dict[str, Any]) -> str:
  """The FP8 row: peaks in MiB, jaxaccum's over its bound, and the
  collectives over the data axis of 8 H100s."""
  r = results.get("fp8")
  if r is None:
    return "(not measured: `python benchmarks/accelerator_memory.py --fp8`)"
  cells = [f"{r[key] / 2**20:,.0f}" for key in ("full_peak", "bound", "jaxaccum_peak")]
  cells[2] += f" ({ratio(r['jaxaccum_peak'] / r['bound'])})"
  model = (
    f"{r['layers']} × d_model {r['d_model']}, {r['batch_size']} × {r['seq_len']:,}"
  )
  peaks = table(
    ["FP8 transformer (H100), MiB", "k", "full batch", "bound", "jaxaccum (× bound)"],
    [[model, r["k"], *cells]],
  )
  rows = [
    [
      name,
      *(
        f"{r[f'{path}_{where}']} ({r[f'{path}_{where}_bytes'] / 2**10:,.1f} KiB)"
        for where in ("in_loop", "after_loop")
      ),
    ]
    for path, name in (("mesh", "`mesh=`"), ("plain", "plain `jit`, Explicit axis"))
  ]
  return f"{peaks}\n\n" + table(
    ["8 × H100, k = 4: collectives", "in the loop (bytes per step)", "after it"], rows
  )


#: The blocks written from ``accelerator_memory.json`` (``accelerator_causes``: with
#: ``accelerator_memory_causes.json``), by name (for ``_report.py``).
BLOCKS = {
  "accelerator_memory machine": accelerator_memory_machine,
  **{
    f"accelerator_memory {target}": functools.partial(_accelerator_table, target=target)
    for target in ("h100", "tpu-v5e")
  },
  "accelerator_memory summary": accelerator_memory_summary,
  "accelerator_memory fp8": accelerator_memory_fp8,
  "accelerator_causes rows": accelerator_causes_rows,
}


def _git(*args: str) -> str:
  try:
    out = subprocess.run(
      ["git", *args], capture_output=True, text=True, check=True, timeout=10
    )
  except (OSError, subprocess.SubprocessError):
    return ""
  return out.stdout.strip()


def machine(argv: Sequence[str], wall: float) -> dict[str, Any]:
  """The versions and the commit a run measured, and how long it took."""
  return {
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "optax": optax.__version__,
    "jaxaccum": jaxaccum.__version__,
    "git_commit": _git("rev-parse", "HEAD"),
    "jaxaccum_uncommitted_changes": _git("status", "--porcelain", "jaxaccum"),
    "python": platform.python_version(),
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "argv": list(argv),
    "wall_s": round(wall, 1),
  }


def live_peaks(preset: str, dtype: str, k: int) -> dict[str, int]:
  """For each of the small MLP's :func:`scan_steps`, the bytes live at its
  program's peak by XLA's live-range dump for the TPU v5e, each compiled in
  a process of its own (``XLA_FLAGS`` are read when JAX's backends start)."""
  peaks = {}
  for name in scan_steps("dispatch_mlp", preset, dtype, k)[0]:
    with tempfile.TemporaryDirectory() as dump:
      env = {**os.environ, "XLA_FLAGS": f"--xla_dump_to={dump}"}
      command = [sys.executable, __file__, "--live-peak-of", name, "--ks", str(k)]
      command += ["--preset", preset, "--dtype", dtype]
      subprocess.run(command, env=env, check=True, capture_output=True)
      found = [
        int(m.group(1).replace(" ", ""))
        for f in pathlib.Path(dump).glob("*live-range.txt")
        for m in re.finditer(r"peak usage: ([\d ]+) bytes", f.read_text())
      ]
    peaks[name] = max(found)
  return peaks


def write_causes(
  args: argparse.Namespace, preset: str, ks: Sequence[int]
) -> dict[str, Any]:
  """``--causes``: measures the control steps and writes their JSON (with
  ``--live-peaks``, only the small MLP's live peaks, into the JSON there)."""
  start = time.perf_counter()
  args.out.mkdir(parents=True, exist_ok=True)
  path = args.out / "accelerator_memory_causes.json"
  if args.live_peaks:
    results = json.loads(path.read_text())
    small = results["small_scan"]
    small["live_peak_bytes"] = live_peaks(preset, args.dtype, small["k"])
    small["live_peak_machine"] = machine(sys.argv[1:], time.perf_counter() - start)
  else:
    results = measure_causes(preset, args.dtype, ks)
    results["machine"] = machine(sys.argv[1:], time.perf_counter() - start)
  path.write_text(json.dumps(results, indent=1))
  print(f"wrote {path}")
  return results


def write_fp8(args: argparse.Namespace, preset: str) -> dict[str, Any]:
  """Measures the FP8 row into the existing ``accelerator_memory.json``."""
  path = args.out / "accelerator_memory.json"
  results = json.loads(path.read_text())
  start = time.perf_counter()
  row = measure_fp8(preset)
  row["machine"] = machine(sys.argv[1:], time.perf_counter() - start)
  results["fp8"] = row
  path.write_text(json.dumps(results, indent=1))
  print(accelerator_memory_fp8(results))
  return row


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
  """Runs the sweep; prints and writes the rows."""
  args = parse_args(argv)
  warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
  preset = args.preset or ("cpu-quick" if args.quick else "gpu")
  ks = args.ks or list(QUICK_KS if args.quick else DEFAULT_KS)
  names = args.models
  tx = optax.adam(1e-3)
  if args.live_peak_of:  # a child of live_peaks: compile, XLA dumps
    steps, step_args = scan_steps("dispatch_mlp", preset, args.dtype, ks[0])
    tpu = jaxaccum.compile_target("tpu-v5e")
    return [measure(steps[args.live_peak_of], step_args, tpu)]
  if args.causes:
    return [write_causes(args, preset, ks)]
  if args.fp8:
    testing.cpu_devices(8)  # stand-ins for 8 H100s, before JAX's backends start
    return [write_fp8(args, args.preset or "gpu")]

  start = time.perf_counter()
  targets = []
  for name in args.targets:
    t0 = time.perf_counter()
    targets.append(jaxaccum.compile_target(name))
    print(f"{targets[-1]!r}: ready in {time.perf_counter() - t0:.2f} s", flush=True)
  rows = []
  for target in targets:
    for name in names:
      model = _models.abstract(name, preset, args.dtype)
      doubled = _models.abstract(name, preset, args.dtype, batch_scale=2)
      full_step = _approaches.full_batch_step(model.loss, tx)
      state = jax.eval_shape(tx.init, model.params)
      full = measure(full_step, (model.params, state, model.batch), target)
      for k in ks:
        if model.batch_size % k:
          continue
        row = measure_row(
          target=target, model=model, doubled=doubled, tx=tx, k=k, full=full
        )
        rows.append(row)
        print(
          f"{target.name} {name} k={k}: jaxaccum {mib(row['jaxaccum_peak'])} MiB, "
          f"streamed {mib(row['streamed_peak'])} MiB ({row['compile_s']} s)",
          file=sys.stderr,
          flush=True,
        )
  wall = time.perf_counter() - start

  results = {
    "machine": machine(sys.argv[1:], wall),
    "settings": {"preset": preset, "dtype": args.dtype, "ks": ks},
    "targets": {t.name: _compile.target_info(t) for t in targets},
    "models": {
      name: _models.abstract(name, preset, args.dtype).config.describe()
      for name in names
    },
    "notes": NOTES,
    "rows": rows,
  }
  args.out.mkdir(parents=True, exist_ok=True)
  suffix = "_quick" if args.quick else ""
  path = args.out / f"accelerator_memory{suffix}.json"
  path.write_text(json.dumps(results, indent=1))
  print(f"\nwrote {path} ({wall:.0f} s)")
  if not args.no_plots:
    png = args.out / f"accelerator_memory{suffix}.png"
    plot(rows, png, f"device memory per step, compile-only; jax {jax.__version__}")
    print(f"wrote {png}")
  for target in results["targets"]:
    print(_accelerator_table(results, target), end="\n\n")
  print(accelerator_memory_summary(results), end="\n\n")
  for row in rows:
    print(json.dumps(row))
  return rows


if __name__ == "__main__":
  main()
