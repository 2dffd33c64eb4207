"""Splitting a batch into micro-batches, and validating the batch first.

The split is a free, C-order reshape of the leading axis: ``(B, ...)`` becomes
``(k, m, ...)`` with ``B = k * m``, so micro-batch ``i`` holds rows
``i*m .. (i+1)*m - 1``. Nothing is transposed or copied. Inside a data-parallel
``shard_map`` the same reshape runs on each device's local shard, so micro-batch
``i`` is the ``i``-th contiguous slice of every shard and no data moves between
devices.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

PyTree = Any


class MicroBatching(NamedTuple):
  """How a batch of ``batch_size`` rows is cut: ``num_micro_batches * micro_batch_size``."""

  batch_size: int
  num_micro_batches: int
  micro_batch_size: int


def check_split_arguments(
  num_micro_batches: int | None, micro_batch_size: int | None
) -> None:
  """Raises ``ValueError`` unless exactly one positive split size is given."""
  if (num_micro_batches is None) == (micro_batch_size is None):
    raise ValueError(
      "Give exactly one of num_micro_batches and micro_batch_size, got "
      f"{num_micro_batches=} and {micro_batch_size=}."
    )
  for name, size in (
    ("num_micro_batches", num_micro_batches),
    ("micro_batch_size", micro_batch_size),
  ):
    if size is None:
      continue
    if isinstance(size, bool) or not isinstance(size, int):
      raise TypeError(f"{name} must be a Python int, got {size!r}.")
    if size <= 0:
      raise ValueError(f"{name} must be positive, got {name}={size}.")


def leading_batch_size(batch: dict[str, PyTree]) -> int:
  """Returns the leading-axis size shared by every leaf of the batch.

  Args:
    batch: the batch arguments by name, e.g. ``{"args[1]": (x, y)}``; the
      names appear in error messages.

  Raises:
    ValueError: if the batch has no array leaves, a leaf is a scalar, or the
      leaves disagree on their leading size (every size is named).

  >>> import jax.numpy as jnp
  >>> leading_batch_size({"args[1]": (jnp.ones((8, 2)), jnp.ones(8))})
  8
  """
  sizes = {}
  for name, tree in batch.items():
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
      where = name + jax.tree_util.keystr(path)
      shape = getattr(leaf, "shape", None)
      if shape is None:
        raise TypeError(
          f"Batch leaf {where} is a {type(leaf).__name__}, not an array; "
          "pass Python scalars as non-batch arguments."
        )
      if len(shape) == 0:
        raise ValueError(
          f"Batch leaf {where} is a scalar (shape=()); every batch leaf "
          "needs a leading batch axis."
        )
      sizes[where] = shape[0]
  if not sizes:
    raise ValueError(f"The batch arguments {list(batch)} hold no arrays to split.")
  if len(set(sizes.values())) > 1:
    listing = ", ".join(f"{where}: {size}" for where, size in sizes.items())
    raise ValueError(
      f"Batch leaves have different leading sizes ({listing}); they must "
      "share one batch axis."
    )
  return next(iter(sizes.values()))


def plan_split(
  batch_size: int,
  num_micro_batches: int | None = None,
  micro_batch_size: int | None = None,
) -> MicroBatching:
  """Resolves the split of ``batch_size`` rows.

  Args:
    batch_size: rows in the (local) batch.
    num_micro_batches: ``k``; give this or ``micro_batch_size``.
    micro_batch_size: ``m``; give this or ``num_micro_batches``.

  Returns:
    The ``MicroBatching`` with ``batch_size == k * m``.

  Raises:
    ValueError: if the sizes do not divide, naming them.

  >>> plan_split(12, num_micro_batches=4)
  MicroBatching(batch_size=12, num_micro_batches=4, micro_batch_size=3)
  >>> plan_split(12, micro_batch_size=6).num_micro_batches
  2
  """
  check_split_arguments(num_micro_batches, micro_batch_size)
  if num_micro_batches is not None:
    if batch_size % num_micro_batches:
      raise ValueError(f"{batch_size=} is not divisible by {num_micro_batches=}.")
    return MicroBatching(batch_size, num_micro_batches, batch_size // num_micro_batches)
  assert micro_batch_size is not None
  if batch_size % micro_batch_size:
    raise ValueError(f"{batch_size=} is not divisible by {micro_batch_size=}.")
  return MicroBatching(batch_size, batch_size // micro_batch_size, micro_batch_size)


def split(batch: PyTree, num_micro_batches: int) -> PyTree:
  """Reshapes every leaf from ``(B, ...)`` to ``(k, B // k, ...)``, C-order.

  >>> import jax.numpy as jnp
  >>> split(jnp.arange(6), 3).tolist()
  [[0, 1], [2, 3], [4, 5]]
  """
  return jax.tree.map(
    lambda x: x.reshape(
      (num_micro_batches, x.shape[0] // num_micro_batches, *x.shape[1:])
    ),
    batch,
  )
