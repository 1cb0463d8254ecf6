"""The op on one device: the backend protocol, the registry, the routing to a design, the two ``custom_vjp``s.

Everything above this file (``api.py``, ``sharding.py``, ``_partition.py``) ends in :func:`per_device`; everything
below it (the backends of ``lce_flax/_impl/``) holds plans and kernels only. Data flows one way::

    per_device → dispatch (Route: backend, spec, design) → lean / fast custom_vjp → backend.stats / grads → kernels

* :class:`Backend` is what a backend module provides (a module satisfies it structurally: the backends import
  nothing from here); :class:`FastBackend` adds the fast design's forward and backward.
* :data:`REGISTRY`: every implementation, with what it needs (the compute capability of its kernels, named in
  :mod:`lce_flax._device`; interpret mode; a fast design on a vocabulary shard), in one table.
* :func:`check_arguments`: the op's arguments checked once, with errors that name what they got.
* :func:`dispatch`: the backend and design that run for a problem and the options; every fallback is decided and
  written into ``Design.notes`` here, and warned about once.
* :func:`lean`: the recompute ``custom_vjp`` (8·B·H·V FLOPs, O(B) residuals), written once for every backend;
  with reduction ``axes`` it is the vocab-parallel head: the same vjp plus the row statistics' all-reduce and the
  psum of the partial dx (:mod:`lce_flax._impl.vocab_parallel`).
* :func:`fast`: the ``custom_vjp`` of the fast designs (6·B·H·V FLOPs), written once: the backend's forward forms
  the gradients (or what they are made of) while the logits are on hand; the backward scales them.
* :func:`entropy`: the ``custom_vjp`` of ``Aux.entropy`` (``LossOptions.entropy``): one pass of its own over the
  vocabulary for every backend (chunked's column loop), its own recompute backward; collectives as in
  :func:`lean` on a vocabulary shard.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from lce_flax import _device, _math
from lce_flax._impl import chunked, common, pallas_mosaic, pallas_triton, reference, triton, vocab_parallel
from lce_flax._impl.common import F32
from lce_flax.options import LossOptions

# ------------------------------------------------------------------------------------------------ the protocol


@runtime_checkable
class Backend(Protocol):
  """What every backend module provides, for a 2-D problem (``x`` [B, H], ``w`` [H, V] or [V, H], ``bias`` [V] or
  None, normalised ``labels`` [B] int32; see :mod:`lce_flax._impl.common` for the column and label protocol).

  ``plan`` is ``design(...).config``: the backend's config with every field resolved for one shape and mode.
  """

  Config: type  # the backend's knobs (``lce_flax.ChunkedConfig``, ...); ``vocab_chunk`` / ``token_chunk`` fields
  # where its designs loop over vocabulary columns / tokens

  def supported(self, spec: common.Spec, platform: str, dtype: Any = None) -> None:
    """Raises ``NotImplementedError`` naming what this backend cannot run (a dtype, a missing package)."""

  def design(self, num_tokens: int, hidden: int, spec: common.Spec, dtype: Any, mode: str,
             config: Any = None) -> common.Design:
    """The design that runs for ``mode`` with its plan; ``ValueError`` naming a bad config field,
    ``NotImplementedError`` when there is no design for ``mode``."""

  def stats(self, x, w, bias, labels, spec: common.Spec, plan: Any) -> _math.RowStats:
    """Row statistics of the columns ``w`` holds: the lean forward before :func:`lce_flax._math.finalize`."""

  def grads(self, x, w, bias, labels, lse, g_loss, g_lse, spec: common.Spec, plan: Any):
    """The lean backward over the columns ``w`` holds for the given (whole-vocabulary) ``lse``:
    (dx float32, dw in w's dtype, dbias float32 or None)."""


@runtime_checkable
class FastBackend(Backend, Protocol):
  """A backend with a fast design: gradients formed while the logits are on hand."""

  def fast_forward(self, x, w, bias, labels, weights, spec: common.Spec, plan: Any, axes: tuple[str, ...]):
    """``(Σ weights·loss, TokenOut, residuals)``; ``axes``: mesh axes w's vocabulary is split over (empty on one
    device; only backends registered with ``vocab_parallel_fast`` take any)."""

  def fast_backward(self, residuals, g_total, spec: common.Spec, plan: Any, primals: Primals, g_tokens=None):
    """(dx, dw, dbias) in the inputs' dtypes for the scalar cotangent ``g_total``, plus, for a design that forms dz
    in its backward (``Design.token_cotangents``), ``g_tokens`` = (cotangents of the per-token losses, of the
    per-token lse; float32 [B]); None for the others."""

  # Optional: ``per_token_config(config) -> config | None``, the config of a fast design that takes per-token
  # cotangents where the backend's default fast design does not (None: there is none, or the user chose the design).


class Primals(NamedTuple):
  """Static facts about the fast op's inputs that a backward may need (hashable: a ``nondiff_argnums`` argument)."""

  x_shape: tuple[int, ...]
  w_shape: tuple[int, ...]
  bias_dtype: Any
  x_grad: bool = True  # whether x is differentiated (set for the backward from the forward's inputs)
  w_grad: bool = True  # whether w is (False: a frozen head; the backward may skip dw)


@dataclasses.dataclass(frozen=True)
class _Perturbed:
  """Which of x and w are differentiated, carried from the fast forward to its backward (a pytree with no
  leaves)."""

  x: bool
  w: bool


jax.tree_util.register_dataclass(_Perturbed, data_fields=[], meta_fields=["x", "w"])


# ------------------------------------------------------------------------------------------------ the registry


@dataclasses.dataclass(frozen=True)
class Entry:
  """One implementation: its module and what it needs to run."""

  backend: Backend
  kernels: bool = False  # runs Pallas / Triton kernels: ``interpret`` applies, a GPU or interpret mode is needed
  min_cc: tuple[int, int] | None = None  # the compute capability its kernels need (compiled, not interpreted)
  needs: str = ""  # what the kernels are, in words, for the error that says why they cannot run
  interpretable: bool = True  # kernels that Pallas can interpret on any platform
  vocab_parallel_fast: bool = False  # its fast design runs with w's vocabulary split over mesh axes
  autodiff: bool = False  # differentiated by JAX on one device (the oracle: no hand-written backward)

  @property
  def has_fast(self) -> bool:
    return isinstance(self.backend, FastBackend)


REGISTRY: dict[str, Entry] = {
    "xla": Entry(reference, autodiff=True),
    "chunked": Entry(chunked, vocab_parallel_fast=True),
    "pallas_triton": Entry(pallas_triton, kernels=True, min_cc=_device.AMPERE,
                           needs="Pallas kernels lowered through Triton"),
    "triton": Entry(triton, kernels=True, min_cc=_device.AMPERE, needs="raw Triton kernels", interpretable=False),
    "pallas_mosaic": Entry(pallas_mosaic, kernels=True, min_cc=_device.HOPPER, needs="WGMMA (Hopper) kernels"),
}
# What ``impl="auto"`` tries, fastest first; each needs its ``min_cc`` (chunked, last, runs anywhere).
AUTO_ORDER = ("pallas_mosaic", "pallas_triton", "chunked")


def auto_order(cc: tuple[int, int] | None = None) -> tuple[str, ...]:
  """The implementations ``impl="auto"`` tries on a device of compute capability ``cc`` (default: this one)."""
  cc = _device.compute_capability() if cc is None else cc
  return tuple(n for n in AUTO_ORDER if REGISTRY[n].min_cc is None or (cc is not None and cc >= REGISTRY[n].min_cc))


def check_supported(name: str, spec: common.Spec, platform: str, dtype) -> None:
  """Raises ``NotImplementedError`` naming why ``name`` cannot run here: the platform or compute capability its
  kernels need (unless interpreted), then the backend's own checks (dtypes, packages)."""
  entry = REGISTRY[name]
  if entry.kernels and spec.interpret and not entry.interpretable:
    raise NotImplementedError(f"impl={name!r} runs {entry.needs}, which need an NVIDIA GPU (platform={platform!r}, "
                              "interpret=True); it has no interpret mode: use impl='pallas_triton' (interpret=True) "
                              "or impl='chunked' here")
  if entry.kernels and not spec.interpret:
    if platform != "gpu":
      alt = " or interpret=True" if entry.interpretable else ""
      raise NotImplementedError(f"impl={name!r} runs {entry.needs}, which need an NVIDIA GPU (platform={platform!r})"
                                f"{alt}")
    cc = _device.compute_capability()
    if cc is None or cc < entry.min_cc:
      raise NotImplementedError(f"impl={name!r} needs an NVIDIA GPU with compute capability >= "
                                f"{'.'.join(map(str, entry.min_cc))}, got {cc}")
  entry.backend.supported(spec, platform, dtype)


def available_implementations(dtype=jnp.bfloat16, platform: str | None = None) -> list[str]:
  """Names of the implementations that can run ``dtype`` inputs on ``platform`` (default: this device)."""
  platform = platform or _device.platform()
  spec = common.Spec(_math.LossSpec(vocab_size=2), interpret=False)
  names = []
  for name in REGISTRY:
    try:
      check_supported(name, spec, platform, jnp.dtype(dtype))
      names.append(name)
    except NotImplementedError:
      pass
  return names


# ------------------------------------------------------------------------------------------------ arguments


def shape_dtype(a, name: str):
  """``a`` as something with a shape and a dtype (an array, a ``ShapeDtypeStruct``); None stays None."""
  if a is None:
    return None
  if not hasattr(a, "shape") or not hasattr(a, "dtype"):
    try:
      a = jnp.asarray(a)
    except TypeError:
      raise TypeError(f"{name} must be an array, got a {type(a).__name__}") from None
  return a


def check_arguments(x, w, labels, bias, where, w_layout: str) -> None:
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


# ------------------------------------------------------------------------------------------------ dispatch


class Route(NamedTuple):
  """What runs for one problem: the backend's name, the loss's spec, the design (with its plan), and the fallbacks
  taken on the way (also among ``design.notes``), which the op warns about once at trace time."""

  name: str
  spec: common.Spec
  design: common.Design
  dtype: Any  # the dtype x and w are cast to before the matmuls
  fallbacks: tuple[str, ...] = ()

  @property
  def entry(self) -> Entry:
    return REGISTRY[self.name]


_WARNED: set[tuple] = set()


def warn_once(key: tuple, message: str) -> None:
  """A ``UserWarning`` at trace time, the first time ``key`` is seen in this process."""
  if key not in _WARNED:
    _WARNED.add(key)
    warnings.warn(f"lce_flax: {message}", stacklevel=4)


def compute_dtype(x_dtype, w_dtype, opts: LossOptions, platform: str):
  """The dtype x and w are cast to before the matmuls: ``opts.dtype``, else their promotion (warned about on a GPU
  when it turns bf16 activations or weights into float32 matmuls)."""
  if opts.dtype is not None:
    return jnp.dtype(opts.dtype)
  dtype = jnp.promote_types(x_dtype, w_dtype)
  low = (jnp.bfloat16, jnp.float16)
  if platform == "gpu" and dtype == jnp.float32 and (x_dtype in low or w_dtype in low):
    warn_once(("promotion", str(x_dtype), str(w_dtype)),
              f"x is {x_dtype} and w is {w_dtype}; JAX promotion makes the head's matmuls float32, which runs the "
              "exact float32 path, not the bf16 kernels. Pass dtype=jnp.bfloat16 (LossOptions.dtype or a head's "
              "dtype=) for mixed precision, or dtype=jnp.float32 to keep float32 and silence this warning.")
  return dtype


def _with_notes(design: common.Design, *notes: str, first: bool = False) -> common.Design:
  notes = tuple(n for n in notes if n)
  return dataclasses.replace(design, notes=(*notes, *design.notes) if first else (*design.notes, *notes))


def dispatch(num_tokens: int, hidden: int, vocab: int, dtype, w_layout: str, opts: LossOptions, platform: str,
             shards: int = 1) -> Route:
  """The backend and design that run; every fallback is decided and noted here.

  ``shards`` > 1: the vocabulary is split over that many devices (the vocab-parallel head); the design is that of
  one shard's V/shards columns, and only backends registered with ``vocab_parallel_fast`` have a fast design
  there. A chunk option (``token_chunk`` / ``vocab_chunk``) is honoured or refused: ``impl="auto"`` skips a design
  that refuses it (and says so), an explicit impl raises ``ValueError`` naming the option and the impl.
  ``reduction="none"`` with ``mode=None`` runs a fast design that takes per-token cotangents where the backend has
  one (:func:`_per_token_fast`), else lean; with ``mode="fast"`` only such a design runs (or ``"xla"``'s autodiff):
  where there is none, ``ValueError`` (:func:`_token_cotangents_error`; auto skips such a candidate but the last)."""
  interpret = _device.default_interpret() if opts.interpret is None else bool(opts.interpret)
  spec = common.Spec(opts.spec(vocab), w_layout, interpret)
  shard_spec = spec if shards == 1 else common.Spec(opts.spec(vocab // shards), w_layout, interpret)
  want = opts.design_mode
  auto = opts.impl == "auto"
  names = auto_order() if auto else (opts.impl,)
  # the chunk option set (at most one; options.py has checked that it belongs to the mode asked for)
  chunk = next(((f, v) for f in ("token_chunk", "vocab_chunk") if (v := getattr(opts, f)) is not None), None)
  notes, reasons = [], []
  per_token = opts.mode is None and opts.reduction == "none" and chunk is None
  # mode='fast' with reduction='none': only a fast design that takes per-token cotangents runs (never lean)
  fast_tokens = opts.mode == "fast" and opts.reduction == "none"
  what = "fast design" if shards == 1 else f"vocab-parallel fast design (V split over {shards} devices)"
  for i, name in enumerate(names):
    last = i == len(names) - 1
    entry = REGISTRY[name]
    config = opts.config
    # (mode='fast', reduction='none' where this impl has no fast design that takes per-token cotangents)
    refuse = functools.partial(_token_cotangents_error, name, entry, opts=opts, shards=shards, auto=auto,
                               last=last, reasons=reasons)
    try:
      check_supported(name, spec, platform, dtype)
      if chunk is not None:
        field, val = chunk
        if field not in entry.backend.Config.__dataclass_fields__:
          loop = "tokens" if field == "token_chunk" else "vocabulary columns"
          why = f"{field}={val} rules out impl={name!r}: it has no design that loops over {loop}"
          raise NotImplementedError(why) if auto else ValueError(why)
        config = entry.backend.Config(**{field: val})
      mode = want
      # (the oracle's autodiff is one computation for both modes)
      has_fast = shards == 1 and entry.autodiff or entry.has_fast and (shards == 1 or entry.vocab_parallel_fast)
      if not has_fast and want == "fast":
        if fast_tokens:
          raise refuse(None, config)
        if opts.mode == "fast" and not auto:
          raise ValueError(f"mode='fast': impl={name!r} has no {what}; use mode='lean' (or mode=None)")
        if auto and (not last or chunk is not None):
          raise NotImplementedError(f"no {what}")
        mode = "lean"
      try:
        design = entry.backend.design(num_tokens, hidden, shard_spec, dtype, mode, config)
        if per_token and entry.has_fast and shards == 1:
          design = _per_token_fast(entry, num_tokens, hidden, shard_spec, dtype, config) or design
      except ValueError as e:  # under auto the only value given to a design is the chunk option: a design that
        if fast_tokens and _chooses_scalar_fast(name, entry, config, shards):  # (the refusal says more)
          raise refuse(None, config) from e
        if not auto or chunk is None:  # refuses it is skipped, like a backend that cannot run
          raise
        raise NotImplementedError(f"{e} (impl={name!r} refuses it)") from e
      if fast_tokens:
        default = design
        if shards > 1:
          raise refuse(default, config)
        if entry.autodiff:  # the oracle: JAX's autodiff takes any cotangent (one computation for both modes)
          design = _with_notes(design, "mode='fast', reduction='none': JAX's autodiff through the stored logits "
                                       "takes the per-token cotangents (the same computation as mode='lean' here)")
        else:
          design = _per_token_fast(entry, num_tokens, hidden, shard_spec, dtype, config, default,
                                   "mode='fast', reduction='none'")
          if design is None:
            raise refuse(default, config)
    except NotImplementedError as e:
      reasons.append(f"{name}: {e}")
      continue
    if opts.interpret is not None and not entry.kernels:
      raise ValueError(f"interpret={opts.interpret} would be ignored: impl={name!r} runs no Pallas kernel")
    fallbacks = ["skipped " + "; ".join(reasons)] if reasons else []
    mode = design.mode
    if mode != want and not per_token:
      fallbacks.append(f"{name} has no {what}: runs its {design.name!r} design")
      notes.append(fallbacks[-1])
    if shards > 1:
      notes.append(f"vocab-parallel: each of {shards} devices runs {vocab // shards} columns; design and memory are "
                   "per device")
    if interpret and entry.kernels:
      notes.append("kernels run in Pallas interpret mode (slow; for testing)")
    if opts.entropy:
      design = _entropy_note(design, num_tokens, hidden, vocab // shards, opts)
    design = _with_notes(design, *notes)
    if reasons:
      design = _with_notes(design, "skipped " + "; ".join(reasons), first=True)
    return Route(name, spec, design, jnp.dtype(dtype), tuple(fallbacks))
  raise ValueError(f"impl={opts.impl!r} cannot run here ({'; '.join(reasons)}); implementations that can run "
                   f"{jnp.dtype(dtype).name} inputs: {available_implementations(dtype, platform)}")


def _entropy_note(design: common.Design, num_tokens: int, hidden: int, columns: int, opts: LossOptions
                  ) -> common.Design:
  """``entropy=True``: the entropy's own pass, in the notes and in the memory bound (its [B, c] float32 chunks and
  the float32 dx of its backward, on top of the design's)."""
  c = entropy_chunk(num_tokens, columns, opts.vocab_chunk)
  note = (f"entropy=True: aux.entropy is one more pass over the vocabulary, the same for every impl (XLA matmuls in "
          f"chunks of {c} columns): 2·B·H·V FLOPs, and 6·B·H·V more in the backward when aux.entropy is "
          "differentiated")
  return dataclasses.replace(design, memory_bytes=design.memory_bytes + 3 * num_tokens * c * 4
                             + num_tokens * hidden * 4, notes=(*design.notes, note))


def _per_token_fast(entry: Entry, num_tokens: int, hidden: int, spec: common.Spec, dtype, config,
                    default: common.Design | None = None, asked: str = "reduction='none'") -> common.Design | None:
  """For ``reduction="none"``: a fast design of the backend that forms dz in its backward (and so takes per-token
  cotangents): its default one, else the one its ``per_token_config`` names; None when it has none (with
  ``mode=None`` the lean design runs; with ``mode='fast'`` dispatch raises). A config the fast design refuses (e.g.
  one with a lean ``vocab_chunk``) keeps the lean design. ``default``: the backend's fast design for ``config``
  where the caller has formed it already (``mode='fast'``: its config errors raised); ``asked``: what the note
  names as the reason."""
  def fast_design(cfg):
    try:
      design = entry.backend.design(num_tokens, hidden, spec, dtype, "fast", cfg)
    except (ValueError, NotImplementedError):
      return None
    return design if takes_token_cotangents(design.config) else None

  if default is not None:
    design = default if takes_token_cotangents(default.config) else None
  else:
    design = fast_design(config)
  note = "forms dz in its backward, so it takes the per-token cotangents"
  if design is None and hasattr(entry.backend, "per_token_config"):
    other = entry.backend.per_token_config(config)
    design = None if other is None else fast_design(other)
    if design is not None:
      note += (f" (the default fast design of these sizes takes none; this one holds the B×V logits: "
               f"{design.memory_bytes / 2**30:.2f} GiB, mode='lean' takes less)")
  if design is None:
    return None
  return dataclasses.replace(design, notes=(*design.notes, f"{asked}: the {design.name!r} fast design {note}"))


def _token_cotangent_impls() -> list[str]:
  """The implementations with a fast design that takes per-token cotangents where their default one does not (the
  backends with a ``per_token_config``: ``"pallas_mosaic"``)."""
  return [n for n, e in REGISTRY.items() if hasattr(e.backend, "per_token_config")]


def _chooses_scalar_fast(name: str, entry: Entry, config, shards: int) -> bool:
  """Whether ``config`` (a token chunk, a fast design) chose a fast design of ``name`` that takes no per-token
  cotangents where the backend has one that does (its ``per_token_config`` keeps the user's choice: None)."""
  return shards == 1 and name in _token_cotangent_impls() and entry.backend.per_token_config(config) is None


def _token_cotangents_error(name: str, entry: Entry, default: common.Design | None, config, *, opts: LossOptions,
                            shards: int, auto: bool, last: bool, reasons: list[str]) -> Exception:
  """The error of ``mode='fast'`` with ``reduction='none'`` where impl ``name`` has no fast design that takes
  per-token cotangents (``default``: its fast design for ``config``, None where it has none), saying why and what to
  do instead: a ``ValueError``, or under ``impl='auto'`` a ``NotImplementedError`` that skips a candidate but the
  last (the user asked for fast: auto never falls back to lean here)."""
  takers = _token_cotangent_impls()
  chosen = None  # the option that chose a fast design that takes none, where the backend has one that would
  if _chooses_scalar_fast(name, entry, config, shards):
    cfg = config or entry.backend.Config()
    chosen = (f"token_chunk={opts.token_chunk}" if opts.token_chunk is not None else
              f"config token_chunk={cfg.token_chunk}" if getattr(cfg, "token_chunk", None) is not None else
              f"config fast_design={getattr(cfg, 'fast_design', None)!r}")
  if shards > 1:
    why = (f"w's vocabulary is split over {shards} devices, where no fast design takes them ("
           + (f"its vocab-parallel {default.name!r} design forms the gradients in its forward, for one scalar "
              "cotangent)" if default is not None else "it has no vocab-parallel fast design)"))
  elif chosen is not None:
    which = "a fast design that loops over tokens" if default is None else f"its {default.name!r} fast design"
    why = (f"{chosen} chooses {which}, which forms the gradients in its forward, for one scalar cotangent; its fast "
           "design that takes them stores the logits of all tokens at once (it has no token loop)")
  elif default is None:
    why = "it has no fast design"
  else:
    why = f"its {default.name!r} fast design forms the gradients in its forward, for one scalar cotangent"
  if opts.token_chunk is not None and chosen is None:
    why += (f" (and token_chunk={opts.token_chunk} is for the fast designs that loop over tokens, none of which takes "
            "per-token cotangents)")
  if auto and not last:
    return NotImplementedError(f"mode='fast' with reduction='none': {why}")
  impl = f"impl={name!r}" if not auto else f"impl='auto' (which picks {name!r} here)"
  todo = [f"drop {chosen}"] if chosen is not None else []
  todo.append("use mode=None or mode='lean' (a lean design takes any per-token cotangent"
              + ("; vocab_chunk sets its chunk)" if opts.token_chunk is not None else ")"))
  if shards == 1 and name not in takers:
    todo.append(" or ".join(f"impl={t!r}" for t in takers) + " on a Hopper GPU with bf16/fp16 inputs (its "
                "'logits' fast design forms dz in its backward)")
  skipped = f" (skipped: {'; '.join(reasons)})" if reasons else ""
  return ValueError(f"mode='fast' with reduction='none' needs a fast design that takes per-token cotangents, and "
                    f"{impl} has none here: {why}{skipped}; {', or '.join(todo)}")


# ------------------------------------------------------------------------------------------------ the lean vjp


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def lean(x, w, bias, labels, spec: common.Spec, backend: Backend, plan, axes: tuple[str, ...] = ()
         ) -> _math.TokenOut:
  """Per-token loss, lse and correctness; differentiable in x, w and bias with any cotangent on loss and lse.

  The forward keeps O(B) residuals (x, w, bias, labels and lse); the backward recomputes the logits (8·B·H·V FLOPs
  in all). ``axes``: mesh axes w's vocabulary is split over (inside ``shard_map`` or a ``custom_partitioning``
  lowering; ``w`` holds this device's columns, ``labels`` are the normalised global ones): the row statistics are
  all-reduced across them before they are finalised, and the partial dx is psum'd in float32 before it is rounded.
  """
  local = vocab_parallel.localize(labels, axes, common.vocab_size(w, spec.w_layout)) if axes else labels
  st = backend.stats(x, w, bias, local, spec, plan)
  if axes:
    st = _math.all_reduce_stats(st, axes, spec.opts)
  return _math.finalize(st, labels, spec.opts)


def _lean_fwd(x, w, bias, labels, spec, backend, plan, axes):
  out = lean(x, w, bias, labels, spec, backend, plan, axes)
  return out, (x, w, bias, labels, out.lse)


def _lean_bwd(spec, backend, plan, axes, res, g):
  x, w, bias, labels, lse = res
  local = vocab_parallel.localize(labels, axes, common.vocab_size(w, spec.w_layout)) if axes else labels
  dx, dw, db = backend.grads(x, w, bias, local, lse, g.loss.astype(F32), g.lse.astype(F32), spec, plan)
  if axes:
    dx = jax.lax.psum(dx.astype(F32), axes)
  return dx.astype(x.dtype), dw, None if bias is None else db.astype(bias.dtype), None


lean.defvjp(_lean_fwd, _lean_bwd)


# ------------------------------------------------------------------------------------------------ the fast vjp


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def fast(x, w, bias, labels, weights, spec: common.Spec, backend: FastBackend, plan, axes: tuple[str, ...],
         primals: Primals):
  """``(Σ_t weights_t·loss_t, TokenOut)``, differentiable in x, w and bias through the scalar only (6·B·H·V FLOPs):
  the backend's forward forms the gradients while the logits are on hand, the backward scales them by the
  cotangent. The per-token outputs must not be differentiated (their cotangents must be symbolic zeros)."""
  del primals
  total, out, _ = backend.fast_forward(x, w, bias, labels, weights, spec, plan, axes)
  return total, out


def _fast_fwd(x, w, bias, labels, weights, spec, backend, plan, axes, primals):
  del primals
  # symbolic_zeros=True wraps each array argument in a CustomVJPPrimal (None stays None).
  total, out, res = backend.fast_forward(x.value, w.value, None if bias is None else bias.value, labels.value,
                                         weights.value, spec, plan, axes)
  return (total, out), (res, _Perturbed(bool(x.perturbed), bool(w.perturbed)))


def _fast_bwd(spec, backend, plan, axes, primals, res, g):
  del axes
  res, perturbed = res
  primals = primals._replace(x_grad=perturbed.x, w_grad=perturbed.w)
  g_total, g_out = g
  zero = lambda t, shape: jnp.zeros(shape, F32) if isinstance(t, jax.custom_derivatives.SymbolicZero) else t
  g_total = zero(g_total, ())
  if takes_token_cotangents(plan):  # dz formed in the backward: the per-token outputs are differentiable too
    rows = primals.x_shape[:1]
    dx, dw, db = backend.fast_backward(res, g_total, spec, plan, primals,
                                       g_tokens=(zero(g_out.loss, rows), zero(g_out.lse, rows)))
  else:
    common.check_fast_cotangents(g_out)
    dx, dw, db = backend.fast_backward(res, g_total, spec, plan, primals)
  return dx, dw, db, None, None


def takes_token_cotangents(plan) -> bool:
  """Whether the fast design of ``plan`` forms dz in its backward, and so takes any per-token cotangent."""
  return bool(getattr(plan, "token_cotangents", False))


fast.defvjp(_fast_fwd, _fast_bwd, symbolic_zeros=True)


# ------------------------------------------------------------------------------------------------ the entropy vjp


def entropy_chunk(num_tokens: int, columns: int, requested: int | None = None) -> int:
  """Vocabulary columns per chunk of the entropy's pass: ``requested`` (the ``vocab_chunk`` option), else chunked's
  lean rule (32 MiB of float32 logits, a power of two in [128, 16384]); at most ``columns``."""
  return chunked.lean_chunk(num_tokens, columns, requested)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def entropy(x, w, bias, spec: common.Spec, chunk: int, scale: float = 1.0, axes: tuple[str, ...] = ()):
  """Per-token entropy (float32 [B]) of ``softmax(scale·softcap(x @ w + bias))``; differentiable in x, w and bias.

  One pass over the columns of ``w`` in chunks of ``chunk`` (:func:`lce_flax._impl.chunked.entropy_stats`, O(B)
  residuals); the backward recomputes each chunk (:func:`lce_flax._impl.chunked.entropy_grads`). ``axes``: mesh
  axes w's vocabulary is split over (``w`` holds this device's columns): the stats are all-reduced across them
  and the partial dx is psum'd in float32, as in :func:`lean`."""
  return _entropy_fwd(x, w, bias, spec, chunk, scale, axes)[0]


def _entropy_fwd(x, w, bias, spec, chunk, scale, axes):
  st = chunked.entropy_stats(x, w, bias, spec, chunk, scale)
  if axes:
    st = _math.all_reduce_entropy(st, axes)
  ent, lse, mean = _math.finalize_entropy(st)
  return ent, (x, w, bias, lse, mean)


def _entropy_bwd(spec, chunk, scale, axes, res, g):
  x, w, bias, lse, mean = res
  dx, dw, db = chunked.entropy_grads(x, w, bias, lse, mean, g.astype(F32), spec, chunk, scale)
  if axes:
    dx = jax.lax.psum(dx.astype(F32), axes)
  return dx.astype(x.dtype), dw, None if bias is None else db.astype(bias.dtype)


entropy.defvjp(_entropy_fwd, _entropy_bwd)


def op_entropy(x, w, bias, w_layout: str, opts: LossOptions, vocab: int, vocab_axes: tuple[str, ...] = ()):
  """``Aux.entropy`` of the op on one device's 2-D ``x`` [B, H] (``vocab``: the whole vocabulary's size; ``w`` holds
  this device's columns when ``vocab_axes`` split it): x and w cast to the op's compute dtype, as the loss's."""
  dtype = compute_dtype(x.dtype, w.dtype, opts, _device.platform())
  spec = common.Spec(opts.spec(vocab), w_layout)
  chunk = entropy_chunk(x.shape[0], common.vocab_size(w, w_layout), opts.vocab_chunk)
  return entropy(x.astype(dtype), w.astype(dtype), bias, spec, chunk, 1.0, tuple(vocab_axes))


def check_entropy(opts: LossOptions, return_aux: bool) -> None:
  """``entropy=True`` puts the entropy in ``Aux``: without ``return_aux`` it would be computed for nothing."""
  if opts.entropy and not return_aux:
    raise ValueError("entropy=True returns the per-token entropy in Aux.entropy: pass return_aux=True (or leave "
                     "entropy off)")


# ------------------------------------------------------------------------------------------------ the op


class Aux(NamedTuple):
  """Per-token outputs of :func:`lce_flax.linear_cross_entropy` (``return_aux=True``), shaped like ``labels``.

  Attributes:
    token_loss: float32; 0 where not counted, NaN where the label is out of range.
    lse: float32 log-sum-exp of the (capped) logits, for every token (counted or not).
    num_correct: int32 scalar: counted tokens whose label has the largest logit.
    num_tokens: int32 scalar: counted tokens.
    entropy: with ``entropy=True`` (:class:`lce_flax.LossOptions`), float32 ``-Σ_v p_v log p_v`` of
      ``p = softmax(z')``, the capped logits (as ``lse``: no temperature, no label smoothing), for every token
      (counted or not: mask it yourself); else None. It carries a gradient to x, w and bias whatever the design
      and the reduction: it is computed by a pass of its own (the same for every implementation), whose backward
      runs only when it is differentiated. On a mesh too (the sharded forms add that backward to the loss's).
  """

  token_loss: jax.Array
  lse: jax.Array
  num_correct: jax.Array
  num_tokens: jax.Array
  entropy: jax.Array | None = None


def route_for(x, w, labels, w_layout: str, opts: LossOptions, shards: int = 1) -> Route:
  """:func:`dispatch` for these (validated) arrays: the route of the per-device op."""
  platform = _device.platform()
  dtype = compute_dtype(x.dtype, w.dtype, opts, platform)
  vocab = common.vocab_size(w, w_layout) * shards
  return dispatch(math.prod(labels.shape), x.shape[-1], vocab, dtype, w_layout, opts, platform, shards)


def per_device(x, w, labels, *, bias=None, where=None, w_layout="hv", return_aux=False, options: LossOptions,
               count=None, vocab_axes: tuple[str, ...] = (), route: Route | None = None):
  """The op on one device's (validated) arrays, inside ``shard_map`` or a ``custom_partitioning`` lowering when
  sharded.

  ``count`` replaces the counted-token total of ``mean`` (the sharded forms pass the global count);
  ``vocab_axes``: mesh axes ``w``'s (and ``bias``'s) vocabulary is split over, this device holding its shard
  (the vocab-parallel head); x and labels are then the same on each. ``route``: the caller's :func:`dispatch` of
  this very problem (dispatched here when None)."""
  opts = options
  batch_shape = labels.shape
  shards = vocab_parallel.axes_size(vocab_axes) if vocab_axes else 1
  vocab = common.vocab_size(w, w_layout) * shards
  norm = _math.normalize_labels(labels.reshape(-1), None if where is None else where.reshape(-1) != 0,
                                opts.ignore_index, vocab)
  counted = norm != _math.IGNORED
  local_count = counted.sum(dtype=jnp.int32)
  total = local_count if count is None else count
  if labels.size == 0:  # the documented all-ignored result; no implementation runs on zero tokens
    loss = jnp.zeros(batch_shape if opts.reduction == "none" else (), jnp.float32)
    zeros = jnp.zeros(batch_shape, jnp.float32)
    aux = Aux(zeros, zeros, jnp.int32(0), jnp.int32(0), zeros if opts.entropy else None)
    return (loss, aux) if return_aux else loss
  route = route or route_for(x, w, labels, w_layout, opts, shards)
  for fallback in route.fallbacks:
    warn_once(("fallback", fallback), f"{fallback} (lce_flax.explain(...) reports every decision)")
  entry, spec, design = route.entry, route.spec, route.design
  x2 = x.reshape(-1, x.shape[-1]).astype(route.dtype)
  w = w.astype(route.dtype)
  axes = tuple(vocab_axes)
  if design.mode == "fast":
    weights = counted.astype(F32)
    if opts.reduction == "mean":
      weights = weights / jnp.maximum(total, 1).astype(F32)
    if entry.autodiff and not axes:
      out = _math.finalize(entry.backend.stats(x2, w, bias, norm, spec, design.config), norm, spec.opts)
      loss = jnp.sum(weights * out.loss)
    else:
      labels_here = vocab_parallel.localize(norm, axes, vocab // shards) if axes else norm
      primals = Primals(x2.shape, w.shape, None if bias is None else jnp.dtype(bias.dtype))
      loss, out = fast(x2, w, bias, labels_here, weights, spec, entry.backend, design.config, axes, primals)
    if opts.reduction == "none":  # (a design that takes per-token cotangents: the dispatch chose it)
      loss = out.loss.reshape(batch_shape)
  else:
    if entry.autodiff and not axes:
      out = _math.finalize(entry.backend.stats(x2, w, bias, norm, spec, design.config), norm, spec.opts)
    else:
      out = lean(x2, w, bias, norm, spec, entry.backend, design.config, axes)
    if opts.reduction == "none":
      loss = out.loss.reshape(batch_shape)
    else:
      loss = out.loss.sum()
      if opts.reduction == "mean":
        loss = loss / jnp.maximum(total, 1).astype(F32)
  if not return_aux:
    return loss
  ent = None
  if opts.entropy:  # its own pass and vjp, whatever the design
    ent = op_entropy(x2, w, bias, w_layout, opts, vocab, axes).reshape(batch_shape)
  return loss, Aux(out.loss.reshape(batch_shape), out.lse.reshape(batch_shape), out.correct.sum(dtype=jnp.int32),
                   local_count, ent)
