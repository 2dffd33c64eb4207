"""The noise-scale and mixed-precision examples train and show what they claim;
the convnet example's step equals a Python loop over its micro-batches.

Each example is imported by path and its ``main`` run with tiny settings, no
progress bar and ``out_dir=tmp_path``.
"""

import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from examples_util import load_example

CHANCE = 0.1  # ten digit classes


@pytest.mark.slow
def test_noise_scale_tracks_a_finite_positive_b_simple(tmp_path):
  steps = 40
  result = load_example("noise_scale").main(
    steps=steps,
    num_micro_batches=4,
    micro_batch_size=16,
    out_dir=str(tmp_path),
    progress=False,
  )
  assert result["batch_size"] == 64 and result["micro_batch_size"] == 16
  b_simple, losses = result["b_simple"], result["losses"]
  assert b_simple.shape == losses.shape == (steps,)
  assert np.all(np.isfinite(b_simple)) and np.all(b_simple > 0)
  # After one update the ratio of the averages is that step's raw ratio.
  assert b_simple[0] == pytest.approx(
    result["trace"][0] / result["sq_norm"][0], rel=1e-4
  )
  assert result["final_b_simple"] == pytest.approx(b_simple[-1])
  assert np.mean(losses[-5:]) < 0.5 * losses[0]
  assert result["final_loss"] == pytest.approx(losses[-1])
  assert result["accuracy"] > 5 * CHANCE
  assert result["params_finite"]
  assert pathlib.Path(result["png"]).is_file()


def test_noise_scale_needs_two_micro_batches(tmp_path):
  with pytest.raises(ValueError, match="num_micro_batches >= 2"):
    load_example("noise_scale").main(
      steps=1, num_micro_batches=1, out_dir=str(tmp_path), progress=False
    )


@pytest.mark.slow  # main() end to end
def test_mixed_precision_bf16_and_loss_scaled_fp16_train(tmp_path):
  steps = 30
  # A start far above what float16 holds: the first steps overflow and back off.
  result = load_example("mixed_precision").main(
    steps_bf16=steps,
    steps_fp16=steps,
    compare_ks=(8,),
    initial_scale=2.0**24,
    growth_interval=10,
    out_dir=str(tmp_path),
    progress=False,
  )
  module = load_example("mixed_precision")

  # (a) float32 accumulation of bf16 gradients: within bf16 tolerance of a
  # float32 reference and exact up to float32 rounding; a bf16 sum is not.
  (row,) = result["grad_check"]
  assert row["k"] == 8
  assert row["jaxaccum_vs_f32"] < 2 * module.BF16_EPS
  assert row["jaxaccum_vs_exact"] < 1e-5
  assert row["bf16_sum_vs_exact"] > 1e-4
  assert result["master_dtype"] == "float32"
  losses = result["losses_bf16"]
  assert losses.shape == (steps,) and np.all(np.isfinite(losses))
  assert np.mean(losses[-5:]) < 0.5 * losses[0]
  assert result["final_loss_bf16"] == pytest.approx(losses[-1])
  assert result["accuracy_bf16"] > 5 * CHANCE

  # (b) float16 with dynamic loss scaling.
  scales = result["loss_scale_history"]
  assert scales.shape == (steps,)
  assert scales[0] == 2.0**24 and np.min(scales) < 2.0**24
  skipped = result["skipped_steps"]
  assert skipped and skipped[0] == 0  # 2^24 overflows float16 at once
  assert result["num_skipped"] == len(skipped)
  for s in skipped:  # each overflow halves the scale, once
    if s + 1 < steps:
      assert scales[s + 1] == scales[s] / 2
  assert result["final_loss_scale"] > 0
  assert result["params_finite"]
  losses = result["losses_fp16"]
  finite = losses[np.isfinite(losses)]
  assert np.mean(finite[-5:]) < 0.5 * finite[0]
  assert result["accuracy_fp16"] > 5 * CHANCE
  assert 0 <= result["underflow_scaled"] <= result["underflow_unscaled"] <= 1
  assert pathlib.Path(result["png"]).is_file()


def capture_gradients():
  """An "optimizer" whose state is the last gradient it got and whose updates
  are zeros: the example's own jitted step then hands its gradients back."""
  return optax.GradientTransformation(
    lambda params: jax.tree.map(jnp.zeros_like, params),
    lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads),
  )


@pytest.mark.slow
def test_convnet_batchnorm_step_equals_a_python_loop_over_micro_batches():
  """examples/convnet_batchnorm.py's ``train_step`` (its model, its loss, its
  ``rng_argnum`` and ``state_argnum``) against an eager Python loop of
  ``jax.value_and_grad``: micro-batch ``i`` holds rows ``i*m .. (i+1)*m - 1``,
  gets the key ``fold_in(fold_in(key, step), i)`` and the running statistics
  micro-batch ``i - 1`` wrote."""
  module = load_example("convnet_batchnorm")
  model = module.ConvNet()
  k, m, step = 4, 4, 3
  keys = jax.random.split(jax.random.key(0), 4)
  images = jax.random.uniform(keys[0], (k * m, 8, 8, 1))
  labels = jax.random.randint(keys[1], (k * m,), 0, 10)
  variables = model.init(keys[2], images[:1], train=False)
  params = variables["params"]
  # Running statistics away from their initial values, so that the momentum
  # update shows in every entry.
  batch_stats = jax.tree.map(lambda s: s + 0.5, variables["batch_stats"])
  tx = capture_gradients()
  state = module.TrainState(
    jnp.asarray(step, jnp.int32), params, batch_stats, tx.init(params)
  )
  new_state, loss, accuracy = module.make_train_step(model, tx, k)(
    state, (images, labels), keys[3]
  )

  def loss_fn(params, images, labels, dropout_key, batch_stats):
    logits, updates = model.apply(
      {"params": params, "batch_stats": batch_stats},
      images,
      train=True,
      rngs={"dropout": dropout_key},
      mutable=["batch_stats"],
    )
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    accuracy = jnp.mean(jnp.argmax(logits, axis=-1) == labels)
    return loss, (accuracy, updates["batch_stats"])

  # Compiled once and called k times, in a Python loop.
  micro_value_and_grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
  step_key = jax.random.fold_in(keys[3], step)
  stats, losses, accuracies, grads = batch_stats, [], [], []
  for i in range(k):
    rows = slice(i * m, (i + 1) * m)
    (value, (acc, stats)), g = micro_value_and_grad(
      params, images[rows], labels[rows], jax.random.fold_in(step_key, i), stats
    )
    losses.append(value)
    accuracies.append(acc)
    grads.append(g)
  want_grads = jax.tree.map(lambda *g: jnp.mean(jnp.stack(g), axis=0), *grads)

  chex.assert_trees_all_close(
    (loss, new_state.opt_state, new_state.batch_stats),
    (jnp.mean(jnp.stack(losses)), want_grads, stats),
    rtol=1e-5,
    atol=1e-6,
  )
  assert float(accuracy) == pytest.approx(float(jnp.mean(jnp.stack(accuracies))))
  chex.assert_trees_all_equal(new_state.params, params)  # zero updates
  assert int(new_state.step) == step + 1
