"""The package's tuning table (``lce_flax/_impl/pallas_mosaic/gemm_tuning.json``) updated from what a GPU run wrote.

Two kinds of rows come back from the GPU:

  "devices"   GEMM rows, ``{kind: {role: [row, ...]}}``: ``bench_gemm.py --sweep`` and ``--schedules`` write them
              (their ``gemm_tuning.json``); a row replaces the table's row of the same device kind, role and bucket
  "steps"     whole-step rows, ``{kind: [row, ...]}``: ``bench_step_products.py`` writes them (``steps.json``); a
              row replaces the table's row of the same device kind, design and bucket. A lean row (design
              "recompute") whose pair's step held more than lean mode's bound (``temp_gb`` over ``temp_bound_gb``)
              is refused: the package would run it

Every other row stays, so rows measured on one chip (an H200) can be added beside another's (the H100's) one bucket
at a time: the package runs a kind's own row where it is the nearest, and the same chip's other rows elsewhere
(``tuning.device_rows``). A device kind is matched to the table's key as the package reads kinds (case and
spacing aside).

    python3 -m benchmarks.tuning_table DIR/gemm_tuning.json [DIR/steps.json ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lce_flax._impl.pallas_mosaic import tuning  # noqa: E402


def kind_key(section: dict, kind: str) -> str:
  """The key of ``section`` (the table's "devices" or "steps") for the device kind ``kind``: the one already there
  that the package reads as the same kind (case and spacing aside), else ``kind``."""
  return next((k for k in section if tuning.norm_kind(k) == tuning.norm_kind(kind)), kind)


def merge(path: str, table_path: str = tuning.TABLE_PATH) -> dict:
  """The "devices" and "steps" rows of the file ``path`` into the table at ``table_path``; returns how many rows
  (of both sections) replaced one of the table's and how many were added."""
  with open(path) as f:
    new = json.load(f)
  if not any(s in new for s in ("devices", "steps")):
    raise ValueError(f"{path}: no \"devices\" or \"steps\" rows to merge (keys: {sorted(new)})")
  with open(table_path) as f:
    table = json.load(f)
  counts = {"replaced": 0, "added": 0}

  def put(old: list, row: dict, same) -> None:
    kept = [r for r in old if not same(r, row)]
    counts["replaced" if len(kept) < len(old) else "added"] += 1
    old[:] = kept + [row]

  devices = table.setdefault("devices", {})
  for kind, roles in new.get("devices", {}).items():
    mine = devices.setdefault(kind_key(devices, kind), {})
    for role, rows in roles.items():
      for row in rows:
        put(mine.setdefault(role, []), row, lambda a, b: a["bucket"] == b["bucket"])
  for kind, rows in new.get("steps", {}).items():
    for row in rows:
      _check_lean_bound(path, kind, row)
  steps = table.setdefault("steps", {})
  for kind, rows in new.get("steps", {}).items():
    mine = steps.setdefault(kind_key(steps, kind), [])
    for row in rows:
      put(mine, row, lambda a, b: (a["design"], a["bucket"]) == (b["design"], b["bucket"]))
  with open(table_path, "w") as f:
    json.dump(table, f, indent=1)
    f.write("\n")
  return counts


def _check_lean_bound(path: str, kind: str, row: dict) -> None:
  """``ValueError`` for a lean steps row whose chosen pair's step held more than lean mode's bound (B·H·4 + 64 MB):
  lean mode promises that bound, and the package runs a merged row's pair and width."""
  if row.get("design") != "recompute" or "temp_bound_gb" not in row:
    return
  pair = ",".join(row["products"])
  held = row.get("temp_gb", {}).get(pair)
  if held is not None and held > row["temp_bound_gb"]:
    raise ValueError(f"{path}: the lean steps row {row.get('name', row['bucket'])} of {kind} chose ({pair}), whose "
                     f"step held {held} GB, over lean mode's bound of {row['temp_bound_gb']} GB; not merged")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("files", nargs="+", help="gemm_tuning.json / steps.json files written on a GPU")
  a = ap.parse_args(argv)
  for path in a.files:
    print(f"{path}: {merge(path)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
