"""MLflow: a run named trainer.experiment_name in experiment trainer.project_name (MLFLOW_EXPERIMENT_NAME,
where set, names it), in the tracking server of MLFLOW_TRACKING_URI, or else a local store in the run's
output folder (outputs/<project>/<experiment>/mlflow: an SQLite database and an artifact folder;
`mlflow ui --backend-store-uri sqlite:///.../mlflow.db` shows it). The resolved configuration goes in
as the run's parameters, the YAML and the resolved configuration as artifacts (config/), validation
samples as table artifacts (val_generations/step_N.json). A resume continues the run it recorded."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from siirl_dag.trainer.trackers import GENERATION_COLUMNS, RunInfo, Tracker, flatten

# MLflow's own rule (mlflow.utils.validation): a name it refuses would fail the whole batch
_NAME = re.compile(r"^[/\w.\- :]*$")
_BATCH = 1000  # metrics per log_batch call (MLflow's limit)
_PARAMS = 100  # params per log_batch call


def _valid(name: str) -> bool:
    norm = os.path.normpath(name)
    return bool(_NAME.match(name)) and norm == name and not name.startswith(("/", ".")) and len(name) <= 250


def local_store(out_dir: Path) -> tuple[str, str]:
    """The tracking URI and artifact location of the local store in the run's output folder."""
    folder = (Path(out_dir) / "mlflow").resolve()
    folder.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{folder / 'mlflow.db'}", (folder / "artifacts").as_uri()


class MLflow(Tracker):
    def __init__(self, run: RunInfo):
        super().__init__(run)
        # a tracking server that is gone costs a step a few seconds, not MLflow's minutes of retries
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
        from mlflow import MlflowClient

        uri, artifacts = os.environ.get("MLFLOW_TRACKING_URI"), None
        if not uri:
            uri, artifacts = local_store(run.out_dir)
        self.uri, self.client, self.skipped = uri, MlflowClient(tracking_uri=uri), set()
        previous = run.previous if run.resumed and run.previous.get("tracking_uri") == uri else {}
        self.run_id = self._continued(previous.get("run_id"))
        if self.run_id is None:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or run.project
            found = self.client.get_experiment_by_name(name)
            experiment = found.experiment_id if found else self.client.create_experiment(name, artifacts)
            self.run_id = self.client.create_run(experiment, run_name=run.experiment,
                                                 tags={"siirl_dag.pipeline": str(run.pipeline_file)}).info.run_id
        self._log_config(run)

    def _continued(self, run_id: str | None) -> str | None:
        """The recorded run, marked running again; None where there is none (or it was deleted)."""
        if not run_id:
            return None
        from mlflow.exceptions import MlflowException

        try:
            found = self.client.get_run(run_id)
        except MlflowException:
            return None
        if found.info.lifecycle_stage != "active":
            return None
        self.client.update_run(run_id, status="RUNNING")
        return run_id

    def _log_config(self, run: RunInfo) -> None:
        from mlflow.entities import Param

        logged = self.client.get_run(self.run_id).data.params
        # a parameter keeps its first value (MLflow refuses a change): a resume adds only new ones; what
        # changed is in the resolved configuration it uploads beside the first
        params = [Param(k, v[:6000]) for k, v in flatten(run.config).items() if _valid(k) and k not in logged]
        for i in range(0, len(params), _PARAMS):
            self.client.log_batch(self.run_id, params=params[i:i + _PARAMS])
        folder = "config" if not logged else f"config/resumed_at_step_{run.start_step}"
        if run.pipeline_file and Path(run.pipeline_file).is_file():
            self.client.log_artifact(self.run_id, run.pipeline_file, folder)
        self.client.log_text(self.run_id, json.dumps(run.config, indent=2), f"{folder}/resolved.json")

    def record(self) -> dict:
        return {"run_id": self.run_id, "tracking_uri": self.uri}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        names = [k for k in metrics if _valid(k)]
        self.skipped.update(k for k in metrics if not _valid(k))
        batch = [Metric(k, metrics[k], now, step) for k in names]
        for i in range(0, len(batch), _BATCH):
            self.client.log_batch(self.run_id, metrics=batch[i:i + _BATCH])

    def log_generations(self, step: int, rows: list[dict]) -> None:
        table = {c: [row.get(c) for row in rows] for c in GENERATION_COLUMNS}
        self.client.log_table(self.run_id, table, f"val_generations/step_{step}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")
