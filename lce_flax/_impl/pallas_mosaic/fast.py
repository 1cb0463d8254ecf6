"""The fast designs of ``impl="pallas_mosaic"`` (``mode="fast"``, 6·B·H·V FLOPs) and their dz pass.

The forward kernel (:func:`.op.run_forward` with ``Dims.store``) also stores every logit tile, shifted by its
row max, in the input dtype, and its row maxima; once lse is known, one elementwise kernel (:func:`_dz_pass`)
turns the stored tiles into dz in place. Two designs (``Plan.fast_design``, chosen by :func:`.op.fast_design`):

* ``"logits"``: all B tokens at once. The buffer is B×V in the input dtype (+ B·V/bv float32 maxima); the
  backward forms dx = dz wᵀ and dw = xᵀ dz as two whole matmuls (the largest, most efficient shapes the problem
  has; no accumulation across chunks: every product accumulates in float32 inside one matmul).
* ``"tokens"``: chunks of c tokens (a c×V buffer); each chunk's dx rows are complete at once and its xᵀdz adds
  into an H×V float32 dw: the choice when H·V·4 + c·V·2 is smaller than B·V·2 (small H, many tokens:
  gpt2-small).

**What is stored.** Where the forward runs on the GEMM of :mod:`.gemm` with bf16 operands and no label smoothing
(every LLM head measured), each tile is stored as the exponentials ``E = exp(zc - r)`` against one reference logit
``r`` per row (its largest logit at the labels of 256 tokens of the batch, :func:`_reference`; the kernel takes them
against ``max(r, tile max - epilogue.EXP_CLAMP)``, which is ``r`` except in a tile more than 80 above it, whose
row lies past ``PROBS_GAP`` and is repaired below), times the soft cap's derivative when there is one
(:func:`.op.stores_probs`). The logit gradient is then ``dz = σ·E`` with one factor ``σ = coef·exp(r - lse)`` per
row, except at the label, whose exact value (B numbers) is written over E; so
dx = σ·(E·wᵀ) and dw = (σ·x)ᵀ·E are the two products on E itself, with no pass over B×V between forward and
backward (:func:`_grads_from_probs`). A row whose lse lies more than ``PROBS_GAP`` above its reference (60 nats)
would leave E's range: the backward flags the GEMM tile rows holding such rows and the GEMM of :mod:`.gemm`,
skipping every tile row not flagged, writes their exact dz over E's buffer, decided per tile on the device
(:func:`_repair`), before the same two products. Otherwise (the
kernels_ws forward, fp16, label smoothing, whose uniform term is no per-row factor under a soft cap) the tiles are
stored shifted by their row max and one elementwise kernel turns them into dz in place (:func:`_dz_pass`).

The ``custom_vjp`` around :func:`fast_forward` and :func:`fast_backward` is :func:`lce_flax._impl.base.fast`: only
the reduced loss is differentiable (the per-token outputs' cotangents must be symbolic zeros).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from lce_flax import _math
from lce_flax._impl import common
from lce_flax._impl.common import F32, cdiv
from lce_flax._impl.pallas_mosaic import epilogue, gemm, kernels, op, tuning


def _dz_pass_body(zb_ref, mt_ref, lse_ref, y_ref, coef_ref, a_ref, c_ref, o_ref, db_ref, *, opts, v: int):
  """One [bt, bv] block of stored tiles → dz, in place (Pallas Triton on the GPU; interpreted on CPU)."""
  bt, bv = zb_ref.shape
  j = pl.program_id(1)
  shape = (bt, bv)
  zc = zb_ref[...].astype(F32) + epilogue.bcast_rows(mt_ref[0, :], shape)
  cols = lax.broadcasted_iota(jnp.int32, shape, 1) + j * bv
  dz = epilogue.dlogits_capped(zc, cols, y_ref[...], lse_ref[...], coef_ref[...], a_ref[...], c_ref[...], opts)
  dz = jnp.where(cols < v, dz, 0.0)
  o_ref[...] = dz.astype(o_ref.dtype)
  if db_ref is not None:
    db_ref[0, :] = dz.sum(axis=0)


def _dz_pass(zb, mt, lse, yp, coef, a, c, d: kernels.Dims, p: op.Plan, opts):
  """dz from the stored tiles, written over them (``input_output_aliases``: no second B×V buffer), and the
  column sums for dbias. An elementwise Pallas kernel, so that XLA can neither keep both buffers nor fuse this
  pass into the two matmuls that read dz (which it does at some shapes, then holding zb and dz at once)."""
  bt, bv = p.block_t, p.block_v
  grid = (d.b // bt, d.vp // bv)
  vec = pl.BlockSpec((bt,), lambda i, j: (i,))
  out_shape = [jax.ShapeDtypeStruct(zb.shape, zb.dtype)]
  out_specs = [pl.BlockSpec((bt, bv), lambda i, j: (i, j))]
  if d.has_bias:
    out_shape.append(jax.ShapeDtypeStruct((grid[0], d.vp), F32))
    out_specs.append(pl.BlockSpec((1, bv), lambda i, j: (i, j)))
  body = functools.partial(_dz_pass_body, opts=opts, v=d.v)
  out = pl.pallas_call(
      body if d.has_bias else common.absent_refs(body, 8), grid=grid,
      in_specs=[pl.BlockSpec((bt, bv), lambda i, j: (i, j)), pl.BlockSpec((1, bt), lambda i, j: (j, i)),
                vec, vec, vec, vec, vec],
      out_specs=out_specs, out_shape=out_shape, input_output_aliases={0: 0}, interpret=d.interpret,
      compiler_params=None if d.interpret else pltriton.CompilerParams(num_warps=4, num_stages=1),
      name="lce_mosaic_dz_pass",
  )(zb, mt, lse, yp, coef, a, c)
  return out[0], (out[1].sum(axis=0) if d.has_bias else None)


def _stored(xp, wp, bp, yp, d: kernels.Dims, p: op.Plan, opts, ref=None):
  """The forward with stores over rows ``xp``: (RowStats, stored tiles [rows, vp'], their row maxima [tiles, rows]
  (None when ``ref`` is given: the tiles are then ``exp(zc - ref)``, see :func:`.op.stores_probs`), and the Dims
  and Plan the dz pass reads them with)."""
  if p.gemm is None:
    stats, (zb, mt) = op.run_forward(xp, wp, bp, yp, d, p, opts)
    return stats, zb, mt, d, p
  # the forward on the GEMM of :mod:`.gemm`, its statistics epilogue storing the tiles (of the GEMM's tile_n); its
  # exp on the hardware's ex2.approx (13-28% off this GEMM's time at the LLM shapes but qwen3-8b's,
  # benchmarks/results/h100-2026-11-24-epilogue/), a soft cap through epilogue.softcap
  cfg = p.gemm
  st, zb = gemm.gemm(xp, wp, transpose_b=d.w_layout == "vh", config=cfg, interpret=d.interpret,
                     approx_math=epilogue.APPROX_MATH,
                     epilogue=gemm.RowStats(yp, opts, store=True, bias=bp, ref=ref))
  mt = None if ref is not None else st[0, :zb.shape[1] // cfg.tile_n, :d.b]
  return gemm.merge_row_stats(st, d.b), zb, mt, *_read_as(d, p, zb.shape[1])


# ------------------------------------------------------------------------------------- stored exponentials

PROBS_GAP, REF_COLUMNS = op.PROBS_GAP, op.REF_COLUMNS


def _reference(xp, wp, bp, yp, layout: str, opts, v: int):
  """Each row's reference logit (float32 [rows]): its largest capped logit over the label columns of
  ``REF_COLUMNS`` tokens spread over the batch (the tokens that occur are the likely ones, so the max over them
  lies near the row's max; for a row whose own label is among them, within its loss). A [rows, 256] product: the
  gather of every row's own label column of a [H, V] w cost more than the dz pass it replaces (1.4 ms at
  llama3-8b on an H100, ``benchmarks/probe_fast_parts.py``). Rows whose lse lies too far above it take the
  exact dz of the repair (:func:`_grads_from_probs`)."""
  rows = yp.shape[0]
  n = min(REF_COLUMNS, rows)
  # (evenly spaced, formed by traced ops: a NumPy array here would be a constant of the traced function, which a
  # custom_partitioning primitive refuses, so the multi-device path would fail to trace)
  picks = jnp.round(lax.iota(F32, n) * ((rows - 1) / max(n - 1, 1))).astype(jnp.int32)
  col = yp[picks]
  col = jnp.where((col >= 0) & (col < v), col, 0)
  ws = jnp.take(wp, col, axis=1 if layout == "hv" else 0)
  z = common.grad_x(xp, ws, "vh" if layout == "hv" else "hv")  # x·ws: [rows, picks], float32
  if bp is not None:
    z = z + bp[col][None, :]
  return _math.softcap(z, opts.logit_softcap).max(axis=1)


@dataclasses.dataclass(frozen=True)
class _Probs:
  """What the backward needs of a forward that stored exponentials (a pytree: the arrays are its leaves)."""

  e: jax.Array  # [rows, V] bf16: exp(zc - ref) (times the cap's derivative)
  ref: jax.Array  # [rows] float32
  target: jax.Array  # [rows] float32: zc at the label (0 without one)
  lse: jax.Array  # [rows] float32


jax.tree_util.register_dataclass(_Probs, data_fields=["e", "ref", "target", "lse"], meta_fields=[])

def _stored_probs(xp, wp, bp, yp, d: kernels.Dims, p: op.Plan, opts, layout: str, ref=None):
  """The forward storing exponentials over rows ``xp``: (TokenOut, :class:`_Probs`); ``ref``: the rows'
  reference logits if already formed (the "tokens" design forms them once for all its chunks)."""
  if ref is None:
    ref = _reference(xp, wp, bp, yp, layout, opts, d.v)
  stats, e, _, _, _ = _stored(xp, wp, bp, yp, d, p, opts, ref)
  out = _math.finalize(stats, yp, opts)
  return out, _Probs(e, ref, stats.target, out.lse)


def _repair_config(rows: int, h: int, v: int, dtype, bp, opts, interpret: bool):
  """The GEMM tiling of the repair (the tuning table's ``lean_dz`` row: the same product and epilogue as lean
  mode's recompute), which also sets the rows each of the repair's flags stands for (:func:`.gemm.row_unit`).
  Where that row is a ping-pong schedule (gpt2-small's H = 768), the cooperative default tiling: the row mask is
  the cooperative schedule's, and the repair's speed counts only where rows are flagged."""
  part = gemm.LogitGrad(None, None, None, None, None, opts, bias=bp)  # (what its shared memory depends on)
  cfg = gemm.table_config("lean_dz", rows, v, h, dtype, epilogue=part, interpret=interpret)
  if cfg.schedule != "cooperative":
    cfg = tuning.fit_role("lean_dz", gemm.GemmConfig())
  return cfg


def _repair(e, flags, cfg: gemm.GemmConfig, xp, wp, bp, yp, lse, coef, a, c, layout: str, opts, interpret: bool):
  """E with the rows of every flagged row unit (``flags`` int32, one per :func:`.gemm.row_unit` rows of ``cfg``,
  :func:`_repair_config`'s tiling, which the flags were made for) replaced by their exact logit gradient dz, in
  place: the GEMM of :mod:`.gemm` with the ``LogitGrad`` epilogue writing over E (``into``), its ``row_mask``
  skipping the tiles of unflagged units. One launch, decided per tile on the device: no host round trip, and the
  work is that of the flagged units alone (a skipped tile costs the read of its flag)."""
  vp, v = e.shape[1], common.vocab_size(wp, layout)
  if vp != v:
    raise ValueError(f"_repair: E {e.shape} must be as wide as w's vocabulary ({v}): the GEMM forward stores it so")
  part = gemm.LogitGrad(lse, coef, a, c, yp, opts, bias=bp, into=e)
  return gemm.gemm(xp, wp, transpose_b=layout == "vh", epilogue=part, config=cfg, interpret=interpret,
                   approx_math=epilogue.APPROX_MATH, row_mask=flags)


def _grads_from_probs(st: _Probs, xp, wp, bp, yp, g_loss, g_lse, spec: common.Spec, p: op.Plan, dw_dtype,
                      dw_acc=None, want=(True, True)):
  """(dx in x's dtype, dw ``dw_dtype``, dbias float32 or None) over the rows of ``xp`` from the stored exponentials;
  with ``dw_acc`` (float32, w's shape) the dw returned is ``dw_acc + dw``. ``want``: whether dx and dw are needed
  (one not needed comes back as None, its product never formed).

  ``dz = coef·p - [v = y]·a`` (:func:`.epilogue.row_coefficients`; no smoothing) is ``σ·E`` off the label with
  ``σ = coef·exp(ref - lse)``; at the label the exact ``(coef·p_y - a)`` (times the cap's derivative) is written
  into E as ``dz_y / σ`` (one entry per row, in place). Then ``dx = σ·(E·wᵀ)`` and ``dw = (σ·x)ᵀ·E``: E's rounding
  error is relative, ~2⁻⁹ per entry, at any size (the shifted logits' grows with the distance to the max).

  E's largest entry is at most ``exp(lse - ref)`` and σ at least ``coef·exp(ref - lse)`` (ref is at most the row
  max). A row with a gradient whose ``lse - ref > PROBS_GAP`` (σ·x would near bf16's smallest normals) or whose
  label entry is not finite flags its row unit (the repair GEMM's tile row, :func:`.gemm.row_unit`):
  :func:`_repair` writes the exact dz of the flagged units over their rows of E (2·unit·H·V FLOPs a unit), whose σ
  becomes 1, and the same two products follow. The flags are read by the repair GEMM on the device: nothing waits
  for them on the host, and with no unit flagged the repair costs one launch whose tiles only read their flag.
  (A host-side branch here, a ``lax.cond`` or a ``while_loop`` of run-time trips, made XLA's GPU runtime copy its
  predicate to the host and wait for the device at every call, after which the host launched the rest of the step
  only as fast as it could: the example trainer's step took 61.8 ms with it and 53.0 ms without on one H200, under
  the profiler, ``benchmarks/results/trainer-scaling-2026-11-27/run8_no_host_waits_a33e087/``.)"""
  opts, v, layout = spec.opts, spec.opts.vocab_size, spec.w_layout
  e = st.e
  coef, a, c = epilogue.row_coefficients(st.lse, yp, g_loss, g_lse, opts)
  sigma = coef * jnp.exp(st.ref - st.lse)
  hit = (yp >= 0) & (yp < v)
  t = _math.through_softcap(coef * jnp.exp(st.target - st.lse) - a, st.target, opts.logit_softcap)
  patch = (t / sigma).astype(e.dtype)
  needed = (coef != 0) | (a != 0)  # (NaN coef: an out-of-range label, whose gradient is NaN on either path)
  bad = needed & ~((st.lse - st.ref <= PROBS_GAP) & (~hit | jnp.isfinite(patch)))
  rows = jnp.arange(e.shape[0])
  e = e.at[rows, jnp.where(hit, yp, e.shape[1])].set(patch, mode="drop", unique_indices=True, indices_are_sorted=True)

  cfg = _repair_config(e.shape[0], xp.shape[1], e.shape[1], xp.dtype, bp, opts, spec.interpret)
  unit = gemm.row_unit(cfg, spec.interpret)
  units = cdiv(e.shape[0], unit)
  flags = jnp.any(jnp.pad(bad, (0, units * unit - e.shape[0])).reshape(units, unit), axis=1).astype(jnp.int32)
  e = _repair(e, flags, cfg, xp, wp, bp, yp, st.lse, coef, a, c, layout, opts, spec.interpret)
  sigma = jnp.where(jnp.repeat(flags, unit)[:e.shape[0]] != 0, 1.0, sigma)
  want_dx, want_dw = want
  dx = dw = None
  # The order of the two products sets the memory. dx on the GEMM is written once, in x's dtype (σ applied in its
  # epilogue): it goes last, so that σ·x, dead by then, can share dx's output buffer (XLA may put a temporary in an
  # output's buffer before that output is written), and the backward adds nothing beyond E and O(B) vectors
  # (llama3-8b, gemma2-2b). XLA's dx is a float32 product then scaled: it goes first, while dw's output buffer can
  # hold it.
  # (The "tokens" design, which passes dw_acc, carries its buffers through a loop: no order is imposed there.)
  fused = p.products[0] == "gemm"
  ordered = want_dx and want_dw and dw_acc is None
  if want_dx and not fused:
    dx = op.product_dx(e, wp, layout, p.products[0], spec.interpret, scale=sigma, out_dtype=xp.dtype)
    if ordered:
      e, dx = lax.optimization_barrier((e, dx))
  if want_dw:
    xs = (xp.astype(F32) * sigma[:, None]).astype(xp.dtype)
    dw = op.product_dw(xs, e, layout, p.products[1], spec.interpret, dw_dtype, acc=dw_acc)
    if ordered and fused:
      e, dw = lax.optimization_barrier((e, dw))
  db = None if bp is None else jnp.einsum("b,bv->v", sigma.astype(e.dtype), e, preferred_element_type=F32)
  if want_dx and fused:
    dx = op.product_dx(e, wp, layout, p.products[0], spec.interpret, scale=sigma, out_dtype=xp.dtype)
  return dx, dw, db


def _read_as(d: kernels.Dims, p: op.Plan, stored_cols: int):
  """The Dims and Plan the dz pass reads stored tiles of ``stored_cols`` columns with."""
  if p.gemm is None:
    return d, p
  return dataclasses.replace(d, vp=stored_cols), dataclasses.replace(p, block_v=p.gemm.tile_n)


def _dz(zb, mt, lse, yp, g_loss, g_lse, d: kernels.Dims, p: op.Plan, opts):
  """dz (over the stored tiles, in place) and the dbias column sums for per-token cotangents of loss and lse."""
  coef, a, c = epilogue.row_coefficients(lse, yp, g_loss, g_lse, opts)
  return _dz_pass(zb, mt, lse, yp, coef, a, c, d, p, opts)


def _stored_dz(xp, wp, bp, yp, wts, d: kernels.Dims, p: op.Plan, opts):
  """Forward with stores + the dz pass over rows ``xp`` (weights as the loss cotangents): (TokenOut, dz [rows, vp]
  in x's dtype, dbias)."""
  stats, zb, mt, d, p = _stored(xp, wp, bp, yp, d, p, opts)
  out = _math.finalize(stats, yp, opts)
  dz, db = _dz(zb, mt, out.lse, yp, wts, jnp.zeros_like(wts), d, p, opts)
  return out, dz, db


def _fast_forward(x, w, bias, labels, weights, spec: common.Spec, p: op.Plan):
  """(Σ weights·loss, TokenOut, residuals) of the design ``p.fast_design``."""
  opts = spec.opts
  b = x.shape[0]
  xp, wp, bp, yp, d = op.prepare(x, w, bias, labels, spec, p, store=True)
  wts = jnp.pad(weights.astype(F32), (0, d.b - b))  # padding rows: weight 0 (and label -1): dz = 0
  probs = op.stores_probs(p, opts, x.dtype)
  if p.fast_design == "logits":  # dz is formed in the backward, for any per-token cotangent
    if probs:
      out, stored = _stored_probs(xp, wp, bp, yp, d, p, opts, spec.w_layout)
    else:
      stats, zb, mt, _, _ = _stored(xp, wp, bp, yp, d, p, opts)
      out = _math.finalize(stats, yp, opts)
      stored = (zb, mt, out.lse)
    res = (stored, yp, wts, xp, wp, bp)
  else:
    chunk = p.token_chunk
    n = cdiv(d.b, chunk)
    pad = n * chunk - d.b
    xs = jnp.pad(xp, ((0, pad), (0, 0))).reshape(n, chunk, d.h)
    ys = jnp.pad(yp, (0, pad), constant_values=_math.IGNORED).reshape(n, chunk)
    ws = jnp.pad(wts, (0, pad)).reshape(n, chunk)
    dc = dataclasses.replace(d, b=chunk)
    # the reference logits of all chunks at once: one gather of w's columns, not one per chunk (8 of them took
    # 1.16 ms at llama3-8b, 32768 tokens, on an H100: benchmarks/results/h100-2026-11-24-r5-tokens/)
    if probs:
      refs = jnp.pad(_reference(xp, wp, bp, yp, spec.w_layout, opts, d.v), (0, pad)).reshape(n, chunk)

    def step(i, dw, db, dx):
      """Chunk ``i``: its TokenOut, and dw, dbias and the dx rows with its share added. ``dw`` None (the first
      chunk): its float32 product is the dw, so no buffer of zeros is written and read (2.1 GB twice at llama3-8b)."""
      xc, yc, wc = (lax.dynamic_index_in_dim(t, i, keepdims=False) for t in (xs, ys, ws))
      if dw is not None:
        # the chunk's forward starts once the previous chunk's products are done, so that one chunk's stored
        # tiles are alive at a time: with nothing else ordering them (two chunks: the loop after the first has
        # one trip, which XLA inlines), XLA's GPU scheduler formed the next chunk's tiles beside the last's (two
        # 1 GiB buffers in the example trainer's step on two GPUs, benchmarks/results/trainer-scaling-2026-11-27/)
        xc, dw, dx = lax.optimization_barrier((xc, dw, dx))
      if probs:
        rc = lax.dynamic_index_in_dim(refs, i, keepdims=False)
        out, st = _stored_probs(xc, wp, bp, yc, dc, p, opts, spec.w_layout, ref=rc)
        dxc, dw, dbc = _grads_from_probs(st, xc, wp, bp, yc, wc, jnp.zeros_like(wc), spec, p, F32, dw_acc=dw)
      else:
        out, dz, dbc = _stored_dz(xc, wp, bp, yc, wc, dc, p, opts)
        dw = op.product_dw(xc, dz, spec.w_layout, p.products[1], spec.interpret, F32, acc=dw)
        dxc = op.product_dx(dz, wp, spec.w_layout, p.products[0], spec.interpret)
      db = dbc if db is None else db + dbc
      return out, dw, db, lax.dynamic_update_index_in_dim(dx, dxc.astype(xp.dtype), i, 0)

    out0, dw, db, dx = step(0, None, None, jnp.zeros((n, chunk, d.h), xp.dtype))
    outs = jax.tree.map(lambda t: jnp.zeros((n, *t.shape), t.dtype).at[0].set(t), out0)

    def body(i, carry):
      outs, dw, db, dx = carry
      out, dw, db, dx = step(i, dw, db, dx)
      return jax.tree.map(lambda a, t: lax.dynamic_update_index_in_dim(a, t, i, 0), outs, out), dw, db, dx

    outs, dw, db, dx = lax.fori_loop(1, n, body, (outs, dw, db, dx))
    out = jax.tree.map(lambda t: t.reshape(n * chunk), outs)
    res = (dx.reshape(n * chunk, d.h), dw, db)
  out = _math.TokenOut(*(t[:b] for t in out))
  total = jnp.sum(weights.astype(F32) * out.loss)
  return total, out, res


def fast_forward(x, w, bias, labels, weights, spec: common.Spec, p: op.Plan, axes: tuple[str, ...] = ()):
  """``(Σ weights·loss, TokenOut, residuals)`` of the design ``p.fast_design`` (x and w bf16 or fp16, one dtype;
  a whole vocabulary: the registry gives this backend no vocab-parallel fast design)."""
  if axes:
    raise NotImplementedError("pallas_mosaic has no vocab-parallel fast design")
  if p.fast_design is None:
    raise ValueError("a plan of the lean design cannot run mode='fast'")
  return _fast_forward(x, w, bias, labels, weights, spec, p)


def fast_backward(residuals, g_total, spec: common.Spec, p: op.Plan, primals, g_tokens=None):
  """(dx, dw, dbias): the "logits" design forms dz from the stored tiles now, for the cotangent ``g_total`` of the
  weighted sum and, when given, ``g_tokens`` = (cotangents of the per-token losses, of the lse), and then its two
  products; the "tokens" design scales the gradients it formed in the forward by ``g_total``."""
  (b, h), v, bias_dtype = primals.x_shape, spec.opts.vocab_size, primals.bias_dtype  # (a whole vocabulary)
  gt = g_total.astype(F32)
  if p.fast_design == "logits":
    stored, yp, wts, xp, wp, bp = residuals
    g_loss, g_lse = wts * gt, jnp.zeros_like(wts)
    if g_tokens is not None:
      pad = (0, yp.shape[0] - b)
      g_loss = g_loss + jnp.pad(g_tokens[0].astype(F32), pad)
      g_lse = jnp.pad(g_tokens[1].astype(F32), pad)
    if isinstance(stored, _Probs):
      want = (primals.x_grad, primals.w_grad)
      dx, dw, db = _grads_from_probs(stored, xp, wp, bp, yp, g_loss, g_lse, spec, p, wp.dtype, want=want)
      # (a gradient not asked for: zeros, which nothing reads)
      dx = jnp.zeros(xp.shape, xp.dtype) if dx is None else dx
      dw = jnp.zeros(wp.shape, wp.dtype) if dw is None else dw
    else:
      zb, mt, lse = stored
      hp = wp.shape[0] if spec.w_layout == "hv" else wp.shape[1]
      d = kernels.Dims(yp.shape[0], hp, v, zb.shape[1], spec.w_layout, bias_dtype is not None, spec.interpret, True)
      d, pr = _read_as(d, p, zb.shape[1])
      dz, db = _dz(zb, mt, lse, yp, g_loss, g_lse, d, pr, spec.opts)
      dw = op.product_dw(xp, dz, spec.w_layout, p.products[1], spec.interpret, wp.dtype)
      dx = op.product_dx(dz, wp, spec.w_layout, p.products[0], spec.interpret)
    dx = dx.astype(xp.dtype)
    dbias = None if db is None else db.astype(bias_dtype)
  else:  # "tokens": formed in the forward (x and w share the kernels' dtype)
    dx, dw, db = residuals
    scale = lambda t, dtype: (t.astype(F32) * gt).astype(dtype)
    dx, dw = scale(dx, dx.dtype), scale(dw, dx.dtype)
    if primals.x_grad and primals.w_grad:
      # dw is scaled before dx leaves, so that its reduction over the token axes of a mesh (which follows this
      # backward) can start beside the backward of the layers below: XLA's GPU scheduler otherwise put this
      # small scaling, and so the reduction, after that whole backward (the example trainer's step on two GPUs,
      # benchmarks/results/trainer-scaling-2026-11-27/run8_no_host_waits_a33e087/)
      dx, dw = lax.optimization_barrier((dx, dw))
    dbias = None if db is None else scale(db, bias_dtype)
  dw = dw[:h, :v] if spec.w_layout == "hv" else dw[:v, :h]
  return dx[:b, :h], dw, None if dbias is None else dbias[:v]
