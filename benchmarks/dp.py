"""DP-SGD: memory on a compile-only H100 against k, and step time against jax-privacy.

Usage::

  python benchmarks/dp.py            # every part; writes benchmarks/results/dp.json
  python benchmarks/dp.py --quick    # small sizes, writes <tmp>/dp_quick.json

Part 1, memory (compiled for an H100 that is not there, never run; the
``targets`` extra). The step is ``jaxaccum.make_train_step(loss, tx, k,
clip_per_example=1.0)`` with ``tx = optax.chain(jaxaccum.dp_noise(...),
optax.adam(...))``, parameters and optimizer state donated, on the
transformer of ``step_time.py``'s ``gpu`` preset (float32) with its logical
batch of 64 sequences: per-device peak (XLA's memory analysis) against k. At
k = 1 the step clips per example over the whole batch at once: every
example's gradient is alive together, ``B`` copies of the parameters. Then
the largest logical batch that fits in the H100's 80 GB: at k = 1 (clipping
on the whole batch) by bisection over the batch size, and with jaxaccum at a
fixed micro-batch size (the peak is then the fixed step plus the batch's
tokens, so the batch is found by a line through two compiled sizes and the
answer compiled to check).

Part 1b, ghost clipping's memory (``--part ghost``; compiled only, for the
same H100 and transformer): one micro-batch of m = 8, 32 and 128 sequences
(k = 1), the DP step's peak by ``clip_method="vmap"`` (``peak``) and by
``"ghost"`` (``peak_ghost``), and the peak of the same step without privacy
(a batch loss and Adam: ``peak_non_private``), in ``results["ghost"]``.

Part 2, step time on this CPU, side by side: the same DP-SGD step (clipped
sum, Gaussian noise, Adam) at equal logical batch, with jaxaccum
(``make_train_step(..., k, clip_per_example=C)``) and with jax-privacy's
clipped-gradient function (``jax_privacy.clipping.clipped_grad`` with
``microbatch_size = B / k``, its own accumulation), inside one ``jax.jit``.
The approaches are timed in interleaved rounds (the order rotates every
round); each round times ``repeats`` steps of each. The ratio is the median
over rounds of jax-privacy's time over jaxaccum's (above 1: jaxaccum is
faster). An A/A control times jaxaccum twice, as two approaches in the same
rounds: its ratio, and the spread of it, is the noise floor of the machine,
shared with other work. The goal is a ratio <= 1.0x of jaxaccum's time to
jax-privacy's, i.e. jax-privacy / jaxaccum >= 1 within the noise floor.

The results go to ``benchmarks/results/dp.json`` (``--quick``: a temporary
folder) and the table into ``benchmarks/README.md`` (this file's
``report``, between the ``dp`` markers).
"""

# The manual's typography: multiplication signs for ratios, en dashes.
# ruff: noqa: RUF001

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import dataclasses
import datetime
import importlib.metadata
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


def example_loss(cfg: _models.TransformerConfig) -> Callable[..., jax.Array]:
  """The transformer's loss on ONE sequence (no batch axis)."""
  batch_loss = _models.make_transformer_loss(cfg)
  return lambda params, tokens: batch_loss(params, tokens[None])


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
  privacy: a batch loss, Adam, no clipping, no noise); None if XLA refuses
  it."""
  params = jax.eval_shape(lambda: _models.transformer_init(jax.random.key(0), cfg))
  tx = dp_tx(float(batch)) if clip_method else optax.adam(1e-4)
  opt_state = jax.eval_shape(tx.init, params)
  tokens = jax.ShapeDtypeStruct((batch, cfg.seq_len + 1), jnp.int32)
  mask = jax.ShapeDtypeStruct((batch,), jnp.float32)
  if clip_method is None:
    step = jaxaccum.make_train_step(_models.make_transformer_loss(cfg), tx, k)
    jitted = jax.jit(lambda p, s, t, m: step(p, s, t), donate_argnums=(0, 1))
    return _peak(jitted, (params, opt_state, tokens, mask), target, batch, k)
  step = jaxaccum.make_train_step(
    example_loss(cfg), tx, k, clip_per_example=CLIP, clip_method=clip_method
  )
  # The mask by position: a keyword ShapeDtypeStruct would be a static value.
  jitted = jax.jit(
    lambda p, s, t, m: step(p, s, t, example_mask=m), donate_argnums=(0, 1)
  )
  return _peak(jitted, (params, opt_state, tokens, mask), target, batch, k)


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


def ghost_part(preset: str, sizes: tuple[int, ...]) -> dict[str, Any]:
  """One micro-batch of ``m`` sequences (k = 1) on the compile-only H100:
  the DP step's peak by ``clip_method="vmap"`` (``peak``) and ``"ghost"``,
  and the non-private step's."""
  target = jaxaccum.compile_target("h100")
  cfg = dataclasses.replace(_models.PRESETS[preset]["transformer"], dtype="float32")
  assert isinstance(cfg, _models.TransformerConfig)
  rows = []
  for m in sizes:
    row: dict[str, Any] = {"micro_batch_size": m}
    for key, method in (
      ("peak", "vmap"),
      ("peak_ghost", "ghost"),
      ("peak_non_private", None),
    ):
      start = time.perf_counter()
      row[key] = step_peak(cfg, target, m, 1, method)
      shown = "-" if row[key] is None else f"{row[key] / GB:.2f} GB"
      print(f"  H100, m={m:>3}, {key}: {shown} ({time.perf_counter() - start:.0f} s)")
    rows.append(row)
  return {"target": target.title, "model": cfg.describe(), "rows": rows}


def largest_whole_batch(
  cfg: Any, target: Any, budget: int, start: int
) -> dict[str, Any]:
  """Bisection over the batch size of the k = 1 step (clipping on the whole
  batch): the largest batch whose peak is at most ``budget``."""
  low, high = 0, start
  peaks: dict[int, int | None] = {}
  while True:  # grow until it does not fit
    peaks[high] = step_peak(cfg, target, high, 1)
    if peaks[high] is None or peaks[high] > budget:
      break
    low, high = high, high * 2
  while high - low > 1:
    mid = (low + high) // 2
    peaks[mid] = step_peak(cfg, target, mid, 1)
    if peaks[mid] is None or peaks[mid] > budget:
      high = mid
    else:
      low = mid
  return {"batch": low, "peak": peaks.get(low), "compiled": sorted(peaks)}


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
    result["largest_whole_batch"] = largest_whole_batch(cfg, target, budget, batch)
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

  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Explicit,))
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
          options = {"mesh": mesh, "data_axis": "fsdp"}
        fun = jaxaccum.grad(
          loss,
          k,
          normalize="sum",
          clip_per_example=clip,
          clip_method="ghost",
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


def exact_part(ks: tuple[int, ...]) -> dict[str, Any]:
  """:func:`exact_rows`, in a process of its own with 8 CPU devices (this
  one's backend may have started with one)."""
  env = dict(os.environ)
  testing.cpu_devices(8, environ=env)
  env["JAX_PLATFORMS"] = "cpu"
  out = subprocess.run(
    [sys.executable, __file__, "--exact-rows", ",".join(map(str, ks))],
    env=env,
    check=True,
    capture_output=True,
    text=True,
  )
  print(out.stdout.rsplit("\n", 2)[0])
  return {
    "date": datetime.date.today().isoformat(),
    "jax": jax.__version__,
    "tolerance": 1e-5,
    "rows": json.loads(out.stdout.splitlines()[-1]),
  }


# ---------------------------------------------------------------- part 2: time


def jax_privacy_step(cfg: Any, batch: int, k: int) -> Callable[..., Any]:
  """The same DP-SGD step with jax-privacy's clipped-gradient function."""
  from jax_privacy import clipping  # noqa: PLC0415 (the bench extra)

  grad = clipping.clipped_grad(
    example_loss(cfg),
    l2_clip_norm=CLIP,
    batch_argnums=1,
    keep_batch_dim=False,
    microbatch_size=batch // k if k > 1 else None,
  )
  adam = optax.adam(1e-4)

  @jax.jit
  def step(params, opt_state, tokens, key):
    total = grad(params, tokens)
    leaves, treedef = jax.tree.flatten(total)
    keys = jax.random.split(key, len(leaves))
    noisy = [
      (g + SIGMA * CLIP * jax.random.normal(kk, g.shape)) / batch
      for g, kk in zip(leaves, keys, strict=True)
    ]
    updates, opt_state = adam.update(jax.tree.unflatten(treedef, noisy), opt_state)
    return optax.apply_updates(params, updates), opt_state

  def run(state):
    params, opt_state, tokens, key = state
    params, opt_state = step(params, opt_state, tokens, key)
    return params, opt_state, tokens, key

  return run


def jaxaccum_step(cfg: Any, batch: int, k: int) -> tuple[Callable[..., Any], Any]:
  tx = dp_tx(float(batch))
  step = jaxaccum.make_train_step(
    example_loss(cfg), tx, k, clip_per_example=CLIP, donate=False
  )

  def run(state):
    params, opt_state, tokens, mask = state
    params, opt_state, _ = step(params, opt_state, tokens, example_mask=mask)
    return params, opt_state, tokens, mask

  return run, tx


def time_part(
  preset: str, ks: tuple[int, ...], rounds: int, repeats: int
) -> dict[str, Any]:
  cfg = _models.PRESETS[preset]["transformer"]
  model = _models.build("transformer", preset)
  batch = cfg.batch_size
  rows = []
  for k in ks:
    run_a, tx = jaxaccum_step(cfg, batch, k)
    run_b = jax_privacy_step(cfg, batch, k)
    params = model.params
    mask = jnp.ones((batch,), jnp.float32)
    states = {
      "jaxaccum": (params, tx.init(params), model.batch, mask),
      "jaxaccum_again": (params, tx.init(params), model.batch, mask),
      "jax_privacy": (
        params,
        optax.adam(1e-4).init(params),
        model.batch,
        jax.random.key(1),
      ),
    }
    runs = {"jaxaccum": run_a, "jaxaccum_again": run_a, "jax_privacy": run_b}
    for name, run in runs.items():  # compile and warm up
      states[name] = jax.block_until_ready(run(states[name]))
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(rounds):
      order = names[r % 3 :] + names[: r % 3]
      for name in order:
        start = time.perf_counter()
        for _ in range(repeats):
          states[name] = runs[name](states[name])
        jax.block_until_ready(states[name])
        times[name].append((time.perf_counter() - start) * 1e3 / repeats)
    peer = [b / a for a, b in zip(times["jaxaccum"], times["jax_privacy"], strict=True)]
    control = [
      b / a for a, b in zip(times["jaxaccum"], times["jaxaccum_again"], strict=True)
    ]
    row = {
      "k": k,
      "micro_batch_size": batch // k,
      "ms": {name: statistics.median(t) for name, t in times.items()},
      "ratio": statistics.median(peer),
      "ratio_spread": [min(peer), max(peer)],
      "aa_ratio": statistics.median(control),
      "aa_spread": [min(control), max(control)],
    }
    rows.append(row)
    print(
      f"  CPU, B={batch}, k={k}: jaxaccum {row['ms']['jaxaccum']:.1f} ms, "
      f"jax-privacy {row['ms']['jax_privacy']:.1f} ms: jax-privacy / jaxaccum "
      f"{row['ratio']:.2f}x; A/A {row['aa_ratio']:.2f}x "
      f"[{row['aa_spread'][0]:.2f}, {row['aa_spread'][1]:.2f}]"
    )
  return {
    "model": cfg.describe(),
    "batch_size": batch,
    "rounds": rounds,
    "repeats": repeats,
    "rows": rows,
  }


# ---------------------------------------------------------------- the report


def memory_table(results: dict[str, Any]) -> str:
  memory = results["memory"]
  model = memory["model"]
  lines = [
    f"Compiled for {memory['target']} ({_report.gib(memory['memory_bytes'], 0)} GiB), "
    f"never run: the transformer of `step_time.py`'s `gpu` preset "
    f"({model['num_layers']} layers, d_model {model['d_model']}, vocabulary "
    f"{model['vocab']:,}, {model['seq_len']} tokens; "
    f"{memory['num_params'] / 1e6:.0f}M parameters, float32), Adam, DP-SGD with "
    f"per-example clipping, logical batch {memory['batch_size']} sequences, "
    f"per-device peak against k ({results['date']}).",
    "",
  ]
  rows = [
    (
      r["k"],
      r["micro_batch_size"],
      "–" if r["peak"] is None else _report.gib(r["peak"], 1),
    )
    for r in memory["rows"]
  ]
  lines.append(_report.table(("k", "examples per micro-batch", "peak, GiB"), rows))
  whole = memory.get("largest_whole_batch")
  accumulated = memory.get("largest_accumulated_batch")
  if whole and accumulated:
    budget = f"{_report.gib(memory['memory_bytes'], 0)} GiB"
    lines += [
      "",
      f"In {budget}: per-example clipping on the whole batch (k = 1) fits "
      f"**{whole['batch']:,} sequences** (peak {_report.gib(whole['peak'], 1)} GiB; "
      f"{whole['batch'] + 1:,} does not compile within it). jaxaccum at "
      f"{accumulated['micro_batch_size']} sequences per micro-batch fits **at "
      f"least {accumulated['batch']:,} sequences**, "
      f"{accumulated['batch'] / whole['batch']:,.0f} times as many (k = "
      f"{accumulated['num_micro_batches']:,}, compiled: peak "
      f"{_report.gib(accumulated['peak'], 1)} GiB). That batch is a lower bound: the "
      "search drew a line through the peaks at k = 8 and 64, "
      f"{accumulated['bytes_per_micro_batch'] / 1024:.0f} KiB per micro-batch "
      "(its tokens), and the compiled peak at the line's k came out below the "
      "budget; what grows with k is only the batch itself.",
    ]
  return "\n".join(lines)


def time_table(results: dict[str, Any]) -> str:
  timing = results["time"]
  model = timing["model"]
  lines = [
    f"On {results['machine']}, the `cpu` preset's transformer ({model['num_layers']} "
    f"layers, d_model {model['d_model']}, {model['seq_len']} tokens), logical batch "
    f"{timing['batch_size']}, one DP-SGD step (clip, noise, Adam), median of "
    f"{timing['rounds']} interleaved rounds of {timing['repeats']} steps; jax-privacy "
    f"{results['versions']['jax-privacy']}, jax {results['versions']['jax']}.",
    "",
  ]
  rows = [
    (
      r["k"],
      r["micro_batch_size"],
      f"{r['ms']['jaxaccum']:.1f}",
      f"{r['ms']['jax_privacy']:.1f}",
      f"{r['ratio']:.2f}× ({r['ratio_spread'][0]:.2f}–{r['ratio_spread'][1]:.2f})",
      f"{r['aa_ratio']:.2f}× ({r['aa_spread'][0]:.2f}–{r['aa_spread'][1]:.2f})",
    )
    for r in timing["rows"]
  ]
  lines.append(
    _report.table(
      (
        "k",
        "examples per micro-batch",
        "jaxaccum ms",
        "jax-privacy ms",
        "jax-privacy / jaxaccum (range)",
        "A/A: jaxaccum / jaxaccum (range)",
      ),
      rows,
    )
  )
  verdicts = [
    f"k = {r['k']}: {_report.timed_verdict(r['ratio'] >= 1, r['aa_ratio'])} "
    f"({r['ratio']:.2f}×)"
    for r in timing["rows"]
  ]
  lines += [
    "",
    "Goal (jaxaccum's step at most jax-privacy's, a ratio of at least 1; "
    "decided only where the A/A ratio is within 3% of 1): " + "; ".join(verdicts) + ".",
  ]
  return "\n".join(lines)


#: The generated blocks this file writes from ``dp.json``, by name
#: (``_report.py`` puts each on its page).
def ghost_table(results: dict[str, Any]) -> str:
  ghost = results["ghost"]
  budget = results["memory"]["memory_bytes"]
  lines = [
    f'Ghost clipping (`clip_method="ghost"`) against per-example gradients '
    f'(`"vmap"`, the default) and the step without privacy: one micro-batch of '
    f"m sequences (k = 1), the same transformer, compiled for {ghost['target']}, "
    "per-device peak. A peak marked * is above the "
    f"{_report.gib(budget, 0)} GiB the device has: compiled, it would not run. "
    "A dash: XLA refused it.",
    "",
  ]

  def gib(b):
    return "–" if b is None else _report.gib(b, 1) + ("*" if b > budget else "")

  rows = [
    (
      r["micro_batch_size"],
      gib(r["peak"]),
      gib(r["peak_ghost"]),
      gib(r["peak_non_private"]),
      "–"
      if r["peak_ghost"] is None or r["peak_non_private"] is None
      else f"{r['peak_ghost'] / r['peak_non_private']:.2f}×",
    )
    for r in ghost["rows"]
  ]
  header = ("m", "vmap, GiB", "ghost, GiB", "non-private, GiB", "ghost / non-private")
  lines.append(_report.table(header, rows))
  return "\n".join(lines)


def exact_table(results: dict[str, Any]) -> str:
  exact = results["exact"]
  tolerance = exact["tolerance"]
  lines = [
    'Ghost clipping (`clip_method="ghost"`) against an independent reference '
    "written in `dp.py` (one `jax.vmap(jax.grad)` over the 64 rows on one "
    "device, each example clipped to the median norm, summed): the relative "
    "error of the clipped sum over all leaves, and of the worst leaf. "
    "An MLP and a CNN on scikit-learn's digits, a one-layer transformer LM "
    "(16 tokens) on CPython's `pydoc_data` text; on one CPU device, and on 8 "
    "CPU devices with `mesh=` and every leaf that 8 divides sharded over the "
    f"data axis (FSDP); jax {exact['jax']}, {exact['date']}. Goal: at most "
    f"{tolerance:g}; a row above it is marked ✗.",
    "",
  ]
  rows = [
    (
      r["model"],
      "1"
      if r["devices"] == 1
      else f"{r['devices']}, FSDP ({r['fsdp_leaves']} of {r['leaves']} leaves)",
      r["k"],
      f"{r['rel_error']:.1e}" + ("" if r["rel_error"] <= tolerance else " ✗"),
      f"{r['max_leaf_rel_error']:.1e}"
      + ("" if r["max_leaf_rel_error"] <= tolerance else " ✗"),
      "; ".join(r["fallback"]) or "none",
    )
    for r in exact["rows"]
  ]
  header = ("model", "devices", "k", "rel. error", "worst leaf", "falls back")
  lines.append(_report.table(header, rows))
  return "\n".join(lines)


BLOCKS = {
  "dp memory": memory_table,
  "dp ghost": ghost_table,
  "dp exact": exact_table,
  "dp time": time_table,
}


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small sizes, few rounds")
  parser.add_argument("--out", type=pathlib.Path, default=None)
  parser.add_argument(
    "--part",
    choices=("both", "time", "memory", "ghost", "exact"),
    default="both",
    help="measure one part and keep the other from the existing JSON",
  )
  parser.add_argument(
    "--rounds", type=int, default=None, help="timed rounds (default 21; quick 3)"
  )
  parser.add_argument(
    "--repeats", type=int, default=None, help="steps per sample (default 5; quick 2)"
  )
  parser.add_argument("--exact-rows", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.exact_rows:  # exact_part's process, with 8 CPU devices
    rows = exact_rows(tuple(int(k) for k in args.exact_rows.split(",")))
    print(json.dumps(rows))
    return 0
  quick = args.quick
  out = _paths.output_folder(args.out, quick)
  name = "dp_quick.json" if quick else "dp.json"
  path = out / name
  results: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
  if args.part in ("both", "time"):  # the machine the times come from
    results["machine"] = f"{os.cpu_count()}-core {_report.cpu_model()}"
  if args.part != "exact":  # the exact part dates its own rows
    results.update(
      date=datetime.date.today().isoformat(),
      versions={
        p: importlib.metadata.version(p) for p in ("jax", "jax-privacy", "optax")
      },
    )
  if args.part in ("both", "time"):
    print("Part 2: step time on this CPU")
    results["time"] = time_part(
      "cpu-quick" if quick else "cpu",
      (1, 4) if quick else (1, 2, 4, 8),
      rounds=args.rounds or (3 if quick else 21),
      repeats=args.repeats or (2 if quick else 5),
    )
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
      "gpu-quick" if quick else "gpu", (8,) if quick else (8, 32, 128)
    )
  if args.part in ("both", "exact"):
    print("Part 3: ghost clipping against a vmap(grad) reference, 1 and 8 devices")
    results["exact"] = exact_part((1, 2, 4, 8))
  path.write_text(json.dumps(results, indent=1) + "\n")
  print(f"wrote {path}")
  if not quick:
    for page, file in _report.PAGES.items():
      file.write_text(_report.render(file.read_text(), out, page))
    print(f"rewrote {_report.MANUAL}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
