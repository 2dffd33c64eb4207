"""The public API, snapshotted: names, signatures and NamedTuple fields.

Code outside the project depends on these (``../shared/DESIGN.md``). A
change to ``jaxaccum`` or ``jaxaccum.nnx`` that renames or drops anything
fails here. An intended extension (a new keyword, a new function) updates
``tests/data/public_api.txt`` by running this file as a script:
``python tests/test_public_api.py > tests/data/public_api.txt``.
"""

import inspect
import pathlib
import sys

SNAPSHOT = pathlib.Path(__file__).parent / "data" / "public_api.txt"


def _signature(fun) -> str:
  """Parameter names, kinds and defaults; annotations are not the contract."""
  sig = inspect.signature(fun)
  params = [
    p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()
  ]
  return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def _describe(module_name: str, name: str, obj) -> list[str]:
  where = f"{module_name}.{name}"
  if inspect.isclass(obj):
    fields = getattr(obj, "_fields", None)
    if fields is not None:
      return [f"{where}: NamedTuple{tuple(fields)}"]
    lines = [f"{where}: class"]
    for attr, member in sorted(vars(obj).items()):
      if attr.startswith("_") or not callable(member):
        continue
      lines.append(f"{where}.{attr}{_signature(member)}")
    return lines
  if callable(obj):
    return [f"{where}{_signature(obj)}"]
  return [f"{where} = {type(obj).__name__}"]


def describe_public_api() -> str:
  import jaxaccum  # noqa: PLC0415

  lines = []
  for module in (jaxaccum, jaxaccum.nnx):
    for name in sorted(vars(module)):
      obj = getattr(module, name)
      if name.startswith("_") or (inspect.ismodule(obj) and name != "nnx"):
        continue
      if module is jaxaccum.nnx and getattr(obj, "__module__", "") != "jaxaccum.nnx":
        continue
      if inspect.ismodule(obj):
        lines.append(f"{module.__name__}.{name}: module")
        continue
      lines += _describe(module.__name__, name, obj)
  return "\n".join(lines) + "\n"


def test_the_public_api_is_the_snapshot():
  assert describe_public_api() == SNAPSHOT.read_text(), (
    "The public API changed. If that is intended (an extension, never a "
    "rename), rewrite tests/data/public_api.txt: "
    "python tests/test_public_api.py > tests/data/public_api.txt"
  )


if __name__ == "__main__":
  sys.stdout.write(describe_public_api())


def test_the_signatures_defaults_are_the_options_defaults():
  """value_and_grad and jaxaccum.nnx.value_and_grad spell their defaults out
  (they are the documented API); the options object holds them too, for
  make_train_step and the rest. They must agree."""
  import jaxaccum  # noqa: PLC0415
  from jaxaccum import _options  # noqa: PLC0415

  def fun(w, x):
    return w

  for public in (jaxaccum.value_and_grad, jaxaccum.nnx.value_and_grad):
    defaults = {
      name: p.default
      for name, p in inspect.signature(public).parameters.items()
      if p.default is not inspect.Parameter.empty
      and name not in ("num_micro_batches", "wrt")
    }
    spelled = _options.create(fun, 1, **defaults)
    assert vars(spelled) == vars(_options.create(fun, 1)), public


def _docs_api():
  """docs/api.py, the API reference's builder and docstring check."""
  import importlib.util  # noqa: PLC0415

  path = pathlib.Path(__file__).parents[1] / "docs" / "api.py"
  spec = importlib.util.spec_from_file_location("jaxaccum_docs_api", path)
  assert spec is not None and spec.loader is not None
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_every_public_name_has_a_docstring():
  assert _docs_api().undocumented() == []


def test_the_docstring_check_names_a_public_name_without_one(monkeypatch):
  """The check can fail: a function and a NamedTuple field without one."""
  import jaxaccum  # noqa: PLC0415

  def helper(x):
    return x

  monkeypatch.setattr(jaxaccum.nnx, "helper", helper, raising=False)
  monkeypatch.setattr(jaxaccum.nnx, "__all__", [*jaxaccum.nnx.__all__, "helper"])
  monkeypatch.setattr(
    jaxaccum.Deviation, "__doc__", jaxaccum.Deviation.__doc__.replace("where:", "at:")
  )
  assert _docs_api().undocumented() == [
    "jaxaccum.Deviation.where",
    "jaxaccum.nnx.helper",
  ]


def test_the_version_is_read_from_one_place():
  """pyproject.toml reads jaxaccum.__version__; the installed metadata and
  the changelog's newest release agree with it."""
  import importlib.metadata  # noqa: PLC0415
  import re  # noqa: PLC0415

  import jaxaccum  # noqa: PLC0415

  root = pathlib.Path(__file__).parents[1]
  pyproject = (root / "pyproject.toml").read_text()
  assert 'dynamic = ["version"]' in pyproject
  assert re.search(r'^version\s*=\s*"', pyproject, re.M) is None
  assert importlib.metadata.version("jaxaccum") == jaxaccum.__version__
  changelog = (root / "CHANGELOG.md").read_text()
  releases = re.findall(
    r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", changelog, re.M
  )
  assert releases[0] == jaxaccum.__version__


def test_every_public_name_is_in_all_so_that_the_reference_documents_it():
  """pdoc, and so docs/api.py's docstring check, follows ``__all__``: a
  public name left out of it had no entry in the API reference."""
  import jaxaccum  # noqa: PLC0415

  for module in (jaxaccum, jaxaccum.nnx):
    public = {
      name
      for name, obj in vars(module).items()
      if not name.startswith("_")
      and (not inspect.ismodule(obj) or name == "nnx")
      and getattr(obj, "__module__", "jaxaccum").startswith("jaxaccum")
    }
    assert public == set(module.__all__), module.__name__


def _private_imports(source: str) -> list[str]:
  """The private jaxaccum modules a file imports or reaches by attribute."""
  import ast  # noqa: PLC0415

  found = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.ImportFrom) and node.module:
      if node.module.startswith("jaxaccum._"):
        found.append(node.module)
      elif node.module.startswith("jaxaccum"):
        found += [
          f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")
        ]
    elif isinstance(node, ast.Import):
      found += [a.name for a in node.names if a.name.startswith("jaxaccum._")]
    elif (
      isinstance(node, ast.Attribute)
      and isinstance(node.value, ast.Name)
      and node.value.id == "jaxaccum"
      and node.attr.startswith("_")
      and not node.attr.startswith("__")
    ):
      found.append(f"jaxaccum.{node.attr}")
  return found


def test_benchmarks_and_examples_use_the_public_api_only():
  """What a benchmark needs to read a compiled step is what a user checking
  their own step needs (jaxaccum.testing.compile_step): no file under
  benchmarks/ or examples/ imports a private jaxaccum module."""
  root = pathlib.Path(__file__).parents[1]
  files = sorted([*root.glob("benchmarks/*.py"), *root.glob("examples/*.py")])
  assert files
  found = {
    str(f.relative_to(root)): names
    for f in files
    if (names := _private_imports(f.read_text()))
  }
  assert found == {}
  assert _private_imports(
    "from jaxaccum import _hlo, testing\nimport jaxaccum._memory"
  ) == [
    "jaxaccum._hlo",
    "jaxaccum._memory",
  ]
  assert _private_imports("import jaxaccum\njaxaccum._memory.compile_for") == [
    "jaxaccum._memory"
  ]
