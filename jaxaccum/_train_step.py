"""``make_train_step``: one jitted, donated step of accumulation plus an update.

The step donates the parameters and the optimizer state (``donate_argnums``),
so XLA writes the new values into the old buffers instead of holding two
copies. A step whose loss or gradient is not finite is skipped: its update
is computed and dropped by a select (``jnp.where``), so parameters and
optimizer state come back unchanged and a NaN never reaches them. (A
``lax.cond`` would keep a second copy of both: its branches cannot update the
donated buffers in place.)
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxaccum import (
  _accumulator,
  _calls,
  _compat,
  _options,
  _privacy,
  _static,
  _tree,
  _value_and_grad,
)
from jaxaccum._engine import Result
from jaxaccum._optim.loss_scale import DynamicLossScale
from jaxaccum._optim.opt_state import find_loss_scale
from jaxaccum._optim.scaling import warn_running_average

PyTree = Any


def make_train_step(
  loss_fn: Callable[..., Any],
  tx: optax.GradientTransformation,
  num_micro_batches: int | None = None,
  *,
  skip_nonfinite: bool = True,
  donate: bool = True,
  **value_and_grad_kwargs: Any,
) -> Any:
  """Builds ``step(params, opt_state, *args) -> (params, opt_state, value)``.

  The step runs ``jaxaccum.value_and_grad(loss_fn, num_micro_batches,
  **value_and_grad_kwargs)(params, *args)``, then ``tx.update`` once and
  ``optax.apply_updates``, inside one ``jax.jit``.

  Args:
    loss_fn: ``loss_fn(params, batch, ...)``, as for
      :func:`jaxaccum.value_and_grad` with ``argnums=0``; the batch is
      ``batch_argnums`` (default 1) of ``loss_fn``'s arguments. ``params``
      may be an Equinox module: its floating-point arrays are updated (and
      donated), its other leaves come back as they were, and ``opt_state``
      is ``tx.init(eqx.filter(params, eqx.is_inexact_array))``.
    tx: the optimizer, run once per step. For a Linen variables dict
      holding Flax's ``_overwrite_with_gradient`` collection (FP8 layers),
      ``tx`` updates ``params["params"]`` and the collection is overwritten
      by its new value, as ``TrainState.apply_gradients`` does
      (``opt_state = tx.init(params["params"])``).
    num_micro_batches: ``k``; or give ``micro_batch_size``.
    skip_nonfinite: skip a step that has nothing to learn from: its value or
      a gradient is NaN or Inf, or (``normalize="weighted"``) its total
      weight is zero, a batch of padding only. The parameters and optimizer
      state come back unchanged (the update is computed and dropped by
      ``jnp.where``), with ``state_argnum`` the state too, and the value
      reported is the one that caused the skip.
      For float16, pass ``tx = jaxaccum.accumulate(inner, 1,
      loss_scale=jaxaccum.dynamic_loss_scale())``: the step then multiplies
      the loss by the current scale, and ``accumulate`` unscales the
      gradients, skips a step that overflowed and adjusts the scale once per
      step. Inside an ``optax.chain``, put that ``accumulate`` first, so that
      nothing sees the gradients before they are unscaled (anywhere else,
      e.g. under ``optax.masked``, the step raises a ``ValueError``). With
      ``noise_stats``, the noise is reported unscaled.
      With ``clip_per_example`` (DP-SGD) the value does not count, and a
      batch without real examples is skipped unless ``tx`` holds a
      :func:`jaxaccum.dp_noise` with ``normalize="poisson"``, whose empty
      draws are steps of noise.
    donate: donate ``params`` and ``opt_state`` to the step, so that XLA
      writes the new values into their buffers. The arrays you passed are
      deleted by the call: use the ones it returns. Reading the old ones
      raises JAX's ``RuntimeError: Array has been deleted``, and passing them
      to the step again raises a ``ValueError`` saying so. ``donate=False``
      keeps them, at the cost of a second copy of both.
    **value_and_grad_kwargs: the options of :func:`jaxaccum.value_and_grad`
      (``micro_batch_size``, ``batch_argnums``, ``has_aux``, ``normalize``,
      ``rng_argnum``, ``state_argnum``, ``remat``, ``mesh``,
      ``clip_per_example``, ``public_argnums``, ...). With
      ``state_argnum`` the state passes through the ``k`` micro-batches in
      order, so a running average in it (BatchNorm's statistics) moves ``k``
      times per step: momentum ``μ`` acts as ``μ^k`` (0.9 at ``k = 8`` as
      0.43, 5.7 times as far per step). Build such layers with
      ``momentum=jaxaccum.micro_batch_momentum(μ, k)``; the step warns once
      (:class:`jaxaccum.RunningAverageWarning`) unless that was asked for
      its ``k``. With ``clip_per_example`` the step takes
      ``example_mask=``; put :func:`jaxaccum.dp_noise` first in ``tx``: the
      step passes it the :class:`jaxaccum.ClipRecord` of the gradient, and
      the noise refuses any other place in the chain and any other
      ``clip_norm``.

  Returns:
    The jitted step. It is ``jax.jit``-like (``.lower(...)`` works on it),
    except that Python values passed by keyword (``train=False``) are static:
    ``loss_fn`` sees them as Python values and each value compiles once.
    Arrays passed by keyword are traced.
    ``value`` is what ``value_and_grad`` returns first: the loss, or
    ``(loss, aux)`` with ``has_aux``; with ``noise_stats=True`` it is
    ``(that, noise)``, the step's :class:`jaxaccum.GradientNoise`.

  >>> import jax.numpy as jnp, optax, jaxaccum
  >>> loss = lambda w, x: jnp.mean((x @ w - 1.0) ** 2)
  >>> step = jaxaccum.make_train_step(loss, optax.sgd(0.1), num_micro_batches=4)
  >>> w, x = jnp.zeros(2), jnp.ones((8, 2))
  >>> opt_state = optax.sgd(0.1).init(w)
  >>> w, opt_state, value = step(w, opt_state, x)
  >>> float(value), [round(float(v), 4) for v in w]
  (1.0, [0.2, 0.2])
  """
  if value_and_grad_kwargs.get("argnums", 0) != 0:
    raise ValueError("make_train_step differentiates the parameters, argnums=0.")
  if value_and_grad_kwargs.get("clip_record"):
    raise ValueError(
      "make_train_step hands its optimizer the clip record itself; "
      "clip_record=True is for value_and_grad and grad feeding accumulate()."
    )
  options = _options.create(loss_fn, num_micro_batches, **value_and_grad_kwargs)
  plain = _value_and_grad.Step(loss_fn, options)
  scaled = _value_and_grad.Step(_scaled(loss_fn, options), options)
  check_noise = NoiseCheck(options)
  warn_once = _warning_once(options, plain)

  def step(params, opt_state, /, *args, **kwargs):
    loss_scale = find_loss_scale(opt_state)
    if loss_scale is None:
      result = plain(params, *args, **kwargs)
    else:
      result = scaled(params, *args, _jaxaccum_loss_scale=loss_scale, **kwargs)
      result = _unscaled(result, loss_scale)
    warn_once(params, args)
    engine_options = plain.engine(len(args) + 1).options
    noise = check_noise(opt_state)
    extra: dict[str, Any] = {}
    if noise is not None:
      extra["clip_record"] = noise_record(result, options, noise)
    ok = worth_a_step(result, options, noise, extra.get("clip_record"))
    if engine_options.state_argnum is not None and skip_nonfinite:
      # A skipped step leaves the threaded state (BatchNorm statistics) as it
      # was too: one bad batch must not poison every later step.
      old_state = args[engine_options.state_argnum - 1]
      aux, new_state = result.aux
      result = result._replace(aux=(aux, _tree.select(ok, new_state, old_state)))
    if not skip_nonfinite or loss_scale is not None:
      # float16: accumulate() unscales, skips overflowing windows and adjusts
      # the scale itself.
      params, opt_state = _apply(tx, params, opt_state, result.grads[0], extra)
    else:
      update = _apply(tx, params, opt_state, result.grads[0], extra)
      barrier = plain.micro_batches((params, *args)) == 1 and _on_several_devices(
        engine_options, (params, opt_state, args)
      )
      params, opt_state = _selected(ok, update, (params, opt_state), barrier)
    value = (result.value, result.aux) if options.has_aux else result.value
    return params, opt_state, ((value, result.noise) if options.noise_stats else value)

  jitted = _calls.JitWithStaticKwargs(step, donate_argnums=(0, 1) if donate else ())
  return _partitioning(_checked_donation(jitted) if donate else jitted, plain)


def _selected(
  ok: jax.Array, new: tuple[PyTree, PyTree], old: tuple[PyTree, PyTree], barrier: bool
) -> tuple[PyTree, PyTree]:
  """The new parameters and optimizer state where the step is ``ok``, else
  the old ones: selected, not branched. A ``lax.cond`` returning either the
  inputs or the new values cannot update the donated buffers in place, and
  held a second copy of the parameters and the optimizer state (+640 MiB
  for a 109M-parameter Adam step on an H100 target). A skipped step's
  update is computed from its non-finite gradient and dropped here;
  zeroing that gradient first would cost another copy of it.

  With ``barrier`` (one micro-batch over several devices) the update is
  computed apart first: the gradients come straight from the backward
  pass. Fused with the select, each parameter's update waited for the
  all-finite flag of every gradient, and XLA put off the unembedding's
  gradient matmul to the end of the backward pass, holding the logits'
  cotangent through all of it (+2,000 MiB per device for a 1B Llama with
  FSDP on 8 H100s, with view="device" and "global"). Computed apart (a
  barrier), the step holds the full batch's peak to the MiB there. But the
  barrier keeps the new parameters and optimizer state beside the old ones
  until the select, a copy of both: on one device, where the update is the
  peak of a small model, that copy was the excess (a 20 KiB MLP on a TPU
  v5e: 633,344 B, 476,672 without it; a 4-layer transformer on one H100
  holds the same peak either way), so one device goes without it. With a
  loop the gradients come from the accumulator, and the barrier would only
  cost that copy."""
  if barrier:
    new = jax.lax.optimization_barrier(new)
  (new_params, new_state), (params, opt_state) = new, old
  return _tree.select(ok, new_params, params), _tree.select(ok, new_state, opt_state)


def _warning_once(
  options: _options.Options, plain: _value_and_grad.Step
) -> Callable[[PyTree, tuple[Any, ...]], None]:
  """``warn(params, args)``: the :class:`jaxaccum.RunningAverageWarning` of a
  step with ``state_argnum``, at its first trace with ``k > 1``."""
  warned: list[bool] = []

  def warn(params: PyTree, args: tuple[Any, ...]) -> None:
    if options.state_argnum is None or warned:
      return
    k = plain.micro_batches((params, *args))
    if k > 1:
      warned.append(True)
      warn_running_average(k, f"state_argnum={options.state_argnum}'s state")

  return warn


def _on_several_devices(options: _options.Options, tree: PyTree) -> bool:
  """Whether the step runs on more than one device: ``mesh=`` over several,
  a mesh of several in context (``jax.set_mesh``), or an argument placed on
  a mesh of several (under ``jit`` its type carries the mesh, on Auto axes
  too, where the spec is hidden)."""
  if options.mesh is not None and options.mesh.size > 1:
    return True
  context = jax.sharding.get_abstract_mesh()
  if not context.empty and context.size > 1:
    return True
  for x in filter(_compat.is_tracer, jax.tree.leaves(tree)):
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    if mesh is not None and not mesh.empty and mesh.size > 1:
      return True
  return False


def _scaled(
  loss_fn: Callable[..., Any], options: _options.Options
) -> Callable[..., Any]:
  """``loss_fn`` with its loss (not its weight or aux) times the loss scale."""

  def scaled_loss_fn(*args, _jaxaccum_loss_scale, **kwargs):
    out = loss_fn(*args, **kwargs)
    value, aux = out if options.has_aux else (out, None)
    if options.normalize == "weighted":
      value = (_jaxaccum_loss_scale.scale_loss(value[0]), value[1])
    else:
      value = _jaxaccum_loss_scale.scale_loss(value)
    return (value, aux) if options.has_aux else value

  return scaled_loss_fn


def _unscaled(result: Result, loss_scale: DynamicLossScale) -> Result:
  """The value (float32, like the scaled loss) and the noise of a step run on
  a scaled loss, divided back. The gradients stay scaled: accumulate()
  unscales them."""
  return result._replace(
    value=result.value / loss_scale.scale,
    noise=None if result.noise is None else result.noise.unscaled(loss_scale.scale),
  )


class NoiseCheck:
  """The :func:`jaxaccum.dp_noise` in a step's optimizer state, or None,
  read at trace time, with one :class:`jaxaccum.ClipWithoutNoiseWarning` per
  step built with ``clip_per_example`` whose optimizer holds none (unless
  ``clip_without_noise=True``)."""

  def __init__(self, options: _options.Options):
    self.options = options
    self.warned = False

  def __call__(self, opt_state: PyTree) -> _privacy.NoiseConfig | None:
    noise = _privacy.find_noise(opt_state)
    o = self.options
    if (
      noise is None
      and o.privacy.clip_norm is not None
      and not o.privacy.without_noise
      and not self.warned
    ):
      self.warned = True
      _privacy.warn_without_noise(
        f"The train step clips each example's gradient (clip_per_example="
        f"{o.privacy.clip_norm}), but its optimizer holds no jaxaccum.dp_noise: "
        "its updates are not private.",
        stacklevel=4,
      )
    return noise


def noise_record(
  result: Result, options: _options.Options, noise: _privacy.NoiseConfig
) -> _privacy.ClipRecord:
  """The :class:`~jaxaccum._privacy.ClipRecord` that a step holding
  :func:`jaxaccum.dp_noise` hands its optimizer with the gradient, after
  checking the noise against the step's options."""
  _privacy.check_noise_matches(noise, options.privacy.clip_norm, options.normalize)
  assert options.privacy.clip_norm is not None and result.sums is not None
  return _privacy.record_of(
    result.grads[0],
    result.total_weight,
    options.privacy.clip_norm,
    options.normalize,
    result.sums[0],
  )


def worth_a_step(
  result: Result,
  options: _options.Options,
  noise: _privacy.NoiseConfig | None = None,
  record: _privacy.ClipRecord | None = None,
) -> jax.Array:
  """The step is taken only if its value and gradients are finite and, with
  ``normalize="weighted"``, its total weight is not zero (a batch of padding
  only has nothing to learn from: Adam's momentum would still move).

  With ``clip_per_example`` the value does not count (an example whose loss
  is not finite already added nothing to the gradient, and a step must not
  depend on one example). With :func:`jaxaccum.dp_noise` (its ``record``)
  the decision reads only the clipped sum and what the noise divides by: a
  batch without real examples is skipped where that is their count
  (``"fixed"``, public at a fixed batch size), and never where it is a
  public number (under Poisson sampling an empty draw is part of the
  mechanism, and its step is noise). The private total weight of a weighted
  step decides nothing."""
  if options.privacy.clip_norm is not None:
    if noise is not None and record is not None:
      ok = _tree.all_finite(record.clipped_sum)
      if noise.public_denominator is None:
        ok = ok & (record.examples != 0)
      return ok
    return _tree.all_finite(result.grads) & (result.total_weight != 0)
  ok = _tree.all_finite(result.grads)
  ok = ok & jnp.all(jnp.isfinite(result.value))
  if options.normalize == "weighted":
    ok = ok & (result.total_weight != 0)
  return ok


def _apply(
  tx: optax.GradientTransformation,
  params: PyTree,
  opt_state: PyTree,
  grads: PyTree,
  extra: dict[str, Any],
):
  overwritten = _overwritten(params, grads)
  if overwritten is not None:  # Flax's FP8 metadata: TrainState.apply_gradients
    inner, next_state = _apply(tx, params["params"], opt_state, grads["params"], extra)
    return {**params, "params": inner, overwritten: grads[overwritten]}, next_state
  if extra:  # dp_noise's clip_record, through chains of plain transformations
    tx = optax.with_extra_args_support(tx)
  updates, next_state = tx.update(grads, opt_state, params, **extra)
  # The state keeps its dtypes (adam's mu would come back promoted with the
  # gradients'): the select, donation and the next call need the same types.
  next_state = _tree.cast_like(next_state, opt_state)
  return optax.apply_updates(params, updates), next_state


def _overwritten(params: PyTree, grads: PyTree) -> str | None:
  """Flax's ``_overwrite_with_gradient`` key where ``params`` is a Linen
  variables dict holding that collection beside ``"params"``: then, as
  ``TrainState.apply_gradients`` does, ``tx`` updates ``params["params"]``
  (``opt_state`` is ``tx.init(params["params"])``) and the collection is
  overwritten by its "gradient", its new value (FP8 scales and amax
  histories, combined over the micro-batches as the full batch's)."""
  key = _accumulator.OVERWRITE_WITH_GRADIENT
  both = isinstance(params, dict) and isinstance(grads, dict)
  return key if both and key in params and "params" in params else None


def _checked_donation(step: _calls.JitWithStaticKwargs) -> Any:
  """``step``, raising a clear error when it is given parameters or an
  optimizer state that an earlier call already donated."""

  class DonatingStep:
    __wrapped__ = step.__wrapped__

    def __call__(self, params, opt_state, /, *args, **kwargs):
      for name, tree in (("params", params), ("opt_state", opt_state)):
        if donated(tree):
          raise ValueError(
            f"make_train_step donates params and opt_state, and the {name} "
            "passed were donated to an earlier call: pass the ones that call "
            "returned, or build the step with donate=False."
          )
      return step(params, opt_state, *args, **kwargs)

    def lower(self, *args, **kwargs):
      return step.lower(*args, **kwargs)

    def trace(self, *args, **kwargs):
      return step.trace(*args, **kwargs)

  return DonatingStep()


def _partitioning(step: Any, plain: _value_and_grad.Step) -> Any:
  """``step``, taking parameters with leaves that ``jax.grad`` refuses (an
  Equinox module): their floating-point arrays go through the jitted,
  donated step and the optimizer, the other leaves stay out of it, static,
  and come back as they were (:mod:`jaxaccum._static`). The call's
  arguments are checked first, with ``value_and_grad``'s messages.

  Both depend only on the call's configuration: the arguments' structure and
  their leaves' types and dtypes. They run when a configuration is first
  seen; a later call of it costs one flatten and a lookup (checking and
  partitioning on every call was most of the step's Python time per call on
  a dispatch-bound model, benchmarks/README.md)."""
  # Per configuration: whether the parameters hold static leaves.
  static_leaves: dict[Any, bool] = {}

  def split(params, args, kwargs):
    key = _configuration((params, *args))
    try:
      partitioned = static_leaves.get(key)
    except TypeError:  # an unhashable static field in the structure
      key, partitioned = None, None
    if partitioned is None:
      plain.validate((params, *args))
      plain.check_differentiable((params, *args))
      diff, rest = _static.partition(params)
      if key is not None:
        static_leaves[key] = rest is not None
    elif partitioned:
      diff, rest = _static.partition(params)
    else:
      diff, rest = params, None
    if rest is not None:
      kwargs = {**kwargs, _static.KEYWORD: {0: rest}}
    return diff, rest, kwargs

  class PartitioningStep:
    __wrapped__ = step.__wrapped__

    def __call__(self, params, opt_state, /, *args, **kwargs):
      diff, rest, kwargs = split(params, args, kwargs)
      diff, opt_state, value = step(diff, opt_state, *args, **kwargs)
      return _static.combine(diff, rest), opt_state, value

    def lower(self, params, opt_state, /, *args, **kwargs):
      diff, _, kwargs = split(params, args, kwargs)
      return step.lower(diff, opt_state, *args, **kwargs)

    def trace(self, params, opt_state, /, *args, **kwargs):
      diff, _, kwargs = split(params, args, kwargs)
      return step.trace(diff, opt_state, *args, **kwargs)

  return PartitioningStep()


def _configuration(tree: PyTree) -> Any:
  """What the checks and the partition of a call depend on: the structure
  of ``tree``, the types of its leaves and their dtypes (None for a leaf
  without one: a function, a flag or a size in an Equinox module)."""
  leaves, treedef = jax.tree.flatten(tree)
  try:
    dtypes = tuple(map(_DTYPE, leaves))
  except AttributeError:
    dtypes = tuple(getattr(x, "dtype", None) for x in leaves)
  return treedef, tuple(map(type, leaves)), dtypes


_DTYPE = operator.attrgetter("dtype")


def donated(tree: PyTree) -> bool:
  """Whether ``tree`` was donated: one leaf tells (a donation takes all)."""
  x = next(iter(jax.tree.leaves(tree)), None)
  return isinstance(x, jax.Array) and not _compat.is_tracer(x) and x.is_deleted()
