"""The tree toolkit (jaxaccum/_tree.py), against plain numpy references."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxaccum import _tree


# mutmut: _tree.sq_norm (accumulated in float32, also for an empty tree)
def test_sq_norm_is_float32_even_for_bfloat16_leaves_and_an_empty_tree():
  x = jnp.linspace(0.0, 1.0, 4097).astype(jnp.bfloat16)
  want = np.sum(np.square(np.asarray(x, np.float64)))
  got = _tree.sq_norm({"x": x, "y": jnp.ones((3,), jnp.bfloat16)})
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, want + 3, rtol=1e-6)
  empty = _tree.sq_norm({})
  assert isinstance(empty, jax.Array) and empty.dtype == jnp.float32
  assert float(empty) == 0.0
