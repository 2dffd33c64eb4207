"""nnx objects as the engine's arguments, for :mod:`jaxaccum.nnx`.

Each argument of ``fun`` that holds nnx objects is split into its variables
(:func:`_split_args`): the differentiated ones (``wrt``) and the rest, which
the engine threads through the micro-batches as its state. Inside the loop
the objects are rebuilt from the loop's own traced values (:func:`_pure`),
and after it the state the last micro-batch left is written back into them
(:func:`_write_back`). :func:`accumulated_results` is the step that does it
all.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from flax import nnx as flax_nnx

from jaxaccum import _engine, _options, _privacy, _value_and_grad


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


# The engine's arguments: (the differentiated states, the threaded states,
# *fun's arguments with None where an nnx object was). Errors name these two
# as follows, and fun's own arguments as the user numbered them.
_HIDDEN = ((0, "the differentiated nnx variables"), (1, "the threaded nnx variables"))


def accumulated_results(
  fun: Callable[..., Any], options: _options.Options, wrt: Any
) -> Callable[..., tuple[_engine.Result, _options.Options]]:
  """``run(*args, **kwargs) -> (result, user_options)``: the accumulated
  step on ``fun``'s arguments, the nnx objects' other variables written
  back, and the :class:`~jaxaccum._engine.Result` with the user's aux and the
  grads as ``nnx.State`` s, before it is arranged for the caller."""
  steps: dict[Any, _value_and_grad.Step] = {}

  def step_for(user: _options.Options, layout: tuple[_Arg | None, ...]):
    """The engine's step for one layout of arguments, built once."""
    key = (len(layout), layout)
    try:
      step = steps.get(key)
    except TypeError:  # an unhashable graph: build for this call
      step = None
    if step is None:
      specs = user.param_specs
      if specs is not None and user.tree_grads:
        specs = (specs,)
      parallel = user.parallel
      if specs is not None:
        parallel = dataclasses.replace(parallel, param_specs=specs)
      engine_options = user.shifted(2, hidden=_HIDDEN).replace(
        argnums=(0,), state_argnum=1, has_aux=True, parallel=parallel
      )
      step = _value_and_grad.Step(
        _pure(fun, layout, wrt, options.has_aux), engine_options
      )
      with contextlib.suppress(TypeError):  # unhashable: not kept
        steps[key] = step
    return step

  def run(*args, **kwargs):
    user = options.resolve(len(args))
    _check_batch_is_plain(args, user)
    _check_public_objects(args, user)
    layout, diff_states, threaded, plain = _split_args(args, user, wrt)
    result = step_for(user, layout)(tuple(diff_states), threaded, *plain, **kwargs)
    aux, new_threaded = result.aux
    _write_back(args, layout, new_threaded)
    sums = result.sums
    return result._replace(
      aux=aux,
      grads=tuple(result.grads[0]),
      sums=None if sums is None else tuple(sums[0]),
    ), user

  def micro_batches(*args) -> int:
    """``k``, as ``run`` splits these arguments."""
    user = options.resolve(len(args))
    layout, diff_states, threaded, plain = _split_args(args, user, wrt)
    return step_for(user, layout).micro_batches((tuple(diff_states), threaded, *plain))

  run.micro_batches = micro_batches  # type: ignore[attr-defined]
  return run


def _split_args(
  args: tuple[Any, ...], user: _options.Options, wrt: Any
) -> tuple[tuple[_Arg | None, ...], list[Any], list[Any], list[Any]]:
  """Each argument as the engine takes it: nnx objects split into their
  differentiated (``wrt``) and threaded variables, the rest as they are."""
  layout: list[_Arg | None] = []
  diff_states: list[Any] = []
  threaded: list[Any] = []
  plain: list[Any] = []
  for n, arg in enumerate(args):
    differentiated = n in user.argnums
    holds_nnx = _holds_nnx(arg)
    plain.append(None if differentiated or holds_nnx else arg)
    if not holds_nnx:
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
  return tuple(layout), diff_states, threaded, plain


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
  args: tuple[Any, ...],
  layout: tuple[_Arg | None, ...],
  new_threaded: list[Any],
):
  """Updates the nnx objects in place with the state the last micro-batch left."""
  states = iter(new_threaded)
  for arg, arg_layout in zip(args, layout, strict=True):
    if arg_layout is None:
      continue
    state = next(states)
    if arg_layout.graphdef is not None and state is not None:
      flax_nnx.update(arg, state)


def _check_batch_is_plain(args: tuple[Any, ...], user: _options.Options) -> None:
  for n in user.batch_argnums:
    if _holds_nnx(args[n]):
      raise ValueError(
        f"The batch argument {n} holds an nnx object; the batch must be a "
        "pytree of arrays to split into micro-batches."
      )


def _check_public_objects(args: tuple[Any, ...], user: _options.Options) -> None:
  """Under ``clip_per_example``, an nnx object that is not differentiated
  (a teacher model) is read by every example's loss, like any other
  argument: it must be declared public (the engine sees only its variables,
  as threaded state, and checks the plain arguments)."""
  if user.privacy.clip_norm is None:
    return
  for n, arg in enumerate(args):
    if n in user.argnums or n in user.public_argnums or not _holds_nnx(arg):
      continue
    raise ValueError(
      f"With clip_per_example, args[{n}] holds nnx objects whose variables "
      "reach every example's loss, and it is not differentiated. jaxaccum "
      "cannot see where they came from: a model or state computed from the "
      "examples carries them into every example's clipped gradient, and the "
      f"privacy guarantee is void. {_privacy.public_fix(user, n)}"
    )
