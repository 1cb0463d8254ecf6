"""The op on 8 simulated CPU devices: the explicit form (``sharded_linear_cross_entropy``), Explicit-axis types,
and the automatic path (Auto axes under ``jit``: the custom_partitioning rule of ``lce_flax._partition``). Same
loss and grads as one device, no gathered head or tokens, and the kernels' custom calls partitioned for GPU."""

from __future__ import annotations

import functools
import math
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lce_flax import linear_cross_entropy
from lce_flax.sharding import DEFAULT_RULES, make_mesh, sharded_linear_cross_entropy
from tests._checks import MOSAIC_SMALL, OPTIONS, chunk_kw, tolerances
from tests.reference_np import linear_cross_entropy_np, rel_err

# (data, fsdp, tensor)
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

  kw.update(op_kwargs, **chunk_kw(chunk, op_kwargs.get("mode"), reduction))
  single = lambda x, w, b: linear_cross_entropy(x, w, y, bias=b, impl=impl, **kw)
  l0, a0, g0 = run(single, x, w, b)
  xs, ws, bs, ys, wh = _place(mesh, x, w, b, y, where if where is not None else y > 0, w_layout)
  sharded = lambda x, w, b, y, wh: sharded_linear_cross_entropy(
      x, w, y, bias=b, mesh=mesh, impl=impl, **dict(kw, where=None if where is None else wh))
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


@pytest.mark.parametrize("mesh_shape", [(2, 2, 2), (1, 1, 8)], ids=lambda m: "x".join(map(str, m)))
def test_all_options_every_mesh(mesh_shape):
  _compare(mesh_shape, options=OPTIONS["all"], seed=1)


@pytest.mark.parametrize("opt", ["smoothing", "z_loss"])
@pytest.mark.parametrize("mesh_shape", [(2, 2, 2)], ids=lambda m: "x".join(map(str, m)))
def test_each_option(mesh_shape, opt):
  _compare(mesh_shape, options=OPTIONS[opt], seed=len(opt), reduction="sum" if opt == "z_loss" else "mean")


@pytest.mark.parametrize("mesh_shape", [(2, 2, 2), (1, 1, 8)], ids=lambda m: "x".join(map(str, m)))
def test_reduction_none_with_cotangent(mesh_shape):
  """Per-token losses come back split like the labels; an arbitrary cotangent gives the right grads."""
  _compare(mesh_shape, options=OPTIONS["all"], reduction="none", seed=5, batch_shape=(8, 5))


@pytest.mark.parametrize("mesh_shape", [(2, 2, 2)], ids=lambda m: "x".join(map(str, m)))
def test_vocab_parallel_lean(mesh_shape):
  """The recompute design of the vocab-parallel head (the default is the fast one), with ragged vocab chunks."""
  _compare(mesh_shape, options=OPTIONS["all"], seed=6, mode="lean")


@pytest.mark.parametrize("mesh_shape", [(1, 1, 8), (4, 1, 2)], ids=lambda m: "x".join(map(str, m)))
def test_aux_gradients(mesh_shape):
  """A reduced loss refuses gradients of its aux outputs (never drops them); reduction='none' differentiates the
  lse too, as on one device."""
  mesh = make_mesh(*mesh_shape)
  x, w, _, y, _ = _inputs(3)
  f = lambda x: sharded_linear_cross_entropy(x, w, y, mesh=mesh, return_aux=True)[1].lse.sum()
  with pytest.raises(ValueError, match="reduction='none'"):
    jax.grad(f)(x)
  cot = jnp.asarray(np.random.default_rng(4).standard_normal(B), jnp.float32)

  def g(op, x, w):
    loss, aux = op(x, w)
    return (loss * cot).sum() + (0.5 * aux.lse * cot[::-1]).sum()
  kw = dict(reduction="none", return_aux=True, z_loss=1e-3)
  ref = jax.grad(functools.partial(g, lambda x, w: linear_cross_entropy(x, w, y, impl="xla", **kw)), (0, 1))(x, w)
  got = jax.jit(jax.grad(functools.partial(
      g, lambda x, w: sharded_linear_cross_entropy(x, w, y, mesh=mesh, vocab_chunk=16, **kw)), (0, 1)))(x, w)
  for s, r in zip(got, ref):
    assert rel_err(s, r) <= TOL


@pytest.mark.parametrize("mesh_shape", [(1, 2, 4)], ids=lambda m: "x".join(map(str, m)))
def test_embed_table_layout(mesh_shape):
  """w_layout='vh' ([V, H], a tied embedding table): V split over tensor, H over fsdp."""
  _compare(mesh_shape, options=OPTIONS["z_loss"], w_layout="vh", seed=9, use_where=False)


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


@pytest.mark.parametrize("mesh_shape", [(1, 1, 8)], ids=lambda m: "x".join(map(str, m)))
def test_out_of_range_label_is_nan(mesh_shape):
  mesh = make_mesh(*mesh_shape)
  x, w, _, y, _ = _inputs(3)
  y = y.at[11].set(V + 5)
  f = lambda x, w: sharded_linear_cross_entropy(x, w, y, mesh=mesh, token_chunk=16)
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
  with pytest.raises(ValueError, match="'model' is not an axis"):
    sharded_linear_cross_entropy(x, w, y, mesh=mesh, fsdp_axis=("fsdp", "model"))
  with pytest.raises(ValueError, match="cannot be \\(or hold\\) the vocab axis"):
    sharded_linear_cross_entropy(x, w, y, mesh=mesh, fsdp_axis=("data", "tensor"))


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
  from lce_flax.linen import SPLIT_KERNEL_AXES
  assert nn.logical_to_mesh_axes(SPLIT_KERNEL_AXES, DEFAULT_RULES) == P(("data", "fsdp"), "tensor")
  custom = (("batch", "data"), ("embed", None), ("vocab", "tensor"))
  assert nn.logical_to_mesh_axes(("embed", "vocab"), custom) == P(None, "tensor")


@pytest.mark.parametrize("mesh_shape", [(8, 1, 1)], ids=lambda m: "x".join(map(str, m)))
def test_eager_call_and_grad(mesh_shape):
  """Outside jit too (the fast designs' custom_vjps need jit under shard_map; the wrapper adds it)."""
  mesh = make_mesh(*mesh_shape)
  x, w, _, y, _ = _inputs(10)
  l0, g0 = jax.value_and_grad(linear_cross_entropy, (0, 1))(x, w, y)
  l1, g1 = jax.value_and_grad(lambda x, w: sharded_linear_cross_entropy(x, w, y, mesh=mesh), (0, 1))(x, w)
  assert rel_err(l1, l0) <= TOL
  for s, r in zip(g1, g0):
    assert rel_err(s, r) <= TOL


# ------------------------------------------------------------------------------ the automatic path (Auto axes)

from jax.sharding import AxisType  # noqa: E402

from lce_flax import _partition  # noqa: E402

AB, AH, AV = 16, 64, 136  # tiny: interpret-mode kernels are slow


def _mosaic_small():
  from lce_flax._impl.pallas_mosaic import Config
  return Config(**MOSAIC_SMALL)


def _mesh(shape, axis_type=AxisType.Auto):
  return jax.make_mesh(shape, ("data", "fsdp", "tensor"), axis_types=(axis_type,) * 3)


def _auto_inputs(seed, dtype=jnp.float32, w_layout="hv", batch_shape=(AB,)):
  x, w, b, y, where = _inputs(seed, batch_shape=batch_shape, h=AH, v=AV, w_layout=w_layout)
  return x.astype(dtype), w.astype(dtype), b.astype(dtype), y, where


def _step(reduction, cot, y, where, kw):
  """value_and_grad (or vjp with ``cot`` for reduction='none') of x, w, bias through the op."""
  def loss(x, w, b, y, wh):
    out, aux = linear_cross_entropy(x, w, y, bias=b, where=wh if where else None, reduction=reduction,
                                    return_aux=True, **kw)
    return ((out * cot).sum() if reduction == "none" else out), aux
  return lambda x, w, b, y, wh: jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(x, w, b, y, wh)


def _auto_compare(mesh_shape, tok, wspec, *, axis_type=AxisType.Auto, impl="chunked", options=None,
                  reduction="mean", dtype=jnp.float32, tol=TOL, where=True, w_layout="hv", batch_shape=(AB,),
                  seed=0, **kw):
  kw = dict(impl=impl, w_layout=w_layout, **(options or {}), **kw)
  if impl in ("pallas_triton", "pallas_mosaic"):  # (interpret mode runs anywhere: nothing to skip)
    kw["interpret"] = True
  if impl == "pallas_mosaic":
    kw["config"] = _mosaic_small()
  x, w, b, y, wh = _auto_inputs(seed, dtype, w_layout, batch_shape)
  cot = jnp.asarray(np.random.default_rng(seed + 1).standard_normal(batch_shape), jnp.float32)
  step = _step(reduction, cot, y, where, kw)
  (l0, a0), g0 = step(x, w, b, y, wh)
  mesh = _mesh(mesh_shape, axis_type)
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  args = (put(x, P(tok)), put(w, wspec), put(b, P()), put(y, P(tok)), put(wh, P(tok)))
  with jax.set_mesh(mesh):
    f = jax.jit(step)
    (l1, a1), g1 = f(*args)
    lowered = f.lower(*args)
  assert rel_err(l1, l0) <= tol, (l1, l0)
  assert rel_err(a1.token_loss, a0.token_loss) <= tol and rel_err(a1.lse, a0.lse) <= tol
  assert int(a1.num_tokens) == int(a0.num_tokens) and int(a1.num_correct) == int(a0.num_correct)
  for name, s, r in zip(("dx", "dw", "dbias"), g1, g0):
    assert s.shape == r.shape and s.dtype == r.dtype, name
    assert rel_err(s, r) <= tol, (name, rel_err(s, r))
  # and the implementation itself against the float64 oracle (on the inputs rounded to their dtype)
  up = lambda a: np.asarray(jnp.asarray(a).astype(jnp.float32))
  ref = linear_cross_entropy_np(up(x), up(w), np.asarray(y), bias=up(b), reduction=reduction,
                                where=np.asarray(wh) if where else None, w_layout=w_layout,
                                cotangent=np.asarray(cot) if reduction == "none" else None, **(options or {}))
  loss_tol, grad_tol = tolerances(dtype)
  assert rel_err(a1.token_loss, ref["token_loss"]) <= loss_tol and rel_err(a1.lse, ref["lse"]) <= loss_tol
  for name, s in zip(("dx", "dw", "dbias"), g1):
    assert rel_err(s, ref[name]) <= grad_tol, (name, rel_err(s, ref[name]))
  return lowered


# (mesh, token axes, w spec): data×tensor 8×1, 2×4, 1×8 and data×fsdp×tensor 2×2×2
LAYOUTS = {
    "8x1x1-dp": ((8, 1, 1), "data", P()),
    "2x1x4-dp-h-over-tensor": ((2, 1, 4), "data", P("tensor", None)),  # H over an axis the tokens are not on
    "1x1x8-tokens-over-tensor": ((1, 1, 8), ("data", "tensor"), P()),
    "2x2x2-fsdp": ((2, 2, 2), ("data", "fsdp"), P("fsdp", None)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_auto_chunked_every_layout(layout):
  mesh_shape, tok, wspec = LAYOUTS[layout]
  lowered = _auto_compare(mesh_shape, tok, wspec, options=OPTIONS["all"], seed=1)
  assert "CustomSPMDPartitioning" in lowered.as_text()


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_auto_reductions(reduction):
  _auto_compare((2, 2, 2), ("data", "fsdp"), P("fsdp", None), options=OPTIONS["all"], reduction=reduction, seed=2,
                batch_shape=(4, 4))


@pytest.mark.parametrize("opt", ["smoothing", "z_loss", "softcap"])
def test_auto_each_option(opt):
  _auto_compare((2, 1, 4), "data", P(), options=OPTIONS[opt], seed=3, where=False)


def test_auto_embed_table_layout():
  _auto_compare((2, 2, 2), ("data", "fsdp"), P(None, "fsdp"), w_layout="vh", options=OPTIONS["z_loss"], seed=4)


@pytest.mark.parametrize("layout", ["2x2x2-fsdp"])
def test_auto_pallas_triton(layout):
  mesh_shape, tok, wspec = LAYOUTS[layout]
  _auto_compare(mesh_shape, tok, wspec, impl="pallas_triton", options=OPTIONS["all"], seed=5)


def test_auto_pallas_triton_lean_none():
  _auto_compare((2, 2, 2), ("data", "fsdp"), P("fsdp", None), impl="pallas_triton", reduction="none", seed=6)


def test_auto_impl_auto_and_x_hidden_sharded():
  """x's H dim sharded: resharded to H-replicated (its own tokens' H slices), not an error and not a token gather."""
  x, w, b, y, wh = _auto_inputs(8)
  mesh = _mesh((2, 1, 4))
  l0, g0 = jax.value_and_grad(lambda x, w: linear_cross_entropy(x, w, y), (0, 1))(x, w)
  xs = jax.device_put(x, NamedSharding(mesh, P("data", "tensor")))
  with jax.set_mesh(mesh):
    l1, g1 = jax.jit(jax.value_and_grad(lambda x, w: linear_cross_entropy(x, w, y), (0, 1)))(xs, w)
  assert rel_err(l1, l0) <= TOL and all(rel_err(s, r) <= TOL for s, r in zip(g1, g0))


@pytest.mark.parametrize("impl", ["chunked", "pallas_triton"])
def test_explicit_axes_match_one_device(impl):
  """Explicit axes: the op runs per shard from the types (data/FSDP through the same per-shard body)."""
  _auto_compare((2, 2, 2), ("data", "fsdp"), P("fsdp", None), axis_type=AxisType.Explicit, impl=impl,
                options=OPTIONS["all"], seed=9)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=str)
@pytest.mark.parametrize("wspec", [P(("data", "fsdp"), None), P(("data", "fsdp"), "tensor")], ids=str)
def test_h_over_two_axes(wspec, axis_type):
  """w's H split over both axes the tokens are on (a head whose parameters and optimizer state are split over
  every data-parallel axis): gathered over the two, its gradient reduce-scattered back over them; with and without
  the vocabulary split over "tensor", on Explicit axes (the layout read from the types) and Auto ones (the
  partitioning rule)."""
  lowered = _auto_compare((2, 2, 2), ("data", "fsdp"), wspec, axis_type=axis_type, options=OPTIONS["all"],
                          seed=16, token_chunk=16)
  hlo = lowered.compile().as_text()
  assert "all-gather" in hlo and "reduce-scatter" in hlo


def test_explicit_axes_vocab_parallel():
  _auto_compare((2, 2, 2), ("data", "fsdp"), P("fsdp", "tensor"), axis_type=AxisType.Explicit,
                options=OPTIONS["z_loss"], seed=10, token_chunk=16)


# vocab parallel under Auto axes: w's V over "tensor" (with tokens over data, and H over fsdp)
VOCAB_LAYOUTS = {
    "1x1x8": ((1, 1, 8), None, P(None, "tensor")),
    "2x1x4": ((2, 1, 4), "data", P(None, "tensor")),
    "2x2x2-fsdp": ((2, 2, 2), ("data", "fsdp"), P("fsdp", "tensor")),
}


@pytest.mark.parametrize("mode", ["fast", "lean"])
@pytest.mark.parametrize("layout", list(VOCAB_LAYOUTS))
def test_auto_vocab_parallel_chunked(layout, mode):
  mesh_shape, tok, wspec = VOCAB_LAYOUTS[layout]
  _auto_compare(mesh_shape, tok, wspec, options=OPTIONS["all"], seed=11, mode=mode, **chunk_kw(8, mode))


@pytest.mark.parametrize("impl,reduction", [("pallas_triton", "mean"), ("pallas_triton", "none"), ("xla", "sum")])
def test_auto_vocab_parallel_kernels(impl, reduction):
  """The kernels on each device's columns: their forward stats combined across "tensor", their backward run with
  the global lse (impl="pallas_triton" has only the lean design, so no fallback is involved)."""
  mesh_shape, tok, wspec = VOCAB_LAYOUTS["2x2x2-fsdp" if reduction != "none" else "2x1x4"]
  _auto_compare(mesh_shape, tok, wspec, impl=impl, options=OPTIONS["all"], reduction=reduction, seed=12,
                batch_shape=(4, 4) if reduction == "none" else (AB,))


@pytest.mark.parametrize("mesh_shape,tok,wspec", [((1, 1, 8), "data", P(None, "tensor")),
                                                   ((1, 2, 4), ("data", "fsdp"), P("data", "tensor")),
                                                   ((1, 1, 1), "data", P("fsdp", "tensor"))])
def test_explicit_size_one_axes(mesh_shape, tok, wspec):
  """Arrays typed as split over Explicit axes of size 1 (tokens over "data" = 1, w's H over "data" = 1, a 1-device
  mesh) run as if those axes were absent."""
  devices = jax.devices()[:math.prod(mesh_shape)]
  x, w, b, y, wh = _auto_inputs(15)
  mesh = jax.make_mesh(mesh_shape, ("data", "fsdp", "tensor"), axis_types=(AxisType.Explicit,) * 3,
                       devices=devices)
  l0, g0 = jax.value_and_grad(lambda x, w: linear_cross_entropy(x, w, y, bias=b, z_loss=1e-3), (0, 1))(x, w)
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  with jax.set_mesh(mesh):
    f = jax.jit(jax.value_and_grad(lambda x, w, y, b: linear_cross_entropy(x, w, y, bias=b, z_loss=1e-3), (0, 1)))
    l1, g1 = f(put(x, P(tok)), put(w, wspec), put(y, P(tok)), put(b, P()))
  assert rel_err(l1, l0) <= TOL and all(rel_err(s, r) <= TOL for s, r in zip(g1, g0))


def test_explicit_axes_vocab_parallel_kernels():
  _auto_compare((2, 2, 2), ("data", "fsdp"), P("fsdp", "tensor"), axis_type=AxisType.Explicit, impl="pallas_triton",
                options=OPTIONS["all"], seed=14)


def test_auto_vocab_parallel_never_gathers_the_head():
  for mesh_shape, tok, wspec in VOCAB_LAYOUTS.values():
    hlo = _auto_hlo(mesh_shape, tok, wspec)
    assert "f32[48,1000]" not in hlo  # neither w nor dw whole, anywhere
    assert not any("f32[64,48]" in g for g in _gathers(hlo))  # nor all tokens' activations
  assert "f32[48,1000]" in _auto_hlo((8, 1, 1), "data", P())  # (the check can fail: replicated w is whole)


def test_single_device_path_unchanged(monkeypatch):
  """No mesh: the old path exactly (no custom_partitioning, no custom_vjp of _partition) for a design XLA splits by
  itself (lean), and for any design in a process with one device; under an Auto-axis mesh, the partitioned form."""
  from lce_flax import explain
  x, w, b, y, wh = _auto_inputs(12)
  jaxpr = lambda **kw: str(jax.make_jaxpr(lambda x, w: linear_cross_entropy(x, w, y, **kw))(x, w))
  assert "custom_partitioning" not in jaxpr(mode="lean")
  assert "custom_partitioning" in jaxpr()  # this process has 8 devices: the token loop is partitioned
  with jax.set_mesh(_mesh((8, 1, 1))):
    assert "custom_partitioning" in jaxpr() and "custom_partitioning" in jaxpr(mode="lean")
  monkeypatch.setattr(jax, "device_count", lambda *a: 1)
  assert "custom_partitioning" not in jaxpr()
  assert not any("devices" in n or "partition" in n for n in explain(x, w, y).notes)  # one device: nothing to say


def _auto_hlo(mesh_shape, tok, wspec, impl="chunked", b=64, h=48, v=1000):
  mesh = _mesh(mesh_shape)
  xs = jax.ShapeDtypeStruct((b, h), jnp.float32, sharding=NamedSharding(mesh, P(tok)))
  ws = jax.ShapeDtypeStruct((h, v), jnp.float32, sharding=NamedSharding(mesh, wspec))
  ys = jax.ShapeDtypeStruct((b,), jnp.int32, sharding=NamedSharding(mesh, P(tok)))
  f = lambda x, w, y: linear_cross_entropy(x, w, y, impl=impl, label_smoothing=0.1)
  with jax.set_mesh(mesh):
    return jax.jit(jax.value_and_grad(f, (0, 1))).lower(xs, ws, ys).compile().as_text()


def _gathers(hlo):
  return [line for line in hlo.splitlines() if "all-gather(" in line or "all-gather-start(" in line]


@pytest.mark.parametrize("mesh_shape,tok", [((8, 1, 1), "data"), ((2, 1, 4), ("data", "tensor"))])
def test_auto_data_parallel_gathers_nothing(mesh_shape, tok):
  """w replicated: no all-gather at all (no tokens' [B, H], no head); dw is all-reduced; per-device shapes."""
  hlo = _auto_hlo(mesh_shape, tok, P())
  assert not _gathers(hlo)
  n = math.prod(mesh_shape[:1]) * (mesh_shape[2] if isinstance(tok, tuple) else 1)
  assert f"f32[{64 // n},48]" in hlo  # each device's tokens
  assert "all-reduce" in hlo


def test_auto_fsdp_gathers_only_w_over_fsdp():
  hlo = _auto_hlo((2, 2, 2), ("data", "fsdp"), P("fsdp", None))
  gathers = _gathers(hlo)
  assert gathers and all("f32[48,1000]" in g and "{'fsdp'}" in g for g in gathers), gathers  # w's H, per call
  assert not any("f32[64,48]" in g for g in gathers)  # never all tokens' activations
  assert "reduce-scatter" in hlo  # dw back to this device's H slice


def _eqns(jaxpr):
  """Every equation of ``jaxpr`` and of the jaxprs in its parameters."""
  for e in jaxpr.eqns:
    yield e
    for sub in jax.extend.core.jaxprs_in_params(e.params):
      yield from _eqns(sub)


@pytest.mark.parametrize("route", ["auto", "explicit"])
def test_bf16_head_of_float32_params_communicates_in_bf16(route):
  """float32 x and w, dtype=bf16 (a mixed-precision head), data × FSDP: x and w enter the partitioned op in bf16,
  so w is gathered and dw reduced in bf16 (half the bytes, as for nn.Dense(dtype=bf16)); loss and the float32
  grads of x and w match float64 NumPy to the bf16 tolerances. (Read before compilation: the CPU backend promotes
  bf16 collectives to float32 when it compiles them; GPUs run them in bf16.)"""
  mesh = _mesh((2, 2, 2))
  x, w, _, y, where = _inputs(11, batch_shape=(64,), h=48, v=1000)
  tok, wsh = NamedSharding(mesh, P(("data", "fsdp"))), NamedSharding(mesh, P("fsdp", None))
  kw = dict(label_smoothing=0.1, where=where, dtype=jnp.bfloat16, impl="chunked")
  if route == "auto":
    f = lambda x, w: linear_cross_entropy(x, w, y, **kw)
  else:
    f = lambda x, w: sharded_linear_cross_entropy(x, w, y, mesh=mesh, **kw)
  step = jax.value_and_grad(f, (0, 1))
  args = (jax.device_put(x, tok), jax.device_put(w, wsh))
  with jax.set_mesh(mesh):
    if route == "auto":  # the partitioned primitives take x and w in bf16
      prims = [e for e in _eqns(jax.make_jaxpr(step)(*args).jaxpr) if e.primitive.name == "custom_partitioning"]
      assert prims and all(e.invars[i].aval.dtype == jnp.bfloat16 for e in prims for i in (0, 1)), prims
      from lce_flax import explain
      notes = explain(x, w, **{k: v for k, v in kw.items() if k != "where"}).notes
      assert any("x is float32 and w is float32: cast to bfloat16 before the partitioned op" in n for n in notes)
    else:  # the shard_map body's gather of w and reduction of dw, in bf16
      text = jax.jit(step).lower(*args).as_text()
      moved = re.findall(r"stablehlo\.(all_gather|reduce_scatter|all_reduce).*?-> tensor<([\w]+)>", text, re.S)
      head = [(op, t) for op, t in moved if re.fullmatch(r"\d+x500x\w+", t)]  # w's [H, V / tensor] pieces
      assert {op for op, _ in head} == {"all_gather", "reduce_scatter", "all_reduce"}, moved
      assert all(t.endswith("xbf16") for _, t in head), head
    loss, (dx, dw) = jax.jit(step)(*args)
  assert dx.dtype == jnp.float32 and dw.dtype == jnp.float32
  bf = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))
  ref = linear_cross_entropy_np(bf(x), bf(w), np.asarray(y), where=np.asarray(where), label_smoothing=0.1)
  rtol, gtol = tolerances(jnp.bfloat16)
  assert abs(float(loss) - ref["loss"]) <= rtol * abs(ref["loss"])
  assert rel_err(dx, ref["dx"]) < gtol and rel_err(dw, ref["dw"]) < gtol


# ------------------------------------------------------------------------- the GPU proof (lowered for CUDA)

GPU_KERNEL_TARGETS = {"pallas_triton": "__gpu$xla.gpu.triton", "pallas_mosaic": "mosaic_gpu"}


def _as_gpu(monkeypatch, impl):
  """Dispatch as on an H100 (sm90): ``impl``'s compiled kernels are what runs (every backend imports on any
  machine, so this cannot fail for want of a GPU)."""
  from lce_flax import _device, explain
  monkeypatch.setattr(_device, "platform", lambda: "gpu")
  monkeypatch.setattr(_device, "compute_capability", lambda: (9, 0))
  d = explain(jax.ShapeDtypeStruct((64, 128), jnp.bfloat16), jax.ShapeDtypeStruct((128, 512), jnp.bfloat16),
              impl=impl, interpret=False)
  assert d.impl == impl and not any("interpret" in n for n in d.notes)


@pytest.mark.parametrize("wspec", [P("fsdp", None), P("fsdp", "tensor")], ids=["fsdp", "fsdp+vocab"])
@pytest.mark.parametrize("impl", ["pallas_triton", "pallas_mosaic"])
def test_gpu_auto_path_is_custom_partitioned(monkeypatch, impl, wspec):
  """Lowered for CUDA under Auto axes: the only custom call is the partitioner's; no kernel outside it (w's V split
  over "tensor" too: the vocab-parallel head, lean design, runs the kernels per device)."""
  _as_gpu(monkeypatch, impl)
  mesh = _mesh((2, 2, 2))
  tok = NamedSharding(mesh, P(("data", "fsdp")))
  xs = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16, sharding=tok)
  ws = jax.ShapeDtypeStruct((128, 512), jnp.bfloat16, sharding=NamedSharding(mesh, wspec))
  ys = jax.ShapeDtypeStruct((256,), jnp.int32, sharding=tok)
  f = lambda x, w, y: linear_cross_entropy(x, w, y, impl=impl, interpret=False, mode="lean")
  with jax.set_mesh(mesh):
    text = jax.jit(jax.value_and_grad(f, (0, 1))).trace(xs, ws, ys).lower(lowering_platforms=("cuda",)).as_text()
  targets = set(re.findall(r"custom_call @([\w$.]+)", text))
  assert "CustomSPMDPartitioning" in targets and not any(GPU_KERNEL_TARGETS[impl] in t for t in targets), targets


MOSAIC_CFG = {"logits": dict(fast_design="logits"), "tokens": dict(fast_design="tokens", token_chunk=256, gemm=True)}


@pytest.mark.parametrize("impl, mode, design, reduction", [
    ("pallas_mosaic", "fast", "logits", "mean"), ("pallas_mosaic", "fast", "tokens", "mean"),
    ("pallas_mosaic", "fast", "logits", "none"), ("pallas_mosaic", "lean", None, "mean"),
    ("pallas_triton", "lean", None, "mean"), ("pallas_triton", "lean", None, "none")])
def test_gpu_data_parallel_step_traces(monkeypatch, impl, mode, design, reduction):
  """A data-parallel training step as the example trainer runs it (w replicated, tokens split over 2 devices,
  bias, ignored tokens, soft cap), lowered for CUDA with the H100's tuning rows: every partitioned primitive's
  global body traces without constants (a NumPy array formed at trace time becomes one, and custom_partitioning
  refuses it: this failed on GPUs while the lean-only lowering tests above passed)."""
  from lce_flax._impl.pallas_mosaic import gemm
  from lce_flax._impl.pallas_mosaic import op as mosaic_op
  _as_gpu(monkeypatch, impl)
  monkeypatch.setattr(gemm, "_device_kind", lambda: "NVIDIA H100 80GB HBM3")
  mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,))
  tok = NamedSharding(mesh, P("data"))
  b, h, v = 512, 128, 1024
  xs = jax.ShapeDtypeStruct((b, h), jnp.bfloat16, sharding=tok)
  ws = jax.ShapeDtypeStruct((h, v), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
  bs = jax.ShapeDtypeStruct((v,), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
  ys = jax.ShapeDtypeStruct((b,), jnp.int32, sharding=tok)
  cfg = mosaic_op.Config(**MOSAIC_CFG[design]) if design else None
  kw = dict(impl=impl, interpret=False, mode=mode, reduction=reduction, logit_softcap=30.0, config=cfg)

  def loss(x, w, bias, y):
    out = linear_cross_entropy(x, w, y, bias=bias, where=y != 7, **kw)
    return out.sum() if reduction == "none" else out

  with jax.set_mesh(mesh):
    text = jax.jit(jax.value_and_grad(loss, (0, 1, 2))).trace(xs, ws, bs, ys).lower(
        lowering_platforms=("cuda",)).as_text()
  assert "CustomSPMDPartitioning" in text


def _per_shard_cuda_lines(options, b: int, h: int, v: int, vocab: tuple) -> list[str]:
  """The per-shard body of the op's gradients (``_partition._shard_map``, tokens over data × fsdp, w's H over fsdp
  and V over ``vocab``) on a bf16 [b, h] x and [h, v] w, lowered for an abstract 2×2×2 H100 mesh: its lines."""
  from jax._src.mesh import AbstractDevice
  am = jax.sharding.AbstractMesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3,
                                 abstract_device=AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132,
                                                                platform="cuda"))
  s = _partition.Static(options, "hv", v)
  lay = _partition.Layout(("data", "fsdp"), ("fsdp",), vocab)
  args = (jax.ShapeDtypeStruct((b, h), jnp.bfloat16), jax.ShapeDtypeStruct((h, v), jnp.bfloat16),
          jax.ShapeDtypeStruct((b,), jnp.int32))
  with jax.sharding.use_abstract_mesh(am):
    text = jax.jit(lambda x, w, y: _partition._shard_map("grads", s, (am, lay), x, w, None, y, None)).trace(
        *args).lower(lowering_platforms=("cuda",)).as_text()
  return text.splitlines()


@pytest.mark.parametrize("vocab", [(), ("tensor",)], ids=["fsdp", "fsdp+vocab"])
@pytest.mark.parametrize("impl", ["pallas_triton", "pallas_mosaic"])
def test_gpu_per_shard_body_runs_kernels_on_shards(monkeypatch, impl, vocab):
  """The per-shard body (what the partition rule lowers per device, and the explicit form's shard_map), lowered
  for an abstract H100 mesh: every kernel custom call sits inside the manual computation, on this shard's tokens."""
  from lce_flax.options import LossOptions
  _as_gpu(monkeypatch, impl)
  b, h, v = 256, 128, 512
  lines = _per_shard_cuda_lines(LossOptions(impl=impl, interpret=False, mode="lean"), b, h, v, vocab)
  start = next(i for i, line in enumerate(lines) if "sdy.manual_computation" in line)
  indent = len(lines[start]) - len(lines[start].lstrip())
  kernels = [i for i, line in enumerate(lines) if f"custom_call @{GPU_KERNEL_TARGETS[impl]}" in line]
  assert kernels
  end = next(i for i in range(start + 1, len(lines))
             if len(lines[i]) - len(lines[i].lstrip()) == indent and lines[i].lstrip().startswith("}"))
  for i in kernels:
    assert start < i < end and len(lines[i]) - len(lines[i].lstrip()) > indent
  body = "\n".join(lines[start + 1:end])
  assert f"tensor<{b}x{h}xbf16>" not in body  # never all tokens' activations inside the per-device region
  assert f"tensor<{b // 4}x{h}xbf16>" in body  # this device's 64 tokens
  if vocab:  # this device's shard of w (H over fsdp, V over tensor); the whole head never inside the region
    assert f"tensor<{h // 2}x{v // 2}xbf16>" in body and f"x{v}xbf16>" not in body


def test_gpu_per_shard_tokens_design_adds_dw_in_place(monkeypatch):
  """The fast "tokens" design in the per-shard body (lowered for an abstract H100 mesh): each chunk's dw product
  after the first is a Mosaic GPU call whose float32 [H, V] output is aliased to its operand (the carried dw,
  handed in as a mutable ref), inside the manual computation; dw and dx leave it together."""
  from lce_flax._impl.pallas_mosaic import op as mosaic_op
  from lce_flax.options import LossOptions
  _as_gpu(monkeypatch, "pallas_mosaic")
  b, h, v = 4096, 256, 1024
  cfg = mosaic_op.Config(fast_design="tokens", token_chunk=256, gemm=True)
  lines = _per_shard_cuda_lines(LossOptions(impl="pallas_mosaic", interpret=False, mode="fast", config=cfg), b, h, v,
                                ())
  start = next(i for i, line in enumerate(lines) if "sdy.manual_computation" in line)
  aliased = [i for i, line in enumerate(lines) if "custom_call @mosaic_gpu" in line and "output_operand_alias" in line]
  dw_acc = [i for i in aliased if lines[i].rstrip().endswith(f"-> tensor<{h}x{v}xf32>")]
  assert len(dw_acc) == 1 and dw_acc[0] > start, aliased
  # the others: the repair of rows past the stored exponentials' range, written over a chunk's E in place (the
  # first chunk's and the loop's)
  assert len(aliased) == 3 and all(lines[i].rstrip().endswith(f"-> tensor<256x{v}xbf16>") for i in aliased
                                   if i not in dw_acc), [lines[i][-60:] for i in aliased]
  # dw (scaled, in w's dtype) and dx leave the design through one optimization barrier, so that dw's reduction
  # over the token axes can start as soon as the design is done (not after the backward that dx feeds)
  rows = b // 4  # (tokens over data × fsdp)
  tied = [line for line in lines if "stablehlo.optimization_barrier" in line
          and f"tensor<{rows}x{h}xbf16>" in line and f"tensor<{h}x{v}xbf16>" in line]
  assert len(tied) == 1, tied


def test_gpu_per_shard_lean_takes_its_chunks_in_place(monkeypatch):
  """Lean mode with both chunk products on the GEMM in the per-shard body, V split over the tensor axis (lowered for
  an abstract H100 mesh): over this shard's 512 columns in chunks of 256, the recompute and dx read the chunk of the
  local w in place (no slice of w is formed) and each chunk's dw goes into the local dw by a Mosaic GPU call whose
  output is its operand, inside the manual computation."""
  from lce_flax._impl.pallas_mosaic import op as mosaic_op
  from lce_flax.options import LossOptions
  _as_gpu(monkeypatch, "pallas_mosaic")
  b, h, v = 1024, 256, 1024
  cfg = mosaic_op.Config(products="gemm", vocab_chunk=256)
  lines = _per_shard_cuda_lines(LossOptions(impl="pallas_mosaic", interpret=False, mode="lean", config=cfg), b, h, v,
                                ("tensor",))
  start = next(i for i, line in enumerate(lines) if "sdy.manual_computation" in line)
  calls = [i for i, line in enumerate(lines) if "custom_call @mosaic_gpu" in line]
  dw_in_place = [i for i in calls if "output_operand_alias" in lines[i] and lines[i].rstrip().endswith(
      f"-> tensor<{h}x{v // 2}xbf16>")]
  assert len(dw_in_place) == 1 and dw_in_place[0] > start, [lines[i][-80:] for i in calls]
  slices = [line for line in lines if "stablehlo.dynamic_slice" in line and line.rstrip().endswith("x256xbf16>")]
  assert not slices, slices


def test_auto_uneven_token_split():
  """12 tokens constrained over 8 devices: the partitioner keeps the op's tokens unpadded; the loss is exact (and
  the rule refuses an uneven split rather than counting padding as tokens)."""
  x, w, b, y, wh = _auto_inputs(13, batch_shape=(12,))
  mesh = _mesh((8, 1, 1))
  f = lambda x, w: linear_cross_entropy(jax.lax.with_sharding_constraint(x, P("data")), w, y)
  l0, g0 = jax.value_and_grad(lambda x, w: linear_cross_entropy(x, w, y), (0, 1))(x, w)
  with jax.set_mesh(mesh):
    l1, g1 = jax.jit(jax.value_and_grad(f, (0, 1)))(x, w)
  assert rel_err(l1, l0) <= TOL and all(rel_err(s, r) <= TOL for s, r in zip(g1, g0))


def test_compiled_kernels_on_sharded_inputs_without_a_context_mesh(monkeypatch):
  """Plain ``jit`` on NamedSharding-placed inputs with no ``jax.set_mesh``: where compiled kernels would run (a
  multi-GPU process), the op takes the custom_partitioning rule, so no input is gathered. On CPU the kernels are
  interpreted (ordinary XLA ops), so the routing is forced here and the rule runs the chunked implementation."""
  from lce_flax import api
  monkeypatch.setattr(api, "_kernels_on_many_devices", lambda *a: True)
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  rng = np.random.default_rng(21)
  x = jnp.asarray(rng.standard_normal((64, 16)), jnp.float32)
  w = jnp.asarray(0.3 * rng.standard_normal((16, 70)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 70, 64), jnp.int32)
  f = lambda x, w, y: linear_cross_entropy(x, w, y, impl="chunked", z_loss=1e-3)
  want, gwant = jax.value_and_grad(f, (0, 1))(x, w, y)
  put = lambda a: jax.device_put(a, NamedSharding(mesh, P("data")))
  step = jax.jit(jax.value_and_grad(f, (0, 1)))
  loss, grads = step(put(x), w, put(y))
  np.testing.assert_allclose(loss, want, rtol=1e-6)
  for g, r in zip(grads, gwant):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)
  assert "CustomSPMDPartitioning" in step.lower(put(x), w, put(y)).as_text()
  assert "all-gather" not in step.lower(put(x), w, put(y)).compile().as_text()


# ---------------------------------------------------- plain jit on sharded inputs, no context mesh (8 devices)
# jit gives no sign at trace time that its inputs are sharded: the routing decides from the design and the device
# count. A loop over token chunks (chunked's fast design) is custom-partitioned; XLA left to itself gathers the tokens
# and every device runs every chunk.

NB, NH, NV = 8 * 13, 48, 300  # 13 tokens per device (ragged against token_chunk=8), a ragged vocabulary


def _no_mesh_put(mesh, tok, wspec, x, w, b, y, where):
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  return put(x, P(tok)), put(w, wspec), put(b, P()), put(y, P(tok)), put(where, P(tok))


NO_MESH_LAYOUTS = {  # (mesh shape, its axes, token axes, w's spec)
    "dp": ((8,), ("data",), "data", P()),
    "fsdp": ((4, 2), ("data", "fsdp"), ("data", "fsdp"), P("fsdp", None)),
}


@pytest.mark.parametrize("layout", list(NO_MESH_LAYOUTS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_no_context_mesh_chunked_matches_the_oracle(layout, dtype):
  """impl="chunked" under plain jit, tokens (and w's H) placed over a mesh that is not set as context: the loss and
  the gradients of x, w and bias are the float64 oracle's (ignored labels, a where mask, [8, 13] leading dims), and
  the call took the partitioned route, as explain() says."""
  from lce_flax import explain
  shape, names, tok, wspec = NO_MESH_LAYOUTS[layout]
  mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))
  x, w, b, y, where = _inputs(31, batch_shape=(8, 13), h=NH, v=NV, dtype=dtype)
  assert int((y == -100).sum()) > 0 and not bool(where.all())
  kw = dict(impl="chunked", token_chunk=8, z_loss=1e-4, label_smoothing=0.05)
  f = lambda x, w, b, y, wh: linear_cross_entropy(x, w, y, bias=b, where=wh, **kw)
  step = jax.jit(jax.value_and_grad(f, (0, 1, 2)))
  args = _no_mesh_put(mesh, tok, wspec, x, w, b, y, where)
  assert jax.sharding.get_abstract_mesh().empty
  loss, grads = step(*args)
  assert "CustomSPMDPartitioning" in step.lower(*args).as_text()
  assert any("this process has 8 devices and the 'token_chunks' design loops over token chunks" in n
             and "custom-partitioned" in n for n in explain(x, w, y, bias=b, **kw).notes)
  up = lambda a: np.asarray(jnp.asarray(a).astype(jnp.float32))
  ref = linear_cross_entropy_np(up(x), up(w), np.asarray(y), bias=up(b), where=np.asarray(where), z_loss=1e-4,
                                label_smoothing=0.05)
  loss_tol, grad_tol = tolerances(dtype)
  assert loss.dtype == jnp.float32 and rel_err(loss, ref["loss"]) <= loss_tol, (loss, ref["loss"])
  for name, g, a in zip(("dx", "dw", "dbias"), grads, (x, w, b)):
    assert g.shape == a.shape and g.dtype == a.dtype, name
    assert rel_err(g, ref[name]) <= grad_tol, (name, rel_err(g, ref[name]))


def _no_mesh_compiled(impl, b, h, v, *, sharded=True, dtype=jnp.float32, **kw):
  """The compiled value_and_grad step for B tokens split over 8 devices (w replicated), or, ``sharded=False``,
  for the tokens as they are on one device."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  place = (lambda spec: dict(sharding=NamedSharding(mesh, spec))) if sharded else (lambda spec: {})
  xs = jax.ShapeDtypeStruct((b, h), dtype, **place(P("data")))
  ws = jax.ShapeDtypeStruct((h, v), dtype, **place(P()))
  ys = jax.ShapeDtypeStruct((b,), jnp.int32, **place(P("data")))
  f = lambda x, w, y: linear_cross_entropy(x, w, y, impl=impl, **kw)
  return jax.jit(jax.value_and_grad(f, (0, 1))).lower(xs, ws, ys).compile()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_no_context_mesh_chunked_runs_one_shard_per_device(monkeypatch, dtype):
  """The compiled per-device step of chunked's token loop on tokens split 8 ways, no context mesh: no all-gather,
  and the temp memory of one shard's problem compiled for one device. The local route (XLA partitioning the loop
  itself) gathers all tokens on every device and needs more: the check can fail."""
  from lce_flax import api
  b, h, v = 8 * 256, 64, 1024
  temp = lambda c: c.memory_analysis().temp_size_in_bytes
  fixed = _no_mesh_compiled("chunked", b, h, v, dtype=dtype)
  assert not _gathers(fixed.as_text())
  monkeypatch.setattr(api, "_token_loop_on_many_devices", lambda *a: False)  # the local op on one device
  one_shard = _no_mesh_compiled("chunked", b // 8, h, v, sharded=False, dtype=dtype)
  assert "CustomSPMDPartitioning" not in one_shard.as_text()
  assert temp(fixed) <= 1.05 * temp(one_shard) + 4096, (temp(fixed), temp(one_shard))
  slow = _no_mesh_compiled("chunked", b, h, v, dtype=dtype)  # the route this replaced
  gathered = _gathers(slow.as_text())
  assert gathered and any(f"[{b // 32},32,{h}]" in g for g in gathered), gathered  # all tokens' x, in chunks of 32
  assert temp(slow) > 1.5 * temp(one_shard), (temp(slow), temp(one_shard))


@pytest.mark.parametrize("impl,kw", [("chunked", dict(mode="lean")), ("xla", {})], ids=["chunked-lean", "xla"])
def test_no_context_mesh_lean_and_xla_stay_local_and_are_not_gathered(impl, kw):
  """Designs without a loop over tokens stay one XLA computation, which XLA splits along the tokens by itself: no
  all-gather, the partitioner not involved; explain() says so."""
  from lce_flax import explain
  b, h, v = 8 * 256, 64, 1024
  compiled = _no_mesh_compiled(impl, b, h, v, **kw)
  assert not _gathers(compiled.as_text()) and "all-reduce" in compiled.as_text()
  notes = explain(jax.ShapeDtypeStruct((b, h), jnp.float32), jax.ShapeDtypeStruct((h, v), jnp.float32), impl=impl,
                  **kw).notes
  assert any("this process has 8 devices and no context mesh: the op runs as one XLA computation" in n
             for n in notes), notes
  assert not any("custom-partitioned" in n for n in notes)


def test_no_context_mesh_interpreted_kernels_are_said_slow():
  """Interpreted kernels stay local (interpret mode is for testing): explain() says that XLA gathers sharded inputs,
  a warning says it once, and the compiled step does gather them (the note is true)."""
  from lce_flax import explain
  from lce_flax._impl import base
  b, h, v = 8 * 32, 32, 256
  shapes = jax.ShapeDtypeStruct((b, h), jnp.float32), jax.ShapeDtypeStruct((h, v), jnp.float32)
  notes = explain(*shapes, impl="pallas_triton", interpret=True).notes
  assert any("'pallas_triton' runs interpreted kernels" in n and "every device computes every token" in n
             for n in notes), notes
  base._WARNED.clear()
  with pytest.warns(UserWarning, match="runs interpreted kernels, which stay one XLA computation"):
    compiled = _no_mesh_compiled("pallas_triton", b, h, v, interpret=True, mode="lean")
  assert _gathers(compiled.as_text())
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _no_mesh_compiled("pallas_triton", b, h, v, interpret=True, mode="lean")  # once
