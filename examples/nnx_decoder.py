"""A small NNX decoder written the way a public framework writes it, trained with the fused loss through an adapter.

The model is not changed for the fused loss: its head is an ``nnx.Einsum`` (kernel [D, V]) or, tied, a custom
``Embedder`` holding a [V, D] table; its parameters carry the mesh axis names ("fsdp", "tp") directly. The only
hook used is the ``return_hidden`` flag, which returns the head's input instead of the logits. The loss is::

    h = model(tokens, return_hidden=True)                            # [B, T, D]; the head is not called
    loss = lce_flax.adapters.head_loss(model.lm_head(), h, labels)   # gradients land on the model's own weight

and equals the model's own ``optax.softmax_cross_entropy_with_integer_labels(model(tokens), labels)`` over counted
tokens (``tests/test_integration.py`` checks the loss and every gradient to 1e-5 in float32).

Run ``python examples/nnx_decoder.py`` (a few seconds on CPU): it trains a few ``optax.adamw`` steps with each head
and prints the fused and the reference loss of every step.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from lce_flax import adapters  # noqa: E402
from lce_flax.sharding import sharded_linear_cross_entropy  # noqa: E402

FSDP, TP = "fsdp", "tp"
IGNORE = -100


@dataclasses.dataclass(frozen=True)
class Config:
  vocab_size: int = 250
  embed_dim: int = 32
  num_heads: int = 2
  head_dim: int = 16
  mlp_dim: int = 64
  num_layers: int = 2
  tie_embeddings: bool = False


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], sharding: tuple[str | None, ...], scale: float) -> nnx.Param:
  """A float32 parameter annotated with mesh axis names, as the framework does (no logical names, no rules)."""
  return nnx.Param(scale * jax.random.normal(rngs.params(), shape, jnp.float32), out_sharding=sharding)


class Embedder(nnx.Module):
  """The framework's embedding: a [V, D] table, ``encode`` for the input and ``decode`` for the tied logits."""

  def __init__(self, vocab_size: int, embed_dim: int, *, rngs: nnx.Rngs):
    self.input_embedding = _param(rngs, (vocab_size, embed_dim), (TP, FSDP), embed_dim ** -0.5)
    self.embed_dim = embed_dim

  def encode(self, tokens: jax.Array) -> jax.Array:
    return self.input_embedding[...][tokens] * jnp.sqrt(self.embed_dim).astype(jnp.float32)

  def decode(self, x: jax.Array) -> jax.Array:
    return jnp.einsum("btd,vd->btv", x, self.input_embedding[...])


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, *, rngs: nnx.Rngs):
    del rngs
    self.scale = nnx.Param(jnp.zeros((dim,), jnp.float32), out_sharding=(None,))

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    return x * (1.0 + self.scale[...])


def _einsum(eq: str, shape: tuple[int, ...], sharding: tuple[str | None, ...], rngs: nnx.Rngs) -> nnx.Einsum:
  return nnx.Einsum(eq, shape, kernel_init=nnx.initializers.normal(shape[0] ** -0.5),
                    kernel_metadata={"out_sharding": sharding}, rngs=rngs)


class Block(nnx.Module):
  """Pre-norm causal self-attention and a gated MLP, every projection an ``nnx.Einsum``."""

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    d, n, k, f = cfg.embed_dim, cfg.num_heads, cfg.head_dim, cfg.mlp_dim
    self.attn_norm = RMSNorm(d, rngs=rngs)
    self.qkv = _einsum("btd,sdnk->sbtnk", (3, d, n, k), (None, FSDP, TP, None), rngs)
    self.out = _einsum("btnk,nkd->btd", (n, k, d), (TP, None, FSDP), rngs)
    self.mlp_norm = RMSNorm(d, rngs=rngs)
    self.gate_up = _einsum("btd,gdf->gbtf", (2, d, f), (None, FSDP, TP), rngs)
    self.down = _einsum("btf,fd->btd", (f, d), (TP, FSDP), rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    q, k, v = self.qkv(self.attn_norm(x))
    t = x.shape[1]
    scores = jnp.einsum("bsnk,btnk->bnst", q, k) * q.shape[-1] ** -0.5
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e30)
    x = x + self.out(jnp.einsum("bnst,btnk->bsnk", jax.nn.softmax(scores, axis=-1), v))
    gate, up = self.gate_up(self.mlp_norm(x))
    return x + self.down(jax.nn.gelu(gate) * up)


class Decoder(nnx.Module):
  """The framework's decoder: ``model(tokens)`` returns the logits, ``model(tokens, return_hidden=True)`` the
  head's input (the final norm's output) without calling the head."""

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embedder = Embedder(cfg.vocab_size, cfg.embed_dim, rngs=rngs)
    self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.embed_dim, rngs=rngs)
    if not cfg.tie_embeddings:
      self.head = _einsum("BTD,DV->BTV", (cfg.embed_dim, cfg.vocab_size), (FSDP, TP), rngs)

  def __call__(self, tokens: jax.Array, *, return_hidden: bool = False) -> jax.Array:
    x = self.embedder.encode(tokens)
    for block in self.blocks:
      x = block(x)
    h = self.final_norm(x)
    if return_hidden:
      return h
    return self.embedder.decode(h) if self.cfg.tie_embeddings else self.head(h)

  def lm_head(self) -> nnx.Module:
    """The module that holds the output weight: the ``nnx.Einsum``, or the ``Embedder`` when tied."""
    return self.embedder if self.cfg.tie_embeddings else self.head


def fused_loss(model: Decoder, tokens: jax.Array, labels: jax.Array, mesh: jax.sharding.Mesh | None = None
               ) -> jax.Array:
  """The fused loss through the adapter: no [B, T, V] logits; the gradient lands on the head's own weight.

  One device, or a mesh whose "tp" axis has size 1: :func:`lce_flax.adapters.head_loss`. With "tp" > 1 the
  head's vocabulary dim is split over "tp" (the framework's annotation), so the weight read by
  :func:`lce_flax.adapters.head_weights` goes to the vocab-parallel ``sharded_linear_cross_entropy``, told the
  framework's mesh axis names.
  """
  h = model(tokens, return_hidden=True)
  if mesh is None or mesh.shape[TP] == 1:
    return adapters.head_loss(model.lm_head(), h, labels, ignore_index=IGNORE)
  w, bias, w_layout = adapters.head_weights(model.lm_head())
  return sharded_linear_cross_entropy(h, w, labels, bias=bias, w_layout=w_layout, mesh=mesh, batch_axes=FSDP,
                                      vocab_axis=TP, fsdp_axis=FSDP, ignore_index=IGNORE)


def reference_loss(model: Decoder, tokens: jax.Array, labels: jax.Array) -> jax.Array:
  """The model's own head + optax, mean over the counted tokens."""
  counted = labels != IGNORE
  per_token = optax.softmax_cross_entropy_with_integer_labels(model(tokens), jnp.where(counted, labels, 0))
  return jnp.sum(jnp.where(counted, per_token, 0.0)) / jnp.maximum(counted.sum(), 1)


def make_batch(rng: np.random.Generator, cfg: Config, batch: int, length: int) -> tuple[jax.Array, jax.Array]:
  """Random documents of ragged lengths, right-padded; the labels are the next tokens, IGNORE past each end."""
  tokens = rng.integers(0, cfg.vocab_size, size=(batch, length + 1))
  ends = rng.integers(length // 2, length + 1, size=batch)
  labels = np.where(np.arange(length)[None, :] < ends[:, None] - 1, tokens[:, 1:], IGNORE)
  return jnp.asarray(tokens[:, :-1], jnp.int32), jnp.asarray(labels, jnp.int32)


def make_mesh(fsdp: int = 1, tp: int = 1) -> jax.sharding.Mesh:
  return jax.make_mesh((fsdp, tp), (FSDP, TP), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                       devices=jax.devices()[:fsdp * tp])


def build(cfg: Config, mesh: jax.sharding.Mesh, seed: int = 0) -> tuple[Decoder, nnx.Optimizer]:
  """The model (its parameters placed on ``mesh`` by their annotations) and its ``optax.adamw`` optimizer."""
  with jax.set_mesh(mesh):
    model = Decoder(cfg, rngs=nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, optax.adamw(3e-3, weight_decay=0.1), wrt=nnx.Param)
  return model, optimizer


@functools.partial(nnx.jit, static_argnames="mesh")
def train_step(model: Decoder, optimizer: nnx.Optimizer, tokens: jax.Array, labels: jax.Array,
               mesh: jax.sharding.Mesh | None = None) -> jax.Array:
  loss, grads = nnx.value_and_grad(fused_loss)(model, tokens, labels, mesh)
  optimizer.update(model, grads)
  return loss


@nnx.jit
def reference_value(model: Decoder, tokens: jax.Array, labels: jax.Array) -> jax.Array:
  return reference_loss(model, tokens, labels)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--length", type=int, default=33)
  parser.add_argument("--fsdp", type=int, default=1)
  parser.add_argument("--tp", type=int, default=1)
  args = parser.parse_args(argv)
  mesh = make_mesh(args.fsdp, args.tp)
  for tied in (False, True):
    cfg = Config(tie_embeddings=tied)
    model, optimizer = build(cfg, mesh)
    rng = np.random.default_rng(0)
    print(f"head: {type(model.lm_head()).__name__} ({'tied' if tied else 'untied'}), mesh {dict(mesh.shape)}")
    with jax.set_mesh(mesh):
      for step in range(args.steps):
        tokens, labels = make_batch(rng, cfg, args.batch, args.length)
        reference = reference_value(model, tokens, labels)  # before the step, on the same parameters
        fused = train_step(model, optimizer, tokens, labels, mesh)
        print(f"  step {step}: fused {float(fused):.6f}  model head + optax {float(reference):.6f}")


if __name__ == "__main__":
  main()
