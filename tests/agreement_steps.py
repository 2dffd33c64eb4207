"""The steps whose decisions every device must take alike, and their checks.

Shared by ``tests/test_agreement.py`` (one process, 8 devices) and
``tests/multihost_worker.py`` (2 processes x 4 devices). Each check feeds a
batch whose non-finite rows sit on some devices only, and reads every
device's copy of the results: a replicated value must be bitwise the same
on all of them.

``make_batch(x, y)`` turns host arrays of the global batch into arrays
sharded over the mesh's data axis (``device_put`` in one process,
``make_array_from_process_local_data`` in several).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxaccum

DIM = 4
ROWS_PER_DEVICE = 4


def loss(w, batch):
  x, y = batch
  return jnp.mean((x @ w - y) ** 2)


def host_batch(devices: int, seed: int, bad_devices=()) -> tuple[np.ndarray, ...]:
  """A global batch of ``ROWS_PER_DEVICE`` rows per device, NaN in the
  rows of ``bad_devices`` (positions along the data axis)."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(devices * ROWS_PER_DEVICE, DIM)).astype(np.float32)
  y = (x @ np.linspace(-1.0, 1.0, DIM)).astype(np.float32)
  for d in bad_devices:
    x[d * ROWS_PER_DEVICE : (d + 1) * ROWS_PER_DEVICE] = np.nan
  return x, y


def copies(x: jax.Array) -> list[bytes]:
  """The bytes of every addressable device's copy of ``x``."""
  return [np.asarray(s.data).tobytes() for s in x.addressable_shards]


def agreed(tree: Any) -> bool:
  """Every device holds the same bytes of every (replicated) leaf."""
  return all(len(set(copies(x))) == 1 for x in jax.tree.leaves(tree))


def digest(tree: Any) -> str:
  """A hash of this process's copy of every (replicated) leaf: equal
  across processes when every device of every process agrees."""
  h = hashlib.sha256()
  for x in jax.tree.leaves(tree):
    h.update(copies(x)[0])
  return h.hexdigest()


def replicated(mesh, tree):
  return jax.device_put(
    tree, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  )


def skipped_train_step(mesh, make_batch: Callable, bad_devices) -> dict:
  """``make_train_step`` on a batch that is NaN on ``bad_devices`` only:
  every device skips, the parameters stay as they were and stay the same on
  every device; then a clean step moves them, alike everywhere."""
  devices = mesh.shape["data"]
  tx = optax.adam(0.1)
  w = replicated(mesh, jnp.linspace(0.5, -0.5, DIM))
  state = replicated(mesh, tx.init(w))
  step = jaxaccum.make_train_step(
    loss, tx, 2, mesh=mesh, data_axis="data", donate=False
  )
  with jax.set_mesh(mesh):
    bad_w, bad_state, bad_value = step(
      w, state, make_batch(*host_batch(devices, 0, bad_devices))
    )
    new_w, new_state, _ = step(w, state, make_batch(*host_batch(devices, 1)))
  return {
    "skipped_value_is_nan": bool(np.isnan(np.asarray(bad_value))),
    "skipped_params_unchanged": copies(bad_w) == copies(w),
    "skipped_state_unchanged": all(
      copies(a) == copies(b)
      for a, b in zip(jax.tree.leaves(bad_state), jax.tree.leaves(state), strict=True)
    ),
    "skipped_agreed": agreed((bad_w, bad_state, bad_value)),
    "clean_moved": copies(new_w) != copies(w),
    "clean_agreed": agreed((new_w, new_state)),
    "digest": digest((bad_w, bad_state, new_w, new_state)),
  }


def dropped_micro_batch(mesh, make_batch: Callable, bad_devices) -> dict:
  """``accumulate(inner, 2)`` fed a clean micro-batch, one that is NaN on
  ``bad_devices`` only, then a clean one: every device drops the same one,
  and the window of two calls ends on the second with the one it kept."""
  devices = mesh.shape["data"]
  grad_fn = jaxaccum.grad(loss, 1, mesh=mesh, data_axis="data")
  tx = jaxaccum.accumulate(optax.sgd(0.1), 2)
  w = replicated(mesh, jnp.linspace(0.5, -0.5, DIM))
  state = replicated(mesh, tx.init(w))

  @jax.jit
  def call(state, batch):
    return tx.update(grad_fn(w, batch), state, w)

  updated, skipped = [], []
  with jax.set_mesh(mesh):
    for seed, bad in ((2, ()), (3, bad_devices), (4, ())):
      updates, state = call(state, make_batch(*host_batch(devices, seed, bad)))
      updated.append(agreed(state) and bool(jaxaccum.has_updated(state)))
      skipped.append(int(state.num_skipped))
  return {
    "updated_on_the_second_call_only": updated == [False, True, False],
    "skipped_counts": skipped,
    "state_agreed": agreed(state),
    "updates_agreed": agreed(updates),
    "updates_finite": bool(np.isfinite(np.asarray(updates)).all()),
    "digest": digest((state, updates)),
  }


def adjusted_loss_scale(mesh, make_batch: Callable, bad_devices) -> dict:
  """float16-style loss scaling through ``make_train_step``: a step that is
  non-finite on ``bad_devices`` only halves the scale on every device and
  leaves the parameters alone; a clean one keeps the scale."""
  devices = mesh.shape["data"]
  tx = jaxaccum.accumulate(
    optax.sgd(0.1), 1, loss_scale=jaxaccum.dynamic_loss_scale(2.0**10)
  )
  w = replicated(mesh, jnp.linspace(0.5, -0.5, DIM))
  state = replicated(mesh, tx.init(w))
  step = jaxaccum.make_train_step(
    loss, tx, 2, mesh=mesh, data_axis="data", donate=False
  )
  with jax.set_mesh(mesh):
    bad_w, bad_state, _ = step(
      w, state, make_batch(*host_batch(devices, 5, bad_devices))
    )
    good_w, good_state, _ = step(bad_w, bad_state, make_batch(*host_batch(devices, 6)))
  return {
    "scales": [float(bad_state.loss_scale.scale), float(good_state.loss_scale.scale)],
    "skipped_params_unchanged": copies(bad_w) == copies(w),
    "clean_moved": copies(good_w) != copies(bad_w),
    "agreed": agreed((bad_w, bad_state, good_w, good_state)),
    "digest": digest((bad_w, bad_state, good_w, good_state)),
  }


def autopilot_windows(mesh, make_batch: Callable, steps: int) -> dict:
  """``accumulate(inner, auto_k(...))`` for ``steps`` calls on noisy labels
  (a critical batch of a few micro-batches, so that the window grows): its
  length, ``has_updated`` and the parameters are the same on every device
  after each call."""
  devices = mesh.shape["data"]
  grad_fn = jaxaccum.grad(loss, 1, mesh=mesh, data_axis="data")
  tx = jaxaccum.accumulate(optax.sgd(1e-3), jaxaccum.auto_k(max_k=16, warmup=1))
  w = replicated(mesh, jnp.full(DIM, 0.2))
  state = replicated(mesh, tx.init(w))

  @jax.jit
  def call(w, state, batch):
    updates, state = tx.update(grad_fn(w, batch), state, w)
    return optax.apply_updates(w, updates), state

  disagreements, windows, trail = 0, set(), hashlib.sha256()
  rng = np.random.default_rng(7)
  with jax.set_mesh(mesh):
    for _ in range(steps):
      x = rng.normal(size=(devices * ROWS_PER_DEVICE, DIM)).astype(np.float32)
      y = (3.0 * rng.normal(size=x.shape[0])).astype(np.float32)
      w, state = call(w, state, make_batch(x, y))
      if not agreed((state.window_size, state.updated, w)):
        disagreements += 1
      windows.add(int(state.window_size))
      trail.update(digest((state.window_size, state.updated, w)).encode())
  return {
    "disagreements": disagreements,
    "windows": sorted(windows),
    "digest": trail.hexdigest(),
  }
