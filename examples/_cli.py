"""The examples' command lines, parsed before JAX is imported.

A helper of the examples, not one of them. Each example builds an
``argparse`` parser from these pieces in its ``parse_args`` and parses
``sys.argv`` first thing, before it imports JAX (which takes seconds): so
``--help``, a mistyped flag or a bad value answers at once, with the usage
and exit code 2, never with a traceback. Only the standard library is
imported here.

The flags are ``main``'s keyword arguments, dashed: ``num_micro_batches``
is ``--num-micro-batches``, and ``progress=False`` is ``--no-progress``.
Numbers are checked by their ``type=`` (``positive_int`` and the like);
values that must agree with each other (a batch that divides into the
micro-batches) by the example's ``parse_args``, with ``parser.error``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
  """Shows each option's default, except for on/off flags and ``None``."""

  def _get_help_string(self, action: argparse.Action) -> str | None:
    if action.nargs == 0 or action.default is None:  # a flag; explained in help
      return action.help
    if isinstance(action.default, tuple):  # as it is typed: --flag 8 64
      return f"{action.help} (default: {' '.join(map(str, action.default))})"
    return super()._get_help_string(action)


def parser(doc: str | None) -> argparse.ArgumentParser:
  """An ``ArgumentParser`` described by the first paragraph of ``doc``."""
  first = (doc or "").strip().split("\n\n")[0]
  return argparse.ArgumentParser(
    description=" ".join(first.replace("``", "").split()),
    epilog="What it shows, and how: the docstring at the top of examples/%(prog)s.",
    formatter_class=_Formatter,
  )


def _whole_number(text: str, low: int) -> int:
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
  if value < low:
    raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
  return value


def positive_int(text: str) -> int:
  """An ``argparse`` type: a whole number >= 1."""
  return _whole_number(text, 1)


def non_negative_int(text: str) -> int:
  """An ``argparse`` type: a whole number >= 0."""
  return _whole_number(text, 0)


def int_at_least(low: int) -> Callable[[str], int]:
  """An ``argparse`` type: a whole number >= ``low``."""
  return lambda text: _whole_number(text, low)


def _number(text: str) -> float:
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
  if not math.isfinite(value):
    raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
  return value


def positive_float(text: str) -> float:
  """An ``argparse`` type: a finite number > 0."""
  value = _number(text)
  if value <= 0:
    raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
  return value


def probability(text: str) -> float:
  """An ``argparse`` type: a number in [0, 1), such as a dropout rate."""
  value = _number(text)
  if not 0 <= value < 1:
    raise argparse.ArgumentTypeError(f"must be at least 0 and below 1, got {text}")
  return value


def decay_rate(text: str) -> float:
  """An ``argparse`` type: a number strictly between 0 and 1."""
  value = _number(text)
  if not 0 < value < 1:
    raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
  return value


def add_run_options(
  parser: argparse.ArgumentParser, *, outputs: str, seed_help: str
) -> None:
  """``--out-dir``, ``--seed`` and ``--no-progress``, which every example has."""
  parser.add_argument(
    "--out-dir", metavar="DIR", default="outputs", help=f"the folder for {outputs}"
  )
  parser.add_argument(
    "--seed", type=non_negative_int, metavar="N", default=0, help=seed_help
  )
  parser.add_argument(
    "--no-progress",
    dest="progress",
    action="store_false",
    help="no progress bar",
  )


def check_batch_fits(
  parser: argparse.ArgumentParser, args: argparse.Namespace, rows: int
) -> None:
  """Exits with a usage error when ``--num-micro-batches`` times
  ``--micro-batch-size`` is more than the ``rows`` training images."""
  batch_size = args.num_micro_batches * args.micro_batch_size
  if batch_size > rows:
    parser.error(
      f"the batch of {args.num_micro_batches} x {args.micro_batch_size} = "
      f"{batch_size} rows is more than the {rows} training images"
    )


def keyword_arguments(args: argparse.Namespace) -> dict[str, Any]:
  """The parsed flags as ``main``'s keyword arguments (lists become tuples)."""
  return {n: tuple(v) if isinstance(v, list) else v for n, v in vars(args).items()}
