"""Each differentiated leaf's :class:`Placement`: the one place where the
data-parallel strategy is chosen per leaf.

Every data-parallel step (the per-device view of ``mesh=``, its global
view, plain ``jit`` on JAX's ``reduced``/``unreduced`` types) runs the same
five moves (:mod:`jaxaccum._parallel.skeleton`), and a leaf's placement says
what each of them does with it: what happens to it before the loop, along
which data axes each device keeps its own share of its gradient until the
one reduction after the loop, how its accumulator is laid out, and whether
an optimization barrier keeps its gather inside the loop.

- **replicated** leaves (not sharded over a data axis): a share per device,
  reduced once, after the loop;
- **FSDP** leaves (sharded over data axes), by ``fsdp_gather``:

  - ``"per_micro_batch"`` (default): as they are, each micro-batch's
    gradient reduce-scattered inside the backward pass into a float32
    accumulator sharded like the parameter; an optimization barrier keeps
    each weight's gather inside the loop, where the full-batch step has it.
    Under ``mesh=`` HSDP's replica axes (the data axes a leaf is replicated
    over) keep a share per device, reduced after the loop; under plain
    ``jit`` they stay with the partitioner (JAX types a contraction over
    rows sharded over ``(replica, fsdp)`` as unreduced over all of them or
    none).
  - ``"cast_once"``: cast to ``gather_dtype`` and gathered once per step,
    before the loop; reduce-scattered per micro-batch as above.
  - ``"once"``: gathered once, in its own dtype; the whole gradient kept per
    device and reduce-scattered once after the loop. No collective inside
    the loop.

:func:`for_mesh` places the leaves of ``mesh=`` (a copy per device of
what each device keeps), :func:`on_types` those of plain ``jit`` (typed
``reduced`` over what each device keeps).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
from jax.sharding import PartitionSpec as P

from jaxaccum import _accumulator, _compat
from jaxaccum._options import Options
from jaxaccum._parallel import specs as _specs

PyTree = Any

#: What happens to a leaf before the loop, by ``fsdp_gather`` for an FSDP
#: leaf (any other leaf enters as it is).
BEFORE_LOOP = {"per_micro_batch": "as_is", "cast_once": "cast_gather", "once": "gather"}


class Placement(NamedTuple):
  """How one differentiated leaf is placed, accumulated and reduced.

  Attributes:
    spec: its spec cut along the data axes (None where its sharding is
      hidden: under ``mesh=`` treated as replicated over the data axes and
      left to the partitioner along the others; under plain ``jit``, a leaf
      off an Explicit mesh, left to the partitioner).
    copies: the data axes along which each device keeps its own share of
      the leaf's gradient until the one reduction after the loop: under
      ``mesh=`` each device gets its own copy of the leaf; under plain
      ``jit`` the leaf is typed ``reduced`` over them (its cotangent comes
      back ``unreduced``). The leaf's other data axes (those it is sharded
      over) share it: its gradient is summed over them inside the backward
      pass.
    before_loop: ``"as_is"``, ``"gather"`` (gathered over its data axes
      once, before the loop) or ``"cast_gather"`` (cast to ``gather_dtype``
      first).
    accumulator: the spec of its accumulator (under ``mesh=``, of one
      device's copy; plain ``jit``'s with its ``unreduced`` axes); None
      where it is left as the gradient comes.
    barrier: it passes an optimization barrier with the micro-batch index
      in each micro step, so that its gather is not hoisted out of the loop.
    combine: how its micro-batches' terms combine, and its devices' after
      the loop (:class:`jaxaccum._accumulator.Rule`: a gradient's sum, an
      FP8 amax's max); set by the step (:func:`combined`).
  """

  spec: _specs.SplitSpec | None
  copies: tuple[str, ...] = ()
  before_loop: str = "as_is"
  accumulator: P | None = None
  barrier: bool = False
  combine: _accumulator.Rule = _accumulator.GRADIENT

  @property
  def shared(self) -> bool:
    """Whether some data axes share the leaf (its gradient is summed over
    them inside the backward pass)."""
    return is_fsdp(self.spec) and self.before_loop != "gather"

  @property
  def blocked(self) -> bool:
    """Whether the leaf reaches the micro step sharded over the data axes
    it is shared along (not gathered before the loop)."""
    return self.shared and self.before_loop == "as_is"

  def mapped(self, axis: str) -> bool:
    """Whether the per-device view's ``vmap`` over ``axis`` maps the leaf:
    along its copies, and along the axes a blocked leaf is sharded over."""
    return axis in self.copies or self.blocked


def for_mesh(
  options: Options, layout: tuple[_specs.SplitSpec | None, ...]
) -> tuple[Placement, ...]:
  """The placements of ``mesh=``'s leaves, whose split specs ``layout``
  gives (:func:`jaxaccum._parallel.layout.layout`): a copy per device along
  ``copies``, each copy's accumulator sharded like the leaf in the loop."""
  o = options
  axes = o.data_axes
  assert axes is not None
  mode = o.fsdp_gather
  if o.rule is not None and o.rule.whole_gradients and o.view == "device":
    # Each example's gradient is clipped by its norm over every leaf, so
    # each device computes whole gradients: FSDP leaves gathered once.
    # Ghost clipping needs no per-example gradient: its weighted backward
    # pass is shared like the non-private step's.
    mode = "once"
  placed = []
  for s in layout:
    fsdp = is_fsdp(s)
    before = BEFORE_LOOP[mode] if fsdp else "as_is"
    copies = kept_axes(s, axes) if fsdp and mode != "once" else axes
    accumulator = None
    if s is not None:
      accumulator = s.other_spec() if before == "gather" else s.full_spec()
    barrier = fsdp and mode == "per_micro_batch"
    placed.append(Placement(s, copies, before, accumulator, barrier))
  return tuple(placed)


def on_types(x: Any, axes: tuple[str, ...], mode: str, reducible: bool) -> Placement:
  """The placement of plain ``jit``'s leaf ``x`` with the batch on data
  ``axes`` of an Explicit mesh, under ``fsdp_gather=mode``; ``reducible``
  says whether some use of it in ``fun`` keeps it ``reduced``
  (:meth:`jaxaccum._parallel.reduced.Evaluated.probe`). Its own type (its
  partitions, any ``reduced`` axes it has) is read from the leaf."""
  own = _compat.explicit_spec(x)
  if own is None:
    return Placement(None)
  spec = _specs.split_spec(own, len(own.partitions), axes, mixed=True)
  fsdp = is_fsdp(spec)
  before = BEFORE_LOOP[mode] if fsdp else "as_is"
  if fsdp and mode == "per_micro_batch":
    # HSDP's replica axes stay with the partitioner too (module docstring).
    return Placement(spec, _ordered(own.reduced), "as_is", P(*own.partitions), True)
  if before == "cast_gather":  # reduce-scattered into a sharded sum
    return Placement(spec, axes if reducible else (), before, P(*own.partitions))
  inside = spec.other_spec()
  if not reducible:  # the partitioner reduces each micro-batch's gradient
    return Placement(spec, (), before, P(*inside.partitions))
  copies = (*axes, *_ordered(set(own.reduced) - set(axes)))
  return Placement(spec, copies, before, _specs.typed(inside, unreduced=axes))


def combined(
  placements: Sequence[Placement],
  rules: Sequence[_accumulator.Rule],
  paths: Sequence[str],
) -> tuple[Placement, ...]:
  """``placements`` with each leaf's combine rule. A leaf that is not summed
  (an FP8 amax) and is shared by the devices of a data axis (FSDP), whose
  gradient the backward pass sums over them, is a ``ValueError``."""
  for p, r, path in zip(placements, rules, paths, strict=True):
    if not r.summed and p.shared:
      raise ValueError(
        f"The leaf {path} combines by {r.name!r} (not a gradient: an FP8 "
        "scale or amax, or combine=), and is sharded over the data axes "
        f"({sorted(p.spec.data_axes_used()) if p.spec else ''}), whose backward "
        "pass sums it over them: replicate it over the data axes."
      )
  return tuple(p._replace(combine=r) for p, r in zip(placements, rules, strict=True))


def each(
  fun: Callable[..., Any], placements: Sequence[Placement], *trees: PyTree
) -> PyTree:
  """``fun(*leaves, placement)`` over the leaves of ``trees`` (shaped like
  the differentiated arguments) and ``placements``, one per leaf."""
  flat = [jax.tree.flatten(t) for t in trees]
  leaves = [
    fun(*xs, p) for *xs, p in zip(*(f[0] for f in flat), placements, strict=True)
  ]
  return jax.tree.unflatten(flat[0][1], leaves)


def is_fsdp(s: _specs.SplitSpec | None) -> bool:
  """Whether a leaf is sharded over data axes (FSDP)."""
  return s is not None and bool(s.sharded_dims())


def kept_axes(s: _specs.SplitSpec | None, axes: tuple[str, ...]) -> tuple[str, ...]:
  """The data axes a leaf is replicated over (HSDP's replica axes)."""
  used = frozenset() if s is None else s.data_axes_used()
  return tuple(a for a in axes if a not in used)


def _ordered(names: Any) -> tuple[str, ...]:
  return tuple(sorted(names))
