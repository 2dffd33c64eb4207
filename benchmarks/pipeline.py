"""Pipeline parallelism: memory and communication of a Llama-style model.

Usage::

  python benchmarks/pipeline.py [--quick] [--targets h100,tpu-v5e]
  python benchmarks/pipeline.py --render     # rewrite the manual's blocks only

Compile-only: nothing runs, and no accelerator is needed (the ``targets``
extra). The model is ``fsdp.py``'s Llama-style decoder (float32 master
weights cast to bfloat16 in the loss, each layer rematerialized with nothing
saved, a global batch of 128 sequences of 2,048 tokens), its decoder layers run by ``jaxaccum.pipeline`` on a
``"stage"`` axis beside a ``"data"`` axis, 8 devices in all: stages × data
= 8 × 1, 4 × 2 and 2 × 4. The embedding and the head run outside the
pipeline on the whole batch, replicated over the stages and sharded over
``"data"`` along the vocabulary (FSDP for those two matrices where there is a
data axis). One ``optax.adamw`` step, parameters and optimizer state donated,
under plain ``jit`` with ``data_axis="data"``.

Per configuration (``m`` pipeline micro-batches of the data shard, ``r``
circular repeats) and per device:

- ``peak_bytes``: XLA's compiled memory analysis for the target
  (``argument + output + temp - alias``, as ``jaxaccum.compiled_memory``);
- ``collective_bytes``: every collective's result bytes times the trip
  counts of the loops around it (``jaxaccum.testing.compile_step``), and the part that
  moves over the stage axis inside the pipeline loop;
- ``bubble``: the fraction of the loop's iterations a stage idles,
  ``(S - 1) / (r·m + S - 1)``.

The FSDP comparison is ``fsdp.py``'s results for the same model, batch,
devices and targets (``results/fsdp.json``): jaxaccum's best mode per
target, the lowest peak and the fewest bytes over the modes and ``k`` that
``fsdp.py`` measured (``results/fsdp_llama_2.7b.json``, from ``fsdp.py
--model llama_2.7b``, for the larger model: three modes at k = 1, 2, 16). A larger model (``--large``) shows where pipelining
starts to win. Outputs ``pipeline.json`` in ``--out``
and the generated blocks of ``benchmarks/README.md`` (written by this file's
``BLOCKS``, stitched in by ``_report.py``).
"""

# The manual's typography: multiplication signs.
# ruff: noqa: RUF001, RUF002

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import math
import pathlib
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

import _paths
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from jaxaccum import testing

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"
NUM_DEVICES = 8
LAYOUTS = ((8, 1), (4, 2), (2, 4))  # (stages, data)
MICRO_FACTORS = (1, 2, 4)  # m = factor * S
REPEATS = (1, 2)
TARGETS = {"h100": "1x1x8", "tpu-v5e": "2x4"}
PyTree = Any


def _bubble(stages: int, m: int, r: int) -> float:
  return (stages - 1) / (r * m + stages - 1)


# ---------------------------------------------------------------- the step


def _fsdp() -> Any:
  """``fsdp.py``, for its model (benchmarks/ is not a package)."""
  sys.path.insert(0, str(HERE))
  import fsdp  # noqa: PLC0415

  return fsdp


def make_step(cfg: Any, stages: int, data: int, m: int, r: int) -> Any:
  """The jitted, donated train step, and its sharded abstract arguments."""
  fsdp = _fsdp()

  head = cfg.d_model // cfg.num_heads
  inv_freq = 1.0 / (10_000 ** (np.arange(0, head, 2, dtype=np.float32) / head))
  angles = np.arange(cfg.seq_len, dtype=np.float32)[:, None] * inv_freq[None, :]
  cos_np, sin_np = np.cos(angles), np.sin(angles)

  def layer(w, x):
    """One decoder layer, as fsdp.py's (its weights cast to bfloat16)."""
    w = jax.tree.map(lambda a: a.astype(jnp.bfloat16), w)
    cos, sin = jnp.asarray(cos_np, x.dtype), jnp.asarray(sin_np, x.dtype)
    x = x + fsdp._attention(
      fsdp._rms_norm(x, w["attn_norm"]), w, cos, sin, cfg.num_heads
    )
    h = fsdp._rms_norm(x, w["mlp_norm"])
    return x + (jax.nn.silu(h @ w["w_gate"]) * (h @ w["w_up"])) @ w["w_down"]

  # Each layer rematerialized with nothing saved, as fsdp.py's (and MaxText's
  # remat_policy: full): a stage's backward pass holds one layer's internals.
  layer = jax.checkpoint(
    layer, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False
  )
  pipe = jaxaccum.pipeline(
    layer, num_stages=stages, num_micro_batches=m, repeats=r, data_axis="data"
  )

  def loss(params, tokens):
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    x = params["embed"].astype(jnp.bfloat16)[inputs]
    x = pipe(params["layers"], x)
    x = fsdp._rms_norm(x, params["final_norm"].astype(jnp.bfloat16))
    logits = (x @ params["unembed"].astype(jnp.bfloat16)).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  shapes = fsdp.param_shapes(cfg)
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
  tx = fsdp.optimizer()

  def step(params, opt_state, tokens):
    value, grads = jax.value_and_grad(loss)(params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return jax.jit(step, donate_argnums=(0, 1)), shapes, specs


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


def measure(target: Any, cfg: Any, config: Config) -> dict[str, Any]:
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
  start = time.perf_counter()
  try:
    mesh = target.mesh(
      (config.data, config.stages), ("data", "stage"), axis_types=(AxisType.Auto,) * 2
    )
    step, shapes, specs = make_step(cfg, config.stages, config.data, config.m, config.r)

    def on(x, spec):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

    params = jax.tree.map(on, shapes, specs)
    state = optax.tree_utils.tree_map_params(
      step_tx(),
      on,
      jax.eval_shape(step_tx().init, shapes),
      specs,
      transform_non_params=lambda x: on(x, P()),
      is_leaf=lambda x: isinstance(x, P),
    )
    tokens = on(
      jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len + 1), "int32"), P("data")
    )
    with jax.set_mesh(mesh):
      compiled = testing.compile_step(step, params, state, tokens, target=target)
  except Exception as e:  # recorded; the sweep goes on
    lines = str(e).strip().splitlines()
    row["error"] = f"{type(e).__name__}: {(lines[0] if lines else '')[:300]}"
    row["compile_s"] = round(time.perf_counter() - start, 1)
    return row
  found, stats = compiled.collectives, compiled.memory
  assert stats is not None, "the target reports no memory analysis"
  loop = [c for c in found if c.in_loop and "permute" in c.op]
  row.update(
    peak_bytes=stats.peak_bytes,
    argument_bytes=stats.argument_bytes,
    temp_bytes=stats.temp_bytes,
    collective_bytes=compiled.bytes_communicated,
    permute_bytes=sum(c.bytes * c.executions for c in loop),
    permute_executions=sorted({c.executions for c in loop}),
    in_loop_ops=sorted({c.op for c in found if c.in_loop}),
    compile_s=round(time.perf_counter() - start, 1),
  )
  return row


def step_tx() -> Any:
  return _fsdp().optimizer()


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


def large_config(fsdp: Any) -> Any:
  """A Llama-style model of about 2.7B parameters (d_model 2560, 32 layers),
  fsdp.py's batch: ``fsdp.MODELS["llama_2.7b"]``."""
  return fsdp.MODELS["llama_2.7b"]


def run(args: argparse.Namespace) -> dict[str, Any]:
  """Compiles every target, model and configuration; the JSON-ready results."""
  fsdp = _fsdp()
  warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
  if args.quick:  # 16 layers: every layout and repeat count divides them
    models = {
      "llama_quick": dataclasses.replace(fsdp.MODELS["llama_quick"], num_layers=16)
    }
  else:
    models = {"llama_1b": fsdp.MODELS["llama_1b"]}
  if args.large:
    models["llama_2.7b"] = large_config(fsdp)
  rows: list[dict[str, Any]] = []
  targets = {}
  for target_name in args.targets:
    target = jaxaccum.compile_target(target_name, topology=TARGETS[target_name])
    targets[target.name] = {"title": target.title, "memory_bytes": target.memory_bytes}
    if args.rows is not None:  # a sweep stopped early: its rows, as written
      continue
    for name, cfg in models.items():
      for config in configs(name, args.quick, name == "llama_2.7b"):
        if target_name in args.fewer_on and config.m != 2 * config.stages:
          continue
        row = measure(target, cfg, config)
        rows.append(row)
        if args.partial is not None:  # every row as it comes, for a long sweep
          args.partial.write_text(json.dumps(rows, indent=1) + "\n")
        print(
          f"{target.name:<8} {name:<11} S={config.stages} D={config.data} "
          f"m={config.m:<3} r={config.r} peak {_gib(row['peak_bytes'])} GiB, "
          f"collectives {_gib(row['collective_bytes'])} GiB ({row['compile_s']} s)"
          + (f"  {row['error'][:120]}" if "error" in row else ""),
          file=sys.stderr,
          flush=True,
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
          math.prod(x.shape) for x in jax.tree.leaves(fsdp.param_shapes(cfg))
        ),
      }
      for name, cfg in models.items()
    },
    "targets": targets,
    "fsdp": fsdp_best(),
    "maxtext": {"note": args.maxtext_note, "rows": []},
    "versions": {p: importlib.metadata.version(p) for p in ("jax", "jaxlib", "optax")},
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
  for path in sorted(RESULTS.glob("fsdp*.json")):
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


def _gib(n: float | None) -> str:
  return "–" if n is None else f"{n / 2**30:.2f}"


def _cell(row: dict[str, Any]) -> str:
  if row.get("peak_bytes") is None:
    return "refused" if "error" in row else "–"
  return f"{_gib(row['peak_bytes'])} / {_gib(row['collective_bytes'])}"


def table(results: dict[str, Any]) -> str:
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
        "| stages × data | m | r = 1 | r = 2 |",
        "|---|---|---|---|",
      ]
      keys = sorted({(r["stages"], r["data"], r["m"]) for r in rows}, reverse=True)
      for s, d, m in keys:
        cells = []
        for r in REPEATS:
          found = [
            x for x in rows if (x["stages"], x["data"], x["m"], x["r"]) == (s, d, m, r)
          ]
          cells.append(
            f"{_cell(found[0])} ({found[0]['bubble']:.2f})" if found else "–"
          )
        lines.append(f"| {s} × {d} | {m} | {' | '.join(cells)} |")
      fsdp = results["fsdp"].get(model, {}).get(target)
      if fsdp:
        low, few = fsdp["lowest_peak"], fsdp["fewest_bytes"]
        lines += [
          "",
          "jaxaccum's FSDP on the same 8 devices (`fsdp.py`): its lowest peak "
          f"(`{low['approach'].removeprefix('jaxaccum_')}`, k = {low['k']}) "
          f"{_gib(low['peak_bytes'])} / {_gib(low['collective_bytes'])}; its "
          f"fewest bytes (`{few['approach'].removeprefix('jaxaccum_')}`, k = "
          f"{few['k']}) {_gib(few['peak_bytes'])} / {_gib(few['collective_bytes'])}.",
        ]
      parts.append("\n".join(lines))
  return "\n\n".join(parts)


def summary(results: dict[str, Any]) -> str:
  """The ``pipeline summary`` block: the lowest peak per target and model,
  against FSDP."""
  bullets = []
  for target, info in results["targets"].items():
    for model in results["models"]:
      rows = [
        r
        for r in results["rows"]
        if r["target"] == target and r["model"] == model and r["peak_bytes"]
      ]
      if not rows:
        continue
      low = min(rows, key=lambda r: r["peak_bytes"])
      few = min(rows, key=lambda r: r["collective_bytes"])
      text = (
        f"**{info['title']}, `{model}`.** Lowest peak {_gib(low['peak_bytes'])} GiB "
        f"at {low['stages']} × {low['data']}, m = {low['m']}, r = {low['r']} "
        f"(bubble {low['bubble']:.2f}); fewest collective bytes "
        f"{_gib(few['collective_bytes'])} GiB at {few['stages']} × {few['data']}, "
        f"m = {few['m']}, r = {few['r']}"
      )
      fsdp = results["fsdp"].get(model, {}).get(target)
      if fsdp:
        text += "; " + _against_fsdp(low, few, fsdp)
      bullets.append(text + ".")
    crossing = _bytes_by_size(results, target, info["title"])
    if crossing:
      bullets.append(crossing)
    refused = [r for r in results["rows"] if r["target"] == target and "error" in r]
    if refused:
      bullets.append(
        f"**{info['title']}**: {len(refused)} configurations refused by the "
        "compiler (beyond the device's memory, or an error), shown as refused."
      )
  return "\n".join(f"- {b}" for b in bullets)


def _against_fsdp(
  low: dict[str, Any], few: dict[str, Any], fsdp: dict[str, Any]
) -> str:
  """The pipeline's lowest peak and fewest bytes against FSDP's."""
  peak = low["peak_bytes"] / fsdp["lowest_peak"]["peak_bytes"]
  moved = few["collective_bytes"] / fsdp["fewest_bytes"]["collective_bytes"]
  return (
    f"against jaxaccum's FSDP of the same model, the lowest peak is {peak:.2f} × "
    f"FSDP's lowest and the fewest bytes {moved:.2f} × FSDP's fewest (whose peak "
    f"is {_gib(fsdp['fewest_bytes']['peak_bytes'])} GiB)"
  )


def _bytes_by_size(results: dict[str, Any], target: str, title: str) -> str | None:
  """Where pipelining starts to move fewer bytes than FSDP: the ratio of
  their fewest bytes per step at every model size measured both ways."""
  ratios = []
  for model, described in results["models"].items():
    fsdp = results["fsdp"].get(model, {}).get(target)
    rows = [
      r
      for r in results["rows"]
      if r["target"] == target and r["model"] == model and r.get("collective_bytes")
    ]
    if fsdp and rows:
      few = min(r["collective_bytes"] for r in rows)
      ratio = few / fsdp["fewest_bytes"]["collective_bytes"]
      ratios.append((described["num_params"], model, ratio))
  if len(ratios) < 2:
    return None
  ratios.sort()
  listed = ", ".join(f"{ratio:.2f} × at `{model}`" for _, model, ratio in ratios)
  fewer = [f"`{model}`" for _, model, ratio in ratios if ratio <= 1]
  where = (
    f"the pipeline moves fewer at {', '.join(fewer)}"
    if fewer
    else "the pipeline moves more at every size measured"
  )
  return (
    f"**{title}, pipeline ÷ FSDP in bytes per step** (the fewest of each over "
    f"what was measured at each size): {listed}; {where}."
  )


def maxtext_table(results: dict[str, Any]) -> str:
  """The ``pipeline maxtext`` block: MaxText's own pipeline on the same
  configurations, against jaxaccum's, a row per configuration."""
  maxtext = results["maxtext"]
  if not maxtext["rows"]:
    return f"{maxtext['note']}"
  lines = [
    maxtext["note"],
    "",
    "| target | stages × data | m | r | bubble | MaxText: peak / collective GiB "
    "| jaxaccum: peak / collective GiB | jaxaccum ÷ MaxText: peak / bytes "
    "| at or below MaxText |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for m in maxtext["rows"]:
    config = (m["stages"], m["data"], m["m"], m["r"])
    ours = [
      r
      for r in results["rows"]
      if (r["target"], r["model"]) == (m["target"], m["model"])
      and (r["stages"], r["data"], r["m"], r["r"]) == config
      and r["peak_bytes"]
    ]
    head = (
      f"| {m['target']} | {m['stages']} × {m['data']} | {m['m']} | {m['r']} "
      f"| {_bubble(m['stages'], m['m'], m['r']):.2f} "
    )
    if m.get("peak_bytes") is None:
      lines.append(head + f"| did not compile: {m['error']} | | | |")
      continue
    theirs = f"{_gib(m['peak_bytes'])} / {_gib(m['collective_bytes'])}"
    if not ours:
      lines.append(head + f"| {theirs} | not measured | | |")
      continue
    o = ours[0]
    peak = o["peak_bytes"] / m["peak_bytes"]
    moved = o["collective_bytes"] / m["collective_bytes"]
    met = o["peak_bytes"] <= m["peak_bytes"] and (
      o["collective_bytes"] <= m["collective_bytes"]
    )
    lines.append(
      head + f"| {theirs} | {_gib(o['peak_bytes'])} / {_gib(o['collective_bytes'])} "
      f"| {peak:.2f} / {moved:.2f} | {'yes' if met else '**no**'} |"
    )
  return "\n".join(lines)


#: The blocks of ``benchmarks/README.md`` this file writes from ``pipeline.json``.
BLOCKS = {
  "pipeline table": table,
  "pipeline summary": summary,
  "pipeline maxtext": maxtext_table,
}


# ---------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="a small model, 2 rows")
  parser.add_argument("--large", action="store_true", help="also a 2.7B model")
  parser.add_argument(
    "--targets", default="h100,tpu-v5e", type=lambda s: s.split(","), help="targets"
  )
  parser.add_argument(
    "--fewer-on",
    default="",
    type=lambda s: [t for t in s.split(",") if t],
    help="targets on which only m = 2S is compiled",
  )
  parser.add_argument(
    "--maxtext-note",
    default="Not compared: MaxText was not installed for this run.",
    help="what the MaxText comparison gave (a sentence for the manual)",
  )
  parser.add_argument(
    "--out",
    type=pathlib.Path,
    help="output folder (default: benchmarks/results; quick: the temporary folder)",
  )
  parser.add_argument(
    "--partial",
    type=pathlib.Path,
    default=None,
    help="write the rows here as they come",
  )
  parser.add_argument(
    "--rows",
    type=pathlib.Path,
    default=None,
    help="compile nothing: the results of the rows --partial wrote (a sweep "
    "stopped early), with the same flags",
  )
  parser.add_argument(
    "--render", action="store_true", help="only rewrite the manual's blocks"
  )
  parser.add_argument(
    "--maxtext",
    type=pathlib.Path,
    default=None,
    metavar="JSON",
    help="merge MaxText's measured rows ({note, rows}) into pipeline.json, "
    "with fsdp.py's results read again",
  )
  args = parser.parse_args(argv)
  args.out = _paths.output_folder(args.out, args.quick)
  return args


def render_manual() -> None:
  """Rewrites the generated blocks of the manuals (``_report.py``)."""
  sys.path.insert(0, str(HERE))
  import _report  # noqa: PLC0415

  _report.main([])


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
    print(table(results))
    print(summary(results))
    if args.quick:
      return
  render_manual()


if __name__ == "__main__":
  main()
