"""What the fast mode's row-max shift buys (CPU, float64 NumPy): the logit gradient formed from logits stored in
bf16 as they are (torch.compile's buffer) against logits stored shifted by their 128-column tile's row max
(``pallas_mosaic``'s buffer, which adds a float32 max per row and tile: B·V/64 bytes, 1/64 of the buffer).

``python -m benchmarks.stored_logits_precision`` prints the relative errors (Frobenius) of dz, dx = dz·w and
dw = xᵀ·dz against float64, next to the error of rounding the exact dz to bf16 (what every design pays), and
writes ``$OUT/stored_logits_precision.json``.
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16


def _bf16(a):
  return a.astype(BF16).astype(np.float64)


def run(b=1024, h=256, v=16384, tile=128, seed=0) -> list[dict]:
  rng = np.random.default_rng(seed)
  rows = []
  for name, wscale, cap in (("standard", 0.02 * np.sqrt(4096 / h), None), ("peaky", 0.7, 30.0)):
    x = rng.standard_normal((b, h))
    w = rng.standard_normal((h, v)) * wscale
    z = x @ w
    if cap:
      z = cap * np.tanh(z / cap)
    y = rng.integers(0, v, b)
    top = z.max(1, keepdims=True)
    lse = np.log(np.exp(z - top).sum(1, keepdims=True)) + top
    onehot = np.zeros_like(z)
    onehot[np.arange(b), y] = 1.0
    dz = lambda zs: np.exp(zs - lse) - onehot  # pylint: disable=cell-var-from-loop
    ref = dz(z)
    m = z.reshape(b, v // tile, tile).max(-1, keepdims=True)
    variants = {
        "bf16 dz only": _bf16(ref),
        "shifted bf16 logits": _bf16(dz((_bf16(z.reshape(b, v // tile, tile) - m) + m).reshape(b, v))),
        "plain bf16 logits": _bf16(dz(_bf16(z))),
    }
    for label, a in variants.items():
      err = lambda f: float(np.linalg.norm(f(a - ref)) / np.linalg.norm(f(ref)))  # pylint: disable=cell-var-from-loop
      rows.append(dict(logits=name, logit_std=float(z.std()), logit_max=float(z.max()), variant=label,
                       dz=err(lambda t: t), dx=err(lambda t: t @ w.T), dw=err(lambda t: x.T @ t)))  # pylint: disable=cell-var-from-loop
  return rows


if __name__ == "__main__":
  out = run()
  for r in out:
    print(f"{r['logits']:9s} (std {r['logit_std']:.1f}, max {r['logit_max']:.1f})  {r['variant']:20s}  "
          f"dz {r['dz']:.2e}  dx {r['dx']:.2e}  dw {r['dw']:.2e}")
  with open(os.path.join(os.environ.get("OUT", "."), "stored_logits_precision.json"), "w") as f:
    json.dump(out, f, indent=1)
