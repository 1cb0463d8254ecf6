"""What the forward GEMM's loss epilogue costs, piece by piece (one GPU run).

At each shape it times, in alternation (median of ``--rounds`` rounds of 10 runs), the forward product ``x·w`` of
``lce_flax/_impl/pallas_mosaic/gemm.py`` with the tuning table's config under these epilogues:

  bare        the bf16 product stored (``Store()``)
  max         a row max per tile, written out as the statistics are (the statistics' SMEM and TMA traffic alone)
  max_exp     + Σ exp(z - max) (no masking of the columns past V)
  masked      + the mask of the columns past V
  stats       + the target logit (``RowStats``: what the lean forward runs)
  stats_fast  ``stats`` with the approximate ``exp`` (``approx_math``)
  store       ``RowStats(store=True)``: the fast forward (statistics + the shifted bf16 tiles)
  store_fast  ``store`` with the approximate ``exp``

and XLA's bare product. Each epilogue is a subclass of ``RowStats`` whose ``stats_of`` leaves parts out, so the
rest of the epilogue (labels copied in, statistics copied out) is the one the op runs. One JSON line per
measurement; ``--out`` gets ``results.json`` with device, versions and date.
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
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_gemm import SHAPES, interleaved  # noqa: E402
from lce_flax._impl.pallas_mosaic import gemm as G  # noqa: E402
from lce_flax._impl.pallas_mosaic import tuning  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Partial(G.RowStats):
  """``RowStats`` computing only the statistics up to ``level`` (the others are zeros of the same layout)."""

  level: str = "max"

  def stats_of(self, zc, cols, valid, labels):
    if self.level == "max":
      m = zc.max(axis=1)
      return m, m, m, m
    if self.level == "max_exp":
      m = zc.max(axis=1)
      s = jnp.exp(zc - lax.broadcast_in_dim(m, zc.shape, [0])).sum(axis=1)
      return m, s, m, m
    if self.level == "masked":
      masked = jnp.where(valid, zc, -jnp.inf)
      m = masked.max(axis=1)
      m_safe = jnp.where(m == -jnp.inf, 0.0, m)
      s = jnp.exp(masked - lax.broadcast_in_dim(m_safe, zc.shape, [0])).sum(axis=1)
      return m, s, m, m
    raise ValueError(self.level)


def variants(x, w, y):
  opts = G.StatsOptions()
  return {
      "xla": jax.jit(jnp.dot),
      "bare": jax.jit(lambda x, w, y: G.gemm(x, w, role="fwd")),
      "max": jax.jit(lambda x, w, y: G.gemm(x, w, epilogue=Partial(y, opts, level="max"), role="fwd_stats")),
      "max_exp": jax.jit(lambda x, w, y: G.gemm(x, w, epilogue=Partial(y, opts, level="max_exp"), role="fwd_stats")),
      "masked": jax.jit(lambda x, w, y: G.gemm(x, w, epilogue=Partial(y, opts, level="masked"), role="fwd_stats")),
      "stats": jax.jit(lambda x, w, y: G.gemm(x, w, epilogue=G.RowStats(y, opts), role="fwd_stats")),
      "stats_fast": jax.jit(lambda x, w, y: G.gemm(x, w, epilogue=G.RowStats(y, opts), role="fwd_stats",
                                                   approx_math=True)),
      "store": jax.jit(lambda x, w, y: G.gemm(x, w, epilogue=G.RowStats(y, opts, store=True), role="fwd_store")),
      "store_fast": jax.jit(lambda x, w, y: G.gemm(x, w, epilogue=G.RowStats(y, opts, store=True), role="fwd_store",
                                                   approx_math=True)),
  }


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/epilogue-local"))
  ap.add_argument("--shapes", default="llama3-8b,gemma2-2b,gpt2-small,qwen3-8b")
  ap.add_argument("--rounds", type=int, default=3)
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  kind = jax.devices()[0].device_kind
  meta = dict(device=kind, jax=jax.__version__, date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              commit=os.environ.get("LCE_FLAX_COMMIT"))
  rows = []
  for name in args.shapes.split(","):
    b, h, v = SHAPES[name]
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (b, h), jnp.bfloat16)
    w = (0.02 * jax.random.normal(k[1], (h, v), jnp.float32)).astype(jnp.bfloat16)
    y = jax.random.randint(k[2], (b,), 0, v, jnp.int32)
    fns = {}
    for vname, f in variants(x, w, y).items():
      a = (x, w) if vname == "xla" else (x, w, y)
      try:
        jax.block_until_ready(f(*a))
        fns[vname] = (f, a)
      except Exception as e:  # noqa: BLE001
        rows.append(dict(shape=name, variant=vname, error=f"{type(e).__name__}: {e}"[:400]))
        print(json.dumps(rows[-1]), flush=True)
    t = interleaved(fns, rounds=args.rounds)
    cfg = tuning.select_row("fwd", b, v, h, kind)
    for vname, ms in t.items():
      rows.append(dict(shape=name, variant=vname, ms=round(ms, 3), tflops=round(2 * b * h * v / ms / 1e9, 1),
                       vs_bare=round(ms / t["bare"], 3) if "bare" in t else None, fwd_config=cfg[0].short()))
      print(json.dumps(rows[-1]), flush=True)
    del x, w, y, fns
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(dict(meta, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
