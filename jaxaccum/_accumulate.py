"""``value_and_grad`` and ``grad``: the in-step ``lax.scan`` accumulation engine.

One jitted step splits the batch into ``k`` micro-batches (``_split``), runs
forward and backward on each inside a ``lax.scan``, and adds each gradient into
an accumulator of at least ``accum_dtype`` (float32 by default). The per-micro-
batch losses and weights leave the scan as ``k`` scalars; the normalization
mode (``_normalize``) turns the sums into the result once, after the loop.

The engine is split in two halves so that the data-parallel path can reduce
between them: ``_Engine.sums`` runs the loop on a (local) batch and returns raw
``Sums``; ``_Engine.finish`` normalizes them and restores the dtypes
``jax.value_and_grad`` would return.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp

from jaxaccum import _checks, _normalize, _parallel, _split, _stats

PyTree = Any


class Sums(NamedTuple):
  """What the micro-batch loop produces, before any normalization.

  Attributes:
    loss: the sum of the micro-batch losses; shape=(), at least ``accum_dtype``.
    grads: the sum of the micro-batch gradients, one tree per entry of
      ``argnums``; leaves like the parameters, at least ``accum_dtype``.
    weight: the sum of the micro-batch weights; shape=(), at least float32.
    aux: ``fun``'s aux per micro-batch, each leaf with a leading axis ``k``.
    state: the state after the last micro-batch (``None`` without state).
    losses: the per-micro-batch losses; shape=(k,), ``fun``'s loss dtype.
    noise: partial sums for the gradient noise scale (``None`` unless
      ``noise_stats``).
  """

  loss: jax.Array
  grads: tuple[PyTree, ...]
  weight: jax.Array
  aux: PyTree
  state: PyTree
  losses: jax.Array
  noise: _stats.NoiseSums | None


def _as_tuple(argnums: int | Sequence[int], name: str) -> tuple[int, ...]:
  nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
  if not nums or not all(isinstance(n, int) for n in nums):
    raise TypeError(f"{name} must be an int or a non-empty tuple of ints.")
  if min(nums) < 0:
    raise ValueError(f"{name}={argnums} must be non-negative.")
  if len(set(nums)) != len(nums):
    raise ValueError(f"{name}={argnums} repeats an argument.")
  return nums


@dataclasses.dataclass(frozen=True)
class _Engine:
  """The static configuration of one accumulated ``value_and_grad``."""

  fun: Callable[..., Any]
  num_micro_batches: int | None
  micro_batch_size: int | None
  argnums: tuple[int, ...]
  batch_argnums: tuple[int, ...]
  has_aux: bool
  normalization: _normalize.Normalization
  accum_dtype: Any
  rng_argnum: int | None
  state_argnum: int | None
  remat: bool | Callable[..., Any]
  noise_stats: bool
  value_checks: bool

  def check_args(self, args: tuple[Any, ...]) -> None:
    """Trace-time checks of the call's positional arguments."""
    used = self.argnums + self.batch_argnums
    for n in (self.rng_argnum, self.state_argnum):
      if n is not None:
        used += (n,)
    if max(used) >= len(args):
      raise ValueError(
        f"The function was called with {len(args)} positional arguments, "
        f"but argnums={self.argnums}, batch_argnums={self.batch_argnums}, "
        f"rng_argnum={self.rng_argnum} and state_argnum={self.state_argnum} "
        "refer to more."
      )

  def plan(self, args: tuple[Any, ...]) -> _split.MicroBatching:
    """Validates the batch arguments and resolves ``k`` and ``m``."""
    self.check_args(args)
    batch = {f"args[{i}]": args[i] for i in self.batch_argnums}
    return _split.plan_split(
      _split.leading_batch_size(batch),
      self.num_micro_batches,
      self.micro_batch_size,
    )

  def _micro_loss(self, kwargs: dict[str, Any]) -> Callable[..., Any]:
    """``fun`` as ``args -> (loss, (weight, aux, new_state))`` for autodiff."""

    def loss_fn(*args):
      out = self.fun(*args, **kwargs)
      value, aux = _unpack_aux(out, self.has_aux)
      new_state = None
      if self.state_argnum is not None:
        aux, new_state = _unpack_state(aux)
      loss, weight = self.normalization.loss_and_weight(value)
      return loss, (weight, aux, new_state)

    return loss_fn

  def sums(
    self,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    split: _split.MicroBatching,
    diff_args: tuple[PyTree, ...] | None = None,
    index_offset: jax.Array | int = 0,
  ) -> Sums:
    """Runs the ``lax.scan`` over the micro-batches of ``args``.

    Args:
      args: the positional arguments; the batch arguments hold this device's
        batch, of ``split.batch_size`` rows.
      kwargs: keyword arguments, passed unchanged to every micro-batch.
      split: the resolved split of the batch.
      diff_args: the values to differentiate at, by default
        ``args[argnums]`` (the data-parallel path passes them cast to varying).
      index_offset: added to the micro-batch index before it is folded into
        the key, so that micro-batch ``i`` of device ``d`` is the global
        micro-batch ``d * k + i``.
    """
    k, m = split.num_micro_batches, split.micro_batch_size
    if diff_args is None:
      diff_args = tuple(args[i] for i in self.argnums)
    micro_batches = tuple(_split.split(args[i], k) for i in self.batch_argnums)
    value_and_grad = jax.value_and_grad(
      self._micro_loss(kwargs),
      argnums=self.argnums,
      has_aux=True,
    )
    init_grads = jax.tree.map(
      lambda p: _parallel.like_vma(
        jnp.zeros(jnp.shape(p), _normalize.accumulator_dtype(self.accum_dtype, p)), p
      ),
      diff_args,
    )
    init_state = None if self.state_argnum is None else args[self.state_argnum]

    def micro_step(diff_args, micro, index, state):
      """Forward and backward on one micro-batch."""
      chex.assert_tree_shape_prefix(micro, (m,))
      call_args = list(args)
      for n, d in zip(self.argnums, diff_args, strict=True):
        call_args[n] = d
      for n, b in zip(self.batch_argnums, micro, strict=True):
        call_args[n] = b
      if self.rng_argnum is not None:
        call_args[self.rng_argnum] = jax.random.fold_in(args[self.rng_argnum], index)
      if self.state_argnum is not None:
        call_args[self.state_argnum] = state
      return value_and_grad(*call_args)

    if self.remat is not False:
      policy = None if self.remat is True else self.remat
      micro_step = jax.checkpoint(micro_step, prevent_cse=False, policy=policy)

    def body(carry, xs, first=False):
      acc_grads, state = carry
      micro, index = xs
      (loss, (weight, aux, new_state)), grads = micro_step(
        diff_args, micro, index, state
      )
      chex.assert_trees_all_equal_shapes(grads, init_grads)
      acc_grads = jax.tree.map(
        lambda a, g: g.astype(a.dtype) if first else a + g.astype(a.dtype),
        acc_grads,
        grads,
      )
      chex.assert_trees_all_equal_dtypes(acc_grads, init_grads)
      if self.state_argnum is not None:
        new_state = _match_state(new_state, state)
      sq_norm = _stats.sq_norm(grads) if self.noise_stats else None
      return (acc_grads, new_state), (loss, weight, aux, sq_norm)

    indices = index_offset + jnp.arange(k, dtype=jnp.int32)
    if k == 1:
      # One micro-batch: no loop and no accumulator, exactly the full batch.
      first = jax.tree.map(lambda x: x[0], (micro_batches, indices))
      carry, ys = body((init_grads, init_state), first, first=True)
      (grads, state), (losses, weights, aux, sq_norms) = (
        carry,
        jax.tree.map(lambda y: jnp.expand_dims(y, 0), ys),
      )
    else:
      (grads, state), (losses, weights, aux, sq_norms) = jax.lax.scan(
        body, (init_grads, init_state), (micro_batches, indices)
      )
    if self.value_checks:
      _checks.check_weights(weights)
    return Sums(
      loss=jnp.sum(losses.astype(jnp.promote_types(self.accum_dtype, losses.dtype))),
      grads=grads,
      weight=jnp.sum(weights.astype(jnp.promote_types(jnp.float32, weights.dtype))),
      aux=aux,
      state=state,
      losses=losses,
      noise=None
      if sq_norms is None
      else _stats.micro_batch_noise(self.normalization.name, sq_norms, weights, m),
    )

  def finish(
    self,
    sums: Sums,
    diff_args: tuple[PyTree, ...],
    sq_norm: Callable[[PyTree], jax.Array] = _stats.sq_norm,
  ) -> tuple[Any, Any, _stats.GradientNoise | None]:
    """Normalizes ``sums``: ``(value, aux)``, the grads tuple, and the noise."""
    norm = self.normalization
    value = norm.finalize(sums.loss, sums.weight).astype(sums.losses.dtype)
    normalized = norm.finalize(sums.grads, sums.weight)
    grads = jax.tree.map(
      lambda g, p: g.astype(_normalize.result_dtype(p)), normalized, diff_args
    )
    if self.value_checks:
      _checks.check_total_weight(sums.weight, grads)
    aux = sums.aux
    if self.state_argnum is not None:
      aux = (aux, sums.state)
    noise = None
    if sums.noise is not None:
      big_sq_norm = sq_norm(normalized)
      if not norm.divide:
        # A sum over the batch's rows: its per-row mean is the sum / B_big.
        big_sq_norm = big_sq_norm / sums.noise.examples**2
      noise = sums.noise.finalize(big_sq_norm)
    return (value, aux), grads, noise

  def output(
    self,
    value_aux: tuple[Any, Any],
    grads: tuple[PyTree, ...],
    noise: _stats.GradientNoise | None,
    argnums: int | Sequence[int],
  ) -> Any:
    """Arranges the result as ``jax.value_and_grad`` would, plus the noise."""
    if isinstance(argnums, int):
      grads = grads[0]
    value = value_aux if self.has_aux else value_aux[0]
    if self.noise_stats:
      return (value, grads), noise
    return value, grads


def _unpack_aux(out: Any, has_aux: bool) -> tuple[Any, Any]:
  if not has_aux:
    return out, None
  if not (isinstance(out, (tuple, list)) and len(out) == 2):
    raise ValueError(
      "has_aux=True needs fun to return a pair (value, aux), got a "
      f"{type(out).__name__}."
    )
  return out[0], out[1]


def _unpack_state(aux: Any) -> tuple[Any, Any]:
  if not (isinstance(aux, (tuple, list)) and len(aux) == 2):
    raise ValueError(
      "state_argnum needs fun to return (value, (aux, new_state)), got an "
      f"aux that is a {type(aux).__name__}, not a pair."
    )
  return aux[0], aux[1]


def _match_state(new_state: PyTree, state: PyTree) -> PyTree:
  """Checks that ``fun`` returned a state like the one it got; keeps dtypes."""
  new_struct: Any = jax.tree.structure(new_state)
  old_struct: Any = jax.tree.structure(state)
  if new_struct != old_struct:
    raise ValueError(
      "fun returned a new_state whose structure differs from the state it "
      f"was given: {new_struct} vs {old_struct}."
    )
  for new, old in zip(jax.tree.leaves(new_state), jax.tree.leaves(state), strict=False):
    if jnp.shape(new) != jnp.shape(old):
      raise ValueError(
        "fun returned a new_state leaf of shape="
        f"{jnp.shape(new)} for a state leaf of shape={jnp.shape(old)}."
      )
  return jax.tree.map(_cast_like, new_state, state)


def _cast_like(new: Any, old: Any) -> Any:
  """``new`` in ``old``'s dtype (a weak-typed Python number, say, in int32)."""
  new, old = jnp.asarray(new), jnp.asarray(old)
  return new if new.dtype == old.dtype else new.astype(old.dtype)


def _engine(
  fun: Callable[..., Any],
  *,
  num_micro_batches: int | None,
  micro_batch_size: int | None,
  argnums: int | Sequence[int],
  batch_argnums: int | Sequence[int],
  has_aux: bool,
  normalize: str,
  accum_dtype: Any,
  rng_argnum: int | None,
  state_argnum: int | None,
  remat: bool | Callable[..., Any],
  noise_stats: bool,
  value_checks: bool,
) -> _Engine:
  """Validates the static arguments (at definition time) into an ``_Engine``."""
  if not callable(fun):
    raise TypeError(f"fun must be callable, got {fun!r}.")
  _split.check_split_arguments(num_micro_batches, micro_batch_size)
  diff = _as_tuple(argnums, "argnums")
  batch = _as_tuple(batch_argnums, "batch_argnums")
  if set(diff) & set(batch):
    raise ValueError(
      f"{argnums=} and {batch_argnums=} overlap: the differentiated "
      "arguments are not split."
    )
  for name, n in (("rng_argnum", rng_argnum), ("state_argnum", state_argnum)):
    if n is not None and n in diff + batch:
      raise ValueError(f"{name}={n} is also in argnums or batch_argnums.")
  if rng_argnum is not None and rng_argnum == state_argnum:
    raise ValueError(f"{rng_argnum=} and {state_argnum=} are the same argument.")
  if state_argnum is not None and not has_aux:
    raise ValueError(
      "state_argnum needs has_aux=True and fun returning (value, (aux, new_state))."
    )
  if not jnp.issubdtype(accum_dtype, jnp.floating):
    raise ValueError(f"accum_dtype must be a floating dtype, got {accum_dtype}.")
  return _Engine(
    fun=fun,
    num_micro_batches=num_micro_batches,
    micro_batch_size=micro_batch_size,
    argnums=diff,
    batch_argnums=batch,
    has_aux=has_aux,
    normalization=_normalize.get(normalize),
    accum_dtype=jnp.dtype(accum_dtype),
    rng_argnum=rng_argnum,
    state_argnum=state_argnum,
    remat=remat,
    noise_stats=noise_stats,
    value_checks=value_checks,
  )


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
  data_axis: str | None = None,
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
  engine = _engine(
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

  if mesh is not None or data_axis is not None:
    parallel = _parallel.wrap(engine, mesh, data_axis, param_specs)

    @functools.wraps(fun)
    def data_parallel(*args, **kwargs):
      value_aux, grads, noise = parallel(*args, **kwargs)
      return engine.output(value_aux, grads, noise, argnums)

    return data_parallel

  @functools.wraps(fun)
  def accumulated(*args, **kwargs):
    split = engine.plan(args)
    diff_args = tuple(args[i] for i in engine.argnums)
    sums = engine.sums(args, kwargs, split)
    value_aux, grads, noise = engine.finish(sums, diff_args)
    return engine.output(value_aux, grads, noise, argnums)

  return accumulated


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
