"""Runs the multi-device test files again and again, each in a fresh process,
and counts aborts and hangs.

    python tests/stress.py --runs 30 --beside     # the acceptance run
    python tests/stress.py --runs 2 --out /tmp/stress.json   # a quick look

A multi-device CPU test can pass a hundred times and abort on the next:
XLA's CPU client waits 40 seconds for every device of a collective, then
kills the process. Each run here is ``python -m pytest -n 0 FILE`` in a new
process, so one abort costs one run and is counted as one. With
``--beside``, another pytest (single-device test files, in a loop) loads the
machine meanwhile, as a second job does on a shared CI runner. ``--control``
first runs ``tests/cpu_rendezvous_repro.py`` (no jaxaccum) with one and with
two threads per device, with 3 busy processes beside it (``--burn 3``): it
shows that such a load does make XLA abort, and that the setting the suite
uses does not. ``--control-only`` runs only that, and replaces the control
of the record in ``--out``, keeping its runs of the files.

The counts go to ``tests/results/stress.json`` (``--out``) and, rendered,
into tests/README.md between its ``stress`` markers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "tests" / "results" / "stress.json"
MANUAL = ROOT / "tests" / "README.md"
FILES = (
  "tests/test_meshes.py",
  "tests/test_autopilot.py",
  "tests/test_loss_scale.py",
  "tests/test_fsdp.py",
  "tests/test_parallel.py",
  "tests/test_agreement.py",
  "tests/test_multihost.py",
)
BESIDE = (
  "tests/test_value_and_grad.py",
  "tests/test_weighted.py",
  "tests/test_accumulate.py",
  "tests/test_precision.py",
)
#: Busy processes beside each run of the reproduction.
CONTROL_BURN = 3
ABORTED = ("Termination timeout", "Fatal Python error", "rendezvous")


def classify(returncode: int | None, output: str) -> str:
  """One run's outcome: passed, failed (a test failed), aborted (the
  process died, e.g. XLA's rendezvous timeout) or hung (killed at the
  time limit).

  >>> classify(0, "3 passed"), classify(1, "1 failed"), classify(None, "")
  ('passed', 'failed', 'hung')
  >>> classify(-6, "F rendezvous.cc:161] Termination timeout for `all reduce`")
  'aborted'
  """
  if returncode is None:
    return "hung"
  if returncode == 0:
    return "passed"
  if returncode < 0 or returncode == 134 or any(s in output for s in ABORTED):
    return "aborted"
  return "failed"


def run_once(
  command: list[str], timeout: float, env: dict[str, str]
) -> tuple[str, float]:
  start = time.perf_counter()
  try:
    proc = subprocess.run(
      command,
      check=False,
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=timeout,
    )
    outcome = classify(proc.returncode, proc.stdout + proc.stderr)
  except subprocess.TimeoutExpired:
    outcome = classify(None, "")
  return outcome, time.perf_counter() - start


def tally(outcomes: list[tuple[str, float]]) -> dict:
  counts = {k: 0 for k in ("passed", "failed", "aborted", "hung")}
  for outcome, _ in outcomes:
    counts[outcome] += 1
  return {
    "runs": len(outcomes),
    **counts,
    "median_seconds": round(statistics.median(s for _, s in outcomes), 1),
  }


class Beside:
  """Another pytest in a loop, loading the machine while the runs go."""

  def __init__(self, env: dict[str, str]):
    self.proc = subprocess.Popen(
      [
        sys.executable,
        "-c",
        "import subprocess, sys\n"
        "while True:\n"
        f"  subprocess.run([sys.executable, '-m', 'pytest', '-q', '-n', '1', "
        f"'-p', 'no:cacheprovider', *{list(BESIDE)!r}], capture_output=True)\n",
      ],
      cwd=ROOT,
      env=env,
      start_new_session=True,
    )

  def stop(self) -> None:
    os.killpg(self.proc.pid, 9)


def stress(
  files,
  runs: int,
  timeout: float,
  beside: bool,
  control: int,
  *,
  progress=lambda results, done: None,
) -> dict:
  """The runs, tallied; ``progress(results, rounds_done)`` after each round,
  so that a long sweep stopped early keeps what it measured."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  env.pop("XLA_FLAGS", None)  # conftest.py sets the suite's own
  env.pop("PJRT_NPROC", None)
  load = Beside(env) if beside else None
  results: dict = {"files": {}, "control": {}}
  try:
    for threads in (1, 2) if control else ():
      repro = [
        sys.executable,
        "tests/cpu_rendezvous_repro.py",
        f"--threads-per-device={threads}",
        f"--burn={CONTROL_BURN}",
      ]
      outcomes = [run_once(repro, timeout, env) for _ in range(control)]
      results["control"][f"{threads} thread(s) per device"] = tally(outcomes)
      print(f"control, {threads} thread(s) per device:", tally(outcomes), flush=True)
    outcomes: dict[str, list] = {f: [] for f in files}
    for r in range(runs):
      for f in files:
        command = [
          sys.executable,
          "-m",
          "pytest",
          "-q",
          "-n",
          "0",
          "-p",
          "no:cacheprovider",
          f,
        ]
        outcomes[f].append(run_once(command, timeout, env))
        print(f"run {r + 1}/{runs} {f}: {outcomes[f][-1][0]}", flush=True)
      results["files"] = {f: tally(o) for f, o in outcomes.items()}
      progress(results, r + 1)
  finally:
    if load is not None:
      load.stop()
  return results


def render(record: dict) -> str:
  """The tests/README.md block of a stress record."""
  lines = [
    f"Measured by `python tests/stress.py --runs {record['runs']}"
    + (" --beside" if record["beside"] else "")
    + (f" --control {record['control_runs']}" if record["control_runs"] else "")
    + (
      " --files " + " ".join(record["files"])
      if record["files"] and set(record["files"]) != set(FILES)
      else ""
    )
    + f"` on {record['date']}, {record['machine']}, jax {record['jax']}"
    + (", another pytest running beside" if record["beside"] else "")
    + ":"
    + (
      f" the control rows by `python tests/stress.py --control-only --control "
      f"{record['control_runs']}` on {record['control_date']}, each run of the "
      f"reproduction with {CONTROL_BURN} busy processes beside it."
      if "control_date" in record
      else ""
    ),
    "",
    "| file | runs | passed | failed | aborted | hung | median run |",
    "|---|---|---|---|---|---|---|",
  ]
  for name, t in {**record["control"], **record["files"]}.items():
    label = (
      f"`cpu_rendezvous_repro.py`, {name}"
      + (f", {CONTROL_BURN} busy processes beside" if "control_date" in record else "")
      if "per device" in name
      else f"`{Path(name).name}`"
    )
    lines.append(
      f"| {label} | {t['runs']} | {t['passed']} | {t['failed']} | {t['aborted']} "
      f"| {t['hung']} | {t['median_seconds']:.0f} s |"
    )
  return "\n".join(lines)


def write_manual(record: dict, manual: Path = MANUAL) -> None:
  text = manual.read_text()
  begin, end = "<!-- begin: stress -->", "<!-- end: stress -->"
  head, rest = text.split(begin)
  _, tail = rest.split(end)
  manual.write_text(f"{head}{begin}\n\n{render(record)}\n\n{end}{tail}")


def cpu_model() -> str:
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.machine()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--runs", type=int, default=30)
  parser.add_argument("--files", nargs="*", default=list(FILES))
  parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
  parser.add_argument("--beside", action="store_true", help="another pytest beside")
  parser.add_argument(
    "--control", type=int, default=0, help="runs of the repro per setting"
  )
  parser.add_argument(
    "--control-only",
    action="store_true",
    help="only the control; the files' runs are kept from --out",
  )
  parser.add_argument("--out", type=Path, default=RESULTS)
  args = parser.parse_args()
  import jax  # noqa: PLC0415  (only for its version)

  head = {
    "date": datetime.date.today().isoformat(),
    "machine": f"{os.cpu_count()} cores ({cpu_model()})",
    "jax": jax.__version__,
    "beside": args.beside,
    "control_runs": args.control,
  }

  def save(results: dict, done: int) -> dict:
    record = {**head, "runs": done, **results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    if args.out.resolve() == RESULTS.resolve():
      write_manual(record)
    return record

  if args.control_only:
    kept = json.loads(args.out.read_text())
    control = stress([], 0, args.timeout, False, args.control)["control"]
    record = {
      **kept,
      "control": control,
      "control_runs": args.control,
      "control_date": head["date"],
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    if args.out.resolve() == RESULTS.resolve():
      write_manual(record)
    print(render(record))
    return
  results = stress(
    args.files, args.runs, args.timeout, args.beside, args.control, progress=save
  )
  print(render(save(results, args.runs)))


if __name__ == "__main__":
  main()
