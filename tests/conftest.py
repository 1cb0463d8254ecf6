"""Test-wide setup: 8 simulated CPU devices (for the mesh tests), set before JAX initialises its backends; and the
one place GPU tests are skipped: a ``gpu``-marked test runs only where the default backend is a GPU."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402  (after XLA_FLAGS)
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
  del config
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason=f"needs a GPU (the default backend is {jax.default_backend()!r})")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
