"""``pallas_mosaic`` fast mode: the forward's stored tiles through 32-column SMEM slices (all 4 pipeline stages)
against whole-tile SMEM buffers (one stage fewer), in one lease. ``PYTHONPATH=. python3
benchmarks/gpu_fast_store.py``; writes ``$OUT/fast_store.json``.

1. correctness of the sliced stores against xla on float32-upcast inputs (ragged, bias, every option, both
   layouts, standard and peaky logits);
2. fast fwd+bwd at the four LLM shapes, each variant twice (interleaved), with temp memory.
"""

from __future__ import annotations

import datetime
import json
import os

import jax
import jax.numpy as jnp

from benchmarks.gpu_check_mosaic import SHAPES, bench, inputs, rel, temp_bytes
from lce_flax import linear_cross_entropy, pallas_mosaic

RES = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "jax": jax.__version__,
       "device": str(jax.devices()[0].device_kind), "correctness": [], "fast": [], "errors": []}


def save():
  with open(os.path.join(os.environ.get("OUT", "."), "fast_store.json"), "w") as f:
    json.dump(RES, f, indent=1)


def correctness(layout, wscale):
  b, h, v = 1000, 512, 5003
  x, w, y, bb = inputs(b, h, v, layout, bias=True, wscale=wscale)
  opts = dict(label_smoothing=0.1, z_loss=1e-3, logit_softcap=30.0)
  cot = jax.random.normal(jax.random.key(3), (b,))

  def f(impl, x, w, bb):
    loss = linear_cross_entropy(x, w, y, bias=bb, w_layout=layout, impl=impl, mode="fast", reduction="none", **opts)
    return jnp.sum(cot * loss)

  l1, d1 = jax.jit(jax.value_and_grad(lambda *a: f("pallas_mosaic", *a), (0, 1, 2)))(x, w, bb)
  up = lambda t: t.astype(jnp.float32)
  with jax.default_matmul_precision("highest"):
    l0, d0 = jax.jit(jax.value_and_grad(lambda *a: f("xla", *a), (0, 1, 2)))(up(x), up(w), up(bb))
  row = dict(slice=pallas_mosaic.STORE_SLICE, layout=layout, wscale=wscale,
             loss_rel=abs(float(l1 - l0)) / abs(float(l0)), grads_rel=[rel(a, c) for a, c in zip(d1, d0)])
  row["ok"] = row["loss_rel"] < 1e-4 and all(e < 1e-2 for e in row["grads_rel"])
  RES["correctness"].append(row)
  print("CORRECT", row, flush=True)


def timing(name, rnd):
  b, h, v = SHAPES[name]
  x, w, y, _ = inputs(b, h, v, "hv")
  y = jnp.maximum(y, 0)
  f = jax.jit(jax.value_and_grad(lambda x, w: linear_cross_entropy(
      x, w, y, impl="pallas_mosaic", mode="fast", reduction="sum"), (0, 1)))
  _, ms = bench(f, x, w)
  row = dict(shape=name, slice=pallas_mosaic.STORE_SLICE, round=rnd, ms=ms, temp_bytes=temp_bytes(f, x, w))
  RES["fast"].append(row)
  print("FAST", row, flush=True)


def guarded(fn, *a):
  try:
    fn(*a)
  except Exception as e:  # pylint: disable=broad-except
    RES["errors"].append(f"{fn.__name__}{a} slice={pallas_mosaic.STORE_SLICE}: {type(e).__name__}: {str(e)[:500]}")
    print("ERROR", RES["errors"][-1], flush=True)
  save()


if __name__ == "__main__":
  for layout in ("hv", "vh"):
    for wscale in (0.3, 3.0):
      guarded(correctness, layout, wscale)
  for rnd in (0, 1):
    for name in SHAPES:
      for sl in (32, 128):
        pallas_mosaic.STORE_SLICE = sl
        guarded(timing, name, rnd)
  pallas_mosaic.STORE_SLICE = 32
  print(json.dumps(RES["fast"], indent=0))
