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

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx as flax_nnx

from jaxaccum import (
  _calls,
  _nnx_objects,
  _options,
  _train_step,
  _tree,
  _value_and_grad,
)
from jaxaccum._inspect import equivalence as _equivalence
from jaxaccum._optim import opt_state as _opt_state
from jaxaccum._optim import scaling as _scaling

__all__ = ["grad", "make_train_step", "value_and_grad", "verify_equivalence"]


def value_and_grad(
  fun: Callable[..., Any],
  num_micro_batches: int | None = None,
  *,
  argnums: int | Sequence[int] = 0,
  wrt: Any = flax_nnx.Param,
  has_aux: bool = False,
  aux: Any = "auto",
  normalize: str = "mean",
  micro_batch_size: int | None = None,
  batch_argnums: int | Sequence[int] = 1,
  shared_argnums: int | Sequence[int] = (),
  accum_dtype: Any = jnp.float32,
  remat: bool | Callable[..., Any] = False,
  mesh: Any = None,
  data_axis: str | tuple[str, ...] | None = None,
  param_specs: Any = None,
  fsdp_gather: str = "per_micro_batch",
  gather_dtype: Any = None,
  view: str = "device",
  noise_stats: bool = False,
  value_checks: bool = False,
  clip_per_example: float | None = None,
  public_argnums: int | Sequence[int] = (),
  clip_record: bool = False,
  clip_method: str = "vmap",
  clip_without_noise: bool = False,
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
    has_aux: ``fun`` returns ``(value, aux)``; the aux comes back as the
      full batch's would (``aux=``).
    aux: how each aux leaf combines over the micro-batches, as in
      :func:`jaxaccum.value_and_grad`: by default a leaf with a row axis is
      concatenated back in batch order and any other leaf takes the mean.
    normalize: ``"mean"``, ``"sum"`` or ``"weighted"``.
    micro_batch_size: ``m``, the rows per micro-batch.
    batch_argnums: the positions in ``fun``'s arguments of the batch
      (the model is position 0, so the default 1 is the first after it).
    shared_argnums: arguments meant to reach every micro-batch whole, as in
      :func:`jaxaccum.value_and_grad`.
    accum_dtype: the dtype of the sums; float32 by default.
    remat: as in :func:`jaxaccum.value_and_grad`.
    mesh, data_axis, param_specs, fsdp_gather, gather_dtype, view: the
      data-parallel path, as in :func:`jaxaccum.value_and_grad`;
      ``param_specs`` mirrors the ``wrt``
      state (a tuple of them for a tuple ``argnums``), e.g.
      ``nnx.get_partition_spec(nnx.state(model, nnx.Param))``.
    noise_stats: also return the :class:`jaxaccum.GradientNoise`, as in
      :func:`jaxaccum.value_and_grad`: the result is then
      ``(output, noise)``.
    value_checks: as in :func:`jaxaccum.value_and_grad`.
    clip_per_example: DP-SGD's per-example clipping, as in
      :func:`jaxaccum.value_and_grad`: ``fun(model, example)`` sees one
      example, and the function takes ``example_mask=``. ``fun`` may read
      the model's other variables (BatchNorm in eval mode,
      ``use_running_average=True``) but not change them (BatchNorm in
      training mode, a stored RNG stream that dropout draws from).
    public_argnums: with ``clip_per_example``, the other arguments that hold
      arrays or nnx objects (a teacher model) and that every example's loss
      may read, declared to depend on no example, as in
      :func:`jaxaccum.value_and_grad`; any other is a ``ValueError``.
    clip_record: with ``clip_per_example``, return the gradient as a
      :class:`jaxaccum.ClipRecord`, as in :func:`jaxaccum.value_and_grad`:
      for a loop of your own, ``optimizer.update(model, record.grads,
      clip_record=record)`` with :func:`jaxaccum.dp_noise` first in the
      optimizer (or :func:`jaxaccum.nnx.make_train_step`, which does it).
    clip_method: ``"vmap"`` or ``"ghost"``, as in
      :func:`jaxaccum.value_and_grad`.
    clip_without_noise: with ``clip_per_example``, no
      :func:`jaxaccum.dp_noise` will see the clipped gradient, on purpose, as
      in :func:`jaxaccum.value_and_grad`: no
      :class:`jaxaccum.ClipWithoutNoiseWarning`.

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
  # Every parameter above but wrt is an option of the engine: validated once.
  options = _options.create(**{k: v for k, v in locals().items() if k != "wrt"})
  _value_and_grad.warn_if_without_noise(options)
  run = _nnx_objects.accumulated_results(fun, options, wrt)

  @functools.wraps(fun)
  def accumulated(*args, **kwargs):
    result, user = run(*args, **kwargs)
    return _value_and_grad.recorded(result, user).arranged(user)

  return accumulated


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
  nnx_only = {"wrt"}
  options = _options.create(
    fun, num_micro_batches, **{k: v for k, v in kwargs.items() if k not in nnx_only}
  )

  @functools.wraps(fun)
  def accumulated_grad(*args, **call_kwargs):
    output = value_and_grad_fun(*args, **call_kwargs)
    return _value_and_grad.grad_only(output, options)

  return accumulated_grad


def make_train_step(
  loss_fn: Callable[..., Any],
  optimizer: flax_nnx.Optimizer,
  num_micro_batches: int | None = None,
  *,
  skip_nonfinite: bool = True,
  donate: bool = True,
  **value_and_grad_kwargs: Any,
) -> Callable[..., Any]:
  """Builds ``step(model, *args, **kwargs) -> value`` for an ``nnx.Optimizer``.

  The step runs :func:`jaxaccum.nnx.value_and_grad` of ``loss_fn`` on
  ``(model, *args)`` and ``optimizer.update(model, grads)`` once, inside one
  ``jax.jit``, and writes the new variables into ``model`` and ``optimizer``
  in place, as an ``nnx.jit`` step does. The step is skipped as
  :func:`jaxaccum.make_train_step`'s is: when the value or a gradient is not
  finite, or (``normalize="weighted"``) the total weight is zero, the
  parameters, the optimizer state (its ``step`` too) and the other variables
  (BatchNorm statistics) come back unchanged; RNG streams advance all the
  same, so the next step draws new numbers.

  Every ``nnx.Rngs`` stream that ``loss_fn`` draws from (``nnx.Dropout``)
  advances once per micro-batch, so by ``k`` per step: micro-batch ``i``
  draws what the ``i``-th of ``k`` eager calls would. So do running averages
  (``nnx.BatchNorm``'s ``mean`` and ``var``): with momentum ``μ`` they decay
  by ``μ^k`` per step, not the full batch's ``μ`` (0.9 at ``k = 4`` acts as
  0.66). ``nnx.BatchNorm(..., momentum=jaxaccum.micro_batch_momentum(μ, k))``
  keeps the full batch's per-step momentum. For a model with
  ``nnx.BatchStat`` variables and ``k > 1`` the step warns once
  (:class:`jaxaccum.RunningAverageWarning`) unless
  ``micro_batch_momentum`` was asked for its ``k``.

  DP-SGD: with ``clip_per_example=C`` and :func:`jaxaccum.dp_noise` first in
  the optimizer's chain, the step passes the noise what the clipped sum was
  divided by and checks its ``clip_norm``, as :func:`jaxaccum.make_train_step`
  does.

  Args:
    loss_fn: ``loss_fn(model, batch, ...)``, as for
      :func:`jaxaccum.nnx.value_and_grad`.
    optimizer: the ``nnx.Optimizer`` of ``model``; its ``wrt`` filter is the
      default ``wrt``.
    num_micro_batches: ``k``; or give ``micro_batch_size``.
    skip_nonfinite: skip a step that has nothing to learn from (above).
    donate: donate the model's and the optimizer's arrays to the step, so that
      XLA updates them in place. The step writes the new arrays back into
      ``model`` and ``optimizer``, but an array you took out of them before
      the call (``w = model.kernel[...]``) is deleted by it: reading it
      raises JAX's ``RuntimeError: Array has been deleted``. So does an
      ``nnx.clone(model)`` taken before the call: a clone shares the model's
      arrays (passed to the step, it raises a ``ValueError`` saying so).
      Copy such arrays first (``jax.tree.map(jnp.copy, nnx.clone(model))``),
      or pass ``donate=False``.
    **value_and_grad_kwargs: the options of :func:`jaxaccum.nnx.value_and_grad`
      (``micro_batch_size``, ``batch_argnums``, ``has_aux``, ``aux``,
      ``normalize``, ``mesh``, ``data_axis``, ``wrt``, ...).

  Returns:
    The step. It returns what :func:`jaxaccum.nnx.value_and_grad` returns
    first: the loss, or ``(loss, aux)`` with ``has_aux``; with
    ``noise_stats=True``, ``(that, noise)``. Python values passed by keyword
    are static (``train=False`` compiles once); arrays are traced.

  Raises:
    TypeError: if ``optimizer`` is not an ``nnx.Optimizer``.
    ValueError: for an optimizer with a float16 loss scale
      (``accumulate(..., loss_scale=...)``), which only
      :func:`jaxaccum.make_train_step` applies.

  >>> import jax.numpy as jnp, optax, jaxaccum
  >>> from flax import nnx
  >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
  >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  >>> def loss_fn(model, batch):
  ...   x, y = batch
  ...   return jnp.mean((model(x)[:, 0] - y) ** 2)
  >>> step = jaxaccum.nnx.make_train_step(loss_fn, optimizer, 4)
  >>> batch = (jnp.ones((8, 2)), jnp.zeros(8))
  >>> bool(step(model, batch) > step(model, batch)), int(optimizer.step[...])
  (True, 2)
  """
  _check_train_step(optimizer, value_and_grad_kwargs)
  kwargs = {"wrt": optimizer.wrt, **value_and_grad_kwargs}
  wrt = kwargs.pop("wrt")
  options = _options.create(loss_fn, num_micro_batches, **kwargs)
  run = _nnx_objects.accumulated_results(loss_fn, options, wrt)
  check_noise = _train_step.NoiseCheck(options)
  both_update = isinstance(optimizer, flax_nnx.ModelAndOptimizer)

  warn_once = _running_average_warning(run)

  def pure(graphdef, rngs, rest, /, *args, **call_kwargs):
    model, opt = flax_nnx.merge(graphdef, rngs, rest, copy=True)
    result, _ = run(model, *args, **call_kwargs)
    warn_once(model, args)
    grads = result.grads[0]
    noise = check_noise(opt.opt_state)
    extra: dict[str, Any] = {}
    if noise is not None:  # dp_noise, as jaxaccum.make_train_step passes it
      extra["clip_record"] = _train_step.noise_record(result, options, noise)
    if both_update:
      opt.update(grads, **extra)
    else:
      opt.update(model, grads, **extra)
    parts: tuple[Any, ...] = flax_nnx.split((model, opt), flax_nnx.RngState, ...)
    _, new_rngs, new_rest = parts
    if skip_nonfinite:
      ok = _train_step.worth_a_step(result, options, noise, extra.get("clip_record"))
      new_rest = _tree.select(ok, new_rest, _tree.cast_like(rest, new_rest))
    value = (result.value, result.aux) if options.has_aux else result.value
    return new_rngs, new_rest, (value, result.noise) if options.noise_stats else value

  jitted = _calls.JitWithStaticKwargs(pure, donate_argnums=(1, 2) if donate else ())

  def step(model, /, *args, **call_kwargs):
    parts: tuple[Any, ...] = flax_nnx.split((model, optimizer), flax_nnx.RngState, ...)
    graphdef, rngs, rest = parts
    if donate and _train_step.donated(rest):
      raise ValueError(
        "jaxaccum.nnx.make_train_step donates the model's and the optimizer's "
        "arrays and writes the new ones back, and this model's arrays were "
        "donated to an earlier call: an nnx.clone(model) taken before that "
        "call shares them. Give a copy its own arrays, jax.tree.map(jnp.copy, "
        "nnx.clone(model)), or build the step with donate=False."
      )
    new_rngs, new_rest, value = jitted(graphdef, rngs, rest, *args, **call_kwargs)
    flax_nnx.update((model, optimizer), new_rngs, new_rest)
    return value

  return functools.wraps(loss_fn)(step)


def _check_train_step(optimizer: Any, value_and_grad_kwargs: dict[str, Any]) -> None:
  """Refuses what :func:`make_train_step` does not take: an optimizer that
  is not an ``nnx.Optimizer``, or one with a float16 loss scale, and
  ``clip_record=True``."""
  if not isinstance(optimizer, flax_nnx.Optimizer):
    raise TypeError(
      "jaxaccum.nnx.make_train_step takes an nnx.Optimizer, got "
      f"{type(optimizer).__name__}; for an optax transformation and a pytree of "
      "parameters use jaxaccum.make_train_step."
    )
  if _opt_state.find_loss_scale(optimizer.opt_state) is not None:
    raise ValueError(
      "jaxaccum.nnx.make_train_step does not apply a float16 loss scale; "
      "jaxaccum.make_train_step does: run it on the arrays of "
      "nnx.split(model, nnx.Param, ...), or train in bfloat16 or float32."
    )
  if value_and_grad_kwargs.get("clip_record"):
    raise ValueError(
      "jaxaccum.nnx.make_train_step hands its optimizer the clip record "
      "itself; clip_record=True is for jaxaccum.value_and_grad and grad."
    )


def _running_average_warning(run: Any) -> Callable[[Any, tuple[Any, ...]], None]:
  """``warn(model, args)``: the :class:`jaxaccum.RunningAverageWarning` of a
  step whose model updates ``nnx.BatchStat``, at its first trace with
  ``k > 1``."""
  warned: list[bool] = []

  def warn(model: Any, args: tuple[Any, ...]) -> None:
    if warned or not _updates_batch_stats(model):
      return
    warned.append(True)
    k = run.micro_batches(model, *args)
    _scaling.warn_running_average(k, "the model's nnx.BatchStat")

  return warn


def _updates_batch_stats(model: Any) -> bool:
  """Whether a module of ``model`` holds ``nnx.BatchStat`` variables that a
  training call may update: any such module but an ``nnx.BatchNorm`` (or
  a module like it) in eval mode, ``use_running_average=True``."""
  for _, module in flax_nnx.iter_modules(model):
    if getattr(module, "use_running_average", False) is True:
      continue
    if any(isinstance(v, flax_nnx.BatchStat) for v in vars(module).values()):
      return True
  return False


def verify_equivalence(
  fun: Callable[..., Any],
  model: Any,
  batch: Any = None,
  num_micro_batches: int | None = None,
  *,
  wrt: Any = flax_nnx.Param,
  fun_kwargs: dict[str, Any] | None = None,
  rtol: float | None = None,
  atol: float = 0.0,
  **options: Any,
) -> _equivalence.Deviation:
  """Checks that accumulation over micro-batches equals the full batch, for
  an nnx model: :func:`jaxaccum.verify_equivalence` on ``fun(model, ...)``.

  Called as :func:`jaxaccum.verify_equivalence` is, ``verify_equivalence(fun,
  (model, batch, ...), k, **options)``: the arguments as a tuple with the
  model first, and ``batch_argnums`` (default 1) naming the batch among
  them. The older ``verify_equivalence(fun, model, batch, k)`` still works;
  it is ``verify_equivalence(fun, (model, batch), k)``.

  The model is left as it was. A ``fun`` that changes the model's other
  variables (BatchNorm statistics in training mode, an ``nnx.Rngs`` stream
  drawn by dropout) has no full-batch counterpart: each micro-batch
  computes its own statistics and draws its own numbers. It is refused, as
  are ``state_argnum`` and ``rng_argnum`` (the model's own variables are
  its state and its keys); verify the deterministic path, ``model.eval()``,
  which runs the same gradient code.

  Args:
    fun: ``fun(model, batch, ..., **fun_kwargs)``, the loss, as for
      :func:`jaxaccum.nnx.value_and_grad`.
    model: the tuple of ``fun``'s positional arguments, the nnx model first
      (the other arguments are pytrees of arrays); or, in the older form,
      the model alone.
    batch: ``k`` (``num_micro_batches``); in the older form, the whole batch.
    num_micro_batches: in the older form, ``k``; otherwise left out.
    wrt: the nnx filter of the variables to differentiate.
    fun_kwargs: keyword arguments of ``fun`` for both calls.
    rtol: the tolerance relative to the whole gradient's largest magnitude,
      as in :func:`jaxaccum.verify_equivalence`.
    atol: an absolute tolerance added to it (default 0).
    **options: further options of :func:`jaxaccum.value_and_grad`
      (``batch_argnums``, ``has_aux``, ``normalize``, ``mesh``,
      ``data_axis``, ...).

  Returns:
    The largest deviations, as a :class:`jaxaccum.Deviation`.

  Raises:
    AssertionError: if the value or any gradient leaf differs by more than
      the tolerance, naming both deviations, the leaf with the largest one
      and the likely cause.
    TypeError: for ``argnums``, ``state_argnum`` or ``rng_argnum``.
    ValueError: if ``fun`` changes variables other than ``wrt``'s.

  >>> import jax.numpy as jnp, jaxaccum
  >>> from flax import nnx
  >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
  >>> loss = lambda model, x: jnp.mean(jnp.sin(model(x)))
  >>> dev = jaxaccum.nnx.verify_equivalence(loss, (model, jnp.ones((8, 3))), 4)
  >>> dev.grads < 1e-6
  True
  """
  args, num_micro_batches = _equivalence_call(model, batch, num_micro_batches)
  for name in ("argnums", "state_argnum", "rng_argnum"):
    if name in options:
      raise TypeError(
        f"jaxaccum.nnx.verify_equivalence takes no {name}: it differentiates "
        "the wrt variables of the model (the first argument), and the model's "
        "other variables are its state and its keys, which have no "
        "full-batch counterpart when they change. Call model.eval() and "
        "verify the deterministic path."
      )
  parts: tuple[Any, ...] = flax_nnx.split(args[0], wrt, ...)
  graphdef, params, rest = parts
  last = len(args)  # the model's other variables go after fun's arguments

  def pure(params, *others_and_rest, **kwargs):
    *others, rest = others_and_rest
    copy = flax_nnx.merge(graphdef, params, rest, copy=True)
    out = fun(copy, *others, **kwargs)
    _refuse_changed(flax_nnx.split(copy, wrt, ...)[-1], rest)
    return out

  for name in ("batch_argnums", "shared_argnums"):
    if name in options:  # counted from the end of fun's arguments, not ours
      user = _options._as_tuple(options[name], name)
      options[name] = tuple(n + last if n < 0 else n for n in user)
  shared = (*options.pop("shared_argnums", ()), last)
  return _equivalence.verify_equivalence(
    pure,
    (params, *args[1:], rest),
    num_micro_batches,
    fun_kwargs=fun_kwargs,
    rtol=rtol,
    atol=atol,
    shared_argnums=shared,
    **options,
  )


def _equivalence_call(
  model: Any, batch: Any, num_micro_batches: Any
) -> tuple[tuple[Any, ...], Any]:
  """``(args, k)`` from either form of :func:`verify_equivalence`'s call:
  ``(fun, args, k)`` or the older ``(fun, model, batch, k)``."""
  if isinstance(model, tuple) and num_micro_batches is None:
    if not model:
      raise TypeError(
        "jaxaccum.nnx.verify_equivalence(fun, args, k) needs args = (model, "
        "batch, ...), got an empty tuple."
      )
    return model, batch
  if batch is None:
    raise TypeError(
      "jaxaccum.nnx.verify_equivalence takes fun's arguments as a tuple, as "
      "jaxaccum.verify_equivalence does: verify_equivalence(fun, (model, "
      "batch), k); got the model alone."
    )
  return (model, batch), num_micro_batches


def _refuse_changed(after: Any, before: Any) -> None:
  """Raises if ``fun`` changed any of the model's non-``wrt`` variables."""
  is_variable = lambda x: isinstance(x, flax_nnx.Variable)  # noqa: E731
  changed = [
    jax.tree_util.keystr(path)
    for (path, new), old in zip(
      jax.tree_util.tree_leaves_with_path(after, is_leaf=is_variable),
      jax.tree.leaves(before, is_leaf=is_variable),
      strict=True,
    )
    if any(
      a is not b
      for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(old), strict=True)
    )
  ]
  if changed:
    raise ValueError(
      f"jaxaccum.nnx.verify_equivalence: fun changed the model's variables "
      f"{', '.join(changed)}, which the full batch would change once and "
      "k micro-batches change k times (BatchNorm statistics in training "
      "mode, dropout's RNG stream): they have no full-batch counterpart. "
      "Verify the deterministic path: call model.eval() first."
    )
