"""Equinox modules as the differentiated argument, against Equinox's own
``eqx.filter_value_and_grad`` on the full batch.

An Equinox module holds leaves that ``jax.grad`` refuses (an ``eqx.nn.MLP``'s
activation, a ``custom_jvp``; ``Dropout``'s ``p`` and ``inference``). jaxaccum
partitions such an argument as ``eqx.filter_value_and_grad`` does: its
floating-point arrays are differentiated, every other leaf is static and gets
None as its gradient (``jaxaccum/_static.py``). Stateful layers go through
``state_argnum`` (``eqx.nn.BatchNorm`` with an ``eqx.nn.State``) and keys
through ``rng_argnum`` (``eqx.nn.Dropout``); where micro-batches differ from
the full batch (batch statistics, keys) the reference is Equinox's own
gradient over the same micro-batches, one after the other.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxaccum

# The unit roundoff of float32; an element of a sum of n terms is off by at
# most about n u of the terms' magnitude, on each of the two paths.
U = float(jnp.finfo(jnp.float32).eps) / 2
B, FEATURES, WIDTH = 32, 6, 16


def assert_trees_close(got, want, terms):
  """The same tree (None where Equinox gives None), each leaf within
  ``2 * terms * u`` of its largest magnitude in ``want``."""
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for (path, g), w in zip(
    jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True
  ):
    assert g.shape == w.shape and g.dtype == w.dtype, jax.tree_util.keystr(path)
    atol = 2 * terms * U * float(jnp.max(jnp.abs(w))) + 1e-30
    np.testing.assert_allclose(
      g, w, rtol=0, atol=atol, err_msg=jax.tree_util.keystr(path)
    )


def mlp_loss(model, x, y):
  pred = jax.vmap(model)(x)
  return jnp.mean((pred - y) ** 2), {"pred": pred, "err": jnp.mean(jnp.abs(pred - y))}


def mlp_problem():
  kx, ky, km = jax.random.split(jax.random.key(0), 3)
  model = eqx.nn.MLP(FEATURES, 3, WIDTH, 2, activation=jax.nn.gelu, key=km)
  x = jax.random.normal(kx, (B, FEATURES))
  y = jax.random.normal(ky, (B, 3))
  return model, x, y


@pytest.mark.slow
def test_mlp_value_aux_and_grads_equal_eqx_filter_value_and_grad():
  model, x, y = mlp_problem()
  fun = jaxaccum.value_and_grad(mlp_loss, 4, has_aux=True, batch_argnums=(1, 2))
  (value, aux), grads = fun(model, x, y)
  (want_value, want_aux), want = eqx.filter_value_and_grad(mlp_loss, has_aux=True)(
    model, x, y
  )
  terms = B + WIDTH + 8
  assert_trees_close(grads, want, terms)  # None for the activation, as eqx
  assert grads.activation is None and grads.layers[0].weight is not None
  assert_trees_close((value, aux), (want_value, want_aux), terms)


def test_mlp_under_filter_jit_and_grad_equal_eqx():
  model, x, y = mlp_problem()

  @eqx.filter_jit
  def grads_of(model, x, y):
    return jaxaccum.grad(lambda m, x, y: mlp_loss(m, x, y)[0], 8, batch_argnums=(1, 2))(
      model, x, y
    )

  want = eqx.filter_grad(lambda m, x, y: mlp_loss(m, x, y)[0])(model, x, y)
  assert_trees_close(grads_of(model, x, y), want, B + WIDTH + 8)


def test_verify_equivalence_takes_an_eqx_module():
  model, x, y = mlp_problem()
  deviation = jaxaccum.verify_equivalence(
    mlp_loss, (model, x, y), 4, has_aux=True, batch_argnums=(1, 2)
  )
  assert deviation.grads < 1e-5


class WithIndex(eqx.Module):
  """Integer arrays, a bool and a Python float among the leaves."""

  weight: jax.Array
  index: jax.Array
  scale: float
  on: bool

  def __call__(self, x):
    return (x[:, self.index] @ self.weight) * self.scale if self.on else x


def test_integer_arrays_and_python_numbers_get_no_gradient_as_in_eqx():
  model = WithIndex(jnp.arange(6.0).reshape(3, 2) / 6, jnp.array([0, 2, 3]), 0.5, True)
  x = jax.random.normal(jax.random.key(1), (B, 4))
  loss = lambda m, x: jnp.mean(m(x) ** 2)  # noqa: E731
  value, grads = jaxaccum.value_and_grad(loss, 4)(model, x)
  want_value, want = eqx.filter_value_and_grad(loss)(model, x)
  assert grads.index is None and grads.scale is None and grads.on is None
  assert_trees_close((value, grads), (want_value, want), B + 8)


def test_a_pytree_of_arrays_and_floats_is_differentiated_as_jax_grad_does():
  """jax.grad takes a Python float; so does jaxaccum, as long as no leaf
  that jax.grad refuses makes the argument partitioned."""
  params = {"w": jnp.ones(3), "scale": 2.0}
  loss = lambda p, x: jnp.mean((x @ p["w"]) * p["scale"])  # noqa: E731
  x = jnp.arange(12.0).reshape(4, 3)
  grads = jaxaccum.grad(loss, 2)(params, x)
  want = jax.grad(loss)(params, x)
  assert_trees_close(grads, want, 8)


def test_make_train_step_trains_an_mlp_as_eqx_does():
  model, x, y = mlp_problem()
  tx = optax.adamw(1e-2)
  loss = lambda m, batch: mlp_loss(m, *batch)[0]  # noqa: E731
  # The reference first: the step donates the model's arrays.
  ref, ref_state = model, tx.init(eqx.filter(model, eqx.is_inexact_array))
  for _ in range(3):
    grads = eqx.filter_grad(loss)(ref, (x, y))
    updates, ref_state = tx.update(
      grads, ref_state, eqx.filter(ref, eqx.is_inexact_array)
    )
    ref = eqx.apply_updates(ref, updates)
  step = jaxaccum.make_train_step(loss, tx, 4)
  opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
  model = jax.tree.map(lambda a: a.copy() if eqx.is_array(a) else a, model)
  for _ in range(3):
    model, opt_state, _ = step(model, opt_state, (x, y))
  assert isinstance(model, eqx.nn.MLP) and model.activation is jax.nn.gelu
  assert_trees_close(
    eqx.filter(model, eqx.is_array), eqx.filter(ref, eqx.is_array), 3 * (B + WIDTH + 8)
  )


def test_accumulate_takes_an_eqx_module_and_its_gradients():
  model, x, y = mlp_problem()
  loss = lambda m, x, y: mlp_loss(m, x, y)[0]  # noqa: E731
  tx = jaxaccum.accumulate(optax.sgd(0.1), 4)
  state = tx.init(model)
  for i in range(4):
    rows = slice(i * B // 4, (i + 1) * B // 4)
    updates, state = tx.update(
      eqx.filter_grad(loss)(model, x[rows], y[rows]), state, model
    )
  assert bool(jaxaccum.has_updated(state))
  want = jax.tree.map(lambda g: -0.1 * g, eqx.filter_grad(loss)(model, x, y))
  assert_trees_close(updates, want, B + WIDTH + 8)


# -- a small CNN with BatchNorm and Dropout ------------------------------------


class CNN(eqx.Module):
  conv: eqx.nn.Conv2d
  norm: eqx.nn.BatchNorm
  drop: eqx.nn.Dropout
  head: eqx.nn.Linear

  def __init__(self, key, momentum=0.9):
    k1, k2 = jax.random.split(key)
    self.conv = eqx.nn.Conv2d(1, 4, 3, key=k1)
    self.norm = eqx.nn.BatchNorm(4, axis_name="batch", mode="batch", momentum=momentum)
    self.drop = eqx.nn.Dropout(0.25)
    self.head = eqx.nn.Linear(4 * 6 * 6, 10, key=k2)

  def __call__(self, x, state, key):
    h, state = self.norm(jax.nn.relu(self.conv(x)), state)
    return self.head(self.drop(h, key=key).reshape(-1)), state


def cnn_loss(model, state, batch, key):
  """Equinox's stateful idiom: BatchNorm reads the batch axis by name."""
  x, labels = batch
  keys = jax.random.split(key, x.shape[0])
  logits, state = jax.vmap(
    model, axis_name="batch", in_axes=(0, None, 0), out_axes=(0, None)
  )(x, state, keys)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  return loss, (logits, state)


def cnn_problem(momentum=0.9):
  kx, km = jax.random.split(jax.random.key(2))
  model, state = eqx.nn.make_with_state(CNN)(km, momentum)
  x = jax.random.normal(kx, (B, 1, 8, 8))
  return model, state, (x, jnp.arange(B) % 10)


CNN_OPTIONS = {"has_aux": True, "state_argnum": 1, "batch_argnums": 2, "rng_argnum": 3}
CNN_TERMS = B + 4 * 36 + 16


def eqx_micro_batches(model, state, batch, key, k):
  """The reference: eqx.filter_value_and_grad on each micro-batch, one after
  the other, micro-batch i with fold_in(key, i) and the state micro-batch
  i - 1 left; the mean loss and gradient, the logits in batch order."""
  m = B // k
  losses, logits, grads = [], [], []
  for i in range(k):
    micro = jax.tree.map(lambda a, i=i: a[i * m : (i + 1) * m], batch)
    (loss, (micro_logits, state)), g = eqx.filter_value_and_grad(
      cnn_loss, has_aux=True
    )(model, state, micro, jax.random.fold_in(key, i))
    losses.append(loss)
    logits.append(micro_logits)
    grads.append(g)
  mean = jax.tree.map(lambda *gs: sum(gs) / k, *grads)
  return (sum(losses) / k, (jnp.concatenate(logits), state)), mean


@pytest.mark.slow
def test_cnn_with_batchnorm_state_and_dropout_keys_equals_eqx_micro_batch_by_micro_batch():
  model, state, batch = cnn_problem()
  key = jax.random.key(3)
  got = jaxaccum.value_and_grad(cnn_loss, 4, **CNN_OPTIONS)(model, state, batch, key)
  want = eqx_micro_batches(model, state, batch, key, 4)
  assert_trees_close(got, want, CNN_TERMS)
  (_, (_, final_state)), grads = got
  assert grads.norm.weight is not None and grads.drop.p is None
  # The running statistics moved once per micro-batch: 4 times.
  assert int(final_state.get(model.norm.batch_counter)) == 4


@pytest.mark.slow
def test_cnn_at_one_micro_batch_is_eqx_on_the_full_batch():
  model, state, batch = cnn_problem()
  key = jax.random.key(3)
  got = jaxaccum.value_and_grad(cnn_loss, 1, **CNN_OPTIONS)(model, state, batch, key)
  want = eqx.filter_value_and_grad(cnn_loss, has_aux=True)(model, state, batch, key)
  assert_trees_close(got, want, CNN_TERMS)


def test_cnn_in_inference_mode_equals_eqx_on_the_full_batch():
  """Running statistics and no dropout: no micro-batch sees anything the full
  batch does not, so the accumulated step is the full batch's."""
  model, state, batch = cnn_problem()
  key = jax.random.key(3)
  _, (_, state) = cnn_loss(model, state, batch, key)  # statistics to read
  model = eqx.nn.inference_mode(model)
  got = jaxaccum.value_and_grad(cnn_loss, 4, **CNN_OPTIONS)(model, state, batch, key)
  want = eqx.filter_value_and_grad(cnn_loss, has_aux=True)(model, state, batch, key)
  assert_trees_close(got, want, CNN_TERMS)


@pytest.mark.slow
def test_make_train_step_threads_eqx_state_and_keys():
  model, state, batch = cnn_problem()
  key = jax.random.key(3)
  tx = optax.sgd(0.1)
  (_, (_, want_state)), grads = eqx_micro_batches(model, state, batch, key, 4)
  want = eqx.apply_updates(model, tx.update(grads, tx.init(grads))[0])
  step = jaxaccum.make_train_step(cnn_loss, tx, 4, **CNN_OPTIONS)
  opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
  new_model, _, (_, (_, new_state)) = step(model, opt_state, state, batch, key)
  assert_trees_close(
    eqx.filter(new_model, eqx.is_array), eqx.filter(want, eqx.is_array), CNN_TERMS
  )
  assert_trees_close(new_state, want_state, CNN_TERMS)


@pytest.mark.parametrize("k", [2, 4])
def test_grads_of_static_leaves_are_none_at_every_k(k):
  model, x, y = mlp_problem()
  _, grads = jaxaccum.value_and_grad(mlp_loss, k, has_aux=True, batch_argnums=(1, 2))(
    model, x, y
  )
  assert jax.tree.structure(grads) == jax.tree.structure(
    eqx.filter(model, eqx.is_inexact_array)
  )


def test_mesh_data_parallel_takes_an_eqx_module():
  model, x, y = mlp_problem()
  mesh = jax.make_mesh((8,), ("data",))
  fun = jaxaccum.value_and_grad(
    mlp_loss, 2, has_aux=True, batch_argnums=(1, 2), mesh=mesh, data_axis="data"
  )
  (value, _), grads = fun(model, x, y)
  (want_value, _), want = eqx.filter_value_and_grad(mlp_loss, has_aux=True)(model, x, y)
  assert_trees_close((value, grads), (want_value, want), B + WIDTH + 8)


def test_eager_calls_with_a_module_compile_once():
  """The static leaves key the compiled step (a custom_jvp hashes): the
  second and third eager calls reuse it, in value_and_grad and
  make_train_step alike."""
  model, x, y = mlp_problem()
  traces = []

  def loss(m, batch):
    traces.append(1)
    return mlp_loss(m, *batch)[0]

  fun = jaxaccum.value_and_grad(loss, 4)
  for _ in range(3):
    fun(model, (x, y))
  assert len(traces) == 2  # on a micro-batch and at twice its rows, once
  tx = optax.sgd(0.1)
  step = jaxaccum.make_train_step(loss, tx, 4, donate=False)
  opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
  for _ in range(3):
    model, opt_state, _ = step(model, opt_state, (x, y))
  assert len(traces) == 4
