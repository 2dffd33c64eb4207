"""Flax NNX adapter: ``jaxaccum.nnx.value_and_grad(fun, k)(model, batch)``.

Every argument of ``fun`` that holds nnx objects (a Module, ``nnx.Rngs``, an
``nnx.State``, a tuple of modules) is split into its variables. For the
differentiated arguments (``argnums``, by default the model at position 0)
those are the ``wrt`` variables (``nnx.Param``) and the rest; the rest, and
every variable of the other nnx arguments (a teacher model for distillation,
say), is threaded through the micro-batches as the engine's state
(``state_argnum``), in order, and written back into the objects afterwards.
So the result equals running ``nnx.value_and_grad`` eagerly on each
micro-batch in turn and averaging: BatchNorm statistics are updated once per
micro-batch, and every ``nnx.Dropout`` draws a fresh mask per micro-batch,
because its RNG stream advances as it would eagerly.

Inside the scan body the objects are rebuilt with ``nnx.merge`` from the
body's own traced values, so no Variable from an outer trace level is touched
there.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx as flax_nnx

from jaxaccum import _accumulate


def _holds_nnx(x: Any) -> bool:
  """Whether ``x`` is, or holds, an nnx object or variable."""
  is_node = flax_nnx.graph.is_graph_node
  if isinstance(x, flax_nnx.State):
    return True
  return any(is_node(leaf) for leaf in jax.tree.leaves(x, is_leaf=is_node))


class _Arg(NamedTuple):
  """How one argument of ``fun`` reaches the engine.

  Attributes:
    graphdef: the nnx structure to merge with (None for a plain argument).
    differentiated: whether the argument is in ``argnums``.
  """

  graphdef: Any
  differentiated: bool


def value_and_grad(
  fun: Callable[..., Any],
  num_micro_batches: int | None = None,
  *,
  argnums: int | Sequence[int] = 0,
  wrt: Any = flax_nnx.Param,
  has_aux: bool = False,
  normalize: str = "mean",
  micro_batch_size: int | None = None,
  batch_argnums: int | Sequence[int] = 1,
  accum_dtype: Any = jnp.float32,
  remat: bool | Callable[..., Any] = False,
  mesh: Any = None,
  data_axis: str | tuple[str, ...] | None = None,
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
    argnums: the argument(s) to differentiate, nnx objects (their ``wrt``
      variables) or pytrees of arrays. Other arguments that hold nnx objects
      (a teacher model, ``nnx.Rngs``, an ``nnx.State``) are not
      differentiated; their variables are threaded through the micro-batches
      and written back, like the non-``wrt`` variables of the model.
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
      state (a tuple of them for a tuple ``argnums``), e.g.
      ``nnx.get_partition_spec(nnx.state(model, nnx.Param))``.
    noise_stats: also return the :class:`jaxaccum.GradientNoise`, as in
      :func:`jaxaccum.value_and_grad`: the result is then
      ``(output, noise)``.
    value_checks: as in :func:`jaxaccum.value_and_grad`.

  Returns:
    A function ``(*args, **kwargs) -> (value, grads)`` (or
    ``((value, aux), grads)``), where ``grads`` is an ``nnx.State`` of the
    ``wrt`` variables that ``nnx.Optimizer.update`` accepts (a tuple of them
    for a tuple ``argnums``). The objects' other variables are updated in
    place, as after ``k`` eager calls.

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
  diff_nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
  nums = (batch_argnums,) if isinstance(batch_argnums, int) else tuple(batch_argnums)
  if set(nums) & set(diff_nums):
    raise ValueError(
      f"{batch_argnums=} overlaps {argnums=}: the differentiated arguments "
      "(the model, by default 0) are not split."
    )
  specs = param_specs
  if param_specs is not None and isinstance(argnums, int):
    specs = (param_specs,)

  engines: dict[Any, Callable[..., Any]] = {}

  def engine_for(layout: tuple[_Arg | None, ...]) -> Callable[..., Any]:
    """The engine's value_and_grad for one layout of arguments, built once."""
    try:
      engine_fun = engines.get(layout)
    except TypeError:  # an unhashable graph: build for this call
      engine_fun = None
    if engine_fun is None:
      engine_fun = _accumulate.value_and_grad(
        _pure(fun, layout, wrt, has_aux),
        num_micro_batches,
        micro_batch_size=micro_batch_size,
        argnums=0,
        batch_argnums=tuple(n + 2 for n in nums),
        has_aux=True,
        normalize=normalize,
        accum_dtype=accum_dtype,
        state_argnum=1,
        remat=remat,
        mesh=mesh,
        data_axis=data_axis,
        param_specs=specs,
        noise_stats=noise_stats,
        value_checks=value_checks,
      )
      with contextlib.suppress(TypeError):  # unhashable: not kept
        engines[layout] = engine_fun
    return engine_fun

  def accumulated(*args, **kwargs):
    if max(diff_nums + nums) >= len(args):
      raise ValueError(
        f"fun was called with {len(args)} positional arguments, but "
        f"argnums={argnums} and batch_argnums={batch_argnums} refer to more."
      )
    _check_batch_is_plain(args, nums)
    layout: list[_Arg | None] = []
    diff_states: list[Any] = []
    threaded: list[Any] = []
    plain: list[Any] = []
    for n, arg in enumerate(args):
      differentiated = n in diff_nums
      plain.append(None if differentiated or _holds_nnx(arg) else arg)
      if not _holds_nnx(arg):
        layout.append(_Arg(None, True) if differentiated else None)
        if differentiated:
          diff_states.append(arg)
          threaded.append(None)
        continue
      if differentiated:
        parts: tuple[Any, ...] = flax_nnx.split(arg, wrt, ...)
        graphdef, diff_state, rest = parts
        diff_states.append(diff_state)
      else:
        graphdef, rest = flax_nnx.split(arg)
      layout.append(_Arg(graphdef, differentiated))
      threaded.append(rest)
    out = engine_for(tuple(layout))(tuple(diff_states), threaded, *plain, **kwargs)
    (value, (aux, new_threaded)), grads = out[0] if noise_stats else out
    _write_back(args, layout, new_threaded)
    grads = grads[0] if isinstance(argnums, int) else tuple(grads)
    result = ((value, aux) if has_aux else value), grads
    return (result, out[1]) if noise_stats else result

  return accumulated


def _pure(
  fun: Callable[..., Any], layout: tuple[_Arg | None, ...], wrt: Any, has_aux: bool
) -> Callable[..., Any]:
  """``fun`` on states: ``pure(diff_states, threaded, *plain_args, **kwargs)``
  rebuilds the nnx objects, calls ``fun`` and returns ``(value, (aux,
  new_threaded))``, the threaded states as ``fun`` left them."""

  def pure(diff_states, threaded, *plain_args, **kwargs):
    diffs, states = iter(diff_states), iter(threaded)
    objects: list[tuple[Any, bool] | None] = []
    call_args = []
    for arg_layout, plain_arg in zip(layout, plain_args, strict=True):
      if arg_layout is None:
        call_args.append(plain_arg)
        continue
      if arg_layout.graphdef is None:  # a differentiated plain pytree
        call_args.append(next(diffs))
        next(states)
        objects.append(None)
        continue
      parts = (next(diffs),) if arg_layout.differentiated else ()
      obj = flax_nnx.merge(arg_layout.graphdef, *parts, next(states), copy=True)
      objects.append((obj, arg_layout.differentiated))
      call_args.append(obj)
    out = fun(*call_args, **kwargs)
    value, aux = out if has_aux else (out, None)
    return value, (aux, [_rest(entry, wrt) for entry in objects])

  return pure


def _rest(entry: tuple[Any, bool] | None, wrt: Any) -> Any:
  """The threaded state of a rebuilt object: all but ``wrt`` if it was
  differentiated, else all of it."""
  if entry is None:
    return None
  obj, differentiated = entry
  parts: tuple[Any, ...] = (
    flax_nnx.split(obj, wrt, ...) if differentiated else flax_nnx.split(obj)
  )
  return parts[-1]


def _write_back(
  args: tuple[Any, ...], layout: list[_Arg | None], new_threaded: list[Any]
):
  """Updates the nnx objects in place with the state the last micro-batch left."""
  states = iter(new_threaded)
  for arg, arg_layout in zip(args, layout, strict=True):
    if arg_layout is None:
      continue
    state = next(states)
    if arg_layout.graphdef is not None and state is not None:
      flax_nnx.update(arg, state)


def _check_batch_is_plain(args: tuple[Any, ...], nums: tuple[int, ...]) -> None:
  for n in nums:
    if _holds_nnx(args[n]):
      raise ValueError(
        f"The batch argument {n} holds an nnx object; the batch must be a "
        "pytree of arrays to split into micro-batches."
      )


def grad(
  fun: Callable[..., Any],
  num_micro_batches: int | None = None,
  **kwargs: Any,
) -> Callable[..., Any]:
  """Like ``nnx.grad``, accumulated over micro-batches; see ``value_and_grad``.

  Returns ``grads``, or ``(grads, aux)`` with ``has_aux=True``; with
  ``noise_stats=True``, ``(that, noise)``.

  >>> import jax.numpy as jnp, jaxaccum
  >>> from flax import nnx
  >>> model = nnx.Linear(2, 1, use_bias=False, rngs=nnx.Rngs(0))
  >>> model.kernel[...] = jnp.ones((2, 1))
  >>> loss = lambda model, x: jnp.mean(model(x) ** 2)
  >>> grads = jaxaccum.nnx.grad(loss, 2)(model, jnp.ones((4, 2)))
  >>> grads["kernel"][...].ravel().tolist()  # d/dw mean((x.w)^2) = 2 (x.w) x
  [4.0, 4.0]
  """
  value_and_grad_fun = value_and_grad(fun, num_micro_batches, **kwargs)
  has_aux = kwargs.get("has_aux", False)
  noise_stats = kwargs.get("noise_stats", False)

  @functools.wraps(fun)
  def accumulated_grad(*args, **call_kwargs):
    out = value_and_grad_fun(*args, **call_kwargs)
    value, grads = out[0] if noise_stats else out
    result = (grads, value[1]) if has_aux else grads
    return (result, out[1]) if noise_stats else result

  return accumulated_grad
