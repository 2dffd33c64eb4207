"""Bytes communicated per optimizer step by data-parallel gradient accumulation.

Part 1, on 8 fake CPU devices: the collectives of each of :data:`APPROACHES`
per ``k`` (:func:`run`, :func:`measure`), and of the plain-``jit`` step on
each of :data:`EXPLICIT_MESHES` (:func:`run_explicit`). Part 2: the steps of
:data:`PLAIN_APPROACHES` timed in interleaved rounds, and a profile of a few
of them (:func:`run_plain_jit`, :func:`profile_thunks`). Outputs
``communication.json`` and ``communication.png`` in ``--out``.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import contextlib
import datetime
import functools
import itertools
import json
import pathlib
import platform
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import _approaches
import _models
import _paths
import _timing
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _report import (
  aa_decides,
  aa_note,
  columns,
  cpu_model,
  date,
  k_axis,
  mib,
  ms,
  pyplot,
  ratio,
  timed_verdict,
)
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from jaxaccum import testing

PyTree = Any
LossAndGrads = Callable[[PyTree, PyTree], tuple[jax.Array, PyTree]]

NUM_DEVICES = 8
WIDTHS = (784, 512, 512, 10)
BATCH_SIZE = 256
KS = (1, 2, 4, 8, 16)
QUICK_KS = (1, 4)
APPROACHES = {
  "jaxaccum": "(a) jaxaccum, mesh=, data_axis=",
  "optax_microbatch": "(b) optax.microbatch under jit (GSPMD)",
  "hand_scan": "(c) hand-written lax.scan, C-order split, under jit",
  "jaxaccum_explicit": "(d) jaxaccum.value_and_grad(loss, k) under plain jit, no "
  "mesh=, on an Explicit mesh",
}
#: The Explicit meshes of the plain-jit rows: the replicated MLP on ``(8,)``,
#: and a tensor-parallel one on ``(4, 2)`` (Megatron's split of the two hidden
#: layers: the first's columns and the second's rows over ``"model"``).
EXPLICIT_MESHES = {
  "data8": {"shape": (8,), "axes": ("data",), "specs": None, "loss": "loss"},
  "data4_model2": {
    "shape": (4, 2),
    "axes": ("data", "model"),
    "specs": (
      {"w": P(None, "model"), "b": P(None, "model")},
      {"w": P("model", None), "b": P()},
      {"w": P(), "b": P()},
    ),
    "loss": "explicit_loss",
  },
}

# Part 2: step time under plain jit without mesh=.
PLAIN_WIDTHS = (784, 256, 10)
PLAIN_BATCH_SIZE = 4096
PLAIN_K = 8
PLAIN_ROUNDS = 21
PLAIN_MIN_SAMPLE_MS = 200.0
PLAIN_TARGET = 1.10
PLAIN_APPROACHES = {
  "full_batch": "full batch, jit(jax.value_and_grad(loss))",
  "full_batch_again": "the full batch timed again (the A/A control)",
  "jaxaccum": "jaxaccum.value_and_grad(loss, k), plain jit, no mesh=",
  "jaxaccum_mesh": 'jaxaccum.value_and_grad(loss, k, mesh=, data_axis="data")',
  "jaxaccum_explicit": "jaxaccum.value_and_grad(loss, k), plain jit, no mesh=, on an "
  "Explicit (8,) mesh (the weights accumulated unreduced, reduced after the loop)",
  "optax_microbatch": "optax.microbatching.microbatch(jax.value_and_grad(loss)), "
  "plain jit (its strided split keeps each device's rows in place)",
  "contiguous_scan": "contiguous split: hand-written lax.scan over "
  "batch.reshape(k, B // k, ...), plain jit",
  "full_batch_one_device": "full batch on one device (a reference for the loop's "
  "own cost)",
  "jaxaccum_one_device": "jaxaccum.value_and_grad(loss, k) on one device; its "
  "ratio is to the full batch on one device",
  "hand_scan_one_device": "the hand-written lax.scan on one device (the loop "
  "any accumulation runs); its ratio is to the full batch on one device",
  "full_batch_device_rows": "the full batch of one device's rows (B / 8) on one "
  "device: what each device computes in the 8-device full batch",
  "jaxaccum_device_rows": "jaxaccum.value_and_grad(loss, k) on one device's rows "
  "(B / 8) on one device: each device's loop in the 8-device split, B / (8 k) rows "
  "a micro-batch; its ratio is to the full batch of the same rows",
}
#: The steps of part 2 whose thunks are profiled (one trace of a few steps each).
PROFILED = (
  "full_batch",
  "jaxaccum_mesh",
  "jaxaccum_explicit",
  "full_batch_device_rows",
  "jaxaccum_device_rows",
)
PROFILE_STEPS = 4
PROFILE_ROUNDS = 7
#: Collectives that move batch data between devices (the gradient
#: reductions are all-reduces or reduce-scatters).
MOVES_DATA = (
  "all-gather",
  "all-gather-start",
  "collective-permute",
  "collective-permute-start",
  "all-to-all",
)


def yardstick(name: str) -> str:
  """The part-2 row that ``name``'s time ratio is over: the full batch of
  its rows on its devices."""
  for rows in ("_one_device", "_device_rows"):
    if name.endswith(rows):
      return f"full_batch{rows}"
  return "full_batch"


def init_params(rng: np.random.Generator, widths: Sequence[int] = WIDTHS) -> list:
  """The MLP's parameters: one ``{"w", "b"}`` dict per layer, LeCun normal.

  Drawn with numpy (float32), which is faster than compiling jax.random ops.
  """
  normal = rng.standard_normal
  return [
    {
      "w": (normal((fan_in, fan_out)) / np.sqrt(fan_in)).astype(np.float32),
      "b": np.zeros((1, fan_out), np.float32),
    }
    for fan_in, fan_out in itertools.pairwise(widths)
  ]


def loss(params: list[dict], batch: tuple[jax.Array, jax.Array]) -> jax.Array:
  """Mean softmax cross-entropy of the ReLU MLP on ``batch = (x, labels)``
  (``_models.mlp_loss``)."""
  x, labels = batch
  return _models.mlp_loss(params, {"x": x, "y": labels})


def explicit_loss(params: list[dict], batch: tuple[jax.Array, jax.Array]) -> jax.Array:
  """:func:`loss` written for Explicit axes, as a tensor-parallel model must be:
  each matrix product names its result's sharding (``out_sharding``), rows
  where the batch's are and columns where the weight's are; JAX refuses a
  contraction over a sharded feature dimension without it. The specs are read
  with ``spec.partitions[...]``: a ``reduced`` parameter's ``spec[...]`` is
  refused by JAX."""
  x, labels = batch
  rows = jax.typeof(x).sharding.spec.partitions[0]
  h = x
  for i, layer in enumerate(params):
    cols = jax.typeof(layer["w"]).sharding.spec.partitions[1]
    h = jnp.matmul(h, layer["w"], out_sharding=P(rows, cols)) + layer["b"]
    if i < len(params) - 1:
      h = jax.nn.relu(h)
  return optax.softmax_cross_entropy_with_integer_labels(h, labels).mean()


def explicit_problem(
  mesh: jax.sharding.Mesh, specs: Sequence[dict] | None, params: list, batch: tuple
) -> tuple[list, tuple]:
  """``params`` (by layer ``specs``, replicated if None) and ``batch`` (rows
  over ``"data"``) placed on ``mesh``."""
  specs = specs or [{"w": P(), "b": P()}] * len(params)
  placed = [
    {n: jax.device_put(a, NamedSharding(mesh, spec[n])) for n, a in layer.items()}
    for layer, spec in zip(params, specs, strict=True)
  ]
  return placed, jax.device_put(batch, NamedSharding(mesh, P("data")))


def explicit_mesh(shape: Sequence[int], axes: Sequence[str]) -> jax.sharding.Mesh:
  return jax.make_mesh(
    tuple(shape), tuple(axes), axis_types=(AxisType.Explicit,) * len(axes)
  )


def make_approach(
  name: str,
  k: int,
  mesh: jax.sharding.Mesh,
  *,
  loss_fn: Callable[..., jax.Array] = loss,
  batch_size: int = BATCH_SIZE,
  data_axis: str | tuple[str, ...] = "data",
  param_specs: PyTree = None,
) -> LossAndGrads:
  """``(params, batch) -> (loss, grads)`` for approach ``name`` with ``k``
  (``jaxaccum_once``: ``fsdp_gather="once"``; ``param_specs`` tells jaxaccum
  the shardings it cannot see under an outer ``jit`` on Auto axes)."""
  if name in ("jaxaccum", "jaxaccum_once"):
    return jaxaccum.value_and_grad(
      loss_fn,
      k,
      mesh=mesh,
      data_axis=data_axis,
      param_specs=param_specs,
      fsdp_gather="once" if name == "jaxaccum_once" else "per_micro_batch",
    )
  if name == "optax_microbatch":
    return _approaches.optax_microbatch(loss_fn, batch_size // k)
  if name == "hand_scan":
    return _approaches.hand_scan(loss_fn, k)
  raise ValueError(f"unknown approach {name!r}")


def xla_flops(compiled: Any) -> float:
  """Per-device flops of a compiled function, XLA's count (loop bodies once)."""
  analysis = compiled.cost_analysis()
  if not analysis:
    raise RuntimeError("XLA gave no cost analysis for this backend.")
  return float(analysis["flops"])


def compile_step(
  fun: LossAndGrads,
  params: PyTree,
  batch: PyTree,
  mesh: jax.sharding.Mesh | None = None,
) -> tuple[Any, float]:
  """``jit(fun)`` (or ``fun``, if jitted) compiled for ``(params, batch)``
  (under ``jax.set_mesh(mesh)`` where given: an Explicit loss names bare
  ``out_sharding`` specs), and the seconds it took."""
  start = time.perf_counter()
  jitted = fun if hasattr(fun, "lower") else jax.jit(fun)
  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    compiled = jitted.lower(params, batch).compile()
  return compiled, time.perf_counter() - start


def collective_summary(colls: Sequence[testing.Collective]) -> dict[str, Any]:
  """Bytes per step of ``colls``, by opcode, and how many run in the loop."""
  by_op: dict[str, int] = {}
  for c in colls:
    by_op[c.op] = by_op.get(c.op, 0) + c.bytes * c.executions
  in_loop = [c for c in colls if c.in_loop]
  return {
    "bytes_per_step": sum(c.bytes * c.executions for c in colls),
    "bytes_by_op": by_op,
    "num_collectives": len(colls),
    "collective_executions_per_step": sum(c.executions for c in colls),
    "in_loop_collectives": len(in_loop),
    "in_loop_executions_per_step": sum(c.executions for c in in_loop),
    "in_loop_ops": sorted({c.op for c in in_loop}),
  }


def axis_summary(
  colls: Sequence[testing.Collective], mesh: jax.sharding.Mesh, axis: str
) -> dict[str, Any]:
  """The collectives that communicate over mesh ``axis``
  (``Collective.axes``): executions and bytes per step inside the loop, and
  each one after it."""
  on = [c for c in colls if axis in c.axes(mesh)]
  in_loop = [c for c in on if c.in_loop]
  after = [c for c in on if not c.in_loop]
  return {
    "in_loop_executions_per_step": sum(c.executions for c in in_loop),
    "in_loop_bytes_per_step": sum(c.bytes * c.executions for c in in_loop),
    "in_loop_bytes_per_execution": sorted({c.bytes for c in in_loop}),
    "in_loop_ops": sorted({c.op for c in in_loop}),
    "after_loop": [{"op": c.op, "bytes": c.bytes} for c in after],
  }


def shard_bytes(tree: PyTree) -> int:
  """Bytes of one device's shard of every leaf of ``tree``."""
  return sum(
    int(np.prod(x.addressable_shards[0].data.shape)) * x.dtype.itemsize
    for x in jax.tree.leaves(tree)
  )


def leaf_bytes(params: list[dict]) -> dict[str, int]:
  """One device's bytes of the weights (every use a matrix product) and of the
  biases (added to activations), as the parameters lie on their mesh."""
  return {
    "weights": shard_bytes([layer["w"] for layer in params]),
    "biases": shard_bytes([layer["b"] for layer in params]),
  }


def keeps_shardings(grads: PyTree, params: PyTree) -> bool:
  """Whether every gradient has its parameter's sharding."""
  return all(
    g.sharding.is_equivalent_to(p.sharding, g.ndim)
    for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(params), strict=True)
  )


def accuracy(
  outputs: tuple[jax.Array, PyTree], reference: tuple[jax.Array, PyTree]
) -> dict[str, float]:
  """Relative errors of a step's ``(loss, grads)`` against ``reference``."""
  value, grads = outputs
  want_value, want_grads = reference
  return {
    "value_rel_error": _approaches.max_rel_error(value, want_value),
    "grads_rel_error": _approaches.max_rel_error(grads, want_grads),
  }


def measure(
  fun: LossAndGrads,
  k: int,
  *,
  params: PyTree,
  batch: PyTree,
  reference: tuple[jax.Array, PyTree],
  ideal_flops: float,
  grad_bytes: int,
  mesh: jax.sharding.Mesh,
) -> dict[str, Any]:
  """Compiles ``jit(fun)`` once; its collectives (all, and those over
  ``"data"``), compute estimate and accuracy. An Explicit ``mesh`` is set
  around the compilation."""
  explicit = AxisType.Explicit in mesh.axis_types
  compiled, compile_seconds = compile_step(
    fun, params, batch, mesh if explicit else None
  )
  colls = testing.collectives(compiled.as_text() or "")
  summary = collective_summary(colls)
  flops = xla_flops(compiled)
  return {
    **summary,
    "data_axis": axis_summary(colls, mesh, "data"),
    "bytes_over_grad_bytes": summary["bytes_per_step"] / grad_bytes,
    "collectives": [c._asdict() for c in colls],
    "xla_flops_per_device": flops,
    "compute_vs_data_parallel_est": flops * k / ideal_flops,
    **accuracy(compiled(params, batch), reference),
    "compile_seconds": compile_seconds,
  }


def environment(doc: str) -> dict[str, Any]:
  """What a benchmark's JSON starts with: the first paragraph of its ``doc``,
  the date, the versions, the backend and the number of devices."""
  return {
    "description": doc.split("\n\n", maxsplit=1)[0],
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "jax_version": jax.__version__,
    "optax_version": optax.__version__,
    "python_version": platform.python_version(),
    "backend": jax.default_backend(),
    "num_devices": NUM_DEVICES,
    "machine": {  # the host, and its load average now
      "cpu_model": cpu_model(),
      "cpu_count": os.cpu_count(),
      "platform": platform.platform(),
      "load_average_at_start": list(os.getloadavg()),
    },
  }


def run(args: argparse.Namespace) -> dict[str, Any]:
  """Measures every approach for every ``k``; returns the JSON-ready results."""
  cpus = _timing.pin(args.cpus)  # before JAX starts its threads
  ks = QUICK_KS if args.quick else KS
  if jax.device_count() < NUM_DEVICES:
    raise RuntimeError(
      f"Needs {NUM_DEVICES} devices, found {jax.device_count()}: set XLA_FLAGS="
      f"--xla_force_host_platform_device_count={NUM_DEVICES} before jax starts."
    )
  env = environment(__doc__)
  mesh = jax.make_mesh((NUM_DEVICES,), ("data",), axis_types=(AxisType.Auto,))
  rng = np.random.default_rng(0)
  params = init_params(rng)
  x = rng.standard_normal((BATCH_SIZE, WIDTHS[0]), dtype=np.float32)
  labels = rng.integers(0, WIDTHS[-1], BATCH_SIZE, dtype=np.int32)
  reference = jax.jit(jax.value_and_grad(loss))(params, (x, labels))
  batch = jax.device_put((x, labels), NamedSharding(mesh, P("data")))
  params = jax.device_put(params, NamedSharding(mesh, P()))
  grad_bytes = _approaches.tree_bytes(params)

  # The plain data-parallel step (no accumulation): one all-reduce, B/8 rows
  # of work per device. Its flops are the yardstick for redundant compute.
  plain = jax.jit(jax.value_and_grad(loss)).lower(params, batch).compile()
  ideal_flops = xla_flops(plain)

  explicit = explicit_mesh((NUM_DEVICES,), ("data",))
  on_explicit = explicit_problem(
    explicit, None, init_params(np.random.default_rng(0)), (x, labels)
  )
  results: dict[str, dict[str, Any]] = {name: {} for name in APPROACHES}
  for name in APPROACHES:
    for k in ks:
      if name == "jaxaccum_explicit":
        fun, (p, b), on = jaxaccum.value_and_grad(loss, k), on_explicit, explicit
      else:
        fun, (p, b), on = make_approach(name, k, mesh), (params, batch), mesh
      r = measure(
        fun,
        k,
        params=p,
        batch=b,
        reference=reference,
        ideal_flops=ideal_flops,
        grad_bytes=grad_bytes,
        mesh=on,
      )
      results[name][str(k)] = r
      print(f"{name} k={k}: {r['bytes_per_step']:,} bytes per step", flush=True)
  explicit_rows = run_explicit(
    ks,
    params=init_params(np.random.default_rng(0)),
    batch=(x, labels),
    reference=reference,
  )
  plain = run_plain_jit(
    rounds=args.rounds or (5 if args.quick else PLAIN_ROUNDS),
    min_sample_ms=args.min_sample_ms or (50.0 if args.quick else PLAIN_MIN_SAMPLE_MS),
    profile_rounds=3 if args.quick else PROFILE_ROUNDS,
  )
  env["machine"]["cpus"] = cpus
  env["machine"]["pinned"] = bool(args.cpus)
  return {
    **env,
    "model": {
      "kind": "mlp",
      "widths": list(WIDTHS),
      "num_params": sum(int(p.size) for p in jax.tree.leaves(params)),
    },
    "batch_size": BATCH_SIZE,
    "ks": list(ks),
    "grad_bytes": grad_bytes,
    "data_parallel_flops_per_device": ideal_flops,
    "approaches": {name: APPROACHES[name] for name in APPROACHES},
    "results": results,
    "explicit": explicit_rows,
    "plain_jit": plain,
  }


def run_explicit(
  ks: Sequence[int], *, params: list, batch: tuple, reference: tuple[jax.Array, PyTree]
) -> dict[str, Any]:
  """Plain ``jit`` of ``jaxaccum.value_and_grad(loss_fn, k)``, no ``mesh=``,
  on each of :data:`EXPLICIT_MESHES` with its loss: the collectives over
  each axis in the loop and after it, and whether each gradient keeps its
  parameter's sharding; the full batch under the same ``jit`` is k = 0."""
  out: dict[str, Any] = {}
  for name, spec in EXPLICIT_MESHES.items():
    mesh = explicit_mesh(spec["shape"], spec["axes"])
    p, b = explicit_problem(mesh, spec["specs"], params, batch)
    loss_fn = {"loss": loss, "explicit_loss": explicit_loss}[spec["loss"]]
    rows = {}
    for k in (0, *ks):
      fun = (
        jax.value_and_grad(loss_fn) if k == 0 else jaxaccum.value_and_grad(loss_fn, k)
      )
      compiled, _ = compile_step(fun, p, b, mesh)
      colls = testing.collectives(compiled.as_text() or "")
      value, grads = compiled(p, b)
      rows[str(k)] = {
        "data_axis": axis_summary(colls, mesh, "data"),
        **(
          {"model_axis": axis_summary(colls, mesh, "model")}
          if "model" in spec["axes"]
          else {}
        ),
        **collective_summary(colls),
        **accuracy((value, grads), reference),
        "grads_keep_shardings": keeps_shardings(grads, p),
      }
      print(f"{name} k={k}: compiled on an Explicit mesh", flush=True)
    out[name] = {
      "mesh": {
        "shape": list(spec["shape"]),
        "axis_names": list(spec["axes"]),
        "axis_types": "Explicit",
      },
      "param_specs": [
        {n: str(s) for n, s in layer.items()}
        for layer in (spec["specs"] or [{"w": P(), "b": P()}] * len(p))
      ],
      "loss": spec["loss"],
      "leaf_bytes": leaf_bytes(p),
      "rows": rows,
    }
  return out


# ---------------------------------------------------------------- part 2


def run_plain_jit(
  *, rounds: int, min_sample_ms: float, profile_rounds: int = PROFILE_ROUNDS
) -> dict[str, Any]:
  """Issue 19: jaxaccum without ``mesh=`` under plain ``jit`` on a batch
  sharded over the devices, against the full batch, ``mesh=`` and a
  contiguous split: step time in interleaved rounds and the collectives of
  the compiled step."""
  mesh = jax.make_mesh((NUM_DEVICES,), ("data",), axis_types=(AxisType.Auto,))
  rng = np.random.default_rng(1)
  params = init_params(rng, PLAIN_WIDTHS)
  x = rng.standard_normal((PLAIN_BATCH_SIZE, PLAIN_WIDTHS[0]), dtype=np.float32)
  labels = rng.integers(0, PLAIN_WIDTHS[-1], PLAIN_BATCH_SIZE, dtype=np.int32)
  reference = jax.jit(jax.value_and_grad(loss))(params, (x, labels))
  on_mesh = (
    jax.device_put(params, NamedSharding(mesh, P())),
    jax.device_put((x, labels), NamedSharding(mesh, P("data"))),
  )
  explicit = explicit_mesh((NUM_DEVICES,), ("data",))
  on_explicit = explicit_problem(explicit, None, params, (x, labels))
  one_device = jax.device_put((params, (x, labels)), jax.devices()[0])
  rows = PLAIN_BATCH_SIZE // NUM_DEVICES
  device_rows = jax.device_put((params, (x[:rows], labels[:rows])), jax.devices()[0])
  references = {
    "device_rows": jax.jit(jax.value_and_grad(loss))(*device_rows),
    "": reference,
  }
  k = PLAIN_K
  steps = {
    "full_batch": (jax.value_and_grad(loss), on_mesh),
    "full_batch_again": (jax.value_and_grad(loss), on_mesh),
    "jaxaccum": (jaxaccum.value_and_grad(loss, k), on_mesh),
    "jaxaccum_mesh": (
      jaxaccum.value_and_grad(loss, k, mesh=mesh, data_axis="data", param_specs=P()),
      on_mesh,
    ),
    "jaxaccum_explicit": (jaxaccum.value_and_grad(loss, k), on_explicit),
    "optax_microbatch": (
      make_approach("optax_microbatch", k, mesh, batch_size=PLAIN_BATCH_SIZE),
      on_mesh,
    ),
    "contiguous_scan": (_approaches.hand_scan(loss, k), on_mesh),
    "full_batch_one_device": (jax.value_and_grad(loss), one_device),
    "jaxaccum_one_device": (jaxaccum.value_and_grad(loss, k), one_device),
    "hand_scan_one_device": (_approaches.hand_scan(loss, k), one_device),
    "full_batch_device_rows": (jax.value_and_grad(loss), device_rows),
    "jaxaccum_device_rows": (jaxaccum.value_and_grad(loss, k), device_rows),
  }
  compiled = {
    name: (compile_step(fun, *args)[0], args) for name, (fun, args) in steps.items()
  }
  samples, repeats = _timing.interleaved(
    {name: functools.partial(step, *args) for name, (step, args) in compiled.items()},
    rounds=rounds,
    min_sample_ms=min_sample_ms,
  )
  timings = {
    name: {
      **_timing.quartiles(s),
      "samples_ms": s,
      "repeats_per_sample": repeats[name],
    }
    for name, s in samples.items()
  }
  results = {}
  for name, (step, args) in compiled.items():
    full = yardstick(name)
    colls = testing.collectives(step.as_text() or "")
    want = references["device_rows" if name.endswith("_device_rows") else ""]
    results[name] = {
      "label": PLAIN_APPROACHES[name],
      **timings[name],
      "ratio_to_full": timings[name]["median_ms"] / timings[full]["median_ms"],
      "yardstick": full,
      **collective_summary(colls),
      "data_moving_collectives": [c.op for c in colls if c.op in MOVES_DATA],
      "collectives": [c._asdict() for c in colls],
      "xla_flops_per_device": xla_flops(step),
      **accuracy(step(*args), want),
    }
  results["jaxaccum_explicit"]["data_axis"] = axis_summary(
    testing.collectives(compiled["jaxaccum_explicit"][0].as_text() or ""),
    explicit,
    "data",
  )
  profile = profile_thunks(
    {name: compiled[name] for name in PROFILED},
    rounds=profile_rounds,
    steps_per_trace=PROFILE_STEPS,
  )
  ratio = results["jaxaccum"]["ratio_to_full"]
  over_mesh = (
    results["jaxaccum_explicit"]["median_ms"] / results["jaxaccum_mesh"]["median_ms"]
  )
  aa = results["full_batch_again"]["ratio_to_full"]
  moved = results["jaxaccum"]["data_moving_collectives"]
  return {
    "model": {
      "kind": "mlp",
      "widths": list(PLAIN_WIDTHS),
      "num_params": sum(int(p.size) for p in jax.tree.leaves(params)),
    },
    "batch_size": PLAIN_BATCH_SIZE,
    "k": k,
    "rounds": rounds,
    "min_sample_ms": min_sample_ms,
    "mesh": {"shape": [NUM_DEVICES], "axis_names": ["data"], "axis_types": "Auto"},
    "batch_spec": str(P("data")),
    "param_spec": str(P()),
    "approaches": results,
    "aa_ratio": aa,
    "targets": [
      _target(
        f"jaxaccum time <= {PLAIN_TARGET:.2f} x full batch",
        ratio,
        f"<= {PLAIN_TARGET:.2f}",
        ratio <= PLAIN_TARGET,
        aa,
      ),
      _target(
        "jaxaccum on Explicit axes, plain jit: time <= mesh=",
        over_mesh,
        "<= 1.00",
        over_mesh <= 1.0,
        aa,
      ),
      _target(
        "no all-gather, collective-permute or all-to-all",
        len(moved),
        "== 0",
        not moved,
      ),
    ],
    "profile": profile,
    "load_average_at_end": list(os.getloadavg()),
  }


def _target(
  name: str, value: float, threshold: str, ok: bool, aa: float | None = None
) -> dict[str, Any]:
  """A part-2 target; one that compares times (``aa``: the run's A/A ratio)
  is decided only where the A/A control decides it."""
  out = {"target": name, "value": value, "threshold": threshold, "pass": ok}
  return out if aa is None else {**out, "timed": True, "decided": aa_decides(aa)}


#: An HLO computation's header and an instruction: ``%name = type opcode(``.
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(
  r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][\w\-]*)\((.*)$"
)
_LAYOUT = re.compile(r"\{[^}]*\}")
THUNK_KINDS = ("matmul", "collective", "copy/slice", "elementwise/reduce")
_COPIES = frozenset(
  {
    "copy",
    "dynamic-slice",
    "dynamic-update-slice",
    "slice",
    "concatenate",
    "transpose",
    "bitcast",
    "reshape",
    "broadcast",
    "parameter",
    "constant",
    "tuple",
    "get-tuple-element",
  }
)


def thunk_kinds(hlo: str) -> tuple[dict[str, str | None], dict[str, str]]:
  """Each instruction of an optimized HLO module, by name: its kind
  (:data:`THUNK_KINDS`; a fusion's from the ops it fuses), or None for a
  loop, call or conditional (its thunks are counted where they run); and
  its signature, ``f32[8,4] fusion(f32[8,4], f32[4,8])`` (result and
  operand types, layouts left out)."""
  ops: dict[str, set[str]] = {}
  instructions: dict[str, tuple[str, list[str]]] = {}
  types: dict[str, str] = {}
  operands: dict[str, list[str]] = {}
  current = None
  for line in hlo.splitlines():
    head = _COMPUTATION.match(line)
    if head and not line[:1].isspace():  # instructions are indented
      current = head.group(1)
      ops[current] = set()
      continue
    m = _INSTRUCTION.match(line)
    if m and current is not None:
      name, result, op, rest = m.groups()
      ops[current].add(op)
      instructions[name] = (op, re.findall(r"calls=%?([\w.\-]+)", rest))
      types[name] = _LAYOUT.sub("", result)
      operands[name] = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])

  def kind(op: str, calls: list[str]) -> str | None:
    if op in ("while", "call", "conditional"):
      return None
    fused = {op}.union(*(ops.get(c, set()) for c in calls))
    if any(o in testing.COLLECTIVES for o in fused):
      return "collective"
    if fused & {"dot", "convolution"}:
      return "matmul"
    if fused - {"fusion"} <= _COPIES:
      return "copy/slice"
    return "elementwise/reduce"

  signatures = {
    name: f"{types[name]} {op}({', '.join(types.get(o, o) for o in operands[name])})"
    for name, (op, _) in instructions.items()
  }
  kinds = {name: kind(op, calls) for name, (op, calls) in instructions.items()}
  return kinds, signatures


def trace_thunks(
  step: Any, args: tuple, kinds: dict[str, str | None], steps: int
) -> dict:
  """One ``jax.profiler`` trace of ``steps`` calls of the compiled ``step``:
  per step, the thunk executions and their summed milliseconds (over every
  device's threads) by kind (``kinds``, from :func:`thunk_kinds`)."""
  with tempfile.TemporaryDirectory() as folder:
    jax.profiler.start_trace(folder)
    for _ in range(steps):
      out = step(*args)
    jax.block_until_ready(out)
    jax.profiler.stop_trace()
    (trace,) = pathlib.Path(folder).rglob("*.xplane.pb")
    data = jax.profiler.ProfileData.from_file(str(trace))
  count = dict.fromkeys(THUNK_KINDS, 0)
  total = dict.fromkeys(THUNK_KINDS, 0.0)
  by_name: dict[str, float] = {}
  for plane in data.planes:
    for line in plane.lines:
      for event in line.events:
        kind = kinds.get(event.name)
        if kind is not None:
          count[kind] += 1
          total[kind] += event.duration_ns / 1e6
          by_name[event.name] = by_name.get(event.name, 0.0) + event.duration_ns / 1e6
  return {
    "thunks_per_step": {k: count[k] / steps for k in THUNK_KINDS},
    "thunk_ms_per_step": {k: total[k] / steps for k in THUNK_KINDS},
    "ms_per_step_by_instruction": {n: t / steps for n, t in by_name.items()},
  }


def profile_thunks(
  steps: dict[str, tuple[Any, tuple]], *, rounds: int, steps_per_trace: int
) -> dict[str, dict[str, Any]]:
  """:func:`trace_thunks` of each compiled step in ``steps`` (``name ->
  (step, args)``), in ``rounds`` interleaved rounds (round ``r`` traces
  every step once, in an order rotated by ``r``, as the timing does): the
  median over the rounds of each kind's thunks and milliseconds per step."""
  read = {name: thunk_kinds(step.as_text() or "") for name, (step, _) in steps.items()}
  names = list(steps)
  traces: dict[str, list[dict]] = {name: [] for name in names}
  for r in range(rounds):
    shift = r % len(names)
    for name in names[shift:] + names[:shift]:
      step, args = steps[name]
      traces[name].append(trace_thunks(step, args, read[name][0], steps_per_trace))
  return {
    name: {
      "rounds": rounds,
      "steps": steps_per_trace,
      **{
        what: {
          k: statistics.median(t[what][k] for t in traces[name]) for k in THUNK_KINDS
        }
        for what in ("thunks_per_step", "thunk_ms_per_step")
      },
      "longest_thunks": longest(traces[name], *read[name]),
      "traces": [
        {what: t[what] for what in ("thunks_per_step", "thunk_ms_per_step")}
        for t in traces[name]
      ],
    }
    for name in names
  }


def longest(
  traces: list[dict],
  kinds: dict[str, str | None],
  signatures: dict[str, str],
  top: int = 10,
) -> list[dict[str, Any]]:
  """The ``top`` instructions whose thunks last longest, the median over
  ``traces`` of their milliseconds per step (summed over the devices), with
  their kind and signature."""
  names = {n for t in traces for n in t["ms_per_step_by_instruction"]}
  spent = {
    n: statistics.median(t["ms_per_step_by_instruction"].get(n, 0.0) for t in traces)
    for n in names
  }
  return [
    {
      "instruction": n,
      "kind": kinds[n],
      "ms_per_step": spent[n],
      "signature": signatures[n],
    }
    for n in sorted(spent, key=spent.get, reverse=True)[:top]
  ]


def plot(results: dict[str, Any], png: pathlib.Path) -> None:
  """Bytes per step against ``k`` (log-scale y), and the compute estimate."""
  plt = pyplot()
  ks = results["ks"]
  grad_bytes = results["grad_bytes"]
  fig, (ax, ax_compute, ax_time) = plt.subplots(
    1, 3, figsize=(17, 4.8), layout="constrained", width_ratios=(3, 2, 2)
  )
  markers = dict(zip(APPROACHES, "os^D", strict=True))
  for name, label in results["approaches"].items():
    rows = [results["results"][name][str(k)] for k in ks]
    ax.plot(ks, [r["bytes_per_step"] for r in rows], marker=markers[name], label=label)
    ax_compute.plot(
      ks,
      [r["compute_vs_data_parallel_est"] for r in rows],
      marker=markers[name],
      label=label,
    )
  ax.plot(ks, [k * grad_bytes for k in ks], ":", color="gray", label="k x gradient")
  ax.axhline(grad_bytes, color="gray", ls="--", lw=0.8, label="1 x gradient")
  k_axis(ax, ks, "bytes communicated per step (per device)", logy=True)
  ax.set_title(
    f"{results['model']['num_params']:,}-parameter MLP, batch "
    f"{results['batch_size']} on {results['num_devices']} devices"
  )
  ax.legend(fontsize=7, loc="upper left")
  k_axis(ax_compute, ks, "per-device flops / plain data-parallel step")
  ax_compute.set_title("Compute per device (estimate: XLA flops x k)")
  ax_compute.axhline(results["num_devices"], color="gray", ls=":", lw=0.8)
  ax_compute.text(
    ks[0],
    results["num_devices"] * 0.93,
    "every device computes the whole batch",
    fontsize=8,
    color="gray",
    va="top",
  )
  plot_plain_jit(results["plain_jit"], ax_time)
  png.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(png, dpi=120)
  plt.close(fig)


def plot_plain_jit(plain: dict[str, Any], ax: Any) -> None:
  """Part 2: every sample of every approach (dots) and its median (a
  horizontal bar, log-scale time), with its ratio to its yardstick."""
  names = list(plain["approaches"])
  for i, name in enumerate(names):
    r = plain["approaches"][name]
    ax.barh(i, r["median_ms"], color=f"C{i % 10}", alpha=0.6)
    ax.plot(r["samples_ms"], [i] * len(r["samples_ms"]), ".", color="k", ms=2)
    ax.text(
      max(r["samples_ms"]) * 1.1,
      i,
      f"{r['ratio_to_full']:.2f}x",
      va="center",
      fontsize=7,
    )
  labels = [PLAIN_LABELS.get(n, n).replace("`", "") for n in names]
  ax.set_yticks(range(len(names)), labels, fontsize=7)
  ax.invert_yaxis()
  ax.set_xscale("log")
  ax.set(
    xlabel="ms per step (median of interleaved rounds; dots: samples)",
    title=(
      f"Plain jit, no mesh=: {plain['model']['num_params']:,}-parameter MLP, "
      f"B={plain['batch_size']}, k={plain['k']}"
    ),
  )
  ax.title.set_fontsize(9)


# ---------------------------------------------------------------- the manual's blocks


COMMUNICATION_APPROACHES = {
  "jaxaccum": "(a) jaxaccum, `mesh=`",
  "optax_microbatch": "(b) optax.microbatch",
  "hand_scan": "(c) hand-written scan",
  "jaxaccum_explicit": "(d) jaxaccum, plain `jit`, Explicit",
}


def machine_table(results: dict[str, Any], command: str) -> str:
  """The run: when, with what command, on what, how long (a table)."""
  m = results.get("machine", {})
  cpus = f"{m['cpu_count']}" if m.get("cpu_count") else "–"
  if m.get("pinned"):
    cpus += f", pinned to {','.join(map(str, m['cpus']))}"
  load, took = m.get("load_average_at_start"), results.get("seconds")
  return columns(
    [results],
    {
      "measured": lambda r: date(r["date"]),
      "command": lambda r: f"`{command}`",
      "devices": lambda r: f"{r['num_devices']} fake {r['backend'].upper()}",
      "CPU": lambda r: m.get("cpu_model") or "–",
      "cores": lambda r: cpus,
      "jax": lambda r: r["jax_version"],
      "optax": lambda r: r["optax_version"],
      "load average at the start": lambda r: f"{load[0]:.1f}" if load else "–",
      "wall time, s": lambda r: f"{took:.0f}" if took else "–",
    },
  )


def communication_bytes(results: dict[str, Any]) -> str:
  model = results["model"]
  head = (
    f"{model['num_params']:,}-parameter MLP ({' → '.join(map(str, model['widths']))}), "
    f"batch {results['batch_size']} over {results['num_devices']} devices; the "
    f"gradient is {mib(results['grad_bytes'], 2)} MiB. Per device and step:"
  )
  rows = [
    (label, k, results["results"][name][str(k)])
    for name, label in COMMUNICATION_APPROACHES.items()
    for k in results["ks"]
  ]
  spec = {
    "approach": lambda x: x[0],
    "k": lambda x: x[1],
    "MiB communicated": lambda x: mib(x[2]["bytes_per_step"], 2),
    "× gradient": lambda x: ratio(x[2]["bytes_over_grad_bytes"]),
    "collectives": lambda x: ", ".join(x[2]["bytes_by_op"]) or "none",
    "run in the loop": lambda x: x[2]["in_loop_executions_per_step"],
    "compute × data parallel (est.)": lambda x: ratio(
      x[2]["compute_vs_data_parallel_est"]
    ),
    "grads rel. error": lambda x: f"{x[2]['grads_rel_error']:.1e}",
  }
  return head + "\n\n" + columns(rows, spec)


def _data_axis_cell(d: dict[str, Any]) -> str:
  """The executions per step and bytes each of the collectives in the loop."""
  if not d["in_loop_executions_per_step"]:
    return "none"
  each = " or ".join(f"{b:,}" for b in d["in_loop_bytes_per_execution"])
  return f"{d['in_loop_executions_per_step']} × {each} B"


def _after_cell(d: dict[str, Any]) -> str:
  """``all-reduce, 2,674,688 B`` (each collective after the loop)."""
  if not d["after_loop"]:
    return "none"
  return "; ".join(f"{c['op']}, {c['bytes']:,} B" for c in d["after_loop"])


def communication_explicit(results: dict[str, Any]) -> str:
  explicit = results["explicit"]
  rows = [(m, k, r) for m in explicit.values() for k, r in m["rows"].items()]

  def mesh(m: dict[str, Any]) -> str:
    axes = zip(m["mesh"]["axis_names"], m["mesh"]["shape"], strict=True)
    return " × ".join(f"{a} ({n})" for a, n in axes)

  return columns(
    rows,
    {
      "mesh": lambda x: mesh(x[0]),
      "k": lambda x: "full batch" if x[1] == "0" else x[1],
      '`"data"` in the loop': lambda x: _data_axis_cell(x[2]["data_axis"]),
      '`"data"` after the loop': lambda x: _after_cell(x[2]["data_axis"]),
      # Every gradient, weight or bias, and the loss's 4 bytes, on one device.
      "grads + loss": lambda x: f"{sum(x[0]['leaf_bytes'].values()) + 4:,} B",
      '`"model"` in the loop': lambda x: (
        _data_axis_cell(x[2]["model_axis"]) if "model_axis" in x[2] else "–"
      ),
      "shardings kept": lambda x: "yes" if x[2]["grads_keep_shardings"] else "no",
      "grads rel. error": lambda x: f"{x[2]['grads_rel_error']:.1e}",
    },
  )


PLAIN_LABELS = {
  "full_batch": "full batch, `jit(jax.value_and_grad(loss))`",
  "full_batch_again": "the full batch again (A/A)",
  "jaxaccum": "jaxaccum, plain `jit`, no `mesh=`",
  "jaxaccum_mesh": "jaxaccum, `mesh=`",
  "jaxaccum_explicit": "jaxaccum, plain `jit`, no `mesh=`, Explicit axes",
  "optax_microbatch": "optax.microbatch, plain `jit`",
  "contiguous_scan": "contiguous split (hand-written scan)",
  "full_batch_one_device": "full batch, one device",
  "jaxaccum_one_device": "jaxaccum, one device (× the full batch on one device)",
  "hand_scan_one_device": "hand-written scan, one device (× the same)",
  "full_batch_device_rows": "full batch of B / 8 rows, one device",
  "jaxaccum_device_rows": "jaxaccum on B / 8 rows, one device (× the same)",
}


def communication_plain_jit(results: dict[str, Any]) -> str:
  plain = results["plain_jit"]
  model, load = plain["model"], plain["load_average_at_end"]
  head = (
    f"A {model['num_params']:,}-parameter MLP "
    f"({' → '.join(map(str, model['widths']))}), batch {plain['batch_size']:,} "
    f"sharded over {results['num_devices']} devices, k = {plain['k']}: the median "
    f"of {plain['rounds']} interleaved rounds (samples of at least "
    f"{plain['min_sample_ms']:g} ms); {aa_note(plain['aa_ratio'])}; load average "
    f"{load[0]:.1f} when the timing ended."
  )
  steps = columns(
    plain["approaches"].items(),
    {
      "approach": lambda x: PLAIN_LABELS.get(x[0], x[0]),
      "median ms": lambda x: ms(x[1]["median_ms"]),
      "quartiles": lambda x: f"{ms(x[1]['q1_ms'])} to {ms(x[1]['q3_ms'])}",
      "× full batch": lambda x: ratio(x[1]["ratio_to_full"]),
      "collectives that move batch rows": lambda x: (
        ", ".join(sorted(set(x[1]["data_moving_collectives"]))) or "none"
      ),
      "MiB communicated": lambda x: mib(x[1]["bytes_per_step"], 2),
      "collectives run in the loop": lambda x: x[1]["in_loop_executions_per_step"],
      "grads rel. error": lambda x: f"{x[1]['grads_rel_error']:.1e}",
    },
  )

  def outcome(t: dict[str, Any]) -> str:
    if t.get("timed"):
      return timed_verdict(t["pass"], plain["aa_ratio"])
    return "met" if t["pass"] else "missed"

  targets = columns(
    plain["targets"],
    {
      "target": lambda t: f"`{t['target']}`",
      "value": lambda t: (
        f"{t['value']:.2f}" if isinstance(t["value"], float) else t["value"]
      ),
      "outcome": outcome,
    },
  )
  return "\n\n".join([head, steps, targets])


def communication_profile(results: dict[str, Any]) -> str:
  plain = results["plain_jit"]
  profile, res, k = plain["profile"], plain["approaches"], plain["k"]

  def flops(name: str) -> str:
    loop = 1 if name.startswith("full_batch") else k
    full = res[res[name]["yardstick"]]["xla_flops_per_device"]
    return ratio(res[name]["xla_flops_per_device"] * loop / full)

  spec = {
    "step": lambda x: PLAIN_LABELS.get(x[0], x[0]),
    "× full batch (time)": lambda x: ratio(res[x[0]]["ratio_to_full"]),
    "× full batch (flops)": lambda x: flops(x[0]),
  }
  for kind in THUNK_KINDS:
    spec[f"{kind} thunks"] = lambda x, kind=kind: (
      f"{x[1]['thunks_per_step'][kind]:,.0f}"
    )
  for kind in THUNK_KINDS:
    spec[f"{kind} ms"] = lambda x, kind=kind: ms(x[1]["thunk_ms_per_step"][kind])
  longest = [
    (name, t)
    for name in ("full_batch", "jaxaccum_mesh", "jaxaccum_explicit")
    if name in profile
    for t in profile[name]["longest_thunks"][:4]
  ]
  first = next(iter(profile.values()))
  return "\n\n".join(
    [
      f"`jax.profiler` traces of {first['steps']} steps of each, in "
      f"{first['rounds']} interleaved rounds, the median over the rounds; per "
      "step, summed over the devices:",
      columns(profile.items(), spec),
      "The four longest instructions of each 8-device step:",
      columns(
        longest,
        {
          "step": lambda x: PLAIN_LABELS.get(x[0], x[0]),
          "instruction": lambda x: f"`{x[1]['instruction']}`",
          "kind": lambda x: x[1]["kind"],
          "signature": lambda x: f"`{x[1]['signature']}`",
          "ms": lambda x: ms(x[1]["ms_per_step"]),
        },
      ),
    ]
  )


#: The blocks written from ``communication.json``, by name (for ``_report.py``).
BLOCKS = {
  "communication machine": functools.partial(
    machine_table, command="python benchmarks/communication.py"
  ),
  "communication bytes": communication_bytes,
  "communication explicit": communication_explicit,
  "communication plain_jit": communication_plain_jit,
  "communication profile": communication_profile,
}


# ---------------------------------------------------------------- main


def run_and_write(
  name: str,
  run_fn: Callable[[argparse.Namespace], dict[str, Any]],
  plot_fn: Callable[[dict[str, Any], pathlib.Path], None],
  args: argparse.Namespace,
) -> tuple[dict[str, Any], pathlib.Path]:
  """Runs ``run_fn(args)`` on 8 CPU devices and writes ``name.json`` (with
  the seconds it took) and ``name.png`` (by ``plot_fn``) in ``args.out``
  (``name_quick.*`` for a ``--quick`` run). Returns the results and the
  JSON's path."""
  quick = getattr(args, "quick", False)
  # Before JAX starts: 8 CPU devices, unless XLA_FLAGS names a count, with
  # threads enough for their collectives.
  testing.cpu_devices()
  start = time.perf_counter()
  results = run_fn(args)
  results["seconds"] = time.perf_counter() - start
  args.out.mkdir(parents=True, exist_ok=True)
  path = args.out / (f"{name}_quick.json" if quick else f"{name}.json")
  path.write_text(json.dumps(results, indent=2) + "\n")
  plot_fn(results, path.with_suffix(".png"))
  return results, path


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark, writes the JSON and the PNG, returns the results."""
  parser = _paths.parser(
    __doc__,
    quick="k in 1 and 4, 5 rounds of 50 ms samples, to the temporary folder",
    rounds=f"part 2's timing rounds (default {PLAIN_ROUNDS})",
    cpus=True,
  )
  parser.add_argument(
    "--min-sample-ms",
    type=float,
    help=f"repeat a step within a sample until it lasts this long (default "
    f"{PLAIN_MIN_SAMPLE_MS:g})",
  )
  results, path = run_and_write("communication", run, plot, parser.parse_args(argv))
  print(
    communication_bytes(results),
    communication_plain_jit(results),
    communication_profile(results),
    sep="\n\n",
  )
  print(
    f"gradient: {results['grad_bytes']:,} bytes; total {results['seconds']:.1f} s; "
    f"wrote {path} and {path.with_suffix('.png')}"
  )
  return results


if __name__ == "__main__":
  main()
