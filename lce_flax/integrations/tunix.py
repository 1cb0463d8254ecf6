"""google-tunix: the fused loss as a trainer's ``loss_fn``, and RL per-token log-probs, read from the model.

One line for supervised fine-tuning::

    import lce_flax.integrations.tunix as lce_tunix
    trainer = peft_trainer.PeftTrainer(model, optimizer, config).with_loss_fn(lce_tunix.loss_fn)

:func:`loss_fn` has the signature of tunix's default loss (``model, input_tokens, input_mask, positions,
attention_mask, images=None``) and computes the same number: the mean next-token cross-entropy over
``input_mask[:, 1:]``. It reads from the model, as the model's own forward does:

- the hidden states: the model's ``output_hidden_states=True`` sow (``all_hidden_states``), or, for a model
  without that flag (Llama 3), the output of its ``final_norm``; under ``jit`` the unused logits are dead code;
- the head: ``model.lm_head`` (tunix's ``Einsum``, its ``w`` and ``einsum_str`` give the layout), or, when tied
  (``config.use_tied_embedding``, or no ``lm_head``), ``model.embedder.input_embedding`` [V, D];
- the compute dtype: the head's ``dtype`` (``Einsum.dtype``, ``Embedder.dtype``; none: promotion, as the head);
- the final-logit soft-cap: ``model.final_logits_softcap`` or ``model.config.final_logit_softcap`` (Gemma 2/4).

:func:`make_loss_fn` gives the same function with loss options (``z_loss=``, ``dtype=``, ``impl=``, ...).
:func:`per_token_logps` is tunix's ``compute_per_token_logps`` (log-probs of the completion at a temperature)
computed by the fused op, for GRPO/PPO losses, and with ``return_entropy=True`` the entropy from the same op call
(``Aux.entropy``, as tunix's ``compute_entropy_from_logits`` of the logits at that temperature);
:func:`per_token_entropy` the entropy alone (see :mod:`lce_flax.integrations.rl`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from lce_flax import adapters
from lce_flax.integrations import rl
from lce_flax.options import LossOptions


def head_of(model: nnx.Module) -> tuple[Any, str | None]:
  """``(head, attr)``: the module the model's logits come from and the name of its table.

  ``model.lm_head`` unless the model ties its head to the embedding (``config.use_tied_embedding`` (Qwen),
  ``config.weight_tying`` (Llama 3.2), or no ``lm_head`` at all), then ``(model.embedder, "input_embedding")``.
  """
  config = getattr(model, "config", None)
  tied = (bool(getattr(config, "use_tied_embedding", False)) or bool(getattr(config, "weight_tying", False))
          or getattr(model, "lm_head", None) is None)
  if not tied:
    return model.lm_head, None
  embedder = getattr(model, "embedder", None)
  if embedder is None:
    raise TypeError(f"{type(model).__name__} has neither an lm_head nor an embedder; pass the head to "
                    "lce_flax.adapters.head_loss yourself")
  return embedder, "input_embedding" if hasattr(embedder, "input_embedding") else None


def softcap_of(model: nnx.Module) -> float | None:
  """The model's final-logit soft-cap (``final_logits_softcap`` attribute, else ``config.final_logit_softcap``)."""
  cap = getattr(model, "final_logits_softcap", None)
  if cap is None:
    cap = getattr(getattr(model, "config", None), "final_logit_softcap", None)
  return None if cap is None else float(cap)


def _accepts(fn: Callable, name: str) -> bool:
  try:
    return name in inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return False


def hidden_states(model: nnx.Module, input_tokens: jax.Array, positions: jax.Array, attention_mask: jax.Array,
                  **kwargs: Any) -> jax.Array:
  """``[B, L, D]``: the input of the model's head (its final norm's output), for these tokens.

  Runs the model with ``output_hidden_states=True`` under ``nnx.capture`` and takes its ``all_hidden_states`` sow
  (the model is left unchanged); a model without that flag is run capturing its ``final_norm``'s output. The
  model also computes its logits, which ``jit`` drops as dead code (tunix's train steps are jitted); run eagerly,
  they are formed.
  """
  if _accepts(model.__call__, "output_hidden_states"):
    _, sown = nnx.capture(model, nnx.Intermediate)(input_tokens, positions, None, attention_mask,
                                                   output_hidden_states=True, **kwargs)
    return sown["all_hidden_states"].get_value()[-1]
  if getattr(model, "final_norm", None) is None:
    raise TypeError(f"{type(model).__name__} has no output_hidden_states flag and no final_norm to capture")
  _, inter = nnx.capture(model, nnx.Intermediate, method_outputs=nnx.Intermediate)(
      input_tokens, positions, None, attention_mask, **kwargs)
  return inter["final_norm"]["__call__"].get_value()[0]


def head_loss(model: nnx.Module, h: jax.Array, labels: jax.Array, *, where: jax.Array | None = None,
              options: LossOptions | None = None, **overrides: Any):
  """The fused loss of ``model``'s own head (tied or not, its dtype and soft-cap) on hidden states ``h``."""
  head, attr = head_of(model)
  if "logit_softcap" not in overrides and (options is None or options.logit_softcap is None):
    overrides["logit_softcap"] = softcap_of(model)
  return adapters.head_loss(head, h, labels, where=where, attr=attr, options=options, **overrides)


def make_loss_fn(options: LossOptions | None = None, **overrides: Any) -> Callable[..., jax.Array]:
  """A tunix ``loss_fn`` (see :func:`loss_fn`) computing the fused loss with these options."""

  def fused_loss_fn(model: nnx.Module, input_tokens: jax.Array, input_mask: jax.Array, positions: jax.Array,
                    attention_mask: jax.Array, images: jax.Array | None = None) -> jax.Array:
    kwargs = {} if images is None else {"images": images}
    h = hidden_states(model, input_tokens, positions, attention_mask, **kwargs)
    return head_loss(model, h[:, :-1], input_tokens[:, 1:], where=input_mask[:, 1:], options=options,
                     **overrides)

  return fused_loss_fn


def loss_fn(model: nnx.Module, input_tokens: jax.Array, input_mask: jax.Array, positions: jax.Array,
            attention_mask: jax.Array, images: jax.Array | None = None) -> jax.Array:
  """tunix's default SFT loss, fused: mean next-token cross-entropy over ``input_mask[:, 1:]``, no logits.

  Pass it to ``PeftTrainer.with_loss_fn``. Arguments as tunix's default loss function.
  """
  return make_loss_fn()(model, input_tokens, input_mask, positions, attention_mask, images)


def _rl_inputs(model, prompt_tokens, completion_tokens, pad_id, eos_id):
  from tunix.rl import common  # noqa: PLC0415  (the client, imported when used)

  input_tokens, positions, attn_mask, seg_ids = common.process_ids(prompt_tokens, completion_tokens, pad_id, eos_id)
  kwargs = {}
  if seg_ids is not None and _accepts(model.__call__, "segment_ids"):
    kwargs["segment_ids"] = seg_ids
  h = hidden_states(model, input_tokens, positions, attn_mask, **kwargs)
  keep = completion_tokens.shape[1]
  return h[:, -keep - 1:-1], input_tokens[:, -keep:]


def per_token_logps(model: nnx.Module, prompt_tokens: jax.Array, completion_tokens: jax.Array, pad_id: int,
                    eos_id: int, *, temperature: float = 1.0, stop_gradient: bool = True,
                    return_entropy: bool = False, options: LossOptions | None = None, **overrides: Any):
  """tunix's ``compute_per_token_logps`` by the fused op: ``[B, completion_len]`` float32 log-probs.

  The log-probs of ``completion_tokens`` given the prompt and the completion so far, at ``temperature`` (the
  model's soft-cap applied first, as its logits are), with tunix's own input processing (``process_ids``).
  ``return_entropy`` also returns the per-token entropy, from the same op call (its ``Aux.entropy``: one more pass
  over the vocabulary; it carries a gradient, for a PPO entropy bonus, when ``stop_gradient=False``).
  """
  h, targets = _rl_inputs(model, prompt_tokens, completion_tokens, pad_id, eos_id)
  head, attr = head_of(model)
  out = rl.token_logprobs(head, h, targets, temperature=temperature, logit_softcap=softcap_of(model), attr=attr,
                          return_entropy=return_entropy, options=options, **overrides)
  return jax.lax.stop_gradient(out) if stop_gradient else out


def per_token_entropy(model: nnx.Module, prompt_tokens: jax.Array, completion_tokens: jax.Array, pad_id: int,
                      eos_id: int, *, temperature: float = 1.0, vocab_chunk: int | None = None) -> jax.Array:
  """``[B, completion_len]`` entropy of the model's next-token distribution at ``temperature``, without log-probs
  (vocabulary-chunked, differentiable; see :func:`lce_flax.integrations.rl.token_entropy`)."""
  h, _ = _rl_inputs(model, prompt_tokens, completion_tokens, pad_id, eos_id)
  head, attr = head_of(model)
  return rl.token_entropy(head, h, temperature=temperature, logit_softcap=softcap_of(model), attr=attr,
                          vocab_chunk=vocab_chunk)


__all__ = ["head_loss", "head_of", "hidden_states", "loss_fn", "make_loss_fn", "per_token_entropy",
           "per_token_logps", "softcap_of"]
