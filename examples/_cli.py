"""The examples' command line, read off the signature of their ``main``.

A helper of the examples, not one of them. Every keyword argument of ``main``
becomes a flag with the same default: ``num_micro_batches: int = 8`` gives
``--num-micro-batches 8``, ``progress: bool = True`` gives ``--no-progress``,
a ``False`` default gives ``--NAME``, and a tuple takes several values.
"""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable
from typing import Any


def command_line(main: Callable[..., Any], doc: str | None) -> Any:
  """Parses ``sys.argv`` into ``main``'s keyword arguments and calls it."""
  parser = argparse.ArgumentParser(description=(doc or "").strip().splitlines()[0])
  shown = "default: %(default)s"
  for name, param in inspect.signature(main).parameters.items():
    flag, default = "--" + name.replace("_", "-"), param.default
    if isinstance(default, bool):
      if default:
        parser.add_argument(
          f"--no-{flag[2:]}", dest=name, action="store_false", help=f"{name}=False"
        )
      else:
        parser.add_argument(flag, dest=name, action="store_true", help=f"{name}=True")
    elif isinstance(default, tuple):
      parser.add_argument(
        flag, dest=name, type=type(default[0]), nargs="+", default=default, help=shown
      )
    else:
      parser.add_argument(
        flag, dest=name, type=type(default), default=default, help=shown
      )
  args = vars(parser.parse_args())
  return main(**{n: tuple(v) if isinstance(v, list) else v for n, v in args.items()})
