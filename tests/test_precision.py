"""bf16 parameters: the sums are float32, the grads come back in bf16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxaccum

K = 256


def bf16_problem():
  # Each micro-batch gradient is 1.0 to 1.1, so a running bf16 sum passes 128,
  # where bf16's spacing is 1: from there on every fraction is rounded away.
  x = 1.0 + 0.1 * jax.random.uniform(jax.random.key(0), (2 * K, 3))
  return jnp.ones(3, jnp.bfloat16), x.astype(jnp.bfloat16)


def loss(w, x):
  return jnp.mean(jnp.sum(x * w[None, :], axis=1))


def micro_batch_grads(w, x):
  """Each micro-batch's bf16 gradient, one at a time."""
  grads = [jax.grad(loss)(w, x[2 * i : 2 * i + 2]) for i in range(K)]
  return np.stack([np.asarray(g, np.float64) for g in grads])


def one_bf16_rounding(value):
  """Half a bf16 spacing around ``value``: 2**-8 relative, plus a spare bit."""
  return 2.0**-7 * np.abs(value)


@pytest.mark.slow
def test_bf16_accumulates_in_float32():
  w, x = bf16_problem()
  grads = jax.jit(jaxaccum.grad(loss, K))(w, x)
  assert grads.dtype == jax.grad(loss)(w, x).dtype == jnp.bfloat16

  exact = micro_batch_grads(w, x).mean(axis=0)
  err = np.abs(np.asarray(grads, np.float64) - exact)
  assert np.all(err <= one_bf16_rounding(exact)), (err, exact)

  # The same sum in a bf16 accumulator misses by far more than one rounding,
  # so this test can fail.
  naive = jnp.zeros(3, jnp.bfloat16)
  for g in micro_batch_grads(w, x):
    naive = naive + jnp.asarray(g, jnp.bfloat16)
  naive_err = np.abs(np.asarray(naive / K, np.float64) - exact)
  assert np.all(naive_err > 2 * one_bf16_rounding(exact)), naive_err


def test_bf16_value_dtype_matches_jax():
  w, x = bf16_problem()
  value, _ = jaxaccum.value_and_grad(loss, 16)(w, x)
  assert value.dtype == jax.value_and_grad(loss)(w, x)[0].dtype


def running_sum(grads, dtype):
  """The micro-batch gradients added one at a time in ``dtype``, in order."""
  total = jnp.zeros(grads.shape[1:], dtype)
  for g in grads:
    total = total + jnp.asarray(g, dtype)
  return np.asarray(total, np.float64)


@pytest.mark.slow
@pytest.mark.parametrize("accum_dtype", [jnp.float32, jnp.bfloat16])
def test_accum_dtype_is_never_narrower_than_the_gradient(accum_dtype):
  """float32 gradients are summed in float32 even if accum_dtype is bf16.

  The K micro-batch gradients are 1.0 to 1.1 each, so a bf16 sum loses the
  fractions past 128 (see bf16_problem); a float32 sum of K positive terms
  is within K * 2**-24 relative of the exact one (the worst-case bound for
  summation), far below that.
  """
  w, x = bf16_problem()
  w, x = w.astype(jnp.float32), x.astype(jnp.float32)
  grads = jax.jit(jaxaccum.grad(loss, K, accum_dtype=accum_dtype))(w, x)
  assert grads.dtype == jnp.float32
  micro = micro_batch_grads(w, x)
  exact = micro.mean(axis=0)
  np.testing.assert_allclose(np.asarray(grads, np.float64), exact, rtol=K * 2.0**-24)
  # A bf16 accumulator would miss by more than that: this test can fail.
  bf16_mean = running_sum(micro, jnp.bfloat16) / K
  assert np.all(np.abs(bf16_mean - exact) > 100 * K * 2.0**-24 * exact)


def test_accum_dtype_is_used_where_it_is_wider_or_equal():
  """accum_dtype=bf16 on bf16 gradients is a bf16 sum, as asked: the result
  follows a bf16 running sum, not the float32 one (the default)."""
  w, x = bf16_problem()
  grads = jax.jit(jaxaccum.grad(loss, K, accum_dtype=jnp.bfloat16))(w, x)
  assert grads.dtype == jnp.bfloat16
  micro = micro_batch_grads(w, x)
  exact = micro.mean(axis=0)
  bf16_mean = running_sum(micro, jnp.bfloat16) / K
  got = np.asarray(grads, np.float64)
  assert np.all(np.abs(got - bf16_mean) <= one_bf16_rounding(bf16_mean)), (
    got,
    bf16_mean,
  )
  assert np.all(np.abs(got - exact) > 2 * one_bf16_rounding(exact)), (got, exact)
