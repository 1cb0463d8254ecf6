"""DeepMind ``gemma`` models trained by kauldron: the fused cross-entropy as a kauldron loss, one line.

::

    from lce_flax.integrations.kauldron import LinearCrossEntropy

    cfg.train_losses = {"xent": LinearCrossEntropy(model=cfg.model, labels="batch.target",
                                                   mask="batch.loss_mask")}
    # in place of kd.losses.SoftmaxCrossEntropyWithIntLabels(logits="preds.logits", labels="batch.target",
    #                                                         mask="batch.loss_mask")

The loss reads what kauldron already records: the hidden states are the output of the model's ``final_norm``
(kauldron applies the model with ``capture_intermediates=True``, so it is ``interms.final_norm.__call__[0]``) and
the head is the tied embedding ``params['embedder']['input_embedding']`` [V, D], read in place. From ``model`` it
reads the final-logit soft-cap (``config.final_logit_softcap``: 30 for Gemma 2, none for Gemma 3); the matmul
runs in the promoted dtype of the hidden states and the table, as gemma's ``Embedder.decode``. Gemma's
``[B, L, 1]`` targets and masks are accepted as they are.

The loss is the fused mean (fast mode, no ``[B, L, V]`` logits, no per-token values handed to kauldron): its
state is kauldron's ``AllReduceMean`` with the summed loss and the number of counted tokens, so it averages as
``SoftmaxCrossEntropyWithIntLabels`` does. A floating (weighting) mask instead gets per-token losses
(``reduction="none"``), which kauldron weights and sums, so each token is weighted exactly; the op then runs its
per-token design (:func:`lce_flax.explain` with ``reduction="none"``: lean, 8·B·H·V FLOPs, on most devices;
``pallas_mosaic``'s fast ``"logits"`` design on Hopper), and a one-time warning names it. A bool (or 0/1
integer) mask keeps the fused mean. Under ``jit`` (kauldron's train step) the model's own logits are dead code
unless something else (a metric on ``preds.logits``) uses them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from kauldron import kd, kontext

from lce_flax import adapters, api
from lce_flax._impl import base
from lce_flax.options import LossOptions, for_head

_UNSET = "from the model"


def _squeeze_last(a: jax.Array | None, like_ndim: int) -> jax.Array | None:
  """gemma's ``[B, L, 1]`` targets and masks as ``[B, L]`` (``like_ndim`` is the hidden states' ndim - 1)."""
  if a is None:
    return None
  a = jnp.asarray(a)
  return a[..., 0] if a.ndim == like_ndim + 1 and a.shape[-1] == 1 else a


@dataclasses.dataclass(eq=True, frozen=True, kw_only=True)
class LinearCrossEntropy(kd.losses.Loss):
  """Softmax cross-entropy of a gemma model's tied head, fused with the head's matmul (no logits).

  Attributes:
    labels: key of the integer targets, ``[B, L]`` or gemma's ``[B, L, 1]`` (e.g. ``"batch.target"``).
    hidden: key of the head's input (default: the recorded output of the model's ``final_norm``).
    params: key of the model's parameters.
    model: the gemma model (``gm.nn.Gemma3_4B(...)``, ``cfg.model``): its ``config.final_logit_softcap`` is used.
    head: the head's entry in the parameters (``"embedder"``).
    attr: the table in that entry (``"input_embedding"``, gemma's [V, D] embedding).
    logit_softcap: the final-logit soft-cap; by default read from ``model`` (none without a model).
    options: the op's :class:`lce_flax.LossOptions` (``z_loss=``, ``dtype=``, ``impl=``, ...); its ``reduction``
      is set by the loss.
    mask, weight, normalize_by, step: as every kauldron loss; a floating ``mask`` (token weights) gets per-token
      losses instead of the fused mean, and warns once naming what runs (:meth:`explain_per_token`).
  """

  labels: kontext.Key = kontext.REQUIRED
  hidden: kontext.Key = "interms.final_norm.__call__[0]"
  params: kontext.Key = "params"
  model: Any = None
  head: str = "embedder"
  attr: str | None = "input_embedding"
  logit_softcap: float | None | str = _UNSET
  options: LossOptions = LossOptions()

  def _options(self, reduction: str) -> LossOptions:
    if self.options.entropy:
      raise ValueError("LinearCrossEntropy: entropy=True has nowhere to go (a kauldron loss returns one value); "
                       "leave it off")
    cap = self.logit_softcap
    if cap == _UNSET:
      cap = getattr(getattr(self.model, "config", None), "final_logit_softcap", None)
    return self.options.replace(reduction=reduction, logit_softcap=cap)

  def _head(self, params: Any) -> Any:
    if self.head not in params:
      raise KeyError(f"LinearCrossEntropy: no {self.head!r} in the parameters (keys {sorted(params)[:8]}); set "
                     "head= to the head's entry")
    return params[self.head]

  def get_values(self, hidden: jax.Array, labels: jax.Array, params: Any) -> jax.Array:
    """Per-token losses shaped like ``labels`` (kauldron's interface; the fused mean does not use it)."""
    labels_in = jnp.asarray(labels)
    per = adapters.head_loss(self._head(params), hidden, _squeeze_last(labels_in, hidden.ndim - 1), attr=self.attr,
                             options=self._options("none"))
    return per.reshape(labels_in.shape)

  def get_state(self, hidden: jax.Array, labels: jax.Array, params: Any, *, mask: jax.Array | None = None,
                step: int | None = None) -> kd.losses.Loss.State:
    """kauldron's loss state (summed loss, counted tokens), computed by the fused op."""
    hidden = jnp.asarray(hidden)
    labels = _squeeze_last(labels, hidden.ndim - 1)
    mask = _squeeze_last(mask, hidden.ndim - 1)
    weight = self.get_weight(step=step)
    if mask is not None and jnp.issubdtype(mask.dtype, jnp.floating):  # token weights: per-token values
      self._warn_per_token(hidden, labels, params)
      return self.State.from_values(values=self.get_values(hidden, labels, params), mask=mask, weight=weight,
                                    normalize_by=self.normalize_by)
    where = None if mask is None else mask != 0
    total, aux = adapters.head_loss(self._head(params), hidden, labels, where=where, attr=self.attr,
                                    return_aux=True, options=self._options("sum"))
    count = aux.num_tokens if self.normalize_by == "mask" else labels.size
    return self.State(value=total * weight, count=jnp.asarray(count, jnp.float32))

  def explain_per_token(self, hidden: jax.Array, labels: jax.Array, params: Any):
    """What a floating (weighting) mask runs: :func:`lce_flax.explain` of the per-token losses it needs (arrays or
    ``jax.ShapeDtypeStruct``; gemma's ``[B, L, 1]`` labels accepted)."""
    (w, bias, layout), dtype = adapters.read_head(self._head(params), attr=self.attr)
    shape = tuple(labels.shape)
    if len(shape) == len(hidden.shape) and shape[-1:] == (1,):  # gemma's [B, L, 1]
      shape = shape[:-1]
    return api.explain(hidden, w, jax.ShapeDtypeStruct(shape, jnp.int32), bias=bias, w_layout=layout,
                       options=for_head(self._options("none"), dtype, {}))

  def _warn_per_token(self, hidden: jax.Array, labels: jax.Array, params: Any) -> None:
    d = self.explain_per_token(hidden, labels, params)
    flops = "6·B·H·V" if d.mode == "fast" else "8·B·H·V"
    base.warn_once(("kauldron", "weighting mask", d.impl, d.mode, d.name), (
        f"LinearCrossEntropy: the mask is floating (token weights), so kauldron gets per-token losses "
        f"(reduction='none'), not the fused mean: impl={d.impl!r} runs its {d.mode} {d.name!r} design ({flops} "
        "FLOPs; LinearCrossEntropy.explain_per_token or lce_flax.explain(..., reduction='none') says more). A bool "
        "or 0/1 integer mask keeps the fused mean."))

  def get_state_from_context(self, context: Any) -> kd.losses.Loss.State:
    kwargs = kontext.resolve_from_keyed_obj(context, self)
    return self.get_state(**kwargs)


__all__ = ["LinearCrossEntropy"]
