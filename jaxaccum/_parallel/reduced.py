"""``fun`` run with its parameters typed ``reduced``, each use rewritten into
one that JAX takes.

Plain ``jit``'s step (:mod:`jaxaccum._parallel.unreduced`) types each leaf that is
replicated over the batch's axes ``reduced`` over them: no data moves, and
its cotangent comes back ``unreduced``, each device holding its own rows'
share, to be reduced once after the loop. JAX takes a ``reduced`` operand
in a matrix product with activations sharded over those axes, and in views
and casts; it refuses one added to those activations (a bias), multiplied
into them (a norm's scale) or gathered by them (an embedding table).
:class:`Evaluated` traces ``fun`` on the leaves' plain types, then evaluates
its jaxpr on the ``reduced`` leaves, rewriting each use of a reduced value:

- **an elementwise operation with an operand sharded over the reduced
  axes** (a bias, a scale): the reduced operand is broadcast straight into
  that operand's sharding, each device taking its own rows of it (no data
  moves). The broadcast's transpose sums each device's rows of the
  cotangent, ``unreduced``, where the partitioner would all-reduce them;
- **a matrix product with such an operand**, sharded over them on a free
  dimension: as it is;
- **a view or a cast, or an elementwise operation whose other operands
  are replicated** (a constant, another reduced value): as it is, the
  result reduced, if JAX takes it;
- **a call** (``jit``, ``checkpoint``, ``scan``, ``cond``): evaluated
  inside, rebuilt as the same call (a ``jit`` inlined);
- **a convolution of such an operand's images with a reduced kernel** (JAX
  has no ``reduced`` rule for it), on a mesh of the reduced axes only: its
  own derivative, the kernel's cotangent each device's share, ``unreduced``
  (:func:`jaxaccum._parallel.rebuilt.kept_kernel_conv`);
- **any other use** (a gather, a convolution, a custom derivative, a use
  JAX refuses, an output): the operand is made plain first, so that this
  use's cotangent is reduced in the loop by the partitioner, as under plain
  ``jit``, and comes back typed ``unreduced`` (JAX's transpose of the
  conversion), to add to the others.

Each rewrite is exact: it changes where the sum over devices happens, never
what is summed. :meth:`Evaluated.probe` runs the walk on shapes and says
which leaves some use keeps ``reduced``; a leaf whose every use is made
plain gains nothing from entering the loop reduced.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core
from jax.sharding import PartitionSpec as P

from jaxaccum import _compat, _jaxpr
from jaxaccum._parallel import rebuilt as _rebuilt
from jaxaccum._parallel import specs as _specs
from jaxaccum._parallel import types as _types

PyTree = Any

#: Elementwise operations of several operands (with size-1 and scalar
#: operands broadcast): a reduced operand meeting one sharded over its
#: reduced axes is broadcast into that one's sharding.
ELEMENTWISE = frozenset(
  {
    "add",
    "add_any",
    "sub",
    "mul",
    "div",
    "max",
    "min",
    "pow",
    "atan2",
    "rem",
    "select_n",
    "clamp",
    "nextafter",
  }
)

#: Operations whose reduced operand JAX may type itself: a gather of a
#: reduced table by sharded indices (an embedding lookup), whose transpose
#: is an ``unreduced`` scatter-add.
TYPED = frozenset({"gather"})

#: What JAX raises for a form of a use it refuses, forward or backward:
#: its sharding-type refusals, and the ``ValueError`` and ``TypeError`` of
#: rules that do not take ``reduced`` types yet (``jnp.sort``'s
#: ``pspec[...]``, a select whose operand is sharded over the reduced axes).
_REFUSED: tuple[type[Exception], ...] = (
  *_compat.SHARDING_TYPE_ERRORS,
  ValueError,
  TypeError,
)

#: A rule that fails otherwise (a jaxaccum bug, a primitive whose parameters
#: a new jax renamed): its use takes the plain form, with a warning.
_FAILED_USE = Exception


class Evaluated:
  """``fun``, taking arguments typed ``reduced`` over the data ``axes``:
  traced on their plain types, its jaxpr evaluated on theirs (module
  docstring). Its outputs are never reduced.

  >>> import jax, jax.numpy as jnp
  >>> f = Evaluated(lambda w, x: jnp.sum(x @ w + w[:1]), ("data",))
  >>> float(f(jnp.ones((2, 2)), jnp.ones((3, 2))))
  18.0
  """

  def __init__(self, fun: Callable[..., Any], axes: Sequence[str]):
    self.fun = fun
    self.axes = frozenset(axes)
    self._tracked: list[Any] | None = None
    self._kept: set[int] = set()
    self._jaxprs: dict[Any, tuple[Any, Any]] = {}

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    closed, out_tree, arrays = _trace(self.fun, args, kwargs, self._jaxprs)
    origins = None
    if self._tracked is not None:  # probing: each tracked leaf's uses
      where = {id(x): n for n, x in enumerate(self._tracked)}
      origins = [frozenset({where[id(x)]}) if id(x) in where else None for x in arrays]
    walk = _Walk(self.axes)
    outs, _ = walk.run(closed.jaxpr, closed.consts, arrays, origins)
    self._kept |= walk.kept
    # the loss (the first leaf) may stay a sum over rows, unreduced
    loss = outs[0] if outs and not walk.reduced(outs[0]) else _types.plain(outs[0])
    return jax.tree.unflatten(out_tree, [loss, *map(_types.plain, outs[1:])])

  def probe(
    self,
    loss: Callable[..., Any],
    enter: Callable[[PyTree], PyTree],
    diff_args: PyTree,
    *rest: Any,
  ) -> list[bool]:
    """For each leaf of ``diff_args``, whether some use in
    ``loss(enter(diff_args), *rest)`` (which calls this ``fun``) keeps it
    ``reduced``; on shapes only, nothing computed. ``enter`` types the
    leaves as the loop will."""

    def run(diff_args: PyTree, *rest: Any) -> Any:
      entered = enter(diff_args)
      self._tracked, self._kept = jax.tree.leaves(entered), set()
      try:
        return loss(entered, *rest)
      finally:
        self._tracked = None

    jax.eval_shape(run, diff_args, *rest)
    return [n in self._kept for n in range(len(jax.tree.leaves(diff_args)))]


def _trace(
  fun: Callable[..., Any],
  args: tuple[Any, ...],
  kwargs: dict[str, Any],
  cache: dict[Any, tuple[Any, Any]],
) -> tuple[Any, Any, list[Any]]:
  """``fun(*args, **kwargs)``'s jaxpr over its array leaves, traced on
  their types without ``reduced`` axes; its output tree; those leaves.
  Kept in ``cache`` by those types and the other leaves, where the jaxpr
  closes over no tracer (the probe's trace and the loop's then share one)."""
  flat, tree = jax.tree.flatten((args, kwargs))
  where = [n for n, x in enumerate(flat) if isinstance(x, jax.Array)]
  arrays = [flat[n] for n in where]
  types = [_plain_type(x) for x in arrays]
  key: Any = (tree, tuple(x for n, x in enumerate(flat) if n not in set(where)), *types)
  try:
    hit = cache.get(key)
  except TypeError:  # an unhashable static leaf
    hit, key = None, None
  if hit is not None:
    return (*hit, arrays)

  def traced(*xs: Any) -> Any:
    full = list(flat)
    for n, x in zip(where, xs, strict=True):
      full[n] = x
    a, k = jax.tree.unflatten(tree, full)
    return fun(*a, **k)

  closed, shape = jax.make_jaxpr(traced, return_shape=True)(*types)
  out_tree = jax.tree.structure(shape)
  if key is not None and not any(_compat.is_tracer(c) for c in closed.consts):
    cache[key] = (closed, out_tree)
  return closed, out_tree, arrays


class _Walk(_jaxpr.Walker):
  """Evaluates a jaxpr on values some of which are reduced over ``axes``,
  rewriting their uses (module docstring). The metadata beside a value is
  the set of leaves (the origins the top-level inputs carry, when probing)
  that reach it reduced; ``kept`` collects the leaves that some use kept
  reduced. Every use falls back to its plain form alone: a rewrite that
  JAX refuses, forward or backward, or a rule that fails, costs that use's
  reduction in the loop, never the step's."""

  rules: ClassVar[dict[str, str]] = {
    "reshard": "reshard",
    "conv_general_dilated": "conv",
    "scan": "call",
    "cond": "call",
    **{name: "call" for name in _jaxpr.REMAT},
  }

  def __init__(self, axes: frozenset[str]):
    self.axes = axes
    self.kept: set[int] = set()

  def reduced(self, x: Any) -> frozenset[str]:
    """The axes of ``self.axes`` that ``x`` is reduced over."""
    spec = _types.spec_of(x)
    return frozenset() if spec is None else frozenset(spec.reduced) & self.axes

  def partial(self, x: Any) -> frozenset[str]:
    """The axes of ``self.axes`` that ``x`` is ``unreduced`` over: a sum
    over rows whose reduction is put off."""
    spec = _types.spec_of(x)
    return frozenset() if spec is None else frozenset(spec.unreduced) & self.axes

  def follows(self, eqn: Any, invals: list[Any], meta: list[Any]) -> bool:
    del eqn, meta
    return any(self.reduced(x) or self.partial(x) for x in invals)

  def plain(self, eqn: Any, invals: list[Any]) -> list[Any]:
    """``eqn`` on values none of which is reduced or partial: a sum of rows
    to a scalar (a loss, a count) is left ``unreduced`` over the data axes;
    the rest as it is."""
    if eqn.primitive.name == "reduce_sum" and not eqn.outvars[0].aval.shape:
      parts = _types.spec_or_empty(invals[0]).partitions
      axes = frozenset(n for e in parts for n in _specs.names(e)) & self.axes
      spec = _types.aval_spec(eqn.outvars[0].aval)
      if axes and spec is not None and not spec.unreduced:
        out = eqn.outvars[0].aval.sharding.update(spec=P(unreduced=axes))
        return _jaxpr.bind(eqn, invals, out_sharding=out)
    return _bind(eqn, invals)

  def equation(
    self, eqn: Any, invals: list[Any], meta: list[Any]
  ) -> tuple[list[Any], list[Any]]:
    """The walker's dispatch, with a rule that fails for a reason other
    than JAX's refusal of the user's own program (a jaxaccum bug, a
    primitive whose parameters a new jax renamed) taking that use's plain
    form, with a warning."""
    try:
      return super().equation(eqn, invals, meta)
    except _FAILED_USE as error:
      fallen = error
    outs = self.as_plain(eqn, invals)  # the user's own error raises here
    warnings.warn(
      f"jaxaccum could not rewrite a use ({eqn.primitive.name}) of a parameter "
      "typed reduced, so that use's gradient is reduced every micro-batch, as "
      "plain jit does; the other uses keep theirs. Please report it. The walk "
      f"said: {type(fallen).__name__}: {fallen}",
      stacklevel=2,
    )
    return outs, [None] * len(outs)

  def as_plain(self, eqn: Any, invals: list[Any]) -> list[Any]:
    """``eqn`` with its reduced and partial operands made plain: plain
    ``jit``'s own use of them."""
    return _bind(eqn, [_types.plain(x) for x in invals])

  def default(
    self, eqn: Any, invals: list[Any], meta: list[Any]
  ) -> tuple[list[Any], list[Any]]:
    if any(self.reduced(x) for x in invals):
      return self.use(eqn, invals, meta)
    return self.on_partial(eqn, invals), [None] * len(eqn.outvars)

  def on_partial(self, eqn: Any, invals: list[Any]) -> list[Any]:
    """``eqn`` on sums ``unreduced`` over data axes: added to or subtracted
    from one another, widened, scaled or divided by a replicated value,
    negated, it stays unreduced (a replicated factor typed reduced); any
    other use reduces it first, an all-reduce here, where plain ``jit`` has
    it: a replicated addend (a penalty on the weights, a constant) would
    have to be split over the devices, and a narrowing cast rounds the
    sum."""
    at = [n for n, x in enumerate(invals) if self.partial(x)]
    axes = frozenset().union(*(self.partial(invals[n]) for n in at))
    try:  # JAX refuses a sum meeting rows (an operand sharded over axes)
      out = _linear(eqn, invals, at, axes)
    except _REFUSED:
      out = None  # reduced below
    if out is not None:
      return [out]
    return self.as_plain(eqn, invals)

  def use(
    self, eqn: Any, invals: list[Any], sources: list[frozenset[int] | None]
  ) -> tuple[list[Any], list[frozenset[int] | None]]:
    """``eqn`` on ``invals``, some reduced, rewritten to a use JAX takes:
    the first of :meth:`rewrites` that it types forward and transposes."""
    leaves = frozenset().union(*(s for s in sources if s))
    at = [n for n, x in enumerate(invals) if self.reduced(x)]
    axes = frozenset().union(*(self.reduced(invals[n]) for n in at))
    for form, outcome in self.rewrites(eqn, invals, at, axes):
      if outcome == "plain":
        outs = _bind(eqn, form(invals))
      else:
        result = axes if outcome == "reduced" else frozenset()
        try:
          outs = _bind(eqn, form(invals), result)
          _check_transpose(eqn, invals, at, form, result=result, outs=outs)
        except _REFUSED:
          continue  # JAX has no rule for it, or no transpose: the next form
      if outcome == "kept":
        self.kept |= leaves
      return outs, [(leaves or None) if outcome == "reduced" else None] * len(outs)
    raise AssertionError("unreachable: the plain form is always the last")

  def rewrites(
    self, eqn: Any, invals: list[Any], at: list[int], axes: frozenset[str]
  ) -> Iterator[tuple[Callable[[list[Any]], list[Any]], str]]:
    """The forms of ``eqn`` to try, each a rewrite of its operands (the
    reduced ones at positions ``at``, reduced over ``axes``), with what it
    makes of them: ``"kept"`` (the use contracts or broadcasts them into
    rows: their cotangent comes back unreduced), ``"reduced"`` (the result
    is reduced too) or ``"plain"`` (made plain first; always the last)."""
    name = eqn.primitive.name
    others = [_types.spec_of(x) for n, x in enumerate(invals) if n not in at]
    out = eqn.outvars[0].aval
    if name == "dot_general" and _contracts_rows(eqn, invals, at, axes):
      yield list, "kept"
    elif (
      name in ELEMENTWISE
      and _specs.covers(_types.aval_spec(out), axes)
      and any(_specs.covers(s, axes) for s in others)
    ):  # broadcast into the sharded operand's rows
      yield (
        (
          lambda vals: [
            _broadcast(x, out) if n in at else x for n, x in enumerate(vals)
          ]
        ),
        "kept",
      )
    elif name in TYPED:  # JAX's own rule, where it has one
      yield list, "kept"
    elif (name in ELEMENTWISE or len(invals) == 1) and not (
      _has_jaxpr(eqn) or any(s is not None and _specs.shards(s, axes) for s in others)
    ):  # a view, a cast, an op of reduced and replicated values
      yield (
        (
          lambda vals: [
            x if n in at else _as_reduced(x, vals[at[0]], axes)
            for n, x in enumerate(vals)
          ]
        ),
        "reduced",
      )
    yield (
      lambda vals: [_types.plain(x) if n in at else x for n, x in enumerate(vals)],
      "plain",
    )

  def conv(
    self, eqn: Any, invals: list[Any], sources: list[frozenset[int] | None]
  ) -> tuple[list[Any], list[frozenset[int] | None]]:
    """A convolution of rows with a reduced kernel: its own derivative
    (:mod:`jaxaccum._parallel.rebuilt`) where each device's images are its
    own."""
    axes = frozenset().union(*(self.reduced(x) for x in invals))
    if self.reduced(invals[1]) and _rebuilt.kernel_of_rows(eqn, invals, axes):
      self.kept |= frozenset().union(*(s for s in sources if s))
      return [_rebuilt.kept_kernel_conv(eqn, invals[0], invals[1], axes)], [None]
    return self.default(eqn, invals, sources)

  def reshard(
    self, eqn: Any, invals: list[Any], sources: list[frozenset[int] | None]
  ) -> tuple[list[Any], list[frozenset[int] | None]]:
    """A ``reshard`` of a reduced value: one that keeps it replicated over
    the reduced axes keeps it reduced; one that shards it over them takes
    each device's part (no data moves), and one onto Auto axes leaves it
    to the partitioner (``.at[].get(out_sharding=)``'s own reshard of a
    gathered table): either way its cotangent comes back ``unreduced``."""
    axes = self.reduced(invals[0])
    if not axes:
      return self.default(eqn, invals, sources)
    leaves = frozenset().union(*(s for s in sources if s))
    dst = eqn.params["dst_sharding"]
    if axes <= _types.explicit_axes(dst.mesh) and not _specs.shards(dst.spec, axes):
      spec = P(*dst.spec.partitions, reduced=set(dst.spec.reduced) | axes)
      out = _jaxpr.bind(eqn, invals, dst_sharding=dst.update(spec=spec))
      return out, [leaves or None]
    self.kept |= leaves
    return _bind(eqn, invals), [None]

  def call(
    self, eqn: Any, invals: list[Any], sources: list[frozenset[int] | None]
  ) -> tuple[list[Any], list[frozenset[int] | None]]:
    """A ``checkpoint``, ``scan`` or ``cond`` rebuilt around the walk of its
    jaxprs. A scan's carry and a scan's or a cond's outputs are made plain:
    their types must match across iterations and branches."""
    if not any(self.reduced(x) for x in invals):
      return self.default(eqn, invals, sources)
    p = eqn.params
    name = eqn.primitive.name
    if name in _jaxpr.REMAT:
      found: list[Any] = []

      def inner(*args: Any) -> list[Any]:
        outs, origins = self.run(p["jaxpr"], (), args, sources)
        found[:] = origins
        return outs

      remat = jax.checkpoint(inner, prevent_cse=p["prevent_cse"], policy=p["policy"])
      return remat(*invals), found
    if name == "cond":
      return _rebuilt.cond(self, eqn, invals, sources)
    return _rebuilt.scan(self, eqn, invals, sources)


def _check_transpose(
  eqn: Any,
  invals: list[Any],
  at: list[int],
  form: Callable[[list[Any]], list[Any]],
  *,
  result: frozenset[str],
  outs: list[Any],
) -> None:
  """Raises JAX's own refusal where it cannot transpose ``eqn`` rewritten
  by ``form``, from cotangents of ``outs``'s types back to the reduced
  operands at ``at`` (on types only): a form JAX takes forward but not
  backward fails here, at its use, not later in the step's backward pass."""
  if not any(jnp.issubdtype(invals[n].dtype, jnp.inexact) for n in at):
    return

  def transpose(reduced: list[Any], cotangents: list[Any]) -> Any:
    def rebuilt(*reduced: Any) -> list[Any]:
      vals = list(invals)
      for n, x in zip(at, reduced, strict=True):
        vals[n] = x
      return _bind(eqn, form(vals), result)

    _, pullback = jax.vjp(rebuilt, *reduced)
    return pullback(cotangents)

  jax.eval_shape(
    transpose,
    [_compat.type_of(invals[n]) for n in at],
    [_compat.cotangent_type(x) for x in outs],
  )


#: The parameters in which an operation carries its result's sharding, as
#: traced (``vmap`` gives the bias it broadcasts one).
_OUT_SHARDINGS = ("sharding", "out_sharding")


def _bind(
  eqn: Any, invals: list[Any], reduced: frozenset[str] = frozenset()
) -> list[Any]:
  """``eqn`` on ``invals``; with ``reduced``, its result typed reduced over
  those axes where a parameter fixes the result's sharding (as traced, on
  plain types, it would make the result plain)."""
  params = eqn.primitive.get_bind_params(eqn.params)
  for key in _OUT_SHARDINGS:
    fixed = params.get(key) if reduced else None
    if isinstance(fixed, jax.sharding.NamedSharding):
      spec = P(*fixed.spec.partitions, reduced=set(fixed.spec.reduced) | reduced)
      params[key] = fixed.update(spec=spec)
  out = eqn.primitive.bind(*invals, **params)
  return list(out) if eqn.primitive.multiple_results else [out]


def _contracts_rows(
  eqn: Any, invals: list[Any], at: list[int], axes: frozenset[str]
) -> bool:
  """A matrix product of one reduced operand with one sharded over the
  reduced ``axes`` on free dimensions only (the rows of activations): its
  transpose contracts those rows, an ``unreduced`` sum JAX types."""
  if len(at) != 1 or len(invals) != 2:
    return False
  other = 1 - at[0]
  spec = _types.spec_of(invals[other])
  (contracting, batch) = eqn.params["dimension_numbers"]
  bound = set(contracting[other]) | set(batch[other])
  if spec is None or not _specs.covers(spec, axes):
    return False
  return not any(
    set(_specs.names(entry)) & axes
    for d, entry in enumerate(spec.partitions)
    if d in bound
  )


def _broadcast(x: Any, out: Any) -> jax.Array:
  """``x`` (reduced) broadcast to ``out``'s shape and partitions: each
  device's rows of it, no data moved."""
  spec = P(*out.sharding.spec.partitions)
  dims = tuple(range(out.ndim - jnp.ndim(x), out.ndim))
  sharding = jax.typeof(x).sharding.update(spec=spec)
  return jax.lax.broadcast_in_dim(x, out.shape, dims, out_sharding=sharding)


def _linear(
  eqn: Any, invals: list[Any], at: list[int], axes: frozenset[str]
) -> jax.Array | None:
  """``eqn`` on the sums at positions ``at`` (unreduced over ``axes``; the
  other operands replicated), written as operations JAX types on them, or
  None where it is none of :meth:`_Walk.on_partial`'s."""
  name = eqn.primitive.name
  ref = invals[at[0]]

  def scaled(x: jax.Array, factor: Any) -> jax.Array:
    return x * _as_reduced(factor, ref, axes, ref.dtype)

  if name in {"add", "add_any", "sub"} and len(at) == 2:
    a, b = invals  # JAX types no unreduced sub: a + (-1) b
    return jax.lax.add(a, scaled(b, -1) if name == "sub" else b)
  if name == "mul" and len(at) == 1:
    return scaled(ref, invals[1 - at[0]])
  if name == "div" and at == [0]:
    return scaled(ref, jax.lax.div(jnp.ones((), ref.dtype), invals[1]))
  if name == "neg":
    return scaled(ref, -1)
  if name in {"copy", "reduce_sum"} or (
    name == "convert_element_type" and _widens(ref.dtype, eqn)
  ):  # a narrowing cast rounds the sum, not its parts: None
    return _bind(eqn, invals)[0]
  return None


def _widens(dtype: Any, eqn: Any) -> bool:
  """``eqn`` (a cast of a ``dtype`` value) loses nothing of it."""
  new = eqn.params["new_dtype"]
  return jnp.promote_types(dtype, new) == new


def _as_reduced(
  x: Any, like: jax.Array, axes: frozenset[str], dtype: Any = None
) -> jax.Array:
  """``x``, replicated over ``axes`` (a literal, a constant, a value of
  ``fun``'s), typed ``reduced`` over them (on ``like``'s mesh where it has
  none), cast to ``dtype`` if given; as it is where it is sharded over them
  (JAX decides) or on a mesh without them (JAX refuses it)."""
  x = jnp.asarray(x, dtype)
  sharding = jax.typeof(x).sharding
  spec = _types.spec_of(x)
  if spec is None or sharding.mesh.empty:
    typed = P(*(None,) * jnp.ndim(x), reduced=set(axes))
    return jax.sharding.reshard(x, jax.typeof(like).sharding.update(spec=typed))
  if _specs.shards(spec, axes) or not axes <= set(sharding.mesh.axis_names):
    return x
  typed = P(*spec.partitions, reduced=set(spec.reduced) | axes)
  return jax.sharding.reshard(x, sharding.update(spec=typed))


def _has_jaxpr(eqn: Any) -> bool:
  """``eqn`` calls a jaxpr (a custom derivative, a ``while``): opaque."""
  kinds = (jex_core.Jaxpr, jex_core.ClosedJaxpr)
  return any(isinstance(v, kinds) for v in eqn.params.values())


def _plain_type(x: jax.Array) -> jax.ShapeDtypeStruct:
  aval = jax.typeof(x)
  sharding = aval.sharding
  spec = _types.spec_of(x)
  if spec is not None and spec.reduced:
    sharding = sharding.update(spec=P(*spec.partitions, unreduced=set(spec.unreduced)))
  return jax.ShapeDtypeStruct(
    x.shape, x.dtype, sharding=sharding, weak_type=aval.weak_type
  )
