"""examples/pipeline.py trains pipelined and unpipelined side by side, and
the two agree to float32 rounding."""

from pathlib import Path

import numpy as np
import pytest
from examples_util import load_example

# The losses of the two runs agree to float32 rounding relative to the loss:
# the same model and data, the layers' sums reordered (rows summed per
# micro-batch, then the micro-batches), which moves a loss of a few nats by a
# few units of its last place, and the optimizer's steps then follow.
RELATIVE = 1e-5


@pytest.fixture(scope="module")
def example():
  return load_example("pipeline")


def check(result, steps):
  piped = np.asarray(result["pipelined_losses"])
  plain = np.asarray(result["unpipelined_losses"])
  assert piped.shape == plain.shape == (steps,)
  assert np.all(np.isfinite(piped))
  assert result["max_relative_difference"] < RELATIVE
  np.testing.assert_allclose(piped, plain, rtol=RELATIVE)
  assert piped[-1] < piped[0] - 0.5  # it learns
  # Inside its loops the step moves activations between stages, nothing else.
  assert result["loop_collectives"] == ["collective-permute"]
  png = Path(result["png"])
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_pipelined_training_follows_the_unpipelined_run(example, tmp_path):
  steps = 12
  result = example.main(
    steps=steps,
    seq_len=16,
    width=16,
    heads=2,
    learning_rate=1e-2,
    log_every=4,
    out_dir=tmp_path,
    progress=False,
  )
  check(result, steps)
  assert result["iterations"] == 7  # r*m + S - 1 = 4 + 4 - 1
  assert result["bubble"] == pytest.approx(3 / 7)


@pytest.mark.slow  # main() with its defaults: 200 steps, about a minute
def test_the_default_run(example, tmp_path):
  check(example.main(out_dir=tmp_path, progress=False), 200)


def test_a_batch_that_does_not_split_is_a_usage_error(example, capsys):
  with pytest.raises(SystemExit) as exit_info:
    example.parse_args(["--batch-size", "10", "--num-micro-batches", "4"])
  assert exit_info.value.code == 2
  assert (
    "--batch-size 10 does not split into --num-micro-batches 4 equal micro-batches"
    in capsys.readouterr().err
  )
