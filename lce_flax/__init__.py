"""lce_flax: a fused linear + cross-entropy head for JAX/Flax that never holds the [tokens, vocab] logits."""

from lce_flax.api import IMPLEMENTATIONS, Aux, available_implementations, linear_cross_entropy

__all__ = ["Aux", "IMPLEMENTATIONS", "available_implementations", "linear_cross_entropy"]
__version__ = "0.1.0"
