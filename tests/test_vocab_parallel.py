"""The vocab-parallel head's pieces against the float64 oracle, for every backend, with no mesh.

``test_shard_protocol`` runs each backend's ``stats`` and ``grads`` (the two halves of its lean design) on the
shards of a vocabulary split three ways, with shard-local labels, and combines them as the vocab-parallel head
does across devices (stats merged, dx summed, dw and dbias concatenated): the Mosaic kernels are checked here
too, since their CPU interpreter cannot run inside ``shard_map``. ``test_vmapped_head`` runs
:func:`lce_flax._impl.base.lean` with reduction axes, its collectives over a ``vmap`` axis standing for the mesh
axis. The meshes themselves are in ``tests/test_sharding.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lce_flax import _device, _math
from lce_flax._impl import base, vocab_parallel
from lce_flax.options import LossOptions
from tests._checks import OPTIONS, make_inputs, tolerances
from tests.reference_np import linear_cross_entropy_np, rel_err
from tests.test_impls import VARIANTS

SHARDS = 3
LEAN = [n for n, v in VARIANTS.items() if v.mode == "lean" or v.impl == "xla"]


def _problem(name, dtype, seed, w_layout):
  v = VARIANTS[name]
  if v.low_precision_only and dtype == jnp.float32:
    dtype = jnp.float16
  sizes = dict(v.sizes)
  b, h = sizes.get("batch_shape", (37,))[0], sizes.get("h", 24)
  vocab = SHARDS * 67  # 67 columns per shard: ragged against every tile and chunk
  (x, w, y, bias), (xn, wn, yn, bn) = make_inputs(seed, (b,), h, vocab, dtype, w_layout=w_layout, bias=True)
  y = y.at[5].set(vocab + 3)  # out of range: NaN loss and gradient row, whichever shard
  yn = np.asarray(y)
  return v, dtype, (x, w, y, bias), (xn, wn, yn, bn), vocab


# (dtype, layout) pairs; the slow low-memory variant runs the first only
CASES = {"f32-hv": (jnp.float32, "hv"), "bf16-vh": (jnp.bfloat16, "vh")}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", LEAN)
def test_shard_protocol(name, case):
  dtype, w_layout = CASES[case]
  if name == "pallas_triton:low_memory" and case != "f32-hv":
    pytest.skip("one case is enough for the low-memory dx pass (slow in interpret mode)")
  seed = LEAN.index(name) * 4 + (dtype == jnp.float32) * 2 + (w_layout == "vh")
  v, dtype, (x, w, y, bias), (xn, wn, yn, bn), vocab = _problem(name, dtype, seed, w_layout)
  if v.gpu_only and _device.platform() != "gpu":
    pytest.skip("runs on a GPU only")
  options = OPTIONS["all"]
  opts = LossOptions(impl=v.impl, mode="lean", config=v.config, **options,
                     **({} if v.impl in ("xla", "chunked") else dict(interpret=_device.platform() != "gpu")))
  b = x.shape[0]
  route = base.dispatch(b, x.shape[1], vocab, jnp.dtype(dtype), w_layout, opts, _device.platform(), SHARDS)
  mod, spec, design = route.entry.backend, route.spec, route.design
  assert spec.opts.vocab_size == vocab and any("vocab-parallel" in n for n in design.notes)
  norm = _math.normalize_labels(y, None, opts.ignore_index, vocab)
  cols = vocab // SHARDS
  vax = 1 if w_layout == "hv" else 0
  shard = lambda a, j, axis: jax.lax.slice_in_dim(a, j * cols, (j + 1) * cols, axis=axis)
  n = np.asarray(norm)
  local = [jnp.asarray(np.where((n >= j * cols) & (n < (j + 1) * cols), n - j * cols,
                                np.where((n >= 0) & (n < vocab), cols, n)), jnp.int32) for j in range(SHARDS)]

  st = None
  for j in range(SHARDS):
    sj = mod.stats(x, shard(w, j, vax), shard(bias, j, 0), local[j], spec, design.config)
    st = sj if st is None else _math.merge_stats(st, sj)
  out = _math.finalize(st, norm, spec.opts)
  rng = np.random.default_rng(seed)
  g_loss = rng.standard_normal(b).astype(np.float32)
  g_lse = rng.standard_normal(b).astype(np.float32)
  ref = linear_cross_entropy_np(xn, wn, yn, bias=bn, reduction="none", w_layout=w_layout, cotangent=g_loss,
                                **options)
  tok_tol, grad_tol = tolerances(dtype)
  ok = np.arange(b) != 5
  assert rel_err(np.asarray(out.loss)[ok], ref["token_loss"][ok]) <= tok_tol
  assert rel_err(out.lse, ref["lse"]) <= tok_tol
  assert np.isnan(out.loss[5]) and int(out.correct.sum()) == ref["num_correct"]

  parts = [mod.grads(x, shard(w, j, vax), shard(bias, j, 0), local[j], out.lse, jnp.asarray(g_loss),
                     jnp.asarray(g_lse), spec, design.config) for j in range(SHARDS)]
  dx = sum(p[0].astype(jnp.float32) for p in parts)
  dw = jnp.concatenate([p[1] for p in parts], axis=vax)
  db = jnp.concatenate([p[2] for p in parts])
  assert dx.dtype == jnp.float32 and dw.dtype == w.dtype and db.dtype == jnp.float32
  # the lse cotangent's part, analytically: d(Σ c·lse)/dz' = c·softmax, through the soft cap
  wh = np.asarray(wn, np.float64) if w_layout == "hv" else np.asarray(wn, np.float64).T
  z = np.asarray(xn, np.float64) @ wh + bn
  cap = options["logit_softcap"]
  zc = cap * np.tanh(z / cap)
  dz_lse = g_lse[:, None] * np.exp(zc - ref["lse"][:, None]) * (1 - (zc / cap) ** 2)
  want_dx = ref["dx"] + dz_lse @ wh.T
  want_dwh = (ref["dw"] if w_layout == "hv" else ref["dw"].T) + np.asarray(xn, np.float64).T @ dz_lse
  want_db = ref["dbias"] + dz_lse.sum(0)
  assert np.isnan(np.asarray(dx)[5]).all() and not np.isnan(np.asarray(dx)[ok]).any()
  assert rel_err(np.asarray(dx)[ok], want_dx[ok]) <= grad_tol
  # the NaN row reaches every column of dw and dbias (as on one device); compare without it
  parts_ok = [mod.grads(x[ok], shard(w, j, vax), shard(bias, j, 0), local[j][ok], out.lse[ok],
                        jnp.asarray(g_loss[ok]), jnp.asarray(g_lse[ok]), spec, design.config) for j in range(SHARDS)]
  dw_ok = jnp.concatenate([p[1] for p in parts_ok], axis=vax)
  db_ok = jnp.concatenate([p[2] for p in parts_ok])
  ref_ok = linear_cross_entropy_np(xn[ok], wn, yn[ok], bias=bn, reduction="none", w_layout=w_layout,
                                   cotangent=g_loss[ok], **options)
  want_dwh = (ref_ok["dw"] if w_layout == "hv" else ref_ok["dw"].T) + np.asarray(xn, np.float64)[ok].T @ dz_lse[ok]
  want_db = ref_ok["dbias"] + dz_lse[ok].sum(0)
  got_dwh = np.asarray(dw_ok, np.float64) if w_layout == "hv" else np.asarray(dw_ok, np.float64).T
  assert rel_err(got_dwh, want_dwh) <= grad_tol
  assert rel_err(db_ok, want_db) <= grad_tol
  assert np.isnan(np.asarray(dw, np.float32)).any()  # (the NaN row did reach dw)


def test_localize():
  """Shard-local labels: own columns local, others' ``columns`` (counted, in range, no column), codes kept."""
  labels = jnp.asarray([-1, 0, 4, 5, 9, 11, 12], jnp.int32)  # V = 12 over 3 shards of 4; 12 is out of range
  got = jax.vmap(lambda _: vocab_parallel.localize(labels, ("v",), 4), axis_name="v")(jnp.arange(3))
  want = [[-1, 0, 4, 4, 4, 4, 12], [-1, 4, 0, 1, 4, 4, 12], [-1, 4, 4, 4, 1, 3, 12]]
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("impl", ["xla", "chunked", "pallas_triton"])
def test_vmapped_head(impl):
  """``base.lean`` with reduction axes (its pmax/psum over a vmap axis: loss, lse, correct and the gradients of a
  per-token cotangent (on loss and lse) equal the float64 oracle's."""
  (x, w, y, bias), (xn, wn, yn, bn) = make_inputs(7, (29,), 24, SHARDS * 50, jnp.float32, bias=True)
  vocab = SHARDS * 50
  opts = LossOptions(impl=impl, mode="lean", **OPTIONS["z_loss"],
                     **(dict(interpret=True) if impl == "pallas_triton" else {}))
  route = base.dispatch(29, 24, vocab, jnp.dtype(jnp.float32), "hv", opts, _device.platform(), SHARDS)
  mod, spec, design = route.entry.backend, route.spec, route.design
  norm = _math.normalize_labels(y, None, opts.ignore_index, vocab)
  ws = jnp.stack(jnp.split(w, SHARDS, axis=1))
  bs = jnp.stack(jnp.split(bias, SHARDS))
  rng = np.random.default_rng(8)
  cot, cot_lse = (jnp.asarray(rng.standard_normal(29), jnp.float32) for _ in range(2))

  def shard_grads(w, b):
    _, vjp = jax.vjp(lambda x, w, b: (lambda o: (o.loss, o.lse))(
        base.lean(x, w, b, norm, spec, mod, design.config, ("v",))), x, w, b)
    return vjp((cot, cot_lse))

  loss, lse, correct = jax.vmap(lambda w, b: (lambda o: (o.loss, o.lse, o.correct.sum()))(
      base.lean(x, w, b, norm, spec, mod, design.config, ("v",))), axis_name="v")(ws, bs)
  dx, dws, dbs = jax.vmap(shard_grads, axis_name="v")(ws, bs)
  ref = linear_cross_entropy_np(xn, wn, yn, bias=bn, reduction="none", cotangent=np.asarray(cot),
                                **OPTIONS["z_loss"])
  p = np.exp(np.asarray(xn, np.float64) @ np.asarray(wn, np.float64) + bn - ref["lse"][:, None])
  dz_lse = np.asarray(cot_lse, np.float64)[:, None] * p
  for k in range(SHARDS):  # every shard holds the whole-vocabulary results, and the psum'd dx
    assert rel_err(loss[k], ref["token_loss"]) <= 2e-5 and rel_err(lse[k], ref["lse"]) <= 2e-5
    assert int(correct[k]) == ref["num_correct"]
    assert rel_err(dx[k], ref["dx"] + dz_lse @ np.asarray(wn, np.float64).T) <= 2e-5
  assert rel_err(jnp.concatenate(list(dws), axis=1), ref["dw"] + np.asarray(xn, np.float64).T @ dz_lse) <= 2e-5
  assert rel_err(jnp.concatenate(list(dbs)), ref["dbias"] + dz_lse.sum(0)) <= 2e-5
