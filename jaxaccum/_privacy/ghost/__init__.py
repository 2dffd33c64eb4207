"""Ghost clipping: DP-SGD's clipped sum without per-example gradients.

``clip_method="ghost"`` computes the same thing as the default
``clip_method="vmap"`` (:func:`jaxaccum._privacy.clipped_value_and_grad`):
the sum over a micro-batch of each example's gradient scaled to L2 norm at
most ``C``. It reads each example's gradient *norm* from the traced program
instead of materializing the gradient, in three steps:

1. **Trace.** ``fun`` on one example is traced to a jaxpr; each
   differentiated leaf is followed through the operations that only view it
   (reshape, transpose, cast, broadcast, nested ``jit``), and each other
   operation that reads it is a *use*.
2. **Tap.** The jaxpr is evaluated for every example (``vmap``) with a zero
   *tap* added at each use, and one backward pass gives each tap's
   cotangent per example:

   - a ``dot_general`` between the leaf and an activation ``a`` (a dense
     layer, an attention projection): the tap is on the product's output,
     whose cotangent ``g`` gives the norm of ``a``'s and ``g``'s product,
     ``sum_{s,t} <a_s, a_t><g_s, g_t>`` over the example's tokens (the Gram
     form), or that product itself where it is smaller (``2 S^2 > C F``,
     chosen per use as Bu et al. 2022's book-keeping does);
   - a ``gather`` of whole rows (an embedding lookup): the tap is on the
     rows gathered, ``sum_{s,t} [row_s = row_t] <g_s, g_t>``;
   - any other use (a bias add, a LayerNorm scale, a convolution kernel), and
     every use of a leaf used more than once: the tap is on the operand the
     use reads, whose cotangent is that use's per-example gradient, summed
     back to the leaf's shape. For an elementwise use it is as large as the
     activation it meets; for another use (a convolution, a ``scan``), or a
     leaf used more than once with a ``dot_general`` or a ``gather`` among its
     uses, it is the leaf's per-example gradient (the ``"vmap"`` cost, for
     that leaf only). Such leaves are named in a
     :class:`GhostFallbackWarning` at trace time. A convolution's kernel is
     not given a tap of its own per example: a zero added to the output
     whose backward pass takes the example's kernel gradient one window
     offset at a time (:func:`kernel_tap`), so that no convolution is
     grouped over the examples.
3. **Weigh.** The squared norms are summed over the leaves, and a second
   forward and backward pass of ``fun`` over the rows, with example ``i``'s
   loss weighted by ``min(1, C / norm_i)`` (0 for a masked or non-finite
   row), gives the clipped sum. The first pass's activations are dead by
   then, so the peak is one pass's (plus the taps' cotangents, as large as
   the activations they meet), at the price of a second forward pass. In the
   second pass each row that is not kept is replaced by a kept one, so that
   its weight 0 multiplies finite numbers and it adds exactly zero.

   Where ``fun`` computes in a narrower dtype than the accumulator's
   (bfloat16 parameters, or a cast to bfloat16 in ``fun``), there is no
   second pass: its bfloat16 backward pass would round the factors and
   contract the rows in bfloat16, and it would not reproduce the first
   pass's bfloat16 values bit for bit (XLA keeps excess precision in a
   fusion as it sees fit: the clipped share of an outlier came out 0.27%
   below C). The clipped sum is formed instead from the first pass's own
   activations and cotangents (Bu et al. 2022's book-keeping), in float32,
   each row's share its factor times the very gradient its norm was taken
   from (:func:`kept_sums`). The price: every tapped cotangent is held
   until the norms are known.

The clipped sum is the gradient of a loss, :func:`weighted_loss`, with
respect to the differentiated leaves in the accumulator's dtype (float32
masters of bfloat16 leaves): under ``mesh=`` the devices' losses are summed
and differentiated together, so that an FSDP leaf's clipped sums are
reduce-scattered inside the backward pass, as the non-private step's
gradients are, and no device holds a whole gradient of it (in float32, the
second pass's; in bfloat16, each device's book-kept sum of its rows).
"""

from jaxaccum._privacy.ghost.passes import Weighted as Weighted
from jaxaccum._privacy.ghost.passes import clipped_sum as clipped_sum
from jaxaccum._privacy.ghost.passes import kept_only as kept_only
from jaxaccum._privacy.ghost.passes import masters as masters
from jaxaccum._privacy.ghost.passes import weighted_loss as weighted_loss
from jaxaccum._privacy.ghost.uses import METHODS as METHODS
from jaxaccum._privacy.ghost.uses import GhostFallbackWarning as GhostFallbackWarning
from jaxaccum._privacy.ghost.uses import check_method as check_method
