"""Hardware counters of the forward x·w, bare and with the op's loss work, under Nsight Compute (one GPU).

``bench_epilogue.py`` times the forward GEMM with each epilogue; this reads why one takes longer than another. For
each shape and variant it runs Nsight Compute (``ncu``) on one launch of the kernel, after two launches that warm
it up, and keeps the sections that say what limits a GEMM: speed of light (tensor pipe, SM, DRAM and L2
throughput), the scheduler (issue slots), the warp states (why warps stall), the instruction mix and the top
stall sites. Variants (``bench_epilogue.gemm_variant``, each at the tuning table's row for its role):

  xla       XLA's bare product (cuBLAS), bf16 out
  bare      the package's GEMM, bf16 out (role ``fwd``)
  stats     the lean forward: row statistics, approximate exp (role ``fwd_stats``)
  store     the fast forward: statistics and the stored bf16 exponentials (role ``fwd_store``)

    python3 -m benchmarks.ncu_forward [--shapes gpt2-small-chunk8k,llama3-8b] [--variants xla,bare,stats,store]
        [--out DIR]                    # GPU: runs ncu on itself, writes DIR/ncu_forward.json and .log
    python3 -m benchmarks.ncu_forward --shapes gpt2-small-chunk8k --variants store --changes "stages=5,epi_slots=6" \
        --source                       # a changed row; and the SASS with its stall samples, per instruction
    python3 -m benchmarks.ncu_forward --child store --shape 8192,768,50304   # what ncu runs (also a CPU check with
        --interpret)

``--changes`` (``bench_gemm.config_changes``: ``field=value,...``) changes the table row of the package's variants;
``--light`` keeps only the time, the clock, the tensor pipe, the DRAM bytes and the L2 hit rate (a few replays,
not dozens); ``--source`` also exports each run's report and writes its SASS page (``ncu --page source
--print-source sass``: every instruction with its warp-stall samples) to ``DIR/<shape>-<variant>.sass.csv.gz``.

``ncu`` runs with ``--clock-control none``: the GPU keeps its own clocks, as in every other measurement here. Each
profiled launch is replayed once per group of counters, so the kernel's time under ``ncu`` is that of a cold
launch (the first replay's), not the sustained time ``bench_epilogue.py`` measures; compare the counters, not the
times, with those runs. ``LCE_FLAX_COMMIT`` names the tree in the JSON.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gzip
import importlib.metadata
import io
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {"gpt2-small-chunk8k": (8192, 768, 50304), "gpt2-small": (16384, 768, 50304),
          "llama3-8b": (8192, 4096, 128256), "gemma2-2b": (8192, 2304, 256000), "qwen3-8b": (4096, 4096, 151936)}
VARIANTS = {"xla": None, "bare": "bare", "stats": "stats_fast", "store": "exp_fast"}
# the kernels each variant launches: XLA's GEMM (cuBLAS's or a fused Triton GEMM), or the Mosaic GPU kernel
KERNEL_RE = {"xla": "regex:gemm|nvjet|xmma|cutlass", "mosaic": "regex:mosaic_gpu"}
SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis", "SchedulerStats", "WarpStateStats",
            "InstructionStats", "LaunchStats", "Occupancy", "SourceCounters")
METRICS = ("gpu__time_duration.sum", "sm__cycles_elapsed.avg.per_second",
           "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed",
           "smsp__issue_active.avg.pct_of_peak_sustained_elapsed", "dram__bytes_write.sum", "dram__bytes_read.sum")
# --light: these beside METRICS, no sections (a few replays: DRAM traffic and L2 hits across tile orders)
LIGHT_METRICS = ("lts__t_sector_hit_rate.pct", "lts__t_bytes.sum")
WARMUP = 2  # launches before the profiled one


def child(variant: str, shape: tuple[int, int, int], interpret: bool, calls: int, changes: str = "") -> None:
  """Builds the variant at ``shape`` (its table row changed by ``changes``) and launches it ``calls`` times (what
  ``ncu`` profiles)."""
  import dataclasses

  import jax
  import jax.numpy as jnp

  from benchmarks.bench_epilogue import ROLES, gemm_variant
  from benchmarks.bench_gemm import config_changes
  from lce_flax._impl.pallas_mosaic import gemm as G
  from lce_flax._impl.pallas_mosaic import tuning

  b, h, v = shape
  kx, kw, ky = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (b, h), jnp.bfloat16)
  w = (0.02 * jax.random.normal(kw, (h, v), jnp.float32)).astype(jnp.bfloat16)
  y = jax.random.randint(ky, (b,), 0, v)
  name = VARIANTS[variant]
  if name is None:
    f = jax.jit(lambda x, w, y: x @ w)
  elif changes:
    cfg = dataclasses.replace(tuning.select_config(ROLES[name], b, v, h, G._device_kind()), **config_changes(changes))
    f = gemm_variant(name, config=cfg, interpret=interpret)
  else:
    f = gemm_variant(name, role=ROLES[name], interpret=interpret)
  jax.block_until_ready((x, w, y))
  for _ in range(calls):
    jax.block_until_ready(f(x, w, y))
  print(f"ran {variant} {shape} x{calls}", flush=True)


def parse_details(text: str) -> dict:
  """``ncu --csv --page details`` -> {section/metric name: value with unit}, the last kernel's rows (one kernel is
  profiled per run). Non-CSV lines (ncu's own messages, the program's output) are skipped."""
  rows = [r for r in csv.reader(io.StringIO(text)) if len(r) >= 5]
  if not rows:
    return {}
  head, out = rows[0], {}
  try:
    i_sec, i_name, i_unit, i_val = (head.index(k) for k in ("Section Name", "Metric Name", "Metric Unit",
                                                             "Metric Value"))
  except ValueError:
    return {}
  for r in rows[1:]:
    if len(r) > max(i_sec, i_name, i_unit, i_val):
      out[f"{r[i_sec]}/{r[i_name]}"] = f"{r[i_val]} {r[i_unit]}".strip()
  return out


def profile(variant: str, shape_name: str, out_dir: str, log, changes: str = "", source: bool = False,
            light: bool = False) -> dict:
  """One ``ncu`` run of ``variant`` at ``shape_name``: its details page (``log``) and the parsed metrics; with
  ``source``, its SASS page too (see the module's docstring)."""
  b, h, v = SHAPES[shape_name]
  kern = KERNEL_RE["xla" if variant == "xla" else "mosaic"]
  tag = f"{shape_name}-{variant}" + (f"[{changes}]" if changes and variant != "xla" else "")
  report = os.path.join(out_dir, "".join(c if c.isalnum() or c in "-_." else "_" for c in tag))
  cmd = ["ncu", "--clock-control", "none", "--target-processes", "all", "--kernel-name", kern,
         *(["--export", report, "--force-overwrite", "--import-source", "no"] if source else []),
         "--launch-skip", str(WARMUP), "--launch-count", "1", "--csv", "--page", "details",
         *[a for s in (() if light else SECTIONS) for a in ("--section", s)],
         "--metrics", ",".join(METRICS + (LIGHT_METRICS if light else ())),
         sys.executable, "-m", "benchmarks.ncu_forward", "--child", variant, "--shape", f"{b},{h},{v}",
         "--calls", str(WARMUP + 1), *(["--changes", changes] if changes and variant != "xla" else [])]
  t0 = time.time()
  p = subprocess.run(cmd, capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  log.write(f"\n===== {tag} (rc {p.returncode}, {time.time() - t0:.0f} s)\n{' '.join(cmd)}\n")
  log.write(p.stdout)
  log.write(p.stderr[-4000:])
  text = p.stdout
  if source and os.path.exists(report + ".ncu-rep"):
    text = subprocess.run(["ncu", "--import", report + ".ncu-rep", "--csv", "--page", "details"],
                          capture_output=True, text=True).stdout
    log.write(text)
    sass = subprocess.run(["ncu", "--import", report + ".ncu-rep", "--csv", "--page", "source", "--print-source",
                           "sass"], capture_output=True, text=True)
    with gzip.open(report + ".sass.csv.gz", "wt") as f:
      f.write(sass.stdout)
    log.write(f"sass page: {len(sass.stdout)} characters, rc {sass.returncode} {sass.stderr[-2000:]}\n")
    os.remove(report + ".ncu-rep")
  log.flush()
  return {"shape": shape_name, "mnk": [b, v, h], "variant": variant, "changes": changes or None,
          "rc": p.returncode, "metrics": parse_details(text)}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--shapes", default="gpt2-small-chunk8k,llama3-8b")
  ap.add_argument("--variants", default="xla,bare,stats,store")
  ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/ncu_forward"))
  ap.add_argument("--child", choices=tuple(VARIANTS), help="run one variant (what ncu profiles)")
  ap.add_argument("--shape", help="B,H,V of --child")
  ap.add_argument("--calls", type=int, default=WARMUP + 1)
  ap.add_argument("--changes", default="", help="';'-separated changes of the package's variants' table rows, each "
                  "profiled besides the row itself (field=value,...)")
  ap.add_argument("--source", action="store_true", help="also each run's SASS with its stall samples")
  ap.add_argument("--light", action="store_true", help="only the time, clock, tensor pipe, DRAM bytes and L2 hit "
                  "rate (no sections: a few replays a run)")
  ap.add_argument("--interpret", action="store_true", help="--child with the kernels interpreted (a CPU check)")
  a = ap.parse_args(argv)
  if a.child:
    child(a.child, tuple(int(s) for s in a.shape.split(",")), a.interpret, a.calls, a.changes)
    return 0
  os.makedirs(a.out, exist_ok=True)
  budget, t0 = float(os.environ.get("BUDGET_S", "400")), time.time()
  ver = subprocess.run(["ncu", "--version"], capture_output=True, text=True).stdout.strip().splitlines()
  meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"), "ncu": ver[-1] if ver else None,
          "commit": os.environ.get("LCE_FLAX_COMMIT"), "command": " ".join(sys.argv)}
  # (not from JAX: a backend started here would hold the GPU's memory that the profiled child needs)
  smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                       capture_output=True, text=True).stdout.strip().splitlines()
  meta.update(jax=importlib.metadata.version("jax"), device=smi[0] if smi else None)
  rows = []
  with open(os.path.join(a.out, "ncu_forward.log"), "w") as log:
    for shape in a.shapes.split(","):
      runs = [(v, "") for v in a.variants.split(",")]
      runs += [(v, c) for c in filter(None, a.changes.split(";")) for v in a.variants.split(",") if v != "xla"]
      for variant, changes in runs:
        if time.time() - t0 > budget:
          rows.append({"shape": shape, "variant": variant, "changes": changes or None, "skipped": "past BUDGET_S"})
          continue
        rows.append(profile(variant, shape, a.out, log, changes, a.source, a.light))
        with open(os.path.join(a.out, "ncu_forward.json"), "w") as f:
          json.dump({**meta, "rows": rows}, f, indent=1)
        m = rows[-1]["metrics"]
        print(shape, variant, changes, rows[-1]["rc"], {k.split("/")[-1]: m.get(k) for k in m
                                                         if k.split("/")[-1] in METRICS + LIGHT_METRICS}, flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
