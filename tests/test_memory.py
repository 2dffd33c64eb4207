"""Compile-time memory: the planner, remat and the donated train step."""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxaccum

WIDTH, DEPTH, BATCH = 64, 6, 512


def deep_loss(params, batch):
  x, y = batch
  h = x
  for w in params:
    h = jnp.tanh(h @ w)
  return jnp.mean((h[:, 0] - y) ** 2)


def deep_problem(batch=BATCH, depth=DEPTH):
  keys = jax.random.split(jax.random.key(0), depth + 2)
  params = [jax.random.normal(k, (WIDTH, WIDTH)) / np.sqrt(WIDTH) for k in keys[:depth]]
  x = jax.random.normal(keys[-2], (batch, WIDTH))
  y = jax.random.normal(keys[-1], (batch,))
  return params, (x, y)


def abstract(tree):
  """Shapes only: the planner must work without any data."""
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def peak(k):
  params, batch = deep_problem()
  return jaxaccum.compiled_memory(
    jaxaccum.value_and_grad(deep_loss, k), params, batch
  ).peak_bytes


def test_peak_memory_falls_with_k():
  peaks = [peak(k) for k in (1, 4, 16)]
  assert peaks[0] > peaks[1] > peaks[2], peaks


def test_plan_chooses_the_smallest_k_that_fits():
  params, batch = deep_problem()
  budget = (peak(4) + peak(2)) // 2  # k=4 fits, k=2 does not
  plan = jaxaccum.plan_micro_batches(
    deep_loss, abstract((params, batch)), memory_limit_bytes=budget
  )
  assert plan.num_micro_batches == 4
  assert plan.peak_bytes == peak(4) <= budget
  rows = {row.num_micro_batches: row for row in plan.table}
  assert not rows[2].fits and rows[2].memory.peak_bytes > budget
  assert rows[4].micro_batch_size == BATCH // 4
  # Bisected over the powers of two that divide the batch: not all compiled.
  powers = [2**i for i in range(10) if BATCH % 2**i == 0]
  assert set(rows) < set(powers), sorted(rows)
  assert "<- chosen" in str(plan)


def test_plan_is_one_when_everything_fits():
  params, batch = deep_problem()
  plan = jaxaccum.plan_micro_batches(
    deep_loss, (params, batch), memory_limit_bytes=10 * peak(1), candidates=[1, 2, 8]
  )
  assert plan.num_micro_batches == 1
  assert [row.num_micro_batches for row in plan.table] == [1, 2]  # bisected


def test_plan_raises_when_nothing_fits():
  params, batch = deep_problem()
  with pytest.raises(
    ValueError,
    match=r"No candidate fits memory_limit_bytes=1000 .* smallest compiled peak",
  ):
    jaxaccum.plan_micro_batches(
      deep_loss, abstract((params, batch)), memory_limit_bytes=1000, candidates=[1, 2]
    )


def test_plan_a_whole_train_step_counts_the_optimizer_state():
  params, batch = deep_problem()
  tx = optax.adam(1e-3)
  args = abstract((params, tx.init(params), batch))
  builder = functools.partial(jaxaccum.make_train_step, deep_loss, tx)
  plan = jaxaccum.plan_micro_batches(
    builder, args, memory_limit_bytes=10**9, candidates=[1, 4]
  )
  grads_only = jaxaccum.plan_micro_batches(
    deep_loss, abstract((params, batch)), memory_limit_bytes=10**9, candidates=[1, 4]
  )
  adam_bytes = 2 * sum(p.size * 4 for p in params)
  # The step also holds Adam's two moments as arguments.
  assert (
    plan.table[0].memory.argument_bytes
    >= grads_only.table[0].memory.argument_bytes + adam_bytes
  )


def test_memory_report_prints_the_parts(capsys):
  params, batch = deep_problem()
  stats = jaxaccum.memory_report(jaxaccum.value_and_grad(deep_loss, 4), params, batch)
  out = capsys.readouterr().out
  for word in ("arguments", "outputs", "temporaries", "peak"):
    assert word in out
  assert (
    stats.peak_bytes
    == stats.argument_bytes + stats.output_bytes + stats.temp_bytes - stats.alias_bytes
  )


def meta_objective(remat, k):
  """A gradient penalty: differentiates *through* the accumulated gradient."""

  def objective(params, batch):
    grads = jaxaccum.grad(deep_loss, k, remat=remat)(params, batch)
    return sum(jnp.sum(g**2) for g in grads)

  return jax.grad(objective)


@pytest.mark.slow
def test_remat_lowers_peak_memory_when_differentiating_through_accumulation():
  params, batch = deep_problem(depth=12)
  plain = jaxaccum.compiled_memory(meta_objective(False, 8), params, batch)
  remat = jaxaccum.compiled_memory(meta_objective(True, 8), params, batch)
  assert remat.peak_bytes < 0.5 * plain.peak_bytes, (remat, plain)
  chex.assert_trees_all_close(
    meta_objective(True, 8)(params, batch),
    meta_objective(False, 8)(params, batch),
    rtol=1e-4,
    atol=1e-8,
  )


def test_remat_costs_nothing_in_a_first_order_step():
  params, batch = deep_problem()
  plain = jaxaccum.compiled_memory(jaxaccum.value_and_grad(deep_loss, 8), params, batch)
  remat = jaxaccum.compiled_memory(
    jaxaccum.value_and_grad(
      deep_loss, 8, remat=jax.checkpoint_policies.nothing_saveable
    ),
    params,
    batch,
  )
  assert remat.peak_bytes == plain.peak_bytes


def test_train_step_donates_and_matches_the_full_batch():
  params, batch = deep_problem()
  tx = optax.adam(1e-2)
  step = jaxaccum.make_train_step(deep_loss, tx, 8)
  stats = jaxaccum.compiled_memory(step, params, tx.init(params), batch)
  param_bytes = sum(p.size * 4 for p in params)
  assert stats.alias_bytes >= 3 * param_bytes  # params and both Adam moments

  ref_params, ref_state = params, tx.init(params)
  grads = jax.grad(deep_loss)(ref_params, batch)
  updates, ref_state = tx.update(grads, ref_state, ref_params)
  ref_params = optax.apply_updates(ref_params, updates)

  new_params, _, value = step(params, tx.init(params), batch)
  assert params[0].is_deleted()  # donated: the input buffers were reused
  chex.assert_trees_all_close(new_params, ref_params, rtol=1e-5, atol=1e-6)
  assert np.isfinite(value)


def test_train_step_skips_a_nan_step():
  params, (x, y) = deep_problem()
  tx = optax.adam(1e-2)
  step = jaxaccum.make_train_step(deep_loss, tx, 4, donate=False)
  bad = (x.at[3, 0].set(jnp.nan), y)
  new_params, new_state, value = step(params, tx.init(params), bad)
  assert np.isnan(value)
  chex.assert_trees_all_equal(new_params, params)
  chex.assert_trees_all_equal(new_state, tx.init(params))


def test_train_step_skip_keeps_the_state_as_it_came_in():
  """A NaN batch must not poison the threaded state (BatchNorm statistics)."""

  def loss_with_stats(params, batch, stats):
    x, y = batch
    new_stats = 0.9 * stats + 0.1 * jnp.mean(x, axis=0)
    return deep_loss(params, (x - stats[None, :], y)), (None, new_stats)

  params, (x, y) = deep_problem()
  tx = optax.sgd(0.1)
  step = jaxaccum.make_train_step(
    loss_with_stats, tx, 4, state_argnum=2, has_aux=True, donate=False
  )
  stats = jnp.zeros(WIDTH)
  _, _, (value, (_, good_stats)) = step(params, tx.init(params), (x, y), stats)
  assert np.isfinite(value) and not np.allclose(good_stats, stats)
  bad = (x.at[3, 0].set(jnp.nan), y)
  new_params, _, (value, (_, new_stats)) = step(params, tx.init(params), bad, stats)
  assert np.isnan(value)
  chex.assert_trees_all_equal(new_params, params)
  chex.assert_trees_all_equal(new_stats, stats)


def test_plan_a_step_whose_batch_is_not_the_last_argument():
  params, batch = deep_problem()
  tx = optax.sgd(0.1)

  def noisy_loss(params, batch, key):
    x, y = batch
    return deep_loss(params, (x + 0.01 * jax.random.normal(key, x.shape), y))

  builder = functools.partial(jaxaccum.make_train_step, noisy_loss, tx, rng_argnum=2)
  args = (*abstract((params, tx.init(params), batch)), jax.random.key(0))
  plan = jaxaccum.plan_micro_batches(
    builder, args, memory_limit_bytes=10**9, candidates=[1, 4], step_batch_argnum=2
  )
  assert plan.num_micro_batches == 1 and plan.table[0].micro_batch_size == BATCH
  with pytest.raises(ValueError, match="step_batch_argnum is for a step builder"):
    jaxaccum.plan_micro_batches(
      deep_loss, (params, batch), memory_limit_bytes=10**9, step_batch_argnum=1
    )


def test_plan_with_a_mesh_splits_each_device_batch():
  params, batch = deep_problem(batch=64)
  mesh = jax.make_mesh((8,), ("data",))
  plan = jaxaccum.plan_micro_batches(
    deep_loss,
    abstract((params, batch)),
    memory_limit_bytes=10**9,
    mesh=mesh,
    data_axis="data",
    candidates=[1, 2, 4, 8],
    print_fn=None,
  )
  # 8 rows per device: the micro-batch sizes are per device.
  assert plan.num_micro_batches == 1
  assert [row.micro_batch_size for row in plan.table] == [
    8 // row.num_micro_batches for row in plan.table
  ]


@pytest.mark.parametrize("k", [2, 8])
def test_peak_equals_a_hand_written_scan(k):
  """The engine needs no more memory than the obvious lax.scan over the same
  split: what it misses of the ideal bound, a hand-written loop misses too."""
  params, batch = deep_problem()

  def hand_scan(params, batch):
    micro = jax.tree.map(lambda a: a.reshape(k, -1, *a.shape[1:]), batch)

    def body(acc, mb):
      loss, grads = jax.value_and_grad(deep_loss)(params, mb)
      return jax.tree.map(jnp.add, acc, (loss, grads)), None

    zeros = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
    total, _ = jax.lax.scan(body, zeros, micro)
    return jax.tree.map(lambda t: t / k, total)

  ours = jaxaccum.compiled_memory(jaxaccum.value_and_grad(deep_loss, k), params, batch)
  theirs = jaxaccum.compiled_memory(hand_scan, params, batch)
  chex.assert_trees_all_close(
    jax.jit(jaxaccum.value_and_grad(deep_loss, k))(params, batch),
    jax.jit(hand_scan)(params, batch),
    rtol=1e-6,
  )
  assert ours.peak_bytes <= 1.01 * theirs.peak_bytes, (ours, theirs)


def counting_builder(calls):
  """A step builder that records each k it is asked to build."""

  def build(num_micro_batches):
    calls.append(num_micro_batches)
    return jax.jit(jaxaccum.value_and_grad(deep_loss, num_micro_batches))

  return build


def test_default_candidates_are_the_powers_of_two_that_divide_the_batch():
  params, batch = deep_problem(batch=96)
  plan = jaxaccum.plan_micro_batches(
    deep_loss, abstract((params, batch)), memory_limit_bytes=10**12, print_fn=None
  )
  assert plan.num_micro_batches == 1
  assert {row.num_micro_batches for row in plan.table} <= {1, 2, 4, 8, 16, 32}


def test_the_planner_bisects_and_agrees_with_trying_every_candidate():
  """Peak memory falls as k grows, so the planner bisects: ceil(log2 n) + 1
  compiles for n candidates, and the same answer as compiling them all."""
  params, batch = deep_problem()
  args = abstract((params, batch))
  every = [peak(k) for k in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)]
  budget = (every[3] + every[4]) // 2  # k = 16 is the first that fits
  calls = []
  plan = jaxaccum.plan_micro_batches(
    counting_builder(calls),
    args,
    memory_limit_bytes=budget,
    step_batch_argnum=1,
    print_fn=None,
  )
  assert plan.num_micro_batches == 16
  assert len(calls) <= int(np.ceil(np.log2(10))) + 1, calls
  assert len(set(calls)) == len(calls), "each candidate compiles at most once"
  assert [row.num_micro_batches for row in plan.table] == sorted(calls)


def test_the_planner_prints_one_line_per_compile():
  params, batch = deep_problem()
  lines = []
  plan = jaxaccum.plan_micro_batches(
    deep_loss,
    abstract((params, batch)),
    memory_limit_bytes=10**12,
    candidates=[1, 4],
    print_fn=lines.append,
  )
  assert plan.num_micro_batches == 1
  assert len(lines) == len(plan.table) >= 1
  assert re.match(
    r"^plan_micro_batches: k=1 peak=[\d.]+ [KMG]?i?B \(fits\) compiled in [\d.]+ s$",
    lines[0],
  ), lines


def test_plan_with_an_hsdp_tuple_of_data_axes():
  """data_axis=("replica", "fsdp") raised a raw KeyError in the planner while
  value_and_grad accepts it."""
  params, batch = deep_problem(batch=64)
  mesh = jax.make_mesh((2, 4), ("replica", "fsdp"))
  plan = jaxaccum.plan_micro_batches(
    deep_loss,
    abstract((params, batch)),
    memory_limit_bytes=10**9,
    candidates=[1, 8],
    mesh=mesh,
    data_axis=("replica", "fsdp"),
    print_fn=None,
  )
  assert plan.table[0].micro_batch_size == 8  # 64 rows on 8 devices, k = 1
