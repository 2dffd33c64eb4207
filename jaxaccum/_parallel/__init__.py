"""Data parallelism: each device accumulates its own rows, and the gradients
are reduced across devices once per step.

- :mod:`~jaxaccum._parallel.route`: which path runs a step (one function);
- :mod:`~jaxaccum._parallel.placement`: each leaf's :class:`Placement`, the
  one place the strategy is chosen per leaf;
- :mod:`~jaxaccum._parallel.skeleton`: the five moves every data-parallel
  step makes (place, loop, hold, sum, reduce), which
- :mod:`~jaxaccum._parallel.device_view` (``mesh=``: ``fun`` on one
  device's rows, a ``vmap`` over the devices' blocks, with DP-SGD's micro
  steps in :mod:`~jaxaccum._parallel.clipped_steps`),
  :mod:`~jaxaccum._parallel.global_view` (``mesh=``, ``view="global"``) and
  :mod:`~jaxaccum._parallel.unreduced` (plain ``jit`` on an Explicit mesh,
  on JAX's ``reduced``/``unreduced`` types) fill in;
- :mod:`~jaxaccum._parallel.reduced`: ``fun`` evaluated with its parameters
  typed ``reduced``, each use rewritten into one JAX types (a ``cond``, a
  ``scan`` and a convolution of a reduced kernel rebuilt in
  :mod:`~jaxaccum._parallel.rebuilt`);
- :mod:`~jaxaccum._parallel.layout`: ``mesh=``'s leaves' specs, what a
  compiled step depends on;
- :mod:`~jaxaccum._parallel.devices`: the devices of the data axes, as the
  per-device view lays them out;
- :mod:`~jaxaccum._parallel.specs` and :mod:`~jaxaccum._parallel.types`:
  ``PartitionSpec`` algebra, and values' sharding types;
- :mod:`~jaxaccum._parallel.options`: :class:`DataParallel`, the group of
  data-parallel options.
"""

from jaxaccum._parallel.options import DataParallel as DataParallel
