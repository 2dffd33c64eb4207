"""``mesh=`` with ``view="global"`` where JAX's types cannot carry the step
(Auto data axes, or a batch not sharded over them): ``fun`` on the global
micro-batch, as under plain ``jit``, each micro-batch the ``i``-th slice of
every device's rows (no row moves); the partitioner places every
collective. The accumulator is kept sharded like the parameters, and FSDP
leaves keep their gathers inside the loop (an optimization barrier), as in
the default view. On Explicit data axes that the batch is sharded over,
``view="global"`` is plain ``jit``'s step instead
(:mod:`jaxaccum._parallel.unreduced`; :func:`jaxaccum._parallel.route.route`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxaccum import _accumulator, _engine
from jaxaccum._engine import Engine
from jaxaccum._parallel import types as _types
from jaxaccum._parallel.placement import Placement
from jaxaccum._parallel.skeleton import Step


def runner(
  engine: Engine, placements: Sequence[Placement]
) -> Callable[[tuple[Any, ...], dict[str, Any]], _engine.Result]:
  """``run(args, kwargs)``: the :class:`GlobalStep` of these arguments,
  planned for the global batch. ``fsdp_gather="once"`` over two
  micro-batches or more is refused here, when the step is run (plain
  ``jit``'s step, which ``view="global"`` takes on Explicit data axes, has
  it): it needs a gradient per device."""

  def run(args: tuple[Any, ...], kwargs: dict[str, Any]) -> _engine.Result:
    split = engine.plan(args)
    if engine.options.fsdp_gather == "once" and split.num_micro_batches > 1:
      raise ValueError(
        "fsdp_gather='once' keeps a gradient per device until after the loop: "
        "view='global' has it on Explicit data axes that the batch is sharded "
        "over, for a step that needs no statistic of a micro-batch's whole "
        "gradient (no clip_per_example or noise_stats), and view='device' "
        "(fun on one device's rows) always; otherwise choose "
        "fsdp_gather='per_micro_batch' or 'cast_once'."
      )
    _engine.check_noise_estimable(engine.options, split.num_micro_batches)
    return GlobalStep(engine, placements, split)(args, kwargs)

  return run


class GlobalStep(Step):
  """The step of the module docstring."""

  def before_loop(self, x: jax.Array, p: Placement) -> jax.Array:
    """``"cast_once"``'s leaves cast and gathered; the others as they are."""
    if p.before_loop != "cast_gather" or p.spec is None:
      return x
    gathered = x.astype(self.options.gather_dtype)
    return _types.constrain(gathered, p.spec.other_spec())

  def leaf_sum(self, p: Placement) -> _accumulator.LeafSum:
    """Sharded like the parameter (left to the partitioner where its
    sharding is hidden)."""
    spec = p.accumulator
    if spec is None:
      return _accumulator.LeafSum()
    return _accumulator.LeafSum(layout=lambda x: _types.constrain(x, spec))

  def reduce(self, sums: _engine.Sums, args: tuple[Any, ...]) -> _engine.Result:
    """Normalized, each gradient then in its parameter's sharding: the
    partitioner placed the reductions."""
    diff_args = tuple(args[n] for n in self.options.argnums)
    result = self.engine.finish(sums, diff_args, args)
    clipped = result.sums  # DP-SGD's clipped sums, laid out as the gradients
    return result._replace(
      grads=self.map(self.after_loop, result.grads, diff_args),
      sums=None if clipped is None else self.map(self.after_loop, clipped, diff_args),
    )

  def after_loop(self, g: jax.Array, x: jax.Array, p: Placement) -> jax.Array:
    """``g`` in the sharding of its parameter ``x``."""
    del x
    return g if p.spec is None else _types.constrain(g, p.spec.full_spec())
