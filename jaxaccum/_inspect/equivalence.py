"""``verify_equivalence``: accumulation checked against the full batch.

It runs the accumulated and the full-batch computation side by side and
raises with the largest deviation. (The engine's own checks are in
:mod:`jaxaccum._checks`.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jaxaccum import _compat, _normalize, _options, _static
from jaxaccum._value_and_grad import value_and_grad

PyTree = Any


class Deviation(NamedTuple):
  """The largest deviation ``verify_equivalence`` found.

  Attributes:
    value: ``max |accumulated - full|`` of the value.
    grads: ``max |accumulated - full|`` over every gradient leaf.
    where: the tree path of the gradient leaf where ``grads`` occurs.
  """

  value: float
  grads: float
  where: str


def _full_batch(fun: Callable[..., Any], o: _options.Options) -> Callable[..., Any]:
  """The reference: ``jax.value_and_grad`` on the whole batch at once."""
  argnums = o.argnums[0] if o.tree_grads else o.argnums
  has_aux = o.has_aux
  if o.normalize != "weighted":
    return jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)

  def loss_sum(*args, **kwargs):
    out = fun(*args, **kwargs)
    value, aux = out if has_aux else (out, None)
    loss, weight = value
    return loss, (weight, aux)

  def reference(*args, **kwargs):
    (loss, (weight, aux)), grads = jax.value_and_grad(
      loss_sum, argnums=argnums, has_aux=True
    )(*args, **kwargs)
    safe = jnp.where(weight != 0, weight, 1)
    # Divided as the gradient of loss_sum / weight would be, in the dtypes
    # jax.grad gives (those of the parameters).
    grads = jax.tree.map(
      lambda g: jnp.where(weight != 0, g / safe, 0).astype(_normalize.result_dtype(g)),
      grads,
    )
    value = jnp.where(weight != 0, loss / safe, 0).astype(jnp.result_type(loss))
    return ((value, aux) if has_aux else value), grads

  return reference


def _replicated_batch(
  full: Callable[..., Any], o: _options.Options
) -> Callable[..., Any]:
  """``full`` on the batch replicated over the devices. On Explicit axes a
  batch typed sharded over the data axes makes a model's weight gradient (a
  contraction over the rows) ask for an ``out_sharding`` that an ordinary
  model does not give; the reference is the same numbers either way."""

  def replicated(x):
    spec = _compat.explicit_spec(x)
    if spec is None or all(entry is None for entry in spec):
      return x
    mesh = jax.typeof(x).sharding.mesh
    return jax.sharding.reshard(
      x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    )

  def reference(*args, **kwargs):
    args = tuple(
      jax.tree.map(replicated, a) if n in o.batch_argnums else a
      for n, a in enumerate(args)
    )
    return full(*args, **kwargs)

  return reference


def verify_equivalence(
  fun: Callable[..., Any],
  args: tuple[Any, ...],
  num_micro_batches: int,
  *,
  fun_kwargs: dict[str, Any] | None = None,
  rtol: float | None = None,
  **options: Any,
) -> Deviation:
  """Checks that accumulation over micro-batches equals the full batch.

  Computes ``value_and_grad(fun, num_micro_batches, **options)(*args,
  **fun_kwargs)`` and the full-batch reference (``jax.value_and_grad`` on the
  whole batch, under ``jit``; for ``normalize="weighted"``, the full-batch
  ``loss_sum / weight``), and compares value and gradients leaf by leaf with
  ``chex``. With ``mesh=`` and ``data_axis=`` the accumulated side runs
  data-parallel and the reference is the full batch on the same arrays;
  where the batch is typed sharded (Explicit axes) the reference takes it
  replicated, so that each device holds the whole batch for the check.
  With ``clip_per_example`` the reference is the same function with one
  micro-batch: every example's clipped gradient from one ``vmap`` over the
  whole batch.

  This holds for losses in which examples do not interact. Per-micro-batch
  keys (``rng_argnum``) and threaded state (``state_argnum``) have no
  full-batch counterpart, so they are refused: verify the deterministic path
  (``fun_kwargs={"train": False}``, dropout off), which checks the same
  gradient code.

  Args:
    fun: the loss, as for :func:`jaxaccum.value_and_grad`.
    args: the positional arguments, with the whole batch.
    num_micro_batches: ``k``.
    fun_kwargs: keyword arguments of ``fun`` for both calls, e.g.
      ``{"train": False}``; Python values stay Python values.
    rtol: the tolerance, relative to each leaf's largest magnitude; by default
      ``max(1e-5, 8 * eps)`` of the leaf's dtype (``1e-5`` for float32).
    **options: further arguments of :func:`jaxaccum.value_and_grad`
      (``argnums``, ``batch_argnums``, ``has_aux``, ``normalize``, ``mesh``,
      ...).

  Returns:
    The largest deviations, as a ``Deviation``.

  Raises:
    AssertionError: naming the leaf with the largest deviation, if any leaf
      differs by more than the tolerance.

  >>> import jax.numpy as jnp, jaxaccum
  >>> loss = lambda w, x: jnp.mean(jnp.sin(x * w))
  >>> dev = jaxaccum.verify_equivalence(loss, (jnp.array(0.5), jnp.arange(8.0)), 4)
  >>> dev.grads < 1e-6
  True
  """
  o = _options.create(fun, num_micro_batches, **options)
  if o.rng_argnum is not None:
    raise ValueError(
      f"verify_equivalence compares with one full-batch call; rng_argnum={o.rng_argnum} "
      "has no full-batch counterpart, since each micro-batch draws its own "
      "random numbers. Verify the deterministic path instead: leave rng_argnum "
      'out and pass fun_kwargs={"train": False} (dropout off), or pass a fixed '
      f"key that fun uses alike on any rows, with shared_argnums=({o.rng_argnum},)."
    )
  for name in ("state_argnum", "noise_stats"):
    if getattr(o, name):
      raise ValueError(
        f"verify_equivalence compares with one full-batch call; {name} has "
        "no full-batch counterpart."
      )
  fun_kwargs = dict(fun_kwargs or {})
  o = o.resolve(len(args))
  # Leaves that jax.grad refuses (an Equinox module's) are static on both sides.
  args, fun_kwargs = _static.partition_args(args, o.argnums, fun_kwargs)
  if o.privacy.clip_norm is not None:  # a check, not training: no noise meant
    options = {"clip_without_noise": True, **options}
  accumulated = value_and_grad(fun, num_micro_batches, **options)
  full = _full_batch(_static.combining(fun), o)
  if o.privacy.clip_norm is not None:
    # DP-SGD's full batch: every example's clipped gradient in one vmap.
    whole = {n: v for n, v in options.items() if n != "micro_batch_size"}
    full = value_and_grad(fun, 1, **whole)
  if o.mesh is not None:
    full = _replicated_batch(full, o)
  reference = jax.jit(functools.partial(full, **fun_kwargs))
  (value, grads) = accumulated(*args, **fun_kwargs)
  ref_value, ref_grads = reference(*args)
  if o.has_aux:
    value, ref_value = value[0], ref_value[0]

  pairs = [("value", value, ref_value)] + [
    ("grads" + jax.tree_util.keystr(path), leaf, ref_leaf)
    for (path, leaf), ref_leaf in zip(
      jax.tree_util.tree_leaves_with_path(grads),
      jax.tree.leaves(ref_grads),
      strict=False,
    )
  ]
  rows = [_compare(name, got, want, rtol) for name, got, want in pairs]
  failing = [row for row in rows if not row.ok]
  if failing:
    worst = max(failing, key=lambda row: row.deviation / row.allowed)
    raise AssertionError(
      f"Accumulated and full-batch {worst.name} differ by up to "
      f"{worst.deviation:.3e}, more than the {worst.allowed:.3e} allowed "
      f"({len(failing)} of {len(rows)} leaves differ)."
    )
  worst_grad = max(rows[1:], key=lambda row: row.deviation)
  return Deviation(rows[0].deviation, worst_grad.deviation, worst_grad.name)


class _Row(NamedTuple):
  name: str
  deviation: float  # max |got - want|
  allowed: float  # rtol * max |want|
  ok: bool


def _compare(name: str, got: Any, want: Any, rtol: float | None) -> _Row:
  """Compares one leaf with chex, relative to the leaf's largest magnitude, at
  the precision of the less precise of the two."""
  finfo = max(
    (jnp.finfo(jnp.result_type(x)) for x in (got, want)), key=lambda f: float(f.eps)
  )
  if rtol is None:
    rtol = max(1e-5, 8 * float(finfo.eps))
  got64, want64 = np.asarray(got, np.float64), np.asarray(want, np.float64)
  deviation = float(np.max(np.abs(got64 - want64), initial=0.0))
  allowed = rtol * float(np.max(np.abs(want64), initial=0.0)) + float(finfo.tiny)
  try:
    chex.assert_trees_all_close(got64, want64, rtol=0.0, atol=allowed)
  except AssertionError:
    return _Row(name, deviation, allowed, ok=False)
  return _Row(name, deviation, allowed, ok=True)
