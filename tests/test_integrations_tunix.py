"""lce_flax.integrations.tunix against google-tunix's own code on tiny models (tunix is part of the ``dev`` extra).

Qwen3 (untied and tied, float32 and bfloat16 compute), Gemma 2 (tied, a final-logit soft-cap scaled down to the
tiny model) and Llama 3.2 (tied, no hidden-states flag): the fused ``loss_fn`` and its gradient with respect to
every parameter against tunix's own default SFT loss; the RL per-token log-probs (values and the gradient of a
GRPO-style objective) against tunix's ``compute_per_token_logps`` at temperatures 1 and 0.7, and the entropy of the
same op call (values and the gradient of a PPO loss with tunix's entropy bonus) against tunix's
``compute_entropy_from_logits``.
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

# Importing tunix's models turns flax's eager variable sharding off process-wide (flax_always_shard_variable), as
# its models need (their parameters carry mesh names and are built without a mesh). The other test files of a
# pytest worker rely on flax's default: it is restored here, and turned off only while a tunix model is built.
_EAGER = flax.config.flax_always_shard_variable
from tunix.models.gemma import model as gemma_lib  # noqa: E402
from tunix.models.llama3 import model as llama3_lib  # noqa: E402
from tunix.models.qwen3 import model as qwen3_lib  # noqa: E402
from tunix.rl import algo_core  # noqa: E402
from tunix.rl import common as rl_common  # noqa: E402
from tunix.sft import peft_trainer  # noqa: E402

from lce_flax.integrations import tunix as lce_tunix  # noqa: E402

flax.config.update("flax_always_shard_variable", _EAGER)

V, D, B, L = 101, 24, 2, 9  # a prime vocabulary, 2 x 8 predicted tokens


def qwen3(tied: bool, dtype) -> nnx.Module:
  config = qwen3_lib.ModelConfig(num_layers=1, vocab_size=V, embed_dim=D, hidden_dim=32, num_heads=2, head_dim=8,
                                 num_kv_heads=1, rope_theta=10_000, norm_eps=1e-6, use_tied_embedding=tied,
                                 dtype=dtype, param_dtype=jnp.float32)
  with nnx.use_eager_sharding(False):
    return qwen3_lib.Qwen3(config, rngs=nnx.Rngs(params=0))


def llama32_tied() -> nnx.Module:
  """Llama 3.2-style (``weight_tying``); its forward has no hidden-states flag: the final norm is captured."""
  config = llama3_lib.ModelConfig(num_layers=1, vocab_size=V, embed_dim=D, hidden_dim=32, num_heads=2, head_dim=8,
                                  num_kv_heads=1, rope_theta=10_000, norm_eps=1e-6, weight_tying=True)
  with nnx.use_eager_sharding(False):
    return llama3_lib.Llama3(config, rngs=nnx.Rngs(params=0))


def gemma2(softcap: float) -> nnx.Module:
  config = gemma_lib.ModelConfig(num_layers=2, num_embed=V, embed_dim=D, hidden_dim=32, num_heads=2, head_dim=8,
                                 num_kv_heads=1, final_logit_softcap=softcap, use_post_attn_norm=True,
                                 use_post_ffw_norm=True, attention_types=(gemma_lib.AttentionType.LOCAL_SLIDING,
                                                                          gemma_lib.AttentionType.GLOBAL),
                                 attn_logits_soft_cap=50.0, sliding_window_size=4)
  with nnx.use_eager_sharding(False):
    model = gemma_lib.Gemma(config, rngs=nnx.Rngs(params=0))
  # tunix draws the table with stddev 0.01 (checkpoints overwrite it): larger values, so the cap matters
  table = model.embedder.input_embedding
  table.set_value(jax.random.normal(jax.random.key(1), table.get_value().shape) * 3.0)
  return model


MODELS = {
    "qwen3_untied_f32": lambda: qwen3(False, jnp.float32),
    "qwen3_tied_f32": lambda: qwen3(True, jnp.float32),
    "qwen3_untied_bf16": lambda: qwen3(False, jnp.bfloat16),
    "gemma2_softcap": lambda: gemma2(2.0),
    "llama32_tied_f32": llama32_tied,
}
# the untied float32 Qwen3 is checked exactly by the log-probs test (values and gradients) instead
LOSS_CASES = ["qwen3_tied_f32", "qwen3_untied_bf16", "gemma2_softcap", "llama32_tied_f32"]


def batch(seed: int):
  rng = np.random.default_rng(seed)
  tokens = jnp.asarray(rng.integers(0, V, (B, L)), jnp.int32)
  mask = np.ones((B, L), bool)
  mask[0, :3] = False  # a prompt that is not trained on
  mask[1, -2:] = False  # padding
  positions = jnp.broadcast_to(jnp.arange(L), (B, L))
  attention_mask = jnp.broadcast_to(jnp.tril(jnp.ones((L, L), bool)), (B, L, L))
  return dict(input_tokens=tokens, input_mask=jnp.asarray(mask), positions=positions,
              attention_mask=attention_mask)


def rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def value_and_grads(fn, model, inputs):
  f = nnx.jit(nnx.value_and_grad(lambda m: fn(m, **inputs)))
  return f(model)


@pytest.mark.parametrize("name", LOSS_CASES)
def test_loss_fn_matches_tunix_default_loss(name):
  model = MODELS[name]()
  inputs = batch(0)
  want, want_g = value_and_grads(peft_trainer._default_loss_fn, model, inputs)
  got, got_g = value_and_grads(lce_tunix.loss_fn, model, inputs)
  bf16 = name.endswith("bf16")  # tunix rounds its logits to bf16, the fused op accumulates them in float32
  assert rel(got, want) < (5e-3 if bf16 else 2e-6), (float(got), float(want))
  flat_got, flat_want = dict(nnx.to_flat_state(got_g)), dict(nnx.to_flat_state(want_g))
  assert flat_got.keys() == flat_want.keys() and flat_got
  for path, g in flat_got.items():
    err = rel(g.get_value(), flat_want[path].get_value())
    assert err < (3e-2 if bf16 else 2e-5), f"{path}: {err:.2e}"


def test_softcap_and_dtype_are_read_from_the_model():
  model = gemma2(2.0)
  assert lce_tunix.softcap_of(model) == 2.0
  head, attr = lce_tunix.head_of(model)
  assert head is model.embedder and attr == "input_embedding"
  inputs = batch(1)

  @nnx.jit
  def both(m):
    h = lce_tunix.hidden_states(m, inputs["input_tokens"], inputs["positions"], inputs["attention_mask"])
    return (lce_tunix.head_loss(m, h[:, :-1], inputs["input_tokens"][:, 1:]),
            lce_tunix.head_loss(m, h[:, :-1], inputs["input_tokens"][:, 1:], logit_softcap=None))

  capped, uncapped = both(model)
  assert abs(float(capped) - float(uncapped)) > 0.1  # the cap changes the loss, so reading it matters
  q = qwen3(False, jnp.bfloat16)
  assert lce_tunix.head_of(q) == (q.lm_head, None) and lce_tunix.softcap_of(q) is None
  from lce_flax import adapters
  (w, _, layout), dtype = adapters.read_head(q.lm_head)
  assert layout == "hv" and w.shape == (D, V) and dtype == jnp.bfloat16


@pytest.mark.parametrize("name,temperature", [("qwen3_untied_f32", 1.0), ("gemma2_softcap", 0.7)])
def test_per_token_logps_match_tunix(name, temperature):
  model = MODELS[name]()
  rng = np.random.default_rng(2)
  pad, eos = 0, 1
  prompt = rng.integers(2, V, (B, 5))
  prompt[0, :2] = pad  # left-padded prompt
  completion = rng.integers(2, V, (B, 6))
  completion[1, -2:] = pad
  prompt, completion = jnp.asarray(prompt, jnp.int32), jnp.asarray(completion, jnp.int32)
  graphdef, state = nnx.split(model)
  want = rl_common.compute_per_token_logps(graphdef, state, prompt, completion, pad, eos, temperature=temperature)
  got = nnx.jit(lambda m: lce_tunix.per_token_logps(m, prompt, completion, pad, eos, temperature=temperature))(model)
  assert got.shape == want.shape == completion.shape
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
  # the gradient of a GRPO-style objective through the fused log-probs equals that through tunix's
  weights = jnp.asarray(rng.standard_normal(completion.shape), jnp.float32)

  def objective(m, fused):
    if fused:
      lp = lce_tunix.per_token_logps(m, prompt, completion, pad, eos, temperature=temperature, stop_gradient=False)
    else:
      gd, st = nnx.split(m)
      lp = rl_common.compute_per_token_logps(gd, st, prompt, completion, pad, eos, temperature=temperature,
                                             stop_gradient=False)
    return jnp.sum(jnp.exp(lp - jax.lax.stop_gradient(lp)) * weights)

  g_got = dict(nnx.to_flat_state(nnx.jit(nnx.grad(lambda m: objective(m, True)))(model)))
  g_want = dict(nnx.to_flat_state(nnx.jit(nnx.grad(lambda m: objective(m, False)))(model)))
  for path, g in g_got.items():
    assert rel(g.get_value(), g_want[path].get_value()) < 2e-5, path


def test_per_token_entropy_matches_the_models_logits():
  model = gemma2(2.0)
  rng = np.random.default_rng(3)
  prompt = jnp.asarray(rng.integers(2, V, (B, 4)), jnp.int32)
  completion = jnp.asarray(rng.integers(2, V, (B, 5)), jnp.int32)
  graphdef, state = nnx.split(model)
  _, logits = rl_common.compute_per_token_logps(graphdef, state, prompt, completion, 0, 1, temperature=0.8,
                                                return_logits=True)
  z = np.asarray(logits, np.float64)  # tunix's own capped logits / T, upcast
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  want = -(p * np.log(p)).sum(-1)
  got = lce_tunix.per_token_entropy(model, prompt, completion, 0, 1, temperature=0.8, vocab_chunk=16)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name,temperature", [("qwen3_untied_f32", 1.0), ("gemma2_softcap", 0.7)])
def test_entropy_of_the_logps_call_matches_tunix(name, temperature):
  """per_token_logps(return_entropy=True): the op's Aux.entropy equals tunix's compute_entropy_from_logits of the
  logits compute_per_token_logps returns (capped, divided by T), and the gradient of tunix's PPO objective (clipped
  ratio, minus entropy_coef times the masked mean entropy, as ppo_policy_loss_fn) through the fused log-probs and
  entropy equals that through tunix's."""
  model = MODELS[name]()
  rng = np.random.default_rng(4)
  pad, eos = 0, 1
  prompt = rng.integers(2, V, (B, 5))
  prompt[1, :2] = pad
  completion = rng.integers(2, V, (B, 6))
  completion[0, -3:] = pad
  prompt, completion = jnp.asarray(prompt, jnp.int32), jnp.asarray(completion, jnp.int32)
  mask = completion != pad
  graphdef, state = nnx.split(model)
  _, logits = rl_common.compute_per_token_logps(graphdef, state, prompt, completion, pad, eos, temperature=temperature,
                                                return_logits=True)
  want = algo_core.compute_entropy_from_logits(logits)
  _, got = nnx.jit(lambda m: lce_tunix.per_token_logps(m, prompt, completion, pad, eos, temperature=temperature,
                                                       return_entropy=True))(model)
  assert got.shape == want.shape == completion.shape
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
  assert float(jnp.std(want)) > 5e-3  # entropies that differ from token to token (by 250x the tolerance)
  advantages = jnp.asarray(rng.standard_normal(completion.shape), jnp.float32)
  old = jnp.asarray(-4.6 + 0.1 * rng.standard_normal(completion.shape), jnp.float32)

  def objective(m, fused, entropy_coef=0.5):
    if fused:
      lp, ent = lce_tunix.per_token_logps(m, prompt, completion, pad, eos, temperature=temperature,
                                          stop_gradient=False, return_entropy=True)
    else:
      gd, st = nnx.split(m)
      lp, lg = rl_common.compute_per_token_logps(gd, st, prompt, completion, pad, eos, temperature=temperature,
                                                 stop_gradient=False, return_logits=True)
      ent = algo_core.compute_entropy_from_logits(lg)
    ratio = jnp.exp(lp - old)
    pg = jnp.maximum(-ratio * advantages, -jnp.clip(ratio, 0.8, 1.2) * advantages)
    return algo_core.masked_mean(pg, mask) - entropy_coef * algo_core.masked_mean(ent, mask)

  grads = lambda fused, coef=0.5: dict(nnx.to_flat_state(nnx.jit(nnx.grad(
      lambda m: objective(m, fused, coef)))(model)))
  g_got, g_want = grads(True), grads(False)
  assert g_got.keys() == g_want.keys() and g_got
  for path, g in g_got.items():
    assert rel(g.get_value(), g_want[path].get_value()) < 2e-5, path
  # the entropy bonus weighs in those gradients: without it they differ
  no_bonus = grads(True, 0.0)
  assert max(rel(no_bonus[p].get_value(), g_want[p].get_value()) for p in g_want) > 1e-2
