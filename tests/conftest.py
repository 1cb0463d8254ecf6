"""Test-wide setup: 8 simulated CPU devices (for the mesh tests), set before JAX initialises its backends."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
