"""What a compiled ``mesh=`` step depends on besides static values: each
differentiated leaf's spec, cut along the data axes.

A spec comes from ``param_specs`` if given, else from the arrays: their
sharding outside ``jit``, their type on Explicit axes inside it. Under
``jit`` on Auto axes without ``param_specs`` it is hidden (None): such a
leaf counts as replicated over the data axes, with a warning where it may
well not be (:func:`warn_if_hidden`).
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxaccum import _compat
from jaxaccum._options import Options
from jaxaccum._parallel import specs as _specs

PyTree = Any
#: Per leaf of the differentiated arguments, its split spec (None: hidden).
Layout = tuple["_specs.SplitSpec | None", ...]


class HiddenShardingWarning(UserWarning):
  """The parameters' shardings are not visible to ``mesh=`` (under ``jit`` on
  Auto axes, without ``param_specs``), and they are treated as replicated."""


def layout(options: Options, args: tuple[Any, ...]) -> Layout:
  """Per leaf of the differentiated arguments, its split spec if known.

  From ``param_specs`` if given, else from the arrays: their sharding
  outside ``jit``, their type on Explicit axes inside it. Unknown (None)
  means replicated along the data axes. ``options`` are ``mesh=``'s, with
  their positions resolved for ``args``.
  """
  o = options
  assert o.mesh is not None and o.data_axes is not None
  specs: list[Any] = []
  given = o.param_specs
  if given is not None and len(o.argnums) == 1:
    given = (given,)
  for j, n in enumerate(o.argnums):
    arg = args[n]
    if given is not None:
      leaf_specs = _broadcast_specs(given[j], arg, o.names(n))
    else:
      leaf_specs = [_known_spec(x) for x in jax.tree.leaves(arg)]
    for (path, x), spec in zip(
      jax.tree_util.tree_leaves_with_path(arg), leaf_specs, strict=True
    ):
      what = f"The parameter {o.names(n)}{jax.tree_util.keystr(path)}"
      if spec is not None:
        _check_divides(o.mesh, what, jnp.shape(x), spec)
      specs.append(
        None
        if spec is None
        else _specs.split_spec(spec, jnp.ndim(x), o.data_axes, what)
      )
  return tuple(specs)


def warn_if_hidden(options: Options, layout: Layout, args: tuple[Any, ...]) -> None:
  """Warns, once per traced step, where the parameters' shardings are not
  visible (under ``jit`` on Auto axes, without ``param_specs``) and they
  may well be sharded over the data axes: the mesh has devices beyond the
  data axes, or a parameter is large. Silent where the user cannot do
  better: small parameters on a mesh of data axes only."""
  o = options
  assert o.mesh is not None
  unknown = [
    (path, x)
    for n in o.argnums
    for path, x in jax.tree_util.tree_leaves_with_path(args[n])
  ]
  unknown = [pair for pair, s in zip(unknown, layout, strict=True) if s is None]
  if not unknown:
    return
  large = [
    (path, x) for path, x in unknown if jnp.size(x) * jnp.dtype(x).itemsize >= 2**20
  ]
  if o.mesh.size == o.data_devices and not large:
    return
  path, _ = (large or unknown)[0]
  name = f"{o.names(o.argnums[0])}{jax.tree_util.keystr(path)}"
  more = f" and {len(unknown) - 1} more leaves" if len(unknown) > 1 else ""
  warnings.warn(
    f"jaxaccum: under jit on a mesh with Auto axes the parameters' shardings "
    f"are not visible, so {name}{more} count as not sharded over the data "
    f"axes {o.data_axes}: a parameter sharded over them (FSDP) is gathered "
    "whole on every device (its sharding along other axes is left to the "
    "partitioner). Pass "
    "param_specs=jax.tree.map(lambda x: x.sharding.spec, params), computed "
    "outside jit (or a tree prefix of PartitionSpecs), or use a mesh with "
    "Explicit axes (jax.make_mesh(..., axis_types=(AxisType.Explicit,) * n)). "
    "If they are replicated, param_specs=jax.sharding.PartitionSpec() says so "
    "and silences this.",
    HiddenShardingWarning,
    stacklevel=2,
  )


def _check_divides(
  mesh: jax.sharding.Mesh, what: str, shape: tuple[int, ...], spec: P
) -> None:
  """Each dimension of a parameter divides among the devices its spec
  shards it over (JAX's own error, before the loss runs, names neither
  the parameter nor ``param_specs``)."""
  for dim, (size, entry) in enumerate(zip(shape, spec.partitions, strict=False)):
    devices = 1
    for name in _specs.names(entry):
      devices *= mesh.shape[name]
    if size % devices:
      raise ValueError(
        f"{what} has shape {shape}, and its spec {spec} shards dimension "
        f"{dim} (size {size}) over {devices} devices ({entry!r}), which do "
        f"not divide it: choose a size that {devices} divides, or another "
        "spec (param_specs=)."
      )


def _known_spec(x: Any) -> P | None:
  """``x``'s ``PartitionSpec`` where it can be known: its type or sharding;
  ``P()`` for a concrete array not sharded over a mesh; None for a value
  traced on Auto axes, whose sharding is hidden."""
  spec = _compat.visible_spec(x)
  if spec is None and not _compat.is_tracer(x):
    return P()
  return spec


def _broadcast_specs(spec_tree: Any, arg: PyTree, name: str) -> list[P | None]:
  """One spec per leaf of ``arg`` from ``spec_tree``, a tree prefix of it."""
  is_spec = lambda s: isinstance(s, P) or s is None  # noqa: E731
  specs: list[P | None] = []
  try:
    jax.tree.map(
      lambda s, sub: specs.extend([s] * len(jax.tree.leaves(sub))),
      spec_tree,
      arg,
      is_leaf=is_spec,
    )
  except ValueError as error:
    raise ValueError(
      f"param_specs does not match the structure of {name}: it must be a tree "
      "prefix of the differentiated argument, a PartitionSpec (or None) where "
      f"a subtree shares one. {error}"
    ) from None
  return specs
