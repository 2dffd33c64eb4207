"""The leaves of an :func:`jaxaccum.accumulate` window that are not
gradients: each combined over the window by its rule, never normalized, and
written over its parameter when the window ends.

A leaf's rule is the one ``value_and_grad`` gives it
(:func:`jaxaccum._accumulator.rules`): Flax's ``_overwrite_with_gradient``
collection (FP8 scales and amax histories, whose "gradient" is the new
value) takes ``max``, and ``combine=`` names any other leaf's. The window's
inner optimizer gets zeros for them; on the call that ends the window their
update is ``combined - params``, so that ``optax.apply_updates`` writes the
window's value over the parameter (to float rounding).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxaccum import _accumulator

PyTree = Any
Rule = _accumulator.Rule
check_combine = _accumulator.check_combine


def rules(combine: Any, tree: PyTree) -> tuple[Rule, ...]:
  """Each leaf's rule; an extended dtype (Flax's ``fm32``), which
  ``optax.apply_updates`` cannot write, is a ``ValueError``."""
  found = _accumulator.rules(combine, (tree,), True)
  if any(r.name == "dtype" for r in found):
    raise ValueError(
      "accumulate() was given leaves of a JAX extended dtype (Flax's fm32 FP8 "
      "metadata), which optax.apply_updates cannot write: keep the metadata in "
      "float32 (Flax's default), or accumulate with jaxaccum.value_and_grad."
    )
  return found


def _each(fun: Any, leaf_rules: Sequence[Rule], *trees: PyTree) -> PyTree:
  flat, treedef = jax.tree.flatten(trees[0])
  rest = [jax.tree.leaves(t) for t in trees[1:]]
  out = [fun(r, *xs) for r, *xs in zip(leaf_rules, flat, *rest, strict=True)]
  return jax.tree.unflatten(treedef, out)


def zeros(leaf_rules: Sequence[Rule], tree: PyTree, accum_dtype: Any) -> PyTree:
  """The window's empty accumulator, each leaf its rule's identity."""
  return _each(lambda r, x: r.zero(x, r.dtype(accum_dtype, x)), leaf_rules, tree)


def added(
  leaf_rules: Sequence[Rule], acc: PyTree, grads: PyTree, valid: jax.Array
) -> PyTree:
  """``acc`` with one micro-batch's ``grads`` combined, where ``valid``."""

  def one(r, a, g):
    return jnp.where(valid, r.add(a, g.astype(a.dtype)), a)

  return _each(one, leaf_rules, acc, grads)


def gradients(leaf_rules: Sequence[Rule], tree: PyTree) -> PyTree:
  """``tree`` with zeros where a leaf is not a gradient: what the inner
  optimizer and the finiteness check see."""
  return _each(lambda r, x: x if r.normalized else jnp.zeros_like(x), leaf_rules, tree)


def overwritten(
  leaf_rules: Sequence[Rule], updates: PyTree, acc: PyTree, params: PyTree
) -> PyTree:
  """``updates`` where a leaf is a gradient; elsewhere ``acc - params``,
  which ``optax.apply_updates`` turns into the window's combined value."""
  if params is None and not all(r.normalized for r in leaf_rules):
    raise ValueError(
      "accumulate()'s update needs params= for leaves that are not gradients "
      "(FP8 metadata, combine=): their update writes the window's value."
    )

  def one(r, u, a, p):
    return u if r.normalized else (a - p).astype(u.dtype)

  return _each(one, leaf_rules, updates, acc, params if params is not None else acc)


def reset(leaf_rules: Sequence[Rule], done: jax.Array, acc: PyTree) -> PyTree:
  """The accumulator, emptied where the window ended."""
  return _each(lambda r, a: jnp.where(done, r.zero(a, a.dtype), a), leaf_rules, acc)
