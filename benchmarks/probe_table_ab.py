"""What merging rows into the tuning table, or turning one of the kernels' switches, would do to the op's whole
step, measured before the change lands (one GPU).

The op reads the package's table (``lce_flax/_impl/pallas_mosaic/gemm_tuning.json``) and the kernels' module
switches (e.g. ``gemm.L2_PREFETCH``) at trace time, so one process can compile the step twice:

* ``--rows FILE``: under the table as it is (``table``) and under a copy with the rows of ``FILE`` merged into it
  (``merged``: ``benchmarks/tuning_table.py``'s merge, the same as ``--merge`` would do);
* ``--flag MODULE.NAME``: with that switch of ``lce_flax._impl.pallas_mosaic`` False (``off``) and True (``on``);
* ``--role ROLE --configs "CHANGES;CHANGES;..."``: under the table as it is (``table``) and, for each ``CHANGES``
  (``field=value,...`` of a ``GemmConfig``), with every GEMM of that role running the config the table picks for it
  so changed (labelled by ``CHANGES``): a sweep of one kernel's config measured in the whole step, where a chunk's
  kernel timed alone can rank configs the other way round.

Per shape and mode it times, in alternation (median of ``--rounds`` rounds of 10-run medians), ``value_and_grad``
of x and w (summed loss) of the plain head and of ``impl="pallas_mosaic"`` in each ``--mode`` under each variant,
with each step's compiled temporaries and the largest relative difference of each step's gradients from the first
variant's (``speedup``: the first variant's time over each other's). A variant that fails to compile (a config the
kernel refuses) is recorded in ``errors`` and left out.

    python3 -m benchmarks.probe_table_ab --rows DIR/lean_dz_rows.json --mode lean --shapes gemma2-2b,llama3-8b
    python3 -m benchmarks.probe_table_ab --flag gemm.L2_PREFETCH --mode fast,lean --shapes llama3-8b-32k
    python3 -m benchmarks.probe_table_ab --role dw_acc --configs "epi_n=32;epi_slots=3,epi_n=32" --mode fast \
        --shapes llama3-8b-32k,gemma2-2b-32k
    python3 -m benchmarks.probe_table_ab --interpret --rows ROWS --shapes tiny --rounds 1     # a CPU check

Writes ``DIR/results.json`` (device, versions, date, ``LCE_FLAX_COMMIT``, rows) after every shape and prints one
JSON line per shape.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import json
import os
import shutil
import sys
import tempfile
from unittest import mock

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import bench, tuning_table  # noqa: E402
from benchmarks.bench_floors import SHAPES, head_steps  # noqa: E402
from benchmarks.bench_gemm import config_changes, interleaved, rel_err, save_probe  # noqa: E402
from lce_flax import explain, linear_cross_entropy  # noqa: E402
from lce_flax._impl.pallas_mosaic import tuning  # noqa: E402


def op_step(y, mode: str, interpret: bool):
  """A new jitted ``value_and_grad`` of x and w (summed loss) of ``impl="pallas_mosaic"`` in ``mode`` (a new
  function each call: jit's cache must not hand one table's trace to the other)."""
  kw = dict(reduction="sum", impl="pallas_mosaic", mode=mode, interpret=interpret)
  return jax.jit(jax.value_and_grad(lambda x, w: linear_cross_entropy(x, w, y, **kw), (0, 1))), kw


def ab_row(name: str, variants: dict, mode: str, rounds: int, interpret: bool) -> dict:
  """One shape in one mode: the plain head and the op's step compiled under each of ``variants`` (label → a
  context manager factory in force while the step traces and compiles; the first is the baseline), timed in
  alternation."""
  x, w, y = bench.make_inputs(SHAPES[name])
  calls, temp, plans, grads, errors = {"plain": (head_steps(y, False, interpret)["plain"], (x, w))}, {}, {}, {}, {}
  for label, variant in variants.items():
    try:
      with variant():
        f, kw = op_step(y, mode, interpret)
        d = explain(x, w, y, **kw)
        plans[label] = [str(d.config), *d.notes]  # (the notes name each kernel's config and its table row)
        g = f.lower(x, w).compile()  # (compiled under this variant: the plan and kernels are fixed from here on)
    except Exception as e:  # noqa: BLE001  (a config the kernel refuses: recorded, the others still run)
      if label == next(iter(variants)):
        raise
      errors[label] = f"{type(e).__name__}: {str(e)[:300]}"
      continue
    temp[label] = round(g.memory_analysis().temp_size_in_bytes / 1e9, 4)
    grads[label] = g(x, w)[1]
    calls[label] = (g, (x, w))
  base, *others = [k for k in variants if k in calls]
  diff = max((rel_err(u, v) for k in others for u, v in zip(grads[k], grads[base])), default=0.0)
  del grads
  t = interleaved(calls, rounds=rounds)
  row = {"name": name, "shape": [*x.shape, w.shape[1]], "mode": mode, "ms": {k: round(v, 3) for k, v in t.items()},
         "vs_plain": {k: round(t[k] / t["plain"], 3) for k in [base, *others]},
         "speedup": {k: round(t[base] / t[k], 3) for k in others}, "temp_gb": temp,
         "same_plan": all(plans[k] == plans[base] for k in others), "plans": plans, "grad_rel_diff": diff}
  return {**row, "errors": errors} if errors else row


def flag_set(flag: str, value: bool):
  """A context manager in which ``lce_flax._impl.pallas_mosaic.MODULE.NAME`` (``flag`` = ``"MODULE.NAME"``) is
  ``value``; ``ValueError`` at once where that is no boolean switch."""
  module, name = flag.rsplit(".", 1)
  mod = importlib.import_module(f"lce_flax._impl.pallas_mosaic.{module}")
  if not isinstance(getattr(mod, name, None), bool):
    raise ValueError(f"--flag {flag}: lce_flax._impl.pallas_mosaic.{module} has no boolean {name}")
  return mock.patch.object(mod, name, value)


def role_changed(role: str, changes: dict):
  """A context manager in which every GEMM of ``role`` traced runs the config the table picks for it with
  ``changes`` applied (its ``explain()`` note says so)."""
  pick = tuning.select_row

  def changed(r, m, n, k, device_kind):
    cfg, src = pick(r, m, n, k, device_kind)
    if r != role:
      return cfg, src
    return dataclasses.replace(cfg, **changes), f"{src}, changed: {changes}"

  return mock.patch.object(tuning, "select_row", changed)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  what = ap.add_mutually_exclusive_group(required=True)
  what.add_argument("--rows", help="a file of rows in the table's format (\"devices\" and/or \"steps\")")
  what.add_argument("--flag", help="MODULE.NAME: a boolean switch of lce_flax._impl.pallas_mosaic, off against on")
  what.add_argument("--role", help="a GEMM role (fwd_store, dw_acc, ...) whose config --configs changes")
  ap.add_argument("--configs", help="--role: ';'-separated changes of its config, each 'field=value,...'")
  ap.add_argument("--mode", default="lean", help="comma list of fast, lean")
  ap.add_argument("--shapes", default="gpt2-small,llama3-8b,qwen3-8b,gemma2-2b")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--interpret", action="store_true", help="the kernels interpreted (a CPU check)")
  ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/probe_table_ab"))
  a = ap.parse_args(argv)
  modes = a.mode.split(",")
  if not set(modes) <= {"fast", "lean"}:
    ap.error(f"--mode {a.mode}: each of fast, lean")
  if bool(a.role) != bool(a.configs):
    ap.error("--role and --configs go together")
  os.makedirs(a.out, exist_ok=True)
  with tempfile.TemporaryDirectory() as tmp:
    if a.rows:
      merged = os.path.join(tmp, "gemm_tuning.json")
      shutil.copy(tuning.TABLE_PATH, merged)
      counts = tuning_table.merge(a.rows, merged)
      variants = {"table": lambda: tuning.table_at(tuning.TABLE_PATH), "merged": lambda: tuning.table_at(merged)}
      head = {"rows_file": a.rows, "merged": counts}
    elif a.flag:
      flag_set(a.flag, False)  # (a flag that is not there fails here, before any shape runs)
      variants = {"off": lambda: flag_set(a.flag, False), "on": lambda: flag_set(a.flag, True)}
      head = {"flag": a.flag}
    else:
      variants = {"table": contextlib.nullcontext}
      for item in a.configs.split(";"):  # (a field that GemmConfig lacks fails here, before any shape runs)
        variants[item] = functools.partial(role_changed, a.role, config_changes(item))
      head = {"role": a.role, "configs": a.configs.split(";")}
    print(json.dumps(head), flush=True)
    rows = []
    for name in a.shapes.split(","):
      for mode in modes:
        r = ab_row(name, variants, mode, a.rounds, a.interpret)
        rows.append(r)
        print(json.dumps(r), flush=True)
        save_probe(a.out, [head, *rows], a.rounds)
  return 0


if __name__ == "__main__":
  sys.exit(main())
