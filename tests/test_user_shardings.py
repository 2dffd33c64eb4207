"""The user's mesh and shardings come through every path untouched: the
setups that 0.3.0's ``mesh=`` broke without a test noticing.

- A tensor-parallel parameter's gradient comes back with the parameter's
  own shards (it came back whole on every device under ``mesh=`` on Auto
  axes: an out-of-memory error on a model that fits only split).
- A loss that constrains an activation on the concrete mesh (as MaxText's
  layers do) runs where ``jax.value_and_grad`` runs it (``mesh=`` re-typed
  the user's Explicit data axes to Auto, and JAX refused the constraint).

Each case compares against ``jax.value_and_grad`` on the whole batch.
"""

import chex
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from jaxaccum import _compat

B, F, H, K = 64, 16, 32, 4
MODES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}
SPECS = {"w1": P(None, "model"), "w2": P("model")}


def tp_loss(mode):
  """Tensor parallel over "model"; on Explicit axes the sharded contraction
  names its output, with the batch axis read from the type (the idiom that
  runs in both of mesh='s views)."""

  def loss(p, batch):
    x, y = batch
    rows = jax.typeof(x).sharding.spec[0]
    out = {"out_sharding": P(rows)} if mode == "explicit" else {}
    h = jnp.tanh(x @ p["w1"])
    return jnp.mean((jnp.einsum("bh,h->b", h, p["w2"], **out) - y) ** 2)

  return loss


def tp_problem(mode):
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(mode,) * 2)
  keys = jax.random.split(jax.random.key(0), 3)
  params = {
    "w1": jax.random.normal(keys[0], (F, H)) / F**0.5,
    "w2": jax.random.normal(keys[1], (H,)) / H**0.5,
  }
  x = jax.random.normal(keys[2], (B, F))
  params = {
    n: jax.device_put(a, NamedSharding(mesh, SPECS[n])) for n, a in params.items()
  }
  batch = jax.device_put((x, jnp.sin(x[:, 0])), NamedSharding(mesh, P("data")))
  return mesh, params, batch


@pytest.mark.slow
@pytest.mark.parametrize("param_specs", [False, True], ids=["hidden", "param_specs"])
@pytest.mark.parametrize("path", ["plain", "mesh", "mesh_global"])
@pytest.mark.parametrize("mode", list(MODES))
def test_tensor_parallel_gradients_keep_their_shards(mode, path, param_specs):
  mesh, params, batch = tp_problem(MODES[mode])
  options = {}
  if path != "plain":
    options = {"mesh": mesh, "data_axis": "data"}
    if path == "mesh_global":
      options["view"] = "global"
  if param_specs:
    if path == "plain":
      pytest.skip("param_specs is an option of mesh=")
    options["param_specs"] = SPECS
  fun = jax.jit(jaxaccum.value_and_grad(tp_loss(mode), K, **options))
  with jax.set_mesh(mesh):
    value, grads = fun(params, batch)
    want = jax.jit(jax.value_and_grad(tp_loss(mode)))(params, batch)
  chex.assert_trees_all_close((value, grads), want, rtol=1e-5, atol=1e-6)
  for name, g in grads.items():
    p = params[name]
    assert g.sharding.is_equivalent_to(p.sharding, g.ndim), (name, g.sharding)
    assert g.addressable_shards[0].data.shape == p.addressable_shards[0].data.shape


@pytest.mark.slow
@pytest.mark.parametrize("spec", [P(), P(None, None)], ids=["P()", "P(None, None)"])
@pytest.mark.parametrize("mode", list(MODES))
def test_a_constraint_on_the_concrete_mesh_in_the_per_device_view(mode, spec):
  """Under mesh= fun sees one device's rows, which each device holds whole:
  P() and P(None, None) on the concrete mesh are valid there."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(MODES[mode],))
  keys = jax.random.split(jax.random.key(1), 3)
  host = {"w1": jax.random.normal(keys[0], (F, H)) / 4, "w2": jnp.ones(H) / H}
  x = jax.random.normal(keys[2], (B, F))
  batch = jax.device_put((x, jnp.cos(x[:, 0])), NamedSharding(mesh, P("data")))
  params = jax.device_put(host, NamedSharding(mesh, P()))

  def loss(p, batch):
    x, y = batch
    h = jax.lax.with_sharding_constraint(
      jnp.tanh(x @ p["w1"]), NamedSharding(mesh, spec)
    )
    return jnp.mean((h @ p["w2"] - y) ** 2)

  fun = jax.jit(jaxaccum.value_and_grad(loss, K, mesh=mesh, data_axis="data"))
  with jax.set_mesh(mesh):
    got = fun(params, batch)

  def full(p, batch):  # the same loss on the whole batch, the rows replicated
    x, y = batch
    h = jnp.tanh(x @ p["w1"])
    return jnp.mean((h @ p["w2"] - y) ** 2)

  want = jax.value_and_grad(full)(host, (x, jnp.cos(x[:, 0])))
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


#: mesh shape, axis names, data_axis, w1's spec; the last two shard w1 over
#: the data axes in another order than data_axis names them, and over two
#: dimensions (its product then gathers it, as on Explicit axes it must).
FSDP_MESHES = {
  "data": ((8,), ("data",), "data", P("data")),
  "replica_x_fsdp": ((2, 4), ("replica", "fsdp"), ("replica", "fsdp"), P("fsdp")),
  "data_x_fsdp": ((2, 4), ("data", "fsdp"), ("data", "fsdp"), P(("data", "fsdp"))),
  "fsdp_x_data": ((2, 4), ("data", "fsdp"), ("fsdp", "data"), P(("data", "fsdp"))),
  "two_dims": ((2, 4), ("data", "fsdp"), ("fsdp", "data"), P("data", "fsdp")),
  "fsdp_x_tp": ((4, 2), ("data", "model"), "data", P("data", "model")),
}


@pytest.mark.slow
@pytest.mark.parametrize("fsdp_gather", ["per_micro_batch", "cast_once"])
@pytest.mark.parametrize("where", list(FSDP_MESHES))
@pytest.mark.parametrize("mode", list(MODES))
def test_a_constraint_on_the_concrete_mesh_with_fsdp_leaves(mode, where, fsdp_gather):
  """The same constraint where a parameter is sharded over the data axes
  (FSDP, HSDP, FSDP with tensor parallelism): the per-device view keeps the
  user's axis types for those leaves too (0.3.0 re-typed the data axes to
  Auto there, and JAX refused the constraint on an Explicit mesh); on
  Explicit axes fun sees the leaf typed as the parameter is, and the
  gradient keeps its shards."""
  shape, names, data_axis, w1_spec = FSDP_MESHES[where]
  mesh = jax.make_mesh(shape, names, axis_types=(MODES[mode],) * len(names))
  keys = jax.random.split(jax.random.key(2), 3)
  host = {"w1": jax.random.normal(keys[0], (F, H)) / 4, "w2": jnp.ones(H) / H}
  x = jax.random.normal(keys[2], (B, F))
  batch = jax.device_put((x, jnp.cos(x[:, 0])), NamedSharding(mesh, P(data_axis)))
  params = {
    "w1": jax.device_put(host["w1"], NamedSharding(mesh, w1_spec)),
    "w2": jax.device_put(host["w2"], NamedSharding(mesh, P())),
  }

  seen = []

  def loss(p, batch):
    x, y = batch
    w1 = p["w1"]
    seen.append(jax.typeof(w1).sharding.spec)
    if where == "two_dims":
      w1 = jax.sharding.reshard(w1, P())
    whole = NamedSharding(mesh, P())
    h = jnp.tanh(x @ w1)
    if where == "fsdp_x_tp" and mode == "explicit":  # h is split over "model"
      h = jax.sharding.reshard(h, whole)
    h = jax.lax.with_sharding_constraint(h, whole)
    return jnp.mean((h @ p["w2"] - y) ** 2)

  fun = jax.jit(
    jaxaccum.value_and_grad(
      loss,
      K,
      mesh=mesh,
      data_axis=data_axis,
      fsdp_gather=fsdp_gather,
      gather_dtype=jnp.float32 if fsdp_gather == "cast_once" else None,
      param_specs={"w1": w1_spec, "w2": P()},
    )
  )
  with jax.set_mesh(mesh):
    value, grads = fun(params, batch)

  def full(p, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

  want = jax.value_and_grad(full)(host, (x, jnp.cos(x[:, 0])))
  chex.assert_trees_all_close((value, grads), want, rtol=1e-5, atol=1e-6)
  if mode == "explicit" and fsdp_gather == "per_micro_batch":  # fun sees its type
    assert all(spec == P(*w1_spec, *[None] * (2 - len(w1_spec))) for spec in seen)
  g = grads["w1"]
  assert g.sharding.is_equivalent_to(params["w1"].sharding, 2), g.sharding
  shard = params["w1"].addressable_shards[0].data.shape
  assert g.addressable_shards[0].data.shape == shard


def test_a_product_with_an_fsdp_leaf_that_explicit_types_refuse_is_explained():
  """On Explicit axes fun sees an FSDP leaf with its type, as under
  jax.value_and_grad on the mesh: a product that JAX refuses there (the
  rows and the weight's columns both over "data") is refused here too, at
  trace time, with what to do, the leaf named."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  w = jax.device_put(jnp.ones((F, H)), NamedSharding(mesh, P(None, "data")))
  x = jax.device_put(jnp.ones((B, F)), NamedSharding(mesh, P("data")))

  def loss(p, x):
    return jnp.mean(jnp.tanh(x @ p["w"]))

  with jax.set_mesh(mesh):
    with pytest.raises(Exception, match="illegally sharded"):
      jax.jit(jax.value_and_grad(loss))({"w": w}, x)
    fun = jax.jit(jaxaccum.value_and_grad(loss, K, mesh=mesh, data_axis="data"))
    with pytest.raises(
      ValueError, match=r"\(FSDP\): args\[0\]\['w'\] \(over data\)"
    ) as ours:
      fun({"w": w}, x)
  for words in (
    "JAX's sharding types refuse an operation in fun",
    "as under jax.value_and_grad on the same mesh",
    "jax.sharding.reshard(w, P(...))",
    "(out_sharding=)",
    "On Auto axes (param_specs=",
    "JAX said: dot_general",
  ):
    assert words in str(ours.value), words
  assert isinstance(ours.value.__cause__, _compat.SHARDING_TYPE_ERRORS)


@pytest.mark.slow
def test_a_refusal_without_fsdp_leaves_is_jaxs_own():
  """The explanation is for FSDP leaves only: on an Explicit tensor-parallel
  mesh, a contraction over "model" that names no output sharding is JAX's
  own error, as under jax.value_and_grad."""
  mesh, params, batch = tp_problem(AxisType.Explicit)

  def loss(p, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

  fun = jax.jit(jaxaccum.value_and_grad(loss, K, mesh=mesh, data_axis="data"))
  with jax.set_mesh(mesh), pytest.raises(_compat.SHARDING_TYPE_ERRORS):
    fun(params, batch)
