"""Pipeline parallelism: the quickstart's character transformer in 4 stages.

Run it with::

  pip install -e ".[examples]"
  python examples/pipeline.py              # about a minute on 2 CPU cores
  python examples/pipeline.py --help

The transformer blocks are stacked (``nnx.vmap``) and run by
``jaxaccum.pipeline`` on a mesh axis ``"stage"`` of 4 CPU devices: each
device holds one stage's blocks, the batch flows through the stages in
pipeline micro-batches, and the activations move between stages by
collective-permutes. The embedding and the tied output head run outside the
pipeline, on the whole batch. The same model, from the same initialization,
is trained side by side without the pipeline (a ``lax.scan`` over the
blocks on one device), and every logged step prints both losses: they agree
to float32 rounding, step after step.

It prints the schedule (the loop's iterations and the bubble, the fraction
of them in which a stage idles) and the collectives of the compiled step,
read from its HLO, and it saves both loss curves. Data: ``pydoc_data.topics``
(the quickstart's ``CharData``); nothing is downloaded.
"""

from __future__ import annotations

from typing import Any

import _cli  # examples/_cli.py


def parse_args(argv: list[str] | None = None) -> dict[str, Any]:
  """``main``'s keyword arguments from the command line (``sys.argv`` if None)."""
  parser = _cli.parser(__doc__)
  add = parser.add_argument
  count = _cli.positive_int
  add("--steps", type=count, default=200, metavar="N", help="optimizer steps")
  add("--batch-size", type=count, default=16, metavar="N", help="sequences per step")
  add("--seq-len", type=count, default=64, metavar="N", help="characters per sequence")
  add("--stages", type=count, default=4, metavar="S", help="pipeline stages (devices)")
  add(
    "--num-micro-batches",
    type=count,
    default=4,
    metavar="M",
    help="pipeline micro-batches; must divide the batch size",
  )
  add(
    "--repeats",
    type=count,
    default=1,
    metavar="R",
    help="circular repeats: each micro-batch passes the stages R times",
  )
  add("--layers", type=count, default=4, metavar="L", help="transformer blocks")
  add("--width", type=count, default=32, metavar="N", help="the model's width")
  add("--heads", type=count, default=4, metavar="N", help="attention heads")
  add(
    "--learning-rate",
    type=_cli.positive_float,
    default=3e-3,
    metavar="LR",
    help="AdamW's learning rate",
  )
  add(
    "--log-every", type=count, default=20, metavar="N", help="steps between log lines"
  )
  _cli.add_run_options(
    parser,
    outputs="the loss curves, pipeline_loss.png",
    seed_help="seeds the initialization and the batch order",
  )
  args = parser.parse_args(argv)
  if args.batch_size % args.num_micro_batches:
    parser.error(
      f"--batch-size {args.batch_size} does not split into --num-micro-batches "
      f"{args.num_micro_batches} equal micro-batches"
    )
  if args.layers % (args.stages * args.repeats):
    parser.error(
      f"--layers {args.layers} do not split into --stages {args.stages} x "
      f"--repeats {args.repeats} equal groups"
    )
  if args.width % args.heads:
    parser.error(f"--width {args.width} does not split into --heads {args.heads}")
  return _cli.keyword_arguments(args)


if __name__ == "__main__":
  # First thing: --help and a bad flag answer before JAX is imported (seconds).
  ARGS = parse_args()
  from jaxaccum.testing import cpu_devices

  cpu_devices(ARGS["stages"])  # before JAX starts: one CPU device per stage

import time
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from quickstart import CausalSelfAttention, CharData  # examples/quickstart.py
from tqdm.auto import tqdm

import jaxaccum
from jaxaccum import testing

matplotlib.use("Agg")  # write files, never open a window
import matplotlib.pyplot as plt

# -----------------------------------------------------------------------------
# The model: the quickstart's transformer, its blocks stacked
# -----------------------------------------------------------------------------


class Block(nnx.Module):
  """A pre-LayerNorm block: x + attn(ln(x)), then x + mlp(ln(x)), no dropout
  (the unpipelined twin must draw the same masks to compare)."""

  def __init__(self, width: int, heads: int, *, rngs: nnx.Rngs):
    self.attn_norm = nnx.LayerNorm(width, rngs=rngs)
    self.attn = CausalSelfAttention(width, heads, rngs=rngs)
    self.mlp_norm = nnx.LayerNorm(width, rngs=rngs)
    self.mlp_in = nnx.Linear(width, 4 * width, rngs=rngs)
    self.mlp_out = nnx.Linear(4 * width, width, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.attn_norm(x))
    return x + self.mlp_out(nnx.gelu(self.mlp_in(self.mlp_norm(x))))


class StackedCharTransformer(nnx.Module):
  """Token and position embeddings, ``layers`` blocks stacked on a leading
  axis (one ``nnx.vmap`` over their initialization), a tied output head."""

  def __init__(
    self,
    vocab: int,
    seq_len: int,
    *,
    width: int,
    heads: int,
    layers: int,
    rngs: nnx.Rngs,
  ):
    small = nnx.initializers.normal(0.02)
    self.token_embed = nnx.Embed(vocab, width, embedding_init=small, rngs=rngs)
    self.pos_embed = nnx.Embed(seq_len, width, embedding_init=small, rngs=rngs)

    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def blocks(rngs: nnx.Rngs) -> Block:
      return Block(width, heads, rngs=rngs)

    self.blocks = blocks(rngs)
    self.final_norm = nnx.LayerNorm(width, rngs=rngs)

  def __call__(self, tokens: jax.Array, run_blocks: Any) -> jax.Array:
    """Logits; ``run_blocks(layer_fn, stacked, x)`` runs the stacked blocks."""
    positions = jnp.arange(tokens.shape[1])
    x = self.token_embed(tokens) + self.pos_embed(positions)[None]
    graphdef, stacked = nnx.split(self.blocks)
    x = run_blocks(lambda state, h: nnx.merge(graphdef, state)(h), stacked, x)
    return self.token_embed.attend(self.final_norm(x))


def scanned(layer_fn, stacked, x):
  """The blocks one after the other on one device: a ``lax.scan``."""
  return jax.lax.scan(lambda h, w: (layer_fn(w, h), None), x, stacked)[0]


def pipelined(stages: int, micro_batches: int, repeats: int):
  """The blocks in ``stages`` stages: ``jaxaccum.pipeline``. With repeats, the
  stacked leaves are ``(repeats, L // repeats, ...)``: row i holds the
  blocks of repeat i, and the stages split the second axis."""

  def run(layer_fn, stacked, x):
    pipe = jaxaccum.pipeline(
      layer_fn, num_stages=stages, num_micro_batches=micro_batches, repeats=repeats
    )
    return pipe(by_repeat(stacked, repeats), x)

  return run


def by_repeat(stacked, repeats):
  if repeats == 1:
    return stacked
  return jax.tree.map(lambda w: w.reshape(repeats, -1, *w.shape[1:]), stacked)


def token_mean_loss(run_blocks):
  """The token mean of the cross-entropy over the real (unpadded) targets."""

  def loss(model, batch):
    logits = model(batch["inputs"], run_blocks)
    token = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    real = batch["mask"]
    return jnp.sum(jnp.where(real, token, 0.0)) / jnp.sum(real)

  return loss


def make_step(run_blocks):
  @nnx.jit
  def step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(token_mean_loss(run_blocks))(model, batch)
    optimizer.update(model, grads)
    return loss

  return step


def on_stages(model: StackedCharTransformer, mesh: jax.sharding.Mesh, repeats: int):
  """Puts the stacked blocks' leaves on the stage axis (each device its
  stage's blocks) and everything else on every device."""
  state = nnx.state(model)
  stage = P("stage") if repeats == 1 else P(None, "stage")

  def place(path, x):
    in_blocks = jax.tree_util.keystr(path[:1]) == "['blocks']"
    return jax.device_put(x, NamedSharding(mesh, stage if in_blocks else P()))

  nnx.update(model, jax.tree_util.tree_map_with_path(place, state))


# -----------------------------------------------------------------------------
# main
# -----------------------------------------------------------------------------


def main(
  *,
  steps: int = 200,
  batch_size: int = 16,
  seq_len: int = 64,
  stages: int = 4,
  num_micro_batches: int = 4,
  repeats: int = 1,
  layers: int = 4,
  width: int = 32,
  heads: int = 4,
  learning_rate: float = 3e-3,
  log_every: int = 20,
  out_dir: str | Path = "outputs",
  seed: int = 0,
  progress: bool = True,
) -> dict[str, Any]:
  """Trains the pipelined and the unpipelined model side by side.

  Returns a dict: ``pipelined_losses`` and ``unpipelined_losses`` (one per
  step), ``max_relative_difference`` (of the losses, over all steps),
  ``max_parameter_difference`` (the largest absolute difference of any
  parameter after training), ``iterations`` and ``bubble`` of the schedule,
  ``collectives`` (op -> count in the compiled pipelined step),
  ``loop_collectives`` (ops over the stage axis inside its loops), and
  ``png``.
  """
  if len(jax.devices()) < stages:
    raise ValueError(
      f"stages={stages} needs {stages} devices, there are {len(jax.devices())}: "
      "run the script itself (it makes them), or call "
      "jaxaccum.testing.cpu_devices(stages) before JAX starts."
    )
  out_dir = Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  data = CharData(seq_len)
  mesh = jax.make_mesh((stages,), ("stage",), devices=jax.devices()[:stages])

  def new_model():
    return StackedCharTransformer(
      data.vocab_size,
      seq_len,
      width=width,
      heads=heads,
      layers=layers,
      rngs=nnx.Rngs(seed),
    )

  reference, model = new_model(), new_model()  # the same initialization twice
  params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  on_stages(model, mesh, repeats)
  tx = optax.adamw(learning_rate)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  reference_optimizer = nnx.Optimizer(reference, tx, wrt=nnx.Param)
  piped_step = make_step(pipelined(stages, num_micro_batches, repeats))
  plain_step = make_step(scanned)

  # The loop: r*m + S - 1 iterations (with m >= S); a stage idles in S - 1.
  iterations = repeats * max(num_micro_batches, stages) + stages - 1
  iterations -= max(stages - num_micro_batches, 0)
  bubble = 1 - repeats * num_micro_batches / iterations
  print("jaxaccum pipeline: the quickstart's character transformer in stages\n")
  print(
    f"model  {layers} blocks, width {width}, {params / 1e6:.2f}M parameters; "
    f"{stages} stages of {layers // stages} block{'s' * (layers != stages)} on "
    f"{stages} CPU devices"
  )
  print(
    f"batch  {batch_size} sequences of {seq_len} = {num_micro_batches} pipeline "
    f"micro-batches of {batch_size // num_micro_batches}; repeats {repeats}: "
    f"{iterations} iterations, bubble {bubble:.0%}"
  )

  batches = data.batches(batch_size, seed)
  batch = next(batches)
  with jax.set_mesh(mesh):
    text = piped_step.lower(model, optimizer, batch).compile().as_text()
  found = testing.collectives(text)
  collectives: dict[str, int] = {}
  for c in found:
    op = c.op.removesuffix("-start")
    collectives[op] = collectives.get(op, 0) + 1
  loop_ops = sorted({c.op.removesuffix("-start") for c in found if c.in_loop})
  print(
    "step   collectives in the compiled step: "
    + ", ".join(f"{op} x{n}" for op, n in sorted(collectives.items()))
    + f"; inside its loops: {', '.join(loop_ops) or 'none'}\n"
  )

  print(f"{'step':>6} {'pipelined':>11} {'unpipelined':>12} {'|difference|':>13}")
  piped, plain = [], []
  start = time.perf_counter()
  bar = tqdm(range(steps), disable=not progress, ncols=80, desc="train", leave=False)
  for step in bar:
    with jax.set_mesh(mesh):
      piped.append(piped_step(model, optimizer, batch))
    plain.append(plain_step(reference, reference_optimizer, batch))
    if step % log_every == 0 or step == steps - 1:
      a, b = float(piped[-1]), float(plain[-1])
      bar.write(f"{step:>6} {a:>11.6f} {b:>12.6f} {abs(a - b):>13.2e}")
    batch = next(batches)
  elapsed = time.perf_counter() - start
  bar.close()

  piped_np = np.array([float(v) for v in piped])
  plain_np = np.array([float(v) for v in plain])
  relative = float(np.max(np.abs(piped_np - plain_np) / np.abs(plain_np)))
  gap = max(
    float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
    for a, b in zip(
      jax.tree.leaves(nnx.state(model, nnx.Param)),
      jax.tree.leaves(nnx.state(reference, nnx.Param)),
      strict=True,
    )
  )
  print(
    f"\nloss {piped_np[0]:.3f} -> {piped_np[-1]:.3f}; largest relative difference "
    f"of the two losses over {steps} steps: {relative:.1e}; largest parameter "
    f"difference after training: {gap:.1e}; {elapsed:.0f} s for both"
  )
  png = out_dir / "pipeline_loss.png"
  fig, ax = plt.subplots(figsize=(7, 4))
  ax.plot(piped_np, label=f"pipelined ({stages} stages)")
  ax.plot(plain_np, "--", label="unpipelined (lax.scan)")
  ax.set(xlabel="optimizer step", ylabel="token mean cross-entropy (nats)")
  ax.set_title("Character transformer on pydoc_data.topics, pipelined and not")
  ax.legend()
  fig.tight_layout()
  fig.savefig(png, dpi=120)
  plt.close(fig)
  print(f"loss curves: {png}")
  return {
    "pipelined_losses": piped_np.tolist(),
    "unpipelined_losses": plain_np.tolist(),
    "max_relative_difference": relative,
    "max_parameter_difference": gap,
    "iterations": iterations,
    "bubble": bubble,
    "collectives": collectives,
    "loop_collectives": loop_ops,
    "png": str(png),
  }


if __name__ == "__main__":
  main(**ARGS)
