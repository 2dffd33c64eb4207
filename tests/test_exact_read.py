"""The read of a loss as a function of sums over its rows
(:mod:`jaxaccum._exact`, :mod:`jaxaccum._rowsums`): which losses are of
that form, what their coefficients need before the loop, why the others
are not, and that ``F`` at the micro-batches' totals is the full batch's
value (the gradients are held against ``jax.value_and_grad`` through the
step, in ``tests/test_exact.py``)."""

import jax
import jax.numpy as jnp
import optax
import pytest

from jaxaccum import _exact
from jaxaccum._rowsums import Rows

M, T, V, D = 4, 5, 7, 3


def params():
  k = jax.random.split(jax.random.key(0), 3)
  return {
    "emb": jax.random.normal(k[0], (V, D)),
    "out": jax.random.normal(k[1], (D, V)),
    "b": 0.1 * jax.random.normal(k[2], (V,)),
  }


def batch(rows, seed):
  k1, k2 = jax.random.split(jax.random.key(seed))
  tok = jax.random.randint(k1, (rows, T), 0, V)
  mask = (jax.random.uniform(k2, (rows, T)) > 0.4).astype(jnp.float32)
  return tok, mask


def token_losses(p, tok):
  logits = p["emb"][tok] @ p["out"] + p["b"][None, None]
  return optax.softmax_cross_entropy_with_integer_labels(logits, tok)


def logits(p, tok):
  return p["emb"][tok] @ p["out"] + p["b"][None, None]


def normalized(h):
  """Each row centred and scaled by the batch's statistics (BatchNorm)."""
  return (h - h.mean(0, keepdims=True)) / (h.std(0, keepdims=True) + 1e-3)


LOSSES = {
  # name: (loss, what its coefficients need)
  "mean": (lambda p, t, m: token_losses(p, t).mean(), "constant"),
  "sum": (lambda p, t, m: token_losses(p, t).sum(), "constant"),
  "masked mean": (
    lambda p, t, m: jnp.sum(token_losses(p, t) * m) / jnp.sum(m),
    "counts",
  ),
  "mean(where=)": (
    lambda p, t, m: token_losses(p, t).mean(where=m > 0),
    "counts",
  ),
  "max(count, 1)": (
    lambda p, t, m: jnp.sum(token_losses(p, t) * m) / jnp.maximum(jnp.sum(m), 1.0),
    "counts",
  ),
  "mean plus penalty": (
    lambda p, t, m: token_losses(p, t).mean() + 1e-2 * jnp.sum(p["out"] ** 2),
    "constant",
  ),
  "flattened tokens": (
    lambda p, t, m: (
      jnp.sum(
        optax.softmax_cross_entropy_with_integer_labels(
          logits(p, t).reshape(-1, V), t.reshape(-1)
        )
        * m.reshape(-1)
      )
      / jnp.sum(m)
    ),
    "counts",
  ),
  "log_softmax, take_along_axis": (
    lambda p, t, m: (
      -jnp.mean(
        jnp.take_along_axis(jax.nn.log_softmax(logits(p, t)), t[..., None], -1)[..., 0],
        where=m > 0,
      )
    ),
    "counts",
  ),
  "ratio of two means": (
    lambda p, t, m: jnp.mean(logits(p, t)) / jnp.mean(logits(p, t) ** 2),
    "forward",
  ),
  "product of two means": (
    lambda p, t, m: jnp.mean(logits(p, t)) * jnp.mean(jnp.tanh(logits(p, t))),
    "forward",
  ),
}

REFUSED = {
  "a batch statistic per row": (
    lambda p, t, m: jnp.mean(normalized(logits(p, t)) ** 2),
    "other than through sums",
  ),
  "a sort over the rows": (
    lambda p, t, m: jnp.sum(jnp.sort(token_losses(p, t).sum(1))[: M // 2]),
    "other than through sums",
  ),
  "an unbiased variance": (
    lambda p, t, m: jnp.var(token_losses(p, t).sum(1), ddof=1),
    "other than through sums",
  ),
  "a count per row": (
    lambda p, t, m: jnp.sum(token_losses(p, t) / t.shape[0]),
    "scales with the rows where they are summed",
  ),
  "no batch": (lambda p, t, m: jnp.sum(p["out"] ** 2), "does not depend"),
}


def flat(loss):
  leaves, tree = jax.tree.flatten(params())

  def fun(*xs):
    return loss(jax.tree.unflatten(tree, xs[: len(leaves)]), *xs[len(leaves) :])

  return fun, leaves


def read(loss, rows=M):
  fun, leaves = flat(loss)
  n = len(leaves)
  return _exact.read(
    fun,
    [*leaves, *batch(rows, 1)],
    [None] * n + [Rows(0)] * 2,
    [True] * n + [False] * 2,
    rows,
  )


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_a_loss_of_sums_is_read_and_finished_at_the_totals_as_the_full_batch(name):
  """``F`` at the totals of two micro-batches' sums is the loss of the two
  together, with ``jnp.mean``'s count scaled to their rows."""
  loss, coefficients = LOSSES[name]
  got = read(loss)
  assert isinstance(got, _exact.Read), got
  assert got.coefficients == coefficients
  fun, leaves = flat(loss)
  parts = [batch(M, 1), batch(M, 2)]
  sums = [got.evaluate([*leaves, *b])[1] for b in parts]
  totals = [a + b for a, b in zip(*sums, strict=True)]
  whole = [jnp.concatenate(x) for x in zip(*parts, strict=True)]
  want = fun(*leaves, *whole)
  assert jnp.allclose(got.finish(totals, [*leaves, *parts[0]], 2 * M), want, rtol=1e-6)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_loss_of_another_form_is_refused_with_its_reason(name):
  loss, reason = REFUSED[name]
  got = read(loss)
  assert isinstance(got, _exact.Refusal), got
  assert reason in got.reason


def test_the_counts_come_from_the_mask_alone():
  """A masked mean's count, the sum the parameters do not reach, is
  computed without the model: the equations it needs read the mask only."""
  got = read(LOSSES["masked mean"][0])
  _, leaves = flat(LOSSES["masked mean"][0])
  tok, mask = batch(M, 3)
  counted = got.counted([*leaves, tok, mask])
  by_params = dict(zip(got.params, counted, strict=True))
  assert float(by_params[False]) == float(mask.sum())
  assert float(by_params[True]) == 0.0
  needed = _exact._needed(
    got.jaxpr.jaxpr, [v for v, p in zip(got.sums, got.params, strict=True) if not p]
  )
  assert {e.primitive.name for e in needed} <= {
    "reduce_sum",
    "mul",
    "convert_element_type",
  }


def test_a_division_by_a_batch_quantity_in_a_refused_loss_is_told():
  """The refusal says when the loss divides by a quantity computed from
  the batch (the case a warning names normalize="weighted" for)."""

  def masked_batchnorm(p, t, m):
    h = normalized(logits(p, t))
    return jnp.sum(jnp.sum(h**2, -1) * m) / jnp.sum(m)

  got = read(masked_batchnorm)
  assert isinstance(got, _exact.Refusal) and got.divides_by_batch
  assert not read(REFUSED["a sort over the rows"][0]).divides_by_batch
