"""normalize="weighted": the exact token mean over padded, variable-length data."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxaccum

VOCAB, WIDTH, LENGTH = 11, 6, 12
# Real tokens per sequence; the rest is padding. The micro-batches of 2
# sequences hold 13, 14, 6 and 17 tokens: very different counts.
LENGTHS = np.array([12, 1, 3, 11, 1, 5, 12, 5])


def token_problem(seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  params = {
    "embed": jax.random.normal(keys[0], (VOCAB, WIDTH)),
    "out": jax.random.normal(keys[1], (WIDTH, VOCAB)) / np.sqrt(WIDTH),
  }
  tokens = jax.random.randint(keys[2], (len(LENGTHS), LENGTH + 1), 0, VOCAB)
  mask = (np.arange(LENGTH)[None, :] < LENGTHS[:, None]).astype(np.float32)
  return params, {"tokens": tokens, "mask": jnp.asarray(mask)}


def token_losses(params, batch):
  inputs, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
  logits = params["embed"][inputs] @ params["out"]
  logp = jax.nn.log_softmax(logits)
  return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def loss_sum_and_tokens(params, batch):
  mask = batch["mask"]
  return jnp.sum(token_losses(params, batch) * mask), jnp.sum(mask)


def full_batch_token_mean(params, batch):
  loss_sum, tokens = loss_sum_and_tokens(params, batch)
  return loss_sum / tokens


@pytest.mark.slow
def test_weighted_equals_full_batch_token_mean():
  params, batch = token_problem()
  got = jax.jit(jaxaccum.value_and_grad(loss_sum_and_tokens, 4, normalize="weighted"))(
    params, batch
  )
  want = jax.value_and_grad(full_batch_token_mean)(params, batch)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_token_mean_is_exact_by_default_where_the_mean_of_means_is_not():
  """The bug of transformers' num_items_in_batch (2024), on the same data:
  the mean of the micro-batches' token means (computed here by hand) is
  measurably wrong, and the same loss, unchanged, under the default
  normalize="mean" is the full batch's token mean."""
  params, batch = token_problem()
  value, grads = jax.value_and_grad(full_batch_token_mean)(params, batch)
  micro = [
    jax.tree.map(lambda x, i=i: x.reshape(4, -1, *x.shape[1:])[i], batch)
    for i in range(4)
  ]
  means = [jax.value_and_grad(full_batch_token_mean)(params, b) for b in micro]
  wrong_value = sum(v for v, _ in means) / 4
  wrong_out = sum(g["out"] for _, g in means) / 4
  assert abs(float(wrong_value - value)) > 1e-2 * abs(float(value))
  rel = jnp.linalg.norm(wrong_out - grads["out"]) / jnp.linalg.norm(grads["out"])
  assert rel > 0.05, rel
  got = jaxaccum.value_and_grad(full_batch_token_mean, 4)(params, batch)
  chex.assert_trees_all_close(got, (value, grads), rtol=1e-5, atol=1e-6)


def test_zero_total_weight_gives_zeros_not_nan():
  params, batch = token_problem()
  batch = dict(batch, mask=jnp.zeros_like(batch["mask"]))
  value, grads = jaxaccum.value_and_grad(loss_sum_and_tokens, 4, normalize="weighted")(
    params, batch
  )
  assert float(value) == 0.0
  for leaf in jax.tree.leaves(grads):
    np.testing.assert_array_equal(leaf, np.zeros_like(leaf))


def test_empty_micro_batch_contributes_nothing():
  params, batch = token_problem()
  mask = batch["mask"].at[2:4].set(0.0)  # micro-batch 1 has no tokens
  batch = dict(batch, mask=mask)
  got = jaxaccum.value_and_grad(loss_sum_and_tokens, 4, normalize="weighted")(
    params, batch
  )
  chex.assert_trees_all_close(
    got,
    jax.value_and_grad(full_batch_token_mean)(params, batch),
    rtol=1e-5,
    atol=1e-6,
  )


def test_weighted_with_aux():
  params, batch = token_problem()

  def fun(p, b):
    loss_sum, tokens = loss_sum_and_tokens(p, b)
    return (loss_sum, tokens), tokens

  (value, tokens), _ = jaxaccum.value_and_grad(
    fun, 4, normalize="weighted", has_aux=True, aux="stack"
  )(params, batch)
  np.testing.assert_array_equal(tokens, [13, 14, 6, 17])
  np.testing.assert_allclose(value, full_batch_token_mean(params, batch), rtol=1e-6)


def test_integer_weights():
  params, batch = token_problem()

  def fun(p, b):
    loss_sum, tokens = loss_sum_and_tokens(p, b)
    return loss_sum, tokens.astype(jnp.int32)

  got = jaxaccum.value_and_grad(fun, 2, normalize="weighted")(params, batch)
  want = jax.value_and_grad(full_batch_token_mean)(params, batch)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
