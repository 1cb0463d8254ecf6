"""lce_flax: a fused linear + cross-entropy head for JAX/Flax that never holds the [tokens, vocab] logits.

``lce_flax.linear_cross_entropy`` is the op; the submodules ``linen``, ``nnx`` (Flax heads), ``sharding`` (the op
under ``shard_map``) and ``train`` (a sharded train step) load on first access.
"""

import importlib

from lce_flax.api import IMPLEMENTATIONS, Aux, available_implementations, linear_cross_entropy

__all__ = ["Aux", "IMPLEMENTATIONS", "available_implementations", "linear_cross_entropy", "linen", "nnx",
           "sharding", "train"]
__version__ = "0.1.0"

_LAZY = ("linen", "nnx", "sharding", "train")


def __getattr__(name):
  if name in _LAZY:
    return importlib.import_module(f"lce_flax.{name}")
  raise AttributeError(f"module 'lce_flax' has no attribute {name!r}")
