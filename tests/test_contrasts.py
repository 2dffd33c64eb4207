"""The README's claims about the alternatives, each checked here.

jaxaccum's README contrasts it with ``optax.MultiSteps`` and
``optax.microbatching.microbatch``; each sentence it makes about them is one of
these tests (the traffic and memory comparisons are benchmarks).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum


def loss(w, batch):
  x, y = batch
  return jnp.mean((x @ w - y) ** 2)


def data(k=4, m=2):
  x = jax.random.normal(jax.random.key(0), (k * m, 3))
  return jnp.zeros(3), (x, x[:, 0])


def micro_grads(w, batch, k=4):
  x, y = batch
  m = x.shape[0] // k
  return [
    jax.grad(loss)(w, (x[i * m : (i + 1) * m], y[i * m : (i + 1) * m]))
    for i in range(k)
  ]


@pytest.mark.parametrize("name", ["multisteps", "jaxaccum"])
def test_a_nan_micro_batch_reaches_multisteps_parameters_not_jaxaccums(name):
  w, batch = data()
  grads = micro_grads(w, batch)
  grads[1] = grads[1].at[0].set(jnp.nan)
  k = len(grads)
  tx = (
    optax.MultiSteps(optax.sgd(0.1), k)
    if name == "multisteps"
    else jaxaccum.accumulate(optax.sgd(0.1), k)
  )
  state = tx.init(w)
  params = w
  for g in grads:
    updates, state = tx.update(g, state, params)
    params = optax.apply_updates(params, updates)
  if name == "multisteps":  # optax's default: nothing is skipped
    assert np.isnan(np.asarray(params)).any()
  else:  # the NaN micro-batch is dropped from the window and counted
    assert np.isfinite(np.asarray(params)).all() and int(state.num_skipped) == 1


def test_optax_microbatch_takes_every_kth_row():
  """optax.microbatch's micro-batch i is rows i, i + k, i + 2k, ... (a
  strided gather); jaxaccum's is the contiguous rows i*m .. (i+1)*m - 1.
  Summing each micro-batch's first row tells them apart."""
  k, m = 4, 3
  rows = jnp.arange(k * m, dtype=jnp.float32)
  theirs = optax.microbatching.microbatch(
    lambda x: x[0],
    argnums=0,
    microbatch_size=m,
    accumulator=optax.microbatching.AccumulationType.SUM,
  )(rows)
  assert float(theirs) == 0 + 1 + 2 + 3  # rows 0..3 open the micro-batches

  def first_row(w, x):
    return w * x[0]

  ours, _ = jaxaccum.value_and_grad(first_row, k, normalize="sum")(jnp.float32(1), rows)
  assert float(ours) == 0 + 3 + 6 + 9


def test_optax_microbatch_fails_on_an_explicit_mesh():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  w, (x, y) = data(k=8, m=4)
  batch = jax.device_put((x, y), NamedSharding(mesh, P("data")))
  fun = optax.microbatching.microbatch(
    jax.value_and_grad(loss),
    argnums=1,
    microbatch_size=8,
    accumulator=optax.microbatching.AccumulationType.MEAN,
  )
  with pytest.raises(Exception, match="reshape"):
    jax.jit(fun)(w, batch)
  # jaxaccum on the same mesh and batch:
  value, grads = jaxaccum.value_and_grad(loss, 4, mesh=mesh, data_axis="data")(w, batch)
  want = jax.value_and_grad(loss)(w, (x, y))
  np.testing.assert_allclose(value, want[0], rtol=1e-5)
  np.testing.assert_allclose(grads, want[1], rtol=1e-5, atol=1e-6)
