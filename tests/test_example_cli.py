"""The examples' command lines: ``--help`` answers without importing JAX, and a
bad value is a usage error (exit code 2), never a traceback.

Each script runs in a subprocess, as a user runs it. ``python -X importtime``
lists every module the run imported, so "JAX was not imported" is checked
from that list, not from a wall-clock time.
"""

import argparse
import inspect
import os
import subprocess
import sys

import pytest
from examples_util import EXAMPLES, ROOT, load_example

SCRIPTS = sorted(p.stem for p in EXAMPLES.glob("*.py") if not p.stem.startswith("_"))
# What no example may import before its command line is parsed.
HEAVY = {"jax", "jaxlib", "flax", "optax", "jaxaccum", "grain", "numpy", "sklearn"}
HEAVY |= {"matplotlib", "tqdm"}


def test_every_example_is_covered():
  assert len(SCRIPTS) == 13, SCRIPTS
  assert {
    "quickstart",
    "input_pipeline",
    "dp_digits",
    "dp_lm",
    "pipeline",
    "fp8_lm",
  } <= set(SCRIPTS)


def run(name: str, *args: str) -> subprocess.CompletedProcess:
  """``python -X importtime examples/NAME.py ARGS``, on the CPU."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "COLUMNS": "100"}  # help's width
  command = [sys.executable, "-X", "importtime", str(EXAMPLES / f"{name}.py")]
  return subprocess.run(
    [*command, *args],
    capture_output=True,
    text=True,
    env=env,
    cwd=ROOT,
    timeout=120,
    check=False,
  )


def imported(stderr: str) -> set[str]:
  """The top-level packages in ``-X importtime``'s listing on stderr."""
  names = set()
  for line in stderr.splitlines():
    if line.startswith("import time:") and "|" in line:
      name = line.rsplit("|", 1)[1].strip()
      if name != "imported package":  # the listing's header
        names.add(name.split(".")[0])
  return names


def error_output(proc: subprocess.CompletedProcess) -> str:
  """stderr without ``-X importtime``'s listing: what the user reads."""
  lines = proc.stderr.splitlines()
  return "\n".join(line for line in lines if not line.startswith("import time:"))


def assert_usage_error(proc: subprocess.CompletedProcess, message: str) -> None:
  """argparse's answer to a bad command line: usage, one error line, exit 2."""
  err = error_output(proc)
  assert proc.returncode == 2, err
  assert err.startswith("usage: "), err
  assert message in err.splitlines()[-1], err
  assert "Traceback" not in err
  assert proc.stdout == ""
  assert not imported(proc.stderr) & HEAVY


def test_the_import_listing_shows_an_import():
  """The check below would see JAX: ``imported`` reads the listing right."""
  proc = subprocess.run(
    [sys.executable, "-X", "importtime", "-c", "import json.decoder"],
    capture_output=True,
    text=True,
    timeout=60,
    check=True,
  )
  assert "json" in imported(proc.stderr)


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_answers_before_jax_is_imported(name):
  proc = run(name, "--help")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.startswith(f"usage: {name}.py ")
  words = " ".join(proc.stdout.split())  # as wrapped to any terminal's width
  for flag in ("--out-dir DIR", "--seed N", "--no-progress", "(default: "):
    assert flag in words
  assert f"the docstring at the top of examples/{name}.py" in words
  modules = imported(proc.stderr)
  assert {"argparse", "_cli"} <= modules  # the listing is there
  assert not modules & HEAVY, sorted(modules & HEAVY)


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_bad_number_is_a_usage_error(name):
  assert_usage_error(
    run(name, "--learning-rate", "0"),
    "argument --learning-rate: must be more than 0, got 0",
  )
  assert_usage_error(
    run(name, "--seed", "1.5"),
    "argument --seed: expected a whole number, got '1.5'",
  )


@pytest.mark.parametrize(
  ("flag", "value"),
  [("--augment", "rotate"), ("--source", "files"), ("--placement", "gpu")],
)
def test_a_bad_choice_is_a_usage_error(flag, value):
  proc = run("input_pipeline", flag, value)
  assert_usage_error(proc, f"argument {flag}: invalid choice: '{value}'")


def test_help_lists_the_choices():
  out = run("input_pipeline", "--help").stdout
  for choices in ("{batch,example,none}", "{rows,batches}", "{device,pinned_host}"):
    assert choices in out


@pytest.mark.parametrize(
  ("name", "args", "message"),
  [
    ("quickstart", ["--batch-size", "30"], "does not split into"),
    ("quickstart", ["--width", "30", "--heads", "4"], "does not split into"),
    ("quickstart", ["--dropout", "1"], "must be at least 0 and below 1"),
    ("dp_lm", ["--width", "30"], "--width 30 does not split into --heads 4"),
    ("dp_lm", ["--quick", "--heads", "3"], "--width 32 does not split into --heads 3"),
    ("digits_mlp", ["--train-rows", "5"], "--train-rows must be between"),
    ("convnet_batchnorm", ["--batch-size", "2000"], "more than the 1344"),
    ("cross_step", ["--micro-batch-size", "2000"], "more than the 1344"),
    ("noise_scale", ["--num-micro-batches", "1"], "must be at least 2, got 1"),
    ("noise_scale", ["--decay", "1"], "must be between 0 and 1"),
    ("mixed_precision", ["--compare-ks", "8", "5"], "5 does not divide"),
    ("data_parallel", ["--multiprocess", "--batch-size", "100"], "8 device(s)"),
    ("input_pipeline", ["--batch-size", "100"], "does not divide the 1344"),
    ("input_pipeline", ["--source", "batches", "--augment", "example"], "batches"),
    ("input_pipeline", ["--steps", "-3"], "must be at least 1, got -3"),
  ],
)
def test_values_that_do_not_fit_are_usage_errors(name, args, message):
  assert_usage_error(run(name, *args), message)


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_command_line_defaults_are_mains(name):
  """``parse_args([])`` is ``main``'s keyword arguments, at their defaults."""
  module = load_example(name)
  parsed = module.parse_args([])
  for internal in getattr(module, "WORKER_FLAGS", ()):  # data_parallel's
    parsed.pop(internal)
  defaults = {
    n: p.default for n, p in inspect.signature(module.main).parameters.items()
  }
  assert parsed == defaults
  flipped = module.parse_args(["--no-progress", "--seed", "3", "--out-dir", "x"])
  assert (flipped["progress"], flipped["seed"], flipped["out_dir"]) == (False, 3, "x")


def test_numbers_are_checked_by_their_type():
  cli = load_example("_cli")
  assert cli.positive_int("3") == 3
  assert cli.non_negative_int("0") == 0
  assert cli.int_at_least(2)("2") == 2
  assert cli.positive_float("1e-3") == 1e-3
  assert cli.probability("0") == 0.0
  assert cli.decay_rate("0.5") == 0.5
  for parse, text in [
    (cli.positive_int, "0"),
    (cli.positive_int, "2.0"),
    (cli.non_negative_int, "-1"),
    (cli.int_at_least(2), "1"),
    (cli.positive_float, "0"),
    (cli.positive_float, "nan"),
    (cli.positive_float, "inf"),
    (cli.probability, "1"),
    (cli.decay_rate, "0"),
  ]:
    with pytest.raises(argparse.ArgumentTypeError):
      parse(text)


def test_tuple_flags_show_their_default_as_typed(monkeypatch):
  """``--compare-ks 8 64``: several values, shown as one would type them."""
  monkeypatch.setenv("COLUMNS", "100")
  cli = load_example("_cli")
  parser = cli.parser("One line.\n\nMore.")
  parser.add_argument(
    "--ks", type=cli.positive_int, nargs="+", default=(8, 64), help="the k"
  )
  parser.add_argument("--flag", action="store_true", help="on or off")
  words = " ".join(parser.format_help().split())
  assert "the k (default: 8 64)" in words
  assert "on or off (default" not in words  # a flag has no default to show
  assert "One line." in words and "More." not in words
  assert cli.keyword_arguments(parser.parse_args(["--ks", "2", "4"])) == {
    "ks": (2, 4),
    "flag": False,
  }
