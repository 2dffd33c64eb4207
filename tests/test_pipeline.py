"""``jaxaccum.pipeline`` equals the unpipelined ``lax.scan`` over the layers.

The reference is the obvious one: ``lax.scan`` of the same ``layer_fn`` over
the ``L`` stacked layers on the whole batch, differentiated by
``jax.value_and_grad`` (with keys, a Python loop over the pipeline
micro-batches, each scanned with the keys the contract gives it). The
pipeline runs on a mesh of 2 or 4 stage devices (and a 2 x 4 data x stage
mesh), and without a mesh on one device.
"""

import functools
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from jaxaccum import testing
from jaxaccum._pipeline import (
  PipelineBubbleWarning,
  ReplicatedLayersWarning,
  Schedule,
)

# The unit roundoff u of float32: half the spacing of its numbers at 1.
U = float(jnp.finfo(jnp.float32).eps) / 2
WIDTH, LAYERS, BATCH = 4, 8, 16


def layer(w, h):
  """A residual tanh layer: ``h + tanh(h @ w["a"] + w["b"])``."""
  return h + jnp.tanh(h @ w["a"] + w["b"][None])


def dropout_layer(w, h, key):
  """The residual layer with dropout (rate 1/2) on its branch."""
  keep = jax.random.bernoulli(key, 0.5, h.shape)
  return h + jnp.where(keep, 2 * jnp.tanh(h @ w["a"] + w["b"][None]), 0.0)


def make_problem(layers=LAYERS, batch=BATCH, width=WIDTH, seed=0):
  k = jax.random.split(jax.random.key(seed), 3)
  stacked = {
    "a": jax.random.normal(k[0], (layers, width, width)) / 2,
    "b": jax.random.normal(k[1], (layers, width)) / 2,
  }
  return stacked, jax.random.normal(k[2], (batch, width))


def scanned(layer_fn, stacked, x, *args):
  """The reference: the L layers one after the other, a ``lax.scan``."""
  return jax.lax.scan(lambda h, w: (layer_fn(w, h, *args), None), x, stacked)[0]


def unpipelined(stacked, x):
  return scanned(layer, stacked, x)


def loss_of(forward):
  """A loss that reads every output entry with its own weight, so that a
  row or a column put in the wrong place changes it."""

  def loss(stacked, x, *args):
    y = forward(stacked, x, *args)
    weights = jnp.arange(1, y.size + 1, dtype=y.dtype).reshape(y.shape) / y.size
    return jnp.sum(jnp.sin(y) * weights)

  return loss


def by_repeat(stacked, repeats):
  """Leaves ``(L, ...)`` as the circular layout's ``(repeats, L // r, ...)``."""
  if repeats == 1:
    return stacked
  return jax.tree.map(lambda w: w.reshape(repeats, -1, *w.shape[1:]), stacked)


def by_layer(stacked, repeats):
  """The inverse of :func:`by_repeat` (and a copy to the host, so that a
  gradient sharded over a stage axis reshapes freely)."""
  if repeats == 1:
    return stacked
  return jax.tree.map(lambda w: np.asarray(w).reshape(-1, *w.shape[2:]), stacked)


def stage_mesh(stages, axis_type=AxisType.Explicit):
  return jax.make_mesh(
    (stages,), ("stage",), (axis_type,), devices=jax.devices()[:stages]
  )


def on_stages(mesh, stacked, repeats):
  spec = P("stage") if repeats == 1 else P(None, "stage")
  return jax.device_put(by_repeat(stacked, repeats), NamedSharding(mesh, spec))


def assert_close(got, want, terms):
  """Each leaf of ``got`` within ``2 * terms * u`` of the largest magnitude in
  that leaf of ``want``.

  A sum of n float32 terms is off by at most (n - 1) u times the sum of
  their magnitudes (Higham 2002, eq. 4.4), and both paths round so: hence
  the 2. ``terms`` counts the roundings an entry collects: the sum over the
  batch's rows (the pipeline sums a micro-batch's rows, then the
  micro-batches), the dot products of the layers it passes, and a few more.
  A micro-batch lost, doubled or given to the wrong layer moves a leaf by
  an m-th of it at least: orders of magnitude beyond this.
  """
  for (path, want_leaf), g in zip(
    jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got), strict=True
  ):
    assert jnp.shape(g) == jnp.shape(want_leaf), (path, jnp.shape(g))
    w = np.asarray(want_leaf, np.float64)
    np.testing.assert_allclose(
      np.asarray(g, np.float64),
      w,
      rtol=0,
      atol=2 * terms * U * np.max(np.abs(w)),
      err_msg=jax.tree_util.keystr(path),
    )


def terms(micro_batches=1, *, per_layer=WIDTH + 4, batch=BATCH, layers=LAYERS):
  """The roundings an entry collects: the batch's rows and the micro-batches
  summed, and ``per_layer`` in each layer: a dot product over the width and a
  few more (a LayerNorm sums the width four times: its mean and variance,
  and two sums in its backward pass)."""
  return batch + micro_batches + layers * per_layer


LAYER_NORM = 4 * WIDTH + 8  # roundings per layer of a block with a LayerNorm


def raises_whole(message):
  """``pytest.raises`` matching the whole message, so that a garbled or
  truncated one fails (JAX may append its note on filtered frames)."""
  note = r"(\n-+\nFor simplicity, JAX has removed its internal frames.*)?"
  return pytest.raises(ValueError, match="(?s)^" + re.escape(message) + note + r"\Z")


# -- the schedule ----------------------------------------------------------


@pytest.mark.parametrize(
  ("S", "r", "m", "iterations"),
  [(4, 1, 4, 7), (4, 1, 8, 11), (4, 2, 8, 19), (2, 2, 2, 5), (4, 2, 2, 9)],
)
def test_the_loop_has_r_m_plus_s_minus_1_iterations(S, r, m, iterations):
  """With m >= S the contract's count; with m < S repeats start every S
  iterations: (r - 1) S + m + S - 1."""
  schedule = Schedule(S, r, m, 1)
  assert schedule.iterations == iterations
  assert schedule.bubble == pytest.approx(1 - r * m / iterations)


def test_every_stage_runs_every_micro_batch_of_every_repeat_once():
  """The slots of the schedule: stage s at iteration t runs micro-batch j of
  repeat rho exactly once, and stage s + 1 runs it at t + 1."""
  schedule = Schedule(4, 2, 6, 1)
  seen = {}
  for t in range(schedule.iterations):
    for s in range(4):
      micro, repeat, real = (int(v) for v in schedule.slot(jnp.int32(t), s))
      if real:
        assert (s, micro, repeat) not in seen
        seen[(s, micro, repeat)] = t
  assert len(seen) == 4 * 2 * 6
  for (s, micro, repeat), t in seen.items():
    if s:
      assert seen[(s - 1, micro, repeat)] == t - 1
    elif repeat:  # it came back from the last stage, not earlier
      assert seen[(3, micro, repeat - 1)] < t


# -- values and gradients ----------------------------------------------------


CONFIGS = [(S, m, r) for S in (2, 4) for m in (S, 2 * S) for r in (1, 2)]


@functools.cache
def reference():
  """The unpipelined value and gradients (stacked, x) of the standard problem."""
  value, grads = jax.jit(jax.value_and_grad(loss_of(unpipelined), argnums=(0, 1)))(
    *make_problem()
  )
  return value, *grads


def pipelined_value_and_grads(pipe, mesh, repeats):
  """The pipeline's value and gradients (stacked, x) of the standard problem,
  with the stacked layers as ``(L, ...)`` again."""
  stacked, x = make_problem()
  if mesh is None:
    args = (by_repeat(stacked, repeats), x)
    value, grads = jax.jit(jax.value_and_grad(loss_of(pipe), argnums=(0, 1)))(*args)
  else:
    with jax.set_mesh(mesh):
      args = (on_stages(mesh, stacked, repeats), x)
      value, grads = jax.jit(jax.value_and_grad(loss_of(pipe), argnums=(0, 1)))(*args)
  return value, by_layer(grads[0], repeats), grads[1]


@pytest.mark.slow
@pytest.mark.parametrize(("S", "m", "r"), CONFIGS)
def test_values_and_grads_equal_the_unpipelined_scan(S, m, r):
  pipe = jaxaccum.pipeline(layer, num_stages=S, num_micro_batches=m, repeats=r)
  got = pipelined_value_and_grads(pipe, stage_mesh(S), r)
  assert_close(got, reference(), terms(m))


def test_without_a_mesh_the_stages_run_on_one_device():
  pipe = jaxaccum.pipeline(layer, num_stages=4, num_micro_batches=4, repeats=2)
  assert_close(pipelined_value_and_grads(pipe, None, 2), reference(), terms(4))


def test_fewer_micro_batches_than_stages_warn_and_still_equal_the_scan():
  """With m < S and r > 1 a micro-batch is back at stage 0 only S
  iterations after it left: the repeats start every S iterations."""
  pipe = jaxaccum.pipeline(layer, num_stages=4, num_micro_batches=2, repeats=2)
  with pytest.warns(PipelineBubbleWarning) as caught:
    got = pipelined_value_and_grads(pipe, stage_mesh(4), 2)
  assert [str(w.message) for w in caught] == [
    "num_micro_batches=2 is less than num_stages=4: each stage idles 56% of "
    "the 9 iterations (the bubble). num_micro_batches=4 or more keeps it at "
    "27% or less."
  ]
  assert_close(got, reference(), terms(2))


@pytest.mark.parametrize("data", [1, 2])
def test_the_results_rows_come_back_split_over_the_stages(data):
  """The head after the pipeline runs on 1/S of the rows per stage device:
  the result is sharded over the stage axis (after the data axis)."""
  stacked, x = make_problem()
  if data == 1:
    mesh, rows = stage_mesh(4), "stage"
  else:
    mesh, rows = data_stage_mesh(AxisType.Explicit), ("data", "stage")
  pipe = jaxaccum.pipeline(layer, num_stages=4, num_micro_batches=4)
  with jax.set_mesh(mesh):
    x = jax.device_put(x, NamedSharding(mesh, P(None if data == 1 else "data")))
    y = jax.jit(pipe)(on_stages(mesh, stacked, 1), x)
  assert y.sharding.spec[0] == rows
  assert_close(y, unpipelined(stacked, x), terms())


def test_side_inputs_travel_with_the_activations_and_come_back_unchanged():
  """A pytree activation: a boolean mask and integer positions ride along
  (the layer reads them), through the collective-permutes and back."""
  stacked, x = make_problem()
  mask = jnp.arange(BATCH * WIDTH).reshape(BATCH, WIDTH) % 3 != 0
  positions = jnp.arange(BATCH, dtype=jnp.int32)

  def masked(w, h):
    out = layer(w, h["h"]) * (1 + h["pos"][:, None] / BATCH)
    return {"h": jnp.where(h["mask"], out, h["h"]), "mask": h["mask"], "pos": h["pos"]}

  pipe = jaxaccum.pipeline(masked, num_stages=2, num_micro_batches=4)
  mesh = stage_mesh(2)
  inputs = {"h": x, "mask": mask, "pos": positions}
  with jax.set_mesh(mesh):
    got = jax.jit(pipe)(on_stages(mesh, stacked, 1), inputs)
  want = scanned(masked, stacked, inputs)
  assert got["mask"].dtype == jnp.bool_ and got["pos"].dtype == jnp.int32
  np.testing.assert_array_equal(got["mask"], mask)
  np.testing.assert_array_equal(got["pos"], positions)
  assert_close(got["h"], want["h"], terms())


# -- keys --------------------------------------------------------------------


def keyed_reference(stacked, x, key, m, shards=1):
  """Pipeline micro-batch j (rows j, j + m, ...) through the L layers, layer
  l with ``fold_in(fold_in(key, j), l)``: a Python loop over j, a scan
  over l. With data ``shards``, shard d's rows (the d-th block of the
  batch) are pipelined apart, its micro-batch j numbered d·m + j."""
  out = jnp.zeros_like(x)
  rows = x.shape[0] // shards
  for d in range(shards):
    for j in range(m):
      keys = jax.vmap(
        lambda layer, n=d * m + j: jax.random.fold_in(jax.random.fold_in(key, n), layer)
      )(jnp.arange(LAYERS))
      where = slice(d * rows + j, (d + 1) * rows, m)
      h = jax.lax.scan(
        lambda h, wk: (dropout_layer(wk[0], h, wk[1]), None), x[where], (stacked, keys)
      )[0]
      out = out.at[where].set(h)
  return out


def test_layer_l_on_micro_batch_j_gets_fold_in_fold_in_key_j_l():
  stacked, x = make_problem()
  key = jax.random.key(7)
  pipe = jaxaccum.pipeline(
    dropout_layer, num_stages=4, num_micro_batches=4, repeats=2, rng_argnum=2
  )
  mesh = stage_mesh(4)
  with jax.set_mesh(mesh):
    got = jax.jit(jax.value_and_grad(loss_of(pipe), argnums=(0, 1)))(
      on_stages(mesh, stacked, 2), x, key
    )
  want = jax.jit(
    jax.value_and_grad(
      loss_of(lambda s, x, key: keyed_reference(s, x, key, 4)), argnums=(0, 1)
    )
  )(stacked, x, key)
  value, (d_stacked, dx) = got
  assert_close((value, by_layer(d_stacked, 2), dx), (want[0], *want[1]), terms(4))


@pytest.mark.slow
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize(
  ("shape", "names", "data"),
  [
    ((2, 4), ("data", "stage"), "data"),
    ((2, 2, 2), ("a", "b", "stage"), ("a", "b")),
  ],
  ids=["2 data x 4 stages", "2 x 2 data x 2 stages"],
)
def test_each_data_shard_draws_its_own_keys(shape, names, data, axis_type):
  """Data shard d's micro-batch j is number d·m + j, d the row-major index
  over the data axes: no two shards draw the same dropout masks (the same
  key on both drew the same masks for both halves of the batch)."""
  stacked, x = make_problem()
  key = jax.random.key(7)
  stages = shape[-1]
  pipe = jaxaccum.pipeline(
    dropout_layer, num_stages=stages, num_micro_batches=4, rng_argnum=2, data_axis=data
  )
  mesh = jax.make_mesh(shape, names, (axis_type,) * len(shape))
  with jax.set_mesh(mesh):
    got = jax.jit(jax.value_and_grad(loss_of(pipe), argnums=(0, 1)))(
      on_stages(mesh, stacked, 1), jax.device_put(x, NamedSharding(mesh, P(data))), key
    )
  shards = 8 // stages
  reference = functools.partial(keyed_reference, m=4, shards=shards)
  want = jax.jit(jax.value_and_grad(loss_of(reference), argnums=(0, 1)))(
    stacked, x, key
  )
  value, (d_stacked, dx) = got
  assert_close((value, d_stacked, dx), (want[0], *want[1]), terms(4))


@pytest.mark.slow
def test_static_arguments_reach_the_layers_as_they_are():
  """A Python bool and a float among pipe's arguments are static, as the
  docstring says, with remat and without, on a stage mesh and on one
  device: the layer branches on the bool and loops int(4 * scale) times,
  which a traced value could do neither of."""

  def switched(w, h, train, scale):
    if not train:
      return h
    for _ in range(int(4 * scale)):
      h = layer(w, h)
    return h

  stacked, x = make_problem()
  mesh = stage_mesh(4)
  for remat in (True, False):
    pipe = jaxaccum.pipeline(switched, num_stages=4, num_micro_batches=4, remat=remat)
    for train in (True, False):
      want = scanned(switched, stacked, x, train, 0.5)
      got = jax.jit(pipe, static_argnums=(2, 3))(stacked, x, train, 0.5)
      assert_close(got, want, 2 * terms())
      with jax.set_mesh(mesh):
        got = jax.jit(pipe, static_argnums=(2, 3))(
          on_stages(mesh, stacked, 1), x, train, 0.5
        )
      assert_close(got, want, 2 * terms())


# -- composition -------------------------------------------------------------


def mean_loss_of(forward):
  """A per-example mean, as ``normalize="mean"`` wants: the outer split of
  the batch then averages to the full batch's value."""

  def loss(stacked, x):
    y = forward(stacked, x)
    return jnp.mean(jnp.sin(y) @ jnp.arange(1.0, WIDTH + 1))

  return loss


@functools.cache
def mean_reference():
  return jax.jit(jax.value_and_grad(mean_loss_of(unpipelined)))(*make_problem())


def test_an_outer_value_and_grad_of_k_micro_batches_equals_the_full_batch():
  """k = 2 outer micro-batches, each pipelined in 4: the full batch's."""
  stacked, x = make_problem()
  pipe = jaxaccum.pipeline(layer, num_stages=4, num_micro_batches=4, repeats=2)
  mesh = stage_mesh(4)
  with jax.set_mesh(mesh):
    value, grads = jax.jit(jaxaccum.value_and_grad(mean_loss_of(pipe), 2))(
      on_stages(mesh, stacked, 2), x
    )
  assert_close((value, by_layer(grads, 2)), mean_reference(), terms(4))


def data_stage_mesh(axis_type):
  return jax.make_mesh((2, 4), ("data", "stage"), (axis_type, axis_type))


@pytest.mark.slow
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_data_and_stage_axes_under_plain_jit_equal_the_scan(axis_type):
  """A 2 data x 4 stage mesh: each data row of devices pipelines its own
  half of the batch. On Explicit axes the data axis is read from the batch's
  type; on Auto axes it is named."""
  stacked, x = make_problem()
  mesh = data_stage_mesh(axis_type)
  data_axis = "data" if axis_type == AxisType.Auto else None
  pipe = jaxaccum.pipeline(
    layer, num_stages=4, num_micro_batches=4, repeats=2, data_axis=data_axis
  )
  with jax.set_mesh(mesh):
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    value, grads = jax.jit(jax.value_and_grad(mean_loss_of(pipe)))(
      on_stages(mesh, stacked, 2), x
    )
  assert_close((value, by_layer(grads, 2)), mean_reference(), terms(4))


@pytest.mark.slow
@pytest.mark.parametrize(
  ("shape", "names"),
  [((1, 4), ("other", "stage")), ((2, 4, 1), ("data", "stage", "tensor"))],
)
def test_explicit_meshes_with_axes_the_pipeline_leaves_alone(shape, names):
  """Explicit axes the pipeline's shard_map leaves to the partitioner (of
  size 1 here, as in MaxText's meshes): the result's rows come back split
  over the stages (a reduce-scatter jax 0.12.0.1 cannot lower there), the
  values and gradients those of the scan."""
  stacked, x = make_problem()
  mesh = jax.make_mesh(
    shape,
    names,
    (AxisType.Explicit,) * len(shape),
    devices=jax.devices()[: 4 * shape[0]],
  )
  pipe = jaxaccum.pipeline(layer, num_stages=4, num_micro_batches=4)
  data = "data" if "data" in names else None
  with jax.set_mesh(mesh):
    x = jax.device_put(x, NamedSharding(mesh, P(data)))
    value, grads = jax.jit(jax.value_and_grad(mean_loss_of(pipe)))(
      on_stages(mesh, stacked, 1), x
    )
  assert_close((value, grads), mean_reference(), terms(4))


@pytest.mark.slow
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_data_and_stage_axes_under_the_mesh_path_equal_the_scan(axis_type):
  """jaxaccum's ``mesh=`` runs the loss per device of the data axis, k = 2
  micro-batches each, the pipeline inside."""
  stacked, x = make_problem()
  mesh = data_stage_mesh(axis_type)
  pipe = jaxaccum.pipeline(layer, num_stages=4, num_micro_batches=4, repeats=2)
  step = jaxaccum.value_and_grad(
    mean_loss_of(pipe), 2, mesh=mesh, data_axis="data", param_specs=P(None, "stage")
  )
  with jax.set_mesh(mesh):
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    value, grads = jax.jit(step)(on_stages(mesh, stacked, 2), x)
  assert_close((value, by_layer(grads, 2)), mean_reference(), terms(4))


def replicated_out(w, h):
  """The residual layer with its output replicated: on Explicit axes a
  tensor-parallel matmul's output is typed sharded, and a scan carry (the
  user's own ``lax.scan`` as much as the pipeline's) must keep its type."""
  return jax.sharding.reshard(layer(w, h), P())


@pytest.mark.slow
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize("within", ["fsdp", "tensor"])
def test_fsdp_or_tensor_parallelism_inside_a_stage_equal_the_scan(within, axis_type):
  """A 2 x 4 mesh whose first axis shards each stage's weights: FSDP (the
  batch over it too, ``data_axis=()`` so the partitioner gathers the
  weights where they are used) or tensor parallelism (the weights' output
  dimension). Values and gradients are the scan's; on Explicit axes the
  gradients are typed like the weights."""
  stacked, x = make_problem()
  mesh = jax.make_mesh((2, 4), (within, "stage"), (axis_type, axis_type))
  fsdp = within == "fsdp"
  specs = (
    {"a": P("stage", "fsdp"), "b": P("stage")}
    if fsdp
    else {"a": P("stage", None, "tensor"), "b": P("stage", "tensor")}
  )
  layer_fn = replicated_out if not fsdp and axis_type == AxisType.Explicit else layer
  pipe = jaxaccum.pipeline(
    layer_fn, num_stages=4, num_micro_batches=4, data_axis=() if fsdp else None
  )
  with jax.set_mesh(mesh):
    w = jax.tree.map(
      lambda a, p: jax.device_put(a, NamedSharding(mesh, p)), stacked, specs
    )
    rows = jax.device_put(x, NamedSharding(mesh, P("fsdp" if fsdp else None)))
    value, grads = jax.jit(jax.value_and_grad(mean_loss_of(pipe)))(w, rows)
  assert_close((value, grads), mean_reference(), terms(4))
  if axis_type == AxisType.Explicit:  # on Auto axes jit's outputs are XLA's choice
    for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(specs), strict=True):
      assert g.sharding.is_equivalent_to(NamedSharding(mesh, p), g.ndim)


# -- the compiled program ------------------------------------------------------

# Wide enough that one layer's weights (16 x 16 floats, 1 KiB) outweigh the
# activations of a data shard (8 rows x 16 floats, 512 B): a weight moved
# between stages cannot pass for an activation.
WIDE = 16


def compiled_step(step_of, data_axis_type=AxisType.Auto, r=2, m=4):
  """The optimized HLO and memory analysis of a training step's value and
  gradients on the 2 data x 4 stage mesh, and the sizes to check them by."""
  stacked, x = make_problem(width=WIDE)
  mesh = data_stage_mesh(data_axis_type)
  with jax.set_mesh(mesh):
    stacked = on_stages(mesh, stacked, r)
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    compiled = jax.jit(step_of(mesh, r, m)).lower(stacked, x).compile()
  # One pipeline micro-batch of a data shard (the mesh path's k = 2 halves it).
  rows = BATCH // 2 // (2 if step_of is mesh_path_step else 1)
  micro = rows // m * WIDE * 4
  stage_weights = LAYERS // 4 * (WIDE * WIDE + WIDE) * 4
  grads = LAYERS // 4 * (WIDE * WIDE + WIDE) * 4  # one stage's gradients
  return compiled, {"micro": micro, "stage_weights": stage_weights, "grads": grads}


def plain_jit_step(mesh, r, m):
  pipe = jaxaccum.pipeline(
    layer, num_stages=4, num_micro_batches=m, repeats=r, data_axis="data"
  )
  return jax.value_and_grad(mean_loss_of_wide(pipe))


def mesh_path_step(mesh, r, m):
  pipe = jaxaccum.pipeline(layer, num_stages=4, num_micro_batches=m, repeats=r)
  return jaxaccum.value_and_grad(
    mean_loss_of_wide(pipe),
    2,
    mesh=mesh,
    data_axis="data",
    param_specs=P(None, "stage"),
  )


def mean_loss_of_wide(forward):
  def loss(stacked, x):
    return jnp.mean(jnp.sin(forward(stacked, x)) @ jnp.arange(1.0, WIDE + 1))

  return loss


DATA, STAGE = [0], [1]  # the mesh's axes, for Collective.spans


def permute_pairs(text):
  """The (source, target) device pairs of every collective-permute in HLO
  text, as mesh coordinates ``(data, stage)``."""
  pairs = []
  for line in text.splitlines():
    if "collective-permute" in line and "source_target_pairs=" in line:
      found = re.search(r"source_target_pairs=\{(.*?)\}\}", line).group(1)
      for a, b in re.findall(r"(\d+),(\d+)", found):
        pairs.append(
          (np.unravel_index(int(a), (2, 4)), np.unravel_index(int(b), (2, 4)))
        )
  return pairs


@pytest.mark.slow
@pytest.mark.parametrize("step_of", [plain_jit_step, mesh_path_step])
def test_inside_the_loop_only_one_micro_batch_moves_between_stages(step_of):
  """Every collective over the stage axis inside a loop is a
  collective-permute of one micro-batch's activation: no weight, no whole
  batch, no all-reduce per iteration."""
  compiled, sizes = compiled_step(step_of)
  found = testing.collectives(compiled.as_text())
  permutes = [c for c in found if c.op.startswith("collective-permute")]
  assert permutes, "the activations never moved"
  in_loop = [c for c in found if c.in_loop and c.spans((2, 4), STAGE)]
  inner = [c for c in in_loop if c.executions > 2]  # the pipeline's own loop
  assert inner, "no collective inside the pipeline loop"
  assert {(c.op.removesuffix("-start"), c.bytes) for c in inner} == {
    ("collective-permute", sizes["micro"])
  }


@pytest.mark.slow
@pytest.mark.parametrize(("r", "m", "trips"), [(1, 4, 7), (2, 4, 11), (2, 8, 19)])
def test_the_loop_runs_r_m_plus_s_minus_1_iterations(r, m, trips):
  compiled, _ = compiled_step(plain_jit_step, r=r, m=m)
  permutes = [c for c in testing.collectives(compiled.as_text()) if "permute" in c.op]
  # One forward and one backward loop, each moving an activation per trip.
  assert [c.executions for c in permutes] == [trips, trips]


# (S, m, r) and the loop's length, counted by hand from the schedule: repeat
# rho of micro-batch j enters stage 0 at rho * max(m, S) + j (with m < S it is
# back only S iterations after it left) and leaves the last stage S - 1 later.
TRIPS = [
  (2, 2, 1, 3),  # m = S: r*m + S - 1
  (2, 4, 3, 13),
  (4, 4, 2, 11),
  (4, 8, 1, 11),
  (4, 2, 1, 5),  # m < S, one repeat: still r*m + S - 1
  (4, 2, 2, 9),  # m < S, r > 1: r*S + m - 1, not r*m + S - 1 = 7
  (4, 1, 3, 12),  # not 6
  (4, 3, 2, 10),  # not 9
  (2, 1, 4, 8),  # not 5
]


def pipeline_scan_length(jaxpr):
  """The length of the outermost ``scan`` in a jaxpr: the pipeline's loop
  (the layers' scan of each stage sits inside it)."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan":
      return eqn.params["length"]
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      found = pipeline_scan_length(sub)
      if found is not None:
        return found
  return None


@pytest.mark.slow
@pytest.mark.parametrize(("S", "m", "r", "trips"), TRIPS)
def test_the_traced_loop_has_r_minus_1_max_m_s_plus_m_plus_s_minus_1_iterations(
  S, m, r, trips
):
  """The docstring's count, ``(r - 1)·max(m, S) + m + S - 1``, against the
  length of the scan the pipeline traces (one device; the same schedule)."""
  stacked, x = make_problem(layers=S * r, batch=4 * m)
  pipe = jaxaccum.pipeline(layer, num_stages=S, num_micro_batches=m, repeats=r)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", PipelineBubbleWarning)
    jaxpr = jax.make_jaxpr(pipe)(by_repeat(stacked, r), x)
  assert pipeline_scan_length(jaxpr.jaxpr) == trips == (r - 1) * max(m, S) + m + S - 1
  assert Schedule(S, r, m, 1).iterations == trips


@pytest.mark.parametrize(("S", "m", "r", "trips"), [TRIPS[1], TRIPS[5], TRIPS[6]])
def test_the_compiled_loop_on_stage_devices_runs_as_many_trips(S, m, r, trips):
  """On a mesh of ``S`` stage devices the compiled while loop runs the
  docstring's count: each trip moves one activation (a collective-permute)."""
  stacked, x = make_problem(layers=S * r, batch=4 * m)
  pipe = jaxaccum.pipeline(layer, num_stages=S, num_micro_batches=m, repeats=r)
  mesh = stage_mesh(S)
  with jax.set_mesh(mesh), warnings.catch_warnings():
    warnings.simplefilter("ignore", PipelineBubbleWarning)
    compiled = jax.jit(pipe).lower(on_stages(mesh, stacked, r), x).compile()
  permutes = [c for c in testing.collectives(compiled.as_text()) if "permute" in c.op]
  assert [(c.in_loop, c.executions) for c in permutes] == [(True, trips)]


@pytest.mark.parametrize("step_of", [plain_jit_step, mesh_path_step])
def test_no_stage_holds_another_stages_weights(step_of):
  """Each device's arguments are its stage's layers and its rows; nothing
  gathers weights over the stage axis."""
  compiled, sizes = compiled_step(step_of)
  memory = compiled.memory_analysis()
  rows = BATCH // 2 * WIDE * 4
  assert memory.argument_size_in_bytes == sizes["stage_weights"] + rows
  for c in testing.collectives(compiled.as_text()):
    if c.spans((2, 4), STAGE):
      assert c.bytes <= rows, c  # activations of a shard at most, never weights


@pytest.mark.slow
@pytest.mark.parametrize("step_of", [plain_jit_step, mesh_path_step])
def test_with_data_parallelism_one_gradient_reduction_over_data_per_step(step_of):
  compiled, sizes = compiled_step(step_of)
  text = compiled.as_text()
  # The activations move within a row of stages, never across the data axis.
  pairs = permute_pairs(text)
  assert pairs and all(a[0] == b[0] and a[1] != b[1] for a, b in pairs), pairs
  over_data = [
    c
    for c in testing.collectives(text)
    if "permute" not in c.op and c.spans((2, 4), DATA)
  ]
  assert over_data, "the gradients were never reduced over the data axis"
  assert not [c for c in over_data if c.in_loop], over_data
  # The stage's gradients once, and the loss (a few scalars).
  assert (
    sizes["grads"]
    <= sum(c.bytes * c.executions for c in over_data)
    <= (sizes["grads"] + 16)
  )


# -- bad input -----------------------------------------------------------------


def trace(fun, *args):
  """Traces without running: the errors come from tracing alone."""
  return jax.eval_shape(fun, *args)


def test_layers_that_do_not_split_into_the_stages_and_repeats():
  stacked, x = make_problem(layers=6)
  pipe = jaxaccum.pipeline(layer, num_stages=4, num_micro_batches=4)
  with raises_whole(
    "L=6 layers do not split into num_stages=4 * repeats=1 = 4 equal groups: "
    "choose L, num_stages and repeats with L divisible by num_stages * repeats."
  ):
    trace(pipe, stacked, x)
  pipe = jaxaccum.pipeline(layer, num_stages=2, num_micro_batches=4, repeats=2)
  with raises_whole(
    "L=6 layers do not split into num_stages=2 * repeats=2 = 4 equal groups: "
    "choose L, num_stages and repeats with L divisible by num_stages * repeats."
  ):
    trace(pipe, by_repeat(stacked, 2), x)


def test_repeats_want_the_leaves_as_rows_of_layers():
  stacked, x = make_problem()
  pipe = jaxaccum.pipeline(layer, num_stages=2, num_micro_batches=4, repeats=2)
  with raises_whole(
    "stacked['a'] has shape=(8, 4, 4), and with repeats=2 every leaf is "
    "stacked (repeats, L // repeats, ...), one row of layers per repeat, for "
    "the circular layout: pass w.reshape(2, -1, *w.shape[1:]) and shard its "
    "second axis P(None, 'stage')."
  ):
    trace(pipe, stacked, x)


def test_a_batch_that_does_not_split_into_the_micro_batches():
  stacked, x = make_problem(batch=12)
  pipe = jaxaccum.pipeline(layer, num_stages=2, num_micro_batches=8)
  with raises_whole(
    "The batch_size=12 is not divisible by num_micro_batches=8: choose a "
    "num_micro_batches that divides it (1, 2, 3, 4, 6, 12)."
  ):
    trace(pipe, stacked, x)


def test_a_data_shard_that_does_not_split_into_the_micro_batches():
  """16 rows split into 16 micro-batches, but each of 2 data shards
  pipelines its own 8 (JAX's reshape error named neither)."""
  stacked, x = make_problem()
  mesh = data_stage_mesh(AxisType.Explicit)
  pipe = jaxaccum.pipeline(layer, num_stages=4, num_micro_batches=16)
  with (
    jax.set_mesh(mesh),
    raises_whole(
      "Each of the 2 data shards (axes ('data',)) pipelines its own 8 of the "
      "batch_size=16 rows, and num_micro_batches=16 does not divide 8: choose a "
      "num_micro_batches that does (1, 2, 4, 8), or a batch_size that is a "
      "multiple of 32."
    ),
  ):
    jax.jit(pipe).trace(
      on_stages(mesh, stacked, 1), jax.device_put(x, NamedSharding(mesh, P("data")))
    )


def test_a_batch_that_does_not_split_over_the_data_devices():
  """15 rows, 5 micro-batches, but 2 data shards (named on Auto axes, where
  the batch's sharding is hidden)."""
  stacked, x = make_problem(batch=15)
  mesh = data_stage_mesh(AxisType.Auto)
  pipe = jaxaccum.pipeline(layer, num_stages=4, num_micro_batches=5, data_axis="data")
  with (
    jax.set_mesh(mesh),
    raises_whole(
      "The batch_size=15 does not split over the 2 devices of the data axes "
      "('data',): pass a batch whose size is a multiple of 2."
    ),
  ):
    jax.jit(pipe).trace(on_stages(mesh, stacked, 1), x)


def test_a_mesh_without_the_stage_axis():
  stacked, x = make_problem()
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  pipe = jaxaccum.pipeline(layer, num_stages=4, num_micro_batches=4)
  with (
    jax.set_mesh(mesh),
    raises_whole(
      "The mesh has no axis 'stage' for the stages: its axes are ('data', "
      "'model'). Name the stage axis with stage_axis=, or make a mesh with one "
      "of size num_stages=4."
    ),
  ):
    trace(pipe, stacked, x)


def test_a_stage_axis_of_another_size_than_num_stages():
  stacked, x = make_problem()
  pipe = jaxaccum.pipeline(layer, num_stages=2, num_micro_batches=4)
  with (
    jax.set_mesh(stage_mesh(4)),
    raises_whole(
      "The mesh's stage axis 'stage' has 4 devices and num_stages=2: one stage "
      "per device, so pass num_stages=4 or resize the axis."
    ),
  ):
    trace(pipe, stacked, x)


@pytest.mark.parametrize(
  ("repeats", "spec", "want"),
  [
    (1, P(), "P('stage')"),
    (2, P(), "P(None, 'stage')"),
    (2, P("stage"), "P(None, 'stage')"),
  ],
  ids=["replicated", "replicated-repeats", "stage-on-the-repeats"],
)
def test_layers_not_on_the_stage_axis_of_explicit_axes_are_named(repeats, spec, want):
  """On Explicit axes the layers' type shows where they lie: replicated (or
  split over the repeats instead of the layers), they got a raw shard_map
  error ("in_specs ... does not match the specs of the input")."""
  stacked, x = make_problem()
  mesh = stage_mesh(2)
  pipe = jaxaccum.pipeline(layer, num_stages=2, num_micro_batches=4, repeats=repeats)
  layers = "axis 0, of 8 layers" if repeats == 1 else "axis 1, of 4 layers per repeat"
  with jax.set_mesh(mesh):
    w = jax.device_put(by_repeat(stacked, repeats), NamedSharding(mesh, spec))
    typed = jax.typeof(w["a"]).sharding.spec
    with raises_whole(
      f"stacked['a'] lies {typed} on the mesh's Explicit axes, and each of the "
      f"2 stages holds its own layers: the layer axis ({layers}) must be "
      f"split over the stage axis 'stage'. Place the stacked layers {want}: "
      f"jax.device_put(stacked, NamedSharding(mesh, {want})) before the step, "
      f"jax.sharding.reshard(stacked, {want}) inside it, or param_specs={want} "
      "under jaxaccum's mesh=."
    ):
      jax.jit(pipe).trace(w, x)


@pytest.mark.slow
def test_replicated_layers_on_auto_axes_warn_where_their_sharding_shows():
  """On Auto axes replicated layers run (each stage slices its own out), but
  every device holds the whole stack: a warning naming the fix, where the
  sharding is visible (concrete arrays). Placed P("stage"), none."""
  stacked, x = make_problem()
  mesh = stage_mesh(4, AxisType.Auto)
  pipe = jaxaccum.pipeline(layer, num_stages=4, num_micro_batches=4)
  with jax.set_mesh(mesh):
    w = jax.device_put(stacked, NamedSharding(mesh, P()))
    with pytest.warns(ReplicatedLayersWarning) as caught:
      y = pipe(w, x)
    assert [str(c.message) for c in caught] == [
      "stacked['a'] lies P() on the mesh, so every device holds all 8 layers, "
      "and each of the 4 stages uses 2 of them: place the stacked layers "
      "P('stage') (jax.device_put(stacked, NamedSharding(mesh, P('stage')))) "
      "so that each device holds its own stage's layers only."
    ]
    assert_close(y, unpipelined(stacked, x), terms())
    with warnings.catch_warnings():
      warnings.simplefilter("error", ReplicatedLayersWarning)
      pipe(on_stages(mesh, stacked, 1), x)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_layers_placed_on_the_stages_that_do_not_divide_them_are_named(axis_type):
  """6 layers, 4 stages, placed P("stage") by jaxaccum's own mesh= path: an
  error from jaxaccum naming the sizes, not JAX's sharding error (on
  Explicit axes JAX's came first). (Placed
  by the user, an uneven P("stage") array cannot exist: device_put raises
  before jaxaccum runs.)"""
  stacked, x = make_problem(layers=6)
  mesh = data_stage_mesh(axis_type)
  pipe = jaxaccum.pipeline(layer, num_stages=4, num_micro_batches=2)
  step = jaxaccum.value_and_grad(
    mean_loss_of(pipe), 2, mesh=mesh, data_axis="data", param_specs=P("stage")
  )
  with jax.set_mesh(mesh), pytest.raises(ValueError) as caught:
    jax.jit(step).trace(stacked, jax.device_put(x, NamedSharding(mesh, P("data"))))
  # mesh= places the layers before the loss (and the pipeline) runs: its
  # own check of param_specs comes first, on both axis types
  assert str(caught.value) == (
    "The parameter args[0]['a'] has shape (6, 4, 4), and its spec "
    "P('stage',) shards dimension 0 (size 6) over 4 devices ('stage'), which "
    "do not divide it: choose a size that 4 divides, or another spec "
    "(param_specs=)."
  )


def test_the_mesh_is_read_from_the_leaves_shardings():
  """Without a mesh context, the stacked leaves' sharding names the mesh (so
  a mismatch is still caught)."""
  stacked, x = make_problem()
  stacked = on_stages(stage_mesh(4), stacked, 1)
  pipe = jaxaccum.pipeline(layer, num_stages=2, num_micro_batches=4)
  with pytest.raises(ValueError, match="has 4 devices and num_stages=2"):
    trace(pipe, stacked, x)


def test_data_axes_the_mesh_does_not_have():
  stacked, x = make_problem()
  pipe = jaxaccum.pipeline(layer, num_stages=4, num_micro_batches=4, data_axis="batch")
  with (
    jax.set_mesh(data_stage_mesh(AxisType.Auto)),
    raises_whole(
      "data_axis=('batch',) names ('batch',), which the mesh does not have: the "
      "mesh's axes are ('data', 'stage'), the stages on 'stage'. Name the axes "
      "the batch is sharded over besides it."
    ),
  ):
    trace(pipe, stacked, x)


@pytest.mark.parametrize(
  ("change", "result"),
  [
    (lambda w, h: h @ w["a"][:, :2], "shape=(4, 2), dtype=float32"),
    (lambda w, h: layer(w, h).astype(jnp.bfloat16), "shape=(4, 4), dtype=bfloat16"),
  ],
  ids=["shape", "dtype"],
)
def test_a_layer_that_changes_the_activations_shape_or_dtype(change, result):
  stacked, x = make_problem()
  pipe = jaxaccum.pipeline(change, num_stages=2, num_micro_batches=4)
  with raises_whole(
    f"layer_fn turned the activation x of shape=(4, 4), dtype=float32 into "
    f"{result}: each layer's output is the next layer's input, so it must keep "
    "the shape and dtype (cast back, or change them outside the pipeline)."
  ):
    trace(pipe, stacked, x)


def test_a_layer_that_changes_the_activations_structure():
  stacked, x = make_problem()
  pipe = jaxaccum.pipeline(
    lambda w, h: (layer(w, h), h), num_stages=2, num_micro_batches=4
  )
  with raises_whole(
    "layer_fn returned PyTreeDef((*, *)) for an activation PyTreeDef(*): a "
    "layer must return the activation with the structure it got."
  ):
    trace(pipe, stacked, x)


def test_stacked_leaves_with_different_numbers_of_layers():
  stacked, x = make_problem()
  stacked["b"] = stacked["b"][:4]
  pipe = jaxaccum.pipeline(layer, num_stages=2, num_micro_batches=4)
  with raises_whole(
    "The leaves of stacked hold different numbers of layers (stacked['a']: 8, "
    "stacked['b']: 4): stack every parameter of the L layers on the same "
    "leading axis."
  ):
    trace(pipe, stacked, x)


def test_activation_leaves_with_different_batch_sizes():
  stacked, x = make_problem()
  pipe = jaxaccum.pipeline(
    lambda w, h: {"h": layer(w, h["h"]), "mask": h["mask"]},
    num_stages=2,
    num_micro_batches=4,
  )
  with raises_whole(
    "The leaves of x have different batch sizes (x['h']: 16, x['mask']: 8): "
    "every leaf of the activation needs the same leading batch axis."
  ):
    trace(pipe, stacked, {"h": x, "mask": jnp.ones(8, bool)})


@pytest.mark.parametrize(
  ("option", "value", "message"),
  [
    ("num_stages", 0, "num_stages must be a positive int, got 0."),
    ("num_stages", True, "num_stages must be a positive int, got True."),
    ("num_micro_batches", 2.0, "num_micro_batches must be a positive int, got 2.0."),
    ("repeats", -1, "repeats must be a positive int, got -1."),
    (
      "rng_argnum",
      1,
      "rng_argnum must be the position of the key among pipe's arguments, 2 "
      "or more (pipe(stacked, x, key) has it at 2), got 1.",
    ),
    ("stage_axis", 0, "stage_axis must be a mesh axis name, got 0."),
  ],
)
def test_bad_options_are_named(option, value, message):
  options = {"num_stages": 2, "num_micro_batches": 4, option: value}
  with raises_whole(message):
    jaxaccum.pipeline(layer, **options)


def test_a_key_position_beyond_the_arguments():
  stacked, x = make_problem()
  pipe = jaxaccum.pipeline(
    dropout_layer, num_stages=2, num_micro_batches=4, rng_argnum=2
  )
  with raises_whole(
    "rng_argnum=2, but pipe was called with 2 arguments: pass the key at that position."
  ):
    trace(pipe, stacked, x)


# -- Flax -----------------------------------------------------------------------


class LinenBlock(nn.Module):
  """A pre-LayerNorm residual block, shaped for ``nn.scan``: (carry, x)."""

  @nn.compact
  def __call__(self, h, _):
    return h + jnp.tanh(nn.Dense(WIDTH)(nn.LayerNorm()(h))), None


@pytest.mark.slow
def test_linen_layers_stacked_by_nn_scan_equal_the_scanned_model():
  """The recipe: the params of an ``nn.scan``-ned block are stacked on a
  leading axis; ``layer_fn`` applies one block."""
  _, x = make_problem()
  scanned_model = nn.scan(
    LinenBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS
  )()
  params = scanned_model.init(jax.random.key(3), x, None)["params"]
  pipe = jaxaccum.pipeline(
    lambda p, h: LinenBlock().apply({"params": p}, h, None)[0],
    num_stages=4,
    num_micro_batches=4,
  )
  mesh = stage_mesh(4)
  with jax.set_mesh(mesh):
    got = jax.jit(jax.value_and_grad(loss_of(pipe), argnums=(0, 1)))(
      on_stages(mesh, params, 1), x
    )
  model = lambda p, x: scanned_model.apply({"params": p}, x, None)[0]  # noqa: E731
  want = jax.jit(jax.value_and_grad(loss_of(model), argnums=(0, 1)))(params, x)
  assert_close(got, want, terms(4, per_layer=LAYER_NORM))


class NnxBlock(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
    self.linear = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

  def __call__(self, h):
    return h + jnp.tanh(self.linear(self.norm(h)))


class NnxStack(nnx.Module):
  """L blocks made by ``nnx.vmap``: every variable stacked on a leading axis."""

  def __init__(self, rngs: nnx.Rngs):
    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
      return NnxBlock(rngs)

    self.blocks = create(rngs)


def nnx_loss(run):
  """``loss(model, x)``: the blocks split into a graph and a stacked state,
  ``layer_fn`` merging one layer's slice back into a block."""

  def loss(model, x):
    graphdef, state = nnx.split(model.blocks)
    return loss_of(lambda s, x: run(lambda w, h: nnx.merge(graphdef, w)(h), s, x))(
      state, x
    )

  return loss


@pytest.mark.slow
def test_nnx_layers_stacked_by_nnx_vmap_equal_the_scan():
  _, x = make_problem()
  model = NnxStack(nnx.Rngs(4))
  want = nnx.value_and_grad(nnx_loss(scanned))(model, x)
  mesh = stage_mesh(4)

  def pipelined(layer_fn, state, x):
    return jaxaccum.pipeline(layer_fn, num_stages=4, num_micro_batches=4)(state, x)

  with jax.set_mesh(mesh):
    state = nnx.state(model)
    nnx.update(model, on_stages(mesh, state, 1))
    got = nnx.jit(nnx.value_and_grad(nnx_loss(pipelined)))(model, x)
  assert_close(got, want, terms(4, per_layer=LAYER_NORM))


# -- a whole training step --------------------------------------------------------


def regression_loss(forward):
  def loss(params, batch):
    x, y = batch
    return jnp.mean((forward(params["layers"], x) @ params["head"] - y) ** 2)

  return loss


@pytest.mark.slow
def test_twenty_train_steps_equal_the_unpipelined_steps():
  """make_train_step (Adam, k = 2 outer micro-batches) with the pipeline,
  against the same step with the scan, from the same start, over 20 steps:
  every step's loss and the final parameters."""
  stacked, x = make_problem()
  y = jnp.sin(x @ jnp.arange(1.0, WIDTH + 1))
  params = {"layers": stacked, "head": jnp.ones(WIDTH) / WIDTH}
  tx = optax.adam(1e-2)
  pipe = jaxaccum.pipeline(layer, num_stages=4, num_micro_batches=4, repeats=2)
  plain = jaxaccum.make_train_step(regression_loss(unpipelined), tx, 2)
  piped = jaxaccum.make_train_step(regression_loss(pipe), tx, 2)
  mesh = stage_mesh(4)
  want_params, state = jax.tree.map(jnp.copy, params), tx.init(params)
  want_losses = []
  for _ in range(20):
    want_params, state, value = plain(want_params, state, (x, y))
    want_losses.append(value)
  with jax.set_mesh(mesh):
    got_params = {
      "layers": on_stages(mesh, stacked, 2),
      "head": jax.device_put(params["head"], NamedSharding(mesh, P())),
    }
    state = tx.init(got_params)
    got_losses = []
    for _ in range(20):
      got_params, state, value = piped(got_params, state, (x, y))
      got_losses.append(value)
  got_params["layers"] = by_layer(got_params["layers"], 2)
  # Each step's roundings, twenty times over (Adam's update divides by the
  # root of a running mean of squares: a relative error, not amplified).
  assert_close((got_losses, got_params), (want_losses, want_params), 20 * terms(4))
  assert want_losses[-1] < 0.5 * want_losses[0]  # it learned: the test is not vacuous
