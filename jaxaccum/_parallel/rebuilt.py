"""The operations that the walk of :mod:`jaxaccum._parallel.reduced`
rebuilds around its own pieces rather than binds as traced.

- A ``cond`` (:func:`cond`) and a ``scan`` (:func:`scan`): their jaxprs
  walked, their outputs (and a scan's carry) made plain, since their types
  must match across branches and iterations.
- A convolution of rows with a kernel typed ``reduced``, for which JAX has
  no ``reduced`` rule: where each device's images are its own (the batch
  dimension sharded over the reduced axes exactly, :func:`kernel_of_rows`),
  :func:`kept_kernel_conv`, whose kernel cotangent is each device's rows'
  share, left ``unreduced`` for the one reduction after the loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from jaxaccum import _compat, _jaxpr
from jaxaccum._parallel import specs as _specs
from jaxaccum._parallel import types as _types


def cond(
  walk: _jaxpr.Walker, eqn: Any, invals: list[Any], sources: list[frozenset[int] | None]
) -> tuple[list[Any], list[frozenset[int] | None]]:
  """A ``cond`` rebuilt: each branch walked, its outputs plain."""

  def branch(closed: Any) -> Callable[..., list[Any]]:
    def run(*ops: Any) -> list[Any]:
      outs, _ = walk.run(closed.jaxpr, closed.consts, ops, sources[1:])
      return [_types.plain(x) for x in outs]

    return run

  branches = [branch(b) for b in eqn.params["branches"]]
  outs = jax.lax.switch(invals[0], branches, *invals[1:])
  return list(outs), [None] * len(outs)


def scan(
  walk: _jaxpr.Walker, eqn: Any, invals: list[Any], sources: list[frozenset[int] | None]
) -> tuple[list[Any], list[frozenset[int] | None]]:
  """A ``scan`` rebuilt: its body walked, its carry and outputs plain."""
  p = eqn.params
  consts, carried = _compat.scan_operand_counts(p, len(invals))
  fixed, init = invals[:consts], [_types.plain(x) for x in invals[consts:][:carried]]
  scanned = invals[consts + carried :]
  closed = p["jaxpr"]
  inner_sources = [*sources[:consts], *[None] * carried, *sources[consts + carried :]]

  def step(carry: list[Any], xs: list[Any]) -> tuple[list[Any], list[Any]]:
    outs, _ = walk.run(
      closed.jaxpr, closed.consts, [*fixed, *carry, *xs], inner_sources
    )
    return [_types.plain(x) for x in outs[:carried]], [
      _types.plain(x) for x in outs[carried:]
    ]

  carry, ys = jax.lax.scan(
    step, init, scanned, length=p["length"], reverse=p["reverse"], unroll=p["unroll"]
  )
  outs = [*carry, *ys]
  return outs, [None] * len(outs)


def kernel_of_rows(eqn: Any, invals: list[Any], axes: frozenset[str]) -> bool:
  """A convolution of images whose batch dimension is sharded over the
  reduced axes exactly (each device's images its own; the kernel then is
  the reduced operand), one batch group, on a mesh of those axes only
  (other axes of size 1): the kernel's cotangent is taken in a
  ``shard_map`` manual over every mesh axis (JAX takes ``unreduced``
  outputs only so), and with another axis in the mesh jax 0.10.2 returned
  half of it, silently (a ``(4, 2)`` data x model mesh; not isolated from
  this derivative; 0.12.1 returned it whole)."""
  mesh = jax.typeof(invals[0]).sharding.mesh
  if eqn.params["batch_group_count"] != 1 or any(
    size > 1 and a not in axes for a, size in mesh.shape.items()
  ):
    return False
  images = _types.spec_or_empty(invals[0]).partitions
  batch = eqn.params["dimension_numbers"].lhs_spec[0]
  return batch < len(images) and set(_specs.names(images[batch])) == axes


def kept_kernel_conv(
  eqn: Any, images: jax.Array, kernel: jax.Array, axes: frozenset[str]
) -> jax.Array:
  """The convolution of :func:`kernel_of_rows`, on the kernel made plain
  (no data moves), with a derivative that leaves the kernel's cotangent
  ``unreduced``: each device's rows' share, a ``shard_map`` over the
  reduced axes, where JAX, which has no ``reduced`` rule for a convolution,
  would have the partitioner all-reduce it. The images' cotangent is the
  convolution's own."""
  params = eqn.params
  mesh = jax.typeof(images).sharding.mesh
  names = tuple(sorted(axes))

  def conv(x: jax.Array, k: jax.Array) -> jax.Array:
    return eqn.primitive.bind(x, k, **params)

  @jax.custom_vjp
  def kept(x: jax.Array, k: jax.Array) -> jax.Array:
    return conv(x, _types.plain(k))

  def forward(x: jax.Array, k: jax.Array) -> tuple[jax.Array, Any]:
    return kept(x, k), (x, k)

  def backward(res: Any, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, k = res
    plain = _types.plain(k)
    _, images_vjp = jax.vjp(lambda x: conv(x, plain), x)
    (dx,) = images_vjp(g)

    def local(x: jax.Array, g: jax.Array, k: jax.Array) -> jax.Array:
      k = jax.lax.pcast(k, names, to="varying")
      _, kernel_vjp = jax.vjp(lambda k: conv(x, k), k)
      return jax.lax.pcast(kernel_vjp(g)[0], names, to="unreduced")

    # Manual over every mesh axis (the default): JAX takes unreduced
    # outputs only so.
    dk = jax.shard_map(
      local,
      mesh=mesh,
      in_specs=(P(*_types.spec_or_empty(x)), P(*_types.spec_or_empty(g)), P()),
      out_specs=P(unreduced=set(names)),
    )(x, g, plain)
    return dx, dk

  kept.defvjp(forward, backward)
  return kept(images, kernel)
