"""make_train_step: what it hands the optimizer (the parameters, an
unscaled gradient under a loss scale, a state kept in its dtypes) and the
loss (keyword arguments), against ``jax.value_and_grad`` on the full batch
and a plain optimizer update; and its errors for a setup it cannot serve.

The tests were written for mutants that survived mutmut (issue 13), each
watched failing on them; the comment above each names the mutated function.
Skipping a non-finite step: tests/test_train_step_skip.py.
"""

import re

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import jaxaccum

K, M, F = 2, 3, 4


def data(seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  w = jax.random.normal(keys[0], (F,))
  x = jax.random.normal(keys[1], (K * M, F))
  y = jax.random.normal(keys[2], (K * M,))
  return w, (x, y)


def mse(w, batch):
  x, y = batch
  return jnp.mean((jnp.tanh(x @ w) - y) ** 2)


def micro(batch, i, m=M):
  return jax.tree.map(lambda b: b[i * m : (i + 1) * m], batch)


def scaled_sgd(learning_rate=0.1):
  return jaxaccum.accumulate(
    optax.sgd(learning_rate), 1, loss_scale=jaxaccum.dynamic_loss_scale(2.0**4)
  )


# mutmut: _opt_state.find_loss_scale
def test_train_step_finds_the_loss_scale_inside_multisteps():
  """_opt_state.find_loss_scale: MultiSteps not unwrapped."""
  w, batch = data()
  tx = optax.MultiSteps(scaled_sgd(), every_k_schedule=1)
  step = jaxaccum.make_train_step(mse, tx, K, donate=False)
  new_w, opt_state, value = step(w, tx.init(w), batch)

  want_value, grads = jax.value_and_grad(mse)(w, batch)
  chex.assert_trees_all_close(value, want_value, rtol=1e-6)
  chex.assert_trees_all_close(new_w, w - 0.1 * grads, rtol=1e-5, atol=1e-6)
  assert int(opt_state.inner_opt_state.step) == 1


# mutmut: _opt_state.find_loss_scale
def test_two_loss_scales_are_a_clear_error():
  """_opt_state.find_loss_scale: `> 1` -> `> 2`, and the message."""
  w, batch = data()
  tx = optax.chain(scaled_sgd(), scaled_sgd())
  step = jaxaccum.make_train_step(mse, tx, K, donate=False)
  want = (
    "make_train_step multiplies the whole loss by the loss scale, so the "
    "jaxaccum.accumulate(..., loss_scale=...) that unscales it must see "
    "every gradient first: pass it as tx, or first in optax.chain. This "
    "opt_state holds 2 loss scale(s) elsewhere."
  )
  with pytest.raises(ValueError, match=f"^{re.escape(want)}"):
    step(w, tx.init(w), batch)


# mutmut: _train_step.make_train_step
def test_train_step_with_other_argnums_is_a_clear_error():
  """_train_step.make_train_step: the argnums check reads another key, and
  the message."""
  with pytest.raises(
    ValueError,
    match=r"^make_train_step differentiates the parameters, argnums=0\.$",
  ):
    jaxaccum.make_train_step(mse, optax.sgd(0.1), K, argnums=1)


def loss_and_aux(w, batch):
  """The mean loss, and per-example residuals as aux (rows: joined)."""
  x, y = batch
  residual = jnp.tanh(x @ w) - y
  return jnp.mean(residual**2), {"residual": residual}


def token_loss(w, batch):
  """``normalize="weighted"``: a loss sum and its weight (nonzero rows of y)."""
  x, y = batch
  mask = (y > 0).astype(jnp.float32)
  return jnp.sum(mask * (jnp.tanh(x @ w) - y) ** 2), jnp.sum(mask)


def token_loss_and_aux(w, batch):
  """The token loss, and its token mean as aux (averaged by token count)."""
  loss_sum, weight = token_loss(w, batch)
  return (loss_sum, weight), {"token_mean": loss_sum / jnp.maximum(weight, 1.0)}


# mutmut: _train_step.make_train_step
@pytest.mark.slow
@pytest.mark.parametrize("has_aux", [False, True])
@pytest.mark.parametrize("normalize", ["mean", "weighted"])
def test_loss_scaled_train_step_reports_the_unscaled_loss_and_its_aux(
  has_aux, normalize
):
  """_train_step.make_train_step: ``has_aux`` or ``weighted`` lost under a
  loss scale."""
  weighted = normalize == "weighted"
  loss_fn = {
    (False, False): mse,
    (True, False): loss_and_aux,
    (False, True): token_loss,
    (True, True): token_loss_and_aux,
  }[has_aux, weighted]
  w, batch = data()
  tx = scaled_sgd()
  step = jaxaccum.make_train_step(
    loss_fn, tx, K, donate=False, has_aux=has_aux, normalize=normalize
  )
  new_w, opt_state, value = step(w, tx.init(w), batch)

  def reference(w):  # the full-batch mean (token mean when weighted)
    out = loss_fn(w, batch)
    loss = out[0] if has_aux else out
    return loss[0] / loss[1] if weighted else loss

  want_loss, grads = jax.value_and_grad(reference)(w)
  loss = value[0] if has_aux else value
  assert loss.dtype == jnp.float32
  chex.assert_trees_all_close(loss, want_loss, rtol=1e-5)
  if has_aux:  # the full batch's aux, unscaled
    chex.assert_trees_all_close(value[1], loss_fn(w, batch)[1], rtol=1e-6)
  chex.assert_trees_all_close(new_w, w - 0.1 * grads, rtol=1e-5, atol=1e-6)
  assert int(opt_state.step) == 1 and int(opt_state.num_skipped) == 0


# mutmut: _train_step.make_train_step
@pytest.mark.parametrize("scaled", [False, True])
def test_train_step_passes_keyword_arguments_on(scaled):
  """_train_step.make_train_step: keywords dropped, with and without a loss
  scale."""

  def weighted_mse(w, batch, *, factor):
    return factor * mse(w, batch)

  w, batch = data()
  tx = scaled_sgd() if scaled else optax.sgd(0.1)
  step = jaxaccum.make_train_step(weighted_mse, tx, K, donate=False)
  new_w, _, loss = step(w, tx.init(w), batch, factor=3.0)

  want_loss, grads = jax.value_and_grad(weighted_mse)(w, batch, factor=3.0)
  chex.assert_trees_all_close(loss, want_loss, rtol=1e-5)
  chex.assert_trees_all_close(new_w, w - 0.1 * grads, rtol=1e-5, atol=1e-6)


# mutmut: _train_step.make_train_step
def test_train_step_passes_the_params_to_the_optimizer():
  """_train_step.make_train_step: tx.update without params (adamw's weight
  decay needs them)."""
  w, batch = data()
  tx = optax.adamw(0.1, weight_decay=0.5)
  step = jaxaccum.make_train_step(mse, tx, K, donate=False)
  new_w, new_state, _ = step(w, tx.init(w), batch)

  updates, want_state = tx.update(jax.grad(mse)(w, batch), tx.init(w), w)
  chex.assert_trees_all_close(
    new_w, optax.apply_updates(w, updates), rtol=1e-5, atol=1e-6
  )
  chex.assert_trees_all_close(new_state, want_state, rtol=1e-5, atol=1e-6)


# mutmut: _train_step.make_train_step
def test_train_step_keeps_the_optimizer_state_dtypes():
  """_train_step.make_train_step: the optimizer state not cast back; float32
  updates into adam's bfloat16 moments would promote them."""
  w, batch = data()
  w = w.astype(jnp.bfloat16)
  to_float32 = optax.stateless(
    lambda updates, params: jax.tree.map(lambda u: u.astype(jnp.float32), updates)
  )
  tx = optax.chain(to_float32, optax.adam(0.1))
  state = tx.init(w)
  step = jaxaccum.make_train_step(mse, tx, K, donate=False)
  new_w, new_state, _ = step(w, state, batch)

  updates, want_state = tx.update(jax.grad(mse)(w, batch), state, w)
  assert want_state[1][0].mu.dtype == jnp.float32  # the premise: promoted
  want_state = jax.tree.map(lambda n, o: n.astype(o.dtype), want_state, state)
  chex.assert_trees_all_equal_dtypes(new_state, state)
  chex.assert_trees_all_close(new_state, want_state, rtol=1e-2, atol=1e-3)
  chex.assert_trees_all_close(
    new_w, optax.apply_updates(w, updates), rtol=1e-2, atol=1e-2
  )
  assert new_w.dtype == jnp.bfloat16


def test_a_step_checks_and_partitions_once_per_configuration(monkeypatch):
  """The checks before jit and the parameters' partition depend only on the
  call's configuration (structure, leaf types and dtypes): a later call of
  a configuration seen before runs neither (on every call they were most of
  the step's Python time, benchmarks/README.md), a new one runs both."""
  from jaxaccum import _static, _value_and_grad  # noqa: PLC0415

  calls = []
  validate, partition = _value_and_grad.Step.validate, _static.partition

  def counted_validate(self, args):
    calls.append("validate")
    return validate(self, args)

  def counted_partition(tree):
    calls.append("partition")
    return partition(tree)

  monkeypatch.setattr(_value_and_grad.Step, "validate", counted_validate)
  monkeypatch.setattr(_static, "partition", counted_partition)
  w, batch = data()
  tx = optax.sgd(0.1)
  step = jaxaccum.make_train_step(mse, tx, K)
  opt_state = tx.init(w)
  w, opt_state, _ = step(w, opt_state, batch)
  # The checks (the swapped-arguments check partitions the parameters) and
  # the partition, then the trace's own check and partition (once, in jit,
  # where value_and_grad's step partitions its arguments).
  assert calls == ["validate", *["partition"] * 4]
  for _ in range(2):
    w, opt_state, _ = step(w, opt_state, batch)
  assert len(calls) == 5
  x, y = batch
  w, opt_state, _ = step(w, opt_state, (x, y.astype(jnp.bfloat16)))
  assert calls[5:7] == ["validate", "partition"]
  n = len(calls)
  w, opt_state, _ = step(w, opt_state, (x, y.astype(jnp.bfloat16)))
  assert len(calls) == n
  # An error is raised again on the next call: a configuration that fails
  # its checks is not recorded.
  for _ in range(2):
    with pytest.raises(TypeError, match="is a str"):
      step(w, opt_state, (x, "y"))


def test_an_integer_leaf_where_a_float_was_is_static():
  """The configuration a step records holds the leaves' dtypes: an integer
  array in the place of an earlier call's float array is a static leaf (no
  gradient, back as it was), not differentiated."""

  def loss(params, batch):
    return mse(params["w"] * jnp.sum(params["n"]), batch)

  w, batch = data()
  tx = optax.sgd(0.1)
  step = jaxaccum.make_train_step(loss, tx, K, donate=False)
  as_float = {"n": jnp.ones(2), "w": w}
  step(as_float, tx.init(as_float), batch)
  as_int = {"n": jnp.ones(2, jnp.int32), "w": w}
  new, _, value = step(as_int, tx.init({"n": None, "w": w}), batch)
  assert new["n"] is as_int["n"]
  want_value, want = jax.value_and_grad(loss)(as_float, batch)
  chex.assert_trees_all_close(value, want_value, rtol=1e-6)
  chex.assert_trees_all_close(new["w"], w - 0.1 * want["w"], rtol=1e-5, atol=1e-6)
