"""The checks: what the engine verifies about its inputs and its results.

- Trace-time checks of the call's arguments (:func:`check_args`): no nnx
  object where a pytree of arrays belongs, only arrays and numbers among the
  differentiated leaves, a PRNG key where ``rng_argnum`` points. Each names
  the argument as the user numbered it.
- Trace-time checks of what ``fun`` returns (:func:`check_aux`).
- A hint when ``fun`` fails on a micro-batch while another argument looks
  like a batch that was not split (:func:`batch_argnums_hint`).
- Static ``chex`` assertions on shapes and dtypes run inside the engine's
  loop; they cost nothing at run time.
- Value-level checks of the normalization (:func:`check_weights`,
  :func:`check_total_weight`), written with ``checkify.debug_check`` and off
  unless ``value_checks=True``: even as no-ops they would put an effect on
  the step's jaxpr, which takes a jitted step off JAX's fast dispatch path.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import checkify

from jaxaccum import _tree
from jaxaccum._options import Options

PyTree = Any


def check_args(options: Options, args: tuple[Any, ...]) -> None:
  """Trace-time checks of a call's positional arguments."""
  _check_no_nnx_objects(options, args)
  for n in options.argnums:
    _check_differentiable(args[n], options.names(n))
  if options.rng_argnum is not None:
    _check_key(options, args[options.rng_argnum])


def _check_no_nnx_objects(options: Options, args: tuple[Any, ...]) -> None:
  """An nnx Module or other graph node belongs to ``jaxaccum.nnx``."""
  is_object = lambda x: isinstance(x, nnx.Pytree)  # noqa: E731
  for n, arg in enumerate(args):
    nodes = [x for x in jax.tree.leaves(arg, is_leaf=is_object) if is_object(x)]
    if nodes:
      raise ValueError(
        f"{options.names(n)} is (or holds) an nnx object, {type(nodes[0]).__name__}. "
        "jaxaccum.value_and_grad works on pytrees of arrays; for Flax NNX "
        "models use jaxaccum.nnx.value_and_grad(fun, k)(model, batch), which "
        "splits the model, differentiates its nnx.Param variables and writes "
        "its other state back."
      )


def _check_differentiable(tree: PyTree, name: str) -> None:
  """Every leaf to differentiate is an array or a number, named if not."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic, numbers.Number)):
      continue
    raise TypeError(
      f"{name}{jax.tree_util.keystr(path)} is a {type(leaf).__name__} "
      f"({leaf!r:.40}), not an array: every leaf of a differentiated argument "
      "must be an array or a number. Move it out of the parameters, or pass "
      "it as another argument."
    )


def _check_key(options: Options, key: Any) -> None:
  """``rng_argnum`` points at a PRNG key: a typed key, or a raw ``uint32``
  key (``jax.random.PRNGKey``)."""
  if _tree.is_key(key) or getattr(key, "dtype", None) == jnp.uint32:
    return
  n = options.rng_argnum
  assert n is not None
  raise TypeError(
    f"rng_argnum={n - options.names.offset} points at {options.names(n)}, "
    f"{describe(key)}, not a PRNG key: pass jax.random.key(seed) (or a raw "
    "key from jax.random.PRNGKey), or leave rng_argnum out."
  )


def describe(x: Any) -> str:
  """A short description of a value for an error message.

  >>> describe(jnp.ones(2)), describe("a"), describe((1, 2))
  ('a float32 array of shape=(2,)', 'a str', 'a tuple of length 2')
  """
  if isinstance(x, (tuple, list)):
    return f"a {type(x).__name__} of length {len(x)}"
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return f"a {jnp.dtype(x.dtype).name} array of shape={tuple(x.shape)}"
  return f"a {type(x).__name__}"


def check_aux(aux: PyTree) -> None:
  """Every leaf of ``fun``'s aux is something the loop can stack."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(aux):
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic, numbers.Number)):
      continue
    raise TypeError(
      f"fun returned aux{jax.tree_util.keystr(path)} = {leaf!r:.40}, a "
      f"{type(leaf).__name__}: jaxaccum stacks the aux of every micro-batch "
      "into arrays, so it holds arrays and numbers only. Return other values "
      "from outside the accumulated function."
    )


def batch_argnums_hint(
  options: Options, args: tuple[Any, ...], batch_size: int
) -> str | None:
  """A note for an error that ``fun`` raised on a micro-batch, when some
  argument outside ``batch_argnums`` has the batch's leading size: it was
  passed whole to every micro-batch, which may be the cause."""
  used = set(options.array_argnums)
  suspects = [
    n
    for n, arg in enumerate(args)
    if n not in used
    and (leaves := jax.tree.leaves(arg))
    and all(jnp.ndim(x) > 0 and jnp.shape(x)[0] == batch_size for x in leaves)
  ]
  if not suspects:
    return None
  offset = options.names.offset
  batch = tuple(n - offset for n in options.batch_argnums)
  names = ", ".join(options.names(n) for n in suspects)
  has, was = ("has", "was") if len(suspects) == 1 else ("have", "were")
  return (
    f"jaxaccum splits only batch_argnums={batch}; {names} also {has} the "
    f"batch's leading size {batch_size} and {was} passed whole to every "
    f"micro-batch. Did you mean batch_argnums={tuple(sorted(batch + tuple(n - offset for n in suspects)))}?"
  )


def check_weights(weights: jax.Array) -> None:
  """Every micro-batch weight is finite and non-negative (under checkify)."""
  checkify.debug_check(
    jnp.all(jnp.isfinite(weights) & (weights >= 0)),
    "jaxaccum: micro-batch weights must be finite and >= 0, got {weights}.",
    weights=weights,
  )


def check_total_weight(total: jax.Array, grad_sums: PyTree) -> None:
  """The total weight is positive, or the summed gradients are zero (under
  checkify).

  ``grad_sums`` are the gradients before normalization. A zero total weight
  under a loss sum that still depends on the parameters means the weights and
  the loss disagree (a mask applied to one and not the other); the zero
  result would hide that.
  """
  zero = jnp.all(
    jnp.asarray([jnp.all(g == 0) for g in jax.tree.leaves(grad_sums)] or [True])
  )
  checkify.debug_check(
    (total > 0) | zero,
    "jaxaccum: total weight {total} is not positive, yet the summed gradient is "
    "not zero: the weights count no rows that the loss sums over.",
    total=total,
  )
