"""The digits examples run, learn, and show what they claim (tiny settings).

Each example is imported by path and its ``main`` run with few steps, no
progress bar and ``out_dir=tmp_path``.
"""

import pathlib

import numpy as np
import pytest
from examples_util import load_example

TRAIN_ROWS = load_example("_digits").TRAIN_ROWS


@pytest.mark.slow  # main() end to end
def test_digits_mlp_accumulated_curve_overlaps_full_batch(tmp_path):
  result = load_example("digits_mlp").main(
    steps=30, out_dir=str(tmp_path), progress=False
  )
  full, accum = result["losses_full"], result["losses_accum"]
  assert full.shape == accum.shape == (30,)
  assert full[-1] < 0.5 * full[0]
  np.testing.assert_allclose(accum, full, rtol=1e-5, atol=1e-6)
  assert result["max_curve_diff"] == pytest.approx(np.max(np.abs(full - accum)))
  assert result["max_curve_diff"] < 1e-5
  assert result["accuracy_full"] > 0.5
  # 1350 training rows (padded by 2 to split into 8), 447 test rows.
  assert result["padded_rows"] == 2
  assert abs(result["accuracy_accum"] - result["accuracy_full"]) <= 1 / 447
  assert result["train_accuracy_accum"] > 0.5
  assert pathlib.Path(result["png"]).is_file()


@pytest.mark.slow  # main() end to end
def test_convnet_batchnorm_linen_recipe_learns(tmp_path):
  result = load_example("convnet_batchnorm").main(
    steps=15, eval_every=15, out_dir=str(tmp_path), progress=False
  )
  losses = result["losses"]
  assert losses.shape == (15,)
  assert np.all(np.isfinite(losses))
  assert np.mean(losses[-3:]) < 0.5 * losses[0]
  assert result["test_accuracy"] > 0.5
  # The running averages moved away from their initial zeros, at the full
  # batch's momentum per step: 0.9 over the default 8 micro-batches.
  assert np.any(result["batch_stats_mean"] != 0)
  assert result["momentum"] ** 8 == pytest.approx(0.9, rel=1e-12)
  assert pathlib.Path(result["png"]).is_file()


@pytest.mark.slow  # main() end to end
def test_cross_step_adam_runs_once_per_window(tmp_path):
  example = load_example("cross_step")
  epochs, size, k = 2, 20, 8
  result = example.main(
    epochs=epochs,
    micro_batch_size=size,
    every_k=k,
    learning_rate=1e-2,
    out_dir=str(tmp_path),
    progress=False,
  )
  per_epoch = -(-TRAIN_ROWS // size)  # 68: 67 of 20 rows and one of 4
  micro_steps = epochs * per_epoch
  assert result["micro_steps"] == micro_steps
  assert result["update_calls"] == micro_steps  # nnx.Optimizer counts every call
  # Per epoch: 8 full windows, then the flushed window of the last 4.
  assert result["optimizer_steps"] == epochs * (per_epoch // k + 1)
  assert result["adam_count"] == result["optimizer_steps"]
  assert result["flushed_windows"] == epochs
  full, rest = [k] * (per_epoch // k), [per_epoch % k]
  np.testing.assert_array_equal(result["window_sizes"], (full + rest) * epochs)
  # The windows hold every row exactly once; the flushed one 3 * 20 + 4 rows.
  assert int(np.sum(result["window_rows"])) == epochs * TRAIN_ROWS
  assert result["window_rows"][per_epoch // k] == 64
  # The inner step grows by one on a window's last micro-batch, else not at all.
  steps = np.diff(result["inner_step_per_micro_step"], prepend=0)
  assert set(steps.tolist()) == {0, 1}
  ends = np.cumsum(result["window_sizes"]) - 1
  np.testing.assert_array_equal(np.flatnonzero(steps), ends)
  losses = result["losses"]
  assert losses[-1] < 0.5 * losses[0]
  assert result["test_accuracy"] > 0.5
  assert pathlib.Path(result["png"]).is_file()


@pytest.mark.slow
def test_cross_step_without_flush_steps_every_k_micro_batches(tmp_path):
  result = load_example("cross_step").main(
    epochs=1,
    micro_batch_size=16,
    flush_at_epoch_end=False,
    out_dir=str(tmp_path),
    progress=False,
  )
  # 84 micro-batches of 16: 10 windows of 8; the last 4 wait for more.
  assert result["micro_steps"] == 84
  assert result["optimizer_steps"] == result["micro_steps"] // 8
  assert result["adam_count"] == result["optimizer_steps"]
  assert result["update_calls"] == result["micro_steps"]
  assert result["flushed_windows"] == 0
  assert set(result["window_sizes"].tolist()) == {8}
