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


@pytest.mark.slow
@pytest.mark.parametrize(("rows", "k"), [(13, 4), (16, 4), (1, 8), (30, 7)])
def test_weighted_by_the_mask_equals_the_mean_over_the_real_rows(rows, k):
  w, x, y = ragged(rows)
  (px, py), mask = jaxaccum.pad_batch((x, y), k)
  assert px.shape[0] % k == 0 and px.shape[0] - rows < k
  assert isinstance(px, np.ndarray) and mask.dtype == np.float32
  np.testing.assert_array_equal(mask, np.arange(px.shape[0]) < rows)
  # numpy leaves are padded by repeating the last row, as jax leaves are
  # (mutmut: _split.pad_batch, whose numpy padding with zeros survived).
  np.testing.assert_array_equal(px[rows:], np.repeat(x[-1:], px.shape[0] - rows, 0))
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
  with pytest.raises(ValueError) as error:
    jaxaccum.pad_batch(np.zeros((0, 3)), 2)
  assert str(error.value) == (
    "pad_batch got an empty batch (batch_size=0); nothing to repeat."
  )


def test_pad_batch_names_leaves_of_different_sizes():
  """(mutmut: _split.pad_batch, whose name for the batch in the message
  survived.)"""
  with pytest.raises(ValueError) as error:
    jaxaccum.pad_batch((np.zeros((3, 2)), np.zeros((4,))), 2)
  assert str(error.value) == (
    "Batch leaves have different leading sizes (batch[0]: 3, batch[1]: 4); "
    "they must share one batch axis."
  )


def test_merged_aux_is_in_batch_order():
  w, x, y = ragged(12)

  def loss_with_rows(w, batch):
    x, y = batch
    rows = row_losses(w, x, y)
    return jnp.mean(rows), rows

  (_, rows), _ = jaxaccum.value_and_grad(loss_with_rows, 4, has_aux=True, aux="stack")(
    w, (x, y)
  )
  assert rows.shape == (4, 3)
  np.testing.assert_allclose(
    jaxaccum.merge_micro_batches(rows), row_losses(w, x, y), rtol=1e-6
  )

  mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  batch = jax.device_put((x, y), NamedSharding(mesh, P("data")))
  (_, rows), _ = jaxaccum.value_and_grad(
    loss_with_rows, 3, has_aux=True, aux="stack", mesh=mesh, data_axis="data"
  )(w, batch)
  assert rows.shape == (12, 1)
  np.testing.assert_allclose(
    jaxaccum.merge_micro_batches(rows), row_losses(w, x, y), rtol=1e-6
  )


def test_merging_a_per_micro_batch_scalar_is_an_error():
  with pytest.raises(ValueError) as error:
    jaxaccum.merge_micro_batches(jnp.zeros(4))
  assert str(error.value) == (
    "merge_micro_batches needs leaves of shape (k, m, ...), got shape=(4,): "
    "a per-micro-batch scalar has no rows to merge."
  )


def test_merge_keeps_the_trailing_axes_and_refuses_bad_shards():
  """(mutmut: _split.merge_micro_batches, whose trailing axes and checks of
  ``shards`` survived.)"""
  rows = jnp.arange(24).reshape(2, 4, 3)  # k = 2, m = 4, 3 features
  np.testing.assert_array_equal(
    jaxaccum.merge_micro_batches(rows), np.arange(24).reshape(8, 3)
  )
  blocks = jaxaccum.merge_micro_batches(rows, shards=2)[:, 0] // 3
  np.testing.assert_array_equal(blocks, [0, 1, 4, 5, 2, 3, 6, 7])
  for shards in (0, True, 1.0):
    with pytest.raises(ValueError) as error:
      jaxaccum.merge_micro_batches(rows, shards=shards)
    assert str(error.value) == f"shards must be a positive integer, got {shards!r}."
  with pytest.raises(ValueError) as error:
    jaxaccum.merge_micro_batches(rows, shards=3)
  assert str(error.value) == (
    "merge_micro_batches: micro-batches of m=4 rows do not split into shards=3 blocks."
  )


def test_a_batch_without_leaves_lives_on_one_device():
  """(mutmut: _split.batch_devices, whose default for no leaves survived.)"""
  assert jaxaccum._split.batch_devices({}) == 1
  assert jaxaccum._split.batch_devices([None, ()]) == 1
