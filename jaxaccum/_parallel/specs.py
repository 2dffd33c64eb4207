"""``PartitionSpec`` algebra: how a spec splits into its data part and the
rest, and the entries it is made of.

The data-parallel path splits the batch over the *data* axes and keeps every
other mesh axis (tensor-parallel ``"model"``, say) as the parameters have it.
A :class:`SplitSpec` is a parameter's spec cut in two along that line: the
data axes a dimension is sharded over (FSDP), and the other axes. The
functions below read and rewrite one spec entry (``None``, an axis name or a
tuple of them) or a whole spec; :mod:`jaxaccum._parallel.types` applies
specs to values.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, NamedTuple

from jax.sharding import PartitionSpec as P


class SplitSpec(NamedTuple):
  """A ``PartitionSpec`` cut in two along the data axes.

  Attributes:
    data: per dimension, the data axes it is sharded over (a tuple, in
      order; empty where none).
    other: per dimension, the other axes it is sharded over.
  """

  data: tuple[tuple[str, ...], ...]
  other: tuple[tuple[str, ...], ...]

  def data_spec(self) -> P:
    """The data part, as ``shard_map`` wants it for its manual axes."""
    return P(*(entry(axes) for axes in self.data))

  def other_spec(self, axes: frozenset[str] | None = None) -> P:
    """The rest (restricted to ``axes`` if given), as a ``PartitionSpec``."""
    return P(
      *(entry(tuple(n for n in dim if axes is None or n in axes)) for dim in self.other)
    )

  def full_spec(self) -> P:
    """Data and other axes together: the spec the array had."""
    return P(*(entry(d + o) for d, o in zip(self.data, self.other, strict=True)))

  def sharded_dims(self) -> tuple[tuple[int, tuple[str, ...]], ...]:
    """``(dim, data_axes)`` for every dimension sharded along data axes."""
    return tuple((d, axes) for d, axes in enumerate(self.data) if axes)

  def data_axes_used(self) -> frozenset[str]:
    return frozenset(n for axes in self.data for n in axes)


def split_spec(
  spec: P | None,
  ndim: int,
  data_axes: Sequence[str],
  what: str = "An array",
  *,
  mixed: bool = False,
) -> SplitSpec:
  """Cuts ``spec`` into its data part and the rest; ``None`` is replicated.

  Raises:
    ValueError: if one dimension is sharded along a data axis and another
      axis together, which a per-device split cannot express (unless
      ``mixed``: plain ``jit`` on JAX's types, which splits nothing per
      device, takes such a dimension).

  >>> split_spec(P(("replica", "fsdp"), "model"), 2, ("replica", "fsdp"))
  SplitSpec(data=(('replica', 'fsdp'), ()), other=((), ('model',)))
  >>> split_spec(None, 1, ("data",)).data_spec() == P(None)
  True
  """
  data: list[tuple[str, ...]] = []
  other: list[tuple[str, ...]] = []
  entries = tuple(spec) if spec is not None else ()
  for dim in range(ndim):
    found = names(entries[dim] if dim < len(entries) else None)
    in_data = tuple(n for n in found if n in data_axes)
    rest = tuple(n for n in found if n not in data_axes)
    if in_data and rest and not mixed:
      raise ValueError(
        f"{what} is sharded along {found} in dimension {dim}: data axes "
        f"{tuple(data_axes)} and other mesh axes together. jaxaccum splits "
        "every device's data shard locally, so a dimension may be sharded "
        "along data axes or along other axes, not both."
      )
    data.append(in_data)
    other.append(rest)
  return SplitSpec(tuple(data), tuple(other))


def names(entry: Any) -> tuple[str, ...]:
  """The axis names of a spec entry (none for ``None`` or unconstrained).

  >>> names(("replica", "fsdp")), names("data"), names(None)
  (('replica', 'fsdp'), ('data',), ())
  """
  if entry is None or entry is P.UNCONSTRAINED:
    return ()
  return entry if isinstance(entry, tuple) else (entry,)


def entry(names: tuple[str, ...]) -> Any:
  """The spec entry of ``names``: ``None``, one name, or a tuple of them."""
  if not names:
    return None
  return names[0] if len(names) == 1 else names


def only(e: Any, axes: Collection[str]) -> Any:
  """A spec entry restricted to ``axes``."""
  return entry(tuple(n for n in names(e) if n in axes))


def without(e: Any, axes: Collection[str]) -> Any:
  """A spec entry without ``axes``."""
  return entry(tuple(n for n in names(e) if n not in axes))


def uses(spec: P, axes: Collection[str]) -> frozenset[str]:
  """The ``axes`` that ``spec`` shards a dimension over."""
  return frozenset(n for e in spec.partitions for n in names(e) if n in axes)


def shards(spec: P, axes: Collection[str]) -> bool:
  """``spec`` shards a dimension over some of ``axes``."""
  return bool(uses(spec, axes))


def covers(spec: P | None, axes: Collection[str]) -> bool:
  """``spec`` shards its dimensions over all of ``axes``."""
  if spec is None:
    return False
  return set(axes) <= {n for e in spec.partitions for n in names(e)}


def typed(
  spec: P,
  reduced: Collection[str] = frozenset(),
  unreduced: Collection[str] = frozenset(),
) -> P:
  """``spec``'s partitions with ``reduced`` and ``unreduced`` axes."""
  return P(*spec.partitions, reduced=set(reduced), unreduced=set(unreduced))
