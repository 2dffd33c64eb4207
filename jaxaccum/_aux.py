"""The aux of ``fun``, combined over the micro-batches as the full batch's.

The loop hands over ``fun``'s aux stacked: every leaf with a leading axis of
``n``, one entry per micro-batch, in the global micro-batch order (device
``d``'s micro-batches ``d*k .. d*k+k-1`` under ``mesh=``), together with the
micro-batch weights in the same order (:class:`Stacked`). Each aux leaf is then
combined by an accumulation type, a value with one ``combine`` function, as in
``optax.microbatching`` (``accumulator=``):

- ``"concatenate"``: the entries joined along their leading axis, in the
  batch's row order (:func:`jaxaccum.merge_micro_batches`): logits and
  per-example losses come back with the full batch's ``B`` rows.
- ``"mean"``: the mean over the micro-batches, weighted by the micro-batch
  weights, so that a metric that is a mean over a micro-batch's rows (or, with
  ``normalize="weighted"``, over its real tokens) becomes the full batch's
  mean. A total weight of zero gives zeros, as the loss does.
- ``"sum"``: the sum over the micro-batches (counts).
- ``"stack"``: the entries as they are, ``(n, ...)``: jaxaccum 0.1.0's aux.

The default, ``"auto"``, picks one of the first two per leaf: a leaf whose
leading axis has the micro-batch's row count (the rows one call of ``fun``
sees) is concatenated; every other leaf, scalars included, takes the mean. A
leaf whose leading axis has that size by coincidence (a per-class vector
when there are as many classes as rows) is concatenated too: name its type in
``aux=`` then.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxaccum import _normalize

PyTree = Any


class Stacked(NamedTuple):
  """The per-micro-batch aux, as the loop hands it over.

  Attributes:
    aux: ``fun``'s aux, every leaf ``(n, ...)``: one entry per micro-batch, in
      the global micro-batch order.
    weights: the micro-batch weights, shape=(n,), in the same order (ones
      unless ``normalize="weighted"``).
    rows: the rows of one entry, as one call of ``fun`` saw them.
    shards: the blocks each entry's rows come from (``S`` under plain ``jit``
      over a sharded batch, see :class:`jaxaccum._split.MicroBatching`; 1
      otherwise, where the entries follow each other in batch order).
  """

  aux: PyTree
  weights: jax.Array
  rows: int
  shards: int = 1


class Accumulation(NamedTuple):
  """One accumulation type: how the ``n`` entries of one aux leaf combine.

  Attributes:
    name: the name passed to ``aux=``.
    combine: ``(leaf, stacked, where) -> leaf``: ``leaf`` is ``(n, ...)``,
      ``stacked`` the :class:`Stacked` it came from, ``where`` the leaf's path
      for errors.
  """

  name: str
  combine: Callable[[jax.Array, Stacked, str], jax.Array]


def _concatenate(x: jax.Array, stacked: Stacked, where: str) -> jax.Array:
  if jnp.ndim(x) < 2:
    raise ValueError(
      f'aux="concatenate" for {where}, a scalar per micro-batch: it has no axis '
      'to join along. Use "mean", "sum" or "stack" for it.'
    )
  if x.shape[1] % stacked.shards:
    raise ValueError(
      f'aux="concatenate" for {where}, of shape={tuple(x.shape[1:])} per '
      f"micro-batch: its leading axis does not split into the {stacked.shards} "
      "blocks that each micro-batch's rows come from (a batch sharded over "
      'devices under plain jit). Use "stack" for it.'
    )
  return merge_micro_batches(x, shards=stacked.shards)


def _mean(x: jax.Array, stacked: Stacked, where: str) -> jax.Array:
  del where
  x = jnp.asarray(x)
  floating = jnp.issubdtype(x.dtype, jnp.floating)
  if x.shape[0] == 1:  # one micro-batch: its aux, unchanged (a float, as below)
    return x[0] if floating else x[0].astype(jnp.float32)
  dtype = jnp.promote_types(jnp.float32, x.dtype) if floating else jnp.float32
  weights = stacked.weights.astype(dtype).reshape((-1,) + (1,) * (x.ndim - 1))
  total = jnp.sum(stacked.weights.astype(dtype))
  mean = _normalize.safe_divide(jnp.sum(x.astype(dtype) * weights, axis=0), total)
  return mean.astype(x.dtype) if floating else mean


def _sum(x: jax.Array, stacked: Stacked, where: str) -> jax.Array:
  del stacked, where
  # In the leaf's dtype; jnp.sum adds bfloat16 and float16 in float32.
  return jnp.sum(x, axis=0)


def _stack(x: jax.Array, stacked: Stacked, where: str) -> jax.Array:
  del stacked, where
  return x


def _auto(x: jax.Array, stacked: Stacked, where: str) -> jax.Array:
  if has_rows(x, stacked.rows):
    return _concatenate(x, stacked, where)
  return _mean(x, stacked, where)


def has_rows(x: Any, rows: int) -> bool:
  """Whether a stacked leaf ``(n, ...)`` has a row axis: its entries' leading
  axis has the micro-batch's ``rows``.

  >>> has_rows(jnp.zeros((4, 8, 10)), 8), has_rows(jnp.zeros((4,)), 8)
  (True, False)
  """
  return jnp.ndim(x) >= 2 and jnp.shape(x)[1] == rows


CONCATENATE = Accumulation("concatenate", _concatenate)
MEAN = Accumulation("mean", _mean)
SUM = Accumulation("sum", _sum)
STACK = Accumulation("stack", _stack)
AUTO = Accumulation("auto", _auto)
TYPES = {a.name: a for a in (AUTO, CONCATENATE, MEAN, SUM, STACK)}


def check_spec(spec: Any) -> None:
  """Raises unless every leaf of ``spec`` (``aux=``) names an accumulation
  type; definition-time.

  >>> check_spec({"logits": "concatenate", "acc": "mean"})
  >>> check_spec("max")
  Traceback (most recent call last):
  ValueError: Unknown aux='max'; choose one of ['auto', 'concatenate', 'mean', 'stack', 'sum'], or a tree prefix of fun's aux with these as leaves.
  """
  leaves = jax.tree.leaves(spec)
  if not leaves:
    raise ValueError(
      f"aux={spec!r} names no accumulation type; choose one of {sorted(TYPES)}, "
      "or a tree prefix of fun's aux with these as leaves."
    )
  for leaf in leaves:
    if not (isinstance(leaf, str) and leaf in TYPES):
      shown = spec if leaf is spec else leaf
      raise ValueError(
        f"Unknown aux={shown!r}; choose one of {sorted(TYPES)}, or a tree "
        "prefix of fun's aux with these as leaves."
      )


def combine(spec: Any, stacked: Stacked) -> PyTree:
  """The aux combined over the micro-batches, leaf by leaf.

  Args:
    spec: ``aux=``: an accumulation type's name, or a tree prefix of the aux
      with names as leaves.
    stacked: the stacked aux, its weights and its row layout.

  Returns:
    The aux with every leaf combined by its type.

  Raises:
    ValueError: at trace time, if ``spec`` is not a tree prefix of the aux, or
      a leaf cannot take its type, naming the leaf.

  >>> stacked = Stacked({"logits": jnp.arange(6.0).reshape(3, 2), "acc": jnp.array([0.5, 1.0, 0.0])}, jnp.ones(3), rows=2)
  >>> out = combine("auto", stacked)
  >>> out["logits"].tolist(), out["acc"].tolist()
  ([0.0, 1.0, 2.0, 3.0, 4.0, 5.0], 0.5)
  """
  try:
    types = jax.tree.map(
      lambda name, subtree: jax.tree.map(lambda _: TYPES[name], subtree),
      spec,
      stacked.aux,
    )
  except ValueError:
    raise ValueError(
      f"aux={spec!r} is not a tree prefix of fun's aux, whose structure is "
      f"{jax.tree.structure(stacked.aux)}: give one type for all "
      "leaves, or a tree like the aux's top with a type per subtree."
    ) from None
  is_type = lambda x: isinstance(x, Accumulation)  # noqa: E731
  flat_types = jax.tree.leaves(types, is_leaf=is_type)
  paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(stacked.aux)
  combined = [
    accumulation.combine(x, stacked, "aux" + jax.tree_util.keystr(path))
    for (path, x), accumulation in zip(paths_and_leaves, flat_types, strict=True)
  ]
  return jax.tree.unflatten(treedef, combined)


def merge_micro_batches(tree: PyTree, *, shards: int = 1) -> PyTree:
  """Merges the micro-batch axis back into the batch axis: ``(k, m, ...)``
  becomes ``(k * m, ...)``, in the batch's own row order.

  ``aux="concatenate"`` (and the default, for leaves with a row axis) does
  this for you. It is for an aux taken with ``aux="stack"``, which has a
  leading axis of length ``k`` (one entry per micro-batch), or for per-row
  values you stacked yourself. On one device micro-batch ``i`` holds
  rows ``i*m .. (i+1)*m - 1`` and a reshape restores the order. Under
  ``mesh=`` the leading axis is ``devices * k`` (device ``d``'s micro-batches
  first), and the same holds.

  Under plain ``jit`` with a batch on ``N`` devices (sharded over a mesh),
  micro-batch ``i`` holds the ``i``-th slice of every one of ``S = gcd(m,
  N)`` equal blocks of the batch, so that no row moves between devices;
  pass ``shards=S`` to restore the order then.

  Args:
    tree: a pytree whose leaves are ``(k, m, ...)``.
    shards: ``S``, the blocks each micro-batch's rows come from.

  Returns:
    The tree with every leaf ``(k * m, ...)``, rows in batch order.

  Raises:
    ValueError: for a leaf without an ``m`` axis, or an ``m`` that does not
      split into ``shards`` blocks.

  >>> import jax.numpy as jnp, jaxaccum
  >>> jaxaccum.merge_micro_batches(jnp.arange(6).reshape(3, 2)).tolist()
  [0, 1, 2, 3, 4, 5]
  >>> rows = jnp.array([[0, 1, 4, 5], [2, 3, 6, 7]])  # k = 2, in 2 blocks
  >>> jaxaccum.merge_micro_batches(rows, shards=2).tolist()
  [0, 1, 2, 3, 4, 5, 6, 7]
  """
  if isinstance(shards, bool) or not isinstance(shards, numbers.Integral) or shards < 1:
    raise ValueError(f"shards must be a positive integer, got {shards!r}.")

  def merge(x):
    if jnp.ndim(x) < 2:
      raise ValueError(
        f"merge_micro_batches needs leaves of shape (k, m, ...), got shape={jnp.shape(x)}: "
        "a per-micro-batch scalar has no rows to merge."
      )
    k, m, rest = x.shape[0], x.shape[1], x.shape[2:]
    if m % shards:
      raise ValueError(
        f"merge_micro_batches: micro-batches of m={m} rows do not split into "
        f"{shards=} blocks."
      )
    if shards == 1:  # one reshape: on Explicit axes JAX keeps the rows' sharding
      return x.reshape((k * m, *rest))
    blocks = x.reshape((k, shards, m // shards, *rest))
    return jnp.swapaxes(blocks, 0, 1).reshape((k * m, *rest))

  return jax.tree.map(merge, tree)
