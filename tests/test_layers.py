"""The layers of a step import one way (docs/ARCHITECTURE.md, "Layers and the flow of a step"):
runtime.step <- runtime.scheduler <- runtime.dispatch, and the schedules never import the trainer loop."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "siirl_dag"


def imports(module: str) -> set[str]:
    """The siirl_dag modules `module` imports, at the top or inside functions."""
    path = ROOT.joinpath(*module.split(".")[1:])
    tree = ast.parse((path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("siirl_dag"):
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("siirl_dag")}
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
