"""Token chunk of ``pallas_mosaic``'s "tokens" fast design at gpt2-small (where it is the default), and a probe of
the "vh" + bias alignment error. ``PYTHONPATH=. python3 benchmarks/gpu_tune_tokens.py``; writes
``$OUT/tune_tokens.json``."""

from __future__ import annotations

import datetime
import json
import os
import traceback

import jax
import jax.numpy as jnp

from benchmarks.gpu_check_mosaic import SHAPES, bench, inputs, temp_bytes
from lce_flax import linear_cross_entropy
from lce_flax.pallas_mosaic import Config

RES = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "jax": jax.__version__,
       "device": str(jax.devices()[0].device_kind), "rows": [], "probe": []}


def save():
  with open(os.path.join(os.environ.get("OUT", "."), "tune_tokens.json"), "w") as f:
    json.dump(RES, f, indent=1)


def tune():
  for name, chunks in (("gpt2-small", (1024, 2048, 4096, 8192)), ("gemma2-2b", (2048,))):
    b, h, v = SHAPES[name]
    x, w, y, _ = inputs(b, h, v, "hv")
    y = jnp.maximum(y, 0)
    for design, chunk in [("tokens", c) for c in chunks] + [("logits", None)]:
      cfg = Config(fast_design=design, chunk_size=chunk)
      f = jax.jit(jax.value_and_grad(lambda x, w, cfg=cfg: linear_cross_entropy(
          x, w, y, impl="pallas_mosaic", mode="fast", reduction="sum", config=cfg), (0, 1)))
      _, ms = bench(f, x, w)
      RES["rows"].append(dict(shape=name, design=design, chunk=chunk, ms=ms, temp_bytes=temp_bytes(f, x, w)))
      print(RES["rows"][-1], flush=True)
      save()


def probe():
  """Which call fails: lean "vh" + bias at V=5003, repeated, then V=5008."""
  for v, mode in ((5003, "lean"), (5003, "lean"), (5008, "lean"), (5003, "fast")):
    x, w, y, bb = inputs(1000, 512, v, "vh", bias=True, wscale=0.3)
    f = jax.jit(jax.value_and_grad(lambda x, w, b, mode=mode: linear_cross_entropy(
        x, w, y, bias=b, w_layout="vh", impl="pallas_mosaic", mode=mode, reduction="sum"), (0, 1, 2)))
    row = dict(v=v, mode=mode)
    try:
      l, g = f(x, w, bb)
      jax.block_until_ready(g)
      row["ok_first"] = True
      l, g = f(x, w, bb)
      jax.block_until_ready(g)
      row["ok_second"] = True
      row["sum_dw"] = float(jnp.sum(g[1].astype(jnp.float32)))
      row["ok_eager_after"] = True
    except Exception as e:  # pylint: disable=broad-except
      row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
      row["where"] = traceback.format_exc()[-600:]
    RES["probe"].append(row)
    print("PROBE", row, flush=True)
    save()


if __name__ == "__main__":
  tune()
  probe()
