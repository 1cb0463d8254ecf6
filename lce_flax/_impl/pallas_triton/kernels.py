"""The Pallas (Triton-lowered) kernels of ``impl="pallas_triton"`` and their launchers.

* :func:`forward`: the forward kernel (``_fwd_kernel``), one program per (row block, vocabulary split), each
  leaving 4 float32 row statistics per token and split; merged by :func:`lce_flax._impl.common.merge_splits`.
* :func:`dz_chunk`: the backward's logit-gradient kernel (``_dz_kernel``) for one vocabulary chunk, in grouped
  tile order, with per-row-block column sums for the bias gradient.
* :func:`dx_accumulate`: the in-place ``dx += dz·w[chunk]ᵀ`` kernel (``_dx_kernel``) of ``dx_kernel=True`` and
  of the low-memory dx pass.

The tiling, the program order and the memory traffic are explained in :mod:`lce_flax._impl.pallas_triton.op`.
Ragged B, V and H are handled by masked loads and stores (``pl.ds`` windows checked against iota bounds); w is
never padded or copied. Plans (``p``) are :class:`lce_flax._impl.pallas_triton.op.Plan`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from lce_flax import _math
from lce_flax._impl import common
from lce_flax._impl.common import F32, cdiv


@dataclasses.dataclass(frozen=True)
class Dims:
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


def _load(ref, mask, other):
  """``plgpu.load`` with the mask only where one is needed (``mask`` None: an unmasked load)."""
  return plgpu.load(ref, mask=mask, other=None if mask is None else other)


def _params(p):
  return plgpu.CompilerParams(num_warps=p.num_warps, num_stages=p.num_stages)


def tile_logits(x_ref, w_ref, b_ref, r0, rmask, c0, cmask, d: Dims, p):
  """float32 ``x[r0:r0+bt] @ w[:, c0:c0+bv] (+ bias)``; ``rmask``/``cmask`` guard ragged edges (or None)."""
  bt, bv, bk = p.block_t, p.block_v, p.block_k
  ragged_k = d.h % bk != 0

  def kstep(kk, acc):
    k0 = kk * bk
    kmask = (k0 + _iota(bk)) < d.h if ragged_k else None
    xt = _load(x_ref.at[pl.ds(r0, bt), pl.ds(k0, bk)],
               _and(None if rmask is None else rmask[:, None], None if kmask is None else kmask[None, :]), 0.0)
    if d.w_layout == "hv":
      wmask = _and(None if kmask is None else kmask[:, None], None if cmask is None else cmask[None, :])
      wt = _load(w_ref.at[pl.ds(k0, bk), pl.ds(c0, bv)], wmask, 0.0)
      dims = (((1,), (0,)), ((), ()))
    else:
      wmask = _and(None if cmask is None else cmask[:, None], None if kmask is None else kmask[None, :])
      wt = _load(w_ref.at[pl.ds(c0, bv), pl.ds(k0, bk)], wmask, 0.0)
      dims = (((1,), (1,)), ((), ()))
    return acc + lax.dot_general(xt, wt, dims, preferred_element_type=F32)

  z = lax.fori_loop(0, cdiv(d.h, bk), kstep, jnp.zeros((bt, bv), F32))
  if d.has_bias:
    z = z + _load(b_ref.at[pl.ds(c0, bv)], cmask, 0.0).astype(F32)[None, :]
  return z


# ------------------------------------------------------------------------------------------------ forward


def _fwd_kernel(x_ref, w_ref, b_ref, y_ref, m_ref, s_ref, t_ref, zs_ref, *, d: Dims, p, opts):
  bt, bv, ns = p.block_t, p.block_v, p.num_splits
  nb = cdiv(d.b, bt)
  nvt = cdiv(d.v, bv)
  tps = cdiv(nvt, ns)  # vocabulary tiles per split
  pid = pl.program_id(0)
  i = lax.div(pid, ns)  # split-fastest order: resident programs share row blocks (see op.py's docstring)
  j = lax.rem(pid, ns)
  r0 = i * bt
  rmask = (r0 + _iota(bt)) < d.b if d.b % bt else None
  labels = _load(y_ref.at[pl.ds(r0, bt)], rmask, _math.IGNORED)

  def tile(t, st):
    c0 = t * bv
    cols = c0 + _iota(bv)
    cvalid = cols < d.v
    z = tile_logits(x_ref, w_ref, b_ref, r0, rmask, c0, cvalid if d.v % bv else None, d, p)
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


def forward(x, w, bias, labels, spec: common.Spec, p) -> _math.RowStats:
  """Row statistics of the columns of ``w`` (one kernel + the merge of its splits)."""
  b, h = x.shape
  opts = spec.opts
  d = Dims(b, h, common.vocab_size(w, spec.w_layout), spec.w_layout, bias is not None)
  nb = cdiv(b, p.block_t)
  n = p.num_splits * nb * p.block_t
  kernel = functools.partial(_fwd_kernel, d=d, p=p, opts=opts)
  outs = pl.pallas_call(
      kernel if d.has_bias else common.absent_refs(kernel, 2),
      out_shape=[jax.ShapeDtypeStruct((n,), F32)] * 4,
      grid=(nb * p.num_splits,),
      interpret=spec.interpret,
      compiler_params=_params(p),
      name="lce_forward",
  )(*common.present(x, w, bias, labels))
  return common.merge_splits([o.reshape(p.num_splits, nb * p.block_t)[:, :b] for o in outs])


# ------------------------------------------------------------------------------------------------ backward


def _dz_kernel(k_ref, x_ref, w_ref, b_ref, y_ref, lse_ref, gl_ref, gs_ref, dz_ref, db_ref, *, d: Dims, p,
               width: int, opts):
  """One [block_t, block_v] tile of the logit gradient of the chunk ``[off, off + width)``."""
  bt, bv = p.block_t, p.block_v
  nb = cdiv(d.b, bt)
  nct = cdiv(width, bv)
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
  off = k_ref[0] * p.vocab_chunk
  r0 = i * bt
  lc0 = t * bv
  rvalid = (r0 + _iota(bt)) < d.b
  rmask = rvalid if d.b % bt else None
  lcols = lc0 + _iota(bv)
  cvalid = lcols < width
  cmask = cvalid if width % bv else None
  z = tile_logits(x_ref, w_ref, b_ref, r0, rmask, off + lc0, cmask, d, p)
  rows = pl.ds(r0, bt)
  labels = _load(y_ref.at[rows], rmask, _math.IGNORED)
  lse, g_loss, g_lse = (_load(ref.at[rows], rmask, 0.0) for ref in (lse_ref, gl_ref, gs_ref))
  dz = _math.dlogits(z, lse, labels, off + lcols, cvalid, g_loss, g_lse, opts)
  smask = _and(None if rmask is None else rmask[:, None], None if cmask is None else cmask[None, :])
  plgpu.store(dz_ref.at[rows, pl.ds(lc0, bv)], dz.astype(dz_ref.dtype), mask=smask)
  if d.has_bias:
    # Padding rows may hold inf·0 = NaN (their lse is a placeholder): keep them out of the column sums.
    db_ref[pl.ds((i * nct + t) * bv, bv)] = jnp.sum(jnp.where(rvalid[:, None], dz, 0.0), axis=0)


def dz_chunk(k, width: int, x, w, bias, labels, lse, g_loss, g_lse, spec: common.Spec, p):
  """(dz [B, width] in x.dtype, per-row-block column sums [row_blocks, ≥ width] float32 or None) of the columns
  ``[k·chunk, k·chunk + width)``; ``k`` is a traced int32 scalar."""
  b, h = x.shape
  d = Dims(b, h, common.vocab_size(w, spec.w_layout), spec.w_layout, bias is not None)
  nb = cdiv(b, p.block_t)
  nct = cdiv(width, p.block_v)
  kernel = functools.partial(_dz_kernel, d=d, p=p, width=width, opts=spec.opts)
  out_shape = [jax.ShapeDtypeStruct((b, width), x.dtype)]
  if d.has_bias:
    out_shape.append(jax.ShapeDtypeStruct((nb * nct * p.block_v,), F32))
  outs = pl.pallas_call(
      kernel if d.has_bias else common.absent_refs(kernel, 3, 9),
      out_shape=out_shape,
      grid=(nb * nct,),
      interpret=spec.interpret,
      compiler_params=_params(p),
      name="lce_backward_dz",
  )(*common.present(jnp.reshape(k, (1,)).astype(jnp.int32), x, w, bias, labels, lse, g_loss, g_lse))
  return outs[0], (outs[1].reshape(nb, nct * p.block_v) if d.has_bias else None)


def _dx_kernel(k_ref, dz_ref, w_ref, dx_in_ref, dx_ref, *, d: Dims, p, width: int, block_h: int):
  """``dx[rows, hs] += dz[rows, :] @ w[hs, chunk]ᵀ`` for one [block_t, block_h] tile, in float32, in place."""
  bt, bk, bh = p.block_t, p.block_k, block_h
  nh = cdiv(d.h, bh)
  pid = pl.program_id(0)
  i = lax.div(pid, nh)  # H-fastest order: resident programs share rows of dz and the whole chunk of w
  hb = lax.rem(pid, nh)
  r0 = i * bt
  h0 = hb * bh
  off = k_ref[0] * p.vocab_chunk
  rmask = (r0 + _iota(bt)) < d.b if d.b % bt else None
  hmask = (h0 + _iota(bh)) < d.h if d.h % bh else None
  tmask = _and(None if rmask is None else rmask[:, None], None if hmask is None else hmask[None, :])
  del dx_in_ref  # aliased to dx_ref
  acc = _load(dx_ref.at[pl.ds(r0, bt), pl.ds(h0, bh)], tmask, 0.0)
  ragged = width % bk != 0

  def kstep(kk, acc):
    j0 = kk * bk
    jmask = (j0 + _iota(bk)) < width if ragged else None
    zmask = _and(None if rmask is None else rmask[:, None], None if jmask is None else jmask[None, :])
    dzt = _load(dz_ref.at[pl.ds(r0, bt), pl.ds(j0, bk)], zmask, 0.0)
    if d.w_layout == "hv":
      wmask = _and(None if hmask is None else hmask[:, None], None if jmask is None else jmask[None, :])
      wt = _load(w_ref.at[pl.ds(h0, bh), pl.ds(off + j0, bk)], wmask, 0.0)
      dims = (((1,), (1,)), ((), ()))
    else:
      wmask = _and(None if jmask is None else jmask[:, None], None if hmask is None else hmask[None, :])
      wt = _load(w_ref.at[pl.ds(off + j0, bk), pl.ds(h0, bh)], wmask, 0.0)
      dims = (((1,), (0,)), ((), ()))
    return acc + lax.dot_general(dzt, wt, dims, preferred_element_type=F32)

  acc = lax.fori_loop(0, cdiv(width, bk), kstep, acc)
  plgpu.store(dx_ref.at[pl.ds(r0, bt), pl.ds(h0, bh)], acc, mask=tmask)


def dx_accumulate(dx, dz, w, k, spec: common.Spec, p):
  """``dx + dz @ w[:, k·chunk : k·chunk + width]ᵀ`` (float32 [B, H]) without a second B×H buffer."""
  b, h = dx.shape
  width = dz.shape[1]
  d = Dims(b, h, common.vocab_size(w, spec.w_layout), spec.w_layout, False)
  bh = max(16, min(p.block_v, common.pow2_ceil(h)))
  nb, nh = cdiv(b, p.block_t), cdiv(h, bh)
  return pl.pallas_call(
      functools.partial(_dx_kernel, d=d, p=p, width=width, block_h=bh),
      out_shape=jax.ShapeDtypeStruct(dx.shape, F32),
      grid=(nb * nh,),
      input_output_aliases={3: 0},
      interpret=spec.interpret,
      compiler_params=_params(p),
      name="lce_backward_dx",
  )(jnp.reshape(k, (1,)).astype(jnp.int32), dz, w, dx)
