"""make_train_step on 8 simulated CPU devices: a sharded tiny LM trains exactly like the unsharded one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import lce_flax.linen
import lce_flax.nnx
from lce_flax import LossOptions, linear_cross_entropy
from lce_flax.sharding import DEFAULT_RULES, make_mesh, sharded_linear_cross_entropy
from lce_flax.train import TrainState, batch_sharding, global_batch, make_train_step, state_shardings
from tests.reference_np import linear_cross_entropy_np, rel_err

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
  assert s1.params["head"].get_value().sharding.spec == P(None, "tensor")  # fsdp has size 1 here: not used
  assert s1.params["dense"]["kernel"].get_value().sharding.spec == P(None, "tensor")
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


@pytest.mark.parametrize("sharded", [False, True])
def test_compiler_options_reach_the_step(sharded):
  """``compiler_options`` go to the step's compile: a misspelled name fails it, naming the name; the GPU scheduler
  option (a no-op on the CPU) trains exactly as without it, and ``step.lower`` compiles with it too."""
  mesh = make_mesh(2, 2, 2) if sharded else None
  model = TinyLM(mesh=mesh)
  batches = _batches(2)
  params = TinyLM().init(jax.random.key(0), batches[0]["tokens"], batches[0]["labels"])["params"]
  opt = optax.adam(1e-2)
  loss = lambda p, b: model.apply({"params": p}, b["tokens"], b["labels"])  # noqa: E731

  def run(options):
    state = TrainState.create(params, opt, mesh=mesh)
    step = make_train_step(loss, opt, mesh=mesh, compiler_options=options)
    losses = []
    for b in batches:
      state, m = step(state, b)
      losses.append(float(m["loss"]))
    return losses, step, state

  typo = {"xla_gpu_enable_latency_hiding_schedulr": True}
  with pytest.raises(Exception, match="xla_gpu_enable_latency_hiding_schedulr"):
    run(typo)
  base, _, state = run(None)
  got, _, _ = run({"xla_gpu_enable_latency_hiding_scheduler": True})
  assert got == base
  with pytest.raises(Exception, match="xla_gpu_enable_latency_hiding_schedulr"):  # the lowered step carries them
    make_train_step(loss, opt, mesh=mesh, compiler_options=typo).lower(state, batches[0]).compile()


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


# ------------------------------------------------------------------ the library's heads on an Explicit-axes mesh


def _explicit_mesh():
  """data × tensor = 2 × 4 (an "fsdp" axis of size 1 too, so every axis DEFAULT_RULES names exists)."""
  return jax.make_mesh((2, 1, 4), ("data", "fsdp", "tensor"), axis_types=(AxisType.Explicit,) * 3)


def _kernel_spec(kernel_axes):
  """Where DEFAULT_RULES put the head's kernel on the data × fsdp × tensor = 2 × 1 × 4 mesh: H over "fsdp" (the
  logical "embed" or the mesh's name), or over "data" and "fsdp" (``SPLIT_KERNEL_AXES``: split on the mesh's
  2 data devices too)."""
  if kernel_axes == lce_flax.linen.SPLIT_KERNEL_AXES:
    return P(("data", "fsdp"), "tensor")
  return P("fsdp", "tensor")


def _head_problem(seed):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(B, T, H)).astype(np.float32)
  labels = rng.integers(0, V, (B, T)).astype(np.int32)
  labels = np.where(rng.random((B, T)) < 0.2, -100, labels).astype(np.int32)
  return x, labels


def _check_head(loss, grads, kernel, bias, x, labels, grad_x):
  ref = linear_cross_entropy_np(np.asarray(x, np.float64), np.asarray(kernel, np.float64), labels,
                                bias=np.asarray(bias, np.float64), **OPTS)
  assert rel_err(loss, ref["loss"]) <= 1e-5, (float(loss), ref["loss"])
  assert rel_err(grads["kernel"], ref["dw"]) <= 1e-5
  assert rel_err(grads["bias"], ref["dbias"]) <= 1e-5
  assert rel_err(grad_x, ref["dx"]) <= 1e-5


@pytest.mark.parametrize("kernel_axes", [("embed", "vocab"), ("fsdp", "tensor"), lce_flax.linen.SPLIT_KERNEL_AXES],
                         ids=["logical", "mesh-names", "split"])
def test_linen_lmhead_on_explicit_mesh_matches_one_device(kernel_axes):
  """linen.LMHead under jit on a 2×4 Explicit mesh, parameters placed by their names through DEFAULT_RULES:
  the float64 NumPy loss and gradients, with the kernel's gradient left sharded like the kernel."""
  mesh = _explicit_mesh()
  x, labels = _head_problem(1)
  head = lce_flax.linen.LMHead(V, use_bias=True, kernel_axes=kernel_axes, bias_axes=kernel_axes[1:],
                               bias_init=nn.initializers.normal(0.5), options=LossOptions(**OPTS))
  boxed = head.init(jax.random.key(0), x, labels)["params"]
  shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, DEFAULT_RULES)
  params = jax.device_put(nn.unbox(boxed), shardings)
  spec = _kernel_spec(kernel_axes)
  assert params["kernel"].sharding.spec == spec
  assert params["bias"].sharding.spec == P("tensor")
  xs = jax.device_put(x, batch_sharding(mesh))
  ys = jax.device_put(labels, batch_sharding(mesh))

  def loss_fn(p, x):
    return head.apply({"params": p}, x, labels=ys)

  with jax.set_mesh(mesh):
    loss, (grads, gx) = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))(params, xs)
  assert jax.typeof(grads["kernel"]).sharding.spec == spec
  un = nn.unbox(boxed)
  _check_head(loss, grads, un["kernel"], un["bias"], x, labels, gx)


@pytest.mark.parametrize("kernel_axes", [("embed", "vocab"), ("fsdp", "tensor"), lce_flax.linen.SPLIT_KERNEL_AXES],
                         ids=["logical", "mesh-names", "split"])
def test_nnx_lmhead_on_explicit_mesh_matches_one_device(kernel_axes):
  """nnx.LMHead the same way: split, place the state by its names, merge inside jit."""
  mesh = _explicit_mesh()
  x, labels = _head_problem(2)
  head = lce_flax.nnx.LMHead(H, V, use_bias=True, kernel_axes=kernel_axes, bias_axes=kernel_axes[1:],
                             bias_init=nnx.initializers.normal(0.5), options=LossOptions(**OPTS), rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(head)
  kernel, bias = np.asarray(head.kernel[...]), np.asarray(head.bias[...])
  shardings = nn.logical_to_mesh_sharding(nnx.get_partition_spec(state), mesh, DEFAULT_RULES)
  state = jax.device_put(state, shardings)
  spec = _kernel_spec(kernel_axes)
  assert state["kernel"].get_value().sharding.spec == spec
  xs = jax.device_put(x, batch_sharding(mesh))
  ys = jax.device_put(labels, batch_sharding(mesh))

  def loss_fn(st, x):
    return nnx.merge(graphdef, st)(x, ys)

  with jax.set_mesh(mesh):
    loss, (grads, gx) = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))(state, xs)
  assert jax.typeof(grads["kernel"].get_value()).sharding.spec == spec
  grads = {k: np.asarray(grads[k].get_value()) for k in ("kernel", "bias")}
  _check_head(loss, grads, kernel, bias, x, labels, gx)


class HeadLM(nn.Module):
  """Embedding (one-hot matmul) → Dense + tanh → linen.LMHead; the head's kernel carries logical names."""

  @nn.compact
  def __call__(self, tokens, labels):
    table = self.param("embed", nn.initializers.normal(1.0), (V, H))
    h = jax.nn.one_hot(tokens, V, dtype=table.dtype) @ table
    h = jnp.tanh(nn.Dense(H)(h))
    return lce_flax.linen.LMHead(V, kernel_init=nn.initializers.normal(0.3), options=LossOptions(**OPTS))(h, labels)


def test_train_step_with_lmhead_on_explicit_mesh_matches_one_device():
  """make_train_step + linen.LMHead on the 2×4 Explicit mesh, with global_batch: the unsharded run's losses and
  parameters after three AdamW steps."""
  mesh = _explicit_mesh()
  batches = _batches(1) * 3  # one batch, three times: the loss must fall
  model = HeadLM()
  params = model.init(jax.random.key(0), batches[0]["tokens"], batches[0]["labels"])["params"]
  opt = optax.adamw(1e-2)
  loss_fn = lambda p, b: model.apply({"params": p}, b["tokens"], b["labels"])  # noqa: E731
  runs = {}
  for name, m in (("one", None), ("mesh", mesh)):
    state = TrainState.create(params, opt, mesh=m)
    step = make_train_step(loss_fn, opt, mesh=m)
    losses = []
    for b in batches:
      state, metrics = step(state, b if m is None else global_batch(jax.tree.map(np.asarray, b), m))
      losses.append(float(metrics["loss"]))
    runs[name] = (losses, state)
  (l0, s0), (l1, s1) = runs["one"], runs["mesh"]
  assert l0[-1] < l0[0]
  for a, b in zip(l1, l0):
    assert rel_err(a, b) <= 1e-5, (l1, l0)
  for a, b in zip(jax.tree.leaves(nn.unbox(s1.params)), jax.tree.leaves(nn.unbox(s0.params))):
    assert rel_err(a, b) <= 1e-5
  assert s1.params["LMHead_0"]["kernel"].value.sharding.spec == P(None, "tensor")  # fsdp (size 1) left out
