"""Speed and memory of the plain head, of every available implementation (and of tokamax's, if installed) at LLM
head shapes.

Usage::

  python -m benchmarks.bench [--preset {smoke,llm,sweep}] [--impls plain_bf16,auto,chunked,...] [--modes fast,lean]
                             [--passes fwd,fwdbwd] [--out DIR] [--time-limit-s SECONDS] [--order {impl,shape}]
                             [--interpret] [--no-report]

Rows (``--impls``; the default is all of them that can run here, in this order):

* ``plain_bf16``: the head a Flax model has without this package, ``nn.Dense(V, use_bias=False,
  dtype=jnp.bfloat16)`` followed by ``optax.softmax_cross_entropy_with_integer_labels`` on its [B, V] bf16 logits.
  The baseline of every ratio in the tables.
* ``plain_f32``: the same, with the logits upcast to float32 before optax.
* ``auto``: ``lce_flax.linear_cross_entropy`` with ``impl="auto"``; each row records what it resolved to
  (``design``, from :func:`lce_flax.explain`).
* ``xla``, ``chunked``, ``pallas_triton``, ``triton``, ``pallas_mosaic`` (``lce_flax.IMPLEMENTATIONS``): one row per
  mode for implementations with a fast and a lean design, one row otherwise. ``xla`` holds the float32 logits and
  differentiates them with JAX's autodiff: it is the float32 numerics reference, not a speed baseline.
* ``pallas_triton:low_memory``, ``triton:low_memory``: configuration variants (a third logits pass instead of a
  B×H float32 buffer).
* ``tokamax_xla``, ``tokamax_chunked_xla``: tokamax's ``linear_softmax_cross_entropy_loss``.

For each shape, row and pass (``fwd``: the loss; ``fwdbwd``: the loss and the gradients of x and w) it compiles the
jitted function once, reads the compiled temp memory (``compiled.memory_analysis().temp_size_in_bytes``: the extra
device memory beyond inputs and outputs), runs it once to warm up, then times repeated runs with wall clock around
``jax.block_until_ready`` and records the median. Inputs: bf16 ``x ~ N(0, 1)`` [B, H], ``w = 0.02·N(0, 1)`` [H, V],
labels uniform in [0, V), reduction "sum".

Each measurement is one JSON line in ``DIR/bench_<preset>.jsonl`` (schema in :func:`base_row` and
:func:`measure`), written as soon as it is taken; a row that fails (out of memory, unsupported) gets ``error`` and
the run goes on. Past ``--time-limit-s`` the remaining work is recorded as skipped. At the end
:mod:`benchmarks.plots` turns every ``*.jsonl`` in DIR into ``results.md`` and PNG plots.

TFLOP/s: ``tflops`` is the floor's FLOPs over the time (6·B·H·V for fwdbwd, 2·B·H·V for fwd), so rows compare on
one scale; ``algo_tflops`` uses the FLOPs the design actually does (``flops_factor``·B·H·V: 6 when the gradients
come from logits on hand, 8 for designs that recompute the logits in the backward, 10 for a third pass).

Only the public API of ``lce_flax`` is used (``linear_cross_entropy``, ``explain``, ``available_implementations``,
the ``*Config`` classes).
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
import re
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
from benchmarks import shapes as shapes_lib
from benchmarks.shapes import PEAK_TFLOPS, Preset, Shape

TOKAMAX_IMPLS = ("tokamax_xla", "tokamax_chunked_xla")
BASELINES = ("plain_bf16", "plain_f32")  # the head without lce_flax: bf16 Dense + optax (and its float32 twin)
KERNEL_IMPLS = ("pallas_triton", "triton", "pallas_mosaic")  # the implementations ``interpret`` applies to
# fwd: the loss; fwdbwd: loss and the gradients of x and w; tokens: per-token losses (reduction "none") in a
# weighted sum, and the gradients of x and w (any per-token cotangent); dx: a frozen head, the gradient of x only
PASSES = ("fwd", "fwdbwd", "tokens", "dx")


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
  """What every row carries: device, software versions, date, and the commit measured (``LCE_FLAX_COMMIT``, where
  the job sets it)."""
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
      date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
      commit=os.environ.get("LCE_FLAX_COMMIT"),
  )


# ------------------------------------------------------------------------------------------------- variants


@dataclasses.dataclass(frozen=True)
class Variant:
  """One row kind to measure. ``loss(x, w, labels)`` returns the summed float32 loss.

  ``explain(shape, pass_)``, for lce_flax rows, returns what :func:`lce_flax.explain` says will run at ``shape`` for
  that pass (``"tokens"``: with ``reduction="none"``); the row records it, and its FLOPs factor follows the design
  (``auto`` may resolve differently per shape and pass)."""

  impl: str
  mode: str | None
  loss: Callable[..., jax.Array] | None
  flops_factor: int  # FLOPs of fwd+bwd in units of B·H·V: 6 (gradients from the logits on hand) or 8 (recompute)
  unavailable: str | None = None  # reason, when it cannot run here
  explain: Callable[[Shape], Any] | None = None
  token_loss: Callable[..., jax.Array] | None = None  # (x, w, labels) -> per-token float32 losses, for "tokens"

  @property
  def label(self) -> str:
    return self.impl if self.mode is None else f"{self.impl}:{self.mode}"


def _sds(shape: Shape):
  """The benchmark's x and w as ``jax.ShapeDtypeStruct`` (what ``lce_flax.explain`` needs)."""
  return (jax.ShapeDtypeStruct((shape.B, shape.H), jnp.bfloat16),
          jax.ShapeDtypeStruct((shape.H, shape.V), jnp.bfloat16))


def design_factor(design) -> int:
  """FLOPs of fwd+bwd in units of B·H·V for a design: xla autodiffs stored logits (6), fast designs form the
  gradients from logits on hand (6), lean ones recompute them (8), ``low_memory`` a third time (10)."""
  if design.impl == "xla":
    return 6
  if getattr(design.config, "low_memory", False):
    return 10
  return 6 if design.mode == "fast" else 8


def design_record(design) -> dict[str, Any]:
  """The JSON form of a ``Design`` (its config as a dict of its resolved fields)."""
  config = design.config
  if dataclasses.is_dataclass(config):
    config = {k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
              for k, v in dataclasses.asdict(config).items()}
  elif config is not None:
    config = str(config)
  return dict(impl=design.impl, mode=design.mode, name=design.name, chunking=design.chunking,
              memory_bytes=int(design.memory_bytes), config=config, notes=list(design.notes))


PROBE = Shape("probe", 64, 32, 512)  # a small problem to ask an implementation whether (and how) it runs here


def _lce_variant(impl: str, mode: str | None, interpret: bool, config=None, tag: str | None = None) -> Variant:
  """``linear_cross_entropy(impl=impl, mode=mode)``; unavailable (with the reason) where ``explain`` refuses it.

  Kernel implementations get ``interpret=`` explicitly: on a CPU they are unavailable unless ``--interpret`` is
  given (interpret mode checks the harness drives them; its times mean nothing)."""
  kw: dict[str, Any] = dict(reduction="sum", impl=impl, mode=mode)
  if config is not None:
    kw["config"] = config
  if impl in KERNEL_IMPLS:
    kw["interpret"] = bool(interpret)

  def explain(shape: Shape, pass_: str = "fwdbwd"):
    return lce_flax.explain(*_sds(shape), **(dict(kw, reduction="none") if pass_ == "tokens" else kw))

  label_mode = tag or mode
  try:
    design = explain(PROBE)
  except Exception as e:  # noqa: BLE001 - NotImplementedError (cannot run here), ValueError (option refused)
    return Variant(impl, label_mode, None, 6, f"{type(e).__name__}: {e}")
  return Variant(impl, label_mode, functools.partial(lce_flax.linear_cross_entropy, **kw), design_factor(design),
                 explain=explain,
                 token_loss=functools.partial(lce_flax.linear_cross_entropy, **dict(kw, reduction="none")))


def _lce_variants(name: str, modes: tuple[str, ...], interpret: bool = False) -> list[Variant]:
  """``impl=name`` once per mode where the implementation has a fast design, else once (mode None). ``xla``
  runs one computation in both modes (autodiff through its float32 logits): one row."""
  if name in ("auto", "xla"):
    return [_lce_variant(name, None, interpret)]
  fast = _lce_variant(name, "fast", interpret)
  if fast.unavailable is not None:  # no fast design (or not available at all): one row, the default design
    return [_lce_variant(name, None, interpret)]
  return [fast if m == "fast" else _lce_variant(name, m, interpret) for m in modes]


# Configurations measured as rows of their own: name -> (impl, the ``*Config`` class, its fields).
# ``low_memory``: a third logits pass instead of the B×H float32 dx accumulator (≤ 64 MB at the LLM shapes).
# ``pallas_mosaic:<design>``: its fast design named; ``:kernels_ws``: the fast forward on the warp-specialised kernel
# of kernels_ws.py instead of the persistent GEMM; ``:xla_products`` / ``:gemm_products``: both backward products
# on XLA's GEMMs / on ours (the default picks each by the tuning table); ``:tokens<N>`` (any N, a multiple of 128):
# the "tokens" design in chunks of N tokens; ``:lean<N>`` (a multiple of 256): lean mode in chunks of N columns;
# ``:shifted``: the stored tiles as logits shifted by their row max and a dz pass (not the exponentials);
# ``:lean_kernels_ws``: lean mode on the kernels of kernels_ws.py instead of the persistent GEMM.
CONFIG_VARIANTS = {"pallas_triton:low_memory": ("pallas_triton", "PallasTritonConfig", {"low_memory": True}),
                   "triton:low_memory": ("triton", "TritonConfig", {"low_memory": True}),
                   "pallas_mosaic:logits": ("pallas_mosaic", "PallasMosaicConfig", {"fast_design": "logits"}),
                   "pallas_mosaic:tokens": ("pallas_mosaic", "PallasMosaicConfig", {"fast_design": "tokens"}),
                   "pallas_mosaic:kernels_ws": ("pallas_mosaic", "PallasMosaicConfig", {"gemm": False}),
                   "pallas_mosaic:xla_products": ("pallas_mosaic", "PallasMosaicConfig", {"products": "xla"}),
                   "pallas_mosaic:gemm_products": ("pallas_mosaic", "PallasMosaicConfig", {"products": "gemm"}),
                   "pallas_mosaic:shifted": ("pallas_mosaic", "PallasMosaicConfig", {"stored": "shifted"}),
                   "pallas_mosaic:lean_kernels_ws": ("pallas_mosaic", "PallasMosaicConfig", {"gemm": False})}


_TOKEN_CHUNK_VARIANT = re.compile(r"pallas_mosaic:tokens(\d+)")
_VOCAB_CHUNK_VARIANT = re.compile(r"pallas_mosaic:lean(\d+)")


def _config_of(name: str):
  """(impl, config class, fields) of a configuration row: :data:`CONFIG_VARIANTS`, ``pallas_mosaic:tokens<N>`` or
  ``pallas_mosaic:lean<N>``; None for any other name."""
  if name in CONFIG_VARIANTS:
    return CONFIG_VARIANTS[name]
  m = _TOKEN_CHUNK_VARIANT.fullmatch(name)
  if m:
    return "pallas_mosaic", "PallasMosaicConfig", {"fast_design": "tokens", "token_chunk": int(m.group(1))}
  m = _VOCAB_CHUNK_VARIANT.fullmatch(name)
  if m:
    return "pallas_mosaic", "PallasMosaicConfig", {"vocab_chunk": int(m.group(1))}
  return None


def _config_variant(name: str, interpret: bool = False) -> Variant:
  impl, cls, fields = _config_of(name)
  tag = name.split(":", 1)[1]
  try:
    config = getattr(lce_flax, cls)(**fields)
  except Exception as e:  # noqa: BLE001 - e.g. the backend's optional dependency is missing
    return Variant(impl, tag, None, 10, f"{type(e).__name__}: {e}")
  # (":lean<N>" and ":lean_kernels_ws" are lean mode's rows)
  return _lce_variant(impl, "lean" if tag.startswith("lean") else None, interpret, config=config, tag=tag)


def _plain_variant(name: str, logit_softcap: float | None = None) -> Variant:
  """The head without this package: ``nn.Dense(V, dtype=bfloat16)`` and optax on its [B, V] logits.

  ``plain_bf16`` hands optax the bf16 logits as they come out of the Dense (so its per-token losses are bf16);
  ``plain_f32`` upcasts them to float32 first. The per-token losses are summed in float32, so that
  ``loss_rel_err`` shows the logits' precision, not the rounding of one bf16 scalar. ``logit_softcap``: the logits
  go through ``cap·tanh(logits/cap)`` first, in their dtype, as Gemma 2's Flax head does."""
  import flax.linen as nn  # noqa: PLC0415
  import optax  # noqa: PLC0415

  upcast = name == "plain_f32"

  def token_loss(x, w, labels):
    dense = nn.Dense(w.shape[1], use_bias=False, dtype=jnp.bfloat16)
    logits = dense.apply({"params": {"kernel": w}}, x)
    if upcast:
      logits = logits.astype(jnp.float32)
    if logit_softcap is not None:
      logits = jnp.tanh(logits / logit_softcap) * logit_softcap
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).astype(jnp.float32)

  def loss(x, w, labels):
    return jnp.sum(token_loss(x, w, labels), dtype=jnp.float32)

  return Variant(name, None, loss, 6, token_loss=token_loss)


def _tokamax_variant(name: str, tokamax, reason: str | None) -> Variant:
  impl = name.removeprefix("tokamax_")
  # tokamax's xla path autodiffs the stored logits; chunked_xla keeps the [B] lse and recomputes.
  factor = 6 if impl == "xla" else 8
  if tokamax is None:
    return Variant(name, None, None, factor, reason)

  def loss(x, w, labels):
    return tokamax.linear_softmax_cross_entropy_loss(x, labels, w, reduction="sum", implementation=impl)

  return Variant(name, None, loss, factor)


def default_impls(tokamax_available: bool) -> list[str]:
  """The default rows: the plain heads, ``auto``, every implementation available here, tokamax's if it imports."""
  return [*BASELINES, "auto", *lce_flax.available_implementations(),
          *(TOKAMAX_IMPLS if tokamax_available else ())]


def make_variants(impls: list[str] | None, modes: tuple[str, ...],
                  interpret: bool = False) -> tuple[list[Variant], str | None]:
  """Variants for ``impls`` (None: :func:`default_impls`).

  Returns the variants and, when tokamax was wanted but does not import, why.
  """
  tokamax, reason = None, None
  if impls is None or any(n in TOKAMAX_IMPLS for n in impls):
    tokamax, reason = import_tokamax()
  if impls is None:
    impls = default_impls(tokamax is not None)
  known = [*BASELINES, "auto", *lce_flax.IMPLEMENTATIONS, *CONFIG_VARIANTS, *TOKAMAX_IMPLS]
  for name in impls:
    if name not in known and _config_of(name) is None:
      raise ValueError(f"--impls: {name!r} is not one of {known}, 'pallas_mosaic:tokens<N>' or "
                       "'pallas_mosaic:lean<N>'")
  variants = []
  for name in impls:
    if name in BASELINES:
      variants.append(_plain_variant(name))
    elif name in TOKAMAX_IMPLS:
      variants.append(_tokamax_variant(name, tokamax, reason))
    elif _config_of(name) is not None:
      variants.append(_config_variant(name, interpret))
    else:
      variants.extend(_lce_variants(name, modes, interpret))
  return variants, reason


# --------------------------------------------------------------------------------------------------- inputs


def make_inputs(shape: Shape, seed: int = 0):
  """bf16 x ~ N(0,1) [B, H], w = 0.02·N(0,1) [H, V], labels uniform int32 [B]."""
  kx, kw, ky = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(kx, (shape.B, shape.H), jnp.bfloat16)
  w = (0.02 * jax.random.normal(kw, (shape.H, shape.V), jnp.float32)).astype(jnp.bfloat16)
  y = jax.random.randint(ky, (shape.B,), 0, shape.V, jnp.int32)
  return jax.block_until_ready((x, w, y))


@functools.partial(jax.jit, static_argnames="chunk")
def reference_losses(x, w, labels, chunk: int = 8192):
  """Per-token cross-entropy [B] in float32 with full-precision ("highest") dots, vocabulary chunk by chunk so that
  no [B, V] array is formed; independent of every implementation under test. A pass's reference loss is their sum
  (the "tokens" pass: their weighted sum)."""
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
  return lse - target


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


def token_weights(n: int) -> jax.Array:
  """The per-token cotangents of the "tokens" pass: fixed weights in [0.5, 1.5) (a weighted sum, as an RL or
  distillation loss takes it)."""
  return 0.5 + jax.random.uniform(jax.random.key(7), (n,), jnp.float32)


def measure(variant: Variant, pass_: str, shape: Shape, args, preset: Preset) -> dict[str, Any]:
  """One row: times, memory and loss of ``variant`` on ``args`` for ``pass_`` ("fwd" or "fwdbwd")."""
  if pass_ == "fwd":
    fn = variant.loss
  elif pass_ == "dx":
    fn = jax.value_and_grad(variant.loss, argnums=0)
  elif pass_ == "tokens":
    if variant.token_loss is None:
      raise NotImplementedError(f"{variant.label} has no per-token losses here")
    weights = token_weights(args[2].shape[0])
    fn = jax.value_and_grad(lambda x, w, y: jnp.sum(weights * variant.token_loss(x, w, y)), argnums=(0, 1))
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
  floor_factor = {"fwd": 2, "dx": 4}.get(pass_, 6)
  algo_factor = {"fwd": 2, "dx": 4}.get(pass_, variant.flops_factor)
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
  if pass_ == "dx":
    row["dx_norm"] = float(_norm(out[1]))
  if pass_ in ("fwdbwd", "tokens"):
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


def run(preset: Preset, variants: list[Variant], out_dir: str, time_limit_s: float | None = None,
        log: Callable[[str], None] = print, order: str = "impl") -> str:
  """Measures everything of ``preset``; returns the path of the JSON-lines file.

  ``order="impl"`` runs each variant over every shape before the next variant (the default: ``variants`` come in
  order of importance, so a time-limit cut drops the least important); ``"shape"`` runs every variant at each
  shape.
  """
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, f"bench_{preset.name}.jsonl")
  env = environment()
  start = time.monotonic()
  log(f"# {env['device']} ({env['platform']}), jax {env['jax']}, preset {preset.name}, "
      f"variants {[v.label for v in variants]}, time limit {time_limit_s} s -> {path}")
  with open(path, "w") as fh:

    def emit(row):
      fh.write(json.dumps(row) + "\n")
      fh.flush()
      if "error" in row:
        log(f"{row['shape']:>24} {row['label']:>24} {row['pass']:>6}  ERROR {row['error'][:160]}")
      else:
        log(f"{row['shape']:>24} {row['label']:>24} {row['pass']:>6} {row['ms']:9.2f} ms "
            f"{row['tflops']:6.1f} TF/s  temp {(row['temp_bytes'] or 0) / 1e9:6.2f} GB  loss {row['loss']:.6g}"
            f"  rel.err {row.get('loss_rel_err', float('nan')):.1e}")

    problems = shapes_lib.preset_shapes(preset)
    if order == "impl":  # each implementation over every shape: a time-limit cut loses the last implementations
      work = [(p, v) for v in variants for p in problems]
    elif order == "shape":  # every implementation at each shape: a time-limit cut loses the last shapes
      work = [(p, v) for p in problems for v in variants]
    else:
      raise ValueError(f"order={order!r} must be 'impl' or 'shape'")
    held: dict[str, Any] = {"name": None, "args": None, "err": None}  # inputs of one shape at a time
    refs: dict[str, dict[str, float]] = {}  # shape -> {"sum": its reference loss, "tokens": the weighted sum}

    def inputs_for(shape: Shape, pass_: str):
      if held["name"] != shape.name:
        held.update(name=shape.name, args=None, err=None)
        try:
          held["args"] = make_inputs(shape)  # deterministic: the same inputs whenever a shape comes back
          if preset.reference and shape.name not in refs:
            losses = reference_losses(*held["args"])
            refs[shape.name] = {"sum": float(jnp.sum(losses)),
                                "tokens": float(jnp.sum(token_weights(losses.shape[0]) * losses))}
        except Exception as e:  # noqa: BLE001 - e.g. the inputs themselves do not fit
          held.update(args=None, err=f"inputs: {type(e).__name__}: {str(e)[:300]}")
      ref = refs.get(shape.name)
      return held["args"], held["err"], None if ref is None else ref["tokens" if pass_ == "tokens" else "sum"]

    for (shape, axis, passes), variant_ in work:
      for pass_ in passes:
        design, variant = None, variant_
        if variant.explain is not None and variant.unavailable is None:
          try:  # (per pass: per-token losses may take another design)
            design = variant.explain(shape, pass_)
            variant = dataclasses.replace(variant, flops_factor=design_factor(design))
          except Exception as e:  # noqa: BLE001 - the run below will say what fails
            design = f"{type(e).__name__}: {str(e)[:300]}"
        row = base_row(env, preset, shape, axis, variant, pass_)
        if isinstance(design, str):
          row["design_error"] = design
        elif design is not None:
          row["design"] = design_record(design)
          row["resolved"] = f"{design.impl}:{design.mode}"
        if time_limit_s is not None and time.monotonic() - start > time_limit_s:
          row["error"] = f"skipped: past --time-limit-s={time_limit_s:g}"
        elif variant.unavailable is not None:
          row["error"] = f"unavailable: {variant.unavailable}"
        else:
          args, err, ref = inputs_for(shape, pass_)
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
                 help="comma-separated: plain_bf16, plain_f32, auto, any of lce_flax.IMPLEMENTATIONS, "
                 "pallas_triton:low_memory, triton:low_memory, tokamax_xla, tokamax_chunked_xla (default: the plain "
                 "heads, auto, every implementation available here, and tokamax's if it imports)")
  p.add_argument("--modes", default="fast,lean", help="modes of implementations that have both (default fast,lean)")
  p.add_argument("--out", default=None, help="output folder (default: $OUT, else /tmp/lce_bench/<preset>)")
  p.add_argument("--time-limit-s", type=float, default=None,
                 help="stop measuring after this many seconds; the rest is recorded as skipped")
  p.add_argument("--passes", default=None,
                 help="comma-separated subset of fwd,fwdbwd for every shape (default: the preset's)")
  p.add_argument("--order", choices=("impl", "shape"), default="impl",
                 help="impl: each implementation over all shapes in turn (a time-limit cut drops the last "
                 "implementations); shape: all implementations at each shape in turn")
  p.add_argument("--interpret", action="store_true",
                 help="run Pallas kernels in interpret mode (CPU check of the harness; times mean nothing)")
  p.add_argument("--no-report", action="store_true", help="write JSON lines only (no markdown, no plots)")
  p.add_argument("--shapes", default=None, help="comma-separated names of the preset's shapes to run (default: all)")
  return p.parse_args(argv)


def main(argv=None) -> int:
  a = parse_args(argv)
  preset = shapes_lib.PRESETS[a.preset]
  if a.passes:
    passes = tuple(x for x in a.passes.split(",") if x)
    if not passes or any(x not in PASSES for x in passes):
      raise SystemExit(f"--passes: {a.passes!r} must be a comma-separated subset of {PASSES}")
    preset = dataclasses.replace(preset, passes=passes, sweep_passes=passes)
  if a.shapes:
    names = [x for x in a.shapes.split(",") if x]
    unknown = sorted(set(names) - {s.name for s in preset.shapes})
    if unknown or not names:
      raise SystemExit(f"--shapes: {unknown or a.shapes!r} not among {[s.name for s in preset.shapes]}")
    preset = dataclasses.replace(preset, shapes=tuple(s for s in preset.shapes if s.name in names), sweeps=())
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
    run(preset, variants, out_dir, a.time_limit_s, order=a.order)
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
