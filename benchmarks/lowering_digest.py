"""Digests of the CUDA lowering of the project's GPU kernels, to show that a change leaves them as they were.

    python3 -m benchmarks.lowering_digest [--out FILE.json]              # on CPU: lowers, prints name -> digest
    python3 -m benchmarks.lowering_digest --against FILE.json            # exit 1 if any digest differs

Each entry lowers one call for CUDA on this machine (no GPU needed): the op's forward and backward in each of
``pallas_mosaic``'s designs (the "logits" and "tokens" fast designs, lean mode with its chunk products on XLA and
on the GEMM) at a small head with a soft cap, z-loss and a bias, and the GEMM's own schedules with their windows. The
text is XLA's StableHLO with the Mosaic GPU modules inside it; source locations are left out (JAX's user frame is
blanked while lowering), so moving code between lines changes no digest and a changed kernel changes its own.
Run it before and after a change (``--out`` then ``--against``, each a process of its own: Mosaic GPU numbers the
kernels it lowers within a process, so a second lowering in one process names them differently): equal digests
mean the change lowers every kernel here to the same program, so the GPU check of the earlier commit stands for
these kernels.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lce_flax import _math  # noqa: E402
from lce_flax._impl.pallas_mosaic import Config, tuning  # noqa: E402
from lce_flax._impl.pallas_mosaic import gemm as G  # noqa: E402

SDS = jax.ShapeDtypeStruct
BF = jnp.bfloat16


def _op_cases() -> dict:
  """The op's gradient of x and w per design (through its backend calls, as the CPU tests lower them: the public
  op refuses kernels on a machine without a GPU): B = 1000, H = 512, V = 5120, a soft cap, z-loss and a bias; the
  fast designs store exponentials (the shifted logits' dz pass is a Pallas Triton kernel, which lowers only on a
  GPU)."""
  from lce_flax._impl import (  # noqa: PLC0415
    base,
    common,
    pallas_mosaic,  # noqa: PLC0415
  )

  b, h, v = 1000, 512, 5120
  spec = common.Spec(_math.LossSpec(vocab_size=v, logit_softcap=30.0, z_loss=1e-4), "hv", interpret=False)
  args = (SDS((b, h), BF), SDS((h, v), BF), SDS((v,), jnp.float32), SDS((b,), jnp.int32))
  designs = {"fast_logits": ("fast", Config(fast_design="logits")),
             "fast_tokens": ("fast", Config(fast_design="tokens", token_chunk=256)),
             "lean_xla": ("lean", Config(products="xla", vocab_chunk=1536)),
             "lean_gemm": ("lean", Config(products="gemm", vocab_chunk=1536))}
  out = {}
  for name, (mode, cfg) in designs.items():
    plan = pallas_mosaic.design(b, h, spec, BF, mode, cfg).config

    def f(x, w, bias, y, mode=mode, plan=plan):
      if mode == "lean":
        return base.lean(x, w, bias, y, spec, pallas_mosaic, plan).loss.sum()
      primals = base.Primals(x.shape, w.shape, bias.dtype)
      return base.fast(x, w, bias, y, jnp.ones((b,), jnp.float32), spec, pallas_mosaic, plan, (), primals)[0]
    out[name] = (jax.grad(f, (0, 1, 2)), *args)
  return out


def _gemm_cases() -> dict:
  """The GEMM's schedules (cooperative with a cluster, ping-pong) and its windows on B and on an ``AddTo``'s C."""
  m, k, n = 1000, 576, 1024
  vec, y = SDS((m,), jnp.float32), SDS((m,), jnp.int32)
  spec = _math.LossSpec(vocab_size=4096)
  cfg = G.GemmConfig(wg_split="m", cluster="n")
  s = SDS((), jnp.int32)
  return {
      "gemm_store": (lambda a, b: G.gemm(a, b, config=cfg), SDS((m, k), BF), SDS((k, n), BF)),
      "gemm_pingpong_ws": (lambda a, b: G.gemm(a, b, config=dataclasses.replace(tuning.PINGPONG_WS, cluster="n")),
                           SDS((m, k), BF), SDS((k, n), BF)),
      "gemm_fwd_store": (lambda a, b, y: G.gemm(a, b, epilogue=G.RowStats(y, store=True), approx_math=True,
                                                config=tuning.fit_role("fwd_store", cfg)),
                         SDS((m, k), BF), SDS((k, 2176), BF), y),
      "gemm_lean_dz_window": (lambda a, b, l, y, s: G.gemm(a, b, epilogue=G.LogitGrad(l, l, l, l, y, spec),
                                                           b_window=G.Window(s, n, 1, 64),
                                                           config=tuning.fit_role("lean_dz", cfg)),
                              SDS((m, k), BF), SDS((k, 4096), BF), vec, y, s),
      "gemm_dx_acc_window": (lambda z, w, c, s: G.gemm(z, w, transpose_b=True, epilogue=G.AddTo(c),
                                                       b_window=G.Window(s, 1024, 1, 64),
                                                       config=tuning.fit_role("dx_acc", cfg)),
                             SDS((m, 1024), BF), SDS((k, 4096), BF), SDS((m, k), jnp.float32), s),
      "gemm_dw_window": (lambda a, z, dw, s: G.gemm(a, z, transpose_a=True,
                                                    epilogue=G.AddTo(dw, window=G.Window(s, 1024, 0, 64)), config=cfg),
                         SDS((m, 1024), BF), SDS((m, k), BF), SDS((4096, k), BF), s),
  }


def digests() -> dict[str, str]:
  """name -> sha256 (16 hex digits) of each case's CUDA lowering, without source locations."""
  from jax._src import source_info_util  # noqa: PLC0415  (JAX's own: blanking its user frame drops the locations)

  user_frame = source_info_util.user_frame
  source_info_util.user_frame = lambda *a, **k: None
  try:
    out = {}
    for name, (f, *args) in {**_op_cases(), **_gemm_cases()}.items():
      text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text(debug_info=False)
      out[name] = hashlib.sha256(text.encode()).hexdigest()[:16]
    return out
  finally:
    source_info_util.user_frame = user_frame


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", help="write the digests to this JSON file")
  ap.add_argument("--against", help="a JSON file of earlier digests: exit 1 if any differs")
  a = ap.parse_args(argv)
  got = digests()
  for name, d in got.items():
    print(f"{name:24s} {d}")
  if a.out:
    with open(a.out, "w") as f:
      json.dump({"jax": jax.__version__, "digests": got}, f, indent=1)
  if a.against:
    with open(a.against) as f:
      old = json.load(f)["digests"]
    changed = sorted(k for k in got.keys() | old.keys() if got.get(k) != old.get(k))
    print("changed: " + (", ".join(changed) if changed else "none"))
    return 1 if changed else 0
  return 0


if __name__ == "__main__":
  sys.exit(main())
