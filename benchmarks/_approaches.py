"""The ways to take one optimizer step on an effective batch of ``B`` rows.

Each approach wraps the same ``loss(params, batch)`` and the same optax
optimizer ``tx``, and offers the same interface (:class:`Approach`):

- ``reset()`` gives it fresh copies of the model's initial parameters and a
  fresh optimizer state;
- ``step()`` processes the whole effective batch (``k`` micro-batches) and
  applies exactly one optimizer update; it returns a pytree to block on;
- ``memory()`` compiles (never runs) what a step executes and returns XLA's
  memory analysis.

The approaches:

1. :class:`FullBatch`: ``jax.value_and_grad`` on all ``B`` rows, one jit.
2. :class:`JaxAccum`: ``jaxaccum.make_train_step(loss, tx, k)``, which also
   checks that the loss and gradients are finite and skips the update if not;
   :class:`JaxAccumNoSkip` is the same with ``skip_nonfinite=False``, what the
   peers compute (none of them checks).
3. :class:`OptaxMicrobatch`: ``optax.microbatching.microbatch`` around
   ``jax.value_and_grad``, one jit.
4. :class:`OptaxMultiSteps`: ``optax.MultiSteps(tx, k)``; a step is ``k``
   jitted calls (gradient on one micro-batch, MultiSteps update, apply).
5. :class:`NaiveLoop`: ``k`` calls of a jitted ``jax.grad``, summed in Python
   (eager jax ops on device arrays), then one jitted update on ``sum / k``.
6. :class:`HandScan`, timed only when asked for: a ``lax.scan`` over the
   micro-batches written without jaxaccum, one jit.

Every jitted step donates the parameters and the optimizer state, as a
training loop would.

What ``memory()`` measures (``peak = argument + output + temp - alias``, the
formula of ``jaxaccum.MemoryStats``):

- single-call approaches (1-3, 6, and jaxaccum without the skip): the peak of
  the compiled step, with the whole batch as an argument;
- MultiSteps: the peak of its per-micro-batch call. Its arguments hold one
  micro-batch, the parameters and the MultiSteps state (inner state and the
  float32 accumulator). The rest of the batch lives outside the call;
- naive loop: the larger of the peaks of its two compiled functions, the
  micro-batch gradient and the update. While the gradient function runs the
  Python-side accumulator (one gradient tree) and the optimizer state are
  also alive, outside that call; ``resident_bytes`` adds them.

For 4 and 5 the micro-batches are sliced from the batch once, before timing:
the timed step does not pay for slicing, which favours them.
"""

from __future__ import annotations

import abc
import functools
import time
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
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
  """Traces, lowers and compiles ``jitted(*args)``; XLA's memory analysis.

  The arrays in ``args`` may be ``jax.ShapeDtypeStruct``s; nothing runs.
  Besides the byte counts (``peak = argument + output + temp - alias``):

  - ``compile_s``: the wall time of tracing, lowering and compiling;
  - ``effects``: the jaxpr's effects. A jitted function with any effect (an
    ``ErrorEffect`` from ``checkify.debug_check``, a callback, ...) does not
    get JAX's C++ dispatch fast path: every call runs the Python path of
    ``jax.jit``, which costs a fixed overhead per call.
  """
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


def split_micro_batches(batch: PyTree, k: int) -> list[PyTree]:
  """The ``k`` contiguous micro-batches of ``batch``, as separate arrays."""
  size = jax.tree.leaves(batch)[0].shape[0] // k
  return [
    jax.tree.map(lambda x, i=i: x[i * size : (i + 1) * size], batch) for i in range(k)
  ]


@functools.cache
def full_batch_step(loss: Any, tx: optax.GradientTransformation) -> Any:
  """The jitted, donated full-batch step ``(params, opt_state, batch)``.

  Cached, so that every ``k`` of a model reuses one jitted function (and its
  compilations, one per batch shape).
  """

  def step(params, opt_state, batch):
    value, grads = jax.value_and_grad(loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return jax.jit(step, donate_argnums=(0, 1))


class Approach(abc.ABC):
  """One way to take an optimizer step over ``k`` micro-batches.

  Attributes:
    name: the identifier used in the JSON and plots.
    label: the human-readable name.
    model: the model: loss, initial parameters and the whole batch.
    tx: the optimizer (the inner optimizer for MultiSteps).
    k: the number of micro-batches.
    micro_batch_size: ``B // k``.
  """

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
  """An approach whose whole step is one jitted ``fn(params, opt_state, batch)``."""

  fn: Any

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

  def __init__(self, model: Model, tx: optax.GradientTransformation, k: int):
    super().__init__(model, tx, k)
    self.fn = full_batch_step(model.loss, tx)


class JaxAccum(OneCallStep):
  """``jaxaccum.make_train_step``: ``lax.scan`` over micro-batches in one jit."""

  name, label = "jaxaccum", "jaxaccum"
  skip_nonfinite = True

  def __init__(self, model: Model, tx: optax.GradientTransformation, k: int):
    super().__init__(model, tx, k)
    self.fn = jaxaccum.make_train_step(
      model.loss, tx, k, skip_nonfinite=self.skip_nonfinite
    )


class JaxAccumNoSkip(JaxAccum):
  """``jaxaccum.make_train_step(..., skip_nonfinite=False)``: no finite check."""

  name, label = "jaxaccum_no_skip", "jaxaccum, no skip"
  skip_nonfinite = False


class OptaxMicrobatch(OneCallStep):
  """``optax.microbatching.microbatch(jax.value_and_grad(loss), ...)``, MEAN."""

  name, label = "optax_microbatch", "optax.microbatch"

  def __init__(self, model: Model, tx: optax.GradientTransformation, k: int):
    super().__init__(model, tx, k)
    value_and_grad = optax.microbatching.microbatch(
      jax.value_and_grad(model.loss),
      argnums=1,
      microbatch_size=self.micro_batch_size,
      accumulator=optax.microbatching.AccumulationType.MEAN,
    )

    def step(params, opt_state, batch):
      value, grads = value_and_grad(params, batch)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, value

    self.fn = jax.jit(step, donate_argnums=(0, 1))


class HandScan(OneCallStep):
  """A ``lax.scan`` over the micro-batches written without jaxaccum: the
  batch reshaped to ``(k, B / k, ...)``, a float32 accumulator, the mean of
  the ``k`` gradients and one update, in one jit (the step
  ``accelerator_memory.hand_scan_step`` compiles, with this optimizer).
  Timed only when ``--approaches`` names it."""

  name, label = "hand_scan", "hand-written scan"

  def __init__(self, model: Model, tx: optax.GradientTransformation, k: int):
    super().__init__(model, tx, k)
    loss = model.loss

    def step(params, opt_state, batch):
      micro = jax.tree.map(lambda x: x.reshape(k, -1, *x.shape[1:]), batch)

      def body(acc, mb):
        value, grads = jax.value_and_grad(loss)(params, mb)
        return jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, grads), value

      zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
      acc, values = jax.lax.scan(body, zeros, micro)
      grads = jax.tree.map(lambda a, p: (a / k).astype(p.dtype), acc, params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, jnp.mean(values)

    self.fn = jax.jit(step, donate_argnums=(0, 1))


class OptaxMultiSteps(Approach):
  """``optax.MultiSteps(tx, k)``: ``k`` jitted micro-steps make one step."""

  name, label = "optax_multisteps", "optax.MultiSteps"

  def __init__(self, model: Model, tx: optax.GradientTransformation, k: int):
    super().__init__(model, tx, k)
    self.multi = optax.MultiSteps(tx, every_k_schedule=k)
    self.micro_batches = split_micro_batches(model.batch, k)

    def micro_step(params, state, micro_batch):
      value, grads = jax.value_and_grad(model.loss)(params, micro_batch)
      updates, state = self.multi.update(grads, state, params)
      return optax.apply_updates(params, updates), state, value

    self.fn = jax.jit(micro_step, donate_argnums=(0, 1))

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
#: Approaches a run times only where ``--approaches`` names them; each is a
#: peer too.
OPTIONAL: tuple[type[Approach], ...] = (HandScan,)
