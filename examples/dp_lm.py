"""Differentially private training (DP-SGD) of a character transformer on Python's docs.

The quickstart's character-level transformer (``examples/quickstart.py``:
token and position embeddings, causal self-attention, a tied output head),
dropout off, on ``pydoc_data.topics``, which ships with CPython, trained
twice from the same initialization on the same Poisson-sampled batches:

  (a) DP-SGD: each sequence is one example. Its gradient is clipped to L2
      norm C by ghost clipping (``clip_per_example=C,
      clip_method="ghost"``: the norm is read from each layer's inputs and
      output gradients, then a second, weighted backward pass gives the
      clipped sum; no per-example gradient of a dense layer is ever held).
      The clipped sums of K micro-batches are accumulated in one jitted
      step, ``jaxaccum.dp_noise`` adds Gaussian noise of standard deviation
      sigma * C once per step and divides by the expected batch size, and
      Adam takes one step;
  (b) the same model without privacy: no clipping, no noise, the same loss
      (each drawn sequence's mean over its characters, averaged over the
      draw) and the same Adam.

Before training, the script checks ghost clipping against per-example
gradients (``clip_method="vmap"``) on the first draw and raises if their
clipped sums differ by more than float32 rounding. It prints epsilon at
delta = 1e-5 for the run, from Google's dp-accounting
(``jaxaccum.dp_epsilon``: Poisson sampling, add-or-remove-one adjacency),
and the held-out loss (nats per character) and next-character accuracy of
both models, of the initial model and of a unigram model (character
frequencies of the training text).

The unit of privacy is a sequence: a chunk of at most ``--seq-len`` + 1
characters of one paragraph. A paragraph cut into several sequences, or a
document, is protected only by group privacy (weaker: roughly epsilon times
the number of its sequences). The last 10% of the sequences (the last
documents in sorted order) are held out and never drawn.

Run: ``python examples/dp_lm.py [--steps 300] [--noise-multiplier 1]``;
``--quick`` for a small model and a few steps (a smoke test, seconds after
compiling); ``--write-results`` writes ``benchmarks/results/dp_lm.json``,
from which ``examples/README.md`` shows the result.
"""

from __future__ import annotations

from typing import Any

import _cli  # examples/_cli.py

# The defaults, and --quick's: a small model and a few steps.
SETTINGS: dict[str, Any] = {
  "steps": 300,
  "expected_batch_size": 256,
  "num_micro_batches": 4,
  "seq_len": 32,
  "width": 64,
  "layers": 2,
  "heads": 4,
}
QUICK: dict[str, Any] = {
  "steps": 6,
  "expected_batch_size": 32,
  "num_micro_batches": 2,
  "seq_len": 16,
  "width": 32,
  "layers": 1,
  "heads": 2,
}
DEFAULT_RESULTS = "benchmarks/results/dp_lm.json"


def parse_args(argv: list[str] | None = None) -> dict[str, Any]:
  """``main``'s keyword arguments from the command line (``sys.argv`` if None)."""
  parser = _cli.parser(__doc__)
  add = parser.add_argument
  count = _cli.positive_int

  def sized(flag: str, help: str) -> None:
    key = flag[2:].replace("-", "_")
    add(
      flag,
      type=count,
      default=None,
      metavar="N",
      help=f"{help} (default: {SETTINGS[key]}; --quick: {QUICK[key]})",
    )

  sized("--steps", "optimizer steps of each run")
  sized("--expected-batch-size", "the mean Poisson draw of sequences per step")
  sized("--num-micro-batches", "micro-batches per step (K)")
  sized("--seq-len", "characters per sequence, the model's context")
  sized("--width", "the model's width")
  sized("--layers", "transformer blocks")
  sized("--heads", "attention heads; must divide the width")
  add(
    "--noise-multiplier",
    type=_cli.positive_float,
    default=1.0,
    metavar="SIGMA",
    help="the noise's standard deviation over the clipping norm",
  )
  add(
    "--clip-norm",
    type=_cli.positive_float,
    default=1.0,
    metavar="C",
    help="each sequence's gradient is clipped to this L2 norm",
  )
  add(
    "--learning-rate",
    type=_cli.positive_float,
    default=3e-3,
    metavar="LR",
    help="Adam's learning rate, the same in both runs",
  )
  add(
    "--quick",
    action="store_true",
    help="a small model and a few steps: a smoke test, too short to learn",
  )
  add(
    "--results",
    metavar="PATH",
    default=None,
    help="write the results as JSON to PATH",
  )
  add(
    "--write-results",
    action="store_true",
    help=f"write the results to {DEFAULT_RESULTS} (unless --results)",
  )
  _cli.add_run_options(
    parser,
    outputs="nothing (the script prints, and writes JSON only when asked)",
    seed_help="seeds the initialization, the draws and the noise",
  )
  args = parser.parse_args(argv)
  chosen = {**SETTINGS, **(QUICK if args.quick else {})}
  chosen.update({k: v for k, v in vars(args).items() if k in chosen and v})
  if chosen["width"] % chosen["heads"]:
    parser.error(
      f"--width {chosen['width']} does not split into --heads {chosen['heads']}"
    )
  return _cli.keyword_arguments(args)


if __name__ == "__main__":
  # First thing: --help and a bad flag answer before JAX is imported (seconds).
  ARGS = parse_args()

import datetime
import json
import math
import os
import pathlib
import platform
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from quickstart import PAD, CharData, CharTransformer  # examples/quickstart.py
from tqdm import tqdm

import jaxaccum

DELTA = 1e-5
HELD_OUT_FRACTION = 0.1
#: Rows of the first draw on which ghost clipping is checked against vmap.
CHECK_ROWS = 64


# -----------------------------------------------------------------------------
# Data: the quickstart's sequences, the last tenth held out
# -----------------------------------------------------------------------------


def as_batch(ids: np.ndarray) -> dict[str, np.ndarray]:
  """Sequences of ``seq_len + 1`` ids as inputs, next-character targets and
  the mask of real targets."""
  return {"inputs": ids[:, :-1], "targets": ids[:, 1:], "mask": ids[:, 1:] != PAD}


def split(data: CharData) -> tuple[np.ndarray, np.ndarray]:
  """The training and held-out sequences. ``CharData`` keeps the documents'
  order, so the held-out tail is whole documents (and part of one)."""
  held = round(HELD_OUT_FRACTION * len(data.ids))
  return data.ids[:-held], data.ids[-held:]


def unigram(train: np.ndarray, held: np.ndarray, vocab_size: int) -> dict[str, float]:
  """The baseline that knows only character frequencies: the held-out loss of
  the training text's frequencies (add-one smoothed), and the accuracy of
  always guessing the most frequent character."""
  counts = np.bincount(train[:, 1:][train[:, 1:] != PAD], minlength=vocab_size)
  counts[PAD] = 0
  probs = (counts + 1.0) / (counts.sum() + vocab_size - 1)
  targets = held[:, 1:][held[:, 1:] != PAD]
  return {
    "loss": float(-np.mean(np.log(probs[targets]))),
    "accuracy": float(np.mean(targets == np.argmax(counts))),
  }


# -----------------------------------------------------------------------------
# Losses
# -----------------------------------------------------------------------------


def sequence_loss(model: CharTransformer, example: dict[str, jax.Array]) -> jax.Array:
  """One sequence's mean cross-entropy over its real characters: the loss
  whose gradient DP-SGD clips, one sequence at a time."""
  logits = model(example["inputs"][None])[0]
  token_loss = optax.softmax_cross_entropy_with_integer_labels(
    logits, example["targets"]
  )
  real = example["mask"]
  return jnp.sum(jnp.where(real, token_loss, 0.0)) / jnp.maximum(jnp.sum(real), 1)


def draw_loss(model: CharTransformer, batch: dict[str, jax.Array]):
  """The non-private loss of a padded draw: ``(sum of the drawn sequences'
  losses, their number)`` with ``normalize="weighted"``, their mean."""
  losses = jax.vmap(sequence_loss, in_axes=(None, 0))(model, batch)
  drawn = batch["drawn"] > 0
  return jnp.sum(jnp.where(drawn, losses, 0.0)), jnp.sum(batch["drawn"])


@nnx.jit
def evaluate(model: CharTransformer, batch: dict[str, jax.Array]):
  """Held-out ``(loss, accuracy)``: means over every real target character."""
  logits = model(batch["inputs"])
  token_loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  right = jnp.argmax(logits, axis=-1) == batch["targets"]
  real = batch["mask"]
  count = jnp.sum(real)
  return (
    jnp.sum(jnp.where(real, token_loss, 0.0)) / count,
    jnp.sum(jnp.where(real, right, False)) / count,
  )


def check_ghost(model, batch, clip_norm, num_micro_batches) -> float:
  """Ghost clipping's clipped sum against per-example gradients' on
  ``batch``: the relative L2 distance over all parameters. Raises if it is
  more than float32 rounding."""
  sums = {
    method: jaxaccum.nnx.grad(
      sequence_loss,
      num_micro_batches,
      normalize="sum",
      clip_per_example=clip_norm,
      clip_method=method,
      clip_without_noise=True,  # a check of the clipped sum, not training
    )
    for method in ("vmap", "ghost")
  }
  with warnings.catch_warnings():
    # The tied embedding (a gather and the output head) is used twice, so its
    # per-example gradient is computed, exact; the warning says so.
    warnings.simplefilter("ignore", jaxaccum.GhostFallbackWarning)
    both = nnx.jit(lambda m, b: (sums["vmap"](m, b), sums["ghost"](m, b)))(model, batch)
  want, got = (jax.tree.leaves(g) for g in both)
  diff = sum(float(jnp.sum((a - b) ** 2)) for a, b in zip(got, want, strict=True))
  size = sum(float(jnp.sum(b**2)) for b in want)
  error = math.sqrt(diff / size)
  if not error <= 1e-5:
    raise AssertionError(f"ghost clipping differs from vmap by {error:.2e} (relative)")
  return error


# -----------------------------------------------------------------------------
# Training
# -----------------------------------------------------------------------------


def main(
  *,
  steps: int | None = None,
  expected_batch_size: int | None = None,
  num_micro_batches: int | None = None,
  seq_len: int | None = None,
  width: int | None = None,
  layers: int | None = None,
  heads: int | None = None,
  noise_multiplier: float = 1.0,
  clip_norm: float = 1.0,
  learning_rate: float = 3e-3,
  quick: bool = False,
  results: str | None = None,
  write_results: bool = False,
  out_dir: str = "outputs",
  seed: int = 0,
  progress: bool = True,
) -> dict[str, Any]:
  """Trains both models and returns what the script prints.

  Args:
    steps, expected_batch_size, num_micro_batches, seq_len, width, layers,
      heads: replace ``SETTINGS`` (``QUICK``'s with ``quick``).
    noise_multiplier: sigma.
    clip_norm: C.
    learning_rate: Adam's, both runs.
    quick: a small model and a few steps (``QUICK``).
    results: write the results as JSON there.
    write_results: write them to ``benchmarks/results/dp_lm.json`` unless
      ``results`` is given.
    out_dir: unused (the script writes no plot); every example takes it.
    seed: seeds the initialization, the draws and the noise.
    progress: show a tqdm progress bar.

  Returns:
    A dict: ``settings``; ``epsilon`` and ``epsilon_rdp`` at ``delta``;
    ``train_sequences``, ``held_out_sequences`` and ``sampling_rate``;
    ``ghost_check`` (ghost's clipped sum against vmap's, relative);
    ``held_out`` with ``(loss, accuracy)`` of ``initial``, ``unigram``,
    ``dp`` and ``plain``; ``curve`` (held-out losses of both runs at a few
    steps); ``draw_sizes``, ``max_batch_size``, ``seconds``,
    ``cpu_seconds`` (this process's), ``load_average`` (at the start and
    the end) and, when written, ``results_path``.
  """
  del out_dir
  start, cpu_start = time.perf_counter(), time.process_time()
  load_start = os.getloadavg()[0]
  given = {
    "steps": steps,
    "expected_batch_size": expected_batch_size,
    "num_micro_batches": num_micro_batches,
    "seq_len": seq_len,
    "width": width,
    "layers": layers,
    "heads": heads,
  }
  settings = {**SETTINGS, **(QUICK if quick else {})}
  settings.update({k: v for k, v in given.items() if v is not None})
  steps, k = settings["steps"], settings["num_micro_batches"]

  data = CharData(settings["seq_len"])
  train_ids, held_ids = split(data)
  if DELTA * len(train_ids) >= 1:
    raise ValueError(f"delta {DELTA} is not below 1 / {len(train_ids)} sequences")
  train = as_batch(train_ids)
  held = {key: jnp.asarray(v) for key, v in as_batch(held_ids).items()}
  sampler = jaxaccum.PoissonSampler(
    len(train_ids), settings["expected_batch_size"], multiple_of=k
  )

  def build() -> CharTransformer:
    return CharTransformer(
      data.vocab_size,
      settings["seq_len"],
      width=settings["width"],
      layers=settings["layers"],
      heads=settings["heads"],
      dropout=0.0,
      rngs=nnx.Rngs(seed),
    )

  dp_model, plain_model = build(), build()  # the same initialization
  noise = jaxaccum.dp_noise(
    noise_multiplier,
    clip_norm,
    jax.random.key(seed + 1),
    normalize="poisson",
    expected_batch_size=sampler.expected_batch_size,
  )
  dp_optimizer = nnx.Optimizer(
    dp_model, optax.chain(noise, optax.adam(learning_rate)), wrt=nnx.Param
  )
  plain_optimizer = nnx.Optimizer(plain_model, optax.adam(learning_rate), wrt=nnx.Param)
  dp_step = jaxaccum.nnx.make_train_step(
    sequence_loss,
    dp_optimizer,
    k,
    clip_per_example=clip_norm,
    clip_method="ghost",
  )
  plain_step = jaxaccum.nnx.make_train_step(
    draw_loss, plain_optimizer, k, normalize="weighted"
  )

  rng = np.random.default_rng(seed)
  first, mask = sampler.sample(train, rng)
  rows = min(CHECK_ROWS, int(mask.sum())) // k * k
  kept = np.flatnonzero(mask)[:rows]
  ghost_check = check_ghost(
    dp_model, {key: v[kept] for key, v in first.items()}, clip_norm, k
  )

  initial = evaluate(dp_model, held)
  every = max(1, steps // 5)
  curve = {"step": [0], "dp": [float(initial[0])], "plain": [float(initial[0])]}
  sizes = []
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", jaxaccum.GhostFallbackWarning)  # see check_ghost
    for step in tqdm(range(1, steps + 1), desc="dp_lm", disable=not progress):
      batch, mask = (first, mask) if step == 1 else sampler.sample(train, rng)
      sizes.append(int(mask.sum()))
      dp_step(dp_model, batch, example_mask=mask)
      plain_step(plain_model, {**batch, "drawn": mask})
      if step % every == 0 or step == steps:
        curve["step"].append(step)
        curve["dp"].append(float(evaluate(dp_model, held)[0]))
        curve["plain"].append(float(evaluate(plain_model, held)[0]))

  q = sampler.sampling_rate
  scores = {
    "initial": initial,
    "dp": evaluate(dp_model, held),
    "plain": evaluate(plain_model, held),
  }
  held_out = {
    name: {"loss": float(loss), "accuracy": float(accuracy)}
    for name, (loss, accuracy) in scores.items()
  }
  held_out["unigram"] = unigram(train_ids, held_ids, data.vocab_size)
  result: dict[str, Any] = {
    "date": datetime.date.today().isoformat(),
    "machine": machine(),
    "jax": jax.__version__,
    # The command line, when run as a script (not from a test's main()).
    "argv": sys.argv[1:] if sys.argv[0].endswith("dp_lm.py") else None,
    "settings": {
      **settings,
      "noise_multiplier": noise_multiplier,
      "clip_norm": clip_norm,
      "learning_rate": learning_rate,
      "seed": seed,
      "parameters": sum(
        x.size for x in jax.tree.leaves(nnx.state(dp_model, nnx.Param))
      ),
    },
    "delta": DELTA,
    "epsilon": jaxaccum.dp_epsilon(q, noise_multiplier, steps, DELTA),
    "epsilon_rdp": jaxaccum.dp_epsilon(
      q, noise_multiplier, steps, DELTA, accountant="rdp"
    ),
    "train_sequences": len(train_ids),
    "held_out_sequences": len(held_ids),
    "held_out_characters": int(np.sum(held_ids[:, 1:] != PAD)),
    "sampling_rate": q,
    "max_batch_size": sampler.max_batch_size,
    "ghost_check": ghost_check,
    "held_out": held_out,
    "curve": curve,
    "draw_sizes": sizes,
  }
  result["seconds"] = time.perf_counter() - start
  # Time on a shared machine is mostly other jobs': the CPU time this
  # process took, and the load average (1 minute) at its start and end.
  result["cpu_seconds"] = time.process_time() - cpu_start
  result["load_average"] = [load_start, os.getloadavg()[0]]
  report(result)
  path = results or (DEFAULT_RESULTS if write_results else None)
  if path:
    pathlib.Path(path).write_text(json.dumps(result, indent=1) + "\n")
    result["results_path"] = path
    print(f"Results written to {path}.")
  result["draw_sizes"] = np.asarray(sizes)
  return result


def machine() -> str:
  """``2-core <the CPU's model name>``, for the JSON's record of the run."""
  name = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      models = [
        line.split(":", 1)[1].strip() for line in f if line.startswith("model name")
      ]
    name = models[0] if models else name
  except OSError:
    pass
  return f"{os.cpu_count()}-core {name}"


def report(result: dict[str, Any]) -> None:
  """Prints the run's summary."""
  s, h = result["settings"], result["held_out"]
  sizes = result["draw_sizes"]
  print(
    f"{s['parameters']:,} parameters ({s['layers']} blocks of width "
    f"{s['width']}); {result['train_sequences']:,} training sequences of at "
    f"most {s['seq_len']} characters, {result['held_out_sequences']:,} held out."
  )
  print(
    f"{s['steps']} steps, Poisson sampling q = {result['sampling_rate']:.4f}: "
    f"draws of {min(sizes)} to {max(sizes)} (mean {np.mean(sizes):.0f}), padded "
    f"to {result['max_batch_size']} = {s['num_micro_batches']} micro-batches of "
    f"{result['max_batch_size'] // s['num_micro_batches']}."
  )
  print(
    f"Ghost clipping against per-example gradients on the first draw: "
    f"{result['ghost_check']:.1e} apart (relative)."
  )
  print(
    f"DP-SGD, sigma = {s['noise_multiplier']}, C = {s['clip_norm']}: epsilon = "
    f"{result['epsilon']:.2f} at delta = {result['delta']:g} (PLD; RDP bound "
    f"{result['epsilon_rdp']:.2f})."
  )
  print(f"Held out ({result['held_out_characters']:,} characters):")
  names = {
    "initial": "initial model",
    "unigram": "unigram frequencies",
    "dp": f"DP-SGD, epsilon {result['epsilon']:.2f}",
    "plain": "non-private",
  }
  for key, label in names.items():
    print(
      f"  {label:<22} loss {h[key]['loss']:.3f} nats/char, "
      f"next-character accuracy {h[key]['accuracy']:.3f}"
    )
  print(
    f"{result['seconds']:.0f} s in all ({result['cpu_seconds']:.0f} s of CPU; load "
    f"average {result['load_average'][0]:.1f} at the start, "
    f"{result['load_average'][1]:.1f} at the end)."
  )


if __name__ == "__main__":
  main(**ARGS)
