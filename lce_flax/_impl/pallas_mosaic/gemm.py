"""One Hopper GEMM (Pallas Mosaic GPU) for the head's three products, with a prologue and an epilogue hook.

``out = epilogue(prologue(A) · B)`` with A [M, K] and B [K, N], each stored either way round
(``transpose_a``: A is handed in as [K, M]; ``transpose_b``: B as [N, K]), so the head's products need no
transposed copies:

* forward ``x·w``: A = x [B, H], B = w ([H, V], or [V, H] with ``transpose_b``);
* ``dx = dz·wᵀ``: A = dz [B, V], B = w ([H, V] with ``transpose_b``, or [V, H]);
* ``dw = xᵀ·dz``: A = x [B, H] with ``transpose_a``, B = dz [B, V] (or ``dzᵀ·x`` for a [V, H] w).

**Structure (the GPU path).** A persistent grid of one CTA (or one 2-CTA cluster) per SM walks the output tiles
in a planar-snake order (:func:`plgpu.planar_snake`: neighbouring CTAs share rows of A or columns of B while they
are in L2). A CTA tile is two warpgroup tiles of ``tile_m × tile_n`` side by side (``wg_split``): two compute
warpgroups each own one float32 WGMMA accumulator, a third warpgroup only issues the TMA copies of the K steps
(``plgpu.emit_pipeline_warp_specialized``, ``stages`` deep). With ``cluster`` set, the two CTAs of a cluster
share the operand tile they have in common through TMA multicast. That is the ``cooperative`` schedule
(:attr:`GemmConfig.schedule`): both warpgroups finish a CTA tile's K loop together and run their epilogues at the
same time, so the tensor cores idle during the epilogue.

The ``pingpong`` schedule (:func:`_body_pingpong`) hides the epilogue instead: two compute warpgroups, no TMA
warpgroup, each warpgroup with an output tile (``tile_m × tile_n``) and a ``stages``-deep K pipeline of its own,
and a pair of turn barriers that lets one warpgroup at a time issue its tile's WGMMAs. Warpgroup 1 starts its
first K loop when warpgroup 0's is issued, and the two alternate from then on, so one warpgroup's epilogue
(statistics, stores) runs while the other's MMAs keep the tensor cores busy (the technique of CUTLASS's
"ping-pong" kernels and FlashAttention-3's warpgroup scheduling). It takes no clusters; its SMEM holds two rings
of slots, so 3 stages of 128×128×64 (192 KB) at most, with ``epi_n = 32`` for the larger epilogues.
``pingpong_ws`` (:func:`_body_pingpong_ws`) takes the same turns but is fed by a TMA warpgroup through one ring
shared by both compute warpgroups, filled in the order the turns consume it: 6 slots of 128×128×64, so the copies
run 5 K steps ahead (2 in ``pingpong``, whose warpgroups copy for themselves). It also runs on 2-CTA clusters,
whose two CTAs take the two halves of each turn's cluster tile and multicast the operand they share. Measured on an
H100, the ping-pong schedules win only where K is short (gpt2-small's H = 768: the epilogue is a large part of a
tile); at H ≥ 2304 one warpgroup's K loop alone does not keep the tensor cores as busy as two cooperating ones
(``docs/kernels.md``).

**Ragged shapes.** M, N and K need not be multiples of any tile: TMA fills the out-of-bounds part of a loaded
tile with zeros (so a ragged K adds nothing) and clips the out-of-bounds part of a stored one. No operand is
copied or padded. Mosaic's swizzled TMA descriptors need each array's minor dimension to be a multiple of the
swizzle row (64 bf16 elements: 128 bytes) and its major one a multiple of 8, so V = 50304, 128256, 151936 and
256000 are read in place as [H, V] or [V, H], while a [H, 128037] w (rows not even 16-byte aligned) is refused
with a clear error: hand such a w in as [V, H], which only needs H to be a multiple of 64.

**Hooks.**

* prologue (:class:`DzFromLogits`): forms the A tile in registers from the SMEM tile TMA brought in, before the
  WGMMA (which then takes A from registers). ``DzFromLogits`` turns stored logits into the logit gradient
  ``dz = exp(z - lse)·coef - [col = label]·a`` of the rows, so ``dx = dz·wᵀ`` needs no separate pass over B×V.
* epilogue: a tuple of parts, each applied to the float32 accumulator of a warpgroup tile:
  :class:`Store` (write it in a dtype, through double-buffered SMEM sub-tiles and TMA),
  :class:`AddTo` (``C += acc`` in float32, in place, by TMA reduce-adds: the token-chunked dw; or into a window
  of a larger C, in its dtype: lean mode's dw per vocabulary chunk),
  :class:`RowStats` (the softmax-cross-entropy row statistics of each tile, merged by :func:`merge_row_stats`).

**Windows** (:class:`Window`). ``b_window`` makes B a window of ``b`` along one axis from a start known only at
run time (an int32 input the kernel reads once; every TMA copy of B is offset by it), so lean mode's loop over
vocabulary chunks reads each chunk of w where it lies: a chunk of columns of an [H, V] w is strided, and XLA would
hand a custom call a copy of it. ``a_window`` does the same for A (a block of x's tokens, as the M rows of the
logits or as the contraction of ``xᵀ·dz``).

**Barriers.** Pallas (warpgroup semantics) adds a warpgroup barrier before and after every SMEM store from
registers and before every TMA load a warpgroup issues, in case one of its threads reads what another writes.
This kernel's SMEM is written by threads only for TMA to read (the stored sub-tiles, the statistics rows) and read
by threads only after TMA wrote it (labels, bias, reference rows, the label table, the prologue's vectors), and
every such hand-over has a barrier of its own: a slot is rewritten after ``wait_smem_to_gmem`` (a wait and a
warpgroup barrier), handed to TMA after ``commit_smem`` (a fence and a warpgroup barrier), and a per-tile vector
is fetched for the next tile only after the tile's epilogue has passed those (its statistics or its stores). So
the ``cooperative`` and ``pingpong_ws`` schedules can run without Pallas's barriers
(:attr:`GemmConfig.auto_barriers` False: two of the four around each stored sub-tile go); measured, that gained
nothing, and the default keeps them.

**Interpret mode (CPU).** Mosaic GPU's interpreter runs neither collective warpgroup axes (``run_scoped`` with
``collective_axes``) nor WGMMA. ``interpret=True`` therefore runs a twin of the same kernel: the same persistent
tile loop, TMA pipeline over K, block specs (transposes, out-of-bounds fills), prologue and epilogue parts, with
one warpgroup tile per CTA tile and ``lax.dot_general`` on the SMEM tiles in place of the WGMMA. The twin ignores
``schedule`` (and ``cluster``, ``wg_split``): both schedules compute the same tiles, so its numerics stand for
both. The GPU path of either schedule is checked on CPU by lowering it for CUDA (layouts, shared-memory budget).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from lce_flax import _device, _math
from lce_flax._impl.common import F32, cdiv
from lce_flax._impl.pallas_mosaic import epilogue, tuning
from lce_flax._impl.pallas_mosaic.tuning import SCHEDULES, GemmConfig  # noqa: F401  (part of this module's API)

_SUPPORTED = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_MINOR = 64  # elements of a 128-byte swizzle row (16-bit operands)
# AddTo's default for prefetching each warpgroup tile of its target into L2 before the tile's K loop
# (AddTo.l2_prefetch): off, since it made the whole step slower on an H200 at 32768 tokens, 0.980-0.992x as fast in
# both modes at llama3-8b and gemma2-2b (benchmarks/results/h200-2026-11-30-l2-prefetch)
L2_PREFETCH = False


@dataclasses.dataclass(frozen=True)
class Problem:
  """Static facts of one call: sizes, operand layouts, and the twin (interpret) or GPU structure."""

  m: int
  n: int
  k: int
  transpose_a: bool
  transpose_b: bool
  dtype: Any
  interpret: bool
  nwg: int  # warpgroup tiles per CTA tile (2 on the GPU path, 1 in the interpret twin)

  def rows_padded(self, cfg: GemmConfig) -> int:
    tm = cfg.cluster_tile()[0] if not self.interpret else cfg.tile_m
    return cdiv(self.m, tm) * tm

  def col_tiles(self, cfg: GemmConfig) -> int:
    """Warpgroup tiles along N the tile loop visits (those past N included, when a cluster overhangs)."""
    tn = cfg.cluster_tile()[1] if not self.interpret else cfg.tile_n
    return cdiv(self.n, tn) * (tn // cfg.tile_n)


@dataclasses.dataclass(frozen=True)
class Tile:
  """Where a warpgroup tile lies, as the hooks see it."""

  g: Any  # warpgroup index within the CTA (0 in the interpret twin)
  row0: Any  # first output row
  col0: Any  # first output column
  col_tile: Any  # col0 // tile_n
  cfg: GemmConfig
  prob: Problem

  @property
  def rows(self):
    return pl.ds(self.row0, self.cfg.tile_m)

  @property
  def cols(self):
    return pl.ds(self.col0, self.cfg.tile_n)


def _transforms(dtype, minor_elems: int):
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = plgpu.find_swizzle(minor_elems * itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


@dataclasses.dataclass(frozen=True)
class Window:
  """``size`` rows (``axis=0``) or columns (``axis=1``) of a 2-D array from ``start`` (an int32 scalar, traced or
  not): what a kernel reads (:func:`gemm`'s ``a_window``, ``b_window``) or adds into (:class:`AddTo`'s ``window``)
  in place, where a slice would be a copy (a chunk of columns of a row-major array is strided; XLA hands a custom
  call no strided operand). The kernel takes ``start`` as an int32 [1] GMEM input and offsets its TMA windows by it; the
  window must lie inside the array and ``start`` be a multiple of ``multiple`` (what Mosaic GPU's layout inference
  needs to know of a dynamic offset; neither is checked on the device: :mod:`lce_flax._impl.pallas_mosaic.op`
  clamps its chunks to end at V, a multiple of the GEMM's column tile)."""

  start: Any
  size: int
  axis: int
  multiple: int = 128

  def check(self, name: str, shape) -> tuple[int, int]:
    """The windowed shape of an array of ``shape``; ``ValueError`` naming ``name`` unless the window can fit."""
    if self.axis not in (0, 1) or not 0 < self.size <= shape[self.axis] or self.size % self.multiple:
      raise ValueError(f"gemm: {name} window of {self.size} along axis {self.axis} of {tuple(shape)}: a window is "
                       f"1 to {shape[self.axis] if self.axis in (0, 1) else '?'} long (a multiple of {self.multiple}), "
                       "along axis 0 or 1")
    if isinstance(self.start, (int, np.integer)) and (
        self.start % self.multiple or not 0 <= self.start <= shape[self.axis] - self.size):
      raise ValueError(f"gemm: {name} window from {self.start}: the start of a window of {self.size} along axis "
                       f"{self.axis} of {tuple(shape)} is a multiple of {self.multiple} in [0, "
                       f"{shape[self.axis] - self.size}]")
    return (self.size, shape[1]) if self.axis == 0 else (shape[0], self.size)

  def start_array(self):
    return jnp.asarray(self.start, jnp.int32).reshape(1)

  def of(self, ref, start):
    """The window of ``ref`` from ``start`` (read from the start input in the kernel)."""
    start = pl.multiple_of(start, self.multiple)
    return ref.at[pl.ds(start, self.size)] if self.axis == 0 else ref.at[:, pl.ds(start, self.size)]


def _windowed(body, a_window: Window | None, b_window: Window | None):
  """``body`` taking A and B through their windows (None: as they are): the kernel's first inputs are the windows'
  starts (int32 [1] each, A's first)."""
  if a_window is None and b_window is None:
    return body
  n = (a_window is not None) + (b_window is not None)

  def f(*refs, **kw):
    starts, (a_ref, b_ref, *rest) = list(refs[:n]), refs[n:]
    if a_window is not None:
      a_ref = a_window.of(a_ref, starts.pop(0)[0])
    if b_window is not None:
      b_ref = b_window.of(b_ref, starts.pop(0)[0])
    return body(a_ref, b_ref, *rest, **kw)
  return f


# ------------------------------------------------------------------------------------------------ epilogue parts


class Part:
  """One epilogue part. ``inputs``: extra GMEM arrays; ``out_types``: its outputs; ``smem``: its SMEM (one slot
  per warpgroup); ``prefetch`` runs before a tile's K loop (issue small copies), ``apply`` after it, on the
  float32 accumulator value ``z`` [tile_m, tile_n]. ``reduces_rows``: ``apply`` reduces along the tile's rows,
  for which Mosaic GPU adds scratch SMEM of its own (counted by :func:`smem_bytes`). ``in_place``: the positions
  of the inputs the kernel updates (handed in as mutable refs, aliased to outputs by XLA); their final values
  follow the part's ``out_types`` outputs."""

  reduces_rows = False
  in_place: tuple[int, ...] = ()

  def inputs(self, prob: Problem, cfg: GemmConfig) -> tuple:
    return ()

  def out_types(self, prob: Problem, cfg: GemmConfig) -> tuple:
    return ()

  def smem(self, prob: Problem, cfg: GemmConfig) -> tuple:
    return ()

  def prefetch(self, t: Tile, ins, smem):
    del t, ins, smem

  def apply(self, z, t: Tile, ins, outs, smem):
    raise NotImplementedError

  def finish(self, outs, prob: Problem, cfg: GemmConfig):
    return outs


def _subtiles(cfg: GemmConfig, by_columns: bool = False):
  """The ``epi_m × epi_n`` sub-tiles of a warpgroup tile, row block by row block (``by_columns``: column slice by
  column slice, as :func:`_store_subtiles` forms a tile given by slices)."""
  rows = [slice(i * cfg.epi_m, (i + 1) * cfg.epi_m) for i in range(cfg.tile_m // cfg.epi_m)]
  if by_columns:
    yield from ((ms, ns) for ns in _column_slices(cfg) for ms in rows)
  else:
    yield from ((ms, ns) for ms in rows for ns in _column_slices(cfg))


def _column_slices(cfg: GemmConfig):
  """The ``epi_n``-wide column slices of a warpgroup tile."""
  return (slice(j * cfg.epi_n, (j + 1) * cfg.epi_n) for j in range(cfg.tile_n // cfg.epi_n))


@dataclasses.dataclass(frozen=True)
class Store(Part):
  """Stores the accumulator as ``dtype`` (the operands' dtype when None) [M, N]: each ``epi_m × epi_n``
  sub-tile goes registers → SMEM (``epi_slots`` slots in turn) → TMA, so copies drain while the next are
  written. ``row_scale`` (float32 [M]): each row is multiplied by its factor first, in float32 (the fast design's
  ``dx = σ·(E·wᵀ)`` written once, in x's dtype, with no float32 [M, N] product in between)."""

  dtype: Any = None
  row_scale: Any = None

  def _dt(self, prob):
    return jnp.dtype(self.dtype or prob.dtype)

  def inputs(self, prob, cfg):
    if self.row_scale is None:
      return ()
    if self.row_scale.shape != (prob.m,):
      raise ValueError(f"Store: row_scale must be [{prob.m}] (one per output row), got {self.row_scale.shape}")
    return (jnp.pad(self.row_scale.astype(F32), (0, prob.rows_padded(cfg) - prob.m)),)

  def out_types(self, prob, cfg):
    return (jax.ShapeDtypeStruct((prob.m, prob.n), self._dt(prob)),)

  def smem(self, prob, cfg):
    slots = (plgpu.SMEM((prob.nwg, cfg.epi_slots, cfg.epi_m, cfg.epi_n), self._dt(prob),
                        transforms=_transforms(self._dt(prob), cfg.epi_n)),)
    if self.row_scale is None:
      return slots
    return slots + (plgpu.SMEM((prob.nwg, cfg.tile_m), F32), plgpu.Barrier(num_barriers=prob.nwg))

  def prefetch(self, t, ins, smem):
    if self.row_scale is not None:  # (the previous tile's epilogue, which read this slot, is done)
      plgpu.copy_gmem_to_smem(ins[0].at[t.rows], smem[1].at[t.g], smem[2].at[t.g])

  def apply(self, z, t, ins, outs, smem):
    if self.row_scale is not None:
      plgpu.barrier_wait(smem[2].at[t.g])
      z = z * epilogue.bcast_rows(smem[1][t.g], z.shape)
    _store_subtiles(z, t, outs[0], smem[0])


def _copies_since_slot(q: int, n: int, slots: int) -> int:
  """How many of a tile's stores were issued after the one that last read the slot of sub-tile ``q`` (of ``n``
  a tile, slot ``q mod slots``): ``slots - 1`` within the tile; for the first ones, counted back into the previous
  tile's stores (every tile uses the slots in the same order, so slot ``q`` was last read by its sub-tile ``last``)."""
  if q >= slots:
    return slots - 1
  last = q + (n - 1 - q) // slots * slots
  return (n - 1 - last) + q


def _store_subtiles(z, t: Tile, out, buf, reduction_op=None):
  """Writes the tile ``z`` to ``out`` at the tile's place: each ``epi_m × epi_n`` sub-tile registers → a slot of
  ``buf`` [nwg, slots, epi_m, epi_n] (in turn) → TMA (clipped at the array's edges). A slot is rewritten once the
  copy that last read it is done: ``wait_smem_to_gmem(k)`` with ``k`` the stores issued since (bulk copies that
  other parts issued in between only add to the count, so they never make the wait too short). ``reduction_op``:
  TMA's reduction into ``out`` instead of a plain store (``"add"``: :class:`AddTo`).

  ``z`` may also be a function of a column slice giving the tile's ``[tile_m, epi_n]`` columns there: the tile is
  then formed one slice at a time, right before its stores, so that an epilogue whose output needs more float32
  temporaries than a compute warpgroup's registers hold beside the accumulator (the soft cap's) holds one slice of
  them, not whole tiles (which spilled). Returns the number of copies issued."""
  by_columns = callable(z)
  subs = list(_subtiles(t.cfg, by_columns))
  slots = buf.shape[1]
  part = z
  for q, (ms, ns) in enumerate(subs):
    if by_columns and ms.start == 0:
      part = z(ns)
    slot = q % slots
    plgpu.wait_smem_to_gmem(_copies_since_slot(q, len(subs), slots), wait_read_only=True)
    buf[t.g, slot] = (part[ms, :] if by_columns else part[ms, ns]).astype(buf.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(buf.at[t.g, slot], out.at[pl.ds(t.row0 + ms.start, t.cfg.epi_m),
                                                       pl.ds(t.col0 + ns.start, t.cfg.epi_n)],
                            reduction_op=reduction_op)
  return len(subs)


@dataclasses.dataclass(frozen=True)
class AddTo(Part):
  """``c += acc`` in float32 [M, N], in place: the accumulation of a token-chunked dw. ``c`` is handed to the
  kernel as a mutable ref (:attr:`Part.in_place`), so its buffer is the output (XLA aliases it; a copy is made
  only where the caller still holds ``c``), and no second M×N float32 buffer exists. With ``window``
  (:class:`Window`) ``c`` is a larger array, float32 or the operands' dtype, and the product is added into its
  window: lean mode's dw, each vocabulary chunk's product added into its columns of the whole dw (zeros before;
  every column gets one nonzero product, so the rounded sum is the rounded product).

  On the GPU each sub-tile of the accumulator goes registers → SMEM → a TMA *reduce-add* into ``c``
  (``cp.reduce.async.bulk.tensor``): the add happens on the way to memory, so the epilogue reads nothing into the
  SM; the copies drain while the next tile's K loop runs. A reduce-add still brings its lines of ``c`` from memory
  into L2, and every CTA reaches its epilogue at about the same time. With ``l2_prefetch`` (None: the module's
  ``L2_PREFETCH``, off) each warpgroup asks for its tile of ``c`` in L2 before its K loop
  (``cp.async.bulk.prefetch.tensor``, :func:`plgpu.async_prefetch`), so that those reads overlap the MMAs; measured
  in the whole step, that was slower (see ``L2_PREFETCH``). The interpret twin (Mosaic GPU's interpreter has no TMA
  reductions) reads each sub-tile of ``c`` by TMA into SMEM, adds and stores it back."""

  c: Any
  window: Window | None = None
  l2_prefetch: bool | None = None
  in_place = (0,)

  def inputs(self, prob, cfg):
    if self.window is None:
      if self.c.shape != (prob.m, prob.n) or self.c.dtype != F32:
        raise ValueError(f"AddTo: c must be float32 {(prob.m, prob.n)}, got {self.c.dtype} {self.c.shape}")
      return (self.c,)
    if self.c.ndim != 2 or self.window.check("AddTo's c", self.c.shape) != (prob.m, prob.n) or (
        self.c.dtype not in (F32, prob.dtype)):
      raise ValueError(f"AddTo: c must be float32 or {prob.dtype}, with a window of {(prob.m, prob.n)}, got "
                       f"{self.c.dtype} {self.c.shape} and {self.window.size} along axis {self.window.axis}")
    return (self.c, self.window.start_array())

  def _dt(self):
    return jnp.dtype(self.c.dtype)

  def _target(self, ins):
    """``c`` as the tiles address it (its window, when it has one)."""
    return ins[0] if self.window is None else self.window.of(ins[0], ins[1][0])

  def smem(self, prob, cfg):
    if not prob.interpret:
      return Store(self._dt()).smem(prob, cfg)
    dt = self._dt()
    return (plgpu.SMEM((prob.nwg, 2, cfg.epi_m, cfg.epi_n), dt, transforms=_transforms(dt, cfg.epi_n)),
            plgpu.Barrier(num_barriers=2 * prob.nwg))

  def _load(self, q, slot, t, c, buf, bars):
    ms, ns = list(_subtiles(t.cfg))[q]
    where = (pl.ds(t.row0 + ms.start, t.cfg.epi_m), pl.ds(t.col0 + ns.start, t.cfg.epi_n))
    plgpu.copy_gmem_to_smem(c.at[where], buf.at[t.g, slot], bars.at[t.g * 2 + slot])

  def prefetch(self, t, ins, smem):
    if not t.prob.interpret:
      if L2_PREFETCH if self.l2_prefetch is None else self.l2_prefetch:
        plgpu.async_prefetch(self._target(ins).at[t.rows, t.cols])
      return
    # (twin) the first sub-tile of C lands while the K loop runs; slot 0 was last read by the previous tile's
    # second-to-last store, which is done once at most one copy is in flight
    c, (buf, bars) = self._target(ins), smem
    plgpu.wait_smem_to_gmem(0 if len(list(_subtiles(t.cfg))) % 2 else 1, wait_read_only=True)
    self._load(0, 0, t, c, buf, bars)

  def apply(self, z, t, ins, outs, smem):
    c = self._target(ins)
    if not t.prob.interpret:
      _store_subtiles(z, t, c, smem[0], reduction_op="add")
      return
    buf, bars = smem
    subs = list(_subtiles(t.cfg))
    for q, (ms, ns) in enumerate(subs):
      slot = q % 2
      if q + 1 < len(subs):  # the next sub-tile of C comes in while this one is added and stored
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the store that last read the other slot is done
        self._load(q + 1, 1 - slot, t, c, buf, bars)
      plgpu.barrier_wait(bars.at[t.g * 2 + slot])
      buf[t.g, slot] = (buf[t.g, slot].astype(F32) + z[ms, ns]).astype(buf.dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(buf.at[t.g, slot], c.at[pl.ds(t.row0 + ms.start, t.cfg.epi_m),
                                                       pl.ds(t.col0 + ns.start, t.cfg.epi_n)])


@dataclasses.dataclass(frozen=True)
class StatsOptions:
  """What :class:`RowStats` needs of the loss options (any object with these two attributes will do, e.g. the
  package's loss spec): the logit soft-cap and whether the loss needs Σz (label smoothing)."""

  logit_softcap: float | None = None
  needs_logit_sum: bool = False


@dataclasses.dataclass(frozen=True)
class RowStats(Part):
  """The loss statistics of each warpgroup tile (the forward's lean epilogue): per row, over the tile's columns
  ``< N`` (the vocabulary), ``(max, Σexp(zc - max), zc[label], Σzc)`` of the soft-capped logits ``zc`` (a row with
  no valid column: max = -inf, Σexp = 0), as :func:`lce_flax._math.tile_stats`. Output: float32 [4, column tiles,
  M_padded];
  :func:`merge_row_stats` turns it into the rows' :class:`lce_flax._math.RowStats`. ``labels`` int32 [M] (column
  ids; negative: no target); ``opts``: :class:`StatsOptions` or the package's loss spec.

  ``target_tiles=True`` forms the target logit (a compare, a select and a sum per element) only in the warpgroup
  tiles that hold a row's label: a table of one flag per tile, built from the labels before the kernel, comes into
  SMEM with the tile's labels, and a tile without a label writes zeros (of 128×128 tiles, with uniform random
  labels, about 28% hold one at gpt2-small's 50304 columns, 6-12% at the larger vocabularies; text's labels are
  more concentrated). The flag is uniform over a warpgroup, and the
  branch holds no barrier: only register math and shuffles within warps. ``False`` forms it in every tile, in one
  pass with the row max. ``None`` (the default): the table with a soft cap, where the capped target (a tanh of
  the sum) is dearer and the two-pass epilogue has the max at hand first; without a cap, every tile. Measured on
  an H200 in two runs (``benchmarks/results/target-tiles-h200-2026-11-29/``), the table took the capped fast
  forward 0.87× and 0.92× its time at gpt2-small's 8192-token chunk, 0.99× at gemma2-2b and 0.99-1.01× at
  llama3-8b; the uncapped one 1.08× and 0.99× at gpt2-small, 1.02× and 0.99× at gemma2-2b: no gain that holds.

  ``store=True`` (the fast forward) also writes each tile in the operands' dtype, as a second output [M, N rounded
  up to ``tile_n``] (columns ``≥ N`` hold zeros' values, to be masked or ignored by the reader), in one of two forms:

  * ``ref=None``: the capped logits shifted by their row max over the tile, ``zc - max``; tile ``j`` goes with the
    maxima ``stats[0, j]``. Near the row max, where the softmax mass is, the stored values are near 0, so their
    rounding error is small in absolute terms (see :func:`lce_flax._impl.pallas_mosaic.epilogue.shifted_logits`).
  * ``ref`` float32 [M] (a per-row reference logit): the exponentials ``exp(zc - ref)``, times the soft cap's
    derivative ``1 - (zc/cap)²`` when there is one. Then ``softmax·coef`` is the stored tile times one per-row
    factor ``coef·exp(ref - lse)``, so the logit gradient needs no pass over the tile (:mod:`.fast`). Each entry has
    the relative rounding error of the dtype whatever its size; ``ref`` must lie within ~70 of the row max
    (the exponentials are taken against ``max(ref, max - epilogue.EXP_CLAMP)``; the reader checks the range)."""

  reduces_rows = True  # (max and sums per row)

  labels: Any
  opts: Any = StatsOptions()
  store: bool = False
  bias: Any = None  # float32 [N], added to the accumulator before the soft cap
  target: bool = True  # False: no target logits (zeros; benchmarks/bench_epilogue.py measures what they cost)
  target_tiles: bool | None = None  # the target logit only in tiles that hold a label (None: with a soft cap)
  ref: Any = None  # float32 [M]: store=True writes exp(zc - ref) (times the cap's derivative) instead of zc - max

  def inputs(self, prob, cfg):
    mp = prob.rows_padded(cfg)
    y = self.labels.astype(jnp.int32)
    ins = (jnp.pad(y, (0, mp - prob.m), constant_values=-1),)
    if self.bias is not None:
      if self.bias.shape != (prob.n,):
        raise ValueError(f"RowStats: bias must be [{prob.n}] (one per output column), got {self.bias.shape}")
      ins += (jnp.pad(self.bias.astype(F32), (0, prob.col_tiles(cfg) * cfg.tile_n - prob.n)),)
    if self.ref is not None:
      if not self.store or self.ref.shape != (prob.m,):
        raise ValueError(f"RowStats: ref must be [{prob.m}] (one per output row) and goes with store=True, got "
                         f"{self.ref.shape} and store={self.store}")
      ins += (jnp.pad(self.ref.astype(F32), (0, mp - prob.m)),)
    if "held" in self._vectors():
      ins += (self._held(ins[0], prob, cfg),)
    return ins

  _HELD = 4  # the table's entries per tile (one flag, padded to the 16 bytes of a TMA copy)
  _HELD_SLOT = 32  # the SMEM floats per warpgroup for it

  @classmethod
  def _held(cls, y, prob, cfg):
    """The tile table: float32 [row tiles · column tiles · _HELD], entry ``_HELD·(r·column tiles + c)`` 1 where a
    row of warpgroup row tile ``r`` has its label in column tile ``c``, else 0 (``y``: the labels padded with
    -1 to the padded rows)."""
    tiles = (y.shape[0] // cfg.tile_m, prob.col_tiles(cfg))
    col = jnp.where(y >= 0, y // cfg.tile_n, tiles[1])  # a negative label: no tile (dropped, as a label past them)
    held = jnp.zeros(tiles, F32).at[jnp.arange(y.shape[0]) // cfg.tile_m, col].set(1.0, mode="drop")
    return jnp.pad(held[..., None], ((0, 0), (0, 0), (0, cls._HELD - 1))).reshape(-1)

  @classmethod
  def _held_at(cls, t):
    """Tile ``t``'s entry of the table."""
    return pl.ds((t.row0 // t.cfg.tile_m * t.prob.col_tiles(t.cfg) + t.col_tile) * cls._HELD, cls._HELD)

  def out_types(self, prob, cfg):
    st = jax.ShapeDtypeStruct((4, prob.col_tiles(cfg), prob.rows_padded(cfg)), F32)
    if not self.store:
      return (st,)
    return (st, jax.ShapeDtypeStruct((prob.m, cdiv(prob.n, cfg.tile_n) * cfg.tile_n), prob.dtype))

  def _vectors(self):
    """The names of the per-tile vectors beside the labels, in input order ("bias": per column, "ref": per row,
    "held": the tile's entry of the label table)."""
    return tuple(v for v, on in (("bias", self.bias is not None), ("ref", self.ref is not None),
                                 ("held", self._by_tiles())) if on)

  def _by_tiles(self) -> bool:
    """Whether the target logit is formed only in the tiles that hold a label (see ``target_tiles``)."""
    if not self.target:
      return False
    return self.opts.logit_softcap is not None if self.target_tiles is None else self.target_tiles

  def smem(self, prob, cfg):
    # labels, statistics, barriers (labels; bias; ref; table), the bias tile, the ref rows, the table entry, the stored
    # tiles' slots
    vecs = self._vectors()
    own = (plgpu.SMEM((prob.nwg, cfg.tile_m), jnp.int32), plgpu.SMEM((prob.nwg, 4, cfg.tile_m), F32),
           plgpu.Barrier(num_barriers=prob.nwg * (1 + len(vecs))))
    # (a warpgroup's slot of the table's entry is 128 bytes, as a TMA copy's SMEM destination must be aligned)
    sizes = {"bias": cfg.tile_n, "ref": cfg.tile_m, "held": self._HELD_SLOT}
    return (own + tuple(plgpu.SMEM((prob.nwg, sizes[v]), F32) for v in vecs)
            + (Store().smem(prob, cfg) if self.store else ()))

  def _pieces(self, smem):
    """(bias SMEM, ref SMEM, label table SMEM, stored tiles' slots), None where absent."""
    got = dict(zip(self._vectors(), smem[3:]))
    return got.get("bias"), got.get("ref"), got.get("held"), (smem[-1] if self.store else None)

  def prefetch(self, t, ins, smem):
    y, bars = ins[0], smem[2]
    plgpu.copy_gmem_to_smem(y.at[t.rows], smem[0].at[t.g], bars.at[t.g])
    for q, (name, src) in enumerate(zip(self._vectors(), ins[1:])):
      where = t.cols if name == "bias" else t.rows if name == "ref" else self._held_at(t)
      dst = smem[3 + q].at[t.g] if name != "held" else smem[3 + q].at[t.g, pl.ds(0, self._HELD)]
      plgpu.copy_gmem_to_smem(src.at[where], dst, bars.at[(q + 1) * t.prob.nwg + t.g])

  def apply(self, z, t, ins, outs, smem):
    (st, *stored), (y_smem, st_smem, bars) = outs, smem[:3]
    b_smem, r_smem, _, buf = self._pieces(smem)
    for q in range(1 + len(self._vectors())):
      plgpu.barrier_wait(bars.at[q * t.prob.nwg + t.g])
    if b_smem is not None:
      z = z + epilogue.bcast_cols(b_smem[t.g], z.shape)
    # where N is a multiple of tile_n a tile lies wholly inside N or (a cluster's overhang) wholly past it: no
    # per-element mask, and a tile past N (its columns zeros) is dropped below as a whole
    whole = t.prob.n % t.cfg.tile_n == 0
    if self.opts.logit_softcap is not None:
      return self._capped(z, t, whole, outs, smem)
    cols = lax.broadcasted_iota(jnp.int32, z.shape, 1) + t.col0
    valid = None if whole else cols < t.prob.n
    # the target logit (and the max, which a tile without a label takes its zeros' layout from) first: then z is
    # dead once the exponentials are formed (unless the shifted store needs it), so one float32 tile, not two,
    # stays live through the statistics' stores
    m = epilogue.row_max(z, valid) if self._by_tiles() else None
    tgt = self._target(lambda: epilogue.target_logit(z, cols, valid, y_smem[t.g]), m, t, smem)
    # with a reference, the exponentials against it are what is stored (capped_stats: one exp per element)
    m, s, zsum, e = epilogue.capped_stats(z, valid, self.opts, None if r_smem is None else r_smem[t.g], m=m)
    m, s, zsum = self._past_n(m, s, zsum, t, whole)
    self._put_stats(m, s, tgt, zsum, t, st, st_smem, 0)
    if self.store:
      _store_subtiles(epilogue.shifted_logits(z, m) if r_smem is None else e, t, stored[0], buf)

  def _capped(self, z, t, whole, outs, smem):
    """:meth:`apply` with a soft cap, in two passes over column slices. The cap's temporaries are whole tiles
    when it runs on the tile (the exponentials of the capped logits beside them, and the tanh's own), more than
    a compute warpgroup's 232 registers hold beside the 128 of the accumulator: the kernels spilled 400-630 bytes.
    So the accumulator is the one float32 tile held: first the rows' max and target logit of the raw logits,
    capped per row (the cap is increasing and keeps 0); then per slice the cap, the exponentials summed into the
    statistics, and the slice's stores; the statistics last. (Without a cap the whole-tile form spills nothing
    and takes fewer cross-lane reductions, one per statistic: the slices' cost gpt2-small's and qwen3-8b's step
    1.5%.)"""
    (st, *stored), (y_smem, st_smem) = outs, smem[:2]
    _, r_smem, _, buf = self._pieces(smem)
    cap, labels = self.opts.logit_softcap, y_smem[t.g]

    def cols(ns):
      return lax.broadcasted_iota(jnp.int32, (z.shape[0], ns.stop - ns.start), 1) + (t.col0 + ns.start)

    def valid(ns):
      return None if whole else cols(ns) < t.prob.n

    slices = list(_column_slices(t.cfg))
    mz = functools.reduce(jnp.maximum, [(z[:, ns] if whole else jnp.where(valid(ns), z[:, ns], -jnp.inf)).max(axis=1)
                                        for ns in slices])
    m = jnp.where(mz == -jnp.inf, -jnp.inf, epilogue.softcap(mz, cap))

    def target():
      raw = functools.reduce(jnp.add, [epilogue.target_logit(z[:, ns], cols(ns), valid(ns), labels) for ns in slices])
      # a tile without the row's label sums no hit: its target stays exactly 0 (the rows' target is the sum over
      # the tiles, and the cap's tanh(0) is ~1e-7, not 0); a label's raw logit of exactly 0 caps to 0 as well
      return jnp.where(raw == 0.0, 0.0, epilogue.softcap(raw, cap))

    tgt = self._target(target, mz, t, smem)
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)  # a fully masked row: exp(-inf - 0) = 0, not NaN
    # with a reference, the exponentials against it (what is stored; see epilogue.capped_stats)
    shift = m_safe if r_smem is None else epilogue.ref_shift(r_smem[t.g], m_safe)
    sums, zsums = [], []

    def columns(ns):
      zc, ok = epilogue.softcap(z[:, ns], cap), valid(ns)
      e = epilogue.exp_shifted(zc if ok is None else jnp.where(ok, zc, -jnp.inf), shift)
      sums.append(e.sum(axis=1))
      if self.opts.needs_logit_sum:
        zsums.append((zc if ok is None else jnp.where(ok, zc, 0.0)).sum(axis=1))
      if not self.store:
        return None
      return epilogue.shifted_logits(zc, m) if r_smem is None else _math.through_softcap(e, zc, cap)

    issued = 0
    if self.store:
      issued = _store_subtiles(columns, t, stored[0], buf)
    else:
      for ns in slices:
        columns(ns)
    s = functools.reduce(jnp.add, sums)
    if r_smem is not None:
      s = s * epilogue.to_max(shift, m_safe)
    zsum = functools.reduce(jnp.add, zsums) if zsums else epilogue.row_zeros(m)  # (no Σzc asked)
    m, s, zsum = self._past_n(m, s, zsum, t, whole)
    self._put_stats(m, s, tgt, zsum, t, st, st_smem, issued)

  def _target(self, form, m, t, smem):
    """The tile's target logits: ``form()``, where the label table says the tile holds a label (or always, without
    the table); zeros in the layout of the rows' max ``m`` where it does not; None without targets."""
    if not self.target:
      return None
    held = self._pieces(smem)[2]
    if held is None:
      return form()
    return lax.cond(held[t.g, 0] != 0.0, form, lambda: epilogue.row_zeros(m))

  @staticmethod
  def _past_n(m, s, zsum, t, whole):
    """The statistics of a tile that lies past N (a cluster's overhang, where N is a multiple of tile_n): none."""
    if not whole:
      return m, s, zsum
    past = t.col0 >= t.prob.n
    keep = jnp.where(past, 0.0, 1.0)
    return m + jnp.where(past, -jnp.inf, 0.0), s * keep, zsum * keep

  @staticmethod
  def _put_stats(m, s, tgt, zsum, t, st, st_smem, since: int):
    """The tile's four statistics rows → SMEM → TMA. ``since``: the bulk copies issued after the previous tile's
    statistics (which last read ``st_smem``), left pending by the wait."""
    plgpu.wait_smem_to_gmem(since, wait_read_only=True)  # the previous tile's statistics have left st_smem
    st_smem[t.g, 0] = m
    st_smem[t.g, 1] = s
    st_smem[t.g, 2] = epilogue.row_zeros(m) if tgt is None else tgt
    st_smem[t.g, 3] = zsum
    plgpu.commit_smem()
    for q in range(4):
      plgpu.copy_smem_to_gmem(st_smem.at[t.g, q], st.at[q, t.col_tile, t.rows])


def merge_row_stats(stats, m: int) -> _math.RowStats:
  """The rows' statistics over all column tiles from :class:`RowStats`' output [4, tiles, M_padded]."""
  mx, s, tgt, zs = (stats[q, :, :m] for q in range(4))
  top = mx.max(axis=0)
  safe = jnp.where(top == -jnp.inf, 0.0, top)
  return _math.RowStats(top, (s * jnp.exp(mx - safe)).sum(axis=0), tgt.sum(axis=0), zs.sum(axis=0))


@dataclasses.dataclass(frozen=True)
class LogitGrad(Part):
  """The logit gradient of each warpgroup tile, stored in the operands' dtype [M, N] (lean mode's recompute):
  ``dz = (coef·exp(zc - lse) - [col = label]·a - c)`` times the soft cap's derivative, with ``zc`` the capped
  logits (``bias`` float32 [N] added first) and the per-row ``lse``, ``coef``, ``a``, ``c`` float32 [M] of
  :func:`lce_flax._impl.pallas_mosaic.epilogue.row_coefficients`; ``labels`` int32 [M] are column ids (anything
  outside ``[0, N)``: no label column here). Columns below a row's ``first`` (int32 [M]; None: 0) are written as
  zeros: the clamped last chunk of a vocabulary walk, whose first columns the chunk before it did. ``opts``: the
  package's loss spec (``logit_softcap``, ``label_smoothing``). The epilogue is
  :func:`.epilogue.dlogits_capped`, the formula of every other dz kernel of the package. ``into`` ([M, N] in the
  operands' dtype): the tiles are written over it, in place (:attr:`Part.in_place`), instead of into a new array;
  with :func:`gemm`'s ``row_mask`` only the computed tiles are (the fast design's repair of the rows past its
  stored exponentials' range)."""

  lse: Any
  coef: Any
  a: Any
  c: Any
  labels: Any
  opts: Any
  first: Any = None
  bias: Any = None
  into: Any = None

  @property
  def in_place(self) -> tuple[int, ...]:  # (into: the last input)
    return () if self.into is None else (2 + (self.bias is not None),)

  def inputs(self, prob, cfg):
    mp = prob.rows_padded(cfg)
    vecs = (self.lse, self.coef, self.a, self.c)
    if any(v.shape != (prob.m,) for v in (*vecs, self.labels)) or (
        self.first is not None and self.first.shape != (prob.m,)):
      raise ValueError(f"LogitGrad: lse, coef, a, c, labels (and first) must be [{prob.m}] (one per output row), got "
                       f"{[v.shape for v in (*vecs, self.labels, self.first) if v is not None]}")
    # rows past M (a cluster's overhang): lse = +inf and zero coefficients give dz = 0 exactly
    fills = (jnp.inf, 0.0, 0.0, 0.0)
    f = jnp.stack([jnp.pad(v.astype(F32), (0, mp - prob.m), constant_values=fl) for v, fl in zip(vecs, fills)])
    first = jnp.zeros((prob.m,), jnp.int32) if self.first is None else self.first
    i = jnp.stack([jnp.pad(self.labels.astype(jnp.int32), (0, mp - prob.m), constant_values=-1),
                   jnp.pad(first.astype(jnp.int32), (0, mp - prob.m))])
    out = (f, i)
    if self.bias is not None:
      if self.bias.shape != (prob.n,):
        raise ValueError(f"LogitGrad: bias must be [{prob.n}] (one per output column), got {self.bias.shape}")
      out += (jnp.pad(self.bias.astype(F32), (0, prob.col_tiles(cfg) * cfg.tile_n - prob.n)),)
    if self.into is not None:
      if self.into.shape != (prob.m, prob.n) or self.into.dtype != prob.dtype:
        raise ValueError(f"LogitGrad: into must be {prob.dtype} {(prob.m, prob.n)} (the output's place), got "
                         f"{self.into.dtype} {self.into.shape}")
      out += (self.into,)
    return out

  def out_types(self, prob, cfg):
    return () if self.into is not None else (jax.ShapeDtypeStruct((prob.m, prob.n), prob.dtype),)

  def _copies(self) -> int:
    return 6 + (self.bias is not None)  # one barrier per TMA copy: 4 float rows, 2 int rows, the bias tile

  def smem(self, prob, cfg):
    own = (plgpu.SMEM((prob.nwg, 4, cfg.tile_m), F32), plgpu.SMEM((prob.nwg, 2, cfg.tile_m), jnp.int32),
           plgpu.Barrier(num_barriers=prob.nwg * self._copies()))
    if self.bias is not None:
      own += (plgpu.SMEM((prob.nwg, cfg.tile_n), F32),)
    return own + Store().smem(prob, cfg)

  def prefetch(self, t, ins, smem):
    f, i = ins[:2]
    f_smem, i_smem, bars = smem[:3]
    pairs = [(f.at[q, t.rows], f_smem.at[t.g, q]) for q in range(4)]
    pairs += [(i.at[q, t.rows], i_smem.at[t.g, q]) for q in range(2)]
    if self.bias is not None:
      pairs.append((ins[2].at[t.cols], smem[3].at[t.g]))
    for q, (src, dst) in enumerate(pairs):
      plgpu.copy_gmem_to_smem(src, dst, bars.at[self._copies() * t.g + q])

  def apply(self, z, t, ins, outs, smem):
    f_smem, i_smem, bars = smem[:3]
    for q in range(self._copies()):
      plgpu.barrier_wait(bars.at[self._copies() * t.g + q])
    if self.bias is not None:
      z = z + epilogue.bcast_cols(smem[3][t.g], z.shape)
    lse, coef, a, c = (f_smem[t.g, q] for q in range(4))
    labels, first = i_smem[t.g, 0], i_smem[t.g, 1]

    def dz(zs, col0):  # a [rows, cols] piece of the tile, its first column col0
      cols = lax.broadcasted_iota(jnp.int32, zs.shape, 1) + col0
      out = epilogue.epilogue_dlogits(zs, cols, labels, lse, coef, a, c, self.opts)
      return jnp.where(cols >= epilogue.bcast_rows(first, zs.shape), out, 0.0)

    # with a cap, a column slice at a time (see RowStats._capped)
    out = dz(z, t.col0) if self.opts.logit_softcap is None else (lambda ns: dz(z[:, ns], t.col0 + ns.start))
    _store_subtiles(out, t, outs[0] if self.into is None else ins[-1], smem[-1])


# ------------------------------------------------------------------------------------------------ prologue


@dataclasses.dataclass(frozen=True)
class DzFromLogits:
  """A prologue: A = the logit gradient of stored logits, formed tile by tile before the MMA.

  A is handed in as logits ``z`` [M, K] (bf16, not transposed); the A tile the MMA takes is
  ``dz = exp(z - lse)·coef - [col = label]·a`` (columns ``≥ K`` zero), with per-row ``lse``, ``coef``, ``a``
  float32 [M] and ``labels`` int32 [M] (as :func:`lce_flax._impl.pallas_mosaic.epilogue.row_coefficients` gives
  them; ``lse`` may already hold a per-row shift of the stored logits). Then ``dx = gemm(z, w, prologue=...)``."""

  lse: Any
  coef: Any
  a: Any
  labels: Any

  def inputs(self, prob, cfg):
    mp = prob.rows_padded(cfg)
    pad = lambda v, fill: jnp.pad(v, (0, mp - prob.m), constant_values=fill)
    vecs = jnp.stack([pad(self.lse.astype(F32), 0.0), pad(self.coef.astype(F32), 0.0), pad(self.a.astype(F32), 0.0)])
    return (vecs, pad(self.labels.astype(jnp.int32), -1))

  def smem(self, prob, cfg):
    return (plgpu.SMEM((prob.nwg, 3, cfg.tile_m), F32), plgpu.SMEM((prob.nwg, cfg.tile_m), jnp.int32),
            plgpu.Barrier(num_barriers=4 * prob.nwg))

  def fetch(self, t: Tile, ins, smem):
    """Brings the tile's row vectors into SMEM and waits for them (once per output tile; one barrier per copy,
    since each TMA copy is one arrival)."""
    (vecs, y), (v_smem, y_smem, bars) = ins, smem
    pairs = [(vecs.at[q, t.rows], v_smem.at[t.g, q]) for q in range(3)] + [(y.at[t.rows], y_smem.at[t.g])]
    for q, (src, dst) in enumerate(pairs):
      plgpu.copy_gmem_to_smem(src, dst, bars.at[4 * t.g + q])
    for q in range(4):
      plgpu.barrier_wait(bars.at[4 * t.g + q])

  def form(self, z, k0, t: Tile, smem):
    """The A tile [tile_m, tile_k] (operand dtype) from the stored-logit tile ``z`` (float32)."""
    v_smem, y_smem, _ = smem
    shape = z.shape
    row = lambda v: epilogue.bcast_rows(v, shape)
    cols = lax.broadcasted_iota(jnp.int32, shape, 1) + k0
    dz = epilogue.exp_shifted(z, v_smem[t.g, 0]) * row(v_smem[t.g, 1])
    dz = dz - jnp.where(cols == row(y_smem[t.g]), row(v_smem[t.g, 2]), 0.0)
    return jnp.where(cols < t.prob.k, dz, 0.0)


# ------------------------------------------------------------------------------------------------ the kernel


def _in_specs(prob: Problem, cfg: GemmConfig, cta_m: int, cta_n: int):
  tk = cfg.tile_k
  multicast_a = ("cluster",) if cfg.cluster == "n" else ()
  multicast_b = ("cluster",) if cfg.cluster == "m" else ()
  extra = {} if prob.interpret else {"memory_space": plgpu.SMEM}
  if cfg.mma_lag and not prob.interpret:
    extra["delay_release"] = cfg.mma_lag
  if prob.transpose_a:
    a_spec = plgpu.BlockSpec((tk, cta_m), lambda k: (k, 0), transforms=_transforms(prob.dtype, cta_m),
                             collective_axes=multicast_a, **extra)
  else:
    a_spec = plgpu.BlockSpec((cta_m, tk), lambda k: (0, k), transforms=_transforms(prob.dtype, tk),
                             collective_axes=multicast_a, **extra)
  if prob.transpose_b:
    b_spec = plgpu.BlockSpec((cta_n, tk), lambda k: (0, k), transforms=_transforms(prob.dtype, tk),
                             collective_axes=multicast_b, **extra)
  else:
    b_spec = plgpu.BlockSpec((tk, cta_n), lambda k: (k, 0), transforms=_transforms(prob.dtype, cta_n),
                             collective_axes=multicast_b, **extra)
  return [a_spec, b_spec]


def _windows(a_ref, b_ref, prob: Problem, m0, n0, cta_m: int, cta_n: int):
  a_win = a_ref.at[:, pl.ds(m0, cta_m)] if prob.transpose_a else a_ref.at[pl.ds(m0, cta_m)]
  b_win = b_ref.at[pl.ds(n0, cta_n)] if prob.transpose_b else b_ref.at[:, pl.ds(n0, cta_n)]
  return a_win, b_win


def _wg_operands(a_smem, b_smem, prob: Problem, cfg: GemmConfig, g):
  """This warpgroup's [tile_m, tile_k] A view and [tile_k, tile_n] B view of the CTA's SMEM tiles."""
  tm, tn = cfg.tile_m, cfg.tile_n
  rows = pl.ds(g * tm, tm) if (prob.nwg > 1 and cfg.wg_split == "m") else slice(None)
  cols = pl.ds(g * tn, tn) if (prob.nwg > 1 and cfg.wg_split == "n") else slice(None)
  a = a_smem.at[:, rows].T if prob.transpose_a else a_smem.at[rows]
  b = b_smem.at[cols].T if prob.transpose_b else b_smem.at[:, cols]
  return a, b


def _tile_origin(lin, prob: Problem, cfg: GemmConfig, cta_m: int, cta_n: int):
  """The CTA tile (its first row and column) of step ``lin`` of the persistent loop."""
  cl_m, cl_n = (cfg.cluster_tile() if not prob.interpret else (cta_m, cta_n))
  shape = (cdiv(prob.m, cl_m), cdiv(prob.n, cl_n))
  mi, ni = plgpu.planar_snake(lin, shape, 0 if cfg.order_minor == "m" else 1, cfg.order_width)
  if not prob.interpret and cfg.cluster is not None:
    c = lax.axis_index("cluster")
    if cfg.cluster == "m":
      mi = mi * 2 + c
    else:
      ni = ni * 2 + c
  return mi * cta_m, ni * cta_n


def _split(seq, sizes):
  out, i = [], 0
  for s in sizes:
    out.append(tuple(seq[i:i + s]))
    i += s
  return out


def _ignore(*_, **__):
  return None


def _smem_types(parts, prologue, prob: Problem, cfg: GemmConfig):
  """(the prologue's SMEM types, [each epilogue part's])."""
  return (prologue.smem(prob, cfg) if prologue is not None else ()), [p.smem(prob, cfg) for p in parts]


@dataclasses.dataclass(frozen=True)
class _Hooks:
  """A call's prologue and epilogue parts bound to the kernel's refs: what every kernel body does around a tile's
  K loop. ``of`` splits the body's refs (inputs, outputs, then any SMEM); ``with_smem`` adds the hooks' SMEM once
  the body has allocated it (:func:`_smem_types`)."""

  parts: tuple
  prologue: Any
  pro_ins: tuple
  part_ins: tuple
  part_outs: tuple
  pro_smem: tuple = ()
  part_smem: tuple = ()

  @staticmethod
  def of(refs, parts, prologue, n_in, n_out, n_smem=None) -> _Hooks:
    ins = _split(refs[:sum(n_in)], n_in)
    outs = _split(refs[sum(n_in):sum(n_in) + sum(n_out)], n_out)
    h = _Hooks(parts, prologue, ins[0], tuple(ins[1:]), tuple(outs))
    if n_smem is None:
      return h
    smem = _split(refs[sum(n_in) + sum(n_out):], n_smem)
    return h.with_smem(smem[0], smem[1:])

  def with_smem(self, pro_smem, part_smem) -> _Hooks:
    return dataclasses.replace(self, pro_smem=tuple(pro_smem), part_smem=tuple(part_smem))

  def before(self, t: Tile):
    """Before tile ``t``'s K loop: the parts' prefetches, the prologue's row vectors."""
    for p, pi, ps in zip(self.parts, self.part_ins, self.part_smem):
      p.prefetch(t, pi, ps)
    if self.prologue is not None:
      self.prologue.fetch(t, self.pro_ins, self.pro_smem)

  def form(self, a, k0, t: Tile, dtype):
    """The prologue's A tile (``dtype``) from the loaded one (its float32 value) of the K step at column ``k0``."""
    return self.prologue.form(a, k0, t, self.pro_smem).astype(dtype)

  def after(self, z, t: Tile):
    """After tile ``t``'s K loop: each epilogue part on the accumulator ``z``."""
    for p, pi, po, ps in zip(self.parts, self.part_ins, self.part_outs, self.part_smem):
      p.apply(z, t, pi, po, ps)


def row_unit(config: GemmConfig, interpret: bool = False) -> int:
  """The rows one entry of :func:`gemm`'s ``row_mask`` stands for: a cluster tile's on the GPU (the CTAs of a
  cluster take or skip their tiles together: they share the multicast operand's copies and barriers), a warpgroup
  tile's in the interpret twin."""
  return config.tile_m if interpret else config.cluster_tile()[0]


def _split_mask(refs, n_in, masked: bool):
  """(the row mask's ref, or None; the kernel's other refs): the mask comes right after the hooks' inputs."""
  if not masked:
    return None, refs
  k = sum(n_in)
  return refs[k], refs[:k] + refs[k + 1:]


def _if_kept(mask_ref, row0, unit: int, fn):
  """Runs ``fn`` (a tile's loads, MMAs and epilogue) unless the row mask skips the rows from ``row0``."""
  if mask_ref is None:
    fn()
  else:
    pl.when(mask_ref[row0 // unit] != 0)(fn)


def _body_ws(a_ref, b_ref, *refs, prob: Problem, cfg: GemmConfig, parts, prologue, n_in, n_out, masked=False):
  """The GPU kernel: 2 compute warpgroups + 1 TMA warpgroup, persistent over the output tiles."""
  mask_ref, refs = _split_mask(refs, n_in, masked)
  hooks = _Hooks.of(refs, parts, prologue, n_in, n_out)
  cta_m, cta_n = cfg.cta_tile()
  specs = _in_specs(prob, cfg, cta_m, cta_n)
  steps = cdiv(prob.k, cfg.tile_k)

  def pipeline(body, ctx):
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(steps,), memory_registers=40, in_specs=specs, wg_axis="wg", num_compute_wgs=2,
        max_concurrent_steps=cfg.stages, compute_context=ctx)

  pro_smem_types, smem_types = _smem_types(parts, prologue, prob, cfg)
  a_tmpl, b_tmpl = _windows(a_ref, b_ref, prob, 0, 0, cta_m, cta_n)

  def scope(allocs, pro_smem, *part_smem):
    h = hooks.with_smem(pro_smem, part_smem)
    cl_m, cl_n = cfg.cluster_tile()
    tiles = cdiv(prob.m, cl_m) * cdiv(prob.n, cl_n)

    @plgpu.nd_loop((tiles,), collective_axes="sm")
    def _tile(info):
      (lin,) = info.index
      m0, n0 = _tile_origin(lin, prob, cfg, cta_m, cta_n)

      def tile_of(g):
        row0 = m0 + (g * cfg.tile_m if cfg.wg_split == "m" else 0)
        col0 = n0 + (g * cfg.tile_n if cfg.wg_split == "n" else 0)
        return Tile(g, row0, col0, col0 // cfg.tile_n, cfg, prob)

      def ctx(eval_pipeline):
        t = tile_of(lax.axis_index("wg"))
        h.before(t)

        def acc_scope(acc_ref):
          eval_pipeline(acc_ref)
          if cfg.mma_lag:
            plgpu.wgmma_wait(0)  # the K loop's last WGMMAs
          h.after(acc_ref[...], t)

        pl.run_scoped(acc_scope, plgpu.ACC((cfg.tile_m, cfg.tile_n), F32))

      def mma(idx, a_smem, b_smem, acc_ref):
        g = lax.axis_index("wg")
        a, b = _wg_operands(a_smem, b_smem, prob, cfg, g)
        if prologue is not None:
          (k,) = idx
          a = h.form(a[...].astype(F32), k * cfg.tile_k, tile_of(g), prob.dtype)
        plgpu.wgmma(acc_ref, a, b)
        plgpu.wgmma_wait(cfg.mma_lag)  # (its slot is released mma_lag steps later)
        return acc_ref

      a_win, b_win = _windows(a_ref, b_ref, prob, m0, n0, cta_m, cta_n)
      _if_kept(mask_ref, m0, row_unit(cfg), lambda: pipeline(mma, ctx)(a_win, b_win, allocations=allocs))

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # no SMEM is released while a copy still reads it

  pl.run_scoped(scope, pipeline(_ignore, _ignore).get_allocations(a_tmpl, b_tmpl), pro_smem_types, *smem_types,
                collective_axes="wg")


def _body_pingpong(a_ref, b_ref, *refs, prob: Problem, cfg: GemmConfig, parts, prologue, n_in, n_out, masked=False):
  """The GPU kernel, ping-pong schedule: 2 compute warpgroups, each with an output tile and a K pipeline of its
  own, taking turns on the tensor cores.

  The warpgroup tiles of the planar-snake order are dealt out in pairs: pair ``p`` goes to CTA ``p mod #SMs``, its
  tiles ``2p`` and ``2p + 1`` to warpgroups 0 and 1. Each warpgroup issues the TMA copies of its own tile's K steps
  into its own ``stages``-deep ring of SMEM slots (the copies of its next tile's first steps start as soon as its
  MMAs are done, so they land during its epilogue). A pair of turn barriers orders the K loops: warpgroup ``g``
  waits for its turn, issues all WGMMAs of its tile, hands the turn to the other warpgroup and only then waits for
  its MMAs and runs its epilogue, so one warpgroup's epilogue runs while the other's WGMMAs keep the tensor cores
  busy. Warpgroup 0 has the first turn (warpgroup 1 hands it over at the start)."""
  hooks = _Hooks.of(refs, parts, prologue, n_in, n_out)
  tm, tn, tk, depth = cfg.tile_m, cfg.tile_n, cfg.tile_k, cfg.stages
  steps = cdiv(prob.k, tk)
  depth = min(depth, steps)
  a_shape, a_minor = ((tk, tm), tm) if prob.transpose_a else ((tm, tk), tk)
  b_shape, b_minor = ((tn, tk), tk) if prob.transpose_b else ((tk, tn), tn)
  a_type = plgpu.SMEM((2, depth, *a_shape), prob.dtype, transforms=_transforms(prob.dtype, a_minor))
  b_type = plgpu.SMEM((2, depth, *b_shape), prob.dtype, transforms=_transforms(prob.dtype, b_minor))
  full_type = plgpu.Barrier(num_arrivals=2, num_barriers=2 * depth)  # a slot's A and B copies have landed
  turn_type = plgpu.Barrier(num_arrivals=1, num_barriers=2)  # warpgroup g may issue its K loop's WGMMAs
  pro_smem_types, smem_types = _smem_types(parts, prologue, prob, cfg)
  tiles = cdiv(prob.m, tm) * cdiv(prob.n, tn)
  pairs = cdiv(tiles, 2)

  def scope(a_buf, b_buf, full, turn, pro_smem, *part_smem):
    h = hooks.with_smem(pro_smem, part_smem)
    g = lax.axis_index("wg")
    nsm = lax.axis_size("sm")

    def tile_at(pair):
      lin = 2 * pair + g
      row0, col0 = _tile_origin(lin, prob, cfg, tm, tn)
      return lin < tiles, Tile(g, row0, col0, col0 // tn, cfg, prob)

    def load(t: Tile, step, slot):
      ks = pl.ds(step * tk, tk)
      a_src = a_ref.at[ks, t.rows] if prob.transpose_a else a_ref.at[t.rows, ks]
      b_src = b_ref.at[t.cols, ks] if prob.transpose_b else b_ref.at[ks, t.cols]
      bar = full.at[g * depth + slot]
      plgpu.copy_gmem_to_smem(a_src, a_buf.at[g, slot], bar)
      plgpu.copy_gmem_to_smem(b_src, b_buf.at[g, slot], bar)

    def load_first(pair):
      valid, t = tile_at(pair)

      @pl.when(jnp.logical_and(pair < pairs, valid))
      def _():
        for s in range(depth):
          load(t, s, s)

    load_first(lax.axis_index("sm"))

    @pl.when(g == 1)
    def _():
      plgpu.barrier_arrive(turn.at[0])  # warpgroup 0 has the first turn

    @plgpu.nd_loop((pairs,), collective_axes="sm")
    def _pair(info):
      (pair,) = info.index
      valid, t = tile_at(pair)

      @pl.when(valid)
      def _():
        h.before(t)

        def acc_scope(acc_ref):
          plgpu.barrier_wait(turn.at[g])

          @pl.loop(0, steps)
          def _k(step):
            slot = lax.rem(step, depth)
            plgpu.barrier_wait(full.at[g * depth + slot])
            a = a_buf.at[g, slot].T if prob.transpose_a else a_buf.at[g, slot]
            b = b_buf.at[g, slot].T if prob.transpose_b else b_buf.at[g, slot]
            if prologue is not None:
              a = h.form(a[...].astype(F32), step * tk, t, prob.dtype)
              plgpu.wgmma(acc_ref, a, b)
              plgpu.wgmma_wait(0)  # the slot is read: refill it
              refill, rslot = step + depth, slot
            else:
              plgpu.wgmma(acc_ref, a, b)
              plgpu.wgmma_wait(1)  # the previous step's WGMMA has read its slot: refill that one
              refill, rslot = step - 1 + depth, lax.rem(step + depth - 1, depth)

            @pl.when(jnp.logical_and(refill >= depth, refill < steps))
            def _():
              load(t, refill, rslot)

          plgpu.barrier_arrive(turn.at[1 - g])  # all WGMMAs issued: the other warpgroup's turn
          plgpu.wgmma_wait(0)  # (the last WGMMA still reads a slot the next tile's copies overwrite)
          load_first(pair + nsm)  # the next tile's first K steps land during this epilogue
          h.after(acc_ref[...], t)

        pl.run_scoped(acc_scope, plgpu.ACC((tm, tn), F32))

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # no SMEM is released while a copy still reads it

  pl.run_scoped(scope, a_type, b_type, full_type, turn_type, pro_smem_types, *smem_types, collective_axes="wg")


def _body_pingpong_ws(a_ref, b_ref, *refs, prob: Problem, cfg: GemmConfig, parts, prologue, n_in, n_out, masked=False):
  """The GPU kernel, ping-pong schedule fed by a TMA warpgroup (``schedule="pingpong_ws"``): the two compute
  warpgroups take turns on the tensor cores as in :func:`_body_pingpong`, but their K steps come through one ring of
  ``stages`` slots shared by both, filled by a third warpgroup in the order the turns consume them (a warpgroup's
  tile, then the other's next one), so the copies run up to ``stages - 1`` K steps ahead across tile boundaries.

  Barriers: ``full[g, slot]`` (a slot's A and B copies for warpgroup ``g`` have landed; one set per warpgroup, so
  each barrier is waited for only by the warpgroup it is meant for), ``empty[slot]`` (its WGMMA has read the slot;
  waited for only by the TMA warpgroup), ``turn[g]`` as in :func:`_body_pingpong`.

  With ``cluster`` set, the two CTAs of a cluster walk the same sequence of cluster tiles (``tile_m × 2·tile_n``
  for ``cluster="n"``, ``2·tile_m × tile_n`` for ``"m"``), each warpgroup taking its CTA's half of a turn's cluster
  tile, so the two CTAs fill their rings in lockstep: the operand the halves have in common (A for ``"n"``, B for
  ``"m"``) is loaded half by each CTA and multicast to both (TMA multicast), which halves its L2 traffic. A slot
  is then written into both CTAs' SMEM, so ``empty`` is a cluster barrier: each consumer's release arrives in both
  CTAs, and a producer refills a slot once the consumers of both have read it. At the end each producer waits for
  the releases of its ring's last ``stages`` positions, so that no CTA leaves while its peer still arrives on its
  barriers."""
  hooks = _Hooks.of(refs, parts, prologue, n_in, n_out)
  tm, tn, tk, depth = cfg.tile_m, cfg.tile_n, cfg.tile_k, cfg.stages
  steps = cdiv(prob.k, tk)
  a_shape, a_minor = ((tk, tm), tm) if prob.transpose_a else ((tm, tk), tk)
  b_shape, b_minor = ((tn, tk), tk) if prob.transpose_b else ((tk, tn), tn)
  a_type = plgpu.SMEM((depth, *a_shape), prob.dtype, transforms=_transforms(prob.dtype, a_minor))
  b_type = plgpu.SMEM((depth, *b_shape), prob.dtype, transforms=_transforms(prob.dtype, b_minor))
  full_type = plgpu.Barrier(num_arrivals=2, num_barriers=2 * depth)
  if cfg.cluster is None:
    empty_type = plgpu.Barrier(num_arrivals=1, num_barriers=depth)
  else:  # (a release arrives in both CTAs: their consumers read a slot the multicast writes into both)
    empty_type = plgpu.ClusterBarrier(collective_axes=("cluster",), num_arrivals=1, num_barriers=depth)
  multicast_a = "cluster" if cfg.cluster == "n" else None
  multicast_b = "cluster" if cfg.cluster == "m" else None
  turn_type = plgpu.Barrier(num_arrivals=1, num_barriers=2)
  pro_smem_types, smem_types = _smem_types(parts, prologue, prob, cfg)
  cl_m, cl_n = cfg.cluster_tile()
  tiles = cdiv(prob.m, cl_m) * cdiv(prob.n, cl_n)  # cluster tiles (a CTA takes its half of each)
  pairs = cdiv(tiles, 2)
  memory_registers = 40
  compute_registers = min(240, (512 - memory_registers) // 2 // 8 * 8)

  def scope(a_buf, b_buf, full, empty, turn, pro_smem, *part_smem):
    h = hooks.with_smem(pro_smem, part_smem)
    wg = lax.axis_index("wg")

    def tile_of(pair, g):
      lin = 2 * pair + g
      row0, col0 = _tile_origin(lin, prob, cfg, tm, tn)
      return lin < tiles, Tile(g, row0, col0, col0 // tn, cfg, prob)

    @pl.when(wg == 2)
    def _producer():
      plgpu.set_max_registers(memory_registers, action="decrease")

      def fill(pair, local, g):
        """The K steps of warpgroup ``g``'s tile of ``pair`` into the ring, from ring position ``first``."""
        valid, t = tile_of(pair, g)
        first = (2 * local + g) * steps

        @pl.when(valid)
        def _():
          @pl.loop(0, steps)
          def _k(step):
            pos = first + step
            slot = lax.rem(pos, depth)

            @pl.when(pos >= depth)
            def _():
              plgpu.barrier_wait(empty.at[slot])  # the WGMMA that read this slot's last use is done

            ks = pl.ds(step * tk, tk)
            a_src = a_ref.at[ks, t.rows] if prob.transpose_a else a_ref.at[t.rows, ks]
            b_src = b_ref.at[t.cols, ks] if prob.transpose_b else b_ref.at[ks, t.cols]
            plgpu.copy_gmem_to_smem(a_src, a_buf.at[slot], full.at[g * depth + slot], collective_axes=multicast_a)
            plgpu.copy_gmem_to_smem(b_src, b_buf.at[slot], full.at[g * depth + slot], collective_axes=multicast_b)

      @plgpu.nd_loop((pairs,), collective_axes="sm")
      def _pair(info):
        (pair,) = info.index
        for g in range(2):  # in the order the turns consume them
          fill(pair, info.local_index, g)

      if cfg.cluster is not None:  # the last releases (the peer's included) before this CTA may leave
        sm, nsm = lax.axis_index("sm"), lax.axis_size("sm")
        mine = lax.div(pairs - sm + nsm - 1, nsm)  # the pairs this CTA took (sm, sm + nsm, ...)
        # (an odd tile count leaves the last pair's second tile out)
        short = jnp.logical_and(tiles % 2 == 1, lax.rem(pairs - 1, nsm) == sm).astype(jnp.int32)
        end = (2 * mine - short) * steps  # ring positions filled
        for pos in (end - depth + i for i in range(depth)):
          pl.when(pos >= 0)(functools.partial(lambda p: plgpu.barrier_wait(empty.at[lax.rem(p, depth)]), pos))

    @pl.when(wg < 2)
    def _consumers():
      plgpu.set_max_registers(compute_registers, action="increase")
      g = wg

      @pl.when(g == 1)
      def _():
        plgpu.barrier_arrive(turn.at[0])  # warpgroup 0 has the first turn

      @plgpu.nd_loop((pairs,), collective_axes="sm")
      def _pair(info):
        (pair,) = info.index
        valid, t = tile_of(pair, g)
        first = (2 * info.local_index + g) * steps

        @pl.when(valid)
        def _():
          h.before(t)

          def acc_scope(acc_ref):
            plgpu.barrier_wait(turn.at[g])

            @pl.loop(0, steps)
            def _k(step):
              slot = lax.rem(first + step, depth)
              plgpu.barrier_wait(full.at[g * depth + slot])
              a = a_buf.at[slot].T if prob.transpose_a else a_buf.at[slot]
              b = b_buf.at[slot].T if prob.transpose_b else b_buf.at[slot]
              if prologue is not None:
                a = h.form(a[...].astype(F32), step * tk, t, prob.dtype)
                plgpu.wgmma(acc_ref, a, b)
                plgpu.wgmma_wait(0)
                plgpu.barrier_arrive(empty.at[slot])
              else:
                plgpu.wgmma(acc_ref, a, b)
                plgpu.wgmma_wait(1)  # the previous step's WGMMA is done: its slot is free

                @pl.when(step > 0)
                def _():
                  plgpu.barrier_arrive(empty.at[lax.rem(first + step + depth - 1, depth)])

            plgpu.barrier_arrive(turn.at[1 - g])  # all WGMMAs issued: the other warpgroup's turn
            plgpu.wgmma_wait(0)
            if prologue is None:
              plgpu.barrier_arrive(empty.at[lax.rem(first + steps - 1, depth)])
            h.after(acc_ref[...], t)

          pl.run_scoped(acc_scope, plgpu.ACC((tm, tn), F32))

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # no SMEM is released while a copy still reads it

  pl.run_scoped(scope, a_type, b_type, full_type, empty_type, turn_type, pro_smem_types, *smem_types,
                collective_axes="wg")


def _body_twin(a_ref, b_ref, *refs, prob: Problem, cfg: GemmConfig, parts, prologue, n_in, n_out, n_smem,
               masked=False):
  """The interpret twin: one warpgroup tile per CTA tile, the same loop, pipeline, hooks; a dot for the MMA."""
  mask_ref, refs = _split_mask(refs, n_in, masked)
  h = _Hooks.of(refs, parts, prologue, n_in, n_out, n_smem)
  tm, tn = cfg.tile_m, cfg.tile_n
  specs = _in_specs(prob, cfg, tm, tn)
  steps = cdiv(prob.k, cfg.tile_k)
  dims = (((0 if prob.transpose_a else 1,), (1 if prob.transpose_b else 0,)), ((), ()))
  tiles = cdiv(prob.m, tm) * cdiv(prob.n, tn)

  @plgpu.nd_loop((tiles,), collective_axes="sm")
  def _tile(info):
    (lin,) = info.index
    m0, n0 = _tile_origin(lin, prob, cfg, tm, tn)
    t = Tile(0, m0, n0, n0 // tn, cfg, prob)

    def step(idx, a_smem, b_smem, acc):
      a = a_smem[...]
      if prologue is not None:
        (k,) = idx
        a = h.form(a.astype(F32), k * cfg.tile_k, t, prob.dtype)
      return acc + lax.dot_general(a, b_smem[...], dims, preferred_element_type=F32)

    def run():
      h.before(t)
      a_win, b_win = _windows(a_ref, b_ref, prob, m0, n0, tm, tn)
      z = plgpu.emit_pipeline(step, grid=(steps,), in_specs=specs, max_concurrent_steps=cfg.stages,
                              init_carry=jnp.zeros((tm, tn), F32))(a_win, b_win)
      h.after(z, t)

    _if_kept(mask_ref, m0, row_unit(cfg, interpret=True), run)

  plgpu.wait_smem_to_gmem(0)


SMEM_LIMIT = 227 * 1024


SMEM_ALIGN = 1024  # Mosaic GPU starts every scoped SMEM buffer at a multiple of 1 KB
REDUCTION_SCRATCH = 2048  # the SMEM Mosaic GPU adds for an epilogue's row reductions (Part.reduces_rows)


def _alloc_bytes(alloc) -> int:
  shape = getattr(alloc, "shape", None)
  if shape is None:  # barriers: 8 bytes each
    nb = alloc.num_barriers
    return 8 * (math.prod(nb) if isinstance(nb, tuple) else int(nb))
  return cdiv(math.prod(shape) * jnp.dtype(alloc.dtype).itemsize, SMEM_ALIGN) * SMEM_ALIGN


def smem_bytes(prob: Problem, cfg: GemmConfig, parts, prologue=None) -> int:
  """The GPU kernel's shared memory, as Mosaic GPU counts it: the pipeline's stages (and their barriers), the
  hooks' buffers each rounded up to 1 KB, and the reductions' scratch (checked against the lowering's own count in
  ``tests/test_gemm.py``)."""
  cta_m, cta_n = cfg.cta_tile()
  stage = (cta_m + cta_n) * cfg.tile_k * jnp.dtype(prob.dtype).itemsize
  barriers = 2  # per stage: its copies have landed, its slot is free (cooperative) / one per warpgroup (pingpong)
  if cfg.schedule == "pingpong":  # a ring of slots per warpgroup
    stage *= 2
  elif cfg.schedule == "pingpong_ws":  # one full barrier per warpgroup and an empty one
    barriers = 3
  turns = 16 if cfg.schedule != "cooperative" else 0  # the two turn barriers
  pro_types, part_types = _smem_types(parts, prologue, prob, cfg)
  allocs = [x for types in part_types for x in types] + list(pro_types)
  reductions = REDUCTION_SCRATCH if any(p.reduces_rows for p in parts) else 0
  return cfg.stages * (stage + 8 * barriers) + turns + sum(_alloc_bytes(x) for x in allocs) + reductions


def _check_operand(name, arr, minor_dim_name):
  if jnp.dtype(arr.dtype) not in _SUPPORTED:
    raise TypeError(f"gemm: {name} has dtype {arr.dtype}; this GEMM takes bf16 or fp16 operands (WGMMA's 16-bit "
                    "path); cast float32 operands first or use jnp.dot")
  if arr.ndim != 2:
    raise ValueError(f"gemm: {name} must be 2-D, got {arr.shape}")
  if arr.shape[1] % _MINOR or arr.shape[0] % 8:
    raise ValueError(f"gemm: {name} {arr.shape}: TMA with the 128-byte swizzle reads arrays whose minor dimension "
                     f"({minor_dim_name}={arr.shape[1]}) is a multiple of {_MINOR} and whose major one is a multiple "
                     "of 8; store it the other way round (e.g. w as [V, H]) or pad it once where it is created")


def _parts(epilogue) -> tuple:
  return (Store(),) if epilogue is None else (tuple(epilogue) if isinstance(epilogue, (tuple, list)) else (epilogue,))


def table_config(role: str, m: int, n: int, k: int, dtype, *, epilogue=None, prologue=None,
                 interpret: bool = False) -> GemmConfig:
  """The config :func:`gemm` runs when given none: the tuning table's row for ``role`` and this shape on this
  device (:func:`.tuning.select_config`), with fewer stages until the SMEM estimate of the call's hooks fits.
  Callers that must know the tiling (e.g. the width of the statistics' column tiles) ask here and pass it on."""
  config = tuning.select_config(role, m, n, k, _device_kind())
  if interpret:
    config = dataclasses.replace(config, cluster=None)
  prob = Problem(m, n, k, False, False, jnp.dtype(dtype), interpret, 1 if interpret else 2)
  parts = _parts(epilogue)
  while config.stages > 2 and smem_bytes(prob, config, parts, prologue) > SMEM_LIMIT:
    config = dataclasses.replace(config, stages=config.stages - 1)
  return config


def gemm(a, b, *, transpose_a: bool = False, transpose_b: bool = False, epilogue=None, prologue=None,
         config: GemmConfig | None = None, interpret: bool = False, role: str = "plain", approx_math: bool = False,
         row_mask=None, a_window: Window | None = None, b_window: Window | None = None):
  """``epilogue(prologue(A) · B)``; see the module docstring. Returns the epilogue parts' outputs (a tuple, or the
  one array of a one-output epilogue). ``epilogue``: a :class:`Part` or a tuple of them (default ``Store()``);
  ``config``: a :class:`GemmConfig` (default: :func:`.tuning.select_config` for ``role``, with fewer stages where
  the hooks' SMEM needs it); ``approx_math``: the hooks' ``exp`` on the hardware's approximate unit (``ex2.approx``,
  relative error ~1e-7) instead of the accurate library routine (GPU path only). It also makes ``tanh`` the
  hardware's ``tanh.approx`` (relative error ~5e-4: ~0.015 on a logit near a soft cap of 30), so a soft-capped
  epilogue should leave it off. ``row_mask`` (int32 [cdiv(M, row_unit(config, interpret))]): the output tiles of
  the row units whose entry is 0 are skipped whole (nothing loaded, no MMA, no epilogue: their part of an output
  is left unwritten, so it suits epilogues that write in place); a skipped tile costs one read of its entry.
  The cooperative schedule only. ``b_window`` (:class:`Window`): B is that window of ``b`` (as given, before
  ``transpose_b``), read in place: no copy of a strided slice; ``a_window`` the same for A."""
  _check_operand("a", a, "M" if transpose_a else "K")
  _check_operand("b", b, "K" if transpose_b else "N")
  if a.dtype != b.dtype:
    raise TypeError(f"gemm: operand dtypes differ ({a.dtype} vs {b.dtype})")
  a_shape = a.shape if a_window is None else a_window.check("a", a.shape)
  m, k = (a_shape[1], a_shape[0]) if transpose_a else a_shape
  b_shape = b.shape if b_window is None else b_window.check("b", b.shape)
  k2, n = (b_shape[1], b_shape[0]) if transpose_b else b_shape
  if k != k2:
    raise ValueError(f"gemm: contraction sizes differ: A gives K={k}, B gives K={k2}")
  if prologue is not None and transpose_a:
    raise NotImplementedError("gemm: a prologue forms A from a non-transposed [M, K] tile")
  if prologue is not None and config is not None and config.mma_lag:
    raise ValueError(f"gemm: config.mma_lag={config.mma_lag} with a prologue: its A tile is formed in registers, "
                     "which each K step's WGMMA must have read before the next is formed (use mma_lag=0)")
  parts = _parts(epilogue)
  if config is None:
    config = table_config(role, m, n, k, a.dtype, epilogue=parts, prologue=prologue, interpret=interpret)
  if interpret:
    config = dataclasses.replace(config, cluster=None)
  config.validate()
  prob = Problem(m, n, k, transpose_a, transpose_b, jnp.dtype(a.dtype), interpret, 1 if interpret else 2)
  if row_mask is not None:
    if not interpret and config.schedule != "cooperative":
      raise NotImplementedError(f"gemm: row_mask with schedule={config.schedule!r} (the cooperative one only)")
    units = cdiv(m, row_unit(config, interpret))
    if row_mask.shape != (units,):
      raise ValueError(f"gemm: row_mask must be [{units}] (one entry per {row_unit(config, interpret)} rows of "
                       f"M={m}), got {row_mask.shape}")

  pro_in = prologue.inputs(prob, config) if prologue is not None else ()
  part_in = [p.inputs(prob, config) for p in parts]
  part_out = [p.out_types(prob, config) for p in parts]
  n_in = [len(pro_in)] + [len(x) for x in part_in]
  n_out = [len(x) for x in part_out]
  out_type = tuple(o for x in part_out for o in x)
  # the inputs a part updates in place go in as mutable refs: XLA aliases each to the kernel's output
  part_in = [tuple(jax.new_ref(x) if i in p.in_place else x for i, x in enumerate(xs))
             for p, xs in zip(parts, part_in)]
  args = (a, b, *pro_in, *(x for xs in part_in for x in xs))
  if row_mask is not None:
    args += (row_mask.astype(jnp.int32),)
  args = (*(win.start_array() for win in (a_window, b_window) if win is not None), *args)
  window = functools.partial(_windowed, a_window=a_window, b_window=b_window)
  hooks = dict(prob=prob, cfg=config, parts=parts, prologue=prologue, n_in=n_in, n_out=n_out,
               masked=row_mask is not None)

  if interpret:
    pro_smem, part_smem = _smem_types(parts, prologue, prob, config)
    smem = [pro_smem] + part_smem
    body = window(functools.partial(_body_twin, n_smem=[len(s) for s in smem], **hooks))
    kern = plgpu.kernel(body, out_type=out_type, scratch_types=[s for ss in smem for s in ss],
                        grid=(min(3, cdiv(m, config.tile_m) * cdiv(n, config.tile_n)),), grid_names=("sm",),
                        interpret=plgpu.InterpretGPUParams())
  else:
    cs = config.cluster_size()
    body = {"cooperative": _body_ws, "pingpong": _body_pingpong, "pingpong_ws": _body_pingpong_ws}[config.schedule]
    kern = plgpu.kernel(window(functools.partial(body, **hooks)), out_type=out_type, grid=(_device.num_sms() // cs,),
                        grid_names=("sm",), cluster=(cs,), cluster_names=("cluster",),
                        num_threads=2 if config.schedule == "pingpong" else 3,
                        thread_name="wg", kernel_name=kernel_name(role, parts, prologue),
                        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
                                                             approx_math=approx_math,
                                                             unsafe_no_auto_barriers=not config.auto_barriers))
  res = kern(*args)
  res = list(res) if isinstance(res, (tuple, list)) else [res]
  flat = []
  for p, os_, xs in zip(parts, _split(res, n_out), part_in):
    flat.extend(p.finish(os_ + tuple(jax.freeze(xs[i]) for i in p.in_place), prob, config))
  return flat[0] if len(flat) == 1 else tuple(flat)


def kernel_name(role: str, parts, prologue=None) -> str:
  """The GPU kernel's name, as profiles and traces show it: the role and the hooks, e.g.
  ``lce_gemm_lean_dz_LogitGrad`` (``benchmarks/profile_head.py`` sums the time of each)."""
  hooks = ([type(prologue).__name__] if prologue is not None else []) + [type(p).__name__ for p in parts]
  return "_".join(["lce_gemm", role, *hooks])


def _device_kind() -> str:
  try:
    return jax.devices()[0].device_kind
  except Exception:  # noqa: BLE001  (no backend: the tuning table's default row)
    return "unknown"
