"""Data parallelism: each device accumulates its own rows, and the gradients
are reduced across devices once per step.

- :mod:`~jaxaccum._parallel.data_parallel`: ``mesh=``, the per-device view
  (a ``vmap`` over the devices' blocks) and the global view;
- :mod:`~jaxaccum._parallel.unreduced`: plain ``jit`` on an Explicit mesh,
  on JAX's ``reduced``/``unreduced`` types;
- :mod:`~jaxaccum._parallel.reduced`: ``fun`` evaluated with its parameters
  typed ``reduced``, each use rewritten into one JAX types;
- :mod:`~jaxaccum._parallel.options`: :class:`DataParallel`, the group of
  data-parallel options;
- :mod:`~jaxaccum._parallel.specs`: how a ``PartitionSpec`` splits into its
  data part and the rest.
"""

from jaxaccum._parallel.options import DataParallel as DataParallel
