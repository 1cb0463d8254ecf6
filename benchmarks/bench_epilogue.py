"""What the forward GEMM's loss epilogue costs, piece by piece (one GPU run).

At each shape it times, in alternation (median of ``--rounds`` rounds of 10 runs), XLA's bare product ``x·w`` and
the forward GEMM of ``lce_flax/_impl/pallas_mosaic/gemm.py`` (the tuning table's config) under these epilogues:

  bare            the bf16 product stored (``Store()``)
  stats_no_target the row statistics but the target logit (``RowStats(target=False)``)
  stats           ``RowStats``: the lean forward
  store           ``RowStats(store=True)``: the fast forward
  store_cap       ``store`` with a soft cap of 30 (gemma2's)
  exp             ``RowStats(store=True, ref=0)``: the stored exponentials (the op's fast forward)
  stats_cap, exp_cap  ``stats_fast`` and ``exp_fast`` with a soft cap of 30: the lean and fast forwards of a
                  Gemma 2 head as the op runs them
  *_fast          the same with the approximate ``exp`` (``approx_math``)
  stats_fast_no_target, exp_fast_no_target  ``stats_fast`` and ``exp_fast`` without the target logit
                  (``target=False``: no per-element label compare, select and row sum): what moving the label's
                  logit out of the epilogue would save
  stats_fast_tiles, exp_fast_tiles  ``stats_fast`` and ``exp_fast`` with the target logit formed only in the
                  tiles that hold a label (``target_tiles=True``; without a soft cap the package forms it in every
                  tile)
  stats_cap_every_target, exp_cap_every_target  ``stats_cap`` and ``exp_cap`` with the target logit formed in
                  every tile (``target_tiles=False``; with a soft cap the package forms it only in the tiles that
                  hold a label)

``--variants`` picks some of them; ``--store-configs "epi_slots=3;stages=3,epi_n=128"`` adds ``exp_fast`` once per
given change to the tuning table's ``fwd_store`` config (named ``exp_fast[epi_slots=3]`` and so on); ``--configs``
adds ``bare``, ``stats_fast`` and ``exp_fast`` with their roles' configs changed so. One JSON line
per measurement; ``--out`` gets ``results.json`` with device, versions and date.
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import bench, shapes  # noqa: E402
from benchmarks.bench_gemm import SHAPES, config_changes, interleaved  # noqa: E402
from lce_flax._impl.pallas_mosaic import gemm as G  # noqa: E402
from lce_flax._impl.pallas_mosaic import tuning  # noqa: E402

# the four heads, and token chunks of the "tokens" design's forward: gpt2-small's 8192 tokens (4096 before its
# chunks grew to op.TOKEN_CHUNK_MIN), llama3-8b's 4096 at 32768 tokens, and 4096 of gemma2-2b (2048 run at 32768)
EPI_SHAPES = {**SHAPES, "gpt2-small-chunk": (4096, 768, 50304), "gpt2-small-chunk8k": (8192, 768, 50304),
              "llama3-8b-chunk": (4096, 4096, 128256), "gemma2-2b-chunk": (4096, 2304, 256000)}


# the variants that --configs re-times under changed configs, and the tuning-table role each one reads
ROLES = {"bare": "fwd", "stats_fast": "fwd_stats", "exp_fast": "fwd_store"}


def gemm_variant(name: str, logit_softcap: float | None = None, target: bool = True,
                 target_tiles: bool | None = None, **where):
  """``bare``, ``stats_fast`` or ``exp_fast`` (the op's fast forward: statistics and stored exponentials) on the GEMM,
  jitted; ``target=False``: without the target logit; ``target_tiles``: ``RowStats``' (the package's choice when
  None); ``where``: ``role=`` (the table's config at trace time) or ``config=``, and any other keyword of ``gemm``
  (``interpret=``)."""
  plain = G.StatsOptions(logit_softcap=logit_softcap)
  if name == "bare":
    return jax.jit(lambda x, w, y: G.gemm(x, w, **where))
  ref = name == "exp_fast"
  return jax.jit(lambda x, w, y: G.gemm(
      x, w, epilogue=G.RowStats(y, plain, store=ref, target=target, target_tiles=target_tiles,
                                ref=jnp.zeros(y.shape, jnp.float32) if ref else None),
      approx_math=True, **where))


def variants():
  """name -> f(x, w, y), each jitted."""
  plain, capped = G.StatsOptions(), G.StatsOptions(logit_softcap=30.0)

  def fwd(part, opts, approx=False, **kw):
    role = "fwd_store" if kw.get("store") else "fwd_stats"
    return jax.jit(lambda x, w, y: G.gemm(x, w, epilogue=part(y, opts, **kw), role=role, approx_math=approx))

  return {
      "xla": jax.jit(lambda x, w, y: jnp.dot(x, w)),
      "bare": gemm_variant("bare", role=ROLES["bare"]),
      "stats_no_target": fwd(G.RowStats, plain, target=False),
      "stats": fwd(G.RowStats, plain),
      "stats_fast": gemm_variant("stats_fast", role=ROLES["stats_fast"]),
      "store": fwd(G.RowStats, plain, store=True),
      "store_fast": fwd(G.RowStats, plain, approx=True, store=True),
      "store_cap": fwd(G.RowStats, capped, store=True),
      "exp_fast": gemm_variant("exp_fast", role=ROLES["exp_fast"]),
      "stats_fast_no_target": gemm_variant("stats_fast", target=False, role=ROLES["stats_fast"]),
      "exp_fast_no_target": gemm_variant("exp_fast", target=False, role=ROLES["exp_fast"]),
      "stats_fast_tiles": gemm_variant("stats_fast", target_tiles=True, role=ROLES["stats_fast"]),
      "exp_fast_tiles": gemm_variant("exp_fast", target_tiles=True, role=ROLES["exp_fast"]),
      "stats_cap_every_target": gemm_variant("stats_fast", 30.0, target_tiles=False, role=ROLES["stats_fast"]),
      "exp_cap_every_target": gemm_variant("exp_fast", 30.0, target_tiles=False, role=ROLES["exp_fast"]),
      "stats_cap": gemm_variant("stats_fast", 30.0, role=ROLES["stats_fast"]),
      "exp_cap": gemm_variant("exp_fast", 30.0, role=ROLES["exp_fast"]),
  }


def config_variants(spec: str, b: int, h: int, v: int, kind: str, which: tuple[str, ...]) -> dict:
  """For each ``;``-separated ``field=value,...`` of ``spec``: the variants ``which`` (of :data:`ROLES`) with their
  tuning-table config changed so, named ``<variant>[<item>]``."""
  out = {}
  for item in filter(None, spec.split(";")):
    for name in which:
      cfg = dataclasses.replace(tuning.select_config(ROLES[name], b, v, h, kind), **config_changes(item))
      out[f"{name}[{item}]"] = gemm_variant(name, config=cfg)
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/epilogue-local"))
  ap.add_argument("--shapes", default="llama3-8b,gemma2-2b,gpt2-small,qwen3-8b")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--variants", default=None, help="comma-separated subset of the variants (default: all)")
  ap.add_argument("--store-configs", default="", help="';'-separated changes to the fwd_store config, each timed "
                  "as an exp_fast variant (e.g. 'epi_slots=3;stages=3,epi_n=128')")
  ap.add_argument("--configs", default="", help="';'-separated changes to the table's configs, each timed as bare, "
                  "stats_fast and exp_fast variants (e.g. 'tile_m=64,tile_n=256')")
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  kind = jax.devices()[0].device_kind
  meta = dict(device=kind, jax=jax.__version__, date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              commit=os.environ.get("LCE_FLAX_COMMIT"))
  rows = []
  for name in args.shapes.split(","):
    b, h, v = EPI_SHAPES[name]
    x, w, y = bench.make_inputs(shapes.Shape(name, b, h, v))
    fns = {}
    chosen = variants()
    if args.variants:
      unknown = set(args.variants.split(",")) - set(chosen)
      if unknown:
        raise SystemExit(f"--variants: unknown {sorted(unknown)}; known: {', '.join(chosen)}")
      chosen = {n: chosen[n] for n in args.variants.split(",")}
    chosen.update(config_variants(args.store_configs, b, h, v, kind, ("exp_fast",)))
    chosen.update(config_variants(args.configs, b, h, v, kind, tuple(ROLES)))
    for vname, f in chosen.items():
      a = (x, w, y)
      try:
        print(f"# {name} {vname}", file=sys.stderr, flush=True)
        jax.block_until_ready(f(*a))
        fns[vname] = (f, a)
      except Exception as e:  # noqa: BLE001
        rows.append(dict(shape=name, variant=vname, error=f"{type(e).__name__}: {e}"[:400]))
        print(json.dumps(rows[-1]), flush=True)
    # each config variant's outputs against its base variant's (the same math: equal bit for bit). The statistics
    # [4, column tiles, rows] are padded to each config's cluster tile: compared over the 128-column tiles of the
    # vocabulary and the real rows (a 256-column tile's statistics have another shape: not comparable, None)
    def valid_part(a, b=b, v=v):
      return a[:, :-(-v // 128), :b] if a.ndim == 3 else a

    # (and each *_tiles and *_every_target variant's against the package's way: equal bit for bit too)
    same = {}
    for base in (*ROLES, "stats_cap", "exp_cap"):
      if base not in fns:
        continue
      want = [valid_part(a) for a in jax.tree.leaves(fns[base][0](x, w, y))]
      for vname in fns:
        if vname.startswith(base + "[") or vname in (base + "_tiles", base + "_every_target"):
          got = [valid_part(a) for a in jax.tree.leaves(fns[vname][0](x, w, y))]
          shapes_match = [g.shape for g in got] == [r.shape for r in want]
          same[vname] = all(bool(jnp.array_equal(g, r)) for g, r in zip(got, want)) if shapes_match else None
      del want
    t = interleaved(fns, rounds=args.rounds)
    cfg = tuning.select_row("fwd", b, v, h, kind)
    for vname, ms in t.items():
      rows.append(dict(shape=name, variant=vname, ms=round(ms, 3), tflops=round(2 * b * h * v / ms / 1e9, 1),
                       vs_bare=round(ms / t["bare"], 3) if "bare" in t else None, fwd_config=cfg[0].short(),
                       **({"equals_base": same[vname]} if vname in same else {})))
      print(json.dumps(rows[-1]), flush=True)
    del x, w, y, fns
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(dict(meta, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
