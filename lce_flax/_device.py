"""What the default device is, read once: platform and (on NVIDIA GPUs) compute capability."""

from __future__ import annotations

import functools

import jax


@functools.cache
def platform() -> str:
  """``"cpu"``, ``"gpu"`` or ``"tpu"`` of the default backend."""
  return jax.default_backend()


@functools.cache
def compute_capability() -> tuple[int, int] | None:
  """(major, minor) of the first GPU, or None when the default backend is not a CUDA GPU."""
  if platform() != "gpu":
    return None
  cc = getattr(jax.devices()[0], "compute_capability", None)
  if not cc:
    return None
  major, minor = str(cc).split(".")
  return int(major), int(minor)


def default_interpret() -> bool:
  """Kernels run in Pallas interpret mode when there is no GPU to compile them for."""
  return platform() != "gpu"
