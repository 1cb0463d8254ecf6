"""The loss options, written once: the op, the sharded form, the heads and the adapters all take a ``LossOptions``.

Keyword arguments of :func:`lce_flax.linear_cross_entropy` (and of a head's call) with these names override the
fields of the ``options`` they are given, so ``options=LossOptions(z_loss=1e-4)`` on a head and
``head(x, labels, z_loss=0.0, logit_softcap=None)`` on one call both work; an override of ``None`` sets the field
to ``None`` (it does not mean "keep").
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal, get_args

import jax
import jax.numpy as jnp

from lce_flax import _math

Reduction = Literal["mean", "sum", "none"]
Mode = Literal["fast", "lean"]
Impl = Literal["auto", "xla", "chunked", "pallas_triton", "triton", "pallas_mosaic"]
IMPLS: tuple[str, ...] = get_args(Impl)
# Names that an earlier version took, and what replaced them (a TypeError names the replacement).
RENAMED = {"chunk_size": "token_chunk (tokens per chunk, for the designs that loop over tokens: mode='fast') or "
                         "vocab_chunk (vocabulary columns per chunk, for those that loop over the vocabulary: "
                         "mode='lean')"}


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
      implementation has a fast design, else lean; with ``reduction="none"`` (per-token cotangents) fast only
      where that design forms dz in its backward (``"pallas_mosaic"``'s ``"logits"``), else lean.
      ``mode="fast"`` with ``reduction="none"`` runs that design (and ``"xla"``, whose autodiff takes any
      cotangent) and never lean: where the implementation (``"auto"``'s pick) has none, a ``ValueError`` at trace
      time names it and what to use instead (``lce_flax.explain`` says which design runs and why).
    token_chunk: tokens per chunk, for the designs that loop over chunks of tokens (the fast designs of
      ``"chunked"`` and ``"pallas_mosaic"``'s ``"tokens"``, none of which takes per-token cotangents:
      ``reduction="none"`` refuses it); setting it makes ``mode=None`` fast, and ``"auto"`` picks a design that
      honours it. None: chosen by shape.
    vocab_chunk: vocabulary columns per chunk, for the designs that loop over the vocabulary (every lean
      design but ``"xla"``'s); setting it makes ``mode=None`` lean. None: chosen by shape. At most one of the two
      may be set, and neither together with ``config`` (set the chunk inside it).
    interpret: run Pallas kernels in interpret mode (None: when the default backend is not a GPU).
    config: the implementation's own configuration (``lce_flax.ChunkedConfig``, ``PallasTritonConfig``,
      ``TritonConfig``, ``PallasMosaicConfig``); it must belong to ``impl`` (an explicit one).
    entropy: also compute each token's entropy ``-Σ_v p_v log p_v`` of ``p = softmax(z')`` (the capped logits)
      into ``Aux.entropy`` (so ``return_aux=True`` is needed). It is one more pass over the vocabulary, the same
      for every ``impl`` (XLA matmuls in chunks of ``vocab_chunk`` columns, else chosen by shape): 2·B·H·V FLOPs,
      and 6·B·H·V more in the backward when ``Aux.entropy`` is differentiated (it carries a gradient). Off by
      default: nothing is computed that was not asked for.
  """

  reduction: Reduction = "mean"
  ignore_index: int = -100
  label_smoothing: float = 0.0
  z_loss: float = 0.0
  logit_softcap: float | None = None
  dtype: Any = None
  impl: Impl = "auto"
  mode: Mode | None = None
  token_chunk: int | None = None
  vocab_chunk: int | None = None
  interpret: bool | None = None
  config: Any = None
  entropy: bool = False

  def __post_init__(self):
    if self.dtype is not None:  # canonical and hashable: jnp.bfloat16, "bfloat16" and np.dtype agree
      object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
    for name in ("label_smoothing", "z_loss", "logit_softcap"):  # Python floats: static, hashable, comparable
      val = getattr(self, name)
      if val is not None:
        object.__setattr__(self, name, _static_float(name, val))
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
    for name in ("token_chunk", "vocab_chunk"):
      val = getattr(self, name)
      if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val <= 0):
        raise ValueError(f"{name}={val!r} must be a positive int (or None)")
      if val is not None and self.config is not None:
        raise ValueError(f"{name}={val} and config={self.config!r} are both given; set the chunk inside the config")
    if self.token_chunk is not None and self.vocab_chunk is not None:
      raise ValueError(f"token_chunk={self.token_chunk} and vocab_chunk={self.vocab_chunk} are both given; no design "
                       "has both loops: token_chunk is for the fast designs, vocab_chunk for the lean ones")
    if self.token_chunk is not None and self.design_mode == "lean":
      why = "mode='lean'" if self.mode == "lean" else "reduction='none' (per-token cotangents)"
      raise ValueError(f"token_chunk={self.token_chunk}: {why} runs a lean design, which loops over vocabulary "
                       "columns, not tokens; set vocab_chunk instead (or mode='fast' with a reduced loss)")
    if self.vocab_chunk is not None and self.mode == "fast":
      raise ValueError(f"vocab_chunk={self.vocab_chunk}: the fast designs loop over tokens, not vocabulary columns; "
                       "set token_chunk instead (or mode='lean')")
    if not isinstance(self.entropy, bool):
      raise ValueError(f"entropy={self.entropy!r} must be a bool")
    if self.config is not None and self.impl == "auto":
      raise ValueError(f"config={self.config!r} needs the impl it belongs to (impl='auto' may pick another)")

  def replace(self, **overrides: Any) -> LossOptions:
    """A copy with ``overrides`` applied (None sets a field to None); unknown names raise ``TypeError``."""
    _check_names(overrides)
    return dataclasses.replace(self, **overrides) if overrides else self

  @property
  def design_mode(self) -> Mode:
    """The mode asked for: ``mode``, or, when it is None, lean for ``reduction="none"`` (per-token cotangents) or
    a ``vocab_chunk`` (a loop over the vocabulary), else fast. (``reduction="none"`` with ``mode=None`` still runs
    a fast design where one takes per-token cotangents; with ``mode="fast"`` only such a design runs.)"""
    if self.mode is not None:
      return self.mode
    return "lean" if self.reduction == "none" or self.vocab_chunk is not None else "fast"

  def spec(self, vocab_size: int) -> _math.LossSpec:
    """The loss's math for a vocabulary of ``vocab_size`` (what the implementations compute)."""
    return _math.LossSpec(vocab_size=vocab_size, label_smoothing=self.label_smoothing, z_loss=self.z_loss,
                          logit_softcap=self.logit_softcap)


FIELDS = tuple(f.name for f in dataclasses.fields(LossOptions))


def _check_names(kwargs) -> None:
  """``TypeError`` for an option name that does not exist (naming its replacement where it was renamed)."""
  for name in sorted(set(kwargs) - set(FIELDS)):
    if name in RENAMED:
      raise TypeError(f"{name!r} is no longer a loss option: use {RENAMED[name]}")
    raise TypeError(f"unknown loss option(s) {sorted(set(kwargs) - set(FIELDS))}; the options are {FIELDS}")


def _checked_init(init):
  @functools.wraps(init)
  def __init__(self, **kwargs):  # noqa: N807
    _check_names(kwargs)
    init(self, **kwargs)
  return __init__


LossOptions.__init__ = _checked_init(LossOptions.__init__)


def _static_float(name: str, val) -> float:
  """``val`` as a Python float; a traced value (under ``jit``, e.g. from a schedule) is refused by name: the loss's
  options are static, compiled into the kernels."""
  if isinstance(val, jax.core.Tracer):
    raise TypeError(
        f"{name} is a traced array ({jax.typeof(val).str_short()}), e.g. a schedule's value under jit; loss options "
        "are static (compiled into the kernels): pass a Python float, or make it a static argument of the jitted "
        "function (one compilation per value)")
  try:
    if isinstance(val, (bool, str)):
      raise TypeError
    return float(val)
  except (TypeError, ValueError):
    raise TypeError(f"{name}={val!r} must be a float (a Python or concrete scalar)") from None


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
