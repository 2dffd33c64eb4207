"""examples/data_parallel.py trains data-parallel, on one host and in 2 processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from examples_util import EXAMPLES, ROOT, load_example

EXAMPLE = EXAMPLES / "data_parallel.py"
# Tiny settings, shared by both tests so that their loss curves must agree.
TINY = {
  "steps": 30,
  "batch_size": 128,
  "num_micro_batches": 2,
  "hidden": 64,
  "learning_rate": 3e-3,
  "seed": 0,
}


@pytest.fixture(scope="module")
def example():
  return load_example("data_parallel")


@pytest.fixture(scope="module")
def single_process(example, tmp_path_factory):
  out_dir = tmp_path_factory.mktemp("single")
  return example.main(**TINY, out_dir=out_dir, progress=False), out_dir


def test_single_host_trains_with_no_collective_in_the_loop(single_process):
  result, out_dir = single_process
  losses = result["losses"]
  assert losses.shape == (TINY["steps"],)
  assert np.all(np.isfinite(losses))
  assert result["num_devices"] == 8  # conftest.py's fake CPU devices
  # It learns: from about ln(10) to well below, and far above chance (0.1).
  assert losses[0] > 2.0
  assert np.mean(losses[-5:]) < 0.5 * losses[0]
  assert result["test_accuracy"] > 0.7
  # One all-reduce after the loop, none inside it.
  assert result["loop_collectives"] == 0
  assert sum(c["executions"] for c in result["collectives"]) == 1
  assert result["bytes_per_step"] <= result["grad_bytes"] + 16
  png = Path(result["png"])
  assert png.parent == out_dir
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # two processes start JAX and train end to end
def test_two_processes_give_the_single_process_losses(single_process, tmp_path):
  single, _ = single_process
  flags = [f"--{name.replace('_', '-')}={value}" for name, value in TINY.items()]
  flags += ["--multiprocess", "--no-progress", f"--out-dir={tmp_path}"]
  env = dict(os.environ)
  env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
  proc = subprocess.run(
    [sys.executable, str(EXAMPLE), *flags],
    env=env,
    capture_output=True,
    text=True,
    timeout=180,
    check=False,
  )
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
  assert "[process 0] final loss" in proc.stdout
  summary = json.loads((tmp_path / "data_parallel_multiprocess.json").read_text())
  multi = np.asarray(summary["multiprocess_losses"], np.float32)
  assert multi.shape == (TINY["steps"],)
  assert summary["multiprocess_loop_collectives"] == 0
  # Same global batches, same parameters: equal up to float32 rounding, both to
  # this test's single-process run and to the one the launcher ran itself.
  np.testing.assert_allclose(multi, single["losses"], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(
    multi, summary["single_process_losses"], rtol=1e-5, atol=1e-6
  )
  assert (tmp_path / "data_parallel.png").stat().st_size > 0
