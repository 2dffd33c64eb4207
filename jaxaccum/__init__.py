"""jaxaccum: gradient accumulation over micro-batches for JAX and Flax.

The public surface:

- :func:`value_and_grad`, :func:`grad`: drop-ins for ``jax.value_and_grad``
  and ``jax.grad`` that split the batch into micro-batches and accumulate
  inside one ``lax.scan``.
- :func:`accumulate`: an optax transformation that accumulates across calls
  and runs the inner optimizer once per window.
- :func:`verify_equivalence`: checks accumulation against the full batch.
"""

from jaxaccum._accumulate import grad as grad
from jaxaccum._accumulate import value_and_grad as value_and_grad
from jaxaccum._checks import Deviation as Deviation
from jaxaccum._checks import verify_equivalence as verify_equivalence
from jaxaccum._transform import AccumulateState as AccumulateState
from jaxaccum._transform import accumulate as accumulate

__version__ = "0.1.0"
