"""``linear_cross_entropy`` and ``explain``: the public op's validation, options built once, and routing.

api.py (this file: validation, routing, explain) → ``sharding.py`` (inputs typed as sharded over Explicit mesh
axes: ``shard_map``) or ``_partition.py`` (Auto mesh axes: ``custom_partitioning``) → the per-device op
(:func:`lce_flax._impl.base.per_device`: the backend, its design and the ``custom_vjp``) → the kernels. Each layer
imports only the ones below it. Everything users see — leading dims, masks, dtypes, reductions, errors, and every
routing and fallback decision — is decided once, and :func:`explain` reports it before anything runs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from lce_flax import _device, _partition, sharding
from lce_flax._impl import base, common
from lce_flax._impl.base import Aux, available_implementations, check_arguments, shape_dtype
from lce_flax.options import LossOptions, resolve

__all__ = ["IMPLEMENTATIONS", "Aux", "available_implementations", "explain", "linear_cross_entropy"]

IMPLEMENTATIONS: tuple[str, ...] = tuple(base.REGISTRY)  # the names ``impl=`` takes besides "auto"


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
  x, w, bias = shape_dtype(x, "x"), shape_dtype(w, "w"), shape_dtype(bias, "bias")
  labels = jax.ShapeDtypeStruct(x.shape[:-1], jnp.int32) if labels is None else shape_dtype(labels, "labels")
  check_arguments(x, w, labels, bias, None, w_layout)
  vocab = common.vocab_size(w, w_layout)
  if not isinstance(vocab_shards, int) or vocab_shards < 1 or vocab % vocab_shards:
    raise ValueError(f"vocab_shards={vocab_shards!r} must be a positive int dividing V={vocab}")
  platform = _device.platform()
  dtype = base.compute_dtype(x.dtype, w.dtype, opts, platform)
  route = base.dispatch(math.prod(labels.shape), x.shape[-1], vocab, dtype, w_layout, opts, platform, vocab_shards)
  design = route.design
  if dtype != jnp.promote_types(x.dtype, w.dtype) or x.dtype != w.dtype:
    design = dataclasses.replace(design, notes=(f"x ({x.dtype}) and w ({w.dtype}) are cast to {dtype.name}",
                                                *design.notes))
  where_to = _routing(x, w, labels, bias, None, opts, route, num_tokens=math.prod(labels.shape))[1]
  return dataclasses.replace(design, notes=(*design.notes, *where_to))


# ------------------------------------------------------------------------------------------------ routing


# Designs whose loop runs over the tokens. XLA's SPMD partitioner cannot split a loop along the dim it iterates
# over: on tokens that jit shards with no context mesh it all-gathers them and every device runs every chunk.
# Measured on 8 simulated CPU devices, tokens split 8 ways (B=32768, H=256, V=8192, value_and_grad): chunked's
# token_chunks 21.5 s (f32) / 24.9 s (bf16) left to XLA (x gathered to all 32768 tokens on each device) against
# 2.6 s / 3.7 s custom-partitioned. The lean design (a loop over vocabulary columns) and the xla reference (no
# loop) are split along the tokens by XLA itself: no gather, the partitioned form's time (3.4 s / 3.4 s lean).
_TOKEN_LOOPS = frozenset({("chunked", "token_chunks")})


def _routing(x, w, labels, bias, where, opts: LossOptions, route: base.Route | None, num_tokens: int
             ) -> tuple[str, tuple[str, ...]]:
  """Where the op runs — ``"explicit"`` (inputs typed as sharded: ``shard_map``), ``"partitioned"``
  (``custom_partitioning``) or ``"local"`` — and that decision in words, with its cost where it has one.

  With no context mesh, ``jit`` gives no sign at trace time that its inputs are sharded, so a process with several
  devices takes the partitioned form for what XLA cannot split by itself (compiled kernels, loops over tokens);
  what stays local there is said too, and where it is slow on sharded inputs, warned about."""
  typed = {n: _explicit_axes(a) for n, a in (("x", x), ("w", w), ("labels", labels), ("bias", bias),
                                               ("where", where)) if a is not None}
  if any(typed.values()):
    axes = sorted({a for ax in typed.values() for a in ax})
    return "explicit", (f"the inputs are typed as sharded over Explicit mesh axes {axes}: the op runs under "
                        "shard_map (lce_flax.sharding), each device runs it on its shard (the design shown is the "
                        "whole problem's; x, labels split over their first dim; w's V split: the vocab-parallel "
                        "head, explain(vocab_shards=...); w's H split: gathered once per call)"
                        + _narrow_note(x, w, opts),)
  n = jax.device_count()
  if _partition.auto_mesh_active():
    why = "the context mesh has Auto axes of size > 1"
  elif _kernels_on_many_devices(route, num_tokens):
    why = (f"this process has {n} devices and {route.name!r} runs compiled kernels (a bare kernel call on inputs "
           "that jit shards would make XLA gather them)")
  elif _token_loop_on_many_devices(route, num_tokens):
    why = (f"this process has {n} devices and the {route.design.name!r} design loops over token chunks, which "
           "XLA cannot split (on inputs that jit shards with no context mesh every device would gather all tokens "
           "and run every chunk)")
  else:
    return "local", _local_notes(route, num_tokens)
  cost = ("reduction='none': the backward re-runs the local forward inside jax.vjp (10·B·H·V FLOPs for a lean "
          "design instead of 8; O(B) residuals)" if opts.reduction == "none" else
          "the gradients are formed in the forward on each shard (the FLOPs of this design) and scaled in the "
          "backward")
  return "partitioned", (f"{why}: the op runs as custom-partitioned primitives (lce_flax._partition), each device "
                         f"runs it on its shard (the design shown is the whole problem's); {cost}"
                         + _narrow_note(x, w, opts),)


def _narrow_note(x, w, opts: LossOptions) -> str:
  """What :func:`lce_flax._partition.narrow` does to this call, if anything."""
  wide = [f"{n} is {a.dtype}" for n, a in (("x", x), ("w", w)) if _partition.narrows(a.dtype, opts)]
  if not wide:
    return ""
  to = jnp.dtype(opts.dtype).name
  return (f"; {' and '.join(wide)}: cast to {to} before the partitioned op, so w's gather and dw's reduction "
          f"across devices move {to} (as for nn.Dense(dtype={to})); the gradients come back in their dtypes")


def _on_many_devices(route: base.Route | None, num_tokens: int) -> bool:
  return route is not None and num_tokens > 0 and jax.device_count() > 1


def _kernels_on_many_devices(route: base.Route | None, num_tokens: int) -> bool:
  """Whether this call runs compiled kernels (Triton / Mosaic custom calls) in a process with several devices."""
  return _on_many_devices(route, num_tokens) and route.entry.kernels and not route.spec.interpret


def _token_loop_on_many_devices(route: base.Route | None, num_tokens: int) -> bool:
  """Whether this call runs a design that loops over tokens (``_TOKEN_LOOPS``) in a process with several
  devices."""
  return _on_many_devices(route, num_tokens) and (route.name, route.design.name) in _TOKEN_LOOPS


def _slow_locally(route: base.Route | None, num_tokens: int) -> bool:
  """Interpreted kernels in a process with several devices: they stay local (interpret mode is for testing;
  Mosaic's interpreter cannot run inside a partitioned body), and XLA gathers the inputs jit shards (measured
  15× slower on 8 CPU devices, B=1024, H=64, V=512)."""
  return _on_many_devices(route, num_tokens) and route.entry.kernels and route.spec.interpret


def _local_notes(route: base.Route | None, num_tokens: int) -> tuple[str, ...]:
  """What the local op does in a process with several devices (nothing to say on one device)."""
  if not _on_many_devices(route, num_tokens):
    return ()
  n = jax.device_count()
  if _slow_locally(route, num_tokens):
    return (f"this process has {n} devices and {route.name!r} runs interpreted kernels, which stay one XLA "
            "computation: on inputs that jit shards with no context mesh, XLA gathers them and every device "
            "computes every token (slow; interpret mode is for testing)",)
  return (f"this process has {n} devices and no context mesh: the op runs as one XLA computation, which jit "
          f"partitions itself (the {route.design.name!r} design has no loop over tokens: tokens jit shards are "
          "not gathered; for w split over a mesh, set a context mesh: docs/multi_gpu.md)",)


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
    return_aux: also return an :class:`Aux` (per-token loss and lse, accuracy counts; the per-token entropy with
      ``entropy=True``).
    options: a :class:`lce_flax.LossOptions` (default ``LossOptions()``).
    **overrides: fields of :class:`lce_flax.LossOptions` by name (``reduction=``, ``ignore_index=``,
      ``label_smoothing=``, ``z_loss=``, ``logit_softcap=``, ``dtype=``, ``impl=``, ``mode=``, ``token_chunk=``,
      ``vocab_chunk=``, ``interpret=``, ``config=``, ``entropy=``), applied on top of ``options``.

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
  x, w, labels = shape_dtype(x, "x"), shape_dtype(w, "w"), shape_dtype(labels, "labels")
  bias, where = shape_dtype(bias, "bias"), shape_dtype(where, "where")
  x, w, labels = jnp.asarray(x), jnp.asarray(w), jnp.asarray(labels)
  check_arguments(x, w, labels, bias, where, w_layout)
  base.check_entropy(opts, return_aux)
  kw = dict(bias=bias, where=where, w_layout=w_layout, return_aux=return_aux, options=opts)
  if any(_explicit_axes(a) for a in (x, w, labels, bias, where) if a is not None):
    return sharding.from_types(x, w, labels, **kw)
  # one dispatch for this call: the routing reads it, and the per-device op runs it
  route = base.route_for(x, w, labels, w_layout, opts) if labels.size else None
  kind, notes = _routing(x, w, labels, bias, where, opts, route, labels.size)
  if kind == "partitioned":  # Auto mesh axes, or compiled kernels / a token loop where jit may see sharded inputs
    if opts.reduction == "none":  # with no context mesh: XLA partitions the op by its custom_partitioning rule
      base.warn_once(("partitioned", "none"), notes[0])
    return _partition.linear_cross_entropy(x, w, labels, **kw)
  if _slow_locally(route, labels.size):
    base.warn_once(("local", route.name), f"{notes[0]} (lce_flax.explain(...) reports every decision)")
  return base.per_device(x, w, labels, **kw, route=route)
