"""A shipped graph run as a user runs it, for the benchmark scripts: `python -m siirl_dag.main
graphs/NAME.yaml --json` from the repository root, its outputs (checkpoints, tensorboard, logs) in a
fresh temporary folder."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def python(args: list[str]) -> str:
    """`python ARGS` from the repository root: its standard output; SystemExit with its error's end if it fails."""
    res = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(args[:2])} failed:\n{res.stderr[-3000:]}")
    return res.stdout


def run_graph(graph: str, overrides: list[str]) -> tuple[dict, float]:
    """graphs/`graph`.yaml with `overrides`: (its --json history, its wall seconds)."""
    with tempfile.TemporaryDirectory() as tmp:
        outputs = [f"trainer.default_local_dir={tmp}/ckpt", f"trainer.tensorboard_dir={tmp}/tb", f"trainer.log_dir={tmp}/logs"]
        began = time.perf_counter()
        history = json.loads(python(["-m", "siirl_dag.main", f"graphs/{graph}.yaml", "--json", *outputs, *overrides]))
        return history, time.perf_counter() - began


def steps_in_order(history: dict) -> list[dict]:
    """A run's --json history: the metrics of each step, in step order."""
    return [history["steps"][k] for k in sorted(history["steps"], key=int)]


def val_curve(history: dict, metric: str) -> dict[str, float]:
    """`metric` before training ("0") and at each step that validated, in step order."""
    steps = history["steps"]
    validated = {k: steps[k][metric] for k in sorted(steps, key=int) if metric in steps[k]}
    return {"0": history["val_before"][metric], **validated}
