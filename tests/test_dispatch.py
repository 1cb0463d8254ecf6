"""Dispatch: which implementation runs where, every fallback visible in ``explain``, configs and options checked,
bad input refused with errors naming the argument; and every GPU path forced on a GPU that can run it."""

from __future__ import annotations

import importlib.util
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lce_flax
from lce_flax import LossOptions, _device, _math, explain, linear_cross_entropy
from lce_flax._impl import base, common
from tests._checks import check_impl, make_inputs
from tests.reference_np import linear_cross_entropy_np, rel_err

S = jax.ShapeDtypeStruct
LLAMA = dict(x=S((8192, 4096), jnp.bfloat16), w=S((4096, 128256), jnp.bfloat16))


@pytest.fixture
def fake_gpu(monkeypatch):
  def set_cc(cc):
    monkeypatch.setattr(_device, "platform", lambda: "gpu")
    monkeypatch.setattr(_device, "compute_capability", lambda: cc)
    monkeypatch.setattr(_device, "default_interpret", lambda: False)
  return set_cc


@pytest.mark.parametrize("cc,first", [((9, 0), "pallas_mosaic"), ((8, 0), "pallas_triton"), ((7, 5), "chunked")])
def test_auto_order_by_compute_capability(fake_gpu, cc, first):
  fake_gpu(cc)
  assert base.auto_order()[0] == first
  assert base.auto_order()[-1] == "chunked"


def test_auto_on_cpu_is_chunked_fast():
  d = explain(**LLAMA)
  assert (d.impl, d.mode, d.name) == ("chunked", "fast", "token_chunks")
  assert d.chunking == "token chunks of 2048 tokens" and d.config == lce_flax.ChunkedConfig(token_chunk=2048)
  d = explain(**LLAMA, reduction="none")
  assert (d.impl, d.mode, d.name) == ("chunked", "lean", "recompute")


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_auto_on_tpu_exports_plain_stablehlo(monkeypatch, reduction):
  """On a TPU ``auto`` routes to ``chunked`` (pure JAX), so the op and its gradients lower for TPU as plain StableHLO
  (no custom call, no host callback): exported for TPU and CPU at once, the CPU half of the same module gives the
  float64 oracle's loss and gradients of x and w (bf16 inputs, ignored tokens, ragged sizes)."""
  from jax import export

  monkeypatch.setattr(_device, "platform", lambda: "tpu")
  (x, w, y, _), (xn, wn, yn, _) = make_inputs(5, (3, 29), 48, 517, jnp.bfloat16)
  assert (explain(x, w, y, reduction=reduction).impl, base.auto_order()[0]) == ("chunked", "chunked")
  rng = np.random.default_rng(6)
  cot = rng.standard_normal(y.shape).astype(np.float32) if reduction == "none" else None

  def step(x, w):
    loss = linear_cross_entropy(x, w, y, reduction=reduction)
    return (loss * cot).sum() if reduction == "none" else loss

  exp = export.export(jax.jit(jax.value_and_grad(step, (0, 1))), platforms=["tpu", "cpu"])(x, w)
  text = exp.mlir_module()
  assert exp.platforms == ("tpu", "cpu") and "custom_call" not in text and "callback" not in text
  loss, (dx, dw) = exp.call(x, w)
  ref = linear_cross_entropy_np(xn, wn, yn, reduction=reduction, cotangent=cot)
  want = (ref["token_loss"] * cot).sum() if reduction == "none" else ref["loss"]
  assert abs(float(loss) - want) <= 2e-5 * abs(want)
  assert rel_err(dx, ref["dx"]) <= 2e-2 and rel_err(dw, ref["dw"]) <= 2e-2


def test_auto_on_hopper_says_what_runs(fake_gpu):
  fake_gpu((9, 0))
  d = explain(**LLAMA)
  assert (d.impl, d.mode) == ("pallas_mosaic", "fast")
  assert d.memory_bytes > 8192 * 128256 * 2  # the stored bf16 logits are the bound of the "logits" design
  lean = explain(**LLAMA, mode="lean")
  assert (lean.impl, lean.mode) == ("pallas_mosaic", "lean") and lean.memory_bytes < d.memory_bytes / 4
  # float32 inputs: WGMMA has no float32 operands, pallas_triton has no fast design: chunked, and it says so
  f32 = explain(S((8192, 4096), jnp.float32), S((4096, 128256), jnp.float32))
  assert f32.impl == "chunked" and any("pallas_mosaic" in n for n in f32.notes)
  # mixed precision asked for: the bf16 kernels, and the cast is in the notes
  mixed = explain(S((8192, 4096), jnp.bfloat16), S((4096, 128256), jnp.float32), dtype=jnp.bfloat16)
  assert mixed.impl == "pallas_mosaic" and any("cast to bfloat16" in n for n in mixed.notes)


def test_reduction_none_runs_a_fast_design_that_takes_token_cotangents(fake_gpu):
  """Per-token losses (mode=None) run the "logits" fast design on Hopper, also where the memory rule picks the
  "tokens" design for a mean (gpt2-small: many tokens, small H), and the notes say why and what it holds; a
  design or a token chunk the user chose is kept (the lean design then runs)."""
  fake_gpu((9, 0))
  gpt2 = dict(x=S((16384, 768), jnp.bfloat16), w=S((768, 50304), jnp.bfloat16))
  assert explain(**gpt2).name == "tokens"
  d = explain(**gpt2, reduction="none")
  assert (d.impl, d.mode, d.name) == ("pallas_mosaic", "fast", "logits")
  assert d.memory_bytes >= 16384 * 50304 * 2
  assert any("reduction='none'" in n and "mode='lean' takes less" in n for n in d.notes)
  llama = explain(**LLAMA, reduction="none")
  assert llama.name == "logits" and not any("mode='lean' takes less" in n for n in llama.notes)
  chosen = explain(**gpt2, reduction="none", impl="pallas_mosaic",
                   config=lce_flax.PallasMosaicConfig(fast_design="tokens"))
  assert (chosen.mode, chosen.name) == ("lean", "recompute")


def test_fast_mode_with_reduction_none_says_which_design_runs(fake_gpu):
  """mode='fast' with reduction='none' runs the fast design that takes per-token cotangents (Hopper's 'logits'),
  picked as for mode=None (also where the sizes' default is 'tokens'), and explain() names it and why; where there
  is none (a design or token chunk chosen, float32 inputs, a split vocabulary, no fast design) the error says why
  and what to use instead."""
  fake_gpu((9, 0))
  gpt2 = dict(x=S((16384, 768), jnp.bfloat16), w=S((768, 50304), jnp.bfloat16))
  fast_none = dict(mode="fast", reduction="none")
  for impl in ("pallas_mosaic", "auto"):
    d = explain(**gpt2, impl=impl, **fast_none)
    assert (d.impl, d.mode, d.name) == ("pallas_mosaic", "fast", "logits") and d.config.token_cotangents
    assert d.memory_bytes >= 16384 * 50304 * 2  # it holds the B×V logits, and says so
    assert any(n.startswith("mode='fast', reduction='none': the 'logits' fast design forms dz in its backward")
               and "mode='lean' takes less" in n for n in d.notes), d.notes
    llama = explain(**LLAMA, impl=impl, **fast_none)
    assert llama.name == "logits" and any(n.startswith("mode='fast', reduction='none'") for n in llama.notes)
    assert not any("mode='lean' takes less" in n for n in llama.notes)
  start = r"^mode='fast' with reduction='none' needs a fast design that takes per-token cotangents, and "
  with pytest.raises(ValueError, match=start + r"impl='pallas_mosaic' has none here: config fast_design='tokens' "
                                               r"chooses its 'tokens' fast design.*drop config fast_design='tokens'"):
    explain(**gpt2, impl="pallas_mosaic", config=lce_flax.PallasMosaicConfig(fast_design="tokens"), **fast_none)
  # no design both loops over tokens and takes per-token cotangents (auto: every candidate skipped but the last)
  with pytest.raises(ValueError, match=start + r"impl='pallas_mosaic' has none here: token_chunk=4096 chooses its "
                                               r"'tokens' fast design.*no token loop.*drop token_chunk=4096"):
    explain(**LLAMA, impl="pallas_mosaic", token_chunk=4096, **fast_none)
  with pytest.raises(ValueError, match=start + r"impl='auto' \(which picks 'chunked' here\).*token_chunk=4096 is for "
                                               r"the fast designs that loop over tokens.*skipped: pallas_mosaic: .*"
                                               r"token_chunk=4096 chooses its 'tokens' fast design.*no token loop"):
    explain(**LLAMA, token_chunk=4096, **fast_none)
  f32 = dict(x=S((8192, 4096), jnp.float32), w=S((4096, 128256), jnp.float32))
  with pytest.raises(ValueError, match=start + r"impl='auto' \(which picks 'chunked' here\) has none here: its "
                                               r"'token_chunks' fast design forms the gradients in its forward.*"
                                               r"skipped: pallas_mosaic: .*WGMMA.*impl='pallas_mosaic' on a Hopper"):
    explain(**f32, **fast_none)
  with pytest.raises(ValueError, match=start + r"impl='pallas_mosaic' has none here: w's vocabulary is split over 2"):
    explain(**LLAMA, impl="pallas_mosaic", vocab_shards=2, **fast_none)
  d = explain(**LLAMA, impl="xla", **fast_none)  # autodiff takes any cotangent: one computation for both modes
  assert (d.mode, d.name) == ("fast", "autodiff") and any("autodiff" in n and "per-token" in n for n in d.notes)
  fake_gpu((8, 0))
  with pytest.raises(ValueError, match=start + r"impl='pallas_triton' has none here: it has no fast design; use "
                                               r"mode=None or mode='lean'"):
    explain(**LLAMA, impl="pallas_triton", **fast_none)


@pytest.mark.parametrize("impl,kw", [("chunked", {}), ("pallas_triton", dict(interpret=True)), ("auto", {}),
                                     ("chunked", dict(token_chunk=16)),
                                     ("pallas_mosaic", dict(interpret=True, token_chunk=64))])
def test_fast_mode_with_reduction_none_refuses_at_trace_time(impl, kw):
  """mode='fast' with reduction='none' where the impl (auto's pick on CPU: chunked) has no fast design that takes
  per-token cotangents: a ValueError at trace time, under jit and eagerly, naming reduction='none', the impl and
  what to use instead; never a silent lean run."""
  (x, w, y, _), _ = make_inputs(90, (37,), 64, 301, jnp.bfloat16)
  f = lambda x, w: linear_cross_entropy(x, w, y, mode="fast", reduction="none", impl=impl, **kw)
  who = rf"impl='{impl}'" if impl != "auto" else r"impl='auto' \(which picks 'chunked' here\)"
  match = (rf"^mode='fast' with reduction='none' needs a fast design that takes per-token cotangents, and {who} has "
           r"none here: .*use mode=None or mode='lean'")
  with pytest.raises(ValueError, match=match) as e:
    jax.jit(lambda x, w: jax.vjp(f, x, w)[0]).trace(x, w)
  if "token_chunk" in kw:
    assert f"token_chunk={kw['token_chunk']}" in str(e.value) and "vocab_chunk" in str(e.value)
  with pytest.raises(ValueError, match=match):
    f(x, w)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_fast_mode_with_reduction_none_on_xla_is_autodiff(dtype):
  """impl='xla' is JAX's autodiff (one computation for both modes): mode='fast' with reduction='none' runs it, and
  the per-token losses and the vjp of a random per-token cotangent equal the float64 oracle's."""
  check_impl("xla", seed=91 + (dtype == jnp.float32), batch_shape=(3, 13), h=24, v=301, dtype=dtype, bias=True,
             where=True, reduction="none", options=dict(z_loss=1e-3, logit_softcap=5.0), mode="fast")


def test_sm80_lean_kernels_and_fast_fallback_are_visible(fake_gpu):
  fake_gpu((8, 0))
  assert explain(**LLAMA, mode="lean").impl == "pallas_triton"
  fast = explain(**LLAMA)
  assert (fast.impl, fast.mode) == ("chunked", "fast")
  assert any("pallas_triton" in n for n in fast.notes)
  # asked for by name with the default mode: the backend's own (lean) design, said in the notes
  named = explain(**LLAMA, impl="pallas_triton")
  assert (named.impl, named.mode) == ("pallas_triton", "lean") and any("no fast design" in n for n in named.notes)
  with pytest.raises(ValueError, match="impl='pallas_triton' has no fast design"):
    explain(**LLAMA, impl="pallas_triton", mode="fast")


def test_vocab_parallel_designs_are_visible(fake_gpu):
  """A vocabulary split over devices: auto's fast design is the chunked token loop (the kernels have no
  vocab-parallel fast design, and the skip is in the notes), lean runs the kernels on V/t columns; a kernel asked
  for with mode="fast" is an error; the design and memory are one device's."""
  fake_gpu((9, 0))
  fast = explain(**LLAMA, vocab_shards=2)
  assert (fast.impl, fast.mode) == ("chunked", "fast")
  assert any("no vocab-parallel fast design" in n for n in fast.notes)
  assert any("each of 2 devices runs 64128 columns" in n for n in fast.notes)
  lean = explain(**LLAMA, vocab_shards=2, mode="lean")
  assert (lean.impl, lean.mode) == ("pallas_mosaic", "lean")
  assert lean.memory_bytes <= explain(**LLAMA, mode="lean").memory_bytes
  named = explain(**LLAMA, vocab_shards=4, impl="pallas_mosaic")
  assert (named.impl, named.mode) == ("pallas_mosaic", "lean") and any("vocab-parallel" in n for n in named.notes)
  with pytest.raises(ValueError, match="impl='pallas_mosaic' has no vocab-parallel fast design"):
    explain(**LLAMA, vocab_shards=2, impl="pallas_mosaic", mode="fast")
  with pytest.raises(ValueError, match="vocab_shards=5 must be a positive int dividing V=128256"):
    explain(**LLAMA, vocab_shards=5)


def test_explicit_impl_that_cannot_run_names_reason_and_alternatives():
  with pytest.raises(ValueError, match=r"pallas_mosaic: .*implementations that can run bfloat16 inputs: "
                                       r"\[.*'xla'.*'chunked'"):
    explain(**LLAMA, impl="pallas_mosaic", interpret=False)


def test_config_must_belong_to_its_impl():
  with pytest.raises(TypeError, match="is a lce_flax.PallasTritonConfig; impl='chunked' takes a "
                                      "lce_flax.ChunkedConfig"):
    explain(**LLAMA, impl="chunked", config=lce_flax.PallasTritonConfig())
  with pytest.raises(ValueError, match="needs the impl it belongs to"):
    LossOptions(config=lce_flax.ChunkedConfig(vocab_chunk=64))
  with pytest.raises(ValueError, match="set the chunk inside the config"):
    LossOptions(impl="chunked", token_chunk=8, config=lce_flax.ChunkedConfig(token_chunk=64))
  assert explain(**LLAMA, impl="chunked", config=lce_flax.ChunkedConfig(token_chunk=512)).config.token_chunk == 512


def test_options_object_replace_and_errors():
  o = LossOptions(z_loss=1e-4, logit_softcap=30.0)
  assert o.replace(logit_softcap=None).logit_softcap is None and o.replace().z_loss == 1e-4
  assert LossOptions(dtype="bfloat16") == LossOptions(dtype=jnp.bfloat16)
  hash(LossOptions(dtype=jnp.float32, config=None))
  with pytest.raises(TypeError, match=r"unknown loss option\(s\) \['zloss'\]"):
    o.replace(zloss=1.0)
  with pytest.raises(dataclasses_error()):
    o.z_loss = 1.0
  with pytest.raises(TypeError, match="options must be a lce_flax.LossOptions"):
    linear_cross_entropy(jnp.ones((2, 4)), jnp.ones((4, 5)), jnp.zeros(2, int), options={"z_loss": 1.0})


def dataclasses_error():
  import dataclasses
  return dataclasses.FrozenInstanceError


@pytest.mark.parametrize("impl,extra,reduction", [
    (impl, extra, reduction)
    for impl, extra in [("xla", {}), ("chunked", dict(mode="fast")), ("chunked", dict(mode="lean")),
                        ("pallas_triton", dict(interpret=True))]
    for reduction in ("mean", "sum", "none")
    if not (reduction == "none" and extra.get("mode") == "fast")])  # refused by LossOptions (tests/test_api.py)
def test_empty_batch_is_all_ignored(impl, extra, reduction):
  """B = 0: loss 0 (an empty array for "none"), zero gradients, on every implementation."""
  x, w, b = jnp.ones((0, 8)), jnp.ones((8, 10)), jnp.ones((10,))
  y = jnp.zeros((0,), jnp.int32)
  f = lambda x, w, b: linear_cross_entropy(x, w, y, bias=b, impl=impl, reduction=reduction, **extra)
  out = f(x, w, b)
  assert out.shape == ((0,) if reduction == "none" else ()) and not np.any(out)
  grads = jax.grad(lambda *a: f(*a).sum(), (0, 1, 2))(x, w, b)
  assert grads[0].shape == (0, 8) and not np.any(grads[1]) and not np.any(grads[2])
  loss, aux = linear_cross_entropy(x, w, y, impl=impl, return_aux=True, reduction=reduction, **extra)
  assert int(aux.num_tokens) == 0 and aux.token_loss.shape == (0,)


def test_numeric_where_mask_equals_bool():
  (x, w, y, _), (xn, wn, yn, _) = make_inputs(11, (23,), 16, 50, jnp.float32)
  mask = np.random.default_rng(12).random(23) < 0.6
  want = linear_cross_entropy_np(xn, wn, yn, where=mask)["loss"]
  for m in (jnp.asarray(mask), jnp.asarray(mask, jnp.int32), jnp.asarray(mask, jnp.float32)):
    assert rel_err(linear_cross_entropy(x, w, y, where=m), want) < 1e-5


def test_dtype_option_casts_and_gradients_keep_input_dtypes():
  """dtype=bf16 with float32 inputs: the loss of the bf16-rounded inputs; gradients return in float32."""
  (x, w, y, _), (xn, wn, yn, _) = make_inputs(13, (31,), 24, 70, jnp.float32)
  up = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))
  loss, (dx, dw) = jax.value_and_grad(lambda x, w: linear_cross_entropy(x, w, y, dtype=jnp.bfloat16), (0, 1))(x, w)
  want = linear_cross_entropy_np(up(xn), up(wn), yn)
  assert rel_err(loss, want["loss"]) < 1e-5
  assert dx.dtype == jnp.float32 and dw.dtype == jnp.float32
  assert rel_err(dx, want["dx"]) < 2e-2 and rel_err(dw, want["dw"]) < 2e-2


def test_promotion_to_float32_on_a_gpu_warns_once(fake_gpu):
  fake_gpu((7, 5))  # chunked runs anywhere; the warning is about the dtype, not the backend
  base._WARNED.clear()
  x, w, y = jnp.ones((4, 8), jnp.bfloat16), jnp.ones((8, 10), jnp.float32), jnp.zeros(4, jnp.int32)
  with pytest.warns(UserWarning, match="dtype=jnp.bfloat16"):
    linear_cross_entropy(x, w, y, impl="chunked")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    linear_cross_entropy(x, w, y, impl="chunked")  # once
    linear_cross_entropy(x, w, y, impl="chunked", dtype=jnp.float32)  # asked for: no warning


def test_bad_objects_get_one_line_errors():
  with pytest.raises(TypeError, match="^x must be an array, got a dict$"):
    linear_cross_entropy({"a": 1}, jnp.ones((4, 5)), jnp.zeros(2, int))


GPU_IMPLS = ["xla", "chunked", "pallas_triton", "triton", "pallas_mosaic"]


@pytest.mark.gpu
@pytest.mark.parametrize("impl", GPU_IMPLS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("mode", ["fast", "lean"])
def test_every_gpu_path_against_reference(impl, dtype, mode):
  """Forces each implementation this GPU can run and checks it against the float64 oracle; a pairing that no GPU
  runs is checked for its error instead."""
  # What the machine may lack (a compute capability, the optional jax-triton) is read off the registry, not off an
  # error: on a GPU that has both, every implementation must be supported, or the test fails.
  need, cc = base.REGISTRY[impl].min_cc, _device.compute_capability()
  if need is not None and (cc is None or cc < need):
    pytest.skip(f"impl={impl!r} needs compute capability >= {need}; this GPU has {cc}")
  if impl == "triton" and importlib.util.find_spec("jax_triton") is None:
    pytest.skip("impl='triton' needs the jax_triton package (the [gpu] extra)")
  base.check_supported(impl, common.Spec(_math.LossSpec(vocab_size=1000)), _device.platform(), None)
  args = (S((101, 128), dtype), S((128, 1000), dtype))
  if mode == "fast" and impl in ("pallas_triton", "triton"):
    with pytest.raises(ValueError, match=f"impl='{impl}' has no fast design"):
      explain(*args, impl=impl, mode=mode)
    return
  if impl == "pallas_mosaic" and dtype == jnp.float32:
    with pytest.raises(ValueError, match="pallas_mosaic runs bfloat16 and float16 inputs"):
      explain(*args, impl=impl, mode=mode)
    return
  d = explain(*args, impl=impl, mode=mode)
  assert d.impl == impl
  # fp32 is checked as exact fp32: XLA and Triton may run float32 dots as TF32 at the default precision.
  with jax.default_matmul_precision("highest"):
    check_impl(impl, mode=mode, dtype=dtype, h=128, v=1000, batch_shape=(101,), bias=True, seed=5)


# ------------------------------------------------------------------------------------- chunk options × designs

# every design auto can reach, by device: (compute capability, dtype) -> what auto may pick
DEVICES = {"cpu": None, "sm80": (8, 0), "sm90": (9, 0)}
CHUNK_OPTIONS = {"none": {}, "token_chunk": dict(token_chunk=256), "vocab_chunk": dict(vocab_chunk=256)}
# the chunk field of each design that honours a chunk option; a design not listed has no chunk loop
HONOURS = {("chunked", "token_chunks"): "token_chunk", ("chunked", "recompute"): "vocab_chunk",
           ("pallas_triton", "recompute"): "vocab_chunk", ("pallas_mosaic", "recompute"): "vocab_chunk",
           ("pallas_mosaic", "tokens"): "token_chunk"}
SHAPES = {"llama3": LLAMA, "gpt2": dict(x=S((16384, 768), jnp.bfloat16), w=S((768, 50304), jnp.bfloat16))}


@pytest.mark.parametrize("shards", [1, 2])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("mode", [None, "fast", "lean"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("option", list(CHUNK_OPTIONS))
@pytest.mark.parametrize("device", list(DEVICES))
def test_auto_honours_every_chunk_option(fake_gpu, device, option, dtype, mode, reduction, shape, shards):
  """Every option × design pairing that auto can reach (one device, or w's vocabulary split over two): the design
  picked honours the chunk option set (its resolved config carries that chunk), or the error names the option and
  what rules it out."""
  if DEVICES[device] is not None:
    fake_gpu(DEVICES[device])
  x, w = (S(a.shape, jnp.dtype(dtype)) for a in SHAPES[shape].values())
  kw = dict(CHUNK_OPTIONS[option], mode=mode, reduction=reduction, vocab_shards=shards)
  if mode == "fast" and reduction == "none" and option != "vocab_chunk":  # (vocab_chunk: refused as for a mean)
    # only a fast design that takes per-token cotangents runs (Hopper's 'logits', bf16, one device); else an error
    # naming what auto picks (the last candidate: the others are skipped), never a silent lean run
    if (device, dtype, option, shards) == ("sm90", "bfloat16", "none", 1):
      d = explain(x, w, **kw)
      assert (d.impl, d.mode, d.name) == ("pallas_mosaic", "fast", "logits") and base.takes_token_cotangents(d.config)
      assert any(n.startswith("mode='fast', reduction='none': the 'logits' fast design") for n in d.notes), d.notes
      return
    with pytest.raises(ValueError, match=r"^mode='fast' with reduction='none' needs a fast design that takes "
                                         r"per-token cotangents, and impl='auto' \(which picks 'chunked' here\)") as e:
      explain(x, w, **kw)
    if option == "token_chunk":
      assert "token_chunk=256" in str(e.value) and "vocab_chunk" in str(e.value)
    return
  try:
    d = explain(x, w, **kw)
  except ValueError as e:  # only a chunk of the other mode's loop is refused, by name, before any design is tried
    field = option
    assert field != "none", e
    other = "lean" if field == "token_chunk" else "fast"
    assert mode == other or (field == "token_chunk" and reduction == "none"), e
    assert f"{field}=256" in str(e) and ("vocab_chunk" if field == "token_chunk" else "token_chunk") in str(e)
    return
  expected = mode or ("lean" if reduction == "none" or option == "vocab_chunk" else "fast")
  if mode is None and reduction == "none" and option == "none" and base.takes_token_cotangents(d.config):
    expected = "fast"  # a fast design that forms dz in its backward takes the per-token cotangents
  assert d.mode == expected
  if (device, dtype, shape, mode, reduction, option, shards) == ("sm90", "bfloat16", "llama3", None, "none", "none", 1):
    assert (d.impl, d.name, d.mode) == ("pallas_mosaic", "logits", "fast")
  if option == "none":
    return
  assert HONOURS.get((d.impl, d.name)) == option, (d.impl, d.name, d.notes)
  assert getattr(d.config, option) == 256
  if device == "sm90" and dtype == "bfloat16" and option == "token_chunk" and shards == 1:
    assert (d.impl, d.name) == ("pallas_mosaic", "tokens")  # the 'logits' design would refuse it
  if device == "sm90" and dtype == "bfloat16" and option == "vocab_chunk":
    assert (d.impl, d.name) == ("pallas_mosaic", "recompute")  # on each device's columns too


def test_auto_skips_a_design_that_refuses_the_chunk_and_says_why(fake_gpu):
  fake_gpu((9, 0))
  # Mosaic's 'tokens' design needs whole row blocks (128 tokens): 100 is refused, chunked honours it
  d = explain(**LLAMA, token_chunk=100)
  assert (d.impl, d.name, d.config.token_chunk) == ("chunked", "token_chunks", 100)
  assert any("pallas_mosaic" in n and "token_chunk=100" in n for n in d.notes)
  fake_gpu((8, 0))
  d = explain(**LLAMA, token_chunk=1024)
  assert d.impl == "chunked" and any("token_chunk=1024 rules out impl='pallas_triton'" in n for n in d.notes)
  with pytest.raises(ValueError, match="token_chunk=1024 rules out impl='pallas_triton': it has no design that loops "
                                       "over tokens"):
    explain(**LLAMA, impl="pallas_triton", token_chunk=1024)


@pytest.mark.parametrize("name,value", [("z_loss", 1e-3), ("label_smoothing", 0.1), ("logit_softcap", 30.0)])
def test_traced_option_values_are_refused_by_name(name, value):
  """An option traced under jit (a schedule's value) raises an error naming it; a concrete array works."""
  (x, w, y, _), (xn, wn, yn, _) = make_inputs(14, (19,), 16, 50, jnp.float32)
  with pytest.raises(TypeError, match=f"^{name} is a traced array"):
    jax.jit(lambda x, v: linear_cross_entropy(x, w, y, **{name: v}))(x, value)
  got = linear_cross_entropy(x, w, y, **{name: jnp.float32(value)})
  assert rel_err(got, linear_cross_entropy_np(xn, wn, yn, **{name: np.float32(value)})["loss"]) < 1e-5


# ------------------------------------------------------------------------------------- routing and fallbacks


def test_explain_reports_the_routing(monkeypatch):
  """explain() says where the op runs when it does not run as one device's op, and what that costs."""
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P
  w = S((32, 96), jnp.float32)
  with monkeypatch.context() as m:
    m.setattr(jax, "device_count", lambda: 1)  # one device: nothing to say
    assert not any("shard" in n for n in explain(S((64, 32), jnp.float32), w).notes)
  mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2)
  typed = explain(S((64, 32), jnp.float32, sharding=NamedSharding(mesh, P("data"))), w)
  assert any("Explicit mesh axes ['data']" in n and "shard_map" in n for n in typed.notes)
  auto = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
  with jax.set_mesh(auto):
    mean = explain(S((64, 32), jnp.float32), w)
    none = explain(S((64, 32), jnp.float32), w, reduction="none")
  assert any("custom-partitioned" in n and "FLOPs of this design" in n for n in mean.notes)
  assert any("custom-partitioned" in n and "10·B·H·V FLOPs" in n for n in none.notes)


def test_explain_reports_kernels_routed_through_the_partitioned_form(fake_gpu):
  fake_gpu((9, 0))
  d = explain(**LLAMA)
  assert any(f"this process has {jax.device_count()} devices and 'pallas_mosaic' runs compiled kernels" in n
             for n in d.notes)


def test_explain_reports_copies_and_kernels_inside_a_backend():
  """Mosaic's padding copy of w, the Triton dz pass inside the Mosaic backend, float32 dw in interpret mode."""
  odd = explain(S((100, 100), jnp.bfloat16), S((100, 1000), jnp.bfloat16), impl="pallas_mosaic", interpret=True)
  assert any("w is zero-padded from H×V = 100×1000 to 128×1024" in n for n in odd.notes)
  assert any("dz pass is a Pallas Triton kernel" in n for n in odd.notes)
  assert not any("zero-padded" in n for n in explain(**LLAMA, impl="pallas_mosaic", interpret=True).notes)
  lean = explain(**LLAMA, impl="pallas_mosaic", interpret=True, mode="lean")
  assert not any("dz pass" in n for n in lean.notes)
  tri = explain(S((64, 64), jnp.float32), S((64, 100), jnp.float32), impl="pallas_triton", interpret=True)
  assert any("interpret mode: the dw matmul accumulates in float32" in n for n in tri.notes)


def test_each_fallback_warns_once_at_trace_time():
  base._WARNED.clear()
  (x, w, y, _), _ = make_inputs(15, (16,), 16, 40, jnp.float32)
  f = lambda x: linear_cross_entropy(x, w, y, impl="pallas_triton", interpret=True)
  with pytest.warns(UserWarning, match="pallas_triton has no fast design: runs its 'recompute' design"):
    jax.jit(f).lower(x)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jax.jit(lambda x: 2 * f(x)).lower(x)  # once
    explain(x, w, impl="pallas_triton", interpret=True)  # explain reports, never warns
