"""The raw Triton kernels of ``impl="triton"`` (``triton.jit``) and their jax-triton launchers.

``_fwd_kernel`` (forward) and ``_dz_kernel`` (the backward's logit gradient of one vocabulary chunk) are the
kernels of :mod:`lce_flax._impl.pallas_triton.kernels` written directly in Triton, with the same grid, program
order and tiling (see :mod:`lce_flax._impl.triton.op`); :func:`forward` and :func:`dz_chunk` are the launchers
that ``pallas_triton``'s recompute ``custom_vjp`` calls (:data:`KERNELS`).

The tile math is the ``_math`` formulas written out in ``triton.language`` (Triton kernels cannot call ``jnp``):
:func:`lce_flax._math.tile_stats` and :func:`~lce_flax._math.merge_stats` (online logsumexp) in the forward,
:func:`lce_flax._math.dlogits` in the backward; the GPU tests check every option against the float64 oracle.

Why pointer loads and not TMA: jax-triton 0.3.1 builds its ``TritonKernel`` without the kernel's
``global_scratch_size`` (jaxlib has accepted it since 0.10, but jax-triton does not pass it), so a kernel that
creates device-side tensor descriptors (``tl.make_tensor_descriptor``) would get a null scratch pointer, and host
descriptors are not among the argument types ``triton_call`` accepts.

Importing this module never fails: without ``triton`` the kernels are not defined (``triton`` is None and
:data:`KERNELS` is None), and :func:`jax_triton` raises ``NotImplementedError`` naming the missing package.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lce_flax import _math
from lce_flax._impl import common
from lce_flax._impl.common import F32, cdiv
from lce_flax._impl.pallas_triton import op as pallas_triton_op

try:
  import triton
  import triton.language as tl
  from triton.language.extra import libdevice
except ImportError as _e:  # no triton: op.supported() says so
  triton = None
  TRITON_IMPORT_ERROR = _e
else:
  TRITON_IMPORT_ERROR = None


def jax_triton():
  """The ``jax_triton`` module, or ``NotImplementedError`` naming the package to install."""
  try:
    import jax_triton as jt  # (optional dependency, imported on first use)
  except ImportError as e:
    raise NotImplementedError(
        f"impl='triton' needs the jax-triton package (pip install 'lce_flax[gpu]') and a CUDA build of jaxlib: "
        f"{e}") from e
  return jt


if triton is not None:

  @triton.jit
  def _load_tile(ptrs, m0, m1, USE0: tl.constexpr, USE1: tl.constexpr):
    """``tl.load`` with the masks that are needed (static flags), zeros elsewhere."""
    if USE0:
      if USE1:
        v = tl.load(ptrs, mask=m0 & m1, other=0.0)
      else:
        v = tl.load(ptrs, mask=m0, other=0.0)
    else:
      if USE1:
        v = tl.load(ptrs, mask=m1, other=0.0)
      else:
        v = tl.load(ptrs)
    return v

  @triton.jit
  def _logits(x_ptr, w_ptr, b_ptr, rows, cols, rmask, cmask,
              H: tl.constexpr, V: tl.constexpr, HV: tl.constexpr, HAS_BIAS: tl.constexpr,
              MASK_R: tl.constexpr, MASK_C: tl.constexpr,
              BT: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    """float32 ``x[rows] @ w[:, cols] (+ bias)`` [BT, BV]; ``rows``/``cols`` are global indices."""
    ks = tl.arange(0, BK)
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * H + ks[None, :]
    if HV:  # w [H, V]: a [BK, BV] tile, contiguous along V
      w_ptrs = w_ptr + ks.to(tl.int64)[:, None] * V + cols[None, :]
    else:  # w [V, H]: a [BV, BK] tile, contiguous along H, transposed for the dot
      w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * H + ks[None, :]
    EVEN_K: tl.constexpr = H % BK == 0
    acc = tl.zeros((BT, BV), dtype=tl.float32)
    for k0 in range(0, H, BK):
      kmask = (k0 + ks) < H
      xt = _load_tile(x_ptrs, rmask[:, None], kmask[None, :], MASK_R, not EVEN_K)
      if HV:
        wt = _load_tile(w_ptrs, kmask[:, None], cmask[None, :], not EVEN_K, MASK_C)
        acc = tl.dot(xt, wt, acc, input_precision=PREC)
      else:
        wt = _load_tile(w_ptrs, cmask[:, None], kmask[None, :], MASK_C, not EVEN_K)
        acc = tl.dot(xt, tl.trans(wt), acc, input_precision=PREC)
      x_ptrs += BK
      if HV:
        w_ptrs += BK * V
      else:
        w_ptrs += BK
    if HAS_BIAS:
      if MASK_C:
        bias = tl.load(b_ptr + cols, mask=cmask, other=0.0)
      else:
        bias = tl.load(b_ptr + cols)
      acc += bias.to(tl.float32)[None, :]
    return acc

  @triton.jit
  def _softcap(z, HAS_CAP: tl.constexpr, CAP: tl.constexpr):
    """``_math.softcap``: ``c·tanh(z/c)``."""
    if HAS_CAP:
      z = CAP * libdevice.tanh(z / CAP)
    return z

  @triton.jit
  def _finite(m):
    return (m == m) & (tl.abs(m) < float("inf"))  # noqa: PLR0124  (m == m: not NaN)

  @triton.jit
  def _fwd_kernel(x_ptr, w_ptr, b_ptr, y_ptr, m_ptr, s_ptr, t_ptr, zs_ptr,
                  B: tl.constexpr, H: tl.constexpr, V: tl.constexpr, VL: tl.constexpr, HV: tl.constexpr,
                  HAS_BIAS: tl.constexpr,
                  SMOOTH: tl.constexpr, HAS_CAP: tl.constexpr, CAP: tl.constexpr,
                  BT: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr, S: tl.constexpr, PREC: tl.constexpr):
    """Partial row stats (``_math.RowStats``) of row block ``pid // S`` over the vocabulary split ``pid % S``."""
    NB: tl.constexpr = (B + BT - 1) // BT
    NVT: tl.constexpr = (V + BV - 1) // BV
    TPS: tl.constexpr = (NVT + S - 1) // S  # vocabulary tiles per split
    MASK_R: tl.constexpr = B % BT != 0
    MASK_C: tl.constexpr = V % BV != 0
    pid = tl.program_id(0)
    i = pid // S  # split-fastest: resident programs share row blocks (see pallas_triton's docstring)
    j = pid % S
    rows = i * BT + tl.arange(0, BT)
    rmask = rows < B
    labels = tl.load(y_ptr + rows, mask=rmask, other=-1)
    m_run = tl.full((BT,), float("-inf"), tl.float32)
    s_run = tl.zeros((BT,), tl.float32)
    t_run = tl.zeros((BT,), tl.float32)
    zs_run = tl.zeros((BT,), tl.float32)
    t_lo = j * TPS
    t_hi = tl.minimum(t_lo + TPS, NVT)
    for t in range(t_lo, t_hi):
      cols = t * BV + tl.arange(0, BV)
      cmask = cols < V
      z = _logits(x_ptr, w_ptr, b_ptr, rows, cols, rmask, cmask, H, V, HV, HAS_BIAS, MASK_R, MASK_C, BT, BV, BK,
                  PREC)
      zc = _softcap(z, HAS_CAP, CAP)
      # _math.tile_stats
      if MASK_C:
        masked = tl.where(cmask[None, :], zc, float("-inf"))
      else:
        masked = zc
      m_t = tl.max(masked, axis=1)
      m_t_safe = tl.where(_finite(m_t), m_t, 0.0)
      s_t = tl.sum(tl.exp(masked - m_t_safe[:, None]), axis=1)
      hit = (cols[None, :] == labels[:, None]) & cmask[None, :]
      t_run += tl.sum(tl.where(hit, zc, 0.0), axis=1)
      if SMOOTH:
        if MASK_C:
          zs_run += tl.sum(tl.where(cmask[None, :], zc, 0.0), axis=1)
        else:
          zs_run += tl.sum(zc, axis=1)
      # _math.merge_stats
      m_new = tl.maximum(m_run, m_t)
      m_safe = tl.where(_finite(m_new), m_new, 0.0)
      s_run = s_run * tl.exp(m_run - m_safe) + s_t * tl.exp(m_t - m_safe)
      m_run = m_new
    o = (j * NB + i) * BT + tl.arange(0, BT)  # outputs are padded to whole row blocks: no store mask
    tl.store(m_ptr + o, m_run)
    tl.store(s_ptr + o, s_run)
    tl.store(t_ptr + o, t_run)
    tl.store(zs_ptr + o, zs_run)

  @triton.jit
  def _dz_kernel(k_ptr, x_ptr, w_ptr, b_ptr, y_ptr, lse_ptr, gl_ptr, gs_ptr, dz_ptr, db_ptr,
                 B: tl.constexpr, H: tl.constexpr, V: tl.constexpr, VL: tl.constexpr, HV: tl.constexpr,
                 HAS_BIAS: tl.constexpr,
                 EPS: tl.constexpr, ZL: tl.constexpr, HAS_CAP: tl.constexpr, CAP: tl.constexpr,
                 WIDTH: tl.constexpr, CHUNK: tl.constexpr, G: tl.constexpr,
                 BT: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    """One [BT, BV] tile of ``_math.dlogits`` for the chunk ``[k·CHUNK, k·CHUNK + WIDTH)``, k read from k_ptr."""
    NB: tl.constexpr = (B + BT - 1) // BT
    NCT: tl.constexpr = (WIDTH + BV - 1) // BV
    MASK_R: tl.constexpr = B % BT != 0
    MASK_C: tl.constexpr = WIDTH % BV != 0
    # Grouped order: G row blocks × all tiles of the chunk are resident together (L2 reuse of w and x).
    pid = tl.program_id(0)
    per_group = G * NCT
    g = pid // per_group
    first = g * G
    gsize = tl.minimum(NB - first, G)
    local = pid % per_group
    i = first + local % gsize
    t = local // gsize
    # The chunk's first column as loaded index × constexpr chunk: Triton sees that it is a multiple of CHUNK
    # and vectorises the loads of w (a loaded offset made the backward ~3× slower on an H100).
    off = tl.load(k_ptr) * CHUNK
    rows = i * BT + tl.arange(0, BT)
    rmask = rows < B
    lcols = t * BV + tl.arange(0, BV)
    cmask = lcols < WIDTH
    cols = off + lcols
    z = _logits(x_ptr, w_ptr, b_ptr, rows, cols, rmask, cmask, H, V, HV, HAS_BIAS, MASK_R, MASK_C, BT, BV, BK,
                PREC)
    labels = tl.load(y_ptr + rows, mask=rmask, other=-1)
    lse = tl.load(lse_ptr + rows, mask=rmask, other=0.0)
    g_loss = tl.load(gl_ptr + rows, mask=rmask, other=0.0)
    g_lse = tl.load(gs_ptr + rows, mask=rmask, other=0.0)
    # _math.dlogits
    zc = _softcap(z, HAS_CAP, CAP)
    g_loss = tl.where(labels >= 0, g_loss, 0.0)
    if ZL != 0.0:
      coef = g_loss * (1.0 + 2.0 * ZL * lse) + g_lse
    else:
      coef = g_loss + g_lse
    p = tl.exp(zc - lse[:, None])
    dz = p * coef[:, None] - tl.where(cols[None, :] == labels[:, None], (1.0 - EPS) * g_loss[:, None], 0.0)
    if EPS != 0.0:
      dz = dz - (EPS / VL) * g_loss[:, None]
    if HAS_CAP:
      dz = dz * (1.0 - (zc / CAP) * (zc / CAP))
    dz = tl.where(cmask[None, :], dz, 0.0)
    dz = tl.where((labels >= VL)[:, None], float("nan"), dz)
    dz_ptrs = dz_ptr + rows.to(tl.int64)[:, None] * WIDTH + lcols[None, :]
    out = dz.to(dz_ptr.dtype.element_ty)
    if MASK_R:
      if MASK_C:
        tl.store(dz_ptrs, out, mask=rmask[:, None] & cmask[None, :])
      else:
        tl.store(dz_ptrs, out, mask=rmask[:, None])
    else:
      if MASK_C:
        tl.store(dz_ptrs, out, mask=cmask[None, :])
      else:
        tl.store(dz_ptrs, out)
    if HAS_BIAS:
      # Padding rows may hold inf·0 = NaN (their lse is a placeholder): keep them out of the column sums.
      col_sum = tl.sum(tl.where(rmask[:, None], dz, 0.0), axis=0)
      tl.store(db_ptr + (i * NCT + t) * BV + tl.arange(0, BV), col_sum)


def _kernel_options(spec: common.Spec, w, has_bias: bool, b: int, h: int) -> dict:
  # V: the columns w holds; VL: the label space (out-of-range labels, ε/V), larger on a vocabulary shard
  opts = spec.opts
  return {"B": b, "H": h, "V": common.vocab_size(w, spec.w_layout), "VL": opts.vocab_size,
          "HV": spec.w_layout == "hv", "HAS_BIAS": has_bias,
          "HAS_CAP": opts.logit_softcap is not None,
          "CAP": 1.0 if opts.logit_softcap is None else float(opts.logit_softcap)}


def _bias_or_dummy(bias):
  # triton_call flattens its arguments as a pytree, where None is no leaf, and a Triton kernel has one fixed
  # signature: a placeholder takes the bias's place (HAS_BIAS=False: never read).
  return jnp.zeros((1,), F32) if bias is None else bias


def forward(x, w, bias, labels, spec: common.Spec, p) -> _math.RowStats:
  """Row statistics of the columns of ``w`` (``p``: a :class:`lce_flax._impl.triton.op.Plan`)."""
  jt = jax_triton()
  b, h = x.shape
  nb = cdiv(b, p.block_t)
  n = p.num_splits * nb * p.block_t
  outs = jt.triton_call(
      x, w, _bias_or_dummy(bias), labels,
      kernel=_fwd_kernel,
      out_shape=[jax.ShapeDtypeStruct((n,), F32)] * 4,
      grid=(nb * p.num_splits,),
      num_warps=p.num_warps,
      num_stages=p.num_stages,
      name="lce_triton_forward",
      SMOOTH=spec.opts.needs_logit_sum,
      BT=p.block_t, BV=p.block_v, BK=p.block_k, S=p.num_splits, PREC=p.input_precision,
      **_kernel_options(spec, w, bias is not None, b, h),
  )
  return common.merge_splits([o.reshape(p.num_splits, nb * p.block_t)[:, :b] for o in outs])


def dz_chunk(k, width: int, x, w, bias, labels, lse, g_loss, g_lse, spec: common.Spec, p):
  """(dz [B, width] in x.dtype, per-row-block column sums [row_blocks, ≥ width] float32 or None) of the columns
  ``[k·chunk, k·chunk + width)``."""
  jt = jax_triton()
  b, h = x.shape
  nb = cdiv(b, p.block_t)
  nct = cdiv(width, p.block_v)
  # without a bias the column sums' output is a placeholder too (the kernel's signature is fixed)
  db_size = nb * nct * p.block_v if bias is not None else 1
  dz, db = jt.triton_call(
      jnp.reshape(k, (1,)).astype(jnp.int32), x, w, _bias_or_dummy(bias), labels, lse, g_loss, g_lse,
      kernel=_dz_kernel,
      out_shape=[jax.ShapeDtypeStruct((b, width), x.dtype), jax.ShapeDtypeStruct((db_size,), F32)],
      grid=(nb * nct,),
      num_warps=p.num_warps,
      num_stages=p.bwd_num_stages,
      name="lce_triton_backward_dz",
      EPS=float(spec.opts.label_smoothing), ZL=float(spec.opts.z_loss),
      WIDTH=width, CHUNK=p.vocab_chunk, G=p.group_t,
      BT=p.block_t, BV=p.block_v, BK=p.block_k, PREC=p.input_precision,
      **_kernel_options(spec, w, bias is not None, b, h),
  )
  return dz, (db.reshape(nb, nct * p.block_v) if bias is not None else None)


KERNELS = pallas_triton_op.Kernels(forward, dz_chunk) if triton is not None else None
