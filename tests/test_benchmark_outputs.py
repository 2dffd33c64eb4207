"""A benchmark's ``--quick`` run is a smoke test: it writes to the temporary
folder, never among ``benchmarks/results/`` (whose JSON the manuals'
tables are generated from); a full run writes there; ``--out`` wins."""

import functools
import importlib.util
import pathlib
import sys
import tempfile

import hypothesis
import hypothesis.strategies as st
import jax
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


load_once = functools.cache(load)


@hypothesis.settings(max_examples=100, deadline=None)
@hypothesis.given(
  base=st.integers(0, 10**4),
  slope=st.integers(1, 10**3),
  curve=st.integers(0, 5),
  headroom=st.integers(0, 10**6),
  refused_from=st.one_of(st.none(), st.integers(1, 3000)),
  known=st.lists(st.integers(1, 3000), max_size=3),
)
def test_largest_fitting_finds_the_last_batch_that_fits(
  *, base, slope, curve, headroom, refused_from, known
):
  """benchmarks/dp.py's search for the largest micro-batch under a memory
  budget, against a scan of every batch: a peak growing like a compiled
  step's (a line with some curvature), XLA refusing the larger ones (None),
  and some peaks already compiled (the rows of the ghost part)."""
  dp = load_once("dp")
  budget = base + headroom

  def peak(b):
    if refused_from is not None and b >= refused_from:
      return None
    return base + slope * b + curve * b * b

  def fits(b):
    return peak(b) is not None and peak(b) <= budget

  expected = 0
  while fits(expected + 1):
    expected += 1
  probed = []
  found = dp.largest_fitting(
    lambda b: probed.append(b) or peak(b), budget, 64, {b: peak(b) for b in known}
  )
  assert found["batch"] == expected
  assert found["peak"] == (peak(expected) if expected else None)
  assert found["compiled"] == probed
  assert not set(probed) & set(known)  # a known peak is not compiled again
  hypothesis.event(f"compiles: {min(len(probed), 12) // 4 * 4}+")
  hypothesis.event("nothing fits" if expected == 0 else "something fits")


def test_every_regression_guard_line_of_ci_parses():
  """Each ``regressions.py`` command in ``.ci/run`` is one its parser takes
  (``--targets`` is a flag there, not the list the shared parser checks)."""
  guard = load("regressions")
  ci = (BENCHMARKS.parent / ".ci" / "run").read_text()
  lines = [
    ln.split()[2:]
    for ln in ci.splitlines()
    if ln.startswith("python benchmarks/regressions.py")
  ]
  assert {"--targets"} <= {a for line in lines for a in line}
  for line in lines:
    args = guard.cli().parse_args(line)
    assert args.check and args.targets == ("--targets" in line)


def test_the_regression_guard_fails_a_step_whose_loss_is_wrong():
  """regressions.py runs each step once against jax.value_and_grad on the
  full batch: the right step passes, one whose loss and gradients are 256
  times the full batch's (the same compiled bytes) is caught."""
  guard = load("regressions")
  step, args, mesh, data, loss = guard.mlp_step("replicated", "plain")
  right = guard.measure(step, args, mesh, data, loss)
  assert right["error"] <= guard.EXACT

  def scaled(*a):
    value, grads = step(*a)
    return value * 256, jax.tree.map(lambda g: g * 256, grads)

  wrong = guard.measure(scaled, args, mesh, data, loss)
  assert wrong["error"] > guard.EXACT
  assert guard.BASELINE.name == f"regressions-jax{guard.MINOR}.json"
