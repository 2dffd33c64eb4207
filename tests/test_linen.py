"""The Flax Linen recipe (rng_argnum + state_argnum) against a plain Python loop.

The recipe, as in examples/convnet_batchnorm.py: ``loss_fn(params, batch,
dropout_key, batch_stats)`` applies the model with ``mutable=["batch_stats"]``
and ``rngs={"dropout": dropout_key}`` and returns ``(loss, (aux,
new_batch_stats))``; ``jaxaccum.value_and_grad(loss_fn, k, rng_argnum=2,
state_argnum=3, has_aux=True)``. The reference runs ``jax.value_and_grad`` on
micro-batch ``i`` (rows ``i*m .. (i+1)*m - 1``) with the key
``fold_in(key, i)`` and the statistics micro-batch ``i - 1`` produced, then
averages. The model has BatchNorm and Dropout, so a wrong key or a dropped
statistics update changes the result.
"""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxaccum

K, M, F, H = 4, 6, 5, 8


class Net(nn.Module):
  """Dense -> BatchNorm -> softplus -> Dropout -> Dense; also returns the mask."""

  @nn.compact
  def __call__(self, x, *, train):
    h = nn.Dense(H)(x)
    h = nn.BatchNorm(use_running_average=not train, momentum=0.9)(h)
    h = nn.softplus(h) + 0.1  # strictly positive: a zero marks a dropped unit
    h = nn.Dropout(0.5, deterministic=not train)(h)
    return nn.Dense(1)(h)[:, 0], h == 0.0


MODEL = Net()


def loss_fn(params, batch, dropout_key, batch_stats):
  x, y = batch
  (pred, dropped), updates = MODEL.apply(
    {"params": params, "batch_stats": batch_stats},
    x,
    train=True,
    rngs={"dropout": dropout_key},
    mutable=["batch_stats"],
  )
  loss = jnp.mean((pred - y) ** 2)
  aux = {"dropped": dropped, "pred_mean": jnp.mean(pred)}
  return loss, (aux, updates["batch_stats"])


def problem():
  keys = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(keys[0], (K * M, F))
  y = jnp.sin(jnp.sum(x, axis=1))
  variables = MODEL.init(keys[1], x[:M], train=False)
  # Non-trivial running statistics, so that the momentum update is visible.
  batch_stats = jax.tree.map(
    lambda s: s + 0.3 * jax.random.normal(keys[2], s.shape), variables["batch_stats"]
  )
  return variables["params"], (x, y), keys[3], batch_stats


def accumulated(params, batch, key, batch_stats):
  return jax.jit(
    jaxaccum.value_and_grad(loss_fn, K, rng_argnum=2, state_argnum=3, has_aux=True)
  )(params, batch, key, batch_stats)


def reference(params, batch, key, batch_stats, *, fold=True, thread=True):
  """The Python loop; ``fold``/``thread`` switch off the key and the state."""
  values, grads, auxes, stats = [], [], [], batch_stats
  for i in range(K):
    rows = slice(i * M, (i + 1) * M)
    micro = jax.tree.map(lambda a, rows=rows: a[rows], batch)
    micro_key = jax.random.fold_in(key, i) if fold else key
    (value, (aux, new_stats)), g = jax.value_and_grad(loss_fn, has_aux=True)(
      params, micro, micro_key, stats if thread else batch_stats
    )
    values.append(value)
    grads.append(g)
    auxes.append(aux)
    stats = new_stats
  return (
    jnp.mean(jnp.stack(values)),
    jax.tree.map(lambda *g: jnp.mean(jnp.stack(g), axis=0), *grads),
    {  # the aux as jaxaccum combines it: rows joined, scalars averaged
      "dropped": jnp.concatenate([a["dropped"] for a in auxes]),
      "pred_mean": jnp.mean(jnp.stack([a["pred_mean"] for a in auxes])),
    },
    stats,
  )


@pytest.mark.slow
def test_linen_recipe_matches_python_loop():
  params, batch, key, batch_stats = problem()
  (value, (aux, final_stats)), grads = accumulated(params, batch, key, batch_stats)
  want_value, want_grads, want_aux, want_stats = reference(
    params, batch, key, batch_stats
  )
  chex.assert_trees_all_close(
    (value, grads, final_stats, aux),
    (want_value, want_grads, want_stats, want_aux),
    rtol=1e-5,
    atol=1e-6,
  )
  chex.assert_trees_all_equal_shapes_and_dtypes(grads, params)
  assert aux["dropped"].shape == (K * M, H)
  assert aux["pred_mean"].shape == ()


def test_each_micro_batch_draws_its_own_dropout_mask():
  params, batch, key, batch_stats = problem()
  (_, (aux, _)), _ = accumulated(params, batch, key, batch_stats)
  dropped = np.asarray(aux["dropped"])
  # Dropout(0.5) drops some units, not all ...
  assert 0.2 < dropped.mean() < 0.8
  # ... and every micro-batch has a different mask.
  for i in range(K):
    for j in range(i + 1, K):
      assert not np.array_equal(dropped[i], dropped[j]), (i, j)


def test_wrong_keys_or_unthreaded_stats_would_be_caught():
  """The comparison above has power: the usual mistakes change the result."""
  params, batch, key, batch_stats = problem()
  (value, (aux, final_stats)), grads = accumulated(params, batch, key, batch_stats)

  def deviation(a, b):
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(a, b, strict=True))

  # One key for every micro-batch: other masks, other value and gradient.
  same_key_value, same_key_grads, same_key_aux, _ = reference(
    params, batch, key, batch_stats, fold=False
  )
  assert not np.array_equal(aux["dropped"], same_key_aux["dropped"])
  assert abs(float(value - same_key_value)) > 1e-4
  assert deviation(jax.tree.leaves(grads), jax.tree.leaves(same_key_grads)) > 1e-4

  # Statistics not threaded (each micro-batch starts from the initial ones):
  # the final running averages lose the first K - 1 updates.
  *_, unthreaded_stats = reference(params, batch, key, batch_stats, thread=False)
  assert (
    deviation(jax.tree.leaves(final_stats), jax.tree.leaves(unthreaded_stats)) > 1e-3
  )


def test_linen_train_step_updates_stats_and_params():
  """One optax step with the recipe equals the same step on the Python
  loop's gradients (each micro-batch with its own dropout key): finite, and
  the statistics moved. (SGD, not Adam: Adam's first step is about
  lr * sign(g), which turns the rounding noise of Dense_0's bias, whose
  gradient BatchNorm makes zero, into full-size steps.)"""
  params, batch, key, batch_stats = problem()
  tx = optax.sgd(0.5)
  opt_state = tx.init(params)
  (value, (_, new_stats)), grads = accumulated(params, batch, key, batch_stats)
  updates, _ = tx.update(grads, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  assert np.isfinite(float(value))
  chex.assert_tree_all_finite((new_params, new_stats))
  moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), new_stats, batch_stats)
  assert all(jax.tree.leaves(moved))

  want_value, want_grads, _, want_stats = reference(params, batch, key, batch_stats)
  want_updates, _ = tx.update(want_grads, opt_state, params)
  chex.assert_trees_all_close(
    (value, optax.apply_updates(params, want_updates), want_stats),
    (want_value, new_params, new_stats),
    rtol=1e-5,
    atol=1e-6,
  )
