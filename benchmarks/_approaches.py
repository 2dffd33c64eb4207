"""The ways to take one optimizer step on an effective batch of ``B`` rows
(:data:`APPROACHES`, timed by ``step_time.py``), and the peers' baselines
the other benchmarks share (:func:`train_step`, :func:`full_batch_step`,
:func:`full_batch_select_step`, :func:`optax_microbatch`, :func:`hand_scan`).

An :class:`Approach`'s ``memory()`` compiles (never runs) what a step
executes: for MultiSteps, its per-micro-batch call; for the naive loop, the
larger of its two functions (``resident_bytes`` adds what stays alive
outside them). Every jitted step donates the parameters and the optimizer
state; MultiSteps and the naive loop get their micro-batches sliced once,
before timing.
"""

from __future__ import annotations

import abc
import functools
import time
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _models import Model

import jaxaccum

PyTree = Any


def tree_bytes(tree: PyTree, dtype: Any = None) -> int:
  """Bytes of the arrays in ``tree``, or of the same shapes in ``dtype``."""
  total = 0
  for x in jax.tree.leaves(tree):
    itemsize = jnp.dtype(dtype or x.dtype).itemsize
    total += int(x.size) * itemsize
  return total


def fresh_copy(tree: PyTree) -> PyTree:
  """New device buffers with the values of ``tree`` (safe to donate)."""
  return jax.tree.map(jnp.copy, tree)


def shape_of(tree: PyTree) -> PyTree:
  """``jax.ShapeDtypeStruct`` for each leaf, to compile without data."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def compiled_stats(jitted: Any, *args: Any) -> dict[str, Any]:
  """Traces, lowers and compiles ``jitted(*args)`` (``ShapeDtypeStruct``s
  will do: nothing runs): XLA's memory analysis, the seconds it took
  (``compile_s``) and the jaxpr's ``effects`` (a jitted function with any
  effect misses JAX's C++ dispatch fast path)."""
  start = time.perf_counter()
  traced = jitted.trace(*args)
  compiled = traced.lower().compile()
  seconds = time.perf_counter() - start
  analysis = compiled.memory_analysis()
  stats = {
    "argument_bytes": int(analysis.argument_size_in_bytes),
    "output_bytes": int(analysis.output_size_in_bytes),
    "temp_bytes": int(analysis.temp_size_in_bytes),
    "alias_bytes": int(analysis.alias_size_in_bytes),
  }
  stats["peak_bytes"] = (
    stats["argument_bytes"]
    + stats["output_bytes"]
    + stats["temp_bytes"]
    - stats["alias_bytes"]
  )
  stats["compile_s"] = seconds
  stats["effects"] = sorted(type(e).__name__ for e in traced.jaxpr.effects)
  return stats


def bound_terms(params: PyTree, batch: PyTree, k: int) -> tuple[PyTree, int, int]:
  """The memory bound's terms beside the micro step's peak: the ``B / k`` rows'
  shapes, a float32 accumulator's bytes, the other ``B - B / k`` rows' bytes."""
  size = jax.tree.leaves(batch)[0].shape[0]
  micro = size // k
  micro_batch = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct((micro, *x.shape[1:]), x.dtype), batch
  )
  rest = tree_bytes(batch) * (size - micro) // size
  return micro_batch, tree_bytes(params, jnp.float32), rest


def max_rel_error(got: PyTree, want: PyTree) -> float:
  """The largest over the leaves of two trees of ``max|got - want| / max|want|``."""
  return max(
    float(np.max(np.abs(np.asarray(g) - np.asarray(w))) / np.max(np.abs(w)))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
  )


def split_micro_batches(batch: PyTree, k: int) -> list[PyTree]:
  """The ``k`` contiguous micro-batches of ``batch``, as separate arrays."""
  size = jax.tree.leaves(batch)[0].shape[0] // k
  return [
    jax.tree.map(lambda x, i=i: x[i * size : (i + 1) * size], batch) for i in range(k)
  ]


def train_step(value_and_grad: Any, tx: optax.GradientTransformation) -> Any:
  """The jitted, donated step ``(params, opt_state, batch) -> (params,
  opt_state, value)``: ``value_and_grad(params, batch)``, then one update."""

  def step(params, opt_state, batch):
    value, grads = value_and_grad(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return jax.jit(step, donate_argnums=(0, 1))


@functools.cache
def full_batch_step(loss: Any, tx: optax.GradientTransformation) -> Any:
  """The jitted, donated full-batch step ``(params, opt_state, batch)``.

  Cached, so that every ``k`` of a model reuses one jitted function (and its
  compilations, one per batch shape).
  """
  return train_step(jax.value_and_grad(loss), tx)


def full_batch_select_step(loss: Any, tx: optax.GradientTransformation) -> Any:
  """The full-batch step with ``make_train_step``'s skip written by hand: the
  new parameters and optimizer state kept only where the loss and every
  gradient are finite (``jnp.where``), without an optimization barrier."""

  def step(params, opt_state, batch):
    value, grads = jax.value_and_grad(loss)(params, batch)
    leaves = [value, *jax.tree.leaves(grads)]
    ok = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))
    updates, new_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = functools.partial(jax.tree.map, lambda n, o: jnp.where(ok, n, o))
    return keep(new_params, params), keep(new_state, opt_state), value

  return jax.jit(step, donate_argnums=(0, 1))


def hand_scan(
  loss: Any, k: int, *, split: str = "contiguous", shardings: PyTree = None
) -> Any:
  """Accumulation written by hand, the peers' baseline: ``(params, batch) ->
  (value, grads)``, a ``lax.scan`` over ``k`` micro-batches adding each
  gradient into a float32 accumulator, then the mean. ``split="contiguous"``:
  micro-batch ``i`` is a C-order ``batch.reshape(k, B // k, ...)``'s ``i``-th;
  ``"strided"``: rows ``i, i + k, ...`` (MaxText's, which keeps every
  device's rows on it). With ``shardings`` (the parameters'), the parameters,
  the accumulator and the gradients are constrained to them, as MaxText does."""

  def constrain(tree: PyTree) -> PyTree:
    if shardings is None:
      return tree
    return jax.lax.with_sharding_constraint(tree, shardings)

  def split_batch(x: jax.Array) -> jax.Array:
    if split == "strided":
      return x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1)
    return x.reshape(k, x.shape[0] // k, *x.shape[1:])

  def value_and_grad(params, batch):
    params = constrain(params)

    def body(carry, micro_batch):
      value, grads = jax.value_and_grad(loss)(params, micro_batch)
      acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), carry[1], grads)
      return (carry[0] + value, constrain(acc)), None

    # zeros_like keeps a parameter's sharding on Explicit axes (the scan's
    # carry must keep its type).
    zeros = jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params)
    init = (jnp.zeros((), jnp.float32), constrain(zeros))
    (total, acc), _ = jax.lax.scan(body, init, jax.tree.map(split_batch, batch))
    grads = jax.tree.map(lambda a, p: (a / k).astype(p.dtype), acc, params)
    return total / k, constrain(grads)

  return value_and_grad


def optax_microbatch(loss: Any, micro_batch_size: int) -> Any:
  """``optax.microbatching.microbatch(jax.value_and_grad(loss), ...)``, MEAN:
  ``(params, batch) -> (value, grads)``."""
  return optax.microbatching.microbatch(
    jax.value_and_grad(loss),
    argnums=1,
    microbatch_size=micro_batch_size,
    accumulator=optax.microbatching.AccumulationType.MEAN,
  )


class Approach(abc.ABC):
  """One way to take an optimizer step over ``k`` micro-batches of
  ``model``'s batch with ``tx``; ``name`` in the JSON, ``label`` for people."""

  name: ClassVar[str]
  label: ClassVar[str]

  def __init__(self, model: Model, tx: optax.GradientTransformation, k: int):
    self.model, self.tx, self.k = model, tx, k
    self.micro_batch_size = model.batch_size // k
    self.params: PyTree = None
    self.opt_state: PyTree = None

  def reset(self) -> None:
    """Fresh parameters (copies of the initial ones) and optimizer state."""
    self.params = fresh_copy(self.model.params)
    self.opt_state = self.init_state(self.params)

  def init_state(self, params: PyTree) -> PyTree:
    """The optimizer state for ``params``."""
    return self.tx.init(params)

  @abc.abstractmethod
  def step(self) -> PyTree:
    """One optimizer step over the whole effective batch; returns the params."""

  @abc.abstractmethod
  def memory(self) -> dict[str, Any]:
    """Compile-time memory of what a step runs (see the module docstring)."""

  def calls_per_step(self) -> int:
    """Jitted calls (dispatches) the host makes per step."""
    return 1


class OneCallStep(Approach):
  """An approach whose whole step is one jitted ``fn(params, opt_state,
  batch)``, the one its ``make()`` returns."""

  def __init__(self, model: Model, tx: optax.GradientTransformation, k: int):
    super().__init__(model, tx, k)
    self.fn = self.make()

  @abc.abstractmethod
  def make(self) -> Any:
    """The jitted, donated step."""

  def step(self) -> PyTree:
    self.params, self.opt_state, _ = self.fn(
      self.params, self.opt_state, self.model.batch
    )
    return self.params

  def memory(self) -> dict[str, Any]:
    return compiled_stats(
      self.fn,
      shape_of(self.model.params),
      shape_of(self.tx.init(self.model.params)),
      self.model.batch,
    )


class FullBatch(OneCallStep):
  """``jax.value_and_grad`` on all ``B`` rows and one update, in one jit."""

  name, label = "full_batch", "full batch"

  def make(self) -> Any:
    return full_batch_step(self.model.loss, self.tx)


class JaxAccum(OneCallStep):
  """``jaxaccum.make_train_step``: ``lax.scan`` over micro-batches in one jit."""

  name, label = "jaxaccum", "jaxaccum"
  skip_nonfinite = True

  def make(self) -> Any:
    skip = self.skip_nonfinite
    return jaxaccum.make_train_step(
      self.model.loss, self.tx, self.k, skip_nonfinite=skip
    )


class JaxAccumNoSkip(JaxAccum):
  """``jaxaccum.make_train_step(..., skip_nonfinite=False)``: no finite check."""

  name, label = "jaxaccum_no_skip", "jaxaccum, no skip"
  skip_nonfinite = False


class OptaxMicrobatch(OneCallStep):
  """``optax.microbatching.microbatch(jax.value_and_grad(loss), ...)``, MEAN."""

  name, label = "optax_microbatch", "optax.microbatch"

  def make(self) -> Any:
    vg = optax_microbatch(self.model.loss, self.micro_batch_size)
    return train_step(vg, self.tx)


class OptaxMultiSteps(Approach):
  """``optax.MultiSteps(tx, k)``: ``k`` jitted micro-steps make one step."""

  name, label = "optax_multisteps", "optax.MultiSteps"

  def __init__(self, model: Model, tx: optax.GradientTransformation, k: int):
    super().__init__(model, tx, k)
    self.multi = optax.MultiSteps(tx, every_k_schedule=k)
    self.micro_batches = split_micro_batches(model.batch, k)
    self.fn = train_step(jax.value_and_grad(model.loss), self.multi)

  def init_state(self, params: PyTree) -> PyTree:
    return self.multi.init(params)

  def step(self) -> PyTree:
    for micro_batch in self.micro_batches:
      self.params, self.opt_state, _ = self.fn(self.params, self.opt_state, micro_batch)
    return self.params

  def memory(self) -> dict[str, Any]:
    return compiled_stats(
      self.fn,
      shape_of(self.model.params),
      shape_of(self.multi.init(self.model.params)),
      self.micro_batches[0],
    )

  def calls_per_step(self) -> int:
    return self.k


class NaiveLoop(Approach):
  """``k`` jitted ``jax.grad`` calls summed in Python, then a jitted update."""

  name, label = "naive_loop", "naive loop"

  def __init__(self, model: Model, tx: optax.GradientTransformation, k: int):
    super().__init__(model, tx, k)
    self.micro_batches = split_micro_batches(model.batch, k)
    self.grad_fn = jax.jit(jax.grad(model.loss))

    def update(params, opt_state, grad_sum):
      grads = jax.tree.map(lambda g: g / k, grad_sum)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    self.update_fn = jax.jit(update, donate_argnums=(0, 1, 2))

  def step(self) -> PyTree:
    grad_sum = None
    for micro_batch in self.micro_batches:
      grads = self.grad_fn(self.params, micro_batch)
      grad_sum = grads if grad_sum is None else jax.tree.map(jnp.add, grad_sum, grads)
    self.params, self.opt_state = self.update_fn(self.params, self.opt_state, grad_sum)
    return self.params

  def memory(self) -> dict[str, Any]:
    params = shape_of(self.model.params)
    grad = compiled_stats(self.grad_fn, params, self.micro_batches[0])
    update = compiled_stats(
      self.update_fn, params, shape_of(self.tx.init(self.model.params)), params
    )
    peak = max(grad["peak_bytes"], update["peak_bytes"])
    resident = grad["peak_bytes"] + tree_bytes(self.model.params)
    resident += tree_bytes(self.tx.init(self.model.params))
    return {
      "peak_bytes": peak,
      "grad_fn": grad,
      "update_fn": update,
      "resident_bytes": max(resident, update["peak_bytes"]),
      "compile_s": grad["compile_s"] + update["compile_s"],
      "effects": sorted(set(grad["effects"]) | set(update["effects"])),
    }

  def calls_per_step(self) -> int:
    num_leaves = len(jax.tree.leaves(self.model.params))
    return self.k + (self.k - 1) * num_leaves + 1


APPROACHES: tuple[type[Approach], ...] = (
  FullBatch,
  JaxAccum,
  JaxAccumNoSkip,
  OptaxMicrobatch,
  OptaxMultiSteps,
  NaiveLoop,
)
PEERS = (OptaxMicrobatch.name, OptaxMultiSteps.name, NaiveLoop.name)
