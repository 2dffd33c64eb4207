"""The benchmarks' manual, ``benchmarks/README.md``, and the measured numbers
of ``README.md``, ``docs/guide.md`` and ``examples/README.md`` are
generated: written from ``benchmarks/results/*.json`` by
``benchmarks/_report.py``. A result rerun without
``python benchmarks/_report.py``, or a number edited by hand between the
markers, fails here.
"""

import difflib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jaxaccum.testing import cpu_devices

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
MANUAL = BENCHMARKS / "README.md"


def load_report():
  """Imports ``benchmarks/_report.py`` (benchmarks/ is not a package)."""
  if "_report" in sys.modules:
    return sys.modules["_report"]
  spec = importlib.util.spec_from_file_location("_report", BENCHMARKS / "_report.py")
  assert spec is not None and spec.loader is not None
  module = importlib.util.module_from_spec(spec)
  sys.modules["_report"] = module
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize("page", ["benchmarks", "readme", "guide", "examples"])
def test_each_committed_page_is_what_report_writes_from_the_results(page):
  report = load_report()
  path = report.PAGES[page]
  committed = path.read_text()
  generated = report.render(committed, BENCHMARKS / "results", page)
  name = path.relative_to(ROOT)
  diff = "".join(
    difflib.unified_diff(
      committed.splitlines(keepends=True),
      generated.splitlines(keepends=True),
      f"{name} (committed)",
      f"{name} (from benchmarks/results)",
    )
  )
  assert not diff, "run `python benchmarks/_report.py`:\n" + diff[:6000]


def test_a_block_of_another_page_is_an_error():
  report = load_report()
  guide = report.PAGES["guide"].read_text()
  with pytest.raises(ValueError, match="autopilot summary"):
    report.render(guide, BENCHMARKS / "results", "benchmarks")


def test_a_changed_result_changes_the_manual(tmp_path):
  """The check above can fail: a median changed in a copy of the results
  shows up in the page rendered from the copy."""
  report = load_report()
  results = tmp_path / "results"
  shutil.copytree(BENCHMARKS / "results", results)
  path = results / "step_time.json"
  data = json.loads(path.read_text())
  config = data["models"]["dispatch_mlp"]["configs"][0]
  config["approaches"]["jaxaccum"]["median_ms"] *= 3
  path.write_text(json.dumps(data))
  committed = MANUAL.read_text()
  assert report.render(committed, results) != report.render(
    committed, BENCHMARKS / "results"
  )


def test_a_missing_result_is_said_not_invented(tmp_path):
  report = load_report()
  text = report.write_block("fsdp table", tmp_path)
  assert "No results yet" in text and "fsdp.json" in text


def test_a_block_the_report_does_not_know_is_an_error():
  report = load_report()
  text = (
    MANUAL.read_text()
    + "<!-- begin: step_time nonsense -->\n<!-- end: step_time nonsense -->\n"
  )
  with pytest.raises(ValueError, match="nonsense"):
    report.render(text, BENCHMARKS / "results")


def guide_block(heading: str) -> str:
  """The first ``python`` block under docs/guide.md's ``## heading``."""
  text = (ROOT / "docs" / "guide.md").read_text()
  section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
  return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 2, 4])
def test_the_guide_mesh_block_runs_as_written_on_few_devices(devices, tmp_path):
  """The guide's mesh example runs on any machine; pytest-markdown-docs
  runs it on the suite's 8 devices, this on 1, 2 and 4 (a (1, 2) mesh
  once raised an XLA RET_CHECK)."""
  script = tmp_path / "mesh_block.py"
  script.write_text(
    guide_block("Scaling out")
    + f"assert jax.device_count() == {devices}\n"
    + "print('ok', mesh.shape)\n"
  )
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  cpu_devices(devices, environ=env)
  proc = subprocess.run(
    [sys.executable, str(script)],
    check=False,
    env=env,
    capture_output=True,
    text=True,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.startswith("ok")
