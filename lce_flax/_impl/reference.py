"""``impl="xla"``: the whole [B, V] logits in float32, differentiated by JAX's autodiff.

The simplest correct implementation and the oracle of the kernel tests: no ``custom_vjp``, so its gradients
check the hand-written backward passes of every other backend. Memory: O(B·V).
"""

from __future__ import annotations

import jax.numpy as jnp

from lce_flax import _math
from lce_flax._impl import common

Config = None  # nothing to configure


def supported(spec: common.Spec, platform: str, dtype=None) -> None:
  del spec, platform, dtype  # runs everywhere


def design(num_tokens: int, hidden: int, spec: common.Spec, dtype, mode: str, config=None) -> common.Design:
  """Both modes are the same computation here: autodiff through the stored float32 logits."""
  if config is not None:
    raise TypeError(f"impl='xla' takes no config, got config={config!r}")
  # the float32 logits, their softmax and their gradient
  mem = 3 * num_tokens * spec.opts.vocab_size * 4
  return common.Design("xla", mode, "autodiff", None, "the whole [B, V] float32 logits at once", mem)


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


def fast(x, w, bias, labels, weights, spec: common.Spec, config=None):
  """``(Σ weights·loss, TokenOut)`` by the same autodiff (the logits are stored either way)."""
  out = lean(x, w, bias, labels, spec, config)
  return jnp.sum(weights * out.loss), out
