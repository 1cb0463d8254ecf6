"""The example trainer (``examples/train_lm.py``, the package ``examples/lm/``) on a tiny configuration: resume,
killed saves, both heads, meshes, per-device memory on a data-parallel mesh, out-of-memory reports, outputs."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_lm.py")

from examples.lm import data as lm_data  # noqa: E402
from examples.lm import main as lm_main  # noqa: E402
from examples.lm import maxbatch as lm_maxbatch  # noqa: E402
from examples.lm import model as lm_model  # noqa: E402
from examples.lm import train as lm_train  # noqa: E402

# Tiny: 1 layer, d_model 32, vocab 300, batch 8 (one example per simulated device), 32 tokens.
TINY = ["--vocab-size", "300", "--d-model", "32", "--num-layers", "1", "--num-heads", "2", "--d-ff", "64",
        "--seq-len", "32", "--batch-size", "8", "--eval-batches", "1", "--eval-every", "0", "--sample-tokens", "4",
        "--lr", "1e-2", "--warmup", "2", "--quiet"]


def test_run_steps_dispatches_before_reading_the_loss():
  """``run_steps``: each step is dispatched before the previous step's loss is read, except after a step whose
  state is read (evaluated, saved), which is finished (and its state handed over) before the next dispatch; every
  step's loss and time are reported once, in order."""
  events = []

  class Loss:
    def __init__(self, i):
      self.i = i

    def __float__(self):
      events.append(("read", self.i))
      return float(self.i)

  def compiled(state, batch):
    events.append(("dispatch", batch))
    return state + 1, {"loss": Loss(batch)}

  losses, states = [], []
  state, times = lm_train.run_steps(
      compiled, 0, range(5), lambda step: step, on_loss=lambda done, loss, dt: losses.append((done, loss)),
      reads_state=lambda done: done == 2, on_state=lambda done, st, loss: states.append((done, st, loss)))
  assert events == [("dispatch", 0), ("dispatch", 1), ("read", 0), ("read", 1), ("dispatch", 2), ("dispatch", 3),
                    ("read", 2), ("dispatch", 4), ("read", 3), ("read", 4)]
  assert losses == [(1, 0.0), (2, 1.0), (3, 2.0), (4, 3.0), (5, 4.0)] and states == [(2, 2, 1.0)]
  assert state == 5 and len(times) == 5 and all(t >= 0 for t in times)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
  """One corpus + tokenizer build and one JAX compilation cache for the module (LCE_FLAX_TEST_CACHE: a persistent
  one across runs); the JAX cache settings are put back afterwards."""
  import jax

  path = os.environ.get("LCE_FLAX_TEST_CACHE") or str(tmp_path_factory.mktemp("cache"))
  keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
  saved = {k: getattr(jax.config, k) for k in keys}
  yield path
  for k, v in saved.items():
    jax.config.update(k, v)


def run(cache_dir, tmp_path, name, *extra, other_head=False):
  """The trainer's ``main`` on TINY; ``other_head``: also the other head's step at the same batch."""
  out = tmp_path / name
  argv = [*TINY, "--cache-dir", cache_dir, "--jax-cache-dir", os.path.join(cache_dir, "jax"), "--out", str(out)]
  return lm_main.main([*argv, *extra, *(() if other_head else ("--only-this-head",))]), out


@pytest.fixture(scope="module")
def straight(cache_dir, tmp_path_factory):
  """Six uninterrupted steps of the fused head, checkpointed every 3."""
  tmp = tmp_path_factory.mktemp("straight")
  result, out = run(cache_dir, tmp, "out", "--steps", "6", "--ckpt-dir", str(tmp / "ckpt"), "--save-every", "3",
                    other_head=True)
  return result, out


def test_corpus_split_and_batches_are_deterministic(cache_dir):
  data = lm_data.load_data(cache_dir, 300, log=lambda s: None)
  assert data.tokenizer_vocab <= 300 and data.train_ids.max() < 300 and len(data.eval_ids) > 10_000
  a = lm_data.train_batch(data.train_ids, 5, 4, 16, seed=1)
  b = lm_data.train_batch(data.train_ids, 5, 4, 16, seed=1)
  c = lm_data.train_batch(data.train_ids, 6, 4, 16, seed=1)
  np.testing.assert_array_equal(a["inputs"], b["inputs"])
  assert not np.array_equal(a["inputs"], c["inputs"])
  np.testing.assert_array_equal(a["inputs"][:, 1:], a["labels"][:, :-1])  # labels are the next tokens
  text = data.tokenizer.decode(data.train_ids[:200].tolist())
  assert sum(ch.isalpha() for ch in text) > 50  # English prose, not ids


def test_outputs_written(straight):
  result, out = straight
  with open(out / "train_lm.json") as f:
    on_disk = json.load(f)
  run_ = on_disk["runs"]["fused"]
  assert len(run_["losses"]) == 6 and all(np.isfinite(run_["losses"]))
  assert run_["final_eval"]["step"] == 6 and run_["final_eval"]["ppl"] > 1
  assert run_["tokens_per_s"] > 0 and run_["memory"]["compiled"]["peak"] > 0
  # the plain head's step at the same batch: compiled and timed beside the run, the heads named fused and plain
  plain = on_disk["same_batch"]["plain"]
  assert set(on_disk["runs"]) == {"fused"} and set(on_disk["same_batch"]) == {"plain"}
  assert plain["fits"] and plain["tokens_per_s"] > 0 and plain["batch_size"] == 8
  # the head's own memory, the step's temporaries, recorded per head (test_data_parallel_step_... checks its size)
  assert plain["memory"]["temp"] > run_["memory"]["compiled"]["temp"] > 0
  assert "xla" not in json.dumps(on_disk["runs"]) + json.dumps(on_disk["same_batch"])
  assert isinstance(run_["sample"], str) and run_["sample"].startswith("Return the")
  with open(out / "train_lm.png", "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert result["runs"]["fused"]["losses"] == run_["losses"]


def test_fused_and_plain_heads_agree(cache_dir, tmp_path, straight):
  fused = straight[0]["runs"]["fused"]["losses"][:3]
  plain, _ = run(cache_dir, tmp_path, "plain", "--steps", "6", "--stop-after", "3", "--loss", "plain")
  plain = plain["runs"]["plain"]["losses"]
  # Same seed → same parameters and batch: step 0's loss is the same number up to float32 rounding.
  np.testing.assert_allclose(plain[0], fused[0], rtol=1e-5)
  # Later steps go through different (equally exact) gradient arithmetic; they stay close, not bit-equal.
  np.testing.assert_allclose(plain, fused, rtol=2e-3)
  assert plain[0] > 5.0  # ~log(300) at initialisation: a real loss, not a stub


def test_resume_continues_the_same_loss_curve(cache_dir, tmp_path, straight):
  want = straight[0]["runs"]["fused"]["losses"]
  ckpt = str(tmp_path / "ckpt")
  first, _ = run(cache_dir, tmp_path, "a", "--steps", "6", "--stop-after", "3", "--ckpt-dir", ckpt, "--save-every", "3")
  assert first["runs"]["fused"]["losses"] == want[:3]
  second, _ = run(cache_dir, tmp_path, "b", "--steps", "6", "--ckpt-dir", ckpt, "--save-every", "3", "--resume")
  r = second["runs"]["fused"]
  assert r["start_step"] == 3
  assert r["losses"] == want  # bit-identical: the first three restored from the checkpoint, the rest recomputed
  assert r["final_eval"] == straight[0]["runs"]["fused"]["final_eval"]


_KILL_DURING_SAVE = """
import os, sys, importlib.util
from orbax.checkpoint._src.path import atomicity
_finalize = atomicity.AtomicRenameTemporaryPath.finalize
async def finalize(self):
  # The checkpoint of step 4 is written but not yet committed (renamed) when the process dies.
  if os.path.basename(str(self.get_final())) == "4":
    os._exit(137)
  return await _finalize(self)
atomicity.AtomicRenameTemporaryPath.finalize = finalize
spec = importlib.util.spec_from_file_location("train_lm", sys.argv[1])
m = importlib.util.module_from_spec(spec); sys.modules["train_lm"] = m; spec.loader.exec_module(m)
m.main(sys.argv[2:])
"""


def test_killed_during_save_resumes_from_last_finished_checkpoint(cache_dir, tmp_path, straight):
  ckpt = tmp_path / "ckpt"
  args = [*TINY, "--cache-dir", cache_dir, "--jax-cache-dir", os.path.join(cache_dir, "jax"), "--steps", "6",
          "--ckpt-dir", str(ckpt), "--save-every", "2"]
  env = dict(os.environ, PYTHONPATH=ROOT)
  proc = subprocess.run([sys.executable, "-c", _KILL_DURING_SAVE, SCRIPT, *args, "--out", str(tmp_path / "a")],
                        env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 137, proc.stderr[-3000:]
  entries = sorted(os.listdir(ckpt))
  assert "2" in entries and "4" not in entries, entries
  assert any(e.startswith("4.") and "tmp" in e for e in entries), entries  # the unfinished save is still there
  result, _ = run(cache_dir, tmp_path, "b", *args[len(TINY) + 4:], "--resume")
  r = result["runs"]["fused"]
  assert r["start_step"] == 2
  assert r["losses"] == straight[0]["runs"]["fused"]["losses"]
  assert not any("tmp" in e for e in os.listdir(ckpt))  # the leftover was cleaned up
  assert {"2", "4", "6"} <= set(os.listdir(ckpt))


@pytest.mark.parametrize("threshold,start,unit", [(37, 8, 1), (100, 8, 8), (5, 8, 1), (3, 8, 4), (10_000, 8, 8)])
def test_search_max_batch(threshold, start, unit):
  seen = []

  def fits(b):
    seen.append(b)
    return b <= threshold

  lo, hi = lm_maxbatch.search_max_batch(fits, start, unit, limit=512, tol=1 / 16)
  want = min(threshold, 512) // unit * unit
  assert lo <= want and lo % unit == 0 and all(b % unit == 0 for b in seen)
  if want == 0:
    assert lo == 0
  elif threshold > 512:
    assert hi is None and lo == 512 // unit * unit
  else:
    assert hi > threshold and hi - lo <= max(unit, lo // 16)  # within the tolerance of the true largest batch
    assert fits(lo) and not fits(hi)


def test_find_max_batch_against_a_cpu_budget(cache_dir, tmp_path):
  budget_gib = 2 / 1024  # 2 MiB per device: the tiny model's batch 8 fits, 16 does not
  result, out = run(cache_dir, tmp_path, "mb", "--find-max-batch", "--mem-budget-gib", str(budget_gib),
                    "--bench-steps", "0", "--num-devices", "1", "--max-batch-tol", "0.5")
  budget = budget_gib * 2**30
  for loss in ("fused", "plain"):
    r = result["max_batch"][loss]
    probes = {p["batch_size"]: p for p in r["probes"]}
    best = r["max_batch"]
    assert best >= 1 and probes[best]["fits"] and probes[best]["memory"]["peak"] <= budget
    bigger = [b for b in probes if b > best]
    assert bigger and all(not probes[b]["fits"] and probes[b]["memory"]["peak"] > budget for b in bigger)
    assert min(bigger) - best <= max(1, best // 2)
  assert os.path.exists(out / "train_lm.png")


def test_heads_share_one_parameter_tree():
  import jax

  cfg = lm_model.ModelConfig(vocab_size=300, seq_len=16, d_model=32, num_layers=1, num_heads=2, d_ff=64)
  tx = lm_train.make_optimizer(1e-3, 1, 2)
  states = {
      "fused, 1 device": lm_train.make_trainer(cfg, "fused", "auto", 8, tx, 16, num_devices=1).init(3),
      "fused, data x fsdp x tensor = 2x2x2": lm_train.make_trainer(cfg, "fused", "auto", 8, tx, 16,
                                                                   mesh="data=2,fsdp=2,tensor=2").init(3),
      "plain (nn.Dense)": lm_train.make_trainer(cfg, "plain", "auto", 8, tx, 16).init(3),
  }
  ref = states.pop("plain (nn.Dense)").params
  assert ref["head"]["kernel"].shape == (32, 300)
  for name, st in states.items():
    assert jax.tree.structure(st.params) == jax.tree.structure(ref), name
    for a, b in zip(jax.tree.leaves(st.params), jax.tree.leaves(ref)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
  # the head's kernel [H, V] is placed by its logical names ("embed" -> fsdp, "vocab" -> tensor)
  assert st.params["head"]["kernel"].sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")


def _assert_same_loss_and_grads(got, pairs, tol=1e-5):
  """Each ``(key, ref)`` of ``pairs``: ``got[key]`` and ``got[ref]``, each ``(loss, grads)``, agree (the loss to
  ``tol / 10``, every gradient leaf to ``tol`` of its largest entry), and every parameter has a gradient."""
  import jax

  for key, ref in pairs:
    (loss, g), (loss_ref, g_ref) = got[key], got[ref]
    np.testing.assert_allclose(np.float32(loss), np.float32(loss_ref), rtol=tol / 10, err_msg=str(key))
    assert jax.tree.structure(g) == jax.tree.structure(g_ref)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g), jax.tree.leaves(g_ref)):
      a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
      assert np.abs(b).max() > 0, path  # every parameter gets a gradient
      np.testing.assert_allclose(a, b, rtol=tol, atol=tol * np.abs(b).max(), err_msg=f"{key} {path}")


def _grads_on_meshes(model, tokens, labels, meshes):
  """``{None: (loss, grads)}`` of ``model`` at its initial parameters on one device, and the same per named mesh of
  ``meshes`` (its tokens split over all the mesh's axes)."""
  import jax

  params = model.init(jax.random.key(2), tokens, labels)
  value_and_grad = lambda t: jax.jit(jax.value_and_grad(lambda p: model.apply(p, t, labels)))(params)  # noqa: E731
  got = {None: value_and_grad(tokens)}
  for name, mesh in meshes.items():
    with jax.set_mesh(mesh):
      got[name] = value_and_grad(jax.sharding.reshard(tokens, jax.sharding.PartitionSpec(mesh.axis_names)))
  return got


def _two_device_step_reductions(head, num_layers, **model):
  """The trainer's step (V = 4096, H = 32, ``model`` options) compiled for two devices, data parallel: per
  all-reduce in schedule order, how many [H, V] gradients it carries (the head's kernel, the embedding table), and
  the entry computation's text."""
  import dataclasses
  import re

  v, h = 4096, 32
  cfg = lm_model.ModelConfig(vocab_size=v, seq_len=16, d_model=h, num_layers=num_layers, num_heads=2, d_ff=64)
  tr = lm_train.make_trainer(dataclasses.replace(cfg, **model), head, "auto", 4, lm_train.make_optimizer(1e-3, 1, 2),
                             16, num_devices=2)
  text = lm_train.compile_step(tr, tr.abstract_state(0), 16).as_text().split("ENTRY")[1]
  reduces = [ln.split(" all-reduce(")[0] for ln in text.splitlines() if " all-reduce(" in ln]
  return [len(re.findall(rf"f32\[({v},{h}|{h},{v})\]", r)) for r in reduces], text


@pytest.mark.parametrize("remat", [True, False], ids=["remat", "stored"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_blocks_backward_held_in_order(remat, dtype):
  """``layer_grads_in_order`` (the default) changes no number: the loss and every parameter's gradient equal those of
  the same model differentiated by JAX alone (3 blocks, ragged 13-token sequences, float32 and bfloat16, remat'd or
  not), on one device and on a data=2 x fsdp=2 mesh (float32: also the mesh's against one device's); and the
  backward carries two optimization barriers per block (one before its recompute, one tying its parameter gradients
  to its input's), which the reference has not."""
  import dataclasses

  import jax
  import jax.numpy as jnp

  cfg = lm_model.ModelConfig(vocab_size=97, seq_len=13, d_model=32, num_layers=3, num_heads=2, d_ff=48,
                             dtype=dtype, remat=remat)
  rng = np.random.default_rng(5)
  tokens, labels = (jnp.asarray(rng.integers(0, 97, (4, 13)), jnp.int32) for _ in range(2))
  got = {}
  for ordered in (False, True):
    model = lm_model.TransformerLM(dataclasses.replace(cfg, layer_grads_in_order=ordered), head="plain")
    params = model.init(jax.random.key(2), tokens, labels)
    grad = jax.jit(jax.value_and_grad(lambda p, m=model, t=tokens: m.apply(p, t, labels)))
    got[ordered] = grad(params)
    text = grad.lower(params).as_text()
    got[ordered, "barriers"] = text.count("optimization_barrier")
    mesh = jax.make_mesh((2, 2), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
      sharded = jax.sharding.reshard(tokens, jax.sharding.PartitionSpec("data"))
      got[ordered, "mesh"] = jax.jit(jax.value_and_grad(lambda p, m=model, t=sharded: m.apply(p, t, labels)))(params)
  assert got[True, "barriers"] - got[False, "barriers"] == 2 * cfg.num_layers
  tol = 1e-5 if dtype == "float32" else 1e-2  # (bf16: the barriers change XLA's fusions, so where it rounds)
  pairs = [(True, False), ((True, "mesh"), (False, "mesh"))]  # ordered against JAX alone, on the same devices
  if dtype == "float32":  # (bf16 sums over 2 devices round otherwise)
    pairs.append(((True, "mesh"), False))
  _assert_same_loss_and_grads(got, pairs, tol)


@pytest.mark.parametrize("head", ["fused", "plain"])
def test_head_grads_held_within_the_top_blocks(head):
  """``head_grads_within=K`` (the model's default K = 0) changes no number: the loss and every parameter's gradient
  equal those of the same model without it (K = 0), for K = 1 and K = num_layers, on one device and on a data=2
  mesh (float32, ragged 13-token sequences, both heads). And it moves the head's gradient reduction: in the
  trainer's step compiled for two devices (data parallel), without it the head kernel's gradient is all-reduced with
  the embedding table's, after the whole backward (XLA's CPU compiler combines the gradients' all-reduces); with it,
  in an all-reduce of its own (or combined with the blocks' above), scheduled before the last. K outside
  [0, num_layers] is refused."""
  import dataclasses

  import jax
  import jax.numpy as jnp

  cfg = lm_model.ModelConfig(vocab_size=97, seq_len=13, d_model=32, num_layers=3, num_heads=2, d_ff=48)
  rng = np.random.default_rng(8)
  tokens, labels = (jnp.asarray(rng.integers(0, 97, (4, 13)), jnp.int32) for _ in range(2))
  meshes = {"mesh": jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))}
  got = {}
  for k in (0, 1, cfg.num_layers):
    model = lm_model.TransformerLM(dataclasses.replace(cfg, head_grads_within=k), head=head)
    for name, res in _grads_on_meshes(model, tokens, labels, meshes).items():
      got[k if name is None else (k, name)] = res
  _assert_same_loss_and_grads(
      got, [pair for k in (1, cfg.num_layers) for pair in ((k, 0), ((k, "mesh"), (0, "mesh")), ((k, "mesh"), 0))])

  # where the compiled step reduces the [H, V] gradients (the head's kernel and the embedding table)
  for k in (0, 1):
    big, _ = _two_device_step_reductions(head, num_layers=2, head_grads_within=k, embed_grads="reduce")
    assert sum(big) == 2, big
    if k == 0:
      assert big[-1] == 2, big  # both at the end
    else:
      assert big[-1] == 1 and big.index(1) < len(big) - 1, big  # the head's earlier, the table's at the end
  with pytest.raises(ValueError, match="head_grads_within=4"):
    model = lm_model.TransformerLM(dataclasses.replace(cfg, head_grads_within=4), head=head)
    model.init(jax.random.key(2), tokens, labels)


@pytest.mark.parametrize("head", ["fused", "plain"])
def test_embedding_grads_gathered(head):
  """``embed_grads="gather"`` (the default) changes no number: the loss and every parameter's gradient equal those of
  "reduce" on one device, on a data=2 mesh and on a data=2 x fsdp=2 mesh (float32, ragged 13-token sequences, a
  token repeated across the devices' rows). In the trainer's step compiled for two devices (data parallel) the
  embedding table's [V, H] gradient is not all-reduced (the head's is) and the rows' gradients and
  their ids are all-gathered instead. An unknown value is refused, naming it."""
  import dataclasses

  import jax
  import jax.numpy as jnp

  cfg = lm_model.ModelConfig(vocab_size=97, seq_len=13, d_model=32, num_layers=2, num_heads=2, d_ff=48)
  rng = np.random.default_rng(9)
  tokens, labels = (jnp.asarray(rng.integers(0, 97, (4, 13)), jnp.int32) for _ in range(2))
  tokens = tokens.at[:, 0].set(5)  # one id in every row: its gradient sums rows of all devices
  got = {}
  meshes = {"data": jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,)),
            "data_fsdp": jax.make_mesh((2, 2), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)}
  for eg in ("reduce", "gather"):
    model = lm_model.TransformerLM(dataclasses.replace(cfg, embed_grads=eg), head=head)
    for name, res in _grads_on_meshes(model, tokens, labels, meshes).items():
      got[eg if name is None else (eg, name)] = res
  _assert_same_loss_and_grads(got, [("gather", "reduce"), (("gather", "data"), "reduce"),
                                    *((("gather", n), ("reduce", n)) for n in meshes)])

  for eg, want in (("reduce", 2), ("gather", 1)):
    big, text = _two_device_step_reductions(head, num_layers=1, embed_grads=eg)
    assert sum(big) == want, (eg, big)
    assert (" all-gather(" in text) == (eg == "gather"), eg
  with pytest.raises(ValueError, match="embed_grads='scatter'"):
    lm_model.TransformerLM(dataclasses.replace(cfg, embed_grads="scatter"), head=head).init(
        jax.random.key(2), tokens, labels)


@pytest.mark.parametrize("embed_grads", ["reduce", "gather"])
def test_embedding_grads_accumulate_in_float32(embed_grads):
  """The lookup's table gradient is the float64 sum of its rows' gradients rounded once to bf16 (on a data=2 mesh:
  each device's partial sum rounded, then summed), with one id taking most of the 8x96 rows (as text's frequent
  ids do). A scatter-add in bf16 (JAX's own transpose of the lookup) stops growing once the sum's spacing passes
  a row's size, and misses by far more: the check below fails it."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  vocab, h = 50, 16
  rng = np.random.default_rng(21)
  tokens = np.where(rng.random((8, 96)) < 0.8, 7, rng.integers(0, vocab, (8, 96))).astype(np.int32)
  rows_t = jnp.asarray(rng.uniform(0.2, 0.5, (8, 96, h)), jnp.bfloat16)
  table = jnp.asarray(rng.standard_normal((vocab, h)), jnp.bfloat16)
  ref = np.zeros((vocab, h))
  np.add.at(ref, tokens, np.asarray(rows_t, np.float64))

  @functools.partial(jax.jit, static_argnums=0)
  def table_grad(lookup, table, tokens, rows_t):
    return jax.vjp(lambda t: lookup(t, tokens), table)[1](rows_t)[0]

  def check(got, rounds):
    assert got.dtype == jnp.bfloat16 and got.shape == (vocab, h)
    err = np.abs(np.asarray(got, np.float64) - ref)
    assert np.all(err <= rounds * 2.0 ** -8 * np.abs(ref)), float(np.max(err / np.maximum(np.abs(ref), 1e-30)))

  ours = functools.partial(lm_model.lookup, vocab, embed_grads)
  check(table_grad(ours, table, jnp.asarray(tokens), rows_t), 1)
  with pytest.raises(AssertionError):
    check(table_grad(lambda t, i: jnp.take(t, i, axis=0), table, jnp.asarray(tokens), rows_t), 1)
  mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  with jax.set_mesh(mesh):
    got = table_grad(ours, table, jax.device_put(tokens, P("data")), jax.device_put(rows_t, P("data")))
  check(got, 3 if embed_grads == "reduce" else 1)


def _tiny_trainer(loss, mesh, steps=2, **model):
  """The tiny model's trainer (8 sequences of 16 tokens); ``model``: more fields of its ``ModelConfig``."""
  cfg = lm_model.ModelConfig(vocab_size=300, seq_len=16, d_model=32, num_layers=1, num_heads=2, d_ff=64, **model)
  tx = lm_train.make_optimizer(1e-2, 1, steps)
  return lm_train.make_trainer(cfg, loss, "auto", 8, tx, 16, mesh=mesh, num_devices=None if mesh else 1)


def _tiny_step_losses(loss, mesh, steps=2, **model):
  """Losses of ``steps`` train steps of :func:`_tiny_trainer` on fixed random tokens (no corpus needed), then of a
  held-out batch; and the trainer."""
  return _tiny_run(loss, mesh, steps, **model)[:2]


def _tiny_run(loss, mesh, steps=2, **model):
  """:func:`_tiny_step_losses`, and the state after the steps."""
  import jax

  tr = _tiny_trainer(loss, mesh, steps, **model)
  rng = np.random.default_rng(11)
  ids = rng.integers(0, 300, 10_000).astype(np.int32)
  out = []
  with jax.set_mesh(tr.mesh):
    state = tr.init(0)
    for i in range(steps):
      state, m = tr.step(state, tr.put_batch(lm_data.train_batch(ids, i, 8, 16, seed=0, rows=tr.rows)))
      out.append(float(m["loss"]))
    ev = float(tr.eval_loss(state.params, tr.put_batch(lm_data.train_batch(ids, 99, 8, 16, seed=0))))
  return out + [ev], tr, state


@pytest.fixture(scope="module")
def one_device_losses():
  return _tiny_step_losses("plain", None)[0]


@pytest.mark.parametrize("loss,mesh", [("fused", "data=2,fsdp=2,tensor=2"), ("plain", "data=2,fsdp=2,tensor=2")])
def test_trainer_on_meshes_matches_one_device(loss, mesh, one_device_losses):
  """The trainer's step and eval on 8 devices (Explicit axes, the head split over fsdp/tensor) give the numbers of
  the plain head on one device (two steps, then a held-out batch)."""
  got, tr = _tiny_step_losses(loss, mesh)
  assert tr.mesh.size == 8
  np.testing.assert_allclose(got, one_device_losses, rtol=2e-5)


@pytest.mark.parametrize("loss", ["fused", "plain"])
@pytest.mark.parametrize("mesh,n", [("data=4", 4), ("data=2,fsdp=2", 4), ("data=2,tensor=2", 2)])
def test_split_head_over_data(loss, mesh, n, one_device_losses):
  """``split_head``: the head's kernel and both of its AdamW moments are split on H over every axis that splits
  the tokens (data as well as fsdp; V stays over tensor), the rest of the model is placed as without it, and two
  steps and a held-out batch give the one-device plain head's numbers."""
  import jax

  got, tr = _tiny_step_losses(loss, mesh, split_head=True)
  np.testing.assert_allclose(got, one_device_losses, rtol=2e-5)
  unsplit = _tiny_trainer(loss, mesh)
  with jax.set_mesh(tr.mesh):
    split, before = tr.init(0), unsplit.init(0)
  kernel = split.params["head"]["kernel"]
  h, v = kernel.shape
  tensor = tr.mesh.shape["tensor"]
  moments = [a for a in jax.tree.leaves(split.opt_state) if a.shape == (h, v)]
  assert len(moments) == 2  # AdamW's mu and nu
  for a in [kernel, *moments]:
    assert a.sharding.shard_shape(a.shape) == (h // n, v // tensor), (mesh, a.sharding)
  old = before.params["head"]["kernel"]
  assert old.sharding.shard_shape(old.shape) == (h // tr.mesh.shape["fsdp"], v // tensor)
  others = lambda st: [(p, a.sharding.spec) for p, a in jax.tree.leaves_with_path(st.params) if "head" not in str(p)]
  assert others(split) == others(before)


def test_split_head_is_the_trainers_default():
  """The trainer's command line splits the head over data unless told ``--no-split-head``; the model's own config
  does not (a model built by hand keeps the head's kernel as its logical names alone place it)."""
  cfg = lambda argv: lm_train.model_config(lm_main.parse_args(argv))
  assert cfg([]).split_head and not cfg(["--no-split-head"]).split_head
  assert cfg([]).head_axes == ("head_embed", "vocab") and cfg(["--no-split-head"]).head_axes == ("embed", "vocab")
  assert not lm_model.ModelConfig(300, 16, 32, 1, 2, 64).split_head


@pytest.mark.parametrize("loss", ["fused", "plain"])
@pytest.mark.parametrize("mesh,n,model", [("data=4", 4, {}), ("data=2,fsdp=2", 4, {"split_head": True})],
                         ids=["data=4", "data=2,fsdp=2,split_head"])
def test_split_embed_over_data(loss, mesh, n, model, one_device_losses):
  """``split_embed``: the embedding table [V, H] and both of its AdamW moments are split on V over every axis that
  splits the tokens (data as well as fsdp; H whole; read after the steps), the rest of the state is placed as
  without it, and two steps and a held-out batch give the one-device plain head's numbers (with the split head too
  on data x fsdp)."""
  import jax

  got, tr, state = _tiny_run(loss, mesh, split_embed=True, **model)
  np.testing.assert_allclose(got, one_device_losses, rtol=2e-5)
  table = state.params["embed"]["embedding"]
  v, h = table.shape
  moments = [a for a in jax.tree.leaves(state.opt_state) if a.shape == (v, h)]
  assert len(moments) == 2  # AdamW's mu and nu
  for a in [table, *moments]:
    assert a.sharding.shard_shape(a.shape) == (v // n, h), (mesh, a.sharding)
  unsplit = _tiny_trainer(loss, mesh, **model).shardings
  specs = lambda sh: [(p, s.spec) for p, s in jax.tree.leaves_with_path(sh) if "embed" not in str(p)]  # noqa: E731
  assert specs(tr.shardings) == specs(unsplit)
  assert not any(unsplit.params["embed"]["embedding"].spec)  # (without the option: replicated)


def test_split_embed_gradients():
  """The vocabulary-parallel lookup (``split_lookup``) changes no number: on a data=4 mesh (``embed_grads``
  "gather") and a data=2 x fsdp=2 mesh ("reduce") the loss and every parameter's gradient, the table's included,
  equal those of the unsplit model on one device (float32, ragged 13-token sequences, one token in every device's
  rows; the parameters replicated, which the lookup splits itself). (The trainer's steps alone would miss a table
  gradient off by a constant factor: AdamW's first update does not see it.)"""
  import dataclasses

  import flax.linen as nn
  import jax
  import jax.numpy as jnp

  cfg = lm_model.ModelConfig(vocab_size=96, seq_len=13, d_model=32, num_layers=1, num_heads=2, d_ff=48)
  rng = np.random.default_rng(9)
  tokens, labels = (jnp.asarray(rng.integers(0, 96, (4, 13)), jnp.int32) for _ in range(2))
  tokens = tokens.at[:, 0].set(5)  # one id in every row: its gradient sums rows of all devices
  explicit = lambda *shape: jax.make_mesh(shape, ("data", "fsdp")[:len(shape)],  # noqa: E731
                                          axis_types=(jax.sharding.AxisType.Explicit,) * len(shape))
  params = jax.jit(lm_model.TransformerLM(cfg, head="plain").init)(jax.random.key(2), tokens, labels)
  got = {}
  cases = (("unsplit", None, "gather"), ("data=4", explicit(4), "gather"),
           ("data=2 x fsdp=2", explicit(2, 2), "reduce"))
  for name, mesh, embed_grads in cases:
    model = lm_model.TransformerLM(dataclasses.replace(cfg, split_embed=mesh is not None, embed_grads=embed_grads),
                                   head="plain")
    fn = jax.jit(jax.value_and_grad(lambda p, t, m=model: m.apply(p, t, labels)))
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
      split = tokens if mesh is None else jax.sharding.reshard(tokens, jax.sharding.PartitionSpec(mesh.axis_names))
      loss, grads = fn(params, split)
    got[name] = (loss, nn.meta.unbox(grads))
  _assert_same_loss_and_grads(got, [(name, "unsplit") for name in got if name != "unsplit"])


def _step_collectives(text, op):
  """(dtype, dims) of each array that an ``op`` (e.g. "all-gather") of the compiled HLO ``text`` returns (its
  result type, the part of the instruction's line before the op's name)."""
  out = []
  for line in text.splitlines():
    m = re.search(rf" {op}(-start)?\(", line)
    if m:
      out += [(dt, tuple(map(int, dims.split(",")))) for dt, dims in re.findall(r"(\w+)\[([\d,]+)\]", line[:m.start()])]
  return out


def test_split_embed_step_reduce_scatters_the_rows(monkeypatch):
  """The trainer's bf16 step compiled for data=4 with ``split_embed`` (V = 1024, H = 48; 8 sequences of 16 tokens,
  32 a device) looks up the rows without gathering the table. Read from the compiled HLO by the shapes the
  collectives return, whatever their dtype (the CPU backend may widen bf16 ones): the token ids are all-gathered
  (s32[128]), the looked-up rows reduce-scattered ([32, 48]: a device's tokens x H), and no all-gather or all-reduce
  returns a [V, H] array (the table, its bf16 copy, its gradient). With ``embed_grads="reduce"`` the table's
  gradient is reduce-scattered ([V/4, H]), not all-reduced. The checks can fail: a lookup that gathers the split
  table (and, with ``reduce``, all-reduces its gradient) shows a [V, H] all-gather and all-reduce and no
  reduce-scatter of rows."""
  import dataclasses

  import jax
  from jax.sharding import PartitionSpec as P

  v, h, rows = 1024, 48, (32, 48)
  cfg = lm_model.ModelConfig(vocab_size=v, seq_len=16, d_model=h, num_layers=1, num_heads=2, d_ff=64,
                             dtype="bfloat16")

  def collectives(**model):
    tr = lm_train.make_trainer(dataclasses.replace(cfg, **model), "fused", "auto", 8,
                               lm_train.make_optimizer(1e-3, 1, 2), 16, mesh="data=4")
    text = lm_train.compile_step(tr, tr.abstract_state(0), 16).as_text()
    return {op: [dims for _, dims in _step_collectives(text, op)]
            for op in ("all-gather", "all-reduce", "reduce-scatter")}

  for embed_grads in ("gather", "reduce"):
    got = collectives(split_embed=True, embed_grads=embed_grads)
    assert (8 * 16,) in got["all-gather"] and rows in got["reduce-scatter"], (embed_grads, got)
    assert (v, h) not in got["all-gather"] + got["all-reduce"], (embed_grads, got)
    assert ((v // 4, h) in got["reduce-scatter"]) == (embed_grads == "reduce"), (embed_grads, got)

  def gathering_lookup(vocab, grads, table, tokens):  # the split table gathered, then looked up as unsplit
    if lm_model._token_spec(tokens) is not None:
      table = jax.sharding.reshard(table, P())
    return lm_model.lookup(vocab, grads, table, tokens)

  monkeypatch.setattr(lm_model, "split_lookup", gathering_lookup)
  got = collectives(split_embed=True, embed_grads="reduce")  # ("reduce": the table's gradient all-reduced)
  assert (v, h) in got["all-gather"] and (v, h) in got["all-reduce"] and rows not in got["reduce-scatter"], got


def test_split_embed_on_one_device_and_its_errors():
  """On one device ``split_embed`` is the unsplit trainer: the same placement and the same step and evaluation
  programs (their lowered text equal). It is off unless asked (``--split-embed``). A vocabulary that the devices
  splitting the tokens do not divide is refused by the trainer and by the lookup, naming the sizes."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  def programs(**model):
    tr = _tiny_trainer("plain", None, **model)
    assert tr.mesh.size == 1
    state, batch = tr.abstract_state(0), tr.abstract_batch(16)
    placed = [(x.shape, x.sharding.is_equivalent_to(tr.shardings.params["head"]["kernel"], x.ndim))
              for x in jax.tree.leaves(state)]  # (every array where the head's kernel is: whole, on one device)
    with jax.set_mesh(tr.mesh):
      return placed, tr.step.lower(state, batch).as_text(), tr.eval_loss.lower(state.params, batch).as_text()

  split, unsplit = programs(split_embed=True), programs()
  assert split[0] == unsplit[0] and all(ok for _, ok in split[0])
  assert split[1] == unsplit[1] and split[2] == unsplit[2]
  cfg = lambda argv: lm_train.model_config(lm_main.parse_args(argv))  # noqa: E731
  assert not cfg([]).split_embed and cfg(["--split-embed"]).split_embed
  assert not lm_model.ModelConfig(300, 16, 32, 1, 2, 64).split_embed
  with pytest.raises(ValueError, match=r"--split-embed: --vocab-size=300 must be divisible by the 8 devices"):
    _tiny_trainer("fused", "data=8", split_embed=True)
  _tiny_trainer("fused", "data=2,tensor=4", split_embed=True)  # (tensor does not split the tokens: 300 / 2)
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"split_embed: vocab_size=300 must be divisible by the 8"):
    lm_model.split_lookup(300, "gather", jnp.zeros((300, 4)), jax.device_put(jnp.zeros((8, 2), jnp.int32), P("data")))


def test_data_parallel_step_keeps_one_devices_memory():
  """On a data-parallel mesh the fused step's compiled temporaries per device are one device's at the same
  per-device batch (4 sequences of 64 tokens, V = 4096): nothing in the sharded step (metrics, the loss's sharded
  route, a gather of the head) holds a [tokens, V] buffer. The plain head's step, compiled alike, is the yardstick:
  its float32 logits and their gradient make its temporaries at least twice the logits' bytes."""
  cfg = lm_model.ModelConfig(vocab_size=4096, seq_len=64, d_model=32, num_layers=1, num_heads=2, d_ff=64)
  tx = lm_train.make_optimizer(1e-3, 1, 2)
  logits_bytes = 4 * 64 * 4096 * 4  # one device's float32 logits

  def temp(head, n):
    tr = lm_train.make_trainer(cfg, head, "auto", 4 * n, tx, 64, num_devices=n)
    assert dict(tr.mesh.shape) == {"data": n, "fsdp": 1, "tensor": 1}
    return lm_train.compiled_memory(lm_train.compile_step(tr, tr.abstract_state(0), 64))["temp"]

  one = temp("fused", 1)
  assert temp("plain", 1) >= 2 * logits_bytes  # the shape makes the head's logits dominate a step
  assert one < logits_bytes  # the fused step holds less than the logits alone
  for n in (8,):
    got = temp("fused", n)
    assert abs(got - one) <= 0.05 * one, (n, got, one)


def test_out_of_memory_is_reported_not_raised(cache_dir, tmp_path, monkeypatch, capsys):
  """A head whose step does not fit (XLA's RESOURCE_EXHAUSTED at compile or run time, as the plain head of the
  headroom preset on an 80 GB GPU) is reported as "does not fit"; any other error still raises."""
  import jax

  real = lm_train.compile_step
  error = [jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 67.10GiB.")]

  def compile_step(trainer, state_like, seq_len):
    if trainer.model.head == "plain":
      raise error[0]
    return real(trainer, state_like, seq_len)

  monkeypatch.setattr(lm_train, "compile_step", compile_step)
  monkeypatch.setattr(lm_maxbatch, "compile_step", compile_step)
  result, _ = run(cache_dir, tmp_path, "fused", "--steps", "2", "--sample-tokens", "0", other_head=True)
  assert result["runs"]["fused"]["fits"] and len(result["runs"]["fused"]["losses"]) == 2
  plain = result["same_batch"]["plain"]
  assert not plain["fits"] and "RESOURCE_EXHAUSTED" in plain["error"]
  result, _ = run(cache_dir, tmp_path, "plain", "--steps", "2", "--loss", "plain")
  assert result["runs"]["plain"] == {"head": "plain", "impl": "plain", "fits": False, "batch_size": 8,
                                     "error": "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 67.10GiB."}
  printed = capsys.readouterr().out
  assert "plain: does not fit at batch 8 (RESOURCE_EXHAUSTED" in printed
  assert "the fused head trains at this batch" in printed
  error[0] = ValueError("a bug, not a memory limit")
  with pytest.raises(ValueError, match="a bug"):
    run(cache_dir, tmp_path, "bug", "--steps", "2", "--loss", "plain")


def test_presets_set_no_option_of_the_fused_head():
  """impl="auto" chooses the implementation and its chunking: no preset (and no flag) sets a chunk option."""
  for name, preset in lm_main.PRESETS.items():
    args = lm_main.parse_args(["--preset", name])
    assert not [k for k in vars(args) if "chunk" in k], name
    assert set(preset) <= set(vars(args))
  with pytest.raises(SystemExit):
    lm_main.parse_args(["--chunk-size", "4096"])
  headroom = lm_main.PRESETS["headroom"]
  assert headroom["vocab_size"] == 256000 and headroom["batch_size"] * headroom["seq_len"] == 65536


@pytest.mark.parametrize("embed_grads", ["reduce", "gather"])
@pytest.mark.parametrize("head", ["fused", "plain"])
def test_bf16_step_reduces_the_vocabulary_gradients_in_bf16(head, embed_grads, tmp_path):
  """A bf16 model on a data-parallel mesh moves its two [V, d] parameters' gradients in bf16: the head's all-reduce,
  and the embedding table's (rows looked up in the compute dtype, as ``nn.Embed(dtype=...)`` does) all-reduce
  (``reduce``) or the all-gather of its rows' gradients (``gather``, [B, T, d]). Read from the program as XLA's
  partitioner leaves it (dumped through the step's ``compiler_options``), before the CPU backend widens bf16
  collectives."""
  import glob
  import re

  v, d, batch, t = 1024, 32, 4, 16
  cfg = lm_model.ModelConfig(vocab_size=v, seq_len=t, d_model=d, num_layers=1, num_heads=2, d_ff=64,
                             dtype="bfloat16", embed_grads=embed_grads)
  tr = lm_train.make_trainer(cfg, head, "auto", batch, lm_train.make_optimizer(1e-3, 1, 2), t, num_devices=2,
                             compiler_options={"xla_dump_to": str(tmp_path),
                                               "xla_dump_hlo_pass_re": "spmd-partitioning"})
  lm_train.compile_step(tr, tr.abstract_state(0), t)
  (path,) = glob.glob(str(tmp_path / "*jit_step*after_spmd-partitioning*"))
  with open(path) as f:
    text = f.read()

  def moved(kind, dims):
    found = re.findall(rf"= (\w+)\[([\d,]*)\]\{{[\d,]*\}} {kind}\(", text)
    return sorted(dt for dt, shape in found if sorted(map(int, shape.split(","))) == sorted(dims))

  assert moved("all-reduce", [d, v]) == ["bf16"] * (2 if embed_grads == "reduce" else 1), text.count("all-reduce(")
  assert moved("all-gather", [batch, t, d]) == (["bf16"] if embed_grads == "gather" else [])


def test_pgle_trains_the_same_steps(cache_dir, tmp_path, straight):
  """``--pgle N``: the jitted step, profiled for N calls and compiled again with the profile (empty on the CPU),
  trains the same losses as the compiled step; its timing leaves out the first N + 1 steps, and JAX's PGLE settings
  are put back afterwards."""
  import jax

  want = straight[0]["runs"]["fused"]
  # (on the CPU JAX's profiler records no kernel times, and JAX says so when it takes the profile: PGLE ran)
  profiled = (pytest.warns(RuntimeWarning, match="PGLE collected an empty trace")
              if jax.default_backend() == "cpu" else contextlib.nullcontext())
  with profiled:
    got, _ = run(cache_dir, tmp_path, "pgle", "--steps", "6", "--pgle", "2")
  got = got["runs"]["fused"]
  np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-6)
  assert want["timed_steps"] == 5 and got["timed_steps"] == 3 and got["step_time_s"] > 0
  assert not jax.config.jax_enable_pgle
  for bad in (["--pgle", "-1"], ["--pgle", "2", "--num-processes", "2"]):
    with pytest.raises(SystemExit):
      lm_main.parse_args(bad)


def test_gpu_presets_hold_the_head_grads_at_the_top_block():
  """The GPU presets (gpu, headroom) hold the backward at the top block for the head's reduced gradients and let
  XLA keep two collectives in flight; the cpu preset leaves both to XLA. The user's flags come after the preset's
  options, so the same key (or ``--head-grads-within``) overrides them."""
  step_options = lambda argv: lm_train.compiler_options(lm_main.parse_args(argv).compiler_option)
  limit = "xla_gpu_experimental_parallel_collective_overlap_limit"
  for preset in ("gpu", "headroom"):
    assert lm_train.model_config(lm_main.parse_args(["--preset", preset])).head_grads_within == 1
    assert step_options(["--preset", preset]) == {limit: 2}
    assert step_options(["--preset", preset, "--compiler-option", f"{limit}=1", "--compiler-option", "a=b"]) == {
        limit: 1, "a": "b"}
    assert lm_train.model_config(lm_main.parse_args(["--preset", preset, "--head-grads-within", "0"])
                                 ).head_grads_within == 0
  assert lm_train.model_config(lm_main.parse_args([])).head_grads_within == 0 and step_options([]) == {}
  assert lm_model.ModelConfig(300, 16, 32, 1, 2, 64).head_grads_within == 0


def test_compiler_option_flags():
  """``--compiler-option KEY=VALUE``: booleans, integers, floats and strings, in the order given; malformed ones
  are refused by the argument parser, naming the item."""
  got = lm_train.compiler_options(["a=true", "b=False", "c=2", "d=0.5", "e=some,thing", "c=3"])
  assert got == {"a": True, "b": False, "c": 3, "d": 0.5, "e": "some,thing"}
  assert type(got["c"]) is int and lm_train.compiler_options(None) == {}
  for bad in ("novalue", "=1"):
    with pytest.raises(SystemExit):
      lm_main.parse_args(["--compiler-option", bad])
    with pytest.raises(ValueError, match=repr(bad)):
      lm_train.compiler_options([bad])


def test_optimizer_clips_the_global_norm_unless_told_not_to():
  """make_optimizer (the trainer's --clip-norm): a gradient past the clip norm enters AdamW scaled to that norm, one
  within it as it is; with 0 every gradient enters as it is. (Two steps of different norms: AdamW alone is blind to a
  constant scale.)"""
  import jax
  import jax.numpy as jnp
  import optax

  params = {"a": jnp.array([1.0, -2.0]), "b": jnp.array([[0.5]])}
  g1 = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([[12.0]])}  # global norm 13: clipped to 1
  g2 = {"a": jnp.array([0.02, -0.01]), "b": jnp.array([[0.05]])}  # within the norm
  ref = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 0.1, 1, 3, end_value=0.01), b2=0.95, weight_decay=0.1)
  got = {}
  for clip, first in ((1.0, jax.tree.map(lambda g: g / 13.0, g1)), (0.0, g1)):
    tx = lm_train.make_optimizer(0.1, 1, 3, clip_norm=clip)
    st, st_ref = tx.init(params), ref.init(params)
    for g, g_ref in ((g1, first), (g2, g2)):
      up, st = tx.update(g, st, params)
      up_ref, st_ref = ref.update(g_ref, st_ref, params)
    for a, b in zip(jax.tree.leaves(up), jax.tree.leaves(up_ref)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, err_msg=f"clip_norm={clip}")
    got[clip] = np.asarray(up["a"])
  assert np.abs(got[1.0] - got[0.0]).max() > 1e-3 * np.abs(got[0.0]).max()  # (the two differ: the test can fail)
  assert lm_main.parse_args(["--clip-norm", "0"]).clip_norm == 0.0
  assert lm_main.parse_args([]).clip_norm == 1.0
  # a checkpoint's optimizer state fits either setting
  assert (jax.tree.structure(lm_train.make_optimizer(0.1, 1, 3, clip_norm=0.0).init(params))
          == jax.tree.structure(lm_train.make_optimizer(0.1, 1, 3).init(params)))
  with pytest.raises(SystemExit):
    lm_main.parse_args(["--clip-norm", "-1"])
