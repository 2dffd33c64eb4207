"""``jaxaccum.ClipPerExample``: the DP-SGD options, as one group.

``value_and_grad(fun, k, privacy=jaxaccum.ClipPerExample(1.0, method="ghost"))``
is ``value_and_grad(fun, k, clip_per_example=1.0, clip_method="ghost")``: the
flat keywords are shorthands for this group's fields, and giving both is a
``TypeError``. The group validates itself here, where its feature lives; the
core reads it through :class:`jaxaccum._options.Options`'s properties only.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import numpy as np

from jaxaccum import _options
from jaxaccum._privacy import clipping as _clipping
from jaxaccum._privacy import ghost as _ghost


@dataclasses.dataclass(frozen=True)
class ClipPerExample:
  """Differentially private training (DP-SGD): each example's gradient
  clipped to L2 norm ``clip_norm``, the clipped gradients summed in float32.

  ``fun`` is then called on ONE example (each batch leaf without its leading
  axis) and returns that example's scalar loss (``(loss_sum, weight)`` with
  ``normalize="weighted"``); the call takes ``example_mask=``, a vector with
  one entry per row (0 for padding, which adds exactly zero). Add the noise
  with :func:`jaxaccum.dp_noise`; ``docs/privacy.md`` has the rest.

  Attributes:
    clip_norm: C, the norm each example's gradient is clipped to (None: no
      clipping, the group's default).
    method: ``"vmap"`` (each example's gradient, one ``vmap`` of ``grad``)
      or ``"ghost"`` (the same sum from each parameter's uses in the traced
      program and a second, per-example weighted pass, without per-example
      gradients).
    public_argnums: the other arguments every example's loss may read,
      declared to depend on no example (a schedule's value, a frozen
      table); any other array argument, and an array ``fun`` closes over
      from an enclosing trace, is refused.
    record: return the gradient as a :class:`jaxaccum.ClipRecord`, which
      :func:`jaxaccum.accumulate` takes with :func:`jaxaccum.dp_noise`.
    without_noise: clipping without ``dp_noise`` on purpose (it warns once
      otherwise, :class:`jaxaccum.ClipWithoutNoiseWarning`).
    keyword: ``"privacy"``, the keyword of ``value_and_grad`` that takes
      the group.
    shorthands: the flat keywords of ``value_and_grad`` that stand for the
      group's fields (``clip_per_example=`` for ``clip_norm``, ...).

  >>> import jaxaccum
  >>> jaxaccum.ClipPerExample(1.0, method="ghost").method
  'ghost'
  >>> jaxaccum.ClipPerExample(method="ghost")
  Traceback (most recent call last):
  ValueError: clip_method='ghost' says how each example's gradient is clipped; it needs clip_per_example=C (the norm to clip to).
  """

  clip_norm: float | None = None
  method: str = "vmap"
  public_argnums: int | Sequence[int] = ()
  record: bool = False
  without_noise: bool = False

  keyword: ClassVar[str] = "privacy"
  shorthands: ClassVar[dict[str, str]] = {
    "clip_per_example": "clip_norm",
    "clip_method": "method",
    "public_argnums": "public_argnums",
    "clip_record": "record",
    "clip_without_noise": "without_noise",
  }

  def __post_init__(self) -> None:
    clip = check_clip_norm("clip_per_example", self.clip_norm)
    method = _ghost.check_method(self.method)
    if method != "vmap" and clip is None:
      raise ValueError(
        f"clip_method={method!r} says how each example's gradient is clipped; "
        "it needs clip_per_example=C (the norm to clip to)."
      )
    if self.record and clip is None:
      raise ValueError(
        "clip_record=True returns the gradient as a jaxaccum.ClipRecord of a "
        "clipped sum, and needs clip_per_example=C."
      )
    if self.without_noise and clip is None:
      raise ValueError(
        "clip_without_noise=True says that clip_per_example is used without "
        "jaxaccum.dp_noise on purpose; it needs clip_per_example=C."
      )
    object.__setattr__(self, "clip_norm", clip)
    object.__setattr__(self, "record", bool(self.record))
    object.__setattr__(self, "without_noise", bool(self.without_noise))

  def _core(self) -> dict[str, Any]:
    """The core options the group sets: the positions of the public
    arguments, which the core resolves and shifts with the others."""
    return {"public_argnums": _options.positions(self.public_argnums, "public_argnums")}

  def _check(self, options: _options.Options) -> None:
    """Per-example clipping takes neither threaded state nor noise stats,
    and records one differentiated tree."""
    if self.clip_norm is None:
      return
    if options.state_argnum is not None:
      raise ValueError(
        f"clip_per_example does not take state_argnum={options.state_argnum}: "
        "each example's gradient is computed apart from the others, so there "
        "is no order in which to thread state (BatchNorm statistics mix "
        "examples, which differential privacy forbids). Use a model without "
        "BatchNorm (GroupNorm or LayerNorm work per example) and pass dropout "
        "keys with rng_argnum."
      )
    if options.noise_stats:
      raise ValueError(
        "clip_per_example does not take noise_stats=True: the gradient noise "
        "scale is measured on unclipped micro-batch gradients. Leave one out."
      )
    if self.record and not options.tree_grads:
      raise ValueError(
        f"clip_record=True records one differentiated tree; got "
        f"argnums={options.argnums}. Differentiate one argument (a tuple of "
        "trees inside it works)."
      )

  # -- the gradient rule the engine is given (jaxaccum._engine.GradientRule) --

  @property
  def active(self) -> bool:
    """Whether the group clips (a norm was given)."""
    return self.clip_norm is not None

  @property
  def whole_gradients(self) -> bool:
    """Whether each device computes whole per-example gradients (``"vmap"``:
    a leaf sharded over the data axes is gathered once per step); ghost
    clipping's weighted pass is shared as the non-private step's is."""
    return self.method == "vmap"

  def check_value(self, value: Any, options: _options.Options) -> None:
    """``fun``'s value for one example is a scalar (or the weighted pair)."""
    _clipping.check_per_example_value(value, options.normalize)

  def value_and_grad(
    self, loss_fn: Any, options: _options.Options, kwargs: dict[str, Any]
  ) -> Any:
    """The micro-batch's value and clipped sum
    (:func:`jaxaccum._privacy.clipped_value_and_grad`): ``fun`` reaches the
    keyword arguments by closure, and under clipping only jaxaccum's own
    hold arrays (``check_public_args``)."""
    assert self.clip_norm is not None
    return _clipping.clipped_value_and_grad(
      loss_fn,
      argnums=options.argnums,
      batch_argnums=options.batch_argnums,
      clip_norm=self.clip_norm,
      accum_dtype=options.accum_dtype,
      rng_argnum=options.rng_argnum,
      state_argnum=options.state_argnum,
      mask_argnum=options.example_mask,
      clip_method=self.method,
      closed_over=jax.tree.leaves(kwargs),
    )

  def objective(
    self, loss_fn: Any, options: _options.Options, kwargs: dict[str, Any]
  ) -> Any:
    """Ghost clipping's micro-batch as a loss whose gradient, with respect
    to the masters, is the clipped sum
    (:func:`jaxaccum._privacy.ghost_objective`)."""
    assert self.clip_norm is not None
    return _clipping.ghost_objective(
      loss_fn,
      argnums=options.argnums,
      batch_argnums=options.batch_argnums,
      clip_norm=self.clip_norm,
      rng_argnum=options.rng_argnum,
      state_argnum=options.state_argnum,
      mask_argnum=options.example_mask,
      closed_over=jax.tree.leaves(kwargs),
    )

  def masters(self, diff_args: Any, accum_dtype: Any) -> Any:
    """The differentiated arguments in the accumulator's dtype, which ghost
    clipping's objective is differentiated with respect to."""
    return _ghost.masters(diff_args, accum_dtype)

  def kept_only(self, grads: Any, some: Any, accum_dtype: Any) -> Any:
    """The clipped sums, exactly zero where no row was kept."""
    return _ghost.kept_only(grads, some, accum_dtype)


_options.register(ClipPerExample)


def check_clip_norm(name: str, value: Any) -> float | None:
  """A clipping norm: None, or a positive finite real number (as a float)
  that float32, in which the step clips, holds as a normal number: a
  denormal one or one that rounds to 0 or overflows to inf is refused.

  >>> check_clip_norm("clip_per_example", 0.0)
  Traceback (most recent call last):
  ValueError: clip_per_example must be a positive number, the L2 norm C that each example's gradient is clipped to, got clip_per_example=0.0. Pass e.g. clip_per_example=1.0.
  """
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(
      f"{name} must be a Python or numpy number (the clipping norm C), got "
      f"{value!r} of type {type(value).__name__}."
    )
  if not (math.isfinite(value) and float(value) > 0):
    raise ValueError(
      f"{name} must be a positive number, the L2 norm C that each example's "
      f"gradient is clipped to, got {name}={value!r}. Pass e.g. {name}=1.0."
    )
  as_float32 = np.float32(value)
  tiny, largest = np.finfo(np.float32).tiny, np.finfo(np.float32).max
  if not tiny <= as_float32 <= largest:
    raise ValueError(
      f"{name}={value!r} is not a normal float32 number (it becomes "
      f"{float(as_float32)!r} in float32, in which each example's gradient is "
      f"clipped): the clip would be 0, denormal or infinite. Choose a norm "
      f"between {float(tiny):.3g} and {float(largest):.3g}, in practice near "
      "the examples' gradient norms (e.g. their median), such as 1.0."
    )
  return float(value)
