"""The scan engine that everything else builds on.

One traced step splits the batch into ``k`` micro-batches (``_split``), runs
forward and backward on each inside a ``lax.scan``, and adds each gradient into
an accumulator of at least ``accum_dtype`` (float32 by default). The
per-micro-batch losses and weights leave the scan as ``k`` scalars; the
normalization mode (``_normalize``) turns the sums into the result once, after
the loop.

The engine is split in two halves so that the data-parallel path can reduce
between them: :meth:`Engine.sums` runs the loop on a (local) batch and returns
raw :class:`Sums`; :meth:`Engine.finish` normalizes them and restores the
dtypes ``jax.value_and_grad`` would return. The public wrappers
(``_accumulate``), the data-parallel path (``_parallel``) and
``verify_equivalence`` (``_checks``) all build on this module; it imports none
of them.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jaxaccum import _normalize, _sharding, _split, _stats

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


@dataclasses.dataclass(frozen=True)
class Engine:
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

  @property
  def array_argnums(self) -> tuple[int, ...]:
    """The positions whose leaves are always arrays (differentiated, split,
    key and state arguments); Python values elsewhere stay Python values."""
    extra = tuple(n for n in (self.rng_argnum, self.state_argnum) if n is not None)
    return self.argnums + self.batch_argnums + extra

  def check_args(self, args: tuple[Any, ...]) -> None:
    """Trace-time checks of the call's positional arguments."""
    used = self.array_argnums
    if max(used) >= len(args):
      raise ValueError(
        f"The function was called with {len(args)} positional arguments, "
        f"but argnums={self.argnums}, batch_argnums={self.batch_argnums}, "
        f"rng_argnum={self.rng_argnum} and state_argnum={self.state_argnum} "
        "refer to more."
      )
    _check_no_nnx_objects(args)
    for n in self.argnums:
      _check_differentiable(args[n], f"args[{n}]")

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
    batches = _split.MicroBatches(tuple(args[i] for i in self.batch_argnums), k)
    value_and_grad = jax.value_and_grad(
      self._micro_loss(kwargs),
      argnums=self.argnums,
      has_aux=True,
    )
    # zeros_like keeps the parameter's sharding (Explicit mesh axes) and its
    # varying manual axes, so the scan carry's type never changes.
    init_grads = jax.tree.map(
      lambda p: _sharding.like_vma(
        jnp.zeros_like(p, _normalize.accumulator_dtype(self.accum_dtype, p)), p
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
      acc_grads, state, fetched = carry
      scanned, local, index = xs
      micro = batches.take(scanned, fetched)
      if batches.streamed:  # double buffering: copy the next one meanwhile
        fetched = batches.fetch(batches.next_index(local))
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
      return (acc_grads, new_state, fetched), (loss, weight, aux, sq_norm)

    local = jnp.arange(k, dtype=jnp.int32)
    xs = (batches.scanned(), local, index_offset + local)
    init = (init_grads, init_state, batches.fetch(0))
    if k == 1:
      # One micro-batch: no loop and no accumulator, exactly the full batch.
      carry, ys = body(init, jax.tree.map(lambda x: x[0], xs), first=True)
      ys = jax.tree.map(lambda y: jnp.expand_dims(y, 0), ys)
    else:
      carry, ys = jax.lax.scan(body, init, xs)
    (grads, state, _), (losses, weights, aux, sq_norms) = carry, ys
    if self.value_checks:
      _normalize.check_weights(weights)
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
      _normalize.check_total_weight(sums.weight, sums.grads)
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

  def local(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The whole step on one device: ``sums`` then ``finish``."""
    split = self.plan(args)
    diff_args = tuple(args[i] for i in self.argnums)
    return self.finish(self.sums(args, kwargs, split), diff_args)

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
    shape = getattr(out, "shape", None)
    got = f"a {type(out).__name__}" if shape is None else f"one array of {shape=}"
    raise ValueError(
      f"has_aux=True needs fun to return a pair (value, aux), got {got}."
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
  """``new`` typed as ``old`` (a Python number, say, as a strong int32).

  A weak type counts too: a state fed back into a jitted step with another
  weak type would compile the step again.
  """
  new, old = jnp.asarray(new), jnp.asarray(old)
  if jax.typeof(old).weak_type:
    return new.astype(old.dtype)
  return jax.lax.convert_element_type(new, old.dtype)


def _check_no_nnx_objects(args: tuple[Any, ...]) -> None:
  """An nnx Module or other graph node belongs to ``jaxaccum.nnx``."""
  from flax import nnx  # noqa: PLC0415 (imported only when called)

  is_object = lambda x: isinstance(x, nnx.Pytree)  # noqa: E731
  for n, arg in enumerate(args):
    nodes = [x for x in jax.tree.leaves(arg, is_leaf=is_object) if is_object(x)]
    if nodes:
      raise ValueError(
        f"args[{n}] is (or holds) an nnx object, {type(nodes[0]).__name__}. "
        "jaxaccum.value_and_grad works on pytrees of arrays; for Flax NNX "
        "models use jaxaccum.nnx.value_and_grad(fun, k)(model, batch), which "
        "splits the model, differentiates its nnx.Param variables and writes "
        "its other state back."
      )


def _check_differentiable(tree: PyTree, name: str) -> None:
  """Every leaf to differentiate is an array or a number, named if not."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic, numbers.Number)):
      continue
    raise TypeError(
      f"{name}{jax.tree_util.keystr(path)} is a {type(leaf).__name__} "
      f"({leaf!r:.40}), not an array: every leaf of a differentiated argument "
      "must be an array or a number. Move it out of the parameters, or pass "
      "it as another argument."
    )


def _as_tuple(argnums: Any, name: str) -> tuple[int, ...]:
  nums = (argnums,) if isinstance(argnums, numbers.Integral) else tuple(argnums)
  if not nums or not all(
    isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in nums
  ):
    raise TypeError(f"{name} must be an int or a non-empty tuple of ints.")
  nums = tuple(int(n) for n in nums)
  if min(nums) < 0:
    raise ValueError(f"{name}={argnums} must be non-negative.")
  if len(set(nums)) != len(nums):
    raise ValueError(f"{name}={argnums} repeats an argument.")
  return nums


def _check_remat(remat: Any) -> bool | Callable[..., Any]:
  if isinstance(remat, bool) or (callable(remat) and not isinstance(remat, type)):
    return remat
  raise TypeError(
    "remat must be a bool or a jax.checkpoint_policies policy (a callable), "
    f"got {remat!r}."
  )


def _check_argnum(name: str, n: Any) -> int | None:
  if n is None:
    return None
  return _as_tuple(n, name)[0]


def make(
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
) -> Engine:
  """Validates the static arguments (at definition time) into an ``Engine``."""
  if not callable(fun):
    raise TypeError(f"fun must be callable, got {fun!r}.")
  _split.check_split_arguments(num_micro_batches, micro_batch_size)
  diff = _as_tuple(argnums, "argnums")
  batch = _as_tuple(batch_argnums, "batch_argnums")
  rng_argnum = _check_argnum("rng_argnum", rng_argnum)
  state_argnum = _check_argnum("state_argnum", state_argnum)
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
  _normalize.check_accum_dtype(accum_dtype)
  return Engine(
    fun=fun,
    num_micro_batches=None if num_micro_batches is None else int(num_micro_batches),
    micro_batch_size=None if micro_batch_size is None else int(micro_batch_size),
    argnums=diff,
    batch_argnums=batch,
    has_aux=has_aux,
    normalization=_normalize.get(normalize),
    accum_dtype=jnp.dtype(accum_dtype),
    rng_argnum=rng_argnum,
    state_argnum=state_argnum,
    remat=_check_remat(remat),
    noise_stats=noise_stats,
    value_checks=value_checks,
  )
