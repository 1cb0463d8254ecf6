"""``pallas_triton`` with ``Config(low_memory=True)`` at the four anchor shapes: fwd+bwd time and compiled temp.

Run on a GPU from the repository root: ``PYTHONPATH=. python3 benchmarks/gpu_low_memory.py [--tune]``; writes
``$OUT/low_memory.json`` (device, versions, date). The ≤ 64 MB target of the Triton issue is about this variant.
``--tune``: other ways under 64 MB at the two shapes where the default low-memory plan trails Liger (gpt2-small:
the float32 dx fits, so the in-place dx kernel with a small dz chunk and no third pass; llama3-8b: larger dx-pass
blocks, and the raw Triton dz kernel).
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import jax
import jax.numpy as jnp

from benchmarks.gpu_check_mosaic import SHAPES, bench, inputs, temp_bytes
from lce_flax import linear_cross_entropy
from lce_flax import triton_kernels
from lce_flax.pallas_triton import Config

TUNE = [
    ("gpt2-small", "dx_kernel chunk 256", "pallas_triton", Config(dx_kernel=True, chunk_size=256)),
    ("gpt2-small", "dx_kernel chunk 512", "pallas_triton", Config(dx_kernel=True, chunk_size=512)),
    ("gpt2-small", "low_memory token_block 2048", "pallas_triton", Config(low_memory=True, token_block=2048)),
    ("llama3-8b", "low_memory token_block 2048 dx_chunk 4096", "pallas_triton",
     Config(low_memory=True, token_block=2048, dx_chunk=4096)),
    ("llama3-8b", "low_memory chunk 2048 token_block 2048 dx_chunk 2048", "pallas_triton",
     Config(low_memory=True, chunk_size=2048, token_block=2048, dx_chunk=2048)),
    ("llama3-8b", "triton low_memory", "triton", triton_kernels.Config(low_memory=True)),
    ("llama3-8b", "triton low_memory token_block 2048 dx_chunk 4096", "triton",
     triton_kernels.Config(low_memory=True, token_block=2048, dx_chunk=4096)),
]


def measure(res, key, cases):
  """Times fwd+bwd and reads the compiled temp of each ``(shape, label, impl, config)``; appends to ``res[key]``."""
  for name, label, impl, cfg in cases:
    b, h, v = SHAPES[name]
    x, w, y, _ = inputs(b, h, v, "hv")
    y = jnp.maximum(y, 0)
    f = jax.jit(jax.value_and_grad(lambda x, w, cfg=cfg, impl=impl: linear_cross_entropy(
        x, w, y, impl=impl, mode="lean", reduction="sum", config=cfg), (0, 1)))
    try:
      _, ms = bench(f, x, w)
      row = dict(shape=name, variant=label, impl=impl, ms=ms, temp_bytes=temp_bytes(f, x, w))
    except Exception as e:  # pylint: disable=broad-except
      row = dict(shape=name, variant=label, impl=impl, error=f"{type(e).__name__}: {str(e)[:300]}")
    res[key].append(row)
    print(row, flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "low_memory.json"), "w") as fh:
      json.dump(res, fh, indent=1)


def main():
  res = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "jax": jax.__version__,
         "device": str(jax.devices()[0].device_kind), "rows": [], "tune": []}
  if "--tune" in sys.argv:
    measure(res, "tune", TUNE)
  else:
    measure(res, "rows", [(name, label, "pallas_triton", cfg) for name in SHAPES
                          for label, cfg in (("low_memory", Config(low_memory=True)), ("default", None))])


if __name__ == "__main__":
  main()
