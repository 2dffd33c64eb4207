"""The per-element pieces of examples/input_pipeline.py, in an importable module.

A helper of the examples, not one of them. Grain's worker processes
(``IterDataset.mp_prefetch``) are *spawned*: each one unpickles the pipeline,
and a function is pickled by its module and name. So the data source and the
augmentations live here, as top-level names of a module that a fresh Python
process can import (the examples folder is on the workers' ``sys.path``,
inherited from the parent), and not in a script or a closure. Only numpy is
imported: a worker needs no JAX.

The augmentation is what a digits classifier would use: a random rotation of
up to ``MAX_DEGREES``, a random shift of up to ``MAX_SHIFT`` pixels in each
direction (bilinear resampling, zeros outside the image), then Gaussian pixel
noise, clipped to [0, 1]. ``augment_batch`` draws and resamples a whole batch
with a few vectorized numpy calls; ``augment_example`` is the same arithmetic
for one image, as a per-example ``random_map`` would run it.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

MAX_DEGREES = 12.0  # the largest rotation, either way
MAX_SHIFT = 1.0  # pixels, along each axis
NOISE = 0.05  # standard deviation of the pixel noise (pixels are in [0, 1])

Example = dict[str, np.ndarray]


class DigitsSource:
  """A random-access source of ``{"image", "label", "index"}`` dicts.

  ``image`` is float32 of shape ``(8, 8, 1)``, ``label`` an int32 scalar and
  ``index`` the row's position in ``images``, so that a consumer can check
  which rows it received. Grain reads it through ``__len__`` and
  ``__getitem__``.
  """

  def __init__(self, images: np.ndarray, labels: np.ndarray):
    if len(images) != len(labels):
      raise ValueError(f"{len(images)=} != {len(labels)=}")
    self.images = np.asarray(images, np.float32)
    self.labels = np.asarray(labels, np.int32)

  def __len__(self) -> int:
    return len(self.images)

  def __getitem__(self, index: int) -> Example:
    return {
      "image": self.images[index],
      "label": self.labels[index],
      "index": np.int32(index),
    }


class ShuffledBatches:
  """An endless random-access source whose elements are whole batches.

  Element ``i`` is batch ``i % batches_per_epoch`` of epoch
  ``i // batches_per_epoch``; each epoch is its own permutation of the rows
  (one numpy ``permutation``, seeded by ``(seed, epoch)``), cut into
  ``batch_size`` consecutive slices, and a batch is one fancy-indexed gather.
  The same dicts as ``DigitsSource`` gives, stacked: Grain then handles one
  element per batch instead of one per row.
  """

  def __init__(
    self, images: np.ndarray, labels: np.ndarray, batch_size: int, seed: int
  ):
    if len(images) != len(labels) or len(images) % batch_size:
      raise ValueError(f"{len(images)=}, {len(labels)=}, {batch_size=}")
    self.images = np.asarray(images, np.float32)
    self.labels = np.asarray(labels, np.int32)
    self.batch_size, self.seed = batch_size, seed
    self.batches_per_epoch = len(images) // batch_size

  def __len__(self) -> int:
    return sys.maxsize  # endless, as MapDataset.repeat() makes it

  def __getitem__(self, index: int) -> Example:
    epoch, i = divmod(index, self.batches_per_epoch)
    order = np.random.default_rng([self.seed, epoch]).permutation(len(self.images))
    rows = order[i * self.batch_size : (i + 1) * self.batch_size].astype(np.int32)
    return {"image": self.images[rows], "label": self.labels[rows], "index": rows}


def shift_rotate(images: np.ndarray, rng: np.random.Generator) -> np.ndarray:
  """Randomly rotated, shifted and noised copies of ``images``.

  Args:
    images: float32 of shape ``(n, height, width, channels)``, in [0, 1].
    rng: draws one angle and one shift per image, and the noise.

  Returns:
    float32 of the same shape, in [0, 1].
  """
  n, height, width, _ = images.shape
  angle = np.deg2rad(rng.uniform(-MAX_DEGREES, MAX_DEGREES, n))
  shift = rng.uniform(-MAX_SHIFT, MAX_SHIFT, (2, n))
  cos, sin = np.cos(angle)[:, None, None], np.sin(angle)[:, None, None]
  # Output pixel (r, c) reads the input at the inverse transform of (r, c):
  # undo the shift, then rotate back by -angle around the image's center.
  cy, cx = (height - 1) / 2, (width - 1) / 2
  rows, cols = np.mgrid[0:height, 0:width].astype(np.float32)
  dy = rows[None] - cy - shift[0][:, None, None]  # (n, height, width)
  dx = cols[None] - cx - shift[1][:, None, None]
  src_y = cos * dy + sin * dx + cy
  src_x = -sin * dy + cos * dx + cx
  y0, x0 = np.floor(src_y).astype(np.int32), np.floor(src_x).astype(np.int32)
  wy, wx = (src_y - y0)[..., None], (src_x - x0)[..., None]
  batch = np.arange(n)[:, None, None]
  out = np.zeros(images.shape, np.float32)
  for oy, ox, weight in (
    (0, 0, (1 - wy) * (1 - wx)),
    (0, 1, (1 - wy) * wx),
    (1, 0, wy * (1 - wx)),
    (1, 1, wy * wx),
  ):
    y, x = y0 + oy, x0 + ox
    inside = ((y >= 0) & (y < height) & (x >= 0) & (x < width))[..., None]
    pixel = images[batch, np.clip(y, 0, height - 1), np.clip(x, 0, width - 1)]
    out += np.where(inside, weight * pixel, 0.0).astype(np.float32)
  out += rng.normal(0.0, NOISE, out.shape).astype(np.float32)
  return np.clip(out, 0.0, 1.0)


def augment_batch(batch: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
  """``shift_rotate`` on a batch's ``"image"``; labels and indices unchanged."""
  return {**batch, "image": shift_rotate(batch["image"], rng)}


def augment_example(example: Example, rng: np.random.Generator) -> Example:
  """``shift_rotate`` on one example's ``"image"`` (a batch of one)."""
  return {**example, "image": shift_rotate(example["image"][None], rng)[0]}
