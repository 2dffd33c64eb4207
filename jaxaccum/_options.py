"""One validated options object for every accumulated ``value_and_grad``.

The public functions (``value_and_grad``, ``grad``, ``jaxaccum.nnx``,
``make_train_step``, ``verify_equivalence``, ``plan_micro_batches``) all take
the same keyword arguments. They are validated once, here, into an
:class:`Options`, and everything below reads that object, never the raw
keywords: the defaults live in one place (the dataclass fields), and so does
every rule about them.

Argument positions are the user's. ``argnums`` may count from the end, as in
JAX; :meth:`Options.resolve` turns them into positions once the number of
arguments is known. An adapter that calls the engine with arguments of its own
in front (``jaxaccum.nnx`` passes the parameter states first) shifts the
positions with :meth:`Options.shifted`, and :class:`ArgNames` keeps naming
them as the user numbered them.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxaccum import _accumulator, _aux, _normalize

PyTree = Any


@dataclasses.dataclass(frozen=True)
class ArgNames:
  """Names argument positions in errors the way the user numbered them.

  Attributes:
    offset: engine position = the user's position + ``offset``.
    hidden: engine positions the user never passed, with their names (the
      parameter states that ``jaxaccum.nnx`` puts in front).
  """

  offset: int = 0
  hidden: tuple[tuple[int, str], ...] = ()

  def __call__(self, n: int) -> str:
    """``args[i]`` for the user's argument ``i`` at engine position ``n``.

    >>> ArgNames(offset=2, hidden=((0, "the model's parameters"),))(3)
    'args[1]'
    """
    for position, name in self.hidden:
      if position == n:
        return name
    return f"args[{n - self.offset}]"


@dataclasses.dataclass(frozen=True, eq=False)
class Options:
  """The options of one accumulated ``value_and_grad``, validated.

  Attributes mirror the keyword arguments of :func:`jaxaccum.value_and_grad`,
  except:

  - ``argnums``, ``batch_argnums``: tuples; negative entries count from the
    end until :meth:`resolve`;
  - ``tree_grads``: ``argnums`` was a single integer, so the grads come back
    as one tree rather than a tuple (as in ``jax.value_and_grad``);
  - ``shared_argnums``, ``public_argnums``: tuples;
  - ``normalization``: the mode as a value (:mod:`jaxaccum._normalize`);
  - ``parallel``: the ``jaxaccum.DataParallel`` group (its shorthands,
    ``mesh=`` and the rest, routed into it), and ``privacy``, the
    ``jaxaccum.ClipPerExample`` group (``clip_per_example=`` and the rest),
    read through the properties below; ``public_argnums`` is the privacy
    group's, kept here with the other positions;
  - ``names``: how errors name argument positions;
  - ``combine``: ``combine=``, how each differentiated leaf's micro-batch
    terms combine (:func:`jaxaccum._accumulator.rules`; None: by default);
  - ``example_mask``: with ``clip_per_example``, the engine position of the
    row mask that the call's ``example_mask=`` keyword became (one of
    ``batch_argnums``; ``fun`` never sees it), or None.
  """

  num_micro_batches: int | None = None
  micro_batch_size: int | None = None
  argnums: tuple[int, ...] = (0,)
  batch_argnums: tuple[int, ...] = (1,)
  has_aux: bool = False
  aux: Any = "auto"
  normalize: str = "mean"
  accum_dtype: Any = jnp.float32
  rng_argnum: int | None = None
  state_argnum: int | None = None
  shared_argnums: tuple[int, ...] = ()
  remat: bool | Callable[..., Any] = False
  parallel: Any = None
  noise_stats: bool = False
  value_checks: bool = False
  public_argnums: tuple[int, ...] = ()
  privacy: Any = None
  tree_grads: bool = True
  names: ArgNames = ArgNames()
  example_mask: int | None = None
  combine: Any = None

  @property
  def normalization(self) -> _normalize.Normalization:
    return _normalize.get(self.normalize)

  @property
  def array_argnums(self) -> tuple[int, ...]:
    """The positions whose leaves are arrays (differentiated, split, key and
    state arguments); Python values elsewhere stay Python values."""
    extra = tuple(n for n in (self.rng_argnum, self.state_argnum) if n is not None)
    return self.argnums + self.batch_argnums + extra

  # -- the data-parallel group, as the core reads it --------------------------

  @property
  def mesh(self) -> jax.sharding.Mesh | None:
    return None if self.parallel is None else self.parallel.mesh

  @property
  def data_axes(self) -> tuple[str, ...] | None:
    return None if self.parallel is None else self.parallel.data_axes

  @property
  def param_specs(self) -> PyTree | None:
    return None if self.parallel is None else self.parallel.param_specs

  @property
  def fsdp_gather(self) -> str:
    return "per_micro_batch" if self.parallel is None else self.parallel.fsdp_gather

  @property
  def gather_dtype(self) -> Any:
    return None if self.parallel is None else self.parallel.gather_dtype

  @property
  def view(self) -> str:
    return "device" if self.parallel is None else self.parallel.view

  # -- the privacy group, as the core reads it ---------------------------------

  @property
  def rule(self) -> Any:
    """The gradient rule the engine is given (``jaxaccum._engine.GradientRule``:
    the privacy group where it clips), or None for ``jax.value_and_grad``."""
    active = self.privacy is not None and self.privacy.active
    return self.privacy if active else None

  @property
  def data_devices(self) -> int:
    """Devices the batch is split over: the product of the data axes' sizes
    (1 without a mesh)."""
    return 1 if self.parallel is None else self.parallel.data_devices

  def replace(self, **changes: Any) -> Options:
    return dataclasses.replace(self, **changes)

  # -- call time --------------------------------------------------------------

  def resolve(self, num_args: int) -> Options:
    """The options with every position counted from the front, checked
    against the ``num_args`` positional arguments of the call."""

    def one(n: int) -> int:
      return n + num_args if n < 0 else n

    resolved = self.replace(
      argnums=tuple(map(one, self.argnums)),
      batch_argnums=tuple(map(one, self.batch_argnums)),
      rng_argnum=None if self.rng_argnum is None else one(self.rng_argnum),
      state_argnum=None if self.state_argnum is None else one(self.state_argnum),
      shared_argnums=tuple(map(one, self.shared_argnums)),
      public_argnums=tuple(map(one, self.public_argnums)),
    )
    used = resolved.array_argnums + resolved.shared_argnums + resolved.public_argnums
    if max(used) >= num_args or min(used) < 0:
      user = self.shifted(-self.names.offset)
      given = num_args - self.names.offset
      message = (
        f"The function was called with {given} positional arguments, but "
        f"argnums={user.argnums}, batch_argnums={user.batch_argnums}, "
        f"rng_argnum={user.rng_argnum} and state_argnum={user.state_argnum} "
        "refer to more."
      )
      if not 0 <= min(resolved.batch_argnums) <= max(resolved.batch_argnums) < num_args:
        message += (
          f" batch_argnums={user.batch_argnums} points past them, and jaxaccum "
          "splits only the batch it is given as an argument. If fun closes "
          "over its batch (lambda params: loss(params, batch)), take the batch "
          "as an argument instead, fun(params, batch), and pass it in the call, "
          f"at batch_argnums={user.batch_argnums}; if it is among the {given} "
          "arguments, point batch_argnums at it."
        )
      raise ValueError(message)
    _check_positions(resolved)
    return resolved

  def shifted(self, offset: int, **changes: Any) -> Options:
    """For an adapter that puts ``offset`` arguments of its own in front:
    every position moves by ``offset``, and errors keep naming the user's."""
    bump = lambda n: None if n is None else n + offset  # noqa: E731
    return self.replace(
      argnums=tuple(n + offset for n in self.argnums),
      batch_argnums=tuple(n + offset for n in self.batch_argnums),
      rng_argnum=bump(self.rng_argnum),
      state_argnum=bump(self.state_argnum),
      shared_argnums=tuple(n + offset for n in self.shared_argnums),
      public_argnums=tuple(n + offset for n in self.public_argnums),
      names=ArgNames(self.names.offset + offset, changes.pop("hidden", ())),
      **changes,
    )


#: The option groups, by the keyword of ``value_and_grad`` that takes them:
#: each feature registers its group (:func:`register`), and :func:`create`
#: routes the group's flat shorthands into it. The core imports no feature:
#: it reads a group through the properties of :class:`Options` and calls
#: its ``_check``.
GROUPS: dict[str, Any] = {}


def register(group: Any) -> Any:
  """Registers an option group: a frozen dataclass that validates itself,
  with class attributes ``keyword`` (its keyword in ``value_and_grad``) and
  ``shorthands`` (flat keyword -> field), and a method ``_check(options)``
  for its constraints on the other options."""
  GROUPS[group.keyword] = group
  return group


#: The core keyword arguments of jaxaccum.value_and_grad.
CORE_KEYWORDS = frozenset(
  {f.name for f in dataclasses.fields(Options)}
  - {"tree_grads", "names", "example_mask", "parallel", "privacy", "public_argnums"}
)


def keywords() -> frozenset[str]:
  """Every keyword of :func:`jaxaccum.value_and_grad`: the core's, each
  group's, and each group's shorthands."""
  flat = {name for g in GROUPS.values() for name in g.shorthands}
  return CORE_KEYWORDS | set(GROUPS) | flat


def flat(kwargs: dict[str, Any]) -> dict[str, Any]:
  """``kwargs`` with each group given by its keyword spelled as its
  shorthands instead (the fields that differ from the group's defaults),
  for a caller that varies one of them (the memory planner's search)."""
  out = dict(kwargs)
  for keyword, group in GROUPS.items():
    given = out.pop(keyword, None)
    if given is None:
      continue
    default = group()
    for name, field in group.shorthands.items():
      value = getattr(given, field)
      if not _same(value, getattr(default, field)):
        out[name] = value
  return out


def _same(value: Any, default: Any) -> bool:
  """Whether a shorthand's value is its field's default (spelled out, as
  the signature's defaults are)."""
  if value is default:
    return True
  try:
    return bool(value == default)
  except Exception:  # an array, or a tree of them: not a default
    return False


def _groups(kwargs: dict[str, Any]) -> dict[str, Any]:
  """Each registered group, from its keyword or from its shorthands in
  ``kwargs`` (which loses them), else its defaults; a group and its
  shorthands together are a ``TypeError`` naming both."""
  groups = {}
  for keyword, group in GROUPS.items():
    names = group.shorthands
    default = group()
    flat = {names[n]: kwargs.pop(n) for n in list(kwargs) if n in names}
    flat = {f: v for f, v in flat.items() if not _same(v, getattr(default, f))}
    given = kwargs.pop(keyword, None)
    if given is not None and flat:
      shown = ", ".join(f"{n}=" for n in names if names[n] in flat)
      raise TypeError(
        f"{shown} and {keyword}= were both given: {shown} "
        f"{'is a shorthand' if len(flat) == 1 else 'are shorthands'} for a "
        f"field of {keyword}=jaxaccum.{group.__name__}(...). Pass the group "
        "alone, with that field in it."
      )
    if given is not None and not isinstance(given, group):
      raise TypeError(f"{keyword}= takes a jaxaccum.{group.__name__}, got {given!r}.")
    groups[keyword] = given if given is not None else group(**flat)
  return groups


def create(fun: Any = None, num_micro_batches: Any = None, **kwargs: Any) -> Options:
  """Validates the keyword arguments of :func:`jaxaccum.value_and_grad`.

  Unknown keywords are a ``TypeError`` naming them; bad values a
  ``ValueError`` or ``TypeError`` naming the argument, at definition time.
  Defaults are the :class:`Options` fields'.
  """
  _check_known(kwargs)
  kwargs = dict(kwargs)
  groups = _groups(kwargs)
  if fun is not None and not callable(fun):
    raise TypeError(f"fun must be callable, got {fun!r}.")
  defaults = Options()
  get = lambda name: kwargs.get(name, getattr(defaults, name))  # noqa: E731
  micro_batch_size = get("micro_batch_size")
  check_split_sizes(num_micro_batches, micro_batch_size)
  argnums = kwargs.get("argnums", 0)  # as in jax.value_and_grad: one tree
  diff = _as_tuple(argnums, "argnums")
  batch = _as_tuple(kwargs.get("batch_argnums", 1), "batch_argnums")
  rng_argnum = _one_position("rng_argnum", get("rng_argnum"))
  state_argnum = _one_position("state_argnum", get("state_argnum"))
  has_aux, aux = bool(get("has_aux")), get("aux")
  _check_aux(has_aux, aux, state_argnum)
  combine = get("combine")
  _accumulator.check_combine(combine)
  shared = _optional(kwargs, "shared_argnums")
  normalize = get("normalize")
  _normalize.get(normalize)
  accum_dtype = get("accum_dtype")
  _normalize.check_accum_dtype(accum_dtype)
  core = {
    k: v for g in groups.values() if hasattr(g, "_core") for k, v in g._core().items()
  }
  options = Options(
    num_micro_batches=None if num_micro_batches is None else int(num_micro_batches),
    micro_batch_size=None if micro_batch_size is None else int(micro_batch_size),
    argnums=diff,
    batch_argnums=batch,
    has_aux=has_aux,
    aux=aux,
    normalize=normalize,
    accum_dtype=jnp.dtype(accum_dtype),
    rng_argnum=rng_argnum,
    state_argnum=state_argnum,
    shared_argnums=shared,
    remat=_check_remat(get("remat")),
    **groups,
    noise_stats=bool(get("noise_stats")),
    value_checks=bool(get("value_checks")),
    combine=combine,
    **core,
    tree_grads=isinstance(argnums, numbers.Integral),
  )
  for group in groups.values():
    group._check(options)
  # Positions that are all counted from the front can be checked now.
  listed = options.array_argnums + options.shared_argnums + options.public_argnums
  if all(n >= 0 for n in listed):
    _check_positions(options)
  return options


def _check_aux(has_aux: bool, aux: Any, state_argnum: int | None) -> None:
  """Raises for an ``aux=`` or ``state_argnum`` that needs ``has_aux=True``."""
  _aux.check_spec(aux)
  if not has_aux and not (isinstance(aux, str) and aux == "auto"):
    raise ValueError(f"aux={aux!r} combines fun's aux; it needs has_aux=True.")
  if state_argnum is not None and not has_aux:
    raise ValueError(
      "state_argnum needs has_aux=True and fun returning (value, (aux, new_state))."
    )


def _check_known(kwargs: dict[str, Any]) -> None:
  """Raises for a keyword that is no option of ``value_and_grad``."""
  known = keywords()
  unknown = sorted(set(kwargs) - known)
  if unknown:
    raise TypeError(
      f"Unknown option(s) {unknown}; the options are those of "
      f"jaxaccum.value_and_grad: {sorted(known | {'num_micro_batches'})}."
    )


def check_split_sizes(num_micro_batches: Any, micro_batch_size: Any) -> None:
  """Raises unless exactly one positive integer split size is given."""
  if (num_micro_batches is None) == (micro_batch_size is None):
    raise ValueError(
      "Give exactly one of num_micro_batches and micro_batch_size, got "
      f"{num_micro_batches=} and {micro_batch_size=}."
    )
  for name, size in (
    ("num_micro_batches", num_micro_batches),
    ("micro_batch_size", micro_batch_size),
  ):
    if size is None:
      continue
    if isinstance(size, bool) or not isinstance(size, numbers.Integral):
      raise TypeError(
        f"{name} must be an integer (a Python or numpy int), got {size!r} "
        f"of type {type(size).__name__}."
      )
    if size <= 0:
      raise ValueError(f"{name} must be positive, got {name}={size}.")


def _check_positions(options: Options) -> None:
  """The argument numbers do not overlap (all counted from the front)."""
  diff, batch = options.argnums, options.batch_argnums
  rng_argnum, state_argnum = options.rng_argnum, options.state_argnum
  if set(diff) & set(batch):
    raise ValueError(
      f"argnums={_show(diff)} and batch_argnums={_show(batch)} overlap: the "
      "differentiated arguments are not split."
    )
  for name, n in (("rng_argnum", rng_argnum), ("state_argnum", state_argnum)):
    if n is not None and n in diff + batch:
      raise ValueError(f"{name}={n} is also in argnums or batch_argnums.")
  if rng_argnum is not None and rng_argnum == state_argnum:
    raise ValueError(f"{rng_argnum=} and {state_argnum=} are the same argument.")
  for n in options.public_argnums:
    if n in options.array_argnums:
      raise ValueError(
        f"public_argnums names argument {n}, which is also in argnums, "
        "batch_argnums, rng_argnum or state_argnum: public_argnums are the "
        "other arguments that every example's loss reads, declared to depend "
        "on no example."
      )
  for n in options.shared_argnums:
    if n in options.array_argnums:
      raise ValueError(
        f"shared_argnums names argument {n}, which is also in argnums, "
        "batch_argnums, rng_argnum or state_argnum: shared_argnums are the "
        "arguments that reach every micro-batch unchanged."
      )


def _show(nums: tuple[int, ...]) -> Any:
  return nums[0] if len(nums) == 1 else nums


def _as_tuple(argnums: Any, name: str) -> tuple[int, ...]:
  nums = (argnums,) if isinstance(argnums, numbers.Integral) else tuple(argnums)
  if not nums or not all(
    isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in nums
  ):
    raise TypeError(f"{name} must be an int or a non-empty tuple of ints.")
  nums = tuple(int(n) for n in nums)
  if len(set(nums)) != len(nums):
    raise ValueError(f"{name}={argnums} repeats an argument.")
  return nums


def _optional(kwargs: dict[str, Any], name: str) -> tuple[int, ...]:
  """An optional list of positions: ``()`` unless given."""
  return positions(kwargs.get(name, ()), name)


def positions(nums: Any, name: str) -> tuple[int, ...]:
  """Argument positions, as a tuple: ``()`` for none (an option group's
  positions too, which the core resolves and shifts with its own).

  >>> positions(2, "public_argnums"), positions((), "public_argnums")
  ((2,), ())
  """
  return _as_tuple(nums, name) if nums != () else ()


def _one_position(name: str, n: Any) -> int | None:
  if n is None:
    return None
  return _as_tuple(n, name)[0]


def _check_remat(remat: Any) -> bool | Callable[..., Any]:
  if isinstance(remat, bool) or (callable(remat) and not isinstance(remat, type)):
    return remat
  raise TypeError(
    "remat must be a bool or a jax.checkpoint_policies policy (a callable), "
    f"got {remat!r}."
  )
