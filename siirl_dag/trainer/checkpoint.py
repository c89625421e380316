"""Checkpoints that survive a crash mid-save: written to a temporary folder, then renamed.

Layout: <dir>/global_step_<k>/{<train node>/ (engine dist checkpoint), trainer_state.json}.
Only folders with trainer_state.json count; resume picks the newest; old ones are pruned to
max_ckpt_to_keep.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Callable

from siirl_dag.errors import ConfigError, Problem

_STEP = re.compile(r"^global_step_(\d+)$")
STATE_FILE = "trainer_state.json"


def latest(directory: str | Path) -> Path | None:
    """The newest complete checkpoint folder under `directory`, or None."""
    root = Path(directory)
    if not root.is_dir():
        return None
    done = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name)) and (p / STATE_FILE).is_file()]
    return max(done)[1] if done else None


def save(directory: str | Path, step: int, state: dict, write_engines: Callable[[Path], None], keep: int | None) -> Path:
    """Write engines + trainer state under a temporary name, rename into place, prune old ones."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / f"global_step_{step}", root / f".tmp_global_step_{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write_engines(tmp)
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    if keep:
        done = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name)))
        for _, old in done[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def load_state(path: str | Path) -> dict:
    """The trainer state of a checkpoint folder; a damaged one is bad input, reported clearly."""
    f = Path(path) / STATE_FILE
    try:
        state = json.loads(f.read_text())
        if not isinstance(state, dict) or not isinstance(state.get("step"), int):
            raise ValueError("no integer 'step'")
        return state
    except (OSError, ValueError) as exc:
        raise ConfigError([Problem(("trainer", "resume_from_path"), f"checkpoint state {f} is unreadable ({exc}); "
                                   "expected a folder written by this trainer", file=str(f))]) from None
