"""The op against the float64 NumPy oracle, for every implementation that runs on CPU without interpret mode.

Kernel backends run the same checks through ``check_impl`` (imported by their own test modules).
"""

from __future__ import annotations

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lce_flax import linear_cross_entropy
from tests.reference_np import linear_cross_entropy_np, rel_err

OPTIONS = {
    "plain": {},
    "smoothing": dict(label_smoothing=0.1),
    "z_loss": dict(z_loss=1e-2),
    "softcap": dict(logit_softcap=3.0),
    "all": dict(label_smoothing=0.2, z_loss=1e-3, logit_softcap=4.0),
}
# (impl, mode, chunk_size): small chunks so that several chunks and a ragged last one are exercised.
VARIANTS = [("xla", None, None), ("chunked", "fast", 8), ("chunked", "lean", 64), ("chunked", "fast", None),
            ("chunked", "lean", None)]


def make_inputs(seed, batch_shape, h, v, dtype, *, w_layout="hv", bias=False, ignore_frac=0.2, wscale=0.3):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((*batch_shape, h)).astype(np.float32)
  w = (wscale * rng.standard_normal((h, v) if w_layout == "hv" else (v, h))).astype(np.float32)
  labels = rng.integers(0, v, batch_shape)
  labels = np.where(rng.random(batch_shape) < ignore_frac, -100, labels).astype(np.int32)
  b = rng.standard_normal(v).astype(np.float32) if bias else None
  # Round to the input dtype first, so the oracle sees exactly the numbers the implementation sees.
  cast = lambda a: None if a is None else jnp.asarray(a, dtype)
  up = lambda a: None if a is None else np.asarray(jnp.asarray(a, dtype).astype(jnp.float32))
  return (cast(x), cast(w), jnp.asarray(labels), cast(b)), (up(x), up(w), labels, up(b))


def tolerances(dtype):
  # fp32: float32 accumulation only. bf16/fp16: the logit gradient enters the dx/dw matmuls in the input dtype.
  return (2e-5, 2e-5) if dtype == jnp.float32 else (2e-5, 2e-2)


def check_impl(impl, *, seed=0, batch_shape=(37,), h=24, v=301, dtype=jnp.float32, w_layout="hv", bias=False,
               reduction="mean", options=None, where=False, **kwargs):
  """Loss, aux and grads of x, w (and bias) of ``impl`` against the float64 oracle."""
  options = options or {}
  (x, w, y, b), (xn, wn, yn, bn) = make_inputs(seed, batch_shape, h, v, dtype, w_layout=w_layout, bias=bias)
  mask = None
  if where:
    mask = jnp.asarray(np.random.default_rng(seed + 1).random(batch_shape) < 0.8)
  cot = None
  if reduction == "none":
    cot = np.random.default_rng(seed + 2).standard_normal(batch_shape).astype(np.float32)
  ref = linear_cross_entropy_np(xn, wn, yn, bias=bn, reduction=reduction, where=None if mask is None else np.asarray(mask),
                                w_layout=w_layout, cotangent=cot, **options)

  def f(x, w, b):
    return linear_cross_entropy(x, w, y, bias=b, reduction=reduction, where=mask, w_layout=w_layout, impl=impl,
                                return_aux=True, **options, **kwargs)

  if cot is None:
    (loss, aux), (dx, dw, db) = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(x, w, b)
  else:
    (loss, vjp, aux) = jax.vjp(f, x, w, b, has_aux=True)
    dx, dw, db = vjp(jnp.asarray(cot))
  loss_tol, grad_tol = tolerances(dtype)
  assert loss.dtype == jnp.float32
  assert rel_err(loss, ref["loss"]) < loss_tol, (loss, ref["loss"])
  assert rel_err(aux.token_loss, ref["token_loss"]) < loss_tol
  assert rel_err(aux.lse, ref["lse"]) < loss_tol
  assert int(aux.num_tokens) == ref["num_tokens"]
  assert int(aux.num_correct) == ref["num_correct"]
  assert dx.dtype == x.dtype and dw.dtype == w.dtype
  assert rel_err(dx, ref["dx"]) < grad_tol
  assert rel_err(dw, ref["dw"]) < grad_tol
  if bias:
    assert rel_err(db, ref["dbias"]) < grad_tol
  return loss, aux, (dx, dw, db)


def check_lse_cotangent(impl, *, h=40, dtype=jnp.float32, tol=1e-5, **kwargs):
  """Cotangents on the aux lse flow through the backward: d(Σ_t c_t lse_t)/dx = (c ⊙ softmax) @ w.T."""
  (x, w, y, _), (xn, wn, _, _) = make_inputs(4, (21,), h, 77, dtype)
  c = np.random.default_rng(0).standard_normal(21).astype(np.float32)
  g = jax.grad(lambda x: (c * linear_cross_entropy(x, w, y, impl=impl, mode="lean", return_aux=True,
                                                   **kwargs)[1].lse).sum())(x)
  z = xn.astype(np.float64) @ wn
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  assert rel_err(g, (c[:, None] * p) @ wn.T) < tol


def check_llama3_8b(impl, **kwargs):
  """GPU check at the llama3-8b head (B=8192, H=4096, V=128256, bf16): per-token loss of 64 rows vs float64 NumPy
  ≤ 1e-4; summed loss and grads vs the xla path on float32 inputs at highest precision ≤ 1e-4 / 1e-2."""
  b, h, v = 8192, 4096, 128256
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(k1, (b, h), jnp.float32).astype(jnp.bfloat16)
  w = (0.02 * jax.random.normal(k2, (h, v), jnp.float32)).astype(jnp.bfloat16)
  y = jax.random.randint(k3, (b,), 0, v, jnp.int32)
  rows = np.sort(np.random.default_rng(0).choice(b, 64, replace=False))
  tok = np.asarray(jax.jit(lambda x, w, y: linear_cross_entropy(x, w, y, reduction="none", impl=impl,
                                                                **kwargs))(x, w, y))
  ref = linear_cross_entropy_np(np.asarray(x[rows].astype(jnp.float32), np.float64),
                                np.asarray(w.astype(jnp.float32), np.float64), np.asarray(y)[rows],
                                reduction="none")
  assert np.max(np.abs(tok[rows] - ref["loss"]) / np.abs(ref["loss"])) <= 1e-4
  f = lambda impl, **kw: lambda x, w: linear_cross_entropy(x, w, y, reduction="sum", impl=impl, **kw)
  loss, grads = jax.jit(jax.value_and_grad(f(impl, **kwargs), (0, 1)))(x, w)
  with jax.default_matmul_precision("highest"):
    loss_r, grads_r = jax.jit(jax.value_and_grad(f("xla"), (0, 1)))(x.astype(jnp.float32), w.astype(jnp.float32))
  assert abs(float(loss) - float(loss_r)) / abs(float(loss_r)) <= 1e-4
  for g, r in zip(grads, grads_r):
    err = float(jnp.linalg.norm((g.astype(jnp.float32) - r).ravel()) / jnp.linalg.norm(r.ravel()))
    assert err <= 1e-2, err


def check_bad_and_ignored_labels(impl, *, h=16, dtype=jnp.float32, **kwargs):
  """An out-of-range label gives NaN loss and grads for its token only; an ignored token gives 0; a batch with
  every token ignored gives zero loss and exactly zero gradients (no NaN from padding rows of kernels)."""
  (x, w, y, b), _ = make_inputs(2, (19,), h, 70, dtype, bias=True, ignore_frac=0.0)
  y = y.at[4].set(70).at[7].set(-100)
  f = lambda x, w, b: linear_cross_entropy(x, w, y, bias=b, impl=impl, reduction="none", **kwargs).sum()
  loss, (dx, dw, db) = jax.value_and_grad(f, (0, 1, 2))(x, w, b)
  f32 = lambda a: np.asarray(a, np.float32)
  assert np.isnan(loss) and np.isnan(f32(dx[4])).all() and np.isnan(f32(dw)).any() and np.isnan(f32(db)).any()
  tok = linear_cross_entropy(x, w, y, bias=b, impl=impl, reduction="none", **kwargs)
  assert np.isnan(tok[4]) and tok[7] == 0.0 and np.isfinite(np.delete(np.asarray(tok), 4)).all()
  y0 = jnp.full((19,), -100)
  g = jax.grad(lambda x, w, b: linear_cross_entropy(x, w, y0, bias=b, impl=impl, z_loss=0.1, mode="lean",
                                                    **kwargs), (0, 1, 2))(x, w, b)
  for a in g:
    assert np.isfinite(f32(a)).all() and not np.any(f32(a))


@pytest.mark.parametrize("impl,mode,chunk", VARIANTS)
@pytest.mark.parametrize("opt", list(OPTIONS))
def test_options(impl, mode, chunk, opt):
  check_impl(impl, mode=mode, chunk_size=chunk, options=OPTIONS[opt], bias=True, seed=hash(opt) % 1000)


@pytest.mark.parametrize("impl,mode,chunk", VARIANTS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("w_layout", ["hv", "vh"])
def test_dtypes_and_layouts(impl, mode, chunk, dtype, w_layout):
  check_impl(impl, mode=mode, chunk_size=chunk, dtype=dtype, w_layout=w_layout, batch_shape=(3, 13), seed=7)


@pytest.mark.parametrize("impl,mode,chunk", VARIANTS)
@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_reductions_and_where(impl, mode, chunk, reduction):
  if reduction == "none" and mode == "fast":
    mode = "lean"
  check_impl(impl, mode=mode, chunk_size=chunk, reduction=reduction, where=True, options=OPTIONS["all"], seed=3)


@hypothesis.settings(max_examples=15, deadline=None, derandomize=False)
@hypothesis.given(
    b=st.integers(1, 40), h=st.integers(1, 20), v=st.integers(2, 150), chunk=st.integers(1, 70),
    mode=st.sampled_from(["fast", "lean"]), opt=st.sampled_from(list(OPTIONS)), layout=st.sampled_from(["hv", "vh"]),
    seed=st.integers(0, 2**16))
def test_property_shapes(b, h, v, chunk, mode, opt, layout, seed):
  check_impl("chunked", mode=mode, chunk_size=chunk, batch_shape=(b,), h=h, v=v, w_layout=layout,
             options=OPTIONS[opt], seed=seed, bias=seed % 2 == 0)


def test_matches_optax():
  """The plain and label-smoothed loss equal optax's functions on materialised logits."""
  (x, w, y, b), _ = make_inputs(11, (29,), 16, 77, jnp.float32, bias=True, ignore_frac=0.0)
  logits = x @ w + b
  ref = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  assert np.allclose(linear_cross_entropy(x, w, y, bias=b), ref, rtol=1e-6)
  smooth = optax.smooth_labels(jax.nn.one_hot(y, 77), 0.1)
  ref = optax.softmax_cross_entropy(logits, smooth).mean()
  assert np.allclose(linear_cross_entropy(x, w, y, bias=b, label_smoothing=0.1), ref, rtol=1e-6)


@pytest.mark.parametrize("impl,mode", [("xla", None), ("chunked", "fast"), ("chunked", "lean")])
def test_transformations(impl, mode):
  """jit, grad, value_and_grad and jax.checkpoint give the same numbers as the eager call."""
  (x, w, y, _), _ = make_inputs(5, (4, 9), 12, 55, jnp.float32)
  f = lambda x, w: linear_cross_entropy(x, w, y, impl=impl, mode=mode, chunk_size=16, z_loss=1e-3)
  l0, g0 = jax.value_and_grad(f, (0, 1))(x, w)
  l1, g1 = jax.jit(jax.value_and_grad(f, (0, 1)))(x, w)
  g2 = jax.grad(jax.checkpoint(f), (0, 1))(x, w)
  g3 = jax.jit(jax.grad(lambda x, w: 2.0 * f(x, w), (0, 1)))(x, w)
  assert np.allclose(l0, l1, rtol=1e-6)
  for a, b, c, d in zip(g0, g1, g2, g3):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(2 * a, d, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("impl,mode", [("xla", None), ("chunked", "fast"), ("chunked", "lean")])
def test_all_ignored_gives_zero(impl, mode):
  (x, w, _, b), _ = make_inputs(1, (17,), 8, 40, jnp.float32, bias=True)
  y = jnp.full((17,), -100)
  f = lambda x, w, b: linear_cross_entropy(x, w, y, bias=b, impl=impl, mode=mode, z_loss=0.1)
  loss, grads = jax.value_and_grad(f, (0, 1, 2))(x, w, b)
  assert loss == 0.0
  for g in grads:
    assert not np.isnan(g).any() and not np.any(g)


@pytest.mark.parametrize("impl,mode", [("xla", None), ("chunked", "fast"), ("chunked", "lean")])
@pytest.mark.parametrize("bad", [40, 1000, -1])
def test_out_of_range_label_is_nan(impl, mode, bad):
  """A label outside [0, V) that is not ignore_index is never a plausible number: its loss and grads are NaN."""
  (x, w, y, _), _ = make_inputs(2, (9,), 8, 40, jnp.float32, ignore_frac=0.0)
  y = y.at[4].set(bad)
  f = lambda x, w: linear_cross_entropy(x, w, y, impl=impl, mode=mode, chunk_size=16)
  loss, (dx, dw) = jax.value_and_grad(f, (0, 1))(x, w)
  assert np.isnan(loss)
  assert np.isnan(dx[4]).all() and np.isnan(dw).any()
  tok = linear_cross_entropy(x, w, y, impl=impl, mode="lean" if mode else None, reduction="none")
  assert np.isnan(tok[4]) and not np.isnan(np.delete(np.asarray(tok), 4)).any()


def test_fast_mode_refuses_aux_gradients():
  (x, w, y, _), _ = make_inputs(3, (9,), 8, 40, jnp.float32)
  f = lambda x: linear_cross_entropy(x, w, y, impl="chunked", mode="fast", return_aux=True)[1].lse.sum()
  with pytest.raises(ValueError, match="mode='lean'"):
    jax.grad(f)(x)
  # the same quantity is differentiable in lean mode
  g = jax.grad(lambda x: linear_cross_entropy(x, w, y, impl="chunked", mode="lean", return_aux=True)[1].lse.sum())(x)
  assert np.isfinite(g).all() and np.any(g)


def test_aux_lse_gradient_lean():
  check_lse_cotangent("chunked", chunk_size=8)


def test_bad_and_ignored_labels_lean():
  check_bad_and_ignored_labels("chunked", chunk_size=16)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(x=jnp.ones((4, 8)), w=jnp.ones((8, 10, 1)), labels=jnp.zeros(4, int)), ValueError, r"w.shape=\(8, 10, 1\)"),
        (dict(x=jnp.ones((4, 8)), w=jnp.ones((9, 10)), labels=jnp.zeros(4, int)), ValueError, "disagree on H"),
        (dict(x=jnp.ones((4, 8)), w=jnp.ones((8, 10)), labels=jnp.zeros(5, int)), ValueError, r"labels.shape=\(5,\)"),
        (dict(x=jnp.ones((4, 8)), w=jnp.ones((8, 10)), labels=jnp.zeros(4)), TypeError, "labels.dtype=float32"),
        (dict(x=jnp.ones((4, 8), int), w=jnp.ones((8, 10)), labels=jnp.zeros(4, int)), TypeError, "x.dtype=int"),
        (dict(x=jnp.ones((4, 8)), w=jnp.ones((8, 10)), labels=jnp.zeros(4, int), reduction="avg"), ValueError,
         "reduction='avg'"),
        (dict(x=jnp.ones((4, 8)), w=jnp.ones((8, 10)), labels=jnp.zeros(4, int), impl="cuda"), ValueError,
         "impl='cuda'"),
        (dict(x=jnp.ones((4, 8)), w=jnp.ones((8, 10)), labels=jnp.zeros(4, int), bias=jnp.ones(9)), ValueError,
         r"bias.shape=\(9,\)"),
        (dict(x=jnp.ones((4, 8)), w=jnp.ones((8, 10)), labels=jnp.zeros(4, int), where=jnp.ones(4)), ValueError,
         "where.dtype=float32"),
        (dict(x=jnp.ones((4, 8)), w=jnp.ones((8, 10)), labels=jnp.zeros(4, int), w_layout="vh"), ValueError,
         "disagree on H"),
        (dict(x=jnp.ones((4, 8)), w=jnp.ones((8, 10)), labels=jnp.zeros(4, int), label_smoothing=1.0), ValueError,
         "label_smoothing"),
        (dict(x=jnp.ones((4, 8)), w=jnp.ones((8, 10)), labels=jnp.zeros(4, int), reduction="none", mode="fast"),
         ValueError, "mode='lean'"),
    ],
)
def test_bad_input_errors_at_trace_time(kwargs, exc, match):
  x, w, labels = kwargs.pop("x"), kwargs.pop("w"), kwargs.pop("labels")
  with pytest.raises(exc, match=match):
    jax.jit(lambda x, w, l: linear_cross_entropy(x, w, l, **kwargs)).lower(x, w, labels)


def test_unrunnable_impl_lists_alternatives():
  if jax.default_backend() == "gpu":
    pytest.skip("CPU-only check")
  with pytest.raises(ValueError, match=r"implementations that can: \[.*'chunked'"):
    linear_cross_entropy(jnp.ones((4, 8)), jnp.ones((8, 10)), jnp.zeros(4, int), impl="pallas_mosaic",
                         interpret=False)


def test_auto_on_cpu_is_chunked():
  if jax.default_backend() != "cpu":
    pytest.skip("CPU-only check")
  hlo = jax.jit(lambda x, w, y: jax.grad(linear_cross_entropy)(x, w, y)).lower(
      jnp.ones((64, 8)), jnp.ones((8, 10)), jnp.zeros(64, int)).as_text()
  assert "while" in hlo  # the chunk loop, not one [B, V] dot


def _temp_bytes(impl, b=4096, h=256, v=32768, **kw):
  x = jax.ShapeDtypeStruct((b, h), jnp.float32)
  w = jax.ShapeDtypeStruct((h, v), jnp.float32)
  y = jax.ShapeDtypeStruct((b,), jnp.int32)
  g = jax.jit(jax.grad(functools.partial(linear_cross_entropy, impl=impl, **kw), argnums=(0, 1)))
  return g.lower(x, w, y).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("mode", [None, "lean"])
def test_memory_bounded(mode):
  """Compiled temp memory of the chunked gradient is at most 5% of the XLA path's (B=4096, H=256, V=32768)."""
  xla = _temp_bytes("xla")
  ours = _temp_bytes("chunked", mode=mode)
  assert ours <= 0.05 * xla, (ours, xla)


def test_explicitly_sharded_inputs_get_a_clear_error():
  """On an Explicit-axes mesh the direct call names the sharded argument and points to the sharded wrapper."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  (x, w, y, _), _ = make_inputs(0, (8,), 16, 96, jnp.float32, ignore_frac=0.0)
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    ys = jax.device_put(y, NamedSharding(mesh, P("data")))
    with pytest.raises(ValueError, match=r"x is sharded over the explicit mesh axes \('data',\).*sharded_linear"):
      jax.jit(lambda x, w, y: linear_cross_entropy(x, w, y, impl="chunked"))(xs, w, ys)
    # replicated inputs on the same mesh run, and the xla path handles sharded ones itself
    ref = linear_cross_entropy(x, w, y, impl="xla")
    assert np.allclose(jax.jit(lambda x, w, y: linear_cross_entropy(x, w, y, impl="chunked"))(x, w, y), ref)
    assert np.allclose(jax.jit(lambda x, w, y: linear_cross_entropy(x, w, y, impl="xla"))(xs, w, ys), ref,
                       rtol=1e-6)
