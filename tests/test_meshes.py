"""The meshes real training runs use, on 8 CPU devices, Auto and Explicit.

- (8,) ``data``: data parallel with an FSDP-sharded weight;
- (4, 2) ``data`` x ``model``: FSDP + tensor parallel;
- (2, 2, 2) ``replica`` x ``fsdp`` x ``model``: HSDP + tensor parallel, with
  ``data_axis=("replica", "fsdp")``.

Each layout must give the full-batch value and grads, grads sharded exactly
like the parameters, no reduction over a data axis inside the loop (tensor-
parallel collectives over ``model`` belong there), as many data-axis
collectives for k = 2 as for k = 8, and a per-device peak below the plain
full-batch ``jit`` step on the same mesh.
"""

import dataclasses
import inspect

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


@dataclasses.dataclass(frozen=True)
class Layout:
  name: str
  shape: tuple[int, ...]
  axis_names: tuple[str, ...]
  data_axis: str | tuple[str, ...]
  specs: dict
  model: str | None  # the tensor-parallel axis, if any

  def mesh(self, axis_type):
    return jax.make_mesh(
      self.shape, self.axis_names, axis_types=(axis_type,) * len(self.shape)
    )

  @property
  def data_dims(self):
    axes = (self.data_axis,) if isinstance(self.data_axis, str) else self.data_axis
    return [self.axis_names.index(a) for a in axes]


LAYOUTS = [
  Layout(
    "dp_fsdp",
    (8,),
    ("data",),
    "data",
    {"w1": P("data", None), "b1": P(), "w2": P()},
    None,
  ),
  Layout(
    "fsdp_tp",
    (4, 2),
    ("data", "model"),
    "data",
    {"w1": P("data", "model"), "b1": P("model"), "w2": P("model", None)},
    "model",
  ),
  Layout(
    "hsdp_tp",
    (2, 2, 2),
    ("replica", "fsdp", "model"),
    ("replica", "fsdp"),
    {"w1": P("fsdp", "model"), "b1": P("model"), "w2": P("model", "fsdp")},
    "model",
  ),
]
MODES = [AxisType.Auto, AxisType.Explicit]


@pytest.fixture(params=LAYOUTS, ids=lambda layout: layout.name)
def layout(request):
  return request.param


@pytest.fixture(params=MODES, ids=["auto", "explicit"])
def mode(request):
  return request.param


def make_loss(layout, mode):
  """The same MLP loss, written as a user writes it for each mode.

  Explicit: the FSDP weights are gathered in global view (``reshard``), and
  the contraction over the tensor-parallel axis names its output sharding
  with the idiom that runs both under plain jit and inside jaxaccum: the
  batch axis read from the input's type.
  """
  model = layout.model

  def loss(p, batch):
    x, y = batch
    w1, w2 = p["w1"], p["w2"]
    if mode == AxisType.Explicit:
      w1 = jax.sharding.reshard(w1, P(None, model))
      w2 = jax.sharding.reshard(w2, P(model, None))
    h = jnp.tanh(x @ w1 + p["b1"][None])
    if mode == AxisType.Explicit:
      batch_axis = jax.typeof(h).sharding.spec[0]
      out = jnp.einsum("bh,hf->bf", h, w2, out_sharding=P(batch_axis, None))
    else:
      out = h @ w2
    return jnp.mean((out - y) ** 2)

  return loss


def make_problem(batch_size=64, features=16, hidden=32, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  params = {
    "w1": jax.random.normal(keys[0], (features, hidden)) / features**0.5,
    "b1": 0.1 * jax.random.normal(keys[1], (hidden,)),
    "w2": jax.random.normal(keys[2], (hidden, features)) / hidden**0.5,
  }
  x = jax.random.normal(keys[3], (batch_size, features))
  return params, (x, jnp.sin(x))


def place(layout, mesh, params, batch):
  sharded = {
    n: jax.device_put(v, NamedSharding(mesh, layout.specs[n]))
    for n, v in params.items()
  }
  return sharded, jax.device_put(batch, NamedSharding(mesh, P(layout.data_axis)))


def accumulated(layout, mesh, mode, k, *, under_jit, fsdp_gather="per_micro_batch"):
  """jaxaccum's step; under an outer jit on an Auto mesh the shardings are
  not visible, so there (only) the parameter specs are passed."""
  specs = layout.specs if (under_jit and mode == AxisType.Auto) else None
  fun = jaxaccum.value_and_grad(
    make_loss(layout, mode),
    k,
    mesh=mesh,
    data_axis=layout.data_axis,
    param_specs=specs,
    fsdp_gather=fsdp_gather,
  )
  return jax.jit(fun) if under_jit else fun


def full_batch(layout, mesh, mode):
  """The plain full-batch step under jit on the same mesh."""
  return jax.jit(jax.value_and_grad(make_loss(layout, mode)))


def assert_sharded_like(grads, params):
  for name, g in grads.items():
    assert g.sharding.is_equivalent_to(params[name].sharding, g.ndim), (
      name,
      g.sharding,
      params[name].sharding,
    )


@pytest.mark.slow
@pytest.mark.parametrize("under_jit", [False, True], ids=["eager", "jit"])
def test_full_batch_value_and_grads_sharded_like_the_parameters(
  layout, mode, under_jit
):
  mesh = layout.mesh(mode)
  params, batch = make_problem()
  sharded, sharded_batch = place(layout, mesh, params, batch)
  fun = accumulated(layout, mesh, mode, 4, under_jit=under_jit)
  value, grads = fun(sharded, sharded_batch)
  with jax.set_mesh(mesh):
    want = full_batch(layout, mesh, mode)(sharded, sharded_batch)
  # ... and against one device, unsharded, as a second reference.
  one_device = jax.value_and_grad(make_loss(LAYOUTS[0], AxisType.Auto))(params, batch)
  for reference in (want, one_device):
    chex.assert_trees_all_close((value, grads), reference, rtol=1e-5, atol=1e-6)
  assert_sharded_like(grads, sharded)


def data_collectives(layout, mesh, mode, k, fsdp_gather="once"):
  params, batch = make_problem()
  sharded, sharded_batch = place(layout, mesh, params, batch)
  text = _hlo.compiled_text(
    accumulated(layout, mesh, mode, k, under_jit=True, fsdp_gather=fsdp_gather),
    sharded,
    sharded_batch,
  )
  colls = _hlo.collectives(text)
  over_data = [c for c in colls if c.spans(layout.shape, layout.data_dims)]
  return colls, over_data


@pytest.mark.slow
def test_no_data_axis_collective_inside_the_loop_when_gathered_once(layout, mode):
  mesh = layout.mesh(mode)
  counts = {}
  for k in (2, 8):
    colls, over_data = data_collectives(layout, mesh, mode, k, "once")
    assert all(c.groups is not None for c in colls), colls
    assert [c for c in over_data if c.in_loop] == [], over_data
    counts[k] = sorted((c.op, c.executions) for c in over_data)
    if layout.model is not None:
      # Tensor parallelism stays: the model-axis reduction of the activations
      # runs in the loop, once per micro-batch.
      model_dim = [layout.axis_names.index(layout.model)]
      assert any(c.in_loop and c.spans(layout.shape, model_dim) for c in colls)
  assert counts[2] == counts[8], counts
  # FSDP weights: gathered once and reduce-scattered once, outside the loop.
  ops = [op for op, _ in counts[2]]
  assert "reduce-scatter" in ops and any(op.startswith("all-gather") for op in ops)
  assert all(n == 1 for _, n in counts[2])


@pytest.mark.slow
def test_per_micro_batch_fsdp_reduces_over_its_fsdp_axes_in_the_loop_only(layout, mode):
  """The default: each micro-batch gathers the FSDP weights it uses (as the
  full-batch step does) and reduces its FSDP gradients inside the loop, k
  times a step, over the axes they are sharded over only (the partitioner
  places it in the backward pass: a reduce-scatter on a GPU or TPU, see
  tests/test_targets.py; an all-reduce and a slice on the CPU). Replicated
  leaves and HSDP's replica axes are reduced once, after the loop: no
  reduction in the loop spans an axis a leaf is replicated over."""
  mesh = layout.mesh(mode)
  used = {n for spec in layout.specs.values() for e in spec if e for n in _names(e)}
  data = (
    layout.data_axis if isinstance(layout.data_axis, tuple) else (layout.data_axis,)
  )
  replica_dims = [layout.axis_names.index(a) for a in data if a not in used]
  for k in (2, 8):
    _, over_data = data_collectives(layout, mesh, mode, k, "per_micro_batch")
    in_loop = [c for c in over_data if c.in_loop]
    ops = {c.op.removesuffix("-start") for c in in_loop}
    assert "all-gather" in ops and ops & {"all-reduce", "reduce-scatter"}, in_loop
    assert ops <= {"all-gather", "all-reduce", "reduce-scatter"}, in_loop
    assert all(c.executions == k for c in in_loop), in_loop
    assert not [c for c in in_loop if c.spans(layout.shape, replica_dims)], in_loop
    after = [c for c in over_data if not c.in_loop and c.op.startswith("all-reduce")]
    assert after and all(c.executions == 1 for c in after), over_data


def _names(entry):
  return entry if isinstance(entry, tuple) else (entry,)


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 8])
def test_peak_per_device_below_the_full_batch_step(layout, mode, k):
  mesh = layout.mesh(mode)
  # Activations dominate, as where accumulation is needed. (An FSDP weight
  # costs one full-size float32 accumulator per device: the price of one
  # reduce-scatter per step instead of k.)
  params, batch = make_problem(batch_size=4096, features=128, hidden=2048)
  sharded, sharded_batch = place(layout, mesh, params, batch)
  with jax.set_mesh(mesh):
    full = jaxaccum.compiled_memory(
      full_batch(layout, mesh, mode), sharded, sharded_batch
    )
  accum = jaxaccum.compiled_memory(
    accumulated(layout, mesh, mode, k, under_jit=True), sharded, sharded_batch
  )
  assert accum.peak_bytes < full.peak_bytes, (str(accum), str(full))


def test_hsdp_keys_are_global_micro_batches():
  """With data_axis=("replica", "fsdp"), device d's micro-batch i is the
  global micro-batch d*k + i: the masks equal one device with D*k."""
  layout = LAYOUTS[2]
  mesh = layout.mesh(AxisType.Explicit)
  params, (x, y) = make_problem()
  k = 2

  def dropout_loss(p, batch, key):
    x, y = batch
    keep = jax.random.bernoulli(key, 0.5, x.shape)
    h = jnp.tanh(jnp.where(keep, x, 0.0) @ p["w1"] + p["b1"][None])
    return jnp.mean((h @ p["w2"] - y) ** 2), keep

  key = jax.random.key(3)
  (value, masks), grads = jaxaccum.value_and_grad(
    dropout_loss,
    k,
    rng_argnum=2,
    has_aux=True,
    aux="stack",
    mesh=mesh,
    data_axis=layout.data_axis,
  )(params, jax.device_put((x, y), NamedSharding(mesh, P(layout.data_axis))), key)
  devices = 4
  (want_value, want_masks), want_grads = jaxaccum.value_and_grad(
    dropout_loss, devices * k, rng_argnum=2, has_aux=True, aux="stack"
  )(params, (x, y), key)
  np.testing.assert_array_equal(np.asarray(masks), np.asarray(want_masks))
  assert len({np.asarray(m).tobytes() for m in masks}) == devices * k
  chex.assert_trees_all_close(
    (value, grads), (want_value, want_grads), rtol=1e-5, atol=1e-6
  )


def test_naming_the_data_axis_in_fun_is_a_clear_error():
  layout = LAYOUTS[1]
  mesh = layout.mesh(AxisType.Explicit)
  params, batch = make_problem()
  sharded, sharded_batch = place(layout, mesh, params, batch)

  def loss(p, batch):
    x, _ = batch
    h = jnp.einsum("bf,fh->bh", x, p["w1"], out_sharding=P("data", "model"))
    return jnp.mean(h**2)

  fun = jaxaccum.value_and_grad(loss, 2, mesh=mesh, data_axis="data")
  with pytest.raises(
    ValueError,
    match=r"^fun names the data axes \('data',\) in a sharding annotation\. In "
    r"jaxaccum's default view \(view='device'\) .* Pass view='global' to run fun "
    r"on the global micro-batch, as under plain jit, where such annotations are "
    r"valid as written .* P\(jax\.typeof\(x\)\.sharding\.spec\[0\], \.\.\.\) "
    r"names the batch axis in both views\. JAX said: ",
  ):
    fun(sharded, sharded_batch)


def test_a_dimension_sharded_along_data_and_model_is_refused():
  layout = LAYOUTS[1]
  mesh = layout.mesh(AxisType.Explicit)
  params, batch = make_problem()
  w1 = jax.device_put(params["w1"], NamedSharding(mesh, P(("data", "model"), None)))
  fun = jaxaccum.value_and_grad(
    make_loss(layout, AxisType.Explicit), 2, mesh=mesh, data_axis="data"
  )
  with pytest.raises(ValueError, match=r"args\[0\]\['w1'\].*data axes.*not both"):
    fun({**params, "w1": w1}, batch)


class TensorParallelMLP(nnx.Module):
  """An nnx MLP whose parameters carry tensor-parallel annotations."""

  def __init__(self, features, hidden, *, explicit, rngs):
    lecun = nnx.initializers.lecun_normal()
    self.up = nnx.Linear(
      features,
      hidden,
      kernel_init=nnx.with_partitioning(lecun, (None, "model")),
      bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("model",)),
      rngs=rngs,
    )
    self.down = nnx.Linear(
      hidden,
      features,
      kernel_init=nnx.with_partitioning(lecun, ("model", None)),
      rngs=rngs,
    )
    self.explicit = explicit

  def __call__(self, x):
    h = nnx.relu(self.up(x))
    # The contraction over the model axis names its output's sharding with the
    # idiom that runs under plain jit and inside jaxaccum alike.
    spec = P(jax.typeof(h).sharding.spec[0], None) if self.explicit else None
    return self.down(h, out_sharding=spec)


def nnx_loss(model, batch):
  x, y = batch
  return jnp.mean((model(x) - y) ** 2)


def sharded_model(mesh, explicit):
  with jax.set_mesh(mesh):  # flax creates annotated variables on the mesh
    model = TensorParallelMLP(16, 32, explicit=explicit, rngs=nnx.Rngs(0))
  state = nnx.state(model)
  specs = nnx.get_partition_spec(state)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  nnx.update(model, jax.device_put(state, shardings))
  return model, nnx.get_partition_spec(nnx.state(model, nnx.Param))


def param_shardings(model):
  return jax.tree.map(lambda x: x.sharding, nnx.state(model, nnx.Param))


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES, ids=["auto", "explicit"])
def test_nnx_tensor_parallel_training_stays_sharded_and_equals_the_full_batch(mode):
  mesh = LAYOUTS[1].mesh(mode)
  explicit = mode == AxisType.Explicit
  model, specs = sharded_model(mesh, explicit)
  reference, _ = sharded_model(mesh, explicit)
  with jax.set_mesh(mesh):  # users train under the mesh, as flax wants
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    ref_optimizer = nnx.Optimizer(reference, optax.adam(1e-2), wrt=nnx.Param)
  want_shardings = param_shardings(model)
  # Under nnx.jit an Auto mesh hides the shardings; there they are passed.
  grad_fn = jaxaccum.nnx.value_and_grad(
    nnx_loss, 4, mesh=mesh, data_axis="data", param_specs=None if explicit else specs
  )

  @nnx.jit
  def step(model, optimizer, batch):
    value, grads = grad_fn(model, batch)
    optimizer.update(model, grads)
    return value

  @nnx.jit
  def full_step(model, optimizer, batch):
    value, grads = nnx.value_and_grad(nnx_loss)(model, batch)
    optimizer.update(model, grads)
    return value

  x = jax.random.normal(jax.random.key(1), (64, 16))
  batch = jax.device_put((x, jnp.sin(x)), NamedSharding(mesh, P("data")))
  for _ in range(3):
    with jax.set_mesh(mesh):
      value = step(model, optimizer, batch)
      want = full_step(reference, ref_optimizer, batch)
    np.testing.assert_allclose(value, want, rtol=1e-5)
  chex.assert_trees_all_close(
    nnx.state(model, nnx.Param), nnx.state(reference, nnx.Param), rtol=1e-5, atol=1e-6
  )
  for got, want in zip(
    jax.tree.leaves(param_shardings(model)),
    jax.tree.leaves(want_shardings),
    strict=True,
  ):
    assert got.is_equivalent_to(want, 2), (got, want)
  mu = optimizer.opt_state[0].mu
  for got, want in zip(
    jax.tree.leaves(jax.tree.map(lambda x: x.sharding, mu)),
    jax.tree.leaves(want_shardings),
    strict=True,
  ):
    assert got.is_equivalent_to(want, 2), (got, want)


def test_a_raw_uint32_key_in_the_state_draws_alike_on_every_device():
  """Documented behaviour: only typed keys get the device folded in; a raw
  uint32 key in the state is an integer array, the same on every device."""
  mesh = jax.make_mesh((8,), ("data",))
  params, (x, y) = make_problem()

  def loss_with_key(p, batch, key):
    x, _ = batch
    draw = jax.random.normal(key, ())
    return jnp.mean((x @ p["w1"]) ** 2) * 0.0 + draw * 0.0, (draw, key)

  for key, distinct in ((jax.random.PRNGKey(0), 1), (jax.random.key(0), 8)):
    (_, (draws, _)), _ = jaxaccum.value_and_grad(
      loss_with_key,
      1,
      state_argnum=2,
      has_aux=True,
      aux="stack",
      mesh=mesh,
      data_axis="data",
    )(params, jax.device_put((x, y), NamedSharding(mesh, P("data"))), key)
    assert len(set(np.asarray(draws).tolist())) == distinct


# -- Small meshes and flax's own annotations (issue 18) ----------------------


@pytest.mark.slow
@pytest.mark.parametrize("model_size", [2, 4])
def test_a_data_axis_of_size_one_equals_the_full_batch(model_size, mode):
  """A (1, n) data x model mesh, the README's layout on a 2-device machine:
  the reduction over a one-device data axis raised an XLA RET_CHECK."""
  mesh = jax.make_mesh(
    (1, model_size),
    ("data", "model"),
    axis_types=(mode, mode),
    devices=jax.devices()[:model_size],
  )
  layout = dataclasses.replace(
    LAYOUTS[1],
    shape=(1, model_size),
    specs={"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)},
  )
  params, batch = make_problem()
  sharded, sharded_batch = place(layout, mesh, params, batch)
  for under_jit in (False, True):
    fun = accumulated(layout, mesh, mode, 4, under_jit=under_jit)
    value, grads = fun(sharded, sharded_batch)
    want = jax.value_and_grad(make_loss(LAYOUTS[0], AxisType.Auto))(params, batch)
    chex.assert_trees_all_close((value, grads), want, rtol=1e-5, atol=1e-6)
    assert_sharded_like(grads, sharded)


class EmbedLM(nnx.Module):
  """Token embedding and output projection, annotated as flax layers are:
  ``nnx.Embed`` called with ``out_sharding=`` runs its lookup under
  ``jax.sharding.auto_axes``."""

  def __init__(self, vocab, width, *, rngs):
    self.embed = nnx.Embed(
      vocab,
      width,
      embedding_init=nnx.with_partitioning(
        nnx.initializers.normal(1.0), (None, "model")
      ),
      rngs=rngs,
    )
    self.out = nnx.Linear(
      width,
      vocab,
      kernel_init=nnx.with_partitioning(
        nnx.initializers.lecun_normal(), ("model", None)
      ),
      rngs=rngs,
    )

  def __call__(self, tokens):
    batch_axis = jax.typeof(tokens).sharding.spec[0]
    h = self.embed(tokens, out_sharding=P(batch_axis, None, "model"))
    return self.out(h, out_sharding=P(batch_axis, None, None))


def embed_loss(model, tokens):
  logits = model(tokens[:, :-1])
  return jnp.mean(
    optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
  )


@pytest.mark.slow
@pytest.mark.skipif(
  "out_sharding" not in inspect.signature(nnx.Embed.__call__).parameters,
  reason="this flax's nnx.Embed takes no out_sharding= (flax 0.12.2 does not)",
)
def test_flax_embed_with_out_sharding_works_inside_the_mesh_path():
  mesh = LAYOUTS[1].mesh(AxisType.Explicit)
  with jax.set_mesh(mesh):
    model = EmbedLM(13, 8, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(2), (32, 9), 0, 13)
  tokens = jax.device_put(tokens, NamedSharding(mesh, P("data")))
  with jax.set_mesh(mesh):
    want = nnx.jit(nnx.value_and_grad(embed_loss))(model, tokens)
    got = nnx.jit(
      jaxaccum.nnx.value_and_grad(embed_loss, 2, mesh=mesh, data_axis="data")
    )(model, tokens)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


# -- Concrete-mesh constraints inside fun (issue 19): MaxText's and flax's ---


@pytest.mark.parametrize(
  "spec", [P(), P(None, None), P(None, "model")], ids=["P()", "P(None,None)", "model"]
)
def test_a_constraint_on_the_concrete_mesh_that_names_no_data_axis_works(spec):
  """MaxText constrains activations with with_sharding_constraint(x,
  NamedSharding(mesh, spec)) on its concrete mesh, as flax's logical-axis
  helpers do; under mesh= this failed even for specs that name no data axis."""
  layout = LAYOUTS[1]
  mesh = layout.mesh(AxisType.Auto)
  params, batch = make_problem()
  sharded, sharded_batch = place(layout, mesh, params, batch)

  def constrained(p, batch):
    x, y = batch
    h = jnp.tanh(x @ p["w1"] + p["b1"][None])
    h = jax.lax.with_sharding_constraint(h, NamedSharding(mesh, spec))
    return jnp.mean((h @ p["w2"] - y) ** 2)

  fun = jaxaccum.value_and_grad(
    constrained, 4, mesh=mesh, data_axis="data", param_specs=layout.specs
  )
  got = jax.jit(fun)(sharded, sharded_batch)
  want = jax.value_and_grad(make_loss(LAYOUTS[0], AxisType.Auto))(params, batch)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_constraint_that_names_the_data_axis_is_a_clear_error():
  """MaxText's activation rules put the data axis on the batch dimension.
  Inside jaxaccum the batch dimension is one device's rows (a vmap over the
  data axes), so that constraint cannot hold; the error names the spec and
  what to write instead."""
  layout = LAYOUTS[1]
  mesh = layout.mesh(AxisType.Auto)
  params, batch = make_problem()
  sharded, sharded_batch = place(layout, mesh, params, batch)

  def constrained(p, batch):
    x, y = batch
    h = jnp.tanh(x @ p["w1"] + p["b1"][None])
    h = jax.lax.with_sharding_constraint(h, NamedSharding(mesh, P("data", "model")))
    return jnp.mean((h @ p["w2"] - y) ** 2)

  fun = jaxaccum.value_and_grad(
    constrained, 4, mesh=mesh, data_axis="data", param_specs=layout.specs
  )
  with pytest.raises(ValueError) as error:
    jax.jit(fun)(sharded, sharded_batch)
  message = str(error.value)
  assert message.startswith("fun names the data axes ('data',) in a sharding")
  assert "P('data', 'model')" in message  # the constraint, as JAX names it
  assert "P(None, 'model') for P('data', 'model')" in message
