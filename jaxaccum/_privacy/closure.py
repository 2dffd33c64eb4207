"""Arrays that ``fun`` closes over, read from the jaxpr a clipped step traces.

Under ``clip_per_example`` every array argument of the step is accounted for:
differentiated, split (``batch_argnums``), the key, or declared public
(``public_argnums``). An array that ``fun`` reaches without being passed
escapes that rule: a loss defined inside the user's ``jax.jit`` may close
over the traced batch itself (a BatchNorm over the batch's mean and std,
in-batch contrastive negatives), and every example's loss then reads every
example. In the check that found it (issue 44), one removed example moved
such a clipped sum by 14 C at B = 16, where the bound is C.

``jax.make_jaxpr`` inside an enclosing trace turns such an array into a
*const* of the closed jaxpr that is a tracer of the enclosing trace, while
the step's own arrays are the jaxpr's inputs. :func:`trace` traces once,
with every array argument an input, and :func:`refuse_traced_consts` refuses
any const that is still a tracer, except those jaxaccum itself closed ``fun``
over (its own keyword arguments: a loss scale, an Equinox module's static
leaves). A concrete array (a constant, or parameters closed over outside
``jit``) is a const too, and is allowed: it is fixed before the step sees any
example. The callers evaluate the jaxpr they checked, so that ``fun`` is
traced once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxaccum import _compat


def is_array(x: Any) -> bool:
  """An array leaf that a traced function takes as an input (a jax array or a
  tracer, a numpy array or scalar); other leaves (Python values) stay
  closed over, static."""
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def trace(
  fun: Callable[..., Any], args: Sequence[Any], closed_over: Sequence[Any] = ()
) -> tuple[Any, Any, list[Any]]:
  """``fun(*args)`` traced once, its array leaves the jaxpr's inputs.

  Returns ``(closed, out_tree, inputs)``: the ``ClosedJaxpr``, the treedef
  of ``fun``'s output, and the arrays to evaluate it on
  (``jax.extend.core.jaxpr_as_fun(closed)(*inputs)`` is ``fun(*args)``'s
  leaves). Raises :func:`refuse_traced_consts`'s ``ValueError`` where
  ``fun`` closes over a tracer that is not among ``closed_over``.
  """
  leaves, treedef = jax.tree.flatten(list(args))
  dynamic = [i for i, x in enumerate(leaves) if is_array(x)]

  def flat(*inputs):
    full = list(leaves)
    for i, x in zip(dynamic, inputs, strict=True):
      full[i] = x
    return fun(*jax.tree.unflatten(treedef, full))

  inputs = [leaves[i] for i in dynamic]
  closed, shape = jax.make_jaxpr(flat, return_shape=True)(*inputs)
  refuse_traced_consts(closed, closed_over)
  return closed, jax.tree.structure(shape), inputs


def refuse_traced_consts(closed: Any, closed_over: Sequence[Any] = ()) -> None:
  """A ``ValueError`` naming the consts of ``closed`` that are tracers of an
  enclosing trace, other than the arrays in ``closed_over`` (compared by
  identity: jaxaccum's own)."""
  own = {id(x) for x in closed_over}
  found = [c for c in closed.consts if _compat.is_tracer(c) and id(c) not in own]
  if not found:
    return
  described = [f"shape={tuple(c.shape)} and dtype={c.dtype}" for c in found]
  what = (
    f"an array of {described[0]}"
    if len(found) == 1
    else f"{len(found)} arrays ({'; '.join(described)})"
  )
  raise ValueError(
    f"With clip_per_example, fun closes over {what} that an enclosing "
    "transformation traces (a jax.jit, nnx.jit or eqx.filter_jit around the "
    "step): it is not an argument of the step, so jaxaccum cannot see where it "
    "came from, and it may hold other examples (the batch itself, a statistic "
    "of it such as a BatchNorm's mean in training mode, in-batch negatives). "
    "Every example's loss would read them, each example's clip would no longer "
    "bound its effect on the update, and the privacy guarantee would be void. "
    "Pass it to the step as an argument instead: declare it with "
    "public_argnums= if it depends on no example (a learning-rate schedule's "
    "value, a frozen table; a key goes by rng_argnum=), or make it part of the "
    "batch (batch_argnums=) if it holds examples, so that each example sees "
    "only its own row. Constants are allowed: a concrete array, or parameters "
    "closed over outside jit. (An array computed inside the jit is traced even "
    "where it depends on no example, a positional table made there, say: "
    "compute it outside the jit, or pass it with public_argnums=.)"
  )
