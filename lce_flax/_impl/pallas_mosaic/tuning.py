"""The tiling of :mod:`.gemm` (:class:`GemmConfig`) and its tuning table: a config per (device kind, GEMM role,
shape bucket).

The table is data (``gemm_tuning.json`` beside this file), written by ``benchmarks/bench_gemm.py --sweep`` on the
GPU and read once. :func:`select_config` picks the row at trace time; :func:`describe` says which row it was (for
``explain()``).

Roles: the bare products ``fwd`` (x·w), ``dx`` (dz·wᵀ), ``dw`` (xᵀ·dz, bf16 out), and with their loss work
``fwd_stats`` (statistics epilogue), ``fwd_store`` (statistics + stored logits), ``dx_prologue`` (dz formed in the
prologue), ``dw_acc`` (xᵀ·dz + C in float32), ``dx_acc`` (dz·wᵀ + C in float32: lean mode's dx over its vocabulary
chunks), ``lean_dz`` (lean mode's recompute of a vocabulary chunk, its
logit gradient formed and stored in the epilogue); ``plain`` for anything else. Shape bucket: ``(M, N, K)`` rounded
to powers of two; the row nearest in log-distance serves a shape. A role with loss work and no row of its own
takes its bare product's row (:func:`fit_role` makes it fit the hooks' SMEM), then (``plain`` too) the nearest row
of any bare product of the device, then :data:`DEFAULT`. A row's config names its schedule (``"schedule"``:
``cooperative`` when absent, ``pingpong`` or ``pingpong_ws``; ``benchmarks/bench_gemm.py --schedules`` writes rows
for the faster one). A device kind runs its own rows and those of the kinds of the same chip (the H200 the
H100's), the nearest row serving and its own where two are as near (:func:`device_rows`); :func:`describe` says
whose row it ran.

Beside the GEMM rows the file holds ``"steps"``: the fast designs' whole step timed with each pair of backward
products (ours or XLA's for dx and dw) at a head's bucket (``benchmarks/bench_step_products.py``); where one exists
its fastest pair runs (:func:`step_products`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os

SCHEDULES = ("cooperative", "pingpong", "pingpong_ws")


@dataclasses.dataclass(frozen=True)
class GemmConfig:
  """Static tiling of one GEMM call.

  ``tile_m × tile_n`` is one compute warpgroup's accumulator; the CTA tile doubles it along ``wg_split``
  ("m" or "n"), a cluster of two CTAs doubles that along ``cluster`` ("m", "n" or None). ``order_minor`` /
  ``order_width`` set the planar-snake tile order; ``epi_m × epi_n`` is the sub-tile of the stored output, staged
  through ``epi_slots`` SMEM slots per warpgroup (a slot is rewritten once its last TMA store has read it, so more
  slots leave more stores in flight).
  ``schedule``: ``"cooperative"`` (both warpgroups on one CTA tile, fed by a TMA warpgroup), ``"pingpong"``
  (each warpgroup on a tile of its own, with its own ring of ``stages`` slots, taking turns on the tensor cores)
  or ``"pingpong_ws"`` (the same turns, one ring of ``stages`` slots filled by a TMA warpgroup); under both
  ping-pong schedules ``wg_split`` is unused; ``pingpong`` takes no ``cluster``, ``pingpong_ws`` does (the cluster
  tile is two warpgroup tiles, and the operand they share is multicast). The interpret twin ignores it.
  ``mma_lag`` (cooperative, no prologue): how many WGMMAs a compute warpgroup leaves in flight when it moves to the
  next K step; each operand slot is released that many steps later (the pipeline's ``delay_release``), so the
  next WGMMA is issued while the previous one still runs. 0: each K step waits for its own WGMMA.
  ``auto_barriers``: whether Pallas adds its automatic warpgroup barriers (``CompilerParams``'
  ``unsafe_no_auto_barriers`` when False): one before and one after every SMEM store from registers and one before
  every TMA load a compute warpgroup issues. ``False`` (``cooperative`` and ``pingpong_ws`` only) leaves the
  kernel's own barriers, which order every SMEM hand-over of those schedules (the module docstring of :mod:`.gemm`
  says which): 19 warpgroup barriers in the fast forward's lowering instead of 55. Timed on an H200
  (``benchmarks/results/barriers-h200-2026-11-29/``) it moved the bare, lean and fast forwards by -3.3% to +6.5%
  at four heads, +0.1% on the geometric mean: no gain, so the default keeps Pallas's.
  """

  tile_m: int = 128
  tile_n: int = 128
  tile_k: int = 64
  stages: int = 4
  wg_split: str = "n"
  cluster: str | None = None
  order_minor: str = "n"
  order_width: int = 16
  epi_m: int = 64
  epi_n: int = 64
  schedule: str = "cooperative"
  epi_slots: int = 2
  mma_lag: int = 0
  auto_barriers: bool = True

  def cta_tile(self) -> tuple[int, int]:
    """The output block a CTA's warpgroups work on at once: two warpgroup tiles side by side (cooperative), or
    one warpgroup tile (ping-pong: each warpgroup has a tile of its own)."""
    if self.schedule != "cooperative":
      return (self.tile_m, self.tile_n)
    return (self.tile_m * (2 if self.wg_split == "m" else 1), self.tile_n * (2 if self.wg_split == "n" else 1))

  def cluster_size(self) -> int:
    return 1 if self.cluster is None else 2

  def cluster_tile(self) -> tuple[int, int]:
    cm, cn = self.cta_tile()
    return (cm * (2 if self.cluster == "m" else 1), cn * (2 if self.cluster == "n" else 1))

  def short(self) -> str:
    bars = "" if self.auto_barriers else " auto_barriers=0"
    if self.schedule != "cooperative":
      cl = f" cl={self.cluster}" if self.cluster else ""
      return (f"{self.tile_m}x{self.tile_n}x{self.tile_k} s{self.stages} {self.schedule}{cl} "
              f"order={self.order_minor}{self.order_width} epi={self.epi_m}x{self.epi_n}{bars}")
    slots = f" slots={self.epi_slots}" if self.epi_slots != 2 else ""
    lag = f" lag={self.mma_lag}" if self.mma_lag else ""
    return (f"{self.tile_m}x{self.tile_n}x{self.tile_k} s{self.stages} wg={self.wg_split} cl={self.cluster} "
            f"order={self.order_minor}{self.order_width}{slots}{lag}{bars}")

  def validate(self):
    for name in ("tile_m", "tile_n", "tile_k"):
      if getattr(self, name) % 64:
        raise ValueError(f"GemmConfig.{name}={getattr(self, name)} must be a multiple of 64")
    if self.wg_split not in ("m", "n") or self.cluster not in (None, "m", "n") or self.order_minor not in ("m", "n"):
      raise ValueError(f"bad GemmConfig dimension names: {self}")
    if self.tile_m % self.epi_m or self.tile_n % self.epi_n or self.epi_m % 64 or self.epi_n % 32:
      raise ValueError(f"the epilogue sub-tile {self.epi_m}x{self.epi_n} must divide the warpgroup tile, with rows a "
                       "multiple of 64 (the WGMMA register layout) and columns a multiple of 32")
    if self.stages < 2:
      raise ValueError("GemmConfig.stages must be >= 2")
    if self.epi_slots < 2:
      raise ValueError(f"GemmConfig.epi_slots={self.epi_slots} must be >= 2 (a store drains while the next is written)")
    if self.schedule not in SCHEDULES:
      raise ValueError(f"GemmConfig.schedule={self.schedule!r}: one of {SCHEDULES}")
    if self.schedule == "pingpong" and self.cluster is not None:
      raise ValueError("GemmConfig: the pingpong schedule runs without clusters (cluster=None; pingpong_ws takes them)")
    if not self.auto_barriers and self.schedule == "pingpong":
      raise ValueError("GemmConfig.auto_barriers=False under the pingpong schedule: its compute warpgroups refill "
                       "their operand slots after their own WGMMA waits, which Pallas's barrier orders")
    if not 0 <= self.mma_lag < self.stages or (self.mma_lag and self.schedule != "cooperative"):
      raise ValueError(f"GemmConfig.mma_lag={self.mma_lag} must be in [0, stages={self.stages}) and 0 under the "
                       "ping-pong schedules")


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


def norm_kind(kind: str) -> str:
  """A device kind as the table's keys are read (case and spacing aside): ``"NVIDIA  H200"`` -> ``"nvidia h200"``.
  ``benchmarks/tuning_table.py`` matches a GPU run's kind to the table's key with it."""
  return " ".join(kind.lower().split())


def _read() -> dict:
  if not os.path.exists(TABLE_PATH):
    return {}
  with open(TABLE_PATH) as f:
    return json.load(f)


@contextlib.contextmanager
def table_at(path: str):
  """The package reads its table from ``path`` inside the block, its cached reads dropped on the way in and out:
  a copy with rows merged, measured before they land (``benchmarks/probe_table_ab.py``), or a test's table. The
  op reads the table at trace time, so what is traced inside keeps that table's configs."""
  global TABLE_PATH
  old, TABLE_PATH = TABLE_PATH, str(path)
  load_table.cache_clear()
  load_steps.cache_clear()
  try:
    yield
  finally:
    TABLE_PATH = old
    load_table.cache_clear()
    load_steps.cache_clear()


@functools.lru_cache(maxsize=1)
def load_table() -> dict:
  """``{device kind (lower case): {role: [{"bucket": [m, n, k], "config": {...}, ...}, ...]}}``."""
  return {norm_kind(kind): roles for kind, roles in _read().get("devices", {}).items()}


@functools.lru_cache(maxsize=1)
def load_steps() -> dict:
  """``{device kind (lower case): [row, ...]}``: the file's ``"steps"``, the fast designs' whole step (forward and
  backward of x and w) timed with each (dx, dw) pair of backward products, in alternation
  (``benchmarks/bench_step_products.py``; lean mode's too). A row: ``"design"``, ``"bucket"`` (tokens, hidden,
  vocab rounded to powers of two), ``"shape"``, ``"products"`` (the fastest pair), ``"ms"`` (each pair's time,
  "dx,dw": ms, and the plain head's), ``"source"``; lean mode's rows (design ``"recompute"``) also each pair's
  ``"vocab_chunk"`` (the width the op plans for it: wider on the GEMM, whose chunk products take the chunk in place),
  ``"temp_gb"`` and, where a pair ran blocks of tokens within each chunk, ``"token_block"``."""
  return {norm_kind(kind): rows for kind, rows in _read().get("steps", {}).items()}


# Device kinds that are one chip: the H100 and H200 are both GH100 (SM90, 227 KB of shared memory per block), the
# H200 with more and faster HBM. A kind runs its own rows and, where they have a nearer one, those of a kind of the
# same chip.
CHIPS = (("h100", "h200", "gh200"),)


def _kinds(table: dict, device_kind: str) -> list[str]:
  """The kinds of ``table`` whose rows ``device_kind`` may run: its own first, then those of the same chip
  (:data:`CHIPS`)."""
  kind = norm_kind(device_kind)
  out = [kind] if kind in table else []
  for marks in CHIPS:
    if any(mk in kind for mk in marks):
      out += [other for other in sorted(table) if other != kind and any(mk in other for mk in marks)]
  return out


def device_rows(device_kind: str) -> dict[str, list[tuple[str, dict]]]:
  """``{role: [(measured_on, row), ...]}`` for ``device_kind``: its own rows, then those of the kinds of the same
  chip (:data:`CHIPS`). A shape takes the row nearest its bucket (:func:`_pick`), its own kind's where two are
  as near: an H200 with a row of its own at one bucket runs it there and the H100's rows elsewhere."""
  table = load_table()
  rows: dict[str, list[tuple[str, dict]]] = {}
  for kind in _kinds(table, device_kind):
    for role, rs in table[kind].items():
      rows.setdefault(role, []).extend((kind, row) for row in rs)
  return rows


def step_products(design: str, tokens: int, hidden: int, vocab: int, device_kind: str):
  """``((dx, dw), why)``: the pair of backward products the fast design ``design``'s whole step measured fastest
  with at this head's bucket (a ``"steps"`` row of the same bucket, :func:`load_steps`), else None. The step is
  what counts: the heads run at the GPU's power limit, where a GEMM's time depends on what runs around it, and
  the bare products timed alone favoured ours at shapes whose step ran faster with dx on XLA's
  (``benchmarks/results/step-products-h100-2026-11-28/``)."""
  found = _step_row(design, tokens, hidden, vocab, device_kind)
  if found is None:
    return None
  measured_on, row = found
  pair, ms, widths = tuple(row["products"]), row["ms"], row.get("vocab_chunk", {})
  at = lambda k: f" at {widths[k]} columns a chunk" if k in widths else ""
  rest = ", ".join(("the plain head" if k == "plain" else f"({k.replace(',', ', ')})") + f" {v:.2f}" + at(k)
                   for k, v in ms.items() if k != ",".join(pair))
  b = "x".join(str(x) for x in row["bucket"])
  same = "" if measured_on == norm_kind(device_kind) else f", the same chip as {device_kind}"
  # (a row that timed one pair, e.g. bench_step_products --pairs, chose its width and blocks, not its pair)
  timed = "fastest" if set(ms) - {"plain", ",".join(pair)} else "only"
  return pair, (f"the whole step measured {timed} with (dx, dw) on ({', '.join(pair)}): "
                f"{ms[','.join(pair)]:.2f} ms{at(','.join(pair))} against {rest} "
                f"(table: {measured_on}/steps/{design}/{b}{same})")


def step_chunk(design: str, tokens: int, hidden: int, vocab: int, device_kind: str, pair,
               token_block: int | None = None) -> int | None:
  """The vocabulary chunk width at which the whole step of ``design`` ran with the (dx, dw) ``pair`` at this
  head's bucket (a lean ``steps`` row's ``"vocab_chunk"``, the fastest of the widths timed for that pair), where
  that step ran the same blocks of tokens (the row's ``"token_block"`` of the pair; a row without one ran a single
  block, None), else None: a width measured with other blocks holds other buffers and fills other waves."""
  found = _step_row(design, tokens, hidden, vocab, device_kind)
  if found is None:
    return None
  key = ",".join(pair)
  if found[1].get("token_block", {}).get(key) != token_block:
    return None
  return found[1].get("vocab_chunk", {}).get(key)


def step_token_block(design: str, tokens: int, hidden: int, vocab: int, device_kind: str, pair):
  """``(True, block)``: the blocks of tokens the whole step of ``design`` ran with the (dx, dw) ``pair`` at this
  head's bucket (a lean ``steps`` row's ``"token_block"`` of the pair; None: one block), where the row records
  them; else ``(False, None)``."""
  found = _step_row(design, tokens, hidden, vocab, device_kind)
  blocks = {} if found is None else found[1].get("token_block", {})
  key = ",".join(pair)
  return (True, blocks[key]) if key in blocks else (False, None)


def _step_row(design: str, tokens: int, hidden: int, vocab: int, device_kind: str):
  """(measured_on, row): the ``steps`` row of ``design`` at this head's bucket, the device's own kind's first."""
  steps = load_steps()
  want = list(bucket(tokens, hidden, vocab))
  for measured_on, row in ((kind, row) for kind in _kinds(steps, device_kind) for row in steps[kind]):
    if row["design"] == design and row["bucket"] == want:
      return measured_on, row
  return None


def _source(device_kind: str, measured_on: str, role: str, row) -> str:
  b = "x".join(str(x) for x in row["bucket"])
  same = "" if measured_on == norm_kind(device_kind) else f", the same chip as {device_kind}"
  return f"table: {measured_on}/{role}/{b}{same}"


def _pick(rows, m: int, n: int, k: int):
  """The (role, measured_on, row) of ``rows`` whose bucket is nearest to (m, n, k) in log-distance (the first of
  those as near)."""
  want = [math.log2(d) for d in bucket(m, n, k)]
  return min(rows, key=lambda r: sum(abs(math.log2(b) - w) for b, w in zip(r[-1]["bucket"], want)))


# roles with loss work run on their bare product's row, adjusted to fit their extra shared memory
BASE_ROLE = {"fwd_stats": "fwd", "fwd_store": "fwd", "lean_dz": "fwd", "dx_prologue": "dx", "dw_acc": "dw",
             "dx_acc": "dx"}


def fit_role(role: str, cfg: GemmConfig) -> GemmConfig:
  """A bare product's config made to fit the extra SMEM of ``role``'s hooks (227 KB in all): the stored bf16
  tiles next to the statistics or the prologue's vectors take half-width sub-tiles; a float32 ``+C`` output one
  stage fewer (and, under the ping-pong schedules, whose operand rings already take 192 KB, half-width sub-tiles)."""
  if role in ("fwd_store", "lean_dz", "dx_prologue"):
    return dataclasses.replace(cfg, epi_n=min(cfg.epi_n, 32))
  if role in ("dw_acc", "dx_acc"):
    if cfg.schedule == "cooperative":
      return dataclasses.replace(cfg, stages=min(cfg.stages, 3))
    # ping-pong: 2 x 3 slots of its own per warpgroup, or one shared ring of 5
    stages = min(cfg.stages, 3 if cfg.schedule == "pingpong" else 5)
    return dataclasses.replace(cfg, stages=stages, epi_n=min(cfg.epi_n, 32))
  return cfg


def fit_shape(cfg: GemmConfig, m: int, n: int) -> GemmConfig:
  """``cfg`` with its CTA and cluster tiles no larger than the [m, n] output where a smaller one serves: the two
  warpgroups side by side along the other dimension when the output is narrower than the CTA tile along theirs,
  and no cluster when the cluster tile overhangs the output (the CTAs past the edge would load and store nothing).
  A row measured at an LLM head keeps its tiling there; a small head (H = 128, whose dw is [128, V]) gets a CTA
  tile that lies within its arrays."""
  if cfg.schedule == "cooperative":
    cm, cn = cfg.cta_tile()
    if cfg.wg_split == "m" and m < cm and n >= 2 * cfg.tile_n:
      cfg = dataclasses.replace(cfg, wg_split="n")
    elif cfg.wg_split == "n" and n < cn and m >= 2 * cfg.tile_m:
      cfg = dataclasses.replace(cfg, wg_split="m")
  cm, cn = cfg.cluster_tile()
  if (cfg.cluster == "m" and m < cm) or (cfg.cluster == "n" and n < cn):
    cfg = dataclasses.replace(cfg, cluster=None)
  return cfg


def select_row(role: str, m: int, n: int, k: int, device_kind: str) -> tuple[GemmConfig, str]:
  """The chosen config and where it came from (``"table: <kind>/<role>/<bucket>"`` or ``"default"``; ", fitted to
  the MxN output" where :func:`fit_shape` changed it)."""
  cfg, src = _row(role, m, n, k, device_kind)
  fitted = fit_shape(cfg, m, n)
  return fitted, (src if fitted == cfg else f"{src}, fitted to the {m}x{n} output")


def _row(role: str, m: int, n: int, k: int, device_kind: str) -> tuple[GemmConfig, str]:
  table = device_rows(device_kind)
  bare = [(r, on, row) for r in ("fwd", "dx", "dw") for on, row in table.get(r, ())]
  for tier in (role, BASE_ROLE.get(role, role), "bare"):
    rows = bare if tier == "bare" else [(tier, on, row) for on, row in table.get(tier, ())]
    if not rows:
      continue
    r, measured_on, row = _pick(rows, m, n, k)
    cfg = GemmConfig(**row["config"])
    return (cfg if r == role else fit_role(role, cfg)), _source(device_kind, measured_on, r, row)
  return fit_role(role, DEFAULT), "default"


# a bare product runs on XLA's GEMM instead where its table row measured ours slower than XLA's by more than this
# (in one run, timed in alternation; closer than 3% is within the run-to-run spread and keeps ours)
XLA_MARGIN = 1.03


def xla_faster(role: str, m: int, n: int, k: int, device_kind: str) -> str | None:
  """For a bare product (``dx`` or ``dw``): why XLA's GEMM runs it instead of ours at this shape (its table row's
  ``vs_xla`` times, ours over XLA's above :data:`XLA_MARGIN`), else None (ours; also where no row has them)."""
  rows = [(role, on, row) for on, row in device_rows(device_kind).get(role, ())]
  if not rows:
    return None
  _, measured_on, row = _pick(rows, m, n, k)
  t = row.get("vs_xla")
  if not t or t["ours_ms"] <= XLA_MARGIN * t["xla_ms"]:
    return None
  return (f"{role} {m}x{n}x{k} on XLA: {t['xla_ms']:.2f} vs {t['ours_ms']:.2f} ms ours "
          f"({_source(device_kind, measured_on, role, row)})")


def select_config(role: str, m: int, n: int, k: int, device_kind: str) -> GemmConfig:
  """The :class:`~.gemm.GemmConfig` for one GEMM of ``role`` with out [m, n] and contraction k on
  ``device_kind`` (``jax.devices()[0].device_kind``)."""
  return select_row(role, m, n, k, device_kind)[0]


def describe(role: str, m: int, n: int, k: int, device_kind: str) -> str:
  """One line for ``explain()``: the config and the table row it came from."""
  cfg, src = select_row(role, m, n, k, device_kind)
  return f"gemm[{role}] {m}x{n}x{k}: {cfg.short()} ({src})"
