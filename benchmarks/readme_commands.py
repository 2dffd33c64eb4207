"""What the README's two commands take on a fresh clone: time, disk, outcome.

It reads README.md's demo and test commands (:data:`COMMANDS`), clones the
committed ``HEAD`` into a temporary folder once per command and runs each
there as written, in a clean environment (pip's download cache as it is),
then the demo again in the tests' venv. Per run: wall and CPU time, exit
status, the ``.venv``'s size, the last line printed and any line in which a
compile-only plugin reports an error. Outputs ``readme_commands.json``.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import re
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

import _paths
from _report import cpu_model, table

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Which README block is which command: a bash block whose text contains the key.
COMMANDS = {"demo": "examples/quickstart.py", "tests": "python -m pytest"}


def readme_commands(readme: str) -> dict[str, str]:
  """The README's demo and test commands, each one line of a bash block.

  Raises:
    ValueError: if README.md lacks one of them, or has it twice.
  """
  blocks = re.findall(r"```bash[^\n]*\n(.*?)```", readme, re.DOTALL)
  found = {}
  for name, key in COMMANDS.items():
    lines = [line.strip() for b in blocks for line in b.splitlines() if key in line]
    if len(lines) != 1:
      raise ValueError(
        f"README.md should give one {name} command (a bash line with "
        f"{key!r}); found {len(lines)}: {lines}"
      )
    found[name] = lines[0]
  return found


def _size(path: pathlib.Path) -> int:
  return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _clean_env(tmp: pathlib.Path) -> dict[str, str]:
  """The environment of a new shell: no venv, no JAX settings of ours, and
  an empty compilation cache for the tests (a new machine has none)."""
  env = dict(os.environ)
  env["JAXACCUM_TEST_COMPILATION_CACHE"] = str(tmp / "xla-cache")
  for name in ("VIRTUAL_ENV", "JAX_PLATFORMS", "XLA_FLAGS", "PYTHONPATH"):
    env.pop(name, None)
  venv = os.environ.get("VIRTUAL_ENV")
  if venv:
    env["PATH"] = os.pathsep.join(
      p for p in env["PATH"].split(os.pathsep) if not p.startswith(venv)
    )
  return env


# A line that a plugin prints when it cannot start on a CPU-only machine.
PLUGIN_ERROR = re.compile(r"(cuda|cudnn|libtpu|tpu|plugin).*(error|fail)", re.I)


def _cpu_seconds() -> float:
  """User and system CPU time of this process's waited-for children."""
  usage = resource.getrusage(resource.RUSAGE_CHILDREN)
  return usage.ru_utime + usage.ru_stime


def _run(command: str, clone: pathlib.Path) -> dict[str, Any]:
  start, cpu = time.perf_counter(), _cpu_seconds()
  proc = subprocess.run(
    ["bash", "-c", command],
    check=False,
    cwd=clone,
    env=_clean_env(clone.parent),
    capture_output=True,
    text=True,
  )
  seconds = time.perf_counter() - start
  cpu = _cpu_seconds() - cpu
  lines = [line for line in proc.stdout.splitlines() if line.strip()]
  plugin = [
    line
    for line in (proc.stdout + proc.stderr).splitlines()
    if PLUGIN_ERROR.search(line)
  ]
  return {
    "command": command,
    "returncode": proc.returncode,
    "seconds": seconds,
    "cpu_seconds": cpu,
    "venv_bytes": _size(clone / ".venv"),
    "last_line": lines[-1] if lines else "",
    "plugin_error_lines": plugin[:20],
    "stderr_tail": proc.stderr[-2000:] if proc.returncode else "",
  }


def run_fresh(commands: list[str]) -> list[dict[str, Any]]:
  """Runs ``commands`` one after the other in one fresh clone of ``HEAD``."""
  with tempfile.TemporaryDirectory(prefix="jaxaccum-readme-") as tmp:
    clone = pathlib.Path(tmp) / "jaxaccum"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    return [_run(command, clone) for command in commands]


# ---------------------------------------------------------------- README.md's block


def readme_commands_times(results: dict[str, Any]) -> str:
  """Each run: minutes of wall and CPU time, the ``.venv``'s size, its exit
  status and pytest's summary line."""
  m = results["machine"]
  rows = [
    [
      name.replace("_", " "),
      f"{r['seconds'] / 60:.1f}",
      f"{r['cpu_seconds'] / 60:.1f}",
      f"{r['venv_bytes'] / 2**30:.1f}",
      r["returncode"],
      len(r["plugin_error_lines"]),
      f"`{r['last_line'].strip('= ')}`" if name == "tests" else "",
    ]
    for name, r in results["runs"].items()
  ]
  header = ["run", "minutes", "CPU minutes", "`.venv`, GiB", "exit"]
  header += ["plugin error lines", "pytest"]
  return (
    f"Measured by `python benchmarks/readme_commands.py` on {results['date']}, "
    f"a {m['cores']}-core {m['cpu']}, Python {m['python']}:\n\n" + table(header, rows)
  )


#: The blocks written from ``readme_commands.json``, by name (for ``_report.py``).
BLOCKS = {
  "readme_commands times": readme_commands_times,
}


def main(argv: list[str] | None = None) -> int:
  args = _paths.parser(__doc__).parse_args(argv)
  commit = subprocess.run(
    ["git", "rev-parse", "--short", "HEAD"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    check=True,
  ).stdout.strip()
  commands = readme_commands((ROOT / "README.md").read_text())
  # Each command in a fresh clone; then the other one in the same clone and
  # venv, as a newcomer who runs both would (the tests first, the demo
  # second: the order in which compile-only plugins used to spill errors).
  both = run_fresh([commands["tests"], commands["demo"]])
  runs = dict(zip(("tests", "demo_after_tests"), both, strict=True))
  (runs["demo"],) = run_fresh([commands["demo"]])
  results = {
    "date": datetime.date.today().isoformat(),
    "commit": commit,
    "machine": {
      "cpu": cpu_model(),
      "cores": os.cpu_count(),
      "python": sys.version.split()[0],
    },
    "runs": runs,
  }
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "readme_commands.json").write_text(json.dumps(results, indent=2) + "\n")
  print(readme_commands_times(results))
  return 0 if all(r["returncode"] == 0 for r in runs.values()) else 1


if __name__ == "__main__":
  sys.exit(main())
