"""Where the example trainer's step spends its GPU time, on 1 and k GPUs: a profile of each head's step and
the kernels whose time grows from one device to k.

    python3 -m benchmarks.trainer_profile --ks 1,2 --out DIR          # on a machine with 2 GPUs
    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
      python3 -m benchmarks.trainer_profile --preset cpu --small --ks 1,2 --out DIR   # a CPU check of the driver

For each k and head (``fused``: lce_flax's, ``plain``: ``nn.Dense`` + optax) the trainer's step (its preset's
model, ``--per-device-batch`` sequences per device, on k devices: a data-parallel mesh, or with ``--meshes`` the
FSDP and tensor meshes of ``trainer_scaling``) is compiled, run
``--warmup`` times, then ``--steps`` times under ``jax.profiler.trace`` (Perfetto JSON), as the trainer runs them
(``examples.lm.train.run_steps``: each step dispatched before the previous one's loss is read). Each step's time
as the trainer counts it; from the trace, on the first device, the time its streams are busy (the union of its
kernels' intervals) and what they run, grouped by kernel name (numbers stripped), with the collectives (NCCL
kernels) summed apart, and the collectives' time with no other kernel running (what they cannot hide), by
collective and the kernel before it. A step that is longer than its device's busy time waited on something else
(the host, another device): the idle gaps of 50 µs or more are summed per step and the largest listed with the
kernels on either side.

Writes ``DIR/trainer_profile.json`` (device, versions, date, commit, one entry per (k, head): step ms, busy ms,
collective ms, the kernel groups) and prints, per head, the kernel groups whose time per step grew most from k = 1
to the largest k. The traces themselves stay in a temporary folder unless ``--keep-traces``.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # (the example trainer's package, examples.lm)

from benchmarks.trainer_scaling import SMALL, compiler_option_args, job_meta, mesh_kinds, meshes  # noqa: E402

COLLECTIVE = re.compile(r"nccl|all[-_]?reduce|all[-_]?gather|reduce[-_]?scatter|collective", re.I)


# ------------------------------------------------------------------------------------------- the trace

def kernel_group(name: str) -> str:
  """A kernel's name without its instance number and its template or argument lists, so that launches of one
  kernel group together (``loop_add_fusion.12`` → ``loop_add_fusion``, ``fusion_777`` → ``fusion``)."""
  name = re.sub(r"<.*>|\(.*\)", "", name).strip()
  return re.sub(r"[._]\d+$", "", name)


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
  """``intervals`` as disjoint ones, sorted."""
  out: list[tuple[float, float]] = []
  for a, b in sorted(intervals):
    if out and a <= out[-1][1]:
      out[-1] = (out[-1][0], max(out[-1][1], b))
    else:
      out.append((a, b))
  return out


def _union(intervals: list[tuple[float, float]]) -> float:
  return sum(b - a for a, b in _merged(intervals))


def idle_gaps(spans: list[tuple[float, float, str]], steps: int, top: int = 12, floor_us: float = 50.0) -> dict:
  """Where the device sat idle: the gaps between its busy intervals (``spans``: start, end in µs, kernel name),
  the sum of those of at least ``floor_us`` per step, and the ``top`` largest with the kernels on either side. The
  gaps between steps (the host's wait for the loss) are among them, one per step."""
  gaps, end, last = [], -float("inf"), None
  for a, b, name in sorted(spans):
    if last is not None and a - end >= floor_us:
      gaps.append((a - end, last, name))
    if b > end:
      end, last = b, name
  gaps.sort(reverse=True)
  return {"idle_ms": round(sum(g for g, _, _ in gaps) / 1e3 / steps, 4), "idle_floor_us": floor_us,
          "idle_gaps": [{"us": round(g, 1), "after": kernel_group(x), "before": kernel_group(y)}
                        for g, x, y in gaps[:top]]}


def device_spans(events: list[dict]) -> tuple[str | None, list[tuple[float, float, str]], list[str]]:
  """The first GPU's (or TPU's) process name and its kernels, ``(start µs, end µs, name)`` on its "Stream" lines
  (all its lines if none is named so: not the "XLA Ops" line's copies), sorted; ``(None, [], the process names)``
  where the trace has no device process (as on the CPU)."""
  names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  devices = sorted((n, pid) for pid, n in names.items() if re.search(r"/device:(GPU|TPU):0\b", n or ""))
  if not devices:  # (the names it has, to adapt this reader to another exporter's naming)
    return None, [], sorted(n for n in names.values() if n)
  name, pid = devices[0]
  threads = {e.get("tid"): e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name" and e.get("pid") == pid}
  streams = {t for t, n in threads.items() if n.startswith("Stream")}
  spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("name", "?")) for e in events
                 if e.get("pid") == pid and e.get("ph") == "X" and "dur" in e
                 and (not streams or e.get("tid") in streams))
  return name, spans, []


def _uncovered(a: float, b: float, cover: list[tuple[float, float]]) -> float:
  """How much of [a, b] no interval of ``cover`` (merged, sorted) covers."""
  left = b - a
  for c, d in cover:
    if d <= a:
      continue
    if c >= b:
      break
    left -= min(b, d) - max(a, c)
  return left


def exposed_collectives(spans: list[tuple[float, float, str]], steps: int, top: int = 8) -> dict:
  """The collectives' time during which no other kernel of the device runs: what they add to the step where
  they cannot hide. ``compute_ms``: the union of the other kernels' intervals; ``exposed_collective_ms``: the
  collectives' union less that; ``exposed``: the ``top`` largest by exposed time, grouped by collective kernel
  and the compute kernel that ended last before each began (one place in the step: the same one in each step),
  with their launches and their whole and exposed time per step (ms)."""
  compute = _merged([(a, b) for a, b, n in spans if not COLLECTIVE.search(n)])
  coll = sorted((a, b, n) for a, b, n in spans if COLLECTIVE.search(n))
  ends = sorted((b, n) for a, b, n in spans if not COLLECTIVE.search(n))
  end_times = [e for e, _ in ends]
  places: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
  for a, b, n in coll:
    i = bisect.bisect_right(end_times, a)  # the compute kernels that ended by a
    key = (kernel_group(n), kernel_group(ends[i - 1][1]) if i else "(step start)")
    places[key][0] += 1
    places[key][1] += b - a
    places[key][2] += _uncovered(a, b, compute)
  merged = _merged([(a, b) for a, b, _ in coll])
  per = lambda us: round(us / 1e3 / steps, 4)
  rows = sorted(places.items(), key=lambda kv: -kv[1][2])[:top]
  return {"compute_ms": per(_union(compute)),
          "exposed_collective_ms": per(sum(_uncovered(a, b, compute) for a, b in merged)),
          "exposed": [{"collective": c, "after": after, "launches_per_step": round(v[0] / steps, 2),
                       "ms": per(v[1]), "exposed_ms": per(v[2])} for (c, after), v in rows]}


def device_summary(events: list[dict], steps: int) -> dict:
  """Per-step kernel time of the first GPU in a Chrome/Perfetto trace's ``events`` (:func:`device_spans`): busy
  (union of its kernels' intervals), collectives, and the kernel groups (ms per step), largest first. ``device``
  is the process name read (None where the trace has no device process, as on the CPU: then every number is
  None)."""
  name, spans, processes = device_spans(events)
  if name is None:
    return {"device": None, "busy_ms": None, "collective_ms": None, "compute_ms": None, "exposed_collective_ms": None,
            "exposed": [], "idle_ms": None, "idle_gaps": [], "kernels": {}, "processes": processes}
  groups = collections.Counter()
  for a, b, n in spans:
    groups[kernel_group(n)] += b - a
  coll = [(a, b) for a, b, n in spans if COLLECTIVE.search(n)]
  per = lambda us: round(us / 1e3 / steps, 4)
  return {"device": name, "busy_ms": per(_union([s[:2] for s in spans])), "collective_ms": per(_union(coll)),
          **exposed_collectives(spans, steps), **idle_gaps(spans, steps),
          "kernels": {g: per(t) for g, t in groups.most_common()}}


def read_trace(folder: str) -> list[dict]:
  """The events of the Perfetto trace ``jax.profiler.trace(folder, create_perfetto_trace=True)`` wrote."""
  paths = sorted(glob.glob(os.path.join(folder, "**", "perfetto_trace.json.gz"), recursive=True))
  if not paths:
    raise FileNotFoundError(f"no perfetto_trace.json.gz under {folder}")
  with gzip.open(paths[-1], "rt") as f:
    trace = json.load(f)
  return trace["traceEvents"] if isinstance(trace, dict) else trace


def growth(one: dict, many: dict, top: int = 12) -> list[tuple[str, float, float]]:
  """The kernel groups whose ms per step grew most from ``one`` to ``many`` (device summaries): (group, ms at
  one, ms at many)."""
  keys = set(one["kernels"]) | set(many["kernels"])
  rows = [(k, one["kernels"].get(k, 0.0), many["kernels"].get(k, 0.0)) for k in keys]
  return sorted(rows, key=lambda r: r[1] - r[2])[:top]


# ------------------------------------------------------------------------------------------- the runs

def profile_one(argv: list[str], k: int, head: str, per_device_batch: int, warmup: int, steps: int,
                trace_dir: str, mesh: str | None = None) -> dict:
  """``head``'s step on ``mesh`` (the trainer's ``--mesh``; default ``data={k}``) of ``k`` devices, profiled."""
  from examples.lm import main as lm_main  # noqa: PLC0415
  from examples.lm.train import compile_step, compiled_memory, run_steps, trainer_from_args  # noqa: PLC0415

  mesh = mesh or f"data={k}"
  args = lm_main.parse_args([*argv, "--mesh", mesh, "--num-devices", str(k),
                             "--batch-size", str(per_device_batch * k)])
  tr = trainer_from_args(args, head)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, args.vocab_size, (args.batch_size, args.seq_len + 1)).astype(np.int32)
  with jax.set_mesh(tr.mesh):
    state = tr.init(args.seed)
    batch = tr.put_batch({"inputs": tokens[:, :-1], "labels": tokens[:, 1:]})
    compiled = compile_step(tr, state, args.seq_len)
    for _ in range(warmup):
      state, metrics = compiled(state, batch)
    float(metrics["loss"])
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):  # (timed as the trainer times its steps)
      state, times = run_steps(compiled, state, range(steps), lambda i: batch)
  summary = device_summary(read_trace(trace_dir), steps)
  return {"k": k, "mesh": mesh, "head": head, "batch_size": args.batch_size,
          "step_ms": round(1e3 * float(np.median(times)), 3), "step_ms_all": [round(1e3 * t, 3) for t in times],
          "memory": compiled_memory(compiled), **summary}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--preset", default="gpu")
  ap.add_argument("--per-device-batch", type=int, default=8, help="sequences per device")
  ap.add_argument("--ks", default="1,2", help="comma-separated device counts")
  ap.add_argument("--meshes", default="data", help="comma-separated mesh kinds for k > 1 (data, fsdp, tensor: "
                  "trainer_scaling's); k = 1 runs data=1 once")
  ap.add_argument("--heads", default="fused,plain")
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--steps", type=int, default=5, help="profiled steps per (k, head)")
  ap.add_argument("--compiler-option", action="append", default=[], metavar="KEY=VALUE",
                  help="an XLA option for compiling the step (the trainer's flag; repeatable)")
  ap.add_argument("--small", action="store_true", help="a tiny model (a CPU check of the driver)")
  ap.add_argument("--keep-traces", action="store_true", help="keep the traces in DIR/traces/")
  ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/trainer_profile"))
  a = ap.parse_args(argv)
  os.makedirs(a.out, exist_ok=True)
  ks = [int(k) for k in a.ks.split(",")]
  if max(ks) > jax.device_count():
    raise SystemExit(f"--ks {a.ks}: this process sees {jax.device_count()} device(s)")
  common = ["--preset", a.preset, *(SMALL if a.small else []), *compiler_option_args(a.compiler_option)]
  traces = os.path.join(a.out, "traces") if a.keep_traces else tempfile.mkdtemp(prefix="trainer_profile_")
  meta = {**job_meta(jax.device_count(), a.preset, a.per_device_batch), "steps": a.steps}
  kinds = mesh_kinds(a.meshes)
  runs = []
  for head in a.heads.split(","):
    for k in ks:
      for mesh in sorted({meshes(k).get(kind, f"data={k}") for kind in kinds}):
        r = profile_one(common, k, head, a.per_device_batch, a.warmup, a.steps,
                        os.path.join(traces, f"{head}_{mesh.replace('=', '').replace(',', '_')}"), mesh)
        runs.append(r)
        print(json.dumps({key: v for key, v in r.items() if key != "kernels"}), flush=True)
        with open(os.path.join(a.out, "trainer_profile.json"), "w") as f:
          json.dump({**meta, "runs": runs}, f, indent=1)
  lo, hi = min(ks), max(ks)
  for head, kind in ((h, kind) for h in a.heads.split(",") for kind in kinds):
    if kind not in meshes(hi):
      continue
    one = next(r for r in runs if r["head"] == head and r["k"] == lo)
    many = next(r for r in runs if r["head"] == head and r["mesh"] == meshes(hi)[kind])
    print(f"\n{head}, {many['mesh']}: step {one['step_ms']} -> {many['step_ms']} ms; device busy {one['busy_ms']} -> "
          f"{many['busy_ms']} ms; idle in gaps of 50 us or more {one['idle_ms']} -> {many['idle_ms']} ms; "
          f"collectives {one['collective_ms']} -> {many['collective_ms']} ms, of which with no other kernel running "
          f"{one['exposed_collective_ms']} -> {many['exposed_collective_ms']} ms; other kernels' union "
          f"{one['compute_ms']} -> {many['compute_ms']} ms")
    if one["device"] is not None:
      for e in many["exposed"]:
        print(f"  exposed, k = {hi}: {e['exposed_ms']:7.3f} of {e['ms']:7.3f} ms  {e['collective'][:48]} after "
              f"{e['after'][:40]} ({e['launches_per_step']} a step)")
      for r in (one, many):
        print(f"  largest gaps, k = {r['k']}: " + "; ".join(f"{g['us']:.0f} us {g['after'][:40]} -> {g['before'][:40]}"
                                                           for g in r["idle_gaps"][:5]))
      for g, t1, tk in growth(one, many):
        print(f"  {tk - t1:+8.3f} ms  {t1:8.3f} -> {tk:8.3f}  {g[:100]}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
