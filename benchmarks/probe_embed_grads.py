"""The embedding table's gradient formed from the rows' gradients: the scatter-add forms the trainer can use.

The trainer's ``--embed-grads gather`` (``examples/lm/model.py``: ``lookup``) all-gathers every device's
rows' gradients and token ids and scatter-adds all of them into the [V, H] table gradient on each device, in place
of a local scatter-add and an all-reduce of the table. On four devices that is four times the rows of the one-device
scatter. This probe times, on one device, the scatter-add of ``n`` rows [n, H] into a zero [V, H] table for each
form, at the one-device row count and at k times it, in alternation:

  bf16         ``zeros(bf16).at[ids].add(rows)`` (what the trainer's lookup ran first)
  f32          the same into a float32 table, cast to bf16 after
  sorted_bf16  ids sorted first (rows permuted with them), the scatter told so (``indices_are_sorted``)
  sorted_f32   both

Token ids are drawn uniformly and from a Zipf law (exponent 1.1, as text is: a few ids take many rows). Each row
records its error against a float64 NumPy sum of the same rows (relative Frobenius norm).

    python -m benchmarks.probe_embed_grads --out DIR                          # the trainer's gpu preset
    JAX_PLATFORMS=cpu python -m benchmarks.probe_embed_grads --small --out DIR  # a CPU check of the probe
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_gemm import interleaved, save_probe  # noqa: E402


def forms(vocab: int):
  """name -> jitted (rows [n, H] bf16, ids [n] int32) -> the bf16 [V, H] table gradient."""

  def scatter(acc_dtype, sort):
    def f(rows, ids):
      if sort:
        order = jnp.argsort(ids)
        rows, ids = rows[order], ids[order]
      table = jnp.zeros((vocab, rows.shape[-1]), acc_dtype)
      return table.at[ids].add(rows.astype(acc_dtype), indices_are_sorted=sort).astype(rows.dtype)
    return jax.jit(f)

  return {"bf16": scatter(jnp.bfloat16, False), "f32": scatter(jnp.float32, False),
          "sorted_bf16": scatter(jnp.bfloat16, True), "sorted_f32": scatter(jnp.float32, True)}


def token_ids(rng, n: int, vocab: int, law: str) -> np.ndarray:
  if law == "uniform":
    return rng.integers(0, vocab, n).astype(np.int32)
  return ((rng.zipf(1.1, n) - 1) % vocab).astype(np.int32)


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--vocab", type=int, default=131072)
  ap.add_argument("--hidden", type=int, default=1024)
  ap.add_argument("--rows", default="8192,32768", help="row counts (one device's, and k devices' gathered)")
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--small", action="store_true", help="V 960, H 64, rows 96,384: a CPU check")
  ap.add_argument("--out", default="/tmp/lce_probe_embed_grads")
  a = ap.parse_args(argv)
  if a.small:
    a.vocab, a.hidden, a.rows = 960, 64, "96,384"
  rng = np.random.default_rng(0)
  fns = forms(a.vocab)
  rows_out = []
  for n in map(int, a.rows.split(",")):
    for law in ("uniform", "zipf"):
      ids = token_ids(rng, n, a.vocab, law)
      rows = jnp.asarray(rng.standard_normal((n, a.hidden)), jnp.bfloat16)
      ref = np.zeros((a.vocab, a.hidden))
      np.add.at(ref, ids, np.asarray(rows, np.float64))
      args = (rows, jnp.asarray(ids))
      ms = interleaved({name: (f, args) for name, f in fns.items()}, rounds=a.rounds)
      for name, f in fns.items():
        got = np.asarray(f(*args), np.float64)
        err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
        r = dict(form=name, rows=n, ids=law, vocab=a.vocab, hidden=a.hidden, distinct_ids=int(np.unique(ids).size),
                 ms=ms[name], rel_err=err)
        rows_out.append(r)
        print(json.dumps(r), flush=True)
      save_probe(a.out, rows_out, a.rounds)
  return 0


if __name__ == "__main__":
  sys.exit(main())
