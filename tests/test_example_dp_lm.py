"""examples/dp_lm.py: a character transformer trained with DP-SGD (ghost
clipping, Poisson draws, k micro-batches, dp_noise) beside the same model
trained without privacy."""

import json
import math

import numpy as np
import pytest
from examples_util import load_example

import jaxaccum


def test_unigram_baseline_is_the_held_out_cross_entropy_of_train_frequencies():
  """The baseline the DP model must beat, against a count written here: ids
  1..3, PAD 0 never counted or predicted."""
  dp_lm = load_example("dp_lm")
  train = np.array([[1, 1, 2, 0], [1, 3, 1, 1]])  # targets: 1 2 0 | 3 1 1
  held = np.array([[2, 1, 3, 0]])  # targets: 1 3 (and a PAD)
  got = dp_lm.unigram(train, held, vocab_size=4)
  # Target counts 1: 3, 2: 1, 3: 1; add-one over the 3 real ids: 4/8, 2/8, 2/8.
  assert got["loss"] == pytest.approx(-(math.log(4 / 8) + math.log(2 / 8)) / 2)
  assert got["accuracy"] == 0.5  # always "1": right on the first target only


@pytest.mark.slow
def test_quick_run_accounts_checks_ghost_and_learns(tmp_path, capsys):
  dp_lm = load_example("dp_lm")
  path = tmp_path / "dp_lm.json"
  result = dp_lm.main(quick=True, progress=False, results=str(path))
  settings = result["settings"]
  assert {k: settings[k] for k in dp_lm.QUICK} == dp_lm.QUICK
  q = dp_lm.QUICK["expected_batch_size"] / result["train_sequences"]
  assert result["sampling_rate"] == pytest.approx(q)
  steps = dp_lm.QUICK["steps"]
  assert result["epsilon"] == jaxaccum.dp_epsilon(q, 1.0, steps, 1e-5)
  assert result["delta"] < 1 / result["train_sequences"]
  # Ghost clipping's clipped sum equals per-example clipping's (the script
  # raises past 1e-5; a wrong norm is off by far more).
  assert 0 <= result["ghost_check"] <= 1e-5
  held = result["held_out"]
  for run in ("dp", "plain"):
    assert math.isfinite(held[run]["loss"])
    assert held[run]["loss"] < held["initial"]["loss"]
  assert held["initial"]["loss"] == pytest.approx(math.log(104), rel=0.02)
  sizes = result["draw_sizes"]
  assert len(sizes) == steps and len(set(sizes.tolist())) > 1
  assert sizes.max() <= result["max_batch_size"]
  assert result["curve"]["step"][-1] == steps
  written = json.loads(path.read_text())
  assert written["epsilon"] == result["epsilon"]
  assert written["held_out"] == held
  out = capsys.readouterr().out
  assert f"epsilon = {result['epsilon']:.2f} at delta = 1e-05" in out


@pytest.mark.slow  # the full run, as examples/README.md shows it (minutes)
def test_full_run_learns_under_privacy_between_unigram_and_non_private():
  result = load_example("dp_lm").main(progress=False)
  held = result["held_out"]
  assert result["epsilon"] < 10
  assert held["dp"]["loss"] < held["unigram"]["loss"] - 0.1
  assert held["plain"]["loss"] < held["dp"]["loss"]
  assert held["dp"]["accuracy"] > held["unigram"]["accuracy"]
