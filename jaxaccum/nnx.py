"""Flax NNX adapter: ``jaxaccum.nnx.value_and_grad(fun, k)(model, batch)``.

The model is split into the differentiated variables (``wrt``, by default
``nnx.Param``) and everything else: BatchNorm statistics, RNG stream counts,
and any other variable. The rest is threaded through the micro-batches as the
engine's state (``state_argnum``), in order, and written back into the model
afterwards. So the result equals running ``nnx.value_and_grad`` eagerly on
each micro-batch in turn and averaging: BatchNorm statistics are updated once
per micro-batch, and every ``nnx.Dropout`` draws a fresh mask per micro-batch,
because its RNG stream advances as it would eagerly.

Inside the scan body the model is rebuilt with ``nnx.merge`` from the body's
own traced values, so no Variable from an outer trace level is touched there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx as flax_nnx

from jaxaccum import _accumulate


def value_and_grad(
  fun: Callable[..., Any],
  num_micro_batches: int | None = None,
  *,
  wrt: Any = flax_nnx.Param,
  has_aux: bool = False,
  normalize: str = "mean",
  micro_batch_size: int | None = None,
  batch_argnums: int | Sequence[int] = 1,
  accum_dtype: Any = jnp.float32,
  remat: bool | Callable[..., Any] = False,
  mesh: Any = None,
  data_axis: str | None = None,
  param_specs: Any = None,
  noise_stats: bool = False,
  value_checks: bool = False,
) -> Callable[..., Any]:
  """Like ``nnx.value_and_grad``, accumulated over micro-batches.

  Args:
    fun: ``fun(model, *args, **kwargs)``: the loss, as for
      :func:`jaxaccum.value_and_grad` (a scalar, ``(loss_sum, weight)`` with
      ``normalize="weighted"``, and ``(value, aux)`` with ``has_aux``).
    num_micro_batches: ``k``; give this or ``micro_batch_size``.
    wrt: an ``nnx`` filter of the variables to differentiate.
    has_aux: ``fun`` returns ``(value, aux)``; aux comes back stacked.
    normalize: ``"mean"``, ``"sum"`` or ``"weighted"``.
    micro_batch_size: ``m``, the rows per micro-batch.
    batch_argnums: the positions in ``fun``'s arguments of the batch
      (the model is position 0, so the default 1 is the first after it).
    accum_dtype: the dtype of the sums; float32 by default.
    remat: as in :func:`jaxaccum.value_and_grad`.
    mesh, data_axis, param_specs: the data-parallel path, as in
      :func:`jaxaccum.value_and_grad`; ``param_specs`` mirrors the ``wrt``
      state.
    noise_stats: also return the :class:`jaxaccum.GradientNoise`, as in
      :func:`jaxaccum.value_and_grad`: the result is then
      ``(output, noise)``.
    value_checks: as in :func:`jaxaccum.value_and_grad`.

  Returns:
    A function ``(model, *args, **kwargs) -> (value, grads)`` (or
    ``((value, aux), grads)``), where ``grads`` is an ``nnx.State`` of the
    ``wrt`` variables that ``nnx.Optimizer.update`` accepts. The model's other
    variables are updated in place, as after ``k`` eager calls.

  >>> import jax.numpy as jnp, optax, jaxaccum
  >>> from flax import nnx
  >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
  >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  >>> def loss(model, batch):
  ...   x, y = batch
  ...   return jnp.mean((model(x)[:, 0] - y) ** 2)
  >>> @nnx.jit
  ... def train_step(model, optimizer, batch):
  ...   value, grads = jaxaccum.nnx.value_and_grad(loss, 4)(model, batch)
  ...   optimizer.update(model, grads)
  ...   return value
  >>> batch = (jnp.ones((8, 3)), jnp.zeros(8))
  >>> bool(train_step(model, optimizer, batch) > train_step(model, optimizer, batch))
  True
  """
  nums = (batch_argnums,) if isinstance(batch_argnums, int) else tuple(batch_argnums)
  if 0 in nums:
    raise ValueError(f"{batch_argnums=} includes 0, which is the model.")

  def accumulated(model, *args, **kwargs):
    _check_no_nnx_objects(args, kwargs)
    graphdef, params, rest = _split_model(model, wrt)

    def pure(params, rest, *args, **kwargs):
      inner = flax_nnx.merge(graphdef, params, rest, copy=True)
      out = fun(inner, *args, **kwargs)
      value, aux = out if has_aux else (out, None)
      new_rest = _split_model(inner, wrt)[2]
      return value, (aux, new_rest)

    engine_fun = _accumulate.value_and_grad(
      pure,
      num_micro_batches,
      micro_batch_size=micro_batch_size,
      argnums=0,
      batch_argnums=tuple(n + 1 for n in nums),
      has_aux=True,
      normalize=normalize,
      accum_dtype=accum_dtype,
      state_argnum=1,
      remat=remat,
      mesh=mesh,
      data_axis=data_axis,
      param_specs=param_specs,
      noise_stats=noise_stats,
      value_checks=value_checks,
    )
    out = engine_fun(params, rest, *args, **kwargs)
    (value, (aux, new_rest)), grads = out[0] if noise_stats else out
    flax_nnx.update(model, new_rest)
    result = ((value, aux) if has_aux else value), grads
    return (result, out[1]) if noise_stats else result

  return accumulated


def _check_no_nnx_objects(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
  """Only the model's variables are threaded through the micro-batches."""
  is_node = flax_nnx.graph.is_graph_node
  named = {f"argument {n}": a for n, a in enumerate(args, start=1)}
  named.update({f"keyword argument {k!r}": v for k, v in kwargs.items()})
  for name, value in named.items():
    nodes = [x for x in jax.tree.leaves(value, is_leaf=is_node) if is_node(x)]
    if nodes:
      raise ValueError(
        f"The {name} of fun is an nnx object ({type(nodes[0]).__name__}); "
        "jaxaccum.nnx threads the model's state through the micro-batches, "
        "not other nnx objects. Keep RNG streams inside the model (e.g. "
        "nnx.Dropout(0.1, rngs=rngs)), or pass a plain key and use "
        "jaxaccum.value_and_grad with rng_argnum."
      )


def _split_model(model: Any, wrt: Any) -> tuple[Any, Any, Any]:
  """``(graphdef, wrt_state, rest_state)`` of ``model``."""
  parts: tuple[Any, ...] = flax_nnx.split(model, wrt, ...)
  return parts[0], parts[1], parts[2]
