"""Flax NNX heads that drop in for ``nnx.Linear(H, vocab_size)`` + ``optax.softmax_cross_entropy_with_integer_labels``.

:class:`LMHead` owns the variables of ``nnx.Linear(in_features, vocab_size)`` — ``kernel`` [H, V] and (with
``use_bias``) ``bias`` [V], initialised from ``rngs`` in the same order, so a Linear-head state (or checkpoint)
loads unchanged — and returns the fused loss of :func:`lce_flax.linear_cross_entropy`; :meth:`LMHead.logits`
gives the logits for evaluation and generation. :class:`TiedLMHead` computes the loss from an ``nnx.Embed`` table
in its [V, H] layout, like ``Embed.attend`` + cross-entropy, without a transposed copy.

The parameters carry logical sharding names (``out_sharding`` metadata, default ``("embed", "vocab")`` and
``("vocab",)``), readable with ``nnx.get_partition_spec``. They are sharded eagerly, as any NNX variable with
``out_sharding``, when a mesh is active and the names resolve (through ``nn.logical_axis_rules`` or
``sharding_rules`` metadata) to that mesh's axes; otherwise the names are only recorded, so a head can be built
with no mesh at all.

Example (the two-line change)::

    # before:  self.head = nnx.Linear(hidden, vocab, use_bias=False, rngs=rngs)
    #          loss = optax.softmax_cross_entropy_with_integer_labels(self.head(h), labels).mean()
    self.head = lce_flax.nnx.LMHead(hidden, vocab, rngs=rngs)
    loss = self.head(h, labels)
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import meta as flax_meta
from flax.core import spmd as flax_spmd
from flax.nnx.nn import dtypes as nnx_dtypes
from flax.typing import Dtype, Initializer

from lce_flax import adapters, api
from lce_flax.linen import BIAS_AXES, KERNEL_AXES, _no_loss_arguments, check_input, dense_logits
from lce_flax.options import LossOptions, for_head

_SHARDING_KEYS = ("out_sharding", "sharding", "sharding_names")  # the last two: flax's deprecated spellings


def _mesh_names(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _can_shard_now(axes: Any, metadata: Mapping[str, Any]) -> bool:
  """Whether ``axes`` (after the logical axis rules) name axes of the mesh in effect, so eager sharding can apply."""
  if isinstance(axes, jax.sharding.NamedSharding):
    return True  # it carries its own mesh
  mesh = metadata.get("mesh") or flax_meta.get_global_mesh()
  if mesh is None:
    return False
  resolved = flax_spmd.apply_rules(tuple(axes), metadata.get("sharding_rules"))
  return all(name in mesh.axis_names for entry in resolved for name in _mesh_names(entry))


def _harmless(axes: tuple[str | None, ...], metadata: Mapping[str, Any]) -> tuple[str | None, ...]:
  """``axes`` with each name that no logical rule maps and the active mesh lacks replaced by None (replicated).

  With no mesh active the names are kept as given (they may be mesh names of a mesh set up later)."""
  mesh = metadata.get("mesh") or flax_meta.get_global_mesh()
  if mesh is None:
    return tuple(axes)
  rules = flax_spmd.composite_rules(flax_spmd.get_logical_axis_rules(), metadata.get("sharding_rules", ()))
  mapped = {alias for alias, _ in rules}
  return tuple(name if name is None or name in mapped or all(n in mesh.axis_names for n in _mesh_names(name))
               else None for name in axes)


def _metadata(axes: tuple[str | None, ...] | None, user: Mapping[str, Any]) -> dict[str, Any]:
  """Variable metadata: the user's, plus ``out_sharding=axes`` unless the user gave a sharding."""
  md = dict(user)
  given = [k for k in _SHARDING_KEYS if k in md]
  if axes is not None and not given:
    md["out_sharding"] = _harmless(axes, md)
    given = ["out_sharding"]
  if given and "eager_sharding" not in md:
    # Names with no mesh (or no rules mapping them onto it) are recorded, not applied: flax would otherwise
    # refuse to create the variable. A user who sets ``eager_sharding`` gets flax's own behaviour.
    md["eager_sharding"] = nnx.using_eager_sharding() and _can_shard_now(md[given[0]], md)
  return md


def _check_options(options: LossOptions) -> LossOptions:
  if not isinstance(options, LossOptions):
    raise TypeError(f"options must be a lce_flax.LossOptions, got a {type(options).__name__}")
  return options


class LMHead(nnx.Module):
  """A language-model head with the variables of ``nnx.Linear(in_features, vocab_size)`` that returns the loss.

  ``head(x, labels)`` equals ``optax.softmax_cross_entropy_with_integer_labels(linear(x), labels)`` reduced over
  counted tokens, for an ``nnx.Linear`` with the same ``kernel``/``bias``, without forming the ``[..., V]``
  logits. Numerics follow ``nnx.Linear``: variables in ``param_dtype``; ``x``, ``kernel``, ``bias`` cast to
  ``dtype`` (None: their promoted type) before the matmul; logits accumulated and loss computed in float32.

  Args:
    in_features: H, the size of the hidden states.
    vocab_size: V.
    use_bias: whether the head has a ``bias`` [V] (``nnx.Linear``'s default is True, an LM head's usually False).
    dtype: dtype of the matmul (None: promote ``x`` and the parameters).
    param_dtype: dtype of the parameters.
    precision: ``lax.Precision`` of :meth:`logits`.
    kernel_init: initialiser of ``kernel`` [H, V] (``nnx.Linear``'s default: LeCun normal).
    bias_init: initialiser of ``bias`` [V].
    kernel_axes: sharding names of ``kernel`` (None: none), stored as ``out_sharding`` metadata: logical names
      (resolved through ``nn.logical_axis_rules`` / ``sharding_rules``) or mesh axis names. A name that no rule
      maps and that the mesh active at construction lacks is stored as None (replicated), so the default
      ``("embed", "vocab")`` is harmless on a ``("fsdp", "tp")`` mesh without rules.
    bias_axes: sharding names of ``bias``, as ``kernel_axes``.
    kernel_metadata: further metadata of the ``kernel`` variable (a sharding given here replaces ``kernel_axes``).
    bias_metadata: further metadata of the ``bias`` variable.
    options: the loss options (:class:`lce_flax.LossOptions`); a call's keyword overrides replace its fields,
      ``None`` included.
    rngs: the ``nnx.Rngs`` the parameters are drawn from (``params`` stream, kernel then bias, as Linear).
  """

  def __init__(
      self,
      in_features: int,
      vocab_size: int,
      *,
      use_bias: bool = False,
      dtype: Dtype | None = None,
      param_dtype: Dtype = jnp.float32,
      precision: Any = None,
      kernel_init: Initializer = nnx.initializers.lecun_normal(),
      bias_init: Initializer = nnx.initializers.zeros_init(),
      kernel_axes: tuple[str | None, ...] | None = KERNEL_AXES,
      bias_axes: tuple[str | None, ...] | None = BIAS_AXES,
      kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
      bias_metadata: Mapping[str, Any] = MappingProxyType({}),
      options: LossOptions = LossOptions(),
      rngs: nnx.Rngs,
  ):
    if in_features < 1 or vocab_size < 1:
      raise ValueError(f"in_features={in_features} and vocab_size={vocab_size} must be >= 1")
    self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, vocab_size), param_dtype),
                            **_metadata(kernel_axes, kernel_metadata))
    self.bias: nnx.Param | None
    if use_bias:
      self.bias = nnx.Param(bias_init(rngs.params(), (vocab_size,), param_dtype), **_metadata(bias_axes, bias_metadata))
    else:
      self.bias = nnx.data(None)
    self.in_features = in_features
    self.vocab_size = vocab_size
    self.use_bias = use_bias
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.precision = precision
    self.options = _check_options(options)

  def _arrays(self, x: jax.Array):
    x = jnp.asarray(x)
    check_input(x, self.in_features, type(self).__name__)
    return x, self.kernel[...], self.bias[...] if self.bias is not None else None

  def __call__(self, x: jax.Array, labels: jax.Array | None = None, *, where: jax.Array | None = None,
               return_aux: bool = False, **overrides: Any):
    """The cross-entropy of ``x @ kernel + bias`` against ``labels``, without the logits; the logits if no labels.

    ``head(x)`` is ``nnx.Linear``'s output (:meth:`logits`), so the head can stand where the model calls
    ``self.lm_head(h)`` for generation and evaluation; ``head(x, labels)`` is the fused loss.

    Args:
      x: ``[..., H]`` hidden states.
      labels: ``[...]`` integer targets; ``ignore_index`` (default -100) marks tokens that are not counted. None:
        return the ``[..., V]`` logits.
      where: optional ``[...]`` mask (bool or 0/1); masked tokens are not counted.
      return_aux: also return the op's :class:`lce_flax.Aux`.
      **overrides: per-call values of fields of ``options`` (``reduction=``, ``z_loss=``, ``impl=``, ...).

    Returns:
      The float32 loss (and the :class:`lce_flax.Aux` if ``return_aux``), as :func:`lce_flax.linear_cross_entropy`;
      without labels, the logits.
    """
    if labels is None:
      _no_loss_arguments(type(self).__name__, where, return_aux, overrides)
      return self.logits(x)
    x, kernel, bias = self._arrays(x)
    return api.linear_cross_entropy(x, kernel, labels, bias=bias, where=where, return_aux=return_aux,
                                    w_layout="hv", options=for_head(self.options, self.dtype, overrides))

  def logits(self, x: jax.Array) -> jax.Array:
    """``[..., V]`` logits ``x @ kernel + bias``: ``nnx.Linear``'s output on the same variables."""
    return dense_logits(*nnx_dtypes.promote_dtype(self._arrays(x), dtype=self.dtype), self.precision)


class TiedLMHead(nnx.Module):
  """The loss of a head tied to the input embedding (``Embed.attend`` + cross-entropy, fused); no variables.

  Call it with the model's embedding: ``self.head(self.embed, h, labels)``, or without labels for the logits
  ``self.head(self.embed, h)``. The embedding is what :func:`lce_flax.adapters.head_loss` accepts: an
  ``nnx.Embed``, a custom embedder holding its [V, H] table as an ``nnx.Param`` (tunix's ``Embedder``; ``attr=``
  names it when there are several), a param dict, or the bare [V, H] table. The table is read in its own layout
  (``w_layout="vh"``), never transposed or copied, and receives the head's gradient. The embedding is an argument
  rather than an attribute so the model holds it once (no shared reference to track).

  Args:
    dtype: dtype of the matmul (None: the embedder's own ``dtype`` (``nnx.Embed.dtype``, tunix's
      ``Embedder.dtype``), else the promoted type).
    attr: the table's name in a custom embedder or param dict holding several 2-D tables.
    options: the loss options (:class:`lce_flax.LossOptions`); a call's keyword overrides replace its fields.
  """

  def __init__(self, *, dtype: Dtype | None = None, attr: str | None = None, options: LossOptions = LossOptions()):
    self.dtype = dtype
    self.attr = attr
    self.options = _check_options(options)

  def _read(self, embed: Any, x: jax.Array):
    weights, dtype = adapters.read_head(embed, attr=self.attr, w_layout="vh" if adapters.is_table(embed) else None)
    if weights.w_layout != "vh":
      raise ValueError(f"{type(self).__name__}: the embedding must be a [V, H] table, got a {weights.w_layout!r} "
                       f"weight of shape {tuple(weights.w.shape)}; use lce_flax.adapters.head_loss for other heads")
    x = jnp.asarray(x)
    check_input(x, weights.w.shape[1], type(self).__name__)
    return x, weights.w, self.dtype if self.dtype is not None else dtype

  def __call__(self, embed: Any, x: jax.Array, labels: jax.Array | None = None, *,
               where: jax.Array | None = None, return_aux: bool = False, **overrides: Any):
    """The loss of ``embed.attend(x)`` against ``labels`` (the logits if no labels); as :meth:`LMHead.__call__`."""
    if labels is None:
      _no_loss_arguments(type(self).__name__, where, return_aux, overrides)
      return self.logits(embed, x)
    x, table, dtype = self._read(embed, x)
    return api.linear_cross_entropy(x, table, labels, w_layout="vh", where=where, return_aux=return_aux,
                                    options=for_head(self.options, dtype, overrides))

  def logits(self, embed: Any, x: jax.Array) -> jax.Array:
    """``[..., V]`` logits ``x @ table.T``, as ``Embed.attend(x)``."""
    x, table, dtype = self._read(embed, x)
    x, table = nnx_dtypes.promote_dtype((x, table), dtype=dtype)
    return jnp.dot(x, table.T)


__all__ = ["LMHead", "TiedLMHead"]
