"""Splitting a batch into micro-batches, and validating the batch first.

The split is a reshape of the leading axis, so nothing is transposed and no
row moves between devices. On one device ``(B, ...)`` becomes ``(k, m, ...)``
with ``B = k * m``: micro-batch ``i`` holds rows ``i*m .. (i+1)*m - 1``. A
batch laid out in ``S`` blocks (sharded over ``S`` devices) becomes
``(S, k, m / S, ...)``: micro-batch ``i`` holds the ``i``-th slice of every
block, ``m / S`` rows each, so each device keeps computing its own rows
(:meth:`MicroBatching.rows` lists them). The data-parallel path uses the same
layout with one block per device and runs ``fun`` per block.

Batch leaves that live in host memory (``memory_kind="pinned_host"``) are
streamed: :class:`MicroBatches` slices micro-batch ``i + 1`` out of the host
array and copies it to device memory while micro-batch ``i`` computes, so that
only two micro-batches of them are ever in device memory.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxaccum import _checks, _compat, _options

PyTree = Any


class MicroBatching(NamedTuple):
  """How a batch of ``batch_size`` rows is cut: ``num_micro_batches * micro_batch_size``.

  Attributes:
    batch_size: rows in the batch (one device's, in the data-parallel path).
    num_micro_batches: ``k``.
    micro_batch_size: ``m``, rows per micro-batch.
    shards: ``S``, the blocks the batch is laid out in: micro-batch ``i``
      holds the ``i``-th slice of ``m / S`` rows of every block. 1 on one
      device (contiguous micro-batches); for a batch on ``N`` devices
      ``gcd(m, N)``, so that no row leaves its device; in the data-parallel
      path the data devices, one block each.
  """

  batch_size: int
  num_micro_batches: int
  micro_batch_size: int
  shards: int = 1

  def rows(self) -> np.ndarray:
    """The batch rows of each micro-batch, shape ``(k, m)``.

    >>> MicroBatching(8, 2, 4).rows().tolist()
    [[0, 1, 2, 3], [4, 5, 6, 7]]
    >>> MicroBatching(8, 2, 4, shards=2).rows().tolist()
    [[0, 1, 4, 5], [2, 3, 6, 7]]
    """
    k, s = self.num_micro_batches, self.shards
    ids = np.arange(self.batch_size).reshape(s, k, self.micro_batch_size // s)
    return ids.transpose(1, 0, 2).reshape(k, self.micro_batch_size)


def leading_batch_size(batch: dict[str, PyTree]) -> int:
  """Returns the leading-axis size shared by every leaf of the batch.

  Args:
    batch: the batch arguments by name, e.g. ``{"args[1]": (x, y)}``; the
      names appear in error messages.

  Raises:
    TypeError: for a leaf that is not an array (a Python list of numbers, a
      string), naming it.
    ValueError: if the batch has no array leaves, a leaf is a scalar, or the
      leaves disagree on their leading size (every size is named).

  >>> import jax.numpy as jnp
  >>> leading_batch_size({"args[1]": (jnp.ones((8, 2)), jnp.ones(8))})
  8
  """
  sizes = {}
  for name, tree in batch.items():
    for path, leaf in jax.tree_util.tree_leaves_with_path(
      tree, is_leaf=_is_number_list
    ):
      where = name + jax.tree_util.keystr(path)
      if _is_number_list(leaf):
        raise TypeError(
          f"Batch leaf {where} is a Python list, not an array: pass "
          "jnp.asarray(...) of it (JAX would take each element of a list as a "
          "leaf of its own)."
        )
      shape = getattr(leaf, "shape", None)
      if shape is None:
        raise TypeError(
          f"Batch leaf {where} is {_checks.shown(leaf)}, not an "
          "array: pass Python values as arguments outside batch_argnums, which "
          "reach every micro-batch unchanged."
        )
      if len(shape) == 0:
        refuse_rows(batch)
        raise ValueError(
          f"Batch leaf {where} is a scalar (shape=()); every batch leaf "
          "needs a leading batch axis."
        )
      sizes[where] = shape[0]
  if not sizes:
    raise ValueError(f"The batch arguments {list(batch)} hold no arrays to split.")
  if len(set(sizes.values())) > 1:
    refuse_rows(batch)
    raise ValueError(
      f"Batch leaves have different leading sizes ({_by_size(sizes)}); they "
      "must share one batch axis."
    )
  return next(iter(sizes.values()))


def _by_size(sizes: dict[str, int]) -> str:
  """The leaves by leading size, each size with its first leaf and a count
  of the others, at most four sizes.

  >>> _by_size({"a[0]": 16, "a[1]": 16, "a[2]": 16, "b": 64})
  'a[0] and 2 more: 16, b: 64'
  """
  first: dict[int, list[str]] = {}
  for where, size in sizes.items():
    first.setdefault(size, []).append(where)
  shown = [
    f"{names[0]}{f' and {len(names) - 1} more' if len(names) > 1 else ''}: {size}"
    for size, names in list(first.items())[:4]
  ]
  return ", ".join(shown) + (", ..." if len(first) > 4 else "")


def _is_rows(x: Any) -> bool:
  """A Python list of two or more arrays (or trees of them) of one structure
  and shapes: rows, one per example, where a batch leaf was meant."""
  if not isinstance(x, list) or len(x) < 2:
    return False
  shapes = lambda e: [getattr(a, "shape", None) for a in jax.tree.leaves(e)]  # noqa: E731
  first, structure = shapes(x[0]), str(jax.tree.structure(x[0]))
  return (
    bool(first)
    and None not in first
    and all(str(jax.tree.structure(e)) == structure and shapes(e) == first for e in x)
  )


def refuse_rows(batch: dict[str, PyTree], num_micro_batches: int | None = None) -> None:
  """Raises, saying how to stack them, if a batch argument holds a Python list
  of rows (``[row0, row1, ...]``): each row is a leaf of its own, split along
  its own first axis. Called where the batch's sizes fail a check. A list of
  equal arrays can also be meant (crops of one batch), so a list counts as
  rows only where stacking it gives a batch that fits: as many rows as the
  other leaves have, and divisible by ``num_micro_batches`` if given.

  >>> refuse_rows({"args[1]": [jnp.ones(16)] * 64})
  Traceback (most recent call last):
  ValueError: Batch args[1] is a Python list of 64 arrays of shape (16,), one per example? Each is a batch leaf of its own, split along its own first axis. Stack them into one array with a leading batch axis: jnp.stack(rows), of shape (64, 16).
  >>> refuse_rows({"args[1]": ([jnp.ones(16)] * 64, jnp.ones(10))})  # not rows
  """
  lists = [
    (name + jax.tree_util.keystr(path), rows)
    for name, tree in batch.items()
    for path, rows in jax.tree_util.tree_leaves_with_path(tree, is_leaf=_is_rows)
    if _is_rows(rows)
  ]
  others = {
    x.shape[0]
    for x in jax.tree.leaves(list(batch.values()), is_leaf=_is_rows)
    if not _is_rows(x) and len(getattr(x, "shape", ())) > 0
  }
  for where, rows in lists:
    n = len(rows)
    if others - {n} or (num_micro_batches and n % num_micro_batches):
      continue
    if hasattr(rows[0], "shape"):
      what = f"arrays of shape {tuple(rows[0].shape)}"
      fix = f"jnp.stack(rows), of shape {(n, *rows[0].shape)}"
    else:
      what = f"{type(rows[0]).__name__}s of arrays"
      fix = "jax.tree.map(lambda *xs: jnp.stack(xs), *rows)"
    raise ValueError(
      f"Batch {where} is a Python list of {n} {what}, one per example? Each is "
      "a batch leaf of its own, split along its own first axis. Stack them "
      f"into one array with a leading batch axis: {fix}."
    )


def _is_number_list(x: Any) -> bool:
  """A Python list whose elements are numbers or such lists (a leaf meant as
  an array); a list of arrays is a container and stays one."""
  return isinstance(x, list) and all(
    isinstance(e, numbers.Number) or _is_number_list(e) for e in x
  )


def plan_split(
  batch_size: int,
  num_micro_batches: int | None = None,
  micro_batch_size: int | None = None,
  shards: int = 1,
  *,
  leaf: str = "the batch",
  devices: int = 1,
) -> MicroBatching:
  """Resolves the split of ``batch_size`` rows.

  Args:
    batch_size: rows in the (local) batch.
    num_micro_batches: ``k``; give this or ``micro_batch_size``.
    micro_batch_size: ``m``; give this or ``num_micro_batches``.
    shards: the devices the batch lives on, ``N``; the batch is laid out in
      ``gcd(m, N)`` blocks (see :class:`MicroBatching`).
    leaf: the batch leaf that errors name (its path).
    devices: the data-parallel devices that each hold ``batch_size`` rows
      (``mesh=``), for the padding that errors suggest.

  Returns:
    The ``MicroBatching`` with ``batch_size == k * m``.

  Raises:
    ValueError: for an empty batch, or sizes that do not divide, naming them.

  >>> plan_split(12, num_micro_batches=4)
  MicroBatching(batch_size=12, num_micro_batches=4, micro_batch_size=3, shards=1)
  >>> plan_split(12, micro_batch_size=6).num_micro_batches
  2
  """
  if batch_size == 0:
    given = (
      f"{num_micro_batches=}"
      if num_micro_batches is not None
      else f"{micro_batch_size=}"
    )
    raise ValueError(
      f"The batch is empty (batch_size=0): nothing to split into micro-batches ({given})."
    )
  if num_micro_batches is not None:
    name, size = "num_micro_batches", int(num_micro_batches)
  else:
    assert micro_batch_size is not None
    name, size = "micro_batch_size", int(micro_batch_size)
  if batch_size % size:
    raise ValueError(_does_not_divide(batch_size, name, size, leaf, devices))
  k = size if name == "num_micro_batches" else batch_size // size
  m = batch_size // k
  return MicroBatching(batch_size, k, m, math.gcd(m, shards))


def _does_not_divide(batch_size: int, name: str, size: int, leaf: str, devices: int):
  """The error for a ``num_micro_batches`` or ``micro_batch_size`` that does
  not divide the batch: the leaf, the sizes that fit and how to pad.

  >>> print(_does_not_divide(250, "num_micro_batches", 4, "args[1][0]", 1))
  batch_size=250 (the rows of args[1][0]) is not divisible by num_micro_batches=4. The num_micro_batches up to 4 that divide 250: 1, 2. Or pad the batch with jaxaccum.pad_batch(batch, 4), which returns (padded_batch, mask), and use the mask as the weight with normalize="weighted": fun returns (jnp.sum(losses * mask), jnp.sum(mask)).
  """
  fits = [d for d in range(1, min(size, batch_size) + 1) if batch_size % d == 0]
  shown = ", ".join(map(str, fits[-8:]))
  listing = f"{'..., ' if len(fits) > 8 else ''}{shown}"
  multiple = size * devices
  pad_args = str(multiple) if name == "num_micro_batches" else f"{name}={multiple}"
  if size > batch_size:
    first = (
      f"{name}={size} is more than the {batch_size} rows of {leaf}"
      + (" on each device" if devices > 1 else "")
      + (
        ": each micro-batch needs at least one row."
        if name == "num_micro_batches"
        else ": a micro-batch cannot hold more rows than the batch has."
      )
    )
  else:
    first = f"{batch_size=} (the rows of {leaf}) is not divisible by {name}={size}."
  return (
    f"{first} The {name} up to {min(size, batch_size)} that divide {batch_size}: "
    f"{listing}. Or pad the batch with jaxaccum.pad_batch(batch, {pad_args}), which "
    "returns (padded_batch, mask), and use the mask as the weight with "
    'normalize="weighted": fun returns (jnp.sum(losses * mask), jnp.sum(mask)).'
  )


def first_leaf(batch: dict[str, PyTree]) -> str:
  """The path of the batch's first leaf, as errors name it.

  >>> first_leaf({"args[1]": (jnp.ones(2), jnp.ones(2))})
  'args[1][0]'
  """
  for name, tree in batch.items():
    for path, _ in jax.tree_util.tree_leaves_with_path(tree):
      return name + jax.tree_util.keystr(path)
  return "the batch"


def batch_devices(batch: PyTree) -> int:
  """The number of devices the batch lives on: its sharding's devices (a
  concrete array), or its mesh's (a traced one); 1 on one device.

  The split lays a batch on ``N`` devices out in ``S = gcd(m, N)`` blocks
  (:func:`plan_split`), whatever axes the batch is sharded over, so that no
  row leaves its device: under ``jit`` on Auto axes the layout is not
  visible, and every even sharding over the mesh's devices is covered.

  >>> import jax.numpy as jnp
  >>> batch_devices({"x": jnp.ones((8, 2))})
  1
  """
  return max((_devices(x) for x in jax.tree.leaves(batch)), default=1)


def _devices(x: Any) -> int:
  sharding = getattr(x, "sharding", None)
  if sharding is not None and not _compat.is_tracer(x):
    return len(sharding.device_set)
  mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
  return 1 if mesh is None or mesh.empty else int(mesh.size)


def _reshape_leading(
  x: jax.Array, shape: tuple[int, ...], split: MicroBatching
) -> jax.Array:
  """``x`` with its leading axis reshaped to ``shape``; on Explicit mesh axes
  the sharding of the leading axis goes to the first new axis.

  Raises:
    ValueError: on Explicit axes, where that first axis (``k``, or the ``S``
      blocks) does not divide among the devices the rows are sharded over.
  """
  out_shape = (*shape, *x.shape[1:])
  spec = _compat.explicit_spec(x)
  if spec is None:
    return x.reshape(out_shape)
  _check_rows_divide(x, shape[0], split)
  entries = (*tuple(spec)[:1], *(None,) * (len(shape) - 1), *tuple(spec)[1:])
  sharding = jax.typeof(x).sharding.update(spec=jax.sharding.PartitionSpec(*entries))
  return jax.lax.reshape(x, out_shape, out_sharding=sharding)


def _check_rows_divide(x: jax.Array, first: int, split: MicroBatching) -> None:
  """On Explicit axes a sharded leading axis must stay sharded: the first
  axis of the split layout, of size ``first``, takes its mesh axes."""
  sharding = jax.typeof(x).sharding
  entry = sharding.spec[0] if len(sharding.spec) else None
  axes = entry if isinstance(entry, tuple) else (entry,)
  n = math.prod(sharding.mesh.shape[a] for a in axes if a is not None)
  if first % n == 0:
    return
  b, k, m = split.batch_size, split.num_micro_batches, split.micro_batch_size
  fits = [d for d in range(2, b + 1) if b % d == 0 and (b // d) % n == 0]
  raise ValueError(
    f"Under plain jit, a batch leaf of shape {x.shape} has its {b} rows "
    f"sharded over {n} devices ({entry!r} of an Explicit mesh), and "
    f"k={k} micro-batches of m={m} rows cannot each take an equal share of "
    f"every device's rows: m is not a multiple of {n}. "
    + (
      f"num_micro_batches={fits[0]}"
      + "".join(f", {d}" for d in fits[1:8])
      + f" make m a multiple of {n}"
      if fits
      else f"No num_micro_batches >= 2 makes m a multiple of {n}"
    )
    + "; or pass mesh= and data_axis= (each device then splits its own rows)."
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
  """Hands micro-batch ``i`` of a batch to the loop body.

  Every leaf is laid out as ``(k, m, ...)``, or ``(S, k, m / S, ...)`` with
  several blocks (:func:`split`). With one block, device leaves are scanned
  over (:meth:`scanned`); with several, the body takes the ``i``-th slice of
  every block (:meth:`take`), so that no row leaves its device. Leaves in host
  memory are streamed: :meth:`fetch` slices micro-batch ``i`` out of the host
  array and copies it into device memory. The engine fetches micro-batch
  ``i + 1`` in the body that computes micro-batch ``i`` and carries it to the
  next iteration, so the copy can overlap the computation (double buffering).

  ``per_block=True`` (the data-parallel path) keeps the block axis in front
  of micro-batch ``i``, ``(S, m / S, ...)``, for a ``vmap`` over it; otherwise
  the blocks' slices form one micro-batch of ``m`` rows.

  >>> import jax.numpy as jnp
  >>> mb = MicroBatches({"x": jnp.arange(6)}, MicroBatching(6, 3, 2))
  >>> mb.take(jax.tree.map(lambda x: x[1], mb.scanned()), mb.fetch(1), 1)["x"].tolist()
  [2, 3]
  """

  def __init__(self, batch: PyTree, split: MicroBatching, per_block: bool = False):
    leaves, self._treedef = jax.tree.flatten(batch)
    k, m, s = split.num_micro_batches, split.micro_batch_size, split.shards
    self._blocked = s > 1 or per_block
    self._per_block = per_block
    self._axis = 1 if self._blocked else 0
    shape = (s, k, m // s) if self._blocked else (k, m)
    self._host = tuple(in_host_memory(x) for x in leaves)
    # A host leaf in one block stays ``(B, ...)``: its micro-batch is a slice
    # of rows, copied as it is. Reshaping it to ``(k, m, ...)`` would be a
    # relayout in host memory (a TPU compiler refuses it for a leaf narrower
    # than its tile).
    self._leaves = [
      x if host and not self._blocked else _reshape_leading(x, shape, split)
      for x, host in zip(leaves, self._host, strict=True)
    ]
    self._rows = m
    self.num_micro_batches = k

  @property
  def streamed(self) -> bool:
    """Whether any leaf lives in host memory."""
    return any(self._host)

  def scanned(self) -> tuple[Any, ...]:
    """The device leaves to scan over, ``(k, m, ...)``; None where a leaf is
    taken by index instead (host leaves, and every leaf with several blocks)."""
    return tuple(
      None if host or self._blocked else x
      for x, host in zip(self._leaves, self._host, strict=True)
    )

  def fetch(self, index: jax.Array | int) -> tuple[Any, ...]:
    """Micro-batch ``index`` of the host leaves, copied to device memory."""
    return tuple(
      jax.device_put(self._host_slice(x, index), jax.memory.Space.Device)
      if host
      else None
      for x, host in zip(self._leaves, self._host, strict=True)
    )

  def _host_slice(self, x: jax.Array, index: jax.Array | int) -> jax.Array:
    """Micro-batch ``index`` of a host leaf, still in host memory: rows
    ``index * m .. (index + 1) * m - 1`` of a ``(B, ...)`` leaf, or the
    ``index``-th slice of every block."""
    if self._blocked:
      return self._slice(x, index)
    m = self._rows
    return jax.lax.dynamic_slice_in_dim(x, index * m, m, axis=0)

  def take(
    self, scanned: tuple[Any, ...], fetched: tuple[Any, ...], index: jax.Array | int
  ) -> PyTree:
    """Micro-batch ``index``, from its scanned, fetched and indexed leaves."""
    leaves = []
    for x, s, f, host in zip(self._leaves, scanned, fetched, self._host, strict=True):
      micro = f if host else (s if not self._blocked else self._slice(x, index))
      if self._blocked and not self._per_block:
        micro = _merge_blocks(micro)
      leaves.append(micro)
    return jax.tree.unflatten(self._treedef, leaves)

  def _slice(self, x: jax.Array, index: jax.Array | int) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(x, index, axis=self._axis, keepdims=False)

  def next_index(self, index: jax.Array) -> jax.Array:
    """The micro-batch to prefetch while ``index`` computes (the last one
    fetches itself again rather than reading past the batch)."""
    return jnp.minimum(index + 1, self.num_micro_batches - 1)


def _merge_blocks(x: jax.Array) -> jax.Array:
  """``(S, m/S, ...)`` to ``(m, ...)``: the blocks' slices as one micro-batch."""
  out_shape = (x.shape[0] * x.shape[1], *x.shape[2:])
  spec = _compat.explicit_spec(x)
  if spec is None:
    return x.reshape(out_shape)
  entries = (*tuple(spec)[:1], *tuple(spec)[2:])
  sharding = jax.typeof(x).sharding.update(spec=jax.sharding.PartitionSpec(*entries))
  return jax.lax.reshape(x, out_shape, out_sharding=sharding)


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
  _options.check_split_sizes(num_micro_batches, micro_batch_size)
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
