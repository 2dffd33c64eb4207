"""Runs the manuals' code blocks in this process, as a user who copies them
would: ``python tests/manual_blocks.py {run,names} BLOCKS.json``, started
by ``test_manual_blocks.py`` in a fresh process without the suite's
conftest. ``BLOCKS.json`` is a list of ``[page, line, source]``, the source
padded with blank lines so that tracebacks give the page's line numbers.

- ``run``: each block in a namespace of its own.
- ``names``: only each block's imports, then every dotted name it reads
  from what it imported (``jaxaccum.testing.collectives``), looked up as
  the block would. A submodule found only because another block imported
  it (``import jaxaccum`` alone does not load it) is an error too: a user
  running that block alone would get ``AttributeError``.

It prints ``ok PAGE LINE`` for each block that passes, writes every failure
to stderr, named by page and line, and exits 1 if any failed.
"""

import ast
import contextlib
import importlib
import json
import sys
import traceback
import types


def run(page: str, source: str) -> None:
  exec(compile(source, page, "exec"), {"__name__": "__main__"})


def _imports(tree: ast.Module) -> tuple[list[ast.stmt], set[str]]:
  """The block's import statements and the modules they name (each with its
  parents: ``import a.b`` loads ``a`` too)."""
  statements: list[ast.stmt] = []
  named: set[str] = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module:
      names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    else:
      continue
    statements.append(node)
    for name in names:
      parts = name.split(".")
      named.update(".".join(parts[: i + 1]) for i in range(len(parts)))
  return statements, named


def _chains(tree: ast.Module, roots: set[str]) -> list[tuple[int, list[str]]]:
  """Every outermost ``root.a.b`` read in the block, ``root`` a name bound
  by its imports and never assigned."""
  assigned = {
    n.id
    for n in ast.walk(tree)
    if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)
  }
  inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
  chains = []
  for node in ast.walk(tree):
    if not isinstance(node, ast.Attribute) or id(node) in inner:
      continue
    parts, value = [], node
    while isinstance(value, ast.Attribute):
      parts.insert(0, value.attr)
      value = value.value
    if isinstance(value, ast.Name) and value.id in roots - assigned:
      chains.append((node.lineno, [value.id, *parts]))
  return chains


def names(page: str, source: str, fresh: set[str]) -> None:
  """Runs the block's imports and looks up every dotted name it reads."""
  tree = ast.parse(source, page)
  statements, named = _imports(tree)
  namespace: dict = {}
  exec(compile(ast.Module(statements, []), page, "exec"), namespace)
  for line, (root, *attributes) in _chains(tree, set(namespace) - {"__builtins__"}):
    value, path = namespace[root], root
    for attribute in attributes:
      path = f"{path}.{attribute}"
      if not hasattr(value, attribute):
        raise AttributeError(f"line {line}: {path}: {value!r} has no {attribute!r}.")
      value = getattr(value, attribute)
      if not isinstance(value, types.ModuleType):
        break  # a class or a function: its attributes are not imports
      if value.__name__ not in fresh | named:
        raise AttributeError(
          f"line {line}: {path} is there only because another block imported "
          f"{value.__name__}: this block alone fails with AttributeError."
        )


def main(mode: str, path: str) -> int:
  with open(path) as file:
    blocks = json.load(file)
  fresh: set[str] = set()
  if mode == "names":  # what a fresh import of each top-level package loads
    for _, _, source in blocks:
      for name in _imports(ast.parse(source))[1]:
        with contextlib.suppress(ImportError):  # the block's own fails, named
          importlib.import_module(name.split(".")[0])
    fresh = set(sys.modules)
  failed = []
  for page, line, source in blocks:
    try:
      if mode == "run":
        run(page, source)
      else:
        names(page, source, fresh)
    except BaseException:
      failed.append(f"{page}, the block at line {line}:\n{traceback.format_exc()}")
    else:
      print("ok", page, line, flush=True)
  sys.stderr.write("\n".join(failed))
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main(*sys.argv[1:]))
