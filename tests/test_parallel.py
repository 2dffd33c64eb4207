"""Data-parallel accumulation on 8 CPU devices: exact, and one reduction per step."""

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
from jaxaccum import testing as _hlo
from jaxaccum._inspect import hlo as hlo_text_reader

D = 8  # devices, from conftest.py's XLA_FLAGS
B, F, H = 64, 4, 6


@pytest.fixture(params=[AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def mesh(request):
  assert jax.device_count() == D
  return jax.make_mesh((D,), ("data",), axis_types=(request.param,))


DATA = P("data")


def shard(mesh, tree, spec=DATA):
  return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, spec)), tree)


def mlp_loss(p, batch):
  x, y = batch
  h = jnp.tanh(x @ p["w1"])
  return jnp.mean((h @ p["w2"] - y) ** 2)


def problem(seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  params = {
    "w1": jax.random.normal(keys[0], (F, H)),
    "w2": jax.random.normal(keys[1], (H,)),
  }
  x = jax.random.normal(keys[2], (B, F))
  y = jnp.sin(x @ jax.random.normal(keys[3], (F,)))
  return params, (x, y)


# float32 throughout (unit roundoff u = 2**-24 = 6e-8). The data-parallel
# result and the reference sum the same B = 64 per-example terms, only in
# another order (per micro-batch, per device, then across devices); a sum's
# order moves it by at most about n*u relative to the sum of the terms'
# magnitudes (64u = 3.8e-6), and in practice by a few u. RTOL = 1e-5 leaves
# room above that bound; ATOL = 1e-6 catches entries that cancel to near zero.
# The bugs these tests exist for are far larger: a normalization off by a
# factor D or k, a dropped micro-batch or device shard (>= 1/(D*k) = 6%).
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def assert_close(got, want):
  chex.assert_trees_all_close(got, want, **TOLERANCE)


def python_loop(fun, num_micro_batches, params, batch, *args, key=None, **kwargs):
  """The obvious reference: eager ``jax.value_and_grad`` on each contiguous
  micro-batch in turn (micro-batch ``i`` gets ``fold_in(key, i)`` when a key
  is given), then the mean of the values and of the gradients, and the aux
  stacked."""
  rows = jax.tree.leaves(batch)[0].shape[0] // num_micro_batches
  values, grads, auxes = [], [], []
  for i in range(num_micro_batches):
    micro = jax.tree.map(lambda a, i=i: a[i * rows : (i + 1) * rows], batch)
    extra = args if key is None else (*args, jax.random.fold_in(key, i))
    (value, aux), g = jax.value_and_grad(fun, has_aux=True)(
      params, micro, *extra, **kwargs
    )
    values.append(value)
    grads.append(g)
    auxes.append(aux)
  mean = lambda *xs: jnp.mean(jnp.stack(xs), axis=0)  # noqa: E731
  return (mean(*values), jnp.stack(auxes)), jax.tree.map(mean, *grads)


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2, 4])
def test_mean_equals_single_device_full_batch(mesh, k):
  params, batch = problem()
  fun = jaxaccum.value_and_grad(mlp_loss, k, mesh=mesh, data_axis="data")
  want = jax.value_and_grad(mlp_loss)(params, batch)
  assert_close(fun(params, shard(mesh, batch)), want)
  assert_close(jax.jit(fun)(params, shard(mesh, batch)), want)


def test_micro_batch_size_is_per_device(mesh):
  params, batch = problem()
  fun = jaxaccum.value_and_grad(
    mlp_loss, micro_batch_size=2, mesh=mesh, data_axis="data"
  )
  assert_close(
    jax.jit(fun)(params, shard(mesh, batch)),
    jax.value_and_grad(mlp_loss)(params, batch),
  )


def test_weighted_divides_by_the_global_token_count(mesh):
  params, (x, y) = problem()
  # Devices hold very different numbers of real rows; some hold none.
  mask = (jnp.arange(B) % 11 < jnp.arange(B) // 8).astype(jnp.float32)

  def loss_sum(p, batch):
    x, y, mask = batch
    err = (jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2
    return jnp.sum(err * mask), jnp.sum(mask)

  def full_batch_mean(p, batch):
    total, tokens = loss_sum(p, batch)
    return total / tokens

  fun = jaxaccum.value_and_grad(
    loss_sum, 2, normalize="weighted", mesh=mesh, data_axis="data"
  )
  batch = (x, y, mask)
  assert_close(
    jax.jit(fun)(params, shard(mesh, batch)),
    jax.value_and_grad(full_batch_mean)(params, batch),
  )


@pytest.mark.slow
def test_rng_equals_single_device_with_global_micro_batch_numbering(mesh):
  """Device d's micro-batch i is the global micro-batch d*k+i, key included."""
  params, batch = problem()
  k = 2

  def dropout_loss(p, batch, key):
    x, y = batch
    keep = jax.random.bernoulli(key, 0.7, (x.shape[0], H))
    h = jnp.where(keep, jnp.tanh(x @ p["w1"]) / 0.7, 0.0)
    return jnp.mean((h @ p["w2"] - y) ** 2), keep

  key = jax.random.key(5)
  fun = jaxaccum.value_and_grad(
    dropout_loss,
    k,
    rng_argnum=2,
    has_aux=True,
    aux="stack",
    mesh=mesh,
    data_axis="data",
  )
  (value, masks), grads = jax.jit(fun)(params, shard(mesh, batch), key)
  masks = np.asarray(masks)
  (want_value, want_masks), want_grads = jaxaccum.value_and_grad(
    dropout_loss, D * k, rng_argnum=2, has_aux=True, aux="stack"
  )(params, batch, key)
  assert_close((value, grads), (want_value, want_grads))
  np.testing.assert_array_equal(masks, want_masks)
  # No full batch draws these masks; the obvious reference is a Python loop
  # over the D*k global micro-batches with fold_in(key, global index).
  (loop_value, loop_masks), loop_grads = python_loop(
    dropout_loss, D * k, params, batch, key=key
  )
  assert_close((value, grads), (loop_value, loop_grads))
  np.testing.assert_array_equal(masks, loop_masks)
  assert masks.shape == (D * k, B // (D * k), H)
  assert not np.array_equal(masks[0], masks[k])  # devices 0 and 1 differ


@pytest.mark.slow
def test_state_is_threaded_per_device_and_averaged(mesh):
  """BatchNorm-style running statistics: an EMA of micro-batch means.

  Device d's micro-batch i is slice i of shard d, so "micro-batch i" globally
  is slice i of every shard. The device-averaged running mean equals one
  single-device chain over those global micro-batches, by linearity.
  """
  params, batch = problem()
  k = 2

  def loss_with_stats(p, batch, stats):
    x, y = batch
    h = jnp.tanh(x @ p["w1"])
    new = {
      "mean": 0.9 * stats["mean"] + 0.1 * jnp.mean(h, axis=0),
      "count": stats["count"] + 1,
    }
    return jnp.mean((h @ p["w2"] - y) ** 2), (None, new)

  stats = {"mean": jnp.full((H,), 0.5), "count": jnp.array(0, jnp.int32)}
  fun = jaxaccum.value_and_grad(
    loss_with_stats, k, state_argnum=2, has_aux=True, mesh=mesh, data_axis="data"
  )
  (value, (_, final)), grads = jax.jit(fun)(params, shard(mesh, batch), stats)

  # Reorder rows so that contiguous single-device micro-batch i is slice i
  # of every shard, then run one chain of k micro-batches.
  order = jnp.arange(B).reshape(D, k, B // (D * k)).transpose(1, 0, 2).reshape(-1)
  permuted = jax.tree.map(lambda a: a[order], batch)
  (want_value, (_, want)), want_grads = jaxaccum.value_and_grad(
    loss_with_stats, k, state_argnum=2, has_aux=True
  )(params, permuted, stats)
  assert_close((value, grads, final["mean"]), (want_value, want_grads, want["mean"]))
  assert int(final["count"]) == k  # every device ran k micro-batches
  # The loss does not read the statistics: value and grads are the full batch's.
  assert_close((value, grads), jax.value_and_grad(mlp_loss)(params, batch))
  # The statistics: each device's chain over its own k slices, averaged.
  shards = jax.tree.map(lambda a: a.reshape(D, k, B // (D * k), *a.shape[1:]), batch)
  chains = []
  for d in range(D):
    chain = stats
    for i in range(k):
      micro = jax.tree.map(lambda a, d=d, i=i: a[d, i], shards)
      _, (_, chain) = loss_with_stats(params, micro, chain)
    chains.append(chain["mean"])
  assert_close(final["mean"], jnp.mean(jnp.stack(chains), axis=0))


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 4])
def test_fsdp_per_micro_batch_reduces_each_micro_batch_into_a_sharded_accumulator(k):
  """The default FSDP mode: every micro-batch's gradient is reduced over the
  data axis inside the loop (k times; a reduce-scatter where the compiler
  makes one, an all-reduce and a slice on the CPU) into a float32
  accumulator sharded like the parameter: the loop carries 1/D of each
  FSDP gradient, never a whole one."""
  mesh = jax.make_mesh((D,), ("data",), axis_types=(AxisType.Explicit,))
  params, batch = problem()
  params = {"w1": jnp.tile(params["w1"], (1, 4)), "w2": jnp.tile(params["w2"], 4)}
  sharded = {
    "w1": shard(mesh, params["w1"], P(None, "data")),
    "w2": shard(mesh, params["w2"], P("data")),
  }

  def gathered_loss(p, batch):  # on Explicit axes the user gathers FSDP weights
    return mlp_loss(jax.tree.map(lambda w: jax.sharding.reshard(w, P()), p), batch)

  fun = jax.jit(jaxaccum.value_and_grad(gathered_loss, k, mesh=mesh, data_axis="data"))
  value, grads = fun(sharded, shard(mesh, batch))
  assert grads["w1"].sharding.spec == P(None, "data")
  assert grads["w2"].sharding.spec == P("data")
  assert_close((value, grads), jax.value_and_grad(mlp_loss)(params, batch))
  text = _hlo.compiled_text(fun, sharded, shard(mesh, batch))
  reductions = [
    c
    for c in _hlo.collectives(text)
    if c.op.startswith(("all-reduce", "reduce-scatter"))
  ]
  in_loop = [c for c in reductions if c.in_loop]
  assert in_loop and all(c.executions == k for c in in_loop), reductions
  carried = loop_carry(text)
  w1, w2 = params["w1"].shape, params["w2"].shape
  assert f"f32[{w1[0]},{w1[1] // D}]" in carried, carried  # 1/D of each
  assert f"f32[{w2[0] // D}]" in carried, carried
  assert not [t for t in carried if t in (f"f32[{w1[0]},{w1[1]}]", f"f32[{w2[0]}]")]


def loop_carry(hlo_text):
  """The array types the entry computation's while loop carries."""
  module = hlo_text_reader.parse(hlo_text)
  (loop,) = [i for i in module.computations[module.entry] if i.op == "while"]
  return [t.split("{")[0] for t in hlo_text_reader._top_level(loop.type)]


def test_fsdp_params_get_reduce_scattered_grads():
  mesh = jax.make_mesh((D,), ("data",), axis_types=(AxisType.Explicit,))
  params, batch = problem()
  params = {"w1": jnp.tile(params["w1"], (1, 4)), "w2": jnp.tile(params["w2"], 4)}
  sharded = {
    "w1": shard(mesh, params["w1"], P(None, "data")),
    "w2": shard(mesh, params["w2"], P("data")),
  }
  fun = jax.jit(
    jaxaccum.value_and_grad(
      mlp_loss, 2, mesh=mesh, data_axis="data", fsdp_gather="once"
    )
  )
  value, grads = fun(sharded, shard(mesh, batch))
  assert grads["w1"].sharding.spec == P(None, "data")
  assert grads["w2"].sharding.spec == P("data")
  assert_close((value, grads), jax.value_and_grad(mlp_loss)(params, batch))
  colls = _hlo.collectives(_hlo.compiled_text(fun, sharded, shard(mesh, batch)))
  # Each collective runs once per step, before or after the loop, and spans
  # the data axis (there is no other).
  assert all(c.executions == 1 and not c.in_loop for c in colls), colls
  assert all(c.spans((D,), [0]) for c in colls), colls
  by_op = {}
  for c in colls:
    by_op[c.op] = by_op.get(c.op, 0) + c.bytes
  full = sum(x.size * 4 for x in jax.tree.leaves(params))  # float32
  # Every parameter is all-gathered once (its full size arrives), every
  # gradient reduce-scattered once (each device keeps its 1/D shard), and
  # the only all-reduce is the loss and weight sums: at most two float32
  # scalars (XLA folds the weight sum of the mean mode, a constant).
  all_reduce = by_op.pop("all-reduce")
  assert by_op == {"all-gather": full, "reduce-scatter": full // D}
  assert all_reduce <= 8


def test_fsdp_under_auto_jit_needs_param_specs():
  mesh = jax.make_mesh((D,), ("data",), axis_types=(AxisType.Auto,))
  params, batch = problem()
  params = {"w1": jnp.tile(params["w1"], (1, 4)), "w2": jnp.tile(params["w2"], 4)}
  specs = {"w1": P(None, "data"), "w2": P("data")}
  fun = jax.jit(
    jaxaccum.value_and_grad(mlp_loss, 2, mesh=mesh, data_axis="data", param_specs=specs)
  )
  sharded = {
    "w1": shard(mesh, params["w1"], P(None, "data")),
    "w2": shard(mesh, params["w2"], P("data")),
  }
  value, grads = fun(sharded, shard(mesh, batch))
  assert grads["w1"].sharding.spec == P(None, "data")
  assert_close((value, grads), jax.value_and_grad(mlp_loss)(params, batch))


def loop_collectives(text):
  colls = _hlo.collectives(text)
  return [c for c in colls if c.in_loop], colls


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_no_collective_inside_the_loop_and_one_reduction(mesh, k):
  params, batch = problem()
  fun = jaxaccum.value_and_grad(mlp_loss, k, mesh=mesh, data_axis="data")
  in_loop, colls = loop_collectives(_hlo.compiled_text(fun, params, shard(mesh, batch)))
  assert in_loop == []
  # One all-reduce of (grads, loss, weight), however many micro-batches.
  assert sum(c.executions for c in colls) == 1, colls
  grad_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))
  assert sum(c.bytes for c in colls) <= grad_bytes + 16


@pytest.mark.parametrize("k", [2, 4, 8])
def test_gspmd_accumulation_reduces_inside_the_loop(k):
  """Why mesh= exists: optax.microbatch under jit all-reduces k times a step."""
  mesh = jax.make_mesh((D,), ("data",), axis_types=(AxisType.Auto,))
  params, batch = problem()
  fun = optax.microbatching.microbatch(
    jax.value_and_grad(mlp_loss),
    argnums=1,
    microbatch_size=B // k,
    accumulator=optax.microbatching.AccumulationType.MEAN,
  )
  in_loop, _ = loop_collectives(_hlo.compiled_text(fun, params, shard(mesh, batch)))
  assert [c.op for c in in_loop] == ["all-reduce"]
  assert in_loop[0].executions == k


def test_global_batch_not_divisible_by_devices(mesh):
  params, (x, y) = problem()
  fun = jaxaccum.value_and_grad(mlp_loss, 1, mesh=mesh, data_axis="data")
  with pytest.raises(
    ValueError, match=r"global batch_size=60 is not divisible by the 8 devices"
  ):
    fun(params, (x[:60], y[:60]))


def test_local_batch_not_divisible_by_k(mesh):
  params, batch = problem()
  fun = jaxaccum.value_and_grad(mlp_loss, 3, mesh=mesh, data_axis="data")
  with pytest.raises(
    ValueError,
    match=r"batch_size=8 \(the rows of args\[1\]\[0\]\) is not divisible by "
    r"num_micro_batches=3",
  ):
    fun(params, shard(mesh, batch))


def test_unknown_data_axis(mesh):
  with pytest.raises(ValueError, match="not an axis of the mesh"):
    jaxaccum.value_and_grad(mlp_loss, 2, mesh=mesh, data_axis="batch")(*problem())
  with pytest.raises(ValueError, match="needs mesh="):
    jaxaccum.value_and_grad(mlp_loss, 2, data_axis="data")


class Net(nnx.Module):
  def __init__(self, rngs):
    self.hidden = nnx.Linear(F, H, rngs=rngs)
    self.norm = nnx.BatchNorm(H, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)
    self.out = nnx.Linear(H, 1, rngs=rngs)

  def __call__(self, x):
    return self.out(self.drop(nnx.relu(self.norm(self.hidden(x)))))[:, 0]


@pytest.mark.slow
def test_nnx_data_parallel(mesh):
  _, batch = problem()
  model = Net(nnx.Rngs(0, dropout=1))
  model.drop.rate = 0.0  # deterministic: compare with the full batch
  model.norm.use_running_average = True

  def loss(m, batch):
    x, y = batch
    return jnp.mean((m(x) - y) ** 2)

  reference = nnx.clone(model)
  value, grads = nnx.jit(
    jaxaccum.nnx.value_and_grad(loss, 2, mesh=mesh, data_axis="data")
  )(model, shard(mesh, batch))
  want_value, want_grads = nnx.value_and_grad(loss)(reference, batch)
  assert_close(
    (value, nnx.to_pure_dict(grads)), (want_value, nnx.to_pure_dict(want_grads))
  )


def test_nnx_dropout_differs_across_devices():
  mesh = jax.make_mesh((D,), ("data",), axis_types=(AxisType.Explicit,))
  _, batch = problem()
  model = Net(nnx.Rngs(0, dropout=1))

  def masks(m, batch):
    x, _ = batch
    h = nnx.relu(m.hidden(x)) + 1.0
    dropped = m.drop(h) == 0
    return jnp.sum(m.drop(h)) * 0.0, dropped

  (_, dropped), _ = jaxaccum.nnx.value_and_grad(
    masks, 1, has_aux=True, aux="stack", mesh=mesh, data_axis="data"
  )(model, shard(mesh, batch))
  dropped = np.asarray(dropped)
  assert dropped.shape == (D, B // D, H)
  assert not np.array_equal(dropped[0], dropped[1])
  # The stream advanced as on one device: once per micro-batch and call.
  assert int(model.drop.rngs.count[...]) == 2


@pytest.mark.slow
def test_eager_calls_trace_once_and_keep_array_kwargs_dynamic(mesh):
  """Called eagerly in a loop, the data-parallel step compiles once per
  configuration; array keyword arguments stay inputs, Python ones static."""
  params, batch = problem()
  traces = []

  def scaled_loss(p, batch, *, scale, square):
    traces.append(square)
    loss = mlp_loss(p, batch)
    return scale * (loss**2 if square else loss)

  fun = jaxaccum.value_and_grad(scaled_loss, 2, mesh=mesh, data_axis="data")
  sharded = shard(mesh, batch)
  first = []  # fun's traces in the first call: the read's and the step's
  for scale in (1.0, 2.0, 3.0):
    value, grads = fun(params, sharded, scale=jnp.asarray(scale), square=False)
    want = jax.value_and_grad(mlp_loss)(params, batch)
    assert_close((value, grads), jax.tree.map(lambda w, s=scale: s * w, want))
    first = first or list(traces)
  assert traces == first and set(first) == {False}
  first = len(first)
  fun(params, sharded, scale=jnp.asarray(1.0), square=True)
  assert len(traces) > first and set(traces[first:]) == {True}


@pytest.mark.slow
def test_a_key_that_fun_advances_in_the_state_moves_on(mesh):
  """A key carried in the state and split by ``fun`` comes back advanced
  (device 0's chain), never reset to the key that came in."""
  params, batch = problem()
  k = 2

  def loss_with_key(p, batch, key):
    x, y = batch
    noise = 0.01 * jax.random.normal(key, x.shape)
    return mlp_loss(p, (x + noise, y)), (None, jax.random.split(key)[0])

  key = jax.random.key(7)
  fun = jaxaccum.value_and_grad(
    loss_with_key, k, state_argnum=2, has_aux=True, mesh=mesh, data_axis="data"
  )
  (_, (_, final)), _ = jax.jit(fun)(params, shard(mesh, batch), key)
  want = jax.random.fold_in(key, 0)  # device 0's copy
  for _ in range(k):
    want = jax.random.split(want)[0]
  np.testing.assert_array_equal(jax.random.key_data(final), jax.random.key_data(want))


class _Unhashable:
  __hash__ = None  # type: ignore[assignment]

  def __init__(self, power):
    self.power = power


@pytest.mark.slow
def test_keyword_arguments_of_any_kind(mesh):
  """Python values in keyword arguments (in dicts and lists, unhashable
  objects, None) stay Python values in ``fun``; arrays, even sharded along
  the data axis, reach every device whole. The reference is the full
  batch."""
  params, batch = problem()
  k = 2

  def loss(p, batch, *, cfg, shape, obj, offset, unused):
    assert unused is None and isinstance(cfg["square"], bool)
    value = mlp_loss(p, batch) + jnp.sum(jnp.zeros(shape)) + jnp.sum(offset)
    return value**obj.power if cfg["square"] else value

  offset = jnp.arange(D, dtype=jnp.float32) / 100
  kwargs = {
    "cfg": {"square": True, "scale": jnp.float32(2.0)},
    "shape": [2, 3],
    "obj": _Unhashable(2),
    "offset": shard(mesh, offset),
    "unused": None,
  }
  fun = jaxaccum.value_and_grad(loss, k, mesh=mesh, data_axis="data")
  # The loss squares the batch's mean: read as a function of its sums, the
  # full batch's (exact by default).
  want = jax.value_and_grad(loss)(params, batch, **{**kwargs, "offset": offset})
  assert_close(fun(params, shard(mesh, batch), **kwargs), want)
  assert_close(
    jax.jit(lambda p, b: fun(p, b, **kwargs))(params, shard(mesh, batch)), want
  )


def test_batched_keys_in_the_state():
  mesh = jax.make_mesh((D,), ("data",))
  params, batch = problem()

  k = 2

  def loss_with_keys(p, batch, keys):
    x, y = batch
    noise = 0.01 * jax.random.normal(keys[0], x.shape)
    return mlp_loss(p, (x + noise, y)), (noise[0, 0], keys)

  keys = jax.random.split(jax.random.key(3), 3)
  fun = jaxaccum.value_and_grad(
    loss_with_keys,
    k,
    state_argnum=2,
    has_aux=True,
    aux="stack",
    mesh=mesh,
    data_axis="data",
  )
  (_, (draws, final)), _ = jax.jit(fun)(params, shard(mesh, batch), keys)
  # Every key of the array had the device folded in: devices draw differently
  # (fun leaves the keys alone, so micro-batches of one device draw alike).
  draws = np.asarray(draws)
  assert draws.shape == (D * k,)
  assert len(set(draws[::k].tolist())) == D
  np.testing.assert_array_equal(draws[::k], draws[1::k])
  # ... and the keys come back as they went in.
  np.testing.assert_array_equal(jax.random.key_data(final), jax.random.key_data(keys))


@pytest.mark.slow
def test_train_step_skip_keeps_a_sharded_state(mesh):
  params, (x, y) = problem()
  tx = optax.sgd(0.1)

  def loss_with_stats(p, batch, stats):
    x, _ = batch
    return mlp_loss(p, batch), (None, 0.9 * stats + 0.1 * jnp.mean(x))

  stats = jax.device_put(jnp.zeros(D), NamedSharding(mesh, DATA))
  step = jaxaccum.make_train_step(
    loss_with_stats,
    tx,
    2,
    state_argnum=2,
    has_aux=True,
    donate=False,
    mesh=mesh,
    data_axis="data",
  )
  _, _, (value, (_, good)) = step(params, tx.init(params), shard(mesh, (x, y)), stats)
  assert np.isfinite(value) and not np.allclose(good, 0.0)
  bad = shard(mesh, (x.at[5, 0].set(jnp.nan), y))
  new_params, _, (value, (_, kept)) = step(params, tx.init(params), bad, stats)
  assert np.isnan(value)
  chex.assert_trees_all_equal(new_params, params)
  np.testing.assert_array_equal(kept, np.zeros(D))
