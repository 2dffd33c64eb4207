"""Bad input raises a ValueError at trace time that names the sizes."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxaccum


def loss(w, batch):
  x, y = batch
  return jnp.mean((x @ w - y) ** 2)


W = jnp.zeros(3)
BATCH = (jnp.ones((12, 3)), jnp.ones(12))


def trace(fun, *args):
  """Traces without running: errors must come from tracing alone."""
  return jax.eval_shape(fun, *args)


PAD_HINT = (
  "Or pad the batch with jaxaccum.pad_batch(batch, {}), which returns "
  '(padded_batch, mask), and use the mask as the weight with normalize="weighted": '
  "fun returns (jnp.sum(losses * mask), jnp.sum(mask))."
)


def test_batch_not_divisible_by_k_names_the_leaf_the_ks_that_fit_and_padding():
  with pytest.raises(ValueError) as error:
    trace(jaxaccum.value_and_grad(loss, 5), W, BATCH)
  assert str(error.value) == (
    "batch_size=12 (the rows of args[1][0]) is not divisible by "
    "num_micro_batches=5. The num_micro_batches up to 5 that divide 12: 1, 2, 3, "
    "4. " + PAD_HINT.format(5)
  )


def test_batch_not_divisible_by_micro_batch_size():
  with pytest.raises(ValueError) as error:
    trace(jaxaccum.value_and_grad(loss, micro_batch_size=5), W, BATCH)
  assert str(error.value) == (
    "batch_size=12 (the rows of args[1][0]) is not divisible by "
    "micro_batch_size=5. The micro_batch_size up to 5 that divide 12: 1, 2, 3, "
    "4. " + PAD_HINT.format("micro_batch_size=5")
  )


def test_more_micro_batches_than_rows_says_so():
  batch = {"tokens": jnp.ones((256, 2))}
  with pytest.raises(ValueError) as error:
    trace(
      jaxaccum.value_and_grad(lambda w, b: loss(w, (b["tokens"], 0.0)), 512),
      W[:2],
      batch,
    )
  assert str(error.value) == (
    "num_micro_batches=512 is more than the 256 rows of args[1]['tokens']: each "
    "micro-batch needs at least one row. The num_micro_batches up to 256 that "
    "divide 256: ..., 2, 4, 8, 16, 32, 64, 128, 256. " + PAD_HINT.format(512)
  )
  with pytest.raises(ValueError) as error:
    trace(jaxaccum.value_and_grad(loss, micro_batch_size=16), W, BATCH)
  assert str(error.value) == (
    "micro_batch_size=16 is more than the 12 rows of args[1][0]: a micro-batch "
    "cannot hold more rows than the batch has. The micro_batch_size up to 12 "
    "that divide 12: 1, 2, 3, 4, 6, 12. " + PAD_HINT.format("micro_batch_size=16")
  )


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
  with pytest.raises(ValueError) as error:
    trace(jaxaccum.value_and_grad(loss, 2), W, (jnp.ones((12, 3)), jnp.ones(())))
  assert str(error.value) == (
    "Batch leaf args[1][1] is a scalar (shape=()); every batch leaf needs a "
    "leading batch axis."
  )


def test_a_batch_without_arrays_is_named():
  """(mutmut: _split.leading_batch_size; this and the three messages around
  it are matched whole.)"""
  with pytest.raises(ValueError) as error:
    jaxaccum.value_and_grad(lambda w, batch: jnp.sum(w), 2)(W, ())
  assert str(error.value) == "The batch arguments ['args[1]'] hold no arrays to split."


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
  with pytest.raises(
    ValueError, match=r"pair \(value, aux\), got a tuple of length 3\."
  ):
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


NNX_POINTER = (
  "args[0] is (or holds) an nnx object, Linear. jaxaccum.value_and_grad works "
  "on pytrees of arrays; for Flax NNX models use jaxaccum.nnx.value_and_grad(fun, "
  "k)(model, batch), which splits the model, differentiates its nnx.Param "
  "variables and writes its other state back; the whole step is "
  "jaxaccum.nnx.make_train_step(fun, optimizer, k), and the check against the "
  "full batch jaxaccum.nnx.verify_equivalence(fun, (model, batch), k)."
)


def test_an_nnx_model_points_to_jaxaccum_nnx():
  from flax import nnx  # noqa: PLC0415

  model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
  fun = lambda m, b: jnp.mean(m(b[0]))  # noqa: E731
  with pytest.raises(ValueError) as error:
    jaxaccum.value_and_grad(fun, 2)(model, BATCH)
  assert str(error.value) == NNX_POINTER
  with pytest.raises(ValueError) as error:
    jaxaccum.verify_equivalence(fun, (model, BATCH), 2)
  assert str(error.value) == NNX_POINTER
  with pytest.raises(ValueError) as error:
    jaxaccum.make_train_step(fun, optax.sgd(0.1), 2)(model, None, BATCH)
  assert str(error.value) == NNX_POINTER


@pytest.mark.parametrize("name", ["a_name", "z_name"])  # before and after "w"
def test_a_string_in_the_parameters_is_static_with_no_gradient(name):
  """A leaf jax.grad refuses makes the argument partitioned, as
  eqx.filter_value_and_grad does (tests/test_equinox.py): its gradient is
  None, the other leaves' are the full batch's."""
  params = {"w": W, name: "encoder"}
  fun = lambda p, b: loss(p["w"], b) if p[name] == "encoder" else None  # noqa: E731
  value, grads = jaxaccum.value_and_grad(fun, 2)(params, BATCH)
  want_value, want = jax.value_and_grad(loss)(W, BATCH)
  assert grads[name] is None
  np.testing.assert_allclose(value, want_value, rtol=1e-6)
  np.testing.assert_allclose(grads["w"], want, rtol=1e-6)


def test_mesh_batch_error_names_the_global_batch_and_the_devices():
  mesh = jax.make_mesh((8,), ("data",))
  batch = (jnp.ones((200, 3)), jnp.ones(200))
  fun = jaxaccum.value_and_grad(loss, 4, mesh=mesh, data_axis="data")
  with pytest.raises(ValueError) as error:
    fun(W, batch)
  assert str(error.value) == (
    "The global batch_size=200 on the 8 devices of data axes ('data',) is 25 "
    "rows per device, and per device: batch_size=25 (the rows of args[1][0]) is "
    "not divisible by num_micro_batches=4. The num_micro_batches up to 4 that "
    "divide 25: 1. " + PAD_HINT.format(32)
  )


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
    ({"argnums": (0, 0)}, ValueError, "argnums=(0, 0) repeats an argument."),
    ({"batch_argnums": ()}, TypeError, "batch_argnums must be an int or a non-empty"),
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
  # given and the sums divided by the total, as the full batch divides.
  value, grads = jaxaccum.value_and_grad(negative_weight_loss, 2, normalize="weighted")(
    W, (x, y)
  )

  def full(w, batch):
    loss_sum, weight = negative_weight_loss(w, batch)
    return loss_sum / weight

  want = jax.value_and_grad(full)(W, (x, y))
  chex.assert_trees_all_close((value, grads), want, rtol=1e-6)


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


# -- Messages that say what to do (issue 18) ---------------------------------


@pytest.mark.parametrize(
  "split", [{"micro_batch_size": 2}, {"num_micro_batches": 2}], ids=["m", "k"]
)
def test_an_empty_batch_is_a_clear_error(split):
  """The message names the size the user gave (mutmut: _split.plan_split)."""
  empty = (jnp.ones((0, 3)), jnp.ones(0))
  with pytest.raises(ValueError) as error:
    jaxaccum.value_and_grad(loss, **split)(W, empty)
  ((name, value),) = split.items()
  assert str(error.value) == (
    "The batch is empty (batch_size=0): nothing to split into micro-batches "
    f"({name}={value})."
  )


def test_a_python_list_in_the_batch_is_named_as_a_list():
  rows = [[1.0, 2.0, 3.0]] * 4
  with pytest.raises(TypeError) as error:
    jaxaccum.value_and_grad(loss, 2)(W, (rows, jnp.ones(4)))
  assert str(error.value) == (
    "Batch leaf args[1][0] is a Python list, not an array: pass "
    "jnp.asarray(...) of it (JAX would take each element of a list as a leaf "
    "of its own)."
  )


def test_a_string_in_the_batch_is_named():
  def uses_x(w, batch):
    return jnp.mean(batch[0] @ w)

  with pytest.raises(TypeError) as error:
    jaxaccum.value_and_grad(uses_x, 2)(W, (jnp.ones((4, 3)), "abc"))
  assert str(error.value) == (
    "Batch leaf args[1][1] is a str ('abc'), not an array: pass Python values "
    "as arguments outside batch_argnums, which reach every micro-batch "
    "unchanged."
  )


def test_a_shape_error_hints_at_batch_argnums_when_another_argument_looks_like_a_batch():
  """loss(w, x, y) with the default batch_argnums=1 splits x and not y."""

  def three_args(w, x, y):
    return jnp.mean((x @ w - y) ** 2)

  with (
    pytest.warns(jaxaccum.SharedArgumentWarning),
    pytest.raises(TypeError) as error,
  ):
    jaxaccum.value_and_grad(three_args, 2)(W, jnp.ones((4, 3)), jnp.ones(4))
  note = "\n".join(getattr(error.value, "__notes__", []))
  assert (
    "jaxaccum splits only batch_argnums=(1,); args[2] also has the batch's "
    "leading size 4 and was passed whole to every micro-batch. Did you mean "
    "batch_argnums=(1, 2)?"
  ) in note


def test_two_suspects_and_a_scalar_argument_get_one_hint():
  """(mutmut: _checks.batch_argnums_hint: the plural, the join of the names,
  and a scalar argument, whose missing leading axis crashed the hint.)"""

  def four(w, x, y, z, scale):
    return jnp.mean((x @ w - y - z) ** 2) * scale

  with (
    pytest.warns(jaxaccum.SharedArgumentWarning),
    pytest.raises(TypeError) as error,
  ):
    jaxaccum.value_and_grad(four, 2)(W, jnp.ones((4, 3)), jnp.ones(4), jnp.ones(4), 2.0)
  assert error.value.__notes__[0] == (
    "jaxaccum splits only batch_argnums=(1,); args[2], args[3] also have the "
    "batch's leading size 4 and were passed whole to every micro-batch. Did "
    "you mean batch_argnums=(1, 2, 3)?"
  )


def test_the_hint_counts_in_the_users_positions_under_nnx():
  """jaxaccum.nnx puts two arguments of its own in front; the hint names
  the user's (mutmut: _checks.batch_argnums_hint's offsets)."""
  model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))

  def three(model, x, y):
    return jnp.mean((model(x) - y) ** 2)

  with (
    pytest.warns(jaxaccum.SharedArgumentWarning),
    pytest.raises(TypeError) as error,
  ):
    jaxaccum.nnx.value_and_grad(three, 2)(model, jnp.ones((4, 3)), jnp.ones((4, 2)))
  assert error.value.__notes__[0] == (
    "jaxaccum splits only batch_argnums=(1,); args[2] also has the batch's "
    "leading size 4 and was passed whole to every micro-batch. Did you mean "
    "batch_argnums=(1, 2)?"
  )


def test_a_string_in_the_aux_is_named():
  def with_name(w, batch):
    return loss(w, batch), {"name": "hi", "n": 1}

  with pytest.raises(TypeError) as error:
    jaxaccum.value_and_grad(with_name, 2, has_aux=True)(W, BATCH)
  assert str(error.value) == (
    "fun returned aux['name'], a str ('hi'): jaxaccum stacks the aux of every "
    "micro-batch into arrays, so it holds arrays and numbers only. Return "
    "other values from outside the accumulated function."
  )


def test_a_flat_triple_under_weighted_has_aux_shows_the_nesting():
  def flat(w, batch):
    x, y = batch
    return jnp.sum((x @ w - y) ** 2), jnp.float32(12), None

  want = (
    'has_aux=True with normalize="weighted" needs fun to return '
    "((loss_sum, weight), aux), got a tuple of length 3."
  )
  with pytest.raises(ValueError, match="^" + re.escape(want)):
    jaxaccum.value_and_grad(flat, 2, normalize="weighted", has_aux=True)(W, BATCH)


def test_an_rng_argnum_that_is_not_a_key_is_named():
  def with_key(w, batch, key):
    return loss(w, batch)

  with pytest.raises(TypeError) as error:
    jaxaccum.value_and_grad(with_key, 2, rng_argnum=2)(W, BATCH, jnp.ones(2))
  assert str(error.value) == (
    "rng_argnum=2 points at args[2], a float32 array of shape=(2,), not a PRNG "
    "key: pass jax.random.key(seed) (or a raw key from jax.random.PRNGKey), or "
    "leave rng_argnum out."
  )


def test_param_specs_of_the_wrong_structure_are_named():
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  mesh = jax.make_mesh((8,), ("data",))
  params = {"a": jnp.zeros(3), "b": jnp.zeros(3)}

  def two(p, batch):
    return loss(p["a"] + p["b"], batch)

  fun = jaxaccum.value_and_grad(
    two, 2, mesh=mesh, data_axis="data", param_specs={"a": P(), "c": P()}
  )
  batch = (jnp.ones((16, 3)), jnp.ones(16))
  with pytest.raises(
    ValueError, match=r"^param_specs does not match the structure of args\[0\]"
  ):
    jax.jit(fun)(params, batch)


def test_donated_parameters_used_again_say_donate_false():
  import optax  # noqa: PLC0415

  step = jaxaccum.make_train_step(loss, optax.sgd(0.1), 2)
  w, opt_state = jnp.zeros(3), optax.sgd(0.1).init(jnp.zeros(3))
  step(w, opt_state, BATCH)
  with pytest.raises(
    ValueError,
    match=r"^make_train_step donates params and opt_state, and the params "
    r"passed were donated to an earlier call: pass the ones that call "
    r"returned, or build the step with donate=False\.",
  ):
    step(w, opt_state, BATCH)


def test_an_accumulate_state_restored_as_a_dict_says_how_to_restore():
  import optax  # noqa: PLC0415

  tx = jaxaccum.accumulate(optax.sgd(0.1), 2)
  state = tx.init(W)
  with pytest.raises(
    TypeError,
    match=r"^accumulate\(\)'s update got a dict as its state, not an "
    r"AccumulateState: restore a checkpoint with tx\.init\(params\) as the target",
  ):
    tx.update(W, state._asdict(), W)


@pytest.mark.parametrize("every_k", [0, lambda step: 0], ids=["int", "callable"])
def test_every_k_of_zero_is_an_error_also_from_a_callable(every_k):
  import optax  # noqa: PLC0415

  with pytest.raises(ValueError, match=r"^every_k must be positive, got every_k=0\."):
    tx = jaxaccum.accumulate(optax.sgd(0.1), every_k)
    tx.init(W)


def test_a_state_aux_that_is_an_array_is_described_not_named_by_its_tracer():
  def no_pair(w, batch, state):
    return loss(w, batch), state

  want = (
    "state_argnum needs fun to return (value, (aux, new_state)), got an aux "
    "that is one array of shape=(), not a pair."
  )
  with pytest.raises(ValueError, match="^" + re.escape(want)):
    jaxaccum.value_and_grad(no_pair, 2, state_argnum=2, has_aux=True)(
      W, BATCH, jnp.zeros(())
    )


def test_noise_stats_with_one_micro_batch_is_an_error():
  with pytest.raises(
    ValueError,
    match=r"^noise_stats=True needs at least 2 micro-batches in total, got 1: "
    r"one micro-batch has no noise to measure\.",
  ):
    jaxaccum.value_and_grad(loss, 1, noise_stats=True)(W, BATCH)


@pytest.mark.parametrize(
  "kwargs", [{"argnums": -2}, {"batch_argnums": -1}, {"argnums": (-2,)}]
)
def test_negative_argument_numbers_count_from_the_end_as_in_jax(kwargs):
  value, grads = jaxaccum.value_and_grad(loss, 2, **kwargs)(W, BATCH)
  want = jax.value_and_grad(loss, argnums=kwargs.get("argnums", 0))(W, BATCH)
  chex.assert_trees_all_close((value, grads), want, rtol=1e-6)


def test_a_numpy_integer_argnums_returns_the_tree_as_jax_does():
  """argnums=np.int64(0) passed validation but the output code tested
  isinstance(argnums, int) and returned a 1-tuple of gradients."""
  _, grads = jaxaccum.value_and_grad(loss, 2, argnums=np.int64(0))(W, BATCH)
  _, want = jax.value_and_grad(loss, argnums=np.int64(0))(W, BATCH)
  assert jax.tree.structure(grads) == jax.tree.structure(want)
  chex.assert_trees_all_close(grads, want, rtol=1e-6)


def test_argument_errors_name_the_users_positions_under_nnx():
  """jaxaccum.nnx shifts positions by two inside; the user's batch is
  argument 1, and that is what the error names."""
  from flax import nnx  # noqa: PLC0415

  model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))

  def nnx_loss(model, batch):
    x, y = batch
    return jnp.mean((model(x)[:, 0] - y) ** 2)

  with pytest.raises(
    ValueError, match=r"Batch leaves have different leading sizes \(args\[1\]\[0\]: 12"
  ):
    jaxaccum.nnx.value_and_grad(nnx_loss, 2)(model, (jnp.ones((12, 3)), jnp.ones(10)))


def test_a_negative_batch_argnums_error_names_no_state_argnum():
  with pytest.raises(ValueError) as error:
    jaxaccum.value_and_grad(loss, 5, batch_argnums=-1)(W, BATCH)
  assert "state_argnum" not in str(error.value)
  assert "batch_size=12 (the rows of args[1][0]) is not divisible by " in str(
    error.value
  )


def test_a_value_is_described_by_its_type_unless_it_is_an_array():
  """(mutmut: _checks.describe: a shape without a dtype is not an array, and
  anything else is named by its own type.)"""
  import types  # noqa: PLC0415

  from jaxaccum import _checks  # noqa: PLC0415

  assert (
    _checks.describe(types.SimpleNamespace(shape=(2,))) == "a types.SimpleNamespace"
  )

  def with_key(w, batch, key):
    return loss(w, batch)

  with pytest.raises(TypeError) as error:
    jaxaccum.value_and_grad(with_key, 2, rng_argnum=2)(W, BATCH, "seed")
  assert str(error.value).startswith("rng_argnum=2 points at args[2], a str, not")


def test_make_train_step_names_a_leaf_it_cannot_take_as_value_and_grad_does():
  """A str in the batch: make_train_step raised JAX's raw "Error interpreting
  argument ... as an abstract array" before the step's own checks ran."""
  batch = (BATCH[0], ["row"] * 12)
  with pytest.raises(TypeError) as direct:
    jaxaccum.value_and_grad(loss, 2)(W, batch)
  step = jaxaccum.make_train_step(loss, optax.sgd(0.1), 2)
  with pytest.raises(TypeError) as stepped:
    step(W, optax.sgd(0.1).init(W), batch)
  assert str(stepped.value) == str(direct.value)
  assert str(direct.value).startswith("Batch leaf args[1][1][0] is a str ('row'),")


def test_no_message_cuts_a_type_name_short():
  """A custom_jvp (jax.nn.relu) was shown as ``(<jax._src.custom_derivatives.custom_jvp )``:
  a repr cut at 40 characters. Types are named whole, and a repr only where it fits."""
  full = "a jax._src.custom_derivatives.custom_jvp"

  def with_function(w, batch):
    return loss(w, batch), {"act": jax.nn.relu}

  with pytest.raises(TypeError) as error:
    jaxaccum.value_and_grad(with_function, 2, has_aux=True)(W, BATCH)
  assert str(error.value).startswith(f"fun returned aux['act'], {full}: jaxaccum")
  with pytest.raises(TypeError) as error:
    jaxaccum.value_and_grad(loss, 2)(W, (BATCH[0], [jax.nn.relu] * 12))
  assert str(error.value).startswith(
    f"Batch leaf args[1][1][0] is {full}, not an array: pass"
  )


CLOSED_OVER = (
  "The function was called with 1 positional arguments, but argnums=(0,), "
  "batch_argnums=(1,), rng_argnum=None and state_argnum=None refer to more. "
  "batch_argnums=(1,) points past them, and jaxaccum splits only the batch it "
  "is given as an argument. If fun closes over its batch (lambda params: "
  "loss(params, batch)), take the batch as an argument instead, fun(params, "
  "batch), and pass it in the call, at batch_argnums=(1,); if it is among the "
  "1 arguments, point batch_argnums at it."
)


def test_a_loss_that_closes_over_its_batch_is_told_to_take_it_as_an_argument():
  """It got "... refer to more.", which did not say that the batch must be an
  argument."""
  closed = lambda w: loss(w, BATCH)  # noqa: E731
  with pytest.raises(ValueError) as error:
    jaxaccum.value_and_grad(closed, 2)(W)
  assert str(error.value) == CLOSED_OVER
  step = jaxaccum.make_train_step(closed, optax.sgd(0.1), 2)
  with pytest.raises(ValueError) as error:
    step(W, optax.sgd(0.1).init(W))
  assert str(error.value) == CLOSED_OVER
  model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError) as error:
    jaxaccum.nnx.value_and_grad(lambda m: jnp.mean(m(BATCH[0])), 2)(model)
  assert str(error.value) == CLOSED_OVER


@pytest.mark.parametrize("aux", [None, {"acc": jnp.ones(())}])
def test_a_swapped_new_state_and_aux_is_called_swapped(aux):
  """(value, (new_state, aux)) where (value, (aux, new_state)) belongs got a
  bare structure mismatch."""

  def swapped(w, batch, state):
    return loss(w, batch), ({"n": state["n"] + 1}, aux)

  with pytest.raises(ValueError) as error:
    jaxaccum.value_and_grad(swapped, 2, has_aux=True, state_argnum=2)(
      W, BATCH, {"n": jnp.zeros(())}
    )
  message = str(error.value)
  assert message.startswith(
    "state_argnum needs fun to return (value, (aux, new_state)), and fun "
    "returned (value, (new_state, aux)) it seems: the first of the pair has "
    "the state's structure, shapes and dtypes, the second does not"
  )
  assert message.endswith("Swap the pair: return value, (aux, new_state).")


def test_a_new_state_of_another_structure_says_what_fun_returns():
  def grows(w, batch, state):
    return loss(w, batch), (None, {**state, "extra": state["n"]})

  with pytest.raises(ValueError) as error:
    jaxaccum.value_and_grad(grows, 2, has_aux=True, state_argnum=2)(
      W, BATCH, {"n": jnp.zeros(())}
    )
  assert str(error.value).endswith(
    "Under state_argnum fun returns (value, (aux, new_state)), new_state like "
    "the state it got."
  )


# -- Swapped arguments and lists of rows -------------------------------------

V, D = 16, 4
EMBED = jax.random.normal(jax.random.key(0), (V, D))
TOKENS = jax.random.randint(jax.random.key(1), (8, 5), 0, V)


def tied_lm(batch, embed):
  """An LM whose only parameter is its (tied) embedding table, written
  batch first: ``fun(batch, params)``."""
  logits = embed[batch] @ embed.T
  picked = jnp.take_along_axis(logits, batch[..., None], -1)[..., 0]
  return jnp.mean(jax.nn.logsumexp(logits, -1) - picked)


SWAPPED = (
  "argnums=0 differentiates args[0], which holds no floating-point array: "
  "int32[8, 5]; there is no gradient to take (jax.grad refuses integers). Are "
  "the parameters and the batch swapped? The batch, split along its leading "
  "axis, is args[1] (batch_argnums=1): float32[16, 4]. Pass (params, batch), "
  "or set argnums= and batch_argnums=."
)


def test_swapped_params_and_batch_are_refused_where_jax_refuses_them():
  """fun(batch, params) with the defaults differentiates the tokens and
  splits the embedding table's rows as the batch. jax.grad refuses the
  integer tokens; jaxaccum, partitioning the argument as Equinox does, made
  them static and returned (nan, None): no gradient, silently."""
  with pytest.raises(TypeError, match="grad requires real- or complex-valued"):
    jax.value_and_grad(tied_lm)(TOKENS, EMBED)
  with pytest.raises(ValueError) as error:
    jaxaccum.value_and_grad(tied_lm, 4)(TOKENS, EMBED)
  assert str(error.value) == SWAPPED
  with pytest.raises(ValueError) as error:
    jax.jit(jaxaccum.value_and_grad(tied_lm, 4))(TOKENS, EMBED)
  assert str(error.value) == SWAPPED
  step = jaxaccum.make_train_step(tied_lm, optax.sgd(0.1), 4)
  with pytest.raises(ValueError) as error:
    step(TOKENS, optax.sgd(0.1).init(TOKENS), EMBED)
  assert str(error.value) == SWAPPED
  # The fix the message names: the full batch's gradient.
  got = jaxaccum.value_and_grad(tied_lm, 4, argnums=1, batch_argnums=0)(TOKENS, EMBED)
  chex.assert_trees_all_close(
    got, jax.value_and_grad(tied_lm, argnums=1)(TOKENS, EMBED), rtol=1e-5, atol=1e-7
  )


def test_what_jax_takes_is_not_called_swapped():
  """No false alarm: an argument with no leaves (jax.grad gives {}), one
  with a float leaf beside an integer one (partitioned, as Equinox does),
  and Python floats (jax.grad takes them)."""
  x = jnp.ones((8, 3))
  value, grads = jaxaccum.value_and_grad(lambda p, x: jnp.mean(x), 2)({}, x)
  assert grads == {} and float(value) == 1.0
  params = {"w": jnp.ones(3), "step": jnp.int32(3)}
  grads = jaxaccum.grad(lambda p, x: jnp.mean(x @ p["w"]), 2)(params, x)
  assert grads["step"] is None
  assert float(jaxaccum.grad(lambda s, x: s * jnp.mean(x), 2)(2.0, x)) == 1.0


ROWS = [jax.random.normal(jax.random.key(i), (16,)) for i in range(64)]
LABELS = jnp.arange(64) % 10
STACK_ROWS = (
  "Batch args[1][0] is a Python list of 64 arrays of shape (16,), one per "
  "example? Each is a batch leaf of its own, split along its own first axis. "
  "Stack them into one array with a leading batch axis: jnp.stack(rows), of "
  "shape (64, 16)."
)


def classify(w, batch):
  x, y = batch
  return optax.softmax_cross_entropy_with_integer_labels(x @ w, y).mean()


def test_a_list_of_rows_with_array_labels_is_told_to_stack_them():
  """Each row a leaf of its own, with leading size 16 against the labels'
  64: the message listed all 65 leaves (1,361 characters)."""
  w = jnp.zeros((16, 10))
  with pytest.raises(ValueError) as error:
    jaxaccum.value_and_grad(classify, 4)(w, (ROWS, LABELS))
  assert str(error.value) == STACK_ROWS and len(STACK_ROWS) < 300
  step = jaxaccum.make_train_step(classify, optax.sgd(0.1), 4)
  with pytest.raises(ValueError) as error:
    step(w, optax.sgd(0.1).init(w), (ROWS, LABELS))
  assert str(error.value) == STACK_ROWS
  # The fix: the full batch's gradient.
  got = jaxaccum.value_and_grad(classify, 4)(w, (jnp.stack(ROWS), LABELS))
  want = jax.value_and_grad(classify)(w, (jnp.stack(ROWS), LABELS))
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
  ("batch", "message"),
  [
    (  # rows alone, 3 features for 4 micro-batches
      [jnp.ones(3)] * 8,
      "Batch args[1] is a Python list of 8 arrays of shape (3,), one per "
      "example? Each is a batch leaf of its own, split along its own first "
      "axis. Stack them into one array with a leading batch axis: "
      "jnp.stack(rows), of shape (8, 3).",
    ),
    (  # (x, y) pairs, y a scalar
      [(jnp.ones(3), jnp.float32(1.0))] * 8,
      "Batch args[1] is a Python list of 8 tuples of arrays, one per example? "
      "Each is a batch leaf of its own, split along its own first axis. Stack "
      "them into one array with a leading batch axis: "
      "jax.tree.map(lambda *xs: jnp.stack(xs), *rows).",
    ),
    (  # scalar labels
      (jnp.ones((8, 3)), [jnp.float32(1.0)] * 8),
      "Batch args[1][1] is a Python list of 8 arrays of shape (), one per "
      "example? Each is a batch leaf of its own, split along its own first "
      "axis. Stack them into one array with a leading batch axis: "
      "jnp.stack(rows), of shape (8,).",
    ),
  ],
  ids=["rows", "pairs", "scalars"],
)
def test_every_list_of_rows_is_told_to_stack_them(batch, message):
  with pytest.raises(ValueError) as error:
    trace(jaxaccum.value_and_grad(lambda w, b: jnp.float32(0.0), 4), W, batch)
  assert str(error.value) == message


def test_leaves_of_different_sizes_are_listed_by_size():
  """A list of equal arrays is a batch as any tuple (crops of one batch):
  only the sizes that differ, each size once with a count."""
  batch = ([jnp.ones((12, 3))] * 5, jnp.ones(10))
  with pytest.raises(ValueError) as error:
    trace(jaxaccum.value_and_grad(lambda w, b: jnp.float32(0.0), 2), W, batch)
  assert str(error.value) == (
    "Batch leaves have different leading sizes (args[1][0][0] and 4 more: 12, "
    "args[1][1]: 10); they must share one batch axis."
  )
  crops = [jnp.ones((12, 3))] * 5
  _, grads = jaxaccum.value_and_grad(lambda w, b: jnp.mean(sum(c @ w for c in b)), 2)(
    W, crops
  )
  assert grads.shape == (3,)
