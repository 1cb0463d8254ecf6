"""Runs the example trainer (``examples/lm/``): ``python examples/train_lm.py --help`` lists the flags.

The fused head swaps into the model in ``examples/lm/model.py``; ``examples/quickstart.py`` shows the swap alone.
"""

import os
import sys

if __package__ in (None, ""):  # run as a script from a checkout: make ``examples.lm`` and ``lce_flax`` importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples.lm.main import main  # noqa: E402

if __name__ == "__main__":
  main()
