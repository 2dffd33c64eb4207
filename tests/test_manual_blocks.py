"""Every complete code block of the manuals runs as written, in a fresh
Python process, as a user who copies it would run it.

pytest-markdown-docs runs the same blocks inside the suite's process, after
``conftest.py`` has imported ``jaxaccum.testing``, set 8 devices and strict
settings, and after other tests have imported what they needed: a block
that used ``jaxaccum.testing`` without importing it passed there and failed
for every user with ``AttributeError``. Here the blocks run in a process of
their own, without the conftest (``tests/manual_blocks.py``):

- by default, each block's imports and every dotted name it reads from
  them (about 4 s for all the pages: one JAX start);
- marked ``slow``, every block whole, one process per page, with the 8 CPU
  devices a user sets in the environment (``XLA_FLAGS``, and the
  ``PJRT_NPROC`` that ``jaxaccum.testing.cpu_devices`` adds); each block in
  a namespace of its own, the page's blocks sharing the process.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from markdown_it import MarkdownIt
from pytest_markdown_docs.plugin import extract_fence_tests

from jaxaccum.testing import cpu_devices

ROOT = Path(__file__).resolve().parents[1]
RUNNER = Path(__file__).resolve().parent / "manual_blocks.py"
# The pages pytest-markdown-docs runs: pyproject.toml's testpaths.
PAGES = [
  "README.md",
  "examples/README.md",
  "benchmarks/README.md",
  "docs/privacy.md",
  "docs/guide.md",
]


def blocks(page: str) -> list[tuple[str, int, str]]:
  """The page's blocks as pytest-markdown-docs runs them (``notest`` left
  out, ``continuation`` joined), padded so that line numbers are the
  page's."""
  path = ROOT / page
  fences = extract_fence_tests(MarkdownIt("commonmark"), path.read_text(), 0, path)
  return [(page, f.start_line, f.source) for f in fences]


def user_environment() -> dict[str, str]:
  """This process's environment without JAX's and XLA's settings, then the
  CPU and the 8 devices a user sets."""
  env = {
    k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_", "PJRT_"))
  }
  env["JAX_PLATFORMS"] = "cpu"
  cpu_devices(8, environ=env)
  return env


def run_blocks(mode: str, found: list[tuple[str, int, str]], tmp_path: Path):
  """``tests/manual_blocks.py`` in a fresh process, from the repository's
  root, as ``python script.py``."""
  path = tmp_path / "blocks.json"
  path.write_text(json.dumps(found))
  return subprocess.run(
    [sys.executable, str(RUNNER), mode, str(path)],
    cwd=ROOT,
    env=user_environment(),
    capture_output=True,
    text=True,
    check=False,
    timeout=600,
  )


def test_every_name_each_block_imports_is_there_in_a_fresh_process(tmp_path):
  found = [block for page in PAGES for block in blocks(page)]
  assert len(found) >= 10
  proc = run_blocks("names", found, tmp_path)
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert proc.stdout.count("ok ") == len(found)


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p)])
def test_each_block_runs_in_a_fresh_process_without_the_conftest(page, tmp_path):
  found = blocks(page)
  proc = run_blocks("run", found, tmp_path)
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert proc.stdout.count("ok ") == len(found)


def test_a_name_the_block_does_not_import_is_an_error(tmp_path):
  """The default check can fail: a name that is not there, and a submodule
  that another block's import loaded (``import xml`` alone loads no
  ``xml.dom``), each named by page and line; the block that imports what it
  reads passes."""
  found = [
    ("a.md", 1, "import xml.dom.minidom\nxml.dom.minidom.parseString\n"),
    ("b.md", 2, "\nimport xml\nxml.dom.minidom.parseString('<a/>')\n"),
    ("c.md", 1, "import json\njson.no_such_function({})\n"),
    ("d.md", 1, "from xml import dom\ndom.minidom\n"),
  ]
  proc = run_blocks("names", found, tmp_path)
  assert proc.returncode == 1 and proc.stdout == "ok a.md 1\n", proc.stderr
  failures = proc.stderr.split("\n\n")
  assert failures[0].startswith("b.md, the block at line 2:\nTraceback")
  assert failures[0].endswith(
    "AttributeError: line 3: xml.dom is there only because another block "
    "imported xml.dom: this block alone fails with AttributeError."
  )
  assert failures[1].startswith("c.md, the block at line 1:\nTraceback")
  assert failures[1].endswith(
    "AttributeError: line 2: json.no_such_function: <module 'json' from "
    f"'{json.__file__}'> has no 'no_such_function'."
  )
  assert failures[2].startswith("d.md, the block at line 1:")


@pytest.mark.slow
def test_the_blocks_run_without_the_suites_settings_and_failures_are_named(
  tmp_path,
):
  """The full run can fail: the process has none of the conftest's settings
  (rank promotion is JAX's default, the conftest is not imported), has the 8
  devices, and a block that raises fails the run, named by page and line."""
  found = [
    (
      "page.md",
      3,
      "import sys, jax\n"
      "assert jax.config.jax_numpy_rank_promotion == 'allow'\n"
      "assert 'conftest' not in sys.modules and jax.device_count() == 8\n",
    ),
    ("page.md", 9, "\n" * 8 + "raise RuntimeError('as written')\n"),
  ]
  proc = run_blocks("run", found, tmp_path)
  assert proc.returncode == 1 and proc.stdout == "ok page.md 3\n", proc.stderr
  assert proc.stderr.startswith("page.md, the block at line 9:\nTraceback")
  assert 'File "page.md", line 9' in proc.stderr
  assert proc.stderr.endswith("RuntimeError: as written\n")
