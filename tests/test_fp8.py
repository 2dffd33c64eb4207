"""FP8 training under accumulation (issue 47): Flax's FP8 metadata, and any
leaf that is not a gradient, combined as the full batch's backward pass
gives it.

- ``Fp8DotGeneralOp``'s scales and amax histories (the
  ``_overwrite_with_gradient`` collection, whose "gradient" is the new
  value) equal ``jax.grad``'s on the full batch at k = 1, 2, 4, 8: the
  input and kernel histories by max over the micro-batches, the
  output-gradient history from cotangents seeded as the full batch's, the
  scales never normalized. So do they under Flax's ``fm32`` meta dtype
  (combined by the dtype's own addition, max), over five ``TrainState``
  steps, and under ``mesh=`` on 8 CPU devices.
- ``combine=`` names the rule of a user's own non-additive state: a running
  max, a running min, a row count, the last row.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax.linen import fp8_ops
from flax.training import train_state
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from jaxaccum import testing

OWG = fp8_ops.OVERWRITE_WITH_GRADIENT
pytestmark = pytest.mark.filterwarnings(
  "ignore:The Fp8DotGeneralOp is deprecated:DeprecationWarning"
)


class Mlp(nn.Module):
  """Two FP8 dense layers, as the issue's table measured (Flax's
  deprecated ``Fp8DotGeneralOp``, which MaxText's recipe used, or its
  successor ``Fp8DirectDotGeneralOp``)."""

  op: type = fp8_ops.Fp8DotGeneralOp

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(16, dot_general_cls=self.op)(x))
    return nn.Dense(4, dot_general_cls=self.op)(x)


MODEL = Mlp()


def batch(rows=64, seed=0):
  """Rows whose scales range from 0.1 to 8, so that each micro-batch's amax
  differs from the full batch's."""
  x = jax.random.normal(jax.random.key(seed), (rows, 8))
  x = x * jnp.linspace(0.1, 8, rows)[:, None]
  return x, jax.random.normal(jax.random.key(seed + 1), (rows, 4))


def variables():
  return MODEL.init(jax.random.key(2), batch()[0][:2])


def loss(v, b):
  x, y = b
  return jnp.mean((MODEL.apply(v, x) - y) ** 2)


def assert_metadata_equal(got, want, rtol=1e-6, atol=0.0):
  """Every FP8 variable equal (relative ``rtol``), named on failure."""
  for (path, a), b in zip(
    jax.tree_util.tree_leaves_with_path(want[OWG]),
    jax.tree.leaves(got[OWG]),
    strict=True,
  ):
    np.testing.assert_allclose(
      np.asarray(b),
      np.asarray(a),
      rtol=rtol,
      atol=atol,
      err_msg=jax.tree_util.keystr(path),
    )


def assert_params_close(got, want):
  pairs = zip(
    jax.tree.leaves(want["params"]), jax.tree.leaves(got["params"]), strict=True
  )
  for a, b in pairs:
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_fp8_metadata_is_the_full_batch_s(k):
  """The issue's table: summed and divided by k, the input amax was the
  micro-batches' mean and the output-gradient amax k times too large."""
  v, b = variables(), batch()
  want = jax.jit(jax.grad(loss))(v, b)
  got = jaxaccum.grad(loss, k)(v, b)
  assert_metadata_equal(got, want)
  assert_params_close(got, want)


@pytest.mark.parametrize("k", [2, 4])
def test_fp8_direct_dot_general_metadata_is_the_full_batch_s(k):
  """Flax's current FP8 op: its output-gradient metadata comes from its
  quantized dot's backward pass, the input's and kernel's from ``in_q``."""
  model = Mlp(fp8_ops.Fp8DirectDotGeneralOp)
  v, b = model.init(jax.random.key(2), batch()[0][:2]), batch()

  def direct(v, b):
    x, y = b
    return jnp.mean((model.apply(v, x) - y) ** 2)

  want = jax.jit(jax.grad(direct))(v, b)
  got = jaxaccum.grad(direct, k)(v, b)
  assert_metadata_equal(got, want)
  assert_params_close(got, want)


@pytest.mark.parametrize("k", [2, 4, 8])
def test_output_gradient_amax_is_seeded_as_the_full_batch_s(k):
  """``normalize="sum"`` of a loss that divides by the batch's rows itself:
  no normalization after the loop, so each micro-batch's backward pass is
  seeded with 1, as the full batch's (the mean under ``mesh=`` and plain
  ``jit``, seeded with 1 / k, is tested below)."""
  v, b = variables(), batch()
  rows = b[0].shape[0]

  def summed(v, b):
    x, y = b
    return jnp.sum((MODEL.apply(v, x) - y) ** 2) / (rows * 4)

  want = jax.jit(jax.grad(summed))(v, b)
  got = jaxaccum.grad(summed, k, normalize="sum")(v, b)
  assert_metadata_equal(got, want)


def as_fm32(v):
  """The FP8 metadata in Flax's ``fm32`` meta dtype (autodiff adds by max),
  as MaxText keeps it."""
  return {**v, OWG: jax.tree.map(lambda x: x.astype(fp8_ops.fm32), v[OWG])}


@pytest.mark.parametrize("k", [2, 4])
def test_fm32_metadata_combines_by_its_dtype_s_addition(k):
  """Cast to float32 and added, an fm32 leaf would be summed; by its
  dtype's own addition it is the full batch's."""
  b = batch()

  @jax.jit
  def both(b):
    v = as_fm32(variables())
    f32 = lambda g: {**g, OWG: jax.tree.map(lambda x: x.astype(jnp.float32), g[OWG])}  # noqa: E731
    want = jax.grad(loss, allow_int=True)(v, b)
    got = jaxaccum.grad(loss, k)(v, b)
    dtypes = {str(x.dtype) for x in jax.tree.leaves(got[OWG])}
    assert dtypes == {"fp8_meta32"}, dtypes
    return f32(got), f32(want)

  got, want = both(b)
  assert_metadata_equal(got, want)
  assert_params_close(got, want)


def test_linen_train_state_steps_equal_the_full_batch_s():
  """Five ``TrainState.apply_gradients`` steps: each step's metadata is
  written over the old (so a wrong history feeds the next step's scale)."""
  v = variables()
  tx = optax.adam(1e-2)
  states = [
    train_state.TrainState.create(apply_fn=MODEL.apply, params=v, tx=tx) for _ in "ab"
  ]
  full = jax.jit(lambda s, b: s.apply_gradients(grads=jax.grad(loss)(s.params, b)))
  accum = jax.jit(
    lambda s, b: s.apply_gradients(grads=jaxaccum.grad(loss, 4)(s.params, b))
  )
  want, got = states
  for step in range(5):
    b = batch(seed=10 + step)
    want, got = full(want, b), accum(got, b)
    assert_metadata_equal(got.params, want.params)
    assert_params_close(got.params, want.params)


# -- combine=: a user's own non-additive state ------------------------------------


@jax.custom_vjp
def observe(x, peak, low, count, last):
  """``x``; the "gradients" of the statistics are their new values (a
  running max and min of ``|x|``, the rows seen, the last row's first
  entry), as Flax's FP8 metadata does."""
  del peak, low, count, last
  return x


def _observe_fwd(x, peak, low, count, last):
  a = jnp.abs(x)
  new = (
    jnp.maximum(peak, jnp.max(a)),
    jnp.minimum(low, jnp.min(a)),
    jnp.full_like(count, x.shape[0]),
    x[-1, 0] + 0 * last,
  )
  return x, new


def _observe_bwd(new, g):
  return (g, *new)


observe.defvjp(_observe_fwd, _observe_bwd)


def stats_loss(params, b):
  x, y = b
  s = params["stats"]
  x = observe(x, s["peak"], s["low"], s["count"], s["last"])
  return jnp.mean((x @ params["w"] - y) ** 2)


def stats_params():
  stats = {"peak": jnp.float32(0.5), "low": jnp.float32(100.0), "count": jnp.float32(0)}
  stats["last"] = jnp.float32(0)
  return {"w": jnp.ones((8, 4)) * 0.1, "stats": stats}


COMBINE = {
  "w": None,
  "stats": {"peak": "max", "low": "min", "count": "sum", "last": "last"},
}


@pytest.mark.parametrize("k", [2, 4])
def test_combine_names_each_leaf_s_rule(k):
  """Summed and divided by k (a gradient's rule), the running max would be
  the micro-batches' mean and the count one micro-batch's rows."""
  p, b = stats_params(), batch()
  want = jax.jit(jax.grad(stats_loss))(p, b)
  got = jaxaccum.grad(stats_loss, k, combine=COMBINE)(p, b)
  for name in ("peak", "low", "count", "last"):
    np.testing.assert_allclose(
      got["stats"][name], want["stats"][name], rtol=1e-6, err_msg=name
    )
  assert float(got["stats"]["count"]) == 64.0
  np.testing.assert_allclose(got["w"], want["w"], rtol=1e-5, atol=1e-7)


def test_combine_as_a_string_applies_to_every_leaf():
  p, b = stats_params(), batch()
  got = jaxaccum.grad(lambda s, b: stats_loss({**p, "stats": s}, b), 4, combine="max")(
    p["stats"], b
  )
  want = jax.grad(lambda s, b: stats_loss({**p, "stats": s}, b))(p["stats"], b)
  np.testing.assert_allclose(got["peak"], want["peak"], rtol=1e-6)


def test_combine_refuses_an_unknown_rule():
  with pytest.raises(ValueError, match="Unknown combine='mean'"):
    jaxaccum.grad(stats_loss, 2, combine={"w": "mean"})


def test_combine_refuses_a_tree_that_is_not_a_prefix():
  p, b = stats_params(), batch()
  with pytest.raises(ValueError, match="not a tree prefix"):
    jaxaccum.grad(stats_loss, 2, combine={"w": None, "other": "max"})(p, b)


# -- data parallel: the max over devices, once, after the loop ---------------------


def explicit_mesh():
  return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))


def on_mesh(mesh, v, b):
  rows = NamedSharding(mesh, P("data"))
  return jax.device_put(v, NamedSharding(mesh, P())), jax.device_put(b, rows)


def test_plain_jax_grad_on_a_sharded_batch_takes_the_max_over_devices():
  """What JAX itself does with the metadata on a batch sharded over 8
  devices: the amax of a sharded activation is the global max (the
  partitioner's all-reduce), not a sum over devices. jaxaccum's steps are
  compared with this."""
  mesh = explicit_mesh()
  v, b = variables(), batch()
  want = jax.jit(jax.grad(loss))(v, b)
  with jax.set_mesh(mesh):
    got = jax.jit(jax.grad(loss))(*on_mesh(mesh, v, b))
  assert_metadata_equal(got, want)


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("view", ["device", "global"])
def test_mesh_metadata_is_the_full_batch_s(k, view):
  """Each device's amax combined by max over its micro-batches and then
  over the devices after the loop (summed over the 8 devices it was 8
  times too large); each micro-batch's backward pass seeded with the
  mean's 1 / (8 k), so that the output-gradient amax is the full
  batch's."""
  mesh = explicit_mesh()
  v, b = variables(), batch()
  want = jax.jit(jax.grad(loss))(v, b)
  step = jax.jit(jaxaccum.grad(loss, k, mesh=mesh, data_axis="data", view=view))
  with jax.set_mesh(mesh):
    got = step(*on_mesh(mesh, v, b))
  assert_metadata_equal(got, want)
  assert_params_close(got, want)


@pytest.mark.parametrize("k", [2, 4])
def test_plain_jit_on_an_explicit_mesh_metadata_is_the_full_batch_s(k):
  """Plain ``jit`` (no ``mesh=``), the batch sharded over an Explicit
  axis: the metadata never enters ``reduced`` (an ``unreduced`` cotangent
  would be summed over the devices)."""
  mesh = explicit_mesh()
  v, b = variables(), batch()
  want = jax.jit(jax.grad(loss))(v, b)
  with jax.set_mesh(mesh):
    got = jax.jit(jaxaccum.grad(loss, k))(*on_mesh(mesh, v, b))
  assert_metadata_equal(got, want)
  assert_params_close(got, want)


def test_make_train_step_overwrites_the_metadata_as_train_state_does():
  """``make_train_step`` on a Linen variables dict with FP8 layers: ``tx``
  updates ``params["params"]`` and the metadata is overwritten by its new
  value, as five ``TrainState.apply_gradients`` steps on the full batch
  give it (added as an update, the scales would grow by one each step)."""
  v = variables()
  tx = optax.adam(1e-2)
  want = train_state.TrainState.create(apply_fn=MODEL.apply, params=v, tx=tx)
  full = jax.jit(lambda s, b: s.apply_gradients(grads=jax.grad(loss)(s.params, b)))
  step = jaxaccum.make_train_step(loss, tx, 4, donate=False)
  params, opt_state = v, tx.init(v["params"])
  for i in range(5):
    b = batch(seed=10 + i)
    want = full(want, b)
    params, opt_state, _ = step(params, opt_state, b)
    assert_metadata_equal(params, want.params)
    assert_params_close(params, want.params)


def test_weighted_with_fp8_metadata_is_refused_with_the_way_out():
  """``normalize="weighted"`` divides after the loop: each micro-batch's
  output-gradient amax would be Σ weight times the full batch's."""
  v, b = variables(), batch()

  def weighted(v, b):
    x, y = b
    return jnp.sum((MODEL.apply(v, x) - y) ** 2), jnp.float32(x.shape[0])

  with pytest.raises(ValueError, match='normalize="weighted" divides by the total'):
    jaxaccum.grad(weighted, 4, normalize="weighted")(v, b)


def test_a_masked_mean_is_read_as_the_full_batch_s():
  """The way out: the weighted mean written in ``fun`` under
  ``normalize="mean"``, micro-batches holding different counts of real
  rows, gives the full batch's metadata (the exact plan seeds each
  backward pass with the full batch's cotangents)."""
  v, b = variables(), batch()
  mask = (jnp.arange(64) % 3 != 0) & (jnp.arange(64) < 50)

  def masked(v, b):
    x, y, m = b
    per_row = jnp.sum((MODEL.apply(v, x) - y) ** 2, axis=1)
    return jnp.sum(per_row * m) / jnp.sum(m)

  full = (*b, mask.astype(jnp.float32))
  want = jax.jit(jax.grad(masked))(v, full)
  got = jaxaccum.grad(masked, 4)(v, full)
  assert_metadata_equal(got, want)
  assert_params_close(got, want)


def test_mesh_fp8_step_has_no_data_axis_collective_in_its_loop():
  """The max over devices is one reduction after the loop, never one per
  micro-batch: each device's amax stays its own in the loop."""
  mesh = explicit_mesh()
  v, b = variables(), batch()
  step = jax.jit(jaxaccum.grad(loss, 4, mesh=mesh, data_axis="data"))
  with jax.set_mesh(mesh):
    text = step.lower(*on_mesh(mesh, v, b)).compile().as_text()
  data = [c for c in testing.collectives(text) if c.spans((8,), [0])]
  assert data and not [c for c in data if c.in_loop], data


def test_accumulate_windows_write_the_full_batch_s_metadata():
  """``accumulate()`` across calls: each micro-batch's share of the window's
  loss differentiated (``loss / k``, ``weight=1 / k``), the metadata
  combined by max over the window and written over the parameters when it
  ends, as three ``TrainState`` steps on the whole windows give it (summed
  and divided, it was not). ``optax.apply_updates`` writes it as ``p + (n -
  p)``: exact to half an ulp of the old value ``p`` (``atol``)."""
  k, v = 4, variables()
  tx = jaxaccum.accumulate(optax.adam(1e-2), k)
  want = train_state.TrainState.create(
    apply_fn=MODEL.apply, params=v, tx=optax.adam(1e-2)
  )
  full = jax.jit(lambda s, b: s.apply_gradients(grads=jax.grad(loss)(s.params, b)))
  share = jax.jit(jax.grad(lambda v, b: loss(v, b) / k))

  @jax.jit
  def call(params, state, micro):
    updates, state = tx.update(share(params, micro), state, params, weight=1.0 / k)
    return optax.apply_updates(params, updates), state

  params, state = v, tx.init(v)
  for step in range(3):
    b = batch(seed=20 + step)
    want = full(want, b)
    for micro in zip(*(jnp.split(x, k) for x in b), strict=True):
      params, state = call(params, state, micro)
    assert_metadata_equal(params, want.params, atol=1e-7)
    assert_params_close(params, want.params)


@pytest.mark.parametrize("view", ["device", "global"])
def test_mesh_fm32_metadata_combines_by_its_dtype_s_addition(view):
  """``fm32`` leaves under ``mesh=``: copied per device, combined by the
  dtype's own addition over the micro-batches and then over the devices,
  never cast through float32."""
  mesh = explicit_mesh()
  b = batch()

  def f32(g):
    return {**g, OWG: jax.tree.map(lambda x: x.astype(jnp.float32), g[OWG])}

  @jax.jit
  def both(v, b):
    v = as_fm32(v)
    want = jax.grad(loss, allow_int=True)(v, b)
    got = jaxaccum.grad(loss, 4, mesh=mesh, data_axis="data", view=view)(v, b)
    return f32(got), f32(want)

  with jax.set_mesh(mesh):
    got, want = both(*on_mesh(mesh, variables(), b))
  assert_metadata_equal(got, want)
  assert_params_close(got, want)


@pytest.mark.parametrize("view", ["device", "global"])
def test_mesh_combine_reduces_each_rule_over_the_devices(view):
  """Under ``mesh=`` each rule reduces over the devices as over the
  micro-batches: the running max and min, the rows counted (summed over
  the devices, 64), the last row of the last device's last micro-batch (on
  Auto axes: ``x[-1]`` of rows typed sharded is refused on Explicit ones,
  under ``jax.grad`` too)."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  p, b = stats_params(), batch()
  want = jax.jit(jax.grad(stats_loss))(p, b)
  step = jax.jit(
    jaxaccum.grad(
      stats_loss, 2, combine=COMBINE, mesh=mesh, data_axis="data", view=view
    )
  )
  with jax.set_mesh(mesh):
    got = step(*on_mesh(mesh, p, b))
  for name in ("peak", "low", "count", "last"):
    np.testing.assert_allclose(
      got["stats"][name], want["stats"][name], rtol=1e-6, err_msg=name
    )
  np.testing.assert_allclose(got["w"], want["w"], rtol=1e-5, atol=1e-7)


def test_a_non_gradient_leaf_sharded_over_the_data_axes_is_refused():
  """A running max sharded over the data axis (FSDP) would have its
  backward pass sum it over the devices: a clear ``ValueError``."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))

  @jax.custom_vjp
  def peaks(x, p):
    del p
    return x

  peaks.defvjp(
    lambda x, p: (x, jnp.maximum(p, jnp.max(jnp.abs(x), axis=0))),
    lambda new, g: (g, new),
  )

  def f(params, b):
    return jnp.mean(peaks(b[0], params["peak"]) @ params["w"])

  params = {"w": jnp.ones((8, 4)), "peak": jnp.zeros(8)}
  step = jaxaccum.grad(
    f,
    2,
    combine={"w": None, "peak": "max"},
    mesh=mesh,
    data_axis="data",
    param_specs={"w": P(), "peak": P("data")},
  )
  with pytest.raises(ValueError, match=r"combines by 'max'.*replicate it"):
    jax.jit(step)(params, batch())


def test_verify_equivalence_holds_for_fp8_layers():
  """``verify_equivalence`` compares every leaf, the FP8 metadata included."""
  deviation = jaxaccum.verify_equivalence(loss, (variables(), batch()), 4)
  assert deviation.grads < 1e-5, deviation
