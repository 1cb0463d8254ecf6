"""``impl="pallas_triton"``: Pallas kernels lowered through Triton, for NVIDIA GPUs from SM80 (A100, H100).

This file holds the design: :class:`Config`, the :func:`plan` heuristic, the backend protocol of
:mod:`lce_flax._impl.base` (:func:`supported`, :func:`design`, :func:`stats`, :func:`grads`; there is no fast
design) and the recompute backward that ``impl="triton"`` shares (:class:`Kernels`, :func:`grads_with`). The lean
``custom_vjp`` around them is :func:`lce_flax._impl.base.lean`; the kernels are in :mod:`.kernels`.

On a machine without a GPU the same kernels run in Pallas interpret mode (``spec.interpret``), which is how the
CPU test-suite checks them.

Forward (one kernel, O(B) output)
  A 1-D grid of ``num_row_blocks × num_splits`` programs. Program ``(i, j)`` owns the ``block_t`` tokens of row
  block ``i`` and the ``j``-th contiguous split of the vocabulary tiles. It walks its split one ``[block_t,
  block_v]`` logit tile at a time; each tile is accumulated in float32 registers over H in ``block_k`` steps
  (``x[rows, k:k+bk] @ w[k:k+bk, cols]``), gets its bias and soft cap, and is reduced on chip by
  :func:`lce_flax._math.tile_stats` and merged into the row's running :class:`~lce_flax._math.RowStats` (online
  logsumexp). Only the split's partial stats leave the chip: 4 float32 per token and split (≤ 1 MB at llama3-8b).
  A tiny JAX step merges the splits (:func:`~lce_flax._math.merge_stats`) and finalises the loss.

  The program index is split *split-fastest* (``pid = i·S + j``), so the ~132 programs resident at once share a
  handful of row blocks and cover the whole vocabulary between them. HBM traffic with ``R`` resident row blocks
  (≈ #SMs / S): x is read about once (its resident blocks, R·block_t·H·2 bytes, stay in L2 while the vocabulary
  streams past), w is read ``B / (R·block_t)`` times: ``H·V·2·B/(R·block_t)`` bytes. At llama3-8b (block_t=128,
  S=8, so R≈16) that is 1 GB × 4 = 4 GB (≈ 1.3 ms at 3.3 TB/s) against 8.6 TFLOP of matmul (≈ 13 ms): the
  forward is matmul-bound. Larger ``block_t``·``block_v`` raise the arithmetic intensity of the on-chip product
  (``block_t·block_v / (block_t + block_v)`` FLOP per loaded byte per k-step) at the price of registers: the
  default 128×256×64 (bf16, 8 warps) is Triton's usual Hopper matmul tile; fp32 inputs halve ``block_v`` and
  ``block_k`` to fit shared memory.

Backward (recompute; no B×V array)
  The lean ``jax.custom_vjp`` keeps x, w, bias, labels and the [B] lse. The backward walks the vocabulary in chunks of
  ``vocab_chunk`` columns. Per chunk a Pallas kernel recomputes the chunk's logits tile by tile (same tiling as the
  forward, grouped tile order for L2 reuse), turns them into the logit gradient with
  :func:`lce_flax._math.dlogits` and writes ``dz`` [B, chunk] in the input dtype (and, with a bias, per row
  block column sums for ``dbias`` in float32). Then ``dw[:, chunk] = xᵀ dz`` by one XLA matmul (complete: the
  reduction over B happens inside it, so dw's columns are written once, never accumulated), and
  ``dx += dz w[:, chunk]ᵀ`` into a float32 accumulator by an XLA matmul and an add (default), or in place by a
  second Pallas kernel (``dx_kernel=True``: no second B×H float32 buffer, but slower than cuBLAS).
  Extra memory (H100, compiled temp): llama3-8b 286 MB = float32 dx (B·H·4 = 128 MB) + XLA's float32 product
  (128 MB) + ``dz`` (B·chunk·itemsize = 32 MB with the default chunk of 2048); 196 MB with ``dx_kernel=True``.
  112–134 MB at gpt2-small, qwen3-8b, gemma2-2b. FLOPs: 2·B·H·V forward + 6·B·H·V backward.

  The float32 dx accumulator is what keeps this above 64 MB at llama3-8b. Any chunking of the backward
  accumulates one of dx (over vocabulary chunks) or dw (over token chunks) across chunks; holding neither in
  float32 means accumulating in bf16 (Liger's choice, error growing with the number of chunks) or a third
  logits pass, which ``Config(low_memory=True)`` does: the chunk loop above forms dw (and dbias) only, then
  a second loop over blocks of ``token_block`` tokens recomputes each block's logits in chunks of ``dx_chunk``
  columns and accumulates that block's dx in a float32 [token_block, H] buffer (the in-place dx kernel),
  complete before the next block; its dw pass takes half the default dz budget. FLOPs 10·B·H·V. Measured on
  an H100 (fwd+bwd / temp): gpt2-small
  15.9 ms / 53 MB, llama3-8b 73.7 / 42 MB, qwen3-8b 43.7 / 42 MB, gemma2-2b 95.5 / 31 MB (default: 11.5 / 118,
  59.2 / 300, 34.7 / 141, 69.0 / 128 MB).

Precision: every product accumulates in float32. Float32 inputs follow ``jax.default_matmul_precision`` as
JAX's own dots do: by default Pallas Triton multiplies them as TF32 on the tensor cores (H100: token-loss
relative error ~8e-5, gradients ~4e-4); under ``jax.default_matmul_precision("highest")`` they are exact
float32 (IEEE) products, at a fraction of the speed.

Ragged B, V and H are handled by masked loads and stores; w is never padded or copied.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax.numpy as jnp
from jax import lax

from lce_flax import _device, _math
from lce_flax._impl import common
from lce_flax._impl.common import F32, cdiv, pow2_ceil, pow2_floor
from lce_flax._impl.pallas_triton import kernels

DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)


@dataclasses.dataclass(frozen=True)
class ConfigFields:
  """The knobs of the Triton-tiled kernels (shared by ``pallas_triton`` and ``triton``); ``None`` fields are
  chosen by :func:`plan` from the shape and the device.

  Attributes:
    block_t: tokens per tile (power of two ≥ 16).
    block_v: vocabulary columns per tile (power of two ≥ 16).
    block_k: hidden units per matmul step (power of two ≥ 16).
    num_splits: vocabulary splits of the forward grid (programs = row blocks × splits).
    vocab_chunk: vocabulary columns per backward chunk (the ``dz`` buffer is B × vocab_chunk); rounded up to whole
      ``block_v`` tiles.
    num_warps: Triton warps per program.
    num_stages: Triton software-pipelining stages of the H loop.
    group_t: row blocks per group in the backward's tile order (L2 reuse of w).
    dx_kernel: accumulate ``dx += dz·w[chunk]ᵀ`` in place with a Pallas kernel (True) or with an XLA matmul
      followed by an add (False, the default: faster, but XLA keeps a second B×H float32 buffer for the
      product).
    low_memory: a third logits pass instead of the B×H float32 dx accumulator (see the module docstring).
    token_block: tokens per block of the low-memory dx pass (rounded up to a multiple of ``block_t``).
    dx_chunk: vocabulary columns per chunk of the low-memory dx pass (rounded up to a multiple of ``block_v``).
  """

  block_t: int | None = None
  block_v: int | None = None
  block_k: int | None = None
  num_splits: int | None = None
  vocab_chunk: int | None = None
  num_warps: int | None = None
  num_stages: int | None = None
  group_t: int | None = None
  dx_kernel: bool | None = None
  low_memory: bool | None = None
  token_block: int | None = None
  dx_chunk: int | None = None


@dataclasses.dataclass(frozen=True)
class Config(ConfigFields):
  """Configuration of ``impl="pallas_triton"`` (``lce_flax.PallasTritonConfig``): the fields of
  :class:`ConfigFields`."""


@dataclasses.dataclass(frozen=True)
class Plan:
  """A fully resolved config for one shape (hashable; a ``nondiff_argnums`` argument): ``Design.config``."""

  block_t: int
  block_v: int
  block_k: int
  num_splits: int
  vocab_chunk: int
  num_warps: int
  num_stages: int
  group_t: int
  dx_kernel: bool
  low_memory: bool
  token_block: int
  dx_chunk: int  # vocabulary columns per chunk of the low-memory dx pass


# Budget for the backward's dz chunk (B × vocab_chunk in the input dtype).
DZ_CHUNK_BYTES = 32 * 2**20
# Budget for each of the low-memory dx pass's buffers (float32 dx block, dz block).
LOW_MEMORY_BLOCK_BYTES = 16 * 2**20
POSITIVE_FIELDS = ("block_t", "block_v", "block_k", "num_splits", "vocab_chunk", "num_warps", "num_stages",
                   "group_t", "token_block", "dx_chunk")


def _default_splits(row_blocks: int, vocab_tiles: int, sms: int) -> int:
  """Fewest splits whose grid fills its last wave best, from one full wave up to four.

  One program per SM at the default tile (its pipelined operands take ~200 KB of shared memory), so
  ``row_blocks·S / sms`` waves run, the last one partly idle; fewer splits keep each program's vocabulary walk
  long and the partial stats small. llama3-8b (64 row blocks, 132 SMs): S=4, 1.94 waves (measured on an H100,
  best of 4/8/16: 15.2 vs 16.2 vs 18.0 ms).
  """
  row_blocks = max(row_blocks, 1)
  lo = max(1, cdiv(sms, row_blocks))
  best, best_eff = lo, 0.0
  for s in range(lo, 4 * lo + 1):
    waves = row_blocks * s / sms
    eff = waves / cdiv(row_blocks * s, sms)
    if eff > best_eff + 1e-3:
      best, best_eff = s, eff
  return max(1, min(best, vocab_tiles, 64))


def plan(num_tokens: int, hidden: int, vocab: int, dtype, config: ConfigFields | None = None) -> Plan:
  """Block sizes for one shape: the heuristic, with any field of ``config`` taking precedence.

  * ``block_t`` 128 (fewer for tiny B: next power of two ≥ 16), ``block_v`` 256 for 2-byte inputs, 128 for
    fp32 (shared memory per stage: ``(block_t + block_v)·block_k·itemsize``), ``block_k`` 64 (32 for fp32),
    each capped at the next power of two of the dimension; 8 warps for a 128×256 tile, else 4; 3 stages
    (4 for 2-byte inputs on SM90, which has 228 KB of shared memory).
  * ``num_splits``: see :func:`_default_splits` (at least one full wave of programs, the last wave as full as
    possible), at most the number of vocabulary tiles and 64 (the partial stats stay ≤ 16·B·64 bytes).
  * ``vocab_chunk``: ``DZ_CHUNK_BYTES / (B·itemsize)`` rounded down to a power of two in [256, 16384] and to a
    multiple of ``block_v``.

  Raises ``ValueError`` naming a field whose value is not allowed.
  """
  c = config or Config()
  common.check_positive(c, POSITIVE_FIELDS)
  itemsize = jnp.dtype(dtype).itemsize
  small = itemsize <= 2
  tokens = max(num_tokens, 1)  # an empty batch plans as one token (dispatch never runs it)
  bt = c.block_t or max(16, min(128, pow2_ceil(tokens)))
  bv = c.block_v or max(16, min(256 if small else 128, pow2_ceil(vocab)))
  bk = c.block_k or max(16, min(64 if small else 32, pow2_ceil(hidden)))
  for name, val in (("block_t", bt), ("block_v", bv), ("block_k", bk)):
    if val < 16 or val & (val - 1):
      raise ValueError(f"{name}={val} must be a power of two >= 16 (Triton tiles)")
  nvt = cdiv(vocab, bv)
  splits = min(c.num_splits or _default_splits(cdiv(tokens, bt), nvt, _device.num_sms()), max(nvt, 1))
  # low_memory: half the dz budget, so the dw pass (dz chunk) and the dx pass (two 16 MB blocks) stay ≤ 64 MB
  dz_bytes = DZ_CHUNK_BYTES // 2 if c.low_memory else DZ_CHUNK_BYTES
  chunk = c.vocab_chunk or min(max(pow2_floor(dz_bytes // (itemsize * tokens)), 256), 16384)
  chunk = cdiv(chunk, bv) * bv  # whole tiles per chunk; the last chunk of V is ragged instead
  warps = c.num_warps or (8 if bt * bv >= 128 * 256 else 4)
  stages = c.num_stages or (4 if small and _device.at_least(_device.HOPPER) else 3)
  # XLA's matmul + add measured faster than the in-place dx kernel at all four anchor shapes (H100: llama3-8b
  # 58.8 vs 63.9 ms fwd+bwd), at 90 MB more temp memory there (286 vs 196 MB); the low-memory path needs the kernel.
  low = bool(c.low_memory)
  # Low-memory dx pass: a float32 [token_block, H] accumulator and a [token_block, dx_chunk] dz of ~16 MB each.
  tb = c.token_block or max(bt, pow2_floor(LOW_MEMORY_BLOCK_BYTES // (4 * max(hidden, 1))))
  tb = cdiv(min(tb, cdiv(tokens, bt) * bt), bt) * bt
  dx_chunk = c.dx_chunk or max(pow2_floor(LOW_MEMORY_BLOCK_BYTES // (itemsize * tb)), bv)
  dx_chunk = cdiv(dx_chunk, bv) * bv
  return Plan(bt, bv, bk, splits, chunk, warps, stages, c.group_t or 8, bool(c.dx_kernel) or low, low, tb, dx_chunk)


def check_dtype(impl: str, dtype) -> None:
  if dtype is not None and jnp.dtype(dtype) not in [jnp.dtype(t) for t in DTYPES]:
    raise NotImplementedError(f"{impl} runs float16, bfloat16 and float32 inputs, got {jnp.dtype(dtype)}")


def supported(spec: common.Spec, platform: str, dtype=None) -> None:
  """Raises ``NotImplementedError`` for a dtype the kernels do not take (the GPU they need, or interpret mode, is
  checked by the registry: :func:`lce_flax._impl.base.check_supported`)."""
  del spec, platform
  check_dtype("pallas_triton", dtype)


def lean_design(impl: str, p: Plan, num_tokens: int, hidden: int, vocab: int, dtype, interpret: bool = False
                ) -> common.Design:
  """The ``Design`` of the recompute backward below with the resolved plan ``p`` (``pallas_triton`` and
  ``triton``). ``memory_bytes`` (the module docstring's accounting, a bias included): the forward's partial
  stats (16 bytes per token and split), the dz chunk (B·chunk·itemsize) and its bias column sums, and the
  float32 dx (B·H·4, twice with XLA's product when ``dx_kernel`` is False); with ``low_memory``, the dx pass's
  float32 [token_block, H] block and its [token_block, dx_chunk] dz instead of the dx."""
  notes = ("interpret mode: the dw matmul accumulates in float32 and is then cast (compiled, it writes w's dtype "
           "directly, accumulating in float32 inside cuBLAS)",) if interpret else ()
  itemsize = jnp.dtype(dtype).itemsize
  rows = cdiv(num_tokens, p.block_t) * p.block_t
  width = min(p.vocab_chunk, cdiv(vocab, p.block_v) * p.block_v)
  mem = 16 * p.num_splits * rows + num_tokens * width * itemsize + rows // p.block_t * width * 4
  tiles = f"{p.block_t}×{p.block_v}×{p.block_k} tiles, {p.num_splits} vocabulary splits in the forward"
  if p.low_memory:
    mem += p.token_block * hidden * 4 + p.token_block * p.dx_chunk * itemsize
    chunking = (f"{tiles}; backward: dw over vocabulary chunks of {p.vocab_chunk} columns, then dx over blocks "
                f"of {p.token_block} tokens × chunks of {p.dx_chunk} columns")
    return common.Design(impl, "lean", "recompute_low_memory", p, chunking, mem, notes)
  mem += num_tokens * hidden * 4 * (1 if p.dx_kernel else 2)
  dx = "in place (dx kernel)" if p.dx_kernel else "by XLA matmuls"
  chunking = f"{tiles}; backward: vocabulary chunks of {p.vocab_chunk} columns, dx accumulated {dx}"
  return common.Design(impl, "lean", "recompute", p, chunking, mem, notes)


def check_mode(impl: str, mode: str) -> None:
  """``mode`` (validated by ``LossOptions``) must be one this backend has a design for: lean only."""
  if mode == "fast":
    raise NotImplementedError(f"{impl} has no fast design")


def design(num_tokens: int, hidden: int, spec: common.Spec, dtype, mode: str, config: Config | None = None
           ) -> common.Design:
  """The recompute design with every field of ``config`` resolved by :func:`plan` (``Design.config`` is the
  :class:`Plan` that :func:`lean` takes); ``mode="fast"`` raises ``NotImplementedError``."""
  common.check_config(config, Config, "pallas_triton")
  check_mode("pallas_triton", mode)
  check_dtype("pallas_triton", dtype)
  p = plan(num_tokens, hidden, spec.opts.vocab_size, dtype, config)
  return lean_design("pallas_triton", p, num_tokens, hidden, spec.opts.vocab_size, dtype, spec.interpret)


# --------------------------------------------------------------------------------------- the recompute backward


@dataclasses.dataclass(frozen=True)
class Kernels:
  """The two kernel launchers of the recompute design: the forward statistics and the backward's dz chunk.

  ``impl="triton"`` runs the same forward/backward orchestration with its own launchers.

  Attributes:
    forward: ``(x, w, bias, labels, spec, plan) -> RowStats`` of the columns of ``w``.
    dz_chunk: ``(k, width, x, w, bias, labels, lse, g_loss, g_lse, spec, plan) -> (dz, db_parts or None)``: the
      logit gradient [B, width] (input dtype) of the columns ``[k·plan.vocab_chunk, k·plan.vocab_chunk + width)``
      and, with a bias, its float32 column sums per row block, [row_blocks, ≥ width]; ``k`` is a traced int32
      scalar.
  """

  forward: Any
  dz_chunk: Any


def grads_with(launchers: Kernels, x, w, bias, labels, lse, g_loss, g_lse, spec: common.Spec, p):
  """The recompute backward over the columns of ``w`` for the given lse: (dx float32, dw, dbias float32)."""
  g_loss = g_loss.astype(F32)
  g_lse = g_lse.astype(F32)
  vocab = common.vocab_size(w, spec.w_layout)
  # On a GPU the dw matmul writes the weights' dtype directly (cuBLAS accumulates in float32 either way); in
  # interpret mode (CPU) it accumulates in float32 explicitly.
  dw_type = F32 if spec.interpret else w.dtype
  dw_step = functools.partial(_dw_step, launchers, x, w, bias, labels, lse, g_loss, g_lse, spec, p, dw_type)

  def step(k, width, carry):
    dx, dw, db = carry
    dz, dw, db = dw_step(k, width, (None, dw, db))
    if p.dx_kernel:
      dx = kernels.dx_accumulate(dx, dz, w, k, spec, p)
    else:
      wc = common.slice_vocab(w, k * p.vocab_chunk, width, spec.w_layout)
      dx = dx + common.grad_x(dz, wc, spec.w_layout)
    return dx, dw, db

  carry = (jnp.zeros(x.shape, F32), jnp.zeros_like(w), None if bias is None else jnp.zeros(bias.shape, F32))
  if p.low_memory:
    _, dw, db = _vocab_loop(vocab, p.vocab_chunk, lambda k, n, cr: (None, *dw_step(k, n, cr)[1:]),
                            (None, *carry[1:]))
    dx = _dx_by_token_blocks(launchers, x, w, bias, labels, lse, g_loss, g_lse, spec, p)
  else:
    dx, dw, db = _vocab_loop(vocab, p.vocab_chunk, step, carry)
  return dx, dw, db


def _vocab_loop(vocab: int, c: int, step, carry):
  """``step(k, width, carry)`` over the chunks ``[k·c, k·c + width)`` of the vocabulary (the last one ragged)."""
  n_full, tail = vocab // c, vocab % c
  if n_full:
    carry = lax.fori_loop(0, n_full, lambda k, cr: step(k, c, cr), carry)
  if tail:
    carry = step(jnp.int32(n_full), tail, carry)
  return carry


def _dw_step(launchers, x, w, bias, labels, lse, g_loss, g_lse, spec, p, dw_type, k, width, carry):
  """One vocabulary chunk: its dz, and its columns of dw (and dbias). Returns (dz, dw, db)."""
  _, dw, db = carry
  dz, db_parts = launchers.dz_chunk(k, width, x, w, bias, labels, lse, g_loss, g_lse, spec, p)
  # The reduction over tokens is complete inside this one matmul: dw's columns are written once.
  dwc = lax.dot_general(*((x, dz) if spec.w_layout == "hv" else (dz, x)), (((0,), (0,)), ((), ())),
                        preferred_element_type=dw_type)
  dw = lax.dynamic_update_slice_in_dim(dw, dwc.astype(dw.dtype), k * p.vocab_chunk, spec.vocab_axis)
  if db is not None:
    db = lax.dynamic_update_slice_in_dim(db, db_parts[:, :width].sum(0), k * p.vocab_chunk, 0)
  return dz, dw, db


def _dx_by_token_blocks(launchers, x, w, bias, labels, lse, g_loss, g_lse, spec, p):
  """The low-memory backward's dx pass: per block of ``token_block`` tokens, the logits are recomputed chunk by
  chunk (``dx_chunk`` columns) and ``dx_block += dz wᵀ`` accumulates in a float32 [token_block, H] buffer that
  is complete, and cast, before the next block starts."""
  px = dataclasses.replace(p, vocab_chunk=p.dx_chunk)
  vocab = common.vocab_size(w, spec.w_layout)

  def rows(r, n: int):
    sl = lambda a: lax.dynamic_slice_in_dim(a, r, n, 0)
    xb, yb, lb, glb, gsb = sl(x), sl(labels), sl(lse), sl(g_loss), sl(g_lse)

    def step(k, width, acc):
      dz, _ = launchers.dz_chunk(k, width, xb, w, bias, yb, lb, glb, gsb, spec, px)
      return kernels.dx_accumulate(acc, dz, w, k, spec, px)

    return _vocab_loop(vocab, px.vocab_chunk, step, jnp.zeros((n, x.shape[1]), F32))

  tb = min(p.token_block, x.shape[0])
  n_full, tail = divmod(x.shape[0], tb)
  dx = jnp.zeros(x.shape, F32)
  if n_full:
    dx = lax.fori_loop(0, n_full, lambda i, d: lax.dynamic_update_slice_in_dim(d, rows(i * tb, tb), i * tb, 0), dx)
  if tail:
    dx = lax.dynamic_update_slice_in_dim(dx, rows(n_full * tb, tail), n_full * tb, 0)
  return dx


PALLAS_KERNELS = Kernels(kernels.forward, kernels.dz_chunk)


def stats(x, w, bias, labels, spec: common.Spec, plan: Plan) -> _math.RowStats:
  """The forward kernel's row statistics of the columns of ``w``."""
  return PALLAS_KERNELS.forward(x, w, bias, labels, spec, plan)


def grads(x, w, bias, labels, lse, g_loss, g_lse, spec: common.Spec, plan: Plan):
  """The recompute backward for the given lse: (dx float32, dw, dbias float32)."""
  return grads_with(PALLAS_KERNELS, x, w, bias, labels, lse, g_loss, g_lse, spec, plan)
