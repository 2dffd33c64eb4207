"""examples/fp8_lm.py runs end to end with tiny settings: its FP8 metadata
equals the full batch's at every step, and both models learn."""

import math
from pathlib import Path

import pytest
from examples_util import load_example


@pytest.mark.slow  # main() end to end
def test_fp8_lm_main_tiny(tmp_path):
  example = load_example("fp8_lm")
  results = example.main(
    steps=4,
    batch_size=16,
    seq_len=16,
    num_micro_batches=4,
    width=32,
    layers=1,
    heads=2,
    out_dir=tmp_path,
    progress=False,
  )
  assert results["fp8"]["metadata_deviation"] <= 1e-6
  for name in ("fp8", "bf16"):
    losses = results[name]["losses"]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]
  assert Path(results["png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_fp8_lm_arguments_are_checked():
  example = load_example("fp8_lm")
  with pytest.raises(SystemExit):
    example.parse_args(["--batch-size", "10", "--num-micro-batches", "4"])
