"""Arguments that every micro-batch gets whole, found at trace time.

A PRNG key passed without ``rng_argnum`` gives every micro-batch the same
dropout mask, and an array with the batch's rows left out of
``batch_argnums`` gives every micro-batch all of them: both train without an
error. jaxaccum warns about each, naming the position and the fix, and stays
silent for ``shared_argnums`` and with one micro-batch in total. Each message
is matched whole.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum

K, M = 4, 2
X = jnp.arange(K * M * 3.0).reshape(K * M, 3) / 10


def dropout_loss(w, x, key):
  keep = jax.random.bernoulli(key, 0.5, x.shape)
  return jnp.mean(jnp.where(keep, x, 0.0) @ w), keep


def key_warning(position, total=K):
  return (
    f"jaxaccum: args[{position}] is a PRNG key that reaches every micro-batch "
    f"unchanged, so all {total} micro-batches draw the same random numbers (one "
    "dropout mask for all of them). To give each its own, pass "
    f"rng_argnum={position}: micro-batch i then gets jax.random.fold_in(key, i). "
    "If one key shared by every micro-batch is what you mean, pass "
    f"shared_argnums=({position},)."
  )


def warnings_of(fun, *args):
  """The SharedArgumentWarning messages that tracing ``fun`` gives."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = fun(*args)
  messages = [
    str(w.message) for w in caught if w.category is jaxaccum.SharedArgumentWarning
  ]
  return messages, out


@pytest.mark.parametrize(
  "key", [jax.random.key(1), jax.random.PRNGKey(1)], ids=["typed", "raw"]
)
def test_a_key_without_rng_argnum_warns_naming_the_position_and_the_fix(key):
  fun = jaxaccum.value_and_grad(dropout_loss, K, has_aux=True, aux="stack")
  messages, ((_, masks), _) = warnings_of(fun, jnp.ones(3), X, key)
  assert messages == [key_warning(2)]
  # The premise: every micro-batch drew the same mask.
  np.testing.assert_array_equal(masks[0], masks[1])


def test_the_fix_the_warning_names_gives_each_micro_batch_its_own_key():
  fun = jaxaccum.value_and_grad(
    dropout_loss, K, has_aux=True, aux="stack", rng_argnum=2
  )
  messages, ((_, masks), _) = warnings_of(fun, jnp.ones(3), X, jax.random.key(1))
  assert messages == []
  assert not np.array_equal(masks[0], masks[1])


def test_shared_argnums_silences_a_key_meant_to_be_shared():
  fun = jaxaccum.value_and_grad(dropout_loss, K, has_aux=True, shared_argnums=2)
  messages, _ = warnings_of(fun, jnp.ones(3), X, jax.random.key(1))
  assert messages == []


def test_one_micro_batch_in_total_shares_nothing_and_warns_nothing():
  fun = jaxaccum.value_and_grad(dropout_loss, 1, has_aux=True)
  messages, _ = warnings_of(fun, jnp.ones(3), X, jax.random.key(1))
  assert messages == []


def test_a_key_on_a_mesh_counts_every_devices_micro_batches():
  mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  x = jax.device_put(X, NamedSharding(mesh, P("data")))
  fun = jaxaccum.value_and_grad(
    dropout_loss, 2, has_aux=True, mesh=mesh, data_axis="data"
  )
  messages, _ = warnings_of(jax.jit(fun), jnp.ones(3), x, jax.random.key(1))
  assert messages == [key_warning(2, total=8)]


def test_under_nnx_the_fix_is_an_nnx_rngs():
  model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))

  def loss(model, x, key):
    keep = jax.random.bernoulli(key, 0.5, x.shape)
    return jnp.mean(model(jnp.where(keep, x, 0.0)))

  messages, _ = warnings_of(
    jaxaccum.nnx.value_and_grad(loss, K), model, X, jax.random.key(1)
  )
  assert messages == [
    "jaxaccum: args[2] is a PRNG key that reaches every micro-batch unchanged, "
    "so all 4 micro-batches draw the same random numbers (one dropout mask for "
    "all of them). To give each its own, pass an nnx.Rngs "
    "(nnx.Rngs(dropout=key)) instead: its streams advance once per micro-batch. "
    "If one key shared by every micro-batch is what you mean, pass "
    "shared_argnums=(2,)."
  ]


def two_parts(w, x, y):
  return jnp.mean((x @ w - y) ** 2)


def test_an_argument_with_the_batchs_rows_outside_batch_argnums_warns():
  """loss(w, x, y) with the default batch_argnums=1: y is not split. Here
  it even broadcasts silently, (m,) against (B,) ... into no error."""
  y = jnp.arange(K * M, dtype=jnp.float32)
  messages, _ = warnings_of(
    jaxaccum.value_and_grad(lambda w, x, y: jnp.mean(x @ w) - jnp.mean(y), K),
    jnp.ones(3),
    X,
    y,
  )
  assert messages == [
    "jaxaccum: args[2] has the batch's leading size 8 but is not in "
    "batch_argnums=(1,), so every micro-batch gets all 8 rows of it. If part of "
    "the batch, pass batch_argnums=(1, 2); if meant whole for every "
    "micro-batch, pass shared_argnums=(2,)."
  ]


def test_the_batch_argnums_the_warning_names_splits_it():
  y = jnp.sin(jnp.arange(K * M, dtype=jnp.float32))
  fun = jaxaccum.value_and_grad(two_parts, K, batch_argnums=(1, 2))
  messages, got = warnings_of(fun, jnp.ones(3), X, y)
  assert messages == []
  want = jax.value_and_grad(two_parts)(jnp.ones(3), X, y)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
  np.testing.assert_allclose(got[1], want[1], rtol=1e-5)


def test_shared_argnums_silences_an_array_meant_whole():
  table = jnp.ones((K * M, 3))  # happens to have the batch's 8 rows
  fun = jaxaccum.value_and_grad(
    lambda w, x, t: jnp.mean(x @ w) + jnp.sum(t), K, shared_argnums=(2,)
  )
  messages, _ = warnings_of(fun, jnp.ones(3), X, table)
  assert messages == []


@pytest.mark.parametrize(
  "key", [jax.random.key(1), jax.random.PRNGKey(1)], ids=["typed", "raw"]
)
def test_a_key_where_the_batch_belongs_names_the_positions_that_fit(key):
  """loss(w, key, x) with the default batch_argnums=1: the key is taken for
  the batch (a raw key looked like a batch of 2 rows)."""

  def loss(w, key, x):
    return dropout_loss(w, x, key)[0]

  with pytest.raises(ValueError) as error:
    jaxaccum.value_and_grad(loss, K)(jnp.ones(3), key, X)
  assert str(error.value) == (
    "batch_argnums=(1,) points at args[1], a PRNG key, not a batch. Point "
    "batch_argnums=(2,), and pass rng_argnum=1: micro-batch i then gets "
    "jax.random.fold_in(key, i)."
  )
  got = jaxaccum.value_and_grad(loss, K, batch_argnums=2, rng_argnum=1)(
    jnp.ones(3), key, X
  )
  assert np.isfinite(got[0])


def test_a_key_where_the_batch_belongs_with_no_batch_to_point_at():
  with pytest.raises(ValueError) as error:
    jaxaccum.value_and_grad(lambda w, key: jnp.sum(w), K)(
      jnp.ones(3), jax.random.key(0)
    )
  assert str(error.value) == (
    "batch_argnums=(1,) points at args[1], a PRNG key, not a batch. Point "
    "batch_argnums= at the batch, and pass rng_argnum=1: micro-batch i then "
    "gets jax.random.fold_in(key, i)."
  )


def test_verify_equivalence_with_rng_argnum_points_to_the_deterministic_path():
  with pytest.raises(ValueError) as error:
    jaxaccum.verify_equivalence(
      lambda w, x, key: dropout_loss(w, x, key)[0],
      (jnp.ones(3), X, jax.random.key(0)),
      K,
      rng_argnum=2,
    )
  assert str(error.value) == (
    "verify_equivalence compares with one full-batch call; rng_argnum=2 has no "
    "full-batch counterpart, since each micro-batch draws its own random "
    "numbers. Verify the deterministic path instead: leave rng_argnum out and "
    'pass fun_kwargs={"train": False} (dropout off), or pass a fixed key that '
    "fun uses alike on any rows, with shared_argnums=(2,)."
  )


def test_shared_argnums_that_overlap_another_list_is_refused():
  with pytest.raises(ValueError) as error:
    jaxaccum.value_and_grad(two_parts, K, shared_argnums=1)
  assert str(error.value) == (
    "shared_argnums names argument 1, which is also in argnums, batch_argnums, "
    "rng_argnum or state_argnum: shared_argnums are the arguments that reach "
    "every micro-batch unchanged."
  )


def test_two_floats_or_three_uint32s_are_no_key():
  """Only a typed key or a uint32[2] is taken for one (mutmut-style: the
  dtype and the shape must both fit)."""
  fun = jaxaccum.value_and_grad(lambda w, x, a: jnp.mean(x @ w) * jnp.sum(a), K)
  for extra in (jnp.ones(2), jnp.ones(3, jnp.uint32), jnp.ones((2, 2), jnp.uint32)):
    messages, _ = warnings_of(fun, jnp.ones(3), X, extra)
    assert messages == [], extra
