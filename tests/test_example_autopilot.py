"""examples/autopilot.py runs end to end with tiny settings, and its results
have the schema of benchmarks/results/autopilot.json."""

import json
import math
import pathlib

import numpy as np
import pytest
from examples_util import load_example

RUNS = ("fixed_small", "fixed_large", "hand_ramp", "autopilot")


def test_the_hand_ramp_is_linear_in_micro_batches():
  ramp_table = load_example("autopilot").ramp_table
  table = ramp_table(1000, 2, 32)
  assert table[0] == 2
  assert 31 <= table[-1] <= 32
  assert np.all(np.diff(table) >= 0)
  # The windows cover the budget; the last may be cut short (flushed).
  consumed = np.concatenate([[0], np.cumsum(table)])
  assert consumed[-2] < 1000 <= consumed[-1]
  # k grows with the micro-batches consumed, not with the steps.
  np.testing.assert_allclose(table, 2 + 30 * consumed[:-1] / 1000, atol=0.5)


@pytest.mark.slow  # main() end to end: two tasks, four runs, two seeds
def test_autopilot_main_tiny(tmp_path):
  example = load_example("autopilot")
  path = tmp_path / "results" / "autopilot.json"
  seeds = 2
  out = example.main(
    seeds=seeds,
    quick=True,  # a few hundred micro-batches, small models
    results=str(path),
    out_dir=str(tmp_path),
    progress=False,
  )
  written = json.loads(path.read_text())
  assert set(written["tasks"]) == {"char_lm", "digits"}
  assert written["seeds"] == [0, 1]
  assert set(written["autopilot"]) >= {"horizon", "growth", "warmup", "lr_rule"}
  for name, task in written["tasks"].items():
    runs = task["runs"]
    assert tuple(runs) == RUNS, name
    settings = task["settings"]
    budget, min_k, max_k = settings["budget"], settings["min_k"], settings["max_k"]
    for run, r in runs.items():
      for key in ("final_loss_mean", "final_loss_std", "optimizer_steps", "tokens"):
        assert math.isfinite(r[key]), (name, run, key)
      assert r["micro_batches"] == budget
      assert len(r["final_loss_per_seed"]) == seeds
      # Each run trains: the held-out loss falls, for every seed.
      for losses in r["eval"]["loss"]:
        assert losses[-1] < losses[0] - 0.1, (name, run, losses)
      curves = r["curves"]
      assert len(curves["k"]) == len(curves["b_simple"]) == seeds
      assert len(curves["k"][0]) == len(curves["micro_batches"])
      assert r["eval"]["tokens"][-1] == pytest.approx(r["tokens"], rel=1e-5)
    # Equal tokens: every run saw the same micro-batches, seed by seed.
    tokens = {run: r["tokens_per_seed"] for run, r in runs.items()}
    assert len({tuple(t) for t in tokens.values()}) == 1, tokens
    # The step counts follow from the windows (the last one flushed).
    steps = {run: r["optimizer_steps_per_seed"] for run, r in runs.items()}
    assert steps["fixed_small"] == [math.ceil(budget / min_k)] * seeds
    assert steps["fixed_large"] == [math.ceil(budget / max_k)] * seeds
    assert steps["fixed_large"][0] < steps["hand_ramp"][0] < steps["fixed_small"][0]
    # The autopilot starts at min_k and its window grows from there.
    for k in runs["autopilot"]["curves"]["k"]:
      assert k[0] == min_k
      assert max(k) > min_k
    assert steps["autopilot"][0] < steps["fixed_small"][0]
    goal = task["goal"]
    assert set(goal) >= {"met", "steps_ratio", "loss_gap_to_small", "beats_hand_ramp"}
    # The JSON's floats have 6 significant digits.
    assert goal["steps_ratio"] == pytest.approx(
      runs["autopilot"]["optimizer_steps"] / runs["fixed_small"]["optimizer_steps"],
      rel=1e-5,
    )
  assert out["tasks"].keys() == written["tasks"].keys()
  for png in (tmp_path / "autopilot.png", path.with_suffix(".png")):
    assert pathlib.Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
