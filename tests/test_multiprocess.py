"""make_train_step in 2 CPU processes on localhost (jax.distributed, gloo collectives): the one-process numbers.

Each worker process has 2 CPU devices; together they form a 2 × 2 (data × tensor) mesh of ``AxisType.Explicit``
axes, load only their own rows of each batch (``lce_flax.train.process_rows`` / ``global_batch``) and train a tiny
LM with ``lce_flax.linen.LMHead``. The test process computes the same steps on one device and compares losses,
gradients and the parameters after the steps (fp32, relative error ≤ 1e-5).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V, H, B, T, STEPS = 64, 16, 8, 6, 2
OPTS = dict(z_loss=1e-3, label_smoothing=0.05)
TIMEOUT_S = 150  # per run of both workers; about 30 s on an idle 2-core machine


def build():
  """The model, its loss, the optimizer and the (global) batches: the same in every process."""
  import jax
  import jax.numpy as jnp
  import optax
  from flax import linen as nn

  import lce_flax.linen
  from lce_flax import LossOptions

  class TinyLM(nn.Module):
    @nn.compact
    def __call__(self, tokens, labels):
      table = self.param("embed", nn.initializers.normal(1.0), (V, H))
      h = jax.nn.one_hot(tokens, V, dtype=table.dtype) @ table
      h = jnp.tanh(nn.Dense(H)(h))
      return lce_flax.linen.LMHead(V, kernel_init=nn.initializers.normal(0.3), options=LossOptions(**OPTS))(h, labels)

  rng = np.random.default_rng(7)
  labels = rng.integers(0, V, (B, T)).astype(np.int32)
  labels = np.where(rng.random((B, T)) < 0.2, -100, labels).astype(np.int32)
  batches = [{"tokens": rng.integers(0, V, (B, T)).astype(np.int32), "labels": labels}] * STEPS  # loss must fall
  model = TinyLM()
  params = model.init(jax.random.key(0), batches[0]["tokens"], batches[0]["labels"])["params"]
  loss_fn = lambda p, b: model.apply({"params": p}, b["tokens"], b["labels"])  # noqa: E731
  return params, loss_fn, optax.adamw(1e-2), batches


def run_steps(mesh, make_batch):
  """First-batch gradients (replicated onto every process), then STEPS train steps; host numpy results."""
  import jax
  from flax import linen as nn
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from lce_flax.train import TrainState, make_train_step

  params, loss_fn, opt, batches = build()
  state = TrainState.create(params, opt, mesh=mesh)
  step = make_train_step(loss_fn, opt, mesh=mesh, donate=False)
  out_sh = None if mesh is None else NamedSharding(mesh, P())  # replicated: readable on every process

  def grads(params, batch):
    return nn.unbox(jax.grad(loss_fn)(params, batch))

  b0 = make_batch(batches[0])
  if mesh is None:
    g = jax.jit(grads)(state.params, b0)
  else:
    with jax.set_mesh(mesh):
      g = jax.jit(grads, out_shardings=out_sh)(state.params, b0)
  res = {f"grad/{jax.tree_util.keystr(k)}": np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(g)}
  losses, norms = [], []
  for b in batches:
    state, m = step(state, make_batch(b))
    losses.append(float(m["loss"]))
    norms.append(float(m["grad_norm"]))
  final = nn.unbox(state.params)
  if mesh is not None:
    with jax.set_mesh(mesh):
      final = jax.jit(lambda p: p, out_shardings=out_sh)(final)
  res.update({f"param/{jax.tree_util.keystr(k)}": np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(final)})
  res["losses"], res["grad_norms"] = np.array(losses), np.array(norms)
  return res


def worker(pid: int, port: int, out: str) -> None:
  import jax

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_num_cpu_devices", 2)
  jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=pid,
                             initialization_timeout=60)
  from jax.sharding import AxisType

  from lce_flax.train import global_batch, process_rows

  assert jax.process_count() == 2 and jax.local_device_count() == 2 and jax.device_count() == 4
  mesh = jax.make_mesh((2, 1, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Explicit,) * 3)
  rows = process_rows(mesh, B)
  assert rows.stop - rows.start == B // 2, rows

  def make_batch(b):  # this process loads only its own rows
    return global_batch({k: v[rows] for k, v in b.items()}, mesh)

  res = run_steps(mesh, make_batch)
  np.savez(out, rows=np.array([rows.start, rows.stop]), **res)
  jax.distributed.shutdown()


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_two_processes_match_one(tmp_path):
  port = _free_port()
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
  outs = [str(tmp_path / f"p{i}.npz") for i in range(2)]
  code = ("import sys; from tests.test_multiprocess import worker; "
          "worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])")
  procs = [subprocess.Popen([sys.executable, "-c", code, str(i), str(port), outs[i]], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
  from tests.reference_np import rel_err

  want = run_steps(None, lambda b: b)  # one process, one device: computed while the workers start
  logs = [""] * 2
  deadline = time.monotonic() + TIMEOUT_S
  try:
    for i, p in enumerate(procs):
      try:
        logs[i], _ = p.communicate(timeout=max(deadline - time.monotonic(), 1))
      except subprocess.TimeoutExpired:
        pass
  finally:
    for i, p in enumerate(procs):
      if p.poll() is None:
        p.kill()
        logs[i] = (logs[i] or "") + (p.communicate()[0] or "") + f"\n[killed after {TIMEOUT_S} s]"
  report = "\n".join(f"--- process {i} (exit {p.returncode}) ---\n{logs[i][-4000:]}" for i, p in enumerate(procs))
  assert all(p.returncode == 0 for p in procs), report

  got = [dict(np.load(o)) for o in outs]
  assert [tuple(g.pop("rows")) for g in got] == [(0, B // 2), (B // 2, B)]
  assert want["losses"][-1] < want["losses"][0]  # it trains
  for g in got:
    assert set(g) == set(want), (sorted(g), sorted(want))
    for k in want:
      assert rel_err(g[k], want[k]) <= 1e-5, (k, g[k], want[k])
