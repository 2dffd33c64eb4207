"""jaxaccum.nnx.value_and_grad equals an eager loop of nnx.value_and_grad."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum

K, M, F = 4, 4, 3


class Net(nnx.Module):
  """Linear -> BatchNorm -> ReLU -> Dropout -> Linear."""

  def __init__(self, rngs):
    self.hidden = nnx.Linear(F, 8, rngs=rngs)
    self.norm = nnx.BatchNorm(8, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)
    self.out = nnx.Linear(8, 1, rngs=rngs)

  def __call__(self, x):
    h = self.drop(nnx.relu(self.norm(self.hidden(x))))
    return self.out(h)[:, 0]


def loss(model, batch):
  x, y = batch
  return jnp.mean((model(x) - y) ** 2)


def batch_data(seed=1, rows=K * M):
  x = jax.random.normal(jax.random.key(seed), (rows, F))
  return x, jnp.sin(jnp.sum(x, axis=1))


def micro(batch, i):
  return jax.tree.map(lambda a: a[i * M : (i + 1) * M], batch)


def eager_reference(model, batch, fun=loss):
  """nnx.value_and_grad on each micro-batch in turn, then the mean."""
  values, grads = [], []
  for i in range(K):
    v, g = nnx.value_and_grad(fun)(model, micro(batch, i))
    values.append(v)
    grads.append(g)
  return np.mean(values), jax.tree.map(lambda *g: sum(g) / K, *grads)


def assert_models_equal(model, reference):
  chex.assert_trees_all_close(
    nnx.state(model, nnx.BatchStat),
    nnx.state(reference, nnx.BatchStat),
    rtol=1e-6,
  )
  chex.assert_trees_all_equal(
    nnx.state(model, nnx.RngCount), nnx.state(reference, nnx.RngCount)
  )


def test_under_nnx_jit_matches_eager_loop():
  model, reference = Net(nnx.Rngs(0, dropout=1)), Net(nnx.Rngs(0, dropout=1))
  batch = batch_data()
  step = nnx.jit(jaxaccum.nnx.value_and_grad(loss, K))
  value, grads = step(model, batch)
  want_value, want_grads = eager_reference(reference, batch)
  np.testing.assert_allclose(value, want_value, rtol=1e-5)
  chex.assert_trees_all_close(grads, want_grads, rtol=1e-5, atol=1e-6)
  assert isinstance(grads, nnx.State)
  # BatchNorm statistics: updated once per micro-batch; RNG: advanced K times.
  assert_models_equal(model, reference)
  assert int(nnx.state(model, nnx.RngCount)["drop"]["rngs"]["count"][...]) == K


def test_each_micro_batch_gets_its_own_dropout_mask():
  model = Net(nnx.Rngs(0, dropout=1))
  model.norm = nnx.BatchNorm(8, use_running_average=True, rngs=nnx.Rngs(0))

  def masks(m, batch):
    x, _ = batch
    h = nnx.relu(m.hidden(x)) + 1.0  # strictly positive before dropout
    return jnp.sum(m.drop(h)) * 0.0, m.drop(h) == 0

  (_, dropped), _ = jaxaccum.nnx.value_and_grad(masks, K, has_aux=True)(
    model, batch_data()
  )
  assert dropped.shape == (K * M, 8)  # the micro-batches' rows, joined
  assert not np.array_equal(dropped[:M], dropped[M : 2 * M])


def test_under_jax_jit_through_split_and_merge():
  reference = Net(nnx.Rngs(0, dropout=1))
  graphdef, state = nnx.split(Net(nnx.Rngs(0, dropout=1)))
  batch = batch_data()

  @jax.jit
  def step(state, batch):
    model = nnx.merge(graphdef, state)
    value, grads = jaxaccum.nnx.value_and_grad(loss, K)(model, batch)
    return value, grads, nnx.state(model)

  value, grads, state = step(state, batch)
  want_value, want_grads = eager_reference(reference, batch)
  np.testing.assert_allclose(value, want_value, rtol=1e-5)
  chex.assert_trees_all_close(grads, want_grads, rtol=1e-5, atol=1e-6)
  assert_models_equal(nnx.merge(graphdef, state), reference)


def test_eagerly_without_jit():
  model, reference = Net(nnx.Rngs(0, dropout=1)), Net(nnx.Rngs(0, dropout=1))
  batch = batch_data()
  value, _ = jaxaccum.nnx.value_and_grad(loss, micro_batch_size=M)(model, batch)
  np.testing.assert_allclose(value, eager_reference(reference, batch)[0], rtol=1e-5)
  assert_models_equal(model, reference)


def test_weighted_and_aux():
  model, reference = Net(nnx.Rngs(0, dropout=1)), Net(nnx.Rngs(0, dropout=1))
  x, y = batch_data()
  mask = (jnp.arange(K * M) % 5 != 0).astype(jnp.float32)

  def loss_sum(m, batch):
    x, y, mask = batch
    err = (m(x) - y) ** 2
    return (jnp.sum(err * mask), jnp.sum(mask)), jnp.max(err)

  (value, aux), grads = nnx.jit(
    jaxaccum.nnx.value_and_grad(
      loss_sum, K, normalize="weighted", has_aux=True, aux="stack"
    )
  )(model, (x, y, mask))
  assert aux.shape == (K,)

  # Eagerly: per micro-batch, the gradient of the loss sum; then Σg / Σn.
  def only_sum(m, b):
    (s, n), _ = loss_sum(m, b)
    return s, n

  sums, tokens, grad_sum = 0.0, 0.0, None
  for i in range(K):
    (s, n), g = nnx.value_and_grad(only_sum, has_aux=True)(
      reference, micro((x, y, mask), i)
    )
    sums, tokens = sums + s, tokens + n
    grad_sum = g if grad_sum is None else jax.tree.map(jnp.add, grad_sum, g)
  np.testing.assert_allclose(value, sums / tokens, rtol=1e-5)
  chex.assert_trees_all_close(
    grads, jax.tree.map(lambda g: g / tokens, grad_sum), rtol=1e-5, atol=1e-6
  )
  assert_models_equal(model, reference)


def test_optimizer_accepts_the_grads():
  model = Net(nnx.Rngs(0, dropout=1))
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  batch = batch_data()

  @nnx.jit
  def train_step(model, optimizer, batch):
    value, grads = jaxaccum.nnx.value_and_grad(loss, K)(model, batch)
    optimizer.update(model, grads)
    return value

  first = float(train_step(model, optimizer, batch))
  for _ in range(30):
    last = float(train_step(model, optimizer, batch))
  assert last < first


def test_batch_argnums_cannot_be_the_model():
  with pytest.raises(ValueError, match=r"^argnums=0 and batch_argnums=0 overlap"):
    jaxaccum.nnx.value_and_grad(loss, 2, batch_argnums=0)


def test_noise_stats_pass_through():
  model, reference = Net(nnx.Rngs(0, dropout=1)), Net(nnx.Rngs(0, dropout=1))
  batch = batch_data()
  (value, grads), noise = jaxaccum.nnx.value_and_grad(loss, K, noise_stats=True)(
    model, batch
  )
  want_value, want_grads = eager_reference(reference, batch)
  np.testing.assert_allclose(value, want_value, rtol=1e-5)
  chex.assert_trees_all_close(grads, want_grads, rtol=1e-5, atol=1e-6)
  assert float(noise.b_small) == M and float(noise.b_big) == K * M
  big = sum(jnp.sum(g**2) for g in jax.tree.leaves(want_grads))
  np.testing.assert_allclose(noise.big_sq_norm, big, rtol=1e-4)


class Student(nnx.Module):
  def __init__(self, rngs):
    self.hidden = nnx.Linear(F, 8, rngs=rngs)
    self.out = nnx.Linear(8, 4, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(self.hidden(x)))


class Teacher(nnx.Module):
  """A frozen teacher with BatchNorm in evaluation mode."""

  def __init__(self, rngs):
    self.hidden = nnx.Linear(F, 16, rngs=rngs)
    self.norm = nnx.BatchNorm(16, use_running_average=True, rngs=rngs)
    self.out = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(self.norm(self.hidden(x))))


def distill(student, teacher, x):
  targets = jax.nn.softmax(teacher(x))
  return jnp.mean(optax.softmax_cross_entropy(student(x), targets))


@pytest.mark.slow
def test_distillation_with_a_teacher_equals_the_full_batch():
  student, teacher = Student(nnx.Rngs(0)), Teacher(nnx.Rngs(1))
  x = batch_data()[0]
  value, grads = nnx.jit(jaxaccum.nnx.value_and_grad(distill, K, batch_argnums=2))(
    student, teacher, x
  )
  want_value, want_grads = nnx.value_and_grad(distill)(student, teacher, x)
  np.testing.assert_allclose(value, want_value, rtol=1e-5)
  chex.assert_trees_all_close(grads, want_grads, rtol=1e-5, atol=1e-6)
  # Only the student is differentiated: its Params, not the teacher's.
  assert set(nnx.to_pure_dict(grads)) == {"hidden", "out"}
  assert jax.tree.structure(grads) == jax.tree.structure(nnx.state(student, nnx.Param))


@pytest.mark.slow
def test_rngs_argument_is_threaded_and_written_back():
  """An nnx.Rngs passed next to the model advances once per micro-batch,
  as in K eager calls, and every micro-batch draws its own mask."""
  model = Net(nnx.Rngs(0))
  model.drop.rate = 0.0

  def loss_with_rngs(model, batch, rngs):
    x, y = batch
    keep = jax.random.bernoulli(rngs.noise(), 0.5, x.shape)
    return loss(model, (jnp.where(keep, x, 0.0), y)), keep

  rngs, reference_rngs = nnx.Rngs(noise=7), nnx.Rngs(noise=7)
  reference = nnx.clone(model)
  batch = batch_data()
  (value, masks), grads = jaxaccum.nnx.value_and_grad(
    loss_with_rngs, K, has_aux=True, aux="stack"
  )(model, batch, rngs)
  want = [
    nnx.value_and_grad(loss_with_rngs, has_aux=True)(
      reference, micro(batch, i), reference_rngs
    )
    for i in range(K)
  ]
  np.testing.assert_array_equal(masks, np.stack([w[0][1] for w in want]))
  np.testing.assert_allclose(value, np.mean([w[0][0] for w in want]), rtol=1e-5)
  chex.assert_trees_all_close(
    grads,
    jax.tree.map(lambda *g: sum(g) / K, *[w[1] for w in want]),
    rtol=1e-5,
    atol=1e-6,
  )
  assert int(rngs.noise.count[...]) == K == int(reference_rngs.noise.count[...])
  assert_models_equal(model, reference)


def test_a_state_argument_is_threaded_not_differentiated():
  model = Net(nnx.Rngs(0, dropout=1))
  model.drop.rate = 0.0
  stats = nnx.State({"seen": nnx.Variable(jnp.zeros(()))})

  def counting_loss(model, batch, stats):
    stats["seen"][...] = stats["seen"][...] + batch[0].shape[0]
    return loss(model, batch)

  reference = nnx.clone(model)
  value, grads = jaxaccum.nnx.value_and_grad(counting_loss, K)(
    model, batch_data(), stats
  )
  want_value, want_grads = eager_reference(reference, batch_data())
  np.testing.assert_allclose(value, want_value, rtol=1e-5)
  chex.assert_trees_all_close(grads, want_grads, rtol=1e-5, atol=1e-6)
  assert float(stats["seen"][...]) == K * M


def test_argnums_tuple_differentiates_both_models():
  student, other = Student(nnx.Rngs(0)), Student(nnx.Rngs(2))

  def agreement(a, b, x):
    return jnp.mean((a(x) - b(x)) ** 2)

  x = batch_data()[0]
  value, (ga, gb) = jaxaccum.nnx.value_and_grad(
    agreement, K, argnums=(0, 1), batch_argnums=2
  )(student, other, x)
  want_value, (wa, wb) = nnx.value_and_grad(agreement, argnums=(0, 1))(
    student, other, x
  )
  np.testing.assert_allclose(value, want_value, rtol=1e-5)
  chex.assert_trees_all_close((ga, gb), (wa, wb), rtol=1e-5, atol=1e-6)


def test_grad_returns_the_grads_only():
  model, reference = Net(nnx.Rngs(0, dropout=1)), Net(nnx.Rngs(0, dropout=1))
  model.drop.rate = reference.drop.rate = 0.0
  batch = batch_data()
  grads = jaxaccum.nnx.grad(loss, K)(model, batch)
  chex.assert_trees_all_close(
    grads, eager_reference(reference, batch)[1], rtol=1e-5, atol=1e-6
  )
  (grads, aux) = jaxaccum.nnx.grad(lambda m, b: (loss(m, b), b[1]), K, has_aux=True)(
    model, batch
  )
  np.testing.assert_array_equal(aux, batch[1])  # the rows, joined in batch order


def test_an_nnx_model_in_the_batch_is_refused():
  model = Net(nnx.Rngs(0))
  with pytest.raises(ValueError, match="batch argument 1 holds an nnx object"):
    jaxaccum.nnx.value_and_grad(lambda m, b: loss(m, b[1]), K)(
      model, (model, batch_data())
    )


# -- Whole steps: jaxaccum.nnx.make_train_step and verify_equivalence --------
#
# With dropout and BatchNorm in training mode the reference is an eager loop
# of nnx.value_and_grad over the micro-batches (statistics updated and RNG
# streams advanced once per micro-batch) and one optimizer.update with the
# mean gradient; without them, and on a mesh, the full batch's step.

TOL = {"rtol": 1e-5, "atol": 1e-6}


def pair(tx=None):
  """A model and its optimizer, twice, from one initialization."""
  tx = tx or optax.adam(1e-2)
  model, reference = Net(nnx.Rngs(0, dropout=1)), Net(nnx.Rngs(0, dropout=1))
  return (
    (model, nnx.Optimizer(model, tx, wrt=nnx.Param)),
    (reference, nnx.Optimizer(reference, tx, wrt=nnx.Param)),
  )


def sequential_step(model, optimizer, batch):
  """The reference: K eager micro-batches, then one update with the mean."""
  values, grads = [], []
  for i in range(K):
    v, g = nnx.value_and_grad(loss)(model, micro(batch, i))
    values.append(v)
    grads.append(g)
  optimizer.update(model, jax.tree.map(lambda *g: sum(g) / K, *grads))
  return np.mean(values)


def arrays(tree, kind=...):
  """The arrays of ``kind`` variables (RNG keys as their data), copied:
  a donating step deletes the originals."""
  state = nnx.state(tree, kind)
  return jax.tree.map(
    lambda x: jnp.copy(
      jax.random.key_data(x)
      if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
      else x
    ),
    state,
  )


def assert_same(a, b):
  chex.assert_trees_all_close(arrays(a), arrays(b), **TOL)


def test_dropout_and_batchnorm_steps_equal_a_sequential_loop():
  """Two steps: BatchNorm statistics updated per micro-batch, dropout masks
  drawn per micro-batch (the streams advance by K per step), momentum. (Not
  Adam: the hidden bias's gradient is zero up to rounding behind BatchNorm,
  and Adam turns rounding into steps of the learning rate's size.)"""
  (model, optimizer), (reference, ref_optimizer) = pair(optax.sgd(0.1, momentum=0.9))
  step = jaxaccum.nnx.make_train_step(loss, optimizer, K)
  for seed in (1, 2):
    batch = batch_data(seed)
    value = step(model, batch)
    want = sequential_step(reference, ref_optimizer, batch)
    np.testing.assert_allclose(value, want, **TOL)
  assert_same(model, reference)
  assert_same(optimizer, ref_optimizer)
  assert int(model.drop.rngs.count[...]) == 2 * K
  assert int(optimizer.step[...]) == 2


def test_without_dropout_and_batchnorm_a_step_equals_the_full_batch_step():
  (model, optimizer), (reference, ref_optimizer) = pair()
  model.eval()
  reference.eval()
  batch = batch_data()
  value = jaxaccum.nnx.make_train_step(loss, optimizer, K)(model, batch)
  want, grads = nnx.value_and_grad(loss)(reference, batch)
  ref_optimizer.update(reference, grads)
  np.testing.assert_allclose(value, want, **TOL)
  assert_same(model, reference)


def test_on_a_mesh_a_step_equals_the_full_batch_step():
  (model, optimizer), (reference, ref_optimizer) = pair()
  model.eval()
  reference.eval()
  mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  batch = batch_data(rows=4 * K * 2)
  sharded = jax.device_put(batch, NamedSharding(mesh, P("data")))
  step = jaxaccum.nnx.make_train_step(loss, optimizer, 2, mesh=mesh, data_axis="data")
  value = step(model, sharded)
  want, grads = nnx.value_and_grad(loss)(reference, batch)
  ref_optimizer.update(reference, grads)
  np.testing.assert_allclose(value, want, **TOL)
  assert_same(model, reference)


def test_aux_comes_back_as_the_full_batchs():
  (model, optimizer), (reference, _) = pair()
  model.eval()
  reference.eval()

  def with_aux(model, batch):
    x, _ = batch
    pred = model(x)
    return loss(model, batch), {"pred": pred, "mean": jnp.mean(pred)}

  batch = batch_data()
  _, aux = jaxaccum.nnx.make_train_step(with_aux, optimizer, K, has_aux=True)(
    model, batch
  )
  _, want = with_aux(reference, batch)  # before the update, as the step's
  chex.assert_trees_all_close(aux, want, **TOL)


def test_a_nonfinite_step_is_skipped_and_the_streams_still_advance():
  (model, optimizer), _ = pair()
  before = arrays((model, optimizer), nnx.Not(nnx.RngState))
  x, y = batch_data()
  value = jaxaccum.nnx.make_train_step(loss, optimizer, K)(
    model, (x, y.at[3].set(jnp.nan))
  )
  assert not np.isfinite(value)
  chex.assert_trees_all_equal(arrays((model, optimizer), nnx.Not(nnx.RngState)), before)
  assert int(optimizer.step[...]) == 0
  assert int(model.drop.rngs.count[...]) == K


def test_a_zero_total_weight_is_skipped():
  (model, optimizer), _ = pair(optax.sgd(0.1))
  params = arrays(model, nnx.Param)

  def token_loss(model, batch):
    x, y, mask = batch
    return jnp.sum(mask * (model(x) - y) ** 2), jnp.sum(mask)

  x, y = batch_data()
  step = jaxaccum.nnx.make_train_step(token_loss, optimizer, K, normalize="weighted")
  step(model, (x, y, jnp.zeros_like(y)))
  chex.assert_trees_all_equal(arrays(model, nnx.Param), params)
  assert int(optimizer.step[...]) == 0


@pytest.mark.slow
@pytest.mark.parametrize("donate", [True, False])
def test_donation_deletes_arrays_taken_out_before_the_step_only(donate):
  (model, optimizer), _ = pair()
  kernel = model.hidden.kernel[...]
  jaxaccum.nnx.make_train_step(loss, optimizer, K, donate=donate)(model, batch_data())
  assert kernel.is_deleted() == donate
  assert np.all(np.isfinite(model.hidden.kernel[...]))  # the model's own: new


def test_not_an_optimizer_is_named():
  with pytest.raises(TypeError) as error:
    jaxaccum.nnx.make_train_step(loss, optax.sgd(0.1), K)
  assert str(error.value) == (
    "jaxaccum.nnx.make_train_step takes an nnx.Optimizer, got "
    "GradientTransformationExtraArgs; for an optax transformation and a pytree "
    "of parameters use jaxaccum.make_train_step."
  )


def test_a_float16_loss_scale_is_refused():
  model = Net(nnx.Rngs(0, dropout=1))
  tx = jaxaccum.accumulate(optax.sgd(0.1), 1, loss_scale=jaxaccum.dynamic_loss_scale())
  with pytest.raises(ValueError) as error:
    jaxaccum.nnx.make_train_step(loss, nnx.Optimizer(model, tx, wrt=nnx.Param), K)
  assert str(error.value) == (
    "jaxaccum.nnx.make_train_step does not apply a float16 loss scale; "
    "jaxaccum.make_train_step does: run it on the arrays of nnx.split(model, "
    "nnx.Param, ...), or train in bfloat16 or float32."
  )


# -- verify_equivalence -----------------------------------------------------


def test_verify_equivalence_passes_in_eval_mode_and_leaves_the_model():
  model = Net(nnx.Rngs(0, dropout=1))
  model.eval()
  state = arrays(model)
  deviation = jaxaccum.nnx.verify_equivalence(loss, model, batch_data(), K)
  assert deviation.grads < 1e-5
  assert deviation.where.startswith("grads")
  chex.assert_trees_all_equal(arrays(model), state)


@pytest.mark.slow
def test_verify_equivalence_on_a_mesh_passes_and_catches_interacting_examples():
  """Through mesh=, each device's micro-batches against the full batch: a
  per-example loss passes, and one that mixes the examples of a batch (the
  devices' means differ from the whole batch's) fails."""
  model = Net(nnx.Rngs(0, dropout=1))
  model.eval()
  state = arrays(model)
  mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  batch = jax.device_put(batch_data(rows=4 * K * 2), NamedSharding(mesh, P("data")))
  options = {"mesh": mesh, "data_axis": "data"}
  deviation = jaxaccum.nnx.verify_equivalence(loss, model, batch, 2, **options)
  assert deviation.grads < 1e-5
  chex.assert_trees_all_equal(arrays(model), state)

  def interacting(model, batch):
    x, y = batch  # divided by the batch's largest target: not a sum over rows
    return jnp.mean((model(x) - y) ** 2) / jnp.max(jnp.abs(y))

  with pytest.raises(AssertionError, match="Accumulated and full-batch"):
    jaxaccum.nnx.verify_equivalence(interacting, model, batch, 2, **options)


def test_verify_equivalence_fails_on_a_loss_whose_examples_interact():
  """A loss normalized by the batch's own largest target is not a mean of
  per-example terms: the check must say so."""
  model = Net(nnx.Rngs(0, dropout=1))
  model.eval()

  def interacting(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2) / jnp.max(jnp.abs(y))

  with pytest.raises(AssertionError, match="Accumulated and full-batch"):
    jaxaccum.nnx.verify_equivalence(interacting, model, batch_data(), K)


def test_verify_equivalence_in_training_mode_points_to_eval():
  model = Net(nnx.Rngs(0, dropout=1))
  with pytest.raises(ValueError) as error:
    jaxaccum.nnx.verify_equivalence(loss, model, batch_data(), K)
  assert str(error.value) == (
    "jaxaccum.nnx.verify_equivalence: fun changed the model's variables "
    "['drop']['rngs']['count'], ['norm']['mean'], ['norm']['var'], which the "
    "full batch would change once and k micro-batches change k times "
    "(BatchNorm statistics in training mode, dropout's RNG stream): they have "
    "no full-batch counterpart. Verify the deterministic path: call "
    "model.eval() first."
  )


def test_jaxaccum_nnx_exports_its_functions_only():
  assert sorted(jaxaccum.nnx.__all__) == [
    "grad",
    "make_train_step",
    "value_and_grad",
    "verify_equivalence",
  ]
  assert all(callable(getattr(jaxaccum.nnx, name)) for name in jaxaccum.nnx.__all__)


def test_a_model_and_optimizer_steps_like_an_optimizer():
  """nnx.ModelAndOptimizer.update takes the grads alone; the step calls it so."""
  model, reference = Net(nnx.Rngs(0, dropout=1)), Net(nnx.Rngs(0, dropout=1))
  model.eval()
  reference.eval()
  both = nnx.ModelAndOptimizer(model, optax.sgd(0.1))
  ref_optimizer = nnx.Optimizer(reference, optax.sgd(0.1), wrt=nnx.Param)
  batch = batch_data()
  jaxaccum.nnx.make_train_step(loss, both, K)(model, batch)
  ref_optimizer.update(reference, nnx.grad(loss)(reference, batch))
  assert_same(model, reference)
  assert int(both.step[...]) == 1


# Both calls of jaxaccum.nnx.verify_equivalence: jaxaccum.verify_equivalence's
# (fun, args, k), and the older (fun, model, batch, k).
CONVENTIONS = {
  "plain": lambda fun, model, batch, k, **kw: jaxaccum.nnx.verify_equivalence(
    fun, (model, batch), k, **kw
  ),
  "older": jaxaccum.nnx.verify_equivalence,
}


def test_verify_equivalence_takes_jaxaccum_verify_equivalences_call():
  model = Net(nnx.Rngs(0, dropout=1))
  model.eval()
  x, y = batch_data()
  older = jaxaccum.nnx.verify_equivalence(loss, model, (x, y), K)
  plain = jaxaccum.nnx.verify_equivalence(loss, (model, (x, y)), K)
  assert plain == older and plain.grads < 1e-5

  def split_loss(model, x, y):
    return loss(model, (x, y))

  split = jaxaccum.nnx.verify_equivalence(
    split_loss, (model, x, y), K, batch_argnums=(1, 2)
  )
  assert split.grads < 1e-5
  ends = jaxaccum.nnx.verify_equivalence(
    split_loss, (model, x, y), K, batch_argnums=(1, -1)
  )
  assert ends == split


@pytest.mark.parametrize("convention", sorted(CONVENTIONS))
@pytest.mark.parametrize("name", ["state_argnum", "rng_argnum", "argnums"])
def test_verify_equivalence_refuses_state_and_rng_argnum_in_both_calls(
  convention, name
):
  """The docstring's promise: the model's variables are its state and its
  keys; state_argnum and rng_argnum are refused with a pointer to eval()."""
  model = Net(nnx.Rngs(0, dropout=1))
  model.eval()
  with pytest.raises(TypeError) as error:
    CONVENTIONS[convention](loss, model, batch_data(), K, **{name: 1})
  assert str(error.value).startswith(
    f"jaxaccum.nnx.verify_equivalence takes no {name}: it differentiates the "
    "wrt variables of the model (the first argument)"
  )
  assert str(error.value).endswith(
    "Call model.eval() and verify the deterministic path."
  )


@pytest.mark.parametrize("convention", sorted(CONVENTIONS))
def test_verify_equivalence_refuses_changed_state_in_both_calls(convention):
  model = Net(nnx.Rngs(0, dropout=1))  # training mode: BatchNorm and dropout move
  with pytest.raises(
    ValueError, match=r"^jaxaccum.nnx.verify_equivalence: fun changed"
  ):
    CONVENTIONS[convention](loss, model, batch_data(), K)


def test_verify_equivalence_without_the_batch_names_the_call():
  model = Net(nnx.Rngs(0, dropout=1))
  with pytest.raises(
    TypeError, match=r"verify_equivalence\(fun, \(model, batch\), k\)"
  ):
    jaxaccum.nnx.verify_equivalence(loss, model, num_micro_batches=K)


def test_a_clone_taken_before_a_donating_step_is_named_when_passed_to_it():
  """nnx.clone shares the model's arrays, which the step donates: passed to
  the step, the clone raised JAX's "INVALID_ARGUMENT: ... Buffer has been
  deleted or donated". A copy with its own arrays keeps working."""
  model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
  clone, copy = nnx.clone(model), jax.tree.map(jnp.copy, nnx.clone(model))
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  step = jaxaccum.nnx.make_train_step(lambda m, x: jnp.mean(m(x) ** 2), optimizer, 2)
  x = jnp.ones((4, 2))
  step(model, x)
  with pytest.raises(ValueError) as error:
    step(clone, x)
  assert str(error.value).startswith(
    "jaxaccum.nnx.make_train_step donates the model's and the optimizer's arrays"
  )
  assert "jax.tree.map(jnp.copy, nnx.clone(model))" in str(error.value)
  assert copy(x).shape == (4, 1)  # its own arrays: untouched by the donation
