"""``linear_cross_entropy`` and ``explain``: validation, the options built once, and one dispatch.

dispatch (:func:`_dispatch`, this file) → implementation (``lce_flax/_impl/``: ``reference``, ``chunked``,
``pallas_triton/``, ``triton/``, ``pallas_mosaic/``) → kernel. Every implementation computes the math of
``_math.py`` on a 2-D problem with normalised labels, following the protocol of ``lce_flax/_impl/common.py``.
Everything users see — leading dims, masks, dtypes, reductions, errors, and every fallback — is decided here,
once, and :func:`explain` reports it before anything runs.
"""

from __future__ import annotations

import importlib
import math
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from lce_flax import _device, _math
from lce_flax._impl import common
from lce_flax.options import LossOptions, resolve

# name -> module. Imported on first use, so a missing optional dependency (jax-triton) only matters to the
# implementation that needs it.
IMPLEMENTATIONS = {
    "xla": "lce_flax._impl.reference",
    "chunked": "lce_flax._impl.chunked",
    "pallas_triton": "lce_flax._impl.pallas_triton",
    "triton": "lce_flax._impl.triton",
    "pallas_mosaic": "lce_flax._impl.pallas_mosaic",
}
KERNEL_IMPLS = ("pallas_triton", "triton", "pallas_mosaic")  # the ones ``interpret`` applies to


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


def available_implementations(dtype=jnp.bfloat16, platform: str | None = None) -> list[str]:
  """Names of the implementations that can run ``dtype`` inputs on ``platform`` (default: this device)."""
  platform = platform or _device.platform()
  spec = common.Spec(_math.LossSpec(vocab_size=2), interpret=False)
  names = []
  for name in IMPLEMENTATIONS:
    try:
      _module(name).supported(spec, platform, jnp.dtype(dtype))
      names.append(name)
    except NotImplementedError:
      pass
  return names


# ------------------------------------------------------------------------------------------------ validation


def _shape_dtype(a, name: str):
  if a is None:
    return None
  if not hasattr(a, "shape") or not hasattr(a, "dtype"):
    try:
      a = jnp.asarray(a)
    except TypeError:
      raise TypeError(f"{name} must be an array, got a {type(a).__name__}") from None
  return a


def _check(x, w, labels, bias, where, w_layout: str) -> None:
  """Trace-time checks of shapes and dtypes; each error names the argument and what it got."""
  if w_layout not in ("hv", "vh"):
    raise ValueError(f"w_layout={w_layout!r} must be 'hv' (w is [H, V], a Dense kernel) or 'vh' ([V, H], an "
                     "Embed table)")
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
  if h == 0:
    raise ValueError(f"H must be > 0: x.shape={x.shape}, w.shape={w.shape}")
  v = common.vocab_size(w, w_layout)
  if v == 0:
    raise ValueError(f"V must be > 0: w.shape={w.shape} (w_layout={w_layout!r})")
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise TypeError(f"labels must be integers, got labels.dtype={labels.dtype}")
  if labels.shape != x.shape[:-1]:
    raise ValueError(f"labels.shape={labels.shape} must equal x.shape[:-1]={x.shape[:-1]} (x.shape={x.shape})")
  if bias is not None and (bias.shape != (v,) or not jnp.issubdtype(bias.dtype, jnp.floating)):
    raise ValueError(f"bias must be floating [V]=[{v}], got bias.shape={bias.shape}, bias.dtype={bias.dtype}")
  if where is not None:
    if where.shape != labels.shape:
      raise ValueError(f"where.shape={where.shape} must equal labels.shape={labels.shape}")
    if not (where.dtype == jnp.bool_ or jnp.issubdtype(where.dtype, jnp.number)):
      raise TypeError(f"where must be bool or a numeric 0/1 mask, got where.dtype={where.dtype}")


def _explicit_axes(a) -> tuple[str, ...]:
  """Mesh axes with ``AxisType.Explicit`` over which ``a``'s type says it is sharded (empty outside that mode).
  Axes of size 1 count too: such an array is typed as sharded, and the sharded form (which ignores size-1 axes)
  takes it as it is."""
  sharding = getattr(jax.typeof(a), "sharding", None)
  mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
  if mesh is None or spec is None or not getattr(mesh, "axis_types", ()):
    return ()
  explicit = {n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Explicit}
  return tuple(n for entry in spec for n in (entry if isinstance(entry, tuple) else (entry,)) if n in explicit)


# ------------------------------------------------------------------------------------------------ dispatch

_WARNED: set[tuple] = set()


def _compute_dtype(x_dtype, w_dtype, opts: LossOptions, platform: str):
  if opts.dtype is not None:
    return jnp.dtype(opts.dtype)
  dtype = jnp.promote_types(x_dtype, w_dtype)
  low = (jnp.bfloat16, jnp.float16)
  if platform == "gpu" and dtype == jnp.float32 and (x_dtype in low or w_dtype in low):
    key = (str(x_dtype), str(w_dtype))
    if key not in _WARNED:
      _WARNED.add(key)
      warnings.warn(
          f"lce_flax: x is {x_dtype} and w is {w_dtype}; JAX promotion makes the head's matmuls float32, which "
          "runs the exact float32 path, not the bf16 kernels. Pass dtype=jnp.bfloat16 (LossOptions.dtype or a "
          "head's dtype=) for mixed precision, or dtype=jnp.float32 to keep float32 and silence this warning.",
          stacklevel=4)
  return dtype


def _dispatch(num_tokens: int, hidden: int, vocab: int, dtype, w_layout: str, opts: LossOptions, platform: str,
              shards: int = 1) -> tuple[Any, common.Spec, common.Design]:
  """(module, spec, design) of the implementation that runs; every fallback is decided and noted here.

  ``shards`` > 1: the vocabulary is split over that many devices (the vocab-parallel head,
  :mod:`lce_flax._impl.vocab_parallel`); the design is that of one shard's V/shards columns, and only the
  chunked backend has a fast design there."""
  interpret = _device.default_interpret() if opts.interpret is None else bool(opts.interpret)
  spec = common.Spec(opts.spec(vocab), w_layout, interpret)
  shard_spec = spec if shards == 1 else common.Spec(opts.spec(vocab // shards), w_layout, interpret)
  want = opts.design_mode
  auto = opts.impl == "auto"
  names = _auto_order() if auto else (opts.impl,)
  # the chunk option set (at most one; options.py has checked that it belongs to the mode asked for)
  chunk = next(((f, v) for f in ("token_chunk", "vocab_chunk") if (v := getattr(opts, f)) is not None), None)
  notes, reasons = [], []
  for i, name in enumerate(names):
    last = i == len(names) - 1
    try:
      mod = _module(name)
      mod.supported(spec, platform, dtype)
      config = opts.config
      if chunk is not None:
        field, val = chunk
        if getattr(mod, "Config", None) is None or field not in mod.Config.__dataclass_fields__:
          loop = "tokens" if field == "token_chunk" else "vocabulary columns"
          why = (f"{field}={val} rules out impl={name!r}: it has no design that loops over {loop}"
                 + ("" if name != "xla" else " (it has no chunk loop)"))
          raise NotImplementedError(why) if auto else ValueError(why)
        config = mod.Config(**{field: val})
      mode = want
      what = "fast design" if shards == 1 else f"vocab-parallel fast design (V split over {shards} devices)"
      has_fast = mod.fast is not None and (shards == 1 or name == "chunked")
      if not has_fast and want == "fast":
        if opts.mode == "fast" and not auto:
          raise ValueError(f"mode='fast': impl={name!r} has no {what}; use mode='lean' (or mode=None)")
        if auto and (not last or chunk is not None and chunk[0] == "token_chunk"):
          raise NotImplementedError(f"no {what}")
        mode = "lean"
      try:
        design = mod.design(num_tokens, hidden, shard_spec, dtype, mode, config)
      except ValueError as e:  # under auto the only value given to a design is the chunk option: one that refuses
        if not auto or chunk is None:  # it is skipped, like a backend that cannot run
          raise
        raise NotImplementedError(f"{e} (impl={name!r} refuses it)") from e
      if mode != want:
        notes.append(f"{name} has no {what}: runs its {design.name!r} design")
      if shards > 1:
        notes.append(f"vocab-parallel: each of {shards} devices runs {vocab // shards} columns; design and memory "
                     "are per device")
    except NotImplementedError as e:
      reasons.append(f"{name}: {e}")
      continue
    if opts.interpret is not None and name not in KERNEL_IMPLS:
      raise ValueError(f"interpret={opts.interpret} would be ignored: impl={name!r} runs no Pallas kernel")
    if reasons:
      notes.insert(0, "skipped " + "; ".join(reasons))
    if interpret and name in KERNEL_IMPLS:
      notes.append("kernels run in Pallas interpret mode (slow; for testing)")
    return mod, spec, common.Design(*[getattr(design, f) for f in ("impl", "mode", "name", "config", "chunking",
                                                                   "memory_bytes")],
                                    notes=tuple(design.notes) + tuple(notes))
  raise ValueError(f"impl={opts.impl!r} cannot run here ({'; '.join(reasons)}); implementations that can run "
                   f"{jnp.dtype(dtype).name} inputs: {available_implementations(dtype, platform)}")


def explain(x, w, labels=None, *, bias=None, w_layout: str = "hv", vocab_shards: int = 1,
            options: LossOptions | None = None, **overrides: Any) -> common.Design:
  """What :func:`linear_cross_entropy` would run for these arguments, without running it.

  Arrays may be ``jax.ShapeDtypeStruct``; ``labels`` defaults to ``x.shape[:-1]``. Returns a
  :class:`~lce_flax._impl.common.Design`: the implementation, the mode, the design inside it, its fully resolved
  config, the chunking in words, a bound on the extra memory in bytes, and notes on every decision dispatch took
  (a backend skipped and why, lean instead of fast, a dtype cast). ``vocab_shards``: the number of devices ``w``'s
  vocabulary is split over (a vocab-parallel head; ``w`` is then the whole head's shape), whose per-device design
  this returns.

  Example:
    >>> import jax, jax.numpy as jnp, lce_flax
    >>> x = jax.ShapeDtypeStruct((8192, 4096), jnp.bfloat16); w = jax.ShapeDtypeStruct((4096, 128256), jnp.bfloat16)
    >>> d = lce_flax.explain(x, w, impl="chunked")
    >>> d.impl, d.mode, d.name, d.chunking
    ('chunked', 'fast', 'token_chunks', 'token chunks of 2048 tokens')
  """
  opts = resolve(options, overrides)
  x, w, bias = _shape_dtype(x, "x"), _shape_dtype(w, "w"), _shape_dtype(bias, "bias")
  labels = jax.ShapeDtypeStruct(x.shape[:-1], jnp.int32) if labels is None else _shape_dtype(labels, "labels")
  _check(x, w, labels, bias, None, w_layout)
  platform = _device.platform()
  dtype = _compute_dtype(x.dtype, w.dtype, opts, platform)
  num_tokens = math.prod(labels.shape)
  vocab = common.vocab_size(w, w_layout)
  if not isinstance(vocab_shards, int) or vocab_shards < 1 or vocab % vocab_shards:
    raise ValueError(f"vocab_shards={vocab_shards!r} must be a positive int dividing V={vocab}")
  _, _, design = _dispatch(num_tokens, x.shape[-1], vocab, dtype, w_layout, opts, platform, vocab_shards)
  if dtype != jnp.promote_types(x.dtype, w.dtype) or x.dtype != w.dtype:
    design = common.Design(*[getattr(design, f) for f in ("impl", "mode", "name", "config", "chunking",
                                                          "memory_bytes")],
                           notes=(f"x ({x.dtype}) and w ({w.dtype}) are cast to {dtype.name}", *design.notes))
  return design


# ------------------------------------------------------------------------------------------------ the op


def linear_cross_entropy(
    x: jax.Array,
    w: jax.Array,
    labels: jax.Array,
    *,
    bias: jax.Array | None = None,
    where: jax.Array | None = None,
    w_layout: str = "hv",
    return_aux: bool = False,
    options: LossOptions | None = None,
    **overrides: Any,
):
  r"""Cross-entropy of a linear head, without materialising the ``[..., V]`` float32 logits.

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
    where: optional ``[...]`` mask, bool or numeric (nonzero counts); masked tokens are not counted (as
      optax's ``where=``).
    w_layout: ``"hv"`` or ``"vh"``, see ``w``.
    return_aux: also return an :class:`Aux` (per-token loss and lse, accuracy counts).
    options: a :class:`lce_flax.LossOptions` (default ``LossOptions()``).
    **overrides: fields of :class:`lce_flax.LossOptions` by name (``reduction=``, ``ignore_index=``,
      ``label_smoothing=``, ``z_loss=``, ``logit_softcap=``, ``dtype=``, ``impl=``, ``mode=``, ``token_chunk=``,
      ``vocab_chunk=``, ``interpret=``, ``config=``), applied on top of ``options``.

  Returns:
    The float32 loss (scalar, or ``[...]`` for ``reduction="none"``), and an :class:`Aux` if ``return_aux``.
    Gradients flow to x, w and bias in their own dtypes.

  Run-time values: labels outside ``[0, V)`` that are not ``ignore_index`` give that token a NaN loss (and NaN
  gradients), so the reduced loss is NaN: a bad label never yields a plausible number. NaN or inf in x or w
  propagate to the loss as in the unfused head. An empty batch gives loss 0 (``"mean"``, ``"sum"``) or an
  empty array (``"none"``), and zero gradients. :func:`explain` says what runs for given arguments.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from lce_flax import linear_cross_entropy
    >>> x = jnp.ones((2, 3, 4)); w = jnp.zeros((4, 10)); y = jnp.array([[1, 2, -100], [0, 9, 9]])
    >>> print(f"{linear_cross_entropy(x, w, y):.4f}")  # uniform logits: log(10) per counted token
    2.3026
  """
  opts = resolve(options, overrides)
  x, w, labels = _shape_dtype(x, "x"), _shape_dtype(w, "w"), _shape_dtype(labels, "labels")
  bias, where = _shape_dtype(bias, "bias"), _shape_dtype(where, "where")
  x, w, labels = jnp.asarray(x), jnp.asarray(w), jnp.asarray(labels)
  _check(x, w, labels, bias, where, w_layout)
  sharded = {n: _explicit_axes(a) for n, a in (("x", x), ("w", w), ("labels", labels), ("bias", bias),
                                                  ("where", where)) if a is not None}
  if any(sharded.values()):
    from lce_flax import sharding  # pylint: disable=g-import-not-at-top
    return sharding.from_types(x, w, labels, bias=bias, where=where, w_layout=w_layout, return_aux=return_aux,
                               options=opts)
  from lce_flax import _partition  # pylint: disable=g-import-not-at-top
  # Auto mesh axes, or compiled kernels where jit may see sharded inputs with no context mesh: XLA partitions the
  # op by its custom_partitioning rule (a bare kernel custom call would make XLA gather every input).
  if _partition.auto_mesh_active() or _kernels_on_many_devices(x, w, labels, w_layout, opts):
    return _partition.linear_cross_entropy(x, w, labels, bias=bias, where=where, w_layout=w_layout,
                                           return_aux=return_aux, options=opts)
  return local_linear_cross_entropy(x, w, labels, bias=bias, where=where, w_layout=w_layout,
                                    return_aux=return_aux, options=opts)


def _kernels_on_many_devices(x, w, labels, w_layout: str, opts: LossOptions) -> bool:
  """Whether this call runs compiled kernels (Triton / Mosaic custom calls) in a process with several devices."""
  if jax.device_count() < 2 or labels.size == 0:
    return False
  platform = _device.platform()
  dtype = _compute_dtype(x.dtype, w.dtype, opts, platform)
  _, spec, design = _dispatch(labels.size, x.shape[-1], common.vocab_size(w, w_layout), dtype, w_layout, opts,
                              platform)
  return design.impl in KERNEL_IMPLS and not spec.interpret


def local_linear_cross_entropy(x, w, labels, *, bias=None, where=None, w_layout="hv", return_aux=False,
                               options: LossOptions, count=None, vocab_axes: tuple[str, ...] = ()):
  """The op on one device's arrays (inside ``shard_map`` or a ``custom_partitioning`` lowering when sharded).

  ``count`` replaces the counted-token total of ``mean`` (the sharded forms pass the global count);
  ``vocab_axes``: mesh axes ``w``'s (and ``bias``'s) vocabulary is split over, this device holding its shard
  (the vocab-parallel head, :mod:`lce_flax._impl.vocab_parallel`); x and labels are then the same on each."""
  from lce_flax._impl import chunked, vocab_parallel  # pylint: disable=g-import-not-at-top
  opts = options
  batch_shape = labels.shape
  platform = _device.platform()
  dtype = _compute_dtype(x.dtype, w.dtype, opts, platform)
  shards = vocab_parallel.axes_size(vocab_axes) if vocab_axes else 1
  vocab = common.vocab_size(w, w_layout) * shards
  norm = _math.normalize_labels(labels.reshape(-1), None if where is None else where.reshape(-1) != 0,
                                opts.ignore_index, vocab)
  counted = norm != _math.IGNORED
  local_count = counted.sum(dtype=jnp.int32)
  total = local_count if count is None else count
  if labels.size == 0:  # the documented all-ignored result; no implementation runs on zero tokens
    loss = jnp.zeros(batch_shape if opts.reduction == "none" else (), jnp.float32)
    aux = Aux(jnp.zeros(batch_shape, jnp.float32), jnp.zeros(batch_shape, jnp.float32), jnp.int32(0),
              jnp.int32(0))
    return (loss, aux) if return_aux else loss
  mod, spec, design = _dispatch(norm.shape[0], x.shape[-1], vocab, dtype, w_layout, opts, platform, shards)
  x2 = x.reshape(-1, x.shape[-1]).astype(dtype)
  w = w.astype(dtype)
  if design.mode == "fast":
    weights = counted.astype(jnp.float32)
    if opts.reduction == "mean":
      weights = weights / jnp.maximum(total, 1).astype(jnp.float32)
    if shards > 1:  # (dispatch picks chunked: the one vocab-parallel fast design)
      local = vocab_parallel.localize(norm, vocab_axes, vocab // shards)
      loss, out = chunked.fast(x2, w, bias, local, weights, spec, design.config, axis=vocab_axes)
    else:
      loss, out = mod.fast(x2, w, bias, norm, weights, spec, design.config)
  else:
    if shards > 1:
      out = vocab_parallel.lean(x2, w, bias, norm, spec, design.config, mod, vocab_axes)
    else:
      out = mod.lean(x2, w, bias, norm, spec, design.config)
    if opts.reduction == "none":
      loss = out.loss.reshape(batch_shape)
    else:
      loss = out.loss.sum()
      if opts.reduction == "mean":
        loss = loss / jnp.maximum(total, 1).astype(jnp.float32)
  if not return_aux:
    return loss
  return loss, Aux(out.loss.reshape(batch_shape), out.lse.reshape(batch_shape),
                   out.correct.sum(dtype=jnp.int32), local_count)
