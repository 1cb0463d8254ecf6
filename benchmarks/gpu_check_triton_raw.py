"""GPU check of ``impl="triton"`` (raw Triton through jax-triton) against ``impl="pallas_triton"``.

Run on a GPU machine from the repository root (jax-triton installed)::

  PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check_triton_raw.py [--out DIR] [--budget SECONDS]

Sections (each guarded: one that fails records its error and the next runs; the JSON is rewritten after each
section, so a run cut short keeps what it measured; sections stop when the time budget is spent):

1. small ragged shape (B=333, H=200, V=5003), compiled kernels, bf16/fp16/fp32, both layouts, plain and every
   option with a bias, per-token cotangent, vs the float64 oracle;
2. llama3-8b (B=8192, H=4096, V=128256, bf16): per-token loss of 64 rows vs float64 NumPy, summed loss and
   gradients vs the XLA path on float32-upcast inputs at ``highest`` precision;
3. fwd and fwd+bwd times (median of 10 after 2 warm-ups, wall clock around ``block_until_ready``) and compiled
   temp memory of triton and pallas_triton at llama3-8b and gpt2-small (bf16, reduction "sum", grads of x, w);
4. the backward's dz kernels alone (all chunks) at llama3-8b, triton vs pallas_triton;
5. a small sweep of the raw Triton kernels' stages/splits/block_k at llama3-8b;
6. ``ab``: interleaved rounds (each variant timed once per round) of triton and pallas_triton with 3 and 4
   pipeline stages at llama3-8b and gpt2-small; ``ab_more``: the same, two rounds, at qwen3-8b and gemma2-2b.

Writes ``triton_raw_<date>.json`` into ``--out`` (default ``$OUT`` or ``.``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import numpy as np

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from reference_np import linear_cross_entropy_np  # noqa: E402

from lce_flax import _base, _math, linear_cross_entropy, pallas_triton, triton_kernels  # noqa: E402
from benchmarks.gpu_check_triton import inputs, loss_fn, median_ms, ragged_case, run_sections, temp_bytes  # noqa: E402  (shared helpers)

SHAPES = {"llama3-8b": (8192, 4096, 128256), "gpt2-small": (16384, 768, 50304)}
T0 = time.time()
BUDGET = 300.0


def left() -> float:
  return BUDGET - (time.time() - T0)


def section_small(res):
  rng = np.random.default_rng(1)
  cases = [(jnp.bfloat16, "hv", False), (jnp.bfloat16, "vh", False), (jnp.bfloat16, "hv", True),
           (jnp.bfloat16, "vh", True), (jnp.float16, "hv", True), (jnp.float32, "vh", True)]
  rows = []
  for dtype, layout, all_opts in cases:
    opts = dict(label_smoothing=0.05, z_loss=1e-4, logit_softcap=5.0) if all_opts else {}
    rows.append(ragged_case(rng, "triton", dtype, layout, opts, all_opts))
    print("small", rows[-1], flush=True)
  res["small"] = rows


def section_llama(res):
  b, h, v = SHAPES["llama3-8b"]
  x, w, y = inputs(b, h, v, jnp.bfloat16)
  rows = np.sort(np.random.default_rng(0).choice(b, 64, replace=False))
  tok = np.asarray(jax.jit(lambda x, w, y: linear_cross_entropy(x, w, y, reduction="none", impl="triton"))(x, w, y))
  ref = linear_cross_entropy_np(np.asarray(x[rows].astype(jnp.float32), np.float64),
                                np.asarray(w.astype(jnp.float32), np.float64), np.asarray(y)[rows], reduction="none")
  out = dict(token_loss_max_rel_64rows=float(np.max(np.abs(tok[rows] - ref["loss"]) / np.abs(ref["loss"]))))
  loss, grads = jax.jit(jax.value_and_grad(loss_fn("triton"), (0, 1)))(x, w, y)
  with jax.default_matmul_precision("highest"):
    loss_r, grads_r = jax.jit(jax.value_and_grad(loss_fn("xla"), (0, 1)))(x.astype(jnp.float32),
                                                                          w.astype(jnp.float32), y)
  out["loss"] = float(loss)
  out["loss_ref_fp32_highest"] = float(loss_r)
  out["loss_rel"] = abs(float(loss) - float(loss_r)) / abs(float(loss_r))
  for name, g_, r in zip(("dx", "dw"), grads, grads_r):
    out[f"{name}_rel_norm"] = float(jnp.linalg.norm((g_.astype(jnp.float32) - r).ravel()) / jnp.linalg.norm(r.ravel()))
  out["pass"] = bool(out["token_loss_max_rel_64rows"] <= 1e-4 and out["loss_rel"] <= 1e-4
                     and out["dx_rel_norm"] <= 1e-2 and out["dw_rel_norm"] <= 1e-2)
  print("llama", out, flush=True)
  res["llama3_8b_correctness"] = out


def time_one(impl, shape, config=None, label=None):
  b, h, v = SHAPES[shape]
  x, w, y = inputs(b, h, v, jnp.bfloat16)
  f = loss_fn(impl, config)
  fwd = jax.jit(f)
  fb = jax.jit(jax.value_and_grad(f, (0, 1)))
  row = dict(impl=impl, shape=shape, config=label or "default")
  row["fwd_ms"] = median_ms(fwd, x, w, y)
  row["fwdbwd_ms"] = median_ms(fb, x, w, y)
  row["fwd_temp_mb"] = (temp_bytes(f, x, w, y) or 0) / 1e6
  row["fwdbwd_temp_mb"] = (temp_bytes(jax.value_and_grad(f, (0, 1)), x, w, y) or 0) / 1e6
  row["loss"] = float(fwd(x, w, y))
  print("time", row, flush=True)
  return row


def section_timings(res):
  rows = res.setdefault("timings", [])
  for shape in ("llama3-8b", "gpt2-small"):
    for impl in ("triton", "pallas_triton"):
      if left() < 20:
        return
      try:
        rows.append(time_one(impl, shape))
      except Exception as e:  # noqa: BLE001
        rows.append(dict(impl=impl, shape=shape, error=repr(e)[:2000]))
        print("time error", impl, shape, repr(e)[:400], flush=True)


def section_dz_split(res):
  b, h, v = SHAPES["llama3-8b"]
  x, w, y = inputs(b, h, v, jnp.bfloat16)
  spec = _base.Spec(_math.LossOptions(v), interpret=False)
  lse = jnp.full((b,), 12.0, jnp.float32)
  ones = jnp.ones((b,), jnp.float32)
  out = {}
  for name, mod, kernels in (("triton", triton_kernels, triton_kernels.KERNELS),
                             ("pallas_triton", pallas_triton, pallas_triton.PALLAS_KERNELS)):
    p = mod.plan(b, h, v, x.dtype)
    c = p.chunk_size

    @jax.jit
    def loop(x, w, y, p=p, c=c, kernels=kernels):
      def body(k, acc):
        dz, _ = kernels.dz_chunk(k, c, x, w, None, y, lse, ones, ones, spec, p)
        return acc + dz[0, 0].astype(jnp.float32)
      return jax.lax.fori_loop(0, v // c, body, jnp.float32(0))
    out[f"{name}_dz_kernels_ms"] = median_ms(loop, x, w, y, iters=5)
    out[f"{name}_chunks"] = v // c
  out["tflops_note"] = "2·B·H·(V//chunk·chunk) FLOP per loop"
  print("dz split", out, flush=True)
  res["dz_split_llama3_8b"] = out


def section_sweep(res):
  C = triton_kernels.Config
  variants = [("stages3", C(num_stages=3)), ("splits8", C(num_splits=8)), ("bk128_stages2", C(block_k=128, num_stages=2)),
              ("bwd_stages3", C(bwd_num_stages=3)), ("chunk4096", C(chunk_size=4096))]
  rows = res.setdefault("sweep_llama3_8b", [])
  for label, cfg in variants:
    if left() < 25:
      return
    try:
      rows.append(time_one("triton", "llama3-8b", cfg, label))
    except Exception as e:  # noqa: BLE001
      rows.append(dict(config=label, error=repr(e)[:2000]))
      print("sweep error", label, repr(e)[:400], flush=True)
  if left() > 25:
    try:
      rows.append(time_one("pallas_triton", "llama3-8b", pallas_triton.Config(num_stages=3), "pallas stages3"))
    except Exception as e:  # noqa: BLE001
      rows.append(dict(config="pallas stages3", error=repr(e)[:2000]))


def section_ab(res, shapes=("llama3-8b", "gpt2-small"), rounds=5, key="ab"):
  """Interleaved rounds: every variant is timed once per round, so drifts of the machine hit all alike."""
  variants = [("triton", None, "triton default (3 stages)"),
              ("pallas_triton", None, "pallas_triton default"),
              ("triton", triton_kernels.Config(num_stages=4), "triton 4 stages"),
              ("pallas_triton", pallas_triton.Config(num_stages=3), "pallas_triton 3 stages")]
  out = res.setdefault(key, {})
  for shape in shapes:
    b, h, v = SHAPES[shape]
    x, w, y = inputs(b, h, v, jnp.bfloat16)
    fns = []
    for impl, cfg, label in variants:
      f = loss_fn(impl, cfg)
      fns.append((label, jax.jit(f), jax.jit(jax.value_and_grad(f, (0, 1)))))
      out.setdefault(shape, {}).setdefault(label, {"fwd_ms": [], "fwdbwd_ms": []})
    for r in range(rounds):
      if left() < 20:
        break
      for label, fwd, fb in fns:
        out[shape][label]["fwd_ms"].append(median_ms(fwd, x, w, y, iters=10, warmup=2 if r == 0 else 1))
        out[shape][label]["fwdbwd_ms"].append(median_ms(fb, x, w, y, iters=10, warmup=2 if r == 0 else 1))
    for label, d in out[shape].items():
      d["fwd_median_of_rounds"] = float(np.median(d["fwd_ms"])) if d["fwd_ms"] else None
      d["fwdbwd_median_of_rounds"] = float(np.median(d["fwdbwd_ms"])) if d["fwdbwd_ms"] else None
      print("ab", shape, label, {k: v for k, v in d.items() if "median" in k}, flush=True)
    del x, w, y, fns


def section_ab_more(res):
  SHAPES.update({"qwen3-8b": (4096, 4096, 151936), "gemma2-2b": (8192, 2304, 256000)})
  section_ab(res, shapes=("qwen3-8b", "gemma2-2b"), rounds=2, key="ab_more")


def main():
  global BUDGET
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  ap.add_argument("--budget", type=float, default=BUDGET)
  ap.add_argument("--sections", default="small,llama,timings,dz_split,sweep")
  ap.add_argument("--tag", default="", help="suffix of the JSON file name")
  args = ap.parse_args()
  BUDGET = args.budget
  import triton  # pylint: disable=g-import-not-at-top
  try:
    import jax_triton  # pylint: disable=g-import-not-at-top
    jt_version = jax_triton.__version__
  except Exception as e:  # noqa: BLE001
    jt_version = f"unavailable: {e!r}"
  dev = jax.devices()[0]
  res = dict(device=str(getattr(dev, "device_kind", dev)), jax=jax.__version__, triton=triton.__version__,
             jax_triton=jt_version, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             inputs="bf16 x~N(0,1), w=0.02·N(0,1), uniform labels, reduction sum, grads of x and w",
             timing="median of 10 after 2 warm-ups, wall clock around block_until_ready; temp = compiled temp size")
  print(res, flush=True)
  path = os.path.join(args.out, f"triton_raw_{datetime.date.today().isoformat()}{args.tag}.json")
  sections = dict(small=section_small, llama=section_llama, timings=section_timings, dz_split=section_dz_split,
                  sweep=section_sweep, ab=section_ab, ab_more=section_ab_more)
  run_sections(res, sections, args.sections.split(","), path, left, min_left_s=15)
  print("wrote", path, "total", round(time.time() - T0, 1), "s", flush=True)


if __name__ == "__main__":
  main()
