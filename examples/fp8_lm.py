"""FP8 training under accumulation: a character transformer with FP8 dense layers.

Run it with::

  python examples/fp8_lm.py            # about a minute on 2 CPU cores
  python examples/fp8_lm.py --help

The model is the quickstart's kind of character transformer on Python's own
documentation (``pydoc_data.topics``, nothing downloaded), written in Flax
Linen, whose every dense layer is ``nn.Dense(...,
dot_general_cls=fp8_ops.Fp8DotGeneralOp)``: inputs and kernels quantized to
E4M3, output gradients to E5M2, each with a scale computed from an amax
history. That metadata lives in Flax's ``_overwrite_with_gradient``
collection: the "gradient" JAX returns for it is its new value, which
``TrainState.apply_gradients`` writes over the old one.

What it demonstrates:

1. **The metadata is the full batch's.** Each optimizer step accumulates
   ``k = 4`` micro-batches with ``jaxaccum.value_and_grad``, and, at every
   step, the same parameters' full-batch ``jax.grad`` is computed beside it:
   every amax history and scale must equal the full batch's (relative 1e-6;
   the script raises otherwise). Summed and divided like gradients, the
   input amax would be the micro-batches' mean and the output-gradient amax
   ``k`` times too large (a scale that saturates E4M3's 448 silently).
2. **Training.** A ``TrainState`` with AdamW takes one update per batch; the
   FP8 model's loss curve is printed and plotted beside the same model's
   with plain bfloat16 dense layers, trained the same way.

On a CPU the FP8 casts are emulated (quantize, then compute in float32), so
this shows the numbers, not the speed: an H100 or a TPU runs them natively.
"""

from __future__ import annotations

from typing import Any

import _cli  # examples/_cli.py

RESULTS = "benchmarks/results/fp8_lm.json"


def parse_args(argv: list[str] | None = None) -> dict[str, Any]:
  """``main``'s keyword arguments from the command line (``sys.argv`` if None)."""
  parser = _cli.parser(__doc__)
  add = parser.add_argument
  count = _cli.positive_int
  add("--steps", type=count, default=60, metavar="N", help="optimizer steps")
  add("--batch-size", type=count, default=32, metavar="N", help="sequences per step")
  add("--seq-len", type=count, default=32, metavar="N", help="characters per sequence")
  add("--num-micro-batches", type=count, default=4, metavar="K", help="k")
  add("--width", type=count, default=64, metavar="N", help="the model's width")
  add("--layers", type=count, default=2, metavar="N", help="transformer blocks")
  add("--heads", type=count, default=4, metavar="N", help="attention heads")
  add(
    "--learning-rate",
    type=_cli.positive_float,
    default=3e-3,
    metavar="LR",
    help="AdamW's learning rate",
  )
  add(
    "--write-results",
    action="store_true",
    help=f"write the results to {RESULTS} (examples/README.md's table)",
  )
  _cli.add_run_options(
    parser,
    outputs="the loss curves, fp8_lm_loss.png",
    seed_help="seeds the initialization and the batch order",
  )
  args = parser.parse_args(argv)
  if args.batch_size % args.num_micro_batches:
    parser.error(
      f"--batch-size {args.batch_size} does not split into "
      f"--num-micro-batches {args.num_micro_batches} micro-batches"
    )
  if args.width % args.heads:
    parser.error(f"--width {args.width} does not split into --heads {args.heads}")
  return _cli.keyword_arguments(args)


if __name__ == "__main__":
  ARGS = parse_args()  # --help answers before JAX is imported

import datetime
import json
import platform
import sys
import time
import warnings
from pathlib import Path
from pydoc_data.topics import topics

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax.linen import fp8_ops
from flax.training import train_state
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from tqdm.auto import tqdm

import jaxaccum

OWG = fp8_ops.OVERWRITE_WITH_GRADIENT


def corpus(seq_len: int) -> tuple[np.ndarray, int]:
  """The documentation as ``(sequences, vocabulary size)``: consecutive
  chunks of ``seq_len + 1`` character ids (inputs and next-character
  targets)."""
  text = "".join(topics[key] for key in sorted(topics))
  chars = sorted(set(text))
  ids = np.array([chars.index(c) for c in text[:200_000]], np.int32)
  rows = len(ids) // (seq_len + 1)
  return ids[: rows * (seq_len + 1)].reshape(rows, seq_len + 1), len(chars)


class Block(nn.Module):
  """Pre-norm causal attention and an MLP, every projection ``dense``."""

  width: int
  heads: int
  fp8: bool

  def dense(self, features: int, name: str) -> nn.Dense:
    if not self.fp8:
      return nn.Dense(features, dtype=jnp.bfloat16, name=name)
    with warnings.catch_warnings():  # Fp8DotGeneralOp warns it is deprecated
      warnings.simplefilter("ignore", DeprecationWarning)
      return nn.Dense(features, dot_general_cls=fp8_ops.Fp8DotGeneralOp, name=name)

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, d = x.shape
    h = nn.LayerNorm()(x)
    qkv = self.dense(3 * d, "qkv")(h).reshape(b, t, 3, self.heads, d // self.heads)
    q, k, v = (qkv[:, :, i].astype(jnp.float32) for i in range(3))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // self.heads)
    scores = jnp.where(jnp.tril(jnp.ones((1, 1, t, t), bool)), scores, -1e9)
    att = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores), v).reshape(b, t, d)
    x = x + self.dense(d, "out")(att).astype(jnp.float32)
    h = nn.gelu(self.dense(4 * d, "up")(nn.LayerNorm()(x)))
    return x + self.dense(d, "down")(h).astype(jnp.float32)


class CharLM(nn.Module):
  vocab: int
  width: int
  layers: int
  heads: int
  fp8: bool

  @nn.compact
  def __call__(self, ids: jax.Array) -> jax.Array:
    x = nn.Embed(self.vocab, self.width)(ids)
    pos = self.param("pos", nn.initializers.normal(0.02), (ids.shape[1], self.width))
    x = x + pos[None]
    for _ in range(self.layers):
      x = Block(self.width, self.heads, self.fp8)(x)
    return nn.Dense(self.vocab)(nn.LayerNorm()(x)).astype(jnp.float32)


def loss_fn(model: CharLM):
  def loss(variables, seqs):
    logits = model.apply(variables, seqs[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, seqs[:, 1:]).mean()

  return loss


def metadata_deviation(got: Any, want: Any) -> float:
  """The largest relative difference over every FP8 variable."""
  worst = 0.0
  for a, b in zip(jax.tree.leaves(want[OWG]), jax.tree.leaves(got[OWG]), strict=True):
    scale = np.maximum(np.abs(np.asarray(a)), np.finfo(np.float32).tiny)
    worst = max(worst, float(np.max(np.abs(np.asarray(b) - np.asarray(a)) / scale)))
  return worst


def train(fp8: bool, data: np.ndarray, vocab: int, **o: Any) -> dict[str, Any]:
  """Trains one model; with ``fp8``, checks the metadata at every step."""
  model = CharLM(vocab, o["width"], o["layers"], o["heads"], fp8)
  loss = loss_fn(model)
  rng = np.random.default_rng(o["seed"])
  variables = model.init(jax.random.key(o["seed"]), data[:2, :-1])
  state = train_state.TrainState.create(
    apply_fn=model.apply, params=variables, tx=optax.adamw(o["learning_rate"])
  )
  accumulated = jaxaccum.value_and_grad(loss, o["num_micro_batches"])

  @jax.jit
  def step(state, batch):
    value, grads = accumulated(state.params, batch)
    full = jax.grad(loss)(state.params, batch) if fp8 else grads
    return state.apply_gradients(grads=grads), value, grads, full

  losses, worst = [], 0.0
  for _ in tqdm(range(o["steps"]), disable=not o["progress"], leave=False):
    batch = jnp.asarray(data[rng.choice(len(data), o["batch_size"], replace=False)])
    state, value, grads, full = step(state, batch)
    losses.append(float(value))
    if fp8:
      worst = max(worst, metadata_deviation(grads, full))
      if worst > 1e-6:
        raise AssertionError(f"FP8 metadata differs from the full batch's: {worst:.2e}")
  return {"losses": losses, "metadata_deviation": worst}


def plot(results: dict[str, Any], png: Path) -> None:
  fig = Figure(figsize=(6, 3.5), layout="constrained")
  FigureCanvasAgg(fig)
  ax = fig.add_subplot()
  for name, r in results.items():
    ax.plot(r["losses"], label=name)
  ax.set(xlabel="optimizer step", ylabel="loss (nats per character)")
  ax.legend()
  fig.savefig(png, dpi=100)


def main(
  *,
  steps: int = 60,
  batch_size: int = 32,
  seq_len: int = 32,
  num_micro_batches: int = 4,
  width: int = 64,
  layers: int = 2,
  heads: int = 4,
  learning_rate: float = 3e-3,
  out_dir: str | Path = "outputs",
  seed: int = 0,
  progress: bool = True,
  write_results: bool = False,
) -> dict[str, Any]:
  """Trains the FP8 model and the bfloat16 one; returns both results (and
  writes them to :data:`RESULTS` with ``write_results``)."""
  options = dict(locals())
  del options["write_results"]
  start = time.perf_counter()
  data, vocab = corpus(seq_len)
  print(f"{len(data):,} sequences of {seq_len + 1} characters, {vocab} symbols")
  results = {}
  for name, fp8 in (("fp8", True), ("bf16", False)):
    results[name] = train(fp8, data, vocab, **options)
  deviation = results["fp8"]["metadata_deviation"]
  print(
    f"1. FP8 metadata, jaxaccum (k={num_micro_batches}) vs. the full batch's "
    f"jax.grad, at each of {steps} steps: max relative difference {deviation:.1e}"
  )
  print(f"2. Training: {steps} steps of {batch_size} sequences, AdamW")
  for name, r in results.items():
    last = float(np.mean(r["losses"][-10:]))
    print(f"   {name:5s} loss {r['losses'][0]:.3f} -> {last:.3f} (mean of the last 10)")
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  png = out / "fp8_lm_loss.png"
  plot(results, png)
  if write_results:
    record = {
      "date": datetime.date.today().isoformat(),
      "argv": sys.argv[1:],
      "machine": platform.machine(),
      "jax": jax.__version__,
      "seconds": time.perf_counter() - start,
      "settings": {
        k: v for k, v in options.items() if k not in ("out_dir", "progress")
      },
      "metadata_deviation": deviation,
      "curves": {name: r["losses"] for name, r in results.items()},
    }
    Path(RESULTS).write_text(json.dumps(record, indent=1) + "\n")
    print(f"Results written to {RESULTS}.")
  return {**results, "png": str(png)}


if __name__ == "__main__":
  main(**ARGS)
