"""Batches in host memory (``memory_kind="pinned_host"``) stream through the scan.

On the CPU backend host and device memory are the same memory and the copy
compiles to nothing, so these tests check what can be checked here: every
entry point accepts a host batch and gives the full-batch result, and the
traced step streams (slices micro-batch ``i + 1`` out of the host array and
copies it to the device inside the loop, carried to the next iteration). The
memory saving itself is measured on a compile-only GPU target in
``tests/test_targets.py`` and ``benchmarks/accelerator_memory.py``.
"""

import chex
import jax
import jax.extend
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import jaxaccum

B, F, H = 64, 8, 16


def loss(p, batch):
  x, y = batch
  return jnp.mean((jnp.tanh(x @ p["w"]) @ p["v"] - y) ** 2)


def problem():
  keys = jax.random.split(jax.random.key(0), 3)
  params = {
    "w": jax.random.normal(keys[0], (F, H)),
    "v": jax.random.normal(keys[1], (H,)),
  }
  x = jax.random.normal(keys[2], (B, F))
  return params, (x, jnp.sin(x[:, 0]))


def on_host(tree, sharding=None):
  sharding = sharding or SingleDeviceSharding(
    jax.devices()[0], memory_kind="pinned_host"
  )
  return jax.device_put(tree, sharding)


def close(got, want):
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("under_jit", [False, True], ids=["eager", "jit"])
def test_host_batch_gives_the_full_batch(k, under_jit):
  params, batch = problem()
  host = on_host(batch)
  assert jaxaccum._split.in_host_memory(host[0])
  fun = jaxaccum.value_and_grad(loss, k)
  got = (jax.jit(fun) if under_jit else fun)(params, host)
  close(got, jax.value_and_grad(loss)(params, batch))


def test_a_batch_mixing_host_and_device_leaves():
  params, (x, y) = problem()
  got = jaxaccum.value_and_grad(loss, 4)(params, (on_host(x), y))
  close(got, jax.value_and_grad(loss)(params, (x, y)))


def scan_body(jaxpr):
  """The body of the one scan, through public jaxpr APIs only."""
  (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
  (body,) = jax.extend.core.jaxprs_in_params(eqn.params)
  return getattr(body, "jaxpr", body)


def test_the_loop_copies_the_next_micro_batch_and_carries_it():
  """Streaming, structurally: inside the loop each host leaf has one copy to
  device memory, of one micro-batch, and the copy is carried to the next
  iteration (double buffering); outside the loop nothing copies a whole host
  leaf to the device."""
  params, batch = problem()
  host = on_host(batch)
  jaxpr = jax.make_jaxpr(jaxaccum.value_and_grad(loss, 4))(params, host).jaxpr
  outside = [e for e in jaxpr.eqns if e.primitive.name == "device_put"]
  assert all(v.aval.shape[0] == B // 4 for e in outside for v in e.outvars), (
    outside
  )  # only the first micro-batch, before the loop
  body = scan_body(jaxpr)
  copies = [e for e in body.eqns if e.primitive.name == "device_put"]
  assert sorted(e.outvars[0].aval.shape for e in copies) == [(B // 4,), (B // 4, F)]
  for e in copies:
    assert e.outvars[0].aval.memory_space != jax.memory.Space.Host
    assert e.outvars[0] in body.outvars  # carried: the next iteration's batch
  host = jax.memory.Space.Host
  host_reads = [
    e
    for e in body.eqns
    if any(v.aval.memory_space == host for v in e.invars)
    and [v.aval.shape[0] for v in e.outvars if v.aval.memory_space == host] == [B // 4]
  ]
  assert len(host_reads) == 2, body  # x and y, sliced in host memory


def test_a_device_batch_is_scanned_over_not_copied():
  params, batch = problem()
  jaxpr = jax.make_jaxpr(jaxaccum.value_and_grad(loss, 4))(params, batch).jaxpr
  body = scan_body(jaxpr)
  assert not [
    e for e in body.eqns if e.primitive.name in ("device_put", "dynamic_slice")
  ]


def test_make_train_step_and_nnx_take_host_batches():
  params, batch = problem()
  host = on_host(batch)
  tx = optax.sgd(0.1)
  step = jaxaccum.make_train_step(loss, tx, 4, donate=False)
  new_params, _, value = step(params, tx.init(params), host)
  want_value, want_grads = jax.value_and_grad(loss)(params, batch)
  close(value, want_value)
  close(new_params, jax.tree.map(lambda p, g: p - 0.1 * g, params, want_grads))

  model = nnx.Linear(F, 1, rngs=nnx.Rngs(0))

  def nnx_loss(model, batch):
    x, y = batch
    return jnp.mean((model(x)[:, 0] - y) ** 2)

  reference = nnx.clone(model)
  got = jaxaccum.nnx.value_and_grad(nnx_loss, 4)(model, host)
  want = nnx.value_and_grad(nnx_loss)(reference, batch)
  close((got[0], nnx.to_pure_dict(got[1])), (want[0], nnx.to_pure_dict(want[1])))


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(8,), (4, 2)], ids=["data", "data_model"])
@pytest.mark.parametrize(
  "mode", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"]
)
def test_each_device_streams_its_own_host_shard(shape, mode):
  names = ("data", "model")[: len(shape)]
  mesh = jax.make_mesh(shape, names, axis_types=(mode,) * len(shape))
  params, batch = problem()
  host = on_host(batch, NamedSharding(mesh, P("data"), memory_kind="pinned_host"))
  assert host[0].sharding.memory_kind == "pinned_host"
  # Replicated parameters, said so: under jit on an Auto mesh with a model
  # axis their shardings are hidden, and jaxaccum would warn.
  fun = jaxaccum.value_and_grad(loss, 2, mesh=mesh, data_axis="data", param_specs=P())
  want = jax.value_and_grad(loss)(params, batch)
  close(fun(params, host), want)
  close(jax.jit(fun)(params, host), want)
