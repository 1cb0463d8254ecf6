"""``impl="triton"``: the op as raw Triton kernels called through jax-triton — not implemented yet.

The Pallas Triton lowering (``impl="pallas_triton"``) covers the same GPUs. A raw-Triton variant would only earn
its place where it beats that lowering (e.g. TMA descriptors or persistent scheduling that Pallas Triton does not
expose); until it exists, this module reports itself unsupported so that ``impl="triton"`` fails with a clear
message and ``impl="auto"`` never picks it.
"""

from __future__ import annotations

import dataclasses

from lce_flax import _base

fast = None


@dataclasses.dataclass(frozen=True)
class Config:
  """Placeholder, so that ``linear_cross_entropy(..., chunk_size=...)`` reaches :func:`supported`'s message."""

  chunk_size: int | None = None


def supported(spec: _base.Spec, platform: str) -> None:
  del spec, platform
  raise NotImplementedError("impl='triton' (raw Triton kernels through jax-triton) is not implemented yet; "
                            "use impl='pallas_triton', which lowers the same kernels through Pallas")


def lean(x, w, bias, labels, spec: _base.Spec, config=None):
  raise NotImplementedError("impl='triton' is not implemented yet; use impl='pallas_triton'")
