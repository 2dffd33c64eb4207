"""The generated pages: the blocks of ``benchmarks/README.md``, ``README.md``,
``docs/guide.md`` and ``examples/README.md``, each written from
``benchmarks/results/*.json`` by the benchmark that measured it, and the
formatting they share.

Usage::

  python benchmarks/_report.py          # rewrite the generated blocks
  python benchmarks/_report.py --check  # exit 1 with a diff if one is stale

A block stands between ``<!-- begin: step_time dispatch_mlp -->`` and
``<!-- end: step_time dispatch_mlp -->``: the first word names the JSON, the
rest the block. Each script's ``BLOCKS`` maps its block names to the
functions that write them (:data:`SCRIPTS`); :func:`render` replaces what
stands between the markers and leaves the fixed text around them as it is.
``tests/test_manuals.py`` checks that each committed page is what it writes.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import pathlib
import platform
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from types import ModuleType
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
MANUAL = HERE / "README.md"
RESULTS = HERE / "results"

Results = dict[str, Any]

# ---------------------------------------------------------------- the machine


def cpu_model() -> str:
  """The CPU's model name from ``/proc/cpuinfo`` (``platform.processor()``
  is often empty on Linux), for the JSON's record of the machine."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


# ---------------------------------------------------------------- formatting


def format_bytes(n: float) -> str:
  """Bytes in binary units, e.g. ``1.5 MiB``."""
  for unit in ("B", "KiB", "MiB"):
    if abs(n) < 1024:
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
    n /= 1024
  return f"{n:.2f} GiB"


def mib(n: float | None, digits: int = 0) -> str:
  """Bytes as MiB with thousands separators: ``2,400`` or ``4.02``."""
  return "–" if n is None else f"{n / 2**20:,.{digits}f}"


def gib(n: float | None, digits: int = 2) -> str:
  return "–" if n is None else f"{n / 2**30:,.{digits}f}"


def ratio(x: float | None) -> str:
  """A ratio, two decimals."""
  return "–" if x is None else f"{x:.2f}"


def ms(x: float) -> str:
  """Milliseconds to three significant digits (``0.138``, ``33.3``, ``1,540``)."""
  if x >= 100:
    return f"{x:,.0f}"
  if x >= 10:
    return f"{x:.1f}"
  if x >= 1:
    return f"{x:.2f}"
  return f"{x:.3f}"


def count(n: float) -> str:
  return f"{n:,.0f}"


def duration(seconds: float) -> str:
  """``45 s`` or ``7 minutes``."""
  return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} minutes"


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
  """A Markdown table."""
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)


def columns(items: Iterable[Any], spec: dict[str, Callable[[Any], Any]]) -> str:
  """A Markdown table of ``items``, a column per entry of ``spec``: its
  header, and the function that writes an item's cell.

  >>> print(columns([1, 2], {"n": str, "n²": lambda n: n * n}))
  | n | n² |
  |---|---|
  | 1 | 1 |
  | 2 | 4 |
  """
  return table(list(spec), [[cell(item) for cell in spec.values()] for item in items])


def date(text: str) -> str:
  return text[:10]


def command_line(command: str, argv: Sequence[str] | None) -> str:
  """``command`` and its arguments, less ``--out DIR`` (where it wrote)."""
  args = list(argv or [])
  while "--out" in args:
    i = args.index("--out")
    del args[i : i + 2]
  return " ".join([command, *args])


def met(ok: bool) -> str:
  return "met" if ok else "not met"


#: A timing goal is decided only where the run's A/A ratio (one approach
#: timed twice in the same interleaved rounds, its second median over its
#: first) is within this of 1, as printed (two decimals).
AA_TOLERANCE = 0.03


def aa_decides(aa: float | None) -> bool:
  """Whether an A/A ratio is close enough to 1 to decide a timing goal.

  >>> aa_decides(1.03), aa_decides(1.034), aa_decides(0.96), aa_decides(None)
  (True, True, False, False)
  """
  return aa is not None and abs(float(f"{aa:.2f}") - 1) <= AA_TOLERANCE + 1e-9


def aa_note(aa: float | None) -> str:
  """``A/A 1.01``, or ``no A/A control in this run`` (a JSON from before it)."""
  return "no A/A control in this run" if aa is None else f"A/A {aa:.2f}"


def capital(text: str) -> str:
  """``text`` with its first letter upper-cased (``str.capitalize`` lowers
  the rest: ``A/A`` would read ``a/a``)."""
  return text[:1].upper() + text[1:]


def timed_verdict(ok: bool, aa: float | None) -> str:
  """A timing goal's outcome: ``met`` or ``missed`` where the A/A ratio
  decides it (:func:`aa_decides`), else ``undecided (A/A 1.07)``.

  >>> timed_verdict(True, 1.01), timed_verdict(False, 1.07), timed_verdict(True, None)
  ('met', 'undecided (A/A 1.07)', 'undecided (no A/A control in this run)')
  """
  if not aa_decides(aa):
    return f"undecided ({aa_note(aa)})"
  return "met" if ok else "missed"


def pyplot() -> Any:
  """``matplotlib.pyplot`` on the Agg backend, imported when a script plots
  (importing a script for its blocks plots nothing)."""
  import matplotlib  # noqa: PLC0415

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  return plt


def k_axis(
  ax: Any,
  ks: Sequence[int],
  ylabel: str,
  *,
  xlabel: str = "micro-batches per step, k",
  logy: bool = False,
  title: str | None = None,
) -> None:
  """An axis against ``k``: log 2, a tick at each ``k``, a light grid; a
  linear y axis starts at 0."""
  ax.set_xscale("log", base=2)
  if logy:
    ax.set_yscale("log")
  else:
    ax.set_ylim(0, None)
  ax.set_xticks(ks, [str(k) for k in ks])
  ax.set(xlabel=xlabel, ylabel=ylabel)
  ax.grid(True, which="both" if logy else "major", alpha=0.3)
  if title:
    ax.set_title(title, fontsize=9)


# ---------------------------------------------------------------- the pages

#: The generated pages.
PAGES: dict[str, pathlib.Path] = {
  "benchmarks": MANUAL,
  "readme": ROOT / "README.md",
  "guide": ROOT / "docs" / "guide.md",
  "examples": ROOT / "examples" / "README.md",
}
#: The blocks that are not on the benchmarks' manual, and their pages.
ELSEWHERE = {
  "readme_commands times": "readme",
  "autopilot summary": "guide",
  "dp_lm result": "examples",
  "fp8_lm result": "examples",
}
#: The JSON stem -> the script in this folder whose ``BLOCKS`` write its
#: blocks (the benchmark that measures it; the three whose scripts live in
#: ``examples/`` keep theirs in ``_example_blocks.py``).
SCRIPTS = {
  "step_time": "step_time",
  "eager_calls": "eager_calls",
  "communication": "communication",
  "meshes": "meshes",
  "fsdp": "fsdp",
  "accelerator_memory": "accelerator_memory",
  "accelerator_causes": "accelerator_memory",
  "input_pipeline": "_example_blocks",
  "autopilot": "_example_blocks",
  "dp_lm": "_example_blocks",
  "fp8_lm": "_example_blocks",
  "readme_commands": "readme_commands",
  "dp": "dp",
  "dp_audit": "dp",
  "pipeline": "pipeline",
  "maxtext_llama": "maxtext_llama",
}
#: Blocks whose data is several JSON files, and their stems.
MULTI_SOURCES = {
  "input_pipeline": {
    "device": "input_pipeline_device",
    "pinned_host": "input_pipeline_pinned_host",
  },
  "accelerator_causes": {
    "sweep": "accelerator_memory",
    "causes": "accelerator_memory_causes",
  },
}
#: The command that writes a JSON, where it is not ``python
#: benchmarks/SCRIPT.py``.
COMMANDS = {
  "accelerator_causes": "python benchmarks/accelerator_memory.py --causes",
  "input_pipeline": "python examples/input_pipeline.py",
  "autopilot": "python examples/autopilot.py --write-results",
  "dp_lm": "python examples/dp_lm.py --write-results",
  "fp8_lm": "python examples/fp8_lm.py --write-results",
  "dp_audit": "python benchmarks/dp.py --part audit",
}
#: ``"source name"`` -> the function writing that block from ``source.json``,
#: and the page of each block: filled from the scripts' ``BLOCKS`` on first
#: use (:func:`blocks`).
BLOCKS: dict[str, Callable[[Results], str]] = {}
PAGE_OF: dict[str, str] = {}
_MARKERS = re.compile(
  r"(<!-- begin: (?P<name>[\w\-]+ [\w\-]+) -->\n)(?P<body>.*?)(<!-- end: (?P=name) -->)",
  re.DOTALL,
)


def _script(name: str) -> ModuleType:
  """``benchmarks/NAME.py``: the module already imported from that file (a
  script that runs and renders), or the file imported as ``_bench_NAME``
  (``examples/`` has a ``pipeline.py`` too, which ``import pipeline`` could
  find first)."""
  path = HERE / f"{name}.py"
  for module in list(sys.modules.values()):
    file = getattr(module, "__file__", None)
    if file and pathlib.Path(file).resolve() == path:
      return module
  spec = importlib.util.spec_from_file_location(f"_bench_{name}", path)
  assert spec is not None and spec.loader is not None
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # for its dataclasses
  spec.loader.exec_module(module)
  return module


def blocks() -> dict[str, Callable[[Results], str]]:
  """Every block writer, by name, from the scripts of :data:`SCRIPTS`."""
  if not BLOCKS:
    for name in dict.fromkeys(SCRIPTS.values()):
      for block, writer in _script(name).BLOCKS.items():
        if SCRIPTS.get(block.split()[0]) != name:
          raise ValueError(f"{name}.py writes {block!r}, whose JSON is not its own")
        BLOCKS[block] = writer
        PAGE_OF[block] = ELSEWHERE.get(block, "benchmarks")
  return BLOCKS


def load(source: str, results_dir: pathlib.Path) -> Results | None:
  """The JSON of ``source`` (a stem of ``results_dir``), or None if absent."""
  if source in MULTI_SOURCES:
    runs = {}
    for key, stem in MULTI_SOURCES[source].items():
      path = results_dir / f"{stem}.json"
      if path.exists():
        runs[key] = json.loads(path.read_text())
    return runs or None
  path = results_dir / f"{source}.json"
  return json.loads(path.read_text()) if path.exists() else None


def write_block(name: str, results_dir: pathlib.Path = RESULTS) -> str:
  """The text of block ``name`` from the JSON in ``results_dir``."""
  writer = blocks()[name]
  source = name.split(maxsplit=1)[0]
  data = load(source, results_dir)
  if data is None:
    return (
      f"_No results yet: `benchmarks/results/{source}.json` does not exist. "
      f"`{COMMANDS.get(source, f'python benchmarks/{SCRIPTS[source]}.py')}` writes it._"
    )
  return writer(data).strip("\n")


def render(
  text: str, results_dir: pathlib.Path = RESULTS, page: str = "benchmarks"
) -> str:
  """``text`` (the page ``page``) with every generated block rewritten from
  ``results_dir``.

  Raises:
    ValueError: for a block name no script writes or that belongs to
      another page, or a block of the page that the text lacks.
  """
  blocks()
  found = [m.group("name") for m in _MARKERS.finditer(text)]
  mine = {name for name, p in PAGE_OF.items() if p == page}
  unknown = sorted(set(found) - mine)
  missing = sorted(mine - set(found))
  if unknown or missing:
    raise ValueError(
      f"{page}: blocks not written there by the benchmarks: {unknown}; "
      f"blocks missing: {missing}"
    )

  def replace(m: re.Match[str]) -> str:
    body = write_block(m.group("name"), results_dir)
    return f"{m.group(1)}\n{body}\n\n{m.group(4)}"

  return _MARKERS.sub(replace, text)


def main(argv: Sequence[str] | None = None) -> int:
  """Rewrites the pages (or, with ``--check``, diffs them); the exit code."""
  import _paths  # noqa: PLC0415  (benchmarks/ is on the path from the module's end)

  parser = _paths.parser(__doc__, out=False)
  parser.add_argument(
    "--check",
    action="store_true",
    help="write nothing; exit 1 and print a diff if a page is stale",
  )
  parser.add_argument("--results", type=pathlib.Path, default=RESULTS)
  args = parser.parse_args(argv)
  stale = False
  for page, path in PAGES.items():
    old = path.read_text()
    new = render(old, args.results, page)
    if old == new:
      print(f"{path}: up to date")
    elif args.check:
      sys.stdout.writelines(
        difflib.unified_diff(
          old.splitlines(keepends=True),
          new.splitlines(keepends=True),
          f"{path} (committed)",
          f"{path} (from {args.results})",
        )
      )
      print(f"\n{path} is stale: run `python benchmarks/_report.py`.")
      stale = True
    else:
      path.write_text(new)
      print(f"{path}: rewritten from {args.results}")
  return 1 if stale else 0


sys.path.insert(0, str(HERE))  # the benchmarks import each other by name
# A script run as __main__ that imports _report gets this module, not a copy.
sys.modules.setdefault("_report", sys.modules[__name__])

if __name__ == "__main__":
  sys.exit(main())
