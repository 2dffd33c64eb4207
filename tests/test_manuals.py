"""The benchmarks' manual, ``benchmarks/README.md``, is generated: its tables
and measured numbers are written from ``benchmarks/results/*.json`` by
``benchmarks/_report.py`` (STYLE.md, item 14). A result rerun without
``python benchmarks/_report.py``, or a number edited by hand between the
markers, fails here.
"""

import difflib
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

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


def test_the_committed_benchmarks_manual_is_what_report_writes_from_the_results():
  report = load_report()
  committed = MANUAL.read_text()
  generated = report.render(committed, BENCHMARKS / "results")
  diff = "".join(
    difflib.unified_diff(
      committed.splitlines(keepends=True),
      generated.splitlines(keepends=True),
      "benchmarks/README.md (committed)",
      "benchmarks/README.md (from benchmarks/results)",
    )
  )
  assert not diff, "run `python benchmarks/_report.py`:\n" + diff[:6000]


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
