"""README.md's Python code blocks run as written, in order, in one namespace (a later block may use an earlier
block's names, as a reader who pastes them one after another does). The Multi-GPU block runs on the 8 simulated
CPU devices of ``tests/conftest.py``."""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_readme_has_code_blocks():
  assert len(BLOCKS) >= 3, BLOCKS


def test_readme_code_blocks_run_as_written(capsys):
  namespace: dict = {"__name__": "readme"}
  for i, block in enumerate(BLOCKS):
    try:
      exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)  # noqa: S102
    except Exception as e:  # noqa: BLE001
      pytest.fail(f"README.md python block {i + 1} fails: {type(e).__name__}: {e}\n{block}")
  # the numbers the blocks print or compute are finite losses
  assert "impl=" in capsys.readouterr().out  # the op block prints explain()
  for name in ("loss", "tied"):
    assert np.isfinite(float(namespace[name])), name
