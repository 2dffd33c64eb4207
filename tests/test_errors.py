"""Bad input raises a ValueError at trace time that names the sizes."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxaccum


def loss(w, batch):
  x, y = batch
  return jnp.mean((x @ w - y) ** 2)


W = jnp.zeros(3)
BATCH = (jnp.ones((12, 3)), jnp.ones(12))


def trace(fun, *args):
  """Traces without running: errors must come from tracing alone."""
  return jax.eval_shape(fun, *args)


def test_batch_not_divisible_by_k():
  with pytest.raises(
    ValueError, match=r"batch_size=12 is not divisible by num_micro_batches=5"
  ):
    trace(jaxaccum.value_and_grad(loss, 5), W, BATCH)


def test_batch_not_divisible_by_micro_batch_size():
  with pytest.raises(
    ValueError, match=r"batch_size=12 is not divisible by micro_batch_size=5"
  ):
    trace(jaxaccum.value_and_grad(loss, micro_batch_size=5), W, BATCH)


@pytest.mark.parametrize("k", [0, -3])
def test_k_not_positive(k):
  with pytest.raises(ValueError, match=f"num_micro_batches={k}"):
    jaxaccum.value_and_grad(loss, k)


def test_micro_batch_size_not_positive():
  with pytest.raises(ValueError, match="micro_batch_size=0"):
    jaxaccum.value_and_grad(loss, micro_batch_size=0)


def test_both_k_and_micro_batch_size():
  with pytest.raises(ValueError, match=r"num_micro_batches=2 and micro_batch_size=6"):
    jaxaccum.value_and_grad(loss, 2, micro_batch_size=6)


def test_neither_k_nor_micro_batch_size():
  with pytest.raises(ValueError, match="exactly one"):
    jaxaccum.value_and_grad(loss)


def test_k_must_be_an_int():
  with pytest.raises(TypeError, match="num_micro_batches"):
    jaxaccum.value_and_grad(loss, 2.0)


def test_batch_leaves_with_different_leading_sizes():
  batch = (jnp.ones((12, 3)), jnp.ones(10))
  with pytest.raises(ValueError, match=r"args\[1\]\[0\]: 12, args\[1\]\[1\]: 10"):
    trace(jaxaccum.value_and_grad(loss, 2), W, batch)


def test_several_batch_args_with_different_sizes():
  def two(w, x, y):
    return loss(w, (x, y))

  with pytest.raises(ValueError, match=r"args\[1\]: 12, args\[2\]: 8"):
    trace(
      jaxaccum.value_and_grad(two, 2, batch_argnums=(1, 2)),
      W,
      jnp.ones((12, 3)),
      jnp.ones(8),
    )


def test_scalar_batch_leaf():
  with pytest.raises(ValueError, match=r"scalar \(shape=\(\)\)"):
    trace(jaxaccum.value_and_grad(loss, 2), W, (jnp.ones((12, 3)), jnp.ones(())))


def test_unknown_normalize():
  with pytest.raises(ValueError, match="normalize='median'"):
    jaxaccum.value_and_grad(loss, 2, normalize="median")


def test_weighted_fun_that_does_not_return_a_pair():
  with pytest.raises(ValueError, match=r"\(loss_sum, weight\).*shape=\(\)"):
    trace(jaxaccum.value_and_grad(loss, 2, normalize="weighted"), W, BATCH)


def test_weighted_fun_returning_a_triple():
  def triple(w, batch):
    return loss(w, batch), 1.0, 2.0

  with pytest.raises(ValueError, match="tuple of length 3"):
    trace(jaxaccum.value_and_grad(triple, 2, normalize="weighted"), W, BATCH)


def test_weighted_with_non_scalar_weight():
  def vector_weight(w, batch):
    return loss(w, batch), jnp.ones(2)

  with pytest.raises(ValueError, match=r"weight must be a scalar, got shape=\(2,\)"):
    trace(jaxaccum.value_and_grad(vector_weight, 2, normalize="weighted"), W, BATCH)


def test_non_scalar_loss():
  with pytest.raises(ValueError, match=r"scalar, got shape=\(6,\)"):
    trace(jaxaccum.value_and_grad(lambda w, b: b[0] @ w, 2), W, BATCH)


def test_argnums_out_of_range():
  with pytest.raises(
    ValueError,
    match=r"^The function was called with 2 positional arguments, but "
    r"argnums=\(0,\), batch_argnums=\(2,\), rng_argnum=None and "
    r"state_argnum=None refer to more\.",
  ):
    trace(jaxaccum.value_and_grad(loss, 2, batch_argnums=2), W, BATCH)


def test_state_that_changes_shape():
  def grows(w, batch, state):
    return loss(w, batch), (None, jnp.concatenate([state, state]))

  with pytest.raises(
    ValueError, match=r"shape=\(4,\) for a state leaf of shape=\(2,\)"
  ):
    trace(
      jaxaccum.value_and_grad(grows, 2, state_argnum=2, has_aux=True),
      W,
      BATCH,
      jnp.zeros(2),
    )


def test_has_aux_without_a_pair():
  with pytest.raises(
    ValueError,
    match=r"^has_aux=True needs fun to return a pair \(value, aux\), got one "
    r"array of shape=\(\)\.",
  ):
    trace(jaxaccum.value_and_grad(loss, 2, has_aux=True), W, BATCH)
  with pytest.raises(ValueError, match=r"pair \(value, aux\), got a tuple\."):
    trace(
      jaxaccum.value_and_grad(lambda w, b: (loss(w, b),) * 3, 2, has_aux=True),
      W,
      BATCH,
    )


def test_integer_accum_dtype():
  with pytest.raises(ValueError, match="accum_dtype"):
    jaxaccum.value_and_grad(loss, 2, accum_dtype=jnp.int32)


def test_a_pair_without_has_aux_asks_about_has_aux():
  def loss_and_metrics(w, batch):
    return loss(w, batch), {"mse": loss(w, batch)}

  with pytest.raises(ValueError, match=r"Did you mean has_aux=True"):
    trace(jaxaccum.value_and_grad(loss_and_metrics, 2), W, BATCH)


def test_weighted_pair_with_aux_but_no_has_aux():
  def weighted(w, batch):
    return (jnp.sum(batch[1]), jnp.float32(12)), None

  with pytest.raises(ValueError, match=r"Did you mean has_aux=True"):
    trace(jaxaccum.value_and_grad(weighted, 2, normalize="weighted"), W, BATCH)


def test_an_nnx_model_points_to_jaxaccum_nnx():
  from flax import nnx  # noqa: PLC0415

  model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
  with pytest.raises(
    ValueError,
    match=r"^args\[0\] is \(or holds\) an nnx object, Linear\. "
    r"jaxaccum\.value_and_grad works on pytrees of arrays; for Flax NNX models "
    r"use jaxaccum\.nnx\.value_and_grad\(fun, k\)\(model, batch\), which "
    r"splits the model, differentiates its nnx\.Param variables and writes its "
    r"other state back\.",
  ):
    jaxaccum.value_and_grad(lambda m, b: jnp.mean(m(b[0])), 2)(model, BATCH)


@pytest.mark.parametrize("name", ["a_name", "z_name"])  # before and after "w"
def test_a_string_in_the_parameters_is_named(name):
  params = {"w": W, name: "encoder"}
  with pytest.raises(
    TypeError,
    match=rf"^args\[0\]\['{name}'\] is a str \('encoder'\), not an array: every "
    r"leaf of a differentiated argument must be an array or a number\. Move it "
    r"out of the parameters, or pass it as another argument\.",
  ):
    jaxaccum.value_and_grad(lambda p, b: loss(p["w"], b), 2)(params, BATCH)


def test_mesh_batch_error_names_the_global_batch_and_the_devices():
  mesh = jax.make_mesh((8,), ("data",))
  batch = (jnp.ones((200, 3)), jnp.ones(200))
  fun = jaxaccum.value_and_grad(loss, 4, mesh=mesh, data_axis="data")
  with pytest.raises(
    ValueError,
    match=r"global batch_size=200 on the 8 devices of data axes \('data',\) is 25 rows "
    r"per device.*batch_size=25 is not divisible by num_micro_batches=4",
  ):
    fun(W, batch)


@pytest.mark.parametrize("remat", [None, 0, 1, "yes", 2.0])
def test_remat_takes_a_bool_or_a_policy(remat):
  with pytest.raises(
    TypeError,
    match=rf"^remat must be a bool or a jax\.checkpoint_policies policy \(a "
    rf"callable\), got {re.escape(repr(remat))}\.",
  ):
    jaxaccum.value_and_grad(loss, 2, remat=remat)


@pytest.mark.parametrize(
  ("kwargs", "error", "message"),
  [
    (
      {"argnums": ()},
      TypeError,
      "argnums must be an int or a non-empty tuple of ints.",
    ),
    ({"argnums": (0, 1.0)}, TypeError, "argnums must be an int or a non-empty tuple"),
    ({"argnums": True}, TypeError, "argnums must be an int or a non-empty tuple"),
    ({"argnums": -1}, ValueError, "argnums=-1 must be non-negative."),
    ({"argnums": (0, 0)}, ValueError, "argnums=(0, 0) repeats an argument."),
    ({"batch_argnums": ()}, TypeError, "batch_argnums must be an int or a non-empty"),
    ({"rng_argnum": -2}, ValueError, "rng_argnum=-2 must be non-negative."),
    ({"state_argnum": (3, 3)}, ValueError, "state_argnum=(3, 3) repeats an argument."),
    (
      {"argnums": (0, 1)},
      ValueError,
      "argnums=(0, 1) and batch_argnums=1 overlap: the differentiated "
      "arguments are not split.",
    ),
    (
      {"rng_argnum": 0},
      ValueError,
      "rng_argnum=0 is also in argnums or batch_argnums.",
    ),
    (
      {"state_argnum": 1, "has_aux": True},
      ValueError,
      "state_argnum=1 is also in argnums or batch_argnums.",
    ),
    (
      {"rng_argnum": 2, "state_argnum": 2, "has_aux": True},
      ValueError,
      "rng_argnum=2 and state_argnum=2 are the same argument.",
    ),
    (
      {"state_argnum": 2},
      ValueError,
      "state_argnum needs has_aux=True and fun returning (value, (aux, new_state)).",
    ),
  ],
)
def test_argument_numbers_are_checked_and_named(kwargs, error, message):
  with pytest.raises(error, match="^" + re.escape(message)):
    jaxaccum.value_and_grad(loss, 2, **kwargs)


def test_fun_must_be_callable():
  with pytest.raises(TypeError, match=r"^fun must be callable, got 3\."):
    jaxaccum.value_and_grad(3, 2)


@pytest.mark.parametrize(
  "remat", [True, False, jax.checkpoint_policies.nothing_saveable]
)
def test_remat_accepts_bools_and_policies(remat):
  value, _ = jaxaccum.value_and_grad(loss, 2, remat=remat)(W, BATCH)
  assert float(value) == 1.0


@pytest.mark.parametrize("k", [np.int64(4), np.int32(4), 4])
def test_any_integer_type_is_a_number_of_micro_batches(k):
  value, grads = jaxaccum.value_and_grad(loss, k)(W, BATCH)
  want = jax.value_and_grad(loss)(W, BATCH)
  np.testing.assert_allclose(value, want[0])
  np.testing.assert_allclose(grads, want[1], rtol=1e-6)


@pytest.mark.parametrize("k", [True, 4.0, np.float32(4)])
def test_bools_and_floats_are_not_numbers_of_micro_batches(k):
  with pytest.raises(TypeError, match="num_micro_batches must be an integer"):
    jaxaccum.value_and_grad(loss, k)


def negative_weight_loss(w, batch):
  x, y = batch
  err = (x @ w - y) ** 2
  return jnp.sum(err), jnp.sum(y)  # y holds a negative weight below


def test_negative_weights_are_reported_at_the_call_with_value_checks():
  x = jnp.ones((4, 3))
  y = jnp.array([1.0, 1.0, -5.0, 1.0])
  fun = jaxaccum.value_and_grad(
    negative_weight_loss, 2, normalize="weighted", value_checks=True
  )
  with pytest.raises(Exception, match=r"weights must be finite and >= 0"):
    fun(W, (x, y))
  # Without value_checks, the documented behaviour: the weights are summed as
  # given; a total that is not positive gives zero grads, never NaN.
  value, grads = jaxaccum.value_and_grad(negative_weight_loss, 2, normalize="weighted")(
    W, (x, y)
  )
  assert float(value) == 0.0 and not np.any(grads)


def test_accumulate_names_a_gradient_leaf_of_the_wrong_shape():
  import optax  # noqa: PLC0415

  params = {"layer": {"w": jnp.zeros((3, 2)), "b": jnp.zeros(2)}}
  tx = jaxaccum.accumulate(optax.sgd(0.1), 2)
  state = tx.init(params)
  grads = {"layer": {"w": jnp.zeros((2, 3)), "b": jnp.zeros(2)}}
  with pytest.raises(
    ValueError, match=r"grads\['layer'\]\['w'\] has shape=\(2, 3\).*shape=\(3, 2\)"
  ):
    tx.update(grads, state, params)
