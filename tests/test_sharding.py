"""The op under shard_map on 8 simulated CPU devices: same loss and grads as one device, and no gathered head."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lce_flax import linear_cross_entropy
from lce_flax.sharding import DEFAULT_RULES, make_mesh, sharded_linear_cross_entropy
from tests.reference_np import linear_cross_entropy_np, rel_err
from tests.test_api import OPTIONS

# (data, fsdp, tensor)
MESHES = [(8, 1, 1), (2, 2, 2), (1, 1, 8), (4, 1, 2)]
# B = 8·5 tokens (5 per device on 8 devices), V = 8·37 (37 columns per shard: ragged against chunk 16),
# H = 24 (12 per FSDP shard).
B, H, V = 40, 24, 296
TOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def _eight_devices():
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices (tests/conftest.py sets XLA_FLAGS for 8 simulated CPU devices)")


def _inputs(seed, *, batch_shape=(B,), h=H, v=V, w_layout="hv", dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((*batch_shape, h)).astype(np.float32)
  w = (0.3 * rng.standard_normal((h, v) if w_layout == "hv" else (v, h))).astype(np.float32)
  b = rng.standard_normal(v).astype(np.float32)
  y = rng.integers(0, v, batch_shape)
  y = np.where(rng.random(batch_shape) < 0.2, -100, y).astype(np.int32)
  where = rng.random(batch_shape) < 0.85
  return jnp.asarray(x, dtype), jnp.asarray(w, dtype), jnp.asarray(b, dtype), jnp.asarray(y), jnp.asarray(where)


def _place(mesh, x, w, b, y, where, w_layout="hv"):
  """Puts the arrays where a sharded train step keeps them (the op reshards anything else itself)."""
  tok = NamedSharding(mesh, P(("data", "fsdp")))
  wspec = P("fsdp", "tensor") if w_layout == "hv" else P("tensor", "fsdp")
  return (jax.device_put(x, tok), jax.device_put(w, NamedSharding(mesh, wspec)),
          jax.device_put(b, NamedSharding(mesh, P("tensor"))), jax.device_put(y, tok), jax.device_put(where, tok))


def _compare(mesh_shape, *, seed=0, options=None, reduction="mean", w_layout="hv", batch_shape=(B,), chunk=16,
             use_where=True, oracle=True, impl="chunked", **op_kwargs):
  """Loss, aux and grads of x, w, bias: sharded vs the single-device op (≤ 1e-5) and vs the float64 oracle."""
  options = options or {}
  mesh = make_mesh(*mesh_shape)
  x, w, b, y, where = _inputs(seed, batch_shape=batch_shape, w_layout=w_layout)
  where = where if use_where else None
  cot = None
  if reduction == "none":
    cot = jnp.asarray(np.random.default_rng(seed + 1).standard_normal(batch_shape), jnp.float32)
  kw = dict(reduction=reduction, where=where, w_layout=w_layout, return_aux=True, **options)

  def run(f, *args):
    if cot is None:
      (loss, aux), grads = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(*args)
    else:
      loss, vjp, aux = jax.vjp(f, *args, has_aux=True)
      grads = vjp(cot)
    return loss, aux, grads

  kw.update(op_kwargs)
  single = lambda x, w, b: linear_cross_entropy(x, w, y, bias=b, impl=impl, chunk_size=chunk, **kw)
  l0, a0, g0 = run(single, x, w, b)
  xs, ws, bs, ys, wh = _place(mesh, x, w, b, y, where if where is not None else y > 0, w_layout)
  sharded = lambda x, w, b, y, wh: sharded_linear_cross_entropy(
      x, w, y, bias=b, mesh=mesh, impl=impl, chunk_size=chunk, **dict(kw, where=None if where is None else wh))
  l1, a1, g1 = jax.jit(lambda x, w, b, y, wh: run(functools.partial(sharded, y=y, wh=wh), x, w, b))(
      xs, ws, bs, ys, wh)
  assert l1.shape == l0.shape and l1.dtype == jnp.float32
  assert rel_err(l1, l0) <= TOL, (l1, l0)
  assert rel_err(a1.token_loss, a0.token_loss) <= TOL
  assert rel_err(a1.lse, a0.lse) <= TOL
  assert int(a1.num_tokens) == int(a0.num_tokens) and int(a1.num_correct) == int(a0.num_correct)
  for name, s, r in zip(("dx", "dw", "dbias"), g1, g0):
    assert s.shape == r.shape and s.dtype == r.dtype, name
    assert rel_err(s, r) <= TOL, (name, rel_err(s, r))
  if oracle:
    ref = linear_cross_entropy_np(np.asarray(x), np.asarray(w), np.asarray(y), bias=np.asarray(b), reduction=reduction,
                                  where=None if where is None else np.asarray(where), w_layout=w_layout,
                                  cotangent=None if cot is None else np.asarray(cot), **options)
    assert rel_err(l1, ref["loss"]) < 2e-5
    for name, s in zip(("dx", "dw", "dbias"), g1):
      assert rel_err(s, ref[name]) < 2e-5, name
  return l1, g1


@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda m: "x".join(map(str, m)))
def test_all_options_every_mesh(mesh_shape):
  _compare(mesh_shape, options=OPTIONS["all"], seed=1)


@pytest.mark.parametrize("opt", ["plain", "smoothing", "z_loss", "softcap"])
@pytest.mark.parametrize("mesh_shape", [(2, 2, 2), (4, 1, 2)], ids=lambda m: "x".join(map(str, m)))
def test_each_option(mesh_shape, opt):
  _compare(mesh_shape, options=OPTIONS[opt], seed=len(opt), reduction="sum" if opt == "z_loss" else "mean")


@pytest.mark.parametrize("mesh_shape", [(8, 1, 1), (2, 2, 2), (1, 1, 8)], ids=lambda m: "x".join(map(str, m)))
def test_reduction_none_with_cotangent(mesh_shape):
  """Per-token losses come back split like the labels; an arbitrary cotangent gives the right grads."""
  _compare(mesh_shape, options=OPTIONS["all"], reduction="none", seed=5, batch_shape=(8, 5))


@pytest.mark.parametrize("mesh_shape", [(2, 2, 2), (1, 1, 8)], ids=lambda m: "x".join(map(str, m)))
def test_vocab_parallel_lean(mesh_shape):
  """The recompute design of the vocab-parallel head (the default is the fast one), with ragged vocab chunks."""
  _compare(mesh_shape, options=OPTIONS["all"], seed=6, mode="lean")


def test_vocab_parallel_fast_refuses_aux_gradients():
  mesh = make_mesh(1, 1, 8)
  x, w, _, y, _ = _inputs(3)
  f = lambda x: sharded_linear_cross_entropy(x, w, y, mesh=mesh, return_aux=True)[1].lse.sum()
  with pytest.raises(ValueError, match="mode='lean'"):
    jax.grad(f)(x)


@pytest.mark.parametrize("mesh_shape", [(2, 2, 2), (1, 2, 4)], ids=lambda m: "x".join(map(str, m)))
def test_embed_table_layout(mesh_shape):
  """w_layout='vh' ([V, H], a tied embedding table): V split over tensor, H over fsdp."""
  _compare(mesh_shape, options=OPTIONS["z_loss"], w_layout="vh", seed=9, use_where=False)


@pytest.mark.parametrize("reduction", ["mean"])  # lean/"none" runs the same wrapper code path
def test_kernel_backend_under_data_parallel(reduction):
  """The data-parallel path runs any backend: Pallas Triton (interpret mode on CPU) on a 4×2×1 mesh."""
  try:
    linear_cross_entropy(jnp.ones((4, 8)), jnp.ones((8, 16)), jnp.zeros(4, jnp.int32), impl="pallas_triton",
                         interpret=True)
  except (NotImplementedError, ValueError, ImportError) as e:
    pytest.skip(f"pallas_triton cannot run here: {e}")
  mode = "lean" if reduction == "none" else None
  _compare((4, 2, 1), options=OPTIONS["all"], seed=4, reduction=reduction, batch_shape=(8, 5), oracle=False,
           impl="pallas_triton", interpret=True, mode=mode)


def test_mean_divides_by_global_count():
  """Devices hold very different numbers of counted tokens: the loss is the global token mean."""
  mesh = make_mesh(4, 1, 2)
  x, w, _, y, _ = _inputs(2)
  y = y.at[: B // 4].set(-100)  # the first data shard counts nothing at all
  y = y.at[B // 4: B // 4 + 3].set(7)
  ref = linear_cross_entropy(x, w, y)
  got = jax.jit(lambda x, w: sharded_linear_cross_entropy(x, w, y, mesh=mesh))(x, w)
  assert rel_err(got, ref) <= TOL
  xn, wn, yn = np.asarray(x), np.asarray(w), np.asarray(y)
  local_means = [linear_cross_entropy_np(xn[i:i + B // 4], wn, yn[i:i + B // 4])["loss"] for i in range(0, B, B // 4)]
  assert abs(float(np.mean(local_means)) - float(ref)) > 1e-3  # the mean of means differs: the check can fail


@pytest.mark.parametrize("mesh_shape", [(8, 1, 1), (1, 1, 8)], ids=lambda m: "x".join(map(str, m)))
def test_out_of_range_label_is_nan(mesh_shape):
  mesh = make_mesh(*mesh_shape)
  x, w, _, y, _ = _inputs(3)
  y = y.at[11].set(V + 5)
  f = lambda x, w: sharded_linear_cross_entropy(x, w, y, mesh=mesh, chunk_size=16)
  loss, (dx, dw) = jax.jit(jax.value_and_grad(f, (0, 1)))(x, w)
  assert np.isnan(loss) and np.isnan(dx[11]).all() and np.isnan(dw).any()
  assert not np.isnan(np.delete(np.asarray(dx), 11, axis=0)).any()


def _compiled_hlo(mesh, w_layout="hv", b=64, h=48, v=1000, mode=None):
  tok = NamedSharding(mesh, P(("data", "fsdp")))
  wspec = P("fsdp", "tensor") if w_layout == "hv" else P("tensor", "fsdp")
  xs = jax.ShapeDtypeStruct((b, h), jnp.float32, sharding=tok)
  ws = jax.ShapeDtypeStruct((h, v) if w_layout == "hv" else (v, h), jnp.float32, sharding=NamedSharding(mesh, wspec))
  ys = jax.ShapeDtypeStruct((b,), jnp.int32, sharding=tok)
  f = lambda x, w, y: sharded_linear_cross_entropy(x, w, y, mesh=mesh, w_layout=w_layout, label_smoothing=0.1,
                                                   mode=mode)
  return jax.jit(jax.value_and_grad(f, (0, 1))).lower(xs, ws, ys).compile().as_text()


@pytest.mark.parametrize("mesh_shape,w_layout,mode", [((1, 1, 8), "hv", "fast"), ((1, 1, 8), "hv", "lean"),
                                                      ((2, 2, 2), "hv", "fast"), ((4, 1, 2), "vh", "lean")])
def test_vocab_parallel_never_gathers_the_head(mesh_shape, w_layout, mode):
  """No all-gather, and no array at all, of the full [H, V] weight (or its gradient) in the compiled step."""
  h, v = 48, 1000
  hlo = _compiled_hlo(make_mesh(*mesh_shape), w_layout, mode=mode)
  full = f"f32[{h},{v}]" if w_layout == "hv" else f"f32[{v},{h}]"
  assert full not in hlo
  gathers = [line for line in hlo.splitlines() if "all-gather(" in line or "all-gather-start(" in line]
  for line in gathers:  # only the FSDP gather over H, to this device's V/t columns
    assert full not in line and f"{v}]" not in line.split("all-gather")[0], line
  assert ("all-gather" in hlo) == (mesh_shape[1] > 1)
  assert "all-reduce" in hlo  # the stats combine across the vocab axis


def test_hlo_check_can_fail():
  """With the vocab axis unused, every device holds the whole head: the string the test above looks for is there."""
  assert "f32[48,1000]" in _compiled_hlo(make_mesh(8, 1, 1))


@pytest.mark.parametrize(
    "shape_kw,match",
    [
        (dict(batch_shape=(36,)), r"x.shape\[0\]=36 .* divisible by the batch axes"),
        (dict(v=300), r"V=300 .* divisible by the size 8 of vocab_axis='tensor'"),
        (dict(h=25), r"H=25 .* divisible by the size 2 of fsdp_axis='fsdp'"),
    ],
)
def test_indivisible_shapes_raise(shape_kw, match):
  mesh = make_mesh(1, 2, 4) if "batch_shape" not in shape_kw else make_mesh(8, 1, 1)
  if "v" in shape_kw:
    mesh = make_mesh(1, 1, 8)
  x, w, _, y, _ = _inputs(0, **shape_kw)
  with pytest.raises(ValueError, match=match):
    sharded_linear_cross_entropy(x, w, y, mesh=mesh)


def test_bad_axis_names_raise():
  mesh = make_mesh(2, 2, 2)
  x, w, _, y, _ = _inputs(0)
  with pytest.raises(ValueError, match="'model' is not an axis"):
    sharded_linear_cross_entropy(x, w, y, mesh=mesh, vocab_axis="model")
  with pytest.raises(ValueError, match="cannot also be one of"):
    sharded_linear_cross_entropy(x, w, y, mesh=mesh, vocab_axis="data")


def test_make_mesh():
  m = make_mesh()
  assert dict(m.shape) == {"data": 8, "fsdp": 1, "tensor": 1}
  assert dict(make_mesh(-1, 2, 2).shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  assert dict(make_mesh(data=1, tensor=-1).shape) == {"data": 1, "fsdp": 1, "tensor": 8}
  with pytest.raises(ValueError, match="at most one -1"):
    make_mesh(-1, -1)
  with pytest.raises(ValueError, match="does not match 8 devices"):
    make_mesh(2, 2, 1)
  with pytest.raises(ValueError, match="cannot be split"):
    make_mesh(-1, 3)


def test_default_rules_map_an_lm():
  from flax import linen as nn
  assert nn.logical_to_mesh_axes(("embed", "vocab"), DEFAULT_RULES) == P("fsdp", "tensor")
  assert nn.logical_to_mesh_axes(("vocab", "embed"), DEFAULT_RULES) == P("tensor", "fsdp")
  assert nn.logical_to_mesh_axes(("batch", "length", "embed"), DEFAULT_RULES) == P(("data", "fsdp"), None, None)
  custom = (("batch", "data"), ("embed", None), ("vocab", "tensor"))
  assert nn.logical_to_mesh_axes(("embed", "vocab"), custom) == P(None, "tensor")


def test_explicit_axis_mesh():
  """A mesh from plain jax.make_mesh (Explicit axes) works too: the inputs are resharded to the op's layout."""
  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Explicit,) * 3)
  x, w, b, y, _ = _inputs(8)
  f0 = lambda x, w, b: linear_cross_entropy(x, w, y, bias=b, z_loss=1e-3)
  f1 = lambda x, w, b: sharded_linear_cross_entropy(x, w, y, bias=b, z_loss=1e-3, mesh=mesh)
  l0, g0 = jax.value_and_grad(f0, (0, 1, 2))(x, w, b)
  l1, g1 = jax.jit(jax.value_and_grad(f1, (0, 1, 2)))(x, w, b)
  assert rel_err(l1, l0) <= TOL
  for s, r in zip(g1, g0):
    assert rel_err(s, r) <= TOL


@pytest.mark.parametrize("mesh_shape", [(8, 1, 1), (1, 1, 8)], ids=lambda m: "x".join(map(str, m)))
def test_eager_call_and_grad(mesh_shape):
  """Outside jit too (the fast designs' custom_vjps need jit under shard_map; the wrapper adds it)."""
  mesh = make_mesh(*mesh_shape)
  x, w, _, y, _ = _inputs(10)
  l0, g0 = jax.value_and_grad(linear_cross_entropy, (0, 1))(x, w, y)
  l1, g1 = jax.value_and_grad(lambda x, w: sharded_linear_cross_entropy(x, w, y, mesh=mesh), (0, 1))(x, w)
  assert rel_err(l1, l0) <= TOL
  for s, r in zip(g1, g0):
    assert rel_err(s, r) <= TOL
