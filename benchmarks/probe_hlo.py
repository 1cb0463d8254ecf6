"""Compiles one fwd+bwd step of the head on this GPU and reports what XLA made of it: the optimized HLO's GEMM
custom calls (and whether each accumulates into an operand: cuBLAS ``beta`` = 1), the GEMMs its autotuner gave to
Triton (with their tiling and split-K), Mosaic calls, while loops and
conditionals (each a device→host read of its predicate), copies of large buffers, the temp memory and (with
``--buffers``) the buffers XLA's buffer assignment holds at the peak (from its dump, ``--xla_dump_to``).

  python benchmarks/probe_hlo.py --shape llama3-8b-32k --out DIR [--mode lean] [--buffers] [--products xla,gemm]

``--products DX,DW`` runs ``impl="pallas_mosaic"`` with ``PallasMosaicConfig(products=(DX, DW))`` (the backward
products' owners) instead of the op's own choice, and names the outputs after it.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import tempfile

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import shapes as shapes_lib  # noqa: E402
from lce_flax import PallasMosaicConfig, linear_cross_entropy  # noqa: E402


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--shape", default="llama3-8b-32k")
  ap.add_argument("--out", required=True)
  ap.add_argument("--mode", default=None, help="fast or lean (default: the op's own choice)")
  ap.add_argument("--buffers", action="store_true", help="also report the buffers live at the peak")
  ap.add_argument("--products", default=None, metavar="DX,DW", help="impl=pallas_mosaic with these products")
  a = ap.parse_args()
  dump = tempfile.mkdtemp() if a.buffers else None
  if dump:  # read when the backend starts (below, at the first compile)
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_as_text"
  shape = next(s for p in shapes_lib.PRESETS.values() for s in p.shapes if s.name == a.shape)
  b, h, v = shape.B, shape.H, shape.V
  sds = jax.ShapeDtypeStruct
  args = (sds((b, h), jnp.bfloat16), sds((h, v), jnp.bfloat16), sds((b,), jnp.int32))
  kw = {}
  if a.products:
    kw = dict(impl="pallas_mosaic", config=PallasMosaicConfig(products=tuple(a.products.split(","))))
  f = lambda x, w, y: linear_cross_entropy(x, w, y, reduction="sum", mode=a.mode, **kw)
  compiled = jax.jit(jax.grad(f, (0, 1))).lower(*args).compile()
  text = compiled.as_text()
  os.makedirs(a.out, exist_ok=True)
  name = a.shape + (f"-{a.mode}" if a.mode else "") + (f"-{a.products.replace(',', '-')}" if a.products else "")
  with open(os.path.join(a.out, f"{name}.hlo.txt"), "w") as fh:
    fh.write(text)
  gemms = [ln.strip()[:400] for ln in text.splitlines() if "custom_call_target=\"__cublas" in ln]
  # GEMMs XLA's autotuner gave to its Triton emitter instead of cuBLAS: the fusion's output and its tiling (a
  # split_k > 1 holds float32 partial sums of the output's size times split_k)
  triton = [_triton_gemm(ln) for ln in text.splitlines() if "__triton" in ln and "gemm" in ln and " fusion(" in ln]
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
      device=jax.devices()[0].device_kind, jax=jax.__version__, shape=a.shape, mode=a.mode, products=a.products,
      temp_bytes=compiled.memory_analysis().temp_size_in_bytes,
      gemms=gemms, triton_gemms=triton,
      gemm_beta=[re.search(r'"beta":([\d.]+)', g).group(1) if '"beta"' in g else None for g in gemms],
      mosaic_calls=sum("mosaic_gpu" in ln and "custom-call" in ln for ln in text.splitlines()),
      whiles=sum(" while(" in ln for ln in text.splitlines()),
      conditionals=sum(" conditional(" in ln for ln in text.splitlines()),
      big_copies=[ln.strip()[:200] for ln in text.splitlines() if " copy(" in ln and nbytes(ln) >= big])
  if dump:
    report["peak_buffers"] = _peak_buffers(dump)
  print(json.dumps(report, indent=1))
  with open(os.path.join(a.out, f"{name}.json"), "w") as fh:
    json.dump(report, fh, indent=1)


def _triton_gemm(line: str) -> str:
  """A Triton GEMM fusion's line cut to its result (name, shape) and its tiling config."""
  config = re.search(r'"(triton_gemm_config|block_level_fusion_config)":{[^}]*}', line)
  return f"{line.strip().split(' fusion(')[0][:160]} {config.group(0) if config else ''}"


def _peak_buffers(dump: str) -> list[str]:
  """The "peak buffers" section of the largest module's buffer assignment in an XLA dump (sizes and the HLO
  values that hold them), or the file names found if there is none."""
  files = sorted(glob.glob(os.path.join(dump, "*buffer-assignment.txt")), key=os.path.getsize)
  if not files:
    return sorted(os.listdir(dump))[:50]
  lines = open(files[-1]).read().splitlines()
  start = next((i for i, ln in enumerate(lines) if "peak buffers" in ln.lower()), None)
  return [os.path.basename(files[-1])] + (lines[start:start + 120] if start is not None else lines[-120:])


if __name__ == "__main__":
  main()
