"""GPU check of ``impl="pallas_mosaic", mode="fast"`` (the stored-logits design) on an SM90 GPU.

Run from the repository root: ``PYTHONPATH=. python3 benchmarks/gpu_fast.py``. Writes ``$OUT/pallas_mosaic_fast.json``
after every step (device, versions, date), and prints one line per measurement.

1. correctness against the xla implementation on float32-upcast inputs (``highest`` matmul precision): a ragged
   medium shape with every option and a bias, both layouts, standard and peaky logits (logit std ≈ 10);
2. llama3-8b: loss/grad errors against xla; fwd+bwd time and compiled temp memory of the fast stored-logits
   design, the chunked fast design, and the lean kernels; the parts of the fast design on their own (forward
   kernel with its stores and the in-place dz pass, the dx and dw matmuls);
3. the other anchor shapes: fwd+bwd and temp of both fast designs and of lean.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.gpu_check_mosaic import RES, SHAPES, bench, inputs, rel, save, step, temp_bytes


def host_rel(a, b) -> float:
  """rel() on the host: works even on a device buffer that a later XLA computation would refuse."""
  a, b = (np.asarray(jax.device_get(t), np.float64) for t in (a, b))
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def misaligned(tree) -> list[int]:
  """Offsets mod 256 of the device buffers of a pytree's arrays (XLA GPU wants 256-byte aligned inputs)."""
  return [int(a.unsafe_buffer_pointer()) % 256 for a in jax.tree.leaves(tree) if hasattr(a, "unsafe_buffer_pointer")]
from lce_flax import _base, _math, linear_cross_entropy
from lce_flax import pallas_mosaic as pm

OUT_NAME = "pallas_mosaic_fast.json"
RES.update(fast=[], parts=[])


def _save():
  import os  # pylint: disable=g-import-not-at-top
  save()
  with open(os.path.join(os.environ.get("OUT", "."), OUT_NAME), "w") as f:
    import json  # pylint: disable=g-import-not-at-top
    json.dump(RES, f, indent=1)


def loss_fn(impl, mode, layout, y, bb=None, design=None, **opts):
  cfg = pm.Config(fast_design=design) if design else None

  def f(x, w, b):
    return linear_cross_entropy(x, w, y, bias=b, w_layout=layout, impl=impl, mode=mode, reduction="sum",
                                config=cfg, **opts)
  return f


@step("fast correctness")
def correctness(name, b, h, v, layout, wscale, bias=True, **opts):
  x, w, y, bb = inputs(b, h, v, layout, jnp.bfloat16, bias, wscale=wscale)
  argn = (0, 1, 2) if bias else (0, 1)
  got = jax.jit(jax.value_and_grad(loss_fn("pallas_mosaic", "fast", layout, y, design="logits", **opts), argn))
  up = lambda a: None if a is None else a.astype(jnp.float32)
  with jax.default_matmul_precision("highest"):
    ref = jax.jit(jax.value_and_grad(loss_fn("xla", None, layout, y, **opts), argn))
    l0, g0 = ref(up(x), up(w), up(bb))
  l1, g1 = got(x, w, bb)
  row = dict(name=name, shape=[b, h, v], layout=layout, wscale=wscale, opts=opts, misaligned_fast=misaligned((l1, g1)),
             misaligned_ref=misaligned((l0, g0)))
  print("ALIGN", row, flush=True)
  row.update(loss=float(jax.device_get(l1)), loss_ref=float(jax.device_get(l0)),
             dx_rel=host_rel(g1[0], g0[0]), dw_rel=host_rel(g1[1], g0[1]), db_rel=host_rel(g1[2], g0[2]) if bias else None)
  row["loss_rel"] = abs(row["loss"] - row["loss_ref"]) / abs(row["loss_ref"])
  # the lean kernels on the same inputs: the rounding of dz alone, for comparison
  row["misaligned_inputs"] = misaligned((x, w, bb))
  print("ALIGN inputs before lean", row["misaligned_inputs"], flush=True)
  lean = jax.jit(jax.value_and_grad(loss_fn("pallas_mosaic", "lean", layout, y, **opts), argn))
  l2, g2 = lean(x, w, bb)
  row.update(misaligned_lean=misaligned((l2, g2)), lean_dx_rel=host_rel(g2[0], g0[0]), lean_dw_rel=host_rel(g2[1], g0[1]))
  RES["fast"].append(row)
  print("CORRECT", row, flush=True)
  _save()


@step("fast timing")
def timing(shape_name, designs=("logits", "tokens", "chunked"), lean=True, parts=False, check=False):
  b, h, v = SHAPES[shape_name]
  x, w, y, _ = inputs(b, h, v, "hv", jnp.bfloat16, False, wscale=0.02)
  y = jnp.maximum(y, 0)
  runs = [("fast", d) for d in designs] + ([("lean", None)] if lean else [])
  grads = {}
  for mode, design in runs:
    f = jax.jit(jax.value_and_grad(loss_fn("pallas_mosaic", mode, "hv", y, design=design), (0, 1)))
    comp, ms = bench(f, x, w, None)
    row = dict(shape=shape_name, mode=mode, design=design, ms=ms, compile_s=comp, temp_bytes=temp_bytes(f, x, w, None),
               floor_ms_790=(6 if mode == "fast" else 8) * b * h * v / 790e12 * 1e3)
    if check:
      l, g = f(x, w, None)
      grads[(mode, design)] = (l, g)
    RES["timing"].append(row)
    print("TIME", row, flush=True)
    _save()
  if check:
    with jax.default_matmul_precision("highest"):
      l0, g0 = jax.jit(jax.value_and_grad(loss_fn("xla", None, "hv", y), (0, 1)))(x, w, None)
    for key, (l, g) in grads.items():
      row = dict(shape=shape_name, mode=key[0], design=key[1], loss_rel=abs(float(l - l0)) / abs(float(l0)),
                 dx_rel=rel(g[0], g0[0]), dw_rel=rel(g[1], g0[1]))
      RES["fast"].append(row)
      print("CORRECT", row, flush=True)
    del g0
  _save()
  if parts:
    time_parts(x, w, y)


def time_parts(x, w, y):
  """The fast design's pieces at this shape: forward kernel (+ stores), + the dz pass, and the two matmuls."""
  b, h = x.shape
  v = w.shape[1]
  spec = _base.Spec(_math.LossOptions(v))
  labels = y.astype(jnp.int32)
  wts = jnp.ones((b,), jnp.float32)
  p = pm.plan(b, h, v)
  lean_fwd = jax.jit(lambda x, w: pm.lean(x, w, None, labels, spec).loss.sum())
  store_fwd = jax.jit(lambda x, w: pm._fast_forward(x, w, None, labels, wts, spec, p)[2][0])  # dz buffer
  for name, f in (("forward (lean, stats only)", lean_fwd), ("forward + stores + dz pass", store_fwd)):
    comp, ms = bench(f, x, w)
    RES["parts"].append(dict(part=name, ms=ms, temp_bytes=temp_bytes(f, x, w)))
    print("PART", RES["parts"][-1], flush=True)
  dz = store_fwd(x, w)
  mm = {
      "dw = x^T dz (XLA, bf16 out)": (jax.jit(lambda x, dz: _base.grad_w(x, dz, "hv", out_dtype=x.dtype)), (x, dz)),
      "dx = dz w^T (XLA, f32 out)": (jax.jit(lambda dz, w: _base.grad_x(dz, w, "hv")), (dz, w)),
      "x @ w (XLA, bf16 out)": (jax.jit(lambda x, w: x @ w), (x, w)),
  }
  try:
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm  # pylint: disable=g-import-not-at-top
    cfg = hm.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4, grid_minor_dim=hm.MatmulDimension.N,
                          grid_tile_width=4, wg_dimension=hm.MatmulDimension.N)
    mm["dw = x^T dz (jax hopper_matmul_mgpu, x^T copied)"] = (
        jax.jit(lambda x, dz: hm.matmul(x.T, dz, None, cfg)), (x, dz))
    mm["x @ w (jax hopper_matmul_mgpu)"] = (jax.jit(lambda x, w: hm.matmul(x, w, None, cfg)), (x, w))
  except Exception as e:  # pylint: disable=broad-except
    RES["errors"].append(f"hopper_matmul: {type(e).__name__}: {e}")
  for name, (f, args) in mm.items():
    try:
      comp, ms = bench(f, *args)
      RES["parts"].append(dict(part=name, ms=ms, tflops=2 * b * h * v / ms / 1e9))
      print("PART", RES["parts"][-1], flush=True)
    except Exception as e:  # pylint: disable=broad-except
      RES["errors"].append(f"{name}: {type(e).__name__}: {str(e)[:300]}")
    _save()


def main():
  import sys  # pylint: disable=g-import-not-at-top
  RES["script"] = "benchmarks/gpu_fast.py"
  if "--quick" in sys.argv:  # correctness + the memory of the fast design at two shapes
    correctness("ragged, all options", 1000, 512, 5003, "vh", 0.3, label_smoothing=0.1, z_loss=1e-3,
                logit_softcap=30.0)
    correctness("ragged, no bias", 1000, 512, 5003, "vh", 0.3, bias=False)
    correctness("ragged, peaky, softcap 30", 1000, 512, 5003, "hv", 0.5, logit_softcap=30.0)
    timing("llama3-8b", designs=("logits",), lean=False, check=True)
    timing("qwen3-8b", designs=("logits",), lean=False)
    timing("gpt2-small", designs=("tokens", "logits"), lean=False)
    timing("gemma2-2b", designs=("logits",), lean=False)
    _save()
    print("ERRORS", RES["errors"], flush=True)
    return
  opts = dict(label_smoothing=0.1, z_loss=1e-3, logit_softcap=30.0)
  for layout in ("hv", "vh"):
    correctness("ragged, all options", 1000, 512, 5003, layout, 0.3, **opts)
  correctness("ragged, peaky (logit std ~11)", 1000, 512, 5003, "hv", 0.5)
  correctness("ragged, peaky, softcap 30", 1000, 512, 5003, "vh", 0.5, logit_softcap=30.0)
  timing("llama3-8b", check=True, parts=True)
  for name in ("qwen3-8b", "gpt2-small", "gemma2-2b"):
    timing(name)
  _save()
  print("ERRORS", RES["errors"], flush=True)


if __name__ == "__main__":
  main()
