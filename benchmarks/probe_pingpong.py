"""Why the ping-pong schedule's K loop is slower than the cooperative one's at long K (one GPU run).

At each shape (``--shapes``, default llama3-8b and gpt2-small) it times, in alternation, the bare x·w and the op's
fast forward (statistics and stored exponentials on the approximate exp) with

  coop        the tuning table's cooperative row (at gpt2-small, whose row is ws-cln: the one it had before)
  ws-cln      ``pingpong_ws`` on 2-CTA clusters along N, 128×128×64 K steps, 6 slots (the gpt2-small row)
  ws-cln-k128 the same with 128-deep K steps and 3 slots: the same SMEM and the same time covered by the ring, half
              the K steps (so half the per-step barrier waits, arrivals and loop overhead)
  ws-cln-s4   4 slots of 64 (less time covered by the ring: if it is latency, this is slower)
  ws-cln-w8   the snake of width 8
  coop-s2     the cooperative row with 2 stages (its ring covering about what ws-cln's does)

plus XLA's bare x·w. One JSON line per measurement; ``--out`` gets ``results.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_gemm import SHAPES, interleaved  # noqa: E402
from lce_flax._impl.pallas_mosaic import gemm as G  # noqa: E402
from lce_flax._impl.pallas_mosaic import tuning  # noqa: E402


def _fit(role: str, cfg: G.GemmConfig) -> G.GemmConfig:
  return dataclasses.replace(cfg, epi_n=64) if role == "fwd" else tuning.fit_role(role, cfg)


def variants(m: int, n: int, k: int, kind: str) -> dict[str, tuple[str, G.GemmConfig]]:
  ws = dataclasses.replace(tuning.PINGPONG_WS, cluster="n")
  out = {}
  for role in ("fwd", "fwd_store"):
    coop = tuning.select_config(role, m, n, k, kind)
    if coop.schedule != "cooperative":  # (gpt2-small's rows: the cooperative config they had before)
      coop = _fit(role, G.GemmConfig(wg_split="m", cluster="n", order_width=8))
    fit = functools.partial(_fit, role)
    out.update({
        f"{role}/coop": (role, coop),
        f"{role}/coop-s2": (role, dataclasses.replace(coop, stages=2)),
        f"{role}/ws-cln": (role, fit(ws)),
        f"{role}/ws-cln-k128": (role, fit(dataclasses.replace(ws, tile_k=128, stages=3))),
        f"{role}/ws-cln-s4": (role, fit(dataclasses.replace(ws, stages=4))),
        f"{role}/ws-cln-w8": (role, fit(dataclasses.replace(ws, order_width=8))),
    })
  return out


def fn(role: str, cfg: G.GemmConfig):
  if role == "fwd":
    return jax.jit(lambda a, b, lab: G.gemm(a, b, config=cfg))
  stats = lambda lab: G.RowStats(lab, store=True, ref=jnp.zeros(lab.shape, jnp.float32))
  return jax.jit(lambda a, b, lab: G.gemm(a, b, epilogue=stats(lab), config=cfg, approx_math=True))


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--shapes", default="llama3-8b,gpt2-small")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/probe_pingpong"))
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  kind = jax.devices()[0].device_kind
  rows = [dict(kind="meta", device=kind, jax=jax.__version__,
               date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))]
  print(json.dumps(rows[0]), flush=True)
  for shape in args.shapes.split(","):
    b, h, v = SHAPES[shape]
    kk = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kk[0], (b, h), jnp.bfloat16)
    w = (0.02 * jax.random.normal(kk[1], (h, v), jnp.float32)).astype(jnp.bfloat16)
    y = jax.random.randint(kk[2], (b,), 0, v, jnp.int32)
    fns = {"xla": (jax.jit(lambda a, b_, lab: jnp.dot(a, b_)), (x, w, y))}
    cfgs = {}
    for name, (role, cfg) in variants(b, v, h, kind).items():
      try:  # a variant that does not build (SMEM) is a row with its error
        f = fn(role, cfg)
        jax.block_until_ready(f(x, w, y))
        fns[name], cfgs[name] = (f, (x, w, y)), cfg.short()
      except Exception as e:  # noqa: BLE001
        row = dict(kind="error", shape=shape, variant=name, cfg=cfg.short(), error=f"{type(e).__name__}: {e}"[:300])
        rows.append(row)
        print(json.dumps(row), flush=True)
    t = interleaved(fns, args.rounds)
    row = dict(kind="probe", shape=shape, ms={k: round(val, 3) for k, val in t.items()},
               tflops={k: round(2 * b * h * v / val / 1e9, 1) for k, val in t.items()}, cfg=cfgs)
    rows.append(row)
    print(json.dumps(row), flush=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
      json.dump(rows, f, indent=1)
    del x, w, y, fns


if __name__ == "__main__":
  main()
