"""``impl="pallas_triton"`` against the float64 oracle.

On CPU the kernels run in Pallas interpret mode (the op's default there) with small blocks, so several vocabulary
tiles, splits, backward chunks, H steps and ragged edges of B, V and H are all exercised. The ``gpu``-marked
tests run the compiled kernels at the llama3-8b shape (``pytest -m gpu`` on a GPU machine).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lce_flax import _math, linear_cross_entropy
from lce_flax._impl import base, chunked, common, pallas_triton
from lce_flax._impl.pallas_triton import Config, op
from tests._checks import (
  OPTIONS,
  TRITON_SMALL,
  check_impl,
  check_llama3_8b,
  make_inputs,
)
from tests.reference_np import linear_cross_entropy_np, rel_err

# 16-token, 32-column, 16-deep tiles; 3 splits of the forward; backward chunks of 64 columns: with B=37, H=24,
# V=301 every loop runs several times and ends on a ragged tile (37 = 2·16 + 5, 24 = 16 + 8, 301 = 9·32 + 13,
# 301 = 4·64 + 45).
SMALL = Config(**TRITON_SMALL)
on_gpu = jax.default_backend() == "gpu"


def check(**kw):
  kw.setdefault("config", SMALL)
  return check_impl("pallas_triton", mode="lean", **kw)


def test_low_memory_vh_bf16_none():
  check(reduction="none", dtype=jnp.bfloat16, w_layout="vh", bias=True, options=OPTIONS["all"], seed=9,
        config=Config(block_t=16, block_v=32, block_k=16, vocab_chunk=64, low_memory=True, token_block=32,
                      dx_chunk=96))


@pytest.mark.parametrize(
    "config",
    [
        None,  # the heuristic: one tile holds the whole problem
        Config(block_t=16, block_v=16, block_k=16, num_splits=64, vocab_chunk=1000),  # splits > tiles; chunk > V
        Config(block_t=64, block_v=64, block_k=32, num_splits=1, vocab_chunk=16),  # B < block_t; one split
        Config(block_t=16, block_v=32, block_k=16, vocab_chunk=96, dx_kernel=True),  # dx by the in-place kernel
        # low memory: dx over token blocks of 16 (37 = 2·16 + 5) and vocabulary chunks of 128 (301 = 2·128 + 45)
        Config(block_t=16, block_v=32, block_k=16, vocab_chunk=64, low_memory=True, token_block=16, dx_chunk=128),
    ],
    ids=["heuristic", "many-splits", "one-split", "dx-kernel", "low-memory"],
)
def test_configs(config):
  check(config=config, options=OPTIONS["smoothing"], bias=True, seed=5)


def test_jit_and_checkpoint_agree():
  (x, w, y, _), (xn, wn, yn, _) = make_inputs(5, (4, 9), 20, 55, jnp.float32)
  f = lambda x, w: linear_cross_entropy(x, w, y, impl="pallas_triton", config=SMALL, z_loss=1e-3)
  l0, g0 = jax.value_and_grad(f, (0, 1))(x, w)
  ref = linear_cross_entropy_np(xn, wn, yn, z_loss=1e-3)  # the eager numbers are right, then the others agree
  assert rel_err(l0, ref["loss"]) < 2e-5 and rel_err(g0[0], ref["dx"]) < 2e-5 and rel_err(g0[1], ref["dw"]) < 2e-5
  l1, g1 = jax.jit(jax.value_and_grad(f, (0, 1)))(x, w)
  g2 = jax.jit(jax.grad(jax.checkpoint(f), (0, 1)))(x, w)
  assert np.allclose(l0, l1, rtol=1e-6)
  for a, b, c in zip(g0, g1, g2):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-7)


def test_supported():
  spec = common.Spec(_math.LossSpec(vocab_size=10))
  pallas_triton.supported(common.Spec(_math.LossSpec(vocab_size=10), interpret=True), "cpu")
  for dtype in (jnp.float16, jnp.bfloat16, jnp.float32):
    pallas_triton.supported(common.Spec(_math.LossSpec(vocab_size=10), interpret=True), "cpu", dtype)
  with pytest.raises(NotImplementedError, match="platform='cpu'"):
    base.check_supported("pallas_triton", spec, "cpu", jnp.float32)
  with pytest.raises(NotImplementedError, match="float16, bfloat16 and float32 .*int32"):
    pallas_triton.supported(spec, "gpu", jnp.int32)
  if not on_gpu:
    with pytest.raises(ValueError, match="pallas_triton"):
      linear_cross_entropy(jnp.ones((4, 8)), jnp.ones((8, 10)), jnp.zeros(4, int), impl="pallas_triton",
                           interpret=False)


def test_design_protocol():
  """design(): the resolved plan is what lean takes; no fast design; bad configs name the field or class."""
  spec = common.Spec(_math.LossSpec(vocab_size=128256))
  d = pallas_triton.design(8192, 4096, spec, jnp.bfloat16, "lean", None)
  assert (d.impl, d.mode, d.name) == ("pallas_triton", "lean", "recompute")
  assert d.config == op.plan(8192, 4096, 128256, jnp.bfloat16) and "chunks of 2048 columns" in d.chunking
  # dz (B·chunk·2) + float32 dx and XLA's product (2·B·H·4) + forward stats and bias sums (< 1 MiB)
  floor = 8192 * 2048 * 2 + 2 * 8192 * 4096 * 4
  assert floor <= d.memory_bytes <= floor + 2**20
  dk = pallas_triton.design(8192, 4096, spec, jnp.bfloat16, "lean", Config(dx_kernel=True))
  assert dk.memory_bytes == d.memory_bytes - 8192 * 4096 * 4
  low = pallas_triton.design(8192, 4096, spec, jnp.bfloat16, "lean", Config(low_memory=True))
  assert low.name == "recompute_low_memory" and low.memory_bytes < 64 * 2**20
  assert pallas_triton.design(0, 4096, spec, jnp.bfloat16, "lean", None).memory_bytes >= 0  # empty batch
  with pytest.raises(NotImplementedError, match="pallas_triton has no fast design"):
    pallas_triton.design(8192, 4096, spec, jnp.bfloat16, "fast", None)
  with pytest.raises(TypeError, match="pallas_triton"):
    pallas_triton.design(64, 64, spec, jnp.bfloat16, "lean", chunked.Config())
  for field, bad in (("vocab_chunk", 0), ("num_splits", -1), ("block_t", 2.0), ("num_warps", True)):
    with pytest.raises(ValueError, match=f"{field}={bad!r}"):
      pallas_triton.design(64, 64, spec, jnp.bfloat16, "lean", Config(**{field: bad}))


def test_plan_heuristic():
  p = op.plan(8192, 4096, 128256, jnp.bfloat16)
  assert (p.block_t, p.block_v, p.block_k, p.num_warps, p.dx_kernel) == (128, 256, 64, 8, False)
  assert p.vocab_chunk == 2048 and p.vocab_chunk % p.block_v == 0  # 32 MiB of bf16 dz at B=8192
  assert 64 * p.num_splits >= 132  # the forward grid covers the SMs
  p32 = op.plan(8192, 4096, 128256, jnp.float32)
  assert (p32.block_v, p32.block_k) == (128, 32)
  tiny = op.plan(5, 3, 7, jnp.float32)
  assert (tiny.block_t, tiny.block_v, tiny.block_k) == (16, 16, 16) and tiny.num_splits == 1
  assert op.plan(37, 24, 301, jnp.float32, Config(block_v=32, vocab_chunk=50)).vocab_chunk == 64
  low = op.plan(8192, 4096, 128256, jnp.bfloat16, Config(low_memory=True))
  assert low.dx_kernel and (low.token_block, low.dx_chunk) == (1024, 8192)  # 16 MiB f32 dx block, bf16 dz block
  with pytest.raises(ValueError, match="block_v=48"):
    op.plan(37, 24, 301, jnp.float32, Config(block_v=48))


# ------------------------------------------------------------------------------------------------ GPU, LLM shape


@pytest.mark.gpu(min_cc=(8, 0), long=True)
def test_llama3_8b_shape():
  check_llama3_8b("pallas_triton")

