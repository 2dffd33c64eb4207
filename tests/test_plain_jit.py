"""Without ``mesh=``, under plain ``jit`` over a batch sharded across devices,
the split follows the batch's layout (issue 19): no batch data moves between
devices, every device computes its own rows of each micro-batch, and the only
collectives are the gradient reductions that plain ``jit`` places itself.

A contiguous split would put micro-batch ``i`` on the few devices that hold
rows ``i*m .. (i+1)*m - 1``: XLA then gathers the whole batch before the loop
(5.5x the full batch's step time on 8 CPU devices) or permutes rows in it.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from jaxaccum import testing

B, F, H = 256, 16, 32
MOVES_DATA = ("all-gather", "all-gather-start", "collective-permute",
              "collective-permute-start", "all-to-all")  # fmt: skip


def loss(p, batch):
  x, y = batch
  return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)


def problem():
  keys = jax.random.split(jax.random.key(0), 3)
  params = {
    "w1": jax.random.normal(keys[0], (F, H)) / F**0.5,
    "w2": jax.random.normal(keys[1], (H,)) / H**0.5,
  }
  x = jax.random.normal(keys[2], (B, F))
  return params, (x, jnp.sin(x[:, 0]))


def run_and_compile(fun, mesh, *args):
  """``jit(fun)(*args)`` under ``mesh``, and its compiled HLO text."""
  fun = jax.jit(fun)
  with jax.set_mesh(mesh):
    return fun(*args), fun.lower(*args).compile().as_text()


@pytest.mark.slow
@pytest.mark.parametrize(
  "mode", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"]
)
@pytest.mark.parametrize("k", [2, 8])
@pytest.mark.parametrize("devices", [8, 2])
def test_a_sharded_batch_is_split_where_it_lies(mode, k, devices):
  """On 2 devices the batch lies in S = 2 blocks (mutmut: _split.
  MicroBatches, where two blocks were taken for one, a contiguous split
  that moved rows, and survived)."""
  mesh = jax.make_mesh(
    (devices,), ("data",), axis_types=(mode,), devices=jax.devices()[:devices]
  )
  params, batch = problem()
  sharded = jax.device_put(batch, NamedSharding(mesh, P("data")))
  (value, grads), text = run_and_compile(
    jaxaccum.value_and_grad(loss, k), mesh, params, sharded
  )
  want = jax.value_and_grad(loss)(params, batch)
  chex.assert_trees_all_close((value, grads), want, rtol=1e-5, atol=1e-6)
  colls = testing.collectives(text)
  assert not [c for c in colls if c.op in MOVES_DATA], colls
  # What remains is the gradient (and loss) reduction plain jit places: in
  # the loop, a reduction of at most one gradient and the loss per
  # micro-batch.
  grad_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))
  assert all(c.op.startswith("all-reduce") for c in colls), colls
  assert sum(c.bytes for c in colls if c.in_loop) <= grad_bytes + 8, colls


def test_the_documented_rows_form_each_micro_batch():
  """Micro-batch i holds the i-th slice of every block (MicroBatching.rows),
  and merge_micro_batches(aux, shards=S) gives the rows back in batch order."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  params, (x, y) = problem()
  ids = jnp.arange(B, dtype=jnp.float32)

  def with_ids(p, batch):
    x, y, row = batch
    return loss(p, (x, y)), row

  batch = jax.device_put((x, y, ids), NamedSharding(mesh, P("data")))
  k = 4
  (_, rows), _ = jax.jit(
    jaxaccum.value_and_grad(with_ids, k, has_aux=True, aux="stack")
  )(params, batch)
  shards = np.gcd(B // k, 8)
  want = jaxaccum._split.MicroBatching(B, k, B // k, shards).rows()
  np.testing.assert_array_equal(np.asarray(rows), want)
  np.testing.assert_array_equal(
    jaxaccum.merge_micro_batches(rows, shards=int(shards)), np.arange(B)
  )


def test_on_one_device_micro_batches_stay_contiguous():
  params, (x, y) = problem()
  ids = jnp.arange(B, dtype=jnp.float32)

  def with_ids(p, batch):
    x, y, row = batch
    return loss(p, (x, y)), row

  (_, rows), _ = jax.jit(
    jaxaccum.value_and_grad(with_ids, 4, has_aux=True, aux="stack")
  )(params, (x, y, ids))
  np.testing.assert_array_equal(np.asarray(rows), np.arange(B).reshape(4, -1))


def test_a_micro_batch_smaller_than_the_devices_share_is_a_clear_error_on_explicit_axes():
  """48 rows on 8 devices in 4 micro-batches of 12: a micro-batch cannot take
  an equal share of every device's rows. On Explicit axes JAX refused the
  layout with its own message; jaxaccum names the sizes and the k that fit.
  (mutmut: _split._reshape_leading, whose Explicit branch no test reached.)"""
  params, _ = problem()
  x = jax.random.normal(jax.random.key(1), (48, F))
  batch = (x, jnp.sin(x[:, 0]))
  fun = jax.jit(jaxaccum.value_and_grad(loss, 4))
  want = jax.value_and_grad(loss)(params, batch)
  for mode in (AxisType.Auto, AxisType.Explicit):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(mode,))
    sharded = jax.device_put(batch, NamedSharding(mesh, P("data")))
    with jax.set_mesh(mesh):
      if mode == AxisType.Auto:  # the layout is not visible: XLA moves rows
        chex.assert_trees_all_close(fun(params, sharded), want, rtol=1e-5, atol=1e-6)
        continue
      with pytest.raises(ValueError) as error:
        fun(params, sharded)
  assert str(error.value) == (
    "Under plain jit, a batch leaf of shape (48, 16) has its 48 rows sharded "
    "over 8 devices ('data' of an Explicit mesh), and k=4 micro-batches of "
    "m=12 rows cannot each take an equal share of every device's rows: m is "
    "not a multiple of 8. num_micro_batches=2, 3, 6 make m a multiple of 8; "
    "or pass mesh= and data_axis= (each device then splits its own rows)."
  )


@pytest.mark.slow
def test_a_leaf_sharded_along_more_axes_keeps_them_and_moves_no_rows():
  """A (batch, time, features) leaf on a (4, 2) Explicit mesh, rows over
  "data" and time over "model": each micro-batch keeps both shardings
  (mutmut: _split._merge_blocks, whose mutants dropped or shifted the
  entries after the rows' and survived rank-2 batches)."""
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  w = jax.random.normal(jax.random.key(2), (F,)) / F**0.5

  def seq_loss(w, batch):
    x, y = batch
    assert jax.typeof(x).sharding.spec[1] == "model", jax.typeof(x)
    return jnp.mean((jnp.tanh(x) @ w - y) ** 2)

  x = jax.random.normal(jax.random.key(3), (64, 4, F))
  batch = (x, jnp.cos(x[..., 0]))
  sharded = (
    jax.device_put(x, NamedSharding(mesh, P("data", "model", None))),
    jax.device_put(batch[1], NamedSharding(mesh, P("data", "model"))),
  )
  (value, grads), text = run_and_compile(
    jaxaccum.value_and_grad(seq_loss, 2), mesh, w, sharded
  )
  with jax.set_mesh(mesh):
    want = jax.value_and_grad(seq_loss)(w, sharded)
  chex.assert_trees_all_close((value, grads), want, rtol=1e-5, atol=1e-6)
  assert not [c for c in testing.collectives(text) if c.op in MOVES_DATA]
