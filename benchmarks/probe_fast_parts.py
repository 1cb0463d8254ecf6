"""Where the fast design's time goes, piece by piece, with the stored tiles as exponentials or as shifted logits
(one GPU run; ``PallasMosaicConfig(stored=...)``).

At each shape it times, in alternation (median of ``--rounds`` rounds of 10 runs):

  ref            each row's reference logit (the gather of the label columns of w and B dot products)
  fwd_shifted    the forward GEMM storing shifted logits (statistics epilogue, approx exp)
  fwd_exp        the forward GEMM storing exp(zc - r)
  patch          writing B label entries into the stored [B, V] tiles (in place: the tiles are donated)
  step_shifted   the op's forward + backward (gradients of x and w), stored="shifted"
  step_exp       the same, stored="exponentials" (the default where it applies)
  repair_none    the repair of rows past the exponentials' range (:func:`.fast._repair`, in place) with no row unit
                 flagged: what every backward pays for the check
  repair_all     the same with every row unit flagged (the whole dz recomputed: a bound, never the common case)
  plain_bf16     the plain head (bf16 logits, optax's softmax cross-entropy), for scale

with each step's compiled temporary bytes. One JSON line per measurement; ``--out`` gets ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lce_flax  # noqa: E402
from benchmarks.bench_gemm import SHAPES, interleaved, save_probe  # noqa: E402
from lce_flax import _math  # noqa: E402
from lce_flax._impl.pallas_mosaic import fast  # noqa: E402
from lce_flax._impl.pallas_mosaic import gemm as G  # noqa: E402


def step(stored):
  cfg = lce_flax.PallasMosaicConfig(stored=stored)

  def loss(x, w, y):
    return lce_flax.linear_cross_entropy(x, w, y, impl="pallas_mosaic", mode="fast", reduction="sum", config=cfg)

  return jax.jit(jax.grad(loss, (0, 1)))


def plain(x, w, y):
  def loss(x, w):
    z = jnp.dot(x, w)
    return optax.softmax_cross_entropy_with_integer_labels(z, y).sum()
  return jax.grad(loss, (0, 1))(x, w)


def measure(name: str, rounds: int) -> list[dict]:
  """The rows of one shape."""
  rows = []
  opts = G.StatsOptions()
  b, h, v = SHAPES[name]
  k = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(k[0], (b, h), jnp.bfloat16)
  w = (0.02 * jax.random.normal(k[1], (h, v))).astype(jnp.bfloat16)
  y = jax.random.randint(k[2], (b,), 0, v)
  spec_opts = _math.LossSpec(vocab_size=v)
  ref = jax.jit(lambda x, w, y: fast._reference(x, w, None, y, "hv", spec_opts, v))
  r = ref(x, w, y)
  fwd_shifted = jax.jit(lambda x, w, y: G.gemm(x, w, role="fwd_store", approx_math=True,
                                               epilogue=G.RowStats(y, opts, store=True)))
  fwd_exp = jax.jit(lambda x, w, y, r: G.gemm(x, w, role="fwd_store", approx_math=True,
                                              epilogue=G.RowStats(y, opts, store=True, ref=r)))
  e = fwd_exp(x, w, y, r)[1]
  patch = jax.jit(lambda e, y, p: e.at[jnp.arange(b), y].set(p, unique_indices=True, indices_are_sorted=True),
                  donate_argnums=0)
  pvals = jnp.ones((b,), e.dtype)
  steps = {"step_shifted": step("shifted"), "step_exp": step("exponentials")}
  compiled = {n: f.lower(x, w, y).compile() for n, f in steps.items()}
  compiled["plain_bf16"] = jax.jit(plain).lower(x, w, y).compile()
  vec = lambda val: jnp.full((b,), val, jnp.float32)
  lse, coef, a, c = vec(float(jnp.log(v)) + 1.0), vec(1.0), vec(1.0), vec(0.0)
  cfg = fast._repair_config(b, h, v, x.dtype, None, spec_opts, False)
  repair = jax.jit(lambda e, flags: fast._repair(e, flags, cfg, x, w, None, y, lse, coef, a, c, "hv", spec_opts,
                                                 False), donate_argnums=0)
  unit = G.row_unit(cfg)
  flags = {"repair_none": jnp.zeros((-(-b // unit),), jnp.int32), "repair_all": jnp.ones((-(-b // unit),), jnp.int32)}
  holder = {"e": e}

  def in_place(f, *args):  # (each call donates the stored tiles and keeps the result for the next)
    def run(_):
      holder["e"] = f(holder["e"], *args)
      return holder["e"]
    return run

  fns = {"ref": (ref, (x, w, y)), "fwd_shifted": (fwd_shifted, (x, w, y)), "fwd_exp": (fwd_exp, (x, w, y, r)),
         "patch": (in_place(patch, y, pvals), (None,))}
  fns.update({n: (in_place(repair, fl), (None,)) for n, fl in flags.items()})
  fns.update({n: (c, (x, w, y)) for n, c in compiled.items()})
  ms = interleaved(fns, rounds)
  for n, t in ms.items():
    row = dict(shape=name, B=b, H=h, V=v, part=n, ms=round(t, 4))
    if n in compiled:
      row["temp_gb"] = round(compiled[n].memory_analysis().temp_size_in_bytes / 1e9, 3)
    rows.append(row)
    print(json.dumps(row), flush=True)
  return rows


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/fast-parts-local"))
  ap.add_argument("--shapes", default="llama3-8b,gemma2-2b,qwen3-8b")
  ap.add_argument("--rounds", type=int, default=3)
  args = ap.parse_args()
  rows = [r for name in args.shapes.split(",") for r in measure(name, args.rounds)]
  save_probe(args.out, rows, args.rounds)


if __name__ == "__main__":
  main()
