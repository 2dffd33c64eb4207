"""Two processes on localhost, 4 CPU devices each, one accumulated step.

Runs tests/multihost_worker.py twice with ``jax.distributed.initialize``
(coordinator on 127.0.0.1, gloo CPU collectives) and checks that the
data-parallel result equals the single-process one, on an (8,) mesh and on a
(4, 2) data x model mesh whose data axis spans the processes; and that every
device of both processes takes the same decisions when only process 1's
data holds NaN rows (tests/agreement_steps.py).
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("multihost_worker.py")


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_equal_one(tmp_path):
  port = str(free_port())
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # the worker sets its own: 4 devices each
  root = str(Path(__file__).resolve().parents[1])
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  outs = [tmp_path / f"process{i}.json" for i in range(2)]
  procs = [
    subprocess.Popen(
      [sys.executable, str(WORKER), port, str(i), str(outs[i])],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  logs = []
  for p in procs:
    try:
      logs.append(p.communicate(timeout=240)[0])
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
  for p, log in zip(procs, logs, strict=True):
    assert p.returncode == 0, log[-3000:]

  results = [json.loads(out.read_text()) for out in outs]
  for r in results:
    assert r["value_vs_full_batch"] < 1e-6, r
    assert r["grads_vs_full_batch"] < 1e-5, r
    assert r["value_vs_single_process"] < 1e-6, r
    assert r["grads_vs_single_process"] < 1e-5, r
    assert r["aux_vs_single_process"] < 1e-6, r
    # (4, 2) mesh, tensor-parallel weights, data axis across the processes.
    assert r["tp_value_vs_full_batch"] < 1e-6, r
    assert r["tp_grads_vs_full_batch"] < 1e-5, r
    assert r["tp_grads_sharded_like_params"], r
  assert results[0]["value"] == results[1]["value"]

  # Every device agrees (tests/agreement_steps.py), NaN rows in process 1's
  # data only: each process's 4 devices hold the same, and so do the two
  # processes.
  first, second = (r["agreement"] for r in results)
  for name in first:
    assert first[name].pop("digest") == second[name].pop("digest"), name
  assert first == second
  assert first["train_step"] == {
    "skipped_value_is_nan": True,
    "skipped_params_unchanged": True,
    "skipped_state_unchanged": True,
    "skipped_agreed": True,
    "clean_moved": True,
    "clean_agreed": True,
  }
  assert first["accumulate"] == {
    "updated_on_the_second_call_only": True,
    "skipped_counts": [0, 1, 1],
    "state_agreed": True,
    "updates_agreed": True,
    "updates_finite": True,
  }
  assert first["loss_scale"] == {
    "scales": [2.0**9, 2.0**9],
    "skipped_params_unchanged": True,
    "clean_moved": True,
    "agreed": True,
  }
  assert first["autopilot"]["disagreements"] == 0
  assert len(first["autopilot"]["windows"]) > 1
