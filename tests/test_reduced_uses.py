"""Each use of a parameter typed ``reduced`` in plain jit's step
(:mod:`jaxaccum._parallel.reduced`): a bias, a norm's scale, an embedding table, a
penalty on the weights, layers inside ``jit``, ``checkpoint``, ``scan`` and
``cond``, and the loss's own sum. Every step is compared with
``jax.value_and_grad`` on the whole batch under the same ``jit`` on the same
mesh, and its compiled program is read: which data-axis collectives run in
the loop (none, where the use has rows to leave unreduced) and after it.
"""

import warnings

import chex
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_ghost_mesh import cnn8_batch, convs_loss, convs_params

import jaxaccum
from jaxaccum import _compat, testing
from jaxaccum._parallel import reduced as _reduced
from jaxaccum._parallel import unreduced as _unreduced

V, D, S, B, K = 32, 16, 8, 32, 4


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))


def put(mesh, tree, spec=None):
  sharding = NamedSharding(mesh, P() if spec is None else spec)
  return jax.tree.map(lambda a: jax.device_put(a, sharding), tree)


def lm_params(mesh):
  keys = jax.random.split(jax.random.key(0), 4)
  return put(
    mesh,
    {
      "embed": jax.random.normal(keys[0], (V, D)),
      "scale": 0.1 * jax.random.normal(keys[1], (D,)),  # used as 1 + scale
      "layers": jax.random.normal(keys[2], (2, D, D)) / D**0.5,
      "out": jax.random.normal(keys[3], (D, V)) / D**0.5,
      "bias": jnp.zeros((V,)),
    },
  )


def tokens(mesh):
  return put(mesh, jax.random.randint(jax.random.key(1), (B, S), 0, V), P("data"))


def lm_rows(p, tok):
  """A small LM's loss per row, with every use the walk rewrites: an
  embedding gather, an RMS norm's scale (offset by a literal, as MaxText's
  is), layers stacked for a scan, a bias inside a jit, a cond."""
  h = p["embed"].at[tok[:, :-1]].get(out_sharding=P("data", None, None))
  h = (
    h
    * jax.lax.rsqrt(jnp.mean(h**2, -1, keepdims=True) + 1e-6)
    * (1.0 + p["scale"])[None, None]
  )

  def layer(h, w):
    return jax.checkpoint(lambda h: h + jnp.tanh(h @ w))(h), None

  h, _ = jax.lax.scan(layer, h, p["layers"])
  logits = jax.jit(lambda h, w, b: h @ w + b[None, None])(h, p["out"], p["bias"])
  on = jnp.ones((), bool)  # a replicated predicate (a data-dependent one is reduced)
  logits = jax.lax.cond(on, lambda x: x, lambda x: 2.0 * x, logits)
  logp = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.take_along_axis(logp, tok[:, 1:, None], -1)[..., 0], axis=1)


def lm_loss(p, tok):
  return jnp.mean(lm_rows(p, tok))


def compiled(fun, mesh, *args):
  fun = jax.jit(fun)
  with jax.set_mesh(mesh):
    out = fun(*args)
    text = fun.lower(*args).compile().as_text()
  return out, testing.collectives(text)


def data_collectives(colls, *, in_loop):
  return [c for c in colls if c.in_loop == in_loop and c.spans((8,), [0])]


def shard_bytes(tree):
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def test_the_probe_says_which_leaves_a_use_keeps_reduced(mesh):
  """Traced only: a matrix product, a bias, a scale, an embedding and a
  convolution's kernel keep their leaf reduced; a penalty JAX has no
  reduced rule for (integer_pow) makes its plain."""

  def loss(p, x):
    h = jnp.tanh(x @ p["w"] + p["b"][None]) * p["scale"][None]
    e = p["embed"].at[jnp.argmax(h, -1)].get(out_sharding=P("data", None))
    c = jax.lax.conv_general_dilated(
      h[:, None, :], p["kernel"], (1,), "SAME", dimension_numbers=("NCH", "OIH", "NCH")
    )
    grouped = jax.lax.conv_general_dilated(  # two batch groups: no rule
      h.reshape(B // 2, 2, D),
      p["grouped"],
      (1,),
      "SAME",
      dimension_numbers=("NCH", "OIH", "NCH"),
      batch_group_count=2,
    )
    return jnp.mean(e) + jnp.mean(c) + jnp.mean(grouped) + jnp.sum(p["penalty"] ** 2)

  params = put(
    mesh,
    {
      "w": jnp.ones((D, D)),
      "b": jnp.ones((D,)),
      "scale": jnp.ones((D,)),
      "embed": jnp.ones((D, D)),
      "kernel": jnp.ones((1, 1, 3)),
      "grouped": jnp.ones((2, 2, 3)),
      "penalty": jnp.ones((3,)),
    },
  )
  x = put(mesh, jnp.ones((B, D)), P("data"))
  fun = _reduced.Evaluated(loss, ("data",))

  def enter(p):
    return jax.tree.map(lambda a: jax.sharding.reshard(a, P(reduced={"data"})), p)

  with jax.set_mesh(mesh):
    kept = fun.probe(fun, enter, params, x)
  names = sorted(params)  # the leaves' order
  assert dict(zip(names, kept, strict=True)) == {
    "b": True,
    "embed": True,
    "grouped": False,
    "kernel": True,
    "penalty": False,
    "scale": True,
    "w": True,
  }


def test_an_lm_reduces_nothing_over_data_in_the_loop(mesh):
  """Embedding, norm scale, scanned checkpointed layers, a bias inside a
  jit, a cond, and the loss: all reduced once, in one all-reduce after the
  loop."""
  params, tok = lm_params(mesh), tokens(mesh)
  out, colls = compiled(jaxaccum.value_and_grad(lm_loss, K), mesh, params, tok)
  want, _ = compiled(jax.value_and_grad(lm_loss), mesh, params, tok)
  chex.assert_trees_all_close(out, want, rtol=1e-5, atol=1e-6)
  assert not data_collectives(colls, in_loop=True), colls
  after = data_collectives(colls, in_loop=False)
  assert [c.bytes for c in after] == [shard_bytes(params) + 4], after


def cnn_loss(p, batch):
  """test_ghost_mesh's two convolutions (NHWC, then NCHW with strides,
  dilation and two feature groups) per example, averaged over the batch."""
  return jnp.mean(jax.vmap(convs_loss, in_axes=(None, 0))(p, batch))


def test_a_per_example_loss_under_vmap_reduces_nothing_in_the_loop(mesh):
  """A loss written per example and vmapped over the batch: vmap broadcasts
  the bias with an output sharding of its own, which the walk types reduced
  too (taken as traced, it made the bias plain: reduced every micro-batch)."""
  params = put(mesh, {"w": jnp.ones((D, D)) / D, "b": jnp.linspace(-1, 1, D)})
  x = put(mesh, jax.random.normal(jax.random.key(4), (B, D)), P("data"))

  def one(p, x):
    return jnp.sum(jnp.tanh(x @ p["w"] + p["b"]) ** 2)

  def loss(p, x):
    return jnp.mean(jax.vmap(one, in_axes=(None, 0))(p, x))

  out, colls = compiled(jaxaccum.value_and_grad(loss, K), mesh, params, x)
  want, _ = compiled(jax.value_and_grad(loss), mesh, params, x)
  chex.assert_trees_all_close(out, want, rtol=1e-5, atol=1e-6)
  assert not data_collectives(colls, in_loop=True), colls
  after = data_collectives(colls, in_loop=False)
  assert [c.bytes for c in after] == [shard_bytes(params) + 4], after


@pytest.mark.parametrize(
  "shape", [(8,), (8, 1), (4, 2)], ids=["data", "data_x_unit", "data_x_model"]
)
def test_a_cnn_reduces_nothing_over_data_in_the_loop(shape):
  """Convolution kernels (JAX has no reduced rule for a convolution): each
  device's kernel cotangent is its own rows' share, unreduced, reduced once
  after the loop with the rest. What the loop still moves over "data" is
  the model's own: XLA's CPU partitioner gathers this model's activations,
  the same bytes per step as in the full-batch program. On a mesh with a
  "model" axis too the kernels are reduced in the loop, where plain jit has
  them (taken unreduced there, jax 0.10.2 halved them). There, on a jaxlib
  that doubles a grouped convolution's kernel gradient beside a "model" axis
  (plain jit too: _compat.GROUPED_CONV_KERNEL), the step is refused."""
  names = ("data", "model")[: len(shape)]
  mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(shape))
  params = put(mesh, convs_params())
  images, labels = cnn8_batch()
  batch = put(mesh, (images, labels), P("data"))
  if shape == (4, 2) and _compat.GROUPED_CONV_KERNEL.present():
    with pytest.raises(ValueError, match=r"\. Here model=2\. Upgrade to jax>="):
      compiled(jaxaccum.value_and_grad(cnn_loss, K), mesh, params, batch)
    return
  out, colls = compiled(jaxaccum.value_and_grad(cnn_loss, K), mesh, params, batch)
  want, full = compiled(jax.value_and_grad(cnn_loss), mesh, params, batch)
  chex.assert_trees_all_close(out, want, rtol=1e-5, atol=1e-6)
  kernels = shard_bytes([params["k1"], params["k2"]])
  reductions = [c for c in colls if c.op.startswith(("all-reduce", "reduce-scatter"))]
  in_loop = sum(c.bytes for c in reductions if c.in_loop)
  after = [c.bytes for c in reductions if not c.in_loop]
  if shape[1:] in ((), (1,)):  # an axis of size 1 shards nothing
    assert in_loop == 0, reductions
    assert after == [shard_bytes(params) + 4], reductions
    gathered = [
      sum(c.bytes * c.executions for c in cs if c.op == "all-gather")
      for cs in (colls, full)
    ]
    assert gathered[0] == gathered[1], gathered
  else:
    assert in_loop == kernels, reductions
    assert after == [shard_bytes(params) - kernels + 4], reductions


@pytest.mark.parametrize(
  "head",
  [
    pytest.param(lambda m, other: -m, marks=pytest.mark.slow),
    lambda m, other: 0.5 * m - other / 3.0,
    pytest.param(lambda m, other: m + other, marks=pytest.mark.slow),
  ],
  ids=["negated", "scaled_and_subtracted", "added"],
)
def test_the_loss_stays_a_sum_through_linear_operations(mesh, head):
  """The loss's sum over rows is left unreduced through negation, scaling,
  division by a constant, sums and differences of such sums and casts that
  lose nothing: nothing over data in the loop."""
  params, tok = lm_params(mesh), tokens(mesh)

  def loss(p, tok):
    return head(
      lm_loss(p, tok), jnp.mean(p["embed"].at[tok].get(out_sharding=P("data")))
    )

  out, colls = compiled(jaxaccum.value_and_grad(loss, K), mesh, params, tok)
  want, _ = compiled(jax.value_and_grad(loss), mesh, params, tok)
  chex.assert_trees_all_close(out, want, rtol=1e-5, atol=1e-6)
  assert not data_collectives(colls, in_loop=True), colls


@pytest.mark.parametrize(
  ("head", "in_loop"),
  [
    pytest.param(lambda m, p: jnp.log(m), [4], marks=pytest.mark.slow),
    (lambda m, p: m + 1e-3 * jnp.sum(p["out"] ** 2), []),
    pytest.param(
      lambda m, p: m.astype(jnp.bfloat16).astype(jnp.float32),
      [],
      marks=pytest.mark.slow,
    ),
  ],
  ids=["log", "penalty_added", "narrowing_cast"],
)
def test_other_uses_of_the_loss_are_applied_to_the_totals(
  mesh, head, in_loop, monkeypatch
):
  """The log of the mean needs the whole sum; a penalty on the weights
  would have to be split over the devices to add to a sum of theirs; a
  cast to bfloat16 rounds the sum, not its parts. Exact by default, each is
  applied once to the totals, after the loop: no gradient is reduced in it.
  The log's cotangent needs the total first, from a forward pass before the
  loop that reduces its sum per micro-batch (4 bytes). Compared with the
  step whose reductions the partitioner places (the same read)."""
  params, tok = lm_params(mesh), tokens(mesh)

  def loss(p, tok):
    return head(lm_loss(p, tok), p)

  fun = jaxaccum.value_and_grad(loss, K)
  out, colls = compiled(fun, mesh, params, tok)
  monkeypatch.setattr(_unreduced, "applies", lambda *a: False)
  want, _ = compiled(jaxaccum.value_and_grad(loss, K), mesh, params, tok)
  chex.assert_trees_all_close(out, want, rtol=1e-5, atol=1e-6)
  assert [c.bytes for c in data_collectives(colls, in_loop=True)] == in_loop, colls
  after = data_collectives(colls, in_loop=False)
  assert sum(c.bytes for c in after) <= shard_bytes(params) + 4, after
  assert sum(c.bytes for c in after) >= shard_bytes(params), after


@pytest.mark.slow
def test_a_weighted_loss_reduces_its_weight_in_the_loop_only(mesh):
  """normalize="weighted": the loss sum is reduced after the loop; the
  weight, which the step checks per micro-batch, in it (4 bytes)."""
  params, tok = lm_params(mesh), tokens(mesh)
  mask = put(mesh, (jnp.arange(B) % 3 != 0).astype(jnp.float32), P("data"))

  def loss(p, tok, mask):
    return jnp.sum(lm_rows(p, tok) * mask), jnp.sum(mask)

  fun = jaxaccum.value_and_grad(loss, K, normalize="weighted", batch_argnums=(1, 2))

  def full(p, tok, mask):
    total, weight = loss(p, tok, mask)
    return total / weight

  out, colls = compiled(fun, mesh, params, tok, mask)
  want, _ = compiled(jax.value_and_grad(full), mesh, params, tok, mask)
  chex.assert_trees_all_close(out, want, rtol=1e-5, atol=1e-6)
  print("COLLS", [(c.bytes, c.in_loop) for c in colls if c.spans((8,), [0])])
  assert [c.bytes for c in data_collectives(colls, in_loop=True)] == [4], colls


@pytest.mark.slow
def test_a_sum_that_meets_the_rows_again_is_reduced_first(mesh, monkeypatch):
  """A mean over the rows subtracted from each row (centering) needs the
  whole sum where it meets the rows: reduced there, as plain jit does, and
  exact against the step whose reductions the partitioner places."""
  # mutmut: _reduced._Walk.on_partial
  params, tok = lm_params(mesh), tokens(mesh)

  def loss(p, tok):
    rows = lm_rows(p, tok)
    return jnp.mean((rows - jnp.mean(rows)) ** 2) + jnp.mean(rows)

  out, _ = compiled(jaxaccum.value_and_grad(loss, K), mesh, params, tok)
  monkeypatch.setattr(_unreduced, "applies", lambda *a: False)
  want, _ = compiled(jaxaccum.value_and_grad(loss, K), mesh, params, tok)
  chex.assert_trees_all_close(out, want, rtol=1e-5, atol=1e-6)


#: Uses of a parameter that the walk cannot keep reduced on every jax CI
#: covers (jax 0.10.2 types none of these on a reduced operand; a select's
#: operand sharded over the reduced axes is refused on any version).
UNREWRITABLE = {
  "sort": lambda p, h, m: jnp.sum(jnp.sort(p["v"])),
  "cumsum": lambda p, h, m: jnp.sum(jnp.cumsum(p["v"])),
  "max": lambda p, h, m: jnp.max(p["v"]),
  "abs": lambda p, h, m: jnp.sum(jnp.abs(p["v"])),
  "var": lambda p, h, m: jnp.var(p["v"]),
  "logsumexp": lambda p, h, m: jax.nn.logsumexp(p["v"]),
  "argmax_gather": lambda p, h, m: p["v"][jnp.argmax(p["b"])],
  "where_rows": lambda p, h, m: jnp.mean(jnp.where(m[:, None], p["v"][None], h) ** 2),
}


@pytest.mark.parametrize("use", sorted(UNREWRITABLE))
def test_a_use_the_walk_cannot_rewrite_costs_only_its_leaf(mesh, use):
  """One use the walk cannot keep reduced (``jnp.sort`` of a 4-element
  parameter, a gather by ``argmax``, ``jnp.where`` of a parameter vector
  over rows, ...) takes that parameter plain there alone: the step moves at
  most that parameter's bytes (and the loss's 4) over data in the loop,
  where the whole-step fallback moved every gradient (65,552 B for the
  sort), and it equals ``jax.value_and_grad`` on the whole batch."""
  d = 4
  params = put(
    mesh,
    {
      "w": jnp.arange(d * d, dtype=jnp.float32).reshape(d, d) / 10,
      "v": jnp.array([0.3, -0.2, 0.5, 0.1]),
      "b": jnp.linspace(-1.0, 1.0, d),
    },
  )
  x = put(mesh, jax.random.normal(jax.random.key(0), (64, d)), P("data"))
  row_mask = put(mesh, jnp.arange(64) % 3 != 0, P("data"))
  extra = UNREWRITABLE[use]

  def loss(p, batch):
    xb, mb = batch
    h = jnp.tanh(xb @ p["w"]) + p["b"][None]
    return jnp.mean(h**2) + extra(p, h, mb)

  with warnings.catch_warnings():
    warnings.simplefilter("error")  # a known limit, not a jaxaccum bug
    out, colls = compiled(jaxaccum.value_and_grad(loss, K), mesh, params, (x, row_mask))
  want, _ = compiled(jax.value_and_grad(loss), mesh, params, (x, row_mask))
  chex.assert_trees_all_close(out, want, rtol=1e-5, atol=1e-6)
  in_loop = sum(c.bytes for c in data_collectives(colls, in_loop=True))
  assert in_loop <= shard_bytes(params["v"]) + 4, (use, colls)


def test_a_sharding_type_error_of_fun_is_jax_s_own(mesh):
  """A use JAX's types refuse under ``jax.value_and_grad`` on the same mesh
  (an embedding lookup by sharded tokens without ``out_sharding=``) is
  re-raised as JAX's own error, not as a jaxaccum failure to report."""
  table = put(mesh, jnp.ones((V, D)))
  tok = put(mesh, jnp.zeros((B, S), jnp.int32), P("data"))

  def loss(e, t):
    return jnp.mean(e[t])

  refusal = _compat_refusal()
  with pytest.raises(refusal, match="out_sharding"):
    compiled(jax.value_and_grad(loss), mesh, table, tok)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    with pytest.raises(refusal, match="out_sharding"):
      compiled(jaxaccum.value_and_grad(loss, K), mesh, table, tok)


def _compat_refusal():
  from jaxaccum import _compat  # noqa: PLC0415

  return _compat.SHARDING_TYPE_ERRORS


def _closed_call(fun, *args):
  """``fun(*args)`` through JAX's ``closed_call`` primitive, as a
  ``custom_vjp`` whose residuals are unused becomes after DCE."""
  from jax._src import core  # noqa: PLC0415 (the primitive has no public name)

  closed = jax.make_jaxpr(fun)(*args)
  params = core.closed_call_p.get_bind_params({"call_jaxpr": closed})
  return core.closed_call_p.bind(*args, **params)[0]


def test_a_parameter_used_inside_a_closed_call_stays_reduced(mesh):
  """The walker's call table reads ``closed_call``'s own parameter
  (``call_jaxpr``): a layer inside one keeps its weight reduced, nothing
  over data in the loop but the loss's 4 bytes, and equals
  ``jax.value_and_grad``."""
  params = put(mesh, {"w": jnp.eye(D) + 0.1, "out": jnp.ones((D,)) / D})
  x = put(mesh, jax.random.normal(jax.random.key(2), (B, D)), P("data"))

  def loss(p, x):
    h = _closed_call(lambda w, x: jnp.tanh(x @ w), p["w"], x)
    return jnp.mean((h @ p["out"]) ** 2)

  out, colls = compiled(jaxaccum.value_and_grad(loss, K), mesh, params, x)
  want, _ = compiled(jax.value_and_grad(loss), mesh, params, x)
  chex.assert_trees_all_close(out, want, rtol=1e-5, atol=1e-6)
  assert sum(c.bytes for c in data_collectives(colls, in_loop=True)) == 0, colls
