"""The tuning table of :mod:`.gemm`: a :class:`~.gemm.GemmConfig` per (device kind, GEMM role, shape bucket).

The table is data (``gemm_tuning.json`` beside this file), written by ``benchmarks/bench_gemm.py --sweep`` on the
GPU and read once. :func:`select_config` picks the row at trace time; :func:`describe` says which row it was (for
``explain()``).

Roles: the bare products ``fwd`` (x·w), ``dx`` (dz·wᵀ), ``dw`` (xᵀ·dz, bf16 out), and with their loss work
``fwd_stats`` (statistics epilogue), ``fwd_store`` (statistics + stored logits), ``dx_prologue`` (dz formed in the
prologue), ``dw_acc`` (xᵀ·dz + C in float32); ``plain`` for anything else. Shape bucket: ``(M, N, K)`` rounded
to powers of two; the row nearest in log-distance serves a shape. A role with loss work and no row of its own
takes its bare product's row (:func:`fit_role` makes it fit the hooks' SMEM), then (``plain`` too) the nearest row
of any bare product of the device, then :data:`DEFAULT`. A row's config names its schedule (``"schedule"``:
``cooperative`` when absent, ``pingpong`` or ``pingpong_ws``; ``benchmarks/bench_gemm.py --schedules`` writes rows
for the faster one).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os

from lce_flax._impl.pallas_mosaic.gemm import GemmConfig

TABLE_PATH = os.path.join(os.path.dirname(__file__), "gemm_tuning.json")

# jax's example matmul's fastest shape of config at the head's sizes: 128x128x64 tiles, 4 stages, the warpgroups
# side by side along N, no cluster, snake of width 16 (issue 27's measurements).
DEFAULT = GemmConfig()

# the ping-pong schedule's shape of config (each warpgroup a 128x128 tile and 3 stages of its own: 192 KB of SMEM
# for the operands, so half-width epilogue sub-tiles); a table row selects it with "schedule": "pingpong"
PINGPONG = GemmConfig(stages=3, epi_n=32, schedule="pingpong")
# the same turns fed by a TMA warpgroup through one ring shared by both compute warpgroups: 6 slots (192 KB)
PINGPONG_WS = GemmConfig(stages=6, epi_n=32, schedule="pingpong_ws")


def bucket(m: int, n: int, k: int) -> tuple[int, int, int]:
  return tuple(1 << max(0, round(math.log2(max(d, 1)))) for d in (m, n, k))


def _norm_kind(kind: str) -> str:
  return " ".join(kind.lower().split())


@functools.lru_cache(maxsize=1)
def load_table() -> dict:
  """``{device kind (lower case): {role: [{"bucket": [m, n, k], "config": {...}, ...}, ...]}}``."""
  if not os.path.exists(TABLE_PATH):
    return {}
  with open(TABLE_PATH) as f:
    raw = json.load(f)
  return {_norm_kind(kind): roles for kind, roles in raw.get("devices", {}).items()}


def _pick(rows, m: int, n: int, k: int):
  """The (role, row) of ``rows`` whose bucket is nearest to (m, n, k) in log-distance."""
  want = [math.log2(d) for d in bucket(m, n, k)]
  return min(rows, key=lambda rr: sum(abs(math.log2(b) - w) for b, w in zip(rr[1]["bucket"], want)))


# roles with loss work run on their bare product's row, adjusted to fit their extra shared memory
BASE_ROLE = {"fwd_stats": "fwd", "fwd_store": "fwd", "dx_prologue": "dx", "dw_acc": "dw"}


def fit_role(role: str, cfg: GemmConfig) -> GemmConfig:
  """A bare product's config made to fit the extra SMEM of ``role``'s hooks (227 KB in all): the stored bf16
  tiles next to the statistics or the prologue's vectors take half-width sub-tiles; a float32 ``+C`` output one
  stage fewer (and, under the ping-pong schedules, whose operand rings already take 192 KB, half-width sub-tiles)."""
  if role in ("fwd_store", "dx_prologue"):
    return dataclasses.replace(cfg, epi_n=min(cfg.epi_n, 32))
  if role == "dw_acc":
    if cfg.schedule == "cooperative":
      return dataclasses.replace(cfg, stages=min(cfg.stages, 3))
    # ping-pong: 2 x 3 slots of its own per warpgroup, or one shared ring of 5
    stages = min(cfg.stages, 3 if cfg.schedule == "pingpong" else 5)
    return dataclasses.replace(cfg, stages=stages, epi_n=min(cfg.epi_n, 32))
  return cfg


def select_row(role: str, m: int, n: int, k: int, device_kind: str) -> tuple[GemmConfig, str]:
  """The chosen config and where it came from (``"table: <kind>/<role>/<bucket>"`` or ``"default"``)."""
  table = load_table().get(_norm_kind(device_kind), {})
  bare = [(r, row) for r in ("fwd", "dx", "dw") for row in table.get(r, ())]
  for tier in (role, BASE_ROLE.get(role, role), "bare"):
    rows = bare if tier == "bare" else [(tier, row) for row in table.get(tier, ())]
    if not rows:
      continue
    r, row = _pick(rows, m, n, k)
    b = "x".join(str(x) for x in row["bucket"])
    cfg = GemmConfig(**row["config"])
    return (cfg if r == role else fit_role(role, cfg)), f"table: {device_kind}/{r}/{b}"
  return fit_role(role, DEFAULT), "default"


def select_config(role: str, m: int, n: int, k: int, device_kind: str) -> GemmConfig:
  """The :class:`~.gemm.GemmConfig` for one GEMM of ``role`` with out [m, n] and contraction k on
  ``device_kind`` (``jax.devices()[0].device_kind``)."""
  return select_row(role, m, n, k, device_kind)[0]


def describe(role: str, m: int, n: int, k: int, device_kind: str) -> str:
  """One line for ``explain()``: the config and the table row it came from."""
  cfg, src = select_row(role, m, n, k, device_kind)
  return f"gemm[{role}] {m}x{n}x{k}: {cfg.short()} ({src})"
