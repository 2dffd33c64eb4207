"""Data-parallel gradient accumulation: one host with 8 devices, or 2 processes.

An MLP learns scikit-learn's bundled digits (8x8 images, offline). Every
optimizer step takes a global batch of ``batch_size`` rows, sharded along the
``"data"`` axis of a device mesh. ``jaxaccum.make_train_step(loss, tx, k,
mesh=mesh, data_axis="data")`` splits each device's shard into ``k``
micro-batches, accumulates their gradients locally inside ``shard_map`` and
all-reduces them ONCE, after the loop: the compiled step has no collective
inside its while loop (the script prints the count from ``jaxaccum.testing``).
The result is the full-batch gradient, up to float32 rounding.

Single host (8 fake CPU devices, unless ``XLA_FLAGS`` already sets a device
count)::

  python examples/data_parallel.py [--steps 300] [--out-dir outputs]

Multi-process, on this machine::

  python examples/data_parallel.py --multiprocess [--steps 100]

starts this script twice more, as two processes with 4 CPU devices each. They
meet through ``jax.distributed.initialize(coordinator_address=
"127.0.0.1:PORT", num_processes=2, process_id=i)`` and form one 8-device mesh;
CPU collectives between processes use gloo
(``jax.config.update("jax_cpu_collectives_implementation", "gloo")``, set
before ``initialize``). Each process feeds only its own rows of every global
batch, with ``jax.make_array_from_process_local_data``. Process 0 prints the
losses; then the launcher trains the same steps in one process and prints the
largest difference, which is float32 rounding: the global batches and the
parameters are the same, only where the rows live differs.

On a real multi-host TPU or GPU cluster the same worker code runs, once per
host, with three changes: no fake devices and no gloo (the accelerators'
own collectives are used); ``jax.distributed.initialize()`` without
arguments, since on Cloud TPU, SLURM, Open MPI and Kubernetes (JobSet) the
coordinator address, process count and process id are read from the
environment; and each host reads only its own part of the data set (e.g. a
shard of files), instead of indexing one array that every process holds.
The mesh, the ``NamedSharding`` of the batch and the training step do not
change.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import _cli  # examples/_cli.py

TRAIN_ROWS = 1347  # training rows of the digits; the other 450 are the test set
SINGLE_PROCESS_STEPS = 300  # the default of --steps
MULTIPROCESS_STEPS = 100  # the --multiprocess default: gloo steps are slower
MULTIPROCESS_DEVICES = 8  # 2 processes x 4 CPU devices
# The flags with which the launcher starts each process of a --multiprocess run.
WORKER_FLAGS = ("worker", "coordinator", "num_processes", "process_id", "result")


def parse_args(argv: list[str] | None = None) -> dict[str, Any]:
  """``main``'s keyword arguments from the command line (``sys.argv`` if None).

  And the internal ``WORKER_FLAGS`` (hidden from ``--help``), which the
  launcher of a multi-process run passes to each process it starts.
  """
  parser = _cli.parser(__doc__)
  add = parser.add_argument
  count = _cli.positive_int
  add(
    "--steps",
    type=count,
    metavar="N",
    help=f"optimizer steps (default: {SINGLE_PROCESS_STEPS}, or "
    f"{MULTIPROCESS_STEPS} with --multiprocess)",
  )
  add(
    "--batch-size",
    type=count,
    default=256,
    metavar="N",
    help=f"rows per optimizer step over all devices, the global batch (at most "
    f"{TRAIN_ROWS})",
  )
  add(
    "--num-micro-batches",
    type=count,
    default=4,
    metavar="K",
    help="micro-batches per device per optimizer step; the batch must divide "
    "by K (by 8 K with --multiprocess)",
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
    "--multiprocess",
    action="store_true",
    help="also train in 2 local processes of 4 CPU devices each (jax.distributed)"
    " and compare with one process",
  )
  _cli.add_run_options(
    parser,
    outputs="the plot data_parallel.png (and, with --multiprocess, "
    "data_parallel_multiprocess.json)",
    seed_help="seeds the initialization and the order of the batches",
  )
  hidden = argparse.SUPPRESS
  add("--worker", action="store_true", help=hidden)
  add("--coordinator", help=hidden)
  add("--num-processes", type=count, help=hidden)
  add("--process-id", type=_cli.non_negative_int, help=hidden)
  add("--result", help=hidden)
  args = parser.parse_args(argv)
  if args.steps is None:  # fewer steps by default across processes
    args.steps = MULTIPROCESS_STEPS if args.multiprocess else SINGLE_PROCESS_STEPS
  if args.batch_size > TRAIN_ROWS:
    parser.error(
      f"--batch-size {args.batch_size} is more than the {TRAIN_ROWS} training rows"
    )
  devices = MULTIPROCESS_DEVICES if args.multiprocess else 1
  if args.batch_size % (devices * args.num_micro_batches):
    parser.error(
      f"--batch-size {args.batch_size} does not split into {devices} device(s) x "
      f"--num-micro-batches {args.num_micro_batches} equal micro-batches"
    )
  return _cli.keyword_arguments(args)


if __name__ == "__main__":
  # First thing: --help and a bad flag answer before JAX is imported (seconds).
  ARGS = parse_args()
  WORKER = {name: ARGS.pop(name) for name in WORKER_FLAGS}
  if not WORKER["worker"]:
    # Before JAX starts: 8 CPU devices, unless XLA_FLAGS names a count.
    from jaxaccum.testing import cpu_devices

    cpu_devices()

import dataclasses
import itertools
import json
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _digits import digits_split  # examples/_digits.py
from _plots import log_axis  # examples/_plots.py
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from tqdm import tqdm

import jaxaccum
from jaxaccum import testing

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Config:
  """The training run; the same in every process and in every mode.

  Attributes:
    steps: optimizer steps.
    batch_size: the global batch, in rows, summed over all devices.
    num_micro_batches: ``k``, micro-batches per device per step.
    hidden: width of the two hidden layers.
    learning_rate: Adam's learning rate.
    seed: seeds the initialization and the order of the batches.
  """

  steps: int = SINGLE_PROCESS_STEPS
  batch_size: int = 256
  num_micro_batches: int = 4
  hidden: int = 128
  learning_rate: float = 3e-3
  seed: int = 0


def init_params(config: Config) -> dict[str, np.ndarray]:
  """MLP parameters 64 -> hidden -> hidden -> 10, as host (numpy) arrays.

  numpy with a fixed seed, so that every process draws the same values.
  """
  rng = np.random.default_rng(config.seed)
  sizes = (64, config.hidden, config.hidden, 10)
  params = {}
  for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
    scale = np.sqrt(2.0 / fan_in)
    params[f"w{i}"] = (rng.standard_normal((fan_in, fan_out)) * scale).astype(
      np.float32
    )
    params[f"b{i}"] = np.zeros((1, fan_out), np.float32)
  return params


def logits_fn(params: PyTree, x: jax.Array) -> jax.Array:
  """The ReLU MLP's logits."""
  h = jax.nn.relu(x @ params["w0"] + params["b0"])
  h = jax.nn.relu(h @ params["w1"] + params["b1"])
  return h @ params["w2"] + params["b2"]


def loss_fn(params: PyTree, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
  """Mean cross-entropy of a (micro-)batch ``(x, y)``."""
  x, y = batch
  return optax.softmax_cross_entropy_with_integer_labels(logits_fn(params, x), y).mean()


@jax.jit
def accuracy(params: PyTree, x: jax.Array, y: jax.Array) -> jax.Array:
  """Fraction of rows whose arg-max logit is the label."""
  return jnp.mean(jnp.argmax(logits_fn(params, x), axis=-1) == y)


def batch_indices(config: Config, num_rows: int) -> np.ndarray:
  """Row indices of every global batch, shape ``(steps, batch_size)``.

  Shuffled epochs from ``config.seed``: every process computes the same ones.
  """
  if config.batch_size > num_rows:
    raise ValueError(f"batch_size={config.batch_size} exceeds the {num_rows} rows.")
  rng = np.random.default_rng(config.seed + 1)
  per_epoch = num_rows // config.batch_size
  epochs = -(-config.steps // per_epoch)
  order = np.concatenate(
    [rng.permutation(num_rows)[: per_epoch * config.batch_size] for _ in range(epochs)]
  )
  return order[: config.steps * config.batch_size].reshape(config.steps, -1)


def data_axis_size(config: Config, num_devices: int) -> int:
  """The most devices (at most ``num_devices``) that split the batch evenly.

  Each device needs ``batch_size / devices`` rows, divisible by ``k``.
  """
  for n in range(num_devices, 0, -1):
    if config.batch_size % (n * config.num_micro_batches) == 0:
      return n
  raise ValueError(
    f"batch_size={config.batch_size} is not divisible by "
    f"num_micro_batches={config.num_micro_batches}."
  )


def process_rows(sharding: NamedSharding, global_rows: int) -> slice:
  """The rows of a global batch that this process's devices hold.

  With one process that is every row. With several, each process holds a
  contiguous block, where the mesh puts its devices (not necessarily at
  ``process_index * rows``).
  """
  index_map = sharding.addressable_devices_indices_map((global_rows,))
  blocks = [idx[0].indices(global_rows) for idx in index_map.values() if idx]
  return slice(min(b[0] for b in blocks), max(b[1] for b in blocks))


def replicate(tree: PyTree, mesh: jax.sharding.Mesh) -> PyTree:
  """Host arrays, equal in every process, as arrays replicated over ``mesh``."""
  sharding = NamedSharding(mesh, P())
  return jax.tree.map(
    lambda a: jax.make_array_from_process_local_data(sharding, a, a.shape), tree
  )


def local_copy(tree: PyTree) -> PyTree:
  """This process's copy of replicated arrays, as ordinary local arrays."""
  return jax.tree.map(lambda a: a.addressable_data(0), tree)


def train(config: Config, *, progress: bool = True, desc: str = "train") -> dict:
  """Trains on all devices (of all processes); returns losses and metrics.

  The mesh has one ``"data"`` axis over ``data_axis_size`` devices. Every
  process runs this same function (single-controller on one host; one
  controller per process with ``jax.distributed``).
  """
  x_train, y_train, x_test, y_test = digits_split(TRAIN_ROWS)
  num_devices = data_axis_size(config, jax.device_count())
  if jax.process_count() > 1 and num_devices != jax.device_count():
    raise ValueError(
      f"batch_size={config.batch_size} must split evenly over all "
      f"{jax.device_count()} devices, in micro-batches of k="
      f"{config.num_micro_batches}, when several processes train."
    )
  devices = np.array(jax.devices()[:num_devices])
  mesh = jax.sharding.Mesh(devices, ("data",))
  data_sharding = NamedSharding(mesh, P("data"))
  rows = process_rows(data_sharding, config.batch_size)

  tx = optax.adam(config.learning_rate)
  params = replicate(init_params(config), mesh)
  opt_state = replicate(jax.tree.map(np.asarray, tx.init(init_params(config))), mesh)
  step = jaxaccum.make_train_step(
    loss_fn, tx, config.num_micro_batches, mesh=mesh, data_axis="data"
  )
  indices = batch_indices(config, len(x_train))

  def global_batch(i: int) -> tuple[jax.Array, jax.Array]:
    """Global batch ``i``, built from this process's rows of it only."""
    own = indices[i, rows]
    return tuple(
      jax.make_array_from_process_local_data(
        data_sharding, a[own], (config.batch_size, *a.shape[1:])
      )
      for a in (x_train, y_train)
    )

  # Compile once, read the collectives from the optimized HLO, run the
  # compiled step in the loop.
  start = time.perf_counter()
  jitted: Any = step  # make_train_step returns a jax.jit function
  compiled = jitted.lower(params, opt_state, global_batch(0)).compile()
  compile_seconds = time.perf_counter() - start
  collectives = testing.collectives(compiled.as_text())
  in_loop = [c for c in collectives if c.in_loop]

  step_losses = []
  start = time.perf_counter()
  bar = tqdm(range(config.steps), desc=desc, disable=not progress)
  for i in bar:
    params, opt_state, loss = compiled(params, opt_state, global_batch(i))
    step_losses.append(loss)
    if i % 25 == 0 or i == config.steps - 1:
      bar.set_postfix(loss=f"{float(local_copy(loss)):.4f}")
  losses = np.asarray([float(local_copy(v)) for v in step_losses], np.float32)
  seconds = time.perf_counter() - start

  final = local_copy(params)
  return {
    "losses": losses,
    "first_loss": float(losses[0]),
    "final_loss": float(losses[-1]),
    "train_accuracy": float(accuracy(final, x_train, y_train)),
    "test_accuracy": float(accuracy(final, x_test, y_test)),
    "loop_collectives": len(in_loop),
    "collectives": [c._asdict() for c in collectives],
    "bytes_per_step": testing.bytes_communicated(compiled.as_text()),
    "grad_bytes": sum(int(p.size) * p.dtype.itemsize for p in jax.tree.leaves(final)),
    "num_devices": int(devices.size),
    "num_processes": jax.process_count(),
    "micro_batch_rows": config.batch_size // devices.size // config.num_micro_batches,
    "compile_seconds": compile_seconds,
    "seconds": seconds,
  }


def report(result: dict, config: Config, prefix: str = "") -> None:
  """Prints the run's summary."""
  print(
    f"{prefix}{result['num_processes']} process(es), {result['num_devices']} devices "
    f"on the data axis; global batch {config.batch_size} = {result['num_devices']} "
    f"devices x {config.num_micro_batches} micro-batches x "
    f"{result['micro_batch_rows']} rows"
  )
  ops = ", ".join(f"{c['op']} x{c['executions']}" for c in result["collectives"])
  print(
    f"{prefix}collectives inside the step's loop: {result['loop_collectives']}; "
    f"in the whole step: {ops} ({result['bytes_per_step']:,} bytes; gradient "
    f"{result['grad_bytes']:,} bytes)"
  )
  losses = result["losses"]
  marks = sorted({int(i) for i in np.linspace(0, len(losses) - 1, 5)})
  print(f"{prefix}loss: " + ", ".join(f"step {i} {losses[i]:.6f}" for i in marks))
  print(
    f"{prefix}final loss {result['final_loss']:.6f}; "
    f"test accuracy {result['test_accuracy']:.4f} "
    f"(train {result['train_accuracy']:.4f}); {result['seconds']:.1f} s for "
    f"{config.steps} steps"
  )


def plot(curves: dict[str, np.ndarray], title: str, png: pathlib.Path) -> None:
  """Loss curves against the step, log-scale y."""
  fig = Figure(figsize=(6.5, 4), layout="constrained")
  FigureCanvasAgg(fig)
  ax = fig.subplots()
  # Curves that should coincide: the first wide and translucent, the rest dashed.
  wide = len(curves) > 1
  for i, (label, losses) in enumerate(curves.items()):
    steps = np.arange(len(losses))
    if i == 0:
      ax.plot(
        steps, losses, label=label, lw=3 if wide else 1.2, alpha=0.6 if wide else 1
      )
    else:
      ax.plot(steps, losses, "--", label=label, lw=1.2)
  ax.set(xlabel="optimizer step", ylabel="training loss (global batch mean)")
  log_axis(ax, *curves.values())
  ax.set_title(title)
  ax.legend()
  png.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(png, dpi=110)


def free_port() -> int:
  """A TCP port on 127.0.0.1 that is free now."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def config_args(config: Config) -> list[str]:
  """``config`` as command-line flags of this script."""
  args = []
  for field in dataclasses.fields(config):
    args += [f"--{field.name.replace('_', '-')}", str(getattr(config, field.name))]
  return args


def launch(
  config: Config,
  *,
  num_processes: int = 2,
  devices_per_process: int = 4,
  progress: bool = True,
  timeout: float = 300.0,
) -> dict:
  """Runs ``train`` in ``num_processes`` local processes; process 0's result.

  Process 0 writes to this process's terminal. The others write to log files,
  shown if they fail. If one process fails, or ``timeout`` seconds pass, the
  others are killed (a peer would otherwise wait for it in a collective).
  """
  env = dict(os.environ)
  testing.cpu_devices(devices_per_process, environ=env)
  env["JAX_PLATFORMS"] = "cpu"
  port = free_port()
  with tempfile.TemporaryDirectory() as tmp:
    result_path = pathlib.Path(tmp) / "process0.json"
    logs = [pathlib.Path(tmp) / f"process{i}.log" for i in range(num_processes)]
    procs = []
    for i in range(num_processes):
      command = [
        sys.executable,
        str(pathlib.Path(__file__).resolve()),
        "--worker",
        f"--coordinator=127.0.0.1:{port}",
        f"--num-processes={num_processes}",
        f"--process-id={i}",
        f"--result={result_path}",
        *config_args(config),
        *([] if progress and i == 0 else ["--no-progress"]),
      ]
      with logs[i].open("w") as log:
        output = None if i == 0 else log
        procs.append(subprocess.Popen(command, env=env, stdout=output, stderr=output))
    deadline = time.monotonic() + timeout
    try:
      while any(p.poll() is None for p in procs):
        failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
        if failed or time.monotonic() > deadline:
          what = f"process {failed[0]} failed" if failed else f"{timeout} s passed"
          raise RuntimeError(
            f"Multi-process run stopped: {what}. Logs of processes 1+:\n"
            + "\n".join(log.read_text()[-2000:] for log in logs[1:])
          )
        time.sleep(0.1)
    finally:
      for p in procs:
        if p.poll() is None:
          p.kill()
          p.wait()
    codes = [p.returncode for p in procs]
    if any(codes):
      raise RuntimeError(
        f"Exit codes {codes}. Logs of processes 1+:\n"
        + "\n".join(log.read_text()[-2000:] for log in logs[1:])
      )
    result = json.loads(result_path.read_text())
  result["losses"] = np.asarray(result["losses"], np.float32)
  return result


def worker(
  config: Config,
  coordinator: str,
  num_processes: int,
  process_id: int,
  progress: bool = True,
) -> dict:
  """One process of the multi-process run: joins the cluster and trains."""
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=coordinator,
    num_processes=num_processes,
    process_id=process_id,
  )
  try:
    return train(config, progress=progress, desc=f"process {process_id}")
  finally:
    jax.distributed.shutdown()


def main(
  *,
  steps: int = SINGLE_PROCESS_STEPS,
  batch_size: int = 256,
  num_micro_batches: int = 4,
  hidden: int = 128,
  learning_rate: float = 3e-3,
  seed: int = 0,
  multiprocess: bool = False,
  out_dir: str | pathlib.Path = "outputs",
  progress: bool = True,
) -> dict:
  """Trains data-parallel; returns the losses and metrics.

  Args:
    steps, batch_size, num_micro_batches, hidden, learning_rate, seed: the
      run (see :class:`Config`); ``batch_size`` is global.
    multiprocess: also train in 2 local processes of 4 CPU devices each and
      compare with the single-process run.
    out_dir: where ``data_parallel.png`` (the loss curve; with
      ``multiprocess``, both curves) and, with ``multiprocess``,
      ``data_parallel_multiprocess.json`` go.
    progress: show a tqdm progress bar.

  Returns:
    ``losses`` (float32, one per step: the loss of the global batch before
    the step), ``first_loss``, ``final_loss``, ``test_accuracy``,
    ``train_accuracy``, ``loop_collectives`` (collectives inside the
    compiled step's loop), ``collectives``, ``bytes_per_step``,
    ``grad_bytes``, ``num_devices``, ``seconds`` and ``png``. With
    ``multiprocess``, also ``multiprocess`` (process 0's result, same keys)
    and ``max_loss_diff`` (the largest absolute difference of the two loss
    curves).
  """
  config = Config(steps, batch_size, num_micro_batches, hidden, learning_rate, seed)
  out = pathlib.Path(out_dir)
  png = out / "data_parallel.png"
  if not multiprocess:
    result = train(config, progress=progress, desc="data parallel")
    report(result, config)
    plot(
      {
        f"{result['num_devices']} devices, {num_micro_batches} micro-batches each": (
          result["losses"]
        )
      },
      f"digits MLP, global batch {batch_size}; test accuracy "
      f"{result['test_accuracy']:.3f}",
      png,
    )
    print(f"plot: {png}")
    return {**result, "png": str(png)}

  multi = launch(config, progress=progress)
  result = train(config, progress=progress, desc="single process")
  print("single-process run with the same settings, for comparison:")
  report(result, config, prefix="  ")
  max_diff = float(np.max(np.abs(multi["losses"] - result["losses"])))
  print(
    f"max |multi-process loss - single-process loss| over {steps} steps: {max_diff:.3g}"
  )
  plot(
    {
      f"{multi['num_processes']} processes x "
      f"{multi['num_devices'] // multi['num_processes']} devices": multi["losses"],
      f"1 process x {result['num_devices']} devices": result["losses"],
    },
    f"digits MLP, global batch {batch_size}: multi- vs single-process",
    png,
  )
  summary = {
    "multiprocess_losses": multi["losses"].tolist(),
    "single_process_losses": result["losses"].tolist(),
    "max_loss_diff": max_diff,
    "multiprocess_test_accuracy": multi["test_accuracy"],
    "single_process_test_accuracy": result["test_accuracy"],
    "multiprocess_loop_collectives": multi["loop_collectives"],
    "config": dataclasses.asdict(config),
  }
  (out / "data_parallel_multiprocess.json").write_text(json.dumps(summary, indent=2))
  print(f"plot: {png}; losses: {out / 'data_parallel_multiprocess.json'}")
  return {**result, "multiprocess": multi, "max_loss_diff": max_diff, "png": str(png)}


if __name__ == "__main__":
  if WORKER["worker"]:
    config = Config(**{f.name: ARGS[f.name] for f in dataclasses.fields(Config)})
    result = worker(
      config,
      WORKER["coordinator"],
      WORKER["num_processes"],
      WORKER["process_id"],
      progress=ARGS["progress"],
    )
    if WORKER["process_id"] == 0:
      report(result, config, prefix="[process 0] ")
      losses = ", ".join(f"{v:.6f}" for v in result["losses"][:5])
      print(f"[process 0] losses of the first steps: {losses}, ...")
      result["losses"] = result["losses"].tolist()
      pathlib.Path(WORKER["result"]).write_text(json.dumps(result))
  else:
    main(**ARGS)
