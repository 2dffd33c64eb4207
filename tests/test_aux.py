"""The aux comes back as the full batch's: rows joined, other leaves averaged.

The reference is the full batch's own aux, from ``jax.value_and_grad`` on the
whole batch. A row leaf (logits, per-example losses) must come back with the
batch's rows in batch order; a mean over a micro-batch's rows (accuracy) must
come back as the mean over the whole batch, weighted by token counts under
``normalize="weighted"`` (so micro-batches of unequal counts tell a weighted
mean from a plain one). Values per row are computed per row on both sides, so
they agree to a few roundings; means over rows to the roundings of a sum.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum

B, F, C = 16, 5, 3
# float32 unit roundoff times the terms a row or a mean over B rows sums.
RTOL = 2 * (B + F) * float(jnp.finfo(jnp.float32).eps)


def problem(seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  w = jax.random.normal(keys[0], (F, C))
  x = jax.random.normal(keys[1], (B, F))
  labels = jax.random.randint(keys[2], (B,), 0, C)
  return w, (x, labels)


def classifier(w, batch):
  """Cross-entropy, with an aux of every kind: rows, rows with trailing
  axes, a mean over rows, and a dict nested in it."""
  x, labels = batch
  logits = x @ w
  per_example = -jnp.take_along_axis(
    jax.nn.log_softmax(logits), labels[:, None], axis=1
  )[:, 0]
  aux = {
    "logits": logits,
    "per_example": per_example,
    "outer": jnp.einsum("bf,bc->bfc", x, logits),
    "metrics": {
      "accuracy": jnp.mean(jnp.argmax(logits, axis=1) == labels),
      "mean_logit": jnp.mean(logits),
    },
  }
  return jnp.mean(per_example), aux


def full_batch_aux(fun, *args):
  (_, aux), _ = jax.value_and_grad(fun, has_aux=True)(*args)
  return aux


@pytest.mark.parametrize("k", [1, 4])
def test_the_default_aux_is_the_full_batchs_aux(k):
  """A stacked aux, a mean of rows, or rows out of order all fail here."""
  w, batch = problem()
  (_, aux), _ = jax.jit(jaxaccum.value_and_grad(classifier, k, has_aux=True))(w, batch)
  want = full_batch_aux(classifier, w, batch)
  chex.assert_trees_all_equal_shapes_and_dtypes(aux, want)
  chex.assert_trees_all_close(aux, want, rtol=RTOL, atol=RTOL)


def test_at_one_micro_batch_the_aux_is_funs_own_bit_for_bit():
  w, batch = problem()
  (_, aux), _ = jax.jit(jaxaccum.value_and_grad(classifier, 1, has_aux=True))(w, batch)
  (_, want), _ = jax.jit(jax.value_and_grad(classifier, has_aux=True))(w, batch)
  chex.assert_trees_all_equal(aux, want)


def token_metrics(w, batch):
  """A weighted loss over real rows, and metrics that are means over them."""
  x, labels, mask = batch
  _, aux = classifier(w, (x, labels))
  per_example = aux["per_example"]
  count = jnp.sum(mask)
  correct = (jnp.argmax(aux["logits"], axis=1) == labels) * mask
  metrics = {
    "token_accuracy": jnp.sum(correct) / jnp.maximum(count, 1.0),
    "token_loss": jnp.sum(per_example * mask) / jnp.maximum(count, 1.0),
    "per_example": per_example,
  }
  return (jnp.sum(per_example * mask), count), metrics


def weighted_problem():
  """Micro-batches of 4 rows (k = 4) with 4, 1, 0 and 3 real rows."""
  w, (x, labels) = problem(1)
  mask = jnp.array([1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 1, 0, 1, 1], jnp.float32)
  return w, (x, labels, mask)


def full_batch_token_metrics(w, batch):
  x, labels, mask = batch
  _, aux = classifier(w, (x, labels))
  count = jnp.sum(mask)
  correct = (jnp.argmax(aux["logits"], axis=1) == labels) * mask
  return {
    "token_accuracy": jnp.sum(correct) / count,
    "token_loss": jnp.sum(aux["per_example"] * mask) / count,
    "per_example": aux["per_example"],
  }


def test_weighted_means_are_the_full_batchs_token_means():
  """A plain mean over micro-batches (unequal token counts) fails here."""
  w, batch = weighted_problem()
  (value, aux), _ = jax.jit(
    jaxaccum.value_and_grad(token_metrics, 4, has_aux=True, normalize="weighted")
  )(w, batch)
  want = full_batch_token_metrics(w, batch)
  chex.assert_trees_all_close(aux, want, rtol=RTOL, atol=RTOL)
  # The token loss as a metric is the loss itself.
  np.testing.assert_allclose(aux["token_loss"], value, rtol=RTOL)


def test_a_batch_of_padding_only_gives_zero_means_not_nan():
  w, (x, labels, mask) = weighted_problem()
  (_, aux), _ = jaxaccum.value_and_grad(
    token_metrics, 4, has_aux=True, normalize="weighted"
  )(w, (x, labels, jnp.zeros_like(mask)))
  assert float(aux["token_accuracy"]) == 0.0 and float(aux["token_loss"]) == 0.0


def mesh_of(n, axis_type=jax.sharding.AxisType.Explicit):
  return jax.make_mesh(
    (n,), ("data",), axis_types=(axis_type,), devices=jax.devices()[:n]
  )


def test_on_a_mesh_rows_come_back_in_batch_order_and_means_weighted():
  """4 devices x k = 2: the aux and its weights must both be in device-major
  order (a weight per micro-batch in loop order gives another mean)."""
  w, batch = weighted_problem()
  mesh = mesh_of(4)
  sharded = jax.device_put(batch, NamedSharding(mesh, P("data")))
  (_, aux), _ = jax.jit(
    jaxaccum.value_and_grad(
      token_metrics, 2, has_aux=True, normalize="weighted", mesh=mesh, data_axis="data"
    )
  )(w, sharded)
  want = full_batch_token_metrics(w, batch)
  chex.assert_trees_all_close(aux, want, rtol=RTOL, atol=RTOL)
  # (mutmut: _aux._join) The rows stay on their devices: no reshard.
  assert aux["per_example"].sharding.spec == P("data")

  (_, aux), _ = jax.jit(
    jaxaccum.value_and_grad(classifier, 2, has_aux=True, mesh=mesh, data_axis="data")
  )(w, sharded[:2])
  want = full_batch_aux(classifier, w, batch[:2])
  chex.assert_trees_all_close(aux, want, rtol=RTOL, atol=RTOL)


def test_on_an_hsdp_mesh_rows_stay_sharded_over_both_data_axes():
  """(mutmut: _aux._join, a tuple of mesh axes taken as one name.)"""
  w, batch = problem()
  mesh = jax.make_mesh(
    (2, 2),
    ("replica", "data"),
    axis_types=(jax.sharding.AxisType.Explicit,) * 2,
    devices=jax.devices()[:4],
  )
  sharded = jax.device_put(batch, NamedSharding(mesh, P(("replica", "data"))))
  (_, aux), _ = jax.jit(
    jaxaccum.value_and_grad(
      classifier, 2, has_aux=True, mesh=mesh, data_axis=("replica", "data")
    )
  )(w, sharded)
  chex.assert_trees_all_close(
    aux, full_batch_aux(classifier, w, batch), rtol=RTOL, atol=RTOL
  )
  assert aux["per_example"].sharding.spec == P(("replica", "data"))


def test_under_plain_jit_a_sharded_batch_comes_back_in_batch_order():
  """The batch on 4 devices, k = 2: each micro-batch holds a slice of each
  of 4 blocks, and joining them as contiguous rows would shuffle the rows."""
  w, batch = problem()
  mesh = mesh_of(4, jax.sharding.AxisType.Auto)
  sharded = jax.device_put(batch, NamedSharding(mesh, P("data")))
  (_, aux), _ = jax.jit(jaxaccum.value_and_grad(classifier, 2, has_aux=True))(
    w, sharded
  )
  want = full_batch_aux(classifier, w, batch)
  chex.assert_trees_all_close(aux, want, rtol=RTOL, atol=RTOL)


class Linear(nnx.Module):
  def __init__(self, w):
    self.w = nnx.Param(w)

  def __call__(self, x):
    return x @ self.w[...]


def test_nnx_aux_is_the_full_batchs():
  w, batch = problem()
  model = Linear(w)

  def loss(model, batch):
    return classifier(model.w[...], batch)

  (_, aux), _ = nnx.jit(jaxaccum.nnx.value_and_grad(loss, 4, has_aux=True))(
    model, batch
  )
  want = full_batch_aux(classifier, w, batch)
  chex.assert_trees_all_close(aux, want, rtol=RTOL, atol=RTOL)


@pytest.mark.slow
def test_a_per_leaf_spec_sets_each_leafs_type():
  w, batch = problem()
  spec = {
    "logits": "stack",
    "per_example": "concatenate",
    "outer": "stack",
    "metrics": {"accuracy": "sum", "mean_logit": "mean"},
  }
  (_, aux), _ = jaxaccum.value_and_grad(classifier, 4, has_aux=True, aux=spec)(w, batch)
  micro = [
    classifier(w, jax.tree.map(lambda a, i=i: a[4 * i : 4 * i + 4], batch))[1]
    for i in range(4)
  ]
  want = full_batch_aux(classifier, w, batch)
  np.testing.assert_allclose(aux["logits"], jnp.stack([a["logits"] for a in micro]))
  np.testing.assert_allclose(aux["per_example"], want["per_example"], rtol=RTOL)
  np.testing.assert_allclose(
    aux["metrics"]["accuracy"], sum(a["metrics"]["accuracy"] for a in micro)
  )
  np.testing.assert_allclose(
    aux["metrics"]["mean_logit"], want["metrics"]["mean_logit"], rtol=RTOL, atol=RTOL
  )


def test_a_prefix_spec_covers_a_subtree_and_stack_is_010s_aux():
  w, batch = problem()
  (_, aux), _ = jaxaccum.value_and_grad(
    classifier,
    4,
    has_aux=True,
    aux={"logits": "auto", "per_example": "auto", "outer": "auto", "metrics": "stack"},
  )(w, batch)
  assert aux["metrics"]["accuracy"].shape == (4,)
  assert aux["logits"].shape == (B, C)
  (_, stacked), _ = jaxaccum.value_and_grad(classifier, 4, has_aux=True, aux="stack")(
    w, batch
  )
  assert stacked["logits"].shape == (4, B // 4, C)
  np.testing.assert_allclose(
    jaxaccum.merge_micro_batches(stacked["logits"]), aux["logits"], rtol=RTOL
  )


def test_a_leaf_whose_leading_axis_has_the_row_count_by_coincidence_is_joined():
  """The documented ambiguity: a per-class vector of as many entries as a
  micro-batch has rows looks like rows; naming its type fixes it."""
  w, batch = problem()

  def per_class(w, batch):
    x, _ = batch
    logits = x @ w
    return jnp.mean(logits**2), jnp.mean(logits, axis=0)  # (C,), C == m == 3

  x, labels = batch
  batch = (x[:12], labels[:12])  # k = 4 micro-batches of m = 3 = C rows
  (_, aux), _ = jaxaccum.value_and_grad(per_class, 4, has_aux=True)(w, batch)
  assert aux.shape == (12,)
  (_, aux), _ = jaxaccum.value_and_grad(per_class, 4, has_aux=True, aux="mean")(
    w, batch
  )
  chex.assert_trees_all_close(
    aux, full_batch_aux(per_class, w, batch), rtol=RTOL, atol=RTOL
  )


def test_means_keep_float_dtypes_and_make_integers_float32():
  def fun(w, x):
    return jnp.mean(x * w), {
      "bf16": jnp.mean(x).astype(jnp.bfloat16),
      "count": jnp.sum(x > 0).astype(jnp.int32),
    }

  x = jnp.arange(8.0) - 3.0
  for k in (1, 4):
    (_, aux), _ = jaxaccum.value_and_grad(fun, k, has_aux=True)(1.0, x)
    assert aux["bf16"].dtype == jnp.bfloat16
    assert aux["count"].dtype == jnp.float32
    np.testing.assert_allclose(aux["count"], 4.0 / k)  # rows 1, 2, 3, 4
  (_, aux), _ = jaxaccum.value_and_grad(fun, 4, has_aux=True, aux="sum")(1.0, x)
  assert aux["count"].dtype == jnp.int32 and int(aux["count"]) == 4
  assert aux["bf16"].dtype == jnp.bfloat16


def test_a_sum_adds_the_micro_batches_entry_by_entry():
  """(mutmut: _aux._sum over every axis.) Per-class counts: the full batch's."""

  def per_class(w, batch):
    x, labels = batch
    return jnp.mean((x @ w) ** 2), jnp.sum(jax.nn.one_hot(labels, C), axis=0)

  w, batch = problem()
  (_, aux), _ = jaxaccum.value_and_grad(per_class, 4, has_aux=True, aux="sum")(w, batch)
  np.testing.assert_array_equal(aux, full_batch_aux(per_class, w, batch))


def test_state_argnum_combines_the_aux_and_returns_the_final_state():
  def fun(w, x, count):
    return jnp.mean(x * w), (x * w, count + 1)

  (_, (aux, count)), _ = jaxaccum.value_and_grad(fun, 4, has_aux=True, state_argnum=2)(
    2.0, jnp.arange(8.0), jnp.zeros((), jnp.int32)
  )
  np.testing.assert_array_equal(aux, 2.0 * jnp.arange(8.0))
  assert int(count) == 4


# -- bad specs: every message whole -----------------------------------------


def test_an_unknown_type_is_named_at_definition_time():
  with pytest.raises(ValueError) as error:
    jaxaccum.value_and_grad(classifier, 4, has_aux=True, aux={"logits": "max"})
  assert str(error.value) == (
    "Unknown aux='max'; choose one of ['auto', 'concatenate', 'mean', "
    "'stack', 'sum'], or a tree prefix of fun's aux with these as leaves."
  )
  with pytest.raises(ValueError) as error:
    jaxaccum.value_and_grad(classifier, 4, has_aux=True, aux={})
  assert str(error.value) == (
    "aux={} names no accumulation type; choose one of ['auto', 'concatenate', "
    "'mean', 'stack', 'sum'], or a tree prefix of fun's aux with these as leaves."
  )


def test_aux_without_has_aux_is_refused():
  with pytest.raises(ValueError) as error:
    jaxaccum.value_and_grad(classifier, 4, aux="stack")
  assert str(error.value) == "aux='stack' combines fun's aux; it needs has_aux=True."


def test_a_spec_that_is_not_a_prefix_of_the_aux_is_named():
  w, batch = problem()
  with pytest.raises(ValueError) as error:
    jaxaccum.value_and_grad(classifier, 4, has_aux=True, aux={"logits": "stack"})(
      w, batch
    )
  assert str(error.value) == (
    "aux={'logits': 'stack'} is not a tree prefix of fun's aux, whose structure "
    "is PyTreeDef({'logits': *, 'metrics': {'accuracy': *, 'mean_logit': *}, "
    "'outer': *, 'per_example': *}): give one type for all leaves, or a tree "
    "like the aux's top with a type per subtree."
  )


def test_concatenating_a_scalar_names_the_leaf():
  w, batch = problem()
  with pytest.raises(ValueError) as error:
    jaxaccum.value_and_grad(classifier, 4, has_aux=True, aux="concatenate")(w, batch)
  assert str(error.value) == (
    "aux=\"concatenate\" for aux['metrics']['accuracy'], a scalar per "
    'micro-batch: it has no axis to join along. Use "mean", "sum" or "stack" '
    "for it."
  )


def test_concatenating_rows_that_do_not_split_into_the_blocks_names_the_leaf():
  """Under plain jit over 4 devices, each micro-batch's rows come from 4
  blocks; a leading axis of 2 cannot be put back in their order."""
  mesh = mesh_of(4)
  x = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("data")))

  def fun(w, x):
    return jnp.mean(x * w), jnp.stack([jnp.min(x), jnp.max(x)])

  with pytest.raises(ValueError) as error:
    jax.jit(jaxaccum.value_and_grad(fun, 2, has_aux=True, aux="concatenate"))(1.0, x)
  assert str(error.value) == (
    'aux="concatenate" for aux, of shape=(2,) per micro-batch: its leading axis '
    "does not split into the 4 blocks that each micro-batch's rows come from "
    '(a batch sharded over devices under plain jit). Use "stack" for it.'
  )


def test_a_float64_mean_stays_float64_under_x64():
  """(mutmut: _aux._mean averaging in float32 whatever the leaf.)"""

  def fun(w, x):
    return jnp.mean(x * w), jnp.mean(x)

  with jax.enable_x64(True):
    x = 1.0 + jnp.arange(8, dtype=jnp.float64) * 1e-10
    (_, aux), _ = jaxaccum.value_and_grad(fun, 4, has_aux=True)(jnp.float64(1.0), x)
    assert aux.dtype == jnp.float64
    np.testing.assert_allclose(aux, jnp.mean(x), rtol=1e-15)


def test_under_plain_jit_on_explicit_axes_rows_stay_on_their_devices():
  """(mutmut: _aux._reshape without the rows' sharding.) The batch on 4
  devices of an Explicit mesh, k = 2: each micro-batch holds a slice of each
  of 4 blocks, joined back without moving a row."""
  mesh = mesh_of(4)
  x = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("data")))

  def fun(w, x):
    return jnp.mean(x * w), x * w

  (_, aux), _ = jax.jit(jaxaccum.value_and_grad(fun, 2, has_aux=True))(2.0, x)
  np.testing.assert_array_equal(aux, 2.0 * jnp.arange(16.0))
  assert aux.sharding.spec == P("data")
