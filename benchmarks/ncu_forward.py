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
    python3 -m benchmarks.ncu_forward --sweep --shapes llama3-8b --variants store --changes "order_minor=m;..." \
        --repeats 3 [--pick 3]         # DRAM bytes and L2 hits of each row, 3 launches each, one ncu
                                       # process a row, within BUDGET_S (benchmarks/order_sweep.sh: then the
                                       # fewest-bytes orders timed)
    python3 -m benchmarks.ncu_forward --summarize DIR/llama3-8b-store.sass.csv.gz   # stalls and opcodes of a SASS page
    python3 -m benchmarks.ncu_forward --child store --shape 8192,768,50304   # what ncu runs (also a CPU check with
        --interpret)

``--changes`` (``bench_gemm.config_changes``: ``field=value,...``, ``;`` between rows) changes the table row of
the package's variants; ``--light`` keeps only the time, the clock, the tensor pipe, the DRAM bytes and the L2 hit
rate (a few replays, not dozens); ``--sweep`` (the package's variants only) profiles every row of a shape with those
counters, one ``ncu`` process per row (each cut off at ``BUDGET_S`` seconds from the start, default 400; rows
past it are recorded as skipped), ``--repeats`` launches each, since the DRAM bytes of one row moved by up to 37%
between runs (``benchmarks/results/ncu-forward-h200-2026-11-29/``); ``--source`` also exports each run's report
and writes its SASS page (``ncu --page source --print-source sass``: every instruction with its warp-stall
samples) to ``DIR/<shape>-<variant>.sass.csv.gz``.

``ncu`` runs with ``--clock-control none``: the GPU keeps its own clocks, as in every other measurement here. Each
profiled launch is replayed once per group of counters, so the kernel's time under ``ncu`` is that of a cold
launch (the first replay's), not the sustained time ``bench_epilogue.py`` measures; compare the counters, not the
times, with those runs. ``LCE_FLAX_COMMIT`` names the tree in the JSON.
"""

from __future__ import annotations

import argparse
import collections
import csv
import dataclasses
import datetime
import gzip
import importlib.metadata
import io
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (importing JAX starts no backend: the parent leaves the GPU's memory to the profiled child)
import jax  # noqa: E402

from benchmarks import bench, shapes  # noqa: E402
from benchmarks.bench_epilogue import EPI_SHAPES as SHAPES  # noqa: E402  (B, H, V by name)
from benchmarks.bench_epilogue import ROLES, gemm_variant  # noqa: E402
from benchmarks.bench_gemm import config_changes  # noqa: E402
from lce_flax._impl.pallas_mosaic import gemm as G  # noqa: E402
from lce_flax._impl.pallas_mosaic import tuning  # noqa: E402

VARIANTS = {"xla": None, "bare": "bare", "stats": "stats_fast", "store": "exp_fast"}
# the kernels each variant launches: XLA's GEMM (cuBLAS's or a fused Triton GEMM), or the Mosaic GPU kernel
KERNEL_RE = {"xla": "regex:gemm|nvjet|xmma|cutlass", "mosaic": "regex:mosaic_gpu"}
SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis", "SchedulerStats", "WarpStateStats",
            "InstructionStats", "LaunchStats", "Occupancy", "SourceCounters")
METRICS = ("gpu__time_duration.sum", "sm__cycles_elapsed.avg.per_second",
           "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed",
           "smsp__issue_active.avg.pct_of_peak_sustained_elapsed", "dram__bytes_write.sum", "dram__bytes_read.sum")
# --light and --sweep: these beside METRICS, no sections (a few replays: DRAM traffic and L2 hits of tile orders)
LIGHT_METRICS = ("lts__t_sector_hit_rate.pct", "lts__t_bytes.sum")
WARMUP = 2  # launches before the profiled one
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_runs(spec: str) -> list[tuple[str, str]]:
  """``"store:;store:order_minor=m"`` -> [("store", ""), ("store", "order_minor=m")]: the child's runs."""
  out = []
  for item in filter(None, spec.split(";")):
    variant, _, changes = item.partition(":")
    if variant not in VARIANTS:
      raise ValueError(f"run {item!r}: the variant must be one of {tuple(VARIANTS)}")
    out.append((variant, changes))
  return out


def child(runs: list[tuple[str, str]], shape: tuple[int, int, int], interpret: bool, calls: int) -> None:
  """Builds each run's variant at ``shape`` (its table row changed by the run's changes), compiles them all, then
  launches each ``calls`` times in turn (what ``ncu`` profiles: the k-th kernel is run ``k // calls``)."""
  b, h, v = shape
  x, w, y = bench.make_inputs(shapes.Shape("child", b, h, v))
  fns = []
  for variant, changes in runs:
    name = VARIANTS[variant]
    if name is None:
      f = jax.jit(lambda x, w, y: x @ w)
    elif changes:
      cfg = dataclasses.replace(tuning.select_config(ROLES[name], b, v, h, G._device_kind()),
                                **config_changes(changes))
      f = gemm_variant(name, config=cfg, interpret=interpret)
    else:
      f = gemm_variant(name, role=ROLES[name], interpret=interpret)
    fns.append(f.lower(x, w, y).compile())  # (compiled first: no autotuning launch among the profiled ones)
  for (variant, changes), f in zip(runs, fns):
    for _ in range(calls):
      jax.block_until_ready(f(x, w, y))
    print(f"ran {variant}[{changes}] {shape} x{calls}", flush=True)


def parse_details(text: str) -> dict[int, dict[str, str]]:
  """``ncu --csv --page details`` -> {kernel ID: {section/metric name: value with unit}}. Non-CSV lines (ncu's own
  messages, the program's output) are skipped."""
  rows = [r for r in csv.reader(io.StringIO(text)) if len(r) >= 5]
  if not rows:
    return {}
  head = rows[0]
  try:
    i_id, i_sec, i_name, i_unit, i_val = (head.index(k) for k in ("ID", "Section Name", "Metric Name",
                                                                   "Metric Unit", "Metric Value"))
  except ValueError:
    return {}
  out = collections.defaultdict(dict)
  for r in rows[1:]:
    if len(r) > max(i_id, i_sec, i_name, i_unit, i_val) and r[i_id].isdigit():
      out[int(r[i_id])][f"{r[i_sec]}/{r[i_name]}"] = f"{r[i_val]} {r[i_unit]}".strip()
  return dict(out)


def number(value: str) -> float | None:
  """``"15,325,344,768 byte"`` -> 15325344768.0 (ncu's base units, ``--print-units base``); None if not a number."""
  try:
    return float(value.split(" ")[0].replace(",", ""))
  except (ValueError, AttributeError):
    return None


def ncu_command(kern: str, light: bool, launches: tuple[int, int], export: str | None = None) -> list[str]:
  """``ncu`` profiling ``launches`` = (skip, count) kernels matching ``kern``, with the sections (or, ``light``,
  only the metrics) of the module's docstring, the details page as CSV in base units."""
  return ["ncu", "--clock-control", "none", "--target-processes", "all", "--kernel-name", kern,
          *(["--export", export, "--force-overwrite", "--import-source", "no"] if export else []),
          "--launch-skip", str(launches[0]), "--launch-count", str(launches[1]), "--csv", "--page", "details",
          "--print-units", "base", *[a for s in (() if light else SECTIONS) for a in ("--section", s)],
          "--metrics", ",".join(METRICS + (LIGHT_METRICS if light else ()))]


def child_command(runs: list[tuple[str, str]], shape: tuple[int, int, int], calls: int) -> list[str]:
  b, h, v = shape
  return [sys.executable, "-m", "benchmarks.ncu_forward", "--child", ";".join(f"{r}:{c}" for r, c in runs),
          "--shape", f"{b},{h},{v}", "--calls", str(calls)]


def _kill_group(pid: int) -> None:
  try:
    os.killpg(pid, signal.SIGKILL)
  except ProcessLookupError:  # (it ended meanwhile)
    pass


def run_logged(cmd: list[str], tag: str, log, timeout: float | None = None) -> subprocess.CompletedProcess:
  """Runs ``cmd``, its output copied into ``log`` line by line as it comes (a job cut off leaves what it did);
  past ``timeout`` seconds its process group is killed (rc -9) and what it printed is returned."""
  t0 = time.time()
  if log is not None:
    log.write(f"\n===== {tag}\n{' '.join(cmd)}\n")
    log.flush()
  out = []
  with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                        start_new_session=True) as p:
    timer = threading.Timer(timeout, _kill_group, (p.pid,)) if timeout else None
    if timer:
      timer.start()
    try:
      for line in p.stdout:
        out.append(line)
        if log is not None:
          log.write(line)
          log.flush()
      rc = p.wait()
    finally:
      if timer:
        timer.cancel()
  if log is not None:
    log.write(f"===== {tag}: rc {rc}, {time.time() - t0:.0f} s\n")
    log.flush()
  return subprocess.CompletedProcess(cmd, rc, "".join(out), "")


def profile(variant: str, shape_name: str, out_dir: str, log, changes: str = "", source: bool = False,
            light: bool = False) -> dict:
  """One ``ncu`` run of ``variant`` at ``shape_name``: its details page (``log``) and the parsed metrics; with
  ``source``, its SASS page too (see the module's docstring)."""
  shape = SHAPES[shape_name]
  changes = changes if variant != "xla" else ""
  tag = f"{shape_name}-{variant}" + (f"[{changes}]" if changes else "")
  report = os.path.join(out_dir, "".join(c if c.isalnum() or c in "-_." else "_" for c in tag))
  kern = KERNEL_RE["xla" if variant == "xla" else "mosaic"]
  p = run_logged(ncu_command(kern, light, (WARMUP, 1), report if source else None)
                 + child_command([(variant, changes)], shape, WARMUP + 1), tag, log)
  text = p.stdout
  if source and os.path.exists(report + ".ncu-rep"):
    text = subprocess.run(["ncu", "--import", report + ".ncu-rep", "--csv", "--page", "details", "--print-units",
                           "base"], capture_output=True, text=True).stdout
    log.write(text)
    sass = subprocess.run(["ncu", "--import", report + ".ncu-rep", "--csv", "--page", "source", "--print-source",
                           "sass"], capture_output=True, text=True)
    with gzip.open(report + ".sass.csv.gz", "wt") as f:
      f.write(sass.stdout)
    log.write(f"sass page: {len(sass.stdout)} characters, rc {sass.returncode} {sass.stderr[-2000:]}\n")
    os.remove(report + ".ncu-rep")
  kernels = parse_details(text)
  return {"shape": shape_name, "mnk": [shape[0], shape[2], shape[1]], "variant": variant, "changes": changes or None,
          "rc": p.returncode, "metrics": kernels[max(kernels)] if kernels else {}}


def sweep(runs: list[tuple[str, str]], shape_name: str, repeats: int, log, deadline: float | None = None
          ) -> list[dict]:
  """``--sweep``: the light counters of ``repeats`` launches of each run (package variants), one ``ncu`` process
  per row (the runs that share their changes), each cut off at ``deadline`` (``time.time()``); a row not reached
  by then is recorded as skipped. Per run, each metric's values and their median."""
  if any(v == "xla" for v, _ in runs):
    raise ValueError("--sweep profiles the package's kernels alone (xla's compile launches kernels of its own)")
  rows = []
  for changes in dict.fromkeys(c for _, c in runs):
    group = [r for r in runs if r[1] == changes]
    left = None if deadline is None else deadline - time.time()
    if left is not None and left < 30:
      rows += [{"shape": shape_name, "variant": v, "changes": c or None, "skipped": "past BUDGET_S"} for v, c in group]
      continue
    rows += _sweep_group(group, shape_name, repeats, log, left)
  return rows


def _sweep_group(runs, shape_name, repeats, log, timeout):
  shape = SHAPES[shape_name]
  p = run_logged(ncu_command(KERNEL_RE["mosaic"], True, (0, len(runs) * repeats))
                 + child_command(runs, shape, repeats), f"{shape_name} sweep [{runs[0][1]}]", log, timeout)
  kernels = parse_details(p.stdout)
  rows = []
  for i, (variant, changes) in enumerate(runs):
    got = [kernels[k] for k in range(i * repeats, (i + 1) * repeats) if k in kernels]
    names = sorted({n for m in got for n in m if n.split("/")[-1] in METRICS + LIGHT_METRICS})
    values = {n.split("/")[-1]: [number(m.get(n)) for m in got] for n in names}
    rows.append({"shape": shape_name, "mnk": [shape[0], shape[2], shape[1]], "variant": variant,
                 "changes": changes or None, "rc": p.returncode, "launches": len(got), "values": values,
                 "median": {k: statistics.median(x for x in v if x is not None) for k, v in values.items()
                            if any(x is not None for x in v)}})
  return rows


def pick(rows: list[dict], k: int, metric: str = "dram__bytes_read.sum") -> list[str]:
  """The ``k`` changes of a shape's ``--sweep`` rows whose variants read the fewest DRAM bytes, summed over the
  variants (medians), fewest first; a change with a variant that has no reading is left out."""
  totals, missing = collections.Counter(), set()
  for r in rows:
    if r["changes"]:
      if metric in r.get("median", {}):
        totals[r["changes"]] += r["median"][metric]
      else:
        missing.add(r["changes"])
  return sorted((c for c in totals if c not in missing), key=totals.get)[:k]


def summarize_sass(path: str, top: int = 12) -> dict:
  """A SASS page of ``--source`` -> its stall reasons (share of all samples), the samples and executed warp
  instructions per opcode, and the ``top`` instructions by samples."""
  with gzip.open(path, "rt") as f:
    rows = list(csv.reader(f))
  head = next(r for r in rows if "Address" in r and "Source" in r)
  data = [dict(zip(head, r)) for r in rows[rows.index(head) + 1:] if len(r) == len(head)]
  stalls = [h for h in head if h.startswith("stall_") and "Not Issued" not in h]
  count = lambda d, k: int(d.get(k) or 0)  # noqa: E731
  total = sum(count(d, "Warp Stall Sampling (All Samples)") for d in data) or 1
  reasons = collections.Counter({s[len("stall_"):]: sum(count(d, s) for d in data) for s in stalls})
  samples, executed = collections.Counter(), collections.Counter()
  for d in data:
    words = [w for w in d["Source"].split() if not w.startswith("@")]
    op = words[0].split(".")[0] if words else "?"
    samples[op] += count(d, "Warp Stall Sampling (All Samples)")
    executed[op] += count(d, "Instructions Executed")
  hot = sorted(data, key=lambda d: -count(d, "Warp Stall Sampling (All Samples)"))[:top]
  return {"instructions": len(data), "samples": total,
          "stall_share": {k: round(v / total, 4) for k, v in reasons.most_common() if v},
          "samples_by_opcode": {k: round(v / total, 4) for k, v in samples.most_common(16)},
          "executed_by_opcode": dict(executed.most_common(24)),
          "top": [{"sass": d["Source"].strip(),
                   "share": round(count(d, "Warp Stall Sampling (All Samples)") / total, 4),
                   "executed": count(d, "Instructions Executed"),
                   "stalls": {s[len("stall_"):]: count(d, s) for s in stalls if count(d, s)}} for d in hot]}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--shapes", default="gpt2-small-chunk8k,llama3-8b")
  ap.add_argument("--variants", default="xla,bare,stats,store")
  ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/ncu_forward"))
  ap.add_argument("--changes", default="", help="';'-separated changes of the package's variants' table rows, each "
                  "profiled besides the row itself (field=value,...)")
  ap.add_argument("--source", action="store_true", help="also each run's SASS with its stall samples")
  ap.add_argument("--light", action="store_true", help="only the time, clock, tensor pipe, DRAM bytes and L2 hit "
                  "rate (no sections: a few replays a run)")
  ap.add_argument("--sweep", action="store_true",
                  help="the light counters of every row of a shape, one ncu process per row within BUDGET_S")
  ap.add_argument("--repeats", type=int, default=3, help="--sweep: launches profiled per row")
  ap.add_argument("--pick", type=int, default=0, help="--sweep: write DIR/picks.json, each shape's PICK changes "
                  "with the fewest DRAM bytes read (to time with bench_epilogue --configs)")
  ap.add_argument("--summarize", metavar="SASS_CSV_GZ", help="print the summary of a --source SASS page")
  ap.add_argument("--child", metavar="RUNS", help="variant:changes;... to build and launch (what ncu runs)")
  ap.add_argument("--shape", help="B,H,V of --child")
  ap.add_argument("--calls", type=int, default=WARMUP + 1, help="--child: launches of each run")
  ap.add_argument("--interpret", action="store_true", help="--child with the kernels interpreted (a CPU check)")
  a = ap.parse_args(argv)
  if a.summarize:
    print(json.dumps(summarize_sass(a.summarize), indent=1))
    return 0
  if a.child:
    child(parse_runs(a.child), tuple(int(s) for s in a.shape.split(",")), a.interpret, a.calls)
    return 0
  if shutil.which("ncu") is None:
    raise SystemExit("ncu_forward: Nsight Compute's `ncu` is not on PATH (CUDA installs it in its bin/, e.g. "
                     "/usr/local/cuda/bin)")
  os.makedirs(a.out, exist_ok=True)
  budget, t0 = float(os.environ.get("BUDGET_S", "400")), time.time()
  ver = subprocess.run(["ncu", "--version"], capture_output=True, text=True).stdout.strip().splitlines()
  meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"), "ncu": ver[-1] if ver else None,
          "commit": os.environ.get("LCE_FLAX_COMMIT"), "command": " ".join(sys.argv)}
  # (not from JAX: a backend started here would hold the GPU's memory that the profiled child needs)
  smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                       capture_output=True, text=True).stdout.strip().splitlines()
  meta.update(jax=importlib.metadata.version("jax"), device=smi[0] if smi else None)
  variants = a.variants.split(",")
  rows, picks = [], {}

  def save():
    with open(os.path.join(a.out, "ncu_forward.json"), "w") as f:
      json.dump({**meta, "rows": rows}, f, indent=1)

  with open(os.path.join(a.out, "ncu_forward.log"), "w") as log:
    for shape in a.shapes.split(","):
      runs = [(v, "") for v in variants]
      runs += [(v, c) for c in filter(None, a.changes.split(";")) for v in variants if v != "xla"]
      if a.sweep:
        rows += sweep(runs, shape, a.repeats, log, deadline=t0 + budget)
        save()
        for r in rows[-len(runs):]:
          print(shape, r["variant"], r["changes"], r.get("launches"), r.get("median", r.get("skipped")), flush=True)
        if a.pick:
          picks[shape] = ";".join(pick(rows[-len(runs):], a.pick))
          with open(os.path.join(a.out, "picks.json"), "w") as f:
            json.dump(picks, f, indent=1)
        continue
      for variant, changes in runs:
        if time.time() - t0 > budget:
          rows.append({"shape": shape, "variant": variant, "changes": changes or None, "skipped": "past BUDGET_S"})
          continue
        rows.append(profile(variant, shape, a.out, log, changes, a.source, a.light))
        save()
        m = rows[-1]["metrics"]
        print(shape, variant, changes, rows[-1]["rc"], {k.split("/")[-1]: m.get(k) for k in m
                                                         if k.split("/")[-1] in METRICS + LIGHT_METRICS}, flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
