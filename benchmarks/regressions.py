"""A regression guard: a fixed set of small steps, compiled, against a
committed baseline.

Run: ``python benchmarks/regressions.py --check`` (CI runs it on every
jax leg; exit 1 on a regression), ``--rebaseline`` to rewrite
``results/regressions-jax<minor>.json``, ``--targets`` to add the H100 and
TPU v5e rows. ``benchmarks/README.md``'s ``regressions.py`` section says
which steps (:data:`LAYOUTS`, a pipeline) and what :func:`measure` reads.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _paths
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from jaxaccum import testing

MINOR = ".".join(jax.__version__.split(".")[:2])
BASELINE = Path(__file__).parent / "results" / f"regressions-jax{MINOR}.json"
TOLERANCE = 0.01
EXACT = 1e-5
METRICS = ("peak_bytes", "collective_bytes", "data_bytes_in_loop")
B, F, H, K = 256, 64, 128, 4

# layout: (mesh shape, axis names, data axes, parameter specs)
LAYOUTS: dict[str, tuple[tuple[int, ...], tuple[str, ...], tuple[str, ...], dict]] = {
  "replicated": ((8,), ("data",), ("data",), {}),
  "tensor_parallel": (
    (4, 2),
    ("data", "model"),
    ("data",),
    {"w1": P(None, "model"), "w2": P("model", None)},
  ),
  "fsdp": ((8,), ("data",), ("data",), {"w1": P("data", None)}),
  "hsdp": ((2, 4), ("replica", "fsdp"), ("replica", "fsdp"), {"w1": P("fsdp", None)}),
}


def mlp(tp: bool, explicit: bool) -> Callable[..., jax.Array]:
  """The loss: tensor parallel over "model" where ``tp``; on Explicit axes
  a contraction over sharded features names its output's sharding."""

  def loss(p, batch):
    x, y = batch
    rows = jax.typeof(x).sharding.spec[0] if explicit else None
    out = {"out_sharding": P(rows, None)} if explicit and tp else {}
    h = jnp.tanh(x @ p["w1"])
    return jnp.mean((jnp.matmul(h, p["w2"], **out) + p["b"] - y) ** 2)

  return loss


def arrays(mesh: jax.sharding.Mesh, specs: dict, data: tuple[str, ...]) -> tuple:
  keys = jax.random.split(jax.random.key(0), 3)
  params = {
    "w1": jax.random.normal(keys[0], (F, H)) / F**0.5,
    "w2": jax.random.normal(keys[1], (H, 1)) / H**0.5,
    "b": jnp.zeros((1, 1)),
  }
  x = jax.random.normal(keys[2], (B, F))
  put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
  params = {n: put(a, specs.get(n, P())) for n, a in params.items()}
  rows = P(data if len(data) > 1 else data[0])
  return params, (put(x, rows), put(jnp.sin(x[:, :1]), rows))


def mlp_step(layout: str, path: str, target: Any = None) -> tuple[Any, ...]:
  """The step, its arguments, mesh, data axes and loss; for a compile-only
  ``target``, on that target's devices."""
  shape, names, data, specs = LAYOUTS[layout]
  explicit = path == "plain"
  kind = AxisType.Explicit if explicit else AxisType.Auto
  types = (kind,) * len(names)
  mesh = target.mesh(shape, names, axis_types=types) if target else None
  mesh = mesh or jax.make_mesh(shape, names, axis_types=types)
  args = arrays(jax.make_mesh(shape, names) if target else mesh, specs, data)
  if target:
    args = jax.tree.map(lambda a: target.place(a, a.sharding.spec, mesh=mesh), args)
  loss = mlp("model" in names, explicit)
  every = {n: specs.get(n, P()) for n in ("w1", "w2", "b")}
  options = {} if explicit else {"mesh": mesh, "data_axis": data, "param_specs": every}
  return jaxaccum.value_and_grad(loss, K, **options), args, mesh, data, loss


def pipeline_step(path: str) -> tuple[Any, ...]:
  """4 stages of 2 residual layers each, over ("data", "stage") = (2, 4)."""
  kind = AxisType.Explicit if path == "plain" else AxisType.Auto
  mesh = jax.make_mesh((2, 4), ("data", "stage"), axis_types=(kind,) * 2)
  pipe = jaxaccum.pipeline(
    lambda w, h: h + jnp.tanh(h @ w), num_stages=4, num_micro_batches=4
  )

  def loss(stacked, batch):
    x, y = batch
    out = jnp.sum(pipe(stacked, x), axis=1, keepdims=True)
    if path == "plain":  # the rows come back over ("data", "stage"): the labels too
      y = jax.sharding.reshard(y, jax.typeof(out).sharding.spec)
    return jnp.mean((out - y) ** 2)

  stacked = jax.random.normal(jax.random.key(1), (8, F, F)) / F
  x = jax.random.normal(jax.random.key(2), (B, F))
  put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
  args = (put(stacked, P("stage")), (put(x, P("data")), put(x[:, :1], P("data"))))
  options = {} if path == "plain" else {"mesh": mesh, "data_axis": "data"}
  return jaxaccum.value_and_grad(loss, 2, **options), args, mesh, ("data",), loss


def measure(
  step: Any,
  args: tuple,
  mesh: jax.sharding.Mesh,
  data: tuple,
  loss: Any,
  *,
  target=None,
) -> dict:
  """The step's bytes; on this machine (no ``target``) also its deviation
  from the full batch's value and gradients."""
  fun = jax.jit(step)
  with jax.set_mesh(mesh):
    stats = jaxaccum.compiled_memory(fun, *args, target=target)
    colls = testing.collectives(testing.compiled_text(fun, *args, target=target))
    right = (
      {}
      if target
      else {"error": deviation(fun(*args), jax.jit(jax.value_and_grad(loss))(*args))}
    )
  shape = tuple(mesh.shape.values())
  dims = [mesh.axis_names.index(a) for a in data]
  return {
    "peak_bytes": int(stats.peak_bytes),
    "collective_bytes": sum(c.bytes * c.executions for c in colls),
    "data_bytes_in_loop": sum(
      c.bytes * c.executions for c in colls if c.in_loop and c.spans(shape, dims)
    ),
    **right,
  }


def deviation(got: Any, want: Any) -> float:
  """The largest difference between the step's value and gradients and the
  full batch's, over the largest magnitude among the latter."""
  pairs = list(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))
  scale = max(float(jnp.max(jnp.abs(w))) for _, w in pairs)
  return max(float(jnp.max(jnp.abs(g - w))) for g, w in pairs) / scale


def cpu_rows() -> dict[str, dict]:
  rows = {}
  for path in ("plain", "mesh"):
    for layout in LAYOUTS:
      rows[f"cpu8/{layout}/{path}"] = measure(*mlp_step(layout, path))
    rows[f"cpu8/pipeline/{path}"] = measure(*pipeline_step(path))
  return rows


def target_rows() -> dict[str, dict]:
  """The replicated and FSDP plain-jit steps for 8 H100s and a TPU v5e 2x4,
  and the FSDP step through ``mesh=`` on Auto axes (the per-device view's
  blocked leaves, where the partitioner places the gathers)."""
  rows = {}
  for name in ("h100", "tpu-v5e"):
    target = jaxaccum.compile_target(name, topology=_paths.TOPOLOGIES[name])
    for layout, path in (("replicated", "plain"), ("fsdp", "plain"), ("fsdp", "mesh")):
      rows[f"{name}/{layout}/{path}"] = measure(
        *mlp_step(layout, path, target), target=target
      )
  return rows


def regressions(rows: dict[str, dict], baseline: dict[str, dict]) -> list[str]:
  """Every metric of a step more than ``TOLERANCE`` above its baseline, and
  every baseline step that is gone, said in a line."""
  found = []
  for name, want in baseline.items():
    got = rows.get(name)
    if got is None:
      continue
    for metric in METRICS:
      limit = want[metric] * (1 + TOLERANCE)
      if got[metric] > limit:
        found.append(f"{name}: {metric} {got[metric]:,} > baseline {want[metric]:,}")
  return found


def cli() -> argparse.ArgumentParser:
  parser = _paths.parser(__doc__, out=False)
  parser.add_argument("--check", action="store_true", help="compare (the default)")
  parser.add_argument("--rebaseline", action="store_true", help="rewrite the baseline")
  parser.add_argument("--targets", action="store_true", help="add the H100/TPU rows")
  parser.add_argument("--baseline", type=Path, default=BASELINE)
  return parser


def main(argv: list[str] | None = None) -> int:
  args = cli().parse_args(argv)
  rows = cpu_rows()
  if args.targets:
    rows.update(target_rows())
  saved = json.loads(args.baseline.read_text()) if args.baseline.exists() else {}
  if args.rebaseline:
    saved.update({n: {m: r[m] for m in METRICS} for n, r in rows.items()})
    args.baseline.write_text(json.dumps(dict(sorted(saved.items())), indent=1) + "\n")
    print(f"wrote {len(rows)} steps to {args.baseline}")
    return 0
  missing = [name for name in rows if name not in saved]
  found = regressions(rows, saved) + [f"{n}: no baseline" for n in missing]
  found += [
    f"{name}: value and gradients {got['error']:.1e} off the full batch's"
    for name, got in rows.items()
    if got.get("error", 0.0) > EXACT
  ]
  for name, got in rows.items():
    exact = f" error={got['error']:.1e}" if "error" in got else ""
    print(name, " ".join(f"{m}={got[m]:,}" for m in METRICS) + exact)
  for line in found:
    print("REGRESSION", line)
  print(f"{len(rows)} steps checked, {len(found)} regressions")
  return 1 if found else 0


if __name__ == "__main__":
  sys.exit(main())
