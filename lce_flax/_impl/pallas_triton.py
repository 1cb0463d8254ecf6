"""``impl="pallas_triton"``: Pallas kernels lowered through Triton, for NVIDIA GPUs from SM80 (A100, H100).

On a machine without a GPU the same kernels run in Pallas interpret mode (``spec.interpret``), which is how the
CPU test-suite checks them.

Forward (one kernel, O(B) output)
  A 1-D grid of ``num_row_blocks × num_splits`` programs. Program ``(i, j)`` owns the ``block_t`` tokens of row
  block ``i`` and the ``j``-th contiguous split of the vocabulary tiles. It walks its split one ``[block_t,
  block_v]`` logit tile at a time; each tile is accumulated in float32 registers over H in ``block_k`` steps
  (``x[rows, k:k+bk] @ w[k:k+bk, cols]``), gets its bias and soft cap, and is reduced on chip by
  :func:`lce_flax._math.tile_stats` and merged into the row's running :class:`~lce_flax._math.RowStats` (online
  logsumexp). Only the split's partial stats leave the chip: 4 float32 per token and split (≤ 1 MB at llama3-8b).
  A tiny JAX step merges the splits (:func:`~lce_flax._math.merge_stats`) and finalises the loss.

  The program index is split *split-fastest* (``pid = i·S + j``), so the ~132 programs resident at once share a
  handful of row blocks and cover the whole vocabulary between them. HBM traffic with ``R`` resident row blocks
  (≈ #SMs / S): x is read about once (its resident blocks, R·block_t·H·2 bytes, stay in L2 while the vocabulary
  streams past), w is read ``B / (R·block_t)`` times: ``H·V·2·B/(R·block_t)`` bytes. At llama3-8b (block_t=128,
  S=8, so R≈16) that is 1 GB × 4 = 4 GB (≈ 1.3 ms at 3.3 TB/s) against 8.6 TFLOP of matmul (≈ 13 ms): the
  forward is matmul-bound. Larger ``block_t``·``block_v`` raise the arithmetic intensity of the on-chip product
  (``block_t·block_v / (block_t + block_v)`` FLOP per loaded byte per k-step) at the price of registers: the
  default 128×256×64 (bf16, 8 warps) is Triton's usual Hopper matmul tile; fp32 inputs halve ``block_v`` and
  ``block_k`` to fit shared memory.

Backward (recompute; no B×V array)
  ``jax.custom_vjp`` keeps x, w, bias, labels and the [B] lse. The backward walks the vocabulary in chunks of
  ``chunk_size`` columns. Per chunk a Pallas kernel recomputes the chunk's logits tile by tile (same tiling as the
  forward, grouped tile order for L2 reuse), turns them into the logit gradient with
  :func:`lce_flax._math.dlogits` and writes ``dz`` [B, chunk] in the input dtype (and, with a bias, per row
  block column sums for ``dbias`` in float32). Then ``dw[:, chunk] = xᵀ dz`` by one XLA matmul (complete: the
  reduction over B happens inside it, so dw's columns are written once, never accumulated), and
  ``dx += dz w[:, chunk]ᵀ`` into a float32 accumulator by an XLA matmul and an add (default), or in place by a
  second Pallas kernel (``dx_kernel=True``: no second B×H float32 buffer, but slower than cuBLAS).
  Extra memory (H100, compiled temp): llama3-8b 286 MB = float32 dx (B·H·4 = 128 MB) + XLA's float32 product
  (128 MB) + ``dz`` (B·chunk·itemsize = 32 MB with the default chunk of 2048); 196 MB with ``dx_kernel=True``.
  112–134 MB at gpt2-small, qwen3-8b, gemma2-2b. FLOPs: 2·B·H·V forward + 6·B·H·V backward.

  The float32 dx accumulator is what keeps this above 64 MB at llama3-8b. Any chunking of the backward
  accumulates one of dx (over vocabulary chunks) or dw (over token chunks) across chunks; holding neither in
  float32 means accumulating in bf16 (Liger's choice, error growing with the number of chunks) or a third
  logits pass, which ``Config(low_memory=True)`` does: the chunk loop above forms dw (and dbias) only, then
  a second loop over blocks of ``token_block`` tokens recomputes each block's logits in chunks of ``dx_chunk``
  columns and accumulates that block's dx in a float32 [token_block, H] buffer (the in-place dx kernel),
  complete before the next block; its dw pass takes half the default dz budget. FLOPs 10·B·H·V. Measured on
  the H100 (``benchmarks/results/pallas_triton_low_memory_h100_2026-11-22.json``, fwd+bwd / temp): gpt2-small
  15.9 ms / 53 MB, llama3-8b 73.7 / 42 MB, qwen3-8b 43.7 / 42 MB, gemma2-2b 95.5 / 31 MB (default: 11.5 / 118,
  59.2 / 300, 34.7 / 141, 69.0 / 128 MB).

Measured timings and the block-size sweep: ``benchmarks/NOTES_triton.md``.

Precision: every product accumulates in float32. Float32 inputs follow ``jax.default_matmul_precision`` as
JAX's own dots do: by default Pallas Triton multiplies them as TF32 on the tensor cores (H100: token-loss
relative error ~8e-5, gradients ~4e-4); under ``jax.default_matmul_precision("highest")`` they are exact
float32 (IEEE) products, at a fraction of the speed.

Ragged B, V and H are handled by masked loads and stores (``pl.ds`` windows checked against iota bounds); w is
never padded or copied.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from lce_flax import _device, _math
from lce_flax._impl import common
from lce_flax._impl.common import F32

fast = None  # api.py runs ``lean`` and reduces; the gradient comes from the recompute backward


@dataclasses.dataclass(frozen=True)
class Config:
  """Kernel configuration; ``None`` fields are chosen by :func:`plan` from the shape and the device.

  Attributes:
    block_t: tokens per tile (power of two ≥ 16).
    block_v: vocabulary columns per tile (power of two ≥ 16).
    block_k: hidden units per matmul step (power of two ≥ 16).
    num_splits: vocabulary splits of the forward grid (programs = row blocks × splits).
    chunk_size: vocabulary columns per backward chunk (the ``dz`` buffer is B × chunk_size).
    num_warps: Triton warps per program.
    num_stages: Triton software-pipelining stages of the H loop.
    group_t: row blocks per group in the backward's tile order (L2 reuse of w).
    dx_kernel: accumulate ``dx += dz·w[chunk]ᵀ`` in place with a Pallas kernel (True) or with an XLA matmul
      followed by an add (False, the default: faster, but XLA keeps a second B×H float32 buffer for the
      product).
    low_memory: a third logits pass instead of the B×H float32 dx accumulator (see the module docstring).
    token_block: tokens per block of the low-memory dx pass (a multiple of ``block_t``).
    dx_chunk: vocabulary columns per chunk of the low-memory dx pass (a multiple of ``block_v``).
  """

  block_t: int | None = None
  block_v: int | None = None
  block_k: int | None = None
  num_splits: int | None = None
  chunk_size: int | None = None
  num_warps: int | None = None
  num_stages: int | None = None
  group_t: int | None = None
  dx_kernel: bool | None = None
  low_memory: bool | None = None
  token_block: int | None = None
  dx_chunk: int | None = None


@dataclasses.dataclass(frozen=True)
class Plan:
  """A fully resolved :class:`Config` for one shape (hashable; a ``nondiff_argnums`` argument)."""

  block_t: int
  block_v: int
  block_k: int
  num_splits: int
  chunk_size: int
  num_warps: int
  num_stages: int
  group_t: int
  dx_kernel: bool
  low_memory: bool
  token_block: int
  dx_chunk: int  # vocabulary columns per chunk of the low-memory dx pass


# Budget for the backward's dz chunk (B × chunk_size in the input dtype).
DZ_CHUNK_BYTES = 32 * 2**20
# Budget for each of the low-memory dx pass's buffers (float32 dx block, dz block).
LOW_MEMORY_BLOCK_BYTES = 16 * 2**20


def _pow2_ceil(n: int) -> int:
  return 1 << max(int(n) - 1, 0).bit_length()


def _pow2_floor(n: int) -> int:
  return 1 << max(int(n).bit_length() - 1, 0)


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _num_sms() -> int:
  try:
    dev = jax.devices()[0]
    return int(getattr(dev, "core_count", 0) or 132)
  except Exception:  # no backend details: assume an H100
    return 132


def _default_splits(row_blocks: int, vocab_tiles: int, sms: int) -> int:
  """Fewest splits whose grid fills its last wave best, from one full wave up to four.

  One program per SM at the default tile (its pipelined operands take ~200 KB of shared memory), so
  ``row_blocks·S / sms`` waves run, the last one partly idle; fewer splits keep each program's vocabulary walk
  long and the partial stats small. llama3-8b (64 row blocks, 132 SMs): S=4, 1.94 waves (measured best of
  4/8/16 on H100: 15.2 vs 16.2 vs 18.0 ms).
  """
  lo = max(1, _cdiv(sms, row_blocks))
  best, best_eff = lo, 0.0
  for s in range(lo, 4 * lo + 1):
    waves = row_blocks * s / sms
    eff = waves / _cdiv(row_blocks * s, sms)
    if eff > best_eff + 1e-3:
      best, best_eff = s, eff
  return max(1, min(best, vocab_tiles, 64))


def plan(num_tokens: int, hidden: int, vocab: int, dtype, config: Config | None = None) -> Plan:
  """Block sizes for one shape: the heuristic, with any field of ``config`` taking precedence.

  * ``block_t`` 128 (fewer for tiny B: next power of two ≥ 16), ``block_v`` 256 for 2-byte inputs, 128 for
    fp32 (shared memory per stage: ``(block_t + block_v)·block_k·itemsize``), ``block_k`` 64 (32 for fp32),
    each capped at the next power of two of the dimension; 8 warps for a 128×256 tile, else 4; 3 stages
    (4 for 2-byte inputs on SM90, which has 228 KB of shared memory).
  * ``num_splits``: see :func:`_default_splits` (at least one full wave of programs, the last wave as full as
    possible), at most the number of vocabulary tiles and 64 (the partial stats stay ≤ 16·B·64 bytes).
  * ``chunk_size``: ``DZ_CHUNK_BYTES / (B·itemsize)`` rounded down to a power of two in [256, 16384] and to a
    multiple of ``block_v``.
  """
  c = config or Config()
  itemsize = jnp.dtype(dtype).itemsize
  small = itemsize <= 2
  bt = c.block_t or max(16, min(128, _pow2_ceil(num_tokens)))
  bv = c.block_v or max(16, min(256 if small else 128, _pow2_ceil(vocab)))
  bk = c.block_k or max(16, min(64 if small else 32, _pow2_ceil(hidden)))
  for name, val in (("block_t", bt), ("block_v", bv), ("block_k", bk)):
    if val < 16 or val & (val - 1):
      raise ValueError(f"{name}={val} must be a power of two >= 16 (Triton tiles)")
  nb = _cdiv(num_tokens, bt)
  nvt = _cdiv(vocab, bv)
  splits = c.num_splits or _default_splits(nb, nvt, _num_sms())
  if splits < 1:
    raise ValueError(f"num_splits={splits} must be >= 1")
  splits = min(splits, nvt)
  # low_memory: half the dz budget, so the dw pass (dz chunk) and the dx pass (two 16 MB blocks) stay ≤ 64 MB
  dz_bytes = DZ_CHUNK_BYTES // 2 if c.low_memory else DZ_CHUNK_BYTES
  chunk = c.chunk_size or min(max(_pow2_floor(dz_bytes // (itemsize * max(num_tokens, 1))), 256), 16384)
  if chunk < 1:
    raise ValueError(f"chunk_size={chunk} must be >= 1")
  chunk = _cdiv(chunk, bv) * bv  # whole tiles per chunk; the last chunk of V is ragged instead
  warps = c.num_warps or (8 if bt * bv >= 128 * 256 else 4)
  cc = _device.compute_capability()
  stages = c.num_stages or (4 if small and cc is not None and cc >= (9, 0) else 3)
  group = c.group_t or 8
  # XLA's matmul + add measured faster than the in-place dx kernel at all four anchor shapes (H100: llama3-8b
  # 58.8 vs 63.9 ms fwd+bwd), at 90 MB more temp memory there (286 vs 196 MB); the low-memory path needs the kernel.
  dx_kernel = False if c.dx_kernel is None else bool(c.dx_kernel)
  low = bool(c.low_memory)
  # Low-memory dx pass: a float32 [token_block, H] accumulator and a [token_block, dx_chunk] dz of ~16 MB each.
  tb = c.token_block or max(bt, _pow2_floor(LOW_MEMORY_BLOCK_BYTES // (4 * max(hidden, 1))))
  tb = _cdiv(min(tb, _cdiv(num_tokens, bt) * bt), bt) * bt
  dx_chunk = c.dx_chunk or max(_pow2_floor(LOW_MEMORY_BLOCK_BYTES // (itemsize * tb)), bv)
  dx_chunk = _cdiv(dx_chunk, bv) * bv
  return Plan(bt, bv, bk, splits, chunk, warps, stages, group, dx_kernel or low, low, tb, dx_chunk)


def supported(spec: common.Spec, platform: str) -> None:
  if spec.interpret:
    return  # interpret mode runs anywhere
  if platform != "gpu":
    raise NotImplementedError(f"pallas_triton needs an NVIDIA GPU (platform={platform!r}) or interpret=True")
  cc = _device.compute_capability()
  if cc is None or cc < (8, 0):
    raise NotImplementedError(f"pallas_triton needs an NVIDIA GPU with compute capability >= 8.0, got {cc}")


# ------------------------------------------------------------------------------------------------ kernels


@dataclasses.dataclass(frozen=True)
class _Dims:
  """Static shape facts a kernel body needs."""

  b: int  # tokens
  h: int  # hidden
  v: int  # vocabulary
  w_layout: str
  has_bias: bool


def _iota(n: int):
  return lax.broadcasted_iota(jnp.int32, (n,), 0)


def _and(a, b):
  if a is None:
    return b
  if b is None:
    return a
  return a & b


def _tile_logits(x_ref, w_ref, b_ref, r0, rmask, c0, cmask, d: _Dims, p: Plan):
  """float32 ``x[r0:r0+bt] @ w[:, c0:c0+bv] (+ bias)``; ``rmask``/``cmask`` guard ragged edges (or None)."""
  bt, bv, bk = p.block_t, p.block_v, p.block_k
  nk = _cdiv(d.h, bk)
  ragged_k = d.h % bk != 0

  def kstep(kk, acc):
    k0 = kk * bk
    kmask = (k0 + _iota(bk)) < d.h if ragged_k else None
    xmask = _and(None if rmask is None else rmask[:, None], None if kmask is None else kmask[None, :])
    xt = plgpu.load(x_ref.at[pl.ds(r0, bt), pl.ds(k0, bk)], mask=xmask, other=None if xmask is None else 0.0)
    if d.w_layout == "hv":
      wmask = _and(None if kmask is None else kmask[:, None], None if cmask is None else cmask[None, :])
      wt = plgpu.load(w_ref.at[pl.ds(k0, bk), pl.ds(c0, bv)], mask=wmask, other=None if wmask is None else 0.0)
      dims = (((1,), (0,)), ((), ()))
    else:
      wmask = _and(None if cmask is None else cmask[:, None], None if kmask is None else kmask[None, :])
      wt = plgpu.load(w_ref.at[pl.ds(c0, bv), pl.ds(k0, bk)], mask=wmask, other=None if wmask is None else 0.0)
      dims = (((1,), (1,)), ((), ()))
    return acc + lax.dot_general(xt, wt, dims, preferred_element_type=F32)

  z = lax.fori_loop(0, nk, kstep, jnp.zeros((bt, bv), F32))
  if d.has_bias:
    bias = plgpu.load(b_ref.at[pl.ds(c0, bv)], mask=cmask, other=None if cmask is None else 0.0)
    z = z + bias.astype(F32)[None, :]
  return z


def _fwd_kernel(x_ref, w_ref, b_ref, y_ref, m_ref, s_ref, t_ref, zs_ref, *, d: _Dims, p: Plan, opts):
  bt, bv, ns = p.block_t, p.block_v, p.num_splits
  nb = _cdiv(d.b, bt)
  nvt = _cdiv(d.v, bv)
  tps = _cdiv(nvt, ns)  # vocabulary tiles per split
  pid = pl.program_id(0)
  i = lax.div(pid, ns)  # split-fastest order: resident programs share row blocks (see module docstring)
  j = lax.rem(pid, ns)
  r0 = i * bt
  rmask = (r0 + _iota(bt)) < d.b if d.b % bt else None
  labels = plgpu.load(y_ref.at[pl.ds(r0, bt)], mask=rmask, other=None if rmask is None else _math.IGNORED)

  def tile(t, st):
    c0 = t * bv
    cols = c0 + _iota(bv)
    cvalid = cols < d.v
    z = _tile_logits(x_ref, w_ref, b_ref, r0, rmask, c0, cvalid if d.v % bv else None, d, p)
    zc = _math.softcap(z, opts.logit_softcap)
    return _math.merge_stats(st, _math.tile_stats(zc, cols, labels, cvalid, opts))

  t_lo = j * tps
  t_hi = jnp.minimum(t_lo + tps, nvt)
  st = lax.fori_loop(t_lo, t_hi, tile, _math.empty_stats(bt))
  o = (j * nb + i) * bt  # outputs are padded to whole row blocks: no store mask
  m_ref[pl.ds(o, bt)] = st.m
  s_ref[pl.ds(o, bt)] = st.s
  t_ref[pl.ds(o, bt)] = st.target
  zs_ref[pl.ds(o, bt)] = st.zsum


def _forward(x, w, bias, labels, spec: common.Spec, p: Plan) -> _math.TokenOut:
  b, h = x.shape
  opts = spec.opts
  d = _Dims(b, h, opts.vocab_size, spec.w_layout, bias is not None)
  nb = _cdiv(b, p.block_t)
  n = p.num_splits * nb * p.block_t
  kernel = functools.partial(_fwd_kernel, d=d, p=p, opts=opts)
  if bias is None:
    kernel = _without_bias(kernel, n_in=2)
  outs = pl.pallas_call(
      kernel,
      out_shape=[jax.ShapeDtypeStruct((n,), F32)] * 4,
      grid=(nb * p.num_splits,),
      interpret=spec.interpret,
      compiler_params=plgpu.CompilerParams(num_warps=p.num_warps, num_stages=p.num_stages),
      name="lce_forward",
  )(*([x, w] + ([] if bias is None else [bias]) + [labels]))
  return merge_splits(outs, b, p, labels, opts)


def merge_splits(outs, b: int, p, labels, opts) -> _math.TokenOut:
  """Finalises the forward from the four [num_splits · row_blocks · block_t] partial-stat outputs of a kernel."""
  nb = _cdiv(b, p.block_t)
  parts = [o.reshape(p.num_splits, nb * p.block_t)[:, :b] for o in outs]
  st = _math.RowStats(*(a[0] for a in parts))
  for k in range(1, p.num_splits):
    st = _math.merge_stats(st, _math.RowStats(*(a[k] for a in parts)))
  return _math.finalize(st, labels, opts)


def _without_bias(kernel, n_in: int):
  """Adapts a kernel written as ``kernel(*refs_before_bias, b_ref, *rest)`` to calls without a bias input."""
  def wrapped(*refs):
    return kernel(*refs[:n_in], None, *refs[n_in:])
  return wrapped


def _dz_kernel(k_ref, x_ref, w_ref, b_ref, y_ref, lse_ref, gl_ref, gs_ref, dz_ref, *db_ref, d: _Dims, p: Plan,
               width: int, opts):
  """One [block_t, block_v] tile of the logit gradient of the chunk ``[off, off + width)``."""
  bt, bv = p.block_t, p.block_v
  nb = _cdiv(d.b, bt)
  nct = _cdiv(width, bv)
  # Grouped order: group_t row blocks × all tiles of the chunk are resident together, so the chunk of w and the
  # group's rows of x are read from HBM about once.
  pid = pl.program_id(0)
  per_group = p.group_t * nct
  g = lax.div(pid, per_group)
  first = g * p.group_t
  gsize = jnp.minimum(nb - first, p.group_t)
  local = lax.rem(pid, per_group)
  i = first + lax.rem(local, gsize)
  t = lax.div(local, gsize)

  # The chunk's first column as index × static chunk size (not a loaded offset): Triton then knows it is a
  # multiple of block_v and vectorises the loads of w (a loaded offset made the backward ~3× slower on H100).
  off = k_ref[0] * p.chunk_size
  r0 = i * bt
  lc0 = t * bv
  rvalid = (r0 + _iota(bt)) < d.b
  rmask = rvalid if d.b % bt else None
  lcols = lc0 + _iota(bv)
  cvalid = lcols < width
  cmask = cvalid if width % bv else None
  z = _tile_logits(x_ref, w_ref, b_ref, r0, rmask, off + lc0, cmask, d, p)
  ld = lambda ref, other: plgpu.load(ref.at[pl.ds(r0, bt)], mask=rmask, other=None if rmask is None else other)
  labels = ld(y_ref, _math.IGNORED)
  lse = ld(lse_ref, 0.0)
  g_loss = ld(gl_ref, 0.0)
  g_lse = ld(gs_ref, 0.0)
  dz = _math.dlogits(z, lse, labels, off + lcols, cvalid, g_loss, g_lse, opts)
  smask = _and(None if rmask is None else rmask[:, None], None if cmask is None else cmask[None, :])
  plgpu.store(dz_ref.at[pl.ds(r0, bt), pl.ds(lc0, bv)], dz.astype(dz_ref.dtype), mask=smask)
  if d.has_bias:
    # Padding rows may hold inf·0 = NaN (their lse is a placeholder): keep them out of the column sums.
    col_sum = jnp.sum(jnp.where(rvalid[:, None], dz, 0.0), axis=0)
    db_ref[0][pl.ds((i * nct + t) * bv, bv)] = col_sum


def _dz_chunk(k, width: int, x, w, bias, labels, lse, g_loss, g_lse, spec: common.Spec, p: Plan):
  """(dz [B, width] in x.dtype, dbias [width] float32 or None) of the columns [k·chunk, k·chunk + width)."""
  b, h = x.shape
  d = _Dims(b, h, spec.opts.vocab_size, spec.w_layout, bias is not None)
  nb = _cdiv(b, p.block_t)
  nct = _cdiv(width, p.block_v)
  kernel = functools.partial(_dz_kernel, d=d, p=p, width=width, opts=spec.opts)
  out_shape = [jax.ShapeDtypeStruct((b, width), x.dtype)]
  if bias is None:
    kernel = _without_bias(kernel, n_in=3)
  else:
    out_shape.append(jax.ShapeDtypeStruct((nb * nct * p.block_v,), F32))
  outs = pl.pallas_call(
      kernel,
      out_shape=out_shape,
      grid=(nb * nct,),
      interpret=spec.interpret,
      compiler_params=plgpu.CompilerParams(num_warps=p.num_warps, num_stages=p.num_stages),
      name="lce_backward_dz",
  )(*([jnp.reshape(k, (1,)).astype(jnp.int32), x, w] + ([] if bias is None else [bias])
      + [labels, lse, g_loss, g_lse]))
  if bias is None:
    return outs[0], None
  return outs[0], outs[1].reshape(nb, nct * p.block_v)[:, :width].sum(0)


def _dx_kernel(k_ref, dz_ref, w_ref, dx_in_ref, dx_ref, *, d: _Dims, p: Plan, width: int, block_h: int):
  """``dx[rows, hs] += dz[rows, :] @ w[hs, chunk]ᵀ`` for one [block_t, block_h] tile, in float32, in place."""
  bt, bk, bh = p.block_t, p.block_k, block_h
  nh = _cdiv(d.h, bh)
  pid = pl.program_id(0)
  i = lax.div(pid, nh)  # H-fastest order: resident programs share rows of dz and the whole chunk of w
  hb = lax.rem(pid, nh)
  r0 = i * bt
  h0 = hb * bh
  off = k_ref[0] * p.chunk_size
  rmask = (r0 + _iota(bt)) < d.b if d.b % bt else None
  hmask = (h0 + _iota(bh)) < d.h if d.h % bh else None
  tmask = _and(None if rmask is None else rmask[:, None], None if hmask is None else hmask[None, :])
  del dx_in_ref  # aliased to dx_ref
  acc = plgpu.load(dx_ref.at[pl.ds(r0, bt), pl.ds(h0, bh)], mask=tmask, other=None if tmask is None else 0.0)
  ragged = width % bk != 0

  def kstep(kk, acc):
    j0 = kk * bk
    jmask = (j0 + _iota(bk)) < width if ragged else None
    zmask = _and(None if rmask is None else rmask[:, None], None if jmask is None else jmask[None, :])
    dzt = plgpu.load(dz_ref.at[pl.ds(r0, bt), pl.ds(j0, bk)], mask=zmask, other=None if zmask is None else 0.0)
    if d.w_layout == "hv":
      wmask = _and(None if hmask is None else hmask[:, None], None if jmask is None else jmask[None, :])
      wt = plgpu.load(w_ref.at[pl.ds(h0, bh), pl.ds(off + j0, bk)], mask=wmask, other=None if wmask is None else 0.0)
      dims = (((1,), (1,)), ((), ()))
    else:
      wmask = _and(None if jmask is None else jmask[:, None], None if hmask is None else hmask[None, :])
      wt = plgpu.load(w_ref.at[pl.ds(off + j0, bk), pl.ds(h0, bh)], mask=wmask, other=None if wmask is None else 0.0)
      dims = (((1,), (0,)), ((), ()))
    return acc + lax.dot_general(dzt, wt, dims, preferred_element_type=F32)

  acc = lax.fori_loop(0, _cdiv(width, bk), kstep, acc)
  plgpu.store(dx_ref.at[pl.ds(r0, bt), pl.ds(h0, bh)], acc, mask=tmask)


def _dx_accumulate(dx, dz, w, k, spec: common.Spec, p: Plan):
  """``dx + dz @ w[:, k·chunk : k·chunk + width]ᵀ`` (float32 [B, H]) without a second B×H buffer."""
  b, h = dx.shape
  width = dz.shape[1]
  d = _Dims(b, h, spec.opts.vocab_size, spec.w_layout, False)
  bh = max(16, min(p.block_v, _pow2_ceil(h)))
  nb, nh = _cdiv(b, p.block_t), _cdiv(h, bh)
  return pl.pallas_call(
      functools.partial(_dx_kernel, d=d, p=p, width=width, block_h=bh),
      out_shape=jax.ShapeDtypeStruct(dx.shape, F32),
      grid=(nb * nh,),
      input_output_aliases={3: 0},
      interpret=spec.interpret,
      compiler_params=plgpu.CompilerParams(num_warps=p.num_warps, num_stages=p.num_stages),
      name="lce_backward_dx",
  )(jnp.reshape(k, (1,)).astype(jnp.int32), dz, w, dx)


# ------------------------------------------------------------------------------------------------ custom_vjp


@dataclasses.dataclass(frozen=True)
class Kernels:
  """The two kernel launchers the recompute custom_vjp below calls (hashable: a ``nondiff_argnums`` argument).

  ``impl="triton"`` (``triton_kernels.py``) runs the same forward/backward orchestration with its own launchers.

  Attributes:
    forward: ``(x, w, bias, labels, spec, plan) -> TokenOut``.
    dz_chunk: ``(k, width, x, w, bias, labels, lse, g_loss, g_lse, spec, plan) -> (dz, dbias or None)``: the
      logit gradient [B, width] (input dtype) of the columns ``[k·plan.chunk_size, k·plan.chunk_size + width)``
      and their float32 bias gradient; ``k`` is a traced int32 scalar.
  """

  forward: Any
  dz_chunk: Any


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _lean(x, w, bias, labels, spec, p, kernels):
  return kernels.forward(x, w, bias, labels, spec, p)


def _lean_fwd(x, w, bias, labels, spec, p, kernels):
  out = kernels.forward(x, w, bias, labels, spec, p)
  return out, (x, w, bias, labels, out.lse)


def _lean_bwd(spec, p, kernels, res, g):
  x, w, bias, labels, lse = res
  g_loss = g.loss.astype(F32)
  g_lse = g.lse.astype(F32)
  # On a GPU the dw matmul writes the weights' dtype directly (cuBLAS accumulates in float32 either way); in
  # interpret mode (CPU) it accumulates in float32 explicitly.
  dw_type = F32 if spec.interpret else w.dtype
  dw_step = functools.partial(_dw_step, kernels, x, w, bias, labels, lse, g_loss, g_lse, spec, p, dw_type)

  def step(k, width, carry):
    dx, dw, db = carry
    dz, dw, db = dw_step(k, width, (None, dw, db))
    if p.dx_kernel:
      dx = _dx_accumulate(dx, dz, w, k, spec, p)
    else:
      wc = common.slice_vocab(w, k * p.chunk_size, width, spec.w_layout)
      dx = dx + common.grad_x(dz, wc, spec.w_layout)
    return dx, dw, db

  carry = (jnp.zeros(x.shape, F32), jnp.zeros_like(w), None if bias is None else jnp.zeros(bias.shape, F32))
  if p.low_memory:
    _, dw, db = _vocab_loop(spec.opts.vocab_size, p.chunk_size, lambda k, n, cr: (None, *dw_step(k, n, cr)[1:]),
                            (None, *carry[1:]))
    dx = _dx_by_token_blocks(kernels, x, w, bias, labels, lse, g_loss, g_lse, spec, p)
  else:
    dx, dw, db = _vocab_loop(spec.opts.vocab_size, p.chunk_size, step, carry)
  return dx.astype(x.dtype), dw, None if bias is None else db.astype(bias.dtype), None


def _vocab_loop(vocab: int, c: int, step, carry):
  """``step(k, width, carry)`` over the chunks ``[k·c, k·c + width)`` of the vocabulary (the last one ragged)."""
  n_full, tail = vocab // c, vocab % c
  if n_full:
    carry = lax.fori_loop(0, n_full, lambda k, cr: step(k, c, cr), carry)
  if tail:
    carry = step(jnp.int32(n_full), tail, carry)
  return carry


def _dw_step(kernels, x, w, bias, labels, lse, g_loss, g_lse, spec, p, dw_type, k, width, carry):
  """One vocabulary chunk: its dz, and its columns of dw (and dbias). Returns (dz, dw, db)."""
  _, dw, db = carry
  dz, dbc = kernels.dz_chunk(k, width, x, w, bias, labels, lse, g_loss, g_lse, spec, p)
  # The reduction over tokens is complete inside this one matmul: dw's columns are written once.
  dwc = lax.dot_general(*((x, dz) if spec.w_layout == "hv" else (dz, x)), (((0,), (0,)), ((), ())),
                        preferred_element_type=dw_type)
  dw = lax.dynamic_update_slice_in_dim(dw, dwc.astype(dw.dtype), k * p.chunk_size, spec.vocab_axis)
  if db is not None:
    db = lax.dynamic_update_slice_in_dim(db, dbc, k * p.chunk_size, 0)
  return dz, dw, db


def _dx_by_token_blocks(kernels, x, w, bias, labels, lse, g_loss, g_lse, spec, p):
  """The low-memory backward's dx pass: per block of ``token_block`` tokens, the logits are recomputed chunk by
  chunk (``dx_chunk`` columns) and ``dx_block += dz wᵀ`` accumulates in a float32 [token_block, H] buffer that
  is complete, and cast, before the next block starts."""
  px = dataclasses.replace(p, chunk_size=p.dx_chunk)
  vocab = spec.opts.vocab_size

  def rows(r, n: int):
    sl = lambda a: lax.dynamic_slice_in_dim(a, r, n, 0)
    xb, yb, lb, glb, gsb = sl(x), sl(labels), sl(lse), sl(g_loss), sl(g_lse)

    def step(k, width, acc):
      dz, _ = kernels.dz_chunk(k, width, xb, w, bias, yb, lb, glb, gsb, spec, px)
      return _dx_accumulate(acc, dz, w, k, spec, px)

    return _vocab_loop(vocab, px.chunk_size, step, jnp.zeros((n, x.shape[1]), F32)).astype(x.dtype)

  tb = min(p.token_block, x.shape[0])
  n_full, tail = divmod(x.shape[0], tb)
  dx = jnp.zeros_like(x)
  if n_full:
    dx = lax.fori_loop(0, n_full, lambda i, d: lax.dynamic_update_slice_in_dim(d, rows(i * tb, tb), i * tb, 0), dx)
  if tail:
    dx = lax.dynamic_update_slice_in_dim(dx, rows(n_full * tb, tail), n_full * tb, 0)
  return dx


_lean.defvjp(_lean_fwd, _lean_bwd)
PALLAS_KERNELS = Kernels(_forward, _dz_chunk)


def lean_with(kernels: Kernels, x, w, bias, labels, spec: common.Spec, p) -> _math.TokenOut:
  """The recompute custom_vjp with the given kernel launchers and a resolved plan (``p`` needs ``chunk_size``,
  ``dx_kernel`` and ``low_memory``, plus whatever the launchers read)."""
  return _lean(x, w, bias, labels, spec, p, kernels)


def lean(x, w, bias, labels, spec: common.Spec, config: Config | None = None) -> _math.TokenOut:
  """Per-token loss, lse and correctness; differentiable in x, w and bias with any cotangent on loss and lse."""
  p = plan(x.shape[0], x.shape[1], spec.opts.vocab_size, x.dtype, config)
  return lean_with(PALLAS_KERNELS, x, w, bias, labels, spec, p)
