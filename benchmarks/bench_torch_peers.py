"""The PyTorch peers of a fused linear + cross-entropy, timed like ``bench.py`` times ours, same JSON-line schema.

Usage (on a CUDA machine; torch is on the GPU image, the others are optional)::

  python -m benchmarks.bench_torch_peers [--preset llm] [--impls torch_eager,torch_compile,liger_flce,cce]
                                         [--out DIR] [--time-limit-s SECONDS]

Peers: ``torch_eager`` (``F.cross_entropy`` on fp32 logits of ``x @ w.T``), ``torch_compile`` (the same under
``torch.compile``), ``liger_flce`` (liger-kernel's ``LigerFusedLinearCrossEntropyLoss``) and ``cce`` (Apple's
cut-cross-entropy ``linear_cross_entropy`` as users call it: its backward skips the blocks of the logit gradient
whose entries are all below its ``filter_eps``, bf16's eps / 32 by default); ``cce_exact`` (not in the default
list) is CCE with ``filter_eps=None``, every block's products done, which separates what the filter saves from
what its kernels do. One that does not import is recorded as unavailable. Liger and CCE
are not on the GPU image: carry their wheels (``benchmarks/run_gpu.sh`` installs what it finds in ``.whl/``).

Same inputs as ``bench.py`` (bf16 x ~ N(0,1) [B, H]; w = 0.02·N(0,1), here [V, H] as torch heads store it;
labels uniform; reduction "sum"), same timing (warm-up, then the median of repeated runs, wall clock around
``torch.cuda.synchronize()``), same rows. Memory: ``device_peak_bytes`` is the allocator's peak over one step
minus what was allocated before it, with the inputs and the previous step's gradients already in place, i.e. the
extra memory beyond inputs and gradients (``temp_bytes`` is null: torch has no compile-time figure).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

from benchmarks import shapes as shapes_lib
from benchmarks.shapes import PEAK_TFLOPS, Preset, Shape

PEERS = ("torch_compile", "cce", "liger_flce", "torch_eager")  # default order: most telling first
OPTIONAL = ("cce_exact",)
# FLOPs of a fwd+bwd in units of B·H·V: autograd over stored logits and Liger (gradients formed chunk by chunk in
# the forward) do 6; CCE recomputes the logits in its backward: 8.
FLOPS_FACTOR = {"torch_eager": 6, "torch_compile": 6, "liger_flce": 6, "cce": 8, "cce_exact": 8}


def _version(dist: str) -> str | None:
  try:
    return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    return None


def make_peers(torch, names) -> dict[str, Callable | str]:
  """name -> loss(x [B,H], w [V,H], labels [B]) (summed), or the reason it is unavailable."""
  import torch.nn.functional as F  # noqa: N812, PLC0415

  def eager(x, w, y):
    return F.cross_entropy((x @ w.T).float(), y, reduction="sum")

  peers: dict[str, Callable | str] = {}
  for name in names:
    try:
      if name == "torch_eager":
        peers[name] = eager
      elif name == "torch_compile":
        dyn = torch._dynamo.config  # one graph per shape and pass: raise the recompile limit above their count
        for attr in ("cache_size_limit", "recompile_limit"):
          if hasattr(dyn, attr):
            setattr(dyn, attr, 64)
        peers[name] = torch.compile(eager, dynamic=False)
      elif name == "liger_flce":
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss  # noqa: PLC0415
        module = LigerFusedLinearCrossEntropyLoss(reduction="sum")
        peers[name] = lambda x, w, y, m=module: m(w, x, y)  # Liger takes (weight, input, target)
      elif name in ("cce", "cce_exact"):
        from cut_cross_entropy import linear_cross_entropy  # noqa: PLC0415
        kw = {"filter_eps": None} if name == "cce_exact" else {}
        peers[name] = lambda x, w, y, f=linear_cross_entropy, kw=kw: f(x, w, y, reduction="sum", **kw)
      else:
        raise ValueError(f"--impls: {name!r} is not one of {PEERS + OPTIONAL}")
    except ValueError:
      raise
    except Exception as e:  # noqa: BLE001 - a peer that does not import is recorded, not fatal
      peers[name] = f"{type(e).__name__}: {str(e)[:200]}"
  return peers


def environment(torch) -> dict:
  cuda = torch.cuda.is_available()
  return dict(
      device=torch.cuda.get_device_name(0) if cuda else "cpu", platform="gpu" if cuda else "cpu",
      num_devices=torch.cuda.device_count() if cuda else 1, torch=torch.__version__, triton=_version("triton"),
      liger_kernel=_version("liger-kernel"), cut_cross_entropy=_version("cut-cross-entropy"),
      date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"))


def make_inputs(torch, shape: Shape, device, seed: int = 0):
  g = torch.Generator(device=device).manual_seed(seed)
  x = torch.randn(shape.B, shape.H, device=device, generator=g).to(torch.bfloat16).requires_grad_()
  w = (0.02 * torch.randn(shape.V, shape.H, device=device, generator=g)).to(torch.bfloat16).requires_grad_()
  y = torch.randint(0, shape.V, (shape.B,), device=device, generator=g)
  return x, w, y


def reference_loss(torch, x, w, y, chunk: int = 8192) -> float:
  """Summed cross-entropy in float32 without TF32, vocabulary chunk by chunk (no [B, V] array)."""
  tf32 = torch.backends.cuda.matmul.allow_tf32
  torch.backends.cuda.matmul.allow_tf32 = False
  try:
    with torch.no_grad():
      xf = x.float()
      lses = [torch.logsumexp(xf @ w[i:i + chunk].float().T, dim=-1) for i in range(0, w.shape[0], chunk)]
      lse = torch.logsumexp(torch.stack(lses), dim=0)
      target = (xf * w[y].float()).sum(-1)
      return float((lse - target).sum())
  finally:
    torch.backends.cuda.matmul.allow_tf32 = tf32


def measure(torch, loss_fn, pass_: str, shape: Shape, x, w, y, preset: Preset, factor: int) -> dict:
  sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)

  def step():
    x.grad = None
    w.grad = None
    if pass_ == "fwd":
      with torch.no_grad():
        return loss_fn(x, w, y)
    loss = loss_fn(x, w, y)
    loss.backward()
    return loss

  t = time.perf_counter()
  step()  # warm-up: compilation (torch.compile, Triton autotuning) stays out of the numbers
  sync()
  warmup_s = time.perf_counter() - t
  peak = None
  if x.is_cuda:
    base = torch.cuda.memory_allocated()  # inputs and the warm-up's gradients
    torch.cuda.reset_peak_memory_stats()
  t = time.perf_counter()
  loss = step()
  sync()
  times = [time.perf_counter() - t]
  if x.is_cuda:
    peak = torch.cuda.max_memory_allocated() - base
  reps = int(min(max(preset.target_s / max(times[0], 1e-6), preset.min_reps), preset.max_reps))
  for _ in range(reps - 1):
    t = time.perf_counter()
    loss = step()
    sync()
    times.append(time.perf_counter() - t)
  ms = statistics.median(times) * 1e3
  algo = 2 if pass_ == "fwd" else factor
  norms = {}
  if pass_ == "fwdbwd":  # as bench.py: float32 norms of the gradients, a cheap cross-implementation sanity check
    norms = dict(dx_norm=float(x.grad.float().norm()), dw_norm=float(w.grad.float().norm()))
  return dict(ms=ms, ms_min=min(times) * 1e3, reps=len(times), compile_s=warmup_s,
              tflops=shape.flops(2 if pass_ == "fwd" else 6) / ms / 1e9, algo_tflops=shape.flops(algo) / ms / 1e9,
              flops_factor=algo, temp_bytes=None, device_peak_bytes=peak, loss=float(loss.detach()),
              timer="wallclock", **norms)


def run(preset: Preset, names, out_dir: str, time_limit_s: float | None = None) -> str:
  import torch  # noqa: PLC0415 - only here, so that importing this module needs no torch

  device = "cuda" if torch.cuda.is_available() else "cpu"
  env = environment(torch)
  peers = make_peers(torch, names)
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, f"torch_peers_{preset.name}.jsonl")
  start = time.monotonic()
  print(f"# {env['device']}, torch {env['torch']}, peers {list(peers)}, time limit {time_limit_s} s -> {path}",
        flush=True)
  with open(path, "w") as fh:
    refs: dict[str, float | None] = {}
    # Each peer over every shape in turn, in the order asked: a time-limit cut drops the last peers, not the last
    # shapes.
    for name, fn in peers.items():
      for shape, axis, passes in shapes_lib.preset_shapes(preset):
        inputs, err = None, "inputs were not made"
        for pass_ in passes:
          row = dict(env, source="torch", preset=preset.name, shape=shape.name, sweep=axis, B=shape.B, H=shape.H,
                     V=shape.V, dtype="bfloat16", reduction="sum", impl=name, mode=None, label=name,
                     **{"pass": pass_}, floor_ms=shape.floor_ms(2 if pass_ == "fwd" else 6), peak_tflops=PEAK_TFLOPS)
          if time_limit_s is not None and time.monotonic() - start > time_limit_s:
            row["error"] = f"skipped: past --time-limit-s={time_limit_s:g}"
          elif isinstance(fn, str):
            row["error"] = f"unavailable: {fn}"
          else:
            if inputs is None and err == "inputs were not made":
              try:
                inputs = make_inputs(torch, shape, device)  # seeded: the same inputs for every peer
                if preset.reference and shape.name not in refs:
                  refs[shape.name] = reference_loss(torch, *inputs)
              except Exception as e:  # noqa: BLE001
                inputs, err = None, f"inputs: {type(e).__name__}: {str(e)[:300]}"
            ref = refs.get(shape.name)
            if ref is not None:
              row["ref_loss"] = ref
            if inputs is None:
              row["error"] = err
            else:
              try:
                row.update(measure(torch, fn, pass_, shape, *inputs, preset, FLOPS_FACTOR[name]))
                if ref is not None:
                  row["loss_rel_err"] = abs(row["loss"] - ref) / max(abs(ref), 1e-30)
              except Exception as e:  # noqa: BLE001 - OOM or a peer's failure: record, go on
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
              if device == "cuda":
                torch.cuda.empty_cache()
          fh.write(json.dumps(row) + "\n")
          fh.flush()
          msg = row.get("error") or (f"{row['ms']:9.2f} ms {row['tflops']:6.1f} TF/s  extra "
                                     f"{(row['device_peak_bytes'] or 0) / 1e9:6.2f} GB  loss {row['loss']:.6g}")
          print(f"{shape.name:>24} {name:>14} {pass_:>6} {msg}", flush=True)
        del inputs
        if device == "cuda":
          torch.cuda.empty_cache()
  print(f"# done in {time.monotonic() - start:.1f} s", flush=True)
  return path


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--preset", choices=sorted(shapes_lib.PRESETS), default="llm")
  p.add_argument("--impls", default=",".join(PEERS), help=f"comma-separated subset of {PEERS + OPTIONAL}")
  p.add_argument("--out", default=None, help="output folder (default: $OUT, else /tmp/lce_bench/<preset>)")
  p.add_argument("--time-limit-s", type=float, default=None, help="stop after this many seconds; the rest is skipped")
  p.add_argument("--passes", default=None, help="comma-separated subset of fwd,fwdbwd (default: the preset's)")
  a = p.parse_args(argv)
  preset = shapes_lib.PRESETS[a.preset]
  if a.passes:
    passes = tuple(x for x in a.passes.split(",") if x)
    if not passes or any(x not in ("fwd", "fwdbwd") for x in passes):
      raise SystemExit(f"--passes: {a.passes!r} must be a comma-separated subset of ('fwd', 'fwdbwd')")
    preset = dataclasses.replace(preset, passes=passes, sweep_passes=passes)
  names = [n for n in a.impls.split(",") if n]
  out_dir = a.out or os.environ.get("OUT") or os.path.join("/tmp/lce_bench", preset.name)
  try:
    import torch  # noqa: F401, PLC0415
  except ImportError as e:
    print(f"# torch peers not measured: {e}", flush=True)
    return 0
  try:
    run(preset, names, out_dir, a.time_limit_s)
  except KeyboardInterrupt:
    print("# interrupted; rows so far are written", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
