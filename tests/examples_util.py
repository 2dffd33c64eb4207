"""Imports the scripts in examples/ for the example smoke tests.

pytest puts this folder (tests/, which has no ``__init__.py``) on ``sys.path``,
so a test imports this module as ``from examples_util import load_example``.
"""

import importlib.util
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def load_example(name: str) -> types.ModuleType:
  """Imports ``examples/<name>.py`` as the module ``example_<name>``, once.

  The examples folder goes on ``sys.path`` first, as ``python
  examples/<name>.py`` puts it, so that the examples' sibling imports
  (``from _digits import digits_split``) work. ``name`` may also be one of
  those helpers, e.g. ``load_example("_digits").TRAIN_ROWS``.
  """
  if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))
  module_name = f"example_{name}"
  if module_name in sys.modules:
    return sys.modules[module_name]
  spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / f"{name}.py")
  assert spec is not None and spec.loader is not None
  module = importlib.util.module_from_spec(spec)
  # Registered before it runs: Linen modules (dataclasses) look up their module.
  sys.modules[module_name] = module
  spec.loader.exec_module(module)
  return module
