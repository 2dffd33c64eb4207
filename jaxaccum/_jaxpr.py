"""The one jaxpr walker: an evaluation loop, JAX's call table and a finder.

Two analyses read ``fun``'s traced program and evaluate it again with each
use of a parameter changed: plain ``jit``'s rewrite of the uses of a
``reduced`` parameter (:mod:`jaxaccum._parallel.reduced`) and ghost
clipping's taps at each use (:mod:`jaxaccum._privacy.ghost`). Both are
:class:`Walker` subclasses: one loop, as JAX's own ``eval_jaxpr``, that

- keeps a *metadata* value beside each variable (what the analysis follows:
  which parameter a value views, which leaves reach it), ``None`` where
  there is nothing to follow;
- binds every equation inside its ``eqn.ctx``, as ``eval_jaxpr`` does;
- evaluates JAX's call primitives inline, their bodies found through one
  table (:data:`CALLS`, the parameter names per primitive as jax names
  them);
- hands every other equation that touches followed values to a rule, found
  by primitive name in the subclass's ``rules`` table (a method name), or
  to its ``default`` rule.

:func:`find` searches nested jaxprs at any depth, for the checks that only
look (a convolution grouped over examples, a JAX bug's trigger), and
:func:`inlined` traces a function with its calls evaluated inline, for the
analyses that read one flat program (:mod:`jaxaccum._rowsums`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import jax
from jax.extend import core as jex_core

#: JAX's call primitives whose body the walker evaluates inline, and the
#: parameter that holds it (a ``ClosedJaxpr``). ``closed_call`` is what a
#: ``custom_vjp`` whose residuals are unused becomes after DCE; jax 0.12.1
#: names its equation ``eval_jaxpr``.
CALLS: dict[str, str] = {
  "pjit": "jaxpr",
  "jit": "jaxpr",
  "closed_call": "call_jaxpr",
  "eval_jaxpr": "call_jaxpr",
  "core_call": "call_jaxpr",
}

#: ``jax.checkpoint``'s primitive, by its names across jax versions; its
#: body (parameter ``jaxpr``) is an open ``Jaxpr``.
REMAT = frozenset({"checkpoint", "remat2"})


def body(eqn: Any) -> Any:
  """The ``ClosedJaxpr`` a call equation (:data:`CALLS`) evaluates, or None
  for any other equation.

  >>> import jax, jax.numpy as jnp
  >>> closed = jax.make_jaxpr(jax.jit(lambda x: x * 2))(1.0)
  >>> body(closed.jaxpr.eqns[0]).jaxpr.eqns[0].primitive.name
  'mul'
  """
  name = CALLS.get(eqn.primitive.name)
  if name is None:
    return None
  inner = eqn.params[name]
  if isinstance(inner, jex_core.ClosedJaxpr):
    return inner
  return jex_core.ClosedJaxpr(inner, ())


def jaxprs(params: Any) -> Iterator[Any]:
  """Every open ``Jaxpr`` among an equation's parameters (inside tuples and
  ``ClosedJaxpr``s too): a call's body, a ``scan``'s, a ``cond``'s
  branches, a custom derivative's primal."""
  values = params.values() if isinstance(params, dict) else params
  for value in values:
    if isinstance(value, (tuple, list)):
      yield from jaxprs(value)
      continue
    inner = getattr(value, "jaxpr", value)
    if isinstance(inner, jex_core.Jaxpr):
      yield inner


def find(jaxpr: Any, predicate: Callable[[Any], bool]) -> Any:
  """The first equation of ``jaxpr`` (a ``Jaxpr`` or ``ClosedJaxpr``), at
  any depth, for which ``predicate`` holds; None if there is none.

  >>> import jax, jax.numpy as jnp
  >>> closed = jax.make_jaxpr(lambda x: jax.checkpoint(jnp.sin)(x))(1.0)
  >>> find(closed, lambda e: e.primitive.name == "sin").primitive.name
  'sin'
  """
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  for eqn in jaxpr.eqns:
    if predicate(eqn):
      return eqn
    for inner in jaxprs(eqn.params):
      found = find(inner, predicate)
      if found is not None:
        return found
  return None


def bind(eqn: Any, invals: Sequence[Any], **changes: Any) -> list[Any]:
  """``eqn``'s primitive applied to ``invals``, its parameters with
  ``changes``; always a list of outputs."""
  params = {**eqn.primitive.get_bind_params(eqn.params), **changes}
  out = eqn.primitive.bind(*invals, **params)
  return list(out) if eqn.primitive.multiple_results else [out]


class Walker:
  """Evaluates a jaxpr with a metadata value beside each variable.

  Subclasses name their rules in ``rules`` (primitive name -> method name)
  and give a ``default`` rule; a rule takes ``(eqn, invals, meta)`` and
  returns ``(outs, out_meta)``, lists as long as ``eqn.outvars``. An
  equation that :meth:`follows` nothing is bound as it is (:meth:`plain`).

  >>> import jax, jax.numpy as jnp
  >>> class Uses(Walker):
  ...   def __init__(self):
  ...     self.seen = []
  ...   def default(self, eqn, invals, meta):
  ...     self.seen.append(eqn.primitive.name)
  ...     return self.plain(eqn, invals), ["w"] * len(eqn.outvars)  # followed on
  >>> closed = jax.make_jaxpr(lambda w, x: jnp.sin(x) * jax.jit(jnp.cos)(w))(1.0, 2.0)
  >>> walk = Uses()
  >>> outs, _ = walk.run(closed.jaxpr, closed.consts, [1.0, 2.0], ["w", None])
  >>> walk.seen, float(outs[0]) == float(jnp.sin(2.0) * jnp.cos(1.0))
  (['cos', 'mul'], True)
  """

  rules: ClassVar[dict[str, str]] = {}

  def run(
    self,
    jaxpr: Any,
    consts: Sequence[Any],
    args: Sequence[Any],
    meta: Sequence[Any] | None = None,
  ) -> tuple[list[Any], list[Any]]:
    """``jaxpr`` on ``args`` (with ``consts``), each argument with its
    metadata (None for all where not given): the outputs and theirs."""
    env: dict[Any, Any] = {}
    known: dict[Any, Any] = {}

    def read(v: Any) -> Any:
      return v.val if isinstance(v, jex_core.Literal) else env[v]

    def meta_of(v: Any) -> Any:
      return None if isinstance(v, jex_core.Literal) else known.get(v)

    for v, x in zip(jaxpr.constvars, consts, strict=True):
      env[v] = x
    meta = [None] * len(args) if meta is None else meta
    for v, x, m in zip(jaxpr.invars, args, meta, strict=True):
      env[v] = x
      if m is not None:
        known[v] = m
    for eqn in jaxpr.eqns:
      invals = [read(v) for v in eqn.invars]
      inmeta = [meta_of(v) for v in eqn.invars]
      with eqn.ctx.manager:
        outs, outmeta = self.equation(eqn, invals, inmeta)
      for v, x, m in zip(eqn.outvars, outs, outmeta, strict=True):
        env[v] = x
        if m is not None:
          known[v] = m
    return [read(v) for v in jaxpr.outvars], [meta_of(v) for v in jaxpr.outvars]

  def equation(
    self, eqn: Any, invals: list[Any], meta: list[Any]
  ) -> tuple[list[Any], list[Any]]:
    """One equation: bound as it is, a call evaluated inline, or a rule."""
    if not self.follows(eqn, invals, meta):
      return self.plain(eqn, invals), [None] * len(eqn.outvars)
    inner = body(eqn)
    if inner is not None:
      return self.run(inner.jaxpr, inner.consts, invals, meta)
    rule = getattr(self, self.rules.get(eqn.primitive.name, "default"))
    return rule(eqn, invals, meta)

  def follows(self, eqn: Any, invals: list[Any], meta: list[Any]) -> bool:
    """Whether ``eqn`` touches a followed value (by default: one with
    metadata)."""
    del eqn, invals
    return any(m is not None for m in meta)

  def plain(self, eqn: Any, invals: list[Any]) -> list[Any]:
    """``eqn`` on ``invals``, as traced."""
    return bind(eqn, invals)

  def default(
    self, eqn: Any, invals: list[Any], meta: list[Any]
  ) -> tuple[list[Any], list[Any]]:
    """The rule for every primitive not in ``rules``."""
    raise NotImplementedError


class _Inline(Walker):
  """Evaluates every equation, calls inline (the walker's own rule)."""

  def follows(self, eqn: Any, invals: list[Any], meta: list[Any]) -> bool:
    del eqn, invals, meta
    return True

  def default(
    self, eqn: Any, invals: list[Any], meta: list[Any]
  ) -> tuple[list[Any], list[Any]]:
    return self.plain(eqn, invals), [None] * len(eqn.outvars)


def inlined(fun: Callable[..., Any], args: Sequence[Any]) -> Any:
  """``fun(*args)``'s ``ClosedJaxpr`` (``args`` flat: arrays or
  ``ShapeDtypeStruct``\\ s), with every call of :data:`CALLS` evaluated
  inline, at any depth outside other primitives' bodies; its outputs flat.

  >>> import jax, jax.numpy as jnp
  >>> f = lambda x: jax.jit(jnp.sin)(x) * 2
  >>> [e.primitive.name for e in inlined(f, [jnp.ones(2)]).jaxpr.eqns]
  ['sin', 'mul']
  """
  closed = jax.make_jaxpr(lambda *xs: jax.tree.leaves(fun(*xs)))(*args)

  def flat(*xs: Any) -> list[Any]:
    outs, _ = _Inline().run(closed.jaxpr, closed.consts, xs)
    return outs

  return jax.make_jaxpr(flat)(*args)
