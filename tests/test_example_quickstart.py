"""examples/quickstart.py runs end to end with tiny settings and gives real results."""

import math
from pathlib import Path

import numpy as np
import pytest
from examples_util import load_example


@pytest.fixture(scope="module")
def quickstart():
  return load_example("quickstart")


@pytest.mark.slow  # main() end to end
def test_quickstart_main_tiny(quickstart, tmp_path):
  results = quickstart.main(
    steps=30,
    batch_size=32,
    seq_len=32,
    num_micro_batches=8,
    width=32,
    layers=1,
    heads=2,
    learning_rate=1e-2,
    sample_length=20,
    out_dir=tmp_path,
    progress=False,
  )
  losses = results["losses"]
  assert len(losses) == 30
  assert all(math.isfinite(loss) for loss in losses)
  # It learns: the first loss is near a uniform guess, the last ones far below.
  assert results["first_loss"] > 4.0
  assert results["final_loss"] < results["first_loss"] - 0.8
  # The accumulated step equals the full batch to float32 rounding...
  assert results["max_relative_deviation"] < 1e-5
  assert results["max_deviation"] < 1e-5
  # ...and the naive mean of micro-batch means does not, least of all when the
  # micro-batches are grouped by length.
  comparisons = results["comparisons"]
  assert len(comparisons) == 4
  by_length = comparisons["rows by length, trained"]
  assert by_length["naive_grad_error"] > 1e-2
  assert by_length["naive_loss_error"] > 1e-3
  assert results["tokens_per_second"] > 0
  assert results["peak_bytes_accumulated"] < results["peak_bytes_full_batch"]
  png = Path(results["png"])
  assert png.parent == tmp_path
  assert png.stat().st_size > 0
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert results["sample"].startswith("The ")
  assert len(results["sample"]) == len("The ") + 20


def test_sequences_hold_different_numbers_of_real_tokens(quickstart):
  data = quickstart.CharData(seq_len=32)
  real = data.lengths - 1
  assert real.min() >= 1
  assert real.max() == 32
  assert len(set(real.tolist())) > 10  # genuinely variable lengths
  batch = next(data.batches(32, seed=0))
  assert batch["inputs"].shape == batch["targets"].shape == (32, 32)
  # Right padding: each row's mask is a run of True, then False.
  mask = batch["mask"]
  counts = mask.sum(axis=1)
  assert (mask == (np.arange(32)[None, :] < counts[:, None])).all()
  assert ((batch["targets"] != quickstart.PAD) == mask).all()
  # So the micro-batches hold different numbers of real tokens.
  assert len(set(mask.reshape(8, -1).sum(axis=1).tolist())) > 1
  assert data.decode(data.encode("The object")) == "The object"
