"""Compiles one fwd+bwd step of the head on this GPU and reports what XLA made of it: the optimized HLO's GEMM
custom calls (and whether each accumulates into an operand: cuBLAS ``beta`` = 1), Mosaic calls, while loops and
conditionals (each a device→host read of its predicate), copies of large buffers, and the temp memory.

  python benchmarks/probe_hlo.py --shape llama3-8b-32k --out DIR [--mode lean]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import shapes as shapes_lib  # noqa: E402
from lce_flax import linear_cross_entropy  # noqa: E402


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--shape", default="llama3-8b-32k")
  ap.add_argument("--out", required=True)
  ap.add_argument("--mode", default=None, help="fast or lean (default: the op's own choice)")
  a = ap.parse_args()
  shape = next(s for p in shapes_lib.PRESETS.values() for s in p.shapes if s.name == a.shape)
  b, h, v = shape.B, shape.H, shape.V
  sds = jax.ShapeDtypeStruct
  args = (sds((b, h), jnp.bfloat16), sds((h, v), jnp.bfloat16), sds((b,), jnp.int32))
  f = lambda x, w, y: linear_cross_entropy(x, w, y, reduction="sum", mode=a.mode)
  compiled = jax.jit(jax.grad(f, (0, 1))).lower(*args).compile()
  text = compiled.as_text()
  os.makedirs(a.out, exist_ok=True)
  name = a.shape + (f"-{a.mode}" if a.mode else "")
  with open(os.path.join(a.out, f"{name}.hlo.txt"), "w") as fh:
    fh.write(text)
  gemms = [ln.strip()[:400] for ln in text.splitlines() if "custom_call_target=\"__cublas" in ln]
  big = 256 * 2**20

  def nbytes(ln):
    m = re.search(r"= (\w+)\[([\d,]+)\]", ln)
    if not m:
      return 0
    n = 1
    for d in m.group(2).split(","):
      n *= int(d)
    return n * {"bf16": 2, "f32": 4, "s32": 4, "f16": 2}.get(m.group(1), 4)

  report = dict(
      device=jax.devices()[0].device_kind, jax=jax.__version__, shape=a.shape, mode=a.mode,
      temp_bytes=compiled.memory_analysis().temp_size_in_bytes,
      gemms=gemms, gemm_beta=[re.search(r'"beta":([\d.]+)', g).group(1) if '"beta"' in g else None for g in gemms],
      mosaic_calls=sum("mosaic_gpu" in ln and "custom-call" in ln for ln in text.splitlines()),
      whiles=sum(" while(" in ln for ln in text.splitlines()),
      conditionals=sum(" conditional(" in ln for ln in text.splitlines()),
      big_copies=[ln.strip()[:200] for ln in text.splitlines() if " copy(" in ln and nbytes(ln) >= big])
  print(json.dumps(report, indent=1))
  with open(os.path.join(a.out, f"{name}.json"), "w") as fh:
    json.dump(report, fh, indent=1)


if __name__ == "__main__":
  main()
