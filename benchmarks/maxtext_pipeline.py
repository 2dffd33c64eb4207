"""MaxText's own pipeline parallelism on ``pipeline.py``'s configurations,
compiled for 8 H100s: its peak memory and collective bytes per device.

Usage and install (Python 3.12, a venv of its own): ``benchmarks/README.md``.

:func:`compile_step` builds MaxText's train step as its ahead-of-time
compiler does, at :data:`SETTINGS`; ``pipeline.read`` reads it. Writes
``results/maxtext_pipeline.json`` a row at a time.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json
import pathlib
import sys
from typing import Any

import _compile
import _models
import _paths
import jax
import maxtext_llama
import pipeline

import jaxaccum
from jaxaccum import testing

RESULTS = _paths.RESULTS / "maxtext_pipeline.json"
TARGET, MODEL = "h100", "llama_1b"
VERSIONS = ("maxtext", "jax", "flax")
#: pipeline.py's llama_1b (fsdp.py's) in MaxText's llama2 decoder.
SETTINGS = {
  "model_name": "llama2-7b",
  "base_emb_dim": 2048,
  "base_num_query_heads": 16,
  "base_num_kv_heads": 16,
  "head_dim": 128,
  "base_mlp_dim": 5632,
  "base_num_decoder_layers": 16,
  "vocab_size": 32000,
  "max_target_length": 2048,
  "per_device_batch_size": 16,  # 128 sequences on 8 devices
  "dtype": "bfloat16",
  "weight_dtype": "float32",
  "remat_policy": "full",
  "hardware": "gpu",
  "ici_fsdp_parallelism": 1,
}


def config(stages: int, data: int, m: int, r: int) -> Any:
  """MaxText's config of one configuration (``maxtext_llama.COMMON``'s
  settings and :data:`SETTINGS`)."""
  return maxtext_llama.pyconfig(
    {
      **SETTINGS,
      "ici_pipeline_parallelism": stages,
      "ici_data_parallelism": data,
      "num_pipeline_microbatches": m,
      "num_pipeline_repeats": r,
      "num_layers_per_pipeline_stage": SETTINGS["base_num_decoder_layers"]
      // (stages * r),
    }
  )


def compile_step(cfg: Any, target: Any) -> Any:
  """MaxText's train step of ``cfg``, compiled for ``target``, as
  ``train_compile.py`` builds it (its mesh over the target's devices), and
  read (``jaxaccum.testing.CompiledStep``)."""
  from flax.linen import partitioning  # noqa: PLC0415
  from maxtext.trainers.pre_train import train, train_compile  # noqa: PLC0415
  from maxtext.utils import maxtext_utils, sharding  # noqa: PLC0415

  mesh = maxtext_utils.get_mesh_from_config(cfg, list(target.mesh().devices.flat))
  args, _, state_shardings, _, graphdef = train_compile.get_shaped_inputs(mesh, cfg)
  params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(
    cfg, state_shardings
  )
  state_shardings = sharding.build_zero1_input_state_mesh_shardings(
    cfg, state_shardings, params_shardings
  )
  data_sharding = sharding.get_input_data_sharding(cfg, mesh)
  step, in_shard, out_shard, _, donate = (
    maxtext_utils.get_functional_train_with_signature(
      train.train_step, data_sharding, state_shardings, graphdef, cfg, params_shardings
    )
  )
  jitted = jax.jit(
    step, in_shardings=in_shard, out_shardings=out_shard, donate_argnums=donate
  )
  with jax.set_mesh(mesh), partitioning.axis_rules(cfg.logical_axis_rules):
    return testing.compile_step(jitted, *args, target=target)


def measure(target: Any, stages: int, data: int, m: int, r: int) -> dict[str, Any]:
  """MaxText's fields of one row, read as ``pipeline.py`` reads its own."""
  row: dict[str, Any] = {"peak_bytes": None, "collective_bytes": None}

  def compile_it() -> dict[str, Any]:
    found = pipeline.read(compile_step(config(stages, data, m, r), target))
    del found["permute_executions"]
    return found

  return _compile.timed(row, compile_it)


def measure_jaxaccum(target: Any, stages: int, data: int, m: int, r: int) -> dict:
  """``pipeline.py``'s own row of the configuration, compiled here, with this
  venv's jax (pipeline.json's rows come from the dev venv's)."""
  cfg = _models.LLAMAS[MODEL]
  row = pipeline.measure(target, cfg, pipeline.Config(MODEL, stages, data, m, r))
  keys = ("peak_bytes", "collective_bytes", "permute_bytes", "compile_s", "error")
  return {k: row[k] for k in keys if k in row}


#: The JSON's ``note``: the manual's table shows the rows and
#: ``benchmarks/README.md`` says what was compiled.
NOTE = (
  "MaxText's own pipeline on pipeline.py's llama_1b configurations, compiled "
  "by benchmarks/maxtext_pipeline.py for the H100 (benchmarks/README.md)."
)


def main(argv: list[str] | None = None) -> None:
  parser = _paths.parser(__doc__, out=False)
  parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
  parser.add_argument(
    "--layouts",
    default=",".join(f"{s}x{d}" for s, d in pipeline.LAYOUTS),
    help="stages x data, comma-separated",
  )
  parser.add_argument(
    "--factors", default=[2], type=_paths.ints, help="m = factor * S, comma-separated"
  )
  parser.add_argument(
    "--repeats", default=[1], type=_paths.ints, help="r, comma-separated"
  )
  parser.add_argument(
    "--steps",
    default="maxtext,jaxaccum",
    help="what to compile per configuration (the other's fields are kept): "
    "maxtext, and jaxaccum (pipeline.py's step with this venv's jax); none: "
    "compile nothing, only write the note again",
  )
  args = parser.parse_args(argv)
  steps = args.steps.split(",")
  testing.cpu_devices(8)  # before JAX starts: the H100s' stand-ins
  target = jaxaccum.compile_target(TARGET, topology=_paths.TOPOLOGIES[TARGET])
  rows = json.loads(args.out.read_text())["rows"] if args.out.exists() else []
  for layout in args.layouts.split(","):
    stages, data = (int(n) for n in layout.split("x"))
    for m in (n * stages for n in args.factors):
      for r in args.repeats:
        key = {"target": target.name, "model": MODEL, "stages": stages}
        key.update(data=data, m=m, r=r)
        old = [x for x in rows if all(x[k] == v for k, v in key.items())]
        row = old[0] if old else {**key, "peak_bytes": None, "collective_bytes": None}
        if "maxtext" in steps:
          for k in ("error", "argument_bytes", "temp_bytes", "permute_bytes"):
            row.pop(k, None)
          row.update(measure(target, stages, data, m, r))
        if "jaxaccum" in steps:
          row["jaxaccum_same_jax"] = measure_jaxaccum(target, stages, data, m, r)
        rows = [x for x in rows if x is not row and x not in old] + [row]
        rows.sort(key=lambda x: (-x["stages"], x["m"], x["r"]))
        out = {"note": NOTE, "rows": rows, "versions": _compile.versions(*VERSIONS)}
        args.out.write_text(json.dumps(out, indent=1) + "\n")
        ours = row.get("jaxaccum_same_jax", {})
        print(
          f"S={stages} D={data} m={m} r={r}: MaxText peak {row['peak_bytes']}, "
          f"collectives {row['collective_bytes']} ({row.get('compile_s')} s) "
          f"{row.get('error', '')[:200]}; jaxaccum here {ours.get('peak_bytes')}, "
          f"{ours.get('collective_bytes')} {ours.get('error', '')[:200]}",
          file=sys.stderr,
          flush=True,
        )


if __name__ == "__main__":
  main()
