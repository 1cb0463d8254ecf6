"""The loss math of :mod:`lce_flax._math`, written with the ops Mosaic GPU lowers on register tiles.

The epilogues of ``impl="pallas_mosaic"``'s kernels run on a float32 ``[block_t, block_v]`` WGMMA accumulator
that never leaves the registers. Per-row values enter a tile through ``lax.broadcast_in_dim`` (no reshapes, no
``[:, None]``), and there is no ``isfinite``: only ``m = -inf`` is special-cased. The tests check every function
here against :func:`lce_flax._math.tile_stats`, :func:`~lce_flax._math.merge_stats` and
:func:`~lce_flax._math.dlogits` on random tiles.

* forward: :func:`epilogue_stats` (a tile's row statistics), :func:`merge` (online logsumexp), and
  :func:`shifted_logits` (what the fast forward stores of a tile);
* backward: :func:`row_coefficients` (per-token factors of the logit gradient, computed once per call) and
  :func:`epilogue_dlogits` / :func:`dlogits_capped` (a tile's logit gradient from them).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from lce_flax import _math
from lce_flax._impl.common import F32

LOG2E = math.log2(math.e)


# Every kernel here runs its epilogue with ``approx_math``: ``exp2`` is the hardware's ``ex2.approx`` (relative error
# ~2⁻²², as Triton's ``exp``) and ``rsqrt`` its ``rsqrt.approx``, several times cheaper than the accurate library
# routines. Mosaic's approximate ``tanh`` (~5e-4 relative) would be too coarse for a soft cap of 30, so the kernels
# never call ``jnp.tanh``: the cap goes through :func:`softcap`, built on those two units.
APPROX_MATH = True


def tanh(x):
  """``tanh`` of a float32 tile for the epilogues: ``sign(x)·(1 - 2u)`` with ``u = e/(1 + e)``, ``e = exp(-2|x|)``,
  the reciprocal as ``rsqrt(1 + e)²`` (``exp2`` and ``rsqrt`` on the approximate units under ``approx_math``):
  seven instructions per element beside those two, no branch, no series. Near ±1, where a soft cap's logits
  crowd, it keeps float32's resolution of the result (the form ``2/(1 + e) - 1`` would round to twice its ulp
  there and tie logits a cap brings together, which the accuracy count reads). Near 0 its error is absolute,
  ≤ ~4e-7 (GPU: each approximate unit adds ~2⁻²² of u), not relative: the subtraction leaves tanh's low bits to
  rounding. A soft cap needs no more: the loss and its gradient see a capped logit through ``exp``, so an absolute
  error ε in it is a relative error ε in its softmax term, as the matmul's own float32 rounding of the logit is.
  ±1 at ±inf, NaN at NaN. No division: Mosaic GPU lowers a float32 division to the IEEE-exact ``div.rn``, a
  multi-instruction routine per element."""
  return _scaled_tanh(x, 1.0, 1.0)


def _scaled_tanh(z, k: float, scale: float):
  """``scale·tanh(k·z)`` as :func:`tanh` forms it, the constants folded into its multiplies."""
  e = jnp.exp2(jnp.abs(z) * (-2.0 * LOG2E * k))  # in (0, 1]: no overflow at any z
  r = lax.rsqrt(1.0 + e)
  mag = (e * (r * r)) * (-2.0 * scale) + scale  # scale·(1 - 2e/(1 + e))
  return jnp.where(z < 0.0, -mag, mag)


def softcap(z, cap: float | None):
  """:func:`lce_flax._math.softcap` (``cap·tanh(z/cap)``) for a kernel's register tile, as :func:`tanh` with
  ``1/cap`` and ``cap`` folded into its constants. Every kernel epilogue caps its logits with this. Absolute error
  ≤ ~cap·4e-7."""
  return z if cap is None else _scaled_tanh(z, 1.0 / cap, cap)


def exp_shifted(z, shift):
  """``exp(z - shift)`` of a tile ``z`` [bt, bv] and a per-row ``shift`` [bt], as ``2^(z·log2e - shift·log2e)``: one
  fused multiply-add per element before the ``exp2`` instead of a subtraction and a multiplication. Rounding
  ``shift·log2e`` once per row scales that row's exponentials by ``1 ± |shift|·2⁻²⁴``, the relative size of the
  float32 rounding the logits themselves carry."""
  return jnp.exp2(z * LOG2E - bcast_rows(shift * LOG2E, z.shape))


def bcast_rows(v, shape):
  """A per-row vector [bt] as a [bt, bv] tile."""
  return lax.broadcast_in_dim(v, shape, [0])


def bcast_cols(v, shape):
  """A per-column vector [bv] as a [bt, bv] tile."""
  return lax.broadcast_in_dim(v, shape, [1])


# the stored exponentials' shift lies at most this far below the row max (e^80 ≈ 5.5e34: finite in bf16; fp16
# overflows past e^11, so its stores take the shifted form)
EXP_CLAMP = 80.0


def _masked(zc, valid):
  """The tile ``zc`` with -inf in its columns outside ``valid`` (None: all are valid)."""
  return zc if valid is None else jnp.where(valid, zc, -jnp.inf)


def row_max(zc, valid):
  """The rows' max of the tile ``zc`` [bt, bv] over its ``valid`` columns (None: all): -inf where none is."""
  return _masked(zc, valid).max(axis=1)


def row_zeros(m):
  """Zeros in the register layout of the per-row vector ``m`` (a row max, -inf allowed). A constant would be a
  splat, which neither a branch's result nor Mosaic GPU's SMEM stores take in place of a row vector (those store
  only multiples of 128 elements: a 64-row tile's vector is not)."""
  return jnp.where(m == -jnp.inf, 0.0, m) * 0.0


def capped_stats(zc, valid, opts, ref=None, m=None):
  """``(max, Σexp(zc - max), Σzc, E)`` of the rows of the capped tile ``zc`` [bt, bv] over its ``valid`` columns,
  ``E`` the tile's exponentials (0 in the invalid columns). ``valid`` None: every column counts and no per-element
  mask is formed (a tile that lies inside the vocabulary). ``opts``: anything with ``needs_logit_sum``. ``m``: the
  rows' max when the caller has it (:func:`row_max` of the same tile), else it is formed here.

  ``ref`` None: ``E = exp(zc - max)``. ``ref`` [bt] (a per-row reference logit): ``E = exp(zc - c)`` against
  ``c = max(ref, max - EXP_CLAMP)``, what the fast forward stores, and the sum is taken of E and brought to the
  max per row (times ``exp(c - max)``, its exponent clamped at EXP_CLAMP): one exp per element, no multiply. A
  tile more than EXP_CLAMP below ``ref`` (its exponentials ≤ e^-80 of the row's, or flushed to 0) sums to
  ~nothing either way, the row's own entry at ``ref`` outweighing it."""
  masked = _masked(zc, valid)
  m = masked.max(axis=1) if m is None else m  # (row_max's, on the masked tile formed here anyway)
  m_safe = jnp.where(m == -jnp.inf, 0.0, m)  # a fully masked row: exp(-inf - 0) = 0, not NaN
  shift = m_safe if ref is None else ref_shift(ref, m_safe)
  e = exp_shifted(masked, shift)
  s = e.sum(axis=1)
  if ref is not None:
    s = s * to_max(shift, m_safe)
  if not opts.needs_logit_sum:
    zsum = row_zeros(m)
  else:
    zsum = (zc if valid is None else jnp.where(valid, zc, 0.0)).sum(axis=1)
  return m, s, zsum, e


def ref_shift(ref, m_safe):
  """The stored exponentials' per-row shift ``max(ref, max - EXP_CLAMP)`` (see :func:`capped_stats`)."""
  return jnp.maximum(ref, m_safe - EXP_CLAMP)


def to_max(shift, m_safe):
  """The per-row factor ``exp(shift - max)`` (exponent clamped at EXP_CLAMP) that takes a sum of exponentials
  against ``shift`` to one against the row max."""
  return jnp.exp(jnp.minimum(shift - m_safe, EXP_CLAMP))


def target_logit(zc, cols, valid, labels):
  """Each row's capped logit at its label's column (``cols`` [bt, bv] global column ids, ``labels`` [bt]), if the
  tile holds it, else 0; ``valid`` None: all columns count."""
  hit = cols == bcast_rows(labels, zc.shape)
  return jnp.where(hit if valid is None else valid & hit, zc, 0.0).sum(axis=1)


def epilogue_stats(zc, cols, valid, labels, opts: _math.LossSpec):
  """``_math.tile_stats`` of the capped tile ``zc`` [bt, bv]; ``cols``/``valid`` are [bt, bv], labels [bt]."""
  m, s, zsum, _ = capped_stats(zc, valid, opts)
  return _math.RowStats(m, s, target_logit(zc, cols, valid, labels), zsum)


def shifted_logits(zc, m):
  """What the fast forward stores of a capped tile: ``zc - m`` with ``m`` the tile's row max (finite).

  Stored in bf16/fp16, the entries that carry the softmax mass (``zc`` near the row max) are near 0, so their
  rounding error is absolute ~2⁻⁹·|zc - m| instead of ~2⁻⁹·|zc| (as for rounded logits): an entry's
  probability keeps a relative error ≤ 2⁻⁹·(m - zc), which is only large where the probability is
  ~e^{-(m - zc)} small.
  """
  return zc - bcast_rows(jnp.where(m == -jnp.inf, 0.0, m), zc.shape)


def merge(a: _math.RowStats, b: _math.RowStats) -> _math.RowStats:
  """``_math.merge_stats`` for registers (Mosaic GPU has no ``isfinite``: only ``m = -inf`` is special-cased).

  Differs from it only for infinite logits (+inf), where both are meaningless anyway.
  """
  m = jnp.maximum(a.m, b.m)
  m_safe = jnp.where(m == -jnp.inf, 0.0, m)
  s = a.s * jnp.exp(a.m - m_safe) + b.s * jnp.exp(b.m - m_safe)
  return _math.RowStats(m, s, a.target + b.target, a.zsum + b.zsum)


def row_coefficients(lse, labels, g_loss, g_lse, opts: _math.LossSpec):
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


def epilogue_dlogits(z, cols, labels, lse, coef, a, c, opts: _math.LossSpec):
  """The logit gradient of a tile from :func:`row_coefficients` (``cols`` [bt, bv] global column ids)."""
  return dlogits_capped(softcap(z, opts.logit_softcap), cols, labels, lse, coef, a, c, opts)


def dlogits_capped(zc, cols, labels, lse, coef, a, c, opts: _math.LossSpec):
  """:func:`epilogue_dlogits` of the already capped tile ``zc``."""
  shape = zc.shape
  p = exp_shifted(zc, lse)
  dz = p * bcast_rows(coef, shape) - jnp.where(cols == bcast_rows(labels, shape), bcast_rows(a, shape), 0.0)
  if opts.label_smoothing:
    dz = dz - bcast_rows(c, shape)
  return _math.through_softcap(dz, zc, opts.logit_softcap)
