"""Checks every implementation's tests share: inputs, tolerances, and comparisons with the float64 oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lce_flax import linear_cross_entropy
from tests.reference_np import linear_cross_entropy_np, rel_err

# Small configs of the kernel backends, written once: several tiles, splits and chunks on the tests' small problems,
# every loop ending ragged. TRITON_SMALL: PallasTritonConfig / TritonConfig; MOSAIC_SMALL: PallasMosaicConfig's
# lean design (replace vocab_chunk with None for its fast designs).
TRITON_SMALL = dict(block_t=16, block_v=32, block_k=16, num_splits=3, vocab_chunk=64)
MOSAIC_SMALL = dict(block_t=64, block_v=64, num_splits=3, num_stages=2, vocab_chunk=128)

OPTIONS = {
    "plain": {},
    "smoothing": dict(label_smoothing=0.1),
    "z_loss": dict(z_loss=1e-2),
    "softcap": dict(logit_softcap=3.0),
    "all": dict(label_smoothing=0.2, z_loss=1e-3, logit_softcap=4.0),
}


def chunk_kw(chunk, mode=None, reduction="mean"):
  """The chunk option of the design that ``mode`` and ``reduction`` pick: ``token_chunk`` for the fast designs,
  ``vocab_chunk`` for the lean ones (an empty dict for ``chunk=None``)."""
  if chunk is None:
    return {}
  lean = mode == "lean" or (mode is None and reduction == "none")
  return {"vocab_chunk" if lean else "token_chunk": chunk}


def make_inputs(seed, batch_shape, h, v, dtype, *, w_layout="hv", bias=False, ignore_frac=0.2, wscale=0.3):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((*batch_shape, h)).astype(np.float32)
  w = (wscale * rng.standard_normal((h, v) if w_layout == "hv" else (v, h))).astype(np.float32)
  labels = rng.integers(0, v, batch_shape)
  labels = np.where(rng.random(batch_shape) < ignore_frac, -100, labels).astype(np.int32)
  b = rng.standard_normal(v).astype(np.float32) if bias else None
  # Round to the input dtype first, so the oracle sees exactly the numbers the implementation sees.
  cast = lambda a: None if a is None else jnp.asarray(a, dtype)
  up = lambda a: None if a is None else np.asarray(jnp.asarray(a, dtype).astype(jnp.float32))
  return (cast(x), cast(w), jnp.asarray(labels), cast(b)), (up(x), up(w), labels, up(b))


def tolerances(dtype):
  # fp32: float32 accumulation only. bf16/fp16: the logit gradient enters the dx/dw matmuls in the input dtype.
  return (2e-5, 2e-5) if dtype == jnp.float32 else (2e-5, 2e-2)


def check_impl(impl, *, seed=0, batch_shape=(37,), h=24, v=301, dtype=jnp.float32, w_layout="hv", bias=False,
               reduction="mean", options=None, where=False, **kwargs):
  """Loss, aux and grads of x, w (and bias) of ``impl`` against the float64 oracle."""
  options = options or {}
  (x, w, y, b), (xn, wn, yn, bn) = make_inputs(seed, batch_shape, h, v, dtype, w_layout=w_layout, bias=bias)
  mask = None
  if where:
    mask = jnp.asarray(np.random.default_rng(seed + 1).random(batch_shape) < 0.8)
  cot = None
  if reduction == "none":
    cot = np.random.default_rng(seed + 2).standard_normal(batch_shape).astype(np.float32)
  ref = linear_cross_entropy_np(xn, wn, yn, bias=bn, reduction=reduction,
                                where=None if mask is None else np.asarray(mask), w_layout=w_layout, cotangent=cot,
                                **options)

  def f(x, w, b):
    return linear_cross_entropy(x, w, y, bias=b, reduction=reduction, where=mask, w_layout=w_layout, impl=impl,
                                return_aux=True, **options, **kwargs)

  if cot is None:
    (loss, aux), (dx, dw, db) = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(x, w, b)
  else:
    (loss, vjp, aux) = jax.vjp(f, x, w, b, has_aux=True)
    dx, dw, db = vjp(jnp.asarray(cot))
  loss_tol, grad_tol = tolerances(dtype)
  assert loss.dtype == jnp.float32
  assert rel_err(loss, ref["loss"]) < loss_tol, (loss, ref["loss"])
  assert rel_err(aux.token_loss, ref["token_loss"]) < loss_tol
  assert rel_err(aux.lse, ref["lse"]) < loss_tol
  assert int(aux.num_tokens) == ref["num_tokens"]
  assert int(aux.num_correct) == ref["num_correct"]
  assert dx.dtype == x.dtype and dw.dtype == w.dtype
  assert rel_err(dx, ref["dx"]) < grad_tol
  assert rel_err(dw, ref["dw"]) < grad_tol
  if bias:
    assert rel_err(db, ref["dbias"]) < grad_tol
  return loss, aux, (dx, dw, db)


def check_lse_cotangent(impl, *, h=40, dtype=jnp.float32, tol=1e-5, **kwargs):
  """Cotangents on the aux lse flow through the backward: d(Σ_t c_t lse_t)/dx = (c ⊙ softmax) @ w.T."""
  (x, w, y, _), (xn, wn, _, _) = make_inputs(4, (21,), h, 77, dtype)
  c = np.random.default_rng(0).standard_normal(21).astype(np.float32)
  g = jax.grad(lambda x: (c * linear_cross_entropy(x, w, y, impl=impl, mode="lean", return_aux=True,
                                                   **kwargs)[1].lse).sum())(x)
  z = xn.astype(np.float64) @ wn
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  assert rel_err(g, (c[:, None] * p) @ wn.T) < tol


def check_llama3_8b(impl, **kwargs):
  """GPU check at the llama3-8b head (B=8192, H=4096, V=128256, bf16): per-token loss of 64 rows vs float64 NumPy
  ≤ 1e-4; summed loss and grads vs the xla path on float32 inputs at highest precision ≤ 1e-4 / 1e-2."""
  b, h, v = 8192, 4096, 128256
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(k1, (b, h), jnp.float32).astype(jnp.bfloat16)
  w = (0.02 * jax.random.normal(k2, (h, v), jnp.float32)).astype(jnp.bfloat16)
  y = jax.random.randint(k3, (b,), 0, v, jnp.int32)
  rows = np.sort(np.random.default_rng(0).choice(b, 64, replace=False))
  tok = np.asarray(jax.jit(lambda x, w, y: linear_cross_entropy(x, w, y, reduction="none", impl=impl,
                                                                **kwargs))(x, w, y))
  ref = linear_cross_entropy_np(np.asarray(x[rows].astype(jnp.float32), np.float64),
                                np.asarray(w.astype(jnp.float32), np.float64), np.asarray(y)[rows],
                                reduction="none")
  assert np.max(np.abs(tok[rows] - ref["loss"]) / np.abs(ref["loss"])) <= 1e-4
  f = lambda impl, **kw: lambda x, w: linear_cross_entropy(x, w, y, reduction="sum", impl=impl, **kw)
  loss, grads = jax.jit(jax.value_and_grad(f(impl, **kwargs), (0, 1)))(x, w)
  with jax.default_matmul_precision("highest"):
    loss_r, grads_r = jax.jit(jax.value_and_grad(f("xla"), (0, 1)))(x.astype(jnp.float32), w.astype(jnp.float32))
  assert abs(float(loss) - float(loss_r)) / abs(float(loss_r)) <= 1e-4
  for g, r in zip(grads, grads_r):
    err = float(jnp.linalg.norm((g.astype(jnp.float32) - r).ravel()) / jnp.linalg.norm(r.ravel()))
    assert err <= 1e-2, err


def check_bad_and_ignored_labels(impl, *, h=16, dtype=jnp.float32, **kwargs):
  """An out-of-range label gives NaN loss and grads for its token only; an ignored token gives 0; a batch with
  every token ignored gives zero loss and exactly zero gradients (no NaN from padding rows of kernels)."""
  (x, w, y, b), _ = make_inputs(2, (19,), h, 70, dtype, bias=True, ignore_frac=0.0)
  y = y.at[4].set(70).at[7].set(-100)
  f = lambda x, w, b: linear_cross_entropy(x, w, y, bias=b, impl=impl, reduction="none", **kwargs).sum()
  loss, (dx, dw, db) = jax.value_and_grad(f, (0, 1, 2))(x, w, b)
  f32 = lambda a: np.asarray(a, np.float32)
  assert np.isnan(loss) and np.isnan(f32(dx[4])).all() and np.isnan(f32(dw)).any() and np.isnan(f32(db)).any()
  tok = linear_cross_entropy(x, w, y, bias=b, impl=impl, reduction="none", **kwargs)
  assert np.isnan(tok[4]) and tok[7] == 0.0 and np.isfinite(np.delete(np.asarray(tok), 4)).all()
  y0 = jnp.full((19,), -100)
  g = jax.grad(lambda x, w, b: linear_cross_entropy(x, w, y0, bias=b, impl=impl, z_loss=0.1, mode="lean",
                                                    **kwargs), (0, 1, 2))(x, w, b)
  for a in g:
    assert np.isfinite(f32(a)).all() and not np.any(f32(a))


