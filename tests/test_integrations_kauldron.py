"""lce_flax.integrations.kauldron against kauldron's own loss on tiny gemma models (both are part of ``dev``).

A Gemma 2-like model (final-logit soft-cap) and a Gemma 3-like one (none), float32 and bfloat16 parameters:
kauldron's forward pass (``capture_intermediates=True``, as its train step) gives the context; the fused loss and
its gradient with respect to every parameter are compared with ``kd.losses.SoftmaxCrossEntropyWithIntLabels`` on
the model's own logits, with gemma's ``[B, L, 1]`` targets and masks.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gemma import gm
from kauldron import kd
from kauldron.train import train_step

from lce_flax import LossOptions
from lce_flax._impl import base
from lce_flax.integrations.kauldron import LinearCrossEntropy

V, D, B, L = 101, 32, 2, 7


def model(softcap: float | None, dtype) -> gm.nn.Transformer:
  config = gm.nn.config.TransformerConfig(
      num_embed=V, embed_dim=D, hidden_dim=48, num_heads=2, head_dim=16, num_kv_heads=1,
      final_logit_softcap=softcap, use_post_attn_norm=True, use_post_ffw_norm=True,
      attention_types=(gm.nn.config.AttentionType.LOCAL_SLIDING, gm.nn.config.AttentionType.GLOBAL),
      sliding_window_size=4)
  return gm.nn.Transformer(config=config, tokens="batch.input", dtype=dtype)


def batch(seed: int):
  rng = np.random.default_rng(seed)
  mask = rng.random((B, L, 1)) < 0.8
  mask[0, 0] = False
  return {"input": jnp.asarray(rng.integers(0, V, (B, L)), jnp.int32),
          "target": jnp.asarray(rng.integers(0, V, (B, L, 1)), jnp.int32),
          "loss_mask": jnp.asarray(mask)}


def rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


CASES = {"gemma2_softcap_f32": (0.5, jnp.float32), "gemma3_f32": (None, jnp.float32),
         "gemma2_softcap_bf16": (0.5, jnp.bfloat16)}


@pytest.mark.parametrize("name", list(CASES))
def test_loss_and_grads_match_kauldron(name):
  softcap, dtype = CASES[name]
  net = model(softcap, dtype)
  data = batch(0)
  params = net.init(jax.random.key(0), data["input"])["params"]
  params = jax.tree.map(lambda p: (p * 8.0).astype(p.dtype), params)  # logits of a few units: the 0.5 cap matters
  reference = kd.losses.SoftmaxCrossEntropyWithIntLabels(logits="preds.logits", labels="batch.target",
                                                         mask="batch.loss_mask")
  fused = LinearCrossEntropy(model=net, labels="batch.target", mask="batch.loss_mask")

  def loss(p, the_loss):
    ctx = kd.train.Context(step=0, batch=data, params=p, collections={})
    ctx = train_step.forward(ctx, model=net, rngs={}, is_training=True)
    return the_loss.get_state_from_context(ctx).compute()

  want, want_g = jax.jit(jax.value_and_grad(lambda p: loss(p, reference)))(params)
  got, got_g = jax.jit(jax.value_and_grad(lambda p: loss(p, fused)))(params)
  bf16 = dtype == jnp.bfloat16  # gemma rounds its logits to bf16, the fused op accumulates them in float32
  assert rel(got, want) < (1e-2 if bf16 else 2e-6), (float(got), float(want))
  flat_got = jax.tree_util.tree_flatten_with_path(got_g)[0]
  flat_want = dict(jax.tree_util.tree_flatten_with_path(want_g)[0])
  assert len(flat_got) == len(flat_want) > 5
  for path, g in flat_got:
    err = rel(g.astype(jnp.float32), flat_want[path].astype(jnp.float32))
    assert err < (5e-2 if bf16 else 2e-5), f"{jax.tree_util.keystr(path)}: {err:.2e}"
  assert fused._options("sum").logit_softcap == softcap  # read from the model's config


def test_weighting_mask_and_normalize_by_values():
  net = model(None, jnp.float32)
  data = batch(1)
  data["loss_mask"] = jnp.asarray(np.random.default_rng(1).random((B, L, 1)), jnp.float32)  # token weights
  params = net.init(jax.random.key(1), data["input"])["params"]

  @jax.jit
  def states(params):
    ctx = train_step.forward(kd.train.Context(step=0, batch=data, params=params, collections={}), model=net,
                             rngs={}, is_training=True)
    out = {}
    for normalize_by in ("mask", "values"):
      kw = dict(labels="batch.target", mask="batch.loss_mask", normalize_by=normalize_by, weight=0.5)
      out[normalize_by] = (
          LinearCrossEntropy(model=net, **kw).get_state_from_context(ctx),
          kd.losses.SoftmaxCrossEntropyWithIntLabels(logits="preds.logits", **kw).get_state_from_context(ctx))
    return out

  for got, want in states(params).values():
    assert rel(got.compute(), want.compute()) < 2e-6
    assert float(got.count) == float(want.count)


def test_weighting_mask_warns_once_naming_what_runs():
  """A floating mask hands kauldron per-token losses: a one-time warning names the design that runs for them (as
  explain_per_token and lce_flax.explain with reduction='none' do); a bool mask (the fused mean) does not warn."""
  net = model(None, jnp.float32)
  data = batch(2)
  params = net.init(jax.random.key(2), data["input"])["params"]
  ctx = train_step.forward(kd.train.Context(step=0, batch=data, params=params, collections={}), model=net, rngs={},
                           is_training=True)
  weights = jnp.asarray(np.random.default_rng(2).random((B, L, 1)), jnp.float32)

  def state(loss, mask):
    ctx_m = ctx.replace(batch=dict(data, loss_mask=mask))
    return jax.jit(lambda c: loss.get_state_from_context(c).compute())(ctx_m)

  base._WARNED.clear()
  fused = LinearCrossEntropy(model=net, labels="batch.target", mask="batch.loss_mask")
  d = fused.explain_per_token(ctx.interms["final_norm"]["__call__"][0], data["target"], params)
  assert (d.impl, d.mode, d.name) == ("chunked", "lean", "recompute")  # on this CPU
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    state(fused, data["loss_mask"])  # bool: the fused mean, nothing to say
  with pytest.warns(UserWarning, match=r"the mask is floating \(token weights\), so kauldron gets per-token losses "
                                       r"\(reduction='none'\), not the fused mean: impl='chunked' runs its lean "
                                       r"'recompute' design \(8·B·H·V FLOPs"):
    state(fused, weights)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    state(fused, weights * 0.5)  # once per design
  xla = LinearCrossEntropy(model=net, labels="batch.target", mask="batch.loss_mask", options=LossOptions(impl="xla"))
  with pytest.warns(UserWarning, match="impl='xla' runs its lean 'autodiff' design"):
    state(xla, weights)


def test_entropy_option_is_refused():
  net = model(None, jnp.float32)
  data = batch(3)
  params = net.init(jax.random.key(3), data["input"])["params"]
  loss = LinearCrossEntropy(model=net, labels="batch.target", options=LossOptions(entropy=True))
  with pytest.raises(ValueError, match="entropy=True has nowhere to go"):
    loss.get_state(jnp.ones((B, L, D)), data["target"], params)
