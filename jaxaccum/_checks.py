"""The checks: what the engine verifies about its inputs and its results.

- Trace-time checks of the call's arguments (:func:`check_args`): no nnx
  object where a pytree of arrays belongs, a PRNG key where ``rng_argnum``
  points, no key where the batch belongs. Each names the argument as the
  user numbered it. (A differentiated leaf that is not an array is static,
  not an error: :mod:`jaxaccum._static`.)
- Trace-time checks of what ``fun`` returns (:func:`check_aux`).
- A warning at trace time for an argument that reaches every micro-batch
  whole but looks like it should not: a PRNG key without ``rng_argnum``, or
  an array with the batch's leading size outside ``batch_argnums``
  (:func:`warn_shared_args`, :class:`SharedArgumentWarning`); and a hint when
  ``fun`` fails on a micro-batch while such an argument is there
  (:func:`batch_argnums_hint`).
- Static ``chex`` assertions on shapes and dtypes run inside the engine's
  loop; they cost nothing at run time.
- Value-level checks of the normalization (:func:`check_weights`,
  :func:`check_total_weight`), written with ``checkify.debug_check`` and off
  unless ``value_checks=True``: even as no-ops they would put an effect on
  the step's jaxpr, which takes a jitted step off JAX's fast dispatch path.
"""

from __future__ import annotations

import numbers
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import checkify

from jaxaccum import _tree
from jaxaccum._options import Options

PyTree = Any


class SharedArgumentWarning(UserWarning):
  """An argument that reaches every micro-batch whole looks like it should not.

  jaxaccum warns at trace time about a positional argument outside
  ``batch_argnums``, ``argnums``, ``rng_argnum`` and ``state_argnum`` that is a
  PRNG key (every micro-batch would draw the same random numbers: pass
  ``rng_argnum``) or that has the batch's leading size (a part of the batch
  left unsplit: add it to ``batch_argnums``). For an argument that is meant to
  be shared, pass ``shared_argnums=(n,)`` and jaxaccum says nothing.

  >>> import warnings, jax, jax.numpy as jnp, jaxaccum
  >>> def loss(w, x, key):
  ...   return jnp.mean(x * w * jax.random.uniform(key))
  >>> with warnings.catch_warnings(record=True) as caught:
  ...   warnings.simplefilter("always")
  ...   _ = jaxaccum.grad(loss, 2)(1.0, jnp.ones(4), jax.random.key(0))
  >>> caught[0].category.__name__
  'SharedArgumentWarning'
  """


def check_args(options: Options, args: tuple[Any, ...]) -> None:
  """Trace-time checks of a call's positional arguments."""
  _check_no_nnx_objects(options, args)
  if options.rng_argnum is not None:
    _check_key(options, args[options.rng_argnum])
  for n in options.batch_argnums:
    _check_batch_is_no_key(options, args, n)


def _rng_fix(options: Options, n: int) -> str:
  """How to give each micro-batch its own key, for the user's argument at
  engine position ``n``."""
  if options.names.hidden:  # jaxaccum.nnx: keys come from nnx.Rngs
    return (
      "pass an nnx.Rngs (nnx.Rngs(dropout=key)) instead: its streams advance "
      "once per micro-batch"
    )
  user = n - options.names.offset
  return f"pass rng_argnum={user}: micro-batch i then gets jax.random.fold_in(key, i)"


def _check_batch_is_no_key(options: Options, args: tuple[Any, ...], n: int) -> None:
  """A PRNG key where the batch belongs (``loss(params, key, batch)`` with
  the default ``batch_argnums=1``) is named, with the positions that fit."""
  if not _tree.is_single_key(args[n]):
    return
  offset = options.names.offset
  fits = _batch_like(options, args, exclude=n)
  batch = (
    f"batch_argnums={tuple(p - offset for p in fits)}"
    if fits
    else "batch_argnums= at the batch"
  )
  raise ValueError(
    f"batch_argnums={tuple(p - offset for p in options.batch_argnums)} points "
    f"at {options.names(n)}, a PRNG key, not a batch. Point {batch}, and "
    f"{_rng_fix(options, n)}."
  )


def _batch_like(options: Options, args: tuple[Any, ...], exclude: int) -> list[int]:
  """Positions outside ``argnums`` (and ``exclude``) whose leaves are all
  arrays with one shared leading size: candidates for ``batch_argnums``."""
  fits = []
  for n, arg in enumerate(args):
    if n == exclude or n in options.argnums or n in options.shared_argnums:
      continue
    leaves = jax.tree.leaves(arg)
    arrays = all(
      hasattr(x, "shape") and jnp.ndim(x) > 0 and not _tree.is_key(x) for x in leaves
    )
    if leaves and arrays and len({jnp.shape(x)[0] for x in leaves}) == 1:
      fits.append(n)
  return fits


def _unsplit(options: Options, args: tuple[Any, ...], batch_size: int) -> list[int]:
  """Positions outside every argument list whose leaves all have the batch's
  leading size: likely part of the batch, passed whole."""
  used = set(options.array_argnums) | set(options.shared_argnums)
  return [
    n
    for n, arg in enumerate(args)
    if n not in used
    and (leaves := jax.tree.leaves(arg))
    and all(jnp.ndim(x) > 0 and jnp.shape(x)[0] == batch_size for x in leaves)
  ]


def warn_shared_args(
  options: Options, args: tuple[Any, ...], batch_size: int, total: int
) -> None:
  """Warns (:class:`SharedArgumentWarning`) about arguments that every one
  of ``total`` micro-batches gets whole but that look like they should not:
  a PRNG key without ``rng_argnum``, or arrays with the batch's leading
  size outside ``batch_argnums``. Nothing with one micro-batch in total,
  where sharing changes nothing, or for ``shared_argnums``."""
  if total < 2:
    return
  offset = options.names.offset
  used = set(options.array_argnums) | set(options.shared_argnums)
  for n, arg in enumerate(args):
    if n in used or not _tree.is_single_key(arg):
      continue
    warnings.warn(
      f"jaxaccum: {options.names(n)} is a PRNG key that reaches every "
      f"micro-batch unchanged, so all {total} micro-batches draw the same "
      "random numbers (one dropout mask for all of them). To give each its own, "
      f"{_rng_fix(options, n)}. If one key shared by every micro-batch is "
      f"what you mean, pass shared_argnums=({n - offset},).",
      SharedArgumentWarning,
      stacklevel=2,
    )
  suspects = _unsplit(options, args, batch_size)
  if not suspects:
    return
  batch = tuple(n - offset for n in options.batch_argnums)
  extended = tuple(sorted(batch + tuple(n - offset for n in suspects)))
  shared = tuple(n - offset for n in suspects)
  names = ", ".join(options.names(n) for n in suspects)
  has = "has" if len(suspects) == 1 else "have"
  warnings.warn(
    f"jaxaccum: {names} {has} the batch's leading size {batch_size} but "
    f"{'is' if len(suspects) == 1 else 'are'} not in batch_argnums={batch}, so "
    f"every micro-batch gets all {batch_size} rows of "
    f"{'it' if len(suspects) == 1 else 'them'}. If part of the batch, pass "
    f"batch_argnums={extended}; if meant whole for every micro-batch, pass "
    f"shared_argnums={shared}.",
    SharedArgumentWarning,
    stacklevel=2,
  )


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
        "its other state back; the whole step is jaxaccum.nnx.make_train_step"
        "(fun, optimizer, k), and the check against the full batch "
        "jaxaccum.nnx.verify_equivalence(fun, (model, batch), k)."
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

  Other types are named in full, with their module:

  >>> describe(jax.nn.relu)
  'a jax._src.custom_derivatives.custom_jvp'
  """
  if isinstance(x, (tuple, list)):
    return f"a {type(x).__name__} of length {len(x)}"
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    # A key array's dtype (key<fry>) is no numpy dtype.
    dtype = x.dtype if _tree.is_key(x) else jnp.dtype(x.dtype)
    return f"{_article(dtype.name)} {dtype.name} array of shape={tuple(x.shape)}"
  name = type_name(x)
  return f"{_article(name)} {name}"


def shown(x: Any) -> str:
  """:func:`describe`, with the value's repr where it is short enough to
  read whole (a repr is never cut).

  >>> shown("abc"), shown(jax.nn.relu)
  ("a str ('abc')", 'a jax._src.custom_derivatives.custom_jvp')
  """
  text = repr(x)
  return describe(x) + (f" ({text})" if len(text) <= 40 else "")


def type_name(x: Any) -> str:
  """The name of ``x``'s type, whole: with its module unless a builtin.

  >>> type_name(1.0), type_name(np.float32(1))
  ('float', 'numpy.float32')
  """
  cls = type(x)
  if cls.__module__ == "builtins":
    return cls.__qualname__
  return f"{cls.__module__}.{cls.__qualname__}"


def _article(word: str) -> str:
  """``a`` or ``an``, by how the word starts (``an int``, ``an int32
  array``, ``a float32 array``, ``a uint32 array``).

  >>> [_article(w) for w in ("int", "object", "float32", "uint32")]
  ['an', 'an', 'a', 'a']
  """
  return "an" if word[:1].lower() in "aeio" else "a"


def check_aux(aux: PyTree) -> None:
  """Every leaf of ``fun``'s aux is something the loop can stack."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(aux):
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic, numbers.Number)):
      continue
    raise TypeError(
      f"fun returned aux{jax.tree_util.keystr(path)}, {shown(leaf)}: "
      "jaxaccum stacks the aux of every micro-batch "
      "into arrays, so it holds arrays and numbers only. Return other values "
      "from outside the accumulated function."
    )


def batch_argnums_hint(
  options: Options, args: tuple[Any, ...], batch_size: int
) -> str | None:
  """A note for an error that ``fun`` raised on a micro-batch, when some
  argument outside ``batch_argnums`` has the batch's leading size: it was
  passed whole to every micro-batch, which may be the cause."""
  suspects = _unsplit(options, args, batch_size)
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


def check_number(name: str, value: Any) -> None:
  """A ``TypeError`` unless ``value`` is a real number (not a bool)."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"{name} must be a number, got {value!r}.")
