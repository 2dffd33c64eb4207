"""Ghost clipping's passes: the first (the norms and the clip factors) and
the weighted second, as a loss whose gradient is the clipped sum."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxaccum import _compat, _jaxpr, _normalize
from jaxaccum._privacy import closure as _closure
from jaxaccum._privacy.ghost.norms import kept_sums, squared_norms
from jaxaccum._privacy.ghost.uses import (
  GhostFallbackWarning,
  Tag,
  Use,
  Walk,
  fallbacks,
  is_conv_kernel,
  plan_uses,
  tap_shape,
)

PyTree = Any


class _Traced(NamedTuple):
  """``fun`` on one example, traced, and what the walk found in it."""

  jaxpr: Any  # a ClosedJaxpr of (parameter, example, shared array leaves)
  out_def: Any  # the treedef of (loss, (weight, aux, state))
  tags: list[Tag | None]
  uses: list[Use]
  plan: dict[int, str]


def _trace(
  per_example: Callable[..., Any],
  leaves: list[Any],
  example: list[Any],
  shared: list[Any],
  closed_over: Sequence[Any] = (),
) -> _Traced:
  """``per_example(leaves, example, shared)`` traced once; an array it
  closes over that an enclosing transformation traces is refused
  (:mod:`jaxaccum._privacy.closure`), unless jaxaccum passed it
  (``closed_over``)."""
  closed, out_shape = jax.make_jaxpr(per_example, return_shape=True)(
    leaves, example, shared
  )
  _closure.refuse_traced_consts(closed, closed_over)
  tags: list[Tag | None] = [Tag(i, ()) for i in range(len(leaves))]
  tags += [None] * (len(example) + len(shared))
  walk = Walk()
  _run_top(walk, closed, [None] * len(tags), tags)
  plan = plan_uses(walk.uses, len(leaves))
  return _Traced(closed, jax.tree.structure(out_shape), tags, walk.uses, plan)


def _run_top(
  walk: Walk, closed: Any, args: list[Any], tags: list[Tag | None]
) -> list[Any]:
  outs, out_tags = walk.run(closed.jaxpr, closed.consts, args, tags)
  if out_tags and out_tags[0] is not None:  # the loss is a parameter
    outs[0] = walk.output(outs[0], out_tags[0], closed.jaxpr.outvars[0].aval)
  return outs


def _leaf_names(diff: Any) -> list[str]:
  return [
    jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(diff)[0]
  ]


def _has_convolution(params: Any) -> bool:
  """A jaxpr among an equation's parameters holds a convolution, at any
  depth (:func:`jaxaccum._jaxpr.find`)."""
  is_conv = lambda e: e.primitive.name == "conv_general_dilated"  # noqa: E731
  return any(_jaxpr.find(inner, is_conv) is not None for inner in _jaxpr.jaxprs(params))


def _refuse_nested_convolutions(traced: _Traced, diff: Any) -> None:
  """A ``ValueError`` where a leaf's per-example gradient would pass through a
  convolution that :func:`kernel_tap` cannot take, on several devices.

  The walk takes a convolution's kernel by :func:`kernel_tap` only where it reaches the
  convolution; one inside ``jax.checkpoint``, ``scan``, ``cond`` or a custom
  derivative, or a kernel with ``batch_group_count``, gets a kernel per
  example, whose gradient ``vmap`` makes a convolution grouped over the
  examples: XLA's SPMD partitioner miscompiles it where the examples are
  sharded over devices (the whole clipped sum 2.6% off, silently, on 8 CPU
  devices). Whether this step's rows are sharded is not visible at trace
  time, so any process with more than one device is refused.
  """
  devices = jax.device_count()
  if devices == 1:
    return
  found: dict[int, str] = {}
  for n, u in enumerate(traced.uses):
    if traced.plan[n] != "input" or u.eqn is None or is_conv_kernel(u.eqn, u.position):
      continue
    name = u.eqn.primitive.name
    if name == "conv_general_dilated" or _has_convolution(u.eqn.params):
      found.setdefault(u.leaf, name)
  if not found:
    return
  paths = _leaf_names(diff)
  named = "; ".join(
    f"args{paths[i]} (used by {why})" for i, why in sorted(found.items())
  )
  raise ValueError(
    f'clip_method="ghost" with {devices} devices: {named} '
    f"{'reaches' if len(found) == 1 else 'reach'} a convolution "
    "that ghost clipping cannot read directly (inside jax.checkpoint, a scan, a "
    "cond or a custom derivative, or with batch_group_count > 1), so each "
    "example would get its own kernel, and the gradient of that vmap forms, a "
    "convolution grouped over the examples, is miscompiled by XLA's SPMD "
    "partitioner where the examples are sharded over devices (every device but "
    "the first gets a zero gradient: the norms, and so the privacy guarantee, "
    'would be wrong; clip_method="vmap" computes the same form). Call the '
    "convolution outside that function (ghost takes the kernel gradient of a "
    "convolution it reaches one window offset at a time), or run in a process "
    "with one device."
  )


def _warn_fallbacks(traced: _Traced, diff: Any) -> None:
  """A :class:`GhostFallbackWarning` naming the leaves whose per-example
  gradient is computed."""
  found = fallbacks(traced.uses, traced.plan)
  if not found:
    return
  paths = _leaf_names(diff)
  named = "; ".join(f"args{paths[i]} ({why})" for i, why in sorted(found.items()))
  warnings.warn(
    f'clip_method="ghost" computes a per-example gradient for {len(found)} '
    f'leaves, as clip_method="vmap" does: {named}. The result is exact; '
    "only dot_general, gather (embedding) and elementwise uses of a leaf used "
    "once are computed without one.",
    GhostFallbackWarning,
    stacklevel=2,
  )


class Weighted(NamedTuple):
  """Ghost clipping's second pass, as a loss (:func:`weighted_loss`).

  Attributes:
    total: shape=(), whose gradient with respect to the differentiated
      leaves' masters is the sum of the kept rows' clipped gradients:
      ``sum_i factor_i * loss_i`` (the loss's dtype) in float32 models; in
      narrower ones the book-kept sums' inner product with the masters
      (float32), a number no one reads.
    losses: each row's loss, from the first pass, shape=(rows,).
    rest: each row's rest (weight, aux, state), stacked over the rows.
    kept: which rows count, shape=(rows,), bool: present, with a finite norm.
  """

  total: jax.Array
  losses: jax.Array
  rest: Any
  kept: jax.Array


def weighted_loss(
  loss_fn: Callable[..., Any],
  args: list[Any],
  *,
  argnums: tuple[int, ...],
  in_axes: list[int | None],
  present: jax.Array,
  clip_norm: float,
  masters: Any = None,
  closed_over: Sequence[Any] = (),
) -> Weighted:
  """Ghost clipping as a loss whose gradient is the clipped sum.

  ``loss_fn(*args)`` is ``fun`` on one example, returning ``(loss, rest)``;
  the arguments with ``in_axes`` 0 hold one row per example, the others are
  shared. The first pass (the norms) reads the differentiated arguments
  ``args[argnums]`` through ``stop_gradient``, so differentiating the
  result's ``total`` with respect to them runs only the second pass's
  backward. A caller that differentiates the sum of several such totals
  (the devices of a data axis, sharing an FSDP leaf) gets their clipped
  sums added inside that backward pass: each example's norm is taken over
  every leaf before the clip, and no device holds a per-example or whole
  gradient of a leaf beyond what the non-private step holds (but for the
  leaves that fall back, :class:`GhostFallbackWarning`).

  ``masters`` (:func:`masters`): the differentiated arguments in the
  accumulator's dtype, to differentiate the total with respect to; the
  leaves in ``args[argnums]`` are then only read. Where ``fun`` computes
  with every leaf in its master's dtype (float32 parameters), the second
  pass is ``fun`` again on the masters, each row's loss weighted by its
  factor. Where it does not (bfloat16 parameters, or a cast to bfloat16 in
  ``fun``), a second pass would seed its backward pass with rounded factors
  and contract the rows in bfloat16, and would not reproduce the first
  pass's bfloat16 values exactly (XLA may keep excess precision in one pass
  and not the other): the clipped sum is then formed in float32 from the
  first pass's own activations and cotangents (:func:`kept_sums`, Bu et
  al. 2022's book-keeping), each row's share its factor times the very
  gradient whose norm gave the factor, and the total is its inner product
  with the masters.

  The arrays of the other arguments (public, shared, the model's other
  variables) are inputs of the traced program too, so that an array ``fun``
  closes over from an enclosing trace stands out, and is refused unless it
  is among ``closed_over`` (jaxaccum's own).
  """
  diff = tuple(args[n] for n in argnums)
  leaves, diff_def = jax.tree.flatten(diff)
  batched = [n for n, axis in enumerate(in_axes) if axis == 0]
  batch_leaves, batch_def = jax.tree.flatten([args[n] for n in batched])
  others = [n for n in range(len(args)) if n not in argnums and n not in batched]
  other_leaves, other_def = jax.tree.flatten([args[n] for n in others])
  dynamic = [i for i, x in enumerate(other_leaves) if _closure.is_array(x)]
  shared = [other_leaves[i] for i in dynamic]

  def per_example(param_leaves, example_leaves, shared_leaves):
    call = list(args)
    for n, d in zip(argnums, jax.tree.unflatten(diff_def, param_leaves), strict=True):
      call[n] = d
    for n, b in zip(
      batched, jax.tree.unflatten(batch_def, example_leaves), strict=True
    ):
      call[n] = b
    rest = list(other_leaves)
    for i, x in zip(dynamic, shared_leaves, strict=True):
      rest[i] = x
    for n, a in zip(others, jax.tree.unflatten(other_def, rest), strict=True):
      call[n] = a
    return loss_fn(*call)

  example = [_one_row(x) for x in batch_leaves]
  traced = _trace(per_example, leaves, example, shared, closed_over)
  _refuse_nested_convolutions(traced, diff)
  _warn_fallbacks(traced, diff)
  first = _factors(
    traced,
    jax.lax.stop_gradient(leaves),
    batch_leaves,
    shared,
    present=present,
    clip_norm=clip_norm,
  )
  kept, (losses, rest) = first.kept, first.out
  wide = leaves if masters is None else jax.tree.leaves(masters)
  if _rounds(traced, leaves, wide):
    sums = kept_sums(traced, first, wide)
    total = sum(
      (jnp.sum(jax.lax.stop_gradient(s) * w) for s, w in zip(sums, wide, strict=True)),
      start=jnp.zeros((), jnp.float32),
    )
    return Weighted(total, losses, rest, kept)
  total = _second_pass(per_example, first, batch_leaves, shared, wide)
  return Weighted(total, losses, rest, kept)


def _second_pass(
  per_example: Callable[..., Any],
  first: _FirstPass,
  batch_leaves: list[Any],
  shared: list[Any],
  wide: Any,
) -> jax.Array:
  """The objective whose gradient with respect to ``wide`` is the clipped
  sum: each row's loss weighted by the first pass's ``factor``.

  The second pass runs fun again (the first pass's activations are dead by
  then: the peak is one pass's), on rows where each row not kept is
  replaced by a kept one: its weight 0 then multiplies finite numbers.
  Where no row is kept, a row with a finite norm stands in; where there is
  none, zeros do (a device of a data axis whose rows all failed still adds
  its zero to the leaves it shares with the others)."""
  batch = [
    _usable_rows(_take_rows(x, first.stand_in), first.usable) for x in batch_leaves
  ]
  again = jax.vmap(lambda p, b: per_example(p, b, shared)[0], in_axes=(None, 0))(
    wide, batch
  )
  return jnp.sum(again * first.factor.astype(again.dtype))


def masters(diff: PyTree, accum_dtype: Any) -> PyTree:
  """The differentiated arguments in the accumulator's dtype (float32 for
  bfloat16 leaves; a float32 leaf is itself), for :func:`weighted_loss`."""
  return jax.tree.map(
    lambda x: x.astype(_normalize.accumulator_dtype(accum_dtype, x)), diff
  )


def _rounds(traced: _Traced, leaves: list[Any], wide: list[Any]) -> bool:
  """Whether ``fun`` computes with a leaf in another dtype than its master
  (bfloat16 parameters, or a cast in ``fun``)."""
  if any(
    jnp.result_type(a) != jnp.result_type(b) for a, b in zip(leaves, wide, strict=True)
  ):
    return True
  return any(u.aval.dtype != jnp.result_type(wide[u.leaf]) for u in traced.uses)


class _FirstPass(NamedTuple):
  """The first pass (:func:`_factors`).

  Attributes:
    factor: each row's clip factor ``min(1, C / norm)``, 0 where not kept;
      shape=(rows,), float32.
    kept: the rows that count: present, with a finite norm; shape=(rows,).
    stand_in: the row that stands in for each row in the second pass.
    usable: whether that row is usable (finite); shape=(), bool.
    out: ``(losses, rest)``, each row's loss and rest.
    tap_grads: each use's tap cotangent, per row.
    saved: what each ``dot`` and ``gather`` use kept (:func:`_saved`).
  """

  factor: jax.Array
  kept: jax.Array
  stand_in: jax.Array
  usable: jax.Array
  out: Any
  tap_grads: dict[int, jax.Array]
  saved: dict[int, Any]


def _factors(
  traced: _Traced,
  leaves: list[Any],
  batch_leaves: list[Any],
  shared: list[Any],
  *,
  present: jax.Array,
  clip_norm: float,
) -> _FirstPass:
  """The first pass: each row's clip factor, which rows are kept, the row
  that stands in for each row in the second pass, and what the norms were
  taken from (:class:`_FirstPass`)."""
  rows = present.shape[0]
  taps = {
    n: _rows_like_batch(jnp.zeros((rows, *s.shape), s.dtype), batch_leaves)
    for n, s in ((n, tap_shape(traced.uses[n], k)) for n, k in traced.plan.items())
  }
  forward = _forward(traced)
  losses, tap_vjp, (rest, saved) = jax.vjp(
    lambda t: forward(leaves, t, batch_leaves, shared), taps, has_aux=True
  )
  (tap_grads,) = tap_vjp(jnp.ones_like(losses))
  norm = jnp.sqrt(squared_norms(traced.uses, traced.plan, tap_grads, saved, rows))
  finite = jnp.isfinite(norm)
  kept = present & finite
  clip = jnp.float32(clip_norm)
  factor = jnp.where(kept, clip / jnp.maximum(norm, clip), jnp.float32(0))
  stand_in = jnp.where(jnp.any(kept), kept, finite)
  index = jnp.where(kept, jnp.arange(rows), jnp.argmax(stand_in))
  return _FirstPass(
    factor, kept, index, jnp.any(stand_in), (losses, rest), tap_grads, saved
  )


def _usable_rows(x: jax.Array, usable: jax.Array) -> jax.Array:
  """``x``, or zeros where no row is usable (a key stays: it is never the
  reason a row is not finite)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    return x
  return jnp.where(usable, x, jnp.zeros_like(x))


def clipped_sum(
  loss_fn: Callable[..., Any],
  args: list[Any],
  *,
  argnums: tuple[int, ...],
  in_axes: list[int | None],
  present: jax.Array,
  clip_norm: float,
  accum_dtype: Any,
  closed_over: Sequence[Any] = (),
) -> tuple[tuple[jax.Array, Any], tuple[PyTree, ...]]:
  """The sum of the kept rows' clipped gradients, by ghost clipping: the
  gradient of :func:`weighted_loss`'s total.

  Returns ``((losses, rest), grads)``: each row's loss and rest (stacked),
  and a tuple (one per ``argnums``) of the clipped sums, in (at least)
  ``accum_dtype``. A row is kept when ``present`` and its norm is finite;
  the others add exactly zero.
  """

  def objective(wide):
    weighted = weighted_loss(
      loss_fn,
      args,
      argnums=argnums,
      in_axes=in_axes,
      present=present,
      clip_norm=clip_norm,
      masters=wide,
      closed_over=closed_over,
    )
    return weighted.total, weighted

  wide = masters(tuple(args[n] for n in argnums), accum_dtype)
  (_, weighted), grads = jax.value_and_grad(objective, has_aux=True)(wide)
  return (weighted.losses, weighted.rest), kept_only(
    grads, jnp.any(weighted.kept), accum_dtype
  )


def kept_only(grads: PyTree, some: jax.Array, accum_dtype: Any) -> PyTree:
  """``grads`` in (at least) ``accum_dtype``, or exactly zero where no row
  was kept (``some`` False: every weight was 0)."""
  return jax.tree.map(
    lambda g: jnp.where(some, g, jnp.zeros_like(g)).astype(
      _normalize.accumulator_dtype(accum_dtype, g)
    ),
    grads,
  )


def _take_rows(x: jax.Array, index: jax.Array) -> jax.Array:
  """``x[index]``, laid out as ``x`` on an Explicit mesh."""
  spec = _compat.explicit_spec(x)
  if spec is None:
    return jnp.take(x, index, axis=0)
  return x.at[index].get(out_sharding=spec)


def _rows_like_batch(x: jax.Array, batch_leaves: list[Any]) -> jax.Array:
  """``x`` with its rows sharded as the batch's, on an Explicit mesh (where
  ``vmap``'s mapped inputs must agree)."""
  for leaf in batch_leaves:
    spec = _compat.explicit_spec(leaf)
    if spec is not None and len(spec) and spec[0] is not None:
      row = jax.sharding.PartitionSpec(spec[0], *([None] * (x.ndim - 1)))
      return jax.sharding.reshard(x, row)
  return x


def _one_row(x: jax.Array) -> jax.ShapeDtypeStruct:
  """The type of one of ``x``'s rows: its sharding along the other
  dimensions kept (the rows' axes are ``vmap``'s), as ``vmap`` types it."""
  sharding: Any = getattr(jax.typeof(x), "sharding", None)
  if _compat.explicit_spec(x) is not None:
    spec = sharding.spec
    sharding = sharding.update(spec=spec.update(partitions=tuple(spec)[1:]))
  else:
    sharding = None
  return jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=sharding)


def _forward(traced: _Traced) -> Callable[..., Any]:
  """``(param_leaves, taps, batch_leaves, shared) -> (losses, (rest,
  saved))`` over every row: the tapped walk of the traced jaxpr, under
  ``vmap``."""

  def one(param_leaves, example_leaves, example_taps, shared):
    walk = Walk(traced.plan, example_taps)
    outs = _run_top(
      walk, traced.jaxpr, [*param_leaves, *example_leaves, *shared], traced.tags
    )
    loss, rest = jax.tree.unflatten(traced.out_def, outs)
    return loss, (rest, walk.saved)

  def forward(param_leaves, taps, batch_leaves, shared):
    return jax.vmap(one, in_axes=(None, 0, 0, None))(
      param_leaves, batch_leaves, taps, shared
    )

  return forward
