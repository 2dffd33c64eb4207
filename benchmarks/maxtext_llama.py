"""MaxText's own llama, unmodified, through ``jaxaccum.value_and_grad(...,
mesh=..., view="global")``: equal to its full batch on every mesh.

Usage (Python 3.12, in a venv of its own: MaxText needs it)::

  python3.12 -m venv /tmp/maxtext-venv && . /tmp/maxtext-venv/bin/activate
  pip install maxtext==0.2.5 -e .
  python benchmarks/maxtext_llama.py            # writes results/maxtext_llama.json

MaxText's model is built as its trainer builds it (``pyconfig``, its mesh,
its logical-axis rules, its NNX model and its ``train.loss_fn``), as a tiny
llama2 (2 layers, d_model 64, 4 heads, vocabulary 256, 32 tokens, 2
sequences per device) in float32 on 8 CPU devices. Its activation
constraints name the data axes on the batch dimension, which
``view="global"`` accepts as written: ``fun`` sees the global micro-batch,
as under plain ``jit``. The loss is MaxText's token-weighted cross-entropy,
returned as ``(xent_sum, total_weights)`` with ``normalize="weighted"``.

Per mesh (data 8, fsdp 8, data 4 x fsdp 2) and k: the loss and the largest
relative gradient difference (max |a - b| / max |b| per leaf) against
``jax.value_and_grad`` of MaxText's loss on the whole batch.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import datetime
import importlib.metadata
import json
import pathlib
import platform
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxaccum
from jaxaccum import testing

MESHES = {
  "data (8)": {"ici_data_parallelism": 8, "ici_fsdp_parallelism": 1},
  "fsdp (8)": {"ici_data_parallelism": 1, "ici_fsdp_parallelism": 8},
  "data (4) x fsdp (2)": {"ici_data_parallelism": 4, "ici_fsdp_parallelism": 2},
}
KS = (2, 4)
RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "maxtext_llama.json"


def config(parallelism: dict[str, int]) -> Any:
  """MaxText's config of the tiny float32 llama2."""
  import maxtext  # noqa: PLC0415
  from maxtext.configs import pyconfig  # noqa: PLC0415

  base = pathlib.Path(maxtext.__file__).parent / "configs" / "base.yml"
  settings = {
    "model_name": "llama2-7b",
    "override_model_config": "true",
    "base_emb_dim": 64,
    "base_num_query_heads": 4,
    "base_num_kv_heads": 4,
    "base_mlp_dim": 128,
    "base_num_decoder_layers": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "max_target_length": 32,
    "per_device_batch_size": 2,
    "attention": "dot_product",
    "dtype": "float32",
    "matmul_precision": "highest",
    "hardware": "cpu",
    "enable_checkpointing": "false",
    "dataset_type": "synthetic",
    "run_name": "jaxaccum",
    "base_output_directory": "/tmp/jaxaccum-maxtext",
    "enable_goodput_recording": "false",
    "skip_jax_distributed_system": "true",
    **parallelism,
  }
  return pyconfig.initialize(
    [None, str(base), *(f"{k}={v}" for k, v in settings.items())]
  )


def measure(name: str, parallelism: dict[str, int]) -> dict[str, Any]:
  """The full batch against jaxaccum's global view at each k, on one mesh."""
  from flax import nnx  # noqa: PLC0415
  from flax.linen import partitioning  # noqa: PLC0415
  from maxtext.common import train_state_nnx  # noqa: PLC0415
  from maxtext.optimizers import optimizers  # noqa: PLC0415
  from maxtext.trainers.pre_train import train  # noqa: PLC0415
  from maxtext.utils import maxtext_utils, model_creation_utils, sharding  # noqa: PLC0415

  cfg = config(parallelism)
  mesh = maxtext_utils.get_mesh_from_config(cfg)

  def rules():
    return partitioning.axis_rules(cfg.logical_axis_rules)

  create_model, abstract = model_creation_utils.create_nnx_abstract_model(cfg, mesh)
  tx = optimizers.get_optimizer(
    cfg, maxtext_utils.create_learning_rate_schedule(cfg), abstract, mesh=mesh
  )

  def init_state():
    model = create_model()
    return train_state_nnx.TrainStateNNX(model, nnx.Optimizer(model, tx, wrt=nnx.Param))

  _, _, shardings = maxtext_utils.get_abstract_state(cfg, mesh, init_state, True)
  with rules():
    state = jax.jit(lambda: nnx.state(init_state()), out_shardings=shardings)()
    model = nnx.merge(nnx.graphdef(nnx.eval_shape(init_state)), state).model
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  rows, length = cfg.global_batch_size_to_train_on, cfg.max_target_length
  tokens = np.random.default_rng(0).integers(1, cfg.vocab_size, (rows, length + 1))
  positions = np.broadcast_to(np.arange(length), (rows, length))
  ones = np.ones((rows, length))
  batch = {
    "inputs": tokens[:, :-1],
    "inputs_position": positions,
    "inputs_segmentation": ones,
    "targets": tokens[:, 1:],
    "targets_position": positions,
    "targets_segmentation": ones,
  }
  batch = jax.device_put(
    {k: np.asarray(v, np.int32) for k, v in batch.items()},
    sharding.get_input_data_sharding(cfg, mesh),
  )

  def maxtext_loss(params, batch, rest):
    model = nnx.merge(graphdef, params, rest, copy=True)
    return train.loss_fn(model, cfg, dict(batch), None, None, is_train=True)

  def full_loss(params, batch, rest):
    return maxtext_loss(params, batch, rest)[0]

  def summed_loss(params, batch, rest):  # normalize="weighted": (sum, weight)
    aux = maxtext_loss(params, batch, rest)[1]
    return aux["xent_sum"], aux["total_weights"]

  row: dict[str, Any] = {"mesh": name, "axes": dict(mesh.shape), "ks": {}}
  data_axes = tuple(a for a in ("data", "fsdp") if mesh.shape[a] > 1)
  with jax.set_mesh(mesh), rules():
    value, want = jax.jit(jax.value_and_grad(full_loss))(params, batch, rest)
    row["full_batch_loss"] = float(value)
    for k in KS:
      step = jaxaccum.value_and_grad(
        summed_loss,
        k,
        normalize="weighted",
        mesh=mesh,
        data_axis=data_axes,
        view="global",
        param_specs=jax.tree.map(lambda x: x.sharding.spec, params),
      )
      value, grads = jax.jit(step)(params, batch, rest)
      differences = [
        float(jnp.max(jnp.abs(g - w)) / jnp.max(jnp.abs(w)))
        for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True)
      ]
      row["ks"][str(k)] = {"loss": float(value), "grad_rel_diff": max(differences)}
      print(
        f"{name:<20} k={k}: loss {float(value):.7f}, gradients {max(differences):.1e}"
      )
  return row


def table(results: dict[str, Any]) -> str:
  """The manual's table: per mesh, the full batch's loss and each k's loss
  and largest relative gradient difference."""
  ks = sorted({k for r in results["rows"] for k in r["ks"]}, key=int)
  v = results["versions"]
  head = (
    f"Run on {results['date']}, 8 CPU devices, Python {results['python']}, "
    f"jax {v['jax']}, flax {v['flax']}, MaxText {v['maxtext']}: MaxText's "
    "llama and loss as its trainer builds them, unmodified, through "
    '`jaxaccum.value_and_grad(..., mesh=mesh, view="global")`, against '
    "`jax.value_and_grad` of the same loss on the whole batch. The gradient "
    "difference is the largest over the parameters of max |a - b| / max |b|."
    "\n\n"
  )
  header = "| mesh | full batch loss | " + " | ".join(
    f"k = {k}: loss / max gradient difference" for k in ks
  )
  lines = [header + " |", "|---|---|" + "---|" * len(ks)]
  for r in results["rows"]:
    cells = [
      f"{r['ks'][k]['loss']:.7f} / {r['ks'][k]['grad_rel_diff']:.1e}" for k in ks
    ]
    lines.append(
      f"| {r['mesh']} | {r['full_batch_loss']:.7f} | " + " | ".join(cells) + " |"
    )
  return head + "\n".join(lines)


BLOCKS = {"maxtext_llama table": table}


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
  parser.add_argument("--meshes", default=",".join(MESHES), help="comma-separated")
  args = parser.parse_args(argv)
  testing.cpu_devices(8)  # before JAX starts its backend
  rows = [measure(name, MESHES[name]) for name in args.meshes.split(",")]
  results = {
    "date": datetime.date.today().isoformat(),
    "versions": {
      name: importlib.metadata.version(name) for name in ("jax", "flax", "maxtext")
    },
    "python": platform.python_version(),
    "rows": rows,
  }
  args.out.write_text(json.dumps(results, indent=1) + "\n")
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
