"""lce_flax: a fused linear + cross-entropy head for JAX/Flax whose memory stays bounded.

``lce_flax.linear_cross_entropy`` is the op, ``lce_flax.LossOptions`` its options and ``lce_flax.explain`` says
what it will run. The submodules ``linen``, ``nnx`` (Flax heads), ``adapters`` (the loss from heads models already
have), ``sharding`` (meshes and the explicit sharded form) and ``train`` (a sharded train step) load on first
access. The implementations' configs are ``ChunkedConfig``, ``PallasTritonConfig``, ``TritonConfig`` and
``PallasMosaicConfig``.
"""

import importlib

from lce_flax._impl.chunked import Config as ChunkedConfig
from lce_flax._impl.pallas_mosaic import Config as PallasMosaicConfig
from lce_flax._impl.pallas_triton import Config as PallasTritonConfig
from lce_flax._impl.triton import Config as TritonConfig
from lce_flax.api import IMPLEMENTATIONS, Aux, available_implementations, explain, linear_cross_entropy
from lce_flax.options import LossOptions

__all__ = ["Aux", "ChunkedConfig", "IMPLEMENTATIONS", "LossOptions", "PallasMosaicConfig", "PallasTritonConfig",
           "TritonConfig", "adapters", "available_implementations", "explain", "linear_cross_entropy", "linen",
           "nnx", "sharding", "train"]
__version__ = "0.2.0"  # the one place the version is written (pyproject.toml reads it)

_LAZY_MODULES = ("adapters", "linen", "nnx", "sharding", "train")


def __getattr__(name):
  if name in _LAZY_MODULES:
    return importlib.import_module(f"lce_flax.{name}")
  raise AttributeError(f"module 'lce_flax' has no attribute {name!r}")
