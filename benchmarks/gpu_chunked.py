"""GPU check for issue 3: chunked fast vs lean (and xla) at llama3-8b, bf16, reduction "sum".

Usage on the device: ``python3 -m benchmarks.gpu_chunked`` (writes JSON lines to $OUT/chunked.jsonl).
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from lce_flax import linear_cross_entropy

B, H, V = 8192, 4096, 128256


def bench(f, *args, reps=10):
  out = f(*args)
  jax.block_until_ready(out)
  ts = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    ts.append(time.perf_counter() - t)
  return float(np.median(ts)) * 1e3, out


def main():
  k = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(k[0], (B, H), jnp.bfloat16)
  w = (0.02 * jax.random.normal(k[1], (H, V))).astype(jnp.bfloat16)
  y = jax.random.randint(k[2], (B,), 0, V)
  # float32 reference of the summed loss ("highest" precision dots), vocab chunk by chunk
  def ref_loss(x, w, y):
    xf = x.astype(jnp.float32)
    c = 8192
    n = -(-V // c)
    wp = jnp.pad(w, ((0, 0), (0, n * c - V)))
    def chunk_lse(i):
      z = jnp.dot(xf, jax.lax.dynamic_slice_in_dim(wp, i * c, c, 1).astype(jnp.float32), precision="highest")
      return jax.nn.logsumexp(jnp.where(i * c + jnp.arange(c) < V, z, -jnp.inf), axis=-1)
    lse = jax.nn.logsumexp(jax.lax.map(chunk_lse, jnp.arange(n)), axis=0)
    tgt = jnp.einsum("bh,hb->b", xf, w[:, y].astype(jnp.float32), precision="highest")
    return jnp.sum(lse - tgt)
  ref = float(jax.jit(ref_loss)(x, w, y))
  dev = jax.devices()[0]
  meta = dict(device=dev.device_kind, jax=jax.__version__, date=str(datetime.date.today()), shape="llama3-8b",
              B=B, H=H, V=V, dtype="bfloat16", reduction="sum", ref_loss_fp32=ref)
  rows = []
  variants = [("xla", None, None), ("chunked", "fast", None), ("chunked", "lean", None), ("chunked", "fast", 1024), ("chunked", "fast", 2048), ("chunked", "fast", 4096),
              ("chunked", "lean", 1024), ("chunked", "lean", 4096), ("chunked", "lean", 8192),
              ("chunked", "lean", 16384)]
  for impl, mode, chunk in variants:
    f = functools.partial(linear_cross_entropy, reduction="sum", impl=impl, mode=mode, chunk_size=chunk)
    row = dict(meta, impl=impl, mode=mode, chunk_size=chunk)
    try:
      fwd = jax.jit(f)
      fb = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
      row["fwd_temp_bytes"] = fwd.lower(x, w, y).compile().memory_analysis().temp_size_in_bytes
      row["fwdbwd_temp_bytes"] = fb.lower(x, w, y).compile().memory_analysis().temp_size_in_bytes
      row["fwd_ms"], loss = bench(fwd, x, w, y)
      row["fwdbwd_ms"], (loss2, _) = bench(fb, x, w, y)
      row["loss"] = float(loss)
      row["loss_rel_err"] = abs(float(loss) - ref) / abs(ref)
      flops = (6 if mode != "lean" else 8) * B * H * V
      row["tflops_fwdbwd"] = flops / row["fwdbwd_ms"] / 1e9
    except Exception as e:  # record, never stop the run
      row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    rows.append(row)
    print(json.dumps(row), flush=True)
  out = os.environ.get("OUT", ".")
  with open(os.path.join(out, "chunked.jsonl"), "w") as fh:
    fh.writelines(json.dumps(r) + "\n" for r in rows)
  print(f"{'impl':8} {'mode':5} {'chunk':>6} {'fwd ms':>8} {'f+b ms':>8} {'temp GB':>8} {'rel err':>9}")
  for r in rows:
    print(f"{r['impl']:8} {str(r['mode']):5} {str(r['chunk_size']):>6} {r.get('fwd_ms', float('nan')):8.1f} "
          f"{r.get('fwdbwd_ms', float('nan')):8.1f} {r.get('fwdbwd_temp_bytes', 0) / 1e9:8.2f} "
          f"{r.get('loss_rel_err', float('nan')):9.2e} {r.get('error', '')}")


if __name__ == "__main__":
  main()
