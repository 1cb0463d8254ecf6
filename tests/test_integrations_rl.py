"""lce_flax.integrations.rl against float64 NumPy: per-token log-probs at a temperature (bias and soft-cap folded
into the fused op's inputs) with the entropy of the same op call (``Aux.entropy``), and the entropy alone
(``token_entropy``, temperature on the float32 logits); values and gradients, float32 and bfloat16, ignored and
masked tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lce_flax.integrations import rl

N, H, V = 23, 16, 101  # ragged: 23 tokens, a prime vocabulary (chunks of 32 leave a ragged last one)


def reference(x, w, b, y, temperature, cap, where, a):
  """log-probs, entropy and the gradients (x, w, b) of sum(a * logp) and sum(a * entropy), in float64.

  ``y`` may hold -100 (ignored: log-prob 0, no gradient; its entropy counts); ``where`` False zeroes both."""
  x, w, b, a = (np.asarray(t, np.float64) for t in (x, w, b, a))
  z0 = x @ w + b
  t = np.tanh(z0 / cap) if cap else None
  z = (cap * t if cap else z0) / temperature
  lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
  p = np.exp(z - lse[:, None])
  counted = y >= 0
  yc = np.where(counted, y, 0)
  logp = (z[np.arange(len(y)), yc] - lse) * counted
  ez = (p * z).sum(1)
  ent = lse - ez
  keep = np.asarray(where, np.float64)
  logp, ent = logp * keep, ent * keep
  onehot = np.eye(w.shape[1])[yc]
  out = {"logp": logp, "ent": ent}
  for name, dz in (("logp", (a * keep * counted)[:, None] * (onehot - p)),
                   ("ent", -(a * keep)[:, None] * p * (z - ez[:, None]))):
    dz0 = dz / temperature * ((1 - t**2) if cap else 1.0)
    out[name + "_grads"] = (dz0 @ w.T, x.T @ dz0, dz0.sum(0))
  return out


def inputs(seed, dtype):
  rng = np.random.default_rng(seed)
  x = (rng.standard_normal((N, H)) * 0.8).astype(np.float32)
  w = (rng.standard_normal((H, V)) * 0.8).astype(np.float32)
  b = rng.standard_normal(V).astype(np.float32)
  y = np.where(rng.random(N) < 0.15, -100, rng.integers(0, V, N))
  where = rng.random(N) < 0.8
  a = rng.standard_normal(N)
  cast = lambda t: jnp.asarray(t, dtype)
  up = lambda t: np.asarray(jnp.asarray(t, dtype).astype(jnp.float32))  # what the op sees, upcast
  return (cast(x), cast(w), cast(b)), (up(x), up(w), up(b)), y, where, a


def scaled(t, temperature):
  """``t / T`` as token_logprobs hands it to the op: computed in float32, rounded to ``t``'s dtype, upcast."""
  return np.asarray((jnp.asarray(t).astype(jnp.float32) * (1.0 / temperature)).astype(t.dtype).astype(jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("temperature,cap", [(1.0, None), (0.7, None), (0.6, 3.0)])
def test_logprobs_and_entropy_against_float64(dtype, temperature, cap):
  """token_logprobs(return_entropy=True): one op call; both outputs are of the distribution the op sees (x / T and
  bias / T rounded to the compute dtype), so the oracle gets those inputs, at T = 1 with the cap c / T."""
  (x, w, b), (xr, wr, br), y, where, a = inputs(int(temperature * 10 + (cap or 0)), dtype)
  xs, bs = scaled(x, temperature), scaled(b, temperature)
  want = reference(xs, wr, bs, y, 1.0, None if cap is None else cap / temperature, where, a)

  def f(x, w, b):
    return rl.token_logprobs({"kernel": w, "bias": b}, x, jnp.asarray(y), temperature=temperature,
                             logit_softcap=cap, where=jnp.asarray(where), return_entropy=True, vocab_chunk=32,
                             impl="chunked")

  (lp, ent), vjp = jax.vjp(f, x, w, b)
  assert lp.shape == ent.shape == (N,) and lp.dtype == ent.dtype == jnp.float32
  np.testing.assert_allclose(lp, want["logp"], atol=4e-5, rtol=2e-5)
  np.testing.assert_allclose(ent, want["ent"], atol=4e-5, rtol=2e-5)
  assert np.all(np.asarray(lp)[~where | (y < 0)] == 0) and np.all(np.asarray(ent)[~where] == 0)
  assert np.all(np.asarray(ent)[where & (y < 0)] > 0)  # an ignored token still has an entropy
  zeros = jnp.zeros(N, jnp.float32)
  bf16 = dtype == jnp.bfloat16
  for name, cot in (("logp", (jnp.asarray(a, jnp.float32), zeros)), ("ent", (zeros, jnp.asarray(a, jnp.float32)))):
    # the op's gradients are of x / T and b / T: the chain rule's 1 / T brings them to x and b
    ref = dict(zip(("dx", "dw", "dbias"), want[name + "_grads"]))
    ref["dx"], ref["dbias"] = ref["dx"] / temperature, ref["dbias"] / temperature
    for got, what in zip(vjp(cot), ("dx", "dw", "dbias")):
      err = np.max(np.abs(np.asarray(got, np.float64) - ref[what])) / np.max(np.abs(ref[what]))
      assert err < (5e-2 if bf16 else 2e-5), f"{name} {what}: {err:.2e}"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("temperature,cap", [(1.0, None), (0.6, 3.0)])
def test_token_entropy_against_float64(dtype, temperature, cap):
  """token_entropy alone: 1 / T on the float32 logits (no rounding of x / T), values and gradients."""
  (x, w, b), (xr, wr, br), _, where, a = inputs(40 + int(temperature * 10), dtype)
  want = reference(xr, wr, br, np.zeros(N, int), temperature, cap, where, a)
  f = lambda x, w, b: rl.token_entropy({"kernel": w, "bias": b}, x, temperature=temperature, logit_softcap=cap,
                                       where=jnp.asarray(where), vocab_chunk=32)
  ent, vjp = jax.vjp(f, x, w, b)
  np.testing.assert_allclose(ent, want["ent"], atol=2e-5, rtol=2e-5)
  for got, ref, what in zip(vjp(jnp.asarray(a, jnp.float32)), want["ent_grads"], ("dx", "dw", "dbias")):
    err = np.max(np.abs(np.asarray(got, np.float64) - ref)) / np.max(np.abs(ref))
    assert err < (5e-2 if dtype == jnp.bfloat16 else 2e-5), f"{what}: {err:.2e}"
  if dtype == jnp.float32:  # the same pass as the op's Aux.entropy: they agree where x / T is exact in float32
    _, ent_op = rl.token_logprobs({"kernel": w, "bias": b}, x, jnp.zeros(N, jnp.int32), temperature=temperature,
                                  logit_softcap=cap, where=jnp.asarray(where), return_entropy=True)
    np.testing.assert_allclose(ent_op, ent, atol=2e-6, rtol=2e-6)


def test_vh_table_chunks_and_leading_axes():
  """A [V, H] table, a chunk larger than V and one column wide, [B, T] leading axes: all equal the reference."""
  (x, w, b), (xr, wr, br), y, where, a = inputs(5, jnp.float32)
  want = reference(xr, wr, 0 * br, y, 1.3, None, np.ones(N, bool), a)
  table = w.T
  for chunk in (1, 32, 4096):
    ent = rl.token_entropy(table, x[:22].reshape(2, 11, H), w_layout="vh", temperature=1.3, vocab_chunk=chunk)
    np.testing.assert_allclose(ent.reshape(-1), want["ent"][:22], atol=2e-5, rtol=2e-5)
  lp = rl.token_logprobs(table, x, jnp.asarray(y), w_layout="vh", temperature=1.3)
  np.testing.assert_allclose(lp, want["logp"], atol=2e-5, rtol=2e-5)


def test_refusals():
  x, w, y = jnp.ones((3, H)), jnp.zeros((H, V)), jnp.zeros(3, jnp.int32)
  with pytest.raises(ValueError, match="entropy=True is return_entropy=True here"):
    rl.token_logprobs(w, x, y, w_layout="hv", entropy=True)
  with pytest.raises(ValueError, match="vocab_chunk=0 must be a positive int"):
    rl.token_entropy(w, x, w_layout="hv", vocab_chunk=0)
  with pytest.raises(ValueError, match="temperature=0.0 must be > 0"):
    rl.token_logprobs(w, x, y, w_layout="hv", temperature=0.0)
  with pytest.raises(ValueError, match="label_smoothing=0.1 and z_loss=0.0 must be 0"):
    rl.token_logprobs(w, x, y, w_layout="hv", label_smoothing=0.1)
  with pytest.raises(ValueError, match="does not end in the head's H=16"):
    rl.token_entropy(w, jnp.ones((3, H + 1)), w_layout="hv")


def test_importing_lce_flax_imports_no_client():
  """``import lce_flax`` and ``lce_flax.integrations`` (and its rl module) leave tunix and kauldron unimported."""
  import subprocess
  import sys

  code = ("import sys, lce_flax, lce_flax.integrations, lce_flax.integrations.rl, lce_flax.adapters; "
          "print(sorted(m for m in ('tunix', 'kauldron', 'gemma') if m in sys.modules))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]", out.stdout + out.stderr
