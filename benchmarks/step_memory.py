"""The example trainer's step compiled (not run) on one device and on a data-parallel mesh of k, at one per-device
batch: per-device temporaries and peak, and where its all-reduces sit in the schedule. A data-parallel step should
need no more temporaries per device than the one-device step (gradients are reduced, not kept twice).

    python3 -m benchmarks.step_memory --per-device-batch 64 --ks 1,2 [--heads fused,plain]
        [--variant NAME:ITEM,...] [--out DIR]

``--variant`` as in :mod:`benchmarks.trainer_scaling` (``KEY=VALUE``: an XLA option; ``--flag``: a trainer
argument), e.g. ``--variant unordered:--no-layer-grads-in-order``. Writes ``DIR/step_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax

from benchmarks import hlo_schedule
from benchmarks.trainer_scaling import ROOT, job_meta, parse_variants


def compile_one(argv: list[str], k: int, head: str) -> dict:
  """``head``'s step at ``argv`` on data = k: compiled memory (bytes per device) and its collectives' schedule."""
  sys.path.insert(0, ROOT)
  from examples.lm import main as lm_main  # noqa: PLC0415
  from examples.lm.train import compile_step, compiled_memory, trainer_from_args  # noqa: PLC0415

  args = lm_main.parse_args([*argv, "--mesh", f"data={k}", "--num-devices", str(k)])
  t0 = time.perf_counter()
  tr = trainer_from_args(args, head)
  compiled = compile_step(tr, tr.abstract_state(args.seed), args.seq_len)
  found = hlo_schedule.summary(compiled.as_text())
  colls = found["collectives"]
  first = max((c["kernels_after"] for c in colls), default=None)
  return {"k": k, "head": head, "memory": compiled_memory(compiled), "compile_s": round(time.perf_counter() - t0, 1),
          "collectives": len(colls), "first_start_kernels_after": first,
          "kernels": colls[0]["kernels"] if colls else None,
          "overlapped": sum(1 for c in colls if c["compute_between"]), "host_syncs": len(found["host_syncs"])}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--preset", default="gpu")
  ap.add_argument("--per-device-batch", type=int, default=64)
  ap.add_argument("--ks", default="1,2")
  ap.add_argument("--heads", default="fused")
  ap.add_argument("--variant", action="append", default=[], metavar="NAME:ITEM[,ITEM]")
  ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/step_memory"))
  a = ap.parse_args(argv)
  os.makedirs(a.out, exist_ok=True)
  ks = [int(k) for k in a.ks.split(",")]
  if max(ks) > jax.device_count():
    raise SystemExit(f"--ks {a.ks}: this process sees {jax.device_count()} device(s)")
  rows = []
  for var, extra in parse_variants(a.variant).items():
    for head in a.heads.split(","):
      for k in ks:
        argv_k = ["--preset", a.preset, "--batch-size", str(a.per_device_batch * k), *extra]
        row = {"variant": var, "variant_args": extra, **compile_one(argv_k, k, head)}
        rows.append(row)
        m = row["memory"]
        print(f"{var:<10} {head:<6} k={k}: temporaries {m['temp'] / 2**30:6.2f} GiB, peak {m['peak'] / 2**30:6.2f} GiB"
              f" per device; {row['collectives']} async collectives, {row['overlapped']} overlapping compute, the "
              f"earliest with {row['first_start_kernels_after']}/{row['kernels']} kernels after its start "
              f"({row['compile_s']} s)", flush=True)
        with open(os.path.join(a.out, "step_memory.json"), "w") as f:
          json.dump({**job_meta(max(ks), a.preset, a.per_device_batch), "rows": rows}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
