"""The fused loss wired into other JAX LLM stacks, one call each; see docs/integration.md.

- :mod:`lce_flax.integrations.tunix`: a ``loss_fn`` for google-tunix's trainers (``PeftTrainer.with_loss_fn``)
  and per-token log-probs of completions for its RL learners.
- :mod:`lce_flax.integrations.kauldron`: a kauldron loss for DeepMind ``gemma`` models trained by kauldron.
- :mod:`lce_flax.integrations.rl`: per-token log-probs at a temperature and per-token entropy for any head the
  adapters accept (no client needed).

Importing ``lce_flax`` or this package imports neither tunix nor kauldron: each integration module is imported
explicitly (``import lce_flax.integrations.tunix``) or on first attribute access, and imports its client then.
The clients are the optional extra ``lce_flax[integrations]``.
"""

import importlib

__all__ = ["kauldron", "rl", "tunix"]


def __getattr__(name):
  if name in __all__:
    return importlib.import_module(f"lce_flax.integrations.{name}")
  raise AttributeError(f"module 'lce_flax.integrations' has no attribute {name!r}")
