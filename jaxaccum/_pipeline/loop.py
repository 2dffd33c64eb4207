"""The loop: one stage's layers on one micro-batch (:class:`StageFn`), and
the ``lax.scan`` of every stage over the schedule's iterations, with the
activations moved one stage on after each (:class:`Loop`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxaccum import _compat
from jaxaccum._pipeline.arguments import Args
from jaxaccum._pipeline.schedule import Schedule

PyTree = Any


class StageFn:
  """One stage's ``n`` layers on one micro-batch, in one repeat."""

  def __init__(
    self,
    layer_fn: Callable[..., Any],
    schedule: Schedule,
    key_index: int | None,
    remat: Any,
    extra: Args,
  ):
    self.layer_fn = layer_fn
    self.schedule = schedule
    self.key_index = key_index
    self.extra = extra
    fn = self._run
    if remat is not False:
      policy = None if remat is True else remat
      fn = jax.checkpoint(fn, prevent_cse=False, policy=policy)
    self.fn = fn

  def _run(self, w, h, where, traced):
    stage, micro, repeat = where
    sched = self.schedule
    n = sched.layers_per_stage
    w = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, repeat, 0, False), w)
    first = (repeat * sched.stages + stage) * n

    def layer(h, xs):
      w_l, i = xs
      call = self.extra.full(traced)
      if self.key_index is not None:
        key = jax.random.fold_in(call[self.key_index], micro)
        call[self.key_index] = jax.random.fold_in(key, first + i)
      return self.layer_fn(w_l, h, *call), None

    h, _ = jax.lax.scan(layer, h, (w, jnp.arange(n, dtype=jnp.int32)))
    return h

  def __call__(self, w: PyTree, h: PyTree, where: tuple, traced: list[Any]) -> PyTree:
    """Runs the layers of repeat ``where = (stage, micro, repeat)`` on ``h``;
    ``micro`` is the index the keys fold in. ``traced``: the arrays among
    ``pipe``'s extra arguments (the static values are closed over)."""
    return self.fn(w, h, where, traced)


@dataclasses.dataclass(frozen=True)
class Loop:
  """The pipeline loop of one stage, over the named stage ``axis``: a
  ``shard_map``'s over ``devices``, or a ``vmap``'s on one device.

  Attributes:
    stage_fn: the stage's layers.
    axis: the stage axis.
    devices: whether the stages are devices (else a ``vmap``, which wants
      every ``ppermute`` to be a permutation).
    split_rows: return each stage its share of the result's rows (a
      reduce-scatter), instead of all of them (an all-reduce).
    data_axes: the manual data axes: data shard ``d`` (its index over
      them) numbers its micro-batches ``d·m .. d·m + m - 1`` for the keys.
  """

  stage_fn: StageFn
  axis: str
  devices: bool
  split_rows: bool = False
  data_axes: tuple[str, ...] = ()

  def __call__(self, w: PyTree, x: PyTree, traced: list[Any]) -> PyTree:
    """``w``: this stage's layers, leaves ``(r, n, ...)``; ``x``: the whole
    batch (of this data shard); ``traced``: the arrays among the extra
    arguments."""
    return _run_loop(self, w, x, traced)


def _run_loop(loop: Loop, w: PyTree, x: PyTree, traced: list[Any]) -> PyTree:
  """See :class:`Loop`."""
  stage_fn, axis, devices = loop.stage_fn, loop.axis, loop.devices
  schedule = stage_fn.schedule
  S, r, m = schedule.stages, schedule.repeats, schedule.micro_batches
  stage = jax.lax.axis_index(axis)
  shard = jax.lax.axis_index(loop.data_axes) if loop.data_axes else 0
  # Micro-batch j: rows j, j + m, ... (a batch sharded over devices stays put).
  buf = jax.tree.map(lambda a: _split(a, m), x)
  take = lambda tree, j: jax.tree.map(  # noqa: E731
    lambda a: jax.lax.dynamic_index_in_dim(a, j, 0, False), tree
  )
  put = lambda tree, j, value, ok: jax.tree.map(  # noqa: E731
    lambda a, v: jax.lax.dynamic_update_index_in_dim(
      a, jnp.where(ok, v, jax.lax.dynamic_index_in_dim(a, j, 0, False)), j, 0
    ),
    tree,
    value,
  )
  # The last stage's activations go back to the first for the next repeat;
  # with one repeat nothing goes back, except where vmap wants a permutation.
  ring = [(i, (i + 1) % S) for i in range(S if r > 1 or not devices else S - 1)]
  act = take(buf, 0)  # real data, never NaN, for the bubble's first inputs

  def iteration(carry, t):
    buf, act = carry
    micro, repeat, real = schedule.slot(t, stage)
    first = stage == 0
    inp = jax.tree.map(lambda b, a: jnp.where(first, b, a), take(buf, micro), act)
    out = stage_fn(w, inp, (stage, shard * m + micro, repeat), traced)
    # The last stage keeps its results: a slot's last write is the last
    # repeat's (every repeat writes every slot, in order).
    buf = put(buf, micro, out, real & (stage == S - 1))
    act = jax.tree.map(lambda o: jax.lax.ppermute(o, axis, ring), out)
    if r > 1:  # stage 0 parks what comes back, for the next repeat
      back, _, back_real = schedule.slot(t, S - 1)
      buf = put(buf, back, act, first & back_real)
    return (buf, act), None

  (buf, _), _ = jax.lax.scan(
    iteration, (buf, act), jnp.arange(schedule.iterations, dtype=jnp.int32)
  )
  # The last stage's results to every stage: each gets its share of the rows
  # (the head then runs on 1/S of them per device), or all of them.
  last = stage == S - 1

  def collect(b):
    a = _merge(b)
    wide = a.dtype if a.dtype != jnp.bool_ else jnp.int32  # psum sums numbers
    a = jnp.where(last, a, jnp.zeros_like(a)).astype(wide)
    if loop.split_rows:
      return _compat.psum_scatter(a, axis, 0)
    return jax.lax.psum(a, axis).astype(b.dtype)

  return jax.tree.map(lambda b: collect(b).astype(b.dtype), buf)


def _split(a: jax.Array, m: int) -> jax.Array:
  """``(B, ...)`` to ``(m, B / m, ...)``; micro-batch ``j`` holds rows ``j,
  j + m, ...``."""
  return jnp.swapaxes(a.reshape(a.shape[0] // m, m, *a.shape[1:]), 0, 1)


def _merge(a: jax.Array) -> jax.Array:
  """The inverse of :func:`_split`."""
  m, rows = a.shape[:2]
  return jnp.swapaxes(a, 0, 1).reshape(m * rows, *a.shape[2:])
