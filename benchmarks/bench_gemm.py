"""Per-kernel benchmark of the Hopper GEMM (``lce_flax/_impl/pallas_mosaic/gemm.py``) at the four LLM head shapes.

For each shape (B×H×V) and each of the head's three products

  fwd  x·w    [B,H]·[H,V]   ours: gemm(x, w)                      XLA: jnp.dot(x, w)
  dx   dz·wᵀ  [B,V]·[V,H]   ours: gemm(dz, w, transpose_b=True)   XLA: dot_general contracting V
  dw   xᵀ·dz  [H,B]·[B,V]   ours: gemm(x, dz, transpose_a=True)   XLA: dot_general contracting B

it times (median wall clock around ``block_until_ready``, after warm-up, bf16 in and out) our GEMM, XLA's GEMM,
and jax's example ``hopper_matmul_mgpu`` (best of a few configs; it needs its operands as [M,K]·[K,N] with N a
multiple of its CTA tile, so they are transposed/zero-padded beforehand, outside the timing; the padded columns'
time is counted, their FLOPs are not). Then the products with their loss work:

  fwd_stats        x·w with the row-statistics epilogue (the lean forward)
  fwd_stats_store  the same plus the bf16 logits stored
  dx_prologue      dz formed from stored logits + per-row lse/coef in the prologue, then dz·wᵀ
  dw_acc           xᵀ·dz + C in float32 (a token-chunked dw); XLA: dot in float32 + C

``--sweep`` also times a grid of configs per product and writes the fastest into the package's tuning table
(``lce_flax/_impl/pallas_mosaic/gemm_tuning.json``, under this device's kind) and into the output folder.
One JSON line per measurement on stdout; everything into ``--out`` (``results.json``).
Env: SHAPES (comma list), BUDGET_S (stop starting new work after this many seconds).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lce_flax._impl.pallas_mosaic import gemm as G  # noqa: E402
from lce_flax._impl.pallas_mosaic import tuning  # noqa: E402

SHAPES = {"gpt2-small": (16384, 768, 50304), "llama3-8b": (8192, 4096, 128256),
          "qwen3-8b": (4096, 4096, 151936), "gemma2-2b": (8192, 2304, 256000)}
T0 = time.time()
ROWS: list[dict] = []


def emit(**r):
  ROWS.append(r)
  print(json.dumps(r), flush=True)


def timeit(f, args, iters=10):
  jax.block_until_ready(f(*args))
  jax.block_until_ready(f(*args))
  ts = []
  for _ in range(iters):
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    ts.append(time.perf_counter() - t)
  return 1e3 * float(np.median(ts))


def budget_left(budget):
  return budget - (time.time() - T0)


def rel_err(got, ref):
  got, ref = jnp.asarray(got, jnp.float32), jnp.asarray(ref, jnp.float32)
  return float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))


def example_configs(quick):
  from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
  D = hm.MatmulDimension
  combos = [(D.N, None), (D.N, D.M), (D.M, D.N)] if quick else [
      (wg, cl) for wg in (D.N, D.M) for cl in (None, D.M, D.N)]
  for wg, cl in combos:
    yield hm.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4, epi_tile_n=64, epi_tile_m=64,
                          grid_minor_dim=D.N, grid_tile_width=16, wg_dimension=wg, cluster_dimension=cl)


def pad_to(a, axis, mult):
  p = (-a.shape[axis]) % mult
  if not p:
    return a
  widths = [(0, 0)] * a.ndim
  widths[axis] = (0, p)
  return jnp.pad(a, widths)


def bench_example(a_mk, b_kn, flops, quick):
  """jax's hopper_matmul_mgpu on [M,K]·[K,N] (padded to its tile multiples), best config."""
  from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
  D = hm.MatmulDimension
  best = None
  for cfg in example_configs(quick):
    mm = 128 * (1 + (cfg.wg_dimension == D.M)) * (1 + (cfg.cluster_dimension == D.M))
    mn = 128 * (1 + (cfg.wg_dimension == D.N)) * (1 + (cfg.cluster_dimension == D.N))
    ap, bp = pad_to(a_mk, 0, mm), pad_to(b_kn, 1, mn)
    try:
      f = jax.jit(lambda a, b, cfg=cfg: hm.matmul(a, b, None, cfg))
      ms = timeit(f, (ap, bp))
    except Exception as e:  # noqa: BLE001  (a config the example refuses: recorded, not fatal)
      emit(kind="example_error", cfg=str(cfg)[:100], error=f"{type(e).__name__}: {str(e)[:200]}")
      continue
    name = f"wg={cfg.wg_dimension} cl={cfg.cluster_dimension}"
    if best is None or ms < best[0]:
      best = (ms, name)
    del ap, bp
  return best


def sweep_configs(role):
  """The sweep's grid: the warpgroup split, the 2-CTA cluster (and its direction), the snake's direction."""
  stages = 3 if role == "dw_acc" else 4
  grid = [("n", None, "n"), ("n", "m", "n"), ("m", "n", "n"), ("n", "n", "n"), ("m", None, "n"), ("n", None, "m")]
  n = int(os.environ.get("SWEEP_N", len(grid)))
  return [G.GemmConfig(stages=stages, wg_split=wg, cluster=cl, order_minor=om) for wg, cl, om in grid[:n]]


def products(x, w, dz):
  """name -> (our call(config), xla call, A as [M,K], B as [K,N] for the example)."""
  ours = {
      "fwd": (lambda cfg: jax.jit(lambda x, w: G.gemm(x, w, config=cfg)), (x, w)),
      "dx": (lambda cfg: jax.jit(lambda dz, w: G.gemm(dz, w, transpose_b=True, config=cfg)), (dz, w)),
      "dw": (lambda cfg: jax.jit(lambda x, dz: G.gemm(x, dz, transpose_a=True, config=cfg)), (x, dz)),
  }
  dg = jax.lax.dot_general
  xla = {
      "fwd": (jax.jit(jnp.dot), (x, w)),
      "dx": (jax.jit(lambda dz, w: dg(dz, w, (((1,), (1,)), ((), ())))), (dz, w)),
      "dw": (jax.jit(lambda x, dz: dg(x, dz, (((0,), (0,)), ((), ())))), (x, dz)),
  }
  return ours, xla


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/gemm-local"))
  ap.add_argument("--sweep", action="store_true")
  ap.add_argument("--quick-example", action="store_true", help="3 configs of jax's example instead of 6")
  ap.add_argument("--no-example", action="store_true")
  ap.add_argument("--no-fused", action="store_true")
  args = ap.parse_args()
  budget = float(os.environ.get("BUDGET_S", "1e9"))
  shapes = os.environ.get("SHAPES", ",".join(SHAPES)).split(",")
  os.makedirs(args.out, exist_ok=True)
  dev = jax.devices()[0]
  kind = dev.device_kind
  import jaxlib
  meta = dict(kind="meta", device=kind, jax=jax.__version__, jaxlib=jaxlib.__version__,
              date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              sweep=args.sweep, timing="median of 10 wall-clock runs around block_until_ready, after 2 warm-ups")
  emit(**meta)
  table_rows: dict[str, list] = {}

  def save():
    with open(os.path.join(args.out, "results.json"), "w") as f:
      json.dump({"meta": meta, "rows": ROWS, "table": table_rows}, f, indent=1)

  for shape in shapes:
    b, h, v = SHAPES[shape]
    k = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(k[0], (b, h), jnp.bfloat16)
    w = (0.02 * jax.random.normal(k[1], (h, v), jnp.float32)).astype(jnp.bfloat16)
    dz = (1e-3 * jax.random.normal(k[2], (b, v), jnp.float32)).astype(jnp.bfloat16)
    flops = 2 * b * h * v
    ours, xla = products(x, w, dz)
    best_bare = {}
    for prod in ("fwd", "dx", "dw"):
      if budget_left(budget) < 30:
        emit(kind="stop", shape=shape, product=prod, why="past BUDGET_S")
        break
      mnk = {"fwd": (b, v, h), "dx": (b, h, v), "dw": (h, v, b)}[prod]
      role = prod
      f_xla, xargs = xla[prod]
      t_xla = timeit(f_xla, xargs)
      ref = f_xla(*xargs)
      emit(kind="xla", shape=shape, product=prod, ms=round(t_xla, 3), tflops=round(flops / t_xla / 1e9, 1))
      cfgs = sweep_configs(role) if args.sweep else [tuning.select_config(role, *mnk, kind)]
      results = []
      for cfg in cfgs:
        if budget_left(budget) < 20:
          break
        make, oargs = ours[prod]
        try:
          f = make(cfg)
          ms = timeit(f, oargs)
          err = rel_err(f(*oargs), ref) if not results else None
        except Exception as e:  # noqa: BLE001  (a config that does not build: recorded, the sweep goes on)
          emit(kind="ours_error", shape=shape, product=prod, cfg=cfg.short(), error=f"{type(e).__name__}: {e}"[:300])
          continue
        results.append((ms, cfg))
        row = dict(kind="ours", shape=shape, product=prod, cfg=cfg.short(), ms=round(ms, 3),
                   tflops=round(flops / ms / 1e9, 1), vs_xla=round(t_xla / ms, 3))
        if err is not None:
          row["rel_err_vs_xla"] = err
        emit(**row)
      if not results:
        continue
      ms, cfg = min(results, key=lambda r: r[0])
      best_bare[prod] = min(ms, t_xla)
      table_rows.setdefault(role, []).append(
          {"bucket": list(tuning.bucket(*mnk)), "shape": [*mnk], "config": dataclasses.asdict(cfg), "ms": round(ms, 3)})
      ex = None
      if not args.no_example and budget_left(budget) > 60:
        a_mk = {"fwd": x, "dx": dz, "dw": jnp.asarray(x.T)}[prod]
        b_kn = {"fwd": w, "dx": jnp.asarray(w.T), "dw": dz}[prod]
        ex = bench_example(a_mk, b_kn, flops, args.quick_example)
        del a_mk, b_kn
      summary = dict(kind="summary", shape=shape, product=prod, ours_ms=round(ms, 3), cfg=cfg.short(),
                     ours_tflops=round(flops / ms / 1e9, 1), xla_ms=round(t_xla, 3), ours_vs_xla=round(t_xla / ms, 3))
      if ex is not None:
        summary.update(example_ms=round(ex[0], 3), example_cfg=ex[1], ours_vs_example=round(ex[0] / ms, 3))
      emit(**summary)
      save()
      del ref

    if not args.no_fused and budget_left(budget) > 40:
      fused(shape, x, w, dz, flops, best_bare, kind, table_rows)
    save()
    del x, w, dz
  save()
  if args.sweep:
    with open(os.path.join(args.out, "gemm_tuning.json"), "w") as f:
      json.dump({"source": "benchmarks/bench_gemm.py --sweep", "date": meta["date"], "jax": meta["jax"],
                 "devices": {kind: table_rows}}, f, indent=1)


def fused(shape, x, w, dz, flops, best_bare, kind, table_rows):
  """The products with their loss work, against the best bare product of this run."""
  b, h = x.shape
  v = w.shape[1]
  k = jax.random.split(jax.random.key(1), 4)
  labels = jax.random.randint(k[0], (b,), 0, v, jnp.int32)
  opts = G.StatsOptions()

  def row(name, ms, base_ms, **kw):
    emit(kind="fused", shape=shape, variant=name, ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1),
         vs_best_bare=round(ms / base_ms, 3) if base_ms else None, **kw)

  cfg_f = tuning.select_config("fwd_stats", b, v, h, kind)
  f = jax.jit(lambda x, w, y: G.gemm(x, w, epilogue=G.RowStats(y, opts), config=cfg_f))
  try:
    ms = timeit(f, (x, w, labels))
    st = G.merge_row_stats(f(x, w, labels), b)
    z = jnp.dot(x[:512], w, preferred_element_type=jnp.float32)
    lse_ref = jax.nn.logsumexp(z, axis=1)
    lse = (st.m + jnp.log(st.s))[:512]
    row("fwd_stats", ms, best_bare.get("fwd"), cfg=cfg_f.short(), lse_max_abs_err=float(jnp.abs(lse - lse_ref).max()))
  except Exception as e:  # noqa: BLE001
    emit(kind="fused_error", shape=shape, variant="fwd_stats", error=f"{type(e).__name__}: {e}"[:300])
  cfg_s = tuning.select_config("fwd_store", b, v, h, kind)
  f = jax.jit(lambda x, w, y: G.gemm(x, w, epilogue=(G.RowStats(y, opts), G.Store()), config=cfg_s))
  try:
    row("fwd_stats_store", timeit(f, (x, w, labels)), best_bare.get("fwd"), cfg=cfg_s.short())
  except Exception as e:  # noqa: BLE001
    emit(kind="fused_error", shape=shape, variant="fwd_stats_store", error=f"{type(e).__name__}: {e}"[:300])
  cfg_p = tuning.select_config("dx_prologue", b, h, v, kind)
  lse = jnp.full((b,), 3.0, jnp.float32)
  coef = jnp.ones((b,), jnp.float32)
  f = jax.jit(lambda z, w, l, c, a, y: G.gemm(z, w, transpose_b=True, prologue=G.DzFromLogits(l, c, a, y),
                                              config=cfg_p))
  try:
    ms = timeit(f, (dz, w, lse, coef, coef, labels))
    got = f(dz, w, lse, coef, coef, labels)[:256]
    z32 = dz[:256].astype(jnp.float32)
    d = jnp.exp(z32 - 3.0) - (jnp.arange(v)[None, :] == labels[:256, None])
    ref = jnp.dot(d.astype(jnp.bfloat16), w.T, preferred_element_type=jnp.float32)
    row("dx_prologue", ms, best_bare.get("dx"), cfg=cfg_p.short(), rel_err=rel_err(got, ref))
  except Exception as e:  # noqa: BLE001
    emit(kind="fused_error", shape=shape, variant="dx_prologue", error=f"{type(e).__name__}: {e}"[:300])
  cfg_a = tuning.select_config("dw_acc", h, v, b, kind)
  c = jnp.zeros((h, v), jnp.float32) + 1.0
  f = jax.jit(lambda x, dz, c: G.gemm(x, dz, transpose_a=True, epilogue=G.AddTo(c), config=cfg_a))
  dg = jax.lax.dot_general
  fx = jax.jit(lambda x, dz, c: c + dg(x, dz, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32))
  try:
    t_x = timeit(fx, (x, dz, c))
    ms = timeit(f, (x, dz, c))
    err = rel_err(f(x, dz, c) - c, fx(x, dz, c) - c)
    row("dw_acc", ms, best_bare.get("dw"), cfg=cfg_a.short(), xla_f32_plus_c_ms=round(t_x, 3),
        vs_xla=round(t_x / ms, 3), rel_err=err)
  except Exception as e:  # noqa: BLE001
    emit(kind="fused_error", shape=shape, variant="dw_acc", error=f"{type(e).__name__}: {e}"[:300])
  del table_rows


if __name__ == "__main__":
  main()
