"""``impl="triton"``: the op as raw Triton kernels (``triton.jit``) called through jax-triton, NVIDIA SM80+.

The same design as ``impl="pallas_triton"`` (:mod:`lce_flax._impl.pallas_triton`), written directly in Triton instead of
being lowered from Pallas; only the two kernels differ, everything around them is shared:

Forward (``_fwd_kernel``)
  A 1-D grid of ``row_blocks × num_splits`` programs, split-fastest (``pid = i·S + j``). Program ``(i, j)`` walks
  the ``j``-th contiguous split of the vocabulary tiles for the ``block_t`` tokens of row block ``i``; each
  ``[block_t, block_v]`` tile of logits is accumulated in float32 registers over H in ``block_k`` steps
  (``tl.dot``: WGMMA on Hopper, its operands brought into shared memory by the software pipeline), gets its bias
  and soft cap, and is reduced on chip to the row statistics of :func:`lce_flax._math.tile_stats`, merged into the
  running ones as :func:`lce_flax._math.merge_stats` does (online logsumexp). 4 float32 per token and split leave
  the chip; JAX merges the splits and finalises with ``_math`` (:func:`lce_flax._impl.pallas_triton.merge_splits`).

Backward (``_dz_kernel`` inside :func:`lce_flax._impl.pallas_triton.lean_with`)
  The recompute ``jax.custom_vjp`` of ``pallas_triton`` with this module's launchers: per vocabulary chunk the
  dz kernel recomputes the chunk's logits tile by tile (grouped tile order for L2 reuse) and writes the logit
  gradient of :func:`lce_flax._math.dlogits` in the input dtype (and per row block column sums for dbias); XLA
  matmuls then write the chunk's dw columns and add into a float32 dx. ``Config(dx_kernel=True)`` and
  ``Config(low_memory=True)`` are ``pallas_triton``'s variants with this module's dz kernel (their in-place dx
  accumulation is ``pallas_triton``'s Pallas kernel).

The tile math is the ``_math`` formulas written out in ``triton.language`` (Triton kernels cannot call ``jnp``);
the GPU tests (``tests/test_triton_kernels.py``) check every option against the float64 oracle.

Why pointer loads and not TMA: jax-triton 0.3.1 builds its ``TritonKernel`` without the kernel's
``global_scratch_size`` (jaxlib has accepted it since 0.10, but jax-triton does not pass it), so a kernel that
creates device-side tensor descriptors (``tl.make_tensor_descriptor``) would get a null scratch pointer, and host
descriptors are not among the argument types ``triton_call`` accepts. See ``benchmarks/NOTES_triton_raw.md``.

Precision: float32 accumulation everywhere. bf16/fp16 inputs multiply on the tensor cores. Float32 inputs follow
``jax.default_matmul_precision`` like ``pallas_triton``: TF32 by default, exact IEEE float32 products (FMA, slow)
under ``"highest"``/``"float32"``.

Needs ``jax_triton`` (the ``[gpu]`` extra) and a CUDA GPU; elsewhere :func:`supported` raises
``NotImplementedError`` naming what is missing, so ``impl="auto"`` skips this backend.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from lce_flax import _device, _math
from lce_flax._impl import common, pallas_triton
from lce_flax._impl.common import F32

fast = None  # api.py runs ``lean`` and reduces; the gradient comes from the recompute backward

try:
  import triton
  import triton.language as tl
  from triton.language.extra import libdevice
except ImportError as _e:  # no triton: supported() says so
  triton = None
  _TRITON_IMPORT_ERROR = _e
else:
  _TRITON_IMPORT_ERROR = None


@dataclasses.dataclass(frozen=True)
class Config(pallas_triton.Config):
  """``pallas_triton``'s configuration (same fields and heuristic: :func:`lce_flax._impl.pallas_triton.plan`, including
  ``dx_kernel`` and ``low_memory``, whose backward is shared), plus:

  Attributes:
    bwd_num_stages: pipelining stages of the backward dz kernel (default: ``num_stages``, itself 3 here).
  """

  bwd_num_stages: int | None = None


@dataclasses.dataclass(frozen=True)
class Plan(pallas_triton.Plan):
  """A resolved :class:`Config` (hashable): ``pallas_triton``'s plan plus the raw kernels' own fields."""

  bwd_num_stages: int = 3
  input_precision: str = "tf32"  # tl.dot's for float32 inputs: "tf32" or "ieee"


def _input_precision() -> str:
  prec = jax.config.jax_default_matmul_precision
  return "ieee" if prec is not None and str(prec).lower() in ("highest", "float32") else "tf32"


def plan(num_tokens: int, hidden: int, vocab: int, dtype, config: Config | None = None) -> Plan:
  """Block sizes for one shape: ``pallas_triton``'s heuristic (the same tiles) but 3 pipeline stages, any
  ``config`` field first."""
  c = config or Config()
  base = pallas_triton.plan(num_tokens, hidden, vocab, dtype, c)
  # 3 stages on every GPU: on the H100 (llama3-8b, run 1) 3 stages beat pallas_triton's SM90 default of 4 by
  # 0.9 ms in the forward and 0.5 ms in the dz kernels (benchmarks/NOTES_triton_raw.md).
  stages = c.num_stages or 3
  fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
  return Plan(**dict(fields, num_stages=stages), bwd_num_stages=c.bwd_num_stages or stages,
              input_precision=_input_precision())


def _jax_triton():
  try:
    import jax_triton  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise NotImplementedError(
        f"impl='triton' needs the jax-triton package (pip install 'lce_flax[gpu]') and a CUDA build of jaxlib: "
        f"{e}") from e
  return jax_triton


def supported(spec: common.Spec, platform: str) -> None:
  """Raises ``NotImplementedError`` unless raw Triton kernels can run here (CUDA GPU, SM80+, jax-triton)."""
  if platform != "gpu" or spec.interpret:
    raise NotImplementedError(
        f"impl='triton' runs raw Triton kernels, which need an NVIDIA GPU (platform={platform!r}, "
        f"interpret={spec.interpret}); it has no interpret mode: use impl='pallas_triton' (interpret=True) or "
        "impl='chunked' here")
  if triton is None:
    raise NotImplementedError(f"impl='triton' needs the triton package: {_TRITON_IMPORT_ERROR}")
  _jax_triton()
  cc = _device.compute_capability()
  if cc is None or cc < (8, 0):
    raise NotImplementedError(f"impl='triton' needs an NVIDIA GPU with compute capability >= 8.0, got {cc}")


# ------------------------------------------------------------------------------------------------ kernels

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
    return (m == m) & (tl.abs(m) < float("inf"))

  @triton.jit
  def _fwd_kernel(x_ptr, w_ptr, b_ptr, y_ptr, m_ptr, s_ptr, t_ptr, zs_ptr,
                  B: tl.constexpr, H: tl.constexpr, V: tl.constexpr, HV: tl.constexpr, HAS_BIAS: tl.constexpr,
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
                 B: tl.constexpr, H: tl.constexpr, V: tl.constexpr, HV: tl.constexpr, HAS_BIAS: tl.constexpr,
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
    # and vectorises the loads of w (see NOTES_triton.md on the loaded-offset slowdown).
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
      dz = dz - (EPS / V) * g_loss[:, None]
    if HAS_CAP:
      dz = dz * (1.0 - (zc / CAP) * (zc / CAP))
    dz = tl.where(cmask[None, :], dz, 0.0)
    dz = tl.where((labels >= V)[:, None], float("nan"), dz)
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


def _kernel_options(spec: common.Spec, has_bias: bool, b: int, h: int) -> dict:
  opts = spec.opts
  return dict(B=b, H=h, V=opts.vocab_size, HV=spec.w_layout == "hv", HAS_BIAS=has_bias,
              HAS_CAP=opts.logit_softcap is not None,
              CAP=1.0 if opts.logit_softcap is None else float(opts.logit_softcap))


def _bias_or_dummy(bias):
  # triton_call flattens its arguments as a pytree, where None is no leaf: pass a placeholder instead.
  return jnp.zeros((1,), F32) if bias is None else bias


def _forward(x, w, bias, labels, spec: common.Spec, p: Plan) -> _math.TokenOut:
  jt = _jax_triton()
  b, h = x.shape
  nb = pallas_triton._cdiv(b, p.block_t)  # pylint: disable=protected-access
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
      **_kernel_options(spec, bias is not None, b, h),
  )
  return pallas_triton.merge_splits(outs, b, p, labels, spec.opts)


def _dz_chunk(k, width: int, x, w, bias, labels, lse, g_loss, g_lse, spec: common.Spec, p: Plan):
  """(dz [B, width] in x.dtype, dbias [width] float32 or None) of the columns [k·chunk, k·chunk + width)."""
  jt = _jax_triton()
  b, h = x.shape
  nb = pallas_triton._cdiv(b, p.block_t)  # pylint: disable=protected-access
  nct = pallas_triton._cdiv(width, p.block_v)  # pylint: disable=protected-access
  out_shape = [jax.ShapeDtypeStruct((b, width), x.dtype), jax.ShapeDtypeStruct((nb * nct * p.block_v,), F32)]
  if bias is None:
    out_shape[1] = jax.ShapeDtypeStruct((1,), F32)  # unused
  dz, db = jt.triton_call(
      jnp.reshape(k, (1,)).astype(jnp.int32), x, w, _bias_or_dummy(bias), labels, lse, g_loss, g_lse,
      kernel=_dz_kernel,
      out_shape=out_shape,
      grid=(nb * nct,),
      num_warps=p.num_warps,
      num_stages=p.bwd_num_stages,
      name="lce_triton_backward_dz",
      EPS=float(spec.opts.label_smoothing), ZL=float(spec.opts.z_loss),
      WIDTH=width, CHUNK=p.chunk_size, G=p.group_t,
      BT=p.block_t, BV=p.block_v, BK=p.block_k, PREC=p.input_precision,
      **_kernel_options(spec, bias is not None, b, h),
  )
  if bias is None:
    return dz, None
  return dz, db.reshape(nb, nct * p.block_v)[:, :width].sum(0)


KERNELS = pallas_triton.Kernels(_forward, _dz_chunk) if triton is not None else None


def lean(x, w, bias, labels, spec: common.Spec, config: Config | None = None) -> _math.TokenOut:
  """Per-token loss, lse and correctness; differentiable in x, w and bias with any cotangent on loss and lse."""
  supported(spec, _device.platform())
  p = plan(x.shape[0], x.shape[1], spec.opts.vocab_size, x.dtype, config)
  return pallas_triton.lean_with(KERNELS, x, w, bias, labels, spec, p)
