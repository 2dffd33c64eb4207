"""Values and their sharding types: reading a value's spec, laying a value
out as a spec says, and making a ``reduced`` or ``unreduced`` value plain.

:mod:`jaxaccum._parallel.specs` is the algebra of the specs themselves.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxaccum import _compat
from jaxaccum._parallel import specs


def spec_of(x: Any) -> P | None:
  """``x``'s ``PartitionSpec`` on an Explicit mesh, None elsewhere."""
  return aval_spec(jax.typeof(x))


def aval_spec(aval: Any) -> P | None:
  """The ``PartitionSpec`` an abstract value's type carries, or None."""
  sharding = getattr(aval, "sharding", None)
  spec = getattr(sharding, "spec", None)
  return spec if isinstance(spec, P) else None


def spec_or_empty(x: Any) -> P:
  """``x``'s ``PartitionSpec``, ``P()`` where it has none."""
  spec = spec_of(x)
  return P() if spec is None else spec


def explicit_axes(mesh: Any) -> set[str]:
  """The Explicit axes of ``mesh`` (a mesh or an abstract mesh)."""
  return {
    n
    for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
    if t == AxisType.Explicit
  }


def explicit_only(spec: P, mesh: Any) -> P:
  """``spec`` without the axes that are not Explicit (what a reshard, or a
  reshape's ``out_sharding``, names)."""
  explicit = explicit_axes(mesh)
  return P(*(specs.only(e, explicit) for e in spec))


def reshard(x: jax.Array, spec: P) -> jax.Array:
  """``x`` resharded to ``spec`` on its own mesh (no mesh context needed)."""
  return jax.sharding.reshard(x, jax.typeof(x).sharding.update(spec=spec))


def reshaped(x: jax.Array, shape: tuple[int, ...], spec: P) -> jax.Array:
  """``x`` reshaped to ``shape``, typed ``spec`` on its mesh."""
  sharding = jax.typeof(x).sharding.update(spec=spec)
  return jax.lax.reshape(x, shape, out_sharding=sharding)


def constrain(x: jax.Array, spec: P) -> jax.Array:
  """``x`` laid out as ``spec`` on the mesh of the context: a reshard
  along its Explicit axes (a mesh may mix the two), a sharding constraint
  along the others."""
  explicit = explicit_axes(jax.sharding.get_abstract_mesh())
  entries = [*spec, *(None,) * (jnp.ndim(x) - len(spec))]
  if not explicit:
    return jax.lax.with_sharding_constraint(x, P(*entries))
  if all(e is P.UNCONSTRAINED for e in entries):
    return x
  now = [*(_compat.explicit_spec(x) or ()), *(None,) * jnp.ndim(x)]
  x = jax.sharding.reshard(
    x,
    P(
      *(
        now[d] if e is P.UNCONSTRAINED else specs.only(e, explicit)
        for d, e in enumerate(entries)
      )
    ),
  )
  rest = [
    P.UNCONSTRAINED
    if e is P.UNCONSTRAINED or specs.only(e, explicit)
    else specs.without(e, explicit)
    for e in entries
  ]
  if all(e is None or e is P.UNCONSTRAINED for e in rest):
    return x
  return jax.lax.with_sharding_constraint(x, P(*rest))


def plain(x: Any) -> Any:
  """``x`` as an ordinary value: without ``reduced`` axes (its cotangent
  reduced here) or ``unreduced`` ones (reduced here)."""
  spec = spec_of(x)
  if spec is None or not (spec.reduced or spec.unreduced):
    return x
  return reshard(x, P(*spec.partitions))
