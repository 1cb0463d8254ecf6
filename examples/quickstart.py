"""Quick start: a small Flax language model trained with its head swapped for lce_flax's fused head.

    python examples/quickstart.py            # both heads, about a minute on 2 CPU cores

The model is an ordinary linen module. Its head, written as users write it, is

    logits = nn.Dense(vocab, use_bias=False, name="head")(h)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

and the swap is one line, ``loss = LMHead(vocab, name="head")(h, labels)``: the same ``kernel`` [H, V] under the same
name (a checkpoint of one loads into the other), the same loss, without the [tokens, V] logits. This script trains
both from the same initial parameters on word-level text (the reference manual's help topics that come with
Python) and prints their losses side by side and the memory XLA compiled for each train step.
The full trainer (meshes, checkpoints, largest batch, GPU presets) is ``examples/train_lm.py``.
"""

from __future__ import annotations

import argparse
import collections
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from lce_flax.linen import LMHead


def load_tokens(vocab: int) -> np.ndarray:
  """Lower-cased words and punctuation of Python's help topics, as ids of the ``vocab - 1`` most common (0: other)."""
  from pydoc_data import topics  # plain English text that ships with CPython

  words = re.findall(r"[a-z]+|[^\sa-z]", " ".join(topics.topics[k] for k in sorted(topics.topics)).lower())
  ids = {w: i + 1 for i, (w, _) in enumerate(collections.Counter(words).most_common(vocab - 1))}
  return np.asarray([ids.get(w, 0) for w in words], np.int32)


class Block(nn.Module):
  """Pre-LayerNorm block: causal self-attention, then an MLP."""

  dim: int
  heads: int

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(self.heads)(h, mask=nn.make_causal_mask(jnp.ones(x.shape[:2])))
    h = nn.LayerNorm()(x)
    return x + nn.Dense(self.dim)(nn.gelu(nn.Dense(4 * self.dim)(h)))


class TinyLM(nn.Module):
  vocab: int
  fused: bool  # True: lce_flax's head; False: nn.Dense + optax
  dim: int = 128
  layers: int = 2
  heads: int = 4

  @nn.compact
  def __call__(self, tokens, labels):
    pos = self.param("pos", nn.initializers.normal(0.02), (tokens.shape[1], self.dim))
    h = nn.Embed(self.vocab, self.dim)(tokens) + pos
    for _ in range(self.layers):
      h = Block(self.dim, self.heads)(h)
    h = nn.LayerNorm()(h)
    if self.fused:  # after: one op, the loss from h and the head's kernel
      return LMHead(self.vocab, use_bias=False, name="head")(h, labels)
    logits = nn.Dense(self.vocab, use_bias=False, name="head")(h)  # before: [B, T, V] logits
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def batches(ids: np.ndarray, batch: int, seq: int, seed: int = 0):
  """Random windows of ``seq + 1`` tokens: inputs and next-token labels."""
  rng = np.random.default_rng(seed)
  while True:
    starts = rng.integers(0, len(ids) - seq - 1, batch)
    win = np.stack([ids[s:s + seq + 1] for s in starts])
    yield jnp.asarray(win[:, :-1]), jnp.asarray(win[:, 1:])


def make_step(model: TinyLM, tx: optax.GradientTransformation):
  def step(params, opt_state, tokens, labels):
    loss, grads = jax.value_and_grad(lambda p: model.apply({"params": p}, tokens, labels))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(step, donate_argnums=(0, 1))


def train(fused: bool, ids: np.ndarray, args) -> dict:
  """Trains one head from the seed's parameters; returns its losses and the compiled step's temporary bytes."""
  model = TinyLM(args.vocab, fused)
  data = batches(ids, args.batch, args.seq)
  tokens, labels = next(data)
  params = model.init(jax.random.key(0), tokens, labels)["params"]  # the same numbers for both heads
  warmup = min(10, args.steps // 2)
  tx = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, max(args.steps, warmup + 1)))
  opt_state = tx.init(params)
  step = make_step(model, tx)
  temp = step.lower(params, opt_state, tokens, labels).compile().memory_analysis().temp_size_in_bytes
  losses = []
  for _ in range(args.steps):
    params, opt_state, loss = step(params, opt_state, tokens, labels)
    losses.append(float(loss))
    tokens, labels = next(data)
  return {"losses": losses, "temp_bytes": int(temp)}


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=150)
  p.add_argument("--vocab", type=int, default=8192)
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--seq", type=int, default=64)
  p.add_argument("--lr", type=float, default=3e-3)
  args = p.parse_args(argv)
  ids = load_tokens(args.vocab)
  print(f"{len(ids):,} tokens, vocabulary {args.vocab}; batch {args.batch} x {args.seq} tokens, {args.steps} steps")
  runs = {name: train(name == "fused", ids, args) for name in ("plain", "fused")}
  print(f"{'step':>6} {'plain loss':>11} {'fused loss':>11}")
  for i in sorted({0, *range(9, args.steps, max(args.steps // 6, 1)), args.steps - 1}):
    print(f"{i + 1:6d} {runs['plain']['losses'][i]:11.4f} {runs['fused']['losses'][i]:11.4f}")
  mib = {k: r["temp_bytes"] / 2**20 for k, r in runs.items()}
  print(f"train step's temporary memory: plain {mib['plain']:.1f} MiB, fused {mib['fused']:.1f} MiB "
        f"({mib['plain'] / mib['fused']:.1f}x less with the fused head)")
  return runs


if __name__ == "__main__":
  main()
