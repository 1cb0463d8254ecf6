"""Test-wide setup: 8 simulated CPU devices (for the mesh tests), set before JAX initialises its backends; and the
one place GPU tests are skipped. ``@pytest.mark.gpu`` runs a test only where the default backend is a GPU;
``gpu(min_cc=(9, 0))`` also needs that compute capability, ``gpu(needs="jax_triton")`` that module;
a parametrized case may add its own ``gpu(...)`` mark to the test's (all of them apply);
``gpu(long=True)`` marks a test at an LLM shape (a minute or more): collected first, so that pytest-xdist's workers
start the longest tests first and the run ends without a long tail (``benchmarks/gpu_check.sh``)."""

import importlib.util
import os


def gpu_of_worker(environ) -> str | None:
  """The one GPU a pytest-xdist worker takes where ``LCE_FLAX_TEST_GPUS`` = N spreads the workers over a host's N
  GPUs (``benchmarks/gpu_check.sh`` on a multi-GPU host): worker ``gwK`` gets the ``K mod N``-th of the GPUs this
  process may use (those of ``CUDA_VISIBLE_DEVICES`` where it is set), so each runs as on a one-GPU host; None
  (every GPU visible) without it or outside a worker."""
  gpus, worker = environ.get("LCE_FLAX_TEST_GPUS"), environ.get("PYTEST_XDIST_WORKER", "")
  if not gpus or not worker.startswith("gw"):
    return None
  visible = environ.get("CUDA_VISIBLE_DEVICES")
  ids = visible.split(",") if visible else [str(i) for i in range(int(gpus))]
  return ids[int(worker[2:]) % min(len(ids), int(gpus))]


os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if (_gpu := gpu_of_worker(os.environ)) is not None:  # (before JAX initialises its backends)
  os.environ["CUDA_VISIBLE_DEVICES"] = _gpu

import jax  # noqa: E402  (after XLA_FLAGS)
import pytest  # noqa: E402

from lce_flax import _device  # noqa: E402


def _why_not(markers) -> str | None:
  if jax.default_backend() != "gpu":
    return f"needs a GPU (the default backend is {jax.default_backend()!r})"
  cc = _device.compute_capability()
  for marker in markers:
    min_cc = marker.kwargs.get("min_cc")
    if min_cc is not None and (cc is None or cc < tuple(min_cc)):
      return f"needs compute capability >= {min_cc}, this GPU has {cc}"
    needs = marker.kwargs.get("needs")
    if needs is not None and importlib.util.find_spec(needs) is None:
      return f"needs the {needs} package"
  return None


def _long(item) -> bool:
  return any(m.kwargs.get("long") for m in item.iter_markers("gpu"))


def pytest_collection_modifyitems(config, items):
  del config
  for item in items:
    markers = list(item.iter_markers("gpu"))
    if markers and (why := _why_not(markers)) is not None:
      item.add_marker(pytest.mark.skip(reason=why))
  items.sort(key=lambda item: not _long(item))  # (stable: the rest keep their order)
