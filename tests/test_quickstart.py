"""examples/quickstart.py: the swapped head trains like the plain one, from the same parameters, in less memory."""

from __future__ import annotations

import numpy as np

from examples import quickstart


def test_quickstart_heads_train_alike():
  runs = quickstart.main(["--steps", "4", "--vocab", "2048", "--batch", "8", "--seq", "64"])
  plain, fused = runs["plain"]["losses"], runs["fused"]["losses"]
  assert len(plain) == len(fused) == 4 and plain[0] > 6.0  # ~log(2048) = 7.6 at initialisation: a real loss
  # same initial parameters and batches: the same loss up to float32 rounding, step after step
  np.testing.assert_allclose(fused, plain, rtol=1e-4)
  assert plain[-1] < plain[0]
  # the plain step keeps the float32 [8*64, 2048] logits (and their gradient); the fused one does not
  assert runs["plain"]["temp_bytes"] - runs["fused"]["temp_bytes"] >= 8 * 64 * 2048 * 4
