"""``impl="pallas_mosaic"``: Pallas Mosaic GPU kernels (TMA + WGMMA) for Hopper GPUs (SM90: H100, H200).

Both kernels (forward statistics, backward logit gradient) are built on one thing: a float32 tile of ``x @ w``
accumulated by WGMMA over H from shared-memory tiles of x and w that TMA streams in ``num_stages`` steps ahead,
whose accumulator never leaves the registers: the epilogue reduces or transforms it on chip. Two variants:

* **warp-specialised** (the GPU default): a CTA tile of ``block_t × 2·block_v``; two compute warpgroups own one
  ``block_t × block_v`` accumulator each, a third warpgroup only issues TMA copies
  (``plgpu.emit_pipeline_warp_specialized``, as in jax's own Hopper matmul); while one compute warpgroup runs its
  epilogue the other keeps the tensor cores busy. Warpgroup lowering semantics (Mosaic infers the layouts).
* **one warpgroup** (``Config(warp_specialized=False)``; the interpret-mode path): ``plgpu.emit_pipeline`` with
  ``delay_release=1`` (one WGMMA stays in flight while the next tiles land), Lane semantics with explicit
  register layouts. About 1.3× slower on the H100 (``benchmarks/NOTES_mosaic.md``).

Forward (O(B) output)
  ``plgpu.kernel`` over a grid ``(num_splits, row_blocks)``, split fastest, so the CTAs resident at one time share
  a few row blocks of x (in L2) while the vocabulary streams past. CTA ``(j, i)`` walks the vocabulary tiles of
  split ``j`` for its ``block_t`` tokens; each tile's logits (plus bias, soft cap) are reduced to the online
  logsumexp statistics (running max, sum of exponentials, target logit, logit sum) and merged into a running
  per-row state (registers; SMEM per compute warpgroup in the warp-specialised kernel). Only these 4 float32 per token and split reach HBM; a tiny JAX step merges the
  splits with :func:`lce_flax._math.merge_stats` and :func:`lce_flax._math.finalize` gives loss and lse.

Backward (recompute, bounded memory)
  ``jax.custom_vjp`` keeps x, w, bias, labels and the [B] lse. The vocabulary is walked in chunks of
  ``chunk_size`` columns; per chunk one persistent Mosaic kernel (a CTA per SM looping over the chunk's tiles)
  recomputes the chunk's logit tiles and writes the logit gradient ``dz`` [B, chunk] in the input dtype (its
  epilogue is the factored form of :func:`lce_flax._math.dlogits`, see :func:`row_coefficients`), then two XLA
  matmuls give ``dw[chunk] = xᵀ dz`` (complete, written once) and ``dx += dz wᵀ[chunk]`` (float32 accumulator).
  FLOPs 2·B·H·V (forward) + 2·B·H·V (recompute) + 4·B·H·V (gradients) = 8·B·H·V.
  Extra memory: dz (B·chunk·2 bytes: 32 MiB at B=8192, chunk 2048), the float32 dx (B·H·4), one chunk of w.

Fast mode (``mode="fast"``, 6·B·H·V, a bounded buffer; see the "fast mode" section at the end)
  The forward kernel also writes every logit tile, shifted by its row max, in the input dtype, plus the maxima
  (through SMEM + TMA, while the other warpgroup keeps the tensor cores busy). Once lse is known, one elementwise
  pass turns the stored tiles into dz in place, and dx, dw are plain matmuls: for all B tokens at once
  (``"logits"``: a B×V buffer, the same bytes as torch.compile's bf16 logits) or per chunk of tokens with a float32
  dw (``"tokens"``: H·V·4 + c·V·2 bytes); the default is whichever buffer is smaller.

Shapes: B is padded to a multiple of ``block_t`` (x is small); the vocabulary's last tile is a window clamped to
end at V whose already-counted columns are masked, so w is not padded or copied when TMA can tile it as it is:
H a multiple of ``block_k`` (64) and V a multiple of 8 ("vh") or 64 ("hv"), and V ≥ ``block_v`` — true of the LLM
heads (50304, 128256, 151936, 256000). Otherwise w is zero-padded (a copy of w per call; small problems only).

dtypes: bf16 and fp16 run as they are (float32 accumulation). WGMMA has no fp32 operands (tf32 would need a
second shared-memory layout), so **fp32 inputs** take one of two paths (``Config.fp32_inputs``): by default the
exact chunked implementation (the package's fp32 contract: 2e-5 of the float64 oracle), or, opted in with
``"bf16"``, the kernels on bf16-rounded x and w (the exact loss of the rounded inputs, ~1e-3 from the fp32 one;
gradients returned in fp32).

Interpret mode (CPU): the one-warpgroup kernels run under Mosaic GPU's own interpreter
(``plgpu.InterpretGPUParams``: simulated GMEM/SMEM, TMA copies, barriers), except the one WGMMA instruction, which
it cannot interpret: there the pipeline body adds ``jnp.dot`` of the same shared-memory tiles into a carried
accumulator. Everything else (the TMA pipeline, index maps, tile windows, epilogues, SMEM stores) is what the GPU
runs. The warp-specialised kernels cannot be interpreted (collective warpgroup axes); CPU tests lower them for
CUDA instead (layout inference and the SMEM budget are checked there), the GPU check runs them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from lce_flax import _device, _math
from lce_flax._impl import common
from lce_flax._impl.common import F32

_L = plgpu.Layout.WGMMA
_ROW = plgpu.Layout.WGMMA.reduce(1)  # one value per tile row (token)
_COL = plgpu.Layout.WGMMA.reduce(0)  # one value per tile column (vocabulary entry)


@dataclasses.dataclass(frozen=True)
class Config:
  """Kernel configuration; ``None`` fields are chosen by :func:`plan`.

  Attributes:
    block_t: tokens per tile (multiple of 64: one warpgroup's WGMMA rows).
    block_v: vocabulary columns per tile (multiple of 64).
    block_k: hidden units per pipeline step (64: one 128-byte swizzle of bf16).
    num_stages: TMA pipeline depth (≥ 2).
    num_splits: vocabulary splits of the forward grid.
    chunk_size: vocabulary columns per backward chunk (a multiple of ``block_v``); in the "tokens" fast design,
      tokens per chunk (a multiple of ``block_t``).
    semantics: ``"lane"`` (explicit register layouts) or ``"warpgroup"`` (layouts inferred by Mosaic).
    fp32_inputs: what float32 (or mixed) inputs do: ``"chunked"`` (default) runs them exactly through
      :mod:`lce_flax._impl.chunked` (XLA float32 matmuls: WGMMA has no float32 operands); ``"bf16"`` rounds x and w to
      bf16 and runs the kernels (the loss of the rounded inputs; gradients returned in float32).
    warp_specialized: two compute warpgroups (each a ``block_t × block_v`` accumulator, a CTA tile of
      ``block_t × 2·block_v``) fed by a third, TMA-only warpgroup (``plgpu.emit_pipeline_warp_specialized``);
      None: on a GPU yes, in interpret mode no (the interpreter cannot run it).
    fast_design: the buffer ``mode="fast"`` spends (see :func:`fast`): ``"logits"`` (the B×V shifted logits in
      the input dtype), ``"tokens"`` (a chunk of them and an H×V float32 dw), ``"chunked"`` (the chunked
      implementation's fast design), or None: the smaller of the first two.
  """

  block_t: int | None = None
  block_v: int | None = None
  block_k: int | None = None
  num_stages: int | None = None
  num_splits: int | None = None
  chunk_size: int | None = None
  semantics: str | None = None
  warp_specialized: bool | None = None
  fp32_inputs: str | None = None
  fast_design: str | None = None


@dataclasses.dataclass(frozen=True)
class Plan:
  block_t: int
  block_v: int
  block_k: int
  num_stages: int
  num_splits: int
  chunk_size: int
  semantics: str
  warp_specialized: bool


DZ_CHUNK_BYTES = 32 * 2**20


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _pow2_floor(n: int) -> int:
  return 1 << max(int(n).bit_length() - 1, 0)


def _num_sms() -> int:
  try:
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)
  except Exception:  # no backend details: assume an H100
    return 132


def plan(num_tokens: int, hidden: int, vocab: int, config: Config | None = None, interpret: bool = False) -> Plan:
  """Tile sizes for one shape (bf16/fp16 operands): the heuristic, overridden by any field of ``config``.

  128×128 tiles (one warpgroup holds a 64 KB float32 accumulator: 128 registers per thread with the epilogue's
  temporaries), 64-deep steps, 4 stages (32 KB of SMEM per stage; 48 KB with warp specialisation);
  ``num_splits`` for ~8 waves of CTAs over the SMs (H100, llama3-8b forward: 4 splits 14.3 ms, 8 splits 14.7 ms,
  16 splits 13.8 ms); ``chunk_size`` ``DZ_CHUNK_BYTES`` of bf16 dz, a power of two in [block_v, 16384], at most the
  (block-rounded) vocabulary.
  """
  c = config or Config()
  ws = (not interpret) if c.warp_specialized is None else bool(c.warp_specialized)
  # (the warp-specialised kernels' layout inference fails for block_t=64: they keep 128-row tiles)
  bt = c.block_t or (64 if num_tokens <= 64 and not ws else 128)
  bv = c.block_v or 128
  bk = c.block_k or 64
  for name, val, mult in (("block_t", bt, 64), ("block_v", bv, 64), ("block_k", bk, 64)):
    if val < mult or val % mult:
      raise ValueError(f"{name}={val} must be a positive multiple of {mult}")
  stages = c.num_stages or 4
  if stages < 2:
    raise ValueError(f"num_stages={stages} must be >= 2 (one WGMMA stays in flight)")
  vp = max(vocab, bv)
  nb = _cdiv(num_tokens, bt)
  nvt = _cdiv(vp, bv)
  splits = c.num_splits or max(1, min(nvt, 64, _cdiv(8 * _num_sms(), nb)))
  if splits < 1:
    raise ValueError(f"num_splits={splits} must be >= 1")
  splits = min(splits, nvt)
  chunk = c.chunk_size or min(max(_pow2_floor(DZ_CHUNK_BYTES // (2 * max(num_tokens, 1))), bv), 16384)
  if chunk < bv or chunk % bv:
    raise ValueError(f"chunk_size={chunk} must be a positive multiple of block_v={bv}")
  chunk = min(chunk, (vp // bv) * bv)
  if ws and interpret:
    raise NotImplementedError("warp_specialized=True cannot run in interpret mode (Mosaic GPU's interpreter has no "
                              "collective warpgroup axes); use warp_specialized=False")
  # the warp-specialised kernels run in Warpgroup semantics (as jax's own Hopper matmul does)
  sem = c.semantics or ("warpgroup" if ws else "lane")
  if sem not in ("lane", "warpgroup"):
    raise ValueError(f"semantics={sem!r} must be 'lane' or 'warpgroup'")
  if ws:
    sem = "warpgroup"
    if chunk % (2 * bv):
      chunk = _cdiv(chunk, 2 * bv) * 2 * bv  # whole CTA tiles (2 warpgroups × block_v) per chunk
    chunk = min(chunk, (max(vp, 2 * bv) // (2 * bv)) * 2 * bv)
    splits = min(splits, _cdiv(vp, 2 * bv))
  return Plan(bt, bv, bk, stages, splits, chunk, sem, ws)


def supported(spec: common.Spec, platform: str) -> None:
  if spec.interpret:
    return  # Mosaic GPU's interpreter runs these kernels on any platform (see module docstring)
  if platform != "gpu":
    raise NotImplementedError(f"pallas_mosaic needs an NVIDIA GPU (platform={platform!r}) or interpret=True")
  cc = _device.compute_capability()
  if cc is None or cc < (9, 0):
    raise NotImplementedError(f"pallas_mosaic needs WGMMA (compute capability >= 9.0, Hopper), got {cc}")


# ------------------------------------------------------------------------------------------------ epilogue math
# The loss math of _math.py, written with the ops Mosaic GPU lowers on register tiles: per-row values enter a tile
# through lax.broadcast_in_dim (no reshapes, no [:, None]); tests check these against _math.tile_stats/dlogits.


def _rows(v, shape):
  return lax.broadcast_in_dim(v, shape, [0])


def _cols(v, shape):
  return lax.broadcast_in_dim(v, shape, [1])


def epilogue_stats(zc, cols, valid, labels, opts: _math.LossOptions):
  """``_math.tile_stats`` of the capped tile ``zc`` [bt, bv]; ``cols``/``valid`` are [bt, bv], labels [bt]."""
  masked = jnp.where(valid, zc, -jnp.inf)
  m = masked.max(axis=1)
  m_safe = jnp.where(m == -jnp.inf, 0.0, m)  # a fully masked row: exp(-inf - 0) = 0, not NaN
  s = jnp.exp(masked - _rows(m_safe, zc.shape)).sum(axis=1)
  hit = valid & (cols == _rows(labels, zc.shape))
  target = jnp.where(hit, zc, 0.0).sum(axis=1)
  zsum = jnp.where(valid, zc, 0.0).sum(axis=1) if opts.needs_logit_sum else jnp.zeros_like(m)
  return _math.RowStats(m, s, target, zsum)


def shifted_logits(zc, m):
  """What the fast forward stores of a capped tile: ``zc - m`` with ``m`` the tile's row max (finite).

  Stored in bf16/fp16, the entries that carry the softmax mass (``zc`` near the row max) are near 0, so their
  rounding error is absolute ~2⁻⁹·|zc - m| instead of ~2⁻⁹·|zc| (as for rounded logits): an entry's probability
  keeps a relative error ≤ 2⁻⁹·(m - zc), which is only large where the probability is ~e^{-(m - zc)} small.
  """
  return zc - _rows(jnp.where(m == -jnp.inf, 0.0, m), zc.shape)


def merge(a: _math.RowStats, b: _math.RowStats) -> _math.RowStats:
  """``_math.merge_stats`` for registers (Mosaic GPU has no ``isfinite``: only ``m = -inf`` is special-cased).

  Differs from it only for infinite logits (+inf), where both are meaningless anyway.
  """
  m = jnp.maximum(a.m, b.m)
  m_safe = jnp.where(m == -jnp.inf, 0.0, m)
  s = a.s * jnp.exp(a.m - m_safe) + b.s * jnp.exp(b.m - m_safe)
  return _math.RowStats(m, s, a.target + b.target, a.zsum + b.zsum)


def row_coefficients(lse, labels, g_loss, g_lse, opts: _math.LossOptions):
  """Per-token factors of :func:`lce_flax._math.dlogits`: ``dz' = p·coef - [v = y]·a - c``.

  ``coef = g·(1 + 2λ_z·lse) + g_lse``, ``a = (1-ε)·g``, ``c = ε/V·g`` with ``g`` the loss cotangent of counted
  tokens (0 otherwise); ``coef`` is NaN for out-of-range labels, so their whole gradient row is NaN.
  """
  counted = labels >= 0
  g = jnp.where(counted, g_loss.astype(F32), 0.0)
  coef = g * (1.0 + 2.0 * opts.z_loss * lse) if opts.z_loss else g
  coef = coef + g_lse.astype(F32)
  coef = jnp.where(labels >= opts.vocab_size, jnp.nan, coef)
  a = (1.0 - opts.label_smoothing) * g
  c = (opts.label_smoothing / opts.vocab_size) * g
  return coef, a, c


def epilogue_dlogits(z, cols, labels, lse, coef, a, c, opts: _math.LossOptions):
  """The logit gradient of a tile from :func:`row_coefficients` (``cols`` [bt, bv] global column ids)."""
  return dlogits_capped(_math.softcap(z, opts.logit_softcap), cols, labels, lse, coef, a, c, opts)


def dlogits_capped(zc, cols, labels, lse, coef, a, c, opts: _math.LossOptions):
  """:func:`epilogue_dlogits` of the already capped tile ``zc``."""
  shape = zc.shape
  p = jnp.exp(zc - _rows(lse, shape))
  dz = p * _rows(coef, shape) - jnp.where(cols == _rows(labels, shape), _rows(a, shape), 0.0)
  if opts.label_smoothing:
    dz = dz - _rows(c, shape)
  if opts.logit_softcap is not None:
    r = zc * (1.0 / opts.logit_softcap)
    dz = dz * (1.0 - r * r)
  return dz


# ------------------------------------------------------------------------------------------------ kernels


@dataclasses.dataclass(frozen=True)
class _Dims:
  b: int  # padded tokens (multiple of block_t)
  h: int  # padded hidden (multiple of block_k)
  v: int  # real vocabulary
  vp: int  # vocabulary of the w handed to the kernel (≥ block_v)
  w_layout: str
  has_bias: bool
  interpret: bool
  store: bool = False  # the fast forward: also write the shifted logits and tile maxima (see _store_tile)


def _transforms(minor_bytes: int):
  swizzle = plgpu.find_swizzle(minor_bytes * 8)
  return swizzle, (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))


def _layout(a, layout, p: Plan, d: _Dims):
  """Pins a register layout (Lane semantics); Warpgroup semantics and the interpreter infer it."""
  if p.semantics == "lane":
    return plgpu.layout_cast(a, layout)
  return a


def _load_vec(smem, layout, p: Plan, d: _Dims):
  if d.interpret or p.semantics != "lane":
    return _layout(smem[...], layout, p, d)
  return plgpu.load(smem, layout=layout)


def _iota(shape, dim, p: Plan, d: _Dims):
  if p.semantics == "lane" and not d.interpret:
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=_L)
  return lax.broadcasted_iota(jnp.int32, shape, dim)


def _logit_tile(x_rows, w_cols, d: _Dims, p: Plan):
  """float32 ``x_rows @ w_cols`` [block_t, block_v] (w_cols is [bv, H] for "vh", [H, bv] for "hv")."""
  bt, bv, bk = p.block_t, p.block_v, p.block_k
  _, tr = _transforms(bk * 2)
  nk = d.h // bk
  delay = 0 if d.interpret else 1
  x_spec = plgpu.BlockSpec((bt, bk), lambda k: (0, k), transforms=tr, delay_release=delay)
  if d.w_layout == "vh":
    w_spec = plgpu.BlockSpec((bv, bk), lambda k: (0, k), transforms=tr, delay_release=delay)
  else:
    w_spec = plgpu.BlockSpec((bk, bv), lambda k: (k, 0), transforms=_transforms(bv * 2)[1], delay_release=delay)
  if d.interpret:
    # Mosaic GPU's interpreter has no WGMMA: the same shared-memory tiles go through jnp.dot instead.
    dims = (((1,), (1,)), ((), ())) if d.w_layout == "vh" else (((1,), (0,)), ((), ()))

    def step(_, xs, ws, acc):
      return acc + lax.dot_general(xs[...], ws[...], dims, preferred_element_type=F32)

    return plgpu.emit_pipeline(step, grid=(nk,), in_specs=[x_spec, w_spec], max_concurrent_steps=p.num_stages,
                               init_carry=jnp.zeros((bt, bv), F32))(x_rows, w_cols)

  def scope(acc_ref):
    def step(_, xs, ws):
      plgpu.wgmma(acc_ref, xs, ws.transpose((1, 0)) if d.w_layout == "vh" else ws)
      plgpu.wgmma_wait(1)  # the previous step's WGMMA is done: its SMEM slot may be refilled

    plgpu.emit_pipeline(step, grid=(nk,), in_specs=[x_spec, w_spec], max_concurrent_steps=p.num_stages)(
        x_rows, w_cols)
    plgpu.wgmma_wait(0)
    return acc_ref[...]

  return pl.run_scoped(scope, plgpu.ACC((bt, bv), F32))


def _w_window(w_ref, c0, bv: int, d: _Dims):
  return w_ref.at[pl.ds(c0, bv)] if d.w_layout == "vh" else w_ref.at[:, pl.ds(c0, bv)]


def _fetch(pairs, bars, first: int = 0):
  """TMA copies of small GMEM vectors into SMEM (one barrier each: a copy is one arrival), then waits for all."""
  for k, (src, dst) in enumerate(pairs):
    plgpu.copy_gmem_to_smem(src, dst, bars.at[first + k])
  for k in range(len(pairs)):
    plgpu.barrier_wait(bars.at[first + k])


def _fwd_gmem_refs(refs: list, d: _Dims):
  """Pops the forward kernels' GMEM refs off ``refs``: x, w, bias (or None), labels, stats, and the fast
  forward's stored tiles and maxima (or None, None); what is left in ``refs`` is scratch."""
  x_ref, w_ref = refs.pop(0), refs.pop(0)
  b_ref = refs.pop(0) if d.has_bias else None
  y_ref, st_ref = refs.pop(0), refs.pop(0)
  zb_ref, mt_ref = (refs.pop(0), refs.pop(0)) if d.store else (None, None)
  return x_ref, w_ref, b_ref, y_ref, st_ref, zb_ref, mt_ref


def _fwd_body(*refs, d: _Dims, p: Plan, opts: _math.LossOptions):
  refs = list(refs)
  x_ref, w_ref, b_ref, y_ref, st_ref, zb_ref, mt_ref = _fwd_gmem_refs(refs, d)
  y_smem = refs.pop(0)
  b_smem = refs.pop(0) if d.has_bias else None
  st_smem = refs.pop(0)
  o_smem, m_smem = (refs.pop(0), refs.pop(0)) if d.store else (None, None)
  (bars,) = refs
  bt, bv, ns = p.block_t, p.block_v, p.num_splits
  nvt = _cdiv(d.vp, bv)
  tps = _cdiv(nvt, ns)  # vocabulary tiles per split
  j = lax.axis_index("split")
  i = lax.axis_index("row")
  r0 = i * bt
  _fetch([(y_ref.at[pl.ds(r0, bt)], y_smem)], bars)
  labels = _load_vec(y_smem, _ROW, p, d)
  shape = (bt, bv)
  x_rows = x_ref.at[pl.ds(r0, bt)]

  def tile(t, carry):
    st = _math.RowStats(*carry)
    nominal = t * bv
    c0 = jnp.minimum(nominal, d.vp - bv)  # the last window is clamped to end at vp; its overlap is masked
    z = _logit_tile(x_rows, _w_window(w_ref, c0, bv, d), d, p)
    if d.has_bias:
      _fetch([(b_ref.at[pl.ds(c0, bv)], b_smem)], bars, 1)
      z = z + _cols(_load_vec(b_smem, _COL, p, d), shape)
    cols = _iota(shape, 1, p, d) + c0
    valid = (cols >= nominal) & (cols < d.v)
    zc = _math.softcap(z, opts.logit_softcap)
    new = epilogue_stats(zc, cols, valid, labels, opts)
    if d.store:
      _store_tile(zc, new.m, o_smem, m_smem, zb_ref, mt_ref, r0, c0, nominal, bt, bv)
    return tuple(merge(st, new))

  init = tuple(_layout(jnp.full((bt,), val, F32), _ROW, p, d) for val in (-jnp.inf, 0.0, 0.0, 0.0))
  t_lo = j * tps
  t_hi = jnp.minimum(t_lo + tps, nvt)
  st = lax.fori_loop(t_lo, t_hi, tile, init)
  for k in range(4):
    st_smem[k] = st[k]
  plgpu.commit_smem()
  for k in range(4):
    plgpu.copy_smem_to_gmem(st_smem.at[k], st_ref.at[k, j, pl.ds(r0, bt)])
  plgpu.wait_smem_to_gmem(0)


def _store_tile(zc, m, o_smem, m_smem, zb_ref, mt_ref, r0, c0, nominal, bt: int, bv: int):
  """Fast forward: writes the tile's :func:`shifted_logits` (input dtype) and its row max through SMEM + TMA.

  ``c0`` is the tile's first column, ``nominal`` the first column its CTA tile counts. With V a multiple of
  ``block_v`` (see :func:`_prepare`) a tile is either all new (stored) or all overlap of the clamped last window
  (skipped), so every column is stored once, by a tile aligned to ``block_v``: column ``q``'s max is row
  ``q // block_v`` of ``mt``. The SMEM buffers are reused by the next tile: wait until the previous tile's
  copies have read them.
  """
  @pl.when(c0 >= nominal)
  def _():
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    o_smem[...] = shifted_logits(zc, m).astype(o_smem.dtype)
    m_smem[...] = jnp.where(m == -jnp.inf, 0.0, m)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, zb_ref.at[pl.ds(r0, bt), pl.ds(c0, bv)])
    plgpu.copy_smem_to_gmem(m_smem, mt_ref.at[c0 // bv, pl.ds(r0, bt)])


def _kernel(body, out_type, scratch, grid, names, d: _Dims, p: Plan, name: str):
  params = plgpu.CompilerParams(
      lowering_semantics=plgpu.LoweringSemantics.Lane if p.semantics == "lane"
      else plgpu.LoweringSemantics.Warpgroup)
  return plgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=grid, grid_names=names,
                      compiler_params=params, interpret=plgpu.InterpretGPUParams() if d.interpret else False,
                      )


def _out_types(d: _Dims, p: Plan, nparts: int, dtype):
  out = [jax.ShapeDtypeStruct((4, nparts, d.b), F32)]
  if d.store:
    out += [jax.ShapeDtypeStruct((d.b, d.vp), dtype), jax.ShapeDtypeStruct((d.vp // p.block_v, d.b), F32)]
  return tuple(out)


def _merge_parts(st, labels, opts) -> _math.TokenOut:
  acc = _math.RowStats(*(a[0] for a in st))
  for k in range(1, st.shape[1]):
    acc = _math.merge_stats(acc, _math.RowStats(*(a[k] for a in st)))
  return _math.finalize(acc, labels, opts)


def _forward(x, w, bias, labels, d: _Dims, p: Plan, opts):
  """x [d.b, d.h], w padded as _prepare made it, labels [d.b] (padding rows -1).

  Returns (TokenOut, stored) with ``stored`` = (shifted logits [d.b, d.vp], row maxima [vp/bv, d.b]) when
  ``d.store``, else None.
  """
  nb = d.b // p.block_t
  ns = p.num_splits
  scratch = [plgpu.SMEM((p.block_t,), jnp.int32)]
  if d.has_bias:
    scratch.append(plgpu.SMEM((p.block_v,), F32))
  scratch.append(plgpu.SMEM((4, p.block_t), F32))
  if d.store:
    scratch += [plgpu.SMEM((p.block_t, p.block_v), x.dtype, transforms=_transforms(p.block_v * 2)[1]),
                plgpu.SMEM((p.block_t,), F32)]
  scratch.append(plgpu.Barrier(num_barriers=2))
  kern = _kernel(functools.partial(_fwd_body, d=d, p=p, opts=opts), _out_types(d, p, ns, x.dtype), scratch,
                 (ns, nb), ("split", "row"), d, p, "lce_mosaic_forward")
  st, *stored = kern(*([x, w] + ([bias] if d.has_bias else []) + [labels]))
  return _merge_parts(st, labels, opts), (tuple(stored) if d.store else None)


def _dz_body(*refs, d: _Dims, p: Plan, opts: _math.LossOptions):
  """One [block_t, block_v] tile of the logit gradient of the chunk handed in as ``w_ref``."""
  if d.has_bias:
    (x_ref, w_ref, b_ref, y_ref, lse_ref, coef_ref, a_ref, c_ref, dz_ref, vec_smem, y_smem, b_smem, o_smem,
     bars) = refs
  else:
    x_ref, w_ref, y_ref, lse_ref, coef_ref, a_ref, c_ref, dz_ref, vec_smem, y_smem, o_smem, bars = refs
    b_ref = b_smem = None
  bt, bv = p.block_t, p.block_v
  t = lax.axis_index("tile")
  i = lax.axis_index("row")
  r0 = i * bt
  c0 = t * bv
  rows = pl.ds(r0, bt)
  pairs = [(y_ref.at[rows], y_smem)] + [(ref.at[rows], vec_smem.at[k])
                                        for k, ref in enumerate((lse_ref, coef_ref, a_ref, c_ref))]
  if d.has_bias:
    pairs.append((b_ref.at[pl.ds(c0, bv)], b_smem))
  _fetch(pairs, bars)
  shape = (bt, bv)
  z = _logit_tile(x_ref.at[rows], _w_window(w_ref, c0, bv, d), d, p)
  if d.has_bias:
    z = z + _cols(_load_vec(b_smem, _COL, p, d), shape)
  labels = _load_vec(y_smem, _ROW, p, d)  # already shifted to chunk-local column ids
  lse, coef, a, c = (_load_vec(vec_smem.at[k], _ROW, p, d) for k in range(4))
  cols = _iota(shape, 1, p, d) + c0
  dz = epilogue_dlogits(z, cols, labels, lse, coef, a, c, opts)
  o_smem[...] = dz.astype(o_smem.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(o_smem, dz_ref.at[rows, pl.ds(c0, bv)])
  plgpu.wait_smem_to_gmem(0)


def _dz_chunk(x, w_c, b_c, labels_local, lse, coef, a, c, d: _Dims, p: Plan, opts):
  """dz [d.b, width] (x.dtype) of the chunk whose head columns are ``w_c`` (width a multiple of block_v)."""
  width = w_c.shape[0] if d.w_layout == "vh" else w_c.shape[1]
  nb = d.b // p.block_t
  nct = width // p.block_v
  _, otr = _transforms(p.block_v * 2)
  scratch = [plgpu.SMEM((4, p.block_t), F32), plgpu.SMEM((p.block_t,), jnp.int32)]
  if d.has_bias:
    scratch.append(plgpu.SMEM((p.block_v,), F32))
  scratch += [plgpu.SMEM((p.block_t, p.block_v), x.dtype, transforms=otr),
              plgpu.Barrier(num_barriers=6 if d.has_bias else 5)]
  kern = _kernel(functools.partial(_dz_body, d=d, p=p, opts=opts), jax.ShapeDtypeStruct((d.b, width), x.dtype),
                 scratch, (nct, nb), ("tile", "row"), d, p, "lce_mosaic_dz")
  return kern(*([x, w_c] + ([b_c] if d.has_bias else []) + [labels_local, lse, coef, a, c]))


# ------------------------------------------------------------------------------- warp-specialised kernels (GPU)
# CTA tile block_t × 2·block_v: compute warpgroup g ∈ {0, 1} owns columns [g·bv, (g+1)·bv) of the tile and its own
# accumulator; warpgroup 2 only issues TMA copies (jax's emit_pipeline_warp_specialized). While one compute
# warpgroup runs its epilogue the other keeps the tensor cores busy. Code outside the pipeline runs in all three
# warpgroups, so everything that touches per-warpgroup state sits under ``pl.when(wg < 2)`` or in the compute
# context.


def _ws_pipeline(d: _Dims, p: Plan, stages: int):
  bt, bv, bk = p.block_t, p.block_v, p.block_k
  _, tr = _transforms(bk * 2)
  x_spec = plgpu.BlockSpec((bt, bk), lambda k: (0, k), transforms=tr, memory_space=plgpu.SMEM)
  if d.w_layout == "vh":
    w_spec = plgpu.BlockSpec((2 * bv, bk), lambda k: (0, k), transforms=tr, memory_space=plgpu.SMEM)
  else:
    w_spec = plgpu.BlockSpec((bk, 2 * bv), lambda k: (k, 0), transforms=_transforms(bv * 2)[1],
                             memory_space=plgpu.SMEM)

  def make(body, ctx):
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(d.h // bk,), memory_registers=40, in_specs=[x_spec, w_spec], wg_axis="wg", num_compute_wgs=2,
        max_concurrent_steps=stages, compute_context=ctx)

  def mma(_, xs, ws, acc_ref):
    g = lax.axis_index("wg")
    if d.w_layout == "vh":
      plgpu.wgmma(acc_ref, xs, ws.at[pl.ds(g * bv, bv)].transpose((1, 0)))
    else:
      plgpu.wgmma(acc_ref, xs, ws.at[:, pl.ds(g * bv, bv)])
    plgpu.wgmma_wait(0)
    return acc_ref

  return make, mma


def _w_window_ws(w_ref, c0, d: _Dims, p: Plan):
  return _w_window(w_ref, c0, 2 * p.block_v, d)


def _fwd_ws_body(*refs, d: _Dims, p: Plan, opts: _math.LossOptions):
  x_ref, w_ref, b_ref, y_ref, st_ref, zb_ref, mt_ref = _fwd_gmem_refs(list(refs), d)
  bt, bv, ns = p.block_t, p.block_v, p.num_splits
  cv = 2 * bv
  nvt = _cdiv(d.vp, cv)
  tps = _cdiv(nvt, ns)
  j = lax.axis_index("split")
  i = lax.axis_index("row")
  r0 = i * bt
  x_rows = x_ref.at[pl.ds(r0, bt)]
  # the stored tiles take 2·bt·bv·itemsize bytes of SMEM: one pipeline stage fewer (as in the dz kernel)
  make, mma = _ws_pipeline(d, p, max(2, p.num_stages - 1) if d.store else p.num_stages)
  ignore = lambda *_, **__: None
  shape = (bt, bv)

  def scope(allocs, st_smem, y_smem, b_smem, o_smem, m_smem, bars):
    g = lax.axis_index("wg")

    @pl.when(g < 2)
    def _init():
      plgpu.copy_gmem_to_smem(y_ref.at[pl.ds(r0, bt)], y_smem.at[g], bars.at[g])
      plgpu.barrier_wait(bars.at[g])
      st_smem[g, 0] = jnp.full((bt,), -jnp.inf, F32)
      for k in range(1, 4):
        st_smem[g, k] = jnp.zeros((bt,), F32)

    def tile(t, _):
      nominal = t * cv
      c0 = jnp.minimum(nominal, d.vp - cv)

      def ctx(eval_pipeline):
        g = lax.axis_index("wg")
        c0g = c0 + g * bv
        if d.has_bias:
          plgpu.copy_gmem_to_smem(b_ref.at[pl.ds(c0g, bv)], b_smem.at[g], bars.at[2 + g])

        def acc_scope(acc_ref):
          eval_pipeline(acc_ref)
          z = acc_ref[...]
          if d.has_bias:
            plgpu.barrier_wait(bars.at[2 + g])
            z = z + _cols(b_smem[g], shape)
          cols = lax.broadcasted_iota(jnp.int32, shape, 1) + c0g
          valid = (cols >= nominal) & (cols < d.v)
          zc = _math.softcap(z, opts.logit_softcap)
          new = epilogue_stats(zc, cols, valid, y_smem[g], opts)
          if d.store:
            _store_tile(zc, new.m, o_smem.at[g], m_smem.at[g], zb_ref, mt_ref, r0, c0g, nominal, bt, bv)
          old = _math.RowStats(*(st_smem[g, k] for k in range(4)))
          st = merge(old, new)
          for k in range(4):
            st_smem[g, k] = st[k]

        pl.run_scoped(acc_scope, plgpu.ACC(shape, F32))

      make(mma, ctx)(x_rows, _w_window_ws(w_ref, c0, d, p), allocations=allocs)
      return 0

    lax.fori_loop(j * tps, jnp.minimum(j * tps + tps, nvt), tile, 0)

    @pl.when(g < 2)
    def _store():
      plgpu.commit_smem()
      for k in range(4):
        plgpu.copy_smem_to_gmem(st_smem.at[g, k], st_ref.at[k, 2 * j + g, pl.ds(r0, bt)])
      plgpu.wait_smem_to_gmem(0)

  w_tmpl = _w_window_ws(w_ref, 0, d, p)
  pl.run_scoped(scope, make(ignore, ignore).get_allocations(x_rows, w_tmpl),
                plgpu.SMEM((2, 4, bt), F32), plgpu.SMEM((2, bt), jnp.int32),
                plgpu.SMEM((2, bv), F32) if d.has_bias else None,
                plgpu.SMEM((2, bt, bv), x_ref.dtype, transforms=_transforms(bv * 2)[1]) if d.store else None,
                plgpu.SMEM((2, bt), F32) if d.store else None,
                plgpu.Barrier(num_barriers=4), collective_axes="wg")


def _forward_ws(x, w, bias, labels, d: _Dims, p: Plan, opts):
  """Warp-specialised :func:`_forward` (same outputs)."""
  nb = d.b // p.block_t
  ns = p.num_splits
  kern = plgpu.kernel(
      functools.partial(_fwd_ws_body, d=d, p=p, opts=opts),
      out_type=_out_types(d, p, 2 * ns, x.dtype), grid=(ns, nb), grid_names=("split", "row"),
      num_threads=3, thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
  st, *stored = kern(*([x, w] + ([bias] if d.has_bias else []) + [labels]))
  return _merge_parts(st, labels, opts), (tuple(stored) if d.store else None)


def _dz_ws_body(*refs, d: _Dims, p: Plan, opts: _math.LossOptions, width: int):
  """The logit gradient of the chunk handed in as ``w_ref`` ([d.b, width]), tile pair by tile pair.

  Persistent: one CTA per SM walks the (row block, tile pair) grid with ``plgpu.nd_loop``, tile pairs fastest, so
  the CTAs in flight share a few row blocks of x and the chunk of w stays in L2; each tile's dz store (SMEM → TMA)
  drains while the next tile's MMAs run (the SMEM buffer is only rewritten once the previous copy has read it).
  H100, llama3-8b, one chunk of 2048 columns: 0.316 ms against 0.364 ms with one CTA per tile pair
  (``benchmarks/results/pallas_mosaic_lean_persistent_h100_2026-11-23.json``).
  """
  if d.has_bias:
    x_ref, w_ref, b_ref, y_ref, lse_ref, coef_ref, a_ref, c_ref, dz_ref = refs
  else:
    x_ref, w_ref, y_ref, lse_ref, coef_ref, a_ref, c_ref, dz_ref = refs
    b_ref = None
  bt, bv = p.block_t, p.block_v
  # the two dz output tiles take 2·bt·bv·2 bytes of SMEM: one pipeline stage fewer than the forward
  make, mma = _ws_pipeline(d, p, max(2, p.num_stages - 1))
  ignore = lambda *_, **__: None
  shape = (bt, bv)
  nvec = 5 + d.has_bias

  def scope(allocs, vec_smem, y_smem, b_smem, o_smem, bars):
    @plgpu.nd_loop((d.b // bt, width // (2 * bv)), collective_axes="sm")
    def _tile(info):
      i, t = info.index
      rows = pl.ds(i * bt, bt)
      c0 = t * 2 * bv

      def ctx(eval_pipeline):
        g = lax.axis_index("wg")
        c0g = c0 + g * bv
        pairs = [(y_ref.at[rows], y_smem.at[g])] + [
            (ref.at[rows], vec_smem.at[g, k]) for k, ref in enumerate((lse_ref, coef_ref, a_ref, c_ref))]
        if d.has_bias:
          pairs.append((b_ref.at[pl.ds(c0g, bv)], b_smem.at[g]))
        for k, (src, dst) in enumerate(pairs):  # lands while the MMAs run
          plgpu.copy_gmem_to_smem(src, dst, bars.at[g * nvec + k])

        def acc_scope(acc_ref):
          eval_pipeline(acc_ref)
          z = acc_ref[...]
          for k in range(len(pairs)):
            plgpu.barrier_wait(bars.at[g * nvec + k])
          if d.has_bias:
            z = z + _cols(b_smem[g], shape)
          cols = lax.broadcasted_iota(jnp.int32, shape, 1) + c0g
          lse, coef, a, c = (vec_smem[g, k] for k in range(4))
          dz = epilogue_dlogits(z, cols, y_smem[g], lse, coef, a, c, opts)
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's copy has read o_smem[g]
          o_smem[g] = dz.astype(o_smem.dtype)
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(o_smem.at[g], dz_ref.at[rows, pl.ds(c0g, bv)])

        pl.run_scoped(acc_scope, plgpu.ACC(shape, F32))

      make(mma, ctx)(x_ref.at[rows], _w_window_ws(w_ref, c0, d, p), allocations=allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # SMEM stays allocated until the last copy has read it

  _, otr = _transforms(bv * 2)
  pl.run_scoped(scope, make(ignore, ignore).get_allocations(x_ref.at[pl.ds(0, bt)], _w_window_ws(w_ref, 0, d, p)),
                plgpu.SMEM((2, 4, bt), F32), plgpu.SMEM((2, bt), jnp.int32),
                plgpu.SMEM((2, bv), F32) if d.has_bias else None,
                plgpu.SMEM((2, bt, bv), dz_ref.dtype, transforms=otr),
                plgpu.Barrier(num_barriers=2 * nvec), collective_axes="wg")


def _dz_chunk_ws(x, w_c, b_c, labels_local, lse, coef, a, c, d: _Dims, p: Plan, opts):
  width = w_c.shape[0] if d.w_layout == "vh" else w_c.shape[1]
  tiles = (d.b // p.block_t) * (width // (2 * p.block_v))
  kern = plgpu.kernel(
      functools.partial(_dz_ws_body, d=d, p=p, opts=opts, width=width),
      out_type=jax.ShapeDtypeStruct((d.b, width), x.dtype), grid=(min(_num_sms(), tiles),), grid_names=("sm",),
      num_threads=3, thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
  return kern(*([x, w_c] + ([b_c] if d.has_bias else []) + [labels_local, lse, coef, a, c]))


# ------------------------------------------------------------------------------------------------ custom_vjp


def _prepare(x, w, bias, labels, spec: common.Spec, p: Plan, store: bool = False):
  """Pads tokens to whole row blocks (and, only where unavoidable, H and V); bias to float32.

  TMA tiles the whole GMEM array: V must be a multiple of 8 rows ("vh") or of the 64-column swizzle ("hv"). The
  fast forward (``store``) also needs whole ``block_v`` tiles, so that every stored tile is aligned and no two
  overlap (true of the LLM heads: 50304, 128256, 151936 and 256000 are multiples of 128).
  """
  b, h = x.shape
  v = spec.opts.vocab_size
  bp = _cdiv(b, p.block_t) * p.block_t
  hp = _cdiv(h, p.block_k) * p.block_k
  cta_v = p.block_v * (2 if p.warp_specialized else 1)
  # A bias makes it 64 columns either way: the lean backward hands each chunk's bias slice to the dz kernel, and
  # XLA passes a slice as an offset into the same buffer, which Mosaic GPU wants 256-byte aligned (the clamped
  # last chunk starts at vp - chunk: a multiple of 64 floats only if vp is).
  mult = p.block_v if store else (64 if spec.w_layout == "hv" or bias is not None else 8)
  vp = max(_cdiv(v, mult) * mult, cta_v)
  x = jnp.pad(x, ((0, bp - b), (0, hp - h)))
  labels = jnp.pad(labels, (0, bp - b), constant_values=_math.IGNORED)
  if hp != h or vp != v:  # small or odd problems only: this copies w
    pads = ((0, hp - h), (0, vp - v)) if spec.w_layout == "hv" else ((0, vp - v), (0, hp - h))
    w = jnp.pad(w, pads)
  if bias is not None:
    bias = jnp.pad(bias.astype(F32), (0, vp - v))
  d = _Dims(bp, hp, v, vp, spec.w_layout, bias is not None, spec.interpret, store)
  return x, w, bias, labels, d


def _run_forward(x, w, bias, labels, spec, p):
  b = x.shape[0]
  xp, wp, bp, yp, d = _prepare(x, w, bias, labels, spec, p)
  out, _ = (_forward_ws if p.warp_specialized else _forward)(xp, wp, bp, yp, d, p, spec.opts)
  return _math.TokenOut(*(a[:b] for a in out))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _lean(x, w, bias, labels, spec, p):
  return _run_forward(x, w, bias, labels, spec, p)


def _lean_fwd(x, w, bias, labels, spec, p):
  out = _run_forward(x, w, bias, labels, spec, p)
  return out, (x, w, bias, labels, out.lse)


def _lean_bwd(spec, p, res, g):
  x, w, bias, labels, lse = res
  opts = spec.opts
  b, h = x.shape
  v = opts.vocab_size
  xp, wp, bp, yp, d = _prepare(x, w, bias, labels, spec, p)
  pad = d.b - b
  coef, a, c = row_coefficients(lse, labels, g.loss, g.lse, opts)
  # Padding rows: lse = +inf makes p = 0, and zero coefficients keep them at dz = 0 exactly.
  lse_p = jnp.pad(lse, (0, pad), constant_values=jnp.inf)
  coef, a, c = (jnp.pad(t, (0, pad)) for t in (coef, a, c))
  vaxis = spec.vocab_axis
  cw = p.chunk_size
  n_full = d.vp // cw
  tail = d.vp - n_full * cw

  def step(start, lo, carry):
    """Chunk of columns [start, start + cw); its first ``lo`` columns were done by the previous chunk."""
    dx, dw, db = carry
    w_c = common.slice_vocab(wp, start, cw, spec.w_layout)
    b_c = None if bp is None else lax.dynamic_slice_in_dim(bp, start, cw)
    local = jnp.where(yp >= 0, yp - start, -1)  # chunk-local target column (-1: none)
    dz = (_dz_chunk_ws if p.warp_specialized else _dz_chunk)(xp, w_c, b_c, local, lse_p, coef, a, c, d, p, opts)
    # dw's columns are complete after this one matmul (overlap columns get the same values again).
    dw = lax.dynamic_update_slice_in_dim(dw, common.grad_w(xp, dz, spec.w_layout).astype(dw.dtype), start, vaxis)
    if db is not None:
      db = lax.dynamic_update_slice_in_dim(db, jnp.sum(dz.astype(F32), axis=0), start, 0)
    if lo:  # overlap columns must not reach dx twice
      keep = jnp.arange(cw) >= lo
      w_c = jnp.where(keep[None, :] if spec.w_layout == "hv" else keep[:, None], w_c, 0)
    dx = dx + common.grad_x(dz, w_c, spec.w_layout)
    return dx, dw, db

  carry = (jnp.zeros(xp.shape, F32), jnp.zeros_like(wp), None if bp is None else jnp.zeros(bp.shape, F32))
  if n_full:
    carry = lax.fori_loop(0, n_full, lambda k, cr: step(k * cw, 0, cr), carry)
  if tail:
    carry = step(d.vp - cw, n_full * cw - (d.vp - cw), carry)
  dx, dw, db = carry
  dx = dx[:b, :h].astype(x.dtype)
  dw = dw[:h, :v] if spec.w_layout == "hv" else dw[:v, :h]
  return dx, dw.astype(w.dtype), None if bias is None else db[:v].astype(bias.dtype), None


_lean.defvjp(_lean_fwd, _lean_bwd)


def lean(x, w, bias, labels, spec: common.Spec, config: Config | None = None) -> _math.TokenOut:
  """Per-token loss, lse and correctness; differentiable in x, w and bias with any cotangent on loss and lse.

  bf16/fp16 inputs run the kernels. Other inputs (fp32) follow ``config.fp32_inputs``: by default the exact
  chunked implementation, or (``"bf16"``) the kernels on bf16-rounded x and w, gradients returned in fp32.
  """
  config = config or Config()
  fp32 = config.fp32_inputs or "chunked"
  if fp32 not in ("chunked", "bf16"):
    raise ValueError(f"fp32_inputs={fp32!r} must be 'chunked' or 'bf16'")
  p = plan(x.shape[0], x.shape[1], spec.opts.vocab_size, config, spec.interpret)
  if x.dtype not in (jnp.bfloat16, jnp.float16) or w.dtype != x.dtype:
    if fp32 == "chunked":
      from lce_flax._impl import chunked  # pylint: disable=g-import-not-at-top
      return chunked.lean(x, w, bias, labels, spec, chunked.Config())
    x, w = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  return _lean(x, w, bias, labels, spec, p)


# ------------------------------------------------------------------------------------------------ fast mode
# 6·B·H·V: the forward kernel also stores every logit tile (shifted by its row max, in the input dtype) and its
# row maxima; once lse is known, one elementwise kernel (:func:`_dz_pass`) turns the stored tiles into dz in place.
# Two designs:
#
# * "logits": all B tokens at once. The buffer is B×V in the input dtype (+ B·V/bv float32 maxima); the backward
#   forms dx = dz wᵀ and dw = xᵀ dz as two whole matmuls (the largest, most efficient shapes the problem has; no
#   accumulation across chunks: every product accumulates in float32 inside one matmul).
# * "tokens": chunks of c tokens (a c×V buffer); each chunk's dx rows are complete at once and its xᵀdz adds into
#   an H×V float32 dw: the choice when H·V·4 + c·V·2 is smaller than B·V·2 (small H, many tokens: gpt2-small).


def _dz_pass_body(zb_ref, mt_ref, lse_ref, y_ref, coef_ref, a_ref, c_ref, o_ref, *db_ref, opts, v: int):
  """One [bt, bv] block of stored tiles → dz, in place (Pallas Triton on the GPU; interpreted on CPU)."""
  bt, bv = zb_ref.shape
  j = pl.program_id(1)
  shape = (bt, bv)
  zc = zb_ref[...].astype(F32) + _rows(mt_ref[0, :], shape)
  cols = lax.broadcasted_iota(jnp.int32, shape, 1) + j * bv
  dz = dlogits_capped(zc, cols, y_ref[...], lse_ref[...], coef_ref[...], a_ref[...], c_ref[...], opts)
  dz = jnp.where(cols < v, dz, 0.0)
  o_ref[...] = dz.astype(o_ref.dtype)
  if db_ref:
    db_ref[0][0, :] = dz.sum(axis=0)


def _dz_pass(zb, mt, lse, yp, coef, a, c, d: _Dims, p: Plan, opts):
  """dz from the stored tiles, written over them (``input_output_aliases``: no second B×V buffer), and the
  column sums for dbias. An elementwise Pallas kernel, so that XLA can neither keep both buffers nor fuse this
  pass into the two matmuls that read dz (which it does at some shapes, then holding zb and dz at once)."""
  from jax.experimental.pallas import triton as pltriton  # pylint: disable=g-import-not-at-top
  bt, bv = p.block_t, p.block_v
  grid = (d.b // bt, d.vp // bv)
  vec = pl.BlockSpec((bt,), lambda i, j: (i,))
  out_shape = [jax.ShapeDtypeStruct(zb.shape, zb.dtype)]
  out_specs = [pl.BlockSpec((bt, bv), lambda i, j: (i, j))]
  if d.has_bias:
    out_shape.append(jax.ShapeDtypeStruct((grid[0], d.vp), F32))
    out_specs.append(pl.BlockSpec((1, bv), lambda i, j: (i, j)))
  out = pl.pallas_call(
      functools.partial(_dz_pass_body, opts=opts, v=opts.vocab_size), grid=grid,
      in_specs=[pl.BlockSpec((bt, bv), lambda i, j: (i, j)), pl.BlockSpec((1, bt), lambda i, j: (j, i)),
                vec, vec, vec, vec, vec],
      out_specs=out_specs, out_shape=out_shape, input_output_aliases={0: 0}, interpret=d.interpret,
      compiler_params=None if d.interpret else pltriton.CompilerParams(num_warps=4, num_stages=1),
      name="lce_mosaic_dz_pass",
  )(zb, mt, lse, yp, coef, a, c)
  return out[0], (out[1].sum(axis=0) if d.has_bias else None)


def _stored_dz(xp, wp, bp, yp, wts, d: _Dims, p: Plan, opts):
  """Forward kernel with stores + the dz pass over rows ``xp``: (TokenOut, dz [rows, vp] in x's dtype, dbias)."""
  out, (zb, mt) = (_forward_ws if p.warp_specialized else _forward)(xp, wp, bp, yp, d, p, opts)
  coef, a, c = row_coefficients(out.lse, yp, wts, jnp.zeros_like(wts), opts)
  dz, db = _dz_pass(zb, mt, out.lse, yp, coef, a, c, d, p, opts)
  return out, dz, db


def _fast_forward(x, w, bias, labels, weights, spec: common.Spec, p: Plan, chunk: int | None):
  """(Σ weights·loss, TokenOut, residuals): ``chunk`` None is the "logits" design, else "tokens" with that many
  tokens per chunk (a multiple of block_t)."""
  opts = spec.opts
  b = x.shape[0]
  xp, wp, bp, yp, d = _prepare(x, w, bias, labels, spec, p, store=True)
  wts = jnp.pad(weights.astype(F32), (0, d.b - b))  # padding rows: weight 0 (and label -1): dz = 0
  if chunk is None:
    out, dz, db = _stored_dz(xp, wp, bp, yp, wts, d, p, opts)
    res = (dz, xp, wp, None, None, db)
  else:
    n = _cdiv(d.b, chunk)
    pad = n * chunk - d.b
    xs = jnp.pad(xp, ((0, pad), (0, 0))).reshape(n, chunk, d.h)
    ys = jnp.pad(yp, (0, pad), constant_values=_math.IGNORED).reshape(n, chunk)
    ws = jnp.pad(wts, (0, pad)).reshape(n, chunk)
    dc = dataclasses.replace(d, b=chunk)

    def body(carry, rows):
      dw, db = carry
      xc, yc, wc = rows
      out, dz, dbc = _stored_dz(xc, wp, bp, yc, wc, dc, p, opts)
      dw = dw + common.grad_w(xc, dz, spec.w_layout)
      return (dw, None if db is None else db + dbc), (common.grad_x(dz, wp, spec.w_layout, out_dtype=xp.dtype), out)

    init = (jnp.zeros(wp.shape, F32), None if bp is None else jnp.zeros(bp.shape, F32))
    (dw, db), (dx, out) = lax.scan(body, init, (xs, ys, ws))
    out = jax.tree.map(lambda t: t.reshape(n * chunk), out)
    res = (None, None, None, dx.reshape(n * chunk, d.h), dw, db)
  out = _math.TokenOut(*(t[:b] for t in out))
  total = jnp.sum(weights.astype(F32) * out.loss)
  return total, out, res


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _fast(x, w, bias, labels, weights, spec, p, chunk, meta):
  del meta  # (H, bias dtype): what the backward needs to undo _prepare's padding
  total, out, _ = _fast_forward(x, w, bias, labels, weights, spec, p, chunk)
  return total, out


def _fast_fwd(x, w, bias, labels, weights, spec, p, chunk, meta):
  del meta
  # symbolic_zeros=True wraps each array argument in a CustomVJPPrimal (None stays None).
  total, out, res = _fast_forward(x.value, w.value, None if bias is None else bias.value, labels.value,
                                  weights.value, spec, p, chunk)
  return (total, out), (res, labels.value)


def _fast_bwd(spec, p, chunk, meta, residuals, g):
  del p, chunk
  (dz, xp, wp, dx, dw, db), labels = residuals
  g_total, g_out = g
  common.check_fast_cotangents(g_out)
  gt = g_total.astype(F32)
  (h, bias_dtype), b, v = meta, labels.shape[0], spec.opts.vocab_size
  scale = lambda t, dtype: (t.astype(F32) * gt).astype(dtype)
  if dz is not None:  # "logits": the two matmuls now
    # The cotangent enters dw through x (exact when it is 1, as for a loss): the matmul writes dw in its final
    # dtype, with no H×V float32 product.
    dw = common.grad_w(scale(xp, xp.dtype), dz, spec.w_layout, out_dtype=wp.dtype)
    dx = scale(common.grad_x(dz, wp, spec.w_layout), xp.dtype)
  else:  # "tokens": formed in the forward (x and w share the kernels' dtype)
    dx, dw = scale(dx, dx.dtype), scale(dw, dx.dtype)
  dw = dw[:h, :v] if spec.w_layout == "hv" else dw[:v, :h]
  dbias = None if db is None else scale(db, bias_dtype)[:v]
  return dx[:b, :h], dw, dbias, None, None


_fast.defvjp(_fast_fwd, _fast_bwd, symbolic_zeros=True)


TOKEN_CHUNK_MIN = 4096


def token_chunk(num_tokens: int, hidden: int, block_t: int = 128) -> int:
  """Tokens per chunk of the "tokens" design: a c×V buffer about the size of the H×V float32 dw it adds into
  (c ≈ 2H), but at least ``TOKEN_CHUNK_MIN`` tokens, which keeps the chunk's matmuls at the matmul rate (H100,
  gpt2-small: 1024 tokens 12.6 ms / 0.27 GB, 2048 11.5 / 0.38, 4096 9.7 / 0.58, 8192 9.1 / 1.01; the whole-batch
  "logits" design 9.0 / 1.68), and at most half the tokens; a power of two and a multiple of ``block_t``."""
  return max(block_t, _pow2_floor(min(max(2 * hidden, TOKEN_CHUNK_MIN), max(num_tokens // 2, 1))))


def fast_design(num_tokens: int, hidden: int, vocab: int, itemsize: int = 2) -> str:
  """The design with the smaller buffer: ``"logits"`` (B·V·itemsize) or ``"tokens"`` (H·V·4 of float32 dw plus a
  c×V chunk, c = :func:`token_chunk`). llama3-8b: 2.10 vs 3.15 GB, qwen3-8b 1.24 vs 3.11, gemma2-2b 4.19 vs
  4.46 (logits); gpt2-small: 1.65 vs 0.57 GB (tokens)."""
  c = token_chunk(num_tokens, hidden)
  if c >= num_tokens:
    return "logits"
  return "logits" if num_tokens * itemsize <= 4 * hidden + c * itemsize else "tokens"


FAST_DESIGNS = ("logits", "tokens", "chunked")


def fast(x, w, bias, labels, weights, spec: common.Spec, config: Config | None = None):
  """``(Σ weights·loss, TokenOut)``, differentiable in x, w, bias through the scalar only (6·B·H·V FLOPs).

  ``config.fast_design``: ``"logits"`` or ``"tokens"`` (this module's kernels, see above), ``"chunked"`` (the
  pure-JAX chunked implementation's fast design), or None: the smaller buffer (:func:`fast_design`). float32
  inputs follow ``config.fp32_inputs`` as in :func:`lean`.
  """
  from lce_flax._impl import chunked  # pylint: disable=g-import-not-at-top
  config = config or Config()
  fp32 = config.fp32_inputs or "chunked"
  if fp32 not in ("chunked", "bf16"):
    raise ValueError(f"fp32_inputs={fp32!r} must be 'chunked' or 'bf16'")
  low = x.dtype in (jnp.bfloat16, jnp.float16) and w.dtype == x.dtype
  design = config.fast_design or fast_design(x.shape[0], x.shape[1], spec.opts.vocab_size)
  if design not in FAST_DESIGNS:
    raise ValueError(f"fast_design={design!r} must be one of {FAST_DESIGNS}")
  if design == "chunked" or (not low and fp32 == "chunked"):
    return chunked.fast(x, w, bias, labels, weights, spec, chunked.Config())
  if not low:
    x, w = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  p = plan(x.shape[0], x.shape[1], spec.opts.vocab_size, dataclasses.replace(config, chunk_size=None),
           spec.interpret)
  chunk = None
  if design == "tokens":
    chunk = config.chunk_size or token_chunk(x.shape[0], x.shape[1], p.block_t)
    if chunk % p.block_t:
      raise ValueError(f"chunk_size={chunk} (tokens per chunk of the 'tokens' fast design) must be a multiple of "
                       f"block_t={p.block_t}")
  return _fast(x, w, bias, labels, weights, spec, p, chunk, (x.shape[1], None if bias is None else bias.dtype))
