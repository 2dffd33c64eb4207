"""examples/input_pipeline.py: the Grain pipeline delivers what it claims, and
the accumulated step learns from it (tiny settings, no timing assertions)."""

import contextlib
import io
import json
import pathlib

import numpy as np
import pytest
from examples_util import load_example

example = load_example("input_pipeline")
pipeline_parts = load_example("_pipeline")
x_train, y_train, _, _ = load_example("_digits").digits_split(images=True)
ROWS, BATCH = len(x_train), 192
PER_EPOCH = ROWS // BATCH  # 7


def take(ds, batches):
  it = iter(ds)
  try:
    return [next(it) for _ in range(batches)]
  finally:
    it.close()


def epochs_of(indices):
  return np.asarray(indices).reshape(-1, ROWS)


def assert_each_row_once_per_epoch_in_new_orders(indices):
  epochs = epochs_of(indices)
  assert len(epochs) >= 2
  for epoch in epochs:
    np.testing.assert_array_equal(np.sort(epoch), np.arange(ROWS))
    assert not np.array_equal(epoch, np.arange(ROWS))  # shuffled
  assert not np.array_equal(epochs[0], epochs[1])  # reshuffled every epoch


@pytest.mark.parametrize("source", ["rows", "batches"])
def test_pipeline_without_augmentation_delivers_each_row_once_per_epoch(source):
  ds = example.digits_pipeline(
    x_train, y_train, batch_size=BATCH, seed=3, augment="none", source=source
  )
  batches = take(ds, 2 * PER_EPOCH)
  index = np.concatenate([b["index"] for b in batches])
  assert_each_row_once_per_epoch_in_new_orders(index)
  for b in batches:
    assert b["image"].shape == (BATCH, 8, 8, 1) and b["image"].dtype == np.float32
    np.testing.assert_array_equal(b["image"], x_train[b["index"]])
    np.testing.assert_array_equal(b["label"], y_train[b["index"]])


@pytest.mark.parametrize(
  ("augment", "source"), [("batch", "rows"), ("example", "rows"), ("batch", "batches")]
)
def test_augmentation_moves_pixels_but_keeps_labels(augment, source):
  ds = example.digits_pipeline(
    x_train, y_train, batch_size=BATCH, seed=0, augment=augment, source=source
  )
  (batch,) = take(ds, 1)
  original = x_train[batch["index"]]
  np.testing.assert_array_equal(batch["label"], y_train[batch["index"]])
  image = batch["image"]
  assert image.shape == original.shape and image.dtype == np.float32
  assert image.min() >= 0.0 and image.max() <= 1.0
  # Every image changed, by more than the pixel noise alone would...
  change = np.abs(image - original).mean(axis=(1, 2, 3))
  assert np.all(change > 0.02)
  assert np.mean(change) > 0.06
  # ...but each is still its own digit: closer to its original than, on
  # average, to the originals of the other classes in the batch.
  corr = np.corrcoef(image.reshape(BATCH, -1), original.reshape(BATCH, -1))
  corr = corr[:BATCH, BATCH:]  # augmented x original
  labels = batch["label"]
  own = np.diag(corr)
  others = [corr[i, labels != labels[i]].mean() for i in range(BATCH)]
  assert np.mean(own > np.asarray(others)) > 0.9


class FixedDraws:
  """A stand-in generator: given angles and shifts, no noise."""

  def __init__(self, angles, shifts):
    self.draws = [np.asarray(angles, float), np.asarray(shifts, float)]

  def uniform(self, low, high, size):
    del low, high
    return np.broadcast_to(self.draws.pop(0), size)

  def normal(self, loc, scale, size):
    del loc, scale
    return np.zeros(size)


def test_shift_rotate_resamples_exactly():
  images = x_train[:4]
  same = pipeline_parts.shift_rotate(images, FixedDraws(0.0, 0.0))
  np.testing.assert_allclose(same, images, atol=1e-6)
  # One pixel down, none across: row r + 1 of the output is row r of the input.
  shifts = [[1.0] * 4, [0.0] * 4]
  down = pipeline_parts.shift_rotate(images, FixedDraws(0.0, shifts))
  np.testing.assert_allclose(down[:, 1:], images[:, :-1], atol=1e-6)
  np.testing.assert_array_equal(down[:, 0], 0.0)
  # A quarter turn (90 degrees, beyond the random range) is np.rot90 on the
  # square image: the sampling grid, not only its offsets, is right.
  quarter = pipeline_parts.shift_rotate(images, FixedDraws(90.0, 0.0))
  turned = np.rot90(images, k=1, axes=(1, 2))
  np.testing.assert_allclose(quarter, turned, atol=1e-5)


@pytest.fixture(scope="module")
def device_run(tmp_path_factory):
  """main() with tiny settings: 2 epochs, every measurement once, 2 steps."""
  capture = io.StringIO()
  with contextlib.redirect_stdout(capture):
    result = example.main(
      steps=2 * PER_EPOCH,
      batch_size=BATCH,
      num_micro_batches=8,
      loss_every=5,
      measure_steps=2,
      repeats=1,
      measure_workers=(),  # spawning takes seconds; see the worker test below
      out_dir=str(tmp_path_factory.mktemp("device")),
      progress=False,
    )
  return result, capture.getvalue()


@pytest.mark.slow  # main() end to end (the device_run fixture)
def test_main_trains_from_the_pipeline_and_reports(device_run):
  result, stdout = device_run
  assert result["batch_memory_kind"] == "device"
  assert result["indices"].shape == (2 * ROWS,)
  assert_each_row_once_per_epoch_in_new_orders(result["indices"])
  losses = result["losses"]
  assert losses.shape == (2 * PER_EPOCH,) and np.all(np.isfinite(losses))
  assert np.mean(losses[-3:]) < 0.75 * losses[0]  # 2.3 (chance) -> about 1.4
  assert result["test_accuracy"] > 0.5  # chance is 0.1
  # A summary in words, ending with where the numbers went; no JSON dump.
  last = stdout.strip().splitlines()[-1]
  assert last.startswith("plot: ") and last.endswith("input_pipeline.json")
  assert "{" not in stdout
  assert "batches already in memory, cycled" in stdout
  assert "rows, per-example augmentation, 0 workers" in stdout
  summary = json.loads(pathlib.Path(result["json"]).read_text())
  assert summary == json.loads(json.dumps(result["summary"]))
  assert summary["test_accuracy"] == pytest.approx(result["test_accuracy"])
  assert summary["train_steps_per_s"] > 0
  expected = {
    "resident",
    "grain",
    "grain_batches_source",
    "python_loop",
    "grain_default_read_threads",
    "resident_loss_every_step",
    "python_loop_loss_every_step",
    "grain_per_example_0w",
  }
  assert set(summary["steps_per_s"]) == expected
  pipelines = {
    "rows_no_augment",
    "rows_per_batch",
    "batches_per_batch",
    "rows_per_example_0w",
  }
  assert set(summary["batches_per_s"]) == pipelines
  assert all(v > 0 for v in summary["steps_per_s"].values())
  assert all(v > 0 for v in summary["batches_per_s"].values())
  assert set(summary["first_batch_s"]) == pipelines
  assert all(v > 0 for v in summary["first_batch_s"].values())
  assert pathlib.Path(result["png"]).is_file()


@pytest.mark.slow  # main() end to end (the device_run fixture)
def test_pinned_host_batches_stream_to_the_same_losses(device_run, tmp_path):
  # The same batches in the same order, prefetched into host memory: the
  # accumulated step streams the micro-batches in and computes the same
  # steps as with the batches in device memory.
  result = example.main(
    steps=2 * PER_EPOCH,
    batch_size=BATCH,
    num_micro_batches=8,
    placement="pinned_host",
    measure_steps=0,
    out_dir=str(tmp_path),
    progress=False,
  )
  assert result["batch_memory_kind"] == "pinned_host"
  np.testing.assert_array_equal(result["indices"], device_run[0]["indices"])
  np.testing.assert_allclose(result["losses"], device_run[0]["losses"], rtol=1e-5)


@pytest.mark.slow  # spawns a Grain worker process
def test_a_spawned_worker_delivers_the_same_batches():
  # The worker unpickles the pipeline: its source and augmentation must be
  # importable (examples/_pipeline.py), and Grain's absl flags parsed.
  ds = lambda workers: example.digits_pipeline(  # noqa: E731
    x_train, y_train, batch_size=BATCH, seed=1, augment="batch", workers=workers
  )
  in_process, in_worker = take(ds(0), 3), take(ds(1), 3)
  for a, b in zip(in_process, in_worker, strict=True):
    assert a.keys() == b.keys()
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])
