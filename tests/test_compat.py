"""The JAX workarounds of ``jaxaccum/_compat.py`` against what they stand
for, on both sides of the JAX release that needs them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxaccum import _compat

#: (mesh shape, axis names): every axis manual, and an Explicit axis of
#: size 1 left to the partitioner (MaxText's meshes), where jax 0.12.0.1
#: fails to lower psum_scatter.
MESHES = {"all manual": ((8,), ("fsdp",)), "an axis left": ((1, 8), ("other", "fsdp"))}


@pytest.mark.parametrize("scatter", ["psum_scatter", "scatter_by_all_to_all"])
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("name", sorted(MESHES))
def test_the_reduce_scatter_is_psum_scatter(name, dim, scatter):
  shape, names = MESHES[name]
  mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(shape))
  x = jnp.arange(8 * 16 * 24, dtype=jnp.float32).reshape(8, 16, 24) ** 0.5
  parts = jax.device_put(x, NamedSharding(mesh, P("fsdp")))
  out = P(*([None] * (dim + 1)), "fsdp")
  fun = jax.shard_map(
    lambda local: getattr(_compat, scatter)(local[0], "fsdp", dim)[None],
    mesh=mesh,
    in_specs=P("fsdp"),
    out_specs=out,
    axis_names={"fsdp"},
  )
  with jax.set_mesh(mesh):
    got = jax.jit(fun)(parts)
  np.testing.assert_allclose(np.asarray(got)[0], np.sum(x, 0), rtol=1e-6)


@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "sharded"])
def test_psum_scatter_is_the_reduce_scatter_wherever_this_jax_lowers_it(sharded):
  """On a (2 fsdp x 4 stage) Explicit mesh, manual over "stage" only: the
  all-to-all stands in where JAX cannot lower psum_scatter (0.12 always,
  0.10.2 for an operand sharded along "fsdp"), and the reduce-scatter
  stays elsewhere. Both give the sum."""
  mesh = jax.make_mesh((2, 4), ("fsdp", "stage"), axis_types=(AxisType.Explicit,) * 2)
  x = jnp.arange(16 * 4, dtype=jnp.float32).reshape(16, 4)
  parts = jax.device_put(x, NamedSharding(mesh, P("fsdp" if sharded else None)))
  fun = jax.shard_map(
    lambda a: _compat.psum_scatter(a, "stage", 0),
    mesh=mesh,
    in_specs=P(),
    out_specs=P("stage"),
    axis_names={"stage"},
  )
  with jax.set_mesh(mesh):
    got = jax.jit(fun)(parts)
    text = jax.jit(fun).lower(parts).compile().as_text()
  np.testing.assert_allclose(np.asarray(got), 4 * x, rtol=1e-6)
  lowers = jax.__version_info__ < (0, 12) and not sharded
  assert ("reduce-scatter" in text) == lowers
  assert ("all-to-all" in text) == (not lowers)
