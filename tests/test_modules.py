"""The linen and NNX heads: a tiny 2-layer transformer built with a Dense/Linear (or ``Embed.attend``) head + optax
and with the fused head must agree on parameters, loss and the gradient of every parameter; checkpoints move
between them; options and dtypes reach the op (checked against the float64 oracle).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import PartitionSpec as P

import lce_flax.linen as lce_linen
import lce_flax.nnx as lce_nnx
from lce_flax import Aux, LossOptions
from tests._checks import chunk_kw
from tests.reference_np import linear_cross_entropy_np, rel_err

VOCAB, EMBED, SEQ, BATCH, HEADS, LAYERS = 97, 32, 12, 3, 4, 2
# Small chunks so the chunked backend runs several chunks with a ragged last one (36 tokens, 97 columns).
CHUNK = 16


def chunk(impl, mode=None):
  """The chunk option of the design ``mode`` picks where the implementation has a chunk loop (``xla`` has none,
  and refuses one): tokens per chunk for the fast design, vocabulary columns for the lean one."""
  return chunk_kw(CHUNK, mode) if impl == "chunked" else {}


def make_batch(seed: int = 0, ignore_frac: float = 0.25):
  """Tokens [BATCH, SEQ], next-token labels with ~ignore_frac of -100 (at least one counted and one ignored)."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32)
  labels = rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32)
  ignored = rng.random((BATCH, SEQ)) < ignore_frac
  ignored[0, 0], ignored[0, 1] = True, False
  return jnp.asarray(tokens), jnp.asarray(np.where(ignored, -100, labels))


def optax_loss(logits, labels, ignore_index=-100):
  """The unfused reference: optax's cross-entropy, mean over counted tokens."""
  counted = labels != ignore_index
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(counted, labels, 0))
  return jnp.sum(jnp.where(counted, ce, 0.0)) / jnp.maximum(counted.sum(), 1)


def assert_trees_equal(a, b):
  """Same structure, and every leaf of ``a`` bit-equal (shape and dtype included) to ``b``'s."""
  la, ta = jax.tree.flatten_with_path(a)
  lb, tb = jax.tree.flatten_with_path(b)
  assert ta == tb, f"tree structures differ:\n{ta}\n{tb}"
  for (path, x), (_, y) in zip(la, lb):
    assert x.dtype == y.dtype, (jax.tree_util.keystr(path), x.dtype, y.dtype)
    np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


def assert_trees_close(a, b, rtol=1e-5):
  """Every leaf of ``a`` close to ``b``: elementwise ``rtol``, plus an absolute slack of ``rtol`` times the
  largest entry of the whole tree ``b`` (some gradients, e.g. of attention key biases, are zero up to rounding).
  """
  la, ta = jax.tree.flatten_with_path(a)
  lb, tb = jax.tree.flatten_with_path(b)
  assert ta == tb, f"tree structures differ:\n{ta}\n{tb}"
  scale = max(float(np.abs(np.asarray(y, np.float64)).max()) for _, y in lb)
  assert scale > 0, "the reference tree is all zero: the comparison could not fail"
  for (path, x), (_, y) in zip(la, lb):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    assert x.shape == y.shape, (jax.tree_util.keystr(path), x.shape, y.shape)
    np.testing.assert_allclose(x, y, rtol=rtol, atol=rtol * scale, err_msg=jax.tree_util.keystr(path))


def shapes_dtypes(tree):
  return jax.tree.map(lambda a: (a.shape, jnp.dtype(a.dtype)), tree)


def jaxpr_shapes(jaxpr) -> set[tuple[int, ...]]:
  """Shapes of every value a jaxpr (and each jaxpr nested in it) produces."""
  shapes = set()
  for eqn in jaxpr.eqns:
    shapes.update(tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      shapes |= jaxpr_shapes(sub)
  return shapes


# ------------------------------------------------------------------------------------------------------------ linen


class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(x)
    h = nn.MultiHeadDotProductAttention(num_heads=HEADS)(h, mask=nn.make_causal_mask(jnp.ones(x.shape[:2])))
    x = x + h
    h = nn.Dense(4 * EMBED)(nn.LayerNorm()(x))
    return x + nn.Dense(EMBED)(nn.gelu(h))


class LinenLM(nn.Module):
  """head: "dense" (nn.Dense + optax), "fused" (LMHead), "attend" (Embed.attend + optax), "tied" (TiedLMHead)."""

  head: str
  use_bias: bool = False
  impl: str = "chunked"
  mode: str | None = None

  @nn.compact
  def __call__(self, tokens, labels):
    embed = nn.Embed(VOCAB, EMBED, name="embed")
    x = embed(tokens) + self.param("pos", nn.initializers.normal(0.02), (SEQ, EMBED))
    for _ in range(LAYERS):
      x = LinenBlock()(x)
    x = nn.LayerNorm()(x)
    if self.head == "dense":
      return optax_loss(nn.Dense(VOCAB, use_bias=self.use_bias, name="head")(x), labels)
    if self.head == "fused":
      head = lce_linen.LMHead(VOCAB, use_bias=self.use_bias, name="head",
                              options=LossOptions(impl=self.impl, mode=self.mode, **chunk(self.impl, self.mode)))
      return head(x, labels)
    if self.head == "attend":
      return optax_loss(embed.attend(x), labels)
    return lce_linen.TiedLMHead(options=LossOptions(impl=self.impl, mode=self.mode, **chunk(self.impl, self.mode)))(
        embed, x, labels)


LINEN_CASES = [  # (tied, use_bias, impl, mode)
    (False, True, "chunked", None),
    (False, False, "xla", None),
    (False, False, "chunked", "lean"),
    (True, False, "chunked", None),
    (True, False, "xla", None),
]


@functools.cache
def linen_reference(tied: bool, use_bias: bool):
  """(params, loss, grads) of the Dense-head (or ``Embed.attend``) model, shared by the cases that need them."""
  tokens, labels = make_batch(seed=1)
  ref = LinenLM("attend" if tied else "dense", use_bias=use_bias)
  params = jax.jit(ref.init)(jax.random.key(0), tokens, labels)["params"]
  loss, grads = jax.jit(jax.value_and_grad(lambda p: ref.apply({"params": p}, tokens, labels)))(params)
  return params, loss, grads


@pytest.mark.parametrize("tied,use_bias,impl,mode", LINEN_CASES)
def test_linen_model_matches_dense_head(tied, use_bias, impl, mode):
  tokens, labels = make_batch(seed=1)
  fused = LinenLM("tied" if tied else "fused", use_bias=use_bias, impl=impl, mode=mode)
  ref_params, loss_ref, g_ref = linen_reference(tied, use_bias)
  # Same names, shapes and dtypes (values drawn alike: test_linen_logits_match_dense).
  abstract = nn.meta.unbox(jax.eval_shape(fused.init, jax.random.key(0), tokens, labels))["params"]
  assert shapes_dtypes(abstract) == shapes_dtypes(ref_params)
  if not tied:
    assert abstract["head"]["kernel"].shape == (EMBED, VOCAB)
    assert ("bias" in abstract["head"]) == use_bias

  # The fused model runs on the Dense model's (plain, unboxed) parameters.
  value_and_grad = jax.jit(jax.value_and_grad(lambda p, labels: fused.apply({"params": p}, tokens, labels)))
  loss, g = value_and_grad(ref_params, labels)
  np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)
  assert_trees_close(g, g_ref, rtol=1e-5)
  # The loss is not trivially insensitive to the labels.
  shifted = jnp.where(labels >= 0, (labels + 1) % VOCAB, labels)
  assert abs(float(value_and_grad(ref_params, shifted)[0]) - float(loss)) > 1e-3


def test_linen_fused_model_never_forms_logits():
  tokens, labels = make_batch()
  model = LinenLM("fused", impl="chunked", mode="lean")
  params = nn.meta.unbox(jax.eval_shape(model.init, jax.random.key(0), tokens, labels))["params"]
  jaxpr = jax.make_jaxpr(jax.grad(lambda p: model.apply({"params": p}, tokens, labels)))(params).jaxpr
  shapes = jaxpr_shapes(jaxpr)
  assert (BATCH * SEQ, VOCAB) not in shapes and (BATCH, SEQ, VOCAB) not in shapes
  # ... while the Dense model does (so the check above can fail).
  ref = LinenLM("dense")
  assert (BATCH, SEQ, VOCAB) in jaxpr_shapes(jax.make_jaxpr(lambda p: ref.apply({"params": p}, tokens, labels))(
      params).jaxpr)


def test_linen_partitioning_metadata():
  x = jnp.ones((2, 5, EMBED))
  y = jnp.zeros((2, 5), jnp.int32)
  variables = lce_linen.LMHead(VOCAB, use_bias=True).init(jax.random.key(0), x, y)
  assert isinstance(variables["params"]["kernel"], nn.LogicallyPartitioned)
  specs = nn.get_partition_spec(variables)["params"]
  assert specs == {"kernel": P("embed", "vocab"), "bias": P("vocab")}
  # Logical names map onto a mesh through the usual rules.
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  rules = (("embed", None), ("vocab", "model"))
  shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(variables), mesh, rules)["params"]
  assert shardings["kernel"].spec == P(None, "model")
  custom = lce_linen.LMHead(VOCAB, kernel_axes=("embed", "vocab_tp")).init(jax.random.key(0), x, y)
  assert nn.get_partition_spec(custom)["params"]["kernel"] == P("embed", "vocab_tp")
  bare = lce_linen.LMHead(VOCAB, kernel_axes=None).init(jax.random.key(0), x, y)
  assert not isinstance(bare["params"]["kernel"], nn.LogicallyPartitioned)


def test_linen_head_sharded_by_logical_rules():
  """Parameters placed by their logical names on an (Auto) mesh: same loss, gradients sharded like the params."""
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  rules = (("embed", None), ("vocab", "model"))
  head = lce_linen.LMHead(96, use_bias=True, options=LossOptions(impl="chunked", token_chunk=CHUNK),
                          bias_init=nn.initializers.normal(1.0))
  x = jax.random.normal(jax.random.key(0), (4, 6, EMBED))
  labels = jnp.asarray(np.random.default_rng(0).integers(-1, 96, (4, 6)), jnp.int32)
  abstract = jax.eval_shape(head.init, jax.random.key(0), x, labels)
  shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
  params = jax.jit(head.init, out_shardings=shardings)(jax.random.key(0), x, labels)
  assert params["params"]["kernel"].value.sharding.spec == P(None, "model")
  batch = jax.sharding.NamedSharding(mesh, P("data"))
  loss_fn = lambda p, x, labels: head.apply(p, x, labels, ignore_index=-1)
  loss, g = jax.jit(jax.value_and_grad(loss_fn))(params, jax.device_put(x, batch), jax.device_put(labels, batch))
  assert g["params"]["kernel"].value.sharding.spec == P(None, "model")
  plain = nn.meta.unbox(jax.device_get(params))
  want = linear_cross_entropy_np(x, plain["params"]["kernel"], labels, bias=plain["params"]["bias"],
                                 ignore_index=-1)
  assert rel_err(loss, want["loss"]) < 1e-5
  assert rel_err(g["params"]["kernel"].value, want["dw"]) < 1e-5


@pytest.mark.parametrize("use_bias", [False, True])
def test_linen_logits_match_dense(use_bias):
  x = jax.random.normal(jax.random.key(1), (3, 7, EMBED))
  head = lce_linen.LMHead(VOCAB, use_bias=use_bias, bias_init=nn.initializers.normal(1.0))
  variables = head.init(jax.random.key(0), x, method="logits")
  dense = nn.Dense(VOCAB, use_bias=use_bias, bias_init=nn.initializers.normal(1.0))
  dense_vars = dense.init(jax.random.key(0), x)
  assert_trees_equal(nn.meta.unbox(variables), dense_vars)
  np.testing.assert_array_equal(head.apply(variables, x, method="logits"), dense.apply(dense_vars, x))
  # bf16 activations with fp32 params promote to fp32, as Dense.
  xb = x.astype(jnp.bfloat16)
  out = head.apply(variables, xb, method="logits")
  assert out.dtype == dense.apply(dense_vars, xb).dtype == jnp.float32


def test_linen_head_loss_and_logits_in_one_apply():
  class Model(nn.Module):
    def setup(self):
      self.head = lce_linen.LMHead(VOCAB, use_bias=True)  # impl="auto": chunked on CPU

    def __call__(self, x, labels):
      return self.head(x, labels), self.head.logits(x), self.head(x, labels, z_loss=0.5)

  x = jax.random.normal(jax.random.key(1), (2, 5, EMBED))
  _, labels = make_batch()
  labels = labels[:2, :5]
  variables = Model().init(jax.random.key(0), x, labels)
  assert jax.tree.map(jnp.shape, nn.meta.unbox(variables)) == {
      "params": {"head": {"kernel": (EMBED, VOCAB), "bias": (VOCAB,)}}}
  loss, logits, loss_z = Model().apply(variables, x, labels)
  np.testing.assert_allclose(loss, optax_loss(logits, labels), rtol=1e-6)
  assert loss_z > loss + 1.0  # the per-call z_loss reached the op (0.5·lse² with lse ≈ log 97 + O(1))


def test_linen_tied_logits_match_attend():
  x = jax.random.normal(jax.random.key(1), (3, 7, EMBED))
  embed = nn.Embed(VOCAB, EMBED)
  ev = embed.init(jax.random.key(0), jnp.zeros((1,), jnp.int32))
  table = ev["params"]["embedding"]
  want = embed.apply(ev, x, method="attend")
  np.testing.assert_allclose(lce_linen.TiedLMHead().logits(table, x), want, rtol=1e-6, atol=1e-6)
  got = embed.apply(ev, x, method=lambda e, x: lce_linen.TiedLMHead().logits(e, x))
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def _orbax_roundtrip(tmp_path, tree, target):
  ckptr = ocp.StandardCheckpointer()
  path = tmp_path / "ckpt"
  ckptr.save(path, tree)
  ckptr.wait_until_finished()
  return ckptr.restore(path, target)


def test_linen_orbax_dense_checkpoint_into_fused(tmp_path):
  tokens, labels = make_batch(seed=2)
  ref, fused = LinenLM("dense"), LinenLM("fused", impl="chunked")
  # A trained-looking Dense checkpoint: initialise with a different key than the fused model's own init.
  dense_params = jax.jit(ref.init)(jax.random.key(7), tokens, labels)["params"]
  target = nn.meta.unbox(jax.eval_shape(lambda: fused.init(jax.random.key(0), tokens, labels)))["params"]
  restored = _orbax_roundtrip(tmp_path, dense_params, target)
  assert_trees_equal(restored, dense_params)
  np.testing.assert_allclose(jax.jit(fused.apply)({"params": restored}, tokens, labels),
                             jax.jit(ref.apply)({"params": dense_params}, tokens, labels), rtol=1e-6)
  # And back: the fused model's checkpoint is a Dense checkpoint.
  back = _orbax_roundtrip(tmp_path / "back", restored, jax.eval_shape(lambda: dense_params))
  assert_trees_equal(back, dense_params)


# ------------------------------------------------------------------------------------------------------ op options


def _head_problem(seed, use_bias, batch_shape=(3, 11), h=EMBED, v=VOCAB):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((*batch_shape, h)), jnp.float32)
  labels = rng.integers(0, v, batch_shape)
  labels = jnp.asarray(np.where(rng.random(batch_shape) < 0.2, -100, labels), jnp.int32)
  head = lce_linen.LMHead(v, use_bias=use_bias, options=LossOptions(impl="chunked", token_chunk=CHUNK),
                          bias_init=nn.initializers.normal(0.5))
  params = nn.meta.unbox(head.init(jax.random.key(seed), x, labels))["params"]
  return head, params, x, labels


@pytest.mark.parametrize("options", [dict(label_smoothing=0.1, z_loss=1e-3, logit_softcap=5.0),
                                     dict(reduction="sum"),
                                     # the lean design loops over vocabulary columns: the head's token_chunk goes
                                     dict(reduction="none", mode="lean", token_chunk=None, vocab_chunk=CHUNK)])
def test_linen_head_options_against_oracle(options):
  head, params, x, labels = _head_problem(3, use_bias=True)
  where = jnp.asarray(np.random.default_rng(4).random(labels.shape) < 0.8)
  cot = (jnp.asarray(np.random.default_rng(5).standard_normal(labels.shape), jnp.float32)
         if options.get("reduction") == "none" else 1.0)
  # Options as fields on one head and as call kwargs on another: both must reach the op.
  as_fields = head.clone(options=head.options.replace(**options))

  def run(h, p, x, kw):
    out, vjp = jax.vjp(lambda p, x: h.apply({"params": p}, x, labels, where=where, **kw), p, x)
    return out, *vjp(jnp.asarray(cot, out.dtype) * jnp.ones_like(out))

  want = linear_cross_entropy_np(x, params["kernel"], labels, bias=params["bias"], where=where,
                                 cotangent=cot, **{k: v for k, v in options.items()
                                                    if k not in ("mode", "token_chunk", "vocab_chunk")})
  for h, kw in ((as_fields, {}), (head, options)):
    loss, dp, dx = run(h, params, x, kw)
    assert rel_err(loss, want["loss"]) < 1e-5
    assert rel_err(dx, want["dx"]) < 1e-5
    assert rel_err(dp["kernel"], want["dw"]) < 1e-5
    assert rel_err(dp["bias"], want["dbias"]) < 1e-5


def test_linen_head_aux_and_bf16():
  head, params, x, labels = _head_problem(6, use_bias=False)
  loss, aux = head.apply({"params": params}, x, labels, return_aux=True)
  assert isinstance(aux, Aux) and aux.token_loss.shape == labels.shape
  want = linear_cross_entropy_np(x, params["kernel"], labels)
  assert int(aux.num_tokens) == want["num_tokens"] and int(aux.num_correct) == want["num_correct"]
  np.testing.assert_allclose(aux.lse, want["lse"], rtol=1e-5)
  # dtype=bf16: x and the fp32 kernel are rounded to bf16 for the matmul, the loss stays fp32, grads reach fp32.
  bf = head.clone(dtype=jnp.bfloat16)
  loss, (dp, dx) = jax.value_and_grad(lambda p, x: bf.apply({"params": p}, x, labels), argnums=(0, 1))(params, x)
  assert loss.dtype == jnp.float32 and dp["kernel"].dtype == jnp.float32 and dx.dtype == jnp.float32
  up = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))
  want = linear_cross_entropy_np(up(x), up(params["kernel"]), labels)
  assert rel_err(loss, want["loss"]) < 1e-5
  assert rel_err(dx, want["dx"]) < 2e-2 and rel_err(dp["kernel"], want["dw"]) < 2e-2
  # param_dtype=bf16: parameters stored in bf16, as Dense would store them.
  pb = head.clone(param_dtype=jnp.bfloat16).init(jax.random.key(0), x, labels)
  assert nn.meta.unbox(pb)["params"]["kernel"].dtype == jnp.bfloat16


def test_linen_errors():
  head, params, x, labels = _head_problem(0, use_bias=False)
  with pytest.raises(TypeError, match="unknown loss option"):
    head.apply({"params": params}, x, labels, smoothing=0.1)
  with pytest.raises(ValueError, match="reduction="):
    head.apply({"params": params}, x, labels, reduction="avg")
  with pytest.raises(ValueError, match=r"x.shape=\(3, 11, 32\).*H=33"):
    lce_linen.TiedLMHead()(jnp.zeros((VOCAB, EMBED + 1)), x, labels)
  with pytest.raises(ValueError, match=r"must be 2-D.*\(97,\)"):
    lce_linen.TiedLMHead()(jnp.zeros((VOCAB,)), x, labels)
  with pytest.raises(TypeError, match="without labels returns the logits; where, z_loss"):
    head.apply({"params": params}, x, where=labels > 0, z_loss=1e-4)


class DropInLM(nn.Module):
  """A linen LM written for ``nn.Dense``: ``self.lm_head(h)`` gives the logits (generation); the fused head is
  put where the Dense stood, and the same module gives the loss when labels are passed."""

  head: str  # "dense" | "fused" | "tied"

  def setup(self):
    self.embed = nn.Embed(VOCAB, EMBED)
    self.mlp = nn.Dense(EMBED)
    if self.head == "dense":
      self.lm_head = nn.Dense(VOCAB, use_bias=False)
    elif self.head == "fused":
      self.lm_head = lce_linen.LMHead(VOCAB, options=LossOptions(impl="chunked", **chunk("chunked")))
    else:
      self.lm_head = lce_linen.TiedLMHead(options=LossOptions(impl="chunked"))

  def __call__(self, tokens, labels=None):
    h = jnp.tanh(self.mlp(self.embed(tokens)))
    if self.head == "tied":
      return self.lm_head(self.embed, h, labels)
    return self.lm_head(h) if labels is None else self.lm_head(h, labels)


@pytest.mark.parametrize("head", ["fused", "tied"])
def test_linen_heads_are_drop_ins(head):
  """Without labels the heads return the logits Dense / Embed.attend return; with labels the fused loss; same
  parameter tree as the Dense model (tied: no head parameters), gradients of every parameter equal."""
  tokens, labels = make_batch(seed=11)
  fused = DropInLM(head)
  params = fused.init(jax.random.key(0), tokens)["params"]
  if head == "fused":
    dense = DropInLM("dense")
    assert shapes_dtypes(dense.init(jax.random.key(0), tokens)["params"]) == shapes_dtypes(nn.meta.unbox(params))
    logits_fn = lambda p: dense.apply({"params": nn.meta.unbox(p)}, tokens)
  else:
    assert "lm_head" not in params
    logits_fn = lambda p: fused.apply({"params": p}, tokens, method=lambda m, t: m.embed.attend(
        jnp.tanh(m.mlp(m.embed(t)))))
  np.testing.assert_allclose(fused.apply({"params": params}, tokens), logits_fn(params), rtol=1e-6, atol=1e-6)
  got, g = jax.value_and_grad(lambda p: fused.apply({"params": p}, tokens, labels))(params)
  want, g_ref = jax.value_and_grad(lambda p: optax_loss(logits_fn(p), labels))(params)
  assert rel_err(got, want) < 1e-5
  assert_trees_close(nn.meta.unbox(g), nn.meta.unbox(g_ref))


def test_tied_heads_take_what_the_adapters_take():
  """TiedLMHead (linen and NNX) reads a param dict ({'embedding'}, gemma's {'input_embedding'}), a custom
  embedder holding a [V, H] nnx.Param (its dtype used), and names one of several tables with attr=."""

  class Embedder(nnx.Module):  # as tunix's
    def __init__(self, *, dtype, rngs):
      self.input_embedding = nnx.Param(jax.random.normal(rngs.params(), (VOCAB, EMBED)))
      self.dtype = dtype

  x = jax.random.normal(jax.random.key(2), (3, 5, EMBED))
  _, labels = make_batch(seed=12)
  labels = labels[:, :5]
  emb = Embedder(dtype=jnp.float32, rngs=nnx.Rngs(0))
  table = emb.input_embedding[...]
  want = optax_loss(x @ table.T, labels)
  for tied in (lce_linen.TiedLMHead(), lce_nnx.TiedLMHead()):
    for embed in (emb, {"embedding": table}, {"input_embedding": table}, table):
      assert rel_err(tied(embed, x, labels), want) < 1e-5
      np.testing.assert_allclose(tied(embed, x), x @ table.T, rtol=1e-5, atol=1e-5)
  two = {"input_embedding": table, "mm_input_projection": jnp.zeros((7, EMBED))}
  assert rel_err(lce_nnx.TiedLMHead(attr="input_embedding")(two, x, labels), want) < 1e-5
  assert rel_err(lce_linen.TiedLMHead(attr="input_embedding")(two, x, labels), want) < 1e-5
  with pytest.raises(ValueError, match="several 2-D tables; pick one with attr="):
    lce_nnx.TiedLMHead()(two, x, labels)
  # the embedder's own dtype is the matmul dtype, as its decode computes it
  bf16 = Embedder(dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  assert lce_nnx.TiedLMHead().logits(bf16, x).dtype == jnp.bfloat16
  up = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))
  assert rel_err(lce_nnx.TiedLMHead(options=LossOptions(impl="chunked"))(bf16, x, labels),
                 linear_cross_entropy_np(up(x), up(bf16.input_embedding[...]), labels,
                                         w_layout="vh")["loss"]) < 1e-5


# -------------------------------------------------------------------------------------------------------------- nnx


class NNXBlock(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(EMBED, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(HEADS, EMBED, decode=False, rngs=rngs)
    self.ln2 = nnx.LayerNorm(EMBED, rngs=rngs)
    self.up = nnx.Linear(EMBED, 4 * EMBED, rngs=rngs)
    self.down = nnx.Linear(4 * EMBED, EMBED, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.ln1(x), mask=nnx.make_causal_mask(jnp.ones(x.shape[:2])))
    return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class NNXLM(nnx.Module):
  """head as :class:`LinenLM`; "dense" is an ``nnx.Linear`` head."""

  def __init__(self, head: str, *, use_bias=False, impl="chunked", mode=None, rngs: nnx.Rngs):
    self.embed = nnx.Embed(VOCAB, EMBED, rngs=rngs)
    self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (SEQ, EMBED)))
    self.blocks = nnx.List([NNXBlock(rngs) for _ in range(LAYERS)])
    self.ln = nnx.LayerNorm(EMBED, rngs=rngs)
    self.kind = head
    if head == "dense":
      self.head = nnx.Linear(EMBED, VOCAB, use_bias=use_bias, rngs=rngs)
    elif head == "fused":
      self.head = lce_nnx.LMHead(EMBED, VOCAB, use_bias=use_bias, rngs=rngs,
                                 options=LossOptions(impl=impl, mode=mode, **chunk(impl, mode)))
    elif head == "tied":
      self.head = lce_nnx.TiedLMHead(options=LossOptions(impl=impl, mode=mode, **chunk(impl, mode)))

  def __call__(self, tokens, labels):
    x = self.embed(tokens) + self.pos[...]
    for block in self.blocks:
      x = block(x)
    x = self.ln(x)
    if self.kind == "dense":
      return optax_loss(self.head(x), labels)
    if self.kind == "fused":
      return self.head(x, labels)
    if self.kind == "attend":
      return optax_loss(self.embed.attend(x), labels)
    return self.head(self.embed, x, labels)


def pure_params(model):
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


@functools.cache
def nnx_reference(tied: bool, use_bias: bool):
  """(params, loss, grads) of the Linear-head (or ``Embed.attend``) NNX model, as pure dicts."""
  tokens, labels = make_batch(seed=3)
  ref = NNXLM("attend" if tied else "dense", use_bias=use_bias, rngs=nnx.Rngs(0))
  loss, grads = nnx.jit(lambda m: nnx.value_and_grad(lambda m: m(tokens, labels))(m))(ref)
  return pure_params(ref), loss, nnx.to_pure_dict(grads)


@pytest.mark.parametrize("tied,use_bias,impl,mode", LINEN_CASES)
def test_nnx_model_matches_linear_head(tied, use_bias, impl, mode):
  tokens, labels = make_batch(seed=3)
  fused = NNXLM("tied" if tied else "fused", use_bias=use_bias, impl=impl, mode=mode, rngs=nnx.Rngs(0))
  ref_params, loss_ref, g_ref = nnx_reference(tied, use_bias)
  # Same variables, drawn alike from the same Rngs.
  assert shapes_dtypes(pure_params(fused)) == shapes_dtypes(ref_params)
  assert_trees_equal(pure_params(fused), ref_params)
  loss, g = nnx.jit(lambda m: nnx.value_and_grad(lambda m: m(tokens, labels))(m))(fused)
  np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)
  assert_trees_close(nnx.to_pure_dict(g), g_ref, rtol=1e-5)


def test_nnx_head_and_logits_match_linear():
  x = jax.random.normal(jax.random.key(1), (3, 7, EMBED))
  _, labels = make_batch()
  labels = jnp.pad(labels, ((0, 0), (0, 0)))[:, :7]
  lin = nnx.Linear(EMBED, VOCAB, bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(4))
  head = lce_nnx.LMHead(EMBED, VOCAB, use_bias=True, bias_init=nnx.initializers.normal(1.0),
                        options=LossOptions(impl="xla"), rngs=nnx.Rngs(4))
  assert_trees_equal(pure_params(head), pure_params(lin))
  np.testing.assert_array_equal(head.logits(x), lin(x))
  np.testing.assert_allclose(head(x, labels), optax_loss(lin(x), labels), rtol=1e-6)
  want = linear_cross_entropy_np(x, head.kernel[...], labels, bias=head.bias[...], z_loss=1e-3)
  assert rel_err(head(x, labels, z_loss=1e-3), want["loss"]) < 1e-6
  # Tied: TiedLMHead.logits is Embed.attend.
  embed = nnx.Embed(VOCAB, EMBED, rngs=nnx.Rngs(5))
  tied = lce_nnx.TiedLMHead(options=LossOptions(impl="chunked"))
  np.testing.assert_allclose(tied.logits(embed, x), embed.attend(x), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(tied(embed, x, labels), optax_loss(embed.attend(x), labels), rtol=1e-6)
  np.testing.assert_allclose(tied(embed.embedding[...], x, labels), tied(embed, x, labels), rtol=1e-6)


def test_nnx_head_without_labels_is_linear():
  """``head(x)`` is nnx.Linear's output, so LMHead stands where the model calls ``self.lm_head(h)``."""
  x = jax.random.normal(jax.random.key(3), (2, 5, EMBED))
  lin = nnx.Linear(EMBED, VOCAB, use_bias=False, rngs=nnx.Rngs(6))
  head = lce_nnx.LMHead(EMBED, VOCAB, rngs=nnx.Rngs(6))
  np.testing.assert_array_equal(head(x), lin(x))
  with pytest.raises(TypeError, match="without labels returns the logits; return_aux"):
    head(x, return_aux=True)


def test_nnx_head_on_a_mesh_without_its_names():
  """The default logical names on a ("fsdp", "tp") mesh with no rules (tunix's): replicated, and the model's
  partition specs resolve on that mesh; with rules, they follow the rules; mesh names given are kept."""
  mesh = jax.make_mesh((2, 2), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  with jax.set_mesh(mesh):
    head = lce_nnx.LMHead(EMBED, 96, use_bias=True, rngs=nnx.Rngs(0))
    specs = nnx.get_partition_spec(nnx.state(head))
    assert specs["kernel"].get_value() == P(None, None) and specs["bias"].get_value() == P(None)
    state = jax.device_put(nnx.state(head), nnx.get_named_sharding(nnx.state(head), mesh))  # no error
    assert state["kernel"].get_value().sharding.spec == P(None, None)
    with nn.logical_axis_rules((("embed", "fsdp"), ("vocab", "tp"))):
      ruled = lce_nnx.LMHead(EMBED, 96, rngs=nnx.Rngs(0))
      assert nnx.get_partition_spec(nnx.state(ruled))["kernel"].get_value() == P("fsdp", "tp")
    named = lce_nnx.LMHead(EMBED, 96, kernel_axes=("fsdp", "tp"), rngs=nnx.Rngs(0))
  assert named.kernel[...].sharding.spec == P("fsdp", "tp")
  x = jax.random.normal(jax.random.key(4), (4, 3, EMBED))
  labels = jnp.asarray(np.random.default_rng(4).integers(0, 96, (4, 3)), jnp.int32)
  want = linear_cross_entropy_np(x, np.asarray(named.kernel[...]), labels)["loss"]
  with jax.set_mesh(mesh):
    assert rel_err(nnx.jit(lambda m, x: m(x, labels, impl="chunked"))(named, x), want) < 1e-5


def test_nnx_dtypes():
  x = jax.random.normal(jax.random.key(1), (4, EMBED))
  labels = jnp.arange(4, dtype=jnp.int32)
  head = lce_nnx.LMHead(EMBED, VOCAB, dtype=jnp.bfloat16, options=LossOptions(impl="chunked"), rngs=nnx.Rngs(0))
  assert head.kernel[...].dtype == jnp.float32
  loss = head(x, labels)
  assert loss.dtype == jnp.float32
  up = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))
  assert rel_err(loss, linear_cross_entropy_np(up(x), up(head.kernel[...]), labels)["loss"]) < 1e-5
  assert head.logits(x).dtype == jnp.bfloat16
  assert lce_nnx.LMHead(EMBED, VOCAB, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0)).kernel[...].dtype == jnp.bfloat16


def test_nnx_sharding_metadata():
  head = lce_nnx.LMHead(EMBED, VOCAB, use_bias=True, rngs=nnx.Rngs(0))
  assert head.kernel.get_metadata()["out_sharding"] == ("embed", "vocab")
  specs = nnx.get_partition_spec(nnx.state(head))
  assert specs["kernel"].get_value() == P("embed", "vocab") and specs["bias"].get_value() == P("vocab")
  # With a mesh and rules mapping the logical names onto it, the parameters are sharded at creation.
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  with jax.set_mesh(mesh), nn.logical_axis_rules((("embed", None), ("vocab", "model"))):
    sharded = lce_nnx.LMHead(EMBED, 96, use_bias=True, rngs=nnx.Rngs(0))
  assert sharded.kernel[...].sharding.spec == P(None, "model")
  assert sharded.bias[...].sharding.spec == P("model")
  custom = lce_nnx.LMHead(EMBED, VOCAB, kernel_metadata={"out_sharding": (None, "tp")}, rngs=nnx.Rngs(0))
  assert custom.kernel.get_metadata()["out_sharding"] == (None, "tp")
  assert "out_sharding" not in lce_nnx.LMHead(EMBED, VOCAB, kernel_axes=None, rngs=nnx.Rngs(0)).kernel.get_metadata()


def test_nnx_orbax_linear_checkpoint_into_fused(tmp_path):
  tokens, labels = make_batch(seed=4)
  ref = NNXLM("dense", rngs=nnx.Rngs(7))
  loss = nnx.jit(lambda m: m(tokens, labels))
  want = loss(ref)
  make_fused = lambda: NNXLM("fused", impl="chunked", rngs=nnx.Rngs(0))
  assert rel_err(loss(make_fused()), want) > 1e-4  # different weights before the restore
  abstract = nnx.state(nnx.eval_shape(make_fused))
  # As NNX's checkpointing guide does it: save the model's State, restore into the new model's abstract State.
  fused = make_fused()
  nnx.update(fused, _orbax_roundtrip(tmp_path / "state", nnx.state(ref), abstract))
  assert_trees_equal(pure_params(fused), pure_params(ref))
  np.testing.assert_allclose(loss(fused), want, rtol=1e-6)
  assert fused.head.kernel.get_metadata()["out_sharding"] == ("embed", "vocab")  # the head's metadata stays
  # As plain nested dicts of arrays.
  fused = make_fused()
  restored = _orbax_roundtrip(tmp_path / "pure", pure_params(ref), nnx.to_pure_dict(nnx.state(fused, nnx.Param)))
  params = nnx.state(fused, nnx.Param)
  nnx.replace_by_pure_dict(params, restored)
  nnx.update(fused, params)
  assert_trees_equal(pure_params(fused), pure_params(ref))
  np.testing.assert_allclose(loss(fused), want, rtol=1e-6)


def test_heads_hold_one_options_object_and_calls_override_it():
  """Each head holds one LossOptions (keyword-only in linen, so the head's own fields keep their positions); a
  call's keyword overrides its fields, None included."""
  for cls in (lce_linen.LMHead, lce_linen.TiedLMHead):
    assert {f.name: f for f in dataclasses.fields(cls)}["options"].kw_only, cls
  head = lce_linen.LMHead(VOCAB, True, options=LossOptions(logit_softcap=2.0))
  assert (head.vocab_size, head.use_bias, head.options.logit_softcap) == (VOCAB, True, 2.0)
  x, labels = jax.random.normal(jax.random.key(2), (5, EMBED)), jnp.arange(5, dtype=jnp.int32)
  params = head.init(jax.random.key(0), x, labels)
  plain = nn.meta.unbox(params)["params"]
  capped = linear_cross_entropy_np(x, plain["kernel"], labels, bias=plain["bias"], logit_softcap=2.0)["loss"]
  uncapped = linear_cross_entropy_np(x, plain["kernel"], labels, bias=plain["bias"])["loss"]
  assert rel_err(head.apply(params, x, labels), capped) < 1e-5
  assert rel_err(head.apply(params, x, labels, logit_softcap=None), uncapped) < 1e-5
  nhead = lce_nnx.LMHead(EMBED, VOCAB, options=LossOptions(logit_softcap=2.0), rngs=nnx.Rngs(0))
  want = linear_cross_entropy_np(x, nhead.kernel[...], labels)["loss"]
  assert rel_err(nhead(x, labels, logit_softcap=None), want) < 1e-5
  with pytest.raises(TypeError, match="LossOptions"):
    lce_nnx.LMHead(EMBED, VOCAB, options={"z_loss": 1.0}, rngs=nnx.Rngs(0))
