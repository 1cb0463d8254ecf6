"""``impl="xla"``: the whole [B, V] logits in float32, differentiated by JAX's autodiff.

The simplest correct implementation and the oracle of the kernel tests: no ``custom_vjp``, so its gradients
check the hand-written backward passes of every other backend. Memory: O(B·V).
"""

from __future__ import annotations

import jax.numpy as jnp
from lce_flax import _math
from lce_flax._impl import common


def supported(spec: common.Spec, platform: str) -> None:
  del spec, platform  # runs everywhere


def lean(x, w, bias, labels, spec: common.Spec, config=None) -> _math.TokenOut:
  del config
  opts = spec.opts
  z = common.logits(x, w, spec.w_layout)
  if bias is not None:
    z = z + bias.astype(jnp.float32)
  zc = _math.softcap(z, opts.logit_softcap)
  cols = jnp.arange(opts.vocab_size, dtype=jnp.int32)
  st = _math.tile_stats(zc, cols, labels, jnp.ones_like(cols, bool), opts)
  return _math.finalize(st, labels, opts)


fast = None  # autodiff already forms the gradient from the stored logits
