"""MaxText's own llama, unmodified, through ``jaxaccum.value_and_grad(...,
mesh=..., view="global")``: equal to its full batch on every mesh, and its
peak memory against MaxText's own gradient accumulation.

Usage and install (Python 3.12, a venv of its own): ``benchmarks/README.md``.

:func:`build` makes the model as MaxText's trainer does, :func:`programs`
the three programs, :func:`measure_memory` reads each. Each run rewrites its
own part of ``results/maxtext_llama.json``.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import datetime
import json
import pathlib
import platform
import re
import shutil
import tempfile
from collections.abc import Callable
from typing import Any, NamedTuple

import _approaches
import _compile
import _paths
import jax
import jax.numpy as jnp
import numpy as np
from _report import table as md_table

import jaxaccum
from jaxaccum import testing

MESHES = {
  "data (8)": {"ici_data_parallelism": 8, "ici_fsdp_parallelism": 1},
  "fsdp (8)": {"ici_data_parallelism": 1, "ici_fsdp_parallelism": 8},
  "data (4) x fsdp (2)": {"ici_data_parallelism": 4, "ici_fsdp_parallelism": 2},
}
#: ``--explicit``: MaxText's Explicit meshes, its layers unrolled (see the
#: module docstring for why).
EXPLICIT = {"shard_mode": "explicit", "scan_layers": "false"}
RESULTS = _paths.RESULTS / "maxtext_llama.json"
#: Where XLA dumps each compiled program (``--xla_dump_to``, set in main()).
DUMP = pathlib.Path(tempfile.gettempdir()) / "jaxaccum-maxtext-dump"
_LIVE_PEAK = re.compile(r"Stack trace breakdown for peak usage: ([\d ]+) bytes")


class Size(NamedTuple):
  """A model to measure: MaxText settings, the k to run, where."""

  settings: dict[str, Any]
  ks: tuple[int, ...]
  target: str | None  # a jaxaccum.compile_target name; None: run on CPU
  section: str  # where its rows go in the results


SIZES = {
  "tiny": Size(
    {
      "model_name": "llama2-7b",
      "base_emb_dim": 64,
      "base_num_query_heads": 4,
      "base_num_kv_heads": 4,
      "base_mlp_dim": 128,
      "base_num_decoder_layers": 2,
      "head_dim": 16,
      "vocab_size": 256,
      "max_target_length": 32,
      "per_device_batch_size": 4,
      "dtype": "float32",
      "matmul_precision": "highest",
      "hardware": "cpu",
    },
    ks=(2, 4),
    target=None,
    section="rows",
  ),
  "1b": Size(
    {
      "model_name": "llama2-7b",
      "base_emb_dim": 2048,
      "base_num_query_heads": 32,
      "base_num_kv_heads": 4,
      "base_mlp_dim": 5632,
      "base_num_decoder_layers": 22,
      "head_dim": 64,
      "vocab_size": 32000,
      "max_target_length": 2048,
      "per_device_batch_size": 8,
      "dtype": "bfloat16",
      "hardware": "gpu",
    },
    ks=(2, 4, 8),
    target="h100",
    section="h100",
  ),
}


#: The settings of every MaxText run here: synthetic data, no checkpoints,
#: dot-product attention (the cuDNN kernel needs Transformer Engine).
COMMON = {
  "override_model_config": "true",
  "attention": "dot_product",
  "enable_checkpointing": "false",
  "dataset_type": "synthetic",
  "run_name": "jaxaccum",
  "base_output_directory": "/tmp/jaxaccum-maxtext",
  "enable_goodput_recording": "false",
  "skip_jax_distributed_system": "true",
}


def pyconfig(settings: dict[str, Any]) -> Any:
  """MaxText's config: its ``base.yml`` with :data:`COMMON` and ``settings``."""
  import maxtext  # noqa: PLC0415
  from maxtext.configs import pyconfig as maxtext_pyconfig  # noqa: PLC0415

  base = pathlib.Path(maxtext.__file__).parent / "configs" / "base.yml"
  args = (f"{k}={v}" for k, v in {**COMMON, **settings}.items())
  return maxtext_pyconfig.initialize([None, str(base), *args])


def config(size: Size, parallelism: dict[str, int], k: int = 1) -> Any:
  """MaxText's config; with ``k``, its own accumulation over ``k``
  micro-batches of the same global batch."""
  return pyconfig(
    {
      **size.settings,
      "per_device_batch_size": size.settings["per_device_batch_size"] / k,
      "gradient_accumulation_steps": k,
      "jax_cache_dir": "",  # every program compiled, and dumped
      **parallelism,
    }
  )


class Setup(NamedTuple):
  """MaxText's model as its trainer builds it, split for differentiation."""

  cfg: Any
  mesh: jax.sharding.Mesh
  graphdef: Any
  params: Any  # nnx.State of the Params: arrays, or ShapeDtypeStructs
  rest: Any  # the other state (RNGs), likewise
  params_shardings: Any  # what train_step gets as params_shardings
  batch: dict[str, Any]


def build(cfg: Any, devices: list[jax.Device], *, concrete: bool) -> Setup:
  """The model, its parameters and a synthetic batch on MaxText's mesh of
  ``devices``; with ``concrete=False``, only their shapes and shardings."""
  from flax import nnx  # noqa: PLC0415
  from maxtext.common import train_state_nnx  # noqa: PLC0415
  from maxtext.optimizers import optimizers  # noqa: PLC0415
  from maxtext.utils import maxtext_utils, model_creation_utils, sharding  # noqa: PLC0415

  mesh = maxtext_utils.get_mesh_from_config(cfg, devices)
  create_model, abstract = model_creation_utils.create_nnx_abstract_model(cfg, mesh)
  tx = optimizers.get_optimizer(
    cfg, maxtext_utils.create_learning_rate_schedule(cfg), abstract, mesh=mesh
  )

  def init_state():
    model = create_model()
    return train_state_nnx.TrainStateNNX(model, nnx.Optimizer(model, tx, wrt=nnx.Param))

  _, _, shardings = maxtext_utils.get_abstract_state(cfg, mesh, init_state, True)
  params_shardings, _ = sharding.maybe_update_params_sharding_with_opt(cfg, shardings)
  init = jax.jit(lambda: nnx.state(init_state()), out_shardings=shardings)
  with rules(cfg):
    state = init() if concrete else jax.eval_shape(init)
    model = nnx.merge(nnx.graphdef(nnx.eval_shape(init_state)), state).model
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  rows, length = cfg.global_batch_size_to_train_on, cfg.max_target_length
  data_sharding = sharding.get_input_data_sharding(cfg, mesh)
  if concrete:
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
      {k: np.asarray(v, np.int32) for k, v in batch.items()}, data_sharding
    )
  else:
    names = ("inputs", "targets")
    batch = {
      f"{n}{part}": jax.ShapeDtypeStruct(
        (rows, length), jnp.int32, sharding=data_sharding
      )
      for n in names
      for part in ("", "_position", "_segmentation")
    }
  return Setup(cfg, mesh, graphdef, params, rest, params_shardings, batch)


def rules(cfg: Any) -> Any:
  from flax.linen import partitioning  # noqa: PLC0415

  return partitioning.axis_rules(cfg.logical_axis_rules)


def programs(full: Setup, size: Size, parallelism: dict[str, int], k: int) -> dict:
  """The three programs of ``(params, batch, rest)`` -> ``(loss, grads)``
  at ``k``, each jitted with the gradients in the parameters' shardings.
  On Explicit meshes jaxaccum's is plain ``jit``, without ``mesh=``."""
  from flax import nnx  # noqa: PLC0415
  from maxtext.trainers.pre_train import train  # noqa: PLC0415
  from maxtext.utils import gradient_accumulation  # noqa: PLC0415

  ga = build(config(size, parallelism, k), list(full.mesh.devices.flat), concrete=False)

  def loss_fn(setup, params, batch, rest):
    model = nnx.merge(setup.graphdef, params, rest, copy=True)
    return train.loss_fn(model, setup.cfg, dict(batch), None, None, is_train=True)

  def full_batch(params, batch, rest):
    return jax.value_and_grad(lambda p: loss_fn(full, p, batch, rest)[0])(params)

  def maxtext_ga(params, batch, rest):  # what train_step does with k > 1
    model = nnx.merge(ga.graphdef, params, rest, copy=True)
    loss, _, grads = gradient_accumulation.gradient_accumulation_loss_and_grad(
      train.loss_fn, ga.cfg, model, None, ga.params_shardings, dict(batch), None
    )
    return loss, grads

  def summed_loss(params, batch, rest):  # normalize="weighted": (sum, weight)
    aux = loss_fn(full, params, batch, rest)[1]
    return aux["xent_sum"], aux["total_weights"]

  data_axes = batch_axes(full.mesh)
  explicit = jax.sharding.AxisType.Explicit in full.mesh.axis_types
  accumulated = jaxaccum.value_and_grad(
    summed_loss,
    k,
    normalize="weighted",
    mesh=full.mesh,
    data_axis=data_axes,
    view="global",
    param_specs=jax.tree.map(lambda s: s.spec, full.params_shardings),
  )
  if explicit:  # the drop-in: the data axes read from the batch's type
    accumulated = jaxaccum.value_and_grad(summed_loss, k, normalize="weighted")
  scalar = jax.sharding.NamedSharding(full.mesh, jax.sharding.PartitionSpec())
  out = (scalar, full.params_shardings)
  return {
    "full_batch": jax.jit(full_batch, out_shardings=out),
    "maxtext_ga": jax.jit(maxtext_ga, out_shardings=out),
    "jaxaccum": jax.jit(accumulated, out_shardings=out),
  }


def batch_axes(mesh: jax.sharding.Mesh) -> tuple[str, ...]:
  """The mesh axes the batch is split over (those of more than 1 device)."""
  return tuple(a for a in ("data", "fsdp") if mesh.shape[a] > 1)


def micro_batch_loop(step: testing.CompiledStep, k: int) -> testing.Loop | None:
  """The micro-batch loop: the one loop outside every other loop that runs
  ``k`` times and holds loops of its own (the layer scans), or with
  unrolled layers the one such loop at all. None if there is not exactly
  one."""
  runs_k = [loop for loop in step.loops if not loop.outer and loop.trip_count == k]
  loops = [
    loop
    for loop in runs_k
    if any(inner.outer[:1] == (loop.name,) for inner in step.loops)
  ]
  loops = loops or runs_k
  return loops[0] if len(loops) == 1 else None


def live_at_peak(hlo_text: str) -> int | None:
  """The bytes live at the fullest point of the compiled program (the peak
  of the live-range report XLA dumped for it, before they are packed into
  buffers)."""
  module = hlo_text.split(None, 2)[1].rstrip(",")  # "HloModule jit_f, ..."
  paths = sorted(DUMP.glob(f"*.{module}.*after_optimizations-live-range.txt"))
  match = _LIVE_PEAK.search(paths[-1].read_text()) if paths else None
  return int(match.group(1).replace(" ", "")) if match else None


def measure_memory(
  step: testing.CompiledStep, k: int | None, mesh: jax.sharding.Mesh | None = None
) -> dict[str, Any]:
  """Peak bytes per device, the bytes live at the peak and, with ``k``,
  the collectives in the micro-batch loop; with ``mesh`` also the
  all-reduces among them over the batch's axes, and their bytes per
  micro-batch."""
  stats = step.memory
  assert stats is not None, "the backend reports no memory analysis"
  row: dict[str, Any] = {
    "peak_bytes": stats.peak_bytes,
    "argument_bytes": stats.argument_bytes,
    "output_bytes": stats.output_bytes,
    "temp_bytes": stats.temp_bytes,
    "live_at_peak_bytes": live_at_peak(step.text),
  }
  if k is not None:
    loop = micro_batch_loop(step, k)
    row["in_loop_collectives"] = None if loop is None else len(step.inside(loop))
    if mesh is not None and loop is not None:
      axes = set(batch_axes(mesh))
      reductions = [
        c
        for c in step.inside(loop)
        if c.op.startswith("all-reduce") and axes & set(c.axes(mesh))
      ]
      row["in_loop_data_all_reduces"] = len(reductions)
      row["in_loop_data_all_reduce_list"] = [
        [c.bytes, ",".join(c.axes(mesh))] for c in reductions
      ]
      row["in_loop_data_all_reduce_bytes"] = (
        sum(c.bytes * c.executions for c in reductions) // k
      )
  return row


def kind(path: Any) -> str:
  """A parameter's kind, from its path: the layers' matrices, the norm
  scales, the embedding table or the unembedding (``logits_dense``)."""
  name = jax.tree_util.keystr(path)
  if "embedding" in name:
    return "embedding"
  if "logits_dense" in name:
    return "logits"
  return "norm scales" if "scale" in name else "layer matrices"


def parameter_bytes(params: Any) -> dict[str, int]:
  """The parameters' bytes by :func:`kind`."""
  kinds: dict[str, int] = {}
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    kinds[kind(path)] = (
      kinds.get(kind(path), 0) + int(np.prod(x.shape)) * x.dtype.itemsize
    )
  return kinds


def returned_by_remat(full: Setup) -> dict[str, list[int]]:
  """Per kind of parameter (:func:`parameter_bytes`): how many of its
  leaves a rematerialized call (``nnx.remat``, a ``checkpoint`` in the
  loss's jaxpr) returns as it came in, and how many leaves there are."""
  from flax import nnx  # noqa: PLC0415
  from maxtext.trainers.pre_train import train  # noqa: PLC0415

  def loss(params, batch, rest):
    model = nnx.merge(full.graphdef, params, rest, copy=True)
    return train.loss_fn(model, full.cfg, dict(batch), None, None, is_train=True)[0]

  with jax.set_mesh(full.mesh), rules(full.cfg):
    jaxpr = jax.make_jaxpr(loss)(full.params, full.batch, full.rest).jaxpr
  paths = [p for p, _ in jax.tree_util.tree_leaves_with_path(full.params)]
  kinds = [kind(p) for p in paths]
  returned: set[int] = set()

  def visit(jaxpr: Any, leaves: dict[Any, int]) -> None:
    for eqn in jaxpr.eqns:
      body = eqn.params.get("jaxpr")
      if body is None:
        continue
      body = getattr(body, "jaxpr", body)
      inner = {
        var: leaves[v]
        for var, v in zip(body.invars, eqn.invars, strict=False)
        if not hasattr(v, "val") and v in leaves  # a Literal carries its value
      }
      if eqn.primitive.name in ("checkpoint", "remat2"):
        returned.update(inner[v] for v in body.outvars if v in inner)
      visit(body, inner)

  visit(jaxpr, {v: n for n, v in enumerate(jaxpr.invars[: len(paths)])})
  counts: dict[str, list[int]] = {}
  for n, name in enumerate(kinds):
    counts.setdefault(name, [0, 0])
    counts[name][0] += n in returned
    counts[name][1] += 1
  return counts


def scanned_layers(size: Size, name: str, k: int) -> str:
  """What jaxaccum's plain-``jit`` step does with MaxText's scanned layers
  (``scan_layers=true``) on ``name``'s Explicit mesh: ``"lowers"``, or the
  exception it raises, its type and first line."""
  scanned = size._replace(settings={**size.settings, "scan_layers": "true"})
  parallelism = MESHES[name]
  full = build(config(scanned, parallelism), jax.devices()[:8], concrete=False)
  with jax.set_mesh(full.mesh), rules(full.cfg):
    step = programs(full, scanned, parallelism, k)["jaxaccum"]
    try:
      step.lower(full.params, full.batch, full.rest)
    except Exception as error:  # recorded, as raised
      return f"{type(error).__name__}: {str(error).splitlines()[0]}"
  return "lowers"


def measure(size: Size, name: str, target: Any) -> tuple[dict[str, Any], dict]:
  """One mesh: each program's peak and in-loop collectives per k; on CPU
  also each one's loss and gradient difference against the full batch.
  Returns the row and the model's size."""
  parallelism = MESHES[name]
  devices = list(target.mesh().devices.flat) if target else jax.devices()[:8]
  full = build(config(size, parallelism), devices, concrete=target is None)
  args = (full.params, full.batch, full.rest)
  row: dict[str, Any] = {"mesh": name, "axes": dict(full.mesh.shape), "ks": {}}
  explicit = jax.sharding.AxisType.Explicit in full.mesh.axis_types
  if explicit:
    row["parameter_bytes"] = parameter_bytes(full.params)
    row["returned_by_remat"] = returned_by_remat(full)
  model = {
    "parameters": sum(int(np.prod(x.shape)) for x in jax.tree.leaves(full.params)),
    "global_batch": full.cfg.global_batch_size_to_train_on,
    "sequence_length": full.cfg.max_target_length,
  }
  with jax.set_mesh(full.mesh), rules(full.cfg):
    for k in size.ks:
      cell: dict[str, Any] = {}
      for approach, fun in programs(full, size, parallelism, k).items():
        if approach == "full_batch" and "full_batch" in row:
          continue
        shutil.rmtree(DUMP, ignore_errors=True)
        step = testing.compile_step(fun, *args, target=target)
        memory = measure_memory(
          step,
          None if approach == "full_batch" else k,
          full.mesh if explicit else None,
        )
        if target is None:
          value, grads = step.compiled(*args)
          if approach == "full_batch":
            want = grads
            row["full_batch_loss"] = float(value)
          else:
            memory["loss"] = float(value)
            memory["grad_rel_diff"] = _approaches.max_rel_error(grads, want)
        if approach == "full_batch":
          row["full_batch"] = memory
        else:
          cell[approach] = memory
        print(f"{name:<20} k={k} {approach:<10} {memory}", flush=True)
      if target is None:  # the fields of the first table
        cell["loss"] = cell["jaxaccum"]["loss"]
        cell["grad_rel_diff"] = cell["jaxaccum"]["grad_rel_diff"]
      row["ks"][str(k)] = cell
  return row, model


def _ks(r: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
  return sorted(r["ks"].items(), key=lambda item: int(item[0]))


def _run(run: dict[str, Any]) -> str:
  """``2026-12-04, jax 0.12.0.1, MaxText 0.2.5``, and where it compiled."""
  v = run["versions"]
  where = f", {run['devices']} {run['device_kind']}s" if "devices" in run else ""
  return f"{run['date']}, jax {v['jax']}, MaxText {v['maxtext']}{where}:"


def _exact(c: dict[str, Any]) -> str:
  return f"{c['loss']:.7f} / {c['grad_rel_diff']:.1e}"


def table(results: dict[str, Any]) -> str:
  """Per mesh, the full batch's loss and, per k, the loss and largest
  relative gradient difference of jaxaccum and of MaxText's accumulation."""
  ks = sorted({k for r in results["rows"] for k in r["ks"]}, key=int)
  header = ["mesh", "full batch loss"]
  header += [f"k = {k}: {who}" for k in ks for who in ("jaxaccum", "MaxText GA")]
  rows = [
    [
      r["mesh"],
      f"{r['full_batch_loss']:.7f}",
      *(c for k in ks for c in (_exact(r["ks"][k]), _exact(r["ks"][k]["maxtext_ga"]))),
    ]
    for r in results["rows"]
  ]
  return _run(results) + "\n\n" + md_table(header, rows)


def peak_table(rows: list[dict[str, Any]], unit: str) -> str:
  """Per mesh and k: the three peaks (in ``unit``); jaxaccum's ratio to
  MaxText's accumulation, and its difference in peak and in the bytes live
  at the peak; the collectives inside each one's micro-batch loop, and the
  bytes per micro-batch of the all-reduces over the batch's axes there."""
  scale = {"KiB": 2**10, "GiB": 2**30}[unit]

  def size(n: int) -> str:
    return f"{n / scale:,.{1 if unit == 'KiB' else 2}f}"

  def difference(a: int | None, b: int | None) -> str:
    if a is None or b is None:
      return "?"
    n = a - b
    return f"{n:+,} B" if abs(n) < 2**20 else f"{n / 2**20:+,.1f} MiB"

  header = ["mesh", "k", f"full batch ({unit})", f"MaxText GA ({unit})"]
  header += [f"jaxaccum ({unit})", "jaxaccum ÷ MaxText GA"]
  header += ["jaxaccum - MaxText GA: peak / live at peak"]
  header += ["in-loop collectives: MaxText GA / jaxaccum"]
  reduces = any(
    "in_loop_data_all_reduce_bytes" in c["jaxaccum"] for r in rows for _, c in _ks(r)
  )
  if reduces:
    header += ["in-loop data all-reduces, B per micro-batch: MaxText GA / jaxaccum"]
  out = []
  for r in rows:
    full = r["full_batch"]["peak_bytes"]
    for k, cell in _ks(r):
      ga, ours = cell["maxtext_ga"], cell["jaxaccum"]
      peak = difference(ours["peak_bytes"], ga["peak_bytes"])
      live = difference(ours["live_at_peak_bytes"], ga["live_at_peak_bytes"])
      out.append(
        [
          r["mesh"],
          k,
          size(full),
          size(ga["peak_bytes"]),
          size(ours["peak_bytes"]),
          f"{ours['peak_bytes'] / ga['peak_bytes']:.3f}",
          f"{peak} / {live}",
          f"{ga['in_loop_collectives']} / {ours['in_loop_collectives']}",
        ]
      )
      if reduces:
        out[-1].append(
          " / ".join(f"{c['in_loop_data_all_reduce_bytes']:,}" for c in (ga, ours))
        )
  return md_table(header, out)


def cpu_peaks(results: dict[str, Any]) -> str:
  """The tiny llama's peaks on 8 CPU devices."""
  return _run(results) + "\n\n" + peak_table(results["rows"], "KiB")


def h100_peaks(results: dict[str, Any]) -> str:
  """The 1.1B llama's peaks compiled for 8 H100s."""
  run = results["h100"]
  head = (
    f"{_run(run)} {run['parameters']:,} parameters, {run['global_batch']} "
    f"sequences of {run['sequence_length']} tokens per step."
  )
  return head + "\n\n" + peak_table(run["rows"], "GiB")


def _parameter_bytes(run: dict[str, Any]) -> str:
  """The parameters' bytes by kind, and how many leaves of each a
  rematerialized call returns as they came in."""
  row = run["rows"][0]
  remat = row.get("returned_by_remat", {})
  return md_table(
    ["parameters", "bytes", "leaves returned by a remat call"],
    [
      [kind, f"{n:,}", "{} of {}".format(*remat[kind]) if kind in remat else "–"]
      for kind, n in row["parameter_bytes"].items()
    ],
  )


def explicit_table(results: dict[str, Any]) -> str:
  """``--explicit``: per mesh and k, the loss and gradient difference of
  jaxaccum's plain ``jit`` and of MaxText's accumulation against the full
  batch, and the peaks; the parameters' bytes; each of jaxaccum's
  all-reduces over the batch's axes in the loop; what the scanned layers
  did."""
  run = results.get("explicit")
  if run is None:
    return "No `--explicit` run yet: `python benchmarks/maxtext_llama.py --explicit`."
  rows = [
    [
      r["mesh"],
      k,
      f"{r['full_batch_loss']:.7f}",
      _exact(c["jaxaccum"]),
      _exact(c["maxtext_ga"]),
    ]
    for r in run["rows"]
    for k, c in _ks(r)
  ]
  reduces = [
    [r["mesh"], k, f"{n:,}", axes]
    for r in run["rows"]
    for k, c in _ks(r)
    for n, axes in c["jaxaccum"]["in_loop_data_all_reduce_list"]
  ]
  scanned = (
    "lowers too"
    if run["scanned_layers"] == "lowers"
    else f"raised `{run['scanned_layers']}` while tracing"
  )
  return "\n\n".join(
    [
      _run(run),
      md_table(["mesh", "k", "full batch loss", "jaxaccum", "MaxText GA"], rows),
      peak_table(run["rows"], "KiB"),
      _parameter_bytes(run),
      md_table(["mesh", "k", "jaxaccum's in-loop all-reduce, B", "axes"], reduces),
      f"With MaxText's scanned layers, jaxaccum's plain-`jit` step {scanned}.",
    ]
  )


def h100_explicit_peaks(results: dict[str, Any]) -> str:
  """``--config 1b --explicit``: the 1.1B llama's peaks on MaxText's
  Explicit meshes, compiled for 8 H100s."""
  run = results.get("h100_explicit")
  if run is None:
    return (
      "No compile yet: `python benchmarks/maxtext_llama.py --config 1b --explicit`."
    )
  head = f"{_run(run)} {run['parameters']:,} parameters."
  return "\n\n".join([head, peak_table(run["rows"], "GiB"), _parameter_bytes(run)])


BLOCKS: dict[str, Callable[[dict[str, Any]], str]] = {
  "maxtext_llama table": table,
  "maxtext_llama peak": cpu_peaks,
  "maxtext_llama h100": h100_peaks,
  "maxtext_llama explicit": explicit_table,
  "maxtext_llama h100_explicit": h100_explicit_peaks,
}


def save(
  path: pathlib.Path, size: Size, rows: list[dict[str, Any]], info: dict
) -> None:
  """Writes ``rows`` into their section of the results, replacing the rows
  of the same meshes and keeping the rest."""
  results = json.loads(path.read_text()) if path.exists() else {}
  header = {
    "date": datetime.date.today().isoformat(),
    "versions": _compile.versions("jax", "flax", "maxtext"),
    "python": platform.python_version(),
  }
  part = results if size.section == "rows" else results.setdefault(size.section, {})
  done = {r["mesh"] for r in rows}
  kept = [r for r in part.get("rows", []) if r["mesh"] not in done]
  order = list(MESHES)
  part.update(header, **info)
  part["rows"] = sorted(kept + rows, key=lambda r: order.index(r["mesh"]))
  path.write_text(json.dumps(results, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
  parser = _paths.parser(
    __doc__, out=False, ks="comma-separated (default: the config's)"
  )
  parser.add_argument("--config", choices=SIZES, default="tiny")
  parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
  parser.add_argument("--meshes", default=",".join(MESHES), help="comma-separated")
  parser.add_argument(
    "--explicit",
    action="store_true",
    help="MaxText's shard_mode=explicit, jaxaccum through plain jit",
  )
  args = parser.parse_args(argv)
  size = SIZES[args.config]
  if args.ks:
    size = size._replace(ks=tuple(args.ks))
  if args.explicit:
    section = "explicit" if size.section == "rows" else f"{size.section}_explicit"
    size = size._replace(settings={**size.settings, **EXPLICIT}, section=section)
  testing.cpu_devices(8)  # before JAX starts its backend
  os.environ["XLA_FLAGS"] += f" --xla_dump_to={DUMP} --xla_gpu_dump_llvmir=false"
  target = None
  info: dict[str, Any] = {}
  if size.target:
    target = jaxaccum.compile_target(size.target, topology="1x1x8")
    info = {"devices": len(target.devices), "device_kind": target.device_kind}
  meshes = args.meshes.split(",")
  if args.explicit and target is None:
    info["scanned_layers"] = scanned_layers(size, meshes[0], size.ks[0])
    print(f"scanned layers: {info['scanned_layers']}", flush=True)
  rows = []
  for name in meshes:
    row, model = measure(size, name, target)
    rows.append(row)
    save(args.out, size, rows, {**info, **model})
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
  main()
