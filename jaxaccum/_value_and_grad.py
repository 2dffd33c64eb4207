"""``value_and_grad`` and ``grad``: the public face of the scan engine.

These validate their options once (:mod:`jaxaccum._options`) and run the
engine (:mod:`jaxaccum._engine`) on one device, or its data-parallel form
(:mod:`jaxaccum._parallel.data_parallel`) with ``mesh=``. Called outside ``jit``, the step
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
from jaxaccum._parallel import data_parallel as _parallel
from jaxaccum._parallel import unreduced as _unreduced

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
) -> Callable[..., Any]:
  """Like ``jax.value_and_grad``, accumulated over micro-batches in one scan.

  The arguments in ``batch_argnums`` are split along their leading axis into
  ``k`` micro-batches. On one device micro-batch ``i`` holds rows
  ``i*m .. (i+1)*m - 1``; for a batch sharded over devices, the ``i``-th
  slice of every device's rows, so that no row moves (see
  :func:`jaxaccum.merge_micro_batches`). A ``lax.scan`` runs ``fun`` forward
  and backward on each and adds the gradients into a float32 accumulator, so
  only one micro-batch's activations are alive at a time. The sums are
  normalized once.

  Under plain ``jit`` on an Explicit mesh (``jax.make_mesh``'s default), a
  batch whose rows are sharded over some mesh axes is data parallel without
  ``mesh=``: those are the data axes. A parameter replicated over them
  (replicated, or tensor parallel over other axes) enters the loop typed
  ``reduced`` over them and is accumulated ``unreduced`` in float32, as is
  the loss's sum over rows: all are reduced once, together, after the loop,
  each into its own sharding. ``fun`` is traced on the parameters' own types
  and evaluated with each use of a parameter rewritten into one JAX types (a
  bias or a norm's scale broadcast into the activations' rows, an embedding
  table gathered by them; ``jaxaccum/_parallel/reduced.py``). A use JAX has no rule
  for (a convolution kernel) takes the parameter as it is, its gradient
  there reduced each micro-batch, as plain ``jit`` does; a loss used other
  than linearly (its log, a penalty added to it) is reduced where it is
  used. With ``noise_stats`` or ``clip_per_example`` every leaf is reduced
  each micro-batch. ``fun`` runs on your mesh with its own axis types, and
  its constraints work as under ``jax.value_and_grad``. A batch replicated
  over every axis, or on Auto axes, leaves every reduction to the
  partitioner.

  Args:
    fun: the loss, ``fun(*args, **kwargs)``. Its value is a scalar, or the pair
      ``(loss_sum, weight)`` with ``normalize="weighted"``; with ``has_aux``
      it returns ``(value, aux)``.
    num_micro_batches: ``k``, the number of micro-batches. Give this or
      ``micro_batch_size``.
    micro_batch_size: ``m``, the rows per micro-batch.
    argnums: the argument(s) to differentiate, as in ``jax.value_and_grad``
      (negative numbers count from the end). One that holds a leaf
      ``jax.grad`` refuses (a function, a bool, an int or an integer array,
      as an Equinox module does) is partitioned as
      ``eqx.filter_value_and_grad`` does: its floating-point arrays are
      differentiated, every other leaf (Python floats too) is static and its
      gradient is None. Pytrees of arrays and floats are differentiated as
      ``jax.grad`` does.
    batch_argnums: the argument(s) to split: pytrees whose leaves share one
      leading batch axis. Other arguments reach every micro-batch unchanged;
      one that looks like it should not (a PRNG key, or an array with the
      batch's leading size) gets a ``SharedArgumentWarning`` at trace time,
      unless it is in ``shared_argnums``.
    has_aux: ``fun`` returns ``(value, aux)``. The aux comes back as the full
      batch's would (``aux=``).
    aux: how each aux leaf combines over the micro-batches: ``"auto"`` (the
      default), ``"concatenate"``, ``"mean"``, ``"sum"`` or ``"stack"``, or a
      tree prefix of the aux with these as leaves (``{"logits":
      "concatenate", "acc": "mean"}``). ``"auto"`` concatenates a leaf whose
      leading axis has the micro-batch's row count back into the batch's
      ``B`` rows, in batch order (logits, per-example losses), and takes the
      mean of every other leaf (scalars such as an accuracy), weighted like
      the loss: by the micro-batch weights under ``normalize="weighted"``,
      equally otherwise. A leaf whose leading axis has the row count by
      coincidence is concatenated too; name its type then. The mean of an
      integer leaf is float32, and a zero total weight gives zeros.
      ``"stack"`` keeps a leading axis of length ``k`` (jaxaccum 0.1.0's
      aux). With ``state_argnum``, only the aux part is combined.
    normalize: ``"mean"`` (``fun`` returns a micro-batch mean; the result is
      the mean over micro-batches), ``"sum"`` (the results are summed) or
      ``"weighted"`` (``fun`` returns ``(loss_sum, weight)``; the result is
      ``sum(loss_sum) / sum(weight)`` over the whole batch: zero when the
      total weight is zero, not finite when it is not finite).
    accum_dtype: the dtype of the sums; a gradient wider than it (float64) is
      summed in its own dtype. The grads come back in the parameters' dtype.
    rng_argnum: a PRNG key argument; micro-batch ``i`` receives
      ``jax.random.fold_in(key, i)``. With one micro-batch in total the key
      reaches ``fun`` unchanged: at ``k = 1`` jaxaccum is your own step.
    state_argnum: a mutable state argument (e.g. BatchNorm statistics). ``fun``
      must use ``has_aux=True`` and return ``(value, (aux, new_state))``;
      micro-batch ``i + 1`` sees the state micro-batch ``i`` produced, and the
      aux comes back as ``(aux, final_state)``. Each state leaf keeps its
      dtype (a Python number takes it); another dtype is an error. A running
      average in the state (BatchNorm's statistics) so moves ``k`` times per
      step: momentum ``μ`` decays it by ``μ^k`` per step, where the full
      batch decays it by ``μ`` (0.9 at ``k = 4`` acts as 0.66). Build the
      layer with ``jaxaccum.micro_batch_momentum(μ, k)`` (``μ^(1/k)``) to
      keep the full batch's per-step momentum.
    shared_argnums: arguments meant to reach every micro-batch whole, such as
      a key that every micro-batch should share, or a table that happens to
      have the batch's leading size: jaxaccum does not warn about them.
    noise_stats: also measure the gradient noise scale (McCandlish et al.
      2018) from the micro-batch gradients, at the cost of one squared norm
      per micro-batch. The function then returns ``(output, noise)``, with
      ``output`` as without it and ``noise`` a :class:`GradientNoise`
      (``|G_small|²``, ``|G_big|²``, ``B_small``, ``B_big``); feed it to
      :func:`noise_scale_update`. Needs two micro-batches in total.
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
      ``micro_batch_size`` rows) and accumulates its own gradient; replicated
      parameters are reduced ONCE, after the loop. ``fun`` sees one
      device's micro-batch, and the mesh as under plain ``jit``: annotations
      on the other mesh axes work as there (see ``view`` for the other
      choice). The micro-batch index folded into the key is global (``d * k
      + i`` on device ``d``). Each device threads its own copy of the state;
      after the loop floating-point state is averaged over devices, integers
      take their maximum, and a typed PRNG key (``jax.random.key``; a raw
      ``uint32`` key counts as integers) that ``fun`` advanced comes from
      device 0.
    data_axis: the mesh axis that the batch is sharded along, or a tuple of
      them (HSDP: ``("replica", "fsdp")``).
    param_specs: ``PartitionSpec``s of the differentiated arguments (a tree
      prefix per entry of ``argnums``). Only needed inside ``jit`` with an
      Auto mesh, where shardings are not visible at trace time; outside
      ``jit`` and with Explicit meshes they are read from the arrays.
      Gradients come back sharded like the parameters.
    fsdp_gather: how parameters sharded along ``data_axis`` (FSDP) are
      handled; replicated parameters are always reduced once, after the
      loop.

      - ``"per_micro_batch"`` (default, for memory): each micro-batch's
        forward gathers the weights where it uses them, as the full-batch
        step does, and the gradient is taken of the devices' summed loss, so
        that the partitioner reduce-scatters each layer's gradient inside
        the backward pass, as plain ``jit`` does, into a float32 accumulator
        sharded like the parameter (``P / D`` per device). HSDP's replica
        axes are reduced once, after the loop.
      - ``"cast_once"`` (for fewer bytes at about the same memory): each
        FSDP leaf is cast to ``gather_dtype`` and gathered once per step,
        before the loop; its gradients are reduce-scattered per micro-batch
        as above. Exact when ``fun``'s first use of each FSDP leaf is that
        cast (a bfloat16 model with float32 master weights): otherwise
        ``fun`` computes with rounded weights.
      - ``"once"`` (no collective inside the loop): the weights are gathered
        before the loop, the full gradient accumulated per device, and
        reduce-scattered once after it; it holds a full-size float32
        accumulator per device.

      :func:`jaxaccum.plan_micro_batches` picks the mode that moves the
      fewest bytes within a memory budget.
    gather_dtype: the dtype FSDP leaves are gathered in with
      ``fsdp_gather="cast_once"`` (which needs it), e.g. ``jnp.bfloat16``.
    view: what ``fun`` sees under ``mesh=``. ``"device"`` (default): one
      device's micro-batch, a key per device, a state per device; naming a
      data axis in a sharding annotation is an error (the data axes are
      jaxaccum's). ``"global"``: the global micro-batch, as under plain
      ``jit`` (micro-batch ``i`` is the ``i``-th slice of every device's
      rows, so no row moves), a key per micro-batch (``fold_in(key, i)``),
      one threaded state; annotations may name the data axes (MaxText's
      activation rules work as written). On Explicit data axes that the
      batch is sharded over this is plain ``jit``'s step described above
      (``mesh=`` only names the data axes); elsewhere the partitioner
      places every collective: replicated parameters are all-reduced once
      per micro-batch, and ``fsdp_gather="once"`` is not available.
    clip_per_example: differentially private training (DP-SGD): ``fun`` is
      called on ONE example (each batch leaf without its leading axis; a
      ``vmap`` runs it over the micro-batch) and returns that example's
      scalar loss (``(loss_sum, weight)`` with ``"weighted"``). Each
      example's gradient, over all differentiated leaves together, is scaled
      to L2 norm at most ``clip_per_example`` and the clipped gradients are
      summed in float32. The count of examples replaces the count of
      micro-batches: ``"mean"`` divides by the number of real examples,
      ``"weighted"`` by their total weight, ``"sum"`` by nothing. The
      function then also takes ``example_mask=``, a vector with one entry per
      row: a row whose entry is 0 (padding) adds exactly zero to the sum, the
      value and the count. A real row whose gradient is not finite adds zero
      to the sum (one example cannot poison a step); it still counts, and its
      loss shows in the value.
      Row ``j`` of micro-batch ``i`` gets the key ``fold_in(key_i, j)``. Add
      the noise with :func:`jaxaccum.dp_noise`. Every other argument that
      holds arrays is a ``ValueError`` unless listed in ``public_argnums``,
      and so is an array passed by keyword.
    public_argnums: with ``clip_per_example``, the arguments besides the
      differentiated ones, the batch and the key that every example's loss
      may read, declared to depend on no example: a learning-rate schedule's
      value, a frozen embedding table, a teacher model trained on public
      data. jaxaccum cannot check this; the guarantee holds only if it is
      true. An argument computed from the batch (its mean) voids it.
    clip_record: with ``clip_per_example``, return the gradient as a
      :class:`jaxaccum.ClipRecord` (the gradient, what it was divided by, the
      examples, the clip norm and ``normalize``), which
      :func:`jaxaccum.accumulate` takes in place of the gradient and needs
      when its inner optimizer holds :func:`jaxaccum.dp_noise`.
    clip_method: how ``clip_per_example`` computes the clipped sum:
      ``"vmap"`` (the default) takes each example's gradient (one ``vmap``
      of ``grad``); ``"ghost"`` gives the same sum without them, from each
      parameter's uses in the traced program and a second, per-example
      weighted backward pass (ghost clipping). A leaf used other than by a
      matrix product, a row gather (embedding) or an elementwise operation
      gets its own per-example gradient, named in a
      ``jaxaccum.GhostFallbackWarning`` at trace time. Under ``mesh=``
      ghost keeps ``fsdp_gather``'s mode for FSDP leaves (each device takes
      its examples' norms, and the weighted backward pass is
      reduce-scattered into an accumulator sharded like the leaf, as without
      privacy); ``"vmap"`` gathers them once, each device holding whole
      per-example gradients. See ``docs/privacy.md``.

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
  # Every parameter above is an option: validated once, in one place.
  options = _options.create(**locals())
  step = Step(fun, options)

  @functools.wraps(fun)
  def accumulated(*args, **kwargs):
    return recorded(step(*args, **kwargs), options).arranged(options)

  return accumulated


def recorded(result: _engine.Result, options: _options.Options) -> _engine.Result:
  """The result with its gradient in a :class:`jaxaccum.ClipRecord` when
  ``clip_record=True``."""
  if not options.clip_record:
    return result
  assert options.clip_per_example is not None
  record = _privacy.record_of(
    result.grads[0], result.total_weight, options.clip_per_example, options.normalize
  )
  return result._replace(grads=(record,))


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
    self.parallel = None if options.mesh is None else _parallel.DataParallel(options)
    self._engines: dict[int, _engine.Engine] = {}
    self._validated: set[Any] = set()
    self._compiled = _calls.Compiled(
      self.traced, static_positions=self.static_positions, checked=options.value_checks
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
    if self.parallel is None:
      return None
    return self.parallel.layout(self.engine(len(args)).options, args)

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
    if self.options.clip_per_example is not None and _privacy.MASK_KEYWORD in kwargs:
      kwargs = dict(kwargs)
      mask = _privacy.check_mask(kwargs.pop(_privacy.MASK_KEYWORD))
      engine = self.masked_engine(len(args))
      args = (*args, mask)
    else:
      engine = self.engine(len(args))
    _privacy.check_public_args(engine.options, args, kwargs)
    if self.parallel is not None:
      return self.parallel(engine, layout, args, kwargs)
    return _unreduced.local(engine, args, kwargs)

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
    with _parallel.mesh_context(self.options.mesh):
      return self._compiled(self.layout(args), *args, **kwargs)

  def lower(self, *args: Any, **kwargs: Any) -> Any:
    """``jax.jit(...).lower`` of the program these arguments call."""
    args, kwargs = self.partitioned(args, kwargs)
    with _parallel.mesh_context(self.options.mesh):
      return self._compiled.lower(self.layout(args), *args, **kwargs)
