"""Every device agrees: no decision that devices could take differently.

Two kinds of test:

- **runs** on 8 CPU devices, with NaN rows on one device only: every device
  skips the same ``make_train_step`` step, drops the same ``accumulate()``
  micro-batch, adjusts the loss scale the same way, and follows the same
  ``auto_k`` windows; every replicated result is bitwise the same on every
  device (``tests/agreement_steps.py``; ``tests/test_multihost.py`` runs the
  same checks on 2 processes x 4 devices);
- **structure**: in every compiled step (``make_train_step``, ``accumulate``
  with ``auto_k``, loss scaling, the FSDP modes, Auto and Explicit axes), no
  ``conditional`` predicate, ``while`` condition or replicated output
  depends on a value that differs between devices before a reduction
  (``jaxaccum.testing.divergent_decisions``). A step built to decide on one
  device's rows is caught, so the check can fail.
"""

import agreement_steps as steps
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from jaxaccum import testing

BAD_DEVICE = 3


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))


def sharded_batch(mesh):
  return lambda *arrays: tuple(
    jax.device_put(a, NamedSharding(mesh, P("data"))) for a in arrays
  )


# -- runs ----------------------------------------------------------------------


def test_a_nan_on_one_device_skips_the_train_step_on_every_device(mesh):
  result = steps.skipped_train_step(mesh, sharded_batch(mesh), (BAD_DEVICE,))
  del result["digest"]  # for the processes of tests/test_multihost.py
  assert result == {
    "skipped_value_is_nan": True,
    "skipped_params_unchanged": True,
    "skipped_state_unchanged": True,
    "skipped_agreed": True,
    "clean_moved": True,
    "clean_agreed": True,
  }


def test_a_nan_on_one_device_is_dropped_from_the_window_on_every_device(mesh):
  result = steps.dropped_micro_batch(mesh, sharded_batch(mesh), (BAD_DEVICE,))
  del result["digest"]
  assert result == {
    "updated_on_the_second_call_only": True,
    "skipped_counts": [0, 1, 1],
    "state_agreed": True,
    "updates_agreed": True,
    "updates_finite": True,
  }


def test_an_overflow_on_one_device_halves_the_loss_scale_on_every_device(mesh):
  result = steps.adjusted_loss_scale(mesh, sharded_batch(mesh), (BAD_DEVICE,))
  del result["digest"]
  assert result == {
    "scales": [2.0**9, 2.0**9],
    "skipped_params_unchanged": True,
    "clean_moved": True,
    "agreed": True,
  }


def test_every_device_follows_the_same_autopilot_windows_for_500_steps(mesh):
  result = steps.autopilot_windows(mesh, sharded_batch(mesh), 500)
  assert result["disagreements"] == 0
  assert len(result["windows"]) > 1  # the window did move: there was a decision


# -- structure -------------------------------------------------------------------


def compiled(step, *args, mesh):
  with jax.set_mesh(mesh):
    return step.lower(*args).compile()


def loss2(params, batch):
  x, y = batch
  h = jnp.tanh(x @ params["w1"])
  return jnp.mean((h @ params["w2"] - y) ** 2)


# name: (mesh shape, axis names, data axes, parameter specs, has FSDP leaves)
MESHES = {
  "data (8)": ((8,), ("data",), "data", {"w1": P(), "w2": P()}, False),
  "fsdp (8)": ((8,), ("data",), "data", {"w1": P("data"), "w2": P()}, True),
  "hsdp (2, 4)": (
    (2, 4),
    ("replica", "fsdp"),
    ("replica", "fsdp"),
    {"w1": P("fsdp"), "w2": P()},
    True,
  ),
  "data x model (2, 4)": (
    (2, 4),
    ("data", "model"),
    "data",
    {"w1": P(None, "model"), "w2": P("model")},
    False,
  ),
}


def placed(mesh, specs, data):
  params = {"w1": jnp.ones((8, 8)) / 8, "w2": jnp.linspace(-1.0, 1.0, 8)}
  params = {
    n: jax.device_put(v, NamedSharding(mesh, specs[n])) for n, v in params.items()
  }
  rows = NamedSharding(mesh, P(data))
  batch = (
    jax.device_put(jnp.ones((32, 8)), rows),
    jax.device_put(jnp.ones((32,)), rows),
  )
  return params, batch


#: The FSDP modes and views of the mesh path, as make_train_step's options.
MODES = {
  "per_micro_batch": {},
  "once": {"fsdp_gather": "once"},
  "cast_once": {"fsdp_gather": "cast_once", "gather_dtype": jnp.bfloat16},
  "global view": {"view": "global"},
  # no mesh=: plain jit, on Explicit axes JAX's reduced/unreduced step
  "plain jit": None,
}


@pytest.mark.slow
@pytest.mark.parametrize(
  "axis_type", [AxisType.Auto, AxisType.Explicit], ids=["Auto", "Explicit"]
)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("layout", list(MESHES))
def test_no_train_step_decision_depends_on_one_device(layout, mode, axis_type):
  shape, names, data, specs, fsdp = MESHES[layout]
  if "fsdp_gather" in (MODES[mode] or {}) and not fsdp:
    pytest.skip("no FSDP leaf: the gather mode does not apply")
  if axis_type == AxisType.Explicit and "model" in names:
    pytest.skip("tensor parallelism on Explicit axes needs out_sharding in the loss")
  mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names))
  params, batch = placed(mesh, specs, data)
  tx = optax.adam(1e-3)
  options = {
    "mesh": mesh,
    "data_axis": data,
    "param_specs": specs,
    **(MODES[mode] or {}),
  }
  step = jaxaccum.make_train_step(
    loss2, tx, 2, donate=False, **(options if MODES[mode] is not None else {})
  )
  assert (
    testing.divergent_decisions(
      compiled(step, params, tx.init(params), batch, mesh=mesh), mesh
    )
    == []
  )


@pytest.mark.slow
@pytest.mark.parametrize(
  "every_k",
  [
    pytest.param(4, id="fixed window"),
    pytest.param(jaxaccum.auto_k(max_k=16, warmup=1), id="auto_k"),
  ],
)
@pytest.mark.parametrize(
  "loss_scale", [None, jaxaccum.dynamic_loss_scale()], ids=["float32", "loss scale"]
)
def test_no_accumulate_decision_depends_on_one_device(mesh, every_k, loss_scale):
  grad_fn = jaxaccum.grad(steps.loss, 2, mesh=mesh, data_axis="data")
  tx = jaxaccum.accumulate(optax.adam(1e-3), every_k, loss_scale=loss_scale)
  w = steps.replicated(mesh, jnp.ones(steps.DIM))

  def call(w, state, batch):
    updates, state = tx.update(grad_fn(w, batch), state, w)
    return optax.apply_updates(w, updates), state

  batch = sharded_batch(mesh)(*steps.host_batch(8, 0))
  text = compiled(jax.jit(call), w, tx.init(w), batch, mesh=mesh)
  assert testing.divergent_decisions(text, mesh) == []


def test_a_loss_scaled_train_step_decides_on_reduced_values_only(mesh):
  tx = jaxaccum.accumulate(optax.sgd(0.1), 1, loss_scale=jaxaccum.dynamic_loss_scale())
  step = jaxaccum.make_train_step(
    steps.loss, tx, 2, mesh=mesh, data_axis="data", donate=False
  )
  w = steps.replicated(mesh, jnp.ones(steps.DIM))
  batch = sharded_batch(mesh)(*steps.host_batch(8, 0))
  assert (
    testing.divergent_decisions(compiled(step, w, tx.init(w), batch, mesh=mesh), mesh)
    == []
  )


def test_a_loss_scaled_plain_jit_step_on_explicit_axes_decides_on_reduced_values():
  """Plain jit's unreduced accumulators are only added to: the loss scale's
  overflow check and the skip read the gradients after their reduction."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  tx = jaxaccum.accumulate(optax.sgd(0.1), 1, loss_scale=jaxaccum.dynamic_loss_scale())
  step = jaxaccum.make_train_step(loss2, tx, 2, donate=False)
  params, batch = placed(mesh, {"w1": P(), "w2": P()}, "data")
  assert (
    testing.divergent_decisions(
      compiled(step, params, tx.init(params), batch, mesh=mesh), mesh
    )
    == []
  )


@pytest.mark.parametrize("normalize", ["poisson", "fixed"])
def test_a_dp_sgd_step_decides_on_reduced_values_only(mesh, normalize):
  """Clipped per example, noise once per step: the skip of a step without
  real examples (fixed sampling) reads the total over every device."""

  def example_loss(w, example):
    x, y = example
    return (x @ w - y) ** 2

  expected = {"expected_batch_size": 8.0} if normalize == "poisson" else {}
  noise = jaxaccum.dp_noise(
    1.0, 1.0, jax.random.key(0), normalize=normalize, **expected
  )
  tx = optax.chain(noise, optax.sgd(0.1))
  step = jaxaccum.make_train_step(
    example_loss, tx, 2, clip_per_example=1.0, mesh=mesh, data_axis="data", donate=False
  )
  w = steps.replicated(mesh, jnp.ones(steps.DIM))
  batch = sharded_batch(mesh)(*steps.host_batch(8, 0))
  rows = 8 * steps.ROWS_PER_DEVICE
  mask = jax.device_put(jnp.ones(rows), NamedSharding(mesh, P("data")))
  with jax.set_mesh(mesh):
    text = step.lower(w, tx.init(w), batch, example_mask=mask).compile()
  assert testing.divergent_decisions(text, mesh) == []


def test_a_step_that_skips_on_one_devices_rows_is_caught(mesh):
  """The negative control: each device checks its own rows' gradient for
  NaN (a ``shard_map`` that claims a replicated result it does not have) and
  skips the update on its own. The check names the select's output and the
  ``cond`` deciding on it."""

  def step(w, batch):
    def local(w, batch):
      g = jax.grad(steps.loss)(w, batch)
      return g, jnp.all(jnp.isfinite(g))

    g, ok = jax.shard_map(
      local, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()), check_vma=False
    )(w, batch)
    w = jnp.where(ok, w - 0.1 * g, w)
    return w, jax.lax.cond(ok, lambda: 1, lambda: 0)

  w = steps.replicated(mesh, jnp.ones(steps.DIM))
  batch = sharded_batch(mesh)(*steps.host_batch(8, 0))
  found = testing.divergent_decisions(
    compiled(jax.jit(step), w, batch, mesh=mesh), mesh
  )
  assert sorted({(d.kind, d.axes) for d in found}) == [
    ("conditional", ("data",)),
    ("output", ("data",)),
  ]
  assert {d.instruction for d in found if d.kind == "output"} == {
    "output 0",
    "output 1",
  }


def test_the_check_reads_reduced_values_as_agreed_and_local_ones_as_not(mesh):
  """``psum`` makes a per-device value the same everywhere; a sum over the
  ``model`` axis only leaves it differing along ``data``."""
  mesh2 = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  x = jax.device_put(jnp.arange(16.0), NamedSharding(mesh2, P(("data", "model"))))

  def decide(over):
    def f(x):
      total = jax.shard_map(
        lambda r: jax.lax.psum(r.sum(), over),
        mesh=mesh2,
        in_specs=P(("data", "model")),
        out_specs=P(),
        check_vma=False,
      )(x)
      return jax.lax.cond(total > 0, lambda: 1.0, lambda: 0.0)

    found = testing.divergent_decisions(compiled(jax.jit(f), x, mesh=mesh2), mesh2)
    return sorted({(d.kind, d.axes) for d in found})

  assert decide(("data", "model")) == []
  assert decide("model") == [("conditional", ("data",)), ("output", ("data",))]
  assert decide("data") == [("conditional", ("model",)), ("output", ("model",))]
