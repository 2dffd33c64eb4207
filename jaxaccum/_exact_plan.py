"""The exact plan of one step: :func:`for_step` reads the step's loss
(:func:`jaxaccum._exact.read`) on micro-batch 0 and returns its
:class:`Plan`, or None where exactness by default does not apply.

The :class:`Plan` is what the engine runs: :meth:`Plan.objective` is the
loss each micro-batch differentiates (``Σ_j <c_j, s_j>``, its sums riding
with the aux), and :meth:`Plan.finished` the step's value and gradients
from the totals of those sums after the loop. The coefficients ``c_j`` are
taken before the loop at the totals they need (:func:`plan`).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from jaxaccum import _compat, _exact, _jaxpr, _rowsums, _split
from jaxaccum._exact import Read, Refusal
from jaxaccum._rowsums import Rows


class Flat(NamedTuple):
  """A call's arguments as the flat arrays :func:`read` takes: the array
  leaves of the positional arguments, the rest kept as they are."""

  treedef: Any
  leaves: list[Any]  # every leaf; arrays where ``arrays`` says
  arrays: list[int]  # the positions of the array leaves

  @classmethod
  def of(cls, call_args: Sequence[Any]) -> Flat:
    leaves, treedef = jax.tree.flatten(list(call_args))
    arrays = [n for n, x in enumerate(leaves) if _is_array(x)]
    return cls(treedef, leaves, arrays)

  def values(self) -> list[Any]:
    return [self.leaves[n] for n in self.arrays]

  def call(self, fun: Callable[..., Any], values: Sequence[Any]) -> Any:
    """``fun`` on the call's arguments with ``values`` for its arrays."""
    leaves = list(self.leaves)
    for n, x in zip(self.arrays, values, strict=True):
      leaves[n] = x
    return fun(*jax.tree.unflatten(self.treedef, leaves))

  def marks(self, positions: Sequence[int], mark: Any) -> list[Any]:
    """For each array, ``mark`` if it is a leaf of an argument at one of
    ``positions``, else None."""
    owner = [
      n
      for n, arg in enumerate(jax.tree.unflatten(self.treedef, self.leaves))
      for _ in jax.tree.leaves(arg)
    ]
    return [mark if owner[n] in positions else None for n in self.arrays]


class OtherSums(ValueError):
  """The micro-batch ``fun`` sees (one device's rows) is read as other sums
  than the whole batch's micro-batch (a program that changes at one row:
  a size-1 dimension broadcast, or squeezed, where rows were)."""


def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) or hasattr(
    x, "aval"
  )


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
  """One step made exact: the read of its loss, the sums' coefficients (the
  full batch's cotangents), and the rows of the whole batch."""

  read: Read
  coefficients: list[Any]
  rows: int
  batch: tuple[int, ...]
  params: tuple[int, ...]
  outs: Any  # the tree of loss_fn's outputs, as the read flattened them

  def objective(self, loss_fn: Callable[..., Any]) -> Callable[..., Any]:
    """``loss_fn`` (``call_args -> (loss, (weight, aux, state))``) as
    ``call_args -> (Σ_j <c_j, s_j>, (weight, (aux, sums), state))``: the
    sums ride with the aux through every path's loop, stacked over the
    micro-batches (and devices). Its gradient is this micro-batch's
    share of the full batch's, its backward pass seeded as the full
    batch's. ``fun`` is traced again on the call's own types (a device's
    rows under ``mesh=``), its sums found in the same order."""

    def objective(*call_args: Any) -> Any:
      flat = Flat.of(call_args)
      values = flat.values()
      read_types = [_key(v.aval) for v in self.read.jaxpr.jaxpr.invars]
      if [_key(jax.typeof(x)) for x in values] == read_types:
        outs, sums = self.read.evaluate(values)  # the read's own trace
        outs = jax.tree.unflatten(self.outs, outs)
      else:  # another view of the rows (a device's, under mesh=)
        outs, sums = _evaluated(loss_fn, flat, self.batch)
      if len(sums) != len(self.coefficients):
        raise OtherSums(
          f"one device's micro-batch has {len(sums)} sums over rows where the "
          f"whole batch's has {len(self.coefficients)}"
        )
      terms = [_dot(c, s) for c, s in zip(self.coefficients, sums, strict=True)]
      total = functools.reduce(jnp.add, terms)
      _, (weight, aux, new_state) = outs
      return total, (weight, (aux, sums), new_state)

    return objective

  def value_and_direct(
    self, totals: Sequence[Any], call_args: Sequence[Any]
  ) -> tuple[Any, tuple[Any, ...]]:
    """The loss at the totals, and ``∂F/∂θ`` there (a penalty on the
    weights), for the differentiated arguments of ``call_args``."""
    flat = Flat.of(call_args)
    values = flat.values()
    diff = [n for n, m in enumerate(flat.marks(self.params, True)) if m]

    def value(params: list[Any]) -> Any:
      args = list(values)
      for n, x in zip(diff, params, strict=True):
        args[n] = x
      return self.read.finish(totals, args, self.rows)

    # allow_int: an extended leaf (Flax's fm32), which F does not read
    loss, grads = jax.value_and_grad(value, allow_int=True)([values[n] for n in diff])
    rebuilt = list(flat.leaves)
    for n, g in zip(diff, grads, strict=True):
      rebuilt[flat.arrays[n]] = g
    args = jax.tree.unflatten(flat.treedef, rebuilt)
    return loss, tuple(args[n] for n in self.params)

  def finished(
    self,
    parts: Sequence[Any],
    grads: tuple[Any, ...],
    args: Sequence[Any],
    gradients: Sequence[bool],
  ) -> tuple[Any, tuple[Any, ...]]:
    """The step's value and gradients from the loop: the sums stacked over
    its micro-batches (``parts``), the accumulated gradients of the
    objectives, and the call's arguments for the rest of the loss. Sums
    left ``unreduced`` by the loop are reduced here, once. ``gradients``
    marks the leaves that are gradients (the others, an FP8 scale's new
    value, are kept as the loop combined them)."""
    totals = [_reduced(jnp.sum(p, axis=0)) for p in parts]
    value, direct = self.value_and_direct(totals, args)
    flat, treedef = jax.tree.flatten(grads)
    summed = [
      g + d.astype(g.dtype) if is_gradient else g
      for g, d, is_gradient in zip(
        flat, jax.tree.leaves(direct), gradients, strict=True
      )
    ]
    return value, jax.tree.unflatten(treedef, summed)


def _evaluated(
  loss_fn: Callable[..., Any], flat: Flat, batch: tuple[int, ...]
) -> tuple[Any, list[Any]]:
  """``loss_fn`` on ``flat``'s arguments, with its sums over rows."""
  rows_at = flat.marks(batch, Rows(0))
  outs_tree: list[Any] = []

  def fun(*values: Any) -> list[Any]:
    out = flat.call(loss_fn, values)
    leaves, tree = jax.tree.flatten(out)
    outs_tree[:] = [tree]
    return leaves

  values = flat.values()
  closed = _jaxpr.inlined(fun, [_type(x) for x in values])
  _, nodes = _rowsums.sum_nodes(closed, rows_at)
  sums = _exact._loss_sums(closed.jaxpr, nodes, _exact._rest(closed.jaxpr, nodes))
  env = dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))
  env.update(zip(closed.jaxpr.invars, values, strict=True))
  # The loss's value (its first output) is left out: the objective is
  # built from the sums, and ``F`` on a device's share of them (``unreduced``
  # under plain jit) is neither needed nor always typed.
  kept = [v for v in closed.jaxpr.outvars[1:] if not isinstance(v, jex_core.Literal)]
  for eqn in _exact._needed(closed.jaxpr, [*sums, *kept]):
    _exact._run(eqn, env)
  outs = [None, *(_exact._read(env, v) for v in closed.jaxpr.outvars[1:])]
  return jax.tree.unflatten(outs_tree[0], outs), [env[v] for v in sums]


def _key(aval: Any) -> tuple[Any, ...]:
  """What a value's type is compared by: shape, dtype, sharding."""
  return (aval.shape, aval.dtype, getattr(aval, "sharding", None))


def _type(x: Any) -> Any:
  aval = jax.typeof(x)
  return jax.ShapeDtypeStruct(
    aval.shape, aval.dtype, sharding=getattr(aval, "sharding", None)
  )


def plan(
  loss_fn: Callable[..., Any],
  call_args_at: Callable[[Any], Sequence[Any]],
  *,
  micro_batches: int,
  batch: tuple[int, ...],
  params: tuple[int, ...],
  rows: int,
  micro_rows: int,
) -> Plan | Refusal:
  """The step's :class:`Plan`, or why its loss is not read as sums.

  Args:
    loss_fn: ``call_args -> (loss, rest)``, ``fun`` on one micro-batch.
    call_args_at: ``i -> call_args``, micro-batch ``i``'s arguments (``i``
      traced; micro-batch 0 read).
    micro_batches: the micro-batches of the whole batch.
    batch: the positions of the batch arguments in ``call_args``.
    params: the positions of the differentiated arguments.
    rows: the whole batch's rows; ``micro_rows`` one micro-batch's.
  """
  first = Flat.of(call_args_at(0))
  outs_tree: list[Any] = []

  def fun(*values: Any) -> list[Any]:
    leaves, tree = jax.tree.flatten(first.call(loss_fn, values))
    outs_tree[:] = [tree]
    return leaves

  got = _exact.read(
    fun,
    [_type(x) for x in first.values()],
    first.marks(batch, Rows(0)),
    [m is not None for m in first.marks(params, True)],
    micro_rows,
  )
  if isinstance(got, Refusal):
    return got
  totals = _totals(got, call_args_at, micro_batches)
  coefficients = got.coefficients_at(totals, first.values(), rows)
  return Plan(got, coefficients, rows, batch, params, outs_tree[0])


def _totals(
  got: Read, call_args_at: Callable[[Any], Sequence[Any]], k: int
) -> list[Any]:
  """The totals the coefficients need before the loop: none (zeros), the
  counts alone, or every sum (a forward pass over the micro-batches)."""
  zeros = [jnp.zeros(v.aval.shape, v.aval.dtype) for v in got.sums]
  if got.coefficients == "constant":
    return zeros

  def body(totals: list[Any], i: Any) -> tuple[list[Any], None]:
    values = Flat.of(call_args_at(i)).values()
    sums = (
      got.counted(values) if got.coefficients == "counts" else got.evaluate(values)[1]
    )
    return [t + _reduced(s) for t, s in zip(totals, sums, strict=True)], None

  totals, _ = jax.lax.scan(body, zeros, jnp.arange(k, dtype=jnp.int32))
  return totals


def _dot(c: Any, s: Any) -> Any:
  """``<c, s>``; where ``s`` is ``unreduced`` (a micro-batch's sum over
  rows sharded over Explicit data axes, under plain ``jit``), ``c`` typed
  ``reduced`` over the same axes, so that the product stays ``unreduced``
  until the step's one reduction after the loop."""
  c = c.astype(s.dtype)
  spec = _compat.explicit_spec(s)
  if spec is None or not spec.unreduced:
    return jnp.vdot(c, s)
  typed = jax.sharding.PartitionSpec(*spec.partitions, reduced=set(spec.unreduced))
  return jnp.sum(jax.sharding.reshard(c, typed) * s)


def _reduced(x: Any) -> Any:
  """``x`` summed over the axes its type leaves ``unreduced`` (a count of
  rows sharded over Explicit data axes, under plain ``jit``): the totals
  the coefficients are taken at are the whole batch's."""
  spec = _compat.explicit_spec(x)
  if spec is None or not spec.unreduced:
    return x
  return jax.sharding.reshard(x, jax.sharding.PartitionSpec(*spec.partitions))


def for_step(
  engine: Any, args: tuple[Any, ...], kwargs: dict[str, Any], split: Any
) -> Plan | None:
  """The :class:`Plan` of ``engine``'s step on ``args``, where exactness by
  default applies (``normalize="mean"``, two micro-batches or more, no
  per-example clipping or noise statistics) and the loss is read as sums
  over rows; else None, with a warning where the loss divides by a
  quantity computed from the batch (``normalize="weighted"`` is then the
  way to an exact step)."""
  o = engine.options
  k = split.num_micro_batches
  if o.normalize != "mean" or k < 2 or o.rule is not None:
    return None
  if o.noise_stats:
    return None
  batches = _split.MicroBatches(tuple(args[n] for n in o.batch_argnums), split)
  assemble = engine.micro.call_args(args, k)
  diff_args = tuple(args[n] for n in o.argnums)
  state = None if o.state_argnum is None else args[o.state_argnum]

  def call_args_at(i: Any) -> list[Any]:
    scanned = [None if x is None else x[i] for x in batches.scanned()]
    micro = batches.take(tuple(scanned), batches.fetch(i), i)
    return assemble(diff_args, micro, i, state)

  found = plan(
    engine.micro.loss_fn(args, kwargs, split.batch_size),
    call_args_at,
    micro_batches=k,
    batch=tuple(o.batch_argnums),
    params=tuple(o.argnums),
    rows=split.batch_size,
    micro_rows=split.micro_batch_size,
  )
  if isinstance(found, Refusal):
    if found.divides_by_batch:
      warnings.warn(
        "jaxaccum: the loss divides by a quantity computed from the batch "
        f"but {found.reason}, so each micro-batch's loss is weighted equally, "
        "which is not the full batch's loss where micro-batches hold "
        'different counts. Return (loss_sum, weight) with normalize="weighted" '
        "for the exact token mean.",
        stacklevel=4,
      )
    return None
  if o.state_argnum is not None:
    # the pass before the loop does not thread the state: it may not read it
    flat = Flat.of(call_args_at(0))
    if found.read.before_loop_reads(
      [m is not None for m in flat.marks((o.state_argnum,), True)]
    ):
      return None
  return found
