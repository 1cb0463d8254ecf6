"""The backends of :func:`lce_flax.linear_cross_entropy` (private: reached through ``api.py``'s dispatch)."""
