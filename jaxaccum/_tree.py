"""The tree toolkit: the few pytree operations every part of jaxaccum needs.

One definition each, so that the engine, ``accumulate``, ``make_train_step``
and the data-parallel path agree:

- :func:`all_finite`: whether every leaf is finite;
- :func:`is_key`, :func:`fold_in`: typed PRNG keys, and folding an index into
  every key of a tree (arrays of keys included);
- :func:`cast_like`: a tree given the dtypes of another, with one weak-type
  rule (the result is never weakly typed);
- :func:`check_dtypes_kept`: a returned state keeps its dtypes, as a scan
  carry must;
- :func:`select`: ``jnp.where`` over trees that also selects keys and keeps
  the new value's sharding;
- :func:`sq_norm`: the squared L2 norm, accumulated in float32.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

PyTree = Any


def all_finite(tree: PyTree) -> jax.Array:
  """Whether every leaf of ``tree`` is finite; a scalar bool (True if empty).

  >>> import jax.numpy as jnp
  >>> bool(all_finite({"a": jnp.ones(2), "b": jnp.array(jnp.nan)}))
  False
  >>> bool(all_finite({}))
  True
  """
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  return jnp.all(jnp.asarray(leaves)) if leaves else jnp.asarray(True)


def is_key(x: Any) -> bool:
  """Whether ``x`` is a typed PRNG key, or an array of them (``jax.random.key``;
  a raw ``uint32`` key is an integer array).

  >>> is_key(jax.random.key(0)), is_key(jax.random.PRNGKey(0))
  (True, False)
  """
  dtype = getattr(x, "dtype", None)  # a str is no key (result_type reads it as a dtype)
  return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def is_single_key(x: Any) -> bool:
  """Whether ``x`` is one PRNG key: a typed key (``jax.random.key``) or a raw
  ``uint32`` key (``jax.random.PRNGKey``): ``uint32[2]``, or the raw shape
  of the default generator's keys (``uint32[4]`` under ``"unsafe_rbg"``).

  >>> is_single_key(jax.random.key(0)), is_single_key(jax.random.PRNGKey(0))
  (True, True)
  >>> is_single_key(jnp.zeros(2)), is_single_key(jax.random.split(jax.random.key(0)))
  (False, False)
  """
  if is_key(x):
    return jnp.ndim(x) == 0
  dtype = getattr(x, "dtype", None)
  if dtype is None or dtype != jnp.uint32:
    return False
  raw = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape
  return jnp.shape(x) in {(2,), tuple(raw)}


def fold_in(tree: PyTree, index: jax.Array | int) -> PyTree:
  """``jax.random.fold_in(key, index)`` for every typed key (or array of keys)
  in ``tree``; other leaves are returned as they are.

  >>> keys = fold_in({"k": jax.random.key(0), "x": 1.0}, 3)
  >>> bool((jax.random.key_data(keys["k"]) == jax.random.key_data(jax.random.fold_in(jax.random.key(0), 3))).all())
  True
  """

  def fold(x):
    if not is_key(x):
      return x
    fun = jax.random.fold_in
    for _ in range(jnp.ndim(x)):
      fun = jax.vmap(fun, in_axes=(0, None))
    return fun(x, index)

  return jax.tree.map(fold, tree)


def cast_like(tree: PyTree, like: PyTree) -> PyTree:
  """``tree`` with the dtypes of ``like`` (arrays or ``jax.ShapeDtypeStruct``s),
  never weakly typed: a value fed back into a jitted function with another
  weak type would compile it again. A leaf that already has its dtype and no
  weak type is returned as it is; keys are never cast.

  >>> import jax.numpy as jnp
  >>> out = cast_like({"n": 1}, {"n": jnp.zeros((), jnp.int32)})
  >>> out["n"].dtype, jax.typeof(out["n"]).weak_type
  (dtype('int32'), False)
  """

  def cast(x, target):
    if is_key(x):
      return x
    x = jnp.asarray(x)
    dtype = jnp.dtype(target.dtype)
    if x.dtype == dtype and not jax.typeof(x).weak_type:
      return x
    return jax.lax.convert_element_type(x, dtype)

  return jax.tree.map(cast, tree, like)


def check_dtypes_kept(new: PyTree, old: PyTree, name: str) -> None:
  """Raises a ``ValueError`` naming the leaf where ``new`` changed ``old``'s
  dtype. A weakly typed leaf (a Python number, or an expression of one) may
  take ``old``'s dtype where JAX's promotion would give it that dtype (``0``
  into float32), as in a ``lax.scan`` carry.

  >>> import jax.numpy as jnp
  >>> check_dtypes_kept({"n": 0}, {"n": jnp.zeros(())}, "state")
  >>> check_dtypes_kept({"n": jnp.zeros((), jnp.int32) + 0.5}, {"n": jnp.zeros((), jnp.int32)}, "state")
  Traceback (most recent call last):
  ValueError: fun returned the state leaf state['n'] as float32, but it came in as int32: a threaded state keeps its dtype (a lax.scan carry must). Cast it back yourself, e.g. new.astype(old.dtype), if that is what you mean.
  """
  old_leaves = jax.tree.leaves(old)
  for (path, x), y in zip(
    jax.tree_util.tree_leaves_with_path(new), old_leaves, strict=True
  ):
    have, want = jnp.result_type(x), jnp.result_type(y)
    if have == want:
      continue
    weak = not hasattr(x, "dtype") or jax.typeof(x).weak_type
    if weak and not is_key(x) and jnp.result_type(x, y) == want:
      continue
    raise ValueError(
      f"fun returned the state leaf {name}{jax.tree_util.keystr(path)} as "
      f"{jnp.dtype(have).name}, but it came in as {jnp.dtype(want).name}: a "
      "threaded state keeps its dtype (a lax.scan carry must). Cast it back "
      "yourself, e.g. new.astype(old.dtype), if that is what you mean."
    )


def select(pred: jax.Array, new: PyTree, old: PyTree) -> PyTree:
  """``new`` where ``pred``, else ``old``, leaf by leaf (typed keys too), and
  laid out like ``new`` (on an Explicit mesh a
  leaf of ``old`` with another sharding is resharded first). Masks select,
  they never multiply: ``0 * nan`` is ``nan``.

  >>> import jax.numpy as jnp
  >>> select(jnp.array(False), {"a": jnp.ones(2)}, {"a": jnp.zeros(2)})["a"].tolist()
  [0.0, 0.0]
  """

  def one(new, old):
    new_sharding = jax.typeof(new).sharding
    if jax.typeof(old).sharding != new_sharding:
      old = jax.sharding.reshard(old, new_sharding)
    return jnp.where(pred, new, old)

  return jax.tree.map(one, new, old)


def sq_norm(tree: PyTree) -> jax.Array:
  """The squared L2 norm of a pytree, accumulated in float32.

  >>> import jax.numpy as jnp
  >>> float(sq_norm({"a": jnp.array([3.0]), "b": jnp.array([[4.0]])}))
  25.0
  """
  return sum(
    (jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)),
    start=jnp.zeros((), jnp.float32),
  )
