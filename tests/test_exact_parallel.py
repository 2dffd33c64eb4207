"""Exact by default on the data-parallel paths where ``fun`` sees the global
batch: ``mesh=`` with ``view="global"`` and plain ``jit`` on a sharded batch give the full batch's value and gradient
for a loss built from sums over its rows, unchanged, as one device does
(``tests/test_exact.py``), with the batch's rows sharded over 8 devices.
Under plain ``jit`` the sums stay ``unreduced`` through the loop: no
gradient is reduced in it."""

import chex
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from jaxaccum import testing
from tests.test_exact import V, micro_mean, params, relative, tokens_and_mask

pytestmark = pytest.mark.filterwarnings("error")  # no fallback, no warning

K = 2
PATHS = ("mesh=, view='global'", "plain jit")


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


def test_the_per_device_view_keeps_the_mean_of_micro_batch_means():
  """view="device" (mesh='s default): fun sees one device's rows, and its
  loss is not read on the whole batch (docs/guide.md): the mean of the
  D * k micro-batches' means, as before."""
  loss, m = LOSSES["sum / max(count, 1)"], mesh(AxisType.Auto)
  w, batch = placed(m)
  with jax.set_mesh(m):
    got = step(loss, "mesh=, view='device'", m)(w, batch)
  want = micro_mean(jax.value_and_grad(loss), (params(), tokens_and_mask(1)), k=8 * K)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
