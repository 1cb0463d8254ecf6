"""The benchmark harness end to end on CPU (``--preset smoke``): JSON lines, tables, plots, error rows, budget.

Asserts nothing about time; it checks that every row is there with its fields, that the losses agree with the
harness's float32 reference (so inputs and reference are wired right), and that failures become rows.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import pytest

from benchmarks import bench, plots, shapes

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _rows(path):
  with open(path) as fh:
    return [json.loads(line) for line in fh]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("smoke"))
  assert bench.main(["--preset", "smoke", "--impls", "xla,chunked", "--out", out]) == 0
  return out, _rows(os.path.join(out, "bench_smoke.jsonl"))


def test_smoke_rows_complete(smoke):
  _, rows = smoke
  preset = shapes.PRESETS["smoke"]
  expected = {(s.name, lab, p) for s, _, passes in shapes.preset_shapes(preset)
              for lab in ("xla", "chunked:fast", "chunked:lean") for p in passes}
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
    want = 2 if r["pass"] == "fwd" else 8 if r["mode"] == "lean" else 6
    assert r["flops_factor"] == want, r
    assert r["algo_tflops"] == pytest.approx(r["tflops"] * want / (2 if r["pass"] == "fwd" else 6))


def test_smoke_losses_match_reference(smoke):
  _, rows = smoke
  for r in rows:
    if r["sweep"] is None:  # the smoke preset computes a reference for its named shapes
      assert r["loss_rel_err"] < 1e-3, r
      # uniform-ish logits (w = 0.02·N(0,1)): about log V per token
      assert r["ref_loss"] == pytest.approx(r["B"] * float(jnp.log(r["V"])), rel=0.05)


def test_smoke_gradient_norms_agree(smoke):
  _, rows = smoke
  for shape in {r["shape"] for r in rows}:
    rs = [r for r in rows if r["shape"] == shape and r["pass"] == "fwdbwd"]
    assert len(rs) == 3
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
  assert "| fwd+bwd: ms (× floor) / extra GB | what, FLOPs | tiny-a 64×32×500 | tiny-b 100×24×1000 |" in md
  assert "| `chunked:lean` | lce_flax, 8·BHV | " in md and "| `chunked:fast` | lce_flax, 6·BHV | " in md
  assert "![llm](llm.png)" in md and "![sweep](sweep.png)" in md
  for axis in "VBH":
    assert f"fwd+bwd vs {axis}" in md
  assert "anchors file" in md  # no torch rows here: the anchors' peers are shown, labelled as such
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


def test_budget_skips_but_reports(tmp_path):
  assert bench.main(["--preset", "smoke", "--impls", "xla", "--out", str(tmp_path), "--budget-s", "0"]) == 0
  rows = _rows(tmp_path / "bench_smoke.jsonl")
  assert rows and all(r["error"].startswith("skipped: past --budget-s") for r in rows)
  assert "skipped" in (tmp_path / "results.md").read_text()


def test_unknown_impl_is_an_error():
  with pytest.raises(ValueError, match="--impls"):
    bench.make_variants(["nope"], ("fast",))


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
