"""``impl="triton"``: the op as raw Triton kernels called through jax-triton (NVIDIA SM80+, no interpret mode).

``op.py``: the configuration, the plan and the backend protocol (the recompute backward is
``pallas_triton``'s); ``kernels.py``: the ``triton.jit`` kernels and their jax-triton launchers.
"""

from lce_flax._impl.triton.op import Config, design, grads, stats, supported

__all__ = ["Config", "design", "grads", "stats", "supported"]
