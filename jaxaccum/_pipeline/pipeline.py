"""``pipeline()``, and the ``pipe`` it returns: the schedule planned and the
arguments checked at trace time, then the loop run on the mesh's stage axis
(a ``shard_map``) or on one device (a ``vmap`` over the stages)."""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxaccum import _compat
from jaxaccum._pipeline import arguments as _arguments
from jaxaccum._pipeline import layout as _layout
from jaxaccum._pipeline import loop as _loop
from jaxaccum._pipeline.schedule import PipelineBubbleWarning, Schedule

PyTree = Any


def pipeline(
  layer_fn: Callable[..., Any],
  *,
  num_stages: int,
  num_micro_batches: int,
  stage_axis: str = "stage",
  repeats: int = 1,
  remat: bool | Callable[..., Any] = True,
  rng_argnum: int | None = None,
  data_axis: str | tuple[str, ...] | None = None,
) -> Callable[..., Any]:
  """Pipeline-parallel layers: ``layer_fn`` over stacked layers, in stages.

  ``pipe(stacked, x, *args)`` equals ``lax.scan`` of ``layer_fn`` over the
  ``L`` layers of ``stacked`` applied to ``x``, for values and gradients.
  The layers are split into ``num_stages`` stages on the mesh's
  ``stage_axis``, ``x``'s batch into ``num_micro_batches`` micro-batches,
  and while stage ``s`` runs micro-batch ``j``, stage ``s + 1`` runs
  micro-batch ``j - 1``: GPipe's schedule, with MaxText's circular repeats.
  Call it inside your loss, under ``jit``: the embedding before it and the
  head after it run on the whole batch.

  Stage ``s`` holds layers ``s·n .. s·n + n - 1`` of each repeat, ``n =
  L / (num_stages · repeats)``. Lay the leaves out so that each stage's
  layers are one block of the stage axis:

  - ``repeats=1``: leaves ``(L, ...)``, sharded ``P(stage_axis, ...)``;
  - ``repeats=r > 1``: leaves ``(r, L // r, ...)``, row ``i`` holding layers
    ``i·L/r ..`` in order (``w.reshape(r, -1, *w.shape[1:])``, before
    placing them: a leaf already sharded ``P(stage_axis)`` on Explicit axes
    does not reshape so), sharded ``P(None, stage_axis, ...)``. Each
    micro-batch then passes the stages
    ``r`` times, and with ``m >= S`` the idle fraction of the loop (the
    bubble) shrinks from ``(S - 1)/(m + S - 1)`` to ``(S - 1)/(r·m + S -
    1)``.

  The loop has ``(r - 1)·max(m, S) + m + S - 1`` iterations, for every
  ``S``, ``m`` and ``r``: ``r·m + S - 1`` when ``m >= S`` (or ``r = 1``).
  With ``m < S`` and ``r > 1`` a micro-batch is back at stage 0 only ``S``
  iterations after it left, so each repeat takes ``S`` iterations, not
  ``m``: ``r·S + m - 1`` in all (``S = 4``, ``m = 2``, ``r = 2``: 9, not 7).
  Activations move between stages by
  ``collective-permute`` only, one micro-batch at a time; no stage holds
  another stage's weights. The mesh is the one set by ``jax.set_mesh`` (or
  jaxaccum's ``mesh=``), or the one the leaves' shardings name; without a
  mesh the stages run one after the other on one device, with the same
  results. Sharding annotations inside ``layer_fn`` on the other axes
  (tensor parallelism, FSDP) work as under plain ``jit``.

  Args:
    layer_fn: one layer, ``layer_fn(layer_params, x, *args) -> x``. ``x`` is
      an array or a pytree of arrays whose leaves share a leading batch axis
      (per-example side inputs, such as a mask, travel in it and come back
      unchanged); the output has its structure, shapes and dtypes.
      ``layer_params`` is one layer's slice of the stacked leaves.
    num_stages: ``S``, the size of the mesh's stage axis.
    num_micro_batches: ``m``, pipeline micro-batches; it divides the batch.
      Pipeline micro-batch ``j`` holds rows ``j, j + m, j + 2m, ...``, so a
      batch sharded over devices is split where it lies. ``m >= S`` keeps
      every stage busy outside the bubble; fewer warn.
    stage_axis: the mesh axis of the stages.
    repeats: ``r``, circular repeats: each stage holds ``r`` groups of
      layers, and each micro-batch passes the stages ``r`` times.
    remat: rematerialize each stage's layers in the backward pass (``True``,
      or a ``jax.checkpoint_policies`` policy), keeping one micro-batch's
      activation per iteration instead of every layer's.
    rng_argnum: the position of a PRNG key among ``pipe``'s arguments (2 or
      more: ``pipe(stacked, x, key)`` has it at 2). Layer ``l`` (counting all
      ``L``) on micro-batch ``j`` gets ``fold_in(fold_in(key, j), l)``. With
      data axes, data shard ``d`` (its row-major index over the data axes
      that ``pipe`` maps itself) pipelines its own rows, and its micro-batch
      ``j`` is number ``d·m + j``: ``fold_in(fold_in(key, d·m + j), l)``,
      so that no two shards draw the same numbers. Under jaxaccum's
      ``mesh=`` the key is already each device's own, and ``d`` counts only
      the data axes that ``mesh=`` does not map.
    data_axis: mesh axes that the batch is sharded over (data parallelism
      beside the stages), under plain ``jit``: each device pipelines its own
      rows, and the weight gradients are summed over these axes once, after
      the loop, instead of once per iteration. By default read from ``x``'s
      type on Explicit mesh axes; on Auto axes, where it is hidden, name
      them. Leave it out under jaxaccum's ``mesh=``, which already runs the
      loss per device. ``()`` keeps every other axis automatic (FSDP over
      the batch's axis inside a stage: the partitioner gathers the weights
      where they are used).

  Returns:
    ``pipe(stacked, x, *args)``, returning the activations after the last
    layer, with ``x``'s structure, shapes and dtypes. Their rows come back
    split over the stage axis as well, where they divide (each stage device
    then runs what follows on its share of them). Arrays among ``args``
    reach every layer unchanged; other values are static. The gradient
    contributions of the micro-batches are summed in the parameters' dtype:
    keep float32 master weights, cast in ``layer_fn``, for float32 sums.

  Raises:
    ValueError: at trace time, naming the sizes, for layers that do not
      split into the stages, a batch that does not split into
      ``num_micro_batches``, a mesh without ``stage_axis`` (or with another
      number of stages), a ``layer_fn`` that changes the activation's shape
      or dtype, stacked leaves of different lengths, and, on Explicit
      axes, stacked leaves whose layer axis is not split over
      ``stage_axis`` (replicated ones: place them ``P(stage_axis)``, or
      ``P(None, stage_axis)`` with repeats).

  Warns:
    PipelineBubbleWarning: ``num_micro_batches < num_stages``.
    ReplicatedLayersWarning: on Auto axes, stacked leaves whose sharding
      shows (concrete arrays) and does not split the layers over the
      stages: the loop runs, but every device holds every layer. Under
      ``jit`` on Auto axes their sharding is hidden from the pipeline, and
      nothing is said: place them before the step, and read the compiled
      step's argument bytes (``jaxaccum.testing.compile_step``).

  >>> import jax, jax.numpy as jnp, jaxaccum
  >>> def layer(w, x):
  ...   return jnp.tanh(x @ w)
  >>> stacked = jax.random.normal(jax.random.key(0), (8, 4, 4)) / 2  # L = 8 layers
  >>> x = jax.random.normal(jax.random.key(1), (16, 4))
  >>> pipe = jaxaccum.pipeline(layer, num_stages=4, num_micro_batches=4)
  >>> y = pipe(stacked, x)   # on a mesh: under jax.set_mesh, leaves P("stage")
  >>> scanned, _ = jax.lax.scan(lambda h, w: (layer(w, h), None), x, stacked)
  >>> bool(jnp.allclose(y, scanned, atol=1e-6))
  True
  """
  _arguments.check_options(
    num_stages, num_micro_batches, repeats, rng_argnum, stage_axis
  )
  pipe = _Pipe(
    layer_fn,
    num_stages=num_stages,
    num_micro_batches=num_micro_batches,
    stage_axis=stage_axis,
    repeats=repeats,
    remat=remat,
    rng_argnum=rng_argnum,
    data_axes=None if data_axis is None else _axes(data_axis),
  )

  @functools.wraps(layer_fn)
  def pipelined(stacked: PyTree, x: PyTree, *args: Any) -> PyTree:
    return pipe(stacked, x, *args)

  return pipelined


def _axes(data_axis: str | tuple[str, ...]) -> tuple[str, ...]:
  return (data_axis,) if isinstance(data_axis, str) else tuple(data_axis)


class _Pipe:
  """``pipe(stacked, x, *args)``: plan and check at trace time, then run the
  loop on the mesh's stage axis, or on one device."""

  def __init__(
    self,
    layer_fn: Callable[..., Any],
    *,
    num_stages: int,
    num_micro_batches: int,
    stage_axis: str,
    repeats: int,
    remat: Any,
    rng_argnum: int | None,
    data_axes: tuple[str, ...] | None,
  ):
    self.layer_fn = layer_fn
    self.stages = num_stages
    self.micro_batches = num_micro_batches
    self.repeats = repeats
    self.axis = stage_axis
    self.remat = remat
    self.key_index = None if rng_argnum is None else rng_argnum - 2
    self.data_axes = data_axes

  def __call__(self, stacked: PyTree, x: PyTree, *args: Any) -> PyTree:
    schedule = self.plan(stacked, x, args)
    self.check_layer(stacked, x, args, schedule)
    extra = _arguments.Args(args)
    stage = _loop.StageFn(self.layer_fn, schedule, self.key_index, self.remat, extra)
    mesh = _layout.find_mesh(stacked, self.axis, self.stages)
    if mesh is None:
      return self.on_one_device(stage, extra, stacked, x)
    return self.on_mesh(mesh, stage, extra, stacked, x)

  def plan(self, stacked: PyTree, x: PyTree, args: tuple[Any, ...]) -> Schedule:
    """The schedule, after the trace-time checks of the arguments."""
    S, r, m = self.stages, self.repeats, self.micro_batches
    layers = _arguments.layers(stacked, S, r)
    _arguments.batch_size(x, m)
    if self.key_index is not None and self.key_index >= len(args):
      raise ValueError(
        f"rng_argnum={self.key_index + 2}, but pipe was called with "
        f"{len(args) + 2} arguments: pass the key at that position."
      )
    schedule = Schedule(S, r, m, layers // (S * r))
    if m < S:
      warnings.warn(
        f"num_micro_batches={m} is less than num_stages={S}: each stage idles "
        f"{schedule.bubble:.0%} of the {schedule.iterations} iterations (the "
        f"bubble). num_micro_batches={S} or more keeps it at "
        f"{Schedule(S, r, S, 1).bubble:.0%} or less.",
        PipelineBubbleWarning,
        stacklevel=4,  # plan, __call__, pipelined, the caller
      )
    return schedule

  def check_layer(
    self, stacked: PyTree, x: PyTree, args: tuple[Any, ...], schedule: Schedule
  ) -> None:
    """``layer_fn`` keeps the activation's structure, shapes and dtypes."""
    lead = 1 if self.repeats == 1 else 2
    one_layer = jax.tree.map(
      lambda w: jax.ShapeDtypeStruct(jnp.shape(w)[lead:], w.dtype), stacked
    )
    rows = jnp.shape(jax.tree.leaves(x)[0])[0] // schedule.micro_batches
    micro = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct((rows, *jnp.shape(a)[1:]), a.dtype), x
    )
    extra = _arguments.Args(args)  # static values closed over, not traced
    out = jax.eval_shape(
      lambda w, h, traced: self.layer_fn(w, h, *extra.full(traced)),
      one_layer,
      micro,
      extra.traced,
    )
    _arguments.check_layer_output(out, micro)

  def on_one_device(
    self, stage: _loop.StageFn, extra: _arguments.Args, stacked: PyTree, x: PyTree
  ) -> PyTree:
    """The stages as a ``vmap`` over the named stage axis: the same loop,
    without a mesh."""
    loop = _loop.Loop(stage, self.axis, devices=False)
    run = jax.vmap(loop, in_axes=(0, None, None), out_axes=None, axis_name=self.axis)
    w = jax.tree.map(functools.partial(_layout.by_stage, stage.schedule), stacked)
    return run(w, x, extra.traced)

  def on_mesh(
    self,
    mesh: Any,
    stage: _loop.StageFn,
    extra: _arguments.Args,
    stacked: PyTree,
    x: PyTree,
  ) -> PyTree:
    """The stages as a ``shard_map`` over the mesh's stage axis, and over
    the data axes: each device pipelines its own rows."""
    axis, r = self.axis, self.repeats
    _layout.check_placement(stacked, mesh, axis, self.stages, r)
    # Inside jaxaccum's mesh= path the loss runs in a vmap over the data axes
    # (spmd_axis_name), whose shard_map batching rule adds them to the specs
    # of the mapped arguments: they must be manual axes here too.
    vmapped = _compat.spmd_vmap_axes(x)
    data = _layout.data_axes(self.data_axes, x, axis)
    _layout.check_data_axes(data, mesh, axis)
    manual = tuple(a for a in data if a not in vmapped)

    # The result's rows split over the stages as well, where they divide (not
    # inside the mesh path's vmap over Explicit axes, where JAX cannot batch
    # the reduce-scatter).
    rows = jnp.shape(jax.tree.leaves(x)[0])[0]
    shards = math.prod(mesh.shape[a] for a in manual)
    _layout.check_shard_rows(rows, shards, manual, self.micro_batches)
    split_rows = (rows // shards) % self.stages == 0 and not _compat.spmd_vmap_axes(
      x, explicit=True
    )
    loop = _loop.Loop(
      stage, axis, devices=True, split_rows=split_rows, data_axes=manual
    )

    def body(w, x, traced):
      if not vmapped:  # cotangents summed over these axes here, once
        x = _vary(x, (axis,))
        w = _vary(w, manual)
      w = jax.tree.map(lambda a: a[None] if r == 1 else a, w)
      return loop(w, x, traced)

    rows_in = P(_entry(manual))
    rows_out = P(_entry((*manual, axis))) if split_rows else rows_in
    mapped = jax.shard_map(
      body,
      mesh=mesh,
      in_specs=(P(axis) if r == 1 else P(None, axis), rows_in, P()),
      out_specs=rows_out,
      axis_names=frozenset({axis, *manual, *vmapped}),
      # In the vmap, JAX's check of varying axes trips over the axes it maps.
      check_vma=not vmapped,
    )
    return mapped(stacked, x, extra.traced)


def _entry(axes: tuple[str, ...]) -> Any:
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else axes


def _vary(tree: PyTree, axes: tuple[str, ...]) -> PyTree:
  """``tree``, which the ``shard_map`` gets whole over ``axes``, typed as
  varying over them: its cotangent is then summed over them here, once,
  and not in the loop where it meets varying values."""
  if not axes:
    return tree
  return jax.tree.map(lambda a: jax.lax.pcast(a, axes, to="varying"), tree)
