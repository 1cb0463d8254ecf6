"""``impl="pallas_mosaic"`` (being split by role; see op.py)."""

from lce_flax._impl.pallas_mosaic.op import Config, fast, lean, supported

__all__ = ["Config", "fast", "lean", "supported"]
