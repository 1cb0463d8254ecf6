"""Flax linen heads that drop in for ``nn.Dense(vocab_size)`` + ``optax.softmax_cross_entropy_with_integer_labels``.

:class:`LMHead` owns exactly the parameters of ``nn.Dense(vocab_size)`` — ``kernel`` [H, V] and (with
``use_bias``) ``bias`` [V], same names, shapes, dtypes and initialisers — so a checkpoint written by a model with a
Dense head restores into a model with this head unchanged, and back. Calling it returns the loss of
:func:`lce_flax.linear_cross_entropy` instead of the logits; :meth:`LMHead.logits` gives the logits for evaluation
and generation, computed exactly as ``Dense`` computes them.

:class:`TiedLMHead` (and :func:`tied_linear_cross_entropy`) compute the same loss from a model's ``nn.Embed`` table
in its own [V, H] layout (``w_layout="vh"``): no transposed copy of the table is made, and the gradient flows back
into the embedding, as with ``Embed.attend`` + cross-entropy.

Example (the two-line change)::

    # before:  logits = nn.Dense(vocab)(h)
    #          loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    loss = lce_flax.linen.LMHead(vocab)(h, labels)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.linen import dtypes as linen_dtypes
from flax.typing import Dtype, Initializer

from lce_flax import adapters, api
from lce_flax.options import LossOptions, for_head, resolve
from lce_flax.sharding import HEAD_EMBED

# Logical axis names of the head's parameters, as used by MaxText-style sharding rules. ``SPLIT_KERNEL_AXES``: the
# kernel's H over every axis that splits the tokens (``lce_flax.sharding.DEFAULT_RULES``: "head_embed" -> data and
# fsdp), as FSDP splits the rest of a model: each device holds and updates 1/n of the head under data parallelism.
KERNEL_AXES = ("embed", "vocab")
SPLIT_KERNEL_AXES = (HEAD_EMBED, "vocab")
BIAS_AXES = ("vocab",)

def check_input(x: jax.Array, hidden: int | None, what: str) -> None:
  if x.ndim < 1:
    raise ValueError(f"{what}: x must be [..., H], got x.shape={x.shape}")
  if hidden is not None and x.shape[-1] != hidden:
    raise ValueError(f"{what}: x.shape={x.shape} does not end in the head's H={hidden}")


def _no_loss_arguments(what: str, where: Any, return_aux: bool, overrides: dict[str, Any]) -> None:
  """A head called without labels returns logits: loss arguments there are a mistake, said in one line."""
  given = [n for n, v in (("where", where), ("return_aux", return_aux)) if v is not None and v is not False]
  given += sorted(overrides)
  if given:
    raise TypeError(f"{what} called without labels returns the logits; {', '.join(given)} only apply to the loss "
                    "(pass labels)")


def dense_logits(x: jax.Array, kernel: jax.Array, bias: jax.Array | None, precision: Any = None) -> jax.Array:
  """``x @ kernel + bias`` contracted on x's last axis, the computation of ``nn.Dense`` (inputs already promoted)."""
  y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=precision)
  if bias is not None:
    y = y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
  return y


def _partitioned(init: Initializer, axes: tuple[str | None, ...] | None) -> Initializer:
  return init if axes is None else nn.with_logical_partitioning(init, axes)


class _HeadOptions(nn.Module):
  """The loss options a head holds (one :class:`lce_flax.LossOptions`, keyword-only so each head's own fields
  keep their positions); a call may override each option, ``None`` included."""

  options: LossOptions = dataclasses.field(default=LossOptions(), kw_only=True)


class LMHead(_HeadOptions):
  """A language-model head with the parameters of ``nn.Dense(vocab_size)`` that returns the cross-entropy loss.

  ``LMHead(V)(x, labels)`` equals
  ``optax.softmax_cross_entropy_with_integer_labels(nn.Dense(V)(x), labels)`` reduced over counted tokens, with the
  same parameters, but never forms the ``[..., V]`` logits (see :func:`lce_flax.linear_cross_entropy`).

  Numerics follow ``nn.Dense``: parameters are stored in ``param_dtype``; ``x``, ``kernel`` and ``bias`` are cast
  to ``dtype`` (None: their promoted type) before the matmul; logits are accumulated and the loss is computed
  in float32.

  Attributes:
    vocab_size: V, the number of output classes.
    use_bias: whether the head has a ``bias`` [V] (``nn.Dense``'s default is True, an LM head's usually False).
    dtype: dtype of the matmul (None: promote ``x`` and the parameters, as ``nn.Dense``; bf16 activations with
      float32 parameters then compute in float32: set ``dtype=jnp.bfloat16`` for mixed precision).
    param_dtype: dtype of the parameters.
    precision: ``lax.Precision`` of :meth:`logits` (the fused loss always accumulates in float32).
    kernel_init: initialiser of ``kernel`` [H, V] (``nn.Dense``'s default: LeCun normal).
    bias_init: initialiser of ``bias`` [V].
    kernel_axes: logical axis names of ``kernel`` for ``nn.with_logical_partitioning`` (None: no metadata).
    bias_axes: logical axis names of ``bias``.
    options: the loss options (:class:`lce_flax.LossOptions`, keyword-only); a call's keyword overrides replace
      its fields, ``None`` included.
  """

  vocab_size: int
  use_bias: bool = False
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  precision: Any = None
  kernel_init: Initializer = nn.initializers.lecun_normal()
  bias_init: Initializer = nn.initializers.zeros_init()
  kernel_axes: tuple[str | None, ...] | None = KERNEL_AXES
  bias_axes: tuple[str | None, ...] | None = BIAS_AXES

  @nn.compact
  def _params(self, x: jax.Array):
    """Creates (or reads) ``kernel`` and ``bias`` as ``nn.Dense`` does (the op casts them, see ``dtype``)."""
    x = jnp.asarray(x)
    check_input(x, None, type(self).__name__)
    kernel = self.param("kernel", _partitioned(self.kernel_init, self.kernel_axes),
                        (jnp.shape(x)[-1], self.vocab_size), self.param_dtype)
    bias = None
    if self.use_bias:
      bias = self.param("bias", _partitioned(self.bias_init, self.bias_axes), (self.vocab_size,), self.param_dtype)
    return x, kernel, bias

  def __call__(self, x: jax.Array, labels: jax.Array | None = None, *, where: jax.Array | None = None,
               return_aux: bool = False, **overrides: Any):
    """The cross-entropy of ``x @ kernel + bias`` against ``labels``, without the logits; the logits if no labels.

    ``head(x)`` is ``nn.Dense``'s output (:meth:`logits`), so the head can stand where the model calls
    ``self.lm_head(h)`` for generation and evaluation; ``head(x, labels)`` is the fused loss.

    Args:
      x: ``[..., H]`` hidden states.
      labels: ``[...]`` integer targets; ``ignore_index`` (default -100) marks tokens that are not counted. None:
        return the ``[..., V]`` logits.
      where: optional ``[...]`` mask (bool or 0/1); masked tokens are not counted.
      return_aux: also return the op's :class:`lce_flax.Aux` (per-token loss, lse, accuracy counts).
      **overrides: per-call values of fields of ``options`` (``reduction=``, ``z_loss=``, ``impl=``, ...).

    Returns:
      The float32 loss (and the :class:`lce_flax.Aux` if ``return_aux``), as :func:`lce_flax.linear_cross_entropy`;
      without labels, the logits.
    """
    if labels is None:
      _no_loss_arguments(type(self).__name__, where, return_aux, overrides)
      return self.logits(x)
    x, kernel, bias = self._params(x)
    return api.linear_cross_entropy(x, kernel, labels, bias=bias, where=where, return_aux=return_aux,
                                    w_layout="hv", options=for_head(self.options, self.dtype, overrides))

  def logits(self, x: jax.Array) -> jax.Array:
    """``[..., V]`` logits ``x @ kernel + bias``: exactly ``nn.Dense(vocab_size)(x)`` on the same parameters."""
    x, kernel, bias = linen_dtypes.promote_dtype(*self._params(x), dtype=self.dtype)
    return dense_logits(x, kernel, bias, self.precision)


def _table(embed: Any, dtype: Dtype | None, attr: str | None = None) -> tuple[jax.Array, Dtype | None]:
  """The [V, H] table of ``embed`` (anything :func:`lce_flax.adapters.head_loss` accepts that holds a [V, H]
  table) and the dtype ``Embed.attend`` would compute in (``dtype``, else the embedder's own)."""
  weights, own = adapters.read_head(embed, attr=attr, w_layout="vh" if adapters.is_table(embed) else None)
  if weights.w_layout != "vh":
    raise ValueError(f"the embedding must be a [V, H] table, got a {weights.w_layout!r} weight of shape "
                     f"{tuple(weights.w.shape)}; use lce_flax.adapters.head_loss for other heads")
  return weights.w, dtype if dtype is not None else own


def tied_linear_cross_entropy(embed: Any, x: jax.Array, labels: jax.Array, *,
                              where: jax.Array | None = None, return_aux: bool = False, dtype: Dtype | None = None,
                              options: LossOptions | None = None, attr: str | None = None, **overrides: Any):
  """Cross-entropy of the tied head ``x @ table.T`` without a transposed copy of the [V, H] ``table``.

  Equals ``optax.softmax_cross_entropy_with_integer_labels(embed.attend(x), labels)`` reduced over counted
  tokens; the op reads the table in its [V, H] layout (``w_layout="vh"``).

  Args:
    embed: the model's (bound) ``nn.Embed``, its param dict (``{"embedding"}``, gemma's ``{"input_embedding"}``),
      an embedder object holding a [V, H] ``nnx.Param``, or the bare ``[V, H]`` table.
    x: ``[..., H]`` hidden states.
    labels: ``[...]`` integer targets.
    where, return_aux: as in :func:`lce_flax.linear_cross_entropy`.
    dtype: dtype of the matmul (None: the embedder's own ``dtype`` (``nn.Embed.dtype``), else the promoted type,
      like ``Embed.attend``).
    options, **overrides: the loss options, as in :func:`lce_flax.linear_cross_entropy`.
    attr: the table's name when ``embed`` holds several 2-D tables.

  Returns:
    As :func:`lce_flax.linear_cross_entropy`.
  """
  table, dtype = _table(embed, dtype, attr)
  x = jnp.asarray(x)
  check_input(x, table.shape[1], "tied_linear_cross_entropy")
  return api.linear_cross_entropy(x, table, labels, where=where, return_aux=return_aux, w_layout="vh",
                                  options=for_head(options or LossOptions(), dtype, overrides))


class TiedLMHead(_HeadOptions):
  """The loss of a head tied to the input embedding: ``Embed.attend`` + cross-entropy, fused; no parameters.

  Call it with the model's embedding: ``TiedLMHead()(self.embed, h, labels)``, or without labels for the logits.
  The embedding is a bound ``nn.Embed``, its param dict, an embedder object or the bare [V, H] table (as
  :func:`tied_linear_cross_entropy`). The table is read in its own [V, H] layout, never transposed or copied, and
  receives the head's gradient.

  Attributes:
    dtype: dtype of the matmul (None: the ``nn.Embed``'s ``dtype``, as ``Embed.attend``; for a bare table the
      promoted type).
    attr: the table's name when the embedding holds several 2-D tables.
    options: the loss options (:class:`lce_flax.LossOptions`, keyword-only); a call's keyword overrides replace
      its fields, ``None`` included.
  """

  dtype: Dtype | None = None
  attr: str | None = None

  def __call__(self, embed: Any, x: jax.Array, labels: jax.Array | None = None, *,
               where: jax.Array | None = None, return_aux: bool = False, **overrides: Any):
    """The loss of ``embed.attend(x)`` against ``labels`` (the logits if no labels); as :meth:`LMHead.__call__`."""
    if labels is None:
      _no_loss_arguments(type(self).__name__, where, return_aux, overrides)
      return self.logits(embed, x)
    return tied_linear_cross_entropy(embed, x, labels, dtype=self.dtype, where=where, return_aux=return_aux,
                                     attr=self.attr, options=resolve(self.options, overrides))

  def logits(self, embed: Any, x: jax.Array) -> jax.Array:
    """``[..., V]`` logits ``x @ table.T``, as ``Embed.attend(x)``."""
    table, dtype = _table(embed, self.dtype, self.attr)
    x = jnp.asarray(x)
    check_input(x, table.shape[1], type(self).__name__)
    x, table = linen_dtypes.promote_dtype(x, table, dtype=dtype)
    return jnp.dot(x, table.T)


__all__ = ["LMHead", "TiedLMHead", "tied_linear_cross_entropy", "KERNEL_AXES", "SPLIT_KERNEL_AXES", "BIAS_AXES"]
