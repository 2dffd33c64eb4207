"""Splitting a batch into micro-batches, and validating the batch first.

The split is a C-order reshape of the leading axis: ``(B, ...)`` becomes
``(k, m, ...)`` with ``B = k * m``, so micro-batch ``i`` holds rows
``i*m .. (i+1)*m - 1``. Nothing is transposed. Inside a data-parallel
``shard_map`` the same reshape runs on each device's local shard, so micro-batch
``i`` is the ``i``-th contiguous slice of every shard and no data moves between
devices. (The reshape itself is free; XLA may still copy the current
micro-batch out of the batch inside the loop, as it would for any slice.)

Batch leaves that live in host memory (``memory_kind="pinned_host"``) are not
reshaped: :class:`MicroBatches` streams them, slicing micro-batch ``i + 1`` out
of the host array and copying it to device memory while micro-batch ``i``
computes, so that only two micro-batches of them are ever in device memory.
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

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
    if isinstance(size, bool) or not isinstance(size, numbers.Integral):
      raise TypeError(
        f"{name} must be an integer (a Python or numpy int), got {size!r} "
        f"of type {type(size).__name__}."
      )
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
    num_micro_batches = int(num_micro_batches)
    if batch_size % num_micro_batches:
      raise ValueError(f"{batch_size=} is not divisible by {num_micro_batches=}.")
    return MicroBatching(batch_size, num_micro_batches, batch_size // num_micro_batches)
  assert micro_batch_size is not None
  micro_batch_size = int(micro_batch_size)
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


def in_host_memory(x: Any) -> bool:
  """Whether ``x`` lives in host memory (e.g. ``memory_kind="pinned_host"``).

  >>> import jax.numpy as jnp
  >>> in_host_memory(jnp.ones(2))
  False
  """
  space = getattr(jax.typeof(x), "memory_space", None)
  return space == jax.memory.Space.Host


class MicroBatches:
  """Hands micro-batch ``i`` of a batch to the scan body.

  Leaves in device memory are reshaped to ``(k, m, ...)`` and scanned over
  (:meth:`scanned`). Leaves in host memory are streamed: :meth:`fetch` slices
  micro-batch ``i`` out of the host array by index and copies it into device
  memory. The engine fetches micro-batch ``i + 1`` in the body that computes
  micro-batch ``i`` and carries it to the next iteration, so the copy can
  overlap the computation (double buffering), and only two micro-batches of
  the host leaves are in device memory at a time.

  >>> import jax.numpy as jnp
  >>> mb = MicroBatches({"x": jnp.arange(6)}, 3)
  >>> mb.take(jax.tree.map(lambda x: x[1], mb.scanned()), mb.fetch(1))["x"].tolist()
  [2, 3]
  """

  def __init__(self, batch: PyTree, num_micro_batches: int):
    leaves, self._treedef = jax.tree.flatten(batch)
    self._leaves = leaves
    self._host = tuple(in_host_memory(x) for x in leaves)
    self.num_micro_batches = num_micro_batches
    self.micro_batch_size = leaves[0].shape[0] // num_micro_batches if leaves else 0

  @property
  def streamed(self) -> bool:
    """Whether any leaf lives in host memory."""
    return any(self._host)

  def scanned(self) -> tuple[Any, ...]:
    """The device leaves as ``(k, m, ...)`` (None for the host leaves)."""
    return tuple(
      None if host else split(x, self.num_micro_batches)
      for x, host in zip(self._leaves, self._host, strict=True)
    )

  def fetch(self, index: jax.Array | int) -> tuple[Any, ...]:
    """Micro-batch ``index`` of the host leaves, in device memory."""
    m = self.micro_batch_size

    def copy(x):
      micro = jax.lax.dynamic_slice_in_dim(x, index * m, m, axis=0)
      return jax.device_put(micro, jax.memory.Space.Device)

    return tuple(
      copy(x) if host else None
      for x, host in zip(self._leaves, self._host, strict=True)
    )

  def take(self, scanned: tuple[Any, ...], fetched: tuple[Any, ...]) -> PyTree:
    """Micro-batch ``i`` from its scanned and its fetched leaves."""
    leaves = [
      f if host else s for s, f, host in zip(scanned, fetched, self._host, strict=True)
    ]
    return jax.tree.unflatten(self._treedef, leaves)

  def next_index(self, index: jax.Array) -> jax.Array:
    """The micro-batch to prefetch while ``index`` computes (the last one
    fetches itself again rather than reading past the batch)."""
    return jnp.minimum(index + 1, self.num_micro_batches - 1)


def pad_batch(
  batch: PyTree,
  num_micro_batches: int | None = None,
  *,
  micro_batch_size: int | None = None,
) -> tuple[PyTree, Any]:
  """Pads a ragged batch so that it splits, and masks the padding.

  Every leaf is padded along its leading axis to the next multiple of
  ``num_micro_batches`` (or of ``micro_batch_size``), by repeating its last
  row: the padded rows hold real values, so a loss stays finite on them. The
  mask is ``1.0`` for real rows and ``0.0`` for padding. Use it as the weight
  with ``normalize="weighted"``, and the result is the mean over the real
  rows alone, as if the batch had not been padded. Under ``mesh=``, pad to a
  multiple of ``num_micro_batches`` times the number of data-parallel
  devices.

  Args:
    batch: a pytree of arrays (numpy or jax) sharing a leading batch axis.
    num_micro_batches: pad to a multiple of this; or give ``micro_batch_size``.
    micro_batch_size: pad to a multiple of this.

  Returns:
    ``(padded_batch, mask)``: leaves of the same kind (numpy stays numpy) and
    a float32 mask of the padded length.

  Raises:
    ValueError: for an empty batch, or leaves of different leading sizes.

  >>> import numpy as np, jaxaccum
  >>> x = np.arange(5.0)
  >>> padded, mask = jaxaccum.pad_batch(x, 4)
  >>> padded.tolist(), mask.tolist()
  ([0.0, 1.0, 2.0, 3.0, 4.0, 4.0, 4.0, 4.0], [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
  """
  check_split_arguments(num_micro_batches, micro_batch_size)
  multiple = num_micro_batches if num_micro_batches is not None else micro_batch_size
  assert multiple is not None
  multiple = int(multiple)
  size = leading_batch_size({"batch": batch})
  if size == 0:
    raise ValueError("pad_batch got an empty batch (batch_size=0); nothing to repeat.")
  padded = -(-size // multiple) * multiple

  def pad(x):
    width = [(0, padded - size)] + [(0, 0)] * (x.ndim - 1)
    return (
      np.pad(x, width, mode="edge")
      if isinstance(x, np.ndarray)
      else jnp.pad(x, width, mode="edge")
    )

  mask = np.zeros(padded, np.float32)
  mask[:size] = 1.0
  return jax.tree.map(pad, batch), mask


def merge_micro_batches(tree: PyTree) -> PyTree:
  """Merges the micro-batch axis back into the batch axis: ``(k, m, ...)``
  becomes ``(k * m, ...)``.

  The stacked aux of :func:`jaxaccum.value_and_grad` has a leading axis of
  length ``k`` (one entry per micro-batch); per-example aux (logits, per-row
  losses) merged this way is in the batch's own row order, also under
  ``mesh=`` (there the leading axis is ``devices * k``).

  >>> import jax.numpy as jnp, jaxaccum
  >>> jaxaccum.merge_micro_batches(jnp.arange(6).reshape(3, 2)).tolist()
  [0, 1, 2, 3, 4, 5]
  """

  def merge(x):
    if jnp.ndim(x) < 2:
      raise ValueError(
        f"merge_micro_batches needs leaves of shape (k, m, ...), got shape={jnp.shape(x)}: "
        "a per-micro-batch scalar has no rows to merge."
      )
    return x.reshape((x.shape[0] * x.shape[1], *x.shape[2:]))

  return jax.tree.map(merge, tree)
