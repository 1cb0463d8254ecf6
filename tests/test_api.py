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
from tests._checks import (  # noqa: F401
  OPTIONS,
  check_bad_and_ignored_labels,
  check_impl,
  check_llama3_8b,
  check_lse_cotangent,
  chunk_kw,
  make_inputs,
  tolerances,
)
from tests.reference_np import linear_cross_entropy_np, rel_err


@hypothesis.settings(max_examples=15, deadline=None, derandomize=False)
@hypothesis.given(
    b=st.integers(1, 40), h=st.integers(1, 20), v=st.integers(2, 150), chunk=st.integers(1, 70),
    mode=st.sampled_from(["fast", "lean"]), opt=st.sampled_from(list(OPTIONS)), layout=st.sampled_from(["hv", "vh"]),
    seed=st.integers(0, 2**16))
def test_property_shapes(b, h, v, chunk, mode, opt, layout, seed):
  check_impl("chunked", mode=mode, **chunk_kw(chunk, mode), batch_shape=(b,), h=h, v=v, w_layout=layout,
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
  (x, w, y, _), (xn, wn, yn, _) = make_inputs(5, (4, 9), 12, 55, jnp.float32)
  chunk = chunk_kw(16, mode) if impl == "chunked" else {}
  f = lambda x, w: linear_cross_entropy(x, w, y, impl=impl, mode=mode, z_loss=1e-3, **chunk)
  l0, g0 = jax.value_and_grad(f, (0, 1))(x, w)
  ref = linear_cross_entropy_np(xn, wn, yn, z_loss=1e-3)  # the eager numbers are right, then the others agree
  assert rel_err(l0, ref["loss"]) < 2e-5 and rel_err(g0[0], ref["dx"]) < 2e-5 and rel_err(g0[1], ref["dw"]) < 2e-5
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
  chunk = chunk_kw(16, mode) if impl == "chunked" else {}
  f = lambda x, w: linear_cross_entropy(x, w, y, impl=impl, mode=mode, **chunk)
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
  check_lse_cotangent("chunked", vocab_chunk=8)


def test_bad_and_ignored_labels_lean():
  check_bad_and_ignored_labels("chunked", vocab_chunk=16)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(x=jnp.ones((4, 8)), w=jnp.ones((8, 10, 1)), labels=jnp.zeros(4, int)), ValueError,
         r"w.shape=\(8, 10, 1\)"),
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
        (dict(x=jnp.ones((4, 8)), w=jnp.ones((8, 10)), labels=jnp.zeros(4, int), where=jnp.ones(5)), ValueError,
         r"where.shape=\(5,\)"),
        (dict(x=jnp.ones((4, 0)), w=jnp.ones((0, 10)), labels=jnp.zeros(4, int)), ValueError, "H must be > 0"),
        (dict(x=jnp.ones((4, 8)), w=jnp.ones((8, 10)), labels=jnp.zeros(4, int), token_chunk=0), ValueError,
         "token_chunk=0"),
        (dict(x=jnp.ones((4, 8)), w=jnp.ones((8, 10)), labels=jnp.zeros(4, int), vocab_chunk=-3), ValueError,
         "vocab_chunk=-3"),
        (dict(x=jnp.ones((4, 8)), w=jnp.ones((8, 10)), labels=jnp.zeros(4, int), impl="xla", token_chunk=8),
         ValueError, "token_chunk=8 rules out impl='xla'"),
        (dict(x=jnp.ones((4, 8)), w=jnp.ones((8, 10)), labels=jnp.zeros(4, int), chunk_size=8), TypeError,
         "'chunk_size' is no longer a loss option: use token_chunk .* or vocab_chunk"),
        (dict(x=jnp.ones((4, 8)), w=jnp.ones((8, 10)), labels=jnp.zeros(4, int), token_chunk=8, vocab_chunk=8),
         ValueError, "no design has both loops"),
        (dict(x=jnp.ones((4, 8)), w=jnp.ones((8, 10)), labels=jnp.zeros(4, int), token_chunk=8, reduction="none"),
         ValueError, "token_chunk=8: reduction='none' .* set vocab_chunk instead"),
        (dict(x=jnp.ones((4, 8)), w=jnp.ones((8, 10)), labels=jnp.zeros(4, int), vocab_chunk=8, mode="fast"),
         ValueError, "vocab_chunk=8: the fast designs loop over tokens"),
        (dict(x=jnp.ones((4, 8)), w=jnp.ones((8, 10)), labels=jnp.zeros(4, int), impl="chunked", interpret=True),
         ValueError, "interpret=True would be ignored"),
        (dict(x=jnp.ones((4, 8)), w=jnp.ones((8, 10)), labels=jnp.zeros(4, int), config=object()), ValueError,
         "needs the impl"),
        (dict(x=jnp.ones((4, 8)), w=jnp.ones((8, 10)), labels=jnp.zeros(4, int), chunked_size=3), TypeError,
         r"unknown loss option\(s\) \['chunked_size'\]"),
        (dict(x=jnp.ones((4, 8)), w=jnp.ones((8, 10)), labels=jnp.zeros(4, int), dtype=jnp.int8), ValueError,
         "dtype=int8"),
        (dict(x=jnp.ones((4, 8)), w=jnp.ones((8, 10)), labels=jnp.zeros(4, int), w_layout="vh"), ValueError,
         "disagree on H"),
        (dict(x=jnp.ones((4, 8)), w=jnp.ones((8, 10)), labels=jnp.zeros(4, int), label_smoothing=1.0), ValueError,
         "label_smoothing"),
        (dict(x=jnp.ones((4, 8)), w=jnp.ones((8, 10)), labels=jnp.zeros(4, int), reduction="none", mode="fast"),
         ValueError, r"mode='fast' with reduction='none' needs a fast design that takes per-token cotangents, and "
                     r"impl='auto' \(which picks 'chunked' here\) has none here: .* use mode=None or mode='lean'"),
    ],
)
def test_bad_input_errors_at_trace_time(kwargs, exc, match):
  x, w, labels = kwargs.pop("x"), kwargs.pop("w"), kwargs.pop("labels")
  with pytest.raises(exc, match=match):
    jax.jit(lambda x, w, l: linear_cross_entropy(x, w, l, **kwargs)).lower(x, w, labels)


def test_unrunnable_impl_lists_alternatives():
  if jax.default_backend() == "gpu":
    pytest.skip("CPU-only check")
  with pytest.raises(ValueError, match=r"implementations that can run float32 inputs: \[.*'chunked'"):
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


def test_explicitly_sharded_inputs_run_per_shard():
  """On an Explicit-axes mesh the direct call runs per shard (no wrapper) and equals one device's numbers."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  (x, w, y, _), _ = make_inputs(0, (8,), 16, 96, jnp.float32, ignore_frac=0.0)
  f = lambda x, w, y: linear_cross_entropy(x, w, y, impl="chunked")
  ref, gref = jax.value_and_grad(f, (0, 1))(x, w, y)
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    ys = jax.device_put(y, NamedSharding(mesh, P("data")))
    ws = jax.device_put(w, NamedSharding(mesh, P(None, "model")))
    loss, grads = jax.jit(jax.value_and_grad(f, (0, 1)))(xs, ws, ys)
  np.testing.assert_allclose(loss, ref, rtol=1e-6)
  for g, r in zip(grads, gref):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)
