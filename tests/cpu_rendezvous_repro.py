"""XLA's CPU client can abort a multi-device loop: a reproduction without jaxaccum.

    python tests/cpu_rendezvous_repro.py --threads-per-device 1 --burn 3  # aborts
    python tests/cpu_rendezvous_repro.py --threads-per-device 2 --burn 3  # passes

8 CPU devices, one jitted step with one all-reduce, called 20,000 times
without waiting for the results, while ``--burn`` busy processes load the
machine. With as many threads as devices (XLA's default on a machine with
fewer cores than devices) and 3 busy processes on 2 cores, jaxlib 0.10.2
aborted in 3 of 3 runs, after about a minute each; with twice the threads,
3 of 3 passed. Without the busy processes, or with 2,000 steps, it rarely
aborts. The abort:

    rendezvous.cc:116] This thread has been waiting for `all reduce ...` for
    20 seconds and may be stuck. Expected 8 threads to join the rendezvous,
    but not all of them arrived on time.
    F rendezvous.cc:161] Termination timeout for `all reduce ...` of 40
    seconds exceeded. Exiting to ensure a consistent program state.
    Expected 8 threads to join the rendezvous, but only 7 of them arrived.

What gdb shows in the stuck process: 7 worker threads wait in
``InProcessCommunicator::AllReduce``; the 8th waits in
``Semaphore::Acquire``, called from ``CpuPjRtRawLoadedExecutable::Execute``
for a launch. XLA's CPU client runs launches and executions on one pool of
``max(PJRT_NPROC or the cores, devices)`` threads; a launch blocks its
thread while its device has 32 computations in flight (the host ran ahead);
the all-reduce needs one thread per device at once. With one thread per
device, the last device's execution never gets one. ``PJRT_NPROC`` at twice
the devices leaves one per device even if every launch blocks.
"""

import argparse
import os
import subprocess
import sys

if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--threads-per-device", type=int, default=1)
  parser.add_argument("--steps", type=int, default=20_000)
  parser.add_argument("--burn", type=int, default=0, help="busy processes beside")
  ARGS = parser.parse_args()
  # Before JAX starts; plain environment variables, no jaxaccum.
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={ARGS.devices}"
  os.environ["PJRT_NPROC"] = str(ARGS.threads_per_device * ARGS.devices)
  os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def main(devices: int, steps: int) -> float:
  mesh = jax.make_mesh((devices,), ("data",))
  w = jax.device_put(jnp.full((8,), 0.2), NamedSharding(mesh, P()))

  @jax.jit
  def step(w, key):
    x = jax.sharding.reshard(jax.random.normal(key, (2 * devices, 8)), P("data"))
    g = jnp.mean(x @ w)  # one all-reduce over the devices
    return jnp.where(g > 0, w * 0.5, w + 1.0)

  with jax.set_mesh(mesh):
    for i in range(steps):
      w = step(w, jax.random.key(i))  # no waiting: the host runs ahead
  return float(w.sum())


if __name__ == "__main__":
  # Each busy process ends with this one, even when XLA aborts it.
  spin = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n  sum(range(10**6))"
  busy = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(ARGS.burn)]
  try:
    print("ok", main(ARGS.devices, ARGS.steps))
  finally:
    for proc in busy:
      proc.kill()
