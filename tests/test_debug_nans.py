"""Everything runs under ``jax_debug_nans`` (issue 12): users turn it on exactly
when they hunt NaNs, so no jaxaccum state may hold a NaN they did not put
there, and no jaxaccum computation may make one from clean inputs. The flag
reports any NaN that any operation produces, even one selected by
``jnp.where`` or written as a constant; run eagerly, even in a masked-out
``jnp.where`` branch (``jnp.where(w > 0, x / w, 0)`` at ``w = 0``).
"""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jaxaccum

K, M, F = 2, 4, 3


@pytest.fixture(autouse=True)
def debug_nans():
  with jax.debug_nans(True):
    yield


def test_the_flag_reports_a_nan_made_inside_jaxaccum():
  """The fixture works: a NaN made from clean inputs raises."""
  with pytest.raises(FloatingPointError):
    jnp.zeros(()) / jnp.zeros(())


def loss(w, batch):
  x, y = batch
  return jnp.mean((x @ w["a"] + w["b"] - y) ** 2)


def params():
  return {"a": jnp.linspace(-1.0, 1.0, F), "b": jnp.array(0.1)}


def stream(n, seed=0):
  keys = jax.random.split(jax.random.key(seed), 2)
  x = jax.random.normal(keys[0], (n, M, F))
  y = jax.random.normal(keys[1], (n, M))
  return [(x[i], y[i]) for i in range(n)]


def no_nan(tree):
  for leaf in jax.tree.leaves(tree):
    assert not jnp.any(jnp.isnan(leaf))


@pytest.mark.parametrize("noise_stats", [False, True])
def test_accumulate_init_holds_no_nan(noise_stats):
  """The issue's reproducer: the noise fields started as NaN."""
  tx = jaxaccum.accumulate(optax.adam(1e-3), 2, noise_stats=noise_stats)
  no_nan(tx.init(params()))


CASES = {
  "plain": {},
  "noise_stats": {"noise_stats": True},
  "weight": {"noise_stats": True, "weight": True},
  "flush": {"noise_stats": True, "flush": True},
  "loss_scale": {"noise_stats": True, "loss_scale": True},
  "every_k=1": {"noise_stats": True, "every_k": 1},
}


@pytest.mark.slow
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", CASES)
def test_accumulate_windows_and_the_noise_tracker(case, jit):
  """Two and a half windows; the tracker and its estimate are read after
  every call, also before the first window ends."""
  opts = CASES[case]
  loss_scale = jaxaccum.dynamic_loss_scale(2.0**4) if opts.get("loss_scale") else None
  tx = jaxaccum.accumulate(
    optax.adam(1e-2),
    opts.get("every_k", K),
    noise_stats=opts.get("noise_stats", False),
    loss_scale=loss_scale,
  )
  w = params()
  state = tx.init(w)
  tracker = jaxaccum.noise_scale_init()
  no_nan((state, tracker, jaxaccum.critical_batch_size(tracker)))
  update = jax.jit(tx.update) if jit else tx.update
  batches = stream(2 * K + 1)
  for i, batch in enumerate(batches):
    kwargs = {}
    if opts.get("weight"):
      kwargs["weight"] = jnp.asarray(i % 3, jnp.float32)  # 0, 1, 2, 0, 1
    if opts.get("flush"):
      kwargs["flush"] = i == 0  # a window of one micro-batch
    if loss_scale is None:
      grads = jax.grad(loss)(w, batch)
    else:
      scale = state.loss_scale

      def scaled(w, batch, scale=scale):
        return scale.scale_loss(loss(w, batch))

      grads = jax.grad(scaled)(w, batch)
    updates, state = update(grads, state, w, **kwargs)
    w = optax.apply_updates(w, updates)
    tracker = jaxaccum.noise_scale_update(tracker, state.noise.last)
    out = (
      updates,
      w,
      state,
      tracker,
      jaxaccum.critical_batch_size(tracker),
      state.noise.last.trace(),
      state.noise.last.sq_norm(),
    )
    no_nan(out)
  assert int(state.step) >= 2


def test_noise_functions_on_measurements_without_an_estimate():
  """One micro-batch (b_small == b_big) and accumulate()'s empty
  measurement before its first window hold no estimate: no NaN either."""
  one = jaxaccum.GradientNoise(*(jnp.asarray(v) for v in (2.0, 2.0, 4.0, 4.0)))
  empty = jaxaccum.accumulate(optax.sgd(0.1), 2, noise_stats=True)
  empty = empty.init(params()).noise.last
  tracker = jaxaccum.noise_scale_init()
  for noise in (one, empty):
    no_nan((noise.trace(), noise.sq_norm()))
    tracker = jaxaccum.noise_scale_update(tracker, noise)
    assert int(tracker.num_updates) == 0
    no_nan((tracker, jaxaccum.critical_batch_size(tracker)))


def test_estimate_with_a_vanishing_gradient():
  """EMA(|G|²) = 0 after an update: the documented infinity, no 0/0."""
  noise = jaxaccum.GradientNoise(*(jnp.asarray(v) for v in (1.0, 0.25, 1.0, 4.0)))
  tracker = jaxaccum.noise_scale_update(jaxaccum.noise_scale_init(), noise)
  assert float(tracker.sq_norm) == 0.0 and int(tracker.num_updates) == 1
  assert float(jaxaccum.critical_batch_size(tracker)) == jnp.inf


# The engine paths (the lead's modules), at k = 1 (no loop) and k = 2.
def big_batch(k):
  batches = stream(k)
  return tuple(jnp.concatenate([b[i] for b in batches]) for i in range(2))


def check_noise(noise):
  no_nan((noise, noise.trace(), noise.sq_norm()))
  tracker = jaxaccum.noise_scale_update(jaxaccum.noise_scale_init(), noise)
  no_nan((tracker, jaxaccum.critical_batch_size(tracker)))


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2])
def test_value_and_grad(k):
  batch = big_batch(k)
  value, grads = jaxaccum.value_and_grad(loss, k)(params(), batch)
  no_nan((value, grads))
  chex.assert_trees_all_close(grads, jax.grad(loss)(params(), batch), rtol=1e-5)
  if k == 1:
    return  # one micro-batch has no noise to measure (an error, tested elsewhere)
  (value, grads), noise = jaxaccum.value_and_grad(loss, k, noise_stats=True)(
    params(), batch
  )
  no_nan((value, grads))
  check_noise(noise)


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2])
def test_make_train_step(k):
  tx = jaxaccum.accumulate(optax.adam(1e-2), 1, noise_stats=True)
  step = jaxaccum.make_train_step(loss, tx, k, noise_stats=k > 1)
  w, state = params(), tx.init(params())
  for _ in range(2):
    w, state, out = step(w, state, big_batch(k))
    value, noise = out if k > 1 else (out, None)
    no_nan((w, state, value))
    if noise is not None:
      check_noise(noise)
    check_noise(state.noise.last)
  assert int(state.step) == 2


class Model(nnx.Module):
  def __init__(self, rngs):
    self.linear = nnx.Linear(F, 1, rngs=rngs)

  def __call__(self, x):
    return self.linear(x)[:, 0]


@pytest.mark.parametrize("k", [1, 2])
def test_nnx_value_and_grad(k):
  model = Model(nnx.Rngs(0))
  x, y = big_batch(k)

  def model_loss(model, batch):
    xs, ys = batch
    return jnp.mean((model(xs) - ys) ** 2)

  (value, grads), noise = (
    jaxaccum.nnx.value_and_grad(model_loss, k, noise_stats=k > 1)(model, (x, y))
    if k > 1
    else (
      jaxaccum.nnx.value_and_grad(model_loss, k)(model, (x, y)),
      None,
    )
  )
  no_nan((value, grads))
  if noise is not None:
    check_noise(noise)
