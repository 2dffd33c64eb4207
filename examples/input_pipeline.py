"""Loading that keeps up: a Grain pipeline feeding the accumulated step.

A small Flax NNX convnet learns scikit-learn's bundled digits (8x8 images,
offline). Each optimizer step takes a batch of 192 augmented images, computed
as 8 micro-batches of 24 by ``jaxaccum.make_train_step`` in one jitted,
donated step. The batches come from a Grain pipeline::

    grain.MapDataset.source(DigitsSource(x, y))  # {"image", "label", "index"}
      .shuffle(seed).repeat()                    # a new order every epoch
      .batch(192, drop_remainder=True)
      .random_map(augment_batch)                 # rotate, shift, noise: numpy
      .to_iter_dataset()
      [.mp_prefetch(grain.MultiprocessingOptions(num_workers=...))]
    grain.experimental.device_put(ds, sharding)  # threads: host, then device

``device_put`` keeps a few batches built on the host and a couple already
copied into device memory, in background threads, so the step never waits
for the data as long as the pipeline is faster than the step.

Then it measures, on this machine, steps/s of the same step fed in different
ways (each the median of ``--repeats`` timed loops of ``--measure-steps``
steps, from fresh copies of the initial parameters), and the pipeline's own
batches/s with no training. The measurements back these rules:

- **Keep the dispatch asynchronous.** A jitted call returns before the step
  has run; ``float(loss)`` waits for it. Reading the loss every step stops
  the next step (and, in a plain loop, the next batch) from being prepared
  while this one runs. Read it every ``--loss-every`` steps; keep the other
  losses as device arrays and read them at the end.
- **Transform batches, not examples.** ``augment_batch`` resamples 192 images
  with a handful of numpy calls; ``augment_example`` runs the same arithmetic
  once per image, and pays Python and Grain's per-element overhead 192
  times.
- **Worker processes help only when cores are free.** Grain's
  ``mp_prefetch`` moves the pipeline into spawned processes. That is worth
  it when the pipeline is the bottleneck and there are idle cores; when the
  step already keeps the cores busy the workers compete with it for them.
  Spawned workers unpickle the pipeline, so its functions must be top-level
  names of an importable module (here ``examples/_pipeline.py``); each
  worker also imports the main script anew, JAX included, before its first
  batch. Outside ``absl.app.run``, Grain's absl flags must be marked parsed
  first (``absl.flags.FLAGS.mark_as_parsed()``).

``--placement pinned_host`` prefetches the batches into pinned host memory
instead (``memory_kind="pinned_host"``; on a GPU that is page-locked RAM the
device can copy from directly). jaxaccum then streams them: the scan copies
one micro-batch at a time into device memory, the next one while the current
one computes, so the device holds two micro-batches of the batch rather than
all of it. The loss is the same; what it costs in steps/s is measured the
same way (run the script once with each placement). On this CPU-only
machine "device" and "pinned_host" memory are both the same RAM, so the
difference shows the streaming's own overhead, not a PCIe transfer.

It prints the test accuracy and the measurements, writes them all to
``input_pipeline.json``, and saves a plot of augmented examples, the loss
curve and the measurements.

Run: ``python examples/input_pipeline.py [--steps 300] [--out-dir outputs]``.
"""

from __future__ import annotations

from typing import Any

import _cli  # examples/_cli.py
from _digits import TRAIN_ROWS  # examples/_digits.py

AUGMENT = ("batch", "example", "none")  # the choices of --augment
SOURCES = ("rows", "batches")  # of --source
PLACEMENTS = ("device", "pinned_host")  # of --placement


def parse_args(argv: list[str] | None = None) -> dict[str, Any]:
  """``main``'s keyword arguments from the command line (``sys.argv`` if None)."""
  parser = _cli.parser(__doc__)
  add = parser.add_argument
  count = _cli.positive_int
  add(
    "--steps",
    type=count,
    default=300,
    metavar="N",
    help="optimizer steps of the training run",
  )
  add(
    "--batch-size",
    type=count,
    default=192,
    metavar="N",
    help=f"rows per optimizer step; must divide the {TRAIN_ROWS} training rows",
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
    "--augment",
    choices=AUGMENT,
    default="batch",
    help="the training run's augmentation: once per batch (vectorized), once "
    "per example, or none",
  )
  add(
    "--source",
    choices=SOURCES,
    default="rows",
    help="what Grain reads: rows (it shuffles and batches them) or whole "
    "shuffled batches (needs --augment batch or none)",
  )
  add(
    "--placement",
    choices=PLACEMENTS,
    default="device",
    help="where batches are prefetched: device memory, or pinned host memory "
    "that jaxaccum streams one micro-batch at a time",
  )
  add(
    "--workers",
    type=_cli.non_negative_int,
    default=0,
    metavar="N",
    help="Grain worker processes of the training run (0: none)",
  )
  add(
    "--loss-every",
    type=count,
    default=25,
    metavar="N",
    help="read the loss (which waits for the step) every N steps",
  )
  add(
    "--measure-steps",
    type=_cli.non_negative_int,
    default=50,
    metavar="N",
    help="timed steps (or batches) per measurement; 0 skips the measurements",
  )
  add(
    "--repeats",
    type=count,
    default=3,
    metavar="N",
    help="timed loops per measurement; the median is reported",
  )
  add(
    "--measure-workers",
    type=count,
    nargs="*",
    default=(1, 2),
    metavar="N",
    help="Grain worker process counts to measure besides 0 (none: skip them)",
  )
  _cli.add_run_options(
    parser,
    outputs="the plot input_pipeline.png and the numbers input_pipeline.json",
    seed_help="seeds the initialization, the shuffle and the augmentation",
  )
  args = parser.parse_args(argv)
  if TRAIN_ROWS % args.batch_size:
    parser.error(
      f"--batch-size {args.batch_size} does not divide the {TRAIN_ROWS} training "
      "rows (try 64, 96, 192 or 448)"
    )
  if args.batch_size % args.num_micro_batches:
    parser.error(
      f"--batch-size {args.batch_size} does not split into "
      f"--num-micro-batches {args.num_micro_batches} equal micro-batches"
    )
  if args.source == "batches" and args.augment == "example":
    parser.error("--source batches makes whole batches: use --augment batch or none")
  return _cli.keyword_arguments(args)


if __name__ == "__main__":
  # First thing: --help and a bad flag answer before JAX is imported (seconds).
  ARGS = parse_args()

import contextlib
import functools
import itertools
import json
import os
import pathlib
import statistics
import textwrap
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _digits import digits_split  # examples/_digits.py
from _pipeline import (  # examples/_pipeline.py: importable by Grain's workers
  DigitsSource,
  ShuffledBatches,
  augment_batch,
  augment_example,
)
from _plots import log_axis  # examples/_plots.py
from absl import flags
from flax import nnx
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from tqdm import tqdm

import jaxaccum

Batch = dict[str, Any]
Params = dict[str, Any]  # nnx.to_pure_dict of the model's state: arrays only


class ConvNet(nnx.Module):
  """Conv-ReLU, strided Conv-ReLU (8x8 -> 4x4), Dense-ReLU, Dense."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 16, (3, 3), rngs=rngs)
    self.conv2 = nnx.Conv(16, 32, (3, 3), strides=(2, 2), rngs=rngs)
    self.dense = nnx.Linear(4 * 4 * 32, 64, rngs=rngs)
    self.out = nnx.Linear(64, 10, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = nnx.relu(self.conv1(x))  # (batch, 8, 8, 16)
    x = nnx.relu(self.conv2(x))  # (batch, 4, 4, 32)
    x = nnx.relu(self.dense(x.reshape((x.shape[0], -1))))
    return self.out(x)


def digits_pipeline(
  x: np.ndarray,
  y: np.ndarray,
  *,
  batch_size: int,
  seed: int,
  augment: str = "batch",
  source: str = "rows",
  workers: int = 0,
  read_threads: int | None = 0,
) -> grain.IterDataset:
  """An endless stream of shuffled, augmented batches of the digits.

  Args:
    x: float32 images of shape ``(rows, 8, 8, 1)``; ``y``: int32 labels.
    batch_size: rows per batch; it must divide ``rows``, so that each epoch
      is a whole number of batches and no row is dropped.
    seed: the shuffle and augmentation seed; every epoch is shuffled anew.
    augment: ``"batch"`` (one vectorized ``augment_batch`` per batch),
      ``"example"`` (``augment_example`` on each image, then batching) or
      ``"none"``.
    source: ``"rows"``: Grain shuffles and batches rows
      (``MapDataset.source(DigitsSource(x, y)).shuffle(seed).repeat()
      .batch(batch_size)``), one Python call per row; ``"batches"``: the
      elements are whole batches (``ShuffledBatches``: a numpy permutation
      per epoch, one gather per batch), which needs ``augment="batch"`` or
      ``"none"``.
    workers: Grain worker processes (``mp_prefetch``); 0 builds the batches
      in this process.
    read_threads: ``grain.ReadOptions.num_threads``, the threads (in each
      process) that compute elements ahead. Grain's default, 16 threads and
      500 elements ahead, suits reading from remote storage; for data in
      memory they only contend for the GIL and the cores, so 0 (the
      elements are computed by whoever iterates, here ``device_put``'s
      prefetch thread). None keeps Grain's default.

  Returns:
    A ``grain.IterDataset`` of dicts of numpy arrays: ``image`` of shape
    ``(batch_size, 8, 8, 1)``, ``label`` and ``index`` (the row in ``x``)
    of shape ``(batch_size,)``.
  """
  if len(x) % batch_size:
    raise ValueError(f"{batch_size=} does not divide the {len(x)} rows")
  if augment not in ("batch", "example", "none"):
    raise ValueError(f"{augment=} is not one of 'batch', 'example', 'none'")
  if source == "batches":
    if augment == "example":
      raise ValueError(f"{source=} makes batches: augment='example' is out")
    ds = grain.MapDataset.source(ShuffledBatches(x, y, batch_size, seed))
  elif source == "rows":
    ds = grain.MapDataset.source(DigitsSource(x, y)).shuffle(seed=seed).repeat()
    if augment == "example":
      ds = ds.random_map(augment_example, seed=seed + 1)
    ds = ds.batch(batch_size, drop_remainder=True)
  else:
    raise ValueError(f"{source=} is not 'rows' or 'batches'")
  if augment == "batch":
    ds = ds.random_map(augment_batch, seed=seed + 1)
  if read_threads is None:  # Grain's default
    it = ds.to_iter_dataset()
  else:
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=read_threads))
  if workers:
    if not flags.FLAGS.is_parsed():  # Grain reads absl flags in its workers
      flags.FLAGS.mark_as_parsed()
    it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
  return it


def python_batches(
  x: np.ndarray,
  y: np.ndarray,
  *,
  batch_size: int,
  seed: int,
  sharding: jax.sharding.Sharding,
) -> Iterator[Batch]:
  """The synchronous baseline: each batch built in this thread when asked for.

  The same shuffle-per-epoch and the same ``augment_batch``, then
  ``jax.device_put``; nothing is prepared ahead.
  """
  rng = np.random.default_rng(seed)
  while True:
    order = rng.permutation(len(x)).astype(np.int32)
    for start in range(0, len(x) - batch_size + 1, batch_size):
      rows = order[start : start + batch_size]
      batch = {"image": x[rows], "label": y[rows], "index": rows}
      yield jax.device_put(augment_batch(batch, rng), sharding)


def make_step(
  graphdef: nnx.GraphDef, tx: optax.GradientTransformation, k: int
) -> Callable[..., Any]:
  """``step(params, opt_state, (images, labels)) -> (params, opt_state, loss)``."""

  def loss_fn(params: Params, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    images, labels = batch
    logits = nnx.merge(graphdef, params)(images)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  return jaxaccum.make_train_step(loss_fn, tx, k)


def check_placement(placement: str) -> jax.sharding.Sharding:
  """The sharding that puts a batch on device 0, in ``placement`` memory."""
  device = jax.devices()[0]
  kinds = [memory.kind for memory in device.addressable_memories()]
  if placement not in ("device", "pinned_host"):
    raise ValueError(f"{placement=} is not 'device' or 'pinned_host'")
  if placement not in kinds:
    raise ValueError(f"{placement=}: {device} offers the memory kinds {kinds}")
  return jax.sharding.SingleDeviceSharding(device, memory_kind=placement)


def steps_per_second(
  step: Callable[..., Any],
  params: Params,
  opt_state: Any,
  batches: Iterator[Batch],
  *,
  steps: int,
  loss_every: int,
  warmup: int = 10,
) -> float:
  """Times ``steps`` steps fed from ``batches``, after ``warmup`` untimed ones.

  The untimed steps compile (once per shape), start the pipeline and use up
  most of the head start its buffers gained meanwhile. The loss is read
  (``float``, which waits for the step) every ``loss_every`` steps and
  after the last one.
  """
  for _ in range(warmup):
    params, opt_state, loss = step(params, opt_state, as_inputs(next(batches)))
  float(loss)
  start = time.perf_counter()
  for i in range(steps):
    params, opt_state, loss = step(params, opt_state, as_inputs(next(batches)))
    if (i + 1) % loss_every == 0:
      float(loss)
  float(loss)
  return steps / (time.perf_counter() - start)


def batches_per_second(
  ds: grain.IterDataset, *, batches: int, first: list[float] | None = None
) -> float:
  """The pipeline alone on the host, no training: batches/s after the first.

  The seconds to the first batch (worker processes starting, buffers
  filling) are appended to ``first``.
  """
  start = time.perf_counter()
  with contextlib.closing(iter(ds)) as it:
    next(it)
    if first is not None:
      first.append(time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(batches):
      next(it)
    return batches / (time.perf_counter() - start)


def as_inputs(batch: Batch) -> tuple[jax.Array, jax.Array]:
  """What the step trains on; ``index`` stays out of it."""
  return batch["image"], batch["label"]


def median_of(
  measurements: dict[str, Callable[[], float]], repeats: int
) -> tuple[dict[str, float], dict[str, tuple[float, float]]]:
  """Runs every measurement ``repeats`` times, interleaved; medians and ranges.

  Interleaving spreads a slow spell of a shared machine over all of them
  rather than onto one.
  """
  runs: dict[str, list[float]] = {name: [] for name in measurements}
  for _ in range(repeats):
    for name, measure in measurements.items():
      runs[name].append(measure())
  medians = {name: statistics.median(r) for name, r in runs.items()}
  return medians, {name: (min(r), max(r)) for name, r in runs.items()}


class Setup(NamedTuple):
  """What the training run and the measurements share."""

  step: Callable[..., Any]  # the accumulated, jitted, donating step
  fresh: Callable[[], tuple[Params, Any]]  # initial params, new Adam state
  pipeline: Callable[..., grain.IterDataset]  # digits_pipeline(**options)
  on_device: Callable[[grain.IterDataset], grain.IterDataset]  # prefetching
  python_loop: Callable[[], Iterator[Batch]]  # the synchronous baseline
  batches_per_epoch: int


def train(
  setup: Setup,
  *,
  steps: int,
  loss_every: int,
  progress: bool,
  **how: Any,
) -> dict[str, Any]:
  """The training run: Grain -> ``device_put`` prefetching -> the step.

  ``how``: the options of ``digits_pipeline`` (augment, source, workers).
  """
  params, opt_state = setup.fresh()
  losses, indices = [], []
  bar = tqdm(total=steps, desc="input_pipeline", disable=not progress)
  feed = iter(setup.on_device(setup.pipeline(**how)))
  with contextlib.closing(feed), bar:
    batch = next(feed)
    params, opt_state, loss = setup.step(params, opt_state, as_inputs(batch))
    shown = np.asarray(batch["image"])[:8], np.asarray(batch["index"])[:8]
    memory_kind = batch["image"].sharding.memory_kind  # where the step read it
    float(loss)
    start = time.perf_counter()  # from the second step on: compiled, started
    for i in range(steps):
      if i:
        batch = next(feed)
        params, opt_state, loss = setup.step(params, opt_state, as_inputs(batch))
      losses.append(loss)  # a device array: keeping it does not wait
      indices.append(batch["index"])
      bar.update()
      if (i + 1) % loss_every == 0:
        bar.set_postfix(loss=f"{float(loss):.4f}")
    float(loss)
    seconds = time.perf_counter() - start
  return {
    "params": params,
    "losses": np.asarray(jnp.stack(losses)),
    "indices": np.concatenate([np.asarray(i) for i in indices]),
    "shown": shown,
    "memory_kind": memory_kind,
    "steps_per_s": (steps - 1) / seconds if steps > 1 else 0.0,
  }


class Measured(NamedTuple):
  """Medians over the repeats, by name."""

  steps_per_s: dict[str, float]  # the step fed in each way
  batches_per_s: dict[str, float]  # the pipelines alone, no training
  first_batch_s: dict[str, float]  # the pipelines' seconds to a first batch
  spread: dict[str, tuple[float, float]]  # (min, max); pipelines: pipeline_*


# What each measurement's name means, in the words of the README's table.
LABELS = {
  # the step fed in each way, steps/s
  "resident": "batches already in memory, cycled",
  "grain": "Grain, rows as the source",
  "grain_batches_source": "Grain, whole batches as the source",
  "python_loop": "a plain Python loop, no prefetching",
  "grain_default_read_threads": "Grain, rows, default read options",
  "resident_loss_every_step": "batches in memory, loss read every step",
  "python_loop_loss_every_step": "Python loop, loss read every step",
  "grain_per_example_{}w": "Grain, rows, per-example augmentation, {workers}",
  "grain_{}w": "Grain, rows, {processes}",
  # the pipelines alone, batches/s
  "rows_no_augment": "rows, no augmentation",
  "rows_per_batch": "rows, per-batch augmentation",
  "batches_per_batch": "whole batches, per-batch augmentation",
  "rows_per_example_{}w": "rows, per-example augmentation, {workers}",
}


def label(name: str) -> str:
  """A measurement's name in words: ``"grain_2w"`` is Grain with 2 workers."""
  head, _, tail = name.rpartition("_")
  if tail.endswith("w") and tail[:-1].isdigit():
    n = int(tail[:-1])
    return LABELS[head + "_{}w"].format(
      workers=f"{n} worker{'s' * (n != 1)}",
      processes=f"{n} worker process{'es' * (n != 1)}",
    )
  return LABELS[name]


def measure(
  setup: Setup,
  *,
  steps: int,
  repeats: int,
  loss_every: int,
  workers: tuple[int, ...],
) -> Measured:
  """Steps/s of the step fed in each way, and the pipelines' own batches/s."""
  # One epoch of finished batches, placed before the loop and cycled.
  with contextlib.closing(iter(setup.on_device(setup.pipeline()))) as it:
    resident = list(itertools.islice(it, setup.batches_per_epoch))

  def resident_fed() -> Iterator[Batch]:
    return itertools.cycle(resident)

  def grain_fed(**how: Any) -> Callable[[], Iterator[Batch]]:
    return lambda: iter(setup.on_device(setup.pipeline(**how)))

  def timed(batches: Callable[[], Iterator[Batch]], every: int) -> float:
    it = batches()
    try:
      return steps_per_second(
        setup.step,
        *setup.fresh(),
        it,
        steps=steps,
        loss_every=every,
        warmup=min(10, steps),
      )
    finally:
      if hasattr(it, "close"):
        it.close()  # stops Grain's threads and worker processes

  first: dict[str, list[float]] = {}

  def alone(name: str, **how: Any) -> Callable[[], float]:
    seconds = first.setdefault(name, [])
    return lambda: batches_per_second(
      setup.pipeline(**how), batches=steps, first=seconds
    )

  every = loss_every
  fed = {
    "resident": (resident_fed, every),
    "grain": (grain_fed(), every),
    "grain_batches_source": (grain_fed(source="batches"), every),
    "python_loop": (setup.python_loop, every),
    # Grain's default ReadOptions: 16 threads computing 500 elements ahead.
    "grain_default_read_threads": (grain_fed(read_threads=None), every),
    # (a) reading the loss after every step
    "resident_loss_every_step": (resident_fed, 1),
    "python_loop_loss_every_step": (setup.python_loop, 1),
    # (b) per-example augmentation; (c) worker processes, for either
    **{
      f"grain_per_example_{w}w": (grain_fed(augment="example", workers=w), every)
      for w in (0, *workers)
    },
    **{f"grain_{w}w": (grain_fed(workers=w), every) for w in workers},
  }
  pipelines = {
    "rows_no_augment": alone("rows_no_augment", augment="none"),
    "rows_per_batch": alone("rows_per_batch"),
    "batches_per_batch": alone("batches_per_batch", source="batches"),
    **{
      f"rows_per_example_{w}w": alone(
        f"rows_per_example_{w}w", augment="example", workers=w
      )
      for w in (0, *workers)
    },
  }
  medians, spread = median_of(
    {
      **{name: functools.partial(timed, *how) for name, how in fed.items()},
      **{f"pipeline_{name}": run for name, run in pipelines.items()},
    },
    repeats,
  )
  steps_per_s = {name: medians[name] for name in fed}
  batches_per_s = {name: medians[f"pipeline_{name}"] for name in pipelines}
  first_batch_s = {name: statistics.median(s) for name, s in first.items()}
  return Measured(steps_per_s, batches_per_s, first_batch_s, spread)


def main(
  *,
  steps: int = 300,
  batch_size: int = 192,
  num_micro_batches: int = 8,
  learning_rate: float = 3e-3,
  augment: str = "batch",
  source: str = "rows",
  placement: str = "device",
  workers: int = 0,
  loss_every: int = 25,
  measure_steps: int = 50,
  repeats: int = 3,
  measure_workers: tuple[int, ...] = (1, 2),
  out_dir: str = "outputs",
  progress: bool = True,
  seed: int = 0,
) -> dict:
  """Trains from the Grain pipeline, then measures the ways of feeding the step.

  Args:
    steps: optimizer steps of the training run, each on ``batch_size`` rows.
    batch_size: rows per step; it must divide the 1344 training rows.
    num_micro_batches: ``k``; it must divide ``batch_size``.
    learning_rate: Adam's learning rate.
    augment: the training run's augmentation: ``batch``, ``example`` or
      ``none``.
    source: ``rows`` (Grain shuffles and batches rows) or ``batches``
      (whole batches from ``ShuffledBatches``); see ``digits_pipeline``.
    placement: ``device`` (batches prefetched into device memory) or
      ``pinned_host`` (into pinned host memory, streamed by jaxaccum).
    workers: Grain worker processes for the training run.
    loss_every: read the loss every this many steps.
    measure_steps: timed steps (or batches) per measurement; 0 skips the
      measurements.
    repeats: timed loops per measurement, interleaved; the median is
      reported.
    measure_workers: worker counts, besides 0, to measure.
    out_dir: where the plot ``input_pipeline.png`` and the summary
      ``input_pipeline.json`` go.
    progress: show a tqdm progress bar.
    seed: the initialization, shuffle and augmentation seed.

  Returns:
    A dict with ``losses`` (float32, shape ``(steps,)``), ``indices`` (the
    training rows in the order the steps saw them, int32 of shape
    ``(steps * batch_size,)``), ``test_accuracy``, ``train_steps_per_s``,
    ``batch_memory_kind`` (where the step found its batches), ``measured``
    (a :class:`Measured`; empty dicts without measurements),
    ``summary`` (the numbers written to ``json``, ``input_pipeline.json``),
    ``json`` and ``png``.
  """
  sharding = check_placement(placement)
  x_train, y_train, x_test, y_test = digits_split(images=True)
  if batch_size % num_micro_batches:
    raise ValueError(f"{num_micro_batches=} does not divide {batch_size=}")

  graphdef, state = nnx.split(ConvNet(rngs=nnx.Rngs(seed)))
  init_params = nnx.to_pure_dict(state)  # nested dicts of arrays
  tx = optax.adam(learning_rate)

  def fresh() -> tuple[Params, Any]:
    params = jax.tree.map(jnp.copy, init_params)  # the step donates its params
    return params, tx.init(params)

  def pipeline(**how: Any) -> grain.IterDataset:
    """``digits_pipeline`` over the training set; ``how``: its options."""
    return digits_pipeline(x_train, y_train, batch_size=batch_size, seed=seed, **how)

  setup = Setup(
    step=make_step(graphdef, tx, num_micro_batches),
    fresh=fresh,
    pipeline=pipeline,
    on_device=functools.partial(
      grain.experimental.device_put,
      device=sharding,
      cpu_buffer_size=4,  # batches built ahead on the host
      device_buffer_size=2,  # batches already in `sharding`'s memory
    ),
    python_loop=functools.partial(
      python_batches,
      x_train,
      y_train,
      batch_size=batch_size,
      seed=seed,
      sharding=sharding,
    ),
    batches_per_epoch=len(x_train) // batch_size,
  )
  run = train(
    setup,
    steps=steps,
    loss_every=loss_every,
    progress=progress,
    augment=augment,
    source=source,
    workers=workers,
  )
  losses = run["losses"]
  logits = nnx.merge(graphdef, run["params"])(jnp.asarray(x_test))
  test_accuracy = float(jnp.mean(jnp.argmax(logits, axis=-1) == y_test))

  measured = Measured({}, {}, {}, {})
  if measure_steps:
    measured = measure(
      setup,
      steps=measure_steps,
      repeats=repeats,
      loss_every=loss_every,
      workers=measure_workers,
    )
  png = pathlib.Path(out_dir) / "input_pipeline.png"
  plot(x_train, shown=run["shown"], losses=losses, measured=measured, png=png)
  summary = {
    "steps": steps,
    "batch_size": batch_size,
    "num_micro_batches": num_micro_batches,
    "augment": augment,
    "source": source,
    "placement": placement,
    "batch_memory_kind": run["memory_kind"],
    "workers": workers,
    "cpu_cores": os.cpu_count(),
    "backend": jax.default_backend(),
    "first_loss": float(losses[0]),
    "final_loss": float(np.mean(losses[-min(steps, 10) :])),
    "test_accuracy": test_accuracy,
    "train_steps_per_s": run["steps_per_s"],
    "steps_per_s": measured.steps_per_s,
    "batches_per_s": measured.batches_per_s,
    "first_batch_s": measured.first_batch_s,
  }
  json_path = pathlib.Path(out_dir) / "input_pipeline.json"
  json_path.parent.mkdir(parents=True, exist_ok=True)
  json_path.write_text(json.dumps(summary, indent=1) + "\n")

  m = batch_size // num_micro_batches
  memory = {"device": "device memory", "pinned_host": "pinned host memory"}
  per = {"batch": "per batch", "example": "per example", "none": "none"}
  reads = {"rows": "rows", "batches": "whole batches"}
  print(
    f"{steps} optimizer steps of {batch_size} rows ({num_micro_batches} "
    f"micro-batches of {m}); augmentation: {per[augment]}; Grain reads "
    f"{reads[source]}, {workers} worker process{'es' * (workers != 1)}; "
    "batches prefetched into "
    f"{memory[placement]}"
  )
  print(
    f"training run: {run['steps_per_s']:.1f} steps/s; loss {losses[0]:.3f} -> "
    f"{summary['final_loss']:.3f}; test accuracy {test_accuracy:.4f}"
  )
  spread = measured.spread
  if measure_steps:
    print(
      f"the same step fed in different ways, steps/s (median of {repeats} timed "
      f"loops of {measure_steps} steps; slowest .. fastest):"
    )
  for name, value in measured.steps_per_s.items():
    low, high = spread[name]
    print(f"  {label(name):52s} {value:7.1f}  ({low:.1f} .. {high:.1f})")
  if measure_steps:
    print("the pipelines alone, no training, batches/s (and time to the 1st batch):")
  for name, value in measured.batches_per_s.items():
    low, high = spread[f"pipeline_{name}"]
    first = measured.first_batch_s[name]
    print(f"  {label(name):44s} {value:7.1f}  ({low:.1f} .. {high:.1f})  {first:.3f} s")
  print(f"plot: {png}; all numbers: {json_path}")
  return {
    "losses": losses,
    "indices": run["indices"],
    "test_accuracy": test_accuracy,
    "train_steps_per_s": run["steps_per_s"],
    "batch_memory_kind": run["memory_kind"],
    "measured": measured,
    "summary": summary,
    "json": str(json_path),
    "png": str(png),
  }


def plot(
  x_train: np.ndarray,
  *,
  shown: tuple[np.ndarray, np.ndarray],
  losses: np.ndarray,
  measured: Measured,
  png: pathlib.Path,
) -> None:
  """Originals and augmented copies; the loss; the measurements, if any."""
  tables = [
    (measured.steps_per_s, "", "steps/s", f"The step fed ({os.cpu_count()} cores)"),
    (measured.batches_per_s, "pipeline_", "batches/s", "The pipelines alone"),
  ]
  tables = [table for table in tables if table[0]]
  widths = [0.8, 1, 1.3, 1.3][: 2 + len(tables)]
  fig = Figure(figsize=(4 * sum(widths), 4.5), layout="constrained")
  FigureCanvasAgg(fig)
  panels = fig.subfigures(1, len(widths), width_ratios=widths)
  images, rows = shown
  axes = panels[0].subplots(4, 4)
  for j, row in enumerate(rows[:8]):
    top = 2 * (j // 4)  # an original, and below it the augmented copy
    axes[top, j % 4].imshow(x_train[row, ..., 0], cmap="gray_r", vmin=0, vmax=1)
    axes[top + 1, j % 4].imshow(images[j, ..., 0], cmap="gray_r", vmin=0, vmax=1)
  for ax in axes.flat:
    ax.set_axis_off()
  panels[0].suptitle("Training rows over their augmented\ncopies in the first batch")
  ax = panels[1].subplots()
  ax.plot(np.arange(1, len(losses) + 1), losses, lw=1)
  ax.set(xlabel="optimizer step", ylabel="training loss (batch mean)")
  log_axis(ax, losses)
  ax.set_title("The accumulated step, fed by Grain")
  for panel, (table, prefix, unit, title) in zip(panels[2:], tables, strict=True):
    ax = panel.subplots()
    names = list(table)[::-1]  # the first measurement on top
    values = np.array([table[n] for n in names])
    low, high = np.array([measured.spread[prefix + n] for n in names]).T
    labels = [textwrap.fill(label(n), 24) for n in names]
    ax.barh(labels, values, xerr=[values - low, high - values], alpha=0.8)
    ax.tick_params(axis="y", labelsize=8)
    ax.set(xlabel=f"{unit}: median; whiskers: slowest to fastest")
    ax.set_title(title)
    log_axis(ax, values, low, high, axis="x")
  png.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(png, dpi=110)


if __name__ == "__main__":
  main(**ARGS)
