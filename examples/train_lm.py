"""Train a small decoder-only transformer on real text with the fused head (``--loss fused``) or the plain one.

    python examples/train_lm.py                       # CPU preset: fused head, ~100 s on 2 cores
    python examples/train_lm.py --loss xla            # the same model with nn.Dense + optax cross-entropy
    python examples/train_lm.py --compare             # both, one after the other; memory/throughput table + plot
    python examples/train_lm.py --preset gpu --find-max-batch   # the largest batch each head fits on this GPU
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/train_lm.py --mesh data=2,fsdp=2,tensor=2
    # two processes (run both; docs/trainer.md):  ... --coordinator localhost:12355 --num-processes 2 --process-id I

Text: the docstrings, comments and ``pydoc_data`` help topics of the Python standard library installed with the
interpreter running this script (PSF License; no download). A byte-level BPE tokenizer (HF ``tokenizers``) is
trained on it once and cached with the token ids under ``--cache-dir``.

Any mesh of the axes ("data", "fsdp", "tensor") (``--mesh``), with ``AxisType.Explicit`` axes under plain ``jit``:
the fused head is ``lce_flax.linen.LMHead``, which runs per shard from the shardings in its inputs' types.

``--loss fused`` and ``--loss xla`` build the same parameter tree (the head's ``kernel`` is ``[H, V]`` under
``params/head`` either way, initialised from the same key), so the two runs start from identical parameters and
a checkpoint of one loads into the other. The only difference is how the loss is formed from the last hidden
state: ``lce_flax`` never materialises the ``[tokens, V]`` logits; ``xla`` does (and keeps them for the backward).

Batches are a pure function of ``(--seed, step)``, so a run resumed from a checkpoint (``--resume``) continues with
exactly the loss curve of an uninterrupted run.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import sysconfig
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a script from a checkout: make ``lce_flax`` importable without installing
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import (  # noqa: E402
  AxisType,  # noqa: E402
  Mesh,
  NamedSharding,
)
from jax.sharding import PartitionSpec as P  # noqa: E402

import lce_flax  # noqa: E402
from lce_flax import LossOptions  # noqa: E402
from lce_flax.linen import LMHead  # noqa: E402
from lce_flax.sharding import MESH_AXES  # noqa: E402
from lce_flax.train import TrainState, batch_sharding, make_train_step, process_rows, state_shardings  # noqa: E402

LOSSES = ("fused", "xla")
EOT = "<|endoftext|>"
CORPUS_VERSION = "stdlib-text-v1"  # bump when the corpus extraction changes, so caches are rebuilt

# Everything a flag can leave unset comes from the preset. The CPU preset is sized to train in well under three
# minutes on two cores (tokenizer included); the GPU preset makes the head dominate memory: 128k vocabulary,
# remat'd blocks, so the [tokens, V] logits of the plain head are most of what a step keeps alive.
PRESETS: dict[str, dict[str, Any]] = {
    "cpu": dict(vocab_size=32768, d_model=128, num_layers=2, num_heads=4, d_ff=512, seq_len=128, batch_size=8,
                steps=250, lr=3e-3, warmup=20, eval_every=50, eval_batches=4, save_every=50, dtype="float32",
                remat=False, mem_budget_gib=2.0, max_batch_limit=1024, bench_steps=2, sample_tokens=24,
                chunk_size=None),
    "gpu": dict(vocab_size=131072, d_model=1024, num_layers=8, num_heads=16, d_ff=4096, seq_len=1024, batch_size=16,
                steps=300, lr=1e-3, warmup=30, eval_every=100, eval_batches=8, save_every=100, dtype="bfloat16",
                remat=True, mem_budget_gib=None, max_batch_limit=4096, bench_steps=5, sample_tokens=48,
                # 4096-token chunks for the chunked head: at V=128k its default (H/2 = 512 tokens) runs 11% slower
                # (132k vs 148k tokens/s at batch 64 on an H100; examples/results/)
                chunk_size=4096),
}


# --------------------------------------------------------------------------------------------------------- data


def _stdlib_files(root: str) -> list[str]:
  """Every ``*.py`` under the standard library (not site-packages), in a sorted, machine-independent order."""
  files = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")
                         and not d.startswith("."))
    files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
  return sorted(files, key=lambda p: os.path.relpath(p, root))


def _file_text(src: str) -> str:
  """The English of one source file: its docstrings and its blocks of whole-line comments."""
  parts = []
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # old escapes in some stdlib files warn on parse
    try:
      tree = ast.parse(src)
    except (SyntaxError, ValueError):
      tree = None
  if tree is not None:
    for node in ast.walk(tree):
      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        doc = ast.get_docstring(node)
        if doc and len(doc) >= 40:
          parts.append(doc)
  block: list[str] = []
  for line in src.splitlines() + [""]:
    s = line.strip()
    if s.startswith("#") and not s.startswith("#!"):
      block.append(s.lstrip("#").strip())
    elif block:
      text = " ".join(b for b in block if b)
      if len(text) >= 40:
        parts.append(text)
      block = []
  return "\n\n".join(parts)


def corpus_documents() -> list[str]:
  """The documents of the corpus, in a deterministic order: one per stdlib source file, then the help topics."""
  root = sysconfig.get_paths()["stdlib"]
  docs = []
  for path in _stdlib_files(root):
    try:
      with open(path, encoding="utf-8") as f:
        text = _file_text(f.read())
    except (OSError, UnicodeDecodeError):
      continue
    if text:
      docs.append(text)
  try:
    from pydoc_data import topics  # the reference manual's text that ``help()`` shows
    docs += [topics.topics[k] for k in sorted(topics.topics)]
  except ImportError:
    pass
  return docs


def split_documents(docs: list[str], every: int = 20) -> tuple[list[str], list[str]]:
  """Held-out text is every ``every``-th whole document (a whole module's text), so eval text is unseen text."""
  train = [d for i, d in enumerate(docs) if i % every != every // 2]
  held_out = [d for i, d in enumerate(docs) if i % every == every // 2]
  return train, held_out


@dataclasses.dataclass
class Data:
  tokenizer: Any  # tokenizers.Tokenizer
  train_ids: np.ndarray  # uint32 [N]
  eval_ids: np.ndarray  # uint32 [M]
  tokenizer_vocab: int  # ids the tokenizer can emit; the model's vocabulary may be padded beyond it
  source: str


def _cache_key() -> str:
  root = sysconfig.get_paths()["stdlib"]
  return hashlib.sha256(f"{CORPUS_VERSION}|{sys.version}|{root}".encode()).hexdigest()[:12]


def _atomic_write(path: str, write: Callable[[str], None]) -> None:
  tmp = f"{path}.tmp{os.getpid()}"
  write(tmp)
  os.replace(tmp, path)


def load_data(cache_dir: str, vocab_size: int, log: Callable[[str], None] = print) -> Data:
  """Tokenizer and token ids of the corpus, from ``cache_dir`` or built (and cached) now."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  cache_dir = os.path.expanduser(cache_dir)
  os.makedirs(cache_dir, exist_ok=True)
  stem = os.path.join(cache_dir, f"{_cache_key()}-bpe{vocab_size}")
  source = f"Python {sys.version.split()[0]} standard library docstrings/comments/help topics (PSF License)"
  if os.path.exists(stem + ".json") and os.path.exists(stem + ".npz"):
    tok = Tokenizer.from_file(stem + ".json")
    with np.load(stem + ".npz") as z:
      return Data(tok, z["train"], z["eval"], tok.get_vocab_size(), source)

  t0 = time.perf_counter()
  corpus_path = os.path.join(cache_dir, f"{_cache_key()}-corpus.json")  # shared by every vocabulary size
  if os.path.exists(corpus_path):
    with open(corpus_path) as f:
      docs = json.load(f)
  else:
    docs = corpus_documents()
    _atomic_write(corpus_path, lambda p: open(p, "w").write(json.dumps(docs)))
  train_docs, eval_docs = split_documents(docs)
  log(f"corpus: {len(train_docs)} train / {len(eval_docs)} held-out documents, "
      f"{sum(map(len, train_docs)) / 1e6:.1f} / {sum(map(len, eval_docs)) / 1e6:.2f} MB "
      f"({time.perf_counter() - t0:.1f} s)")
  t0 = time.perf_counter()
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(train_docs, trainer)  # tokenizer sees training text only

  eot = tok.token_to_id(EOT)

  def encode(docs: list[str]) -> np.ndarray:
    ids = []
    for enc in tok.encode_batch(docs):
      ids += enc.ids
      ids.append(eot)
    return np.asarray(ids, np.uint32)

  train_ids, eval_ids = encode(train_docs), encode(eval_docs)
  log(f"tokenizer: byte-level BPE, {tok.get_vocab_size()} tokens (asked {vocab_size}); "
      f"{len(train_ids):,} train / {len(eval_ids):,} held-out tokens ({time.perf_counter() - t0:.1f} s)")
  _atomic_write(stem + ".json", lambda p: tok.save(p))
  _atomic_write(stem + ".npz", lambda p: np.savez(open(p, "wb"), train=train_ids, eval=eval_ids))
  return Data(tok, train_ids, eval_ids, tok.get_vocab_size(), source)


def train_batch(ids: np.ndarray, step: int, batch_size: int, seq_len: int, seed: int,
                rows: slice = slice(None)) -> dict[str, np.ndarray]:
  """The batch of ``step``: random windows drawn from a generator keyed by (seed, step) alone, so a resumed run
  sees exactly the batches an uninterrupted one would. ``rows``: only these rows of it (a process's share)."""
  rng = np.random.default_rng([seed, step])
  starts = rng.integers(0, len(ids) - seq_len - 1, size=batch_size)[rows]
  win = np.stack([ids[s:s + seq_len + 1] for s in starts]).astype(np.int32)
  return {"inputs": win[:, :-1], "labels": win[:, 1:]}


def eval_batches(ids: np.ndarray, num: int, batch_size: int, seq_len: int) -> list[dict[str, np.ndarray]]:
  """Fixed, non-overlapping windows spread evenly over the held-out text."""
  n = num * batch_size
  stride = max((len(ids) - seq_len - 1) // n, 1)
  starts = [min(i * stride, len(ids) - seq_len - 1) for i in range(n)]
  win = np.stack([ids[s:s + seq_len + 1] for s in starts]).astype(np.int32)
  rows = lambda i: win[i * batch_size:(i + 1) * batch_size]
  return [{"inputs": rows(i)[:, :-1], "labels": rows(i)[:, 1:]}
          for i in range(num)]


# -------------------------------------------------------------------------------------------------------- model


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


HEAD_INIT = nn.initializers.normal(0.02)


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


HEAD_AXES = ("embed", "vocab")  # logical names of the head's kernel [H, V]: H over "fsdp", V over "tensor"


class DenseHead(nn.Module):
  """The plain head (``--loss xla``): ``nn.Dense(V, use_bias=False)``'s ``kernel`` [H, V] and computation, with the
  kernel's logical axis names. On a mesh whose "fsdp" axis splits the kernel's H, the kernel is gathered over it
  first (what FSDP does before a matmul; an Explicit mesh will not contract over a dim split on one side only)."""

  vocab_size: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    kernel = self.param("kernel", nn.with_logical_partitioning(HEAD_INIT, HEAD_AXES), (x.shape[-1], self.vocab_size),
                        jnp.float32)
    spec = getattr(jax.typeof(kernel).sharding, "spec", None)
    if spec is not None and len(spec) == 2 and spec[0] is not None:
      kernel = jax.sharding.reshard(kernel, P(None, spec[1]))
    return jnp.dot(x.astype(self.dtype), kernel.astype(self.dtype))


def fused_head(vocab_size: int, dtype: Any, impl: str, chunk_size: int | None = None) -> nn.Module:
  """``lce_flax.linen.LMHead``: the parameter of :class:`DenseHead` (same name, shape, init and logical names); on a
  mesh of Explicit axes it runs per shard by itself (tokens over the batch axes, V over "tensor", H over "fsdp")."""
  return LMHead(vocab_size, use_bias=False, dtype=dtype, kernel_init=HEAD_INIT, kernel_axes=HEAD_AXES,
                options=LossOptions(impl=impl, chunk_size=chunk_size), name="head")


def embed_lookup(table: jax.Array, tokens: jax.Array) -> jax.Array:
  """``nn.Embed``'s lookup (``table[tokens]``); on an Explicit mesh the rows come out split like ``tokens`` (a gather
  from a replicated table with split indices needs its output sharding spelled out there)."""
  sharding = jax.typeof(tokens).sharding
  if not getattr(getattr(sharding, "mesh", None), "axis_names", ()):
    return jnp.take(table, tokens, axis=0)
  spec = tuple(sharding.spec) + (None,) * (tokens.ndim - len(sharding.spec))
  return table.at[tokens].get(out_sharding=P(*spec, None))


class TransformerLM(nn.Module):
  """Decoder-only LM. ``__call__(tokens, labels)`` is the mean next-token loss; ``logits(tokens)`` the logits."""

  cfg: ModelConfig
  loss: str = "fused"
  impl: str = "auto"
  chunk_size: int | None = None

  def setup(self):
    cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
    self.embed = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=nn.initializers.normal(0.02), name="embed")
    self.pos = self.param("pos", nn.initializers.normal(0.01), (cfg.seq_len, cfg.d_model), jnp.float32)
    block = nn.remat(Block) if cfg.remat else Block  # remat: keep only block inputs, so the head dominates memory
    self.blocks = [block(cfg, name=f"block{i}") for i in range(cfg.num_layers)]
    self.ln_f = nn.LayerNorm(dtype=dtype, name="ln_f")
    if self.loss == "fused":
      self.head = fused_head(cfg.vocab_size, dtype, self.impl, self.chunk_size)
    elif self.loss == "xla":
      self.head = DenseHead(cfg.vocab_size, dtype=dtype, name="head")
    else:
      raise ValueError(f"loss={self.loss!r} is not one of {LOSSES}")

  def hidden(self, tokens: jax.Array) -> jax.Array:
    t = tokens.shape[-1]
    if t > self.cfg.seq_len:
      raise ValueError(f"tokens.shape={tokens.shape}: at most seq_len={self.cfg.seq_len} positions")
    x = (embed_lookup(self.embed.embedding, tokens) + self.pos[:t]).astype(jnp.dtype(self.cfg.dtype))
    for blk in self.blocks:
      x = blk(x)
    return self.ln_f(x)

  def __call__(self, tokens: jax.Array, labels: jax.Array) -> jax.Array:
    x = self.hidden(tokens)
    if self.loss == "fused":
      return self.head(x, labels)
    # The plain head: [B, T, V] logits (kept for the backward), upcast to float32 for the softmax.
    logits = self.head(x).astype(jnp.float32)
    spec = getattr(jax.typeof(logits).sharding, "spec", None)
    if spec is not None and len(spec) == logits.ndim and spec[-1] is not None:
      # V split over "tensor" (Explicit mesh): gather the vocabulary for optax's label lookup, as a plain
      # tensor-parallel head does before its softmax
      logits = jax.sharding.reshard(logits, P(*spec[:-1], None))
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  def logits(self, tokens: jax.Array) -> jax.Array:
    x = self.hidden(tokens)
    if self.loss == "fused":
      return self.head.logits(x).astype(jnp.float32)
    return self.head(x).astype(jnp.float32)  # (generation runs on replicated parameters, see make_trainer)


# -------------------------------------------------------------------------------------------------------- train


@dataclasses.dataclass
class Trainer:
  """The jitted pieces of one (model, batch size) on a mesh of ``AxisType.Explicit`` axes ("data", "fsdp",
  "tensor"), over the devices of every process. Use them inside ``jax.set_mesh(trainer.mesh)``."""

  model: TransformerLM
  tx: optax.GradientTransformation
  mesh: Mesh
  batch_size: int
  init: Callable  # init(seed) -> TrainState, placed by the parameters' logical names
  step: Callable
  eval_loss: Callable
  next_logits: Callable
  shardings: Any  # of the TrainState

  @property
  def batch_sharding(self) -> NamedSharding:
    return batch_sharding(self.mesh)

  @property
  def rows(self) -> slice:
    """The rows of each global batch that this process loads (all of them with one process)."""
    return process_rows(self.mesh, self.batch_size)

  def put_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """This process's rows (``rows`` of the global batch) → global arrays split over the batch axes."""
    return {k: jax.make_array_from_process_local_data(self.batch_sharding, v) for k, v in batch.items()}

  def abstract_batch(self, seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
    s = jax.ShapeDtypeStruct((self.batch_size, seq_len), jnp.int32, sharding=self.batch_sharding)
    return {"inputs": s, "labels": s}

  def abstract_state(self, seed: int) -> Any:
    return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                        jax.eval_shape(functools.partial(self._init_fn, seed)), self.shardings)

  _init_fn: Callable = None


def parse_mesh(spec: str | None) -> dict[str, int]:
  """``"data=2,fsdp=2,tensor=2"`` → sizes of the mesh axes (missing axes: 1; one size may be -1: the rest)."""
  sizes = {a: 1 for a in MESH_AXES}
  if not spec:
    return {**sizes, "data": 0}  # 0: as many devices as divide the batch
  for part in spec.split(","):
    name, _, val = part.partition("=")
    if name.strip() not in sizes or not val.strip().lstrip("-").isdigit():
      raise ValueError(f"--mesh={spec!r}: expected axis=size pairs over {MESH_AXES}, e.g. data=2,tensor=4")
    sizes[name.strip()] = int(val)
  return sizes


def build_mesh(batch_size: int, mesh: str | None = None, num_devices: int | None = None) -> Mesh:
  """A mesh of ``AxisType.Explicit`` axes ("data", "fsdp", "tensor") over the first ``num_devices`` devices of all
  processes. Without ``mesh``: data parallel over as many devices as divide the batch (all of them when there are
  several processes)."""
  devices = jax.devices()[:num_devices or None]
  sizes = parse_mesh(mesh)
  if sizes["data"] == 0:
    n = max(d for d in range(1, len(devices) + 1) if batch_size % d == 0)
    if jax.process_count() > 1 and n != len(devices):
      raise ValueError(f"--batch-size={batch_size} must be divisible by the {len(devices)} devices of all processes")
    sizes["data"] = n
  if list(sizes.values()).count(-1) > 1:
    raise ValueError(f"--mesh: at most one axis may be -1, got {sizes}")
  known = math.prod(v for v in sizes.values() if v != -1)
  for a, v in sizes.items():
    if v == -1:
      sizes[a] = len(devices) // known
  total = math.prod(sizes.values())
  if total < 1 or total > len(devices) or (jax.process_count() > 1 and total != len(devices)):
    raise ValueError(f"mesh {sizes} needs {total} devices; {len(devices)} available")
  if batch_size % (sizes["data"] * sizes["fsdp"]):
    raise ValueError(f"--batch-size={batch_size} must be divisible by data x fsdp = {sizes['data'] * sizes['fsdp']}")
  return jax.make_mesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES, axis_types=(AxisType.Explicit,) * 3,
                       devices=devices[:total])


def make_optimizer(lr: float, warmup: int, steps: int) -> optax.GradientTransformation:
  sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(warmup, 1), max(steps, warmup + 1), end_value=lr * 0.1)
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, b2=0.95, weight_decay=0.1))


def _unboxed(tree: Any) -> Any:
  """Flax's logical-partitioning boxes replaced by their contents (arrays, or the shardings of ``state_shardings``)."""
  return jax.tree.map(lambda n: n.value if isinstance(n, nn.meta.AxisMetadata) else n, tree,
                      is_leaf=lambda n: isinstance(n, nn.meta.AxisMetadata))


def make_trainer(cfg: ModelConfig, loss: str, impl: str, batch_size: int, tx: optax.GradientTransformation,
                 seq_len: int, num_devices: int | None = None, chunk_size: int | None = None,
                 mesh: str | None = None) -> Trainer:
  mesh_ = build_mesh(batch_size, mesh, num_devices)
  model = TransformerLM(cfg, loss=loss, impl=impl, chunk_size=chunk_size)
  repl = NamedSharding(mesh_, P())

  def boxed_state(seed):
    dummy = jnp.zeros((1, seq_len), jnp.int32)
    params = model.init(jax.random.key(seed), dummy, dummy)["params"]  # boxed with the logical names
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

  # Placement from the logical names (lce_flax.sharding.DEFAULT_RULES: "vocab" -> "tensor", "embed" -> "fsdp");
  # parameters without names (the blocks) are replicated. The state itself is a plain tree (no boxes), so both
  # heads give the same tree and the checkpoints are plain arrays.
  shardings = _unboxed(state_shardings(jax.eval_shape(functools.partial(boxed_state, 0)), mesh_))

  def init_fn(seed):
    return _unboxed(boxed_state(seed))

  def loss_fn(params, batch):
    return model.apply({"params": params}, batch["inputs"], batch["labels"])

  # Plain jit: the state's and the batch's shardings are in their types (Explicit axes), and the fused head runs
  # per shard from them; ``.lower()`` stays available for the compiled memory analysis.
  step = make_train_step(loss_fn, tx, mesh=None, donate=True)

  def next_logits(params, tokens, pos):
    # Causal attention: logits at `pos` do not depend on the (padding) tokens after it, so one compiled length.
    params = jax.tree.map(lambda a: jax.sharding.reshard(a, P()), params)  # one sequence: replicate, no FSDP
    return model.apply({"params": params}, tokens, method=TransformerLM.logits)[:, pos]

  return Trainer(
      model=model, tx=tx, mesh=mesh_, batch_size=batch_size,
      init=lambda seed: jax.jit(functools.partial(init_fn, seed), out_shardings=shardings)(),
      step=step,
      eval_loss=jax.jit(loss_fn, out_shardings=repl),
      next_logits=jax.jit(next_logits, out_shardings=repl),
      shardings=shardings, _init_fn=init_fn,
  )


def compiled_memory(compiled) -> dict[str, int]:
  """Bytes per device from XLA's compiled memory analysis; ``peak`` = arguments + outputs − aliased + temporaries."""
  m = compiled.memory_analysis()
  out = {k: int(getattr(m, f"{k}_size_in_bytes", 0) or 0) for k in ("argument", "output", "alias", "temp")}
  out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
  return out


def gpu_peak_bytes() -> int | None:
  stats = jax.local_devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


def compile_step(trainer: Trainer, state_like, seq_len: int):
  with jax.set_mesh(trainer.mesh):
    return trainer.step.lower(state_like, trainer.abstract_batch(seq_len)).compile()


def _is_oom(e: BaseException) -> bool:
  s = str(e)
  return "RESOURCE_EXHAUSTED" in s or "Out of memory" in s or "out of memory" in s


# ------------------------------------------------------------------------------------------------ checkpointing


def checkpoint_manager(ckpt_dir: str, save_every: int):
  import orbax.checkpoint as ocp

  options = ocp.CheckpointManagerOptions(
      max_to_keep=3, save_interval_steps=save_every, create=True,
      cleanup_tmp_directories=True,  # a save that was killed leaves a tmp dir; only finished steps are listed
      enable_async_checkpointing=True)
  return ocp.CheckpointManager(os.path.abspath(os.path.expanduser(ckpt_dir)), options=options)


def save_checkpoint(mngr, step: int, state, history: dict, force: bool = False) -> bool:
  import orbax.checkpoint as ocp

  return mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                 history=ocp.args.JsonSave(history)), force=force)


def restore_checkpoint(mngr, step: int, state_like) -> tuple[Any, dict]:
  import orbax.checkpoint as ocp

  out = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(state_like),
                                                   history=ocp.args.JsonRestore()))
  return out["state"], out["history"]


# ----------------------------------------------------------------------------------------------------- the runs


def _human(n: float | None, unit: str = "B") -> str:
  if n is None:
    return "-"
  for p in ("", "Ki", "Mi", "Gi", "Ti"):
    if abs(n) < 1024 or p == "Ti":
      return f"{n:.1f} {p}{unit}" if p else f"{n:.0f} {unit}"
    n /= 1024
  return str(n)


def generate(trainer: Trainer, params, data: Data, prompt: str, num_tokens: int, seq_len: int,
             repetition_penalty: float = 1.0) -> str:
  """Greedy decoding through the head's logits (ids the tokenizer cannot emit are masked out). A
  ``repetition_penalty`` > 1 divides the positive logits (multiplies the negative ones) of tokens already in the
  text by it, as in CTRL, which keeps a small, briefly trained model from repeating one word; 1 is plain greedy."""
  ids = data.tokenizer.encode(prompt).ids[-(seq_len - 1):] or [data.tokenizer.token_to_id(EOT)]
  buf = np.zeros((1, seq_len), np.int32)
  buf[0, :len(ids)] = ids
  n = len(ids)
  out = []
  for _ in range(min(num_tokens, seq_len - n)):
    logits = np.array(trainer.next_logits(params, jnp.asarray(buf), n - 1)[0], np.float32)
    logits[data.tokenizer_vocab:] = -np.inf
    if repetition_penalty != 1.0:
      seen = np.unique(buf[0, :n])
      logits[seen] = np.where(logits[seen] > 0, logits[seen] / repetition_penalty, logits[seen] * repetition_penalty)
    nxt = int(np.argmax(logits))
    out.append(nxt)
    buf[0, n] = nxt
    n += 1
  return prompt + data.tokenizer.decode(out)


def train(args: argparse.Namespace, data: Data, loss: str, log: Callable[[str], None]) -> dict[str, Any]:
  """Trains one model with the ``loss`` head; returns the run's record (losses, eval, memory, tokens/s, sample)."""
  cfg = model_config(args)
  tx = make_optimizer(args.lr, args.warmup, args.steps)
  tr = make_trainer(cfg, loss, args.impl, args.batch_size, tx, args.seq_len, args.num_devices,
                    args.chunk_size, args.mesh)
  with jax.set_mesh(tr.mesh):
    return _train(args, data, loss, log, cfg, tr)


def _train(args, data, loss, log, cfg, tr) -> dict[str, Any]:
  tokens_per_step = args.batch_size * args.seq_len

  mngr = checkpoint_manager(args.ckpt_dir, args.save_every) if args.ckpt_dir else None
  history: dict[str, list] = {"loss": [], "eval": []}
  start = 0
  state_like = tr.abstract_state(args.seed)
  if mngr is not None and args.resume and mngr.latest_step() is not None:
    start = int(mngr.latest_step())
    state, history = restore_checkpoint(mngr, start, state_like)
    history = {"loss": list(history["loss"])[:start], "eval": [e for e in history["eval"] if e["step"] <= start]}
    log(f"resumed from {args.ckpt_dir} at step {start}")
  else:
    if args.resume:
      log(f"--resume: no finished checkpoint in {args.ckpt_dir}; starting at step 0")
    state = tr.init(args.seed)

  compiled = compile_step(tr, state_like, args.seq_len)
  mem = compiled_memory(compiled)
  n_params = sum(x.size for x in jax.tree.leaves(state.params))
  log(f"{loss}: {n_params / 1e6:.2f}M params (head {cfg.d_model}x{cfg.vocab_size}), batch {args.batch_size}x"
      f"{args.seq_len} on {tr.mesh.devices.size} {jax.default_backend()} device(s) (mesh {dict(tr.mesh.shape)}, "
      f"{jax.process_count()} process(es)); compiled step peak "
      f"{_human(mem['peak'])}/device (temp {_human(mem['temp'])})")

  evals = eval_batches(data.eval_ids, args.eval_batches, args.batch_size, args.seq_len)

  def evaluate(params, step):
    losses = [float(tr.eval_loss(params, tr.put_batch({k: v[tr.rows] for k, v in b.items()}))) for b in evals]
    el = float(np.mean(losses))
    rec = {"step": step, "loss": el, "ppl": float(math.exp(min(el, 50.0)))}
    history["eval"].append(rec)
    return rec

  times: list[float] = []
  stop = min(args.steps, start + args.stop_after) if args.stop_after else args.steps
  bar = _progress(range(start, stop), args, desc=loss)
  peak = None
  for step in bar:
    batch = tr.put_batch(train_batch(data.train_ids, step, args.batch_size, args.seq_len, args.seed, tr.rows))
    t0 = time.perf_counter()
    state, metrics = compiled(state, batch)
    loss_val = float(metrics["loss"])  # blocks: the step's wall time and loss are exact
    dt = time.perf_counter() - t0
    times.append(dt)
    history["loss"].append(loss_val)
    if jax.default_backend() == "gpu":
      peak = gpu_peak_bytes()
    done = step + 1
    if args.eval_every and done % args.eval_every == 0 and done < args.steps:
      e = evaluate(state.params, done)
      log(f"step {done}: train loss {loss_val:.3f}, eval loss {e['loss']:.3f} (ppl {e['ppl']:.1f})")
    if mngr is not None:
      save_checkpoint(mngr, done, state, history, force=done == args.steps)
    if hasattr(bar, "set_postfix"):
      bar.set_postfix(loss=f"{loss_val:.3f}", tok_s=f"{tokens_per_step / dt:,.0f}",
                      mem=_human(peak if peak is not None else mem["peak"]), refresh=False)
  if mngr is not None:
    mngr.wait_until_finished()
    mngr.close()

  finished = (start if not times else stop) == args.steps
  final_eval = evaluate(state.params, stop) if finished or not history["eval"] else history["eval"][-1]
  steady = times[1:] if len(times) > 1 else times  # the first step of a process pays for the transfer of state
  tok_s = tokens_per_step / statistics.median(steady) if steady else None
  record = {
      "loss": loss, "impl": args.impl if loss == "fused" else "xla", "params": int(n_params),
      "start_step": start, "end_step": stop, "losses": history["loss"], "eval": history["eval"],
      "final_eval": final_eval, "tokens_per_s": tok_s, "step_time_s": statistics.median(steady) if steady else None,
      "memory": {"compiled": mem, "gpu_peak_bytes_in_use": peak},
  }
  if times:
    log(f"{loss}: train loss {history['loss'][start]:.3f} at step {start + 1} -> {history['loss'][-1]:.3f} at step "
        f"{stop}; held-out loss {final_eval['loss']:.3f} (ppl {final_eval['ppl']:.1f}); "
        f"{tok_s:,.0f} tokens/s; step peak {_human(peak if peak is not None else mem['peak'])}")
  if finished and args.sample_tokens:
    record["sample"] = generate(tr, state.params, data, args.prompt, args.sample_tokens, args.seq_len,
                                args.repetition_penalty)
  return record


def _progress(it, args, desc: str):
  if args.quiet:
    return it
  try:
    from tqdm import tqdm
  except ImportError:
    return it
  return tqdm(it, desc=desc, dynamic_ncols=True, leave=True, initial=it.start, total=args.steps)


def head_memory(args: argparse.Namespace, batch_size: int, known: dict[str, dict[str, int]] | None = None
                ) -> dict[str, dict[str, int]]:
  """Compiled memory of one training step of each head at ``batch_size`` (compile only; nothing runs); heads in
  ``known`` are taken from there."""
  cfg = model_config(args)
  tx = make_optimizer(args.lr, args.warmup, args.steps)
  out = dict(known or {})
  for loss in LOSSES:
    if loss in out:
      continue
    tr = make_trainer(cfg, loss, args.impl, batch_size, tx, args.seq_len, args.num_devices, args.chunk_size,
                      args.mesh)
    out[loss] = compiled_memory(compile_step(tr, tr.abstract_state(args.seed), args.seq_len))
  return out


def probe(args: argparse.Namespace, data: Data, loss: str, batch_size: int, budget: int | None) -> dict[str, Any]:
  """Does a step of ``loss`` at ``batch_size`` fit? GPU: run it and catch RESOURCE_EXHAUSTED. CPU: its compiled
  peak (arguments + outputs + temporaries) must be within ``budget`` bytes, then a few steps are timed."""
  cfg = model_config(args)
  tr = make_trainer(cfg, loss, args.impl, batch_size, make_optimizer(args.lr, args.warmup, args.steps), args.seq_len,
                    args.num_devices, args.chunk_size, args.mesh)
  with jax.set_mesh(tr.mesh):
    return _probe(args, data, tr, batch_size, budget)


def _probe(args, data, tr, batch_size, budget) -> dict[str, Any]:
  rec: dict[str, Any] = {"batch_size": batch_size, "fits": False}
  state = None
  try:
    compiled = compile_step(tr, tr.abstract_state(args.seed), args.seq_len)
    rec["memory"] = compiled_memory(compiled)
    if budget is not None and rec["memory"]["peak"] > budget:
      return rec
    if budget is not None and args.bench_steps == 0:  # CPU, no timing asked: the analysis is the answer
      rec["fits"] = True
      return rec
    state = tr.init(args.seed)
    times = []
    for i in range(max(args.bench_steps, 1) + 1):
      batch = tr.put_batch(train_batch(data.train_ids, i, batch_size, args.seq_len, args.seed, tr.rows))
      t0 = time.perf_counter()
      state, m = compiled(state, batch)
      float(m["loss"])
      times.append(time.perf_counter() - t0)
    rec["fits"] = True
    rec["tokens_per_s"] = batch_size * args.seq_len / statistics.median(times[1:] or times)
    if jax.default_backend() == "gpu":
      rec["gpu_peak_bytes_in_use"] = gpu_peak_bytes()
  except Exception as e:  # noqa: BLE001 - only out-of-memory is an answer; anything else is a bug
    if not _is_oom(e):
      raise
    rec["error"] = str(e).splitlines()[0][:200]
  finally:
    del state
    jax.clear_caches()
  return rec


def search_max_batch(fits: Callable[[int], bool], start: int, unit: int, limit: int, tol: float
                     ) -> tuple[int, int | None]:
  """Largest multiple of ``unit`` in [unit, ``limit``] for which ``fits`` (monotone) holds: halve from ``start``
  until it fits, double until it does not, then bisect. Returns (largest fitting batch or 0, smallest failing
  batch seen or None if ``limit`` was reached); bisection stops once their gap is at most
  ``max(unit, tol * lo)``, since each probe is a compile (and on a GPU a run)."""
  lo, hi = 0, None
  b = max(start // unit * unit, unit)
  while b >= unit and not fits(b):  # the configured batch does not fit: halve down
    hi, b = b, b // 2 // unit * unit
  if b >= unit:
    while b <= limit:  # double up
      if not fits(b):
        hi = b
        break
      lo, b = b, b * 2
  if hi is not None and lo:
    while hi - lo > max(unit, int(tol * lo) // unit * unit):  # invariant: lo fits, hi does not
      mid = (lo + hi) // 2 // unit * unit
      if fits(mid):
        lo = mid
      else:
        hi = mid
  return lo, hi


def find_max_batch(args: argparse.Namespace, data: Data, loss: str, log: Callable[[str], None]) -> dict[str, Any]:
  """Largest batch (a multiple of the data-parallel width) whose step fits: doubling, then bisection."""
  gpu = jax.default_backend() == "gpu"
  budget = None if gpu else int(args.mem_budget_gib * 2**30)
  sizes, n = parse_mesh(args.mesh), len(jax.devices()[:args.num_devices or None])
  rest = n // (sizes["fsdp"] * sizes["tensor"])
  data_size = n if sizes["data"] == 0 else sizes["data"] if sizes["data"] > 0 else rest
  unit = data_size * sizes["fsdp"]  # the batch is split over data x fsdp
  probes: dict[int, dict] = {}

  def fits(b: int) -> bool:
    if b not in probes:
      probes[b] = probe(args, data, loss, b, budget)
      r = probes[b]
      log(f"  {loss} batch {b:5d}: {'fits' if r['fits'] else 'does not fit'}"
          + (f", compiled peak {_human(r['memory']['peak'])}" if "memory" in r else "")
          + (f", {r['tokens_per_s']:,.0f} tok/s" if r.get("tokens_per_s") else ""))
    return probes[b]["fits"]

  lo, hi = search_max_batch(fits, args.batch_size, unit, args.max_batch_limit, args.max_batch_tol)
  limit = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit") if gpu else None
  return {"max_batch": lo, "limit_reached": hi is None, "budget_bytes": budget, "unit": unit,
          "device_bytes_limit": limit,
          "probes": [probes[k] for k in sorted(probes)]}


# ------------------------------------------------------------------------------------------------------ reports


def print_table(result: dict[str, Any], log: Callable[[str], None]) -> None:
  runs, mem, mb = result.get("runs", {}), result.get("memory_compiled", {}), result.get("max_batch", {})
  log("")
  log(f"{'head':6} {'step peak (compiled)':>21} {'GPU peak in use':>16} {'tokens/s':>10} {'eval loss':>10} "
      f"{'ppl':>8} {'max batch':>10}")
  for loss in LOSSES:
    if loss not in runs and loss not in mem and loss not in mb:
      continue
    r = runs.get(loss, {})
    m = (r.get("memory", {}).get("compiled") or mem.get(loss) or {}).get("peak")
    e = r.get("final_eval") or {}
    t = r.get("tokens_per_s")
    mx = mb.get(loss, {}).get("max_batch")
    log(f"{loss:6} {_human(m):>21} {_human(r.get('memory', {}).get('gpu_peak_bytes_in_use')):>16} "
        f"{(f'{t:,.0f}' if t else '-'):>10} {(f'{e['loss']:.3f}' if e else '-'):>10} "
        f"{(f'{e['ppl']:.1f}' if e else '-'):>8} {(str(mx) if mx is not None else '-'):>10}")
  if "fused" in mem and "xla" in mem:
    f, x = mem["fused"]["peak"], mem["xla"]["peak"]
    log(f"compiled step peak at batch {result['config']['batch_size']}: fused {_human(f)} vs xla {_human(x)} "
        f"({x / max(f, 1):.2f}x)")
  if "fused" in mb and "xla" in mb and mb["xla"]["max_batch"]:
    log(f"largest batch: fused {mb['fused']['max_batch']} vs xla {mb['xla']['max_batch']} "
        f"({mb['fused']['max_batch'] / mb['xla']['max_batch']:.2f}x)")


def plot(result: dict[str, Any], path: str) -> None:
  """Loss curves, memory and throughput of the heads in ``result`` (fused vs xla), one PNG."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  runs, mem, mb = result.get("runs", {}), result.get("memory_compiled", {}), result.get("max_batch", {})
  colors = {"fused": "tab:blue", "xla": "tab:orange"}
  fig, axes = plt.subplots(1, 3 if runs else 2, figsize=(16 if runs else 11, 4.5))
  ax = axes[0] if runs else None
  for loss, r in runs.items():
    ax.plot(range(1, len(r["losses"]) + 1), r["losses"], color=colors[loss], lw=2.5 if loss == "fused" else 1,
            ls="-" if loss == "fused" else "--", label=f"{loss} train")  # the curves coincide: keep both visible
    ev = r.get("eval") or []
    if ev:
      ax.plot([e["step"] for e in ev], [e["loss"] for e in ev], "o--", color=colors[loss], label=f"{loss} held-out")
  if runs:
    ax.set(xlabel="step", ylabel="loss", title="loss")
    ax.legend()
  ax_m, ax_t = axes[-2], axes[-1]
  if mb:
    for loss, r in mb.items():
      ok = [p for p in r["probes"] if "memory" in p]
      ax_m.plot([p["batch_size"] for p in ok], [p["memory"]["peak"] / 2**30 for p in ok], "o-", color=colors[loss],
                label=f"{loss} (max batch {r['max_batch']})")
      ts = [p for p in r["probes"] if p.get("tokens_per_s")]
      ax_t.plot([p["batch_size"] for p in ts], [p["tokens_per_s"] for p in ts], "o-", color=colors[loss], label=loss)
      if r["max_batch"]:
        ax_m.axvline(r["max_batch"], color=colors[loss], ls=":")
    budget = next((r.get("budget_bytes") or r.get("device_bytes_limit") for r in mb.values()
                   if r.get("budget_bytes") or r.get("device_bytes_limit")), None)
    if budget:
      ax_m.axhline(budget / 2**30, color="gray", ls="--", label="budget" if not gpu_limit(mb) else "allocator limit")
    for a in (ax_m, ax_t):
      a.set_xscale("log", base=2)
      a.set_xlabel("batch size")
      a.legend()
    ax_m.set(ylabel="GiB per device (compiled step peak)", title="memory vs batch")
    ax_t.set(ylabel="tokens/s", title="throughput vs batch")
  else:
    names = [n for n in LOSSES if n in mem or n in runs]
    vals = [((runs.get(n, {}).get("memory", {}).get("compiled")) or mem.get(n, {})).get("peak", 0) / 2**30
            for n in names]
    ax_m.bar(names, vals, color=[colors[n] for n in names])
    ax_m.set(ylabel="GiB per device", title=f"compiled step peak, batch {result['config']['batch_size']}")
    tn = [n for n in names if runs.get(n, {}).get("tokens_per_s")]
    ax_t.bar(tn, [runs[n]["tokens_per_s"] for n in tn], color=[colors[n] for n in tn])
    ax_t.set(ylabel="tokens/s", title="throughput" + ("" if len(tn) > 1 else " (run --compare for both)"))
  fig.suptitle(f"lce_flax example LM — {result.get('device', '')}")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def gpu_limit(mb: dict[str, Any]) -> bool:
  return any(r.get("device_bytes_limit") for r in mb.values())


def write_outputs(result: dict[str, Any], out: str, log: Callable[[str], None]) -> tuple[str, str]:
  os.makedirs(out, exist_ok=True)
  jpath, ppath = os.path.join(out, "train_lm.json"), os.path.join(out, "train_lm.png")
  _atomic_write(jpath, lambda p: open(p, "w").write(json.dumps(result, indent=1)))
  plot(result, ppath)
  log(f"wrote {jpath} and {ppath}")
  return jpath, ppath


# --------------------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--loss", choices=LOSSES, default="fused", help="fused: lce_flax head; xla: nn.Dense + optax")
  p.add_argument("--compare", action="store_true", help="train both heads (each in a fresh process) and compare")
  p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
  p.add_argument("--impl", default="auto", help="lce_flax implementation of the fused head")
  p.add_argument("--chunk-size", type=int, help="chunk of the fused head's chunked implementation (default: its "
                 "heuristic)")
  p.add_argument("--steps", type=int)
  p.add_argument("--batch-size", type=int)
  p.add_argument("--seq-len", type=int)
  p.add_argument("--vocab-size", type=int, help="BPE vocabulary = the head's V")
  p.add_argument("--d-model", type=int)
  p.add_argument("--num-layers", type=int)
  p.add_argument("--num-heads", type=int)
  p.add_argument("--d-ff", type=int)
  p.add_argument("--dtype", choices=("float32", "bfloat16"))
  p.add_argument("--remat", action=argparse.BooleanOptionalAction, default=None)
  p.add_argument("--lr", type=float)
  p.add_argument("--warmup", type=int)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--num-devices", type=int, help="use the first N devices (default: all that divide the batch)")
  p.add_argument("--mesh", help="mesh axis sizes, e.g. data=2,fsdp=2,tensor=2 (axes data, fsdp, tensor; missing: 1; "
                 "one may be -1). Default: data parallel over the devices that divide the batch")
  p.add_argument("--coordinator", help="multi-process run: HOST:PORT of process 0 (jax.distributed.initialize)")
  p.add_argument("--num-processes", type=int, default=1, help="multi-process run: number of processes")
  p.add_argument("--process-id", type=int, default=0, help="multi-process run: this process's index")
  p.add_argument("--jax-cache-dir", help="JAX persistent compilation cache (reruns skip compiling); none if unset")
  p.add_argument("--eval-every", type=int, help="steps between held-out evaluations (0: only at the end)")
  p.add_argument("--eval-batches", type=int)
  p.add_argument("--ckpt-dir", help="orbax checkpoints here (none if unset)")
  p.add_argument("--save-every", type=int, help="steps between checkpoints (and one at the end)")
  p.add_argument("--resume", action="store_true", help="continue from the last finished checkpoint in --ckpt-dir")
  p.add_argument("--stop-after", type=int, help="stop after this many steps of this invocation (as if preempted); "
                 "the schedule still runs to --steps")
  p.add_argument("--find-max-batch", action="store_true", help="search the largest batch each head fits")
  p.add_argument("--heads", default="fused,xla", help="--find-max-batch: the heads to search, comma-separated")
  p.add_argument("--mem-budget-gib", type=float, help="CPU --find-max-batch: the memory a step may take")
  p.add_argument("--max-batch-limit", type=int, help="--find-max-batch stops doubling here")
  p.add_argument("--bench-steps", type=int, help="timed steps per --find-max-batch probe (CPU: 0 = compile only)")
  p.add_argument("--max-batch-tol", type=float, default=1 / 16,
                 help="--find-max-batch stops bisecting when the gap is at most this fraction of the batch")
  p.add_argument("--out", default="train_lm_out", help="directory for train_lm.json and train_lm.png")
  p.add_argument("--cache-dir", default=os.environ.get("LCE_FLAX_CACHE", "~/.cache/lce_flax"),
                 help="tokenizer and token ids")
  p.add_argument("--sample-tokens", type=int, help="tokens of greedy generation at the end")
  p.add_argument("--prompt", default="Return the")
  p.add_argument("--repetition-penalty", type=float, default=1.3, help="of the greedy sample; 1 = plain greedy")
  p.add_argument("--quiet", action="store_true", help="no progress bar")
  args = p.parse_args(argv)
  for k, v in PRESETS[args.preset].items():
    if getattr(args, k, None) is None:
      setattr(args, k, v)
  for k in ("steps", "batch_size", "seq_len", "vocab_size", "d_model", "num_layers", "num_heads", "d_ff"):
    if getattr(args, k) < 1:
      p.error(f"--{k.replace('_', '-')}={getattr(args, k)} must be >= 1")
  if args.d_model % args.num_heads:
    p.error(f"--d-model={args.d_model} must be a multiple of --num-heads={args.num_heads}")
  if args.vocab_size < 260:
    p.error(f"--vocab-size={args.vocab_size} must be >= 260 (256 bytes + the end-of-text token)")
  if any(h not in LOSSES for h in args.heads.split(",")):
    p.error(f"--heads={args.heads!r}: each must be one of {LOSSES}")
  if args.resume and not args.ckpt_dir:
    p.error("--resume needs --ckpt-dir")
  try:
    parse_mesh(args.mesh)
  except ValueError as e:
    p.error(str(e))
  if args.num_processes > 1 and not args.coordinator:
    p.error("--num-processes > 1 needs --coordinator HOST:PORT")
  if args.num_processes > 1 and args.compare:
    p.error("--compare runs each head in its own single process; run the heads one at a time with --loss")
  return args


def model_config(args: argparse.Namespace) -> ModelConfig:
  return ModelConfig(args.vocab_size, args.seq_len, args.d_model, args.num_layers, args.num_heads, args.d_ff,
                     args.dtype, bool(args.remat))


def _compare(argv: list[str], args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
  """Runs each head in a fresh process (so GPU peak-memory counters and allocator state are its own)."""
  base = [a for a in argv if a != "--compare"]
  result: dict[str, Any] = {}
  for loss in LOSSES:
    sub_out = os.path.join(args.out, loss)
    cmd = [sys.executable, os.path.abspath(__file__), *base, "--loss", loss, "--out", sub_out]
    if args.ckpt_dir:
      cmd += ["--ckpt-dir", os.path.join(args.ckpt_dir, loss)]
    log(f"--compare: {' '.join(cmd[1:])}")
    subprocess.run(cmd, check=True)
    with open(os.path.join(sub_out, "train_lm.json")) as f:
      sub = json.load(f)
    if not result:
      result = {k: v for k, v in sub.items() if k not in ("runs", "max_batch")}
      result["runs"], result["max_batch"] = {}, {}
    result["runs"].update(sub.get("runs", {}))
    result["max_batch"].update(sub.get("max_batch", {}))
  if not result["max_batch"]:
    del result["max_batch"]
  return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
  """Runs the trainer with command-line ``argv``; returns what it writes to ``--out``/train_lm.json."""
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  if args.coordinator:
    init_distributed(args.coordinator, args.num_processes, args.process_id)
  if jax.process_index() != 0:
    args.quiet = True  # one progress bar, process 0's
  if args.jax_cache_dir:
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(args.jax_cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  log = functools.partial(print, flush=True) if jax.process_index() == 0 else (lambda *a, **k: None)
  dev = jax.local_devices()[0]
  device = f"{jax.device_count()}x {getattr(dev, 'device_kind', dev.platform)}"
  if jax.process_count() > 1:
    device += f" ({jax.process_count()} processes)"
  if args.compare:
    result = _compare(argv, args, log)
  else:
    data = load_data(args.cache_dir, args.vocab_size, log)
    result = {"config": {k: v for k, v in vars(args).items() if k not in ("quiet",)}, "device": device,
              "data": {"source": data.source, "tokenizer_vocab": data.tokenizer_vocab,
                       "train_tokens": int(len(data.train_ids)), "eval_tokens": int(len(data.eval_ids))},
              "lce_flax_implementations": lce_flax.available_implementations()}
    if args.find_max_batch:
      result["max_batch"] = {}
      for loss in args.heads.split(","):
        log(f"--find-max-batch: {loss}")
        result["max_batch"][loss] = find_max_batch(args, data, loss, log)
    else:
      run = train(args, data, args.loss, log)
      result["runs"] = {args.loss: run}
      result["memory_compiled"] = head_memory(args, args.batch_size, {args.loss: run["memory"]["compiled"]})
      if "sample" in run:
        log(f"sample ({args.loss}, greedy, repetition penalty {args.repetition_penalty}): {run['sample']!r}")
  print_table(result, log)
  if jax.process_index() == 0:
    write_outputs(result, args.out, log)
  return result


def init_distributed(coordinator: str, num_processes: int, process_id: int) -> None:
  """``jax.distributed.initialize`` (before anything touches a device); CPU processes exchange through gloo."""
  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices only; no effect on GPUs
  jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)


if __name__ == "__main__":
  main()
