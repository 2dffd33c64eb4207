"""Differentiated arguments that hold leaves ``jax.grad`` refuses.

An Equinox module keeps its activation function (a ``custom_jvp``), its
flags (``Dropout.inference``, a bool) and its sizes among its pytree leaves.
``jax.grad`` refuses such a tree; ``eqx.filter_value_and_grad`` splits it
into its floating-point arrays, which it differentiates, and the rest, which
it passes through unchanged and gives no gradient (``None`` in the grads).
jaxaccum does the same, with one general rule and without importing Equinox:

- a differentiated argument whose every leaf ``jax.grad`` takes (floating-point
  arrays, Python floats) is differentiated as ``jax.grad`` does: nothing
  changes for a pytree of arrays;
- one that holds any other leaf (a function, a bool, an int, an integer
  array) is partitioned as Equinox's ``is_inexact_array`` filter does: its
  floating-point arrays are differentiated, and every other leaf, Python
  floats included, is static, with ``None`` as its gradient.

The public entry points partition at the call (:func:`partition`) and hand
the static rest to ``fun`` by keyword (:data:`KEYWORD`), where
:func:`combining` puts it back: keyword arguments reach every micro-batch
unchanged, their arrays traced and their other values static.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxaccum import _compat

PyTree = Any

# The keyword under which the static rest of the differentiated arguments
# reaches ``fun``'s wrapper (:func:`combining`); ``fun`` never sees it.
KEYWORD = "_jaxaccum_static_leaves"


def is_inexact_array(x: Any) -> bool:
  """Whether ``x`` is a floating-point (or complex) array: what is
  differentiated in a partitioned argument (Equinox's ``is_inexact_array``).

  >>> import jax.numpy as jnp
  >>> is_inexact_array(jnp.ones(2, jnp.bfloat16)), is_inexact_array(jnp.arange(2))
  (True, False)
  >>> is_inexact_array(1.0), is_inexact_array(jax.ShapeDtypeStruct((2,), jnp.float32))
  (False, True)
  """
  # jnp's dtype lattice: bfloat16 and float8 are no numpy floats. A
  # ShapeDtypeStruct stands for an array where a step is only lowered.
  arrays = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)
  return isinstance(x, arrays) and _inexact(x.dtype)


@functools.cache
def _inexact(dtype: Any) -> bool:
  """``jnp.issubdtype(dtype, jnp.inexact)`` (or an extended dtype that is
  its own tangent dtype, Flax's ``fm32``), once per dtype: a partition asks
  it of every leaf, and JAX's answer costs far more than a lookup."""
  return bool(jnp.issubdtype(dtype, jnp.inexact)) or _compat.differentiable_extended(
    dtype
  )


def _jax_takes(x: Any) -> bool:
  """Whether ``jax.grad`` differentiates the leaf ``x`` as it is."""
  return is_inexact_array(x) or (
    isinstance(x, (float, complex)) and not isinstance(x, bool)
  )


def partition(tree: PyTree) -> tuple[PyTree, PyTree]:
  """``(diff, rest)``: ``tree`` unchanged and None when ``jax.grad`` takes
  every leaf; otherwise its floating-point arrays (None elsewhere) and its
  other leaves (None where the arrays are), as ``eqx.partition(tree,
  eqx.is_inexact_array)`` gives them.

  >>> import jax.numpy as jnp
  >>> partition({"w": jnp.ones(2), "scale": 2.0})[1] is None
  True
  >>> diff, rest = partition({"w": jnp.ones(2), "act": abs, "n": 3})
  >>> diff["act"], rest["w"], rest["act"], rest["n"]
  (None, None, <built-in function abs>, 3)
  """
  if all(map(_jax_takes, jax.tree.leaves(tree))):
    return tree, None
  diff = jax.tree.map(lambda x: x if is_inexact_array(x) else None, tree)
  rest = jax.tree.map(lambda x: None if is_inexact_array(x) else x, tree)
  return diff, rest


def combine(diff: PyTree, rest: PyTree) -> PyTree:
  """The tree that :func:`partition` split, put back together.

  >>> import jax.numpy as jnp
  >>> tree = {"w": jnp.ones(2), "act": abs}
  >>> combine(*partition(tree))["act"]
  <built-in function abs>
  """
  if rest is None:
    return diff
  return jax.tree.map(
    lambda d, r: r if d is None else d, diff, rest, is_leaf=lambda x: x is None
  )


def _leaves(tree: PyTree) -> str:
  """The first leaves of ``tree`` as ``int32[8, 5]``, for a message."""
  leaves = jax.tree.leaves(tree)
  shown = [
    f"{jnp.dtype(x.dtype).name}{list(x.shape)}" if hasattr(x, "dtype") else repr(x)
    for x in leaves[:3]
  ]
  return ", ".join(shown) + (", ..." if len(leaves) > 3 else "")


def check_differentiable(
  args: Sequence[Any],
  argnums: Sequence[int],
  batch_argnums: Sequence[int],
  names: Callable[[int], str] = "args[{}]".format,
) -> None:
  """Refuses differentiated arguments with leaves of which none is
  differentiated (integer arrays only, as the batch of tokens is when
  ``fun(params, batch)`` is called ``(batch, params)``): ``jax.grad`` refuses
  an integer array, and partitioned as Equinox does it would give no
  gradient at all, silently.

  >>> check_differentiable((jnp.ones(2), jnp.arange(4)), (0,), (1,))
  >>> check_differentiable((jnp.arange(4), jnp.ones((4, 2))), (0,), (1,))
  Traceback (most recent call last):
  ValueError: argnums=0 differentiates args[0], which holds no floating-point array: int32[4]; there is no gradient to take (jax.grad refuses integers). Are the parameters and the batch swapped? The batch, split along its leading axis, is args[1] (batch_argnums=1): float32[4, 2]. Pass (params, batch), or set argnums= and batch_argnums=.
  """
  trees = [args[n] for n in argnums]
  if not jax.tree.leaves(trees) or jax.tree.leaves([partition(t)[0] for t in trees]):
    return
  name = lambda ns: ns[0] if len(ns) == 1 else tuple(ns)  # noqa: E731
  where = lambda ns: ", ".join(map(names, ns))  # noqa: E731
  raise ValueError(
    f"argnums={name(argnums)} differentiates {where(argnums)}, which holds no "
    f"floating-point array: {_leaves(trees)}; there is no gradient to take "
    "(jax.grad refuses integers). Are the parameters and the batch swapped? "
    f"The batch, split along its leading axis, is {where(batch_argnums)} "
    f"(batch_argnums={name(batch_argnums)}): "
    f"{_leaves([args[n] for n in batch_argnums])}. Pass (params, batch), or "
    "set argnums= and batch_argnums=."
  )


def partition_args(
  args: Sequence[Any], argnums: Sequence[int], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
  """The positional and keyword arguments of one call, each differentiated
  argument partitioned: its differentiable part in its place, the static
  rests under :data:`KEYWORD` (nothing added when nothing is static)."""
  parts = {n: partition(args[n]) for n in argnums}
  if all(rest is None for _, rest in parts.values()):
    return tuple(args), kwargs
  args = tuple(parts[n][0] if n in parts else a for n, a in enumerate(args))
  return args, {**kwargs, KEYWORD: {n: rest for n, (_, rest) in parts.items()}}


def combining(fun: Callable[..., Any]) -> Callable[..., Any]:
  """``fun``, called with the differentiated arguments put back together
  from their parts (:func:`partition_args`)."""

  @functools.wraps(fun)
  def combined(*args: Any, **kwargs: Any) -> Any:
    rests = kwargs.pop(KEYWORD, None)
    if rests is not None:
      args = tuple(
        combine(a, rests[n]) if n in rests else a for n, a in enumerate(args)
      )
    return fun(*args, **kwargs)

  return combined
