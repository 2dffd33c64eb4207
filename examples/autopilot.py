"""The batch-size autopilot on real data: ``jaxaccum.auto_k`` against fixed and ramped windows at equal tokens.

Micro-batches arrive one call at a time and go through
``jaxaccum.accumulate(optax.adam(lr), every_k)``: the window (the effective
batch) is ``every_k`` micro-batches. Four runs per task see the SAME
micro-batches in the same order, a fixed budget of them (equal tokens):

- ``fixed_small``: ``every_k=min_k``, the small batch, at the base learning
  rate (tuned for it);
- ``fixed_large``: ``every_k=max_k``, at ``lr * sqrt(max_k / min_k)``;
- ``hand_ramp``: ``every_k`` a callable of the optimizer step, a linear ramp
  from ``min_k`` to ``max_k`` over the budget's micro-batches (the
  Megatron/MaxText batch ramp, in samples), at ``lr * sqrt(k / min_k)``;
- ``autopilot``: ``every_k=jaxaccum.auto_k(max_k=..., min_k=...,
  lr_rule="sqrt")``: each window's length is the measured critical batch
  ``B_simple`` (McCandlish et al. 2018), and its updates are multiplied by
  ``sqrt(k / min_k)``.

Every larger batch gets the same learning-rate rule, Adam's square-root rule
(Malladi et al. 2022): the base rate times ``sqrt(k / min_k)``. The fixed
runs and the ramp measure ``B_simple`` too (``noise_stats=True``, the same
moving averages as the autopilot's), so the plot shows it next to ``k``.

Two tasks:

- ``char_lm``: the quickstart's character-level transformer on
  ``pydoc_data.topics`` (dropout off), micro-batches of 8 padded sequences;
  the loss is a token SUM and ``weight=`` the token count, so each window
  applies the exact token mean. 5% of the sequences are held out.
- ``digits``: an MLP (64-128-128-10) on scikit-learn's digits, micro-batches
  of 8 rows, a mean loss; the 453 test images are held out.

The final loss is the held-out loss (token-mean cross-entropy for the LM,
mean cross-entropy for the digits) after the whole budget, averaged over the
seeds (each seeds the initialization and the data order; the held-out split
is fixed). The script prints a table per task and checks the goal: the
autopilot reaches the small batch's final loss (within one standard
deviation over the seeds, or within 1%) in at most 0.6x its optimizer steps,
and beats the fixed large batch and the hand ramp at equal tokens. The plot
shows the held-out loss against tokens and against optimizer steps, and
``k`` over training next to the measured ``B_simple`` (in micro-batches).

What it finds (the defaults, 3 seeds, on a CPU; ``--write-results`` keeps
them in ``benchmarks/results/autopilot.json``):

- ``digits`` (10 passes, base rate 2e-3): the autopilot ends at the small
  batch's held-out loss, 0.066 +- 0.006 against 0.067 +- 0.008, in 0.22x
  its optimizer steps (188 against 840), and beats the fixed large batch
  (0.092) and the hand ramp (0.073). The measured ``B_simple`` is 6 to 12
  micro-batches (50 to 100 images) and ``k`` follows it from 2 to 11.
- ``char_lm`` (2 passes, base rate 1e-3): the autopilot takes 0.41x the
  small batch's steps (385 against 936) and beats the fixed large batch
  (2.76) and the hand ramp (2.05) by far: on the early plateau ``B_simple``
  is below one micro-batch, and the autopilot keeps ``k = 2`` where the
  others spend tokens on large windows. It does NOT reach the small batch's
  loss: 1.70 +- 0.02 against 1.57 +- 0.01. Then ``B_simple`` is 4 to 8
  micro-batches, and the model still learns fast at the end of the budget;
  a window near ``B_simple`` costs tokens there (McCandlish et al.: at the
  critical batch, twice the minimum examples; at a quarter of it, as ``k =
  2`` is, 1.25x). A fixed window of 4 (half the steps) ends at 1.70 as well
  (seed 0).
- A horizon of 10 windows (``auto_k``'s first default) is too short for
  windows of 2 micro-batches: their noise estimates swing (to an infinite
  ``B_simple`` when the average ``|G|^2`` dips below 0), and since the window
  only grows, it ratcheted up on the swings (digits: ``k = 32`` by
  mid-budget, loss 0.077; char_lm: 1.90 against 1.68 at 100 windows, seed 0).
  Horizons of 100 to 300 windows did about equally well; 100 is the default
  now, and an infinite estimate holds the window. ``growth`` 1.25 and
  ``warmup`` 20 change nothing measurable.

Run: ``python examples/autopilot.py [--task both] [--seeds 3] [--quick]
[--out-dir outputs] [--write-results]``; ``--write-results`` writes
``benchmarks/results/autopilot.json`` and the plot next to it.
"""

from __future__ import annotations

from typing import Any

import _cli  # examples/_cli.py

TASKS = ("char_lm", "digits")
RUNS = ("fixed_small", "fixed_large", "hand_ramp", "autopilot")

# Each task's settings; the command line's flags replace them (for both
# tasks when --task both). The learning rates are the best of a sweep of
# fixed_small (3 seeds); the autopilot's knobs are set once for both tasks.
SETTINGS: dict[str, dict[str, Any]] = {
  "char_lm": {
    "budget": 1872,  # micro-batches: 2 passes over the 7488 training sequences
    "micro_batch_size": 8,  # sequences of 64 characters
    "min_k": 2,
    "max_k": 32,
    "learning_rate": 1e-3,
    "model": {"seq_len": 64, "width": 128, "layers": 2, "heads": 4},
  },
  "digits": {
    "budget": 1680,  # micro-batches: 10 passes over the 1344 training images
    "micro_batch_size": 8,  # rows
    "min_k": 2,
    "max_k": 32,
    "learning_rate": 2e-3,
    "model": {"hidden": 128},
  },
}
# --quick: a small model and budget, about a minute for everything.
QUICK: dict[str, dict[str, Any]] = {
  "char_lm": {
    "budget": 320,
    "max_k": 16,
    "learning_rate": 3e-3,
    "model": {"seq_len": 32, "width": 32, "layers": 1, "heads": 2},
  },
  "digits": {"budget": 480, "max_k": 16, "model": {"hidden": 32}},
}
# auto_k's knobs, at their defaults (see the docstring for why the horizon is
# 100 windows).
AUTOPILOT = {"horizon": 100.0, "growth": 2.0, "warmup": 5}
DEFAULT_RESULTS = "benchmarks/results/autopilot.json"


def parse_args(argv: list[str] | None = None) -> dict[str, Any]:
  """``main``'s keyword arguments from the command line (``sys.argv`` if None)."""
  parser = _cli.parser(__doc__)
  add = parser.add_argument
  count = _cli.positive_int
  add("--task", choices=("both", *TASKS), default="both", help="the task(s) to run")
  add(
    "--seeds",
    type=count,
    default=3,
    metavar="N",
    help="seeds per run: SEED, SEED+1, ... (initialization and data order)",
  )
  add(
    "--budget",
    type=count,
    default=None,
    metavar="N",
    help="micro-batches per run, the same for the four runs (default: "
    + ", ".join(f"{t} {s['budget']}" for t, s in SETTINGS.items())
    + ")",
  )
  add(
    "--min-k",
    type=_cli.int_at_least(2),
    default=None,
    metavar="K",
    help="the small window, at least 2 (default: 2)",
  )
  add(
    "--max-k",
    type=_cli.int_at_least(2),
    default=None,
    metavar="K",
    help="the large window, at least --min-k (default: 32)",
  )
  add(
    "--learning-rate",
    type=_cli.positive_float,
    default=None,
    metavar="LR",
    help="Adam's base learning rate, for min_k (default: "
    + ", ".join(f"{t} {s['learning_rate']:g}" for t, s in SETTINGS.items())
    + ")",
  )
  add(
    "--horizon",
    type=_cli.positive_float,
    default=AUTOPILOT["horizon"],
    metavar="W",
    help="auto_k's moving-average horizon, in windows (at least 1)",
  )
  add(
    "--growth",
    type=_cli.positive_float,
    default=AUTOPILOT["growth"],
    metavar="F",
    help="auto_k's largest growth of the window per window (more than 1)",
  )
  add(
    "--warmup",
    type=_cli.non_negative_int,
    default=AUTOPILOT["warmup"],
    metavar="N",
    help="auto_k's measured windows before the first change",
  )
  add(
    "--quick",
    action="store_true",
    help="small models and budgets, about a minute: a smoke test, too small "
    "to show the autopilot's advantage (it reports the goal as not met)",
  )
  add(
    "--results",
    metavar="PATH",
    default=None,
    help="write the results as JSON to PATH, and the plot next to it",
  )
  add(
    "--write-results",
    action="store_true",
    help=f"write the results to {DEFAULT_RESULTS} (unless --results)",
  )
  _cli.add_run_options(
    parser,
    outputs="the plot, autopilot.png",
    seed_help="the first seed",
  )
  args = parser.parse_args(argv)
  chosen = [
    settings | (QUICK[task] if args.quick else {})
    for task, settings in SETTINGS.items()
  ]
  min_k = args.min_k or max(s["min_k"] for s in chosen)
  max_k = args.max_k or min(s["max_k"] for s in chosen)
  if max_k < min_k:
    parser.error(f"the window's --max-k {max_k} is less than its --min-k {min_k}")
  if args.horizon < 1:
    parser.error(f"--horizon must be at least 1 window, got {args.horizon:g}")
  if args.growth <= 1:
    parser.error(f"--growth must be more than 1, got {args.growth:g}")
  return _cli.keyword_arguments(args)


if __name__ == "__main__":
  # First thing: --help and a bad flag answer before JAX is imported (seconds).
  ARGS = parse_args()

import copy
import datetime
import functools
import json
import math
import pathlib
import platform
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import quickstart  # examples/quickstart.py: the character LM and its data
from _digits import digits_split  # examples/_digits.py
from _mlp import init_mlp, mlp  # examples/_mlp.py
from _plots import log_axis  # examples/_plots.py
from flax import nnx
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter
from tqdm import tqdm

import jaxaccum

ROOT = pathlib.Path(__file__).resolve().parents[1]
HELD_OUT_SEED = 1234  # the char LM's held-out split, the same for every seed
HELD_OUT_FRACTION = 0.05
EVAL_POINTS = 24  # held-out evaluations per run, at equal micro-batch counts
CURVE_POINTS = 120  # points of the k and B_simple curves in the JSON


# -----------------------------------------------------------------------------
# The tasks: parameters, a stream of micro-batches, a loss, a held-out loss
# -----------------------------------------------------------------------------


class Task(NamedTuple):
  """What the training loop needs of a task.

  ``loss(params, batch)`` returns ``(value, weight)``: with ``weighted``,
  the loss sum and the token count (passed as ``weight=``); otherwise the
  mean loss and the rows (counted, not passed). ``stream(seed)`` yields
  micro-batches forever; ``held_out(params)`` is the held-out loss.
  """

  name: str
  unit: str  # what "tokens" counts: "tokens" or "examples"
  weighted: bool
  init: Callable[[int], Any]
  stream: Callable[[int], Iterator[Any]]
  loss: Callable[[Any, Any], tuple[jax.Array, jax.Array]]
  held_out: Callable[[Any], jax.Array]
  description: str


def char_lm_task(micro_batch_size: int, model: dict[str, int]) -> Task:
  """The quickstart's character LM, dropout off, with 5% of the sequences
  held out (the same ones for every seed)."""
  seq_len = model["seq_len"]
  data = quickstart.CharData(seq_len)
  order = np.random.default_rng(HELD_OUT_SEED).permutation(len(data.ids))
  held = np.sort(order[: int(HELD_OUT_FRACTION * len(order))])
  kept = np.sort(order[len(held) :])
  train = copy.copy(data)  # CharData.batches() over the training rows only
  train.ids, train.lengths = data.ids[kept], data.lengths[kept]
  ids = jnp.asarray(data.ids[held])
  held_batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:], "mask": ids[:, 1:] != 0}

  def build(seed: int) -> nnx.Module:
    return quickstart.CharTransformer(
      data.vocab_size,
      seq_len,
      width=model["width"],
      layers=model["layers"],
      heads=model["heads"],
      dropout=0.0,
      rngs=nnx.Rngs(seed),
    )

  # The parameters are an nnx.State, trained functionally: one graph for
  # every seed, the rest of the module (unused RNG state) held fixed.
  graphdef, _, rest = nnx.split(build(0), nnx.Param, ...)

  def init(seed: int):
    return nnx.split(build(seed), nnx.Param, ...)[1]

  def loss(params, batch):
    # The quickstart's loss: (sum over real tokens, their number).
    return quickstart.loss_fn(nnx.merge(graphdef, params, rest), batch)

  def held_out(params):
    loss_sum, tokens = loss(params, held_batch)
    return loss_sum / tokens

  num_params = sum(x.size for x in jax.tree.leaves(init(0)))
  return Task(
    name="char_lm",
    unit="tokens",
    weighted=True,
    init=init,
    stream=lambda seed: train.batches(micro_batch_size, seed),
    loss=loss,
    held_out=held_out,
    description=(
      f"char_lm: {num_params:,}-parameter transformer, {len(kept):,} training "
      f"sequences of <= {seq_len} characters ({int(train.lengths.sum() - len(kept)):,}"
      f" tokens), {len(held)} held out; micro-batch {micro_batch_size} sequences"
    ),
  )


def digits_task(micro_batch_size: int, model: dict[str, int]) -> Task:
  """An MLP on scikit-learn's digits, a mean loss; the test images held out."""
  x_train, y_train, x_test, y_test = digits_split()
  sizes = (64, model["hidden"], model["hidden"], 10)

  def init(seed: int):
    return init_mlp(jax.random.key(seed), sizes)

  def stream(seed: int):
    rng = np.random.default_rng(seed)
    while True:
      order = rng.permutation(len(x_train))
      for first in range(0, len(order) - micro_batch_size + 1, micro_batch_size):
        rows = order[first : first + micro_batch_size]
        yield x_train[rows], y_train[rows]

  def loss(params, batch):
    x, y = batch
    mean = optax.softmax_cross_entropy_with_integer_labels(mlp(params, x), y).mean()
    return mean, jnp.asarray(y.shape[0], jnp.float32)

  held = (jnp.asarray(x_test), jnp.asarray(y_test))
  num_params = sum(x.size for x in jax.tree.leaves(init(0)))
  return Task(
    name="digits",
    unit="examples",
    weighted=False,
    init=init,
    stream=stream,
    loss=loss,
    held_out=lambda params: loss(params, held)[0],
    description=(
      f"digits: {num_params:,}-parameter MLP {'-'.join(map(str, sizes))}, "
      f"{len(x_train)} training images, {len(x_test)} held out; micro-batch "
      f"{micro_batch_size} rows"
    ),
  )


# -----------------------------------------------------------------------------
# The four runs' optimizers
# -----------------------------------------------------------------------------


def ramp_table(budget: int, min_k: int, max_k: int) -> np.ndarray:
  """The hand ramp's window per optimizer step: ``k`` grows linearly with
  the micro-batches consumed, from ``min_k`` at the start to ``max_k`` at the
  end of the budget (the Megatron/MaxText ramp, in samples)."""
  table, consumed = [], 0
  while consumed < budget:
    k = round(min_k + (max_k - min_k) * consumed / budget)
    table.append(k)
    consumed += k
  return np.asarray(table, np.int32)


def make_optimizer(
  run: str,
  *,
  learning_rate: float,
  budget: int,
  min_k: int,
  max_k: int,
  horizon: float,
  growth: float,
  warmup: int,
) -> optax.GradientTransformationExtraArgs:
  """``accumulate(adam, every_k)`` for ``run``; every window of ``k``
  micro-batches gets Adam's learning rate ``lr * sqrt(k / min_k)``."""
  if run == "fixed_small":
    return jaxaccum.accumulate(optax.adam(learning_rate), min_k, noise_stats=True)
  if run == "fixed_large":
    lr = learning_rate * math.sqrt(max_k / min_k)
    return jaxaccum.accumulate(optax.adam(lr), max_k, noise_stats=True)
  if run == "hand_ramp":
    table = jnp.asarray(ramp_table(budget, min_k, max_k))

    def every_k(step):  # the window of the optimizer step `step`
      return table[jnp.minimum(step, len(table) - 1)]

    # Adam's count is the optimizer step, so this factor is sqrt(k / min_k)
    # of the window it updates.
    factor = optax.scale_by_schedule(lambda count: jnp.sqrt(every_k(count) / min_k))
    inner = optax.chain(optax.adam(learning_rate), factor)
    return jaxaccum.accumulate(inner, every_k, noise_stats=True)
  if run == "autopilot":
    auto = jaxaccum.auto_k(
      max_k=max_k,
      min_k=min_k,
      lr_rule="sqrt",
      horizon=horizon,
      growth=growth,
      warmup=warmup,
    )
    return jaxaccum.accumulate(optax.adam(learning_rate), auto)
  raise ValueError(f"unknown run {run!r}")


# -----------------------------------------------------------------------------
# Training: one call per micro-batch
# -----------------------------------------------------------------------------


def make_micro_step(task: Task, tx, decay: float):
  """A jitted call on one micro-batch: its gradient into the window, the
  parameters updated where the window ends. It also folds each ended
  window's noise into moving averages (decay ``1 - 1/horizon``, as
  ``auto_k``'s) for ``B_simple``; the autopilot's own is in
  ``state.autopilot``."""

  @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
  def micro_step(params, state, tracker, batch, flush):
    (value, weight), grads = jax.value_and_grad(task.loss, has_aux=True)(params, batch)
    extra = {"weight": weight} if task.weighted else {}
    updates, state = tx.update(grads, state, params, flush=flush, **extra)
    params = optax.apply_updates(params, updates)
    noise = state.noise.last
    tracker = jax.tree.map(
      lambda new, old: jnp.where(state.updated, new, old),
      jaxaccum.noise_scale_update(tracker, noise, decay=decay),
      tracker,
    )
    if state.autopilot is not None:
      b_simple = state.autopilot.b_simple
    else:  # in micro-batches, as the autopilot's
      per_micro_batch = jnp.where(noise.b_small > 0, noise.b_small, 1.0)
      b_simple = jaxaccum.critical_batch_size(tracker) / per_micro_batch
    # The optimizer step and B_simple after this call, this call's loss and
    # its tokens (rows): read once, after the run, not per call.
    return params, state, tracker, (state.step, b_simple, value, weight)

  return micro_step


def train(
  task: Task,
  micro_step,
  tx,
  *,
  seed: int,
  budget: int,
  eval_at: np.ndarray,
  progress: bool,
  label: str,
) -> dict[str, Any]:
  """``budget`` micro-batches of ``task.stream(seed)`` through ``micro_step``;
  the last one flushes its window, so that every run applies every token.
  The held-out loss is evaluated after the micro-batches ``eval_at``."""
  params = task.init(seed)
  state = tx.init(params)
  tracker = jaxaccum.noise_scale_init()
  stream = task.stream(seed)
  held_out = jax.jit(task.held_out)
  per_call, evals = [], [held_out(params)]
  no, yes = jnp.asarray(False), jnp.asarray(True)
  wanted = set(eval_at.tolist())
  for i in tqdm(range(1, budget + 1), desc=label, disable=not progress, leave=False):
    batch = next(stream)
    params, state, tracker, out = micro_step(
      params, state, tracker, batch, yes if i == budget else no
    )
    per_call.append(out)
    if i in wanted:
      evals.append(held_out(params))
  steps, b_simple, values, weights = (
    np.asarray(x) for x in zip(*per_call, strict=True)
  )
  updated = np.diff(steps, prepend=0) > 0
  ends = np.flatnonzero(updated)
  window_k = np.diff(ends, prepend=-1)  # micro-batches of each optimizer step
  tokens = np.cumsum(weights)
  if task.weighted:  # the window's token mean
    sums = np.add.reduceat(values, ends - window_k + 1)
    window_loss = sums / np.add.reduceat(weights, ends - window_k + 1)
  else:  # the mean over the window's equal micro-batches
    window_loss = np.add.reduceat(values, ends - window_k + 1) / window_k
  calls = np.concatenate([[0], eval_at])
  return {
    "final_loss": float(evals[-1]),
    "optimizer_steps": int(steps[-1]),
    "tokens": float(tokens[-1]),
    "micro_batches": budget,
    "window_k": window_k,  # per optimizer step
    "b_simple_at_step": b_simple[ends],  # B_simple after each step
    "tokens_at_step": tokens[ends],
    "train_loss": window_loss,  # per optimizer step
    "eval_calls": calls,
    "eval_tokens": np.concatenate([[0.0], tokens[eval_at - 1]]),
    "eval_steps": np.concatenate([[0], steps[eval_at - 1]]),
    "eval_loss": np.asarray([float(e) for e in evals]),
  }


# -----------------------------------------------------------------------------
# Summaries, the goal, the JSON
# -----------------------------------------------------------------------------


def on_grid(x: np.ndarray, y: np.ndarray, grid: np.ndarray) -> np.ndarray:
  """``y`` (a step curve at the points ``x``) at ``grid``: its last value at
  or before each grid point (NaN before the first)."""
  index = np.searchsorted(x, grid, side="right") - 1
  out = np.asarray(y, np.float64)[np.maximum(index, 0)]
  return np.where(index >= 0, out, np.nan)


def rounded(tree: Any, digits: int = 6) -> Any:
  """``tree`` with its floats rounded to ``digits`` significant digits (a
  JSON file half the size), a float that is not finite as None (null)."""
  if isinstance(tree, float):
    return float(f"{tree:.{digits}g}") if math.isfinite(tree) else None
  if isinstance(tree, dict):
    return {key: rounded(value, digits) for key, value in tree.items()}
  if isinstance(tree, list | tuple):
    return [rounded(value, digits) for value in tree]
  return tree


def finite_or_none(values) -> list[float | None]:
  return [float(v) if np.isfinite(v) else None for v in np.asarray(values, float)]


def summarize(
  runs: dict[str, list[dict]], unit: str, goal_steps: float = 0.6
) -> dict[str, Any]:
  """Means over the seeds, curves on common grids, and the goal."""
  out: dict[str, Any] = {"runs": {}}
  budget = runs["fixed_small"][0]["micro_batches"]
  grid = np.unique(np.linspace(1, budget, CURVE_POINTS).round().astype(int))
  for name, seeds in runs.items():
    losses = np.asarray([r["final_loss"] for r in seeds])
    steps = np.asarray([r["optimizer_steps"] for r in seeds])
    entry = {
      "final_loss_mean": float(losses.mean()),
      "final_loss_std": float(losses.std(ddof=1)) if len(losses) > 1 else 0.0,
      "optimizer_steps": float(steps.mean()),
      "tokens": float(np.mean([r["tokens"] for r in seeds])),
      "micro_batches": budget,
      "final_loss_per_seed": losses.tolist(),
      "optimizer_steps_per_seed": steps.tolist(),
      "tokens_per_seed": [r["tokens"] for r in seeds],
    }
    # Curves over the micro-batches consumed (the same for every run):
    # per seed, the window k and B_simple then, and the steps taken. k is
    # each window's planned length: the last window, flushed at the end of
    # the budget, counts as long as the one before (no run here shrinks k).
    curves = {"micro_batches": grid.tolist(), "k": [], "b_simple": [], "steps": []}
    for r in seeds:
      ends = np.cumsum(r["window_k"])  # the call that ended each window
      planned = r["window_k"].copy()
      if len(planned) > 1:
        planned[-1] = max(planned[-1], planned[-2])
      curves["k"].append(
        finite_or_none(on_grid(ends - r["window_k"] + 1, planned, grid))
      )
      curves["b_simple"].append(
        finite_or_none(on_grid(ends, r["b_simple_at_step"], grid))
      )
      curves["steps"].append(np.searchsorted(ends, grid, side="right").tolist())
    entry["curves"] = curves
    first = seeds[0]
    entry["eval"] = {
      "micro_batches": first["eval_calls"].tolist(),
      "tokens": np.mean([r["eval_tokens"] for r in seeds], axis=0).tolist(),
      "steps": [r["eval_steps"].tolist() for r in seeds],
      "loss": [r["eval_loss"].tolist() for r in seeds],
      "loss_mean": np.mean([r["eval_loss"] for r in seeds], axis=0).tolist(),
    }
    # The training loss of each window, per seed, thinned to <= 200 points.
    entry["train_loss"] = []
    for r in seeds:
      keep = np.unique(np.linspace(0, len(r["train_loss"]) - 1, 200).astype(int))
      entry["train_loss"].append(
        {
          "steps": (keep + 1).tolist(),
          "tokens": r["tokens_at_step"][keep].tolist(),
          "loss": r["train_loss"][keep].tolist(),
        }
      )
    out["runs"][name] = entry
  out["token_unit"] = unit
  out["goal"] = check_goal(out["runs"], runs, goal_steps)
  return out


def check_goal(
  summary: dict[str, dict], runs: dict[str, list[dict]], goal_steps: float
) -> dict[str, Any]:
  """The autopilot against the others, over the seeds' means."""
  small, auto = summary["fixed_small"], summary["autopilot"]
  tolerance = max(small["final_loss_std"], 0.01 * small["final_loss_mean"])
  gap = auto["final_loss_mean"] - small["final_loss_mean"]
  ratio = auto["optimizer_steps"] / small["optimizer_steps"]
  # When (in optimizer steps, per seed) the autopilot's held-out loss first
  # came within the tolerance of the small batch's final loss.
  reached = []
  for r in runs["autopilot"]:
    hit = np.flatnonzero(r["eval_loss"] <= small["final_loss_mean"] + tolerance)
    reached.append(int(r["eval_steps"][hit[0]]) if len(hit) else None)
  goal = {
    "steps_ratio": ratio,
    "steps_ratio_target": goal_steps,
    "loss_gap_to_small": gap,
    "loss_tolerance": tolerance,
    "reaches_small_loss": bool(gap <= tolerance),
    "fewer_steps": bool(ratio <= goal_steps),
    "steps_to_small_loss_per_seed": reached,
    "beats_fixed_large": bool(
      auto["final_loss_mean"] < summary["fixed_large"]["final_loss_mean"]
    ),
    "beats_hand_ramp": bool(
      auto["final_loss_mean"] < summary["hand_ramp"]["final_loss_mean"]
    ),
  }
  goal["met"] = all(
    goal[key]
    for key in (
      "reaches_small_loss",
      "fewer_steps",
      "beats_fixed_large",
      "beats_hand_ramp",
    )
  )
  return goal


def print_table(name: str, result: dict[str, Any]) -> None:
  unit = result["token_unit"]
  print(
    f"\n{name}: held-out loss after {result['runs']['fixed_small']['micro_batches']} micro-batches (mean +- std over seeds)"
  )
  print(
    f"  {'run':<12} {'final loss':>17} {'optimizer steps':>16} {unit:>12}  k (first -> largest)"
  )
  for run, r in result["runs"].items():
    ks = [k for k in r["curves"]["k"][0] if k is not None]
    print(
      f"  {run:<12} {r['final_loss_mean']:>9.4f} +- {r['final_loss_std']:.4f} "
      f"{r['optimizer_steps']:>16.0f} {r['tokens']:>12,.0f}  {ks[0]:.0f} -> {max(ks):.0f}"
    )
  g = result["goal"]
  mark = lambda ok: "yes" if ok else "NO"  # noqa: E731
  print(
    f"  autopilot vs fixed_small: loss {g['loss_gap_to_small']:+.4f} (tolerance "
    f"{g['loss_tolerance']:.4f}: {mark(g['reaches_small_loss'])}), steps x"
    f"{g['steps_ratio']:.2f} (<= {g['steps_ratio_target']}: {mark(g['fewer_steps'])})"
  )
  print(
    f"  beats fixed_large: {mark(g['beats_fixed_large'])}; beats hand_ramp: "
    f"{mark(g['beats_hand_ramp'])}; goal met: {mark(g['met'])}"
  )


# -----------------------------------------------------------------------------
# The plot
# -----------------------------------------------------------------------------


def geometric_mean(values: np.ndarray) -> np.ndarray:
  """Per column, over the seeds' finite positive values (NaN where none:
  B_simple is None before its first estimate)."""
  ok = np.isfinite(values) & (values > 0)
  logs = np.where(ok, np.log(np.where(ok, values, 1.0)), 0.0)
  count = ok.sum(axis=0)
  return np.where(count > 0, np.exp(logs.sum(axis=0) / np.maximum(count, 1)), np.nan)


def thousands(value: float, _position: Any = None) -> str:
  """An axis label: 0, 500, 20k, 1.5M."""
  for size, suffix in ((1e6, "M"), (1e3, "k")):
    if abs(value) >= size:
      return f"{value / size:g}{suffix}"
  return f"{value:g}"


COLORS = {
  "fixed_small": "C0",
  "fixed_large": "C3",
  "hand_ramp": "C2",
  "autopilot": "C1",
}


def plot(results: dict[str, dict], png: pathlib.Path) -> None:
  """Per task: held-out loss vs tokens and vs optimizer steps; k and
  B_simple over training."""
  tasks = list(results)
  fig = Figure(figsize=(16, 4.3 * len(tasks)), layout="constrained")
  FigureCanvasAgg(fig)
  axes = np.atleast_2d(fig.subplots(len(tasks), 3))
  for row, task in zip(axes, tasks, strict=True):
    result = results[task]
    unit = result["token_unit"]
    ax_tok, ax_step, ax_k = row
    losses = []
    for run, r in result["runs"].items():
      ev, color = r["eval"], COLORS[run]
      loss = np.asarray(ev["loss"])
      mean, std = loss.mean(axis=0), loss.std(axis=0)
      tokens = np.asarray(ev["tokens"])
      label = f"{run} ({r['final_loss_mean']:.3f}, {r['optimizer_steps']:.0f} steps)"
      ax_tok.plot(tokens, mean, color=color, label=label)
      ax_tok.fill_between(tokens, mean - std, mean + std, color=color, alpha=0.15)
      steps = np.asarray(ev["steps"]).mean(axis=0)
      ax_step.plot(steps[1:], mean[1:], color=color, label=run)  # log axis: no 0
      losses.append(mean[1:])
      curves = r["curves"]
      calls = np.asarray(curves["micro_batches"])
      k = np.mean(np.asarray(curves["k"], float), axis=0)
      ax_k.plot(calls, k, color=color, lw=2, label=f"{run}: k")
      b_simple = geometric_mean(np.asarray(curves["b_simple"], float))
      ax_k.plot(calls, b_simple, color=color, ls=":", lw=1.2)
    small = result["runs"]["fixed_small"]
    for ax in (ax_tok, ax_step):
      ax.axhline(small["final_loss_mean"], color="gray", lw=0.6, ls="--")
      log_axis(ax, *losses)
    ax_tok.set(xlabel=f"{unit} seen", ylabel="held-out loss (nats)")
    ax_tok.xaxis.set_major_formatter(FuncFormatter(thousands))
    ax_tok.set_title(f"{task}: held-out loss at equal {unit} (mean +- std)")
    ax_tok.legend(fontsize=8)
    ax_step.set(xlabel="optimizer steps", ylabel="held-out loss (nats)")
    ax_step.set_xscale("log")
    ax_step.set_title(f"{task}: held-out loss per optimizer step")
    ax_step.legend(fontsize=8)
    ax_k.set(xlabel="micro-batches seen", ylabel="micro-batches per window")
    ax_k.set_yscale("log", base=2)
    ax_k.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax_k.set_title(f"{task}: window k and measured B_simple")
    ax_k.plot([], [], color="gray", ls=":", label="dotted: B_simple, per run")
    ax_k.legend(fontsize=8)
  png.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(png, dpi=100)


# -----------------------------------------------------------------------------
# main
# -----------------------------------------------------------------------------


def main(
  *,
  task: str = "both",
  seeds: int = 3,
  budget: int | None = None,
  min_k: int | None = None,
  max_k: int | None = None,
  learning_rate: float | None = None,
  horizon: float = AUTOPILOT["horizon"],
  growth: float = AUTOPILOT["growth"],
  warmup: int = AUTOPILOT["warmup"],
  quick: bool = False,
  results: str | None = None,
  write_results: bool = False,
  out_dir: str = "outputs",
  seed: int = 0,
  progress: bool = True,
) -> dict[str, Any]:
  """Runs the four runs on each task and seed; returns the results.

  Args:
    task: ``"char_lm"``, ``"digits"`` or ``"both"``.
    seeds: seeds per run, ``seed``, ``seed + 1``, ...
    budget, min_k, max_k, learning_rate: replace the task's settings
      (``SETTINGS``; both tasks' with ``task="both"``).
    horizon, growth, warmup: ``auto_k``'s knobs.
    quick: a small model and budget (``QUICK``).
    results: write the JSON there, and the plot next to it (``.png``).
    write_results: write the JSON to ``benchmarks/results/autopilot.json``
      unless ``results`` is given.
    out_dir: where the plot ``autopilot.png`` goes.
    seed: the first seed.
    progress: show a tqdm progress bar.

  Returns:
    ``{"tasks": {task: {"runs": {run: {...}}, "goal": {...}, ...}}, ...}``,
    as written to the JSON: per run ``final_loss_mean``, ``final_loss_std``,
    ``optimizer_steps``, ``tokens`` and per-seed values, the curves, and
    ``png`` (the plot's path) and ``seconds``.
  """
  start = time.perf_counter()
  tasks = TASKS if task == "both" else (task,)
  knobs = {"horizon": horizon, "growth": growth, "warmup": warmup}
  out: dict[str, Any] = {
    "jax": jax.__version__,
    "date": datetime.date.today().isoformat(),
    "machine": platform.processor() or platform.machine(),
    "backend": jax.default_backend(),
    "seeds": list(range(seed, seed + seeds)),
    "autopilot": {"lr_rule": "sqrt", **knobs},
    "learning_rate_rule": "Adam's square-root rule: lr * sqrt(k / min_k) for every window of k micro-batches",
    "final_loss": "held-out loss after the budget (token-mean cross-entropy for char_lm, mean cross-entropy for digits), mean and sample std (ddof=1) over the seeds",
    "tasks": {},
  }
  for name in tasks:
    settings = copy.deepcopy(SETTINGS[name])
    if quick:
      settings.update(copy.deepcopy(QUICK[name]))
    given = {
      "budget": budget,
      "min_k": min_k,
      "max_k": max_k,
      "learning_rate": learning_rate,
    }
    settings.update({key: value for key, value in given.items() if value is not None})
    if settings["max_k"] < settings["min_k"]:
      raise ValueError(f"max_k={settings['max_k']} < min_k={settings['min_k']}")
    build = char_lm_task if name == "char_lm" else digits_task
    the_task = build(settings["micro_batch_size"], settings["model"])
    print(the_task.description)
    n = settings["budget"]
    eval_at = np.unique(np.linspace(0, n, EVAL_POINTS + 1).round().astype(int)[1:])
    runs: dict[str, list[dict]] = {}
    for run in RUNS:
      tx = make_optimizer(
        run,
        learning_rate=settings["learning_rate"],
        budget=n,
        min_k=settings["min_k"],
        max_k=settings["max_k"],
        **knobs,
      )
      micro_step = make_micro_step(the_task, tx, 1.0 - 1.0 / horizon)
      runs[run] = []
      for s in range(seed, seed + seeds):
        began = time.perf_counter()
        r = train(
          the_task,
          micro_step,
          tx,
          seed=s,
          budget=n,
          eval_at=eval_at,
          progress=progress,
          label=f"{name} {run} seed {s}",
        )
        runs[run].append(r)
        print(
          f"  {run:<12} seed {s}: held-out loss {r['final_loss']:.4f}, "
          f"{r['optimizer_steps']} steps, k {r['window_k'][0]} -> "
          f"{r['window_k'].max()}, "
          f"{time.perf_counter() - began:.0f} s"
        )
    result = summarize(runs, the_task.unit)
    result["settings"] = settings
    result["description"] = the_task.description
    out["tasks"][name] = result
  for name, result in out["tasks"].items():
    print_table(name, result)
  png = pathlib.Path(out_dir) / "autopilot.png"
  plot(out["tasks"], png)
  out["png"] = str(png)
  out["seconds"] = time.perf_counter() - start
  path = results or (str(ROOT / DEFAULT_RESULTS) if write_results else None)
  if path is not None:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rounded(out), indent=1) + "\n")
    next_to = path.with_suffix(".png")
    if next_to.resolve() != png.resolve():
      plot(out["tasks"], next_to)
    out["results"] = str(path)
    print(f"\nresults: {path}; plot: {next_to}")
  print(f"plot: {png}; {out['seconds']:.0f} s in all")
  return out


if __name__ == "__main__":
  main(**ARGS)
