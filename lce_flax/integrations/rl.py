"""Per-token log-probs and entropy of a model's head, for RL post-training (GRPO, PPO), without the logits.

:func:`token_logprobs` is ``log softmax(z / T)[token]`` per token, where ``z`` is the head's (soft-capped) logits
and ``T`` the sampling temperature: the negated per-token loss of :func:`lce_flax.linear_cross_entropy` with
``reduction="none"``, so it runs the fused kernels (per-token cotangents) and carries their gradient. The
temperature is folded into the op's inputs: ``x / T``, ``bias / T`` and a soft-cap ``c / T`` give
``c·tanh(z/c) / T`` exactly (``(c/T)·tanh((z/T)/(c/T))``), so bias and soft-cap are handled, not refused.
With ``return_entropy=True`` the same op call also returns the entropy of that distribution (the op's
``Aux.entropy``, ``LossOptions.entropy``).

:func:`token_entropy` is ``H = lse(z/T) - Σ_v p_v·z_v/T`` per token, alone: the pass that computes the op's
``Aux.entropy`` (:func:`lce_flax._impl.base.entropy`: a loop over vocabulary chunks with float32 online
accumulation, one ``[tokens, chunk]`` block alive, never the ``[tokens, V]`` logits), with ``1/T`` applied to the
float32 logits rather than to the inputs. It carries a gradient, by a backward of its own that recomputes each
chunk. Its cost is one matmul pass over the head (two more with the gradient).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from lce_flax import adapters, api
from lce_flax._impl import base, common
from lce_flax.options import LossOptions, for_head


def _check_temperature(temperature: float) -> float:
  temperature = float(temperature)
  if not temperature > 0:
    raise ValueError(f"temperature={temperature} must be > 0 (greedy decoding has no log-probs to match)")
  return temperature


def _softcap(logit_softcap: float | None, options: LossOptions | None, overrides: dict[str, Any]) -> float | None:
  given = overrides.pop("logit_softcap", None)
  if logit_softcap is not None and given is not None and given != logit_softcap:
    raise ValueError(f"logit_softcap={logit_softcap} and an override logit_softcap={given} disagree")
  cap = logit_softcap if logit_softcap is not None else given
  if cap is None and options is not None:
    cap = options.logit_softcap
  return cap


def token_logprobs(head: Any, x: jax.Array, tokens: jax.Array, *, temperature: float = 1.0,
                   logit_softcap: float | None = None, where: jax.Array | None = None, attr: str | None = None,
                   w_layout: str | None = None, return_entropy: bool = False, vocab_chunk: int | None = None,
                   options: LossOptions | None = None, **overrides: Any):
  """``log p(tokens | x)`` at ``temperature``, per token (float32, shaped like ``tokens``), by the fused op.

  Equals ``jax.nn.log_softmax(logits / temperature)[..., token]`` for ``logits = c·tanh((x @ w + bias)/c)`` (no cap
  when ``logit_softcap`` is None), as tunix's ``selective_log_softmax`` of its temperature-scaled logits.

  Args:
    head: the head, as :func:`lce_flax.adapters.head_loss` accepts it (module, param dict, array + ``w_layout``).
    x: ``[..., H]`` hidden states (the head's input).
    tokens: ``[...]`` the tokens whose log-probs are wanted (the sampled completion, shifted by one).
    temperature: the sampling temperature ``T`` > 0.
    logit_softcap: the model's final-logit soft-cap ``c`` (Gemma 2: 30.0), or None.
    where: optional ``[...]`` mask; masked tokens (and tokens equal to ``ignore_index``) get log-prob 0, masked
      tokens entropy 0.
    attr, w_layout: as in :func:`lce_flax.adapters.head_loss`.
    return_entropy: also return the per-token entropy of ``softmax(logits / T)``: the op's ``Aux.entropy`` from the
      same call (``entropy=True``; one more pass over the vocabulary, see :class:`lce_flax.LossOptions`). It is the
      entropy of the distribution whose log-probs are returned: of ``x / T`` as the op sees it (rounded to the
      compute dtype, as for the log-probs; :func:`token_entropy` scales the float32 logits instead).
    vocab_chunk: the op's ``vocab_chunk``: vocabulary columns per chunk of its lean design and of the entropy's
      pass (None: chosen by shape).
    options, **overrides: the op's options (``dtype=``, ``impl=``, ...). ``label_smoothing`` and ``z_loss`` must
      be 0 and ``reduction`` is ``"none"``: they would change what is computed; ``entropy`` is ``return_entropy``.

  Returns:
    ``logp`` (float32 ``[...]``), or ``(logp, entropy)`` with ``return_entropy``. Both carry gradients.
  """
  temperature = _check_temperature(temperature)
  cap = _softcap(logit_softcap, options, overrides)
  chunk = {} if vocab_chunk is None else {"vocab_chunk": vocab_chunk}
  opts = for_head(options, None, {**overrides, **chunk, "logit_softcap": None, "reduction": "none"})
  if opts.label_smoothing or opts.z_loss:
    raise ValueError(f"token_logprobs: label_smoothing={opts.label_smoothing} and z_loss={opts.z_loss} must be 0 "
                     "(they are not log-probs)")
  if opts.entropy and not return_entropy:
    raise ValueError("token_logprobs: entropy=True is return_entropy=True here (it returns (logp, entropy))")
  (w, bias, layout), own_dtype = adapters.read_head(head, attr=attr, w_layout=w_layout)
  dtype = opts.dtype if opts.dtype is not None else own_dtype
  x = jnp.asarray(x)
  xs, bias_s, cap_s = x, bias, cap
  if temperature != 1.0:
    inv = 1.0 / temperature
    xs = (x.astype(jnp.float32) * inv).astype(x.dtype)
    bias_s = None if bias is None else (bias.astype(jnp.float32) * inv).astype(bias.dtype)
    cap_s = None if cap is None else cap * inv
  opts = opts.replace(logit_softcap=cap_s, dtype=dtype, entropy=return_entropy)
  out = api.linear_cross_entropy(xs, w, tokens, bias=bias_s, where=where, w_layout=layout, options=opts,
                                 return_aux=return_entropy)
  if not return_entropy:
    return -out
  loss, aux = out
  return -loss, _masked(aux.entropy, where)


def _masked(values: jax.Array, where: jax.Array | None) -> jax.Array:
  return values if where is None else jnp.where(jnp.asarray(where).astype(bool), values, 0.0)


def token_entropy(head: Any, x: jax.Array, *, temperature: float = 1.0, logit_softcap: float | None = None,
                  where: jax.Array | None = None, attr: str | None = None, w_layout: str | None = None,
                  vocab_chunk: int | None = None, dtype: Any = None) -> jax.Array:
  """Per-token entropy ``-Σ_v p_v log p_v`` of ``softmax(logits / T)``, alone (no log-probs, no loss).

  The pass that computes the op's ``Aux.entropy`` (see the module doc), local (no partitioning), with ``1/T``
  applied to the float32 logits. It carries a gradient to ``x`` and the head (its backward recomputes each chunk).

  Args:
    head, x, temperature, logit_softcap, where, attr, w_layout: as :func:`token_logprobs`.
    vocab_chunk: columns per chunk (None: chosen by shape, as the op's).
    dtype: the matmul dtype (None: the head's own ``dtype``, else the promoted type of ``x`` and ``w``).

  Returns:
    float32 ``x.shape[:-1]``; 0 where ``where`` is False.

  Example:
    >>> import jax.numpy as jnp
    >>> e = token_entropy(jnp.zeros((3, 8)), jnp.ones((2, 3)), w_layout="hv")  # uniform over 8: log 8
    >>> print(f"{float(e[0]):.4f}")
    2.0794
  """
  temperature = _check_temperature(temperature)
  opts = LossOptions(logit_softcap=logit_softcap, vocab_chunk=vocab_chunk)  # (checks both)
  (w, bias, layout), own_dtype = adapters.read_head(head, attr=attr, w_layout=w_layout)
  dtype = dtype if dtype is not None else own_dtype
  x = jnp.asarray(x)
  hidden, vocab = (w.shape[0], w.shape[1]) if layout == "hv" else (w.shape[1], w.shape[0])
  if x.ndim < 1 or x.shape[-1] != hidden:
    raise ValueError(f"token_entropy: x.shape={x.shape} does not end in the head's H={hidden}")
  xf, w = nn.dtypes.promote_dtype(x.reshape(-1, hidden), w, dtype=dtype)
  chunk = base.entropy_chunk(xf.shape[0], vocab, opts.vocab_chunk)
  ent = base.entropy(xf, w, bias, common.Spec(opts.spec(vocab), layout), chunk, 1.0 / temperature)
  return _masked(ent.reshape(x.shape[:-1]), where)


__all__ = ["token_entropy", "token_logprobs"]
