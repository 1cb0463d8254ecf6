"""What the default device is, read once: platform and (on NVIDIA GPUs) compute capability."""

from __future__ import annotations

import functools

import jax

# The compute capabilities the kernels are written for, named once: the registry of lce_flax._impl.base says which
# backend needs which, and a plan that tunes for Hopper asks :func:`at_least`.
AMPERE = (8, 0)  # SM80: the Triton-tiled kernels (pallas_triton, triton)
HOPPER = (9, 0)  # SM90: WGMMA and TMA (pallas_mosaic); 228 KB of shared memory per SM


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


def at_least(cc: tuple[int, int]) -> bool:
  """Whether the default device is an NVIDIA GPU of compute capability ``cc`` or newer."""
  have = compute_capability()
  return have is not None and have >= cc


def default_interpret() -> bool:
  """Kernels run in Pallas interpret mode when there is no GPU to compile them for."""
  return platform() != "gpu"


@functools.cache
def num_sms() -> int:
  """Streaming multiprocessors of the first device (its ``core_count``); 132 (an H100 SXM) when it is unknown."""
  try:
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)
  except Exception:  # noqa: BLE001  (no backend details: assume an H100)
    return 132
