"""Checkpoints that survive a crash mid-save: written to a temporary folder, then renamed.

Layout: <dir>/global_step_<k>/{<train node>/ (engine dist checkpoint), trainer_state.json, and
in_flight/ (batches generated ahead, `in_flight`)}.
Only folders with trainer_state.json are complete; resume picks the newest. Pruning to
max_ckpt_to_keep removes only steps older than the one just saved; the trainer refuses to start
where a run would overwrite or prune checkpoints that are not its own history.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Sequence

from siirl_dag.config.schema import is_count
from siirl_dag.errors import ConfigError, PathPart, Problem

_STEP = re.compile(r"^global_step_(\d+)$")
STATE_FILE = "trainer_state.json"
# What megatron's dist_checkpointing (torch_dist) writes into an engine folder beside the *.distcp
# shards: its own config, torch DCP's metadata, and the common (non-sharded) state.
ENGINE_FILES = ("metadata.json", ".metadata", "common.pt")
# The HF config fields that fix a model's tensor shapes: an engine checkpoint loads only into the same.
MODEL_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "num_experts", "num_local_experts",
                "moe_intermediate_size", "tie_word_embeddings")
EXPECTED = "expected a global_step_N folder written by this trainer"


def steps(directory: str | Path) -> dict[int, Path]:
    """Every global_step_<k> folder under `directory`, complete or not, by step."""
    root = Path(directory)
    if not root.is_dir():
        return {}
    return {int(m.group(1)): p for p in root.iterdir() if (m := _STEP.match(p.name)) and p.is_dir()}


def latest(directory: str | Path) -> Path | None:
    """The newest complete checkpoint folder under `directory`, or None."""
    done = [(k, p) for k, p in steps(directory).items() if (p / STATE_FILE).is_file()]
    return max(done)[1] if done else None


def save(directory: str | Path, step: int, state: dict, write_engines: Callable[[Path], None], keep: int | None) -> Path:
    """Write engines + trainer state under a temporary name, rename into place, prune older ones."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / f"global_step_{step}", root / f".tmp_global_step_{step}"
    if final.exists():  # the trainer checked the folder at start: another run is writing here
        raise FileExistsError(f"{final} appeared during this run; another run writes into {root}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write_engines(tmp)
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))
    tmp.rename(final)
    if keep:
        older = sorted(k for k in steps(root) if k < step)
        for k in older[:max(0, len(older) - (keep - 1))]:
            shutil.rmtree(root / f"global_step_{k}", ignore_errors=True)
    return final


def load_state(path: str | Path, key: Sequence[PathPart]) -> dict:
    """The trainer state of a checkpoint folder, its shape checked: a damaged one is bad input at
    `key`, reported before any process starts rather than as a KeyError after."""
    folder = Path(path)
    f = folder / STATE_FILE
    if not folder.is_dir():
        raise ConfigError(Problem(tuple(key), f"checkpoint folder {folder} does not exist; {EXPECTED}", file=str(folder)))
    try:
        state = json.loads(f.read_text())
        wrong = _state_problem(state)
    except (OSError, ValueError) as exc:
        wrong = f"is unreadable ({exc})"
    if wrong:
        raise ConfigError(Problem(tuple(key), f"checkpoint state {f} {wrong}; {EXPECTED}", file=str(f)))
    return state


def _state_problem(state) -> str | None:
    if not isinstance(state, dict):
        return "is not a mapping"
    if not is_count(state.get("step")):
        return f"has step {state.get('step')!r:.40}, not a non-negative 64-bit integer"
    lacking = [k for k in ("loader", "versions", "synced") if not isinstance(state.get(k), dict)]
    if lacking:
        return f"lacks the mapping(s) {', '.join(lacking)}"
    versions = [n for n, v in state["versions"].items() if not is_count(v)]
    if versions:
        return f"has a weight version that is not a count for {', '.join(versions)}"
    in_flight = state.get("in_flight", [])  # absent in checkpoints older than one_step_off's
    if not isinstance(in_flight, list) or not all(is_count(b) for b in in_flight):
        return "has an in_flight record that is not a list of batch numbers"
    models = state.get("models", {})  # absent in checkpoints older than the record
    if not isinstance(models, dict) or not all(isinstance(m, dict) for m in models.values()):
        return "has a models record that is not a mapping of mappings"
    return None


def engine_problems(path: str | Path, nodes: Sequence[str], key: Sequence[PathPart]) -> list[Problem]:
    """Each training node's folder must hold a whole engine checkpoint: the engines would find out
    only after every worker started."""
    problems = []
    for node in nodes:
        folder = Path(path) / node
        missing = [f for f in ENGINE_FILES if not (folder / f).is_file()]
        missing += [] if any(folder.glob("*.distcp")) else ["*.distcp"]
        if missing:
            what = f"lacks {', '.join(missing)}" if folder.is_dir() else "does not exist"
            problems.append(Problem(tuple(key), f"the checkpoint folder of node '{node}' {what}; expected the "
                                    f"distributed checkpoint this trainer writes ({', '.join(ENGINE_FILES)}, *.distcp)",
                                    file=str(folder)))
    return problems


def model_identity(hf_config: dict | None, lora: Any = None) -> dict:
    """What a checkpoint records of a trained model, to refuse resuming into a different one: its shape,
    and the shape of its adapters (a checkpoint of adapters holds them alone; None: the whole model)."""
    identity = {k: hf_config[k] for k in MODEL_FIELDS if k in hf_config} if hf_config else {}
    identity["lora"] = None if lora is None else {"rank": lora.rank, "targets": sorted(lora.targets)}
    return identity
