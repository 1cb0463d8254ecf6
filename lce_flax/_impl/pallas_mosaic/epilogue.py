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

# tanh(x) = x·(1 + x²·(c3 + x²·(c5 + x²·(c7 + x²·c9)))) + O(x¹¹) (its Taylor series) where |x| < TANH_SERIES_BELOW:
# the next term is ≤ 1e-8 of tanh there, where 1 - 2/(1 + e^{2|x|}) loses tanh's low bits to the subtraction
TANH_SERIES_BELOW = 0.25
TANH_SERIES = (-1.0 / 3.0, 2.0 / 15.0, -17.0 / 315.0, 62.0 / 2835.0)


def tanh(x):
  """``tanh`` of a float32 tile for the epilogues: ``(1 - e)/(1 + e)`` with ``e = exp(-2|x|)`` (its ``exp2`` and
  the reciprocal, ``rsqrt(1 + e)²``, on the approximate units under ``approx_math``), and below
  :data:`TANH_SERIES_BELOW` its odd Taylor series. Error ≤ ~3e-7 absolute everywhere and ≤ ~1e-6 relative (GPU:
  each approximate unit adds ~2⁻²² relative); ±1 at ±inf, NaN at NaN. No division: Mosaic GPU lowers a float32
  division to the IEEE-exact ``div.rn``, a multi-instruction routine per element."""
  a = jnp.abs(x)
  e = jnp.exp2(a * (-2.0 * LOG2E))  # in (0, 1]: no overflow at any x
  r = lax.rsqrt(1.0 + e)
  far = (1.0 - e) * (r * r)
  x2 = x * x
  c3, c5, c7, c9 = TANH_SERIES
  near = a + a * (x2 * (c3 + x2 * (c5 + x2 * (c7 + x2 * c9))))
  t = jnp.where(a < TANH_SERIES_BELOW, near, far)
  return jnp.where(x < 0.0, -t, t)


def softcap(z, cap: float | None):
  """:func:`lce_flax._math.softcap` (``cap·tanh(z/cap)``) for a kernel's register tile: times ``1/cap`` (no
  division) and :func:`tanh`. Every kernel epilogue caps its logits with this."""
  return z if cap is None else cap * tanh(z * (1.0 / cap))


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


def capped_stats(zc, valid, opts):
  """``(max, Σexp(zc - max), Σzc, exp(zc - max))`` of the rows of the capped tile ``zc`` [bt, bv] over its ``valid``
  columns (the last: the tile of exponentials, 0 in the invalid columns). ``valid`` None: every column counts and
  no per-element mask is formed (a tile that lies inside the vocabulary). ``opts``: anything with
  ``needs_logit_sum``."""
  masked = zc if valid is None else jnp.where(valid, zc, -jnp.inf)
  m = masked.max(axis=1)
  m_safe = jnp.where(m == -jnp.inf, 0.0, m)  # a fully masked row: exp(-inf - 0) = 0, not NaN
  e = exp_shifted(masked, m_safe)
  s = e.sum(axis=1)
  if not opts.needs_logit_sum:
    # zeros in the rows' register layout (a constant would be a splat, which Mosaic GPU stores to SMEM only in
    # multiples of 128 elements: a 64-row tile's vector is not)
    zsum = s * 0.0
  else:
    zsum = (zc if valid is None else jnp.where(valid, zc, 0.0)).sum(axis=1)
  return m, s, zsum, e


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
