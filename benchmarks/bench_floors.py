"""What the GEMMs allow each head: the plain head, ``auto`` and lean mode beside the head's three bare products,
all in one process.

Every design of this op runs the head's three products (x·w, dz·wᵀ, xᵀ·dz) plus its loss work; lean mode runs a
fourth (the logits recomputed in the backward). So with the GEMMs at hand no fast design can take less than the
three fastest bare products, and no lean one less than those plus a second forward product. Per shape (bf16 in and
out; ``bench.py``'s inputs), in one process:

  heads     ``plain`` (``bench.py``'s ``plain_bf16``: bf16 logits + optax, the baseline of every table), ``auto``
            and, with ``--lean``, ``impl="pallas_mosaic", mode="lean"``: ``value_and_grad`` of x and w, timed in
            alternation before the products and again after them (a row takes the median of both)
  products  each of fwd x·w, dx dz·wᵀ, dw xᵀ·dz bare, timed in alternation: XLA's (cuBLAS), the package's GEMM at
            its tuning table's row, and jax's example ``hopper_matmul_mgpu`` at its two configs that won earlier
            sweeps (operands padded to its tile outside the timing; left out with ``--interpret``)

Each ``floor`` row holds ``floor_ms`` (Σ of the fastest bare product of each role), ``lean_floor_ms`` (that plus the
fastest forward product), each head's time and every ratio to the plain head of the same process
(``*_vs_plain``). Times are medians of ``--rounds`` rounds of 10-run medians around ``block_until_ready``.

    python -m benchmarks.bench_floors [--shapes llama3-8b,llama3-8b-32k,...] [--lean] [--rounds 3] [--out DIR]
    python -m benchmarks.bench_floors --interpret --shapes tiny --rounds 1     # a CPU check of the harness

Shapes: the ``llm`` and ``llm32k`` presets' (``benchmarks/shapes.py``) and ``tiny``. Writes ``DIR/floors.json``
(device, versions, date, ``LCE_FLAX_COMMIT``, rows) after every row and prints one JSON line per row.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import bench, shapes  # noqa: E402
from benchmarks.bench_gemm import interleaved, pad_to, rel_err  # noqa: E402
from lce_flax import linear_cross_entropy  # noqa: E402
from lce_flax._impl.pallas_mosaic import gemm as G  # noqa: E402
from lce_flax._impl.pallas_mosaic import tuning  # noqa: E402

SHAPES = shapes.Named({s.name: s for s in (*shapes.PRESETS["llm"].shapes, *shapes.PRESETS["llm32k"].shapes,
                                           shapes.Shape("tiny", 256, 64, 960))})  # (or any BxHxV)
ROLES = ("fwd", "dx", "dw")
_DG = jax.lax.dot_general


def head_steps(y, lean: bool, interpret: bool, logit_softcap: float | None = None) -> dict:
  """name -> jitted ``value_and_grad`` of x and w (summed loss) of each head (``auto`` is what the device picks: on
  a CPU not a Pallas kernel, so ``interpret`` is lean's alone); ``logit_softcap``: every head caps its logits."""
  cap = logit_softcap
  losses = {"plain": bench._plain_variant("plain_bf16", cap).loss,
            "auto": lambda x, w, y: linear_cross_entropy(x, w, y, reduction="sum", logit_softcap=cap)}
  if lean:
    losses["lean"] = lambda x, w, y: linear_cross_entropy(x, w, y, reduction="sum", impl="pallas_mosaic",
                                                          mode="lean", interpret=interpret, logit_softcap=cap)
  return {name: jax.jit(jax.value_and_grad(lambda x, w, f=f: f(x, w, y), (0, 1))) for name, f in losses.items()}


def product_calls(role: str, x, w, dz, kind: str, interpret: bool, example: bool) -> dict:
  """name -> (jitted call, args) of one product's contenders (bf16 out)."""
  (b, h), v = x.shape, w.shape[1]
  mnk = {"fwd": (b, v, h), "dx": (b, h, v), "dw": (h, v, b)}[role]
  cfg = tuning.select_config(role, *mnk, kind)
  if role == "fwd":
    xla = jax.jit(jnp.dot)
    ours = jax.jit(lambda x, w: G.gemm(x, w, config=cfg, interpret=interpret))
    args, a_mk, b_kn = (x, w), x, w
  elif role == "dx":
    xla = jax.jit(lambda dz, w: _DG(dz, w, (((1,), (1,)), ((), ()))))
    ours = jax.jit(lambda dz, w: G.gemm(dz, w, transpose_b=True, config=cfg, interpret=interpret))
    args, a_mk, b_kn = (dz, w), dz, (w.T if example else None)
  else:
    xla = jax.jit(lambda x, dz: _DG(x, dz, (((0,), (0,)), ((), ()))))
    ours = jax.jit(lambda x, dz: G.gemm(x, dz, transpose_a=True, config=cfg, interpret=interpret))
    args, a_mk, b_kn = (x, dz), (x.T if example else None), dz
  calls = {"xla": (xla, args), "ours": (ours, args)}
  if example:
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm  # noqa: PLC0415
    D = hm.MatmulDimension
    for wg, cl in ((D.M, D.N), (D.N, D.M)):
      ecfg = hm.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4, epi_tile_n=64,
                             epi_tile_m=64, grid_minor_dim=D.N, grid_tile_width=16, wg_dimension=wg,
                             cluster_dimension=cl)
      mm = 128 * (1 + (wg == D.M)) * (1 + (cl == D.M))
      mn = 128 * (1 + (wg == D.N)) * (1 + (cl == D.N))
      calls[f"example wg={wg} cl={cl}"] = (jax.jit(lambda a, b, c=ecfg: hm.matmul(a, b, None, c)),
                                           (pad_to(jnp.asarray(a_mk), 0, mm), pad_to(jnp.asarray(b_kn), 1, mn)))
  return calls


def floor_row(name: str, rounds: int, lean: bool, interpret: bool, example: bool, emit) -> dict:
  """One shape's heads and products (see the module's docstring)."""
  shape = SHAPES[name]
  x, w, y = bench.make_inputs(shape)
  kind = G._device_kind()
  heads = {k: (f, (x, w)) for k, f in head_steps(y, lean, interpret).items()}
  before = interleaved(heads, rounds=rounds)
  # dz: any bf16 [B, V] times the same; the logits themselves, made without a float32 [B, V] (15.7 GiB at 32768
  # tokens, which does not fit beside what the heads left in XLA's allocator)
  dz = jax.jit(jnp.dot)(x, w)
  prods = {}
  for role in ROLES:
    calls = product_calls(role, x, w, dz, kind, interpret, example)
    (f_xla, a_xla), (f_ours, a_ours) = calls["xla"], calls["ours"]
    err = rel_err(f_ours(*a_ours), f_xla(*a_xla))
    t = interleaved(calls, rounds=rounds)
    best = min(t, key=t.get)
    prods[role] = {"ms": {k: round(v, 3) for k, v in t.items()}, "best": best, "best_ms": round(t[best], 3),
                   "tflops": round(2 * shape.B * shape.H * shape.V / t[best] / 1e9, 1),
                   "ours_cfg": tuning.describe(role, *{"fwd": (shape.B, shape.V, shape.H),
                                                       "dx": (shape.B, shape.H, shape.V),
                                                       "dw": (shape.H, shape.V, shape.B)}[role], kind),
                   "ours_rel_err_vs_xla": err}
    del calls
  del dz
  after = interleaved(heads, rounds=rounds)
  head_ms = {k: float(np.median([before[k], after[k]])) for k in heads}
  floor = sum(p["best_ms"] for p in prods.values())
  lean_floor = floor + prods["fwd"]["best_ms"]
  plain = head_ms["plain"]
  row = {"kind": "floor", "shape": name, "B": shape.B, "H": shape.H, "V": shape.V, "products": prods,
         "heads_ms": {k: round(v, 3) for k, v in head_ms.items()},
         "heads_ms_before": {k: round(v, 3) for k, v in before.items()},
         "heads_ms_after": {k: round(v, 3) for k, v in after.items()},
         "floor_ms": round(floor, 3), "lean_floor_ms": round(lean_floor, 3),
         "floor_vs_plain": round(floor / plain, 4), "lean_floor_vs_plain": round(lean_floor / plain, 4),
         **{f"{k}_vs_plain": round(v / plain, 4) for k, v in head_ms.items() if k != "plain"},
         "tflops_for_0.90x": round(6 * shape.B * shape.H * shape.V / (0.9 * plain) / 1e9, 1)}
  emit(**row)
  return row


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--shapes", default="gpt2-small,llama3-8b,qwen3-8b,gemma2-2b,llama3-8b-32k,gemma2-2b-32k")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--lean", action="store_true", help="also lean mode among the heads")
  ap.add_argument("--no-example", action="store_true", help="leave jax's example matmul out")
  ap.add_argument("--interpret", action="store_true", help="Pallas kernels in interpret mode (a CPU check)")
  ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_floors"))
  a = ap.parse_args(argv)
  for name in a.shapes.split(","):
    if name not in SHAPES:
      ap.error(f"--shapes: unknown shape {name!r}; known: {', '.join(SHAPES)}")
  os.makedirs(a.out, exist_ok=True)
  meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "jaxlib": jax.lib.__version__,
          "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"),
          "commit": os.environ.get("LCE_FLAX_COMMIT"), "command": " ".join(sys.argv), "rounds": a.rounds}
  rows: list[dict] = []

  def emit(**r):
    rows.append(r)
    print(json.dumps(r), flush=True)
    with open(os.path.join(a.out, "floors.json"), "w") as f:
      json.dump({**meta, "rows": rows}, f, indent=1)

  emit(kind="meta", **meta)
  for name in a.shapes.split(","):
    try:
      floor_row(name, a.rounds, a.lean, a.interpret, not (a.no_example or a.interpret), emit)
    except Exception as e:  # noqa: BLE001 - one shape's failure (out of memory, say) is a row; the rest still run
      emit(kind="error", shape=name, error=f"{type(e).__name__}: {str(e)[:400]}",
           where=traceback.format_exc(limit=-4)[-1200:])
  return 0 if all(r["kind"] != "error" for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
