"""How a ``PartitionSpec`` splits into its data part and the rest.

The data-parallel path splits the batch over the *data* axes and keeps every
other mesh axis (tensor-parallel ``"model"``, say) as the parameters have it.
A :class:`SplitSpec` is a parameter's spec cut in two along that line: the
data axes a dimension is sharded over (FSDP), and the other axes.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    return P(*(_entry(names) for names in self.data))

  def other_spec(self, axes: frozenset[str] | None = None) -> P:
    """The rest (restricted to ``axes`` if given), as a ``PartitionSpec``."""
    return P(
      *(
        _entry(tuple(n for n in names if axes is None or n in axes))
        for names in self.other
      )
    )

  def full_spec(self) -> P:
    """Data and other axes together: the spec the array had."""
    return P(*(_entry(d + o) for d, o in zip(self.data, self.other, strict=True)))

  def sharded_dims(self) -> tuple[tuple[int, tuple[str, ...]], ...]:
    """``(dim, data_axes)`` for every dimension sharded along data axes."""
    return tuple((d, names) for d, names in enumerate(self.data) if names)

  def data_axes_used(self) -> frozenset[str]:
    return frozenset(n for names in self.data for n in names)


def _entry(names: tuple[str, ...]) -> Any:
  if not names:
    return None
  return names[0] if len(names) == 1 else names


def split_spec(
  spec: P | None, ndim: int, data_axes: Sequence[str], what: str = "An array"
) -> SplitSpec:
  """Cuts ``spec`` into its data part and the rest; ``None`` is replicated.

  Raises:
    ValueError: if one dimension is sharded along a data axis and another
      axis together, which a per-device split cannot express.

  >>> split_spec(P(("replica", "fsdp"), "model"), 2, ("replica", "fsdp"))
  SplitSpec(data=(('replica', 'fsdp'), ()), other=((), ('model',)))
  >>> split_spec(None, 1, ("data",)).data_spec() == P(None)
  True
  """
  data: list[tuple[str, ...]] = []
  other: list[tuple[str, ...]] = []
  entries = tuple(spec) if spec is not None else ()
  for dim in range(ndim):
    entry = entries[dim] if dim < len(entries) else None
    names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
    names = tuple(n for n in names if n is not P.UNCONSTRAINED)
    in_data = tuple(n for n in names if n in data_axes)
    rest = tuple(n for n in names if n not in data_axes)
    if in_data and rest:
      raise ValueError(
        f"{what} is sharded along {names} in dimension {dim}: data axes "
        f"{tuple(data_axes)} and other mesh axes together. jaxaccum splits "
        "every device's data shard locally, so a dimension may be sharded "
        "along data axes or along other axes, not both."
      )
    data.append(in_data)
    other.append(rest)
  return SplitSpec(tuple(data), tuple(other))
