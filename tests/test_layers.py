"""The layers of a step import one way (docs/ARCHITECTURE.md, "Layers and the flow of a step"):
runtime.step <- runtime.scheduler <- runtime.dispatch, and the schedules never import the trainer loop;
and no module of siirl_dag or nodes imports itself back through others, nor fails imported first."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

TOP = Path(__file__).resolve().parents[1]
OURS = ("siirl_dag", "nodes")
MODULES = {".".join(p.relative_to(TOP).with_suffix("").parts).removesuffix(".__init__")
           for package in OURS for p in (TOP / package).rglob("*.py")}


def imports(module: str) -> set[str]:
    """The modules of ours `module` imports (`from package import module`: the module alone), at the
    top, inside functions, or by importlib.import_module."""
    path = TOP.joinpath(*module.split("."))
    tree = ast.parse((path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(OURS):
            found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                      for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith(OURS)}
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module" and node.args \
                and isinstance(node.args[0], ast.Constant):
            found.add(node.args[0].value)
    return found


@pytest.mark.parametrize("module, never", [
    ("siirl_dag.runtime.step", ("siirl_dag.runtime.scheduler", "siirl_dag.runtime.dispatch")),
    ("siirl_dag.runtime.scheduler", ("siirl_dag.runtime.dispatch", "siirl_dag.trainer")),
    ("siirl_dag.runtime.dispatch", ("siirl_dag.trainer",)),
    ("siirl_dag.runtime.recovery", ("siirl_dag.runtime.dispatch", "siirl_dag.trainer")),
    ("siirl_dag.trainer.schedules", ("siirl_dag.trainer.loop",)),
    ("siirl_dag.trainer.schedules.sync", ("siirl_dag.trainer.loop", "siirl_dag.trainer.schedules.overlapped")),
    ("siirl_dag.trainer.schedules.overlapped", ("siirl_dag.trainer.loop", "siirl_dag.trainer.schedules.sync")),
    ("siirl_dag.trainer.schedules.generation", ("siirl_dag.trainer.loop", "siirl_dag.runtime.dispatch")),
])
def test_a_layer_does_not_import_the_layers_above_it(module, never):
    assert not {m for m in imports(module) if m.startswith(never)}


def test_no_module_imports_itself_back():
    """Adding a node kind stays one new file plus one line: the registry never imports `nodes`."""
    graph = nx.DiGraph((m, i) for m in MODULES for i in imports(m) & MODULES if i != m)
    assert list(nx.simple_cycles(graph)) == []


FIRST = """import importlib, sys
for module in sys.argv[1:]:
    for name in [n for n in sys.modules if n.split(".")[0] in ("siirl_dag", "nodes")]:
        del sys.modules[name]
    try:
        importlib.import_module(module)
    except Exception as exc:
        print(module, repr(exc))
"""


def test_every_module_imports_before_any_other_of_ours():
    """As a Ray worker or a script may: a package's __init__ that leads back to the module importing
    it (which the graph above, of explicit imports, does not show) fails here."""
    modules = sorted(m for m in MODULES if not m.endswith("__main__"))
    res = subprocess.run([sys.executable, "-c", FIRST, *modules], cwd=TOP, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout == "", res.stdout + res.stderr[-2000:]
