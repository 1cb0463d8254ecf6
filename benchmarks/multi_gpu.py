"""Several GPUs, through the wrapperless path users take: plain ``jax.jit`` on ``NamedSharding``-placed arrays under
``jax.set_mesh(mesh)``, calling :func:`lce_flax.linear_cross_entropy` (``impl="auto"``) directly.

Usage on a multi-GPU device: ``python3 -m benchmarks.multi_gpu`` (all visible GPUs; writes
``$OUT/multi_gpu_<n>gpu.json`` and prints a summary). ``--small`` runs tiny shapes (a CPU smoke test:
``XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu python -m benchmarks.multi_gpu --small``).
``--skip vocab_parallel,equality,weak_scaling,fsdp_step`` leaves sections out.

Every row says which ``path`` ran it:

* ``auto``: a mesh of ``AxisType.Auto`` axes, the context mesh set with ``jax.set_mesh``; the op is
  custom-partitioned (``lce_flax/_partition.py``): each device runs the single-device op on its shard.
* ``explicit``: a mesh of ``AxisType.Explicit`` axes; the op reads the layout from the input types
  (``lce_flax.sharding.from_types``) and runs the shard_map form.
* ``local``: one device, or a mesh whose axes all have size 1 (the op is not partitioned).
* ``linen.LMHead``: ``lce_flax.linen.LMHead.apply`` on the same placed arrays.

Sections (each row records its error instead of stopping the run):

* ``vocab_parallel`` (first, so that ``peak_bytes_in_use`` — a process-lifetime peak — is least polluted):
  llama3-8b head (B=8192 tokens, H=4096, V=128256, bf16, mean), tokens replicated, ``w`` split over a
  ``tensor`` axis of size k = n, …, 2 (Explicit and Auto): ``impl="auto"`` fast (the chunked token loop) and lean
  (the kernels), and each kernel backend's lean design; then one device with the same designs (the references
  of the ratios) and ``impl="auto"``. Each row names the design that ran (``runs``, from ``lce_flax.explain``).
  Per device: compiled argument/output/temp bytes (``memory_analysis``), fwd+bwd time, and the loss and the norms
  of dx, dw against one device's; ``temp_ratio_vs_1dev`` = temp bytes / one device's (same design), target
  ≤ 1.15 / k.
* ``equality``: float32 with every option (bias, ignored tokens, ``where``, label smoothing, z-loss, softcap),
  ``impl="auto"``, meshes data = n, fsdp = n, tensor = n, every mix of two or three axes > 1 (none for n = 2),
  each under Auto and Explicit axes; one ``linen.LMHead`` row; tensor = n with ``mode="lean"`` (the kernels on
  each device's columns). loss/dx/dw/dbias relative error against the op on one device
  (``jax.default_matmul_precision("highest")`` on both sides); target ≤ 1e-5.
* ``weak_scaling``: data parallel (``data`` = k) and FSDP (``fsdp`` = k, ``w`` split over H) with 8192 tokens per
  device at the llama3-8b head, bf16, mean, k = 2, 4, … ≤ n, Auto and Explicit axes; k = 1 is one row (every
  layout and axis type is the same unpartitioned program there). efficiency = t(1) / t(k); per-device compiled
  temp bytes. Also a bare all-reduce of an H×V bf16 array (the dw reduction a data-parallel step pays).
* ``fsdp_step``: one SGD step of the head (loss, dw, ``w - lr·dw`` with ``w`` donated) with ``w`` stored split over
  ``fsdp`` = n (Auto and Explicit) against one device, 8192 tokens per device: step time and per-device bytes
  (``w`` shard, arguments, temp).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import lce_flax
from lce_flax import linear_cross_entropy

AXES = ("data", "fsdp", "tensor")
TOK = P(("data", "fsdp"))  # tokens over both data axes (axes of size 1 are ignored by the op)
W = P("fsdp", "tensor")  # w [H, V]: H over fsdp, V over tensor
REPS = 5
EQ_OPTS = dict(label_smoothing=0.1, z_loss=1e-3, logit_softcap=30.0)
EQ_TARGET = 1e-5
VP_SLACK = 1.15


def make_mesh(devs, types: str, data=1, fsdp=1, tensor=1):
  """A (data, fsdp, tensor) mesh of ``AxisType.Auto`` (types="auto") or ``AxisType.Explicit`` axes."""
  shape = (data, fsdp, tensor)
  kind = AxisType.Auto if types == "auto" else AxisType.Explicit
  return jax.make_mesh(shape, AXES, axis_types=(kind,) * 3, devices=devs[:math.prod(shape)])


def bench(f, *args, reps=REPS):
  """Median ms of ``reps`` calls after one warm-up."""
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
  """Per-device compiled bytes (XLA's memory_analysis of the partitioned program)."""
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


def err(e: BaseException) -> str:
  return f"{type(e).__name__}: {str(e)[:500]}"


def _pow2_upto(n: int):
  k, out = 1, []
  while k <= n:
    out.append(k)
    k *= 2
  return out


def _emit(rows, row):
  rows.append(row)
  print(json.dumps(row), flush=True)


def _place(mesh, specs_and_arrays):
  return tuple(None if a is None else jax.device_put(a, NamedSharding(mesh, s)) for s, a in specs_and_arrays)


# ------------------------------------------------------------------------------------------------ sections


VP_KERNELS = ("pallas_mosaic", "pallas_triton", "triton")  # their lean designs, on each device's columns


def vocab_parallel(devs, b, h, v, dtype, rows):
  n = len(devs)
  key = jax.random.key(1)
  # (devices, path, impl, mode): impl="auto" fast (the chunked token loop, the one vocab-parallel fast design) and
  # lean (the kernels), each kernel's lean design, on Explicit and Auto axes; then one device, same designs
  configs = []
  for k in reversed(_pow2_upto(n)):
    if k > 1:
      configs += [(k, "explicit", "auto", "fast"), (k, "explicit", "auto", "lean"), (k, "auto", "auto", "fast"),
                  (k, "auto", "auto", "lean")]
      configs += [(k, "explicit", impl, "lean") for impl in VP_KERNELS[1:]]
  configs += [(1, "local", "chunked", "fast"), (1, "local", "chunked", "lean"), (1, "local", "auto", None)]
  configs += [(1, "local", impl, "lean") for impl in VP_KERNELS]
  for k, path, impl, mode in configs:
    row = dict(section="vocab_parallel", path=path, devices=k, impl=impl, mode=mode, B=b, H=h, V=v,
               dtype=str(jnp.dtype(dtype)))
    try:
      if path == "local":
        mesh = None
        rep = wsh = jax.sharding.SingleDeviceSharding(devs[0])
        shards = 1
      else:
        mesh = make_mesh(devs, path, tensor=k)
        rep, wsh = NamedSharding(mesh, P()), NamedSharding(mesh, P(None, "tensor"))
        shards = k
      design = lce_flax.explain(jax.ShapeDtypeStruct((b, h), dtype), jax.ShapeDtypeStruct((h, v), dtype),
                                vocab_shards=shards, impl=impl, mode=mode)
      row["runs"] = f"{design.impl}:{design.mode}:{design.name}"
      op = functools.partial(linear_cross_entropy, impl=impl, mode=mode)
      g = jax.jit(jax.value_and_grad(op, argnums=(0, 1)))
      with jax.set_mesh(mesh) if mesh is not None else _null():
        x = rand(jax.random.fold_in(key, 0), (b, h), dtype, rep)
        w = rand(jax.random.fold_in(key, 1), (h, v), dtype, wsh, 0.02)
        y = rand_labels(jax.random.fold_in(key, 2), (b,), v, rep)
        c = g.lower(x, w, y).compile()
        row.update(mem(c))
        row["fwdbwd_ms"] = bench(c, x, w, y)
        row["peak_bytes_in_use"] = peak_bytes(devs[:k])
        loss, (dx, dw) = c(x, w, y)
        row["loss"] = float(loss)
        row["dx_norm"] = float(jnp.linalg.norm(dx.astype(jnp.float32)))
        row["dw_norm"] = float(jnp.linalg.norm(dw.astype(jnp.float32)))
      del x, w, y, c, dx, dw
    except Exception as e:
      row["error"] = err(e)
      traceback.print_exc()
    _emit(rows, row)
  local = {(r["impl"], r["mode"]): r for r in rows
           if r["section"] == "vocab_parallel" and r["path"] == "local" and "head_bytes" in r}
  for r in rows:
    if r["section"] != "vocab_parallel" or r["path"] == "local" or "head_bytes" not in r:
      continue
    # the same design on one device: auto's lean is the first kernel's, its fast the chunked loop
    ref_key = (r["impl"], r["mode"])
    if r["impl"] == "auto":
      ref_key = ("chunked", "fast") if r["mode"] == "fast" else (r["runs"].split(":")[0], "lean")
    one = local.get(ref_key)
    if one is not None:
      r["reference"] = f"1 device {ref_key[0]}:{ref_key[1]}"
      r["temp_ratio_vs_1dev"] = r["temp_size_in_bytes"] / max(one["temp_size_in_bytes"], 1)
      r["head_bytes_ratio_vs_1dev"] = r["head_bytes"] / one["head_bytes"]
      r["target_ratio"] = VP_SLACK / r["devices"]
      r["pass_temp"] = r["temp_ratio_vs_1dev"] <= r["target_ratio"]
      r["loss_rel_err_vs_1dev"] = abs(r["loss"] - one["loss"]) / abs(one["loss"])
      r["dx_norm_rel_vs_1dev"] = abs(r["dx_norm"] - one["dx_norm"]) / one["dx_norm"]
      r["dw_norm_rel_vs_1dev"] = abs(r["dw_norm"] - one["dw_norm"]) / one["dw_norm"]
      r["speedup_vs_1dev"] = one["fwdbwd_ms"] / r["fwdbwd_ms"]


class _null:
  def __enter__(self):
    return None

  def __exit__(self, *a):
    return False


def _eq_meshes(n: int):
  """(label, sizes, axis types) of the equality rows."""
  out = []
  for t in ("auto", "explicit"):
    out += [("data", dict(data=n), t), ("fsdp", dict(fsdp=n), t)]
  out += [("tensor", dict(tensor=n), "auto"), ("tensor", dict(tensor=n), "explicit")]
  for d in range(1, n + 1):
    for f in range(1, n // d + 1):
      if n % (d * f):
        continue
      s = dict(data=d, fsdp=f, tensor=n // (d * f))
      if sum(v > 1 for v in s.values()) >= 2:
        for t in ("auto", "explicit"):
          out.append(("mix", s, t))
  return out


def equality(devs, b, h, v, rows):
  n = len(devs)
  key = jax.random.key(2)
  one = jax.sharding.SingleDeviceSharding(devs[0])
  x0 = rand(jax.random.fold_in(key, 0), (b, h), jnp.float32, one)
  w0 = rand(jax.random.fold_in(key, 1), (h, v), jnp.float32, one, 0.05)
  b0 = rand(jax.random.fold_in(key, 3), (v,), jnp.float32, one)
  y0 = rand_labels(jax.random.fold_in(key, 2), (b,), v, one, ignore_frac=0.1)
  m0 = jax.jit(lambda k: jax.random.uniform(k, (b,)) < 0.9, out_shardings=one)(jax.random.fold_in(key, 4))

  def op(x, w, bb, y, m):
    return linear_cross_entropy(x, w, y, bias=bb, where=m, impl="auto", **EQ_OPTS)

  g_op = jax.jit(jax.value_and_grad(op, (0, 1, 2)))
  with jax.default_matmul_precision("highest"):
    l0, g0 = g_op(x0, w0, b0, y0, m0)  # one device, no context mesh
  ref = dict(loss=float(l0))
  print(json.dumps(dict(section="equality", reference="1 device", impl="auto", **ref)), flush=True)

  def head_op(x, w, bb, y, m):
    head = lce_flax.linen.LMHead(v, use_bias=True, kernel_axes=None, bias_axes=None,
                                 options=lce_flax.LossOptions(impl="auto", **EQ_OPTS))
    return head.apply({"params": {"kernel": w, "bias": bb}}, x, y, where=m)

  g_head = jax.jit(jax.value_and_grad(head_op, (0, 1, 2)))
  def op_lean(x, w, bb, y, m):  # the kernels' lean design on each device's columns (fp32: pallas_triton)
    return linear_cross_entropy(x, w, y, bias=bb, where=m, impl="auto", mode="lean", **EQ_OPTS)

  g_lean = jax.jit(jax.value_and_grad(op_lean, (0, 1, 2)))
  cases = [(label, s, t, "op") for label, s, t in _eq_meshes(n)]
  cases.append(("fsdp", dict(fsdp=n), "explicit", "linen.LMHead"))
  cases += [("tensor", dict(tensor=n), t, "lean") for t in ("auto", "explicit")]
  for label, sizes, types, what in cases:
    row = dict(section="equality", mesh=label, sizes=dict(zip(AXES, (sizes.get(a, 1) for a in AXES))),
               path=types if what == "op" else f"{types}:{what}", impl="auto", B=b, H=h, V=v, dtype="float32",
               **EQ_OPTS)
    try:
      mesh = make_mesh(devs, types, **sizes)
      with jax.set_mesh(mesh), jax.default_matmul_precision("highest"):
        x, w, bb, y, m = _place(mesh, ((TOK, x0), (W, w0), (P("tensor"), b0), (TOK, y0), (TOK, m0)))
        l1, g1 = {"linen.LMHead": g_head, "lean": g_lean}.get(what, g_op)(x, w, bb, y, m)
        l1 = float(l1)
      errs = dict(loss_rel_err=rel(l1, l0), dx_rel_err=rel(g1[0], g0[0]), dw_rel_err=rel(g1[1], g0[1]),
                  dbias_rel_err=rel(g1[2], g0[2]))
      row.update(loss=l1, loss_ref=float(l0), **errs, max_rel_err=max(errs.values()))
      row["ok"] = row["max_rel_err"] <= EQ_TARGET
    except Exception as e:
      row.update(ok=False, error=err(e))
      traceback.print_exc()
    _emit(rows, row)
  if n < 4:
    print(f"equality: no mix of two mesh axes > 1 exists for n={n} devices", flush=True)


def _ws_data(key, mesh, k, b_per, h, v, dtype, layout):
  tok = NamedSharding(mesh, TOK) if mesh is not None else jax.sharding.SingleDeviceSharding(jax.devices()[0])
  wsh = (NamedSharding(mesh, P("fsdp", None) if layout == "fsdp" else P()) if mesh is not None else tok)
  x = rand(jax.random.fold_in(key, 0), (b_per * k, h), dtype, tok)
  w = rand(jax.random.fold_in(key, 1), (h, v), dtype, wsh, 0.02)
  y = rand_labels(jax.random.fold_in(key, 2), (b_per * k,), v, tok)
  return x, w, y


def weak_scaling(devs, b_per, h, v, dtype, rows):
  n = len(devs)
  key = jax.random.key(3)
  op = functools.partial(linear_cross_entropy, impl="auto")
  g = jax.jit(jax.value_and_grad(op, argnums=(0, 1)))
  configs = [("any", "local", 1)]
  configs += [(layout, types, k) for layout in ("data", "fsdp") for types in ("auto", "explicit")
              for k in _pow2_upto(n)[1:]]
  base = None
  for layout, path, k in configs:
    row = dict(section="weak_scaling", layout=layout, path=path, impl="auto", devices=k, tokens_per_device=b_per,
               H=h, V=v, dtype=str(jnp.dtype(dtype)))
    if k == 1:
      row["note"] = "k=1: every layout and axis type runs this same unpartitioned program"
    try:
      mesh = None if k == 1 else make_mesh(devs, path, **{layout: k})
      with jax.set_mesh(mesh) if mesh is not None else _null():
        x, w, y = _ws_data(key, mesh, k, b_per, h, v, dtype, layout)
        c = g.lower(x, w, y).compile()
      row.update(mem(c))
      row["fwdbwd_ms"] = bench(c, x, w, y)
      if k == 1:
        base = row
      if base is not None:
        row["efficiency"] = base["fwdbwd_ms"] / row["fwdbwd_ms"]
        row["temp_ratio_vs_1dev"] = row["temp_size_in_bytes"] / max(base["temp_size_in_bytes"], 1)
      row["tokens_per_s"] = b_per * k / row["fwdbwd_ms"] * 1e3
      del x, w, y, c
    except Exception as e:
      row["error"] = err(e)
      traceback.print_exc()
    _emit(rows, row)
  for k in _pow2_upto(n)[1:]:
    row = dict(section="allreduce", devices=k, shape=[h, v], dtype=str(jnp.dtype(dtype)))
    try:
      mesh = make_mesh(devs, "auto", data=k)
      a = rand(jax.random.fold_in(key, 9), (k * h, v), dtype, NamedSharding(mesh, P("data")))
      ar = jax.jit(jax.shard_map(lambda t: jax.lax.psum(t, "data"), mesh=mesh, in_specs=P("data"),
                                 out_specs=P()))
      row["allreduce_ms"] = bench(ar, a)
      row["algbw_GBps"] = h * v * jnp.dtype(dtype).itemsize / row["allreduce_ms"] / 1e6
      del a
    except Exception as e:
      row["error"] = err(e)
    _emit(rows, row)


def fsdp_step(devs, b_per, h, v, dtype, rows, lr=1e-3):
  n = len(devs)
  key = jax.random.key(4)

  def step(x, w, y):
    loss, dw = jax.value_and_grad(functools.partial(linear_cross_entropy, impl="auto"), argnums=1)(x, w, y)
    return loss, (w.astype(jnp.float32) - lr * dw.astype(jnp.float32)).astype(w.dtype)

  configs = [("local", 1)] + ([("auto", n), ("explicit", n)] if n > 1 else [])
  base = None
  for path, k in configs:
    row = dict(section="fsdp_step", path=path, impl="auto", devices=k, tokens_per_device=b_per, H=h, V=v,
               dtype=str(jnp.dtype(dtype)), w_shard_bytes=h * v * jnp.dtype(dtype).itemsize // k)
    try:
      mesh = None if k == 1 else make_mesh(devs, path, fsdp=k)
      with jax.set_mesh(mesh) if mesh is not None else _null():
        x, w, y = _ws_data(key, mesh, k, b_per, h, v, dtype, "fsdp")
        out_sh = None if mesh is None else (NamedSharding(mesh, P()), w.sharding)
        s = jax.jit(step, donate_argnums=1, out_shardings=out_sh)
        c = s.lower(x, w, y).compile()
      row.update(mem(c))
      for _ in range(2):  # warm-up (w is donated: carry it)
        loss, w = c(x, w, y)
      jax.block_until_ready(w)
      ts = []
      for _ in range(REPS):
        t = time.perf_counter()
        loss, w = c(x, w, y)
        jax.block_until_ready(w)
        ts.append(time.perf_counter() - t)
      row["step_ms"] = float(np.median(ts)) * 1e3
      row["loss"] = float(loss)
      if k == 1:
        base = row
      elif base is not None:
        row["efficiency"] = base["step_ms"] / row["step_ms"]
        row["temp_ratio_vs_1dev"] = row["temp_size_in_bytes"] / max(base["temp_size_in_bytes"], 1)
        row["argument_ratio_vs_1dev"] = row["argument_size_in_bytes"] / base["argument_size_in_bytes"]
      del x, w, y, c
    except Exception as e:
      row["error"] = err(e)
      traceback.print_exc()
    _emit(rows, row)


# ------------------------------------------------------------------------------------------------ summary


def _gb(x):
  return f"{x / 1e9:8.3f}" if isinstance(x, (int, float)) else f"{'-':>8}"


def _f(x, fmt):
  return format(x, fmt) if isinstance(x, (int, float)) and not isinstance(x, bool) else "-"


def summary(rows):
  for r in rows:
    if set(r) <= {"section", "error"}:
      print("section", r["section"], "failed:", r.get("error"))
  sec = lambda s: [r for r in rows if r["section"] == s and set(r) - {"section", "error"}]
  if sec("vocab_parallel"):
    print(f"\n== vocab parallel (per device; ratio vs one device, same design; target <= {VP_SLACK}/k) ==")
    print(f"{'path':9} {'k':>2} {'impl':13} {'mode':5} {'runs':32} {'temp GB':>8} {'head GB':>8} {'temp ratio':>10} "
          f"{'target':>6} {'ms':>8} {'loss err':>8}  ok")
    for r in sec("vocab_parallel"):
      ok = r.get("pass_temp", "ref" if r["path"] == "local" else "-")
      print(f"{r['path']:9} {r['devices']:>2} {r['impl']:13} {str(r['mode']):5} {r.get('runs', ''):32} "
            f"{_gb(r.get('temp_size_in_bytes'))} "
            f"{_gb(r.get('head_bytes'))} {_f(r.get('temp_ratio_vs_1dev'), '10.3f'):>10} "
            f"{_f(r.get('target_ratio'), '6.3f'):>6} {_f(r.get('fwdbwd_ms'), '8.2f'):>8} "
            f"{_f(r.get('loss_rel_err_vs_1dev'), '8.1e'):>8}  {ok} {r.get('error', '')}")
  if sec("equality"):
    print(f"\n== equality (fp32, every option, impl=auto; max rel err vs one device, target <= {EQ_TARGET}) ==")
    print(f"{'mesh':7} {'sizes d/f/t':11} {'path':22} {'loss':>8} {'dx':>8} {'dw':>8} {'dbias':>8}  ok")
    for r in sec("equality"):
      s = "/".join(str(r["sizes"][a]) for a in AXES)
      print(f"{r['mesh']:7} {s:11} {r['path']:22} " + " ".join(
          f"{_f(r.get(k + '_rel_err'), '8.1e'):>8}" for k in ("loss", "dx", "dw", "dbias"))
          + f"  {r.get('ok')} {r.get('error', '')}")
  if sec("weak_scaling") or sec("allreduce"):
    print("\n== weak scaling (tokens per device fixed; efficiency = t(1)/t(k)) ==")
    print(f"{'layout':6} {'path':9} {'k':>2} {'ms':>8} {'eff':>6} {'temp GB':>8} {'tok/s':>10}")
    for r in sec("weak_scaling"):
      print(f"{r['layout']:6} {r['path']:9} {r['devices']:>2} {_f(r.get('fwdbwd_ms'), '8.2f'):>8} "
            f"{_f(r.get('efficiency'), '6.3f'):>6} {_gb(r.get('temp_size_in_bytes'))} "
            f"{_f(r.get('tokens_per_s'), '10.0f'):>10} {r.get('error', '')}")
    for r in sec("allreduce"):
      print(f"all-reduce H x V k={r['devices']}: {_f(r.get('allreduce_ms'), '.2f')} ms {r.get('error', '')}")
  if sec("fsdp_step"):
    print("\n== FSDP step (loss, dw, SGD update of the donated w; per device) ==")
    print(f"{'path':9} {'k':>2} {'ms':>8} {'eff':>6} {'w shard GB':>10} {'args GB':>8} {'temp GB':>8}")
    for r in sec("fsdp_step"):
      print(f"{r['path']:9} {r['devices']:>2} {_f(r.get('step_ms'), '8.2f'):>8} {_f(r.get('efficiency'), '6.3f'):>6} "
            f"{_gb(r.get('w_shard_bytes')):>10} {_gb(r.get('argument_size_in_bytes'))} "
            f"{_gb(r.get('temp_size_in_bytes'))} {r.get('error', '')}")
  if any(r.get("B") == 256 for r in sec("vocab_parallel")):
    print("(--small: fixed-size buffers dominate tiny shapes; the vocab-parallel memory target is meant for the "
          "llama3-8b head)")
  bad = [r for r in rows if r.get("error")]
  print(f"\n{len(rows)} rows, {len(bad)} with errors")


def _versions() -> dict:
  out = dict(jax=jax.__version__, lce_flax=lce_flax.__version__)
  try:
    import jaxlib  # pylint: disable=g-import-not-at-top
    out["jaxlib"] = getattr(jaxlib, "__version__", None) or jaxlib.version.__version__
  except Exception:
    out["jaxlib"] = None
  for mod in ("triton", "jax_triton"):
    try:
      out[mod] = __import__(mod).__version__
    except Exception:
      out[mod] = None
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test)")
  ap.add_argument("--skip", default="",
                  help="comma-separated sections to skip: vocab_parallel,equality,weak_scaling,fsdp_step")
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
  meta = dict(device=devs[0].device_kind, platform=devs[0].platform, n_devices=n, **_versions(),
              date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), small=args.small,
              reps=REPS, note="wrapperless path: jax.jit + NamedSharding under jax.set_mesh, "
                              "lce_flax.linear_cross_entropy(impl='auto'); rows name their path")
  print(json.dumps(meta), flush=True)
  rows = []
  t0 = time.perf_counter()
  sections = [("vocab_parallel", lambda: vocab_parallel(devs, big["b"], big["h"], big["v"], dtype, rows)),
              ("equality", lambda: equality(devs, eq["b"], eq["h"], eq["v"], rows)),
              ("weak_scaling", lambda: weak_scaling(devs, big["b"], big["h"], big["v"], dtype, rows)),
              ("fsdp_step", lambda: fsdp_step(devs, big["b"], big["h"], big["v"], dtype, rows))]
  for name, run in sections:
    if name in skip:
      continue
    ts = time.perf_counter()
    try:
      run()
    except Exception as e:  # a section that fails as a whole (e.g. its reference) is recorded, the rest still run
      traceback.print_exc()
      rows.append(dict(section=name, error=err(e)))
    meta.setdefault("section_s", {})[name] = round(time.perf_counter() - ts, 1)
  meta["total_s"] = round(time.perf_counter() - t0, 1)
  summary(rows)
  print("section seconds:", meta.get("section_s"), "total", meta["total_s"])
  out = os.environ.get("OUT", ".")
  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, f"multi_gpu_{n}gpu{'_small' if args.small else ''}.json")
  with open(path, "w") as fh:
    json.dump(dict(meta=meta, rows=rows), fh, indent=1)
  print("wrote", path)


if __name__ == "__main__":
  main()
