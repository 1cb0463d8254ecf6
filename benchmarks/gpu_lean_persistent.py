"""``pallas_mosaic`` lean backward: the persistent dz kernel (one CTA per SM looping over the chunk's tiles)
against one CTA per tile pair, in one lease. ``PYTHONPATH=. python3 benchmarks/gpu_lean_persistent.py``; writes
``$OUT/lean_persistent.json``.

1. correctness of both variants against xla on float32-upcast inputs (ragged shapes, bias, every option);
2. the dz kernel alone for one chunk at llama3-8b (ms, TFLOP/s on its 2·B·H·chunk FLOPs);
3. lean forward + backward at the four LLM shapes for each variant and chunk size, with temp memory.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback

import jax
import jax.numpy as jnp

from benchmarks.gpu_check_mosaic import SHAPES, bench, inputs, rel, temp_bytes
from lce_flax import _base, _math, linear_cross_entropy, pallas_mosaic
from lce_flax.pallas_mosaic import Config

RES = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "jax": jax.__version__,
       "device": str(jax.devices()[0].device_kind), "correctness": [], "dz": [], "lean": [], "errors": []}


def save():
  with open(os.path.join(os.environ.get("OUT", "."), "lean_persistent.json"), "w") as f:
    json.dump(RES, f, indent=1)


def guarded(fn):
  def run(*a, **k):
    try:
      fn(*a, **k)
    except Exception as e:  # pylint: disable=broad-except
      RES["errors"].append(f"{fn.__name__}{a}: {type(e).__name__}: {str(e)[:500]}")
      traceback.print_exc()
    save()
  return run


@guarded
def correctness(persistent: bool, layout: str, bias: bool, b=1000, h=512, v=5003):
  x, w, y, bb = inputs(b, h, v, layout, bias=bias, wscale=0.3)
  opts = dict(label_smoothing=0.1, z_loss=1e-3, logit_softcap=30.0)
  cot = jax.random.normal(jax.random.key(3), (b,))

  def f(impl, x, w, bb, cfg=None):
    loss = linear_cross_entropy(x, w, y, bias=bb, w_layout=layout, impl=impl, mode="lean", reduction="none",
                                config=cfg, **opts)
    return jnp.sum(cot * loss)

  argn = (0, 1, 2) if bias else (0, 1)
  g1 = jax.jit(jax.value_and_grad(lambda *a: f("pallas_mosaic", *a, cfg=Config(persistent=persistent)), argn))
  l1, d1 = g1(x, w, bb)
  up = lambda t: None if t is None else t.astype(jnp.float32)
  with jax.default_matmul_precision("highest"):
    l0, d0 = jax.jit(jax.value_and_grad(lambda *a: f("xla", *a), argn))(up(x), up(w), up(bb))
  row = dict(persistent=persistent, layout=layout, bias=bias, b=b, h=h, v=v,
             loss_rel=abs(float(l1 - l0)) / abs(float(l0)), grads_rel=[rel(a, c) for a, c in zip(d1, d0)])
  row["ok"] = row["loss_rel"] < 1e-4 and all(e < 1e-2 for e in row["grads_rel"])
  RES["correctness"].append(row)
  print("CORRECT", row, flush=True)


@guarded
def dz_alone(persistent: bool, chunk: int, name="llama3-8b", layout="vh"):
  b, h, v = SHAPES[name]
  x, w, y, _ = inputs(b, h, v, layout)
  spec = _base.Spec(_math.LossOptions(v), layout)
  p = pallas_mosaic.plan(b, h, v, Config(persistent=persistent, chunk_size=chunk))
  xp, wp, bp, yp, d = pallas_mosaic._prepare(x, w, None, y, spec, p)  # pylint: disable=protected-access
  lse = jnp.full((d.b,), 12.0, jnp.float32)
  coef = jnp.ones((d.b,), jnp.float32)
  a = jnp.ones((d.b,), jnp.float32)
  c = jnp.zeros((d.b,), jnp.float32)

  @jax.jit
  def f(xp, wp):
    w_c = _base.slice_vocab(wp, 0, p.chunk_size, layout)
    return pallas_mosaic._dz_chunk_ws(xp, w_c, None, yp, lse, coef, a, c, d, p, spec.opts)  # pylint: disable=protected-access

  _, ms = bench(f, xp, wp, iters=20)
  out = f(xp, wp)
  row = dict(shape=name, persistent=persistent, chunk=p.chunk_size, ms=ms,
             tflops=2 * d.b * d.h * p.chunk_size / ms / 1e9, checksum=float(jnp.sum(out.astype(jnp.float32))))
  RES["dz"].append(row)
  print("DZ", row, flush=True)


@guarded
def lean(name: str, persistent: bool, chunk: int | None, layout="vh"):
  b, h, v = SHAPES[name]
  x, w, y, _ = inputs(b, h, v, layout)
  y = jnp.maximum(y, 0)
  cfg = Config(persistent=persistent, chunk_size=chunk)
  f = jax.jit(jax.value_and_grad(lambda x, w: linear_cross_entropy(
      x, w, y, w_layout=layout, impl="pallas_mosaic", mode="lean", reduction="sum", config=cfg), (0, 1)))
  comp, ms = bench(f, x, w)
  row = dict(shape=name, persistent=persistent, chunk=pallas_mosaic.plan(b, h, v, cfg).chunk_size, ms=ms,
             compile_s=comp, temp_bytes=temp_bytes(f, x, w), tflops_8bhv=8 * b * h * v / ms / 1e9)
  RES["lean"].append(row)
  print("LEAN", row, flush=True)


if __name__ == "__main__":
  parts = set(sys.argv[1:]) or {"correctness", "dz", "lean"}
  if "correctness" in parts:
    for pers in (True, False):
      correctness(pers, "vh", True)
      correctness(pers, "hv", False)
  if "dz" in parts:
    for chunk in (2048, 8192):
      for pers in (False, True):
        dz_alone(pers, chunk)
  if "lean" in parts:
    for name in SHAPES:
      for pers, chunk in ((False, None), (True, None), (True, 4096)):
        lean(name, pers, chunk)
  print(json.dumps({k: RES[k] for k in ("dz", "lean", "errors")}, indent=0))
