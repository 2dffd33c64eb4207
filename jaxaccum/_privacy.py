"""Differentially private training (DP-SGD) over micro-batches.

Three pieces, each usable alone:

1. **Per-example clipping** (:func:`clipped_value_and_grad`), the gradient
   function of the engine's micro step under ``clip_per_example=C``: one
   ``vmap`` of ``value_and_grad`` over the micro-batch's examples, one global
   L2 norm per example over every differentiated leaf, one select. Each
   example's gradient is scaled to norm at most ``C`` and the clipped
   gradients are summed into the float32 accumulator. A masked row (padding)
   and a row whose gradient is not finite add exactly zero: they are
   selected away, never multiplied.
2. **Noise** (:func:`dp_noise`), an optax transformation that adds
   ``N(0, (sigma * C)^2)`` to the clipped *sum* once per update, i.e. once
   per logical batch: once per ``make_train_step`` step, once per window of
   ``accumulate()`` (its inner optimizer runs once per window). It then
   divides by the expected batch size (``normalize="poisson"``) or the actual
   one (``normalize="fixed"``).
3. **Sampling and accounting**: :class:`PoissonSampler` draws each example
   with probability ``q`` and pads the draw to one fixed size, so that one
   compiled step serves every draw; :func:`dp_epsilon` asks Google's
   ``dp-accounting`` package for epsilon.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend import core as jex_core

from jaxaccum import _compat, _ghost, _normalize, _split, _tree

PyTree = Any

#: The keyword of an accumulated function that takes the row mask.
MASK_KEYWORD = "example_mask"

NORMALIZATIONS = ("poisson", "fixed")


# ---------------------------------------------------------------- clipping


def check_per_example_value(value: Any, normalize: str) -> None:
  """Raises unless ``fun``'s value for one example is a scalar (the pair of
  scalars ``(loss_sum, weight)`` with ``normalize="weighted"``)."""
  loss = value[0] if normalize == "weighted" and isinstance(value, tuple) else value
  if isinstance(loss, (tuple, list)) or jnp.shape(loss) != ():
    got = (
      f"a {type(loss).__name__} of length {len(loss)}"
      if isinstance(loss, (tuple, list))
      else f"shape={jnp.shape(loss)}"
    )
    raise ValueError(
      "With clip_per_example, fun is called on one example (each batch leaf "
      "without its leading axis) and must return that example's loss as a "
      f"scalar, got {got}. Reduce over the example's own axes (e.g. "
      "jnp.sum over its tokens), or drop clip_per_example for a loss over a "
      "batch."
    )


def clipped_value_and_grad(
  loss_fn: Callable[..., Any],
  *,
  argnums: tuple[int, ...],
  batch_argnums: tuple[int, ...],
  clip_norm: float,
  accum_dtype: Any,
  rng_argnum: int | None = None,
  state_argnum: int | None = None,
  mask_argnum: int | None = None,
  clip_method: str = "vmap",
) -> Callable[..., Any]:
  """``jax.value_and_grad(loss_fn, argnums, has_aux=True)`` over a
  micro-batch, with each example's gradient clipped to L2 norm
  ``clip_norm`` before the sum.

  ``loss_fn(*args)`` returns ``(loss, (weight, aux, new_state))`` for one
  example. The returned function takes the same arguments with the batch
  arguments holding ``m`` rows (and, at ``mask_argnum``, a row mask that
  ``loss_fn`` does not see), and returns ``((loss, (weight, aux, state)),
  grads)``: the sums of the kept rows' losses and weights, the per-example
  aux stacked over the rows, the state unchanged, and the sum of the kept
  rows' clipped gradients in (at least) ``accum_dtype``. A row is kept when
  its mask is non-zero and its gradient is finite; row ``j`` gets the key
  ``fold_in(key, j)``. ``clip_method="ghost"`` computes the same sum
  without per-example gradients (:func:`jaxaccum._ghost.clipped_sum`).
  """
  rows_of = _RowArgs(loss_fn, batch_argnums, rng_argnum, state_argnum, mask_argnum)
  grad_fn = jax.value_and_grad(rows_of.per_example_loss, argnums=argnums, has_aux=True)

  def value_and_clipped_grad(*call_args):
    args, in_axes, present, state = rows_of(call_args)
    if clip_method == "ghost":
      (loss, (weight, aux, _)), clipped = _ghost.clipped_sum(
        rows_of.per_example_loss,
        args,
        argnums=argnums,
        in_axes=in_axes,
        present=present,
        clip_norm=clip_norm,
        accum_dtype=accum_dtype,
      )
    else:
      per_example = jax.vmap(grad_fn, in_axes=tuple(in_axes))
      (loss, (weight, aux, _)), grads = checked_per_example(per_example, args)
      clipped, _ = clip_and_sum(grads, clip_norm, present, accum_dtype)
    return rows_of.finish(present, loss, weight, aux, state), clipped

  return value_and_clipped_grad


def checked_per_example(per_example: Callable[..., Any], args: Any) -> Any:
  """``per_example(*args)`` (the ``vmap`` of each example's gradient), or,
  in a process with more than one device, a ``ValueError`` where it holds a
  convolution grouped over the examples.

  ``vmap`` makes a convolution kernel's per-example gradient one
  convolution grouped over the examples, and XLA's SPMD partitioner
  miscompiles it where the examples are sharded over devices: every device
  but the first gets a zero gradient, silently (jax 0.10.2 and 0.12.1; a
  CNN's clipped sum 12% off on 8 CPU devices). Whether the rows are sharded
  is not visible at trace time, so any process with several devices is
  refused; ``clip_method="ghost"`` takes a kernel's per-example gradient
  one window offset at a time, as matrix products, and is exact there. The
  program is traced once, and evaluated from the jaxpr that was checked.
  """
  devices = jax.device_count()
  if devices == 1:
    return per_example(*args)
  closed, shape = jax.make_jaxpr(per_example, return_shape=True)(*args)
  if _grouped_convolution(closed.jaxpr):
    raise ValueError(
      f'clip_per_example with clip_method="vmap" in a process with {devices} '
      "devices: fun's per-example gradient holds a convolution grouped over "
      "the examples (vmap's form of a convolution kernel's gradient), which "
      "XLA's SPMD partitioner miscompiles where the examples are sharded over "
      "devices (every device but the first gets a zero kernel gradient, "
      'silently). Use clip_method="ghost" (exact: it takes each example\'s '
      "kernel gradient one window offset at a time, without that "
      "convolution), or run in a process with one device."
    )
  flat = jex_core.jaxpr_as_fun(closed)(*jax.tree.leaves(args))
  return jax.tree.unflatten(jax.tree.structure(shape), flat)


def _grouped_convolution(jaxpr: Any) -> bool:
  """``jaxpr`` holds, at any depth, a convolution with feature or batch
  groups."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "conv_general_dilated" and (
      eqn.params["feature_group_count"] > 1 or eqn.params["batch_group_count"] > 1
    ):
      return True
    for value in eqn.params.values():
      for item in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(item, "jaxpr", item)
        if hasattr(inner, "eqns") and _grouped_convolution(inner):
          return True
  return False


def ghost_objective(
  loss_fn: Callable[..., Any],
  *,
  argnums: tuple[int, ...],
  batch_argnums: tuple[int, ...],
  clip_norm: float,
  rng_argnum: int | None = None,
  state_argnum: int | None = None,
  mask_argnum: int | None = None,
) -> Callable[..., Any]:
  """Ghost clipping over a micro-batch as a loss, for a caller that
  differentiates it itself (the data-parallel path, whose FSDP leaves are
  shared by the devices: their clipped sums are reduce-scattered inside the
  backward pass, as the non-private step's gradients are).

  Takes the arguments of :func:`clipped_value_and_grad`'s function and
  returns ``(total, (((loss, (weight, aux, state)), some)))``: ``total``'s
  gradient with respect to ``argnums`` is the sum of the kept rows' clipped
  gradients (:func:`jaxaccum._ghost.weighted_loss`), the rest as there,
  and ``some`` whether any row was kept (where none is, the caller zeroes
  the gradient: :func:`jaxaccum._ghost.kept_only`).
  """
  rows_of = _RowArgs(loss_fn, batch_argnums, rng_argnum, state_argnum, mask_argnum)

  def objective(*call_args):
    args, in_axes, present, state = rows_of(call_args)
    weighted = _ghost.weighted_loss(
      rows_of.per_example_loss,
      args,
      argnums=argnums,
      in_axes=in_axes,
      present=present,
      clip_norm=clip_norm,
    )
    weight, aux, _ = weighted.rest
    out = rows_of.finish(present, weighted.losses, weight, aux, state)
    return weighted.total, (out, jnp.any(weighted.kept))

  return objective


class _RowArgs:
  """A micro-batch's arguments as per-example ones: the row mask taken out,
  row ``j``'s key ``fold_in(key, j)``, shared arguments whole along the
  axes the rows are spread over; and the kept rows' sums after."""

  def __init__(
    self,
    loss_fn: Callable[..., Any],
    batch_argnums: tuple[int, ...],
    rng_argnum: int | None,
    state_argnum: int | None,
    mask_argnum: int | None,
  ):
    self.loss_fn = loss_fn
    self.rng_argnum = rng_argnum
    self.state_argnum = state_argnum
    self.mask_argnum = mask_argnum
    self.mapped = set(batch_argnums) - {mask_argnum}
    self.changed: list[int] = []

  def per_example_loss(self, *call_args):
    loss, (weight, aux, new_state) = self.loss_fn(*call_args)
    if self.state_argnum is not None:
      self.changed.append(_changed_leaves(call_args[self.state_argnum], new_state))
    return loss, (weight, aux, new_state)

  def __call__(
    self, call_args: tuple[Any, ...]
  ) -> tuple[list[Any], list[int | None], jax.Array, Any]:
    """``(args, in_axes, present, state)``."""
    args = list(call_args)
    mapped = self.mapped
    rows = jax.tree.leaves([args[n] for n in sorted(mapped)])[0].shape[0]
    in_axes: list[int | None] = [0 if n in mapped else None for n in range(len(args))]
    mask = None
    if self.mask_argnum is not None:
      mask, args[self.mask_argnum] = args[self.mask_argnum], None
    if self.rng_argnum is not None:
      key = args[self.rng_argnum]
      args[self.rng_argnum] = jax.vmap(lambda j: jax.random.fold_in(key, j))(
        jnp.arange(rows, dtype=jnp.int32)
      )
      in_axes[self.rng_argnum] = 0
    state = None if self.state_argnum is None else args[self.state_argnum]
    rows_over = _row_axes([args[n] for n in sorted(mapped)])
    if rows_over:
      args = [
        a if axis == 0 else jax.tree.map(lambda x: _unsharded(x, rows_over), a)
        for a, axis in zip(args, in_axes, strict=True)
      ]
    self.changed.clear()
    present = jnp.ones((rows,), bool) if mask is None else mask != 0
    return args, in_axes, present, state

  def finish(
    self, present: jax.Array, loss: jax.Array, weight: Any, aux: Any, state: Any
  ) -> tuple[jax.Array, tuple[jax.Array, Any, Any]]:
    """``(loss, (weight, aux, state))``: the kept rows' losses and weights
    summed, the aux stacked, the state as it came."""
    _check_state_kept(sum(self.changed), len(jax.tree.leaves(state)))

    def kept_sum(v):
      which = _rows_like(present, v)
      v = _rows_like(v, which)
      return jnp.sum(jnp.where(which, v, jnp.zeros_like(v)))

    return kept_sum(loss), (
      kept_sum(jnp.asarray(weight, jnp.float32)),
      aux,
      state,
    )


def _changed_leaves(before: PyTree, after: PyTree) -> int:
  """How many leaves of the threaded state ``fun`` replaced, read at trace
  time: a leaf ``fun`` only read comes back as the very value it was given."""
  old, new = jax.tree.leaves(before), jax.tree.leaves(after)
  if len(old) != len(new):
    return max(len(old), len(new))
  return sum(a is not b for a, b in zip(old, new, strict=True))


def _check_state_kept(changed: int, held: int) -> None:
  """Per-example clipping reads a model's other variables (eval-mode
  BatchNorm's running statistics) but threads none: an example that wrote
  one would reach the next example's loss."""
  if changed:
    raise ValueError(
      f"clip_per_example does not thread state: fun changed {changed} of the "
      f"{held} variables its model holds besides its parameters (BatchNorm "
      "statistics in training mode, RNG streams), and each example's gradient "
      "is computed apart from the others. Use a model that only reads them: "
      "BatchNorm in eval mode (use_running_average=True) is per-example safe, "
      "or use LayerNorm or GroupNorm instead, and pass dropout keys by "
      "rng_argnum."
    )


def check_public_args(
  options: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
  """Under ``clip_per_example``, every argument that holds arrays is
  differentiated, split (``batch_argnums``), the key (``rng_argnum``) or
  declared public (``public_argnums``): jaxaccum cannot see where an array
  came from, and one computed from other examples (a batch mean) would carry
  them into every example's clipped gradient. Python values (static) are
  not seen: a number computed from the batch is just as private."""
  o = options
  if o.clip_per_example is None:
    return
  known = {o.rng_argnum, o.state_argnum, o.example_mask}
  known.update(o.argnums, o.batch_argnums, o.public_argnums)
  for n, arg in enumerate(args):
    if n not in known and any(map(_is_array, jax.tree.leaves(arg))):
      raise ValueError(
        f"With clip_per_example, {o.names(n)} holds arrays that reach every "
        "example's loss, and it is not differentiated, not in batch_argnums "
        "and not the key (rng_argnum). jaxaccum cannot see where it came from: "
        "if it was computed from the batch or from any example (a batch mean, "
        "a normalization statistic), each example's clip no longer bounds its "
        "effect on the update, and the privacy guarantee is void. "
        f"{public_fix(o, n)}"
      )
  for name, value in kwargs.items():
    if name == MASK_KEYWORD or name.startswith("_jaxaccum_"):  # jaxaccum's own
      continue
    if any(map(_is_array, jax.tree.leaves(value))):
      raise ValueError(
        f"With clip_per_example, the keyword argument {name}= holds arrays "
        "that reach every example's loss; jaxaccum cannot see where they came "
        "from (one computed from the batch voids the privacy guarantee), and "
        "only positional arguments can be declared public. Pass it "
        "positionally and list it in public_argnums= if it depends on no "
        "example, or make it part of the batch (batch_argnums)."
      )


def public_fix(options: Any, n: int) -> str:
  """How to declare the argument at engine position ``n`` public, in the
  user's numbering."""
  user = n - options.names.offset
  shared = (
    " shared_argnums= only silences a warning and is not enough for DP."
    if n in options.shared_argnums
    else " (shared_argnums= is not enough for DP.)"
  )
  return (
    f"If it depends on no example (a learning-rate schedule's value, a frozen "
    f"embedding table), declare it public with public_argnums=({user},): the "
    "guarantee then holds only as long as that is true. If it is part of the "
    f"batch, add it to batch_argnums.{shared}"
  )


def _is_array(x: Any) -> bool:
  """An array (numpy, jax, a tracer or an abstract one), not a Python value."""
  return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def _row_axes(batch: list[Any]) -> set[str]:
  """The Explicit mesh axes the rows of ``batch`` are sharded over."""
  axes: set[str] = set()
  for x in jax.tree.leaves(batch):
    spec = _compat.explicit_spec(x)
    if spec is not None and len(spec) and spec[0] is not None:
      axes.update((spec[0],) if isinstance(spec[0], str) else spec[0])
  return axes


def _rows_like(x: jax.Array, like: jax.Array) -> jax.Array:
  """``x`` with its rows laid out like ``like``'s, on an Explicit mesh
  (where operands of one select must agree)."""
  spec = _compat.explicit_spec(like)
  if spec is None or _compat.explicit_spec(x) == spec:
    return x
  return jax.sharding.reshard(x, spec)


def _unsharded(x: Any, axes: set[str]) -> Any:
  """``x`` no longer sharded over ``axes``: an argument shared by every
  example (a parameter) is whole along the axes the examples are spread
  over, as ``vmap`` over them needs on an Explicit mesh."""
  spec = _compat.explicit_spec(x)
  if spec is None:
    return x

  def keep(entry):
    names = () if entry is None else (entry,) if isinstance(entry, str) else entry
    kept = tuple(n for n in names if n not in axes)
    return None if not kept else kept[0] if len(kept) == 1 else kept

  new = jax.sharding.PartitionSpec(*(keep(e) for e in spec))
  return x if new == spec else jax.sharding.reshard(x, new)


def clip_and_sum(
  per_example: PyTree, clip_norm: float, present: jax.Array, accum_dtype: Any
) -> tuple[PyTree, jax.Array]:
  """The sum over the leading (example) axis of ``per_example``'s gradients,
  each scaled to global L2 norm at most ``clip_norm``, and the rows kept.

  A row is kept when ``present`` and its norm is finite; the others add
  exactly zero (a select, so a NaN there does not spread).

  >>> g = {"w": jnp.array([[3.0, 4.0], [0.3, 0.4], [jnp.nan, 0.0]])}
  >>> total, kept = clip_and_sum(g, 1.0, jnp.array([True, True, True]), jnp.float32)
  >>> [round(float(x), 4) for x in total["w"]], kept.tolist()
  ([0.9, 1.2], [True, True, False])
  """
  leaves = jax.tree.leaves(per_example)
  sq = sum(
    (
      jnp.sum(jnp.square(g.astype(jnp.float32)).reshape(g.shape[0], -1), axis=1)
      for g in leaves
    ),
    start=jnp.zeros(present.shape, jnp.float32),
  )
  norm = jnp.sqrt(sq)
  kept = _rows_like(present, norm) & jnp.isfinite(norm)
  clip = jnp.float32(clip_norm)
  # min(1, C / norm) without dividing by zero: C / max(norm, C).
  scale = jnp.where(kept, clip / jnp.maximum(norm, clip), jnp.float32(0))

  def one(g):
    dtype = _normalize.accumulator_dtype(accum_dtype, g)
    shape = (g.shape[0],) + (1,) * (g.ndim - 1)
    scaled = g.astype(dtype) * scale.astype(dtype).reshape(shape)
    return jnp.sum(jnp.where(kept.reshape(shape), scaled, jnp.zeros_like(scaled)), 0)

  return jax.tree.map(one, per_example), kept


def check_mask(mask: Any) -> jax.Array:
  """The ``example_mask=`` of a call: one entry per row, as an array."""
  if mask is None or jnp.ndim(mask) != 1:
    got = "None" if mask is None else f"shape={jnp.shape(mask)}"
    raise ValueError(
      f"{MASK_KEYWORD}= must be a vector with one entry per row of the batch "
      f"(non-zero or True for a real example, 0 or False for padding), got "
      f"{got}. jaxaccum.pad_batch and PoissonSampler return one."
    )
  return jnp.asarray(mask)


# ---------------------------------------------------------------- noise


@dataclasses.dataclass(frozen=True)
class NoiseConfig:
  """What :func:`dp_noise` adds and divides by; static (no array leaves), so
  that ``make_train_step`` and ``accumulate`` read it at trace time.

  Attributes:
    noise_multiplier: sigma; the noise's standard deviation is
      ``noise_multiplier * clip_norm``.
    clip_norm: C, the per-example clipping norm.
    normalize: ``"poisson"`` (divide by ``expected_batch_size``) or
      ``"fixed"`` (divide by the actual number of examples).
    expected_batch_size: ``q * N`` for Poisson sampling, else None.
  """

  noise_multiplier: float
  clip_norm: float
  normalize: str
  expected_batch_size: float | None


jax.tree_util.register_static(NoiseConfig)


class ClipRecord:
  """A clipped sum and how it was made: what :func:`dp_noise` checks it
  received, straight from the step that clipped.

  ``make_train_step`` (and ``jaxaccum.nnx.make_train_step``) hand one to the
  optimizer with the gradient (``clip_record=``), and :func:`accumulate` to
  its inner optimizer once per window; ``value_and_grad(...,
  clip_per_example=C, normalize="sum", clip_record=True)`` returns one in
  place of the gradient, for :func:`accumulate`'s ``update``. ``dp_noise``
  refuses a gradient that is not the record's very ``grads`` (any
  transformation before it made new arrays), a record clipped at another
  norm, and, in :func:`accumulate`, a record of anything but a clipped sum.

  A pytree: ``grads``, ``divided_by`` and ``examples`` are its children,
  ``clip_norm`` and ``normalize`` static.

  Attributes:
    grads: the clipped sum divided by ``divided_by``, as the step returns it.
    divided_by: what the clipped sum was divided by; shape=(), float32.
    examples: the real examples' count (their total weight with
      ``normalize="weighted"``); shape=(), float32.
    clip_norm: the norm each example's gradient was clipped to.
    normalize: the step's ``normalize``: ``"sum"``, ``"mean"`` or
      ``"weighted"``.
  """

  def __init__(
    self,
    grads: PyTree,
    divided_by: Any,
    examples: Any,
    clip_norm: float,
    normalize: str,
  ):
    self.grads = grads
    self.divided_by = divided_by
    self.examples = examples
    self.clip_norm = clip_norm
    self.normalize = normalize

  def __repr__(self) -> str:
    return (
      f"ClipRecord(clip_norm={self.clip_norm}, normalize={self.normalize!r}, "
      f"examples={self.examples})"
    )


jax.tree_util.register_pytree_node(
  ClipRecord,
  lambda r: ((r.grads, r.divided_by, r.examples), (r.clip_norm, r.normalize)),
  lambda static, children: ClipRecord(*children, *static),
)


def record_of(
  grads: PyTree, total_weight: jax.Array, clip_norm: float, normalize: str
) -> ClipRecord:
  """The :class:`ClipRecord` of a clipped step's normalized gradient."""
  examples = jnp.asarray(total_weight, jnp.float32)
  return ClipRecord(
    grads, divided_by(examples, normalize), examples, clip_norm, normalize
  )


_FIRST = (
  "Put jaxaccum.dp_noise first, where it sees the clipped sum itself: "
  "optax.chain(jaxaccum.dp_noise(...), optax.adam(...)), with no wrapper "
  "around it (optax.masked, multi_transform, MultiSteps); to accumulate across "
  "calls, use jaxaccum.accumulate(optax.chain(jaxaccum.dp_noise(...), ...), k)."
)


def check_received(grads: PyTree, record: Any, config: NoiseConfig) -> ClipRecord:
  """``dp_noise``'s check, at trace time, that ``grads`` is the clipped sum
  the step recorded: the very arrays (a transformation before ``dp_noise``,
  even a scale, made new ones), clipped at the noise's ``clip_norm``."""
  if record is None:
    raise ValueError(
      "jaxaccum.dp_noise received no clip_record=, the record of the clipped "
      "sum that make_train_step, jaxaccum.nnx.make_train_step and accumulate "
      "pass with the gradient, so it cannot tell that the gradient was clipped "
      "and that nothing changed it since. " + _FIRST + " In a loop of your own "
      "pass update(record.grads, state, clip_record=record) with the record of "
      "value_and_grad(..., clip_per_example=C, clip_record=True)."
    )
  if not isinstance(record, ClipRecord):
    raise TypeError(
      "clip_record= must be the jaxaccum.ClipRecord a clipped step returns, "
      f"got a {type(record).__name__}."
    )
  got, want = jax.tree.leaves(grads), jax.tree.leaves(record.grads)
  if len(got) != len(want) or any(a is not b for a, b in zip(got, want, strict=True)):
    raise ValueError(
      "jaxaccum.dp_noise received a gradient that is not the clipped sum its "
      "step recorded: a transformation before it in the chain (or a wrapper "
      "around it) changed it, so the noise is no longer calibrated to one "
      "example's effect on what it receives (scale_by_adam before it leaves an "
      "effective noise multiplier near 0.001 for sigma = 1). " + _FIRST
    )
  if np.float32(record.clip_norm) != np.float32(config.clip_norm):
    raise ValueError(
      f"The gradient was clipped at clip_per_example={record.clip_norm}, but "
      f"dp_noise's clip_norm={config.clip_norm}: the noise must be calibrated "
      "to the norm the examples are clipped to. Pass the same number to both."
    )
  return record


def accumulated_record(
  grads: Any, record: Any, config: NoiseConfig | None
) -> tuple[PyTree, ClipRecord | None]:
  """:func:`jaxaccum.accumulate`'s reading of one call: the gradient and
  its :class:`ClipRecord`, given in place of the gradient or (from
  ``make_train_step``) as ``clip_record=`` beside it. With ``dp_noise`` in
  the inner optimizer, a record of a sum clipped at the noise's norm is
  required, at trace time."""
  if isinstance(grads, ClipRecord):
    grads, record = grads.grads, grads
  elif record is not None:
    record = check_received(grads, record, config) if config else record
  if config is None:
    return grads, record
  if record is None:
    raise ValueError(
      "accumulate() with jaxaccum.dp_noise in its inner optimizer needs each "
      "call's clipped sum as a jaxaccum.ClipRecord, in place of the gradient: "
      "grad = jaxaccum.grad(fun, k, clip_per_example=C, normalize='sum', "
      "clip_record=True); tx.update(grad(params, batch, example_mask=mask), "
      "opt_state, params). A plain gradient may be unclipped, clipped at "
      "another norm or a mean, and the noise would protect nothing."
    )
  if np.float32(record.clip_norm) != np.float32(config.clip_norm):
    raise ValueError(
      f"accumulate() got a gradient clipped at clip_per_example="
      f"{record.clip_norm}, but its dp_noise is calibrated to clip_norm="
      f"{config.clip_norm}: one example could move the sum by "
      f"{record.clip_norm / config.clip_norm:.3g} times what the noise "
      "covers. Pass the same number to both."
    )
  if record.normalize != "sum":
    raise ValueError(
      f"accumulate() with jaxaccum.dp_noise adds up clipped sums, but got a "
      f'gradient of normalize="{record.normalize}", divided by its examples '
      "(a mean shrinks the signal by the micro-batch size against the same "
      "noise, and the window's sum would not be the clipped sum). Compute it "
      "with grad(fun, k, clip_per_example=C, normalize='sum', clip_record=True)."
    )
  return grads, record


class DPNoiseState(NamedTuple):
  """The state of :func:`dp_noise`.

  Attributes:
    draws: noise draws so far, one per update; shape=(), int32.
    key: the key passed to :func:`dp_noise`; draw ``t`` uses
      ``fold_in(key, t)``.
    config: the :class:`NoiseConfig` (static: no leaves).
  """

  draws: jax.Array
  key: jax.Array
  config: NoiseConfig


def _gaussian(key: jax.Array, like: PyTree) -> PyTree:
  """Standard normal float32 noise shaped like ``like``: leaf ``i`` (in
  ``jax.tree.leaves`` order) from ``jax.random.split(key, n)[i]``."""
  leaves, treedef = jax.tree.flatten(like)
  keys = jax.random.split(key, max(len(leaves), 1))
  return jax.tree.unflatten(
    treedef,
    [
      jax.random.normal(k, jnp.shape(x), jnp.float32)
      for k, x in zip(keys, leaves, strict=False)
    ],
  )


def dp_noise(
  noise_multiplier: float,
  clip_norm: float,
  key: jax.Array | None,
  *,
  normalize: str,
  expected_batch_size: float | None = None,
) -> optax.GradientTransformationExtraArgs:
  """DP-SGD's Gaussian noise, added once per update to the clipped sum.

  ``update(grads, state, params=None, *, clip_record, **extra)`` takes the
  clipped gradient as :func:`jaxaccum.value_and_grad` with
  ``clip_per_example`` returns it, the clipped sum ``S`` divided by
  ``clip_record.divided_by`` (the number of real examples for
  ``normalize="mean"``, their total weight for ``"weighted"``, 1 for
  ``"sum"``), and returns

  - ``normalize="poisson"``: ``(S + N(0, (sigma C)^2)) / expected_batch_size``,
    the unbiased estimate for Poisson sampling, where the number of examples
    drawn is itself private;
  - ``normalize="fixed"``: ``(S + N(0, (sigma C)^2)) / divided_by``, for
    batches of a fixed, public size. With nothing to divide by
    (``divided_by == 0``) it returns zeros, and ``make_train_step`` skips
    the step.

  ``dp_noise`` must be the first transformation that sees the gradient:
  ``clip_record`` is the :class:`ClipRecord` that ``make_train_step``,
  ``jaxaccum.nnx.make_train_step`` and ``accumulate`` pass with it, and
  ``update`` raises a ``ValueError`` at trace time unless ``grads`` is that
  record's very ``grads``, clipped at ``clip_norm``. Any transformation
  before it (``scale_by_adam``, ``clip_by_global_norm``, even
  ``optax.scale``) or a wrapper around it (``optax.masked``,
  ``MultiSteps``) makes new arrays, and is refused. In ``make_train_step``
  it runs once per step; inside ``accumulate(optax.chain(dp_noise(...),
  ...), k)`` once per window.
  Update ``t`` (``state.draws``) draws its noise from
  ``jax.random.fold_in(key, t)``, leaf ``i`` of the gradient from
  ``jax.random.split(that, number_of_leaves)[i]`` as float32.

  Args:
    noise_multiplier: sigma >= 0, the ratio of the noise's standard deviation
      to ``clip_norm``; :func:`dp_epsilon` turns it into epsilon.
    clip_norm: C, the same number as ``clip_per_example``
      (``make_train_step`` checks it).
    key: a PRNG key (``jax.random.key(seed)``), kept in the state. Use a
      fresh seed for every training run.
    normalize: ``"poisson"`` or ``"fixed"``, see above.
    expected_batch_size: ``q * N`` (sampling rate times data set size);
      needed for, and only for, ``"poisson"``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`DPNoiseState`.

  >>> import jax, jax.numpy as jnp, jaxaccum
  >>> tx = jaxaccum.dp_noise(0.0, 1.0, jax.random.key(0), normalize="fixed")
  >>> grad = jaxaccum.grad(
  ...   lambda w, x: jnp.sum(w * x), 1, clip_per_example=1.0, clip_record=True
  ... )
  >>> record = grad(jnp.zeros(2), jnp.array([[0.5, 0.0], [0.0, 0.25]]))
  >>> state = tx.init(jnp.zeros(2))
  >>> out, state = tx.update(record.grads, state, clip_record=record)
  >>> out.tolist(), int(state.draws)  # the mean of two clipped examples
  ([0.25, 0.125], 1)
  >>> tx.update(record.grads * 1.0, state, clip_record=record)
  Traceback (most recent call last):
  ValueError: jaxaccum.dp_noise received a gradient that is not the clipped sum ...
  """
  config = noise_config(
    noise_multiplier, clip_norm, key, normalize, expected_batch_size
  )
  the_key: jax.Array = key  # type: ignore[assignment]  # checked: not None

  def init_fn(params):
    del params
    return DPNoiseState(jnp.zeros((), jnp.int32), the_key, config)

  def update_fn(grads, state, params=None, *, clip_record=None, **extra_args):
    del params, extra_args
    record = check_received(grads, clip_record, config)
    check_noise_matches(config, record.clip_norm, record.normalize)
    divided_by = jnp.asarray(record.divided_by, jnp.float32)
    noise = _gaussian(jax.random.fold_in(state.key, state.draws), grads)
    stddev = jnp.float32(config.noise_multiplier * config.clip_norm)
    if config.normalize == "poisson":
      assert config.expected_batch_size is not None
      expected = jnp.float32(config.expected_batch_size)
      noisy = jax.tree.map(
        lambda g, z: (g.astype(jnp.float32) * divided_by + stddev * z) / expected,
        grads,
        noise,
      )
    else:
      some = divided_by != 0
      safe = jnp.where(some, divided_by, jnp.float32(1))
      noisy = jax.tree.map(
        lambda g, z: jnp.where(
          some, g.astype(jnp.float32) + stddev * z / safe, jnp.zeros_like(z)
        ),
        grads,
        noise,
      )
    noisy = jax.tree.map(lambda n, g: n.astype(g.dtype), noisy, grads)
    return noisy, state._replace(draws=state.draws + 1)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def noise_config(
  noise_multiplier: Any,
  clip_norm: Any,
  key: Any,
  normalize: Any,
  expected_batch_size: Any,
) -> NoiseConfig:
  """:func:`dp_noise`'s arguments, checked."""
  # Imported here: the options (and through them the checks) import us.
  from jaxaccum._checks import describe  # noqa: PLC0415
  from jaxaccum._options import check_clip_norm  # noqa: PLC0415

  if key is None:
    raise ValueError(
      "dp_noise needs a key: the noise must come from randomness you pass, "
      "e.g. dp_noise(noise_multiplier, clip_norm, jax.random.key(seed), ...), "
      "with a fresh seed for every training run."
    )
  if not _tree.is_single_key(key):
    raise TypeError(
      "dp_noise's key must be one PRNG key, jax.random.key(seed) (or a raw "
      f"jax.random.PRNGKey(seed)), got {describe(key)}."
    )
  _check_number("noise_multiplier", noise_multiplier)
  if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
    raise ValueError(
      "noise_multiplier must be a finite number >= 0 (sigma, the noise's "
      f"standard deviation over clip_norm), got {noise_multiplier=}. Use e.g. "
      "noise_multiplier=1.0; 0 adds no noise and gives no privacy."
    )
  clip = check_clip_norm("clip_norm", clip_norm)
  assert clip is not None
  if normalize not in NORMALIZATIONS:
    raise ValueError(
      f"Unknown {normalize=}; choose 'poisson' (Poisson sampling: divide by "
      "expected_batch_size) or 'fixed' (batches of a fixed size: divide by "
      "the actual number of examples)."
    )
  if normalize == "poisson":
    if expected_batch_size is None:
      raise ValueError(
        'normalize="poisson" divides by the expected batch size: pass '
        "expected_batch_size= (sampling rate times data set size), e.g. "
        "PoissonSampler(...).expected_batch_size."
      )
    _check_number("expected_batch_size", expected_batch_size)
    if not (math.isfinite(expected_batch_size) and expected_batch_size > 0):
      raise ValueError(
        f"expected_batch_size must be a positive number, got {expected_batch_size=}."
      )
    expected_batch_size = float(expected_batch_size)
  elif expected_batch_size is not None:
    raise ValueError(
      f'normalize="fixed" divides by the actual number of examples and takes '
      f"no {expected_batch_size=}: drop it, or use normalize='poisson'."
    )
  return NoiseConfig(float(noise_multiplier), clip, normalize, expected_batch_size)


def _check_number(name: str, value: Any) -> None:
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"{name} must be a number, got {value!r}.")


def find_noise(opt_state: PyTree) -> NoiseConfig | None:
  """The :class:`NoiseConfig` of the one :func:`dp_noise` in ``opt_state``,
  or None. More than one is an error (noise would be added twice)."""
  is_noise = lambda x: isinstance(x, DPNoiseState)  # noqa: E731
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_noise) if is_noise(x)]
  if len(found) > 1:
    raise ValueError(
      f"The optimizer state holds {len(found)} jaxaccum.dp_noise states: noise "
      "would be added more than once per step. Keep one, first in the chain."
    )
  return found[0].config if found else None


def check_noise_matches(
  config: NoiseConfig, clip_per_example: float | None, normalize: str
) -> None:
  """``make_train_step``'s checks of a :func:`dp_noise` against its own
  options, at trace time."""
  if clip_per_example is None:
    raise ValueError(
      "The optimizer holds jaxaccum.dp_noise, but the step does not clip: "
      f"pass clip_per_example={config.clip_norm} (noise calibrated to C "
      "protects nothing unless each example's gradient is clipped to C)."
    )
  if np.float32(clip_per_example) != np.float32(config.clip_norm):
    # Compared as the float32 the step computes with: 0.1 and np.float32(0.1)
    # clip alike.
    raise ValueError(
      f"clip_per_example={clip_per_example} differs from dp_noise's "
      f"clip_norm={config.clip_norm}: the noise must be calibrated to the "
      "norm the examples are clipped to. Pass the same number to both."
    )
  if config.normalize == "fixed" and normalize == "sum":
    raise ValueError(
      'dp_noise\'s normalize="fixed" divides by the actual number of examples, '
      'and the step\'s normalize="sum" divides by nothing: the update would be '
      'the noisy sum. Use normalize="mean" (or "weighted") with a fixed batch '
      'size, or dp_noise(..., normalize="poisson") for Poisson sampling.'
    )
  if config.normalize == "poisson" and normalize == "weighted":
    raise ValueError(
      'normalize="weighted" divides by the actual total weight, and dp_noise\'s '
      'normalize="poisson" by the expected batch size: choose one. For '
      'Poisson sampling use normalize="mean" (or "sum") and mark padding with '
      "example_mask=; for a fixed batch size use dp_noise(..., "
      'normalize="fixed").'
    )


def divided_by(total_weight: jax.Array, normalize: str) -> jax.Array:
  """What ``value_and_grad`` with ``clip_per_example`` divided the clipped
  sum by: the examples' count or weight, or 1 for ``"sum"``."""
  if normalize == "sum":
    return jnp.ones((), jnp.float32)
  return jnp.asarray(total_weight, jnp.float32)


# ---------------------------------------------------------------- sampling


class PoissonSampler:
  """Poisson sampling at one fixed, padded batch size.

  Each example of a data set of ``num_examples`` is drawn independently with
  probability ``q = expected_batch_size / num_examples``, the sampling that
  DP-SGD's privacy analysis assumes (and :func:`dp_epsilon` accounts for).
  The number drawn varies from step to step; each draw is padded to
  ``max_batch_size`` rows with :func:`jaxaccum.pad_batch` and comes with a
  row mask for ``example_mask=``, so one compiled step serves every draw.

  ``max_batch_size`` is the smallest multiple of ``multiple_of`` for which a
  draw exceeds it with probability at most ``overflow_probability`` per step
  (the binomial tail, from scipy); :attr:`overflow_probability` holds the
  exact tail at that size. A draw that does exceed it raises a
  ``RuntimeError``: truncating it, or drawing again, would bias the sample
  and void the guarantee.

  The draws use the numpy ``Generator`` you pass. The privacy analysis
  assumes true randomness; seed it from ``secrets.randbits(128)`` in
  production rather than from a fixed number.

  Args:
    num_examples: N, the size of the data set.
    expected_batch_size: ``q * N``, the mean number of examples per draw.
    overflow_probability: the largest acceptable probability, per step, of a
      draw larger than ``max_batch_size``.
    multiple_of: round ``max_batch_size`` up to a multiple of this (the
      number of micro-batches times the data-parallel devices).

  Attributes:
    num_examples: N, as given.
    expected_batch_size: ``q * N``, as given (a float); pass it to
      :func:`dp_noise` with ``normalize="poisson"``.
    sampling_rate: ``q = expected_batch_size / num_examples``, for
      :func:`dp_epsilon`.
    max_batch_size: the padded size of every draw (rows).
    overflow_probability: the exact probability, per step, of a draw larger
      than ``max_batch_size``.

  >>> import numpy as np, jaxaccum
  >>> sampler = jaxaccum.PoissonSampler(1000, 100, multiple_of=8)
  >>> sampler.sampling_rate, sampler.max_batch_size, sampler.overflow_probability < 1e-6
  (0.1, 152, True)
  >>> x = np.arange(1000.0)
  >>> batch, mask = sampler.sample(x, np.random.default_rng(0))
  >>> batch.shape, mask.shape, int(mask.sum()) == len(np.unique(batch[mask > 0]))
  ((152,), (152,), True)
  """

  def __init__(
    self,
    num_examples: int,
    expected_batch_size: float,
    *,
    overflow_probability: float = 1e-6,
    multiple_of: int = 1,
  ):
    from scipy import stats  # noqa: PLC0415 (jax depends on scipy)

    for name, n in (("num_examples", num_examples), ("multiple_of", multiple_of)):
      if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n <= 0:
        raise ValueError(f"{name} must be a positive integer, got {name}={n!r}.")
    _check_number("expected_batch_size", expected_batch_size)
    if not 0 < expected_batch_size <= num_examples:
      raise ValueError(
        f"expected_batch_size must be in (0, num_examples], got "
        f"{expected_batch_size=} for {num_examples=}."
      )
    _check_number("overflow_probability", overflow_probability)
    if not 0 < overflow_probability < 1:
      raise ValueError(
        f"overflow_probability must be in (0, 1), got {overflow_probability=}."
      )
    self.num_examples = int(num_examples)
    self.expected_batch_size = float(expected_batch_size)
    self.sampling_rate = self.expected_batch_size / self.num_examples
    binom = stats.binom(self.num_examples, self.sampling_rate)
    # The smallest size M with P(draw > M) <= overflow_probability.
    size = int(binom.isf(overflow_probability))
    while size > 0 and binom.sf(size - 1) <= overflow_probability:
      size -= 1
    while binom.sf(size) > overflow_probability:
      size += 1
    size = max(size, 1)
    multiple = int(multiple_of)
    self.max_batch_size = min(-(-size // multiple) * multiple, self._cap(multiple))
    #: P(a draw has more than max_batch_size examples), per step.
    self.overflow_probability = float(binom.sf(self.max_batch_size))

  def _cap(self, multiple: int) -> int:
    """No draw has more than every example: N, rounded up."""
    return -(-self.num_examples // multiple) * multiple

  def sample_indices(self, rng: np.random.Generator) -> np.ndarray:
    """The indices of one Poisson draw, in increasing order.

    Raises:
      RuntimeError: if more than ``max_batch_size`` examples were drawn.
    """
    drawn = np.flatnonzero(rng.random(self.num_examples) < self.sampling_rate)
    if drawn.size > self.max_batch_size:
      raise RuntimeError(
        f"The Poisson draw holds {drawn.size} examples, more than "
        f"max_batch_size={self.max_batch_size} (probability "
        f"{self.overflow_probability:.2g} per step). It is not truncated: that "
        "would break the privacy guarantee. Build the sampler with a smaller "
        "overflow_probability."
      )
    return drawn

  def sample(self, data: PyTree, rng: np.random.Generator) -> tuple[PyTree, Any]:
    """One draw from ``data`` (a pytree of arrays with ``num_examples``
    rows), padded to ``max_batch_size`` rows.

    Returns:
      ``(batch, mask)``: the drawn rows then padding (copies of the last
      drawn row, or of row 0 for an empty draw), and a float32 mask, 1 for
      drawn rows and 0 for padding; pass it as ``example_mask=``.
    """
    size = _split.leading_batch_size({"data": data})
    if size != self.num_examples:
      raise ValueError(
        f"The data has {size} rows, but the sampler was built for "
        f"num_examples={self.num_examples}."
      )
    drawn = self.sample_indices(rng)
    if drawn.size == 0:  # pad_batch needs a row to repeat; mask it all
      batch, _ = _split.pad_batch(
        jax.tree.map(lambda x: x[:1], data), micro_batch_size=self.max_batch_size
      )
      return batch, np.zeros(self.max_batch_size, np.float32)
    rows = jax.tree.map(lambda x: x[drawn], data)
    return _split.pad_batch(rows, micro_batch_size=self.max_batch_size)


# ---------------------------------------------------------------- accounting


ACCOUNTANTS = ("pld", "rdp")


def dp_epsilon(
  sampling_rate: float,
  noise_multiplier: float,
  steps: int,
  delta: float,
  *,
  accountant: str = "pld",
  value_discretization_interval: float = 1e-4,
) -> float:
  """Epsilon of DP-SGD, from Google's ``dp-accounting`` package.

  The mechanism is ``steps`` compositions of the Poisson-subsampled Gaussian
  mechanism (``dp_accounting.PoissonSampledDpEvent`` of a
  ``GaussianDpEvent``), under add-or-remove-one adjacency: what
  :class:`PoissonSampler`, ``clip_per_example`` and :func:`dp_noise` with
  ``normalize="poisson"`` implement. jaxaccum computes nothing itself.

  Args:
    sampling_rate: q, each example's probability of being drawn per step
      (1 for the full batch every step).
    noise_multiplier: sigma of :func:`dp_noise`.
    steps: the number of steps (noise draws).
    delta: the target delta, e.g. 1e-5; below 1 / N for N examples.
    accountant: ``"pld"`` (privacy loss distributions: the tighter) or
      ``"rdp"`` (Rényi DP: an upper bound).
    value_discretization_interval: the PLD accountant's grid of privacy loss
      values (``dp_accounting``'s default, 1e-4). Its arrays hold about
      ``(20 / sigma + 1 / sigma**2) / interval`` points, so a small sigma needs
      a coarser grid (or ``"rdp"``); more than :data:`PLD_MAX_POINTS` is
      refused before anything is allocated.

  Returns:
    The smallest epsilon the accountant certifies at ``delta``.

  What it covers: Poisson sampling (:class:`PoissonSampler`) with the noise
  divided by the expected batch size (``dp_noise(..., normalize="poisson")``),
  under add-or-remove-one adjacency. Batches of a fixed size drawn by
  shuffling (``normalize="fixed"``) are a different mechanism that this
  epsilon does not cover, and neither does replace-one adjacency.

  >>> import jaxaccum
  >>> round(jaxaccum.dp_epsilon(0.01, 1.1, 1000, 1e-5), 2)
  1.52
  """
  try:
    import dp_accounting  # noqa: PLC0415 (an optional dependency)
  except ImportError:
    raise ImportError(
      "dp_epsilon needs Google's dp-accounting package: "
      "pip install 'jaxaccum[dp]' (or pip install dp-accounting)."
    ) from None
  _check_number("sampling_rate", sampling_rate)
  if not 0 < sampling_rate <= 1:
    raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate=}.")
  _check_number("noise_multiplier", noise_multiplier)
  if not noise_multiplier >= 0:
    raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier=}.")
  if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
    raise ValueError(
      f"steps must be an integer >= 1, the noise draws so far, got {steps=}: "
      "before the first step nothing was released and there is no epsilon to "
      "report."
    )
  _check_number("delta", delta)
  if not 0 < delta < 1:
    raise ValueError(f"delta must be in (0, 1), got {delta=}.")
  if accountant not in ACCOUNTANTS:
    raise ValueError(f"Unknown {accountant=}; choose one of {list(ACCOUNTANTS)}.")
  event = dp_accounting.PoissonSampledDpEvent(
    float(sampling_rate), dp_accounting.GaussianDpEvent(float(noise_multiplier))
  )
  if accountant == "pld":
    _check_pld_size(noise_multiplier, value_discretization_interval)
    counter = dp_accounting.pld.PLDAccountant(
      value_discretization_interval=float(value_discretization_interval)
    )
  else:
    counter = dp_accounting.rdp.RdpAccountant()
  counter.compose(dp_accounting.SelfComposedDpEvent(event, int(steps)))
  return float(counter.get_epsilon(float(delta)))


#: The most points :func:`dp_epsilon` lets the PLD accountant's arrays hold
#: (float64: 40 MB each; its composition takes several such arrays). At the
#: default grid that admits sigma >= 0.065; sigma = 0.1 (3e6 points) takes
#: about 15 s on one CPU core for 100 steps, sigma = 0.03 (1.8e7) 230 s.
PLD_MAX_POINTS = 5_000_000


def pld_points(noise_multiplier: float, interval: float) -> float:
  """An upper bound on the points of the PLD of one Gaussian step (sampling
  rate 1: subsampling shrinks it): its privacy losses span about
  ``20 / sigma`` (the tails to a mass of e^-50) plus ``1 / sigma**2`` (the
  shift between the two Gaussians), in steps of ``interval``. Within 2x of
  ``dp_accounting``'s own sizes for sigma from 0.03 to 1.

  >>> f"{pld_points(1.0, 1e-4):.3g}", f"{pld_points(1e-3, 1e-4):.3g}"
  ('2.1e+05', '1.02e+10')
  """
  sigma = float(noise_multiplier)
  return (20 / sigma + 1 / sigma**2) / float(interval)


def _check_pld_size(noise_multiplier: float, interval: Any) -> None:
  """Refuses PLD settings whose arrays would not fit in memory, before
  ``dp_accounting`` allocates them (sigma = 1e-3 asked it for 38 GiB)."""
  _check_number("value_discretization_interval", interval)
  if not (math.isfinite(interval) and interval > 0):
    raise ValueError(
      f"value_discretization_interval must be a positive number, got {interval=}."
    )
  if noise_multiplier == 0:  # no noise: dp_accounting reports infinity
    return
  points = pld_points(noise_multiplier, interval)
  if points > PLD_MAX_POINTS:
    coarser = pld_points(noise_multiplier, 1.0) / PLD_MAX_POINTS
    raise ValueError(
      f"The PLD accountant at noise_multiplier={noise_multiplier} and "
      f"value_discretization_interval={interval} would discretize about "
      f"{points:.2g} privacy loss values ({points * 8 / 2**30:.3g} GiB per "
      f"array, several arrays), more than PLD_MAX_POINTS={PLD_MAX_POINTS:.2g}. "
      f"Pass value_discretization_interval={_round_up(coarser):.2g} or coarser "
      "(epsilon then comes out slightly larger: still an upper bound), or "
      'accountant="rdp".'
    )


def _round_up(x: float) -> float:
  """``x`` rounded up to two significant digits."""
  scale = 10 ** (math.floor(math.log10(x)) - 1)
  return math.ceil(x / scale) * scale
