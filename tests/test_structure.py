"""The package's layers only look down: no import circle among ``lce_flax``'s modules (imports inside functions
included), and the three routing modules each import alone in a fresh interpreter.

api.py (validation, routing, explain) → sharding.py (Explicit axes) → _partition.py (Auto axes) → _impl/base.py
(the per-device op) → the backends → _math.py. ``_partition`` and ``sharding`` never import ``api``.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "lce_flax"


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PKG.rglob("*.py")}


def _imports(name: str) -> set[str]:
  """The lce_flax modules that module ``name`` imports, anywhere in its body."""
  path = MODULES[name]
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:  # relative import
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*anchor, *([base] if base else [])])
      # ``from pkg import sub``: sub is a module when the package has one of that name
      targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    else:
      continue
    out |= {t for t in targets if t in MODULES and t != name}
  return out


GRAPH = {name: _imports(name) for name in MODULES}


def _cycles(graph) -> list[list[str]]:
  """Strongly connected components with more than one module (Tarjan)."""
  index, low, stack, on, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for u in graph[v]:
      if u not in index:
        visit(u)
        low[v] = min(low[v], low[u])
      elif u in on:
        low[v] = min(low[v], index[u])
    if low[v] == index[v]:
      comp = []
      while True:
        u = stack.pop()
        on.discard(u)
        comp.append(u)
        if u == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_graph_is_read():
  """The parser sees the imports the layers are made of (so the checks below can fail)."""
  assert {"lce_flax._partition", "lce_flax._impl.base"} <= GRAPH["lce_flax.sharding"]
  assert "lce_flax._impl.base" in GRAPH["lce_flax._partition"]
  assert {"lce_flax.sharding", "lce_flax._partition", "lce_flax._impl.base"} <= GRAPH["lce_flax.api"]
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _reach(start: str) -> set[str]:
  reach, todo = {start}, [start]
  while todo:
    for u in GRAPH[todo.pop()] - reach:
      reach.add(u)
      todo.append(u)
  return reach


def test_no_import_circle():
  """No circle among the modules the op is made of: everything that ``lce_flax.api`` reaches, the heads and
  adapters on top of it included."""
  op = set().union(*(_reach(m) for m in ("lce_flax.api", "lce_flax.linen", "lce_flax.nnx", "lce_flax.adapters")))
  assert _cycles({m: GRAPH[m] & op for m in op}) == []


@pytest.mark.parametrize("lower", ["lce_flax.sharding", "lce_flax._partition", "lce_flax._impl.base"])
def test_lower_layers_never_import_api(lower):
  assert "lce_flax.api" not in _reach(lower), f"{lower} reaches lce_flax.api"


@pytest.mark.parametrize("module", ["lce_flax.api", "lce_flax.sharding", "lce_flax._partition",
                                    "lce_flax._impl.base"])
def test_each_routing_module_imports_alone(module):
  run = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, capture_output=True, text=True,
                       env={"JAX_PLATFORMS": "cpu", "PATH": ""}, timeout=120)
  assert run.returncode == 0, run.stderr


def test_version_is_written_once():
  """pyproject.toml reads the version from ``lce_flax.__version__`` (no second copy to drift)."""
  import tomllib

  import lce_flax
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())
  assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
  assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "lce_flax.__version__"}
  assert lce_flax.__version__.count(".") == 2
