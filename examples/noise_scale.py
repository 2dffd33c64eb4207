"""Is my effective batch worth it? The gradient noise scale, measured for free.

Accumulation makes the effective batch ``B = k * m`` as large as you like, but
a larger batch is only worth its compute up to a point. McCandlish et al.
2018 ("An Empirical Model of Large-Batch Training") call that point the
critical batch size and estimate it by the simple noise scale

    B_simple = tr(Sigma) / |G|^2,

with ``G`` the true (expected) gradient and ``Sigma`` the covariance of the
per-example gradients. The noise of a batch-``B`` gradient is
``tr(Sigma) / B``, so ``B_simple`` is the batch at which the noise is as large
as the signal. Their model of training predicts, for a batch ``B`` (with
``B_simple`` standing in for their ``B_noise``),

    steps    S = S_min * (1 + B_simple / B)
    examples E = E_min * (1 + B / B_simple),

so well below ``B_simple`` doubling the batch nearly halves the steps, and
well above it a larger batch mostly spends more examples for the same steps.

``jaxaccum.value_and_grad(loss, k, noise_stats=True)`` measures it inside
the training step: the ``k`` micro-batch gradients are small-batch gradients
(``B_small = m``) and their mean is the big-batch gradient (``B_big = k * m``),
and two unbiased estimates of ``|G|^2`` and ``tr(Sigma)`` follow from their
squared norms (``jaxaccum.GradientNoise``). The cost is ONE squared norm per
micro-batch, nothing else: no per-example gradients, no extra pass.
``jaxaccum.noise_scale_update`` folds each step's estimates into exponential
moving averages, and ``jaxaccum.critical_batch_size`` returns their ratio,
``B_simple = EMA(S) / EMA(|G|^2)``, in examples.

The script trains an MLP on scikit-learn's bundled digits (8x8 images,
offline) with SGD with momentum; each step draws ``B`` training rows at random
and accumulates them as ``k`` micro-batches. The model is plain JAX (a list
of weight dicts): ``jaxaccum.nnx.value_and_grad`` has no ``noise_stats``
option. It prints ``B_simple`` over training, compares it with ``B`` and
plots both. ``B_simple`` grows as the loss falls, as McCandlish et al. observe:
the same batch that wastes examples in the first steps is small late in
training, which is the case for a batch-size ramp
(``jaxaccum.accumulate(..., every_k=callable)``).

Run: ``python examples/noise_scale.py [--steps 400] [--out-dir outputs]``.
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
  add("--steps", type=count, default=400, metavar="N", help="optimizer steps")
  add(
    "--num-micro-batches",
    type=_cli.int_at_least(2),
    default=8,
    metavar="K",
    help="micro-batches per optimizer step, at least 2 (the estimate compares "
    "micro-batch gradients with their mean)",
  )
  add(
    "--micro-batch-size",
    type=count,
    default=16,
    metavar="M",
    help=f"rows per micro-batch; the batch, K x M rows, is at most {TRAIN_ROWS}",
  )
  add("--hidden", type=count, default=128, metavar="N", help="hidden layer width")
  add(
    "--learning-rate",
    type=_cli.positive_float,
    default=0.05,
    metavar="LR",
    help="SGD's learning rate (momentum 0.9)",
  )
  add(
    "--decay",
    type=_cli.decay_rate,
    default=0.98,
    metavar="D",
    help="decay of the moving averages behind B_simple (between 0 and 1)",
  )
  _cli.add_run_options(
    parser,
    outputs="the plot, noise_scale.png",
    seed_help="seeds the initialization and the batch sampling",
  )
  args = parser.parse_args(argv)
  _cli.check_batch_fits(parser, args, TRAIN_ROWS)
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
from _mlp import init_mlp, mlp  # examples/_mlp.py
from _plots import log_axis  # examples/_plots.py
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from tqdm import tqdm

import jaxaccum


def loss_fn(params, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
  """The mean cross-entropy of a (micro-)batch."""
  x, y = batch
  return optax.softmax_cross_entropy_with_integer_labels(mlp(params, x), y).mean()


def interpret(b_simple: float, batch_size: int) -> list[str]:
  """A few lines that read ``B_simple`` against the batch, per McCandlish et al."""
  steps = 1 + b_simple / batch_size  # S / S_min
  examples = 1 + batch_size / b_simple  # E / E_min
  doubled = steps / (1 + b_simple / (2 * batch_size))
  side = "below" if batch_size < b_simple else "above"
  lines = [
    f"B_simple ~ {b_simple:.0f} examples: your batch of B = {batch_size} is "
    f"{side} the critical batch.",
    f"  predicted cost at B = {batch_size}: {steps:.2f} x the minimum number of "
    f"steps, {examples:.2f} x the minimum number of examples.",
  ]
  if side == "below":
    lines.append(
      f"  doubling the batch (twice the micro-batches) would divide the steps by "
      f"{doubled:.2f} at a small cost in examples: more accumulation is worth it."
    )
  else:
    lines.append(
      f"  doubling the batch would divide the steps by only {doubled:.2f} and spend "
      "more examples: a smaller batch (fewer micro-batches) is cheaper."
    )
  return lines


def main(
  *,
  steps: int = 400,
  num_micro_batches: int = 8,
  micro_batch_size: int = 16,
  hidden: int = 128,
  learning_rate: float = 0.05,
  decay: float = 0.98,
  out_dir: str = "outputs",
  progress: bool = True,
  seed: int = 0,
) -> dict:
  """Trains the MLP with in-step accumulation and tracks ``B_simple``.

  Args:
    steps: optimizer steps; each uses ``B = num_micro_batches *
      micro_batch_size`` training rows drawn at random without replacement.
    num_micro_batches: ``k``, at least 2 (the estimate needs two batch sizes).
    micro_batch_size: ``m``, the rows per micro-batch (``B_small``).
    hidden: the width of the two hidden layers.
    learning_rate: SGD's learning rate (momentum 0.9).
    decay: the decay of the moving averages in ``noise_scale_update``.
    out_dir: where the plot ``noise_scale.png`` goes.
    progress: show a tqdm progress bar.
    seed: seeds the initialization and the batch sampling.

  Returns:
    A dict with ``b_simple`` (the running ``B_simple`` after each step, in
    examples; float32 array of shape ``(steps,)``), ``trace`` and
    ``sq_norm`` (each step's raw estimates of ``tr(Sigma)`` and ``|G|^2``),
    ``losses`` (the training loss of each step's batch), ``batch_size``,
    ``micro_batch_size``, ``num_micro_batches``, ``final_b_simple``,
    ``crossed_at`` (the first step after which ``B_simple`` stayed above the
    batch size, or ``None``), ``final_loss``, ``accuracy`` (test accuracy),
    ``params_finite``, ``seconds`` and ``png``.
  """
  if num_micro_batches < 2:
    raise ValueError(
      f"The noise scale needs num_micro_batches >= 2, got {num_micro_batches}."
    )
  batch_size = num_micro_batches * micro_batch_size
  if batch_size > TRAIN_ROWS:
    raise ValueError(
      f"The batch of {batch_size} rows exceeds the {TRAIN_ROWS} training rows."
    )
  x_train, y_train, x_test, y_test = digits_split()
  x_all, y_all = jnp.asarray(x_train), jnp.asarray(y_train)

  key = jax.random.key(seed)
  params = init_mlp(jax.random.fold_in(key, 0), (64, hidden, hidden, 10))
  tx = optax.sgd(learning_rate, momentum=0.9)
  opt_state = tx.init(params)
  tracker = jaxaccum.noise_scale_init()
  grad_fn = jaxaccum.value_and_grad(loss_fn, num_micro_batches, noise_stats=True)

  @jax.jit
  def train_step(params, opt_state, tracker, step_key):
    rows = jax.random.choice(step_key, TRAIN_ROWS, (batch_size,), replace=False)
    # k micro-batches of m rows, one lax.scan; `noise` is a GradientNoise.
    (loss, grads), noise = grad_fn(params, (x_all[rows], y_all[rows]))
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    tracker = jaxaccum.noise_scale_update(tracker, noise, decay)
    stats = jnp.stack(
      [loss, jaxaccum.critical_batch_size(tracker), noise.trace(), noise.sq_norm()]
    )
    return params, opt_state, tracker, stats

  history = []
  start = time.perf_counter()
  bar = tqdm(range(steps), desc="noise_scale", disable=not progress)
  for step in bar:
    step_key = jax.random.fold_in(jax.random.fold_in(key, 1), step)
    params, opt_state, tracker, stats = train_step(params, opt_state, tracker, step_key)
    history.append(stats)
    if step % 25 == 0 or step == steps - 1:
      loss, b_simple = (float(v) for v in stats[:2])
      bar.set_postfix(loss=f"{loss:.3f}", B_simple=f"{b_simple:.0f}")
  losses, b_simple, trace, sq_norm = np.asarray(jnp.stack(history)).T
  seconds = time.perf_counter() - start

  logits = mlp(params, jnp.asarray(x_test))
  accuracy = float(jnp.mean(jnp.argmax(logits, axis=-1) == jnp.asarray(y_test)))
  params_finite = all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(params))
  final_b_simple = float(b_simple[-1])
  below = np.flatnonzero(b_simple <= batch_size)
  crossed_at = None
  if b_simple[-1] > batch_size:
    crossed_at = int(below[-1]) + 1 if below.size else 0

  png = pathlib.Path(out_dir) / "noise_scale.png"
  plot(
    losses=losses,
    b_simple=b_simple,
    batch_size=batch_size,
    micro_batch_size=micro_batch_size,
    accuracy=accuracy,
    png=png,
  )

  print(
    f"batch B = {batch_size} rows = {num_micro_batches} micro-batches of "
    f"{micro_batch_size}; SGD with momentum, {steps} optimizer steps"
  )
  marks = sorted({0, steps // 10, steps // 4, steps // 2, (3 * steps) // 4, steps - 1})
  print("B_simple (the critical batch, in examples; moving averages) over training:")
  for s in marks:
    print(f"  step {s:4d}: loss {losses[s]:.4f}  B_simple {b_simple[s]:8.1f}")
  for line in interpret(final_b_simple, batch_size):
    print(line)
  if crossed_at is not None and crossed_at > 0:
    print(
      f"B_simple rose past B = {batch_size} at step {crossed_at}: before, the batch "
      "was above critical (examples partly wasted); since, it is below (steps are "
      "the bottleneck), so a batch-size ramp would fit this run."
    )
  print(f"final training loss {losses[-1]:.4f}, test accuracy {accuracy:.4f}")
  print(f"training time: {seconds:.1f} s; plot: {png}")
  return {
    "b_simple": b_simple,
    "trace": trace,
    "sq_norm": sq_norm,
    "losses": losses,
    "batch_size": batch_size,
    "micro_batch_size": micro_batch_size,
    "num_micro_batches": num_micro_batches,
    "final_b_simple": final_b_simple,
    "crossed_at": crossed_at,
    "final_loss": float(losses[-1]),
    "accuracy": accuracy,
    "params_finite": params_finite,
    "seconds": seconds,
    "png": str(png),
  }


def plot(
  *,
  losses: np.ndarray,
  b_simple: np.ndarray,
  batch_size: int,
  micro_batch_size: int,
  accuracy: float,
  png: pathlib.Path,
) -> None:
  """``B_simple`` against the batch size, and the training loss."""
  fig = Figure(figsize=(11, 4), layout="constrained")
  FigureCanvasAgg(fig)
  ax_b, ax_loss = fig.subplots(1, 2)
  steps = np.arange(len(b_simple))
  ax_b.plot(steps, b_simple, label="B_simple (ratio of moving averages)")
  ax_b.axhline(batch_size, color="C3", ls="--", label=f"batch B = {batch_size}")
  ax_b.axhline(
    micro_batch_size, color="gray", ls=":", label=f"micro-batch m = {micro_batch_size}"
  )
  ax_b.fill_between(
    steps,
    b_simple,
    batch_size,
    where=b_simple > batch_size,
    color="C2",
    alpha=0.15,
    label="B < B_simple: more accumulation pays",
  )
  ax_b.fill_between(
    steps,
    b_simple,
    batch_size,
    where=b_simple <= batch_size,
    color="C3",
    alpha=0.1,
    label="B > B_simple: examples partly wasted",
  )
  ax_b.set(xlabel="optimizer step", ylabel="batch size (examples)")
  log_axis(ax_b, b_simple, batch_size, micro_batch_size)
  ax_b.set_title("Gradient noise scale B_simple vs. the batch")
  ax_b.legend(loc="lower right", fontsize=8)
  ax_loss.plot(steps, losses, lw=0.8)
  ax_loss.set(xlabel="optimizer step", ylabel="training loss (batch mean)")
  log_axis(ax_loss, losses)
  ax_loss.set_title(f"Training loss (test accuracy {accuracy:.3f})")
  png.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(png, dpi=110)


if __name__ == "__main__":
  main(**ARGS)
