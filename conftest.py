"""Strict JAX settings for the whole suite, and 8 fake CPU devices.

``XLA_FLAGS`` must be set before jax is imported, so this module sets it at
import time; pytest imports conftest.py before any test module.
"""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(autouse=True)
def _doctest_namespace(doctest_namespace):
  import jax.numpy as jnp  # noqa: PLC0415

  import jaxaccum  # noqa: PLC0415

  doctest_namespace.update(jax=jax, jnp=jnp, jaxaccum=jaxaccum)
