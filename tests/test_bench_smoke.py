"""The benchmark harness end to end on CPU (``--preset smoke``): JSON lines, tables, plots, error rows, time limit.

Asserts nothing about time; it checks that every row is there with its fields, that the losses agree with the
harness's float32 reference (so inputs and reference are wired right), that ``auto`` rows record what they
resolved to, that the tables are relative to the plain head, and that failures become rows.
"""

from __future__ import annotations

import gzip
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

import lce_flax
from benchmarks import bench, plots, shapes

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMOKE_LABELS = ("plain_bf16", "auto", "xla", "chunked:fast", "chunked:lean")
RESULTS = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "h100-2026-11-23-peers")


def _rows(path):
  with open(path) as fh:
    return [json.loads(line) for line in fh]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("smoke"))
  assert bench.main(["--preset", "smoke", "--impls", "plain_bf16,auto,xla,chunked", "--out", out]) == 0
  return out, _rows(os.path.join(out, "bench_smoke.jsonl"))


def test_smoke_rows_complete(smoke):
  _, rows = smoke
  preset = shapes.PRESETS["smoke"]
  expected = {(s.name, lab, p) for s, _, passes in shapes.preset_shapes(preset)
              for lab in SMOKE_LABELS for p in passes}
  assert {(r["shape"], r["label"], r["pass"]) for r in rows} == expected
  assert len(rows) == len(expected)
  for r in rows:
    assert "error" not in r, r
    for key in ("device", "platform", "jax", "jaxlib", "date", "B", "H", "V", "impl", "mode", "ms", "tflops",
                "algo_tflops", "floor_ms", "temp_bytes", "loss", "reps", "compile_s"):
      assert key in r, (key, r)
    assert r["ms"] > 0 and r["reps"] >= 1
    assert isinstance(r["temp_bytes"], int) and r["temp_bytes"] > 0
    # FLOPs done: 2·BHV forward; 6 when the gradients come from logits on hand; 8 when the backward recomputes.
    mode = r["design"]["mode"] if r["impl"] == "auto" else r["mode"]
    want = 2 if r["pass"] == "fwd" else 8 if mode == "lean" else 6
    assert r["flops_factor"] == want, r
    assert r["algo_tflops"] == pytest.approx(r["tflops"] * want / (2 if r["pass"] == "fwd" else 6))


def test_smoke_auto_records_its_design(smoke):
  """Every lce_flax row carries what lce_flax.explain says runs; auto's is what impl="auto" picks on this device."""
  _, rows = smoke
  for r in rows:
    if r["impl"] == "plain_bf16":
      assert "design" not in r
      continue
    d = r["design"]
    assert {"impl", "mode", "name", "chunking", "memory_bytes", "config", "notes"} <= set(d), d
    assert r["resolved"] == f"{d['impl']}:{d['mode']}"
    if r["impl"] != "auto":
      assert d["impl"] == r["impl"] and (r["mode"] is None or d["mode"] == r["mode"]), r
  x, w = bench._sds(shapes.Shape("t", 64, 32, 500))
  want = lce_flax.explain(x, w, reduction="sum")
  auto = next(r for r in rows if r["impl"] == "auto" and r["shape"] == "tiny-a")
  assert auto["design"] == bench.design_record(want)


def test_smoke_losses_match_reference(smoke):
  _, rows = smoke
  for r in rows:
    if r["sweep"] is None:  # the smoke preset computes a reference for its named shapes
      # the plain head hands optax bf16 logits: its per-token losses carry bf16 rounding
      assert r["loss_rel_err"] < (1e-2 if r["impl"] == "plain_bf16" else 1e-3), r
      # uniform-ish logits (w = 0.02·N(0,1)): about log V per token
      assert r["ref_loss"] == pytest.approx(r["B"] * float(jnp.log(r["V"])), rel=0.05)


def test_every_pass_has_its_own_reference(tmp_path):
  """The "tokens" pass's loss is a weighted sum of the per-token losses: its reference is the float32 weighted sum
  (float64 NumPy here, independently), not the plain sum the other passes take, so its loss_rel_err reads the
  implementation's precision; and its row records the design ``reduction="none"`` runs (on a CPU ``auto`` takes
  lean mode for it, token chunks for the summed loss)."""
  shape = shapes.Shape("t", 40, 32, 300)
  preset = shapes.Preset("t", shapes=(shape,), passes=("fwdbwd", "tokens", "dx"), min_reps=1, max_reps=1)
  variants, _ = bench.make_variants(["xla", "auto"], ("fast",))
  rows = _rows(bench.run(preset, variants, str(tmp_path), log=lambda s: None))
  x, w, y = (np.asarray(a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a, np.float64)
             for a in bench.make_inputs(shape))
  z = x @ w
  m = z.max(axis=1)
  losses = m + np.log(np.exp(z - m[:, None]).sum(axis=1)) - z[np.arange(len(y)), y.astype(int)]
  weights = np.asarray(bench.token_weights(len(y)), np.float64)
  want = {"fwdbwd": losses.sum(), "dx": losses.sum(), "tokens": (weights * losses).sum()}
  assert sorted((r["impl"], r["pass"]) for r in rows) == sorted((i, p) for i in ("xla", "auto") for p in want)
  for r in rows:
    assert "error" not in r, r
    assert r["ref_loss"] == pytest.approx(want[r["pass"]], rel=1e-5), r
    assert r["loss_rel_err"] < (1e-5 if r["impl"] == "xla" else 1e-3), r
  sds = bench._sds(shape)
  for r in (r for r in rows if r["impl"] == "auto"):
    reduction = "none" if r["pass"] == "tokens" else "sum"
    assert r["design"] == bench.design_record(lce_flax.explain(*sds, reduction=reduction)), r
  assert {r["pass"]: r["design"]["mode"] for r in rows if r["impl"] == "auto"} == {
      "fwdbwd": "fast", "dx": "fast", "tokens": "lean"}


def test_smoke_gradient_norms_agree(smoke):
  _, rows = smoke
  for shape in {r["shape"] for r in rows}:
    rs = [r for r in rows if r["shape"] == shape and r["pass"] == "fwdbwd"]
    assert len(rs) == len(SMOKE_LABELS)
    for key in ("dx_norm", "dw_norm"):
      ref = next(r[key] for r in rs if r["impl"] == "xla")
      assert ref > 0
      for r in rs:
        assert r[key] == pytest.approx(ref, rel=2e-2), (key, r["label"], shape)


def test_smoke_report_written(smoke):
  out, rows = smoke
  for png in ("llm.png", "sweep.png"):
    with open(os.path.join(out, png), "rb") as fh:
      assert fh.read(8) == PNG_MAGIC
  md = open(os.path.join(out, "results.md")).read()
  header = ("| fwd+bwd: ms (× plain_bf16) / extra GB (× plain_bf16) | what, FLOPs | tiny-a 64×32×500 "
            "| tiny-b 100×24×1000 |")
  assert header in md
  assert "| `plain_bf16` | baseline, 6·BHV | " in md
  assert "| `auto` | lce_flax → chunked:fast, 6·BHV | " in md  # on a CPU auto runs the chunked fast design
  assert "| `xla` (float32 reference) | lce_flax, 6·BHV | " in md
  assert "| `chunked:lean` | lce_flax, 8·BHV | " in md and "| `chunked:fast` | lce_flax, 6·BHV | " in md
  lean = next(line for line in md.splitlines() if line.startswith("| `chunked:lean` |"))
  assert lean.count("×) / ") == 2 and lean.count("×) |") == 2  # time and memory ratios to plain_bf16, per shape
  assert "![llm](llm.png)" in md and "![sweep](sweep.png)" in md
  for axis in "VBH":
    assert f"(× plain_bf16) vs {axis}" in md
  assert md.count("\n| tiny-a | ") == sum(r["shape"] == "tiny-a" for r in rows)


def test_failures_become_rows(tmp_path):
  def broken(x, w, labels):
    raise RuntimeError("RESOURCE_EXHAUSTED: pretend out of memory")

  preset = shapes.Preset("t", shapes=(shapes.Shape("t", 16, 8, 40),), min_reps=1, max_reps=1, reference=False)
  variants = [bench.Variant("broken", None, broken, 6), bench.Variant("gone", None, None, 6, "no such backend"),
              *bench._lce_variants("xla", ("fast",))]
  rows = _rows(bench.run(preset, variants, str(tmp_path), log=lambda s: None))
  by = {(r["impl"], r["pass"]): r for r in rows}
  assert "RESOURCE_EXHAUSTED" in by["broken", "fwd"]["error"]
  assert by["gone", "fwdbwd"]["error"] == "unavailable: no such backend"
  assert "error" not in by["xla", "fwdbwd"] and by["xla", "fwdbwd"]["ms"] > 0
  assert "error" in open(plots.report(str(tmp_path))[-1]).read()


def test_time_limit_skips_but_reports(tmp_path):
  assert bench.main(["--preset", "smoke", "--impls", "xla", "--out", str(tmp_path), "--time-limit-s", "0"]) == 0
  rows = _rows(tmp_path / "bench_smoke.jsonl")
  assert rows and all(r["error"].startswith("skipped: past --time-limit-s") for r in rows)
  assert "skipped" in (tmp_path / "results.md").read_text()


def test_plain_f32_upcasts_the_plain_logits(tmp_path):
  """plain_f32 is plain_bf16 with the logits upcast before optax: same gradients, a loss nearer the reference."""
  preset = shapes.Preset("t", shapes=(shapes.Shape("t", 64, 32, 500),), passes=("fwdbwd",), min_reps=1, max_reps=1)
  variants, _ = bench.make_variants(["plain_bf16", "plain_f32"], ("fast",))
  bf16, f32 = _rows(bench.run(preset, variants, str(tmp_path), log=lambda s: None))
  assert (bf16["label"], f32["label"]) == ("plain_bf16", "plain_f32")
  assert f32["loss_rel_err"] <= bf16["loss_rel_err"] and f32["loss_rel_err"] < 1e-4
  assert f32["dw_norm"] == pytest.approx(bf16["dw_norm"], rel=2e-2) and f32["flops_factor"] == 6


def test_results_without_baseline_use_the_floor():
  """Runs made before plain_bf16 existed still render: ratios to the floor, and the table says so."""
  rows = plots.load([RESULTS])
  assert rows and not any(r["impl"] == "plain_bf16" for r in rows)
  md = plots.markdown(rows)
  assert "| fwd+bwd: ms (× floor) / extra GB | what, FLOPs | gpt2-small 16384×768×50304 |" in md
  assert "no `plain_bf16` row" in md and "| `xla` (float32 reference) |" in md
  assert "| `pallas_mosaic:fast` | lce_flax, 6·BHV | 9.50 ms (1.98×) / 0.58 GB | 40.3 ms (1.23×) / 2.13 GB |" in md


def test_unknown_impl_is_an_error():
  with pytest.raises(ValueError, match="--impls: 'nope' .*'pallas_mosaic:tokens<N>' or 'pallas_mosaic:lean<N>'"):
    bench.make_variants(["nope"], ("fast",))


def test_chunk_rows_name_their_design():
  """``pallas_mosaic:tokens<N>`` is the "tokens" fast design in chunks of N tokens, ``pallas_mosaic:lean<N>`` lean
  mode in chunks of N vocabulary columns; explain() of each reports that chunk."""
  tok, lean = bench.make_variants(["pallas_mosaic:tokens256", "pallas_mosaic:lean512"], ("fast",), interpret=True)[0]
  shape = shapes.Shape("t", 1000, 64, 5000)
  assert (tok.mode, lean.mode) == ("tokens256", "lean512")
  assert tok.explain(shape).config.token_chunk == 256
  d = lean.explain(shape)
  assert (d.mode, d.config.vocab_chunk) == ("lean", 512)


def test_tokamax_optional():
  tokamax, reason = bench.import_tokamax()
  (v,), why = bench.make_variants(["tokamax_xla"], ("fast",))
  assert (v.unavailable is None) == (tokamax is not None)
  assert why == reason


def test_preset_shapes_share_sweep_base():
  got = shapes.preset_shapes(shapes.PRESETS["sweep"])
  keys = [(s.B, s.H, s.V) for s, _, _ in got]
  assert len(keys) == len(set(keys)) == 13  # 3 axes × 5 values, the base point once
  base = next(axes for s, axes, _ in got if (s.B, s.H, s.V) == (8192, 2048, 65536))
  assert sorted(base.split(",")) == ["B", "H", "V"]


def test_update_between_markers(tmp_path, smoke):
  out, _ = smoke
  doc = tmp_path / "README.md"
  doc.write_text(f"# x\n\n{plots.START}\nold\n{plots.END}\nafter\n")
  plots.report(out, out_dir=str(tmp_path / "res"), update=str(doc))
  text = doc.read_text()
  assert "old" not in text and text.endswith(f"{plots.END}\nafter\n")
  assert "](res/llm.png)" in text
  (tmp_path / "plain.md").write_text("no markers\n")
  with pytest.raises(ValueError, match="markers"):
    plots.update_file(str(tmp_path / "plain.md"), "t")


def test_update_named_section_leaves_results_alone(tmp_path, smoke):
  """docs/performance.md holds one section per committed run; --no-write links the run's own plots."""
  out, _ = smoke
  before = open(os.path.join(out, "results.md")).read()
  doc = tmp_path / "perf.md"
  a, b = plots.markers("a"), plots.markers("b")
  doc.write_text(f"{a[0]}\nold a\n{a[1]}\nmiddle\n{b[0]}\nold b\n{b[1]}\n")
  assert plots.report(out, update=str(doc), section="b", write=False) == [str(doc)]
  text = doc.read_text()
  assert "old a" in text and "old b" not in text and "middle" in text
  rel = os.path.relpath(out, str(tmp_path))
  assert f"]({rel}/llm.png)" in text and f"]({rel}/sweep.png)" in text
  assert open(os.path.join(out, "results.md")).read() == before


def test_device_peak_from_allocator_counters(monkeypatch):
  """Where the backend keeps allocator counters (GPUs), a row that sets a new peak reports it less the memory in
  use before it and one set of outputs; one that does not gets a note instead of a number."""
  shape = shapes.Shape("t", 16, 8, 40)
  preset = shapes.Preset("t", min_reps=1, max_reps=1)
  (variant,) = bench._lce_variants("xla", ("fast",))
  args = bench.make_inputs(shape)
  counters = iter([{"in_use": 1000, "peak": 5000}, {"in_use": 1000, "peak": 9000}])
  monkeypatch.setattr(bench, "_device_memory", lambda: next(counters))
  row = bench.measure(variant, "fwdbwd", shape, args, preset)
  out_bytes = 4 + 16 * 8 * 2 + 8 * 40 * 2  # the f32 loss and the bf16 gradients of x and w
  assert row["device_peak_bytes"] == 9000 - 1000 - out_bytes
  counters = iter([{"in_use": 1000, "peak": 9000}, {"in_use": 1000, "peak": 9000}])
  row = bench.measure(variant, "fwd", shape, args, preset)
  assert "device_peak_bytes" not in row and "no new allocator peak" in row["device_peak_note"]


def test_kernels_in_interpret_mode(tmp_path):
  """--interpret lets the harness drive the Pallas kernels on a CPU (one tiny ragged shape, fwd+bwd)."""
  preset = shapes.Preset("t", shapes=(shapes.Shape("t", 40, 32, 300),), passes=("fwdbwd",), min_reps=1, max_reps=1)
  variants, _ = bench.make_variants(["xla", "pallas_triton", "pallas_mosaic"], ("fast",), interpret=True)
  assert [v.impl for v in variants] == ["xla", "pallas_triton", "pallas_mosaic"]
  rows = _rows(bench.run(preset, variants, str(tmp_path), log=lambda s: None))
  ref = rows[0]
  for r in rows:
    assert "error" not in r, r
    assert r["loss_rel_err"] < 1e-3 and r["dw_norm"] == pytest.approx(ref["dw_norm"], rel=2e-2), r


_HLO = """HloModule step, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]{0}) parameter(0)
  %c = () conditional(pred[] %q, () %t, () %t), true_computation=%add, false_computation=%add, metadata={op_name="jit(step)/cond"}
  %cb = () custom-call(), custom_call_target="xla_ffi_python_gpu_callback", metadata={op_name="jit(step)/debug_callback"}
  ROOT %r = (s32[], f32[4]{0}) tuple(s32[] %i, f32[4]{0} %x)
}

ENTRY %main (p0: f32[4], p1: bf16[1024,512]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  %p1 = bf16[1024,512]{1,0} parameter(1)
  %all-reduce-start = bf16[1024,512]{1,0} all-reduce-start(bf16[1024,512]{1,0} %p1), to_apply=%add
  all-reduce-start.1 = f32[4]{0} all-reduce-start(f32[4]{0} %p0), to_apply=%add
  %a = f32[4]{0} add(f32[4]{0} %p0, f32[4]{0} %p0)
  %all-reduce-done.1 = f32[4]{0} all-reduce-done(f32[4]{0} %all-reduce-start.1)
  %g = f32[4]{0} fusion(f32[4]{0} %a), kind=kCustom, calls=%add, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %w = (s32[], f32[4]{0}) while((s32[], f32[4]{0}) %t0), condition=%add, body=%body, backend_config={"known_trip_count":{"n":"2"}}
  %w2 = (s32[], f32[4]{0}) while((s32[], f32[4]{0}) %t0), condition=%add, body=%body, metadata={op_name="jit(step)/while"}
  %all-reduce-done = bf16[1024,512]{1,0} all-reduce-done(bf16[1024,512]{1,0} %all-reduce-start)
  %k = (f32[4]{0}, s8[4]{0}) custom-call(f32[4]{0} %a), custom_call_target="__cublas$lt$matmul"
  ROOT %r = f32[4]{0} add(f32[4]{0} %b, f32[4]{0} %b)
}
"""  # noqa: E501


def test_hlo_schedule_reads_collectives_and_host_syncs():
  """benchmarks/hlo_schedule.py on a hand-written scheduled module: each async collective of the entry with the
  instructions and compute between its start and its done (names with and without %, a done of another start not
  counted) and the kernels after its start; every conditional, while of unknown trip count and host callback of
  any computation."""
  from benchmarks import hlo_schedule

  got = hlo_schedule.collectives(_HLO)
  assert [(r["name"], r["kind"], r["shape"], r["between"], r["compute_between"], r["kernels_after"], r["kernels"])
          for r in got] == [("all-reduce-start", "all-reduce", "bf16[1024,512]{1,0}", 6, 3, 4, 4),
                            ("all-reduce-start.1", "all-reduce", "f32[4]{0}", 1, 0, 4, 4)]
  assert got[0]["position"] == 2 and got[0]["position_frac"] == round(2 / 11, 3)
  assert [r["bytes"] for r in got] == [1024 * 512 * 2, 16]
  assert hlo_schedule.shape_bytes("(s32[], f32[2,4096]{1,0}, pred[])") == 4 + 2 * 4096 * 4 + 1
  assert hlo_schedule.collectives(_HLO.replace("all-reduce-done(bf16", "copy(bf16"))[0]["between"] is None
  syncs = hlo_schedule.host_syncs(_HLO)
  assert [(h["computation"], h["name"], h["kind"], h["op_name"]) for h in syncs] == [
      ("body", "c", "conditional", "jit(step)/cond"), ("body", "cb", "host callback", "jit(step)/debug_callback"),
      ("ENTRY", "w2", "while", "jit(step)/while")]
  assert [(r["ready"], r["kernels_held"]) for r in got] == [(-1, 0), (-1, 0)]  # (parameters: ready at once)


def test_hlo_schedule_kernels_held_before_a_collective():
  """``ready`` follows an all-reduce's operand back through cheap instructions (a bitcast, a convert fusion, a tuple
  element) to the last kernel it reduces, whichever operand is later; ``kernels_held`` counts the kernels scheduled
  between that one and the start."""
  from benchmarks import hlo_schedule

  text = """HloModule m, is_scheduled=true

ENTRY %main (p: f32[8]) -> bf16[8] {
  %p = f32[8]{0} parameter(0)
  %k0 = (f32[8]{0}, s8[4]{0}) custom-call(%p), custom_call_target="__cublas$lt$matmul"
  %g0 = f32[8]{0} get-tuple-element(%k0), index=0
  %k1 = (f32[8]{0}, s8[4]{0}) custom-call(%p), custom_call_target="__cublas$lt$matmul"
  %g1 = f32[8]{0} get-tuple-element(%k1), index=0
  %k2 = (f32[8]{0}, s8[4]{0}) custom-call(%p), custom_call_target="__cublas$lt$matmul"
  %cv = bf16[8]{0} fusion(%g1), kind=kLoop, calls=%wrapped_convert_computation
  %bc = bf16[2,4]{1,0} bitcast(%cv)
  %e = f32[8]{0} add(%g0, %p)
  %k3 = (f32[8]{0}, s8[4]{0}) custom-call(%e), custom_call_target="__cublas$lt$matmul"
  %k4 = (f32[8]{0}, s8[4]{0}) custom-call(%p), custom_call_target="__cublas$lt$matmul"
  %s = ((bf16[2,4]{1,0}, f32[8]{0}), bf16[2,4]{1,0}) all-reduce-start(%bc, %e), to_apply=%add
  %d = bf16[2,4]{1,0} all-reduce-done(%s)
  %s2 = f32[8]{0} all-reduce-start(%e), to_apply=%add
  %d2 = f32[8]{0} all-reduce-done(%s2)
  ROOT %r = bf16[8]{0} bitcast(%d)
}
"""
  got = hlo_schedule.collectives(text)
  # %s: %bc <- %cv <- %g1 <- %k1 (position 3); %e <- %g0 <- %k0 (1): ready 3; held: %k2, %k3, %k4
  assert [(r["name"], r["ready"], r["kernels_held"]) for r in got] == [("s", 3, 3), ("s2", 1, 4)]


def test_hlo_schedule_held_kernels_with_no_collective_in_flight():
  """``held_free``: of the kernels a collective was held back past, those during which no asynchronous collective
  was in flight (from any start to its done, both included)."""
  from benchmarks import hlo_schedule

  text = """HloModule m, is_scheduled=true

ENTRY %main (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %k0 = (f32[8]{0}, s8[4]{0}) custom-call(%p), custom_call_target="__cublas$lt$matmul"
  %g0 = f32[8]{0} get-tuple-element(%k0), index=0
  %a = f32[8]{0} all-reduce-start(%p), to_apply=%add
  %k1 = (f32[8]{0}, s8[4]{0}) custom-call(%p), custom_call_target="__cublas$lt$matmul"
  %k2 = (f32[8]{0}, s8[4]{0}) custom-call(%p), custom_call_target="__cublas$lt$matmul"
  %ad = f32[8]{0} all-reduce-done(%a)
  %k3 = (f32[8]{0}, s8[4]{0}) custom-call(%p), custom_call_target="__cublas$lt$matmul"
  %b = f32[8]{0} all-reduce-start(%g0), to_apply=%add
  %bd = f32[8]{0} all-reduce-done(%b)
  ROOT %r = f32[8]{0} add(%ad, %bd)
}
"""
  got = {r["name"]: r for r in hlo_schedule.collectives(text)}
  # %a: ready at once (a parameter), held past %k0 with nothing in flight; %b: ready at %k0 (1), held past %k1,
  # %k2 (while %a is in flight) and %k3 (nothing in flight)
  assert [(got[n]["ready"], got[n]["kernels_held"], got[n]["held_free"]) for n in ("a", "b")] == [(-1, 1, 1),
                                                                                              (1, 3, 1)]


def test_hlo_schedule_peak_live():
  """benchmarks/hlo_schedule.py: XLA's live-range dump read at its peak, buffers largest first with the shapes of
  their instructions (a tuple element keeps its index), and the breakdown by source; a dump without a peak section
  gives empty readings."""
  from benchmarks import hlo_schedule

  live = """HloLiveRange (max 9):
  InstructionSequence:
    0:p
  BufferLiveRange:
    p{}:0-9
  Live ranges at 4 (peak):
    p{}: 4096 bytes (cumulative: 4096 bytes)
    fus.2{1}: 65536 bytes (cumulative: 69632 bytes)
  Stack trace breakdown for peak usage: 69 632 bytes
    main (100.0%, total: 69 632 bytes, current: 0 bytes, remaining: 69 632 bytes)
      └── jit(step)/head (94.1%, total: 65 536 bytes, current: 65 536 bytes, remaining: 4 096 bytes)
"""
  text = """HloModule m, is_scheduled=true

ENTRY %main (p: f32[32,32]) -> f32[] {
  %p = f32[32,32]{1,0} parameter(0)
  %fus.2 = (f32[4]{0}, bf16[128,256]{1,0}) fusion(%p), kind=kLoop, calls=%c
  ROOT %r = f32[] constant(0)
}
"""
  got = hlo_schedule.peak_live(live, text, top=1)
  assert got["at"] == 4 and got["bytes"] == 69632
  assert got["buffers"] == [{"name": "fus.2{1}", "bytes": 65536, "shape": "(f32[4]{0}, bf16[128,256]{1,0})"}]
  assert got["breakdown"][0].strip().startswith("Stack trace breakdown") and "jit(step)/head" in got["breakdown"][2]
  assert hlo_schedule.peak_live("HloLiveRange (max 0):\n") == {"at": None, "bytes": None, "buffers": [],
                                                                "breakdown": []}


def test_hlo_schedule_of_a_recorded_gpu_step():
  """benchmarks/hlo_schedule.py on the fused head's compiled step recorded on two H200s (data=2, results of
  2026-11-27): the counts read off that file by hand. Eleven all-reduces, all started after 157 of the step's
  189 kernels; the head's (bf16[1024,131072]) and the embedding's after the last, the head's held back past the
  body's whole backward; six host syncs in the head."""
  from benchmarks import hlo_schedule

  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results",
                      "trainer-scaling-2026-11-27", "run3_bf10960", "step_data2.hlo.txt.gz")
  s = hlo_schedule.summary(hlo_schedule.read(path))
  cs = s["collectives"]
  assert s["entry_instructions"] == 2299 and len(cs) == 11 and {c["kind"] for c in cs} == {"all-reduce"}
  assert all(c["kernels"] == 189 for c in cs) and max(c["kernels_after"] for c in cs) == 32
  assert sum(c["bytes"] for c in cs) == 1_011_048_452  # 512 MiB + 256 MiB + 8 x 24 MiB + 4 MiB
  head = next(c for c in cs if c["shape"].startswith("((bf16[1024,131072]"))
  assert (head["between"], head["kernels_after"]) == (2, 0) and head["op_name"].endswith("head/jit(_op)/shard_map/psum")
  # the head's dw is ready after its "tokens" loop (entry position 478), 136 kernels before its all-reduce starts
  assert (head["ready"], head["kernels_held"], head["held_free"]) == (478, 136, 104)
  assert max(c["kernels_held"] for c in cs if c["shape"].startswith("((bf16[12588032]")) == 1  # the layers': none
  assert sorted(h["kind"] for h in s["host_syncs"]) == ["conditional"] * 2 + ["host callback"] * 2 + ["while"] * 2
  assert all("/head/" in h["op_name"] for h in s["host_syncs"])


def test_hlo_schedule_head_reduction_held_with_the_slot_free():
  """The fused data=2 step recorded on two H200s at ac777ec (run9, layers' backward in order): the head's dw
  all-reduce is ready 136 kernels before it starts, and 128 of those run with no collective in flight, so no limit
  on collectives in flight kept it back there."""
  import tarfile

  from benchmarks import hlo_schedule

  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results",
                      "trainer-scaling-2026-11-27", "run9_ac777ec", "scaling", "hlo.tar")
  with tarfile.open(path) as tar:
    text = gzip.decompress(tar.extractfile("step_data2_fused_default.hlo.txt.gz").read()).decode()
  cs = hlo_schedule.collectives(text)
  head = next(c for c in cs if c["shape"].startswith("((bf16[1024,131072]"))
  assert (head["ready"], head["position"], head["kernels_held"], head["held_free"]) == (493, 1750, 136, 128)
  assert (head["between"], head["kernels_after"]) == (2, 0)


def test_trainer_scaling_variants():
  """benchmarks/trainer_scaling.py --variant: NAME:KEY=VALUE,... as the trainer's --compiler-option arguments,
  --flag items as they are and env:KEY=VALUE items as the process's environment (``default`` first), malformed ones
  refused; weak scaling within a variant; the mesh kinds of k devices, and the processes planned for them."""
  from benchmarks.trainer_scaling import mesh_kinds, meshes, parse_variants, planned, split_env, weak_scaling

  assert parse_variants(["lhs:xla_gpu_enable_latency_hiding_scheduler=true,xla_x=2"]) == {
      "default": [], "lhs": ["--compiler-option", "xla_gpu_enable_latency_hiding_scheduler=true",
                             "--compiler-option", "xla_x=2"]}
  assert parse_variants(["u:--no-layer-grads-in-order,xla_y=1"])["u"] == [
      "--no-layer-grads-in-order", "--compiler-option", "xla_y=1"]
  for bad in ("lhs", "lhs:", ":a=1", "lhs:a", "n:env:NCCL_MAX_NCHANNELS", "n:env:1X=2"):
    with pytest.raises(SystemExit, match="--variant"):
      parse_variants([bad])
  # env: items: the trainer process's environment, split off its arguments (and off those compiled in-process)
  nch = parse_variants(["nch:env:NCCL_MAX_NCHANNELS=4,--pgle=2,env:NCCL_ALGO=Ring,xla_z=1"])["nch"]
  assert nch == ["--pgle=2", "--compiler-option", "xla_z=1", "--env=NCCL_MAX_NCHANNELS=4", "--env=NCCL_ALGO=Ring"]
  assert split_env(nch) == (["--pgle=2", "--compiler-option", "xla_z=1"],
                            {"NCCL_MAX_NCHANNELS": "4", "NCCL_ALGO": "Ring"})
  row = lambda k, var, t: {"k": k, "mesh": f"data={k}", "head": "fused", "variant": var, "step_time_s": t}
  got = weak_scaling([row(1, "default", 0.10), row(1, "lhs", 0.08), row(2, "default", 0.125), row(2, "lhs", 0.1)])
  assert [r["weak_scaling"] for r in got] == [1.0, 1.0, 0.8, 0.8]
  assert meshes(1) == {"data": "data=1"}
  # the one-device row is every kind's baseline: it runs whatever --meshes names (else no weak scaling)
  got = planned([1, 4], ["fsdp", "tensor"], ["fused"], ["default"])
  assert [(k, mesh) for k, _, mesh, _, _ in got] == [(1, "data=1"), (4, "fsdp=4"), (4, "data=2,tensor=2")]
  assert planned([1, 4], ["fsdp"], ["fused"], ["default"], done={(1, "data=1", "fused", "default")}) == [
      (4, "fsdp", "fsdp=4", "fused", "default")]
  assert mesh_kinds("data,tensor") == ["data", "tensor"]
  with pytest.raises(SystemExit, match="unknown mesh kind.*'fdsp'"):
    mesh_kinds("data,fdsp")
  assert meshes(4) == {"data": "data=4", "fsdp": "fsdp=4", "tensor": "data=2,tensor=2"}


def test_trainer_scaling_runs_on_cpu(tmp_path):
  """benchmarks/trainer_scaling.py end to end on 2 simulated CPU devices with a tiny model: the fused head with
  and without a variant's compiler option and with a profile-guided one, and the schedule and compiled memory of
  each on one and two devices (the CPU has no asynchronous collectives)."""
  import gzip
  import json
  import subprocess
  import sys
  import tarfile

  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, "-m", "benchmarks.trainer_scaling", "--preset", "cpu", "--small", "--ks",
                         "2", "--meshes", "data", "--heads", "fused", "--steps", "2", "--schedule",
                         "--variant", "lhs:xla_gpu_enable_latency_hiding_scheduler=true",
                         "--variant", "pgle:--pgle=1", "--out", str(tmp_path),
                         "--jax-cache-dir", str(tmp_path / "jc")],
                        capture_output=True, text=True, env=env, timeout=600,
                        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = json.loads((tmp_path / "trainer_scaling.json").read_text())
  assert [(r["k"], r["variant"], r["variant_args"]) for r in got["rows"]] == [
      (2, "default", []), (2, "lhs", ["--compiler-option", "xla_gpu_enable_latency_hiding_scheduler=true"]),
      (2, "pgle", ["--pgle=1"])]
  assert all(r["step_time_s"] > 0 and r["error"] is None for r in got["rows"])
  assert [(sc["k"], sc["head"], sc["variant"], sc["collectives"]) for sc in got["schedule"]] == [
      (1, "fused", v, []) if k == 1 else (2, "fused", v, []) for v in ("default", "lhs", "pgle") for k in (1, 2)]
  assert all(sc["entry_instructions"] > 0 and sc["memory"]["peak"] > 0 for sc in got["schedule"])
  # each schedule is compiled at the rows' per-device batch (the default 8 sequences), k times it on k devices
  assert [sc["batch_size"] for sc in got["schedule"]] == [8, 16] * 3

  # the GPU check's per-device memory comparison (section 4) reads these rows
  from benchmarks import hlo_schedule
  from benchmarks.trainer_scaling import memory_growth
  grow = memory_growth(got["schedule"], "fused", "lhs")
  one, two = (sc for sc in got["schedule"] if sc["variant"] == "lhs")
  assert grow["k"] == 2 and grow["batch_sizes"] == [8, 16]
  assert grow["temp_ratio"] == two["memory"]["temp"] / one["memory"]["temp"] > 0
  assert grow["live_ratio"] == two["peak_live"]["bytes"] / one["peak_live"]["bytes"] > 0
  assert [bool(sc["note"]) for sc in got["schedule"]] == [False, True] * 3
  # what is alive at each compiled step's memory peak (XLA's live ranges): the buffers sum to at most the peak
  # bytes XLA reports there, each is named with its shape, and the breakdown by source names the model
  for sc in got["schedule"]:
    pk = sc["peak_live"]
    assert pk["at"] > 0 and 0 < sum(b["bytes"] for b in pk["buffers"]) <= pk["bytes"], pk
    assert all(b["shape"] for b in pk["buffers"]) and "breakdown for peak usage" in pk["breakdown"][0]
    assert any("TransformerLM" in line for line in pk["breakdown"]), pk["breakdown"]
  with tarfile.open(tmp_path / "hlo.tar") as hlo:
    names = hlo.getnames()
    text = gzip.decompress(hlo.extractfile("step_data2_fused_lhs.hlo.txt.gz").read()).decode()
    live = gzip.decompress(hlo.extractfile("step_data2_fused_lhs.live-range.txt.gz").read()).decode()
  assert sorted(names) == sorted(f"step_data{k}_fused_{v}.{kind}.txt.gz" for v in ("default", "lhs", "pgle")
                                 for k in (1, 2) for kind in ("hlo", "live-range"))
  assert "ENTRY" in text and "(peak)" in live
  # the profile-guided variant's schedule is its run's last compile of the step, read from XLA's dump: on the CPU
  # (an empty profile) the same program as the one compiled here, but printed with a tuple's elements as `%x#i`
  # where the compiled object's text has get-tuple-element instructions
  with tarfile.open(tmp_path / "hlo.tar") as hlo:
    for k in (1, 2):
      entries = [hlo_schedule.computations(gzip.decompress(hlo.extractfile(f"step_data{k}_fused_{v}.hlo.txt.gz")
                                                           .read()).decode())["ENTRY"] for v in ("default", "pgle")]
      ops = [[op for _, _, op, _ in e if op != "get-tuple-element"] for e in entries]
      assert ops[0] == ops[1] and len(entries[0]) > len(entries[1]), k
  assert os.listdir(tmp_path / "jc")  # the trainers' compilation cache


def test_trainer_scaling_joins_earlier_jobs(tmp_path):
  """benchmarks/trainer_scaling.py: rows of an earlier job (same preset and per-device batch) are taken as done and
  enter the weak-scaling ratios t(1)/t(k) of their head; a job of another per-device batch is refused."""
  import json

  from benchmarks.trainer_scaling import previous_rows, weak_scaling

  row = lambda k, head, t: {"k": k, "mesh": f"data={k}", "head": head, "step_time_s": t, "error": None}
  job = tmp_path / "job1"
  job.mkdir()
  (job / "trainer_scaling.json").write_text(json.dumps(
      {"preset": "gpu", "per_device_batch": 8, "rows": [row(1, "fused", 0.10), row(1, "plain", 0.12)]}))
  prev = previous_rows([str(job / "trainer_scaling.json")], "gpu", 8)
  assert [(r["k"], r["head"], r["from"]) for r in prev] == [(1, "fused", "job1"), (1, "plain", "job1")]
  got = weak_scaling(prev + [row(4, "fused", 0.104), row(4, "plain", None)])
  assert [r["weak_scaling"] for r in got] == [1.0, 1.0, round(0.10 / 0.104, 4), None]
  with pytest.raises(SystemExit, match="per-device batch 8"):
    previous_rows([str(job / "trainer_scaling.json")], "gpu", 16)


def test_trainer_scaling_takes_the_median_of_repeats():
  """benchmarks/trainer_scaling.py --repeats: one row per (k, mesh, head) in first-seen order, the median of the
  repeats that ran, all their times kept; an error only where every repeat failed."""
  from benchmarks.trainer_scaling import aggregate, weak_scaling

  row = lambda k, head, t, rep, err=None: {"k": k, "mesh": f"data={k}", "head": head, "step_time_s": t,
                                           "tokens_per_s_per_device": t and 8192 / t, "error": err, "repeat": rep}
  raw = [row(1, "fused", 0.10, 0), row(2, "fused", 0.12, 0), row(2, "plain", None, 0, ["OOM"]),
         row(1, "fused", 0.14, 1), row(2, "fused", 0.11, 1), row(2, "plain", None, 1, ["OOM"]),
         row(1, "fused", 0.11, 2), row(2, "fused", None, 2, ["timeout"]), row(2, "plain", None, 2, ["OOM"])]
  got = aggregate(raw)
  assert [(r["k"], r["head"]) for r in got] == [(1, "fused"), (2, "fused"), (2, "plain")]
  assert got[0]["step_time_s"] == 0.11 and got[0]["step_times_s"] == [0.10, 0.14, 0.11] and "repeat" not in got[0]
  assert got[1]["step_time_s"] == pytest.approx(0.115) and got[1]["error"] is None
  assert got[1]["tokens_per_s_per_device"] == pytest.approx((8192 / 0.12 + 8192 / 0.11) / 2)
  assert got[2]["step_time_s"] is None and got[2]["error"] == ["OOM"]
  assert weak_scaling(got)[1]["weak_scaling"] == round(0.11 / got[1]["step_time_s"], 4)


def test_bench_lean_runs_each_kernel_and_checks_it(tmp_path, monkeypatch):
  """benchmarks/bench_lean.py in interpret mode at a tiny head: the chunk's recompute on the GEMM equals the
  kernels_ws design's, every contender is timed, and the sweep writes a tuning row of the table's format."""
  import json

  from benchmarks import bench_lean

  monkeypatch.setenv("SWEEP_N", "1")  # (one config of the sweep's grid beside the table's)
  assert bench_lean.main(["--interpret", "--shapes", "tiny", "--rounds", "1", "--sweep", "--out", str(tmp_path)]) == 0
  rows = json.loads((tmp_path / "bench_lean.json").read_text())["rows"]
  check, chunk, *configs, sweep = rows
  assert check["kind"] == "check" and check["lean_dz_vs_kernels_ws_rel_err"] < 1e-2
  # each config of the sweep (the ping-pong schedules among them) checked against the kernels_ws recompute
  assert [r["kind"] for r in configs] == ["check"] * len(configs) and len(configs) == len(sweep["ms"]) - 1
  assert all(r["rel_err_vs_kernels_ws"] < 1e-2 for r in configs), configs
  assert {r["config"] for r in configs} == set(sweep["ms"]) - {"xla"}
  assert sum("pingpong_ws" in k for k in sweep["ms"]) == 3, sweep["ms"]
  assert set(chunk["ms"]) == {"xla", "gemm", "lean_dz", "kernels_ws"} and "gemm[lean_dz] 128x512x64" in chunk[
      "lean_dz_config"]
  assert sweep["best"] in sweep["ms"] and sweep["best"] != "xla"
  ((kind, roles),) = json.loads((tmp_path / "lean_dz_rows.json").read_text())["devices"].items()
  (row,) = roles["lean_dz"]
  assert row["shape"] == [128, 512, 64] and set(row["vs_xla"]) == {"ours_ms", "xla_ms"}
  # in the table's format: benchmarks/tuning_table.py merges it under the device's kind
  from benchmarks import tuning_table

  table = tmp_path / "table.json"
  table.write_text(json.dumps({"devices": {}}))
  assert tuning_table.merge(str(tmp_path / "lean_dz_rows.json"), str(table)) == {"replaced": 0, "added": 1}
  assert json.loads(table.read_text())["devices"][kind]["lean_dz"] == [row]


def test_trainer_profile_sums_device_time():
  """benchmarks/trainer_profile.py: on a trace of a GPU's streams (and its "XLA Ops" copies, not counted), busy
  time is the union of the kernels' intervals, the collectives are summed apart, launches of one kernel group
  together; ms per step, against hand-computed values."""
  from benchmarks.trainer_profile import device_summary, growth, kernel_group

  meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
          {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "name": "process_name", "pid": 8, "args": {"name": "/device:GPU:1"}},
          {"ph": "M", "name": "thread_name", "pid": 7, "tid": 1, "args": {"name": "Stream #13(Compute)"}},
          {"ph": "M", "name": "thread_name", "pid": 7, "tid": 2, "args": {"name": "Stream #20(Nccl)"}},
          {"ph": "M", "name": "thread_name", "pid": 7, "tid": 3, "args": {"name": "XLA Ops"}}]
  x = lambda pid, tid, ts, dur, name: {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name}
  events = meta + [
      x(7, 1, 0, 1000, "loop_add_fusion.3"), x(7, 1, 1000, 500, "loop_add_fusion.17"),
      x(7, 1, 3000, 2000, "mosaic_gpu_kernel"),
      x(7, 2, 1200, 1000, "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"),
      x(7, 3, 0, 9000, "loop_add_fusion.3"),  # the op line: not a stream
      x(8, 1, 0, 99000, "other device"), x(1, 1, 0, 99000, "host")]
  got = device_summary(events, steps=2)
  # busy: [0, 2200] ∪ [3000, 5000] = 4200 us over 2 steps; collectives 1000 us
  assert got["device"] == "/device:GPU:0" and got["busy_ms"] == 2.1 and got["collective_ms"] == 0.5
  assert got["kernels"] == {"mosaic_gpu_kernel": 1.0, "loop_add_fusion": 0.75,
                           "ncclDevKernel_AllReduce_Sum_bf16_RING_LL": 0.5}
  assert kernel_group("input_reduce_fusion.140") == "input_reduce_fusion" and kernel_group("fusion_777") == "fusion"
  # idle: one gap of 800 us (2200 -> 3000) between the all-reduce and the Mosaic kernel, 0.4 ms per step
  assert got["idle_ms"] == 0.4 and got["idle_gaps"] == [
      {"us": 800.0, "after": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "before": "mosaic_gpu_kernel"}]
  assert device_summary(meta[:1] + events[-1:], 1)["busy_ms"] is None  # no device: the CPU
  more = {**got, "kernels": {**got["kernels"], "loop_add_fusion": 2.0}}
  assert growth(got, more)[0] == ("loop_add_fusion", 0.75, 2.0)


def test_trainer_profile_exposed_collectives():
  """benchmarks/trainer_profile.py: a collective's time with no other kernel of the device running is counted as
  exposed, by collective and the kernel that ended last before it, per step; a collective under a compute kernel
  adds nothing; against hand-computed values."""
  from benchmarks.trainer_profile import exposed_collectives

  ar, ag = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(args)", "ncclDevKernel_AllGather_RING_LL"
  spans = [(0, 1000, "gemm_fusion_dot.4"), (900, 1600, "loop_add_fusion.2"), (3000, 5000, "mosaic_gpu_kernel"),
           (1200, 2200, ar),  # 1200-1600 under the add, 1600-2200 alone
           (3500, 4000, ag),  # under the Mosaic kernel
           (4800, 5300, ar), (5100, 5400, ag)]  # 4800-5000 under it; 5000-5400 alone (the two overlap)
  got = exposed_collectives(spans, steps=2)
  assert got["compute_ms"] == round((1600 + 2000) / 2e3, 4)
  assert got["exposed_collective_ms"] == round((600 + 400) / 2e3, 4)
  rows = {(e["collective"], e["after"]): e for e in got["exposed"]}
  assert rows[("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "gemm_fusion_dot")] == {
      "collective": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "after": "gemm_fusion_dot", "launches_per_step": 0.5,
      "ms": 0.5, "exposed_ms": 0.3}
  assert rows[("ncclDevKernel_AllGather_RING_LL", "loop_add_fusion")]["exposed_ms"] == 0.0
  # after the Mosaic kernel's end (5000): the all-reduce 4800-5300 began before it ended, so it follows the add
  assert rows[("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "loop_add_fusion")]["exposed_ms"] == 0.15
  assert rows[("ncclDevKernel_AllGather_RING_LL", "mosaic_gpu_kernel")]["exposed_ms"] == 0.15
  assert got["exposed"][0]["exposed_ms"] == 0.3  # largest first


def test_trainer_profile_runs_on_cpu(tmp_path):
  """benchmarks/trainer_profile.py end to end on 2 simulated CPU devices with a tiny model: one run per (k, head)
  (and mesh, with ``--meshes``), each step timed (the CPU trace has no device process, so no device numbers);
  ``--compiler-option`` reaches the step's compile (a misspelled one fails it)."""
  import json
  import subprocess
  import sys

  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}

  def run(*extra):
    return subprocess.run([sys.executable, "-m", "benchmarks.trainer_profile", "--preset", "cpu", "--small", "--ks",
                           "1,2", "--steps", "2", "--warmup", "1", "--out", str(tmp_path), *extra],
                          capture_output=True, text=True, env=env, timeout=600,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

  bad = run("--heads", "fused", "--compiler-option", "xla_gpu_enable_latency_hiding_schedulr=true")
  assert bad.returncode != 0 and "xla_gpu_enable_latency_hiding_schedulr" in bad.stderr
  proc = run("--compiler-option", "xla_gpu_enable_latency_hiding_scheduler=true")
  assert proc.returncode == 0, proc.stderr[-3000:]
  runs = json.loads((tmp_path / "trainer_profile.json").read_text())["runs"]
  assert [(r["k"], r["head"], r["batch_size"]) for r in runs] == [(1, "fused", 8), (2, "fused", 16), (1, "plain", 8),
                                                                   (2, "plain", 16)]
  assert all(r["step_ms"] > 0 and len(r["step_ms_all"]) == 2 and r["busy_ms"] is None for r in runs)
  # --meshes: k = 1 once, then each mesh kind of k = 2 (FSDP: the parameters split over the devices)
  assert run("--heads", "fused", "--meshes", "data,fdsp").returncode != 0
  proc = run("--heads", "fused", "--meshes", "data,fsdp")
  assert proc.returncode == 0, proc.stderr[-3000:]
  runs = json.loads((tmp_path / "trainer_profile.json").read_text())["runs"]
  assert [(r["k"], r["mesh"], r["batch_size"]) for r in runs] == [(1, "data=1", 8), (2, "data=2", 16),
                                                                   (2, "fsdp=2", 16)]
  assert "fused, fsdp=2: step" in proc.stdout and "fused, data=2: step" in proc.stdout


def test_bench_lean_widths(tmp_path):
  """benchmarks/bench_lean.py --widths in interpret mode at a tiny head: lean's forward and backward at its own
  chunk width and narrower ones, the same gradients at each; and the wave efficiency against hand counts."""
  import json

  from benchmarks import bench_lean
  from lce_flax._impl.pallas_mosaic import tuning

  assert bench_lean.main(["--interpret", "--shapes", "tiny", "--rounds", "1", "--widths", "--out", str(tmp_path)]) == 0
  (row,) = [r for r in json.loads((tmp_path / "bench_lean.json").read_text())["rows"] if r["kind"] == "widths"]
  assert row["default"] == 512 and set(row["ms"]) == {"512", "384", "256"} and row["vs_default"]["512"] == 1.0
  assert row["max_grad_rel_diff"] < 1e-2
  assert set(row["temp_bytes"]) == set(row["ms"]) and all(v > 0 for v in row["temp_bytes"].values())
  assert row["over_bound"] == [k for k, v in row["temp_bytes"].items() if v > row["lean_bound_bytes"]]
  # --chunks: the op's width and the given ones (here V = 512 is the op's own: none can be wider)
  assert bench_lean.main(["--interpret", "--shapes", "tiny", "--rounds", "1", "--widths", "--chunks", "128,256",
                          "--out", str(tmp_path)]) == 0
  (row,) = [r for r in json.loads((tmp_path / "bench_lean.json").read_text())["rows"] if r["kind"] == "widths"]
  assert set(row["ms"]) == {"512", "256", "128"} and row["max_grad_rel_diff"] < 1e-2
  assert row["lean_bound_bytes"] == 128 * 64 * 4 + 64 * 10**6  # (the op's own: LEAN_EXTRA_BYTES)
  # --chunk-products: each width once per owner of the chunk's two products, the same gradients
  assert bench_lean.main(["--interpret", "--shapes", "tiny", "--rounds", "1", "--widths", "--chunks", "256",
                          "--chunk-products", "xla,gemm", "--out", str(tmp_path)]) == 0
  (row,) = [r for r in json.loads((tmp_path / "bench_lean.json").read_text())["rows"] if r["kind"] == "widths"]
  assert set(row["ms"]) == {"512:xla", "512:gemm", "256:xla", "256:gemm"} and row["default"] == "512:xla"
  assert row["max_grad_rel_diff"] < 1e-2
  # --token-blocks: lean mode in blocks of 128 of 384 tokens beside the op's own step and the same pair in one
  # block (tb_all), the same gradients
  assert bench_lean.main(["--interpret", "--shapes", "tiny-tall", "--rounds", "1", "--widths", "--chunks", "256",
                          "--token-blocks", "128", "--out", str(tmp_path)]) == 0
  (row,) = [r for r in json.loads((tmp_path / "bench_lean.json").read_text())["rows"] if r["kind"] == "widths"]
  assert set(row["ms"]) == {"512", "256", "tb128", "tb_all"} and row["max_grad_rel_diff"] < 1e-2
  assert row["temp_bytes"]["tb128"] and row["temp_bytes"]["tb_all"]
  # llama3-8b's lean chunk on a 256×256 cluster tile: 32 × 7 = 224 tiles on 66 clusters: 4 waves, 3.39 used
  cfg = tuning.GemmConfig(wg_split="m", cluster="n")
  assert bench_lean.wave_efficiency(cfg, 8192, 1792, 132) == 8192 * 1792 / (4 * 66 * 256 * 256)
  assert bench_lean.wave_efficiency(cfg, 8192, 1536, 132) == 8192 * 1536 / (3 * 66 * 256 * 256)


def test_bench_lean_products():
  """benchmarks/bench_lean.py --products: lean's three chunk products on XLA against float64 NumPy (the chunk's
  logits rounded to bf16 as XLA's bf16 product rounds them), and the row's widths and floors at a small head."""
  import numpy as np

  from benchmarks import bench_lean

  rng = np.random.default_rng(11)
  b, h, v, cw, n = 40, 24, 200, 48, 3  # ragged: n·cw = 144 of 200 columns
  x = jnp.asarray(rng.normal(size=(b, h)), jnp.bfloat16)
  w = jnp.asarray(0.3 * rng.normal(size=(h, v)), jnp.bfloat16)
  dx, dw = bench_lean.chunk_products(n, cw)(x, w)
  xf, wf = np.asarray(x, np.float64), np.asarray(w, np.float64)
  dz = [np.asarray(jnp.asarray(xf @ wf[:, k * cw:(k + 1) * cw], jnp.bfloat16), np.float64) for k in range(n)]
  want_dx = sum(d @ wf[:, k * cw:(k + 1) * cw].T for k, d in enumerate(dz))
  want_dw = np.concatenate([xf.T @ d for d in dz], axis=1)
  np.testing.assert_allclose(np.asarray(dx), want_dx, rtol=2e-2, atol=2e-2 * np.abs(want_dx).max())
  np.testing.assert_allclose(np.asarray(dw, np.float64), want_dw, rtol=2e-2, atol=2e-2 * np.abs(want_dw).max())
  y = jnp.asarray(rng.integers(0, v, size=(b,)), jnp.int32)
  row = bench_lean.products_row("small", x, w, y, cw, rounds=1)
  assert row["kind"] == "products" and list(row["ms_per_chunk"]) == ["48", "96", "192"]  # 384 > 200 columns
  assert row["lean_target_ms"] == pytest.approx(1.25 * row["plain_ms"], abs=2e-3)
  for c in ("48", "96", "192"):
    assert row["lean_floor_ms"][c] >= row["forward_ms"] > 0 and row["ms_per_chunk"][c] > 0
    assert row["chunk_bytes"][c] == b * int(c) * 2


def test_bench_floors_sums_the_fastest_products(tmp_path):
  """benchmarks/bench_floors.py in interpret mode at a tiny head: every product's contenders timed, our GEMM's
  bare product equal to XLA's, the floor the sum of each role's fastest, lean's floor one forward product more,
  and each head's ratio taken against the plain head of the same process."""
  import json

  from benchmarks import bench_floors

  assert bench_floors.main(["--interpret", "--shapes", "tiny", "--rounds", "1", "--out", str(tmp_path)]) == 0
  data = json.loads((tmp_path / "floors.json").read_text())
  assert data["device"] and data["jax"]
  meta, row = data["rows"]
  assert meta["kind"] == "meta" and row["kind"] == "floor" and (row["B"], row["H"], row["V"]) == (256, 64, 960)
  prods = row["products"]
  assert set(prods) == {"fwd", "dx", "dw"}
  for role, p in prods.items():
    assert set(p["ms"]) == {"xla", "ours"}, role  # (jax's example is left out in interpret mode)
    assert p["best_ms"] == min(p["ms"].values()) and p["ms"][p["best"]] == p["best_ms"]
    assert p["ours_rel_err_vs_xla"] < 1e-3 and f"gemm[{role}]" in p["ours_cfg"]
  # (the file rounds times to 1e-3 ms and ratios to 1e-4, from unrounded values: the checks allow those roundings,
  # which at the tiny head's sub-millisecond times are more than 1e-3 of a ratio)
  half_ms = 5e-4 + 1e-9
  assert row["floor_ms"] == pytest.approx(sum(p["best_ms"] for p in prods.values()), abs=4 * half_ms)
  assert row["lean_floor_ms"] == pytest.approx(row["floor_ms"] + prods["fwd"]["best_ms"], abs=3 * half_ms)
  assert set(row["heads_ms"]) == {"plain", "auto"}
  plain = row["heads_ms"]["plain"]
  for key, ms in (("floor_vs_plain", row["floor_ms"]), ("auto_vs_plain", row["heads_ms"]["auto"])):
    ratio = ms / plain
    assert row[key] == pytest.approx(ratio, abs=5e-5 + half_ms * (1 + ratio) / (plain - half_ms)), key
  with pytest.raises(SystemExit):
    bench_floors.main(["--shapes", "llama3-70b", "--out", str(tmp_path)])


def test_probe_embed_grads_small(tmp_path):
  """benchmarks/probe_embed_grads.py at its CPU size: every form at both row counts and both id laws, timed, and each
  within one bf16 rounding of the float64 sum when it accumulates in float32 (the bf16 forms round every update)."""
  from benchmarks import probe_embed_grads

  assert probe_embed_grads.main(["--small", "--rounds", "1", "--out", str(tmp_path)]) == 0
  with open(tmp_path / "results.json") as f:
    res = json.load(f)
  rows = res["rows"]
  assert {(r["form"], r["rows"], r["ids"]) for r in rows} == {
      (form, n, law) for form in ("bf16", "f32", "sorted_bf16", "sorted_f32") for n in (96, 384)
      for law in ("uniform", "zipf")}
  assert res["device"] and all(r["ms"] > 0 for r in rows)
  assert all(r["rel_err"] <= 2.0 ** -8 for r in rows if r["form"].endswith("f32")), rows
  zipf = {r["form"]: r["rel_err"] for r in rows if r["ids"] == "zipf" and r["rows"] == 384}
  assert zipf["bf16"] > 2 * zipf["f32"], zipf


def test_trainer_scaling_leaves_failed_steps_out_of_the_schedule():
  """A data-parallel row whose every trainer process failed names its step for ``--schedule`` to skip (an XLA
  abort compiling it in the driver's process would end the job); rows of other meshes, and rows that ran, do not."""
  from benchmarks.trainer_scaling import aggregate, failed_steps

  row = lambda k, mesh, var, t, err=None, rep=0: {"k": k, "mesh": mesh, "head": "fused", "variant": var,
                                                  "step_time_s": t, "error": err, "repeat": rep}
  rows = aggregate([row(1, "data=1", "an", 0.05), row(4, "data=4", "an", None, ["Check failed: buffer"]),
                    row(4, "fsdp=4", "an", None, ["OOM"]), row(4, "data=4", "default", None, ["flaky"]),
                    row(4, "data=4", "default", 0.06, rep=1)])
  assert failed_steps(rows) == {("fused", "an", 4): "['Check failed: buffer']"}


def test_profile_head_reads_the_last_call_in_order(tmp_path):
  """benchmarks/profile_head.py: ``last_call`` keeps the first GPU's stream kernels of the last of ``steps`` calls,
  in launch order, named by group; the driver runs on the CPU (no device numbers)."""
  import json

  from benchmarks import profile_head

  meta = [{"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "name": "process_name", "pid": 8, "args": {"name": "/device:GPU:1"}},
          {"ph": "M", "name": "thread_name", "pid": 7, "tid": 1, "args": {"name": "Stream #13(Compute)"}},
          {"ph": "M", "name": "thread_name", "pid": 7, "tid": 3, "args": {"name": "XLA Ops"}}]
  x = lambda pid, tid, ts, dur, name: {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name}
  events = meta + [x(7, 1, 0, 100, "gemm.1"), x(7, 1, 110, 50, "loop_fusion.2"),  # first call
                   x(7, 1, 5000, 100, "gemm.1"), x(7, 1, 5120, 30, "loop_fusion.4"), x(7, 1, 5100, 10, "copy.3"),
                   x(7, 3, 5000, 900, "gemm.1"), x(8, 1, 5000, 900, "other device")]
  events.append(x(7, 1, 130, 5, "copy.3"))  # (each call launches the same three kernels)
  assert profile_head.last_call(events, 2) == [("gemm", 100.0), ("copy", 10.0), ("loop_fusion", 30.0)]
  assert profile_head.last_call(meta[1:2], 2) == []
  assert profile_head.main(["--interpret", "--shapes", "tiny", "--steps", "1", "--warmup", "1",
                            "--out", str(tmp_path)]) == 0
  rows = json.loads((tmp_path / "profile_head.json").read_text())["rows"]
  assert [(r["shape"], r["head"]) for r in rows] == [("tiny", "plain"), ("tiny", "auto")]
  assert all(r["wall_ms"] > 0 and r["busy_ms"] is None for r in rows)


def test_probe_clocks_reads_nvidia_smi_samples():
  """benchmarks/probe_clocks.py: medians of the clock and power columns, the most frequent limit reasons; lines that
  are not samples (an error, a header) are skipped; no sample at all reads as None."""
  from benchmarks.probe_clocks import parse_samples

  lines = ["1755, 690.12, 0x0000000000000004", "1620, 701.50, 0x0000000000000004", "bad line",
           "[N/A], 650.0, 0x0", "1980, 420.0, 0x0000000000000000"]
  assert parse_samples(lines) == {"sm_mhz": 1755.0, "power_w": 690.1, "reasons": "0x0000000000000004",
                                  "samples": 3}
  assert parse_samples(["Field \"x\" is not a valid field to query."]) == {
      "sm_mhz": None, "power_w": None, "reasons": None, "samples": 0}


@pytest.fixture
def package_table():
  """``use(path)``: the package reads its tuning table from ``path`` (its cached reads dropped; call it again after
  the file changes); the package's own table again after the test."""
  import contextlib

  from lce_flax._impl.pallas_mosaic import tuning

  with contextlib.ExitStack() as stack:
    yield lambda path: stack.enter_context(tuning.table_at(path))


def test_tuning_table_merges_gemm_rows_of_another_kind(tmp_path, package_table):
  """benchmarks/tuning_table.py: GEMM rows written on an H200 go under its kind beside the H100's (a row of the same
  kind, role and bucket replaced, the kind matched whatever its case), the H100's rows untouched; the package then
  runs the H200's row at its bucket and the H100's elsewhere; a file with no rows is an error naming it."""
  import json

  from benchmarks import tuning_table
  from lce_flax._impl.pallas_mosaic import tuning

  row = lambda bkt, tile_n: {"bucket": bkt, "shape": bkt, "config": {"tile_n": tile_n}}
  llama, gemma = [8192, 131072, 4096], [8192, 262144, 2048]
  table = tmp_path / "gemm_tuning.json"
  table.write_text(json.dumps({"devices": {"NVIDIA H100 80GB HBM3": {"fwd": [row(llama, 128), row(gemma, 128)]}},
                               "steps": {}}))
  first = tmp_path / "first.json"
  first.write_text(json.dumps({"devices": {"NVIDIA H200": {"fwd": [row(llama, 192)], "dx": [row(llama, 128)]}}}))
  assert tuning_table.merge(str(first), str(table)) == {"replaced": 0, "added": 2}
  again = tmp_path / "again.json"
  again.write_text(json.dumps({"devices": {"nvidia h200": {"fwd": [row(llama, 256)]}}}))
  assert tuning_table.merge(str(again), str(table)) == {"replaced": 1, "added": 0}
  got = json.loads(table.read_text())["devices"]
  assert sorted(got) == ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]
  assert [r["config"]["tile_n"] for r in got["NVIDIA H200"]["fwd"]] == [256]
  assert [r["config"]["tile_n"] for r in got["NVIDIA H100 80GB HBM3"]["fwd"]] == [128, 128]
  package_table(table)
  assert tuning.select_config("fwd", 8192, 128256, 4096, "NVIDIA H200").tile_n == 256
  cfg, src = tuning.select_row("fwd", 8192, 256000, 2304, "NVIDIA H200")
  assert cfg.tile_n == 128 and "nvidia h100 80gb hbm3/fwd/8192x262144x2048, the same chip" in src
  empty = tmp_path / "empty.json"
  empty.write_text(json.dumps({"meta": {}}))
  with pytest.raises(ValueError, match="empty.json: no"):
    tuning_table.merge(str(empty), str(table))


def test_tuning_table_refuses_a_lean_row_over_its_bound(tmp_path):
  """benchmarks/tuning_table.py: a lean steps row whose chosen pair's step held more than lean mode's bound is
  refused, naming the row, the pair and both sizes, and the table stays as it was; the same row within the bound
  is merged."""
  import json

  from benchmarks import tuning_table

  table = tmp_path / "gemm_tuning.json"
  before = json.dumps({"devices": {}, "steps": {"NVIDIA H200": []}})
  table.write_text(before)
  row = {"design": "recompute", "bucket": [16384, 1024, 65536], "shape": [16384, 768, 50304], "name": "gpt2-small",
         "products": ["gemm", "gemm"], "ms": {"plain": 7.0, "gemm,gemm": 10.3, "xla,xla": 11.0}, "source": "test",
         "temp_gb": {"gemm,gemm": 0.1539, "xla,xla": 0.0947}, "temp_bound_gb": 0.1143,
         "vocab_chunk": {"gemm,gemm": 1792, "xla,xla": 768}}
  new = tmp_path / "steps.json"
  new.write_text(json.dumps({"steps": {"NVIDIA H200": [row]}}))
  with pytest.raises(ValueError, match=r"gpt2-small of NVIDIA H200 chose \(gemm,gemm\), whose step held 0.1539 GB, "
                                       r"over lean mode's bound of 0.1143 GB; not merged"):
    tuning_table.merge(str(new), str(table))
  assert table.read_text() == before
  new.write_text(json.dumps({"steps": {"NVIDIA H200": [{**row, "products": ["xla", "xla"]}]}}))
  assert tuning_table.merge(str(new), str(table)) == {"replaced": 0, "added": 1}


def test_bench_step_products_merges_rows_into_the_table(tmp_path, package_table):
  """benchmarks/tuning_table.py (bench_step_products --merge): a steps row replaces the table's row of the same kind,
  design and bucket, others stay; the GEMM rows are untouched; the package reads the merged rows
  (tuning.step_products)."""
  import json

  from benchmarks import tuning_table
  from lce_flax._impl.pallas_mosaic import tuning

  row = lambda design, bkt, pair, t: {"design": design, "bucket": bkt, "shape": bkt, "products": pair,
                                      "ms": {"gemm,gemm": t, ",".join(pair): t - 1.0}, "source": "test"}
  table = tmp_path / "gemm_tuning.json"
  table.write_text(json.dumps({"devices": {"NVIDIA H100 80GB HBM3": {"fwd": []}},
                               "steps": {"NVIDIA H100 80GB HBM3": [row("logits", [8192, 4096, 131072],
                                                                       ["gemm", "xla"], 40.0),
                                                                   row("tokens", [8192, 4096, 131072],
                                                                       ["xla", "gemm"], 41.0)]}}))
  new = tmp_path / "steps.json"
  new.write_text(json.dumps({"steps": {"NVIDIA H100 80GB HBM3": [row("logits", [8192, 4096, 131072],
                                                                     ["xla", "xla"], 39.0)]}}))
  tuning_table.merge(str(new), str(table))
  got = json.loads(table.read_text())
  assert got["devices"] == {"NVIDIA H100 80GB HBM3": {"fwd": []}}
  rows = got["steps"]["NVIDIA H100 80GB HBM3"]
  assert [(r["design"], r["products"]) for r in rows] == [("tokens", ["xla", "gemm"]), ("logits", ["xla", "xla"])]
  package_table(table)
  pair, why = tuning.step_products("logits", 8000, 4096, 128256, "NVIDIA H200")
  assert pair == ("xla", "xla") and "38.00 ms against (gemm, gemm) 39.00" in why
  assert why.endswith("(table: nvidia h100 80gb hbm3/steps/logits/8192x4096x131072, the same chip as NVIDIA H200)")
  assert tuning.step_products("logits", 2048, 4096, 128256, "NVIDIA H100 80GB HBM3") is None
  # an H200 row of its own at the bucket: the H200 runs it; the H100 keeps its own
  h200 = tmp_path / "h200.json"
  h200.write_text(json.dumps({"steps": {"NVIDIA H200": [row("logits", [8192, 4096, 131072], ["gemm", "gemm"],
                                                            37.0)]}}))
  tuning_table.merge(str(h200), str(table))
  package_table(table)
  pair, why = tuning.step_products("logits", 8000, 4096, 128256, "NVIDIA H200")
  assert pair == ("gemm", "gemm") and why.endswith("(table: nvidia h200/steps/logits/8192x4096x131072)")
  assert tuning.step_products("logits", 8000, 4096, 128256, "NVIDIA H100 80GB HBM3")[0] == ("xla", "xla")


def test_bench_step_products_check_row():
  """bench_step_products --check on the CPU: the plain head and auto timed both ways (each call waited for, and ten
  queued), the ratios taken from the same medians."""
  from benchmarks import bench_step_products

  r = bench_step_products.check_row("tiny", 1, True)
  assert r["impl"] == "chunked" and set(r["ms"]) == set(r["ms_queued"]) == {"plain", "auto"}
  assert abs(r["auto_vs_plain"] - r["ms"]["auto"] / r["ms"]["plain"]) < 2e-3
  assert abs(r["auto_vs_plain_queued"] - r["ms_queued"]["auto"] / r["ms_queued"]["plain"]) < 2e-3
  assert all(v > 0 for v in (*r["ms"].values(), *r["ms_queued"].values()))


def test_bench_step_products_capped_heads_compute_the_same_loss():
  """--check --logit-softcap: the plain head capped as Gemma 2's Flax head does it (bf16 logits) and auto with
  ``logit_softcap`` are the same function (loss and gradients, against float64 NumPy's capped loss); the row says
  the cap; the flag goes with --check only."""
  from benchmarks import bench_step_products
  from benchmarks.bench_floors import head_steps
  from tests.reference_np import linear_cross_entropy_np

  rng = np.random.default_rng(11)
  b, h, v = 96, 32, 300
  x = jnp.asarray(rng.standard_normal((b, h)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((h, v)), jnp.bfloat16)  # logits of std ~6: the cap of 5 bends most of them
  y = jnp.asarray(rng.integers(0, v, b), jnp.int32)  # (the plain head masks nothing: every token counts)
  heads = head_steps(y, False, True, logit_softcap=5.0)
  (lp, gp), (la, ga) = heads["plain"](x, w), heads["auto"](x, w)
  ref = linear_cross_entropy_np(x, w, y, reduction="sum", logit_softcap=5.0)
  want = float(ref["loss"])
  assert abs(float(la) - want) <= 1e-4 * abs(want)
  assert abs(float(lp) - want) <= 2e-2 * abs(want)  # (bf16 logits and losses)
  for g, r in ((ga, 1e-2), (gp, 5e-2)):
    for got, exact in zip(g, (ref["dx"], ref["dw"])):
      assert np.linalg.norm(np.asarray(got, np.float64) - exact) <= r * np.linalg.norm(exact)
  uncapped = float(head_steps(y, False, True)["auto"](x, w)[0])
  assert abs(uncapped - want) > 1e-2 * abs(want)
  r = bench_step_products.check_row("tiny", 1, True, logit_softcap=30.0)
  assert r["logit_softcap"] == 30.0 and r["auto_vs_plain"] > 0
  with pytest.raises(SystemExit, match="--check"):
    bench_step_products.main(["--logit-softcap", "30", "--shapes", "tiny", "--interpret"])


def test_bench_step_products_lean_row(monkeypatch):
  """bench_step_products --mode lean on the CPU: lean mode's step with each pair of chunk products beside the plain
  head, a steps row of the design "recompute" that the package reads back (tuning.step_products), and each pair's
  compiled temporaries against lean mode's bound."""
  from benchmarks import bench_step_products
  from lce_flax._impl.pallas_mosaic import tuning

  two = (("xla", "xla"), ("gemm", "gemm"))  # (of the four: each pair is a whole interpreted step, timed 12 times)
  r = bench_step_products.step_row("tiny", 1, True, "lean", pairs=two)
  pairs = {",".join(p) for p in two}
  assert r["design"] == "recompute" and r["shape"] == [256, 64, 960] and r["bucket"] == [256, 64, 1024]
  assert set(r["ms"]) == pairs | {"plain"} and set(r["temp_gb"]) == set(r["vs_plain"]) == pairs
  assert ",".join(r["products"]) == min(pairs, key=r["ms"].get)
  assert r["temp_bound_gb"] == round((256 * 64 * 4 + 64 * 10**6) / 1e9, 4)
  assert all(0 < t <= r["temp_bound_gb"] for t in r["temp_gb"].values()), r["temp_gb"]
  assert r["over_bound"] == []  # (the pair is the fastest of those within the bound: here all of them)
  kind = "NVIDIA H100 80GB HBM3"
  monkeypatch.setattr(tuning, "load_steps", lambda: {tuning.norm_kind(kind): [r]})
  assert tuning.step_products("recompute", 256, 64, 960, kind)[0] == tuple(r["products"])
  assert tuning.step_products("logits", 256, 64, 960, kind) is None


def test_bench_step_products_lean_widths(monkeypatch):
  """bench_step_products --mode lean --widths on the CPU: a pair timed at its own chunk width and at the narrower
  whole-tile widths asked (not at one off the tiles), the row keeping its fastest width's time, width and
  temporaries, every width's time in ``width_ms``; lean mode then runs the chosen pair at that width, where it is
  whole tiles within the memory its own width fits (else at its own)."""
  from benchmarks import bench_step_products
  from lce_flax._impl.pallas_mosaic import gemm, op, tuning

  r = bench_step_products.step_row("tiny", 1, True, "lean", pairs=(("gemm", "gemm"),), widths_asked=[384, 100])
  own = op.plan(256, 64, 960, op.Config(products="gemm"), interpret=True, mode="lean").vocab_chunk
  assert set(r["width_ms"]) == {"gemm,gemm"} and set(r["width_ms"]["gemm,gemm"]) == {str(own), "384"}
  assert set(r["ms"]) == {"gemm,gemm", "plain"} and set(r["vocab_chunk"]) == set(r["temp_gb"]) == {"gemm,gemm"}
  assert r["token_block"] == {"gemm,gemm": None}  # (256 tokens: one block)
  fastest = min(r["width_ms"]["gemm,gemm"], key=r["width_ms"]["gemm,gemm"].get)
  assert r["vocab_chunk"]["gemm,gemm"] == int(fastest) and r["ms"]["gemm,gemm"] == r["width_ms"]["gemm,gemm"][fastest]
  # (read back at V = 1024 of the same bucket, where lean mode runs on the GEMM: V whole 128-column tiles)
  kind, own = "NVIDIA H100 80GB HBM3", op.plan(256, 64, 1024, op.Config(products="gemm"), interpret=True,
                                               mode="lean").vocab_chunk
  monkeypatch.setattr(gemm, "_device_kind", lambda: kind)
  for width, runs in ((384, 384), (300, own), (own + 128, own)):
    row = {**r, "vocab_chunk": {"gemm,gemm": width}}
    monkeypatch.setattr(tuning, "load_steps", lambda row=row: {tuning.norm_kind(kind): [row]})
    p = op.plan(256, 64, 1024, interpret=True, mode="lean")
    assert p.products == ("gemm", "gemm") and p.vocab_chunk == runs, (width, p.vocab_chunk)


def test_bench_step_products_lean_blocks():
  """bench_step_products --mode lean --widths --blocks on the CPU: the GEMM's pair also in blocks of tokens at each
  width asked; each variant's time under its width and blocks in ``width_ms``, the row
  keeping the fastest within lean's bound, with the blocks it ran (``token_block``)."""
  from benchmarks import bench_step_products
  from lce_flax._impl.pallas_mosaic import op

  # (V whole 128-column tiles: blocks of tokens need lean mode on the GEMM)
  own = op.plan(256, 64, 1024, op.Config(products="gemm"), interpret=True, mode="lean").vocab_chunk
  r = bench_step_products.step_row("256x64x1024", 1, True, "lean", pairs=(("gemm", "gemm"),),
                                   widths_asked=[512], blocks_asked=[128])
  ms = r["width_ms"]["gemm,gemm"]
  assert set(ms) == {str(own), "512", "512/tb128"}, ms
  fastest = min(ms, key=ms.get)
  assert r["ms"]["gemm,gemm"] == ms[fastest] and r["vocab_chunk"]["gemm,gemm"] == int(fastest.split("/")[0])
  assert r["token_block"]["gemm,gemm"] == (128 if "/tb" in fastest else None)
  assert set(r["temp_gb"]) == {"gemm,gemm"} and r["over_bound"] == []


def test_probe_table_ab_compiles_the_step_under_each_table(tmp_path):
  """benchmarks/probe_table_ab.py on the CPU: the step compiled under the package's table and under a copy with a
  row merged (a lean_dz row of another config at the shape's bucket), the explain() notes naming each table's
  row, the two steps' gradients equal, and the package's table as it was afterwards."""
  import dataclasses
  import json

  from benchmarks import probe_table_ab
  from lce_flax._impl.pallas_mosaic import gemm, tuning

  before = open(tuning.TABLE_PATH).read()
  kind = gemm._device_kind()  # (the kind whose rows the op reads here)
  cfg = dataclasses.asdict(dataclasses.replace(tuning.DEFAULT, order_width=8))
  rows = tmp_path / "rows.json"
  rows.write_text(json.dumps({"devices": {kind: {"lean_dz": [{"bucket": [256, 1024, 64], "shape": [256, 1024, 64],
                                                                "config": cfg}]}}}))
  assert probe_table_ab.main(["--interpret", "--rows", str(rows), "--shapes", "256x64x1024", "--rounds", "1",
                              "--out", str(tmp_path / "out")]) == 0
  meta, r = json.loads((tmp_path / "out" / "results.json").read_text())["rows"]
  assert meta["merged"] == {"replaced": 0, "added": 1}
  assert set(r["ms"]) == {"plain", "table", "merged"} and r["grad_rel_diff"] < 1e-6 and "merged" in r["speedup"], r
  lean_dz = [[n for n in r["plans"][k] if "gemm[lean_dz]" in n] for k in ("table", "merged")]
  assert lean_dz[0] != lean_dz[1] and "order=n8" in lean_dz[1][0], lean_dz
  assert open(tuning.TABLE_PATH).read() == before and tuning.TABLE_PATH.endswith("gemm_tuning.json")


def test_probe_table_ab_flips_a_kernel_switch(tmp_path):
  """probe_table_ab.py --flag on the CPU: the step compiled with a switch of the kernels off and on, in each mode
  asked, the switch as it was afterwards; a name that is not a boolean switch fails before any shape runs."""
  import json

  from benchmarks import probe_table_ab
  from lce_flax._impl.pallas_mosaic import gemm

  before = gemm.L2_PREFETCH
  assert probe_table_ab.main(["--interpret", "--flag", "gemm.L2_PREFETCH", "--mode", "fast,lean", "--shapes",
                              "256x64x1024", "--rounds", "1", "--out", str(tmp_path / "out")]) == 0
  head, *rows = json.loads((tmp_path / "out" / "results.json").read_text())["rows"]
  assert head == {"flag": "gemm.L2_PREFETCH"} and [r["mode"] for r in rows] == ["fast", "lean"]
  for r in rows:  # (the interpreted kernels prefetch nothing: the two steps are the same program)
    assert set(r["ms"]) == {"plain", "off", "on"} and r["grad_rel_diff"] == 0.0 and set(r["speedup"]) == {"on"}, r
  assert gemm.L2_PREFETCH is before
  with pytest.raises(ValueError, match="no boolean NOPE"):
    probe_table_ab.main(["--interpret", "--flag", "gemm.NOPE", "--shapes", "256x64x1024", "--out", str(tmp_path)])


def test_probe_table_ab_sweeps_a_roles_config_in_the_step(tmp_path):
  """probe_table_ab.py --role --configs on the CPU: the step compiled with every lean_dz GEMM on the table's config
  changed, each change named in explain()'s lean_dz note; a change the kernel refuses is recorded, not fatal; the
  table's own pick as it was afterwards."""
  import json

  from benchmarks import probe_table_ab
  from lce_flax._impl.pallas_mosaic import tuning

  pick = tuning.select_row
  assert probe_table_ab.main(["--interpret", "--role", "lean_dz", "--configs", "order_width=8;tile_k=48",
                              "--shapes", "256x64x1024", "--rounds", "1", "--out", str(tmp_path / "out")]) == 0
  head, r = json.loads((tmp_path / "out" / "results.json").read_text())["rows"]
  assert head == {"role": "lean_dz", "configs": ["order_width=8", "tile_k=48"]}
  assert set(r["ms"]) == {"plain", "table", "order_width=8"} and set(r["speedup"]) == {"order_width=8"}, r
  assert "tile_k=48" in r["errors"] and r["grad_rel_diff"] < 1e-6, r
  lean_dz = {k: [n for n in r["plans"][k] if "gemm[lean_dz]" in n] for k in ("table", "order_width=8")}
  assert "changed" not in lean_dz["table"][0] and "changed: {'order_width': 8}" in lean_dz["order_width=8"][0], r
  assert tuning.select_row is pick
  with pytest.raises(SystemExit):  # (--role without --configs)
    probe_table_ab.main(["--interpret", "--role", "lean_dz", "--shapes", "256x64x1024", "--out", str(tmp_path)])


def test_gpu_check_spreads_test_workers_over_the_gpus():
  """tests/conftest.py's gpu_of_worker, as benchmarks/gpu_check.sh uses it on a host of N GPUs (LCE_FLAX_TEST_GPUS):
  xdist worker gwK sees the K mod N-th GPU it may use, within CUDA_VISIBLE_DEVICES where that is set; nothing is
  pinned without it, outside a worker, or with it empty (one GPU)."""
  import subprocess

  from tests.conftest import gpu_of_worker

  on = lambda **env: gpu_of_worker(env)
  assert [on(LCE_FLAX_TEST_GPUS="2", PYTEST_XDIST_WORKER=f"gw{k}") for k in range(5)] == ["0", "1", "0", "1", "0"]
  assert [on(LCE_FLAX_TEST_GPUS="2", PYTEST_XDIST_WORKER=f"gw{k}", CUDA_VISIBLE_DEVICES="4,6") for k in range(3)] == [
      "4", "6", "4"]
  assert on(LCE_FLAX_TEST_GPUS="2", PYTEST_XDIST_WORKER="gw3", CUDA_VISIBLE_DEVICES="4,5,6,7") == "5"
  assert on(PYTEST_XDIST_WORKER="gw1") is None and on(LCE_FLAX_TEST_GPUS="2") is None
  assert on(LCE_FLAX_TEST_GPUS="", PYTEST_XDIST_WORKER="gw1") is None
  assert subprocess.run(["bash", "-n", "benchmarks/gpu_check.sh"], cwd=os.path.dirname(os.path.dirname(__file__)),
                        capture_output=True).returncode == 0


def test_bench_step_products_chunk_row():
  """bench_step_products --chunks on the CPU: the "tokens" design at a chunk beside the plain head, each step's
  extra memory from its compiled step, the ratio taken from the same medians."""
  from benchmarks import bench_step_products

  r = bench_step_products.chunk_row("tiny", [128], 1, True)
  assert r["shape"] == [256, 64, 960] and set(r["ms"]) == {"128", "plain"} and r["errors"] == {}
  assert set(r["temp_gb"]) == {"128", "plain"} and r["products"]["128"] == ["xla", "xla"]
  assert abs(r["vs_plain"]["128"] / (r["ms"]["128"] / r["ms"]["plain"]) - 1) < 2e-3


def test_probe_clocks_products_are_the_bare_products():
  """probe_clocks --products: each of the three products on ours and on XLA's GEMM, with its 2·B·H·V FLOPs (what the
  energy per FLOP divides by), and the same product from both."""
  import numpy as np

  from benchmarks import bench, probe_clocks
  from benchmarks.bench_floors import SHAPES

  x, w, _ = bench.make_inputs(SHAPES["tiny"])
  calls = probe_clocks.product_contenders(x, w, True)
  assert sorted(calls) == sorted(f"{r}_{g}" for r in ("fwd", "dx", "dw") for g in ("xla", "ours"))
  assert {c[2] for c in calls.values()} == {2.0 * 256 * 64 * 960}
  f, args, _ = calls["dw_xla"]
  g, gargs, _ = calls["dw_ours"]
  np.testing.assert_allclose(np.asarray(g(*gargs), np.float32), np.asarray(f(*args), np.float32), rtol=2e-2, atol=2e-2)


def test_probe_clocks_forwards_compute_the_forward():
  """probe_clocks --forwards: the bare forward on XLA's and on our GEMM, the lean forward's statistics and the fast
  forward's stored exponentials are what they claim, against float64 NumPy at the tiny head, each with 2·B·H·V
  FLOPs."""
  import numpy as np

  from benchmarks import bench, probe_clocks
  from benchmarks.bench_floors import SHAPES
  from lce_flax._impl.pallas_mosaic import gemm

  x, w, y = bench.make_inputs(SHAPES["tiny"])
  (b, h), v = x.shape, w.shape[1]
  calls = probe_clocks.forward_contenders(x, w, y, True)
  assert sorted(calls) == ["fwd_ours", "fwd_xla", "stats", "store"]
  assert {c[2] for c in calls.values()} == {2.0 * b * h * v}
  z = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  for name in ("fwd_xla", "fwd_ours"):
    f, args, _ = calls[name]
    np.testing.assert_allclose(np.asarray(f(*args), np.float64), z, rtol=2e-2, atol=2e-2)
  m = z.max(axis=1)
  lse = m + np.log(np.exp(z - m[:, None]).sum(axis=1))
  f, args, _ = calls["stats"]
  rs = gemm.merge_row_stats(f(*args), b)
  np.testing.assert_allclose(np.asarray(rs.m + jnp.log(rs.s), np.float64), lse, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(rs.target, np.float64), z[np.arange(b), np.asarray(y)], rtol=1e-4, atol=1e-5)
  f, args, _ = calls["store"]
  _, stored = f(*args)
  np.testing.assert_allclose(np.asarray(stored[:, :v], np.float64), np.exp(z), rtol=1e-2)  # exp(z - 0), in bf16


def test_probe_waves_dx_is_the_product():
  """probe_waves: the dx it times on ours and on XLA's GEMM is dz·wᵀ (float64 NumPy reference), at a ragged row
  count."""
  import numpy as np

  from benchmarks import probe_waves

  ours, xla, (dz, w), _ = probe_waves.dx_calls(200, 64, 960, True)
  ref = np.asarray(dz, np.float64) @ np.asarray(w, np.float64).T
  for f in (ours, xla):
    got = np.asarray(f(dz, w), np.float64)
    assert got.shape == (200, 64)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2


def test_trainer_scaling_runs_a_variant_with_its_environment(tmp_path, monkeypatch):
  """run_trainer: a variant's env: items reach the trainer process's environment, not its arguments."""
  import json
  import subprocess

  from benchmarks import trainer_scaling

  seen = {}

  def fake_run(cmd, env, **_):
    seen.update(cmd=cmd, env=env)
    (tmp_path / "train_lm.json").write_text(json.dumps({"runs": {}}))
    return subprocess.CompletedProcess(cmd, 0, "", "")

  monkeypatch.setattr(trainer_scaling.subprocess, "run", fake_run)
  argv = ["--steps", "2", *trainer_scaling.parse_variants(["n:env:NCCL_MAX_NCHANNELS=4"])["n"]]
  assert trainer_scaling.run_trainer(argv, str(tmp_path)) == {"runs": {}}
  assert seen["env"]["NCCL_MAX_NCHANNELS"] == "4" and not any("NCCL" in a for a in seen["cmd"])
  assert seen["cmd"][2:4] == ["--steps", "2"]


def test_per_head_tools_take_any_size_as_a_shape():
  """bench_floors' shapes (also bench_step_products' and profile_head's): the named heads, and any ``BxHxV`` or a
  sweep point's name as a shape of that size; anything else named in a clear error."""
  from benchmarks.bench_floors import SHAPES

  assert SHAPES["llama3-8b"] == shapes.Shape("llama3-8b", 8192, 4096, 128256)
  got = SHAPES["sweep-2048x2048x65536"]
  assert (got.B, got.H, got.V) == (2048, 2048, 65536)
  assert (SHAPES["40x32x300"].B, SHAPES["40x32x300"].V) == (40, 300)
  for bad in ("llama3-9b", "2048x2048", "0x8x8", "2048x2kx8"):
    with pytest.raises(KeyError, match="BxHxV"):
      SHAPES[bad]


def test_config_changes_are_typed_by_the_config_fields():
  """``--configs`` items of the GEMM benchmarks: each value typed as its GemmConfig field, ``None`` clearing an
  optional one, and an unknown field or a missing ``=`` named in the error."""
  import dataclasses

  from benchmarks.bench_gemm import config_changes
  from lce_flax._impl.pallas_mosaic import tuning

  got = config_changes("wg_split=m,order_width=8,cluster=None")
  assert got == {"wg_split": "m", "order_width": 8, "cluster": None}
  cfg = dataclasses.replace(tuning.GemmConfig(cluster="n"), **got)
  assert (cfg.wg_split, cfg.order_width, cfg.cluster) == ("m", 8, None)
  assert config_changes("") == {}
  # a switch: 0 and 1 as False and True
  assert config_changes("auto_barriers=0") == {"auto_barriers": False}
  assert config_changes("auto_barriers=0,auto_barriers=1") == {"auto_barriers": True}
  assert tuning.GemmConfig(**config_changes("auto_barriers=0")).short().endswith("auto_barriers=0")
  with pytest.raises(ValueError, match="'tile_q=1'.*GemmConfig"):
    config_changes("tile_q=1")
  with pytest.raises(ValueError, match="'stages'"):
    config_changes("stages")


def test_gemm_sweep_times_the_tables_row_first():
  """bench_gemm --sweep: the table's config for the device and shape first (the H200's own row where it has one,
  else the H100's), then the grid's others, none twice; a device with no rows starts from the default."""
  from benchmarks.bench_gemm import sweep_candidates, sweep_configs
  from lce_flax._impl.pallas_mosaic import tuning

  mnk = (8192, 4096, 128256)
  got = sweep_candidates("dx", mnk, "NVIDIA H200")
  assert got[0] == tuning.select_config("dx", *mnk, "NVIDIA H200")
  assert len(set(got)) == len(got) and set(got) >= set(sweep_configs("dx"))
  h100 = tuning.select_config("fwd", 8192, 128256, 4096, "NVIDIA H100 80GB HBM3")
  assert "nvidia h200/fwd" not in tuning.select_row("fwd", 8192, 128256, 4096, "NVIDIA H200")[1]
  assert sweep_candidates("fwd", (8192, 128256, 4096), "NVIDIA H200")[0] == h100
  assert sweep_candidates("dx", mnk, "no such device")[0] == tuning.select_config("dx", *mnk, "no such device")


def test_gemm_fused_variants_need_their_bare_product(monkeypatch):
  """bench_gemm's products with their loss work run only where this run timed their bare product; one left out by
  PRODUCTS (here all three) gives a ``fused_skip`` row and no table row, never a row of the default config that
  would then be this device's own."""
  import jax.numpy as jnp

  from benchmarks import bench_gemm

  monkeypatch.setattr(bench_gemm, "ROWS", [])
  x, w, dz = jnp.ones((256, 128), jnp.bfloat16), jnp.ones((128, 512), jnp.bfloat16), jnp.ones((256, 512), jnp.bfloat16)
  table_rows = {}
  bench_gemm.fused("tiny", x, w, dz, 2 * 256 * 128 * 512, {}, {}, table_rows, "NVIDIA H200")
  assert table_rows == {}
  assert [(r["kind"], r["variant"]) for r in bench_gemm.ROWS] == [
      ("fused_skip", v) for v in ("fwd_stats", "fwd_store", "dx_prologue", "dw_acc")]


def test_gemm_fused_candidates_start_from_the_tables_row():
  """bench_gemm's loss-work variants are timed with the table's row for their own role first (the H200 runs the
  H100's forward rows, tuned with the loss work), then the bare product's best configs of the run made to fit the
  hooks, none twice; nothing where the bare product was not timed."""
  from benchmarks.bench_gemm import fused_candidates
  from lce_flax._impl.pallas_mosaic import tuning

  mnk = (8192, 128256, 4096)
  table = tuning.select_config("fwd_store", *mnk, "NVIDIA H200")
  assert table == tuning.select_config("fwd_store", *mnk, "NVIDIA H100 80GB HBM3")
  a, b = tuning.GemmConfig(order_width=8), tuning.GemmConfig(order_width=16)
  got = fused_candidates("fwd_store", "fwd", mnk, {"fwd": [a, b]}, "NVIDIA H200")
  assert got == [table, tuning.fit_role("fwd_store", a), tuning.fit_role("fwd_store", b)]
  assert got[1].epi_n == 32
  assert tuning.fit_role("fwd_store", table) == table  # (the row fits its hooks already: timed once)
  assert fused_candidates("fwd_store", "fwd", mnk, {"fwd": [table, table]}, "NVIDIA H200") == [table]
  assert fused_candidates("dw_acc", "dw", (4096, 128256, 8192), {"fwd": [a]}, "NVIDIA H200") == []


def test_gemm_sweep_finalists():
  """bench_gemm --sweep times again, in alternation, the three fastest configs of its one-after-another pass and
  the table's own row if it is not among them (never one that failed to build)."""
  from benchmarks.bench_gemm import finalists
  from lce_flax._impl.pallas_mosaic import tuning

  a, b, c, d, e = (tuning.GemmConfig(order_width=w) for w in (1, 2, 4, 8, 16))
  results = [(3.0, a), (1.0, b), (2.0, c), (4.0, d), (5.0, e)]
  assert finalists(results, e) == [b, c, a, e]
  assert finalists(results, b) == [b, c, a]
  assert finalists(results, tuning.GemmConfig(order_width=32)) == [b, c, a]
  assert finalists(results[:2], a, n=1) == [b, a]


def test_trainer_scaling_per_chip_runs_each_gpu_alone_then_together(tmp_path, monkeypatch):
  """benchmarks/trainer_scaling.py --per-chip: each chip's one-device step alone (CUDA_VISIBLE_DEVICES = that chip)
  and then all at once in processes started together; the ceiling is the first chip's step alone over the slowest
  chip's step together, and a failed process leaves it None."""
  from benchmarks import trainer_scaling

  # a stand-in trainer: its step time is read from its environment, so that which process got which GPU shows
  fake = tmp_path / "fake_trainer.py"
  fake.write_text(
      "import json, os, sys, time\n"
      "out = sys.argv[sys.argv.index('--out') + 1]\n"
      "os.makedirs(out, exist_ok=True)\n"
      "chip = int(os.environ['CUDA_VISIBLE_DEVICES'])\n"
      "t = float(os.environ['STEP_S_' + str(chip)]) * (1.5 if 'together' in out else 1.0)\n"
      "time.sleep(0.2)\n"
      "json.dump({'runs': {'fused': {'step_time_s': t}}}, open(os.path.join(out, 'train_lm.json'), 'w'))\n")
  monkeypatch.setattr(trainer_scaling, "SCRIPT", str(fake))
  monkeypatch.setenv("STEP_S_0", "0.050")
  monkeypatch.setenv("STEP_S_1", "0.052")
  monkeypatch.setenv("STEP_S_2", "0.049")
  got = trainer_scaling.per_chip(["--steps", "3"], "fused", 3, 8, str(tmp_path), timeout_s=60)
  assert got["alone_step_s"] == [0.050, 0.052, 0.049]
  assert got["together_step_s"] == pytest.approx([0.075, 0.078, 0.0735])
  assert got["ceiling"] == pytest.approx(0.050 / 0.078, abs=1e-4)
  assert got["chip_spread"] == pytest.approx(0.052 / 0.049, abs=1e-4)

  monkeypatch.delenv("STEP_S_2")  # chip 2's processes fail: no ceiling, and the error does not stop the others
  got = trainer_scaling.per_chip(["--steps", "3"], "fused", 3, 8, str(tmp_path), timeout_s=60)
  assert got["alone_step_s"][:2] == [0.050, 0.052] and got["alone_step_s"][2] is None
  assert got["ceiling"] is None and got["chip_spread"] is None
  res = trainer_scaling.run_together([(["--steps", "3"], str(tmp_path / "x"), {"CUDA_VISIBLE_DEVICES": "2"})], 60)
  assert "KeyError" in res[0]["error"][0]


def test_trainer_scaling_main_writes_the_per_chip_rows(tmp_path, monkeypatch):
  """benchmarks/trainer_scaling.py --per-chip through its command line: the rows, then each head's per-chip entry
  in trainer_scaling.json (its processes given their GPU through CUDA_VISIBLE_DEVICES, here stand-ins)."""
  import json

  from benchmarks import trainer_scaling

  seen = []

  def fake_run(argv, out, timeout_s=None):
    seen.append([a for a in argv if a.startswith(trainer_scaling.ENV_ARG)])
    return {"runs": {"fused": {"step_time_s": 0.05, "tokens_per_s": 1000.0, "memory": {}}}}

  def fake_together(jobs, timeout_s=None):
    seen.append([env for _, _, env in jobs])
    return [{"runs": {"fused": {"step_time_s": 0.05 + 0.001 * i}}} for i in range(len(jobs))]

  monkeypatch.setattr(trainer_scaling, "run_trainer", fake_run)
  monkeypatch.setattr(trainer_scaling, "run_together", fake_together)
  n = trainer_scaling.jax.device_count()
  assert trainer_scaling.main(["--ks", "1", "--heads", "fused", "--meshes", "data", "--per-chip",
                               "--out", str(tmp_path)]) in (0, None)
  got = json.loads((tmp_path / "trainer_scaling.json").read_text())
  assert [(r["k"], r["head"], r["step_time_s"]) for r in got["rows"]] == [(1, "fused", 0.05)]
  (chip,) = got["per_chip"]
  assert chip["alone_step_s"] == [0.05] * n and chip["together_step_s"] == pytest.approx(
      [0.05 + 0.001 * i for i in range(n)])
  assert chip["ceiling"] == pytest.approx(0.05 / (0.05 + 0.001 * (n - 1)), abs=1e-4)
  # the row's process, then each chip alone with its own GPU, then all at once
  assert seen[0] == [] and seen[1:1 + n] == [[f"{trainer_scaling.ENV_ARG}CUDA_VISIBLE_DEVICES={i}"]
                                             for i in range(n)]
  assert seen[1 + n] == [{"CUDA_VISIBLE_DEVICES": str(i)} for i in range(n)]


def test_run_together_bounds_all_processes_from_their_start(tmp_path, monkeypatch):
  """trainer_scaling.run_together: processes that outlast ``timeout_s`` are stopped and reported, the others read;
  the bound counts from the start, not per process."""
  import time

  from benchmarks import trainer_scaling

  fake = tmp_path / "slow_trainer.py"
  fake.write_text(
      "import json, os, sys, time\n"
      "out = sys.argv[sys.argv.index('--out') + 1]\n"
      "os.makedirs(out, exist_ok=True)\n"
      "time.sleep(float(os.environ['SLEEP_S']))\n"
      "json.dump({'runs': {}}, open(os.path.join(out, 'train_lm.json'), 'w'))\n")
  monkeypatch.setattr(trainer_scaling, "SCRIPT", str(fake))
  t0 = time.monotonic()
  res = trainer_scaling.run_together([([], str(tmp_path / f"p{i}"), {"SLEEP_S": s})
                                      for i, s in enumerate(("0", "30", "30", "30", "30"))], timeout_s=2)
  assert time.monotonic() - t0 < 6  # (one bound for all five: 2 s a process after the first would take 8)
  assert res[0] == {"runs": {}}
  assert [r["error"] for r in res[1:]] == [["ran past 2 s"]] * 4


NCU_HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
              '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def _ncu_row(kid, section, name, unit, value):
  return (f'"{kid}","1213","python3.12","127.0.0.1","anonymous_mosaic_gpu_kernel","1","7","(384, 1, 1)","(132, 1, 1)",'
          f'"0","9.0","{section}","{name}","{unit}","{value}"')


def test_ncu_forward_reads_each_kernel_of_the_details_page():
  """benchmarks/ncu_forward.py: ncu's details CSV (between the program's own lines and ncu's messages) is read per
  kernel ID, each value with its unit; numbers in base units parse with their thousands separators."""
  from benchmarks import ncu_forward

  text = "\n".join([
      "==PROF== Connected to process 1213", "ran store[] (8192, 768, 50304) x3", NCU_HEADER,
      _ncu_row(0, "Command line profiler metrics", "dram__bytes_read.sum", "byte", "15,325,344,768"),
      _ncu_row(0, "GPU Speed Of Light Throughput", "Duration", "ns", "11,674,816"),
      _ncu_row(1, "Command line profiler metrics", "dram__bytes_read.sum", "byte", "20,973,599,232"),
      _ncu_row(1, "Memory Workload Analysis", "L2 Hit Rate", "%", "58.25"),
      "==PROF== Disconnected from process 1213"])
  got = ncu_forward.parse_details(text)
  assert got == {0: {"Command line profiler metrics/dram__bytes_read.sum": "15,325,344,768 byte",
                     "GPU Speed Of Light Throughput/Duration": "11,674,816 ns"},
                 1: {"Command line profiler metrics/dram__bytes_read.sum": "20,973,599,232 byte",
                     "Memory Workload Analysis/L2 Hit Rate": "58.25 %"}}
  assert ncu_forward.number("15,325,344,768 byte") == 15325344768.0
  assert ncu_forward.number("58.25 %") == 58.25 and ncu_forward.number("n/a") is None
  assert ncu_forward.parse_details("no csv here") == {}


def test_ncu_forward_sweep_maps_launches_to_rows(tmp_path, monkeypatch):
  """--sweep: one ncu process per row (the variants that share its changes) profiles every launch of them
  (repeats × variants, none skipped) and the k-th kernel is variant k // repeats; each row keeps its values and
  their median; a row past the deadline is recorded as skipped, not run; XLA's variant is refused (its compile
  launches kernels of its own)."""
  import subprocess
  import time

  from benchmarks import ncu_forward

  runs = [("store", ""), ("bare", ""), ("store", "order_minor=m"), ("bare", "order_minor=m")]
  reads = [21.0e9, 15.0e9, 19.0e9, 16.0e9, 14.0e9, 15.5e9]  # three launches of each of a process's two variants
  seen = []

  def fake(cmd, tag, log, timeout=None):
    seen.append((cmd, timeout))
    lines = [NCU_HEADER] + [_ncu_row(k, "Command line profiler metrics", "dram__bytes_read.sum", "byte",
                                     f"{int(r * len(seen)):,}") for k, r in enumerate(reads)]
    return subprocess.CompletedProcess(cmd, 0, "\n".join(lines), "")

  monkeypatch.setattr(ncu_forward, "run_logged", fake)
  rows = ncu_forward.sweep(runs, "llama3-8b", 3, None)
  assert len(seen) == 2 and seen[0][1] is None
  for (cmd, _), child in zip(seen, ["store:;bare:", "store:order_minor=m;bare:order_minor=m"]):
    assert cmd[cmd.index("--launch-skip") + 1] == "0" and cmd[cmd.index("--launch-count") + 1] == "6"
    assert cmd[cmd.index("--child") + 1] == child and cmd[cmd.index("--calls") + 1] == "3"
    assert "--section" not in cmd and "lts__t_sector_hit_rate.pct" in cmd[cmd.index("--metrics") + 1]
  assert [(r["variant"], r["changes"], r["launches"]) for r in rows] == [
      ("store", None, 3), ("bare", None, 3), ("store", "order_minor=m", 3), ("bare", "order_minor=m", 3)]
  assert rows[0]["values"]["dram__bytes_read.sum"] == reads[:3]
  assert rows[0]["median"]["dram__bytes_read.sum"] == 19.0e9 and rows[1]["median"]["dram__bytes_read.sum"] == 15.5e9
  assert rows[2]["median"]["dram__bytes_read.sum"] == 38.0e9  # (the second process's reads)
  assert rows[0]["mnk"] == [8192, 128256, 4096]
  seen.clear()
  rows = ncu_forward.sweep(runs, "llama3-8b", 3, None, deadline=time.time() + 10)  # too little time for a row
  assert not seen and all(r["skipped"] == "past BUDGET_S" for r in rows) and len(rows) == 4
  assert ncu_forward.pick(rows, 2) == []
  rows = ncu_forward.sweep(runs[:2], "llama3-8b", 3, None, deadline=time.time() + 100)
  assert 60 < seen[0][1] <= 100
  with pytest.raises(ValueError, match="xla"):
    ncu_forward.sweep([("xla", "")], "llama3-8b", 3, None)
  assert ncu_forward.parse_runs("store:;bare:stages=3,epi_slots=4") == [("store", ""),
                                                                       ("bare", "stages=3,epi_slots=4")]
  with pytest.raises(ValueError, match="variant"):
    ncu_forward.parse_runs("exp:")


def test_ncu_forward_summarizes_a_sass_page(tmp_path):
  """--summarize: a SASS page's stall reasons as shares of all samples, samples and executed instructions per
  opcode (predicates and modifiers dropped), and the hottest instructions, counted by hand here."""
  from benchmarks import ncu_forward

  head = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
          '"Instructions Executed","stall_barrier","stall_long_sb","stall_selected","stall_barrier (Not Issued)"')
  rows = ['"0x10","@!P1  BRA 0x20","60","60","300","0","60","0","0"',
          '"0x20","HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8].tnspB, R24","30","20","1200","20","0","10","20"',
          '"0x30","FADD R1, R2, R3","10","0","2800","0","0","10","0"']
  path = tmp_path / "k.sass.csv.gz"
  with gzip.open(path, "wt") as f:
    f.write("\n".join(['"Kernel Name","anonymous_mosaic_gpu_kernel",', head, *rows]) + "\n")
  s = ncu_forward.summarize_sass(str(path), top=2)
  assert s["instructions"] == 3 and s["samples"] == 100
  assert s["stall_share"] == {"long_sb": 0.6, "barrier": 0.2, "selected": 0.2}
  assert s["samples_by_opcode"] == {"BRA": 0.6, "HGMMA": 0.3, "FADD": 0.1}
  assert s["executed_by_opcode"] == {"FADD": 2800, "HGMMA": 1200, "BRA": 300}
  assert [t["sass"] for t in s["top"]] == ["@!P1  BRA 0x20", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8].tnspB, R24"]
  assert s["top"][1]["stalls"] == {"barrier": 20, "selected": 10}


def test_ncu_forward_child_builds_every_run(capsys):
  """--child (what ncu runs) compiles each run's variant, a changed table row included, and launches it; in
  interpret mode on the CPU. A bad change names the field."""
  from benchmarks import ncu_forward

  ncu_forward.child([("store", ""), ("bare", "stages=3,epi_slots=4"), ("xla", "")], (256, 128, 512), True, 1)
  out = capsys.readouterr().out.splitlines()
  assert out == ["ran store[] (256, 128, 512) x1", "ran bare[stages=3,epi_slots=4] (256, 128, 512) x1",
                 "ran xla[] (256, 128, 512) x1"]
  with pytest.raises(ValueError, match="stagez"):
    ncu_forward.child([("store", "stagez=3")], (256, 128, 512), True, 1)


def test_ncu_forward_picks_the_orders_reading_least():
  """--sweep --pick: the changes whose variants read the fewest DRAM bytes summed over the variants (medians),
  fewest first; the table's rows themselves are not candidates, and a change missing a reading is left out."""
  from benchmarks import ncu_forward

  def row(variant, changes, gb):
    return {"variant": variant, "changes": changes, "median": {} if gb is None else {"dram__bytes_read.sum": gb}}

  rows = [row("bare", None, 19.0), row("store", None, 21.0),
          row("bare", "order_minor=m", 15.0), row("store", "order_minor=m", 16.0),  # 31
          row("bare", "order_width=4", 14.0), row("store", "order_width=4", 20.0),  # 34
          row("bare", "order_width=16", 12.0), row("store", "order_width=16", 13.0),  # 25
          row("bare", "cluster=m", 10.0), row("store", "cluster=m", None)]  # a reading missing
  assert ncu_forward.pick(rows, 2) == ["order_width=16", "order_minor=m"]
  assert ncu_forward.pick(rows, 5) == ["order_width=16", "order_minor=m", "order_width=4"]


def test_ncu_forward_without_ncu_says_so(tmp_path, monkeypatch):
  """On a machine without Nsight Compute the script stops at once with a message naming ``ncu``, not a traceback
  from its first profile."""
  from benchmarks import ncu_forward

  monkeypatch.setattr(ncu_forward.shutil, "which", lambda name: None)
  with pytest.raises(SystemExit, match="`ncu` is not on PATH"):
    ncu_forward.main(["--shapes", "llama3-8b", "--out", str(tmp_path)])
  assert not (tmp_path / "ncu_forward.json").exists()


def test_ncu_forward_run_logged_streams_and_cuts_off(tmp_path):
  """run_logged copies a process's output into the log as it comes and, past its timeout, kills the process (and
  its children) and returns what it printed."""
  import io
  import sys
  import time

  from benchmarks import ncu_forward

  log = io.StringIO()
  p = ncu_forward.run_logged([sys.executable, "-c", "print('one', flush=True); print('two')"], "ok", log)
  assert p.returncode == 0 and p.stdout == "one\ntwo\n" and "one\ntwo\n" in log.getvalue()
  t0 = time.time()
  code = "import subprocess, sys, time; print('started', flush=True); subprocess.run(['sleep', '30']); print('never')"
  p = ncu_forward.run_logged([sys.executable, "-c", code], "cut", log, timeout=2)
  assert time.time() - t0 < 20 and p.returncode == -9 and p.stdout == "started\n"
  assert "===== cut: rc -9" in log.getvalue()


def test_lowering_digest_names_what_changed(tmp_path):
  """benchmarks/lowering_digest.py lowers each case for CUDA on CPU: two processes of the same code give the same
  digests (no source locations in them), and ``--against`` a file whose digest of one case differs exits 1 naming
  that case. (Each run is a process of its own: Mosaic GPU numbers the kernels it lowers within a process.)"""
  import json
  import subprocess
  import sys

  out = tmp_path / "digests.json"
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  run = lambda *args: subprocess.run([sys.executable, "-m", "benchmarks.lowering_digest", *args], cwd=root, env=env,
                                     capture_output=True, text=True, timeout=600)
  assert run("--out", str(out)).returncode == 0
  got = json.loads(out.read_text())["digests"]
  assert {"fast_logits", "fast_tokens", "lean_xla", "lean_gemm", "gemm_store", "gemm_dw_window"} <= set(got)
  got["lean_gemm"] = "0" * 16
  out.write_text(json.dumps({"digests": got}))
  res = run("--against", str(out))
  assert res.returncode == 1 and "changed: lean_gemm\n" in res.stdout, res.stdout + res.stderr
