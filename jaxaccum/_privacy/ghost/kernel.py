"""A convolution kernel's per-example gradient, one window offset at a
time (no convolution grouped over the examples)."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

PyTree = Any


def kernel_tap(eqn: Any, lhs: jax.Array, tap: jax.Array) -> jax.Array:
  """The convolution ``eqn`` of one example's ``lhs`` with a ZERO kernel tap:
  its value is zero, and its gradient with respect to ``tap`` is the
  example's kernel gradient, taken one kernel offset at a time.

  Adding the tap to the kernel itself would give every example its own
  kernel, and ``vmap`` turns each example's kernel gradient into one
  convolution grouped over the examples, which XLA's SPMD partitioner
  miscompiles where the examples are sharded over devices: every device but
  the first gets a zero gradient, silently (jax 0.10.2 and 0.12.1 on 8 CPU
  devices; under ``mesh=`` with a shared FSDP kernel at one row per device
  per micro-batch, the CNN's clipped sum was 2.6% off). Here the backward
  pass takes, for each offset of the kernel's window, the input that offset
  reads (a convolution with a one-hot kernel per channel, exact at HIGHEST,
  the same for every example) and its ``dot_general`` with the output's
  cotangent, in float32, in a loop over the offsets: one offset's inputs
  are live at a time, never all of them (the patches, as many times the
  input as the window has offsets).
  """
  params = eqn.params
  dims = params["dimension_numbers"]
  lhs_spec, rhs_spec, out_spec = dims
  groups = params["feature_group_count"]
  spatial = sorted(rhs_spec[2:])  # the kernel's window, in its own order
  window = [tap.shape[d] for d in spatial]
  channels = lhs.shape[lhs_spec[1]]
  out_aval = eqn.outvars[0].aval
  to_rows = [out_spec[0], *out_spec[2:], out_spec[1]]  # (batch, *spatial, C)
  kernel_order = [rhs_spec[0], rhs_spec[1], *spatial]  # (out, in, *window)

  def offset_grad(lhs, g, offset):
    """The kernel gradient at one offset of the window: (groups, out, in)."""
    one_hot = (jnp.arange(math.prod(window)) == offset).astype(lhs.dtype)
    picker = jnp.broadcast_to(one_hot.reshape(window), (channels, 1, *window))
    picker = jnp.moveaxis(picker, (0, 1), (rhs_spec[0], rhs_spec[1]))
    read = jax.lax.conv_general_dilated(
      lhs,
      picker,
      params["window_strides"],
      params["padding"],
      params["lhs_dilation"],
      params["rhs_dilation"],
      dims,
      feature_group_count=channels,
      precision=jax.lax.Precision.HIGHEST,
    )
    read = widened(jnp.transpose(read, to_rows))
    read = read.reshape(-1, groups, channels // groups)
    g = widened(jnp.transpose(g, to_rows))
    g = g.reshape(-1, groups, g.shape[-1] // groups)
    return jnp.einsum("sgi,sgo->goi", read, g, precision=jax.lax.Precision.HIGHEST)

  @jax.custom_vjp
  def tapped(lhs, tap):
    # Zero, read from the tap so that vmap maps it as the tap is mapped (an
    # unmapped output would get the examples' cotangents summed).
    del lhs
    zero = jnp.zeros((), out_aval.dtype) * jnp.sum(tap).astype(out_aval.dtype)
    return jnp.broadcast_to(zero, out_aval.shape)

  def forward(lhs, tap):
    return tapped(lhs, tap), lhs

  def backward(lhs, g):
    per_offset = jax.lax.map(
      lambda offset: offset_grad(lhs, g, offset), jnp.arange(math.prod(window))
    )  # (window, groups, out, in)
    grad = jnp.moveaxis(per_offset, 0, -1).reshape([tap.shape[d] for d in kernel_order])
    grad = jnp.transpose(grad, [kernel_order.index(d) for d in range(tap.ndim)])
    # At a zero tap the convolution does not depend on lhs.
    return jnp.zeros_like(lhs), grad.astype(tap.dtype)

  tapped.defvjp(forward, backward)
  return tapped(lhs, tap)


def widened(x: jax.Array) -> jax.Array:
  """``x`` in float32 (or its own wider dtype), with exactly the value its
  own dtype holds: a bfloat16 value up-cast is rounded to bfloat16 again
  (``reduce_precision``), since XLA may drop a cast pair f32 -> bf16 -> f32
  and hand one reader the unrounded float32 value and another the rounded
  one (``xla_allow_excess_precision``). The norms and the clipped sum read
  the same values through it, so that each example's share of the sum has
  the norm its clip factor was taken from."""
  dtype = jnp.result_type(x)
  wide = jnp.promote_types(dtype, jnp.float32)
  x = x.astype(wide)
  if dtype == wide or not jnp.issubdtype(dtype, jnp.floating):
    return x
  info = jnp.finfo(dtype)
  return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)
