"""Pipeline parallelism: micro-batches through stages of layers, in one loop.

``pipeline(layer_fn, ...)`` returns ``pipe(stacked, x, *args)``, which equals
a ``lax.scan`` of ``layer_fn`` over the ``L`` stacked layers, for values and
gradients, while each of ``S`` stages holds only its own layers.

The layout is MaxText's circular pipeline, written as one function of
``(stacked, x)``:

- **Stages.** Stage ``s`` holds layers ``s·n .. s·n + n - 1`` of each repeat,
  ``n = L / (S·r)``. With ``repeats = 1`` the leaves are ``(L, ...)`` and
  their leading axis is sharded over the stage axis; with ``repeats = r > 1``
  they are ``(r, L / r, ...)``, one row of layers per repeat, and the second
  axis is sharded: in both, a stage's layers are one block of the sharding.
- **The loop.** One ``lax.scan`` of ``(r - 1)·max(m, S) + m + S - 1``
  iterations (``m`` the pipeline micro-batches): ``r·m + S - 1`` when ``m >=
  S`` or ``r = 1``; with ``m < S`` and ``r > 1`` a micro-batch is back at
  stage 0 only ``S`` iterations after it left, so the repeats start every
  ``S`` iterations, ``r·S + m - 1`` in all. Each iteration every stage runs
  its ``n`` layers on one micro-batch, then the activations move one stage
  on (a ``collective-permute``; the last stage's goes back to the first for
  the next repeat). Stage 0 reads its inputs from, and parks the returning
  activations in, one buffer of the batch; the last stage writes the results
  into its own. Stages written as one body over a named stage axis: a
  ``shard_map`` over the mesh's stage axis, or, without a mesh, a ``vmap``
  over stages on one device (the same numbers, for testing and debugging).
- **Micro-batches.** Pipeline micro-batch ``j`` holds rows ``j, j + m, j +
  2m, ...`` of the batch (every ``m``-th row), so that a batch sharded over
  devices is split where it lies; the output rows come back in the input's
  order.
- **Keys.** With ``rng_argnum``, layer ``l`` (its index among the ``L``) on
  micro-batch ``j`` gets ``fold_in(fold_in(key, j), l)``; data shard ``d``'s
  micro-batch ``j`` counts as ``d·m + j``.
- **Memory.** Each stage's ``n`` layers are rematerialized (``remat=True``):
  the backward pass keeps one micro-batch's activation per iteration.

One module each:

- :mod:`~jaxaccum._pipeline.pipeline`: :func:`pipeline`, and the ``pipe`` it
  returns, which plans, checks and runs the loop on a mesh or one device;
- :mod:`~jaxaccum._pipeline.schedule`: :class:`Schedule`, the loop's length
  and what each stage works on at each iteration;
- :mod:`~jaxaccum._pipeline.arguments`: the trace-time checks of ``pipe``'s
  options and arguments, and its extra arguments, traced or static;
- :mod:`~jaxaccum._pipeline.layout`: where the stages lie: the mesh, the
  stacked layers' placement on the stage axis, the data axes;
- :mod:`~jaxaccum._pipeline.loop`: one stage's layers, and the loop over the
  iterations that moves the activations between stages.

The pipeline imports only the core (``tests/test_layering.py``).
"""

from jaxaccum._pipeline.layout import ReplicatedLayersWarning as ReplicatedLayersWarning
from jaxaccum._pipeline.schedule import PipelineBubbleWarning as PipelineBubbleWarning
from jaxaccum._pipeline.schedule import Schedule as Schedule
