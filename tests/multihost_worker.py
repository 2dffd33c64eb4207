"""One process of the multi-host test (run by tests/test_multihost.py).

Usage: python multihost_worker.py PORT PROCESS_ID OUT_JSON

Two processes with 4 CPU devices each form one 8-device mesh through
``jax.distributed.initialize``. Each process feeds only its own rows of the
global batch; the accumulated data-parallel step must equal the
single-process computation, which every process also runs locally. Two meshes:
(8,) ``data``, and (4, 2) ``data`` x ``model`` with tensor-parallel weights,
whose data axis spans the two processes and whose model axis lies within
each.
"""

import json
import os
import sys

if __name__ == "__main__":  # before JAX starts; importing this file sets nothing
  from jaxaccum.testing import cpu_devices

  cpu_devices(4)
  os.environ["JAX_PLATFORMS"] = "cpu"

import agreement_steps
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum

B, F, H, K = 64, 4, 6, 2


def loss(params, batch):
  x, y = batch
  h = jnp.tanh(x @ params["w1"])
  err = (h @ params["w2"] - y) ** 2
  return jnp.mean(err), jnp.max(err)  # aux: order-sensitive


def tp_loss(params, batch):
  """The loss for an Explicit (4, 2) mesh, in the idiom of both views."""
  x, y = batch
  h = jnp.tanh(x @ params["w1"])
  out = jnp.einsum(
    "bh,h->b", h, params["w2"], out_sharding=P(jax.typeof(h).sharding.spec[0])
  )
  return jnp.mean((out - y) ** 2)


def global_array(value, sharding):
  value = np.asarray(value)
  return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def tensor_parallel(params, x, y) -> dict:
  """The (4, 2) mesh: w1 sharded P(None, "model"), w2 P("model")."""
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  assert {d.process_index for d in mesh.devices[:2].flat} == {0}
  assert {d.process_index for d in mesh.devices[2:].flat} == {1}
  specs = {"w1": P(None, "model"), "w2": P("model")}
  sharded = {
    n: global_array(v, NamedSharding(mesh, specs[n])) for n, v in params.items()
  }
  batch = tuple(global_array(a, NamedSharding(mesh, P("data"))) for a in (x, y))
  value, grads = jax.jit(
    jaxaccum.value_and_grad(tp_loss, K, mesh=mesh, data_axis="data")
  )(sharded, batch)
  kept = all(
    grads[n].sharding.is_equivalent_to(sharded[n].sharding, grads[n].ndim)
    for n in grads
  )
  grads = multihost_utils.process_allgather(grads, tiled=True)
  full_value, full_grads = jax.value_and_grad(loss_value)(params, (x, y))
  return {
    "tp_value_vs_full_batch": float(abs(float(value) - float(full_value))),
    "tp_grads_vs_full_batch": max(
      float(np.max(np.abs(np.asarray(grads[n]) - np.asarray(full_grads[n]))))
      for n in grads
    ),
    "tp_grads_sharded_like_params": kept,
  }


def agreement() -> dict:
  """tests/agreement_steps.py's checks on the (8,) mesh, with the NaN rows
  only in process 1's data; each process reports what its 4 devices hold."""
  mesh = jax.make_mesh((8,), ("data",))
  sharding = NamedSharding(mesh, P("data"))
  process_1 = [i for i, d in enumerate(mesh.devices.flat) if d.process_index == 1]

  def make_batch(*arrays):
    rows = arrays[0].shape[0] // jax.process_count()
    start = jax.process_index() * rows
    return tuple(
      jax.make_array_from_process_local_data(
        sharding, np.asarray(a[start : start + rows]), a.shape
      )
      for a in arrays
    )

  return {
    "train_step": agreement_steps.skipped_train_step(mesh, make_batch, process_1),
    "accumulate": agreement_steps.dropped_micro_batch(mesh, make_batch, process_1),
    "loss_scale": agreement_steps.adjusted_loss_scale(mesh, make_batch, process_1),
    "autopilot": agreement_steps.autopilot_windows(mesh, make_batch, 500),
  }


def loss_value(params, batch):
  return loss(params, batch)[0]


def main(port: str, process_id: str, out: str) -> None:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=2,
    process_id=int(process_id),
  )
  assert jax.device_count() == 8 and jax.local_device_count() == 4

  keys = jax.random.split(jax.random.key(0), 4)
  params = {
    "w1": jax.random.normal(keys[0], (F, H)),
    "w2": jax.random.normal(keys[1], (H,)),
  }
  x = jax.random.normal(keys[2], (B, F))
  y = jnp.sin(x @ jax.random.normal(keys[3], (F,)))

  mesh = jax.make_mesh((8,), ("data",))
  sharding = NamedSharding(mesh, P("data"))
  rows = B // jax.process_count()
  start = jax.process_index() * rows
  batch = jax.tree.map(
    lambda a: jax.make_array_from_process_local_data(
      sharding, np.asarray(a[start : start + rows]), a.shape
    ),
    (x, y),
  )
  step = jax.jit(
    jaxaccum.value_and_grad(
      loss, K, has_aux=True, aux="stack", mesh=mesh, data_axis="data"
    )
  )
  (value, aux), grads = step(params, batch)
  aux = multihost_utils.process_allgather(aux, tiled=True)

  # The single-process reference: 8 * K micro-batches on one device.
  (ref_value, ref_aux), ref_grads = jaxaccum.value_and_grad(
    loss, 8 * K, has_aux=True, aux="stack"
  )(params, (x, y))
  full_value, full_grads = jax.value_and_grad(lambda p, b: loss(p, b)[0])(
    params, (x, y)
  )

  def diff(a, b):
    return max(
      float(np.max(np.abs(np.asarray(u) - np.asarray(v))))
      for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )

  result = {
    **tensor_parallel(params, x, y),
    "agreement": agreement(),
    "process": jax.process_index(),
    "value_vs_full_batch": diff(value, full_value),
    "grads_vs_full_batch": diff(grads, full_grads),
    "aux_vs_single_process": diff(aux, ref_aux),
    "grads_vs_single_process": diff(grads, ref_grads),
    "value_vs_single_process": diff(value, ref_value),
    "value": float(value),
  }
  with open(out, "w") as f:
    json.dump(result, f)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(*sys.argv[1:])
