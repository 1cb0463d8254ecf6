"""Whether the dx product loses time to its last, partly filled wave of output tiles (one GPU).

dx = dz·wᵀ has a small output (B×H) and a long contraction (V): at llama3-8b, 8192×4096 out over K = 128256, whose
CTA tiles of 128×256 are 1024 for the H100's 132 SMs, 7.76 waves, so the last wave leaves a quarter of the SMs idle.
A GEMM that splits K (or streams it) fills that wave; one that does not pays for it. This times dx at a few row
counts around ``--rows`` (each a whole number of 128-row tiles, so the number of waves moves while the work per
tile stays), on the package's GEMM (the tuning table's config for that shape) and on XLA's, in alternation, and
reports ms, TFLOP/s and the waves (CTA tiles ÷ SMs): where ours loses its rate at a fractional wave count and
XLA's does not, the last wave is what it loses.

    python3 -m benchmarks.probe_waves [--hidden 4096 --vocab 128256 --rows 7936,8192,8448] [--out DIR]
    python3 -m benchmarks.probe_waves --configs "wg_split=m,order_width=8"   # also ours with the table's config changed
    python3 -m benchmarks.probe_waves --interpret --hidden 64 --vocab 960 --rows 128,256 --rounds 1   # a CPU check

Writes ``DIR/results.json`` (device, versions, date, ``LCE_FLAX_COMMIT``, rows).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_gemm import config_changes, interleaved, save_probe  # noqa: E402
from lce_flax import _device  # noqa: E402
from lce_flax._impl.pallas_mosaic import gemm as G  # noqa: E402
from lce_flax._impl.pallas_mosaic import tuning  # noqa: E402


def dx_calls(rows: int, hidden: int, vocab: int, interpret: bool):
  """(ours, xla, args, config) of dx = dz·wᵀ with dz [rows, V] and w [H, V] (the op's layout)."""
  kz, kw = jax.random.split(jax.random.key(rows))
  dz = jax.random.normal(kz, (rows, vocab), jnp.bfloat16)
  w = (0.02 * jax.random.normal(kw, (hidden, vocab))).astype(jnp.bfloat16)
  cfg = tuning.select_config("dx", rows, hidden, vocab, G._device_kind())
  xla = jax.jit(lambda dz, w: jax.lax.dot_general(dz, w, (((1,), (1,)), ((), ()))))
  return ours_dx(cfg, interpret), xla, (dz, w), cfg


def ours_dx(cfg: G.GemmConfig, interpret: bool):
  """The package's GEMM forming dx = dz·wᵀ (w [H, V]) with the tiling ``cfg``, jitted."""
  return jax.jit(lambda dz, w: G.gemm(dz, w, transpose_b=True, config=cfg, interpret=interpret))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--hidden", type=int, default=4096)
  ap.add_argument("--vocab", type=int, default=128256)
  ap.add_argument("--rows", default="7936,8192,8448")
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--configs", default="", help="';'-separated field=value,... changes to the table's dx config, "
                  "each timed as ours[change]")
  ap.add_argument("--interpret", action="store_true", help="the kernels interpreted (a CPU check)")
  ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/probe_waves"))
  a = ap.parse_args(argv)
  sms = _device.num_sms()
  rows_out = []
  for m in (int(r) for r in a.rows.split(",")):
    ours, xla, args, cfg = dx_calls(m, a.hidden, a.vocab, a.interpret)
    calls = {"ours": (ours, args), "xla": (xla, args)}
    for item in filter(None, a.configs.split(";")):
      calls[f"ours[{item}]"] = (ours_dx(dataclasses.replace(cfg, **config_changes(item)), a.interpret), args)
    t = interleaved(calls, rounds=a.rounds)
    cm, cn = cfg.cluster_tile()
    tiles = math.ceil(m / cm) * math.ceil(a.hidden / cn) * cfg.cluster_size()
    flops = 2.0 * m * a.hidden * a.vocab
    row = {"rows": m, "hidden": a.hidden, "vocab": a.vocab, "config": cfg.short(), "cta_tiles": tiles, "sms": sms,
           "waves": round(tiles / sms, 3), **{f"{k}_ms": round(v, 3) for k, v in t.items()},
           **{f"{k}_tflops": round(flops / v / 1e9, 1) for k, v in t.items()}}
    print(row, flush=True)
    rows_out.append(row)
    save_probe(a.out, rows_out, a.rounds)
    del args
  return 0


if __name__ == "__main__":
  sys.exit(main())
