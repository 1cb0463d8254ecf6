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
  token_cotangents: bool = False  # its fast design forms dz in its backward: mode='fast' takes reduction='none'

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
                                         True, (("h", 128), ("batch_shape", (101,))), token_cotangents=True),
    "pallas_mosaic:fast_tokens": Variant("pallas_mosaic", "fast",
                                         lce_flax.PallasMosaicConfig(**_MOSAIC_SMALL, fast_design="tokens",
                                                                     token_chunk=64),
                                         True, (("h", 128), ("batch_shape", (101,)))),
    # V a multiple of 128: the forward on the persistent GEMM (gemm.py), the products on it (or on XLA)
    "pallas_mosaic:fast_logits_gemm": Variant("pallas_mosaic", "fast",
                                              lce_flax.PallasMosaicConfig(**_MOSAIC_SMALL, fast_design="logits",
                                                                          gemm=True),
                                              True, (("h", 128), ("v", 384), ("batch_shape", (101,))),
                                              token_cotangents=True),
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
  """(variant, case) pairs that can run: ``reduction="none"`` takes per-token cotangents, which ``mode="fast"`` runs
  only on a fast design that forms dz in its backward (``Variant.token_cotangents``); the others refuse it
  (``test_fast_refuses_per_token_cotangents``), so those pairs are not generated rather than skipped. ``impl="triton"``
  pairs also need the jax_triton package (``gpu(needs=...)``, as the triton kernel tests)."""
  return [pytest.param(n, c, marks=[pytest.mark.gpu(needs="jax_triton")] if VARIANTS[n].impl == "triton" else [])
          for n in names for c in CASES
          if not (CASES[c][2] == "none" and VARIANTS[n].mode == "fast" and not VARIANTS[n].token_cotangents)]


CPU_VARIANTS = [n for n, v in VARIANTS.items() if not v.gpu_only]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(("name", "case"), _pairs(CPU_VARIANTS))
def test_against_oracle(name, case, dtype):
  _run(name, case, dtype)


@pytest.mark.parametrize("name", [n for n in CPU_VARIANTS if VARIANTS[n].mode == "fast"
                                  and not VARIANTS[n].token_cotangents])
def test_fast_refuses_per_token_cotangents(name):
  """mode='fast' with reduction='none' on a fast design that forms the gradients in its forward (one scalar
  cotangent): a ValueError at trace time naming the impl, never a silent lean run."""
  v = VARIANTS[name]
  args = (jnp.ones((4, 128), jnp.bfloat16), jnp.ones((128, 256), jnp.bfloat16), jnp.zeros(4, jnp.int32))
  f = lambda x, w, y: lce_flax.linear_cross_entropy(x, w, y, impl=v.impl, mode=v.mode, reduction="none",
                                                    config=v.config)
  with pytest.raises(ValueError, match=rf"mode='fast' with reduction='none' needs a fast design that takes "
                                       rf"per-token cotangents, and impl='{v.impl}' has none here: .*mode='lean'"):
    jax.jit(f).trace(*args)


@pytest.mark.parametrize("case", ["default_logits", "default_tokens"])
def test_fast_mode_per_token_losses_run_the_logits_design(case):
  """mode='fast', reduction='none', impl='pallas_mosaic' (interpret mode, bf16): the 'logits' fast design runs,
  also where the sizes' default fast design is 'tokens' (B=300, H=64: the per-token design is picked, as with
  mode=None), and explain() says so; the per-token losses, aux and the vjp of a random float32 [B] cotangent
  (dx, dw, dbias) equal the float64 oracle's, with ragged B, ignored and masked tokens and a bias. The first case
  stores shifted logits (label smoothing: a dz pass), the second the exponentials (V=384: the GEMM forward)."""
  from lce_flax import explain

  batch, h, v, w_layout, options, cfg = {
      "default_logits": ((101,), 128, 301, "hv", OPTIONS["all"], _MOSAIC_SMALL),
      "default_tokens": ((300,), 64, 384, "vh", dict(z_loss=1e-3, logit_softcap=5.0), dict(_MOSAIC_SMALL, block_t=128)),
  }[case]
  config = lce_flax.PallasMosaicConfig(**cfg)
  sds = jax.ShapeDtypeStruct
  x, w = sds((*batch, h), jnp.bfloat16), sds((h, v) if w_layout == "hv" else (v, h), jnp.bfloat16)
  kw = dict(interpret=True, config=config, w_layout=w_layout)
  default = explain(x, w, impl="pallas_mosaic", mode="fast", **kw).name
  assert default == case.removeprefix("default_")
  d = explain(x, w, impl="pallas_mosaic", mode="fast", reduction="none", **kw, **options)
  assert (d.impl, d.mode, d.name) == ("pallas_mosaic", "fast", "logits") and d.config.token_cotangents
  note = [n for n in d.notes if n.startswith("mode='fast', reduction='none': the 'logits' fast design forms dz")]
  assert len(note) == 1 and ("the default fast design of these sizes takes none" in note[0]) == (default == "tokens")
  check_impl("pallas_mosaic", seed=200 + len(case), batch_shape=batch, h=h, v=v, dtype=jnp.bfloat16, bias=True,
             where=True, reduction="none", options=options, mode="fast", **kw)


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
