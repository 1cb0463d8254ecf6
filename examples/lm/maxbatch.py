"""Does a step fit, and the largest batch that does: on a GPU a step must really run (out-of-memory is caught); on a
CPU its compiled peak must be within a budget (a CPU process would swap rather than fail)."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import jax

from .data import Data, train_batch
from .train import (
  compile_step,
  compiled_memory,
  gpu_peak_bytes,
  human,
  is_oom,
  oom_message,
  parse_mesh,
  run_steps,
  trainer_from_args,
)


def probe(args: argparse.Namespace, data: Data, head: str, batch_size: int, budget: int | None) -> dict[str, Any]:
  """Does a step of ``head`` at ``batch_size`` fit? Its compiled memory, then (if within ``budget`` bytes, or with
  no budget) ``--bench-steps`` timed steps; an out-of-memory error at compile or run time is the answer "no"."""
  tr = trainer_from_args(args, head, batch_size)
  with jax.set_mesh(tr.mesh):
    return _probe(args, data, tr, batch_size, budget)


def _probe(args, data, tr, batch_size, budget) -> dict[str, Any]:
  rec: dict[str, Any] = {"batch_size": batch_size, "fits": False}
  state = None
  try:
    compiled = compile_step(tr, tr.abstract_state(args.seed), args.seq_len)
    rec["memory"] = compiled_memory(compiled)
    if budget is not None and rec["memory"]["peak"] > budget:
      return rec
    if budget is not None and args.bench_steps == 0:  # CPU, no timing asked: the analysis is the answer
      rec["fits"] = True
      return rec
    state = tr.init(args.seed)
    # (timed as the training loop times its steps: each dispatched before the previous one's loss is read)
    state, times = run_steps(compiled, state, range(max(args.bench_steps, 1) + 1), lambda i: tr.put_batch(
        train_batch(data.train_ids, i, batch_size, args.seq_len, args.seed, tr.rows)))
    rec["fits"] = True
    rec["tokens_per_s"] = batch_size * args.seq_len / statistics.median(times[1:] or times)
    if jax.default_backend() == "gpu":
      rec["gpu_peak_bytes_in_use"] = gpu_peak_bytes()
  except Exception as e:  # noqa: BLE001 - only out-of-memory is an answer; anything else is a bug
    if not is_oom(e):
      raise
    rec["error"] = oom_message(e)
  finally:
    del state
    jax.clear_caches()
  return rec


def search_max_batch(fits: Callable[[int], bool], start: int, unit: int, limit: int, tol: float
                     ) -> tuple[int, int | None]:
  """Largest multiple of ``unit`` in [unit, ``limit``] for which ``fits`` (monotone) holds: halve from ``start``
  until it fits, double until it does not, then bisect. Returns (largest fitting batch or 0, smallest failing
  batch seen or None if ``limit`` was reached); bisection stops once their gap is at most
  ``max(unit, tol * lo)``, since each probe is a compile (and on a GPU a run)."""
  lo, hi = 0, None
  b = max(start // unit * unit, unit)
  while b >= unit and not fits(b):  # the configured batch does not fit: halve down
    hi, b = b, b // 2 // unit * unit
  if b >= unit:
    while b <= limit:  # double up
      if not fits(b):
        hi = b
        break
      lo, b = b, b * 2
  if hi is not None and lo:
    while hi - lo > max(unit, int(tol * lo) // unit * unit):  # invariant: lo fits, hi does not
      mid = (lo + hi) // 2 // unit * unit
      if fits(mid):
        lo = mid
      else:
        hi = mid
  return lo, hi


def batch_unit(args: argparse.Namespace) -> int:
  """The batch is split over data × fsdp: every batch is a multiple of their sizes."""
  sizes, n = parse_mesh(args.mesh), len(jax.devices()[:args.num_devices or None])
  rest = n // (sizes["fsdp"] * sizes["tensor"])
  data_size = n if sizes["data"] == 0 else sizes["data"] if sizes["data"] > 0 else rest
  return data_size * sizes["fsdp"]


def find_max_batch(args: argparse.Namespace, data: Data, head: str, log: Callable[[str], None]) -> dict[str, Any]:
  """Largest batch (a multiple of the data-parallel width) whose step fits: doubling, then bisection."""
  gpu = jax.default_backend() == "gpu"
  budget = None if gpu else int(args.mem_budget_gib * 2**30)
  unit = batch_unit(args)
  probes: dict[int, dict] = {}

  def fits(b: int) -> bool:
    if b not in probes:
      probes[b] = probe(args, data, head, b, budget)
      r = probes[b]
      log(f"  {head} batch {b:5d}: {'fits' if r['fits'] else 'does not fit'}"
          + (f", compiled peak {human(r['memory']['peak'])} (temporaries {human(r['memory']['temp'])})"
             if "memory" in r else "")
          + (f", {r['tokens_per_s']:,.0f} tok/s" if r.get("tokens_per_s") else ""))
    return probes[b]["fits"]

  lo, hi = search_max_batch(fits, args.batch_size, unit, args.max_batch_limit, args.max_batch_tol)
  limit = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit") if gpu else None
  return {"max_batch": lo, "limit_reached": hi is None, "budget_bytes": budget, "unit": unit,
          "device_bytes_limit": limit, "probes": [probes[k] for k in sorted(probes)]}
