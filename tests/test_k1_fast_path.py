"""k = 1 is the plain full-batch step: no loop in the traced program.

The README promises that ``num_micro_batches=1`` compiles to the plain
full-batch step. XLA removes a ``while`` with a trip count of 1 by itself, so
the optimized HLO cannot tell whether jaxaccum traced a loop; the jaxpr can.
These tests read both: the jaxpr (where a lost fast path would show as a
``scan`` of length 1) and the optimized HLO (the program that runs).
"""

import collections
import re

import jax
import jax.extend
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum

LOOPS = ("scan", "while")
# "%name = type opcode(operands)", the type possibly a tuple with spaces.
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s+([a-z][\w\-]*)\(")


def loss(w, batch):
  x, y = batch
  return jnp.mean((jnp.tanh(x @ w) - y) ** 2)


def problem():
  keys = jax.random.split(jax.random.key(0), 3)
  w = jax.random.normal(keys[0], (3,))
  batch = (jax.random.normal(keys[1], (16, 3)), jax.random.normal(keys[2], (16,)))
  return w, batch


def loop_equations(jaxpr):
  """Every ``scan``/``while`` equation, in sub-jaxprs (pjit, shard_map) too."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in LOOPS:
      found.append(eqn)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      found += loop_equations(sub)
  return found


def hlo_ops(fun, *args):
  """The multiset of instruction opcodes in the optimized HLO."""
  text = jax.jit(fun).lower(*args).compile().as_text()
  return collections.Counter(
    m.group(1) for m in map(INSTRUCTION.match, text.splitlines()) if m
  )


def test_k1_traces_no_loop():
  w, batch = problem()
  jaxpr = jax.make_jaxpr(jaxaccum.value_and_grad(loss, 1))(w, batch)
  assert loop_equations(jaxpr.jaxpr) == []


@pytest.mark.parametrize("k", [2, 4])
def test_k_at_least_2_traces_one_scan_of_length_k(k):
  w, batch = problem()
  jaxpr = jax.make_jaxpr(jaxaccum.value_and_grad(loss, k))(w, batch)
  (scan,) = loop_equations(jaxpr.jaxpr)
  assert scan.primitive.name == "scan" and scan.params["length"] == k
  assert hlo_ops(jaxaccum.value_and_grad(loss, k), w, batch)["while"] == 1


def test_k1_compiles_to_the_plain_full_batch_program():
  """The optimized HLO of k = 1 has the same instructions as ``jax.jit`` of
  ``jax.value_and_grad``: no while, no accumulator, nothing extra."""
  w, batch = problem()
  got = hlo_ops(jaxaccum.value_and_grad(loss, 1), w, batch)
  assert got["while"] == 0
  assert got == hlo_ops(jax.value_and_grad(loss), w, batch)


def test_k1_data_parallel_traces_no_loop():
  """The mesh path runs the same engine per device: no loop at k = 1."""
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  w, batch = problem()
  batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
  for k, loops in ((1, 0), (2, 1)):
    fun = jaxaccum.value_and_grad(loss, k, mesh=mesh, data_axis="data")
    assert len(loop_equations(jax.make_jaxpr(fun)(w, batch).jaxpr)) == loops, k
