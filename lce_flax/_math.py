"""The loss math, written once and shared by every implementation.

Every backend computes the same thing: for each token ``t`` with (soft-capped) logits ``z'_t = softcap(x_t @ w
+ b)`` over a vocabulary of ``V`` entries,

.. math::

  \\mathrm{lse}_t = \\log \\sum_v e^{z'_{tv}}, \\qquad
  \\ell_t = \\mathrm{lse}_t - (1-\\varepsilon)\\, z'_{t,y_t} - \\frac{\\varepsilon}{V}\\sum_v z'_{tv}
            + \\lambda_z\\, \\mathrm{lse}_t^2 ,

which is optax's ``softmax_cross_entropy`` with smoothed labels ``(1-ε)·onehot + ε/V`` plus PaLM's z-loss.

The backends differ only in how they walk the ``[B, V]`` logits (all at once, in chunks, in on-chip tiles); what
they do with one tile of logits is here:

* :func:`tile_stats` reduces a ``[bt, bv]`` tile to per-row :class:`RowStats` (running max, sum of
  exponentials, target logit, logit sum), and :func:`merge_stats` combines two partial reductions (online
  logsumexp);
* :func:`finalize` turns the stats of a whole row into the per-token loss, lse and "argmax == label";
* :func:`dlogits` gives the gradient of the loss with respect to the *pre-cap* logits of a tile;
* :func:`entropy_tile`, :func:`merge_entropy`, :func:`finalize_entropy` and :func:`dlogits_entropy` do the same for
  the per-token entropy of ``Aux.entropy`` (``LossOptions.entropy``).

All functions are plain ``jnp`` on arrays of rank ≤ 2, so they trace inside ``lax.scan`` bodies and inside
Pallas kernels alike. Everything is float32.

Labels reach these functions *normalised* (see :func:`normalize_labels`): ``-1`` marks a token that is not
counted (``ignore_index`` or ``where=False``), ``V`` marks a label outside ``[0, V)`` that was not ignored;
such a token's loss and gradients are NaN, so a bad label can never produce a plausible number.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

IGNORED = -1  # normalised label of a token that does not count


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossSpec:
  """The numbers that define the loss of one call (built by ``lce_flax.LossOptions.spec``): the label space and the
  three options that change the loss's value. Hashable, so it can be a ``nondiff_argnums`` / jit-static argument.
  """

  vocab_size: int
  label_smoothing: float = 0.0
  z_loss: float = 0.0
  logit_softcap: float | None = None

  @property
  def needs_logit_sum(self) -> bool:
    return self.label_smoothing != 0.0


class RowStats(NamedTuple):
  """Per-row partial reductions over some vocabulary columns (all float32, shape ``[rows]``)."""

  m: jax.Array  # running max of the (capped) logits
  s: jax.Array  # sum of exp(z' - m)
  target: jax.Array  # the label's capped logit (0 if the label is not among the columns seen)
  zsum: jax.Array  # sum of capped logits (only used with label smoothing)


def normalize_labels(labels, where, ignore_index: int, vocab_size: int):
  """Maps labels to ``-1`` (not counted), ``[0, V)`` (counted) or ``V`` (out of range: NaN loss)."""
  labels = labels.astype(jnp.int32)
  counted = labels != ignore_index
  if where is not None:
    counted = counted & where
  in_range = (labels >= 0) & (labels < vocab_size)
  out = jnp.where(in_range, labels, vocab_size)
  return jnp.where(counted, out, IGNORED)


def softcap(z, cap: float | None):
  return z if cap is None else cap * jnp.tanh(z / cap)


def through_softcap(dz, zc, cap: float | None):
  """A gradient ``dz`` w.r.t. the capped logits ``zc = softcap(z)`` taken back to ``z``: times the cap's derivative
  ``1 - (zc/cap)²`` (``dz`` itself without a cap). Every backward and kernel epilogue that needs it calls this."""
  if cap is None:
    return dz
  u = zc * (1.0 / cap)
  return dz * (1.0 - u * u)


def empty_stats(rows: int) -> RowStats:
  zeros = jnp.zeros((rows,), jnp.float32)
  return RowStats(jnp.full((rows,), -jnp.inf, jnp.float32), zeros, zeros, zeros)


def tile_stats(zc, cols, labels, col_valid, opts: LossSpec) -> RowStats:
  """Reduces a tile of capped logits ``zc`` [bt, bv] to :class:`RowStats`.

  ``cols`` [1, bv] or [bv] are the tile's global column indices, ``col_valid`` masks the columns that belong to
  this tile (padding and overlap excluded), ``labels`` [bt] are normalised labels.
  """
  cols = cols.reshape(1, -1)
  col_valid = col_valid.reshape(1, -1)
  masked = jnp.where(col_valid, zc, -jnp.inf)
  m = jnp.max(masked, axis=-1)
  # A row whose every column is masked has m = -inf; shift by 0 there so exp(-inf - 0) = 0, not NaN.
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  s = jnp.sum(jnp.exp(masked - m_safe[:, None]), axis=-1)
  hit = (cols == labels[:, None]) & col_valid
  target = jnp.sum(jnp.where(hit, zc, 0.0), axis=-1)
  if opts.needs_logit_sum:
    zsum = jnp.sum(jnp.where(col_valid, zc, 0.0), axis=-1)
  else:
    zsum = jnp.zeros_like(m)
  return RowStats(m, s, target, zsum)


def merge_stats(a: RowStats, b: RowStats) -> RowStats:
  """Online-logsumexp combination of two partial reductions over disjoint columns."""
  m = jnp.maximum(a.m, b.m)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  s = a.s * jnp.exp(a.m - m_safe) + b.s * jnp.exp(b.m - m_safe)
  return RowStats(m, s, a.target + b.target, a.zsum + b.zsum)


def all_reduce_stats(st: RowStats, axis: str, opts: LossSpec) -> RowStats:
  """Row stats of the whole vocabulary from each ``axis`` shard's partial stats (inside ``shard_map``):
  a pmax of the max, then one psum of the rescaled sums (and target and logit sum)."""
  m = jax.lax.pmax(st.m, axis)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)  # as in merge_stats
  parts = [st.s * jnp.exp(st.m - m_safe), st.target]
  if opts.needs_logit_sum:
    parts.append(st.zsum)
  summed = jax.lax.psum(jnp.stack(parts), axis)
  zsum = summed[2] if opts.needs_logit_sum else jnp.zeros_like(m)
  return RowStats(m, summed[0], summed[1], zsum)


class TokenOut(NamedTuple):
  loss: jax.Array  # [B] float32; 0 for tokens not counted, NaN for out-of-range labels
  lse: jax.Array  # [B] float32
  correct: jax.Array  # [B] bool: counted and the label's logit is the row's max (ties count as correct)


def finalize(st: RowStats, labels, opts: LossSpec) -> TokenOut:
  lse = st.m + jnp.log(st.s)
  eps = opts.label_smoothing
  loss = lse - (1.0 - eps) * st.target
  if eps:
    loss = loss - (eps / opts.vocab_size) * st.zsum
  if opts.z_loss:
    loss = loss + opts.z_loss * lse * lse
  counted = labels >= 0
  bad = labels >= opts.vocab_size
  # Multiplying (rather than selecting) by NaN makes autodiff through this function NaN too.
  loss = jnp.where(counted, loss, 0.0) * jnp.where(bad, jnp.nan, 1.0)
  correct = counted & ~bad & (st.target >= st.m)
  return TokenOut(loss, lse, correct)


def dlogits(z, lse, labels, cols, col_valid, g_loss, g_lse, opts: LossSpec):
  """Gradient w.r.t. the pre-cap logits ``z`` [bt, bv] of ``Σ_t g_loss_t·ℓ_t + g_lse_t·lse_t``.

  ``dℓ/dz'_v = p_v (1 + 2 λ_z lse) - (1-ε)·[v = y] - ε/V`` and ``dlse/dz'_v = p_v``; the soft cap multiplies by
  ``1 - (z'/c)²``. ``g_loss`` and ``g_lse`` are per-token cotangents [bt] (any values, not only ones).
  Uncounted tokens get no loss gradient; tokens with out-of-range labels get NaN.
  """
  cols = cols.reshape(1, -1)
  col_valid = col_valid.reshape(1, -1)
  zc = softcap(z, opts.logit_softcap)
  counted = labels >= 0
  g_loss = jnp.where(counted, g_loss, 0.0)
  coef = g_loss * (1.0 + 2.0 * opts.z_loss * lse) if opts.z_loss else g_loss
  if g_lse is not None:
    coef = coef + g_lse
  p = jnp.exp(zc - lse[:, None])
  eps = opts.label_smoothing
  dz = p * coef[:, None] - jnp.where(cols == labels[:, None], (1.0 - eps) * g_loss[:, None], 0.0)
  if eps:
    dz = dz - (eps / opts.vocab_size) * g_loss[:, None]
  dz = through_softcap(dz, zc, opts.logit_softcap)
  dz = jnp.where(col_valid, dz, 0.0)
  bad = labels >= opts.vocab_size
  return jnp.where(bad[:, None], jnp.nan, dz)


# ------------------------------------------------------------------------------------------------ entropy
# The per-token entropy of the softmax of ``u = scale·z'`` (``aux.entropy`` of the op: scale 1; the RL helpers'
# temperature: scale 1/T), ``H = lse(u) - Σ_v p_v u_v``, walked over tiles of columns like the loss. The running
# sums are kept relative to the running max (``Σ e^(u-m)·(u-m)``, not ``Σ e^u·u``), so H comes out as
# ``log s - d/s``, a sum of two non-negative terms of size ≤ log V: no cancellation of large logits.


class EntropyStats(NamedTuple):
  """Per-row partial reductions for the entropy over some vocabulary columns (all float32, shape ``[rows]``)."""

  m: jax.Array  # running max of u
  s: jax.Array  # Σ exp(u - m)
  d: jax.Array  # Σ exp(u - m)·(u - m) (≤ 0)


def entropy_logits(z, cap: float | None, scale: float = 1.0):
  """``u = scale·softcap(z)``: the logits whose softmax the entropy is of (float32)."""
  zc = softcap(z, cap)
  return zc if scale == 1.0 else zc * scale


def entropy_tile(u, col_valid) -> EntropyStats:
  """Reduces a tile of logits ``u`` [bt, bv] to :class:`EntropyStats`; ``col_valid`` masks its columns."""
  col_valid = col_valid.reshape(1, -1)
  masked = jnp.where(col_valid, u, -jnp.inf)
  m = jnp.max(masked, axis=-1)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)  # as in tile_stats: a row with no column gives s = d = 0
  shifted = masked - m_safe[:, None]
  e = jnp.exp(shifted)
  d = jnp.sum(jnp.where(col_valid, e * shifted, 0.0), axis=-1)
  return EntropyStats(m, jnp.sum(e, axis=-1), d)


def _rescaled(st: EntropyStats, m):
  """``(s, d)`` of ``st`` relative to the new max ``m`` >= st.m: ``Σ e^(u-m) = s·f`` and
  ``Σ e^(u-m)(u-m) = (d + δ·s)·f`` with ``δ = st.m - m``, ``f = e^δ``."""
  delta = jnp.where(jnp.isfinite(st.m), st.m - m, 0.0)  # an empty part (m = -inf, s = d = 0) stays 0
  f = jnp.exp(delta)
  return st.s * f, (st.d + delta * st.s) * f


def merge_entropy(a: EntropyStats, b: EntropyStats) -> EntropyStats:
  """Combination of two partial entropy reductions over disjoint columns."""
  m = jnp.maximum(a.m, b.m)
  (sa, da), (sb, db) = _rescaled(a, m), _rescaled(b, m)
  return EntropyStats(m, sa + sb, da + db)


def all_reduce_entropy(st: EntropyStats, axis) -> EntropyStats:
  """The whole vocabulary's entropy stats from each ``axis`` shard's (inside ``shard_map``): a pmax, one psum."""
  m = jax.lax.pmax(st.m, axis)
  s, d = jax.lax.psum(jnp.stack(_rescaled(st, m)), axis)
  return EntropyStats(m, s, d)


def finalize_entropy(st: EntropyStats):
  """``(entropy, lse, mean)`` of a whole row: ``H = log s - d/s``, ``lse(u)`` and ``E_p[u]`` (what the backward
  needs)."""
  log_s = jnp.log(st.s)
  rel_mean = st.d / st.s
  return log_s - rel_mean, st.m + log_s, st.m + rel_mean


def dlogits_entropy(z, lse, mean, g, col_valid, cap: float | None, scale: float = 1.0):
  """Gradient w.r.t. the pre-cap logits ``z`` [bt, bv] of ``Σ_t g_t·H_t``.

  ``dH/du_v = -p_v·(u_v - E_p[u])``; ``du/dz = scale·(1 - (z'/c)²)`` (the soft cap's derivative, 1 without it).
  """
  zc = softcap(z, cap)
  u = zc if scale == 1.0 else zc * scale
  p = jnp.exp(u - lse[:, None])
  dz = -(g[:, None] * p) * (u - mean[:, None])
  if scale != 1.0:
    dz = dz * scale
  dz = through_softcap(dz, zc, cap)
  return jnp.where(col_valid.reshape(1, -1), dz, 0.0)
