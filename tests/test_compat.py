"""The JAX workarounds of ``jaxaccum/_compat.py`` against what they stand
for, on both sides of the JAX release that needs them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
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


# -- JAX bugs: refused where present, exact where fixed ------------------------

C = 4  # channels, and the depthwise convolution's groups


def depthwise(params, x):
  """A depthwise convolution (feature_group_count = channels) and a bias: the
  kernel's gradient is the one some releases get wrong."""
  y = jax.lax.conv_general_dilated(
    x,
    params["kernel"],
    (1, 1),
    "SAME",
    dimension_numbers=("NHWC", "HWIO", "NHWC"),
    feature_group_count=C,
  )
  return jnp.mean(jnp.tanh(y + params["bias"][None, None, None]) ** 2)


def conv_problem():
  keys = jax.random.split(jax.random.key(0), 3)
  params = {
    "kernel": jax.random.normal(keys[0], (3, 3, 1, C)) / 3,
    "bias": jax.random.normal(keys[1], (C,)) / 10,
  }
  return params, jax.random.normal(keys[2], (16, 6, 6, C))


BUG = _compat.GROUPED_CONV_KERNEL
FIXED = ".".join(map(str, BUG.fixed))


def conv_step(path, mesh, params, x):
  """The accumulated step (k = 2) on ``mesh``, the batch on ``"data"``."""
  with jax.set_mesh(mesh):
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    params = jax.device_put(params, NamedSharding(mesh, P()))
    if path == "plain jit":
      return jax.jit(jaxaccum.value_and_grad(depthwise, 2))(params, x)
    view = "global" if path == "mesh= global" else "device"
    return jaxaccum.value_and_grad(
      depthwise, 2, mesh=mesh, data_axis="data", view=view
    )(params, x)


@pytest.mark.parametrize(
  ("path", "axes"),
  [
    ("plain jit", AxisType.Explicit),
    ("plain jit", AxisType.Auto),
    ("mesh= global", AxisType.Auto),
  ],
)
def test_a_grouped_convolutions_kernel_gradient_on_a_mesh(path, axes):
  """On a (4, 2) mesh with the batch on its first axis: where the installed
  jaxlib has the bug, plain jax.grad's kernel gradient is twice the full
  batch's (the table's claim, checked here) and jaxaccum refuses the step,
  naming the release that fixed it; where it is fixed, the step equals the
  full batch's jax.value_and_grad on one device."""
  params, x = conv_problem()
  want_value, want = jax.value_and_grad(depthwise)(params, x)
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axes, axes))
  with jax.set_mesh(mesh):
    placed = jax.device_put(x, NamedSharding(mesh, P("data")))
    replicated = jax.device_put(params, NamedSharding(mesh, P()))
    plain = jax.jit(jax.grad(depthwise))(replicated, placed)
  ratio = float(
    jnp.vdot(plain["kernel"], want["kernel"]) / jnp.vdot(want["kernel"], want["kernel"])
  )
  np.testing.assert_allclose(ratio, 2.0 if BUG.present() else 1.0, rtol=1e-5)
  if BUG.present():
    with pytest.raises(ValueError) as error:
      conv_step(path, mesh, params, x)
    # On Auto axes a traced step cannot see the batch's axes: every axis named.
    unseen = "data=4, model=2, the batch's axes unseen on Auto axes"
    here = "model=2" if path == "mesh= global" or axes == AxisType.Explicit else unseen
    assert str(error.value).startswith(
      f"jax {jax.__version__}: {BUG.what}. Here {here}."
    )
    assert f"Upgrade to jax>={FIXED}, where it is right" in str(error.value)
    return
  value, grads = conv_step(path, mesh, params, x)
  np.testing.assert_allclose(value, want_value, rtol=1e-6)
  for got, leaf in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(got, leaf, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
  "case",
  ["data-only mesh", "batch on both axes", "kernel not differentiated", "mesh= device"],
)
def test_a_grouped_convolution_the_bug_does_not_reach_runs_exactly(case):
  """No false alarm, on every release: on a mesh of the data axis alone,
  with the batch sharded over every axis, with the kernel a constant (no
  kernel gradient to take), and through mesh= in the per-device view (a
  shard_map over the data axis, which computes it right): the full batch's
  value and gradient."""
  params, x = conv_problem()
  fun = depthwise
  if case == "kernel not differentiated":
    kernel = params.pop("kernel")
    fun = lambda p, x: depthwise({**p, "kernel": kernel}, x)  # noqa: E731
  want_value, want = jax.value_and_grad(fun)(params, x)
  shape = (8,) if case == "data-only mesh" else (4, 2)
  names = ("data",) if case == "data-only mesh" else ("data", "model")
  axes = AxisType.Auto if case == "mesh= device" else AxisType.Explicit
  mesh = jax.make_mesh(shape, names, axis_types=(axes,) * len(shape))
  if case == "mesh= device":
    value, grads = conv_step("mesh= device", mesh, params, x)
  else:
    rows = P(("data", "model")) if case == "batch on both axes" else P("data")
    with jax.set_mesh(mesh):
      placed = jax.device_put(x, NamedSharding(mesh, rows))
      replicated = jax.device_put(params, NamedSharding(mesh, P()))
      value, grads = jax.jit(jaxaccum.value_and_grad(fun, 2))(replicated, placed)
  np.testing.assert_allclose(value, want_value, rtol=1e-6)
  for got, leaf in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(got, leaf, rtol=1e-5, atol=1e-7)


def test_every_bug_in_the_table_says_what_where_and_how_it_is_found():
  for bug in _compat.JAX_BUGS:
    assert bug.what and bug.detected and bug.affected
    assert all(isinstance(n, int) for n in bug.fixed)
    name = bug.test.split("::")[1]
    assert name in globals(), bug.test  # its test is here
    assert bug.present((0, 10, 2)) and not bug.present(bug.fixed)
