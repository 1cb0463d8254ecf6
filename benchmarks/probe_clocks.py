"""The SM clock and board power each head runs at, and what that does to its GEMMs (one GPU).

The plain head runs three GEMMs with memory-bound loss work between them; the fused op runs its GEMMs back to
back. A GPU at its power limit lowers its clock, so a GEMM can be slower inside the fused op than inside the plain
head. Per shape, each contender

  plain       the plain head (``bench_floors.head_steps``: bf16 logits + optax), value_and_grad of x and w
  auto        ``linear_cross_entropy`` as the device picks it
  auto_xla    the same with both backward products on XLA's GEMM (``PallasMosaicConfig(products="xla")``)
  auto_gemm   ... on the package's GEMM (``products="gemm"``)
  xla3        the plain head's three products alone (XLA: x·w, dz·wᵀ, xᵀ·dz) in one jitted call

is timed in alternation (median of ``--rounds`` rounds of 10-run medians), then run back to back for
``--seconds`` while ``nvidia-smi`` samples the SM clock, the board power and the clock-limit reasons every 20 ms
(medians over the window), then profiled for ``--steps`` calls (the kernel groups, ms per call:
``trainer_profile.device_summary``).

    python3 -m benchmarks.probe_clocks [--shapes qwen3-8b,llama3-8b] [--out DIR]
    python3 -m benchmarks.probe_clocks --products [--shapes ...]   # each bare product: ours against XLA's
    python3 -m benchmarks.probe_clocks --forwards [--shapes ...]   # the forward with and without its loss work
    python3 -m benchmarks.probe_clocks --interpret --shapes tiny --rounds 1 --seconds 0.2   # a CPU check

``--products`` takes, instead of the heads, each of the three products alone (``fwd`` x·w, ``dx`` dz·wᵀ, ``dw``
xᵀ·dz, bf16 out) on the package's GEMM (its tuning table's config) and on XLA's (cuBLAS), as
``bench_floors.product_calls`` builds them, and adds each one's energy per call (``joules``: the median power times
the sustained ms per call) and per FLOP (``pj_per_flop``): at the power limit, the energy a GEMM spends per FLOP sets
its speed.

``--forwards`` takes the forward x·w alone and with the op's loss work, each with its energy per call and per FLOP
as above: ``fwd_xla`` (XLA's bare product), ``fwd_ours`` (the package's, bare), ``stats`` (the lean forward: the row
statistics) and ``store`` (the fast forward: the statistics and the stored bf16 exponentials), each at the tuning
table's row for its role. Whether the stored tiles cost the forward time or energy (at the power limit, the same
thing) is what it answers.

Writes ``DIR/results.json`` (device, versions, date, ``LCE_FLAX_COMMIT``, rows) after every shape.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import bench  # noqa: E402
from benchmarks.bench_epilogue import ROLES, gemm_variant  # noqa: E402
from benchmarks.bench_floors import SHAPES, head_steps, product_calls  # noqa: E402
from benchmarks.bench_gemm import interleaved, save_probe  # noqa: E402
from benchmarks.bench_step_products import pair_step  # noqa: E402
from benchmarks.trainer_profile import device_summary, read_trace  # noqa: E402
from lce_flax._impl.pallas_mosaic import gemm  # noqa: E402

FIELDS = ("clocks.sm", "power.draw", "clocks_throttle_reasons.active")


def contenders(y, interpret: bool) -> dict:
  """name -> jitted call of (x, w) (see the module's docstring)."""
  heads = head_steps(y, False, interpret)
  for name, products in (("auto_xla", "xla"), ("auto_gemm", "gemm")):
    heads[name] = pair_step(y, products, interpret)[0]

  def xla3(x, w):
    z = x @ w
    return z, jax.lax.dot_general(z, w, (((1,), (1,)), ((), ()))), jax.lax.dot_general(x, z, (((0,), (0,)), ((), ())))

  heads["xla3"] = jax.jit(xla3)
  return heads


def product_contenders(x, w, interpret: bool) -> dict:
  """``--products``: name -> (jitted call, args, FLOPs) of each bare product on ours and on XLA's GEMM."""
  (b, h), v = x.shape, w.shape[1]
  dz = jax.jit(lambda x, w: x @ w)(x, w)  # (any bf16 [B, V] times the same)
  out = {}
  for role in ("fwd", "dx", "dw"):
    for name, (f, args) in product_calls(role, x, w, dz, gemm._device_kind(), interpret, False).items():
      out[f"{role}_{name}"] = (f, args, 2.0 * b * h * v)
  return out


def forward_contenders(x, w, y, interpret: bool) -> dict:
  """``--forwards``: name -> (jitted call, args, FLOPs) of the forward x·w, bare (XLA's, ours) and with the lean and
  the fast forward's loss work (see the module's docstring)."""
  (b, h), v = x.shape, w.shape[1]
  calls = {"fwd_xla": jax.jit(lambda x, w, y: x @ w),
           **{name: gemm_variant(variant, role=ROLES[variant], interpret=interpret)
              for name, variant in (("fwd_ours", "bare"), ("stats", "stats_fast"), ("store", "exp_fast"))}}
  return {k: (f, (x, w, y), 2.0 * b * h * v) for k, f in calls.items()}


def parse_samples(lines: list[str]) -> dict:
  """Medians of ``nvidia-smi --format=csv,noheader,nounits`` lines of :data:`FIELDS` (clock MHz, power W) and the
  most frequent clock-limit reasons bitmask (None where nothing parsed)."""
  clocks, power, reasons = [], [], []
  for line in lines:
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(FIELDS):
      continue
    try:
      clocks.append(float(parts[0]))
      power.append(float(parts[1]))
    except ValueError:
      continue
    reasons.append(parts[2])
  if not clocks:
    return {"sm_mhz": None, "power_w": None, "reasons": None, "samples": 0}
  return {"sm_mhz": statistics.median(clocks), "power_w": round(statistics.median(power), 1),
          "reasons": max(set(reasons), key=reasons.count), "samples": len(clocks)}


def sustained(f, args, seconds: float) -> dict:
  """``f`` back to back for ``seconds`` under ``nvidia-smi``'s sampling: ms per call and the medians of the
  samples taken while it ran (none on a machine without ``nvidia-smi``)."""
  jax.block_until_ready(f(*args))
  try:
    smi = subprocess.Popen(["nvidia-smi", "-i", "0", f"--query-gpu={','.join(FIELDS)}",
                            "--format=csv,noheader,nounits", "-lms", "20"], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True)
  except FileNotFoundError:
    smi = None
  time.sleep(0.2)  # (nvidia-smi's first samples, taken before the loop, are dropped below)
  t0, calls = time.perf_counter(), 0
  while time.perf_counter() - t0 < seconds:
    jax.block_until_ready(f(*args))
    calls += 1
  ms = 1e3 * (time.perf_counter() - t0) / calls
  lines = []
  if smi is not None:
    smi.terminate()
    lines = smi.communicate()[0].splitlines()
    lines = lines[len(lines) // 5:]  # the first fifth: the sampler's start and the loop's ramp
  return {"ms_per_call": round(ms, 3), **parse_samples(lines)}


def measure(name: str, rounds: int, seconds: float, steps: int, interpret: bool, products: bool = False,
            forwards: bool = False) -> list[dict]:
  x, w, y = bench.make_inputs(SHAPES[name])
  if products:
    calls = product_contenders(x, w, interpret)
  elif forwards:
    calls = forward_contenders(x, w, y, interpret)
  else:
    calls = {k: (f, (x, w), 6.0 * x.shape[0] * x.shape[1] * w.shape[1]) for k, f in contenders(y, interpret).items()}
  t = interleaved({k: (f, a) for k, (f, a, _) in calls.items()}, rounds=rounds)
  rows = []
  for k, (f, args, flops) in calls.items():
    row = {"shape": name, "contender": k, "ms": round(t[k], 3), **sustained(f, args, seconds)}
    if row["power_w"] is not None:
      joules = row["power_w"] * row["ms_per_call"] / 1e3
      row.update(joules=round(joules, 4), pj_per_flop=round(joules / flops * 1e12, 4))
    with tempfile.TemporaryDirectory(prefix="probe_clocks_") as folder:
      with jax.profiler.trace(folder, create_perfetto_trace=True):
        for _ in range(steps):
          jax.block_until_ready(f(*args))
      s = device_summary(read_trace(folder), steps)
    row.update(busy_ms=s["busy_ms"], kernels=dict(list(s["kernels"].items())[:6]))
    print({kk: v for kk, v in row.items() if kk != "kernels"}, flush=True)
    rows.append(row)
  return rows


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--shapes", default="qwen3-8b,llama3-8b,gemma2-2b")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--seconds", type=float, default=3.0)
  ap.add_argument("--steps", type=int, default=3, help="profiled calls per contender")
  ap.add_argument("--interpret", action="store_true", help="the kernels interpreted (a CPU check)")
  ap.add_argument("--products", action="store_true", help="each bare product, ours against XLA's, instead of the heads")
  ap.add_argument("--forwards", action="store_true",
                  help="the forward x·w bare and with the lean and fast forwards' loss work, instead of the heads")
  ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/probe_clocks"))
  a = ap.parse_args(argv)
  rows = []
  for name in a.shapes.split(","):
    rows += measure(name, a.rounds, a.seconds, a.steps, a.interpret, a.products, a.forwards)
    save_probe(a.out, rows, a.rounds)
  for r in rows:
    print(f"{r['shape']:12s} {r['contender']:10s} {r['ms']:8.3f} ms  sustained {r['ms_per_call']:8.3f} ms  "
          f"{r['sm_mhz']} MHz  {r['power_w']} W  reasons {r['reasons']}  {r.get('pj_per_flop')} pJ/FLOP")
  return 0 if np.isfinite([r["ms"] for r in rows]).all() else 1


if __name__ == "__main__":
  sys.exit(main())
