"""Checks that accumulation is normalized correctly.

Two kinds:

- Value-level checks inside the engine, written with
  ``jax.experimental.checkify.debug_check``. They are off by default: even
  as no-ops they would put an effect on the step's jaxpr, and an effectful
  ``jit`` leaves JAX's fast C++ dispatch path. Switch them on while debugging
  with ``value_and_grad(..., value_checks=True)`` and run the step under
  ``chex.chexify`` (or ``checkify.checkify``).
  (The static, trace-time checks are ``chex`` shape and dtype assertions in
  the engine; they are always on and cost nothing at run time.)
- ``verify_equivalence``: run the accumulated and the full-batch computation
  side by side and raise with the largest deviation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

PyTree = Any


def check_weights(weights: jax.Array) -> None:
  """Every micro-batch weight is finite and non-negative (under chexify)."""
  checkify.debug_check(
    jnp.all(jnp.isfinite(weights) & (weights >= 0)),
    "jaxaccum: micro-batch weights must be finite and >= 0, got {weights}.",
    weights=weights,
  )


def check_total_weight(total: jax.Array, grads: PyTree) -> None:
  """The total weight is positive, or it is zero and handled: zero grads."""
  zero = jnp.all(
    jnp.asarray([jnp.all(g == 0) for g in jax.tree.leaves(grads)] or [True])
  )
  checkify.debug_check(
    (total > 0) | zero,
    "jaxaccum: total weight {total} is not positive, yet the grads are not zero.",
    total=total,
  )


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


def _full_batch(fun, argnums, has_aux, normalize):
  """The reference: ``jax.value_and_grad`` on the whole batch at once."""
  if normalize != "weighted":
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
    safe = jnp.where(weight > 0, weight, 1)
    grads = jax.tree.map(lambda g: jnp.where(weight > 0, g / safe, 0), grads)
    value = jnp.where(weight > 0, loss / safe, 0)
    return ((value, aux) if has_aux else value), grads

  return reference


def verify_equivalence(
  fun: Callable[..., Any],
  args: tuple[Any, ...],
  num_micro_batches: int,
  *,
  rtol: float | None = None,
  **kwargs: Any,
) -> Deviation:
  """Checks that accumulation over micro-batches equals the full batch.

  Computes ``value_and_grad(fun, num_micro_batches, **kwargs)(*args)`` and
  the full-batch reference (``jax.value_and_grad`` on the whole batch; for
  ``normalize="weighted"``, the full-batch ``loss_sum / weight``), and
  compares value and gradients leaf by leaf with ``chex``.

  This holds for losses in which examples do not interact. Per-micro-batch
  keys (``rng_argnum``) and threaded state (``state_argnum``) have no
  full-batch counterpart, so they are refused.

  Args:
    fun: the loss, as for :func:`jaxaccum.value_and_grad`.
    args: the positional arguments, with the whole batch.
    num_micro_batches: ``k``.
    rtol: the tolerance, relative to each leaf's largest magnitude; by default
      ``max(1e-5, 8 * eps)`` of the leaf's dtype (``1e-5`` for float32).
    **kwargs: further arguments of :func:`jaxaccum.value_and_grad`
      (``argnums``, ``batch_argnums``, ``has_aux``, ``normalize``, ...).

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
  from jaxaccum._accumulate import value_and_grad  # noqa: PLC0415 (a cycle)

  for name in ("rng_argnum", "state_argnum", "mesh", "data_axis"):
    if kwargs.get(name) is not None:
      raise ValueError(
        f"verify_equivalence compares with one full-batch call; {name} has "
        "no full-batch counterpart."
      )
  argnums = kwargs.get("argnums", 0)
  has_aux = kwargs.get("has_aux", False)
  normalize = kwargs.get("normalize", "mean")
  accumulated = jax.jit(value_and_grad(fun, num_micro_batches, **kwargs))
  reference = jax.jit(_full_batch(fun, argnums, has_aux, normalize))
  (value, grads), (ref_value, ref_grads) = accumulated(*args), reference(*args)
  if has_aux:
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
  """Compares one leaf with chex, relative to the leaf's largest magnitude."""
  finfo = jnp.finfo(jnp.result_type(want))
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
