"""Per-example clipping: DP-SGD's clipped sum over one micro-batch.

:func:`clipped_value_and_grad` is the gradient function of the engine's micro
step under ``clip_per_example=C``: one ``vmap`` of ``value_and_grad`` over the
micro-batch's examples, one global L2 norm per example over every
differentiated leaf, one select. Each example's gradient is scaled to norm at
most ``C`` and the clipped gradients are summed into the float32
accumulator. A masked row (padding) and a row whose gradient is not finite
add exactly zero: they are selected away, never multiplied.
``clip_method="ghost"`` computes the same sum without per-example gradients
(:mod:`jaxaccum._privacy.ghost`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from jaxaccum import _compat, _jaxpr, _normalize
from jaxaccum._privacy import closure as _closure
from jaxaccum._privacy import ghost as _ghost

PyTree = Any

#: The keyword of an accumulated function that takes the row mask.
MASK_KEYWORD = "example_mask"


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
  closed_over: Sequence[Any] = (),
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
  without per-example gradients (:func:`jaxaccum._privacy.ghost.clipped_sum`).

  ``fun`` is traced once, every array argument an input of the trace, and
  an array it closes over that an enclosing transformation traces is a
  ``ValueError`` (:mod:`jaxaccum._privacy.closure`), unless it is among
  ``closed_over``: the arrays jaxaccum itself closed ``loss_fn`` over (its
  own keyword arguments).
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
        closed_over=closed_over,
      )
    else:
      per_example = jax.vmap(grad_fn, in_axes=tuple(in_axes))
      (loss, (weight, aux, _)), grads = checked_per_example(
        per_example, args, closed_over
      )
      clipped, _ = clip_and_sum(grads, clip_norm, present, accum_dtype)
    return rows_of.finish(present, loss, weight, aux, state), clipped

  return value_and_clipped_grad


def checked_per_example(
  per_example: Callable[..., Any], args: Any, closed_over: Sequence[Any] = ()
) -> Any:
  """``per_example(*args)`` (the ``vmap`` of each example's gradient),
  evaluated from the jaxpr it is traced to once: a ``ValueError`` where
  ``fun`` closes over an array that an enclosing transformation traces (other
  than ``closed_over``, :mod:`jaxaccum._privacy.closure`), and, in a process
  with more than one device, where it holds a convolution grouped over the
  examples.

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
  closed, out_tree, inputs = _closure.trace(per_example, args, closed_over)
  devices = jax.device_count()
  if devices > 1 and _grouped_convolution(closed.jaxpr):
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
  return jax.tree.unflatten(out_tree, jex_core.jaxpr_as_fun(closed)(*inputs))


def _grouped_convolution(jaxpr: Any) -> bool:
  """``jaxpr`` holds, at any depth, a convolution with feature or batch
  groups (:func:`jaxaccum._jaxpr.find`)."""

  def grouped(eqn: Any) -> bool:
    p = eqn.params
    return eqn.primitive.name == "conv_general_dilated" and (
      p["feature_group_count"] > 1 or p["batch_group_count"] > 1
    )

  return _jaxpr.find(jaxpr, grouped) is not None


def ghost_objective(
  loss_fn: Callable[..., Any],
  *,
  argnums: tuple[int, ...],
  batch_argnums: tuple[int, ...],
  clip_norm: float,
  rng_argnum: int | None = None,
  state_argnum: int | None = None,
  mask_argnum: int | None = None,
  closed_over: Sequence[Any] = (),
) -> Callable[..., Any]:
  """Ghost clipping over a micro-batch as a loss, for a caller that
  differentiates it itself (the data-parallel path, whose FSDP leaves are
  shared by the devices: their clipped sums are reduce-scattered inside the
  backward pass, as the non-private step's gradients are).

  Takes the arguments of :func:`clipped_value_and_grad`'s function, and by
  keyword ``masters``, the differentiated arguments in the accumulator's
  dtype (:func:`jaxaccum._privacy.ghost.masters`), and returns ``(total,
  (((loss, (weight, aux, state)), some)))``: ``total``'s gradient with
  respect to ``masters`` is the sum of the kept rows' clipped gradients, in
  the accumulator's dtype (:func:`jaxaccum._privacy.ghost.weighted_loss`),
  the rest as there, and ``some`` whether any row was kept (where none is,
  the caller zeroes the gradient: :func:`jaxaccum._privacy.ghost.kept_only`).
  """
  rows_of = _RowArgs(loss_fn, batch_argnums, rng_argnum, state_argnum, mask_argnum)

  def objective(*call_args, masters):
    args, in_axes, present, state = rows_of(call_args)
    weighted = _ghost.weighted_loss(
      rows_of.per_example_loss,
      args,
      argnums=argnums,
      in_axes=in_axes,
      present=present,
      clip_norm=clip_norm,
      closed_over=closed_over,
      masters=masters,
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
    # The state leaves fun replaced, by position: fun may be traced more than
    # once (ghost clipping traces it for the norms and again for the sum), and
    # a leaf it replaces in each trace is one leaf.
    self.changed: set[int] = set()

  def per_example_loss(self, *call_args):
    loss, (weight, aux, new_state) = self.loss_fn(*call_args)
    if self.state_argnum is not None:
      self.changed |= _changed_leaves(call_args[self.state_argnum], new_state)
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
      keys = jax.vmap(lambda j: jax.random.fold_in(key, j))(
        jnp.arange(rows, dtype=jnp.int32)
      )
      first = jax.tree.leaves([args[n] for n in sorted(mapped)])[0]
      args[self.rng_argnum] = _rows_placed_as(keys, first)
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
    _check_state_kept(len(self.changed), len(jax.tree.leaves(state)))

    def kept_sum(v):
      which = _rows_like(present, v)
      v = _rows_like(v, which)
      return jnp.sum(jnp.where(which, v, jnp.zeros_like(v)))

    return kept_sum(loss), (
      kept_sum(jnp.asarray(weight, jnp.float32)),
      aux,
      state,
    )


def _changed_leaves(before: PyTree, after: PyTree) -> set[int]:
  """The positions of the leaves of the threaded state that ``fun``
  replaced, read at trace time: a leaf ``fun`` only read comes back as the
  very value it was given."""
  old, new = jax.tree.leaves(before), jax.tree.leaves(after)
  if len(old) != len(new):
    return set(range(max(len(old), len(new))))
  return {i for i, (a, b) in enumerate(zip(old, new, strict=True)) if a is not b}


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
  if o.privacy.clip_norm is None:
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


def _rows_placed_as(keys: jax.Array, rows: jax.Array) -> jax.Array:
  """The rows' ``keys`` sharded over the Explicit axes ``rows``' leading
  dimension is (``vmap`` maps operands sharded alike)."""
  spec = _compat.explicit_spec(rows)
  if spec is None or not len(spec) or spec[0] is None:
    return keys
  return jax.sharding.reshard(keys, jax.sharding.PartitionSpec(spec[0]))


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
