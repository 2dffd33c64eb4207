"""jaxaccum quickstart: a character-level transformer on Python's own documentation.

Run it with::

  pip install -e ".[examples]"
  python examples/quickstart.py           # 1-2 minutes on 2 CPU cores
  python examples/quickstart.py --help    # a few knobs: steps, batch, model size

What it demonstrates, in order:

1. **Exact token means over padded micro-batches.** The training text is cut into
   sequences that hold different numbers of real characters, right-padded to one
   length. The loss returns ``(loss_sum, token_count)`` and is accumulated with
   ``jaxaccum.nnx.value_and_grad(loss_fn, 8, normalize="weighted")``: the value and
   gradient are ``sum(loss) / sum(tokens)`` over the *whole* batch. Before training,
   the script checks this against ``nnx.value_and_grad`` on the full batch (dropout
   off) and raises if they differ by more than float32 rounding. For contrast it
   prints how far the naive "mean of per-micro-batch means" is from the full batch,
   on the same batch and on its rows sorted by length (as a length-bucketing loader
   groups them). The check runs again after training.
2. **Less memory for the same step.** XLA's compile-time peak memory of one
   accumulated training step next to the full-batch step: same model, same batch.
3. **Training with dropout.** ``nnx.Dropout`` draws its masks from an RNG stream
   inside the model; jaxaccum threads the stream through the micro-batches, so
   each one gets its own mask. An ``nnx.Optimizer`` (AdamW, warmup + cosine decay)
   takes one update per batch inside an ``@nnx.jit`` step.
4. **Results.** The loss curve is saved as a PNG, real tokens per second are
   measured after compilation, and the model writes a short text sample. After
   the default 500 steps (about two passes over the text) the loss is near 2.2
   nats per character and the sample is character soup with some real words
   ("the", "of", "and", "code") and bits of Python-doc markup such as
   ``"__()"``, not sentences: expect that from a 0.4M-parameter model trained
   for a minute or two on a CPU.

The data is ``pydoc_data.topics``, which ships with CPython: the topics of the
Python reference (79 documents, about 465k characters, in CPython 3.11).
Nothing is downloaded.
"""

from __future__ import annotations

from typing import Any

import _cli  # examples/_cli.py


def parse_args(argv: list[str] | None = None) -> dict[str, Any]:
  """``main``'s keyword arguments from the command line (``sys.argv`` if None)."""
  parser = _cli.parser(__doc__)
  add = parser.add_argument
  count, rate = _cli.positive_int, _cli.positive_float
  add("--steps", type=count, default=500, metavar="N", help="optimizer steps")
  add(
    "--batch-size",
    type=count,
    default=32,
    metavar="N",
    help="sequences per optimizer step (the full batch)",
  )
  add(
    "--seq-len",
    type=count,
    default=64,
    metavar="N",
    help="characters per sequence, the model's context",
  )
  add(
    "--num-micro-batches",
    type=count,
    default=8,
    metavar="K",
    help="micro-batches per optimizer step; must divide the batch size",
  )
  add("--width", type=count, default=128, metavar="N", help="the model's width")
  add("--layers", type=count, default=2, metavar="N", help="transformer blocks")
  add(
    "--heads",
    type=count,
    default=4,
    metavar="N",
    help="attention heads; must divide the width",
  )
  add(
    "--dropout",
    type=_cli.probability,
    default=0.1,
    metavar="P",
    help="dropout rate while training",
  )
  add(
    "--learning-rate",
    type=rate,
    default=3e-3,
    metavar="LR",
    help="AdamW's peak learning rate (warmup, then cosine decay)",
  )
  add(
    "--sample-length",
    type=_cli.non_negative_int,
    default=200,
    metavar="N",
    help="characters to generate after training",
  )
  _cli.add_run_options(
    parser,
    outputs="the loss curve, quickstart_loss.png",
    seed_help="seeds the initialization, dropout and batch order",
  )
  args = parser.parse_args(argv)
  if args.batch_size % args.num_micro_batches:
    parser.error(
      f"--batch-size {args.batch_size} does not split into "
      f"--num-micro-batches {args.num_micro_batches} equal micro-batches"
    )
  if args.width % args.heads:
    parser.error(f"--width {args.width} does not split into --heads {args.heads}")
  return _cli.keyword_arguments(args)


if __name__ == "__main__":
  # First thing: --help and a bad flag answer before JAX is imported (seconds).
  ARGS = parse_args()

import math
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from pydoc_data.topics import topics

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

import jaxaccum

matplotlib.use("Agg")  # write files, never open a window
import matplotlib.pyplot as plt

PAD = 0  # the padding id; characters are numbered from 1


# -----------------------------------------------------------------------------
# Data: paragraphs of the Python documentation, as padded character sequences
# -----------------------------------------------------------------------------

RULE = re.compile(r"[-=*~^+| ]{3,}")  # a line of reST markup: "-----", "+---+"


def prose(paragraph: str) -> str:
  """A paragraph as plain text: no indentation, no runs of spaces, no reST rules.

  reST rules are heading underlines and table borders. Every line of the
  result ends with a newline; a paragraph of rules alone becomes "".
  """
  lines = (" ".join(line.split()) for line in paragraph.split("\n"))
  return "".join(line + "\n" for line in lines if line and not RULE.fullmatch(line))


class CharData:
  """The corpus as right-padded id sequences, with a mask of real targets.

  Every paragraph (text between blank lines) of every document, cleaned by
  :func:`prose`, is cut into chunks of at most ``seq_len + 1`` characters. A
  paragraph's last chunk is shorter, and many paragraphs are short to begin
  with (headings, list items, code lines). So sequences hold genuinely different numbers of real tokens, and so do the
  micro-batches built from them.

  Attributes:
    chars: the vocabulary; character ``chars[i]`` has id ``i + 1``.
    ids: shape=(num_sequences, seq_len + 1), int32; ``PAD`` after the text.
    lengths: shape=(num_sequences,), int32; real characters per sequence.
    num_documents, num_characters: the size of the corpus.
  """

  def __init__(self, seq_len: int):
    documents = [topics[key] for key in sorted(topics)]
    self.num_documents = len(documents)
    self.num_characters = sum(len(doc) for doc in documents)
    self.chars = sorted(set("".join(documents)))
    self._char_to_id = {c: i + 1 for i, c in enumerate(self.chars)}

    chunks = []
    for doc in documents:
      for block in doc.split("\n\n"):
        paragraph = prose(block)
        # Consecutive chunks overlap by one character: the last target of one
        # chunk is the first input of the next, so every character is predicted.
        # Every chunk has at least 2 characters: one input, one target.
        for start in range(0, len(paragraph) - 1, seq_len):
          chunks.append(paragraph[start : start + seq_len + 1])

    self.lengths = np.array([len(c) for c in chunks], np.int32)
    self.ids = np.full((len(chunks), seq_len + 1), PAD, np.int32)
    for row, chunk in enumerate(chunks):
      self.ids[row, : len(chunk)] = self.encode(chunk)

  @property
  def vocab_size(self) -> int:
    return len(self.chars) + 1  # + PAD

  def encode(self, text: str) -> list[int]:
    return [self._char_to_id[c] for c in text]

  def decode(self, ids) -> str:
    return "".join(self.chars[i - 1] for i in ids if i != PAD)

  def batches(self, batch_size: int, seed: int):
    """Yields shuffled batches forever: dicts of numpy arrays.

    ``inputs`` and ``targets`` are the sequences shifted by one; ``mask`` is
    True where the target is a real character.
    """
    rng = np.random.default_rng(seed)
    while True:
      order = rng.permutation(len(self.ids))
      for first in range(0, len(order) - batch_size + 1, batch_size):
        ids = self.ids[order[first : first + batch_size]]
        yield {"inputs": ids[:, :-1], "targets": ids[:, 1:], "mask": ids[:, 1:] != PAD}


# -----------------------------------------------------------------------------
# Model: a small decoder-only transformer in Flax NNX
# -----------------------------------------------------------------------------


class CausalSelfAttention(nnx.Module):
  """Multi-head self-attention in which position t only sees positions <= t.

  With right padding, the causal mask is also the padding mask: a real token
  never attends to the pads that come after it.
  """

  def __init__(self, width: int, heads: int, *, rngs: nnx.Rngs):
    self.heads = heads
    self.qkv = nnx.Linear(width, 3 * width, rngs=rngs)
    self.out = nnx.Linear(width, width, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    batch, length, width = x.shape
    qkv = self.qkv(x).reshape(batch, length, 3, self.heads, width // self.heads)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # (batch, length, heads, dim)
    y = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return self.out(y.reshape(batch, length, width))


class Block(nnx.Module):
  """A pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

  def __init__(self, width: int, heads: int, dropout: float, *, rngs: nnx.Rngs):
    self.attn_norm = nnx.LayerNorm(width, rngs=rngs)
    self.attn = CausalSelfAttention(width, heads, rngs=rngs)
    self.mlp_norm = nnx.LayerNorm(width, rngs=rngs)
    self.mlp_in = nnx.Linear(width, 4 * width, rngs=rngs)
    self.mlp_out = nnx.Linear(4 * width, width, rngs=rngs)
    # The Dropout keeps its own RNG stream (the "dropout" stream of `rngs`).
    # Every call draws a new key from it; jaxaccum.nnx threads the stream
    # through the micro-batches, so each micro-batch gets its own mask.
    self.dropout = nnx.Dropout(dropout, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.dropout(self.attn(self.attn_norm(x)))
    h = nnx.gelu(self.mlp_in(self.mlp_norm(x)))
    return x + self.dropout(self.mlp_out(h))


class CharTransformer(nnx.Module):
  """Token + learned position embeddings, blocks, and a tied output head."""

  def __init__(
    self,
    vocab_size: int,
    seq_len: int,
    *,
    width: int,
    layers: int,
    heads: int,
    dropout: float,
    rngs: nnx.Rngs,
  ):
    small = nnx.initializers.normal(0.02)  # GPT-2's embedding initialization
    self.token_embed = nnx.Embed(vocab_size, width, embedding_init=small, rngs=rngs)
    self.pos_embed = nnx.Embed(seq_len, width, embedding_init=small, rngs=rngs)
    self.embed_dropout = nnx.Dropout(dropout, rngs=rngs)
    self.blocks = nnx.List(
      [Block(width, heads, dropout, rngs=rngs) for _ in range(layers)]
    )
    self.final_norm = nnx.LayerNorm(width, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """Logits, shape=(batch, length, vocab_size), for tokens (batch, length)."""
    positions = jnp.arange(tokens.shape[1])
    x = self.token_embed(tokens) + self.pos_embed(positions)[None]
    x = self.embed_dropout(x)
    for block in self.blocks:
      x = block(x)
    # The output head reuses the token embedding matrix ("tied" weights).
    return self.token_embed.attend(self.final_norm(x))


# -----------------------------------------------------------------------------
# Losses and training steps
# -----------------------------------------------------------------------------


def loss_fn(model: CharTransformer, batch: dict[str, jax.Array]):
  """The summed loss of the real target tokens, and how many there are.

  This is the pair ``normalize="weighted"`` expects: jaxaccum adds both up over
  the micro-batches and divides once, giving the exact token mean of the batch.
  """
  logits = model(batch["inputs"])
  token_loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  real = batch["mask"]
  # Select, never multiply: a NaN in a padded position must not leak through.
  loss_sum = jnp.sum(jnp.where(real, token_loss, 0.0))
  return loss_sum, jnp.sum(real, dtype=jnp.float32)


def token_mean(model: CharTransformer, batch: dict[str, jax.Array]):
  """The token mean of ``batch``: the loss to use without jaxaccum.

  On the whole batch it is the reference (and jaxaccum's default reads it,
  unchanged, as the ratio of two sums: exact). Taken per micro-batch and
  averaged, as optax.MultiSteps or a hand-written loop would, it is the
  naive "mean of micro-batch means", which weighs a token in a short
  micro-batch more than one in a long micro-batch.
  """
  loss_sum, count = loss_fn(model, batch)
  return loss_sum / count


def make_train_steps(num_micro_batches: int):
  """The accumulated training step and, for comparison, the full-batch one."""
  accumulated_grad = jaxaccum.nnx.value_and_grad(
    loss_fn, num_micro_batches, normalize="weighted"
  )

  def accumulated_step(model, optimizer, batch):
    # k forward/backward passes inside one lax.scan, then ONE optimizer update.
    loss, grads = accumulated_grad(model, batch)
    optimizer.update(model, grads)
    return loss

  def full_batch_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(token_mean)(model, batch)
    optimizer.update(model, grads)
    return loss

  return accumulated_step, full_batch_step


# -----------------------------------------------------------------------------
# The check: jaxaccum vs. the full batch (and vs. the naive mean of means)
# -----------------------------------------------------------------------------


def make_comparison(num_micro_batches: int, rtol: float = 1e-5):
  """Returns ``compare(model, batch)``: jaxaccum vs. the full batch, on one batch.

  ``compare`` computes the value and gradients three ways, with dropout off
  (``model.eval()``; with dropout on, the three would draw different masks):

  - jaxaccum, ``normalize="weighted"`` over ``num_micro_batches``;
  - the reference: ``nnx.value_and_grad`` of the token mean of the whole batch;
  - the naive mean of micro-batch means (each micro-batch's token mean at
    weight 1, ``normalize="weighted"``).

  It raises if jaxaccum differs from the reference by more than float32
  rounding, ``rtol`` of each leaf's largest magnitude. It returns a dict:
  ``max_deviation`` (the largest absolute difference over the value and every
  gradient entry), ``max_relative_deviation`` (the same, each leaf divided by
  its largest magnitude), ``naive_loss_error`` (relative) and
  ``naive_grad_error`` (relative L2 norm) of the naive mean of means.
  """
  accumulated = jaxaccum.nnx.value_and_grad(
    loss_fn, num_micro_batches, normalize="weighted"
  )
  naive = jaxaccum.nnx.value_and_grad(
    lambda model, batch: (token_mean(model, batch), 1.0),
    num_micro_batches,
    normalize="weighted",
  )
  full = nnx.value_and_grad(token_mean)

  @nnx.jit  # one compiled function for all three: compiling is the slow part
  def three_ways(model, batch):
    return accumulated(model, batch), naive(model, batch), full(model, batch)

  def lower(model, batch):
    """The check's program, traced and lowered as ``compare`` calls it."""
    model.eval()
    try:
      return three_ways.lower(model, batch)
    finally:
      model.train()

  def compare(model, batch):
    model.eval()
    outputs = three_ways(model, batch)
    model.train()
    (value, grads), (naive_value, naive_grads), (ref_value, ref_grads) = outputs

    leaves = jax.tree_util.tree_leaves_with_path(grads)
    ref_leaves = jax.tree_util.tree_leaves_with_path(ref_grads)
    rows = [("loss", value, ref_value)]
    for (path, leaf), (ref_path, ref_leaf) in zip(leaves, ref_leaves, strict=True):
      assert path == ref_path, (path, ref_path)
      rows.append(("grads" + jax.tree_util.keystr(path), leaf, ref_leaf))

    max_abs, max_rel, worst = 0.0, 0.0, ""
    for name, leaf, ref_leaf in rows:
      got, want = np.asarray(leaf, np.float64), np.asarray(ref_leaf, np.float64)
      deviation = float(np.max(np.abs(got - want)))
      relative = deviation / (float(np.max(np.abs(want))) + 1e-30)
      max_abs = max(max_abs, deviation)
      if relative > max_rel:
        max_rel, worst = relative, name
    if max_rel > rtol:
      raise AssertionError(
        f"Accumulated and full-batch {worst} differ: relative deviation "
        f"{max_rel:.2e} is more than float32 rounding ({rtol:.0e})."
      )

    def flat(tree):
      return np.concatenate([np.ravel(leaf) for leaf in jax.tree.leaves(tree)])

    g, g_naive = flat(ref_grads), flat(naive_grads)
    return {
      "max_deviation": max_abs,
      "max_relative_deviation": max_rel,
      "tolerance": rtol,
      "loss": float(ref_value),
      "naive_loss": float(naive_value),
      "naive_loss_error": abs(float(naive_value - ref_value)) / float(ref_value),
      "naive_grad_error": float(np.linalg.norm(g_naive - g) / np.linalg.norm(g)),
    }

  compare.lower = lower
  return compare


def compile_side_by_side(*lowered) -> None:
  """Compiles lowered programs at once, one thread each: XLA compiles a
  program on one core, so two cores compile two at a time. JAX keeps what
  it compiled, and the first call of each program finds it there."""
  with ThreadPoolExecutor(len(lowered)) as pool:
    list(pool.map(lambda program: program.compile(), lowered))


def by_length(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """The same rows, shortest first, as a length-bucketing data loader groups them.

  Micro-batch ``i`` then holds the ``i``-th group of lengths, so the
  micro-batches' token counts differ a lot; the full-batch token mean is the
  same as for the shuffled rows.
  """
  order = np.argsort(batch["mask"].sum(axis=1), kind="stable")
  return {name: rows[order] for name, rows in batch.items()}


def tokens_per_micro_batch(batch: dict[str, np.ndarray], k: int) -> list[int]:
  return batch["mask"].reshape(k, -1).sum(axis=1).tolist()


def print_comparison(results: dict[str, dict[str, float]]) -> None:
  """One row per check: jaxaccum's deviation, and the naive mean's error."""
  print(f"   {'':27}{'jaxaccum: max |diff|':>21}{'naive mean of means':>28}")
  print(f"   {'':27}{'absolute  relative':>21}{'loss off  gradient off':>28}")
  for name, r in results.items():
    print(
      f"   {name:27}{r['max_deviation']:>11.1e}{r['max_relative_deviation']:>10.1e}"
      f"{100 * r['naive_loss_error']:>13.2f}%{100 * r['naive_grad_error']:>13.1f}%"
    )


# -----------------------------------------------------------------------------
# Text sampling and the loss curve
# -----------------------------------------------------------------------------


def generate(
  model: CharTransformer,
  data: CharData,
  prompt: str,
  *,
  length: int,
  seq_len: int,
  temperature: float = 0.6,
  seed: int = 0,
) -> str:
  """``prompt`` and ``length`` characters sampled after it, dropout off."""
  model.eval()
  # The model as a graph and its arrays: a plain jax.jit of the arrays
  # dispatches one character in microseconds (nnx.jit would walk the model
  # at every call).
  graphdef, state = nnx.split(model)
  model.train()

  @jax.jit
  def next_token(state, window, position, key):
    model = nnx.merge(graphdef, state)
    logits = model(window)[0, position]  # the logits after the last real token
    logits = jnp.where(jnp.arange(logits.shape[0]) == PAD, -jnp.inf, logits)
    return jax.random.categorical(key, logits / temperature)

  ids = data.encode(prompt)
  key = jax.random.key(seed)
  for _ in range(length):
    context = ids[-seq_len:]  # a sliding window of the last seq_len characters
    window = np.asarray([context + [PAD] * (seq_len - len(context))], np.int32)
    key, sample_key = jax.random.split(key)
    ids.append(int(next_token(state, window, len(context) - 1, sample_key)))
  return data.decode(ids)


def save_loss_curve(
  losses: list[float], vocab_size: int, num_micro_batches: int, path: Path
) -> None:
  """The per-step training loss, a moving average, and the uniform-guess level."""
  steps = np.arange(1, len(losses) + 1)
  window = max(1, len(losses) // 20)
  smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
  fig, ax = plt.subplots(figsize=(7, 4))
  ax.plot(steps, losses, color="tab:blue", alpha=0.35, label="loss per step")
  centered = steps[(window - 1) // 2 : len(steps) - window // 2]
  ax.plot(centered, smooth, color="tab:blue", label="moving average")
  ax.axhline(math.log(vocab_size), color="gray", ls="--", label="uniform guess")
  ax.set(xlabel="optimizer step", ylabel="token mean cross-entropy (nats)")
  ax.set_title(
    "Character-level transformer on pydoc_data.topics "
    f"(jaxaccum, k={num_micro_batches})"
  )
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


# -----------------------------------------------------------------------------
# main: check, measure, train, sample
# -----------------------------------------------------------------------------


def main(
  *,
  steps: int = 500,
  batch_size: int = 32,
  seq_len: int = 64,
  num_micro_batches: int = 8,
  width: int = 128,
  layers: int = 2,
  heads: int = 4,
  dropout: float = 0.1,
  learning_rate: float = 3e-3,
  sample_length: int = 200,
  out_dir: str | Path = "outputs",
  seed: int = 0,
  progress: bool = True,
) -> dict[str, Any]:
  """Checks, measures and trains; returns the results as a dict.

  The dict holds ``losses`` (one per step), ``first_loss``, ``final_loss``
  (the mean of the last tenth of the steps), ``tokens_per_second`` (real
  tokens per wall-clock second, after compilation), ``peak_bytes_accumulated``
  and ``peak_bytes_full_batch`` (XLA's peak of one training step),
  ``max_deviation`` and ``max_relative_deviation`` (jaxaccum vs. the full
  batch, over every check), ``comparisons`` (every check's numbers),
  ``sample`` (generated text) and ``png`` (the loss curve's path).
  """
  if batch_size % num_micro_batches:
    raise ValueError(f"{batch_size=} is not divisible by {num_micro_batches=}")
  k, micro = num_micro_batches, batch_size // num_micro_batches
  out_dir = Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)

  data = CharData(seq_len)
  real = data.lengths - 1
  print("jaxaccum quickstart: a character-level transformer on Python's docs\n")
  print(
    f"data   {data.num_documents} documents of pydoc_data.topics, "
    f"{data.num_characters:,} characters, vocabulary {data.vocab_size}\n"
    f"       {len(data.ids):,} sequences padded to {seq_len}; real tokens per "
    f"sequence: min {real.min()}, median {int(np.median(real))}, max {real.max()}"
  )

  model = CharTransformer(
    data.vocab_size,
    seq_len,
    width=width,
    layers=layers,
    heads=heads,
    dropout=dropout,
    rngs=nnx.Rngs(params=seed, dropout=seed + 1),
  )
  num_params = sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
  schedule = optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=learning_rate,
    warmup_steps=max(1, steps // 10),
    decay_steps=steps,
    end_value=learning_rate / 10,
  )
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  print(
    f"model  {layers} pre-LN block{'s' * (layers != 1)}, width {width}, {heads} heads, "
    f"{num_params / 1e6:.2f}M parameters, dropout {dropout}"
  )

  batches = data.batches(batch_size, seed)
  batch = next(batches)
  print(
    f"batch  {batch_size} sequences = {k} micro-batches of {micro}; real tokens "
    f"per micro-batch:\n       {tokens_per_micro_batch(batch, k)} (shuffled), "
    f"{tokens_per_micro_batch(by_length(batch), k)} (by length)"
  )

  # Three programs to compile before training: the check's (1.) and one
  # training step each way (2.; the accumulated one is also the training
  # loop's). Traced here, they compile side by side, one per core; the calls
  # below then find them compiled.
  compare = make_comparison(k)
  accumulated_step, full_batch_step = make_train_steps(k)
  train_step, full_step = nnx.jit(accumulated_step), nnx.jit(full_batch_step)
  compile_side_by_side(
    compare.lower(model, batch),
    train_step.lower(model, optimizer, batch),
    full_step.lower(model, optimizer, batch),
  )

  # 1. One batch: jaxaccum vs. the full batch, with dropout off.
  # Raises if jaxaccum's value or any gradient entry is off by more than float32
  # rounding. The naive mean of micro-batch means is shown for contrast.
  check_batches = {"shuffled rows": batch, "rows by length": by_length(batch)}
  comparisons = {
    f"{name}, untrained": compare(model, rows) for name, rows in check_batches.items()
  }
  print(f"\n1. One batch, jaxaccum (k={k}, weighted) vs. the full batch, dropout off")
  print_comparison(comparisons)

  # 2. Compile-time memory: same model, same batch, one training step each.
  # `compiled_memory` lowers and compiles the step (here: finds it compiled),
  # and asks XLA for its buffer assignment; nothing runs.
  peak_accumulated = jaxaccum.compiled_memory(
    train_step, model, optimizer, batch
  ).peak_bytes
  peak_full = jaxaccum.compiled_memory(full_step, model, optimizer, batch).peak_bytes
  print("\n2. XLA peak memory of one training step (compiled, not run)")
  print(f"   full batch of {batch_size}{'':21}{peak_full / 2**20:>6.1f} MiB")
  print(
    f"   jaxaccum, {k} micro-batches of {micro}{'':7}"
    f"{peak_accumulated / 2**20:>6.1f} MiB  ({peak_full / peak_accumulated:.1f}x less)"
  )

  # 3. Training, with dropout on.
  print(f"\n3. Training: {steps} steps of {batch_size} sequences, AdamW, dropout on")
  losses = []
  start, timed_tokens = 0.0, 0
  # The step with its model and optimizer bound: nnx.cached_partial walks
  # their graph once, not at every call (milliseconds a step).
  bound_step = nnx.cached_partial(train_step, model, optimizer)
  bar = tqdm(range(steps), disable=not progress, ncols=80, desc="   train")
  for step in bar:
    loss = bound_step(batch)
    losses.append(loss)  # a device array: no sync, the next step is queued
    if step == 0:  # the first call compiles; time the steps after it
      jax.block_until_ready(loss)
      start = time.perf_counter()
    else:
      timed_tokens += int(batch["mask"].sum())
    if step % 10 == 0 or step == steps - 1:
      bar.set_postfix(loss=f"{float(loss):.3f}")
    batch = next(batches)
  jax.block_until_ready(losses[-1])
  elapsed = time.perf_counter() - start
  bar.close()
  tokens_per_second = timed_tokens / elapsed if steps > 1 else float("nan")

  losses = [float(loss) for loss in losses]
  tail = max(1, steps // 10)
  final_loss = float(np.mean(losses[-tail:]))
  png = out_dir / "quickstart_loss.png"
  save_loss_curve(losses, data.vocab_size, k, png)
  print(
    f"   loss {losses[0]:.3f} -> {final_loss:.3f} (mean of the last {tail} steps; "
    f"a uniform guess is ln {data.vocab_size} = {math.log(data.vocab_size):.3f})"
  )
  print(f"   {tokens_per_second:,.0f} real tokens/s (after compilation)")
  print(f"   loss curve: {png}")

  # The same check on the trained model. Per-token losses now differ (a
  # character late in a sequence has more context than an early one), so the
  # naive mean of means drifts further from the true token mean.
  trained = {
    f"{name}, trained": compare(model, rows) for name, rows in check_batches.items()
  }
  comparisons.update(trained)
  print("\n   The first batch again, after training:")
  print_comparison(trained)

  # 4. What did it learn?
  sample = generate(
    model, data, "The ", length=sample_length, seq_len=seq_len, seed=seed
  )
  print("\n4. Sample (temperature 0.6, prompt 'The ')")
  print(
    f"   After {steps} steps expect character soup with some real words, not "
    "sentences: the model is small and has seen the text about twice.\n"
    if steps >= 500
    else f"   After only {steps} steps expect mostly noise (the default 500 "
    "give character soup with some real words).\n"
  )
  print("   " + sample.replace("\n", "\n   "))

  return {
    "losses": losses,
    "first_loss": losses[0],
    "final_loss": final_loss,
    "tokens_per_second": tokens_per_second,
    "peak_bytes_accumulated": peak_accumulated,
    "peak_bytes_full_batch": peak_full,
    "max_deviation": max(c["max_deviation"] for c in comparisons.values()),
    "max_relative_deviation": max(
      c["max_relative_deviation"] for c in comparisons.values()
    ),
    "comparisons": comparisons,
    "num_parameters": int(num_params),
    "sample": sample,
    "png": str(png),
  }


if __name__ == "__main__":
  main(**ARGS)
