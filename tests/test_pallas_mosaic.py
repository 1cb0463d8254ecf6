"""``impl="pallas_mosaic"`` against the float64 oracle.

On CPU the Mosaic GPU kernels run under Mosaic GPU's interpreter (``plgpu.InterpretGPUParams``: simulated GMEM,
SMEM, TMA copies and barriers), with the WGMMA instruction replaced by ``jnp.dot`` of the same shared-memory tiles
(the interpreter has no WGMMA; see ``lce_flax/_impl/pallas_mosaic/kernels.py``). Small tiles (64×64, 2 stages,
3 splits, backward chunks of 128 columns) make every loop run several times and end ragged. The ``gpu``-marked
tests run the compiled kernels (``pytest -m gpu`` on an SM90 machine).
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lce_flax import _device, _math, linear_cross_entropy
from lce_flax._impl import base, chunked, common, pallas_mosaic
from lce_flax._impl.pallas_mosaic import Config, epilogue, fast, kernels_ws, op
from tests._checks import MOSAIC_SMALL, OPTIONS, check_impl, make_inputs
from tests.reference_np import linear_cross_entropy_np, rel_err

# B=101 = 64 + 37 rows; V=301: 5 vocabulary tiles of 64 (the last a clamped window), 3 forward splits, backward
# chunks of 128 (2 full + a clamped tail); H=128: two pipeline steps of 64.
SMALL = Config(**MOSAIC_SMALL)
on_sm90 = (_device.compute_capability() or (0, 0)) >= (9, 0)


def check(**kw):
  kw.setdefault("config", SMALL)
  kw.setdefault("h", 128)
  kw.setdefault("batch_shape", (101,))
  kw.setdefault("dtype", jnp.bfloat16)
  kw.setdefault("mode", "lean")
  return check_impl("pallas_mosaic", **kw)


def test_float32_inputs_are_refused_and_run_with_dtype_bf16():
  """WGMMA has no float32 operands: float32 inputs are refused (no hidden fallback); with dtype=jnp.bfloat16 the
  op rounds x and w to bf16 for the kernels: the result is the oracle's on the rounded inputs, to fp32
  accumulation accuracy, and gradients come back in fp32."""
  spec = common.Spec(_math.LossSpec(vocab_size=10), interpret=True)
  for dtype in (jnp.float32, jnp.int32):
    with pytest.raises(NotImplementedError, match="WGMMA has no float32 operands; pass dtype=jnp.bfloat16"):
      pallas_mosaic.supported(spec, "cpu", dtype)
    with pytest.raises(NotImplementedError, match="WGMMA has no float32"):
      pallas_mosaic.design(64, 64, spec, dtype, "lean", None)
  (x, w, y, _), (xn, wn, yn, _) = make_inputs(11, (70,), 128, 200, jnp.float32)
  with pytest.raises((NotImplementedError, ValueError), match="WGMMA has no float32"):
    linear_cross_entropy(x, w, y, impl="pallas_mosaic", mode="lean", config=SMALL)
  f = lambda x, w: linear_cross_entropy(x, w, y, impl="pallas_mosaic", mode="lean", config=SMALL,
                                        dtype=jnp.bfloat16)
  loss, (dx, dw) = jax.value_and_grad(f, (0, 1))(x, w)
  rnd = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))
  ref = linear_cross_entropy_np(rnd(xn), rnd(wn), yn)
  assert dx.dtype == jnp.float32 and dw.dtype == jnp.float32
  assert rel_err(loss, ref["loss"]) < 2e-5
  assert rel_err(dx, ref["dx"]) < 2e-2 and rel_err(dw, ref["dw"]) < 2e-2
  exact = linear_cross_entropy_np(xn, wn, yn)
  assert rel_err(loss, exact["loss"]) < 1e-2  # the price of the bf16 rounding, bounded


@pytest.mark.parametrize(
    "config,h,v",
    [
        (None, 48, 301),  # heuristic tiles (64×128, one chunk); H=48 and V < block_v: x, w zero-padded
        (Config(block_t=64, block_v=64, num_splits=64, vocab_chunk=64, num_stages=3), 64, 256),  # splits > tiles
        (Config(block_t=128, block_v=128, num_splits=1, vocab_chunk=256, num_stages=4), 192, 300),  # B < block_t
    ],
    ids=["heuristic-padded", "many-splits", "one-split"],
)
def test_configs(config, h, v):
  check(config=config, h=h, v=v, options=OPTIONS["smoothing"], bias=True, seed=5, batch_shape=(37,))


# V = 640 = 5·128 (whole GEMM tiles): lean mode on the persistent GEMM, its backward in chunks of 256 columns (the
# third clamped to end at V, its first 128 columns done by the second)
LEAN_GEMM = Config(block_t=64, vocab_chunk=256)


@pytest.mark.parametrize("opt,w_layout,bias,reduction,products", [
    ("all", "hv", True, "mean", "gemm"), ("plain", "vh", False, "none", ("gemm", "xla")),
    ("smoothing", "hv", False, "sum", None), ("plain", "hv", False, "mean", ("xla", "gemm")),
    ("softcap", "vh", True, "sum", "gemm")])
def test_lean_on_the_gemm(opt, w_layout, bias, reduction, products):
  """Lean mode on the GEMM of gemm.py (V a multiple of its 128-column tile, H of 64): the forward's statistics
  epilogue, per vocabulary chunk the logit gradient recomputed by the LogitGrad epilogue, and each chunk's products
  on the GEMM or XLA's as ``products`` asks (dx added into the float32 dx by TMA reduce-adds, dw written into dw),
  against the float64 oracle (per-token cotangents with ``reduction="none"``); explain() names every kernel."""
  from lce_flax import explain

  cfg = dataclasses.replace(LEAN_GEMM, products=products)
  check(config=cfg, h=192, v=640, batch_shape=(3, 67), options=OPTIONS[opt], w_layout=w_layout, bias=bias,
        reduction=reduction, where=True, seed=60 + len(opt))
  sds = jax.ShapeDtypeStruct
  d = explain(sds((201, 192), jnp.bfloat16), sds((192, 640), jnp.bfloat16), sds((201,), jnp.int32),
              impl="pallas_mosaic", mode="lean", interpret=True, config=cfg)
  assert d.config.gemm is not None and d.config.vocab_chunk == 256
  pair = op.products_pair(products) or ("xla", "xla")
  assert d.config.products == pair
  note = next(n for n in d.notes if "lean kernels on the persistent GEMM" in n)
  assert "gemm[fwd_stats]" in note and "gemm[lean_dz]" in note, note
  assert ("gemm[dx_acc] 256x192x256" in note) == (pair[0] == "gemm"), note
  assert ("gemm[dw] 192x256x256" in note) == (pair[1] == "gemm"), note
  assert ("dx by XLA" in note) == (pair[0] == "xla") and ("dw by XLA" in note) == (pair[1] == "xla"), note


@pytest.mark.parametrize("b,h,v,on_xla,in_place", [(8192, 4096, 128256, 1792, 3584), (4096, 4096, 151936, 1536, 7168),
                                                    (8192, 2304, 256000, 2304, 3584), (16384, 768, 50304, 768, 1792)],
                         ids=["llama3-8b", "qwen3-8b", "gemma2-2b", "gpt2-small"])
def test_lean_chunk_width_follows_its_products(b, h, v, on_xla, in_place):
  """Lean mode's chunk width at the LLM heads: with both chunk products on the GEMM (w's chunk read and dw's added
  into in place) dz [B, c] is the one buffer beside the float32 dx, so the chunk is the widest CTA-tile multiple
  whose dz fits the 64 MB with the O(B) vectors and the reserve (the next would not); a pair with an XLA product
  keeps the narrower width of XLA's copies; the forward's statistics stay off the GEMM where no one buffer of the
  backward holds them (gpt2-small), and the memory bound drops the copies' 2·H·c and XLA's cuBLAS workspace."""
  plan = lambda products: op.plan(b, h, v, Config(products=products), mode="lean")
  pg, px, pm = plan("gemm"), plan("xla"), plan(("gemm", "xla"))
  assert (pg.products, pg.vocab_chunk, px.vocab_chunk, pm.vocab_chunk) == (("gemm", "gemm"), in_place, on_xla, on_xla)
  step = 2 * pg.block_v
  fits = lambda c: b * c * 2 + 64 * b + op.LEAN_RESERVE <= op.LEAN_EXTRA_BYTES
  assert in_place % step == 0 and fits(in_place) and not fits(in_place + step)
  assert pg.stats_gemm == (h != 768) and px.stats_gemm == (h != 768)
  same_width = dataclasses.replace(px, vocab_chunk=in_place)
  # (and no cuBLAS workspace: no XLA GEMM runs)
  assert op.memory_bytes(same_width, b, h, v, 2) - op.memory_bytes(pg, b, h, v, 2) == (
      2 * h * in_place * 2 + op.CUBLAS_WORKSPACE)
  assert op.memory_bytes(pg, b, h, v, 2) <= b * h * 4 + op.LEAN_EXTRA_BYTES + 2 * 4 * v  # (+ a bias's two vectors)


@pytest.mark.parametrize("v", [1000, 1088])
def test_lean_products_on_the_gemm_beside_the_forward_kernels(v):
  """Chunk products asked on the GEMM where the forward cannot run on it (V not whole 128-column tiles): a [V, H] w
  of V = 1000 is padded to 1000 rows (8-row multiples), whose chunk starts share no multiple of 64 with the chunk
  width, so the products take XLA's copy of each chunk; V = 1088 (a multiple of 64) lets them read it in place.
  Against the float64 oracle either way."""
  cfg = Config(block_t=64, vocab_chunk=256, products="gemm")
  check(config=cfg, h=192, v=v, batch_shape=(67,), options=OPTIONS["plain"], w_layout="vh", bias=False,
        reduction="sum", seed=70)
  p = op.plan(67, 192, v, cfg, interpret=True, mode="lean")
  assert p.gemm is None and p.products == ("gemm", "gemm")
  assert (op.chunk_window(0, p.vocab_chunk, v, "vh") is None) == (v == 1000)


@pytest.mark.parametrize("w_layout,bias,options,reduction,where,batch", [
    ("hv", False, "plain", "sum", False, 300), ("vh", True, "all", "mean", True, 300),
    ("hv", True, "softcap", "none", False, 257), ("vh", False, "smoothing", "none", True, 384)])
def test_lean_token_blocks_against_the_oracle(w_layout, bias, options, reduction, where, batch):
  """``token_block``: each vocabulary chunk's backward in blocks of the tokens (x's block and dx's rows read and
  added into in place, the chunk's dw accumulated in float32 over the blocks), the last block clamped to end at the
  padded B (its rows done before given dz = 0) and the last chunk clamped to end at V; against the float64 oracle
  with every option, a bias, ignored tokens and per-token cotangents."""
  cfg = Config(block_t=64, vocab_chunk=256, products="gemm", token_block=128)
  check(config=cfg, h=192, v=1152, batch_shape=(batch,), options=OPTIONS[options], w_layout=w_layout, bias=bias,
        reduction=reduction, where=where, seed=90 + batch)
  p = op.plan(batch, 192, 1152, cfg, interpret=True, mode="lean")
  assert p.token_block == 128 and p.gemm is not None and p.products == ("gemm", "gemm")


def test_lean_token_blocks_plan():
  """``token_block`` widens lean mode's chunk where B is well above H (dz [block, chunk] and the chunk's float32 dw
  with its rounded sum in place of dz [B, chunk], within the same 64 MB), says so in explain(), runs as one block
  where it holds every token, is on by default from 32768 tokens with both products on the GEMM, and is refused
  off the GEMM's products, off block_t multiples and in fast mode."""
  from lce_flax import explain

  b, h, v = 32768, 4096, 128256
  p = op.plan(b, h, v, Config(products="gemm", token_block=4096), mode="lean")
  fits_in = lambda bt, c: bt * c * 2 + h * c * 6 + 64 * b + op.LEAN_RESERVE <= op.LEAN_EXTRA_BYTES
  fits = lambda c: fits_in(4096, c)
  step = 2 * p.block_v
  assert p.token_block == 4096 and p.vocab_chunk == 1536 and fits(1536) and not fits(1536 + step)
  # one block of them all (asked for by a block of at least B tokens): 768 columns
  assert op.plan(b, h, v, Config(products="gemm", token_block=b), mode="lean").vocab_chunk == 768
  # not asked: blocks of LEAN_TOKEN_BLOCK from LEAN_BLOCKED_TOKENS tokens on with both products on the GEMM
  d = op.plan(b, h, v, Config(products="gemm"), mode="lean")
  assert (op.LEAN_BLOCKED_TOKENS, op.LEAN_TOKEN_BLOCK) == (32768, 8192)
  assert d.token_block == 8192 and d.vocab_chunk == 1280 and fits_in(8192, 1280) and not fits_in(8192, 1280 + step)
  assert op.plan(b - 128, h, v, Config(products="gemm"), mode="lean").token_block is None
  assert op.plan(b, h, v, Config(products="xla"), mode="lean").token_block is None
  assert op.memory_bytes(p, b, h, v, 2) <= b * h * 4 + op.LEAN_EXTRA_BYTES
  # in blocks dz is [block, chunk]: gpt2-small's forward statistics on the GEMM (103 MB) fit none of the backward's
  # buffers there, so its forward stays on the kernel of kernels_ws.py (counting dz as [B, chunk] had put them on
  # the GEMM, and the step held 154 MB against the bound's 114 on an H200)
  g = (16384, 768, 50304)
  gp = op.plan(*g, Config(products="gemm", token_block=4096), mode="lean")
  assert gp.token_block == 4096 and not gp.stats_gemm
  assert op._gemm_stats_bytes(gp.gemm, g[0], g[2]) > max(4096 * gp.vocab_chunk * 2, g[0] * g[1] * 4, g[1] * g[2] * 2)
  assert op.memory_bytes(gp, *g, 2) <= g[0] * g[1] * 4 + op.LEAN_EXTRA_BYTES
  assert op.plan(1000, 512, 2048, Config(products="gemm", token_block=1024), mode="lean").token_block is None
  for cfg, match in ((Config(products="gemm", token_block=100), "multiple of block_t=128"),
                     (Config(products="xla", token_block=1024), "products='gemm'"),
                     (Config(products=("gemm", "xla"), token_block=1024), "products='gemm'")):
    with pytest.raises(ValueError, match=match):
      op.plan(4096, 512, 2048, cfg, mode="lean")
  with pytest.raises(ValueError, match="token_block=1024: blocks of tokens within each vocabulary chunk"):
    op.plan(4096, 512, 2048, Config(token_block=1024), mode="fast")
  sds = jax.ShapeDtypeStruct
  d = explain(sds((4096, 512), jnp.bfloat16), sds((512, 2048), jnp.bfloat16), sds((4096,), jnp.int32),
              impl="pallas_mosaic", mode="lean", config=Config(products="gemm", token_block=1024))
  assert "each in blocks of 1024 tokens" in d.chunking, d.chunking


def test_lean_runs_the_blocks_and_width_of_its_steps_row(monkeypatch):
  """A lean ``steps`` row's blocks of tokens and chunk width run together: at 32768 tokens the blocks the row's step
  ran with its pair (one block where it says None; blocks of 8192 where it does not say: a row before blocks), and
  its width where that step ran those blocks, whole CTA tiles, within the memory they allow (the 64 MB beside the
  float32 dx, or in blocks the x gradient's buffer: op._blocked_chunk_fits); else the width by memory alone."""
  from lce_flax._impl.pallas_mosaic import gemm, tuning

  kind, (b, h, v) = "NVIDIA H200", (32768, 4096, 128256)
  monkeypatch.setattr(gemm, "_device_kind", lambda: kind)

  def rows(width, blocks):
    r = {"design": "recompute", "bucket": list(tuning.bucket(b, h, v)), "shape": [b, h, v], "source": "test",
         "products": ["gemm", "gemm"], "ms": {"gemm,gemm": 1.0, "xla,xla": 1.1, "plain": 0.7},
         "vocab_chunk": {"gemm,gemm": width, "xla,xla": 512}}
    return {tuning.norm_kind(kind): [r if blocks == "absent" else {**r, "token_block": {"gemm,gemm": blocks}}]}

  monkeypatch.setattr(tuning, "load_steps", lambda: rows(1024, "absent"))
  own = op.plan(b, h, v, mode="lean")
  assert own.products == ("gemm", "gemm") and own.token_block == 8192
  step = 2 * own.block_v
  assert own.vocab_chunk == op.lean_chunk(b, h, step, in_place=True, token_block=8192) == 1280
  single = op.lean_chunk(b, h, step, in_place=True)
  fits = b * h * 2 // (8192 * 2 + h * 6) // step * step  # (the x gradient's buffer: 6400 columns)
  assert single == 768 and fits == 6400 and op.lean_chunk(b, h, step, in_place=True, token_block=4096) == 1536
  for width, blocks, runs in ((1024, 8192, (8192, 1024)), (1280, 8192, (8192, 1280)), (1024, None, (None, 768)),
                              (512, None, (None, 512)), (1024, 4096, (4096, 1024)), (2048, 4096, (4096, 2048)),
                              (1024, "absent", (8192, 1280)), (fits, 8192, (8192, fits)),
                              (fits + step, 8192, (8192, 1280)), (1000, 8192, (8192, 1280))):
    table = rows(width, blocks)
    monkeypatch.setattr(tuning, "load_steps", lambda table=table: table)
    p = op.plan(b, h, v, mode="lean")
    assert (p.products, p.token_block, p.vocab_chunk) == (("gemm", "gemm"), *runs), (width, blocks)
    d = op.design(b, h, common.Spec(_math.LossSpec(vocab_size=v)), jnp.bfloat16, "lean")
    assert ("steps row" in d.chunking) == (blocks not in ("absent", None)), d.chunking
  # asked blocks win over the row's
  p = op.plan(b, h, v, op.Config(token_block=2048), mode="lean")
  assert p.token_block == 2048 and p.vocab_chunk == op.lean_chunk(b, h, step, in_place=True, token_block=2048)
  # the package's own rows at 32768 tokens say the blocks they ran
  monkeypatch.undo()
  for r in tuning.load_steps()["nvidia h200"]:
    if r["design"] == "recompute" and r["bucket"][0] >= op.LEAN_BLOCKED_TOKENS:
      assert r["token_block"]["gemm,gemm"] in (4096, 8192), r["name"]


def test_every_steps_row_is_what_the_op_runs(monkeypatch):
  """Each ``steps`` row of the package's table is what the op runs at its shape on its device kind: a fast row's
  design and pair of backward products; a lean row's pair of chunk products, its blocks of tokens and its chunk
  width (a row the plan would pass over, as the 32768-token lean widths were before blocks could take a measured
  width, fails here)."""
  from lce_flax._impl.pallas_mosaic import gemm, tuning

  rows = [(kind, r) for kind, rs in tuning.load_steps().items() for r in rs]
  assert {r["design"] for _, r in rows} == {"logits", "tokens", "recompute"}
  for kind, r in rows:
    monkeypatch.setattr(gemm, "_device_kind", lambda kind=kind: kind)
    pair = ",".join(r["products"])
    if r["design"] == "recompute":
      p = op.plan(*r["shape"], mode="lean")
      ran = (",".join(p.products), p.token_block, p.vocab_chunk)
      assert ran == (pair, r.get("token_block", {}).get(pair), r["vocab_chunk"][pair]), (kind, r["name"], ran)
      assert r["temp_gb"][pair] <= r["temp_bound_gb"], (kind, r["name"])  # (lean mode's B·H·4 + 64 MB)
    else:
      p = op.plan(*r["shape"], mode="fast")
      assert (p.fast_design, ",".join(p.products)) == (r["design"], pair), (kind, r["name"])


def test_lean_products_follow_the_measured_step(monkeypatch):
  """Lean mode's chunk products run on the pair its whole step measured fastest with at the head's bucket (a
  ``steps`` row of the design "recompute"), and explain() says so; without one, XLA's for both; a fast design's
  row of the same bucket is not lean mode's."""
  from lce_flax import explain
  from lce_flax._impl.pallas_mosaic import gemm, tuning

  kind = tuning.norm_kind(gemm._device_kind())
  b, h, v = 1024, 512, 2048
  step = lambda design, pair: {"design": design, "bucket": list(tuning.bucket(b, h, v)), "shape": [1000, h, v],
                               "products": list(pair), "source": "test",
                               "ms": {"gemm,gemm": 50.1, "gemm,xla": 51.0, "xla,gemm": 50.8, "xla,xla": 52.0,
                                      "plain": 40.0},
                               "vocab_chunk": {"gemm,gemm": 2048, "gemm,xla": 512, "xla,gemm": 512, "xla,xla": 512}}
  sds = jax.ShapeDtypeStruct
  args = lambda n: (sds((n, h), jnp.bfloat16), sds((h, v), jnp.bfloat16), sds((n,), jnp.int32))
  monkeypatch.setattr(tuning, "load_steps", lambda: {kind: [step("logits", ("gemm", "gemm"))]})
  d = explain(*args(1000), impl="pallas_mosaic", mode="lean", interpret=True)
  assert d.config.products == ("xla", "xla") and not any("whole step" in n for n in d.notes), d.notes
  monkeypatch.setattr(tuning, "load_steps", lambda: {kind: [step("recompute", ("gemm", "gemm"))]})
  d = explain(*args(1000), impl="pallas_mosaic", mode="lean", interpret=True)
  assert d.config.products == ("gemm", "gemm"), d.config
  note = next(n for n in d.notes if "lean kernels on the persistent GEMM" in n)
  assert "(dx, dw) on (gemm, gemm): 50.10 ms at 2048 columns a chunk against" in note, note
  assert "(xla, xla) 52.00 at 512 columns a chunk" in note and f"{kind}/steps/recompute/1024x512x2048" in note
  assert explain(*args(4000), impl="pallas_mosaic", mode="lean", interpret=True).config.products == ("xla", "xla")
  d = explain(*args(1000), impl="pallas_mosaic", mode="lean", interpret=True, config=Config(products="xla"))
  assert d.config.products == ("xla", "xla") and not any("whole step" in n for n in d.notes)
  with pytest.raises(ValueError, match="products=.*must be one of"):
    explain(*args(1000), impl="pallas_mosaic", mode="lean", interpret=True, config=Config(products="cublas"))


def test_lean_on_the_gemm_for_a_vocabulary_shard():
  """The backend protocol's halves on one shard of a vocabulary split two ways (what the vocab-parallel head runs on
  each device), on the GEMM: shard-local labels (a label held by the other shard is ``columns``, matching no column
  here), the statistics of the shard's columns, and with the *global* lse the shard's exact dw and its part of dx,
  against float64 NumPy; chunks of 256 of the 384 columns, the second clamped."""
  rng = np.random.default_rng(71)
  b, h, cols = 150, 128, 384
  x64, w64 = rng.standard_normal((b, h)), 0.1 * rng.standard_normal((h, 2 * cols))
  x, w = jnp.asarray(x64, jnp.bfloat16), jnp.asarray(w64, jnp.bfloat16)
  x64, w64 = (np.asarray(a.astype(jnp.float32), np.float64) for a in (x, w))
  labels = rng.integers(0, 2 * cols, b)
  labels[:7] = -1  # ignored
  z = x64 @ w64
  lse = np.log(np.exp(z).sum(1))
  local = np.where(labels < 0, -1, np.where(labels >= cols, labels - cols, cols))  # the second shard's view
  spec = common.Spec(_math.LossSpec(vocab_size=2 * cols), "hv", interpret=True)
  plan = op.plan(b, h, cols, LEAN_GEMM, interpret=True, mode="lean")
  assert plan.gemm is not None and plan.stats_gemm and plan.vocab_chunk == 256
  ws, zs, y = w[:, cols:], z[:, cols:], jnp.asarray(local, jnp.int32)
  st = pallas_mosaic.stats(x, ws, None, y, spec, plan)
  np.testing.assert_allclose(np.asarray(st.m) + np.log(np.asarray(st.s)), np.log(np.exp(zs).sum(1)), rtol=1e-5)
  here = (local >= 0) & (local < cols)
  np.testing.assert_allclose(np.asarray(st.target), np.where(here, zs[np.arange(b), np.minimum(local, cols - 1)], 0),
                             rtol=1e-5, atol=1e-5)
  g = jnp.asarray(rng.uniform(0.5, 1.5, b), jnp.float32)
  dx, dw, _ = pallas_mosaic.grads(x, ws, None, y, jnp.asarray(lse, jnp.float32), g, jnp.zeros_like(g), spec, plan)
  gn = np.where(labels >= 0, np.asarray(g, np.float64), 0.0)
  dz = gn[:, None] * np.exp(zs - lse[:, None])
  dz[np.flatnonzero(here), local[here]] -= gn[here]
  assert rel_err(dw, x64.T @ dz) < 1e-2 and rel_err(dx, dz @ w64[:, cols:].T) < 1e-2


def test_lean_gemm_routing():
  """Where the GEMM cannot read w as it is (V not a multiple of 128, or below one CTA tile), lean mode keeps the
  kernels of kernels_ws.py / kernels.py and explain() says why; ``gemm=True`` there is an error, ``gemm=False``
  keeps them anywhere."""
  from lce_flax import explain

  sds = jax.ShapeDtypeStruct
  args = lambda v: (sds((1000, 512), jnp.bfloat16), sds((512, v), jnp.bfloat16), sds((1000,), jnp.int32))
  d = explain(*args(2000), impl="pallas_mosaic", mode="lean")
  assert d.config.gemm is None
  assert any("kernels_ws.py" in n and "V a multiple of its 128-column tile" in n for n in d.notes), d.notes
  # the GPU's warp-specialised kernels: a CTA tile is 2 × 128 columns
  spec = common.Spec(_math.LossSpec(vocab_size=128), interpret=False)
  d = pallas_mosaic.design(1000, 512, spec, jnp.bfloat16, "lean", None)
  assert d.config.gemm is None and any("V=128 is below one CTA tile" in n for n in d.notes), d.notes
  with pytest.raises(ValueError, match="gemm=True: H×V = 512×2000"):
    explain(*args(2000), impl="pallas_mosaic", mode="lean", config=Config(gemm=True))
  assert explain(*args(2048), impl="pallas_mosaic", mode="lean").config.gemm is not None
  d = explain(*args(2048), impl="pallas_mosaic", mode="lean", config=Config(gemm=False))
  assert d.config.gemm is None and any("gemm=False" in n for n in d.notes)


def test_epilogue_math_matches_shared_math():
  """The register-tile forms of the loss math (broadcast_in_dim, no isfinite) equal _math's on random tiles."""
  rng = np.random.default_rng(0)
  bt, bv, v = 16, 24, 100
  opts = _math.LossSpec(vocab_size=v, label_smoothing=0.1, z_loss=1e-2, logit_softcap=5.0)
  z = jnp.asarray(3 * rng.standard_normal((bt, bv)), jnp.float32)
  c0 = 40
  cols1 = c0 + jnp.arange(bv, dtype=jnp.int32)
  cols = jnp.broadcast_to(cols1, (bt, bv))
  valid1 = cols1 >= 45
  labels = jnp.asarray(rng.integers(-1, v + 1, bt), jnp.int32).at[:3].set(jnp.array([50, 41, 63]))
  got = epilogue.epilogue_stats(_math.softcap(z, opts.logit_softcap), cols, jnp.broadcast_to(valid1, (bt, bv)),
                                     labels, opts)
  want = _math.tile_stats(_math.softcap(z, opts.logit_softcap), cols1, labels, valid1, opts)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-6)
  other = _math.tile_stats(_math.softcap(z[:, ::-1], 5.0), cols1, labels, ~valid1, opts)
  for a, b in zip(epilogue.merge(want, other), _math.merge_stats(want, other)):
    np.testing.assert_allclose(a, b, rtol=1e-6)
  lse = jnp.asarray(rng.standard_normal(bt) + 4, jnp.float32)
  g_loss = jnp.asarray(rng.standard_normal(bt), jnp.float32)
  g_lse = jnp.asarray(rng.standard_normal(bt), jnp.float32)
  coef, a, c = epilogue.row_coefficients(lse, labels, g_loss, g_lse, opts)
  got = epilogue.epilogue_dlogits(z, cols, labels, lse, coef, a, c, opts)
  want = _math.dlogits(z, lse, labels, cols1, jnp.ones((bv,), bool), g_loss, g_lse, opts)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert np.isnan(got[labels >= v]).all()


def _tanh_points():
  """float32 points of every regime of :func:`epilogue.tanh`: zero and the smallest normals, small ones (where the
  form's error is absolute, not relative), the middle, up to where tanh rounds to ±1 and past it, where exp(-2x)
  overflows (x < -44), huge, and random ones."""
  rng = np.random.default_rng(7)
  pos = np.concatenate([[0.0, 2e-38, 1e-30, 1e-12, 1e-6, 1e-3, 0.1, 0.25, 0.3, 0.5, 0.6, 1.0, 2.0, 5.0, 9.0, 9.1,
                         20.0, 44.0, 45.0, 88.0, 1e4, 3e38], np.geomspace(1e-4, 12.0, 4000),
                        np.abs(3 * rng.standard_normal(4000))])
  return np.concatenate([pos, -pos]).astype(np.float32)


def test_epilogue_tanh_against_float64():
  """The kernels' ``tanh`` (no division, no ``jnp.tanh``, no branch: exp2 and rsqrt, which the GPU runs on its
  approximate units) against float64's, here with XLA's accurate exp2 and rsqrt: ≤ 4e-7 absolute everywhere and
  within 3 ulps of the result near ±1, ±1 at ±inf, NaN at NaN; the soft cap it forms within ``cap``·4e-7 of
  ``cap·tanh(z/cap)``."""
  x = _tanh_points()
  got = np.asarray(jax.jit(epilogue.tanh)(jnp.asarray(x)), np.float64)
  want = np.tanh(x.astype(np.float64))
  err = np.abs(got - want)
  assert err.max() <= 4e-7, x[err.argmax()]
  # near ±1, where a cap crowds the logits, within 3 float32 ulps of the result: two logits a cap brings together
  # stay apart as far as float32 allows (the accuracy count compares the label's capped logit with the row max)
  near = np.abs(x) >= 0.55
  ulps = err[near] / np.spacing(np.abs(want[near]).astype(np.float32)).astype(np.float64)
  assert ulps.max() <= 3.0, x[near][ulps.argmax()]
  inf = jnp.asarray([np.inf, -np.inf, np.nan], jnp.float32)
  np.testing.assert_array_equal(epilogue.tanh(inf), [1.0, -1.0, np.nan])
  for cap in (30.0, 5.0):
    z = np.concatenate([x, 50 * x[-4000:]]).astype(np.float32)
    capped = np.asarray(jax.jit(lambda z, c=cap: epilogue.softcap(z, c))(jnp.asarray(z)), np.float64)
    np.testing.assert_allclose(capped, cap * np.tanh(z.astype(np.float64) / cap), rtol=0, atol=cap * 4e-7)
  z = jnp.asarray(x)
  assert epilogue.softcap(z, None) is z  # no cap: the logits as they are


def _on_mosaic_gpu(xs, f):
  """``f`` applied to float32 rows ``xs`` [n·32, 128] by a Mosaic GPU kernel with ``approx_math`` (32 rows a call:
  GMEM → SMEM by TMA → registers → ``f`` → SMEM → GMEM)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  def body(x_gmem, o_gmem, x_smem, o_smem, bar):
    plgpu.copy_gmem_to_smem(x_gmem, x_smem, bar)
    plgpu.barrier_wait(bar)
    o_smem[...] = f(x_smem[...])
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem)
    plgpu.wait_smem_to_gmem(0)

  block = jax.ShapeDtypeStruct((32, 128), jnp.float32)
  call = jax.jit(plgpu.kernel(body, out_type=block, compiler_params=plgpu.CompilerParams(approx_math=True),
                              scratch_types=[plgpu.SMEM(block.shape, block.dtype), plgpu.SMEM(block.shape, block.dtype),
                                             plgpu.Barrier()]))
  return np.concatenate([np.asarray(call(jnp.asarray(xs[i:i + 32]))) for i in range(0, len(xs), 32)])


@pytest.mark.gpu(min_cc=(9, 0))
def test_gpu_epilogue_tanh_on_the_approximate_units():
  """:func:`epilogue.tanh` and the soft cap compiled by Mosaic GPU with ``approx_math`` (ex2.approx, rsqrt.approx),
  as every kernel epilogue runs them: within 1e-6 absolute of float64's tanh (each unit adds ~2⁻²² relative to
  the float32 form's reciprocal), ±1 at ±inf, NaN at NaN."""
  x = _tanh_points()
  n = -(-x.size // 4096) * 4096
  xs = np.pad(x, (0, n - x.size)).reshape(-1, 128)
  xs[-1, :3] = [np.inf, -np.inf, np.nan]
  run = functools.partial(_on_mosaic_gpu, xs)
  got = run(epilogue.tanh).astype(np.float64).ravel()
  want = np.tanh(xs.astype(np.float64)).ravel()
  assert got[-128] == 1.0 and got[-127] == -1.0 and np.isnan(got[-126])
  err = np.abs(got - want)[:-126]
  assert err.max() <= 1e-6, xs.ravel()[err.argmax()]
  capped = run(lambda z: epilogue.softcap(z * 30.0, 30.0)).astype(np.float64).ravel()[:-126]
  np.testing.assert_allclose(capped, 30.0 * want[:-126], rtol=0, atol=30.0 * 1e-6)


# ------------------------------------------------------------------------------------------------ fast mode
FAST = dataclasses.replace(SMALL, fast_design="logits", vocab_chunk=None)  # no chunk loop


GEMM_FAST = dataclasses.replace(FAST, gemm=True)


@pytest.mark.parametrize("w_layout", ["hv", "vh"])
def test_fast_peaky_logits_sum(w_layout):
  """Logits with std ≈ 11 (the regime where storing rounded logits would hurt), V = 257: the warp-specialised (or
  one-warpgroup) forward stores logits shifted by their tile's row max, so the gradient keeps the error of the
  bf16 dz that every design has."""
  (x, w, y, _), (xn, wn, yn, _) = make_inputs(31, (101,), 128, 257, jnp.bfloat16, w_layout=w_layout, wscale=1.0)
  f = lambda x, w: linear_cross_entropy(x, w, y, impl="pallas_mosaic", mode="fast", reduction="sum",
                                        w_layout=w_layout, config=FAST)
  loss, (dx, dw) = jax.value_and_grad(f, (0, 1))(x, w)
  ref = linear_cross_entropy_np(xn, wn, yn, reduction="sum", w_layout=w_layout)
  assert rel_err(loss, ref["loss"]) < 2e-5
  assert rel_err(dx, ref["dx"]) < 1e-2 and rel_err(dw, ref["dw"]) < 1e-2


# ------------------------------------------------------------------- the stored exponentials (no dz pass)


def _repaired_blocks(fn, monkeypatch, units=False):
  """Runs ``fn`` and returns its result and the number of row units (:func:`.gemm.row_unit` rows each) whose dz
  the repair of rows past the stored exponentials' range wrote (:func:`.fast._repair`, wrapped to report its
  flags); with ``units``, also how many row units the repairs had in all."""
  from lce_flax._impl.pallas_mosaic import fast

  seen, repair = [], fast._repair

  def counting(e, flags, *args):
    jax.debug.callback(lambda f: seen.append((int(np.sum(f)), f.size)), flags)
    return repair(e, flags, *args)

  monkeypatch.setattr(fast, "_repair", counting)
  out = jax.block_until_ready(fn())
  jax.effects_barrier()
  assert seen, "the backward never reached the repair"
  repaired = sum(n for n, _ in seen)
  return (out, repaired, sum(u for _, u in seen)) if units else (out, repaired)


@pytest.mark.parametrize("design,opt,w_layout,bias,reduction", [
    ("logits", "plain", "hv", False, "mean"), ("logits", "softcap", "vh", True, "sum"),
    ("logits", "z_loss", "hv", True, "none"), ("tokens", "plain", "vh", True, "mean"),
    ("tokens", "z_loss", "hv", False, "sum")])
def test_fast_stored_exponentials(design, opt, w_layout, bias, reduction, monkeypatch):
  """bf16, V = 384 (a multiple of the GEMM's 128-column tile), no label smoothing: the forward on the GEMM stores
  exp(zc - r) and the backward's products take it as it is (no dz pass), against the float64 oracle: ragged rows,
  ignored and masked tokens, a bias, soft cap and z-loss, per-token cotangents; no run falls back."""
  from lce_flax import explain

  cfg = GEMM_FAST if design == "logits" else dataclasses.replace(GEMM_FAST, fast_design="tokens", token_chunk=64)
  sds = jax.ShapeDtypeStruct
  d = explain(sds((101, 128), jnp.bfloat16), sds((128, 384), jnp.bfloat16), sds((101,), jnp.int32),
              impl="pallas_mosaic", mode="fast", interpret=True, config=cfg, **OPTIONS[opt])
  assert any("exp(zc - r)" in n for n in d.notes) and not any("dz pass" in n for n in d.notes), d.notes
  mode = None if reduction == "none" else "fast"  # (per-token cotangents: mode=None runs the "logits" fast design)
  _, repaired = _repaired_blocks(lambda: check(mode=mode, config=cfg, v=384, w_layout=w_layout, bias=bias,
                                               options=OPTIONS[opt], where=True, reduction=reduction,
                                               seed=60 + len(opt)), monkeypatch)
  assert repaired == 0


@pytest.mark.parametrize("opt", ["smoothing", "softcap"])
def test_fast_stored_option(opt):
  """``Config(stored=...)``: "shifted" keeps the shifted logits and the dz pass where the exponentials would apply
  (and is right), "exponentials" where they cannot apply is refused, naming why; a bad value is refused."""
  from lce_flax import explain

  sds = jax.ShapeDtypeStruct
  shifted = dataclasses.replace(GEMM_FAST, stored="shifted")
  args = (sds((101, 128), jnp.bfloat16), sds((128, 384), jnp.bfloat16), sds((101,), jnp.int32))
  d = explain(*args, impl="pallas_mosaic", mode="fast", interpret=True, config=shifted, **OPTIONS[opt])
  assert d.config.stored == "shifted" and any("dz pass" in n for n in d.notes), d.notes
  check(mode="fast", config=shifted, v=384, options=OPTIONS[opt], seed=70)
  if opt == "smoothing":
    with pytest.raises(ValueError, match="stored='exponentials' does not apply here: label smoothing"):
      explain(*args, impl="pallas_mosaic", mode="fast", interpret=True,
              config=dataclasses.replace(GEMM_FAST, stored="exponentials"), **OPTIONS[opt])
  with pytest.raises(ValueError, match="stored='probs' must be one of"):
    explain(*args, impl="pallas_mosaic", mode="fast", interpret=True, config=Config(stored="probs"))


@pytest.mark.parametrize("w_layout,products", [("hv", "gemm"), ("vh", "xla"), ("vh", "mixed")])
def test_fast_exponentials_peaky(w_layout, products, monkeypatch):
  """Logits with std ≈ 11 and each label among its row's 8 largest logits (losses up to ~25 nats, the stored
  exponentials spanning ~e^±60): the gradient keeps the bf16 dz's error; no fallback. ``mixed``: dx on XLA's
  GEMM and dw on ours, as the tuning table routes a product it measured faster on XLA."""
  if products == "mixed":
    from lce_flax._impl.pallas_mosaic import tuning
    monkeypatch.setattr(tuning, "xla_faster", lambda role, *a: "measured faster" if role == "dx" else None)
    products = None
  (x, w, _, _), (xn, wn, _, _) = make_inputs(33, (101,), 128, 384, jnp.bfloat16, w_layout=w_layout, wscale=1.0)
  z = xn @ (wn if w_layout == "hv" else wn.T)
  rng = np.random.default_rng(34)
  yn = np.argsort(-z, axis=1)[np.arange(101), rng.integers(0, 8, 101)].astype(np.int32)
  yn[::9] = -100
  cfg = dataclasses.replace(GEMM_FAST, products=products)
  f = lambda x, w: linear_cross_entropy(x, w, jnp.asarray(yn), impl="pallas_mosaic", mode="fast", reduction="sum",
                                        w_layout=w_layout, config=cfg)
  (loss, (dx, dw)), repaired = _repaired_blocks(lambda: jax.value_and_grad(f, (0, 1))(x, w), monkeypatch)
  assert repaired == 0
  ref = linear_cross_entropy_np(xn, wn, yn, reduction="sum", w_layout=w_layout)
  assert np.nanmax(ref["token_loss"]) > 10
  assert rel_err(loss, ref["loss"]) < 2e-5
  assert rel_err(dx, ref["dx"]) < 1e-2 and rel_err(dw, ref["dw"]) < 1e-2


def _check_repair(cfg, rows, h, v, monkeypatch, options=None, reduction="mean", **kw):
  """Logits with std ≈ 45 and every label the same column: the reference logits (the largest at the batch's
  labels) lie far below most rows' lse, beyond the stored exponentials' range; the repair writes those rows' exact
  dz over the stored tiles, so the gradients are still right, and without it they are not (so the test sees the
  repair). The first half of the rows are ignored, so some row units need no repair. ``reduction="none"``:
  the per-token losses against random per-token cotangents (the "logits" design)."""
  (x, w, y, b), (xn, wn, yn, bn) = make_inputs(35, (rows,), h, v, jnp.bfloat16, wscale=8.0, bias=True)
  yn = np.where(yn >= 0, 7, yn).astype(np.int32)
  yn[: rows // 2] = -100
  y = jnp.asarray(yn)
  opts = options or {}
  cot = np.random.default_rng(36).uniform(0.5, 2.0, rows) if reduction == "none" else None

  def loss_fn(x, w, b):
    out = linear_cross_entropy(x, w, y, bias=b, impl="pallas_mosaic", mode=None if cot is not None else "fast",
                               reduction=reduction, config=cfg, **opts, **kw)
    return out if cot is None else jnp.sum(out * jnp.asarray(cot, jnp.float32))

  f = jax.jit(jax.value_and_grad(loss_fn, (0, 1, 2)))
  (loss, grads), repaired, units = _repaired_blocks(lambda: f(x, w, b), monkeypatch, units=True)
  ref = linear_cross_entropy_np(xn, wn, yn, bias=bn, reduction=reduction, cotangent=cot, **opts)
  want = ref["loss"] if cot is None else np.sum(np.where(yn >= 0, ref["loss"], 0.0) * cot)
  assert np.nanmax(ref["token_loss"]) > 150 and 0 < repaired < units, (repaired, units)
  assert rel_err(loss, want) < 2e-5
  for got, name in zip(grads, ("dx", "dw", "dbias")):
    assert rel_err(got, ref[name]) < 1e-2, name
  from lce_flax._impl.pallas_mosaic import fast

  monkeypatch.setattr(fast, "_repair", lambda e, flags, *a: e)
  jax.clear_caches()  # (so that the op is traced again, without the repair)
  _, broken = jax.value_and_grad(loss_fn, (0, 1, 2))(x, w, b)
  counted = yn >= 0
  assert not rel_err(broken[0][counted], ref["dx"][counted]) < 1e-2


@pytest.mark.parametrize("w_layout,bias", [("hv", True), ("vh", False)])
def test_repair_writes_exact_dz_of_flagged_row_units(w_layout, bias):
  """:func:`.fast._repair` alone (the GEMM's interpret twin), against float64 NumPy: the rows of each flagged row
  unit become their logit gradient ``coef·softmax - a·[v = y]`` (a bias added first), the other rows stay as they
  were, bit for bit; 256 rows in two units of 128, the second flagged, an ignored row among its rows; an E that is
  not as wide as w's vocabulary is refused."""
  from lce_flax._impl.pallas_mosaic import fast, gemm

  rng = np.random.default_rng(37)
  rows, h, v = 256, 64, 256
  xn = rng.standard_normal((rows, h))
  wn = 0.3 * rng.standard_normal((h, v))
  bn = rng.standard_normal(v) if bias else np.zeros(v)
  yn = rng.integers(0, v, rows).astype(np.int32)
  yn[170] = -100
  x, w = jnp.asarray(xn, jnp.bfloat16), jnp.asarray(wn if w_layout == "hv" else wn.T, jnp.bfloat16)
  xq, wq = np.asarray(x, np.float64), np.asarray(w, np.float64)
  z = xq @ (wq if w_layout == "hv" else wq.T) + bn
  lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
  coef = np.where(yn >= 0, rng.uniform(0.5, 2.0, rows), 0.0)
  a = coef.copy()
  e0 = jnp.asarray(rng.standard_normal((rows, v)), jnp.bfloat16)
  f32 = lambda t: jnp.asarray(t, jnp.float32)
  opts = _math.LossSpec(vocab_size=v)
  bias_arr = f32(bn) if bias else None
  cfg = fast._repair_config(rows, h, v, jnp.bfloat16, bias_arr, opts, True)
  assert gemm.row_unit(cfg, True) == 128
  args = (cfg, x, w, bias_arr, jnp.asarray(yn), f32(lse), f32(coef), f32(a), f32(np.zeros(rows)), w_layout, opts, True)
  got = np.asarray(fast._repair(e0, jnp.asarray([0, 1], jnp.int32), *args), np.float64)
  dz = coef[:, None] * np.exp(z - lse[:, None]) - a[:, None] * (np.arange(v)[None, :] == yn[:, None])
  np.testing.assert_array_equal(got[:128], np.asarray(e0, np.float64)[:128])
  assert rel_err(got[128:], dz[128:]) < 1e-2 and np.all(got[170] == 0)
  with pytest.raises(ValueError, match="as wide as w's vocabulary"):
    fast._repair(jnp.zeros((rows, v + 64), jnp.bfloat16), jnp.asarray([0, 1], jnp.int32), *args)


@pytest.mark.parametrize("design,opt,reduction", [("logits", "plain", "mean"), ("logits", "z_loss", "none"),
                                                  ("tokens", "z_loss", "sum")])
def test_fast_exponentials_repaired_past_their_range(design, opt, reduction, monkeypatch):
  """:func:`_check_repair` interpreted: 300 rows, padded to 320 by the 64-row tiles (the "tokens" design: 5
  chunks of 64), not to the GPU's 128; with z-loss and per-token cotangents too."""
  cfg = GEMM_FAST if design == "logits" else dataclasses.replace(GEMM_FAST, fast_design="tokens", token_chunk=64)
  _check_repair(cfg, 300, 128, 384, monkeypatch, OPTIONS[opt], reduction)


@pytest.mark.gpu(min_cc=(9, 0))
@pytest.mark.parametrize("design", ["logits", "tokens"])
def test_gpu_fast_exponentials_repaired_past_their_range(design, monkeypatch):
  """:func:`_check_repair` compiled: the repair on the GEMM (its row mask, LogitGrad written over E) on the GPU."""
  cfg = Config(fast_design=design, token_chunk=256 if design == "tokens" else None, gemm=True)
  _check_repair(cfg, 1000, 256, 2048, monkeypatch, interpret=False)


def test_fast_cotangent_scales_and_aux_is_not_differentiable():
  (x, w, y, _), (xn, wn, yn, _) = make_inputs(32, (70,), 64, 130, jnp.bfloat16)
  f = lambda x: 2.5 * linear_cross_entropy(x, w, y, impl="pallas_mosaic", mode="fast", config=FAST)
  ref = linear_cross_entropy_np(xn, wn, yn)
  assert rel_err(jax.grad(f)(x), 2.5 * ref["dx"]) < 1e-2
  # the "tokens" design forms its gradients in the forward: its per-token outputs are not differentiable
  tokens = dataclasses.replace(FAST, fast_design="tokens", token_chunk=64)
  g = lambda x: linear_cross_entropy(x, w, y, impl="pallas_mosaic", mode="fast", config=tokens,
                                     return_aux=True)[1].lse.sum()
  with pytest.raises(ValueError, match="'lse' was differentiated"):
    jax.grad(g)(x)


@pytest.mark.parametrize("opt,w_layout,bias,chunk", [("plain", "hv", False, 64), ("all", "vh", True, 128)])
def test_fast_token_chunks(opt, w_layout, bias, chunk):
  """The "tokens" fast design: chunks of stored logits, dx rows per chunk, dw accumulated in float32."""
  cfg = dataclasses.replace(SMALL, fast_design="tokens", vocab_chunk=None, token_chunk=chunk)
  check(mode="fast", config=cfg, w_layout=w_layout, bias=bias, options=OPTIONS[opt], where=True, seed=40 + chunk)


def test_fast_gemm_routing_is_explained_and_refused_where_it_cannot_run():
  from lce_flax import explain

  sds = jax.ShapeDtypeStruct
  y = sds((1000,), jnp.int32)
  d = explain(sds((1000, 512), jnp.bfloat16), sds((512, 2048), jnp.bfloat16), y, impl="pallas_mosaic", mode="fast",
              interpret=True)
  assert d.config.gemm is not None and d.config.products == ("gemm", "gemm")
  assert any("persistent GEMM" in n for n in d.notes) and any("gemm[dx]" in n and "gemm[dw]" in n for n in d.notes)
  # V not a multiple of the GEMM's tile: the warp-specialised forward and XLA's products, said in explain()
  d = explain(sds((1000, 512), jnp.bfloat16), sds((512, 2000), jnp.bfloat16), y, impl="pallas_mosaic", mode="fast",
              interpret=True)
  assert d.config.gemm is None and d.config.products == ("xla", "xla")
  assert any("kernels_ws.py" in n and "V a multiple of its 128-column tile" in n for n in d.notes)
  with pytest.raises(ValueError, match="gemm=True: H×V = 512×2000"):
    explain(sds((1000, 512), jnp.bfloat16), sds((512, 2000), jnp.bfloat16), y, impl="pallas_mosaic", mode="fast",
            interpret=True, config=Config(gemm=True))
  with pytest.raises(ValueError, match="products='cublas'"):
    explain(sds((1000, 512), jnp.bfloat16), sds((512, 2048), jnp.bfloat16), y, impl="pallas_mosaic", mode="fast",
            interpret=True, config=Config(products="cublas"))


def test_fast_products_follow_the_tuning_table(monkeypatch):
  """Each backward product runs on XLA's GEMM where the tuning table's row for it (nearest bucket) measured ours
  slower than XLA's by more than the margin, in one run; explain() says which and why. A config's ``products``
  overrides the table for both."""
  from lce_flax import explain
  from lce_flax._impl.pallas_mosaic import gemm, tuning

  kind = gemm._device_kind()
  row = lambda mnk, ours, xla: {"bucket": list(tuning.bucket(*mnk)), "shape": list(mnk),
                                "config": {"tile_m": 128, "tile_n": 128}, "vs_xla": {"ours_ms": ours, "xla_ms": xla}}
  b, h, v = 1024, 512, 2048
  table = {tuning.norm_kind(kind): {"dx": [row((b, h, v), 15.6, 14.6)], "dw": [row((h, v, b), 12.2, 12.3)]}}
  monkeypatch.setattr(tuning, "load_table", lambda: table)
  sds = jax.ShapeDtypeStruct
  args = (sds((1000, h), jnp.bfloat16), sds((h, v), jnp.bfloat16), sds((1000,), jnp.int32))
  d = explain(*args, impl="pallas_mosaic", mode="fast", interpret=True)
  assert d.config.products == ("xla", "gemm"), d.config
  assert any("dx = dz·wᵀ by XLA (cuBLAS): dx 1024x512x2048 on XLA: 14.60 vs 15.60 ms ours" in n and "gemm[dw]" in n
             for n in d.notes), d.notes
  # within the margin (2.7% here) the product stays on ours
  table[tuning.norm_kind(kind)]["dx"] = [row((b, h, v), 13.1, 12.76)]
  assert explain(*args, impl="pallas_mosaic", mode="fast", interpret=True).config.products == ("gemm", "gemm")
  table[tuning.norm_kind(kind)]["dx"] = [row((b, h, v), 15.6, 14.6)]
  d = explain(*args, impl="pallas_mosaic", mode="fast", interpret=True, config=Config(products="gemm"))
  assert d.config.products == ("gemm", "gemm")


def test_fast_products_follow_the_measured_step(monkeypatch):
  """Where the tuning table has a ``steps`` row of the design at the head's bucket (the whole step timed with each
  (dx, dw) pair), its fastest pair runs, before the per-product rows (which here would say otherwise), and
  explain() says so with the times; another bucket or design falls back to the per-product rule. A config's
  ``products`` may name a (dx, dw) pair; a bad one is an error naming it."""
  from lce_flax import explain
  from lce_flax._impl.pallas_mosaic import gemm, tuning

  kind = tuning.norm_kind(gemm._device_kind())
  b, h, v = 1024, 512, 2048
  row = lambda mnk, ours, xla: {"bucket": list(tuning.bucket(*mnk)), "shape": list(mnk),
                                "config": {"tile_m": 128, "tile_n": 128}, "vs_xla": {"ours_ms": ours, "xla_ms": xla}}
  monkeypatch.setattr(tuning, "load_table", lambda: {kind: {"dx": [row((b, h, v), 12.0, 14.0)],
                                                            "dw": [row((h, v, b), 12.0, 14.0)]}})
  steps = {kind: [{"design": "logits", "bucket": list(tuning.bucket(b, h, v)), "shape": [1000, h, v],
                   "products": ["xla", "gemm"], "source": "test",
                   "ms": {"gemm,gemm": 38.2, "gemm,xla": 38.0, "xla,gemm": 37.5, "xla,xla": 37.8, "plain": 39.5}}]}
  monkeypatch.setattr(tuning, "load_steps", lambda: steps)
  sds = jax.ShapeDtypeStruct
  args = lambda n: (sds((n, h), jnp.bfloat16), sds((h, v), jnp.bfloat16), sds((n,), jnp.int32))
  d = explain(*args(1000), impl="pallas_mosaic", mode="fast", interpret=True)
  assert d.config.fast_design == "logits" and d.config.products == ("xla", "gemm"), d.config
  line = next(n for n in d.notes if "whole step measured fastest" in n)
  assert ("(dx, dw) on (xla, gemm): 37.50 ms against (gemm, gemm) 38.20, (gemm, xla) 38.00, (xla, xla) 37.80, the "
          "plain head 39.50") in line
  assert f"table: {kind}/steps/logits/1024x512x2048" in line
  # a row that timed one pair (bench_step_products --pairs) says so: it chose no pair
  steps[kind][0]["ms"] = {"xla,gemm": 37.5, "plain": 39.5}
  d = explain(*args(1000), impl="pallas_mosaic", mode="fast", interpret=True)
  assert d.config.products == ("xla", "gemm") and not any("measured fastest" in n for n in d.notes), d.notes
  assert any("whole step measured only with (dx, dw) on (xla, gemm): 37.50 ms against the plain head 39.50" in n
             for n in d.notes), d.notes
  # another bucket of tokens: the per-product rows (ours faster on both)
  d = explain(*args(4000), impl="pallas_mosaic", mode="fast", interpret=True, config=Config(fast_design="logits"))
  assert d.config.products == ("gemm", "gemm") and not any("whole step" in n for n in d.notes)
  # the "tokens" design does not take a "logits" row: its own rule (dx on XLA, dw added on the GEMM)
  d = explain(*args(1000), impl="pallas_mosaic", mode="fast", interpret=True,
              config=Config(fast_design="tokens", token_chunk=512))
  assert d.config.products == ("xla", "gemm") and not any("whole step" in n for n in d.notes)
  d = explain(*args(1000), impl="pallas_mosaic", mode="fast", interpret=True, config=Config(products=("gemm", "xla")))
  assert d.config.products == ("gemm", "xla") and not any("whole step" in n for n in d.notes)
  # the row's own pair, asked for: the config chose it, so no line credits the table
  d = explain(*args(1000), impl="pallas_mosaic", mode="fast", interpret=True, config=Config(products=("xla", "gemm")))
  assert d.config.products == ("xla", "gemm") and not any("whole step" in n for n in d.notes)
  for bad in (("gemm",), ("xla", "cublas"), "cublas"):
    with pytest.raises(ValueError, match="products=.*must be one of"):
      explain(*args(1000), impl="pallas_mosaic", mode="fast", interpret=True, config=Config(products=bad))


def test_explain_says_what_a_larger_token_chunk_costs():
  """explain() on the "tokens" design: where the default chunk was cut to fit TOKEN_CHUNK_BYTES (32768 tokens of
  llama3-8b and gemma2-2b) a line says so, with the memory a doubled ``Config.token_chunk`` would hold; none where
  the chunk is at its full-speed size (gpt2-small) or was asked for."""
  from lce_flax import explain

  sds = jax.ShapeDtypeStruct

  def notes(n, h, v, **kw):
    d = explain(sds((n, h), jnp.bfloat16), sds((h, v), jnp.bfloat16), sds((n,), jnp.int32), impl="pallas_mosaic",
                mode="fast", interpret=True, **kw)
    return d.config, [x for x in d.notes if x.startswith("token chunks of")]

  for (h, v), chunk in (((4096, 128256), 4096), ((2304, 256000), 2048)):
    cfg, got = notes(32768, h, v)
    assert (cfg.fast_design, cfg.token_chunk) == ("tokens", chunk) and len(got) == 1, (cfg, got)
    assert got[0].startswith(f"token chunks of {chunk} tokens: the largest power of two whose stored tiles "
                             f"({chunk}×{v}×2 bytes) fit in 1024 MiB")
    assert f"holds about {2 * chunk * v * 2 / 1e9:.2f} GB more when doubled" in got[0]
    assert "Config.token_chunk" in got[0]
    cfg, got = notes(32768, h, v, config=Config(token_chunk=2 * chunk))
    assert cfg.token_chunk == 2 * chunk and got == []
  cfg, got = notes(16384, 768, 50304)
  assert (cfg.fast_design, cfg.token_chunk) == ("tokens", 8192) and got == []


@pytest.mark.parametrize("design,w_layout,bias,smoothing", [
    ("logits", "hv", True, 0.1), ("logits", "vh", False, 0.1), ("tokens", "vh", True, 0.1),
    ("logits", "hv", True, 0.0), ("tokens", "hv", False, 0.0)])
def test_fast_gemm_path_lowers_for_cuda(design, w_layout, bias, smoothing, monkeypatch):
  """The fast op's GPU path (persistent GEMM forward, GEMM products) lowered for CUDA on CPU: with label smoothing
  the stored shifted logits and their dz pass, a Pallas Triton kernel, which lowers only with a GPU present (here
  a stand-in of its shapes takes its place; the GPU tests run it); without, the stored exponentials, whose
  backward is the products alone beside the repair of rows past their range (on the GEMM: lowered here too)."""
  from lce_flax._impl.pallas_mosaic import fast

  def dz_stand_in(zb, mt, lse, yp, coef, a, c, d, p, opts):
    return zb * 2, (jnp.zeros((d.vp,), jnp.float32) if d.has_bias else None)

  monkeypatch.setattr(fast, "_dz_pass", dz_stand_in)
  b, h, v = 1000, 512, 2048
  sds = jax.ShapeDtypeStruct
  opts = _math.LossSpec(vocab_size=v, label_smoothing=smoothing, logit_softcap=30.0)
  spec = common.Spec(opts, w_layout, interpret=False)
  cfg = Config(fast_design=design, token_chunk=256 if design == "tokens" else None, gemm=True, products="gemm")
  plan = pallas_mosaic.design(b, h, spec, jnp.bfloat16, "fast", cfg).config
  assert plan.warp_specialized and plan.gemm is not None

  def f(x, w, bias, y):
    primals = base.Primals(x.shape, w.shape, None if bias is None else bias.dtype)
    return base.fast(x, w, bias, y, jnp.ones((b,), jnp.float32), spec, pallas_mosaic, plan, (), primals)[0]

  args = (sds((b, h), jnp.bfloat16), sds((h, v) if w_layout == "hv" else (v, h), jnp.bfloat16),
          sds((v,), jnp.float32) if bias else None, sds((b,), jnp.int32))
  text = jax.jit(jax.grad(f, (0, 1))).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert ("dz pass" in str(pallas_mosaic.design(b, h, spec, jnp.bfloat16, "fast", cfg).notes)) == bool(smoothing)

  def mosaic_results(text):  # the result types of the program's Mosaic GPU calls
    return [line.rsplit(" -> ", 1)[-1] for line in text.splitlines() if "custom_call @mosaic_gpu" in line]

  # the forward, dx and dw on the GEMM: one Mosaic GPU call each, and with the stored exponentials the repair (on
  # the GEMM too, written over E in place). The "tokens" design traces its chunk twice: the first chunk (whose
  # float32 dw product starts the dw) and the loop over the others, whose dw product adds into the carried float32
  # dw in place (its one output aliased to that operand).
  got = mosaic_results(text)
  w_shape = "x".join(map(str, args[1].shape))
  dw_type = f"tensor<{w_shape}xbf16>"
  gemms = 3 * (1 if design == "logits" else 2)
  repairs = 0 if smoothing else (1 if design == "logits" else 2)
  assert len(got) == gemms + repairs, got
  # Nothing in the program makes the host wait for the device: no conditional, and no loop but the "tokens"
  # design's loop over its chunks, of a fixed trip count (a branch on a run-time value, such as whether a row needs
  # the repair, would copy its predicate to the host and wait there at every call on the GPU).
  assert "stablehlo.case" not in text and "stablehlo.if" not in text
  assert text.count("stablehlo.while") == (0 if design == "logits" else 1), text.count("stablehlo.while")
  if design == "tokens":  # a chunk's forward waits for the previous chunk's products (the carried float32 dw)
    tied = (f"tensor<{w_shape}xf32>", f"tensor<{-(-b // 256)}x256x{h}xbf16>")  # (dw, and dx's chunks of 256 rows)
    assert any("stablehlo.optimization_barrier" in line and all(t in line for t in tied) for line in text.splitlines())
  assert sum(dw_type in r for r in got) == (1 if design == "logits" else 0), got
  assert sum(f"tensor<{w_shape}xf32>" in r for r in got) == (0 if design == "logits" else 2), got
  aliased = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line and "output_operand_alias" in line]
  dw_acc = [line for line in aliased if line.rstrip().endswith(f"-> tensor<{w_shape}xf32>")]
  assert len(dw_acc) == (0 if design == "logits" else 1), aliased
  rows = -(-(b if design == "logits" else 256) // plan.block_t) * plan.block_t
  e_type = f"-> tensor<{rows}x{v}xbf16>"  # (the repair's one output: E, aliased to its operand)
  assert len(aliased) - len(dw_acc) == repairs and all(
      line.rstrip().endswith(e_type) for line in aliased if line not in dw_acc), aliased
  if design == "logits":  # a frozen head (the gradient of x only): the dw product is not in the program
    frozen = mosaic_results(jax.jit(jax.grad(f, 0)).trace(*args).lower(lowering_platforms=("cuda",)).as_text())
    assert not any(dw_type in r for r in frozen) and len(frozen) < len(got), frozen
    if not smoothing:  # w alone differentiated: the dx product (x's rows as padded, x's dtype) is not formed either
      dx_type = f"tensor<{-(-b // plan.block_t) * plan.block_t}x{h}xbf16>"
      assert sum(dx_type in r for r in got) == 1, got
      w_only = mosaic_results(jax.jit(jax.grad(f, 1)).trace(*args).lower(lowering_platforms=("cuda",)).as_text())
      assert not any(dx_type in r for r in w_only) and len(w_only) < len(got), w_only


@pytest.mark.parametrize("w_layout,bias,dtype", [("hv", True, jnp.bfloat16), ("vh", False, jnp.float16)])
def test_reduction_none_runs_the_logits_design(w_layout, bias, dtype):
  """The "logits" fast design forms dz in its backward: ``reduction="none"`` runs it (mode=None) with any
  per-token cotangent, and the lse of ``return_aux`` is differentiable too."""
  from lce_flax import explain

  (x, w, y, b), (xn, wn, yn, bn) = make_inputs(34, (101,), 128, 384, dtype, w_layout=w_layout, bias=bias)
  y = y.at[7].set(-100)
  yn = np.asarray(y)
  kw = dict(bias=b, w_layout=w_layout, reduction="none", impl="pallas_mosaic", interpret=True, z_loss=1e-3,
            logit_softcap=20.0)
  d = explain(x, w, y, **kw)
  assert (d.mode, d.name) == ("fast", "logits") and any("per-token cotangents" in n for n in d.notes)
  cot = np.random.default_rng(35).standard_normal(101).astype(np.float32)
  glse = np.random.default_rng(36).standard_normal(101).astype(np.float32)
  ref = linear_cross_entropy_np(xn, wn, yn, bias=bn, reduction="none", cotangent=cot, w_layout=w_layout,
                                z_loss=1e-3, logit_softcap=20.0)
  f = lambda x, w, b: linear_cross_entropy(x, w, y, return_aux=True, **dict(kw, bias=b))
  (loss, aux), vjp = jax.vjp(f, x, w, b)
  assert rel_err(loss, ref["loss"]) < 1e-5 and rel_err(aux.lse, ref["lse"]) < 1e-5
  zero_aux = jax.tree.map(jnp.zeros_like, aux)
  dx, dw, db = vjp((jnp.asarray(cot), zero_aux))
  assert rel_err(dx, ref["dx"]) < 1e-2 and rel_err(dw, ref["dw"]) < 1e-2
  if bias:
    assert rel_err(db, ref["dbias"]) < 1e-2
  # an lse cotangent: d lse / d z = softmax, against the lean design (which takes it too)
  g = lambda x, mode: linear_cross_entropy(x, w, y, return_aux=True, **dict(kw, mode=mode))[1].lse @ jnp.asarray(glse)
  assert rel_err(jax.grad(g)(x, None), jax.grad(g)(x, "lean")) < 1e-2


def test_fast_design_choice_and_errors():
  """The smaller buffer wins: B·V·2 bytes of stored logits, or H·V·4 of float32 dw + a c×V chunk of them."""
  assert op.fast_design(8192, 4096, 128256) == "logits"  # llama3-8b: 2.10 vs 3.15 GB
  assert op.fast_design(4096, 4096, 151936) == "logits"  # qwen3-8b: 1.24 vs 3.11 GB
  assert op.fast_design(8192, 2304, 256000) == "logits"  # gemma2-2b: 4.19 vs 4.46 GB (4096-token chunks)
  assert op.fast_design(16384, 768, 50304) == "tokens"  # gpt2-small: 1.65 vs 0.98 GB (8192-token chunks)
  assert op.token_chunk(16384, 768, 50304) == 8192  # (4096-token chunks ran 3-6% slower on an H100)
  assert op.token_chunk(12288, 1024, 32000) == 4096  # a power of two, at most half the tokens
  assert op.token_chunk(1000, 768, 50304) == 256  # at most half the tokens
  # a chunk of at most 1 GiB of bf16 logits: the extra memory stays near H·V·4 + 1 GiB at any number of tokens
  assert op.token_chunk(32768, 4096, 128256) == 4096 and op.token_chunk(32768, 2304, 256000) == 2048
  args = (jnp.ones((4, 64), jnp.bfloat16), jnp.ones((64, 10), jnp.bfloat16), jnp.zeros(4, int))
  for design, match in (("big", "fast_design='big'"), ("chunked", "fast_design='chunked'.*impl='chunked'")):
    with pytest.raises(ValueError, match=match):
      linear_cross_entropy(*args, impl="pallas_mosaic", mode="fast", interpret=True,
                           config=Config(fast_design=design))
  with pytest.raises(ValueError, match="token_chunk=100 .*block_t=64"):
    linear_cross_entropy(*args, impl="pallas_mosaic", mode="fast", interpret=True,
                         config=dataclasses.replace(FAST, fast_design="tokens", token_chunk=100))
  with pytest.raises(ValueError, match="token_chunk=128: the 'logits' fast design has no chunk loop"):
    linear_cross_entropy(*args, impl="pallas_mosaic", mode="fast", interpret=True,
                         config=dataclasses.replace(FAST, token_chunk=128))
  with pytest.raises(ValueError, match="vocab_chunk=128: the fast design of impl='pallas_mosaic' loops over tokens"):
    linear_cross_entropy(*args, impl="pallas_mosaic", mode="fast", interpret=True, config=SMALL)
  with pytest.raises(ValueError, match="token_chunk=128: the lean design of impl='pallas_mosaic' loops over vocab"):
    linear_cross_entropy(*args, impl="pallas_mosaic", mode="lean", interpret=True,
                         config=dataclasses.replace(FAST, fast_design=None, token_chunk=128))
  # a token chunk asked for picks the design with a token loop
  assert op.plan(1000, 64, 300, Config(token_chunk=256), mode="fast").fast_design == "tokens"


def test_design_protocol():
  """design(): names, resolved plans (what lean/fast take), memory bounds, and the errors of bad configs."""
  spec = common.Spec(_math.LossSpec(vocab_size=128256))
  lean = pallas_mosaic.design(8192, 4096, spec, jnp.bfloat16, "lean", None)
  assert (lean.impl, lean.mode, lean.name) == ("pallas_mosaic", "lean", "recompute")
  assert lean.config == op.plan(8192, 4096, 128256) and "chunks of 1792 columns" in lean.chunking
  # dz (B·chunk·2) + the float32 dx (B·H·4; each product added into it in place) + two [H, chunk] buffers + the
  # cuBLAS workspace + stats and bias
  floor = 8192 * 1792 * 2 + 8192 * 4096 * 4 + 2 * 4096 * 1792 * 2 + op.CUBLAS_WORKSPACE
  assert floor <= lean.memory_bytes <= floor + 8 * 2**20
  fast = pallas_mosaic.design(8192, 4096, spec, jnp.bfloat16, "fast", None)
  assert (fast.name, fast.config.fast_design, fast.config.token_chunk) == ("logits", "logits", None)
  floor = 8192 * 128256 * 2 + 8192 * (128256 // 128) * 4  # B·V·itemsize + B·⌈V/bv⌉·4
  assert floor <= fast.memory_bytes <= floor + 300 * 2**20
  gpt2 = common.Spec(_math.LossSpec(vocab_size=50304))
  tok = pallas_mosaic.design(16384, 768, gpt2, jnp.bfloat16, "fast", None)
  assert (tok.name, tok.config.token_chunk) == ("tokens", 8192) and "token chunks of 8192" in tok.chunking
  floor = 768 * 50304 * 4 + 8192 * 50304 * 2 + op.CUBLAS_WORKSPACE  # H·V·4 + c·V·itemsize + the cuBLAS workspace
  assert floor <= tok.memory_bytes <= floor + 100 * 2**20 and tok.memory_bytes < fast.memory_bytes
  for mode in ("lean", "fast"):  # an empty batch plans without dividing by zero
    assert pallas_mosaic.design(0, 4096, spec, jnp.bfloat16, mode, None).memory_bytes >= 0
  with pytest.raises(TypeError, match="pallas_mosaic"):
    pallas_mosaic.design(64, 64, spec, jnp.bfloat16, "lean", chunked.Config())
  with pytest.raises(ValueError, match="vocab_chunk=0 "):
    pallas_mosaic.design(64, 64, spec, jnp.bfloat16, "lean", Config(vocab_chunk=0))
  with pytest.raises(ValueError, match="semantics='lane' cannot run the warp-specialised"):
    pallas_mosaic.design(64, 64, spec, jnp.bfloat16, "lean", Config(semantics="lane", warp_specialized=True))
  with pytest.raises(ValueError, match="cannot run mode='fast'"):  # a lean plan handed to fast
    pallas_mosaic.fast_forward(jnp.ones((4, 64), jnp.bfloat16), jnp.ones((64, 10), jnp.bfloat16), None,
                               jnp.zeros(4, jnp.int32), jnp.ones(4),
                               common.Spec(_math.LossSpec(vocab_size=10), interpret=True),
                               op.plan(4, 64, 10, interpret=True))


def test_bias_pads_vocab_to_aligned_chunks():
  """With a bias, V is padded to 64 columns in both layouts: every chunk's bias slice then starts 256-byte aligned
  (Mosaic GPU refused the clamped last chunk's slice at V=5003 and 5008 with w_layout="vh" on the H100)."""
  p = op.plan(1000, 512, 5003)
  for v in (5003, 5008):
    spec = common.Spec(_math.LossSpec(vocab_size=v), "vh")
    x, w, y = jnp.zeros((1000, 512), jnp.bfloat16), jnp.zeros((v, 512), jnp.bfloat16), jnp.zeros(1000, jnp.int32)
    assert op.prepare(x, w, None, y, spec, p)[-1].vp == 5008  # no bias: w is not copied for V=5008
    d = op.prepare(x, w, jnp.zeros(v), y, spec, p)[-1]
    assert d.vp == 5056 and (d.vp - p.vocab_chunk) * 4 % 256 == 0


def test_supported_and_plan():
  pallas_mosaic.supported(common.Spec(_math.LossSpec(vocab_size=10), interpret=True), "cpu")
  pallas_mosaic.supported(common.Spec(_math.LossSpec(vocab_size=10), interpret=True), "cpu", jnp.float16)
  with pytest.raises(NotImplementedError, match="platform='cpu'"):
    base.check_supported("pallas_mosaic", common.Spec(_math.LossSpec(vocab_size=10)), "cpu", jnp.bfloat16)
  if not on_sm90:
    with pytest.raises(ValueError, match="pallas_mosaic"):
      linear_cross_entropy(jnp.ones((4, 64), jnp.bfloat16), jnp.ones((64, 10), jnp.bfloat16), jnp.zeros(4, int),
                           impl="pallas_mosaic", interpret=False)
  p = op.plan(8192, 4096, 128256)
  assert (p.block_t, p.block_v, p.block_k) == (128, 128, 64) and p.vocab_chunk == 1792
  # lean's chunk buffers (dz [B, c], two [H, c]) and the cuBLAS workspace fit in the 64 MB it may hold beside its
  # float32 dx, the x gradient's buffer (B·H·2) holding the workspace where it is larger, else dz where it fits
  for tokens, hidden, chunk in ((4096, 4096, 1536), (8192, 2304, 2304), (16384, 768, 768), (32768, 4096, 512)):
    assert op.plan(tokens, hidden, 256000).vocab_chunk == chunk
    out, dz, w_c = tokens * hidden * 2, tokens * chunk * 2, 2 * hidden * chunk * 2
    in_temp = (dz + w_c) if out > op.CUBLAS_WORKSPACE else (min(dz + w_c + op.CUBLAS_WORKSPACE, w_c + max(
        dz, op.CUBLAS_WORKSPACE)) if dz <= out else dz + w_c + op.CUBLAS_WORKSPACE)
    assert in_temp + op.LEAN_RESERVE + 64 * tokens <= 64 * 10**6, (tokens, hidden, chunk)
  assert 64 * p.num_splits >= 8 * 132  # about 8 waves of forward CTAs
  with pytest.raises(ValueError, match="block_v=96"):
    op.plan(64, 64, 1000, Config(block_v=96))
  with pytest.raises(ValueError, match="vocab_chunk=100 must be a positive multiple of block_v=128"):
    op.plan(64, 64, 1000, Config(vocab_chunk=100))
  with pytest.raises(TypeError, match="unexpected keyword argument 'fp32_inputs'"):
    Config(fp32_inputs="bf16")  # gone: float32 inputs are refused, dtype=jnp.bfloat16 rounds them


@pytest.mark.gpu(min_cc=(9, 0), long=True)
@pytest.mark.parametrize("mode", ["fast", "lean"])
@pytest.mark.parametrize("w_layout", ["vh", "hv"])
def test_gpu_llama3_against_xla(w_layout, mode):
  """llama3-8b head (fast: the stored-logits design, the default at this shape) against xla on float32-upcast
  inputs at full float32 precision."""
  b, h, v = 8192, 4096, 128256
  k = jax.random.split(jax.random.key(1), 3)
  x = jax.random.normal(k[0], (b, h), jnp.bfloat16)
  w = (0.02 * jax.random.normal(k[1], (v, h) if w_layout == "vh" else (h, v))).astype(jnp.bfloat16)
  y = jax.random.randint(k[2], (b,), 0, v)
  f = lambda impl: jax.jit(jax.value_and_grad(
      lambda x, w: linear_cross_entropy(x, w, y, w_layout=w_layout, impl=impl, mode=None if impl == "xla" else mode,
                                        reduction="mean"), (0, 1)))
  l1, (dx1, dw1) = f("pallas_mosaic")(x, w)
  with jax.default_matmul_precision("highest"):
    l0, (dx0, dw0) = f("xla")(x.astype(jnp.float32), w.astype(jnp.float32))
  assert abs(float(l1 - l0)) / abs(float(l0)) < 1e-4
  assert rel_err(dx1, dx0) < 1e-2 and rel_err(dw1, dw0) < 1e-2


@pytest.mark.gpu(min_cc=(9, 0))
@pytest.mark.parametrize("design", ["logits", "tokens"])
def test_gpu_fast_designs_compiled(design):
  cfg = Config(fast_design=design, token_chunk=256 if design == "tokens" else None)  # (the GPU's block_t: 128)
  check(config=cfg, mode="fast", h=512, v=5003, batch_shape=(1000,), options=OPTIONS["all"], bias=True,
        interpret=False)


@pytest.mark.gpu(min_cc=(9, 0))
@pytest.mark.parametrize("products,w_layout", [("gemm", "hv"), (("gemm", "xla"), "vh"), (("xla", "gemm"), "hv")])
def test_gpu_lean_products_compiled(products, w_layout):
  """Lean mode with its chunk products on the GEMM, compiled: every option, a bias, ragged rows, several chunks (the
  last clamped), against the float64 oracle."""
  check(config=Config(products=products, vocab_chunk=1536), mode="lean", h=512, v=5120, batch_shape=(1000,),
        options=OPTIONS["all"], bias=True, w_layout=w_layout, interpret=False)


@pytest.mark.gpu(min_cc=(9, 0))
@pytest.mark.parametrize("w_layout", ["hv", "vh"])
def test_gpu_lean_token_blocks_compiled(w_layout):
  """Lean mode in blocks of the tokens (``token_block``), compiled: every option, a bias, ragged rows, several
  blocks (the last clamped) in several chunks (the last clamped), against the float64 oracle."""
  check(config=Config(products="gemm", vocab_chunk=1536, token_block=384), mode="lean", h=512, v=5120,
        batch_shape=(1000,), options=OPTIONS["all"], bias=True, w_layout=w_layout, interpret=False)


@pytest.mark.gpu(min_cc=(9, 0))
@pytest.mark.parametrize("b,h,v", [(32768, 4096, 128256), (32768, 2304, 256000)],
                         ids=["llama3-8b-32k", "gemma2-2b-32k"])
@pytest.mark.parametrize("asked", [True, False], ids=["blocks-4096", "default"])
def test_gpu_lean_token_blocks_memory(b, h, v, asked):
  """Lean mode in blocks of tokens at 32768 tokens holds at most B·H·4 + 64 MB of temporaries (dz [block, chunk],
  the chunk's float32 dw and its rounded sum beside the float32 dx): in blocks of 4096 tokens at the width by
  memory, and as it runs by default (the blocks and width of the tuning table's steps row on this GPU, which may
  be wider: op._blocked_chunk_fits)."""
  sds = jax.ShapeDtypeStruct
  args = (sds((b, h), jnp.bfloat16), sds((h, v), jnp.bfloat16), sds((b,), jnp.int32))
  cfg = Config(products="gemm", token_block=4096) if asked else None
  f = lambda x, w, y: linear_cross_entropy(x, w, y, impl="pallas_mosaic", mode="lean", reduction="sum", config=cfg)
  temp = jax.jit(jax.grad(f, (0, 1))).lower(*args).compile().memory_analysis().temp_size_in_bytes
  assert temp <= b * h * 4 + 64 * 10**6, (temp, b * h * 4 + 64 * 10**6)


@pytest.mark.gpu(min_cc=(9, 0))
@pytest.mark.parametrize("design", ["logits", "tokens", "lean"])
def test_gpu_fast_memory_within_its_bound(design):
  """The compiled step's temporaries stay near the design's :func:`.op.memory_bytes` (which explain() reports; an
  estimate of XLA's buffers, so within 10%), and the "logits" design holds one B×V buffer, not two: the repair of
  rows past the exponentials' range must update the stored tiles in place (an earlier ``lax.cond`` handing them
  through made XLA's GPU backend copy them). Lean mode holds one float32 dx (each chunk's product added into it in
  place) and one chunk of dz and of w."""
  from lce_flax import explain

  b, h, v = 4096, 1024, 32768
  sds = jax.ShapeDtypeStruct
  args = (sds((b, h), jnp.bfloat16), sds((h, v), jnp.bfloat16), sds((b,), jnp.int32))
  mode = "lean" if design == "lean" else "fast"
  cfg = None if design == "lean" else Config(fast_design=design, token_chunk=1024 if design == "tokens" else None)
  f = lambda x, w, y: linear_cross_entropy(x, w, y, impl="pallas_mosaic", mode=mode, config=cfg)
  temp = jax.jit(jax.grad(f, (0, 1))).lower(*args).compile().memory_analysis().temp_size_in_bytes
  bound = explain(*args, impl="pallas_mosaic", mode=mode, config=cfg).memory_bytes
  assert temp <= 1.1 * bound, (temp, bound)
  if design == "logits":
    assert temp < 1.5 * b * v * 2, temp
  if design == "lean":  # one float32 dx, not two (the dx products add into it in place): a second would not fit
    assert temp <= bound < temp + b * h * 4, (temp, bound)


@pytest.mark.gpu(min_cc=(9, 0))
@pytest.mark.parametrize("b,h,v", [(16384, 768, 50304), (8192, 4096, 128256), (4096, 4096, 151936),
                                   (8192, 2304, 256000)], ids=["gpt2-small", "llama3-8b", "qwen3-8b", "gemma2-2b"])
@pytest.mark.parametrize("gemms", ["autotuned", "cublas", "triton", "ours"])
def test_gpu_lean_memory_at_llm_shapes(b, h, v, gemms):
  """Lean mode's compiled forward + backward holds at most B·H·4 + 64 MB of temporaries at the LLM heads (its
  float32 dx, one chunk's dz and [H, chunk] buffers, the cuBLAS workspace, O(B) vectors), whichever GEMMs XLA's
  autotuner picks for each chunk's products: as it picks them, with cuBLAS for all (XLA's Triton GEMMs off, the
  pick that once held a float32 [H, chunk] product apart from its convert), and with Triton for all (no cuBLAS
  fallback: the chunk's ``dx + dz·w_cᵀ`` must still add into the carried float32 dx in place, as cuBLAS's
  beta = 1 does, not into a second B×H float32 buffer); and with both products on the project's GEMM (dx added by
  TMA reduce-adds into the same float32 dx)."""
  sds = jax.ShapeDtypeStruct
  args = (sds((b, h), jnp.bfloat16), sds((h, v), jnp.bfloat16), sds((b,), jnp.int32))
  cfg = Config(products="gemm") if gemms == "ours" else None
  f = lambda x, w, y: linear_cross_entropy(x, w, y, impl="pallas_mosaic", mode="lean", reduction="sum", config=cfg)
  options = {"autotuned": None, "ours": None, "cublas": {"xla_gpu_enable_triton_gemm": False},
             "triton": {"xla_gpu_cublas_fallback": False, "xla_gpu_triton_gemm_any": True}}[gemms]
  temp = jax.jit(jax.grad(f, (0, 1))).lower(*args).compile(options).memory_analysis().temp_size_in_bytes
  assert temp <= b * h * 4 + 64 * 10**6, (temp, b * h * 4 + 64 * 10**6)


@pytest.mark.parametrize("w_layout", ["hv", "vh"])
def test_lean_chunk_dw_product_is_formed_in_the_weights_dtype(w_layout):
  """Each vocabulary chunk's dw product (xᵀ·dz, [H, chunk]) leaves the dot in w's dtype (bf16), accumulated in
  float32 inside it: a float32 dot and a convert would hand the float32 [H, chunk] buffer to whichever GEMM XLA's
  autotuner picks (a cuBLAS pick keeps it apart from the convert: 21.2 MB more once on an H100 at gemma2-2b's
  2304×2304 chunk, lean's bound is B·H·4 + 64 MB). Checked on the lowered program: no dot in the backward yields
  that shape in float32, one yields it in bf16."""
  b, h, v, cw = 200, 192, 1024, 384
  sds = jax.ShapeDtypeStruct
  args = (sds((b, h), jnp.bfloat16), sds((h, v) if w_layout == "hv" else (v, h), jnp.bfloat16),
          sds((b,), jnp.int32))
  cfg = Config(block_t=64, vocab_chunk=cw)
  f = lambda x, w, y: linear_cross_entropy(x, w, y, impl="pallas_mosaic", mode="lean", reduction="sum", config=cfg,
                                           interpret=True, w_layout=w_layout)
  text = jax.jit(jax.grad(f, (0, 1))).lower(*args).as_text()
  shape = f"{h}x{cw}" if w_layout == "hv" else f"{cw}x{h}"
  dots = re.findall(r"stablehlo\.dot_general[^\n]*-> tensor<(\d+x\d+)x(\w+)>", text)
  assert (shape, "bf16") in dots and (shape, "f32") not in dots, (shape, dots)


@pytest.mark.gpu(min_cc=(9, 0))
def test_gpu_options_compiled():
  check(config=None, h=512, v=5003, batch_shape=(1000,), options=OPTIONS["all"], bias=True, interpret=False)


@pytest.mark.parametrize("w_layout,bias", [("vh", True), ("hv", False)])
def test_warp_specialized_kernels_lower_for_cuda(w_layout, bias):
  """The GPU-default (warp-specialised) kernels cannot be interpreted, but their whole Pallas → Mosaic GPU
  lowering runs on CPU: layout inference and the shared-memory budget are checked here."""
  b, h, v = 200, 128, 1000
  opts = _math.LossSpec(vocab_size=v, label_smoothing=0.1, z_loss=1e-3, logit_softcap=30.0)
  spec = common.Spec(opts, w_layout, interpret=False)
  sds = jax.ShapeDtypeStruct
  args = (sds((b, h), jnp.bfloat16), sds((v, h) if w_layout == "vh" else (h, v), jnp.bfloat16),
          sds((v,), jnp.float32) if bias else None, sds((b,), jnp.int32))

  def f(x, w, bias, y):
    out = base.lean(x, w, bias, y, spec, pallas_mosaic, pallas_mosaic.design(b, h, spec, x.dtype, "lean", Config(
        warp_specialized=True)).config)
    return jnp.sum(out.loss) + jnp.sum(out.lse)

  text = jax.jit(jax.grad(f, (0, 1))).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("mosaic_gpu") >= 2  # the forward and the dz kernel

  def g(x, w, bias, y):  # the fast forward: tile stores through SMEM + TMA on top of the statistics
    p = op.plan(b, h, v, Config(warp_specialized=True), mode="fast")
    xp, wp, bp, yp, d = op.prepare(x, w, bias, y, spec, p, store=True)
    out, (zb, mt) = kernels_ws.forward_ws(xp, wp, bp, yp, d, p, opts)
    return out.s.sum() + zb.sum() + mt.sum()

  text = jax.jit(g).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("mosaic_gpu") >= 1
  # 8 stages of 48 KB (H=1024 has enough steps to fill them) exceed the 227 KB of SMEM: caught when lowering
  big = (sds((b, 1024), jnp.bfloat16), sds((v, 1024) if w_layout == "vh" else (1024, v), jnp.bfloat16)) + args[2:]
  plan8 = pallas_mosaic.design(b, 1024, spec, jnp.bfloat16, "lean", Config(num_stages=8)).config
  bad = lambda x, w, bias, y: base.lean(x, w, bias, y, spec, pallas_mosaic, plan8).loss.sum()
  with pytest.raises(ValueError, match="shared memory"):
    jax.jit(bad).trace(*big).lower(lowering_platforms=("cuda",))


def _lean_lowered(b, h, v, w_layout, bias, cfg, softcap=None):
  """Lean mode's gradient of x and w planned with ``cfg`` and lowered for CUDA on CPU: (plan, StableHLO text, the
  lines of its Mosaic GPU calls)."""
  spec = common.Spec(_math.LossSpec(vocab_size=v, logit_softcap=softcap), w_layout, interpret=False)
  plan = pallas_mosaic.design(b, h, spec, jnp.bfloat16, "lean", cfg).config
  sds = jax.ShapeDtypeStruct
  args = (sds((b, h), jnp.bfloat16), sds((v, h) if w_layout == "vh" else (h, v), jnp.bfloat16),
          sds((v,), jnp.float32) if bias else None, sds((b,), jnp.int32))

  def f(x, w, bias, y):
    return jnp.sum(base.lean(x, w, bias, y, spec, pallas_mosaic, plan).loss)

  text = jax.jit(jax.grad(f, (0, 1))).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  return plan, text, [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]


@pytest.mark.parametrize("w_layout,bias,products", [("hv", False, "gemm"), ("vh", True, "gemm"),
                                                     ("hv", True, ("gemm", "xla")), ("vh", False, ("xla", "gemm"))])
def test_lean_products_on_the_gemm_lower_for_cuda(w_layout, bias, products):
  """Lean mode with its chunk products on the GEMM, lowered for CUDA on CPU: the forward's statistics, then in the
  one loop over the vocabulary chunks (three of 768 columns, the last clamped to end at V) the LogitGrad recompute
  reading w's chunk in place, dx = dz·w_cᵀ added into the carried float32 dx by a Mosaic GPU call whose one output
  is that operand (TMA reduce-adds in place: no second B×H float32 buffer), and xᵀ·dz added into the chunk's
  columns of the whole dw, in place too; no copy of w's chunk unless XLA forms dx; what ``products`` leaves to XLA
  is a dot of the chunk's shape."""
  b, h, v = 1000, 512, 2048
  plan, text, calls = _lean_lowered(b, h, v, w_layout, bias, Config(products=products, vocab_chunk=768), 30.0)
  assert plan.gemm is not None and plan.stats_gemm and plan.vocab_chunk == 768, plan
  on_dx, on_dw = plan.products
  rows, cw = -(-b // plan.block_t) * plan.block_t, plan.vocab_chunk
  dx_type = f"tensor<{rows}x{h}xf32>"
  chunk_type = f"tensor<{h}x{cw}xbf16>" if w_layout == "hv" else f"tensor<{cw}x{h}xbf16>"
  w_type = f"tensor<{h}x{v}xbf16>" if w_layout == "hv" else f"tensor<{v}x{h}xbf16>"
  dx_calls = [line for line in calls if line.rstrip().endswith(f"-> {dx_type}")]
  dw_calls = [line for line in calls if line.rstrip().endswith(f"-> {w_type}")]
  assert len(calls) == 2 + (on_dx == "gemm") + (on_dw == "gemm"), calls  # + the forward and the recompute
  assert len(dx_calls) == (on_dx == "gemm") and all("output_operand_alias" in line for line in dx_calls), dx_calls
  assert len(dw_calls) == (on_dw == "gemm") and all("output_operand_alias" in line for line in dw_calls), dw_calls
  dots = re.findall(r"stablehlo\.dot_general[^\n]*-> (tensor<[^>]*>)", text)
  assert (dx_type in dots) == (on_dx == "xla") and (chunk_type in dots) == (on_dw == "xla"), dots
  slices = re.findall(r"stablehlo\.dynamic_slice[^\n]*-> (tensor<[^>]*>)", text)
  assert (chunk_type in slices) == (on_dx == "xla" or on_dw == "xla"), slices  # w's chunk copied only for XLA
  assert text.count("stablehlo.while") == 1
  # each kernel named by its role and hooks, as a profile shows it (benchmarks/profile_head.py)
  for name, on in (("lce_gemm_lean_dz_LogitGrad", True), ("lce_gemm_dx_acc_AddTo", on_dx == "gemm"),
                   ("lce_gemm_dw_AddTo", on_dw == "gemm")):
    assert (name in text) == on, name


@pytest.mark.parametrize("token_block", [None, 1024], ids=["one-block", "blocks"])
def test_lean_notes_name_the_rows_its_kernels_take(token_block, monkeypatch):
  """explain()'s lean notes name, for the recompute and each chunk's two products on the GEMM, the tuning table's
  row of the shape (role, M×N×K) the kernels look their config up by as they lower for CUDA (per block of tokens
  where lean mode runs blocks: dw then added into the chunk's float32 dw, the role dw_acc)."""
  from lce_flax._impl.pallas_mosaic import tuning

  seen = set()
  real = tuning.select_config  # (what the GEMM calls as it lowers; explain() describes rows by select_row)

  def spy(role, m, n, k, kind):
    seen.add(f"gemm[{role}] {m}x{n}x{k}")
    return real(role, m, n, k, kind)

  monkeypatch.setattr(tuning, "select_config", spy)
  b, h, v = 4000, 512, 2048
  cfg = Config(products="gemm", vocab_chunk=768, token_block=token_block)
  plan, _, _ = _lean_lowered(b, h, v, "hv", False, cfg)
  assert plan.token_block == token_block, plan
  spec = common.Spec(_math.LossSpec(vocab_size=v), "hv", interpret=False)
  notes = " ".join(pallas_mosaic.design(b, h, spec, jnp.bfloat16, "lean", cfg).notes)
  named = set(re.findall(r"gemm\[(?:lean_dz|dx_acc|dw|dw_acc)\] \d+x\d+x\d+", notes))
  looked_up = {n for n in seen if re.match(r"gemm\[(lean_dz|dx_acc|dw|dw_acc)\]", n)}
  assert len(named) == 3 and named == looked_up, (named, looked_up)


@pytest.mark.parametrize("w_layout,bias", [("hv", True), ("vh", False)])
def test_lean_token_blocks_lower_for_cuda(w_layout, bias):
  """Lean mode in blocks of the tokens, lowered for CUDA on CPU: one loop over the vocabulary chunks holding one over
  the token blocks, in which the recompute reads x's block and w's chunk in place, dx's product adds into dx's rows
  in place (the carried float32 dx its one output) and dw's into the chunk's float32 [H, chunk] (its one output);
  no copy of x's block or of w's chunk."""
  b, h, v = 4000, 512, 2048
  plan, text, calls = _lean_lowered(b, h, v, w_layout, bias, Config(products="gemm", vocab_chunk=768,
                                                                     token_block=1024))
  assert plan.gemm is not None and plan.token_block == 1024 and plan.vocab_chunk == 768, plan
  rows = -(-b // plan.block_t) * plan.block_t
  dx_calls = [line for line in calls if line.rstrip().endswith(f"-> tensor<{rows}x{h}xf32>")]
  dw_type = f"tensor<{h}x768xf32>" if w_layout == "hv" else f"tensor<768x{h}xf32>"
  dw_calls = [line for line in calls if line.rstrip().endswith(f"-> {dw_type}")]
  assert len(calls) == 4, calls  # the forward's statistics, the recompute, dx's and dw's products
  assert len(dx_calls) == 1 and len(dw_calls) == 1, calls
  assert all("output_operand_alias" in line for line in dx_calls + dw_calls), calls
  assert "stablehlo.dot_general" not in text
  slices = re.findall(r"stablehlo\.dynamic_slice[^\n]*-> (tensor<[^>]*>)", text)
  chunk_type = f"tensor<{h}x768xbf16>" if w_layout == "hv" else f"tensor<768x{h}xbf16>"
  assert f"tensor<1024x{h}xbf16>" not in slices, slices
  assert slices.count(chunk_type) == 1, slices  # dw's own columns (their sum with the chunk's), not w's chunk
  assert text.count("stablehlo.while") == 2


@pytest.mark.parametrize("cap", [None, 30.0])
def test_kernels_take_the_approximate_units(cap):
  """Every GPU kernel's exp is the hardware's ``ex2.approx`` (``approx_math``), with a soft cap too: its tanh is
  ``epilogue.tanh`` (ex2.approx and rsqrt.approx), never Mosaic's ``tanh.approx`` (too coarse for a cap of 30):
  the lean forward and dz kernels and the fast forward on the GEMM, as lowered for CUDA."""
  b, h, v = 200, 128, 1024
  opts = _math.LossSpec(vocab_size=v, logit_softcap=cap)
  spec = common.Spec(opts, "hv", interpret=False)
  sds = jax.ShapeDtypeStruct
  args = (sds((b, h), jnp.bfloat16), sds((h, v), jnp.bfloat16), sds((b,), jnp.int32))

  def lean(x, w, y):
    out = base.lean(x, w, None, y, spec, pallas_mosaic, pallas_mosaic.design(b, h, spec, x.dtype, "lean").config)
    return jnp.sum(out.loss)

  def fast_forward(x, w, y):
    p = op.plan(b, h, v, mode="fast")
    assert p.gemm is not None  # the forward on the GEMM of gemm.py
    return jax.tree.leaves(fast.fast_forward(x, w, None, y, jnp.ones(y.shape, jnp.float32), spec, p))[0].sum()

  for f in (jax.grad(lean, (0, 1)), fast_forward):
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 1
    assert "ex2.approx" in text and "tanh.approx" not in text, f
    assert ("rsqrt.approx" in text) == (cap is not None), f


def test_plan_warp_specialization_follows_interpret():
  assert op.plan(1000, 512, 5003).warp_specialized
  p = op.plan(1000, 512, 5003, interpret=True)
  assert not p.warp_specialized and p.semantics == "lane"
  with pytest.raises(NotImplementedError, match="interpret"):
    op.plan(1000, 512, 5003, Config(warp_specialized=True), interpret=True)
