"""DP-SGD: memory on a compile-only H100 against k, and step time against jax-privacy.

The parts (``--part``): ``memory`` (:func:`memory_part`), the DP step's
per-device peak against k, compiled for an H100 that is not there, and the
largest logical batch it fits; ``ghost`` (:func:`ghost_part`), one
micro-batch by ``clip_method="ghost"`` beside ``"vmap"``, jax-privacy's
``clipped_grad`` and the non-private step, and the largest each fits;
``time`` (:func:`time_part`), the step on this CPU beside jax-privacy's, in
interleaved rounds with an A/A control; ``exact`` (:func:`exact_rows`),
ghost's clipped sum against a reference written here; ``audit``
(:func:`audit_rows`), one example's effect on what the noise covers.
``benchmarks/README.md``'s ``dp.py`` section says how each is measured and
how to read the tables this file's :data:`BLOCKS` write there.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import concurrent.futures
import contextlib
import dataclasses
import datetime
import json
import pathlib
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pydoc_data import topics
from typing import Any

import _compile
import _models
import _paths
import _report
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from sklearn.datasets import load_digits

import jaxaccum
from jaxaccum import testing

HERE = pathlib.Path(__file__).resolve().parent
CLIP = 1.0
SIGMA = 1.0
GB = 10**9


def one_example(batch_loss: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
  """``batch_loss`` on ONE example (no batch axis)."""
  return lambda params, x: batch_loss(params, jax.tree.map(lambda a: a[None], x))


def example_loss(cfg: _models.TransformerConfig) -> Callable[..., jax.Array]:
  """The transformer's loss on ONE sequence."""
  return one_example(_models.make_transformer_loss(cfg))


def dp_tx(expected: float) -> optax.GradientTransformation:
  return optax.chain(
    jaxaccum.dp_noise(
      SIGMA, CLIP, jax.random.key(0), normalize="poisson", expected_batch_size=expected
    ),
    optax.adam(1e-4),
  )


# ---------------------------------------------------------------- part 1: memory


def step_peak(
  cfg: _models.TransformerConfig,
  target: Any,
  batch: int,
  k: int,
  clip_method: str | None = "vmap",
) -> int | None:
  """Per-device peak of jaxaccum's DP step for ``batch`` sequences in ``k``
  micro-batches on ``target`` (``clip_method=None``: the same step without
  privacy: a batch loss, Adam, no clipping, no noise; ``"jax_privacy"``: the
  DP step written with jax-privacy's ``clipped_grad``, as timed in part 2);
  None if XLA refuses it."""
  params = jax.eval_shape(lambda: _models.transformer_init(jax.random.key(0), cfg))
  tokens = jax.ShapeDtypeStruct((batch, cfg.seq_len + 1), jnp.int32)
  tx, mask = optax.adam(1e-4), jax.ShapeDtypeStruct((batch,), jnp.float32)
  if clip_method == "jax_privacy":
    fun = jax_privacy_update(example_loss(cfg), batch, k)
    mask = jax.eval_shape(lambda: jax.random.key(1))  # the noise's key, in its place
  elif clip_method is None:
    step = jaxaccum.make_train_step(_models.make_transformer_loss(cfg), tx, k)
    fun = lambda p, s, t, m: step(p, s, t)  # noqa: E731
  else:
    tx = dp_tx(float(batch))
    step = jaxaccum.make_train_step(
      example_loss(cfg), tx, k, clip_per_example=CLIP, clip_method=clip_method
    )
    # The mask by position: a keyword ShapeDtypeStruct would be a static value.
    fun = lambda p, s, t, m: step(p, s, t, example_mask=m)  # noqa: E731
  args = (params, jax.eval_shape(tx.init, params), tokens, mask)
  return _peak(jax.jit(fun, donate_argnums=(0, 1)), args, target, batch, k)


def _peak(
  jitted: Any, args: tuple[Any, ...], target: Any, batch: int, k: int
) -> int | None:
  try:
    with warnings.catch_warnings():  # which leaves fall back is not a result
      warnings.simplefilter("ignore", jaxaccum.GhostFallbackWarning)
      stats = jaxaccum.compiled_memory(jitted, *args, target=target)
  except Exception as error:  # XLA's out-of-memory refusal, for one
    print(f"  batch {batch}, k={k}: not compiled ({str(error).splitlines()[0]})")
    return None
  return int(stats.peak_bytes)


#: The ghost part's steps: its JSON key, and ``step_peak``'s ``clip_method``.
GHOST_METHODS = {
  "peak": "vmap",
  "peak_ghost": "ghost",
  "peak_jax_privacy": "jax_privacy",
  "peak_non_private": None,
}


def ghost_part(
  preset: str,
  sizes: tuple[int, ...],
  search: bool,
  earlier: dict[str, Any] | None = None,
  jobs: int = 1,
) -> dict[str, Any]:
  """One micro-batch of ``m`` sequences (k = 1) on the compile-only H100:
  the DP step's peak by ``clip_method="vmap"`` (``peak``) and ``"ghost"``,
  by jax-privacy's ``clipped_grad``, and the non-private step's; with
  ``search``, the largest m each fits in the H100's memory.

  ``earlier`` (a ``dp.json`` of the same model and target, ``--reuse``): its
  peaks are kept rather than compiled again (listed in each row's
  ``reused``), and the memory part's whole-batch search, the same step as
  ``"vmap"`` here, starts vmap's search. ``jobs`` compiles run at a time
  (threads: XLA compiles without Python's lock).
  """
  target = jaxaccum.compile_target("h100")
  cfg = dataclasses.replace(_models.PRESETS[preset]["transformer"], dtype="float32")
  assert isinstance(cfg, _models.TransformerConfig)
  old_rows, seeds = _earlier_peaks(earlier, cfg, target)
  pool = concurrent.futures.ThreadPoolExecutor(jobs)

  def compile_peak(m: int, key: str) -> int | None:
    start = time.perf_counter()
    peak = step_peak(cfg, target, m, 1, GHOST_METHODS[key])
    shown = "-" if peak is None else f"{peak / GB:.2f} GB"
    print(f"  H100, m={m:>3}, {key}: {shown} ({time.perf_counter() - start:.0f} s)")
    return peak

  rows = []
  for m in sizes:
    old = old_rows.get(m, {})
    row: dict[str, Any] = {"micro_batch_size": m}
    row["reused"] = [key for key in GHOST_METHODS if key in old]
    for key in GHOST_METHODS:
      row[key] = old[key] if key in old else pool.submit(compile_peak, m, key)
    rows.append(row)
  for row in rows:
    for key in GHOST_METHODS:
      if isinstance(row[key], concurrent.futures.Future):
        row[key] = row[key].result()
  result: dict[str, Any] = {
    "target": target.title,
    "model": cfg.describe(),
    "rows": rows,
  }
  if search:

    def largest(key: str) -> dict[str, Any]:
      start = time.perf_counter()
      known = {r["micro_batch_size"]: r[key] for r in rows} | seeds.get(key, {})
      found = largest_fitting(
        lambda m: step_peak(cfg, target, m, 1, GHOST_METHODS[key]),
        target.memory_bytes,
        max(sizes),
        known=known,
      )
      found["seconds"] = time.perf_counter() - start
      found["seeded"] = sorted(seeds.get(key, {}))
      print(
        f"  {key}: largest m {found['batch']} ({len(found['compiled'])} compiles, "
        f"{found['seconds']:.0f} s)"
      )
      return found

    start = time.perf_counter()
    futures = {key: pool.submit(largest, key) for key in GHOST_METHODS}
    result["largest"] = {key: f.result() for key, f in futures.items()}
    result["search_seconds"] = time.perf_counter() - start
    result["jobs"] = jobs
  pool.shutdown()
  return result


def _earlier_peaks(
  earlier: dict[str, Any] | None, cfg: Any, target: Any
) -> tuple[dict[int, dict[str, int | None]], dict[str, dict[int, int | None]]]:
  """The ghost rows' peaks of an earlier ``dp.json`` by m, where its model
  and target are these, and the peaks that seed the searches (vmap's: the
  memory part's whole-batch search of the same step)."""
  rows: dict[int, dict[str, int | None]] = {}
  seeds: dict[str, dict[int, int | None]] = {}
  if not earlier:
    return rows, seeds
  ghost = earlier.get("ghost", {})
  if ghost.get("model") == cfg.describe() and ghost.get("target") == target.title:
    for r in ghost["rows"]:
      rows[r["micro_batch_size"]] = {k: r[k] for k in GHOST_METHODS if k in r}
  memory = earlier.get("memory", {})
  whole = memory.get("largest_whole_batch")
  same = dataclasses.replace(cfg, batch_size=memory.get("batch_size", -1))
  if whole and memory.get("model") == same.describe():
    seeds["peak"] = {whole["batch"]: whole["peak"]}
  return rows, seeds


def largest_fitting(
  peak_of: Callable[[int], int | None],
  budget: int,
  start: int,
  known: dict[int, int | None] | None = None,
) -> dict[str, Any]:
  """The largest batch ``b`` with ``peak_of(b) <= budget`` (None: XLA
  refused it, which counts as not fitting), for a peak that grows with ``b``.

  The peaks in ``known`` (batch -> peak, already compiled) bracket it where
  they can; otherwise the batch doubles from ``start`` until one does not fit.
  The bracket then narrows by bisection, each probe placed where the line
  through the bracket's two peaks meets the budget (a compiled peak is close
  to linear in the batch, so this takes two or three compiles), and at the
  midpoint after two such probes on the same side, or where a peak is
  missing.

  Returns:
    ``batch`` (0 if not even 1 fits), its ``peak``, and the batches
    ``compiled`` (those of ``known`` not among them).
  """
  peaks: dict[int, int | None] = dict(known or {})
  compiled: list[int] = []

  def fits(b: int) -> bool:
    if b not in peaks:
      peaks[b] = peak_of(b)
      compiled.append(b)
    peak = peaks[b]
    return peak is not None and peak <= budget

  fitting = [b for b in peaks if fits(b)]
  low = max(fitting, default=0)
  above = [b for b in peaks if b > low]
  high = min(above) if above else max(start, low)
  while fits(high):  # grow until one does not fit
    low, high = high, high * 2
  peaks.setdefault(0, 0)
  sides: list[bool] = []  # where each probe fell: True if it fitted
  while high - low > 1:
    p_low, p_high = peaks[low], peaks[high]
    if p_low is None or p_high is None or sides[-2:] in ([True] * 2, [False] * 2):
      probe = (low + high) // 2  # bisect
    else:
      probe = low + int((budget - p_low) * (high - low) // (p_high - p_low))
    probe = min(max(probe, low + 1), high - 1)
    sides.append(fits(probe))
    if sides[-1]:
      low = probe
    else:
      high = probe
  return {"batch": low, "peak": peaks[low] if low else None, "compiled": compiled}


def largest_accumulated_batch(
  cfg: Any, target: Any, budget: int, micro: int
) -> dict[str, Any]:
  """jaxaccum at ``micro`` sequences per micro-batch: the peak is a line in
  the number of micro-batches (the batch's tokens); the largest batch under
  ``budget`` from two compiled sizes, then compiled to check."""
  k1, k2 = 8, 64
  p1, p2 = (
    step_peak(cfg, target, micro * k1, k1),
    step_peak(cfg, target, micro * k2, k2),
  )
  assert p1 is not None and p2 is not None
  per_micro_batch = (p2 - p1) / (k2 - k1)
  k = int((budget - p1) // per_micro_batch) + k1
  peak = step_peak(cfg, target, micro * k, k)
  while peak is None or peak > budget:  # the line's rounding: step back
    k -= max(1, k // 1000)
    peak = step_peak(cfg, target, micro * k, k)
  return {
    "batch": micro * k,
    "micro_batch_size": micro,
    "num_micro_batches": k,
    "peak": peak,
    "bytes_per_micro_batch": per_micro_batch,
  }


def memory_part(preset: str, ks: tuple[int, ...], search: bool) -> dict[str, Any]:
  target = jaxaccum.compile_target("h100")
  cfg = dataclasses.replace(_models.PRESETS[preset]["transformer"], dtype="float32")
  assert isinstance(cfg, _models.TransformerConfig)
  batch = cfg.batch_size
  params = jax.eval_shape(lambda: _models.transformer_init(jax.random.key(0), cfg))
  num_params = sum(x.size for x in jax.tree.leaves(params))
  rows = []
  for k in ks:
    start = time.perf_counter()
    peak = step_peak(cfg, target, batch, k)
    rows.append({"k": k, "micro_batch_size": batch // k, "peak": peak})
    print(
      f"  H100, B={batch}, k={k:>2}: peak "
      f"{'-' if peak is None else f'{peak / GB:.2f} GB'} "
      f"({time.perf_counter() - start:.0f} s to compile)"
    )
  result: dict[str, Any] = {
    "target": target.title,
    "memory_bytes": target.memory_bytes,
    "model": cfg.describe(),
    "num_params": int(num_params),
    "batch_size": batch,
    "rows": rows,
  }
  if search:
    budget = target.memory_bytes
    result["largest_whole_batch"] = largest_fitting(  # k = 1: the whole batch
      lambda b: step_peak(cfg, target, b, 1), budget, batch
    )
    print(
      f"  k=1 (whole batch): largest batch {result['largest_whole_batch']['batch']}"
    )
    fits = [r for r in rows if r["peak"] is not None and r["peak"] <= budget]
    micro = max(r["micro_batch_size"] for r in fits)
    result["largest_accumulated_batch"] = largest_accumulated_batch(
      cfg, target, budget, micro
    )
    print(f"  jaxaccum: largest batch {result['largest_accumulated_batch']['batch']}")
  return result


# ---------------------------------------------------------------- part 3: exactness


def _exact_models() -> dict[str, tuple[Callable[..., Any], Any, Any]]:
  """``{name: (loss on one example, params, 64 rows)}``: an MLP and a CNN on
  scikit-learn's digits (8 x 8 images), and a transformer LM with a
  sequence dimension on the English text that ships with CPython."""

  digits = load_digits()
  images = jnp.asarray(digits.images[:64] / 16.0, jnp.float32)
  labels = jnp.asarray(digits.target[:64], jnp.int32)
  r = np.random.default_rng(0)

  def normal(*shape):
    return jnp.asarray(r.normal(size=shape) / np.sqrt(shape[0]), jnp.float32)

  def mlp_loss(p, example):
    image, label = example
    h = jnp.tanh(image.reshape(-1) @ p["w1"] + p["b1"])
    return -jax.nn.log_softmax(h @ p["w2"] + p["b2"])[label]

  mlp = {"w1": normal(64, 32), "b1": normal(32), "w2": normal(32, 16), "b2": normal(16)}

  def cnn_loss(p, example):
    image, label = example
    h = jax.lax.conv_general_dilated(
      image[None, :, :, None],
      p["kernel"],
      (1, 1),
      "SAME",
      dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )
    h = jax.nn.relu(h[0] + p["bias"])
    return -jax.nn.log_softmax(h.reshape(-1) @ p["dense"])[label]

  cnn = {"kernel": normal(3, 3, 1, 8), "bias": normal(8), "dense": normal(512, 16)}
  cfg = _models.TransformerConfig(
    vocab=128, d_model=16, num_heads=2, num_layers=1, d_ff=32, seq_len=16, batch_size=64
  )
  text = " ".join(topics.topics.values()).encode("ascii", "replace")
  tokens = np.frombuffer(text[: 64 * 17], np.uint8).reshape(64, 17) % cfg.vocab
  lm = _models.transformer_init(jax.random.key(0), cfg)
  return {
    "mlp": (mlp_loss, mlp, (images, labels)),
    "cnn": (cnn_loss, cnn, (images, labels)),
    "transformer": (example_loss(cfg), lm, jnp.asarray(tokens, jnp.int32)),
  }


def _reference(loss: Callable[..., Any], params: Any, batch: Any, clip: float) -> Any:
  """Written here, apart from jaxaccum: one vmap of grad over the 64 rows,
  each example's gradient scaled to global norm at most ``clip``, summed."""
  grads = jax.vmap(jax.grad(loss), in_axes=(None, 0))(params, batch)
  flat = [g.reshape(64, -1) for g in jax.tree.leaves(grads)]
  norms = jnp.sqrt(sum(jnp.sum(g * g, axis=1) for g in flat))
  factor = jnp.minimum(1.0, clip / norms)
  return jax.tree.map(lambda g: jnp.tensordot(factor, g, axes=(0, 0)), grads), norms


def _fsdp_spec(x: Any) -> Any:
  """FSDP: the first dimension that 8 divides, sharded over "fsdp"."""
  for dim, size in enumerate(x.shape):
    if size % 8 == 0:
      return jax.sharding.PartitionSpec(*([None] * dim), "fsdp")
  return jax.sharding.PartitionSpec()


def exact_rows(ks: tuple[int, ...]) -> list[dict[str, Any]]:
  """Ghost's clipped sum against :func:`_reference` for each model and k,
  on one device and on 8 CPU devices with FSDP (``mesh=``). Runs in a
  process with 8 CPU devices (:func:`exact_part`)."""

  # Auto axes: the models use their FSDP weights as on one device, which the
  # partitioner gathers (on Explicit axes fun would gather them itself).
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
  rows = []
  for name, (loss, params, batch) in _exact_models().items():
    _, norms = _reference(loss, params, batch, 1.0)
    clip = float(jnp.median(norms))  # some examples clipped, some not
    want, _ = _reference(loss, params, batch, clip)
    for devices in (1, 8):
      for k in ks:
        options: dict[str, Any] = {}
        p, b = params, batch
        if devices > 1:
          p = jax.tree.map(
            lambda x: jax.device_put(x, NamedSharding(mesh, _fsdp_spec(x))), params
          )
          b = jax.tree.map(
            lambda x: jax.device_put(x, NamedSharding(mesh, P("fsdp"))), b
          )
          options = {
            "mesh": mesh,
            "data_axis": "fsdp",
            "param_specs": jax.tree.map(_fsdp_spec, params),
          }
        fun = jaxaccum.grad(
          loss,
          k,
          normalize="sum",
          clip_per_example=clip,
          clip_method="ghost",
          clip_without_noise=True,  # measured, not trained
          **options,
        )
        with warnings.catch_warnings(record=True) as caught, jax.set_mesh(mesh):
          warnings.simplefilter("always")
          got = jax.jit(fun)(p, b)
        fell = [
          str(w.message).split(": ", 1)[1].split(". The result")[0]
          for w in caught
          if issubclass(w.category, jaxaccum.GhostFallbackWarning)
        ]
        pairs = list(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))
        errors = [float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w)) for g, w in pairs]
        total = float(
          jnp.sqrt(sum(jnp.sum((g - w) ** 2) for g, w in pairs))
          / jnp.sqrt(sum(jnp.sum(w**2) for _, w in pairs))
        )
        sharded = sum(1 for x in jax.tree.leaves(params) if _fsdp_spec(x) != P())
        row = {
          "model": name,
          "k": k,
          "devices": devices,
          "mesh": "fsdp=8" if devices > 1 else None,
          "fsdp_leaves": sharded if devices > 1 else 0,
          "leaves": len(pairs),
          "rows": 64,
          "rel_error": total,
          "max_leaf_rel_error": max(errors),
          "fallback": fell,
        }
        print(f"  {name}, {devices} device(s), k={k}: {total:.2e} ({max(errors):.2e})")
        rows.append(row)
  return rows


def _eight_devices(*flags: str) -> list[dict[str, Any]]:
  """The rows this file prints as its last line when run with ``flags``, in
  a process of its own with 8 CPU devices (this one's backend may have
  started with one)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  testing.cpu_devices(8, environ=env)
  command = [sys.executable, __file__, *flags]
  out = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
  print(out.stdout.rsplit("\n", 2)[0])
  return json.loads(out.stdout.splitlines()[-1])


def exact_part(ks: tuple[int, ...]) -> dict[str, Any]:
  """:func:`exact_rows` on 8 CPU devices, dated."""
  rows = _eight_devices("--exact-rows", ",".join(map(str, ks)))
  today, jax_version = datetime.date.today().isoformat(), jax.__version__
  return {"date": today, "jax": jax_version, "tolerance": 1e-5, "rows": rows}


# ---------------------------------------------------------------- part 4: audit

AUDIT_N, AUDIT_F, AUDIT_H = 1024, 8, 16
LIBS = ("linen", "nnx", "equinox")
AUDIT_FIELDS = ("library", "path", "clip_method", "k", "dtype", "loss")
#: The audit's covering set: (library, path, clip method, k, parameters'
#: dtype, loss). Every combination of path, method, dtype and loss is a row
#: (bfloat16 x ghost, weighted x mesh= and bfloat16 x plain jit among them);
#: the libraries cycle (no jaxaccum.nnx on the accumulate() path, fed plain
#: arrays), and k = 1, 4 meet each dtype and each loss on every path.
AUDIT_CONFIGS = [
  (lib, path, method, (1, 4)[(i % 4 in (1, 2)) ^ (i // 4 % 2)], dtype, loss)
  for i, (path, method, dtype, loss) in enumerate(
    (p, m, d, w)
    for p in ("step", "accumulate", "mesh", "plain_jit")
    for m in ("vmap", "ghost")
    for d in ("float32", "bfloat16")
    for w in ("mean", "weighted")
  )
  for lib in [("linen", "equinox")[i % 2] if path == "accumulate" else LIBS[i % 3]]
]


def _audit_model(lib: str, dtype: Any) -> tuple[Callable[..., Any], Any]:
  """A tanh MLP (8 -> 16 -> 1) of ``lib`` with parameters in ``dtype``, and
  the loss of ONE example ``(x, y, w)``, ``w (f(x) - y)^2``, in float32."""
  if lib == "linen":
    from flax import linen as nn  # noqa: PLC0415

    dense = lambda n: nn.Dense(n, dtype=dtype, param_dtype=dtype)  # noqa: E731
    net = nn.Sequential([dense(AUDIT_H), nn.tanh, dense(1)])
    model = net.init(jax.random.key(0), jnp.ones(AUDIT_F, dtype))
    apply = net.apply
  elif lib == "nnx":
    from flax import nnx  # noqa: PLC0415

    rngs = nnx.Rngs(0)
    dense = lambda i, o: nnx.Linear(i, o, dtype=dtype, param_dtype=dtype, rngs=rngs)  # noqa: E731
    model = nnx.Sequential(dense(AUDIT_F, AUDIT_H), nnx.tanh, dense(AUDIT_H, 1))
    apply = lambda m, x: m(x)  # noqa: E731
  else:
    import equinox as eqx  # noqa: PLC0415

    mlp = eqx.nn.MLP(AUDIT_F, 1, AUDIT_H, 1, activation=jnp.tanh, key=jax.random.key(0))
    model = jax.tree.map(
      lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, mlp
    )
    apply = lambda m, x: m(x)  # noqa: E731

  def loss(m, example):
    x, y, w = example
    return w * (apply(m, x.astype(dtype))[0].astype(jnp.float32) - y) ** 2

  return loss, model


def _observer() -> optax.GradientTransformationExtraArgs:
  """After dp_noise in the chain: keeps the float32 clipped sum of the
  ClipRecord dp_noise read (optax.chain hands every transformation the same
  clip_record=) and dp_noise's update, in float32."""
  wide = lambda t: jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), t)  # noqa: E731

  def init(params):
    zeros = jax.tree.map(lambda a: jnp.zeros(jnp.shape(a), jnp.float32), params)
    return zeros, zeros

  def update(updates, state, params=None, *, clip_record=None, **extra):
    del params, extra
    seen = (wide(clip_record.clipped_sum), wide(updates))
    return updates, jax.tree.map(lambda _, s: s, state, seen)

  return optax.GradientTransformationExtraArgs(init, update)


def _audit_seen(config: tuple[Any, ...]) -> list[tuple[Any, Any]]:
  """One step of ``config`` on the audit's batch, with the outlier row and
  with it masked out: the (clipped sum, update) the observer saw in each."""
  from flax import nnx  # noqa: PLC0415

  lib, path, method, k, dtype, loss_kind = config
  loss, model = _audit_model(lib, jnp.dtype(dtype))
  n, weighted = AUDIT_N, loss_kind == "weighted"
  x = jax.random.normal(jax.random.key(1), (n, AUDIT_F))
  y = jnp.sin(3 * x[:, 0]) + x[:, 1]
  w = 1.0 + (jnp.arange(n) % 3) if weighted else jnp.ones(n)
  j = n // 3  # the outlier: 30 times an example
  batch = (x.at[j].multiply(30.0), y.at[j].multiply(30.0), w)
  masks = [jnp.ones(n), jnp.ones(n).at[j].set(0.0)]
  noise = jaxaccum.dp_noise(
    0.0,
    CLIP,
    jax.random.key(0),
    normalize="fixed" if weighted else "poisson",
    expected_batch_size=None if weighted else float(n),
  )
  tx = optax.chain(noise, _observer())
  clip = {"clip_per_example": CLIP, "clip_method": method}
  if path == "accumulate":  # k calls of one micro-batch each, one window
    acc = jaxaccum.accumulate(tx, every_k=k)
    grad = jaxaccum.grad(loss, 1, normalize="sum", clip_record=True, **clip)
    update, m, seen = jax.jit(acc.update), n // k, []
    for mask in masks:
      state = acc.init(model)
      for i in range(k):
        part, kept = jax.tree.map(lambda a, i=i: a[i * m : (i + 1) * m], (batch, mask))
        weight = jnp.sum(part[2] * kept) if weighted else None
        record = grad(model, part, example_mask=kept)
        _, state = update(record, state, _static_free(model), weight=weight)
      seen.append(state.inner_state[1])
    return seen
  fun = (lambda m, e: (loss(m, e), e[2])) if weighted else loss
  options = dict(clip, normalize="weighted" if weighted else "mean", donate=False)
  mesh = None
  if path in ("mesh", "plain_jit"):
    axes = AxisType.Explicit if path == "plain_jit" else AxisType.Auto
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axes,))
    put = lambda t, spec: jax.tree.map(  # noqa: E731
      lambda a: jax.device_put(a, NamedSharding(mesh, spec)) if _is_array(a) else a, t
    )
    batch, masks = put(batch, P("data")), put(masks, P("data"))
    model = put(model, P()) if lib != "nnx" else model
    if lib == "nnx":
      nnx.update(model, put(nnx.state(model), P()))
    if path == "mesh":
      options.update(mesh=mesh, data_axis="data")
  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    if lib == "nnx":  # the same model and optimizer, reset between the steps
      optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
      before = jax.tree.map(jnp.copy, nnx.state((model, optimizer)))
      step, seen = jaxaccum.nnx.make_train_step(fun, optimizer, k, **options), []
      for mask in masks:
        nnx.update((model, optimizer), jax.tree.map(jnp.copy, before))
        step(model, batch, example_mask=mask)
        seen.append(jax.tree.map(jnp.copy, optimizer.opt_state[1]))
      return seen
    step = jaxaccum.make_train_step(fun, tx, k, **options)
    opt_state = tx.init(_static_free(model))
    return [step(model, opt_state, batch, example_mask=m)[1][1] for m in masks]


def _is_array(a: Any) -> bool:
  return isinstance(a, jax.Array)


def _static_free(model: Any) -> Any:
  """The model's floating-point arrays (None elsewhere), as optax sees an
  Equinox module (eqx.filter(model, eqx.is_inexact_array))."""
  floating = lambda a: _is_array(a) and jnp.issubdtype(a.dtype, jnp.floating)  # noqa: E731
  return jax.tree.map(lambda a: a if floating(a) else None, model)


def audit_rows() -> list[dict[str, Any]]:
  """Each configuration's one-example effect on what the noise covers, over
  C: the float32 clipped sum dp_noise read and (mean loss, float32
  parameters: the update is not rounded after the noise) dp_noise's
  noise-free update times its public denominator, the expected batch size.
  Runs in a process with 8 CPU devices (:func:`audit_part`)."""
  rows = []
  for config in AUDIT_CONFIGS:
    seen = [
      jax.tree.map(lambda a: np.asarray(a, np.float64), s) for s in _audit_seen(config)
    ]
    diff = jax.tree.map(np.subtract, *seen)
    norm = lambda t: float(np.sqrt(sum(np.sum(a**2) for a in jax.tree.leaves(t))))  # noqa: E731
    row = dict(zip(AUDIT_FIELDS, config, strict=True), sum=norm(diff[0]) / CLIP)
    exact_update = row["loss"] == "mean" and row["dtype"] == "float32"
    row["update"] = norm(diff[1]) * AUDIT_N / CLIP if exact_update else None
    rows.append(row)
    print(row, flush=True)
  return rows


def audit_part() -> dict[str, Any]:
  """:func:`audit_rows` on 8 CPU devices, with the machine and versions."""
  return {
    "machine": f"{os.cpu_count()}-core {_report.cpu_model()}",
    "date": datetime.date.today().isoformat(),
    "versions": _compile.versions("jax", "flax", "equinox", "optax"),
    "examples": AUDIT_N,
    "bound": 1.0001,
    "rows": _eight_devices("--audit-rows"),
  }


def audit_table(audit: dict[str, Any]) -> str:
  """The audit: the run, one row per configuration, and the verdict."""
  bound = audit["bound"]
  ratios = [r[v] for r in audit["rows"] for v in ("sum", "update") if r[v] is not None]
  run = {
    "measured": lambda a: a["date"],
    "machine": lambda a: a["machine"],
    **{
      lib: lambda a, lib=lib: a["versions"][lib] for lib in ("jax", "flax", "equinox")
    },
    "configurations": lambda a: len(a["rows"]),
    "examples": lambda a: f"{a['examples']:,}",
    "C": lambda a: f"{CLIP:g}",
  }

  def ratio(x: float | None) -> str:
    return "–" if x is None else f"{x:.6f}" + ("" if x <= bound else " ✗")

  rows = {
    "library": lambda r: r["library"],
    "path": lambda r: AUDIT_PATHS[r["path"]],
    "clip": lambda r: f'`"{r["clip_method"]}"`',
    "k": lambda r: r["k"],
    "parameters": lambda r: r["dtype"],
    "loss": lambda r: r["loss"],
    "noised sum: ΔS / C": lambda r: ratio(r["sum"]),
    "update: ΔU · E / C": lambda r: ratio(r["update"]),
  }
  verdict = {
    "ratios measured": len,
    "smallest": lambda x: f"{min(x):.6f}",
    "largest": lambda x: f"**{max(x):.6f}**",
    "goal: every ratio at most": lambda x: bound,
    "goal": lambda x: _report.met(max(x) <= bound),
  }
  return _tables(([audit], run), (audit["rows"], rows), ([ratios], verdict))


AUDIT_PATHS = {
  "step": "`make_train_step`",
  "accumulate": "`accumulate()`",
  "mesh": "`mesh=` (8 devices)",
  "plain_jit": "plain `jit`, Explicit mesh (8)",
}


# ---------------------------------------------------------------- part 2: time


def jax_privacy_update(
  loss: Callable[..., jax.Array], batch: int, k: int
) -> Callable[..., Any]:
  """The same DP-SGD step with jax-privacy's clipped-gradient function, not
  jitted: ``update(params, opt_state, batch, key) -> (params, opt_state)``."""
  from jax_privacy import clipping  # noqa: PLC0415 (the bench extra)

  grad = clipping.clipped_grad(
    loss,
    l2_clip_norm=CLIP,
    batch_argnums=1,
    keep_batch_dim=False,
    microbatch_size=batch // k if k > 1 else None,
  )
  adam = optax.adam(1e-4)

  def update(params, opt_state, examples, key):
    total = grad(params, examples)
    leaves, treedef = jax.tree.flatten(total)
    keys = jax.random.split(key, len(leaves))
    noisy = [
      (g + SIGMA * CLIP * jax.random.normal(kk, g.shape)) / batch
      for g, kk in zip(leaves, keys, strict=True)
    ]
    updates, opt_state = adam.update(jax.tree.unflatten(treedef, noisy), opt_state)
    return optax.apply_updates(params, updates), opt_state

  return update


def jax_privacy_step(
  loss: Callable[..., jax.Array], batch: int, k: int
) -> Callable[..., Any]:
  step = jax.jit(jax_privacy_update(loss, batch, k))

  def run(state):
    params, opt_state, examples, key = state
    params, opt_state = step(params, opt_state, examples, key)
    return params, opt_state, examples, key

  return run


def jaxaccum_step(
  loss: Callable[..., jax.Array], batch: int, k: int, clip_method: str
) -> tuple[Callable[..., Any], Any]:
  tx = dp_tx(float(batch))
  step = jaxaccum.make_train_step(
    loss, tx, k, clip_per_example=CLIP, clip_method=clip_method, donate=False
  )

  def run(state):
    params, opt_state, examples, mask = state
    params, opt_state, _ = step(params, opt_state, examples, example_mask=mask)
    return params, opt_state, examples, mask

  return run, tx


#: The contrast to the transformer in the time part: an MLP whose weights are
#: large beside its activations, so that a per-example gradient (``"vmap"``,
#: jax-privacy) costs far more than ghost clipping's second pass.
TIME_MLP = {
  "cpu": _models.MLPConfig(widths=(256, 512, 512, 16), batch_size=64),
  "cpu-quick": _models.MLPConfig(widths=(64, 128, 128, 16), batch_size=16),
}

#: The approaches timed side by side, and the ratios taken per round
#: (numerator, denominator): above 1, the denominator's step is faster.
APPROACHES = ("jaxaccum", "jaxaccum_again", "ghost", "jax_privacy")
RATIOS = {
  "ratio": ("jax_privacy", "jaxaccum"),
  "ghost_ratio": ("ghost", "jaxaccum"),
  "ghost_jax_privacy_ratio": ("ghost", "jax_privacy"),
  "aa_ratio": ("jaxaccum_again", "jaxaccum"),
}


def time_part(
  model: _models.Model, ks: tuple[int, ...], rounds: int, repeats: int
) -> dict[str, Any]:
  """The DP step on this CPU at each k of ``ks``: jaxaccum with
  ``clip_method="vmap"`` (``jaxaccum``, timed twice for the A/A control), with
  ``"ghost"``, and jax-privacy, in interleaved rounds whose order rotates."""
  load_start = os.getloadavg()
  loss = one_example(model.loss)
  batch = model.batch_size
  params = model.params
  mask = jnp.ones((batch,), jnp.float32)
  rows = []
  for k in ks:
    run_vmap, tx = jaxaccum_step(loss, batch, k, "vmap")
    run_ghost, _ = jaxaccum_step(loss, batch, k, "ghost")
    runs = {
      "jaxaccum": run_vmap,
      "jaxaccum_again": run_vmap,
      "ghost": run_ghost,
      "jax_privacy": jax_privacy_step(loss, batch, k),
    }
    states = {
      name: (params, tx.init(params), model.batch, mask)
      for name in ("jaxaccum", "jaxaccum_again", "ghost")
    }
    states["jax_privacy"] = (
      params,
      optax.adam(1e-4).init(params),
      model.batch,
      jax.random.key(1),
    )
    with warnings.catch_warnings():  # which leaves fall back is not a result
      warnings.simplefilter("ignore", jaxaccum.GhostFallbackWarning)
      for name, run in runs.items():  # compile and warm up
        states[name] = jax.block_until_ready(run(states[name]))
    times: dict[str, list[float]] = {name: [] for name in APPROACHES}
    for r in range(rounds):
      shift = r % len(APPROACHES)
      for name in APPROACHES[shift:] + APPROACHES[:shift]:
        start = time.perf_counter()
        for _ in range(repeats):
          states[name] = runs[name](states[name])
        jax.block_until_ready(states[name])
        times[name].append((time.perf_counter() - start) * 1e3 / repeats)
    row: dict[str, Any] = {
      "k": k,
      "micro_batch_size": batch // k,
      "ms": {name: statistics.median(t) for name, t in times.items()},
    }
    for key, (num, den) in RATIOS.items():
      per_round = [a / b for a, b in zip(times[num], times[den], strict=True)]
      row[key] = statistics.median(per_round)
      spread = "aa_spread" if key == "aa_ratio" else f"{key}_spread"
      row[spread] = [min(per_round), max(per_round)]
    rows.append(row)
    print(
      f"  CPU, {model.name}, B={batch}, k={k}: vmap {row['ms']['jaxaccum']:.1f} ms, "
      f"ghost {row['ms']['ghost']:.1f} ms, jax-privacy "
      f"{row['ms']['jax_privacy']:.1f} ms: ghost / vmap {row['ghost_ratio']:.2f}x, "
      f"jax-privacy / vmap {row['ratio']:.2f}x, ghost / jax-privacy "
      f"{row['ghost_jax_privacy_ratio']:.2f}x; A/A {row['aa_ratio']:.2f}x "
      f"[{row['aa_spread'][0]:.2f}, {row['aa_spread'][1]:.2f}]"
    )
  return {
    "model": model.config.describe(),
    "num_params": model.num_params,
    "batch_size": batch,
    "rounds": rounds,
    "repeats": repeats,
    "load_average": [load_start[0], os.getloadavg()[0]],  # 1 min: start, end
    "rows": rows,
  }


# ---------------------------------------------------------------- the report


def _tables(*tables: tuple[Any, dict[str, Callable[[Any], Any]]] | None) -> str:
  """The tables of a block, one per ``(items, columns)`` (None: left out)."""
  return "\n\n".join(_report.columns(*t) for t in tables if t)


def _transformer(model: dict[str, Any]) -> str:
  return (
    f"{model['num_layers']} layers, d_model {model['d_model']}, vocabulary "
    f"{model['vocab']:,}, {model['seq_len']} tokens"
  )


def memory_table(results: dict[str, Any]) -> str:
  """The memory part: the run, the peak against k, and the largest batch."""
  memory = results["memory"]
  budget = memory["memory_bytes"]
  run = {
    "measured": lambda m: results["date"],
    "compiled for": lambda m: m["target"],
    "memory, GiB": lambda m: _report.gib(budget, 0),
    "`gpu` preset's transformer": lambda m: _transformer(m["model"]),
    "parameters": lambda m: f"{m['num_params'] / 1e6:.0f}M",
    "dtype": lambda m: m["model"]["dtype"],
    "logical batch": lambda m: m["batch_size"],
  }
  peaks = {
    "k": lambda r: r["k"],
    "examples per micro-batch": lambda r: r["micro_batch_size"],
    "peak, GiB": lambda r: _report.gib(r["peak"], 1),
  }
  whole = memory.get("largest_whole_batch")
  acc = memory.get("largest_accumulated_batch")
  if not (whole and acc):
    return _tables(([memory], run), (memory["rows"], peaks))
  whole = whole | {"micro_batch_size": whole["batch"], "num_micro_batches": 1}
  fits = f"in {_report.gib(budget, 0)} GiB"
  largest = {
    "step": lambda r: "jaxaccum" if r is acc else "whole batch",
    "k": lambda r: f"{r['num_micro_batches']:,}",
    "examples per micro-batch": lambda r: r["micro_batch_size"],
    f"largest batch {fits}": lambda r: f"**{'≥ ' * (r is acc)}{r['batch']:,}**",
    "× the whole batch's": lambda r: f"{r['batch'] / whole['batch']:,.0f}",
    "peak, GiB": lambda r: _report.gib(r["peak"], 1),
    "the batch above it": lambda r: "–" if r is acc else f"{r['batch'] + 1:,}",
    "KiB per micro-batch": lambda r: (
      f"{r['bytes_per_micro_batch'] / 1024:.0f}" if r is acc else "–"
    ),
  }
  return _tables(([memory], run), (memory["rows"], peaks), ([whole, acc], largest))


def _range(r: dict[str, Any], key: str) -> str:
  spread = r["aa_spread" if key == "aa_ratio" else f"{key}_spread"]
  return f"{r[key]:.2f}× ({spread[0]:.2f}–{spread[1]:.2f})"


def _decided(r: dict[str, Any], verdict: str) -> str:
  """``verdict`` where the row's A/A ratio decides a timing (within 3% of
  1), else ``undecided``."""
  return verdict if _report.aa_decides(r.get("aa_ratio")) else "undecided"


def _ghost_speed(r: dict[str, Any]) -> str:
  """Ghost against ``"vmap"`` at one k: slower or faster by more than 3%, or
  the same."""
  x, tolerance = r["ghost_ratio"], _report.AA_TOLERANCE
  return "slower" if x > 1 + tolerance else "faster" if x < 1 - tolerance else "same"


def time_table(results: dict[str, Any]) -> str:
  """The time part: the run of each model, and one row per model and k."""
  models = {"transformer": results["time"], "MLP": results.get("time_mlp")}
  models = {name: t for name, t in models.items() if t}

  def model(t: dict[str, Any]) -> str:
    m = t["model"]
    if m["kind"] == "mlp":
      return "MLP: " + " → ".join(map(str, m["widths"]))
    return "`cpu` preset's transformer: " + _transformer(m)

  run = {
    "model": lambda x: model(x[1]),
    "parameters": lambda x: f"{x[1]['num_params'] / 1e3:,.0f}k",
    "logical batch": lambda x: x[1]["batch_size"],
    "rounds": lambda x: x[1]["rounds"],
    "steps a sample": lambda x: x[1]["repeats"],
    "machine": lambda x: results["machine"],
    "load average, start / end": lambda x: "{:.1f} / {:.1f}".format(
      *x[1]["load_average"]
    ),
    "jax": lambda x: results["versions"]["jax"],
    "jax-privacy": lambda x: results["versions"]["jax-privacy"],
  }
  rows = [(name, r) for name, t in models.items() for r in t["rows"]]
  ms = lambda r, key: _report.ms(r["ms"][key])  # noqa: E731
  goal = lambda r: "met" if r["ratio"] >= 1 else "missed"  # noqa: E731
  times = {
    "model": lambda x: x[0],
    "k": lambda x: x[1]["k"],
    "m": lambda x: x[1]["micro_batch_size"],
    "vmap ms": lambda x: ms(x[1], "jaxaccum"),
    "ghost ms": lambda x: ms(x[1], "ghost"),
    "jax-privacy ms": lambda x: ms(x[1], "jax_privacy"),
    "ghost / vmap": lambda x: _range(x[1], "ghost_ratio"),
    "jax-privacy / vmap": lambda x: _range(x[1], "ratio"),
    "ghost / jax-privacy": lambda x: _range(x[1], "ghost_jax_privacy_ratio"),
    "A/A: vmap / vmap": lambda x: _range(x[1], "aa_ratio"),
    "ghost against vmap": lambda x: _decided(x[1], _ghost_speed(x[1])),
    "goal": lambda x: _decided(x[1], goal(x[1])) if x[0] == "transformer" else "–",
  }
  return _tables((models.items(), run), (rows, times))


#: How the ghost block names the four steps: in a column's header, in a row.
GHOST_NAMES = {
  "peak": ("vmap", '`"vmap"`'),
  "peak_ghost": ("ghost", '`"ghost"`'),
  "peak_jax_privacy": ("jax-privacy", "jax-privacy's `clipped_grad`"),
  "peak_non_private": ("non-private", "the non-private step"),
}


def ghost_table(results: dict[str, Any]) -> str:
  """The ghost part: the run, the peak of each step against m, and the
  largest m each fits, with what its search took."""
  ghost, budget = results["ghost"], results["memory"]["memory_bytes"]
  largest = ghost.get("largest")
  run: dict[str, Callable[[Any], Any]] = {
    "compiled for": lambda g: g["target"],
    "memory, GiB": lambda g: _report.gib(budget, 0),
  }
  if largest:
    wall = ghost.get("search_seconds", sum(v["seconds"] for v in largest.values()))
    run |= {
      "searches at a time": lambda g: g.get("jobs", 1),
      "the searches' wall time": lambda g: _report.duration(wall),
      "compiles": lambda g: sum(len(v["compiled"]) for v in largest.values()),
    }

  def gib(b: int | None) -> str:
    return "–" if b is None else _report.gib(b, 1) + ("*" if b > budget else "")

  def over(a: int | None, b: int | None) -> str:
    return "–" if a is None or b is None else f"{a / b:.2f}×"

  peaks = {"m": lambda r: r["micro_batch_size"]}
  peaks |= {
    f"{name}, GiB": lambda r, key=key: gib(r.get(key))
    for key, (name, _) in GHOST_NAMES.items()
  }
  peaks |= {
    "ghost / non-private": lambda r: over(r["peak_ghost"], r["peak_non_private"]),
    "ghost / vmap": lambda r: over(r["peak_ghost"], r["peak"]),
  }
  if not largest:
    return _tables(([ghost], run), (ghost["rows"], peaks))

  def listed(ms: list[int]) -> str:
    return ", ".join(map(str, ms)) or "–"

  search = {
    "step": lambda key: GHOST_NAMES[key][1],
    f"largest m in {_report.gib(budget, 0)} GiB": lambda key: (
      f"**{largest[key]['batch']}**"
    ),
    "its peak, GiB": lambda key: _report.gib(largest[key]["peak"], 1),
    "compiles": lambda key: len(largest[key]["compiled"]),
    "search's wall time": lambda key: _report.duration(largest[key]["seconds"]),
    "started from the memory part's m": lambda key: listed(
      largest[key].get("seeded", [])
    ),
    "rows' peaks kept from the run before (m)": lambda key: listed(
      [r["micro_batch_size"] for r in ghost["rows"] if key in r.get("reused", [])]
    ),
  }
  return _tables(([ghost], run), (ghost["rows"], peaks), (GHOST_NAMES, search))


def exact_table(results: dict[str, Any]) -> str:
  """The exactness part: the run, and one row per model, devices and k."""
  exact = results["exact"]
  tolerance = exact["tolerance"]
  run = {
    "measured": lambda e: e["date"],
    "jax": lambda e: e["jax"],
    "examples": lambda e: e["rows"][0]["rows"] if e["rows"] else "–",
    "goal: rel. error at most": lambda e: f"{tolerance:g}",
  }

  def error(x: float) -> str:
    return f"{x:.1e}" + ("" if x <= tolerance else " ✗")

  rows = {
    "model": lambda r: r["model"],
    "devices": lambda r: (
      "1"
      if r["devices"] == 1
      else f"{r['devices']}, FSDP ({r['fsdp_leaves']} of {r['leaves']} leaves)"
    ),
    "k": lambda r: r["k"],
    "rel. error": lambda r: error(r["rel_error"]),
    "worst leaf": lambda r: error(r["max_leaf_rel_error"]),
    "falls back": lambda r: "; ".join(r["fallback"]) or "none",
  }
  return _tables(([exact], run), (exact["rows"], rows))


#: The blocks written from ``dp.json``, by name (for ``_report.py``).
BLOCKS = {
  "dp memory": memory_table,
  "dp ghost": ghost_table,
  "dp exact": exact_table,
  "dp time": time_table,
  "dp_audit table": audit_table,
}


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
  parser = _paths.parser(__doc__, quick="small sizes, few rounds")
  parser.add_argument(
    "--part",
    choices=("both", "time", "memory", "ghost", "exact", "audit"),
    default="both",
    help="measure one part and keep the other from the existing JSON",
  )
  parser.add_argument("--rounds", type=int, help="timed rounds (21; quick 3)")
  parser.add_argument("--repeats", type=int, help="steps per sample (5; quick 2)")
  parser.add_argument("--exact-rows", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--audit-rows", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument(
    "--reuse",
    action="store_true",
    help="ghost part: keep the peaks the JSON has for the same model and target",
  )
  parser.add_argument("--jobs", type=int, default=1, help="ghost: compiles at a time")
  args = parser.parse_args(argv)
  if args.exact_rows:  # exact_part's process, with 8 CPU devices
    rows = exact_rows(tuple(int(k) for k in args.exact_rows.split(",")))
    print(json.dumps(rows))
    return 0
  if args.audit_rows:  # audit_part's process, with 8 CPU devices
    print(json.dumps(audit_rows()))
    return 0
  quick = args.quick
  out = _paths.output_folder(args.out, quick)
  if args.part == "audit":  # its own JSON; the other parts' stays as it is
    print("Part 4: one example's effect on what the noise covers")
    (out / "dp_audit.json").write_text(json.dumps(audit_part(), indent=1) + "\n")
    return _pages(out)
  name = "dp_quick.json" if quick else "dp.json"
  path = out / name
  results: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
  if args.part in ("both", "time"):  # the machine the times come from
    results["machine"] = f"{os.cpu_count()}-core {_report.cpu_model()}"
  if args.part != "exact":  # the exact part dates its own rows
    results.update(
      date=datetime.date.today().isoformat(),
      versions=_compile.versions("jax", "jax-privacy", "optax"),
    )
  if args.part in ("both", "time"):
    print("Part 2: step time on this CPU")
    preset = "cpu-quick" if quick else "cpu"
    ks = (1, 4) if quick else (1, 2, 4, 8)
    rounds = args.rounds or (3 if quick else 21)
    repeats = args.repeats or (2 if quick else 5)
    results["time"] = time_part(
      _models.build("transformer", preset), ks, rounds, repeats
    )
    mlp = _models.make_mlp("mlp", "MLP", TIME_MLP[preset])
    results["time_mlp"] = time_part(mlp, ks, rounds, max(1, repeats // 5))
  if args.part in ("both", "memory"):
    print("Part 1: memory on a compile-only H100")
    results["memory"] = memory_part(
      "gpu-quick" if quick else "gpu",
      (1, 4) if quick else (1, 2, 4, 8, 16, 64),
      search=not quick,
    )
  if args.part in ("both", "ghost"):
    print("Part 1b: ghost clipping's memory on a compile-only H100")
    results["ghost"] = ghost_part(
      "gpu-quick" if quick else "gpu",
      (8,) if quick else (8, 32, 128),
      search=not quick,
      earlier=dict(results) if args.reuse else None,
      jobs=args.jobs,
    )
  if args.part in ("both", "exact"):
    print("Part 3: ghost clipping against a vmap(grad) reference, 1 and 8 devices")
    results["exact"] = exact_part((1, 2, 4, 8))
  path.write_text(json.dumps(results, indent=1) + "\n")
  print(f"wrote {path}")
  return _pages(out)


def _pages(out: pathlib.Path) -> int:
  """The manuals rewritten from ``out`` where it is ``benchmarks/results``
  (a run written elsewhere leaves them as they are)."""
  return _report.main(["--results", str(out)]) if out == _paths.RESULTS else 0


if __name__ == "__main__":
  sys.exit(main())
