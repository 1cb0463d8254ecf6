"""The Hopper GEMM of ``lce_flax/_impl/pallas_mosaic/gemm.py`` against float64 NumPy.

On CPU: the kernel's interpret twin (same persistent tile loop, TMA pipeline, block specs, prologue and epilogue
parts; a dot in place of the WGMMA, one warpgroup tile per CTA tile; the warp-specialised structure itself does
not run under Mosaic GPU's interpreter) at ragged sizes for every role, and the GPU kernel lowered for CUDA
(layouts, shared-memory budget) for every role, config shape and schedule (cooperative, pingpong, pingpong_ws).
On a Hopper GPU (``@pytest.mark.gpu``): the real kernel, every role, ragged sizes, against the same float64
references; the ping-pong schedules also where their turn-taking has corners, against the cooperative one.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lce_flax import _math
from lce_flax._impl.pallas_mosaic import gemm as G
from lce_flax._impl.pallas_mosaic import tuning

BF = jnp.bfloat16
TWIN = G.GemmConfig(tile_m=64, tile_n=128, tile_k=64, stages=2)
# ragged against every tile: M = 3·64 + 8, N = 2·128 + 64, K (as a major dimension) = 3·64 + 8
M, N, K = 200, 320, 192


def _rand(rng, shape, scale=1.0):
  return jnp.asarray(scale * rng.standard_normal(shape), BF)


def _f64(a):
  return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def _rel(got, ref):
  got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
  assert np.isfinite(got).all(), "unwritten or non-finite output entries"
  return np.linalg.norm(got - ref) / np.linalg.norm(ref)


def _operands(rng, layout, m=M, n=N, k=K):
  """A and B stored as ``layout`` says, and their float64 product."""
  ta, tb = layout
  a = _rand(rng, (k, m) if ta else (m, k))
  b = _rand(rng, (n, k) if tb else (k, n))
  a64 = _f64(a).T if ta else _f64(a)
  b64 = _f64(b).T if tb else _f64(b)
  return a, b, a64 @ b64


LAYOUTS = {"x.w": (False, False), "dz.wT": (False, True), "xT.dz": (True, False)}


# ------------------------------------------------------------------------------------------------ interpret twin


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_twin_products_ragged(name):
  rng = np.random.default_rng(hash(name) % 2**32)
  ta, tb = LAYOUTS[name]
  # xT.dz contracts over tokens: a ragged K (zero-filled by TMA); its M (= H) is A's minor dimension, a multiple of 64
  m, k = (320, 200) if ta else (M, K)
  a, b, ref = _operands(rng, (ta, tb), m=m, k=k)
  out = G.gemm(a, b, transpose_a=ta, transpose_b=tb, epilogue=G.Store(jnp.float32), config=TWIN, interpret=True)
  assert out.shape == (m, N) and out.dtype == jnp.float32
  assert _rel(out, ref) < 1e-5
  out16 = G.gemm(a, b, transpose_a=ta, transpose_b=tb, config=TWIN, interpret=True)
  assert out16.dtype == BF and _rel(out16, ref) < 1e-2


def test_twin_one_subtile_per_tile():
  """An odd count of epilogue sub-tiles per tile (here one): the slot reused across tiles is waited for."""
  rng = np.random.default_rng(4)
  a, b, ref = _operands(rng, LAYOUTS["x.w"])
  cfg = dataclasses.replace(TWIN, epi_m=64, epi_n=128)
  # (the twin ignores the schedule: a ping-pong config runs the same twin)
  pp = dataclasses.replace(cfg, schedule="pingpong")
  assert _rel(G.gemm(a, b, epilogue=G.Store(jnp.float32), config=pp, interpret=True), ref) < 1e-5
  c = jnp.asarray(rng.standard_normal((M, N)), jnp.float32)
  out = G.gemm(a, b, epilogue=G.AddTo(c), config=cfg, interpret=True)
  assert _rel(out, ref + np.asarray(c, np.float64)) < 1e-5


@pytest.mark.parametrize("name", ["x.w", "dz.wT"])
def test_twin_store_row_scale(name):
  """``Store(row_scale=σ)``: each row times its factor before the one rounding (the fast design's dx, written in
  x's dtype), ragged M, N and K, factors spanning 2⁻⁴⁰…2⁴⁰ and zeros."""
  rng = np.random.default_rng(11)
  a, b, ref = _operands(rng, LAYOUTS[name])
  scale = np.exp2(rng.uniform(-40, 40, M)) * (rng.random(M) > 0.1)
  want = ref * scale[:, None]
  sc = jnp.asarray(scale, jnp.float32)
  ta, tb = LAYOUTS[name]
  out = G.gemm(a, b, transpose_a=ta, transpose_b=tb, epilogue=G.Store(jnp.float32, row_scale=sc), config=TWIN,
               interpret=True)
  tol = np.abs(ref).max(axis=1, keepdims=True) * scale[:, None]  # each row's scale
  assert (np.abs(_f64(out) - want) <= 1e-5 * tol).all()
  out16 = G.gemm(a, b, transpose_a=ta, transpose_b=tb, epilogue=G.Store(row_scale=sc), config=TWIN, interpret=True)
  assert out16.dtype == BF
  assert (np.abs(_f64(out16) - want) <= 2**-8 * np.abs(want) + 1e-5 * tol).all()
  with pytest.raises(ValueError, match="row_scale must be"):
    G.gemm(a, b, transpose_a=ta, transpose_b=tb, epilogue=G.Store(row_scale=sc[:-1]), config=TWIN, interpret=True)


@pytest.mark.parametrize("slots,epi_n", [(3, 32), (4, 64), (3, 128)])
def test_twin_store_slots(slots, epi_n):
  """More SMEM slots for the stored sub-tiles (``epi_slots``), their count dividing the sub-tiles of a tile or not
  (4 and 2 of 32 and 64 columns, 1 of 128 against 3 slots): every tile lands, also where a slot's last reader was
  in the previous tile; the fast forward's stored exponentials beside the statistics too."""
  rng = np.random.default_rng(5)
  a, b, ref = _operands(rng, LAYOUTS["x.w"])
  cfg = dataclasses.replace(TWIN, epi_n=epi_n, epi_slots=slots)
  assert _rel(G.gemm(a, b, epilogue=G.Store(jnp.float32), config=cfg, interpret=True), ref) < 1e-5
  labels = jnp.asarray(rng.integers(0, N, M), jnp.int32)
  r = jnp.asarray(ref.max(1), jnp.float32)
  _, e = G.gemm(a, b, epilogue=G.RowStats(labels, store=True, ref=r), config=cfg, interpret=True)
  want = np.exp(ref - np.asarray(r, np.float64)[:, None])
  assert np.abs(_f64(e[:, :N]) / want - 1)[want > 1e-30].max() < 2**-8 + 1e-5


def test_store_slot_waits():
  """The wait before a slot is rewritten counts the stores issued since its last reader, across the tile boundary."""
  got = lambda n, s: [G._copies_since_slot(q, n, s) for q in range(n)]
  assert got(8, 2) == [1] * 8
  assert got(8, 3) == [1, 1, 4, 2, 2, 2, 2, 2]  # slot 2's last reader: sub-tile 5 of the previous tile
  assert got(1, 2) == [0] and got(3, 2) == [0, 2, 1] and got(2, 3) == [1, 1]
  with pytest.raises(ValueError, match="epi_slots=1"):
    G.GemmConfig(epi_slots=1).validate()


def test_twin_accumulate_into_c():
  rng = np.random.default_rng(1)
  a, b, ref = _operands(rng, LAYOUTS["xT.dz"], m=320, k=200)
  c = jnp.asarray(rng.standard_normal((320, N)), jnp.float32)
  out = G.gemm(a, b, transpose_a=True, epilogue=G.AddTo(c), config=TWIN, interpret=True)
  assert out.dtype == jnp.float32
  assert _rel(out, ref + np.asarray(c, np.float64)) < 1e-5
  with pytest.raises(ValueError, match="float32"):
    G.gemm(a, b, transpose_a=True, epilogue=G.AddTo(c.astype(BF)), config=TWIN, interpret=True)


def _window_cases(rng, start, size=256, m=M, h=K, v=640, config=TWIN, interpret=True):
  """Lean mode's three chunk products with w's chunk ``[start, start + size)`` read (and dw's added into) in place:
  (name, call, float64 reference of the result) for w [H, V] ("hv") and [V, H] ("vh"), from ``start`` traced."""
  kw = dict(config=config, interpret=interpret)
  x, w, dz = _rand(rng, (m, h)), _rand(rng, (h, v)), _rand(rng, (m, size))
  acc = jnp.asarray(rng.standard_normal((m, h)), jnp.float32)
  dw = jnp.asarray(rng.standard_normal((h, v)), BF)
  x64, w64, dz64, dw64, acc64 = _f64(x), _f64(w), _f64(dz), _f64(dw), np.asarray(acc, np.float64)
  cols = slice(start, start + size)
  win = lambda axis: G.Window(jnp.int32(start), size, axis)
  added = dw64.copy()
  added[:, cols] += x64.T @ dz64
  return [
      ("x.w_c", lambda: G.gemm(x, w, b_window=win(1), **kw), x64 @ w64[:, cols]),
      ("x.w_cT (vh)", lambda: G.gemm(x, w.T, transpose_b=True, b_window=win(0), **kw), x64 @ w64[:, cols]),
      ("acc + dz.w_cT", lambda: G.gemm(dz, w, transpose_b=True, b_window=win(1), epilogue=G.AddTo(acc), **kw),
       acc64 + dz64 @ w64[:, cols].T),
      ("acc + dz.w_c (vh)", lambda: G.gemm(dz, w.T, b_window=win(0), epilogue=G.AddTo(acc), **kw),
       acc64 + dz64 @ w64[:, cols].T),
      ("dw[:, c] += xT.dz", lambda: G.gemm(x, dz, transpose_a=True, epilogue=G.AddTo(dw, window=win(1)), **kw),
       added),
      ("dw[c] += dzT.x (vh)", lambda: G.gemm(dz, x, transpose_a=True, epilogue=G.AddTo(dw.T, window=win(0)), **kw),
       added.T),
  ]


@pytest.mark.parametrize("start", [0, 128, 384])  # 384 = V - 256: the clamped last chunk of a walk over V = 640
def test_twin_windows_read_and_add_in_place(start):
  """``b_window`` and ``AddTo(window=...)``: lean mode's chunk products on a window of w (columns of [H, V], rows
  of [V, H]) from a start the kernel reads at run time, and dw's window added into in place in w's dtype, the rest
  of dw kept bit for bit; against float64 NumPy, M and H ragged against the tiles."""
  rng = np.random.default_rng(20 + start)
  for name, call, ref in _window_cases(rng, start):
    out = call()
    if "dw" in name:  # (bf16: the window's entries rounded once, the others untouched)
      assert out.dtype == BF, name
      keep = np.ones(ref.shape, bool)
      keep[(slice(None), slice(start, start + 256)) if "vh" not in name else (slice(start, start + 256),)] = False
      np.testing.assert_array_equal(_f64(out)[keep], ref[keep])
      assert _rel(out, ref) < 1e-2, name
    else:
      assert _rel(out, ref) < (1e-5 if out.dtype == jnp.float32 else 1e-2), name
  # a float32 C takes a window too (the sum in float32, the other columns untouched)
  x, dz = _rand(rng, (M, K)), _rand(rng, (M, 256))
  c = jnp.asarray(rng.standard_normal((K, 640)), jnp.float32)
  out = G.gemm(x, dz, transpose_a=True, epilogue=G.AddTo(c, window=G.Window(jnp.int32(start), 256, 1)), config=TWIN,
               interpret=True)
  want = np.asarray(c, np.float64).copy()
  want[:, start:start + 256] += _f64(x).T @ _f64(dz)
  assert out.dtype == jnp.float32 and _rel(out, want) < 1e-5
  np.testing.assert_array_equal(np.delete(np.asarray(out), np.s_[start:start + 256], axis=1),
                                np.delete(np.asarray(c), np.s_[start:start + 256], axis=1))


def _token_window_cases(rng, start, size=256, m=640, h=K, v=640, config=TWIN, interpret=True):
  """The same products on a block of the tokens ``[start, start + size)`` read (and dx's rows added into) in place,
  beside w's chunk of the same start and size: (name, call, float64 reference) for the logits of the block, xᵀ·dz of
  the block added into a float32 [H, chunk] (its contraction the windowed axis), and dx's rows."""
  kw = dict(config=config, interpret=interpret)
  x, w, dz = _rand(rng, (m, h)), _rand(rng, (h, v)), _rand(rng, (size, size))
  acc = jnp.asarray(rng.standard_normal((m, h)), jnp.float32)
  c = jnp.asarray(rng.standard_normal((h, size)), jnp.float32)
  x64, w64, dz64, acc64, c64 = _f64(x), _f64(w), _f64(dz), np.asarray(acc, np.float64), np.asarray(c, np.float64)
  block = slice(start, start + size)
  win = lambda axis: G.Window(jnp.int32(start), size, axis)
  rows_added = acc64.copy()
  rows_added[block] += dz64 @ w64[:, block].T
  return [
      ("x_t.w", lambda: G.gemm(x, w, a_window=win(0), **kw), x64[block] @ w64),
      ("x_t.w_c", lambda: G.gemm(x, w, a_window=win(0), b_window=win(1), **kw), x64[block] @ w64[:, block]),
      ("x_t.w_cT (vh)", lambda: G.gemm(x, w.T, transpose_b=True, a_window=win(0), b_window=win(0), **kw),
       x64[block] @ w64[:, block]),
      ("c + x_tT.dz", lambda: G.gemm(x, dz, transpose_a=True, a_window=win(0), epilogue=G.AddTo(c), **kw),
       c64 + x64[block].T @ dz64),
      ("dx[t] += dz.w_cT", lambda: G.gemm(dz, w, transpose_b=True, b_window=win(1),
                                           epilogue=G.AddTo(acc, window=win(0)), **kw), rows_added),
  ]


@pytest.mark.parametrize("start", [0, 128, 384])
def test_twin_token_windows(start):
  """``a_window``: a block of x's rows as the GEMM's M (the block's logits, with w's chunk as well, both layouts) or
  as its contraction (xᵀ·dz of the block, added into a float32 C), and dx's rows added into in place, the other
  rows kept bit for bit; against float64 NumPy, H ragged against the tiles."""
  rng = np.random.default_rng(40 + start)
  for name, call, ref in _token_window_cases(rng, start):
    out = call()
    assert _rel(out, ref) < (1e-5 if out.dtype == jnp.float32 else 1e-2), name
    if name.startswith("dx"):
      keep = np.ones(ref.shape[0], bool)
      keep[start:start + 256] = False
      np.testing.assert_array_equal(_f64(out)[keep], ref[keep])


def test_windows_refused_where_they_cannot_be():
  """A window longer than its axis, of a size that is no multiple of its start's, along no axis of a 2-D array, from
  a static start past the array's end or off its multiple, or a windowed ``AddTo`` into an array of a third dtype
  or the wrong width: a ValueError naming it, at trace time (a traced start is the caller's to keep in range)."""
  x, w, dz = jnp.zeros((64, 128), BF), jnp.zeros((128, 640), BF), jnp.zeros((64, 256), BF)
  for win, match in ((G.Window(0, 768, 1), "window of 768"), (G.Window(0, 200, 1), "multiple of 128"),
                     (G.Window(0, 256, 2), "axis 2"), (G.Window(512, 256, 1), r"window from 512.*in \[0, 384\]"),
                     (G.Window(64, 256, 1), "window from 64.*multiple of 128")):
    with pytest.raises(ValueError, match=match):
      G.gemm(x, w, b_window=win, config=TWIN, interpret=True)
  with pytest.raises(ValueError, match=r"gemm: a window of 128 along axis 0 of \(64, 128\)"):
    G.gemm(x, w, a_window=G.Window(0, 128, 0), config=TWIN, interpret=True)
  with pytest.raises(ValueError, match="AddTo: c must be float32 or bfloat16"):
    G.gemm(x, dz, transpose_a=True, epilogue=G.AddTo(jnp.zeros((128, 640), jnp.float16), window=G.Window(0, 256, 1)),
           config=TWIN, interpret=True)
  with pytest.raises(ValueError, match="AddTo: c must be"):
    G.gemm(x, dz, transpose_a=True, epilogue=G.AddTo(jnp.zeros((128, 640), BF), window=G.Window(0, 384, 1)),
           config=TWIN, interpret=True)


def test_twin_row_mask_skips_whole_row_units():
  """``row_mask``: the tiles of the row units whose entry is 0 are skipped whole; with an in-place epilogue
  (``AddTo``) their rows of the output keep their values bit for bit, the other rows get ``C + A·B``, against
  float64 NumPy; M = 200 rows in units of the twin's tile_m (64): 4 units, the last ragged. A mask of the wrong
  length, and a ping-pong schedule on the GPU path, are refused."""
  rng = np.random.default_rng(3)
  a, b = _rand(rng, (M, K)), _rand(rng, (K, N))
  c = jnp.asarray(rng.standard_normal((M, N)), jnp.float32)
  assert G.row_unit(TWIN, interpret=True) == 64 and G.row_unit(G.GemmConfig(wg_split="m", cluster="m")) == 512
  mask = np.array([1, 0, 0, 1], np.int32)
  out = np.asarray(G.gemm(a, b, epilogue=G.AddTo(c), config=TWIN, interpret=True, row_mask=jnp.asarray(mask)))
  kept = np.repeat(mask, 64)[:M] != 0
  want = np.asarray(c, np.float64) + _f64(a) @ _f64(b)
  assert _rel(out[kept], want[kept]) < 1e-5
  np.testing.assert_array_equal(out[~kept], np.asarray(c)[~kept])
  with pytest.raises(ValueError, match=r"row_mask must be \[4\]"):
    G.gemm(a, b, epilogue=G.AddTo(c), config=TWIN, interpret=True, row_mask=jnp.ones((3,), jnp.int32))
  with pytest.raises(NotImplementedError, match="row_mask with schedule='pingpong'"):
    G.gemm(a, b, epilogue=G.AddTo(c), config=tuning.PINGPONG, row_mask=jnp.ones((2,), jnp.int32))


def _stats_ref(z, labels, cap, n):
  zc = cap * np.tanh(z / cap) if cap else z
  zc = zc[:, :n]
  m = zc.max(1)
  lse = m + np.log(np.exp(zc - m[:, None]).sum(1))
  tgt = np.where(labels >= 0, zc[np.arange(len(labels)), np.maximum(labels, 0)], 0.0)
  return lse, tgt, zc.sum(1)


# N ragged against the 128-column tiles (per-element masks), and N a whole number of tiles (no masks)
STATS_N = [N, 384]


@pytest.mark.parametrize("n", STATS_N)
@pytest.mark.parametrize("cap", [None, 5.0])
def test_twin_row_stats(cap, n):
  rng = np.random.default_rng(2)
  a, b, ref = _operands(rng, LAYOUTS["x.w"], n=n)
  labels = jnp.asarray(rng.integers(0, n, M), jnp.int32).at[3].set(-1)
  opts = G.StatsOptions(cap, True)
  st = G.gemm(a, b, epilogue=G.RowStats(labels, opts), config=TWIN, interpret=True)
  assert st.shape == (4, 3, 256)
  # each tile's target: exactly 0 where the tile does not hold the row's label (the rows' target sums the tiles')
  holds = np.asarray(labels)[None, :] // 128 == np.arange(3)[:, None]
  assert np.all(np.asarray(st[2, :, :M])[~holds] == 0.0)
  rs = G.merge_row_stats(st, M)
  lse_ref, tgt_ref, zsum_ref = _stats_ref(ref, np.asarray(labels), cap, n)
  lse = np.asarray(rs.m, np.float64) + np.log(np.asarray(rs.s, np.float64))
  np.testing.assert_allclose(lse, lse_ref, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(np.asarray(rs.target), tgt_ref, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(np.asarray(rs.zsum), zsum_ref, rtol=1e-4, atol=1e-3)
  # statistics and the stored logits from one pass
  st2, z = G.gemm(a, b, epilogue=(G.RowStats(labels, opts), G.Store(jnp.float32)), config=TWIN, interpret=True)
  np.testing.assert_array_equal(np.asarray(st2), np.asarray(st))
  assert _rel(z, ref) < 1e-5


def _sparse_labels(rng, m, n):
  """Labels that leave most tiles without one: the first rows' labels in the first 100 columns, the next ones'
  in the last tile (up to N - 1), some ignored (-1), one past N inside the last tile's columns and one past every
  tile (neither has a target: 0), the rest anywhere below N."""
  y = rng.integers(0, n, m)
  y[: m // 2] = rng.integers(0, 100, m // 2)
  y[m // 2: 3 * m // 4] = rng.integers(n - 20, n, 3 * m // 4 - m // 2)
  y[[1, 7, m - 1]] = -1
  y[5], y[9] = n + 3, 10**6
  return jnp.asarray(y, jnp.int32)


def _held_ref(labels, rows, tile_m, tile_n, col_tiles):
  held = np.zeros((rows // tile_m, col_tiles))
  for r, y in enumerate(np.asarray(labels)):
    if 0 <= y < col_tiles * tile_n:
      held[r // tile_m, y // tile_n] = 1.0
  return held


@pytest.mark.parametrize("n", STATS_N)
@pytest.mark.parametrize("cap", [None, 5.0])
def test_twin_targets_only_in_tiles_that_hold_a_label(cap, n):
  """The label table (one flag per warpgroup tile) against NumPy, and the statistics with it (``target_tiles=True``)
  bit-equal to those formed with the target logit in every tile (``False``), where most tiles hold no label, some
  labels are ignored and some lie past N; the rows' targets against float64. The default takes the table with a
  soft cap only."""
  rng = np.random.default_rng(12)
  a, b, ref = _operands(rng, LAYOUTS["x.w"], n=n)
  labels = _sparse_labels(rng, M, n)
  prob = G.Problem(M, n, K, False, False, jnp.dtype(BF), True, 1)
  part = G.RowStats(labels, G.StatsOptions(cap, True), target_tiles=True)
  default = G.RowStats(labels, G.StatsOptions(cap, True))
  assert len(default.inputs(prob, TWIN)) == (2 if cap else 1)
  held = np.asarray(part.inputs(prob, TWIN)[-1]).reshape(-1, 3, G.RowStats._HELD)
  want = _held_ref(np.pad(np.asarray(labels), (0, 256 - M), constant_values=-1), 256, 64, 128, 3)
  np.testing.assert_array_equal(held[..., 0], want)
  assert not held[..., 1:].any() and 0 < want.sum() < want.size - 1  # (tiles without a label too)
  st = G.gemm(a, b, epilogue=part, config=TWIN, interpret=True)
  every = G.gemm(a, b, epilogue=dataclasses.replace(part, target_tiles=False), config=TWIN, interpret=True)
  np.testing.assert_array_equal(np.asarray(st), np.asarray(every))
  rs = G.merge_row_stats(st, M)
  y = np.asarray(labels)
  _, tgt_ref, _ = _stats_ref(ref, np.where(y < n, y, -1), cap, n)
  np.testing.assert_allclose(np.asarray(rs.target), tgt_ref, rtol=1e-5, atol=1e-4)
  assert np.all(np.asarray(rs.target)[[1, 5, 7, 9]] == 0.0)


@pytest.mark.parametrize("cap", [None, 5.0])
def test_twin_row_stats_shifted_store_and_bias(cap):
  """``RowStats(store=True, bias=...)``: the statistics of ``z + bias`` and each tile's capped logits shifted by the
  tile's row max (the fast forward), tiles of ``tile_n`` columns, N rounded up to whole tiles."""
  rng = np.random.default_rng(12)
  a, b, ref = _operands(rng, LAYOUTS["x.w"])
  bias = jnp.asarray(rng.standard_normal(N), jnp.float32)
  labels = jnp.asarray(rng.integers(0, N, M), jnp.int32).at[5].set(-1)
  opts = G.StatsOptions(cap, False)
  st, zs = G.gemm(a, b, epilogue=G.RowStats(labels, opts, store=True, bias=bias), config=TWIN, interpret=True)
  assert zs.shape == (M, 384) and zs.dtype == BF  # N = 320 → 3 tiles of 128
  z = ref + np.asarray(bias, np.float64)[None, :]
  rs = G.merge_row_stats(st, M)
  lse_ref, tgt_ref, _ = _stats_ref(z, np.asarray(labels), cap, N)
  np.testing.assert_allclose(np.asarray(rs.m, np.float64) + np.log(np.asarray(rs.s, np.float64)), lse_ref,
                             rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(np.asarray(rs.target), tgt_ref, rtol=1e-5, atol=1e-4)
  zc = cap * np.tanh(z / cap) if cap else z
  tile_max = np.asarray(st[0, :, :M], np.float64).T  # [M, tiles]
  for j in range(3):
    cols = slice(128 * j, min(128 * (j + 1), N))
    np.testing.assert_allclose(tile_max[:, j], zc[:, cols].max(1), rtol=1e-5, atol=1e-4)
    shifted = zc[:, cols] - tile_max[:, j:j + 1]
    assert np.abs(_f64(zs[:, cols]) - shifted).max() <= 2**-8 * np.abs(shifted).max() + 1e-6
  # the shifted values of the entries near the max are nearly exact (bf16 rounding relative to |zc - max|)
  near = np.abs(zc[:, :128] - tile_max[:, :1]) < 0.5
  assert np.abs(_f64(zs[:, :128]) - (zc[:, :128] - tile_max[:, :1]))[near].max() < 2**-9
  with pytest.raises(ValueError, match="bias"):
    G.gemm(a, b, epilogue=G.RowStats(labels, opts, bias=bias[:10]), config=TWIN, interpret=True)


@pytest.mark.parametrize("n", STATS_N)
@pytest.mark.parametrize("cap,bias", [(None, False), (5.0, True)])
def test_twin_row_stats_stored_exponentials(cap, bias, n):
  """``RowStats(store=True, ref=r)``: the same statistics, and each tile stored as ``exp(zc - r)`` times the cap's
  derivative ``1 - (zc/cap)²``, with bf16's relative rounding at every size (the entries span ~e^±20 here)."""
  rng = np.random.default_rng(13)
  a, b, ref = _operands(rng, LAYOUTS["x.w"], n=n)
  bias_v = jnp.asarray(rng.standard_normal(n), jnp.float32) if bias else None
  labels = jnp.asarray(rng.integers(0, n, M), jnp.int32).at[5].set(-1)
  z = ref + (np.asarray(bias_v, np.float64)[None, :] if bias else 0.0)
  zc = cap * np.tanh(z / cap) if cap else z
  r = zc[np.arange(M), np.maximum(np.asarray(labels), 0)] + rng.normal(0, 3, M)  # any reference near the row
  opts = G.StatsOptions(cap, False)
  st, e = G.gemm(a, b, epilogue=G.RowStats(labels, opts, store=True, bias=bias_v, ref=jnp.asarray(r, jnp.float32)),
                 config=TWIN, interpret=True)
  assert e.shape == (M, 384) and e.dtype == BF
  want = np.exp(zc - r[:, None]) * ((1 - (zc / cap) ** 2) if cap else 1.0)
  got = _f64(e[:, :n])
  # formed as exp(zc - c) with c = max(r, the tile's row max - 80): exact to bf16 wherever c = r and the entry is a
  # normal number (e^-80 and up), here every entry but where the cap saturates
  tile_max = np.repeat(np.asarray(st[0, :, :M], np.float64).T, 128, axis=1)[:, :n]
  inside = (tile_max - r[:, None] < 79) & (zc - r[:, None] > -80)
  if cap:  # (1 - (zc/cap)² is float32's cancellation where zc saturates the cap, as in every design's dz)
    inside &= 1 - (zc / cap) ** 2 > 1e-2
  assert inside.mean() > (0.3 if cap else 0.95)
  assert np.abs(got[inside] / want[inside] - 1).max() < 2**-8 + 1e-5
  np.testing.assert_array_equal(_f64(e[:, n:]), 0.0)  # the columns past n
  rs = G.merge_row_stats(st, M)
  lse_ref, tgt_ref, _ = _stats_ref(z, np.asarray(labels), cap, n)
  np.testing.assert_allclose(np.asarray(rs.m, np.float64) + np.log(np.asarray(rs.s, np.float64)), lse_ref,
                             rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(np.asarray(rs.target), tgt_ref, rtol=1e-5, atol=1e-4)
  with pytest.raises(ValueError, match="ref must be"):
    G.gemm(a, b, epilogue=G.RowStats(labels, opts, ref=jnp.zeros((M,), jnp.float32)), config=TWIN, interpret=True)


def _dz_ref(z, lse, coef, a, labels):
  d = np.exp(z - lse[:, None]) * coef[:, None]
  d[np.arange(len(labels)), labels] -= a
  return d


def test_twin_prologue_dz_from_logits():
  rng = np.random.default_rng(3)
  v, h = 320, 192  # dx = dz·wᵀ: A = stored logits [M, V], B = w [H, V] (transpose_b)
  z = _rand(rng, (M, v))
  w = _rand(rng, (h, v), 0.1)
  lse = jnp.asarray(rng.uniform(2, 4, M), jnp.float32)
  coef = jnp.asarray(rng.uniform(0.5, 1.5, M), jnp.float32)
  aa = jnp.asarray(rng.uniform(0.5, 1.5, M), jnp.float32)
  labels = jnp.asarray(rng.integers(0, v, M), jnp.int32)
  out = G.gemm(z, w, transpose_b=True, prologue=G.DzFromLogits(lse, coef, aa, labels),
               epilogue=G.Store(jnp.float32), config=TWIN, interpret=True)
  dz = _dz_ref(_f64(z), _f64(lse), _f64(coef), _f64(aa), np.asarray(labels))
  ref = dz @ _f64(w).T
  assert _rel(out, ref) < 1e-2  # dz is rounded to bf16 before the MMA


def _logit_grad_case(rng, z, cap, smoothing, bias_v=None):
  """A :class:`G.LogitGrad` for the product ``z`` (float64 [m, n], bias not included) and its float64 output:
  ``(coef·exp(zc - lse) - [col = label]·a - c)·(1 - (zc/cap)²)``, zero below each row's ``first`` column; labels
  outside the columns, a row of zero coefficients (row 7), negative coefficients (any per-token cotangent)."""
  m, n = z.shape
  if bias_v is not None:
    z = z + np.asarray(bias_v, np.float64)[None, :]
  zc = cap * np.tanh(z / cap) if cap else z
  lse = np.log(np.exp(zc).sum(1)) + rng.uniform(0, 2, m)  # (a shard's or chunk's columns: lse ≥ their own)
  coef, aa = rng.uniform(-1.5, 1.5, m), rng.uniform(0.5, 1.5, m)
  coef[7], aa[7] = 0.0, 0.0
  c = smoothing / 1000 * aa
  labels = rng.integers(-3, n + 40, m).astype(np.int32)  # some negative, some past n: no label column here
  first = np.where(rng.uniform(size=m) < 0.5, 0, rng.integers(0, n, m)).astype(np.int32)
  f32 = lambda v: jnp.asarray(v, jnp.float32)
  opts = _math.LossSpec(vocab_size=1000, label_smoothing=smoothing, logit_softcap=cap)
  part = G.LogitGrad(f32(lse), f32(coef), f32(aa), f32(c), jnp.asarray(labels), opts, first=jnp.asarray(first),
                     bias=bias_v)
  cols = np.arange(n)[None, :]
  want = coef[:, None] * np.exp(zc - lse[:, None]) - np.where(cols == labels[:, None], aa[:, None], 0.0) - c[:, None]
  want = want * ((1 - (zc / cap) ** 2) if cap else 1.0)
  return part, np.where(cols >= first[:, None], want, 0.0)


def _check_logit_grad(dz, part, want):
  m, n = want.shape
  assert dz.shape == (m, n) and dz.dtype == BF
  got = _f64(dz)
  np.testing.assert_array_equal(got[7], 0.0)  # zero coefficients: a row with no gradient
  assert np.all(got[np.arange(n)[None, :].repeat(m, 0) < np.asarray(part.first)[:, None]] == 0)
  assert np.abs(got - want).max() <= 2**-8 * np.abs(want).max()
  assert _rel(dz, want) < 5e-3


@pytest.mark.parametrize("layout", ["x.w", "x.wT"])
@pytest.mark.parametrize("cap,bias,smoothing", [(None, False, 0.0), (5.0, True, 0.1)])
def test_twin_logit_grad(cap, bias, smoothing, layout):
  """``LogitGrad``: each tile's logit gradient formed in the epilogue and stored in bf16, against float64 NumPy
  (:func:`_logit_grad_case`), ragged N, w either way round; rows of the wrong length are refused."""
  rng = np.random.default_rng(17 + (cap is None))
  tb = layout == "x.wT"
  a_, b_, z = _operands(rng, (False, tb))
  bias_v = jnp.asarray(rng.standard_normal(N), jnp.float32) if bias else None
  part, want = _logit_grad_case(rng, z, cap, smoothing, bias_v)
  _check_logit_grad(G.gemm(a_, b_, transpose_b=tb, epilogue=part, config=TWIN, interpret=True), part, want)
  with pytest.raises(ValueError, match="LogitGrad: lse, coef"):
    G.gemm(a_, b_, transpose_b=tb, epilogue=dataclasses.replace(part, coef=part.coef[:10]), config=TWIN,
           interpret=True)


def test_refusals():
  f32 = jnp.zeros((64, 64), jnp.float32)
  with pytest.raises(TypeError, match="bf16 or fp16"):
    G.gemm(f32, f32, interpret=True)
  with pytest.raises(ValueError, match="multiple of 64"):  # a [H, 128037] w: rows TMA cannot address
    G.gemm(jnp.zeros((64, 128), BF), jnp.zeros((128, 1000), BF), interpret=True)
  with pytest.raises(ValueError, match="contraction"):
    G.gemm(jnp.zeros((64, 128), BF), jnp.zeros((192, 64), BF), interpret=True)
  with pytest.raises(ValueError, match="multiple of 64"):
    dataclasses.replace(G.GemmConfig(), tile_n=96).validate()
  with pytest.raises(ValueError, match="without clusters"):
    dataclasses.replace(tuning.PINGPONG, cluster="n").validate()
  with pytest.raises(ValueError, match="schedule"):
    dataclasses.replace(G.GemmConfig(), schedule="stream-k").validate()
  with pytest.raises(ValueError, match="mma_lag"):
    G.GemmConfig(stages=2, mma_lag=2).validate()
  with pytest.raises(ValueError, match="mma_lag"):
    dataclasses.replace(tuning.PINGPONG, mma_lag=1).validate()
  z, l, y = jnp.zeros((64, 128), BF), jnp.zeros((64,), jnp.float32), jnp.zeros((64,), jnp.int32)
  with pytest.raises(ValueError, match="mma_lag=1 with a prologue"):
    G.gemm(z, jnp.zeros((64, 128), BF), transpose_b=True, prologue=G.DzFromLogits(l, l, l, y),
           config=G.GemmConfig(mma_lag=1), interpret=True)


# ------------------------------------------------------------------------------------------------ CUDA lowering


def _lower(f, *args):
  return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


SDS = jax.ShapeDtypeStruct


LOSS_ALL = _math.LossSpec(vocab_size=4096, label_smoothing=0.1, z_loss=1e-4, logit_softcap=30.0)
LOSS_PLAIN = _math.LossSpec(vocab_size=4096)


def _f32_stats(cfg):
  """``cfg`` with few enough stages for statistics + float32 stored sub-tiles (the ping-pong schedule's two
  operand rings leave room for 2 slots each, the shared ring of ``pingpong_ws`` for 4)."""
  return dataclasses.replace(cfg, stages={"pingpong": 2, "pingpong_ws": 4}.get(cfg.schedule, 3))


@pytest.mark.parametrize("cfg", [G.GemmConfig(), G.GemmConfig(wg_split="m", cluster="n", epi_n=32, epi_slots=3),
                                 G.GemmConfig(tile_m=64, tile_n=256, wg_split="m", cluster="n", epi_n=32),
                                 G.GemmConfig(cluster="m", order_minor="m", order_width=8), tuning.PINGPONG,
                                 tuning.PINGPONG_WS, dataclasses.replace(tuning.PINGPONG_WS, cluster="n"),
                                 dataclasses.replace(tuning.PINGPONG_WS, cluster="m", order_width=8)],
                         ids=lambda c: c.short())
def test_gpu_kernel_lowers_for_cuda(cfg):
  """The GPU kernel (every schedule), every role, through the whole Pallas → Mosaic GPU lowering on CPU."""
  m, n, k = 1000, 2112, 576
  y = SDS((m,), jnp.int32)
  vec = SDS((m,), jnp.float32)
  cases = [
      (lambda a, b: G.gemm(a, b, config=cfg), SDS((m, k), BF), SDS((k, n), BF)),
      (lambda a, b: G.gemm(a, b, transpose_b=True, config=cfg), SDS((m, k), BF), SDS((n, k), BF)),
      (lambda a, b: G.gemm(a, b, transpose_a=True, config=cfg), SDS((m, 1088), BF), SDS((m, n), BF)),
      (lambda a, b, c: G.gemm(a, b, transpose_a=True, epilogue=G.AddTo(c), config=tuning.fit_role("dw_acc", cfg)),
       SDS((m, 1088), BF), SDS((m, n), BF), SDS((1088, n), jnp.float32)),
      (lambda a, b, y: G.merge_row_stats(G.gemm(a, b, epilogue=G.RowStats(y, G.StatsOptions(30.0, True)),
                                                config=cfg), m).s, SDS((m, k), BF), SDS((k, n), BF), y),
      (lambda a, b, y: G.gemm(a, b, epilogue=(G.RowStats(y), G.Store()), config=tuning.fit_role("fwd_store", cfg)),
       SDS((m, k), BF), SDS((k, n), BF), y),
      (lambda a, b, y: G.gemm(a, b, epilogue=(G.RowStats(y), G.Store(jnp.float32)), config=_f32_stats(cfg)),
       SDS((m, k), BF), SDS((k, n), BF), y),
      (lambda a, b, y, bias: G.gemm(a, b, epilogue=G.RowStats(y, G.StatsOptions(30.0), store=True, bias=bias),
                                    config=tuning.fit_role("fwd_store", cfg)),
       SDS((m, k), BF), SDS((k, n), BF), y, SDS((n,), jnp.float32)),
      (lambda a, b, y, bias, r: G.gemm(a, b, epilogue=G.RowStats(y, G.StatsOptions(30.0), store=True, bias=bias,
                                                                  ref=r), config=tuning.fit_role("fwd_store", cfg)),
       SDS((m, k), BF), SDS((k, n), BF), y, SDS((n,), jnp.float32), vec),
      (lambda a, b, y, r: G.gemm(a, b, epilogue=G.RowStats(y, store=True, ref=r), approx_math=True,
                                 config=tuning.fit_role("fwd_store", cfg)), SDS((m, k), BF), SDS((k, n), BF), y, vec),
      # N a whole number of tiles: the statistics without per-element masks
      (lambda a, b, y: G.merge_row_stats(G.gemm(a, b, epilogue=G.RowStats(y, G.StatsOptions(30.0, True)),
                                                config=cfg), m).s, SDS((m, k), BF), SDS((k, 2176), BF), y),
      (lambda a, b, y, r: G.gemm(a, b, epilogue=G.RowStats(y, store=True, ref=r), approx_math=True,
                                 config=tuning.fit_role("fwd_store", cfg)),
       SDS((m, k), BF), SDS((k, 2176), BF), y, vec),
      (lambda e, w, r: G.gemm(e, w, transpose_b=True, epilogue=G.Store(row_scale=r), config=cfg),
       SDS((m, n), BF), SDS((k, n), BF), vec),
      (lambda z, w, l, c, a, y: G.gemm(z, w, transpose_b=True, prologue=G.DzFromLogits(l, c, a, y),
                                       config=tuning.fit_role("dx_prologue", cfg)),
       SDS((m, n), BF), SDS((k, n), BF), vec, vec, vec, y),
      # lean mode's recompute: the logit gradient formed in the epilogue (all options, a bias; w either way round)
      (lambda a, b, l, y, bias: G.gemm(a, b, epilogue=G.LogitGrad(l, l, l, l, y, LOSS_ALL, first=y, bias=bias),
                                       config=tuning.fit_role("lean_dz", cfg)),
       SDS((m, k), BF), SDS((k, n), BF), vec, y, SDS((n,), jnp.float32)),
      (lambda a, b, l, y: G.gemm(a, b, transpose_b=True, epilogue=G.LogitGrad(l, l, l, l, y, LOSS_PLAIN),
                                 approx_math=True, config=tuning.fit_role("lean_dz", cfg)),
       SDS((m, k), BF), SDS((n, k), BF), vec, y),
      # the same and the chunk's two products on a window of w [H, 4096] from a traced start, dw's added in place
      (lambda a, b, l, y, s: G.gemm(a, b, epilogue=G.LogitGrad(l, l, l, l, y, LOSS_PLAIN),
                                    b_window=G.Window(s, n, 1, 64), config=tuning.fit_role("lean_dz", cfg)),
       SDS((m, k), BF), SDS((k, 4096), BF), vec, y, SDS((), jnp.int32)),
      (lambda z, w, c, s: G.gemm(z, w, transpose_b=True, epilogue=G.AddTo(c), b_window=G.Window(s, 1024, 1, 64),
                                 config=tuning.fit_role("dx_acc", cfg)),
       SDS((m, 1024), BF), SDS((k, 4096), BF), SDS((m, k), jnp.float32), SDS((), jnp.int32)),
      (lambda a, z, dw, s: G.gemm(a, z, transpose_a=True, epilogue=G.AddTo(dw, window=G.Window(s, 1024, 0, 64)),
                                  config=cfg),
       SDS((m, 1024), BF), SDS((m, k), BF), SDS((4096, k), BF), SDS((), jnp.int32)),
      # a block of 512 of 2048 tokens: its logits on w's chunk, its xᵀ·dz into a float32 C, dx's rows added into
      (lambda a, b, l, y, s, t: G.gemm(a, b, epilogue=G.LogitGrad(l, l, l, l, y, LOSS_PLAIN),
                                       a_window=G.Window(t, 512, 0), b_window=G.Window(s, n, 1, 64),
                                       config=tuning.fit_role("lean_dz", cfg)),
       SDS((2048, k), BF), SDS((k, 4096), BF), SDS((512,), jnp.float32), SDS((512,), jnp.int32),
       SDS((), jnp.int32), SDS((), jnp.int32)),
      (lambda a, z, c, t: G.gemm(a, z, transpose_a=True, a_window=G.Window(t, 512, 0), epilogue=G.AddTo(c),
                                 config=tuning.fit_role("dw_acc", cfg)),
       SDS((2048, k), BF), SDS((512, 1024), BF), SDS((k, 1024), jnp.float32), SDS((), jnp.int32)),
      (lambda z, w, c, s, t: G.gemm(z, w, transpose_b=True, epilogue=G.AddTo(c, window=G.Window(t, 512, 0)),
                                    b_window=G.Window(s, 1024, 1, 64), config=tuning.fit_role("dx_acc", cfg)),
       SDS((512, 1024), BF), SDS((k, 4096), BF), SDS((2048, k), jnp.float32), SDS((), jnp.int32),
       SDS((), jnp.int32)),
  ]
  for f, *args in cases:
    assert "mosaic_gpu" in _lower(f, *args)


def _warpgroup_barriers(monkeypatch, f, *args) -> int:
  """How many warpgroup barriers (``bar.sync`` of one warpgroup) the Mosaic GPU lowering of ``f`` emits."""
  from jax.experimental.mosaic.gpu import utils as mgpu_utils

  count, emit = [0], mgpu_utils.warpgroup_barrier

  def counted():
    count[0] += 1
    return emit()

  with monkeypatch.context() as m:
    m.setattr(mgpu_utils, "warpgroup_barrier", counted)
    _lower(f, *args)
  return count[0]


@pytest.mark.parametrize("base", [G.GemmConfig(), dataclasses.replace(tuning.PINGPONG_WS, cluster="n")],
                         ids=lambda c: c.schedule)
def test_kernel_without_pallas_barriers_keeps_its_own(base, monkeypatch):
  """The fast forward's kernel (statistics, stored exponentials) lowered for CUDA with ``auto_barriers=False``
  keeps its own two warpgroup barriers per stored sub-tile (the slot's wait, the commit before TMA reads it) and two
  for the statistics rows; with Pallas's (the default) there are at least one more before and one after each of
  those SMEM stores. The ping-pong schedule refuses it."""
  m, n, k = 1000, 2176, 576
  args = (SDS((m, k), BF), SDS((k, n), BF), SDS((m,), jnp.int32), SDS((m,), jnp.float32))
  count = {}
  for auto in (True, False):
    cfg = tuning.fit_role("fwd_store", dataclasses.replace(base, auto_barriers=auto))
    f = lambda a, b, y, r, cfg=cfg: G.gemm(a, b, epilogue=G.RowStats(y, store=True, ref=r), approx_math=True,
                                           config=cfg)
    count[auto] = _warpgroup_barriers(monkeypatch, f, *args)
  cfg = tuning.fit_role("fwd_store", base)
  subtiles = (cfg.tile_m // cfg.epi_m) * (cfg.tile_n // cfg.epi_n)
  assert count[False] >= 2 * subtiles + 2
  assert count[True] >= count[False] + 2 * (subtiles + 4)  # (4 statistics rows)
  with pytest.raises(ValueError, match="auto_barriers=False under the pingpong"):
    dataclasses.replace(tuning.PINGPONG, auto_barriers=False).validate()


@pytest.mark.parametrize("schedule", [tuning.DEFAULT, tuning.PINGPONG_WS], ids=lambda c: c.schedule)
def test_add_to_prefetches_its_target_into_l2(schedule):
  """AddTo's GPU kernel asks for each warpgroup tile of its target in L2 before the tile's K loop (Mosaic GPU's
  ``async_prefetch`` in the lowered module) when its switch or, by default, ``L2_PREFETCH`` says so; a Store never."""
  a, b, c = SDS((1000, 1088), BF), SDS((1000, 2112), BF), SDS((1088, 2112), jnp.float32)
  cfg = tuning.fit_role("dw_acc", schedule)
  lowered = lambda part: _lower(lambda a, b, c: G.gemm(a, b, transpose_a=True, epilogue=part(c), config=cfg), a, b, c)
  assert "async_prefetch" in lowered(lambda c: G.AddTo(c, l2_prefetch=True))
  assert "async_prefetch" not in lowered(lambda c: G.AddTo(c, l2_prefetch=False))
  assert "async_prefetch" not in lowered(lambda c: G.Store())
  assert ("async_prefetch" in lowered(G.AddTo)) == G.L2_PREFETCH
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(G, "L2_PREFETCH", not G.L2_PREFETCH)
    assert ("async_prefetch" in lowered(G.AddTo)) == G.L2_PREFETCH


@pytest.mark.parametrize("cfg", [G.GemmConfig(), G.GemmConfig(wg_split="m", cluster="n", epi_n=32, epi_slots=3),
                                 G.GemmConfig(cluster="m", order_minor="m", order_width=8)], ids=lambda c: c.short())
def test_row_mask_lowers_for_cuda(cfg):
  """The GPU kernel with a ``row_mask`` (a tile's flag read from GMEM, its K loop and epilogue under a branch; with
  a cluster along M, one flag for both CTAs' rows), lowered for CUDA on CPU: the fast design's repair (LogitGrad
  written over E in place, a bias, a soft cap) and an in-place float32 accumulation."""
  m, n, k = 1000, 2176, 576
  cfg = tuning.fit_role("lean_dz", cfg)
  mask = SDS((-(-m // G.row_unit(cfg)),), jnp.int32)
  vec, y = SDS((m,), jnp.float32), SDS((m,), jnp.int32)
  loss = _math.LossSpec(vocab_size=n, logit_softcap=30.0)
  repair = lambda a, b, l, y, e, bias, mk: G.gemm(
      a, b, epilogue=G.LogitGrad(l, l, l, l, y, loss, bias=bias, into=e), config=cfg, row_mask=mk)
  text = _lower(repair, SDS((m, k), BF), SDS((k, n), BF), vec, y, SDS((m, n), BF), SDS((n,), jnp.float32), mask)
  assert "mosaic_gpu" in text and "output_operand_alias" in text
  add = lambda a, b, c, mk: G.gemm(a, b, epilogue=G.AddTo(c), config=tuning.fit_role("dw_acc", cfg), row_mask=mk)
  assert "mosaic_gpu" in _lower(add, SDS((m, k), BF), SDS((k, n), BF), SDS((m, n), jnp.float32), mask)


def test_table_rows_of_the_op_products_lower_on_h100(monkeypatch):
  """The H100 table's rows for the products the fast design runs, at the four heads (among them gemma2-2b's dx in
  128×192 tiles over 3 stages), lower with the hooks the op gives them, their stages as the table says."""
  monkeypatch.setattr(G, "_device_kind", lambda: "NVIDIA H100 80GB HBM3")
  for b, h, v in [(16384, 768, 50304), (8192, 4096, 128256), (4096, 4096, 151936), (8192, 2304, 256000)]:
    e, w, x, sc = SDS((b, v), BF), SDS((h, v), BF), SDS((b, h), BF), SDS((b,), jnp.float32)
    dx = G.table_config("dx", b, h, v, BF, epilogue=G.Store(row_scale=sc))
    assert dx == tuning.select_config("dx", b, h, v, "NVIDIA H100 80GB HBM3")  # no stage taken off
    assert "mosaic_gpu" in _lower(lambda e, w, s: G.gemm(e, w, transpose_b=True, epilogue=G.Store(row_scale=s),
                                                         role="dx"), e, w, sc)
    assert "mosaic_gpu" in _lower(lambda x, e: G.gemm(x, e, transpose_a=True, role="dw"), x, e)
    # the forwards (gpt2-small's rows are the clustered ping-pong), with the op's hooks: a bias, a reference row
    y, bias = SDS((b,), jnp.int32), SDS((v,), jnp.float32)
    assert "mosaic_gpu" in _lower(lambda x, w, y, bias, r: G.gemm(
        x, w, epilogue=G.RowStats(y, store=True, bias=bias, ref=r), role="fwd_store", approx_math=True),
        x, w, y, bias, sc)
    assert "mosaic_gpu" in _lower(lambda x, w, y: G.gemm(x, w, epilogue=G.RowStats(y), role="fwd_stats",
                                                         approx_math=True), x, w, y)
    # lean mode's recompute of one vocabulary chunk (its columns copied out of w), a bias slice with it
    wc, bc = SDS((h, 2048), BF), SDS((2048,), jnp.float32)
    assert "mosaic_gpu" in _lower(lambda x, w, s, y, bias: G.gemm(
        x, w, epilogue=G.LogitGrad(s, s, s, s, y, LOSS_PLAIN, first=y, bias=bias), role="lean_dz", approx_math=True),
        x, wc, sc, y, bc)
  assert G.table_config("fwd_store", 16384, 50304, 768, BF).schedule == "pingpong_ws"


def test_table_config_fits_the_hooks_under_jit():
  """With no config given, the table's row loses stages until the hooks' SMEM fits (decided at trace time)."""
  a, b, y = SDS((1000, 576), BF), SDS((576, 2112), BF), SDS((1000,), jnp.int32)
  assert "mosaic_gpu" in _lower(lambda a, b, y: G.gemm(a, b, epilogue=(G.RowStats(y), G.Store(jnp.float32))), a, b, y)
  assert "mosaic_gpu" in _lower(lambda a, b, y: G.gemm(a, b, epilogue=G.RowStats(y), approx_math=True), a, b, y)


@pytest.mark.parametrize("cfg", [G.GemmConfig(stages=6, wg_split="m", cluster="n", epi_n=32),
                                 G.GemmConfig(stages=6, tile_m=64, tile_n=192, wg_split="m"),
                                 G.GemmConfig(stages=6, wg_split="m", cluster="n", mma_lag=1),
                                 dataclasses.replace(tuning.PINGPONG, stages=4),
                                 dataclasses.replace(tuning.PINGPONG_WS, stages=8),
                                 dataclasses.replace(tuning.PINGPONG_WS, stages=8, cluster="n")],
                         ids=lambda c: c.short())
def test_smem_estimate_is_the_lowerings_count(cfg):
  """``smem_bytes`` (what ``table_config`` fits the stages by) equals Mosaic GPU's own count, for every kind of hook:
  configs past the 227 KB limit, whose lowering error states that count."""
  import re
  m, n, k = 1000, 2112, 576
  a, b, y, vec = SDS((m, k), BF), SDS((k, n), BF), SDS((m,), jnp.int32), SDS((m,), jnp.float32)
  bias, c = SDS((n,), jnp.float32), SDS((1088, n), jnp.float32)
  at, z, wt = SDS((m, 1088), BF), SDS((m, n), BF), SDS((k, n), BF)
  cases = [  # (f, args, Problem, parts, prologue)
      (lambda a, b: G.gemm(a, b, config=cfg), (a, b), (m, n, k, False, False), (G.Store(),), None),
      (lambda a, b, r: G.gemm(a, b, epilogue=G.Store(row_scale=r), config=cfg), (a, b, vec), (m, n, k, False, False),
       (G.Store(row_scale=vec),), None),
      (lambda a, b, y: G.gemm(a, b, epilogue=G.RowStats(y), config=cfg), (a, b, y), (m, n, k, False, False),
       (G.RowStats(y),), None),
      (lambda a, b, y, r, bi: G.gemm(a, b, epilogue=G.RowStats(y, store=True, ref=r, bias=bi), config=cfg),
       (a, b, y, vec, bias), (m, n, k, False, False), (G.RowStats(y, store=True, ref=vec, bias=bias),), None),
      (lambda a, b, c: G.gemm(a, b, transpose_a=True, epilogue=G.AddTo(c), config=cfg), (at, z, c),
       (1088, n, m, True, False), (G.AddTo(c),), None),
      (lambda z, w, l, y: G.gemm(z, w, transpose_b=True, prologue=G.DzFromLogits(l, l, l, y), config=cfg),
       (z, wt, vec, y), (m, k, n, False, True), (G.Store(),), G.DzFromLogits(vec, vec, vec, y)),
      (lambda a, b, l, y, bi: G.gemm(a, b, epilogue=G.LogitGrad(l, l, l, l, y, LOSS_ALL, first=y, bias=bi),
                                     config=cfg), (a, b, vec, y, bias), (m, n, k, False, False),
       (G.LogitGrad(vec, vec, vec, vec, y, LOSS_ALL, first=y, bias=bias),), None),
  ]
  for f, args, dims, parts, prologue in cases:
    if prologue is not None and (cfg.schedule != "cooperative" or cfg.mma_lag):
      continue
    with pytest.raises(ValueError, match="shared memory") as err:
      _lower(f, *args)
    got = int(re.search(r"smem_bytes=(\d+)", str(err.value)).group(1))
    prob = G.Problem(*dims, jnp.dtype(BF), False, 2)
    assert G.smem_bytes(prob, cfg, parts, prologue) == got, (parts, prologue)


def test_shared_memory_budget_is_checked_when_lowering():
  a, b = SDS((1024, 1024), BF), SDS((1024, 1024), BF)
  with pytest.raises(ValueError, match="shared memory"):  # 5 stages of 48 KB + the epilogue exceed 227 KB
    _lower(lambda a, b: G.gemm(a, b, config=G.GemmConfig(stages=5)), a, b)


# ------------------------------------------------------------------------------------------------ tuning table


def test_select_config():
  cfg = tuning.select_config("fwd", 8192, 128256, 4096, "no such device")
  assert cfg == tuning.DEFAULT
  assert tuning.select_config("dw_acc", 4096, 128256, 8192, "no such device").stages == 3
  assert tuning.select_config("fwd_store", 8192, 128256, 4096, "no such device").epi_n == 32
  assert "default" in tuning.describe("dx", 8192, 4096, 128256, "no such device")
  table = tuning.load_table()
  for kind, roles in table.items():
    for role, rows in roles.items():
      for row in rows:
        got, src = tuning.select_row(role, *row["shape"], kind)
        assert got == G.GemmConfig(**row["config"]) and src.startswith("table")
        got.validate()


def test_a_kind_without_rows_takes_those_of_its_chip(monkeypatch):
  """The H200 (GH100, as the H100) takes the H100's rows where it has none of its own, its own where it has them
  (at a bucket where both have one), the H100's nearer row where its own is further away, and explain()'s line
  says whose rows it runs; another chip takes the default."""
  row = lambda tile_n: {"bucket": [8192, 131072, 4096], "shape": [8192, 128256, 4096],
                        "config": {"tile_m": 128, "tile_n": tile_n, "cluster": "n"},
                        "vs_xla": {"ours_ms": 9.0, "xla_ms": 8.0}}
  table = {"nvidia h100 80gb hbm3": {"fwd": [row(128)], "dx": [row(128)]}}
  monkeypatch.setattr(tuning, "load_table", lambda: table)
  got, src = tuning.select_row("fwd", 8192, 128256, 4096, "NVIDIA H200")
  assert got.cluster == "n" and src == ("table: nvidia h100 80gb hbm3/fwd/8192x131072x4096, the same chip as "
                                        "NVIDIA H200")
  assert "the same chip as NVIDIA H200" in tuning.xla_faster("dx", 8192, 128256, 4096, "NVIDIA H200")
  assert tuning.select_config("fwd", 8192, 128256, 4096, "NVIDIA A100-SXM4-80GB") == tuning.DEFAULT
  table["nvidia h200"] = {"fwd": [row(192)]}
  got, src = tuning.select_row("fwd", 8192, 128256, 4096, "NVIDIA H200")
  assert got.tile_n == 192 and src == "table: nvidia h200/fwd/8192x131072x4096"
  # a second H100 row at gemma2-2b's bucket: nearer there than the H200's own row at llama3-8b's
  gemma = {"bucket": [8192, 262144, 2048], "shape": [8192, 256000, 2304], "config": {"tile_n": 256, "cluster": None}}
  table["nvidia h100 80gb hbm3"]["fwd"].append(gemma)
  got, src = tuning.select_row("fwd", 8192, 256000, 2304, "NVIDIA H200")
  assert got.tile_n == 256 and src == ("table: nvidia h100 80gb hbm3/fwd/8192x262144x2048, the same chip as "
                                       "NVIDIA H200")
  assert tuning.select_row("fwd", 8192, 128256, 4096, "NVIDIA H200")[0].tile_n == 192
  assert tuning.select_row("fwd", 8192, 128256, 4096, "NVIDIA H100 80GB HBM3")[0].tile_n == 128
  assert "the same chip as NVIDIA H200" in tuning.xla_faster("dx", 8192, 128256, 4096, "NVIDIA H200")


def test_config_fits_a_small_output(monkeypatch):
  """A row of an LLM head (warpgroups along M, a cluster along N) keeps its tiling there and is fitted to a small
  head's output: the warpgroups side by side along N where M is below the CTA tile (dw of an H = 128 head), no
  cluster where the cluster tile overhangs; explain()'s line says so; the fitted GEMM lowers for CUDA (JAX 0.12
  refuses a window larger than its array at trace time) and computes xᵀ·dz in interpret mode."""
  row = {"bucket": [4096, 131072, 8192], "shape": [4096, 128256, 8192],
         "config": {"tile_m": 128, "tile_n": 128, "wg_split": "m", "cluster": "n"}}
  monkeypatch.setattr(tuning, "load_table", lambda: {"gpu x": {"dw": [row]}})
  assert tuning.select_row("dw", 4096, 128256, 8192, "GPU X") == (G.GemmConfig(**row["config"]),
                                                                 "table: gpu x/dw/4096x131072x8192")
  got, src = tuning.select_row("dw", 128, 1024, 8192, "GPU X")
  assert (got.wg_split, got.cluster) == ("n", "n") and src.endswith(", fitted to the 128x1024 output")
  got, _ = tuning.select_row("dw", 128, 256, 8192, "GPU X")
  assert (got.wg_split, got.cluster) == ("n", None)
  assert tuning.fit_shape(dataclasses.replace(tuning.PINGPONG_WS, cluster="m"), 128, 4096).cluster is None
  monkeypatch.setattr(G, "_device_kind", lambda: "GPU X")
  xs, dzs = SDS((512, 128), BF), SDS((512, 1024), BF)
  assert "mosaic_gpu" in _lower(lambda x, dz: G.gemm(x, dz, transpose_a=True, role="dw"), xs, dzs)
  rng = np.random.default_rng(3)
  x, dz = (jnp.asarray(rng.standard_normal(sh), BF) for sh in ((256, 128), (256, 256)))
  got = G.gemm(x, dz, transpose_a=True, role="dw", interpret=True)
  want = np.asarray(x, np.float64).T @ np.asarray(dz, np.float64)
  assert got.shape == (128, 256) and _rel(got, want) < 1e-2


def test_table_row_picks_the_schedule(monkeypatch):
  """A table row's config names its schedule; the roles with loss work fit it to their SMEM, and it lowers."""
  row = {"bucket": [1024, 2048, 512], "shape": [1000, 2112, 576],
         "config": dataclasses.asdict(dataclasses.replace(tuning.PINGPONG_WS, epi_n=64))}
  monkeypatch.setattr(tuning, "load_table", lambda: {"gpu x": {"fwd": [row], "fwd_stats": [dict(row)]}})
  got, src = tuning.select_row("fwd_stats", 1000, 2112, 576, "GPU X")
  assert got.schedule == "pingpong_ws" and "fwd_stats" in src
  assert tuning.select_config("fwd_store", 1000, 2112, 576, "GPU X") == tuning.fit_role("fwd_store", got)
  acc = tuning.fit_role("dw_acc", got)
  assert acc.schedule == "pingpong_ws" and acc.stages == 5 and acc.epi_n == 32
  monkeypatch.setattr(G, "_device_kind", lambda: "GPU X")
  a, b, y = SDS((1000, 576), BF), SDS((576, 2112), BF), SDS((1000,), jnp.int32)
  assert "mosaic_gpu" in _lower(lambda a, b, y: G.gemm(a, b, epilogue=(G.RowStats(y), G.Store()), role="fwd_store"),
                                a, b, y)


# ------------------------------------------------------------------------------------------------ on a Hopper GPU


GPU_CFGS = [None, G.GemmConfig(wg_split="m", cluster="n"), G.GemmConfig(cluster="m", order_minor="m"),
            tuning.PINGPONG, tuning.PINGPONG_WS, G.GemmConfig(tile_n=192, stages=3, cluster="m", order_width=16),
            G.GemmConfig(wg_split="m", cluster="n", order_width=8, mma_lag=1),
            dataclasses.replace(tuning.PINGPONG_WS, cluster="n"), dataclasses.replace(tuning.PINGPONG_WS, cluster="m")]


@pytest.mark.gpu(min_cc=(9, 0))
@pytest.mark.parametrize("cfg", GPU_CFGS, ids=lambda c: c.short() if c else "table")
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gpu_products(name, cfg):
  rng = np.random.default_rng(7)
  ta, tb = LAYOUTS[name]
  m, n, k = (1088, 2112, 1000) if ta else (1000, 2112, 576)
  a, b, ref = _operands(rng, (ta, tb), m, n, k)
  cfg32 = cfg and dataclasses.replace(cfg, stages=min(cfg.stages, 3 if cfg.schedule != "pingpong_ws" else 5))
  # (a float32 output's SMEM leaves room for 3 stages, 2 x 3 in ping-pong, 5 in a shared ping-pong ring, and 2 of the
  # 128x384 CTA tiles of 128x192 warpgroup tiles)
  prob = G.Problem(m, n, k, ta, tb, jnp.dtype(BF), False, 2)
  while cfg32 and cfg32.stages > 2 and G.smem_bytes(prob, cfg32, (G.Store(jnp.float32),)) > G.SMEM_LIMIT:
    cfg32 = dataclasses.replace(cfg32, stages=cfg32.stages - 1)
  out = G.gemm(a, b, transpose_a=ta, transpose_b=tb, epilogue=G.Store(jnp.float32), config=cfg32)
  assert _rel(out, ref) < 1e-5
  assert _rel(G.gemm(a, b, transpose_a=ta, transpose_b=tb, config=cfg), ref) < 1e-2


@pytest.mark.gpu(min_cc=(9, 0))
@pytest.mark.parametrize("cfg", [None, tuning.PINGPONG_WS, dataclasses.replace(tuning.PINGPONG_WS, cluster="m")],
                         ids=lambda c: c.short() if c else "table")
def test_gpu_windows(cfg):
  """Lean mode's chunk products on windows of w and dw (:func:`_window_cases`) and on blocks of the tokens
  (:func:`_token_window_cases`) on the real kernel, at a shape of whole CTA tiles: H = 576, chunks of 1024 columns
  of V = 4096 (blocks of 1024 of 4096 tokens), the last one clamped (start 3072 - 128)."""
  rng = np.random.default_rng(9)
  for start in (0, 2944):
    for name, call, ref in _window_cases(rng, start, size=1024, m=1000, h=576, v=4096, config=cfg, interpret=False):
      out = call()
      assert _rel(out, ref) < (1e-5 if out.dtype == jnp.float32 else 1e-2), (name, start)
    for name, call, ref in _token_window_cases(rng, start, size=1024, m=4096, h=576, v=4096, config=cfg,
                                               interpret=False):
      out = call()
      assert _rel(out, ref) < (1e-5 if out.dtype == jnp.float32 else 1e-2), (name, start)


@pytest.mark.gpu(min_cc=(9, 0))
@pytest.mark.parametrize("n", [2112, 2176])  # ragged; 17 whole tiles (a 2-CTA cluster overhangs N by one tile)
@pytest.mark.parametrize("base", [tuning.DEFAULT, tuning.PINGPONG, tuning.PINGPONG_WS,
                                  dataclasses.replace(tuning.PINGPONG_WS, cluster="n"),
                                  G.GemmConfig(wg_split="m", cluster="n")], ids=lambda c: c.short())
def test_gpu_hooks(base, n):
  rng = np.random.default_rng(8)
  m, k = 1000, 576
  a, b, ref = _operands(rng, LAYOUTS["x.w"], m, n, k)
  labels = jnp.asarray(rng.integers(0, n, m), jnp.int32)
  sparse = _sparse_labels(rng, m, n)  # (most tiles without a label: the tile table's zeros branch)
  opts = G.StatsOptions(30.0, True)
  st, z = G.gemm(a, b, epilogue=(G.RowStats(labels, opts), G.Store(jnp.float32)),
                 config=_f32_stats(base))  # float32 sub-tiles: fewer stages
  st16, z16 = G.gemm(a, b, epilogue=(G.RowStats(labels, opts), G.Store()),
                     config=tuning.fit_role("fwd_store", base))
  # the max and the target equal; with a cap the sums over the tile's columns are taken per epi_n-wide slice, in an
  # order that follows the config's epi_n: Σexp to float32's rounding, Σzc (128 terms of |zc| ≤ 30, cancelling) to
  # its absolute rounding
  st16, st = np.asarray(st16), np.asarray(st)
  np.testing.assert_array_equal(st16[[0, 2]], st[[0, 2]])
  np.testing.assert_allclose(st16[1], st[1], rtol=1e-5)
  np.testing.assert_allclose(st16[3], st[3], rtol=2e-6, atol=5e-4)
  assert _rel(z16, ref) < 1e-2
  assert _rel(z, ref) < 1e-5
  rs = G.merge_row_stats(st, m)
  lse_ref, tgt_ref, zsum_ref = _stats_ref(ref, np.asarray(labels), 30.0, n)
  np.testing.assert_allclose(np.asarray(rs.m, np.float64) + np.log(np.asarray(rs.s, np.float64)), lse_ref, rtol=1e-5,
                             atol=1e-4)
  np.testing.assert_allclose(np.asarray(rs.target), tgt_ref, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(np.asarray(rs.zsum), zsum_ref, rtol=1e-4, atol=1e-2)
  # the target only in tiles that hold a label: the same statistics as with it in every tile
  for cfg in (_f32_stats(base), tuning.fit_role("fwd_stats", base)):
    for o in (opts, G.StatsOptions()):
      part = G.RowStats(sparse, o, target_tiles=True)
      np.testing.assert_array_equal(np.asarray(G.gemm(a, b, epilogue=part, config=cfg)), np.asarray(
          G.gemm(a, b, epilogue=dataclasses.replace(part, target_tiles=False), config=cfg)))
  y = np.asarray(sparse)
  got = G.merge_row_stats(G.gemm(a, b, epilogue=G.RowStats(sparse, opts), config=tuning.fit_role("fwd_stats", base)),
                          m).target
  np.testing.assert_allclose(np.asarray(got), _stats_ref(ref, np.where(y < n, y, -1), 30.0, n)[1], rtol=1e-5,
                             atol=1e-4)
  # +C
  a2, b2, ref2 = _operands(rng, LAYOUTS["xT.dz"], 1088, n, 1000)
  c = jnp.asarray(rng.standard_normal((1088, n)), jnp.float32)
  out = G.gemm(a2, b2, transpose_a=True, epilogue=G.AddTo(c), config=tuning.fit_role("dw_acc", base))
  assert _rel(out, ref2 + np.asarray(c, np.float64)) < 1e-5
  # dz·wᵀ scaled per row in the epilogue, stored in bf16
  e, wt, ref3 = _operands(rng, LAYOUTS["dz.wT"], m, 576, n)
  sc = rng.uniform(1e-3, 1e3, m)
  out = G.gemm(e, wt, transpose_b=True, epilogue=G.Store(row_scale=jnp.asarray(sc, jnp.float32)), config=base)
  assert out.dtype == BF and _rel(out, ref3 * sc[:, None]) < 1e-2
  # prologue
  zl = _rand(rng, (m, n))
  w = _rand(rng, (k, n), 0.1)
  lse = jnp.asarray(rng.uniform(2, 4, m), jnp.float32)
  coef = jnp.asarray(rng.uniform(0.5, 1.5, m), jnp.float32)
  out = G.gemm(zl, w, transpose_b=True, prologue=G.DzFromLogits(lse, coef, coef, labels), epilogue=G.Store(jnp.float32),
               config=_f32_stats(base))
  dz = _dz_ref(_f64(zl), _f64(lse), _f64(coef), _f64(coef), np.asarray(labels))
  assert _rel(out, dz @ _f64(w).T) < 1e-2
  # lean mode's recompute: the logit gradient formed and stored by the LogitGrad epilogue (soft cap, smoothing, bias)
  bias_v = jnp.asarray(rng.standard_normal(n), jnp.float32)
  part, want = _logit_grad_case(rng, ref, 30.0, 0.1, bias_v)
  _check_logit_grad(G.gemm(a, b, epilogue=part, config=tuning.fit_role("lean_dz", base)), part, want)


@pytest.mark.gpu(min_cc=(9, 0))
@pytest.mark.parametrize("schedule", [tuning.PINGPONG, tuning.PINGPONG_WS,
                                      dataclasses.replace(tuning.PINGPONG_WS, cluster="n"),
                                      dataclasses.replace(tuning.PINGPONG_WS, cluster="m")], ids=lambda c: c.short())
@pytest.mark.parametrize("m,n,k", [(1896, 4160, 1088), (296, 4160, 64), (128, 128, 512), (1024, 4096, 768)])
def test_gpu_pingpong_turns(m, n, k, schedule):
  """The ping-pong schedules where their turn-taking has corners: an odd count of tiles (the last pair's second
  warpgroup has none), several pairs per CTA, a K loop shorter than the stages (one step), CTAs with no tile, a
  K loop that is a multiple of the shared ring (12 steps, 6 slots) and one that is not (17 steps)."""
  rng = np.random.default_rng(9)
  a, b, ref = _operands(rng, LAYOUTS["x.w"], m, n, k)
  labels = jnp.asarray(rng.integers(0, n, m), jnp.int32)
  pp, coop = _f32_stats(schedule), _f32_stats(tuning.DEFAULT)
  st, z = G.gemm(a, b, epilogue=(G.RowStats(labels), G.Store(jnp.float32)), config=pp)
  st_c, z_c = G.gemm(a, b, epilogue=(G.RowStats(labels), G.Store(jnp.float32)), config=coop)
  assert _rel(z, ref) < 1e-5
  np.testing.assert_allclose(np.asarray(z), np.asarray(z_c), rtol=1e-6, atol=1e-5)  # the same tiles and K order
  rs, rs_c = G.merge_row_stats(st, m), G.merge_row_stats(st_c, m)
  for x, y in zip(rs, rs_c):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)
  a2, b2, ref2 = _operands(rng, LAYOUTS["dz.wT"], m, n, k)
  assert _rel(G.gemm(a2, b2, transpose_b=True, config=schedule), ref2) < 1e-2
