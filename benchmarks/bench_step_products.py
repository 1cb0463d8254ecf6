"""The op's whole step with each pair of backward products, beside the plain head (one GPU): the tuning table's
``steps`` rows.

The backward products dx = dz·wᵀ and dw = xᵀ·dz run on the package's GEMM or on XLA's (cuBLAS). Timed alone, in
alternation, ours measured faster at most LLM heads; inside the op's step, whose GEMMs run back to back at the
GPU's power limit, the order can differ (``benchmarks/probe_clocks.py``). So per shape this times, in alternation
(median of ``--rounds`` rounds of 10-run medians), ``value_and_grad`` of x and w (summed loss) of

  plain       the plain head (``bench.py``'s ``plain_bf16``)
  dx,dw       ``impl="pallas_mosaic", mode="fast"`` with ``PallasMosaicConfig(products=(dx, dw))``, each of
              ``gemm,gemm``, ``gemm,xla``, ``xla,gemm``, ``xla,xla`` (the design the op picks at that shape)

and writes a row of the table's ``"steps"`` (:func:`lce_flax._impl.pallas_mosaic.tuning.load_steps`): the design,
the bucket, the fastest pair, every time and each step's compiled temporaries (``temp_gb``). With ``--mode lean``
the same for lean mode (design "recompute"), whose pair is each vocabulary chunk's dx (added into the float32 dx)
and dw, with its bound (lean mode is held to B·H·4 + 64 MB: the row's pair is the fastest of those whose step held
no more, ``over_bound`` names the others) and each pair's chunk width (``vocab_chunk``: the op
plans wider chunks for the pair on the GEMM, whose products take the chunk in place); ``--widths W1,W2`` times each
pair at those narrower widths too (those below the width the op plans for it, whole CTA tiles: a width whose
products fill the GPU's waves better can be the faster), and the row keeps each pair's fastest width (its time,
``vocab_chunk`` and ``temp_gb``; every width's time in ``width_ms``; the blocks of tokens each pair ran within its
chunks in ``token_block``), which the op then runs with that pair where it runs the same blocks.

    python3 -m benchmarks.bench_step_products [--shapes llama3-8b,qwen3-8b] [--rounds 7] [--mode lean] [--out DIR]
    python3 -m benchmarks.bench_step_products --mode lean --widths 3072,3328 --shapes llama3-8b,gemma2-2b
    python3 -m benchmarks.bench_step_products --mode lean --pairs gemm,gemm --widths 1536,2048 --blocks 4096,2048 \
        --shapes llama3-8b-32k                                          # lean's blocks of tokens, with the widths
    python3 -m benchmarks.bench_step_products --merge DIR/steps.json     # into the package's table (tuning_table)
    python3 -m benchmarks.bench_step_products --check [--shapes ...]     # then: plain against auto, as it now runs
    python3 -m benchmarks.bench_step_products --check --logit-softcap 30 --shapes gemma2-2b   # both heads capped
    python3 -m benchmarks.bench_step_products --chunks 4096,8192 --shapes llama3-8b-32k   # the "tokens" design's chunk
    python3 -m benchmarks.bench_step_products --interpret --shapes tiny --rounds 1   # a CPU check

Writes ``DIR/results.json`` (device, versions, date, ``LCE_FLAX_COMMIT``, rows) and ``DIR/steps.json`` (the rows
under the device's kind) after every shape.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import bench, tuning_table  # noqa: E402
from benchmarks.bench_floors import SHAPES, head_steps  # noqa: E402
from benchmarks.bench_gemm import interleaved, save_probe  # noqa: E402
from lce_flax import PallasMosaicConfig, explain, linear_cross_entropy  # noqa: E402
from lce_flax._impl.pallas_mosaic import op, tuning  # noqa: E402

PAIRS = (("gemm", "gemm"), ("gemm", "xla"), ("xla", "gemm"), ("xla", "xla"))


def fast_step(y, config: PallasMosaicConfig, interpret: bool, mode: str = "fast"):
  """The jitted ``value_and_grad`` of x and w (summed loss) of ``impl="pallas_mosaic"`` in ``mode`` with
  ``config``, and the keywords it calls the op with."""
  kw = dict(reduction="sum", impl="pallas_mosaic", mode=mode, config=config, interpret=interpret)
  return jax.jit(jax.value_and_grad(lambda x, w: linear_cross_entropy(x, w, y, **kw), (0, 1))), kw


def pair_step(y, pair, interpret: bool, mode: str = "fast", vocab_chunk: int | None = None,
              token_block: int | None = None):
  """:func:`fast_step` with the backward products ``pair`` (``PallasMosaicConfig.products``), lean mode's chunks
  of ``vocab_chunk`` columns and blocks of ``token_block`` tokens when given."""
  return fast_step(y, PallasMosaicConfig(products=pair, vocab_chunk=vocab_chunk, token_block=token_block),
                   interpret, mode)


def step_row(name: str, rounds: int, interpret: bool, mode: str = "fast", pairs=PAIRS, widths_asked=(),
             blocks_asked=()) -> dict:
  """One shape's times and its ``steps`` row with each pair's compiled temporaries (lean mode's also with each
  pair's chunk width and its bound), of the ``pairs`` timed; in lean mode each pair also at the ``widths_asked``
  below its own, and the GEMM's pair in each of the ``blocks_asked`` blocks of tokens at every width asked,
  keeping its fastest within lean's bound."""
  x, w, y = bench.make_inputs(SHAPES[name])
  b, h = x.shape
  v = w.shape[1]
  calls = {"plain": (head_steps(y, False, interpret)["plain"], (x, w))}
  design = block_t = None
  mem, widths, blocks, asked = {}, {}, {}, {}  # (asked: the blocks of a variant timed at --blocks)
  for pair in pairs:
    f, kw = pair_step(y, pair, interpret, mode)
    d = explain(x, w, y, **kw)
    design, block_t = d.config.fast_design or d.name, d.config.block_t
    own, step = d.config.vocab_chunk, d.config.block_v * (2 if d.config.warp_specialized else 1)
    blocks[",".join(pair)] = d.config.token_block  # (each width of the pair runs the blocks it runs)
    tried = [None] + sorted({c for c in widths_asked if mode == "lean" and c < own and c % step == 0}, reverse=True)
    for c in tried:  # (each pair at the chunk width the op plans for it, then at the narrower ones asked)
      key = ",".join(pair) + ("" if c is None else f"@{c}")
      g = f if c is None else pair_step(y, pair, interpret, mode, c)[0]
      g = g.lower(x, w).compile()  # (timed as compiled here: one compile gives its temporaries and its calls)
      mem[key] = round(g.memory_analysis().temp_size_in_bytes / 1e9, 4)
      if mode == "lean":
        widths[key] = own if c is None else c
      calls[key] = (g, (x, w))
    for tb in (blocks_asked if mode == "lean" and pair == ("gemm", "gemm") else ()):
      for c in sorted({c for c in widths_asked if c % step == 0}, reverse=True):  # (wider than its own too)
        key = ",".join(pair) + f"@{c}/tb{tb}"
        g = pair_step(y, pair, interpret, mode, c, tb)[0].lower(x, w).compile()
        mem[key], widths[key], asked[key] = round(g.memory_analysis().temp_size_in_bytes / 1e9, 4), c, tb
        calls[key] = (g, (x, w))
  t = interleaved(calls, rounds=rounds)
  bound_gb = round(op.lean_bound_bytes(b, h) / 1e9, 4)
  over_of = lambda k: mode == "lean" and mem[k] > bound_gb
  own_block = dict(blocks)
  label = lambda k: str(widths[k]) + (f"/tb{asked[k]}" if k in asked else "")
  width_ms = {}
  for key in [k for k in t if "@" in k]:  # each pair's fastest width (and blocks) within the bound stands for it
    pair_key = key.split("@")[0]
    width_ms.setdefault(pair_key, {label(pair_key): round(t[pair_key], 3)})
    width_ms[pair_key][label(key)] = round(t[key], 3)
    if (over_of(key), t[key]) < (over_of(pair_key), t[pair_key]):
      t[pair_key], mem[pair_key], widths[pair_key] = t[key], mem[key], widths[key]
      blocks[pair_key] = asked.get(key, own_block[pair_key])  # (a narrower width runs the pair's own blocks)
    for d_ in (t, mem, widths, asked):
      d_.pop(key, None)
  over = [k for k in mem if over_of(k)]  # (lean mode holds B·H·4 + 64 MB)
  # the fastest pair within the bound (none within it: the fastest, and the table's merge refuses the row)
  best = min((k for k in t if k != "plain"), key=lambda k: (over_of(k), t[k]))
  rows = -(-b // block_t) * block_t  # (the op's rows: tokens padded to its row tile, as its lookup takes them)
  row = {"design": design, "bucket": list(tuning.bucket(rows, h, v)), "shape": [b, h, v], "name": name,
         "products": best.split(","), "ms": {k: round(s, 3) for k, s in t.items()},
         "source": f"benchmarks/bench_step_products.py, {rounds} alternated rounds"}
  row.update(temp_gb=mem, vs_plain={k: round(s / t["plain"], 3) for k, s in t.items() if k != "plain"})
  if mode == "lean":
    row.update(vocab_chunk=widths, token_block=blocks, temp_bound_gb=bound_gb, over_bound=over)
  if width_ms:
    row["width_ms"] = width_ms
  return row


def queued_ms(f, args, calls: int = 10) -> float:
  """ms per call of ``calls`` calls queued back to back (JAX's asynchronous dispatch) and one wait at the end: the
  device's time per call without the host's round trip between calls (~0.6 ms on the H100 machines), as inside a
  jitted train step, where nothing waits for the head."""
  jax.block_until_ready(f(*args))
  t = time.perf_counter()
  outs = [f(*args) for _ in range(calls)]
  jax.block_until_ready(outs)
  return 1e3 * (time.perf_counter() - t) / calls


def check_row(name: str, rounds: int, interpret: bool, logit_softcap: float | None = None) -> dict:
  """``--check``: the plain head against ``auto`` as the table now picks it, in alternation, and the pair it ran;
  each call waited for (``ms``, as every table here) and ten calls queued (``ms_queued``, :func:`queued_ms`).
  ``logit_softcap``: both heads cap their logits (Gemma 2's head: 30)."""
  x, w, y = bench.make_inputs(SHAPES[name])
  heads = head_steps(y, False, interpret, logit_softcap)
  d = explain(x, w, y, reduction="sum", logit_softcap=logit_softcap)
  t = interleaved({k: (heads[k], (x, w)) for k in ("plain", "auto")}, rounds=rounds)
  q = {k: [] for k in ("plain", "auto")}
  for _ in range(rounds):
    for k in q:
      q[k].append(queued_ms(heads[k], (x, w)))
  q = {k: float(np.median(v)) for k, v in q.items()}
  return {"name": name, "logit_softcap": logit_softcap, "impl": d.impl,
          "design": getattr(d.config, "fast_design", None),
          "products": list(getattr(d.config, "products", None) or ()), "ms": {k: round(s, 3) for k, s in t.items()},
          "auto_vs_plain": round(t["auto"] / t["plain"], 3), "ms_queued": {k: round(s, 3) for k, s in q.items()},
          "auto_vs_plain_queued": round(q["auto"] / q["plain"], 3)}


def temp_bytes(f, args) -> int:
  """The compiled step's extra device memory beyond its inputs and outputs (XLA's temp allocation)."""
  return int(f.lower(*args).compile().memory_analysis().temp_size_in_bytes)


def chunk_row(name: str, chunks: list[int], rounds: int, interpret: bool) -> dict:
  """``--chunks``: the "tokens" design at each chunk of ``chunks`` tokens (``PallasMosaicConfig(token_chunk=c)``, its
  products as the table picks them) against the plain head, in alternation, with each step's extra memory. A plain
  head that does not fit (gemma2-2b at 32768 tokens on an 80 GB GPU) is recorded as its error and left out."""
  x, w, y = bench.make_inputs(SHAPES[name])
  calls, mem, errors, products = {}, {}, {}, {}
  for c in chunks:
    f, kw = fast_step(y, PallasMosaicConfig(fast_design="tokens", token_chunk=c), interpret)
    products[str(c)] = list(explain(x, w, y, **kw).config.products)
    calls[str(c)], mem[str(c)] = (f, (x, w)), temp_bytes(f, (x, w))
  plain = head_steps(y, False, interpret)["plain"]
  try:
    mem["plain"] = temp_bytes(plain, (x, w))
    jax.block_until_ready(plain(x, w))
    calls["plain"] = (plain, (x, w))
  except Exception as e:  # noqa: BLE001 (recorded in the row: out of memory at the largest heads)
    errors["plain"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
  t = interleaved(calls, rounds=rounds)
  row = {"name": name, "shape": [*x.shape, w.shape[1]],
         "products": products, "ms": {k: round(s, 3) for k, s in t.items()},
         "temp_gb": {k: round(b / 1e9, 3) for k, b in mem.items()}, "errors": errors}
  if "plain" in t:
    row["vs_plain"] = {k: round(s / t["plain"], 3) for k, s in t.items() if k != "plain"}
  return row


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--shapes", default="qwen3-8b,llama3-8b,gemma2-2b,gpt2-small")
  ap.add_argument("--rounds", type=int, default=7)
  ap.add_argument("--interpret", action="store_true", help="the kernels interpreted (a CPU check)")
  ap.add_argument("--merge", metavar="STEPS_JSON", help="merge a steps.json into the package's table, and stop")
  ap.add_argument("--check", action="store_true", help="only the plain head against auto as the table picks it "
                  "(rows into DIR/results.json)")
  ap.add_argument("--chunks", metavar="C1,C2", help="only the \"tokens\" design at these chunks of tokens against "
                  "the plain head, with each step's extra memory (rows into DIR/results.json)")
  ap.add_argument("--mode", choices=("fast", "lean"), default="fast", help="the op's mode whose steps rows to "
                  "time (lean: design \"recompute\", each chunk's products)")
  ap.add_argument("--widths", metavar="W1,W2", help="with --mode lean: each pair also at these chunk widths (those "
                  "below its own), the row keeping its fastest")
  ap.add_argument("--blocks", metavar="T1,T2", help="with --mode lean and --widths: the GEMM's pair also in blocks "
                  "of these many tokens at every width asked (wider than its own too), the row keeping the fastest "
                  "within lean's bound")
  ap.add_argument("--pairs", metavar="DX,DW;DX,DW", help="only these pairs of backward products (default: all four)")
  ap.add_argument("--logit-softcap", type=float, default=None, help="with --check: both heads cap their logits "
                  "(Gemma 2's head: 30)")
  ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_step_products"))
  a = ap.parse_args(argv)
  if a.logit_softcap is not None and not a.check:
    raise SystemExit("--logit-softcap goes with --check")
  if a.mode == "lean" and (a.check or a.chunks):
    raise SystemExit("--mode lean times the steps rows only (not --check or --chunks)")
  if a.widths and a.mode != "lean":
    raise SystemExit("--widths goes with --mode lean (the fast designs have no vocabulary chunks)")
  if a.blocks and not a.widths:
    raise SystemExit("--blocks goes with --mode lean and --widths (the widths to run each block at)")
  pairs = PAIRS if not a.pairs else tuple(tuple(p.split(",")) for p in a.pairs.split(";"))
  if any(p not in PAIRS for p in pairs):
    raise SystemExit(f"--pairs {a.pairs!r}: each pair is two of gemm, xla (e.g. 'gemm,gemm;xla,xla')")
  if a.merge:
    print(tuning_table.merge(a.merge))
    return 0
  kind = jax.devices()[0].device_kind
  rows = []
  for name in a.shapes.split(","):
    if a.chunks:
      r = chunk_row(name, [int(c) for c in a.chunks.split(",")], a.rounds, a.interpret)
    else:
      r = (check_row(name, a.rounds, a.interpret, a.logit_softcap) if a.check
           else step_row(name, a.rounds, a.interpret, a.mode, pairs,
                         widths_asked=[int(c) for c in (a.widths or "").split(",") if c],
                         blocks_asked=[int(c) for c in (a.blocks or "").split(",") if c]))
    rows.append(r)
    print(json.dumps(r), flush=True)
    save_probe(a.out, rows, a.rounds)
    if a.check or a.chunks:
      continue
    with open(os.path.join(a.out, "steps.json"), "w") as f:
      json.dump({"steps": {kind: rows}}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
