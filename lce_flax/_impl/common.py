"""What every backend shares: the static call description (:class:`Spec`), the :class:`Design` a backend returns,
the head's three matmuls and small integer helpers.

A backend module (``reference``, ``chunked``, ``pallas_triton``, ``triton``, ``pallas_mosaic``) implements the
protocol of :mod:`lce_flax._impl.base` (``Backend``: ``Config``, ``supported``, ``design``, ``stats``, ``grads``;
``FastBackend`` adds ``fast_forward`` / ``fast_backward``) for a 2-D problem (``x`` [B, H], ``w`` [H, V] or
[V, H], ``bias`` [V] or None, normalised ``labels`` [B] int32, see :func:`lce_flax._math.normalize_labels`). The
backends hold plans and kernels only: the ``custom_vjp``s around ``stats``/``grads`` and the fast forward, the
registry that says where each can run, and the dispatch are :mod:`lce_flax._impl.base`'s.

Columns and labels: a backend walks the columns ``w`` holds (its count is read from ``w``'s shape), while
``spec.opts.vocab_size`` is the size of the label space (out-of-range labels, the ``ε/V`` of label smoothing).
The two differ only on a vocabulary shard: there labels are shard-local (:func:`lce_flax._impl.vocab_parallel.
localize`), and a counted label whose column another shard holds lies in ``[columns, V)``: counted, in range,
and matching no column here.

``stats``, ``grads`` and the fast forward receive ``Design.config`` (the plan): dispatch
(:func:`lce_flax._impl.base.dispatch`) resolves it once and decides every fallback; a backend never switches to
another design or backend by itself. ``base`` also owns the argument checks, flattening, label normalisation
and reductions, so no backend repeats them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from lce_flax._math import LossSpec

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Design:
  """What one call runs: returned by a backend's ``design`` and shown to users by :func:`lce_flax.explain`."""

  impl: str  # the backend that runs
  mode: str  # "fast" or "lean"
  name: str  # the design inside the backend (e.g. "recompute", "logits", "token_chunks")
  config: Any  # the backend's Config with every field resolved: what ``lean``/``fast`` receive
  chunking: str  # how the problem is walked, in words (e.g. "vocabulary chunks of 2048 columns")
  memory_bytes: int  # bound on the extra memory of forward + backward (beyond inputs, outputs and gradients)
  notes: tuple[str, ...] = ()  # decisions dispatch took (fallbacks, casts), in words


def check_config(config, cls, impl: str) -> None:
  """A config given to ``impl`` must be that backend's own ``Config``."""
  if config is not None and not isinstance(config, cls):
    raise TypeError(f"config={config!r} is a {_public_name(type(config))}; impl={impl!r} takes a "
                    f"{_public_name(cls)}")


def _public_name(cls) -> str:
  """``lce_flax.PallasTritonConfig`` for a backend's Config class (its module path tells the backend)."""
  backend = cls.__module__.split(".")[2] if cls.__module__.startswith("lce_flax._impl.") else None
  public = {"chunked": "ChunkedConfig", "pallas_triton": "PallasTritonConfig", "triton": "TritonConfig",
            "pallas_mosaic": "PallasMosaicConfig"}.get(backend)
  return f"lce_flax.{public}" if public else cls.__name__


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def pow2_floor(n: int) -> int:
  """The largest power of two <= n (1 for n < 2)."""
  return 1 << max(int(n).bit_length() - 1, 0)


def pow2_ceil(n: int) -> int:
  """The smallest power of two >= n (1 for n < 2)."""
  return 1 << max(int(n) - 1, 0).bit_length()


@dataclasses.dataclass(frozen=True)
class Spec:
  """Static description of one call (hashable: used as a ``nondiff_argnums`` argument)."""

  opts: LossSpec
  w_layout: str = "hv"  # "hv": w is [H, V] (a Dense kernel); "vh": w is [V, H] (an Embed table)
  interpret: bool = False

  @property
  def vocab_axis(self) -> int:
    return 1 if self.w_layout == "hv" else 0


def vocab_size(w, w_layout: str) -> int:
  return w.shape[1] if w_layout == "hv" else w.shape[0]


def slice_vocab(w, start, size: int, w_layout: str):
  """Columns ``[start, start+size)`` of the head, in the layout of ``w``."""
  axis = 1 if w_layout == "hv" else 0
  return lax.dynamic_slice_in_dim(w, start, size, axis=axis)


def vocab_window(i, c: int, vocab: int):
  """Chunk ``i`` of ``c`` columns covers [i·c, i·c + c) ∩ [0, V); its window is clamped to end at V, so it is
  (start, its columns, which of them are not in an earlier chunk)."""
  nominal = i * c
  start = jnp.minimum(nominal, vocab - c)
  cols = start + jnp.arange(c, dtype=jnp.int32)
  return start, cols, cols >= nominal


def logits(x, w, w_layout: str):
  """``x @ w`` (or ``x @ w.T`` for [V, H]) accumulated in float32: [B, v]."""
  contract = 0 if w_layout == "hv" else 1
  return lax.dot_general(x, w, (((1,), (contract,)), ((), ())), preferred_element_type=F32)


def grad_x(dz, w, w_layout: str, out_dtype=F32):
  """``dz @ w.T`` for [H, V] weights (``dz @ w`` for [V, H]), accumulated in float32: [B, H] of ``out_dtype``."""
  contract = 1 if w_layout == "hv" else 0
  return lax.dot_general(dz, w, (((1,), (contract,)), ((), ())), preferred_element_type=out_dtype)


def grad_w(x, dz, w_layout: str, out_dtype=F32):
  """``x.T @ dz`` ([H, v]) or ``dz.T @ x`` ([v, H]), accumulated in float32, returned as ``out_dtype``."""
  if w_layout == "hv":
    return lax.dot_general(x, dz, (((0,), (0,)), ((), ())), preferred_element_type=out_dtype)
  return lax.dot_general(dz, x, (((0,), (0,)), ((), ())), preferred_element_type=out_dtype)


def check_fast_cotangents(g_out) -> None:
  """A fast design forms only the gradient of the reduced loss: its per-token outputs must not be differentiated
  (their cotangents arrive as ``jax.custom_derivatives.SymbolicZero`` under ``symbolic_zeros=True``)."""
  for name in ("loss", "lse"):
    if not isinstance(getattr(g_out, name), jax.custom_derivatives.SymbolicZero):
      raise ValueError(
          f"mode='fast' forms only the gradient of the reduced loss; the aux output {name!r} was differentiated."
          " Use mode='lean' (or reduction='none') to differentiate per-token values.")


def mxu_dtype(x: jax.Array):
  """dtype the logit gradient is cast to before it enters a matmul: the inputs' (bf16 stays bf16)."""
  return x.dtype




# ------------------------------------------------------------------------------------------------ kernel helpers
# Written once for the kernel backends (pallas_triton, triton, pallas_mosaic).


def merge_splits(parts) -> Any:
  """The row statistics of a forward whose kernel leaves per-split partial statistics: ``parts`` holds the four
  [S, B] arrays (running max, sum of exponentials, target logit, logit sum) of S vocabulary splits (or is one
  [4, S, B] array); the splits are merged with :func:`lce_flax._math.merge_stats`."""
  from lce_flax import _math  # (common.py imports only LossSpec from it at the top)

  m, s, target, zsum = parts
  st = _math.RowStats(m[0], s[0], target[0], zsum[0])
  for k in range(1, m.shape[0]):
    st = _math.merge_stats(st, _math.RowStats(m[k], s[k], target[k], zsum[k]))
  return st


def present(*arrays) -> list:
  """The operands of a kernel call with optional inputs (a bias): the arrays that are not None, in order."""
  return [a for a in arrays if a is not None]


def absent_refs(kernel, *positions: int):
  """A kernel written with one fixed ref signature, adapted to a call that lacks the refs at ``positions``
  (optional inputs, outputs or scratch, e.g. a bias, its gradient and their buffers): they arrive as None.
  ``positions`` index the full signature."""
  if not positions:
    return kernel

  def wrapped(*refs, **kwargs):
    refs = list(refs)
    for p in sorted(positions):
      refs.insert(p, None)
    return kernel(*refs, **kwargs)

  return wrapped


LOOPS = {"fast": "token_chunk", "lean": "vocab_chunk"}  # the chunk that each mode's designs loop over


def check_loop(config, mode: str, impl: str) -> None:
  """Raises ``ValueError`` when ``config`` sets the chunk of the other mode's loop (``token_chunk`` in a lean
  design, ``vocab_chunk`` in a fast one)."""
  for m, name in LOOPS.items():
    val = getattr(config, name, None)
    if m != mode and val is not None:
      raise ValueError(f"{name}={val}: the {mode} design of impl={impl!r} loops over "
                       f"{'tokens' if mode == 'fast' else 'vocabulary columns'}, set {LOOPS[mode]} instead")


def check_positive(config, names) -> None:
  """Raises ``ValueError`` naming the first field of ``config`` among ``names`` that is set but is not a positive
  int (None fields are left to the heuristic)."""
  for name in names:
    val = getattr(config, name)
    if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 1):
      raise ValueError(f"{name}={val!r} must be a positive int (or None)")
