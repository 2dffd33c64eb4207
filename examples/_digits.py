"""scikit-learn's bundled digits (8x8 images, offline), split as the examples use them.

A helper of the examples, not one of them: ``from _digits import digits_split``
works when an example runs as ``python examples/NAME.py``, since Python puts
the script's folder on ``sys.path``. Importing it is cheap (numpy and
scikit-learn load when ``digits_split`` first runs), so that an example can
check its command line against ``ROWS`` and ``TRAIN_ROWS`` before it imports
anything heavy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
  import numpy as np

ROWS = 1797  # the images in scikit-learn's digits
TRAIN_ROWS = 1344  # = 8 * 168 = 64 * 21: splits into 8 or 64 equal micro-batches.
MIN_SPLIT_ROWS = 10  # a stratified split needs a row of each of the 10 digits


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
  import numpy as np  # noqa: PLC0415 (see the module's docstring)
  from sklearn.datasets import load_digits  # noqa: PLC0415
  from sklearn.model_selection import train_test_split  # noqa: PLC0415

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
