"""The noise-scale and mixed-precision examples train and show what they claim.

Each example is imported by path and its ``main`` run with tiny settings, no
progress bar and ``out_dir=tmp_path``.
"""

import pathlib

import numpy as np
import pytest
from examples_util import load_example

CHANCE = 0.1  # ten digit classes


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


def test_command_line_flags_come_from_main_signature(monkeypatch):
  """Every example's ``python examples/NAME.py --flag`` maps onto ``main``."""
  cli = load_example("_cli")

  def main(*, steps: int = 3, rate: float = 0.5, ks: tuple = (8, 64), progress=True):
    return steps, rate, ks, progress

  monkeypatch.setattr("sys.argv", ["x.py"])
  assert cli.command_line(main, "doc") == (3, 0.5, (8, 64), True)
  monkeypatch.setattr(
    "sys.argv", ["x.py", "--steps", "7", "--ks", "2", "4", "--no-progress"]
  )
  assert cli.command_line(main, "doc") == (7, 0.5, (2, 4), False)
  with pytest.raises(SystemExit):
    monkeypatch.setattr("sys.argv", ["x.py", "--stpes", "7"])
    cli.command_line(main, "doc")
