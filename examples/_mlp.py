"""A plain-JAX MLP (a list of weight dicts), shared by some of the examples.

A helper of the examples, not one of them: ``from _mlp import init_mlp, mlp``
works when an example runs as ``python examples/NAME.py``, since Python puts
the script's folder on ``sys.path``.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np


def init_mlp(key: jax.Array, sizes: tuple[int, ...]) -> list[dict[str, jax.Array]]:
  """float32 He-initialized weights and zero biases, one dict per layer."""
  params = []
  for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
    w = jax.random.normal(jax.random.fold_in(key, i), (fan_in, fan_out))
    params.append({"w": w * np.sqrt(2.0 / fan_in), "b": jnp.zeros(fan_out)})
  return params


def mlp(params: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
  """Logits of shape ``(rows, 10)``; ReLU between the layers.

  It computes in the dtype of ``params`` and ``x``.
  """
  for layer in params[:-1]:
    x = jax.nn.relu(x @ layer["w"] + layer["b"][None, :])
  return x @ params[-1]["w"] + params[-1]["b"][None, :]
