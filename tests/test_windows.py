"""Windows that end early (epoch ends) and windows that survive a restart."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jaxaccum

M, F = 4, 3


def loss(w, batch):
  x, y = batch
  return jnp.mean((jnp.tanh(x @ w["a"]) + w["b"] - y) ** 2)


def stream(n, seed=0):
  keys = jax.random.split(jax.random.key(seed), 2)
  x = jax.random.normal(keys[0], (n, M, F))
  y = jax.random.normal(keys[1], (n, M))
  return [(x[i], y[i]) for i in range(n)]


def init_params():
  return {"a": jnp.linspace(-1.0, 1.0, F), "b": jnp.array(0.1)}


@pytest.mark.slow
def test_flush_ends_an_incomplete_window_at_epoch_end():
  """10 micro-batches, every_k=4: updates after 4, 8, and 10 (over 2)."""
  batches = stream(10)
  inner = optax.adam(0.05)
  tx = jaxaccum.accumulate(inner, 4)
  params, state = init_params(), tx.init(init_params())
  update = jax.jit(tx.update)
  applied = []
  for i, batch in enumerate(batches):
    grads = jax.grad(loss)(params, batch)
    updates, new_state = update(grads, state, params, flush=i == len(batches) - 1)
    applied.append(int(new_state.step) > int(state.step))
    params, state = optax.apply_updates(params, updates), new_state
  assert [i + 1 for i, a in enumerate(applied) if a] == [4, 8, 10]
  assert int(state.micro_step) == 0

  # Reference: three in-step accumulated steps over 4, 4 and 2 micro-batches.
  ref, ref_state = init_params(), inner.init(init_params())
  for window in (batches[0:4], batches[4:8], batches[8:10]):
    x = jnp.concatenate([b[0] for b in window])
    y = jnp.concatenate([b[1] for b in window])
    grads = jaxaccum.grad(loss, len(window))(ref, (x, y))
    updates, ref_state = inner.update(grads, ref_state, ref)
    ref = optax.apply_updates(ref, updates)
  chex.assert_trees_all_close(params, ref, rtol=1e-5, atol=1e-6)


def run(tx, params, state, batches):
  update = jax.jit(tx.update)
  for batch in batches:
    updates, state = update(jax.grad(loss)(params, batch), state, params)
    params = optax.apply_updates(params, updates)
  return params, state


@pytest.mark.slow
def test_resume_mid_window_from_an_orbax_checkpoint_is_bit_identical(tmp_path):
  batches = stream(16, seed=3)
  tx = jaxaccum.accumulate(optax.adam(0.05), 8, noise_stats=True)

  uninterrupted = run(tx, init_params(), tx.init(init_params()), batches)

  # Stop after micro-step 3 of the first window of 8, and save.
  params, state = run(tx, init_params(), tx.init(init_params()), batches[:3])
  assert int(state.micro_step) == 3
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "ckpt", {"params": params, "opt_state": state})
  checkpointer.wait_until_finished()

  # A fresh process would rebuild the structure from init, then restore.
  fresh = {"params": init_params(), "opt_state": tx.init(init_params())}
  restored = checkpointer.restore(
    tmp_path / "ckpt", jax.tree.map(ocp.utils.to_shape_dtype_struct, fresh)
  )
  assert isinstance(restored["opt_state"], jaxaccum.AccumulateState)
  assert int(restored["opt_state"].micro_step) == 3

  resumed = run(tx, restored["params"], restored["opt_state"], batches[3:])
  for got, want in zip(
    jax.tree.leaves(resumed), jax.tree.leaves(uninterrupted), strict=True
  ):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
