"""``pipe``'s arguments: the trace-time checks of the options, the stacked
layers, the batch and ``layer_fn``'s output, and the extra arguments split
into traced arrays and static values."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxaccum import _compat

PyTree = Any


def check_options(
  num_stages: Any,
  num_micro_batches: Any,
  repeats: Any,
  rng_argnum: Any,
  stage_axis: Any,
) -> None:
  """``pipeline()``'s options, checked where it is called."""
  for name, value in (
    ("num_stages", num_stages),
    ("num_micro_batches", num_micro_batches),
    ("repeats", repeats),
  ):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value!r}.")
  if rng_argnum is not None and (
    isinstance(rng_argnum, bool) or not isinstance(rng_argnum, int) or rng_argnum < 2
  ):
    raise ValueError(
      f"rng_argnum must be the position of the key among pipe's arguments, "
      f"2 or more (pipe(stacked, x, key) has it at 2), got {rng_argnum!r}."
    )
  if not isinstance(stage_axis, str):
    raise ValueError(f"stage_axis must be a mesh axis name, got {stage_axis!r}.")


def layers(stacked: PyTree, stages: int, repeats: int) -> int:
  """``L``, checked: every leaf stacks the same layers, in stages."""
  leaves = jax.tree_util.tree_leaves_with_path(stacked)
  if not leaves:
    raise ValueError("stacked has no arrays: pass the stacked layer parameters.")
  lead = 1 if repeats == 1 else 2
  lengths = {}
  for path, leaf in leaves:
    shape = jnp.shape(leaf)
    name = f"stacked{jax.tree_util.keystr(path)}"
    if len(shape) < lead:
      raise ValueError(
        f"{name} has shape={shape}: every leaf of stacked needs a leading "
        + ("layer axis." if repeats == 1 else f"(repeats={repeats}, L // repeats).")
      )
    if repeats > 1 and shape[0] != repeats:
      raise ValueError(
        f"{name} has shape={shape}, and with repeats={repeats} every leaf is "
        f"stacked (repeats, L // repeats, ...), one row of layers per repeat, "
        f"for the circular layout: pass w.reshape({repeats}, -1, *w.shape[1:]) "
        f"and shard its second axis P(None, 'stage')."
      )
    lengths[name] = shape[0] * (shape[1] if repeats > 1 else 1)
  total = _agreed(
    lengths,
    "The leaves of stacked hold different numbers of layers ({}): stack every "
    "parameter of the L layers on the same leading axis.",
  )
  if total % (stages * repeats):
    raise ValueError(
      f"L={total} layers do not split into num_stages={stages} * "
      f"repeats={repeats} = {stages * repeats} equal groups: choose L, "
      f"num_stages and repeats with L divisible by num_stages * repeats."
    )
  return total


def batch_size(x: PyTree, micro_batches: int) -> int:
  leaves = jax.tree_util.tree_leaves_with_path(x)
  if not leaves:
    raise ValueError("x has no arrays: pass the activations, pipe(stacked, x).")
  sizes = {}
  for path, leaf in leaves:
    shape = jnp.shape(leaf)
    name = f"x{jax.tree_util.keystr(path)}"
    if not shape:
      raise ValueError(
        f"{name} is a scalar: every leaf of x needs a leading batch axis "
        "(pass per-example values with one, others as pipe's extra arguments)."
      )
    sizes[name] = shape[0]
  size = _agreed(
    sizes,
    "The leaves of x have different batch sizes ({}): every leaf of the "
    "activation needs the same leading batch axis.",
  )
  if size % micro_batches:
    raise ValueError(
      f"The batch_size={size} is not divisible by num_micro_batches="
      f"{micro_batches}: choose a num_micro_batches that divides it "
      f"({divisors(size)})."
    )
  return size


def _agreed(sizes: dict[str, int], message: str) -> int:
  """The one size in ``sizes`` (leaf name -> size), or a ``ValueError``:
  ``message`` with the sizes listed."""
  if len(set(sizes.values())) > 1:
    raise ValueError(message.format(", ".join(f"{n}: {v}" for n, v in sizes.items())))
  return next(iter(sizes.values()))


def divisors(n: int) -> str:
  """``n``'s divisors, listed for an error message."""
  found = [d for d in range(1, n + 1) if n % d == 0]
  return ", ".join(map(str, found))


def check_layer_output(out: PyTree, micro: PyTree) -> None:
  """``layer_fn``'s output (from ``jax.eval_shape``) against its input."""
  got_tree: Any = jax.tree.structure(out)
  want_tree: Any = jax.tree.structure(micro)
  if got_tree != want_tree:
    raise ValueError(
      f"layer_fn returned {got_tree} for an activation {want_tree}: a layer "
      "must return the activation with the structure it got."
    )
  for (path, o), w in zip(
    jax.tree_util.tree_leaves_with_path(out), jax.tree.leaves(micro), strict=True
  ):
    if (o.shape, o.dtype) != (w.shape, w.dtype):
      raise ValueError(
        f"layer_fn turned the activation x{jax.tree_util.keystr(path)} of "
        f"shape={w.shape}, dtype={w.dtype} into shape={o.shape}, "
        f"dtype={o.dtype}: each layer's output is the next layer's input, so "
        "it must keep the shape and dtype (cast back, or change them outside "
        "the pipeline)."
      )


class Args:
  """``pipe``'s extra arguments: arrays are traced into the loop; other
  values reach ``layer_fn`` as they are (static)."""

  def __init__(self, args: tuple[Any, ...]):
    self.args = args
    self.positions = [i for i, a in enumerate(args) if _is_array(a)]
    self.traced = [args[i] for i in self.positions]

  def full(self, traced: list[Any]) -> list[Any]:
    """The arguments, with ``traced`` in the arrays' places."""
    full = list(self.args)
    for i, a in zip(self.positions, traced, strict=True):
      full[i] = a
    return full


def _is_array(a: Any) -> bool:
  return isinstance(a, (jax.Array, np.ndarray)) or _compat.is_tracer(a)
