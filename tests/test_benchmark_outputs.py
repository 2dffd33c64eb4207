"""A benchmark's ``--quick`` run is a smoke test: it writes to the temporary
folder, never among ``benchmarks/results/`` (whose JSON the manuals'
tables are generated from); a full run writes there; ``--out`` wins."""

import importlib.util
import pathlib
import sys
import tempfile

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import _paths  # noqa: E402


def test_quick_runs_write_outside_the_results():
  temp = pathlib.Path(tempfile.gettempdir())
  assert _paths.RESULTS == BENCHMARKS / "results"
  assert _paths.output_folder(None, quick=True) == temp
  assert _paths.output_folder(None, quick=False) == _paths.RESULTS
  assert _paths.output_folder("x/y", quick=True) == pathlib.Path("x/y")


def load(name):
  """``benchmarks/NAME.py`` by its path (``examples/`` has a ``pipeline.py``
  too, which a plain import could find first)."""
  spec = importlib.util.spec_from_file_location(
    f"_bench_{name}", BENCHMARKS / f"{name}.py"
  )
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # for its dataclasses
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize("name", ["fsdp", "pipeline"])
def test_the_scripts_resolve_their_folder_so(name):
  module = load(name)
  assert module.parse_args(["--quick"]).out == pathlib.Path(tempfile.gettempdir())
  assert module.parse_args([]).out == _paths.RESULTS
  assert module.parse_args(["--quick", "--out", "o"]).out == pathlib.Path("o")
