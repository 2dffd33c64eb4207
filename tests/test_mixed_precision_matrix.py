"""Every combination of gradient and parameter dtype, as optax tests MultiSteps.

The inner optimizer's state can change dtype on its first update: adam's ``mu``
starts in the parameters' dtype and comes back in the promoted dtype of
gradients and parameters. ``accumulate`` keeps its state at fixed dtypes, so
that ``lax.cond``, a ``lax.scan`` carry and donation all see one type.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxaccum

K = 2
DTYPES = {"f32": jnp.float32, "f16": jnp.float16, "bf16": jnp.bfloat16}


def make_params(dtype):
  return {
    "w": jnp.linspace(-1.0, 1.0, 6).reshape(3, 2).astype(dtype),
    "b": jnp.array([0.5, -0.25], dtype),
  }


def make_grads(n, dtype, seed=0):
  """``n`` gradients like :func:`make_params`, cast to ``dtype``."""
  keys = jax.random.split(jax.random.key(seed), 2)
  return [
    {
      "w": jax.random.normal(jax.random.fold_in(keys[0], i), (3, 2)).astype(dtype),
      "b": jax.random.normal(jax.random.fold_in(keys[1], i), (2,)).astype(dtype),
    }
    for i in range(n)
  ]


# The four combinations that crashed lax.cond in accumulate() (issue 14):
# adam's state changes dtype on its first update. A donated state whose dtypes
# changed would also leave buffers unusable (a warning) and recompile.
@pytest.mark.slow
@pytest.mark.parametrize(
  ("grad_dtype", "param_dtype"),
  [("f32", "f16"), ("f32", "bf16"), ("f16", "bf16"), ("bf16", "f16")],
)
def test_adam_state_that_changes_dtype_breaks_neither_lax_cond_nor_donation(
  grad_dtype, param_dtype
):
  params = make_params(DTYPES[param_dtype])
  tx = jaxaccum.accumulate(optax.adam(0.1), 4)
  state = tx.init(params)
  update = jax.jit(tx.update, donate_argnums=1)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # "Some donated buffers were not usable"
    for grads in make_grads(5, DTYPES[grad_dtype]):
      old = state
      updates, state = update(grads, state, params)
      params = optax.apply_updates(params, updates)
      # Every buffer was reused, but that of `updated`: update() never reads
      # it, and jit does not pass (or donate) an unused argument.
      kept = old._replace(updated=None)
      assert all(x.is_deleted() for x in jax.tree.leaves(kept))
  assert int(state.step) == 1


INNER = {
  "adam": lambda: optax.adam(0.1),
  "adam_mu_f32": lambda: optax.adam(0.1, mu_dtype=jnp.float32),
  "adamw": lambda: optax.adamw(0.1, weight_decay=0.5),  # reads the params
  "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
  "lion": lambda: optax.lion(0.1),
  "adafactor": lambda: optax.adafactor(0.1),
  "clip_adam": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1)),
}


def dtypes(tree):
  return jax.tree.map(jnp.result_type, tree)


def cast_like(tree, like):
  return jax.tree.map(lambda x, y: x.astype(jnp.result_type(y)), tree, like)


def assert_close(got, want, *low, what=""):
  """Equal up to a few roundings in the lowest precision involved: each
  leaf's own dtype and ``low`` (the gradients' and parameters' dtypes). The
  reference runs op by op, accumulate() under jit, where XLA may keep a
  float16 intermediate in float32; a rounding in a cancelling sum (adam's
  ``mu``) is relative to the leaf's scale, hence the ``atol``.
  """
  assert dtypes(got) == dtypes(want), what
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    if not jnp.issubdtype(jnp.result_type(w), jnp.floating):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=str(what))
      continue
    eps = max(float(jnp.finfo(d).eps) for d in (jnp.result_type(w), *low))
    w32 = np.asarray(w, np.float32)
    np.testing.assert_allclose(
      np.asarray(g, np.float32),
      w32,
      rtol=4 * eps,
      atol=4 * eps * float(np.max(np.abs(w32), initial=1e-30)),
      err_msg=str(what),
    )


def window_mean(grads, dtype):
  """The window's mean as accumulate() forms it: float32 sums, cast back."""
  total = jax.tree.map(lambda *gs: sum(g.astype(jnp.float32) for g in gs), *grads)
  return jax.tree.map(lambda t: (t / len(grads)).astype(dtype), total)


def references(inner, params0, grads, info):
  """The inner optimizer run directly on each window's mean (traceable).

  Its state is cast back to its init dtypes after each update, as
  accumulate() and optax.MultiSteps keep it (so the windows can run in a
  lax.scan: one compile of the inner update). Run as optax runs it, the state
  may change dtype on the first update instead; that run (``direct``) is
  followed abstractly, for its dtypes.

  Returns:
    Per call the updates (zeros of the dtypes the inner update would give,
    where no window ends), then the final params and state. Appends to
    ``info``, per call, the dtypes of the updates that ``direct`` would give,
    and whether the state has ``direct``'s dtypes (then the updates are
    those of the inner optimizer run directly).
  """
  state0 = inner.init(params0)
  windows = len(grads) // K
  means = [
    window_mean(grads[w * K : (w + 1) * K], jnp.result_type(grads[0]["w"]))
    for w in range(windows)
  ]

  def window(carry, mean):
    params, state = carry
    updates, new_state = inner.update(mean, state, params)
    return (optax.apply_updates(params, updates), cast_like(new_state, state)), updates

  stacked = jax.tree.map(lambda *ms: jnp.stack(ms), *means)
  (params, state), window_updates = jax.lax.scan(window, (params0, state0), stacked)

  direct = state0
  out = []
  for i, g in enumerate(grads):
    direct_updates = jax.eval_shape(inner.update, g, direct, params0)[0]
    info.append((dtypes(direct_updates), dtypes(direct) == dtypes(state0)))
    if (i + 1) % K:
      shapes = jax.eval_shape(inner.update, g, state0, params0)[0]
      out.append(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))
    else:
      out.append(jax.tree.map(lambda u, w=i // K: u[w], window_updates))
      mean = means[i // K]
      direct = jax.eval_shape(inner.update, mean, direct, params0)[1]
  return out, params, state


@pytest.mark.slow
@pytest.mark.parametrize("param_dtype", DTYPES)
@pytest.mark.parametrize("grad_dtype", DTYPES)
def test_accumulate_dtypes_and_values_match_the_inner_optimizer(
  grad_dtype, param_dtype
):
  """2k + 1 calls of accumulate(inner, k) for every inner optimizer of INNER,
  inside a lax.scan (the state is its carry), against the inner optimizer run
  directly. One jit holds all of them: one compile per dtype combination."""
  g_dtype, p_dtype = DTYPES[grad_dtype], DTYPES[param_dtype]
  params0 = make_params(p_dtype)
  grads = make_grads(2 * K + 1, g_dtype)
  inners = {name: make() for name, make in INNER.items()}
  txs = {name: jaxaccum.accumulate(inner, K) for name, inner in inners.items()}
  states0 = {name: tx.init(params0) for name, tx in txs.items()}
  info = {name: [] for name in INNER}

  @jax.jit
  def run(params0, states0, grads):
    stacked = jax.tree.map(lambda *gs: jnp.stack(gs), *grads)
    out = {}
    for name, tx in txs.items():

      def call(carry, g, tx=tx):
        params, state = carry
        updates, state = tx.update(g, state, params)
        return (optax.apply_updates(params, updates), state), updates

      got = jax.lax.scan(call, (params0, states0[name]), stacked)
      out[name] = got, references(inners[name], params0, grads, info[name])
    return out

  for name, (got, want) in run(params0, states0, grads).items():
    (params, state), updates = got
    want_updates, want_params, want_state = want
    state0 = states0[name]
    # The inner state's fixed dtypes are those inner.init gives.
    assert dtypes(state0.inner_state) == dtypes(inners[name].init(params0)), name
    assert dtypes(params) == dtypes(params0), name
    assert dtypes(state) == dtypes(state0), name
    assert int(state.step) == 2 and int(state.micro_step) == 1, name
    for i, (want_u, (direct_dtypes, _)) in enumerate(
      zip(want_updates, info[name], strict=True)
    ):
      got_u = jax.tree.map(lambda u, i=i: u[i], updates)
      # The updates have the dtypes the inner optimizer run directly gives.
      assert dtypes(got_u) == direct_dtypes, (name, i)
      assert_close(got_u, want_u, g_dtype, p_dtype, what=(name, i))
    # The values are those of the inner optimizer run directly wherever the
    # dtypes agree: in the first window always, and throughout when the
    # gradients come in the parameters' dtype.
    same = [s for _, s in info[name]]
    assert all(same[:K]), name
    if grad_dtype == param_dtype:
      assert all(same), name
    assert_close(params, want_params, g_dtype, p_dtype, what=name)
    assert_close(state.inner_state, want_state, g_dtype, p_dtype, what=name)


# The engine paths: jaxaccum.value_and_grad (then tx.update) and
# make_train_step. Their gradients come back in the parameters' dtype, as
# from jax.grad; a transformation that casts them gives the other gradient
# dtypes. All combinations share one parameter tree, a subtree "{grad}_{param}"
# per combination, under one optimizer per kind ("inner": adam itself, "acc":
# accumulate(adam, k)): one compile and one lax.cond cover them all.
M = 2  # micro-batches per step


def combo_params(kinds):
  return {
    kind: {f"{g}_{p}": make_params(DTYPES[p]) for g in DTYPES for p in DTYPES}
    for kind in kinds
  }


def cast_each():
  """Casts subtree "{grad}_{param}" to the grad dtype."""

  def cast(updates, params):
    del params
    return {
      key: jax.tree.map(lambda u, key=key: u.astype(DTYPES[key.split("_")[0]]), sub)
      for key, sub in updates.items()
    }

  return optax.stateless(cast)


def per_key(transforms):
  """A dict of transformations, one per top-level key of the parameters
  (optax.partition masks every transformation over the whole tree, which
  compiles slower)."""

  def init(params):
    return {key: tx.init(params[key]) for key, tx in transforms.items()}

  def update(updates, state, params=None):
    out = {
      key: tx.update(updates[key], state[key], params[key])
      for key, tx in transforms.items()
    }
    return {k: u for k, (u, _) in out.items()}, {k: s for k, (_, s) in out.items()}

  return optax.GradientTransformation(init, update)


def combo_tx(kinds, accum_dtype):
  make = {
    "inner": lambda: optax.adam(0.1),
    "acc": lambda: jaxaccum.accumulate(optax.adam(0.1), K, accum_dtype=accum_dtype),
  }
  return per_key({kind: optax.chain(cast_each(), make[kind]()) for kind in kinds})


def combo_loss(params, x):
  """A float32 loss of every subtree, each computed in its own dtype."""
  total = jnp.zeros((), jnp.float32)
  for kind in params.values():
    for sub in kind.values():
      h = jnp.tanh(x.astype(sub["w"].dtype) @ sub["w"] + sub["b"][None, :])
      total += jnp.mean(h.astype(jnp.float32) ** 2)
  return total


def subtrees(tree):
  """``(kind, grad, param), subtree`` pairs."""
  for kind, subs in tree.items():
    for key, sub in subs.items():
      yield (kind, *key.split("_")), sub


@pytest.mark.slow
@pytest.mark.parametrize("accum_dtype", ["float32", "float64"])
def test_value_and_grad_and_make_train_step_in_every_dtype_combination(accum_dtype):
  """k + 1 steps of make_train_step against value_and_grad then tx.update;
  float64 sums under x64."""
  with jax.enable_x64(accum_dtype == "float64"):
    a_dtype = jnp.dtype(accum_dtype)
    # Plain adam does not see the sums' dtype: float32 covers it.
    kinds = ("inner", "acc") if accum_dtype == "float32" else ("acc",)
    tx = combo_tx(kinds, a_dtype)
    params0 = combo_params(kinds)
    xs = [
      jax.random.normal(jax.random.key(i), (2 * M, 3), jnp.float32)
      for i in range(K + 1)
    ]
    grad_fn = jaxaccum.value_and_grad(combo_loss, M, accum_dtype=a_dtype)

    @jax.jit
    def reference(params, state, x):
      """value_and_grad, then tx.update; and the full batch's value and grads."""
      value, grads = grad_fn(params, x)
      updates, new_state = tx.update(grads, state, params)
      # As make_train_step keeps it (plain adam's would change dtype).
      new_state = cast_like(new_state, state)
      full = jax.value_and_grad(combo_loss)(params, x)
      return (value, grads), full, updates, new_state

    params, state0 = params0, tx.init(params0)
    state = state0
    adam = optax.adam(0.1)
    for i, x in enumerate(xs):
      (value, grads), (full_value, full_grads), updates, new_state = reference(
        params, state, x
      )
      # accumulate()'s state keeps its dtypes; plain adam's changes as in optax.
      direct = jax.eval_shape(tx.update, grads, state, params)[1]
      assert dtypes(direct["acc"]) == dtypes(state0["acc"])
      state = new_state
      assert dtypes(grads) == dtypes(params0)
      assert_close(value, full_value, jnp.float16)
      assert_close(grads, full_grads, jnp.float32)  # each leaf in its dtype
      for (kind, g, p), sub in subtrees(updates):
        cast = make_params(DTYPES[g])  # a gradient of that dtype
        param = params[kind][f"{g}_{p}"]
        want = jax.eval_shape(adam.update, cast, adam.init(param), param)[0]
        assert dtypes(sub) == dtypes(want), (kind, g, p, i)
      params = optax.apply_updates(params, updates)
      assert dtypes(params) == dtypes(params0)

    # make_train_step: the same, in one donated step whose state keeps its
    # dtypes (else lax.cond and donation fail).
    step = jaxaccum.make_train_step(combo_loss, tx, M, accum_dtype=a_dtype)
    got_params = jax.tree.map(jnp.copy, params0)
    got_state = tx.init(got_params)
    with warnings.catch_warnings():
      warnings.simplefilter("error")  # "Some donated buffers were not usable"
      for x in xs:
        got_params, got_state, _ = step(got_params, got_state, x)
    assert dtypes(got_params) == dtypes(params0)
    assert dtypes(got_state) == dtypes(state0)
    got = dict(subtrees(got_params))
    for (kind, g, p), sub in subtrees(params):
      assert_close(got[kind, g, p], sub, DTYPES[g], DTYPES[p], what=(kind, g, p))
