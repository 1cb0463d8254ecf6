"""Adapters: the fused loss from the head a model already has, with no fork and no change to its parameters.

A model you do not own keeps its head, its parameter tree and its checkpoint; the loss reads the head's weight
where it lives and calls :func:`lce_flax.linear_cross_entropy` on it, so gradients land on the model's own
parameter (the ``nnx.Einsum``'s kernel, the custom embedder's table, the linen ``params['head']['kernel']``).

==========================================  ==============================================================
head                                        read as
==========================================  ==============================================================
``nnx.Linear``                              ``kernel`` [H, V] (``"hv"``), ``bias`` [V] if any
``nnx.Einsum``                              ``kernel`` 2-D, layout from ``einsum_str`` (``"...d,dv->...v"``
                                            is ``"hv"``, ``"...d,vd->...v"`` is ``"vh"``), ``bias`` of V
                                            elements if any
``nnx.Embed`` (tied)                        ``embedding`` [V, H] (``"vh"``)
any object with one 2-D ``nnx.Variable``    that table, [V, H] (``"vh"``) unless ``w_layout=`` says; an
(a custom embedder, an einsum class)        ``einsum_str`` attribute gives the layout as for ``nnx.Einsum``;
                                            ``attr=`` picks the table when there are several
linen params ``{"kernel", "bias"?}``        ``nn.Dense``'s [H, V] kernel and [V] bias
linen params ``{"embedding"}``              ``nn.Embed``'s [V, H] table (tied)
an array (or a bare ``nnx.Variable``)       itself, with the ``w_layout=`` you give
==========================================  ==============================================================

The flax heads' ``dtype`` (``nnx.Linear(..., dtype=jnp.bfloat16)``) is the computation dtype of the loss, as it is
of the head's own logits, unless ``options``/``dtype=`` set one. Their ``precision``, ``preferred_element_type``,
``dot_general``/``einsum_op`` are not used: the fused op accumulates the logits in float32 whatever they say.

Example::

    h = model(tokens, return_hidden=True)                          # [B, T, D], the head's input
    loss = lce_flax.adapters.head_loss(model.head, h, labels)      # == optax CE of model.head(h), no logits
    loss = lce_flax.adapters.head_loss(model.embedder, h, labels)  # tied custom embedder holding a [V, D] table
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx
from flax.core import meta as flax_meta

from lce_flax import api
from lce_flax.options import LossOptions, for_head

LAYOUTS = ("hv", "vh")

ACCEPTED = ("accepted: nnx.Linear, nnx.Einsum, nnx.Embed, an object holding a 2-D nnx.Param/nnx.Variable table "
            "(attr= picks one of several), a linen param dict {'kernel'[, 'bias']} (nn.Dense) or {'embedding'} "
            "(nn.Embed), or an array with w_layout='hv' ([H, V]) or 'vh' ([V, H])")


class HeadWeights(NamedTuple):
  """What :func:`head_weights` returns: the arguments ``w``, ``bias`` and ``w_layout`` of the fused op."""

  w: jax.Array  # [H, V] for w_layout="hv", [V, H] for "vh"
  bias: jax.Array | None  # [V] or None
  w_layout: str


class _Read(NamedTuple):
  weights: HeadWeights
  dtype: Any  # the head's own computation dtype, or None
  what: str  # how the weight was found, for error messages


def _type_name(obj: Any) -> str:
  t = type(obj)
  return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _value(v: Any) -> Any:
  """The array inside an ``nnx.Variable`` or a linen metadata box (``nn.Partitioned``), else ``v`` itself."""
  if isinstance(v, nnx.Variable):
    return v[...]
  if isinstance(v, flax_meta.AxisMetadata):
    return v.unbox()
  return v


def _is_array(v: Any) -> bool:
  return isinstance(v, (jax.Array, np.ndarray))


def _check_layout(w_layout: str | None) -> None:
  if w_layout is not None and w_layout not in LAYOUTS:
    raise ValueError(f"w_layout={w_layout!r} must be 'hv' (w is [H, V], a Dense kernel) or 'vh' ([V, H], an "
                     "Embed table), or None")


def _agree(found: str, given: str | None, what: str) -> str:
  if given is not None and given != found:
    raise ValueError(f"w_layout={given!r} contradicts {what}, which is {found!r}; leave w_layout=None")
  return found


def _as_vector(bias: Any, vocab: int, what: str) -> jax.Array | None:
  if bias is None:
    return None
  bias = jnp.asarray(_value(bias))
  if bias.size != vocab or sum(d != 1 for d in bias.shape) > 1:
    raise ValueError(f"{what}: bias of shape {bias.shape} cannot be mapped onto the fused op's [V]=[{vocab}] bias")
  return bias.reshape(vocab)


def einsum_layout(einsum_str: str, kernel_shape: tuple[int, ...]) -> str:
  """The ``w_layout`` of a 2-D einsum kernel: ``"hv"`` for ``"...d,dv->...v"``, ``"vh"`` for ``"...d,vd->...v"``.

  The equation must contract ``x``'s last axis with one kernel axis and put the other kernel axis last in the
  output, every other axis of ``x`` passing through in order (named, or as ``...``).

  Args:
    einsum_str: the equation ``"<x>,<kernel>-><out>"``, as held by ``nnx.Einsum``.
    kernel_shape: the kernel's shape.

  Returns:
    ``"hv"`` or ``"vh"``.

  Raises:
    ValueError: naming the equation and why it cannot be mapped (several contracted axes, a kernel that is not
      2-D, a vocabulary axis that is not last, ...).

  Example:
    >>> einsum_layout("BTD,VD->BTV", (256, 64))
    'vh'
  """
  eq = einsum_str.replace(" ", "")

  def fail(why: str):
    return ValueError(f"einsum_str={einsum_str!r} (kernel shape {tuple(kernel_shape)}) cannot be mapped onto the "
                      f"fused op: {why}; supported: x's last axis contracted with one axis of a 2-D kernel, the "
                      "other kernel axis last in the output, e.g. '...d,dv->...v' or '...d,vd->...v'")

  m = re.fullmatch(r"((?:\.\.\.)?[A-Za-z]*(?:\.\.\.)?[A-Za-z]*),([A-Za-z]*)->((?:\.\.\.)?[A-Za-z]*(?:\.\.\.)?"
                   r"[A-Za-z]*)", eq)
  if m is None:
    raise fail("it is not of the form '<x>,<kernel>-><out>' with letters and '...' only, the kernel named by letters")
  lhs, rhs, out = m.groups()
  if lhs.count("...") > 1 or out.count("...") > 1 or ("..." in lhs) != ("..." in out):
    raise fail("'...' must appear once in both x and the output, or in neither")
  lhs_axes, out_axes = lhs.replace("...", "."), out.replace("...", ".")
  for name, axes in (("x", lhs_axes), ("kernel", rhs), ("output", out_axes)):
    if len(set(axes)) != len(axes):
      raise fail(f"the {name} term repeats an axis (a diagonal)")
  contracted = sorted(set(lhs_axes) & set(rhs) - set(out_axes))
  if len(contracted) > 1:
    raise fail(f"it contracts {len(contracted)} axes {contracted}; the fused op contracts exactly one (H)")
  if len(rhs) != 2 or len(kernel_shape) != 2:
    raise fail(f"the kernel has {max(len(rhs), len(kernel_shape))} axes; only 2-D [H, V] or [V, H] kernels map")
  if not contracted:
    raise fail("no axis of x is contracted with the kernel")
  (h,) = contracted
  if lhs_axes[-1:] != h:
    raise fail(f"the contracted axis {h!r} is not x's last axis")
  (v,) = set(rhs) - {h}
  if v in lhs_axes:
    raise fail(f"the kernel axis {v!r} also indexes x (a batched kernel)")
  if out_axes[-1:] != v or out_axes[:-1] != lhs_axes[:-1]:
    raise fail(f"the output must be x's leading axes then the vocabulary axis {v!r}, i.e. "
               f"'{lhs[:-1]}{v}' (x's leading axes in order, {v!r} last)")
  return "hv" if rhs == h + v else "vh"


def _from_einsum(head: Any, kernel: jax.Array, bias: Any, what: str, w_layout: str | None) -> HeadWeights:
  eq = getattr(head, "einsum_str", None)
  if not isinstance(eq, str):
    raise ValueError(f"{what} has no einsum_str (einsum_str={eq!r}); give the layout with w_layout='hv'|'vh'")
  layout = _agree(einsum_layout(eq, kernel.shape), w_layout, f"{what}'s einsum_str={eq!r}")
  vocab = kernel.shape[1] if layout == "hv" else kernel.shape[0]
  return HeadWeights(kernel, _as_vector(bias, vocab, what), layout)


def _table_candidates(head: Any) -> dict[str, Any]:
  """The attributes of ``head`` that are 2-D ``nnx.Variable``s, name -> variable."""
  found = {}
  for name, v in getattr(head, "__dict__", {}).items():
    if isinstance(v, nnx.Variable) and getattr(v, "ndim", None) == 2:
      found[name] = v
  return found


def _from_object(head: Any, attr: str | None, w_layout: str | None) -> _Read:
  tname = _type_name(head)
  if attr is not None:
    if not hasattr(head, attr):
      raise ValueError(f"attr={attr!r}: {tname} has no attribute {attr!r}; its 2-D variables: "
                       f"{sorted(_table_candidates(head))}")
    table = _value(getattr(head, attr))
    if not _is_array(table) or table.ndim != 2:
      raise ValueError(f"attr={attr!r}: {tname}.{attr} is not a 2-D array or nnx.Variable (got "
                       f"{_type_name(table)}{'' if not _is_array(table) else f' of shape {table.shape}'})")
    name = attr
  else:
    candidates = _table_candidates(head)
    if not candidates:
      raise TypeError(f"cannot read a head from {tname}: it is not a known head and holds no 2-D nnx.Param/"
                      f"nnx.Variable attribute; {ACCEPTED}")
    if len(candidates) > 1:
      shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in candidates.items())
      raise ValueError(f"{tname} holds several 2-D variables ({shapes}); pick the table with attr=<name>")
    ((name, var),) = candidates.items()
    table = var[...]
  what = f"{tname}.{name}"
  if isinstance(getattr(head, "einsum_str", None), str):  # an einsum class of a framework: its equation decides
    return _Read(_from_einsum(head, table, None, what, w_layout), None, what)
  return _Read(HeadWeights(table, None, w_layout or "vh"), None, what)


def _from_mapping(head: Mapping, w_layout: str | None) -> _Read:
  keys = sorted(map(str, head.keys()))
  if "kernel" in head and set(keys) <= {"kernel", "bias"}:
    kernel = jnp.asarray(_value(head["kernel"]))
    if kernel.ndim != 2:
      raise ValueError(f"params['kernel'] must be a 2-D [H, V] Dense kernel, got shape {kernel.shape}")
    layout = _agree("hv", w_layout, "a Dense kernel [H, V]")
    return _Read(HeadWeights(kernel, _as_vector(head.get("bias"), kernel.shape[1], "params"), layout), None,
                 "params['kernel']")
  if keys == ["embedding"]:
    table = jnp.asarray(_value(head["embedding"]))
    if table.ndim != 2:
      raise ValueError(f"params['embedding'] must be a 2-D [V, H] Embed table, got shape {table.shape}")
    return _Read(HeadWeights(table, None, _agree("vh", w_layout, "an Embed table [V, H]")), None,
                 "params['embedding']")
  raise ValueError(f"a linen param dict must be nn.Dense's {{'kernel'[, 'bias']}} or nn.Embed's {{'embedding'}}, "
                   f"got keys {keys}; pass the head's own entry, e.g. params['params']['head']")


def _read(head: Any, attr: str | None, w_layout: str | None) -> _Read:
  _check_layout(w_layout)
  known = isinstance(head, (nnx.Linear, nnx.Einsum, nnx.Embed, Mapping)) or _is_array(_value(head))
  if attr is not None and known:
    raise ValueError(f"attr={attr!r} is for custom classes; {_type_name(head)} has a known weight")
  if isinstance(head, nnx.Linear):
    kernel = head.kernel[...]
    bias = None if head.bias is None else head.bias[...]
    return _Read(HeadWeights(kernel, bias, _agree("hv", w_layout, "nnx.Linear's kernel [H, V]")), head.dtype,
                 "nnx.Linear.kernel")
  if isinstance(head, nnx.Einsum):
    bias = None if head.bias is None else head.bias[...]
    return _Read(_from_einsum(head, head.kernel[...], bias, "nnx.Einsum", w_layout), head.dtype, "nnx.Einsum.kernel")
  if isinstance(head, nnx.Embed):
    return _Read(HeadWeights(head.embedding[...], None, _agree("vh", w_layout, "nnx.Embed's embedding [V, H]")),
                 head.dtype, "nnx.Embed.embedding")
  if isinstance(head, Mapping):
    return _from_mapping(head, w_layout)
  value = _value(head)
  if _is_array(value):
    if w_layout is None:
      raise ValueError(f"a bare {_type_name(head)} of shape {value.shape} needs w_layout='hv' ([H, V]) or 'vh' "
                       "([V, H])")
    if value.ndim != 2:
      raise ValueError(f"the head's weight must be 2-D ([H, V] or [V, H]), got shape {value.shape}")
    return _Read(HeadWeights(value, None, w_layout), None, "the array")
  if isinstance(head, (str, bytes, int, float, complex, bool, list, tuple, type(None))):
    raise TypeError(f"cannot read a head from {_type_name(head)}; {ACCEPTED}")
  if isinstance(head, nn.Module):
    raise TypeError(f"cannot read a head from the linen module {_type_name(head)}; pass its param dict (e.g. "
                    f"params['params']['head']); {ACCEPTED}")
  return _from_object(head, attr, w_layout)


def head_weights(head: Any, *, attr: str | None = None, w_layout: str | None = None) -> HeadWeights:
  """The fused op's ``(w, bias, w_layout)`` read from a model's own head, without copying or moving it.

  Inside ``nnx.grad`` / ``jax.grad`` the arrays returned are the traced parameters themselves, so a loss built
  from them sends its gradient to the head's parameter (e.g. the ``nnx.Einsum``'s ``kernel`` or an embedder's
  table); the model's parameter tree and checkpoint are untouched.

  Args:
    head: ``nnx.Linear``, ``nnx.Einsum`` (2-D kernel; the layout is read from ``einsum_str``), ``nnx.Embed``
      (tied), an object holding a 2-D ``nnx.Param``/``nnx.Variable`` table (tied custom embedders: [V, H]; an
      ``einsum_str`` attribute gives the layout as for ``nnx.Einsum``), a linen param dict (``{"kernel",
      "bias"?}`` of ``nn.Dense``, ``{"embedding"}`` of ``nn.Embed``), or an array / bare ``nnx.Variable``.
    attr: for objects holding several 2-D variables, the name of the table.
    w_layout: ``"hv"`` or ``"vh"``: required for an array, optional for a custom object (a table [V, H] by
      default), and for every other head a check that must agree with what the head says.

  Returns:
    A :class:`HeadWeights` ``(w, bias, w_layout)``: ``w`` [H, V] (``"hv"``) or [V, H] (``"vh"``), ``bias`` [V] or
    None.

  Raises:
    TypeError: (one line) for an object that is none of the above, naming its type and what is accepted.
    ValueError: for an einsum equation that cannot be mapped, a bias that is not [V], several candidate tables
      (naming them), or a ``w_layout`` that contradicts the head.

  Example:
    >>> from flax import nnx
    >>> head = nnx.Einsum("...d,vd->...v", (11, 4), rngs=nnx.Rngs(0))
    >>> w, bias, w_layout = head_weights(head)
    >>> w.shape, bias, w_layout
    ((11, 4), None, 'vh')
  """
  return _read(head, attr, w_layout).weights


def head_loss(head: Any, x: jax.Array, labels: jax.Array, *, where: jax.Array | None = None,
              return_aux: bool = False, options: LossOptions | None = None, attr: str | None = None,
              w_layout: str | None = None, **overrides: Any):
  """The fused cross-entropy of a model's own head on hidden states ``x``, without forming the logits.

  Equals ``optax.softmax_cross_entropy_with_integer_labels(logits, labels)`` reduced over counted tokens, where
  ``logits`` is what the head computes from ``x`` (``head(x)``, ``embed.attend(x)``, ``x @ table.T``, or
  ``nn.Dense``'s output on the param dict). Works for NNX objects, linen param dicts and arrays alike.

  Args:
    head: the head as accepted by :func:`head_weights`.
    x: ``[..., H]`` hidden states: the head's input (see docs/integration.md for getting them out of a model).
    labels: ``[...]`` integer targets; ``ignore_index`` (default -100) marks tokens that are not counted.
    where: optional ``[...]`` mask; tokens where it is False (0) are not counted.
    return_aux: also return the op's :class:`lce_flax.Aux`.
    options: a :class:`lce_flax.options.LossOptions` (None: the defaults).
    attr: the table's attribute, for custom objects holding several 2-D variables.
    w_layout: the weight's layout, for arrays (required) and custom objects (default ``"vh"``).
    **overrides: fields of :class:`~lce_flax.options.LossOptions` (``reduction=``, ``z_loss=``, ``dtype=``, ...)
      that replace those of ``options``.

  Returns:
    The float32 loss (scalar, or ``[...]`` for ``reduction="none"``), and an :class:`lce_flax.Aux` if
    ``return_aux``.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> head = nnx.Einsum("...d,dv->...v", (4, 10), kernel_init=nnx.initializers.zeros, rngs=nnx.Rngs(0))
    >>> print(f"{head_loss(head, jnp.ones((2, 3, 4)), jnp.zeros((2, 3), jnp.int32)):.4f}")  # log(10)
    2.3026
  """
  read = _read(head, attr, w_layout)
  w, bias, layout = read.weights
  x = jnp.asarray(x)
  hidden = w.shape[0] if layout == "hv" else w.shape[1]
  if x.ndim < 1 or x.shape[-1] != hidden:
    flipped = {"hv": "vh", "vh": "hv"}[layout]
    hint = ""
    if x.ndim >= 1 and x.shape[-1] == (w.shape[1] if layout == "hv" else w.shape[0]):
      hint = f"; if it is {'a [V, H] table' if flipped == 'vh' else 'an [H, V] kernel'}, pass w_layout={flipped!r}"
    raise ValueError(f"x.shape={x.shape} does not end in H={hidden} of {read.what} (shape {w.shape}, "
                     f"w_layout={layout!r}){hint}")
  # The head computes its logits in its own Flax dtype (None: promotion), and so does the loss, unless the options
  # or the call set one: the same rule as lce_flax's own heads.
  opts = for_head(options, read.dtype, overrides)
  return api.linear_cross_entropy(x, w, labels, bias=bias, where=where, w_layout=layout, return_aux=return_aux,
                                  options=opts)


__all__ = ["ACCEPTED", "HeadWeights", "einsum_layout", "head_loss", "head_weights"]
