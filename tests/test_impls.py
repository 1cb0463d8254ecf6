"""The one suite every implementation runs against the float64 oracle (``tests/reference_np.py``).

Each variant is an implementation with a design and a small config (several tiles, chunks and splits, every loop
ending ragged); each case is a set of options, a dtype, a layout and a reduction. On CPU the Pallas kernels run in
interpret mode; on a GPU (``pytest -m gpu``) the ``gpu``-marked copy runs the same cases compiled, raw Triton
included. Implementation-specific tests (plans, epilogues, CUDA lowering, config errors) live beside their backend's
tests; this file is where an option, a dtype or a reduction is checked for all of them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import lce_flax
from tests._checks import (
  MOSAIC_SMALL,
  OPTIONS,
  TRITON_SMALL,
  check_bad_and_ignored_labels,
  check_impl,
  check_lse_cotangent,
)

_MOSAIC_SMALL = dict(MOSAIC_SMALL, warp_specialized=False, vocab_chunk=None)  # one warpgroup on a GPU too


@dataclasses.dataclass(frozen=True)
class Variant:
  impl: str
  mode: str | None
  config: object = None
  low_precision_only: bool = False  # Mosaic's WGMMA takes bf16/fp16 only
  sizes: tuple = ()  # check_impl's h and batch_shape where the tiles need them
  gpu_only: bool = False

  def kwargs(self):
    kw = dict(mode=self.mode, config=self.config)
    kw.update(self.sizes)
    return kw


VARIANTS = {
    "xla": Variant("xla", None),
    "chunked:fast": Variant("chunked", "fast", lce_flax.ChunkedConfig(token_chunk=8)),
    "chunked:lean": Variant("chunked", "lean", lce_flax.ChunkedConfig(vocab_chunk=64)),
    "pallas_triton:lean": Variant("pallas_triton", "lean", lce_flax.PallasTritonConfig(**TRITON_SMALL)),
    "pallas_triton:low_memory": Variant(
        "pallas_triton", "lean",
        lce_flax.PallasTritonConfig(**TRITON_SMALL, low_memory=True, token_block=32, dx_chunk=64)),
    "pallas_mosaic:lean": Variant("pallas_mosaic", "lean",
                                  lce_flax.PallasMosaicConfig(**dict(_MOSAIC_SMALL, vocab_chunk=128)),
                                  True, (("h", 128), ("batch_shape", (101,)))),
    "pallas_mosaic:fast_logits": Variant("pallas_mosaic", "fast",
                                         lce_flax.PallasMosaicConfig(**_MOSAIC_SMALL, fast_design="logits"),
                                         True, (("h", 128), ("batch_shape", (101,)))),
    "pallas_mosaic:fast_tokens": Variant("pallas_mosaic", "fast",
                                         lce_flax.PallasMosaicConfig(**_MOSAIC_SMALL, fast_design="tokens",
                                                                     token_chunk=64),
                                         True, (("h", 128), ("batch_shape", (101,)))),
    # V a multiple of 128: the forward on the persistent GEMM (gemm.py), the products on it (or on XLA)
    "pallas_mosaic:fast_logits_gemm": Variant("pallas_mosaic", "fast",
                                              lce_flax.PallasMosaicConfig(**_MOSAIC_SMALL, fast_design="logits",
                                                                          gemm=True),
                                              True, (("h", 128), ("v", 384), ("batch_shape", (101,)))),
    "pallas_mosaic:fast_tokens_gemm": Variant("pallas_mosaic", "fast",
                                              lce_flax.PallasMosaicConfig(**_MOSAIC_SMALL, fast_design="tokens",
                                                                          token_chunk=64, gemm=True,
                                                                          products="gemm"),
                                              True, (("h", 192), ("v", 256), ("batch_shape", (101,)))),
    # mode=None: the "logits" design (dz formed in the backward) for every reduction, "none" included
    "pallas_mosaic:auto_mode_logits": Variant("pallas_mosaic", None,
                                              lce_flax.PallasMosaicConfig(**_MOSAIC_SMALL, fast_design="logits"),
                                              True, (("h", 128), ("v", 384), ("batch_shape", (101,)))),
    "triton:lean": Variant("triton", "lean", lce_flax.TritonConfig(**TRITON_SMALL), gpu_only=True),
}

# (options, w_layout, reduction, bias, where, batch_shape or None)
CASES = {
    "all_options": (OPTIONS["all"], "hv", "mean", True, True, None),
    "softcap_vh_sum": (OPTIONS["softcap"], "vh", "sum", False, False, None),
    "per_token_cotangent": (OPTIONS["z_loss"], "hv", "none", True, True, None),
    "plain_leading_dims": (OPTIONS["plain"], "vh", "mean", False, False, (3, 13)),
}


def _run(name, case, dtype):
  v = VARIANTS[name]
  options, w_layout, reduction, bias, where, batch = CASES[case]
  if v.low_precision_only and dtype == jnp.float32:
    dtype = jnp.float16  # float32 is refused by design (tests/test_pallas_mosaic.py checks the error)
  kw = v.kwargs()
  if batch is not None and not v.sizes:
    kw["batch_shape"] = batch
  seed = list(VARIANTS).index(name) * 16 + list(CASES).index(case) * 2 + (dtype == jnp.float32)
  check_impl(v.impl, seed=seed, dtype=dtype, options=options, w_layout=w_layout, reduction=reduction, bias=bias,
             where=where, **kw)


def _pairs(names):
  """(variant, case) pairs that can run: ``reduction="none"`` takes per-token cotangents, which fast designs refuse
  (``test_fast_refuses_per_token_cotangents``), so those pairs are not generated rather than skipped."""
  return [(n, c) for n in names for c in CASES if not (CASES[c][2] == "none" and VARIANTS[n].mode == "fast")]


CPU_VARIANTS = [n for n, v in VARIANTS.items() if not v.gpu_only]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(("name", "case"), _pairs(CPU_VARIANTS))
def test_against_oracle(name, case, dtype):
  _run(name, case, dtype)


@pytest.mark.parametrize("name", [n for n in CPU_VARIANTS if VARIANTS[n].mode == "fast"])
def test_fast_refuses_per_token_cotangents(name):
  v = VARIANTS[name]
  with pytest.raises(ValueError, match="reduction='none' needs per-token cotangents"):
    lce_flax.linear_cross_entropy(jnp.ones((4, 128), jnp.bfloat16), jnp.ones((128, 256), jnp.bfloat16),
                                  jnp.zeros(4, jnp.int32), impl=v.impl, mode=v.mode, reduction="none",
                                  config=v.config)


@pytest.mark.parametrize("name", [n for n in CPU_VARIANTS if VARIANTS[n].mode != "fast"])
def test_lse_cotangent_and_bad_labels(name):
  """Cotangents on the aux lse reach x; an out-of-range label is NaN for its token only; all-ignored is zero."""
  v = VARIANTS[name]
  dtype = jnp.bfloat16 if v.low_precision_only else jnp.float32
  tol = 2e-2 if v.low_precision_only else 1e-5
  h = dict(v.sizes).get("h", 40)
  check_lse_cotangent(v.impl, h=h, dtype=dtype, tol=tol, config=v.config)
  check_bad_and_ignored_labels(v.impl, h=dict(v.sizes).get("h", 16), dtype=dtype, config=v.config)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(("name", "case"), _pairs(VARIANTS))
def test_against_oracle_compiled(name, case, dtype):
  with jax.default_matmul_precision("highest"):
    _run(name, case, dtype)
