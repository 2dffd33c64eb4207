"""DP-SGD where two features meet (issue 44): each seam used to train
normally while the epsilon it reports was wrong, and is now accepted with its
epsilon right or refused at trace time, naming the fix.

- A loss that closes over an array traced by an enclosing ``jit`` (the batch
  itself: a hand-written BatchNorm over its mean and std, in-batch
  contrastive negatives, Linen's ``BatchNorm`` in training mode) carried
  every example into every example's loss (in the issue's check, the clipped
  sum moved by 14 C at B = 16 where the bound is C).
- ``normalize="weighted"`` with ``dp_noise(normalize="fixed")`` (and
  ``accumulate(..., weight=)``) divided the noise by the batch's private
  total weight, which the update's norm gives away. Every combination of the
  step's ``normalize`` (or ``accumulate``'s ``weight=``) and ``dp_noise``'s
  ``normalize`` and ``expected_weight`` is one test below, accepted with its
  update checked against DP-SGD by hand, or refused (the table in
  ``docs/privacy.md``); the sampling, which jaxaccum does not see, decides
  the epsilon, and ``dp_epsilon``'s two samplings are tested last.
- A ``ClipRecord`` fed twice, or not made by a clipped step; clipping with no
  noise anywhere; the count of changed variables.
"""

import warnings

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
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


# ------------------------------------ the noise's denominator: every combination

SIGMA, EBS, EW = 0.8, 12.0, 40.0  # expected examples, expected total weight
MASK = (jnp.arange(B) % 4 != 3).astype(jnp.float32)  # 12 real rows of 16
TOKENS = jnp.arange(B) % 5 + 1.0  # each example's weight (its token count)

NOISES = {
  "poisson": {"normalize": "poisson", "expected_batch_size": EBS},
  "poisson+expected_weight": {"normalize": "poisson", "expected_weight": EW},
  "fixed": {"normalize": "fixed"},
  "fixed+expected_weight": {"normalize": "fixed", "expected_weight": EW},
}


def weighted_loss(p, example):
  """One example's (loss_sum, weight): the loss does not read the weight, so
  that a weight changed alone must not change the update."""
  x, y, w = example
  return example_loss(p, (x, y)), w


def dp_sgd_by_hand(params, batch, mask, key, divide_by, *, loss=example_loss):
  """DP-SGD by hand: the clipped sum of the masked rows, plus dp_noise's
  first draw (``fold_in(key, 0)``, leaf i from ``split(.., n)[i]``), divided
  by ``divide_by``, one SGD step of rate 1."""
  total = clipped_sum(loss, params, batch, mask)
  leaves, treedef = jax.tree.flatten(total)
  keys = jax.random.split(jax.random.fold_in(key, 0), len(leaves))
  noisy = [
    (g + SIGMA * C * jax.random.normal(k, g.shape)) / divide_by
    for g, k in zip(leaves, keys, strict=True)
  ]
  return jax.tree.map(lambda p, g: p - g, params, jax.tree.unflatten(treedef, noisy))


COUNT = object()  # the count of real examples, public at a fixed batch size
WEIGHTED_PRIVATE = "which is private"
FOR_WEIGHTED = "is the public denominator of weighted"
STEP_TABLE = [  # (the step's normalize, dp_noise, the denominator or the error)
  ("mean", "poisson", EBS),
  ("mean", "poisson+expected_weight", FOR_WEIGHTED),
  ("mean", "fixed", COUNT),
  ("mean", "fixed+expected_weight", FOR_WEIGHTED),
  ("sum", "poisson", EBS),
  ("sum", "poisson+expected_weight", FOR_WEIGHTED),
  ("sum", "fixed", 'the step\'s normalize="sum" divides by nothing'),
  ("sum", "fixed+expected_weight", FOR_WEIGHTED),
  ("weighted", "poisson", WEIGHTED_PRIVATE),
  ("weighted", "poisson+expected_weight", EW),
  ("weighted", "fixed", WEIGHTED_PRIVATE),  # divided by the private weight
  ("weighted", "fixed+expected_weight", EW),
]


@pytest.mark.parametrize(
  ("normalize", "noise", "want"),
  STEP_TABLE,
  ids=[f"{n} step, dp_noise {z}" for n, z, _ in STEP_TABLE],
)
def test_each_train_step_cell_is_dp_sgd_over_a_public_number_or_refused(
  normalize, noise, want
):
  key = jax.random.key(7)
  tx = optax.chain(jaxaccum.dp_noise(SIGMA, C, key, **NOISES[noise]), optax.sgd(1.0))
  weighted = normalize == "weighted"
  loss = weighted_loss if weighted else example_loss
  step = jaxaccum.make_train_step(
    loss, tx, 2, normalize=normalize, clip_per_example=C, donate=False
  )
  params, (x, y) = params0(), data()
  batch = (x, y, TOKENS) if weighted else (x, y)
  if isinstance(want, str):
    with pytest.raises(ValueError, match=want) as error:
      step(params, tx.init(params), batch, example_mask=MASK)
    if weighted:
      assert "expected_weight=W" in str(error.value)
    return
  new, opt_state, _ = step(params, tx.init(params), batch, example_mask=MASK)
  divide_by = float(MASK.sum()) if want is COUNT else want
  per_example = (lambda p, e: loss(p, e)[0]) if weighted else loss
  want_params = dp_sgd_by_hand(params, batch, MASK, key, divide_by, loss=per_example)
  assert_tree_close(new, want_params, tolerance(B) + 1e-6)
  assert int(opt_state[0].draws) == 1


ACCUMULATE_TABLE = [  # (weight= given, dp_noise, the denominator or the error)
  (False, "poisson", EBS),
  (False, "poisson+expected_weight", "pass each call's weight="),
  (False, "fixed", COUNT),
  (False, "fixed+expected_weight", "pass each call's weight="),
  (True, "poisson", WEIGHTED_PRIVATE),  # the weights were silently unused
  (True, "poisson+expected_weight", EW),
  (True, "fixed", WEIGHTED_PRIVATE),  # divided by the private weight
  (True, "fixed+expected_weight", EW),
]


def accumulated(noise, weights, key=None, k=4):
  """One window of accumulate(chain(dp_noise, sgd(1)), k) fed the clipped
  sums of the micro-batches of (data(), MASK), with ``weights`` (one per
  call) as weight= when given; the parameters after it."""
  key = jax.random.key(11) if key is None else key
  tx = jaxaccum.accumulate(
    optax.chain(jaxaccum.dp_noise(SIGMA, C, key, **NOISES[noise]), optax.sgd(1.0)),
    k,
  )
  grad = jaxaccum.grad(
    example_loss, 1, normalize="sum", clip_per_example=C, clip_record=True
  )
  params, batch, m = params0(), data(), B // k
  state = tx.init(params)
  for i in range(k):
    rows = slice(i * m, (i + 1) * m)
    record = grad(
      params, jax.tree.map(lambda x, r=rows: x[r], batch), example_mask=MASK[rows]
    )
    kwargs = {} if weights is None else {"weight": weights[i]}
    updates, state = tx.update(record, state, params, **kwargs)
  return optax.apply_updates(params, updates), state


@pytest.mark.parametrize(
  ("weighted", "noise", "want"),
  ACCUMULATE_TABLE,
  ids=[
    f"accumulate {'with' if w else 'without'} weight=, dp_noise {z}"
    for w, z, _ in ACCUMULATE_TABLE
  ],
)
def test_each_accumulate_cell_is_dp_sgd_over_a_public_number_or_refused(
  weighted, noise, want
):
  weights = (
    jnp.sum(TOKENS.reshape(4, -1) * MASK.reshape(4, -1), 1) if weighted else None
  )
  if isinstance(want, str):
    with pytest.raises(ValueError, match=want):
      accumulated(noise, weights)
    return
  new, state = accumulated(noise, weights)
  divide_by = float(MASK.sum()) if want is COUNT else want
  params, batch = params0(), data()
  want_params = dp_sgd_by_hand(params, batch, MASK, jax.random.key(11), divide_by)
  assert_tree_close(new, want_params, tolerance(B) + 1e-6)
  assert int(state.step) == 1


@pytest.mark.parametrize("noise", ["poisson+expected_weight", "fixed+expected_weight"])
def test_the_private_total_weight_enters_no_update_of_a_weighted_step(noise):
  """The leak: an update divided by the batch's total weight W has norm
  about sigma C |z| / W, and told one extra token in one example apart in
  200 of 200 draws at sigma = 10. Under a public denominator the update is
  the same, bit for bit, whatever the weights (one more token, a zero, a
  NaN, all zero: a batch the weighted step would skip)."""
  tx = optax.chain(
    jaxaccum.dp_noise(SIGMA, C, jax.random.key(3), **NOISES[noise]), optax.sgd(1.0)
  )
  step = jaxaccum.make_train_step(
    weighted_loss, tx, 2, normalize="weighted", clip_per_example=C, donate=False
  )
  params, (x, y) = params0(), data()
  opt_state = tx.init(params)

  def update(tokens):
    return step(params, opt_state, (x, y, tokens), example_mask=MASK)[0]

  want = update(TOKENS)
  for tokens in (
    TOKENS.at[0].add(1.0),
    TOKENS.at[5].set(0.0),
    TOKENS.at[5].set(jnp.nan),
    jnp.zeros(B),
  ):
    chex.assert_trees_all_equal(update(tokens), want)
  assert not np.allclose(want["w1"], params["w1"])  # a step, not a skip


def test_the_private_weights_enter_no_update_of_a_weighted_window():
  """accumulate(..., weight=) under a public denominator: the window's update
  is the same whatever the weights, and a micro-batch is not dropped for a
  weight that is not finite (that would drop its examples' clipped sums)."""
  want, _ = accumulated("fixed+expected_weight", jnp.array([3.0, 4.0, 5.0, 6.0]))
  for weights in (jnp.array([3.0, 4.0, 6.0, 6.0]), jnp.array([3.0, 0.0, jnp.nan, 6.0])):
    got, state = accumulated("fixed+expected_weight", weights)
    chex.assert_trees_all_equal(got, want)
    assert int(state.num_skipped) == 0


# ------------------------------------------------------------- ClipRecord's checks

USED_TWICE = "was given to an update before"


def record_maker():
  return jaxaccum.grad(
    example_loss, 1, normalize="sum", clip_per_example=C, clip_record=True
  )


def noisy_window(k=4):
  return jaxaccum.accumulate(noisy_tx(), k)


def micro_batch(i, m=4):
  return jax.tree.map(lambda x: x[i * m : (i + 1) * m], data())


def test_a_record_fed_twice_to_an_eager_accumulate_is_refused():
  grad, tx, params = record_maker(), noisy_window(), params0()
  record = grad(params, micro_batch(0))
  state = tx.init(params)
  _, state = tx.update(record, state, params)
  with pytest.raises(ValueError, match=USED_TWICE):
    tx.update(record, state, params)
  _, state = tx.update(grad(params, micro_batch(1)), state, params)  # a new one
  assert int(state.micro_step) == 2


def test_a_record_fed_twice_to_a_jitted_accumulate_is_refused_before_any_result():
  grad, tx, params = record_maker(), noisy_window(k=2), params0()
  update = jax.jit(tx.update)
  record = grad(params, micro_batch(0))
  _, state = update(record, tx.init(params), params)
  with pytest.raises(jax.errors.JaxRuntimeError, match=USED_TWICE):
    updates, after = update(record, state, params)  # it would end the window
    jax.block_until_ready((updates, after))
  assert int(state.micro_step) == 1  # what the caller holds is the state before


def test_a_record_used_twice_inside_one_jitted_function_is_refused():
  grad, tx, params = record_maker(), noisy_window(), params0()

  @jax.jit
  def twice(params, state, batch):
    record = grad(params, batch)
    _, state = tx.update(record, state, params)
    return tx.update(record, state, params)

  with pytest.raises(jax.errors.JaxRuntimeError, match=USED_TWICE):
    jax.block_until_ready(twice(params, tx.init(params), micro_batch(0)))


def test_a_record_closed_over_by_a_jitted_update_is_taken_on_every_run():
  """Taken at trace time, a constant record would be taken once for any
  number of runs of the compiled update."""
  grad, tx, params = record_maker(), noisy_window(), params0()
  record = grad(params, micro_batch(0))
  update = jax.jit(lambda state: tx.update(record, state, params))
  _, state = update(tx.init(params))
  with pytest.raises(jax.errors.JaxRuntimeError, match=USED_TWICE):
    jax.block_until_ready(update(state))


def test_a_record_given_twice_to_dp_noise_itself_is_refused():
  grad, params = (
    jaxaccum.grad(example_loss, 2, clip_per_example=C, clip_record=True),
    params0(),
  )
  tx = noisy_tx()
  record = grad(params, data())
  _, state = tx.update(record.grads, tx.init(params), params, clip_record=record)
  with pytest.raises(ValueError, match=USED_TWICE):
    tx.update(record.grads, state, params, clip_record=record)


def test_records_made_by_a_jitted_step_fed_once_each_in_any_order_are_taken():
  """Each run of a compiled step gets its own serial (a host callback, not a
  constant of the trace), and the order they are fed in does not matter."""
  grad, tx, params = jax.jit(record_maker()), noisy_window(k=3), params0()
  same = micro_batch(0)
  records = [grad(params, same), grad(params, same), grad(params, micro_batch(1))]
  update = jax.jit(tx.update)
  state = tx.init(params)
  for record in reversed(records):
    updates, state = update(record, state, params)
  assert int(state.step) == 1
  assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))


def test_a_record_built_by_hand_is_refused():
  params = params0()
  grads = jax.tree.map(jnp.ones_like, params)
  forged = jaxaccum.ClipRecord(grads, jnp.float32(1), jnp.float32(4), C, "sum")
  tx = noisy_window()
  with pytest.raises(ValueError, match="that no clipped step made"):
    tx.update(forged, tx.init(params), params)
  noise = noisy_tx()
  with pytest.raises(ValueError, match="that no clipped step made"):
    noise.update(grads, noise.init(params), params, clip_record=forged)


# ---------------------------------------- the epsilon of fixed-size batches


@pytest.mark.parametrize(
  ("rate", "sigma", "steps"), [(0.01, 1.1, 1000), (0.1, 2.0, 50)]
)
def test_fixed_size_batches_are_accounted_for_by_dp_accountings_own_event(
  rate, sigma, steps
):
  """Batches of B = q N drawn without replacement, replace-one adjacency: the
  sum's sensitivity is 2 C, so the Gaussian event's multiplier is sigma / 2."""
  import dp_accounting  # noqa: PLC0415

  n = 10_000
  counter = dp_accounting.rdp.RdpAccountant(
    neighboring_relation=dp_accounting.privacy_accountant.NeighboringRelation.REPLACE_ONE
  )
  event = dp_accounting.SampledWithoutReplacementDpEvent(
    n, round(rate * n), dp_accounting.GaussianDpEvent(sigma / 2)
  )
  counter.compose(dp_accounting.SelfComposedDpEvent(event, steps))
  want = counter.get_epsilon(1e-5)
  got = jaxaccum.dp_epsilon(rate, sigma, steps, 1e-5, sampling="fixed", num_examples=n)
  assert got == want
  # Replace-one is the weaker guarantee at the same sigma and rate.
  assert got > jaxaccum.dp_epsilon(rate, sigma, steps, 1e-5, accountant="rdp")


def test_the_whole_data_set_as_one_fixed_batch_is_the_gaussian_at_half_sigma():
  """At B = N every step is the whole data set, under either sampling:
  replace-one at sigma is add-or-remove-one at sigma / 2 (another event and
  another code path in dp-accounting)."""
  fixed = jaxaccum.dp_epsilon(1.0, 2.0, 3, 1e-5, sampling="fixed", num_examples=100)
  poisson = jaxaccum.dp_epsilon(1.0, 1.0, 3, 1e-5, accountant="rdp")
  np.testing.assert_allclose(fixed, poisson, rtol=1e-12)


@pytest.mark.parametrize(
  ("kwargs", "want"),
  [
    ({}, "sampling='fixed' needs num_examples=N"),
    ({"num_examples": 1001}, "must be a whole number"),
    ({"num_examples": 1000, "accountant": "pld"}, "Rényi DP accountant only"),
  ],
)
def test_fixed_size_accounting_arguments_are_named(kwargs, want):
  with pytest.raises(ValueError, match=want):
    jaxaccum.dp_epsilon(0.01, 1.0, 10, 1e-5, sampling="fixed", **kwargs)
