"""The text: the docstrings, comments and ``pydoc_data`` help topics of the Python standard library installed with
the interpreter running the trainer (PSF License; nothing is downloaded), a byte-level BPE tokenizer (HF
``tokenizers``) trained on it once and cached with the token ids, and the batches (a pure function of the seed and
the step, so a resumed run sees exactly the batches of an uninterrupted one)."""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import os
import sys
import sysconfig
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

EOT = "<|endoftext|>"
CORPUS_VERSION = "stdlib-text-v1"  # bump when the corpus extraction changes, so caches are rebuilt


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
