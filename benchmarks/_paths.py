"""Where the benchmarks write.

A full run writes ``benchmarks/results/``, whose JSON the manuals' tables
are generated from. A ``--quick`` run is a smoke test of the script: it
writes to the system's temporary folder, so that it never leaves untracked
files among the results (or overwrites them).
"""

from __future__ import annotations

import pathlib
import tempfile

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def output_folder(out: pathlib.Path | str | None, quick: bool) -> pathlib.Path:
  """``--out`` if given; else the temporary folder for a quick run, the
  results folder for a full one.

  >>> output_folder("x", quick=True), output_folder(None, quick=False) == RESULTS
  (PosixPath('x'), True)
  >>> output_folder(None, quick=True) == RESULTS
  False
  """
  if out is not None:
    return pathlib.Path(out)
  return pathlib.Path(tempfile.gettempdir()) if quick else RESULTS
