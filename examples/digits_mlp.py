"""Accumulated and full-batch training give the same loss curve (Flax NNX).

The same MLP, from the same initialization, is trained twice on scikit-learn's
bundled digits (8x8 images, offline) with the same effective batch, the
whole training set of 1350 rows, and the same optimizer:

  (a) full batch, with plain ``nnx.value_and_grad``;
  (b) ``jaxaccum.nnx.value_and_grad(loss, 8)``: the batch is split into 8
      micro-batches, and one ``lax.scan`` adds their gradients into a float32
      accumulator inside the jitted step, so only one micro-batch's
      activations are alive at a time.

1350 rows do not split into 8 equal micro-batches. ``jaxaccum.pad_batch``
pads them to 1352 (repeating the last row) and returns a row mask; the loss
returns ``(sum of masked losses, number of real rows)`` and
``normalize="weighted"`` divides the sums over all micro-batches by the real
row count, so (b) computes the full-batch gradient of the 1350 real rows, up
to the order in which float32 additions happen. The step also returns each
row's prediction as aux, and jaxaccum joins the micro-batches'
predictions back into the batch's row order, as the full batch's aux, for
the training accuracy. The two loss curves overlap; the script prints their largest
difference, which is float32 rounding, and plots both curves and the
difference.

Near convergence the per-example gradients nearly cancel, so any float32
full-batch gradient is accurate only to about 1e-4 relative (against a float64
reference after 200 steps, both the plain and the accumulated one are). Adam divides each
entry by its running RMS and so amplifies such differences in entries whose
gradient is almost zero; run many more steps, long after the loss is near
zero, and a few parameters drift apart by more than rounding, as they would
between two full-batch runs on different hardware. The defaults stop before.

Run: ``python examples/digits_mlp.py [--steps 150] [--out-dir outputs]``.
"""

from __future__ import annotations

from typing import Any

import _cli  # examples/_cli.py
from _digits import MIN_SPLIT_ROWS, ROWS  # examples/_digits.py


def parse_args(argv: list[str] | None = None) -> dict[str, Any]:
  """``main``'s keyword arguments from the command line (``sys.argv`` if None)."""
  parser = _cli.parser(__doc__)
  add = parser.add_argument
  count = _cli.positive_int
  add(
    "--steps",
    type=count,
    default=150,
    metavar="N",
    help="optimizer steps of each run; every step uses the whole training set",
  )
  add(
    "--num-micro-batches",
    type=count,
    default=8,
    metavar="K",
    help="micro-batches of the accumulated run; the training set is padded "
    "to a multiple of it",
  )
  add(
    "--train-rows",
    type=count,
    default=1350,
    metavar="N",
    help=f"training images, the full batch (the rest of the {ROWS} are the test "
    "set); need not divide by K",
  )
  add("--hidden", type=count, default=128, metavar="N", help="hidden layer width")
  add(
    "--learning-rate",
    type=_cli.positive_float,
    default=3e-3,
    metavar="LR",
    help="Adam's learning rate, the same in both runs",
  )
  _cli.add_run_options(
    parser,
    outputs="the plot, digits_mlp.png",
    seed_help="seeds the initialization (the data split is fixed)",
  )
  args = parser.parse_args(argv)
  if not MIN_SPLIT_ROWS <= args.train_rows <= ROWS - MIN_SPLIT_ROWS:
    parser.error(
      f"--train-rows must be between {MIN_SPLIT_ROWS} and {ROWS - MIN_SPLIT_ROWS} "
      f"(both sets need every digit), got {args.train_rows}"
    )
  if args.num_micro_batches > args.train_rows:
    parser.error(
      f"--num-micro-batches {args.num_micro_batches} is more than the "
      f"{args.train_rows} training rows"
    )
  return _cli.keyword_arguments(args)


if __name__ == "__main__":
  # First thing: --help and a bad flag answer before JAX is imported (seconds).
  ARGS = parse_args()

import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _digits import digits_split  # examples/_digits.py
from _plots import log_axis  # examples/_plots.py
from flax import nnx
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from tqdm import tqdm

import jaxaccum


class MLP(nnx.Module):
  """64 -> hidden -> hidden -> 10, with ReLU."""

  def __init__(self, hidden: int, *, rngs: nnx.Rngs):
    self.layer1 = nnx.Linear(64, hidden, rngs=rngs)
    self.layer2 = nnx.Linear(hidden, hidden, rngs=rngs)
    self.out = nnx.Linear(hidden, 10, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    h = nnx.relu(self.layer1(x))
    h = nnx.relu(self.layer2(h))
    return self.out(h)


def loss_fn(model: MLP, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
  """The mean cross-entropy of a batch (or of one micro-batch)."""
  x, y = batch
  return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def masked_loss_fn(model: MLP, batch) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
  """For a padded batch: ``((sum of the real rows' losses, real rows),
  predictions)``, with ``normalize="weighted"`` the mean over real rows."""
  x, y, mask = batch
  logits = model(x)
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
  return (jnp.sum(losses * mask), jnp.sum(mask)), jnp.argmax(logits, axis=-1)


def make_train_step(value_and_grad_fn):
  """A jitted step: ``value_and_grad_fn(model, batch)``, then one update."""

  @nnx.jit
  def train_step(model, optimizer, batch):
    value, grads = value_and_grad_fn(model, batch)
    optimizer.update(model, grads)
    return value

  return train_step


@nnx.jit
def accuracy(model: MLP, x: jax.Array, y: jax.Array) -> jax.Array:
  return jnp.mean(jnp.argmax(model(x), axis=-1) == y)


def main(
  *,
  steps: int = 150,
  num_micro_batches: int = 8,
  train_rows: int = 1350,
  hidden: int = 128,
  learning_rate: float = 3e-3,
  out_dir: str = "outputs",
  progress: bool = True,
  seed: int = 0,
) -> dict:
  """Trains the MLP full-batch and accumulated; returns both runs' results.

  Args:
    steps: optimizer steps for each run; every step uses the whole training
      set.
    num_micro_batches: ``k`` for the accumulated run; the training set is
      padded to a multiple of it.
    train_rows: the training set's size (the rest of the 1797 images is the
      test set); it need not divide by ``k``.
    hidden: the width of the two hidden layers.
    learning_rate: Adam's learning rate, the same for both runs.
    out_dir: where the plot ``digits_mlp.png`` goes.
    progress: show a tqdm progress bar.
    seed: the initialization seed (the data split is fixed).

  Returns:
    A dict with ``losses_full`` and ``losses_accum`` (the training loss before
    each step, float32 arrays of shape ``(steps,)``), ``max_curve_diff``
    (their largest absolute difference), ``max_rel_curve_diff`` (the largest
    relative one), ``max_param_diff`` (the largest
    absolute difference of the final parameters), ``accuracy_full`` and
    ``accuracy_accum`` (test accuracy), ``train_accuracy_accum`` (the last
    step's training accuracy, from the aux), ``padded_rows``,
    ``seconds`` and ``png``.
  """
  x_train, y_train, x_test, y_test = digits_split(train_rows)
  batch = (jnp.asarray(x_train), jnp.asarray(y_train))
  # (b) needs k equal micro-batches: pad, and weigh the real rows only.
  (x_pad, y_pad), mask = jaxaccum.pad_batch((x_train, y_train), num_micro_batches)
  padded = (jnp.asarray(x_pad), jnp.asarray(y_pad), jnp.asarray(mask))

  # Two copies of one initialization, each with its own Adam state.
  model_full = MLP(hidden, rngs=nnx.Rngs(seed))
  model_accum = nnx.clone(model_full)
  opt_full = nnx.Optimizer(model_full, optax.adam(learning_rate), wrt=nnx.Param)
  opt_accum = nnx.Optimizer(model_accum, optax.adam(learning_rate), wrt=nnx.Param)

  # (a) the whole batch at once; (b) the same batch as k micro-batches.
  step_full = make_train_step(nnx.value_and_grad(loss_fn))
  step_accum = make_train_step(
    jaxaccum.nnx.value_and_grad(
      masked_loss_fn, num_micro_batches, normalize="weighted", has_aux=True
    )
  )

  losses_full, losses_accum = [], []
  predictions = None
  start = time.perf_counter()
  bar = tqdm(range(steps), desc="digits_mlp", disable=not progress)
  for step in bar:
    losses_full.append(step_full(model_full, opt_full, batch))
    loss_accum, predictions = step_accum(model_accum, opt_accum, padded)
    losses_accum.append(loss_accum)
    if step % 20 == 0 or step == steps - 1:
      bar.set_postfix(full=f"{losses_full[-1]:.4f}", accum=f"{losses_accum[-1]:.4f}")
  curve_full = np.asarray(jnp.stack(losses_full))
  curve_accum = np.asarray(jnp.stack(losses_accum))
  seconds = time.perf_counter() - start

  max_curve_diff = float(np.max(np.abs(curve_full - curve_accum)))
  max_rel_curve_diff = float(np.max(np.abs(curve_full - curve_accum) / curve_full))
  param_diffs = jax.tree.map(
    lambda a, b: jnp.max(jnp.abs(a - b)),
    nnx.state(model_full, nnx.Param),
    nnx.state(model_accum, nnx.Param),
  )
  max_param_diff = float(max(jax.tree.leaves(param_diffs)))
  acc_full = float(accuracy(model_full, x_test, y_test))
  acc_accum = float(accuracy(model_accum, x_test, y_test))
  # aux: the predictions of the last step, before its update, in row order;
  # the padding dropped.
  predicted = np.asarray(predictions)[:train_rows]
  train_acc_accum = float(np.mean(predicted == y_train))

  png = pathlib.Path(out_dir) / "digits_mlp.png"
  plot(curve_full, curve_accum, num_micro_batches, png)

  m = len(mask) // num_micro_batches
  print(
    f"full batch: {train_rows} rows; accumulated as {num_micro_batches} "
    f"micro-batches of {m} ({len(mask) - train_rows} padding rows, weight 0)"
  )
  print(
    f"final loss: full batch {curve_full[-1]:.6f}, accumulated {curve_accum[-1]:.6f}"
  )
  print(
    f"max |loss difference| over {steps} steps: {max_curve_diff:.3g} "
    f"(relative: {max_rel_curve_diff:.3g})"
  )
  print(f"max |parameter difference| after training: {max_param_diff:.3g}")
  print(f"test accuracy: full batch {acc_full:.4f}, accumulated {acc_accum:.4f}")
  print(
    "training accuracy of the last step (its per-row predictions, merged back "
    f"from the micro-batches): {train_acc_accum:.4f}"
  )
  print(f"training time, both runs: {seconds:.1f} s; plot: {png}")
  return {
    "losses_full": curve_full,
    "losses_accum": curve_accum,
    "max_curve_diff": max_curve_diff,
    "max_rel_curve_diff": max_rel_curve_diff,
    "max_param_diff": max_param_diff,
    "accuracy_full": acc_full,
    "accuracy_accum": acc_accum,
    "train_accuracy_accum": train_acc_accum,
    "padded_rows": len(mask) - train_rows,
    "seconds": seconds,
    "png": str(png),
  }


def plot(
  curve_full: np.ndarray, curve_accum: np.ndarray, k: int, png: pathlib.Path
) -> None:
  """The two loss curves, and their absolute difference on a log scale."""
  fig = Figure(figsize=(10, 4), layout="constrained")
  FigureCanvasAgg(fig)
  ax_loss, ax_diff = fig.subplots(1, 2)
  steps = np.arange(len(curve_full))
  ax_loss.plot(steps, curve_full, lw=3, alpha=0.5, label="full batch (nnx)")
  ax_loss.plot(steps, curve_accum, "--", lw=1.2, label=f"jaxaccum, k={k}")
  ax_loss.set(xlabel="optimizer step", ylabel="training loss (cross-entropy)")
  log_axis(ax_loss, curve_full, curve_accum)
  ax_loss.set_title("Same initialization, same full batch")
  ax_loss.legend()
  rel = np.abs(curve_full - curve_accum) / curve_full
  equal = int(np.sum(rel == 0))
  ax_diff.plot(steps, np.where(rel > 0, rel, np.nan), ".", ms=3)
  ax_diff.axhline(np.finfo(np.float32).eps, color="gray", ls=":", label="float32 eps")
  ax_diff.set(xlabel="optimizer step", ylabel="|full - accumulated| / full")
  ax_diff.set_yscale("log")
  ax_diff.set_title(f"Relative difference (bit-equal at {equal} of {len(rel)} steps)")
  ax_diff.legend()
  png.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(png, dpi=110)


if __name__ == "__main__":
  main(**ARGS)
