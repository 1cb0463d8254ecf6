"""Several GPUs: equality on meshes, data-parallel and FSDP weak scaling, the vocab-parallel head's per-device memory.

Usage on a multi-GPU device: ``python3 -m benchmarks.multi_gpu`` (all visible GPUs; writes
``$OUT/multi_gpu_<n>gpu.json`` and prints a summary). ``--small`` runs tiny shapes (a CPU smoke test:
``XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m benchmarks.multi_gpu --small``).

Sections (each row records its error instead of stopping the run):

* ``vocab_parallel`` (run first, so that ``peak_bytes_in_use`` is not polluted by the other sections):
  llama3-8b head (B=8192 tokens, H=4096, V=128256, bf16, mean), tokens replicated, ``w`` split over
  ``tensor`` = k for k = n, …, 2, both designs (``vp_lean``, ``vp_fast``); then one device with the same designs
  (``chunked_lean``, ``chunked_fast``) and with ``impl="auto"``. Per device: compiled argument/output/temp bytes
  (``memory_analysis``), peak bytes, fwd+bwd time; ratios against one device of the same design.
* ``equality``: float32 with every option (bias, ignored tokens, ``where``, smoothing, z-loss, softcap), each
  mesh of n devices, ``impl`` "chunked" and "auto" (the GPU kernels on the data-parallel path),
  loss/dx/dw/dbias relative error against the same op (same ``impl``) on one device
  (``jax.default_matmul_precision("highest")`` on both sides). Target ≤ 1e-5.
* ``weak_scaling``: data parallel (``data`` = k) and FSDP (``fsdp`` = k) with 8192 tokens per device at the
  llama3-8b head, bf16, mean, for k = 1, 2, 4, … ≤ n; efficiency = t(1) / t(k). ``data_local``: the same
  per-device work without the dw all-reduce (the head's share of a step whose gradient reduction overlaps the
  layers below). Also the time of a bare
  all-reduce of an H×V bf16 array (the dw reduction a data-parallel step must pay, not overlapped here since the
  head is the whole step).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lce_flax import linear_cross_entropy
from lce_flax.sharding import make_mesh, sharded_linear_cross_entropy


def bench(f, *args, reps=10):
  jax.block_until_ready(f(*args))
  ts = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    ts.append(time.perf_counter() - t)
  return float(np.median(ts)) * 1e3


def rand(key, shape, dtype, sharding, scale=1.0):
  return jax.jit(lambda k: (scale * jax.random.normal(k, shape, jnp.float32)).astype(dtype),
                 out_shardings=sharding)(key)


def rand_labels(key, shape, v, sharding, ignore_frac=0.0):
  def f(k):
    k1, k2 = jax.random.split(k)
    y = jax.random.randint(k1, shape, 0, v)
    return jnp.where(jax.random.uniform(k2, shape) < ignore_frac, -100, y)
  return jax.jit(f, out_shardings=sharding)(key)


def rel(a, b) -> float:
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def mem(compiled) -> dict:
  m = compiled.memory_analysis()
  out = {k: int(getattr(m, k)) for k in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                                          "alias_size_in_bytes") if hasattr(m, k)}
  out["head_bytes"] = out["argument_size_in_bytes"] + out["output_size_in_bytes"] + out["temp_size_in_bytes"]
  return out


def peak_bytes(devices) -> int | None:
  try:
    return max(int(d.memory_stats()["peak_bytes_in_use"]) for d in devices)
  except Exception:  # CPU devices have no memory stats
    return None


def _meshes(n: int):
  """Every (data, fsdp, tensor) factorisation of n."""
  out = []
  for d in range(1, n + 1):
    for f in range(1, n // d + 1):
      if n % (d * f) == 0:
        out.append((d, f, n // (d * f)))
  return out


def _pow2_upto(n: int):
  k, out = 1, []
  while k <= n:
    out.append(k)
    k *= 2
  return out


# ------------------------------------------------------------------------------------------------ sections


def vocab_parallel(devs, b, h, v, dtype, rows):
  n = len(devs)
  key = jax.random.key(1)
  configs = [(k, f"vp_{mode}") for k in reversed(_pow2_upto(n)) if k > 1 for mode in ("lean", "fast")]
  configs += [(1, "chunked_lean"), (1, "chunked_fast"), (1, "auto")]
  for k, kind in configs:
    row = dict(section="vocab_parallel", devices=k, kind=kind, B=b, H=h, V=v, dtype=str(jnp.dtype(dtype)))
    try:
      if kind.startswith("vp_"):
        mesh = make_mesh(data=1, fsdp=1, tensor=k, devices=devs[:k])
        rep, wsh = NamedSharding(mesh, P()), NamedSharding(mesh, P(None, "tensor"))
        f = functools.partial(sharded_linear_cross_entropy, mesh=mesh, mode=kind[3:])
      else:
        rep = wsh = jax.sharding.SingleDeviceSharding(devs[0])
        f = functools.partial(linear_cross_entropy, impl="auto" if kind == "auto" else "chunked",
                              mode=None if kind == "auto" else kind.split("_")[1])
      x = rand(jax.random.fold_in(key, 0), (b, h), dtype, rep)
      w = rand(jax.random.fold_in(key, 1), (h, v), dtype, wsh, 0.02)
      y = rand_labels(jax.random.fold_in(key, 2), (b,), v, rep)
      g = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
      row.update(mem(g.lower(x, w, y).compile()))
      row["fwdbwd_ms"] = bench(g, x, w, y)
      row["peak_bytes_in_use"] = peak_bytes(devs[:k])
      row["loss"] = float(g(x, w, y)[0])
      del x, w, y
    except Exception as e:
      row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    rows.append(row)
    print(json.dumps(row), flush=True)
  for mode in ("lean", "fast"):
    one = next((r for r in rows if r.get("kind") == f"chunked_{mode}" and "head_bytes" in r), None)
    if one is None:
      continue
    for r in rows:
      if r.get("kind") == f"vp_{mode}" and "head_bytes" in r:
        r["head_bytes_ratio_vs_1dev"] = r["head_bytes"] / one["head_bytes"]
        r["ideal_ratio"] = 1 / r["devices"]
        r["loss_rel_err_vs_1dev"] = abs(r["loss"] - one["loss"]) / abs(one["loss"])
        r["speedup_vs_1dev"] = one["fwdbwd_ms"] / r["fwdbwd_ms"]


def equality(devs, b, h, v, rows):
  key = jax.random.key(2)
  opts = dict(label_smoothing=0.1, z_loss=1e-3, logit_softcap=30.0)
  one = jax.sharding.SingleDeviceSharding(devs[0])
  x0 = rand(jax.random.fold_in(key, 0), (b, h), jnp.float32, one)
  w0 = rand(jax.random.fold_in(key, 1), (h, v), jnp.float32, one, 0.05)
  b0 = rand(jax.random.fold_in(key, 3), (v,), jnp.float32, one)
  y0 = rand_labels(jax.random.fold_in(key, 2), (b,), v, one, ignore_frac=0.1)
  m0 = jax.jit(lambda k: jax.random.uniform(k, (b,)) < 0.9, out_shardings=one)(jax.random.fold_in(key, 4))
  for impl in ("chunked", "auto"):
    try:
      _equality_impl(devs, impl, opts, (x0, w0, b0, y0, m0), b, h, v, rows)
    except Exception as e:
      rows.append(dict(section="equality", impl=impl, error=f"{type(e).__name__}: {str(e)[:400]}"))


def _equality_impl(devs, impl, opts, inputs, b, h, v, rows):
  """One backend (the data-parallel path runs it; the vocab-parallel path is pure JAX either way)."""
  x0, w0, b0, y0, m0 = inputs
  with jax.default_matmul_precision("highest"):
    ref_f = lambda x, w, bb: linear_cross_entropy(x, w, y0, bias=bb, where=m0, impl=impl, **opts)
    l0, g0 = jax.jit(jax.value_and_grad(ref_f, (0, 1, 2)))(x0, w0, b0)
  for shape in _meshes(len(devs)):
    row = dict(section="equality", impl=impl, mesh=dict(zip(("data", "fsdp", "tensor"), shape)), B=b, H=h, V=v,
               dtype="float32", **opts)
    try:
      mesh = make_mesh(*shape, devices=devs)
      tok = NamedSharding(mesh, P(("data", "fsdp")))
      x = jax.device_put(x0, tok)
      w = jax.device_put(w0, NamedSharding(mesh, P("fsdp", "tensor")))
      bb = jax.device_put(b0, NamedSharding(mesh, P("tensor")))
      y, m = jax.device_put(y0, tok), jax.device_put(m0, tok)
      with jax.default_matmul_precision("highest"):
        def f(x, w, bb, y, m, mesh=mesh, impl=impl):
          return sharded_linear_cross_entropy(x, w, y, bias=bb, where=m, mesh=mesh, impl=impl, **opts)
        l1, g1 = jax.jit(jax.value_and_grad(f, (0, 1, 2)))(x, w, bb, y, m)
      row.update(loss=float(l1), loss_ref=float(l0), loss_rel_err=rel(l1, l0),
                 dx_rel_err=rel(g1[0], g0[0]), dw_rel_err=rel(g1[1], g0[1]), dbias_rel_err=rel(g1[2], g0[2]))
      row["pass_1e-5"] = max(row[k] for k in ("loss_rel_err", "dx_rel_err", "dw_rel_err", "dbias_rel_err")) <= 1e-5
    except Exception as e:
      row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
      traceback.print_exc()
    rows.append(row)
    print(json.dumps(row), flush=True)


def weak_scaling(devs, b_per, h, v, dtype, rows, impls):
  n = len(devs)
  key = jax.random.key(3)
  for layout in ("data", "fsdp", "data_local"):
    for impl in impls:
      base = None
      for k in _pow2_upto(n):
        row = dict(section="weak_scaling", layout=layout, impl=impl, devices=k, tokens_per_device=b_per, H=h, V=v,
                   dtype=str(jnp.dtype(dtype)))
        try:
          sizes = dict(data=1, fsdp=k, tensor=1) if layout == "fsdp" else dict(data=k, fsdp=1, tensor=1)
          mesh = make_mesh(**sizes, devices=devs[:k])
          tok = NamedSharding(mesh, P(("data", "fsdp")))
          x = rand(jax.random.fold_in(key, 0), (b_per * k, h), dtype, tok)
          w = rand(jax.random.fold_in(key, 1), (h, v), dtype, NamedSharding(mesh, P("fsdp", None)), 0.02)
          y = rand_labels(jax.random.fold_in(key, 2), (b_per * k,), v, tok)
          if layout == "data_local":
            # the same per-device work with no cross-device reduction of dw (or of the loss): what a data-parallel
            # step pays for the head when the dw all-reduce overlaps the backward of the layers below it
            op = functools.partial(linear_cross_entropy, impl=impl)
            def local(x, w, y, op=op):
              loss, grads = jax.value_and_grad(op, argnums=(0, 1))(x, w, y)
              return loss[None], grads
            g = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P(), P("data")),
                                      out_specs=(P("data"), (P("data"), P("data"))), check_vma=False))
          else:
            f = functools.partial(sharded_linear_cross_entropy, mesh=mesh, impl=impl)
            g = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
          row.update(mem(g.lower(x, w, y).compile()))
          row["fwdbwd_ms"] = bench(g, x, w, y)
          if k == 1:
            base = row["fwdbwd_ms"]
          if base:
            row["efficiency"] = base / row["fwdbwd_ms"]
          row["tokens_per_s"] = b_per * k / row["fwdbwd_ms"] * 1e3
          del x, w, y
        except Exception as e:
          row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
  for k in _pow2_upto(n)[1:]:
    row = dict(section="allreduce", devices=k, shape=[h, v], dtype=str(jnp.dtype(dtype)))
    try:
      mesh = make_mesh(data=k, devices=devs[:k])
      a = rand(jax.random.fold_in(key, 9), (k * h, v), dtype, NamedSharding(mesh, P("data")))
      ar = jax.jit(jax.shard_map(lambda t: jax.lax.psum(t, "data"), mesh=mesh, in_specs=P("data"),
                                 out_specs=P()))
      row["allreduce_ms"] = bench(ar, a)
      row["algbw_GBps"] = h * v * jnp.dtype(dtype).itemsize / row["allreduce_ms"] / 1e6
      del a
    except Exception as e:
      row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    rows.append(row)
    print(json.dumps(row), flush=True)


def summary(rows):
  print("\n== vocab parallel (per device) ==")
  for r in rows:
    if "kind" not in r and "mesh" not in r and "layout" not in r and "shape" not in r:
      print("section", r["section"], "failed:", r.get("error"))
  for r in rows:
    if r["section"] == "vocab_parallel" and "kind" in r:
      # one-device rows are the references of the ratios
      ratio = (f"ratio {r['head_bytes_ratio_vs_1dev']:.3f} (ideal {r['ideal_ratio']:.3f})"
               if "head_bytes_ratio_vs_1dev" in r else "(one-device reference)")
      print(f"{r['kind']:15} k={r['devices']} head {r.get('head_bytes', 0) / 1e9:7.3f} GB  temp "
            f"{r.get('temp_size_in_bytes', 0) / 1e9:7.3f} GB  {ratio}  {r.get('fwdbwd_ms', float('nan')):8.2f} ms  "
            f"{r.get('error', '')}")
  print("\n== equality (fp32, all options) ==")
  for r in rows:
    if r["section"] == "equality" and "mesh" in r:
      print(f"{r['impl']:8}", r["mesh"], {k: f"{r[k]:.1e}" for k in r if k.endswith("rel_err")}, r.get("pass_1e-5"),
            r.get("error", ""))
  print("\n== weak scaling ==")
  for r in rows:
    if r["section"] == "weak_scaling" and "layout" in r:
      print(f"{r['layout']:5} {r['impl']:8} k={r['devices']} {r.get('fwdbwd_ms', float('nan')):8.2f} ms  eff "
            f"{r.get('efficiency', float('nan')):.3f}  {r.get('error', '')}")
    if r["section"] == "allreduce" and "shape" in r:
      print(f"all-reduce H×V k={r['devices']}: {r.get('allreduce_ms', float('nan')):.2f} ms {r.get('error', '')}")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test)")
  ap.add_argument("--skip", default="", help="comma-separated sections to skip: vocab_parallel,equality,weak_scaling")
  args = ap.parse_args()
  devs = jax.devices()
  n = len(devs)
  skip = set(filter(None, args.skip.split(",")))
  if args.small:
    big = dict(b=256, h=64, v=4096)
    eq = dict(b=64 * n, h=32, v=1024 * n)
    dtype = jnp.float32
  else:
    big = dict(b=8192, h=4096, v=128256)
    eq = dict(b=512 * n, h=1024, v=32768)
    dtype = jnp.bfloat16
  meta = dict(device=devs[0].device_kind, n_devices=n, jax=jax.__version__,
              date=str(datetime.datetime.now(datetime.UTC).date()), small=args.small)
  print(json.dumps(meta), flush=True)
  rows = []
  sections = [("vocab_parallel", lambda: vocab_parallel(devs, big["b"], big["h"], big["v"], dtype, rows)),
              ("equality", lambda: equality(devs, eq["b"], eq["h"], eq["v"], rows)),
              ("weak_scaling", lambda: weak_scaling(devs, big["b"], big["h"], big["v"], dtype, rows,
                                                    impls=("auto", "chunked")))]
  for name, run in sections:
    if name in skip:
      continue
    try:
      run()
    except Exception as e:  # a section that fails as a whole (e.g. its reference) is recorded, the rest still run
      traceback.print_exc()
      rows.append(dict(section=name, error=f"{type(e).__name__}: {str(e)[:400]}"))
  summary(rows)
  out = os.environ.get("OUT", ".")
  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, f"multi_gpu_{n}gpu{'_small' if args.small else ''}.json")
  with open(path, "w") as fh:
    json.dump(dict(meta=meta, rows=rows), fh, indent=1)
  print("wrote", path)


if __name__ == "__main__":
  main()
