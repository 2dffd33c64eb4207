"""Exact by default on the data-parallel paths: ``mesh=`` in both views and
plain ``jit`` on a sharded batch give the full batch's value and gradient
for a loss built from sums over its rows, unchanged, as one device does
(``tests/test_exact.py``), with the batch's rows sharded over 8 devices.
Under plain ``jit`` the sums stay ``unreduced`` through the loop: no
gradient is reduced in it."""

import chex
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from jaxaccum import testing
from tests.test_exact import (
  LM,
  V,
  lm_loss,
  micro_mean,
  params,
  relative,
  tokens_and_mask,
)

pytestmark = pytest.mark.filterwarnings("error")  # no fallback, no warning

K = 2
UNREAD = (
  "jaxaccum: fun's loss is not read as sums over rows on the whole batch ({}); "
  "fun sees one device's rows, and each micro-batch's loss weighs the same, "
  "which is the full batch's only where every micro-batch holds the same "
  'weight. For a token mean, return (loss_sum, weight) with normalize="weighted".'
)
PATHS = ("mesh=, view='global'", "mesh=, view='device'", "plain jit")


def head(w, tok):
  """tests/test_exact.py's model, its lookup a product with one-hot rows
  (an indexed lookup on an Explicit mesh needs ``out_sharding=``)."""
  return jnp.tanh(jax.nn.one_hot(tok, V) @ w["emb"]) @ w["out"]


def ce(w, tok):
  logits = head(w, tok)
  return -jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(tok, V), -1)


LOSSES = {
  "sum / max(count, 1)": lambda w, b: (
    jnp.sum(ce(w, b[0]) * b[1]) / jnp.maximum(jnp.sum(b[1]), 1.0)
  ),
  "a ratio of two means": lambda w, b: (
    jnp.mean(head(w, b[0]) ** 2) / jnp.mean(jnp.abs(head(w, b[0])) + 1.0)
  ),
  "a mean plus a penalty": lambda w, b: (
    jnp.mean(ce(w, b[0])) + 1e-2 * jnp.sum(w["out"] ** 2)
  ),
}
NAMES = tuple(LOSSES)


def mesh(types):
  return jax.make_mesh((8,), ("data",), axis_types=(types,))


def step(loss, path, m):
  if path == "plain jit":
    return jax.jit(jaxaccum.value_and_grad(loss, K))
  view = path.split("'")[1]
  return jax.jit(jaxaccum.value_and_grad(loss, K, mesh=m, data_axis="data", view=view))


def placed(m):
  w, batch = params(), tokens_and_mask(1)
  return jax.device_put(w, NamedSharding(m, P())), jax.device_put(
    batch, NamedSharding(m, P("data"))
  )


@pytest.mark.parametrize("types", [AxisType.Explicit, AxisType.Auto], ids=str)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", NAMES)
def test_a_loss_of_sums_equals_the_full_batch_on_8_devices(name, path, types):
  loss, m = LOSSES[name], mesh(types)
  w, batch = placed(m)
  want = jax.value_and_grad(loss)(params(), tokens_and_mask(1))
  with jax.set_mesh(m):
    got = step(loss, path, m)(w, batch)
  chex.assert_trees_all_close(got[0], want[0], rtol=1e-5)
  assert relative(got[1], want[1]) < 2e-6, (name, path)


def test_the_mean_of_micro_batches_is_measurably_off_here():
  """What the default gave before: the test above could fail."""
  loss = LOSSES["sum / max(count, 1)"]
  w, batch = params(), tokens_and_mask(1)
  want = jax.value_and_grad(loss)(w, batch)
  old = micro_mean(jax.value_and_grad(loss), (w, batch))
  assert relative(old[1], want[1]) > 0.05


def test_plain_jit_reduces_no_gradient_inside_the_loop():
  """A masked mean under plain jit on an Explicit mesh: the micro-batches'
  sums and gradients stay unreduced, one reduction of each after the loop
  (the count's pass before it reduces a scalar per micro-batch)."""
  m = mesh(AxisType.Explicit)
  w, batch = placed(m)
  fun = step(LOSSES["sum / max(count, 1)"], "plain jit", m)
  with jax.set_mesh(m):
    text = fun.lower(w, batch).compile().as_text()
  in_loop = [c for c in testing.collectives(text) if c.in_loop and c.spans((8,), [0])]
  assert all(c.bytes <= 4 for c in in_loop), in_loop  # the count, a float32
  grad_bytes = sum(x.size * 4 for x in jax.tree.leaves(w))
  after = [c for c in testing.collectives(text) if not c.in_loop]
  assert sum(c.bytes for c in after) >= grad_bytes, after


def test_a_loss_that_traces_on_one_devices_rows_only_keeps_the_mean_and_says_so():
  """view="device" reads the loss on the whole batch's micro-batch; a
  ``fun`` with a shape that holds for one device's rows only (its rows
  here: 1) is not read there: the mean of the D * k micro-batches' means, as
  before exactness by default, with a warning that names the error."""
  base = LOSSES["sum / max(count, 1)"]

  def loss(w, b):
    b[0].reshape(1, b[0].shape[1])  # one device's micro-batch: one row
    return base(w, b)

  m = mesh(AxisType.Auto)
  w, batch = placed(m)
  with jax.set_mesh(m), pytest.warns(UserWarning, match="cannot reshape") as seen:
    got = step(loss, "mesh=, view='device'", m)(w, batch)
  assert str(seen[0].message) == UNREAD.format(
    "TypeError: cannot reshape array of shape (8, 6) (size 48) into shape (1, 6) "
    "(size 6)"
  )
  want = micro_mean(jax.value_and_grad(base), (params(), tokens_and_mask(1)), k=8 * K)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
  exact = jax.value_and_grad(base)(params(), tokens_and_mask(1))
  assert relative(got[1], exact[1]) > 0.05  # the fallback is the equal-weight mean


@pytest.mark.parametrize("view", ["device", "global"])
def test_the_nnx_lm_s_token_mean_is_exact_unchanged_under_mesh(view):
  """The NNX LM of tests/test_exact.py, its loss unchanged, through
  jaxaccum.nnx.value_and_grad with mesh= on 8 devices, in either view: 32
  rows, two per device and micro-batch."""
  model = LM(nnx.Rngs(0))
  batch = jax.tree.map(
    lambda a, b: jnp.concatenate([a, b]), *map(tokens_and_mask, (0, 1))
  )
  want = nnx.value_and_grad(lm_loss)(model, batch)
  m = mesh(AxisType.Auto)
  placed = jax.device_put(batch, NamedSharding(m, P("data")))
  fun = jaxaccum.nnx.value_and_grad(lm_loss, K, mesh=m, data_axis="data", view=view)
  with jax.set_mesh(m):
    got = fun(model, placed)
  chex.assert_trees_all_close(got[0], want[0], rtol=1e-5)
  assert relative(nnx.state(got[1]), nnx.state(want[1])) < 1e-5


def test_one_row_per_device_and_micro_batch_is_not_read_and_says_so():
  """At one row, the LM's causal mask (one row of its own) is used as the
  rows are, not broadcast over them: the device's program has other sums
  than the whole batch's, so the step keeps equal weights and warns."""
  model = LM(nnx.Rngs(0))
  tok, mask = tokens_and_mask()  # 16 rows: one per device and micro-batch
  mask = mask.at[:, :3].set(1.0)  # every row predicts a token: no 0 / 0
  m = mesh(AxisType.Auto)
  placed = jax.device_put((tok, mask), NamedSharding(m, P("data")))
  fun = jaxaccum.nnx.value_and_grad(lm_loss, K, mesh=m, data_axis="data")
  with jax.set_mesh(m), pytest.warns(UserWarning) as seen:
    got = fun(model, placed)
  assert [str(w.message) for w in seen] == [
    UNREAD.format(
      "OtherSums: one device's micro-batch has 1 sums over rows where the whole "
      "batch's has 2"
    )
  ]
  grads = nnx.value_and_grad(lm_loss)
  want = micro_mean(grads, (model, (tok, mask)), k=8 * K)
  chex.assert_trees_all_close(got[0], want[0], rtol=1e-5)
  assert relative(nnx.state(got[1]), nnx.state(want[1])) < 1e-5
  exact = grads(model, (tok, mask))
  assert relative(nnx.state(got[1]), nnx.state(exact[1])) > 0.05


@pytest.mark.parametrize("path", ["one device", *PATHS])
def test_a_fun_that_does_not_trace_raises_its_own_error_and_nothing_else(path):
  """A fun that traces neither on the whole batch nor on a device's rows
  raises its own error on every path, with no warning that the read gave
  up (the per-device view says that only once the step has traced)."""

  def loss(w, b):
    b[0].reshape(5, -1)  # 8 rows of 6, or a device's 1, do not split in 5
    return LOSSES["sum / max(count, 1)"](w, b)

  m = mesh(AxisType.Auto)
  w, batch = placed(m) if path != "one device" else (params(), tokens_and_mask(1))
  fun = (
    step(loss, path, m) if path != "one device" else jaxaccum.value_and_grad(loss, K)
  )
  with jax.set_mesh(m), pytest.raises(TypeError, match="cannot reshape"):
    fun(w, batch)
