"""make_train_step on 8 simulated CPU devices: a sharded tiny LM trains exactly like the unsharded one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import PartitionSpec as P

from lce_flax import linear_cross_entropy
from lce_flax.sharding import make_mesh, sharded_linear_cross_entropy
from lce_flax.train import TrainState, make_train_step, state_shardings
from tests.reference_np import rel_err

V, H, B, T = 64, 16, 8, 6
OPTS = dict(z_loss=1e-3, label_smoothing=0.05)


@pytest.fixture(scope="module", autouse=True)
def _eight_devices():
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices (tests/conftest.py sets XLA_FLAGS for 8 simulated CPU devices)")


def _head_loss(h, kernel, labels, mesh):
  if mesh is None:
    return linear_cross_entropy(h, kernel, labels, **OPTS)
  return sharded_linear_cross_entropy(h, kernel, labels, mesh=mesh, **OPTS)


class TinyLM(nn.Module):
  """Embedding → Dense + tanh → fused head, every parameter with logical axis names."""

  mesh: jax.sharding.Mesh | None = None

  @nn.compact
  def __call__(self, tokens, labels):
    part = nn.with_logical_partitioning
    table = self.param("embed", part(nn.initializers.normal(1.0), ("vocab", "embed")), (V, H))
    h = jnp.take(table, tokens, axis=0)
    h = jnp.tanh(nn.Dense(H, kernel_init=part(nn.initializers.lecun_normal(), ("embed", "mlp")),
                          bias_init=part(nn.initializers.zeros, ("mlp",)))(h))
    kernel = self.param("head", part(nn.initializers.normal(0.3), ("embed", "vocab")), (H, V))
    return _head_loss(h, kernel, labels, self.mesh)


class TinyNNX(nnx.Module):
  def __init__(self, rngs: nnx.Rngs, mesh=None):
    self.mesh = mesh
    self.embed = nnx.Param(jax.random.normal(rngs.params(), (V, H)), out_sharding=("vocab", "embed"),
                           eager_sharding=False)
    self.dense = nnx.Linear(H, H, rngs=rngs, kernel_metadata=dict(out_sharding=("embed", "mlp"), eager_sharding=False))
    self.head = nnx.Param(0.3 * jax.random.normal(rngs.params(), (H, V)), out_sharding=("embed", "vocab"),
                          eager_sharding=False)

  def __call__(self, tokens, labels):
    h = jnp.tanh(self.dense(jnp.take(self.embed[...], tokens, axis=0)))
    return _head_loss(h, self.head[...], labels, self.mesh)


def _batches(n, ignore=True):
  rng = np.random.default_rng(0)
  out = []
  for _ in range(n):
    tokens = rng.integers(0, V, (B, T)).astype(np.int32)
    labels = rng.integers(0, V, (B, T)).astype(np.int32)
    if ignore:
      labels = np.where(rng.random((B, T)) < 0.2, -100, labels).astype(np.int32)
    out.append({"tokens": jnp.asarray(tokens), "labels": jnp.asarray(labels)})
  return out


def _train_linen(mesh, accum=1, steps=3, ignore=True):
  model = TinyLM(mesh=mesh)
  batches = _batches(steps, ignore)
  params = TinyLM().init(jax.random.key(0), batches[0]["tokens"], batches[0]["labels"])["params"]
  opt = optax.adamw(1e-2)
  state = TrainState.create(params, opt, mesh=mesh)
  step = make_train_step(lambda p, b: model.apply({"params": p}, b["tokens"], b["labels"]), opt, mesh=mesh,
                         grad_accum_steps=accum)
  losses = []
  for b in batches:
    state, m = step(state, b)
    losses.append(float(m["loss"]))
  return losses, state


def test_linen_sharded_matches_single_device():
  """Three AdamW steps with 2 micro-batches each: same losses and parameters on a 2×2×2 mesh as on one device."""
  mesh = make_mesh(2, 2, 2)
  l0, s0 = _train_linen(None, accum=2)
  l1, s1 = _train_linen(mesh, accum=2)
  assert l0[-1] < l0[0]  # it trains
  for a, b in zip(l1, l0):
    assert rel_err(a, b) <= 1e-5, (l1, l0)
  for a, b in zip(jax.tree.leaves(nn.unbox(s1.params)), jax.tree.leaves(nn.unbox(s0.params))):
    assert rel_err(a, b) <= 1e-5
  # parameters and their Adam moments sit where the logical axes say
  head = s1.params["head"]
  assert head.value.sharding.spec == P("fsdp", "tensor")
  assert s1.params["embed"].value.sharding.spec == P("tensor", "fsdp")
  mu = s1.opt_state[0].mu["head"]
  assert mu.value.sharding.spec == P("fsdp", "tensor")
  assert int(s1.step) == 3


def test_grad_accumulation_equals_full_batch():
  """With every token counted (equal counts per micro-batch), 4 micro-batches give the full-batch step."""
  l1, s1 = _train_linen(None, accum=1, steps=2, ignore=False)
  l4, s4 = _train_linen(None, accum=4, steps=2, ignore=False)
  for a, b in zip(l4, l1):
    assert rel_err(a, b) <= 1e-5
  for a, b in zip(jax.tree.leaves(nn.unbox(s4.params)), jax.tree.leaves(nn.unbox(s1.params))):
    assert rel_err(a, b) <= 1e-5
  # and it is not vacuous: a different number of steps gives different parameters
  _, s_other = _train_linen(None, accum=1, steps=1, ignore=False)
  assert rel_err(nn.unbox(s_other.params)["head"], nn.unbox(s1.params)["head"]) > 1e-3


def _train_nnx(mesh, steps=2):
  model = TinyNNX(nnx.Rngs(0), mesh=mesh)
  graphdef, params = nnx.split(model, nnx.Param)
  opt = optax.adam(1e-2)
  state = TrainState.create(params, opt, mesh=mesh)
  step = make_train_step(lambda p, b: nnx.merge(graphdef, p)(b["tokens"], b["labels"]), opt, mesh=mesh)
  losses = []
  for b in _batches(steps):
    state, m = step(state, b)
    losses.append(float(m["loss"]))
  return losses, state


def test_nnx_sharded_matches_single_device():
  l0, _ = _train_nnx(None)
  l1, s1 = _train_nnx(make_mesh(4, 1, 2))
  for a, b in zip(l1, l0):
    assert rel_err(a, b) <= 1e-5, (l1, l0)
  assert s1.params["head"].get_value().sharding.spec == P("fsdp", "tensor")  # fsdp has size 1 here
  assert s1.params["dense"]["kernel"].get_value().sharding.spec == P("fsdp", "tensor")
  assert s1.params["dense"]["bias"].get_value().sharding.spec == P()  # no names: replicated


def test_state_shardings_rules_and_fallbacks():
  params = TinyLM().init(jax.random.key(0), jnp.zeros((B, T), jnp.int32), jnp.zeros((B, T), jnp.int32))["params"]
  mesh = make_mesh(2, 2, 2)
  sh = state_shardings(params, mesh)
  assert sh["head"].value.spec == P("fsdp", "tensor")
  # custom rules: no FSDP, vocab over data
  sh = state_shardings(params, mesh, rules=(("embed", None), ("vocab", "data"), ("mlp", "tensor")))
  assert sh["head"].value.spec == P(None, "data")
  assert sh["Dense_0"]["bias"].value.spec == P("tensor")
  # an indivisible dim is replicated rather than rejected
  odd = {"w": nn.LogicallyPartitioned(jnp.zeros((3, 64)), ("embed", "vocab"))}
  assert state_shardings(odd, mesh)["w"].value.spec == P(None, "tensor")


def test_indivisible_batch_raises():
  mesh = make_mesh(2, 2, 2)
  params = TinyLM().init(jax.random.key(0), jnp.zeros((B, T), jnp.int32), jnp.zeros((B, T), jnp.int32))["params"]
  opt = optax.sgd(0.1)
  state = TrainState.create(params, opt, mesh=mesh)
  step = make_train_step(lambda p, b: TinyLM(mesh=mesh).apply({"params": p}, b["tokens"], b["labels"]), opt,
                         mesh=mesh, grad_accum_steps=3)
  with pytest.raises(ValueError, match="divisible by grad_accum_steps=3"):
    step(state, _batches(1)[0])


def test_vocab_parallel_train_step_never_holds_the_head():
  """The whole compiled step on a 1×1×8 mesh (grads, Adam update) keeps the [H, V] head split over V."""
  mesh = make_mesh(1, 1, 8)
  b = _batches(1)[0]
  params = TinyLM().init(jax.random.key(0), b["tokens"], b["labels"])["params"]
  opt = optax.adam(1e-2)
  state = TrainState.create(params, opt, mesh=mesh)
  step = make_train_step(lambda p, b: TinyLM(mesh=mesh).apply({"params": p}, b["tokens"], b["labels"]), opt,
                         mesh=mesh)
  hlo = step.lower(state, b).compile().as_text()
  assert f"f32[{H},{V // 8}]" in hlo  # the head shard is there...
  assert f"f32[{H},{V}]" not in hlo  # ...and the whole head never is
