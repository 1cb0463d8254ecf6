"""What a compiled step's HLO says of its schedule: where each asynchronous collective starts and ends, which
instructions make the host wait for the device, and (from XLA's dump) what is alive at the memory peak.

    python3 -m benchmarks.hlo_schedule STEP.hlo.txt[.gz]      # a compiled module's text (``compiled.as_text()``)
    python3 -m benchmarks.hlo_schedule STEP.hlo.txt.gz --live-range STEP.live-range.txt.gz

Two readings, both of the text XLA prints for a compiled (scheduled) module, whose computations list their
instructions in schedule order:

- :func:`collectives`: each ``*-start`` … ``*-done`` pair of the entry computation (all-reduce, all-gather,
  reduce-scatter, collective-permute, all-to-all): its shape, its position in the entry's schedule (also as a
  fraction of it), how many instructions lie between start and done, and how many of those are compute (fusions,
  custom calls, while loops, conditionals): the work the collective can overlap; the bytes of its result; and how
  many of the entry's kernels (custom calls, Triton GEMM fusions, while loops) are scheduled after its start, of
  all. ``ready`` is the position of the last kernel whose results it reduces (reached back through the cheap
  instructions between: bitcasts, converts, concatenations), -1 if none, and ``kernels_held`` the kernels the
  schedule runs between that one and the start: work the collective could have overlapped but was held back from;
  ``held_free`` how many of those run with no asynchronous collective in flight (so no limit on collectives in
  flight at once stood in the way of starting it there).
- :func:`host_syncs`: the instructions of any computation at which XLA's GPU runtime copies a value to the host
  and blocks until the device has reached it: a ``conditional`` (its predicate or branch index), a ``while``
  whose trip count the compiler did not find (its condition, once per trip), and a host callback. Each drains the
  device's queue of launched work, so the device idles while the host launches what follows.

And :func:`peak_live` reads the ``*-live-range.txt`` file that XLA writes beside its buffer assignment when a
compile dumps (``compiler_options={"xla_dump_to": DIR}``): the buffers alive at the peak of the schedule, largest
first (with their shapes from the module's text), and XLA's breakdown of the peak by the source (JAX name stack)
that made each buffer.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys

_ASYNC = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_COMPUTE = ("fusion", "custom-call", "while", "conditional", "convolution", "dot")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z\-]*)\((.*)$")


def read(path: str) -> str:
  """The text of an HLO file (gzip-compressed where its name ends in ``.gz``)."""
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt") as f:
    return f.read()


def computations(text: str) -> dict[str, list[tuple[str, str, str, str]]]:
  """Each computation's instructions in printed (schedule) order: (name, shape, opcode, rest of the line); the
  entry computation under the key ``"ENTRY"``."""
  out: dict[str, list] = {}
  current = None
  for line in text.splitlines():
    head = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
    if head and not line.startswith(" "):
      current = "ENTRY" if head.group(1) else head.group(2)
      out[current] = []
      continue
    if line.startswith("}"):
      current = None
      continue
    m = _INSTR.match(line) if current is not None else None
    if m:
      out[current].append((m.group(1), m.group(2).strip(), m.group(3), m.group(4)))
  return out


def _op_name(rest: str) -> str:
  m = re.search(r'op_name="([^"]*)"', rest)
  return m.group(1) if m else ""


def collectives(text: str) -> list[dict]:
  """The entry computation's asynchronous collectives in schedule order (see the module's docstring)."""
  return _collectives(computations(text).get("ENTRY", []))


def _operands(rest: str, index: dict[str, int]) -> list[int]:
  """The entry positions of an instruction's operands (``rest``: the text after its opcode's parenthesis)."""
  depth, end = 1, len(rest)
  for j, ch in enumerate(rest):
    depth += (ch == "(") - (ch == ")")
    if depth == 0:
      end = j
      break
  return [index[t] for t in re.findall(r"[\w.\-]+", rest[:end]) if t in index]


def _latest_kernels(entry: list[tuple[str, str, str, str]], kernels: list[bool], index: dict[str, int]) -> list[int]:
  """For each instruction of the entry, the position of the last kernel its value depends on through instructions
  that are not kernels (itself, if a kernel); -1 if none (parameters, constants). One pass: the schedule puts
  operands first. ``index``: name -> entry position."""
  latest: list[int] = []
  for i, (_, _, _, rest) in enumerate(entry):
    latest.append(i if kernels[i] else max((latest[o] for o in _operands(rest, index) if o < i), default=-1))
  return latest


def _collectives(entry: list[tuple[str, str, str, str]]) -> list[dict]:
  kernels = [_kernel(op, rest) for _, _, op, rest in entry]
  index = {name: i for i, (name, _, _, _) in enumerate(entry)}
  latest = _latest_kernels(entry, kernels, index)
  spans = []  # (start, done, kind) of each asynchronous collective of the entry
  for i, (name, _, op, _) in enumerate(entry):
    kind = op.removesuffix("-start")
    if not op.endswith("-start") or kind not in _ASYNC:
      continue
    used = re.compile(rf"(?<![\w.\-])%?{re.escape(name)}(?![\w.\-])")
    spans.append((i, next((j for j in range(i + 1, len(entry))
                           if entry[j][2] == f"{kind}-done" and used.search(entry[j][3])), None), kind))
  busy = [False] * len(entry)  # whether some asynchronous collective is in flight at each position
  for i, done, _ in spans:
    for j in range(i, (i if done is None else done) + 1):
      busy[j] = True
  rows = []
  for i, done, kind in spans:
    name, shape, _, rest = entry[i]
    between = entry[i + 1:done] if done is not None else []
    ready = max((latest[o] for o in _operands(rest, index) if o < i), default=-1)
    rows.append({"name": name, "kind": kind, "shape": shape, "position": i,
                 "bytes": None if done is None else shape_bytes(entry[done][1]),
                 "position_frac": round(i / max(len(entry) - 1, 1), 3),
                 "between": None if done is None else done - i - 1,
                 "compute_between": sum(op_ in _COMPUTE for _, _, op_, _ in between),
                 "kernels_after": sum(kernels[i + 1:]), "kernels": sum(kernels),
                 "ready": ready, "kernels_held": sum(kernels[ready + 1:i]),
                 "held_free": sum(k and not b for k, b in zip(kernels[ready + 1:i], busy[ready + 1:i])),
                 "op_name": _op_name(rest)})
  return rows


_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
          "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def shape_bytes(shape: str) -> int:
  """The bytes of an HLO shape (an array, or a tuple of them: summed), e.g. ``bf16[1024,512]{1,0}``."""
  total = 0
  for dtype, dims in re.findall(r"([a-z]\w*)\[([\d,]*)\]", shape):
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n * _BYTES[dtype]
  return total


def _kernel(op: str, rest: str) -> bool:
  """Whether an instruction is a library or custom kernel (cuBLAS, Mosaic), a Triton GEMM fusion or a loop: the
  step's heavy work, beside which a collective can hide."""
  return op in ("custom-call", "while") or (op == "fusion" and "gemm_fusion\"" in rest)


def host_syncs(text: str) -> list[dict]:
  """Every instruction of the module at which the host waits for the device (see the module's docstring): its
  computation, name, kind (``conditional``, ``while`` or ``host callback``) and op_name."""
  return _host_syncs(computations(text))


def _host_syncs(comps: dict[str, list[tuple[str, str, str, str]]]) -> list[dict]:
  rows = []
  for comp, instrs in comps.items():
    for name, _, op, rest in instrs:
      if op == "conditional":
        kind = "conditional"
      elif op == "while" and "known_trip_count" not in rest:
        kind = "while"
      elif op == "custom-call" and "callback" in (re.search(r'custom_call_target="([^"]*)"', rest) or [""])[0]:
        kind = "host callback"
      else:
        continue
      rows.append({"computation": comp, "name": name, "kind": kind, "op_name": _op_name(rest)})
  return rows


def summary(text: str, comps: dict | None = None) -> dict:
  """Both readings of one module, and the entry's length (the text parsed once; ``comps``: already parsed by
  :func:`computations`)."""
  comps = computations(text) if comps is None else comps
  entry = comps.get("ENTRY", [])
  return {"entry_instructions": len(entry), "collectives": _collectives(entry), "host_syncs": _host_syncs(comps)}


def peak_live(live_range: str, text: str | None = None, top: int = 25, breakdown_lines: int = 60,
              comps: dict | None = None) -> dict:
  """The peak of XLA's live-range dump ``live_range``: its schedule position (``at``), the bytes alive there
  (``bytes``), the ``top`` largest buffers alive (name, bytes and, given the module's ``text`` or its parsed
  ``comps``, the shape of the instruction that defines it) and the first ``breakdown_lines`` lines of XLA's
  breakdown of the peak by source."""
  lines = live_range.splitlines()
  head = next((i for i, ln in enumerate(lines) if re.match(r"\s*Live ranges at \d+ \(peak\):", ln)), None)
  if head is None:
    return {"at": None, "bytes": None, "buffers": [], "breakdown": []}
  at = int(re.search(r"at (\d+)", lines[head]).group(1))
  buffers, total, i = [], 0, head + 1
  row = re.compile(r"\s*(\S+?)(\{[\d,]*\})?: (\d+) bytes \(cumulative: (\d+) bytes\)")
  while i < len(lines) and (m := row.match(lines[i])):
    buffers.append({"name": m.group(1) + (m.group(2) or ""), "bytes": int(m.group(3))})
    total = int(m.group(4))
    i += 1
  shapes = {}
  if comps is None and text is not None:
    comps = computations(text)
  for instrs in (comps or {}).values():
    shapes.update({name: shape for name, shape, _, _ in instrs})
  for b in buffers:
    b["shape"] = shapes.get(b["name"].split("{")[0])
  start = next((j for j in range(i, len(lines)) if "breakdown for peak usage" in lines[j]), None)
  tree = [] if start is None else [ln.rstrip() for ln in lines[start:start + breakdown_lines] if ln.strip()]
  return {"at": at, "bytes": total, "buffers": sorted(buffers, key=lambda b: -b["bytes"])[:top], "breakdown": tree}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("hlo", help="a compiled module's text, .gz allowed")
  ap.add_argument("--json", action="store_true", help="print the summary as JSON")
  ap.add_argument("--live-range", help="XLA's *-live-range.txt[.gz] of the same module: what is alive at its peak")
  a = ap.parse_args(argv)
  text = read(a.hlo)
  comps = computations(text)  # (parsed once for both readings)
  s = summary(text, comps)
  if a.live_range:
    s["peak_live"] = peak_live(read(a.live_range), comps=comps)
  if a.json:
    print(json.dumps(s, indent=1))
    return 0
  moved = sum(c["bytes"] or 0 for c in s["collectives"])
  print(f"entry: {s['entry_instructions']} instructions; asynchronous collectives: {len(s['collectives'])}, "
        f"{moved / 1e9:.3f} GB of results")
  print(f"{'collective':<22} {'shape':<34} {'at':>6} {'between':>8} {'compute':>8} {'kernels after':>14} "
        f"{'held':>5} {'free':>5}  op")
  for c in s["collectives"]:
    after = f"{c['kernels_after']}/{c['kernels']}"
    print(f"{c['name']:<22} {c['shape'][:34]:<34} {c['position_frac']:6.3f} {c['between']!s:>8} "
          f"{c['compute_between']:>8} {after:>14} {c['kernels_held']:>5} {c['held_free']:>5}  {c['op_name'][-50:]}")
  print(f"host syncs: {len(s['host_syncs'])}")
  for h in s["host_syncs"]:
    print(f"  {h['kind']:<14} {h['name']:<22} in {h['computation']:<28} {h['op_name'][-70:]}")
  if "peak_live" in s:
    pk = s["peak_live"]
    print(f"alive at the peak (schedule position {pk['at']}): {(pk['bytes'] or 0) / 2**30:.2f} GiB")
    for b in pk["buffers"]:
      print(f"  {b['bytes'] / 2**20:10.1f} MiB  {b['name'][:40]:<40} {(b['shape'] or '')[:60]}")
    print("\n".join(pk["breakdown"]))
  return 0


if __name__ == "__main__":
  sys.exit(main())
