"""Structural properties of the compiled step: one loop, not k copies."""

import jax
import jax.numpy as jnp
import pytest

import jaxaccum


def loss(w, batch):
  x, y = batch
  h = jnp.tanh(x @ w["w1"])
  return jnp.mean((h @ w["w2"] - y) ** 2)


def program_size(k, batch_size=64):
  w = {"w1": jnp.ones((4, 8)), "w2": jnp.ones(8)}
  batch = (jnp.ones((batch_size, 4)), jnp.ones(batch_size))
  fun = jaxaccum.value_and_grad(loss, k)
  jaxpr = jax.make_jaxpr(fun)(w, batch)
  hlo = jax.jit(fun).lower(w, batch).as_text()
  return len(jaxpr.eqns), hlo.count("\n"), hlo.count("stablehlo.while")


@pytest.mark.parametrize("k", [2, 8, 64])
def test_traced_program_does_not_grow_with_k(k):
  eqns, lines, loops = program_size(k)
  eqns2, lines2, loops2 = program_size(2)
  assert (eqns, lines, loops) == (eqns2, lines2, loops2)
  assert loops == 1
