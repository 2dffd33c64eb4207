"""DP-SGD with bfloat16 parameters: the noise covers one example's effect, C.

The noise is added to the clipped sum in the accumulator's dtype, before any
cast (DESIGN.md). A sum rounded to bfloat16 and multiplied back by the
examples' count carried a rounding error that grows with the batch: one
example's effect on what the noise covered was 1.10 C, 1.57 C and 3.10 C at
n = 256, 1024 and 4096, by ``"vmap"`` and by ``"ghost"``.

The measurement is the obvious one. Two neighbouring batches differ by one
example, a 30x outlier whose gradient is clipped to exactly C: present in
one, masked out (absent) in the other. The float32 quantity the noise is
added to (the :class:`jaxaccum.ClipRecord`'s ``clipped_sum``, which
``dp_noise`` reads) is compared between them: its change, divided by C, is
1 to float32 rounding. An observer after ``dp_noise`` in the chain reads the
record ``dp_noise`` read on the ``make_train_step``, ``jaxaccum.nnx``,
``accumulate``, ``mesh=`` and plain-``jit`` paths.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_ghost import (
  cnn_batch,
  cnn_loss,
  cnn_params,
  lm_batch,
  lm_loss,
  lm_params,
  mlp_batch,
  mlp_loss,
  mlp_params,
  reference,
  relative_error,
)

import jaxaccum
from jaxaccum import _privacy

F, H, C = 8, 16, 1.0
#: One example's effect on the noised sum, over C: 1 to float32 rounding of
#: a sum of a few thousand terms (measured 1.5e-5 in float32 at n = 4096).
TOLERANCE = 1e-4


def bf16_params():
  k1, k2 = jax.random.split(jax.random.key(0))
  p = {
    "w1": jax.random.normal(k1, (F, H)) / 3,
    "b1": jnp.zeros(H),
    "w2": jax.random.normal(k2, (H,)) / 4,
    "b2": jnp.zeros(()),
  }
  return jax.tree.map(lambda a: a.astype(jnp.bfloat16), p)


def example_loss(p, example):
  """ONE example; the model in its parameters' dtype, the loss in float32."""
  x, y = example
  h = jnp.tanh(x.astype(p["w1"].dtype) @ p["w1"] + p["b1"])
  return ((h @ p["w2"] + p["b2"]).astype(jnp.float32) - y) ** 2


def batch_with_outlier(n, seed=1):
  """n rows; row n // 3 scaled 30x, its gradient far above C."""
  x = jax.random.normal(jax.random.key(seed), (n, F))
  y = jnp.sin(3 * x[:, 0]) + x[:, 1]
  j = n // 3
  return (x.at[j].multiply(30.0), y.at[j].multiply(30.0)), j


def masks(n, j):
  """The outlier present, and absent (its row padding)."""
  present = jnp.ones(n, jnp.float32)
  return present, present.at[j].set(0.0)


def effect(with_it, without_it):
  """The norm of the change over all leaves, in units of C (float64)."""
  diffs = [
    np.asarray(a, np.float64) - np.asarray(b, np.float64)
    for a, b in zip(jax.tree.leaves(with_it), jax.tree.leaves(without_it), strict=True)
  ]
  return float(np.sqrt(sum(np.sum(d**2) for d in diffs))) / C


def reference_sum(params, batch, mask):
  """Per-example clipping by hand: each example's gradient (bfloat16, from
  one vmap of jax.grad), its norm and its clip in float32, masked rows
  dropped, the sum in float32."""
  grads = jax.vmap(jax.grad(example_loss), in_axes=(None, 0))(params, batch)
  wide = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
  norms = jnp.sqrt(
    sum(jnp.sum(g.reshape(g.shape[0], -1) ** 2, 1) for g in jax.tree.leaves(wide))
  )
  factor = jnp.where(mask > 0, jnp.minimum(1.0, C / norms), 0.0)
  return jax.tree.map(
    lambda g: jnp.tensordot(factor, g, (0, 0), precision="highest"), wide
  )


def observe():
  """A transformation after dp_noise that keeps, as its state, the float32
  clipped sum of the record dp_noise was handed (optax.chain passes every
  transformation the same clip_record=)."""

  def init(params):
    return jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)

  def update(updates, state, params=None, *, clip_record=None, **extra):
    del params, extra
    seen = jax.tree.map(lambda s: s.astype(jnp.float32), clip_record.clipped_sum)
    return updates, jax.tree.map(lambda _, s: s, state, seen)

  return optax.GradientTransformationExtraArgs(init, update)


def noise(expected):
  return jaxaccum.dp_noise(
    0.0, C, jax.random.key(0), normalize="poisson", expected_batch_size=expected
  )


# ---------------------------------------------------------------- the record


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_one_examples_effect_on_the_noised_sum_is_c_with_bfloat16_at_4096(method):
  """The acceptance test of issue 44: at n = 4096, k = 4, bfloat16
  parameters, the outlier moves the float32 sum the noise is added to by C,
  to float32 rounding (it was 3.1 C)."""
  n = 4096
  params = bf16_params()
  batch, j = batch_with_outlier(n)
  present, absent = masks(n, j)
  grad = jaxaccum.grad(
    example_loss,
    4,
    normalize="sum",
    clip_per_example=C,
    clip_record=True,
    clip_method=method,
  )
  with_it = grad(params, batch, example_mask=present)
  without_it = grad(params, batch, example_mask=absent)
  assert all(s.dtype == jnp.float32 for s in jax.tree.leaves(with_it.clipped_sum))
  assert abs(effect(with_it.clipped_sum, without_it.clipped_sum) - 1) <= TOLERANCE
  # The gradient the step returns is that sum, cast once.
  for g, s in zip(
    jax.tree.leaves(with_it.grads), jax.tree.leaves(with_it.clipped_sum), strict=True
  ):
    assert g.dtype == jnp.bfloat16
    np.testing.assert_array_equal(g, s.astype(jnp.bfloat16))
  # Against per-example clipping by hand: vmap's per-example gradients are
  # rounded to bfloat16, as the reference's are; ghost forms each example's
  # gradient from bfloat16 activations and cotangents in float32, so it
  # differs from that reference by bfloat16's rounding (2^-9 relative).
  want = reference_sum(params, batch, present)
  error = effect(with_it.clipped_sum, want) * C
  scale = effect(want, jax.tree.map(jnp.zeros_like, want)) * C
  assert error <= (1e-4 if method == "vmap" else 4e-3) * scale, (error, scale)


def test_dp_noise_adds_its_noise_to_the_records_clipped_sum_then_casts():
  """dp_noise reads the record's float32 sum, not the bfloat16 gradient
  times its divisor: here the two differ, and the update follows the sum,
  with the noise drawn as documented (fold_in(key, 0), split per leaf)."""
  grads = {"a": jnp.array([0.25, 0.125], jnp.bfloat16)}
  exact = {"a": jnp.array([0.5 + 2**-10, 0.25 - 2**-11], jnp.float32)}
  # a record as a clipped step marks it (one built by hand is refused)
  record = _privacy.made_record(grads, 2.0, 2.0, C, "mean", clipped_sum=exact)
  key, sigma = jax.random.key(3), 0.5
  tx = jaxaccum.dp_noise(sigma, C, key, normalize="poisson", expected_batch_size=4.0)
  out, _ = tx.update(grads, tx.init(grads), clip_record=record)
  (z_key,) = jax.random.split(jax.random.fold_in(key, 0), 1)
  z = jax.random.normal(z_key, (2,), jnp.float32)
  want = ((exact["a"] + sigma * C * z) / 4.0).astype(jnp.bfloat16)
  assert out["a"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(out["a"], want)
  fixed = jaxaccum.dp_noise(0.0, C, key, normalize="fixed")
  out, _ = fixed.update(grads, fixed.init(grads), clip_record=record)
  np.testing.assert_array_equal(out["a"], (exact["a"] / 2).astype(jnp.bfloat16))


# ---------------------------------------------------------------- every path


N = 2048


def _train_step(method):
  params = bf16_params()
  batch, j = batch_with_outlier(N)
  tx = optax.chain(noise(float(N)), observe())
  step = jaxaccum.make_train_step(
    example_loss, tx, 4, clip_per_example=C, clip_method=method, donate=False
  )
  seen = []
  for mask in masks(N, j):
    _, opt_state, _ = step(params, tx.init(params), batch, example_mask=mask)
    seen.append(opt_state[1])
  return seen


class NnxNet(nnx.Module):
  def __init__(self, rngs):
    self.hidden = nnx.Linear(F, H, param_dtype=jnp.bfloat16, rngs=rngs)
    self.out = nnx.Linear(H, 1, param_dtype=jnp.bfloat16, rngs=rngs)

  def __call__(self, x):
    h = jnp.tanh(self.hidden(x.astype(jnp.bfloat16)))
    return self.out(h)[0].astype(jnp.float32)


def _nnx(method):
  batch, j = batch_with_outlier(N)

  def loss(model, example):
    x, y = example
    return (model(x) - y) ** 2

  seen = []
  for mask in masks(N, j):
    model = NnxNet(nnx.Rngs(0))
    optimizer = nnx.Optimizer(
      model, optax.chain(noise(float(N)), observe()), wrt=nnx.Param
    )
    step = jaxaccum.nnx.make_train_step(
      loss, optimizer, 4, clip_per_example=C, clip_method=method, donate=False
    )
    step(model, batch, example_mask=mask)
    seen.append(optimizer.opt_state[1])
  return seen


def _accumulate(method):
  params = bf16_params()
  batch, j = batch_with_outlier(N)
  tx = jaxaccum.accumulate(optax.chain(noise(float(N)), observe()), every_k=4)
  grad = jaxaccum.grad(
    example_loss,
    1,
    normalize="sum",
    clip_per_example=C,
    clip_record=True,
    clip_method=method,
  )
  update = jax.jit(tx.update)
  seen = []
  for mask in masks(N, j):
    state = tx.init(params)
    for i in range(4):  # one window of four calls
      rows = slice(i * N // 4, (i + 1) * N // 4)
      part = jax.tree.map(lambda x, rows=rows: x[rows], batch)
      record = grad(params, part, example_mask=mask[rows])
      _, state = update(record, state, params)
    assert int(state.step) == 1
    seen.append(state.inner_state[1])
  return seen


def _mesh(method, plain_jit=False):
  """mesh= on 8 devices with w1, b1 and w2 sharded over them (FSDP), or
  plain jit on an Explicit mesh, parameters replicated."""
  axes = AxisType.Explicit if plain_jit else AxisType.Auto
  mesh = jax.make_mesh((8,), ("data",), axis_types=(axes,))
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
  specs = {"w1": P(None, "data"), "b1": P("data"), "w2": P("data"), "b2": P()}
  params = bf16_params()
  options = {}
  if plain_jit:
    params = jax.tree.map(lambda x: put(x, P()), params)
  else:
    params = {name: put(x, specs[name]) for name, x in params.items()}
    options = {"mesh": mesh, "data_axis": "data", "param_specs": specs}
  batch, j = batch_with_outlier(N)
  batch = put(batch, P("data"))
  grad = jaxaccum.grad(
    example_loss,
    2,
    normalize="sum",
    clip_per_example=C,
    clip_record=True,
    clip_method=method,
    **options,
  )
  seen = []
  with jax.set_mesh(mesh):
    for mask in masks(N, j):
      seen.append(jax.jit(grad)(params, batch, example_mask=put(mask, P("data"))))
  return [r.clipped_sum for r in seen]


PATHS = {
  "make_train_step": _train_step,
  "nnx.make_train_step": _nnx,
  "accumulate": _accumulate,
  "mesh": _mesh,
  "plain_jit": lambda method: _mesh(method, plain_jit=True),
}


@pytest.mark.parametrize("method", ["vmap", "ghost"])
@pytest.mark.parametrize("path", list(PATHS))
def test_every_path_noises_the_float32_sum_with_bfloat16_parameters(path, method):
  """The sum dp_noise adds its noise to, or the record a caller hands it,
  moves by C when the outlier is removed, on every path (at n = 2048 the
  bfloat16 sum moved by 1.5 C)."""
  with_it, without_it = PATHS[path](method)
  assert abs(effect(with_it, without_it) - 1) <= TOLERANCE


# ---------------------------------------------------------------- ghost's uses


def _bf16(tree):
  return jax.tree.map(
    lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x,
    tree,
  )


def _mixed_mlp_loss(p, example):
  """Float32 parameters, cast to bfloat16 inside the loss (mixed precision)."""
  return mlp_loss(_bf16(p), _bf16(example)).astype(jnp.float32)


GHOST_MODELS = {
  "mlp": (mlp_loss, mlp_params, mlp_batch, True),
  "cnn": (cnn_loss, cnn_params, cnn_batch, True),
  "transformer": (lm_loss, lm_params, lm_batch, True),
  "tied_transformer": (lm_loss, lambda: lm_params(tied=True), lm_batch, True),
  "mixed_precision_mlp": (_mixed_mlp_loss, mlp_params, mlp_batch, False),
}
#: The transformers compile for half a minute each: slow (the MLP, the CNN
#: and the cast in the loss run by default).
SLOW_MODELS = {"transformer", "tied_transformer"}


@pytest.mark.parametrize(
  "model",
  [
    pytest.param(m, marks=pytest.mark.slow) if m in SLOW_MODELS else m
    for m in GHOST_MODELS
  ],
)
def test_ghost_in_bfloat16_gives_each_example_exactly_its_clipped_norm(model):
  """Ghost clipping on bfloat16 models whose leaves meet every kind of use:
  dense layers and biases, a convolution's kernel, an embedding lookup, a
  LayerNorm scale, an attention projection, an embedding tied to the output
  head (used twice), and float32 parameters cast to bfloat16 in the loss.
  Every example's norm is above C, so removing any one moves the float32
  clipped sum by exactly C: the sum is formed from the very values the
  norms were taken from, in float32, with exact factors."""
  loss, params_fn, batch_fn, cast = GHOST_MODELS[model]
  params, batch = params_fn(), batch_fn()
  if cast:
    params, batch = _bf16(params), _bf16(batch)
  _, norms = reference(loss, params, batch, 1.0)
  clip = float(jnp.min(norms.astype(jnp.float32))) / 2
  grad = jaxaccum.grad(
    loss,
    2,
    normalize="sum",
    clip_per_example=clip,
    clip_method="ghost",
    clip_record=True,
  )
  rows = jax.tree.leaves(batch)[0].shape[0]
  present = jnp.ones(rows, jnp.float32)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", jaxaccum.GhostFallbackWarning)
    whole = grad(params, batch, example_mask=present).clipped_sum
    for j in (0, rows // 2 + 1):
      less = grad(params, batch, example_mask=present.at[j].set(0)).clipped_sum
      assert abs(effect(whole, less) * C / clip - 1) <= TOLERANCE, j
  # The right sum, to bfloat16's rounding of each example's gradient.
  want, _ = reference(loss, params, batch, clip)
  want = jax.tree.map(lambda g: g.astype(jnp.float32), want)
  assert relative_error(whole, want) <= 2e-2
