"""FSDP: memory and communication of accumulating a 1B-parameter transformer.

Compile-only (the ``targets`` extra): ``_models.py``'s Llama under FSDP
(:func:`fsdp_spec`) on 8 H100s and a TPU v5e ``2x4``, one ``optax.adamw``
step by each of :data:`APPROACHES` (:func:`build_step`), read per device by
:func:`measure`. ``--quick`` compiles a 3-layer model at k = 1 and 4 (about
5 minutes on two CPU cores; the full sweep took 73). Outputs ``fsdp.json``
and ``fsdp.png`` (``fsdp_quick.*``, ``fsdp_llama_2.7b.*``) in ``--out``.
"""

from __future__ import annotations

import os

# Without a GPU the CUDA plugin must not try to start one (it would fail and
# not register its compiler).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import dataclasses
import datetime
import json
import math
import pathlib
import platform
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import _approaches
import _compile
import _models
import _paths
import jax
import jax.numpy as jnp
import numpy as np
from _report import date, k_axis, pyplot, ratio, table
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from jaxaccum import testing

PyTree = Any

NUM_DEVICES = 8
DEFAULT_KS = (1, 2, 4, 8, 16)
QUICK_KS = (1, 4)
DATA = "data"
APPROACHES = {
  "full_batch": "full batch, jit",
  "full_batch_skip": "full batch + skip-non-finite select, jit",
  "jaxaccum_per_micro_batch": 'jaxaccum, fsdp_gather="per_micro_batch" (default)',
  "jaxaccum_once": 'jaxaccum, fsdp_gather="once"',
  "jaxaccum_cast_once": 'jaxaccum, fsdp_gather="cast_once" (bfloat16)',
  "jaxaccum_global": 'jaxaccum, view="global"',
  "hand_scan": "hand-written lax.scan (MaxText's pattern)",
  "optax_microbatch": "optax.microbatch, jit",
}
PEERS = ("hand_scan", "optax_microbatch")
DEFAULT = "jaxaccum_per_micro_batch"
# Steps that do not depend on k: compiled once per target.
WHOLE_BATCH = ("full_batch", "full_batch_skip")
#: What the JSON's numbers mean; stored with the results (the rows hold
#: every cross-check: ``peak_bytes_hlo``, ``outputs_sharded_like_inputs``).
NOTES = [
  "Per device, compile-only. peak_bytes: jaxaccum.compiled_memory, argument + "
  "output + temp - alias of device memory (TPU: temp from XLA's peak); null, "
  "with an error, where the compiler refused the step (TPU: beyond 16 GiB).",
  "collective_bytes: each collective's result bytes times the trip counts of "
  "the loops around it (a reduce-scatter counts its 1/8 result). "
  "in_loop_collectives: those inside the micro-batch loop (the outermost loop "
  "that runs k times); in_any_loop_collectives also those of the layer scans "
  "and of XLA's own loops.",
  "float32 master weights cast to bfloat16 in the loss; gradients, adamw's "
  "moments and accumulators float32; each scanned layer rematerialized.",
  "Auto mesh, one axis 'data'; jaxaccum gets param_specs=. Activations "
  "constrained after the embedding and every layer: P('data') under plain "
  "jit, P() inside jaxaccum (without them XLA reshards the SwiGLU's "
  "activations with all-to-alls).",
  "No out_shardings; outputs_sharded_like_inputs: whether the new parameters "
  "and optimizer state come out sharded like the inputs (donation reuses them).",
  "The full batch does not depend on k: compiled once per target, its row "
  "repeated for every k. micro_batch_per_device is in sequences.",
  "H100 HLO: the step on the target's compile-only GPU devices, compiled with "
  "XLA's dump (largest_live_buffers_at_peak from its live ranges; "
  "peak_bytes_hlo that compile's peak; peak_bytes from CPU stand-ins).",
]


# ---------------------------------------------------------------- the steps


def fsdp_spec(path: tuple[Any, ...], x: jax.ShapeDtypeStruct) -> P:
  """FSDP: a weight matrix sharded over ``"data"`` along its larger
  dimension (the first on ties; a stacked layer's leading axis is never
  sharded); norm scales replicated."""
  stacked = jax.tree_util.keystr(path).startswith("['layers']")
  dims = x.shape[1:] if stacked else x.shape
  if len(dims) < 2:
    return P()
  axis = int(np.argmax(dims))  # the first of equal sizes
  spec = [None] * len(dims)
  spec[axis] = DATA
  return P(*([None] * stacked), *spec)


def param_specs(cfg: _models.LlamaConfig) -> PyTree:
  """The parameters' ``PartitionSpec``s."""
  return jax.tree_util.tree_map_with_path(fsdp_spec, _models.llama_shapes(cfg))


@dataclasses.dataclass(frozen=True)
class Setup:
  """A model on one mesh (one ``Auto`` axis ``"data"``): the loss for
  ``jit`` of the whole batch (activations constrained to ``P("data")``) and
  for jaxaccum's per-device view (to ``P()``), the parameters' specs, and
  ``(params, opt_state, tokens)`` as sharded ``ShapeDtypeStruct``s."""

  name: str
  cfg: _models.LlamaConfig
  mesh: Mesh
  jit_loss: Callable[..., jax.Array]
  accum_loss: Callable[..., jax.Array]
  specs: PyTree
  args: tuple[PyTree, PyTree, jax.ShapeDtypeStruct]

  @property
  def shardings(self) -> PyTree:
    return jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.specs)


def make_setup(name: str, cfg: _models.LlamaConfig, mesh: Mesh) -> Setup:
  """The losses, and parameters, adamw state and batch as
  ``ShapeDtypeStruct``s on ``mesh``."""
  specs = param_specs(cfg)
  tokens = jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len + 1), jnp.int32)
  args = _compile.train_args(
    _models.llama_optimizer(),
    _models.llama_shapes(cfg),
    specs,
    mesh,
    tokens=tokens,
    tokens_spec=P(DATA),
  )
  return Setup(
    name,
    cfg,
    mesh,
    jit_loss=_models.llama_loss(cfg, NamedSharding(mesh, P(DATA))),
    accum_loss=_models.llama_loss(cfg, NamedSharding(mesh, P())),
    specs=specs,
    args=args,
  )


#: The keywords of each jaxaccum approach's ``make_train_step``.
JAXACCUM_OPTIONS = {
  "jaxaccum_per_micro_batch": {"fsdp_gather": "per_micro_batch"},
  "jaxaccum_once": {"fsdp_gather": "once"},
  "jaxaccum_cast_once": {"fsdp_gather": "cast_once", "gather_dtype": jnp.bfloat16},
  "jaxaccum_global": {"view": "global"},
}


def build_step(approach: str, setup: Setup, k: int) -> Any:
  """The jitted, donating ``step(params, opt_state, tokens)`` of ``approach``."""
  tx = _models.llama_optimizer()
  if approach == "full_batch":
    return _approaches.full_batch_step(setup.jit_loss, tx)
  if approach == "full_batch_skip":
    return _approaches.full_batch_select_step(setup.jit_loss, tx)
  if approach in JAXACCUM_OPTIONS:
    # The global view's fun is the loss of plain jit; the device view's sees
    # one device's rows.
    loss = setup.jit_loss if approach == "jaxaccum_global" else setup.accum_loss
    return jaxaccum.make_train_step(
      loss,
      tx,
      k,
      mesh=setup.mesh,
      data_axis=DATA,
      param_specs=setup.specs,
      **JAXACCUM_OPTIONS[approach],
    )
  if approach == "hand_scan":
    vg = _approaches.hand_scan(
      setup.jit_loss, k, split="strided", shardings=setup.shardings
    )
    return _approaches.train_step(vg, tx)
  if approach == "optax_microbatch":
    vg = _approaches.optax_microbatch(setup.jit_loss, setup.cfg.batch_size // k)
    return _approaches.train_step(vg, tx)
  raise ValueError(f"unknown approach {approach!r}")


# ---------------------------------------------------------------- reading HLO


def micro_batch_loop(
  step: testing.CompiledStep, k: int
) -> tuple[set[str], list[int | None]]:
  """The computations inside the micro-batch loop of a compiled step (a
  loop outside every other loop that runs ``k >= 2`` times: the layer scans
  and XLA's own loops sit inside it; ``jaxaccum.testing``'s
  ``CompiledStep.loops``), and the trip counts of the outermost loops."""
  outer = [loop for loop in step.loops if not loop.outer]
  inside: set[str] = set()
  for loop in outer:
    if k >= 2 and loop.trip_count == k:
      inside |= loop.computations
  return inside, [loop.trip_count for loop in outer]


def collective_stats(hlo_text: str, k: int) -> dict[str, Any]:
  """Bytes per step, by opcode, and the collectives inside the loops."""
  step = testing.read_compiled(hlo_text)
  colls = step.collectives
  micro, trips = micro_batch_loop(step, k)
  by_op: dict[str, int] = {}
  for c in colls:
    by_op[c.op] = by_op.get(c.op, 0) + c.bytes * c.executions
  in_micro = [c for c in colls if c.computation in micro]
  return {
    "collective_bytes": step.bytes_communicated,
    "in_loop_collectives": len(in_micro),
    "in_loop_collective_bytes": sum(c.bytes * c.executions for c in in_micro),
    "in_any_loop_collectives": sum(c.in_loop for c in colls),
    "num_collectives": len(colls),
    "collective_bytes_by_op": by_op,
    "outer_loop_trip_counts": trips,
  }


_PEAK = re.compile(r"^\s*Live ranges at \d+ \(peak\):")
_LIVE = re.compile(r"^\s*(\S+): (\d+) bytes \(cumulative")
_VALUE = re.compile(
  r"value: <\d+ ([^ >]+)(?: \(phi\))? @\d+> \(size=\d+,offset=\d+\): (.*)$"
)


def live_at_peak(dump: pathlib.Path, limit: int = 12) -> list[dict[str, Any]]:
  """The largest buffers live at the peak, from XLA's dumped live ranges.

  Each: its HLO value, bytes, shape and the JAX ``op_name`` of the
  instruction that defines it: the argument's name for the step's own
  parameters, none for a loop's parameter (a value carried through a loop).
  """
  ranges = sorted(dump.glob("*after_optimizations-live-range.txt"))
  if not ranges:
    return []
  live: list[tuple[str, int]] = []
  in_peak = False
  for line in ranges[-1].read_text().splitlines():
    if _PEAK.match(line):
      in_peak = True
    elif in_peak:
      match = _LIVE.match(line)
      if not match:
        break
      live.append((match.group(1), int(match.group(2))))
  shapes: dict[str, str] = {}
  for path in dump.glob("*after_optimizations-buffer-assignment.txt"):
    for line in path.read_text().splitlines():
      match = _VALUE.search(line)
      if match:
        shapes.setdefault(match.group(1), match.group(2))
  ops: dict[str, str] = {}
  for path in dump.glob("*gpu_after_optimizations.txt"):
    ops.update(testing.read_compiled(path.read_text()).op_names())
  live.sort(key=lambda item: -item[1])
  return [
    {
      "value": name,
      "bytes": size,
      "shape": shapes.get(name.removesuffix("{}"), ""),
      "op_name": ops.get(name.split("{")[0], ""),
    }
    for name, size in live[:limit]
  ]


# ---------------------------------------------------------------- compiling


def _sharded_like_inputs(compiled: Any, args: Sequence[Any]) -> bool:
  """Whether the new parameters and optimizer state come out sharded like
  the ones that went in (donation can then reuse their buffers)."""
  outs = jax.tree.leaves(compiled.output_shardings[:2])
  ins = jax.tree.leaves(args[:2])
  return all(
    o.is_equivalent_to(i.sharding, len(i.shape)) for o, i in zip(outs, ins, strict=True)
  )


def measure(
  approach: str,
  k: int,
  target: jaxaccum.CompileTarget,
  setup: Setup,
  hlo_setup: Setup,
  *,
  hlo_dir: pathlib.Path | None = None,
) -> dict[str, Any]:
  """One row: ``approach`` with ``k`` compiled for ``target``, by
  ``jaxaccum.compiled_memory`` on ``setup`` (``target.mesh()``) and for the
  HLO on ``hlo_setup`` (the target's own devices; on a TPU the same compile);
  with ``hlo_dir`` the HLO text is written there."""
  row: dict[str, Any] = {
    "target": target.name,
    "model": setup.name,
    "k": k,
    "approach": approach,
    "micro_batch_per_device": setup.cfg.batch_size
    // (NUM_DEVICES * (1 if approach in WHOLE_BATCH else k)),
    "peak_bytes": None,
    "collective_bytes": None,
    "in_loop_collectives": None,
  }
  start = time.perf_counter()
  try:
    step = build_step(approach, setup, k)
    stats = jaxaccum.compiled_memory(step, *setup.args, target=target)
  except Exception as e:  # recorded; the sweep goes on
    row["error"] = _compile.error(e)
    row["compile_s"] = round(time.perf_counter() - start, 1)
    return row
  row.update(
    peak_bytes=stats.peak_bytes,
    argument_bytes=stats.argument_bytes,
    output_bytes=stats.output_bytes,
    temp_bytes=stats.temp_bytes,
    alias_bytes=stats.alias_bytes,
  )
  try:
    with tempfile.TemporaryDirectory() as tmp:
      hlo_step = step if hlo_setup is setup else build_step(approach, hlo_setup, k)
      lowered = hlo_step.lower(*hlo_setup.args)
      if target.platform == "tpu":
        compiled = lowered.compile()  # cached: the compile above
      else:
        compiled = lowered.compile(
          compiler_options={"xla_dump_to": tmp, "xla_gpu_dump_llvmir": False}
        )
        row["peak_bytes_hlo"] = testing.read_compiled(
          compiled, target=target
        ).peak_bytes
        row["largest_live_buffers_at_peak"] = live_at_peak(pathlib.Path(tmp))
      text = compiled.as_text()
      if hlo_dir is not None:
        hlo_dir.mkdir(parents=True, exist_ok=True)
        (hlo_dir / f"{target.name}_{approach}_k{k}.txt").write_text(text)
      row.update(collective_stats(text, 1 if approach in WHOLE_BATCH else k))
      row["outputs_sharded_like_inputs"] = _sharded_like_inputs(
        compiled, hlo_setup.args
      )
  except Exception as e:
    row["error"] = f"HLO for the collectives: {_compile.error(e)}"
  row["compile_s"] = round(time.perf_counter() - start, 1)
  return row


def hlo_mesh(target: jaxaccum.CompileTarget) -> Mesh:
  """A mesh of the target's own compile-only devices (its HLO is the
  target's); for a GPU, ``target.mesh()`` holds CPU stand-ins instead."""
  if target.platform == "tpu":
    return target.mesh((NUM_DEVICES,), (DATA,), axis_types=(AxisType.Auto,))
  devices = np.array(target.devices, dtype=object).reshape(NUM_DEVICES)
  return Mesh(devices, (DATA,), axis_types=(AxisType.Auto,))


# ---------------------------------------------------------------- the goal


def goal(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Per (target, k >= 2): is the default's peak at or below the full
  batch's and every peer's (``hand_scan``, ``optax_microbatch``)? One that
  did not compile does not count against it; the default not compiling does.
  ``ratios``: the default's peak over each one's."""
  out = []
  keys = dict.fromkeys((r["target"], r["model"], r["k"]) for r in rows)
  for target, model, k in keys:
    if k < 2:
      continue
    mine = {
      r["approach"]: r["peak_bytes"]
      for r in rows
      if (r["target"], r["model"], r["k"]) == (target, model, k)
    }
    default = mine.get(DEFAULT)
    others = {
      name: mine[name] for name in ("full_batch", *PEERS) if mine.get(name) is not None
    }
    below = sorted(name for name, peak in others.items() if default and peak < default)
    out.append(
      {
        "target": target,
        "model": model,
        "k": k,
        "met": default is not None and not below,
        "below_default": below,
        "default_peak_bytes": default,
        "ratios": {
          name: None if default is None else round(default / peak, 4)
          for name, peak in others.items()
        },
      }
    )
  return out


# ---------------------------------------------------------------- the report


def _unit(rows: list[dict[str, Any]]) -> tuple[str, int]:
  """GiB, or MiB for a model whose steps stay below one GiB."""
  peaks = [r["peak_bytes"] for r in rows if r.get("peak_bytes") is not None]
  return ("GiB", 2**30) if max(peaks, default=0) >= 2**30 else ("MiB", 2**20)


def plot(results: dict[str, Any], path: pathlib.Path) -> None:
  """Per target (rows): the peak per device against k, the full batch a
  horizontal line; the collective bytes per step per device against k."""
  plt = pyplot()
  rows = results["rows"]
  unit, scale = _unit(rows)
  targets = list(dict.fromkeys(r["target"] for r in rows))
  fig, axes = plt.subplots(
    len(targets), 2, figsize=(13, 4.6 * len(targets)), squeeze=False
  )
  styles = {
    "full_batch": ("k", "-", None),
    "full_batch_skip": ("gray", "--", None),
    "jaxaccum_per_micro_batch": ("C0", "-", "o"),
    "jaxaccum_once": ("C1", "--", "s"),
    "jaxaccum_cast_once": ("C4", "--", "D"),
    "jaxaccum_global": ("C5", ":", "P"),
    "hand_scan": ("C2", "-", "^"),
    "optax_microbatch": ("C3", "-", "v"),
  }
  for (ax_peak, ax_bytes), target in zip(axes, targets, strict=True):
    mine = [r for r in rows if r["target"] == target]
    ks = sorted({r["k"] for r in mine})
    for approach, name in APPROACHES.items():
      color, ls, marker = styles[approach]
      points = [r for r in mine if r["approach"] == approach]
      failed = [r["k"] for r in points if r["peak_bytes"] is None]
      label = name
      if failed and approach in WHOLE_BATCH:
        label += " (does not compile)"
      elif failed:
        label += f" (does not compile at k={','.join(map(str, failed))})"
      for ax, key in ((ax_peak, "peak_bytes"), (ax_bytes, "collective_bytes")):
        xy = [(r["k"], r[key] / scale) for r in points if r[key] is not None]
        if approach in WHOLE_BATCH and xy:
          ax.axhline(xy[0][1], color=color, ls=ls, lw=1.5, label=label)
        elif approach in WHOLE_BATCH:
          ax.plot([], [], color=color, ls=":", label=label)
        else:
          ax.plot(
            *(zip(*xy, strict=True) if xy else ([], [])),
            color=color,
            ls=ls,
            marker=marker,
            label=label,
          )
    if all(r["collective_bytes"] is None for r in mine):
      ax_bytes.set_yticks([])
    memory = results["targets"].get(target, {}).get("memory_bytes")
    highest = max((r["peak_bytes"] or 0 for r in mine), default=0)
    if memory and (highest > memory / 2 or any(r["peak_bytes"] is None for r in mine)):
      ax_peak.axhline(
        memory / scale,
        color="gray",
        ls=":",
        lw=1,
        label=f"device memory, {memory / 2**30:.0f} GiB",
      )
    title = results["targets"].get(target, {}).get("title", target)
    for ax, ylabel in (
      (ax_peak, f"peak {unit} per device"),
      (ax_bytes, f"collective {unit} per step, per device"),
    ):
      k_axis(ax, ks, ylabel, title=f"{title} x {NUM_DEVICES}")
      ax.minorticks_off()
    ax_peak.legend(fontsize=7)
  model = results["model"]
  fig.suptitle(
    f"FSDP over {NUM_DEVICES} devices: {model['num_params']:,}-parameter "
    f"Llama ({model['num_layers']} scanned layers), batch {model['batch_size']} x "
    f"{model['seq_len']} tokens, adamw; compile-only, jax "
    f"{results['versions']['jax']}, {results['date'][:10]}",
    fontsize=10,
  )
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


# ---------------------------------------------------------------- the manual's blocks


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


def fsdp_table(results: dict[str, Any]) -> str:
  rows_in = results["rows"]
  unit, scale = _unit(rows_in)
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


def fsdp_summary(results: dict[str, Any]) -> str:
  """The goal per target and k: the default's peak over the full batch's
  and each peer's, and its collective bytes over the hand-written scan's."""
  moved = {
    (r["target"], r["k"], r["approach"]): r["collective_bytes"] for r in results["rows"]
  }
  rows = []
  for g in results["goal"]:
    mine = moved.get((g["target"], g["k"], DEFAULT))
    scan = moved.get((g["target"], g["k"], "hand_scan"))
    rows.append(
      [
        results.get("targets", {}).get(g["target"], {}).get("title", g["target"]),
        g["k"],
        *(ratio(g["ratios"].get(a)) for a in ("full_batch", *PEERS)),
        ratio(mine / scan) if mine and scan else "–",
        "met" if g["met"] else "missed, below: " + ", ".join(g["below_default"]),
      ]
    )
  header = ["target", "k", "peak ÷ full batch", "÷ hand-written scan"]
  header += ["÷ optax.microbatch", "bytes ÷ hand-written scan", "goal"]
  return table(header, rows)


#: The blocks written from ``fsdp.json``, by name (for ``_report.py``).
BLOCKS = {
  "fsdp table": fsdp_table,
  "fsdp summary": fsdp_summary,
}


# ---------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = _paths.parser(
    __doc__,
    quick="a 3-layer model and k in 1 and 4 (minutes)",
    ks="comma-separated k (default 1,2,4,8,16)",
    targets=True,
  )
  parser.add_argument(
    "--model",
    choices=[m for m in _models.LLAMAS if m != "llama_quick"],
    help="the model (default llama_1b; llama_2.7b: pipeline.py's larger one, "
    "written to fsdp_llama_2.7b.json)",
  )
  parser.add_argument(
    "--approaches",
    type=_paths.names,
    help=f"comma-separated, of {', '.join(APPROACHES)} (default: all)",
  )
  parser.add_argument(
    "--hlo-dir",
    type=pathlib.Path,
    help="also write every compiled step's HLO text here (a few MB each)",
  )
  parser.add_argument(
    "--partial",
    type=pathlib.Path,
    metavar="FILE",
    help="write the rows here as they come, and take those it already holds "
    "instead of compiling them again (a long sweep resumed)",
  )
  parser.add_argument(
    "--collectives-from",
    type=pathlib.Path,
    metavar="HLO_DIR",
    help="compile nothing: recount the collectives of the results in --out "
    "from the HLO a run saved with --hlo-dir (after a fix to the reader)",
  )
  given = parser.parse_args(argv)
  partial_sweep = given.approaches is not None or given.ks is not None
  if partial_sweep and given.out == _paths.RESULTS and given.model is None:
    parser.error(
      "--approaches and --ks make a partial sweep of llama_1b: pass --out, so "
      "that benchmarks/results/fsdp.json keeps the whole one"
    )
  if given.quick and given.model is not None:
    parser.error("--quick compiles its own small model: drop --model")
  given.model = "llama_quick" if given.quick else given.model or "llama_1b"
  given.approaches = given.approaches or list(APPROACHES)
  unknown = [a for a in given.approaches if a not in APPROACHES]
  if unknown:
    parser.error(f"unknown approaches {unknown}; choose from {list(APPROACHES)}")
  given.ks = given.ks or list(QUICK_KS if given.quick else DEFAULT_KS)
  batch = _models.LLAMAS[given.model].batch_size
  bad = [k for k in given.ks if k < 1 or batch % (NUM_DEVICES * k)]
  if bad:
    parser.error(f"k={bad}: {batch} sequences over {NUM_DEVICES} devices do not split")
  return given


def run(args: argparse.Namespace) -> dict[str, Any]:
  """Compiles every target, approach and k; the JSON-ready results."""
  warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
  name = args.model
  cfg = _models.LLAMAS[name]
  shapes = _models.llama_shapes(cfg)
  rows: list[dict[str, Any]] = []
  done: dict[tuple[str, int, str], dict[str, Any]] = {}
  if args.partial is not None and args.partial.exists():  # resume a sweep
    done = {
      (r["target"], r["k"], r["approach"]): r
      for r in json.loads(args.partial.read_text())
    }
  targets = {}
  for target_name in args.targets:
    target = jaxaccum.compile_target(
      target_name, topology=_paths.TOPOLOGIES[target_name]
    )
    targets[target.name] = _compile.target_info(target)
    mesh = target.mesh((NUM_DEVICES,), (DATA,), axis_types=(AxisType.Auto,))
    setup = make_setup(name, cfg, mesh)
    hlo = setup if target.platform == "tpu" else make_setup(name, cfg, hlo_mesh(target))
    whole: dict[str, dict[str, Any]] = {}
    for k in args.ks:
      for approach in args.approaches:
        if (target.name, k, approach) in done:
          row = done[target.name, k, approach]
        elif approach in whole:
          row = {**whole[approach], "k": k}  # the same step for every k
        else:
          row = measure(approach, k, target, setup, hlo, hlo_dir=args.hlo_dir)
        if approach in WHOLE_BATCH:
          whole.setdefault(approach, row)
        if approach == DEFAULT:
          row["default"] = True
        mib = {
          key: "-" if row[key] is None else f"{row[key] / 2**20:,.0f}"
          for key in ("peak_bytes", "collective_bytes")
        }
        _compile.record(
          rows,
          row,
          args.partial,
          f"{target.name:<8} k={k:<3} {approach:<25} peak {mib['peak_bytes']} MiB, "
          f"collectives {mib['collective_bytes']} MiB, in the loop "
          f"{row['in_loop_collectives']} ({row['compile_s']} s)",
        )
  goals = goal(rows)
  return {
    "description": __doc__.split("\n\n")[0],
    "rows": rows,
    "goal": goals,
    "notes": NOTES,
    "model": {
      "name": name,
      **cfg.describe(),
      "num_params": sum(math.prod(x.shape) for x in jax.tree.leaves(shapes)),
      "param_bytes": _approaches.tree_bytes(shapes),
      "param_specs": {
        jax.tree_util.keystr(path): str(spec)
        for path, spec in jax.tree_util.tree_leaves_with_path(
          param_specs(cfg), is_leaf=lambda x: isinstance(x, P)
        )
      },
      "optimizer": "optax.adamw(0.0003, weight_decay=0.1)",
    },
    "targets": targets,
    "ks": args.ks,
    "approaches": APPROACHES,
    "versions": _versions(),
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "argv": sys.argv[1:],
  }


def _versions() -> dict[str, str]:
  names = ("jax", "jaxlib", "optax", "libtpu", "jax-cuda13-plugin", "jaxaccum")
  return {"python": platform.python_version(), **_compile.versions(*names)}


def recount(results: dict[str, Any], hlo_dir: pathlib.Path) -> dict[str, Any]:
  """``results`` with every row's collectives counted again from the HLO
  that run saved (``--hlo-dir``); the peaks are the compiler's and stay."""
  for row in results["rows"]:
    k = 1 if row["approach"] == "full_batch" else row["k"]
    path = hlo_dir / f"{row['target']}_{row['approach']}_k{k}.txt"
    row.update(collective_stats(path.read_text(), k))
  results["goal"] = goal(results["rows"])
  results["collectives_recounted"] = {
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "argv": sys.argv[1:],
    "versions": _versions(),
  }
  return results


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the sweep; writes the JSON and the PNG; prints the tables."""
  args = parse_args(argv)
  # Before JAX starts: 8 CPU devices stand in for the 8 H100s (a GPU target
  # of n devices needs n CPU devices), with threads enough for their
  # collectives.
  testing.cpu_devices()
  stem = {"llama_quick": "fsdp_quick", "llama_1b": "fsdp"}.get(
    args.model, f"fsdp_{args.model}"
  )
  if args.collectives_from is not None:
    results = recount(
      json.loads((args.out / f"{stem}.json").read_text()), args.collectives_from
    )
  else:
    start = time.perf_counter()
    results = run(args)
    results["wall_s"] = round(time.perf_counter() - start, 1)
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / f"{stem}.json").write_text(json.dumps(results, indent=1) + "\n")
  plot(results, args.out / f"{stem}.png")
  print(fsdp_table(results), fsdp_summary(results), sep="\n\n")
  print(
    f"\n{results['model']['num_params']:,} parameters; {results['wall_s']:.0f} s; "
    f"wrote {args.out / (stem + '.json')} and {args.out / (stem + '.png')}"
  )
  return results


if __name__ == "__main__":
  main()
