"""The length of an :func:`jaxaccum.accumulate` window: ``every_k``, an
int, a callable from the optimizer step to an int (a batch-size ramp), or
:func:`jaxaccum.auto_k`; checked once, read when a window starts."""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp

from jaxaccum import _compat, _noise_scale
from jaxaccum._optim import autopilot as _autopilot


def check(every_k: Any) -> None:
  """Raises for an ``every_k`` that is not a positive int, a callable or an
  :func:`jaxaccum.auto_k`. A callable is checked at step 0, where it gives
  a concrete number: 0 or less is the same error as the integer; traced
  values it gives later are held at 1 or more."""
  if _autopilot.is_auto(every_k):
    return
  if callable(every_k):
    first = every_k(jnp.zeros((), jnp.int32))
    if not _compat.is_tracer(first) and int(first) <= 0:
      _check_every_k(int(first))
    return
  if isinstance(every_k, bool) or not isinstance(every_k, numbers.Integral):
    raise TypeError(
      f"every_k must be an int, a callable or jaxaccum.auto_k(...), got {every_k!r}."
    )
  _check_every_k(int(every_k))


def first(every_k: Any) -> jax.Array:
  """The first window's length."""
  if _autopilot.is_auto(every_k):
    return _scalar(every_k.min_k, jnp.int32)
  if callable(every_k):
    return jnp.maximum(jnp.asarray(every_k(_scalar(0, jnp.int32)), jnp.int32), 1)
  return _scalar(int(every_k), jnp.int32)


def next_window(
  every_k: Any,
  state: Any,
  done: jax.Array,
  applied: jax.Array,
  noise: _noise_scale.GradientNoise,
) -> tuple[jax.Array, _autopilot.AutoKState | None]:
  """The next window's length (and the autopilot's state) where the window
  ended; the current ones otherwise. ``state`` is the state after the call
  (its ``step`` counts the window if it was applied)."""
  step = state.step
  k, autopilot = state.window_size, state.autopilot
  if _autopilot.is_auto(every_k):
    assert autopilot is not None
    k_next, auto_next = every_k.next_window(autopilot, k, noise, applied)
    autopilot = jax.tree.map(lambda n, o: jnp.where(done, n, o), auto_next, autopilot)
  elif callable(every_k):
    k_next = jnp.maximum(jnp.asarray(every_k(step), jnp.int32), 1)
  else:
    k_next = k
  return jnp.where(done, k_next, k).astype(jnp.int32), autopilot


def _check_every_k(every_k: int) -> None:
  if every_k <= 0:
    raise ValueError(f"every_k must be positive, got {every_k=}.")


def _scalar(value: float, dtype: Any) -> jax.Array:
  return jnp.full((), value, dtype)
