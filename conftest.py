"""Strict JAX settings for the whole suite, and 8 fake CPU devices.

``XLA_FLAGS`` must be set before jax is imported, so this module sets it at
import time; pytest imports conftest.py before any test module.
"""

import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest

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
