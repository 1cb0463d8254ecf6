"""``impl="chunked"``: pure JAX, never more than one chunk of logits alive. Runs on CPU, GPU and TPU.

Two designs behind ``mode``:

``"lean"`` (recompute)
  Forward: a loop over vocabulary chunks of ``vocab_chunk`` columns; each chunk's [B, c] logits feed the online
  logsumexp (:func:`lce_flax._math.merge_stats`) and die. Residuals: x, w, labels and the [B] lse.
  Backward: the same loop again; each chunk's logits are recomputed and turned into the logit gradient, which
  gives its slice of dw exactly (no accumulation across chunks) and adds into a float32 dx.
  FLOPs 8·B·H·V (2 forward + 2 recompute + 4 gradient); extra memory ≈ 3 chunks of B·c·4 bytes + B·H·4 (dx).

``"fast"`` (gradients formed in the forward)
  One loop over token chunks of ``token_chunk`` rows; each chunk's full-vocabulary logits give the loss *and*,
  weighted by the per-token weights the reduction will apply (1 for ``sum``, 1/count for ``mean``), the logit
  gradient, from which the chunk's dx rows and its contribution to a float32 dw accumulator are formed at once.
  The backward only scales the stored dx, dw by the incoming scalar cotangent.
  FLOPs 6·B·H·V; extra memory ≈ H·V·4 (the float32 dw accumulator) + 3 chunks of c·V·4 bytes.
  Only the reduced loss is differentiable; ``reduction="none"`` and gradients of the aux outputs need ``lean``.

The lean design's loop over vocabulary chunks also computes ``Aux.entropy`` for every backend (``entropy_stats``,
``entropy_grads``; see :func:`lce_flax._impl.base.entropy`).

Ragged sizes: the vocabulary's last chunk is moved back to end at V (a clamped window) and its columns already
counted by the previous chunk are masked, so ``w`` is never padded or copied; tokens are padded to a multiple of
the chunk with uncounted labels (x is B·H, small next to w).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from lce_flax import _math
from lce_flax._impl import common
from lce_flax._impl.common import F32


@dataclasses.dataclass(frozen=True)
class Config:
  """Configuration of ``impl="chunked"`` (``lce_flax.ChunkedConfig``); None fields are chosen by shape.

  Attributes:
    vocab_chunk: vocabulary columns per chunk of the lean design (an error in the fast one).
    token_chunk: tokens per chunk of the fast design (an error in the lean one).
  """

  vocab_chunk: int | None = None
  token_chunk: int | None = None


# Budget for one chunk of float32 logits in the lean design: 3 such buffers live at once in its backward.
LEAN_CHUNK_BYTES = 32 * 2**20


_pow2_floor = common.pow2_floor


def lean_chunk(num_tokens: int, vocab: int, requested: int | None = None) -> int:
  """Vocabulary columns per chunk: ``LEAN_CHUNK_BYTES`` of float32 logits, a power of two in [128, 16384]."""
  c = requested or min(max(_pow2_floor(LEAN_CHUNK_BYTES // (4 * max(num_tokens, 1))), 128), 16384)
  return max(1, min(c, vocab))


def fast_chunk(num_tokens: int, hidden: int, vocab: int, requested: int | None = None) -> int:
  """Tokens per chunk. The fast design must hold an H×V float32 dw anyway; a logits chunk of H/2 tokens (a power
  of two in [16, 2048]) is half that buffer, so extra memory stays near 1.5–2× the floor, while the chunk matmuls
  are large enough to run at the matmul rate. Measured on an H100 at llama3-8b (H=4096 → 2048 tokens): 44.1 ms and
  2.68 GB temp, against 48.5 ms / 2.40 GB with 1024 and 43.1 ms / 4.25 GB with 4096."""
  c = requested or min(max(_pow2_floor(hidden // 2), 16), 2048)
  return max(1, min(c, num_tokens))


def design(num_tokens: int, hidden: int, spec: common.Spec, dtype, mode: str, config: Config | None = None
           ) -> common.Design:
  """The chunk length for ``mode`` (every ``Config`` field resolved) and the extra-memory bound."""
  common.check_config(config, Config, "chunked")
  config = config or Config()
  common.check_positive(config, ("vocab_chunk", "token_chunk"))
  common.check_loop(config, mode, "chunked")
  vocab = spec.opts.vocab_size
  itemsize = jnp.dtype(dtype).itemsize
  if mode == "lean":
    c = lean_chunk(num_tokens, vocab, config.vocab_chunk)
    # forward: a [B, c] float32 chunk; backward: logits, dz (f32) and dz in the input dtype, plus the f32 dx
    mem = 3 * num_tokens * c * 4 + num_tokens * hidden * 4
    return common.Design("chunked", mode, "recompute", Config(vocab_chunk=c), f"vocabulary chunks of {c} columns",
                         mem)
  c = fast_chunk(num_tokens, hidden, vocab, config.token_chunk)
  # the float32 dw accumulator, the float32 dx, and a chunk's logits, probabilities and dz
  mem = hidden * vocab * 4 + num_tokens * hidden * itemsize + 3 * c * vocab * 4
  return common.Design("chunked", mode, "token_chunks", Config(token_chunk=c), f"token chunks of {c} tokens", mem)


def supported(spec: common.Spec, platform: str, dtype=None) -> None:
  del spec, platform


def _chunk_logits(x, w, bias, start, c, spec):
  z = common.logits(x, common.slice_vocab(w, start, c, spec.w_layout), spec.w_layout)
  if bias is not None:
    z = z + lax.dynamic_slice_in_dim(bias, start, c).astype(F32)
  return z


# ----------------------------------------------------------------------------------------------- lean


def _column_loop(x, w, bias, spec, c: int, step, init):
  """``step(carry, start, z, cols, valid)`` for each chunk of ``c`` columns of ``w`` (``z``: the chunk's [B, c]
  float32 pre-cap logits; the last window is clamped to end at V, ``valid`` masks its columns already seen)."""
  v = common.vocab_size(w, spec.w_layout)

  def body(i, carry):
    start, cols, valid = common.vocab_window(i, c, v)
    return step(carry, start, _chunk_logits(x, w, bias, start, c, spec), cols, valid)

  return lax.fori_loop(0, -(-v // c), body, init)


def _column_grads(x, w, bias, spec, c: int, dz_of):
  """(dx float32, dw, dbias float32) of a loss whose gradient w.r.t. a chunk's pre-cap logits is
  ``dz_of(z, cols, valid)``: each chunk's logits recomputed, its dw slice written once, dx accumulated."""
  vaxis = spec.vocab_axis

  def step(carry, start, z, cols, valid):
    dx, dw, db = carry
    dz = dz_of(z, cols, valid)
    dzm = dz.astype(common.mxu_dtype(x))
    dx = dx + common.grad_x(dzm, common.slice_vocab(w, start, c, spec.w_layout), spec.w_layout)
    # Columns masked as overlap carry an exact 0, so adding into the window never double-counts.
    old = lax.dynamic_slice_in_dim(dw, start, c, axis=vaxis).astype(F32)
    new = (old + common.grad_w(x, dzm, spec.w_layout)).astype(dw.dtype)
    dw = lax.dynamic_update_slice_in_dim(dw, new, start, vaxis)
    if db is not None:
      db = lax.dynamic_update_slice_in_dim(db, lax.dynamic_slice_in_dim(db, start, c) + dz.sum(0), start, 0)
    return dx, dw, db

  # *_like (not shape) zeros: under shard_map the accumulators must vary over the same mesh axes as the inputs
  init = (jnp.zeros_like(x, F32), jnp.zeros_like(w), None if bias is None else jnp.zeros_like(bias, F32))
  return _column_loop(x, w, bias, spec, c, step, init)


def _row_init(x, fills):
  # built like x (not from a shape) so that, under shard_map, the carries vary over x's axes
  return tuple(jnp.full_like(x[:, 0], f, F32) for f in fills)


def vocab_stats(x, w, bias, labels, spec, c: int) -> _math.RowStats:
  """Row stats of the columns held in ``w``, in chunks of ``c`` columns: the lean forward before finalising.

  ``w`` may be one shard of the vocabulary (then ``labels`` are shard-local, see ``common.py``'s protocol)."""
  opts = spec.opts

  def step(st, start, z, cols, valid):
    del start
    return _math.merge_stats(st, _math.tile_stats(_math.softcap(z, opts.logit_softcap), cols, labels, valid, opts))

  return _column_loop(x, w, bias, spec, c, step, _math.RowStats(*_row_init(x, (-jnp.inf, 0.0, 0.0, 0.0))))


def vocab_grads(x, w, bias, labels, lse, g_loss, g_lse, spec, c: int):
  """Recompute backward over the columns held in ``w`` (see :func:`vocab_stats`) for the given (whole-vocabulary)
  ``lse``: returns (dx float32, dw, dbias float32). On a shard, dx is this shard's part."""
  opts = spec.opts
  return _column_grads(x, w, bias, spec, c,
                       lambda z, cols, valid: _math.dlogits(z, lse, labels, cols, valid, g_loss, g_lse, opts))


def stats(x, w, bias, labels, spec: common.Spec, plan: Config) -> _math.RowStats:
  return vocab_stats(x, w, bias, labels, spec, plan.vocab_chunk)


def grads(x, w, bias, labels, lse, g_loss, g_lse, spec: common.Spec, plan: Config):
  return vocab_grads(x, w, bias, labels, lse, g_loss, g_lse, spec, plan.vocab_chunk)


# ----------------------------------------------------------------------------------------------- entropy
# ``aux.entropy`` (every implementation's: see ``lce_flax._impl.base.entropy``) and the RL helpers' entropy are
# this pass: the lean design's loop over vocabulary chunks, with entropy stats in place of the loss's row stats.


def entropy_stats(x, w, bias, spec, c: int, scale: float = 1.0) -> _math.EntropyStats:
  """Entropy stats of ``softmax(scale·softcap(x @ w + bias))`` over the columns held in ``w``, in chunks of ``c``
  columns (:func:`lce_flax._math.finalize_entropy` gives the entropy; on a shard, combine them first)."""
  cap = spec.opts.logit_softcap

  def step(st, start, z, cols, valid):
    del start, cols
    return _math.merge_entropy(st, _math.entropy_tile(_math.entropy_logits(z, cap, scale), valid))

  return _column_loop(x, w, bias, spec, c, step, _math.EntropyStats(*_row_init(x, (-jnp.inf, 0.0, 0.0))))


def entropy_grads(x, w, bias, lse, mean, g, spec, c: int, scale: float = 1.0):
  """(dx float32, dw, dbias float32) of ``Σ_t g_t·H_t`` over the columns held in ``w``, for the whole
  vocabulary's ``lse`` and ``mean`` (``E_p[u]``) of :func:`lce_flax._math.finalize_entropy`."""
  cap = spec.opts.logit_softcap
  return _column_grads(x, w, bias, spec, c,
                       lambda z, cols, valid: _math.dlogits_entropy(z, lse, mean, g, valid, cap, scale))


# ----------------------------------------------------------------------------------------------- fast


# The fast design takes an optional ``axis``: the mesh axis over which w's vocabulary is split (the
# vocab-parallel head, :mod:`lce_flax._impl.vocab_parallel`). Each device then holds the same tokens, V/t columns
# and shard-local labels; every token chunk's row stats are combined across the axis
# (:func:`lce_flax._math.all_reduce_stats`) before its logit gradient is formed, and the partial dx is psum'd in
# float32 before any rounding.


def _fast_forward(x, w, bias, labels, weights, spec, c, axis=None):
  """Returns (Σ weights·loss, TokenOut, (dx, dw, db)) with the gradients of that sum."""
  opts = spec.opts
  x_in = x
  v = common.vocab_size(w, spec.w_layout)
  b = x.shape[0]
  n = -(-b // c)
  pad = n * c - b
  xs = jnp.pad(x, ((0, pad), (0, 0))).reshape(n, c, x.shape[1])
  ls = jnp.pad(labels, (0, pad), constant_values=_math.IGNORED).reshape(n, c)
  ws = jnp.pad(weights.astype(F32), (0, pad)).reshape(n, c)
  cols = jnp.arange(v, dtype=jnp.int32)
  all_cols = jnp.ones((v,), bool)

  def body(carry, chunk):
    dw, db = carry
    xc, lc, wc = chunk
    z = _chunk_logits(xc, w, bias, 0, v, spec)
    st = _math.tile_stats(_math.softcap(z, opts.logit_softcap), cols, lc, all_cols, opts)
    if axis is not None:
      st = _math.all_reduce_stats(st, axis, opts)
    out = _math.finalize(st, lc, opts)
    dz = _math.dlogits(z, out.lse, lc, cols, all_cols, wc, None, opts)
    dzm = dz.astype(common.mxu_dtype(x))
    dxc = common.grad_x(dzm, w, spec.w_layout)
    # one device: round each chunk's (complete) dx rows now; vocab-parallel: keep float32 for the psum
    dxc = dxc.astype(x.dtype) if axis is None else dxc
    dw = dw + common.grad_w(xc, dzm, spec.w_layout)
    if db is not None:
      db = db + dz.sum(0)
    return (dw, db), (dxc, out)

  # *_like (not shape) zeros: under shard_map the accumulators must vary over the same mesh axes as the inputs
  init = (jnp.zeros_like(w, F32), None if bias is None else jnp.zeros_like(bias, F32))
  (dw, db), (dx, out) = lax.scan(body, init, (xs, ls, ws))
  out = jax.tree.map(lambda a: a.reshape(n * c)[:b], out)
  dx = dx.reshape(n * c, -1)[:b]
  dx = (dx if axis is None else lax.psum(dx, axis)).astype(x_in.dtype)
  total = jnp.sum(weights.astype(F32) * out.loss)
  grads = (dx, dw.astype(w.dtype), None if bias is None else db.astype(bias.dtype))
  return total, out, grads


def fast_forward(x, w, bias, labels, weights, spec: common.Spec, plan: Config, axes: tuple[str, ...] = ()):
  """``(Σ weights·loss, TokenOut, (dx, dw, dbias))``; ``axes``: mesh axes w's vocabulary is split over (then w is
  this device's shard and labels are shard-local, see :mod:`lce_flax._impl.vocab_parallel`)."""
  return _fast_forward(x, w, bias, labels, weights, spec, plan.token_chunk, tuple(axes) or None)


def fast_backward(grads, g_total, spec: common.Spec, plan: Config, primals):
  """The gradients formed in the forward, scaled by the scalar cotangent."""
  del spec, plan, primals
  scale = lambda a: None if a is None else (g_total * a.astype(F32)).astype(a.dtype)
  return tuple(scale(a) for a in grads)
