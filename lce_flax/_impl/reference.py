"""``impl="xla"``: the whole [B, V] logits in float32, differentiated by JAX's autodiff.

The simplest correct implementation and the oracle of the kernel tests: on one device the per-device op
(:func:`lce_flax._impl.base.per_device`) differentiates :func:`stats` by JAX's autodiff, with no ``custom_vjp``,
so its gradients check the hand-written backward passes of every other backend. (Its :func:`grads` serves the
vocab-parallel head, whose collectives need the lean ``custom_vjp``.) Memory: O(B·V).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from lce_flax import _math
from lce_flax._impl import common


@dataclasses.dataclass(frozen=True)
class Config:
  """``impl="xla"`` has nothing to configure (and no chunk loop)."""


def supported(spec: common.Spec, platform: str, dtype=None) -> None:
  del spec, platform, dtype  # runs everywhere


def design(num_tokens: int, hidden: int, spec: common.Spec, dtype, mode: str, config=None) -> common.Design:
  """Both modes are the same computation here: autodiff through the stored float32 logits."""
  if config is not None and config != Config():
    raise TypeError(f"impl='xla' takes no config, got config={config!r}")
  # the float32 logits, their softmax and their gradient
  mem = 3 * num_tokens * spec.opts.vocab_size * 4
  return common.Design("xla", mode, "autodiff", None, "the whole [B, V] float32 logits at once", mem)


def _logits(x, w, bias, spec: common.Spec):
  z = common.logits(x, w, spec.w_layout)
  return z if bias is None else z + bias.astype(jnp.float32)


def _columns(w, spec: common.Spec):
  cols = jnp.arange(common.vocab_size(w, spec.w_layout), dtype=jnp.int32)
  return cols, jnp.ones_like(cols, bool)


def stats(x, w, bias, labels, spec: common.Spec, config=None) -> _math.RowStats:
  del config
  zc = _math.softcap(_logits(x, w, bias, spec), spec.opts.logit_softcap)
  cols, valid = _columns(w, spec)
  return _math.tile_stats(zc, cols, labels, valid, spec.opts)


def grads(x, w, bias, labels, lse, g_loss, g_lse, spec: common.Spec, config=None):
  """The gradient of ``Σ g_loss·loss + g_lse·lse`` for the given lse, formed from the whole float32 dz."""
  del config
  cols, valid = _columns(w, spec)
  dz = _math.dlogits(_logits(x, w, bias, spec), lse, labels, cols, valid, g_loss, g_lse, spec.opts)
  dx = common.grad_x(dz, w.astype(jnp.float32), spec.w_layout)
  dw = common.grad_w(x.astype(jnp.float32), dz, spec.w_layout).astype(w.dtype)
  return dx, dw, None if bias is None else dz.sum(0)
