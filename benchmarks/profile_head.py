"""Where one head's forward + backward spends its GPU time, kernel by kernel: the plain head beside ``auto`` (and,
with ``--lean``, lean mode), each under ``jax.profiler.trace``.

Per shape it jits ``value_and_grad`` of x and w (summed loss) of each head (``bench_floors.head_steps``: the same
heads as the floors), runs it ``--warmup`` times, then ``--steps`` times under the profiler, and reads the trace of
the first GPU with ``trainer_profile.device_summary``: the time its streams are busy per call, the idle gaps, and
the kernel groups (ms per call, largest first). It also keeps the launch order of the last call (``sequence``:
kernel group and µs, in the order the device ran them), so that each piece of the loss work can be set against the
products around it.

    python3 -m benchmarks.profile_head [--shapes qwen3-8b,llama3-8b] [--lean] [--steps 5] [--out DIR]
    python3 -m benchmarks.profile_head --interpret --shapes tiny --steps 1     # a CPU check of the driver

Writes ``DIR/profile_head.json`` (device, versions, date, ``LCE_FLAX_COMMIT``, one entry per shape and head) after
every entry and prints one JSON line per entry (its kernels left out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import bench  # noqa: E402
from benchmarks.bench_floors import SHAPES, head_steps  # noqa: E402
from benchmarks.trainer_profile import device_spans, device_summary, kernel_group, read_trace  # noqa: E402


def last_call(events: list[dict], steps: int) -> list[tuple[str, float]]:
  """(kernel group, µs) of the first GPU's stream kernels in the last of ``steps`` identical calls of a trace, in
  launch order (each call launches the same kernels, so the last ``1/steps`` of them)."""
  spans = device_spans(events)[1]
  return [(kernel_group(n), round(b - a, 1)) for a, b, n in spans[len(spans) - len(spans) // steps:]]


def profile(name: str, lean: bool, interpret: bool, warmup: int, steps: int, trace_root: str) -> list[dict]:
  x, w, y = bench.make_inputs(SHAPES[name])
  out = []
  for head, f in head_steps(y, lean, interpret).items():
    for _ in range(warmup):
      jax.block_until_ready(f(x, w))
    folder = os.path.join(trace_root, f"{name}_{head}")
    times = []
    with jax.profiler.trace(folder, create_perfetto_trace=True):
      for _ in range(steps):
        t = time.perf_counter()
        jax.block_until_ready(f(x, w))
        times.append(1e3 * (time.perf_counter() - t))
    events = read_trace(folder)
    out.append({"shape": name, "head": head, "wall_ms": round(float(np.median(times)), 3),
                **device_summary(events, steps), "sequence": last_call(events, steps)})
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--shapes", default="qwen3-8b,llama3-8b,gemma2-2b,gpt2-small")
  ap.add_argument("--lean", action="store_true", help="also lean mode")
  ap.add_argument("--interpret", action="store_true", help="lean mode's kernels interpreted (a CPU check)")
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--steps", type=int, default=5)
  ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/profile_head"))
  a = ap.parse_args(argv)
  os.makedirs(a.out, exist_ok=True)
  meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
          "date": datetime.date.today().isoformat(), "commit": os.environ.get("LCE_FLAX_COMMIT"),
          "steps": a.steps}
  rows = []
  with tempfile.TemporaryDirectory(prefix="profile_head_") as traces:
    for name in a.shapes.split(","):
      for r in profile(name, a.lean, a.interpret, a.warmup, a.steps, traces):
        rows.append(r)
        print(json.dumps({k: v for k, v in r.items() if k not in ("kernels", "sequence")}), flush=True)
        with open(os.path.join(a.out, "profile_head.json"), "w") as f:
          json.dump({**meta, "rows": rows}, f, indent=1)
  for r in rows:
    if r["device"] is None:
      continue
    print(f"\n{r['shape']} {r['head']}: wall {r['wall_ms']} ms, busy {r['busy_ms']} ms, idle {r['idle_ms']} ms")
    for g, ms in list(r["kernels"].items())[:12]:
      print(f"  {ms:9.3f} ms  {g[:100]}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
