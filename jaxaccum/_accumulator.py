"""How micro-batch gradients are summed: one factory for every path.

An :class:`Accumulator` is a fold, ``init``, ``first`` and ``add``, over the
leaves of the differentiated arguments. :func:`accumulator` builds it: each
leaf is kept in ``accum_dtype`` (float32 by default; a wider gradient in its
own dtype), and each path says only where a leaf's sum lies
(:class:`LeafSum`): on one device nowhere in particular; under ``mesh=``
constrained to one copy per device, or to the parameter's sharding; under
plain ``jit`` on JAX's types resharded to an ``unreduced`` type before it is
added.

A leaf's combine rule (how a micro-batch's term joins the sum) belongs in
:class:`LeafSum` too: today every leaf is summed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp

from jaxaccum import _normalize

PyTree = Any


class Accumulator(NamedTuple):
  """How micro-batch gradients are summed: a fold.

  Attributes:
    init: ``diff_args -> acc``, the zero accumulator.
    first: ``grads -> acc``, the accumulator after one micro-batch (with a
      single micro-batch there is no zero to add to).
    add: ``(acc, grads) -> acc``.
  """

  init: Callable[[Any], Any]
  first: Callable[[Any], Any]
  add: Callable[[Any, Any], Any]


class LeafSum(NamedTuple):
  """How one leaf's sum is kept.

  Attributes:
    layout: applied to every value the accumulator holds (its zero, the
      first term and each sum): a sharding constraint. None: as it comes.
    term: applied to each term, cast to the accumulator's dtype, before it
      joins the sum (and to the zero): a reshard into the accumulator's
      ``unreduced`` type. None: as it comes.
  """

  layout: Callable[[jax.Array], jax.Array] | None = None
  term: Callable[[jax.Array], jax.Array] | None = None

  def zero(self, x: jax.Array, dtype: Any) -> jax.Array:
    """The sum of no terms, for a leaf like ``x``."""
    return self._laid_out(self._term(jnp.zeros_like(x, dtype)))

  def start(self, g: jax.Array, dtype: Any) -> jax.Array:
    """The sum of one term ``g``."""
    return self._laid_out(self._term(g.astype(dtype)))

  def combine(self, acc: jax.Array, g: jax.Array) -> jax.Array:
    """``acc`` with the term ``g`` added."""
    return self._laid_out(acc + self._term(g.astype(acc.dtype)))

  def _term(self, x: jax.Array) -> jax.Array:
    return x if self.term is None else self.term(x)

  def _laid_out(self, x: jax.Array) -> jax.Array:
    return x if self.layout is None else self.layout(x)


def accumulator(
  accum_dtype: Any, leaves: Sequence[LeafSum] | None = None
) -> Accumulator:
  """The :class:`Accumulator` that sums each leaf in ``accum_dtype`` (or in
  the gradient's dtype, where wider), kept as ``leaves`` say, one
  :class:`LeafSum` per leaf of the differentiated arguments in their
  flattened order (None: every leaf as it comes).

  >>> import jax.numpy as jnp
  >>> acc = accumulator(jnp.float32)
  >>> total = acc.add(acc.first({"w": jnp.ones(2, jnp.bfloat16)}), {"w": jnp.ones(2)})
  >>> total["w"].dtype, total["w"].tolist()
  (dtype('float32'), [2.0, 2.0])
  """

  def like(x: jax.Array) -> Any:
    return _normalize.accumulator_dtype(accum_dtype, x)

  def each(fun: Callable[..., jax.Array], *trees: PyTree) -> PyTree:
    flat = [jax.tree.flatten(t) for t in trees]
    first, treedef = flat[0]
    kept = [LeafSum()] * len(first) if leaves is None else leaves
    out = [fun(k, *xs) for k, *xs in zip(kept, *(f[0] for f in flat), strict=True)]
    return jax.tree.unflatten(treedef, out)

  def add(acc: PyTree, grads: PyTree) -> PyTree:
    chex.assert_trees_all_equal_shapes(grads, acc)  # trace time, free
    return each(lambda k, a, g: k.combine(a, g), acc, grads)

  return Accumulator(
    init=lambda diff: each(lambda k, x: k.zero(x, like(x)), diff),
    first=lambda grads: each(lambda k, g: k.start(g, like(g)), grads),
    add=add,
  )
