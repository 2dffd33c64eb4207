"""The benchmark models, in plain JAX: parameter pytrees and mean losses.

Every approach differentiates the very same ``loss(params, batch)``, a
per-example (or per-token) mean, so the mean of ``k`` equal micro-batch
means is the full-batch mean. :data:`PRESETS` sizes three models:
``dispatch_mlp``, a tiny MLP whose step is dominated by dispatch;
``compute_mlp``, a wide MLP whose step is matmul FLOPs; and ``transformer``,
a small pre-LayerNorm causal language model. :class:`LlamaConfig`
(:data:`LLAMAS`) is the Llama-style decoder of ``fsdp.py`` and
``pipeline.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

PyTree = Any
Loss = Callable[[PyTree, PyTree], jax.Array]


@dataclasses.dataclass(frozen=True)
class MLPConfig:
  """A ReLU MLP classifier with a softmax cross-entropy: its layer widths,
  input first and classes last, and the effective batch ``B``."""

  widths: tuple[int, ...]
  batch_size: int

  def describe(self) -> dict[str, Any]:
    """The configuration as JSON-friendly numbers."""
    return {"kind": "mlp", "widths": list(self.widths), "batch_size": self.batch_size}


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """A decoder-only transformer language model. A row holds ``seq_len + 1``
  tokens (inputs and shifted targets); ``batch_size`` is ``B`` in
  sequences; ``dtype`` is the parameters' and compute's (the loss is taken
  in float32)."""

  vocab: int
  d_model: int
  num_heads: int
  num_layers: int
  d_ff: int
  seq_len: int
  batch_size: int
  dtype: str = "float32"

  def describe(self) -> dict[str, Any]:
    """The configuration as JSON-friendly numbers."""
    return {"kind": "transformer", **dataclasses.asdict(self)}


@dataclasses.dataclass(frozen=True)
class Model:
  """A model ready to benchmark: ``loss(params, batch) -> scalar``, a
  per-example mean; its initial parameters; the whole effective batch
  (every leaf's leading axis is ``B``); its configuration, for the report."""

  name: str
  title: str
  loss: Loss
  params: PyTree
  batch: PyTree
  config: MLPConfig | TransformerConfig

  @property
  def batch_size(self) -> int:
    """``B``, the leading size of the batch."""
    return int(jax.tree.leaves(self.batch)[0].shape[0])

  @property
  def num_params(self) -> int:
    """The number of scalar parameters."""
    return sum(int(x.size) for x in jax.tree.leaves(self.params))


# ---------------------------------------------------------------- MLP


def mlp_init(key: jax.Array, widths: tuple[int, ...]) -> list[dict[str, jax.Array]]:
  """He-initialized ``[{"w", "b"}, ...]`` for the given widths."""
  params = []
  for d_in, d_out in itertools.pairwise(widths):
    key, sub = jax.random.split(key)
    w = jax.random.normal(sub, (d_in, d_out), jnp.float32) * math.sqrt(2.0 / d_in)
    params.append({"w": w, "b": jnp.zeros((d_out,), jnp.float32)})
  return params


def mlp_loss(
  params: list[dict[str, jax.Array]], batch: dict[str, jax.Array]
) -> jax.Array:
  """The mean softmax cross-entropy of a ReLU MLP over the batch's rows."""
  h = batch["x"]
  for layer in params[:-1]:
    h = jax.nn.relu(h @ layer["w"] + layer["b"])
  logits = h @ params[-1]["w"] + params[-1]["b"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def make_mlp(name: str, title: str, config: MLPConfig, seed: int = 0) -> Model:
  """An MLP model with random data: Gaussian inputs, uniform labels."""
  key_p, key_x, key_y = jax.random.split(jax.random.key(seed), 3)
  batch = {
    "x": jax.random.normal(key_x, (config.batch_size, config.widths[0]), jnp.float32),
    "y": jax.random.randint(key_y, (config.batch_size,), 0, config.widths[-1]),
  }
  return Model(name, title, mlp_loss, mlp_init(key_p, config.widths), batch, config)


# ---------------------------------------------------------------- transformer


def transformer_init(key: jax.Array, cfg: TransformerConfig) -> dict[str, Any]:
  """Parameters of a pre-LayerNorm transformer, scaled-normal initialized."""
  dtype = jnp.dtype(cfg.dtype)
  keys = iter(jax.random.split(key, 3 + 4 * cfg.num_layers))

  def dense(shape: tuple[int, int]) -> jax.Array:
    std = 1.0 / math.sqrt(shape[0])
    return (jax.random.normal(next(keys), shape, jnp.float32) * std).astype(dtype)

  def norm() -> dict[str, jax.Array]:
    return {
      "scale": jnp.ones((cfg.d_model,), dtype),
      "bias": jnp.zeros((cfg.d_model,), dtype),
    }

  d, f = cfg.d_model, cfg.d_ff
  embed = jax.random.normal(next(keys), (cfg.vocab, d), jnp.float32) * 0.02
  pos = jax.random.normal(next(keys), (cfg.seq_len, d), jnp.float32) * 0.02
  layers = [
    {
      "ln1": norm(),
      "qkv": dense((d, 3 * d)),
      "out": dense((d, d)),
      "ln2": norm(),
      "ff1": dense((d, f)),
      "ff1_b": jnp.zeros((f,), dtype),
      "ff2": dense((f, d)),
      "ff2_b": jnp.zeros((d,), dtype),
    }
    for _ in range(cfg.num_layers)
  ]
  return {
    "embed": embed.astype(dtype),
    "pos": pos.astype(dtype),
    "layers": layers,
    "ln_f": norm(),
    "unembed": dense((d, cfg.vocab)),
  }


def _layer_norm(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
  """LayerNorm with float32 statistics, returned in ``x``'s dtype."""
  x32 = x.astype(jnp.float32)
  mean = x32.mean(-1, keepdims=True)
  var = jnp.square(x32 - mean).mean(-1, keepdims=True)
  y = (x32 - mean) * jax.lax.rsqrt(var + 1e-5)
  return y.astype(x.dtype) * p["scale"] + p["bias"]


def _causal_attention(
  q: jax.Array, k: jax.Array, v: jax.Array, scores_dtype: Any = None
) -> jax.Array:
  """Causal attention of ``(batch, seq, heads, head_dim)`` queries, keys and
  values, the heads merged back: the scores taken in ``scores_dtype`` (the
  einsum's ``preferred_element_type``), the softmax in float32."""
  b, t, h, head = q.shape
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=scores_dtype)
  scores = scores.astype(jnp.float32) / math.sqrt(head)
  causal = jnp.tril(jnp.ones((t, t), jnp.bool_))
  scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
  return jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, h * head)


def _attention(x: jax.Array, layer: dict[str, jax.Array], num_heads: int) -> jax.Array:
  """Causal multi-head self-attention; softmax in float32."""
  b, t, d = x.shape
  q, k, v = jnp.split(x @ layer["qkv"], 3, axis=-1)
  q, k, v = (a.reshape(b, t, num_heads, d // num_heads) for a in (q, k, v))
  return _causal_attention(q, k, v) @ layer["out"]


def make_transformer_loss(cfg: TransformerConfig) -> Loss:
  """``loss(params, tokens)``: the mean next-token cross-entropy.

  ``tokens`` has shape ``(batch, seq_len + 1)``; position ``t`` predicts token
  ``t + 1``. The mean is over every predicted token of the batch, so with equal
  micro-batches the mean of micro-batch means is the batch mean.
  """

  def loss(params: dict[str, Any], tokens: jax.Array) -> jax.Array:
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    x = params["embed"][inputs] + params["pos"][: inputs.shape[1]]
    for layer in params["layers"]:
      x = x + _attention(_layer_norm(x, layer["ln1"]), layer, cfg.num_heads)
      h = _layer_norm(x, layer["ln2"]) @ layer["ff1"] + layer["ff1_b"]
      x = x + jax.nn.gelu(h) @ layer["ff2"] + layer["ff2_b"]
    logits = (_layer_norm(x, params["ln_f"]) @ params["unembed"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  return loss


def make_transformer(
  name: str, title: str, cfg: TransformerConfig, seed: int = 0
) -> Model:
  """A transformer model on uniformly random token sequences."""
  key_p, key_t = jax.random.split(jax.random.key(seed))
  tokens = jax.random.randint(key_t, (cfg.batch_size, cfg.seq_len + 1), 0, cfg.vocab)
  return Model(
    name, title, make_transformer_loss(cfg), transformer_init(key_p, cfg), tokens, cfg
  )


# ---------------------------------------------------------------- Llama


@dataclasses.dataclass(frozen=True)
class LlamaConfig(TransformerConfig):
  """The Llama-style decoder of ``fsdp.py`` and ``pipeline.py``: RMSNorm,
  rotary attention, SwiGLU, untied heads; float32 master weights cast to
  bfloat16 in the loss (``dtype`` is unused), the layers stacked and scanned,
  each rematerialized; ``batch_size`` is the global batch."""

  batch_size: int = 128

  def describe(self) -> dict[str, Any]:
    """The configuration as JSON-friendly numbers."""
    fields = {k: v for k, v in dataclasses.asdict(self).items() if k != "dtype"}
    return {
      "kind": "llama",
      **fields,
      "param_dtype": "float32",
      "compute_dtype": "bfloat16",
      "remat": "full (each layer: only its input is saved)",
    }


LLAMAS = {
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


@functools.cache
def llama_optimizer() -> optax.GradientTransformation:
  """``optax.adamw(3e-4, weight_decay=0.1)``: one object for every step of
  the Llama (the steps' caches key on it)."""
  return optax.adamw(3e-4, weight_decay=0.1)


def llama_shapes(cfg: LlamaConfig) -> dict[str, Any]:
  """The parameters' shapes, float32 master weights; the layers stacked."""
  d, f, n, v = cfg.d_model, cfg.d_ff, cfg.num_layers, cfg.vocab
  layers = {"attn_norm": (n, d), "wq": (n, d, d), "wk": (n, d, d), "wv": (n, d, d)}
  layers |= {"wo": (n, d, d), "mlp_norm": (n, d), "w_gate": (n, d, f)}
  layers |= {"w_up": (n, d, f), "w_down": (n, f, d)}

  def f32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)

  return {
    "embed": f32(v, d),
    "layers": {k: f32(*s) for k, s in layers.items()},
    "final_norm": f32(d),
    "unembed": f32(d, v),
  }


def rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
  """RMSNorm with float32 statistics, returned in ``x``'s dtype."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), -1, keepdims=True) + 1e-6)
  return y.astype(x.dtype) * scale


def _rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotary embedding of ``x`` (batch, seq, heads, head_dim), half-split form."""
  x1, x2 = jnp.split(x, 2, axis=-1)
  c, s = cos[:, None, :], sin[:, None, :]
  return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def llama_layer(
  cfg: LlamaConfig,
  out: Callable[[jax.Array], jax.Array] = lambda x: x,
  cast: bool = False,
) -> Callable[[jax.Array, Any], jax.Array]:
  """One decoder layer, ``layer(x, w) -> out(x)``, rematerialized with
  nothing saved but its input (MaxText's ``remat_policy: full``): attention
  with rotary embeddings, scores and softmax in float32, then the SwiGLU;
  with ``cast``, the weights cast to bfloat16 first (inside the remat)."""
  head = cfg.d_model // cfg.num_heads
  inv_freq = 1.0 / (10_000 ** (np.arange(0, head, 2, dtype=np.float32) / head))
  angles = np.arange(cfg.seq_len, dtype=np.float32)[:, None] * inv_freq[None, :]
  cos_np, sin_np = np.cos(angles), np.sin(angles)

  def layer(x, w):
    if cast:
      w = jax.tree.map(lambda a: a.astype(jnp.bfloat16), w)
    cos, sin = jnp.asarray(cos_np, x.dtype), jnp.asarray(sin_np, x.dtype)
    h = rms_norm(x, w["attn_norm"])
    b, t, _ = h.shape
    q, k, v = (
      (h @ w[n]).reshape(b, t, cfg.num_heads, head) for n in ("wq", "wk", "wv")
    )
    q, k = _rotary(q, cos, sin), _rotary(k, cos, sin)
    x = x + _causal_attention(q, k, v, jnp.float32) @ w["wo"]
    h = rms_norm(x, w["mlp_norm"])
    return out(x + (jax.nn.silu(h @ w["w_gate"]) * (h @ w["w_up"])) @ w["w_down"])

  return jax.checkpoint(
    layer, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False
  )


def llama_loss(
  cfg: LlamaConfig, batch_sharding: Any = None
) -> Callable[[PyTree, jax.Array], jax.Array]:
  """``loss(params, tokens)``: the mean next-token cross-entropy of
  ``(batch, seq_len + 1)`` tokens, the parameters cast to bfloat16 first, the
  layers under ``lax.scan``. With ``batch_sharding`` the activations are
  constrained to it after the embedding and every layer, as MaxText does, so
  that the partitioner gathers the weights where they are used and leaves the
  activations sharded by batch: ``P("data")`` under plain ``jit``; ``P()``
  inside jaxaccum, whose ``vmap`` over the devices adds the data axis."""

  def constrain(x: jax.Array) -> jax.Array:
    if batch_sharding is None:
      return x
    return jax.lax.with_sharding_constraint(x, batch_sharding)

  layer = llama_layer(cfg, constrain)

  def loss(params: PyTree, tokens: jax.Array) -> jax.Array:
    p = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    x = constrain(p["embed"][inputs])
    x, _ = jax.lax.scan(lambda x, w: (layer(x, w), None), x, p["layers"])
    logits = (rms_norm(x, p["final_norm"]) @ p["unembed"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  return loss


# ---------------------------------------------------------------- presets

#: Model sizes per preset. ``cpu`` fits the default run in a few minutes on two
#: cores; ``gpu`` sizes the compute-bound MLP and the transformer for a large
#: accelerator (the dispatch-bound MLP stays tiny on purpose).
_SMALL_MLP = MLPConfig(widths=(32, 64, 64, 10), batch_size=256)
_CPU_TRANSFORMER = TransformerConfig(
  vocab=256, d_model=64, num_heads=4, num_layers=2, d_ff=256, seq_len=32, batch_size=32
)
_GPU_TRANSFORMER = TransformerConfig(
  vocab=32768,
  d_model=1024,
  num_heads=16,
  num_layers=4,
  d_ff=4096,
  seq_len=1024,
  batch_size=64,
)
PRESETS: dict[str, dict[str, MLPConfig | TransformerConfig]] = {
  "cpu": {
    "dispatch_mlp": _SMALL_MLP,
    "compute_mlp": MLPConfig(widths=(256, 512, 512, 16), batch_size=2048),
    "transformer": _CPU_TRANSFORMER,
  },
  "cpu-quick": {
    "dispatch_mlp": dataclasses.replace(_SMALL_MLP, batch_size=128),
    "compute_mlp": MLPConfig(widths=(256, 256, 256, 16), batch_size=2048),
    "transformer": dataclasses.replace(
      _CPU_TRANSFORMER, vocab=128, num_layers=1, batch_size=16
    ),
  },
  "gpu": {
    "dispatch_mlp": _SMALL_MLP,
    "compute_mlp": MLPConfig(widths=(4096, 8192, 8192, 1024), batch_size=8192),
    "transformer": _GPU_TRANSFORMER,
  },
  "gpu-quick": {
    "dispatch_mlp": dataclasses.replace(_SMALL_MLP, batch_size=128),
    "compute_mlp": MLPConfig(widths=(4096, 8192, 8192, 1024), batch_size=4096),
    "transformer": dataclasses.replace(
      _GPU_TRANSFORMER,
      d_model=768,
      num_heads=12,
      num_layers=2,
      d_ff=3072,
      seq_len=512,
      batch_size=32,
    ),
  },
}

TITLES = {
  "dispatch_mlp": "(a) dispatch-bound MLP",
  "compute_mlp": "(b) compute-bound MLP",
  "transformer": "(c) transformer LM",
}


def build(
  name: str, preset: str, dtype: str = "float32", *, batch_scale: int = 1
) -> Model:
  """Model ``name`` at the sizes of ``preset`` (``dtype``: the transformer's;
  the MLPs stay float32), its batch ``batch_scale`` times as large."""
  config = PRESETS[preset][name]
  config = dataclasses.replace(config, batch_size=config.batch_size * batch_scale)
  if isinstance(config, TransformerConfig):
    config = dataclasses.replace(config, dtype=dtype)
    return make_transformer(name, TITLES[name], config)
  return make_mlp(name, TITLES[name], config)


def abstract(name: str, preset: str, dtype: str, batch_scale: int = 1) -> Model:
  """:func:`build`'s model as shapes only (nothing is allocated)."""
  built = []

  def make():
    built.append(build(name, preset, dtype, batch_scale=batch_scale))
    return built[0].params, built[0].batch

  params, batch = jax.eval_shape(make)
  return dataclasses.replace(built[0], params=params, batch=batch)


# ---------------------------------------------------------------- FP8 transformer


def fp8_transformer(cfg: TransformerConfig) -> tuple[PyTree, PyTree, Loss]:
  """The transformer LM with every projection an FP8 dense layer (Flax's
  ``Fp8DotGeneralOp``), in Linen: ``(variables, batch, loss)``, the first
  two as shapes. Its FP8 metadata is in ``_overwrite_with_gradient``."""
  import warnings  # noqa: PLC0415

  from flax import linen as nn  # noqa: PLC0415
  from flax.linen import fp8_ops  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  def dense(features: int) -> Any:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)
      return nn.Dense(features, dot_general_cls=fp8_ops.Fp8DotGeneralOp)

  class Lm(nn.Module):
    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
      d, h = cfg.d_model, cfg.num_heads
      table = self.param("embed", nn.initializers.normal(0.02), (cfg.vocab, d))
      spec = jax.typeof(ids).sharding.spec  # rows on an Explicit data axis
      x = table.at[ids].get(out_sharding=P(*spec, None)) if any(spec) else table[ids]
      x = x + self.param("pos", nn.initializers.normal(0.02), (ids.shape[1], d))[None]
      for _ in range(cfg.num_layers):
        b, t, _ = x.shape
        qkv = dense(3 * d)(nn.LayerNorm()(x)).reshape(b, t, 3, h, d // h)
        x = x + dense(d)(_causal_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]))
        x = x + dense(d)(jax.nn.gelu(dense(cfg.d_ff)(nn.LayerNorm()(x))))
      return dense(cfg.vocab)(nn.LayerNorm()(x)).astype(jnp.float32)

  model = Lm()

  def loss(variables: PyTree, tokens: jax.Array) -> jax.Array:
    logits = model.apply(variables, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  batch = jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len + 1), jnp.int32)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    variables = jax.eval_shape(
      model.init, jax.random.key(0), jnp.zeros((1, cfg.seq_len), jnp.int32)
    )
  return variables, batch, loss
