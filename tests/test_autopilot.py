"""The batch-size autopilot, ``accumulate(inner, jaxaccum.auto_k(...))`` (issue 20).

The reference is linear regression, where the gradient noise scale is known
in closed form. With ``y = x . w* + e``, ``x ~ N(0, I_d)``, ``e ~ N(0, s^2)``
and the per-example loss ``(x . w - y)^2 / 2``, at ``d = w - w*``:

- the true gradient is ``G = d``;
- the per-example gradient ``x (x . d - e)`` has
  ``tr(Sigma) = (d + 1) |d|^2 + d s^2`` (Gaussian fourth moments);

so ``B_simple = tr(Sigma) / |G|^2 = (dim + 1) + dim s^2 / |d|^2``, which grows
as ``w`` approaches ``w*``.
"""

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum

DIM, SIGMA, M = 8, 1.0, 2  # features, label noise, rows per micro-batch


def closed_form_b_simple(distance_sq):
  return (DIM + 1) + DIM * SIGMA**2 / distance_sq


def loss(w, batch):
  x, y = batch
  return jnp.mean((x @ w - y) ** 2) / 2


def micro_batch(key, w_star):
  kx, ke = jax.random.split(key)
  x = jax.random.normal(kx, (M, DIM))
  return x, x @ w_star + SIGMA * jax.random.normal(ke, (M,))


def run_windows(tx, w, calls, seed=0, train=False):
  """``calls`` micro-batches through ``tx``, inside one jitted scan (the
  window length is a value in the state: one trace serves them all)."""
  w_star = jnp.zeros(DIM)

  @jax.jit
  def go(w, state):
    def body(carry, key):
      w, state = carry
      grads = jax.grad(loss)(w, micro_batch(key, w_star))
      updates, state = tx.update(grads, state, w)
      if train:
        w = optax.apply_updates(w, updates)
      return (w, state), jaxaccum.window_size(state)

    keys = jax.random.split(jax.random.key(seed), calls)
    return jax.lax.scan(body, (w, state), keys)

  return go(w, tx.init(w))


@pytest.mark.parametrize("distance_sq", [1.0, 0.25])
def test_the_window_follows_the_closed_form_noise_scale(distance_sq):
  """Parameters held still (sgd(0)): after warm-up the window is the closed
  form's B_simple in micro-batches, within 25%."""
  tx = jaxaccum.accumulate(optax.sgd(0.0), jaxaccum.auto_k(max_k=64, horizon=20))
  w = jnp.full(DIM, np.sqrt(distance_sq / DIM))
  (_, state), sizes = run_windows(tx, w, 3000)
  want = closed_form_b_simple(distance_sq) / M
  got = float(state.window_size)
  assert abs(got - want) <= 0.25 * want, (got, want, sizes[-10:])
  smoothed = float(state.autopilot.b_simple)
  assert abs(smoothed - want) <= 0.25 * want, (smoothed, want)


def test_the_window_grows_as_the_parameters_approach_the_optimum():
  tx = jaxaccum.accumulate(optax.sgd(0.05), jaxaccum.auto_k(max_k=64, horizon=5))
  w = jnp.full(DIM, 1.0)
  (w, state), sizes = run_windows(tx, w, 3000, train=True)
  sizes = np.asarray(sizes)
  assert np.all(np.diff(sizes) >= 0), "it never shrinks by default"
  assert sizes[-1] > 4 * sizes[0], (sizes[0], sizes[-1])
  # ... and it follows the closed form at the parameters reached (the
  # smoothed estimate lags a moving target: 50%).
  want = closed_form_b_simple(float(jnp.sum(w**2))) / M
  assert abs(float(state.autopilot.b_simple) - want) <= 0.5 * want


@pytest.mark.slow
@pytest.mark.parametrize(("min_k", "max_k"), [(2, 3), (5, 7)])
def test_min_k_and_max_k_are_respected(min_k, max_k):
  tx = jaxaccum.accumulate(optax.sgd(0.0), jaxaccum.auto_k(min_k=min_k, max_k=max_k))
  w = jnp.full(DIM, 0.1)  # B_simple far above max_k
  (_, _state), sizes = run_windows(tx, w, 400)
  sizes = np.asarray(sizes)
  assert sizes.min() == min_k and sizes.max() == max_k


@pytest.mark.slow
def test_growth_per_window_is_capped_and_warmup_holds_the_first_windows():
  auto = jaxaccum.auto_k(max_k=64, growth=1.5, warmup=3)
  tx = jaxaccum.accumulate(optax.sgd(0.0), auto)
  (_, _state), sizes = run_windows(tx, jnp.full(DIM, 0.05), 600)
  # One entry per call: collapse to one per window.
  windows = [int(k) for k, prev in zip(sizes[1:], sizes[:-1], strict=True) if k != prev]
  lengths = [2, *windows]
  assert lengths[:2] == [2, 3], lengths  # held for 3 measured windows, then +50%
  for a, b in itertools.pairwise(lengths):
    assert b <= max(int(a * 1.5), a + 1), lengths


def test_a_shrinking_window_stays_at_or_above_min_k():
  """Far from the optimum B_simple is about 4.6 micro-batches, below
  min_k=8: with shrink=True the window still never drops below min_k
  (mutmut: _autopilot.AutoK.next_window, whose clip to min_k survived)."""
  auto = jaxaccum.auto_k(min_k=8, max_k=32, shrink=True, warmup=1)
  tx = jaxaccum.accumulate(optax.sgd(0.0), auto)
  (_, state), sizes = run_windows(tx, jnp.full(DIM, 3.0), 400)
  assert float(state.autopilot.b_simple) < 8
  assert np.asarray(sizes).min() == 8


def test_a_small_growth_factor_still_grows_the_window_by_one():
  """growth=1.1 from a window of 2 rounds down to 2: the window still grows
  by at least one micro-batch (mutmut: the cap's k + 1)."""
  auto = jaxaccum.auto_k(max_k=64, growth=1.1, warmup=1)
  tx = jaxaccum.accumulate(optax.sgd(0.0), auto)
  (_, _state), sizes = run_windows(tx, jnp.full(DIM, 0.05), 300)
  lengths = [int(k) for k in dict.fromkeys(np.asarray(sizes).tolist())]
  assert lengths[:3] == [2, 3, 4], lengths  # floor(1.1 k) < k + 1 here
  for a, b in itertools.pairwise(lengths):
    assert a < b <= max(int(a * 1.1), a + 1), lengths


def test_one_trace_serves_every_window_length():
  """The window's length is a value in the state: a jitted update traced once
  runs windows of every length the autopilot picks."""
  traces = []
  tx = jaxaccum.accumulate(optax.sgd(0.0), jaxaccum.auto_k(max_k=16, warmup=1))

  @jax.jit
  def update(grads, state, w):
    traces.append(1)  # runs only when jit traces
    return tx.update(grads, state, w)

  w, sizes = jnp.full(DIM, 0.1), set()
  state = tx.init(w)
  for i in range(300):
    g = jax.grad(loss)(w, micro_batch(jax.random.key(i), jnp.zeros(DIM)))
    _, state = update(g, state, w)
    sizes.add(int(jaxaccum.window_size(state)))
  assert len(sizes) >= 4, sizes
  assert len(traces) == 1


@pytest.mark.slow
@pytest.mark.parametrize(
  ("rule", "power"), [("sqrt", 0.5), ("linear", 1.0), (None, 0.0)]
)
def test_the_learning_rate_factor_is_the_rule(rule, power):
  """Each window's updates are the inner optimizer's times (k / k0) ** p."""
  auto = jaxaccum.auto_k(max_k=16, warmup=1, lr_rule=rule)
  tx = jaxaccum.accumulate(optax.sgd(0.1), auto)
  reference = optax.sgd(0.1)
  w = jnp.full(DIM, 0.1)
  state, seen = tx.init(w), 0
  for i in range(400):
    g = jax.grad(loss)(w, micro_batch(jax.random.key(i), jnp.zeros(DIM)))
    k = int(jaxaccum.window_size(state))
    factor = float(state.autopilot.lr_factor)
    assert factor == pytest.approx((k / 2) ** power, rel=1e-6)
    if int(state.micro_step) == 0:
      window = [g]
    else:
      window.append(g)
    updates, state = tx.update(g, state, w)
    if jaxaccum.has_updated(state):
      want, _ = reference.update(sum(window) / len(window), reference.init(w), w)
      chex.assert_trees_all_close(updates, want * factor, rtol=1e-5, atol=1e-7)
      seen += k > 2
  assert seen, "the window never grew, so the rule was not exercised"


def test_under_weight_the_window_is_in_micro_batches():
  """With weight= (tokens), B_simple is in tokens; the window converts it
  with the window's own weights: twice the rows at weight 1 each give the
  same window as the same rows weighted 2 per micro-batch... in micro-batches."""
  auto = jaxaccum.auto_k(max_k=64, horizon=20)
  tx = jaxaccum.accumulate(optax.sgd(0.0), auto)
  w = jnp.full(DIM, np.sqrt(1.0 / DIM))
  state = tx.init(w)

  @jax.jit
  def go(state):
    def body(state, key):
      x, y = micro_batch(key, jnp.zeros(DIM))
      # A loss sum over the rows, weighted by the row count: tokens.
      grads = jax.grad(lambda w: jnp.sum((x @ w - y) ** 2) / 2)(w)
      _, state = tx.update(grads, state, w, weight=jnp.float32(M))
      return state, None

    return jax.lax.scan(body, state, jax.random.split(jax.random.key(0), 3000))[0]

  state = go(state)
  want = closed_form_b_simple(1.0) / M
  assert abs(float(state.window_size) - want) <= 0.25 * want


@pytest.mark.slow
def test_a_resume_mid_window_is_bit_identical(tmp_path):
  tx = jaxaccum.accumulate(
    optax.adam(0.05), jaxaccum.auto_k(max_k=16, warmup=1, lr_rule="sqrt")
  )
  w0 = jnp.full(DIM, 0.5)

  def run(w, state, keys):
    update = jax.jit(tx.update)
    for key in keys:
      grads = jax.grad(loss)(w, micro_batch(key, jnp.zeros(DIM)))
      updates, state = update(grads, state, w)
      w = optax.apply_updates(w, updates)
    return w, state

  keys = list(jax.random.split(jax.random.key(5), 120))
  uninterrupted = run(w0, tx.init(w0), keys)
  w, state = run(w0, tx.init(w0), keys[:77])
  assert int(state.micro_step) > 0 and int(state.window_size) > 2  # mid-window, grown
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "ckpt", {"w": w, "opt_state": state})
  checkpointer.wait_until_finished()
  fresh = {"w": w0, "opt_state": tx.init(w0)}
  restored = checkpointer.restore(
    tmp_path / "ckpt", jax.tree.map(ocp.utils.to_shape_dtype_struct, fresh)
  )
  resumed = run(restored["w"], restored["opt_state"], keys[77:])
  for got, want in zip(
    jax.tree.leaves(resumed), jax.tree.leaves(uninterrupted), strict=True
  ):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.slow
def test_every_device_of_a_mesh_picks_the_same_window():
  """Gradients from mesh= are global arrays: the noise statistics, and so the
  window length, are one value, the same on every device."""
  mesh = jax.make_mesh((8,), ("data",))
  tx = jaxaccum.accumulate(optax.sgd(0.0), jaxaccum.auto_k(max_k=32, warmup=1))
  grad_fn = jaxaccum.grad(loss, 1, mesh=mesh, data_axis="data")
  w = jnp.full(DIM, 0.2)
  state = tx.init(w)

  @jax.jit
  def step(state, key):
    keys = jax.random.split(key, 8)
    x, y = jax.vmap(lambda k: micro_batch(k, jnp.zeros(DIM)))(keys)
    batch = jax.sharding.reshard((x.reshape(-1, DIM), y.reshape(-1)), P("data"))
    _, state = tx.update(grad_fn(w, batch), state, w)
    return state

  with jax.set_mesh(mesh):
    for i in range(200):
      state = step(state, jax.random.key(i))
  k = state.window_size
  assert int(k) > 2
  values = {int(np.asarray(shard.data)) for shard in k.addressable_shards}
  assert values == {int(k)} and len(k.addressable_shards) == 8


@pytest.mark.parametrize(
  ("kwargs", "error", "message"),
  [
    (
      {"min_k": 1},
      ValueError,
      "min_k must be at least 2, got min_k=1: a window "
      "of one micro-batch measures no gradient noise.",
    ),
    (
      {"max_k": 2, "min_k": 4},
      ValueError,
      "max_k must be at least min_k, got max_k=2 and min_k=4.",
    ),
    (
      {"lr_rule": "cubic"},
      ValueError,
      "Unknown lr_rule='cubic'; choose 'sqrt', 'linear' or None.",
    ),
    ({"growth": 1.0}, ValueError, "growth must be a factor > 1, got growth=1.0."),
    (
      {"horizon": 0.5},
      ValueError,
      "horizon must be a number of windows >= 1, got horizon=0.5.",
    ),
    ({"warmup": -1}, ValueError, "warmup must be >= 0, got warmup=-1."),
    (
      {"fraction": 0.0},
      ValueError,
      "fraction must be a positive number, got fraction=0.0.",
    ),
    ({"max_k": 8.0}, TypeError, "max_k must be an integer, got 8.0."),
    ({"min_k": True}, TypeError, "min_k must be an integer, got True."),
    ({"warmup": "5"}, TypeError, "warmup must be an integer, got '5'."),
  ],
)
def test_auto_k_refuses_what_cannot_work(kwargs, error, message):
  """Every message whole (mutmut: _autopilot.auto_k, whose argument names in
  the messages survived)."""
  with pytest.raises(error) as raised:
    jaxaccum.auto_k(**{"max_k": 8, **kwargs})
  assert str(raised.value) == message


def test_window_size_reads_every_kind_of_every_k():
  w = jnp.zeros(2)
  for every_k, want in (
    (3, 3),
    (lambda step: 4, 4),
    (jaxaccum.auto_k(max_k=9, min_k=5), 5),
  ):
    tx = optax.chain(optax.clip(1.0), jaxaccum.accumulate(optax.sgd(0.1), every_k))
    assert int(jaxaccum.window_size(tx.init(w))) == want
  # Inside a sharded NamedSharding-placed state too (read, not recomputed).
  state = jax.device_put(tx.init(w), NamedSharding(jax.make_mesh((1,), ("d",)), P()))
  assert int(jaxaccum.window_size(state)) == 5


def test_fraction_aims_below_the_critical_batch():
  """fraction=0.5 aims at half the closed form's B_simple."""
  tx = jaxaccum.accumulate(optax.sgd(0.0), jaxaccum.auto_k(max_k=64, fraction=0.5))
  w = jnp.full(DIM, np.sqrt(0.25 / DIM))
  (_, state), _ = run_windows(tx, w, 3000)
  want = 0.5 * closed_form_b_simple(0.25) / M
  assert abs(float(state.window_size) - want) <= 0.25 * want


def test_a_fresh_state_can_be_donated():
  """Every field its own buffer: the noise tracker's two zeros were one,
  and jit refused to donate the state ("the same buffer twice")."""
  tx = jaxaccum.accumulate(
    optax.adam(1e-3),
    jaxaccum.auto_k(max_k=8),
    loss_scale=jaxaccum.dynamic_loss_scale(),
  )
  state = tx.init({"w": jnp.zeros(3)})
  jax.block_until_ready(jax.jit(lambda s: s, donate_argnums=0)(state))


def test_a_skipped_window_leaves_the_estimate_alone():
  """A window whose micro-batches weigh nothing is skipped; what it measured
  must not move the autopilot (mutmut: _autopilot.AutoK.next_window, where
  a measurement of a skipped window was taken)."""
  tx = jaxaccum.accumulate(optax.sgd(0.0), jaxaccum.auto_k(max_k=32, warmup=1))
  w = jnp.full(DIM, np.sqrt(1.0 / DIM))
  update = jax.jit(lambda g, s, weight: tx.update(g, s, w, weight=weight)[1])

  def loss_sum(w, batch):
    x, y = batch
    return jnp.sum((x @ w - y) ** 2) / 2

  def feed(state, calls, weight, seed):
    for key in jax.random.split(jax.random.key(seed), calls):
      grads = jax.grad(loss_sum)(w, micro_batch(key, jnp.zeros(DIM)))
      state = update(grads, state, jnp.float32(weight))
    return state

  before = feed(tx.init(w), 40, M, seed=0)
  while int(before.micro_step) != 0:  # end on a window boundary
    before = feed(before, 1, M, seed=100 + int(before.micro_step))
  after = feed(before, int(before.window_size), 0.0, seed=1)
  assert int(after.micro_step) == 0 and int(after.step) == int(before.step)
  chex.assert_trees_all_equal(after.autopilot, before.autopilot)
  assert int(after.window_size) == int(before.window_size)


def test_weights_below_one_convert_like_any_other():
  """Micro-batches weighing 0.5 each (gradients of a loss sum weighted
  alike) pick the same windows as weight 1 (mutmut: _autopilot.AutoK.
  next_window, where weights at or below one were taken as one)."""
  w = jnp.full(DIM, np.sqrt(1.0 / DIM))
  keys = jax.random.split(jax.random.key(0), 1500)

  def windows(weight):
    tx = jaxaccum.accumulate(optax.sgd(0.0), jaxaccum.auto_k(max_k=64, horizon=20))

    def body(state, key):
      grads = jax.grad(loss)(w, micro_batch(key, jnp.zeros(DIM))) * weight
      _, state = tx.update(grads, state, w, weight=jnp.float32(weight))
      return state, state.window_size

    return np.asarray(jax.jit(lambda s: jax.lax.scan(body, s, keys)[1])(tx.init(w)))

  whole, half = windows(1.0), windows(0.5)
  assert whole.max() > 2, "the window never grew"
  np.testing.assert_array_equal(half, whole)
