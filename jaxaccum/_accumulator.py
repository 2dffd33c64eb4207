"""How micro-batch gradients are summed: one factory for every path.

An :class:`Accumulator` is a fold, ``init``, ``first`` and ``add``, over the
leaves of the differentiated arguments. :func:`accumulator` builds it: each
leaf is kept in ``accum_dtype`` (float32 by default; a wider gradient in its
own dtype), and each path says only where a leaf's sum lies
(:class:`LeafSum`): on one device nowhere in particular; under ``mesh=``
constrained to one copy per device, or to the parameter's sharding; under
plain ``jit`` on JAX's types resharded to an ``unreduced`` type before it is
added.

A leaf's combine rule (:class:`Rule`: how a micro-batch's term joins the
sum, and whether the result is normalized) is in :class:`LeafSum` too, one
per leaf (:func:`rules`): a gradient is summed and normalized; a leaf of a
JAX extended dtype is combined by the dtype's own addition (Flax's FP8
meta dtype ``fm32``: ``max``), never cast through its physical float; a
leaf of Flax's ``_overwrite_with_gradient`` collection (FP8 scales and
amax histories, whose "gradient" is their new value) by ``max``, as the
full batch's backward pass gives it; and any leaf as ``combine=`` names
it (``"sum"``, ``"max"``, ``"min"``, ``"last"``). Only gradients are
normalized.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp

from jaxaccum import _compat, _normalize

PyTree = Any

#: Flax's collection whose "gradients" are the variables' new values (its
#: ``flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT``).
OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"


class Rule(NamedTuple):
  """How one leaf's micro-batch terms combine into the step's result.

  Attributes:
    name: ``"gradient"`` (summed in ``accum_dtype``, then normalized),
      ``"sum"``, ``"max"``, ``"min"``, ``"last"`` (the last micro-batch's, in
      the full batch's order), or ``"dtype"`` (an extended dtype's own
      addition). Only a gradient is normalized or kept in ``accum_dtype``.
  """

  name: str

  @property
  def normalized(self) -> bool:
    """Whether the combined result is divided by the total weight."""
    return self.name == "gradient"

  @property
  def summed(self) -> bool:
    """Whether terms are added (so that a sum over devices reduces them)."""
    return self.name in ("gradient", "sum")

  def dtype(self, accum_dtype: Any, x: Any) -> Any:
    """The dtype the combination is kept in."""
    if self.summed:
      return _normalize.accumulator_dtype(accum_dtype, x)
    return jax.typeof(x).dtype

  def zero(self, x: jax.Array, dtype: Any) -> jax.Array:
    """The identity of :meth:`add`, like ``x`` in ``dtype``."""
    if self.name == "dtype":
      return _compat.zeros_like_jaxval(x)
    if self.name in ("max", "min"):
      return jnp.full_like(x, _far(dtype, self.name == "max"), dtype)
    return jnp.zeros_like(x, dtype)

  def add(self, acc: jax.Array, g: jax.Array) -> jax.Array:
    """``acc`` combined with the next term ``g``."""
    return _ADD[self.name](acc, g)

  def over(self, acc: jax.Array, axes: int) -> jax.Array:
    """``acc``'s leading ``axes`` axes (one per device, device-major)
    combined: the reduction over devices after the loop."""
    if not axes:
      return acc
    if self.name in ("gradient", "sum", "max", "min"):
      reduce = {"max": jnp.max, "min": jnp.min}.get(self.name, jnp.sum)
      return reduce(acc, axis=tuple(range(axes)))
    if _compat.explicit_spec(acc) is not None:  # gathered, then sliced
      acc = jax.sharding.reshard(acc, jax.sharding.PartitionSpec())
    flat = acc.reshape((-1, *acc.shape[axes:]))
    if self.name == "last":
      return flat[-1]
    out = flat[0]
    for i in range(1, flat.shape[0]):
      out = _compat.add_jaxvals(out, flat[i])
    return out


def _far(dtype: Any, below: bool) -> Any:
  """The value no other of ``dtype`` is below (``below``) or above."""
  if jnp.issubdtype(dtype, jnp.inexact):
    return -jnp.inf if below else jnp.inf
  info = jnp.iinfo(dtype)
  return info.min if below else info.max


_ADD: dict[str, Callable[[Any, Any], Any]] = {
  "gradient": lambda a, g: a + g,
  "sum": lambda a, g: a + g,
  "max": jnp.maximum,
  "min": jnp.minimum,
  "last": lambda a, g: g,
  "dtype": _compat.add_jaxvals,
}
GRADIENT = Rule("gradient")
#: The rules ``combine=`` may name.
NAMED = ("sum", "max", "min", "last")


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
    rule: how the terms combine (:class:`Rule`; a gradient's sum by
      default).
  """

  layout: Callable[[jax.Array], jax.Array] | None = None
  term: Callable[[jax.Array], jax.Array] | None = None
  rule: Rule = GRADIENT

  def zero(self, x: jax.Array, dtype: Any) -> jax.Array:
    """The sum of no terms, for a leaf like ``x``."""
    return self._laid_out(self._term(self.rule.zero(x, dtype)))

  def start(self, g: jax.Array, dtype: Any) -> jax.Array:
    """The sum of one term ``g``."""
    return self._laid_out(self._term(self._cast(g, dtype)))

  def combine(self, acc: jax.Array, g: jax.Array) -> jax.Array:
    """``acc`` with the term ``g`` added."""
    term = self._term(self._cast(g, jax.typeof(acc).dtype))
    return self._laid_out(self.rule.add(acc, term))

  def _cast(self, g: jax.Array, dtype: Any) -> jax.Array:
    return g if self.rule.name == "dtype" else g.astype(dtype)

  def _term(self, x: jax.Array) -> jax.Array:
    return x if self.term is None else self.term(x)

  def _laid_out(self, x: jax.Array) -> jax.Array:
    return x if self.layout is None else self.layout(x)


def accumulator(
  accum_dtype: Any,
  leaves: Sequence[LeafSum] | None = None,
  rules: Sequence[Rule] | None = None,
) -> Accumulator:
  """The :class:`Accumulator` that sums each leaf in ``accum_dtype`` (or in
  the gradient's dtype, where wider), kept as ``leaves`` say, one
  :class:`LeafSum` per leaf of the differentiated arguments in their
  flattened order (None: every leaf as it comes), each combined by its
  rule in ``rules`` (None: every leaf a gradient).

  >>> import jax.numpy as jnp
  >>> acc = accumulator(jnp.float32)
  >>> total = acc.add(acc.first({"w": jnp.ones(2, jnp.bfloat16)}), {"w": jnp.ones(2)})
  >>> total["w"].dtype, total["w"].tolist()
  (dtype('float32'), [2.0, 2.0])
  """

  def each(fun: Callable[..., jax.Array], *trees: PyTree) -> PyTree:
    flat = [jax.tree.flatten(t) for t in trees]
    first, treedef = flat[0]
    kept = [LeafSum()] * len(first) if leaves is None else leaves
    if rules is not None:
      kept = [k._replace(rule=r) for k, r in zip(kept, rules, strict=True)]
    out = [fun(k, *xs) for k, *xs in zip(kept, *(f[0] for f in flat), strict=True)]
    return jax.tree.unflatten(treedef, out)

  def add(acc: PyTree, grads: PyTree) -> PyTree:
    chex.assert_trees_all_equal_shapes(grads, acc)  # trace time, free
    return each(lambda k, a, g: k.combine(a, g), acc, grads)

  return Accumulator(
    init=lambda diff: each(lambda k, x: k.zero(x, k.rule.dtype(accum_dtype, x)), diff),
    first=lambda grads: each(
      lambda k, g: k.start(g, k.rule.dtype(accum_dtype, g)), grads
    ),
    add=add,
  )


def check_combine(combine: Any) -> None:
  """Raises unless every leaf of ``combine=`` names a rule (definition time).

  >>> check_combine({"count": "sum", "peak": "max"})
  >>> check_combine("mean")
  Traceback (most recent call last):
  ValueError: Unknown combine='mean'; choose one of ('sum', 'max', 'min', 'last'), or a tree prefix of the differentiated arguments with these (or None: a gradient) as leaves.
  """
  if combine is None:
    return
  for leaf in jax.tree.leaves(combine):
    if not (isinstance(leaf, str) and leaf in NAMED):
      raise ValueError(
        f"Unknown combine={leaf!r}; choose one of {NAMED}, or a tree prefix of "
        "the differentiated arguments with these (or None: a gradient) as leaves."
      )


def rules(
  combine: Any, diff_args: tuple[PyTree, ...], tree_grads: bool
) -> tuple[Rule, ...]:
  """Each leaf's :class:`Rule`, in the flattened order of ``diff_args`` (one
  tree per entry of ``argnums``; ``combine=`` is a prefix of the one tree
  where ``tree_grads``, else of the tuple)."""
  named = _named(combine, diff_args, tree_grads)
  flat = jax.tree_util.tree_flatten_with_path(diff_args)[0]
  return tuple(_rule_of(p, x, n) for (p, x), n in zip(flat, named, strict=True))


def _named(combine: Any, diff_args: tuple[PyTree, ...], tree_grads: bool) -> list[Any]:
  """The name ``combine=`` gives each leaf (None: not named)."""
  count = len(jax.tree.leaves(diff_args))
  if combine is None or isinstance(combine, str):
    return [combine] * count
  spec = (combine,) if tree_grads else combine
  try:
    spread = jax.tree.map(
      lambda s, sub: [s] * len(jax.tree.leaves(sub)),
      spec,
      diff_args,
      is_leaf=lambda s: s is None or isinstance(s, str),
    )
  except ValueError as error:
    raise ValueError(
      f"combine={combine!r} is not a tree prefix of the differentiated "
      f"arguments ({jax.tree.structure(diff_args)}): {error}"
    ) from None
  return [
    n
    for names in jax.tree.leaves(spread, is_leaf=lambda x: isinstance(x, list))
    for n in names
  ]


def _rule_of(path: Any, x: Any, name: str | None) -> Rule:
  """One leaf's rule: an extended dtype's own addition; else as ``combine=``
  names it; else ``max`` in Flax's overwrite collection; else a gradient."""
  if _compat.is_extended(x):
    if name is not None:
      raise ValueError(
        f"combine={name!r} names the leaf {jax.tree_util.keystr(path)} of the "
        f"extended dtype {jax.typeof(x).dtype}, which combines by its dtype's "
        "own addition (autodiff's): leave it out of combine= (None)."
      )
    return Rule("dtype")
  if name is not None:
    return Rule(name)
  keys = {getattr(k, "key", getattr(k, "name", None)) for k in path}
  return Rule("max") if OVERWRITE_WITH_GRADIENT in keys else GRADIENT


def results(
  leaf_rules: Sequence[Rule],
  sums: PyTree,
  divide: Callable[[jax.Array], jax.Array],
  diff_args: PyTree,
) -> PyTree:
  """The step's result from the combined ``sums``: each gradient divided
  (``divide``, the normalization) and in the dtype ``jax.grad`` gives for
  its leaf of ``diff_args``; any other leaf as it was combined (cast to
  the leaf's dtype; an extended dtype as it is)."""
  flat, treedef = jax.tree.flatten(sums)
  like = jax.tree.leaves(diff_args)

  def one(rule: Rule, g: jax.Array, x: Any) -> Any:
    if rule.name == "dtype":
      return g
    return (divide(g) if rule.normalized else g).astype(_normalize.result_dtype(x))

  out = [one(r, g, x) for r, g, x in zip(leaf_rules, flat, like, strict=True)]
  return jax.tree.unflatten(treedef, out)
