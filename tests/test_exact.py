"""Exact by default: a loss built from sums over its rows, unchanged, gives
the full batch's value and gradient under ``normalize="mean"`` (the
default), against ``jax.value_and_grad`` of the whole batch, where the
mean of the micro-batches' losses is measurably off (the micro-batches
hold different token counts). The read itself is in
``tests/test_exact_read.py``."""

import warnings

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jaxaccum

B, T, V, D, K = 16, 6, 11, 8, 4


def tokens_and_mask(seed=0):
  """Padded rows whose real lengths grow with the row: micro-batch ``i``
  holds far fewer tokens than micro-batch ``k - 1``."""
  tok = jax.random.randint(jax.random.key(seed), (B, T), 0, V)
  lengths = 1 + (jnp.arange(B) * T) // B
  mask = (jnp.arange(T)[None, :] < lengths[:, None]).astype(jnp.float32)
  return tok, mask


class LM(nnx.Module):
  """A small transformer LM: embedding, one causal attention block, head."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(V, D, rngs=rngs)
    self.norm = nnx.LayerNorm(D, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(2, D, rngs=rngs, decode=False)
    self.head = nnx.Linear(D, V, rngs=rngs)

  def __call__(self, tok):
    h = self.embed(tok)
    mask = nnx.make_causal_mask(tok)
    h = h + self.attention(self.norm(h), mask=mask)
    return self.head(h)


def lm_loss(model, batch):
  """The most common LM loss: a token-weighted mean over padded rows."""
  tok, mask = batch
  logits = model(tok[:, :-1])
  token_loss = optax.softmax_cross_entropy_with_integer_labels(logits, tok[:, 1:])
  return jnp.sum(token_loss * mask[:, 1:]) / jnp.sum(mask[:, 1:])


def micro_mean(fun, args, batch_at=1, k=K):
  """The mean of the ``k`` micro-batches' values and gradients: the answer
  the default gave before it was exact (the reference of what is wrong)."""
  batch = args[batch_at]
  outs = []
  for i in range(k):
    part = jax.tree.map(lambda x, i=i: x.reshape(k, -1, *x.shape[1:])[i], batch)
    call = list(args)
    call[batch_at] = part
    outs.append(fun(*call))
  return jax.tree.map(lambda *x: sum(x) / k, *outs)


def relative(a, b):
  num = jnp.sqrt(
    sum(
      jnp.sum((x - y) ** 2)
      for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )
  )
  den = jnp.sqrt(sum(jnp.sum(y**2) for y in jax.tree.leaves(b)))
  return float(num / den)


def test_the_nnx_lm_s_token_mean_is_exact_unchanged():
  """The issue's NNX LM: its loss, unchanged, through
  jaxaccum.nnx.value_and_grad and make_train_step, equals the full batch;
  the mean of the micro-batches' token means is 10%+ off."""
  model = LM(nnx.Rngs(0))
  batch = tokens_and_mask()
  value, grads = nnx.value_and_grad(lm_loss)(model, batch)
  got_value, got_grads = jaxaccum.nnx.value_and_grad(lm_loss, K)(model, batch)
  chex.assert_trees_all_close(got_value, value, rtol=1e-5)
  assert relative(nnx.state(got_grads), nnx.state(grads)) < 1e-5
  _, wrong = micro_mean(nnx.value_and_grad(lm_loss), (model, batch))
  assert relative(nnx.state(wrong), nnx.state(grads)) > 0.1

  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  want = jax.tree.map(  # before the step, which donates the model's arrays
    lambda p, g: p - 0.1 * g, nnx.state(model, nnx.Param), nnx.state(grads, nnx.Param)
  )
  step = jaxaccum.nnx.make_train_step(lm_loss, optimizer, K)
  loss = step(model, batch)
  chex.assert_trees_all_close(loss, value, rtol=1e-5)
  chex.assert_trees_all_close(nnx.state(model, nnx.Param), want, rtol=1e-5, atol=1e-6)


def head(w, tok):
  return jnp.tanh(w["emb"][tok]) @ w["out"]


def params():
  k1, k2 = jax.random.split(jax.random.key(1))
  return {"emb": jax.random.normal(k1, (V, D)), "out": jax.random.normal(k2, (D, V))}


def ce(w, tok):
  return optax.softmax_cross_entropy_with_integer_labels(head(w, tok), tok)


LOSSES = {
  "optax mean(where=mask)": lambda w, b: ce(w, b[0]).mean(where=b[1] > 0),
  "sum / max(count, 1)": lambda w, b: (
    jnp.sum(ce(w, b[0]) * b[1]) / jnp.maximum(jnp.sum(b[1]), 1.0)
  ),
  "a sum": lambda w, b: jnp.sum(ce(w, b[0]) * b[1]),
  "a ratio of two means": lambda w, b: (
    jnp.mean(head(w, b[0]) ** 2) / jnp.mean(jnp.abs(head(w, b[0])) + 1.0)
  ),
  "a mean plus a penalty": lambda w, b: (
    jnp.mean(ce(w, b[0])) + 1e-2 * jnp.sum(w["out"] ** 2)
  ),
  # MaxText's loss: per-token cross entropy, summed over real tokens and
  # divided by their count (plus a z-loss of the same form)
  "maxtext's": lambda w, b: (
    jnp.sum((ce(w, b[0]) + 1e-4 * jax.nn.logsumexp(head(w, b[0]), -1) ** 2) * b[1])
    / (jnp.sum(b[1]) + 1e-8)
  ),
}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_a_loss_of_sums_equals_the_full_batch_under_jit(name):
  loss = LOSSES[name]
  w, batch = params(), tokens_and_mask(1)
  want = jax.value_and_grad(loss)(w, batch)
  got = jax.jit(jaxaccum.value_and_grad(loss, K))(w, batch)
  chex.assert_trees_all_close(got[0], want[0], rtol=1e-5)
  assert relative(got[1], want[1]) < 2e-6, name


def test_a_mean_with_aux_keeps_its_aux_and_is_exact():
  """With has_aux, the aux is combined as before (a row leaf concatenated,
  a scalar averaged), and the masked mean is exact."""

  def loss(w, b):
    per_token = ce(w, b[0])
    value = jnp.sum(per_token * b[1]) / jnp.sum(b[1])
    return value, {"per_row": jnp.sum(per_token, -1), "tokens": jnp.sum(b[1])}

  w, batch = params(), tokens_and_mask(2)
  (value, aux), grads = jaxaccum.value_and_grad(loss, K, has_aux=True)(w, batch)
  (want, want_aux), want_grads = jax.value_and_grad(loss, has_aux=True)(w, batch)
  chex.assert_trees_all_close(value, want, rtol=1e-5)
  assert relative(grads, want_grads) < 2e-6
  chex.assert_trees_all_close(aux["per_row"], want_aux["per_row"], rtol=1e-5)
  chex.assert_trees_all_close(aux["tokens"], want_aux["tokens"] / K)  # the mean


def test_make_train_step_and_equinox_are_exact():
  eqx = pytest.importorskip("equinox")
  model = eqx.nn.MLP(D, V, 16, 2, key=jax.random.key(3))
  x = jax.random.normal(jax.random.key(4), (B, D))
  _, mask = tokens_and_mask(3)
  weights = mask[:, 0] + mask[:, -1]  # rows weighted 1 or 2, some 0

  def loss(m, batch):
    x, weight = batch
    return jnp.sum(jnp.sum(jax.vmap(m)(x) ** 2, -1) * weight) / jnp.sum(weight)

  value, grads = eqx.filter_value_and_grad(loss)(model, (x, weights))
  got, got_grads = jaxaccum.value_and_grad(loss, K)(model, (x, weights))
  chex.assert_trees_all_close(got, value, rtol=1e-5)
  arrays = lambda t: eqx.filter(t, eqx.is_inexact_array)  # noqa: E731
  assert relative(arrays(got_grads), arrays(grads)) < 2e-6
  tx = optax.sgd(0.1)
  step = jaxaccum.make_train_step(loss, tx, K, donate=False)
  new, _, loss_value = step(model, tx.init(arrays(model)), (x, weights))
  chex.assert_trees_all_close(loss_value, value, rtol=1e-5)
  want = jax.tree.map(lambda p, g: p - 0.1 * g, arrays(model), arrays(grads))
  chex.assert_trees_all_close(arrays(new), want, rtol=1e-5, atol=1e-6)


def test_a_batch_statistic_per_row_keeps_the_mean_of_micro_batches_and_warns():
  """A loss that is not of the form (BatchNorm over the batch, then a masked
  mean) keeps the mean of the micro-batches' losses, and says once that it
  divides by a count computed from the batch."""

  def loss(w, b):
    h = head(w, b[0])
    h = (h - h.mean((0, 1), keepdims=True)) / (h.std((0, 1), keepdims=True) + 1e-3)
    return jnp.sum(jnp.sum(h**2, -1) * b[1]) / jnp.sum(b[1])

  w, batch = params(), tokens_and_mask(4)
  with pytest.warns(UserWarning, match="uses the rows other than through sums"):
    got = jaxaccum.value_and_grad(loss, K)(w, batch)
  want = micro_mean(jax.value_and_grad(loss), (w, batch))
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_shape_of_the_micro_batch_s_own_keeps_the_mean_and_never_breaks_the_step():
  """The read traces fun at twice its rows too (to tell a count of rows from
  a constant). A fun with its micro-batch's shape written in does not trace
  there, and one that branches on it traces another program: the step runs,
  as the mean of the micro-batches' losses, and a masked mean says why,
  where a plain mean (exact that way) says nothing."""
  rows = B // K

  def pinned(loss):
    def pinned_loss(w, b):
      b[0].reshape(rows, T)  # the micro-batch's shape, written in
      return loss(w, b)

    return pinned_loss

  def masked(w, b):
    return jnp.sum(ce(w, b[0]) * b[1]) / jnp.sum(b[1])

  def plain(w, b):
    return jnp.mean(ce(w, b[0]))

  w, batch = params(), tokens_and_mask(4)
  with pytest.warns(UserWarning, match=r"twice the rows \(TypeError: cannot reshape"):
    got = jaxaccum.value_and_grad(pinned(masked), K)(w, batch)
  want = micro_mean(jax.value_and_grad(masked), (w, batch))
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)

  def branching(w, b):  # another program at twice the rows: one more op
    return masked(w, b) if b[0].shape[0] == rows else masked(w, b) * jnp.ones(())

  with pytest.warns(UserWarning, match="program changes with the number of rows"):
    got = jaxaccum.value_and_grad(branching, K)(w, batch)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    got = jaxaccum.value_and_grad(pinned(plain), K)(w, batch)
  want = jax.value_and_grad(plain)(w, batch)
  chex.assert_trees_all_close(got[0], want[0], rtol=1e-5)
  assert relative(got[1], want[1]) < 1e-5
