"""``jaxaccum.testing.compile_step`` and ``read_compiled``: a compiled step
read as its HLO text and its memory analysis say, checked against the two
readers it puts together (``testing.collectives`` of the text,
``jaxaccum.compiled_memory``) and against what the steps are known to do:
the ``mesh=`` path reduces once after its loop, a pipeline moves one
activation per trip of its loop along the stage axis.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from jaxaccum import testing


def loss(w, x):
  return jnp.mean(jnp.tanh(x @ w) ** 2)


def data_parallel():
  """The mesh= path on 8 devices, k = 4, and its arguments."""
  mesh = jax.make_mesh((8,), ("data",))
  w = jax.device_put(jnp.ones((3, 5)), NamedSharding(mesh, P()))
  x = jax.device_put(jnp.ones((64, 3)), NamedSharding(mesh, P("data")))
  fun = jaxaccum.value_and_grad(loss, 4, mesh=mesh, data_axis="data")
  return mesh, fun, (w, x)


def test_a_compiled_step_reads_as_its_text_and_its_memory_analysis():
  _, fun, args = data_parallel()
  step = testing.compile_step(fun, *args)
  assert step.memory == jaxaccum.compiled_memory(fun, *args)
  assert step.peak_bytes == step.memory.peak_bytes
  assert step.collectives == tuple(testing.collectives(step.text))
  assert step.loops == tuple(testing.loops(step.text))
  assert step.bytes_communicated == testing.bytes_communicated(step.text)
  assert step.compiled.as_text() == step.text
  again = testing.read_compiled(jax.jit(fun).lower(*args).compile())
  assert (again.collectives, again.loops, again.memory) == (
    step.collectives,
    step.loops,
    step.memory,
  )


def test_hlo_text_reads_without_memory():
  _, fun, args = data_parallel()
  step = testing.compile_step(fun, *args)
  text = testing.read_compiled(step.text)
  assert (text.compiled, text.memory, text.peak_bytes) == (None, None, None)
  assert (text.collectives, text.loops) == (step.collectives, step.loops)


def test_the_mesh_path_reduces_once_over_data_after_its_loop():
  """One loop of k = 4 trips, nothing inside it; one all-reduce over the
  data axis of the gradient (15 floats) and the loss."""
  mesh, fun, args = data_parallel()
  step = testing.compile_step(fun, *args)
  (loop,) = step.loops
  assert (loop.trip_count, loop.executions, loop.outer) == (4, 1, ())
  assert step.inside(loop) == step.inside(loop.name) == []
  assert [
    (c.op, c.bytes, c.executions, c.loops, c.axes(mesh)) for c in step.collectives
  ] == [("all-reduce", (15 + 1) * 4, 1, (), ("data",))]


def test_a_pipelines_permutes_run_once_per_trip_of_its_loop_along_the_stages():
  """4 stages, 4 pipeline micro-batches, one repeat: a loop of 7 trips
  moving one micro-batch's activation (4 rows of 8 floats) along the
  stage axis each trip; the results are gathered after it."""
  mesh = jax.make_mesh((2, 4), ("data", "stage"))
  pipe = jaxaccum.pipeline(
    lambda w, h: jnp.tanh(h @ w), num_stages=4, num_micro_batches=4
  )
  w = jax.device_put(jnp.ones((4, 8, 8)), NamedSharding(mesh, P("stage")))
  x = jax.device_put(jnp.ones((32, 8)), NamedSharding(mesh, P("data")))
  with jax.set_mesh(mesh):
    step = testing.compile_step(pipe, w, x)
  permutes = [c for c in step.collectives if "permute" in c.op]
  assert [(c.bytes, c.executions, c.axes(mesh)) for c in permutes] == [
    (4 * 8 * 4, 7, ("stage",))
  ]
  (loop,) = {step.loop(c.loops[-1]) for c in permutes}
  assert (loop.trip_count, loop.outer) == (7, ())
  assert step.inside(loop) == permutes
  with pytest.raises(KeyError, match="No while loop named 'nowhere'"):
    step.loop("nowhere")


def test_op_names_name_the_jax_operations():
  _, fun, args = data_parallel()
  names = testing.compile_step(fun, *args).op_names()
  assert names and any("tanh" in n for n in names.values())
