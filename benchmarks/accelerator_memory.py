"""Accelerator memory of jaxaccum and its peers, measured without an accelerator.

Usage::

  python benchmarks/accelerator_memory.py [--quick] [--targets h100,tpu-v5e]

XLA compiles for a GPU or a TPU without the hardware (the ``targets`` extra:
the CUDA compiler plugin and libtpu). For every target, benchmark model
(``_models.py``) and number of micro-batches ``k`` this script compiles, and
never runs, one optimizer step (Adam, parameters and state donated) and reads
XLA's memory analysis of one device:

- ``full_peak``: the full-batch step (``jax.value_and_grad`` on all ``B`` rows);
- ``bound``: the full-batch step compiled at the micro-batch size ``B / k``,
  plus one float32 accumulator the size of the parameters, plus the other
  ``B - B / k`` rows of the batch: what accumulation must hold at least;
- ``jaxaccum_peak``: ``jaxaccum.make_train_step(loss, tx, k)``, batch in
  device memory;
- ``streamed_peak``: the same step with the batch in host memory
  (``memory_kind="pinned_host"``), which jaxaccum streams to the device one
  micro-batch at a time; ``streamed_peak_2x``: the same with twice the
  batch at the same micro-batch size (``2k`` micro-batches);
- ``microbatch_peak``: ``optax.microbatching.microbatch``, batch in device
  memory;
- ``batch_bytes``: the batch itself.

Every peak is ``argument + output + temp - alias`` of device memory only
(``jaxaccum.MemoryStats.peak_bytes``: host memory is counted apart, and on
TPU temp is read from XLA's own peak, see the notes in the JSON). A step that
XLA's TPU compiler refuses because it exceeds the chip's memory is reported
as ``null`` with the compiler's message.

The targets checked, per row (PASS / MISS / n/a; misses are reported, the
script never fails on them):

- jaxaccum's peak <= 1.05 x bound;
- for k >= 2 the streamed step saves at least 0.9 x (batch bytes - one
  micro-batch) against jaxaccum's in-device step;
- for k >= 2 the streamed peak stays within 2% when the batch doubles (at
  k = 1 the one micro-batch is the whole batch).

The last lines of the output are one JSON object per row. The results go to
``<out>/accelerator_memory[_quick].json`` and ``.png``.

``--causes`` compiles instead the control steps that say why rows miss the
first target, into ``<out>/accelerator_memory_causes.json``: on the TPU
v5e, jaxaccum at ``k = 1`` with and without its finite check
(``skip_nonfinite``) against the full-batch step, and the large MLP's
jaxaccum step (at each ``k >= 2``) and the small MLP's (at ``k = 16``)
against a ``lax.scan`` written without jaxaccum. ``--causes --live-peaks``
adds to that JSON, for the small MLP's three steps, the bytes live at each
program's peak by XLA's own live-range dump (``--xla_dump_to``, one process
per step), and keeps the rest.
"""

# The manual's blocks below use its typography: multiplication signs, en
# dashes, minus signs.
# ruff: noqa: RUF001

from __future__ import annotations

import os

# Before JAX starts: without a GPU, the CUDA plugin must not try to start one
# (it would fail and not register its compiler).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import dataclasses
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
from collections.abc import Callable, Sequence
from typing import Any

import _approaches
import _models
import _paths
import jax
import jax.numpy as jnp
import jaxlib
import optax
from _report import (
  bullet_list,
  by_k,
  command_line,
  date,
  duration,
  ks_text,
  listing,
  mib,
  ratio,
  span,
  table,
)

import jaxaccum

PyTree = Any

DEFAULT_KS = (1, 2, 4, 8, 16)
QUICK_KS = (1, 4)
MODEL_NAMES = ("dispatch_mlp", "compute_mlp", "transformer")
TARGETS = ("h100", "tpu-v5e")
BOUND_TARGET = 1.05  # jaxaccum's peak at most 1.05 x its bound (checks)

NOTES = {
  "peaks": "bytes of one device: argument + output + temp - alias of XLA's "
  "memory analysis, device memory only (jaxaccum.MemoryStats.peak_bytes); "
  "host memory (a pinned_host batch) is not in it",
  "tpu": "XLA's TPU memory analysis reports temp_size_in_bytes = 0 for many "
  "programs that hold large intermediates, and its peak_memory_in_bytes "
  "includes host arguments and outputs. jaxaccum takes the TPU peak as "
  "peak_memory_in_bytes minus host memory. XLA's TPU compiler refuses (at "
  "compile time) a program that exceeds the chip's HBM: such a step is null",
  "h100": "the compile-only GPU devices have no memory kinds, so a GPU target "
  "lowers on CPU devices standing in for the GPUs (lowering_platforms="
  "('cuda',)) and compiles with the compile-only GPU client",
  "bound": "full-batch step compiled at B/k rows + float32 accumulator "
  "(params in f32) + the other B - B/k rows of the batch",
  "streamed_peak_2x": "the streamed step with batch 2B and 2k micro-batches "
  "(the same micro-batch size)",
  "optimizer": "optax.adam(1e-3); params and optimizer state donated",
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  """The command line."""
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument("--quick", action="store_true", help="small models, k in 1,4")
  parser.add_argument(
    "--out",
    type=pathlib.Path,
    help="output folder (default: benchmarks/results; quick: the temporary folder)",
  )
  parser.add_argument("--targets", default=",".join(TARGETS))
  parser.add_argument("--models", default=",".join(MODEL_NAMES))
  parser.add_argument("--ks", help="comma-separated k (default 1,2,4,8,16)")
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
  return parser.parse_args(argv)


def abstract_model(name: str, preset: str, dtype: str, batch_scale: int = 1) -> Any:
  """Model ``name`` of ``preset`` as shapes only (nothing is allocated).

  ``batch_scale`` multiplies the batch size.
  """
  config = _models.PRESETS[preset][name]
  config = dataclasses.replace(config, batch_size=config.batch_size * batch_scale)
  if isinstance(config, _models.TransformerConfig):
    config = dataclasses.replace(config, dtype=dtype)
    make: Callable[..., Any] = _models.make_transformer
  else:
    make = _models.make_mlp
  built = []

  def build():
    model = make(name, _models.TITLES[name], config)
    built.append(model)
    return model.params, model.batch

  params, batch = jax.eval_shape(build)
  return dataclasses.replace(built[0], params=params, batch=batch)


def measure(
  step: Any, args: Sequence[Any], target: jaxaccum.CompileTarget
) -> dict[str, Any]:
  """Compiles ``step(*args)`` for ``target``: its device peak, or why not."""
  start = time.perf_counter()
  try:
    stats = jaxaccum.compiled_memory(step, *args, target=target)
  except Exception as e:  # reported; the sweep goes on
    message = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    return {"peak": None, "error": message, "compile_s": time.perf_counter() - start}
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
  micro_batch = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct((micro, *x.shape[1:]), x.dtype), batch
  )
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
  accumulator = _approaches.tree_bytes(params, jnp.float32)
  rest = batch_bytes * (size - micro) // size
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
  out: dict[str, dict[str, Any]] = {}
  peak, bound = row["jaxaccum_peak"], row["bound"]
  if peak is None or bound is None:
    out["peak <= 1.05 x bound"] = {"value": None, "pass": None}
  else:
    out["peak <= 1.05 x bound"] = {
      "value": peak / bound,
      "pass": peak <= BOUND_TARGET * bound,
    }
  streamed, doubled = row["streamed_peak"], row["streamed_peak_2x"]
  need = 0.9 * (row["batch_bytes"] - row["micro_batch_bytes"])
  if row["k"] < 2:
    out["streamed saves 0.9 x (batch - micro)"] = {"value": None, "pass": None}
  elif streamed is None or peak is None:
    out["streamed saves 0.9 x (batch - micro)"] = {"value": None, "pass": False}
  else:
    saved = peak - streamed
    out["streamed saves 0.9 x (batch - micro)"] = {
      "value": saved / need if need else None,
      "pass": saved >= need,
    }
  if row["k"] < 2:  # k=1 holds the whole batch; 2k=2 streams: not comparable
    out["streamed within 2% at 2x batch"] = {"value": None, "pass": None}
  elif streamed is None or doubled is None:
    out["streamed within 2% at 2x batch"] = {"value": None, "pass": False}
  else:
    growth = doubled / streamed - 1
    out["streamed within 2% at 2x batch"] = {
      "value": growth,
      "pass": abs(growth) <= 0.02,
    }
  return out


def text_mib(n: int | None) -> str:
  return "-" if n is None else f"{n / 2**20:.1f}"


def text_table(rows: list[dict[str, Any]]) -> str:
  """The rows as a text table, in MiB, with the checks."""
  head = (
    f"{'target':<8} {'model':<13} {'k':>3} {'batch':>9} {'full':>9} {'bound':>9} "
    f"{'jaxaccum':>9} {'streamed':>9} {'stream2x':>9} {'microbatch':>10}  checks"
  )
  lines = [head]
  for r in rows:
    marks = " ".join(
      "n/a" if c["pass"] is None else ("PASS" if c["pass"] else "MISS")
      for c in r["checks"].values()
    )
    lines.append(
      f"{r['target']:<8} {r['model']:<13} {r['k']:>3} {text_mib(r['batch_bytes']):>9} "
      f"{text_mib(r['full_peak']):>9} {text_mib(r['bound']):>9} {text_mib(r['jaxaccum_peak']):>9} "
      f"{text_mib(r['streamed_peak']):>9} {text_mib(r['streamed_peak_2x']):>9} "
      f"{text_mib(r['microbatch_peak']):>10}  {marks}"
    )
  return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> str:
  """PASS / MISS / n/a per check, and every miss and error."""
  lines = ["", "checks (pass / miss / n/a):"]
  names = list(rows[0]["checks"]) if rows else []
  for name in names:
    results = [r["checks"][name]["pass"] for r in rows]
    lines.append(
      f"  {name:<40} {results.count(True):>3} / {results.count(False):>3} / "
      f"{results.count(None):>3}"
    )
  for r in rows:
    where = f"{r['target']} {r['model']} k={r['k']}"
    for name, c in r["checks"].items():
      if c["pass"] is False:
        value = "-" if c["value"] is None else f"{c['value']:.3f}"
        lines.append(f"  MISS {where}: {name} (value {value})")
    for column, error in r["errors"].items():
      lines.append(f"  {where}: {column} did not compile: {error}")
  return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: pathlib.Path, title: str) -> None:
  """One panel per (target, model): device peak against k, a line per column."""
  import matplotlib  # noqa: PLC0415

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

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
      ax.set_xscale("log", base=2)
      ax.set_yscale("log")
      ax.set_xticks(ks, [str(k) for k in ks])
      ax.set_title(f"{target}: {model}", fontsize=10)
      ax.set_xlabel("micro-batches k")
      ax.set_ylabel("device peak, MiB")
      ax.grid(True, which="both", alpha=0.3)
  axes[0][0].legend(fontsize=7)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


# ---------------------------------------------------------------- the causes

CAUSE_MODELS = ("dispatch_mlp", "compute_mlp")
SMALL_SCAN_K = 16  # the small MLP's row above its bound on the TPU v5e


def hand_scan_step(loss: Any, tx: optax.GradientTransformation, k: int) -> Any:
  """One Adam step over ``k`` micro-batches in a ``lax.scan`` written without
  jaxaccum: the batch reshaped to ``(k, m, ...)``, a float32 accumulator, the
  parameters closed over; jitted and donated like the other steps."""

  def step(params, opt_state, batch):
    micro = jax.tree.map(lambda x: x.reshape(k, -1, *x.shape[1:]), batch)

    def body(acc, mb):
      value, grads = jax.value_and_grad(loss)(params, mb)
      return jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, grads), value

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    acc, values = jax.lax.scan(body, zeros, micro)
    grads = jax.tree.map(lambda a, p: (a / k).astype(p.dtype), acc, params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jnp.mean(values)

  return jax.jit(step, donate_argnums=(0, 1))


def selected_step(loss: Any, tx: optax.GradientTransformation) -> Any:
  """The full-batch step that keeps its update only if the loss and the
  gradients are finite (``jnp.where``, as ``make_train_step`` does), written
  without jaxaccum and without an optimization barrier."""

  def step(params, opt_state, batch):
    value, grads = jax.value_and_grad(loss)(params, batch)
    leaves = [value, *jax.tree.leaves(grads)]
    ok = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))
    updates, new_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = functools.partial(jax.tree.map, lambda n, o: jnp.where(ok, n, o))
    return keep(new_params, params), keep(new_state, opt_state), value

  return jax.jit(step, donate_argnums=(0, 1))


def measure_causes(preset: str, dtype: str, ks: Sequence[int]) -> dict[str, Any]:
  """The control steps on the TPU v5e (see the module's docstring)."""
  tpu = jaxaccum.compile_target("tpu-v5e")
  tx = optax.adam(1e-3)
  k1 = []
  for model_preset in dict.fromkeys(("cpu-quick", preset)):
    for name in CAUSE_MODELS:
      model = abstract_model(name, model_preset, dtype)
      args = (model.params, jax.eval_shape(tx.init, model.params), model.batch)
      steps = {
        "full_peak": _approaches.full_batch_step(model.loss, tx),
        "jaxaccum_peak": _approaches.JaxAccum(model, tx, 1).fn,
        "no_skip_peak": _approaches.JaxAccumNoSkip(model, tx, 1).fn,
        "select_peak": selected_step(model.loss, tx),
      }
      row = {"preset": model_preset, "model": name}
      row |= {key: measure(step, args, tpu)["peak"] for key, step in steps.items()}
      k1.append(row)
      print(json.dumps(row), file=sys.stderr, flush=True)
  model = abstract_model("compute_mlp", preset, dtype)
  state = jax.eval_shape(tx.init, model.params)
  scan = []
  for k in ks:
    if k < 2 or model.batch_size % k:
      continue
    steps = {
      "jaxaccum_peak": _approaches.JaxAccum(model, tx, k).fn,
      "no_skip_peak": _approaches.JaxAccumNoSkip(model, tx, k).fn,
      "scan_peak": hand_scan_step(model.loss, tx, k),
    }
    row = {"k": k}
    row |= {
      key: measure(step, (model.params, state, model.batch), tpu)["peak"]
      for key, step in steps.items()
    }
    scan.append(row)
    print(json.dumps(row), file=sys.stderr, flush=True)
  small = abstract_model("dispatch_mlp", preset, dtype)
  small_k = max(k for k in (*ks, SMALL_SCAN_K) if small.batch_size % k == 0)
  steps, small_args = small_steps(preset, dtype, small_k)
  small_scan = {"k": small_k}
  small_scan |= {
    key: measure(step, small_args, tpu)["peak"] for key, step in steps.items()
  }
  print(json.dumps(small_scan), file=sys.stderr, flush=True)
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


def _accelerator_rows(results: dict[str, Any], target: str) -> list[dict[str, Any]]:
  return [r for r in results["rows"] if r["target"] == target]


ACCELERATOR_PEAKS = (
  "full_peak",
  "bound",
  "jaxaccum_peak",
  "streamed_peak",
  "streamed_peak_2x",
  "microbatch_peak",
)


def _accelerator_table(results: dict[str, Any], target: str) -> str:
  """Per model and k, each peak in MiB (KiB for a model whose peaks stay
  below 16 MiB), jaxaccum's also over its bound."""
  title = results["targets"][target]["title"]
  rows = []
  for model, model_name in ACCELERATOR_MODELS.items():
    mine = [r for r in _accelerator_rows(results, target) if r["model"] == model]
    peaks = [r[key] for r in mine for key in ACCELERATOR_PEAKS if r[key] is not None]
    unit, scale = (
      ("MiB", 2**20) if max(peaks, default=2**30) >= 16 * 2**20 else ("KiB", 2**10)
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


def accelerator_memory_machine(results: dict[str, Any]) -> str:
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

  command = "python benchmarks/accelerator_memory.py"
  commands = [command_line(command, part["argv"]) for part in m.get("parts", [])]
  commands = commands or [command_line(command, m.get("argv"))]
  return (
    f"Compiled on {date(m['date'])} with " + listing([f"`{c}`" for c in commands]) + " "
    f"(jax {m['jax']}; preset "
    f"`{s['preset']}`, {s['dtype']}, {ks_text(s['ks'])}) for "
    + listing([describe(n) for n in ACCELERATOR_MODELS if n in models])
    + f"; the sweep took {duration(m['wall_s'])} of compiling."
    + _missing_rows(results)
  )


def _missing_rows(results: dict[str, Any]) -> str:
  """The rows of the sweep's targets, models and ks that it does not hold."""
  have = {(r["target"], r["model"], r["k"]) for r in results["rows"]}
  missing: dict[tuple[str, str], list[int]] = {}
  for target in results["targets"]:
    for model, config in results["models"].items():
      for k in results["settings"]["ks"]:
        if config["batch_size"] % k == 0 and (target, model, k) not in have:
          missing.setdefault((target, model), []).append(k)
  if not missing:
    return ""
  return (
    " Not compiled in this run: "
    + listing(
      [
        f"the {ACCELERATOR_MODELS[model]} at {ks_text(ks)} on the "
        f"{results['targets'][target]['title']}"
        for (target, model), ks in missing.items()
      ]
    )
    + (
      f" ({results['machine']['missing_why']})"
      if "missing_why" in results["machine"]
      else ""
    )
    + "."
  )


def accelerator_memory_h100(results: dict[str, Any]) -> str:
  return _accelerator_table(results, "h100")


def accelerator_memory_tpu(results: dict[str, Any]) -> str:
  return _accelerator_table(results, "tpu-v5e")


def accelerator_memory_summary(results: dict[str, Any]) -> str:
  bullets = [
    _accelerator_target_bullet(results, target, info["title"])
    for target, info in results["targets"].items()
  ]
  bullets.append(_accelerator_streaming_bullet(results))
  bullets.append(_accelerator_checks_bullet(results))
  return bullet_list(b for b in bullets if b)


def _accelerator_target_bullet(results: dict[str, Any], target: str, title: str) -> str:
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
      + " (beyond the chip's memory)"
    )
    if any(k is not None for k in fits):
      text += "; jaxaccum fits from " + listing(
        [f"k = {k}" for k in fits if k is not None]
      )
    text += "."
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


def _accelerator_streaming_bullet(results: dict[str, Any]) -> str:
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
      per_target.append(f"{by_k(mine, mib)} on the {titles.get(target, target)}")
    text += (
      " Against the in-device step, streaming the large MLP's "
      f"{mib(saves[0]['batch_bytes'])} MiB batch saves (MiB; negative: costs) "
      + "; ".join(per_target)
      + "."
    )
  return text


def _accelerator_checks_bullet(results: dict[str, Any]) -> str:
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


def kib(n: float) -> str:
  return f"{n / 2**10:,.0f}"


def size(n: float) -> str:
  """``n`` bytes in KiB, or in MiB from 16 MiB on."""
  return f"{mib(n)} MiB" if abs(n) >= 16 * 2**20 else f"{kib(n)} KiB"


def _sweep_row(sweep: dict[str, Any], target: str, model: str, k: int) -> Any:
  return next(
    (
      r
      for r in sweep["rows"]
      if (r["target"], r["model"], r["k"]) == (target, model, k)
    ),
    None,
  )


def accelerator_causes_rows(results: dict[str, Any]) -> str:
  """Why rows miss the targets: the control steps of ``--causes`` and the
  sweep's own columns, one bullet per cause."""
  sweep, causes = results.get("sweep"), results.get("causes")
  bullets = []
  if causes:
    bullets += [
      _k1_bullet(causes),
      _hoisting_bullet(causes, sweep),
      _small_scan_bullet(causes, sweep),
    ]
  if sweep:
    bullets += [
      _activation_bullet(sweep),
      _tpu_streaming_bullet(sweep),
      _small_batch_bullet(sweep),
    ]
  return bullet_list(b for b in bullets if b)


def _k1_bullet(causes: dict[str, Any]) -> str:
  rows = [r for r in causes["k1"] if None not in (r["jaxaccum_peak"], r["full_peak"])]
  same = sum(r["no_skip_peak"] == r["full_peak"] for r in rows)
  as_select = sum(r["jaxaccum_peak"] == r["select_peak"] for r in rows)

  def described(key: str) -> list[str]:
    return [
      f"the {ACCELERATOR_MODELS[r['model']]} of `{r['preset']}` "
      f"{size(r[key] - r['full_peak'])} "
      f"({ratio(r[key] / r['full_peak'])} × its peak)"
      for r in rows
      if r.get(key) is not None
    ]

  text = (
    f"**k = 1 on the {causes['target']['title']}.** With one micro-batch "
    "jaxaccum's step is the full-batch step plus `make_train_step`'s finite "
    "check (`skip_nonfinite=True`: the update is kept only if the loss and "
    "the gradients are finite). No fixed buffer explained the `--quick` "
    "small MLP's excess over its bound; jaxaccum did: `make_train_step` "
    "computed the update behind an optimization barrier before the select "
    "(so that no gradient matmul waits for the all-finite flag), and XLA "
    "kept the new parameters and optimizer state next to the old ones "
    "instead of updating the donated buffers in place"
  )
  before = described("barrier_peak")
  if before:
    text += ", above the full-batch step by " + listing(before)
  return text + (
    ". The barrier is now put only where the step runs on several devices "
    "(`mesh=`, a mesh in context, or arguments typed on one), where it "
    "keeps the 1B Llama's step with FSDP on 8 H100s at its full batch's "
    "peak (`fsdp.py`'s k = 1 rows). On one chip the step's peak less the "
    "full-batch step's is now "
    + listing(described("jaxaccum_peak"))
    + ": the peak of the same select written by hand (`jnp.where(finite, "
    "new, old)` over the parameters and the optimizer state, jitted and "
    f"donated) to the byte in {as_select} of {len(rows)} of these steps, "
    "whose `skip_nonfinite=False` step compiles to the full-batch step's "
    f"peak to the byte in {same} of {len(rows)}."
    + (
      " Where it is still above the full batch, so is the select written by "
      "hand: that is XLA's select, not a jaxaccum buffer."
      if as_select == len(rows)
      else ""
    )
  )


def _small_scan_bullet(causes: dict[str, Any], sweep: dict[str, Any] | None) -> str:
  r = causes.get("small_scan")
  if not r or None in (r["jaxaccum_peak"], r["scan_peak"]):
    return ""
  row = sweep and _sweep_row(sweep, "tpu-v5e", "dispatch_mlp", r["k"])
  if not row or not row["bound"] or row["jaxaccum_peak"] <= BOUND_TARGET * row["bound"]:
    return ""
  others = {
    x["k"]: x["jaxaccum_peak"]
    for x in sweep["rows"]
    if x["target"] == "tpu-v5e"
    and x["model"] == "dispatch_mlp"
    and x["k"] >= 2
    and x["jaxaccum_peak"] is not None
  }
  return (
    f"**The small MLP on the {causes['target']['title']} at k = {r['k']}, "
    f"above its bound ({ratio(row['jaxaccum_peak'] / row['bound'])}).** "
    f"jaxaccum's step holds (KiB, k ≥ 2) {by_k(others, kib)}, while the bound "
    f"falls with k to {kib(row['bound'])}. Against a `lax.scan` written "
    f"without jaxaccum it holds {r['jaxaccum_peak'] - r['scan_peak']:,} B "
    f"more ({r['scan_peak']:,} B), and {r['no_skip_peak'] - r['scan_peak']:,} "
    "B more without its finite check: the excess is in jaxaccum's loop, not "
    "in the skip. XLA's TPU memory-usage report puts each of these "
    "programs' small buffers at its own 16 KiB-aligned offset; jaxaccum's "
    "loop holds a few more of them than the hand-written one (its loop "
    "tuple one more `f32[16]`, one value per micro-batch, and an `s32[256]` "
    "buffer the size of the labels)." + _live_peak_sentence(r)
  )


def _live_peak_sentence(r: dict[str, Any]) -> str:
  live = r.get("live_peak_bytes")
  if not live:
    return " Which of them are live at the peak was not read out: open."
  fewer = live["scan_peak"] - live["jaxaccum_peak"]
  return (
    " By XLA's own live-range dump (`--causes --live-peaks`), the bytes live "
    f"at each program's peak are {live['jaxaccum_peak']:,} for jaxaccum "
    f"({live['no_skip_peak']:,} without the check) and "
    f"{live['scan_peak']:,} for the scan: "
    + (
      f"jaxaccum's program holds {fewer:,} B fewer, so the excess is not a "
      "buffer it keeps live but the TPU compiler's padding and placement of "
      "its small buffers, a fixed few tens of KiB, not jaxaccum's to fix."
      if fewer >= 0
      else f"jaxaccum's program holds {-fewer:,} B more."
    )
  )


def _hoisting_bullet(causes: dict[str, Any], sweep: dict[str, Any] | None) -> str:
  rows = [r for r in causes["scan"] if r["jaxaccum_peak"] and r["scan_peak"]]
  if not rows:
    return ""
  widths = causes["model"]["widths"]
  weights = sum(a * b for a, b in itertools.pairwise(widths)) * 4
  copies = weights // 2 + causes["batch_bytes"]["x"] // 2
  text = (
    f"**The large MLP on the {causes['target']['title']}, above its bound.** "
    "Against a `lax.scan` written without jaxaccum (the same loss, a float32 "
    "accumulator, Adam), jaxaccum's step holds (MiB) "
    + by_k({r["k"]: r["no_skip_peak"] - r["scan_peak"] for r in rows}, mib)
    + " more without its finite check (`skip_nonfinite=False`), and "
    + by_k({r["k"]: r["jaxaccum_peak"] - r["scan_peak"] for r in rows}, mib)
    + " more with it (at large k the peak moves after the loop, to the "
    "update and its select)"
  )
  bounds = {}
  for r in rows:
    row = sweep and _sweep_row(sweep, "tpu-v5e", "compute_mlp", r["k"])
    if row and row["bound"]:
      bounds[r["k"]] = r["jaxaccum_peak"] - row["bound"]
  if bounds:
    text += "; it is (MiB) " + by_k(bounds, mib) + " above its bound"
  return text + (
    ". XLA's buffer assignment names the excess (at k = 4): a float32 matmul "
    "at default precision runs in bfloat16 on the TPU, and in a loop XLA "
    "hoists the conversions out of it, so that bfloat16 copies of the three "
    "weight matrices and of the whole batch's inputs are carried through the "
    f"loop: {mib(weights // 2)} + {mib(causes['batch_bytes']['x'] // 2)} = "
    f"{mib(copies)} MiB. In one step the conversions fuse into the matmuls. "
    "The cause is XLA's, not jaxaccum's; bfloat16 parameters leave nothing "
    "to convert."
  )


def _activation(sweep: dict[str, Any], r: dict[str, Any]) -> int:
  """One float32 activation of the widest hidden layer, for one micro-batch."""
  widths = sweep["models"][r["model"]]["widths"]
  return r["micro_batch_size"] * max(widths[1:-1]) * 4


def _activation_bullet(sweep: dict[str, Any]) -> str:
  rows = [
    r
    for r in sweep["rows"]
    if r["target"] == "h100"
    and r["model"] == "compute_mlp"
    and r["k"] >= 2
    and None not in (r["jaxaccum_peak"], r["streamed_peak"])
  ]
  if not rows:
    return ""
  saved = {r["k"]: r["jaxaccum_peak"] - r["streamed_peak"] for r in rows}
  account = {
    r["k"]: r["batch_bytes"] - r["micro_batch_bytes"] - _activation(sweep, r)
    for r in rows
  }
  tolerance = 0.01 * rows[0]["batch_bytes"]
  exact = sum(abs(saved[k] - account[k]) <= tolerance for k in saved)
  return (
    "**Streaming the large MLP on the H100, short of 0.9 × (batch − one "
    "micro-batch).** The streamed step saves (MiB) "
    + by_k(saved, mib)
    + ". The batch less one micro-batch less one float32 activation of the "
    "widest layer (micro-batch rows × "
    f"{max(sweep['models']['compute_mlp']['widths'][1:-1]):,} × 4 bytes) is "
    + by_k(account, mib)
    + f": equal within 1% of the batch in {exact} of {len(rows)} rows. XLA's "
    "buffer assignment (at k = 4) shows the streaming itself within its "
    "budget: two micro-batches in device memory, the loop's carry and the "
    "landing buffer of the asynchronous copy of the next one (the copy into "
    "the carry reuses the carry's buffer; no host slice is copied whole and "
    "no device copy of the batch is kept). The rest is the schedule: to "
    "overlap the copy, XLA's GPU scheduler computes the last layer's weight "
    "gradient at the end of the loop body instead of first, so the second "
    "hidden activation stays live while the first one's gradient is written, "
    "and the body needs one activation buffer more than the in-device step "
    "(the large MLP's activation is two micro-batches wide at this width). "
    "Tying the copy to the end of the backward pass keeps every "
    "gradient alive at once and costs more. The fix is the scheduler's "
    "(memory-aware scheduling below the device's capacity), not jaxaccum's."
  )


def _tpu_streaming_bullet(sweep: dict[str, Any]) -> str:
  short = [
    r
    for r in sweep["rows"]
    if r["target"] == "tpu-v5e"
    and r["model"] == "compute_mlp"
    and r["checks"]["streamed saves 0.9 x (batch - micro)"]["pass"] is False
    and None not in (r["jaxaccum_peak"], r["streamed_peak"])
  ]
  if not short:
    return ""
  where = listing(
    [
      f"k = {r['k']}: {mib(r['jaxaccum_peak'] - r['streamed_peak'])} of "
      f"{mib(0.9 * (r['batch_bytes'] - r['micro_batch_bytes']))} MiB"
      for r in short
    ]
  )
  return (
    "**Streaming the large MLP on the TPU v5e, short of 0.9 ×** (saved of "
    f"needed: {where}). Read at k = 2: no device copy of the batch; the "
    "streamed step's peak falls where the TPU compiler's memory-space "
    "assignment has copies between HBM and on-chip memory in flight "
    "(`copy-start`: a micro-batch's logits and a buffer the size of the last "
    "weight matrix), besides the two micro-batches; the in-device step's "
    "peak holds no such copy. Not a jaxaccum buffer; not changed."
  )


def _small_batch_bullet(sweep: dict[str, Any]) -> str:
  rows = [
    r
    for r in sweep["rows"]
    if r["model"] != "compute_mlp"
    and r["k"] >= 2
    and None not in (r["jaxaccum_peak"], r["streamed_peak"])
  ]
  short = [
    r for r in rows if not r["checks"]["streamed saves 0.9 x (batch - micro)"]["pass"]
  ]
  if not short:
    return ""
  need = max(r["batch_bytes"] - r["micro_batch_bytes"] for r in short)
  diff = [r["streamed_peak"] - r["jaxaccum_peak"] for r in short]
  where = listing(
    [
      f"the {ACCELERATOR_MODELS[r['model']]} at k = {r['k']} on the "
      f"{sweep['targets'][r['target']]['title']}"
      for r in short
    ]
  )
  return (
    "**Streaming the transformer and the small MLP.** Their batches are "
    f"small: the batch less one micro-batch is at most {kib(need)} KiB in "
    f"the rows short of 0.9 × ({where}), where the streamed step's peak is "
    f"{span(diff, kib)} KiB above the in-device step's (negative: below). "
    "The rescheduling around the asynchronous copy moves buffers of that "
    "size or more (on the H100, read in the `--quick` transformer at k = 4: "
    "the split-K partial sums of the attention and feed-forward matmuls), so "
    "there the ratio measures the schedule, not the batch."
  )


#: The generated blocks this file writes from ``accelerator_memory.json``
#: (and, for ``accelerator_causes``, from it and
#: ``accelerator_memory_causes.json``), by name (``_report.py`` puts each on
#: its page).
BLOCKS = {
  "accelerator_memory machine": accelerator_memory_machine,
  "accelerator_memory h100": accelerator_memory_h100,
  "accelerator_memory tpu-v5e": accelerator_memory_tpu,
  "accelerator_memory summary": accelerator_memory_summary,
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


def small_steps(preset: str, dtype: str, k: int) -> tuple[dict[str, Any], tuple]:
  """The small MLP's jaxaccum step, without its finite check, and a
  ``lax.scan`` written without jaxaccum, at ``k``; and their arguments."""
  tx = optax.adam(1e-3)
  small = abstract_model("dispatch_mlp", preset, dtype)
  args = (small.params, jax.eval_shape(tx.init, small.params), small.batch)
  steps = {
    "jaxaccum_peak": _approaches.JaxAccum(small, tx, k).fn,
    "no_skip_peak": _approaches.JaxAccumNoSkip(small, tx, k).fn,
    "scan_peak": hand_scan_step(small.loss, tx, k),
  }
  return steps, args


def live_peaks(preset: str, dtype: str, k: int) -> dict[str, int]:
  """For each of :func:`small_steps`, the bytes live at its program's peak
  by XLA's live-range dump for the TPU v5e: each compiled in a process of
  its own, whose ``XLA_FLAGS`` (read once, when JAX's backends start) dump
  there. XLA's peak memory counts these buffers padded and placed; this
  counts them as the program holds them."""
  peaks = {}
  for name in small_steps(preset, dtype, k)[0]:
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
  out = _paths.output_folder(args.out, args.quick)
  out.mkdir(parents=True, exist_ok=True)
  path = out / "accelerator_memory_causes.json"
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


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
  """Runs the sweep; prints and writes the rows."""
  args = parse_args(argv)
  warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
  preset = args.preset or ("cpu-quick" if args.quick else "gpu")
  ks = [int(k) for k in args.ks.split(",")] if args.ks else None
  ks = ks or list(QUICK_KS if args.quick else DEFAULT_KS)
  names = [n for n in args.models.split(",") if n]
  tx = optax.adam(1e-3)
  if args.live_peak_of:  # a child of live_peaks: compile, XLA dumps
    steps, step_args = small_steps(preset, args.dtype, ks[0])
    tpu = jaxaccum.compile_target("tpu-v5e")
    return [measure(steps[args.live_peak_of], step_args, tpu)]
  if args.causes:
    return [write_causes(args, preset, ks)]

  start = time.perf_counter()
  targets = []
  for name in args.targets.split(","):
    t0 = time.perf_counter()
    targets.append(jaxaccum.compile_target(name))
    print(f"{targets[-1]!r}: ready in {time.perf_counter() - t0:.2f} s", flush=True)
  rows = []
  for target in targets:
    for name in names:
      model = abstract_model(name, preset, args.dtype)
      doubled = abstract_model(name, preset, args.dtype, batch_scale=2)
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
          f"{target.name} {name} k={k}: jaxaccum {text_mib(row['jaxaccum_peak'])} MiB, "
          f"streamed {text_mib(row['streamed_peak'])} MiB ({row['compile_s']} s)",
          file=sys.stderr,
          flush=True,
        )
  wall = time.perf_counter() - start

  print()
  print(text_table(rows))
  print(summary(rows))
  results = {
    "machine": machine(sys.argv[1:], wall),
    "settings": {"preset": preset, "dtype": args.dtype, "ks": ks},
    "targets": {
      t.name: {
        "title": t.title,
        "device_kind": t.device_kind,
        "topology": t.topology,
        "memory_bytes": t.memory_bytes,
      }
      for t in targets
    },
    "models": {
      name: abstract_model(name, preset, args.dtype).config.describe() for name in names
    },
    "notes": NOTES,
    "rows": rows,
  }
  args.out = _paths.output_folder(args.out, args.quick)
  args.out.mkdir(parents=True, exist_ok=True)
  suffix = "_quick" if args.quick else ""
  path = args.out / f"accelerator_memory{suffix}.json"
  path.write_text(json.dumps(results, indent=1))
  print(f"\nwrote {path} ({wall:.0f} s)")
  if not args.no_plots:
    png = args.out / f"accelerator_memory{suffix}.png"
    plot(rows, png, f"device memory per step, compile-only; jax {jax.__version__}")
    print(f"wrote {png}")
  print()
  for row in rows:
    print(json.dumps(row))
  return rows


if __name__ == "__main__":
  main()
