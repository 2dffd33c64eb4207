"""Differentially private training (DP-SGD) on scikit-learn's digits.

An MLP is trained twice on the 1344 training images of scikit-learn's
bundled digits (8x8, offline), from the same initialization, with the same
optimizer and the same Poisson-sampled batches of 1,024 images on average:

  (a) DP-SGD: each image's gradient is clipped to L2 norm C
      (``clip_per_example``), the clipped gradients of a draw are summed over
      K micro-batches inside one jitted step, Gaussian noise of standard
      deviation sigma * C is added once per step (``jaxaccum.dp_noise``), and
      the sum is divided by the expected batch size;
  (a') the same DP-SGD run with ghost clipping (``clip_method="ghost"``):
      each image's gradient norm is read from the layers' inputs and output
      gradients, and a second, weighted backward pass gives the clipped sum,
      with no per-example gradient materialized. It draws the same noise
      from the same key, so its parameters equal (a)'s to float32 rounding;
      the script prints how far apart they are;
  (b) the same model without privacy: no clipping, no noise, the mean loss.

Each step draws every training image with probability q = 1024 / 1344
(``jaxaccum.PoissonSampler``). The draws differ in size; each is padded to
one maximum, chosen so that a larger draw has probability below 1e-6 per
step, and masked, so one compiled step serves every draw. The script prints
epsilon at delta = 1e-5 for the run, from Google's dp-accounting
(``jaxaccum.dp_epsilon``, privacy loss distributions, and Rényi DP as a
bound), and the test accuracy of the three models on the 453 held-out
images.

Run: ``python examples/dp_digits.py [--steps 200] [--noise-multiplier 8]``.
"""

from __future__ import annotations

from typing import Any

import _cli  # examples/_cli.py
from _digits import TRAIN_ROWS  # examples/_digits.py


def parse_args(argv: list[str] | None = None) -> dict[str, Any]:
  """``main``'s keyword arguments from the command line (``sys.argv`` if None)."""
  parser = _cli.parser(__doc__)
  add = parser.add_argument
  count = _cli.positive_int
  add("--steps", type=count, default=200, metavar="N", help="optimizer steps")
  add(
    "--expected-batch-size",
    type=count,
    default=1024,
    metavar="B",
    help=f"the mean Poisson draw, q times the {TRAIN_ROWS} training images",
  )
  add(
    "--num-micro-batches",
    type=count,
    default=8,
    metavar="K",
    help="micro-batches per step; the padded draw is a multiple of it",
  )
  add(
    "--noise-multiplier",
    type=_cli.positive_float,
    default=8.0,
    metavar="SIGMA",
    help="the noise's standard deviation over the clipping norm",
  )
  add(
    "--clip-norm",
    type=_cli.positive_float,
    default=1.0,
    metavar="C",
    help="each image's gradient is clipped to this L2 norm",
  )
  add(
    "--learning-rate",
    type=_cli.positive_float,
    default=2e-3,
    metavar="LR",
    help="Adam's learning rate, the same in both runs",
  )
  add("--hidden", type=count, default=128, metavar="N", help="hidden layer width")
  _cli.add_run_options(
    parser,
    outputs="nothing (the script only prints)",
    seed_help="seeds the initialization, the draws and the noise",
  )
  args = parser.parse_args(argv)
  if args.expected_batch_size > TRAIN_ROWS:
    parser.error(
      f"--expected-batch-size {args.expected_batch_size} is more than the {TRAIN_ROWS} "
      "training images"
    )
  return _cli.keyword_arguments(args)


if __name__ == "__main__":
  # First thing: --help and a bad flag answer before JAX is imported (seconds).
  ARGS = parse_args()

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _digits import digits_split  # examples/_digits.py
from _mlp import init_mlp, mlp  # examples/_mlp.py
from tqdm import tqdm

import jaxaccum

DELTA = 1e-5


def example_loss(params, example):
  """One image's cross-entropy: DP-SGD clips each image's gradient."""
  x, y = example
  logits = mlp(params, x[None])[0]
  return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def batch_loss(params, batch):
  """The non-private loss of a padded draw: ``(sum over drawn images, count)``
  with ``normalize="weighted"``, the mean over the drawn images."""
  x, y, mask = batch
  losses = optax.softmax_cross_entropy_with_integer_labels(mlp(params, x), y)
  return jnp.sum(jnp.where(mask > 0, losses, 0.0)), jnp.sum(mask)


def accuracy(params, x, y) -> float:
  return float(jnp.mean(jnp.argmax(mlp(params, x), axis=-1) == y))


def relative_difference(params, reference) -> float:
  """The largest ``|a - b|`` over the leaves, each over its leaf's largest
  ``|b|``: 0 for equal parameters, ~1e-7 for float32 rounding."""
  return max(
    float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(reference), strict=True)
  )


def main(
  *,
  steps: int = 200,
  expected_batch_size: int = 1024,
  num_micro_batches: int = 8,
  noise_multiplier: float = 8.0,
  clip_norm: float = 1.0,
  learning_rate: float = 2e-3,
  hidden: int = 128,
  out_dir: str = "outputs",
  progress: bool = True,
  seed: int = 0,
) -> dict[str, Any]:
  """Trains both models and returns what the script prints.

  Args:
    steps: optimizer steps of each run.
    expected_batch_size: the mean Poisson draw.
    num_micro_batches: ``K``.
    noise_multiplier: sigma.
    clip_norm: C.
    learning_rate: Adam's, both runs.
    hidden: the MLP's hidden width.
    out_dir: unused (the script writes nothing); every example takes it.
    progress: show a tqdm progress bar.
    seed: seeds the initialization, the draws and the noise.

  Returns:
    A dict with ``epsilon`` and ``epsilon_rdp`` (at delta 1e-5), the test
    accuracies ``accuracy_dp``, ``accuracy_ghost`` and ``accuracy_plain``,
    ``ghost_difference`` (the largest difference between a parameter of the
    ghost run and of the vmap run, over the largest magnitude of that
    parameter's leaf), ``ghost_predictions_agree`` (the fraction of test
    images both DP models put in the same class), the draws' sizes
    ``draw_sizes``, the padded size ``max_batch_size``, the number of times
    the DP step was traced ``traces``, and ``seconds``.
  """
  del out_dir
  start = time.perf_counter()
  x_train, y_train, x_test, y_test = digits_split()
  sampler = jaxaccum.PoissonSampler(
    len(x_train), expected_batch_size, multiple_of=num_micro_batches
  )
  traces = []

  def traced_loss(params, example):
    traces.append(1)
    return example_loss(params, example)

  optimizer = optax.adam(learning_rate)
  noise = jaxaccum.dp_noise(
    noise_multiplier,
    clip_norm,
    jax.random.key(seed + 1),
    normalize="poisson",
    expected_batch_size=sampler.expected_batch_size,
  )
  dp_tx = optax.chain(noise, optimizer)
  dp_step = jaxaccum.make_train_step(
    traced_loss, dp_tx, num_micro_batches, clip_per_example=clip_norm
  )
  ghost_step = jaxaccum.make_train_step(
    example_loss,
    dp_tx,
    num_micro_batches,
    clip_per_example=clip_norm,
    clip_method="ghost",
  )
  plain_step = jaxaccum.make_train_step(
    batch_loss, optimizer, num_micro_batches, normalize="weighted"
  )
  init = init_mlp(jax.random.key(seed), (64, hidden, 10))
  dp_params, dp_state = init, dp_tx.init(init)
  # The steps donate their arguments: each run trains its own copy, and the
  # ghost run's noise key is a copy of the vmap run's (the same noise).
  ghost_params, ghost_state = jax.tree.map(jnp.copy, (init, dp_state))
  plain_params = jax.tree.map(jnp.copy, init)
  plain_state = optimizer.init(plain_params)
  rng = np.random.default_rng(seed)
  sizes = []
  for _ in tqdm(range(steps), desc="dp_digits", disable=not progress):
    (x, y), mask = sampler.sample((x_train, y_train), rng)
    sizes.append(int(mask.sum()))
    dp_params, dp_state, _ = dp_step(dp_params, dp_state, (x, y), example_mask=mask)
    ghost_params, ghost_state, _ = ghost_step(
      ghost_params, ghost_state, (x, y), example_mask=mask
    )
    plain_params, plain_state, _ = plain_step(plain_params, plain_state, (x, y, mask))
  q = sampler.sampling_rate
  result = {
    "epsilon": jaxaccum.dp_epsilon(q, noise_multiplier, steps, DELTA),
    "epsilon_rdp": jaxaccum.dp_epsilon(
      q, noise_multiplier, steps, DELTA, accountant="rdp"
    ),
    "accuracy_dp": accuracy(dp_params, x_test, y_test),
    "accuracy_ghost": accuracy(ghost_params, x_test, y_test),
    "ghost_difference": relative_difference(ghost_params, dp_params),
    "ghost_predictions_agree": float(
      jnp.mean(
        jnp.argmax(mlp(ghost_params, x_test), -1)
        == jnp.argmax(mlp(dp_params, x_test), -1)
      )
    ),
    "accuracy_plain": accuracy(plain_params, x_test, y_test),
    "draw_sizes": np.asarray(sizes),
    "max_batch_size": sampler.max_batch_size,
    "overflow_probability": sampler.overflow_probability,
    "traces": len(traces),
    "seconds": time.perf_counter() - start,
  }
  print(
    f"{steps} steps, Poisson sampling q = {q:.3f} of {len(x_train)} images: "
    f"draws of {min(sizes)} to {max(sizes)} (mean {np.mean(sizes):.0f}), padded "
    f"to {sampler.max_batch_size} = {num_micro_batches} x "
    f"{sampler.max_batch_size // num_micro_batches} "
    f"(a larger draw: p = {sampler.overflow_probability:.1e} per step); "
    f"the DP step traced {len(traces)} time(s)."
  )
  print(
    f"DP-SGD, sigma = {noise_multiplier}, C = {clip_norm}: epsilon = "
    f"{result['epsilon']:.2f} at delta = {DELTA:g} (PLD; RDP bound "
    f"{result['epsilon_rdp']:.2f})."
  )
  print(
    f"Ghost clipping, the same draws and noise: parameters within "
    f"{result['ghost_difference']:.1e} of the vmap run's (relative), the same "
    f"class for {result['ghost_predictions_agree']:.1%} of the test images."
  )
  print(
    f"Test accuracy on {len(x_test)} images: DP-SGD {result['accuracy_dp']:.3f} "
    f"(ghost clipping {result['accuracy_ghost']:.3f}), "
    f"non-private {result['accuracy_plain']:.3f}. "
    f"{result['seconds']:.0f} s in all."
  )
  return result


if __name__ == "__main__":
  main(**ARGS)
