"""Train a small decoder-only transformer on real text with the fused head (``--loss fused``) or the plain one.

    python examples/train_lm.py                       # CPU preset: fused head, ~100 s on 2 cores
    python examples/train_lm.py --loss plain          # the same model with nn.Dense + optax cross-entropy
    python examples/train_lm.py --compare             # both, one after the other; memory/throughput table + plot
    python examples/train_lm.py --preset gpu --find-max-batch   # the largest batch each head fits on this GPU
    python examples/train_lm.py --preset headroom             # V=256000, 65536 tokens a step: plain does not fit
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/train_lm.py --mesh data=2,fsdp=2,tensor=2
    # two processes (run both; docs/trainer.md):  ... --coordinator localhost:12355 --num-processes 2 --process-id I

The pieces: ``data.py`` (the text, tokenizer, batches), ``model.py`` (the transformer and its two heads),
``train.py`` (mesh, step, loop, checkpoints, sampling), ``maxbatch.py`` (what fits), ``report.py`` (table, JSON,
plot), and this file (presets, flags, ``--compare``).
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
from typing import Any

import jax

import lce_flax

from .data import load_data
from .maxbatch import find_max_batch, probe
from .model import EMBED_GRADS, HEADS
from .report import print_table, write_outputs
from .train import compiler_options, parse_mesh, train

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train_lm.py")

# Everything a flag can leave unset comes from the preset. No preset sets an option of the fused head: it runs
# LossOptions(impl=--impl), and impl="auto" chooses the implementation and its chunking for the device and shape.
# The GPU presets hold the backward at the top block until the head's gradients are reduced and let XLA keep two
# collectives in flight (HOLD_HEAD_GRADS): the head's reduce-scatter then overlaps the body's backward instead of
# running after the step's last kernel, measured faster on two and four H200s (docs/multi_gpu.md).
HOLD_HEAD_GRADS = dict(head_grads_within=1,
                       xla_options=("xla_gpu_experimental_parallel_collective_overlap_limit=2",))
PRESETS: dict[str, dict[str, Any]] = {
    # sized to train in well under three minutes on two cores (tokenizer included)
    "cpu": dict(vocab_size=32768, d_model=128, num_layers=2, num_heads=4, d_ff=512, seq_len=128, batch_size=8,
                steps=250, lr=3e-3, warmup=20, eval_every=50, eval_batches=4, save_every=50, dtype="float32",
                remat=False, mem_budget_gib=2.0, max_batch_limit=1024, bench_steps=2, sample_tokens=24,
                head_grads_within=0, xla_options=()),
    # the head dominates memory: 128k vocabulary, remat'd blocks, so the [tokens, V] logits of the plain head are
    # most of what a step keeps alive
    "gpu": dict(vocab_size=131072, d_model=1024, num_layers=8, num_heads=16, d_ff=4096, seq_len=1024, batch_size=16,
                steps=300, lr=1e-3, warmup=30, eval_every=100, eval_batches=8, save_every=100, dtype="bfloat16",
                remat=True, mem_budget_gib=None, max_batch_limit=4096, bench_steps=5, sample_tokens=48,
                **HOLD_HEAD_GRADS),
    # the headroom a user buys on one 80 GB GPU: V = 256000 (Gemma's vocabulary) and 65536 tokens a step. The plain
    # head does not fit (its step needed 53.6 GiB at 32768 tokens on an H100, so about twice that here); the fused
    # head's needed 14.1 GiB at 32768 tokens
    "headroom": dict(vocab_size=256000, d_model=1024, num_layers=4, num_heads=16, d_ff=4096, seq_len=1024,
                     batch_size=64, steps=100, lr=1e-3, warmup=10, eval_every=50, eval_batches=4, save_every=50,
                     dtype="bfloat16", remat=True, mem_budget_gib=None, max_batch_limit=1024, bench_steps=3,
                     sample_tokens=32, **HOLD_HEAD_GRADS),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--loss", choices=HEADS, default="fused",
                 help="the head: fused (lce_flax.linen.LMHead) or plain (nn.Dense + optax cross-entropy)")
  p.add_argument("--compare", action="store_true", help="train both heads (each in a fresh process) and compare")
  p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
  p.add_argument("--impl", default="auto", help="LossOptions(impl=...) of the fused head")
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
  p.add_argument("--layer-grads-in-order", action=argparse.BooleanOptionalAction, default=True,
                 help="each block's parameter gradients complete before the backward moves to the block below "
                 "(examples/lm/model.py: _in_order)")
  p.add_argument("--head-grads-within", type=int, metavar="K",
                 help="K > 0: the head's parameter gradients are complete (on a data-parallel mesh: reduced) "
                 "before the backward leaves the top K blocks, so their reduction overlaps those blocks' backward; "
                 "0: XLA places it, after the step's last kernel (examples/lm/model.py: _hold_open). Default: the "
                 "preset's (gpu and headroom: 1, with XLA's limit of collectives in flight raised to 2; cpu: 0)")
  p.add_argument("--embed-grads", choices=EMBED_GRADS, default="gather",
                 help="the embedding table's gradient on a mesh that splits the tokens: gather (the rows' gradients "
                 "all-gathered, B·H elements; measured faster on four GPUs) or reduce (each device's [V, H] table "
                 "all-reduced); examples/lm/model.py: lookup")
  p.add_argument("--split-head", action=argparse.BooleanOptionalAction, default=True,
                 help="the head's kernel and its AdamW moments split on H over the data axis too (ZeRO for the "
                 "head): each device holds and updates 1/n of them, gathers the kernel in the compute dtype for the "
                 "step and reduce-scatters its gradient instead of all-reducing it (measured faster and smaller on "
                 "four GPUs, both heads; examples/lm/model.py: split_head); --no-split-head: replicated over data")
  p.add_argument("--split-embed", action=argparse.BooleanOptionalAction, default=False,
                 help="the embedding table and its AdamW moments split on V over the data axes (data and fsdp): each "
                 "device holds and updates V/n rows, and the lookup runs vocabulary-parallel (the token ids "
                 "all-gathered, each device's rows of them reduce-scattered; backward: the rows' gradients "
                 "all-gathered, each device scatter-adds those of its rows; with --embed-grads reduce the devices' "
                 "[V, H] tables reduce-scattered), so the table is never gathered nor its gradient all-reduced; V "
                 "must be divisible by n (examples/lm/model.py: split_lookup). Off by default: not yet measured on "
                 "GPUs")
  p.add_argument("--lr", type=float)
  p.add_argument("--clip-norm", type=float, default=1.0,
                 help="clip the gradient's global norm to this before AdamW (0: no clipping)")
  p.add_argument("--warmup", type=int)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--num-devices", type=int, help="use the first N devices (default: all that divide the batch)")
  p.add_argument("--mesh", help="mesh axis sizes, e.g. data=2,fsdp=2,tensor=2 (axes data, fsdp, tensor; missing: 1; "
                 "one may be -1). Default: data parallel over the devices that divide the batch")
  p.add_argument("--compiler-option", action="append", metavar="KEY=VALUE",
                 help="an XLA option for compiling the train step (repeatable), e.g. "
                 "xla_gpu_enable_analytical_sol_latency_estimator=true (a cost model for the scheduler); given after "
                 "the preset's (gpu and headroom: xla_gpu_experimental_parallel_collective_overlap_limit=2), so the "
                 "same KEY overrides it")
  p.add_argument("--pgle", type=int, default=0, metavar="N",
                 help="profile-guided scheduling: the first N steps run under JAX's profiler, then the step is "
                 "compiled again with what it measured, so that XLA's scheduler places the gradients' all-reduces by "
                 "measured times (JAX's automatic PGLE; the profile is empty off NVIDIA GPUs). 0: off")
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
  p.add_argument("--only-this-head", action="store_true",
                 help="do not compile and time the other head's step at the same batch after the run")
  p.add_argument("--find-max-batch", action="store_true", help="search the largest batch each head fits")
  p.add_argument("--heads", default=",".join(HEADS), help="--find-max-batch: the heads to search, comma-separated")
  p.add_argument("--mem-budget-gib", type=float, help="CPU --find-max-batch: the memory a step may take")
  p.add_argument("--max-batch-limit", type=int, help="--find-max-batch stops doubling here")
  p.add_argument("--bench-steps", type=int, help="timed steps of a probe: each --find-max-batch probe and the other "
                 "head's step at the run's batch (CPU --find-max-batch: 0 = compile only)")
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
  args.compiler_option = [*args.xla_options, *(args.compiler_option or [])]  # the user's last: theirs win
  for k in ("steps", "batch_size", "seq_len", "vocab_size", "d_model", "num_layers", "num_heads", "d_ff"):
    if getattr(args, k) < 1:
      p.error(f"--{k.replace('_', '-')}={getattr(args, k)} must be >= 1")
  if args.pgle < 0:
    p.error(f"--pgle={args.pgle} must be >= 0")
  if not args.clip_norm >= 0:
    p.error(f"--clip-norm={args.clip_norm} must be >= 0 (0: no clipping)")
  if args.pgle and args.num_processes > 1:
    p.error(f"--pgle with --num-processes={args.num_processes}: each process would compile its step with its own "
            "profile (JAX does not share it), and steps whose collectives run in different orders can hang")
  if args.d_model % args.num_heads:
    p.error(f"--d-model={args.d_model} must be a multiple of --num-heads={args.num_heads}")
  if args.vocab_size < 260:
    p.error(f"--vocab-size={args.vocab_size} must be >= 260 (256 bytes + the end-of-text token)")
  if any(h not in HEADS for h in args.heads.split(",")):
    p.error(f"--heads={args.heads!r}: each must be one of {HEADS}")
  if args.resume and not args.ckpt_dir:
    p.error("--resume needs --ckpt-dir")
  try:
    parse_mesh(args.mesh)
    compiler_options(args.compiler_option)
  except ValueError as e:
    p.error(str(e))
  if args.num_processes > 1 and not args.coordinator:
    p.error("--num-processes > 1 needs --coordinator HOST:PORT")
  if args.num_processes > 1 and args.compare:
    p.error("--compare runs each head in its own single process; run the heads one at a time with --loss")
  return args


def _compare(argv: list[str], args: argparse.Namespace, log) -> dict[str, Any]:
  """Runs each head in a fresh process (so GPU peak-memory counters and allocator state are its own)."""
  import json

  base = [a for a in argv if a != "--compare"]
  result: dict[str, Any] = {}
  for head in HEADS:
    sub_out = os.path.join(args.out, head)
    cmd = [sys.executable, SCRIPT, *base, "--loss", head, "--out", sub_out, "--only-this-head"]
    if args.ckpt_dir:
      cmd += ["--ckpt-dir", os.path.join(args.ckpt_dir, head)]
    log(f"--compare: {' '.join(cmd[1:])}")
    subprocess.run(cmd, check=True)
    with open(os.path.join(sub_out, "train_lm.json")) as f:
      sub = json.load(f)
    if not result:
      result = {k: v for k, v in sub.items() if k not in ("runs", "max_batch", "same_batch")}
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
              "jax": jax.__version__, "lce_flax_implementations": lce_flax.available_implementations(),
              "data": {"source": data.source, "tokenizer_vocab": data.tokenizer_vocab,
                       "train_tokens": int(len(data.train_ids)), "eval_tokens": int(len(data.eval_ids))}}
    if args.find_max_batch:
      result["max_batch"] = {}
      for head in args.heads.split(","):
        log(f"--find-max-batch: {head}")
        result["max_batch"][head] = find_max_batch(args, data, head, log)
    else:
      run = train(args, data, args.loss, log)
      result["runs"] = {args.loss: run}
      if "sample" in run:
        log(f"sample ({args.loss}, greedy, repetition penalty {args.repetition_penalty}): {run['sample']!r}")
      if not args.only_this_head:  # the other head's step at the same batch: its memory and tokens/s (or no fit)
        other = next(h for h in HEADS if h != args.loss)
        log(f"{other}: its step at batch {args.batch_size}, compiled and timed ({args.bench_steps} steps)")
        result["same_batch"] = {other: probe(args, data, other, args.batch_size, None)}
  print_table(result, log)
  if jax.process_index() == 0:
    write_outputs(result, args.out, log)
  return result


def init_distributed(coordinator: str, num_processes: int, process_id: int) -> None:
  """``jax.distributed.initialize`` (before anything touches a device); CPU processes exchange through gloo."""
  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices only; no effect on GPUs
  jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
