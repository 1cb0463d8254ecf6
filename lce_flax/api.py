"""``linear_cross_entropy``: validation, option handling and dispatch to an implementation.

dispatch (this file) → implementation (``reference.py``, ``chunked.py``, ``pallas_triton.py``, ``triton_kernels.py``,
``pallas_mosaic.py``) → kernel. Every implementation computes the math of ``_math.py`` on a 2-D problem with
normalised labels; everything users see — leading dims, masks, reductions, errors — is handled here, once.
"""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from lce_flax import _device, _math
from lce_flax._impl import common

REDUCTIONS = ("mean", "sum", "none")
MODES = ("fast", "lean")

# name -> module path. Modules are imported on first use, so a missing optional dependency (jax-triton) only
# matters to the implementation that needs it.
IMPLEMENTATIONS = {
    "xla": "lce_flax._impl.reference",
    "chunked": "lce_flax._impl.chunked",
    "pallas_triton": "lce_flax._impl.pallas_triton",
    "triton": "lce_flax._impl.triton",
    "pallas_mosaic": "lce_flax._impl.pallas_mosaic",
}


class Aux(NamedTuple):
  """Per-token outputs of :func:`linear_cross_entropy` (``return_aux=True``), shaped like ``labels``."""

  token_loss: jax.Array  # float32; 0 where not counted, NaN where the label is out of range
  lse: jax.Array  # float32 log-sum-exp of the (capped) logits
  num_correct: jax.Array  # int32 scalar: counted tokens whose label has the largest logit
  num_tokens: jax.Array  # int32 scalar: counted tokens


def _module(name: str):
  try:
    return importlib.import_module(IMPLEMENTATIONS[name])
  except ImportError as e:  # an optional dependency of that backend is missing
    raise NotImplementedError(f"impl={name!r} is not available: {e}") from e


def _auto_order() -> tuple[str, ...]:
  cc = _device.compute_capability()
  if cc is not None and cc >= (9, 0):
    return ("pallas_mosaic", "pallas_triton", "chunked")
  if cc is not None and cc >= (8, 0):
    return ("pallas_triton", "chunked")
  return ("chunked",)


def available_implementations(spec: common.Spec | None = None, platform: str | None = None) -> list[str]:
  """Names of the implementations that can run ``spec`` (default: plain options) on ``platform``."""
  platform = platform or _device.platform()
  spec = spec or common.Spec(_math.LossOptions(vocab_size=2))
  names = []
  for name in IMPLEMENTATIONS:
    try:
      _module(name).supported(spec, platform)
      names.append(name)
    except NotImplementedError:
      pass
  return names


def _resolve(impl: str, spec: common.Spec, platform: str, mode: str):
  """Returns (name, module) of the implementation to run; raises with the alternatives if ``impl`` can't.

  ``"auto"`` walks :func:`_auto_order` and takes the first backend that supports the call *in the requested
  mode*: a backend without a fast design is skipped when ``mode="fast"``, since its lean design would be
  slower than the chunked fast one (see README, "Implementations and modes").
  """
  names = _auto_order() if impl == "auto" else (impl,)
  reasons = []
  for name in names:
    try:
      mod = _module(name)
      mod.supported(spec, platform)
      if impl == "auto" and mode == "fast" and mod.fast is None and name != names[-1]:
        raise NotImplementedError("no fast mode")
      return name, mod
    except NotImplementedError as e:
      reasons.append(f"{name}: {e}")
  raise ValueError(f"impl={impl!r} cannot run here ({'; '.join(reasons)}); implementations that can: "
                   f"{available_implementations(spec, platform)}")


def _check(x, w, labels, bias, where, reduction, w_layout, impl, mode, label_smoothing, z_loss, logit_softcap):
  if impl != "auto" and impl not in IMPLEMENTATIONS:
    raise ValueError(f"impl={impl!r} is not one of {['auto', *IMPLEMENTATIONS]}")
  if reduction not in REDUCTIONS:
    raise ValueError(f"reduction={reduction!r} is not one of {REDUCTIONS}")
  if mode is not None and mode not in MODES:
    raise ValueError(f"mode={mode!r} is not one of {MODES} (or None)")
  if w_layout not in ("hv", "vh"):
    raise ValueError(f"w_layout={w_layout!r} must be 'hv' (w is [H, V], a Dense kernel) or 'vh' ([V, H], an Embed table)")
  for name, a in (("x", x), ("w", w)):
    if not jnp.issubdtype(a.dtype, jnp.floating):
      raise TypeError(f"{name} must be floating point, got {name}.dtype={a.dtype}")
  if x.ndim < 1:
    raise ValueError(f"x must be [..., H], got x.shape={x.shape}")
  if w.ndim != 2:
    raise ValueError(f"w must be 2-D ([H, V] for w_layout='hv', [V, H] for 'vh'), got w.shape={w.shape}")
  h = w.shape[0] if w_layout == "hv" else w.shape[1]
  if x.shape[-1] != h:
    raise ValueError(f"x.shape={x.shape} and w.shape={w.shape} (w_layout={w_layout!r}) disagree on H: "
                     f"{x.shape[-1]} vs {h}")
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise TypeError(f"labels must be integers, got labels.dtype={labels.dtype}")
  if labels.shape != x.shape[:-1]:
    raise ValueError(f"labels.shape={labels.shape} must equal x.shape[:-1]={x.shape[:-1]} (x.shape={x.shape})")
  v = common.vocab_size(w, w_layout)
  if bias is not None and (bias.shape != (v,) or not jnp.issubdtype(bias.dtype, jnp.floating)):
    raise ValueError(f"bias must be floating [V]=[{v}], got bias.shape={bias.shape}, bias.dtype={bias.dtype}")
  if where is not None and (where.shape != labels.shape or where.dtype != jnp.bool_):
    raise ValueError(f"where must be bool with labels.shape={labels.shape}, got where.shape={where.shape}, "
                     f"where.dtype={where.dtype}")
  if not 0.0 <= label_smoothing < 1.0:
    raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1)")
  if z_loss < 0:
    raise ValueError(f"z_loss={z_loss} must be >= 0")
  if logit_softcap is not None and not logit_softcap > 0:
    raise ValueError(f"logit_softcap={logit_softcap} must be > 0 (or None)")


def _explicitly_sharded_axes(a) -> tuple[str, ...]:
  """Mesh axes with ``AxisType.Explicit`` over which ``a`` is sharded (empty outside explicit-sharding mode)."""
  sharding = getattr(jax.typeof(a), "sharding", None)
  mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
  if mesh is None or spec is None or not getattr(mesh, "axis_types", ()):
    return ()
  explicit = {n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Explicit}
  used = []
  for entry in spec:
    for name in (entry if isinstance(entry, tuple) else (entry,)):
      if name in explicit:
        used.append(name)
  return tuple(used)


def _check_sharding(impl, **arrays):
  """The chunk loops contract over dimensions that explicit sharding would split without saying how to combine
  them; say so clearly instead of failing deep inside with a ShardingTypeError."""
  if impl == "xla":
    return
  for name, a in arrays.items():
    axes = _explicitly_sharded_axes(a) if a is not None else ()
    if axes:
      raise ValueError(
          f"{name} is sharded over the explicit mesh axes {axes} ({name}.sharding={jax.typeof(a).sharding}); "
          "call lce_flax.sharding.sharded_linear_cross_entropy(..., mesh=mesh) for the sharded computation, "
          "or reshard the inputs to replicated (or use impl='xla').")


def linear_cross_entropy(
    x: jax.Array,
    w: jax.Array,
    labels: jax.Array,
    *,
    bias: jax.Array | None = None,
    reduction: str = "mean",
    ignore_index: int = -100,
    where: jax.Array | None = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    logit_softcap: float | None = None,
    w_layout: str = "hv",
    impl: str = "auto",
    return_aux: bool = False,
    mode: str | None = None,
    chunk_size: int | None = None,
    interpret: bool | None = None,
    config: Any = None,
):
  r"""Cross-entropy of a linear head, without materialising the ``[..., V]`` logits.

  Computes, per token, ``optax.softmax_cross_entropy_with_integer_labels(softcap(x @ w + bias), labels)`` with
  optax-style label smoothing, plus ``z_loss · lse²``:

  .. math::

    \ell_t = \mathrm{lse}_t - (1-\varepsilon) z'_{t,y_t} - \tfrac{\varepsilon}{V}\textstyle\sum_v z'_{tv}
             + \lambda_z \mathrm{lse}_t^2,\qquad z' = c\tanh\big((xw + b)/c\big).

  Args:
    x: ``[..., H]`` activations (bf16, fp16 or fp32).
    w: ``[H, V]`` (``w_layout="hv"``, a ``Dense`` kernel) or ``[V, H]`` (``"vh"``, an ``Embed`` table, used as
      is for tied heads: no transposed copy).
    labels: ``[...]`` integer targets in ``[0, V)``.
    bias: optional ``[V]``.
    reduction: ``"mean"`` (over counted tokens; 0 if none is counted), ``"sum"`` or ``"none"`` (``[...]``).
    ignore_index: label value of tokens that are not counted (loss 0, no gradient).
    where: optional bool ``[...]``; False tokens are not counted (as in optax's ``where=``).
    label_smoothing: ε of optax's ``smooth_labels``: targets ``(1-ε)·onehot + ε/V``.
    z_loss: coefficient of the ``lse²`` auxiliary loss (PaLM).
    logit_softcap: ``c`` of ``c·tanh(z/c)`` applied to the logits (Gemma 2), or None.
    w_layout: ``"hv"`` or ``"vh"``, see ``w``.
    impl: ``"auto"``, ``"xla"``, ``"chunked"``, ``"pallas_triton"``, ``"triton"`` or ``"pallas_mosaic"``.
    return_aux: also return an :class:`Aux` (per-token loss and lse, accuracy counts).
    mode: ``"fast"`` forms the gradients while logits are on hand (6·B·H·V FLOPs, a bounded buffer);
      ``"lean"`` recomputes them in the backward (8·B·H·V FLOPs, O(B) residuals). None: fast, except for
      ``reduction="none"``, which needs per-token cotangents and so runs lean.
    chunk_size: chunk of the ``chunked`` implementation (vocab columns when lean, tokens when fast).
    interpret: run Pallas kernels in interpret mode (default: when the default backend is not a GPU).
    config: implementation-specific configuration (e.g. block sizes), or None for the heuristic.

  Returns:
    The float32 loss (scalar, or ``[...]`` for ``reduction="none"``), and an :class:`Aux` if ``return_aux``.

  Labels outside ``[0, V)`` that are not ``ignore_index`` give that token a NaN loss (and NaN gradients), so the
  reduced loss is NaN: a bad label never yields a plausible number.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from lce_flax import linear_cross_entropy
    >>> x = jnp.ones((2, 3, 4)); w = jnp.zeros((4, 10)); y = jnp.array([[1, 2, -100], [0, 9, 9]])
    >>> print(f"{linear_cross_entropy(x, w, y):.4f}")  # uniform logits: log(10) per counted token
    2.3026
  """
  x, w, labels = jnp.asarray(x), jnp.asarray(w), jnp.asarray(labels)
  _check(x, w, labels, bias, where, reduction, w_layout, impl, mode, label_smoothing, z_loss, logit_softcap)
  _check_sharding(impl, x=x, w=w, labels=labels, bias=bias)
  if mode is None:
    mode = "lean" if reduction == "none" else "fast"
  if reduction == "none" and mode == "fast":
    raise ValueError("reduction='none' needs per-token cotangents, which mode='fast' cannot take; use mode='lean'")

  vocab = common.vocab_size(w, w_layout)
  opts = _math.LossOptions(vocab, float(label_smoothing), float(z_loss),
                           None if logit_softcap is None else float(logit_softcap))
  spec = common.Spec(opts, w_layout, _device.default_interpret() if interpret is None else bool(interpret))
  name, mod = _resolve(impl, spec, _device.platform(), mode)
  if config is None and chunk_size is not None:
    config = getattr(mod, "Config")(chunk_size=chunk_size) if hasattr(mod, "Config") else None

  batch_shape = labels.shape
  dtype = jnp.promote_types(x.dtype, w.dtype)
  x2 = x.reshape(-1, x.shape[-1]).astype(dtype)
  w = w.astype(dtype)
  labels2 = _math.normalize_labels(labels.reshape(-1), None if where is None else where.reshape(-1),
                                   ignore_index, vocab)
  counted = labels2 != _math.IGNORED
  count = counted.sum(dtype=jnp.int32)

  if mode == "fast" and mod.fast is not None:
    weights = counted.astype(jnp.float32)
    if reduction == "mean":
      weights = weights / jnp.maximum(count, 1).astype(jnp.float32)
    loss, out = mod.fast(x2, w, bias, labels2, weights, spec, config)
  else:
    out = mod.lean(x2, w, bias, labels2, spec, config)
    if reduction == "none":
      loss = out.loss.reshape(batch_shape)
    else:
      loss = out.loss.sum()
      if reduction == "mean":
        loss = loss / jnp.maximum(count, 1).astype(jnp.float32)
  if not return_aux:
    return loss
  return loss, Aux(out.loss.reshape(batch_shape), out.lse.reshape(batch_shape),
                   out.correct.sum(dtype=jnp.int32), count)
