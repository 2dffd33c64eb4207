"""The value-level normalization checks, switched on with chex.chexify."""

import chex
import jax
import jax.numpy as jnp
import pytest

import jaxaccum


def weighted(w, batch):
  x, weights = batch
  return jnp.sum((x @ w) ** 2 * weights), jnp.sum(weights)


@pytest.fixture(autouse=True)
def _drain_chexify_checks():
  """Leaves no asynchronous check uninspected for the next test."""
  yield
  try:
    chex.block_until_chexify_assertions_complete()
  except Exception:  # noqa: BLE001 -- already asserted by the test
    pass


W = jnp.ones(2)
X = jnp.ones((8, 2))


def test_checks_are_free_without_chexify():
  """A plain jit runs them as no-ops: a bad weight does not raise there."""
  bad = jnp.ones(8).at[3].set(-5.0)
  value, _ = jax.jit(jaxaccum.value_and_grad(weighted, 4, normalize="weighted"))(
    W, (X, bad)
  )
  assert jnp.isfinite(value)


def test_chexify_catches_a_negative_weight():
  checked = chex.chexify(
    jax.jit(jaxaccum.value_and_grad(weighted, 4, normalize="weighted"))
  )
  checked(W, (X, jnp.ones(8)))  # fine
  chex.block_until_chexify_assertions_complete()
  bad = jnp.ones(8).at[3].set(-5.0)
  with pytest.raises(Exception, match="weights must be finite and >= 0"):
    checked(W, (X, bad))
    chex.block_until_chexify_assertions_complete()


def test_chexify_catches_a_nan_weight():
  checked = chex.chexify(
    jax.jit(jaxaccum.value_and_grad(weighted, 2, normalize="weighted"))
  )
  with pytest.raises(Exception, match="weights must be finite"):
    checked(W, (X, jnp.ones(8).at[0].set(jnp.nan)))
    chex.block_until_chexify_assertions_complete()


def test_zero_total_weight_passes_the_check_with_zero_grads():
  checked = chex.chexify(
    jax.jit(jaxaccum.value_and_grad(weighted, 2, normalize="weighted"))
  )
  value, grads = checked(W, (X, jnp.zeros(8)))
  chex.block_until_chexify_assertions_complete()
  assert float(value) == 0.0 and not jnp.any(grads)
