"""``impl="triton"`` (raw Triton kernels through jax-triton).

Raw Triton kernels only run on an NVIDIA GPU: on CPU these tests check the error path (a clear
``NotImplementedError`` from ``supported``, so ``impl="auto"`` skips the backend and ``impl="triton"`` fails
naming the reason) and the plan. The ``gpu``-marked tests run the compiled kernels against the float64 oracle at
small ragged shapes (every option, both layouts, bf16/fp16/fp32) and at the llama3-8b shape (``pytest -m gpu``).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lce_flax import _device, _math, api, linear_cross_entropy
from lce_flax._impl import base, chunked, common
from lce_flax._impl import triton as triton_backend
from lce_flax._impl.pallas_triton import op as pallas_triton_op
from lce_flax._impl.triton import Config, kernels, op
from tests._checks import OPTIONS, TRITON_SMALL, check_impl, check_llama3_8b

on_gpu = jax.default_backend() == "gpu"


# 16-token, 32-column, 16-deep tiles; 3 forward splits; backward chunks of 64 columns: at B=37, H=24, V=301 every
# loop runs several times and ends on a ragged tile (as in test_pallas_triton).
SMALL = Config(**TRITON_SMALL)


# ------------------------------------------------------------------------------------------------ CPU: error path


def test_supported_says_why_not_on_cpu():
  spec = common.Spec(_math.LossSpec(vocab_size=10))
  with pytest.raises(NotImplementedError, match=r"impl='triton' .*NVIDIA GPU \(platform='cpu'"):
    base.check_supported("triton", spec, "cpu", jnp.float32)
  with pytest.raises(NotImplementedError, match="no interpret mode"):
    base.check_supported("triton", common.Spec(_math.LossSpec(vocab_size=10), interpret=True), "gpu", jnp.float32)


def test_supported_without_jax_triton_names_the_package(monkeypatch):
  monkeypatch.setitem(sys.modules, "jax_triton", None)  # `import jax_triton` raises ImportError
  monkeypatch.setattr(kernels, "triton", object())  # as if triton itself were installed
  with pytest.raises(NotImplementedError, match=r"jax-triton package .*lce_flax\[gpu\]"):
    triton_backend.supported(common.Spec(_math.LossSpec(vocab_size=10), interpret=False), "gpu")


@pytest.mark.skipif(on_gpu, reason="checks the CPU error path")
def test_op_fails_clearly_and_auto_skips_it():
  args = (jnp.ones((4, 8)), jnp.ones((8, 10)), jnp.zeros(4, int))
  for kw in ({}, {"vocab_chunk": 4}, {"interpret": False}):
    with pytest.raises(ValueError, match=r"impl='triton' cannot run here \(triton: impl='triton' runs raw Triton"):
      linear_cross_entropy(*args, impl="triton", **kw)
  assert "triton" not in api.available_implementations()
  assert np.isfinite(float(linear_cross_entropy(*args, impl="auto")))


@pytest.mark.parametrize("cc", [(7, 5), (8, 0), (9, 0), (10, 0)])
def test_auto_never_picks_raw_triton(monkeypatch, cc):
  # pallas_triton is as fast or faster where measured (docs/kernels.md)
  monkeypatch.setattr(_device, "platform", lambda: "gpu")
  monkeypatch.setattr(_device, "compute_capability", lambda: cc)
  assert "triton" not in base.auto_order()


def test_plan_uses_pallas_triton_tiles(monkeypatch):
  p = op.plan(8192, 4096, 128256, jnp.bfloat16)
  q = pallas_triton_op.plan(8192, 4096, 128256, jnp.bfloat16)
  assert (p.block_t, p.block_v, p.block_k, p.num_splits, p.vocab_chunk, p.num_warps, p.group_t) == (
      q.block_t, q.block_v, q.block_k, q.num_splits, q.vocab_chunk, q.num_warps, q.group_t)
  assert not p.dx_kernel and not p.low_memory and p.num_stages == p.bwd_num_stages == 3
  assert p.input_precision == "tf32"
  with jax.default_matmul_precision("highest"):
    assert op.plan(37, 24, 301, jnp.float32, SMALL).input_precision == "ieee"
  s = op.plan(37, 24, 301, jnp.float32, Config(block_v=32, vocab_chunk=50, bwd_num_stages=2))
  assert (s.block_v, s.vocab_chunk, s.bwd_num_stages) == (32, 64, 2)
  low = op.plan(8192, 4096, 128256, jnp.bfloat16, Config(low_memory=True))
  assert low == op.Plan(**{**vars(pallas_triton_op.plan(8192, 4096, 128256, jnp.bfloat16, Config(
      low_memory=True))), "num_stages": 3}, bwd_num_stages=3, input_precision="tf32")
  with pytest.raises(ValueError, match="block_v=48"):
    op.plan(37, 24, 301, jnp.float32, Config(block_v=48))
  with pytest.raises(ValueError, match="bwd_num_stages=0"):
    op.plan(37, 24, 301, jnp.float32, Config(bwd_num_stages=0))


def test_design_protocol():
  """design() runs on any machine (supported() is what needs the GPU): pallas_triton's recompute design with
  this backend's plan, no fast design, its own Config class only."""
  spec = common.Spec(_math.LossSpec(vocab_size=128256))
  d = triton_backend.design(8192, 4096, spec, jnp.bfloat16, "lean", None)
  ref = pallas_triton_op.design(8192, 4096, spec, jnp.bfloat16, "lean", None)
  assert (d.impl, d.name, d.memory_bytes) == ("triton", "recompute", ref.memory_bytes)
  assert d.config == op.plan(8192, 4096, 128256, jnp.bfloat16)
  assert triton_backend.design(0, 4096, spec, jnp.bfloat16, "lean", None).memory_bytes >= 0  # empty batch
  with pytest.raises(NotImplementedError, match="triton has no fast design"):
    triton_backend.design(64, 64, spec, jnp.bfloat16, "fast", None)
  for other in (chunked.Config(), pallas_triton_op.Config()):
    with pytest.raises(TypeError, match="triton"):
      triton_backend.design(64, 64, spec, jnp.bfloat16, "lean", other)
  with pytest.raises(TypeError, match="pallas_triton"):
    pallas_triton_op.design(64, 64, spec, jnp.bfloat16, "lean", Config())
  with pytest.raises(NotImplementedError, match="int32"):
    triton_backend.supported(spec, "gpu", jnp.int32)


# ------------------------------------------------------------------------------------------------ GPU


def check(**kw):
  kw.setdefault("config", SMALL)
  kw.setdefault("interpret", False)
  dtype = kw.get("dtype", jnp.float32)
  if dtype == jnp.float32:  # exact float32 products, as the oracle's tolerance assumes (default would be TF32)
    with jax.default_matmul_precision("highest"):
      return check_impl("triton", mode="lean", **kw)
  return check_impl("triton", mode="lean", **kw)


@pytest.mark.gpu(min_cc=(8, 0), needs="jax_triton")
@pytest.mark.parametrize("config", [
    None, Config(block_t=16, block_v=16, block_k=16, num_splits=64, vocab_chunk=1000),
    Config(block_t=16, block_v=32, block_k=16, vocab_chunk=64, low_memory=True, token_block=48, dx_chunk=128)],
    ids=["heuristic", "many-splits", "low-memory"])
def test_configs_ragged(config):
  check(config=config, batch_shape=(1037,), h=200, v=5003, dtype=jnp.bfloat16, options=OPTIONS["smoothing"],
        bias=True, seed=5)


@pytest.mark.gpu(min_cc=(8, 0), needs="jax_triton", long=True)
def test_llama3_8b_shape():
  check_llama3_8b("triton")
