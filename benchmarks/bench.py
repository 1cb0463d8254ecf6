"""Speed and memory of every available implementation (and tokamax's, if installed) at LLM head shapes.

Usage::

  python -m benchmarks.bench [--preset {smoke,llm,sweep}] [--impls xla,chunked,...] [--modes fast,lean]
                             [--passes fwd,fwdbwd] [--out DIR] [--budget-s SECONDS] [--order {impl,shape}]
                             [--interpret] [--no-report]

For each shape, implementation, mode and pass (``fwd``: the loss; ``fwdbwd``: the loss and the gradients of x and
w) it compiles the jitted function once, reads the compiled temp memory
(``compiled.memory_analysis().temp_size_in_bytes``: the extra device memory beyond inputs and outputs), runs it
once to warm up, then times repeated runs with wall clock around ``jax.block_until_ready`` and records the
median. Inputs are those of the anchors file: bf16 ``x ~ N(0, 1)`` [B, H], ``w = 0.02·N(0, 1)`` [H, V], labels
uniform in [0, V), reduction "sum".

Each measurement is one JSON line in ``DIR/bench_<preset>.jsonl`` (schema in :func:`base_row` and
:func:`measure`), written as soon as it is taken; an implementation that fails (out of memory, unsupported) gives
a row with ``error`` and the run goes on. Past ``--budget-s`` the remaining work is recorded as skipped. At the
end :mod:`benchmarks.plots` turns every ``*.jsonl`` in DIR into ``results.md`` and PNG plots.

TFLOP/s: ``tflops`` is the floor's FLOPs over the time (6·B·H·V for fwdbwd, 2·B·H·V for fwd), so rows compare
on one scale; ``algo_tflops`` uses the FLOPs the design actually does (``flops_factor``·B·H·V: designs that
recompute the logits in the backward, the "lean" ones, do 8·B·H·V).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib
import importlib.metadata
import json
import os
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import lce_flax
from lce_flax import _math
from lce_flax._impl import common
from benchmarks import shapes as shapes_lib
from benchmarks.shapes import PEAK_TFLOPS, Preset, Shape

TOKAMAX_IMPLS = ("tokamax_xla", "tokamax_chunked_xla")
PASSES = ("fwd", "fwdbwd")


# --------------------------------------------------------------------------------------------- environment


def _version(dist: str) -> str | None:
  try:
    return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    return None


def import_tokamax():
  """Returns (module, None) or (None, reason). tokamax is optional: absent, its rows are simply not made.

  tokamax imports ``xprof`` (a profiler, ~32 MB wheel) at import time for its own benchmarking helpers, which
  the loss op never calls; where xprof is missing an empty stand-in module is registered so that the op imports.
  """
  try:
    import tokamax  # noqa: PLC0415
    return tokamax, None
  except ModuleNotFoundError as e:
    if not (e.name or "").startswith("xprof"):
      return None, f"{type(e).__name__}: {e}"
  except Exception as e:  # noqa: BLE001 - any import failure just means "not available"
    return None, f"{type(e).__name__}: {e}"
  import types  # noqa: PLC0415
  for name in ("xprof", "xprof.cli", "xprof.cli.tools"):
    sys.modules.setdefault(name, types.ModuleType(name))
  sys.modules["xprof.cli.tools"].get_kernel_stats_tool = None
  try:
    import tokamax  # noqa: PLC0415
    return tokamax, None
  except Exception as e:  # noqa: BLE001
    return None, f"{type(e).__name__}: {e}"


def environment() -> dict[str, Any]:
  """What every row carries: device, software versions, date."""
  dev = jax.devices()[0]
  return dict(
      device=getattr(dev, "device_kind", str(dev)),
      platform=dev.platform,
      num_devices=jax.device_count(),
      jax=jax.__version__,
      jaxlib=_version("jaxlib"),
      triton=_version("triton"),
      jax_triton=_version("jax-triton"),
      tokamax=_version("tokamax"),
      lce_flax=lce_flax.__version__,
      date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
  )


# ------------------------------------------------------------------------------------------------- variants


@dataclasses.dataclass(frozen=True)
class Variant:
  """One implementation (and mode) to measure. ``loss(x, w, labels)`` returns the summed float32 loss."""

  impl: str
  mode: str | None
  loss: Callable[..., jax.Array] | None
  flops_factor: int  # FLOPs of fwd+bwd in units of B·H·V: 6 (gradients from the logits on hand) or 8 (recompute)
  unavailable: str | None = None  # reason, when it cannot run here

  @property
  def label(self) -> str:
    return self.impl if self.mode is None else f"{self.impl}:{self.mode}"


def _lce_variants(name: str, modes: tuple[str, ...], interpret: bool = False) -> list[Variant]:
  """``impl=name`` once per mode where the implementation has a distinct fast design, else once (mode None).

  ``interpret=True`` runs Pallas kernels in interpret mode (on a CPU: checks the harness drives them; the times
  mean nothing)."""
  try:
    mod = importlib.import_module(lce_flax.IMPLEMENTATIONS[name])
  except ImportError as e:
    return [Variant(name, None, None, 6, f"{type(e).__name__}: {e}")]
  spec = common.Spec(_math.LossOptions(vocab_size=2), interpret=interpret)
  if name not in lce_flax.available_implementations(spec):
    return [Variant(name, None, None, 6, f"not available on {jax.default_backend()} (interpret={interpret})")]
  if getattr(mod, "fast", None) is None:
    # One design whatever the mode: xla autodiffs stored logits (6·B·H·V); kernels without a fast path recompute.
    modes = (None,)
  out = []
  for mode in modes:
    factor = 6 if name == "xla" or mode == "fast" else 8
    kw = {"interpret": True} if interpret else {}
    loss = functools.partial(lce_flax.linear_cross_entropy, reduction="sum", impl=name, mode=mode, **kw)
    out.append(Variant(name, mode, loss, factor))
  return out


# Configurations measured as variants of their own: name -> (impl, its Config fields, FLOPs of fwd+bwd in B·H·V).
# ``low_memory``: a third logits pass instead of the B×H float32 dx accumulator (≤ 64 MB at the LLM shapes).
CONFIG_VARIANTS = {"pallas_triton:low_memory": ("pallas_triton", {"low_memory": True}, 10),
                   "triton:low_memory": ("triton", {"low_memory": True}, 10)}


def _config_variant(name: str, interpret: bool = False) -> Variant:
  impl, fields, factor = CONFIG_VARIANTS[name]
  tag = name.split(":", 1)[1]
  base = _lce_variants(impl, (None,), interpret)[0]
  if base.unavailable:
    return dataclasses.replace(base, mode=tag, flops_factor=factor)
  config = importlib.import_module(lce_flax.IMPLEMENTATIONS[impl]).Config(**fields)
  return Variant(impl, tag, functools.partial(base.loss, config=config), factor)


def _tokamax_variant(name: str, tokamax, reason: str | None) -> Variant:
  impl = name.removeprefix("tokamax_")
  # tokamax's xla path autodiffs the stored logits; chunked_xla keeps the [B] lse and recomputes.
  factor = 6 if impl == "xla" else 8
  if tokamax is None:
    return Variant(name, None, None, factor, reason)

  def loss(x, w, labels):
    return tokamax.linear_softmax_cross_entropy_loss(x, labels, w, reduction="sum", implementation=impl)

  return Variant(name, None, loss, factor)


def make_variants(impls: list[str] | None, modes: tuple[str, ...],
                  interpret: bool = False) -> tuple[list[Variant], str | None]:
  """Variants for ``impls`` (None: every available lce_flax implementation, then tokamax's if it imports).

  Returns the variants and, when tokamax was wanted but does not import, why.
  """
  tokamax, reason = None, None
  if impls is None or any(n in TOKAMAX_IMPLS for n in impls):
    tokamax, reason = import_tokamax()
  if impls is None:
    spec = common.Spec(_math.LossOptions(vocab_size=2), interpret=interpret)
    impls = lce_flax.available_implementations(spec) + (list(TOKAMAX_IMPLS) if tokamax is not None else [])
  known = [*lce_flax.IMPLEMENTATIONS, *TOKAMAX_IMPLS, *CONFIG_VARIANTS]
  for name in impls:
    if name not in known:
      raise ValueError(f"--impls: {name!r} is not one of {known}")
  variants = []
  for name in impls:
    if name in TOKAMAX_IMPLS:
      variants.append(_tokamax_variant(name, tokamax, reason))
    elif name in CONFIG_VARIANTS:
      variants.append(_config_variant(name, interpret))
    else:
      variants.extend(_lce_variants(name, modes, interpret))
  return variants, reason


# --------------------------------------------------------------------------------------------------- inputs


def make_inputs(shape: Shape, seed: int = 0):
  """bf16 x ~ N(0,1) [B, H], w = 0.02·N(0,1) [H, V], labels uniform int32 [B] (the anchors' distribution)."""
  kx, kw, ky = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(kx, (shape.B, shape.H), jnp.bfloat16)
  w = (0.02 * jax.random.normal(kw, (shape.H, shape.V), jnp.float32)).astype(jnp.bfloat16)
  y = jax.random.randint(ky, (shape.B,), 0, shape.V, jnp.int32)
  return jax.block_until_ready((x, w, y))


@functools.partial(jax.jit, static_argnames="chunk")
def reference_loss(x, w, labels, chunk: int = 8192):
  """Summed cross-entropy in float32 with full-precision ("highest") dots, vocabulary chunk by chunk so that no
  [B, V] array is formed; independent of every implementation under test."""
  b, v = x.shape[0], w.shape[1]
  chunk = min(chunk, v)
  n = -(-v // chunk)
  xf = x.astype(jnp.float32)
  wp = jnp.pad(w, ((0, 0), (0, n * chunk - v)))

  def chunk_lse(i):
    wc = jax.lax.dynamic_slice_in_dim(wp, i * chunk, chunk, axis=1).astype(jnp.float32)
    z = jnp.dot(xf, wc, precision=jax.lax.Precision.HIGHEST)
    z = jnp.where(i * chunk + jnp.arange(chunk) < v, z, -jnp.inf)  # padded columns do not count
    return jax.nn.logsumexp(z, axis=-1)

  lse = jax.nn.logsumexp(jax.lax.map(chunk_lse, jnp.arange(n)), axis=0)
  target = jnp.einsum("bh,hb->b", xf, w[:, labels].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
  del b
  return jnp.sum(lse - target)


# ------------------------------------------------------------------------------------------------ measuring


def _device_memory() -> dict[str, int] | None:
  """The allocator's counters of device 0 (GPU backends), or None where the backend keeps none (CPU)."""
  try:
    stats = jax.devices()[0].memory_stats()
  except Exception:  # noqa: BLE001
    return None
  if not stats or "peak_bytes_in_use" not in stats:
    return None
  return {"in_use": int(stats.get("bytes_in_use", 0)), "peak": int(stats["peak_bytes_in_use"])}


def _time(compiled, args, preset: Preset) -> tuple[list[float], Any]:
  """Warm-up run, then timed runs (seconds each) until ``preset.target_s`` is spent, within the rep bounds.

  Each run's outputs are dropped before the next starts, so at most one set of outputs (the gradients: B·H + H·V
  elements) is alive at a time and the allocator's peak is that of one step."""
  out = jax.block_until_ready(compiled(*args))  # warm-up: first-run allocations and autotuning stay out
  times = []
  reps = preset.min_reps
  while len(times) < reps:
    del out
    t = time.perf_counter()
    out = jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - t)
    if len(times) == 1:  # fewer repetitions for slow ones: about target_s in all
      reps = int(min(max(preset.target_s / max(times[0], 1e-6), preset.min_reps), preset.max_reps))
  return times, out


@jax.jit
def _norm(a):
  return jnp.sqrt(jnp.sum(jnp.square(a.astype(jnp.float32))))


def measure(variant: Variant, pass_: str, shape: Shape, args, preset: Preset) -> dict[str, Any]:
  """One row: times, memory and loss of ``variant`` on ``args`` for ``pass_`` ("fwd" or "fwdbwd")."""
  if pass_ == "fwd":
    fn = variant.loss
  else:
    fn = jax.value_and_grad(variant.loss, argnums=(0, 1))
  t = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  compile_s = time.perf_counter() - t
  mem_before = _device_memory()  # after compiling: the autotuner's scratch buffers are not the step's
  analysis = compiled.memory_analysis()
  temp = None if analysis is None else int(analysis.temp_size_in_bytes)
  times, out = _time(compiled, args, preset)
  loss = out if pass_ == "fwd" else out[0]
  ms = statistics.median(times) * 1e3
  floor_factor = 2 if pass_ == "fwd" else 6
  algo_factor = 2 if pass_ == "fwd" else variant.flops_factor
  row = dict(
      ms=ms,
      ms_min=min(times) * 1e3,
      reps=len(times),
      compile_s=compile_s,
      tflops=shape.flops(floor_factor) / ms / 1e9,
      algo_tflops=shape.flops(algo_factor) / ms / 1e9,
      flops_factor=algo_factor,
      temp_bytes=temp,
      loss=float(loss),
  )
  if pass_ == "fwdbwd":
    # Cheap sanity of the gradients, comparable across implementations and with the torch peers: their float32
    # norms (a scale error or a NaN shows; the implementations' own tests check the values).
    dx, dw = out[1]
    row["dx_norm"] = float(_norm(dx))
    row["dw_norm"] = float(_norm(dw))
  mem_after = _device_memory()
  if mem_before is not None and mem_after is not None:
    # The allocator's peak cannot be reset from JAX, so a row's peak is only known when it set a new one. Less the
    # memory in use before the row and one set of outputs, it is the step's extra memory, like temp_bytes.
    if mem_after["peak"] > mem_before["peak"]:
      out_bytes = sum(a.nbytes for a in jax.tree.leaves(out))
      row["device_peak_bytes"] = mem_after["peak"] - mem_before["in_use"] - out_bytes
    else:
      row["device_peak_note"] = "no new allocator peak (at most an earlier row's)"
  del compiled, out
  return row


def base_row(env: dict[str, Any], preset: Preset, shape: Shape, axis: str | None, variant: Variant,
             pass_: str) -> dict[str, Any]:
  return dict(
      env, source="jax", preset=preset.name, shape=shape.name, sweep=axis, B=shape.B, H=shape.H, V=shape.V,
      dtype="bfloat16", reduction="sum", impl=variant.impl, mode=variant.mode, label=variant.label, **{"pass": pass_},
      floor_ms=shape.floor_ms(2 if pass_ == "fwd" else 6), peak_tflops=PEAK_TFLOPS)


# ------------------------------------------------------------------------------------------------------ run


def _on_sigterm(signum, frame):  # a `timeout` wrapper's TERM: stop, but still write the report
  del frame
  raise KeyboardInterrupt(f"signal {signum}")


def run(preset: Preset, variants: list[Variant], out_dir: str, budget_s: float | None = None,
        log: Callable[[str], None] = print, order: str = "impl") -> str:
  """Measures everything of ``preset``; returns the path of the JSON-lines file.

  ``order="impl"`` runs each variant over every shape before the next variant (the default: ``variants`` come in
  order of importance, so a budget cut drops the least important); ``"shape"`` runs every variant at each shape.
  """
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, f"bench_{preset.name}.jsonl")
  env = environment()
  start = time.monotonic()
  log(f"# {env['device']} ({env['platform']}), jax {env['jax']}, preset {preset.name}, "
      f"variants {[v.label for v in variants]}, budget {budget_s} s -> {path}")
  with open(path, "w") as fh:

    def emit(row):
      fh.write(json.dumps(row) + "\n")
      fh.flush()
      if "error" in row:
        log(f"{row['shape']:>24} {row['label']:>20} {row['pass']:>6}  ERROR {row['error'][:160]}")
      else:
        log(f"{row['shape']:>24} {row['label']:>20} {row['pass']:>6} {row['ms']:9.2f} ms "
            f"{row['tflops']:6.1f} TF/s  temp {(row['temp_bytes'] or 0) / 1e9:6.2f} GB  loss {row['loss']:.6g}"
            f"  rel.err {row.get('loss_rel_err', float('nan')):.1e}")

    problems = shapes_lib.preset_shapes(preset)
    if order == "impl":  # each implementation over every shape: a budget cut loses the last implementations
      work = [(p, v) for v in variants for p in problems]
    elif order == "shape":  # every implementation at each shape: a budget cut loses the last shapes
      work = [(p, v) for p in problems for v in variants]
    else:
      raise ValueError(f"order={order!r} must be 'impl' or 'shape'")
    held: dict[str, Any] = {"name": None, "args": None, "err": None}  # inputs of one shape at a time
    refs: dict[str, float | None] = {}

    def inputs_for(shape: Shape):
      if held["name"] != shape.name:
        held.update(name=shape.name, args=None, err=None)
        try:
          held["args"] = make_inputs(shape)  # deterministic: the same inputs whenever a shape comes back
          if preset.reference and shape.name not in refs:
            refs[shape.name] = float(reference_loss(*held["args"]))
        except Exception as e:  # noqa: BLE001 - e.g. the inputs themselves do not fit
          held.update(args=None, err=f"inputs: {type(e).__name__}: {str(e)[:300]}")
      return held["args"], held["err"], refs.get(shape.name)

    for (shape, axis, passes), variant in work:
      for pass_ in passes:
        row = base_row(env, preset, shape, axis, variant, pass_)
        if budget_s is not None and time.monotonic() - start > budget_s:
          row["error"] = f"skipped: past --budget-s={budget_s:g}"
        elif variant.unavailable is not None:
          row["error"] = f"unavailable: {variant.unavailable}"
        else:
          args, err, ref = inputs_for(shape)
          if ref is not None:
            row["ref_loss"] = ref
          if args is None:
            row["error"] = err
          else:
            try:
              row.update(measure(variant, pass_, shape, args, preset))
              if ref is not None:
                row["loss_rel_err"] = abs(row["loss"] - ref) / max(abs(ref), 1e-30)
            except Exception as e:  # noqa: BLE001 - OOM, unsupported option, compile failure: record, go on
              row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        emit(row)
  log(f"# done in {time.monotonic() - start:.1f} s")
  return path


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--preset", choices=sorted(shapes_lib.PRESETS), default="llm")
  p.add_argument("--impls", default=None,
                 help="comma-separated: any of lce_flax.IMPLEMENTATIONS and tokamax_xla, tokamax_chunked_xla "
                 "(default: every available implementation, and tokamax's if it imports)")
  p.add_argument("--modes", default="fast,lean", help="modes of implementations that have both (default fast,lean)")
  p.add_argument("--out", default=None, help="output folder (default: $OUT, else /tmp/lce_bench/<preset>)")
  p.add_argument("--budget-s", type=float, default=None,
                 help="stop measuring after this many seconds; the rest is recorded as skipped")
  p.add_argument("--passes", default=None,
                 help="comma-separated subset of fwd,fwdbwd for every shape (default: the preset's)")
  p.add_argument("--order", choices=("impl", "shape"), default="impl",
                 help="impl: each implementation over all shapes in turn (a budget cut drops the last "
                 "implementations); shape: all implementations at each shape in turn")
  p.add_argument("--interpret", action="store_true",
                 help="run Pallas kernels in interpret mode (CPU check of the harness; times mean nothing)")
  p.add_argument("--no-report", action="store_true", help="write JSON lines only (no markdown, no plots)")
  return p.parse_args(argv)


def main(argv=None) -> int:
  a = parse_args(argv)
  preset = shapes_lib.PRESETS[a.preset]
  if a.passes:
    passes = tuple(x for x in a.passes.split(",") if x)
    if not passes or any(x not in PASSES for x in passes):
      raise SystemExit(f"--passes: {a.passes!r} must be a comma-separated subset of {PASSES}")
    preset = dataclasses.replace(preset, passes=passes, sweep_passes=passes)
  modes = tuple(m for m in a.modes.split(",") if m)
  for m in modes:
    if m not in ("fast", "lean"):
      raise SystemExit(f"--modes: {m!r} is not 'fast' or 'lean'")
  impls = None if a.impls in (None, "", "all") else [s for s in a.impls.split(",") if s]
  out_dir = a.out or os.environ.get("OUT") or os.path.join("/tmp/lce_bench", preset.name)
  variants, tk_reason = make_variants(impls, modes, a.interpret)
  if tk_reason is not None and impls is None:
    print(f"# tokamax not measured: {tk_reason}")
  signal.signal(signal.SIGTERM, _on_sigterm)
  try:
    run(preset, variants, out_dir, a.budget_s, order=a.order)
  except KeyboardInterrupt as e:
    print(f"# interrupted ({e}); writing what was measured")
  if not a.no_report:
    try:
      from benchmarks import plots  # noqa: PLC0415 - matplotlib only when reporting
      for f in plots.report(out_dir):
        print(f"# wrote {f}")
    except Exception:  # noqa: BLE001 - the JSON lines are already on disk
      traceback.print_exc()
      return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
