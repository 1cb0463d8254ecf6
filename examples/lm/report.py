"""What a run prints and writes: one table of both heads (step peak, the step's temporaries — the head's own memory
—, tokens/s, held-out loss, largest batch, or "does not fit"), ``train_lm.json`` and ``train_lm.png``."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from typing import Any

from .data import _atomic_write
from .model import HEADS
from .train import human

COLORS = {"fused": "tab:blue", "plain": "tab:orange"}


def head_summary(result: dict[str, Any], head: str) -> dict[str, Any] | None:
  """One head's numbers at the run's batch: from its training run, else from the step compiled (and timed) beside
  it (``same_batch``). None when neither measured it."""
  run, other = result.get("runs", {}).get(head), result.get("same_batch", {}).get(head)
  rec = run or other
  if rec is None:
    return None
  mem = rec.get("memory") or {}
  compiled = mem.get("compiled", mem if "peak" in mem else None)
  fits = rec.get("fits", True)
  return {"fits": fits, "error": rec.get("error"), "trained": run is not None and fits,
          "peak": (compiled or {}).get("peak"), "temp": (compiled or {}).get("temp"),
          "gpu_peak": mem.get("gpu_peak_bytes_in_use", rec.get("gpu_peak_bytes_in_use")) if run else None,
          "tokens_per_s": rec.get("tokens_per_s"), "final_eval": rec.get("final_eval") if run else None}


def print_table(result: dict[str, Any], log: Callable[[str], None]) -> None:
  mb = result.get("max_batch", {})
  batch = result.get("config", {}).get("batch_size")
  log("")
  log(f"{'head':6} {'step peak':>11} {'temporaries':>12} {'GPU peak':>11} {'tokens/s':>10} {'eval loss':>10} "
      f"{'ppl':>8} {'max batch':>10}  at batch {batch}")
  rows = {h: head_summary(result, h) for h in HEADS}
  for head in HEADS:
    s, mx = rows[head], mb.get(head, {}).get("max_batch")
    if s is None and head not in mb:
      continue
    s = s or {}
    e, t = s.get("final_eval"), s.get("tokens_per_s")
    note = "" if s.get("fits", True) else "  does not fit"
    if s and s.get("fits", True) and not s.get("trained"):
      note = "  (compiled and timed beside the run)" if t else "  (compiled beside the run)"
    log(f"{head:6} {human(s.get('peak')):>11} {human(s.get('temp')):>12} {human(s.get('gpu_peak')):>11} "
        f"{(f'{t:,.0f}' if t else '-'):>10} {(f'{e['loss']:.3f}' if e else '-'):>10} "
        f"{(f'{e['ppl']:.1f}' if e else '-'):>8} {(str(mx) if mx is not None else '-'):>10}{note}")
  f, p = rows["fused"], rows["plain"]
  if f and p and f.get("peak") and p.get("peak"):
    log(f"at batch {batch}: the plain head's step peak is {p['peak'] / f['peak']:.2f}x the fused one's "
        f"({human(p['peak'])} vs {human(f['peak'])}), its temporaries {p['temp'] / max(f['temp'], 1):.2f}x "
        f"({human(p['temp'])} vs {human(f['temp'])})")
  if f and p and f.get("tokens_per_s") and p.get("tokens_per_s"):
    log(f"tokens/s: fused {f['tokens_per_s']:,.0f}, plain {p['tokens_per_s']:,.0f} "
        f"({f['tokens_per_s'] / p['tokens_per_s']:.2f}x)")
  for head, s in rows.items():
    if s and not s.get("fits", True):
      other = "fused" if head == "plain" else "plain"
      ok = rows[other] and rows[other].get("fits", True)
      log(f"{head}: does not fit at batch {batch} ({s.get('error')})"
          + (f"; the {other} head trains at this batch" if ok else ""))
  if "fused" in mb and "plain" in mb and mb["plain"]["max_batch"]:
    log(f"largest batch: fused {mb['fused']['max_batch']} vs plain {mb['plain']['max_batch']} "
        f"({mb['fused']['max_batch'] / mb['plain']['max_batch']:.2f}x)")


def plot(result: dict[str, Any], path: str) -> None:
  """Loss curves, memory and throughput of the heads in ``result`` (fused vs plain), one PNG."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  runs = {h: r for h, r in result.get("runs", {}).items() if r.get("losses")}
  mb = result.get("max_batch", {})
  fig, axes = plt.subplots(1, 3 if runs else 2, figsize=(16 if runs else 11, 4.5))
  if runs:
    ax = axes[0]
    for head, r in runs.items():
      ax.plot(range(1, len(r["losses"]) + 1), r["losses"], color=COLORS[head], lw=2.5 if head == "fused" else 1,
              ls="-" if head == "fused" else "--", label=f"{head} train")  # the curves coincide: keep both visible
      ev = r.get("eval") or []
      if ev:
        ax.plot([e["step"] for e in ev], [e["loss"] for e in ev], "o--", color=COLORS[head], label=f"{head} held-out")
    ax.set(xlabel="step", ylabel="loss", title="loss")
    ax.legend()
  ax_m, ax_t = axes[-2], axes[-1]
  if mb:
    for head, r in mb.items():
      ok = [p for p in r["probes"] if "memory" in p]
      ax_m.plot([p["batch_size"] for p in ok], [p["memory"]["peak"] / 2**30 for p in ok], "o-", color=COLORS[head],
                label=f"{head} (max batch {r['max_batch']})")
      ts = [p for p in r["probes"] if p.get("tokens_per_s")]
      ax_t.plot([p["batch_size"] for p in ts], [p["tokens_per_s"] for p in ts], "o-", color=COLORS[head], label=head)
      if r["max_batch"]:
        ax_m.axvline(r["max_batch"], color=COLORS[head], ls=":")
    budget = next((r.get("budget_bytes") or r.get("device_bytes_limit") for r in mb.values()
                   if r.get("budget_bytes") or r.get("device_bytes_limit")), None)
    if budget:
      gpu = any(r.get("device_bytes_limit") for r in mb.values())
      ax_m.axhline(budget / 2**30, color="gray", ls="--", label="allocator limit" if gpu else "budget")
    for a in (ax_m, ax_t):
      a.set_xscale("log", base=2)
      a.set_xlabel("batch size")
      a.legend()
    ax_m.set(ylabel="GiB per device (compiled step peak)", title="memory vs batch")
    ax_t.set(ylabel="tokens/s", title="throughput vs batch")
  else:
    rows = {h: s for h in HEADS if (s := head_summary(result, h)) is not None}
    names = list(rows)
    peak = [(rows[n].get("peak") or 0) / 2**30 for n in names]
    temp = [(rows[n].get("temp") or 0) / 2**30 for n in names]
    ax_m.bar(names, peak, color=[COLORS[n] for n in names], alpha=0.4, label="step peak")
    ax_m.bar(names, temp, color=[COLORS[n] for n in names], label="temporaries (the head's own)")
    for i, n in enumerate(names):
      if not rows[n].get("fits", True):
        ax_m.text(i, max(peak[i], 0) + 0.01, "does not fit", ha="center", va="bottom")
    ax_m.set(ylabel="GiB per device", title=f"compiled step, batch {result.get('config', {}).get('batch_size')}")
    ax_m.legend()
    tn = [n for n in names if rows[n].get("tokens_per_s")]
    ax_t.bar(tn, [rows[n]["tokens_per_s"] for n in tn], color=[COLORS[n] for n in tn])
    ax_t.set(ylabel="tokens/s", title="throughput")
  fig.suptitle(f"lce_flax example LM — {result.get('device', '')}")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # tight_layout gives up on some small figures; the PNG is fine
    fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def write_outputs(result: dict[str, Any], out: str, log: Callable[[str], None]) -> tuple[str, str]:
  os.makedirs(out, exist_ok=True)
  jpath, ppath = os.path.join(out, "train_lm.json"), os.path.join(out, "train_lm.png")
  _atomic_write(jpath, lambda p: open(p, "w").write(json.dumps(result, indent=1)))
  plot(result, ppath)
  log(f"wrote {jpath} and {ppath}")
  return jpath, ppath
