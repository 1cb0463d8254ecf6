"""The model: a small decoder-only transformer whose head is either the fused one (``lce_flax.linen.LMHead``) or the
plain one, written as users write it (``nn.Dense(V, dtype=...)`` + ``optax.softmax_cross_entropy_with_integer_labels``).

Both heads build the same parameter tree (``params/head/kernel`` is ``[H, V]``, same initialiser, same logical axis
names), so at the same seed they start from the same numbers and a checkpoint of one loads into the other.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from lce_flax import LossOptions
from lce_flax.linen import KERNEL_AXES, SPLIT_KERNEL_AXES, LMHead
from lce_flax.sharding import DATA, DEFAULT_RULES, FSDP

HEADS = ("fused", "plain")
EMBED_GRADS = ("reduce", "gather")
HEAD_INIT = nn.initializers.normal(0.02)
EMBED_INIT = nn.initializers.normal(0.02)
# Logical name of the embedding table's V dim under ``split_embed``, and the trainer's axis rules: the package's
# (lce_flax.sharding.DEFAULT_RULES) and this name over the axes that split the tokens. Under rules without it
# (DEFAULT_RULES alone) the table is replicated, and the lookup splits it itself (:func:`split_lookup`).
EMBED_ROWS = "embed_rows"
RULES = (*DEFAULT_RULES, (EMBED_ROWS, (DATA, FSDP)))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int
  seq_len: int
  d_model: int
  num_layers: int
  num_heads: int
  d_ff: int
  dtype: str = "float32"
  remat: bool = False
  layer_grads_in_order: bool = True  # see :func:`_in_order`
  # > 0: the head's parameter gradients are complete (on a data-parallel mesh: reduced) before the backward
  # leaves the top ``head_grads_within`` blocks, so their reduction overlaps those blocks' backward (see
  # :func:`_hold_open`); 0: XLA places it (the trainer's GPU presets take 1, examples/lm/main.py)
  head_grads_within: int = 0
  # how the embedding table's gradient is formed on a mesh that splits the tokens: "reduce" (each device
  # scatter-adds its rows' gradients into a [V, H] table, then the tables are all-reduced) or "gather" (the rows'
  # gradients and their token ids are all-gathered, and each device scatter-adds all of them: the tokens' B·H
  # elements instead of the table's V·H on the wire; measured faster on four GPUs); either scatter-adds in float32
  # (see :func:`lookup`; with ``split_embed``, :func:`split_lookup`)
  embed_grads: str = "gather"
  # the head's kernel (and so its optimizer state) split on H over the axes that split the tokens, "data" as well
  # as "fsdp" (lce_flax.linen.SPLIT_KERNEL_AXES): each device holds and updates 1/n of it, gathers it in the compute
  # dtype for the step and reduce-scatters its gradient (half an all-reduce's bytes); False: its H over "fsdp" only,
  # as the rest of the model (KERNEL_AXES), V over "tensor" either way
  split_head: bool = False
  # the embedding table (and so its AdamW moments) split on V over the axes that split the tokens ("data" and
  # "fsdp", logical name EMBED_ROWS): each device holds and updates V/n rows, and the lookup runs vocabulary-parallel
  # over those axes (:func:`split_lookup`: the token ids are all-gathered, each device looks up the ids of its rows
  # and a reduce-scatter of the [all tokens, H] rows gives each device its own; the backward all-gathers the rows'
  # gradients and each device scatter-adds those of its ids), so the table is never gathered. Needs V divisible by
  # the number of devices that split the tokens. False: replicated. Not yet measured on GPUs
  split_embed: bool = False

  @property
  def head_axes(self) -> tuple[str, str]:
    """Logical names of the head's kernel [H, V]."""
    return SPLIT_KERNEL_AXES if self.split_head else KERNEL_AXES


class Block(nn.Module):
  """Pre-LayerNorm transformer block: causal self-attention and a GELU MLP."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
    head_dim = cfg.d_model // cfg.num_heads
    h = nn.LayerNorm(dtype=dtype, name="ln_attn")(x)
    qkv = nn.DenseGeneral((3, cfg.num_heads, head_dim), use_bias=False, dtype=dtype, name="qkv")(h)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    a = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    x = x + nn.DenseGeneral(cfg.d_model, axis=(-2, -1), use_bias=False, dtype=dtype, name="attn_out")(a)
    h = nn.LayerNorm(dtype=dtype, name="ln_mlp")(x)
    h = nn.gelu(nn.Dense(cfg.d_ff, dtype=dtype, name="mlp_in")(h))
    return x + nn.Dense(cfg.d_model, dtype=dtype, name="mlp_out")(h)


def fsdp_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
  """``lax.dot_general`` that first gathers a contracting dim of the kernel split over a mesh axis (what FSDP does
  before a matmul; a mesh of Explicit axes will not contract over a dim split on one side only). Without a mesh
  it is ``lax.dot_general``."""
  spec = getattr(jax.typeof(rhs).sharding, "spec", None)
  (_, rc), _ = dimension_numbers
  if spec is not None and any(d < len(spec) and spec[d] is not None for d in rc):
    rhs = jax.sharding.reshard(rhs, P(*(None if d in rc else s for d, s in enumerate(spec))))
  return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                             preferred_element_type=preferred_element_type)


def _token_spec(tokens: jax.Array) -> P | None:
  """``tokens``' PartitionSpec, one entry per dim, where its type names a mesh (an Explicit one); else None."""
  sharding = jax.typeof(tokens).sharding
  if not getattr(getattr(sharding, "mesh", None), "axis_names", ()):
    return None
  return P(*(tuple(sharding.spec) + (None,) * tokens.ndim)[:tokens.ndim])


def _axes_of(spec: P | None) -> tuple[str, ...]:
  """The mesh axes a PartitionSpec names, in order."""
  return tuple(a for s in spec or () for a in ((s,) if isinstance(s, str) else s or ()))


def embed_lookup(table: jax.Array, tokens: jax.Array) -> jax.Array:
  """``nn.Embed``'s lookup (``table[tokens]``); on an Explicit mesh the rows come out split like ``tokens`` (a gather
  from a replicated table with split indices needs its output sharding spelled out there)."""
  spec = _token_spec(tokens)
  if spec is None:
    return jnp.take(table, tokens, axis=0)
  return table.at[tokens].get(out_sharding=P(*spec, None))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def lookup(vocab_size: int, grads: str, table: jax.Array, tokens: jax.Array) -> jax.Array:
  """:func:`embed_lookup` whose backward forms the table's gradient in float32: each row's gradient is scatter-added
  into a float32 [V, H] table, cast to the table's dtype after. JAX's own transpose of the lookup scatter-adds in
  the table's dtype; in bf16, with token ids distributed as text's are (a few ids take many rows), that scatter took
  7.8 ms for 8192 rows against 0.71 ms in float32 on an H100, and its error was 11x larger
  (``benchmarks/results/embed-grads-h100-2026-11-27/``).

  On a mesh that splits ``tokens``, ``grads`` says how the devices' rows come together:

  - ``"reduce"``: each device scatter-adds its own rows and the [V, H] tables (in the table's dtype) are summed
    over the axes that split the tokens;
  - ``"gather"``: the rows' gradients and token ids are all-gathered and each device scatter-adds all of them, so
    the table's gradient is the same everywhere with no reduction. On k devices each receives (k - 1)·B_d·H
    elements (B_d: its tokens) where a ring all-reduce of the table moves about 2·(k - 1)/k·V·H; at the trainer's
    gpu preset (B_d = 8192, V = 131072) on four devices, 8x fewer."""
  del vocab_size, grads
  return embed_lookup(table, tokens)


def _lookup_fwd(vocab_size, grads, table, tokens):
  return embed_lookup(table, tokens), tokens  # (not the table: its [V, H] copy in the compute dtype would stay alive)


def _scatter_rows(num_rows: int, rows_t: jax.Array, ids: jax.Array) -> jax.Array:
  """A table's gradient [num_rows, H]: the rows' gradients ``rows_t`` [..., H] scatter-added at ``ids`` [...] in
  float32 (an id past ``num_rows`` dropped), cast to their dtype after (:func:`lookup` says why float32)."""
  table_t = jnp.zeros((num_rows, rows_t.shape[-1]), jnp.float32)
  rows_t32 = rows_t.reshape(-1, rows_t.shape[-1]).astype(jnp.float32)
  return table_t.at[ids.reshape(-1)].add(rows_t32, mode="drop").astype(rows_t.dtype)


def _lookup_bwd(vocab_size, grads, tokens, rows_t):
  scatter = functools.partial(_scatter_rows, vocab_size)
  spec = _token_spec(tokens)
  split = _axes_of(spec)
  if not split:
    return scatter(rows_t, tokens), None
  if grads == "gather":  # every device gets every row and id
    return scatter(jax.sharding.reshard(rows_t, P()), jax.sharding.reshard(tokens, P())), None
  table_t = jax.shard_map(lambda r, t: lax.psum(scatter(r, t), split), mesh=jax.typeof(tokens).sharding.mesh,
                          in_specs=(P(*spec, None), spec), out_specs=P())(rows_t, tokens)
  return table_t, None


lookup.defvjp(_lookup_fwd, _lookup_bwd)


def split_lookup(vocab_size: int, grads: str, table: jax.Array, tokens: jax.Array) -> jax.Array:
  """:func:`lookup` from a table whose rows (V) are split over the mesh axes that split ``tokens``, without
  gathering the table (``ModelConfig.split_embed``). Where nothing splits the tokens (one device, no mesh, a mesh of
  Auto axes, whose types name no split) it is :func:`lookup` itself. A table placed otherwise (replicated, say) is
  first resharded to that split.

  Vocabulary-parallel over the n devices that split the tokens (each holds rows [i·V/n, (i+1)·V/n) of the table):

  - forward: the token ids are all-gathered (int32); each device looks up the ids of its rows and leaves zeros for
    the others, and a reduce-scatter (psum_scatter) of those [all tokens, H] rows gives each device the rows of its
    own tokens. Each device sends (n - 1)·B_d·H elements in the compute dtype (B_d: its tokens), where gathering
    the table would bring it (n - 1)/n·V·H; the sums add zeros to one row, so the rows are exact;
  - backward, ``grads="gather"``: the rows' gradients are all-gathered with their ids, as :func:`lookup`'s
    "gather" does, and each device scatter-adds in float32 those whose ids are its rows into its [V/n, H]
    gradient; ``grads="reduce"``: each device scatter-adds its own rows' gradients into a float32 [V, H] table
    and the tables (cast to the table's dtype) are reduce-scattered over V. Neither all-reduces the table's
    gradient.

  V must be divisible by n (the error says so)."""
  spec = _token_spec(tokens)
  split = _axes_of(spec)
  if not split:
    return lookup(vocab_size, grads, table, tokens)
  mesh = jax.typeof(tokens).sharding.mesh
  n = 1
  for a in split:
    n *= mesh.shape[a]
  if vocab_size % n:
    raise ValueError(f"split_embed: vocab_size={vocab_size} must be divisible by the {n} devices that split the "
                     f"tokens (mesh axes {split}), whose rows of the embedding table each holds")
  if tuple(getattr(jax.typeof(table).sharding, "spec", ())) != tuple(_rows_spec(split)):
    table = jax.sharding.reshard(table, _rows_spec(split))
  return _split_lookup(vocab_size, grads, split, table, tokens)


def _rows_spec(split: tuple[str, ...]) -> P:
  """The PartitionSpec of a table [V, H] whose rows are split over the mesh axes ``split``."""
  return P(split[0] if len(split) == 1 else split, None)


def _split_rows(split, table, tokens):
  """The rows of ``tokens`` from ``table`` [V, H] split as :func:`_rows_spec` says (the forward of
  :func:`split_lookup`)."""
  spec = _token_spec(tokens)

  def body(table, tokens):
    ids = lax.all_gather(tokens.reshape(-1), split, tiled=True)  # every device's ids, in the devices' order
    local = ids - lax.axis_index(split) * table.shape[0]  # this device holds rows [i·V/n, (i+1)·V/n)
    mine = (local >= 0) & (local < table.shape[0])
    rows = jnp.take(table, jnp.where(mine, local, 0), axis=0)
    rows = jnp.where(mine[:, None], rows, jnp.zeros((), table.dtype))  # zeros for the ids of the other devices
    rows = lax.psum_scatter(rows, split, scatter_dimension=0, tiled=True)  # each device's own tokens' rows
    return rows.reshape(*tokens.shape, table.shape[-1])

  return jax.shard_map(body, mesh=jax.typeof(tokens).sharding.mesh, in_specs=(_rows_spec(split), spec),
                       out_specs=P(*spec, None))(table, tokens)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _split_lookup(vocab_size, grads, split, table, tokens):
  del vocab_size, grads
  return _split_rows(split, table, tokens)


def _split_lookup_fwd(vocab_size, grads, split, table, tokens):
  return _split_rows(split, table, tokens), tokens  # (the ids are gathered again in the backward: int32, tiny)


def _split_lookup_bwd(vocab_size, grads, split, tokens, rows_t):
  spec = _token_spec(tokens)

  def gather(rows_t, tokens):  # every device's rows' gradients and ids; each keeps those of its rows
    ids = lax.all_gather(tokens.reshape(-1), split, tiled=True)
    rows_t = lax.all_gather(rows_t.reshape(-1, rows_t.shape[-1]), split, tiled=True)
    shard = vocab_size // lax.axis_size(split)
    local = ids - lax.axis_index(split) * shard
    local = jnp.where((local >= 0) & (local < shard), local, shard)  # another device's id: past the end, dropped
    return _scatter_rows(shard, rows_t, local)

  def reduce(rows_t, tokens):  # each device's [V, H] table of its own rows, reduce-scattered over V
    return lax.psum_scatter(_scatter_rows(vocab_size, rows_t, tokens), split, scatter_dimension=0, tiled=True)

  rows_t = jax.sharding.reshard(rows_t, P(*spec, None))
  table_t = jax.shard_map(gather if grads == "gather" else reduce, mesh=jax.typeof(tokens).sharding.mesh,
                          in_specs=(P(*spec, None), spec), out_specs=_rows_spec(split))(rows_t, tokens)
  return table_t, None


_split_lookup.defvjp(_split_lookup_fwd, _split_lookup_bwd)


def _call(mdl, x):
  return mdl(x)


def _call_fwd(mdl, x):
  return nn.vjp(_call, mdl, x)  # (vjp_fn: a pytree of the residuals, the block's input and parameters if remat'd)


def _call_bwd(vjp_fn, y_t):
  vjp_fn, y_t = lax.optimization_barrier((vjp_fn, y_t))  # no recompute before the output's gradient has arrived
  params_t, x_t = vjp_fn(y_t)
  return lax.optimization_barrier((params_t, x_t))  # the parameters' gradients complete before the input's leaves


# ``_in_order(block, x)`` is ``block(x)`` with its backward held in order: it starts (recomputing the block, if
# remat'd) when the gradient of the block's output arrives, and its parameter gradients are complete before its
# input's gradient flows on to the block below. Without this, XLA's GPU scheduler put off the weight-gradient
# products of every layer to the end of the backward on a data-parallel mesh, where those gradients are all-reduced:
# at 64 sequences per device the trainer's gpu preset then kept every layer's recomputed activations alive, 28.8 GiB
# of temporaries per device against 12.5 GiB on one GPU (benchmarks/results/trainer-scaling-2026-11-27/). Each
# layer's all-reduce can also start as soon as that layer is done.
_in_order = nn.custom_vjp(_call, forward_fn=_call_fwd, backward_fn=_call_bwd)


def _hold_open(x):
  return x, jnp.zeros((), jnp.float32)


def _hold_open_fwd(x):
  return _hold_open(x), None


def _hold_open_bwd(_, cts):
  x_t, token_t = cts
  # x's gradient moves on only once the token's has arrived: an exact zero computed from it (any token, inf and NaN
  # included) added to x's gradient, a data dependency that XLA keeps up to its scheduler (an optimization barrier
  # does not: the GPU compiler removes barriers before it schedules)
  return (x_t + (jnp.nan_to_num(token_t) * 0.0).astype(x_t.dtype),)


# ``x, token = _hold_open(x)`` is ``x`` and a scalar token. The head takes the token in (:func:`_held_head`), and its
# backward hands the token a value of its parameter gradients: so the gradient of ``x`` moves down past this point
# only once the head's parameter gradients are complete (on a data-parallel mesh, reduced over the data axes). Left to
# itself, XLA's GPU scheduler starts the head's gradient all-reduce (at the trainer's gpu preset 256 MiB) after the
# step's last kernel; with this point one or two blocks below the top it runs during those blocks' backward. With the
# head's gradient all-reduced (replicated head) that step was the slower one on four H100s; with it reduce-scattered
# (``split_head``) and two collectives in flight, the faster one on two and four H200s (docs/multi_gpu.md), which is
# why the trainer's GPU presets hold it at the top block.
_hold_open = jax.custom_vjp(_hold_open)
_hold_open.defvjp(_hold_open_fwd, _hold_open_bwd)


def _call_head(mdl, x, token, labels):
  del token
  return mdl(x) if labels is None else mdl(x, labels)


def _call_head_fwd(mdl, x, token, labels):
  return nn.vjp(lambda m, x: _call_head(m, x, token, labels), mdl, x)


def _call_head_bwd(vjp_fn, y_t):
  params_t, x_t = vjp_fn(y_t)
  # one element of each parameter gradient: a value that exists only once that gradient is complete
  token_t = sum(leaf[(slice(0, 1),) * leaf.ndim].sum().astype(jnp.float32) for leaf in jax.tree.leaves(params_t))
  return params_t, x_t, token_t, None  # (no gradient for the labels)


# ``_held_head(head, x, token, labels)`` is ``head(x, labels)`` (``head(x)`` for labels None) whose backward also
# gives ``token`` (from :func:`_hold_open`) a value of the head's parameter gradients.
_held_head = nn.custom_vjp(_call_head, forward_fn=_call_head_fwd, backward_fn=_call_head_bwd)


class TransformerLM(nn.Module):
  """Decoder-only LM. ``__call__(tokens, labels)`` is the mean next-token loss; ``logits(tokens)`` the logits."""

  cfg: ModelConfig
  head: str = "fused"
  impl: str = "auto"

  def setup(self):
    cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
    embed_init = nn.with_logical_partitioning(EMBED_INIT, (EMBED_ROWS, None)) if cfg.split_embed else EMBED_INIT
    self.embed = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=embed_init, name="embed")
    self.pos = self.param("pos", nn.initializers.normal(0.01), (cfg.seq_len, cfg.d_model), jnp.float32)
    if cfg.embed_grads not in EMBED_GRADS:
      raise ValueError(f"embed_grads={cfg.embed_grads!r} is not one of {EMBED_GRADS}")
    if not 0 <= cfg.head_grads_within <= cfg.num_layers:
      raise ValueError(f"head_grads_within={cfg.head_grads_within} must be in [0, num_layers={cfg.num_layers}]")
    block = nn.remat(Block) if cfg.remat else Block  # remat: keep only block inputs, so the head dominates memory
    self.blocks = [block(cfg, name=f"block{i}") for i in range(cfg.num_layers)]
    self.ln_f = nn.LayerNorm(dtype=dtype, name="ln_f")
    kernel_init = nn.with_logical_partitioning(HEAD_INIT, cfg.head_axes)
    if self.head == "fused":
      # the swap: LMHead holds nn.Dense's kernel and returns the loss; impl="auto" picks the implementation
      self.lm_head = LMHead(cfg.vocab_size, use_bias=False, dtype=dtype, kernel_init=HEAD_INIT,
                            kernel_axes=cfg.head_axes, options=LossOptions(impl=self.impl), name="head")
    elif self.head == "plain":
      self.lm_head = nn.Dense(cfg.vocab_size, use_bias=False, dtype=dtype, kernel_init=kernel_init,
                              dot_general=fsdp_dot_general, name="head")
    else:
      raise ValueError(f"head={self.head!r} is not one of {HEADS}")

  def hidden(self, tokens: jax.Array) -> jax.Array:
    return self._trunk(tokens)[0]

  def _trunk(self, tokens: jax.Array):
    """The last hidden states and the token of :func:`_hold_open` (None where ``head_grads_within`` is 0)."""
    t = tokens.shape[-1]
    if t > self.cfg.seq_len:
      raise ValueError(f"tokens.shape={tokens.shape}: at most seq_len={self.cfg.seq_len} positions")
    # The rows are looked up in the compute dtype, as nn.Embed(dtype=...) does. The table's gradient is the rows'
    # gradients scatter-added in float32 (:func:`lookup`), then reduced over the data axes or formed from the
    # gathered rows (embed_grads) in the compute dtype (bf16: half the bytes; the float32 table itself is what the
    # optimizer updates).
    dtype = jnp.dtype(self.cfg.dtype)
    table = self.embed.embedding.astype(dtype)
    rows = (split_lookup if self.cfg.split_embed else lookup)(self.cfg.vocab_size, self.cfg.embed_grads, table, tokens)
    x = (rows + self.pos[:t]).astype(dtype)
    token, hold_at = None, self.cfg.num_layers - self.cfg.head_grads_within
    for i, blk in enumerate(self.blocks):
      if self.cfg.head_grads_within and i == hold_at:
        x, token = _hold_open(x)
      x = _in_order(blk, x) if self.cfg.layer_grads_in_order else blk(x)
    return self.ln_f(x), token

  def _head(self, x, token, labels=None):
    return (_call_head if token is None else _held_head)(self.lm_head, x, token, labels)

  def __call__(self, tokens: jax.Array, labels: jax.Array) -> jax.Array:
    x, token = self._trunk(tokens)
    if self.head == "fused":
      return self._head(x, token, labels)
    # The plain head: [B, T, V] logits (kept for the backward), upcast to float32 for the softmax.
    logits = self._head(x, token).astype(jnp.float32)
    spec = getattr(jax.typeof(logits).sharding, "spec", None)
    if spec is not None and len(spec) == logits.ndim and spec[-1] is not None:
      # V split over "tensor" (Explicit mesh): gather the vocabulary for optax's label lookup, as a plain
      # tensor-parallel head does before its softmax
      logits = jax.sharding.reshard(logits, P(*spec[:-1], None))
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  def logits(self, tokens: jax.Array) -> jax.Array:
    x = self.hidden(tokens)
    if self.head == "fused":
      return self.lm_head.logits(x).astype(jnp.float32)
    return self.lm_head(x).astype(jnp.float32)
