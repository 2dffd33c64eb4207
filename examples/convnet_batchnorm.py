"""The Flax Linen recipe: BatchNorm statistics and dropout keys, accumulated.

A Linen convnet with BatchNorm and Dropout learns scikit-learn's bundled
digits (8x8x1 images, offline). Each optimizer step sees a batch of 256
images, computed as 8 micro-batches of 32 inside one jitted step with
``jaxaccum.value_and_grad``. Two things in a Linen model are not parameters,
and both need care when a batch is split:

- **BatchNorm statistics** (the ``batch_stats`` collection) are mutable state.
  ``state_argnum`` threads them through the micro-batches in order:
  micro-batch ``i + 1`` sees the running averages that micro-batch ``i``
  wrote, exactly as if the micro-batches had been run one after another, and
  the step returns the final statistics. Each micro-batch normalizes with its
  own mean and variance, as BatchNorm does per device in data parallelism; so
  the gradient is the mean of the k micro-batch gradients (tests/test_linen.py
  checks it against that Python loop), not that of one 256-image BatchNorm.
  The running averages so move k times per step: at k = 8, built with 0.9
  they would decay by 0.9^8 = 0.43 per step, moving 5.7 times as far as the
  full batch's. ``jaxaccum.micro_batch_momentum(0.9, k)`` (``0.9^(1/k)``) is
  the momentum per micro-batch that keeps 0.9 per step.
- **Dropout keys**: ``rng_argnum`` gives micro-batch ``i`` the key
  ``jax.random.fold_in(key, i)``, so every micro-batch draws its own mask.
  Passing one key to every micro-batch would repeat the same mask k times.

The recipe is the ``loss_fn`` and ``train_step`` below; copy those. The model
is evaluated with ``train=False``, on the running averages the steps built.
The script prints the test accuracy and plots the training loss and the test
accuracy.

Run: ``python examples/convnet_batchnorm.py [--steps 200] [--out-dir outputs]``.
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
    "--batch-size",
    type=count,
    default=256,
    metavar="N",
    help=f"images per optimizer step, the full batch (at most {TRAIN_ROWS})",
  )
  add(
    "--num-micro-batches",
    type=count,
    default=8,
    metavar="K",
    help="micro-batches per optimizer step; must divide the batch size",
  )
  add(
    "--learning-rate",
    type=_cli.positive_float,
    default=3e-3,
    metavar="LR",
    help="Adam's learning rate",
  )
  add(
    "--eval-every",
    type=count,
    default=20,
    metavar="N",
    help="measure the test accuracy every N optimizer steps",
  )
  _cli.add_run_options(
    parser,
    outputs="the plot, convnet_batchnorm.png",
    seed_help="seeds the initialization, dropout and shuffling (the split is fixed)",
  )
  args = parser.parse_args(argv)
  if args.batch_size > TRAIN_ROWS:
    parser.error(
      f"--batch-size {args.batch_size} is more than the {TRAIN_ROWS} training images"
    )
  if args.batch_size % args.num_micro_batches:
    parser.error(
      f"--batch-size {args.batch_size} does not split into "
      f"--num-micro-batches {args.num_micro_batches} equal micro-batches"
    )
  return _cli.keyword_arguments(args)


if __name__ == "__main__":
  # First thing: --help and a bad flag answer before JAX is imported (seconds).
  ARGS = parse_args()

import pathlib
import time
from collections.abc import Iterator
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _digits import digits_split  # examples/_digits.py
from _plots import log_axis  # examples/_plots.py
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from tqdm import tqdm

import jaxaccum


class ConvNet(nn.Module):
  """Conv-BN-ReLU, 2x2 max pooling, Conv-BN-ReLU, Dense-ReLU-Dropout, Dense."""

  dropout_rate: float = 0.3
  momentum: float = 0.9  # BatchNorm's, per call: per micro-batch here

  @nn.compact
  def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
    # train=True: normalize with the batch's statistics and update the running
    # averages in "batch_stats"; train=False: normalize with the averages.
    x = nn.Conv(16, (3, 3))(x)  # (batch, 8, 8, 16)
    x = nn.BatchNorm(use_running_average=not train, momentum=self.momentum)(x)
    x = nn.relu(x)
    x = nn.max_pool(x, (2, 2), strides=(2, 2))  # (batch, 4, 4, 16)
    x = nn.Conv(32, (3, 3))(x)  # (batch, 4, 4, 32)
    x = nn.BatchNorm(use_running_average=not train, momentum=self.momentum)(x)
    x = nn.relu(x)
    x = x.reshape((x.shape[0], -1))
    x = nn.relu(nn.Dense(64)(x))
    x = nn.Dropout(self.dropout_rate, deterministic=not train)(x)
    return nn.Dense(10)(x)


class TrainState(NamedTuple):
  """What a step carries to the next.

  (With ``flax.training.train_state.TrainState`` plus a ``batch_stats`` field,
  the update is ``state.apply_gradients(grads=grads, batch_stats=...)``.)
  """

  step: jax.Array  # shape=(), int32
  params: Any
  batch_stats: Any
  opt_state: Any


def make_train_step(model: ConvNet, tx: optax.GradientTransformation, k: int):
  """Builds the jitted training step: the Linen recipe for jaxaccum."""

  # 1. The loss of ONE micro-batch. The argument order matters only through the
  #    argnums below: params (0, differentiated), batch (1, split into k
  #    micro-batches), dropout_key (2, rng_argnum), batch_stats (3,
  #    state_argnum). It returns (loss, (aux, new_batch_stats)).
  def loss_fn(params, batch, dropout_key, batch_stats):
    images, labels = batch
    logits, updates = model.apply(
      {"params": params, "batch_stats": batch_stats},
      images,
      train=True,
      rngs={"dropout": dropout_key},  # fold_in(step key, i) for micro-batch i
      mutable=["batch_stats"],  # returns the updated running averages
    )
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    aux = {"accuracy": jnp.mean(jnp.argmax(logits, axis=-1) == labels)}
    return loss, (aux, updates["batch_stats"])

  # 2. The accumulated value_and_grad. normalize="mean" (the default) matches
  #    the per-example mean loss above; the micro-batches are equal in size.
  grad_fn = jaxaccum.value_and_grad(
    loss_fn,
    k,  # num_micro_batches: the batch's leading axis must divide by k
    rng_argnum=2,  # micro-batch i gets jax.random.fold_in(dropout_key, i)
    state_argnum=3,  # batch_stats: micro-batch i+1 sees micro-batch i's output
    has_aux=True,  # required with state_argnum
  )

  # 3. One jitted step, one optimizer update.
  @jax.jit
  def train_step(state: TrainState, batch, key: jax.Array):
    # A fresh key per step; jaxaccum folds in the micro-batch index on top.
    dropout_key = jax.random.fold_in(key, state.step)
    (loss, (aux, batch_stats)), grads = grad_fn(
      state.params, batch, dropout_key, state.batch_stats
    )
    # loss and grads: the means over the k micro-batches, grads in the
    # parameters' dtype; aux["accuracy"]: the mean over the micro-batches,
    # the whole batch's accuracy; batch_stats: the running averages after
    # all k micro-batches.
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    new_state = TrainState(state.step + 1, params, batch_stats, opt_state)
    return new_state, loss, aux["accuracy"]

  return train_step


def make_evaluate(model: ConvNet):
  @jax.jit
  def evaluate(state: TrainState, images: jax.Array, labels: jax.Array):
    # 4. Evaluation uses the running averages: train=False, nothing mutable.
    logits = model.apply(
      {"params": state.params, "batch_stats": state.batch_stats},
      images,
      train=False,
    )
    return jnp.mean(jnp.argmax(logits, axis=-1) == labels)

  return evaluate


def shuffled_batches(
  x: np.ndarray, y: np.ndarray, batch_size: int, rng: np.random.Generator
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  """Endless epochs of shuffled batches; each epoch drops its remainder."""
  while True:
    order = rng.permutation(len(x))
    for start in range(0, len(x) - batch_size + 1, batch_size):
      rows = order[start : start + batch_size]
      yield x[rows], y[rows]


def main(
  *,
  steps: int = 200,
  batch_size: int = 256,
  num_micro_batches: int = 8,
  learning_rate: float = 3e-3,
  eval_every: int = 20,
  out_dir: str = "outputs",
  progress: bool = True,
  seed: int = 0,
) -> dict:
  """Trains the convnet with accumulated steps; returns the results.

  Args:
    steps: optimizer steps.
    batch_size: images per optimizer step, the effective batch.
    num_micro_batches: ``k``; ``batch_size`` must divide by it.
    learning_rate: Adam's learning rate.
    eval_every: evaluate the test accuracy every this many steps.
    out_dir: where the plot ``convnet_batchnorm.png`` goes.
    progress: show a tqdm progress bar.
    seed: seeds the initialization, dropout and shuffling (the split is fixed).

  Returns:
    A dict with ``losses`` (the batch loss of every step, shape ``(steps,)``),
    ``train_accuracy`` (the dropout-on accuracy of every batch),
    ``eval_steps`` and ``test_accuracies`` (the accuracy curve),
    ``test_accuracy`` (final, ``train=False``), ``batch_stats_mean`` (the
    first BatchNorm's running mean after training), ``momentum`` (its
    momentum per micro-batch), ``seconds`` and ``png``.
  """
  x_train, y_train, x_test, y_test = digits_split(images=True)  # NHWC: (rows, 8, 8, 1)
  # The full batch's momentum, 0.9 per step, over k micro-batches per step.
  model = ConvNet(momentum=jaxaccum.micro_batch_momentum(0.9, num_micro_batches))
  init_key, dropout_key = jax.random.split(jax.random.key(seed))
  variables = model.init(init_key, jnp.asarray(x_train[:1]), train=False)
  tx = optax.adam(learning_rate)
  state = TrainState(
    step=jnp.zeros((), jnp.int32),
    params=variables["params"],
    batch_stats=variables["batch_stats"],
    opt_state=tx.init(variables["params"]),
  )
  train_step = make_train_step(model, tx, num_micro_batches)
  evaluate = make_evaluate(model)
  batches = shuffled_batches(x_train, y_train, batch_size, np.random.default_rng(seed))

  losses, train_acc, eval_steps, test_accs = [], [], [], []
  start = time.perf_counter()
  bar = tqdm(range(steps), desc="convnet_batchnorm", disable=not progress)
  for step in bar:
    state, loss, acc = train_step(state, next(batches), dropout_key)
    losses.append(loss)
    train_acc.append(acc)
    if (step + 1) % eval_every == 0 or step == steps - 1:
      eval_steps.append(step + 1)
      test_accs.append(float(evaluate(state, x_test, y_test)))
      bar.set_postfix(loss=f"{float(loss):.4f}", test_acc=f"{test_accs[-1]:.3f}")
  losses_np = np.asarray(jnp.stack(losses))
  train_acc_np = np.asarray(jnp.stack(train_acc))
  seconds = time.perf_counter() - start

  png = pathlib.Path(out_dir) / "convnet_batchnorm.png"
  m = batch_size // num_micro_batches
  plot(
    losses_np, train_acc_np, eval_steps, test_accs, k=num_micro_batches, m=m, png=png
  )
  bn_mean = np.asarray(state.batch_stats["BatchNorm_0"]["mean"])
  print(
    f"batch of {batch_size} images = {num_micro_batches} micro-batches of {m}, "
    f"{steps} optimizer steps"
  )
  print(
    f"loss: first step {losses_np[0]:.4f}, last 10 steps {losses_np[-10:].mean():.4f}"
  )
  print(
    "test accuracy (BatchNorm on its running averages, dropout off): "
    f"{test_accs[-1]:.4f}"
  )
  print(f"training time: {seconds:.1f} s ({steps} steps); plot: {png}")
  return {
    "losses": losses_np,
    "train_accuracy": train_acc_np,
    "eval_steps": np.asarray(eval_steps),
    "test_accuracies": np.asarray(test_accs),
    "test_accuracy": test_accs[-1],
    "batch_stats_mean": bn_mean,
    "momentum": model.momentum,
    "seconds": seconds,
    "png": str(png),
  }


def plot(losses, train_acc, eval_steps, test_accs, *, k, m, png: pathlib.Path) -> None:
  """The training loss per step, and the train and test accuracy."""
  fig = Figure(figsize=(10, 4), layout="constrained")
  FigureCanvasAgg(fig)
  ax_loss, ax_acc = fig.subplots(1, 2)
  steps = np.arange(1, len(losses) + 1)
  ax_loss.plot(steps, losses, lw=1)
  ax_loss.set(xlabel="optimizer step", ylabel="training loss (batch mean)")
  log_axis(ax_loss, losses)
  ax_loss.set_title(f"Linen convnet, BatchNorm + Dropout, {k} micro-batches of {m}")
  ax_acc.plot(steps, train_acc, lw=0.8, alpha=0.6, label="train batch (dropout on)")
  ax_acc.plot(eval_steps, test_accs, "o-", label="test (running averages)")
  ax_acc.set(xlabel="optimizer step", ylabel="accuracy", ylim=(0.0, 1.02))
  ax_acc.legend(loc="lower right")
  png.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(png, dpi=110)


if __name__ == "__main__":
  main(**ARGS)
