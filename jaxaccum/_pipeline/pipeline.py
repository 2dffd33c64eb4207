"""Pipeline parallelism: micro-batches through stages of layers, in one loop.

``pipeline(layer_fn, ...)`` returns ``pipe(stacked, x, *args)``, which equals
a ``lax.scan`` of ``layer_fn`` over the ``L`` stacked layers, for values and
gradients, while each of ``S`` stages holds only its own layers.

The layout is MaxText's circular pipeline, written as one function of
``(stacked, x)``:

- **Stages.** Stage ``s`` holds layers ``s·n .. s·n + n - 1`` of each repeat,
  ``n = L / (S·r)``. With ``repeats = 1`` the leaves are ``(L, ...)`` and
  their leading axis is sharded over the stage axis; with ``repeats = r > 1``
  they are ``(r, L / r, ...)``, one row of layers per repeat, and the second
  axis is sharded: in both, a stage's layers are one block of the sharding.
- **The loop.** One ``lax.scan`` of ``(r - 1)·max(m, S) + m + S - 1``
  iterations (``m`` the pipeline micro-batches): ``r·m + S - 1`` when ``m >=
  S`` or ``r = 1``; with ``m < S`` and ``r > 1`` a micro-batch is back at
  stage 0 only ``S`` iterations after it left, so the repeats start every
  ``S`` iterations, ``r·S + m - 1`` in all. Each iteration every stage runs its ``n`` layers on one
  micro-batch, then the activations move one stage on (a
  ``collective-permute``; the last stage's goes back to the first for the
  next repeat). Stage 0 reads its inputs from, and parks the returning
  activations in, one buffer of the batch; the last stage writes the results
  into its own. Stages written as one body over a named stage axis: a
  ``shard_map`` over the mesh's stage axis, or, without a mesh, a ``vmap``
  over stages on one device (the same numbers, for testing and debugging).
- **Micro-batches.** Pipeline micro-batch ``j`` holds rows ``j, j + m, j +
  2m, ...`` of the batch (every ``m``-th row), so that a batch sharded over
  devices is split where it lies; the output rows come back in the input's
  order.
- **Keys.** With ``rng_argnum``, layer ``l`` (its index among the ``L``) on
  micro-batch ``j`` gets ``fold_in(fold_in(key, j), l)``; data shard ``d``'s
  micro-batch ``j`` counts as ``d·m + j``.
- **Memory.** Each stage's ``n`` layers are rematerialized (``remat=True``):
  the backward pass keeps one micro-batch's activation per iteration.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxaccum import _compat

PyTree = Any


class PipelineBubbleWarning(UserWarning):
  """Fewer pipeline micro-batches than stages: most of the loop is bubble."""


class ReplicatedLayersWarning(UserWarning):
  """Stacked layers that are not split over the stage axis: every device
  holds every stage's layers."""


@dataclasses.dataclass(frozen=True)
class Schedule:
  """The static numbers of one pipeline, and the loop they make.

  Attributes:
    stages: ``S``.
    repeats: ``r``, passes of every micro-batch through the stages.
    micro_batches: ``m``.
    layers_per_stage: ``n``, layers a stage runs per repeat.
  """

  stages: int
  repeats: int
  micro_batches: int
  layers_per_stage: int

  @property
  def period(self) -> int:
    """Iterations between a micro-batch's repeats at stage 0: ``m``, or ``S``
    when ``m < S`` (a micro-batch needs ``S`` iterations to come back)."""
    return max(self.micro_batches, self.stages)

  @property
  def iterations(self) -> int:
    """The loop's trip count, ``(r - 1)·period + m + S - 1``: ``r·m + S -
    1`` when ``m >= S`` or ``r = 1``, else ``r·S + m - 1``."""
    return (self.repeats - 1) * self.period + self.micro_batches + self.stages - 1

  @property
  def bubble(self) -> float:
    """The fraction of the iterations in which a stage idles."""
    return 1 - self.repeats * self.micro_batches / self.iterations

  def slot(self, iteration: jax.Array, stage: jax.Array | int) -> tuple[jax.Array, ...]:
    """What ``stage`` works on at ``iteration``: ``(micro_batch, repeat,
    real)``; outside ``real`` (the bubble) the indices are clipped to valid
    ones, and the work is thrown away."""
    p = iteration - stage
    micro, repeat = p % self.period, p // self.period
    real = (p >= 0) & (repeat < self.repeats) & (micro < self.micro_batches)
    return (
      jnp.clip(micro, 0, self.micro_batches - 1),
      jnp.clip(repeat, 0, self.repeats - 1),
      real,
    )


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
  _check_options(num_stages, num_micro_batches, repeats, rng_argnum, stage_axis)
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


# -- checks -------------------------------------------------------------------


def _check_options(
  num_stages: Any,
  num_micro_batches: Any,
  repeats: Any,
  rng_argnum: Any,
  stage_axis: Any,
) -> None:
  for name, value in (
    ("num_stages", num_stages),
    ("num_micro_batches", num_micro_batches),
    ("repeats", repeats),
  ):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value!r}.")
  if rng_argnum is not None and (
    isinstance(rng_argnum, bool) or not isinstance(rng_argnum, int) or rng_argnum < 2
  ):
    raise ValueError(
      f"rng_argnum must be the position of the key among pipe's arguments, "
      f"2 or more (pipe(stacked, x, key) has it at 2), got {rng_argnum!r}."
    )
  if not isinstance(stage_axis, str):
    raise ValueError(f"stage_axis must be a mesh axis name, got {stage_axis!r}.")


def _axes(data_axis: str | tuple[str, ...]) -> tuple[str, ...]:
  return (data_axis,) if isinstance(data_axis, str) else tuple(data_axis)


def _layers(stacked: PyTree, stages: int, repeats: int) -> int:
  """``L``, checked: every leaf stacks the same layers, in stages."""
  leaves = jax.tree_util.tree_leaves_with_path(stacked)
  if not leaves:
    raise ValueError("stacked has no arrays: pass the stacked layer parameters.")
  lead = 1 if repeats == 1 else 2
  lengths = {}
  for path, leaf in leaves:
    shape = jnp.shape(leaf)
    name = f"stacked{jax.tree_util.keystr(path)}"
    if len(shape) < lead:
      raise ValueError(
        f"{name} has shape={shape}: every leaf of stacked needs a leading "
        + ("layer axis." if repeats == 1 else f"(repeats={repeats}, L // repeats).")
      )
    if repeats > 1 and shape[0] != repeats:
      raise ValueError(
        f"{name} has shape={shape}, and with repeats={repeats} every leaf is "
        f"stacked (repeats, L // repeats, ...), one row of layers per repeat, "
        f"for the circular layout: pass w.reshape({repeats}, -1, *w.shape[1:]) "
        f"and shard its second axis P(None, 'stage')."
      )
    lengths[name] = shape[0] * (shape[1] if repeats > 1 else 1)
  total = _agreed(
    lengths,
    "The leaves of stacked hold different numbers of layers ({}): stack every "
    "parameter of the L layers on the same leading axis.",
  )
  if total % (stages * repeats):
    raise ValueError(
      f"L={total} layers do not split into num_stages={stages} * "
      f"repeats={repeats} = {stages * repeats} equal groups: choose L, "
      f"num_stages and repeats with L divisible by num_stages * repeats."
    )
  return total


def _batch_size(x: PyTree, micro_batches: int) -> int:
  leaves = jax.tree_util.tree_leaves_with_path(x)
  if not leaves:
    raise ValueError("x has no arrays: pass the activations, pipe(stacked, x).")
  sizes = {}
  for path, leaf in leaves:
    shape = jnp.shape(leaf)
    name = f"x{jax.tree_util.keystr(path)}"
    if not shape:
      raise ValueError(
        f"{name} is a scalar: every leaf of x needs a leading batch axis "
        "(pass per-example values with one, others as pipe's extra arguments)."
      )
    sizes[name] = shape[0]
  size = _agreed(
    sizes,
    "The leaves of x have different batch sizes ({}): every leaf of the "
    "activation needs the same leading batch axis.",
  )
  if size % micro_batches:
    raise ValueError(
      f"The batch_size={size} is not divisible by num_micro_batches="
      f"{micro_batches}: choose a num_micro_batches that divides it "
      f"({_divisors(size)})."
    )
  return size


def _agreed(sizes: dict[str, int], message: str) -> int:
  """The one size in ``sizes`` (leaf name -> size), or a ``ValueError``:
  ``message`` with the sizes listed."""
  if len(set(sizes.values())) > 1:
    raise ValueError(message.format(", ".join(f"{n}: {v}" for n, v in sizes.items())))
  return next(iter(sizes.values()))


def _divisors(n: int) -> str:
  found = [d for d in range(1, n + 1) if n % d == 0]
  return ", ".join(map(str, found))


def _find_mesh(stacked: PyTree, stage_axis: str, stages: int) -> Any:
  """The mesh the stages run on: the context's (``jax.set_mesh``, jaxaccum's
  ``mesh=``), else the one the leaves' shardings name; None without one."""
  mesh: Any = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    meshes = (_leaf_mesh(leaf) for leaf in jax.tree.leaves(stacked))
    mesh = next((m for m in meshes if m is not None), None)
  if mesh is None:
    return None
  if stage_axis not in mesh.axis_names:
    raise ValueError(
      f"The mesh has no axis {stage_axis!r} for the stages: its axes are "
      f"{tuple(mesh.axis_names)}. Name the stage axis with stage_axis=, or "
      f"make a mesh with one of size num_stages={stages}."
    )
  if mesh.shape[stage_axis] != stages:
    raise ValueError(
      f"The mesh's stage axis {stage_axis!r} has {mesh.shape[stage_axis]} "
      f"devices and num_stages={stages}: one stage per device, so pass "
      f"num_stages={mesh.shape[stage_axis]} or resize the axis."
    )
  return mesh


def _check_placement(
  stacked: PyTree, mesh: Any, axis: str, stages: int, repeats: int
) -> None:
  """Each stage's layers lie on its own devices: the stacked leaves' layer
  axis is split over the stage axis, where their sharding shows. On
  Explicit axes anything else is an error (``shard_map`` refuses it, with a
  message about specs); elsewhere replicated layers run (each stage slices
  its own out), but every device holds them all: a warning. Under ``jit``
  on Auto axes the sharding is hidden, and nothing is said."""
  dim = 0 if repeats == 1 else 1
  want = f"P({axis!r})" if repeats == 1 else f"P(None, {axis!r})"
  types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
  explicit = types[axis] == jax.sharding.AxisType.Explicit
  for path, leaf in jax.tree_util.tree_leaves_with_path(stacked):
    spec = _compat.explicit_spec(leaf) if explicit else None
    if spec is None and not _compat.is_tracer(leaf):
      spec = _compat.visible_spec(leaf)
    if spec is None or _on_stages(spec, jnp.ndim(leaf), dim, axis):
      continue
    name = f"stacked{jax.tree_util.keystr(path)}"
    layers = math.prod(jnp.shape(leaf)[: dim + 1])
    if explicit:
      where = (
        f"axis 0, of {layers} layers"
        if repeats == 1
        else f"axis 1, of {layers // repeats} layers per repeat"
      )
      raise ValueError(
        f"{name} lies {spec} on the mesh's Explicit axes, and each of the "
        f"{stages} stages holds its own layers: the layer axis ({where}) must "
        f"be split over the stage axis {axis!r}. Place the stacked layers "
        f"{want}: jax.device_put(stacked, NamedSharding(mesh, {want})) before "
        f"the step, jax.sharding.reshard(stacked, {want}) inside it, or "
        f"param_specs={want} under jaxaccum's mesh=."
      )
    warnings.warn(
      f"{name} lies {spec} on the mesh, so every device holds all {layers} "
      f"layers, and each of the {stages} stages uses {layers // stages} of "
      f"them: place the stacked layers {want} (jax.device_put(stacked, "
      f"NamedSharding(mesh, {want}))) so that each device holds its own "
      "stage's layers only.",
      ReplicatedLayersWarning,
      stacklevel=5,  # _check_placement, on_mesh, __call__, pipelined, the caller
    )
    return


def _on_stages(spec: Any, ndim: int, dim: int, axis: str) -> bool:
  """Whether ``spec`` splits dimension ``dim``, and no other, over ``axis``."""
  entries = [*spec, *(None,) * (ndim - len(spec))]
  names = [e if isinstance(e, tuple) else (e,) for e in entries]
  return axis in names[dim] and not any(
    axis in n for d, n in enumerate(names) if d != dim
  )


def _leaf_mesh(leaf: Any) -> Any:
  """The mesh a leaf's sharding names, where it is visible: a concrete
  array's, or a traced one's type on Explicit axes."""
  sharding = None if _compat.is_tracer(leaf) else getattr(leaf, "sharding", None)
  if isinstance(sharding, jax.sharding.NamedSharding):
    return sharding.mesh
  if _compat.explicit_spec(leaf) is not None:
    return jax.typeof(leaf).sharding.mesh
  return None


def _check_layer_output(out: PyTree, micro: PyTree) -> None:
  """``layer_fn``'s output (from ``jax.eval_shape``) against its input."""
  got_tree: Any = jax.tree.structure(out)
  want_tree: Any = jax.tree.structure(micro)
  if got_tree != want_tree:
    raise ValueError(
      f"layer_fn returned {got_tree} for an activation {want_tree}: a layer "
      "must return the activation with the structure it got."
    )
  for (path, o), w in zip(
    jax.tree_util.tree_leaves_with_path(out), jax.tree.leaves(micro), strict=True
  ):
    if (o.shape, o.dtype) != (w.shape, w.dtype):
      raise ValueError(
        f"layer_fn turned the activation x{jax.tree_util.keystr(path)} of "
        f"shape={w.shape}, dtype={w.dtype} into shape={o.shape}, "
        f"dtype={o.dtype}: each layer's output is the next layer's input, so "
        "it must keep the shape and dtype (cast back, or change them outside "
        "the pipeline)."
      )


# -- the pipeline -------------------------------------------------------------


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
    extra = _Args(args)
    stage = _StageFn(self.layer_fn, schedule, self.key_index, self.remat, extra)
    mesh = _find_mesh(stacked, self.axis, self.stages)
    if mesh is None:
      return self.on_one_device(stage, extra, stacked, x)
    return self.on_mesh(mesh, stage, extra, stacked, x)

  def plan(self, stacked: PyTree, x: PyTree, args: tuple[Any, ...]) -> Schedule:
    """The schedule, after the trace-time checks of the arguments."""
    S, r, m = self.stages, self.repeats, self.micro_batches
    layers = _layers(stacked, S, r)
    _batch_size(x, m)
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
    extra = _Args(args)  # static values closed over, not traced
    out = jax.eval_shape(
      lambda w, h, traced: self.layer_fn(w, h, *extra.full(traced)),
      one_layer,
      micro,
      extra.traced,
    )
    _check_layer_output(out, micro)

  def on_one_device(
    self, stage: _StageFn, extra: _Args, stacked: PyTree, x: PyTree
  ) -> PyTree:
    """The stages as a ``vmap`` over the named stage axis: the same loop,
    without a mesh."""
    loop = _Loop(stage, self.axis, devices=False)
    run = jax.vmap(loop, in_axes=(0, None, None), out_axes=None, axis_name=self.axis)
    w = jax.tree.map(functools.partial(_by_stage, stage.schedule), stacked)
    return run(w, x, extra.traced)

  def on_mesh(
    self, mesh: Any, stage: _StageFn, extra: _Args, stacked: PyTree, x: PyTree
  ) -> PyTree:
    """The stages as a ``shard_map`` over the mesh's stage axis, and over
    the data axes: each device pipelines its own rows."""
    axis, r = self.axis, self.repeats
    _check_placement(stacked, mesh, axis, self.stages, r)
    # Inside jaxaccum's mesh= path the loss runs in a vmap over the data axes
    # (spmd_axis_name), whose shard_map batching rule adds them to the specs
    # of the mapped arguments: they must be manual axes here too.
    vmapped = _compat.spmd_vmap_axes(x)
    data = _data_axes(self.data_axes, x, axis)
    _check_data_axes(data, mesh, axis)
    manual = tuple(a for a in data if a not in vmapped)

    # The result's rows split over the stages as well, where they divide (not
    # inside the mesh path's vmap over Explicit axes, where JAX cannot batch
    # the reduce-scatter).
    rows = jnp.shape(jax.tree.leaves(x)[0])[0]
    shards = math.prod(mesh.shape[a] for a in manual)
    _check_shard_rows(rows, shards, manual, self.micro_batches)
    split_rows = (rows // shards) % self.stages == 0 and not _compat.spmd_vmap_axes(
      x, explicit=True
    )
    loop = _Loop(stage, axis, devices=True, split_rows=split_rows, data_axes=manual)

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


class _Args:
  """``pipe``'s extra arguments: arrays are traced into the loop; other
  values reach ``layer_fn`` as they are (static)."""

  def __init__(self, args: tuple[Any, ...]):
    self.args = args
    self.positions = [i for i, a in enumerate(args) if _is_array(a)]
    self.traced = [args[i] for i in self.positions]

  def full(self, traced: list[Any]) -> list[Any]:
    """The arguments, with ``traced`` in the arrays' places."""
    full = list(self.args)
    for i, a in zip(self.positions, traced, strict=True):
      full[i] = a
    return full


def _is_array(a: Any) -> bool:
  return isinstance(a, (jax.Array, np.ndarray)) or _compat.is_tracer(a)


def _data_axes(
  given: tuple[str, ...] | None, x: PyTree, stage_axis: str
) -> tuple[str, ...]:
  """The data axes: as given, or the mesh axes that ``x``'s rows are
  sharded over where its type shows them (Explicit axes), the stage axis
  excepted."""
  if given is not None:
    return given
  found: list[str] = []
  for leaf in jax.tree.leaves(x):
    spec = _compat.explicit_spec(leaf)
    entry = spec[0] if spec else None
    names = entry if isinstance(entry, tuple) else (entry,)
    found.extend(n for n in names if n and n != stage_axis and n not in found)
  return tuple(found)


def _check_data_axes(data: tuple[str, ...], mesh: Any, stage_axis: str) -> None:
  bad = [a for a in data if a not in mesh.axis_names or a == stage_axis]
  if bad:
    raise ValueError(
      f"data_axis={data} names {tuple(bad)}, which "
      + ("is the stage axis" if stage_axis in bad else "the mesh does not have")
      + f": the mesh's axes are {tuple(mesh.axis_names)}, the stages on "
      f"{stage_axis!r}. Name the axes the batch is sharded over besides it."
    )


def _check_shard_rows(
  rows: int, shards: int, axes: tuple[str, ...], micro_batches: int
) -> None:
  """Each data shard pipelines its own rows: they split into the
  micro-batches."""
  if rows % shards:
    raise ValueError(
      f"The batch_size={rows} does not split over the {shards} devices of the "
      f"data axes {axes}: pass a batch whose size is a multiple of {shards}."
    )
  local = rows // shards
  if local % micro_batches:
    raise ValueError(
      f"Each of the {shards} data shards (axes {axes}) pipelines its own "
      f"{local} of the batch_size={rows} rows, and num_micro_batches="
      f"{micro_batches} does not divide {local}: choose a num_micro_batches "
      f"that does ({_divisors(local)}), or a batch_size that is a multiple "
      f"of {shards * micro_batches}."
    )


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


def _by_stage(schedule: Schedule, w: jax.Array) -> jax.Array:
  """A stacked leaf as ``(S, r, n, ...)``: the stages on one device."""
  S, r, n = schedule.stages, schedule.repeats, schedule.layers_per_stage
  w = w.reshape(r, S, n, *w.shape[(1 if r == 1 else 2) :])
  return jnp.moveaxis(w, 1, 0)


class _StageFn:
  """One stage's ``n`` layers on one micro-batch, in one repeat."""

  def __init__(
    self,
    layer_fn: Callable[..., Any],
    schedule: Schedule,
    key_index: int | None,
    remat: Any,
    extra: _Args,
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
class _Loop:
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

  stage_fn: _StageFn
  axis: str
  devices: bool
  split_rows: bool = False
  data_axes: tuple[str, ...] = ()

  def __call__(self, w: PyTree, x: PyTree, traced: list[Any]) -> PyTree:
    """``w``: this stage's layers, leaves ``(r, n, ...)``; ``x``: the whole
    batch (of this data shard); ``traced``: the arrays among the extra
    arguments."""
    return _run_loop(self, w, x, traced)


def _run_loop(loop: _Loop, w: PyTree, x: PyTree, traced: list[Any]) -> PyTree:
  """See :class:`_Loop`."""
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
