"""Markdown tables and PNG plots from the benchmarks' JSON lines (``bench.py`` and ``bench_torch_peers.py``).

Usage::

  python -m benchmarks.plots RESULTS [RESULTS ...] [--out DIR] [--update FILE]

``RESULTS`` are ``*.jsonl`` files or folders holding them. Writes into ``DIR`` (default: the first folder given,
or the first file's folder) ``results.md`` (the tables), ``llm.png`` (fwd+bwd time and memory per LLM shape, our
implementations beside the peers) and ``sweep.png`` (time and memory vs V, B and H), each only where there are
rows for it. ``--update FILE`` also replaces the text between ``<!-- bench:start -->`` and ``<!-- bench:end -->``
in FILE (e.g. README.md) with the tables, image links made relative to FILE: one command regenerates the README's
Performance section.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
from collections.abc import Iterable, Sequence
from typing import Any

from benchmarks import shapes as shapes_lib

START, END = "<!-- bench:start -->", "<!-- bench:end -->"

# The anchors file's measurements (../shared/anchors/h100-2026-11-22.md): one H100 80GB HBM3, 2026-11-22, jax 0.11.2,
# torch 2.11.0, triton 3.6.0, liger-kernel 0.8.5, cut-cross-entropy 25.1.1, tokamax 0.0.17; fwd+bwd (grads of x and
# w), bf16, reduction "sum"; (ms, extra GB). A reference until a run of bench_torch_peers.py beside ours replaces it.
ANCHOR_PEERS: dict[str, dict[str, tuple[float, float]]] = {
    "gpt2-small": {"jax_xla_plain": (15.0, 6.59), "tokamax_xla": (14.2, 4.95), "tokamax_chunked_xla": (26.8, 0.30),
                   "torch_eager": (18.7, 9.79), "torch_compile": (7.6, 1.65), "liger_flce": (14.7, 0.03),
                   "cce": (11.6, 0.00)},
    "llama3-8b": {"jax_xla_plain": (78.2, 8.40), "tokamax_xla": (75.5, 4.37), "tokamax_chunked_xla": (99.7, 3.34),
                  "torch_eager": (51.1, 11.49), "torch_compile": (39.5, 2.10), "liger_flce": (65.7, 0.07),
                  "cce": (156.0, 0.00)},
    "qwen3-8b": {"jax_xla_plain": (46.4, 5.05), "tokamax_xla": (44.4, 2.59), "tokamax_chunked_xla": (62.4, 3.88),
                 "torch_eager": (32.3, 6.19), "torch_compile": (23.7, 1.25), "liger_flce": (73.1, 0.04),
                 "cce": (92.3, 0.00)},
    "gemma2-2b": {"jax_xla_plain": (92.8, 16.78), "tokamax_xla": (90.7, 12.58),
                  "tokamax_chunked_xla": (124.6, 2.46), "torch_eager": (74.0, 23.95),
                  "torch_compile": (51.1, 4.19), "liger_flce": (141.2, 0.07), "cce": (52.6, 0.00)},
}
ANCHOR_TITLE = "peers from the anchors file (one H100 80GB HBM3, 2026-11-22; not measured by this run)"
PEERS_DESC = {
    "jax_xla_plain": "JAX `x@w` + logsumexp", "tokamax_xla": "tokamax `xla`",
    "tokamax_chunked_xla": "tokamax `chunked_xla`", "torch_eager": "torch eager", "torch_compile": "torch.compile",
    "liger_flce": "Liger FLCE", "cce": "Apple CCE",
}


# --------------------------------------------------------------------------------------------------- loading


def load(paths: Iterable[str]) -> list[dict[str, Any]]:
  """Rows of every ``*.jsonl`` file in ``paths`` (files or folders); non-JSON lines are skipped."""
  files: list[str] = []
  for p in paths:
    files.extend(sorted(glob.glob(os.path.join(p, "*.jsonl"))) if os.path.isdir(p) else [p])
  rows = []
  for f in files:
    with open(f) as fh:
      for line in fh:
        line = line.strip()
        if line.startswith("{"):
          try:
            rows.append(json.loads(line))
          except json.JSONDecodeError:
            pass
  return rows


def _ok(r) -> bool:
  return "error" not in r and r.get("ms") is not None


def _mem_bytes(r) -> float | None:
  """Extra device memory of a row: JAX's compiled temp size, else torch's peak over inputs and gradients."""
  v = r.get("temp_bytes")
  return r.get("device_peak_bytes") if v is None else v


def _is_peer(r) -> bool:
  return r.get("source") == "torch" or str(r["impl"]).startswith("tokamax")


def _labels(rows) -> list[str]:
  """Column order: our implementations, then tokamax, then the torch peers, each in order of first appearance."""
  seen: dict[str, int] = {}
  for r in rows:
    lab = r.get("label") or r["impl"]
    if lab not in seen:
      group = 2 if r.get("source") == "torch" else 1 if str(r["impl"]).startswith("tokamax") else 0
      seen[lab] = group * 10_000 + len(seen)
  return sorted(seen, key=seen.get)


def _fmt_ms(v):
  return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def _fmt_gb(b):
  return "—" if b is None else f"{b / 1e9:.2f}"


def _env_line(rows) -> str:
  parts = []
  for source in ("jax", "torch"):
    rs = [r for r in rows if r.get("source", "jax") == source]
    if not rs:
      continue
    r = rs[0]
    keys = ("jax", "jaxlib", "triton", "jax_triton", "tokamax") if source == "jax" else (
        "torch", "triton", "liger_kernel", "cut_cross_entropy")
    vers = ", ".join(f"{k.replace('_', '-')} {r[k]}" for k in keys if r.get(k))
    parts.append(f"{source} side: {r.get('device')} ({r.get('date')}; {vers})")
  return "; ".join(parts)


# ---------------------------------------------------------------------------------------------------- tables


def _cell(rows, shape, label, pass_="fwdbwd", ratio=False):
  for r in rows:
    if r["shape"] == shape and (r.get("label") or r["impl"]) == label and r["pass"] == pass_:
      if not _ok(r):
        return "skipped" if str(r.get("error", "")).startswith("skipped") else "error"
      x = ""
      if ratio and r.get("floor_ms"):
        f = r["ms"] / r["floor_ms"]
        x = f" ({f:.2f}×)" if f < 100 else f" ({f:.0f}×)"
      mem = _mem_bytes(r)
      return f"{_fmt_ms(r['ms'])} ms{x} / " + ("—" if mem is None else f"{_fmt_gb(mem)} GB")
  return "—"


def _shape_rows(rows):
  return [r for r in rows if not r.get("sweep")]


def _what(rows, label) -> str:
  """'ours' or 'peer', and the FLOPs the design does in a fwd+bwd."""
  rs = [r for r in rows if (r.get("label") or r["impl"]) == label]
  peer = any(_is_peer(r) for r in rs)
  factors = {r.get("flops_factor") for r in rs if r["pass"] == "fwdbwd" and r.get("flops_factor")}
  return f"{'peer' if peer else 'lce_flax'}, {'/'.join(str(f) for f in sorted(factors)) + '·BHV' if factors else '—'}"


def llm_table(rows) -> str:
  """One line per implementation (ours first, then the peers), one column per shape: fwd+bwd time (its ratio to
  the floor) / extra memory; the first line is the floor."""
  rows = _shape_rows(rows)
  if not rows:
    return ""
  labels = _labels(rows)
  shapes = list(dict.fromkeys(r["shape"] for r in rows))
  dims = {s: next((r["B"], r["H"], r["V"]) for r in rows if r["shape"] == s) for s in shapes}
  lines = ["| fwd+bwd: ms (× floor) / extra GB | what, FLOPs | "
           + " | ".join(f"{s} {b}×{h}×{v}" for s, (b, h, v) in dims.items()) + " |",
           "|" + "---|" * (2 + len(shapes)),
           f"| floor (6·BHV at {shapes_lib.PEAK_TFLOPS:.0f} TFLOP/s) | | "
           + " | ".join(f"{_fmt_ms(shapes_lib.Shape(s, *d).floor_ms(6))} ms" for s, d in dims.items()) + " |"]
  for lab in labels:
    lines.append(f"| `{lab}` | {_what(rows, lab)} | " + " | ".join(_cell(rows, s, lab, ratio=True) for s in shapes)
                 + " |")
  return "\n".join(lines)


def detail_table(rows) -> str:
  """Every row: both passes, ×floor, TFLOP/s, memory, loss error, or the error."""
  if not rows:
    return ""
  lines = ["| shape | impl | pass | ms | × floor | TFLOP/s (floor FLOPs) | TFLOP/s (done) | temp GB | peak GB | "
           "loss | rel. err vs fp32 | FLOPs done |", "|" + "---|" * 12]
  for r in rows:
    lab = r.get("label") or r["impl"]
    if not _ok(r):
      lines.append(f"| {r['shape']} | `{lab}` | {r['pass']} | | | | | | | | | {str(r.get('error', ''))[:120]} |")
      continue
    xf = r["ms"] / r["floor_ms"] if r.get("floor_ms") else None
    rel = r.get("loss_rel_err")
    lines.append(
        f"| {r['shape']} | `{lab}` | {r['pass']} | {_fmt_ms(r['ms'])} | {'' if xf is None else f'{xf:.2f}'} | "
        f"{r.get('tflops', float('nan')):.0f} | {r.get('algo_tflops', r.get('tflops', float('nan'))):.0f} | "
        f"{_fmt_gb(r.get('temp_bytes'))} | {_fmt_gb(r.get('device_peak_bytes'))} | {r['loss']:.6g} | "
        f"{'' if rel is None else f'{rel:.1e}'} | {r.get('flops_factor', '')}·BHV |")
  return "\n".join(lines)


def sweep_table(rows) -> str:
  """Per swept axis: fwd+bwd ms / temp GB of each implementation at each value."""
  rows = [r for r in rows if r.get("sweep") and r["pass"] == "fwdbwd"]
  if not rows:
    return ""
  labels = _labels(rows)
  out = []
  for axis in ("V", "B", "H"):
    rs = sorted((r for r in rows if axis in r["sweep"].split(",")), key=lambda r: r[axis])
    if not rs:
      continue
    r0 = rs[0]
    fixed = ", ".join(f"{k}={r0[k]}" for k in "BHV" if k != axis)
    out.append(f"fwd+bwd vs {axis} ({fixed}): ms / temp GB\n")
    out.append(f"| {axis} | floor | " + " | ".join(f"`{lab}`" for lab in labels) + " |")
    out.append("|" + "---|" * (2 + len(labels)))
    for val in dict.fromkeys(r[axis] for r in rs):
      s = next(r["shape"] for r in rs if r[axis] == val)
      floor = next(r["floor_ms"] for r in rs if r[axis] == val)
      out.append(f"| {val} | {_fmt_ms(floor)} | " + " | ".join(_cell(rs, s, lab) for lab in labels) + " |")
    out.append("")
  return "\n".join(out)


def anchor_table() -> str:
  names = list(PEERS_DESC)
  lines = ["| shape (B×H×V) | floor | " + " | ".join(PEERS_DESC[n] for n in names) + " |",
           "|" + "---|" * (2 + len(names))]
  for s in shapes_lib.LLM_SHAPES:
    cells = [f"{ms:.1f} ms / {gb:.2f} GB" for ms, gb in (ANCHOR_PEERS[s.name][n] for n in names)]
    lines.append(f"| {s.name} {s.B}×{s.H}×{s.V} | {s.floor_ms(6):.1f} ms | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def markdown(rows, images: Sequence[str] = ()) -> str:
  """The whole results section: environment, LLM table, plots, sweeps, the anchors' peers, every row."""
  parts = []
  if rows:
    parts.append(f"Measured: {_env_line(rows)}.")
    parts.append(
        "Forward + backward (loss and the gradients of x and w), bf16 inputs (x ~ N(0,1), w = 0.02·N(0,1)), "
        "labels uniform, reduction \"sum\". Time: median after warm-up. Memory: extra device memory beyond inputs "
        "and gradients (JAX: compiled temp size; torch: peak allocated over a step minus what was allocated "
        f"before it). Floor: 6·B·H·V FLOPs at {shapes_lib.PEAK_TFLOPS:.0f} TFLOP/s. The FLOPs column gives what "
        "each design does: 8·B·H·V for those that recompute the logits in the backward, whose own floor is 4/3 "
        "of the one shown.")
    t = llm_table(rows)
    if t:
      parts.append(t)
  for img in images:
    parts.append(f"![{os.path.splitext(os.path.basename(img))[0]}]({img})")
  t = sweep_table(rows)
  if t:
    parts.append(t)
  if not any(r.get("source") == "torch" for r in rows):
    parts.append(f"Reference: {ANCHOR_TITLE}; fwd+bwd ms / extra GB.\n\n" + anchor_table())
  t = detail_table(rows)
  if t:
    parts.append("<details><summary>every measurement</summary>\n\n" + t + "\n\n</details>")
  return "\n\n".join(parts) + "\n"


# ----------------------------------------------------------------------------------------------------- plots


def _plt():
  import matplotlib  # noqa: PLC0415 - only when plotting
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  return plt


def _colors(labels: Sequence[str]) -> dict[str, Any]:
  """One colour per label, the same in every panel and both figures."""
  import matplotlib  # noqa: PLC0415
  cmap = matplotlib.colormaps["tab20"]
  return {lab: cmap(k % 20) for k, lab in enumerate(labels)}


def _suptitle(rows, extra: str = "") -> str:
  return _env_line(rows).replace("; torch side", "\ntorch side") + extra


def plot_llm(rows, path: str) -> str | None:
  """Bars per shape: fwd+bwd time (top, the floor dashed) and extra memory (bottom). Peers (tokamax, torch) are
  dotted; where this run has no torch rows, the anchors file's peers are added as grey hatched bars."""
  rows = [r for r in _shape_rows(rows) if r["pass"] == "fwdbwd" and _ok(r)]
  if not rows:
    return None
  shapes = list(dict.fromkeys(r["shape"] for r in rows))
  use_anchor = not any(r.get("source") == "torch" for r in rows)
  colors = _colors(_labels(rows))
  plt = _plt()
  fig, axes = plt.subplots(2, len(shapes), figsize=(3.4 * len(shapes) + 1.5, 7.5), squeeze=False)
  for j, s in enumerate(shapes):
    rs = [r for r in rows if r["shape"] == s]
    # (name, ms, bytes, colour, hatch)
    bars = [((r.get("label") or r["impl"]), r["ms"], _mem_bytes(r), colors[r.get("label") or r["impl"]],
             ".." if _is_peer(r) else None) for r in rs]
    if use_anchor and s in ANCHOR_PEERS:
      have = {b[0] for b in bars}
      bars += [(f"{n} (anchors)", ms, gb * 1e9, "#cccccc", "//") for n, (ms, gb) in ANCHOR_PEERS[s].items()
               if n not in have]
    for i, vals in enumerate(([b[1] for b in bars], [(b[2] or 0) / 1e9 for b in bars])):
      ax = axes[i][j]
      for k, (b, v) in enumerate(zip(bars, vals)):
        ax.bar(k, v, color=b[3], hatch=b[4], edgecolor="#555555" if b[4] else None, lw=0.3)
        ax.annotate(f"{v:.3g}", (k, v), ha="center", va="bottom", fontsize=6, rotation=90,
                    xytext=(0, 2), textcoords="offset points")
      ax.set_xticks(range(len(bars)), [b[0] for b in bars], rotation=75, fontsize=7)
      ax.margins(y=0.15)
      if i == 0:
        r0 = rs[0]
        ax.axhline(r0["floor_ms"], color="k", ls="--", lw=1, label="6·BHV floor")
        ax.set_title(f"{s}\n{r0['B']}×{r0['H']}×{r0['V']}", fontsize=9)
        ax.legend(fontsize=7)
    axes[0][j].set_ylabel("fwd+bwd, ms")
    axes[1][j].set_ylabel("extra memory, GB")
  anchored = use_anchor and any(s in ANCHOR_PEERS for s in shapes)
  fig.suptitle(_suptitle(rows, "\ngrey hatched: peers from the anchors file (H100, 2026-11-22), not this run"
                         if anchored else ""), fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def plot_sweep(rows, path: str) -> str | None:
  """Time (top) and memory (bottom) vs V, B and H, one line per implementation."""
  rows = [r for r in rows if r.get("sweep") and r["pass"] == "fwdbwd" and _ok(r)]
  axes_present = [a for a in ("V", "B", "H") if any(a in r["sweep"].split(",") for r in rows)]
  if not axes_present:
    return None
  labels = _labels(rows)
  colors = _colors(labels)
  plt = _plt()
  fig, axes = plt.subplots(2, len(axes_present), figsize=(4.5 * len(axes_present), 7), squeeze=False)
  for j, axis in enumerate(axes_present):
    rs = sorted((r for r in rows if axis in r["sweep"].split(",")), key=lambda r: r[axis])
    r0 = rs[0]
    fixed = ", ".join(f"{k}={r0[k]}" for k in "BHV" if k != axis)
    for k, lab in enumerate(labels):
      pts = [r for r in rs if (r.get("label") or r["impl"]) == lab]
      if not pts:
        continue
      xs = [r[axis] for r in pts]
      axes[0][j].plot(xs, [r["ms"] for r in pts], "o-", color=colors[lab], label=lab)
      axes[1][j].plot(xs, [max(_mem_bytes(r) or 0, 1e3) / 1e9 for r in pts], "o-", color=colors[lab], label=lab)
    floors = sorted({(r[axis], r["floor_ms"]) for r in rs})
    axes[0][j].plot([f[0] for f in floors], [f[1] for f in floors], "k--", lw=1, label="6·BHV floor")
    # log-log: linear scaling is a slope of 1, and ratios between designs are equal gaps at every size; lean
    # designs' memory sits 10–100× under that of the ones that keep logits.
    axes[0][j].set_yscale("log")
    axes[1][j].set_yscale("log")
    for i in range(2):
      ax = axes[i][j]
      ax.set_xscale("log", base=2)
      ax.set_xlabel(axis)
      ax.grid(alpha=0.3)
    axes[0][j].set_ylabel("fwd+bwd ms")
    axes[1][j].set_ylabel("extra memory, GB")
    axes[0][j].set_title(f"vs {axis} ({fixed})", fontsize=9)
    axes[0][j].legend(fontsize=7)
  fig.suptitle(_suptitle(rows), fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


# ----------------------------------------------------------------------------------------------------- entry


def update_file(path: str, text: str) -> None:
  """Replaces what lies between the bench markers of ``path`` with ``text``."""
  with open(path) as fh:
    doc = fh.read()
  i, j = doc.find(START), doc.find(END)
  if i < 0 or j < i:
    raise ValueError(f"{path} has no '{START}' … '{END}' markers to replace between")
  with open(path, "w") as fh:
    fh.write(doc[:i + len(START)] + "\n" + text + doc[j:])


def report(inputs: str | Sequence[str], out_dir: str | None = None, update: str | None = None) -> list[str]:
  """Writes results.md and the PNGs for the rows of ``inputs``; returns the paths written."""
  inputs = [inputs] if isinstance(inputs, str) else list(inputs)
  if out_dir is None:
    out_dir = inputs[0] if os.path.isdir(inputs[0]) else os.path.dirname(inputs[0]) or "."
  os.makedirs(out_dir, exist_ok=True)
  rows = load(inputs)
  written = [p for p in (plot_llm(rows, os.path.join(out_dir, "llm.png")),
                         plot_sweep(rows, os.path.join(out_dir, "sweep.png"))) if p]
  md_path = os.path.join(out_dir, "results.md")
  with open(md_path, "w") as fh:
    fh.write(markdown(rows, [os.path.basename(p) for p in written]))
  written.append(md_path)
  if update:
    rel = os.path.relpath(out_dir, os.path.dirname(os.path.abspath(update)) or ".")
    update_file(update, markdown(rows, [os.path.join(rel, os.path.basename(p)) for p in written[:-1]]))
    written.append(update)
  return written


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description="Tables and plots from benchmark JSON lines.")
  p.add_argument("results", nargs="+", help="*.jsonl files or folders of them")
  p.add_argument("--out", default=None, help="output folder (default: the first input's folder)")
  p.add_argument("--update", default=None, help=f"file whose {START} … {END} section is replaced")
  a = p.parse_args(argv)
  for f in report(a.results, a.out, a.update):
    print(f"wrote {f}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
