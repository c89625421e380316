"""Experiment trackers beside the console: TensorBoard, MLflow, Weights & Biases.

Each tracker is one module here holding a `Tracker` subclass; `TRACKERS` names them (adding one is
one file plus one line, and its name in the schema's `trainer.logger` enum). `MetricsLogger`
(trainer/logger.py) hands each of them the step's metrics under the names it was given, and the
validation samples `trainer.log_val_generations` asks for; a tracker that fails is reported once and
left out, the others go on. A tracker whose package is not installed is refused at the door
(`door_problems`, called by `load_pipeline`), with the command that installs it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path

from siirl_dag.errors import Problem


@dataclass(frozen=True)
class Entry:
    ref: str  # module:Class
    needs: tuple[str, ...] = ()  # the modules it imports (checked at the door, not imported there)
    extra: str | None = None  # the package extra that installs them


TRACKERS = {
    "tensorboard": Entry("siirl_dag.trainer.trackers.tensorboard:TensorBoard", ("tensorboard",)),
    "mlflow": Entry("siirl_dag.trainer.trackers.mlflow:MLflow", ("mlflow", "sqlalchemy", "alembic"), "mlflow"),
    "wandb": Entry("siirl_dag.trainer.trackers.wandb:WandB", ("wandb",), "wandb"),
}
RECORD_FILE = "trackers.json"  # in the run's output folder: each tracker's run id, for a resume to continue it


@dataclass
class RunInfo:
    """What a tracker needs to know of the run."""

    project: str  # trainer.project_name (or the pipeline's name)
    experiment: str  # trainer.experiment_name (or "default")
    out_dir: Path  # outputs/<project>/<experiment>: a tracker's local files, and RECORD_FILE
    tensorboard_dir: str
    pipeline_file: str | None = None  # the YAML as the user wrote it
    config: dict = field(default_factory=dict)  # the resolved configuration (`resolved`)
    start_step: int = 0
    resumed: bool = False  # from a checkpoint: a tracker continues the run it recorded
    previous: dict = field(default_factory=dict)  # this tracker's record from the run it continues ({}: none)


class Tracker:
    """One experiment tracker. Every method may raise: the logger reports it once and drops the tracker."""

    def __init__(self, run: RunInfo):
        self.run = run

    def record(self) -> dict:
        """What to keep so that a resumed run continues this tracker's run (its id); {}: nothing."""
        return {}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def log_generations(self, step: int, rows: list[dict]) -> None:
        """Validation samples of this step: dicts of step, prompt, response, score (`GENERATION_COLUMNS`)."""

    def close(self) -> None:
        pass


GENERATION_COLUMNS = ("step", "data_source", "prompt", "response", "score")


def tracker_class(name: str) -> type[Tracker]:
    module, cls = TRACKERS[name].ref.split(":")
    return getattr(importlib.import_module(module), cls)


def install_command(name: str) -> str:
    entry = TRACKERS[name]
    if entry.extra is None:
        return f"pip install {' '.join(entry.needs)}"
    return f"pip install 'siirl_dag[{entry.extra}]' (from a checkout: pip install -e '.[{entry.extra}]', or make setup)"


def door_problems(loggers, for_run: bool = True) -> list[Problem]:
    """trainer.logger names a tracker whose package is not installed: an error for a run, a warning for `validate`."""
    problems = []
    for i, name in enumerate(loggers):
        entry = TRACKERS.get(name)
        missing = [m for m in (entry.needs if entry else ()) if importlib.util.find_spec(m) is None]
        if missing:
            problems.append(Problem(("trainer", "logger", i), f"logger '{name}' needs the Python package(s) "
                                    f"{', '.join(missing)}, not installed here; expected them installed: "
                                    f"{install_command(name)}", severity="error" if for_run else "warning"))
    return problems


def read_records(out_dir: Path) -> dict:
    try:
        records = json.loads((Path(out_dir) / RECORD_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return records if isinstance(records, dict) else {}


def write_records(out_dir: Path, records: dict) -> None:
    path = Path(out_dir) / RECORD_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(records, indent=2))
    tmp.replace(path)


def resolved(pipe) -> dict:
    """The configuration a run resolved (defaults, overrides, placement): what `plan --json` shows,
    with the data, trainer, runtime and model settings."""
    doc = pipe.to_json()
    doc["models"] = {name: dataclasses.asdict(m) for name, m in pipe.models.items()}
    for key in ("data", "trainer", "runtime"):
        doc[key] = dataclasses.asdict(getattr(pipe, key))
    return json.loads(json.dumps(doc, default=str))  # tuples -> lists, anything odd -> its text


def flatten(doc, prefix: str = "") -> dict[str, str]:
    """{'a': {'b': 1}} -> {'a.b': '1'}: the resolved configuration as flat parameters; lists keep their text."""
    if isinstance(doc, dict) and doc:
        out = {}
        for key, value in doc.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(doc, list) and doc and all(isinstance(x, dict) and "id" in x for x in doc):  # nodes, by id
        return flatten({x["id"]: {k: v for k, v in x.items() if k != "id"} for x in doc}, prefix)
    return {prefix: doc if isinstance(doc, str) else json.dumps(doc)}
