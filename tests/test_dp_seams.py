"""DP-SGD where two features meet (issue 44): each seam used to train
normally while the epsilon it reports was wrong, and is now accepted with its
epsilon right or refused at trace time, naming the fix.

- A loss that closes over an array traced by an enclosing ``jit`` (the batch
  itself: a hand-written BatchNorm over its mean and std, in-batch
  contrastive negatives, Linen's ``BatchNorm`` in training mode) carried
  every example into every example's loss; the clipped sum moved by 14 C at
  B = 16 where the bound is C.
- ``normalize="weighted"`` with ``dp_noise(normalize="fixed")`` (and
  ``accumulate(..., weight=)``) divided the noise by the batch's private
  total weight, which the update's norm gives away. Every combination of the
  step's ``normalize``, the noise's ``normalize``, ``weight=`` and the
  sampling is one test below, accepted with its update checked against DP-SGD
  by hand, or refused (the table in ``docs/privacy.md``).
- A ``ClipRecord`` fed twice, or not made by a clipped step; clipping with no
  noise anywhere; the count of changed variables.
"""

import warnings

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import linen as nn
from flax import nnx

import jaxaccum

B, F, H = 16, 3, 4
C = 0.5
EPS = float(jnp.finfo(jnp.float32).eps)
METHODS = ["vmap", "ghost"]


def params0():
  k1, k2 = jax.random.split(jax.random.key(0))
  return {
    "w1": jax.random.normal(k1, (F, H)),
    "w2": jax.random.normal(k2, (H,)) / 2,
    "scale": jnp.ones(H),
    "bias": jnp.zeros(H),
  }


def data(seed=1, rows=B):
  x = jax.random.normal(jax.random.key(seed), (rows, F))
  return x, jnp.sin(3 * x[:, 0]) + x[:, 1]


def example_loss(p, example):
  x, y = example
  return (jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2


def clipped_sum(loss, params, batch, mask=None, clip=C):
  """The reference: each example's gradient by one vmap over the batch,
  clipped over all leaves together, masked rows dropped, summed."""
  grads = jax.vmap(jax.grad(loss), in_axes=(None, 0))(params, batch)
  leaves = jax.tree.leaves(grads)
  norms = jnp.sqrt(sum(jnp.sum(g.reshape(g.shape[0], -1) ** 2, axis=1) for g in leaves))
  factor = jnp.minimum(1.0, clip / norms)
  if mask is not None:
    factor = jnp.where(mask > 0, factor, 0.0)
  return jax.tree.map(lambda g: jnp.tensordot(factor, g, axes=(0, 0)), grads)


def tolerance(n, clip=C):
  """A float32 sum of n terms of norm <= clip: n roundings of at most n*clip."""
  return 2 * n * n * EPS * clip


def assert_tree_close(got, want, atol):
  chex.assert_trees_all_close(got, want, atol=atol, rtol=0)


# ------------------------------------------------ losses that close over the batch


def hand_batchnorm(xs):
  """Normalizes the example by the closed-over batch's mean and std."""

  def loss(p, example):
    x, y = example
    h = (x - jnp.mean(xs, 0)) / (jnp.std(xs, 0) + 1e-3)
    return (jnp.tanh(h @ p["w1"]) @ p["w2"] - y) ** 2

  return loss


def contrastive(xs):
  """In-batch negatives: the example's embedding against every row's."""

  def loss(p, example):
    x, _ = example
    z, zs = jnp.tanh(x @ p["w1"]), jnp.tanh(xs @ p["w1"])
    return jax.nn.logsumexp(zs @ z) - z @ z

  return loss


BN = nn.BatchNorm(use_running_average=False)
BN_STATS = {"mean": jnp.zeros(H), "var": jnp.ones(H)}  # a constant: allowed


def linen_batchnorm(xs):
  """Linen's BatchNorm in training mode, over the example and the closed-over
  batch, as a model that normalizes over its batch would."""

  def loss(p, example):
    x, y = example
    h = jnp.concatenate([x[None], xs]) @ p["w1"]
    variables = {
      "params": {"scale": p["scale"], "bias": p["bias"]},
      "batch_stats": BN_STATS,
    }
    normed, _ = BN.apply(variables, h, mutable=["batch_stats"])
    return (jnp.tanh(normed[0]) @ p["w2"] - y) ** 2

  return loss


CLOSURES = {
  "hand-written BatchNorm": hand_batchnorm,
  "contrastive negatives": contrastive,
  "Linen BatchNorm in training mode": linen_batchnorm,
}
CLOSED_OVER = r"fun closes over an array of shape=\(16, 3\) and dtype=float32"


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("closure", list(CLOSURES))
def test_a_loss_closing_over_the_traced_batch_is_refused(closure, method):
  make_loss = CLOSURES[closure]

  @jax.jit
  def step(params, x, y):
    fun = jaxaccum.value_and_grad(
      make_loss(x), 2, clip_per_example=C, clip_method=method, clip_without_noise=True
    )
    return fun(params, (x, y))

  with pytest.raises(ValueError, match=CLOSED_OVER) as error:
    step(params0(), *data())
  got = str(error.value)
  assert "it may hold other examples" in got
  assert "public_argnums=" in got and "batch_argnums" in got


def noisy_tx(sigma=1.0):
  return optax.chain(
    jaxaccum.dp_noise(sigma, C, jax.random.key(0), normalize="fixed"), optax.sgd(0.1)
  )


@pytest.mark.parametrize("method", METHODS)
def test_make_train_step_refuses_a_loss_closing_over_the_traced_batch(method):
  tx = noisy_tx()

  @jax.jit
  def outer(params, opt_state, x, y):
    step = jaxaccum.make_train_step(
      contrastive(x), tx, 2, clip_per_example=C, clip_method=method, donate=False
    )
    return step(params, opt_state, (x, y))

  with pytest.raises(ValueError, match=CLOSED_OVER):
    outer(params0(), tx.init(params0()), *data())


class NnxNet(nnx.Module):
  def __init__(self, rngs):
    self.hidden = nnx.Linear(F, H, rngs=rngs)
    self.out = nnx.Linear(H, 1, rngs=rngs)

  def __call__(self, x):
    return self.out(jnp.tanh(self.hidden(x)))[0]


@pytest.mark.parametrize("method", METHODS)
def test_nnx_refuses_a_loss_closing_over_the_traced_batch(method):
  model = NnxNet(nnx.Rngs(0))

  @nnx.jit
  def step(model, x, y):
    def loss(model, example):
      xi, yi = example
      return (model((xi - jnp.mean(x, 0)) / jnp.std(x, 0)) - yi) ** 2

    fun = jaxaccum.nnx.value_and_grad(
      loss, 2, clip_per_example=C, clip_method=method, clip_without_noise=True
    )
    return fun(model, (x, y))

  with pytest.raises(ValueError, match=CLOSED_OVER):
    step(model, *data())


@pytest.mark.parametrize("method", METHODS)
def test_nnx_train_step_refuses_a_loss_closing_over_the_traced_batch(method):
  model = NnxNet(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, noisy_tx(), wrt=nnx.Param)

  @nnx.jit
  def outer(model, optimizer, x, y):
    def loss(model, example):
      xi, _ = example
      negatives = jax.vmap(model)(x)  # every row of the batch, closed over
      return jax.nn.logsumexp(negatives * model(xi))

    step = jaxaccum.nnx.make_train_step(
      loss, optimizer, 2, clip_per_example=C, clip_method=method, donate=False
    )
    return step(model, (x, y))

  with pytest.raises(ValueError, match=CLOSED_OVER):
    outer(model, optimizer, *data())


@pytest.mark.parametrize("method", METHODS)
def test_an_equinox_model_closing_over_the_traced_batch_is_refused(method):
  model = eqx.nn.MLP(F, "scalar", H, 1, key=jax.random.key(0))

  @eqx.filter_jit
  def step(model, x, y):
    def loss(model, example):
      xi, yi = example
      return (model((xi - jnp.mean(x, 0)) / jnp.std(x, 0)) - yi) ** 2

    fun = jaxaccum.value_and_grad(
      loss, 2, clip_per_example=C, clip_method=method, clip_without_noise=True
    )
    return fun(model, (x, y))

  with pytest.raises(ValueError, match=CLOSED_OVER):
    step(model, *data())


@pytest.mark.parametrize("method", METHODS)
def test_a_concrete_array_closed_over_inside_jit_is_a_constant_and_allowed(method):
  table = jnp.linspace(-1.0, 1.0, F)  # concrete: no example in it

  def loss(p, example):
    x, y = example
    return example_loss(p, (x * table, y))

  params, batch = params0(), data()
  fun = jaxaccum.grad(
    loss,
    2,
    normalize="sum",
    clip_per_example=C,
    clip_method=method,
    clip_without_noise=True,
  )
  got = jax.jit(fun)(params, batch)
  assert_tree_close(got, clipped_sum(loss, params, batch), tolerance(B))


@pytest.mark.parametrize("method", METHODS)
def test_parameters_closed_over_outside_jit_are_constants_and_allowed(method):
  frozen = params0()  # a frozen encoder's weights, closed over eagerly

  def loss(head, example):
    x, y = example
    return (jnp.tanh(x @ frozen["w1"]) @ head - y) ** 2

  head, batch = jnp.full(H, 0.3), data()
  fun = jaxaccum.grad(
    loss,
    2,
    normalize="sum",
    clip_per_example=C,
    clip_method=method,
    clip_without_noise=True,
  )
  assert_tree_close(fun(head, batch), clipped_sum(loss, head, batch), tolerance(B))


# ----------------------------------------------------- the count of changed variables


class BatchNormNet(nnx.Module):
  def __init__(self, rngs):
    self.hidden = nnx.Linear(F, H, rngs=rngs)
    self.norm = nnx.BatchNorm(H, use_running_average=False, rngs=rngs)
    self.out = nnx.Linear(H, 1, rngs=rngs)

  def __call__(self, x):
    return self.out(jnp.tanh(self.norm(self.hidden(x[None]))))[0, 0]


@pytest.mark.parametrize("method", METHODS)
def test_a_model_that_changes_its_variables_is_named_with_the_right_count(method):
  """Ghost clipping traces fun twice (the norms, then the clipped sum), and
  the count was summed over the traces: "changed 4 of the 2 variables"."""

  def loss(model, example):
    x, y = example
    return (model(x) - y) ** 2

  fun = jaxaccum.nnx.grad(
    loss, 2, clip_per_example=C, clip_method=method, clip_without_noise=True
  )
  with pytest.raises(ValueError, match=r"fun changed 2 of the 2 variables"):
    fun(BatchNormNet(nnx.Rngs(0)), data())


# ------------------------------------------------------- clipping without noise


def without_noise(caught):
  return [w for w in caught if issubclass(w.category, jaxaccum.ClipWithoutNoiseWarning)]


def count_warnings(build_and_run):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    build_and_run()
  return without_noise(caught)


@pytest.mark.parametrize(
  "make",
  [
    lambda **kw: jaxaccum.value_and_grad(example_loss, 2, **kw),
    lambda **kw: jaxaccum.grad(example_loss, 2, **kw),
    lambda **kw: jaxaccum.nnx.value_and_grad(lambda m, e: m(e[0]) ** 2, 2, **kw),
    lambda **kw: jaxaccum.nnx.grad(lambda m, e: m(e[0]) ** 2, 2, **kw),
  ],
  ids=["value_and_grad", "grad", "nnx.value_and_grad", "nnx.grad"],
)
def test_a_clipped_gradient_that_cannot_reach_dp_noise_warns_once(make):
  caught = count_warnings(lambda: make(clip_per_example=C))
  assert len(caught) == 1
  assert "without clip_record=True" in str(caught[0].message)
  assert "Clipping alone gives no privacy" in str(caught[0].message)
  assert not count_warnings(lambda: make(clip_per_example=C, clip_record=True))
  assert not count_warnings(lambda: make(clip_per_example=C, clip_without_noise=True))
  assert not count_warnings(make)  # no clipping: nothing to say


def test_clip_without_noise_needs_clip_per_example():
  with pytest.raises(ValueError, match="it needs clip_per_example=C"):
    jaxaccum.grad(example_loss, 2, clip_without_noise=True)


@pytest.mark.parametrize(
  ("tx", "flag", "want"),
  [("sgd", False, 1), ("dp_noise", False, 0), ("sgd", True, 0)],
)
def test_a_train_step_without_dp_noise_warns_once_and_only_once(tx, flag, want):
  params, batch = params0(), data()
  tx = noisy_tx() if tx == "dp_noise" else optax.sgd(0.1)

  def run():
    step = jaxaccum.make_train_step(
      example_loss, tx, 2, clip_per_example=C, clip_without_noise=flag, donate=False
    )
    opt_state = tx.init(params)
    step(params, opt_state, batch)
    step(params, opt_state, jax.tree.map(lambda x: x[:8], batch))  # a retrace

  caught = count_warnings(run)
  assert len(caught) == want
  if want:
    assert "its optimizer holds no jaxaccum.dp_noise" in str(caught[0].message)


@pytest.mark.parametrize(("tx", "want"), [("sgd", 1), ("dp_noise", 0)])
def test_an_nnx_train_step_without_dp_noise_warns_once(tx, want):
  model = NnxNet(nnx.Rngs(0))
  tx = noisy_tx() if tx == "dp_noise" else optax.sgd(0.1)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  def loss(model, example):
    x, y = example
    return (model(x) - y) ** 2

  def run():
    step = jaxaccum.nnx.make_train_step(loss, optimizer, 2, clip_per_example=C)
    step(model, data())
    step(model, data())

  caught = count_warnings(run)
  assert len(caught) == want


def test_accumulate_given_a_record_without_dp_noise_warns_once():
  grad = jaxaccum.grad(
    example_loss, 1, normalize="sum", clip_per_example=C, clip_record=True
  )
  params, (x, y) = params0(), data()
  tx = jaxaccum.accumulate(optax.sgd(0.1), 2)

  def run():
    state = tx.init(params)
    for i in range(4):
      rows = slice(4 * i, 4 * (i + 1))
      _, state = tx.update(grad(params, (x[rows], y[rows])), state, params)

  caught = count_warnings(run)
  assert len(caught) == 1
  assert "its inner optimizer holds no jaxaccum.dp_noise" in str(caught[0].message)
