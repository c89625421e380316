"""Weights & Biases: a run in project trainer.project_name named trainer.experiment_name, its files
under the run's output folder (outputs/<project>/<experiment>/wandb); W&B's own variables, where set,
come first: WANDB_PROJECT, WANDB_NAME, WANDB_DIR (the run's files under $WANDB_DIR/wandb). Offline
(`wandb sync` uploads the files) unless an API key is set (WANDB_API_KEY, or `wandb login`); WANDB_MODE,
where set, decides. The training step is the x axis of every chart (`training/global_step`: W&B's own
step only increases, so a run resumed from an earlier checkpoint than it logged would lose steps on
it). The resolved configuration is the run's config, the YAML and the configuration are files of the
run; validation samples are a table (`val/generations`, every sample logged so far). A resume
continues the run it recorded."""

from __future__ import annotations

import json
import netrc
import os
import secrets
import shutil
import string
from pathlib import Path
from urllib.parse import urlparse

from siirl_dag.trainer.trackers import GENERATION_COLUMNS, RunInfo, Tracker

STEP = "training/global_step"


def _has_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _new_id() -> str:
    """A run id as W&B makes them (8 lowercase letters and digits), known before the run starts."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def mode() -> str:
    return os.environ.get("WANDB_MODE") or ("online" if _has_key() else "offline")


class WandB(Tracker):
    def __init__(self, run: RunInfo):
        super().__init__(run)
        import wandb

        folder = Path(run.out_dir).resolve()
        folder.mkdir(parents=True, exist_ok=True)
        run_id = run.previous.get("id") if run.resumed else None
        settings = wandb.Settings(console="off", silent=True, x_disable_stats=True, x_save_requirements=False,
                                  disable_git=True)
        # W&B's own variables first (wandb.init's arguments would override them), read as the run starts
        self.wb = wandb.init(project=os.environ.get("WANDB_PROJECT") or run.project,
                             name=os.environ.get("WANDB_NAME") or run.experiment,
                             dir=os.environ.get("WANDB_DIR") or str(folder), id=run_id or _new_id(),
                             resume="allow" if run_id else None, mode=mode(), settings=settings)
        self.wb.config.update(run.config, allow_val_change=True)
        self.wb.define_metric(STEP)
        self.wb.define_metric("*", step_metric=STEP)
        files = Path(self.wb.dir)
        if run.pipeline_file and Path(run.pipeline_file).is_file():
            shutil.copyfile(run.pipeline_file, files / "pipeline.yaml")
        (files / "resolved_config.json").write_text(json.dumps(run.config, indent=2))
        self.samples: list[list] = []

    def record(self) -> dict:
        return {"id": self.wb.id, "project": self.wb.project}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.wb.log({**metrics, STEP: step})

    def log_generations(self, step: int, rows: list[dict]) -> None:
        import wandb

        self.samples += [[row.get(c) for c in GENERATION_COLUMNS] for row in rows]
        self.wb.log({"val/generations": wandb.Table(columns=list(GENERATION_COLUMNS), data=self.samples), STEP: step})

    def close(self) -> None:
        self.wb.finish()
