"""verify_equivalence's verdicts: a correct conversion passes, and a wrong
one fails naming its cause.

The model is a Flax NNX transformer LM whose attention has a key bias:
softmax is invariant to it, so its gradient is zero up to float rounding,
and a tolerance relative to each leaf's own size failed every correct
conversion on it, at any ``rtol`` (and blamed it for every wrong one).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxaccum

V, D, T, ROWS, K = 32, 16, 12, 16, 4


class LM(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(V, D, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(2, D, decode=False, rngs=rngs)  # biases
    self.norm = nnx.LayerNorm(D, rngs=rngs)
    self.out = nnx.Linear(D, V, rngs=rngs)

  def __call__(self, tokens):
    h = self.embed(tokens)
    h = h + self.attn(h, mask=nnx.make_causal_mask(tokens))
    return self.out(self.norm(h))


def token_losses(model, batch):
  tokens, mask = batch
  logits = model(tokens[:, :-1])
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
  return ce * mask[:, 1:], mask[:, 1:]


def token_sum(model, batch):
  """Converted right: (loss_sum, token count) with normalize="weighted"."""
  losses, mask = token_losses(model, batch)
  return jnp.sum(losses), jnp.sum(mask)


def token_mean(model, batch):
  """The token mean as written before jaxaccum, exact by default."""
  losses, mask = token_losses(model, batch)
  return jnp.sum(losses) / jnp.sum(mask)


def row_sum(model, batch):
  return jnp.sum(token_losses(model, batch)[0])


def batch():
  tokens = jax.random.randint(jax.random.key(1), (ROWS, T), 0, V)
  lengths = jax.random.randint(jax.random.key(2), (ROWS,), 2, T + 1)
  return tokens, (jnp.arange(T)[None, :] < lengths[:, None]).astype(jnp.float32)


def full_batch_grads(fun):
  """The reference: nnx.grad on the whole batch."""
  return nnx.grad(fun)(LM(nnx.Rngs(0)), batch())


def test_a_transformer_whose_key_bias_gradient_is_rounding_passes():
  model, data = LM(nnx.Rngs(0)), batch()
  # The key bias's gradient is rounding: the whole gradient's largest
  # magnitude is 1e7 times it. Judged against its own size, the
  # accumulated one differs from it by more than 1e-5 of it (the old check
  # failed, at any rtol up to 1).
  got = jaxaccum.nnx.grad(token_sum, K, normalize="weighted")(model, data)
  want = nnx.grad(lambda m, b: token_sum(m, b)[0] / token_sum(m, b)[1])(model, data)
  bias, want_bias = got["attn"]["key"]["bias"][...], want["attn"]["key"]["bias"][...]
  scale = max(float(jnp.max(jnp.abs(leaf))) for leaf in jax.tree.leaves(want))
  assert float(jnp.max(jnp.abs(want_bias))) < 1e-6 * scale
  assert float(jnp.max(jnp.abs(bias - want_bias))) > 1e-5 * float(
    jnp.max(jnp.abs(want_bias))
  )

  deviation = jaxaccum.nnx.verify_equivalence(
    token_sum, (model, data), K, normalize="weighted"
  )
  np.testing.assert_allclose(deviation.scale, scale, rtol=1e-6)
  assert deviation.grads <= 1e-5 * deviation.scale
  assert deviation.value <= 1e-5 * 4  # the loss is about 3.9


def test_a_token_mean_is_exact_by_default():
  """The token mean as written before jaxaccum is read as a ratio of sums
  over rows (exact by default): the check passes with the defaults."""
  data = batch()
  assert len({float(jnp.sum(m[:, 1:])) for m in jnp.split(data[1], K)}) == K
  deviation = jaxaccum.nnx.verify_equivalence(token_mean, (LM(nnx.Rngs(0)), data), K)
  assert deviation.grads <= 1e-5 * deviation.scale
  assert deviation.value <= 1e-5 * 4


def sorted_token_mean(model, batch):
  """A token mean whose sum runs over the batch's losses sorted together:
  not read as sums over rows, so each micro-batch's mean weighs the same."""
  losses, mask = token_losses(model, batch)
  return jnp.sum(jnp.sort(losses.reshape(-1))) / jnp.sum(mask)


def test_an_unread_token_mean_fails_naming_the_normalization():
  """The value differs too, so the message points at how the loss combines
  (normalize="weighted"), and the worst leaf is a real one, not the key
  bias whose gradient is rounding."""
  with (
    pytest.warns(UserWarning, match="divides by a quantity computed from the batch"),
    pytest.raises(AssertionError) as error,
  ):
    jaxaccum.nnx.verify_equivalence(sorted_token_mean, (LM(nnx.Rngs(0)), batch()), K)
  message = str(error.value)
  assert message.startswith(
    "Accumulated and full-batch results differ, with normalize='mean':\n"
    "  value differs by "
  )
  assert 'return (loss_sum, weight) and pass normalize="weighted"' in message
  assert "['key']['bias']" not in message
  assert len(message) < 900, message


def test_a_row_sum_is_exact_by_default():
  deviation = jaxaccum.nnx.verify_equivalence(row_sum, (LM(nnx.Rngs(0)), batch()), K)
  assert deviation.grads <= 1e-5 * deviation.scale


def test_an_unread_row_sum_with_mean_names_normalize_sum():
  def sorted_row_sum(model, batch):
    return jnp.sum(jnp.sort(token_losses(model, batch)[0].reshape(-1)))

  args = (LM(nnx.Rngs(0)), batch())
  with pytest.raises(AssertionError, match=r"4 times the accumulated one.*"):
    jaxaccum.nnx.verify_equivalence(sorted_row_sum, args, K)
  with pytest.raises(AssertionError, match=r'pass normalize="sum"\.$'):
    jaxaccum.nnx.verify_equivalence(sorted_row_sum, args, K)


def test_a_mean_with_sum_names_normalize_mean():
  def row_mean(model, batch):
    return jnp.mean(token_losses(model, batch)[0])

  with pytest.raises(
    AssertionError,
    match=r"accumulated value is 4 times the full batch\'s: fun returns a mean "
    r'over its rows; pass normalize="mean"\.$',
  ):
    jaxaccum.nnx.verify_equivalence(
      row_mean, (LM(nnx.Rngs(0)), batch()), K, normalize="sum"
    )


def test_interacting_examples_fail_naming_them():
  """Batch statistics over the rows: the value differs, and no mode helps."""

  def batch_norm_loss(w, x):
    h = x @ w
    h = (h - h.mean(0, keepdims=True)) / (h.std(0, keepdims=True) + 1e-3)
    return jnp.mean(jnp.tanh(h) ** 2)

  w = jax.random.normal(jax.random.key(0), (3, 5))
  x = jax.random.normal(jax.random.key(1), (16, 3))
  with pytest.raises(AssertionError, match=r"the examples interact \(batch statistics"):
    jaxaccum.verify_equivalence(batch_norm_loss, (w, x), K)


@pytest.mark.filterwarnings("ignore:jaxaccum. the loss divides")
def test_the_tolerance_is_atol_plus_rtol_times_the_whole_gradients_scale():
  """|accumulated - full| <= atol + rtol * scale, scale the largest magnitude
  of the whole full-batch gradient (the value's: its own): on the wrong
  conversion, the reported deviation is the boundary either way."""
  model, data = LM(nnx.Rngs(0)), batch()
  want = full_batch_grads(sorted_token_mean)
  scale = max(float(jnp.max(jnp.abs(leaf))) for leaf in jax.tree.leaves(want))
  loose = jaxaccum.nnx.verify_equivalence(sorted_token_mean, (model, data), K, rtol=1.0)
  np.testing.assert_allclose(loose.scale, scale, rtol=1e-6)
  worst = loose.grads / loose.scale  # well above the value's
  assert loose.value / 3.0 < worst / 10 and "['key']['bias']" not in loose.where
  verify = lambda **tol: jaxaccum.nnx.verify_equivalence(  # noqa: E731
    sorted_token_mean, (model, data), K, **tol
  )
  verify(rtol=worst * 1.001)
  with pytest.raises(AssertionError, match=r"1 of 13 leaves differ"):
    verify(rtol=worst * 0.999)
  both = max(loose.grads, loose.value)
  verify(rtol=0.0, atol=both * 1.001)
  with pytest.raises(AssertionError, match="differ"):
    verify(rtol=0.0, atol=both * 0.999)


@pytest.mark.parametrize("name", ["state_argnum", "noise_stats"])
def test_state_and_noise_stats_are_refused(name):
  """They have no full-batch counterpart (jaxaccum.nnx's refusal is tested
  in test_nnx.py)."""

  def loss(w, x, state):
    return jnp.mean((x @ w) ** 2), (None, state + 1)

  option = {"state_argnum": 2} if name == "state_argnum" else {"noise_stats": True}
  with pytest.raises(
    ValueError,
    match=rf"^verify_equivalence compares with one full-batch call; {name} has "
    "no full-batch counterpart",
  ):
    jaxaccum.verify_equivalence(
      loss, (jnp.ones(3), jnp.ones((8, 3)), jnp.zeros(())), 2, has_aux=True, **option
    )
