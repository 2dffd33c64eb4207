"""pad_batch and merge_micro_batches: ragged batches and per-example aux."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum

F = 3


def row_losses(w, x, y):
  return jnp.log1p((x @ w - y) ** 2)


def masked_loss(w, batch):
  x, y, mask = batch
  return jnp.sum(row_losses(w, x, y) * mask), jnp.sum(mask)


def mean_loss(w, batch):
  x, y = batch
  return jnp.mean(row_losses(w, x, y))


def ragged(rows, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  w = jax.random.normal(keys[0], (F,))
  x = np.asarray(jax.random.normal(keys[1], (rows, F)))
  return w, x, np.asarray(np.sin(x[:, 0]))


@pytest.mark.parametrize(("rows", "k"), [(13, 4), (16, 4), (1, 8), (30, 7)])
def test_weighted_by_the_mask_equals_the_mean_over_the_real_rows(rows, k):
  w, x, y = ragged(rows)
  (px, py), mask = jaxaccum.pad_batch((x, y), k)
  assert px.shape[0] % k == 0 and px.shape[0] - rows < k
  assert isinstance(px, np.ndarray) and mask.dtype == np.float32
  np.testing.assert_array_equal(mask, np.arange(px.shape[0]) < rows)
  got = jaxaccum.value_and_grad(masked_loss, k, normalize="weighted")(w, (px, py, mask))
  want = jax.value_and_grad(mean_loss)(w, (x, y))
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


def test_micro_batch_size_and_jax_arrays():
  w, x, y = ragged(10)
  (px, py), mask = jaxaccum.pad_batch(
    (jnp.asarray(x), jnp.asarray(y)), micro_batch_size=4
  )
  assert px.shape == (12, F) and isinstance(px, jax.Array)
  # The padding repeats the last real row: finite wherever the data is.
  np.testing.assert_array_equal(px[10:], np.stack([x[-1], x[-1]]))
  got = jaxaccum.value_and_grad(masked_loss, micro_batch_size=4, normalize="weighted")(
    w, (px, py, mask)
  )
  chex.assert_trees_all_close(got, jax.value_and_grad(mean_loss)(w, (x, y)), rtol=1e-5)


def test_data_parallel_pads_to_devices_times_k():
  mesh = jax.make_mesh((8,), ("data",))
  w, x, y = ragged(50)
  k = 2
  (px, py), mask = jaxaccum.pad_batch((x, y), 8 * k)
  assert px.shape[0] == 64
  batch = jax.device_put((px, py, mask), NamedSharding(mesh, P("data")))
  got = jaxaccum.value_and_grad(
    masked_loss, k, normalize="weighted", mesh=mesh, data_axis="data"
  )(w, batch)
  chex.assert_trees_all_close(got, jax.value_and_grad(mean_loss)(w, (x, y)), rtol=1e-5)


def test_an_empty_batch_is_refused():
  with pytest.raises(ValueError, match="empty batch"):
    jaxaccum.pad_batch(np.zeros((0, 3)), 2)


def test_merged_aux_is_in_batch_order():
  w, x, y = ragged(12)

  def loss_with_rows(w, batch):
    x, y = batch
    rows = row_losses(w, x, y)
    return jnp.mean(rows), rows

  (_, rows), _ = jaxaccum.value_and_grad(loss_with_rows, 4, has_aux=True)(w, (x, y))
  assert rows.shape == (4, 3)
  np.testing.assert_allclose(
    jaxaccum.merge_micro_batches(rows), row_losses(w, x, y), rtol=1e-6
  )

  mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  batch = jax.device_put((x, y), NamedSharding(mesh, P("data")))
  (_, rows), _ = jaxaccum.value_and_grad(
    loss_with_rows, 3, has_aux=True, mesh=mesh, data_axis="data"
  )(w, batch)
  assert rows.shape == (12, 1)
  np.testing.assert_allclose(
    jaxaccum.merge_micro_batches(rows), row_losses(w, x, y), rtol=1e-6
  )


def test_merging_a_per_micro_batch_scalar_is_an_error():
  with pytest.raises(ValueError, match=r"shape \(k, m, \.\.\.\).*shape=\(4,\)"):
    jaxaccum.merge_micro_batches(jnp.zeros(4))


def test_a_batch_without_leaves_lives_on_one_device():
  """(mutmut: _split.batch_devices, whose default for no leaves survived.)"""
  assert jaxaccum._split.batch_devices({}) == 1
  assert jaxaccum._split.batch_devices([None, ()]) == 1
