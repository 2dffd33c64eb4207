"""Bad input raises a ValueError at trace time that names the sizes."""

import jax
import jax.numpy as jnp
import pytest

import jaxaccum


def loss(w, batch):
  x, y = batch
  return jnp.mean((x @ w - y) ** 2)


W = jnp.zeros(3)
BATCH = (jnp.ones((12, 3)), jnp.ones(12))


def trace(fun, *args):
  """Traces without running: errors must come from tracing alone."""
  return jax.eval_shape(fun, *args)


def test_batch_not_divisible_by_k():
  with pytest.raises(
    ValueError, match=r"batch_size=12 is not divisible by num_micro_batches=5"
  ):
    trace(jaxaccum.value_and_grad(loss, 5), W, BATCH)


def test_batch_not_divisible_by_micro_batch_size():
  with pytest.raises(
    ValueError, match=r"batch_size=12 is not divisible by micro_batch_size=5"
  ):
    trace(jaxaccum.value_and_grad(loss, micro_batch_size=5), W, BATCH)


@pytest.mark.parametrize("k", [0, -3])
def test_k_not_positive(k):
  with pytest.raises(ValueError, match=f"num_micro_batches={k}"):
    jaxaccum.value_and_grad(loss, k)


def test_micro_batch_size_not_positive():
  with pytest.raises(ValueError, match="micro_batch_size=0"):
    jaxaccum.value_and_grad(loss, micro_batch_size=0)


def test_both_k_and_micro_batch_size():
  with pytest.raises(ValueError, match=r"num_micro_batches=2 and micro_batch_size=6"):
    jaxaccum.value_and_grad(loss, 2, micro_batch_size=6)


def test_neither_k_nor_micro_batch_size():
  with pytest.raises(ValueError, match="exactly one"):
    jaxaccum.value_and_grad(loss)


def test_k_must_be_an_int():
  with pytest.raises(TypeError, match="num_micro_batches"):
    jaxaccum.value_and_grad(loss, 2.0)


def test_batch_leaves_with_different_leading_sizes():
  batch = (jnp.ones((12, 3)), jnp.ones(10))
  with pytest.raises(ValueError, match=r"args\[1\]\[0\]: 12, args\[1\]\[1\]: 10"):
    trace(jaxaccum.value_and_grad(loss, 2), W, batch)


def test_several_batch_args_with_different_sizes():
  def two(w, x, y):
    return loss(w, (x, y))

  with pytest.raises(ValueError, match=r"args\[1\]: 12, args\[2\]: 8"):
    trace(
      jaxaccum.value_and_grad(two, 2, batch_argnums=(1, 2)),
      W,
      jnp.ones((12, 3)),
      jnp.ones(8),
    )


def test_scalar_batch_leaf():
  with pytest.raises(ValueError, match=r"scalar \(shape=\(\)\)"):
    trace(jaxaccum.value_and_grad(loss, 2), W, (jnp.ones((12, 3)), jnp.ones(())))


def test_unknown_normalize():
  with pytest.raises(ValueError, match="normalize='median'"):
    jaxaccum.value_and_grad(loss, 2, normalize="median")


def test_weighted_fun_that_does_not_return_a_pair():
  with pytest.raises(ValueError, match=r"\(loss_sum, weight\).*shape=\(\)"):
    trace(jaxaccum.value_and_grad(loss, 2, normalize="weighted"), W, BATCH)


def test_weighted_fun_returning_a_triple():
  def triple(w, batch):
    return loss(w, batch), 1.0, 2.0

  with pytest.raises(ValueError, match="tuple of length 3"):
    trace(jaxaccum.value_and_grad(triple, 2, normalize="weighted"), W, BATCH)


def test_weighted_with_non_scalar_weight():
  def vector_weight(w, batch):
    return loss(w, batch), jnp.ones(2)

  with pytest.raises(ValueError, match=r"weight must be a scalar, got shape=\(2,\)"):
    trace(jaxaccum.value_and_grad(vector_weight, 2, normalize="weighted"), W, BATCH)


def test_non_scalar_loss():
  with pytest.raises(ValueError, match=r"scalar, got shape=\(6,\)"):
    trace(jaxaccum.value_and_grad(lambda w, b: b[0] @ w, 2), W, BATCH)


def test_overlapping_argnums():
  with pytest.raises(ValueError, match="overlap"):
    jaxaccum.value_and_grad(loss, 2, argnums=1, batch_argnums=1)


def test_argnums_out_of_range():
  with pytest.raises(ValueError, match="2 positional arguments"):
    trace(jaxaccum.value_and_grad(loss, 2, batch_argnums=2), W, BATCH)


def test_state_without_has_aux():
  with pytest.raises(ValueError, match="has_aux=True"):
    jaxaccum.value_and_grad(loss, 2, state_argnum=2)


def test_state_that_changes_shape():
  def grows(w, batch, state):
    return loss(w, batch), (None, jnp.concatenate([state, state]))

  with pytest.raises(
    ValueError, match=r"shape=\(4,\) for a state leaf of shape=\(2,\)"
  ):
    trace(
      jaxaccum.value_and_grad(grows, 2, state_argnum=2, has_aux=True),
      W,
      BATCH,
      jnp.zeros(2),
    )


def test_has_aux_without_a_pair():
  with pytest.raises(ValueError, match=r"\(value, aux\)"):
    trace(jaxaccum.value_and_grad(loss, 2, has_aux=True), W, BATCH)


def test_integer_accum_dtype():
  with pytest.raises(ValueError, match="accum_dtype"):
    jaxaccum.value_and_grad(loss, 2, accum_dtype=jnp.int32)
