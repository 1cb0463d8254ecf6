"""The one-warpgroup Mosaic GPU kernels of ``impl="pallas_mosaic"`` (interpretable), and what every kernel shares.

One warpgroup per CTA runs ``plgpu.emit_pipeline`` with ``delay_release=1`` (one WGMMA stays in flight while the
next tiles land), in Lane semantics with explicit register layouts (``Config(warp_specialized=False)``; about
1.3× slower on an H100 than the warp-specialised kernels of :mod:`.kernels_ws`, which are the GPU default).

* :func:`forward`: a grid ``(num_splits, row_blocks)``, split fastest; each CTA walks its split's vocabulary
  tiles for its ``block_t`` tokens and leaves 4 float32 row statistics per token and split (and, for the fast
  forward, ``Dims.store``, every tile's shifted logits and row maxima through SMEM + TMA, :func:`store_tile`).
* :func:`dz_chunk`: one CTA per ``[block_t, block_v]`` tile of the logit gradient of one vocabulary chunk.

Interpret mode (CPU): these kernels run under Mosaic GPU's own interpreter (``plgpu.InterpretGPUParams``:
simulated GMEM/SMEM, TMA copies, barriers), except the one WGMMA instruction, which it cannot interpret: there
the pipeline body adds ``jnp.dot`` of the same shared-memory tiles into a carried accumulator
(:func:`_logit_tile`). Everything else (the TMA pipeline, index maps, tile windows, epilogues, SMEM stores) is
what the GPU runs.

Shared with the warp-specialised kernels: :class:`Dims`, :func:`transforms`, :func:`w_window`,
:func:`store_tile`, :func:`out_types` and :func:`absent_gmem`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from lce_flax import _math
from lce_flax._impl import common
from lce_flax._impl.common import F32, cdiv
from lce_flax._impl.pallas_mosaic import epilogue

_L = plgpu.Layout.WGMMA
_ROW = plgpu.Layout.WGMMA.reduce(1)  # one value per tile row (token)
_COL = plgpu.Layout.WGMMA.reduce(0)  # one value per tile column (vocabulary entry)


@dataclasses.dataclass(frozen=True)
class Dims:
  """Static shape facts a kernel needs (after ``op.prepare``'s padding)."""

  b: int  # padded tokens (multiple of block_t)
  h: int  # padded hidden (multiple of block_k)
  v: int  # real vocabulary
  vp: int  # vocabulary of the w handed to the kernel (≥ block_v)
  w_layout: str
  has_bias: bool
  interpret: bool
  store: bool = False  # the fast forward: also write the shifted logits and tile maxima (see store_tile)


def transforms(minor_bytes: int):
  swizzle = plgpu.find_swizzle(minor_bytes * 8)
  return swizzle, (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))


def w_window(w_ref, c0, bv: int, d: Dims):
  return w_ref.at[pl.ds(c0, bv)] if d.w_layout == "vh" else w_ref.at[:, pl.ds(c0, bv)]


def absent_gmem(d: Dims) -> list[int]:
  """Positions of the forward kernels' GMEM refs ``(x, w, bias, labels, stats, stored tiles, maxima)`` that this
  call lacks: the bias without one, the stored tiles and maxima outside the fast forward."""
  return ([] if d.has_bias else [2]) + ([] if d.store else [5, 6])


def out_types(d: Dims, p, nparts: int, dtype):
  """The forward's outputs: [4, nparts, B] row statistics (+ stored tiles [B, vp] and maxima [vp/bv, B])."""
  out = [jax.ShapeDtypeStruct((4, nparts, d.b), F32)]
  if d.store:
    out += [jax.ShapeDtypeStruct((d.b, d.vp), dtype), jax.ShapeDtypeStruct((d.vp // p.block_v, d.b), F32)]
  return tuple(out)


def store_tile(zc, m, o_smem, m_smem, zb_ref, mt_ref, r0, c0, nominal, bt: int, bv: int):
  """Fast forward: writes the tile's :func:`~.epilogue.shifted_logits` (input dtype) and its row max through
  SMEM + TMA.

  ``c0`` is the tile's first column, ``nominal`` the first column its CTA tile counts. With V a multiple of
  ``block_v`` (see ``op.prepare``) a tile is either all new (stored) or all overlap of the clamped last window
  (skipped), so every column is stored once, by a tile aligned to ``block_v``: column ``q``'s max is row
  ``q // block_v`` of ``mt``. The SMEM buffers are reused by the next tile: wait until the previous tile's
  copies have read them.
  """
  @pl.when(c0 >= nominal)
  def _():
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    o_smem[...] = epilogue.shifted_logits(zc, m).astype(o_smem.dtype)
    m_smem[...] = jnp.where(m == -jnp.inf, 0.0, m)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, zb_ref.at[pl.ds(r0, bt), pl.ds(c0, bv)])
    plgpu.copy_smem_to_gmem(m_smem, mt_ref.at[c0 // bv, pl.ds(r0, bt)])


def _layout(a, layout, p):
  """Pins a register layout (Lane semantics); Warpgroup semantics and the interpreter infer it."""
  if p.semantics == "lane":
    return plgpu.layout_cast(a, layout)
  return a


def _load_vec(smem, layout, p, d: Dims):
  if d.interpret or p.semantics != "lane":
    return _layout(smem[...], layout, p)
  return plgpu.load(smem, layout=layout)


def _iota(shape, dim, p, d: Dims):
  if p.semantics == "lane" and not d.interpret:
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=_L)
  return lax.broadcasted_iota(jnp.int32, shape, dim)


def _logit_tile(x_rows, w_cols, d: Dims, p):
  """float32 ``x_rows @ w_cols`` [block_t, block_v] (w_cols is [bv, H] for "vh", [H, bv] for "hv")."""
  bt, bv, bk = p.block_t, p.block_v, p.block_k
  _, tr = transforms(bk * 2)
  nk = d.h // bk
  delay = 0 if d.interpret else 1
  x_spec = plgpu.BlockSpec((bt, bk), lambda k: (0, k), transforms=tr, delay_release=delay)
  if d.w_layout == "vh":
    w_spec = plgpu.BlockSpec((bv, bk), lambda k: (0, k), transforms=tr, delay_release=delay)
  else:
    w_spec = plgpu.BlockSpec((bk, bv), lambda k: (k, 0), transforms=transforms(bv * 2)[1], delay_release=delay)
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


def _fetch(pairs, bars, first: int = 0):
  """TMA copies of small GMEM vectors into SMEM (one barrier each: a copy is one arrival), then waits for all."""
  for k, (src, dst) in enumerate(pairs):
    plgpu.copy_gmem_to_smem(src, dst, bars.at[first + k])
  for k in range(len(pairs)):
    plgpu.barrier_wait(bars.at[first + k])


def _kernel(body, out_type, scratch, grid, names, d: Dims, p):
  params = plgpu.CompilerParams(
      lowering_semantics=plgpu.LoweringSemantics.Lane if p.semantics == "lane"
      else plgpu.LoweringSemantics.Warpgroup, approx_math=epilogue.APPROX_MATH)
  return plgpu.kernel(body, out_type=out_type, scratch_types=common.present(*scratch), grid=grid,
                      grid_names=names, compiler_params=params,
                      interpret=plgpu.InterpretGPUParams() if d.interpret else False)


# ------------------------------------------------------------------------------------------------ forward


def _fwd_body(x_ref, w_ref, b_ref, y_ref, st_ref, zb_ref, mt_ref, y_smem, b_smem, st_smem, o_smem, m_smem, bars,
              *, d: Dims, p, opts: _math.LossSpec):
  bt, bv, ns = p.block_t, p.block_v, p.num_splits
  nvt = cdiv(d.vp, bv)
  tps = cdiv(nvt, ns)  # vocabulary tiles per split
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
    z = _logit_tile(x_rows, w_window(w_ref, c0, bv, d), d, p)
    if d.has_bias:
      _fetch([(b_ref.at[pl.ds(c0, bv)], b_smem)], bars, 1)
      z = z + epilogue.bcast_cols(_load_vec(b_smem, _COL, p, d), shape)
    cols = _iota(shape, 1, p, d) + c0
    valid = (cols >= nominal) & (cols < d.v)
    zc = epilogue.softcap(z, opts.logit_softcap)
    new = epilogue.epilogue_stats(zc, cols, valid, labels, opts)
    if d.store:
      store_tile(zc, new.m, o_smem, m_smem, zb_ref, mt_ref, r0, c0, nominal, bt, bv)
    return tuple(epilogue.merge(st, new))

  init = tuple(_layout(jnp.full((bt,), val, F32), _ROW, p) for val in (-jnp.inf, 0.0, 0.0, 0.0))
  t_lo = j * tps
  t_hi = jnp.minimum(t_lo + tps, nvt)
  st = lax.fori_loop(t_lo, t_hi, tile, init)
  for k in range(4):
    st_smem[k] = st[k]
  plgpu.commit_smem()
  for k in range(4):
    plgpu.copy_smem_to_gmem(st_smem.at[k], st_ref.at[k, j, pl.ds(r0, bt)])
  plgpu.wait_smem_to_gmem(0)


def forward(x, w, bias, labels, d: Dims, p, opts):
  """x [d.b, d.h], w and bias padded by ``op.prepare``, labels [d.b] (padding rows -1).

  Returns (RowStats, stored) with ``stored`` = (shifted logits [d.b, d.vp], row maxima [vp/bv, d.b]) when
  ``d.store``, else None.
  """
  bt, bv = p.block_t, p.block_v
  scratch = [plgpu.SMEM((bt,), jnp.int32), plgpu.SMEM((bv,), F32) if d.has_bias else None,
             plgpu.SMEM((4, bt), F32),
             plgpu.SMEM((bt, bv), x.dtype, transforms=transforms(bv * 2)[1]) if d.store else None,
             plgpu.SMEM((bt,), F32) if d.store else None, plgpu.Barrier(num_barriers=2)]
  absent = absent_gmem(d) + ([] if d.has_bias else [8]) + ([] if d.store else [10, 11])
  body = common.absent_refs(functools.partial(_fwd_body, d=d, p=p, opts=opts), *absent)
  kern = _kernel(body, out_types(d, p, p.num_splits, x.dtype), scratch, (p.num_splits, d.b // bt),
                 ("split", "row"), d, p)
  st, *stored = kern(*common.present(x, w, bias, labels))
  return common.merge_splits(st), (tuple(stored) if d.store else None)


# ------------------------------------------------------------------------------------------------ backward


def _dz_body(x_ref, w_ref, b_ref, y_ref, lo_ref, lse_ref, coef_ref, a_ref, c_ref, dz_ref, vec_smem, y_smem, b_smem,
             o_smem, bars, *, d: Dims, p, opts: _math.LossSpec):
  """One [block_t, block_v] tile of the logit gradient of the chunk handed in as ``w_ref``; zero in the columns
  before ``lo_ref``'s (chunk-local, one per row: the columns a previous chunk already did)."""
  bt, bv = p.block_t, p.block_v
  t = lax.axis_index("tile")
  i = lax.axis_index("row")
  r0 = i * bt
  c0 = t * bv
  rows = pl.ds(r0, bt)
  pairs = [(y_ref.at[rows], y_smem.at[0]), (lo_ref.at[rows], y_smem.at[1])] + [
      (ref.at[rows], vec_smem.at[k]) for k, ref in enumerate((lse_ref, coef_ref, a_ref, c_ref))]
  if d.has_bias:
    pairs.append((b_ref.at[pl.ds(c0, bv)], b_smem))
  _fetch(pairs, bars)
  shape = (bt, bv)
  z = _logit_tile(x_ref.at[rows], w_window(w_ref, c0, bv, d), d, p)
  if d.has_bias:
    z = z + epilogue.bcast_cols(_load_vec(b_smem, _COL, p, d), shape)
  labels, lo = (_load_vec(y_smem.at[k], _ROW, p, d) for k in range(2))  # chunk-local column ids
  lse, coef, a, c = (_load_vec(vec_smem.at[k], _ROW, p, d) for k in range(4))
  cols = _iota(shape, 1, p, d) + c0
  dz = epilogue.epilogue_dlogits(z, cols, labels, lse, coef, a, c, opts)
  dz = jnp.where(cols >= epilogue.bcast_rows(lo, shape), dz, 0.0)
  o_smem[...] = dz.astype(o_smem.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(o_smem, dz_ref.at[rows, pl.ds(c0, bv)])
  plgpu.wait_smem_to_gmem(0)


def dz_chunk(x, w_c, b_c, labels_local, lo, lse, coef, a, c, d: Dims, p, opts):
  """dz [d.b, width] (x.dtype) of the chunk whose head columns are ``w_c`` (width a multiple of block_v), zero in
  each row's columns before ``lo`` (int32 [d.b], chunk-local)."""
  width = w_c.shape[0] if d.w_layout == "vh" else w_c.shape[1]
  bt, bv = p.block_t, p.block_v
  scratch = [plgpu.SMEM((4, bt), F32), plgpu.SMEM((2, bt), jnp.int32),
             plgpu.SMEM((bv,), F32) if d.has_bias else None,
             plgpu.SMEM((bt, bv), x.dtype, transforms=transforms(bv * 2)[1]),
             plgpu.Barrier(num_barriers=7 if d.has_bias else 6)]
  body = common.absent_refs(functools.partial(_dz_body, d=d, p=p, opts=opts), *([] if d.has_bias else [2, 12]))
  kern = _kernel(body, jax.ShapeDtypeStruct((d.b, width), x.dtype), scratch, (width // bv, d.b // bt),
                 ("tile", "row"), d, p)
  return kern(*common.present(x, w_c, b_c, labels_local, lo, lse, coef, a, c))
