"""Bytes and memory per step of gradient accumulation on 2-D and 3-D meshes.

On 8 fake CPU devices, each of :data:`LAYOUTS` with ``Auto`` and
``Explicit`` axes, the residual MLP of :func:`make_loss`; per ``k`` the
``(loss, grads)`` of each of :data:`APPROACHES` and of the full batch, read
by :func:`measure`. Outputs ``meshes.json`` and ``meshes.png`` in ``--out``.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import _approaches
import _paths
import communication
import jax
import jax.numpy as jnp
import numpy as np
from _report import format_bytes, k_axis, mib, pyplot, ratio, table
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from jaxaccum import testing

PyTree = Any

FEATURES = 128
HIDDEN = 4096
NUM_BLOCKS = 2
BATCH_SIZE = 4096
KS = (1, 2, 4, 8, 16)
MODES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}
APPROACHES = {
  "jaxaccum": "(a) jaxaccum, mesh=, data_axis=",
  "jaxaccum_once": '(a\') jaxaccum, fsdp_gather="once"',
  "optax_microbatch": "(b) optax.microbatch under jit",
  "hand_scan": "(c) hand-written lax.scan under jit",
}
FULL_BATCH = "full_batch"
FULL_BATCH_LABEL = "(d) full batch, jit(jax.value_and_grad(loss))"


@dataclasses.dataclass(frozen=True)
class Layout:
  """A mesh and where the parameters live on it: the axis (or axes) the
  batch is split over, the data axis the weights are sharded over (FSDP, or
  None) and the tensor-parallel axis."""

  name: str
  title: str
  shape: tuple[int, ...]
  axis_names: tuple[str, ...]
  data_axis: str | tuple[str, ...]
  fsdp_axis: str | None
  model_axis: str = "model"

  def mesh(self, axis_type: AxisType) -> jax.sharding.Mesh:
    return jax.make_mesh(
      self.shape, self.axis_names, axis_types=(axis_type,) * len(self.shape)
    )

  @property
  def data_axes(self) -> tuple[str, ...]:
    return (self.data_axis,) if isinstance(self.data_axis, str) else self.data_axis

  def dims(self, axes: Sequence[str]) -> list[int]:
    """The mesh dimensions of ``axes``."""
    return [self.axis_names.index(a) for a in axes]

  def param_specs(self) -> list[dict[str, P]]:
    """Megatron-style tensor parallelism, FSDP along ``fsdp_axis`` if any:
    ``w1`` column-parallel, ``w2`` row-parallel."""
    block = {
      "w1": P(self.fsdp_axis, self.model_axis),
      "b1": P(self.model_axis),
      "w2": P(self.model_axis, self.fsdp_axis),
      "b2": P(),
    }
    return [block] * NUM_BLOCKS


LAYOUTS = (
  Layout("tp", "(4, 2) data x model: tensor parallel", (4, 2), ("data", "model"), "data", None),
  Layout("fsdp_tp", "(4, 2) data x model: FSDP + TP", (4, 2), ("data", "model"), "data", "data"),
  Layout(
    "hsdp_tp",
    "(2, 2, 2) replica x fsdp x model: HSDP + TP",
    (2, 2, 2),
    ("replica", "fsdp", "model"),
    ("replica", "fsdp"),
    "fsdp",
  ),
)  # fmt: skip


def init_params(rng: np.random.Generator) -> list[dict[str, np.ndarray]]:
  """``NUM_BLOCKS`` residual MLP blocks ``FEATURES -> HIDDEN -> FEATURES``."""

  def normal(fan_in: int, fan_out: int) -> np.ndarray:
    return (rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in)).astype(np.float32)

  return [
    {
      "w1": normal(FEATURES, HIDDEN),
      "b1": np.zeros(HIDDEN, np.float32),
      "w2": normal(HIDDEN, FEATURES),
      "b2": np.zeros(FEATURES, np.float32),
    }
    for _ in range(NUM_BLOCKS)
  ]


def make_loss(model_axis: str, explicit: bool) -> Callable[..., jax.Array]:
  """The residual MLP's mean squared error, as a user writes it: on an
  Explicit mesh the FSDP weights are gathered (``reshard``) and the
  row-parallel contraction names its output sharding, the batch axis read
  from the input's type (the data axis under ``jit``, None inside jaxaccum)."""

  def loss(params: list[dict], batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    h, target = batch
    for block in params:
      w1, w2 = block["w1"], block["w2"]
      if explicit:
        w1 = jax.sharding.reshard(w1, P(None, model_axis))
        w2 = jax.sharding.reshard(w2, P(model_axis, None))
      a = jnp.tanh(h @ w1 + block["b1"])
      if explicit:
        out = jnp.einsum(
          "bh,hf->bf", a, w2, out_sharding=P(jax.typeof(a).sharding.spec[0], None)
        )
      else:
        out = a @ w2
      h = h + out + block["b2"]
    return jnp.mean((h - target) ** 2)

  return loss


def axes_spanned(c: testing.Collective, layout: Layout) -> str:
  """``data``, ``model``, ``data+model`` or ``none``: the mesh axes that a
  collective's replica groups communicate over."""
  data = c.spans(layout.shape, layout.dims(layout.data_axes))
  model = c.spans(layout.shape, layout.dims((layout.model_axis,)))
  return {
    (True, True): "data+model",
    (True, False): "data",
    (False, True): "model",
  }.get((data, model), "none")


def measure(
  fun: communication.LossAndGrads,
  k: int,
  *,
  layout: Layout,
  mesh: jax.sharding.Mesh,
  params: PyTree,
  batch: PyTree,
  reference: tuple[jax.Array, PyTree],
) -> dict[str, Any]:
  """Compiles ``jit(fun)`` on ``mesh``, the grads' ``out_shardings`` the
  parameters' (as a step that updates them in place): bytes by mesh axes,
  peak memory, flops; runs it once against ``reference``. A failure to trace
  or compile is recorded (error class and first line), not raised."""
  out_shardings = (NamedSharding(mesh, P()), jax.tree.map(lambda p: p.sharding, params))
  jitted = jax.jit(fun, out_shardings=out_shardings)
  with jax.set_mesh(mesh):  # plain jit on an Explicit mesh needs it
    try:
      compiled, compile_seconds = communication.compile_step(jitted, params, batch)
    except Exception as error:  # what the approach does on this mesh
      message = str(error).strip().splitlines()
      return {
        "ok": False,
        "error": type(error).__name__,
        "error_message": message[0] if message else "",
      }
    memory = jaxaccum.compiled_memory(jitted, params, batch)  # cached compile
    start = time.perf_counter()
    outputs = jax.block_until_ready(compiled(params, batch))
    run_seconds = time.perf_counter() - start
  colls = testing.collectives(compiled.as_text() or "")
  spanned = [axes_spanned(c, layout) for c in colls]
  by_axes = {name: 0 for name in ("data", "model", "data+model", "none")}
  for c, axes in zip(colls, spanned, strict=True):
    by_axes[axes] += c.bytes * c.executions
  return {
    "ok": True,
    "bytes_over_data_axes": by_axes["data"],
    "bytes_over_model_axis": by_axes["model"],
    "bytes_over_data_and_model": by_axes["data+model"],
    "bytes_within_device": by_axes["none"],
    "in_loop_data_axis_executions": sum(
      c.executions
      for c, a in zip(colls, spanned, strict=True)
      if c.in_loop and "data" in a
    ),
    **communication.collective_summary(colls),
    "collectives": [
      {
        "op": c.op,
        "bytes": c.bytes,
        "executions": c.executions,
        "in_loop": c.in_loop,
        "axes": a,
      }
      for c, a in zip(colls, spanned, strict=True)
    ],
    "peak_bytes": memory.peak_bytes,
    "memory": {
      "argument_bytes": memory.argument_bytes,
      "output_bytes": memory.output_bytes,
      "temp_bytes": memory.temp_bytes,
      "alias_bytes": memory.alias_bytes,
    },
    "xla_flops_per_device": communication.xla_flops(compiled),
    "k": k,
    **communication.accuracy(outputs, reference),
    "grads_sharded_like_params": communication.keeps_shardings(outputs[1], params),
    "compile_seconds": compile_seconds,
    "run_seconds": run_seconds,
  }


def relative(results: dict[str, Any]) -> None:
  """Adds each approach's numbers relative to the full batch on its mesh, in
  place: ``*_vs_full`` ratios and the compute estimate ``flops x k / full``
  (XLA counts a loop body once)."""
  full = results[FULL_BATCH]
  for name in APPROACHES:
    for r in results[name].values():
      if not r["ok"]:
        continue
      for key in ("bytes_over_data_axes", "bytes_over_model_axis", "peak_bytes"):
        r[f"{key}_vs_full"] = r[key] / full[key] if full[key] else None
      r["compute_vs_full_est"] = (
        r["xla_flops_per_device"] * r["k"] / full["xla_flops_per_device"]
      )


def run() -> dict[str, Any]:
  """Measures every layout, axis type, approach and ``k``; JSON-ready results."""
  if jax.device_count() < communication.NUM_DEVICES:
    raise RuntimeError(
      f"Needs {communication.NUM_DEVICES} devices, found {jax.device_count()}."
    )
  env = communication.environment(__doc__)
  rng = np.random.default_rng(0)
  params = init_params(rng)
  x = rng.standard_normal((BATCH_SIZE, FEATURES), dtype=np.float32)
  batch = (x, np.sin(x))
  # One device, unsharded: the reference for every approach on every mesh.
  reference = jax.jit(jax.value_and_grad(make_loss("model", explicit=False)))(
    params, batch
  )
  param_bytes = _approaches.tree_bytes(params)
  results: dict[str, Any] = {}
  for layout in LAYOUTS:
    specs = layout.param_specs()
    results[layout.name] = {}
    for mode_name, mode in MODES.items():
      mesh = layout.mesh(mode)
      loss_fn = make_loss(layout.model_axis, explicit=mode == AxisType.Explicit)
      sharded = [
        {n: jax.device_put(v, NamedSharding(mesh, spec[n])) for n, v in block.items()}
        for block, spec in zip(params, specs, strict=True)
      ]
      sharded_batch = jax.device_put(batch, NamedSharding(mesh, P(layout.data_axis)))
      on_mesh = {
        "layout": layout,
        "mesh": mesh,
        "params": sharded,
        "batch": sharded_batch,
        "reference": reference,
      }
      entry: dict[str, Any] = {
        FULL_BATCH: measure(jax.value_and_grad(loss_fn), 1, **on_mesh)
      }
      for name in APPROACHES:
        entry[name] = {}
        for k in KS:
          fun = communication.make_approach(
            name,
            k,
            mesh,
            loss_fn=loss_fn,
            batch_size=BATCH_SIZE,
            data_axis=layout.data_axis,
            param_specs=specs,
          )
          entry[name][str(k)] = measure(fun, k, **on_mesh)
      relative(entry)
      results[layout.name][mode_name] = entry
      print(f"{layout.title}, {mode_name} axes: measured", flush=True)

  env["machine"]["load_average_at_end"] = list(os.getloadavg())
  return {
    **env,
    "model": {
      "kind": "residual tanh MLP, mean squared error",
      "features": FEATURES,
      "hidden": HIDDEN,
      "num_blocks": NUM_BLOCKS,
      "num_params": sum(int(p.size) for p in jax.tree.leaves(params)),
      "param_bytes": param_bytes,
    },
    "batch_size": BATCH_SIZE,
    "batch_bytes": _approaches.tree_bytes(batch),
    "ks": list(KS),
    "memory_convention": (
      "per device: XLA compiled memory analysis, argument + output + temp - "
      "alias (jaxaccum.compiled_memory(...).peak_bytes)"
    ),
    "approaches": {**APPROACHES, FULL_BATCH: FULL_BATCH_LABEL},
    "layouts": {
      layout.name: {
        "title": layout.title,
        "mesh_shape": list(layout.shape),
        "axis_names": list(layout.axis_names),
        "data_axis": layout.data_axis,
        "model_axis": layout.model_axis,
        "param_specs": {n: str(s) for n, s in layout.param_specs()[0].items()},
        "batch_spec": str(P(layout.data_axis)),
      }
      for layout in LAYOUTS
    },
    "results": results,
  }


def plot(results: dict[str, Any], png: pathlib.Path) -> None:
  """Per layout (rows): MiB over the data axes (log scale), over the model
  axis, and the peak per device, against ``k``; solid Auto, dashed Explicit
  axes, gray lines the full batch. Failed approaches are named in the legend."""
  plt = pyplot()
  import matplotlib.ticker  # noqa: PLC0415

  ks = results["ks"]
  columns = (
    ("bytes_over_data_axes", "MiB over the data axes / step"),
    ("bytes_over_model_axis", "MiB over the model axis / step"),
    ("peak_bytes", "peak MiB per device"),
  )
  fig, axes = plt.subplots(
    len(results["layouts"]), len(columns), figsize=(15, 12), layout="constrained"
  )
  colors = dict(zip(APPROACHES, ("C0", "C3", "C1", "C2"), strict=True))
  markers = dict(zip(APPROACHES, "oDs^", strict=True))
  styles = {"auto": "-", "explicit": "--"}
  for row, (lname, layout) in zip(axes, results["layouts"].items(), strict=True):
    for ax, (key, ylabel) in zip(row, columns, strict=True):
      for mode, style in styles.items():
        entry = results["results"][lname][mode]
        ax.axhline(
          entry[FULL_BATCH][key] / 2**20,
          color="gray",
          ls=style,
          lw=1.5,
          label=f"{FULL_BATCH_LABEL} ({mode})",
        )
        for name, label in APPROACHES.items():
          rows = [entry[name][str(k)] for k in ks]
          points = [
            (k, r[key] / 2**20) for k, r in zip(ks, rows, strict=True) if r["ok"]
          ]
          errors = sorted({r["error"] for r in rows if not r["ok"]})
          failed = f", fails: {', '.join(errors)}" if errors else ""
          ax.plot(
            *(zip(*points, strict=True) if points else ([], [])),
            ls=style,
            marker=markers[name],
            color=colors[name],
            mfc="none" if mode == "explicit" else colors[name],
            label=f"{label} ({mode}{failed})",
          )
      log = key == "bytes_over_data_axes"
      k_axis(ax, ks, ylabel, logy=log, title=layout["title"])
      if log:
        ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
  handles, labels = axes[0][0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="outside lower center", ncol=2, fontsize=8)
  fig.suptitle(
    f"{results['model']['num_params']:,}-parameter residual MLP, batch "
    f"{results['batch_size']}, {results['num_devices']} CPU devices, per device; "
    f"jax {results['jax_version']}, {results['date'][:10]}",
    fontsize=10,
  )
  png.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(png, dpi=110)
  plt.close(fig)


# ---------------------------------------------------------------- the manual's blocks


MESH_APPROACHES = {
  "jaxaccum": "jaxaccum",
  "jaxaccum_once": 'jaxaccum, `fsdp_gather="once"`',
  "optax_microbatch": "optax.microbatch",
  "hand_scan": "hand-written scan",
}
MESH_LAYOUTS = {"tp": "TP", "fsdp_tp": "FSDP + TP", "hsdp_tp": "HSDP + TP"}


def _mesh_name(results: dict[str, Any], layout: str, mode: str) -> str:
  shape = ",".join(str(n) for n in results["layouts"][layout]["mesh_shape"])
  return f"({shape}) {MESH_LAYOUTS.get(layout, layout)}, {mode.capitalize()}"


def _mesh_rows(
  results: dict[str, Any],
  cell: Callable[[dict[str, Any]], str],
  full_cell: Callable[[dict[str, Any]], str],
) -> list[list[str]]:
  rows = []
  for layout, modes in results["results"].items():
    for mode, entry in modes.items():
      lead = [_mesh_name(results, layout, mode), full_cell(entry["full_batch"])]
      for approach, label in MESH_APPROACHES.items():
        if approach in entry:  # the mesh's name and full batch on its first row
          runs = [entry[approach][str(k)] for k in results["ks"]]
          cells = [cell(r) if r["ok"] else f"fails (`{r['error']}`)" for r in runs]
          rows.append([*lead, label, *cells])
          lead = ["", ""]
  return rows


def meshes_layouts(results: dict[str, Any]) -> str:
  rows = []
  for name, layout in results["layouts"].items():
    shape = ", ".join(str(n) for n in layout["mesh_shape"])
    axes = " × ".join(f"`{a}`" for a in layout["axis_names"])
    specs = layout["param_specs"]
    data_axis = layout["data_axis"]
    data_axis = (
      f'"{data_axis}"'
      if isinstance(data_axis, str)
      else "(" + ", ".join(f'"{a}"' for a in data_axis) + ")"
    )
    rows.append(
      [
        f"`{name}`: {MESH_LAYOUTS.get(name, name)}",
        f"({shape}) {axes}",
        ", ".join(f"`{leaf}` `{spec}`" for leaf, spec in specs.items()),
        f"`{layout['batch_spec']}`",
        f"`data_axis={data_axis}`",
      ]
    )
  return table(
    ["layout", "mesh", "parameters, per block", "batch", "what you write"], rows
  )


def meshes_machine(results: dict[str, Any]) -> str:
  model = results["model"]
  widths = f"{model['features']} → {model['hidden']} → {model['features']}"
  header = ["model", "parameters", "blocks", "MiB", "batch rows", "batch MiB"]
  row = [model["kind"], f"{model['num_params']:,}", f"{model['num_blocks']} × {widths}"]
  row += [mib(model["param_bytes"], 2), f"{results['batch_size']:,}"]
  row += [mib(results["batch_bytes"], 2)]
  return (
    communication.machine_table(results, "python benchmarks/meshes.py")
    + "\n\n"
    + table(header, [row])
  )


def _meshes_table(
  caption: str, full: str, cell: Callable[..., str], full_cell: Callable[..., str]
) -> Callable[[dict[str, Any]], str]:
  """A block of one number per mesh, approach and ``k``."""

  def block(results: dict[str, Any]) -> str:
    header = ["mesh, axes", full, "approach", *(f"k = {k}" for k in results["ks"])]
    return caption + ":\n\n" + table(header, _mesh_rows(results, cell, full_cell))

  return block


meshes_bytes = _meshes_table(
  "Bytes over the data axes / over the model axis, per device and step, × "
  "the full batch's on the same mesh",
  "full batch, MiB",
  lambda r: (
    f"{ratio(r['bytes_over_data_axes_vs_full'])} / "
    f"{ratio(r['bytes_over_model_axis_vs_full'])}"
  ),
  lambda r: (
    f"{mib(r['bytes_over_data_axes'], 2)} / {mib(r['bytes_over_model_axis'], 2)}"
  ),
)
meshes_peak = _meshes_table(
  "Peak memory per device (`argument + output + temp − alias`), × the full "
  "batch's on the same mesh",
  "full batch, MiB",
  lambda r: ratio(r["peak_bytes_vs_full"]),
  lambda r: mib(r["peak_bytes"], 2),
)
meshes_in_loop = _meshes_table(
  "Data-axis collectives executed inside the micro-batch loop, per step "
  "(a collective in the loop counts once per micro-batch)",
  "full batch",
  lambda r: str(r["in_loop_data_axis_executions"]),
  lambda r: str(r["in_loop_data_axis_executions"]),
)
meshes_compute = _meshes_table(
  "XLA's flops per device times k over the full batch's (a loop body counts "
  "once); the full batch's gradients' error against one device",
  "full batch",
  lambda r: ratio(r["compute_vs_full_est"]),
  lambda r: f"{r['grads_rel_error']:.1e}",
)


#: The blocks written from ``meshes.json``, by name (for ``_report.py``).
BLOCKS = {
  "meshes layouts": meshes_layouts,
  "meshes machine": meshes_machine,
  "meshes bytes": meshes_bytes,
  "meshes peak": meshes_peak,
  "meshes in_loop": meshes_in_loop,
  "meshes compute": meshes_compute,
}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark, writes the JSON and the PNG, returns the results."""
  args = _paths.parser(__doc__).parse_args(argv)
  results, path = communication.run_and_write("meshes", lambda _: run(), plot, args)
  for block in (meshes_bytes, meshes_in_loop, meshes_peak):
    print(block(results), end="\n\n")
  print(
    f"parameters {format_bytes(results['model']['param_bytes'])}, batch "
    f"{format_bytes(results['batch_bytes'])}; total {results['seconds']:.1f} s; "
    f"wrote {path} and {path.with_suffix('.png')}"
  )
  return results


if __name__ == "__main__":
  main()
