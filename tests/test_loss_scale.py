"""float16 with dynamic loss scaling: adjusted per window, overflowing windows skipped."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxaccum

K, M, F = 4, 8, 3


def loss(w, batch):
  x, y = batch
  return jnp.mean((x @ w - y) ** 2)


def data(seed=0):
  keys = jax.random.split(jax.random.key(seed), 2)
  x = jax.random.normal(keys[0], (3 * K, M, F))
  return x, x @ jnp.array([1.0, -2.0, 0.5]) + 0.1 * jax.random.normal(
    keys[1], (3 * K, M)
  )


def scaled_fp16_grad(w32, batch, scale):
  """The gradient of the scaled loss, computed in float16 as a model would."""
  w16 = w32.astype(jnp.float16)
  x, y = (a.astype(jnp.float16) for a in batch)
  return jax.grad(lambda w: scale.scale_loss(loss(w, (x, y))))(w16)


def test_overflowing_window_is_skipped_and_scale_adjusted_once_per_window():
  x, y = data()
  tx = jaxaccum.accumulate(
    optax.sgd(0.01),
    K,
    loss_scale=jaxaccum.dynamic_loss_scale(2.0**10, growth_interval=2),
  )
  params = jnp.zeros(F, jnp.float32)  # float32 master weights
  state = tx.init(params)
  update = jax.jit(tx.update)
  scales, steps, history = [], [], []
  for i in range(3 * K):
    grads = scaled_fp16_grad(params, (x[i], y[i]), state.loss_scale)
    if i == K + 1:  # window 2, micro-batch 2: an fp16 overflow
      grads = grads.at[0].set(jnp.inf)
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
    assert np.all(np.isfinite(params)) and np.all(np.isfinite(state.acc_grads))
    scales.append(float(state.loss_scale.scale))
    steps.append(int(state.step))
    history.append(np.asarray(params))

  # The scale changes only when a window ends (calls 4, 8, 12).
  assert scales == [1024.0] * 3 + [1024.0] * 4 + [512.0] * 4 + [512.0]
  # Window 1 applied; window 2 overflowed and was skipped whole; window 3 applied.
  assert steps == [0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2]
  np.testing.assert_array_equal(history[7], history[3])
  assert int(state.num_skipped) == 1


def test_scale_grows_after_growth_interval_clean_windows():
  x, y = data()
  tx = jaxaccum.accumulate(
    optax.sgd(0.01), 2, loss_scale=jaxaccum.dynamic_loss_scale(4.0, growth_interval=2)
  )
  params = jnp.zeros(F)
  state = tx.init(params)
  for i in range(8):
    grads = scaled_fp16_grad(params, (x[i], y[i]), state.loss_scale)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  # 4 clean windows, growth every 2: 4 -> 8 -> 16.
  assert float(state.loss_scale.scale) == 16.0


def test_loss_scaled_fp16_matches_float32_accumulation():
  x, y = data()
  scaled = jaxaccum.accumulate(
    optax.sgd(0.05), K, loss_scale=jaxaccum.dynamic_loss_scale(2.0**8)
  )
  plain = jaxaccum.accumulate(optax.sgd(0.05), K)
  p1 = p2 = jnp.zeros(F)
  s1, s2 = scaled.init(p1), plain.init(p2)
  for i in range(2 * K):
    u1, s1 = scaled.update(scaled_fp16_grad(p1, (x[i], y[i]), s1.loss_scale), s1, p1)
    u2, s2 = plain.update(jax.grad(loss)(p2, (x[i], y[i])), s2, p2)
    p1, p2 = optax.apply_updates(p1, u1), optax.apply_updates(p2, u2)
  # float16 forward/backward, float32 everything else: close to float32.
  np.testing.assert_allclose(p1, p2, rtol=5e-3, atol=1e-3)


def test_small_gradients_survive_thanks_to_the_scale():
  """Without scaling this gradient underflows to zero in float16."""
  w = jnp.ones(F)
  x = jnp.full((M, F), 3e-5)
  y = jnp.zeros(M)
  tiny = jax.grad(loss)(
    w.astype(jnp.float16), (x.astype(jnp.float16), y.astype(jnp.float16))
  )
  assert not np.any(tiny)  # underflowed
  scale = jaxaccum.dynamic_loss_scale(2.0**15)
  grads = scale.unscale(scaled_fp16_grad(w, (x, y), scale))
  np.testing.assert_allclose(grads, jax.grad(loss)(w, (x, y)), rtol=2e-2)


def test_small_gradients_reach_the_inner_optimizer_unscaled_in_float32():
  """accumulate() unscales in float32, and the inner optimizer must get that
  float32 mean: cast back to the gradients' float16 it would underflow again,
  as if there were no scale."""
  w = jnp.ones(F)  # float32 master weights
  x = jnp.full((M, F), 3e-5)
  y = jnp.zeros(M)
  exact = jax.grad(loss)(w, (x, y))  # about 5e-9: zero in float16
  assert not np.any(exact.astype(jnp.float16))
  tx = jaxaccum.accumulate(
    optax.sgd(1.0), 2, loss_scale=jaxaccum.dynamic_loss_scale(2.0**15)
  )
  state = tx.init(w)
  for _ in range(2):
    grads = scaled_fp16_grad(w, (x, y), state.loss_scale)
    assert grads.dtype == jnp.float16 and np.all(grads)
    updates, state = tx.update(grads, state, w)
  assert updates.dtype == jnp.float32  # sgd on float32 gradients
  np.testing.assert_allclose(updates, -exact, rtol=2e-2)


@pytest.mark.parametrize("chained", [False, True])
def test_make_train_step_with_loss_scale_skips_overflow(chained):
  x, y = data()
  tx = jaxaccum.accumulate(
    optax.sgd(0.05), 1, loss_scale=jaxaccum.dynamic_loss_scale(2.0**4)
  )
  if chained:  # the step finds the loss scale inside the chain's state
    tx = optax.chain(tx, optax.scale(1.0))
  accumulated = (lambda state: state[0]) if chained else (lambda state: state)

  def fp16_loss(w, batch):
    xb, yb = batch
    return loss(w.astype(jnp.float16), (xb.astype(jnp.float16), yb.astype(jnp.float16)))

  step = jaxaccum.make_train_step(fp16_loss, tx, 2)  # donated
  params = jnp.zeros(F)
  state = tx.init(params)
  batch = (x[:2].reshape(-1, F), y[:2].reshape(-1))
  params, state, value = step(params, state, batch)
  assert value.dtype == jnp.float32
  np.testing.assert_allclose(value, loss(jnp.zeros(F), batch), rtol=1e-2)
  assert int(accumulated(state).step) == 1
  # A batch that overflows float16 (x = 1e4: squares exceed 65504).
  huge = (jnp.full_like(batch[0], 1e4), batch[1])
  before = np.asarray(params)  # params are donated to the step
  new_params, state, _ = step(params, state, huge)
  np.testing.assert_array_equal(new_params, before)
  assert int(accumulated(state).step) == 1
  assert float(accumulated(state).loss_scale.scale) == 8.0


def test_bad_loss_scale_arguments():
  with pytest.raises(ValueError, match="factor"):
    jaxaccum.dynamic_loss_scale(factor=1.0)


def test_without_loss_scale_state_has_none():
  state = jaxaccum.accumulate(optax.sgd(0.1), 2).init(jnp.zeros(2))
  assert state.loss_scale is None
  chex.assert_shape(state.window_finite, ())


def test_scales_beyond_float16_range_with_a_float32_loss():
  """The scale may exceed 65504 when the loss is reduced in float32, as in AMP."""
  x, y = data()

  def amp_loss(w, batch):
    xb, yb = batch
    pred = xb.astype(jnp.float16) @ w.astype(jnp.float16)  # float16 compute
    return jnp.mean((pred.astype(jnp.float32) - yb) ** 2)  # float32 reduction

  tx = jaxaccum.accumulate(
    optax.sgd(0.05), 1, loss_scale=jaxaccum.dynamic_loss_scale(2.0**17)
  )
  step = jaxaccum.make_train_step(amp_loss, tx, 2)
  # Near the optimum the true gradient is ~0.03, so 2**17 times it fits
  # float16; the scale itself (131072) does not, and never enters float16.
  params = jnp.array([1.0, -2.0, 0.5])
  batch = (x.reshape(-1, F), y.reshape(-1))
  params, state, value = step(params, tx.init(params), batch)
  assert int(state.num_skipped) == 0 and int(state.step) == 1
  assert np.isfinite(value) and np.all(np.isfinite(params))


def test_accumulate_state_can_be_donated():
  """Every state field owns its buffer, so make_train_step may donate it."""
  state = jaxaccum.accumulate(
    optax.adam(0.1), 2, loss_scale=jaxaccum.dynamic_loss_scale()
  ).init(jnp.zeros(2))
  buffers = [leaf.unsafe_buffer_pointer() for leaf in jax.tree.leaves(state)]
  assert len(set(buffers)) == len(buffers)


def test_train_step_noise_is_in_unscaled_units():
  x, y = data()
  batch = (x[:2].reshape(-1, F), y[:2].reshape(-1))
  params = jnp.array([1.0, -2.0, 0.5])
  plain = jaxaccum.make_train_step(
    loss, optax.sgd(0.05), 4, noise_stats=True, donate=False
  )
  _, _, (_, want) = plain(params, optax.sgd(0.05).init(params), batch)
  tx = jaxaccum.accumulate(
    optax.sgd(0.05), 1, loss_scale=jaxaccum.dynamic_loss_scale(2.0**10)
  )
  scaled = jaxaccum.make_train_step(loss, tx, 4, noise_stats=True, donate=False)
  _, _, (_, noise) = scaled(params, tx.init(params), batch)
  chex.assert_trees_all_close(noise, want, rtol=1e-5)


def test_train_step_loss_scale_must_see_every_gradient_first():
  x, y = data()
  batch = (x[:2].reshape(-1, F), y[:2].reshape(-1))
  params = {"a": jnp.ones(F), "b": jnp.ones(F)}

  def two_part_loss(p, batch):
    return loss(p["a"], batch) + loss(p["b"], batch)

  scaled = jaxaccum.accumulate(
    optax.sgd(0.05), 1, loss_scale=jaxaccum.dynamic_loss_scale(2.0**10)
  )
  # Found through inject_hyperparams around the chain:
  ok = optax.inject_hyperparams(lambda lr: optax.chain(scaled, optax.scale(lr)))(lr=1.0)
  step = jaxaccum.make_train_step(two_part_loss, ok, 2, donate=False)
  new, _, _ = step(params, ok.init(params), batch)
  grads = jax.grad(two_part_loss)(params, batch)
  chex.assert_trees_all_close(
    new, jax.tree.map(lambda p, g: p - 0.05 * g, params, grads), rtol=1e-5
  )
  # Refused where other gradients would skip the unscaling:
  for bad in (
    optax.multi_transform({"s": scaled, "p": optax.sgd(0.05)}, {"a": "s", "b": "p"}),
    optax.masked(scaled, {"a": True, "b": False}),
    optax.chain(optax.clip_by_global_norm(1.0), scaled),
  ):
    step = jaxaccum.make_train_step(two_part_loss, bad, 2, donate=False)
    with pytest.raises(ValueError, match="must see every gradient first"):
      step(params, bad.init(params), batch)
