"""Lean mode's recompute of one vocabulary chunk, per kernel, at the four LLM heads; and a sweep for its tuning rows.

Lean mode (``impl="pallas_mosaic"``, ``mode="lean"``) walks the vocabulary in chunks of ``vocab_chunk`` columns
(``op.lean_chunk``: the most that keep its buffers within B·H·4 + 64 MB) and recomputes each chunk's logit gradient
``dz`` [B, chunk] before XLA's two products. For one chunk of each head (B × chunk × H), timed in alternation (median
of ``--rounds`` rounds of 10-run medians of a jitted loop over 8 of the head's chunks, divided by 8: the op's own
loop has no dispatch between chunks, and a chunk takes only ~0.1–0.4 ms; bf16):

  xla        jnp.dot(x, w_chunk): the bare product, bf16 out (what the recompute cannot beat by much)
  gemm       our GEMM's bare product at the chunk's shape (the tuning table's ``fwd`` row)
  lean_dz    the op's recompute on the GEMM: the ``LogitGrad`` epilogue, the table's ``lean_dz`` row
  kernels_ws the recompute on the dz kernel of ``kernels_ws.py`` (``PallasMosaicConfig(gemm=False)``)

and, with ``--widths``, lean mode's whole forward and backward (``value_and_grad`` of x and w) at its own chunk
width and at the narrower widths whose recompute fills the GPU's waves best (the persistent GEMM's tiles over the
SMs: llama3-8b's 1792 columns make 448 CTA tiles of 256×128, 3.4 waves on 132 SMs), each with its wave efficiency
(tiles ÷ the whole waves they take) and its compiled temporaries against lean's bound (``--chunks W1,W2``: at those
widths instead, wider ones too; ``--chunk-products gemm,xla``: each width once per owner of the chunk's
products; ``--token-blocks T1,T2``: beside them, lean mode in blocks of T tokens within each chunk, named ``tbT``,
each at the width the op plans for its blocks: ``PallasMosaicConfig(token_block=T)``; and ``tb_all``, the same
pair in one block of all the tokens); with ``--products``, what
XLA's products allow lean mode at wider chunks: per chunk of 1, 2, 4 and 8
times the op's width, the three products lean runs for it (the chunk's logits x·w_c,
``dx += dz·w_cᵀ`` into a float32 carry, ``dw_c = xᵀ·dz`` into dw) timed in one loop, beside XLA's whole forward
product x·w and the plain head's forward and backward (``bench.py``'s ``plain_bf16``): a lean step
at a width costs at least the forward product plus its chunks' products (``lean_floor_ms``), against the 1.25×
the plain head that lean mode is held to; and, with ``--sweep``, ``lean_dz`` on each config of a grid (the warpgroup
split, the 2-CTA cluster and its direction, the snake's order and width, the ping-pong schedule fed by a TMA
warpgroup with and without clusters), each checked against the kernels_ws recompute; the fastest per head goes into
``lean_dz_rows.json`` in the table's format, with its time against XLA's bare product (``vs_xla``), to be merged
into ``lce_flax/_impl/pallas_mosaic/gemm_tuning.json`` under this device's kind (``benchmarks/tuning_table.py``).
Every kernel's dz is checked against the kernels_ws one on the same inputs (``check`` rows).

    python -m benchmarks.bench_lean [--shapes llama3-8b,...] [--rounds 3] [--widths] [--products] [--sweep] [--out DIR]
    python -m benchmarks.bench_lean --interpret --shapes tiny --rounds 1     # a CPU check of the harness

Writes ``DIR/bench_lean.json`` (device, versions, date, rows) and prints one JSON line per row. BUDGET_S (default
400): no new work starts past it.
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
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import bench, shapes  # noqa: E402
from benchmarks.bench_gemm import interleaved, rel_err, sweep_configs  # noqa: E402
from lce_flax import _device, _math, linear_cross_entropy  # noqa: E402
from lce_flax._impl import common  # noqa: E402
from lce_flax._impl.pallas_mosaic import Config, op, tuning  # noqa: E402
from lce_flax._impl.pallas_mosaic import gemm as G  # noqa: E402

LOOP = 8  # chunks timed in one jitted loop (each contender over the same columns)
SHAPES = {**shapes.HEADS, "tiny": (128, 64, 512), "tiny-tall": (384, 64, 512)}  # (CPU checks of the harness)


def chunk_inputs(b: int, h: int, v: int, interpret: bool):
  """x, w, labels, the rows' lse, the loss spec and the two lean plans (GEMM, kernels_ws) of one head."""
  k = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(k[0], (b, h), jnp.float32).astype(jnp.bfloat16)
  w = (0.02 * jax.random.normal(k[1], (h, v), jnp.float32)).astype(jnp.bfloat16)
  y = jax.random.randint(k[2], (b,), 0, v, jnp.int32)
  lse = jnp.full((b,), jnp.log(v) + 0.5, jnp.float32)
  spec = common.Spec(_math.LossSpec(vocab_size=v), "hv", interpret)
  gemm = op.plan(b, h, v, None, interpret, "lean")
  # (the same chunk width for both: the GEMM's plan can take a steps row's wider one, and their dz are compared)
  plans = {"lean_dz": gemm, "kernels_ws": op.plan(b, h, v, Config(gemm=False, vocab_chunk=gemm.vocab_chunk),
                                                  interpret, "lean")}
  return x, w, y, lse, spec, plans


def looped(chunk_call, n: int, cw: int):
  """One jitted loop over ``n`` chunks at columns 0, cw, 2·cw, ...: ``chunk_call(start, *args)`` each (as the op's
  own loop runs them: no dispatch between chunks, so a chunk's time is the loop's over n)."""
  def f(*args):
    out = jax.eval_shape(lambda: chunk_call(0, *args))
    return lax.fori_loop(0, n, lambda k, _: chunk_call(k * cw, *args), jnp.zeros(out.shape, out.dtype))
  return jax.jit(f)


def op_recompute(spec, plan):
  """``chunk_call`` of the op's own recompute (``dz_of`` of :func:`.op._dz_chunks`) under ``plan``."""
  def call(start, x, w, y, lse):
    g = jnp.ones(y.shape, jnp.float32)
    _, _, _, _, dz_of = op._dz_chunks(x, w, None, y, lse, g, jnp.zeros_like(g), spec, plan)
    return dz_of(start, 0)[0]
  return call


def logit_grad_with(cfg, spec, cw: int):
  """``chunk_call`` of the recompute on the GEMM with ``cfg`` (the LogitGrad part as the op builds it)."""
  def call(start, x, w, y, lse):
    coef, a, c = (jnp.ones_like(lse), jnp.ones_like(lse), jnp.zeros_like(lse))
    part = G.LogitGrad(lse, coef, a, c, y - start, spec.opts)
    return G.gemm(x, lax.dynamic_slice_in_dim(w, start, cw, 1), epilogue=part, config=cfg,
                  interpret=spec.interpret)
  return call


def bare(cw: int, ours: bool, interpret: bool):
  """``chunk_call`` of the chunk's bare product: XLA's, or our GEMM's (the table's ``fwd`` row)."""
  def call(start, x, w, *_):
    w_c = lax.dynamic_slice_in_dim(w, start, cw, 1)
    return G.gemm(x, w_c, role="fwd", interpret=interpret) if ours else jnp.dot(x, w_c)
  return call


def wave_efficiency(cfg, m: int, n: int, sms: int) -> float:
  """The share of the persistent GEMM's capacity that an [m, n] output uses: m·n ÷ (whole waves × tiles per wave ×
  a tile's area), with ``cfg``'s cluster tile on ``sms`` SMs (a ping-pong CTA holds two tiles at once); ragged
  edge tiles count as the whole tiles they occupy."""
  tm, tn = cfg.cluster_tile()
  tiles = -(-m // tm) * -(-n // tn)
  per_wave = sms // cfg.cluster_size() * (1 if cfg.schedule == "cooperative" else 2)
  return m * n / (-(-tiles // per_wave) * per_wave * tm * tn)


def chunk_efficiency(b: int, h: int, c: int, kind: str, sms: int) -> float:
  """The wave efficiency of lean's recompute of a chunk of ``c`` columns on the table's ``lean_dz`` row."""
  return wave_efficiency(tuning.select_config("lean_dz", b, c, h, kind), b, c, sms)


def chunk_widths(b: int, h: int, cw: int, kind: str, sms: int, step: int = 128, extra: int = 3) -> dict[int, float]:
  """Lean chunk widths to time: the op's own (``cw``) and the ``extra`` narrower ones (at least half of it, in
  multiples of ``step``) whose recompute fills its waves best; width -> wave efficiency."""
  eff = {c: chunk_efficiency(b, h, c, kind, sms) for c in range(max(step, cw // 2 // step * step), cw + 1, step)}
  best = sorted((c for c in eff if c != cw), key=lambda c: (-eff[c], -c))[:extra]
  return {c: round(eff[c], 3) for c in sorted({cw, *best}, reverse=True)}


def chunk_products(n: int, cw: int):
  """Lean mode's three products for ``n`` chunks of ``cw`` columns on XLA, in one jitted loop as the op runs them:
  the chunk's logits ``dz = x·w_c`` (standing in for its recomputed gradient, same shape and dtype), ``dx += dz·w_cᵀ``
  into a float32 carry, and ``dw_c = xᵀ·dz`` written into the carried dw."""
  def f(x, w):
    def step(k, carry):
      dx, dw = carry
      w_c = lax.dynamic_slice_in_dim(w, k * cw, cw, 1)
      dz = jnp.dot(x, w_c)
      dx = dx + jnp.dot(dz, w_c.T, preferred_element_type=jnp.float32)
      return dx, lax.dynamic_update_slice_in_dim(dw, jnp.dot(x.T, dz), k * cw, 1)
    init = (jnp.zeros(x.shape, jnp.float32), jnp.zeros((x.shape[1], n * cw), x.dtype))
    return lax.fori_loop(0, n, step, init)
  return jax.jit(f)


def plain_step(y):
  """The plain head's forward and backward (x and w): ``bench.py``'s ``plain_bf16`` row, the baseline of its
  tables."""
  loss = bench._plain_variant("plain_bf16").loss
  return jax.jit(jax.value_and_grad(lambda x, w: loss(x, w, y), (0, 1)))


def products_row(name: str, x, w, y, cw: int, rounds: int) -> dict:
  """The ``--products`` row of one head (see the module's docstring)."""
  (b, h), v = x.shape, w.shape[1]
  widths = [cw * m for m in (1, 2, 4, 8) if cw * m <= v]
  fns = {"forward": (jax.jit(jnp.dot), (x, w)), "plain": (plain_step(y), (x, w))}
  loops = {c: min(LOOP, v // c) for c in widths}
  fns.update({c: (chunk_products(loops[c], c), (x, w)) for c in widths})
  t = interleaved(fns, rounds=rounds)
  per = {c: t[c] / loops[c] for c in widths}  # ms per chunk
  floor = {c: t["forward"] + -(-v // c) * per[c] for c in widths}
  return {"kind": "products", "shape": name, "default": cw, "plain_ms": round(t["plain"], 3),
          "forward_ms": round(t["forward"], 3), "lean_target_ms": round(1.25 * t["plain"], 3),
          "ms_per_chunk": {str(c): round(per[c], 4) for c in widths},
          "tflops": {str(c): round(3 * 2 * b * c * h / per[c] / 1e9, 1) for c in widths},
          "lean_floor_ms": {str(c): round(floor[c], 3) for c in widths},
          "lean_floor_vs_plain": {str(c): round(floor[c] / t["plain"], 3) for c in widths},
          "chunk_bytes": {str(c): b * c * x.dtype.itemsize for c in widths}}


def lean_step(y, width: int | None, interpret: bool, products: str | None = None, token_block: int | None = None):
  """The jitted forward and backward (x and w) of lean mode on the GEMM with ``width`` columns per chunk (None: as
  the op plans); its two chunk products on ``products`` ("gemm" or "xla" for both, "DX/DW" for a pair such as
  "gemm/xla"; None: as the op picks); in blocks of ``token_block`` tokens within each chunk when given."""
  cfg = Config(vocab_chunk=width, products=tuple(products.split("/")) if products and "/" in products else products,
               token_block=token_block)
  loss = lambda x, w: linear_cross_entropy(x, w, y, impl="pallas_mosaic", mode="lean", config=cfg,
                                           interpret=interpret)
  return jax.jit(jax.value_and_grad(loss, (0, 1)))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--shapes", default="gpt2-small,llama3-8b,qwen3-8b,gemma2-2b")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--sweep", action="store_true")
  ap.add_argument("--widths", action="store_true", help="lean's forward and backward at wave-aligned chunk widths")
  ap.add_argument("--chunks", default=None, metavar="W1,W2", help="with --widths: these chunk widths (wider ones "
                  "too) instead of the narrower wave-aligned ones, beside the op's own")
  ap.add_argument("--chunk-products", default=None, metavar="ON1,ON2", help="with --widths: each width once per "
                  "given owner of the chunk's two products (gemm, xla, or a dx/dw pair: gemm/xla), named WIDTH:ON")
  ap.add_argument("--token-blocks", default=None, metavar="T1,T2", help="with --widths: lean mode in blocks of these "
                  "many tokens within each chunk too (both chunk products on the GEMM, the op's width for them)")
  ap.add_argument("--products", action="store_true", help="XLA's chunk products at 1-8x the chunk width, against "
                  "the plain head")
  ap.add_argument("--interpret", action="store_true")
  ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_lean"))
  a = ap.parse_args(argv)
  os.makedirs(a.out, exist_ok=True)
  budget, t0 = float(os.environ.get("BUDGET_S", "400")), time.time()
  kind = G._device_kind()
  meta = {"device": kind, "jax": jax.__version__, "date": datetime.datetime.now(datetime.UTC).isoformat(
      timespec="minutes"), "command": " ".join(sys.argv), "rounds": a.rounds}
  rows, table = [], []

  def emit(**r):
    rows.append(r)
    print(json.dumps(r), flush=True)
    with open(os.path.join(a.out, "bench_lean.json"), "w") as f:
      json.dump({**meta, "rows": rows}, f, indent=1)

  for name in a.shapes.split(","):
    if time.time() - t0 > budget:
      emit(shape=name, skipped="past BUDGET_S")
      continue
    b, h, v = SHAPES[name]
    x, w, y, lse, spec, plans = chunk_inputs(b, h, v, a.interpret)
    cw = plans["lean_dz"].vocab_chunk
    n = min(LOOP, v // cw)
    mnk = (b, cw, h)
    args = (x, w, y, lse)
    fns = {"xla": (looped(bare(cw, False, a.interpret), n, cw), args),
           "gemm": (looped(bare(cw, True, a.interpret), n, cw), args),
           "lean_dz": (looped(op_recompute(spec, plans["lean_dz"]), n, cw), args),
           "kernels_ws": (looped(op_recompute(spec, plans["kernels_ws"]), n, cw), args)}
    outs = {k: fns[k][0](*args) for k in ("lean_dz", "kernels_ws")}  # (the last chunk's dz)
    err = rel_err(outs["lean_dz"], outs["kernels_ws"])
    emit(kind="check", shape=name, chunk=cw, lean_dz_vs_kernels_ws_rel_err=err)
    t = {k: val / n for k, val in interleaved(fns, rounds=a.rounds).items()}  # (per chunk)
    flops = 2 * b * cw * h
    emit(kind="chunk", shape=name, mnk=list(mnk), chunks=-(-v // cw), chunks_timed=n,
         lean_dz_config=tuning.describe("lean_dz", *mnk, kind),
         ms={k: round(val, 4) for k, val in t.items()},
         tflops={k: round(flops / val / 1e9, 1) for k, val in t.items()},
         lean_dz_vs_xla=round(t["xla"] / t["lean_dz"], 3),
         lean_dz_vs_kernels_ws=round(t["kernels_ws"] / t["lean_dz"], 3))
    if a.widths:
      widths = chunk_widths(b, h, cw, kind, _device.num_sms())
      if a.chunks:
        picks = sorted({cw, *(int(c) for c in a.chunks.split(","))}, reverse=True)
        widths = {c: round(chunk_efficiency(b, h, c, kind, _device.num_sms()), 3) for c in picks}
      if a.chunk_products:  # each width once per owner of the chunk products: "WIDTH:ON"
        ons = a.chunk_products.split(",")
        widths = {f"{w_}:{on}": e for w_, e in widths.items() for on in ons}
        fns = {k: (lean_step(y, int(k.split(":")[0]), a.interpret, k.split(":")[1]), (x, w)) for k in widths}
        base = f"{cw}:{ons[0]}"
      else:
        fns, base = {w_: (lean_step(y, w_, a.interpret), (x, w)) for w_ in widths}, cw
      blocks = [int(t) for t in (a.token_blocks or "").split(",") if t]
      # each at the width planned for it; "tb_all": the same pair in one block of all the tokens (token_block=B),
      # so the blocks' gain is told apart from the pair's
      for tb in [*blocks, b] if blocks else []:
        c = op.plan(b, h, v, Config(products="gemm", token_block=tb), interpret=a.interpret, mode="lean").vocab_chunk
        name_tb = "tb_all" if tb == b else f"tb{tb}"
        widths[name_tb] = round(chunk_efficiency(min(tb, b), h, c, kind, _device.num_sms()), 3)
        fns[name_tb] = (lean_step(y, None, a.interpret, "gemm", tb), (x, w))
      # each width's compiled temporaries: what the chunk costs in memory (lean's bound is B·H·4 + 64 MB)
      temp = {w_: f.lower(*fa).compile().memory_analysis().temp_size_in_bytes for w_, (f, fa) in fns.items()}
      ref = {w_: f(*fa) for w_, (f, fa) in fns.items()}
      t = interleaved(fns, rounds=a.rounds)
      bound = op.lean_bound_bytes(b, h)
      emit(kind="widths", shape=name, default=base, wave_efficiency={str(k): e for k, e in widths.items()},
           ms={str(k): round(val, 3) for k, val in t.items()},
           vs_default={str(k): round(t[base] / val, 3) for k, val in t.items()},
           temp_bytes={str(k): temp[k] for k in widths}, lean_bound_bytes=bound,
           over_bound=[str(k) for k in widths if temp[k] > bound],  # (a time bought past lean's memory)
           max_grad_rel_diff=max(rel_err(g, g0) for r in ref.values() for g, g0 in zip(r[1], ref[base][1])))
    if a.products:
      emit(**products_row(name, x, w, y, cw, a.rounds))
    if not a.sweep:
      continue
    cands = {"table": plans["lean_dz"].gemm and tuning.select_config("lean_dz", *mnk, kind)}
    cands.update({c.short(): tuning.fit_role("lean_dz", c) for c in sweep_configs("fwd")})
    # the ping-pong schedules: one warpgroup's epilogue (the logit gradient's exps and its bf16 store) runs while
    # the other's MMAs keep the tensor cores busy
    cands.update({c.short(): tuning.fit_role("lean_dz", c) for c in (
        tuning.PINGPONG_WS, *(dataclasses.replace(tuning.PINGPONG_WS, cluster=d) for d in ("n", "m")))})
    fns = {"xla": fns["xla"]}
    for tag, cfg in cands.items():
      if cfg is not None and time.time() - t0 < budget:
        fns[tag] = (looped(logit_grad_with(cfg, spec, cw), n, cw), args)
        got = fns[tag][0](*args)  # (the last chunk's dz, against the kernels_ws one's)
        emit(kind="check", shape=name, config=tag, rel_err_vs_kernels_ws=rel_err(got, outs["kernels_ws"]))
    t = {k: val / n for k, val in interleaved(fns, rounds=a.rounds).items()}
    best = min((k for k in t if k != "xla"), key=t.get)
    emit(kind="sweep", shape=name, mnk=list(mnk), ms={k: round(val, 4) for k, val in t.items()}, best=best)
    cfg = cands[best]
    table.append({"bucket": list(tuning.bucket(*mnk)), "shape": list(mnk), "config": dataclasses.asdict(cfg),
                  "vs_xla": {"ours_ms": round(t[best], 4), "xla_ms": round(t["xla"], 4)}})
    with open(os.path.join(a.out, "lean_dz_rows.json"), "w") as f:
      json.dump({"date": meta["date"], "devices": {kind: {"lean_dz": table}}}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
