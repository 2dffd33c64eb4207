"""``verify_equivalence``: accumulation checked against the full batch.

It runs the accumulated and the full-batch computation side by side and
raises with the largest deviation. (The engine's own checks are in
:mod:`jaxaccum._checks`.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxaccum import _compat, _normalize, _options, _static
from jaxaccum._value_and_grad import value_and_grad

PyTree = Any


class Deviation(NamedTuple):
  """The largest deviation ``verify_equivalence`` found.

  Attributes:
    value: ``max |accumulated - full|`` of the value.
    grads: ``max |accumulated - full|`` over every gradient leaf.
    where: the tree path of the gradient leaf where ``grads`` occurs.
    scale: the full-batch gradient's largest magnitude over every leaf, the
      scale each leaf's tolerance is relative to (``grads / scale`` is the
      relative deviation).
  """

  value: float
  grads: float
  where: str
  scale: float = 0.0


def _full_batch(fun: Callable[..., Any], o: _options.Options) -> Callable[..., Any]:
  """The reference: ``jax.value_and_grad`` on the whole batch at once."""
  argnums = o.argnums[0] if o.tree_grads else o.argnums
  has_aux = o.has_aux
  if o.normalize != "weighted":
    return jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)

  def loss_sum(*args, **kwargs):
    out = fun(*args, **kwargs)
    value, aux = out if has_aux else (out, None)
    loss, weight = value
    return loss, (weight, aux)

  def reference(*args, **kwargs):
    (loss, (weight, aux)), grads = jax.value_and_grad(
      loss_sum, argnums=argnums, has_aux=True
    )(*args, **kwargs)
    safe = jnp.where(weight != 0, weight, 1)
    # Divided as the gradient of loss_sum / weight would be, in the dtypes
    # jax.grad gives (those of the parameters).
    grads = jax.tree.map(
      lambda g: jnp.where(weight != 0, g / safe, 0).astype(_normalize.result_dtype(g)),
      grads,
    )
    value = jnp.where(weight != 0, loss / safe, 0).astype(jnp.result_type(loss))
    return ((value, aux) if has_aux else value), grads

  return reference


def _replicated_batch(
  full: Callable[..., Any], o: _options.Options
) -> Callable[..., Any]:
  """``full`` on the batch replicated over the devices. On Explicit axes a
  batch typed sharded over the data axes makes a model's weight gradient (a
  contraction over the rows) ask for an ``out_sharding`` that an ordinary
  model does not give; the reference is the same numbers either way."""

  def replicated(x):
    spec = _compat.explicit_spec(x)
    if spec is None or all(entry is None for entry in spec):
      return x
    mesh = jax.typeof(x).sharding.mesh
    return jax.sharding.reshard(
      x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    )

  def reference(*args, **kwargs):
    args = tuple(
      jax.tree.map(replicated, a) if n in o.batch_argnums else a
      for n, a in enumerate(args)
    )
    return full(*args, **kwargs)

  return reference


def verify_equivalence(
  fun: Callable[..., Any],
  args: tuple[Any, ...],
  num_micro_batches: int,
  *,
  fun_kwargs: dict[str, Any] | None = None,
  rtol: float | None = None,
  atol: float = 0.0,
  **options: Any,
) -> Deviation:
  """Checks that accumulation over micro-batches equals the full batch.

  Computes ``value_and_grad(fun, num_micro_batches, **options)(*args,
  **fun_kwargs)`` and the full-batch reference (``jax.value_and_grad`` on the
  whole batch, under ``jit``; for ``normalize="weighted"``, the full-batch
  ``loss_sum / weight``), and compares them as ``numpy.testing`` does,
  elementwise ``|accumulated - full| <= atol + rtol * scale``: the value
  with ``scale = |full value|``, and every gradient leaf with one scale, the
  largest magnitude of the whole full-batch gradient. A leaf whose gradient
  is zero up to rounding (an attention key bias, to which softmax is
  invariant) is judged by the gradient it belongs to, not by its own noise.
  A failure says whether the value differs too: then the cause is how the
  loss combines over micro-batches (the ``normalize`` mode, or examples that
  interact), not the leaf it names.

  With ``mesh=`` and ``data_axis=`` the accumulated side runs data-parallel
  and the reference is the full batch on the same arrays; where the batch is
  typed sharded (Explicit axes) the reference takes it replicated, so that
  each device holds the whole batch for the check. With
  ``clip_per_example`` the reference is the same function with one
  micro-batch: every example's clipped gradient from one ``vmap`` over the
  whole batch.

  This holds for losses in which examples do not interact, and checks the
  batch given: a token mean converted without ``normalize="weighted"`` shows
  only where micro-batches hold different numbers of tokens. Per-micro-batch
  keys (``rng_argnum``) and threaded state (``state_argnum``) have no
  full-batch counterpart, so they are refused: verify the deterministic path
  (``fun_kwargs={"train": False}``, dropout off), which checks the same
  gradient code.

  Args:
    fun: the loss, as for :func:`jaxaccum.value_and_grad`.
    args: the positional arguments, with the whole batch.
    num_micro_batches: ``k``.
    fun_kwargs: keyword arguments of ``fun`` for both calls, e.g.
      ``{"train": False}``; Python values stay Python values.
    rtol: the tolerance relative to the scale; by default ``max(1e-5, 8 *
      eps)`` of the leaf's dtype (``1e-5`` for float32).
    atol: an absolute tolerance added to it (default 0).
    **options: further arguments of :func:`jaxaccum.value_and_grad`
      (``argnums``, ``batch_argnums``, ``has_aux``, ``normalize``, ``mesh``,
      ...).

  Returns:
    The largest deviations, as a ``Deviation``.

  Raises:
    AssertionError: if the value or any gradient leaf differs by more than
      the tolerance, naming both deviations, the leaf with the largest one
      and the likely cause.

  >>> import jax.numpy as jnp, jaxaccum
  >>> loss = lambda w, x: jnp.mean(jnp.sin(x * w))
  >>> dev = jaxaccum.verify_equivalence(loss, (jnp.array(0.5), jnp.arange(8.0)), 4)
  >>> dev.grads < 1e-6
  True
  """
  o = _options.create(fun, num_micro_batches, **options)
  if o.rng_argnum is not None:
    raise ValueError(
      f"verify_equivalence compares with one full-batch call; rng_argnum={o.rng_argnum} "
      "has no full-batch counterpart, since each micro-batch draws its own "
      "random numbers. Verify the deterministic path instead: leave rng_argnum "
      'out and pass fun_kwargs={"train": False} (dropout off), or pass a fixed '
      f"key that fun uses alike on any rows, with shared_argnums=({o.rng_argnum},)."
    )
  for name in ("state_argnum", "noise_stats"):
    if getattr(o, name):
      raise ValueError(
        f"verify_equivalence compares with one full-batch call; {name} has "
        "no full-batch counterpart."
      )
  fun_kwargs = dict(fun_kwargs or {})
  o = o.resolve(len(args))
  # Leaves that jax.grad refuses (an Equinox module's) are static on both sides.
  args, fun_kwargs = _static.partition_args(args, o.argnums, fun_kwargs)
  if o.privacy.clip_norm is not None:  # a check, not training: no noise meant
    options = {"clip_without_noise": True, **options}
  accumulated = value_and_grad(fun, num_micro_batches, **options)
  full = _full_batch(_static.combining(fun), o)
  if o.privacy.clip_norm is not None:
    # DP-SGD's full batch: every example's clipped gradient in one vmap.
    whole = {n: v for n, v in options.items() if n != "micro_batch_size"}
    full = value_and_grad(fun, 1, **whole)
  if o.mesh is not None:
    full = _replicated_batch(full, o)
  reference = jax.jit(functools.partial(full, **fun_kwargs))
  (value, grads) = accumulated(*args, **fun_kwargs)
  ref_value, ref_grads = reference(*args)
  if o.has_aux:
    value, ref_value = value[0], ref_value[0]

  report = _Report.create(value, ref_value, grads, ref_grads, rtol=rtol, atol=atol)
  if not report.ok:
    raise AssertionError(report.message(o.normalize))
  return report.deviation()


class _Leaf(NamedTuple):
  """One leaf compared: its largest difference and the difference allowed."""

  name: str
  deviation: float  # max |accumulated - full|, in float64
  allowed: float  # atol + rtol * scale

  @property
  def ok(self) -> bool:
    return self.deviation <= self.allowed  # False for a NaN deviation


def _largest(x: np.ndarray) -> float:
  """The largest finite magnitude in ``x`` (0 for none)."""
  return float(np.max(np.abs(x[np.isfinite(x)]), initial=0.0))


def _leaf(
  name: str, got: Any, want: Any, scale: float, *, rtol: float | None, atol: float
) -> _Leaf:
  """``got`` against ``want`` with ``|got - want| <= atol + rtol * scale``,
  ``rtol`` by default from the less precise of the two dtypes. Equal
  infinities and NaNs on both sides count as equal, as in ``numpy.testing``."""
  if rtol is None:
    eps = max(float(jnp.finfo(jnp.result_type(x)).eps) for x in (got, want))
    rtol = max(1e-5, 8 * eps)
  got64, want64 = np.asarray(got, np.float64), np.asarray(want, np.float64)
  same = (got64 == want64) | (np.isnan(got64) & np.isnan(want64))
  diff = np.where(same, 0.0, np.abs(got64 - want64))
  return _Leaf(name, float(np.max(diff, initial=0.0)), atol + rtol * scale)


class _Report(NamedTuple):
  """The value and every gradient leaf, compared; the gradient's leaves
  against one scale, the whole full-batch gradient's largest magnitude, so
  that a leaf whose gradient is zero up to rounding (an attention key bias)
  is judged by the gradient it belongs to, not by its own noise."""

  value: _Leaf
  grads: list[_Leaf]
  scale: float  # max |full-batch gradient| over every leaf
  got: float  # the accumulated value
  want: float  # the full-batch value

  @classmethod
  def create(cls, value, ref_value, grads, ref_grads, *, rtol, atol) -> _Report:
    named = [
      ("grads" + jax.tree_util.keystr(path), leaf, ref_leaf)
      for (path, leaf), ref_leaf in zip(
        jax.tree_util.tree_leaves_with_path(grads),
        jax.tree.leaves(ref_grads),
        strict=False,
      )
    ]
    scale = max((_largest(np.asarray(w, np.float64)) for _, _, w in named), default=0.0)
    want = float(np.asarray(ref_value, np.float64))
    return cls(
      value=_leaf("value", value, ref_value, abs(want), rtol=rtol, atol=atol),
      grads=[_leaf(n, g, w, scale, rtol=rtol, atol=atol) for n, g, w in named],
      scale=scale,
      got=float(np.asarray(value, np.float64)),
      want=want,
    )

  @property
  def ok(self) -> bool:
    return self.value.ok and all(leaf.ok for leaf in self.grads)

  def worst(self) -> _Leaf:
    return max(self.grads, key=lambda leaf: leaf.deviation, default=_Leaf("", 0.0, 0.0))

  def deviation(self) -> Deviation:
    worst = self.worst()
    return Deviation(self.value.deviation, worst.deviation, worst.name, self.scale)

  def message(self, normalize: str) -> str:
    """Both comparisons, then the likely cause."""
    worst, failing = self.worst(), sum(not leaf.ok for leaf in self.grads)
    value = (
      f"value agrees ({self.got:.6g})"
      if self.value.ok
      else f"value differs by {self.value.deviation:.3e} ({self.got:.6g} "
      f"accumulated, {self.want:.6g} full batch; allowed {self.value.allowed:.3e})"
    )
    grads = (
      f"grads differ by up to {worst.deviation:.3e} at {worst.name}, "
      f"{worst.deviation / self.scale if self.scale else np.inf:.3e} of the "
      f"gradient's largest magnitude {self.scale:.3e} (allowed "
      f"{worst.allowed:.3e}); {failing} of {len(self.grads)} leaves differ"
    )
    return (
      f"Accumulated and full-batch results differ, with normalize={normalize!r}:"
      f"\n  {value};\n  {grads}.\n{self.cause(normalize)}"
    )

  def cause(self, normalize: str) -> str:
    """What the comparison says about why, from the value."""
    if self.value.ok:
      return (
        "The value agrees, so the loss combines as normalize says; the gradient "
        "does not: fun's gradient depends on which rows run together where its "
        "value does not (a custom_vjp or stop_gradient over batch statistics)."
      )
    ratio = self.want / self.got if self.got else np.inf
    times = round(ratio) if np.isfinite(ratio) else 0
    if normalize == "mean" and times >= 2 and abs(ratio - times) <= 1e-4 * times:
      return (
        f"The full batch's value is {times} times the accumulated one: fun "
        'returns a sum over its rows; pass normalize="sum".'
      )
    inverse = 1 / ratio if ratio else np.inf
    times = round(inverse) if np.isfinite(inverse) else 0
    if normalize == "sum" and times >= 2 and abs(inverse - times) <= 1e-4 * times:
      return (
        f"The accumulated value is {times} times the full batch's: fun returns "
        'a mean over its rows; pass normalize="mean".'
      )
    combined = {"mean": "mean", "sum": "sum", "weighted": "Σ loss_sum / Σ weight"}
    return (
      "The value differs too, so the cause is how fun's values combine, not one "
      f"leaf: fun on the whole batch is not the {combined.get(normalize, normalize)} "
      "of fun on its micro-batches. "
      + (
        "A mean over a mask or a token count (padded sequences) does this: "
        'return (loss_sum, weight) and pass normalize="weighted". Otherwise '
        if normalize != "weighted"
        else "loss_sum is not a sum over rows (a mean, a max), or the weight "
        "does not count what loss_sum sums. Or "
      )
      + "the examples interact (batch statistics, a loss over pairs of rows), "
      "which no split reproduces."
    )
