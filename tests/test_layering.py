"""The imports point one way (docs/architecture.md): read from every module
of ``jaxaccum/`` with ``ast``, at any depth of the module (a function's own
import counts), and each rule fails naming the offending import."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "jaxaccum"

FEATURES = ("_parallel", "_privacy", "_optim", "_pipeline")
ENTRIES = ("_value_and_grad", "_train_step")
TOP = ("_inspect", "testing", "nnx", "_nnx_objects", "__init__")


def module_name(path):
  parts = path.relative_to(ROOT.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path):
  """Every jaxaccum module ``path`` imports: ``from jaxaccum import _x``
  counts as ``jaxaccum._x``, ``from jaxaccum._x import y`` as
  ``jaxaccum._x`` (and ``jaxaccum._x.y`` where that is a module)."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names if a.name.startswith("jaxaccum")}
    elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
      "jaxaccum"
    ):
      found.add(node.module)
      for alias in node.names:
        sub = f"{node.module}.{alias.name}"
        as_path = ROOT.parent / pathlib.Path(*sub.split("."))
        if as_path.with_suffix(".py").exists() or (as_path / "__init__.py").exists():
          found.add(sub)
  return found


def layer(name):
  """``"core"``, a feature package's name, ``"entry"`` or ``"top"``."""
  parts = name.split(".")
  first = parts[1] if len(parts) > 1 else "__init__"
  if first in FEATURES:
    return first
  if first in ENTRIES:
    return "entry"
  if first in TOP:
    return "top"
  return "core"


MODULES = {module_name(p): imports(p) for p in sorted(ROOT.rglob("*.py"))}


def offending(rule):
  """``[(module, import)]`` breaking ``rule(module_layer, import_layer)``."""
  return [
    (module, imported)
    for module, found in sorted(MODULES.items())
    for imported in sorted(found)
    if imported != "jaxaccum" and not rule(layer(module), layer(imported))
  ]


def test_the_modules_are_found():
  assert "jaxaccum._engine" in MODULES and "jaxaccum._privacy.ghost" in MODULES
  assert ("jaxaccum._privacy.options", "jaxaccum._options") in [
    (m, i) for m, found in MODULES.items() for i in found
  ], "the reader misses a module-level from-import"


def test_the_core_imports_no_feature_entry_or_inspection():
  assert offending(lambda mine, theirs: mine != "core" or theirs == "core") == []


def test_parallel_and_privacy_never_import_each_other():
  pair = {"_parallel", "_privacy"}
  assert (
    offending(lambda mine, theirs: not ({mine, theirs} == pair and mine != theirs))
    == []
  )


def test_the_pipeline_stands_alone():
  assert (
    offending(lambda mine, theirs: mine != "_pipeline" or theirs in {"core", mine})
    == []
  )


def test_features_import_only_the_core_and_optim_reads_privacy():
  def rule(mine, theirs):
    if mine not in FEATURES or theirs in {"core", mine}:
      return True
    return (mine, theirs) == ("_optim", "_privacy")

  assert offending(rule) == []


def test_entries_and_features_never_import_the_top():
  assert offending(lambda mine, theirs: mine == "top" or theirs != "top") == []


@pytest.mark.parametrize(
  ("module", "imported", "rule"),
  [
    ("jaxaccum._engine", "jaxaccum._privacy", "core"),
    ("jaxaccum._parallel.unreduced", "jaxaccum._privacy.ghost", "pair"),
  ],
)
def test_a_wrong_import_is_named(module, imported, rule, monkeypatch):
  """The rules can fail: one wrong import added to the reading is named."""
  monkeypatch.setitem(MODULES, module, MODULES[module] | {imported})
  if rule == "core":
    found = offending(lambda mine, theirs: mine != "core" or theirs == "core")
  else:
    pair = {"_parallel", "_privacy"}
    found = offending(
      lambda mine, theirs: not ({mine, theirs} == pair and mine != theirs)
    )
  assert (module, imported) in found
