"""Each :class:`~jaxaccum._privacy.record.ClipRecord` that a step hands out
with ``clip_record=True`` is a ticket: taken once, by one update.

A record fed twice to :func:`jaxaccum.accumulate` adds one micro-batch's
clipped sum twice to the window, so that each of its examples moves the
update by up to 2 C against noise calibrated to C. Records pass through
``jax.jit`` as pytrees, so their Python identity is lost; what survives is
an array leaf. Each record therefore carries a serial number (``uint32``)
that this module issues on the host, through ``jax.experimental.io_callback``
when the record is made under a trace (so that every run of a compiled step
gets a new one), and each update that takes a record (``accumulate``'s, or
:func:`jaxaccum.dp_noise`'s given the record directly) redeems it the same
way. Redeeming a serial that is not outstanding (taken before, never issued,
or issued more than :data:`CAPACITY` records ago) raises: a ``ValueError``
outside a trace, and inside a compiled update the same message as JAX's
runtime error, before any result exists, so that nothing is updated.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from jaxaccum import _compat

#: The most records outstanding (issued, not taken) that are remembered; an
#: older one is forgotten and refused if it is ever fed. A record that is
#: never fed (one made for evaluation) so costs a few bytes, up to this many.
CAPACITY = 2**20

SERIAL = jax.ShapeDtypeStruct((), jnp.uint32)


class _Registry:
  """The outstanding serials of this process, in the order issued."""

  def __init__(self) -> None:
    self._last = 0
    self._open: collections.OrderedDict[int, None] = collections.OrderedDict()
    self._lock = threading.Lock()

  def issue(self) -> np.ndarray:
    with self._lock:
      self._last = self._last % (2**32 - 1) + 1  # 1 .. 2**32 - 1, never 0
      self._open[self._last] = None
      if len(self._open) > CAPACITY:
        self._open.popitem(last=False)
      return np.asarray(self._last, np.uint32)

  def take(self, serial: Any) -> np.ndarray:
    number = int(np.asarray(serial))
    with self._lock:
      if number not in self._open:
        raise ValueError(used_twice(number))
      del self._open[number]
    return np.asarray(True)


REGISTRY = _Registry()


def used_twice(number: int) -> str:
  return (
    f"This jaxaccum.ClipRecord (serial {number}) was given to an update "
    "before: a record fed twice adds its micro-batch's clipped sum twice, so "
    "that each of its examples moves the update by up to 2 C (k C after k "
    "uses) against noise calibrated to C, and the privacy guarantee would be "
    "void. Compute a new record for every update: value_and_grad(..., "
    "clip_record=True) on the next micro-batch. (A record made by a "
    f"jaxaccum of another process, or more than {CAPACITY} records ago, is "
    "refused the same way.)"
  )


def issue(traced: bool) -> jax.Array:
  """A fresh serial: computed now outside a trace, else by a host callback
  in the traced program, once per run."""
  if not traced:
    return jnp.asarray(REGISTRY.issue())
  return io_callback(REGISTRY.issue, SERIAL, ordered=False)


def take(serial: Any, traced: bool) -> None:
  """Redeems ``serial`` (None: a record without one, made and taken inside
  one jaxaccum step), raising if it is not outstanding: now, outside a trace;
  by a host callback on every run of the traced program otherwise (also for
  a concrete record that the traced update closes over: taken at trace time,
  it would be taken once for any number of runs)."""
  if serial is None:
    return
  if jnp.shape(serial) != () or jnp.result_type(serial) != jnp.uint32:
    raise ValueError(
      "The jaxaccum.ClipRecord's serial number was changed (it is now "
      f"shape={jnp.shape(serial)}, dtype={jnp.result_type(serial)}; a "
      "jax.tree.map over the record maps it too): map record.grads, not the "
      "record."
    )
  if not (traced or _compat.is_tracer(serial)):
    REGISTRY.take(serial)
    return
  io_callback(REGISTRY.take, jax.ShapeDtypeStruct((), jnp.bool_), serial, ordered=False)
