"""The example trainer's full step on 1, 2, 4, 8 devices: weak scaling, per-device memory and where the head's
gradient reduction sits in the compiled step's schedule.

    python3 -m benchmarks.trainer_scaling --out DIR                 # every visible GPU (the gpu preset)
    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \\
      python3 -m benchmarks.trainer_scaling --preset cpu --small --out DIR    # a CPU check of the driver

For k = 1, 2, 4, … up to the visible devices, each mesh (``data``: data parallel, k; ``fsdp``: parameters split
over k; ``tensor``: data = k/2 and the vocabulary (and MLP, heads) split over ``tensor`` = 2) and each head
(``fused``: lce_flax's, ``plain``: ``nn.Dense`` + optax) it runs ``examples/train_lm.py`` in a fresh process
(its own allocator and peak counters) at a fixed per-device batch (``--per-device-batch`` sequences), a few steps,
no evaluation or sampling, and records the median step time, tokens/s per device and the per-device memory (the
compiled step's peak and temporaries; on a GPU the allocator's peak). Weak-scaling efficiency is t(1) / t(k) of the
same head. ``--max-batch`` also runs the trainer's ``--find-max-batch`` on each mesh (the largest batch each head fits).

``--repeats N`` runs each process N times, in turns, and a row takes the median (a process's step time moved by
±4% between processes on the same machine). ``--ks`` and ``--meshes`` pick some of the runs, so that one
measurement can be spread over several jobs; ``--previous FILE`` (repeatable) takes the rows of earlier jobs'
``trainer_scaling.json`` (same preset and per-device batch), runs none of their (k, mesh, head) again and counts
them in the weak-scaling ratios.

``--variant NAME:ITEM[,ITEM…]`` (repeatable) runs every process once more per variant, each ``KEY=VALUE`` item an
XLA option for the train step (the trainer's ``--compiler-option``) and each ``--flag`` item a trainer argument as
it is, e.g. ``--variant sol:xla_gpu_enable_analytical_sol_latency_estimator=true`` (XLA's scheduler costing the
collectives and kernels by their sizes), ``--variant pgle:--pgle=3`` (by the times the first 3 steps measured) or
``--variant unordered:--no-layer-grads-in-order``; an ``env:KEY=VALUE`` item sets an environment variable of the
variant's trainer processes (``--variant nch4:env:NCCL_MAX_NCHANNELS=4``: NCCL reads its settings when a process
starts, so only a process of its own can change them; the schedules compiled in this process do not see it). Rows
carry their variant (``default``: none) and its trainer arguments, and weak scaling compares a row with k = 1 of
its own head and variant.

``--per-chip`` runs each head's one-device step on every visible GPU, alone in turns and then all at once
(:func:`per_chip`): the weak scaling a data-parallel step could reach with nothing communicated.

``--schedule`` compiles each head's step on one device and on the largest data-parallel mesh in this process, once
per variant (of a ``--pgle=N`` one, the step a short run compiled with its profile, read from XLA's dump; the HLOs
kept in ``DIR/hlo.tar`` as ``step_data{k}_{head}_{variant}.hlo.txt.gz``, with XLA's live ranges beside them as
``....live-range.txt.gz``), records its compiled memory, and reads its schedule (:mod:`benchmarks.hlo_schedule`):
for each asynchronous collective its shape, how many instructions and kernels the schedule places between its start
and its done (the work it can overlap) and how many of the step's kernels come after its start; the instructions at
which the host waits for the device; and the buffers alive at the memory peak, with XLA's breakdown of the peak by
source. A backend without asynchronous collectives (the CPU) says so.

Writes ``DIR/trainer_scaling.json`` (device, n_devices, versions, date, commit, rows) and prints a table; each
trainer process's own output stays in a temporary folder unless ``--keep-runs``.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import gzip
import io
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

import jax

from benchmarks import hlo_schedule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_lm.py")
SMALL = ["--vocab-size", "512", "--d-model", "64", "--num-layers", "1", "--num-heads", "2", "--d-ff", "128",
         "--seq-len", "32"]


def meshes(k: int) -> dict[str, str]:
  """The meshes of ``k`` devices: name -> the trainer's ``--mesh``."""
  out = {"data": f"data={k}"}
  if k > 1:
    out["fsdp"] = f"fsdp={k}"
    out["tensor"] = f"data={k // 2},tensor=2"
  return out


def mesh_kinds(text: str) -> list[str]:
  """``--meshes``' comma-separated kinds (those of :func:`meshes`); an unknown kind is refused, naming it."""
  kinds = text.split(",")
  unknown = sorted(set(kinds) - set(meshes(2)))
  if unknown:
    raise SystemExit(f"--meshes {text}: unknown mesh kind(s) {unknown}; expected {sorted(meshes(2))}")
  return kinds


def planned(ks: list[int], kinds: list[str], heads: list[str], variants, done=frozenset()) -> list[tuple]:
  """The processes to run, (k, mesh kind, --mesh, head, variant), those in ``done`` left out: each mesh of ``kinds``
  (:func:`mesh_kinds`) at each k, and the one-device step (data=1) whenever 1 is among ``ks``, whatever ``kinds``
  names: it is every kind's baseline (what ``weak_scaling`` divides by)."""
  return [(k, name, mesh, head, var) for k in ks for name, mesh in meshes(k).items() for head in heads
          for var in variants if (name in kinds or k == 1) and (k, mesh, head, var) not in done]


def job_meta(n: int, preset: str, per_device_batch: int) -> dict:
  """What a trainer measurement's JSON says of its job: device, device count, versions, date, commit, command."""
  dev = jax.devices()[0]
  return {"device": getattr(dev, "device_kind", dev.platform), "n_devices": n, "jax": jax.__version__,
          "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"),
          "commit": os.environ.get("LCE_FLAX_COMMIT"), "command": " ".join(sys.argv),
          "per_device_batch": per_device_batch, "preset": preset}


ENV_ARG = "--env="  # (a variant's environment item among its trainer arguments: split off before they are parsed)


def split_env(argv: list[str]) -> tuple[list[str], dict[str, str]]:
  """(the trainer arguments, the environment) of a variant's arguments (:func:`parse_variants`'s ``env:`` items)."""
  env = dict(a.removeprefix(ENV_ARG).split("=", 1) for a in argv if a.startswith(ENV_ARG))
  return [a for a in argv if not a.startswith(ENV_ARG)], env


def _trainer_cmd(argv: list[str], out: str, env: dict[str, str] | None = None) -> tuple[list[str], dict]:
  """The command and environment of one trainer process (``argv`` with its variant's ``--env=`` items split off)."""
  argv, extra = split_env(argv)
  cmd = [sys.executable, SCRIPT, *argv, "--out", out, "--quiet"]
  path = os.environ.get("PYTHONPATH")  # (kept: optional wheels installed with --target are found through it)
  return cmd, {**os.environ, **extra, **(env or {}), "PYTHONPATH": ROOT + (os.pathsep + path if path else "")}


def _ran_past(cmd: list[str], timeout_s: float | None) -> dict:
  """The result of a trainer process stopped at ``timeout_s``."""
  return {"error": [f"ran past {timeout_s} s"], "cmd": " ".join(cmd[1:])}


def _trainer_result(cmd: list[str], returncode: int, stdout: str, stderr: str, out: str) -> dict:
  """A finished trainer process's train_lm.json, or the last line of what it printed when it failed."""
  if returncode:
    return {"error": (stderr or stdout).strip().splitlines()[-1:], "cmd": " ".join(cmd[1:])}
  with open(os.path.join(out, "train_lm.json")) as f:
    return json.load(f)


def run_trainer(argv: list[str], out: str, timeout_s: float | None = None) -> dict:
  """One trainer process; its train_lm.json (or the error it ended with, or that it ran past ``timeout_s``)."""
  cmd, env = _trainer_cmd(argv, out)
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                          timeout=timeout_s)
  except subprocess.TimeoutExpired:
    return _ran_past(cmd, timeout_s)
  return _trainer_result(cmd, proc.returncode, proc.stdout, proc.stderr, out)


def run_together(jobs: list[tuple[list[str], str, dict[str, str]]], timeout_s: float | None = None) -> list[dict]:
  """Trainer processes started at once, each ``(argv, out, env)`` with its own environment (its GPU); each one's
  train_lm.json or error, in order. ``timeout_s`` bounds them all from their start."""
  deadline = None if timeout_s is None else time.monotonic() + timeout_s
  procs = []
  for argv, out, env in jobs:
    cmd, full = _trainer_cmd(argv, out, env)
    procs.append((cmd, out, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                             env=full)))
  results = []
  for cmd, out, proc in procs:
    try:
      stdout, stderr = proc.communicate(timeout=None if deadline is None else max(deadline - time.monotonic(), 0))
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.communicate()
      results.append(_ran_past(cmd, timeout_s))
      continue
    results.append(_trainer_result(cmd, proc.returncode, stdout, stderr, out))
  return results


def per_chip(common: list[str], head: str, n: int, per_device_batch: int, runs: str,
             timeout_s: float | None = None) -> dict:
  """``head``'s one-device step on each of the ``n`` visible GPUs (``CUDA_VISIBLE_DEVICES``), first alone (one
  process at a time) and then all at once (``n`` processes, nothing communicated between them).

  A data-parallel step ends when its slowest device does, so what it can reach without any collective is the
  one-device step of the first GPU (what ``weak_scaling`` divides by) over the slowest chip's step while all run:
  ``ceiling``. What keeps it below 1 is the chips themselves (their clocks at the power limit) and what running
  together costs them (the host, the package's power and heat), not communication."""
  argv = [*common, "--loss", head, "--only-this-head", "--num-devices", "1", "--mesh", "data=1",
          "--batch-size", str(per_device_batch)]

  def step(res):
    return res.get("runs", {}).get(head, {}).get("step_time_s")

  alone = [step(run_trainer([*argv, f"{ENV_ARG}CUDA_VISIBLE_DEVICES={i}"],
                            os.path.join(runs, f"chip{i}_alone_{head}"), timeout_s)) for i in range(n)]
  together = [step(r) for r in run_together(
      [(argv, os.path.join(runs, f"chip{i}_together_{head}"), {"CUDA_VISIBLE_DEVICES": str(i)}) for i in range(n)],
      timeout_s)]
  ok = all(alone) and all(together)
  return {"head": head, "n": n, "per_device_batch": per_device_batch, "alone_step_s": alone,
          "together_step_s": together,
          "ceiling": round(alone[0] / max(together), 4) if ok else None,
          "chip_spread": round(max(alone) / min(alone), 4) if all(alone) else None}


def schedule_rows(argv: list[str], k: int, head: str, variant: str, per_device_batch: int,
                  hlo: tarfile.TarFile | None = None) -> dict:
  """``head``'s step on data = k at ``per_device_batch`` sequences per device, with ``argv`` (the variant's
  options among them), compiled here (dumping XLA's buffer assignment): its compiled memory (bytes per device),
  its schedule as :func:`benchmarks.hlo_schedule.summary` reads it and what is alive at its memory peak
  (:func:`benchmarks.hlo_schedule.peak_live`, ``peak_live``); with ``hlo``, its HLO and XLA's live ranges join that
  archive as ``step_data{k}_{head}_{variant}.hlo.txt.gz`` and ``....live-range.txt.gz``."""
  sys.path.insert(0, ROOT)
  from examples.lm import main as lm_main  # noqa: PLC0415
  from examples.lm.train import compile_step, compiled_memory, trainer_from_args  # noqa: PLC0415

  argv = split_env(argv)[0]  # (an environment variable cannot reach this process's compile)
  dump = tempfile.mkdtemp(prefix="trainer_scaling_dump_")
  try:
    dump_args = compiler_option_args([f"xla_dump_to={dump}", "xla_dump_hlo_as_text=true"])
    args = lm_main.parse_args([*argv, *dump_args, "--mesh", f"data={k}", "--num-devices", str(k),
                               "--batch-size", str(per_device_batch * k)])
    tr = trainer_from_args(args, head)
    compiled = compile_step(tr, tr.abstract_state(args.seed), args.seq_len)
    ranges = sorted(glob.glob(os.path.join(dump, "*live-range.txt")), key=os.path.getsize)
    live = open(ranges[-1]).read() if ranges else ""  # (the largest: the step's module)
  finally:
    shutil.rmtree(dump, ignore_errors=True)
  return _schedule_row(compiled.as_text(), live, k, head, variant, args.batch_size, compiled_memory(compiled), hlo)


def pgle_schedule_rows(argv: list[str], runs: int, k: int, head: str, variant: str, per_device_batch: int,
                       hlo: tarfile.TarFile | None = None, timeout_s: float | None = None) -> dict:
  """:func:`schedule_rows` of a ``--pgle`` variant, whose schedule exists only in a run: ``head``'s trainer on
  data = k for ``runs`` + 2 steps with XLA dumping every compile; the step's last compile (the highest module
  number: after the compile ahead of time and the first call's, the one with the profile) is read. ``memory`` is
  the run's compile ahead of time (before the profile). XLA's dump prints a tuple's elements as ``%x#i`` where
  the compiled object's text (:func:`schedule_rows`) has get-tuple-element instructions: its entry has fewer
  instructions, the same kernels and collectives."""
  out = tempfile.mkdtemp(prefix="trainer_scaling_pgle_")
  dump = os.path.join(out, "dump")
  if "--jax-cache-dir" in argv:  # (an executable taken from the compilation cache is not compiled, so not dumped)
    i = argv.index("--jax-cache-dir")
    argv = argv[:i] + argv[i + 2:]
  try:
    res = run_trainer([*argv, *compiler_option_args([f"xla_dump_to={dump}", "xla_dump_hlo_as_text=true"]),
                       "--steps", str(runs + 2), "--loss", head, "--only-this-head", "--num-devices", str(k),
                       "--mesh", f"data={k}", "--batch-size", str(per_device_batch * k)], out, timeout_s)
    if res.get("error"):
      raise RuntimeError(f"{variant} {head} on data={k}: {res['error']}")
    steps = glob.glob(os.path.join(dump, "module_*.jit_step.*after_optimizations.txt"))
    if not steps:
      raise RuntimeError(f"{variant} {head} on data={k}: XLA dumped no compile of the step (a compilation cache "
                         "set in the environment?)")
    last = max(steps, key=lambda f: int(os.path.basename(f).split(".")[0].removeprefix("module_")))
    text = open(last).read()
    live_path = last.removesuffix(".txt") + "-live-range.txt"
    live = open(live_path).read() if os.path.exists(live_path) else ""
  finally:
    shutil.rmtree(out, ignore_errors=True)
  mem = res["runs"][head]["memory"]["compiled"]
  return _schedule_row(text, live, k, head, variant, per_device_batch * k, mem, hlo)


def _schedule_row(text: str, live: str, k: int, head: str, variant: str, batch_size: int, memory: dict,
                  hlo: tarfile.TarFile | None) -> dict:
  """A compiled step's schedule row (and, with ``hlo``, its HLO and live ranges into that archive)."""
  if hlo is not None:
    for suffix, body in ((".hlo.txt.gz", text), (".live-range.txt.gz", live)):
      data = gzip.compress(body.encode())
      info = tarfile.TarInfo(f"step_data{k}_{head}_{variant}{suffix}")
      info.size = len(data)
      hlo.addfile(info, io.BytesIO(data))
  comps = hlo_schedule.computations(text)  # (parsed once for every reading)
  found = hlo_schedule.summary(text, comps)
  sync = sum(op == "all-reduce" for instrs in comps.values() for _, _, op, _ in instrs)  # (synchronous ones)
  return {"mesh": f"data={k}", "k": k, "head": head, "variant": variant, "batch_size": batch_size,
          "memory": memory, **found, "sync_all_reduces": sync, "peak_live": hlo_schedule.peak_live(live, comps=comps),
          "note": None if found["collectives"] or k == 1 else "no asynchronous collective in this backend's "
          "compiled step"}


def compiler_option_args(options: list[str]) -> list[str]:
  """``KEY=VALUE`` items as the trainer's ``--compiler-option`` arguments, checked by the trainer's own parser
  (:func:`examples.lm.train.compiler_options`: a ``ValueError`` names a malformed item)."""
  sys.path.insert(0, ROOT)
  from examples.lm.train import compiler_options  # noqa: PLC0415

  compiler_options(options)
  return [a for o in options for a in ("--compiler-option", o)]


def parse_variants(items: list[str]) -> dict[str, list[str]]:
  """``NAME:ITEM,ITEM`` items as name -> trainer arguments: a ``KEY=VALUE`` item becomes ``--compiler-option
  KEY=VALUE``, a ``--flag`` item stays as it is, an ``env:KEY=VALUE`` item becomes ``--env=KEY=VALUE`` (an
  environment variable of the trainer process, :func:`split_env`); ``default`` (no arguments) first unless a
  variant takes that name."""
  out: dict[str, list[str]] = {"default": []}
  for item in items:
    name, sep, opts = item.partition(":")
    try:
      if not sep or not name or not opts:
        raise ValueError(item)
      parts = opts.split(",")
      flags = [o for o in parts if o.startswith("--")]
      envs = [o.removeprefix("env:") for o in parts if o.startswith("env:")]
      if any(not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", e) for e in envs):
        raise ValueError(item)
      xla = [o for o in parts if not o.startswith(("--", "env:"))]
      out[name] = [*flags, *compiler_option_args(xla), *(ENV_ARG + e for e in envs)]
    except ValueError:
      raise SystemExit(f"--variant {item!r}: expected NAME:ITEM[,ITEM...], each KEY=VALUE, --flag or "
                       "env:KEY=VALUE") from None
  return out


def pgle_runs(args: list[str]) -> int:
  """The N of a variant's ``--pgle=N`` trainer argument (0: none; a variant's items are single words)."""
  return max((int(a.partition("=")[2]) for a in args if a.startswith("--pgle=")), default=0)


def weak_scaling(rows: list[dict]) -> list[dict]:
  """Each row with ``weak_scaling`` = t(1) / t(k), t(1) the step time of its head (and variant) on one device (None
  where either is missing)."""
  base = {(r["head"], r.get("variant", "default")): r["step_time_s"] for r in rows
          if r["k"] == 1 and r.get("step_time_s")}
  out = []
  for r in rows:
    t1 = base.get((r["head"], r.get("variant", "default")))
    out.append({**r, "weak_scaling": round(t1 / r["step_time_s"], 4) if t1 and r.get("step_time_s") else None})
  return out


def aggregate(rows: list[dict]) -> list[dict]:
  """One row per (k, mesh, head, variant), in first-seen order: the repeats' median step time and tokens/s per
  device, all of their step times (``step_times_s``), the first repeat's memory, max batch and error (the error
  only where every repeat failed)."""
  groups: dict[tuple, list[dict]] = {}
  for r in rows:
    groups.setdefault((r["k"], r["mesh"], r["head"], r.get("variant", "default")), []).append(r)
  out = []
  for reps in groups.values():
    ok = [r for r in reps if r.get("step_time_s")]
    row = {key: v for key, v in reps[0].items() if key != "repeat"}
    row.update(step_time_s=_median(ok, "step_time_s"), tokens_per_s_per_device=_median(ok, "tokens_per_s_per_device"),
               step_times_s=[r.get("step_time_s") for r in reps], error=None if ok else reps[0].get("error"))
    out.append(row)
  return out


def failed_steps(rows: list[dict]) -> dict[tuple, str]:
  """(head, variant, k) -> the error of each data-parallel row whose every trainer process failed. ``--schedule``
  does not compile those steps in the driver's process: an abort there (XLA's analytical latency estimator on a
  four-GPU step, run12 in ``benchmarks/results/trainer-scaling-2026-11-27/``) would end the whole job."""
  return {(r["head"], r.get("variant", "default"), r["k"]): str(r["error"])[:300] for r in rows
          if r.get("error") and r["mesh"] == f"data={r['k']}"}


def _median(rows: list[dict], key: str):
  vals = [r.get(key) for r in rows]
  return statistics.median(vals) if vals and all(v is not None for v in vals) else None


def previous_rows(paths: list[str], preset: str, per_device_batch: int) -> list[dict]:
  """The rows of earlier jobs' ``trainer_scaling.json``; each file must be of the same preset and per-device batch."""
  rows = []
  for path in paths:
    with open(path) as f:
      prev = json.load(f)
    if (prev.get("preset"), prev.get("per_device_batch")) != (preset, per_device_batch):
      raise SystemExit(f"--previous {path}: preset {prev.get('preset')!r}, per-device batch "
                       f"{prev.get('per_device_batch')}; this run: {preset!r}, {per_device_batch}")
    rows += [{"variant": "default", **r, "from": os.path.basename(os.path.dirname(os.path.abspath(path))) or path}
             for r in prev["rows"]]
  return rows


def memory_growth(sched: list[dict], head: str = "fused", variant: str = "default") -> dict:
  """Per-device memory of ``head``'s step on the largest data-parallel mesh of ``sched`` (the ``--schedule``
  rows) against one device, at the same per-device batch: the ratios of the compiled temporaries
  (``temp_ratio``: XLA's one temporary allocation, what the device must have free) and of XLA's live-range peak
  (``live_ratio``: the most bytes alive at one time, arguments included). The two part where XLA's packing of the
  buffers into its allocation leaves room unused at every moment (``docs/multi_gpu.md``)."""
  rows = {r["k"]: r for r in sched if r["head"] == head and r["variant"] == variant}
  one, k = rows[1], rows[max(rows)]
  live = [r["peak_live"]["bytes"] for r in (one, k)]
  return {"k": k["k"], "batch_sizes": [one.get("batch_size"), k.get("batch_size")],
          "temp_bytes": [one["memory"]["temp"], k["memory"]["temp"]], "live_peak_bytes": live,
          "temp_ratio": k["memory"]["temp"] / one["memory"]["temp"],
          "live_ratio": live[1] / live[0] if all(live) else None}


def write(out: str, meta: dict, rows: list, sched: dict | None, chips: list | None = None):
  with open(os.path.join(out, "trainer_scaling.json"), "w") as f:
    json.dump({**meta, "rows": rows, "schedule": sched, "per_chip": chips}, f, indent=1)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--preset", default="gpu")
  ap.add_argument("--per-device-batch", type=int, default=8, help="sequences per device")
  ap.add_argument("--steps", type=int, default=20, help="training steps per process; the step time is the median "
                  "of all but the first (a process's median of 5 moved by ±4%% between processes)")
  ap.add_argument("--heads", default="fused,plain")
  ap.add_argument("--max-devices", type=int, default=None)
  ap.add_argument("--ks", default=None, help="comma-separated device counts to run (default: 1, 2, 4, ... up to "
                  "the visible devices)")
  ap.add_argument("--meshes", default="data,fsdp,tensor", help="comma-separated mesh kinds to run")
  ap.add_argument("--previous", action="append", default=[], help="trainer_scaling.json of an earlier job (its "
                  "rows are not run again and enter the weak-scaling ratios); repeatable")
  ap.add_argument("--max-batch", action="store_true", help="also --find-max-batch on each mesh")
  ap.add_argument("--max-batch-limit", type=int, default=None, help="--find-max-batch stops doubling here "
                  "(default: the preset's)")
  ap.add_argument("--repeats", type=int, default=1, help="processes per (k, mesh, head), run in turns; a row takes "
                  "their median")
  ap.add_argument("--timeout-s", type=float, default=900, help="per trainer process")
  ap.add_argument("--jax-cache-dir", help="the trainers' JAX compilation cache (a repeat of a process skips its "
                  "compile); none if unset")
  ap.add_argument("--variant", action="append", default=[], metavar="NAME:ITEM[,ITEM]",
                  help="also run every process with these XLA options for the step (KEY=VALUE) and trainer flags "
                  "(--flag) (repeatable)")
  ap.add_argument("--schedule", action="store_true", help="also each head's (and variant's) compiled schedule")
  ap.add_argument("--per-chip", action="store_true", help="also each head's one-device step on every visible GPU, "
                  "alone and all at once (the weak scaling a step could reach with no communication)")
  ap.add_argument("--small", action="store_true", help="a tiny model (a CPU check of the driver)")
  ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/trainer_scaling"))
  ap.add_argument("--keep-runs", action="store_true", help="keep each trainer process's train_lm.json and plot in "
                  "DIR/<k>dev_<mesh>_<head>/ (default: a temporary folder; the rows hold what was measured)")
  a = ap.parse_args(argv)
  os.makedirs(a.out, exist_ok=True)
  n = min(jax.device_count(), a.max_devices or jax.device_count())
  ks = [k for k in (1, 2, 4, 8, 16) if k <= n]
  if a.ks:
    want = [int(k) for k in a.ks.split(",")]
    if any(k > n for k in want):
      raise SystemExit(f"--ks {a.ks}: this process sees {n} device(s)")
    ks = want
  kinds = mesh_kinds(a.meshes)
  common = ["--preset", a.preset, "--steps", str(a.steps), "--eval-every", "0", "--eval-batches", "1",
            "--sample-tokens", "0", "--bench-steps", "3", *(SMALL if a.small else []),
            *(["--jax-cache-dir", a.jax_cache_dir] if a.jax_cache_dir else [])]
  meta = job_meta(n, a.preset, a.per_device_batch)
  rows = previous_rows(a.previous, a.preset, a.per_device_batch)
  runs = a.out if a.keep_runs else tempfile.mkdtemp(prefix="trainer_scaling_")
  variants = parse_variants(a.variant)
  done = {(r["k"], r["mesh"], r["head"], r.get("variant", "default")) for r in rows}
  todo = planned(ks, kinds, a.heads.split(","), variants, done)
  for rep in range(a.repeats):  # (each repeat runs every process once: drift over the job spreads over all rows)
    for k, mesh_name, mesh, head, var in todo:
      sub = os.path.join(runs, f"{k}dev_{mesh_name}_{head}" + (f"_{var}" if len(variants) > 1 else "")
                         + (f"_{rep}" if a.repeats > 1 else ""))
      res = run_trainer([*common, *variants[var], "--loss", head, "--only-this-head", "--num-devices", str(k),
                         "--mesh", mesh, "--batch-size", str(a.per_device_batch * k)], sub, a.timeout_s)
      run = res.get("runs", {}).get(head, {})
      mem = run.get("memory", {})
      row = {"k": k, "mesh": mesh, "mesh_kind": mesh_name, "head": head, "variant": var,
             "variant_args": variants[var], "batch_size": a.per_device_batch * k,
             "step_time_s": run.get("step_time_s"),
             "tokens_per_s_per_device": run["tokens_per_s"] / k if run.get("tokens_per_s") else None,
             "compiled_peak_bytes": mem.get("compiled", {}).get("peak"),
             "compiled_temp_bytes": mem.get("compiled", {}).get("temp"),
             "gpu_peak_bytes": mem.get("gpu_peak_bytes_in_use"), "error": res.get("error"), "repeat": rep}
      if a.max_batch and rep == 0:
        limit = ["--max-batch-limit", str(a.max_batch_limit * k)] if a.max_batch_limit else []
        mb = run_trainer([*common, *variants[var], "--find-max-batch", "--heads", head, "--num-devices", str(k),
                          "--mesh", mesh, *limit], sub + "_maxbatch", a.timeout_s)
        row["max_batch"] = mb.get("max_batch", {}).get(head, mb.get("error"))
      rows.append(row)
      print(json.dumps(row), flush=True)
      write(a.out, meta, rows, None)  # (so far: a run cut short keeps what it measured)
  rows = weak_scaling(aggregate(rows))
  chips = [per_chip(common, head, n, a.per_device_batch, runs, a.timeout_s) for head in a.heads.split(",")
           ] if a.per_chip else None
  if chips:
    write(a.out, meta, rows, None, chips)
  sched = None
  if a.schedule and max(ks) > 1:
    # (a --pgle variant's schedule is the one compiled with its run's profile, inside that process: compiled here,
    # without the profile, it would be XLA's own schedule under the variant's name)
    runs = {var: pgle_runs(opts) for var, opts in variants.items()}
    failed = failed_steps(rows)

    def schedule_row(head, var, k, hlo):
      if (head, var, k) in failed:
        return {"k": k, "mesh": f"data={k}", "head": head, "variant": var, "error": failed[head, var, k],
                "note": "not compiled: its trainer run failed"}
      argv = [*common, *variants[var]]
      if runs[var]:
        return pgle_schedule_rows(argv, runs[var], k, head, var, a.per_device_batch, hlo, a.timeout_s)
      return schedule_rows(argv, k, head, var, a.per_device_batch, hlo)

    with tarfile.open(os.path.join(a.out, "hlo.tar"), "w") as hlo:
      sched = [schedule_row(head, var, k, hlo) for head in a.heads.split(",") for var in variants
               for k in (1, max(ks))]
  write(a.out, meta, rows, sched, chips)
  print(f"\n{'k':>3} {'mesh':<18} {'head':<6} {'variant':<10} {'step ms':>9} {'tok/s/dev':>11} {'weak':>6} "
        f"{'peak GB':>8}")
  for r in rows:
    ms = f"{r['step_time_s'] * 1e3:9.1f}" if r["step_time_s"] else f"{'error':>9}"
    tps = f"{r['tokens_per_s_per_device']:11,.0f}" if r["tokens_per_s_per_device"] else f"{'':>11}"
    ws = f"{r['weak_scaling']:6.3f}" if r["weak_scaling"] else f"{'':>6}"
    pk = f"{r['compiled_peak_bytes'] / 2**30:8.2f}" if r["compiled_peak_bytes"] else f"{'':>8}"
    print(f"{r['k']:>3} {r['mesh']:<18} {r['head']:<6} {r.get('variant', 'default'):<10} {ms} {tps} {ws} {pk}")
  for c in chips or ():
    print(f"\n{c['head']}, one device per chip: alone {c['alone_step_s']} s, all {c['n']} at once "
          f"{c['together_step_s']} s; ceiling {c['ceiling']}, chips' spread alone {c['chip_spread']}")
  for sc in sched or ():
    if sc.get("error"):
      print(f"\nschedule ({sc['mesh']}, {sc['head']}, {sc['variant']}): {sc['note']}: {sc['error']}")
      continue
    mem = sc["memory"]
    print(f"\nschedule ({sc['mesh']}, {sc['head']}, {sc['variant']}): compiled peak {mem['peak'] / 2**30:.2f} GiB, "
          f"temporaries {mem['temp'] / 2**30:.2f} GiB. {sc['note'] or ''}")
    for c in sc["collectives"]:
      print(f"  {c['name']:<22} {c['shape'][:40]:<40} between {c['between']!s:>4} ({c['compute_between']} compute), "
            f"kernels after its start {c['kernels_after']}/{c['kernels']}, held back past {c['kernels_held']} "
            f"({c['held_free']} with no collective in flight)")
    print(f"  host syncs: {len(sc['host_syncs'])} " + ", ".join(f"{h['kind']} {h['name']}" for h in sc["host_syncs"]))
    pk = sc["peak_live"]
    if pk["bytes"] is not None:
      print(f"  alive at the memory peak: {pk['bytes'] / 2**30:.2f} GiB, the largest: " + ", ".join(
          f"{b['name']} {b['bytes'] / 2**20:.0f} MiB" for b in pk["buffers"][:6]))
  return 0 if all(r["error"] is None for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
