"""FSDP through ``mesh=`` (issue 19): weights sharded over the data axes.

- ``fsdp_gather="per_micro_batch"`` (the default) reduce-scatters each
  micro-batch's gradient into an accumulator sharded like the parameter;
  ``"once"`` gathers before the loop and reduce-scatters after it. Both give
  the full batch's gradients, sharded like the parameters.
- On a parameter-dominated model the default's per-device peak stays near
  the full-batch step's, where gathering once held every weight and a
  full-size accumulator (twice the full batch's peak).
- Under ``jit`` on Auto axes, where the parameters' shardings are hidden, a
  warning says so where it matters, and only there.
"""

import math
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum

LAYERS, WIDTH, BATCH = 6, 1024, 64
MESHES = {
  "fsdp": ((8,), ("data",), "data", P("data", None)),
  "hsdp": ((2, 4), ("replica", "fsdp"), ("replica", "fsdp"), P("fsdp", None)),
  "fsdp_tp": ((4, 2), ("data", "model"), "data", P("data", "model")),
}


def deep_loss(params, batch):
  x, y = batch
  h = x
  for w in params:
    h = jnp.tanh(h @ w)
  return jnp.mean((h - y) ** 2)


def explicit_loss(params, batch):
  """The same model as a user writes it on Explicit axes: each weight
  gathered over the data axes where it is used (reshard), the contraction
  over "model" naming its output."""
  x, y = batch
  h = x
  for w in params:
    spec = jax.typeof(w).sharding.spec
    model = spec[1] if len(spec) > 1 else None
    gathered = jax.sharding.reshard(w, P(None, model))
    batch_axis = jax.typeof(h).sharding.spec[0]
    h = jnp.tanh(
      jnp.einsum("bi,io->bo", h, gathered, out_sharding=P(batch_axis, model))
    )
  return jnp.mean((h - y) ** 2)


def setup(name, mode, layers=LAYERS, width=WIDTH):
  shape, axis_names, data_axis, spec = MESHES[name]
  mesh = jax.make_mesh(shape, axis_names, axis_types=(mode,) * len(shape))
  keys = jax.random.split(jax.random.key(0), layers + 1)
  params = [
    jax.device_put(
      jax.random.normal(k, (width, width)) / width**0.5, NamedSharding(mesh, spec)
    )
    for k in keys[:-1]
  ]
  x = jax.random.normal(keys[-1], (BATCH, width))
  batch = jax.device_put((x, jnp.sin(x)), NamedSharding(mesh, P(data_axis)))
  loss = deep_loss if mode == AxisType.Auto else explicit_loss
  return mesh, data_axis, spec, params, batch, loss


def abstract(tree):
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
  )


@pytest.mark.slow
@pytest.mark.parametrize("gather", ["per_micro_batch", "once"])
@pytest.mark.parametrize("name", sorted(MESHES))
@pytest.mark.parametrize(
  "mode", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"]
)
def test_fsdp_grads_equal_the_full_batch_sharded_like_the_parameters(
  name, mode, gather
):
  mesh, data_axis, spec, params, batch, loss = setup(name, mode, layers=2, width=64)
  fun = jax.jit(
    jaxaccum.value_and_grad(
      loss,
      4,
      mesh=mesh,
      data_axis=data_axis,
      param_specs=[spec] * 2 if mode == AxisType.Auto else None,
      fsdp_gather=gather,
    )
  )
  with jax.set_mesh(mesh):
    value, grads = fun(params, batch)
    want = jax.jit(jax.value_and_grad(loss))(params, batch)
  chex.assert_trees_all_close((value, grads), want, rtol=1e-5, atol=1e-6)
  for g, p in zip(grads, params, strict=True):
    assert g.sharding.is_equivalent_to(p.sharding, 2), (g.sharding, p.sharding)


def hand_scan_step(loss, tx, k, shardings, devices, *, explicit=False):
  """Gradient accumulation as a user writes it under ``jit`` (MaxText's
  pattern): micro-batch ``i`` the ``i``-th slice of every device's rows, a
  ``lax.scan`` whose float32 accumulator and parameters are constrained to
  the parameters' shardings, the mean, the update."""

  def step(params, opt_state, batch):
    def constrain(tree):
      if explicit:  # a reshard: on Explicit axes a constraint only asserts
        return jax.tree.map(jax.sharding.reshard, tree, shardings)
      return jax.lax.with_sharding_constraint(tree, shardings)

    params = constrain(params)

    def split(a):
      a = a.reshape(devices, k, a.shape[0] // (devices * k), *a.shape[1:])
      return a.swapaxes(0, 1).reshape(k, -1, *a.shape[3:])

    def body(acc, micro):
      value, grads = jax.value_and_grad(loss)(params, micro)
      acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)
      return constrain(acc), value

    zeros = constrain(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
    acc, values = jax.lax.scan(body, zeros, jax.tree.map(split, batch))
    grads = constrain(jax.tree.map(lambda a: a / k, acc))
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, values.mean()

  return jax.jit(step, donate_argnums=(0, 1))


def train_step_peaks(name, mode, ks, gather="per_micro_batch"):
  """Per device: the full batch's peak, and per ``k`` jaxaccum's and the
  hand-written scan's, of one adam step."""
  mesh, data_axis, spec, params, batch, loss = setup(name, mode)
  tx = optax.adam(1e-3)
  opt_state = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=NamedSharding(mesh, spec if x.ndim == 2 else P())
    ),
    jax.eval_shape(tx.init, params),
  )
  args = (abstract(params), opt_state, abstract(batch))
  devices = math.prod(mesh.shape[a] for a in jax.tree.leaves(data_axis))

  def full_step(p, s, b):
    value, grads = jax.value_and_grad(loss)(p, b)
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s, value

  with jax.set_mesh(mesh):
    full = jaxaccum.compiled_memory(jax.jit(full_step, donate_argnums=(0, 1)), *args)
    peaks, hand = {}, {}
    for k in ks:
      step = jaxaccum.make_train_step(
        loss,
        tx,
        k,
        mesh=mesh,
        data_axis=data_axis,
        param_specs=[spec] * LAYERS if mode == AxisType.Auto else None,
        fsdp_gather=gather,
        skip_nonfinite=False,
      )
      peaks[k] = jaxaccum.compiled_memory(step, *args).peak_bytes
      scan = hand_scan_step(
        loss,
        tx,
        k,
        [NamedSharding(mesh, spec)] * LAYERS,
        devices,
        explicit=mode == AxisType.Explicit,
      )
      hand[k] = jaxaccum.compiled_memory(scan, *args).peak_bytes
  return full.peak_bytes, peaks, hand


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MESHES))
@pytest.mark.parametrize(
  "mode", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"]
)
def test_per_micro_batch_fsdp_is_at_or_below_a_hand_written_scan(name, mode):
  """A parameter-dominated model: 6 layers of 1024 x 1024 weights, 64 rows.
  The default mode takes the gradient of the devices' summed loss, so that
  the partitioner reduces each FSDP gradient where a plain jit step does,
  into an accumulator sharded like the parameters: per device, at or below
  the scan a user writes by hand, with its accumulator constrained to the
  parameters' shardings, on the same mesh, for every k (XLA's CPU pipeline
  all-reduces the gradients in both; a GPU or TPU reduce-scatters them, see
  tests/test_targets.py and benchmarks/fsdp.py). On Auto axes, where the
  partitioner places each weight's gather, the one-axis FSDP mesh is also
  far below gathering once, which holds every weight and a full-size
  float32 accumulator per device."""
  _, peaks, hand = train_step_peaks(name, mode, (2, 8))
  for k, peak in peaks.items():
    assert peak <= hand[k], (k, peak / 2**20, hand[k] / 2**20)
  # On Explicit axes the gathers are the user's own reshards, which jaxaccum
  # leaves where jax.value_and_grad has them (it keeps the user's axis
  # types): what they hold is the user's program's, as in the hand scan.
  if mode == AxisType.Auto and name == "fsdp":
    _, once, _ = train_step_peaks(name, mode, (2,), gather="once")
    assert peaks[2] < 0.7 * once[2], (peaks[2] / 2**20, once[2] / 2**20)


@pytest.mark.slow
def test_nnx_fsdp_with_partitioning_trains_like_the_full_batch():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))

  class MLP(nnx.Module):
    def __init__(self, rngs):
      init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("data", None))
      self.up = nnx.Linear(16, 32, kernel_init=init, rngs=rngs)
      self.down = nnx.Linear(32, 16, kernel_init=init, rngs=rngs)

    def __call__(self, x):
      up = jax.sharding.reshard(self.up.kernel[...], P())
      down = jax.sharding.reshard(self.down.kernel[...], P())
      h = jnp.tanh(x @ up + self.up.bias[...][None])
      return h @ down + self.down.bias[...][None]

  def loss(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)

  with jax.set_mesh(mesh):
    model, reference = MLP(nnx.Rngs(0)), MLP(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (64, 16))
    batch = jax.device_put((x, jnp.sin(x)), NamedSharding(mesh, P("data")))
    got = nnx.jit(jaxaccum.nnx.value_and_grad(loss, 4, mesh=mesh, data_axis="data"))(
      model, batch
    )
    want = nnx.jit(nnx.value_and_grad(loss))(reference, batch)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
  kernel = got[1]["up"]["kernel"][...]
  assert kernel.sharding.spec == P("data", None)


def test_host_batches_stream_in_fsdp_mode():
  mesh, data_axis, _, params, (x, y), loss = setup("fsdp", AxisType.Auto, 2, 64)
  host = jax.device_put(
    (x, y), NamedSharding(mesh, P(data_axis), memory_kind="pinned_host")
  )
  fun = jaxaccum.value_and_grad(loss, 2, mesh=mesh, data_axis=data_axis)
  want = jax.value_and_grad(loss)(params, (x, y))
  chex.assert_trees_all_close(fun(params, host), want, rtol=1e-5, atol=1e-6)


# -- the warning on hidden shardings (both directions) ----------------------


def hidden_warnings(mesh_shape, axis_names, width, **options):
  mesh = jax.make_mesh(
    mesh_shape, axis_names, axis_types=(AxisType.Auto,) * len(mesh_shape)
  )
  w = jax.device_put(jnp.ones((width, width)), NamedSharding(mesh, P()))
  x = jax.device_put(jnp.ones((16, width)), NamedSharding(mesh, P("data")))

  def loss(w, x):
    return jnp.mean((x @ w) ** 2)

  fun = jaxaccum.value_and_grad(loss, 2, mesh=mesh, data_axis="data", **options)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    jax.jit(fun).lower(w, x)  # traced: the shardings are hidden
    fun(w, x)  # eager: visible, never warns
  return [str(c.message) for c in caught if "not visible" in str(c.message)]


def test_hidden_shardings_warn_on_a_mesh_with_more_axes_than_data():
  (message,) = hidden_warnings((4, 2), ("data", "model"), 8)
  assert "count as not sharded over the data axes ('data',)" in message
  assert "param_specs=" in message and "Explicit" in message


def test_hidden_shardings_warn_for_a_large_parameter_on_a_data_mesh():
  (message,) = hidden_warnings((8,), ("data",), 512)  # 1 MiB of float32
  assert "args[0]" in message


@pytest.mark.parametrize(
  ("shape", "names", "width", "options"),
  [
    ((8,), ("data",), 8, {}),  # small weights on a mesh of data axes only
    ((4, 2), ("data", "model"), 8, {"param_specs": P()}),  # said replicated
  ],
  ids=["small_on_a_data_mesh", "param_specs_given"],
)
def test_hidden_shardings_stay_silent_where_nothing_is_better(
  shape, names, width, options
):
  assert hidden_warnings(shape, names, width, **options) == []


# -- the planner weighs the two modes (issue 19) -----------------------------


def planner_problem():
  mesh, data_axis, _, params, batch, loss = setup("fsdp", AxisType.Explicit, 4, 256)
  return mesh, data_axis, abstract(params), abstract(batch), loss


@pytest.mark.slow
def test_the_planner_picks_the_mode_that_fits_when_one_does():
  mesh, data_axis, params, batch, loss = planner_problem()
  peaks = {}
  with jax.set_mesh(mesh):
    for mode in ("per_micro_batch", "once"):
      step = jaxaccum.value_and_grad(
        loss, 2, mesh=mesh, data_axis=data_axis, fsdp_gather=mode
      )
      peaks[mode] = jaxaccum.compiled_memory(step, params, batch).peak_bytes
  assert peaks["per_micro_batch"] < peaks["once"]
  plan = jaxaccum.plan_micro_batches(
    loss,
    (params, batch),
    memory_limit_bytes=(peaks["per_micro_batch"] + peaks["once"]) // 2,
    candidates=[2],
    mesh=mesh,
    data_axis=data_axis,
    print_fn=None,
  )
  assert (plan.num_micro_batches, plan.fsdp_gather) == (2, "per_micro_batch")
  assert {row.fsdp_gather for row in plan.table} == {"per_micro_batch", "once"}
  assert "Only fsdp_gather='per_micro_batch' fits" in plan.reason


def test_the_planner_picks_the_mode_that_moves_fewer_bytes_when_both_fit():
  mesh, data_axis, params, batch, loss = planner_problem()
  plan = jaxaccum.plan_micro_batches(
    loss,
    (params, batch),
    memory_limit_bytes=2**40,
    candidates=[4],
    mesh=mesh,
    data_axis=data_axis,
    print_fn=None,
  )
  rows = {row.fsdp_gather: row for row in plan.table}
  # Gathering once moves each weight and gradient once; per micro-batch, a
  # reduce-scatter of every gradient per micro-batch (4 here).
  assert rows["once"].collective_bytes < rows["per_micro_batch"].collective_bytes
  assert plan.fsdp_gather == "once"
  assert "moves the fewest bytes" in plan.reason and "per step" in plan.reason
  assert "<- chosen" in str(plan)


def test_the_planner_searches_one_mode_without_fsdp_leaves():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  w = jax.ShapeDtypeStruct((16, 16), jnp.float32, sharding=NamedSharding(mesh, P()))
  x = jax.ShapeDtypeStruct(
    (64, 16), jnp.float32, sharding=NamedSharding(mesh, P("data"))
  )
  plan = jaxaccum.plan_micro_batches(
    lambda w, x: jnp.mean((x @ w) ** 2),
    (w, x),
    memory_limit_bytes=2**40,
    candidates=[1, 2],
    mesh=mesh,
    data_axis="data",
    print_fn=None,
  )
  assert plan.fsdp_gather is None and {r.fsdp_gather for r in plan.table} == {None}


# -- the other modes: cast_once and view="global" ------------------------------


def bf16_loss(loss):
  """``loss`` on weights cast to bfloat16 first: fsdp_gather="cast_once" is
  exact for it (its first use of each weight is that cast)."""

  def cast_first(params, batch):
    return loss(jax.tree.map(lambda w: w.astype(jnp.bfloat16), params), batch)

  return cast_first


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MESHES))
@pytest.mark.parametrize(
  "mode", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"]
)
def test_cast_once_equals_the_full_batch_of_a_bfloat16_model(name, mode):
  """Gathered once in bfloat16, reduce-scattered per micro-batch: the
  gradients of a model that casts its weights to bfloat16 first, equal to
  its full batch's to bfloat16 rounding (the reduction order differs),
  float32 and sharded like the float32 parameters."""
  mesh, data_axis, spec, params, batch, loss = setup(name, mode, layers=2, width=64)
  loss = bf16_loss(loss)
  fun = jax.jit(
    jaxaccum.value_and_grad(
      loss,
      4,
      mesh=mesh,
      data_axis=data_axis,
      param_specs=[spec] * 2 if mode == AxisType.Auto else None,
      fsdp_gather="cast_once",
      gather_dtype=jnp.bfloat16,
    )
  )
  with jax.set_mesh(mesh):
    value, grads = fun(params, batch)
    want = jax.jit(jax.value_and_grad(loss))(params, batch)
  chex.assert_trees_all_close((value, grads), want, rtol=2e-2, atol=2e-3)
  for g, p in zip(grads, params, strict=True):
    assert g.dtype == jnp.float32
    assert g.sharding.is_equivalent_to(p.sharding, 2), (g.sharding, p.sharding)


@pytest.mark.slow
@pytest.mark.parametrize("gather", ["per_micro_batch", "cast_once"])
@pytest.mark.parametrize("name", sorted(MESHES))
@pytest.mark.parametrize(
  "mode", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"]
)
def test_the_global_view_equals_the_full_batch(name, mode, gather):
  """view="global": fun on the global micro-batch (its annotations may name
  the data axes); the gradients equal the full batch's, sharded like the
  parameters."""
  mesh, data_axis, spec, params, batch, loss = setup(name, mode, layers=2, width=64)
  extra = {"gather_dtype": jnp.bfloat16} if gather == "cast_once" else {}
  if gather == "cast_once":
    loss = bf16_loss(loss)
  fun = jax.jit(
    jaxaccum.value_and_grad(
      loss,
      4,
      mesh=mesh,
      data_axis=data_axis,
      param_specs=[spec] * 2 if mode == AxisType.Auto else None,
      fsdp_gather=gather,
      view="global",
      **extra,
    )
  )
  with jax.set_mesh(mesh):
    value, grads = fun(params, batch)
    want = jax.jit(jax.value_and_grad(loss))(params, batch)
  tolerance = {"rtol": 2e-2, "atol": 2e-3} if extra else {"rtol": 1e-5, "atol": 1e-6}
  chex.assert_trees_all_close((value, grads), want, **tolerance)
  for g, p in zip(grads, params, strict=True):
    assert g.sharding.is_equivalent_to(p.sharding, 2), (g.sharding, p.sharding)


@pytest.mark.slow
@pytest.mark.parametrize("gather", ["per_micro_batch", "once", "cast_once"])
@pytest.mark.parametrize("name", ["fsdp", "hsdp"])
@pytest.mark.parametrize(
  "mode", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"]
)
def test_batchnorm_state_with_fsdp_leaves_is_each_devices_chain_averaged(
  name, mode, gather
):
  """BatchNorm-style running statistics (state_argnum) beside FSDP leaves:
  device d's micro-batch i is slice i of its shard; the statistics are each
  device's chain over its k slices, averaged; value and gradients are the
  full batch's."""
  mesh, data_axis, spec, params, batch, loss = setup(name, mode, layers=2, width=64)
  k, devices = 2, 8
  cast = gather == "cast_once"
  base = bf16_loss(loss) if cast else loss

  def loss_with_stats(params, batch, stats):
    x, _ = batch
    w = params[0].astype(jnp.bfloat16) if cast else params[0]  # its first use
    h = jnp.tanh(x @ w.astype(x.dtype))
    new = {"mean": 0.9 * stats["mean"] + 0.1 * jnp.mean(h, axis=0)}
    return base(params, batch), (None, new)

  stats = {"mean": jnp.full((64,), 0.5)}
  fun = jax.jit(
    jaxaccum.value_and_grad(
      loss_with_stats,
      k,
      state_argnum=2,
      has_aux=True,
      mesh=mesh,
      data_axis=data_axis,
      param_specs=[spec] * 2 if mode == AxisType.Auto else None,
      fsdp_gather=gather,
      **({"gather_dtype": jnp.bfloat16} if cast else {}),
    )
  )
  with jax.set_mesh(mesh):
    (value, (_, final)), grads = fun(params, batch, stats)
    want = jax.jit(jax.value_and_grad(base))(params, batch)
  tolerance = {"rtol": 2e-2, "atol": 2e-3} if cast else {"rtol": 1e-5, "atol": 1e-6}
  chex.assert_trees_all_close((value, grads), want, **tolerance)
  host = [np.asarray(w.astype(jnp.bfloat16) if cast else w, np.float32) for w in params]
  x = np.asarray(batch[0]).reshape(devices, k, BATCH // (devices * k), 64)
  chains = []
  for d in range(devices):
    mean = np.full((64,), 0.5, np.float32)
    for i in range(k):
      mean = 0.9 * mean + 0.1 * np.tanh(x[d, i] @ host[0]).mean(0)
    chains.append(mean)
  np.testing.assert_allclose(final["mean"], np.mean(chains, 0), rtol=1e-5, atol=1e-6)


#: Explicit meshes whose other axes have size 1, as MaxText builds them
#: (its fsdp (8) mesh), where jax 0.12's psum_scatter inside a shard_map
#: fails to compile: every mode goes through XLA's partitioner there.
PADDED_MESHES = {
  "fsdp_1x8": ((1, 8), ("other", "fsdp"), "fsdp", P("fsdp", None)),
  "hsdp_1x2x4": (
    (1, 2, 4),
    ("other", "replica", "fsdp"),
    ("replica", "fsdp"),
    P("fsdp", None),
  ),
}


@pytest.mark.slow
@pytest.mark.parametrize(
  ("gather", "view"),
  [
    ("per_micro_batch", "device"),
    ("once", "device"),
    ("cast_once", "device"),
    ("per_micro_batch", "global"),
    ("cast_once", "global"),
  ],
)
@pytest.mark.parametrize("name", sorted(PADDED_MESHES))
def test_every_mode_compiles_on_explicit_meshes_with_axes_of_size_one(
  name, gather, view
):
  shape, axis_names, data_axis, spec = PADDED_MESHES[name]
  mesh = jax.make_mesh(shape, axis_names, axis_types=(AxisType.Explicit,) * len(shape))
  keys = jax.random.split(jax.random.key(1), 3)
  params = [
    jax.device_put(jax.random.normal(k, (64, 64)) / 8, NamedSharding(mesh, spec))
    for k in keys[:2]
  ]
  x = jax.random.normal(keys[2], (BATCH, 64))
  batch = jax.device_put((x, jnp.sin(x)), NamedSharding(mesh, P(data_axis)))
  cast = gather == "cast_once"
  loss = bf16_loss(explicit_loss) if cast else explicit_loss
  fun = jax.jit(
    jaxaccum.value_and_grad(
      loss,
      4,
      mesh=mesh,
      data_axis=data_axis,
      fsdp_gather=gather,
      view=view,
      **({"gather_dtype": jnp.bfloat16} if cast else {}),
    )
  )
  with jax.set_mesh(mesh):
    value, grads = fun(params, batch)
    want = jax.jit(jax.value_and_grad(loss))(params, batch)
  tolerance = {"rtol": 2e-2, "atol": 2e-3} if cast else {"rtol": 1e-5, "atol": 1e-6}
  chex.assert_trees_all_close((value, grads), want, **tolerance)
  for g, p in zip(grads, params, strict=True):
    assert g.sharding.is_equivalent_to(p.sharding, 2), (g.sharding, p.sharding)


def test_the_global_view_names_the_data_axis_in_fun():
  """MaxText-style activation constraints that name the data axis are
  valid in the global view, as under plain jit (the default view refuses
  them: there the data axes are jaxaccum's)."""
  mesh, data_axis, spec, params, batch, _ = setup("fsdp", AxisType.Auto, 2, 64)

  def loss(params, batch):
    x, y = batch
    h = x
    for w in params:
      h = jax.lax.with_sharding_constraint(jnp.tanh(h @ w), P(data_axis, None))
    return jnp.mean((h - y) ** 2)

  fun = jaxaccum.value_and_grad(
    loss, 4, mesh=mesh, data_axis=data_axis, param_specs=[spec] * 2, view="global"
  )
  with jax.set_mesh(mesh):
    got = jax.jit(fun)(params, batch)
    want = jax.jit(jax.value_and_grad(loss))(params, batch)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"^fun names the data axes \('data',\)"):
      jax.jit(
        jaxaccum.value_and_grad(
          loss, 4, mesh=mesh, data_axis=data_axis, param_specs=[spec] * 2
        )
      )(params, batch)


def test_the_global_view_threads_one_state_and_a_key_per_micro_batch():
  """One state through the k global micro-batches, in the row order of the
  split (the i-th slice of every device's rows), and micro-batch i's key
  fold_in(key, i): a Python loop over the same micro-batches is the
  reference."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  k, rows = 4, 64
  w = jnp.linspace(-1.0, 1.0, 16).reshape(4, 4)
  x = jax.random.normal(jax.random.key(0), (rows, 4))
  key = jax.random.key(7)

  def loss(w, x, key, stats):
    keep = jax.random.bernoulli(key, 0.7, x.shape)
    h = jnp.tanh(jnp.where(keep, x, 0.0) @ w)
    new = {"mean": 0.9 * stats["mean"] + 0.1 * jnp.mean(h, 0), "n": stats["n"] + 1}
    return jnp.mean(h**2), (jnp.sum(keep), new)

  stats = {"mean": jnp.zeros(4), "n": jnp.zeros((), jnp.int32)}
  fun = jaxaccum.value_and_grad(
    loss,
    k,
    rng_argnum=2,
    state_argnum=3,
    has_aux=True,
    aux="stack",
    mesh=mesh,
    data_axis="data",
    view="global",
  )
  xs = jax.device_put(x, NamedSharding(mesh, P("data")))
  (value, (kept, final)), grads = jax.jit(fun)(w, xs, key, stats)
  order = jaxaccum._split.MicroBatching(rows, k, rows // k, 8).rows()
  chain, values, keeps, want_grads = stats, [], [], jnp.zeros_like(w)
  for i in range(k):
    (v, (keep, chain)), g = jax.value_and_grad(loss, has_aux=True)(
      w, x[order[i]], jax.random.fold_in(key, i), chain
    )
    values.append(v)
    keeps.append(keep)
    want_grads = want_grads + g / k
  chex.assert_trees_all_close(
    (value, grads, final, kept),
    (jnp.mean(jnp.stack(values)), want_grads, chain, jnp.stack(keeps)),
    rtol=1e-5,
    atol=1e-6,
  )
  assert int(final["n"]) == k


@pytest.mark.parametrize(
  ("options", "message"),
  [
    (
      {"fsdp_gather": "cast_once"},
      "fsdp_gather='cast_once' casts the FSDP leaves to gather_dtype before "
      "gathering them once per step: name it, e.g. gather_dtype=jnp.bfloat16 "
      "(exact when fun's first use of each FSDP leaf is that cast).",
    ),
    (
      {"gather_dtype": jnp.bfloat16},
      "gather_dtype=<class 'jax.numpy.bfloat16'> is for fsdp_gather='cast_once', "
      "not fsdp_gather='per_micro_batch'.",
    ),
    (
      {"fsdp_gather": "cast_once", "gather_dtype": jnp.int8},
      "gather_dtype must be a floating dtype, got int8.",
    ),
    ({"view": "host"}, "Unknown view='host'; choose one of ['device', 'global']."),
  ],
)
def test_bad_fsdp_options_are_clear_errors(options, message):
  mesh = jax.make_mesh((8,), ("data",))
  with pytest.raises(ValueError) as caught:
    jaxaccum.value_and_grad(deep_loss, 2, mesh=mesh, data_axis="data", **options)
  assert str(caught.value) == message


def test_the_global_view_needs_a_mesh_and_refuses_gathering_once():
  with pytest.raises(ValueError) as caught:
    jaxaccum.value_and_grad(deep_loss, 2, view="global")
  assert str(caught.value) == "view= says what fun sees under mesh=; pass mesh= too."
  mesh, data_axis, spec, params, batch, loss = setup("fsdp", AxisType.Auto, 2, 64)
  fun = jaxaccum.value_and_grad(
    loss,
    2,
    mesh=mesh,
    data_axis=data_axis,
    param_specs=[spec] * 2,
    fsdp_gather="once",
    view="global",
  )
  with pytest.raises(ValueError) as caught, jax.set_mesh(mesh):
    jax.jit(fun)(params, batch)
  assert str(caught.value) == (
    "fsdp_gather='once' keeps a gradient per device until after the loop: "
    "view='global' has it on Explicit data axes that the batch is sharded "
    "over, for a step that needs no statistic of a micro-batch's whole "
    "gradient (no clip_per_example or noise_stats), and view='device' "
    "(fun on one device's rows) always; otherwise choose "
    "fsdp_gather='per_micro_batch' or 'cast_once'."
  )
