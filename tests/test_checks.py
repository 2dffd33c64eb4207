"""The value-level normalization checks, switched on with chex.chexify."""

import chex
import jax
import jax.numpy as jnp
import pytest
from jax.experimental import checkify

import jaxaccum


def weighted(w, batch):
  x, weights = batch
  return jnp.sum((x @ w) ** 2 * weights), jnp.sum(weights)


W = jnp.ones(2)
X = jnp.ones((8, 2))


def checked(k):
  """The accumulated function under chexify, checking synchronously."""
  fun = jax.jit(jaxaccum.value_and_grad(weighted, k, normalize="weighted"))
  return chex.chexify(fun, async_check=False)


def test_checks_are_free_without_chexify():
  """A plain jit runs them as no-ops: a bad weight does not raise there."""
  bad = jnp.ones(8).at[3].set(-5.0)
  value, _ = jax.jit(jaxaccum.value_and_grad(weighted, 4, normalize="weighted"))(
    W, (X, bad)
  )
  assert jnp.isfinite(value)


def test_chexify_catches_a_negative_weight():
  checked(4)(W, (X, jnp.ones(8)))  # fine
  with pytest.raises(checkify.JaxRuntimeError, match="weights must be finite and >= 0"):
    checked(4)(W, (X, jnp.ones(8).at[3].set(-5.0)))


def test_chexify_catches_a_nan_weight():
  with pytest.raises(checkify.JaxRuntimeError, match="weights must be finite"):
    checked(2)(W, (X, jnp.ones(8).at[0].set(jnp.nan)))


def test_zero_total_weight_passes_the_check_with_zero_grads():
  value, grads = checked(2)(W, (X, jnp.zeros(8)))
  assert float(value) == 0.0 and not jnp.any(grads)
