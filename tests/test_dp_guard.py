"""DP-SGD's silent losses of privacy, tried as a privacy engineer would, each
now an error that names the fix (issue 38).

Each test states the configuration that used to train normally with a
weakened guarantee: ``dp_noise`` after another transformation, an argument
computed from the batch reaching every example's loss, gradients fed to
``accumulate`` that were clipped at another norm, not clipped, or averaged,
a clip norm that float32 rounds to 0, ``steps=0``, a PLD accountant asked
for tens of GiB. A test of the fix goes with a test that the safe
configuration next to it still trains.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxaccum
from jaxaccum import _privacy

# These tests clip without noise on purpose (the clipped sum is what they check).
pytestmark = pytest.mark.filterwarnings("ignore::jaxaccum.ClipWithoutNoiseWarning")

B, F = 16, 3
C = 1.0


def example_loss(w, example):
  x, y = example
  return (x @ w - y) ** 2


def data(rows=B):
  x = jax.random.normal(jax.random.key(0), (rows, F))
  return x, 2 * x[:, 0] + x[:, 1]


def noise(sigma=1.0, clip=C):
  return jaxaccum.dp_noise(sigma, clip, jax.random.key(1), normalize="fixed")


def message(error):
  return str(error.value)


# ------------------------------------------- dp_noise first, nowhere else


FIRST = "Put jaxaccum.dp_noise first, where it sees the clipped sum itself"

MISPLACED = {
  # The case: the noise is added to Adam's normalized step, whose
  # sensitivity to one example is ~1000 x its noise (sigma_eff ~ 0.00098).
  "after scale_by_adam": lambda: optax.chain(
    optax.scale_by_adam(), noise(), optax.scale(-0.1)
  ),
  # Transformations without state: invisible in the optimizer state's structure.
  "after clip_by_global_norm": lambda: optax.chain(
    optax.clip_by_global_norm(0.1), noise(), optax.sgd(0.1)
  ),
  "after a scale": lambda: optax.chain(optax.scale(1e-3), noise(), optax.sgd(0.1)),
  "after weight decay": lambda: optax.chain(
    optax.add_decayed_weights(1e-2), noise(), optax.sgd(0.1)
  ),
  "under a partial mask": lambda: optax.chain(
    optax.masked(noise(), {"a": True, "b": False}), optax.sgd(0.1)
  ),
  # The other leaves would reach their optimizer with no noise at all.
  "under multi_transform": lambda: optax.multi_transform(
    {"noisy": optax.chain(noise(), optax.sgd(0.1)), "plain": optax.sgd(0.1)},
    {"a": "noisy", "b": "plain"},
  ),
  "inside MultiSteps": lambda: optax.MultiSteps(
    optax.chain(noise(), optax.sgd(0.1)), 2
  ),
  "after adam, under inject_hyperparams": lambda: optax.inject_hyperparams(
    lambda learning_rate: optax.chain(
      optax.scale_by_adam(), noise(), optax.scale(-learning_rate)
    )
  )(learning_rate=0.1),
}


def tree_loss(p, example):
  return example_loss(p["a"] + p["b"], example)


def tree_params():
  return {"a": jnp.zeros(F), "b": jnp.zeros(F)}


@pytest.mark.parametrize("where", list(MISPLACED))
def test_dp_noise_anywhere_but_first_in_make_train_step_is_an_error(where):
  tx = MISPLACED[where]()
  step = jaxaccum.make_train_step(tree_loss, tx, 2, clip_per_example=C, donate=False)
  with pytest.raises(ValueError, match="dp_noise") as error:
    step(tree_params(), tx.init(tree_params()), data())
  assert "first" in message(error)


@pytest.mark.slow
@pytest.mark.parametrize(
  "tx",
  [
    lambda: optax.chain(noise(), optax.adam(0.1)),
    lambda: optax.chain(optax.identity(), noise(), optax.sgd(0.1)),  # no-op first
    lambda: optax.inject_hyperparams(
      lambda learning_rate: optax.chain(noise(), optax.sgd(learning_rate))
    )(learning_rate=0.1),
    lambda: optax.chain(optax.masked(noise(), {"a": True, "b": True}), optax.sgd(0.1)),
  ],
  ids=["first", "after identity", "first under inject_hyperparams", "whole mask"],
)
def test_dp_noise_first_still_trains(tx):
  tx = tx()
  step = jaxaccum.make_train_step(tree_loss, tx, 2, clip_per_example=C, donate=False)
  params, _, _ = step(tree_params(), tx.init(tree_params()), data())
  assert not np.allclose(params["a"], 0)


def test_dp_noise_after_adam_in_nnx_make_train_step_is_an_error():
  model = nnx.Linear(F, 1, rngs=nnx.Rngs(0))
  tx = optax.chain(optax.scale_by_adam(), noise(), optax.scale(-0.1))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  def loss(model, example):
    x, y = example
    return (model(x)[0] - y) ** 2

  step = jaxaccum.nnx.make_train_step(loss, optimizer, 2, clip_per_example=C)
  with pytest.raises(ValueError, match=FIRST):
    step(model, data())


def test_an_nnx_loop_of_ones_own_hands_dp_noise_the_record():
  model = nnx.Linear(F, 1, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.chain(noise(), optax.sgd(0.1)), wrt=nnx.Param)

  def loss(model, example):
    x, y = example
    return (model(x)[0] - y) ** 2

  grad = jaxaccum.nnx.grad(loss, 2, clip_per_example=C, clip_record=True)

  @nnx.jit
  def step(model, optimizer, batch, scale):
    record = grad(model, batch)
    grads = record.grads
    if scale is not None:  # a transformation of one's own, before dp_noise
      grads = jax.tree.map(lambda g: g * scale, grads)
    optimizer.update(model, grads, clip_record=record)

  before = model.kernel[...].copy()
  step(model, optimizer, data(), None)
  assert not np.allclose(model.kernel[...], before)
  with pytest.raises(ValueError, match=FIRST):  # the gradient changed on the way
    step(model, optimizer, data(), 2.0)


def test_dp_noise_after_adam_inside_accumulate_is_an_error():
  w = jnp.zeros(F)
  tx = jaxaccum.accumulate(
    optax.chain(optax.scale_by_adam(), noise(), optax.scale(-0.1)), 2
  )
  grad = jaxaccum.grad(
    example_loss, 1, normalize="sum", clip_per_example=C, clip_record=True
  )
  with pytest.raises(ValueError, match=FIRST):
    tx.update(grad(w, data()), tx.init(w), w)


def test_dp_noise_is_handed_the_step_s_own_arrays_by_hand_too():
  grad = jaxaccum.grad(example_loss, 1, clip_per_example=C, clip_record=True)
  record = grad(jnp.zeros(F), data())
  tx = noise()
  state = tx.init(jnp.zeros(F))
  tx.update(record.grads, state, clip_record=record)  # the record's own arrays
  with pytest.raises(ValueError, match=FIRST):
    tx.update(record.grads * 100.0, state, clip_record=record)


# ------------------------------------- arguments that every example reads


def centered_loss(w, example, mean):
  x, y = example
  return (x @ w - (y - mean)) ** 2


def test_a_batch_statistic_passed_beside_the_batch_is_an_error():
  """The issue's case: the batch mean, computed outside and passed as an
  argument that is not in batch_argnums, reaches every example's loss; the
  clipped sum's add/remove-one sensitivity was 3.8 C."""
  batch = data()
  fun = jaxaccum.grad(centered_loss, 2, clip_per_example=C)
  with pytest.raises(ValueError) as error:
    fun(jnp.zeros(F), batch, jnp.mean(batch[1]))
  got = message(error)
  assert got.startswith("With clip_per_example, args[2] holds arrays")
  assert "declare it public with public_argnums=(2,)" in got
  assert "the privacy guarantee is void" in got
  assert "shared_argnums= is not enough for DP" in got


def test_shared_argnums_does_not_declare_an_argument_public():
  batch = data()
  fun = jaxaccum.grad(centered_loss, 2, clip_per_example=C, shared_argnums=2)
  with pytest.raises(ValueError, match=r"shared_argnums= only silences a warning"):
    fun(jnp.zeros(F), batch, jnp.mean(batch[1]))


def test_a_batch_sized_array_beside_the_batch_is_an_error_not_a_warning():
  batch = data()

  def loss(w, example, table):
    return example_loss(w, example) + jnp.sum(table) * 0

  fun = jaxaccum.grad(loss, 2, clip_per_example=C)
  with pytest.raises(ValueError, match=r"args\[2\] holds arrays"):
    fun(jnp.zeros(F), batch, batch[0])


def test_a_batch_statistic_in_make_train_step_is_an_error():
  tx = optax.chain(noise(), optax.sgd(0.1))
  step = jaxaccum.make_train_step(centered_loss, tx, 2, clip_per_example=C)
  batch = data()
  with pytest.raises(ValueError, match=r"public_argnums=\(2,\)"):
    step(jnp.zeros(F), tx.init(jnp.zeros(F)), batch, jnp.mean(batch[1]))


def test_an_array_keyword_argument_is_an_error():
  def loss(w, example, *, mean):
    return centered_loss(w, example, mean)

  fun = jaxaccum.grad(loss, 2, clip_per_example=C)
  batch = data()
  with pytest.raises(ValueError, match=r"the keyword argument mean= holds arrays"):
    fun(jnp.zeros(F), batch, mean=jnp.mean(batch[1]))


def test_a_declared_public_argument_is_read_and_its_declaration_is_what_holds():
  """public_argnums trusts the declaration. Declared falsely (the batch
  mean), the clipped sum moves by more than C when one example is removed:
  the guarantee is the user's to keep, which the error message says."""
  batch = data()
  fun = jaxaccum.grad(
    centered_loss, 1, normalize="sum", clip_per_example=C, public_argnums=2
  )
  w = jnp.full(F, 3.0)
  rest = jax.tree.map(lambda x: x[1:], batch)
  with_all = fun(w, batch, jnp.mean(batch[1]))
  without_first = fun(w, rest, jnp.mean(rest[1]))
  public = jnp.float32(0.5)  # a true constant: removing the example moves <= C
  honest = fun(w, batch, public) - fun(w, rest, public)
  assert float(jnp.linalg.norm(honest)) <= C * (1 + 1e-6)
  assert float(jnp.linalg.norm(with_all - without_first)) > C


def test_a_teacher_model_beside_the_nnx_model_must_be_declared_public():
  model, teacher = (nnx.Linear(F, 1, rngs=nnx.Rngs(s)) for s in (0, 1))

  def distill(model, example, teacher):
    x, _ = example
    return (model(x)[0] - teacher(x)[0]) ** 2

  fun = jaxaccum.nnx.grad(distill, 2, clip_per_example=C)
  with pytest.raises(ValueError, match=r"args\[2\] holds nnx objects"):
    fun(model, data(), teacher)
  declared = jaxaccum.nnx.grad(distill, 2, clip_per_example=C, public_argnums=2)
  declared(model, data(), teacher)


# ------------------------------------------ the accumulate() path's input


def batch_loss(w, batch):
  return jnp.sum(jax.vmap(example_loss, in_axes=(None, 0))(w, batch))


def window(grad, clip=C, **update_kwargs):
  """One window of two calls of accumulate(chain(dp_noise, sgd), 2)."""
  w = jnp.zeros(F)
  tx = jaxaccum.accumulate(optax.chain(noise(clip=clip), optax.sgd(0.1)), 2)
  state = tx.init(w)
  x, y = data()
  for i in range(2):
    rows = slice(i * B // 2, (i + 1) * B // 2)
    updates, state = tx.update(grad(w, (x[rows], y[rows])), state, w, **update_kwargs)
  return updates


@pytest.mark.parametrize(
  "grad",
  [
    lambda: jaxaccum.grad(example_loss, 1, normalize="sum", clip_per_example=10 * C),
    lambda: jaxaccum.grad(batch_loss, 1, normalize="sum"),
    lambda: jaxaccum.grad(example_loss, 1, clip_per_example=C),
  ],
  ids=["clipped at 10 C", "unclipped", "clipped mean"],
)
def test_accumulate_refuses_gradients_without_a_record_of_the_clipped_sum(grad):
  with pytest.raises(ValueError, match=r"needs each call's clipped sum as a"):
    window(grad(), weight=jnp.float32(B // 2))


def test_accumulate_refuses_a_record_clipped_at_another_norm():
  grad = jaxaccum.grad(
    example_loss, 1, normalize="sum", clip_per_example=10 * C, clip_record=True
  )
  with pytest.raises(ValueError) as error:
    window(grad)
  assert message(error).startswith(
    "accumulate() got a gradient clipped at clip_per_example=10.0, but its "
    "dp_noise is calibrated to clip_norm=1.0"
  )


def test_accumulate_refuses_a_record_of_a_mean():
  grad = jaxaccum.grad(example_loss, 1, clip_per_example=C, clip_record=True)
  with pytest.raises(ValueError, match=r'got a gradient of normalize="mean"'):
    window(grad)


def test_accumulate_takes_the_record_of_a_clipped_sum_and_its_count():
  grad = jaxaccum.grad(
    example_loss, 1, normalize="sum", clip_per_example=C, clip_record=True
  )
  updates = window(grad)  # weight= defaults to the record's examples: B in all
  # DP-SGD by hand: the clipped sum of all B examples, dp_noise's first draw
  # (sigma = 1), divided by the count B, one SGD step of 0.1.
  per_example = jax.vmap(jax.grad(example_loss), (None, 0))(jnp.zeros(F), data())
  norms = jnp.linalg.norm(per_example, axis=1)
  total = jnp.sum(per_example * jnp.minimum(1.0, C / norms)[:, None], axis=0)
  (key,) = jax.random.split(jax.random.fold_in(jax.random.key(1), 0), 1)
  want = -0.1 * (total + C * jax.random.normal(key, (F,))) / B
  np.testing.assert_allclose(updates, want, rtol=1e-5, atol=1e-6)


def test_the_record_holds_the_real_examples_and_what_the_sum_was_divided_by():
  mask = (jnp.arange(B) < 11).astype(jnp.float32)
  for normalize, divided_by in (("sum", 1.0), ("mean", 11.0)):
    grad = jaxaccum.grad(
      example_loss, 4, normalize=normalize, clip_per_example=C, clip_record=True
    )
    record = grad(jnp.zeros(F), data(), example_mask=mask)
    assert (float(record.examples), float(record.divided_by)) == (11.0, divided_by)
    assert (record.clip_norm, record.normalize) == (C, normalize)


@pytest.mark.parametrize("make", ["plain", "nnx"])
def test_clip_record_is_for_value_and_grad_not_for_train_steps(make):
  tx = optax.chain(noise(), optax.sgd(0.1))
  with pytest.raises(ValueError, match="clip_record=True is for"):
    if make == "plain":
      jaxaccum.make_train_step(
        example_loss, tx, 2, clip_per_example=C, clip_record=True
      )
    else:
      model = nnx.Linear(F, 1, rngs=nnx.Rngs(0))
      optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
      jaxaccum.nnx.make_train_step(
        example_loss, optimizer, 2, clip_per_example=C, clip_record=True
      )


def test_accumulate_under_jit_checks_at_trace_time():
  grad = jaxaccum.grad(example_loss, 1, clip_per_example=C, clip_record=True)
  w = jnp.zeros(F)
  tx = jaxaccum.accumulate(optax.chain(noise(), optax.sgd(0.1)), 2)
  update = jax.jit(tx.update)
  with pytest.raises(ValueError, match=r'normalize="mean"'):
    update(grad(w, data()), tx.init(w), w)


# ----------------------------------------------------------- small ones


@pytest.mark.parametrize("clip", [1e-40, 1e-39, 1e-46, 1e39])
def test_a_clip_norm_float32_cannot_hold_is_named(clip):
  with pytest.raises(ValueError) as error:
    jaxaccum.grad(example_loss, 2, clip_per_example=clip)
  assert message(error).startswith(
    f"clip_per_example={clip!r} is not a normal float32 number"
  )
  with pytest.raises(ValueError, match="not a normal float32 number"):
    jaxaccum.dp_noise(1.0, clip, jax.random.key(0), normalize="fixed")


def test_the_smallest_normal_float32_clip_norm_is_taken():
  tiny = float(np.finfo(np.float32).tiny)
  jaxaccum.grad(example_loss, 2, clip_per_example=tiny)(jnp.zeros(F), data())


def test_epsilon_after_zero_steps_is_jaxaccums_error():
  with pytest.raises(ValueError) as error:
    jaxaccum.dp_epsilon(0.01, 1.0, 0, 1e-5)
  assert message(error) == (
    "steps must be an integer >= 1, the noise draws so far, got steps=0: "
    "before the first step nothing was released and there is no epsilon to "
    "report."
  )


def test_pld_settings_that_would_exhaust_memory_are_refused_before_allocating():
  """sigma = 1e-3 asked dp-accounting for 38 GiB. Run in a process whose
  address space may grow by 2 GiB at most, so that the test cannot take the
  machine's memory if the check is missing (it then fails on MemoryError)."""
  code = (
    "import resource, jaxaccum\n"
    "status = open('/proc/self/status').read().split('VmSize:')[1]\n"
    "limit = int(status.split()[0]) * 1024 + 2 * 2**30\n"
    "resource.setrlimit(resource.RLIMIT_AS, (limit, limit))\n"
    "try:\n"
    "  jaxaccum.dp_epsilon(0.01, 1e-3, 100, 1e-5)\n"
    "except ValueError as error:\n"
    "  print(error)\n"
  )
  out = subprocess.run(
    [sys.executable, "-c", code],
    check=False,
    capture_output=True,
    text=True,
    timeout=300,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert out.stdout.startswith(
    "The PLD accountant at noise_multiplier=0.001 and "
    "value_discretization_interval=0.0001 would discretize about 1e+10 "
    "privacy loss values"
  ), out.stderr[-2000:]
  assert "Pass value_discretization_interval=0.21 or coarser" in out.stdout
  assert 'or accountant="rdp".' in out.stdout


def test_the_suggested_pld_grid_fits_and_rdp_is_not_limited():
  assert _privacy.pld_points(1e-3, 0.21) <= _privacy.PLD_MAX_POINTS
  assert _privacy.pld_points(1.0, 1e-4) <= _privacy.PLD_MAX_POINTS
  assert jaxaccum.dp_epsilon(0.01, 1e-3, 10, 1e-5, accountant="rdp") > 1e3


# ------------------------------------------------- eval-mode BatchNorm


class BatchNormNet(nnx.Module):
  def __init__(self, rngs, train):
    self.hidden = nnx.Linear(F, 4, rngs=rngs)
    self.norm = nnx.BatchNorm(4, use_running_average=not train, rngs=rngs)
    self.out = nnx.Linear(4, 1, rngs=rngs)

  def __call__(self, x):
    return self.out(jnp.tanh(self.norm(self.hidden(x))))[0]


def bn_loss(model, example):
  x, y = example
  return (model(x) - y) ** 2


@pytest.mark.slow
def test_eval_mode_batchnorm_is_per_example_and_allowed():
  model = BatchNormNet(nnx.Rngs(0), train=False)
  model.norm.mean[...] = jnp.array([0.1, -0.2, 0.3, 0.0])
  model.norm.var[...] = jnp.array([1.5, 0.5, 2.0, 1.0])
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  batch = data()

  def pure(p, example):
    return bn_loss(nnx.merge(graphdef, p, rest), example)

  per_example = jax.vmap(jax.grad(pure), in_axes=(None, 0))(params, batch)
  leaves = jax.tree.leaves(per_example)
  norms = jnp.sqrt(sum(jnp.sum(g.reshape(B, -1) ** 2, axis=1) for g in leaves))
  factor = jnp.minimum(1.0, C / norms)
  assert 0 < int(jnp.sum(norms > C)) < B
  want = jax.tree.map(lambda g: jnp.tensordot(factor, g, axes=(0, 0)), per_example)
  grads = jaxaccum.nnx.grad(bn_loss, 4, normalize="sum", clip_per_example=C)(
    model, batch
  )
  for g, v in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, v, atol=1e-5)
  np.testing.assert_array_equal(model.norm.mean[...], np.float32([0.1, -0.2, 0.3, 0.0]))


def test_train_mode_batchnorm_is_still_refused():
  model = BatchNormNet(nnx.Rngs(0), train=True)
  fun = jaxaccum.nnx.grad(bn_loss, 2, clip_per_example=C)
  with pytest.raises(ValueError, match=r"fun changed 2 of the 2 variables"):
    fun(model, data())
