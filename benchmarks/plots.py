"""Markdown tables and PNG plots from the benchmarks' JSON lines (``bench.py`` and ``bench_torch_peers.py``).

Usage::

  python -m benchmarks.plots RESULTS [RESULTS ...] [--out DIR] [--update FILE]

  python -m benchmarks.plots RESULTS --update docs/performance.md --section NAME [--no-write]

``RESULTS`` are ``*.jsonl`` files or folders holding them. Writes into ``DIR`` (default: the first folder given,
or the first file's folder) ``results.md`` (the tables), ``llm.png`` (fwd+bwd time and memory per LLM shape, every
row beside the plain head) and ``sweep.png`` (time and memory vs V, B and H), each only where there are rows for
it. ``--update FILE`` also replaces the text between ``<!-- bench:start -->`` and ``<!-- bench:end -->`` in FILE
with the tables, image links made relative to FILE; ``--section NAME`` picks the section between
``<!-- bench:NAME:start -->`` and ``<!-- bench:NAME:end -->`` instead (``docs/performance.md`` has one per
committed run), and ``--no-write`` leaves the results folder untouched.

Ratios are to the ``plain_bf16`` row of the same shape (the head without lce_flax); results that have no such row
(runs made before the harness had it) get ratios to the matmul floor instead, and the table says so.
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

BASELINE = "plain_bf16"  # the head without lce_flax (bf16 nn.Dense + optax): every ratio is to it
DESCRIPTION = (
    "Rows: `plain_bf16` is the head without this package, `nn.Dense(V, dtype=bfloat16)` and "
    "`optax.softmax_cross_entropy_with_integer_labels` on its [B, V] bf16 logits: the baseline of every ratio. "
    "`plain_f32` upcasts those logits to float32 before optax. `auto` is `impl=\"auto\"` (what it resolved to is in "
    "the FLOPs column and in each row's `design`). `xla` is lce_flax's float32 reference (float32 logits "
    "differentiated by autodiff): a numerics reference, not a speed baseline. `impl:mode` rows are lce_flax's "
    "implementations; tokamax and torch rows are peers.")

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


def _is_plain(r) -> bool:
  return str(r["impl"]).startswith("plain_")


def _label(r) -> str:
  return r.get("label") or r["impl"]


def _group(r) -> int:
  """0 the plain heads, 1 auto, 2 lce_flax's implementations, 3 tokamax, 4 torch."""
  if _is_plain(r):
    return 0
  if r.get("source") == "torch":
    return 4
  if str(r["impl"]).startswith("tokamax"):
    return 3
  return 1 if r["impl"] == "auto" else 2


def _labels(rows) -> list[str]:
  """Order: the plain heads, auto, our implementations, tokamax, the torch peers; each in order of appearance."""
  seen: dict[str, int] = {}
  for r in rows:
    lab = _label(r)
    if lab not in seen:
      seen[lab] = _group(r) * 10_000 + len(seen)
  return sorted(seen, key=seen.get)


def _shown(lab: str) -> str:
  return "`xla` (float32 reference)" if lab == "xla" else f"`{lab}`"


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


def _find(rows, shape, label, pass_="fwdbwd"):
  return next((r for r in rows if r["shape"] == shape and _label(r) == label and r["pass"] == pass_), None)


def _baseline(rows, shape, pass_="fwdbwd"):
  """The measured ``plain_bf16`` row of ``shape``, or None."""
  r = _find(rows, shape, BASELINE, pass_)
  return r if r is not None and _ok(r) else None


def _ratio(v, base) -> str:
  if v is None or not base:
    return ""
  f = v / base
  return f" ({f:.2f}×)" if f < 100 else f" ({f:.0f}×)"


def _cell(rows, shape, label, pass_="fwdbwd", ratio=False):
  """``ms (× plain_bf16) / GB (× plain_bf16)``; with no plain_bf16 row in ``rows``, ``ms (× floor) / GB``."""
  r = _find(rows, shape, label, pass_)
  if r is None:
    return "—"
  if not _ok(r):
    return "skipped" if str(r.get("error", "")).startswith("skipped") else "error"
  mem = _mem_bytes(r)
  t, m = "", ""
  if ratio:
    if _has_baseline(rows):
      base = _baseline(rows, shape, pass_)
      if base is not None and label != BASELINE:
        t, m = _ratio(r["ms"], base["ms"]), _ratio(mem, _mem_bytes(base))
    else:
      t = _ratio(r["ms"], r.get("floor_ms"))
  return f"{_fmt_ms(r['ms'])} ms{t} / " + ("—" if mem is None else f"{_fmt_gb(mem)} GB{m}")


def _has_baseline(rows) -> bool:
  return any(_label(r) == BASELINE and _ok(r) for r in rows)


def _shape_rows(rows):
  return [r for r in rows if not r.get("sweep")]


def _what(rows, label) -> str:
  """Whose row it is, what ``auto`` resolved to, and the FLOPs the design does in a fwd+bwd."""
  rs = [r for r in rows if _label(r) == label]
  if any(_is_plain(r) for r in rs):
    who = "baseline" if label == BASELINE else "plain head"
  elif any(_is_peer(r) for r in rs):
    who = "peer"
  else:
    who = "lce_flax"
    resolved = list(dict.fromkeys(r["resolved"] for r in rs if r.get("resolved")))
    if label == "auto" and resolved:
      who += " → " + "/".join(resolved)
  factors = {r.get("flops_factor") for r in rs if r["pass"] == "fwdbwd" and r.get("flops_factor")}
  return f"{who}, {'/'.join(str(f) for f in sorted(factors)) + '·BHV' if factors else '—'}"


def _header(rows) -> str:
  return ("fwd+bwd: ms (× plain_bf16) / extra GB (× plain_bf16)" if _has_baseline(rows)
          else "fwd+bwd: ms (× floor) / extra GB")


def llm_table(rows) -> str:
  """One line per row kind (the plain heads first, then ours, then the peers), one column per shape: fwd+bwd time
  / extra memory, each with its ratio to ``plain_bf16``; the first line is the matmul floor."""
  rows = _shape_rows(rows)
  if not rows:
    return ""
  labels = _labels(rows)
  shapes = list(dict.fromkeys(r["shape"] for r in rows))
  dims = {s: next((r["B"], r["H"], r["V"]) for r in rows if r["shape"] == s) for s in shapes}
  lines = [f"| {_header(rows)} | what, FLOPs | "
           + " | ".join(f"{s} {b}×{h}×{v}" for s, (b, h, v) in dims.items()) + " |",
           "|" + "---|" * (2 + len(shapes)),
           f"| floor (6·BHV at {shapes_lib.PEAK_TFLOPS:.0f} TFLOP/s) | | "
           + " | ".join(f"{_fmt_ms(shapes_lib.Shape(s, *d).floor_ms(6))} ms" for s, d in dims.items()) + " |"]
  for lab in labels:
    lines.append(f"| {_shown(lab)} | {_what(rows, lab)} | "
                 + " | ".join(_cell(rows, s, lab, ratio=True) for s in shapes) + " |")
  return "\n".join(lines)


def detail_table(rows) -> str:
  """Every row: both passes, ratios, TFLOP/s, memory, loss error, the design that ran, or the error."""
  if not rows:
    return ""
  lines = ["| shape | row | pass | ms | × plain_bf16 | × floor | TFLOP/s (floor FLOPs) | TFLOP/s (done) | temp GB | "
           "peak GB | loss | rel. err vs fp32 | FLOPs done | design |", "|" + "---|" * 14]
  for r in rows:
    lab = _label(r)
    if not _ok(r):
      lines.append(f"| {r['shape']} | `{lab}` | {r['pass']} | | | | | | | | | | | {str(r.get('error', ''))[:120]} |")
      continue
    base = _baseline(rows, r["shape"], r["pass"])
    xb = f"{r['ms'] / base['ms']:.2f}" if base is not None and lab != BASELINE else ""
    xf = f"{r['ms'] / r['floor_ms']:.2f}" if r.get("floor_ms") else ""
    rel = r.get("loss_rel_err")
    d = r.get("design")
    design = f"{d['impl']}:{d['mode']} ({d['name']})" if isinstance(d, dict) else ""
    lines.append(
        f"| {r['shape']} | `{lab}` | {r['pass']} | {_fmt_ms(r['ms'])} | {xb} | {xf} | "
        f"{r.get('tflops', float('nan')):.0f} | {r.get('algo_tflops', r.get('tflops', float('nan'))):.0f} | "
        f"{_fmt_gb(r.get('temp_bytes'))} | {_fmt_gb(r.get('device_peak_bytes'))} | {r['loss']:.6g} | "
        f"{'' if rel is None else f'{rel:.1e}'} | {r.get('flops_factor', '')}·BHV | {design} |")
  return "\n".join(lines)


def sweep_table(rows) -> str:
  """Per swept axis: fwd+bwd ms / temp GB of each row kind at each value, with ratios to ``plain_bf16``."""
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
    out.append(f"{_header(rs)} vs {axis} ({fixed})\n")
    out.append(f"| {axis} | floor | " + " | ".join(_shown(lab) for lab in labels) + " |")
    out.append("|" + "---|" * (2 + len(labels)))
    for val in dict.fromkeys(r[axis] for r in rs):
      s = next(r["shape"] for r in rs if r[axis] == val)
      floor = next(r["floor_ms"] for r in rs if r[axis] == val)
      out.append(f"| {val} | {_fmt_ms(floor)} ms | " + " | ".join(_cell(rs, s, lab, ratio=True) for lab in labels)
                 + " |")
    out.append("")
  return "\n".join(out)


def markdown(rows, images: Sequence[str] = ()) -> str:
  """The whole results section: environment, what the rows are, LLM table, plots, sweeps, every row."""
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
    parts.append(DESCRIPTION if _has_baseline(rows) else DESCRIPTION + " These results have no `plain_bf16` row "
                 "(they predate it): ratios are to the floor.")
    t = llm_table(rows)
    if t:
      parts.append(t)
  for img in images:
    parts.append(f"![{os.path.splitext(os.path.basename(img))[0]}]({img})")
  t = sweep_table(rows)
  if t:
    parts.append(t)
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


def _bar_label(lab: str) -> str:
  return "xla (f32 reference)" if lab == "xla" else lab


def plot_llm(rows, path: str) -> str | None:
  """Bars per shape: fwd+bwd time (top, the floor dashed) and extra memory (bottom); the plain head's values are a
  dotted line across each panel, so every bar reads against it. Peers (tokamax, torch) are hatched."""
  rows = [r for r in _shape_rows(rows) if r["pass"] == "fwdbwd" and _ok(r)]
  if not rows:
    return None
  shapes = list(dict.fromkeys(r["shape"] for r in rows))
  colors = _colors(_labels(rows))
  plt = _plt()
  fig, axes = plt.subplots(2, len(shapes), figsize=(3.4 * len(shapes) + 1.5, 7.5), squeeze=False)
  for j, s in enumerate(shapes):
    rs = sorted((r for r in rows if r["shape"] == s), key=lambda r: _labels(rows).index(_label(r)))
    bars = [(_label(r), r["ms"], _mem_bytes(r), colors[_label(r)], ".." if _is_peer(r) else None) for r in rs]
    base = _baseline(rows, s)
    for i, vals in enumerate(([b[1] for b in bars], [(b[2] or 0) / 1e9 for b in bars])):
      ax = axes[i][j]
      for k, (b, v) in enumerate(zip(bars, vals)):
        ax.bar(k, v, color=b[3], hatch=b[4], edgecolor="#555555" if b[4] else None, lw=0.3)
        ax.annotate(f"{v:.3g}", (k, v), ha="center", va="bottom", fontsize=6, rotation=90,
                    xytext=(0, 2), textcoords="offset points")
      ax.set_xticks(range(len(bars)), [_bar_label(b[0]) for b in bars], rotation=75, fontsize=7)
      ax.margins(y=0.15)
      if base is not None:
        ax.axhline(base["ms"] if i == 0 else (_mem_bytes(base) or 0) / 1e9, color="k", ls=":", lw=1,
                   label=BASELINE)
      if i == 0:
        r0 = rs[0]
        ax.axhline(r0["floor_ms"], color="k", ls="--", lw=1, label="6·BHV floor")
        ax.set_title(f"{s}\n{r0['B']}×{r0['H']}×{r0['V']}", fontsize=9)
      if i == 0 or base is not None:
        ax.legend(fontsize=7)
    axes[0][j].set_ylabel("fwd+bwd, ms")
    axes[1][j].set_ylabel("extra memory, GB")
  fig.suptitle(_suptitle(rows), fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def plot_sweep(rows, path: str) -> str | None:
  """Time (top) and memory (bottom) vs V, B and H, one line per row kind; ``plain_bf16`` drawn thick and black."""
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
    for lab in labels:
      pts = [r for r in rs if _label(r) == lab]
      if not pts:
        continue
      style = dict(color="k", lw=2.5, zorder=3) if lab == BASELINE else dict(color=colors[lab])
      xs = [r[axis] for r in pts]
      axes[0][j].plot(xs, [r["ms"] for r in pts], "o-", label=_bar_label(lab), **style)
      axes[1][j].plot(xs, [max(_mem_bytes(r) or 0, 1e3) / 1e9 for r in pts], "o-", label=_bar_label(lab), **style)
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


def markers(section: str | None = None) -> tuple[str, str]:
  """The markers a generated section lies between: ``<!-- bench:start -->`` … ``<!-- bench:end -->``, or
  ``<!-- bench:NAME:start -->`` … ``<!-- bench:NAME:end -->`` for a named one (a file may hold several)."""
  return (START, END) if section is None else (f"<!-- bench:{section}:start -->", f"<!-- bench:{section}:end -->")


def update_file(path: str, text: str, section: str | None = None) -> None:
  """Replaces what lies between the bench markers (of ``section``) of ``path`` with ``text``."""
  start, end = markers(section)
  with open(path) as fh:
    doc = fh.read()
  i, j = doc.find(start), doc.find(end)
  if i < 0 or j < i:
    raise ValueError(f"{path} has no '{start}' … '{end}' markers to replace between")
  with open(path, "w") as fh:
    fh.write(doc[:i + len(start)] + "\n" + text + doc[j:])


def report(inputs: str | Sequence[str], out_dir: str | None = None, update: str | None = None,
           section: str | None = None, write: bool = True) -> list[str]:
  """Writes results.md and the PNGs for the rows of ``inputs`` into ``out_dir``, and the tables into the marked
  section of ``update``; returns the paths written.

  ``write=False`` leaves ``out_dir`` as it is (committed results keep their own report) and links the plots
  already there, for the kinds of rows ``inputs`` hold."""
  inputs = [inputs] if isinstance(inputs, str) else list(inputs)
  if out_dir is None:
    out_dir = inputs[0] if os.path.isdir(inputs[0]) else os.path.dirname(inputs[0]) or "."
  rows = load(inputs)
  if write:
    os.makedirs(out_dir, exist_ok=True)
    images = [p for p in (plot_llm(rows, os.path.join(out_dir, "llm.png")),
                          plot_sweep(rows, os.path.join(out_dir, "sweep.png"))) if p]
    md_path = os.path.join(out_dir, "results.md")
    with open(md_path, "w") as fh:
      fh.write(markdown(rows, [os.path.basename(p) for p in images]))
    written = [*images, md_path]
  else:
    kinds = {"llm.png": any(not r.get("sweep") for r in rows), "sweep.png": any(r.get("sweep") for r in rows)}
    images = [os.path.join(out_dir, f) for f, present in kinds.items()
              if present and os.path.exists(os.path.join(out_dir, f))]
    written = []
  if update:
    rel = os.path.relpath(out_dir, os.path.dirname(os.path.abspath(update)) or ".")
    update_file(update, markdown(rows, [os.path.join(rel, os.path.basename(p)) for p in images]), section)
    written.append(update)
  return written


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description="Tables and plots from benchmark JSON lines.")
  p.add_argument("results", nargs="+", help="*.jsonl files or folders of them")
  p.add_argument("--out", default=None, help="output folder (default: the first input's folder)")
  p.add_argument("--update", default=None, help=f"file whose {START} … {END} section is replaced")
  p.add_argument("--section", default=None,
                 help="with --update: replace the <!-- bench:NAME:start --> … <!-- bench:NAME:end --> section")
  p.add_argument("--no-write", action="store_true",
                 help="write nothing into the results folder (link the plots already there); with --update")
  a = p.parse_args(argv)
  for f in report(a.results, a.out, a.update, a.section, write=not a.no_write):
    print(f"wrote {f}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
