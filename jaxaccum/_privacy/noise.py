"""DP-SGD's noise: :func:`dp_noise`, an optax transformation that adds
``N(0, (sigma * C)^2)`` to the clipped *sum* once per update, i.e. once per
logical batch (once per ``make_train_step`` step, once per window of
``accumulate()``), and the :class:`ClipRecord` that proves to it that what it
received is that clipped sum.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxaccum import _tree
from jaxaccum._checks import check_number, describe
from jaxaccum._privacy.options import check_clip_norm
from jaxaccum._privacy.record import (
  ClipRecord,
  check_made,
  take,
)

PyTree = Any


NORMALIZATIONS = ("poisson", "fixed")


class ClipWithoutNoiseWarning(UserWarning):
  """Each example's gradient is clipped (``clip_per_example``) where no
  :func:`jaxaccum.dp_noise` can add noise to it: clipping alone gives no
  privacy.

  Warned once where that is visible: by ``value_and_grad`` and ``grad``
  (also ``jaxaccum.nnx``'s) built with ``clip_per_example`` but without
  ``clip_record=True`` (their gradient cannot reach ``dp_noise``), by
  ``make_train_step`` (and ``jaxaccum.nnx.make_train_step``) whose optimizer
  holds no ``dp_noise``, and by :func:`jaxaccum.accumulate` given a
  :class:`ClipRecord` with no ``dp_noise`` in its inner optimizer. Pass
  ``clip_without_noise=True`` with ``clip_per_example`` where clipping alone
  is meant (noise added by your own code, or clipping for robustness), or
  filter the warning by this class.
  """


def warn_without_noise(where: str, stacklevel: int = 3) -> None:
  """A :class:`ClipWithoutNoiseWarning` saying where clipping meets no noise."""
  warnings.warn(
    f"{where} Clipping alone gives no privacy. Put jaxaccum.dp_noise(...) first "
    "in the optimizer (optax.chain(jaxaccum.dp_noise(...), ...)); pass "
    "clip_without_noise=True with clip_per_example where clipping without "
    "noise is meant (noise added by your own code, or clipping for "
    "robustness).",
    ClipWithoutNoiseWarning,
    stacklevel=stacklevel,
  )


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
    expected_weight: the public denominator of weighted steps, else None.
  """

  noise_multiplier: float
  clip_norm: float
  normalize: str
  expected_batch_size: float | None
  expected_weight: float | None = None

  @property
  def public_denominator(self) -> float | None:
    """What the noisy clipped sum is divided by where that is a public
    number: ``expected_weight``, or ``expected_batch_size`` under
    ``"poisson"``; None where it is the count of real examples
    (``"fixed"``, public at a fixed batch size)."""
    if self.expected_weight is not None:
      return self.expected_weight
    return self.expected_batch_size if self.normalize == "poisson" else None


jax.tree_util.register_static(NoiseConfig)


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
  check_made(record, "jaxaccum.dp_noise")
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


def gradient_of(grads: Any) -> PyTree:
  """The gradient that :func:`jaxaccum.accumulate` is given: ``grads``, or
  a :class:`ClipRecord`'s own, given in its place."""
  return grads.grads if isinstance(grads, ClipRecord) else grads


def accumulated_record(
  grads: Any, record: Any, config: NoiseConfig | None, weight_given: bool = False
) -> tuple[PyTree, ClipRecord | None]:
  """:func:`jaxaccum.accumulate`'s reading of one call: the gradient and
  its :class:`ClipRecord`, given in place of the gradient or (from
  ``make_train_step``) as ``clip_record=`` beside it. With ``dp_noise`` in
  the inner optimizer, a record of a sum clipped at the noise's norm is
  required, and ``weight=`` (``weight_given``) exactly with ``dp_noise``'s
  ``expected_weight``, at trace time."""
  if isinstance(grads, ClipRecord):
    check_made(grads, "accumulate()")
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
  if weight_given and config.expected_weight is None:
    raise ValueError(
      "accumulate(..., weight=) with jaxaccum.dp_noise would divide the "
      "window's noisy clipped sum by its total weight, which is private (a "
      "count of tokens, say, of examples that are themselves private): the "
      "update's norm, about sigma C |z| / weight, gives it away. dp_noise "
      "never divides by it. Give dp_noise the public denominator: "
      "dp_noise(..., expected_weight=W), W the expected weight of a window "
      "(e.g. the expected examples times the mean weight per example, from "
      "public metadata); or drop weight= (each record's count of real "
      "examples is then the window's weight, public at a fixed batch size)."
    )
  if config.expected_weight is not None and not weight_given:
    raise ValueError(
      f"dp_noise(..., expected_weight={config.expected_weight}) is the public "
      "denominator of weighted windows: pass each call's weight= (the "
      "micro-batch's total weight, e.g. its token count; it says that the "
      "records are sums over those units, and the noisy sum is divided by "
      "expected_weight, never by it), or drop expected_weight for a window "
      "of examples."
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
  expected_weight: float | None = None,
) -> optax.GradientTransformationExtraArgs:
  """DP-SGD's Gaussian noise, added once per update to the clipped sum.

  ``update(grads, state, params=None, *, clip_record, **extra)`` takes the
  clipped gradient as :func:`jaxaccum.value_and_grad` with
  ``clip_per_example`` returns it (the clipped sum divided by the number of
  real examples for ``normalize="mean"``, by their total weight for
  ``"weighted"``, by 1 for ``"sum"``) with its ``clip_record``, whose
  ``clipped_sum`` is the clipped sum ``S`` itself, and returns ``(S + N(0,
  (sigma C)^2)) / D``. The denominator ``D`` is never private:

  - ``normalize="poisson"``: ``D = expected_batch_size``, the unbiased
    estimate for Poisson sampling, where the number of examples drawn is
    itself private;
  - ``normalize="fixed"``: ``D`` = the number of real examples, for
    batches of a fixed, public size. With no example (a batch of padding
    only) it returns zeros, and ``make_train_step`` skips the step;
  - with ``expected_weight=W`` (either normalize): ``D = W``, for weighted
    steps (``normalize="weighted"``, or ``accumulate(..., weight=)``), which
    need it. Their total weight (a token count) is private, and dividing the
    noise by it gives it away: the update's norm is about ``sigma C |z| /
    weight``. ``W`` is a public number, such as the expected examples per
    batch times the mean weight per example, from public metadata. The
    weight itself then enters no update, and needs no bound: each example's
    clipped gradient moves ``S`` by at most ``C`` whatever its weight.

  Anything else is a ``ValueError`` at trace time naming the fix: a weighted
  step without ``expected_weight``, ``expected_weight`` on a step that is not
  weighted, ``"fixed"`` with a step of ``normalize="sum"``. The table of
  every combination and the epsilon that covers it is in
  ``docs/privacy.md``.

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
      for ``"poisson"``, which needs it or ``expected_weight``, not both.
    expected_weight: the public denominator of weighted steps, see above;
      a positive number.

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
    noise_multiplier,
    clip_norm,
    key,
    normalize,
    expected_batch_size,
    expected_weight=expected_weight,
  )
  the_key: jax.Array = key  # type: ignore[assignment]  # checked: not None

  def init_fn(params):
    del params
    return DPNoiseState(jnp.zeros((), jnp.int32), the_key, config)

  def update_fn(grads, state, params=None, *, clip_record=None, **extra_args):
    del params, extra_args
    record = check_received(grads, clip_record, config)
    check_noise_matches(config, record.clip_norm, record.normalize)
    take(record, state)  # every check passed: a refused call takes nothing
    noise = _gaussian(jax.random.fold_in(state.key, state.draws), grads)
    stddev = jnp.float32(config.noise_multiplier * config.clip_norm)
    noisy_sum = jax.tree.map(
      lambda s, z: s.astype(jnp.float32) + stddev * z, record.clipped_sum, noise
    )
    public = config.public_denominator
    if public is not None:
      noisy = jax.tree.map(lambda n: n / jnp.float32(public), noisy_sum)
    else:  # "fixed": the count of real examples, public at a fixed batch size
      count = jnp.asarray(record.examples, jnp.float32)
      some = count != 0
      safe = jnp.where(some, count, jnp.float32(1))
      noisy = jax.tree.map(
        lambda n: jnp.where(some, n / safe, jnp.zeros_like(n)), noisy_sum
      )
    noisy = jax.tree.map(lambda n, g: n.astype(g.dtype), noisy, grads)
    return noisy, state._replace(draws=state.draws + 1)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _check_key(key: Any) -> None:
  """Raises unless ``key`` is one PRNG key: ``dp_noise``'s randomness is
  the caller's."""
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


def noise_config(
  noise_multiplier: Any,
  clip_norm: Any,
  key: Any,
  normalize: Any,
  expected_batch_size: Any,
  *,
  expected_weight: Any = None,
) -> NoiseConfig:
  """:func:`dp_noise`'s arguments, checked."""
  _check_key(key)
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
  if expected_weight is not None:
    expected_weight = _positive("expected_weight", expected_weight)
  if normalize == "poisson":
    if expected_batch_size is None and expected_weight is None:
      raise ValueError(
        'normalize="poisson" divides by the expected batch size: pass '
        "expected_batch_size= (sampling rate times data set size), e.g. "
        "PoissonSampler(...).expected_batch_size; for weighted steps, "
        "expected_weight= (the expected total weight of a batch) instead."
      )
    if expected_batch_size is not None and expected_weight is not None:
      raise ValueError(
        f"dp_noise takes one public denominator, got {expected_batch_size=} "
        f"and {expected_weight=}: expected_batch_size for steps that count "
        'examples (normalize="mean" or "sum"), expected_weight for weighted '
        'steps (normalize="weighted", accumulate(..., weight=)).'
      )
    if expected_batch_size is not None:
      expected_batch_size = _positive("expected_batch_size", expected_batch_size)
  elif expected_batch_size is not None:
    raise ValueError(
      f'normalize="fixed" divides by the actual number of examples and takes '
      f"no {expected_batch_size=}: drop it, or use normalize='poisson'."
    )
  return NoiseConfig(
    float(noise_multiplier), clip, normalize, expected_batch_size, expected_weight
  )


def _positive(name: str, value: Any) -> float:
  """A positive finite number, as a float."""
  check_number(name, value)
  if not (math.isfinite(value) and value > 0):
    raise ValueError(f"{name} must be a positive number, got {name}={value!r}.")
  return float(value)


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
  if normalize == "weighted" and config.expected_weight is None:
    raise ValueError(
      'normalize="weighted" divides the clipped sum by the batch\'s total '
      "weight, which is private (a token count, of examples that are "
      "themselves private): noise divided by it gives it away, since the "
      "update's norm is about sigma C |z| / weight. dp_noise never divides by "
      "it. Give dp_noise a public denominator: dp_noise(..., "
      f'normalize="{config.normalize}", expected_weight=W), W the expected '
      "total weight of a batch (e.g. the expected examples times the mean "
      "weight per example, from public metadata); the noisy clipped sum is "
      "then divided by W, under Poisson or fixed-size sampling alike."
    )
  if normalize != "weighted" and config.expected_weight is not None:
    raise ValueError(
      f"dp_noise(..., expected_weight={config.expected_weight}) is the public "
      'denominator of weighted steps (normalize="weighted", or '
      f'accumulate(..., weight=)), and this step is normalize="{normalize}": '
      "drop expected_weight (and pass expected_batch_size= for Poisson "
      'sampling), or use normalize="weighted".'
    )
  if config.normalize == "fixed" and normalize == "sum":
    raise ValueError(
      'dp_noise\'s normalize="fixed" divides by the actual number of examples, '
      'and the step\'s normalize="sum" divides by nothing: the update would be '
      'the noisy sum. Use normalize="mean" with a fixed batch size, or '
      'dp_noise(..., normalize="poisson") for Poisson sampling.'
    )
