"""What the compile-only benchmarks share: a step's abstract, sharded
arguments, a row that records a compile (or why it failed), and a sweep
that writes its rows as they come.

``fsdp.py``, ``pipeline.py``, ``maxtext_pipeline.py`` and
``accelerator_memory.py`` compile for accelerators that are not there
(``jaxaccum.compile_target``) and never run. A step XLA refuses (the TPU
compiler refuses a program above the chip's memory) is a row with an
``error``; the sweep goes on.
"""

from __future__ import annotations

import importlib.metadata
import json
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

PyTree = Any


def error(e: BaseException) -> str:
  """``Type: first line`` of an exception (300 characters at most)."""
  lines = str(e).strip().splitlines()
  return f"{type(e).__name__}: {(lines[0] if lines else '')[:300]}"


def timed(row: dict[str, Any], measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
  """``row`` updated with ``measure()``, or with its ``error`` where it
  raised (recorded; the sweep goes on), and the seconds it took
  (``compile_s``)."""
  start = time.perf_counter()
  try:
    row.update(measure())
  except Exception as e:
    row["error"] = error(e)
  row["compile_s"] = round(time.perf_counter() - start, 1)
  return row


def record(
  rows: list[dict[str, Any]],
  row: dict[str, Any],
  partial: pathlib.Path | None,
  line: str,
) -> None:
  """Appends ``row``; writes every row so far to ``partial`` (a long sweep's
  rows as they come, ``--partial``); prints ``line`` and the row's error."""
  rows.append(row)
  if partial is not None:
    partial.write_text(json.dumps(rows, indent=1) + "\n")
  error = f"  {row['error'][:120]}" if "error" in row else ""
  print(line + error, file=sys.stderr, flush=True)


def versions(*names: str) -> dict[str, str]:
  """The installed versions of ``names`` (``not installed`` if absent)."""
  out = {}
  for name in names:
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = "not installed"
  return out


def target_info(target: Any) -> dict[str, Any]:
  """A compile target as the JSON records it."""
  return {
    "title": target.title,
    "device_kind": target.device_kind,
    "topology": target.topology,
    "memory_bytes": target.memory_bytes,
  }


def train_args(
  tx: optax.GradientTransformation,
  shapes: PyTree,
  specs: PyTree,
  mesh: jax.sharding.Mesh,
  *,
  tokens: jax.ShapeDtypeStruct,
  tokens_spec: P,
) -> tuple[PyTree, PyTree, jax.ShapeDtypeStruct]:
  """A train step's ``(params, opt_state, tokens)`` as ``ShapeDtypeStruct``s
  on ``mesh``: the parameters by ``specs``, the optimizer state like its
  parameters (the rest replicated), the tokens by ``tokens_spec``."""

  def on(x: Any, spec: P) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

  state = optax.tree_utils.tree_map_params(
    tx,
    on,
    jax.eval_shape(tx.init, shapes),
    specs,
    transform_non_params=lambda x: on(x, P()),
    is_leaf=lambda x: isinstance(x, P),
  )
  return jax.tree.map(on, shapes, specs), state, on(tokens, tokens_spec)
