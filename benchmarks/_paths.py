"""The benchmarks' command line, and where they write.

Every script builds its parser with :func:`parser`, which adds the flags
they share (``--quick``, ``--out``, ``--rounds``, ``--cpus``, ``--ks``,
``--targets``); a script adds only its own. A full run writes
``benchmarks/results/``, whose JSON the manuals' tables are generated from.
A ``--quick`` run is a smoke test of the script: it writes to the system's
temporary folder, so that it never leaves untracked files among the results
(or overwrites them).
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
#: The compile-only accelerators, and the 8-device topology of each.
TOPOLOGIES = {"h100": "1x1x8", "tpu-v5e": "2x4"}


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


def ints(text: str) -> list[int]:
  """``"1,2,4"`` -> ``[1, 2, 4]``.

  >>> ints("1, 2,4,")
  [1, 2, 4]
  """
  return [int(part) for part in text.split(",") if part.strip()]


def names(text: str) -> list[str]:
  """``"a,b"`` -> ``["a", "b"]``."""
  return [part.strip() for part in text.split(",") if part.strip()]


class _Parser(argparse.ArgumentParser):
  """Resolves ``--out`` (:func:`output_folder`) and checks ``--targets``."""

  out_folder = False
  check_targets = False

  def parse_args(self, args=None, namespace=None):  # type: ignore[override]
    ns = super().parse_args(args, namespace)
    if self.out_folder:
      ns.out = output_folder(ns.out, getattr(ns, "quick", False))
    unknown = (
      [t for t in ns.targets if t not in TOPOLOGIES] if self.check_targets else []
    )
    if unknown:
      self.error(f"unknown targets {unknown}; choose from {list(TOPOLOGIES)}")
    return ns


def parser(
  doc: str,
  *,
  quick: str | None = None,
  out: bool = True,
  rounds: str | None = None,
  cpus: bool = False,
  ks: str | None = None,
  targets: bool = False,
) -> argparse.ArgumentParser:
  """A script's parser, described by ``doc``'s first paragraph, with the
  shared flags it asks for (a help text each, or True): ``--quick``;
  ``--out``, the output folder (:func:`output_folder`, resolved on parsing);
  ``--rounds``; ``--cpus`` (``_timing.pin``); ``--ks`` and ``--targets``,
  comma-separated lists (the targets of :data:`TOPOLOGIES`, default all).

  >>> p = parser("Demo.", quick="short", ks="k", targets=True)
  >>> a = p.parse_args(["--quick", "--ks", "1,4"])
  >>> a.quick, a.ks, a.targets, a.out == output_folder(None, True)
  (True, [1, 4], ['h100', 'tpu-v5e'], True)"""
  p = _Parser(
    description=doc.split("\n\n", maxsplit=1)[0],
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  p.out_folder = out
  p.check_targets = targets
  if quick:
    p.add_argument("--quick", action="store_true", help=quick)
  if out:
    p.add_argument(
      "--out",
      type=pathlib.Path,
      help="output folder (default: benchmarks/results; quick: the temporary folder)",
    )
  if rounds:
    p.add_argument("--rounds", type=int, help=rounds)
  if cpus:
    p.add_argument(
      "--cpus",
      help="run on these CPUs only, e.g. 0-3 or 0,2 (before JAX starts; default: "
      "the CPUs this process may use)",
    )
  if ks:
    p.add_argument("--ks", type=ints, help=ks)
  if targets:
    p.add_argument(
      "--targets",
      type=names,
      default=list(TOPOLOGIES),
      help=f"comma-separated, of {', '.join(TOPOLOGIES)} (default: all)",
    )
  return p
