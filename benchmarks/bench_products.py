"""The backward's products on the GEMM under changed tilings, against XLA's and the tuning table's (one GPU run).

At each shape it times, in alternation (median of ``--rounds`` rounds of 10 runs), the product as the op runs it:

  dx   dz·wᵀ [B,V]·[V,H], w handed in as [H, V]; ours with each row scaled in the epilogue and stored in bf16
       (``Store(row_scale=σ)``, the stored-exponentials backward); XLA: the float32 product, scaled, rounded
  dw   xᵀ·dz [H,B]·[B,V], bf16 out
  dw_acc  the "tokens" design's dw: ``--chunks`` chunks' xᵀ·dz added into one float32 [H, V] buffer carried
       through a loop (the same chunk each time; the buffer starts as zeros inside the jitted loop); ours
       ``AddTo`` (TMA reduce-adds in place), XLA: ``c + xᵀ·dz`` (cuBLAS accumulating into c, its beta = 1)

by XLA, by our GEMM with the tuning table's config for the role, and by our GEMM with that config changed as
``--configs "tile_m=64,tile_n=192;stages=3,tile_n=192"`` says (each ``;``-separated item one variant). The number
of output tiles against the SMs decides how full the last wave is (gemma2-2b's dx: 8192×2304 in 256×128 tiles is
576 tiles, 4.4 waves of 132), which the tile shape changes. Each result is checked against XLA's (relative
Frobenius error ≤ 1e-2, bf16 outputs). One JSON line per measurement; ``--out`` gets ``results.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_epilogue import EPI_SHAPES  # noqa: E402
from benchmarks.bench_gemm import config_changes, interleaved  # noqa: E402
from lce_flax._impl.common import cdiv  # noqa: E402
from lce_flax._impl.pallas_mosaic import gemm as G  # noqa: E402
from lce_flax._impl.pallas_mosaic import tuning  # noqa: E402

F32 = jnp.float32


def contenders(product: str, b: int, h: int, v: int, kind: str, spec: str, chunks: int = 8) -> tuple[dict, dict]:
  """(name -> jitted f(a, bm, s), name -> config) for XLA, the table's config and each change of ``spec``."""
  dg = jax.lax.dot_general
  if product == "dx":  # a = E [B, V], bm = w [H, V], s = σ [B]
    role, mnk = "dx", (b, h, v)
    xla = jax.jit(lambda a, bm, s: (dg(a, bm, (((1,), (1,)), ((), ())), preferred_element_type=F32)
                                    * s[:, None]).astype(a.dtype))
    ours = lambda cfg: jax.jit(lambda a, bm, s: G.gemm(a, bm, transpose_b=True, epilogue=G.Store(row_scale=s),
                                                       config=cfg))
  elif product == "dw":  # a = x [B, H], bm = dz [B, V]
    role, mnk = "dw", (h, v, b)
    xla = jax.jit(lambda a, bm, s: dg(a, bm, (((0,), (0,)), ((), ()))))
    ours = lambda cfg: jax.jit(lambda a, bm, s: G.gemm(a, bm, transpose_a=True, config=cfg))
  else:  # dw_acc: as dw, over `chunks` iterations into a float32 buffer
    role, mnk = "dw_acc", (h, v, b)

    def loop(step):
      return lambda a, bm, s: jax.lax.fori_loop(0, chunks, lambda i, c: step(a, bm, c), jnp.zeros((h, v), F32))

    xla = jax.jit(loop(lambda a, bm, c: c + dg(a, bm, (((0,), (0,)), ((), ())), preferred_element_type=F32)))
    ours = lambda cfg: jax.jit(loop(lambda a, bm, c: G.gemm(a, bm, transpose_a=True, epilogue=G.AddTo(c),
                                                            config=cfg)))
  base = tuning.select_config(role, *mnk, kind)
  cfgs = {"table": base}
  for item in filter(None, spec.split(";")):
    cfgs[f"table[{item}]"] = dataclasses.replace(base, **config_changes(item))
  fns = {"xla": xla}
  fns.update({name: ours(cfg) for name, cfg in cfgs.items()})
  return fns, cfgs


def tiles(cfg: G.GemmConfig, m: int, n: int) -> int:
  cm, cn = cfg.cta_tile()
  return cdiv(m, cm) * cdiv(n, cn)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--shapes", default="gemma2-2b")
  ap.add_argument("--products", default="dx")
  ap.add_argument("--configs", default="")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--chunks", type=int, default=8, help="dw_acc: chunks added into the buffer per call")
  ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/products-local"))
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  dev = jax.devices()[0]
  kind = dev.device_kind
  sms = getattr(dev, "core_count", 132) or 132
  rows = []
  for shape in args.shapes.split(","):
    b, h, v = EPI_SHAPES[shape]
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x = (jax.random.normal(k1, (b, h), F32)).astype(jnp.bfloat16)
    w = (jax.random.normal(k2, (h, v), F32) * 0.02).astype(jnp.bfloat16)
    e = jax.random.uniform(k3, (b, v), F32).astype(jnp.bfloat16)
    sigma = jnp.exp(jax.random.uniform(k1, (b,), F32, -3, 3))
    for product in args.products.split(","):
      fns, cfgs = contenders(product, b, h, v, kind, args.configs, args.chunks)
      ops = (e, w, sigma) if product == "dx" else (x, e, sigma)
      m, n = (b, h) if product == "dx" else (h, v)
      ref = np.asarray(fns["xla"](*ops), np.float32)
      ok = {}
      for name in cfgs:
        try:
          got = np.asarray(fns[name](*ops), np.float32)
          ok[name] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
        except Exception as err:  # noqa: BLE001  (a config that does not lower is reported, not timed)
          ok[name] = f"{type(err).__name__}: {str(err)[:200]}"
      timed = {k: (f, ops) for k, f in fns.items() if k == "xla" or isinstance(ok.get(k), float)}
      ms = interleaved(timed, rounds=args.rounds)
      flops = 2 * b * h * v * (args.chunks if product == "dw_acc" else 1)
      for name in fns:
        cfg = cfgs.get(name)
        row = dict(shape=shape, product=product, variant=name, ms=ms.get(name),
                   tflops=(flops / ms[name] / 1e9) if name in ms else None,
                   vs_xla=(ms["xla"] / ms[name]) if name in ms else None,
                   config=None if cfg is None else cfg.short(),
                   cta_tiles=None if cfg is None else tiles(cfg, m, n),
                   waves=None if cfg is None else tiles(cfg, m, n) / sms,
                   rel_err_vs_xla=ok.get(name))
        rows.append(row)
        print(json.dumps(row), flush=True)
  meta = dict(device=kind, jax=jax.__version__, date=datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"),
              command=" ".join(sys.argv), commit=os.environ.get("LCE_FLAX_COMMIT"))
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(dict(meta, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
