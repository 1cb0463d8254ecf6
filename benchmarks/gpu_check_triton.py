"""GPU check of ``impl="pallas_triton"``: correctness at small and LLM shapes, block-size sweep, timings.

Run on a GPU machine from the repository root::

  PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check_triton.py [--out DIR] [--budget SECONDS]

Sections (each guarded: one that fails records its error and the next runs; sections stop when the time budget
is spent):

1. small ragged shapes, compiled kernels, every option, both layouts, bf16/fp16/fp32, vs the float64 oracle;
2. llama3-8b (B=8192, H=4096, V=128256, bf16): per-token loss of 64 random rows vs float64 NumPy, the summed
   loss and the gradients vs the XLA path on float32-upcast inputs at ``highest`` matmul precision;
3. the backward's time split (dz kernel alone, the XLA matmuls alone) at llama3-8b;
4. a sweep of forward block sizes and backward chunks at llama3-8b;
5. forward and forward+backward times (median wall clock around ``block_until_ready``) and compiled temp memory
   of pallas_triton, xla and chunked at the four anchor shapes.

Writes ``pallas_triton_<date>.json`` into ``--out`` (default ``$OUT`` or ``.``) and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import sys
import time
import traceback

import numpy as np

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from reference_np import linear_cross_entropy_np, rel_err  # noqa: E402

from lce_flax import linear_cross_entropy  # noqa: E402
from lce_flax import pallas_triton  # noqa: E402
from lce_flax.pallas_triton import Config  # noqa: E402

SHAPES = {  # name: (B, H, V)
    "llama3-8b": (8192, 4096, 128256),
    "gpt2-small": (16384, 768, 50304),
    "qwen3-8b": (4096, 4096, 151936),
    "gemma2-2b": (8192, 2304, 256000),
}

SMALL = (333, 200, 5003)  # ragged everything (H too)
T0 = time.time()
BUDGET = 380.0


def left() -> float:
  return BUDGET - (time.time() - T0)


def median_ms(fn, *args, iters: int = 10, warmup: int = 2) -> float:
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(iters):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t)
  return float(np.median(ts) * 1e3)


def temp_bytes(fn, *args) -> int | None:
  try:
    return int(jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes)
  except Exception:  # memory_analysis is best effort
    return None


def inputs(b, h, v, dtype, key=0):
  k1, k2, k3 = jax.random.split(jax.random.key(key), 3)
  x = jax.random.normal(k1, (b, h), jnp.float32).astype(dtype)
  w = (0.02 * jax.random.normal(k2, (h, v), jnp.float32)).astype(dtype)
  y = jax.random.randint(k3, (b,), 0, v, jnp.int32)
  return x, w, y


def loss_fn(impl, config=None, **kw):
  def f(x, w, y):
    return linear_cross_entropy(x, w, y, reduction="sum", impl=impl, config=config, **kw)
  return f


def ragged_case(rng, impl: str, dtype, layout: str, opts: dict, with_bias: bool) -> dict:
  """One small ragged problem (``SMALL``) of ``impl`` against the float64 oracle: random x, w, labels (every 17th
  ignored) and per-token cotangent; float32 inputs at full float32 matmul precision. Returns the row."""
  b, h, v = SMALL
  x = rng.standard_normal((b, h)).astype(np.float32)
  wf = (0.3 * rng.standard_normal((h, v))).astype(np.float32)
  wl = wf if layout == "hv" else wf.T.copy()
  bias = rng.standard_normal(v).astype(np.float32) if with_bias else None
  y = rng.integers(0, v, b)
  y[::17] = -100
  g = rng.standard_normal(b).astype(np.float32)
  xd, wd = jnp.asarray(x, dtype), jnp.asarray(wl, dtype)
  bd = None if bias is None else jnp.asarray(bias, dtype)

  def f(x_, w_, b_):
    out = linear_cross_entropy(x_, w_, jnp.asarray(y), bias=b_, reduction="none", w_layout=layout, impl=impl,
                               **opts)
    return jnp.sum(out * g), out

  ctx = jax.default_matmul_precision("highest") if dtype == jnp.float32 else contextlib.nullcontext()
  with ctx:
    (_, tok), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(xd, wd, bd)
  ref = linear_cross_entropy_np(np.asarray(xd, np.float64), np.asarray(wd, np.float64), y,
                                bias=None if bd is None else np.asarray(bd, np.float64), reduction="none",
                                w_layout=layout, cotangent=g, **opts)
  tok = np.asarray(tok, np.float64)
  return dict(impl=impl, dtype=jnp.dtype(dtype).name, layout=layout, opts=opts, bias=bias is not None,
              tok=rel_err(tok, ref["loss"]),
              token_loss_max_rel=float(np.max(np.abs(tok - ref["loss"]) / np.maximum(np.abs(ref["loss"]), 1e-6))),
              dx=rel_err(grads[0], ref["dx"]), dw=rel_err(grads[1], ref["dw"]),
              db=None if bias is None else rel_err(grads[2], ref["dbias"]))


def section_small(res):
  rng = np.random.default_rng(0)
  cases = [  # odd cases carry a bias
      dict(),
      dict(label_smoothing=0.05, z_loss=1e-4, logit_softcap=5.0),
  ]
  rows = [ragged_case(rng, "pallas_triton", dtype, layout, opts, ci % 2 == 1)
          for dtype in (jnp.bfloat16, jnp.float16, jnp.float32) for layout in ("hv", "vh")
          for ci, opts in enumerate(cases)]
  res["small"] = rows
  worst = {k: max(r[k] for r in rows if r[k] is not None) for k in ("tok", "dx", "dw", "db")}
  res["small_worst"] = worst
  print("small shapes worst rel errors:", worst)


def section_llama_correctness(res):
  b, h, v = SHAPES["llama3-8b"]
  x, w, y = inputs(b, h, v, jnp.bfloat16)
  rows = np.sort(np.random.default_rng(0).choice(b, 64, replace=False))
  tok = jax.jit(lambda x, w, y: linear_cross_entropy(x, w, y, reduction="none", impl="pallas_triton"))(x, w, y)
  tok = np.asarray(tok)
  xs = np.asarray(x[rows].astype(jnp.float32), np.float64)
  wh = np.asarray(w.astype(jnp.float32), np.float64)
  ref = linear_cross_entropy_np(xs, wh, np.asarray(y)[rows], reduction="none")
  per_tok = float(np.max(np.abs(tok[rows] - ref["loss"]) / np.abs(ref["loss"])))
  sub_sum = float(abs(tok[rows].sum() - ref["loss"].sum()) / abs(ref["loss"].sum()))
  del wh
  f = jax.jit(jax.value_and_grad(loss_fn("pallas_triton"), argnums=(0, 1)))
  loss, (dx, dw) = f(x, w, y)
  with jax.default_matmul_precision("highest"):
    fr = jax.jit(jax.value_and_grad(loss_fn("xla"), argnums=(0, 1)))
    loss_r, (dx_r, dw_r) = fr(x.astype(jnp.float32), w.astype(jnp.float32), y)
  rn = lambda a, r: float(jnp.linalg.norm((a.astype(jnp.float32) - r).ravel()) / jnp.linalg.norm(r.ravel()))
  out = dict(token_loss_max_rel_err_vs_fp64=per_tok, subset_sum_rel_err_vs_fp64=sub_sum,
             loss=float(loss), loss_ref_f32_highest=float(loss_r),
             loss_rel_err_vs_f32_highest=float(abs(loss - loss_r) / abs(loss_r)),
             dx_rel_norm_err=rn(dx, dx_r), dw_rel_norm_err=rn(dw, dw_r))
  res["llama_correctness"] = out
  print("llama3-8b correctness:", out)


def section_sweep(res):
  b, h, v = SHAPES["llama3-8b"]
  x, w, y = inputs(b, h, v, jnp.bfloat16)
  default = pallas_triton.plan(b, h, v, jnp.bfloat16)
  res["default_plan"] = default.__dict__
  fwd_cfgs = [
      Config(),
      Config(num_stages=3),
      Config(num_splits=8),
  ]
  rows = []
  for c in fwd_cfgs:
    if left() < 15:
      break
    try:
      ms = median_ms(jax.jit(loss_fn("pallas_triton", c)), x, w, y)
    except Exception as e:  # a config that does not compile is recorded, not fatal
      ms = f"error: {type(e).__name__}: {str(e)[:200]}"
    rows.append(dict(config={k: val for k, val in c.__dict__.items() if val is not None}, fwd_ms=ms))
    print("fwd", rows[-1])
  res["sweep_fwd"] = rows
  rows = []
  for c in (Config(chunk_size=2048, dx_kernel=False), Config(chunk_size=4096), Config(chunk_size=4096, dx_kernel=False),
            Config(chunk_size=8192), Config(chunk_size=8192, dx_kernel=False), Config(chunk_size=1024),
            Config(chunk_size=4096, group_t=64), Config(low_memory=True, token_block=2048),
            Config(low_memory=True, dx_chunk=16384)):
    if left() < 15:
      break
    try:
      ms = median_ms(jax.jit(jax.grad(loss_fn("pallas_triton", c), argnums=(0, 1))), x, w, y, iters=5)
    except Exception as e:
      ms = f"error: {type(e).__name__}: {str(e)[:200]}"
    rows.append(dict(config={k: val for k, val in c.__dict__.items() if val is not None}, fwd_bwd_ms=ms))
    print("fwd+bwd", rows[-1])
  res["sweep_bwd"] = rows


def section_breakdown(res):
  """Where the backward's time goes at llama3-8b: the dz kernel alone, the two XLA matmuls alone, the whole."""
  b, h, v = SHAPES["llama3-8b"]
  x, w, y = inputs(b, h, v, jnp.bfloat16)
  p = pallas_triton.plan(b, h, v, jnp.bfloat16)
  spec = pallas_triton._base.Spec(pallas_triton._math.LossOptions(v), interpret=jax.default_backend() != "gpu")
  p = dataclasses.replace(p, chunk_size=min(p.chunk_size, v // 2))  # (no effect at llama3-8b)
  c = p.chunk_size
  n = v // c
  lse = jnp.zeros((b,), jnp.float32) + 12.0
  ones = jnp.ones((b,), jnp.float32)

  def dz_only(x, w, y):
    def body(k, acc):
      dz, _ = pallas_triton._dz_chunk(k, c, x, w, None, y, lse, ones, ones, spec, p)
      return acc + dz[0, 0].astype(jnp.float32)
    return jax.lax.fori_loop(0, n, body, jnp.float32(0))

  dz0 = (1e-3 * jax.random.normal(jax.random.key(3), (b, c), jnp.float32)).astype(jnp.bfloat16)

  def mm_only(x, w, dz0):
    def body(k, carry):
      dx, dw = carry
      off = k * c
      dx = dx + pallas_triton._base.grad_x(dz0, jax.lax.dynamic_slice_in_dim(w, off, c, 1), "hv")
      dwc = jax.lax.dot_general(x, dz0, (((0,), (0,)), ((), ())), preferred_element_type=w.dtype)
      return dx, jax.lax.dynamic_update_slice_in_dim(dw, dwc, off, 1)
    return jax.lax.fori_loop(0, n, body, (jnp.zeros(x.shape, jnp.float32), jnp.zeros_like(w)))

  def dx_only(x, w, dz0):
    def body(k, dx):
      return pallas_triton._dx_accumulate(dx, dz0, w, k, spec, p)
    return jax.lax.fori_loop(0, n, body, jnp.zeros(x.shape, jnp.float32))

  f = loss_fn("pallas_triton")
  out = dict(chunk=c, chunks=n,
             dx_kernel_all_chunks_ms=median_ms(jax.jit(dx_only), x, w, dz0, iters=5),
             dz_kernel_all_chunks_ms=median_ms(jax.jit(dz_only), x, w, y, iters=5),
             xla_matmuls_all_chunks_ms=median_ms(jax.jit(mm_only), x, w, dz0, iters=5),
             fwd_ms=median_ms(jax.jit(f), x, w, y, iters=5),
             fwd_bwd_ms=median_ms(jax.jit(jax.grad(f, argnums=(0, 1))), x, w, y, iters=5))
  res["breakdown"] = out
  print("breakdown:", out)


def section_shapes(res):
  out = []
  for name, (b, h, v) in SHAPES.items():
    x, w, y = inputs(b, h, v, jnp.bfloat16)
    for impl in ("pallas_triton", "pallas_triton:low_memory", "xla", "chunked"):
      if left() < 60:
        break
      row = dict(shape=name, impl=impl)
      try:
        f = loss_fn("pallas_triton", Config(low_memory=True)) if impl.endswith("low_memory") else loss_fn(impl)
        g = jax.grad(f, argnums=(0, 1))
        row["fwd_ms"] = median_ms(jax.jit(f), x, w, y, iters=5)
        row["fwd_bwd_ms"] = median_ms(jax.jit(g), x, w, y, iters=5)
        row["fwd_temp_bytes"] = temp_bytes(f, x, w, y)
        row["fwd_bwd_temp_bytes"] = temp_bytes(g, x, w, y)
      except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
      out.append(row)
      print(row)
    del x, w, y
  res["shapes"] = out


def run_sections(res: dict, sections: dict, names, path: str, left_s, min_left_s: float) -> None:
  """Runs ``sections[name](res)`` for each name while ``left_s()`` (the caller's remaining budget) exceeds
  ``min_left_s``, recording each section's traceback (under ``res["errors"]``) and seconds, and rewriting ``path``
  after every section."""
  errors = res.setdefault("errors", {})
  for name in names:
    if left_s() < min_left_s:
      errors[name] = "skipped: time budget spent"
      continue
    t = time.time()
    try:
      sections[name](res)
    except Exception as e:  # noqa: BLE001  (keep going: later sections are independent)
      errors[name] = traceback.format_exc()[-3000:]
      print(f"section {name} failed: {e!r}"[:1000], flush=True)
    res.setdefault("section_s", {})[name] = round(time.time() - t, 1)
    with open(path, "w") as fh:
      json.dump(res, fh, indent=1, default=str)


def main():
  global BUDGET
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  ap.add_argument("--budget", type=float, default=BUDGET)
  ap.add_argument("--sections", default="small,llama,breakdown,shapes,sweep")
  args = ap.parse_args()
  BUDGET = args.budget
  try:
    import triton  # version only
    triton_version = triton.__version__
  except ImportError:
    triton_version = None
  dev = jax.devices()[0]
  res = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             device=getattr(dev, "device_kind", str(dev)), jax=jax.__version__, jaxlib=jax.lib.__version__
             if hasattr(jax.lib, "__version__") else None, triton=triton_version, errors={})
  sections = dict(small=section_small, llama=section_llama_correctness, breakdown=section_breakdown,
                  sweep=section_sweep, shapes=section_shapes)
  path = os.path.join(args.out, f"pallas_triton_{res['date'][:10]}.json")
  run_sections(res, sections, args.sections.split(","), path, left, min_left_s=20)
  print("\n| shape | impl | fwd ms | fwd+bwd ms | fwd+bwd temp MB |")
  print("|---|---|---|---|---|")
  for r in res.get("shapes", []):
    mb = r.get("fwd_bwd_temp_bytes")
    print(f"| {r['shape']} | {r['impl']} | {r.get('fwd_ms', '-')!s:.6} | {r.get('fwd_bwd_ms', '-')!s:.6} | "
          f"{'-' if mb is None else round(mb / 2**20, 1)} |")
  print("errors:", {k: v[-300:] for k, v in res["errors"].items()})
  print(f"total {time.time() - T0:.0f} s")


if __name__ == "__main__":
  main()
