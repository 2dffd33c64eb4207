"""``value_and_grad`` and ``grad``: the public face of the scan engine.

These validate their options once (:mod:`jaxaccum._options`) and run the
engine (:mod:`jaxaccum._engine`) on the path that
:func:`jaxaccum._parallel.route.route` chooses: on one device, or data
parallel (``mesh=``, or plain ``jit`` on an Explicit mesh). Called outside ``jit``, the step
is compiled once per configuration and kept (:mod:`jaxaccum._calls`), and the
arguments are validated once per configuration, so an eager call costs what
an eager ``jax.value_and_grad`` call costs; under an outer transformation it
is traced inline.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxaccum import _calls, _compat, _engine, _options, _privacy, _split, _static
from jaxaccum._parallel import layout as _layout
from jaxaccum._parallel import route as _route

PyTree = Any


def value_and_grad(
  fun: Callable[..., Any],
  num_micro_batches: int | None = None,
  *,
  micro_batch_size: int | None = None,
  argnums: int | Sequence[int] = 0,
  batch_argnums: int | Sequence[int] = 1,
  has_aux: bool = False,
  aux: Any = "auto",
  combine: Any = None,
  normalize: str = "mean",
  accum_dtype: Any = jnp.float32,
  rng_argnum: int | None = None,
  state_argnum: int | None = None,
  shared_argnums: int | Sequence[int] = (),
  remat: bool | Callable[..., Any] = False,
  mesh: jax.sharding.Mesh | None = None,
  data_axis: str | tuple[str, ...] | None = None,
  param_specs: PyTree | None = None,
  fsdp_gather: str = "per_micro_batch",
  gather_dtype: Any = None,
  view: str = "device",
  noise_stats: bool = False,
  value_checks: bool = False,
  clip_per_example: float | None = None,
  public_argnums: int | Sequence[int] = (),
  clip_record: bool = False,
  clip_method: str = "vmap",
  clip_without_noise: bool = False,
  parallel: Any = None,
  privacy: Any = None,
) -> Callable[..., Any]:
  """Like ``jax.value_and_grad``, accumulated over micro-batches in one scan.

  The arguments in ``batch_argnums`` are split along their leading axis into
  ``k`` micro-batches: on one device micro-batch ``i`` holds rows
  ``i*m .. (i+1)*m - 1``; for a batch sharded over devices, the ``i``-th
  slice of every device's rows, so that no row moves
  (:func:`jaxaccum.merge_micro_batches`). A ``lax.scan`` runs ``fun`` forward
  and backward on each and adds the gradients into a float32 accumulator, so
  only one micro-batch's activations are alive at a time.

  **The full batch's value and gradient, by default.** A loss built from
  sums over its rows (a mean, a token-weighted or masked mean, a sum, a
  ratio of sums, a mean plus a penalty on the weights) is read from its
  jaxpr and made exact: each micro-batch's backward pass gets the full
  batch's cotangents, and the rest of the loss is applied once, to the
  totals (``docs/guide.md``, "Exact by default"), on one device, under
  plain ``jit`` on a sharded batch and under ``mesh=``. Another loss (a
  batch statistic used per row) is the mean of the micro-batches' losses.

  **Several devices.** Under plain ``jit`` on an Explicit mesh, the axes the
  batch's rows are sharded over are the data axes: parameters replicated
  over them enter the loop ``reduced`` and accumulate ``unreduced``, and
  the gradients and the loss are reduced once, after the loop, each into
  its own sharding (a use JAX has no rule for reduces only that leaf each
  micro-batch). ``parallel=jaxaccum.DataParallel(mesh, data_axis, ...)``
  (or its shorthands ``mesh=``, ``data_axis=``, ``param_specs=``,
  ``fsdp_gather=``, ``gather_dtype=``, ``view=``) runs each device's rows
  as their own micro-batches; see :class:`jaxaccum.DataParallel`.

  **Differential privacy.** ``privacy=jaxaccum.ClipPerExample(C, ...)`` (or
  its shorthands ``clip_per_example=``, ``clip_method=``,
  ``public_argnums=``, ``clip_record=``, ``clip_without_noise=``) calls
  ``fun`` on one example and sums the examples' gradients clipped to norm
  ``C``; see :class:`jaxaccum.ClipPerExample` and ``docs/privacy.md``.

  Args:
    fun: the loss, ``fun(*args, **kwargs)``. Its value is a scalar, or the
      pair ``(loss_sum, weight)`` with ``normalize="weighted"``; with
      ``has_aux`` it returns ``(value, aux)``.
    num_micro_batches: ``k``, the number of micro-batches. Give this or
      ``micro_batch_size`` (``m``, the rows per micro-batch).
    argnums: the argument(s) to differentiate, as in ``jax.value_and_grad``.
      One holding leaves ``jax.grad`` refuses (an Equinox module) is
      partitioned as ``eqx.filter_value_and_grad`` does: its floating-point
      arrays are differentiated, every other leaf gets a None gradient.
    batch_argnums: the argument(s) to split, pytrees whose leaves share one
      leading batch axis. Other arguments reach every micro-batch whole; a
      PRNG key or a batch-sized array among them gets a
      ``SharedArgumentWarning`` unless it is in ``shared_argnums``.
    has_aux: ``fun`` returns ``(value, aux)``; the aux comes back as the
      full batch's would (``aux=``).
    aux: how each aux leaf combines: ``"auto"`` (a leaf with the
      micro-batch's rows is concatenated in batch order, any other averaged
      like the loss), ``"concatenate"``, ``"mean"``, ``"sum"``, ``"stack"``,
      or a tree prefix of these.
    combine: the rule of a differentiated leaf that is not a gradient,
      never normalized: ``"sum"``, ``"max"``, ``"min"``, ``"last"``, or a
      tree prefix of these (None: a gradient). Flax's FP8 metadata takes
      ``"max"``, a JAX extended dtype its own addition (example below).
    normalize: ``"mean"`` (the default: the full batch's value and gradient
      as above), ``"sum"`` (the micro-batches' values and gradients summed)
      or ``"weighted"`` (``fun`` returns ``(loss_sum, weight)``; the result
      is ``Σ loss_sum / Σ weight``, zero where the total weight is zero).
    accum_dtype: the dtype of the sums (a wider gradient keeps its own);
      the grads come back in the parameters' dtype.
    rng_argnum: a PRNG key argument; micro-batch ``i`` gets
      ``jax.random.fold_in(key, i)`` (the key itself with one micro-batch in
      total: at ``k = 1`` jaxaccum is your own step).
    state_argnum: mutable state (BatchNorm statistics): ``fun`` has
      ``has_aux=True`` and returns ``(value, (aux, new_state))``; micro-batch
      ``i + 1`` sees micro-batch ``i``'s state, and the aux comes back as
      ``(aux, final_state)``. A running average's momentum ``μ`` then acts as
      ``μ^k`` per step: :func:`jaxaccum.micro_batch_momentum` keeps it.
    shared_argnums: arguments meant to reach every micro-batch whole.
    remat: ``jax.checkpoint`` around each micro-batch (``True`` or a policy),
      for differentiating through the accumulated gradient.
    noise_stats: also return the gradient noise scale's measurements,
      ``(output, noise)``, for :func:`jaxaccum.noise_scale_update`.
    value_checks: emit value-level checks of the weights, raised under
      ``chex.chexify``.
    parallel: a :class:`jaxaccum.DataParallel` (its shorthands above).
    privacy: a :class:`jaxaccum.ClipPerExample` (its shorthands above).
    mesh, data_axis, param_specs, fsdp_gather, gather_dtype, view: shorthands
      for ``parallel``'s fields.
    clip_per_example, clip_method, public_argnums, clip_record,
      clip_without_noise: shorthands for ``privacy``'s fields.

  Returns:
    A function of the same arguments as ``fun`` that returns
    ``(value, grads)``, or ``((value, aux), grads)`` with ``has_aux``.

  Raises:
    ValueError: at definition time for bad options, and at trace time for a
      batch that does not split, naming the sizes. A shorthand given with
      its group is a ``TypeError`` naming both.

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

  A leaf whose "gradient" is its new value (a running max, as an FP8 amax):

  >>> peak = jax.custom_vjp(lambda x, p: x)
  >>> peak.defvjp(lambda x, p: (x, jnp.maximum(p, jnp.max(x))), lambda p, g: (g, p))
  >>> tracked = lambda q, b: loss(q["w"], (peak(b[0], q["peak"]), b[1]))
  >>> q = {"w": w, "peak": jnp.float32(0.0)}
  >>> float(jaxaccum.grad(tracked, 4, combine={"w": None, "peak": "max"})(q, (x, y))["peak"])
  1.5
  """
  # Every parameter above is an option: validated once, in one place.
  options = _options.create(**locals())
  warn_if_without_noise(options)
  step = Step(fun, options)

  @functools.wraps(fun)
  def accumulated(*args, **kwargs):
    return recorded(step(*args, **kwargs), options).arranged(options)

  return accumulated


def warn_if_without_noise(options: _options.Options, stacklevel: int = 4) -> None:
  """A :class:`jaxaccum.ClipWithoutNoiseWarning` for a function built with
  ``clip_per_example`` whose gradient cannot reach :func:`jaxaccum.dp_noise`
  (no ``clip_record=True``), unless ``clip_without_noise=True`` says that is
  meant. ``make_train_step`` builds its step without this: it sees its
  optimizer, and warns itself."""
  if (
    options.privacy.clip_norm is None
    or options.privacy.record
    or options.privacy.without_noise
  ):
    return
  _privacy.warn_without_noise(
    f"clip_per_example={options.privacy.clip_norm} without clip_record=True: "
    "the clipped gradient this function returns cannot reach jaxaccum.dp_noise, "
    "which takes it only with its jaxaccum.ClipRecord (clip_record=True, or "
    "make_train_step, which passes the record itself).",
    stacklevel=stacklevel,
  )


def recorded(result: _engine.Result, options: _options.Options) -> _engine.Result:
  """The result with its gradient in a :class:`jaxaccum.ClipRecord` when
  ``clip_record=True``."""
  if not options.privacy.record:
    return result
  assert options.privacy.clip_norm is not None and result.sums is not None
  record = _privacy.record_of(
    result.grads[0],
    result.total_weight,
    options.privacy.clip_norm,
    options.normalize,
    result.sums[0],
    ticket=True,  # the record leaves jaxaccum: each update takes it once
  )
  return result._replace(grads=(record,), sums=None)


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
  options = _options.create(fun, num_micro_batches, **kwargs)
  warn_if_without_noise(options)
  step = Step(fun, options)

  @functools.wraps(fun)
  def accumulated_grad(*args, **call_kwargs):
    return grad_only(
      recorded(step(*args, **call_kwargs), options).arranged(options), options
    )

  return accumulated_grad


def grad_only(output: Any, options: _options.Options) -> Any:
  """``value_and_grad``'s output as ``grad`` gives it: ``grads``, or ``(grads,
  aux)`` with ``has_aux``; ``(that, noise)`` with ``noise_stats``."""
  (value, grads), noise = output if options.noise_stats else (output, None)
  result = (grads, value[1]) if options.has_aux else grads
  return (result, noise) if options.noise_stats else result


class Step:
  """``fun``'s whole accumulated step, on one device or data-parallel.

  ``step(*args, **kwargs)`` returns the :class:`~jaxaccum._engine.Result`.
  A differentiated argument with leaves that ``jax.grad`` refuses (an
  Equinox module) is partitioned first (:mod:`jaxaccum._static`): its
  gradient holds None where its leaves are static. Called eagerly it validates the arguments once per configuration and runs
  one compiled program per configuration; under an outer transformation it
  is traced inline.
  """

  def __init__(self, fun: Callable[..., Any], options: _options.Options):
    self.fun = _static.combining(fun)
    self.options = options
    self._engines: dict[int, _engine.Engine] = {}
    self._validated: set[Any] = set()
    self._compiled = _calls.Compiled(
      self.compiled_result,
      static_positions=self.static_positions,
      checked=options.value_checks,
    )

  def engine(self, num_args: int) -> _engine.Engine:
    """The engine, its positions resolved for ``num_args`` arguments."""
    engine = self._engines.get(num_args)
    if engine is None:
      engine = _engine.Engine(self.fun, self.options.resolve(num_args))
      self._engines[num_args] = engine
    return engine

  def static_positions(self, num_args: int) -> list[int]:
    """Positions whose Python values ``fun`` gets as they are (not traced)."""
    used = self.engine(num_args).options.array_argnums
    return [n for n in range(num_args) if n not in used]

  def layout(self, args: tuple[Any, ...]) -> Any:
    """What the compiled program depends on besides static values: the
    parameters' shardings on the data-parallel path."""
    if self.options.mesh is None:
      return None
    return _layout.layout(self.engine(len(args)).options, args)

  def masked_engine(self, num_args: int) -> _engine.Engine:
    """The engine for a call with ``example_mask=``: the mask goes after the
    ``num_args`` arguments, as one more batch argument that ``fun`` never
    sees."""
    engine = self._engines.get(-num_args)
    if engine is None:
      o = self.engine(num_args).options
      engine = _engine.Engine(
        self.fun,
        o.replace(batch_argnums=(*o.batch_argnums, num_args), example_mask=num_args),
      )
      self._engines[-num_args] = engine
    return engine

  def traced(self, layout: Any, /, *args: Any, **kwargs: Any) -> _engine.Result:
    if self.options.privacy.clip_norm is not None and _privacy.MASK_KEYWORD in kwargs:
      kwargs = dict(kwargs)
      mask = _privacy.check_mask(kwargs.pop(_privacy.MASK_KEYWORD))
      engine = self.masked_engine(len(args))
      args = (*args, mask)
    else:
      engine = self.engine(len(args))
    _privacy.check_public_args(engine.options, args, kwargs)
    return _route.route(engine, layout, args, kwargs)

  def compiled_result(self, layout: Any, /, *args: Any, **kwargs: Any) -> Any:
    """:meth:`traced`, as a compiled call returns it: the clipped sum in the
    accumulator's dtype only where a :class:`jaxaccum.ClipRecord` carries it
    out (``clip_record=True``), not as one more output buffer."""
    result = self.traced(layout, *args, **kwargs)
    return result if self.options.privacy.record else result._replace(sums=None)

  def micro_batches(self, args: tuple[Any, ...]) -> int:
    """``k``: the micro-batches of these arguments (per device with
    ``mesh=``, as the step runs them)."""
    engine = self.engine(len(args))
    o = engine.options
    if o.mesh is None or o.view == "global":
      return engine.plan(args).num_micro_batches
    return engine.plan(args, devices=o.data_devices).num_micro_batches

  def validate(self, args: tuple[Any, ...]) -> None:
    """The checks that must precede ``jit`` (a string in the batch would
    otherwise fail inside it, unexplained), once per configuration."""
    leaves, treedef = jax.tree.flatten(args)
    key = (treedef, tuple(type(x) for x in leaves))
    if key in self._validated:
      return
    engine = self.engine(len(args))
    engine.check_args(args)
    o = engine.options
    _split.leading_batch_size({o.names(i): args[i] for i in o.batch_argnums})
    self._validated.add(key)

  def partitioned(
    self, args: tuple[Any, ...], kwargs: dict[str, Any]
  ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments with each differentiated one partitioned into
    what is differentiated and what is static (:mod:`jaxaccum._static`)."""
    self.check_differentiable(args)
    argnums = self.engine(len(args)).options.argnums
    return _static.partition_args(args, argnums, kwargs)

  def check_differentiable(self, args: tuple[Any, ...]) -> None:
    """Refuses differentiated arguments with nothing to differentiate in them
    (:func:`jaxaccum._static.check_differentiable`): swapped arguments."""
    o = self.engine(len(args)).options
    _static.check_differentiable(args, o.argnums, o.batch_argnums, o.names)

  def __call__(self, *args: Any, **kwargs: Any) -> _engine.Result:
    args, kwargs = self.partitioned(args, kwargs)
    if any(map(_compat.is_tracer, jax.tree.leaves((args, kwargs)))):
      return self.traced(self.layout(args), *args, **kwargs)
    self.validate(args)
    with _route.mesh_context(self.options.mesh):
      return self._compiled(self.layout(args), *args, **kwargs)

  def lower(self, *args: Any, **kwargs: Any) -> Any:
    """``jax.jit(...).lower`` of the program these arguments call."""
    args, kwargs = self.partitioned(args, kwargs)
    with _route.mesh_context(self.options.mesh):
      return self._compiled.lower(self.layout(args), *args, **kwargs)
