"""scikit-learn's bundled digits (8x8 images, offline), split as the examples use them.

A helper of the examples, not one of them: ``from _digits import digits_split``
works when an example runs as ``python examples/NAME.py``, since Python puts
the script's folder on ``sys.path``.
"""

from __future__ import annotations

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

TRAIN_ROWS = 1344  # = 8 * 168 = 64 * 21: splits into 8 or 64 equal micro-batches.


def digits_split(
  train_rows: int = TRAIN_ROWS, *, images: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """The fixed, stratified split: 1344 training and 453 test images by default.

  Returns ``(x_train, y_train, x_test, y_test)``; ``x`` is float32 of
  shape ``(rows, 64)``, or ``(rows, 8, 8, 1)`` (NHWC) with ``images=True``,
  scaled to [0, 1], ``y`` int32 labels 0..9. The split is the same for a
  given ``train_rows`` (``random_state=0``); the other 1797 - ``train_rows``
  images are the test set.
  """
  digits = load_digits()
  if images:
    x = (digits.images / 16.0).astype(np.float32)[..., None]
  else:
    x = (digits.data / 16.0).astype(np.float32)
  y = digits.target.astype(np.int32)
  x_train, x_test, y_train, y_test = train_test_split(
    x, y, train_size=train_rows, random_state=0, stratify=y
  )
  return x_train, y_train, x_test, y_test
