"""Exact by default: the loss's value and gradient from the totals of its
sums over rows.

:func:`read` reads ``fun``'s loss as ``F(s_1, ..., s_r, θ)`` of sums over
its rows (:mod:`jaxaccum._rowsums` says which values are sums), and the
:class:`Read` it returns is what the step needs to make it exact:

- :meth:`Read.evaluate` runs ``fun`` on one micro-batch and returns its
  outputs and its sums;
- :meth:`Read.counted` only the sums the parameters do not reach (a
  masked mean's count), cheaply, for a pass before the loop;
- :meth:`Read.finish` is ``F`` at the totals, its literals that count rows
  (``jnp.mean``'s) scaled to the whole batch's rows, and
  :meth:`Read.coefficients` its cotangents ``c_j = ∂F/∂s_j`` there.

The step (:mod:`jaxaccum._exact_plan`) then differentiates
``Σ_j <c_j, s_j>`` on each micro-batch, whose backward pass sees the full
batch's cotangents (an FP8 layer's gradient scale sees the full batch's
too), and adds ``∂F/∂θ`` at the totals once (a penalty on the weights).
Which totals the coefficients need before the loop is
:attr:`Read.coefficients`: none (a mean, a sum), the counts (a masked or
token-weighted mean: a pass over the mask alone), or every sum (a ratio of
two means: a forward pass first).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from jaxaccum import _compat, _jaxpr, _rowsums
from jaxaccum._rowsums import SUM, Rows


class Refusal(NamedTuple):
  """Why a loss is not read as a function of sums over its rows."""

  reason: str
  divides_by_batch: bool = False


class Literal(NamedTuple):
  """A literal of ``F`` that counts rows: its value at the micro-batch's
  ``rows``, and how it scales with them (``+1`` in proportion, ``-1``
  inversely)."""

  value: Any
  power: int


@dataclasses.dataclass(frozen=True, eq=False)
class Read:
  """``fun``'s loss read as ``F`` of sums over its rows.

  Attributes:
    jaxpr: ``fun`` traced on one micro-batch, with calls inlined (a
      ``ClosedJaxpr``); its first output is the loss.
    sums: the sum nodes' output variables, in the jaxpr's order.
    params: for each sum, whether the differentiated leaves reach it.
    rest: the equations of ``F``, in order: those the loss needs beyond the
      sum nodes.
    counts: the literals of ``F`` that count rows, by ``(equation index in
      rest, operand position)``.
    rows: the micro-batch's rows.
    coefficients: ``"constant"`` (``∂F/∂s`` depends on no sum),
      ``"counts"`` (only on sums the parameters do not reach) or
      ``"forward"`` (on sums they reach).
  """

  jaxpr: Any
  sums: tuple[Any, ...]
  params: tuple[bool, ...]
  rest: tuple[Any, ...]
  counts: dict[tuple[int, int], Literal]
  rows: int
  coefficients: str

  def evaluate(self, args: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """``fun`` on one micro-batch's flat ``args``: its outputs (the loss
    first) and its sums, in the order of :attr:`sums`."""
    env = self._env(args)
    for eqn in self.jaxpr.jaxpr.eqns:
      _run(eqn, env)
    return [_read(env, v) for v in self.jaxpr.jaxpr.outvars], [
      env[v] for v in self.sums
    ]

  def before_loop_reads(self, inputs: Sequence[bool]) -> bool:
    """Whether the totals the coefficients need before the loop read one of
    the jaxpr's inputs marked in ``inputs`` (the threaded state, which the
    pass before the loop would not thread)."""
    if self.coefficients == "constant":
      return False
    wanted = [
      v
      for v, p in zip(self.sums, self.params, strict=True)
      if self.coefficients == "forward" or not p
    ]
    marked = {v for v, m in zip(self.jaxpr.jaxpr.invars, inputs, strict=True) if m}
    return any(
      v in marked
      for eqn in _needed(self.jaxpr.jaxpr, wanted)
      for v in eqn.invars
      if not isinstance(v, jex_core.Literal)
    )

  def counted(self, args: Sequence[Any]) -> list[Any]:
    """The sums the parameters do not reach (zeros for the others), computed
    from only the equations they need: a masked mean's count from its
    mask, not a forward pass of the model."""
    wanted = [v for v, p in zip(self.sums, self.params, strict=True) if not p]
    env = self._env(args)
    for eqn in _needed(self.jaxpr.jaxpr, wanted):
      _run(eqn, env)
    return [
      jnp.zeros(v.aval.shape, v.aval.dtype) if p else env[v]
      for v, p in zip(self.sums, self.params, strict=True)
    ]

  def finish(self, totals: Sequence[Any], args: Sequence[Any], rows: int) -> Any:
    """``F`` at the totals of the sums, for a batch of ``rows`` rows: the
    loss. Of ``args`` (the jaxpr's inputs), only those ``F`` reads are read."""
    env = self._env(args)
    env.update(zip(self.sums, totals, strict=True))
    for i, eqn in enumerate(self.rest):
      invals = []
      for p, v in enumerate(eqn.invars):
        count = self.counts.get((i, p))
        if count is not None:
          invals.append(_scaled(count, rows / self.rows))
        else:
          invals.append(_read(env, v))
      with eqn.ctx.manager:
        outs = _jaxpr.bind(eqn, invals)
      env.update(zip(eqn.outvars, outs, strict=True))
    return _read(env, self.jaxpr.jaxpr.outvars[0])

  def coefficients_at(
    self, totals: Sequence[Any], args: Sequence[Any], rows: int
  ) -> list[Any]:
    """``c_j = ∂F/∂s_j`` at the totals: each micro-batch's sums' cotangents,
    the full batch's (zeros for an integer sum, a count, which nothing
    differentiates)."""
    floating = [jnp.issubdtype(jnp.result_type(t), jnp.inexact) for t in totals]

    def value(wide: list[Any]) -> Any:
      it = iter(wide)
      return self.finish(
        [next(it) if f else t for t, f in zip(totals, floating, strict=True)],
        args,
        rows,
      )

    grads = iter(
      jax.grad(value)([t for t, f in zip(totals, floating, strict=True) if f])
    )
    return [
      next(grads) if f else jnp.zeros(jnp.shape(t), jnp.float32)
      for t, f in zip(totals, floating, strict=True)
    ]

  def _env(self, args: Sequence[Any]) -> dict[Any, Any]:
    closed = self.jaxpr
    env = dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(closed.jaxpr.invars, args, strict=True))
    return env


def _read(env: dict[Any, Any], v: Any) -> Any:
  return v.val if isinstance(v, jex_core.Literal) else env[v]


def _run(eqn: Any, env: dict[Any, Any]) -> None:
  """Binds ``eqn`` on ``env``'s values, inside its context, into ``env``."""
  with eqn.ctx.manager:
    outs = _jaxpr.bind(eqn, [_read(env, v) for v in eqn.invars])
  env.update(zip(eqn.outvars, outs, strict=True))


def _needed(jaxpr: Any, outvars: Sequence[Any]) -> list[Any]:
  """The equations ``outvars`` need, in order."""
  needed = set(outvars)
  taken = []
  for eqn in reversed(jaxpr.eqns):
    if any(v in needed for v in eqn.outvars):
      taken.append(eqn)
      needed |= {v for v in eqn.invars if not isinstance(v, jex_core.Literal)}
  return taken[::-1]


def _scaled(count: Literal, factor: float) -> Any:
  """A count literal at ``factor`` times the rows, in its own dtype."""
  value = np.asarray(count.value)
  scaled = value.astype(np.float64) * factor**count.power
  return np.asarray(scaled, value.dtype)


def read(
  fun: Callable[..., Any],
  args: Sequence[Any],
  rows_at: Sequence[Rows | None],
  params_at: Sequence[bool],
  rows: int,
) -> Read | Refusal:
  """Reads ``fun(*args)``'s first output (the loss) as ``F`` of sums over
  its rows, or says why not.

  Args:
    fun: the loss, of the flat arrays ``args``.
    args: ``ShapeDtypeStruct``\\ s (or arrays) of one micro-batch's call.
    rows_at: for each of ``args``, its :class:`Rows` (a batch leaf: rows
      along its first dimension) or None (a parameter, a key, a constant).
    params_at: for each of ``args``, whether it is differentiated.
    rows: the rows of the micro-batch.
  """
  closed = _jaxpr.inlined(fun, args)
  kind, nodes = _rowsums.sum_nodes(closed, rows_at)
  if kind != SUM:
    why = (
      "the loss does not depend on the batch"
      if kind is None
      else "the loss uses the rows other than through sums over them"
    )
    return Refusal(why, _divides_by_batch(closed, rows_at))
  rest = _rest(closed.jaxpr, nodes)
  doubled = [_doubled(a, r) for a, r in zip(args, rows_at, strict=True)]
  try:
    twice = _jaxpr.inlined(fun, doubled)
  except Exception as error:  # any: fun traced at its own rows
    # a shape of fun's that holds for its micro-batch's rows only
    why = f"it does not trace at twice the rows ({type(error).__name__}: {error})"
    return Refusal(why, _divides_by_batch(closed, rows_at))
  try:
    counts = _counts(closed, twice, rest)
  except ValueError as error:
    return Refusal(str(error), _divides_by_batch(closed, rows_at))
  sums = _loss_sums(closed.jaxpr, nodes, rest)
  reached = _reached(closed.jaxpr, params_at)
  params = tuple(v in reached for v in sums)
  coefficients = _coefficients(rest, sums, params)
  return Read(closed, sums, params, tuple(rest), counts, rows, coefficients)


def _doubled(arg: Any, rows: Rows | None) -> Any:
  """``arg``'s type with twice the rows (a batch leaf), else as it is."""
  if rows is None:
    return arg
  shape = list(arg.shape)
  shape[rows.dim] *= 2
  sharding = getattr(jax.typeof(arg), "sharding", None)
  return jax.ShapeDtypeStruct(tuple(shape), arg.dtype, sharding=sharding)


def _loss_sums(jaxpr: Any, nodes: list[Any], rest: list[Any]) -> tuple[Any, ...]:
  """The sums the loss is built from, in order (an aux's own sums are
  not)."""
  read = {v for e in rest for v in e.invars if not isinstance(v, jex_core.Literal)}
  read.add(jaxpr.outvars[0])
  return tuple(v for eqn in nodes for v in eqn.outvars if v in read)


def _rest(jaxpr: Any, sum_nodes: list[Any]) -> list[Any]:
  """The equations the loss (the first output) needs beyond the sum nodes."""
  stop = {id(e) for e in sum_nodes}
  needed = {jaxpr.outvars[0]} - {None}
  taken = []
  for eqn in reversed(jaxpr.eqns):
    if id(eqn) in stop or not any(v in needed for v in eqn.outvars):
      continue
    taken.append(eqn)
    needed |= {v for v in eqn.invars if not isinstance(v, jex_core.Literal)}
  return taken[::-1]


def _counts(
  closed: Any, doubled: Any, rest: list[Any]
) -> dict[tuple[int, int], Literal]:
  """The literals of ``F`` that count rows: each literal the loss needs,
  traced at ``rows`` against the same program at twice the rows. One that
  differs outside ``F``, or otherwise than in proportion (or inversely),
  is a ``ValueError`` naming it."""
  eqns, twice = closed.jaxpr.eqns, doubled.jaxpr.eqns
  if [e.primitive.name for e in eqns] != [e.primitive.name for e in twice]:
    raise ValueError("its program changes with the number of rows")
  if len(closed.consts) != len(doubled.consts) or not all(
    _same_const(a, b) for a, b in zip(closed.consts, doubled.consts, strict=True)
  ):
    raise ValueError("a constant it closes over changes with the number of rows")
  where = {id(e): i for i, e in enumerate(rest)}
  # only what the loss needs: a literal of the aux (its own mean) is the
  # aux's business
  loss_needs = {id(e) for e in _needed(closed.jaxpr, closed.jaxpr.outvars[:1])}
  counts = {}
  for eqn, other in zip(eqns, twice, strict=True):
    if id(eqn) not in loss_needs:
      continue
    for p, (v, w) in enumerate(zip(eqn.invars, other.invars, strict=True)):
      if not isinstance(v, jex_core.Literal) or np.array_equal(v.val, w.val):
        continue
      power = _power(v.val, w.val)
      if id(eqn) not in where or power is None:
        raise ValueError(
          f"a literal ({v.val} at these rows, {w.val} at twice as many) scales "
          "with the rows " + ("where they are summed" if power else "otherwise")
        )
      counts[(where[id(eqn)], p)] = Literal(v.val, power)
  return counts


def _same_const(a: Any, b: Any) -> bool:
  """Whether two traces closed over the same constant: the same object (a
  traced keyword argument), or equal concrete arrays."""
  if a is b:
    return True
  if _compat.is_tracer(a) or _compat.is_tracer(b):
    return False
  return np.shape(a) == np.shape(b) and bool(np.array_equal(a, b))


def _power(once: Any, twice: Any) -> int | None:
  """``+1`` if ``twice`` is twice ``once``, ``-1`` if half, else None."""
  a, b = float(np.asarray(once)), float(np.asarray(twice))
  if a and math.isclose(b, 2 * a, rel_tol=1e-6):
    return 1
  if a and math.isclose(b, a / 2, rel_tol=1e-6):
    return -1
  return None


def _reached(jaxpr: Any, params_at: Sequence[bool]) -> set[Any]:
  """The variables the differentiated inputs reach."""
  reached = {v for v, p in zip(jaxpr.invars, params_at, strict=True) if p}
  for eqn in jaxpr.eqns:
    if any(v in reached for v in eqn.invars if not isinstance(v, jex_core.Literal)):
      reached |= set(eqn.outvars)
  return reached


#: Operations in which an operand affine in some variables stays affine.
_AFFINE = frozenset(
  {"add", "add_any", "sub", "neg", "convert_element_type", "reduce_sum", "copy"}
  | {"broadcast_in_dim", "reshape", "squeeze", "transpose", "copy_p", "select_n"}
)


def _coefficients(
  rest: list[Any], sums: tuple[Any, ...], params: tuple[bool, ...]
) -> str:
  """``"constant"``, ``"counts"`` or ``"forward"``: what ``∂F/∂s`` depends
  on (:class:`Read`)."""
  if _affine(rest, set(sums)):
    return "constant"
  if _affine(rest, {v for v, p in zip(sums, params, strict=True) if p}):
    return "counts"
  return "forward"


def _affine(rest: list[Any], variables: set[Any]) -> bool:
  """Whether the loss (the last equation's output) is affine in
  ``variables``: each value either does not depend on them, or is affine
  in them (sums and differences, scaled or divided by a value that does not
  depend on them)."""
  state: dict[Any, str] = {v: "affine" for v in variables}

  def of(v: Any) -> str:
    return "free" if isinstance(v, jex_core.Literal) else state.get(v, "free")

  for eqn in rest:
    ins = [of(v) for v in eqn.invars]
    name = eqn.primitive.name
    if "nonlinear" in ins:
      out = "nonlinear"
    elif all(k == "free" for k in ins):
      out = "free"
    elif (
      (name in _AFFINE and (name != "select_n" or ins[0] == "free"))
      or (name == "mul" and ins.count("affine") == 1)
      or (name == "div" and ins[1] == "free")
    ):
      out = "affine"
    else:
      out = "nonlinear"
    for v in eqn.outvars:
      state[v] = out
  return not rest or state.get(rest[-1].outvars[0]) != "nonlinear"


def _divides_by_batch(closed: Any, rows_at: Sequence[Rows | None]) -> bool:
  """Whether the loss divides by a scalar computed from the batch (a token
  count): the case a warning names ``normalize="weighted"`` for (a batch
  statistic per feature, BatchNorm's, is not such a count)."""
  batch = {v for v, r in zip(closed.jaxpr.invars, rows_at, strict=True) if r}
  for eqn in closed.jaxpr.eqns:
    operands = [v for v in eqn.invars if not isinstance(v, jex_core.Literal)]
    if not any(v in batch for v in operands):
      continue
    divisor = eqn.invars[1] if eqn.primitive.name == "div" else None
    scalar = divisor is not None and not getattr(divisor.aval, "shape", (1,))
    if not isinstance(divisor, jex_core.Literal) and divisor in batch and scalar:
      return True
    batch |= set(eqn.outvars)
  return False
