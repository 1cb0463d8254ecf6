"""``Aux.entropy`` (``LossOptions.entropy``) against the float64 oracle (``tests/reference_np.py``'s ``entropy_np``).

Every implementation (the kernels in interpret mode), float32 and bfloat16, ragged sizes, ignored (-100) and
masked tokens, soft cap and bias, both layouts and leading dims: the entropy's values, and the gradient of an
objective that mixes the loss and the entropy (the loss's part checked against ``linear_cross_entropy_np``). The
same on meshes (the explicit ``shard_map`` form and Auto axes, vocab-parallel included). Off by default (no pass in
the program), ``explain()`` says what it costs, and the errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import lce_flax
from lce_flax import explain, linear_cross_entropy
from lce_flax.sharding import make_mesh, sharded_linear_cross_entropy
from tests._checks import MOSAIC_SMALL, OPTIONS, TRITON_SMALL, make_inputs, tolerances
from tests.reference_np import entropy_np, linear_cross_entropy_np, rel_err

_MOSAIC = dict(MOSAIC_SMALL, warp_specialized=False, vocab_chunk=None)

# name: (impl, op kwargs, low precision only, sizes (h, v, batch_shape) where the kernels' tiles need them)
VARIANTS = {
    "xla": ("xla", {}, False, {}),
    "chunked:fast": ("chunked", dict(mode="fast", config=lce_flax.ChunkedConfig(token_chunk=8)), False, {}),
    # vocab_chunk=64 is the lean design's chunk and the entropy pass's: 301 columns = 4·64 + 45, a ragged last one
    "chunked:lean": ("chunked", dict(mode="lean", vocab_chunk=64), False, {}),
    "pallas_triton:lean": ("pallas_triton", dict(config=lce_flax.PallasTritonConfig(**TRITON_SMALL)), False, {}),
    "pallas_mosaic:logits": ("pallas_mosaic", dict(config=lce_flax.PallasMosaicConfig(**_MOSAIC, fast_design="logits")),
                             True, dict(h=128, v=384, batch_shape=(101,))),
}

# name: (options, w_layout, reduction, bias, where, batch_shape)
CASES = {
    # label smoothing and z-loss change the loss, not the entropy (of the capped logits)
    "all_options_bias_where_mean": (OPTIONS["all"], "hv", "mean", True, True, (37,)),
    "softcap_vh_leading_dims_none": (OPTIONS["softcap"], "vh", "none", False, False, (3, 13)),
    "plain_sum": (OPTIONS["plain"], "hv", "sum", True, False, (29,)),
}


def _pairs():
  """(variant, case) pairs that can run: chunked's fast design takes no per-token cotangents, so mode='fast' with
  reduction='none' refuses it (tests/test_dispatch.py); pallas_mosaic's 'logits' design takes them (mode=None runs
  it for 'none' too)."""
  return [(n, c) for n in VARIANTS for c in CASES
          if not (CASES[c][2] == "none" and VARIANTS[n][1].get("mode") == "fast")]


def _check(name, case, dtype):
  impl, kw, low_only, sizes = VARIANTS[name]
  options, w_layout, reduction, bias, where, batch_shape = CASES[case]
  if low_only and dtype == jnp.float32:
    dtype = jnp.float16  # WGMMA takes no float32 operands
  batch_shape = sizes.get("batch_shape", batch_shape)
  seed = sorted(VARIANTS).index(name) * 8 + sorted(CASES).index(case) * 2 + (dtype == jnp.float32)
  (x, w, y, b), (xn, wn, yn, bn) = make_inputs(seed, batch_shape, sizes.get("h", 24), sizes.get("v", 301), dtype,
                                               w_layout=w_layout, bias=bias)
  rng = np.random.default_rng(seed + 100)
  mask = jnp.asarray(rng.random(batch_shape) < 0.8) if where else None
  c_ent = 4 * rng.standard_normal(batch_shape).astype(np.float32)  # weighs like the loss's cotangents
  c_tok = rng.standard_normal(batch_shape).astype(np.float32) if reduction == "none" else None

  def objective(x, w, b):
    loss, aux = linear_cross_entropy(x, w, y, bias=b, where=mask, w_layout=w_layout, reduction=reduction,
                                     impl=impl, return_aux=True, entropy=True, **options, **kw)
    total = (loss * c_tok).sum() if reduction == "none" else loss
    return total + (aux.entropy * c_ent).sum(), aux

  (_, aux), grads = jax.value_and_grad(objective, (0, 1, 2), has_aux=True)(x, w, b)
  ref = linear_cross_entropy_np(xn, wn, yn, bias=bn, where=None if mask is None else np.asarray(mask),
                                reduction=reduction, w_layout=w_layout, cotangent=c_tok, **options)
  ent = entropy_np(xn, wn, bias=bn, logit_softcap=options.get("logit_softcap"), w_layout=w_layout, cotangent=c_ent)
  loss_tol, grad_tol = tolerances(dtype)
  assert aux.entropy.shape == y.shape and aux.entropy.dtype == jnp.float32
  # every token has an entropy, counted or not (ignored labels and masked tokens included), as the lse
  assert rel_err(aux.entropy, ent["entropy"]) < loss_tol
  assert rel_err(aux.token_loss, ref["token_loss"]) < loss_tol and rel_err(aux.lse, ref["lse"]) < loss_tol
  for got, what in zip(grads, ("dx", "dw", "dbias")):
    if what == "dbias" and not bias:
      continue
    assert rel_err(got, ref[what] + ent[what]) < grad_tol, what
    # the entropy's part is not negligible next to the loss's: a dropped entropy gradient would fail above
    assert rel_err(ref[what], ref[what] + ent[what]) > 5 * grad_tol, what


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(("name", "case"), _pairs())
def test_entropy_and_its_gradient_against_float64(name, case, dtype):
  _check(name, case, dtype)


def test_entropy_alone_is_differentiable_by_a_fast_design():
  """The gradient of the entropy only (no loss cotangent) through the fast design on one device's op, and through
  a reduced loss in the partitioned form (chunked's token loop in a process with several devices)."""
  (x, w, y, _), (xn, wn, _, _) = make_inputs(40, (33,), 16, 97, jnp.float32)
  c = np.random.default_rng(41).standard_normal(33).astype(np.float32)
  want = entropy_np(xn, wn, logit_softcap=2.0, cotangent=c)
  for kw in (dict(impl="chunked", mode="fast"), dict(impl="xla")):
    f = lambda x, w, kw=kw: (c * linear_cross_entropy(x, w, y, logit_softcap=2.0, return_aux=True, entropy=True,
                                                      **kw)[1].entropy).sum()
    dx, dw = jax.jit(jax.grad(f, (0, 1)))(x, w)
    assert rel_err(dx, want["dx"]) < 2e-5 and rel_err(dw, want["dw"]) < 2e-5, kw


def test_peaked_and_uniform_rows():
  """Rows with one dominant logit (entropy near 0) and uniform rows (log V) keep their absolute accuracy."""
  x = jnp.concatenate([jnp.zeros((3, 8)), 40.0 * jnp.eye(8)[:5]], 0)
  w = jnp.concatenate([jnp.eye(8), jnp.zeros((8, 93))], 1)  # V = 101
  y = jnp.zeros(8, jnp.int32)
  _, aux = linear_cross_entropy(x, w, y, return_aux=True, entropy=True, impl="chunked", mode="lean",
                                vocab_chunk=16)
  want = entropy_np(np.asarray(x), np.asarray(w))["entropy"]
  assert abs(want[0] - np.log(101)) < 1e-12 and want[-1] < 1e-12  # (the rows are what they are meant to be)
  np.testing.assert_allclose(aux.entropy, want, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------------------------------ on meshes

B, H, V = 40, 24, 296  # 5 tokens per device on 8 devices, 37 columns per vocabulary shard of 8


def _mesh_inputs(seed):
  (x, w, y, b), (xn, wn, yn, bn) = make_inputs(seed, (B,), H, V, jnp.float32, bias=True)
  rng = np.random.default_rng(seed + 1)
  return (x, w, y, b), (xn, wn, yn, bn), [rng.standard_normal(B).astype(np.float32) for _ in range(2)]


def _mesh_objective(op, reduction, c_tok, c_ent):
  def f(x, w, b):
    loss, aux = op(x, w, b)
    return ((loss * c_tok).sum() if reduction == "none" else loss) + (aux.entropy * c_ent).sum(), aux
  return f


def _mesh_reference(xn, wn, yn, bn, reduction, c_tok, c_ent):
  ref = linear_cross_entropy_np(xn, wn, yn, bias=bn, reduction=reduction, logit_softcap=3.0,
                                cotangent=c_tok if reduction == "none" else None)
  ent = entropy_np(xn, wn, bias=bn, logit_softcap=3.0, cotangent=c_ent)
  return ent["entropy"], [ref[k] + ent[k] for k in ("dx", "dw", "dbias")]


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("mesh_shape,mode", [((2, 2, 2), None), ((1, 1, 8), "lean"), ((8, 1, 1), None)],
                         ids=["2x2x2", "1x1x8-lean", "8x1x1"])
def test_explicit_form_on_meshes(mesh_shape, mode, reduction):
  """sharded_linear_cross_entropy: tokens over data/fsdp, w's H over fsdp (gathered), its V over tensor (the
  entropy's stats combined across the vocabulary shards, its dx psum'd)."""
  (x, w, y, b), (xn, wn, yn, bn), (c_tok, c_ent) = _mesh_inputs(50 + mesh_shape[2])
  mesh = make_mesh(*mesh_shape)
  kw = dict(reduction=reduction, logit_softcap=3.0, return_aux=True, entropy=True, mode=mode)
  if mode == "lean" or reduction == "none":
    kw["vocab_chunk"] = 16
  op = lambda x, w, b: sharded_linear_cross_entropy(x, w, y, bias=b, mesh=mesh, **kw)
  f = _mesh_objective(op, reduction, c_tok, c_ent)
  (_, aux), grads = jax.jit(jax.value_and_grad(f, (0, 1, 2), has_aux=True))(x, w, b)
  want, want_grads = _mesh_reference(xn, wn, yn, bn, reduction, c_tok, c_ent)
  assert aux.entropy.shape == (B,) and rel_err(aux.entropy, want) < 2e-5
  for got, ref, what in zip(grads, want_grads, ("dx", "dw", "dbias")):
    assert rel_err(got, ref) < 2e-5, what


@pytest.mark.parametrize("reduction", ["sum", "none"])
@pytest.mark.parametrize("tok,wspec", [("data", P(None, "tensor")), (("data", "fsdp"), P("fsdp", None))],
                         ids=["vocab-parallel", "fsdp"])
def test_auto_axes(tok, wspec, reduction):
  """Auto mesh axes under jit: the custom-partitioned op, its entropy output and its entropy backward."""
  (x, w, y, b), (xn, wn, yn, bn), (c_tok, c_ent) = _mesh_inputs(60)
  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  bspec = P("tensor") if "tensor" in wspec else P()
  op = lambda x, w, b: linear_cross_entropy(x, w, y, bias=b, reduction=reduction, logit_softcap=3.0,
                                            return_aux=True, entropy=True)
  f = jax.jit(jax.value_and_grad(_mesh_objective(op, reduction, c_tok, c_ent), (0, 1, 2), has_aux=True))
  with jax.set_mesh(mesh):
    (_, aux), grads = f(put(x, P(tok)), put(w, wspec), put(b, bspec))
    assert "CustomSPMDPartitioning" in f.lower(put(x, P(tok)), put(w, wspec), put(b, bspec)).as_text()
  ref = _mesh_reference(xn, wn, yn, bn, reduction, c_tok, c_ent)
  assert rel_err(aux.entropy, ref[0]) < 2e-5
  want = linear_cross_entropy_np(xn, wn, yn, bias=bn, reduction=reduction, logit_softcap=3.0)
  assert rel_err(aux.token_loss, want["token_loss"]) < 2e-5
  for got, r, what in zip(grads, ref[1], ("dx", "dw", "dbias")):
    assert rel_err(got, r) < 2e-5, what


# ------------------------------------------------------------------------------------------------ the option


def test_off_by_default_and_no_pass_without_it():
  (x, w, y, _), _ = make_inputs(70, (12,), 16, 50, jnp.float32)
  loss, aux = linear_cross_entropy(x, w, y, return_aux=True, impl="chunked", mode="lean")
  assert aux.entropy is None and lce_flax.LossOptions().entropy is False
  program = lambda **kw: str(jax.make_jaxpr(
      lambda x: linear_cross_entropy(x, w, y, return_aux=True, impl="chunked", mode="lean", **kw))(x))
  off, on = program(), program(entropy=True)
  assert "entropy" not in off and "entropy" in on  # the pass is in the program only when asked for
  assert off.count("dot_general") < on.count("dot_general")
  loss_on, aux_on = linear_cross_entropy(x, w, y, return_aux=True, impl="chunked", mode="lean", entropy=True)
  assert float(loss_on) == float(loss)  # the loss is untouched


def test_errors():
  x, w, y = jnp.ones((4, 8)), jnp.ones((8, 10)), jnp.zeros(4, jnp.int32)
  with pytest.raises(ValueError, match=r"entropy=True returns the per-token entropy in Aux.entropy: pass "
                                       r"return_aux=True"):
    linear_cross_entropy(x, w, y, entropy=True)
  with pytest.raises(ValueError, match="pass return_aux=True"):
    sharded_linear_cross_entropy(x, w, y, mesh=make_mesh(data=-1), entropy=True)
  with pytest.raises(ValueError, match="entropy='yes' must be a bool"):
    lce_flax.LossOptions(entropy="yes")


@pytest.mark.parametrize("impl,reduction", [("xla", "mean"), ("chunked", "none")])
def test_empty_batch(impl, reduction):
  _, aux = linear_cross_entropy(jnp.ones((0, 3, 8)), jnp.ones((8, 10)), jnp.zeros((0, 3), jnp.int32), impl=impl,
                                reduction=reduction, return_aux=True, entropy=True)
  assert aux.entropy.shape == (0, 3) and aux.entropy.dtype == jnp.float32


def test_explain_says_what_the_entropy_costs():
  S = jax.ShapeDtypeStruct
  x, w = S((8192, 4096), jnp.bfloat16), S((4096, 128256), jnp.bfloat16)
  plain, ent = explain(x, w), explain(x, w, entropy=True)
  assert not any("entropy" in n for n in plain.notes)
  # the default chunk: chunked's lean rule, 32 MiB of float32 logits at 8192 tokens = 1024 columns
  note = "entropy=True: aux.entropy is one more pass over the vocabulary, the same for every impl (XLA matmuls in "
  assert any(n.startswith(note + "chunks of 1024 columns)") and "6·B·H·V more in the backward" in n
             for n in ent.notes)
  assert ent.memory_bytes == plain.memory_bytes + 3 * 8192 * 1024 * 4 + 8192 * 4096 * 4
  assert (ent.impl, ent.mode, ent.name) == (plain.impl, plain.mode, plain.name)  # the loss's design is unchanged
  lean = explain(x, w, entropy=True, vocab_chunk=4096)
  assert any("chunks of 4096 columns" in n for n in lean.notes)
  shard = explain(x, w, entropy=True, vocab_chunk=100_000, vocab_shards=4)  # at most one shard's columns
  assert any("chunks of 32064 columns" in n for n in shard.notes)


def test_head_options_carry_it():
  """A head holding LossOptions(entropy=True) returns the entropy with return_aux, and refuses a call without."""
  from flax import nnx

  import lce_flax.nnx as lce_nnx
  head = lce_nnx.LMHead(16, 50, use_bias=True, bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(0),
                        options=lce_flax.LossOptions(entropy=True, logit_softcap=2.0))
  (x, _, y, _), (xn, _, _, _) = make_inputs(80, (2, 7), 16, 50, jnp.float32)
  _, aux = head(x, y, return_aux=True)
  want = entropy_np(xn, np.asarray(head.kernel.get_value()), bias=np.asarray(head.bias.get_value()),
                    logit_softcap=2.0)["entropy"]
  assert aux.entropy.shape == (2, 7) and rel_err(aux.entropy, want) < 2e-5
  with pytest.raises(ValueError, match="pass return_aux=True"):
    head(x, y)


