"""Per-token log-probs and entropy of a model's head, for RL post-training (GRPO, PPO), without the logits.

:func:`token_logprobs` is ``log softmax(z / T)[token]`` per token, where ``z`` is the head's (soft-capped) logits
and ``T`` the sampling temperature: the negated per-token loss of :func:`lce_flax.linear_cross_entropy` with
``reduction="none"``, so it runs the fused kernels (lean mode: per-token cotangents) and carries their gradient.
The temperature is folded into the op's inputs: ``x / T``, ``bias / T`` and a soft-cap ``c / T`` give
``c·tanh(z/c) / T`` exactly (``(c/T)·tanh((z/T)/(c/T))``), so bias and soft-cap are handled, not refused.

:func:`token_entropy` is ``H = lse(z/T) - Σ_v p_v·z_v/T`` per token. The fused kernels do not compute ``Σ p·z``,
so it runs **a separate pure-JAX pass**: a ``lax.scan`` over vocabulary chunks of ``vocab_chunk`` columns with
an online (running-max) float32 accumulation of ``Σ e^z`` and ``Σ e^z·z``; it holds one ``[tokens, chunk]`` block,
never the ``[tokens, V]`` logits. It is differentiable: the scan body is rematerialised (``jax.checkpoint``), so
the backward recomputes each chunk and keeps only ``[tokens]`` carries per chunk. Its cost is one more matmul
pass over the head (two more with the gradient) on top of the loss.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from lce_flax import _math, adapters, api
from lce_flax._impl import common
from lce_flax.options import LossOptions, for_head

DEFAULT_VOCAB_CHUNK = 2048


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
    where: optional ``[...]`` mask; masked tokens (and tokens equal to ``ignore_index``) get log-prob 0.
    attr, w_layout: as in :func:`lce_flax.adapters.head_loss`.
    return_entropy: also return :func:`token_entropy` (a separate chunked pure-JAX pass, see the module doc).
    vocab_chunk: the entropy pass's vocabulary chunk.
    options, **overrides: the op's options (``dtype=``, ``impl=``, ...). ``label_smoothing`` and ``z_loss`` must
      be 0 and ``reduction`` is ``"none"``: they would change what is computed.

  Returns:
    ``logp`` (float32 ``[...]``), or ``(logp, entropy)`` with ``return_entropy``. Both are differentiable.
  """
  temperature = _check_temperature(temperature)
  cap = _softcap(logit_softcap, options, overrides)
  opts = for_head(options, None, {**overrides, "logit_softcap": None, "reduction": "none"})
  if opts.label_smoothing or opts.z_loss:
    raise ValueError(f"token_logprobs: label_smoothing={opts.label_smoothing} and z_loss={opts.z_loss} must be 0 "
                     "(they are not log-probs)")
  (w, bias, layout), own_dtype = adapters.read_head(head, attr=attr, w_layout=w_layout)
  dtype = opts.dtype if opts.dtype is not None else own_dtype
  x = jnp.asarray(x)
  xs, bias_s, cap_s = x, bias, cap
  if temperature != 1.0:
    inv = 1.0 / temperature
    xs = (x.astype(jnp.float32) * inv).astype(x.dtype)
    bias_s = None if bias is None else (bias.astype(jnp.float32) * inv).astype(bias.dtype)
    cap_s = None if cap is None else cap * inv
  opts = opts.replace(logit_softcap=cap_s, dtype=dtype)
  loss = api.linear_cross_entropy(xs, w, tokens, bias=bias_s, where=where, w_layout=layout, options=opts)
  logp = -loss
  if not return_entropy:
    return logp
  ent = token_entropy(head, x, temperature=temperature, logit_softcap=cap, where=where, attr=attr,
                      w_layout=w_layout, vocab_chunk=vocab_chunk, dtype=dtype)
  return logp, ent


def token_entropy(head: Any, x: jax.Array, *, temperature: float = 1.0, logit_softcap: float | None = None,
                  where: jax.Array | None = None, attr: str | None = None, w_layout: str | None = None,
                  vocab_chunk: int | None = None, dtype: Any = None) -> jax.Array:
  """Per-token entropy ``-Σ_v p_v log p_v`` of ``softmax(logits / T)``, by a vocabulary-chunked pure-JAX pass.

  This does not run the fused kernels (they do not compute ``Σ p·z``): a ``lax.scan`` over chunks of
  ``vocab_chunk`` columns accumulates in float32, holding one ``[tokens, chunk]`` block at a time. It is
  differentiable (the scan body is rematerialised in the backward).

  Args:
    head, x, temperature, logit_softcap, where, attr, w_layout: as :func:`token_logprobs`.
    vocab_chunk: columns per chunk (None: ``min(V, 2048)``).
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
  (w, bias, layout), own_dtype = adapters.read_head(head, attr=attr, w_layout=w_layout)
  dtype = dtype if dtype is not None else own_dtype
  x = jnp.asarray(x)
  hidden, vocab = (w.shape[0], w.shape[1]) if layout == "hv" else (w.shape[1], w.shape[0])
  if x.ndim < 1 or x.shape[-1] != hidden:
    raise ValueError(f"token_entropy: x.shape={x.shape} does not end in the head's H={hidden}")
  chunk = min(vocab, DEFAULT_VOCAB_CHUNK if vocab_chunk is None else int(vocab_chunk))
  if chunk < 1:
    raise ValueError(f"vocab_chunk={vocab_chunk} must be >= 1")
  lead = x.shape[:-1]
  xf = x.reshape(-1, hidden)
  xf, w = nn.dtypes.promote_dtype(xf, w, dtype=dtype)
  n_chunks = -(-vocab // chunk)
  inv_t = 1.0 / temperature

  @jax.checkpoint
  def body(carry, i):
    m, s, t = carry
    # the last chunk's window is clamped to end at V; its columns already counted are masked out
    start, _, fresh = common.vocab_window(i, chunk, vocab)
    z = common.logits(xf, common.slice_vocab(w, start, chunk, layout), layout)
    if bias is not None:
      z = z + jax.lax.dynamic_slice_in_dim(bias, start, chunk).astype(jnp.float32)
    z = _math.softcap(z, logit_softcap) * inv_t
    z_max = jnp.max(jnp.where(fresh, z, -jnp.inf), axis=-1)
    m_new = jnp.maximum(m, z_max)
    e = jnp.where(fresh, jnp.exp(z - m_new[:, None]), 0.0)
    scale = jnp.exp(m - m_new)
    s = s * scale + jnp.sum(e, axis=-1)
    t = t * scale + jnp.sum(e * jnp.where(fresh, z, 0.0), axis=-1)
    return (m_new, s, t), None

  n = xf.shape[0]
  init = (jnp.full((n,), -jnp.inf, jnp.float32), jnp.zeros((n,), jnp.float32), jnp.zeros((n,), jnp.float32))
  (m, s, t), _ = jax.lax.scan(body, init, jnp.arange(n_chunks))
  ent = (m + jnp.log(s) - t / s).reshape(lead)
  if where is not None:
    ent = jnp.where(jnp.asarray(where).astype(bool), ent, 0.0)
  return ent


__all__ = ["token_entropy", "token_logprobs"]
