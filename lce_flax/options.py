"""The loss options, written once: the op, the sharded form, the heads and the adapters all take a ``LossOptions``.

Keyword arguments of :func:`lce_flax.linear_cross_entropy` (and of a head's call) with these names override the
fields of the ``options`` they are given, so ``options=LossOptions(z_loss=1e-4)`` on a head and
``head(x, labels, z_loss=0.0, logit_softcap=None)`` on one call both work; an override of ``None`` sets the field
to ``None`` (it does not mean "keep").
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax.numpy as jnp

Reduction = Literal["mean", "sum", "none"]
Mode = Literal["fast", "lean"]
IMPLS = ("auto", "xla", "chunked", "pallas_triton", "triton", "pallas_mosaic")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossOptions:
  """Options of the fused linear + cross-entropy loss (frozen and hashable: usable as a static argument).

  Attributes:
    reduction: ``"mean"`` over counted tokens (0 when none is counted), ``"sum"``, or ``"none"`` (per token,
      shaped like ``labels``).
    ignore_index: label value of tokens that are not counted (loss 0, no gradient).
    label_smoothing: ε of optax's ``smooth_labels``: targets ``(1-ε)·onehot + ε/V``; in ``[0, 1)``.
    z_loss: coefficient λ of PaLM's auxiliary ``λ·lse²`` loss; ``>= 0``.
    logit_softcap: ``c`` of Gemma 2's ``c·tanh(z/c)`` applied to the logits, or None.
    dtype: the computation dtype of the matmuls, as Flax's ``dtype=``: x and w (and bias) are cast to it
      first; None promotes x and w (bf16 activations with float32 parameters then run in float32). The loss,
      lse and every accumulation are float32 whatever it is; gradients return in each input's own dtype.
    impl: the implementation: ``"auto"`` (the fastest available on this device, see :func:`lce_flax.explain`),
      ``"xla"``, ``"chunked"``, ``"pallas_triton"``, ``"triton"`` or ``"pallas_mosaic"``.
    mode: ``"fast"`` forms the gradients while the logits are on hand (6·B·H·V FLOPs, a bounded buffer);
      ``"lean"`` recomputes them in the backward (8·B·H·V FLOPs, O(B) residuals); None: fast where the
      implementation has a fast design and ``reduction`` is not ``"none"`` (which needs per-token cotangents),
      else lean.
    chunk_size: length of the design's chunk loop (vocabulary columns per chunk in lean designs, tokens per
      chunk in fast designs that loop over tokens); None: chosen by shape. An error for designs without a chunk
      loop, and together with ``config`` (set the chunk inside it).
    interpret: run Pallas kernels in interpret mode (None: when the default backend is not a GPU).
    config: the implementation's own configuration (``lce_flax.ChunkedConfig``, ``PallasTritonConfig``,
      ``TritonConfig``, ``PallasMosaicConfig``); it must belong to ``impl`` (an explicit one).
  """

  reduction: Reduction = "mean"
  ignore_index: int = -100
  label_smoothing: float = 0.0
  z_loss: float = 0.0
  logit_softcap: float | None = None
  dtype: Any = None
  impl: str = "auto"
  mode: Mode | None = None
  chunk_size: int | None = None
  interpret: bool | None = None
  config: Any = None

  def __post_init__(self):
    if self.dtype is not None:  # canonical and hashable: jnp.bfloat16, "bfloat16" and np.dtype agree
      object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
    self.validate()

  def validate(self) -> None:
    """Raises ``ValueError`` naming the first field whose value is not allowed."""
    if self.reduction not in ("mean", "sum", "none"):
      raise ValueError(f"reduction={self.reduction!r} is not one of ('mean', 'sum', 'none')")
    if not isinstance(self.ignore_index, int) or isinstance(self.ignore_index, bool):
      raise ValueError(f"ignore_index={self.ignore_index!r} must be an int")
    if not 0.0 <= self.label_smoothing < 1.0:
      raise ValueError(f"label_smoothing={self.label_smoothing} must be in [0, 1)")
    if not self.z_loss >= 0:
      raise ValueError(f"z_loss={self.z_loss} must be >= 0")
    if self.logit_softcap is not None and not self.logit_softcap > 0:
      raise ValueError(f"logit_softcap={self.logit_softcap} must be > 0 (or None)")
    if self.dtype is not None and not jnp.issubdtype(self.dtype, jnp.floating):
      raise ValueError(f"dtype={self.dtype} must be a floating dtype (or None)")
    if self.impl not in IMPLS:
      raise ValueError(f"impl={self.impl!r} is not one of {IMPLS}")
    if self.mode not in (None, "fast", "lean"):
      raise ValueError(f"mode={self.mode!r} is not one of ('fast', 'lean', None)")
    if self.mode == "fast" and self.reduction == "none":
      raise ValueError("reduction='none' needs per-token cotangents, which mode='fast' cannot take; use "
                       "mode='lean' (or mode=None)")
    if self.chunk_size is not None and (isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int)
                                        or self.chunk_size <= 0):
      raise ValueError(f"chunk_size={self.chunk_size!r} must be a positive int (or None)")
    if self.chunk_size is not None and self.config is not None:
      raise ValueError(f"chunk_size={self.chunk_size} and config={self.config!r} are both given; set the chunk "
                       "inside the config")
    if self.config is not None and self.impl == "auto":
      raise ValueError(f"config={self.config!r} needs the impl it belongs to (impl='auto' may pick another)")

  def replace(self, **overrides: Any) -> LossOptions:
    """A copy with ``overrides`` applied (None sets a field to None); unknown names raise ``TypeError``."""
    unknown = sorted(set(overrides) - set(FIELDS))
    if unknown:
      raise TypeError(f"unknown loss option(s) {unknown}; the options are {FIELDS}")
    return dataclasses.replace(self, **overrides) if overrides else self

  @property
  def math_key(self) -> tuple[float, float, float | None]:
    """(label_smoothing, z_loss, logit_softcap) as floats: the options that change the loss's value."""
    cap = None if self.logit_softcap is None else float(self.logit_softcap)
    return float(self.label_smoothing), float(self.z_loss), cap


FIELDS = tuple(f.name for f in dataclasses.fields(LossOptions))


def resolve(options: LossOptions | None, overrides: dict[str, Any]) -> LossOptions:
  """``options`` (default ``LossOptions()``) with ``overrides`` applied: what every entry point calls."""
  if options is not None and not isinstance(options, LossOptions):
    raise TypeError(f"options must be a lce_flax.LossOptions, got {type(options).__name__}")
  return (options or LossOptions()).replace(**overrides)


def for_head(options: LossOptions, dtype: Any, overrides: dict[str, Any]) -> LossOptions:
  """A head's options for one call: its ``options`` with the call's ``overrides``; the head's Flax ``dtype``
  (None: none) fills ``dtype`` unless the options or the call set it."""
  opts = resolve(options, overrides)
  if dtype is not None and opts.dtype is None:
    opts = opts.replace(dtype=dtype)
  return opts
