"""GPU check of ``impl="pallas_mosaic"``: compile + correctness of variants, then timings at the anchor shapes.

Run on an SM90 GPU from the repository root: ``PYTHONPATH=. python3 benchmarks/gpu_check_mosaic.py [--quick]``.
Writes ``$OUT/pallas_mosaic_gpu.json`` (or ``./pallas_mosaic_gpu.json``) after every step, so a crash or a hang
late in the run keeps what came before, and prints a short table last.

Sections, most important first (a CUDA fault poisons the process, so risky variants come last):
  1. correctness at a ragged medium shape for the default kernel (both layouts, bias, options) against the xla
     implementation on float32-upcast inputs, per-token cotangents on loss and lse;
  2. llama3-8b (8192×4096×128256 bf16): the bf16 matmul, the Mosaic forward, forward+backward (lean), per-kernel
     times of one backward chunk, loss/grad errors against the xla implementation, chunked fast as a same-lease anchor;
  3. backward chunk sizes; the other anchor shapes, forward and forward+backward;
  4. variants of the forward at llama3-8b (splits, stages, block_t, the one-warpgroup kernel).
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp

from lce_flax import _base, _device, _math, linear_cross_entropy
from lce_flax import pallas_mosaic as pm

T0 = time.time()
BUDGET_S = float(os.environ.get("BUDGET_S", 380))
OUT = os.environ.get("OUT", ".")
RES: dict = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "jax": jax.__version__,
             "device": str(jax.devices()[0].device_kind), "correctness": [], "timing": [], "errors": []}
SHAPES = {"gpt2-small": (16384, 768, 50304), "llama3-8b": (8192, 4096, 128256), "qwen3-8b": (4096, 4096, 151936),
          "gemma2-2b": (8192, 2304, 256000)}


def save():
  RES["elapsed_s"] = round(time.time() - T0, 1)
  with open(os.path.join(OUT, "pallas_mosaic_gpu.json"), "w") as f:
    json.dump(RES, f, indent=1)


def left() -> float:
  return BUDGET_S - (time.time() - T0)


def rel(a, b) -> float:
  a = jnp.asarray(a, jnp.float32)
  b = jnp.asarray(b, jnp.float32)
  return float(jnp.linalg.norm((a - b).ravel()) / jnp.maximum(jnp.linalg.norm(b.ravel()), 1e-30))


def bench(f, *args, iters=10):
  """(compile s, median ms) of a jitted f; wall clock around block_until_ready."""
  t = time.time()
  jax.block_until_ready(f(*args))
  comp = time.time() - t
  jax.block_until_ready(f(*args))
  ts = []
  for _ in range(iters):
    t = time.time()
    jax.block_until_ready(f(*args))
    ts.append((time.time() - t) * 1e3)
  return comp, statistics.median(ts)


def temp_bytes(f, *args) -> int | None:
  try:
    return int(f.lower(*args).compile().memory_analysis().temp_size_in_bytes)
  except Exception:  # memory analysis unavailable
    return None


def step(name):
  def deco(fn):
    def run(*a, **k):
      if left() < 20:
        RES["errors"].append(f"{name}: skipped (time budget)")
        return None
      try:
        return fn(*a, **k)
      except Exception as e:  # keep going: later sections are independent
        RES["errors"].append(f"{name}: {type(e).__name__}: {str(e)[:600]}")
        traceback.print_exc()
        return None
      finally:
        save()
    return run
  return deco


def inputs(b, h, v, layout, dtype=jnp.bfloat16, bias=False, seed=0, wscale=0.02):
  k = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(k[0], (b, h), jnp.float32).astype(dtype)
  w = (wscale * jax.random.normal(k[1], (h, v) if layout == "hv" else (v, h), jnp.float32)).astype(dtype)
  y = jax.random.randint(k[2], (b,), 0, v)
  y = jnp.where(jax.random.uniform(k[3], (b,)) < 0.1, -100, y)
  bb = (0.1 * jax.random.normal(k[3], (v,), jnp.float32)) if bias else None
  return x, w, y, bb


@step("correctness")
def correctness(name, b, h, v, layout, dtype=jnp.bfloat16, bias=False, config=None, **opts):
  x, w, y, bb = inputs(b, h, v, layout, dtype, bias, wscale=0.3 if b < 4096 else 0.02)
  k = jax.random.split(jax.random.key(7), 2)
  c1 = jax.random.normal(k[0], (b,))
  c2 = 0.3 * jax.random.normal(k[1], (b,))

  def f(impl, x, w, bb):
    _, aux = linear_cross_entropy(x, w, y, bias=bb, reduction="none", w_layout=layout, impl=impl, return_aux=True,
                                  mode="lean", config=config if impl == "pallas_mosaic" else None, **opts)
    return jnp.sum(c1 * aux.token_loss) + jnp.sum(c2 * aux.lse), aux

  g = jax.jit(jax.value_and_grad(lambda *a: f("pallas_mosaic", *a), (0, 1, 2) if bias else (0, 1), has_aux=True))
  args = (x, w, bb)
  (val, aux), grads = g(*args)
  up = lambda a: None if a is None else a.astype(jnp.float32)
  # the kernels see bf16-rounded operands for fp32 inputs: compare with the xla path on exactly those
  if dtype == jnp.float32:
    xr, wr = up(x.astype(jnp.bfloat16)), up(w.astype(jnp.bfloat16))
  else:
    xr, wr = up(x), up(w)
  gr = jax.jit(jax.value_and_grad(lambda *a: f("xla", *a), (0, 1, 2) if bias else (0, 1), has_aux=True))
  (rval, raux), rgrads = gr(xr, wr, up(bb))
  row = dict(name=name, shape=[b, h, v], layout=layout, dtype=jnp.dtype(dtype).name, bias=bias, opts=opts,
             loss_rel=rel(aux.token_loss, raux.token_loss), lse_rel=rel(aux.lse, raux.lse),
             dx_rel=rel(grads[0], rgrads[0]), dw_rel=rel(grads[1], rgrads[1]),
             db_rel=rel(grads[2], rgrads[2]) if bias else None,
             finite=bool(jnp.isfinite(aux.token_loss).all()))
  RES["correctness"].append(row)
  print("CORRECT", row, flush=True)


def timing_row(**row):
  RES["timing"].append(row)
  print("TIME", row, flush=True)


@step("llama3")
def llama3(layout="vh"):
  b, h, v = SHAPES["llama3-8b"]
  x, w, y, _ = inputs(b, h, v, layout)
  mm = jax.jit(lambda x, w: _base.logits(x, w, layout).astype(jnp.bfloat16))
  _, t_mm = bench(mm, x, w)
  timing_row(shape="llama3-8b", layout=layout, what="xla bf16 matmul x@w", ms=t_mm)
  fwd = jax.jit(lambda x, w: linear_cross_entropy(x, w, y, w_layout=layout, impl="pallas_mosaic", mode="lean",
                                                  reduction="none", return_aux=True))
  comp, t_f = bench(fwd, x, w)
  timing_row(shape="llama3-8b", layout=layout, what="mosaic forward (loss+lse)", ms=t_f, compile_s=comp,
             vs_matmul=t_f / t_mm)
  loss = lambda impl, mode: jax.jit(jax.value_and_grad(
      lambda x, w: linear_cross_entropy(x, w, y, w_layout=layout, impl=impl, mode=mode, reduction="sum"), (0, 1)))
  fb = loss("pallas_mosaic", "lean")
  comp, t_fb = bench(fb, x, w, iters=5)
  timing_row(shape="llama3-8b", layout=layout, what="mosaic lean fwd+bwd", ms=t_fb, compile_s=comp,
             temp_gb=(temp_bytes(fb, x, w) or 0) / 1e9, tflops=8 * b * h * v / t_fb / 1e9)
  # per-kernel times of one backward chunk
  p = pm.plan(b, h, v)
  spec = _base.Spec(_math.LossOptions(v), layout, _device.default_interpret())
  xp, wp, bp, yp, d = pm._prepare(x, w, None, y, spec, p)
  lse = jnp.zeros((d.b,), jnp.float32) + 12.0
  coef = jnp.ones((d.b,), jnp.float32)
  w_c = _base.slice_vocab(wp, 0, p.chunk_size, layout)
  dzf = pm._dz_chunk_ws if p.warp_specialized else pm._dz_chunk
  dzk = jax.jit(lambda xp, w_c: dzf(xp, w_c, None, yp, lse, coef, coef, coef * 0, d, p, spec.opts))
  _, t_dz = bench(dzk, xp, w_c)
  dz = dzk(xp, w_c)
  _, t_gw = bench(jax.jit(lambda xp, dz: _base.grad_w(xp, dz, layout).astype(jnp.bfloat16)), xp, dz)
  _, t_gx = bench(jax.jit(lambda dz, w_c: _base.grad_x(dz, w_c, layout)), dz, w_c)
  n = -(-v // p.chunk_size)
  timing_row(shape="llama3-8b", layout=layout, what=f"bwd chunk {p.chunk_size}: dz kernel / dw mm / dx mm (ms)",
             ms=[t_dz, t_gw, t_gx], times_chunks=n, est_bwd_ms=n * (t_dz + t_gw + t_gx))
  if layout == "vh":
    # errors at scale against the xla implementation (fp32 logits of the same bf16 inputs)
    (l1, g1) = fb(x, w)
    (l0, g0) = loss("xla", "lean")(x, w)
    timing_row(shape="llama3-8b", layout=layout, what="errors vs xla", loss_rel=abs(float(l1 - l0)) / abs(float(l0)),
               dx_rel=rel(g1[0], g0[0]), dw_rel=rel(g1[1], g0[1]), loss=float(l1), loss_xla=float(l0))
    del g0, g1


@step("shape")
def other_shape(name, layout="vh"):
  b, h, v = SHAPES[name]
  x, w, y, _ = inputs(b, h, v, layout)
  _, t_mm = bench(jax.jit(lambda x, w: _base.logits(x, w, layout).astype(jnp.bfloat16)), x, w)
  fwd = jax.jit(lambda x, w: linear_cross_entropy(x, w, y, w_layout=layout, impl="pallas_mosaic", mode="lean",
                                                  reduction="none", return_aux=True))
  _, t_f = bench(fwd, x, w)
  fb = jax.jit(jax.value_and_grad(lambda x, w: linear_cross_entropy(x, w, y, w_layout=layout, impl="pallas_mosaic",
                                                                    mode="lean", reduction="sum"), (0, 1)))
  _, t_fb = bench(fb, x, w, iters=5)
  timing_row(shape=name, layout=layout, what="matmul / mosaic fwd / mosaic lean fwd+bwd", ms=[t_mm, t_f, t_fb],
             temp_gb=(temp_bytes(fb, x, w) or 0) / 1e9, tflops_fb=8 * b * h * v / t_fb / 1e9)


@step("bwd variant")
def fb_variant(config: pm.Config, layout="vh"):
  b, h, v = SHAPES["llama3-8b"]
  x, w, y, _ = inputs(b, h, v, layout)
  fb = jax.jit(jax.value_and_grad(lambda x, w: linear_cross_entropy(
      x, w, y, w_layout=layout, impl="pallas_mosaic", mode="lean", reduction="sum", config=config), (0, 1)))
  comp, t_fb = bench(fb, x, w, iters=5)
  timing_row(shape="llama3-8b", layout=layout, what=f"lean fwd+bwd variant {config}", ms=t_fb, compile_s=comp,
             temp_gb=(temp_bytes(fb, x, w) or 0) / 1e9)


@step("variant")
def fwd_variant(config: pm.Config, layout="vh"):
  b, h, v = SHAPES["llama3-8b"]
  x, w, y, _ = inputs(b, h, v, layout)
  fwd = jax.jit(lambda x, w: linear_cross_entropy(x, w, y, w_layout=layout, impl="pallas_mosaic", mode="lean",
                                                  reduction="none", return_aux=True, config=config))
  comp, t_f = bench(fwd, x, w)
  ref = jax.jit(lambda x, w: linear_cross_entropy(x, w, y, w_layout=layout, impl="pallas_mosaic", mode="lean",
                                                  reduction="none", return_aux=True))(x, w)
  timing_row(shape="llama3-8b", layout=layout, what=f"forward variant {config}", ms=t_f, compile_s=comp,
             lse_rel_vs_default=rel(fwd(x, w)[1].lse, ref[1].lse))


def main():
  quick = "--quick" in sys.argv
  correctness("vh plain ragged", 1000, 512, 5003, "vh")
  correctness("hv bias ragged", 1000, 512, 5003, "hv", bias=True)
  correctness("vh all options", 777, 256, 4096, "vh", bias=True, label_smoothing=0.1, z_loss=1e-3,
              logit_softcap=30.0)
  correctness("fp32 inputs (bf16 kernels)", 600, 256, 3000, "vh", dtype=jnp.float32,
              config=pm.Config(fp32_inputs="bf16"))
  correctness("fp16 hv", 600, 256, 3000, "hv", dtype=jnp.float16)
  correctness("one warpgroup (CPU-tested twin)", 1000, 512, 5003, "vh", bias=True,
              config=pm.Config(warp_specialized=False))
  llama3("vh")
  if quick:
    for name in ("gpt2-small", "qwen3-8b", "gemma2-2b"):
      other_shape(name)
  else:
    for cfg in (pm.Config(chunk_size=4096), pm.Config(chunk_size=8192)):
      fb_variant(cfg)
    llama3("hv")
    for name in ("gpt2-small", "qwen3-8b", "gemma2-2b"):
      other_shape(name)
    for cfg in (pm.Config(num_splits=4), pm.Config(num_splits=16), pm.Config(num_stages=3),
                pm.Config(num_stages=3, num_splits=8), pm.Config(warp_specialized=False, num_splits=4)):
      fwd_variant(cfg)
  save()
  print("\n=== pallas_mosaic on", RES["device"], "jax", RES["jax"])
  for r in RES["correctness"]:
    print(f"  {r['name']:<28} loss {r['loss_rel']:.1e} lse {r['lse_rel']:.1e} dx {r['dx_rel']:.1e} "
          f"dw {r['dw_rel']:.1e} db {r['db_rel'] if r['db_rel'] is None else format(r['db_rel'], '.1e')}")
  for r in RES["timing"]:
    ms = r.get("ms")
    ms = "/".join(f"{m:.2f}" for m in ms) if isinstance(ms, list) else (f"{ms:.2f}" if ms is not None else "")
    extra = {k: (round(val, 4) if isinstance(val, float) else val) for k, val in r.items()
             if k not in ("shape", "layout", "what", "ms")}
    print(f"  {r['shape']:<10} {r['layout']} {r['what']:<52} {ms:>20} ms  {extra}")
  for e in RES["errors"]:
    print("  ERROR", e[:300])


if __name__ == "__main__":
  main()
