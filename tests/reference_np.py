"""The one independent oracle every test compares with: float64 NumPy, forward and analytic gradients.

Written from the formula (see ``lce_flax/_math.py``'s docstring), sharing no code with the package.
"""

from __future__ import annotations

import numpy as np


def linear_cross_entropy_np(x, w, labels, *, bias=None, reduction="mean", ignore_index=-100, where=None,
                            label_smoothing=0.0, z_loss=0.0, logit_softcap=None, w_layout="hv", cotangent=None):
  """Returns dict(loss, token_loss, lse, num_correct, num_tokens, dx, dw, dbias) in float64.

  Gradients are of ``loss`` contracted with ``cotangent`` (default 1; for ``reduction="none"`` a [...] array).
  """
  x = np.asarray(x, np.float64)
  w = np.asarray(w, np.float64)
  wh = w if w_layout == "hv" else w.T  # [H, V]
  labels = np.asarray(labels)
  shape = labels.shape
  x2 = x.reshape(-1, x.shape[-1])
  y = labels.reshape(-1).astype(np.int64)
  n, v = x2.shape[0], wh.shape[1]
  z = x2 @ wh
  if bias is not None:
    z = z + np.asarray(bias, np.float64)
  zc = z if logit_softcap is None else logit_softcap * np.tanh(z / logit_softcap)
  m = zc.max(-1, keepdims=True)
  lse = (m + np.log(np.exp(zc - m).sum(-1, keepdims=True)))[:, 0]
  counted = y != ignore_index
  if where is not None:
    counted &= np.asarray(where).reshape(-1)
  in_range = (y >= 0) & (y < v)
  yc = np.where(in_range, y, 0)
  target = zc[np.arange(n), yc]
  eps = label_smoothing
  tok = lse - (1 - eps) * target - eps / v * zc.sum(-1) + z_loss * lse**2
  tok = np.where(counted, np.where(in_range, tok, np.nan), 0.0)
  count = int(counted.sum())
  if reduction == "none":
    loss = tok.reshape(shape)
    g = np.ones(n) if cotangent is None else np.asarray(cotangent, np.float64).reshape(-1)
  else:
    loss = tok.sum() / (max(count, 1) if reduction == "mean" else 1)
    g = np.full(n, 1.0 if cotangent is None else float(cotangent))
    if reduction == "mean":
      g = g / max(count, 1)
  g = np.where(counted, g, 0.0)
  p = np.exp(zc - lse[:, None])
  onehot = np.zeros_like(p)
  onehot[np.arange(n), yc] = 1.0
  dzc = p * (1 + 2 * z_loss * lse)[:, None] - (1 - eps) * onehot - eps / v
  dz = dzc if logit_softcap is None else dzc * (1 - (zc / logit_softcap) ** 2)
  dz = dz * g[:, None]
  dz[counted & ~in_range] = np.nan
  dx = (dz @ wh.T).reshape(x.shape)
  dwh = x2.T @ dz
  correct = counted & in_range & (target >= zc.max(-1))
  return dict(loss=loss, token_loss=tok.reshape(shape), lse=lse.reshape(shape), num_correct=int(correct.sum()),
              num_tokens=count, dx=dx, dw=dwh if w_layout == "hv" else dwh.T,
              dbias=None if bias is None else dz.sum(0))


def rel_err(a, b) -> float:
  """‖a − b‖ / ‖b‖ in float64 (NaN-aware: any NaN gives inf)."""
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  if np.isnan(a).any() or np.isnan(b).any():
    return float("inf")
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def entropy_np(x, w, *, bias=None, logit_softcap=None, temperature=1.0, w_layout="hv", cotangent=None):
  """Per-token entropy ``-Σ_v p_v log p_v`` of ``p = softmax(softcap(x @ w + bias) / temperature)`` and the gradients
  of ``Σ_t cotangent_t·H_t`` (default 1): dict(entropy, dx, dw, dbias) in float64, entropy shaped like ``x[..., 0]``.

  ``dH/du_v = -p_v (u_v - Σ_k p_k u_k)`` for ``u = z'/T``; ``du/dz = (1 - (z'/c)²) / T``.
  """
  x = np.asarray(x, np.float64)
  w = np.asarray(w, np.float64)
  wh = w if w_layout == "hv" else w.T
  x2 = x.reshape(-1, x.shape[-1])
  z = x2 @ wh
  if bias is not None:
    z = z + np.asarray(bias, np.float64)
  zc = z if logit_softcap is None else logit_softcap * np.tanh(z / logit_softcap)
  u = zc / temperature
  m = u.max(-1, keepdims=True)
  lse = m[:, 0] + np.log(np.exp(u - m).sum(-1))
  p = np.exp(u - lse[:, None])
  mean = (p * u).sum(-1)
  ent = lse - mean
  g = np.ones(len(ent)) if cotangent is None else np.asarray(cotangent, np.float64).reshape(-1)
  du = -g[:, None] * p * (u - mean[:, None])
  dz = du / temperature * (1.0 if logit_softcap is None else 1 - (zc / logit_softcap) ** 2)
  dwh = x2.T @ dz
  return dict(entropy=ent.reshape(x.shape[:-1]), dx=(dz @ wh.T).reshape(x.shape),
              dw=dwh if w_layout == "hv" else dwh.T, dbias=None if bias is None else dz.sum(0))
