"""Accumulation across calls: a streamed loader, ``jaxaccum.accumulate`` and NNX.

Sometimes the micro-batches cannot be stacked into one batch in advance: they
arrive one at a time from a Python generator (a streaming loader, an RL
rollout). Then the accumulation happens across calls, in the optimizer:

    tx = jaxaccum.accumulate(optax.adam(lr), every_k=8)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

and a jitted micro-step computes ``nnx.grad`` on one micro-batch and calls
``optimizer.update(model, grads, ...)``. Seven calls in eight only add the
gradient into a float32 accumulator and leave the parameters alone; the call
that completes a window runs Adam once, on the window's gradient. The script
reads the ``AccumulateState`` inside ``optimizer.opt_state`` to show that
Adam stepped once per 8 micro-batches, while ``nnx.Optimizer``'s own counter
counts every call.

Two details that make each window's gradient exact:

- ``weight=``: the generator shuffles scikit-learn's bundled digits (1344
  training images, offline) into micro-batches of 20, so the last
  micro-batch of every epoch holds only 4 rows. The micro-step takes the
  gradient of the loss *sum* and passes ``weight=`` the number of rows, and
  the window applies ``sum(grads) / sum(rows)``: the exact mean over the
  window's rows, in which those 4 rows weigh as 4 rows, not as 20.
- ``flush=True`` on an epoch's last micro-batch ends the incomplete window
  there (68 micro-batches per epoch are 8 windows of 8 and one of 4), so no
  window mixes two epochs.

The script prints the step counts and the test accuracy, and plots the loss
per optimizer step and the inner step count per micro-step.

Run: ``python examples/cross_step.py [--epochs 12] [--out-dir outputs]``.
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
  add(
    "--epochs",
    type=count,
    default=12,
    metavar="N",
    help=f"passes over the {TRAIN_ROWS} training images",
  )
  add(
    "--micro-batch-size",
    type=count,
    default=20,
    metavar="N",
    help="rows per micro-batch; an epoch's last one holds the remainder",
  )
  add(
    "--every-k",
    type=count,
    default=8,
    metavar="K",
    help="micro-batches per optimizer step (the window)",
  )
  add("--hidden", type=count, default=128, metavar="N", help="hidden layer width")
  add(
    "--learning-rate",
    type=_cli.positive_float,
    default=3e-3,
    metavar="LR",
    help="Adam's learning rate",
  )
  add(
    "--no-flush-at-epoch-end",
    dest="flush_at_epoch_end",
    action="store_false",
    help="let windows run on across epochs, instead of ending the window at "
    "each epoch's last micro-batch",
  )
  _cli.add_run_options(
    parser,
    outputs="the plot, cross_step.png",
    seed_help="seeds the initialization and the shuffling (the split is fixed)",
  )
  args = parser.parse_args(argv)
  if args.micro_batch_size > TRAIN_ROWS:
    parser.error(
      f"--micro-batch-size {args.micro_batch_size} is more than the {TRAIN_ROWS} "
      "training images"
    )
  micro_batches = args.epochs * -(-TRAIN_ROWS // args.micro_batch_size)
  if not args.flush_at_epoch_end and micro_batches < args.every_k:
    parser.error(
      f"{micro_batches} micro-batches in all never complete a window of "
      f"--every-k {args.every_k}"
    )
  return _cli.keyword_arguments(args)


if __name__ == "__main__":
  # First thing: --help and a bad flag answer before JAX is imported (seconds).
  ARGS = parse_args()

import math
import pathlib
import time
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _digits import digits_split  # examples/_digits.py
from _plots import log_axis  # examples/_plots.py
from flax import nnx
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from tqdm import tqdm

import jaxaccum


def stream(
  x: np.ndarray, y: np.ndarray, size: int, epochs: int, rng: np.random.Generator
) -> Iterator[tuple[np.ndarray, np.ndarray, bool]]:
  """Yields ``(x_micro, y_micro, last_of_epoch)``, one micro-batch at a time.

  Each epoch is a fresh shuffle; its last micro-batch holds the remainder,
  ``len(x) % size`` rows, when ``size`` does not divide ``len(x)``.
  """
  for _ in range(epochs):
    order = rng.permutation(len(x))
    for start in range(0, len(x), size):
      rows = order[start : start + size]
      yield x[rows], y[rows], start + size >= len(x)


class MLP(nnx.Module):
  """64 -> hidden -> 10, with ReLU."""

  def __init__(self, hidden: int, *, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(64, hidden, rngs=rngs)
    self.out = nnx.Linear(hidden, 10, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.out(nnx.relu(self.hidden(x)))


@nnx.jit
def micro_step(
  model: MLP, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array, flush: jax.Array
) -> jax.Array:
  """One micro-batch: its gradient goes into the window; returns its loss sum."""

  def loss_sum(model):
    # A SUM over the rows, not a mean: accumulate() divides the window's sum
    # of gradients by the sum of the weights, here the rows.
    logits = model(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).sum()

  loss, grads = nnx.value_and_grad(loss_sum)(model)
  # Extra keyword arguments of nnx.Optimizer.update go to tx.update.
  # The parameters change only on the call that completes (or flushes) a window.
  optimizer.update(model, grads, weight=x.shape[0], flush=flush)
  return loss


@nnx.jit
def accuracy(model: MLP, x: jax.Array, y: jax.Array) -> jax.Array:
  return jnp.mean(jnp.argmax(model(x), axis=-1) == y)


def main(
  *,
  epochs: int = 12,
  micro_batch_size: int = 20,
  every_k: int = 8,
  hidden: int = 128,
  learning_rate: float = 3e-3,
  flush_at_epoch_end: bool = True,
  out_dir: str = "outputs",
  progress: bool = True,
  seed: int = 0,
) -> dict:
  """Trains from a generator of micro-batches; returns counts and results.

  Args:
    epochs: passes over the 1344 training images.
    micro_batch_size: rows per micro-batch; the epoch's last one holds the
      remainder.
    every_k: micro-batches per optimizer step (the window).
    hidden: the MLP's hidden width.
    learning_rate: Adam's learning rate.
    flush_at_epoch_end: end the window at each epoch's last micro-batch, even
      if incomplete; otherwise windows run on across epochs.
    out_dir: where the plot ``cross_step.png`` goes.
    progress: show a tqdm progress bar.
    seed: seeds the initialization and the shuffling (the split is fixed).

  Returns:
    A dict with ``micro_steps`` (calls of the micro-step),
    ``optimizer_steps`` (``AccumulateState.step``: Adam updates),
    ``adam_count`` (Adam's own ``count``), ``update_calls`` (``nnx.Optimizer``'s
    ``step`` counter), ``micro_steps_per_epoch``, ``window_sizes`` and
    ``window_rows`` (micro-batches and rows of each optimizer step),
    ``flushed_windows``, ``losses`` (the mean training loss of each window,
    over its rows), ``inner_step_per_micro_step``, ``epoch_test_accuracy``,
    ``test_accuracy``, ``seconds`` and ``png``.
  """
  x_train, y_train, x_test, y_test = digits_split()
  model = MLP(hidden, rngs=nnx.Rngs(seed))
  tx = jaxaccum.accumulate(optax.adam(learning_rate), every_k=every_k)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  # nnx.Optimizer keeps tx's state as it is, with each leaf wrapped in an
  # OptState variable: optimizer.opt_state is the AccumulateState(micro_step,
  # step, acc_grads, acc_weight, inner_state, num_skipped), and [...] reads a
  # variable's value, e.g. optimizer.opt_state.step[...].

  per_epoch = math.ceil(len(x_train) / micro_batch_size)
  micro_batches = stream(
    x_train, y_train, micro_batch_size, epochs, np.random.default_rng(seed)
  )
  inner_steps, losses, window_sizes, window_rows, epoch_acc = [], [], [], [], []
  window_loss, window_count, window_n = 0.0, 0, 0
  start = time.perf_counter()
  bar = tqdm(
    micro_batches,
    total=epochs * per_epoch,
    desc="cross_step",
    disable=not progress,
  )
  for x, y, last_of_epoch in bar:
    # flush is passed as an array, so it does not retrace micro_step; the
    # short last micro-batch (another shape) compiles it once more.
    flush = jnp.asarray(last_of_epoch and flush_at_epoch_end)
    loss_sum = micro_step(model, optimizer, x, y, flush)
    # The parameters stay fixed within a window, so these sums give the exact
    # training loss, over the window's rows, at the step's parameters.
    window_loss += float(loss_sum)
    window_count += 1
    window_n += len(y)
    inner_steps.append(int(optimizer.opt_state.step[...]))
    if inner_steps[-1] > (inner_steps[-2] if len(inner_steps) > 1 else 0):
      # Adam just ran: this micro-batch completed (or flushed) a window.
      losses.append(window_loss / window_n)
      window_sizes.append(window_count)
      window_rows.append(window_n)
      window_loss, window_count, window_n = 0.0, 0, 0
    if last_of_epoch:
      epoch_acc.append(float(accuracy(model, x_test, y_test)))
      bar.set_postfix(test_acc=f"{epoch_acc[-1]:.3f}", steps=inner_steps[-1])
  seconds = time.perf_counter() - start

  result = {
    "micro_steps": len(inner_steps),
    "optimizer_steps": int(optimizer.opt_state.step[...]),
    # inner_state is optax.adam's (ScaleByAdamState(count, mu, nu), EmptyState()).
    "adam_count": int(optimizer.opt_state.inner_state[0].count[...]),
    "update_calls": int(optimizer.step[...]),
    "micro_steps_per_epoch": per_epoch,
    "window_sizes": np.asarray(window_sizes),
    "window_rows": np.asarray(window_rows),
    "flushed_windows": sum(n < every_k for n in window_sizes),
    "losses": np.asarray(losses),
    "inner_step_per_micro_step": np.asarray(inner_steps),
    "epoch_test_accuracy": np.asarray(epoch_acc),
    "test_accuracy": epoch_acc[-1],
    "seconds": seconds,
  }
  png = pathlib.Path(out_dir) / "cross_step.png"
  plot(result, every_k, png)
  result["png"] = str(png)

  last_rows = len(x_train) - (per_epoch - 1) * micro_batch_size
  full_windows = len(window_sizes) - result["flushed_windows"]
  print(
    f"{result['micro_steps']} micro-batches of {micro_batch_size} rows, one "
    f"optimizer.update call each ({per_epoch} per epoch, the last with "
    f"{last_rows} rows)"
  )
  print(f"optimizer.update calls (nnx.Optimizer.step):    {result['update_calls']}")
  print(f"optimizer steps (AccumulateState.step):         {result['optimizer_steps']}")
  print(f"Adam updates (Adam's own count):                {result['adam_count']}")
  print(
    f"windows: {full_windows} of {every_k} micro-batches, "
    f"{result['flushed_windows']} ended early at an epoch's end (micro-batches "
    f"per window: {sorted(set(window_sizes))}; rows: {sorted(set(window_rows))})"
  )
  print(f"training loss: first optimizer step {losses[0]:.4f}, last {losses[-1]:.4f}")
  print(f"test accuracy: {result['test_accuracy']:.4f}")
  print(f"training time: {seconds:.1f} s; plot: {png}")
  return result


def plot(result: dict, every_k: int, png: pathlib.Path) -> None:
  """Loss per optimizer step, and the inner step count per micro-step."""
  fig = Figure(figsize=(10, 4), layout="constrained")
  FigureCanvasAgg(fig)
  ax_loss, ax_step = fig.subplots(1, 2)
  steps = np.arange(1, len(result["losses"]) + 1)
  flushed = result["window_sizes"] < every_k
  ax_loss.plot(steps, result["losses"], lw=1, label="window mean loss")
  ax_loss.plot(
    steps[flushed], result["losses"][flushed], "o", ms=3, label="flushed window"
  )
  ax_loss.set(xlabel="optimizer step", ylabel="training loss (window mean)")
  ax_loss.xaxis.set_major_locator(MaxNLocator(integer=True))
  log_axis(ax_loss, result["losses"])
  ax_loss.set_title("Loss per optimizer step")
  ax_loss.legend()
  inner = result["inner_step_per_micro_step"]
  micro = np.arange(1, len(inner) + 1)
  shown = micro <= 3 * result["micro_steps_per_epoch"]  # the first 3 epochs
  ax_step.step(micro[shown], inner[shown], where="post", label="AccumulateState.step")
  ax_step.plot(
    micro[shown],
    micro[shown] / every_k,
    ":",
    color="gray",
    label=f"micro-batches / {every_k}",
  )
  for epoch_end in range(
    result["micro_steps_per_epoch"],
    int(micro[shown][-1]) + 1,
    result["micro_steps_per_epoch"],
  ):
    ax_step.axvline(epoch_end, color="tab:red", lw=0.6, alpha=0.5)
  ax_step.set(
    xlabel="micro-batch (red: an epoch's end, which flushes the window)",
    ylabel="Adam updates (optimizer steps)",
  )
  ax_step.yaxis.set_major_locator(MaxNLocator(integer=True))
  ax_step.set_title(f"Adam runs once per {every_k} micro-batches")
  ax_step.legend()
  png.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(png, dpi=110)


if __name__ == "__main__":
  main(**ARGS)
