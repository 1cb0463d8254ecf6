"""Why the ping-pong schedule's K loop is slower than the cooperative one's at long K (one GPU run).

At each shape (``--shapes``, default llama3-8b and gpt2-small) it times, in alternation, the bare x·w (``fwd``) and
the op's fast forward (``fwd_store``: statistics and stored exponentials on the approximate exp) with the tuning
table's cooperative row (at gpt2-small, whose rows are the clustered ping-pong, the cooperative one they had before)
and with the clustered ``pingpong_ws`` configs of ``--ws``: ``s<stages>[k<tile_k>][w<order width>][m]``, e.g.
``s6`` (the gpt2-small row: 6 slots of 128×128×64), ``s3k128`` (3 slots of 128-deep K steps: the same SMEM and
time covered by the ring, half the K steps and so half the per-step waits and arrivals), ``s4`` (less time
covered: slower if the loads' latency is what limits it), ``s6w8`` (the snake of width 8), ``s4m`` (the cluster
along M); plus XLA's bare x·w. One JSON line per measurement; ``--out`` gets ``results.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_gemm import SHAPES, interleaved  # noqa: E402
from lce_flax._impl.pallas_mosaic import gemm as G  # noqa: E402
from lce_flax._impl.pallas_mosaic import tuning  # noqa: E402

WS_SPECS = ("s6", "s4", "s3k128")


def _fit(role: str, cfg: G.GemmConfig) -> G.GemmConfig:
  return dataclasses.replace(cfg, epi_n=64) if role == "fwd" else tuning.fit_role(role, cfg)


def _ws(spec: str) -> G.GemmConfig:
  """A clustered ``pingpong_ws`` config from ``s<stages>[k<tile_k>][w<order width>][m]`` (``m``: cluster along M)."""
  m = re.fullmatch(r"s(\d+)(?:k(\d+))?(?:w(\d+))?(m?)", spec)
  if m is None:
    raise SystemExit(f"--ws: {spec!r} is not s<stages>[k<tile_k>][w<order width>][m]")
  return dataclasses.replace(tuning.PINGPONG_WS, cluster="m" if m[4] else "n", stages=int(m[1]),
                             tile_k=int(m[2] or 64), order_width=int(m[3] or 16))


def variants(m: int, n: int, k: int, kind: str, ws_specs=WS_SPECS, roles=("fwd", "fwd_store")):
  out = {}
  for role in roles:
    coop = tuning.select_config(role, m, n, k, kind)
    if coop.schedule != "cooperative":  # (gpt2-small's rows: the cooperative config they had before)
      coop = _fit(role, G.GemmConfig(wg_split="m", cluster="n", order_width=8))
    out[f"{role}/coop"] = (role, coop)
    out.update({f"{role}/ws-{spec}": (role, _fit(role, _ws(spec))) for spec in ws_specs})
  return out


def fn(role: str, cfg: G.GemmConfig):
  if role == "fwd":
    return jax.jit(lambda a, b, lab: G.gemm(a, b, config=cfg))
  stats = lambda lab: G.RowStats(lab, store=True, ref=jnp.zeros(lab.shape, jnp.float32))
  return jax.jit(lambda a, b, lab: G.gemm(a, b, epilogue=stats(lab), config=cfg, approx_math=True))


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--shapes", default="llama3-8b,gpt2-small")
  ap.add_argument("--ws", default=",".join(WS_SPECS), help="clustered pingpong_ws configs: comma list of "
                  "s<stages>[k<tile_k>][w<order width>][m] (m: cluster along M)")
  ap.add_argument("--roles", default="fwd,fwd_store")
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
    specs, roles = tuple(args.ws.split(",")), tuple(args.roles.split(","))
    for name, (role, cfg) in variants(b, v, h, kind, specs, roles).items():
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
