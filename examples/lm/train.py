"""The training loop: a mesh of Explicit axes ("data", "fsdp", "tensor"), the jitted step of
``lce_flax.train.make_train_step`` under plain ``jit`` (the shardings are in the arrays' types, so the fused head
runs per shard by itself), held-out evaluation, Orbax checkpoints, greedy sampling, and the compiled memory of a
step."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lce_flax.sharding import MESH_AXES
from lce_flax.train import TrainState, batch_sharding, make_train_step, process_rows, state_shardings

from .data import EOT, Data, eval_batches, train_batch
from .model import RULES, ModelConfig, TransformerLM


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
  init_fn: Callable  # init_fn(seed) -> TrainState, unplaced (for eval_shape)

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
                        jax.eval_shape(functools.partial(self.init_fn, seed)), self.shardings)


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


def make_optimizer(lr: float, warmup: int, steps: int, clip_norm: float = 1.0) -> optax.GradientTransformation:
  """AdamW on a warm-up + cosine schedule, after clipping the gradient's global norm to ``clip_norm`` (0: no
  clipping; the global norm needs every reduced gradient before any parameter is updated). The optimizer state has
  the same structure either way, so a checkpoint resumes under another ``clip_norm``."""
  sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(warmup, 1), max(steps, warmup + 1), end_value=lr * 0.1)
  clip = optax.clip_by_global_norm(clip_norm) if clip_norm else optax.identity()
  return optax.chain(clip, optax.adamw(sched, b2=0.95, weight_decay=0.1))


def _unboxed(tree: Any) -> Any:
  """Flax's logical-partitioning boxes replaced by their contents (arrays, or the shardings of ``state_shardings``)."""
  return jax.tree.map(lambda n: n.value if isinstance(n, nn.meta.AxisMetadata) else n, tree,
                      is_leaf=lambda n: isinstance(n, nn.meta.AxisMetadata))


def make_trainer(cfg: ModelConfig, head: str, impl: str, batch_size: int, tx: optax.GradientTransformation,
                 seq_len: int, num_devices: int | None = None, mesh: str | None = None,
                 compiler_options: dict | None = None) -> Trainer:
  mesh_ = build_mesh(batch_size, mesh, num_devices)
  token_devices = mesh_.shape["data"] * mesh_.shape["fsdp"]
  if cfg.split_embed and cfg.vocab_size % token_devices:
    raise ValueError(f"--split-embed: --vocab-size={cfg.vocab_size} must be divisible by the {token_devices} devices "
                     f"that split the tokens (data x fsdp of the mesh {dict(mesh_.shape)}), which each hold V/"
                     f"{token_devices} rows of the embedding table")
  model = TransformerLM(cfg, head=head, impl=impl)
  repl = NamedSharding(mesh_, P())

  def boxed_state(seed):
    dummy = jnp.zeros((1, seq_len), jnp.int32)
    params = model.init(jax.random.key(seed), dummy, dummy)["params"]  # boxed with the logical names
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

  # Placement from the logical names (examples/lm/model.py: RULES, lce_flax.sharding.DEFAULT_RULES and one more:
  # "vocab" -> "tensor", "embed" -> "fsdp", the split head's "head_embed" and the split embedding table's
  # "embed_rows" -> "data" and "fsdp"); parameters without names (the blocks) are replicated. The AdamW moments carry
  # their parameters' names (the optimizer is initialised on the boxed parameters), so they are placed alike. The
  # state itself is a plain tree (no boxes), so both heads give the same tree and the checkpoints are plain arrays.
  shardings = _unboxed(state_shardings(jax.eval_shape(functools.partial(boxed_state, 0)), mesh_, RULES))

  def init_fn(seed):
    return _unboxed(boxed_state(seed))

  def loss_fn(params, batch):
    return model.apply({"params": params}, batch["inputs"], batch["labels"])

  # Plain jit: the state's and the batch's shardings are in their types (Explicit axes), and the fused head runs
  # per shard from them; ``.lower()`` stays available for the compiled memory analysis. The step returns the
  # loss and the gradient norm only: no logits are formed for metrics.
  step = make_train_step(loss_fn, tx, mesh=None, donate=True, compiler_options=compiler_options)

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
      shardings=shardings, init_fn=init_fn,
  )


def trainer_from_args(args: argparse.Namespace, head: str, batch_size: int | None = None) -> Trainer:
  return make_trainer(model_config(args), head, args.impl, batch_size or args.batch_size,
                      make_optimizer(args.lr, args.warmup, args.steps, args.clip_norm), args.seq_len,
                      args.num_devices, args.mesh, compiler_options(args.compiler_option))


def compiler_options(items: list[str] | None) -> dict:
  """``--compiler-option KEY=VALUE`` items as the step's XLA options: true/false as booleans, integers and floats
  as numbers, anything else as a string."""
  out = {}
  for item in items or ():
    key, sep, text = item.partition("=")
    if not sep or not key:
      raise ValueError(f"--compiler-option {item!r}: expected KEY=VALUE")
    value: object = {"true": True, "false": False}.get(text.lower(), text)
    if isinstance(value, str):
      for kind in (int, float):
        try:
          value = kind(text)
          break
        except ValueError:
          pass
    out[key] = value
  return out


def model_config(args: argparse.Namespace) -> ModelConfig:
  return ModelConfig(args.vocab_size, args.seq_len, args.d_model, args.num_layers, args.num_heads, args.d_ff,
                     args.dtype, bool(args.remat), args.layer_grads_in_order,
                     args.head_grads_within, args.embed_grads, args.split_head, args.split_embed)


# --------------------------------------------------------------------------------------------------- memory


def compiled_memory(compiled) -> dict[str, int]:
  """Bytes per device from XLA's compiled memory analysis. ``temp``: the step's temporaries (activations, the
  head's logits or chunks, gradients before the update), which is where the two heads differ; ``peak`` =
  arguments + outputs − aliased + temporaries (parameters and optimizer state included)."""
  m = compiled.memory_analysis()
  out = {k: int(getattr(m, f"{k}_size_in_bytes", 0) or 0) for k in ("argument", "output", "alias", "temp")}
  out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
  return out


def gpu_peak_bytes() -> int | None:
  stats = jax.local_devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


@contextlib.contextmanager
def pgle(runs: int):
  """JAX's automatic profile-guided latency estimation for the jitted calls inside, where ``runs`` > 0: a step's
  first ``runs`` calls are profiled, the next compiles it again with their profile (XLA's scheduler then orders
  the collectives and kernels by measured times). JAX's settings are put back on leaving."""
  if runs <= 0:
    yield
    return
  keys = ("jax_enable_pgle", "jax_pgle_profiling_runs")
  saved = {k: getattr(jax.config, k) for k in keys}
  jax.config.update("jax_enable_pgle", True)
  jax.config.update("jax_pgle_profiling_runs", runs)
  try:
    yield
  finally:
    for k, v in saved.items():
      jax.config.update(k, v)


def compile_step(trainer: Trainer, state_like, seq_len: int):
  with jax.set_mesh(trainer.mesh):
    return trainer.step.lower(state_like, trainer.abstract_batch(seq_len)).compile()


def is_oom(e: BaseException) -> bool:
  """Whether ``e`` is XLA's out-of-memory (at compile time or when a step runs)."""
  s = str(e)
  return "RESOURCE_EXHAUSTED" in s or "Out of memory" in s or "out of memory" in s


def oom_message(e: BaseException) -> str:
  lines = [ln for ln in str(e).splitlines() if ln.strip()]
  return (lines[0] if lines else type(e).__name__)[:300]


# ------------------------------------------------------------------------------------------------ checkpoints


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


# -------------------------------------------------------------------------------------------------- the run


def human(n: float | None, unit: str = "B") -> str:
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


def run_steps(compiled, state, steps: Iterable[int], batch_of: Callable[[int], Any],
              on_loss: Callable[[int, float, float], None] | None = None,
              reads_state: Callable[[int], bool] = lambda done: False,
              on_state: Callable[[int, Any, float], None] | None = None) -> tuple[Any, list[float]]:
  """Runs the compiled train step once for each index of ``steps`` on ``batch_of(index)``; returns the final state
  and each step's seconds. Each step is dispatched before the previous step's loss is read, so that the host's
  work between steps (the next batch, the dispatch) overlaps the device's, as in a training loop that does not wait
  for every loss; a step's time runs from when the device could start it (its dispatch, or the previous step's
  end, whichever came later) to its loss being ready. ``on_loss(done, loss, seconds)`` follows each step (``done``:
  steps done); where ``reads_state(done)``, that step is finished before the next is dispatched and
  ``on_state(done, state, loss)`` may read its state (evaluate, save: the step donates the state it is given)."""
  times: list[float] = []
  last = None  # when the previous step's loss was ready

  def finish(done, metrics, t_dispatch):
    nonlocal last
    loss = float(metrics["loss"])
    now = time.perf_counter()
    times.append(now - (t_dispatch if last is None else max(t_dispatch, last)))
    last = now
    if on_loss is not None:
      on_loss(done, loss, times[-1])
    return loss

  pending = None  # (done, metrics, dispatch time) of the step in flight
  for step in steps:
    batch = batch_of(step)
    t0 = time.perf_counter()
    state, metrics = compiled(state, batch)
    if pending is not None:
      finish(*pending)
    pending = (step + 1, metrics, t0)
    if reads_state(step + 1):
      loss = finish(*pending)
      pending = None
      if on_state is not None:
        on_state(step + 1, state, loss)
  if pending is not None:
    finish(*pending)
  return state, times


def train(args: argparse.Namespace, data: Data, head: str, log: Callable[[str], None]) -> dict[str, Any]:
  """Trains one model with the ``head``; returns the run's record (losses, eval, memory, tokens/s, sample). A
  step that does not fit in the device's memory ends the run with ``fits: False`` and the error, not an
  exception."""
  tr = trainer_from_args(args, head)
  with jax.set_mesh(tr.mesh):
    try:
      return _train(args, data, head, log, tr)
    except Exception as e:  # noqa: BLE001 - only out-of-memory is an answer; anything else is a bug
      if not is_oom(e):
        raise
      log(f"{head}: does not fit at batch {args.batch_size}x{args.seq_len}: {oom_message(e)}")
      jax.clear_caches()
      return {"head": head, "impl": args.impl if head == "fused" else "plain", "fits": False,
              "error": oom_message(e), "batch_size": args.batch_size}


def _train(args, data, head, log, tr) -> dict[str, Any]:
  cfg = model_config(args)
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
  log(f"{head}: {n_params / 1e6:.2f}M params (head {cfg.d_model}x{cfg.vocab_size}), batch {args.batch_size}x"
      f"{args.seq_len} on {tr.mesh.devices.size} {jax.default_backend()} device(s) (mesh {dict(tr.mesh.shape)}, "
      f"{jax.process_count()} process(es)); compiled step: peak {human(mem['peak'])}/device, "
      f"temporaries {human(mem['temp'])}")

  evals = eval_batches(data.eval_ids, args.eval_batches, args.batch_size, args.seq_len)

  def evaluate(params, step):
    losses = [float(tr.eval_loss(params, tr.put_batch({k: v[tr.rows] for k, v in b.items()}))) for b in evals]
    el = float(np.mean(losses))
    rec = {"step": step, "loss": el, "ppl": float(math.exp(min(el, 50.0)))}
    history["eval"].append(rec)
    return rec

  stop = min(args.steps, start + args.stop_after) if args.stop_after else args.steps
  bar = _progress(range(start, stop), args, desc=head)
  peak = None

  def evaluates(done: int) -> bool:  # (the final evaluation comes after the loop)
    return bool(args.eval_every) and done % args.eval_every == 0 and done < args.steps

  def reads_state(done: int) -> bool:
    """Whether the state after step ``done`` is read (evaluated, saved) before the next step runs."""
    return evaluates(done) or (mngr is not None and (done == args.steps or mngr.should_save(done)))

  def on_loss(done: int, loss_val: float, dt: float):
    nonlocal peak
    history["loss"].append(loss_val)
    if jax.default_backend() == "gpu":
      peak = gpu_peak_bytes()
    if hasattr(bar, "set_postfix"):
      bar.set_postfix(loss=f"{loss_val:.3f}", tok_s=f"{tokens_per_step / dt:,.0f}",
                      mem=human(peak if peak is not None else mem["peak"]), refresh=False)

  def on_state(done: int, state, loss_val: float):
    if evaluates(done):
      e = evaluate(state.params, done)
      log(f"step {done}: train loss {loss_val:.3f}, eval loss {e['loss']:.3f} (ppl {e['ppl']:.1f})")
    if mngr is not None:
      save_checkpoint(mngr, done, state, history, force=done == args.steps)

  batch_of = lambda step: tr.put_batch(train_batch(data.train_ids, step, args.batch_size, args.seq_len, args.seed,
                                                   tr.rows))
  with pgle(args.pgle):
    # (--pgle: the jitted step, whose calls JAX profiles and then compiles again with the profile)
    state, times = run_steps(tr.step if args.pgle else compiled, state, bar, batch_of, on_loss, reads_state,
                             on_state)
  if mngr is not None:
    mngr.wait_until_finished()
    mngr.close()

  finished = (start if not times else stop) == args.steps
  final_eval = evaluate(state.params, stop) if finished or not history["eval"] else history["eval"][-1]
  # the first step of a process pays for the transfer of state (and under --pgle N the next N: their profiling and
  # the compile that takes their profile)
  skip = 1 + args.pgle
  steady = times[skip:] if len(times) > skip else times[-1:]
  tok_s = tokens_per_step / statistics.median(steady) if steady else None
  record = {
      "head": head, "impl": args.impl if head == "fused" else "plain", "fits": True, "params": int(n_params),
      "batch_size": args.batch_size, "start_step": start, "end_step": stop, "losses": history["loss"],
      "eval": history["eval"], "final_eval": final_eval, "tokens_per_s": tok_s,
      "step_time_s": statistics.median(steady) if steady else None, "timed_steps": len(steady),
      "memory": {"compiled": mem, "gpu_peak_bytes_in_use": peak},
  }
  if times:
    log(f"{head}: train loss {history['loss'][start]:.3f} at step {start + 1} -> {history['loss'][-1]:.3f} at step "
        f"{stop}; held-out loss {final_eval['loss']:.3f} (ppl {final_eval['ppl']:.1f}); "
        f"{tok_s:,.0f} tokens/s; step peak {human(peak if peak is not None else mem['peak'])}")
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
