"""The benchmark models, in plain JAX: parameter pytrees and mean losses.

Every approach in ``step_time.py`` differentiates the very same
``loss(params, batch)``. Each loss is a per-example (or per-token) mean, so the
mean of ``k`` equal micro-batch means is the full-batch mean and every approach
must produce the same update.

Three models:

- ``dispatch_mlp`` (a): a tiny MLP on small micro-batches. A step is a few
  microseconds of arithmetic, so per-call dispatch overhead dominates.
- ``compute_mlp`` (b): a wide MLP on a large batch, so matmul FLOPs dominate.
- ``transformer`` (c): a small pre-LayerNorm causal transformer language model
  with a token-level cross-entropy mean; its dtype is configurable (bfloat16 on
  an accelerator).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

PyTree = Any
Loss = Callable[[PyTree, PyTree], jax.Array]


@dataclasses.dataclass(frozen=True)
class MLPConfig:
  """A ReLU MLP classifier trained with softmax cross-entropy.

  Attributes:
    widths: layer widths, input first and number of classes last.
    batch_size: the effective batch ``B``.
  """

  widths: tuple[int, ...]
  batch_size: int

  def describe(self) -> dict[str, Any]:
    """The configuration as JSON-friendly numbers."""
    return {"kind": "mlp", "widths": list(self.widths), "batch_size": self.batch_size}


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """A decoder-only transformer language model.

  Attributes:
    vocab: vocabulary size.
    d_model: residual width.
    num_heads: attention heads (``d_model`` divisible by it).
    num_layers: transformer blocks.
    d_ff: hidden width of the feed-forward block.
    seq_len: tokens per example that are predicted (the batch holds
      ``seq_len + 1`` tokens per row: inputs and shifted targets).
    batch_size: the effective batch ``B`` in sequences.
    dtype: the dtype of parameters and compute; the loss is taken in float32.
  """

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
  """A model ready to benchmark.

  Attributes:
    name: a short identifier, used in file names.
    title: a human-readable description.
    loss: ``loss(params, batch) -> scalar``, a per-example mean.
    params: the initial parameters.
    batch: the whole effective batch; every leaf has leading axis ``B``.
    config: the configuration, for the report.
  """

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


def _attention(x: jax.Array, layer: dict[str, jax.Array], num_heads: int) -> jax.Array:
  """Causal multi-head self-attention; softmax in float32."""
  b, t, d = x.shape
  head = d // num_heads
  q, k, v = jnp.split(x @ layer["qkv"], 3, axis=-1)
  q, k, v = (a.reshape(b, t, num_heads, head) for a in (q, k, v))
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
  scores = scores / math.sqrt(head)
  causal = jnp.tril(jnp.ones((t, t), jnp.bool_))
  scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
  out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, d)
  return out @ layer["out"]


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


# ---------------------------------------------------------------- presets

#: Model sizes per preset. ``cpu`` fits the default run in a few minutes on two
#: cores; ``gpu`` sizes the compute-bound MLP and the transformer for a large
#: accelerator (the dispatch-bound MLP stays tiny on purpose).
PRESETS: dict[str, dict[str, MLPConfig | TransformerConfig]] = {
  "cpu": {
    "dispatch_mlp": MLPConfig(widths=(32, 64, 64, 10), batch_size=256),
    "compute_mlp": MLPConfig(widths=(256, 512, 512, 16), batch_size=2048),
    "transformer": TransformerConfig(
      vocab=256,
      d_model=64,
      num_heads=4,
      num_layers=2,
      d_ff=256,
      seq_len=32,
      batch_size=32,
    ),
  },
  "cpu-quick": {
    "dispatch_mlp": MLPConfig(widths=(32, 64, 64, 10), batch_size=128),
    "compute_mlp": MLPConfig(widths=(256, 256, 256, 16), batch_size=2048),
    "transformer": TransformerConfig(
      vocab=128,
      d_model=64,
      num_heads=4,
      num_layers=1,
      d_ff=256,
      seq_len=32,
      batch_size=16,
    ),
  },
  "gpu": {
    "dispatch_mlp": MLPConfig(widths=(32, 64, 64, 10), batch_size=256),
    "compute_mlp": MLPConfig(widths=(4096, 8192, 8192, 1024), batch_size=8192),
    "transformer": TransformerConfig(
      vocab=32768,
      d_model=1024,
      num_heads=16,
      num_layers=4,
      d_ff=4096,
      seq_len=1024,
      batch_size=64,
    ),
  },
  "gpu-quick": {
    "dispatch_mlp": MLPConfig(widths=(32, 64, 64, 10), batch_size=128),
    "compute_mlp": MLPConfig(widths=(4096, 8192, 8192, 1024), batch_size=4096),
    "transformer": TransformerConfig(
      vocab=32768,
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
  name: str,
  preset: str,
  dtype: str = "float32",
  widths: tuple[int, ...] | None = None,
) -> Model:
  """Builds model ``name`` at the sizes of ``preset``.

  Args:
    name: ``dispatch_mlp``, ``compute_mlp`` or ``transformer``.
    preset: a key of ``PRESETS``.
    dtype: the transformer's parameter and compute dtype (the MLPs stay
      float32).
    widths: an MLP's layer widths in place of the preset's (its batch size
      stays the preset's).
  """
  config = PRESETS[preset][name]
  if isinstance(config, TransformerConfig):
    config = dataclasses.replace(config, dtype=dtype)
    return make_transformer(name, TITLES[name], config)
  if widths is not None:
    config = dataclasses.replace(config, widths=widths)
  return make_mlp(name, TITLES[name], config)
