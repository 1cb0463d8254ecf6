"""``impl="pallas_mosaic"``: Pallas Mosaic GPU kernels (TMA + WGMMA) for Hopper GPUs; interpretable on CPU.

``op.py``: the configuration, the plan heuristic, the backend protocol and the recompute backward;
``epilogue.py``: the register-tile loss math; ``kernels.py``: the one-warpgroup kernels (interpretable) and what
every kernel shares; ``kernels_ws.py``: the warp-specialised kernels (the GPU default); ``fast.py``: the fast
designs ("logits", "tokens") and their dz pass. The ``custom_vjp``s are :mod:`lce_flax._impl.base`'s.
"""

from lce_flax._impl.pallas_mosaic.fast import fast_backward, fast_forward
from lce_flax._impl.pallas_mosaic.op import Config, design, grads, per_token_config, stats, supported

__all__ = ["Config", "design", "fast_backward", "fast_forward", "grads", "per_token_config", "stats",
           "supported"]
