"""``impl="pallas_triton"``: Pallas kernels lowered through Triton (NVIDIA SM80+; interpret mode elsewhere).

``op.py``: the configuration, the plan heuristic, the backend protocol and the recompute backward;
``kernels.py``: the Pallas kernels (forward statistics, logit gradient, in-place dx) and their launchers.
"""

from lce_flax._impl.pallas_triton.op import Config, design, grads, stats, supported

__all__ = ["Config", "design", "grads", "stats", "supported"]
