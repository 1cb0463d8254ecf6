"""``impl="triton"``: the op as raw Triton kernels (``triton.jit``) called through jax-triton, NVIDIA SM80+.

The same design as ``impl="pallas_triton"`` (:mod:`lce_flax._impl.pallas_triton.op`), written directly in Triton
instead of being lowered from Pallas; only the two kernels differ (:mod:`lce_flax._impl.triton.kernels`),
everything around them is shared. This file holds the configuration, the plan, and the backend protocol of
:mod:`lce_flax._impl.base` (:func:`supported`, :func:`design`, :func:`stats`, :func:`grads`; there is no fast
design).

Forward (``_fwd_kernel``)
  A 1-D grid of ``row_blocks × num_splits`` programs, split-fastest (``pid = i·S + j``). Program ``(i, j)`` walks
  the ``j``-th contiguous split of the vocabulary tiles for the ``block_t`` tokens of row block ``i``; each
  ``[block_t, block_v]`` tile of logits is accumulated in float32 registers over H in ``block_k`` steps
  (``tl.dot``: WGMMA on Hopper, its operands brought into shared memory by the software pipeline), gets its bias
  and soft cap, and is reduced on chip to the row statistics of :func:`lce_flax._math.tile_stats`, merged into the
  running ones as :func:`lce_flax._math.merge_stats` does (online logsumexp). 4 float32 per token and split leave
  the chip; JAX merges the splits and finalises (:func:`lce_flax._impl.common.merge_splits`).

Backward (``_dz_kernel`` inside :func:`lce_flax._impl.pallas_triton.op.grads_with`)
  The recompute backward of ``pallas_triton`` with this backend's launchers: per vocabulary chunk the
  dz kernel recomputes the chunk's logits tile by tile (grouped tile order for L2 reuse) and writes the logit
  gradient of :func:`lce_flax._math.dlogits` in the input dtype (and per row block column sums for dbias); XLA
  matmuls then write the chunk's dw columns and add into a float32 dx. ``Config(dx_kernel=True)`` and
  ``Config(low_memory=True)`` are ``pallas_triton``'s variants with this backend's dz kernel (their in-place dx
  accumulation is ``pallas_triton``'s Pallas kernel). Extra memory: as ``pallas_triton``'s
  (:func:`lce_flax._impl.pallas_triton.op.lean_design`).

Precision: float32 accumulation everywhere. bf16/fp16 inputs multiply on the tensor cores. Float32 inputs follow
``jax.default_matmul_precision`` like ``pallas_triton``: TF32 by default, exact IEEE float32 products (FMA, slow)
under ``"highest"``/``"float32"`` (read when :func:`design` runs, i.e. at trace time).

Needs ``jax_triton`` (the ``[gpu]`` extra) and a CUDA GPU (SM80+, no interpret mode: the registry of
:mod:`lce_flax._impl.base` checks the GPU); elsewhere ``NotImplementedError`` names what is missing, so
``impl="auto"`` skips this backend.
"""

from __future__ import annotations

import dataclasses

import jax

from lce_flax import _math
from lce_flax._impl import common
from lce_flax._impl.pallas_triton import op as pt
from lce_flax._impl.triton import kernels


@dataclasses.dataclass(frozen=True)
class Config(pt.ConfigFields):
  """Configuration of ``impl="triton"`` (``lce_flax.TritonConfig``): ``pallas_triton``'s fields and heuristic
  (:func:`lce_flax._impl.pallas_triton.op.plan`, including ``dx_kernel`` and ``low_memory``, whose backward is
  shared), plus:

  Attributes:
    bwd_num_stages: pipelining stages of the backward dz kernel (default: ``num_stages``, itself 3 here).
  """

  bwd_num_stages: int | None = None


@dataclasses.dataclass(frozen=True)
class Plan(pt.Plan):
  """A resolved :class:`Config` (hashable; ``Design.config``): ``pallas_triton``'s plan plus the raw kernels'
  own fields."""

  bwd_num_stages: int = 3
  input_precision: str = "tf32"  # tl.dot's for float32 inputs: "tf32" or "ieee"


def _input_precision() -> str:
  prec = jax.config.jax_default_matmul_precision
  return "ieee" if prec is not None and str(prec).lower() in ("highest", "float32") else "tf32"


def plan(num_tokens: int, hidden: int, vocab: int, dtype, config: Config | None = None) -> Plan:
  """Block sizes for one shape: ``pallas_triton``'s heuristic (the same tiles) but 3 pipeline stages, any
  ``config`` field first."""
  c = config or Config()
  common.check_positive(c, ("bwd_num_stages",))
  base = pt.plan(num_tokens, hidden, vocab, dtype, c)
  # 3 stages on every GPU: on an H100 (llama3-8b) 3 stages beat pallas_triton's SM90 default of 4 by 0.9 ms in
  # the forward and 0.5 ms in the dz kernels.
  stages = c.num_stages or 3
  fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
  return Plan(**dict(fields, num_stages=stages), bwd_num_stages=c.bwd_num_stages or stages,
              input_precision=_input_precision())


def supported(spec: common.Spec, platform: str, dtype=None) -> None:
  """Raises ``NotImplementedError`` for a dtype the kernels do not take or a missing package (triton,
  jax-triton); the GPU they need is checked by the registry (:func:`lce_flax._impl.base.check_supported`)."""
  del spec, platform
  pt.check_dtype("impl='triton'", dtype)
  if kernels.triton is None:
    raise NotImplementedError(f"impl='triton' needs the triton package: {kernels.TRITON_IMPORT_ERROR}")
  kernels.jax_triton()


def design(num_tokens: int, hidden: int, spec: common.Spec, dtype, mode: str, config: Config | None = None
           ) -> common.Design:
  """``pallas_triton``'s recompute design (:func:`lce_flax._impl.pallas_triton.op.lean_design`) with this
  backend's :class:`Plan`; ``mode="fast"`` raises ``NotImplementedError``."""
  common.check_config(config, Config, "triton")
  pt.check_mode("triton", mode)
  pt.check_dtype("impl='triton'", dtype)
  p = plan(num_tokens, hidden, spec.opts.vocab_size, dtype, config)
  return pt.lean_design("triton", p, num_tokens, hidden, spec.opts.vocab_size, dtype)


def stats(x, w, bias, labels, spec: common.Spec, plan: Plan) -> _math.RowStats:
  """The forward kernel's row statistics of the columns of ``w``."""
  return kernels.KERNELS.forward(x, w, bias, labels, spec, plan)


def grads(x, w, bias, labels, lse, g_loss, g_lse, spec: common.Spec, plan: Plan):
  """The recompute backward for the given lse: (dx float32, dw, dbias float32)."""
  return pt.grads_with(kernels.KERNELS, x, w, bias, labels, lse, g_loss, g_lse, spec, plan)
