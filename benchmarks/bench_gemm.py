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
  fwd_exp_approx   (``--final``) the op's fast forward: the statistics and the tiles stored as exponentials, on the
                   approximate exp
  dx_prologue      dz formed from stored logits + per-row lse/coef in the prologue, then dz·wᵀ
  dw_acc           xᵀ·dz + C in float32 (a token-chunked dw); XLA: dot in float32 + C

``--sweep`` also times a grid of configs per product (after the table's own row for this device and shape), then
the three fastest and the table's row again in alternation with XLA's GEMM (:func:`finalists`), and writes the
fastest of those, under this device's kind in the format of the package's tuning table
(``lce_flax/_impl/pallas_mosaic/gemm_tuning.json``), to ``gemm_tuning.json`` in the output folder:
``benchmarks/tuning_table.py`` merges it into the package's table.
One JSON line per measurement on stdout; everything into ``--out`` (``results.json``).
``--schedules`` times the GEMM's schedules (:attr:`GemmConfig.schedule`: ``cooperative``, the table's row, against
``pingpong`` and ``pingpong_ws``, the latter also on 2-CTA clusters) on the forward with and without its loss work
(``fwd_store``: the op's fast forward, statistics and stored exponentials on the approximate exp) and on the
token-chunked dw (``dw_acc``), beside XLA's bare GEMM (and float32 xᵀ·dz + C), in alternation; it starts with a
small correctness check of each ping-pong variant (in a child process), writes a copy of the tuning table with the
faster schedule per role and shape, and stops starting work once BUDGET_S (default 200 s) is spent. PINGPONG=1 adds
the ``pingpong`` schedule (each warpgroup its own ring; slower everywhere in earlier rounds).
Env: SHAPES (comma list of ``benchmarks/shapes.py``'s ``HEADS``: the four heads by default, also llama3-8b-32k and
gemma2-2b-32k, whose 32768-row products get tuning rows of their own), PRODUCTS (comma list of fwd, dx, dw: the
products timed, all three by default; a sweep of the backward rows alone is ``PRODUCTS=dx,dw``), BUDGET_S (stop
starting new work after this many seconds).
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

from benchmarks import shapes, tuning_table  # noqa: E402
from lce_flax._impl.pallas_mosaic import gemm as G  # noqa: E402
from lce_flax._impl.pallas_mosaic import tuning  # noqa: E402

SHAPES = shapes.HEADS
DEFAULT_SHAPES = ",".join(shapes.LLM)
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


@jax.jit
def _rel_err(got, ref):
  # one jitted reduction: the float32 casts fuse into it (a [B, V] float32 at 32768 tokens is 15.7 GiB)
  d, r = got.astype(jnp.float32) - ref.astype(jnp.float32), ref.astype(jnp.float32)
  return jnp.sqrt(jnp.sum(d * d)) / jnp.sqrt(jnp.sum(r * r))


def rel_err(got, ref) -> float:
  """‖got − ref‖ / ‖ref‖ in float32."""
  return float(_rel_err(got, ref))


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


def bench_example(a_mk, b_kn, quick):
  """jax's hopper_matmul_mgpu on [M,K]·[K,N] (padded to its tile multiples): (ms, config name, fn, args) of its
  best config."""
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
    emit(kind="example", cfg=name, ms=round(ms, 3))
    if best is None or ms < best[0]:
      best = (ms, name, f, (ap, bp))
  return best


def save_probe(out: str, rows: list[dict], rounds: int) -> None:
  """``out/results.json``: a probe's rows with the device, versions, date and commit (``LCE_FLAX_COMMIT``)."""
  os.makedirs(out, exist_ok=True)
  meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, date=datetime.date.today().isoformat(),
              commit=os.environ.get("LCE_FLAX_COMMIT"), rounds=rounds, rows=rows)
  with open(os.path.join(out, "results.json"), "w") as f:
    json.dump(meta, f, indent=1)


def interleaved(fns, rounds=3):
  """Median ms of each (fn, args) in ``fns``, timed in alternation (so clock drift favours none of them)."""
  ts = {name: [] for name in fns}
  for _ in range(rounds):
    for name, (f, a) in fns.items():
      ts[name].append(timeit(f, a))
  return {name: float(np.median(v)) for name, v in ts.items()}


def config_changes(item: str) -> dict:
  """``"field=value,..."`` (the ``--configs`` items of the benchmarks that time a table row changed) as keyword
  changes of a :class:`tuning.GemmConfig`, each value typed as its field is: ``wg_split=m,order_width=8`` gives
  ``{"wg_split": "m", "order_width": 8}``; ``None`` clears an optional field (``cluster=None``)."""
  fields = {f.name: f for f in dataclasses.fields(tuning.GemmConfig)}
  changes = {}
  for kv in filter(None, item.split(",")):
    key, sep, val = kv.partition("=")
    if not sep or key not in fields:
      raise ValueError(f"config change {kv!r}: expected field=value with a field of GemmConfig ({', '.join(fields)})")
    default = fields[key].default
    changes[key] = (None if val == "None" else bool(int(val)) if isinstance(default, bool)
                    else int(val) if isinstance(default, int) else val)
  return changes


def sweep_configs(role):
  """The sweep's grid: the warpgroup split, the 2-CTA cluster (and its direction), the snake's direction."""
  stages = 3 if role == "dw_acc" else 4
  grid = [("n", None, "n", 16), ("n", "m", "n", 16), ("m", "n", "n", 16), ("n", "n", "n", 16), ("m", "m", "n", 16),
          ("m", "n", "n", 8), ("n", "m", "n", 8), ("m", "n", "m", 16)]
  n = int(os.environ.get("SWEEP_N", len(grid)))
  return [G.GemmConfig(stages=stages, wg_split=wg, cluster=cl, order_minor=om, order_width=ow)
          for wg, cl, om, ow in grid[:n]]


def sweep_candidates(role, mnk, kind):
  """What ``--sweep`` times for one product: the config the table gives this device at this shape first (on a
  kind with no rows of its own, the same chip's), then the grid's others, so a row the sweep writes is never one
  it measured slower than the row it would replace."""
  table = tuning.select_config(role, *mnk, kind)
  return [table] + [c for c in sweep_configs(role) if c != table]


def finalists(results, table_cfg, n: int = 3):
  """The configs ``--sweep`` times again in alternation, from its one-after-another ``results`` ((ms, config) as
  timed): the ``n`` fastest, and the table's own row (``table_cfg``) if it is not among them. One 10-run
  median per config is not enough to rank them: at the power limit, the same config timed in the sweep and in
  alternation with XLA's GEMM differed by up to 8% on an H200 (``benchmarks/results/rows-h200-2026-11-28/``), more
  than most of the grid lies from its fastest; so the row the sweep writes is the fastest in alternation, and it
  never replaces the table's row with one that measured slower beside it."""
  out = [c for _, c in sorted(results, key=lambda r: r[0])[:n]]
  if any(c == table_cfg for _, c in results) and table_cfg not in out:
    out.append(table_cfg)
  return out


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
  ap.add_argument("--final", action="store_true", help="no sweep: the table's configs against XLA and the example, "
                  "every contender of a product (and its loss-work variants) timed in alternation")
  ap.add_argument("--schedules", action="store_true", help="the cooperative and ping-pong schedules of fwd, "
                  "fwd_stats, fwd_store (and XLA's bare GEMM) in alternation; ends itself within BUDGET_S (200 s)")
  ap.add_argument("--smoke-only", choices=tuple(PP_VARIANTS), help="(--schedules runs this in a child "
                  "process) the small correctness check of one ping-pong variant, as JSON lines")
  ap.add_argument("--rounds", type=int, default=5)
  args = ap.parse_args()
  budget = float(os.environ.get("BUDGET_S", "200" if args.schedules else "1e9"))
  shape_names = os.environ.get("SHAPES", DEFAULT_SHAPES).split(",")
  prods = os.environ.get("PRODUCTS", "fwd,dx,dw").split(",")
  if not set(prods) <= {"fwd", "dx", "dw"}:
    raise SystemExit(f"PRODUCTS={','.join(prods)}: expected a comma list of fwd, dx, dw")
  os.makedirs(args.out, exist_ok=True)
  dev = jax.devices()[0]
  kind = dev.device_kind
  import jaxlib
  meta = dict(kind="meta", device=kind, jax=jax.__version__, jaxlib=jaxlib.__version__,
              date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              sweep=args.sweep, mode="schedules" if args.schedules else ("final" if args.final else "sweep/plain"),
              timing=("median of 10 wall-clock runs around block_until_ready after 2 warm-ups; summary rows: "
                      "median of 3 such medians taken in alternation between the compared kernels"))
  emit(**meta)
  if args.smoke_only:
    _smoke(PP_VARIANTS[args.smoke_only], Watchdog(lambda: None), G.StatsOptions())
    return
  if args.schedules:
    schedules(args, kind, meta, budget)
    return
  table_rows: dict[str, list] = {}

  def save():
    with open(os.path.join(args.out, "results.json"), "w") as f:
      json.dump({"meta": meta, "rows": ROWS, "table": table_rows}, f, indent=1)

  for shape in shape_names:
    b, h, v = SHAPES[shape]
    k = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(k[0], (b, h), jnp.bfloat16)
    w = (0.02 * jax.random.normal(k[1], (h, v), jnp.float32)).astype(jnp.bfloat16)
    dz = (1e-3 * jax.random.normal(k[2], (b, v), jnp.float32)).astype(jnp.bfloat16)
    flops = 2 * b * h * v
    if args.final:
      labels = jax.random.randint(k[3], (b,), 0, v, jnp.int32)
      for prod in prods:
        if budget_left(budget) < 40:
          emit(kind="stop", shape=shape, product=prod, why="past BUDGET_S")
          break
        final_product(shape, prod, x, w, dz, labels, kind, args.rounds)
        save()
      del x, w, dz
      continue
    ours, xla = products(x, w, dz)
    best_bare, top = {}, {}
    for prod in prods:
      if budget_left(budget) < 30:
        emit(kind="stop", shape=shape, product=prod, why="past BUDGET_S")
        break
      mnk = {"fwd": (b, v, h), "dx": (b, h, v), "dw": (h, v, b)}[prod]
      role = prod
      f_xla, xargs = xla[prod]
      t_xla = timeit(f_xla, xargs)
      ref = f_xla(*xargs)
      emit(kind="xla", shape=shape, product=prod, ms=round(t_xla, 3), tflops=round(flops / t_xla / 1e9, 1))
      cfgs = sweep_candidates(role, mnk, kind) if args.sweep else [tuning.select_config(role, *mnk, kind)]
      results, built = [], {}  # (ms, config) as timed; config -> its jitted call (timed again below, not rebuilt)
      make, oargs = ours[prod]
      for cfg in cfgs:
        if budget_left(budget) < 20:
          break
        try:
          f = make(cfg)
          ms = timeit(f, oargs)
          err = rel_err(f(*oargs), ref) if not results else None
        except Exception as e:  # noqa: BLE001  (a config that does not build: recorded, the sweep goes on)
          emit(kind="ours_error", shape=shape, product=prod, cfg=cfg.short(), error=f"{type(e).__name__}: {e}"[:300])
          continue
        results.append((ms, cfg))
        built[cfg] = f
        row = dict(kind="ours", shape=shape, product=prod, cfg=cfg.short(), ms=round(ms, 3),
                   tflops=round(flops / ms / 1e9, 1), vs_xla=round(t_xla / ms, 3))
        if err is not None:
          row["rel_err_vs_xla"] = err
        emit(**row)
      if not results:
        continue
      final = finalists(results, cfgs[0]) if args.sweep else [results[0][1]]
      fns = {"xla": (f_xla, xargs)}
      fns.update({f"ours{i}": (built[c], oargs) for i, c in enumerate(final)})
      ex = None
      if not args.no_example and budget_left(budget) > 60:
        a_mk = {"fwd": x, "dx": dz, "dw": jnp.asarray(x.T)}[prod]
        b_kn = {"fwd": w, "dx": jnp.asarray(w.T), "dw": dz}[prod]
        ex = bench_example(a_mk, b_kn, args.quick_example)
        del a_mk, b_kn
        if ex is not None:
          fns["example"] = (ex[2], ex[3])
      t = interleaved(fns)
      ranked = sorted(range(len(final)), key=lambda i: t[f"ours{i}"])
      t["ours"] = t[f"ours{ranked[0]}"]
      cfg = final[ranked[0]]
      top[prod] = [final[i] for i in ranked[:2]]
      best_bare[prod] = min(t.values())
      # the same-run times against XLA's GEMM decide which backward products run on XLA (tuning.xla_faster)
      table_rows.setdefault(role, []).append(
          {"bucket": list(tuning.bucket(*mnk)), "shape": [*mnk], "config": dataclasses.asdict(cfg),
           "ms": round(t["ours"], 3),
           "vs_xla": {"ours_ms": round(t["ours"], 3), "xla_ms": round(t["xla"], 3),
                      "source": "bench_gemm.py --sweep, alternated"}})
      if len(final) > 1:
        emit(kind="finalists", shape=shape, product=prod,
             ms={final[i].short(): round(t[f"ours{i}"], 3) for i in ranked}, table_row=cfgs[0].short())
      summary = dict(kind="summary", shape=shape, product=prod, cfg=cfg.short(), ours_ms=round(t["ours"], 3),
                     ours_tflops=round(flops / t["ours"] / 1e9, 1), xla_ms=round(t["xla"], 3),
                     ours_vs_xla=round(t["xla"] / t["ours"], 3))
      if ex is not None:
        summary.update(example_ms=round(t["example"], 3), example_cfg=ex[1],
                       ours_vs_example=round(t["example"] / t["ours"], 3))
      emit(**summary)
      save()
      del ref, fns, ex

    if not args.no_fused and budget_left(budget) > 40:
      fused(shape, x, w, dz, flops, best_bare, top, table_rows, kind)
    save()
    del x, w, dz
  save()
  if args.sweep:
    with open(os.path.join(args.out, "gemm_tuning.json"), "w") as f:
      json.dump({"source": "benchmarks/bench_gemm.py --sweep", "date": meta["date"], "jax": meta["jax"],
                 "devices": {kind: table_rows}}, f, indent=1)


ALT_CFGS = {  # hand-picked candidates timed beside the table's row in --final mode
    "fwd": [G.GemmConfig(wg_split="m", cluster="n", order_width=8, stages=3, epi_n=128)],
    "dx": [G.GemmConfig(wg_split="m", cluster="n", order_width=8)],
    "dw": [G.GemmConfig(wg_split="m", cluster="n", order_width=8)],
}


def final_product(shape, prod, x, w, dz, labels, kind, rounds):
  """One product, every contender timed in alternation: XLA, ours (table row and a candidate), jax's example (its
  two configs that won the sweeps), and ours with the product's loss work."""
  b, h = x.shape
  v = w.shape[1]
  flops = 2 * b * h * v
  mnk = {"fwd": (b, v, h), "dx": (b, h, v), "dw": (h, v, b)}[prod]
  ours, xla = products(x, w, dz)
  make, oargs = ours[prod]
  f_xla, xargs = xla[prod]
  ref = f_xla(*xargs)
  fns = {"xla": (f_xla, xargs)}
  cfgs = list(dict.fromkeys([tuning.select_config(prod, *mnk, kind)] + ALT_CFGS[prod]))
  for i, cfg in enumerate(cfgs):
    f = make(cfg)
    emit(kind="check", shape=shape, product=prod, cfg=cfg.short(), rel_err_vs_xla=rel_err(f(*oargs), ref))
    fns[f"ours{i}"] = (f, oargs)
  del ref
  from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
  D = hm.MatmulDimension
  a_mk = {"fwd": x, "dx": dz, "dw": jnp.asarray(x.T)}[prod]
  b_kn = {"fwd": w, "dx": jnp.asarray(w.T), "dw": dz}[prod]
  for wg, cl in ((D.N, D.M), (D.M, D.N)):
    cfg = hm.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4, epi_tile_n=64, epi_tile_m=64,
                          grid_minor_dim=D.N, grid_tile_width=16, wg_dimension=wg, cluster_dimension=cl)
    mm = 128 * (1 + (wg == D.M)) * (1 + (cl == D.M))
    mn = 128 * (1 + (wg == D.N)) * (1 + (cl == D.N))
    fns[f"example wg={wg} cl={cl}"] = (jax.jit(lambda a, b, cfg=cfg: hm.matmul(a, b, None, cfg)),
                                       (pad_to(a_mk, 0, mm), pad_to(b_kn, 1, mn)))
  del a_mk, b_kn
  opts = G.StatsOptions()
  role_cfg = lambda role, m, n, k: tuning.select_config(role, m, n, k, kind)
  if prod == "fwd":
    c1 = role_cfg("fwd_stats", *mnk)
    fns["fwd_stats"] = (jax.jit(lambda x, w, y: G.gemm(x, w, epilogue=G.RowStats(y, opts), config=c1)), (x, w, labels))
    fns["fwd_stats_approx"] = (jax.jit(lambda x, w, y: G.gemm(x, w, epilogue=G.RowStats(y, opts), config=c1,
                                                              approx_math=True)), (x, w, labels))
    c2 = role_cfg("fwd_store", *mnk)
    fns["fwd_store"] = (jax.jit(lambda x, w, y: G.gemm(x, w, epilogue=(G.RowStats(y, opts), G.Store()), config=c2)),
                        (x, w, labels))
    # the op's fast forward: the statistics and the tiles stored as exponentials against a per-row reference
    fns["fwd_exp_approx"] = (jax.jit(lambda x, w, y: G.gemm(
        x, w, epilogue=G.RowStats(y, opts, store=True, ref=jnp.zeros(y.shape, jnp.float32)), config=c2,
        approx_math=True)), (x, w, labels))
  elif prod == "dx":
    c3 = role_cfg("dx_prologue", *mnk)
    lse = jnp.full((b,), 3.0, jnp.float32)
    one = jnp.ones((b,), jnp.float32)
    fns["dx_prologue"] = (jax.jit(lambda z, w, l, c, a, y: G.gemm(
        z, w, transpose_b=True, prologue=G.DzFromLogits(l, c, a, y), config=c3)), (dz, w, lse, one, one, labels))
    fns["dx_prologue_approx"] = (jax.jit(lambda z, w, l, c, a, y: G.gemm(
        z, w, transpose_b=True, prologue=G.DzFromLogits(l, c, a, y), config=c3, approx_math=True)),
        (dz, w, lse, one, one, labels))
  else:
    c4 = role_cfg("dw_acc", *mnk)
    c = jnp.ones((h, v), jnp.float32)
    fns["dw_acc"] = (jax.jit(lambda x, dz, c: G.gemm(x, dz, transpose_a=True, epilogue=G.AddTo(c), config=c4)),
                     (x, dz, c))
    dg = jax.lax.dot_general
    fns["xla_f32_plus_c"] = (jax.jit(lambda x, dz, c: c + dg(x, dz, (((0,), (0,)), ((), ())),
                                                             preferred_element_type=jnp.float32)), (x, dz, c))
  if "fwd_stats_approx" in fns:  # the approximate exp against the accurate one: the rows' lse
    lses = []
    for name in ("fwd_stats", "fwd_stats_approx"):
      st = G.merge_row_stats(fns[name][0](*fns[name][1]), b)
      lses.append(st.m + jnp.log(st.s))
    emit(kind="check", shape=shape, product="fwd_stats_approx",
         lse_max_abs_diff=float(jnp.abs(lses[0] - lses[1]).max()))
  if "dx_prologue_approx" in fns:
    outs = [fns[name][0](*fns[name][1]) for name in ("dx_prologue", "dx_prologue_approx")]
    emit(kind="check", shape=shape, product="dx_prologue_approx", rel_err_vs_accurate=rel_err(outs[1], outs[0]))
    del outs
  t = interleaved(fns, rounds)
  ours_best = min((k for k in t if k.startswith("ours")), key=t.get)
  ex_best = min((k for k in t if k.startswith("example")), key=t.get)
  bare_best = min(t[ours_best], t["xla"], t[ex_best])
  ms = t[ours_best]
  row = dict(kind="final", shape=shape, product=prod, ms={k: round(val, 3) for k, val in t.items()},
             ours_cfg=cfgs[int(ours_best[4:])].short(), ours_ms=round(ms, 3), ours_tflops=round(flops / ms / 1e9, 1),
             xla_ms=round(t["xla"], 3), ours_vs_xla=round(t["xla"] / ms, 3), example_ms=round(t[ex_best], 3),
             example_cfg=ex_best[8:], ours_vs_example=round(t[ex_best] / ms, 3))
  for name in ("fwd_stats", "fwd_stats_approx", "fwd_store", "fwd_exp_approx", "dx_prologue", "dx_prologue_approx",
               "dw_acc"):
    if name in t:
      row[f"{name}_ms"] = round(t[name], 3)
      row[f"{name}_vs_best_bare"] = round(t[name] / bare_best, 3)
      row[f"{name}_vs_xla_bare"] = round(t["xla"] / t[name], 3)
  if "xla_f32_plus_c" in t:
    row["dw_acc_vs_xla_f32_plus_c"] = round(t["xla_f32_plus_c"] / t["dw_acc"], 3)
  emit(**row)


def fused_candidates(name, base, mnk, top, kind):
  """The configs the loss-work variant ``name`` (a table role: ``fwd_stats``, ``fwd_store``, ``dx_prologue``,
  ``dw_acc``) of the bare product ``base`` is timed with: the table's row for it on this device first, so that a
  row the run writes was timed beside the one it would replace (the forward rows were tuned with their loss work,
  not from the bare product), then the bare product's two best configs of this run (``top``) made to fit the
  hooks; none where this run did not time the bare product (``PRODUCTS``)."""
  if base not in top:
    return []
  out = [tuning.select_config(name, *mnk, kind)]
  return out + [c for c in dict.fromkeys(tuning.fit_role(name, c0) for c0 in top[base]) if c not in out]


def fused(shape, x, w, dz, flops, best_bare, top, table_rows, kind):
  """The products with their loss work (:func:`fused_candidates`: the table's row, then the bare product's two
  best configs of this run made to fit the hooks, the fastest of them in alternation), against the best bare
  product of this run (ours, XLA's or the example's); a variant whose bare product this run did not time
  (``PRODUCTS``) is left out, so that no row is written for it."""
  b, h = x.shape
  v = w.shape[1]
  k = jax.random.split(jax.random.key(1), 4)
  labels = jax.random.randint(k[0], (b,), 0, v, jnp.int32)
  opts = G.StatsOptions()
  lse = jnp.full((b,), 3.0, jnp.float32)
  coef = jnp.ones((b,), jnp.float32)
  c = jnp.zeros((h, v), jnp.float32) + 1.0
  dg = jax.lax.dot_general
  variants = {
      "fwd_stats": ("fwd", (b, v, h), lambda cfg: jax.jit(
          lambda x, w, y: G.gemm(x, w, epilogue=G.RowStats(y, opts), config=cfg)), (x, w, labels)),
      "fwd_store": ("fwd", (b, v, h), lambda cfg: jax.jit(
          lambda x, w, y: G.gemm(x, w, epilogue=(G.RowStats(y, opts), G.Store()), config=cfg)), (x, w, labels)),
      "dx_prologue": ("dx", (b, h, v), lambda cfg: jax.jit(
          lambda z, w, l, c, a, y: G.gemm(z, w, transpose_b=True, prologue=G.DzFromLogits(l, c, a, y), config=cfg)),
          (dz, w, lse, coef, coef, labels)),
      "dw_acc": ("dw", (h, v, b), lambda cfg: jax.jit(
          lambda x, dz, c: G.gemm(x, dz, transpose_a=True, epilogue=G.AddTo(c), config=cfg)), (x, dz, c)),
  }
  for name, (base, mnk, make, args) in variants.items():
    cands = fused_candidates(name, base, mnk, top, kind)
    if not cands:  # (PRODUCTS left its bare product out: no row for it from this run)
      emit(kind="fused_skip", shape=shape, variant=name, why=f"{base} not timed in this run")
      continue
    built = []
    for i, cfg in enumerate(cands):
      try:
        f = make(cfg)
        ms = timeit(f, args)
      except Exception as e:  # noqa: BLE001
        emit(kind="fused_error", shape=shape, variant=name, cfg=cfg.short(), error=f"{type(e).__name__}: {e}"[:300])
        continue
      emit(kind="fused_try", shape=shape, variant=name, cfg=cfg.short(), ms=round(ms, 3), table_row=i == 0)
      built.append((cfg, f, ms))
    if not built:
      continue
    t = interleaved({i: (f, args) for i, (_, f, _) in enumerate(built)}) if len(built) > 1 else {0: built[0][2]}
    best = min(t, key=t.get)
    (cfg, f, _), ms = built[best], t[best]
    table_rows.setdefault(name, []).append(
        {"bucket": list(tuning.bucket(*mnk)), "shape": [*mnk], "config": dataclasses.asdict(cfg), "ms": round(ms, 3)})
    extra = {}
    out = f(*args)
    if name == "fwd_stats":
      st = G.merge_row_stats(out, b)
      lse_ref = jax.nn.logsumexp(jnp.dot(x[:512], w, preferred_element_type=jnp.float32), axis=1)
      extra["lse_max_abs_err"] = float(jnp.abs((st.m + jnp.log(st.s))[:512] - lse_ref).max())
    elif name == "dx_prologue":
      d = jnp.exp(dz[:256].astype(jnp.float32) - 3.0) - (jnp.arange(v)[None, :] == labels[:256, None])
      extra["rel_err"] = rel_err(out[:256], jnp.dot(d.astype(jnp.bfloat16), w.T, preferred_element_type=jnp.float32))
    elif name == "dw_acc":
      fx = jax.jit(lambda x, dz, c: c + dg(x, dz, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32))
      t = interleaved({"ours": (f, args), "xla": (fx, args)})
      ms = t["ours"]
      extra.update(xla_f32_plus_c_ms=round(t["xla"], 3), vs_xla=round(t["xla"] / ms, 3),
                   rel_err=rel_err(out - c, fx(*args) - c))
    base_ms = best_bare.get(base)
    emit(kind="fused", shape=shape, variant=name, cfg=cfg.short(), ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1),
         vs_best_bare=round(ms / base_ms, 3) if base_ms else None, **extra)
    del out


# ------------------------------------------------------------------------------------------------ --schedules


class Watchdog:
  """Ends the process (after writing what was measured) if one step runs past its limit: a kernel that never
  finishes (a barrier protocol gone wrong) must not hold the run until an outer timeout, with nothing written."""

  def __init__(self, on_timeout):
    self.on_timeout, self.timer = on_timeout, None

  def arm(self, label, seconds):
    import threading  # noqa: PLC0415
    self.disarm()
    self.timer = threading.Timer(seconds, self._fire, (label, seconds))
    self.timer.daemon = True
    self.timer.start()

  def disarm(self):
    if self.timer is not None:
      self.timer.cancel()
      self.timer = None

  def _fire(self, label, seconds):
    emit(kind="error", where=label, error=f"timeout: no result after {seconds} s (a hung kernel?); process ended")
    self.on_timeout()
    os._exit(3)


# the ping-pong variants --schedules times (each checked first by --smoke-only NAME in a child process)
PP_VARIANTS = {"pingpong": tuning.PINGPONG, "pingpong_ws": tuning.PINGPONG_WS,
               "pingpong_ws-cl_n": dataclasses.replace(tuning.PINGPONG_WS, cluster="n"),
               "pingpong_ws-cl_m": dataclasses.replace(tuning.PINGPONG_WS, cluster="m")}
SMOKE = (1896, 4160, 1088)  # an odd count of 128x128 tiles (15 x 33), a few pairs of them per CTA, 17 K steps


def _role_fn(role, cfg, opts):
  """x·w (``fwd``), with the statistics epilogue (``fwd_stats``), the op's fast forward (``fwd_store``: statistics
  and the tiles stored as exponentials against a per-row reference, on the approximate exp), or xᵀ·dz + C in
  float32 (``dw_acc``)."""
  if role == "dw_acc":
    return jax.jit(lambda a, b, c: G.gemm(a, b, transpose_a=True, epilogue=G.AddTo(c), config=cfg))
  if role == "fwd":
    return jax.jit(lambda a, b, lab: G.gemm(a, b, config=cfg))
  if role == "fwd_stats":
    return jax.jit(lambda a, b, lab: G.gemm(a, b, epilogue=G.RowStats(lab, opts), config=cfg))
  return jax.jit(lambda a, b, lab: G.gemm(a, b, epilogue=G.RowStats(lab, opts, store=True, ref=jnp.zeros(
      lab.shape, jnp.float32)), config=cfg, approx_math=True))


def _smoke(cfg, dog, opts) -> bool:
  """``cfg``'s schedule on a small problem (see :data:`SMOKE`) against XLA and the cooperative schedule."""
  try:
    dog.arm(f"{cfg.short()} smoke test", 75)
    m, n, k = SMOKE
    kk = jax.random.split(jax.random.key(2), 3)
    a = jax.random.normal(kk[0], (m, k), jnp.bfloat16)
    b = (0.05 * jax.random.normal(kk[1], (k, n), jnp.float32)).astype(jnp.bfloat16)
    y = jax.random.randint(kk[2], (m,), 0, n, jnp.int32)
    ref = jnp.dot(a, b, preferred_element_type=jnp.float32)
    z = G.gemm(a, b, epilogue=G.Store(jnp.float32), config=cfg)
    st, z16 = G.gemm(a, b, epilogue=(G.RowStats(y, opts), G.Store()), config=tuning.fit_role("fwd_store", cfg))
    st_c = G.gemm(a, b, epilogue=G.RowStats(y, opts), config=tuning.DEFAULT)
    st_p = G.gemm(a, b, epilogue=G.RowStats(y, opts), config=cfg)
    errs = dict(store_f32_rel_err=rel_err(z, ref), store_bf16_rel_err=rel_err(z16, ref),
                lse_diff_store=float(jnp.abs(_lse(st, m) - _lse(st_c, m)).max()),
                lse_diff_stats=float(jnp.abs(_lse(st_p, m) - _lse(st_c, m)).max()))
    dog.disarm()
    ok = errs["store_f32_rel_err"] < 1e-5 and errs["store_bf16_rel_err"] < 1e-2 and max(
        errs["lse_diff_store"], errs["lse_diff_stats"]) < 1e-4
    emit(kind="check", what=f"{cfg.short()} smoke test", cfg=cfg.short(), shape=[m, n, k], ok=ok, **errs)
    return ok
  except Exception as e:  # noqa: BLE001
    dog.disarm()
    emit(kind="error", where=f"{cfg.short()} smoke test", error=f"{type(e).__name__}: {e}"[:400])
    return False


def _smoke_in_child(schedule, out_dir, timeout=90) -> bool:
  """Runs ``--smoke-only schedule`` in a child process (killed after ``timeout`` s: a hung kernel ends with it,
  not with this process); its rows join this run's; returns whether the schedule passed."""
  import subprocess  # noqa: PLC0415
  cmd = [sys.executable, os.path.abspath(__file__), "--smoke-only", schedule, "--out", out_dir]
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  try:
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    text, note = res.stdout, f"exit code {res.returncode}"
    if res.returncode:
      note += ": " + res.stderr[-300:]
  except subprocess.TimeoutExpired as e:
    text = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    note = f"killed after {timeout} s (a hung kernel?)"
  passed = False
  for line in text.splitlines():
    try:
      r = json.loads(line)
    except ValueError:
      continue
    if r.get("kind") in ("check", "error") and "smoke test" in str(r.get("what", r.get("where", ""))):
      ROWS.append(dict(r, child=True))
      passed = passed or (r["kind"] == "check" and bool(r["ok"]))
  emit(kind="smoke", schedule=schedule, passed=passed, child=note)
  return passed


def _xla_f32_plus_c(a, b, c):
  return c + jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _lse(st, b):
  rs = G.merge_row_stats(st, b)
  return rs.m + jnp.log(rs.s)


def schedules(args, kind, meta, budget):
  """The lean forward (``fwd_stats``), the op's fast forward (``fwd_store``), the bare ``fwd`` and the
  token-chunked dw (``dw_acc``, xᵀ·dz + C) with the cooperative schedule (the table's row) and the ping-pong
  variants (:data:`PP_VARIANTS`), plus XLA's bare GEMM and XLA's float32 xᵀ·dz + C, all of one shape timed in
  alternation. Writes
  ``results.json`` and ``gemm_tuning.json`` (the package's table with each of these roles' rows at the measured
  shapes set to its faster schedule)."""
  out = {"meta": meta, "rows": ROWS}

  def save():
    with open(os.path.join(args.out, "results.json"), "w") as f:
      json.dump(out, f, indent=1)

  dog = Watchdog(save)
  shape_names = os.environ.get("SHAPES", "llama3-8b,gpt2-small,qwen3-8b,gemma2-2b").split(",")
  opts = G.StatsOptions()
  # a small call of each ping-pong schedule first, against the cooperative one, in a child process: a wrong or
  # hanging schedule shows up there, in seconds, and its variants are left out of the timings here
  names = [n for n in PP_VARIANTS if n != "pingpong" or os.environ.get("PINGPONG") == "1"]
  passed = {n: _smoke_in_child(n, args.out) for n in names}
  save()

  raw = {}
  if os.path.exists(tuning.TABLE_PATH):
    with open(tuning.TABLE_PATH) as f:
      raw = json.load(f)
  devices = raw.setdefault("devices", {})
  table = devices.setdefault(tuning_table.kind_key(devices, kind), {})
  for shape in shape_names:
    if budget_left(budget) < 45:
      emit(kind="stop", shape=shape, why="past BUDGET_S")
      break
    try:  # whatever goes wrong at one shape is a row, and the next shape runs
      b, h, v = SHAPES[shape]
      flops = 2 * b * h * v
      kk = jax.random.split(jax.random.key(0), 4)
      x = jax.random.normal(kk[0], (b, h), jnp.bfloat16)
      w = (0.02 * jax.random.normal(kk[1], (h, v), jnp.float32)).astype(jnp.bfloat16)
      y = jax.random.randint(kk[2], (b,), 0, v, jnp.int32)
      dz = (1e-3 * jax.random.normal(kk[3], (b, v), jnp.float32)).astype(jnp.bfloat16)
      c = jnp.ones((h, v), jnp.float32)
      mnks = {"fwd": (b, v, h), "fwd_stats": (b, v, h), "fwd_store": (b, v, h), "dw_acc": (h, v, b)}
      role_args = {"fwd": (x, w, y), "fwd_stats": (x, w, y), "fwd_store": (x, w, y), "dw_acc": (x, dz, c)}
      cands = {  # name -> (role, config)
          f"{role}/coop": (role, tuning.select_config(role, *mnks[role], kind)) for role in mnks}
      short = {"pingpong": "pp", "pingpong_ws": "ws", "pingpong_ws-cl_n": "ws-cln", "pingpong_ws-cl_m": "ws-clm"}
      for name, ok in passed.items():
        if not ok:
          continue
        pp, tag = PP_VARIANTS[name], short[name]
        cands.update({f"fwd/{tag}": ("fwd", dataclasses.replace(pp, epi_n=64)), f"fwd_stats/{tag}": ("fwd_stats", pp),
                      f"fwd_store/{tag}": ("fwd_store", tuning.fit_role("fwd_store", pp))})
        if name in ("pingpong_ws", "pingpong_ws-cl_n"):
          cands[f"dw_acc/{tag}"] = ("dw_acc", tuning.fit_role("dw_acc", pp))
      fns = {"xla": (jax.jit(lambda a, b_, lab: jnp.dot(a, b_)), (x, w, y)),
             "xla_dw_f32_plus_c": (jax.jit(_xla_f32_plus_c), (x, dz, c))}
      # each variant is built, run once and checked as it comes (against the cooperative one of its role, which
      # comes first, and the bare ones against XLA); only those references stay on the device meanwhile
      coop_out, ref = {}, None
      for name, (role, cfg) in cands.items():
        if budget_left(budget) < 25:
          emit(kind="stop", shape=shape, variant=name, why="past BUDGET_S")
          break
        try:  # compiles and runs once; a config that fails is a row with its error, the run goes on
          dog.arm(f"{shape} {name}", 90)
          f = _role_fn(role, cfg, opts)
          res = jax.block_until_ready(f(*role_args[role]))
          dog.disarm()
          fns[name] = (f, role_args[role])
          emit(kind="built", shape=shape, variant=name, cfg=cfg.short())
        except Exception as e:  # noqa: BLE001
          dog.disarm()
          emit(kind="error", shape=shape, variant=name, cfg=cfg.short(), error=f"{type(e).__name__}: {e}"[:400])
          continue
        try:
          base = coop_out.get(role)
          if name == f"{role}/coop":
            coop_out[role] = res
          if role == "fwd":
            ref = fns["xla"][0](x, w, y) if ref is None else ref
            emit(kind="check", shape=shape, variant=name, rel_err_vs_xla=rel_err(res, ref))
          elif role == "dw_acc" and base is not None:
            emit(kind="check", shape=shape, variant=name, rel_err_vs_coop=rel_err(res - c, base - c))
          elif base is not None:
            st, st0 = (res[0], base[0]) if role == "fwd_store" else (res, base)
            row = dict(lse_max_abs_diff_vs_coop=float(jnp.abs(_lse(st, b) - _lse(st0, b)).max()))
            if role == "fwd_store":
              row["logits_rel_err_vs_coop"] = rel_err(res[1], base[1])
            emit(kind="check", shape=shape, variant=name, **row)
        except Exception as e:  # noqa: BLE001
          emit(kind="error", shape=shape, variant=name, where="checks", error=f"{type(e).__name__}: {e}"[:400])
        del res
      del coop_out, ref
      t = {}
      try:
        dog.arm(f"{shape} timing", 150)
        t = interleaved(fns, args.rounds)
        dog.disarm()
      except Exception as e:  # noqa: BLE001
        dog.disarm()
        emit(kind="error", shape=shape, where="timing", error=f"{type(e).__name__}: {e}"[:400])
      if t:
        bare = min(t[k] for k in t if k == "xla" or k.startswith("fwd/"))
        row = dict(kind="schedules", shape=shape, ms={k: round(val, 3) for k, val in t.items()},
                   tflops={k: round(flops / val / 1e9, 1) for k, val in t.items()}, best_bare_fwd_ms=round(bare, 3),
                   vs_best_bare_fwd={k: round(val / bare, 3) for k, val in t.items() if not k.startswith("dw_acc")
                                     and k != "xla_dw_f32_plus_c"},
                   cfg={name: cfg.short() for name, (_, cfg) in cands.items() if name in t})
        if "xla_dw_f32_plus_c" in t:
          row["dw_acc_vs_xla_f32_plus_c"] = {k: round(t["xla_dw_f32_plus_c"] / val, 3) for k, val in t.items()
                                             if k.startswith("dw_acc/")}
        for role in mnks:
          mine = {k: v_ for k, v_ in t.items() if k.startswith(role + "/")}
          if not mine:
            continue
          best = min(mine, key=mine.get)
          coop = f"{role}/coop"
          if coop in mine and mine[coop] <= 1.01 * mine[best]:
            best = coop  # a schedule change for less than 1% is noise on this machine: the table keeps its row
          row[f"{role}_best"] = best
          if coop in mine and len(mine) > 1:
            row[f"{role}_pp_speedup"] = round(mine[coop] / min(v_ for k, v_ in mine.items() if k != coop), 3)
          bkt = list(tuning.bucket(*mnks[role]))
          rows = [r for r in table.get(role, []) if r.get("bucket") != bkt]
          rows.append({"bucket": bkt, "shape": list(mnks[role]), "config": dataclasses.asdict(cands[best][1]),
                       "ms": round(mine[best], 3)})
          table[role] = rows
        emit(**row)
      del x, w, y, dz, c, fns
    except Exception as e:  # noqa: BLE001
      emit(kind="error", shape=shape, error=f"{type(e).__name__}: {e}"[:400])
    save()
  raw.update(source="benchmarks/bench_gemm.py --schedules (rows of fwd, fwd_stats, fwd_store, dw_acc at the "
                    "measured shapes); the other rows as they were", date=meta["date"], jax=meta["jax"])
  with open(os.path.join(args.out, "gemm_tuning.json"), "w") as f:
    json.dump(raw, f, indent=1)
  emit(kind="done", seconds=round(time.time() - T0, 1))
  save()


if __name__ == "__main__":
  main()
