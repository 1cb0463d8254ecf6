"""Where the "tokens" fast design's time goes at many tokens, piece by piece, against the plain head's products
(one GPU run; default llama3-8b at 32768 tokens in chunks of 4096).

Timed in alternation (median of ``--rounds`` rounds of 10 runs), each chunk piece as one jitted loop over all
chunks (so that a piece's time is comparable with the whole step's):

  plain_bf16     the plain head's step (bf16 logits, optax), gradients of x and w
  auto           the op's step (``impl="auto"``: the "tokens" design here)
  xla_fwd, xla_dx, xla_dw       XLA's three products over all tokens at once (bf16 out: the plain head's GEMMs)
  chunks_ref     each chunk's reference logits (the gather of 256 label columns of w and a [c, 256] product)
  chunks_fwd     each chunk's forward on our GEMM storing exp(zc - r) (statistics epilogue, approx exp)
  chunks_dx      XLA's dz·wᵀ of each chunk (float32 out, as the design runs it)
  chunks_dx_gemm the same on our GEMM
  chunks_dw_acc  XLA's xᵀ·dz of each chunk added into a carried float32 dw (cuBLAS beta = 1, as the design runs it)
  chunks_dw_f32  the same product without the add (float32 out, overwritten): the add's cost is the difference
  chunks_dw_addto  the same sum on our GEMM's ``AddTo`` epilogue

One JSON line per piece; ``--out`` gets ``results.json`` (device, versions, date, commit).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import optax
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lce_flax  # noqa: E402
from benchmarks.bench_gemm import interleaved, save_probe  # noqa: E402
from lce_flax import _math  # noqa: E402
from lce_flax._impl import common  # noqa: E402
from lce_flax._impl.pallas_mosaic import fast  # noqa: E402
from lce_flax._impl.pallas_mosaic import gemm as G  # noqa: E402

F32 = jnp.float32
DG = lax.dot_general


def _plain(x, w, y):
  def loss(x, w):
    z = jnp.dot(x, w)
    return optax.softmax_cross_entropy_with_integer_labels(z, y).sum(dtype=F32)
  return jax.grad(loss, (0, 1))(x, w)


def _auto(x, w, y):
  return jax.grad(lambda x, w: lce_flax.linear_cross_entropy(x, w, y, reduction="sum"), (0, 1))(x, w)


def pieces(b: int, h: int, v: int, chunk: int):
  """name -> (jitted fn, args) of every piece, on fresh inputs."""
  n = b // chunk
  k = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(k[0], (b, h), jnp.bfloat16)
  w = (0.02 * jax.random.normal(k[1], (h, v))).astype(jnp.bfloat16)
  y = jax.random.randint(k[2], (b,), 0, v)
  opts = _math.LossSpec(vocab_size=v)
  xs, ys = x.reshape(n, chunk, h), y.reshape(n, chunk)
  stats_opts = G.StatsOptions()
  ref1 = jax.jit(lambda x, w, y: fast._reference(x, w, None, y, "hv", opts, v))(xs[0], w, ys[0])
  fwd1 = jax.jit(lambda x, w, y, r: G.gemm(x, w, role="fwd_store", approx_math=True,
                                           epilogue=G.RowStats(y, stats_opts, store=True, ref=r))[1])
  e = fwd1(xs[0], w, ys[0], ref1)
  dz_full = jnp.tile(e, (n, 1))  # [B, V] for XLA's whole-batch products (values do not matter for time)
  z_full = jax.jit(jnp.dot)(x, w)

  def loop(f, init):
    return lambda *a: lax.fori_loop(0, n, lambda i, c: f(i, c, *a), init)

  def ref_step(i, c, xs, w, ys):
    return c + fast._reference(xs[i], w, None, ys[i], "hv", opts, v).sum()

  def fwd_step(i, c, xs, w, ys, r):
    st, e = G.gemm(xs[i], w, role="fwd_store", approx_math=True, epilogue=G.RowStats(ys[i], stats_opts, store=True,
                                                                                     ref=r))
    return c + st[..., 0].sum() + e[0, 0].astype(F32)

  def dx_step(i, c, e, w):
    return c + common.grad_x(e, w, "hv")[i]

  def dx_gemm_step(i, c, e, w):
    return c + G.gemm(e, w, transpose_b=True, epilogue=G.Store(F32), role="dx")[i]

  def dw_acc_step(i, c, xs, e):
    return c + common.grad_w(xs[i], e, "hv")

  def dw_f32_step(i, c, xs, e):
    return common.grad_w(xs[i], e, "hv") + c[0, 0] * 0  # overwritten each chunk (no carried add)

  def dw_addto_step(i, c, xs, e):
    return G.gemm(xs[i], e, transpose_a=True, epilogue=G.AddTo(c), role="dw_acc")

  dw0 = jnp.zeros((h, v), F32)
  zero = jnp.zeros((), F32)
  dxrow = jnp.zeros((h,), F32)
  return {
      "plain_bf16": (jax.jit(_plain), (x, w, y)),
      "auto": (jax.jit(_auto), (x, w, y)),
      "xla_fwd": (jax.jit(jnp.dot), (x, w)),
      "xla_dx": (jax.jit(lambda dz, w: DG(dz, w, (((1,), (1,)), ((), ())))), (dz_full, w)),
      "xla_dw": (jax.jit(lambda x, dz: DG(x, dz, (((0,), (0,)), ((), ())))), (x, z_full)),
      "chunks_ref": (jax.jit(loop(ref_step, zero)), (xs, w, ys)),
      "chunks_fwd": (jax.jit(loop(fwd_step, zero)), (xs, w, ys, ref1)),
      "chunks_dx": (jax.jit(loop(dx_step, dxrow)), (e, w)),
      "chunks_dx_gemm": (jax.jit(loop(dx_gemm_step, dxrow)), (e, w)),
      "chunks_dw_acc": (jax.jit(loop(dw_acc_step, dw0)), (xs, e)),
      "chunks_dw_f32": (jax.jit(loop(dw_f32_step, dw0)), (xs, e)),
      "chunks_dw_addto": (jax.jit(loop(dw_addto_step, dw0)), (xs, e)),
  }


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/tokens-parts-local"))
  ap.add_argument("--shape", default="32768,4096,128256", help="B,H,V")
  ap.add_argument("--chunk", type=int, default=4096)
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--only", default=None, help="comma-separated piece names (default: all)")
  args = ap.parse_args()
  b, h, v = (int(t) for t in args.shape.split(","))
  fns = pieces(b, h, v, args.chunk)
  if args.only:
    fns = {k: fns[k] for k in args.only.split(",")}
  ms = interleaved(fns, args.rounds)
  rows = []
  for name, t in ms.items():
    row = dict(B=b, H=h, V=v, chunk=args.chunk, piece=name, ms=round(t, 3))
    rows.append(row)
    print(json.dumps(row), flush=True)
  save_probe(args.out, rows, args.rounds)


if __name__ == "__main__":
  main()
