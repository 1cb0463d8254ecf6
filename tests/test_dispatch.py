"""``impl="auto"``: which backend runs where, and every GPU path forced on a GPU that can run it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from lce_flax import _device, _math, api
from lce_flax._impl import common
from tests.test_api import check_impl


@pytest.fixture
def fake_gpu(monkeypatch):
  def set_cc(cc):
    monkeypatch.setattr(_device, "platform", lambda: "gpu")
    monkeypatch.setattr(_device, "compute_capability", lambda: cc)
  return set_cc


def _spec(**kw):
  return common.Spec(_math.LossOptions(vocab_size=1000, **kw))


@pytest.mark.parametrize("cc,first", [((9, 0), "pallas_mosaic"), ((8, 0), "pallas_triton"), ((7, 5), "chunked")])
def test_auto_order_by_compute_capability(fake_gpu, cc, first):
  fake_gpu(cc)
  assert api._auto_order()[0] == first
  assert api._auto_order()[-1] == "chunked"


def test_auto_on_cpu_and_fast_mode_fallback(fake_gpu):
  assert api._resolve("auto", _spec(), "cpu", "fast")[0] == "chunked"
  assert api._resolve("auto", _spec(), "cpu", "lean")[0] == "chunked"
  fake_gpu((8, 0))
  lean_name, _ = api._resolve("auto", _spec(), "gpu", "lean")
  fast_name, mod = api._resolve("auto", _spec(), "gpu", "fast")
  # SM80: the Triton kernels for lean; for fast, a backend that has a fast design (pallas_triton has none)
  assert lean_name == "pallas_triton"
  assert fast_name == "chunked" and mod.fast is not None
  fake_gpu((9, 0))
  # SM90: the Mosaic kernels in both modes (fast: stored logits or token chunks, see pallas_mosaic.fast_design)
  assert api._resolve("auto", _spec(), "gpu", "lean")[0] == "pallas_mosaic"
  assert api._resolve("auto", _spec(), "gpu", "fast")[0] == "pallas_mosaic"


def test_explicit_impl_that_cannot_run_names_reason_and_alternatives():
  with pytest.raises(ValueError, match=r"pallas_mosaic: .*implementations that can: \[.*'xla'.*'chunked'"):
    api._resolve("pallas_mosaic", _spec(), "cpu", "lean")


GPU_IMPLS = ["xla", "chunked", "pallas_triton", "triton", "pallas_mosaic"]


@pytest.mark.gpu
@pytest.mark.parametrize("impl", GPU_IMPLS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("mode", ["fast", "lean"])
def test_every_gpu_path_against_reference(impl, dtype, mode):
  """Forces each implementation this GPU can run and checks it against the float64 oracle."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  spec = common.Spec(_math.LossOptions(vocab_size=1000), interpret=False)
  try:
    api._module(impl).supported(spec, "gpu")
  except NotImplementedError as e:
    pytest.skip(f"{impl} cannot run on this GPU: {e}")
  # fp32 is checked as exact fp32: XLA and Triton may run float32 dots as TF32 at the default precision.
  with jax.default_matmul_precision("highest"):
    check_impl(impl, mode=mode, dtype=dtype, batch_shape=(1037,), h=256, v=5003, interpret=False, seed=17)
