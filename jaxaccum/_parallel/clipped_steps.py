"""DP-SGD's micro steps in ``mesh=``'s per-device view (``clip_per_example``).

Each is what :meth:`jaxaccum._parallel.device_view.DeviceStep.micro_step`
runs in place of the default micro step, and uses only the step's public
pieces (its engine, split, devices, inputs and explanations), so that a
gradient rule handed in by the privacy package (``options.rule``, a
:class:`jaxaccum._engine.GradientRule`) shapes them: this module imports
nothing of the privacy package.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from jaxaccum import _micro

if TYPE_CHECKING:
  from jaxaccum._parallel.device_view import DeviceStep


def clipped_micro_step(
  step: DeviceStep,
  args: tuple[Any, ...],
  kwargs: dict[str, Any],
  offsets: jax.Array,
  rows: int,
) -> Callable[..., Any]:
  """DP-SGD's micro step by ``clip_method="vmap"``: the engine's clipped
  step on every device, each device's clipped sum its own (every leaf a
  copy per device, see :func:`jaxaccum._parallel.placement.for_mesh`)."""
  devices = step.devices
  base = step.engine.micro.step(
    args, kwargs, step.split, devices.count * step.split.num_micro_batches, rows
  )
  per_device = devices.nested_vmap(
    step.explained(base, args), step.placements, step.options.state_argnum is not None
  )

  def clipped(diff_args, micro, index, state):
    micro = jax.tree.map(devices.unflatten, micro)
    if state is not None:
      state = jax.tree.map(devices.unflatten, state)
    out, grads = per_device(diff_args, micro, offsets + index, state)
    return jax.tree.map(devices.flatten, out), grads

  return clipped


def ghost_micro_step(
  step: DeviceStep, args: tuple[Any, ...], kwargs: dict[str, Any], offsets: jax.Array
) -> Callable[..., Any]:
  """Ghost clipping's micro step: each device takes its own examples'
  norms (from activations and cotangents, which need no whole gradient),
  then the gradient of the sum of the devices' weighted losses is taken as
  the non-private step's is: a leaf the devices share (FSDP,
  ``fsdp_gather="per_micro_batch"``) gets its clipped sums summed over
  them inside the backward pass, into an accumulator sharded like it."""
  o = step.options
  devices = step.devices
  k = step.split.num_micro_batches
  loss = step.explained(
    step.engine.micro.ghost_loss(args, kwargs, step.split, devices.count * k), args
  )
  per_device = devices.nested_vmap(
    loss, step.placements, o.state_argnum is not None, pairs=True
  )

  def ghost(diff_args, micro, index, state):
    diff_args, micro, state = step.device_inputs(diff_args, micro, index, state)
    # The clipped sums are formed in the accumulator's dtype: the gradient
    # is taken with respect to the leaves in it (bfloat16 leaves' float32
    # masters), read only by the sums, the model reading the leaves.
    masters = o.rule.masters(diff_args, o.accum_dtype)

    def total(masters):
      objectives, rest = per_device((diff_args, masters), micro, offsets + index, state)
      return jnp.sum(objectives), rest

    (_, (out, some)), grads = jax.value_and_grad(total, has_aux=True)(masters)
    losses, (weights, aux, new_state) = jax.tree.map(devices.flatten, out)
    grads = o.rule.kept_only(grads, jnp.any(some), o.accum_dtype)
    return _micro.MicroOut(losses, weights, aux, new_state, None), grads

  return step.engine.micro.rematerialized(ghost)
