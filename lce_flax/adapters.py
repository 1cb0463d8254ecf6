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
MAX_MESSAGE = 200  # every error of this module is one line of at most this many characters

ACCEPTED = ("accepted: nnx.Linear/Einsum/Embed, a bound nn.Dense/nn.Embed, an object or param dict holding a 2-D "
            "table (attr= picks one), an array with w_layout=")


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
  if t.__module__ == "builtins":
    return t.__qualname__
  if t.__module__.startswith("flax."):  # flax.nnx.nn.linear.Linear -> nnx.Linear, flax.linen...Dense -> nn.Dense
    return f"{'nnx' if '.nnx.' in t.__module__ else 'nn'}.{t.__qualname__}"
  return f"{t.__module__.rsplit('.', 1)[-1]}.{t.__qualname__}"


def _short(items: Any, limit: int = 80) -> str:
  """A list for an error message, cut at ``limit`` characters so the message stays one short line."""
  text = str(items)
  return text if len(text) <= limit else text[:limit - 4] + " ...]"


def _error(kind: type, message: str) -> Exception:
  """A one-line error of at most MAX_MESSAGE characters."""
  message = " ".join(message.split())
  if len(message) > MAX_MESSAGE:
    message = message[:MAX_MESSAGE - 3] + "..."
  return kind(message)


def _value(v: Any) -> Any:
  """The array inside an ``nnx.Variable`` or a linen metadata box (``nn.Partitioned``), else ``v`` itself."""
  if isinstance(v, nnx.Variable):
    return v[...]
  if isinstance(v, flax_meta.AxisMetadata):
    return v.unbox()
  return v


def _is_array(v: Any) -> bool:
  return isinstance(v, (jax.Array, np.ndarray))


def _shape(v: Any) -> tuple[int, ...] | None:
  v = _value(v)
  return tuple(v.shape) if _is_array(v) else None


def _check_layout(w_layout: str | None) -> None:
  if w_layout is not None and w_layout not in LAYOUTS:
    raise _error(ValueError, f"w_layout={w_layout!r} must be 'hv' (w is [H, V], a Dense kernel), 'vh' ([V, H], an "
                 "Embed table) or None")


def _agree(found: str, given: str | None, what: str) -> str:
  if given is not None and given != found:
    raise _error(ValueError, f"w_layout={given!r} contradicts {what}, which is {found!r}; leave w_layout=None")
  return found


def _as_vector(bias: Any, vocab: int, what: str) -> jax.Array | None:
  if bias is None:
    return None
  bias = jnp.asarray(_value(bias))
  if bias.size != vocab or sum(d != 1 for d in bias.shape) > 1:
    raise _error(ValueError, f"{what}: bias of shape {bias.shape} cannot be mapped onto the fused op's "
                 f"[V]=[{vocab}] bias")
  return bias.reshape(vocab)


def _module_dtype(head: Any) -> Any:
  """The head's own computation dtype (a ``dtype`` attribute holding a floating dtype), or None."""
  dtype = getattr(head, "dtype", None)
  if dtype is None or isinstance(dtype, (str, bytes)) and not dtype:
    return None
  try:
    dtype = jnp.dtype(dtype)
  except TypeError:
    return None
  return dtype if jnp.issubdtype(dtype, jnp.floating) else None


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
    ValueError: (one line) naming the equation and why it cannot be mapped (several contracted axes, a kernel
      that is not 2-D, a vocabulary axis that is not last, ...).

  Example:
    >>> einsum_layout("BTD,VD->BTV", (256, 64))
    'vh'
  """
  eq = einsum_str.replace(" ", "")

  def fail(why: str):
    return _error(ValueError, f"einsum_str={einsum_str!r} (kernel {tuple(kernel_shape)}) does not map onto the "
                  f"fused op: {why}")

  m = re.fullmatch(r"((?:\.\.\.)?[A-Za-z]*(?:\.\.\.)?[A-Za-z]*),([A-Za-z]*)->((?:\.\.\.)?[A-Za-z]*(?:\.\.\.)?"
                   r"[A-Za-z]*)", eq)
  if m is None:
    raise fail("not '<x>,<kernel>-><out>' with letters and '...' only")
  lhs, rhs, out = m.groups()
  if lhs.count("...") > 1 or out.count("...") > 1 or ("..." in lhs) != ("..." in out):
    raise fail("'...' must appear once in both x and the output, or in neither")
  lhs_axes, out_axes = lhs.replace("...", "."), out.replace("...", ".")
  for name, axes in (("x", lhs_axes), ("kernel", rhs), ("output", out_axes)):
    if len(set(axes)) != len(axes):
      raise fail(f"the {name} term repeats an axis (a diagonal)")
  contracted = sorted(set(lhs_axes) & set(rhs) - set(out_axes))
  if len(contracted) > 1:
    raise fail(f"it contracts {len(contracted)} axes {contracted}, the op exactly one (H)")
  if len(rhs) != 2 or len(kernel_shape) != 2:
    raise fail(f"the kernel has {max(len(rhs), len(kernel_shape))} axes, not 2-D [H, V] or [V, H]")
  if not contracted:
    raise fail("no axis of x is contracted with the kernel")
  (h,) = contracted
  if lhs_axes[-1:] != h:
    raise fail(f"the contracted axis {h!r} is not x's last axis")
  (v,) = set(rhs) - {h}
  if v in lhs_axes:
    raise fail(f"the kernel axis {v!r} also indexes x (a batched kernel)")
  if out_axes[-1:] != v or out_axes[:-1] != lhs_axes[:-1]:
    raise fail(f"the output must be x's leading axes then the vocabulary axis {v!r} last")
  return "hv" if rhs == h + v else "vh"


def _from_einsum(head: Any, kernel: jax.Array, bias: Any, what: str, w_layout: str | None) -> HeadWeights:
  eq = getattr(head, "einsum_str", None)
  if not isinstance(eq, str):
    raise _error(ValueError, f"{what} has no einsum_str (einsum_str={eq!r}); give the layout with "
                 "w_layout='hv'|'vh'")
  layout = _agree(einsum_layout(eq, kernel.shape), w_layout, f"{what}'s einsum_str={eq!r}")
  vocab = kernel.shape[1] if layout == "hv" else kernel.shape[0]
  return HeadWeights(kernel, _as_vector(bias, vocab, what), layout)


def _tables(entries: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
  """The 2-D arrays (or variables, or boxed arrays) among ``entries``: name -> shape."""
  return {str(k): s for k, v in entries.items() if (s := _shape(v)) is not None and len(s) == 2}


def _listing(tables: Mapping[str, tuple[int, ...]]) -> str:
  return _short(", ".join(f"{k} {s}" for k, s in tables.items()) or "none", 90)


def _pick(owner: str, entries: Mapping[str, Any], attr: str | None) -> tuple[str, jax.Array]:
  """The table named ``attr`` among ``entries``, or the only 2-D one."""
  tables = _tables(entries)
  if attr is not None:
    if attr not in entries:
      raise _error(ValueError, f"attr={attr!r}: {owner} has no entry {attr!r}; its 2-D tables: {_listing(tables)}")
    if attr not in tables:
      raise _error(ValueError, f"attr={attr!r}: {owner}[{attr!r}] is not a 2-D table (shape "
                   f"{_shape(entries[attr])}); its 2-D tables: {_listing(tables)}")
    return attr, jnp.asarray(_value(entries[attr]))
  if len(tables) > 1:
    raise _error(ValueError, f"{owner} holds several 2-D tables; pick one with attr=<name>: {_listing(tables)}")
  if not tables:
    return "", None
  ((name, _),) = tables.items()
  return name, jnp.asarray(_value(entries[name]))


def _object_entries(head: Any) -> dict[str, Any]:
  return {k: v for k, v in getattr(head, "__dict__", {}).items() if isinstance(v, nnx.Variable)}


def _from_object(head: Any, attr: str | None, w_layout: str | None) -> _Read:
  tname = _type_name(head)
  entries = _object_entries(head)
  if attr is not None and attr not in entries and hasattr(head, attr):
    entries[attr] = getattr(head, attr)  # a property or a plain array attribute named explicitly
  name, table = _pick(tname, entries, attr)
  if table is None:
    raise _error(TypeError, f"cannot read a head from {tname}: it holds no 2-D nnx.Param/nnx.Variable; {ACCEPTED}")
  what = f"{tname}.{name}"
  dtype = _module_dtype(head)
  if isinstance(getattr(head, "einsum_str", None), str):  # an einsum class of a framework: its equation decides
    return _Read(_from_einsum(head, table, None, what, w_layout), dtype, what)
  return _Read(HeadWeights(table, None, w_layout or "vh"), dtype, what)


def _from_mapping(head: Mapping, attr: str | None, w_layout: str | None, owner: str = "the param dict") -> _Read:
  keys = sorted(map(str, head.keys()))
  if attr is None and "kernel" in head and set(keys) <= {"kernel", "bias"} or attr == "kernel":
    kernel = jnp.asarray(_value(head["kernel"])) if "kernel" in head else None
    if kernel is None or kernel.ndim != 2:
      raise _error(ValueError, f"{owner}['kernel'] must be a 2-D [H, V] Dense kernel, got shape "
                   f"{None if kernel is None else kernel.shape}")
    layout = _agree("hv", w_layout, "a Dense kernel [H, V]")
    return _Read(HeadWeights(kernel, _as_vector(head.get("bias"), kernel.shape[1], owner), layout), None,
                 f"{owner}['kernel']")
  if attr is None and "kernel" in head:
    raise _error(ValueError, f"{owner} has keys {_short(keys, 60)}: an nn.Dense head has only 'kernel' and "
                 "'bias'; name the table with attr=<key>")
  name, table = _pick(owner, head, attr)
  if table is None:
    raise _error(ValueError, f"{owner} has keys {_short(keys, 60)} and no 2-D table; pass the head's own entry, "
                 "e.g. params['head'] (nn.Dense) or params['embed'] (nn.Embed)")
  layout = _agree("vh", w_layout, "an Embed table [V, H]") if name == "embedding" else w_layout or "vh"
  return _Read(HeadWeights(table, None, layout), None, f"{owner}[{name!r}]")


_KNOWN = {nnx.Linear: ("kernel", "hv"), nnx.Einsum: ("kernel", None), nnx.Embed: ("embedding", "vh")}


def _read(head: Any, attr: str | None, w_layout: str | None) -> _Read:
  _check_layout(w_layout)
  if attr is not None and not isinstance(attr, str):
    raise _error(TypeError, f"attr must be the name of the table (a str), got {_type_name(attr)}")
  for cls, (name, layout) in _KNOWN.items():
    if isinstance(head, cls):
      tname = _type_name(head)
      if attr is not None and attr != name:
        raise _error(ValueError, f"attr={attr!r}: {tname}'s weight is {name!r}; leave attr=None")
      weight = getattr(head, name)[...]
      bias = getattr(head, "bias", None)
      bias = None if bias is None else bias[...]
      if layout is None:
        weights = _from_einsum(head, weight, bias, tname, w_layout)
      else:
        weights = HeadWeights(weight, _as_vector(bias, weight.shape[1 if layout == "hv" else 0], tname),
                              _agree(layout, w_layout, f"{tname}.{name} ({'[H, V]' if layout == 'hv' else '[V, H]'})"))
      return _Read(weights, _module_dtype(head), f"{tname}.{name}")
  if isinstance(head, nn.Module):
    tname = _type_name(head)
    if head.scope is None:
      raise _error(TypeError, f"cannot read a head from the unbound linen module {tname}: pass its param dict "
                   "(e.g. params['params']['head']) or call inside the model's apply")
    if isinstance(head, nn.Embed) and attr in (None, "embedding"):  # .embedding runs setup() if need be
      table = head.embedding
      return _Read(HeadWeights(table, None, _agree("vh", w_layout, "nn.Embed.embedding ([V, H])")),
                   _module_dtype(head), "nn.Embed.embedding")
    params = head.variables.get("params", {})
    read = _from_mapping(params, attr, w_layout, owner=f"{tname}'s params")
    return read._replace(dtype=_module_dtype(head))
  if isinstance(head, Mapping):
    return _from_mapping(head, attr, w_layout)
  value = _value(head)
  if _is_array(value):
    if attr is not None:
      raise _error(ValueError, f"attr={attr!r} names a table inside a module or dict; {_type_name(head)} is the "
                   "table itself")
    if w_layout is None:
      raise _error(ValueError, f"a bare {_type_name(head)} of shape {tuple(value.shape)} needs w_layout='hv' "
                   "([H, V]) or 'vh' ([V, H])")
    if value.ndim != 2:
      raise _error(ValueError, f"the head's weight must be 2-D ([H, V] or [V, H]), got shape {tuple(value.shape)}")
    return _Read(HeadWeights(jnp.asarray(value), None, w_layout), None, "the array")
  if isinstance(head, (str, bytes, int, float, complex, bool, list, tuple, type(None))):
    raise _error(TypeError, f"cannot read a head from {_type_name(head)}; {ACCEPTED}")
  return _from_object(head, attr, w_layout)


def is_table(head: Any) -> bool:
  """Whether ``head`` is a bare weight (an array or an ``nnx.Variable``/boxed array) rather than a module or dict."""
  return not isinstance(head, (nnx.Module, nn.Module, Mapping)) and _is_array(_value(head))


def read_head(head: Any, *, attr: str | None = None, w_layout: str | None = None):
  """``(HeadWeights, dtype)``: the weights as :func:`head_weights` and the head's own computation dtype (None
  when it has none: linen param dicts, arrays, objects without a floating ``dtype`` attribute)."""
  read = _read(head, attr, w_layout)
  return read.weights, read.dtype


def head_logits(head: Any, x: jax.Array, *, attr: str | None = None, w_layout: str | None = None,
                dtype: Any = None, precision: Any = None) -> jax.Array:
  """``[..., V]`` logits of the head on ``x``, as the head computes them (``x @ w + bias``, or ``x @ table.T``).

  ``x``, the weight and the bias are cast to ``dtype`` (None: the head's own ``dtype``, else their promoted type)
  before the matmul, as flax's ``Linear``/``Einsum``/``Embed.attend`` do. For evaluation and generation; the loss
  never needs these logits.

  Example:
    >>> import jax.numpy as jnp
    >>> head_logits({"embedding": jnp.ones((5, 3))}, jnp.ones((2, 3))).shape
    (2, 5)
  """
  read = _read(head, attr, w_layout)
  w, bias, layout = read.weights
  x = _check_x(x, read)
  dtype = dtype if dtype is not None else read.dtype
  args = [x, w] if bias is None else [x, w, bias]
  args = list(nn.dtypes.promote_dtype(*args, dtype=dtype))
  x, w = args[0], args[1]
  contract = 0 if layout == "hv" else 1
  y = jax.lax.dot_general(x, w, (((x.ndim - 1,), (contract,)), ((), ())), precision=precision)
  if bias is not None:
    y = y + args[2]
  return y


def _check_x(x: jax.Array, read: _Read) -> jax.Array:
  w, _, layout = read.weights
  x = jnp.asarray(x)
  hidden = w.shape[0] if layout == "hv" else w.shape[1]
  if x.ndim < 1 or x.shape[-1] != hidden:
    flipped = {"hv": "vh", "vh": "hv"}[layout]
    hint = ""
    if x.ndim >= 1 and x.shape[-1] == (w.shape[1] if layout == "hv" else w.shape[0]):
      hint = f"; if it is {'a [V, H] table' if flipped == 'vh' else 'an [H, V] kernel'}, pass w_layout={flipped!r}"
    raise _error(ValueError, f"x.shape={x.shape} does not end in H={hidden} of {read.what} (shape "
                 f"{tuple(w.shape)}, w_layout={layout!r}){hint}")
  return x


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
  x = _check_x(x, read)
  # The head computes its logits in its own Flax dtype (None: promotion), and so does the loss, unless the options
  # or the call set one: the same rule as lce_flax's own heads.
  opts = for_head(options, read.dtype, overrides)
  return api.linear_cross_entropy(x, w, labels, bias=bias, where=where, w_layout=layout, return_aux=return_aux,
                                  options=opts)


__all__ = ["ACCEPTED", "HeadWeights", "einsum_layout", "head_logits", "head_loss", "head_weights", "read_head"]
