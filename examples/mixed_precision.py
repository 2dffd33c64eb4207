"""Mixed precision with accumulation: bf16 compute, float16 with loss scaling.

Both parts train an MLP on scikit-learn's bundled digits (8x8 images,
offline). The parameters are float32 *master weights* throughout; only the
forward and backward passes run in 16 bits, and jaxaccum adds the micro-batch
gradients in float32.

(a) bfloat16. The loss casts the float32 parameters and the inputs to bf16,
    runs the MLP in bf16 and the softmax cross-entropy in float32. The cast's
    transpose widens each micro-batch gradient back to float32 (its values
    are bf16-accurate), ``jaxaccum.value_and_grad`` sums the ``k`` of them in
    float32 and Adam updates the float32 master weights. At the initial
    weights, on the whole training set, the script compares three ways of
    adding the same bf16 micro-batch gradients against a float32 reference:

    - jaxaccum, float32 sum: what the training uses;
    - jaxaccum on a bf16 copy of the parameters: the micro-batch gradients are
      bf16 in dtype, ``accum_dtype=float32`` (the default) still sums them in
      float32 and rounds the mean to bf16 once, at the end;
    - a naive bf16 running sum, ``acc = acc + g`` in bf16, for contrast.

    All three are within bf16 tolerance of float32 (bf16 compute dominates),
    but only the float32 sums add no error of their own: the bf16 running sum
    rounds at every micro-batch, and its error grows with ``k``.

(b) float16 with dynamic loss scaling. float16 keeps 3 more mantissa bits
    than bf16 but has a narrow range: small gradients underflow to zero,
    large ones overflow. The optimizer is

        tx = jaxaccum.accumulate(optax.adam(lr), every_k=1,
                                 loss_scale=jaxaccum.dynamic_loss_scale(...))
        step = jaxaccum.make_train_step(fp16_loss, tx, k)

    The step multiplies the loss by the current scale before the float16
    backward pass, accumulates the ``k`` scaled micro-batch gradients in
    float32, and ``accumulate`` divides by the scale in float32. A step in
    which any micro-batch overflowed is skipped as a whole (parameters and
    Adam state unchanged) and the scale is halved; after ``growth_interval``
    clean steps it doubles. The library's default interval, 2000, suits long
    runs; the script uses 25 so that the scale visibly adapts in a few
    hundred steps. The script checks after every step that no NaN or Inf
    reached the parameters, and that a skipped step left them bit-identical.

Run: ``python examples/mixed_precision.py [--steps-bf16 200] [--steps-fp16 300]``.
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
    "--steps-bf16",
    type=count,
    default=200,
    metavar="N",
    help="optimizer steps of part (a)",
  )
  add(
    "--steps-fp16",
    type=count,
    default=300,
    metavar="N",
    help="optimizer steps of part (b)",
  )
  add(
    "--num-micro-batches",
    type=count,
    default=8,
    metavar="K",
    help="micro-batches per optimizer step, in both parts",
  )
  add(
    "--micro-batch-size",
    type=count,
    default=32,
    metavar="M",
    help=f"rows per micro-batch; a step draws K x M of the {TRAIN_ROWS} training rows",
  )
  add("--hidden", type=count, default=128, metavar="N", help="hidden layer width")
  add(
    "--learning-rate",
    type=_cli.positive_float,
    default=3e-3,
    metavar="LR",
    help="Adam's learning rate, in both parts",
  )
  add(
    "--compare-ks",
    type=_cli.int_at_least(2),
    nargs="+",
    default=(8, 64),
    metavar="K",
    help="micro-batch counts of part (a)'s gradient comparison on the whole "
    f"training set; each at least 2 and a divisor of {TRAIN_ROWS}",
  )
  add(
    "--initial-scale",
    type=_cli.positive_float,
    default=2.0**15,
    metavar="S",
    help="the first loss scale of part (b)",
  )
  add(
    "--growth-interval",
    type=count,
    default=25,
    metavar="N",
    help="steps without overflow before the loss scale doubles",
  )
  _cli.add_run_options(
    parser,
    outputs="the plot, mixed_precision.png",
    seed_help="seeds the initialization and the batch sampling",
  )
  args = parser.parse_args(argv)
  _cli.check_batch_fits(parser, args, TRAIN_ROWS)
  for k in args.compare_ks:
    if TRAIN_ROWS % k:
      parser.error(f"--compare-ks: {k} does not divide the {TRAIN_ROWS} rows")
  return _cli.keyword_arguments(args)


if __name__ == "__main__":
  # First thing: --help and a bad flag answer before JAX is imported (seconds).
  ARGS = parse_args()

import functools
import math
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

BF16_EPS = float(jnp.finfo(jnp.bfloat16).eps)  # 2^-7


def cast(tree, dtype):
  return jax.tree.map(lambda a: a.astype(dtype), tree)


def cross_entropy(logits: jax.Array, y: jax.Array) -> jax.Array:
  """The mean softmax cross-entropy, computed in float32 whatever the logits."""
  logits = logits.astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def loss_f32(params, batch):
  """The float32 reference loss."""
  x, y = batch
  return cross_entropy(mlp(params, x), y)


def low_precision_loss(dtype):
  """The loss of float32 master ``params``, with the MLP run in ``dtype``."""

  def loss(params, batch):
    x, y = batch
    return cross_entropy(mlp(cast(params, dtype), x.astype(dtype)), y)

  return loss


loss_bf16 = low_precision_loss(jnp.bfloat16)
loss_fp16 = low_precision_loss(jnp.float16)


def rel_error(tree, ref) -> float:
  """``|tree - ref| / |ref|`` over all leaves, in float64."""
  a = np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])
  b = np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(ref)])
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@jax.jit
def bf16_running_mean(stacked):
  """The naive accumulator: ``acc = acc + g`` in bf16, then ``acc / k`` in bf16."""

  def add(acc, g):
    return jax.tree.map(lambda a, b: a + b.astype(jnp.bfloat16), acc, g), None

  zeros = jax.tree.map(lambda g: jnp.zeros(g.shape[1:], jnp.bfloat16), stacked)
  total, _ = jax.lax.scan(add, zeros, stacked)
  k = jax.tree.leaves(stacked)[0].shape[0]
  return jax.tree.map(lambda a: a / jnp.asarray(k, jnp.bfloat16), total)


def loss_of_bf16_params(params_bf16, batch):
  """The loss of a bf16 copy of the parameters: its gradient is bf16 in dtype."""
  x, y = batch
  return cross_entropy(mlp(params_bf16, x.astype(jnp.bfloat16)), y)


@functools.partial(jax.jit, static_argnums=2)
def bf16_gradients(params, batch, k: int):
  """The three accumulations of one batch's ``k`` bf16 micro-batch gradients.

  Returns ``(accumulated, bf16_grads, micro)``: jaxaccum's float32 sum of
  the float32-typed gradients, jaxaccum on a bf16 copy of the parameters
  (bf16 in, float32 sum, bf16 out), and the ``k`` micro-batch gradients
  stacked, computed by a ``lax.map`` exactly as jaxaccum's loop does.
  """
  _, accumulated = jaxaccum.value_and_grad(loss_bf16, k)(params, batch)
  params_bf16 = cast(params, jnp.bfloat16)
  _, bf16_grads = jaxaccum.value_and_grad(loss_of_bf16_params, k)(params_bf16, batch)
  x, y = batch
  micro_batches = (x.reshape(k, -1, x.shape[-1]), y.reshape(k, -1))
  micro = jax.lax.map(lambda b: jax.grad(loss_bf16)(params, b), micro_batches)
  return accumulated, bf16_grads, micro


def gradient_check(
  params, x: jax.Array, y: jax.Array, ks: tuple[int, ...]
) -> list[dict]:
  """Accumulated bf16 gradients of the whole batch against a float32 reference.

  For each ``k``: the relative errors against the float32 full-batch gradient
  (``*_vs_f32``) and against the exact (float64) mean of the very same bf16
  micro-batch gradients (``*_vs_exact``: the error the accumulation adds).
  """
  reference = jax.jit(jax.grad(loss_f32))(params, (x, y))
  rows = []
  for k in ks:
    accumulated, bf16_grads, micro = bf16_gradients(params, (x, y), k)
    exact = jax.tree.map(lambda g: np.asarray(g, np.float64).mean(axis=0), micro)
    naive = bf16_running_mean(micro)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(accumulated))
    assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(bf16_grads))
    rows.append(
      {
        "k": k,
        "jaxaccum_vs_f32": rel_error(accumulated, reference),
        "jaxaccum_bf16_params_vs_f32": rel_error(bf16_grads, reference),
        "bf16_sum_vs_f32": rel_error(naive, reference),
        "jaxaccum_vs_exact": rel_error(accumulated, exact),
        "jaxaccum_bf16_params_vs_exact": rel_error(bf16_grads, exact),
        "bf16_sum_vs_exact": rel_error(naive, exact),
      }
    )
  return rows


@jax.jit
def all_finite(tree) -> jax.Array:
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(a)) for a in jax.tree.leaves(tree)]))


def accuracy(params, x: np.ndarray, y: np.ndarray, dtype) -> float:
  """Test accuracy with the forward pass in ``dtype``, as the model runs."""
  logits = mlp(cast(params, dtype), jnp.asarray(x).astype(dtype))
  return float(jnp.mean(jnp.argmax(logits, axis=-1) == jnp.asarray(y)))


@jax.jit
def float32_and_float16_grads(params, batch, scale):
  """The float32 gradient, and the float16 one of ``scale * loss``, unscaled."""
  ref = jax.grad(loss_f32)(params, batch)
  half = jax.grad(lambda p: loss_fp16(p, batch) * scale)(params)
  return ref, half


def underflow_fraction(params, batch, scale: float) -> float:
  """Entries of a float16 gradient that are 0 where the float32 one is not."""
  ref, half = float32_and_float16_grads(params, batch, jnp.float32(scale))
  ref_flat = np.concatenate([np.ravel(g) for g in jax.tree.leaves(ref)])
  half_flat = np.concatenate([np.ravel(g) for g in jax.tree.leaves(half)])
  nonzero = ref_flat != 0
  return float(np.mean(half_flat[nonzero] == 0))


def log2(value: float) -> str:
  return f"2^{math.log2(value):g}"


def main(
  *,
  steps_bf16: int = 200,
  steps_fp16: int = 300,
  num_micro_batches: int = 8,
  micro_batch_size: int = 32,
  hidden: int = 128,
  learning_rate: float = 3e-3,
  compare_ks: tuple[int, ...] = (8, 64),
  initial_scale: float = 2.0**15,
  growth_interval: int = 25,
  out_dir: str = "outputs",
  progress: bool = True,
  seed: int = 0,
) -> dict:
  """Runs part (a), bf16, and part (b), float16 with dynamic loss scaling.

  Args:
    steps_bf16: optimizer steps of part (a).
    steps_fp16: optimizer steps of part (b).
    num_micro_batches: ``k`` of the training steps in both parts.
    micro_batch_size: ``m``; every step draws ``k * m`` training rows at random.
    hidden: the width of the two hidden layers.
    learning_rate: Adam's learning rate in both parts.
    compare_ks: the ``k`` of the gradient comparison in part (a), on the
      whole training set; each must divide 1344.
    initial_scale: the first loss scale of part (b).
    growth_interval: clean steps before the loss scale doubles.
    out_dir: where the plot ``mixed_precision.png`` goes.
    progress: show tqdm progress bars.
    seed: seeds the initialization and the batch sampling.

  Returns:
    A dict with ``grad_check`` (one dict of relative errors per ``k``, see
    :func:`gradient_check`), ``losses_bf16`` and ``losses_fp16`` (the
    training loss of each step), ``final_loss_bf16``, ``final_loss_fp16``,
    ``accuracy_bf16``, ``accuracy_fp16`` (test accuracy, forward pass in bf16
    and float16), ``master_dtype``, ``loss_scale_history`` (the scale each
    float16 step used, float32 array of shape ``(steps_fp16,)``),
    ``final_loss_scale``, ``skipped_steps`` (indices of the overflowed
    steps), ``num_skipped`` (from the optimizer state), ``params_finite``
    (checked after every step of both parts), ``underflow_unscaled`` and
    ``underflow_scaled`` (the fraction of nonzero gradient entries that a
    float16 backward pass flushes to zero without and with the final scale),
    ``seconds`` and ``png``.
  """
  x_train, y_train, x_test, y_test = digits_split()
  x_all, y_all = jnp.asarray(x_train), jnp.asarray(y_train)
  batch_size = num_micro_batches * micro_batch_size
  rng = np.random.default_rng(seed)
  key = jax.random.key(seed)
  start = time.perf_counter()

  def sample():
    rows = rng.choice(TRAIN_ROWS, batch_size, replace=False)
    return x_all[rows], y_all[rows]

  # (a) bf16 compute, float32 accumulation, float32 master weights.
  params = init_mlp(key, (64, hidden, hidden, 10))
  grad_check = gradient_check(params, x_all, y_all, compare_ks)
  tx_a = optax.adam(learning_rate)
  opt_state = tx_a.init(params)
  step_a = jaxaccum.make_train_step(loss_bf16, tx_a, num_micro_batches)
  losses_bf16 = []
  params_finite = True
  bar = tqdm(range(steps_bf16), desc="(a) bf16", disable=not progress)
  for step in bar:
    params, opt_state, loss = step_a(params, opt_state, sample())
    losses_bf16.append(loss)
    params_finite &= bool(all_finite(params))
    if step % 25 == 0 or step == steps_bf16 - 1:
      bar.set_postfix(loss=f"{float(loss):.4f}")
  losses_bf16 = np.asarray(jnp.stack(losses_bf16))
  master_dtype = str(jax.tree.leaves(params)[0].dtype)
  accuracy_bf16 = accuracy(params, x_test, y_test, jnp.bfloat16)

  # (b) float16 forward/backward with a dynamic loss scale, float32 master weights.
  params = init_mlp(key, (64, hidden, hidden, 10))
  loss_scale = jaxaccum.dynamic_loss_scale(
    initial_scale, growth_interval=growth_interval
  )
  tx_b = jaxaccum.accumulate(
    optax.adam(learning_rate), every_k=1, loss_scale=loss_scale
  )
  opt_state = tx_b.init(params)
  # donate=False: the loop keeps the old parameters, to check that a skipped
  # step leaves them untouched (a donated buffer could not be read again).
  step_b = jaxaccum.make_train_step(loss_fp16, tx_b, num_micro_batches, donate=False)
  losses_fp16, scales, skipped_steps = [], [], []
  bar = tqdm(range(steps_fp16), desc="(b) fp16", disable=not progress)
  for step in bar:
    scales.append(float(opt_state.loss_scale.scale))
    skipped_before = int(opt_state.num_skipped)
    new_params, opt_state, loss = step_b(params, opt_state, sample())
    finite = bool(all_finite(new_params))
    assert finite, f"a NaN or Inf reached the parameters at step {step}"
    params_finite &= finite
    if int(opt_state.num_skipped) > skipped_before:
      skipped_steps.append(step)
      # The overflowed step is skipped as a whole: the weights are untouched.
      assert all(
        np.array_equal(a, b)
        for a, b in zip(
          jax.tree.leaves(new_params), jax.tree.leaves(params), strict=True
        )
      )
    params = new_params
    losses_fp16.append(loss)
    if step % 25 == 0 or step == steps_fp16 - 1:
      bar.set_postfix(loss=f"{float(loss):.4f}", scale=log2(scales[-1]))
  losses_fp16 = np.asarray(jnp.stack(losses_fp16))
  scales = np.asarray(scales, np.float32)
  final_scale = float(opt_state.loss_scale.scale)
  num_skipped = int(opt_state.num_skipped)
  assert num_skipped == len(skipped_steps) == steps_fp16 - int(opt_state.step)
  accuracy_fp16 = accuracy(params, x_test, y_test, jnp.float16)
  micro_batch = (x_all[:micro_batch_size], y_all[:micro_batch_size])
  underflow_unscaled = underflow_fraction(params, micro_batch, 1.0)
  underflow_scaled = underflow_fraction(params, micro_batch, final_scale)
  seconds = time.perf_counter() - start

  png = pathlib.Path(out_dir) / "mixed_precision.png"
  plot(
    grad_check=grad_check,
    losses_bf16=losses_bf16,
    losses_fp16=losses_fp16,
    scales=scales,
    skipped_steps=skipped_steps,
    png=png,
  )

  print(f"(a) bf16 compute, float32 accumulation and master weights ({master_dtype})")
  print(
    "    gradient of the whole training set at init, relative error "
    f"(bf16 eps = {BF16_EPS:.4f}):"
  )
  print("          vs float32 reference          |   added by the accumulation")
  print("     k  jaxaccum  bf16-params  bf16-sum |  jaxaccum  bf16-params  bf16-sum")
  methods = ("jaxaccum", "jaxaccum_bf16_params", "bf16_sum")
  for row in grad_check:
    total = "  ".join(f"{row[f'{m}_vs_f32']:9.2e}" for m in methods)
    added = "  ".join(f"{row[f'{m}_vs_exact']:9.2e}" for m in methods)
    print(f"    {row['k']:3d} {total} | {added}")
  print(
    "    (k: micro-batches; jaxaccum: its float32 sum, as trained; bf16-params: "
    "jaxaccum on a bf16 copy of the parameters; bf16-sum: a bf16 running sum)"
  )
  tolerance = 2 * BF16_EPS
  worst = max(row["jaxaccum_vs_f32"] for row in grad_check)
  assert worst < tolerance, (worst, tolerance)
  assert all(row["jaxaccum_vs_exact"] < 1e-5 for row in grad_check)
  assert all(
    row["bf16_sum_vs_exact"] > 10 * row["jaxaccum_vs_exact"] for row in grad_check
  )
  print(
    f"    jaxaccum's float32 sum is within bf16 tolerance of float32 ({worst:.2e} < "
    f"2 eps = {tolerance:.4f}) and adds only float32 rounding; the bf16 running "
    "sum adds its own error, growing with k."
  )
  print(
    f"    trained {steps_bf16} steps of {batch_size} rows ({num_micro_batches} "
    f"micro-batches of {micro_batch_size}): loss {losses_bf16[0]:.3f} -> "
    f"{losses_bf16[-1]:.4f}, test accuracy {accuracy_bf16:.4f}"
  )
  print("(b) float16 compute with dynamic loss scaling, float32 master weights")
  changes = [s for s in range(1, len(scales)) if scales[s] != scales[s - 1]]
  print(f"    loss scale over time: {log2(scales[0])} at step 0")
  for s in changes:
    if s - 1 in skipped_steps:
      why = f"step {s - 1} overflowed and was skipped"
    else:
      why = f"{growth_interval} clean steps"
    print(f"      from step {s:3d}: {log2(scales[s])}  ({why})")
  print(f"      after the last step: {log2(final_scale)}")
  print(
    f"    skipped (overflowed) steps: {num_skipped} of {steps_fp16} {skipped_steps}; "
    "no NaN or Inf ever reached the parameters"
  )
  print(
    f"    float16 gradient entries flushed to zero: {underflow_unscaled:.1%} without "
    f"scaling, {underflow_scaled:.1%} with the scale {log2(final_scale)}"
  )
  print(
    f"    trained {steps_fp16} steps: loss {losses_fp16[0]:.3f} -> "
    f"{losses_fp16[-1]:.4f}, test accuracy {accuracy_fp16:.4f}"
  )
  print(f"total time {seconds:.1f} s; plot: {png}")
  return {
    "grad_check": grad_check,
    "losses_bf16": losses_bf16,
    "losses_fp16": losses_fp16,
    "final_loss_bf16": float(losses_bf16[-1]),
    "final_loss_fp16": float(losses_fp16[-1]),
    "accuracy_bf16": accuracy_bf16,
    "accuracy_fp16": accuracy_fp16,
    "master_dtype": master_dtype,
    "loss_scale_history": scales,
    "final_loss_scale": final_scale,
    "skipped_steps": skipped_steps,
    "num_skipped": num_skipped,
    "params_finite": params_finite,
    "underflow_unscaled": underflow_unscaled,
    "underflow_scaled": underflow_scaled,
    "seconds": seconds,
    "png": str(png),
  }


def plot(
  *,
  grad_check: list[dict],
  losses_bf16: np.ndarray,
  losses_fp16: np.ndarray,
  scales: np.ndarray,
  skipped_steps: list[int],
  png: pathlib.Path,
) -> None:
  """Gradient errors of (a), both loss curves, and the loss scale of (b)."""
  fig = Figure(figsize=(14, 4), layout="constrained")
  FigureCanvasAgg(fig)
  ax_err, ax_loss, ax_scale = fig.subplots(1, 3)

  labels = [
    ("jaxaccum_vs_f32", "jaxaccum: total"),
    ("bf16_sum_vs_f32", "bf16 sum: total"),
    ("jaxaccum_vs_exact", "jaxaccum: accumulation"),
    ("bf16_sum_vs_exact", "bf16 sum: accumulation"),
  ]
  width = 0.8 / len(labels)
  positions = np.arange(len(grad_check))
  for i, (key, label) in enumerate(labels):
    values = [max(row[key], 1e-12) for row in grad_check]
    ax_err.bar(positions + i * width, values, width, label=label)
  ax_err.axhline(BF16_EPS, color="gray", ls=":", label="bf16 eps")
  ax_err.set_xticks(
    positions + 0.4 - width / 2, [f"k = {row['k']}" for row in grad_check]
  )
  ax_err.set(
    xlabel="micro-batches (whole training set)",
    ylabel="relative gradient error",
    yscale="log",
  )
  bottom, top = ax_err.get_ylim()
  ax_err.set_ylim(bottom, top * (top / bottom) ** 0.3)  # room for the legend
  ax_err.set_title("(a) bf16 gradients, vs float32 / vs exact sum")
  ax_err.legend(fontsize=7, ncol=2, loc="upper center")

  ax_loss.plot(np.arange(len(losses_bf16)), losses_bf16, lw=0.8, label="(a) bf16")
  fp16 = np.where(np.isfinite(losses_fp16), losses_fp16, np.nan)
  ax_loss.plot(np.arange(len(fp16)), fp16, lw=0.8, label="(b) float16 + loss scale")
  ax_loss.set(xlabel="optimizer step", ylabel="training loss (batch mean)")
  log_axis(ax_loss, losses_bf16, fp16)
  ax_loss.set_title("Training loss, float32 master weights")
  ax_loss.legend()

  ax_scale.step(
    np.arange(len(scales)), np.log2(scales), where="post", label="loss scale"
  )
  if skipped_steps:
    ax_scale.plot(
      skipped_steps,
      np.log2(scales[skipped_steps]),
      "rx",
      label=f"overflow: step skipped ({len(skipped_steps)})",
    )
  ax_scale.set(xlabel="optimizer step", ylabel="log2(loss scale)")
  ax_scale.set_title("(b) dynamic loss scale")
  ax_scale.legend()
  png.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(png, dpi=110)


if __name__ == "__main__":
  main(**ARGS)
