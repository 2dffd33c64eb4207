"""jaxaccum's API reference, generated from its docstrings with pdoc.

  python docs/api.py              # writes docs/api/ (open docs/api/index.html)
  python docs/api.py --check      # exits 1, naming them, if a public name has no docstring

The reference covers the public modules, ``jaxaccum`` (its ``__all__``),
``jaxaccum.nnx`` and ``jaxaccum.testing``: every function and class, each
public method, and each field of a NamedTuple, which its class documents in
its ``Attributes:`` section. Needs the ``docs`` extra (``pip install -e
".[docs]"``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import pathlib
import re
import sys
import warnings

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# pdoc adds jaxaccum.nnx, which jaxaccum's __all__ names; jaxaccum.testing,
# imported on its own, is named here.
MODULES = ("jaxaccum", "jaxaccum.testing")
CHECKED = ("jaxaccum", "jaxaccum.nnx", "jaxaccum.testing")
OUT = pathlib.Path(__file__).parent / "api"


def _documented_fields(docstring: str) -> set[str]:
  """The names an ``Attributes:`` section of a Google-style docstring lists."""
  match = re.search(r"^\s*Attributes:\n((?:\s+.*\n?)*)", docstring, re.M)
  if not match:
    return set()
  return set(re.findall(r"^\s+(\w+)(?: \(.*?\))?:", match.group(1), re.M))


def undocumented() -> list[str]:
  """The public names, in the modules pdoc documents, without a docstring."""
  import pdoc.doc  # noqa: PLC0415

  missing = []

  def walk(d: pdoc.doc.Namespace, fields: set[str]) -> None:
    members = d.own_members if isinstance(d, pdoc.doc.Class) else d.members.values()
    for m in members:
      if m.name.startswith("_"):
        continue
      text = m.docstring.strip()
      auto = text.startswith("Alias for field number")
      if isinstance(m, pdoc.doc.Variable) and (not text or auto):
        if m.name not in fields:
          missing.append(m.fullname)
      elif not text:
        missing.append(m.fullname)
      if isinstance(m, pdoc.doc.Class):
        walk(m, _documented_fields(m.docstring))

  for name in CHECKED:  # fresh models (Module.from_name caches its own)
    walk(pdoc.doc.Module(importlib.import_module(name)), set())
  return missing


def build(out: pathlib.Path) -> None:
  """Writes the HTML reference of the package into ``out``."""
  import pdoc  # noqa: PLC0415

  pdoc.render.configure(docformat="google", search=True, show_source=True)
  with warnings.catch_warnings():
    # Annotations that name private types (the NamedTuples' fields under
    # `from __future__ import annotations`) are shown as written.
    warnings.filterwarnings("ignore", "Error parsing type annotation")
    pdoc.pdoc(*MODULES, output_directory=out)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--check",
    action="store_true",
    help="only check that every public name has a docstring",
  )
  parser.add_argument("--out", type=pathlib.Path, default=OUT, help="output folder")
  args = parser.parse_args(argv)
  missing = undocumented()
  if missing:
    print(
      f"{len(missing)} public name(s) without a docstring: " + ", ".join(missing),
      file=sys.stderr,
    )
    return 1
  if args.check:
    print("every public name has a docstring")
    return 0
  build(args.out)
  print(f"API reference written to {args.out}/index.html")
  return 0


if __name__ == "__main__":
  sys.exit(main())
