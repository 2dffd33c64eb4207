"""Strict JAX settings for the whole suite, and 8 fake CPU devices.

The device count and XLA's thread pools are fixed when JAX's backends start,
so this module sets them at import time; pytest imports conftest.py before
any test module. ``jaxaccum.testing.cpu_devices`` also gives XLA's CPU
client twice as many threads as devices: with one thread per device, a
collective can wait for a thread forever, and XLA aborts the process
(tests/README.md, "Devices, processes and targets").
"""

import gc
import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest

from jaxaccum.testing import cpu_devices

cpu_devices()  # 8, or the count XLA_FLAGS names

jax.config.update("jax_numpy_rank_promotion", "raise")

# Many tests compile the same program (the full-batch reference at the same
# shapes, parametrized variants). A compilation cache shared by the pytest
# workers of one run compiles each once; keyed on the HLO, it cannot change a
# result.
_CACHE = os.environ.setdefault(
  "JAXACCUM_TEST_COMPILATION_CACHE",
  os.path.join(tempfile.gettempdir(), f"jaxaccum-test-xla-cache-{os.getuid()}"),
)
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(autouse=True)
def _doctest_namespace(doctest_namespace):
  import jax.numpy as jnp  # noqa: PLC0415

  import jaxaccum  # noqa: PLC0415

  doctest_namespace.update(jax=jax, jnp=jnp, jaxaccum=jaxaccum)


try:  # chex's registry of chexify waits (see _inspect_chexify_checks)
  from chex._src.asserts_internal import CHEXIFY_STORAGE as _CHEXIFY_STORAGE
except ImportError:  # a chex that moved it: its warning at exit will say so
  _CHEXIFY_STORAGE = None


@pytest.fixture(autouse=True)
def _inspect_chexify_checks():
  """Waits for the value checks of every ``chex.chexify`` made so far, then
  drops them from chex's registry.

  ``chex.chexify`` appends a wait function to a module-level list for every
  function it wraps, even with ``async_check=False`` where there is nothing
  to wait for, and nothing ever removes it; at exit chex logs "[Chex] Some of
  chexify assertion statuses were not inspected due to async exec" whenever
  that list is not empty (chex/_src/asserts_chexify.py: ``chexify`` and
  ``_check_if_hanging_assertions``). Waiting here makes a failed asynchronous
  check an error of the test that made it, and the emptied list keeps the
  end of the run quiet.
  """
  yield
  if _CHEXIFY_STORAGE is None:
    return
  waits = list(_CHEXIFY_STORAGE.wait_fns)
  _CHEXIFY_STORAGE.wait_fns.clear()
  for wait in waits:
    wait()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
  """In a pytest-xdist worker, collects the garbage while the tests' time
  still runs, and freezes what survives.

  Once every worker has reported its session finished, the controller shuts
  the workers down, and execnet gives a worker's code 5 seconds to return
  before it sends the worker a SIGINT (execnet/gateway_base.py,
  ``WorkerGateway._terminate_execution``). What a worker still runs then is
  pytest's unconfigure, which collects garbage twice over the whole heap
  (_pytest/unraisableexception.py): with JAX's caches after a few hundred
  tests, on a busy machine, that can take longer. The SIGINT then raised
  KeyboardInterrupt in the first Python code to run, hypothesis's
  ``gc_callback`` (hypothesis/internal/conjecture/junkdrawer.py, first in
  ``gc.callbacks``), where it is unraisable, and pytest printed it as a
  PytestUnraisableExceptionWarning after the summary. Here, before xdist
  reports the session finished (its hook wraps this one), one collection
  finds the garbage (an unraisable exception from a finalizer is still
  reported), and ``gc.freeze()`` moves the survivors out of reach of the
  collections after it, which then take milliseconds.
  """
  del session
  if os.environ.get("PYTEST_XDIST_WORKER"):
    gc.collect()
    gc.freeze()


# Compile-only accelerator targets need the `targets` extra (the CUDA
# compiler plugin, libtpu), which the test extra leaves out (about 1 GB).
# Tests and doctests that compile for one are marked `targets` and, without
# the extra, skipped with a one-line reason; CI installs it and runs them.
_TARGET_MODULES = ("jax_plugins.xla_cuda13", "libtpu")


def _targets_installed() -> bool:
  import importlib.util  # noqa: PLC0415

  try:  # find_spec of "a.b" imports "a", which raises when "a" is absent
    return all(importlib.util.find_spec(m) is not None for m in _TARGET_MODULES)
  except ModuleNotFoundError:
    return False


def pytest_collection_modifyitems(config, items):
  missing = (
    None
    if _targets_installed()
    else pytest.mark.skip(
      reason="compile-only targets not installed: pip install -e '.[targets]'"
    )
  )
  for item in items:
    dtest = getattr(item, "dtest", None)  # a doctest
    needs = (
      any("compile_target(" in e.source for e in dtest.examples) if dtest else False
    )
    if needs or item.get_closest_marker("targets"):
      item.add_marker(pytest.mark.targets)
      if missing is not None:
        item.add_marker(missing)
