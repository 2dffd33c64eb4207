"""FSDP: memory and communication of accumulating a 1B-parameter transformer.

Usage::

  python benchmarks/fsdp.py [--quick] [--targets h100,tpu-v5e] [--ks 1,2,4,8,16]
                            [--model llama_1b] [--approaches A,B,...]
                            [--out benchmarks/results] [--hlo-dir DIR]
  python benchmarks/fsdp.py --collectives-from DIR   # recount a saved run

Compile-only: nothing runs, and no accelerator is needed (the ``targets``
extra: the CUDA compiler plugin and libtpu). The model is a Llama-style
decoder (``LlamaConfig``): 16 layers, d_model 2048, SwiGLU d_ff 5632, 16
heads with rotary embeddings, RMSNorm, vocabulary 32,000, sequences of 2,048
tokens; 953M parameters, kept as float32 master weights and cast to
bfloat16 at the top of the loss, so that every matmul runs in bfloat16 (the
softmax, the norms' statistics and the loss in float32). The layers are
stacked and run under ``jax.lax.scan``, each rematerialized in the backward
pass (``jax.checkpoint``, nothing saved but the layer's input: MaxText's
``scan_layers`` with ``remat_policy: full``), so that compiling stays fast.

FSDP: every weight matrix (stacked: one more leading axis) is sharded over
the mesh's one axis ``"data"`` along its larger dimension (the first on ties;
the vocabulary for the embedding tables), the norms' scales are replicated;
the batch is sharded over ``"data"``. The mesh has ``Auto`` axes and
jaxaccum is told the shardings with ``param_specs=``. The activations are
constrained after the embedding and after every layer, as MaxText constrains
them: ``P("data")`` under plain ``jit``, ``P()`` inside jaxaccum, whose
``vmap`` over the devices adds ``"data"`` to the batch axis. One step is
``optax.adamw`` with the parameters and the optimizer state donated; the
global batch is 128 sequences (16 per device), split into ``k``
micro-batches of ``128 / (8 k)`` sequences per device. The approaches:

- ``full_batch``: ``jax.value_and_grad`` on the whole batch, then the update,
  under ``jit`` (``_approaches.full_batch_step``);
- ``jaxaccum_per_micro_batch``: ``jaxaccum.make_train_step(loss, tx, k,
  mesh=mesh, data_axis="data", param_specs=..., fsdp_gather=
  "per_micro_batch")``, jaxaccum's default;
- ``full_batch_skip``: the same with ``make_train_step``'s skip of a
  non-finite step (the new parameters and optimizer state selected by an
  all-finite flag), so that ``k = 1`` is compared with a step that checks
  what it checks;
- ``jaxaccum_once``: the same with ``fsdp_gather="once"``;
- ``jaxaccum_cast_once``: ``fsdp_gather="cast_once"`` with
  ``gather_dtype=jnp.bfloat16`` (the loss casts every weight to bfloat16
  first, so it is exact);
- ``jaxaccum_global``: ``view="global"``, ``fun`` on the global micro-batch
  (the loss of plain ``jit``, its constraints naming ``"data"``);
- ``hand_scan``: MaxText's pattern written by hand: the batch split with a
  stride (micro-batch ``i`` holds rows ``i, i + k, ...``, which keeps every
  device's rows on it), a ``lax.scan`` whose float32 accumulator and
  parameters are constrained to the parameters' shardings, the mean, the
  same update;
- ``optax_microbatch``: ``optax.microbatching.microbatch(
  jax.value_and_grad(loss), argnums=1, microbatch_size=128 // k,
  accumulator=MEAN)`` and the update, under ``jit``
  (``_approaches.OptaxMicrobatch``).

The targets: 8 H100s (``jaxaccum.compile_target("h100",
topology="1x1x8")``) and a TPU v5e ``2x4`` slice. What is recorded, per
device:

- ``peak_bytes``: ``jaxaccum.compiled_memory(step, ..., target=...)``:
  argument + output + temp - alias of device memory;
- ``collective_bytes``: the result bytes of every collective, times the trip
  counts of the loops around it (``jaxaccum.testing.bytes_communicated``);
- ``in_loop_collectives``: collective instructions inside the micro-batch
  loop (the loop outside every other loop that runs ``k`` times), and
  ``in_any_loop_collectives``: inside any while loop, the layer scans'
  included (``jaxaccum.testing.collectives(...)``, ``in_loop``).

``jaxaccum.testing`` misreads some forms of collective that XLA prints
(``testing_misreads`` checks each on a one-instruction example at start-up:
the GPU's asynchronous reduce-scatter and all-to-all, the TPU's
collective-permute with its context scalars). Where a step's HLO holds one,
its collective numbers are null rather than too low, and
``misread_collectives`` says which.

The HLO for the collectives: on the TPU the step compiled by ``lower(...)
.compile()``; on the H100s the same step traced on a mesh of the target's
compile-only GPU devices themselves (``target.devices``), compiled by
``lower(...).compile()``, which also dumps XLA's buffer assignment: the
largest buffers live at the peak (``largest_live_buffers_at_peak``) come
from its live-range report. ``jaxaccum.compiled_memory`` compiles the GPU
step separately, on CPU devices standing in for the GPUs; ``peak_bytes_hlo``
is the second compile's own peak, a cross-check. A step XLA refuses (the TPU
compiler refuses a program above the chip's 16 GiB) has ``peak_bytes:
null`` and an ``error``.

Outputs ``fsdp.json`` and ``fsdp.png`` in ``--out`` (``fsdp_quick.*`` with
``--quick``: a 3-layer model, k in 1 and 4; ``fsdp_llama_2.7b.*`` with
``--model llama_2.7b``, pipeline.py's larger model, which ``pipeline.py``
weighs pipelining against). Each H100 row compiles twice,
and a GPU compile takes 10 to 30 s whatever the model's size, so on two
CPU cores ``--quick`` takes about 5 minutes and ``--quick --targets
tpu-v5e`` about one. The full sweep took 73 minutes on two CPU cores shared
with other work: 20 for the H100 rows, 53 for the TPU's (a TPU compile of
the 1B model takes 2 to 4 minutes).
"""

# The manual's blocks below use its typography: multiplication signs, en
# dashes, minus signs.
# ruff: noqa: RUF001

from __future__ import annotations

import os

# Without a GPU the CUDA plugin must not try to start one (it would fail and
# not register its compiler).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import dataclasses
import datetime
import functools
import importlib.metadata
import json
import math
import pathlib
import platform
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import _approaches
import _models
import _paths
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _report import bullet_list, date, listing, ratio, table
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from jaxaccum import testing

PyTree = Any

NUM_DEVICES = 8
BATCH_SIZE = 128
DEFAULT_KS = (1, 2, 4, 8, 16)
QUICK_KS = (1, 4)
TARGETS = {"h100": "1x1x8", "tpu-v5e": "2x4"}
DATA = "data"
APPROACHES = {
  "full_batch": "full batch, jit",
  "full_batch_skip": "full batch + skip-non-finite select, jit",
  "jaxaccum_per_micro_batch": 'jaxaccum, fsdp_gather="per_micro_batch" (default)',
  "jaxaccum_once": 'jaxaccum, fsdp_gather="once"',
  "jaxaccum_cast_once": 'jaxaccum, fsdp_gather="cast_once" (bfloat16)',
  "jaxaccum_global": 'jaxaccum, view="global"',
  "hand_scan": "hand-written lax.scan (MaxText's pattern)",
  "optax_microbatch": "optax.microbatch, jit",
}
PEERS = ("hand_scan", "optax_microbatch")
DEFAULT = "jaxaccum_per_micro_batch"
MODES = (
  "jaxaccum_per_micro_batch",
  "jaxaccum_once",
  "jaxaccum_cast_once",
  "jaxaccum_global",
)
# Steps that do not depend on k: compiled once per target.
WHOLE_BATCH = ("full_batch", "full_batch_skip")
LEARNING_RATE, WEIGHT_DECAY = 3e-4, 0.1


# ---------------------------------------------------------------- the model


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """A Llama-style decoder: RMSNorm, rotary attention, SwiGLU, untied heads.

  Attributes:
    vocab: vocabulary size.
    d_model: residual width (``num_heads`` divides it).
    num_heads: attention heads.
    num_layers: decoder layers, stacked and scanned.
    d_ff: the SwiGLU's hidden width.
    seq_len: tokens predicted per sequence (a row holds ``seq_len + 1``).
    batch_size: the global batch, in sequences.
  """

  vocab: int
  d_model: int
  num_heads: int
  num_layers: int
  d_ff: int
  seq_len: int
  batch_size: int = BATCH_SIZE

  def describe(self) -> dict[str, Any]:
    """The configuration as JSON-friendly numbers."""
    return {
      "kind": "llama",
      **dataclasses.asdict(self),
      "param_dtype": "float32",
      "compute_dtype": "bfloat16",
      "remat": "full (each layer: only its input is saved)",
    }


MODELS = {
  "llama_1b": LlamaConfig(
    vocab=32_000, d_model=2048, num_heads=16, num_layers=16, d_ff=5632, seq_len=2048
  ),
  # pipeline.py's larger model, where pipelining is weighed against FSDP.
  "llama_2.7b": LlamaConfig(
    vocab=32_000, d_model=2560, num_heads=20, num_layers=32, d_ff=6912, seq_len=2048
  ),
  "llama_quick": LlamaConfig(
    vocab=512, d_model=128, num_heads=4, num_layers=3, d_ff=352, seq_len=64
  ),
}


def param_shapes(cfg: LlamaConfig) -> dict[str, Any]:
  """The parameters' shapes, float32 master weights; the layers stacked."""
  d, f, n, v = cfg.d_model, cfg.d_ff, cfg.num_layers, cfg.vocab
  f32 = jnp.float32
  layers = {
    "attn_norm": (n, d),
    "wq": (n, d, d),
    "wk": (n, d, d),
    "wv": (n, d, d),
    "wo": (n, d, d),
    "mlp_norm": (n, d),
    "w_gate": (n, d, f),
    "w_up": (n, d, f),
    "w_down": (n, f, d),
  }
  return {
    "embed": jax.ShapeDtypeStruct((v, d), f32),
    "layers": {k: jax.ShapeDtypeStruct(s, f32) for k, s in layers.items()},
    "final_norm": jax.ShapeDtypeStruct((d,), f32),
    "unembed": jax.ShapeDtypeStruct((d, v), f32),
  }


def fsdp_spec(path: tuple[Any, ...], x: jax.ShapeDtypeStruct) -> P:
  """FSDP: a weight matrix sharded over ``"data"`` along its larger
  dimension (the first on ties; a stacked layer's leading axis is never
  sharded); norm scales replicated."""
  stacked = jax.tree_util.keystr(path).startswith("['layers']")
  dims = x.shape[1:] if stacked else x.shape
  if len(dims) < 2:
    return P()
  axis = int(np.argmax(dims))  # the first of equal sizes
  spec = [None] * len(dims)
  spec[axis] = DATA
  return P(*([None] * stacked), *spec)


def param_specs(cfg: LlamaConfig) -> PyTree:
  """The parameters' ``PartitionSpec``s."""
  return jax.tree_util.tree_map_with_path(fsdp_spec, param_shapes(cfg))


def _rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), -1, keepdims=True) + 1e-6)
  return y.astype(x.dtype) * scale


def _rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotary embedding of ``x`` (batch, seq, heads, head_dim), half-split form."""
  x1, x2 = jnp.split(x, 2, axis=-1)
  c, s = cos[:, None, :], sin[:, None, :]
  return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def _attention(
  h: jax.Array, w: dict[str, jax.Array], cos: jax.Array, sin: jax.Array, heads: int
) -> jax.Array:
  """Causal multi-head attention; scores and softmax in float32."""
  b, t, d = h.shape
  q, k, v = (
    (h @ w[name]).reshape(b, t, heads, d // heads) for name in ("wq", "wk", "wv")
  )
  q, k = _rotary(q, cos, sin), _rotary(k, cos, sin)
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
  scores = scores / math.sqrt(d // heads)
  causal = jnp.tril(jnp.ones((t, t), jnp.bool_))
  scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(h.dtype)
  out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, d)
  return out @ w["wo"]


def make_loss(
  cfg: LlamaConfig, batch_sharding: NamedSharding | None = None
) -> Callable[[PyTree, jax.Array], jax.Array]:
  """``loss(params, tokens)``: the mean next-token cross-entropy.

  ``tokens`` is ``(batch, seq_len + 1)`` int32. The parameters are cast to
  bfloat16 first (their gradients come back float32); the layers run under
  ``lax.scan``, each wrapped in ``jax.checkpoint`` with nothing saveable.
  With ``batch_sharding`` the activations are constrained to it after the
  embedding and after every layer, as MaxText constrains them, so that the
  partitioner gathers the weights where they are used and leaves the
  activations sharded by batch (without, XLA's partitioner reshards the
  SwiGLU's activations with all-to-alls and gathers other devices'
  activations). Under plain ``jit`` that is ``P("data")``; inside jaxaccum,
  where ``fun`` sees one device's micro-batch and the data axis is
  jaxaccum's (naming it is an error), ``P()``: jaxaccum's ``vmap`` over the
  devices adds ``"data"`` to the batch axis.
  """

  def constrain(x: jax.Array) -> jax.Array:
    if batch_sharding is None:
      return x
    return jax.lax.with_sharding_constraint(x, batch_sharding)

  head = cfg.d_model // cfg.num_heads
  inv_freq = 1.0 / (10_000 ** (np.arange(0, head, 2, dtype=np.float32) / head))
  angles = np.arange(cfg.seq_len, dtype=np.float32)[:, None] * inv_freq[None, :]
  cos_np, sin_np = np.cos(angles), np.sin(angles)

  def layer(x, w):
    cos = jnp.asarray(cos_np, x.dtype)
    sin = jnp.asarray(sin_np, x.dtype)
    x = x + _attention(_rms_norm(x, w["attn_norm"]), w, cos, sin, cfg.num_heads)
    h = _rms_norm(x, w["mlp_norm"])
    x = x + (jax.nn.silu(h @ w["w_gate"]) * (h @ w["w_up"])) @ w["w_down"]
    return constrain(x), None

  layer = jax.checkpoint(
    layer, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False
  )

  def loss(params: PyTree, tokens: jax.Array) -> jax.Array:
    p = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    x = constrain(p["embed"][inputs])
    x, _ = jax.lax.scan(layer, x, p["layers"])
    logits = (_rms_norm(x, p["final_norm"]) @ p["unembed"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  return loss


# ---------------------------------------------------------------- the steps


def optimizer() -> optax.GradientTransformation:
  """One optax.adamw: the same object for every approach (its steps cache)."""
  return _OPTIMIZER


_OPTIMIZER = optax.adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY)


def hand_scan_step(
  loss: Callable[..., jax.Array],
  tx: optax.GradientTransformation,
  k: int,
  shardings: PyTree,
) -> Any:
  """Gradient accumulation as MaxText writes it, under ``jit``.

  The batch is split with a stride, ``(B, ...) -> (B/k, k, ...) -> (k, B/k,
  ...)``: micro-batch ``i`` is rows ``i, i + k, ...``, so every device keeps
  its own rows. The parameters and the float32 accumulator are constrained
  to the parameters' shardings, so that each micro-batch's gradient is
  reduced into a sharded accumulator; the mean then goes to the update.
  """

  def step(params, opt_state, tokens):
    def constrain(tree):
      return jax.lax.with_sharding_constraint(tree, shardings)

    params = constrain(params)
    micro = tokens.reshape(tokens.shape[0] // k, k, *tokens.shape[1:]).swapaxes(0, 1)

    def body(carry, micro_batch):
      value, grads = jax.value_and_grad(loss)(params, micro_batch)
      acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), carry["grads"], grads)
      return {"loss": carry["loss"] + value, "grads": constrain(acc)}, None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    init = {"loss": jnp.zeros((), jnp.float32), "grads": constrain(zeros)}
    total, _ = jax.lax.scan(body, init, micro)
    grads = constrain(jax.tree.map(lambda g: g / k, total["grads"]))
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, total["loss"] / k

  return jax.jit(step, donate_argnums=(0, 1))


@dataclasses.dataclass(frozen=True)
class Setup:
  """A model on one mesh: its losses and the abstract, sharded arguments.

  Attributes:
    name: the model's name.
    cfg: its configuration.
    mesh: the mesh, one ``Auto`` axis ``"data"``.
    jit_loss: the loss for ``jit`` of the whole batch (activations
      constrained to ``P("data")``).
    accum_loss: the loss for jaxaccum (activations constrained to ``P()``
      in its per-device view).
    specs: the parameters' ``PartitionSpec``s.
    args: ``(params, opt_state, tokens)`` as sharded ``ShapeDtypeStruct``s.
  """

  name: str
  cfg: LlamaConfig
  mesh: Mesh
  jit_loss: Callable[..., jax.Array]
  accum_loss: Callable[..., jax.Array]
  specs: PyTree
  args: tuple[PyTree, PyTree, jax.ShapeDtypeStruct]

  @property
  def shardings(self) -> PyTree:
    return jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.specs)


def make_setup(name: str, cfg: LlamaConfig, mesh: Mesh) -> Setup:
  """The losses, and parameters, adamw state and batch as
  ``ShapeDtypeStruct``s on ``mesh``."""
  tx = optimizer()
  specs = param_specs(cfg)
  shapes = param_shapes(cfg)

  def on(x, spec):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

  params = jax.tree.map(on, shapes, specs)
  state = jax.eval_shape(tx.init, shapes)
  state = optax.tree_utils.tree_map_params(
    tx,
    on,
    state,
    specs,
    transform_non_params=lambda x: on(x, P()),
    is_leaf=lambda x: isinstance(x, P),
  )
  tokens = jax.ShapeDtypeStruct(
    (cfg.batch_size, cfg.seq_len + 1),
    jnp.int32,
    sharding=NamedSharding(mesh, P(DATA)),
  )
  return Setup(
    name,
    cfg,
    mesh,
    jit_loss=make_loss(cfg, NamedSharding(mesh, P(DATA))),
    accum_loss=make_loss(cfg, NamedSharding(mesh, P())),
    specs=specs,
    args=(params, state, tokens),
  )


def full_batch_skip_step(loss: Any, tx: optax.GradientTransformation) -> Any:
  """The full-batch step with ``make_train_step``'s skip: the update kept
  only where the loss and every gradient are finite."""

  def step(params, opt_state, batch):
    value, grads = jax.value_and_grad(loss)(params, batch)
    updates, new_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    finite = [jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]
    ok = jnp.logical_and(jnp.isfinite(value), jnp.all(jnp.stack(finite)))
    keep = functools.partial(jax.tree.map, lambda new, old: jnp.where(ok, new, old))
    return keep(new_params, params), keep(new_state, opt_state), value

  return jax.jit(step, donate_argnums=(0, 1))


def build_step(approach: str, setup: Setup, k: int) -> Any:
  """The jitted, donating ``step(params, opt_state, tokens)`` of ``approach``."""
  tx = optimizer()
  if approach == "full_batch":
    return _approaches.full_batch_step(setup.jit_loss, tx)
  if approach == "full_batch_skip":
    return full_batch_skip_step(setup.jit_loss, tx)
  jaxaccum_options = {
    "jaxaccum_per_micro_batch": {"fsdp_gather": "per_micro_batch"},
    "jaxaccum_once": {"fsdp_gather": "once"},
    "jaxaccum_cast_once": {"fsdp_gather": "cast_once", "gather_dtype": jnp.bfloat16},
    "jaxaccum_global": {"view": "global"},
  }
  if approach in jaxaccum_options:
    # The global view's fun is the loss of plain jit; the device view's sees
    # one device's rows.
    loss = setup.jit_loss if approach == "jaxaccum_global" else setup.accum_loss
    return jaxaccum.make_train_step(
      loss,
      tx,
      k,
      mesh=setup.mesh,
      data_axis=DATA,
      param_specs=setup.specs,
      **jaxaccum_options[approach],
    )
  if approach == "hand_scan":
    return hand_scan_step(setup.jit_loss, tx, k, setup.shardings)
  if approach == "optax_microbatch":
    model = _models.Model(
      setup.name, setup.name, setup.jit_loss, setup.args[0], setup.args[2], setup.cfg
    )  # type: ignore[arg-type]
    return _approaches.OptaxMicrobatch(model, tx, k).fn
  raise ValueError(f"unknown approach {approach!r}")


# ---------------------------------------------------------------- reading HLO


def micro_batch_loop(
  step: testing.CompiledStep, k: int
) -> tuple[set[str], list[int | None]]:
  """The computations inside the micro-batch loop of a compiled step, and
  the trip counts of the loops outside every other loop.

  The micro-batch loop is a loop outside every other loop that runs ``k``
  times (``k >= 2``): the layer scans and XLA's own loops (on the TPU,
  windowed einsums, which loop over the devices) sit inside it.

  The loops are ``jaxaccum.testing``'s (``CompiledStep.loops``), a loop's
  trip count as it reads it: XLA's ``known_trip_count`` (GPU), or the
  ``counter < N`` of its condition (TPU). The computations inside a loop
  are its body and condition and all they call, an n-way conditional's
  ``branch_computations`` included (the reader this file had before left
  those out).
  """
  outer = [loop for loop in step.loops if not loop.outer]
  inside: set[str] = set()
  for loop in outer:
    if k >= 2 and loop.trip_count == k:
      inside |= loop.computations
  return inside, [loop.trip_count for loop in outer]


#: Collective instructions in the forms XLA prints them, one per line: the
#: form's name, a regex that finds it, a one-instruction example and the bytes
#: it delivers (its result, the async forms' outputs only).
_FORMS = (
  (
    "reduce-scatter-start (GPU)",
    r"\sreduce-scatter-start\(",
    "%s = ((f32[64]{0}), f32[8]{0}) reduce-scatter-start(f32[64]{0} %x), dimensions={0}",
    32,
  ),
  (
    "all-to-all-start (GPU)",
    r"\sall-to-all-start\(",
    "%s = ((f32[64]{0}), f32[64]{0}) all-to-all-start(f32[64]{0} %x), dimensions={0}",
    256,
  ),
  (
    "collective-permute-start with u32[] contexts (TPU)",
    r"u32\[\](?:\{[^}]*\})?\) collective-permute-start\(",
    "%s = (f32[64]{0}, f32[64]{0}, u32[]{:S(2)}, u32[]{:S(2)}) "
    "collective-permute-start(f32[64]{0} %x), source_target_pairs={{0,1},{1,0}}",
    256,
  ),
)


@functools.cache
def testing_misreads() -> dict[str, str]:
  """The forms of ``_FORMS`` whose bytes ``jaxaccum.testing`` reads wrongly:
  each example, alone in an entry computation, against its known bytes."""
  out = {}
  for name, _, line, want in _FORMS:
    text = f"ENTRY %main (x: f32[64]) -> f32[64] {{\n  {line}\n}}"
    got = testing.bytes_communicated(text)
    if got != want:
      out[name] = f"jaxaccum.testing reads {got} bytes where it delivers {want}"
  return out


def misread_collectives(hlo_text: str) -> dict[str, int]:
  """How many instructions of each form ``jaxaccum.testing`` misreads the
  HLO holds."""
  bad = testing_misreads()
  found: dict[str, int] = {}
  for name, pattern, _, _ in _FORMS:
    if name in bad:
      count = len(re.findall(pattern, hlo_text))
      if count:
        found[name] = count
  return found


def collective_stats(hlo_text: str, k: int) -> dict[str, Any]:
  """Bytes per step, by opcode, and the collectives inside the loops.

  Where the HLO holds collectives that ``jaxaccum.testing`` reads wrongly
  (``testing_misreads``), the totals would be wrong: they are None, and
  ``misread_collectives`` says which, and how many.
  """
  step = testing.read_compiled(hlo_text)
  colls = step.collectives
  missed = misread_collectives(hlo_text)
  micro, trips = micro_batch_loop(step, k)
  by_op: dict[str, int] = {}
  for c in colls:
    by_op[c.op] = by_op.get(c.op, 0) + c.bytes * c.executions
  in_micro = [c for c in colls if c.computation in micro]
  counted = {
    "collective_bytes": step.bytes_communicated,
    "in_loop_collectives": len(in_micro),
    "in_loop_collective_bytes": sum(c.bytes * c.executions for c in in_micro),
    "in_any_loop_collectives": sum(c.in_loop for c in colls),
    "num_collectives": len(colls),
  }
  out: dict[str, Any] = {
    "collective_bytes_by_op": by_op,
    "outer_loop_trip_counts": trips,
  }
  if missed:
    out["misread_collectives"] = missed
    out["counted_by_jaxaccum_testing"] = counted
    return {**dict.fromkeys(counted), **out}
  return {**counted, **out}


_PEAK = re.compile(r"^\s*Live ranges at \d+ \(peak\):")
_LIVE = re.compile(r"^\s*(\S+): (\d+) bytes \(cumulative")
_VALUE = re.compile(
  r"value: <\d+ ([^ >]+)(?: \(phi\))? @\d+> \(size=\d+,offset=\d+\): (.*)$"
)


def live_at_peak(dump: pathlib.Path, limit: int = 12) -> list[dict[str, Any]]:
  """The largest buffers live at the peak, from XLA's dumped live ranges.

  Each: its HLO value, bytes, shape and the JAX ``op_name`` of the
  instruction that defines it: the argument's name for the step's own
  parameters, none for a loop's parameter (a value carried through a loop).
  """
  ranges = sorted(dump.glob("*after_optimizations-live-range.txt"))
  if not ranges:
    return []
  live: list[tuple[str, int]] = []
  in_peak = False
  for line in ranges[-1].read_text().splitlines():
    if _PEAK.match(line):
      in_peak = True
    elif in_peak:
      match = _LIVE.match(line)
      if not match:
        break
      live.append((match.group(1), int(match.group(2))))
  shapes: dict[str, str] = {}
  for path in dump.glob("*after_optimizations-buffer-assignment.txt"):
    for line in path.read_text().splitlines():
      match = _VALUE.search(line)
      if match:
        shapes.setdefault(match.group(1), match.group(2))
  ops: dict[str, str] = {}
  for path in dump.glob("*gpu_after_optimizations.txt"):
    ops.update(testing.read_compiled(path.read_text()).op_names())
  live.sort(key=lambda item: -item[1])
  return [
    {
      "value": name,
      "bytes": size,
      "shape": shapes.get(name.removesuffix("{}"), ""),
      "op_name": ops.get(name.split("{")[0], ""),
    }
    for name, size in live[:limit]
  ]


# ---------------------------------------------------------------- compiling


def _error(e: Exception) -> str:
  lines = str(e).strip().splitlines()
  return f"{type(e).__name__}: {(lines[0] if lines else '')[:300]}"


def _sharded_like_inputs(compiled: Any, args: Sequence[Any]) -> bool:
  """Whether the new parameters and optimizer state come out sharded like
  the ones that went in (donation can then reuse their buffers)."""
  outs = jax.tree.leaves(compiled.output_shardings[:2])
  ins = jax.tree.leaves(args[:2])
  return all(
    o.is_equivalent_to(i.sharding, len(i.shape)) for o, i in zip(outs, ins, strict=True)
  )


def measure(
  approach: str,
  k: int,
  target: jaxaccum.CompileTarget,
  setup: Setup,
  hlo_setup: Setup,
  *,
  hlo_dir: pathlib.Path | None = None,
) -> dict[str, Any]:
  """One row: compiles ``approach`` with ``k`` for ``target``.

  ``setup`` is on ``target.mesh()``, for ``jaxaccum.compiled_memory``;
  ``hlo_setup`` on the target's own devices, for the HLO (the same mesh on
  a TPU, where one compile serves both). With ``hlo_dir`` the compiled HLO
  text is written there.
  """
  row: dict[str, Any] = {
    "target": target.name,
    "model": setup.name,
    "k": k,
    "approach": approach,
    "micro_batch_per_device": setup.cfg.batch_size
    // (NUM_DEVICES * (1 if approach in WHOLE_BATCH else k)),
    "peak_bytes": None,
    "collective_bytes": None,
    "in_loop_collectives": None,
  }
  start = time.perf_counter()
  try:
    step = build_step(approach, setup, k)
    stats = jaxaccum.compiled_memory(step, *setup.args, target=target)
  except Exception as e:  # recorded; the sweep goes on
    row["error"] = _error(e)
    row["compile_s"] = round(time.perf_counter() - start, 1)
    return row
  row.update(
    peak_bytes=stats.peak_bytes,
    argument_bytes=stats.argument_bytes,
    output_bytes=stats.output_bytes,
    temp_bytes=stats.temp_bytes,
    alias_bytes=stats.alias_bytes,
  )
  try:
    with tempfile.TemporaryDirectory() as tmp:
      hlo_step = step if hlo_setup is setup else build_step(approach, hlo_setup, k)
      lowered = hlo_step.lower(*hlo_setup.args)
      if target.platform == "tpu":
        compiled = lowered.compile()  # cached: the compile above
      else:
        compiled = lowered.compile(
          compiler_options={"xla_dump_to": tmp, "xla_gpu_dump_llvmir": False}
        )
        row["peak_bytes_hlo"] = testing.read_compiled(
          compiled, target=target
        ).peak_bytes
        row["largest_live_buffers_at_peak"] = live_at_peak(pathlib.Path(tmp))
      text = compiled.as_text()
      if hlo_dir is not None:
        hlo_dir.mkdir(parents=True, exist_ok=True)
        (hlo_dir / f"{target.name}_{approach}_k{k}.txt").write_text(text)
      row.update(collective_stats(text, 1 if approach in WHOLE_BATCH else k))
      row["outputs_sharded_like_inputs"] = _sharded_like_inputs(
        compiled, hlo_setup.args
      )
  except Exception as e:
    row["error"] = f"HLO for the collectives: {_error(e)}"
  row["compile_s"] = round(time.perf_counter() - start, 1)
  return row


def hlo_mesh(target: jaxaccum.CompileTarget) -> Mesh:
  """A mesh of the target's own compile-only devices (its HLO is the
  target's); for a GPU, ``target.mesh()`` holds CPU stand-ins instead."""
  if target.platform == "tpu":
    return target.mesh((NUM_DEVICES,), (DATA,), axis_types=(AxisType.Auto,))
  devices = np.array(target.devices, dtype=object).reshape(NUM_DEVICES)
  return Mesh(devices, (DATA,), axis_types=(AxisType.Auto,))


# ---------------------------------------------------------------- the report


def goal(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Per (target, k >= 2): is the default's peak at or below the full
  batch's and every peer's (``hand_scan``, ``optax_microbatch``)? One that
  did not compile does not count against it; the default not compiling does.
  ``ratios``: the default's peak over each one's."""
  out = []
  keys = dict.fromkeys((r["target"], r["model"], r["k"]) for r in rows)
  for target, model, k in keys:
    if k < 2:
      continue
    mine = {
      r["approach"]: r["peak_bytes"]
      for r in rows
      if (r["target"], r["model"], r["k"]) == (target, model, k)
    }
    default = mine.get(DEFAULT)
    others = {
      name: mine[name] for name in ("full_batch", *PEERS) if mine.get(name) is not None
    }
    below = sorted(name for name, peak in others.items() if default and peak < default)
    out.append(
      {
        "target": target,
        "model": model,
        "k": k,
        "met": default is not None and not below,
        "below_default": below,
        "default_peak_bytes": default,
        "ratios": {
          name: None if default is None else round(default / peak, 4)
          for name, peak in others.items()
        },
      }
    )
  return out


def _unit(rows: list[dict[str, Any]]) -> tuple[str, int]:
  """GiB, or MiB for a model whose steps stay below one GiB."""
  peaks = [r["peak_bytes"] for r in rows if r["peak_bytes"] is not None]
  return ("GiB", 2**30) if max(peaks, default=0) >= 2**30 else ("MiB", 2**20)


def _mib(n: float | None) -> str:
  return "-" if n is None else f"{n / 2**20:,.0f}"


def gib(n: float | None) -> str:
  return "-" if n is None else f"{n / 2**30:.2f}"


def text_table(rows: list[dict[str, Any]]) -> str:
  """Per target: peak bytes, collective bytes and collectives in the loop,
  per approach (columns) and k (rows)."""
  short = {
    "full_batch": "full",
    "full_batch_skip": "full+skip",
    "jaxaccum_per_micro_batch": "per_micro",
    "jaxaccum_once": "once",
    "jaxaccum_cast_once": "cast_once",
    "jaxaccum_global": "global",
    "hand_scan": "hand_scan",
    "optax_microbatch": "optax_mb",
  }
  unit, scale = _unit(rows)

  def size(n: float) -> str:
    return f"{n / scale:.2f}"

  lines = []
  for target in dict.fromkeys(r["target"] for r in rows):
    mine = [r for r in rows if r["target"] == target]
    ks = sorted({r["k"] for r in mine})
    names = [a for a in APPROACHES if any(r["approach"] == a for r in mine)]
    cell = {(r["approach"], r["k"]): r for r in mine}
    for title, key, fmt in (
      (f"peak {unit} per device", "peak_bytes", size),
      (f"collective {unit} per step per device", "collective_bytes", size),
      ("collectives in the micro-batch loop", "in_loop_collectives", str),
    ):
      lines += ["", f"{target} ({mine[0]['model']}): {title}"]
      lines.append(f"{'k':>3} " + " ".join(f"{short[a]:>10}" for a in names))
      for k in ks:
        values = []
        for a in names:
          r = cell.get((a, k))
          v = None if r is None else r.get(key)
          values.append("-" if v is None else fmt(v))
        lines.append(f"{k:>3} " + " ".join(f"{v:>10}" for v in values))
  return "\n".join(lines)


def summary(rows: list[dict[str, Any]], goals: list[dict[str, Any]]) -> str:
  """The goal per target and k, and every error."""
  lines = ["", f"goal: {DEFAULT} at or below the full batch and every peer, k >= 2"]
  for g in goals:
    verdict = (
      "met" if g["met"] else "MISSED, below it: " + ", ".join(g["below_default"])
    )
    lines.append(f"  {g['target']:<8} k={g['k']:<3} {verdict}")
  for r in rows:
    if "error" in r:
      lines.append(f"  {r['target']} k={r['k']} {r['approach']}: {r['error'][:150]}")
  return "\n".join(lines)


def plot(results: dict[str, Any], path: pathlib.Path) -> None:
  """Per target (rows): the peak per device against k, the full batch a
  horizontal line; the collective bytes per step per device against k."""
  import matplotlib  # noqa: PLC0415  (importing the script for its blocks plots nothing)

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  rows = results["rows"]
  unit, scale = _unit(rows)
  targets = list(dict.fromkeys(r["target"] for r in rows))
  fig, axes = plt.subplots(
    len(targets), 2, figsize=(13, 4.6 * len(targets)), squeeze=False
  )
  styles = {
    "full_batch": ("k", "-", None),
    "full_batch_skip": ("gray", "--", None),
    "jaxaccum_per_micro_batch": ("C0", "-", "o"),
    "jaxaccum_once": ("C1", "--", "s"),
    "jaxaccum_cast_once": ("C4", "--", "D"),
    "jaxaccum_global": ("C5", ":", "P"),
    "hand_scan": ("C2", "-", "^"),
    "optax_microbatch": ("C3", "-", "v"),
  }
  for (ax_peak, ax_bytes), target in zip(axes, targets, strict=True):
    mine = [r for r in rows if r["target"] == target]
    ks = sorted({r["k"] for r in mine})
    for approach, name in APPROACHES.items():
      color, ls, marker = styles[approach]
      points = [r for r in mine if r["approach"] == approach]
      failed = [r["k"] for r in points if r["peak_bytes"] is None]
      label = name
      if failed and approach in WHOLE_BATCH:
        label += " (does not compile)"
      elif failed:
        label += f" (does not compile at k={','.join(map(str, failed))})"
      for ax, key in ((ax_peak, "peak_bytes"), (ax_bytes, "collective_bytes")):
        xy = [(r["k"], r[key] / scale) for r in points if r[key] is not None]
        if approach in WHOLE_BATCH and xy:
          ax.axhline(xy[0][1], color=color, ls=ls, lw=1.5, label=label)
        elif approach in WHOLE_BATCH:
          ax.plot([], [], color=color, ls=":", label=label)
        else:
          ax.plot(
            *(zip(*xy, strict=True) if xy else ([], [])),
            color=color,
            ls=ls,
            marker=marker,
            label=label,
          )
    misread = sorted({f for r in mine for f in r.get("misread_collectives", {})})
    if all(r["collective_bytes"] is None for r in mine):
      ax_bytes.set_yticks([])
    if misread:
      ax_bytes.text(
        0.5,
        0.5,
        "missing points: steps whose HLO holds\n"
        + "\n".join(misread)
        + "\n(jaxaccum.testing misreads their bytes)",
        transform=ax_bytes.transAxes,
        ha="center",
        va="center",
        fontsize=8,
        color="gray",
      )
    memory = results["targets"].get(target, {}).get("memory_bytes")
    highest = max((r["peak_bytes"] or 0 for r in mine), default=0)
    if memory and (highest > memory / 2 or any(r["peak_bytes"] is None for r in mine)):
      ax_peak.axhline(
        memory / scale,
        color="gray",
        ls=":",
        lw=1,
        label=f"device memory, {memory / 2**30:.0f} GiB",
      )
    title = results["targets"].get(target, {}).get("title", target)
    for ax, ylabel in (
      (ax_peak, f"peak {unit} per device"),
      (ax_bytes, f"collective {unit} per step, per device"),
    ):
      ax.set_xscale("log", base=2)
      ax.set_xticks(ks, [str(k) for k in ks])
      ax.minorticks_off()
      ax.set_ylim(0, None)
      ax.set_xlabel("micro-batches per step, k")
      ax.set_ylabel(ylabel)
      ax.grid(True, alpha=0.3)
      ax.set_title(f"{title} x {NUM_DEVICES}", fontsize=9)
    ax_peak.legend(fontsize=7)
  model = results["model"]
  fig.suptitle(
    f"FSDP over {NUM_DEVICES} devices: {model['num_params']:,}-parameter "
    f"Llama ({model['num_layers']} scanned layers), batch {model['batch_size']} x "
    f"{model['seq_len']} tokens, adamw; compile-only, jax "
    f"{results['versions']['jax']}, {results['date'][:10]}",
    fontsize=10,
  )
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _stacked_grad_bytes(cfg: LlamaConfig) -> int:
  """Bytes of the gradient of every stacked weight matrix in bfloat16, whole
  (what one device holds when it is not sharded)."""
  layers = param_shapes(cfg)["layers"]
  return sum(2 * math.prod(x.shape) for x in layers.values() if len(x.shape) == 3)


def _buffers(row: dict[str, Any], limit: int = 6) -> str:
  """The largest buffers live at the peak: MiB, shape (or HLO value) and
  the last part of the JAX op that made it."""
  return "; ".join(
    f"{b['bytes'] / 2**20:,.0f} MiB {b['shape'] or b['value']} "
    f"({b['op_name'].split('/')[-1] or 'carried through a loop'})"
    for b in row.get("largest_live_buffers_at_peak", [])[:limit]
  )


def notes(
  rows: list[dict[str, Any]], goals: list[dict[str, Any]], cfg: LlamaConfig
) -> list[str]:
  """What the JSON's numbers mean, and what they show."""
  out = [
    "Per device, compile-only (nothing ran). peak_bytes: "
    "jaxaccum.compiled_memory(...).peak_bytes, argument + output + temp - alias "
    "of device memory; on the TPU temp is read from XLA's peak_memory_in_bytes. "
    "A step the TPU compiler refuses (beyond 16 GiB) has peak_bytes null and an "
    "error.",
    "collective_bytes: result bytes of every collective times the trip counts "
    "of the while loops around it (jaxaccum.testing.bytes_communicated); a "
    "reduce-scatter counts its 1/8 result, an all-gather its whole result. "
    "in_loop_collectives: collective instructions inside the micro-batch loop "
    "(a loop outside every other loop that runs k times; none for the full "
    "batch or k = 1); in_any_loop_collectives also counts those of the layer "
    "scans outside it and of XLA's own loops (the TPU's windowed einsums).",
    "Parameters: float32 master weights, cast to bfloat16 at the top of the "
    "loss; the matmuls run in bfloat16. Gradients, adamw's moments and every "
    "accumulator are float32. Each layer is rematerialized (jax.checkpoint, "
    "nothing saveable) and the layers are scanned.",
    "Auto mesh, one axis 'data'; jaxaccum gets param_specs=. The activations "
    "are constrained after the embedding and every layer, as MaxText does: "
    "P('data') under plain jit, P() inside jaxaccum (whose vmap over the "
    "devices adds 'data' to the batch axis; naming 'data' there is an error). "
    "Without the constraints XLA's partitioner reshards the SwiGLU "
    "activations with all-to-alls and all-gathers other devices' activations, "
    "inside jaxaccum too.",
    "No out_shardings anywhere (make_train_step takes none); "
    "outputs_sharded_like_inputs says whether XLA gave the new parameters and "
    "optimizer state the inputs' shardings, so that donation reuses them.",
    "full_batch does not depend on k: it is compiled once per target and its "
    "row repeated for every k. micro_batch_per_device is in sequences.",
    "H100 HLO: the step traced on the target's compile-only GPU devices "
    "(target.devices) and compiled with lower().compile(compiler_options="
    "{'xla_dump_to': ...}); largest_live_buffers_at_peak is read from that "
    "dump's live-range report. peak_bytes_hlo is that compile's peak, "
    "peak_bytes the one jaxaccum.compiled_memory compiles on CPU stand-ins.",
  ]
  h100 = [r for r in rows if "peak_bytes_hlo" in r]
  if h100:
    same = sum(r["peak_bytes_hlo"] == r["peak_bytes"] for r in h100)
    out.append(f"peak_bytes_hlo equals peak_bytes in {same} of {len(h100)} H100 rows.")
  sharded = [
    r["outputs_sharded_like_inputs"] for r in rows if "outputs_sharded_like_inputs" in r
  ]
  out.append(
    f"outputs_sharded_like_inputs is true in {sum(sharded)} of {len(sharded)} rows."
  )
  pairs = [
    (r["peak_bytes"], o["peak_bytes"])
    for r in rows
    for o in rows
    if r["approach"] == "hand_scan"
    and o["approach"] == "optax_microbatch"
    and (r["target"], r["k"]) == (o["target"], o["k"])
  ]
  if pairs:
    same = sum(a == b for a, b in pairs)
    out.append(
      f"hand_scan and optax_microbatch have the same peak in {same} of "
      f"{len(pairs)} (target, k): both are plain jit of a lax.scan over a "
      "strided split of the batch with a float32 accumulator, partitioned by "
      "XLA."
    )
  misreads = testing_misreads()
  if misreads:
    out.append(
      "jaxaccum.testing misreads collective forms that these steps use, so "
      "collective_bytes, in_loop_collectives and in_loop_collective_bytes are "
      "null wherever the HLO holds one (misread_collectives counts them; "
      "counted_by_jaxaccum_testing keeps testing's numbers, too low): "
      + "; ".join(f"{form}: {why}" for form, why in misreads.items())
      + ". They return once jaxaccum.testing reads these forms."
    )
  for g in goals:
    if g["met"]:
      continue
    mine = {
      r["approach"]: r for r in rows if (r["target"], r["k"]) == (g["target"], g["k"])
    }
    if not g["below_default"]:
      error = mine.get(DEFAULT, {}).get("error", "not measured")
      out.append(f"MISS {g['target']} k={g['k']}: {DEFAULT}: {error}")
      continue
    best = min(g["below_default"], key=lambda name: mine[name]["peak_bytes"])
    line = (
      f"MISS {g['target']} k={g['k']}: {DEFAULT} {gib(g['default_peak_bytes'])} GiB "
      f"> {best} {gib(mine[best]['peak_bytes'])} GiB (below it: "
      f"{', '.join(g['below_default'])})."
    )
    if mine[DEFAULT].get("largest_live_buffers_at_peak"):
      line += (
        f" Largest buffers live at the peak: {DEFAULT}: {_buffers(mine[DEFAULT])}. "
        f"{best}: {_buffers(mine[best])}."
      )
    out.append(line)

  def excess(g: dict[str, Any]) -> int:
    """The default's peak over the lowest one below it."""
    lowest = min(
      r["peak_bytes"]
      for r in rows
      if (r["target"], r["k"]) == (g["target"], g["k"])
      and r["approach"] in g["below_default"]
    )
    return g["default_peak_bytes"] - lowest

  misses = {
    target: [
      excess(g)
      for g in goals
      if g["target"] == target and g["below_default"] and g["default_peak_bytes"]
    ]
    for target in dict.fromkeys(g["target"] for g in goals)
  }
  if misses.get("tpu-v5e"):
    out.append(
      "The TPU misses are not analysed here (no buffer assignment is dumped for "
      "the TPU): the default's excess over the lowest peer there is "
      f"{min(misses['tpu-v5e']) / 2**30:.2f} to {max(misses['tpu-v5e']) / 2**30:.2f} GiB."
    )
  if misses.get("h100") and cfg != MODELS["llama_1b"]:
    out.append(
      "Why the default misses was worked out from llama_1b's buffer "
      "assignment (run without --quick); largest_live_buffers_at_peak holds "
      "this model's."
    )
  elif misses.get("h100"):
    out.append(
      "Why the default misses (XLA's buffer assignment, H100): at its peak "
      "each device holds its micro-batch's gradient of every stacked weight "
      "matrix whole, unsharded, in bfloat16: the backward lax.scan over the "
      "layers writes each layer's weight gradient into a stacked (layers, 1, "
      "...) output (bf16[16,1,2048,5632] x 3 and bf16[16,1,2048,2048] x 4, "
      f"{_stacked_grad_bytes(cfg) / 2**30:.2f} GiB), "
      "because jaxaccum computes each device's micro-batch gradient inside its "
      "vmap over the devices and reduce-scatters it (psum_scatter per leaf, "
      "into the float32 accumulator) only after the backward pass has produced "
      "all of it. Under plain jit (full batch, hand_scan, optax.microbatch) "
      "XLA's partitioner reduce-scatters each layer's weight gradient inside "
      "the backward layer loop, in bfloat16, so the stacked gradient it writes "
      "is already 1/8 per device. The default's excess over the lowest peer "
      f"on the H100 ({min(misses['h100']) / 2**30:.2f} to "
      f"{max(misses['h100']) / 2**30:.2f} GiB "
      f"for k >= 2) is about that stacked gradient's size (the embedding "
      "tables' gradients are also whole, in float32, before their "
      "reduce-scatter). Gathering the weights is not the cause: every "
      "approach gathers one layer's bfloat16 weights at a time inside the "
      "layer loop."
    )
  return out


# ---------------------------------------------------------------- the manual's blocks


FSDP_APPROACHES = {
  "full_batch": "full batch",
  "full_batch_skip": "full batch + skip",
  "jaxaccum_per_micro_batch": 'jaxaccum (`"per_micro_batch"`)',
  "jaxaccum_once": 'jaxaccum (`"once"`)',
  "jaxaccum_cast_once": 'jaxaccum (`"cast_once"`)',
  "jaxaccum_global": 'jaxaccum (`view="global"`)',
  "hand_scan": "hand-written scan",
  "optax_microbatch": "optax.microbatch",
}


def _fsdp_cell(r: dict[str, Any] | None, scale: int) -> str:
  if r is None:
    return "–"
  if r.get("peak_bytes") is None:
    return "refused" if "RESOURCE_EXHAUSTED" in r.get("error", "") else "fails"

  def size(n: float | None) -> str:
    return "–" if n is None else f"{n / scale:,.2f}"

  loop = r.get("in_loop_collectives")
  return f"{size(r['peak_bytes'])} / {size(r.get('collective_bytes'))} / {'–' if loop is None else loop}"


def fsdp_table(results: dict[str, Any]) -> str:
  rows_in = results["rows"]
  peaks = [r["peak_bytes"] for r in rows_in if r.get("peak_bytes") is not None]
  unit, scale = ("GiB", 2**30) if max(peaks, default=0) >= 2**30 else ("MiB", 2**20)
  model = results["model"]
  parts = [
    f"Compile-only, {date(results['date'])}, jax "
    f"{results.get('versions', {}).get('jax', '?')}: a "
    f"{model['num_params']:,}-parameter `{model['name']}` on 8 devices. Each cell: "
    f"peak {unit} per device / collective {unit} per step per device / "
    "collectives inside the micro-batch loop."
  ]
  for target in dict.fromkeys(r["target"] for r in rows_in):
    mine = {(r["approach"], r["k"]): r for r in rows_in if r["target"] == target}
    names = [a for a in FSDP_APPROACHES if any(a == key[0] for key in mine)]
    ks = sorted({k for _, k in mine})
    title = results.get("targets", {}).get(target, {}).get("title", target)
    rows = [[k, *(_fsdp_cell(mine.get((a, k)), scale) for a in names)] for k in ks]
    parts.append(
      f"**{title}** × 8:\n\n" + table(["k", *(FSDP_APPROACHES[a] for a in names)], rows)
    )
  parts.append("![FSDP peak and collective bytes against k](results/fsdp.png)")
  return "\n\n".join(parts)


def fsdp_summary(results: dict[str, Any]) -> str:
  rows = results["rows"]
  peak = {(r["target"], r["k"], r["approach"]): r.get("peak_bytes") for r in rows}
  moved = {
    (r["target"], r["k"], r["approach"]): r.get("collective_bytes") for r in rows
  }
  default = "jaxaccum_per_micro_batch"
  modes = [a for a in FSDP_APPROACHES if a.startswith("jaxaccum_")]
  peers = [
    a for a in FSDP_APPROACHES if a not in (*modes, "full_batch", "full_batch_skip")
  ]
  lines = []
  for target in dict.fromkeys(r["target"] for r in rows):
    ks = sorted({r["k"] for r in rows if r["target"] == target and r["k"] >= 2})
    ks = [k for k in ks if peak.get((target, k, default)) is not None]
    mine = {k: peak[(target, k, default)] for k in ks}
    full = {k: mine[k] / p for k in ks if (p := peak.get((target, k, "full_batch")))}
    lowest: dict[int, tuple[float, list[str]]] = {}
    for k in ks:
      theirs = {a: p for a in peers if (p := peak.get((target, k, a)))}
      if theirs:
        low = min(theirs.values())
        names = [FSDP_APPROACHES[a] for a, p in theirs.items() if p == low]
        lowest[k] = (mine[k] / low, names)
    title = results.get("targets", {}).get(target, {}).get("title", target)

    def each(values: dict[int, float]) -> str:
      return listing([ratio(v) for v in values.values()])

    text = (
      f"**{title}.** At k = {listing([str(k) for k in ks])}, jaxaccum's default "
      f"peak is {each(full)} × the full batch's and "
      f"{each({k: r for k, (r, _) in lowest.items()})} × the lowest peer's "
      f"({listing(sorted({n for _, ns in lowest.values() for n in ns}))})"
    )
    hand = {
      k: moved[(target, k, default)] / m
      for k in ks
      if moved.get((target, k, default)) and (m := moved.get((target, k, "hand_scan")))
    }
    if len(hand) == len(ks):
      text += (
        f"; it moves {each(hand)} × the hand-written scan's collective bytes per step"
      )
    lines.append(text + ".")
    for mode in modes:
      over = {
        k: (p / h, m / hm)
        for k in ks
        if (p := peak.get((target, k, mode)))
        and (h := peak.get((target, k, "hand_scan")))
        and (m := moved.get((target, k, mode))) is not None
        and (hm := moved.get((target, k, "hand_scan")))
      }
      if over:
        lines.append(
          f"{title}, {FSDP_APPROACHES[mode]} ÷ the hand-written scan at k = "
          f"{listing([str(k) for k in over])}: peak "
          f"{listing([f'{p:.3f}' for p, _ in over.values()])}, collective bytes "
          f"{listing([f'{m:.3f}' for _, m in over.values()])}."
        )
    one = {
      a: p
      for a in ("full_batch", "full_batch_skip", default)
      if (p := peak.get((target, 1, a)))
    }
    if len(one) == 3:
      lines.append(
        f"{title}, k = 1: jaxaccum's step is {one[default] / one['full_batch']:.3f}"
        f" × the full batch's peak and {one[default] / one['full_batch_skip']:.3f}"
        " × the full batch's with the same skip-non-finite select."
      )
  misread = sum(bool(r.get("misread_collectives")) for r in rows)
  if misread:
    lines.append(
      f"In {misread} of {len(rows)} steps the HLO holds a form of collective "
      "that `jaxaccum.testing` misreads; their collective numbers are left out "
      "(–) rather than understated (`misread_collectives` in the JSON)."
    )
  errors = [r for r in rows if r.get("error") and r.get("peak_bytes") is None]
  if errors:
    lines.append(
      f"{len(errors)} of {len(rows)} steps did not compile (refused: "
      f"{sum('RESOURCE_EXHAUSTED' in r['error'] for r in errors)}); the JSON "
      "keeps each error."
    )
  return bullet_list(lines)


#: The generated blocks this file writes from ``fsdp.json``, by name
#: (``_report.py`` puts each on its page).
BLOCKS = {
  "fsdp table": fsdp_table,
  "fsdp summary": fsdp_summary,
}


def _versions() -> dict[str, str]:
  names = ("jax", "jaxlib", "optax", "libtpu", "jax-cuda13-plugin", "jaxaccum")
  out = {"python": platform.python_version()}
  for name in names:
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = "not installed"
  return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument(
    "--quick", action="store_true", help="a 2-layer model and k in 1,2,4 (a minute)"
  )
  parser.add_argument(
    "--targets",
    default=",".join(TARGETS),
    help=f"comma-separated, of {', '.join(TARGETS)} (default: both)",
  )
  parser.add_argument("--ks", help="comma-separated k (default 1,2,4,8,16)")
  parser.add_argument(
    "--model",
    choices=[m for m in MODELS if m != "llama_quick"],
    help="the model (default llama_1b; llama_2.7b: pipeline.py's larger one, "
    "written to fsdp_llama_2.7b.json)",
  )
  parser.add_argument(
    "--approaches",
    help=f"comma-separated, of {', '.join(APPROACHES)} (default: all)",
  )
  parser.add_argument(
    "--out",
    type=pathlib.Path,
    help="output folder (default: benchmarks/results; quick: the temporary folder)",
  )
  parser.add_argument(
    "--hlo-dir",
    type=pathlib.Path,
    help="also write every compiled step's HLO text here (a few MB each)",
  )
  parser.add_argument(
    "--partial",
    type=pathlib.Path,
    metavar="FILE",
    help="write the rows here as they come, and take those it already holds "
    "instead of compiling them again (a long sweep resumed)",
  )
  parser.add_argument(
    "--collectives-from",
    type=pathlib.Path,
    metavar="HLO_DIR",
    help="compile nothing: recount the collectives of the results in --out "
    "from the HLO a run saved with --hlo-dir (after a fix to the reader)",
  )
  args = parser.parse_args(argv)
  partial_sweep = args.approaches is not None or args.ks is not None
  if partial_sweep and args.out is None and not args.quick and args.model is None:
    parser.error(
      "--approaches and --ks make a partial sweep of llama_1b: pass --out, so "
      "that benchmarks/results/fsdp.json keeps the whole one"
    )
  if args.quick and args.model is not None:
    parser.error("--quick compiles its own small model: drop --model")
  args.model = "llama_quick" if args.quick else args.model or "llama_1b"
  args.out = _paths.output_folder(args.out, args.quick)
  args.targets = [t for t in args.targets.split(",") if t]
  unknown = [t for t in args.targets if t not in TARGETS]
  if unknown:
    parser.error(f"unknown targets {unknown}; choose from {list(TARGETS)}")
  args.approaches = args.approaches.split(",") if args.approaches else list(APPROACHES)
  unknown = [a for a in args.approaches if a not in APPROACHES]
  if unknown:
    parser.error(f"unknown approaches {unknown}; choose from {list(APPROACHES)}")
  ks = [int(k) for k in args.ks.split(",")] if args.ks else None
  args.ks = ks or list(QUICK_KS if args.quick else DEFAULT_KS)
  bad = [k for k in args.ks if k < 1 or BATCH_SIZE % (NUM_DEVICES * k)]
  if bad:
    parser.error(
      f"k={bad}: {BATCH_SIZE} sequences over {NUM_DEVICES} devices do not split"
    )
  return args


def run(args: argparse.Namespace) -> dict[str, Any]:
  """Compiles every target, approach and k; the JSON-ready results."""
  warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
  name = args.model
  cfg = MODELS[name]
  shapes = param_shapes(cfg)
  rows: list[dict[str, Any]] = []
  done: dict[tuple[str, int, str], dict[str, Any]] = {}
  if args.partial is not None and args.partial.exists():  # resume a sweep
    done = {
      (r["target"], r["k"], r["approach"]): r
      for r in json.loads(args.partial.read_text())
    }
  targets = {}
  for target_name in args.targets:
    target = jaxaccum.compile_target(target_name, topology=TARGETS[target_name])
    targets[target.name] = {
      "title": target.title,
      "device_kind": target.device_kind,
      "topology": target.topology,
      "memory_bytes": target.memory_bytes,
    }
    mesh = target.mesh((NUM_DEVICES,), (DATA,), axis_types=(AxisType.Auto,))
    setup = make_setup(name, cfg, mesh)
    hlo = setup if target.platform == "tpu" else make_setup(name, cfg, hlo_mesh(target))
    whole: dict[str, dict[str, Any]] = {}
    for k in args.ks:
      for approach in args.approaches:
        if (target.name, k, approach) in done:
          row = done[target.name, k, approach]
          if approach in WHOLE_BATCH:
            whole[approach] = row
        elif approach in whole:
          row = {**whole[approach], "k": k}  # the same step for every k
        else:
          row = measure(approach, k, target, setup, hlo, hlo_dir=args.hlo_dir)
          if approach in WHOLE_BATCH:
            whole[approach] = row
        if approach == DEFAULT:
          row["default"] = True
        rows.append(row)
        if args.partial is not None:  # every row as it comes, for a long sweep
          args.partial.write_text(json.dumps(rows, indent=1) + "\n")
        print(
          f"{target.name:<8} k={k:<3} {approach:<25} peak "
          f"{_mib(row['peak_bytes'])} MiB, collectives "
          f"{_mib(row['collective_bytes'])} MiB, in the loop "
          f"{row['in_loop_collectives']} ({row['compile_s']} s)"
          + (f"  {row['error'][:100]}" if "error" in row else ""),
          file=sys.stderr,
          flush=True,
        )
  goals = goal(rows)
  return {
    "description": __doc__.split("\n\n")[0],
    "rows": rows,
    "goal": goals,
    "notes": notes(rows, goals, cfg),
    "model": {
      "name": name,
      **cfg.describe(),
      "num_params": sum(math.prod(x.shape) for x in jax.tree.leaves(shapes)),
      "param_bytes": _approaches.tree_bytes(shapes),
      "param_specs": {
        jax.tree_util.keystr(path): str(spec)
        for path, spec in jax.tree_util.tree_leaves_with_path(
          param_specs(cfg), is_leaf=lambda x: isinstance(x, P)
        )
      },
      "optimizer": f"optax.adamw({LEARNING_RATE}, weight_decay={WEIGHT_DECAY})",
    },
    "targets": targets,
    "ks": args.ks,
    "approaches": APPROACHES,
    "versions": _versions(),
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "argv": sys.argv[1:],
  }


def recount(results: dict[str, Any], hlo_dir: pathlib.Path) -> dict[str, Any]:
  """``results`` with every row's collectives counted again from the HLO
  that run saved (``--hlo-dir``); the peaks are the compiler's and stay."""
  name = results["model"]["name"]
  for row in results["rows"]:
    k = 1 if row["approach"] == "full_batch" else row["k"]
    path = hlo_dir / f"{row['target']}_{row['approach']}_k{k}.txt"
    for key in ("misread_collectives", "counted_by_jaxaccum_testing"):
      row.pop(key, None)
    row.update(collective_stats(path.read_text(), k))
  results["goal"] = goal(results["rows"])
  results["notes"] = notes(results["rows"], results["goal"], MODELS[name])
  results["collectives_recounted"] = {
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "argv": sys.argv[1:],
    "versions": _versions(),
  }
  return results


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the sweep; writes the JSON and the PNG; prints the tables."""
  args = parse_args(argv)
  # Before JAX starts: 8 CPU devices stand in for the 8 H100s (a GPU target
  # of n devices needs n CPU devices), with threads enough for their
  # collectives.
  testing.cpu_devices()
  stem = {"llama_quick": "fsdp_quick", "llama_1b": "fsdp"}.get(
    args.model, f"fsdp_{args.model}"
  )
  if args.collectives_from is not None:
    results = recount(
      json.loads((args.out / f"{stem}.json").read_text()), args.collectives_from
    )
  else:
    start = time.perf_counter()
    results = run(args)
    results["wall_s"] = round(time.perf_counter() - start, 1)
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / f"{stem}.json").write_text(json.dumps(results, indent=1) + "\n")
  plot(results, args.out / f"{stem}.png")
  print(text_table(results["rows"]))
  print(summary(results["rows"], results["goal"]))
  print(
    f"\n{results['model']['num_params']:,} parameters; {results['wall_s']:.0f} s; "
    f"wrote {args.out / (stem + '.json')} and {args.out / (stem + '.png')}"
  )
  return results


if __name__ == "__main__":
  main()
