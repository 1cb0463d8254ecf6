"""``impl="pallas_mosaic"``: Pallas Mosaic GPU kernels (TMA + WGMMA) for Hopper GPUs (SM90: H100, H200).

This file holds the design: :class:`Config`, the :func:`plan` heuristic, the backend protocol of
:mod:`lce_flax._impl.base` (:func:`supported`, :func:`design`, :func:`stats`, :func:`grads`), the padding
(:func:`prepare`) and the recompute backward (the lean ``custom_vjp`` around them is
:func:`lce_flax._impl.base.lean`).
The register-tile loss math is in :mod:`.epilogue`, the one-warpgroup (interpretable) kernels in :mod:`.kernels`,
the warp-specialised ones in :mod:`.kernels_ws`, and the fast designs with their dz pass in :mod:`.fast`.

Both kernels (forward statistics, backward logit gradient) are built on one thing: a float32 tile of ``x @ w``
accumulated by WGMMA over H from shared-memory tiles of x and w that TMA streams in ``num_stages`` steps ahead,
whose accumulator never leaves the registers: the epilogue reduces or transforms it on chip. Two variants:

* **warp-specialised** (the GPU default): a CTA tile of ``block_t × 2·block_v``; two compute warpgroups own one
  ``block_t × block_v`` accumulator each, a third warpgroup only issues TMA copies
  (``plgpu.emit_pipeline_warp_specialized``, as in jax's own Hopper matmul); while one compute warpgroup runs its
  epilogue the other keeps the tensor cores busy. Warpgroup lowering semantics (Mosaic infers the layouts).
* **one warpgroup** (``Config(warp_specialized=False)``; the interpret-mode path): ``plgpu.emit_pipeline`` with
  ``delay_release=1`` (one WGMMA stays in flight while the next tiles land), Lane semantics with explicit
  register layouts. About 1.3× slower on an H100.

Forward (O(B) output)
  ``plgpu.kernel`` over a grid ``(num_splits, row_blocks)``, split fastest, so the CTAs resident at one time share
  a few row blocks of x (in L2) while the vocabulary streams past. CTA ``(j, i)`` walks the vocabulary tiles of
  split ``j`` for its ``block_t`` tokens; each tile's logits (plus bias, soft cap) are reduced to the online
  logsumexp statistics (running max, sum of exponentials, target logit, logit sum) and merged into a running
  per-row state (registers; SMEM per compute warpgroup in the warp-specialised kernel). Only these 4 float32 per
  token and split reach HBM; a tiny JAX step merges the splits (:func:`lce_flax._impl.common.merge_splits`).

Backward (recompute, bounded memory)
  ``jax.custom_vjp`` keeps x, w, bias, labels and the [B] lse. The vocabulary is walked in chunks of
  ``vocab_chunk`` columns; per chunk one persistent Mosaic kernel (a CTA per SM looping over the chunk's tiles:
  the GEMM of :mod:`.gemm` with its :class:`.gemm.LogitGrad` epilogue where it reads w as it is, see
  :attr:`Config.gemm`, else the dz kernel of :mod:`.kernels_ws`) recomputes the chunk's logit tiles and writes the
  logit gradient ``dz`` [B, chunk] in the input dtype (its epilogue is the factored form of
  :func:`lce_flax._math.dlogits`, see :func:`.epilogue.row_coefficients`), then
  two matmuls give ``dw[chunk] += xᵀ dz`` (into zeros: complete after one chunk) and ``dx += dz wᵀ[chunk]``
  (float32 accumulator); dz is zero in the clamped last chunk's columns that the chunk before did. Each matmul is
  XLA's or the GEMM's (:attr:`Config.products`; the tuning table's whole-step rows choose); the GEMM reads w's
  chunk and adds into dw's in place (:func:`chunk_window`).
  FLOPs 2·B·H·V (forward) + 2·B·H·V (recompute) + 4·B·H·V (gradients) = 8·B·H·V.
  Extra memory: the float32 dx (B·H·4; each chunk's product is added into it in place, one loop over all chunks),
  dz (B·chunk·2 bytes: 28 MiB at B=8192, chunk 1792), and where XLA forms a product its copy of the chunk of w and
  the chunk's dw product (H·chunk·2 each) and its cuBLAS workspace; :func:`lean_chunk` keeps them within
  B·H·4 + 64 MB (so with both products in place the chunks are wider: 3584 columns at llama3-8b). With
  ``Config.token_block`` each chunk runs in blocks of the tokens, its dw accumulated over them in float32
  (:func:`_blocked_step`): wider chunks where B is well above H.

Fast mode (``mode="fast"``, 6·B·H·V, a bounded buffer; :mod:`.fast`)
  The forward kernel also writes every logit tile, shifted by its row max, in the input dtype, plus the maxima
  (through SMEM + TMA, while the other warpgroup keeps the tensor cores busy). Once lse is known, one elementwise
  pass turns the stored tiles into dz in place, and dx, dw are plain matmuls: for all B tokens at once
  (``"logits"``: a B×V buffer, the same bytes as torch.compile's bf16 logits) or per chunk of tokens with a float32
  dw (``"tokens"``: H·V·4 + c·V·2 bytes); the default is whichever buffer is smaller (:func:`fast_design`).

Shapes: B is padded to a multiple of ``block_t`` (x is small); the vocabulary's last tile is a window clamped to
end at V whose already-counted columns are masked, so w is not padded or copied when TMA can tile it as it is:
H a multiple of ``block_k`` (64) and V a multiple of 8 ("vh") or 64 ("hv"), and V ≥ ``block_v`` — true of the LLM
heads (50304, 128256, 151936, 256000). Otherwise w is zero-padded (a copy of w per call; small problems only).

dtypes: bf16 and fp16 run as they are (float32 accumulation). WGMMA has no fp32 operands (tf32 would need a
second shared-memory layout), so :func:`supported` refuses float32 inputs: ``dtype=jnp.bfloat16`` runs the kernels
on bf16-rounded inputs (the exact loss of the rounded inputs), ``impl="chunked"`` keeps float32.

Interpret mode (CPU): the one-warpgroup kernels run under Mosaic GPU's own interpreter (see :mod:`.kernels`);
the warp-specialised kernels cannot be interpreted (collective warpgroup axes): CPU tests lower them for CUDA
instead (layout inference and the SMEM budget are checked there), the GPU check runs them.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from lce_flax import _device, _math
from lce_flax._impl import common
from lce_flax._impl.common import F32, cdiv, pow2_floor
from lce_flax._impl.pallas_mosaic import epilogue, kernels, kernels_ws, tuning
from lce_flax._impl.pallas_mosaic import gemm as gemm_lib
from lce_flax._impl.pallas_mosaic.gemm import GemmConfig

DTYPES = (jnp.bfloat16, jnp.float16)
FAST_DESIGNS = ("logits", "tokens")


@dataclasses.dataclass(frozen=True)
class Config:
  """Configuration of ``impl="pallas_mosaic"`` (``lce_flax.PallasMosaicConfig``); ``None`` fields are chosen by
  :func:`plan`.

  Attributes:
    block_t: tokens per tile (multiple of 64: one warpgroup's WGMMA rows).
    block_v: vocabulary columns per tile (multiple of 64).
    block_k: hidden units per pipeline step (64: one 128-byte swizzle of bf16).
    num_stages: TMA pipeline depth (≥ 2).
    num_splits: vocabulary splits of the forward grid.
    vocab_chunk: vocabulary columns per backward chunk of the lean design (a multiple of ``block_v``; rounded up
      to whole CTA tiles of ``2·block_v`` in the warp-specialised kernels); an error in the fast designs.
    token_chunk: tokens per chunk of the "tokens" fast design (a multiple of ``block_t``); setting it makes
      ``fast_design=None`` pick "tokens"; an error in the lean design and in the "logits" one (no chunk loop).
    semantics: ``"lane"`` (explicit register layouts) or ``"warpgroup"`` (layouts inferred by Mosaic); the
      warp-specialised kernels need ``"warpgroup"``.
    warp_specialized: two compute warpgroups (each a ``block_t × block_v`` accumulator, a CTA tile of
      ``block_t × 2·block_v``) fed by a third, TMA-only warpgroup (``plgpu.emit_pipeline_warp_specialized``);
      None: on a GPU yes, in interpret mode no (the interpreter cannot run it).
    fast_design: the buffer ``mode="fast"`` spends: ``"logits"`` (the B×V shifted logits in the input dtype),
      ``"tokens"`` (a chunk of them and an H×V float32 dw), or None: the smaller of the two
      (:func:`fast_design`). Not read by the lean design.
    gemm: the kernels on the persistent GEMM of :mod:`.gemm` (tiling from the tuning table, :mod:`.tuning`)
      instead of those of :mod:`.kernels_ws` / :mod:`.kernels`: the fast designs' forward (its statistics
      epilogue storing the tiles), and lean mode's forward (the statistics epilogue) and its per-chunk
      recompute (:class:`.gemm.LogitGrad`: the logit gradient formed and stored in the epilogue); None: yes where
      it applies (V a multiple of the GEMM's 128-column tile and at least one CTA tile, H of 64: w read in
      place), else no.
    products: who forms the backward products dx = dz·wᵀ and dw = xᵀ·dz (the fast designs', and each vocabulary
      chunk's in the lean design): ``"gemm"`` (the GEMM of :mod:`.gemm`) or ``"xla"`` (``lax.dot_general``:
      cuBLAS), both, or a (dx, dw) tuple of them; None: the pair the whole step measured fastest with at this
      head's bucket where the tuning table has it (:func:`.tuning.step_products`); else in the lean design XLA's
      for both; else in the
      "logits" design with the forward on the GEMM, each product on the GEMM unless the tuning table measured
      XLA's faster at its shape (:func:`.tuning.xla_faster`), else ``"xla"``; in the "tokens" design dx on
      XLA and each chunk's dw added into the float32 dw on the GEMM (TMA reduce-adds into the carried buffer, in
      place: :class:`.gemm.AddTo`).
    token_block: lean: tokens per block of an inner loop over the tokens within each vocabulary chunk (a multiple
      of ``block_t``; needs both chunk products on the GEMM). Each block's dz [block, chunk] and its products are
      formed in turn, x's block and dx's rows read and added into in place (:class:`.gemm.Window`), and the chunk's
      dw accumulated over the blocks in a float32 [H, chunk] buffer: with B well above H the chunks are then wider
      for the same memory, so the B×H float32 dx makes fewer round trips (one per chunk). At least the tokens:
      one block of them all (the chunk's dw complete after one product). None, where both chunk products are on
      the GEMM: the blocks lean mode's whole step ran its pair with in the tuning table's ``steps`` row of this
      head's bucket (:func:`.tuning.step_token_block`), else blocks of ``LEAN_TOKEN_BLOCK`` (8192) from
      ``LEAN_BLOCKED_TOKENS`` (32768) tokens on; else one.
    stored: what the fast forward stores of each tile: ``"exponentials"`` (``exp(zc - r)`` against a reference logit
      r per row: the backward's products take them as they are, no pass over B×V; :mod:`.fast`) or
      ``"shifted"`` (logits shifted by their row max, turned into dz in place by a dz pass); None: exponentials
      where they apply (:func:`stores_probs`: the forward on the GEMM, bf16, no label smoothing). Not read by the
      lean design.
  """

  block_t: int | None = None
  block_v: int | None = None
  block_k: int | None = None
  num_stages: int | None = None
  num_splits: int | None = None
  vocab_chunk: int | None = None
  token_chunk: int | None = None
  semantics: str | None = None
  warp_specialized: bool | None = None
  fast_design: str | None = None
  gemm: bool | None = None
  products: str | None = None
  stored: str | None = None
  token_block: int | None = None


PRODUCTS = ("gemm", "xla")
STORED = ("exponentials", "shifted")


@dataclasses.dataclass(frozen=True)
class Plan:
  """A resolved :class:`Config` for one shape and mode (hashable; ``Design.config``, what lean/fast take)."""

  block_t: int
  block_v: int
  block_k: int
  num_stages: int
  num_splits: int
  semantics: str
  warp_specialized: bool
  vocab_chunk: int | None = None  # lean: vocabulary columns per chunk (None in the fast designs)
  token_chunk: int | None = None  # "tokens": tokens per chunk (None otherwise)
  fast_design: str | None = None  # None: the lean design
  gemm: GemmConfig | None = None  # the kernels on the GEMM of .gemm with this tiling (None: kernels_ws / kernels)
  stats_gemm: bool = False  # lean: the forward's statistics on the GEMM too (see lean_stats_on_gemm)
  products: tuple[str, str] | None = None  # (dx, dw) each on "gemm" or "xla"
  stored: str | None = None  # fast designs: Config.stored as asked (None: where it applies; see stores_probs)
  products_step: str | None = None  # the table's line on the whole step whose fastest pair ``products`` is (or None)
  token_block: int | None = None  # lean: tokens per block of the backward's inner loop (None: all at once)

  @property
  def token_cotangents(self) -> bool:
    """The "logits" design forms dz in its backward: any per-token cotangent (``reduction="none"``) runs it."""
    return self.fast_design == "logits"


# Lean mode's memory beside its float32 dx (B·H·4): one [B, vocab_chunk] chunk of dz and two [H, vocab_chunk]
# buffers, XLA's cuBLAS workspace (CUBLAS_WORKSPACE), the O(B) vectors (64 bytes a token) and a reserve for what
# else XLA holds at the peak.
LEAN_EXTRA_BYTES = 64 * 10**6
LEAN_RESERVE = 4 * 2**20


def lean_bound_bytes(num_tokens: int, hidden: int) -> int:
  """What lean mode promises to hold beside its inputs and gradients: its float32 dx and ``LEAN_EXTRA_BYTES``."""
  return num_tokens * hidden * 4 + LEAN_EXTRA_BYTES


# Lean mode's default blocks of tokens within each vocabulary chunk (Config.token_block): from 32768 tokens on, in
# blocks of 8192, which measured 1.018x (llama3-8b) and 1.019x (gemma2-2b) as fast at 32768 tokens on an H200 as
# one block with XLA's chunk products (the op's pair there then), where blocks of 4096 measured 1.02x and 0.93x
# (benchmarks/results/h200-2026-11-29-lean-blocks; the steps rows of h200-2026-11-29-lean-32k-rows then chose the
# GEMM's pair with these blocks at both heads). A steps row that records blocks for its pair runs those
# (_row_token_block), at its width: llama3-8b's 3072 and gemma2-2b's 3584 columns in blocks of 8192, whose chunk
# buffers fill part of the x gradient's (h200-2026-11-30-lean-32k-widths).
LEAN_BLOCKED_TOKENS = 32768
LEAN_TOKEN_BLOCK = 8192
TOKEN_CHUNK_MIN = 8192
TOKEN_CHUNK_BYTES = 2**30


def _fast_chunk(num_tokens: int, hidden: int) -> int:
  """The chunk the "tokens" design runs at full speed: about 2H tokens (a c×V buffer the size of the H×V float32
  dw it adds into), at least ``TOKEN_CHUNK_MIN``, at most half the tokens."""
  return min(max(2 * hidden, TOKEN_CHUNK_MIN), max(num_tokens // 2, 1))


def token_chunk(num_tokens: int, hidden: int, vocab: int, block_t: int = 128, itemsize: int = 2) -> int:
  """Tokens per chunk of the "tokens" design: :func:`_fast_chunk`, whose ``TOKEN_CHUNK_MIN`` keeps the chunk's
  matmuls at the matmul rate (measured on an H100, gpt2-small: 1024 tokens 12.6 ms / 0.27 GB, 2048 11.5 / 0.38,
  4096 9.7 / 0.58, 8192 9.1 / 1.01; the whole-batch "logits" design 9.0 / 1.68; on the persistent GEMM, two runs
  alternated: 4096 tokens 6.10, 6.07 ms / 0.59 GB, 8192 5.75, 5.94 / 1.00, "logits" 5.71, 5.77 / 1.75, the plain
  head 7.42, 7.47 / 3.30, ``benchmarks/results/gpt2-token-chunk-h100-2026-11-27/``), but a chunk of at most
  ``TOKEN_CHUNK_BYTES`` (1 GiB: 4096 tokens at V = 128256, 2048 at 256000), which bounds the extra memory by
  H·V·4 + 1 GiB + O(B·H) at any number of tokens; a power of two and a multiple of ``block_t``. Larger chunks run
  faster (fewer float32 reduce-adds into dw) and hold more: at 32768 tokens on an H100, llama3-8b 4096 / 8192 /
  16384 tokens 0.986 / 0.980 / 0.974× the plain head at 2.24 / 4.34 / 6.57 GB, gemma2-2b 2048 / 4096 0.928 / 0.890×
  at 2.45 / 4.51 GB (``benchmarks/results/step-h100-2026-11-28-r20/``): past this bound the chunk no longer shares
  the bf16 dw's buffer, and the step outgrows the speed issue's H·V·4 + 1.5 GB. ``Config.token_chunk`` sets it."""
  c = min(_fast_chunk(num_tokens, hidden), TOKEN_CHUNK_BYTES // (max(vocab, 1) * itemsize))
  return max(block_t, pow2_floor(max(c, 1)))


def fast_design(num_tokens: int, hidden: int, vocab: int, itemsize: int = 2) -> str:
  """``"logits"`` (a B×V buffer) unless the "tokens" design at its full-speed chunk (:func:`_fast_chunk`: H·V·4
  of float32 dw plus a c×V chunk) holds less: llama3-8b 2.10 vs 3.15 GB, qwen3-8b 1.24 vs 3.11, gemma2-2b 4.19 vs
  4.46 (logits); gpt2-small 1.65 vs 0.57 GB, and every LLM head at 32768 tokens (tokens). Smaller chunks hold less
  but run slower: at gemma2-2b, 8192 tokens, 2048-token chunks took 49.6 ms (3.44 GB) against the "logits"
  design's 45.5 ms on an H100, ``benchmarks/results/h100-2026-11-24-r4-fallback/``."""
  del vocab  # both buffers are proportional to it
  c = pow2_floor(max(_fast_chunk(num_tokens, hidden), 1))
  if c >= num_tokens:
    return "logits"
  return "logits" if num_tokens * itemsize <= 4 * hidden + c * itemsize else "tokens"


def plan(num_tokens: int, hidden: int, vocab: int, config: Config | None = None, interpret: bool = False,
         mode: str = "lean") -> Plan:
  """Tile sizes for one shape (bf16/fp16 operands) and mode: the heuristic, overridden by any field of
  ``config``; raises ``ValueError`` naming a field whose value is not allowed.

  128×128 tiles (one warpgroup holds a 64 KB float32 accumulator: 128 registers per thread with the epilogue's
  temporaries), 64-deep steps, 4 stages (32 KB of SMEM per stage; 48 KB with warp specialisation);
  ``num_splits`` for ~8 waves of CTAs over the SMs (H100, llama3-8b forward: 4 splits 14.3 ms, 8 splits 14.7 ms,
  16 splits 13.8 ms); lean ``vocab_chunk``: :func:`lean_chunk`; fast: :func:`fast_design` and :func:`token_chunk`.
  """
  c = config or Config()
  common.check_positive(c, ("block_t", "block_v", "block_k", "num_stages", "num_splits", "vocab_chunk",
                             "token_chunk", "token_block"))
  common.check_loop(c, mode, "pallas_mosaic")
  ws = (not interpret) if c.warp_specialized is None else bool(c.warp_specialized)
  if ws and interpret:
    raise NotImplementedError("warp_specialized=True cannot run in interpret mode (Mosaic GPU's interpreter has no "
                              "collective warpgroup axes); use warp_specialized=False")
  tokens = max(num_tokens, 1)  # an empty batch plans as one token (dispatch never runs it)
  # (the warp-specialised kernels' layout inference fails for block_t=64: they keep 128-row tiles)
  bt = c.block_t or (64 if tokens <= 64 and not ws else 128)
  bv = c.block_v or 128
  bk = c.block_k or 64
  for name, val in (("block_t", bt), ("block_v", bv), ("block_k", bk)):
    if val % 64:
      raise ValueError(f"{name}={val} must be a positive multiple of 64")
  stages = c.num_stages or 4
  if stages < 2:
    raise ValueError(f"num_stages={stages} must be >= 2 (one WGMMA stays in flight)")
  if c.semantics not in (None, "lane", "warpgroup"):
    raise ValueError(f"semantics={c.semantics!r} must be 'lane' or 'warpgroup'")
  if ws and c.semantics == "lane":
    raise ValueError("semantics='lane' cannot run the warp-specialised kernels (they use warpgroup semantics); "
                     "use warp_specialized=False for lane semantics")
  sem = c.semantics or ("warpgroup" if ws else "lane")
  if c.stored not in (None, *STORED):
    raise ValueError(f"stored={c.stored!r} must be one of {STORED} (or None)")
  if c.fast_design not in (None, *FAST_DESIGNS):
    hint = " (the chunked fast design is impl='chunked')" if c.fast_design == "chunked" else ""
    raise ValueError(f"fast_design={c.fast_design!r} must be one of {FAST_DESIGNS} (or None){hint}")
  vp = max(vocab, bv)
  nvt = cdiv(vp, bv)
  splits = min(c.num_splits or max(1, min(nvt, 64, cdiv(8 * _device.num_sms(), cdiv(tokens, bt)))), nvt)
  if ws:
    splits = min(splits, cdiv(vp, 2 * bv))
  tiles = Plan(bt, bv, bk, stages, splits, sem, ws)
  if mode == "fast" and c.token_block is not None:
    raise ValueError(f"token_block={c.token_block}: blocks of tokens within each vocabulary chunk are lean mode's "
                     "(the fast designs' own token loop is token_chunk)")
  if mode == "fast":
    products_pair(c.products)  # (a clear error for a bad one)
    tiles = dataclasses.replace(tiles, gemm=_gemm_config(c, "fwd_store", tokens, hidden, vocab, interpret, ws),
                                stored=c.stored)
    # a token chunk asked for picks the design that has a token loop
    design = c.fast_design or ("tokens" if c.token_chunk is not None else fast_design(num_tokens, hidden, vocab))
    if design == "logits":
      if c.token_chunk is not None:
        raise ValueError(f"token_chunk={c.token_chunk}: the 'logits' fast design has no chunk loop (it stores the "
                         "logits of all tokens at once); use fast_design='tokens' for chunks of tokens")
      return _products(dataclasses.replace(tiles, fast_design=design), c, tokens, hidden, vocab)
    chunk = c.token_chunk or token_chunk(num_tokens, hidden, vocab, bt)
    if chunk % bt:
      raise ValueError(f"token_chunk={chunk} (tokens per chunk of the 'tokens' fast design) must be a multiple of "
                       f"block_t={bt}")
    return _products(dataclasses.replace(tiles, token_chunk=chunk, fast_design=design), c, tokens, hidden, vocab)
  # the chunk products first: on the GEMM they read and write the chunk in place, which leaves room for wider chunks
  p = _products(dataclasses.replace(tiles, gemm=_gemm_config(c, "fwd_stats", tokens, hidden, vocab, interpret, ws)),
                c, tokens, hidden, vocab)
  block = _token_block(c.token_block, p, tokens, bt, hidden, vocab)
  chunk = c.vocab_chunk or _measured_chunk(p, tokens, hidden, vocab, block) or lean_chunk(
      tokens, hidden, bv * (2 if ws else 1), in_place=_products_in_place(p), token_block=block)
  if chunk % bv:
    raise ValueError(f"vocab_chunk={chunk} must be a positive multiple of block_v={bv}")
  chunk = min(chunk, (vp // bv) * bv)
  if ws:
    chunk = cdiv(chunk, 2 * bv) * 2 * bv  # whole CTA tiles (2 warpgroups × block_v) per chunk
    chunk = min(chunk, (max(vp, 2 * bv) // (2 * bv)) * 2 * bv)
  p = dataclasses.replace(p, vocab_chunk=chunk, token_block=block)
  return dataclasses.replace(p, stats_gemm=lean_stats_on_gemm(p, tokens, hidden, vocab))


def _measured_chunk(p: Plan, tokens: int, hidden: int, vocab: int, block: int | None) -> int | None:
  """The chunk width lean mode's whole step measured fastest at with the pair the tuning table chose for it (its
  ``steps`` row, :func:`.tuning.step_chunk`), where the row chose the pair, its step ran the same blocks of tokens
  (``block``), and the width is a multiple of the kernels' CTA tile that fits the memory (at most
  :func:`lean_chunk`'s with those blocks); else None (the width by memory alone)."""
  if p.products_step is None:
    return None
  rows, step = cdiv(tokens, p.block_t) * p.block_t, p.block_v * (2 if p.warp_specialized else 1)
  width = tuning.step_chunk("recompute", rows, hidden, vocab, gemm_lib._device_kind(), p.products, block)
  most = lean_chunk(tokens, hidden, step, in_place=_products_in_place(p), token_block=block)
  if block is not None:  # the blocked chunk's buffers also fit in the x gradient's (see _blocked_chunk_fits)
    most = max(most, _blocked_chunk_fits(rows, hidden, block) // step * step)
  return width if width is not None and width % step == 0 and width <= most else None


def _blocked_chunk_fits(rows: int, hidden: int, block: int, itemsize: int = 2) -> int:
  """The widest chunk whose buffers in blocks of ``block`` tokens (dz [block, chunk], the chunk's float32 dw
  [H, chunk] and its rounded sum) fit in the x gradient's output buffer (rows·H·itemsize bytes, written only
  at the end), where XLA places them: on an H200 at llama3-8b's 32768×4096 lean mode's step held 0.554 GB of
  temporaries both at 1024 columns in blocks of 8192 and at 2048 in blocks of 4096 (67 MB of chunk buffers,
  beyond lean_chunk's 1536 there): the float32 dx and 17 MB
  (``benchmarks/results/h200-2026-11-29-lean-32k-blocks/``). A steps row's width may be this wide; lean mode's
  width by memory alone (:func:`lean_chunk`, no row) keeps to ``LEAN_EXTRA_BYTES``."""
  return rows * hidden * itemsize // (block * itemsize + hidden * (4 + itemsize))


def _row_token_block(p: Plan, tokens: int, hidden: int, vocab: int) -> tuple[bool, int | None]:
  """``(True, block)`` where the tuning table's ``steps`` row chose lean mode's pair (``p.products_step``) and
  records the blocks of tokens its step ran with it (:func:`.tuning.step_token_block`), else ``(False, None)``."""
  if p.products_step is None:
    return False, None
  rows = cdiv(tokens, p.block_t) * p.block_t
  return tuning.step_token_block("recompute", rows, hidden, vocab, gemm_lib._device_kind(), p.products)


def _token_block(asked: int | None, p: Plan, tokens: int, bt: int, hidden: int, vocab: int) -> int | None:
  """Lean mode's tokens per block (``Config.token_block``) as it runs: None where one block would hold them all;
  ``ValueError`` unless a multiple of ``block_t`` with both chunk products on the GEMM reading x in place. Not
  asked: where both products are in place, the blocks the tuning table's ``steps`` row ran its pair with
  (:func:`_row_token_block`), else ``LEAN_TOKEN_BLOCK`` from ``LEAN_BLOCKED_TOKENS`` tokens on; else None."""
  if asked is None:
    if not _products_in_place(p):
      return None
    found, block = _row_token_block(p, tokens, hidden, vocab)
    if found:
      return block if block is not None and block % bt == 0 and block < cdiv(tokens, bt) * bt else None
    return LEAN_TOKEN_BLOCK if tokens >= LEAN_BLOCKED_TOKENS and LEAN_TOKEN_BLOCK % bt == 0 else None
  if asked % bt:
    raise ValueError(f"token_block={asked} must be a multiple of block_t={bt}")
  if not _products_in_place(p):
    raise ValueError(f"token_block={asked}: blocks of tokens need lean mode's chunk products and its recompute on "
                     f"the GEMM, which reads x's block in place (products='gemm' and gemm=True; here products="
                     f"{p.products}, gemm={p.gemm is not None})")
  return asked if asked < cdiv(tokens, bt) * bt else None


def _gemm_stats_bytes(cfg: GemmConfig, rows: int, vocab: int) -> int:
  """Bytes of the GEMM's statistics output, 4 float32 per row and column tile (both in whole cluster tiles)."""
  cm, cn = cfg.cluster_tile()
  return 16 * cdiv(rows, cm) * cm * cdiv(vocab, cn) * (cn // cfg.tile_n)


def _lean_backward_bytes(p: Plan, rows: int, hidden: int, itemsize: int = 2) -> int:
  """Lean mode's backward buffers: dz [B, chunk], the float32 dx, and where XLA forms a chunk product the chunk of
  w and the chunk's dw product (on the GEMM both products take the chunk in place: :func:`chunk_window`); with
  token blocks dz [block, chunk] and the chunk's float32 dw with its rounded sum (:func:`lean_chunk`)."""
  if p.token_block is not None:
    return p.vocab_chunk * (p.token_block * itemsize + hidden * (4 + itemsize)) + rows * hidden * 4
  xla = 0 if _products_in_place(p) else 2 * hidden * p.vocab_chunk * itemsize
  return rows * p.vocab_chunk * itemsize + rows * hidden * 4 + xla


def _products_in_place(p: Plan) -> bool:
  """Whether both of lean mode's chunk products run on the GEMM, reading w's chunk and adding into dw's in place
  (:func:`chunk_window`: the chunk's start a multiple of 64, true on the GEMM, whose V is whole column tiles)."""
  return p.products == ("gemm", "gemm") and p.gemm is not None


def lean_stats_on_gemm(p: Plan, num_tokens: int, hidden: int, vocab: int, itemsize: int = 2) -> bool:
  """Whether lean mode's forward runs on the GEMM (else the forward kernel of kernels_ws.py, whose statistics are a
  few float32 per row and split): its statistics, 4 float32 per row and 128-column tile, are dead before the
  backward allocates, so they add nothing where they fit in one of the backward's buffers (the float32 dx, dz) or
  in dw's output (written only by the backward; XLA places them there). dz is [B, chunk], or [block, chunk] in
  blocks of tokens. At gpt2-small's 16384×768×50304 none holds (103 MB against 50, 59 and 77 MB with the chunk
  products on the GEMM: the statistics beside them took the step to 154 MB on an H200; in blocks of 4096 tokens
  dz is 36 MB, and counting it as [B, chunk] took that step to 154 MB too), and the forward kernel keeps lean mode
  within B·H·4 + 64 MB."""
  if p.gemm is None:
    return False
  rows = cdiv(max(num_tokens, 1), p.block_t) * p.block_t
  dz_rows = p.token_block or rows
  room = max(rows * hidden * 4, dz_rows * p.vocab_chunk * itemsize, hidden * vocab * itemsize)
  return _gemm_stats_bytes(p.gemm, rows, vocab) <= room


def lean_chunk(num_tokens: int, hidden: int, step: int, in_place: bool = False, token_block: int | None = None
               ) -> int:
  """Lean mode's vocabulary columns per chunk: the most that keep its buffers within ``LEAN_EXTRA_BYTES`` beside
  the per-token vectors and ``LEAN_RESERVE``; a multiple of ``step`` (the kernel's column tile) in [step, 16384].

  With both chunk products on the GEMM (``in_place``: w's chunk read and dw's chunk added into in place,
  :func:`chunk_window`; dx added into the float32 dx by TMA reduce-adds; no cuBLAS call) the one buffer is dz
  [B, chunk]: 3584 columns at llama3-8b's 8192×4096 and gemma2-2b's 8192×2304, 7168 at qwen3-8b's 4096×4096,
  1792 at gpt2-small's 16384×768. With blocks of ``token_block`` tokens the buffers are dz [block, chunk], the
  chunk's float32 dw [H, chunk] and the rounded sum that updates dw's columns (H·chunk·2, counted should XLA not
  form it inside the update): 1536 columns at llama3-8b's 32768×4096 in blocks of 4096 tokens, against 768 without.
  Else:

  Per chunk XLA holds three bf16 buffers: dz [B, chunk], the chunk of w it copies for cuBLAS and the chunk's dw
  product (both [H, chunk]: a chunk of columns of an [H, V] head is strided); and its cuBLAS workspace. The x
  gradient's own buffer (B·H·2 bytes, written last) is idle until the end, and XLA's buffer assignment puts the
  workspace there when it is larger, else dz when that fits (``benchmarks/probe_hlo.py --buffers``, H100). So:
  1792 columns at llama3-8b's 8192×4096, 2304 at gemma2-2b's 8192×2304, 1536 at qwen3-8b's 4096×4096, 768 at
  gpt2-small's 16384×768 (memory measured in ``benchmarks/results/h100-2026-11-24-r6-lean``)."""
  room = LEAN_EXTRA_BYTES - LEAN_RESERVE - 64 * num_tokens
  if token_block is not None:
    return min(max(room // (2 * token_block + 6 * hidden) // step * step, step), 16384)
  if in_place:
    return min(max(room // (2 * num_tokens) // step * step, step), 16384)
  out = num_tokens * hidden * 2
  if out > CUBLAS_WORKSPACE:  # the workspace goes into the x gradient's buffer
    chunk = room // (2 * (num_tokens + 2 * hidden))
  else:  # all in temp, or dz in the x gradient's buffer (chunk ≤ H)
    room -= CUBLAS_WORKSPACE
    chunk = max(room // (2 * (num_tokens + 2 * hidden)), min(hidden, room // (4 * hidden)))
  return min(max(chunk // step * step, step), 16384)


def per_token_config(config: Config | None) -> Config | None:
  """The config of the fast design that takes per-token cotangents ("logits", which forms dz in its backward),
  for ``reduction="none"`` where :func:`fast_design` picks "tokens" (gpt2-small: 7.6 ms and 1.75 GB against
  11.1 ms in lean mode and the plain head's 7.5 ms and 3.3 GB); None when the config chose a design or a token
  chunk."""
  c = config or Config()
  if c.fast_design is not None or c.token_chunk is not None:
    return None
  return dataclasses.replace(c, fast_design="logits")


def _lean_min_vocab(cfg: GemmConfig, ws: bool) -> int:
  """Lean mode's least V on the GEMM: one CTA tile of its kernels (the padding of :func:`prepare` below it)."""
  return cfg.tile_n * (2 if ws else 1)


def _gemm_config(c: Config, role: str, tokens: int, hidden: int, vocab: int, interpret: bool, ws: bool
                 ) -> GemmConfig | None:
  """The tuning table's tiling of the forward on the GEMM of :mod:`.gemm` (``role``: "fwd_store", the fast
  designs' forward storing its tiles; "fwd_stats", lean mode's) where it applies (see :attr:`Config.gemm`), else
  None; ``gemm=True`` where it does not raises ``ValueError`` saying why."""
  if c.gemm is False:
    return None
  bias = jax.ShapeDtypeStruct((vocab,), F32)
  cfg = gemm_lib.table_config(role, tokens, vocab, hidden, jnp.bfloat16, interpret=interpret,
                              epilogue=gemm_lib.RowStats(None, store=role == "fwd_store", bias=bias))
  why = gemm_refusal(cfg, hidden, vocab, _lean_min_vocab(cfg, ws) if role == "fwd_stats" else 0)
  if why is not None:
    if c.gemm:
      raise ValueError(f"gemm=True: {why}")
    return None
  return cfg


def products_pair(products) -> tuple[str, str] | None:
  """``Config.products`` as a (dx, dw) pair: one name for both, or a pair of names; None stays None."""
  if products is None:
    return None
  pair = (products, products) if isinstance(products, str) else tuple(products)
  if len(pair) != 2 or any(not isinstance(q, str) or q not in PRODUCTS for q in pair):
    raise ValueError(f"products={products!r} must be one of {PRODUCTS}, a (dx, dw) pair of them, or None")
  return pair


def _products(p: Plan, c: Config, num_tokens: int, hidden: int, vocab: int) -> Plan:
  """``products`` resolved, (dx, dw): both as asked; else XLA's where the forward is not on the GEMM; in the lean
  design (each vocabulary chunk's dx added into the float32 dx, its dw written into dw) XLA's where the tuning
  table has no whole step of it at this head's bucket. In the
  "tokens" design: dx on XLA (its chunk-sized dx ran faster on XLA's GEMM on an H100 at gpt2-small, 4096-token
  chunks: 6.97 vs 7.15 ms for the whole step, ``benchmarks/results/h100-2026-11-24-r4-fallback/``; equal at
  llama3-8b with 32768 tokens) and each chunk's dw added into the carried float32 dw by the GEMM's
  :class:`.gemm.AddTo` (TMA reduce-adds in place: over 8 chunks of 4096 tokens 53.2 against cuBLAS's 55.4 ms at
  llama3-8b, level at gemma2-2b and gpt2-small, ``benchmarks/results/h100-2026-11-25-r16-addto/dw_acc/``). In
  the "logits" design each product on the GEMM but where its tuning-table row measured XLA's GEMM faster at its
  shape (:func:`.tuning.xla_faster`). Either design takes, before those rules, the pair its whole step measured
  fastest with at this head's bucket where the table has that step (:func:`.tuning.step_products`)."""
  if c.products is not None:
    return dataclasses.replace(p, products=products_pair(c.products))
  if p.gemm is None:
    return dataclasses.replace(p, products=("xla", "xla"))
  kind, rows = gemm_lib._device_kind(), cdiv(num_tokens, p.block_t) * p.block_t
  step = tuning.step_products(p.fast_design or "recompute", rows, hidden, vocab, kind)
  if step is not None:
    return dataclasses.replace(p, products=step[0], products_step=step[1])
  if p.fast_design is None:
    return dataclasses.replace(p, products=("xla", "xla"))
  if p.fast_design == "tokens":
    return dataclasses.replace(p, products=("xla", "gemm"))
  on = lambda role, mnk: "xla" if tuning.xla_faster(role, *mnk, kind) else "gemm"
  return dataclasses.replace(p, products=(on("dx", (rows, hidden, vocab)), on("dw", (hidden, vocab, rows))))


PROBS_GAP = 60.0  # nats: the largest lse - reference logit the stored exponentials serve (see .fast)
REF_COLUMNS = 256  # columns of w whose logits give each row's reference: the labels of this many tokens (.fast)


def shifted_reason(p: Plan, opts, dtype) -> str | None:
  """Why the fast forward stores shifted logits (and runs a dz pass) rather than exponentials against a per-row
  reference logit, whose backward forms dz with no pass over B×V (:mod:`.fast`); None: it stores exponentials.
  They apply on the GEMM forward, bf16 (fp16 overflows past e^11), without label smoothing (its uniform term,
  times a soft cap's derivative, is no per-row factor) and ``Config.stored`` other than "shifted";
  ``stored="exponentials"`` where they do not apply raises ``ValueError`` saying why."""
  if p.stored == "shifted":
    return "stored='shifted'"
  why = ("the fast forward is not on the GEMM" if p.gemm is None else
         f"{jnp.dtype(dtype).name} inputs (exp(zc - r) overflows float16)" if jnp.dtype(dtype) != jnp.bfloat16 else
         "label smoothing (its uniform term is no per-row factor)" if opts.label_smoothing else None)
  if why is not None and p.stored == "exponentials":
    raise ValueError(f"stored='exponentials' does not apply here: {why}; use stored='shifted' (or None)")
  return why


def stores_probs(p: Plan, opts, dtype) -> bool:
  """Whether a fast plan's forward stores exponentials (:func:`shifted_reason` is None)."""
  return p.fast_design is not None and shifted_reason(p, opts, dtype) is None


def gemm_refusal(cfg: GemmConfig, hidden: int, vocab: int, min_vocab: int = 0) -> str | None:
  """Why the kernels cannot run on the GEMM of :mod:`.gemm` at this shape (None: they can). ``min_vocab``: the
  columns the design's other kernels need at least (lean mode's: one CTA tile, else :func:`prepare` pads w)."""
  if vocab % cfg.tile_n or hidden % 64:
    return (f"H×V = {hidden}×{vocab}: the GEMM forward needs V a multiple of its {cfg.tile_n}-column tile (whole "
            "stored tiles, no copy of w) and H of 64")
  if vocab < min_vocab:
    return f"V={vocab} is below one CTA tile of the kernels ({min_vocab} columns)"
  return None


def check_dtype(dtype) -> None:
  if jnp.dtype(dtype) not in [jnp.dtype(t) for t in DTYPES]:
    raise NotImplementedError(
        f"pallas_mosaic runs bfloat16 and float16 inputs, got {jnp.dtype(dtype)}: WGMMA has no float32 operands; "
        "pass dtype=jnp.bfloat16 to run the kernels on bf16-rounded inputs")


def supported(spec: common.Spec, platform: str, dtype=None) -> None:
  """Raises ``NotImplementedError`` unless the kernels take ``dtype``: bf16/fp16 (None: not checked). The SM90 GPU
  they need (or Mosaic GPU's interpreter) is checked by the registry
  (:func:`lce_flax._impl.base.check_supported`)."""
  del spec, platform
  if dtype is not None:
    check_dtype(dtype)


# the workspace XLA's GPU backend gives its cuBLAS-Lt GEMMs (``s8[33554432]`` in the compiled HLO), counted as temp
CUBLAS_WORKSPACE = 32 * 2**20


def memory_bytes(p: Plan, num_tokens: int, hidden: int, vocab: int, itemsize: int, probs: bool = False) -> int:
  """Bound on the extra memory of forward + backward (this file's and :mod:`.fast`'s accounting, a bias
  included): the padded copies of x and w (when the shape needs them), the forward's partial stats, and

  * lean: dz (B·chunk·itemsize), the float32 dx (B·H·4: each chunk's product is added into it in place), two
    [H, chunk] buffers (the chunk of w, should XLA copy it for cuBLAS, and the chunk's dw product), or, where
    larger, the forward's partial statistics (dead by then);
  * "logits": the stored tiles, turned into dz in place (B·V·itemsize), their row maxima (B·⌈V/bv⌉·4), the
    bias column sums per row block, the backward's float32 dx product (B·H·4) and x scaled by the cotangent;
  * "tokens" (c tokens per chunk): the float32 dw (H·V·4), one chunk's stored tiles, maxima and bias sums
    (c·V·itemsize + c·⌈V/bv⌉·4 + ...), its float32 dx product (c·H·4), and x padded to whole chunks.

  With stored exponentials (``probs``, :func:`stores_probs`) there are no maxima and no bias sums per row block, the
  reference logits of every token are one [B, 256] float32 product, and the repair of rows past the exponentials'
  range writes into the stored tiles (O(B) flags and factors).
  Every design but lean mode with both chunk products in place (:func:`_products_in_place`) also calls XLA's GEMMs,
  whose cuBLAS workspace (``CUBLAS_WORKSPACE``, 32 MiB) XLA counts as temp.
  """
  bt, bv, bk = p.block_t, p.block_v, p.block_k
  bp, hp = cdiv(num_tokens, bt) * bt, cdiv(hidden, bk) * bk
  mult = bv if p.fast_design else 64  # the stores need whole tiles; a bias pads to 64 columns (see prepare)
  vp = max(cdiv(vocab, mult) * mult, bv * (2 if p.warp_specialized else 1))
  stats = 16 * p.num_splits * (2 if p.warp_specialized else 1) * bp  # the forward's partial statistics
  cublas = 0 if p.fast_design is None and _products_in_place(p) else CUBLAS_WORKSPACE
  mem = 2 * vp * 4 + cublas  # float32 bias and dbias, XLA's cuBLAS workspace
  mem += bp * hp * itemsize if (bp, hp) != (num_tokens, hidden) else 0
  mem += 2 * hp * vp * itemsize if (hp, vp) != (hidden, vocab) else 0  # padded w and its padded gradient
  nvt = vp // bv if p.fast_design and not probs else 0
  if p.fast_design is None:
    # on the GEMM the forward's statistics fit in the backward's buffers or dw's output (lean_stats_on_gemm)
    return mem + max(0 if p.stats_gemm else stats, _lean_backward_bytes(p, bp, hp, itemsize))
  mem += stats
  rows = bp if p.fast_design == "logits" else p.token_chunk
  sums = 0 if probs else rows // bt * vp * 4  # the dz pass's bias column sums per row block
  if probs:  # the reference logits' [B, REF_COLUMNS] float32 product
    mem += bp * min(REF_COLUMNS, bp) * 4
  if p.fast_design == "logits":
    return mem + bp * vp * itemsize + bp * nvt * 4 + sums + bp * hp * (4 + itemsize)
  c = p.token_chunk
  return mem + hp * vp * 4 + c * vp * itemsize + c * nvt * 4 + sums + c * hp * 4 + cdiv(bp, c) * c * hp * itemsize


def design(num_tokens: int, hidden: int, spec: common.Spec, dtype, mode: str, config: Config | None = None
           ) -> common.Design:
  """The design that runs for ``mode`` ("recompute" when lean; "logits" or "tokens" when fast), its
  :class:`Plan` (``Design.config``, what :func:`lean` / :func:`.fast.fast` take) and :func:`memory_bytes`."""
  common.check_config(config, Config, "pallas_mosaic")
  check_dtype(dtype)
  vocab = spec.opts.vocab_size
  p = plan(num_tokens, hidden, vocab, config, spec.interpret, mode)
  kind = (f"warp-specialised, CTA tiles of {p.block_t}×{2 * p.block_v}" if p.warp_specialized
          else "one warpgroup")
  tiles = f"{p.block_t}×{p.block_v}×{p.block_k} tiles ({kind}), {p.num_splits} vocabulary splits in the forward"
  if p.gemm is not None:
    tiles = f"forward on the persistent GEMM ({p.gemm.short()})"
    if p.fast_design is not None and not stores_probs(p, spec.opts, dtype):
      tiles += f", dz pass in {p.block_t}×{p.gemm.tile_n} blocks"
  if p.fast_design is None:
    name, chunking = "recompute", f"{tiles}; backward: vocabulary chunks of {p.vocab_chunk} columns"
    if p.token_block is not None:
      why = ("asked" if config is not None and config.token_block is not None
             else "the blocks of the tuning table's steps row" if _row_token_block(p, num_tokens, hidden, vocab)[0]
             else f"the default from {LEAN_BLOCKED_TOKENS} tokens on")
      chunking += (f", each in blocks of {p.token_block} tokens ({why}; x's block and dx's rows read and added into "
                   "in place, the chunk's dw accumulated over the blocks in float32)")
  elif p.fast_design == "logits":
    name, chunking = "logits", f"{tiles}; the logits of all {num_tokens} tokens stored at once (no chunk loop)"
  else:
    name, chunking = "tokens", f"{tiles}; token chunks of {p.token_chunk} tokens, each chunk's logits stored"
  notes = []
  hp, vp = padded_w(p, hidden, vocab, spec.w_layout)
  if (hp, vp) != (hidden, vocab):
    notes.append(f"w is zero-padded from H×V = {hidden}×{vocab} to {hp}×{vp} for TMA: a copy of w (and of its "
                 f"gradient) per call; H a multiple of {p.block_k} and V of {_v_multiple(p, spec.w_layout)} (at least "
                 f"{p.block_v * (2 if p.warp_specialized else 1)}) avoid it (with a bias V is padded to 64 columns)")
  probs = stores_probs(p, spec.opts, dtype)
  if p.fast_design is None:
    notes.append(_lean_note(p, num_tokens, hidden, vocab))
  else:
    notes.extend(_gemm_notes(p, num_tokens, hidden, vocab, spec, probs))
    if p.fast_design == "tokens" and (config is None or config.token_chunk is None):
      notes.extend(_chunk_note(p.token_chunk, num_tokens, hidden, vocab, jnp.dtype(dtype).itemsize))
    if probs:
      notes.append(f"the stored tiles are exp(zc - r), r each row's largest logit at the labels of {REF_COLUMNS} "
                   "tokens of the batch: the backward's products take them as they are (dz = one factor per row, the "
                   f"B label entries written over), no pass over B×V; if some row's lse exceeds its r by more than "
                   f"{PROBS_GAP:g}, the backward writes the exact dz of its rows' GEMM tile rows over the stored tiles "
                   "first (the persistent GEMM with the LogitGrad epilogue, in place, skipping every tile row with "
                   "no such row: 2·rows·H·V FLOPs a flagged tile row, decided on the device: no host round trip, "
                   "and not warned at run time)")
    else:
      how = "interpreted" if spec.interpret else "compiled by Pallas Triton"
      why = shifted_reason(p, spec.opts, dtype)
      notes.append(f"the stored tiles are logits shifted by their row max ({why}); the fast design's dz pass is a "
                   f"Pallas Triton kernel inside this backend ({how}): it turns them into dz in place")
  return common.Design("pallas_mosaic", mode, name, p, chunking,
                       memory_bytes(p, num_tokens, hidden, vocab, jnp.dtype(dtype).itemsize, probs),
                       notes=tuple(notes))


def _lean_note(p: Plan, num_tokens: int, hidden: int, vocab: int) -> str:
  """explain()'s line on lean mode's kernels."""
  kind, rows = gemm_lib._device_kind(), cdiv(max(num_tokens, 1), p.block_t) * p.block_t
  products = _lean_products_note(p, rows, hidden, kind)
  if p.gemm is None:
    cfg = tuning.DEFAULT
    why = gemm_refusal(cfg, hidden, vocab, _lean_min_vocab(cfg, p.warp_specialized)) or "gemm=False"
    return f"lean kernels: the forward and dz kernels of kernels_ws.py / kernels.py ({why}); {products}"
  fwd = (f"the forward with the statistics epilogue, {tuning.describe('fwd_stats', rows, vocab, hidden, kind)}"
         if p.stats_gemm else "the forward on the kernel of kernels_ws.py (the GEMM's statistics, 4 float32 per row "
         "and 128-column tile, would exceed lean mode's memory here)")
  block = p.token_block or rows  # (the tokens each recompute and product takes: a block of them, or all)
  return (f"lean kernels on the persistent GEMM (lce_flax/_impl/pallas_mosaic/gemm.py): {fwd}; each chunk's logit "
          f"gradient recomputed with the LogitGrad epilogue, "
          f"{tuning.describe('lean_dz', block, p.vocab_chunk, hidden, kind)}; {products}")


def _lean_products_note(p: Plan, rows: int, hidden: int, kind: str) -> str:
  """explain()'s words on who forms each lean chunk's two products (``rows``: the tokens as padded), per block of
  tokens where it runs blocks (dw then added into the chunk's float32 dw: the role ``dw_acc``)."""
  cw, block = p.vocab_chunk, p.token_block or rows
  dx = (f"on the GEMM's TMA reduce-adds into the float32 dx, {tuning.describe('dx_acc', block, hidden, cw, kind)}"
        if p.products[0] == "gemm" else "by XLA (cuBLAS, added into the float32 dx)")
  dw_role = "dw" if p.token_block is None else "dw_acc"
  dw = (f"on the GEMM, {tuning.describe(dw_role, hidden, cw, block, kind)}" if p.products[1] == "gemm"
        else "by XLA (cuBLAS)")
  out = f"each chunk's dx {dx}; its dw {dw}"
  return out + (f" ({p.products_step})" if p.products_step else "")


def _chunk_note(chunk: int, num_tokens: int, hidden: int, vocab: int, itemsize: int) -> list[str]:
  """explain()'s line on a default "tokens" chunk that :data:`TOKEN_CHUNK_BYTES` cut below its full-speed size
  (:func:`token_chunk`): what a larger ``Config.token_chunk`` would cost and buy; no line where it was not cut."""
  if pow2_floor(max(_fast_chunk(num_tokens, hidden), 1)) <= chunk:
    return []
  return [f"token chunks of {chunk} tokens: the largest power of two whose stored tiles ({chunk}×{vocab}×{itemsize} "
          f"bytes) fit in {TOKEN_CHUNK_BYTES >> 20} MiB, which keeps the extra memory near H·V·4 + 1 GiB; each chunk "
          f"adds its dw into the {hidden}×{vocab} float32 dw, so a larger Config.token_chunk runs faster and holds "
          f"about {2 * chunk * vocab * itemsize / 1e9:.2f} GB more when doubled (on an H100 at 32768 tokens, doubling "
          "the chunk took llama3-8b's step from 0.986 to 0.980× the plain head's time and gemma2-2b's from 0.928 to "
          "0.890×, each 2.1 GB more: benchmarks/results/step-h100-2026-11-28-r20/)"]


def _gemm_notes(p: Plan, num_tokens: int, hidden: int, vocab: int, spec: common.Spec, probs: bool) -> list[str]:
  """explain()'s lines on the fast designs' GEMMs: which kernel forms each product, with the tuning table's row."""
  kind = gemm_lib._device_kind()
  rows = p.token_chunk or cdiv(max(num_tokens, 1), p.block_t) * p.block_t
  if p.gemm is not None:
    row = tuning.select_row("fwd_store", rows, vocab, hidden, kind)[1]
    what = "exponentials" if probs else "shifted logits"
    fwd = (f"forward: the persistent GEMM (lce_flax/_impl/pallas_mosaic/gemm.py) with the statistics epilogue "
           f"storing the tiles' {what}, {p.gemm.short()} (from {row})")
  else:
    why = gemm_refusal(tuning.DEFAULT, hidden, vocab)
    fwd = "forward: the warp-specialised kernel of kernels_ws.py" + (f" ({why})" if why else " (gemm=False)")
  def product(role, on, mnk):
    if on == "gemm":
      return f"on the GEMM: {tuning.describe(role, *mnk, kind)}"
    why = tuning.xla_faster(role, *mnk, kind) if p.gemm is not None and p.products_step is None else None
    return "by XLA (cuBLAS)" + (f": {why}" if why else "")

  prods = f"backward products: dx = dz·wᵀ {product('dx', p.products[0], (rows, hidden, vocab))}"
  if p.fast_design == "tokens":
    acc = (f"the GEMM's TMA reduce-adds: {tuning.describe('dw_acc', hidden, vocab, rows, kind)}"
           if p.products[1] == "gemm" else "XLA's product (cuBLAS)")
    prods += f"; each chunk's dw added into the float32 dw in place by {acc}"
  else:
    prods += f"; dw = xᵀ·dz {product('dw', p.products[1], (hidden, vocab, rows))}"
  return [fwd, prods] + ([f"backward products: {p.products_step}"] if p.products_step else [])


def _v_multiple(p: Plan, w_layout: str) -> int:
  """What V must be a multiple of for TMA to tile w as it is (see :func:`prepare`, without a bias)."""
  return p.block_v if p.fast_design else (64 if w_layout == "hv" else 8)


def padded_w(p: Plan, hidden: int, vocab: int, w_layout: str) -> tuple[int, int]:
  """(H, V) of the w the kernels read: :func:`prepare`'s padding for a call without a bias."""
  mult = _v_multiple(p, w_layout)
  cta_v = p.block_v * (2 if p.warp_specialized else 1)
  return cdiv(hidden, p.block_k) * p.block_k, max(cdiv(vocab, mult) * mult, cta_v)


# --------------------------------------------------------------------------------------------- the kernels' calls


def run_forward(xp, wp, bp, yp, d: kernels.Dims, p: Plan, opts):
  """The forward kernel of ``p`` (warp-specialised or one warpgroup): (RowStats, stored tiles or None)."""
  return (kernels_ws.forward_ws if p.warp_specialized else kernels.forward)(xp, wp, bp, yp, d, p, opts)


def product_dx(dz, wp, layout: str, on: str, interpret: bool, *, scale=None, out_dtype=F32, acc=None, window=None,
               rows=None):
  """``dz · wᵀ`` ([B, H]; ``dz · w`` for a [V, H] w) accumulated in float32, by the GEMM of :mod:`.gemm`
  (``on="gemm"``) or XLA's (``"xla"``: cuBLAS): in ``out_dtype``, each row times ``scale`` (float32 [B]) when given
  (on the GEMM in its epilogue, before the one rounding); or, given ``acc`` (float32 [B, H]), ``acc + dz · wᵀ`` in
  float32, updated in place either way (the GEMM's TMA reduce-adds, :class:`.gemm.AddTo`; cuBLAS's ``beta = 1``):
  the lean design's dx over its vocabulary chunks. ``window`` (:class:`.gemm.Window`, on the GEMM only): ``wp``
  is the whole head and the product takes its chunk of columns there, read in place; ``rows`` (on the GEMM, with
  ``acc``): dz is a block of the tokens, added into those rows of ``acc``."""
  if on == "gemm":
    part = gemm_lib.Store(out_dtype, row_scale=scale) if acc is None else gemm_lib.AddTo(acc, window=rows)
    return gemm_lib.gemm(dz, wp, transpose_b=layout == "hv", epilogue=part, role="dx" if acc is None else "dx_acc",
                         interpret=interpret, b_window=window)
  dx = common.grad_x(dz, wp, layout)
  if acc is not None:
    return acc + dx
  return (dx if scale is None else dx * scale[:, None]).astype(out_dtype)


def product_dw(x, dz, layout: str, on: str, interpret: bool, out_dtype, acc=None, window=None, rows=None):
  """``xᵀ · dz`` ([H, V]; ``dzᵀ · x`` [V, H] for a [V, H] w) accumulated in float32, by the GEMM of :mod:`.gemm`
  (``on="gemm"``) or XLA's (``"xla"``): in ``out_dtype``, or given ``acc`` (float32, w's shape: the "tokens"
  design's dw) ``acc + xᵀ · dz`` in float32, updated in place either way (:class:`.gemm.AddTo`'s TMA reduce-adds;
  cuBLAS's ``beta = 1``). XLA's product is formed in ``out_dtype`` by the dot itself: a float32 product and a
  convert would leave its float32 buffer to whichever GEMM XLA's autotuner picks. ``window`` (on the GEMM only):
  ``acc`` is the whole dw in its own dtype (zeros in the chunk's columns) and the product is added into its
  chunk's columns in place (the lean design's). ``rows`` (on the GEMM): dz is that block of x's tokens, the
  product's contraction, read in place (the lean design's token blocks, into a float32 ``acc``)."""
  if on == "gemm":
    a, b = (x, dz) if layout == "hv" else (dz, x)
    part, role = (gemm_lib.Store(out_dtype), "dw") if acc is None else (gemm_lib.AddTo(acc, window=window),
                                                                        "dw" if window is not None else "dw_acc")
    a_win, b_win = (rows, None) if layout == "hv" else (None, rows)
    return gemm_lib.gemm(a, b, transpose_a=True, epilogue=part, role=role, interpret=interpret, a_window=a_win,
                         b_window=b_win)
  if acc is None:
    return common.grad_w(x, dz, layout, out_dtype=out_dtype)
  return acc + common.grad_w(x, dz, layout)


def prepare(x, w, bias, labels, spec: common.Spec, p: Plan, store: bool = False):
  """Pads tokens to whole row blocks (and, only where unavoidable, H and V); bias to float32.

  TMA tiles the whole GMEM array: V must be a multiple of 8 rows ("vh") or of the 64-column swizzle ("hv"). The
  fast forward (``store``) also needs whole ``block_v`` tiles, so that every stored tile is aligned and no two
  overlap (true of the LLM heads: 50304, 128256, 151936 and 256000 are multiples of 128).
  """
  b, h = x.shape
  v = common.vocab_size(w, spec.w_layout)
  bp = cdiv(b, p.block_t) * p.block_t
  hp = cdiv(h, p.block_k) * p.block_k
  cta_v = p.block_v * (2 if p.warp_specialized else 1)
  # A bias makes it 64 columns either way: the lean backward hands each chunk's bias slice to the dz kernel, and
  # XLA passes a slice as an offset into the same buffer, which Mosaic GPU wants 256-byte aligned (the clamped
  # last chunk starts at vp - chunk: a multiple of 64 floats only if vp is).
  mult = p.block_v if store else (64 if spec.w_layout == "hv" or bias is not None else 8)
  vp = max(cdiv(v, mult) * mult, cta_v)
  x = jnp.pad(x, ((0, bp - b), (0, hp - h)))
  labels = jnp.pad(labels, (0, bp - b), constant_values=_math.IGNORED)
  if hp != h or vp != v:  # small or odd problems only: this copies w
    pads = ((0, hp - h), (0, vp - v)) if spec.w_layout == "hv" else ((0, vp - v), (0, hp - h))
    w = jnp.pad(w, pads)
  if bias is not None:
    bias = jnp.pad(bias.astype(F32), (0, vp - v))
  d = kernels.Dims(bp, hp, v, vp, spec.w_layout, bias is not None, spec.interpret, store)
  return x, w, bias, labels, d


def _in_place(d: kernels.Dims, x, w, spec: common.Spec):
  """Checks that a plan on the GEMM reads x and w as they are: the GEMM's statistics count every column of w."""
  h, v = x.shape[1], common.vocab_size(w, spec.w_layout)
  if (d.h, d.vp) != (h, v):
    raise ValueError(f"pallas_mosaic: a plan on the GEMM for H×V = {h}×{v}, which its kernels would pad to "
                     f"{d.h}×{d.vp} (plan with this call's own shapes: lce_flax.explain)")


def _stats(x, w, bias, labels, spec, p) -> _math.RowStats:
  b = x.shape[0]
  xp, wp, bp, yp, d = prepare(x, w, bias, labels, spec, p)
  if not p.stats_gemm:
    st, _ = run_forward(xp, wp, bp, yp, d, p, spec.opts)
    return _math.RowStats(*(a[:b] for a in st))
  _in_place(d, x, w, spec)
  st = gemm_lib.gemm(xp, wp, transpose_b=d.w_layout == "vh", config=p.gemm, interpret=d.interpret,
                     approx_math=epilogue.APPROX_MATH, epilogue=gemm_lib.RowStats(yp, spec.opts, bias=bp))
  return gemm_lib.merge_row_stats(st, b)


def _chunk(k, vp: int, cw: int):
  """Chunk ``k`` of the ``cdiv(vp, cw)`` column chunks ``[start, start + cw)`` that cover ``[0, vp)``: (start, lo),
  the last one clamped to end at ``vp``, its first ``lo`` columns done by the previous chunk (0 for the others).
  One loop takes them all: a separate last step made XLA keep its dx product beside the accumulator (an unfused
  add: 134 MB more at llama3-8b, ``benchmarks/probe_hlo.py --mode lean``)."""
  start = jnp.minimum(k * cw, vp - cw)
  return start, k * cw - start


def _dz_chunks(x, w, bias, labels, lse, g_loss, g_lse, spec, p):
  """The padded operands, their Dims, and ``dz_of(start, lo, block=None)``: the logit gradient [rows, vocab_chunk]
  of the columns from ``start`` (recomputed by the dz kernel) for the given lse and per-token cotangents, zero in
  the chunk's first ``lo`` columns; given ``block = (window, done)`` (on the GEMM: a :class:`.gemm.Window` of the
  tokens, and how many of its first rows the block before did) the [block, vocab_chunk] gradient of that block's
  tokens, zero in those rows."""
  opts = spec.opts
  xp, wp, bp, yp, d = prepare(x, w, bias, labels, spec, p)
  pad = d.b - x.shape[0]
  coef, a, c = epilogue.row_coefficients(lse, labels, g_loss, g_lse, opts)
  # Padding rows: lse = +inf makes p = 0, and zero coefficients keep them at dz = 0 exactly.
  lse_p = jnp.pad(lse, (0, pad), constant_values=jnp.inf)
  coef, a, c = (jnp.pad(t, (0, pad)) for t in (coef, a, c))
  cw = p.vocab_chunk
  dz_chunk = kernels_ws.dz_chunk_ws if p.warp_specialized else kernels.dz_chunk
  if p.gemm is not None:
    _in_place(d, x, w, spec)

  def dz_of(start, lo, block=None):
    w_c = common.slice_vocab(wp, start, cw, spec.w_layout)  # (a copy where XLA's kernels need it: dead on the GEMM)
    b_c = None if bp is None else lax.dynamic_slice_in_dim(bp, start, cw)
    local = jnp.where(yp >= 0, yp - start, -1)  # chunk-local target column (-1: none)
    rows = (lse_p, coef, a, c, local)
    if block is not None:  # the block's rows; those done by the block before: lse = +inf, zero factors (dz = 0)
      win, done = block
      live = jnp.arange(win.size) >= done
      rows = tuple(jnp.where(live, lax.dynamic_slice_in_dim(t, win.start, win.size), fill)
                   for t, fill in zip(rows, (jnp.inf, 0.0, 0.0, 0.0, -1)))
    first = jnp.full(rows[0].shape, lo, jnp.int32)  # (a row vector: the kernels fetch per-row values only)
    if p.gemm is None:
      return dz_chunk(xp, w_c, b_c, rows[4], first, *rows[:4], d, p, opts), w_c
    part = gemm_lib.LogitGrad(*rows[:4], rows[4], opts, first=first, bias=b_c)
    return gemm_lib.gemm(xp, wp, transpose_b=d.w_layout == "vh", epilogue=part, role="lean_dz",
                         interpret=d.interpret, approx_math=epilogue.APPROX_MATH,
                         a_window=None if block is None else block[0],
                         b_window=chunk_window(start, cw, d.vp, spec.w_layout)), w_c

  return xp, wp, bp, d, dz_of


def chunk_window(start, cw: int, vp: int, w_layout: str) -> gemm_lib.Window | None:
  """The GEMM's window on w's vocabulary chunk ``[start, start + cw)`` (columns of an [H, V] w, rows of a [V, H]
  one), read in place. Every chunk start is a multiple of both ``cw`` and ``vp`` (``k·cw`` or the clamped
  ``vp - cw``), so of their greatest common divisor, which the kernel's layouts need to be a multiple of 64: true
  on the GEMM (V a multiple of its column tile, ``cw`` of ``block_v``); None where it is not (a padded "vh" w of
  8-row multiples with the chunk products asked on the GEMM: they then take XLA's copy of the chunk)."""
  g = math.gcd(cw, vp)
  return gemm_lib.Window(start, cw, 1 if w_layout == "hv" else 0, g) if g % 64 == 0 else None


def _grads(x, w, bias, labels, lse, g_loss, g_lse, spec, p):
  """The recompute backward over the columns of ``w`` for the given lse: (dx float32, dw, dbias float32)."""
  b, h = x.shape
  v = common.vocab_size(w, spec.w_layout)
  xp, wp, bp, d, dz_of = _dz_chunks(x, w, bias, labels, lse, g_loss, g_lse, spec, p)
  vaxis = spec.vocab_axis
  on_dx, on_dw = p.products or ("xla", "xla")
  cw = p.vocab_chunk

  def step(k, carry):
    dx, dw, db = carry
    start, lo = _chunk(k, d.vp, cw)
    # dz is zero in the overlap columns (done by the previous chunk), so that they do not reach dx twice; dw and db
    # hold zeros in the chunk's other columns, so adding the chunk's products completes them exactly.
    dz, w_c = dz_of(start, lo)
    win = chunk_window(start, cw, d.vp, spec.w_layout)  # (the GEMM's products read and write the chunk in place)
    if on_dw == "gemm" and win is not None:  # added into the chunk's columns of dw in place
      dw = product_dw(xp, dz, spec.w_layout, on_dw, d.interpret, dw.dtype, acc=dw, window=win)
    else:
      dw = _add_into(dw, product_dw(xp, dz, spec.w_layout, on_dw, d.interpret, dw.dtype), start, vaxis)
    if db is not None:
      db = _add_into(db, jnp.sum(dz.astype(F32), axis=0), start, 0)
    if on_dx == "gemm" and win is not None:  # w's chunk read in place
      return product_dx(dz, wp, spec.w_layout, on_dx, d.interpret, acc=dx, window=win), dw, db
    return product_dx(dz, w_c, spec.w_layout, on_dx, d.interpret, acc=dx), dw, db  # (dx updated in place)

  if p.token_block is not None:
    step = _blocked_step(xp, wp, d, spec, p, dz_of)
  carry = (jnp.zeros(xp.shape, F32), jnp.zeros_like(wp), None if bp is None else jnp.zeros(bp.shape, F32))
  dx, dw, db = lax.fori_loop(0, cdiv(d.vp, cw), step, carry)
  dw = dw[:h, :v] if spec.w_layout == "hv" else dw[:v, :h]
  return dx[:b, :h], dw.astype(w.dtype), None if bias is None else db[:v]


def _blocked_step(xp, wp, d: kernels.Dims, spec: common.Spec, p: Plan, dz_of):
  """The step over one vocabulary chunk with blocks of ``p.token_block`` tokens (both products on the GEMM): per
  block, dz [block, chunk] (the recompute reading x's block and w's chunk in place), its dx added into dx's rows and
  its dw into the chunk's float32 dw; then the chunk's dw rounded into dw's columns. The last block is clamped to
  end at the padded B, its rows done by the block before given dz = 0, as the last chunk's columns are."""
  cw, bt, layout = p.vocab_chunk, p.token_block, spec.w_layout

  def step(k, carry):
    dx, dw, db = carry
    start, lo = _chunk(k, d.vp, cw)
    win = chunk_window(start, cw, d.vp, layout)

    def block(j, inner):
      dx, dw_c, db_c = inner
      first_row, done = _chunk(j, d.b, bt)
      rows = gemm_lib.Window(first_row, bt, 0, math.gcd(bt, d.b))
      dz, _ = dz_of(start, lo, (rows, done))
      dw_c = product_dw(xp, dz, layout, "gemm", d.interpret, F32, acc=dw_c, rows=rows)
      dx = product_dx(dz, wp, layout, "gemm", d.interpret, acc=dx, window=win, rows=rows)
      return dx, dw_c, None if db_c is None else db_c + jnp.sum(dz.astype(F32), axis=0)

    dw_c = jnp.zeros((d.h, cw) if layout == "hv" else (cw, d.h), F32)
    dx, dw_c, db_c = lax.fori_loop(0, cdiv(d.b, bt), block, (dx, dw_c, None if db is None else jnp.zeros(cw, F32)))
    # (dw's columns of the clamped last chunk that the chunk before did: dw_c is zero there, and the sum keeps them)
    dw = _add_into(dw, dw_c, start, spec.vocab_axis)
    return dx, dw, None if db is None else _add_into(db, db_c, start, 0)

  return step


def _add_into(acc, part, start, axis: int):
  """``acc`` with ``part`` added into its slice from ``start`` along ``axis``, the sum rounded to ``acc``'s dtype:
  a chunk's products into the columns of dw and dbias (zeros there before, or, in the clamped last chunk's overlap,
  the chunk before's values beside zeros of this one, so the rounded sum is exact)."""
  old = lax.dynamic_slice_in_dim(acc, start, part.shape[axis], axis)
  return lax.dynamic_update_slice_in_dim(acc, (old + part).astype(acc.dtype), start, axis)


def stats(x, w, bias, labels, spec: common.Spec, plan: Plan) -> _math.RowStats:
  """The forward kernel's row statistics of the columns of ``w`` (x and w bf16 or fp16, one dtype)."""
  return _stats(x, w, bias, labels, spec, plan)


def grads(x, w, bias, labels, lse, g_loss, g_lse, spec: common.Spec, plan: Plan):
  """The recompute backward for the given lse: (dx float32, dw, dbias float32)."""
  return _grads(x, w, bias, labels, lse, g_loss, g_lse, spec, plan)
