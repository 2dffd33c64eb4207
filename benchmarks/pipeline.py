"""Pipeline parallelism: memory and communication of a Llama-style model.

Compile-only (the ``targets`` extra): ``fsdp.py``'s Llama with its layers
run by ``jaxaccum.pipeline`` on a ``"stage"`` axis beside ``"data"``
(:func:`make_step`), per layout of :data:`LAYOUTS`, ``m`` and ``r``, read by
:func:`read`, against ``fsdp.py``'s results (:func:`fsdp_best`). Outputs
``pipeline.json`` in ``--out`` and rewrites the manuals.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import dataclasses
import datetime
import json
import math
import pathlib
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

import _approaches
import _compile
import _models
import _paths
import jax
import jax.numpy as jnp
import optax
from _report import gib, table
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxaccum
from jaxaccum import testing

NUM_DEVICES = 8
LAYOUTS = ((8, 1), (4, 2), (2, 4))  # (stages, data)
MICRO_FACTORS = (1, 2, 4)  # m = factor * S
REPEATS = (1, 2)


def _bubble(stages: int, m: int, r: int) -> float:
  return (stages - 1) / (r * m + stages - 1)


# ---------------------------------------------------------------- the step


def make_step(cfg: _models.LlamaConfig, stages: int, m: int, r: int) -> Any:
  """The jitted, donated train step, and its parameters' shapes and specs."""
  layer = _models.llama_layer(cfg, cast=True)  # fsdp.py's, its weights cast
  pipe = jaxaccum.pipeline(
    lambda w, x: layer(x, w),
    num_stages=stages,
    num_micro_batches=m,
    repeats=r,
    data_axis="data",
  )

  def loss(params, tokens):
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    x = params["embed"].astype(jnp.bfloat16)[inputs]
    x = pipe(params["layers"], x)
    x = _models.rms_norm(x, params["final_norm"].astype(jnp.bfloat16))
    logits = (x @ params["unembed"].astype(jnp.bfloat16)).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  shapes = _models.llama_shapes(cfg)
  if r > 1:
    shapes["layers"] = jax.tree.map(
      lambda s: jax.ShapeDtypeStruct((r, s.shape[0] // r, *s.shape[1:]), s.dtype),
      shapes["layers"],
    )
  layer_spec = P("stage") if r == 1 else P(None, "stage")
  specs = {
    "embed": P("data", None),
    "layers": jax.tree.map(lambda _: layer_spec, shapes["layers"]),
    "final_norm": P(),
    "unembed": P(None, "data"),
  }
  tx = _models.llama_optimizer()
  return _approaches.train_step(jax.value_and_grad(loss), tx), shapes, specs


@dataclasses.dataclass(frozen=True)
class Config:
  model: str
  stages: int
  data: int
  m: int
  r: int

  @property
  def bubble(self) -> float:
    return _bubble(self.stages, self.m, self.r)


def measure(target: Any, cfg: _models.LlamaConfig, config: Config) -> dict[str, Any]:
  """One row: the step of ``config`` compiled for ``target``."""
  row: dict[str, Any] = {
    "target": target.name,
    **dataclasses.asdict(config),
    "bubble": config.bubble,
    "iterations": config.r * config.m + config.stages - 1,
    "rows_per_micro_batch": cfg.batch_size // config.data // config.m,
    "peak_bytes": None,
    "collective_bytes": None,
  }

  def compile_it() -> dict[str, Any]:
    mesh = target.mesh(
      (config.data, config.stages), ("data", "stage"), axis_types=(AxisType.Auto,) * 2
    )
    step, shapes, specs = make_step(cfg, config.stages, config.m, config.r)
    tokens = jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len + 1), "int32")
    args = _compile.train_args(
      _models.llama_optimizer(),
      shapes,
      specs,
      mesh,
      tokens=tokens,
      tokens_spec=P("data"),
    )
    with jax.set_mesh(mesh):
      compiled = testing.compile_step(step, *args, target=target)
    return read(compiled)

  return _compile.timed(row, compile_it)


def read(compiled: testing.CompiledStep) -> dict[str, Any]:
  """A compiled pipelined step's peak, collective bytes and the
  collective-permutes in its loop (``maxtext_pipeline.py`` reads MaxText's
  the same way)."""
  found, stats = compiled.collectives, compiled.memory
  assert stats is not None, "the target reports no memory analysis"
  loop = [c for c in found if c.in_loop and "permute" in c.op]
  return {
    "peak_bytes": stats.peak_bytes,
    "argument_bytes": stats.argument_bytes,
    "temp_bytes": stats.temp_bytes,
    "collective_bytes": compiled.bytes_communicated,
    "permute_bytes": sum(c.bytes * c.executions for c in loop),
    "permute_executions": sorted({c.executions for c in loop}),
    "in_loop_ops": sorted({c.op for c in found if c.in_loop}),
  }


# ---------------------------------------------------------------- the sweep


def configs(model: str, quick: bool, large: bool) -> list[Config]:
  if quick:
    return [Config(model, s, d, s, r) for s, d in ((4, 2),) for r in REPEATS]
  if large:  # the larger model: the layouts at m = 2S
    return [Config(model, s, d, 2 * s, r) for s, d in LAYOUTS for r in REPEATS]
  return [
    Config(model, s, d, f * s, r)
    for s, d in LAYOUTS
    for f in MICRO_FACTORS
    for r in REPEATS
  ]


def run(args: argparse.Namespace) -> dict[str, Any]:
  """Compiles every target, model and configuration; the JSON-ready results."""
  warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
  if args.quick:  # 16 layers: every layout and repeat count divides them
    models = {
      "llama_quick": dataclasses.replace(_models.LLAMAS["llama_quick"], num_layers=16)
    }
  else:
    models = {"llama_1b": _models.LLAMAS["llama_1b"]}
  if args.large:  # about 2.7B parameters (d_model 2560, 32 layers)
    models["llama_2.7b"] = _models.LLAMAS["llama_2.7b"]
  rows: list[dict[str, Any]] = []
  targets = {}
  for target_name in args.targets:
    target = jaxaccum.compile_target(
      target_name, topology=_paths.TOPOLOGIES[target_name]
    )
    targets[target.name] = {"title": target.title, "memory_bytes": target.memory_bytes}
    if args.rows is not None:  # a sweep stopped early: its rows, as written
      continue
    for name, cfg in models.items():
      for config in configs(name, args.quick, name == "llama_2.7b"):
        if target_name in args.fewer_on and config.m != 2 * config.stages:
          continue
        row = measure(target, cfg, config)
        _compile.record(
          rows,
          row,
          args.partial,
          f"{target.name:<8} {name:<11} S={config.stages} D={config.data} "
          f"m={config.m:<3} r={config.r} peak {gib(row['peak_bytes'])} GiB, "
          f"collectives {gib(row['collective_bytes'])} GiB ({row['compile_s']} s)",
        )
  if args.rows is not None:
    rows = json.loads(args.rows.read_text())
  return {
    "description": __doc__.split("\n\n")[0],
    "rows": rows,
    "models": {
      name: {
        **cfg.describe(),
        "num_params": sum(
          math.prod(x.shape) for x in jax.tree.leaves(_models.llama_shapes(cfg))
        ),
      }
      for name, cfg in models.items()
    },
    "targets": targets,
    "fsdp": fsdp_best(),
    "maxtext": {"note": args.maxtext_note, "rows": []},
    "versions": _compile.versions("jax", "jaxlib", "optax"),
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "argv": sys.argv[1:],
  }


def fsdp_best() -> dict[str, Any]:
  """From ``fsdp.py``'s results (``results/fsdp.json``, and
  ``results/fsdp_<model>.json`` from ``fsdp.py --model``): per model and
  target, jaxaccum's FSDP rows with the lowest peak and with the fewest
  collective bytes (over the modes and k in the file), the model's size and
  the run's date."""
  best: dict[str, Any] = {}
  for path in sorted(_paths.RESULTS.glob("fsdp*.json")):
    data = json.loads(path.read_text())
    model = data["model"]["name"]
    entry = best.setdefault(
      model, {"date": data.get("date"), "num_params": data["model"]["num_params"]}
    )
    keys = ("approach", "k", "peak_bytes", "collective_bytes")
    for row in data["rows"]:
      if not row["approach"].startswith("jaxaccum") or row.get("peak_bytes") is None:
        continue
      kept = entry.setdefault(row["target"], {})
      for name, key in (
        ("lowest_peak", "peak_bytes"),
        ("fewest_bytes", "collective_bytes"),
      ):
        if name not in kept or row[key] < kept[name][key]:
          kept[name] = {k: row[k] for k in keys}
  return best


# ---------------------------------------------------------------- the report


def _pair(row: dict[str, Any]) -> str:
  """``peak / collective`` GiB of a row."""
  return f"{gib(row['peak_bytes'])} / {gib(row['collective_bytes'])}"


def _cell(row: dict[str, Any]) -> str:
  if row.get("peak_bytes") is None:
    return "refused" if "error" in row else "–"
  return _pair(row)


def pipeline_table(results: dict[str, Any]) -> str:
  """The ``pipeline table`` block: per target and model, a row per layout
  and ``m``, a column per repeat count."""
  parts = []
  for target, info in results["targets"].items():
    for model, described in results["models"].items():
      rows = [
        r for r in results["rows"] if r["target"] == target and r["model"] == model
      ]
      if not rows:
        continue
      lines = [
        f"**{info['title']}** × 8, `{model}` ({described['num_params']:,} "
        "parameters): peak GiB per device / collective GiB per step per device "
        "(bubble fraction)",
        "",
      ]
      keys = sorted({(r["stages"], r["data"], r["m"]) for r in rows}, reverse=True)
      cells = []
      for s, d, m in keys:
        found = {
          x["r"]: f"{_cell(x)} ({x['bubble']:.2f})"
          for x in rows
          if (x["stages"], x["data"], x["m"]) == (s, d, m)
        }
        cells.append([f"{s} × {d}", m, *(found.get(r, "–") for r in REPEATS)])
      lines.append(table(["stages × data", "m", *(f"r = {r}" for r in REPEATS)], cells))
      fsdp = results["fsdp"].get(model, {}).get(target)
      if fsdp:
        low, few = fsdp["lowest_peak"], fsdp["fewest_bytes"]
        lines += [
          "",
          "jaxaccum's FSDP on the same 8 devices (`fsdp.py`): its lowest peak "
          f"(`{low['approach'].removeprefix('jaxaccum_')}`, k = {low['k']}) "
          f"{_pair(low)}; its fewest bytes "
          f"(`{few['approach'].removeprefix('jaxaccum_')}`, k = {few['k']}) "
          f"{_pair(few)}.",
        ]
      parts.append("\n".join(lines))
  return "\n\n".join(parts)


def _where(r: dict[str, Any]) -> str:
  return f"{r['stages']} × {r['data']}, m = {r['m']}, r = {r['r']}"


def pipeline_summary(results: dict[str, Any]) -> str:
  """The ``pipeline summary`` block: per target and model, the
  configurations with the lowest peak and the fewest bytes, against
  jaxaccum's FSDP of the same model, and how many XLA refused."""
  rows = []
  for target, info in results["targets"].items():
    for model in results["models"]:
      mine = [
        r for r in results["rows"] if (r["target"], r["model"]) == (target, model)
      ]
      fit = [r for r in mine if r["peak_bytes"]]
      fsdp = results["fsdp"].get(model, {}).get(target)
      cells = ["–"] * 4
      if fit:
        low = min(fit, key=lambda r: r["peak_bytes"])
        few = min(fit, key=lambda r: r["collective_bytes"])
        cells[:2] = [
          f"{gib(low['peak_bytes'])} ({_where(low)}, bubble {low['bubble']:.2f})",
          f"{gib(few['collective_bytes'])} ({_where(few)})",
        ]
        if fsdp:
          cells[2] = f"{low['peak_bytes'] / fsdp['lowest_peak']['peak_bytes']:.2f}"
          few_bytes = fsdp["fewest_bytes"]["collective_bytes"]
          cells[3] = f"{few['collective_bytes'] / few_bytes:.2f}"
      if mine:
        refused = sum("error" in r for r in mine)
        rows.append([info["title"], f"`{model}`", *cells, refused])
  header = ["target", "model", "lowest peak, GiB", "fewest collective GiB"]
  header += ["peak ÷ FSDP's lowest", "bytes ÷ FSDP's fewest", "refused"]
  return table(header, rows)


def maxtext_table(results: dict[str, Any]) -> str:
  """The ``pipeline maxtext`` block: MaxText's own pipeline on the same
  configurations, against jaxaccum's (pipeline.json's rows, and the same
  step compiled with MaxText's jax), a row per configuration."""
  maxtext = results["maxtext"]
  if not maxtext["rows"]:
    return f"{maxtext['note']}"
  ours = {
    (r["target"], r["model"], r["stages"], r["data"], r["m"], r["r"]): r
    for r in results["rows"]
    if r["peak_bytes"]
  }
  rows = []
  for m in maxtext["rows"]:
    config = [f"{m['stages']} × {m['data']}", m["m"], m["r"]]
    head = [m["target"], *config, f"{_bubble(m['stages'], m['m'], m['r']):.2f}"]
    if m.get("peak_bytes") is None:
      rows.append([*head, f"did not compile: {m['error']}", "", "", "", ""])
      continue
    o = ours.get((m["target"], m["model"], m["stages"], m["data"], m["m"], m["r"]))
    if o is None:
      rows.append([*head, _pair(m), "not measured", "", "", ""])
      continue
    same = m.get("jaxaccum_same_jax", {})
    met = o["peak_bytes"] <= m["peak_bytes"] and (
      o["collective_bytes"] <= m["collective_bytes"]
    )
    rows.append(
      [
        *head,
        _pair(m),
        _pair(o),
        f"{o['peak_bytes'] / m['peak_bytes']:.2f} / "
        f"{o['collective_bytes'] / m['collective_bytes']:.2f}",
        f"{same['peak_bytes'] / m['peak_bytes']:.2f} / "
        f"{same['collective_bytes'] / m['collective_bytes']:.2f}"
        if same.get("peak_bytes")
        else "–",
        "yes" if met else "**no**",
      ]
    )
  v = maxtext.get("versions", {})
  header = ["target", "stages × data", "m", "r", "bubble"]
  header += ["MaxText: peak / collective GiB", "jaxaccum: peak / collective GiB"]
  header += ["jaxaccum ÷ MaxText: peak / bytes", "the same, MaxText's jax"]
  header += ["at or below MaxText"]
  return (
    f"MaxText {v.get('maxtext', '?')}, jax {v.get('jax', '?')} (MaxText's venv):\n\n"
    + table(header, rows)
  )


#: The blocks of ``benchmarks/README.md`` this file writes from ``pipeline.json``.
BLOCKS = {
  "pipeline table": pipeline_table,
  "pipeline summary": pipeline_summary,
  "pipeline maxtext": maxtext_table,
}


# ---------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = _paths.parser(__doc__, quick="a small model, 2 rows", targets=True)
  parser.add_argument("--large", action="store_true", help="also a 2.7B model")
  parser.add_argument(
    "--fewer-on",
    default="",
    type=_paths.names,
    help="targets on which only m = 2S is compiled",
  )
  parser.add_argument(
    "--maxtext-note",
    default="Not compared: MaxText was not installed for this run.",
    help="what the MaxText comparison gave (a sentence for the manual)",
  )
  parser.add_argument(
    "--partial", type=pathlib.Path, help="write the rows here as they come"
  )
  parser.add_argument(
    "--rows",
    type=pathlib.Path,
    help="compile nothing: the results of the rows --partial wrote (a sweep "
    "stopped early), with the same flags",
  )
  parser.add_argument(
    "--render", action="store_true", help="only rewrite the manual's blocks"
  )
  parser.add_argument(
    "--maxtext",
    type=pathlib.Path,
    metavar="JSON",
    help="merge MaxText's measured rows ({note, rows}) into pipeline.json, "
    "with fsdp.py's results read again",
  )
  return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
  args = parse_args(argv)
  testing.cpu_devices(NUM_DEVICES)  # before JAX starts: the targets' stand-ins
  if args.maxtext is not None or args.render:  # nothing compiled
    path = args.out / "pipeline.json"
    results = json.loads(path.read_text())
    if args.maxtext is not None:
      results["maxtext"] = json.loads(args.maxtext.read_text())
    results["fsdp"] = fsdp_best()  # fsdp.py's results, read again
    path.write_text(json.dumps(results, indent=1) + "\n")
  else:
    start = time.perf_counter()
    results = run(args)
    results["wall_s"] = round(time.perf_counter() - start, 1)
    stem = "pipeline_quick" if args.quick else "pipeline"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=1) + "\n")
    print(pipeline_table(results), pipeline_summary(results), sep="\n\n")
    if args.quick:
      return
  import _report  # noqa: PLC0415  (the manuals' generator)

  _report.main([])


if __name__ == "__main__":
  main()
