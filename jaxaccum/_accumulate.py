"""``value_and_grad`` and ``grad``: the public face of the scan engine.

These wrap :mod:`jaxaccum._engine` (the ``lax.scan`` over micro-batches) for
one device, or :mod:`jaxaccum._parallel` (the same engine inside
``shard_map``) with ``mesh=``. Called outside ``jit``, the step is compiled
once per configuration and kept (:mod:`jaxaccum._calls`), so an eager call
costs what an eager ``jax.value_and_grad`` call costs; under an outer
transformation it is traced inline.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxaccum import _calls, _engine, _parallel

PyTree = Any


def value_and_grad(
  fun: Callable[..., Any],
  num_micro_batches: int | None = None,
  *,
  micro_batch_size: int | None = None,
  argnums: int | Sequence[int] = 0,
  batch_argnums: int | Sequence[int] = 1,
  has_aux: bool = False,
  normalize: str = "mean",
  accum_dtype: Any = jnp.float32,
  rng_argnum: int | None = None,
  state_argnum: int | None = None,
  remat: bool | Callable[..., Any] = False,
  mesh: jax.sharding.Mesh | None = None,
  data_axis: str | tuple[str, ...] | None = None,
  param_specs: PyTree | None = None,
  noise_stats: bool = False,
  value_checks: bool = False,
) -> Callable[..., Any]:
  """Like ``jax.value_and_grad``, accumulated over micro-batches in one scan.

  The arguments in ``batch_argnums`` are split along their leading axis into
  ``k`` contiguous micro-batches (micro-batch ``i`` holds rows
  ``i*m .. (i+1)*m - 1``). A ``lax.scan`` runs ``fun`` forward and backward on
  each and adds the gradients into a float32 accumulator, so only one
  micro-batch's activations are alive at a time. The sums are normalized once.

  Args:
    fun: the loss, ``fun(*args, **kwargs)``. Its value is a scalar, or the pair
      ``(loss_sum, weight)`` with ``normalize="weighted"``; with ``has_aux``
      it returns ``(value, aux)``.
    num_micro_batches: ``k``, the number of micro-batches. Give this or
      ``micro_batch_size``.
    micro_batch_size: ``m``, the rows per micro-batch.
    argnums: the argument(s) to differentiate, as in ``jax.value_and_grad``.
    batch_argnums: the argument(s) to split: pytrees whose leaves share one
      leading batch axis. Other arguments reach every micro-batch unchanged.
    has_aux: ``fun`` returns ``(value, aux)``. The aux comes back stacked, with
      a leading axis of length ``k``.
    normalize: ``"mean"`` (``fun`` returns a micro-batch mean; the result is
      the mean over micro-batches), ``"sum"`` (the results are summed) or
      ``"weighted"`` (``fun`` returns ``(loss_sum, weight)``; the result is
      ``sum(loss_sum) / sum(weight)`` over the whole batch, zero when the
      total weight is zero).
    accum_dtype: the dtype of the sums; a gradient wider than it (float64) is
      summed in its own dtype. The grads come back in the parameters' dtype.
    rng_argnum: a PRNG key argument; micro-batch ``i`` receives
      ``jax.random.fold_in(key, i)``.
    state_argnum: a mutable state argument (e.g. BatchNorm statistics). ``fun``
      must use ``has_aux=True`` and return ``(value, (aux, new_state))``;
      micro-batch ``i + 1`` sees the state micro-batch ``i`` produced, and the
      aux comes back as ``(stacked_aux, final_state)``.
    noise_stats: also measure the gradient noise scale (McCandlish et al.
      2018) from the micro-batch gradients, at the cost of one squared norm
      per micro-batch. The function then returns ``(output, noise)``, with
      ``output`` as without it and ``noise`` a :class:`GradientNoise`
      (``|G_small|²``, ``|G_big|²``, ``B_small``, ``B_big``); feed it to
      :func:`noise_scale_update`. Needs ``k >= 2``.
    value_checks: emit value-level normalization checks (every weight finite
      and non-negative; a zero total weight gives zero grads), which raise
      when the step runs under ``chex.chexify``. Off by default: even unused,
      they would take a jitted step off JAX's fast dispatch path.
    remat: wrap each micro-batch's computation (forward and backward) in
      ``jax.checkpoint``; ``True``, or a ``jax.checkpoint_policies`` policy.
      This matters when you differentiate *through* the accumulated gradient
      (meta-gradients, gradient penalties): the outer backward pass then
      recomputes each micro-batch instead of storing ``k`` micro-batches of
      residuals. A first-order step already holds only one micro-batch's
      activations, and remat leaves its peak unchanged; to go below that,
      checkpoint layers inside the model (``nnx.remat``, ``nn.remat``).
    mesh: a ``jax.sharding.Mesh`` for data parallelism. Each device splits
      its own shard of the batch into ``k`` micro-batches (or micro-batches of
      ``micro_batch_size`` rows) and accumulates locally inside
      ``shard_map``; ONE reduction of the gradients runs after the loop. The
      micro-batch index folded into the key is global (``d * k + i`` on device
      ``d``). Each device threads its own copy of the state; after the loop
      floating-point state is averaged over devices, integers take their
      maximum, and a typed PRNG key (``jax.random.key``; a raw ``uint32`` key
      counts as integers) that ``fun`` advanced comes from device 0. Devices
      draw different numbers from typed keys in the state only.
    data_axis: the mesh axis that the batch is sharded along.
    param_specs: ``PartitionSpec``s of the differentiated arguments (a tree
      prefix per entry of ``argnums``). Only needed inside ``jit`` with an
      ``Auto`` mesh, where shardings are not visible at trace time; outside
      ``jit`` and with ``Explicit`` meshes they are read from the arrays.
      Parameters sharded along ``data_axis`` (FSDP) are all-gathered once
      before the loop, and their grads are reduce-scattered back to that
      sharding.

  Returns:
    A function of the same arguments as ``fun`` that returns
    ``(value, grads)``, or ``((value, aux), grads)`` with ``has_aux``.

  Raises:
    ValueError: at definition time for bad static arguments, and at trace time
      for a batch that does not split, naming the sizes.

  >>> import jax, jax.numpy as jnp, jaxaccum
  >>> def loss(w, batch):
  ...   x, y = batch
  ...   return jnp.mean((x @ w - y) ** 2)
  >>> x = jnp.arange(16.0).reshape(8, 2) / 10
  >>> y = x @ jnp.array([1.0, -1.0])
  >>> w = jnp.zeros(2)
  >>> value, grads = jaxaccum.value_and_grad(loss, num_micro_batches=4)(w, (x, y))
  >>> full_value, full_grads = jax.value_and_grad(loss)(w, (x, y))
  >>> bool(jnp.allclose(value, full_value)), bool(jnp.allclose(grads, full_grads))
  (True, True)
  """
  engine = _engine.make(
    fun,
    num_micro_batches=num_micro_batches,
    micro_batch_size=micro_batch_size,
    argnums=argnums,
    batch_argnums=batch_argnums,
    has_aux=has_aux,
    normalize=normalize,
    accum_dtype=accum_dtype,
    rng_argnum=rng_argnum,
    state_argnum=state_argnum,
    remat=remat,
    noise_stats=noise_stats,
    value_checks=value_checks,
  )
  step = Step(engine, mesh, data_axis, param_specs)

  @functools.wraps(fun)
  def accumulated(*args, **kwargs):
    value_aux, grads, noise = step(*args, **kwargs)
    return engine.output(value_aux, grads, noise, argnums)

  return accumulated


class Step:
  """An engine's whole step, on one device or data-parallel with ``mesh=``.

  ``step(*args, **kwargs)`` returns ``((value, aux), grads_tuple, noise)``.
  Called eagerly it runs one compiled program per configuration; under an
  outer transformation, :meth:`traced` runs inline.
  """

  def __init__(
    self,
    engine: _engine.Engine,
    mesh: jax.sharding.Mesh | None,
    data_axis: str | tuple[str, ...] | None,
    param_specs: PyTree | None,
  ):
    self.engine = engine
    self.parallel: _parallel.DataParallel | None = None
    if mesh is not None or data_axis is not None:
      if mesh is None:
        raise ValueError(f"{data_axis=} needs mesh=, the mesh that holds that axis.")
      if data_axis is None:
        raise ValueError("mesh= needs data_axis=, the name of the mesh's data axis.")
      self.parallel = _parallel.DataParallel(engine, mesh, data_axis, param_specs)
    elif param_specs is not None:
      raise ValueError("param_specs is for the data-parallel path; pass mesh= too.")
    self._compiled = _calls.Compiled(
      self.traced,
      static_positions=self.static_positions,
      checked=engine.value_checks,
    )

  def static_positions(self, num_args: int) -> list[int]:
    """Positions whose Python values ``fun`` gets as they are (not traced)."""
    return [n for n in range(num_args) if n not in self.engine.array_argnums]

  def layout(self, args: tuple[Any, ...]) -> Any:
    """What the compiled program depends on besides static values: the
    parameters' shardings on the data-parallel path."""
    return None if self.parallel is None else self.parallel.layout(args)

  def traced(self, layout: Any, /, *args: Any, **kwargs: Any) -> Any:
    if self.parallel is not None:
      return self.parallel(layout, *args, **kwargs)
    return self.engine.local(args, kwargs)

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    if _calls.is_tracing((args, kwargs)):
      return self.traced(self.layout(args), *args, **kwargs)
    self.engine.check_args(args)
    return self._compiled(self.layout(args), *args, **kwargs)


def grad(
  fun: Callable[..., Any],
  num_micro_batches: int | None = None,
  **kwargs: Any,
) -> Callable[..., Any]:
  """Like ``jax.grad``, accumulated over micro-batches; see ``value_and_grad``.

  Takes the same arguments as :func:`value_and_grad` and returns a function
  that gives ``grads``, or ``(grads, aux)`` with ``has_aux=True``; with
  ``noise_stats=True``, ``(that, noise)``.

  >>> import jax.numpy as jnp, jaxaccum
  >>> loss = lambda w, x: jnp.mean((x * w) ** 2)
  >>> g = jaxaccum.grad(loss, micro_batch_size=2)(jnp.array(1.0), jnp.arange(4.0))
  >>> float(g)  # d/dw mean(x^2 w^2) = 2 w mean(x^2) = 2 * 3.5
  7.0
  """
  value_and_grad_fun = value_and_grad(fun, num_micro_batches, **kwargs)
  has_aux = kwargs.get("has_aux", False)
  noise_stats = kwargs.get("noise_stats", False)

  @functools.wraps(fun)
  def accumulated_grad(*args, **call_kwargs):
    out = value_and_grad_fun(*args, **call_kwargs)
    value, grads = out[0] if noise_stats else out
    result = (grads, value[1]) if has_aux else grads
    return (result, out[1]) if noise_stats else result

  return accumulated_grad
