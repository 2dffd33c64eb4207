"""Plain ``jit`` on an Explicit mesh is data parallel on JAX's own sharding
types: a parameter replicated over the batch's axes (replicated, or
tensor-parallel over another axis; a weight, a bias, a norm's scale, an
embedding table) is accumulated ``unreduced`` and reduced once, after the
loop, into its own sharding, and so is the loss. Before, the partitioner
all-reduced its gradient inside the loop, once per micro-batch.

Each test compares against ``jax.value_and_grad`` on the whole batch, under
the same ``jit`` on the same mesh, and reads the compiled program's
collectives: which mesh axes each spans and whether it runs in the loop.
"""

import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, reshard
from jax.sharding import PartitionSpec as P

import jaxaccum
from jaxaccum import testing

B, F, H, K = 128, 32, 64, 4
LOSS_BYTES = 4  # the loss's sum, reduced with the gradients after the loop


def explicit_mesh(shape, names):
  return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(shape))


def model(mesh, bias=True):
  """A two-layer MLP written for Explicit axes, tensor parallel over
  ``"model"`` where the mesh has it; the batch axis read from the type."""
  tp = "model" if "model" in mesh.axis_names else None

  def loss(p, batch):
    x, y = batch
    rows = jax.typeof(x).sharding.spec[0]
    h = jnp.tanh(jnp.einsum("bf,fh->bh", x, p["w1"], out_sharding=P(rows, tp)))
    out = jnp.einsum("bh,ho->bo", h, p["w2"], out_sharding=P(rows, None))
    return jnp.mean((out + (p["b"] if bias else 0.0) - y) ** 2)

  return loss


def problem(mesh, specs, batch_spec=None):
  batch_spec = P("data") if batch_spec is None else batch_spec
  keys = jax.random.split(jax.random.key(0), 4)
  params = {
    "w1": jax.random.normal(keys[0], (F, H)) / F**0.5,
    "w2": jax.random.normal(keys[1], (H, 1)) / H**0.5,
    "b": jnp.zeros((1, 1)),
  }
  x = jax.random.normal(keys[2], (B, F))
  y = jnp.sin(x[:, :1]) + 0.1 * jax.random.normal(keys[3], (B, 1))
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
  params = {n: put(a, specs.get(n, P())) for n, a in params.items()}
  return params, (put(x, batch_spec), put(y, batch_spec))


def compiled(fun, mesh, *args):
  """``jit(fun)(*args)`` under ``mesh``, and its collectives."""
  fun = jax.jit(fun)
  with jax.set_mesh(mesh):
    out = fun(*args)
    text = fun.lower(*args).compile().as_text()
  return out, testing.collectives(text)


def over(colls, mesh, axes, *, in_loop):
  """The collectives that span any of mesh ``axes``, in or after the loop."""
  dims = [mesh.axis_names.index(a) for a in axes]
  shape = tuple(mesh.shape.values())
  return [c for c in colls if c.in_loop == in_loop and c.spans(shape, dims)]


def shard_bytes(tree):
  """Float32 bytes of one device's shard of every leaf of ``tree``."""
  return sum(
    int(np.prod(x.addressable_shards[0].data.shape)) * 4 for x in jax.tree.leaves(tree)
  )


def assert_like_full_batch(out, want, params):
  chex.assert_trees_all_close(out, want, rtol=1e-5, atol=1e-6)
  for g, p in zip(jax.tree.leaves(out[1]), jax.tree.leaves(params), strict=True):
    assert jax.typeof(g) == jax.typeof(p), (jax.typeof(g), jax.typeof(p))
    assert g.sharding.is_equivalent_to(p.sharding, g.ndim), (g.sharding, p.sharding)


MESHES = {
  "data8": ((8,), ("data",), {}),
  "data4_model2": (
    (4, 2),
    ("data", "model"),
    {"w1": P(None, "model"), "w2": P("model", None)},
  ),
}


@pytest.mark.slow
@pytest.mark.parametrize("path", ["plain", "mesh_global"])
@pytest.mark.parametrize("name", list(MESHES))
def test_replicated_and_tensor_parallel_gradients_are_reduced_once_after_the_loop(
  name, path
):
  """Before, the partitioner all-reduced every micro-batch's gradient over
  "data" inside the loop; and a tensor-parallel gradient must come back
  with its own shards, as under jax.value_and_grad. mesh= with
  view="global" on Explicit axes is the same step (mesh= only names the
  data axes)."""
  shape, names, specs = MESHES[name]
  mesh = explicit_mesh(shape, names)
  params, batch = problem(mesh, specs)
  loss = model(mesh)
  options = {"mesh": mesh, "data_axis": "data", "view": "global"}
  fun = jaxaccum.value_and_grad(loss, K, **(options if path != "plain" else {}))
  out, colls = compiled(fun, mesh, params, batch)
  want, _ = compiled(jax.value_and_grad(loss), mesh, params, batch)
  assert_like_full_batch(out, want, params)
  assert not over(colls, mesh, ["data"], in_loop=True), colls
  after = over(colls, mesh, ["data"], in_loop=False)
  assert [c.op for c in after] == ["all-reduce"], after
  assert after[0].bytes == shard_bytes(params) + LOSS_BYTES, after
  if "model" in names:  # the tensor-parallel all-reduce stays in the loop
    tp = over(colls, mesh, ["model"], in_loop=True)
    assert tp and not any(c.spans(shape, [0]) for c in tp), tp


def hand_scan(loss, params, batch, k, devices):
  """The obvious hand-written accumulation: a scan over the i-th slices of
  every device's rows, each gradient added into an accumulator typed like
  its parameter."""
  rows = jax.typeof(batch[0]).sharding.spec[0]

  def split(a):  # (B, ...) -> (k, D, m / D, ...), each row where it lies
    shape = (devices, k, a.shape[0] // (devices * k), *a.shape[1:])
    blocked = jax.lax.reshape(a, shape, out_sharding=P(rows, *(None,) * a.ndim))
    return jnp.swapaxes(blocked, 0, 1)

  def merge(a):  # (D, m / D, ...) -> (m, ...)
    shape = (a.shape[0] * a.shape[1], *a.shape[2:])
    return jax.lax.reshape(a, shape, out_sharding=P(rows, *(None,) * (a.ndim - 2)))

  def body(acc, micro):
    g = jax.grad(loss)(params, jax.tree.map(merge, micro))
    return jax.tree.map(lambda a, b: a + b / k, acc, g), None

  acc = jax.tree.map(jnp.zeros_like, params)
  return jax.lax.scan(body, acc, jax.tree.map(split, batch))[0]


def test_an_fsdp_leaf_is_reduced_in_the_loop_as_the_hand_written_scan_does():
  """FSDP keeps its default: each micro-batch's gradient of a leaf sharded
  over "data" is reduced inside the loop, no more than the hand-written
  scan does; the replicated leaves are still reduced once, after it."""
  mesh = explicit_mesh((4, 2), ("data", "model"))
  specs = {"w1": P("data", "model"), "w2": P("model", None)}
  params, batch = problem(mesh, specs)
  loss = model(mesh)
  out, colls = compiled(jaxaccum.value_and_grad(loss, K), mesh, params, batch)
  want, _ = compiled(jax.value_and_grad(loss), mesh, params, batch)
  assert_like_full_batch(out, want, params)
  grads, hand = compiled(lambda p, b: hand_scan(loss, p, b, K, 4), mesh, params, batch)
  chex.assert_trees_all_close(grads, want[1], rtol=1e-5, atol=1e-6)

  def reductions(colls):
    return sum(
      c.bytes for c in over(colls, mesh, ["data"], in_loop=True) if "reduce" in c.op
    )

  assert 0 < reductions(colls) <= reductions(hand), (colls, hand)
  # the weight's gather stays in the loop (the hand scan's is hoisted out,
  # holding the whole weight through the loop)
  assert any(c.op.startswith("all-gather") and c.in_loop for c in colls), colls
  after = over(colls, mesh, ["data"], in_loop=False)
  replicated = {"w2": params["w2"], "b": params["b"]}
  assert [c.bytes for c in after] == [shard_bytes(replicated) + LOSS_BYTES], after


@pytest.mark.parametrize("fsdp_gather", ["once", "cast_once"])
def test_fsdp_modes_that_gather_before_the_loop(fsdp_gather):
  """ "once" gathers before the loop and reduces after it, nothing over
  "data" in the loop; "cast_once" gathers in bfloat16 before the loop and
  reduces each micro-batch's gradient in it."""
  mesh = explicit_mesh((4, 2), ("data", "model"))
  specs = {"w1": P("data", "model"), "w2": P("model", None)}
  params, batch = problem(mesh, specs)
  loss = model(mesh)
  options = {"gather_dtype": jnp.bfloat16} if fsdp_gather == "cast_once" else {}
  fun = jaxaccum.value_and_grad(loss, K, fsdp_gather=fsdp_gather, **options)
  out, colls = compiled(fun, mesh, params, batch)
  want, _ = compiled(jax.value_and_grad(loss), mesh, params, batch)
  tolerance = 1e-6 if fsdp_gather == "once" else 2e-2
  chex.assert_trees_all_close(out, want, rtol=tolerance, atol=tolerance)
  for g, p in zip(jax.tree.leaves(out[1]), jax.tree.leaves(params), strict=True):
    assert jax.typeof(g) == jax.typeof(p)
  gathers = [c for c in colls if c.op.startswith("all-gather")]
  assert gathers and not any(c.in_loop for c in gathers), gathers
  in_loop = sum(c.bytes for c in over(colls, mesh, ["data"], in_loop=True))
  if fsdp_gather == "once":
    assert in_loop == 0, colls
  else:
    assert in_loop > shard_bytes({"w1": params["w1"]}), colls


def test_a_constraint_on_the_concrete_mesh_works_as_under_jax_value_and_grad():
  """fun runs on the user's mesh with its own axis types: a
  with_sharding_constraint naming the concrete mesh (as MaxText's layers
  do) is valid where jax.value_and_grad takes it."""
  mesh = explicit_mesh((8,), ("data",))
  params, batch = problem(mesh, {})

  def loss(p, batch):
    x, y = batch
    h = jnp.tanh(x @ p["w1"])
    h = jax.lax.with_sharding_constraint(h, NamedSharding(mesh, P("data", None)))
    h = reshard(h, NamedSharding(mesh, P("data", None)))
    return jnp.mean((h @ p["w2"] + p["b"] - y) ** 2)

  out, colls = compiled(jaxaccum.value_and_grad(loss, K), mesh, params, batch)
  want, _ = compiled(jax.value_and_grad(loss), mesh, params, batch)
  assert_like_full_batch(out, want, params)
  assert not over(colls, mesh, ["data"], in_loop=True), colls


def test_grad_alone_reduces_nothing_over_data_in_the_loop():
  """Without the value the loss's own reduction is dead: jaxaccum.grad's
  only data-axis collective is the one after the loop."""
  mesh = explicit_mesh((8,), ("data",))
  params, batch = problem(mesh, {})
  loss = model(mesh, bias=False)
  grads, colls = compiled(jaxaccum.grad(loss, K), mesh, params, batch)
  want, _ = compiled(jax.grad(loss), mesh, params, batch)
  chex.assert_trees_all_close(grads, want, rtol=1e-5, atol=1e-6)
  assert not over(colls, mesh, ["data"], in_loop=True), colls
  assert len(over(colls, mesh, ["data"], in_loop=False)) == 1, colls


def test_two_data_axes_are_both_reduced_once():
  """A batch sharded over ("replica", "fsdp"), parameters replicated: the
  data axes are both axes of the batch's rows."""
  mesh = explicit_mesh((2, 4), ("replica", "fsdp"))
  params, batch = problem(mesh, {}, P(("replica", "fsdp")))
  loss = model(mesh)
  out, colls = compiled(jaxaccum.value_and_grad(loss, K), mesh, params, batch)
  want, _ = compiled(jax.value_and_grad(loss), mesh, params, batch)
  assert_like_full_batch(out, want, params)
  axes = ["replica", "fsdp"]
  assert not over(colls, mesh, axes, in_loop=True), colls
  after = over(colls, mesh, axes, in_loop=False)
  assert [c.bytes for c in after] == [shard_bytes(params) + LOSS_BYTES], after


def test_state_keys_and_aux_are_the_partitioners_step():
  """The threaded state, the keys and the aux are plain jit's: the same
  micro-batches (the i-th slice of every device's rows) as the same step
  on Auto axes, where the partitioner reduces every micro-batch."""

  def loss(p, batch, key, state):
    x, y = batch
    keep = jax.random.bernoulli(key, 0.8, x.shape)
    h = jnp.tanh(jnp.where(keep, x, 0.0) @ p["w1"])
    mean = jnp.mean(h, axis=0, keepdims=True)
    out = (h - mean) @ p["w2"] + p["b"]
    new_state = 0.9 * state + 0.1 * mean
    return jnp.mean((out - y) ** 2), (jnp.mean(out), new_state)

  fun = jaxaccum.value_and_grad(loss, K, has_aux=True, rng_argnum=2, state_argnum=3)
  results = []
  for mode in (AxisType.Explicit, AxisType.Auto):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(mode,))
    params, batch = problem(mesh, {})
    state = jax.device_put(jnp.zeros((1, H)), NamedSharding(mesh, P()))
    out, colls = compiled(fun, mesh, params, batch, jax.random.key(3), state)
    results.append(out)
  chex.assert_trees_all_close(results[0], results[1], rtol=1e-5, atol=1e-6)
  explicit = explicit_mesh((8,), ("data",))
  params, batch = problem(explicit, {})
  state = jax.device_put(jnp.zeros((1, H)), NamedSharding(explicit, P()))
  _, colls = compiled(fun, explicit, params, batch, jax.random.key(3), state)
  grad_bytes = shard_bytes(params)
  in_loop = over(colls, explicit, ["data"], in_loop=True)
  assert sum(c.bytes for c in in_loop) < grad_bytes, in_loop


@pytest.mark.slow
def test_make_train_step_and_nnx_take_the_same_path():
  """make_train_step and jaxaccum.nnx build the same step: one data-axis
  reduction of the gradient, after the loop, equal to the full batch."""
  from flax import nnx  # noqa: PLC0415

  mesh = explicit_mesh((8,), ("data",))
  params, batch = problem(mesh, {})
  loss = model(mesh)
  step = jaxaccum.make_train_step(loss, optax.sgd(0.1), K, donate=False)
  with jax.set_mesh(mesh):
    new_params, _, _ = step(params, optax.sgd(0.1).init(params), batch)
    want = jax.tree.map(lambda p, g: p - 0.1 * g, params, jax.grad(loss)(params, batch))
    text = jax.jit(step).lower(params, optax.sgd(0.1).init(params), batch)
  chex.assert_trees_all_close(new_params, want, rtol=1e-5, atol=1e-6)
  colls = testing.collectives(text.compile().as_text())
  assert not over(colls, mesh, ["data"], in_loop=True), colls

  class Linear(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(reshard(jnp.ones((F, 1)) / F, P()))

    def __call__(self, x):
      return x @ self.w[...]

  def nnx_loss(m, batch):
    x, y = batch
    return jnp.mean((m(x) - y) ** 2)

  with jax.set_mesh(mesh):
    m = Linear()
    fun = jax.jit(jaxaccum.nnx.value_and_grad(nnx_loss, K))
    (value, grads), ref = fun(m, batch), jax.jit(nnx.value_and_grad(nnx_loss))(m, batch)
    text = fun.lower(m, batch).compile().as_text()
  chex.assert_trees_all_close((value, grads), ref, rtol=1e-5, atol=1e-6)
  colls = testing.collectives(text)
  assert not over(colls, mesh, ["data"], in_loop=True), colls
  assert len(over(colls, mesh, ["data"], in_loop=False)) == 1, colls


def test_a_penalty_on_the_weights_alone_reduces_no_gradient_in_the_loop():
  """A matrix product of a weight with a constant (a penalty computed from
  the weights alone) has no rows to leave unreduced: that use takes the
  weight made plain, and its gradient, the same on every device, is added
  to the unreduced sum where it was computed; exact. The loss it is added
  to is reduced where they meet (4 bytes)."""
  mesh = explicit_mesh((8,), ("data",))
  params, batch = problem(mesh, {})
  base = model(mesh)

  def loss(p, batch):
    return base(p, batch) + 1e-3 * jnp.sum(jnp.ones((3, F)) @ p["w1"])

  out, colls = compiled(jaxaccum.value_and_grad(loss, K), mesh, params, batch)
  want, _ = compiled(jax.value_and_grad(loss), mesh, params, batch)
  assert_like_full_batch(out, want, params)
  in_loop = sum(c.bytes for c in over(colls, mesh, ["data"], in_loop=True))
  assert in_loop <= LOSS_BYTES, colls
  after = over(colls, mesh, ["data"], in_loop=False)
  assert len(after) == 1, after
  assert in_loop + after[0].bytes == shard_bytes(params) + LOSS_BYTES, colls


def test_a_use_jax_refuses_as_reduced_costs_that_use_alone(monkeypatch):
  """Where JAX refuses a rewritten use's transpose (here the walk is told
  that a product with a constant contracts rows: JAX takes it forward, not
  backward), that use alone takes the leaf plain, found at the use (no
  warning, no whole-step fallback): the other leaves stay reduced, and the
  step is exact."""
  from jaxaccum._parallel import reduced as _reduced  # noqa: PLC0415

  monkeypatch.setattr(_reduced, "_contracts_rows", lambda *a: True)
  mesh = explicit_mesh((8,), ("data",))
  params, batch = problem(mesh, {})
  base = model(mesh)

  def loss(p, batch):
    return base(p, batch) + 1e-3 * jnp.sum(jnp.ones((3, F)) @ p["w1"])

  with warnings.catch_warnings():
    warnings.simplefilter("error")
    out, colls = compiled(jaxaccum.value_and_grad(loss, K), mesh, params, batch)
  want, _ = compiled(jax.value_and_grad(loss), mesh, params, batch)
  assert_like_full_batch(out, want, params)
  in_loop = sum(c.bytes for c in over(colls, mesh, ["data"], in_loop=True))
  # w1's gradient from its plain use, and the loss's sum (a penalty meets it)
  assert in_loop <= shard_bytes({"w1": params["w1"]}) + LOSS_BYTES, colls


def test_a_program_the_walk_does_not_know_reduces_every_micro_batch(monkeypatch):
  """A failure of the jaxpr walk (a primitive's parameters renamed by a
  new jax, as scan's were) costs bytes, never the step: a warning, each
  use it could not rewrite reduced by the partitioner, still exact."""
  from jaxaccum._parallel import reduced as _reduced  # noqa: PLC0415

  def broken(self, eqn, invals, sources):
    raise KeyError("num_consts")

  monkeypatch.setattr(_reduced._Walk, "use", broken)
  mesh = explicit_mesh((8,), ("data",))
  params, batch = problem(mesh, {})
  loss = model(mesh)
  with pytest.warns(UserWarning, match="could not rewrite a use"):
    out, colls = compiled(jaxaccum.value_and_grad(loss, K), mesh, params, batch)
  want, _ = compiled(jax.value_and_grad(loss), mesh, params, batch)
  assert_like_full_batch(out, want, params)
  in_loop = sum(c.bytes for c in over(colls, mesh, ["data"], in_loop=True))
  assert in_loop >= shard_bytes(params), colls
