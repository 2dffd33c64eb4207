"""DP-SGD's noise: :func:`dp_noise`, an optax transformation that adds
``N(0, (sigma * C)^2)`` to the clipped *sum* once per update, i.e. once per
logical batch (once per ``make_train_step`` step, once per window of
``accumulate()``), and the :class:`ClipRecord` that proves to it that what it
received is that clipped sum.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxaccum import _tree
from jaxaccum._checks import check_number, describe
from jaxaccum._options import check_clip_norm

PyTree = Any

NORMALIZATIONS = ("poisson", "fixed")


@dataclasses.dataclass(frozen=True)
class NoiseConfig:
  """What :func:`dp_noise` adds and divides by; static (no array leaves), so
  that ``make_train_step`` and ``accumulate`` read it at trace time.

  Attributes:
    noise_multiplier: sigma; the noise's standard deviation is
      ``noise_multiplier * clip_norm``.
    clip_norm: C, the per-example clipping norm.
    normalize: ``"poisson"`` (divide by ``expected_batch_size``) or
      ``"fixed"`` (divide by the actual number of examples).
    expected_batch_size: ``q * N`` for Poisson sampling, else None.
  """

  noise_multiplier: float
  clip_norm: float
  normalize: str
  expected_batch_size: float | None


jax.tree_util.register_static(NoiseConfig)


class ClipRecord:
  """A clipped sum and how it was made: what :func:`dp_noise` checks it
  received, straight from the step that clipped.

  ``make_train_step`` (and ``jaxaccum.nnx.make_train_step``) hand one to the
  optimizer with the gradient (``clip_record=``), and :func:`accumulate` to
  its inner optimizer once per window; ``value_and_grad(...,
  clip_per_example=C, normalize="sum", clip_record=True)`` returns one in
  place of the gradient, for :func:`accumulate`'s ``update``. ``dp_noise``
  refuses a gradient that is not the record's very ``grads`` (any
  transformation before it made new arrays), a record clipped at another
  norm, and, in :func:`accumulate`, a record of anything but a clipped sum.

  A pytree: ``grads``, ``divided_by``, ``examples`` and ``clipped_sum`` are
  its children, ``clip_norm`` and ``normalize`` static.

  Attributes:
    grads: the clipped sum divided by ``divided_by``, as the step returns it
      (in the parameters' dtype).
    divided_by: what the clipped sum was divided by; shape=(), float32.
    examples: the real examples' count (their total weight with
      ``normalize="weighted"``); shape=(), float32.
    clip_norm: the norm each example's gradient was clipped to.
    normalize: the step's ``normalize``: ``"sum"``, ``"mean"`` or
      ``"weighted"``.
    clipped_sum: the clipped sum itself, like ``grads`` but in the
      accumulator's dtype (float32 or wider), neither divided nor cast: what
      :func:`dp_noise` adds its noise to, and what :func:`accumulate` adds up.
      With bfloat16 parameters ``grads`` is rounded to bfloat16, and that
      rounding, multiplied back by the examples' count, would grow with the
      batch. None in a record made by hand: ``dp_noise`` then takes
      ``grads * divided_by``.
  """

  def __init__(
    self,
    grads: PyTree,
    divided_by: Any,
    examples: Any,
    clip_norm: float,
    normalize: str,
    *,
    clipped_sum: PyTree = None,
  ):
    self.grads = grads
    self.divided_by = divided_by
    self.examples = examples
    self.clip_norm = clip_norm
    self.normalize = normalize
    self.clipped_sum = clipped_sum

  def __repr__(self) -> str:
    return (
      f"ClipRecord(clip_norm={self.clip_norm}, normalize={self.normalize!r}, "
      f"examples={self.examples})"
    )


jax.tree_util.register_pytree_node(
  ClipRecord,
  lambda r: (
    (r.grads, r.divided_by, r.examples, r.clipped_sum),
    (r.clip_norm, r.normalize),
  ),
  lambda static, children: ClipRecord(*children[:3], *static, clipped_sum=children[3]),
)


def record_of(
  grads: PyTree,
  total_weight: jax.Array,
  clip_norm: float,
  normalize: str,
  clipped_sum: PyTree = None,
) -> ClipRecord:
  """The :class:`ClipRecord` of a clipped step's normalized gradient and its
  clipped sum in the accumulator's dtype."""
  examples = jnp.asarray(total_weight, jnp.float32)
  return ClipRecord(
    grads,
    divided_by(examples, normalize),
    examples,
    clip_norm,
    normalize,
    clipped_sum=clipped_sum,
  )


def clipped_sum_of(record: ClipRecord) -> PyTree:
  """What the noise is added to: the record's clipped sum in the
  accumulator's dtype, or, for a record made by hand without one,
  ``grads * divided_by`` in float32 (or the gradient's wider dtype)."""
  if record.clipped_sum is not None:
    return record.clipped_sum
  divided = jnp.asarray(record.divided_by, jnp.float32)
  return jax.tree.map(
    lambda g: (
      g.astype(jnp.promote_types(g.dtype, jnp.float32))
      * divided.astype(jnp.promote_types(g.dtype, jnp.float32))
    ),
    record.grads,
  )


_FIRST = (
  "Put jaxaccum.dp_noise first, where it sees the clipped sum itself: "
  "optax.chain(jaxaccum.dp_noise(...), optax.adam(...)), with no wrapper "
  "around it (optax.masked, multi_transform, MultiSteps); to accumulate across "
  "calls, use jaxaccum.accumulate(optax.chain(jaxaccum.dp_noise(...), ...), k)."
)


def check_received(grads: PyTree, record: Any, config: NoiseConfig) -> ClipRecord:
  """``dp_noise``'s check, at trace time, that ``grads`` is the clipped sum
  the step recorded: the very arrays (a transformation before ``dp_noise``,
  even a scale, made new ones), clipped at the noise's ``clip_norm``."""
  if record is None:
    raise ValueError(
      "jaxaccum.dp_noise received no clip_record=, the record of the clipped "
      "sum that make_train_step, jaxaccum.nnx.make_train_step and accumulate "
      "pass with the gradient, so it cannot tell that the gradient was clipped "
      "and that nothing changed it since. " + _FIRST + " In a loop of your own "
      "pass update(record.grads, state, clip_record=record) with the record of "
      "value_and_grad(..., clip_per_example=C, clip_record=True)."
    )
  if not isinstance(record, ClipRecord):
    raise TypeError(
      "clip_record= must be the jaxaccum.ClipRecord a clipped step returns, "
      f"got a {type(record).__name__}."
    )
  got, want = jax.tree.leaves(grads), jax.tree.leaves(record.grads)
  if len(got) != len(want) or any(a is not b for a, b in zip(got, want, strict=True)):
    raise ValueError(
      "jaxaccum.dp_noise received a gradient that is not the clipped sum its "
      "step recorded: a transformation before it in the chain (or a wrapper "
      "around it) changed it, so the noise is no longer calibrated to one "
      "example's effect on what it receives (scale_by_adam before it leaves an "
      "effective noise multiplier near 0.001 for sigma = 1). " + _FIRST
    )
  if np.float32(record.clip_norm) != np.float32(config.clip_norm):
    raise ValueError(
      f"The gradient was clipped at clip_per_example={record.clip_norm}, but "
      f"dp_noise's clip_norm={config.clip_norm}: the noise must be calibrated "
      "to the norm the examples are clipped to. Pass the same number to both."
    )
  return record


def accumulated_record(
  grads: Any, record: Any, config: NoiseConfig | None
) -> tuple[PyTree, ClipRecord | None]:
  """:func:`jaxaccum.accumulate`'s reading of one call: the gradient and
  its :class:`ClipRecord`, given in place of the gradient or (from
  ``make_train_step``) as ``clip_record=`` beside it. With ``dp_noise`` in
  the inner optimizer, a record of a sum clipped at the noise's norm is
  required, at trace time."""
  if isinstance(grads, ClipRecord):
    grads, record = grads.grads, grads
  elif record is not None:
    record = check_received(grads, record, config) if config else record
  if config is None:
    return grads, record
  if record is None:
    raise ValueError(
      "accumulate() with jaxaccum.dp_noise in its inner optimizer needs each "
      "call's clipped sum as a jaxaccum.ClipRecord, in place of the gradient: "
      "grad = jaxaccum.grad(fun, k, clip_per_example=C, normalize='sum', "
      "clip_record=True); tx.update(grad(params, batch, example_mask=mask), "
      "opt_state, params). A plain gradient may be unclipped, clipped at "
      "another norm or a mean, and the noise would protect nothing."
    )
  if np.float32(record.clip_norm) != np.float32(config.clip_norm):
    raise ValueError(
      f"accumulate() got a gradient clipped at clip_per_example="
      f"{record.clip_norm}, but its dp_noise is calibrated to clip_norm="
      f"{config.clip_norm}: one example could move the sum by "
      f"{record.clip_norm / config.clip_norm:.3g} times what the noise "
      "covers. Pass the same number to both."
    )
  if record.normalize != "sum":
    raise ValueError(
      f"accumulate() with jaxaccum.dp_noise adds up clipped sums, but got a "
      f'gradient of normalize="{record.normalize}", divided by its examples '
      "(a mean shrinks the signal by the micro-batch size against the same "
      "noise, and the window's sum would not be the clipped sum). Compute it "
      "with grad(fun, k, clip_per_example=C, normalize='sum', clip_record=True)."
    )
  return grads, record


class DPNoiseState(NamedTuple):
  """The state of :func:`dp_noise`.

  Attributes:
    draws: noise draws so far, one per update; shape=(), int32.
    key: the key passed to :func:`dp_noise`; draw ``t`` uses
      ``fold_in(key, t)``.
    config: the :class:`NoiseConfig` (static: no leaves).
  """

  draws: jax.Array
  key: jax.Array
  config: NoiseConfig


def _gaussian(key: jax.Array, like: PyTree) -> PyTree:
  """Standard normal float32 noise shaped like ``like``: leaf ``i`` (in
  ``jax.tree.leaves`` order) from ``jax.random.split(key, n)[i]``."""
  leaves, treedef = jax.tree.flatten(like)
  keys = jax.random.split(key, max(len(leaves), 1))
  return jax.tree.unflatten(
    treedef,
    [
      jax.random.normal(k, jnp.shape(x), jnp.float32)
      for k, x in zip(keys, leaves, strict=False)
    ],
  )


def dp_noise(
  noise_multiplier: float,
  clip_norm: float,
  key: jax.Array | None,
  *,
  normalize: str,
  expected_batch_size: float | None = None,
) -> optax.GradientTransformationExtraArgs:
  """DP-SGD's Gaussian noise, added once per update to the clipped sum.

  ``update(grads, state, params=None, *, clip_record, **extra)`` takes the
  clipped gradient as :func:`jaxaccum.value_and_grad` with
  ``clip_per_example`` returns it, the clipped sum ``S`` divided by
  ``clip_record.divided_by`` (the number of real examples for
  ``normalize="mean"``, their total weight for ``"weighted"``, 1 for
  ``"sum"``), and returns

  - ``normalize="poisson"``: ``(S + N(0, (sigma C)^2)) / expected_batch_size``,
    the unbiased estimate for Poisson sampling, where the number of examples
    drawn is itself private;
  - ``normalize="fixed"``: ``(S + N(0, (sigma C)^2)) / divided_by``, for
    batches of a fixed, public size. With nothing to divide by
    (``divided_by == 0``) it returns zeros, and ``make_train_step`` skips
    the step.

  ``S`` is ``clip_record.clipped_sum``, the clipped sum in the accumulator's
  dtype (float32 or wider): the noise is added to it before any cast, and
  the result is cast to ``grads``' dtype last. With bfloat16 parameters
  ``grads`` is rounded to bfloat16, and that rounding multiplied back by the
  examples' count would grow with the batch. (A record made by hand without
  ``clipped_sum`` gives ``S = grads * divided_by``.)

  ``dp_noise`` must be the first transformation that sees the gradient:
  ``clip_record`` is the :class:`ClipRecord` that ``make_train_step``,
  ``jaxaccum.nnx.make_train_step`` and ``accumulate`` pass with it, and
  ``update`` raises a ``ValueError`` at trace time unless ``grads`` is that
  record's very ``grads``, clipped at ``clip_norm``. Any transformation
  before it (``scale_by_adam``, ``clip_by_global_norm``, even
  ``optax.scale``) or a wrapper around it (``optax.masked``,
  ``MultiSteps``) makes new arrays, and is refused. In ``make_train_step``
  it runs once per step; inside ``accumulate(optax.chain(dp_noise(...),
  ...), k)`` once per window.
  Update ``t`` (``state.draws``) draws its noise from
  ``jax.random.fold_in(key, t)``, leaf ``i`` of the gradient from
  ``jax.random.split(that, number_of_leaves)[i]`` as float32.

  Args:
    noise_multiplier: sigma >= 0, the ratio of the noise's standard deviation
      to ``clip_norm``; :func:`dp_epsilon` turns it into epsilon.
    clip_norm: C, the same number as ``clip_per_example``
      (``make_train_step`` checks it).
    key: a PRNG key (``jax.random.key(seed)``), kept in the state. Use a
      fresh seed for every training run.
    normalize: ``"poisson"`` or ``"fixed"``, see above.
    expected_batch_size: ``q * N`` (sampling rate times data set size);
      needed for, and only for, ``"poisson"``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`DPNoiseState`.

  >>> import jax, jax.numpy as jnp, jaxaccum
  >>> tx = jaxaccum.dp_noise(0.0, 1.0, jax.random.key(0), normalize="fixed")
  >>> grad = jaxaccum.grad(
  ...   lambda w, x: jnp.sum(w * x), 1, clip_per_example=1.0, clip_record=True
  ... )
  >>> record = grad(jnp.zeros(2), jnp.array([[0.5, 0.0], [0.0, 0.25]]))
  >>> state = tx.init(jnp.zeros(2))
  >>> out, state = tx.update(record.grads, state, clip_record=record)
  >>> out.tolist(), int(state.draws)  # the mean of two clipped examples
  ([0.25, 0.125], 1)
  >>> tx.update(record.grads * 1.0, state, clip_record=record)
  Traceback (most recent call last):
  ValueError: jaxaccum.dp_noise received a gradient that is not the clipped sum ...
  """
  config = noise_config(
    noise_multiplier, clip_norm, key, normalize, expected_batch_size
  )
  the_key: jax.Array = key  # type: ignore[assignment]  # checked: not None

  def init_fn(params):
    del params
    return DPNoiseState(jnp.zeros((), jnp.int32), the_key, config)

  def update_fn(grads, state, params=None, *, clip_record=None, **extra_args):
    del params, extra_args
    record = check_received(grads, clip_record, config)
    check_noise_matches(config, record.clip_norm, record.normalize)
    divided_by = jnp.asarray(record.divided_by, jnp.float32)
    noise = _gaussian(jax.random.fold_in(state.key, state.draws), grads)
    stddev = jnp.float32(config.noise_multiplier * config.clip_norm)
    # The noise is added to the clipped sum in the accumulator's dtype, and
    # the noisy sum is divided, then cast to the gradient's dtype: nothing
    # rounds the sum before the noise covers it.
    total = clipped_sum_of(record)
    if config.normalize == "poisson":
      assert config.expected_batch_size is not None
      denominator = jnp.float32(config.expected_batch_size)
      some = jnp.asarray(True)
    else:
      some = divided_by != 0
      denominator = jnp.where(some, divided_by, jnp.float32(1))

    def noisy_mean(s, z, g):
      noisy = (s + (stddev * z).astype(s.dtype)) / denominator.astype(s.dtype)
      return jnp.where(some, noisy, jnp.zeros_like(noisy)).astype(g.dtype)

    noisy = jax.tree.map(noisy_mean, total, noise, grads)
    return noisy, state._replace(draws=state.draws + 1)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def noise_config(
  noise_multiplier: Any,
  clip_norm: Any,
  key: Any,
  normalize: Any,
  expected_batch_size: Any,
) -> NoiseConfig:
  """:func:`dp_noise`'s arguments, checked."""
  if key is None:
    raise ValueError(
      "dp_noise needs a key: the noise must come from randomness you pass, "
      "e.g. dp_noise(noise_multiplier, clip_norm, jax.random.key(seed), ...), "
      "with a fresh seed for every training run."
    )
  if not _tree.is_single_key(key):
    raise TypeError(
      "dp_noise's key must be one PRNG key, jax.random.key(seed) (or a raw "
      f"jax.random.PRNGKey(seed)), got {describe(key)}."
    )
  check_number("noise_multiplier", noise_multiplier)
  if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
    raise ValueError(
      "noise_multiplier must be a finite number >= 0 (sigma, the noise's "
      f"standard deviation over clip_norm), got {noise_multiplier=}. Use e.g. "
      "noise_multiplier=1.0; 0 adds no noise and gives no privacy."
    )
  clip = check_clip_norm("clip_norm", clip_norm)
  assert clip is not None
  if normalize not in NORMALIZATIONS:
    raise ValueError(
      f"Unknown {normalize=}; choose 'poisson' (Poisson sampling: divide by "
      "expected_batch_size) or 'fixed' (batches of a fixed size: divide by "
      "the actual number of examples)."
    )
  if normalize == "poisson":
    if expected_batch_size is None:
      raise ValueError(
        'normalize="poisson" divides by the expected batch size: pass '
        "expected_batch_size= (sampling rate times data set size), e.g. "
        "PoissonSampler(...).expected_batch_size."
      )
    check_number("expected_batch_size", expected_batch_size)
    if not (math.isfinite(expected_batch_size) and expected_batch_size > 0):
      raise ValueError(
        f"expected_batch_size must be a positive number, got {expected_batch_size=}."
      )
    expected_batch_size = float(expected_batch_size)
  elif expected_batch_size is not None:
    raise ValueError(
      f'normalize="fixed" divides by the actual number of examples and takes '
      f"no {expected_batch_size=}: drop it, or use normalize='poisson'."
    )
  return NoiseConfig(float(noise_multiplier), clip, normalize, expected_batch_size)


def find_noise(opt_state: PyTree) -> NoiseConfig | None:
  """The :class:`NoiseConfig` of the one :func:`dp_noise` in ``opt_state``,
  or None. More than one is an error (noise would be added twice)."""
  is_noise = lambda x: isinstance(x, DPNoiseState)  # noqa: E731
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_noise) if is_noise(x)]
  if len(found) > 1:
    raise ValueError(
      f"The optimizer state holds {len(found)} jaxaccum.dp_noise states: noise "
      "would be added more than once per step. Keep one, first in the chain."
    )
  return found[0].config if found else None


def check_noise_matches(
  config: NoiseConfig, clip_per_example: float | None, normalize: str
) -> None:
  """``make_train_step``'s checks of a :func:`dp_noise` against its own
  options, at trace time."""
  if clip_per_example is None:
    raise ValueError(
      "The optimizer holds jaxaccum.dp_noise, but the step does not clip: "
      f"pass clip_per_example={config.clip_norm} (noise calibrated to C "
      "protects nothing unless each example's gradient is clipped to C)."
    )
  if np.float32(clip_per_example) != np.float32(config.clip_norm):
    # Compared as the float32 the step computes with: 0.1 and np.float32(0.1)
    # clip alike.
    raise ValueError(
      f"clip_per_example={clip_per_example} differs from dp_noise's "
      f"clip_norm={config.clip_norm}: the noise must be calibrated to the "
      "norm the examples are clipped to. Pass the same number to both."
    )
  if config.normalize == "fixed" and normalize == "sum":
    raise ValueError(
      'dp_noise\'s normalize="fixed" divides by the actual number of examples, '
      'and the step\'s normalize="sum" divides by nothing: the update would be '
      'the noisy sum. Use normalize="mean" (or "weighted") with a fixed batch '
      'size, or dp_noise(..., normalize="poisson") for Poisson sampling.'
    )
  if config.normalize == "poisson" and normalize == "weighted":
    raise ValueError(
      'normalize="weighted" divides by the actual total weight, and dp_noise\'s '
      'normalize="poisson" by the expected batch size: choose one. For '
      'Poisson sampling use normalize="mean" (or "sum") and mark padding with '
      "example_mask=; for a fixed batch size use dp_noise(..., "
      'normalize="fixed").'
    )


def divided_by(total_weight: jax.Array, normalize: str) -> jax.Array:
  """What ``value_and_grad`` with ``clip_per_example`` divided the clipped
  sum by: the examples' count or weight, or 1 for ``"sum"``."""
  if normalize == "sum":
    return jnp.ones((), jnp.float32)
  return jnp.asarray(total_weight, jnp.float32)
