"""Every pair of options is exact or refused (issue 45, item 8).

The cases are generated from :data:`OPTIONS`, a table of option values whose
first value is the default: every pair of values of two options (the others
at their defaults), every triple of the options that decide which rows,
keys, weights and state each call of ``fun`` sees and on which path
(:data:`SPLIT_OPTIONS`), and a seeded sample of other triples. Each case
either equals
the reference DESIGN.md documents for it, or raises a ``ValueError`` or
``TypeError`` at trace time whose message names the conflict
(:data:`REFUSALS`). A combination that is accepted but differs from its
reference, or refused where DESIGN says it works, is a bug of the library:
it is neither dropped nor loosened but marked ``xfail(strict=True)`` with
what was measured (:data:`BUGS`), so that the fix shows as an XPASS.

Each test id starts with what the case reaches:

- ``exact.full_batch``: the value and the gradients equal
  ``jax.value_and_grad`` of the whole batch's loss (its mean, its sum, or its
  token mean ``sum(loss * w) / sum(w)``), and a row-wise aux the whole
  batch's;
- ``exact.micro_batches``: part of the result has no full-batch counterpart,
  and DESIGN says it is the micro-batches' run in order: with a key
  (micro-batch ``i`` gets ``fold_in(key, i)``), threaded state, ``aux="mean"``,
  ``"sum"`` or ``"stack"``, or the noise statistics. The reference is
  ``jax.value_and_grad`` of each micro-batch in a Python loop, the rows, key
  and state of each taken from the documented split of the case's path
  (:func:`layout`): contiguous rows on one device; the ``i``-th slice of
  every device's rows under plain ``jit`` and ``view="global"``; each
  device's own micro-batches under ``view="device"``, keyed ``d * k + i``
  (NNX: the device's index folded into the stream's key), each device
  threading its own state, averaged after the loop (integers: the maximum);
- ``exact.per_example`` (``clip_per_example``): one ``vmap(grad)`` per
  micro-batch, row ``j`` of micro-batch ``i`` keyed
  ``fold_in(fold_in(key, i), j)``, each example's gradient clipped to norm
  ``C`` over all leaves at once, summed, divided by the examples, their
  weight or nothing;
- ``refused.<rule>``: the error and the words its message must hold;
- ``bug.<name>``: a strict xfail, its reason the measurement.

No reference calls jaxaccum.

Tolerances. float32: each leaf within ``2 * TERMS * u`` of the magnitude of
the terms summed into it (u = 2**-24; ``TERMS`` counts the rows, the
features, the hidden units and a few roundings; the magnitude is the
largest element of the sum of the terms' absolute values), as in
tests/test_value_and_grad.py. A normalization off by a factor, a missing
micro-batch, another key or a stale state misses it by orders of magnitude.
bfloat16 parameters: the reference is the same computation in float32 from
the same bfloat16 values (the data stay float32, so the model computes in
float32 by promotion). What differs is that ``jax.grad`` rounds each
micro-batch's (or example's) gradient to bfloat16 before jaxaccum adds it,
and the sum is rounded to bfloat16 once more (with ``accum_dtype=bfloat16``
it is also summed in bfloat16; float32 gradients are summed in float32
whatever ``accum_dtype`` says, which the float32 cases check): a few
roundings of relative size 2**-9, so the tolerance is 2**-6 of the terms'
magnitude, still an order of magnitude below a factor of k, a dropped
micro-batch or another key. The same holds for
``fsdp_gather="cast_once"``, whose FSDP leaves reach ``fun`` rounded to
bfloat16: the reference rounds them the same way (docs/guide.md: exact only
for a model that casts them itself), and its value, at float32 tolerance,
tells rounded weights from unrounded ones (1.335031 against 1.333663).

Cost: each case compiles one jaxaccum program; the references are compiled
once per shape and shared (``functools.cache``). The default run holds a
cover of every option value and of everything a case can reach
(:func:`default_cases`); the rest is marked ``slow``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
import pathlib
import random
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, reshard
from jax.sharding import PartitionSpec as P

import jaxaccum

try:  # what JAX raises for an operation its sharding types refuse; not exported
  from jax._src.core import ShardingTypeError
except ImportError:  # another JAX: any error
  ShardingTypeError = Exception  # type: ignore[misc,assignment]

B, F, H = 16, 3, 8  # rows, features, hidden units
N = 4  # the devices of the meshes' "data" axis
C = 0.5  # the clip norm: some examples' gradients are clipped, some not
KEEP = 0.75  # dropout's keep probability
NNX_SEED = 11  # the NNX model's dropout stream
U = float(jnp.finfo(jnp.float32).eps) / 2
TERMS = B + F + H + 8
F32_TOLERANCE = 2 * TERMS * U
BF16_TOLERANCE = 2.0**-6

# -------------------------------------------------------- the option table

#: Every option's values, its default first.
OPTIONS: dict[str, tuple[Any, ...]] = {
  "entry": ("value_and_grad", "make_train_step", "accumulate", "nnx", "equinox"),
  "normalize": ("mean", "sum", "weighted"),
  "dtype": ("float32", "bfloat16"),  # the parameters'
  "accum_dtype": ("float32", "bfloat16"),
  "aux": (None, "auto", "concatenate", "mean", "sum", "stack"),  # None: no aux
  "rng": (False, True),  # rng_argnum (NNX: a dropout stream in the model)
  "state": (False, True),  # state_argnum (NNX: nnx.BatchStat variables)
  "remat": (False, True),
  "k": (2, 1),
  # none; plain jit on an Explicit mesh; mesh= with view="device" or
  # "global", on an Explicit mesh and on an Auto one
  "parallel": ("none", "jit", "device", "global", "device_auto", "global_auto"),
  # fsdp_gather, with w1 and w2 sharded over "data" on a mesh ("cast_once":
  # gather_dtype=bfloat16)
  "fsdp": ("none", "per_micro_batch", "once", "cast_once"),
  "clip": ("none", "vmap", "ghost"),  # clip_per_example=C and clip_method
  "noise_stats": (False, True),  # accumulate(): its own noise_stats
  "value_checks": (False, True),
  # the function called as it is, or under jax.jit (eqx.filter_jit, nnx.jit);
  # make_train_step's step is jitted either way
  "call": ("eager", "jit"),
}
DEFAULTS = {name: values[0] for name, values in OPTIONS.items()}
MESH_PATHS = ("device", "global", "device_auto", "global_auto")


@dataclasses.dataclass(frozen=True)
class Case:
  """One combination of option values; the others at their defaults."""

  entry: str = DEFAULTS["entry"]
  normalize: str = DEFAULTS["normalize"]
  dtype: str = DEFAULTS["dtype"]
  accum_dtype: str = DEFAULTS["accum_dtype"]
  aux: str | None = DEFAULTS["aux"]
  rng: bool = DEFAULTS["rng"]
  state: bool = DEFAULTS["state"]
  remat: bool = DEFAULTS["remat"]
  k: int = DEFAULTS["k"]
  parallel: str = DEFAULTS["parallel"]
  fsdp: str = DEFAULTS["fsdp"]
  clip: str = DEFAULTS["clip"]
  noise_stats: bool = DEFAULTS["noise_stats"]
  value_checks: bool = DEFAULTS["value_checks"]
  call: str = DEFAULTS["call"]

  @property
  def changed(self) -> dict[str, Any]:
    return {n: v for n, v in dataclasses.asdict(self).items() if v != DEFAULTS[n]}

  @property
  def name(self) -> str:
    return ",".join(f"{n}={v}" for n, v in self.changed.items()) or "defaults"

  @property
  def mesh(self) -> jax.sharding.Mesh | None:
    return None if self.parallel == "none" else mesh_of(self.parallel.endswith("auto"))

  @property
  def view(self) -> str | None:
    """``mesh=``'s view, None off the ``mesh=`` path."""
    return self.parallel.split("_")[0] if self.parallel in MESH_PATHS else None

  @property
  def has_aux(self) -> bool:
    return self.aux is not None


def pairs() -> list[Case]:
  """Every pair of values of two options, the others at their defaults."""
  out = []
  for (a, xs), (b, ys) in itertools.combinations(OPTIONS.items(), 2):
    out += [Case(**{a: x, b: y}) for x in xs for y in ys]
  return out


#: The options that decide which rows, keys, weights and state each call of
#: ``fun`` sees, and on which path: every triple of their non-default values
#: is a case too.
SPLIT_OPTIONS = (
  "entry",
  "normalize",
  "rng",
  "state",
  "parallel",
  "fsdp",
  "clip",
  "noise_stats",
)


def split_triples() -> list[Case]:
  """Every triple of non-default values of three :data:`SPLIT_OPTIONS`."""
  out = []
  for names in itertools.combinations(SPLIT_OPTIONS, 3):
    for values in itertools.product(*(OPTIONS[n][1:] for n in names)):
      out.append(Case(**dict(zip(names, values, strict=True))))
  return out


def triples(count: int, seed: int = 45) -> list[Case]:
  """``count`` triples of non-default values of three options, drawn with
  ``seed``."""
  rng = random.Random(seed)
  names = list(OPTIONS)
  out = []
  for _ in range(count):
    chosen = rng.sample(names, 3)
    out.append(Case(**{n: rng.choice(OPTIONS[n][1:]) for n in chosen}))
  return out


@functools.cache
def mesh_of(auto: bool) -> jax.sharding.Mesh:
  axis_type = AxisType.Auto if auto else AxisType.Explicit
  devices = jax.devices()[:N]
  return jax.make_mesh((N,), ("data",), axis_types=(axis_type,), devices=devices)


# ---------------------------------------------------- the problem and models


def problem(dtype: str):
  """Parameters (in ``dtype``), the batch ``(x, y, w)``, a key and a state."""
  k = jax.random.split(jax.random.key(0), 3)
  params = {
    "w1": jax.random.normal(k[0], (F, H)),
    "b1": 0.1 * jax.random.normal(k[1], (H,)),
    "w2": jax.random.normal(k[2], (H,)) / 2,
  }
  params = {n: p.astype(dtype) for n, p in params.items()}
  x = jax.random.normal(jax.random.key(1), (B, F))
  y = jnp.sin(3 * x[:, 0]) + x[:, 1]
  # Token weights that differ between rows and micro-batches, some zero.
  rows = np.arange(B)
  w = jnp.asarray((rows % 3 != 0) * (1.0 + rows % 4 // 2), jnp.float32)
  state = {"mean": jnp.linspace(-0.5, 0.5, H), "count": jnp.array(0, jnp.int32)}
  return params, (x, y, w), jax.random.key(7), state


def gathered(w: jax.Array) -> jax.Array:
  """A weight sharded over an Explicit axis, gathered where it is used, as
  under ``jax.value_and_grad`` on the mesh; elsewhere as it is."""
  if any(s is not None for s in jax.typeof(w).sharding.spec):
    return reshard(w, P())
  return w


def forward(weights, x, *, key=None, state=None):
  """The MLP on rows ``x`` (or one example): predictions and new state.
  ``weights`` is ``(w1, b1, w2, activation)``; a key adds dropout, a state
  a BatchNorm-like running mean that the predictions read."""
  w1, b1, w2, act = weights
  z = x @ gathered(w1)
  h = act(z + jnp.broadcast_to(gathered(b1), z.shape))
  if key is not None:
    keep = jax.random.bernoulli(key, KEEP, h.shape)
    h = jnp.where(keep, h / KEEP, 0.0)
  pred = h @ gathered(w2)
  if state is None:
    return pred, None
  pred = pred + 0.5 * (h @ state["mean"])
  new_state = {
    "mean": 0.9 * state["mean"] + 0.1 * jnp.mean(h, axis=0),
    "count": state["count"] + 1,
  }
  return pred, new_state


def value_of(normalize: str, pred, y, w):
  """The loss as ``fun`` returns it: a mean, a sum, ``(loss_sum, weight)``,
  or (``"wsum"``, what ``accumulate`` takes with ``weight=``) the loss sum."""
  err = (pred - y) ** 2
  if normalize == "mean":
    return jnp.mean(err)
  if normalize == "sum":
    return jnp.sum(err)
  if normalize == "wsum":
    return jnp.sum(err * w)
  return jnp.sum(err * w), jnp.sum(w)


def aux_of(aux: str | None, pred, y):
  """The aux: the predictions (rows), and but for ``"concatenate"``, which
  needs rows in every leaf, the mean absolute error (a scalar)."""
  if aux is None:
    return None
  if aux == "concatenate":
    return {"pred": pred}
  return {"pred": pred, "err": jnp.mean(jnp.abs(pred - y))}


def loss_of(weights_of: Callable[[Any], tuple], normalize, aux, rng, state):
  """``fun(params, batch, [key], [state])``, as ``value_and_grad`` takes it
  with ``rng_argnum=2`` and ``state_argnum`` after it."""

  def fun(p, batch, *extra):
    x, y, w = batch
    key = extra[0] if rng else None
    st = extra[int(rng)] if state else None
    pred, new_state = forward(weights_of(p), x, key=key, state=st)
    out = value_of(normalize, pred, y, w)
    if state:
      return out, (aux_of(aux, pred, y), new_state)
    return (out, aux_of(aux, pred, y)) if aux is not None else out

  return fun


def dict_weights(p):
  return p["w1"], p["b1"], p["w2"], jnp.tanh


class EqxMLP(eqx.Module):
  """The MLP as an Equinox module: its function leaf makes jaxaccum
  partition it as ``eqx.filter_value_and_grad`` does (a None gradient)."""

  w1: jax.Array
  b1: jax.Array
  w2: jax.Array
  act: Callable[..., Any] = jnp.tanh


def eqx_weights(m):
  return m.w1, m.b1, m.w2, m.act


class NnxMLP(nnx.Module):
  """The MLP in NNX, with a dropout stream and ``nnx.BatchStat`` variables
  when asked for: ``jaxaccum.nnx`` threads them through the micro-batches."""

  def __init__(self, params, state=None, rng=False):
    self.w1, self.b1, self.w2 = (nnx.Param(params[n]) for n in ("w1", "b1", "w2"))
    self.rngs = nnx.Rngs(dropout=NNX_SEED) if rng else None
    if state is not None:
      self.mean = nnx.BatchStat(state["mean"])
      self.count = nnx.BatchStat(state["count"])


def nnx_loss(normalize, aux, rng, state):
  """``fun(model, batch)``: the key drawn from the model's stream, the state
  read from and written to its ``BatchStat`` variables."""

  def fun(model, batch):
    x, y, w = batch
    key = model.rngs.dropout() if rng else None
    st = {"mean": model.mean[...], "count": model.count[...]} if state else None
    weights = (model.w1[...], model.b1[...], model.w2[...], jnp.tanh)
    pred, new_state = forward(weights, x, key=key, state=st)
    if state:
      model.mean[...] = new_state["mean"]
      model.count[...] = new_state["count"]
    out = value_of(normalize, pred, y, w)
    return (out, aux_of(aux, pred, y)) if aux is not None else out

  return fun


# ------------------------------------------------------------ running a case


class Out(NamedTuple):
  """A case's result, or its reference, as host arrays: the value and the
  aux (a tuple over the calls for ``accumulate``), the gradients as a dict,
  the final state, the noise statistics and the NNX stream's draws."""

  value: Any
  grads: dict[str, Any]
  aux: Any = None
  state: Any = None
  noise: Any = None
  draws: int | None = None


FSDP_SPECS = {"w1": P(None, "data"), "b1": P(), "w2": P("data")}


def options_of(case: Case, *, normalize: str | None = None) -> dict[str, Any]:
  """jaxaccum's keyword options for ``case``."""
  o: dict[str, Any] = {"normalize": normalize or case.normalize}
  if case.accum_dtype != "float32":
    o["accum_dtype"] = jnp.dtype(case.accum_dtype)
  if case.has_aux or (case.state and case.entry != "nnx"):
    o["has_aux"] = True
  if case.aux not in (None, "auto"):
    o["aux"] = case.aux
  if case.rng and case.entry != "nnx":
    o["rng_argnum"] = 2
  if case.state and case.entry != "nnx":
    o["state_argnum"] = 2 + case.rng
  if case.remat:
    o["remat"] = True
  if case.view is not None:
    o.update(mesh=case.mesh, data_axis="data")
    if case.view == "global":
      o["view"] = "global"
  if case.fsdp != "none":
    o["fsdp_gather"] = case.fsdp
  if case.fsdp == "cast_once":
    o["gather_dtype"] = jnp.bfloat16
  if case.fsdp != "none" and case.parallel.endswith("auto"):
    # Under jit an Auto mesh hides the shardings: docs/guide.md says to
    # pass them (outside jit they are read from the arrays all the same).
    o["param_specs"] = {
      "nnx": nnx.State(dict(FSDP_SPECS)),
      "equinox": EqxMLP(**FSDP_SPECS),
    }.get(case.entry, FSDP_SPECS)
  if case.clip != "none":
    o["clip_per_example"] = C
    if case.clip == "ghost":
      o["clip_method"] = "ghost"
  if case.noise_stats and case.entry != "accumulate":
    o["noise_stats"] = True
  if case.value_checks:
    o["value_checks"] = True
  return o


def placed(case: Case, tree, spec):
  if case.mesh is None:
    return tree
  return jax.device_put(tree, NamedSharding(case.mesh, spec))


def placed_params(case: Case, params):
  if case.fsdp == "none":
    return placed(case, params, P())
  return {n: placed(case, p, FSDP_SPECS[n]) for n, p in params.items()}


def capture() -> optax.GradientTransformation:
  """An optimizer that keeps the gradient it gets as its state and changes
  nothing."""

  def init(params):
    return jax.tree.map(jnp.zeros_like, params)

  def update(updates, state, params=None):
    del state, params
    return jax.tree.map(jnp.zeros_like, updates), updates

  return optax.GradientTransformation(init, update)


def optimizer(case: Case) -> optax.GradientTransformation:
  """``capture()``, after DP-SGD's noise with ``sigma = 0`` when clipping:
  then it gets the clipped sum divided as the step divides it. A weighted
  step's noise is divided by a public expected weight (dp_noise never
  divides by the private one): here the batch's own total weight, so that
  the reference's division by the total weight is the same number."""
  if case.clip == "none":
    return capture()
  expected = None
  if case.normalize == "weighted":
    _, data, _, _ = problem(case.dtype)
    expected = float(np.sum(host(data)[2]))
  noise = jaxaccum.dp_noise(
    0.0, C, jax.random.key(3), normalize="fixed", expected_weight=expected
  )
  return optax.chain(noise, capture())


def captured(case: Case, opt_state):
  return opt_state[-1] if case.clip != "none" else opt_state


def jitted(case: Case, f: Callable[..., Any]) -> Callable[..., Any]:
  """``f`` under the case's ``jit``: always on the plain-jit path."""
  if case.call != "jit" and case.parallel != "jit":
    return f
  if case.entry == "equinox":  # a module with a function among its leaves
    return eqx.filter_jit(f)
  return nnx.jit(f) if case.entry == "nnx" else jax.jit(f)


def host(tree):
  return jax.tree.map(lambda a: np.asarray(jax.device_get(a)), tree)


def grads_dict(grads) -> dict[str, Any]:
  """The gradients of ``w1``, ``b1`` and ``w2`` from a dict, an Equinox
  module (whose function leaf must get None) or an ``nnx.State``."""
  names = ("w1", "b1", "w2")
  if isinstance(grads, EqxMLP):
    assert grads.act is None, grads.act
    return {n: getattr(grads, n) for n in names}
  if isinstance(grads, nnx.State):
    return {n: grads[n][...] for n in names}
  return dict(grads)


def outcome(case: Case, first, grads, state=None, draws=None) -> Out:
  """An :class:`Out` from what an entry point returned first (the value,
  with the aux, the state and the noise as the options add them)."""
  noise = None
  if case.noise_stats and case.entry != "accumulate":
    first, noise = first
    noise = tuple(float(n) for n in noise)
  aux = None
  if case.has_aux or (case.state and case.entry != "nnx"):
    first, aux = first
    if case.state and case.entry != "nnx":
      aux, state = aux
  return Out(host(first), host(grads_dict(grads)), host(aux), host(state), noise, draws)


def value_and_grads(case: Case, result):
  """``value_and_grad``'s result as ``(first, grads)``, the noise statistics
  (``((value, grads), noise)``) moved into ``first`` as ``make_train_step``
  has them."""
  if not case.noise_stats:
    return result
  (first, grads), noise = result
  return (first, noise), grads


def run_value_and_grad(case: Case, params, batch, key, state) -> Out:
  weights_of = eqx_weights if case.entry == "equinox" else dict_weights
  fun = loss_of(weights_of, case.normalize, case.aux, case.rng, case.state)
  f = jitted(case, jaxaccum.value_and_grad(fun, case.k, **options_of(case)))
  model = EqxMLP(**params) if case.entry == "equinox" else params
  result = f(model, batch, *(key,) * case.rng, *(state,) * case.state)
  return outcome(case, *value_and_grads(case, result))


def run_train_step(case: Case, params, batch, key, state) -> Out:
  fun = loss_of(dict_weights, case.normalize, case.aux, case.rng, case.state)
  tx = optimizer(case)
  step = jaxaccum.make_train_step(fun, tx, case.k, donate=False, **options_of(case))
  extra = (key,) * case.rng + (state,) * case.state
  new_params, opt_state, first = step(params, tx.init(params), batch, *extra)
  for p, q in zip(jax.tree.leaves(new_params), jax.tree.leaves(params), strict=True):
    np.testing.assert_array_equal(p, q)  # capture() changes nothing
  return outcome(case, first, captured(case, opt_state))


def run_nnx(case: Case, params, batch, key, state) -> Out:
  del key  # the model's own stream
  model = NnxMLP(params, state if case.state else None, case.rng)
  fun = nnx_loss(case.normalize, case.aux, case.rng, case.state)
  f = jitted(case, jaxaccum.nnx.value_and_grad(fun, case.k, **options_of(case)))
  first, grads = value_and_grads(case, f(model, batch))
  final = None
  if case.state:
    final = {"mean": model.mean[...], "count": model.count[...]}
  draws = int(model.rngs.dropout.count[...]) if case.rng else None
  return outcome(case, first, grads, final, draws)


def run_accumulate(case: Case, params, batch, key, state) -> Out:
  """``accumulate(inner, k)`` fed one call of ``value_and_grad(fun, 1)`` per
  micro-batch, as a loader would: call ``c`` gets the ``c``-th ``B / k``
  rows, the key ``fold_in(key, c)`` and the state the call before returned.
  With ``normalize="weighted"`` each call differentiates its loss sum and
  ``update`` gets its weight (accumulate's contract); with
  ``clip_per_example`` each call returns a ``ClipRecord``, passed in the
  gradient's place."""
  weighted = case.normalize == "weighted"
  per_call = "wsum" if weighted else case.normalize
  options = options_of(case, normalize="sum" if weighted else None)
  if case.clip != "none":
    options["clip_record"] = True
  fun = loss_of(dict_weights, per_call, case.aux, case.rng, case.state)
  f = jitted(case, jaxaccum.value_and_grad(fun, 1, **options))
  tx = jaxaccum.accumulate(
    optimizer(case),
    case.k,
    accum_dtype=jnp.dtype(case.accum_dtype),
    noise_stats=case.noise_stats,
  )
  opt_state = tx.init(params)
  update = jax.jit(tx.update)
  m = B // case.k
  values, auxes = [], []
  for c in range(case.k):
    rows = jax.tree.map(lambda a, c=c: a[c * m : (c + 1) * m], batch)
    call_key = jax.random.fold_in(key, c)
    first, g = f(
      params,
      placed(case, rows, P("data")),
      *(call_key,) * case.rng,
      *(state,) * case.state,
    )
    if case.has_aux or case.state:
      first, aux = first
      if case.state:
        aux, state = aux
      auxes.append(host(aux))
    values.append(host(first))
    weight = {"weight": jnp.sum(rows[2])} if weighted else {}
    _, opt_state = update(g, opt_state, params, **weight)
  noise = tuple(float(n) for n in opt_state.noise.last) if case.noise_stats else None
  aux = tuple(auxes) if case.has_aux else None
  grads = host(captured(case, opt_state.inner_state))
  return Out(tuple(values), grads, aux, host(state) if case.state else None, noise)


RUNNERS = {
  "value_and_grad": run_value_and_grad,
  "equinox": run_value_and_grad,
  "make_train_step": run_train_step,
  "nnx": run_nnx,
  "accumulate": run_accumulate,
}


def run_case(case: Case) -> Out:
  """Runs the case's entry point on the problem, placed on its mesh."""
  params, batch, key, state = problem(case.dtype)
  if case.mesh is None:
    return RUNNERS[case.entry](case, params, batch, key, state)
  with jax.set_mesh(case.mesh):
    params = placed_params(case, params)
    key, state = placed(case, key, P()), placed(case, state, P())
    if case.entry != "accumulate":  # it places each call's rows
      batch = placed(case, batch, P("data"))
    return RUNNERS[case.entry](case, params, batch, key, state)


# ------------------------------------------------------------ the references


class Unit(NamedTuple):
  """One micro-batch as DESIGN.md splits a call's rows on the case's path:
  its rows in the order ``fun`` sees them, the index folded into its key,
  and the state chain it threads (a device under ``view="device"``)."""

  rows: np.ndarray
  index: int
  chain: int


def layout(case: Case, rows: np.ndarray, k: int) -> list[Unit]:
  """The micro-batches of one call of jaxaccum over ``rows``."""
  n = len(rows)
  if case.view == "device":  # device d's micro-batch i: global index d*k+i
    per = n // N
    m = per // k
    return [
      Unit(rows[d * per + i * m : d * per + (i + 1) * m], d * k + i, d)
      for d in range(N)
      for i in range(k)
    ]
  m = n // k
  if case.parallel == "none":  # contiguous rows
    return [Unit(rows[i * m : (i + 1) * m], i, 0) for i in range(k)]
  # The rows sharded over N devices: the i-th slice of each of gcd(m, N)
  # blocks, so that no row moves.
  g = math.gcd(m, N)
  block, s = n // g, m // g
  return [
    Unit(np.concatenate([rows[b * block + i * s :][:s] for b in range(g)]), i, 0)
    for i in range(k)
  ]


def nnx_keys(count: int, device: int | None = None) -> list[jax.Array]:
  """The first ``count`` keys a fresh model's dropout stream draws, from an
  ``nnx.Rngs`` of the same seed, eagerly; on ``device`` under
  ``view="device"``, from the stream with the device's index folded into its
  key (a key per device)."""
  rngs = nnx.Rngs(dropout=NNX_SEED)
  if device is not None:
    rngs.dropout.key[...] = jax.random.fold_in(rngs.dropout.key[...], device)
  return [rngs.dropout() for _ in range(count)]


def unit_keys(case: Case, key, units: list[Unit]) -> list[Any]:
  """Each micro-batch's key: ``fold_in(key, index)``, or the key itself when
  the call has one micro-batch in total; with NNX the ``i``-th draw of the
  stream of the micro-batch's chain."""
  if not case.rng:
    return [None] * len(units)
  if case.entry == "nnx":
    device = case.view == "device"
    draws = {u.chain: nnx_keys(len(units), u.chain if device else None) for u in units}
    seen: collections.Counter[int] = collections.Counter()
    keys = []
    for u in units:
      keys.append(draws[u.chain][seen[u.chain]])
      seen[u.chain] += 1
    return keys
  if len(units) == 1:
    return [key]
  return [jax.random.fold_in(key, u.index) for u in units]


def _loss_parts(normalize: str, aux: str | None, rng: bool, state: bool):
  """``f(p, rows, key, state) -> (differentiated, (value, aux, state))``."""

  def f(p, rows, key, st):
    x, y, w = rows
    pred, new = forward(
      dict_weights(p), x, key=key if rng else None, state=st if state else None
    )
    value = value_of(normalize, pred, y, w)
    loss = value[0] if normalize == "weighted" else value
    return loss, (value, aux_of(aux, pred, y), new)

  return f


@functools.cache
def micro_batch_step(normalize: str, aux: str | None, rng: bool, state: bool):
  """``jax.value_and_grad`` of one micro-batch, jitted once per kind."""
  f = jax.value_and_grad(_loss_parts(normalize, aux, rng, state), has_aux=True)
  return jax.jit(f)


@functools.cache
def example_steps(normalize: str, aux: str | None, rng: bool):
  """``jax.value_and_grad`` of each example of a micro-batch: one ``vmap``."""
  f = jax.value_and_grad(_loss_parts(normalize, aux, rng, False), has_aux=True)
  return jax.jit(jax.vmap(f, in_axes=(None, 0, 0 if rng else None, None)))


@functools.cache
def full_batch_step(normalize: str):
  """``jax.value_and_grad`` of the whole batch's loss: its mean, its sum, its
  loss sum, or its token mean ``sum(loss * w) / sum(w)``."""

  def loss(p, rows):
    x, y, w = rows
    value = value_of(normalize, forward(dict_weights(p), x)[0], y, w)
    return value[0] / value[1] if normalize == "weighted" else value

  return jax.jit(jax.value_and_grad(loss))


class Ref(NamedTuple):
  """One call's reference (an :class:`Out`), its total weight (its examples
  or their weight) and the magnitudes of the terms summed into the value and
  each gradient leaf, which set the tolerances."""

  out: Out
  weight: float
  grad_scale: dict[str, float]
  value_scale: float


def as_f64(tree):
  return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def summed(trees, divisor=1.0):
  return jax.tree.map(lambda *xs: sum(as_f64(xs)) / divisor, *trees)


def magnitude(trees, divisor=1.0) -> dict[str, float]:
  """Per leaf, the largest element of the terms' absolute values summed."""
  return jax.tree.map(
    lambda *xs: float(np.max(sum(np.abs(as_f64(xs))))) / divisor, *trees
  )


def combine_aux(aux_type: str, auxes, units: list[Unit], weights, rows):
  """The micro-batches' aux as jaxaccum documents each type: rows put back
  where they are in the call's batch, means weighted like the loss, sums,
  or stacked; ``"auto"`` joins a leaf with the micro-batch's rows and takes
  the mean of any other."""
  if auxes[0] is None:
    return None
  total = float(sum(weights))

  def leaf(*xs):
    xs = as_f64(xs)
    kind = aux_type
    if kind == "auto":
      rowwise = xs[0].ndim >= 1 and xs[0].shape[0] == len(units[0].rows)
      kind = "concatenate" if rowwise else "mean"
    if kind == "concatenate":
      out = np.zeros((len(rows), *xs[0].shape[1:]))
      for x, u in zip(xs, units, strict=True):
        out[u.rows - rows[0]] = x
      return out
    if kind == "mean":
      return sum(wt * x for wt, x in zip(weights, xs, strict=True)) / total
    return sum(xs) if kind == "sum" else np.stack(xs)

  return jax.tree.map(leaf, *auxes)


def merged(states: list[Any]):
  """The devices' final states as DESIGN.md merges them: floating leaves
  averaged over the devices, integer leaves their maximum."""
  if len(states) == 1:
    return states[0]

  def merge(*xs):
    if np.issubdtype(np.asarray(xs[0]).dtype, np.integer):
      return np.max(xs, axis=0)
    return np.mean(as_f64(xs), axis=0)

  return jax.tree.map(merge, *states)


def sq_norm(tree) -> float:
  return float(sum(np.sum(a**2) for a in jax.tree.leaves(as_f64(tree))))


def noise_reference(grads, weights, examples, big, big_rows=1.0):
  """``|G_small|^2``, ``|G_big|^2``, ``B_small``, ``B_big`` (McCandlish et
  al. 2018): each micro-batch's mean gradient is its gradient over its
  ``weights`` (1 for a mean); the micro-batches holding no examples are left
  out; ``big`` is the whole batch's gradient, a mean once divided by
  ``big_rows``."""
  kept = [(g, wt, e) for g, wt, e in zip(grads, weights, examples, strict=True) if e]
  small = np.mean([sq_norm(g) / wt**2 for g, wt, _ in kept])
  counts = [e for _, _, e in kept]
  return (small, sq_norm(big) / big_rows**2, np.mean(counts), np.sum(counts))


def call_reference(case: Case, params, data, *, normalize, rows, key, state, k) -> Ref:
  """The reference of one call of jaxaccum on ``rows`` of the batch with
  ``k`` micro-batches: the micro-batches run in order, or one ``vmap`` per
  micro-batch with ``clip_per_example``; the full batch's value and
  gradients where keys and state play no part."""
  units = layout(case, rows, k)
  keys = unit_keys(case, key, units)
  if case.clip != "none":
    return example_reference(
      case, params, data, normalize=normalize, rows=rows, units=units, keys=keys
    )
  x, y, w = data
  chains: dict[int, Any] = {}
  values, grads, auxes, weights = [], [], [], []
  step = micro_batch_step(normalize, case.aux, case.rng, case.state)
  for u, unit_key in zip(units, keys, strict=True):
    st = chains.get(u.chain, state) if case.state else None
    r = u.rows
    (_, (value, aux, new_state)), g = step(params, (x[r], y[r], w[r]), unit_key, st)
    chains[u.chain] = new_state
    weighted = normalize == "weighted"
    values.append(float(value[0] if weighted else value))
    weights.append(float(value[1]) if weighted else 1.0)
    grads.append(host(g))
    auxes.append(host(aux))
  divisor = {"mean": len(units), "weighted": sum(weights)}.get(normalize, 1.0)
  value, grad = sum(values) / divisor, summed(grads, divisor)
  if not (case.rng or case.state):  # the full batch, in its own order
    value, grad = full_batch_step(normalize)(params, (x[rows], y[rows], w[rows]))
    value, grad = float(value), as_f64(host(grad))
  aux = combine_aux(case.aux or "auto", auxes, units, weights, rows)
  noise = None
  if case.noise_stats:
    per_row = normalize == "sum"  # a sum's mean gradient: over its rows
    counts = weights if normalize == "weighted" else [len(u.rows) for u in units]
    divisors = counts if normalize != "mean" else [1.0] * len(units)
    parts = [grads, divisors, counts]
    if case.view == "device" and case.fsdp in ("per_micro_batch", "cast_once"):
      # FSDP leaves' gradients are only ever summed over the devices: the
      # noise is that of the global micro-batches (data_parallel.py, _noise).
      by_index = [
        [n for n, u in enumerate(units) if u.index % k == i] for i in range(k)
      ]
      parts = [[summed([p[n] for n in group]) for group in by_index] for p in parts]
    noise = noise_reference(*parts, grad, len(rows) if per_row else 1.0)
  final = merged([chains[c] for c in sorted(chains)]) if case.state else None
  total = sum(weights) if normalize == "weighted" else float(len(rows))
  out = Out(value, grad, aux, final, noise)
  return Ref(out, total, magnitude(grads, divisor), sum(map(abs, values)) / divisor)


def example_reference(case: Case, params, data, *, normalize, rows, units, keys) -> Ref:
  """DP-SGD's reference: every example's gradient (one ``vmap`` per
  micro-batch, row ``j`` keyed ``fold_in(key_i, j)``), clipped to norm C over
  all leaves together, summed, and divided by the examples (``"mean"``),
  their weight (``"weighted"``) or nothing (``"sum"``)."""
  x, y, w = data
  values, weights, clipped, auxes = [], [], [], []
  step = example_steps(normalize, case.aux, case.rng)
  for u, unit_key in zip(units, keys, strict=True):
    r, row_keys = u.rows, None
    if case.rng:
      row_keys = jax.vmap(lambda j, k=unit_key: jax.random.fold_in(k, j))(
        jnp.arange(len(r))
      )
    (_, (value, aux, _)), g = step(params, (x[r], y[r], w[r]), row_keys, None)
    g = as_f64(host(g))
    norms = np.sqrt(
      sum(np.sum(a.reshape(len(r), -1) ** 2, 1) for a in jax.tree.leaves(g))
    )
    factor = np.minimum(1.0, C / np.maximum(norms, C))
    clipped.append(
      jax.tree.map(lambda a, f=factor: a * f.reshape(-1, *[1] * (a.ndim - 1)), g)
    )
    weighted = normalize == "weighted"
    values.append(as_f64(value[0] if weighted else value))
    weights.append(as_f64(value[1]) if weighted else np.ones(len(r)))
    auxes.append(host(aux))
  every = jax.tree.map(lambda *a: np.concatenate(a), *clipped)
  total = float(np.sum(np.concatenate(weights)))
  divisor = {"mean": float(len(rows)), "weighted": total}.get(normalize, 1.0)
  grad = jax.tree.map(lambda a: np.sum(a, 0) / divisor, every)
  grad_scale = jax.tree.map(
    lambda a: float(np.max(np.sum(np.abs(a), 0))) / divisor, every
  )
  losses = np.concatenate(values)
  unit_weights = [float(np.sum(wt)) for wt in weights]
  aux = combine_aux(case.aux or "auto", auxes, units, unit_weights, rows)
  out = Out(float(np.sum(losses)) / divisor, grad, aux)
  return Ref(out, total, grad_scale, float(np.sum(np.abs(losses))) / divisor)


def rounded_weights(case: Case) -> bool:
  """``fsdp_gather="cast_once"`` on a mesh: the FSDP leaves reach ``fun``
  rounded to ``gather_dtype`` (bfloat16); but under ``mesh=``'s device view
  ``clip_method="vmap"`` gathers them once as they are (docs/privacy.md)."""
  vmap_gathers = case.view == "device" and case.clip == "vmap"
  return case.fsdp == "cast_once" and case.mesh is not None and not vmap_gathers


def reference(case: Case) -> Ref:
  """The case's reference. For ``accumulate``: each call's, with the
  window's gradient the calls' mean, or their sum over the total weight
  (``weight=``, or a ClipRecord's examples)."""
  params, data, key, state = problem(case.dtype)
  params = {n: p.astype(jnp.float32) for n, p in params.items()}  # the same values
  if rounded_weights(case):  # fun computes with the FSDP leaves as gathered
    params = {
      n: p.astype(jnp.bfloat16).astype(jnp.float32) if FSDP_SPECS[n] != P() else p
      for n, p in params.items()
    }
  data, state = host(data), host(state)
  if case.entry != "accumulate":
    ref = call_reference(
      case,
      params,
      data,
      normalize=case.normalize,
      rows=np.arange(B),
      key=key,
      state=state,
      k=case.k,
    )
    if case.entry == "nnx" and case.rng:
      ref = ref._replace(out=ref.out._replace(draws=case.k))  # once per micro-batch
    return ref
  weighted = case.normalize == "weighted"
  m = B // case.k
  refs = []
  for c in range(case.k):
    rows = np.arange(c * m, (c + 1) * m)
    call_key = jax.random.fold_in(key, c)
    normalize = "wsum" if weighted else case.normalize
    refs.append(
      call_reference(
        case,
        params,
        data,
        normalize=normalize,
        rows=rows,
        key=call_key,
        state=state,
        k=1,
      )
    )
    state = refs[-1].out.state
  if weighted:  # update(..., weight=) with the call's weight
    weights = [float(np.sum(data[2][c * m : (c + 1) * m])) for c in range(case.k)]
  elif case.clip != "none":  # a ClipRecord's weight: its examples
    weights = [r.weight for r in refs]
  else:
    weights = [1.0] * case.k
  divisor = sum(weights)
  grads = summed([r.out.grads for r in refs], divisor)
  grad_scale = jax.tree.map(lambda *s: sum(s) / divisor, *[r.grad_scale for r in refs])
  noise = None
  if case.noise_stats:  # each call's gradient over its weight; B_big the weights'
    noise = noise_reference([r.out.grads for r in refs], weights, weights, grads)
  out = Out(
    tuple(r.out.value for r in refs),
    grads,
    tuple(r.out.aux for r in refs) if case.has_aux else None,
    state if case.state else None,
    noise,
  )
  return Ref(out, divisor, grad_scale, max(r.value_scale for r in refs))


# ---------------------------------------------------------------- comparison


def assert_close(got, want, atol, what):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, (what, got.shape, want.shape)
  np.testing.assert_allclose(got, want, rtol=0, atol=atol, err_msg=what)


def assert_matches(case: Case, got: Out, ref: Ref) -> None:
  """``got`` equals the reference within the module docstring's tolerances."""
  want = ref.out
  bf16 = case.dtype == "bfloat16" or rounded_weights(case)
  grad_tolerance = BF16_TOLERANCE if bf16 else F32_TOLERANCE
  for n in ("w1", "b1", "w2"):
    g = np.asarray(got.grads[n])
    assert g.dtype == jnp.dtype(case.dtype), (n, g.dtype)  # jax.grad's dtype
    assert_close(g, want.grads[n], grad_tolerance * ref.grad_scale[n], f"grads[{n!r}]")
  calls = case.entry == "accumulate"
  for v, wv in zip(
    *((got.value, want.value) if calls else ([got.value], [want.value])), strict=True
  ):
    assert_close(v, wv, F32_TOLERANCE * max(ref.value_scale, abs(wv)), "value")
  if case.has_aux:
    for a, wa in zip(
      *((got.aux, want.aux) if calls else ([got.aux], [want.aux])), strict=True
    ):
      assert jax.tree.structure(a) == jax.tree.structure(wa), (a, wa)
      for (path, x), wx in zip(
        jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(wa), strict=True
      ):
        atol = F32_TOLERANCE * float(np.max(np.abs(wx)))
        assert_close(x, wx, atol, f"aux{jax.tree_util.keystr(path)}")
  if case.state:
    assert np.asarray(got.state["count"]).dtype == np.int32  # kept its dtype
    assert int(got.state["count"]) == int(want.state["count"]), (got.state, want.state)
    assert_close(got.state["mean"], want.state["mean"], F32_TOLERANCE, "state['mean']")
  assert got.draws == want.draws, (got.draws, want.draws)
  if case.noise_stats:
    rtol = 4 * BF16_TOLERANCE if bf16 else 1e-4
    names = ("small_sq_norm", "big_sq_norm", "b_small", "b_big")
    for name, g, wv in zip(names, got.noise, want.noise, strict=True):
      np.testing.assert_allclose(g, wv, rtol=rtol, err_msg=f"noise.{name}")


# --------------------------------------------------- refusals and known bugs


class Refusal(NamedTuple):
  """A combination DESIGN.md or the manuals refuse: the error, and words its
  message must hold, naming both sides of the conflict."""

  name: str
  applies: Callable[[Case], bool]
  error: type[Exception]
  words: tuple[str, ...]


def micro_batches_in_total(case: Case) -> int:
  return case.k * (N if case.view == "device" else 1)


REFUSALS = (
  Refusal(
    "clip+state",  # docs/privacy.md: no order in which to thread state
    lambda c: c.clip != "none" and c.state and c.entry != "nnx",
    ValueError,
    ("clip_per_example", "state_argnum"),
  ),
  Refusal(
    "nnx+clip+variables",  # docs/privacy.md: fun may read them, not change them
    lambda c: c.clip != "none" and (c.state or c.rng) and c.entry == "nnx",
    ValueError,
    ("clip_per_example", "variables its model holds"),
  ),
  Refusal(
    "clip+noise_stats",  # the noise scale is measured on unclipped gradients
    lambda c: c.clip != "none" and c.noise_stats and c.entry != "accumulate",
    ValueError,
    ("clip_per_example", "noise_stats"),
  ),
  Refusal(
    "noise_stats+one_micro_batch",  # DESIGN.md: two micro-batches in total
    lambda c: (
      c.noise_stats and c.entry != "accumulate" and micro_batches_in_total(c) < 2
    ),
    ValueError,
    ("noise_stats", "2 micro-batches"),
  ),
  Refusal(
    # docs/guide.md: view="global" has "once" only on plain jit's step
    "global+once",
    lambda c: (
      c.fsdp == "once"
      and c.entry != "accumulate"  # each call one micro-batch: nothing to keep
      and (
        c.parallel == "global_auto"
        or (c.parallel == "global" and (c.clip != "none" or c.noise_stats))
      )
    ),
    ValueError,
    ("fsdp_gather='once'", "view='global'"),
  ),
  Refusal(
    "make_train_step+clip+sum",  # dp_noise("fixed") would divide a sum
    lambda c: (
      c.entry == "make_train_step" and c.clip != "none" and c.normalize == "sum"
    ),
    ValueError,
    ('normalize="fixed"', 'normalize="sum"'),
  ),
  Refusal(
    "accumulate+clip+mean",  # docs/privacy.md: accumulate takes clipped sums
    lambda c: c.entry == "accumulate" and c.clip != "none" and c.normalize == "mean",
    ValueError,
    ("accumulate()", 'normalize="mean"', "clip_per_example"),
  ),
)


class Bug(NamedTuple):
  """A combination accepted and wrong, or refused where DESIGN.md says it
  works: measured, and kept as a strict xfail until the library is fixed."""

  name: str
  applies: Callable[[Case], bool]
  raises: type[Exception]
  reason: str


#: In the order in which they would fail a case that meets several: the
#: first that applies names it.
BUGS: tuple[Bug, ...] = ()


def refusal_of(case: Case) -> Refusal | None:
  return next((r for r in REFUSALS if r.applies(case)), None)


def bug_of(case: Case) -> Bug | None:
  if refusal_of(case) is not None:
    return None
  return next((b for b in BUGS if b.applies(case)), None)


def reached(case: Case) -> str:
  """What the case reaches: ``exact.<reference>``, ``refused.<rule>`` or
  ``bug.<name>`` (see the module docstring)."""
  refusal = refusal_of(case)
  if refusal is not None:
    return f"refused.{refusal.name}"
  bug = bug_of(case)
  if bug is not None:
    return f"bug.{bug.name}"
  if case.clip != "none":
    return "exact.per_example"
  if case.rng or case.state or case.noise_stats or case.aux in ("mean", "sum", "stack"):
    return "exact.micro_batches"
  return "exact.full_batch"


def check(case: Case) -> None:
  """Runs the case and asserts what it reaches."""
  refusal = refusal_of(case)
  if refusal is None:
    assert_matches(case, run_case(case), reference(case))
    return
  with pytest.raises(refusal.error) as caught:
    run_case(case)
  for word in refusal.words:
    assert word in str(caught.value), (word, str(caught.value))


# ---------------------------------------------------------------- the cases


RANDOM_TRIPLES = 120


def all_cases() -> list[Case]:
  return list(dict.fromkeys(pairs() + split_triples() + triples(RANDOM_TRIPLES)))


def default_cases(cases: list[Case]) -> set[Case]:
  """The default run's cases: a cover of every non-default option value and
  of everything a case reaches (each refusal, each bug, each reference),
  from the cases that change two or more options first, in a seeded order."""
  rng = random.Random(8)
  order = sorted(cases, key=lambda c: (len(c.changed) < 2, rng.random()))
  uncovered = {(n, v) for n, vs in OPTIONS.items() for v in vs[1:]}
  uncovered |= {("reached", reached(c)) for c in cases}
  chosen = set()
  for case in order:
    covers = set(case.changed.items()) | {("reached", reached(case))}
    if covers & uncovered:
      chosen.add(case)
      uncovered -= covers
  return chosen


CASES = all_cases()
DEFAULT = default_cases(CASES)


def summary() -> str:
  """The counts that tests/README.md states, as it states them."""
  every = collections.Counter(reached(c) for c in CASES)
  default = collections.Counter(reached(c) for c in DEFAULT)

  def total(counter, kind):
    return sum(n for name, n in counter.items() if name.startswith(f"{kind}."))

  exact = (
    f"{every['exact.full_batch']} against the full batch, "
    f"{every['exact.micro_batches']} against the micro-batches run in order, "
    f"{every['exact.per_example']} against the per-example reference"
  )
  lines = [
    f"{len(CASES)} cases: the {len(set(pairs()))} pairs, the "
    f"{len(set(split_triples()))} triples of `SPLIT_OPTIONS` and "
    f"{RANDOM_TRIPLES} seeded random triples, less the duplicates. "
    f"{total(every, 'exact')} reach an exact comparison ({exact}), "
    f"{total(every, 'refused')} a named refusal ({len(REFUSALS)} rules) and "
    f"{total(every, 'bug')} a strict xfail ({len(BUGS)} bugs). The default "
    f"run holds {len(DEFAULT)} of them ({total(default, 'exact')} exact, "
    f"{total(default, 'refused')} refused, {total(default, 'bug')} xfail); "
    "the rest are marked `slow`.",
    "",
    "| reached | cases | default run |",
    "|---|---|---|",
  ]
  names = [f"exact.{k}" for k in ("full_batch", "micro_batches", "per_example")]
  names += [f"refused.{r.name}" for r in REFUSALS] + [f"bug.{b.name}" for b in BUGS]
  lines += [f"| `{n}` | {every[n]} | {default[n]} |" for n in names]
  return "\n".join(lines)


def _param(case: Case):
  marks = [] if case in DEFAULT else [pytest.mark.slow]
  bug = bug_of(case)
  if bug is not None:
    marks.append(pytest.mark.xfail(strict=True, raises=bug.raises, reason=bug.reason))
  return pytest.param(case, id=f"{reached(case)}/{case.name}", marks=marks)


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_combination(case, record_property):
  record_property("reached", reached(case))
  check(case)


def test_the_readme_states_the_matrix():
  """tests/README.md's counts are the ones generated here (STYLE.md, 14)."""
  text = (pathlib.Path(__file__).parent / "README.md").read_text()
  begin, end = "<!-- begin: combinations -->\n", "\n<!-- end: combinations -->"
  assert begin in text and end in text, "tests/README.md lacks the markers"
  stated = text.split(begin)[1].split(end)[0].strip()
  assert stated == summary(), f"tests/README.md should say:\n\n{summary()}"
