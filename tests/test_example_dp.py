"""examples/dp_digits.py runs, accounts and learns (tiny settings by default)."""

import numpy as np
import pytest
from examples_util import load_example

import jaxaccum


@pytest.mark.slow
def test_dp_digits_serves_every_draw_from_one_compiled_step(capsys):
  result = load_example("dp_digits").main(
    steps=4, expected_batch_size=64, num_micro_batches=2, hidden=16, progress=False
  )
  sizes = result["draw_sizes"]
  assert len(set(sizes.tolist())) > 1 and sizes.max() <= result["max_batch_size"]
  assert result["max_batch_size"] % 2 == 0 and result["traces"] == 1
  q = 64 / 1344
  assert result["epsilon"] == jaxaccum.dp_epsilon(q, 8.0, 4, 1e-5)
  assert result["epsilon"] < result["epsilon_rdp"]
  assert 0 <= result["accuracy_dp"] <= 1 and 0 <= result["accuracy_plain"] <= 1
  # Ghost clipping draws the same noise: the parameters agree to float32
  # rounding (a wrong norm or another key moves them by far more than 1e-5).
  assert result["ghost_difference"] <= 1e-5
  assert result["accuracy_ghost"] == result["accuracy_dp"]
  assert result["ghost_predictions_agree"] == 1.0
  out = capsys.readouterr().out
  assert f"epsilon = {result['epsilon']:.2f} at delta = 1e-05" in out
  assert f"(ghost clipping {result['accuracy_ghost']:.3f})" in out


@pytest.mark.slow  # the full run, as examples/README.md shows it
def test_dp_digits_learns_under_privacy_in_under_three_minutes():
  result = load_example("dp_digits").main(progress=False)
  assert result["epsilon"] == pytest.approx(6.23, abs=0.01)
  assert result["accuracy_plain"] > 0.95
  assert result["accuracy_dp"] > 0.85
  # Each step's ghost gradient is vmap's to float32 rounding (tests/test_ghost.py);
  # over 200 noisy steps the roundings compound (2.8e-5 measured, since ghost's
  # clipped sum is kept in float32 from its first pass).
  assert result["ghost_difference"] <= 1e-4
  assert abs(result["accuracy_ghost"] - result["accuracy_dp"]) <= 1 / 453
  assert np.mean(result["draw_sizes"]) == pytest.approx(1024, abs=10)
  assert result["seconds"] < 180
