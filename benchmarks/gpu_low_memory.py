"""``pallas_triton`` with ``Config(low_memory=True)`` at the four anchor shapes: fwd+bwd time and compiled temp.

Run on a GPU from the repository root: ``PYTHONPATH=. python3 benchmarks/gpu_low_memory.py``; writes
``$OUT/low_memory.json`` (device, versions, date). The ≤ 64 MB target of the Triton issue is about this variant.
"""

from __future__ import annotations

import datetime
import json
import os

import jax
import jax.numpy as jnp

from benchmarks.gpu_check_mosaic import SHAPES, bench, inputs, temp_bytes
from lce_flax import linear_cross_entropy
from lce_flax.pallas_triton import Config


def main():
  res = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "jax": jax.__version__,
         "device": str(jax.devices()[0].device_kind), "rows": []}
  for name, (b, h, v) in SHAPES.items():
    x, w, y, _ = inputs(b, h, v, "hv")
    y = jnp.maximum(y, 0)
    for label, cfg in (("low_memory", Config(low_memory=True)), ("default", None)):
      f = jax.jit(jax.value_and_grad(lambda x, w, cfg=cfg: linear_cross_entropy(
          x, w, y, impl="pallas_triton", mode="lean", reduction="sum", config=cfg), (0, 1)))
      _, ms = bench(f, x, w)
      row = dict(shape=name, variant=label, ms=ms, temp_bytes=temp_bytes(f, x, w))
      res["rows"].append(row)
      print(row, flush=True)
      with open(os.path.join(os.environ.get("OUT", "."), "low_memory.json"), "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
  main()
