"""trainer.logger's experiment trackers (TensorBoard, MLflow, W&B) and trainer.log_val_generations:
MetricsLogger and the trackers driven directly, a real MLflow tracking server on 127.0.0.1 (started
here, stopped at the end, killed by `timeout` if this process dies), W&B offline."""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from siirl_dag.config import load_pipeline
from siirl_dag.errors import ConfigError
from siirl_dag.trainer import trackers
from siirl_dag.trainer.logger import MetricsLogger
from siirl_dag.trainer.trackers import RunInfo, Tracker

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = ROOT / "graphs" / "tiny_grpo_cpu.yaml"
# names as the runtime hands them (per-model prefixes included): logged as given, never renamed
METRICS = {"critic/score/mean": 0.5, "policy/actor/pg_loss": 0.25, "critic_model/critic/vf_loss": 1.5,
           "val-core/demo/arith/acc": 0.75, "timing_s/step": 2.0, "training/epoch": 0}
SAMPLES = [{"step": 2, "data_source": "demo", "prompt": "1+1=", "response": "2 | done\nyes", "score": 1.0},
           {"step": 2, "data_source": "demo", "prompt": "2+2=", "response": "5", "score": 0.0}]


def run_info(tmp_path, **kw) -> RunInfo:
    out = tmp_path / "out"
    return RunInfo(**{"project": "proj", "experiment": "exp", "out_dir": out, "tensorboard_dir": str(out / "tb"),
                      "pipeline_file": str(PIPELINE), "config": {"trainer": {"total_steps": 3}, "name": "x"}, **kw})


def three_steps(log: MetricsLogger, first: int = 1) -> None:
    for step in range(first, first + 3):
        log.log(step, {**METRICS, "policy/actor/pg_loss": 0.1 * step}, generations=SAMPLES if step == 2 else None)


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No tracker settings of this machine's user: the run's folder and names are the defaults."""
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR",
                 "WANDB_PROJECT", "WANDB_NAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))  # no `wandb login` of this machine's user
    monkeypatch.setenv("WANDB_SILENT", "true")


def wandb_files(root: Path) -> list[str]:
    """W&B's offline run files under `root` (the run's folder, or WANDB_DIR), whole: a run's finish returns
    before W&B's service has written its file out, its teardown (what ends a process) waits for it."""
    import wandb

    wandb.teardown()
    return sorted(glob.glob(str(root / "wandb" / "offline-run-*" / "run-*.wandb")))


def wandb_records(root: Path, kind: str) -> list:
    """The records of one kind in W&B's offline run files (its LevelDB-style log of protobuf records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    found = []
    for path in wandb_files(root):
        data, pos, chunks = Path(path).read_bytes(), 7, []
        while pos + 7 <= len(data):
            left = 32768 - pos % 32768
            _, length, typ = struct.unpack("<IHB", data[pos:pos + 7])
            if left < 7 or (length == 0 and typ == 0):
                pos += left
                continue
            chunks.append(data[pos + 7:pos + 7 + length])
            pos += 7 + length
            if typ in (1, 4):  # a whole record, or its last part
                rec = pb.Record()
                rec.ParseFromString(b"".join(chunks))
                chunks = []
                if rec.WhichOneof("record_type") == kind:
                    found.append(getattr(rec, kind))
    return found


def wandb_history(root: Path) -> list[dict]:
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in h.item}
            for h in wandb_records(root, "history")]


# -- the door -----------------------------------------------------------------------------------
def test_the_schema_takes_every_tracker_and_log_val_generations():
    enum = json.loads((ROOT / "siirl_dag" / "schemas" / "pipeline.schema.json").read_text())
    assert set(enum["properties"]["trainer"]["properties"]["logger"]["items"]["enum"]) == {"console", *trackers.TRACKERS}
    pipe = load_pipeline(PIPELINE, ["trainer.logger=[console,tensorboard,mlflow,wandb]", "trainer.log_val_generations=4"])
    assert pipe.trainer.logger == ("console", "tensorboard", "mlflow", "wandb") and pipe.trainer.log_val_generations == 4
    assert load_pipeline(PIPELINE).trainer.log_val_generations == 0
    with pytest.raises(ConfigError, match="log_val_generations"):
        load_pipeline(PIPELINE, ["trainer.log_val_generations=-1"])
    with pytest.raises(ConfigError, match="neptune"):
        load_pipeline(PIPELINE, ["trainer.logger=[neptune]"])


def test_a_tracker_not_installed_is_refused_at_its_line_with_the_install_command(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    f = tmp_path / "p.yaml"
    f.write_text(PIPELINE.read_text().replace("logger: [console, tensorboard]", "logger: [console, wandb]"))
    line = 1 + f.read_text().splitlines().index("  logger: [console, wandb]")
    with pytest.raises(ConfigError) as exc:
        load_pipeline(f, for_run=True)
    (problem,) = [p for p in exc.value.problems if "wandb" in p.message]
    assert (problem.file, problem.line) == (str(f), line) and "pip install 'siirl_dag[wandb]'" in problem.message
    assert f"{f}:{line}:" in str(problem)
    # `validate` only warns: the plan needs no tracker
    assert any("wandb" in w.message and w.severity == "warning" for w in load_pipeline(f).warnings)
    from siirl_dag.main import main

    assert main([str(f)]) == 2  # `siirl-dag run`: refused before anything starts


# -- the trackers, directly ---------------------------------------------------------------------
def test_every_tracker_gets_the_metrics_as_named_the_config_and_the_samples(tmp_path, offline):
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = run_info(tmp_path)
    said = []
    log = MetricsLogger(("console", "tensorboard", "mlflow", "wandb"), run.tensorboard_dir, 3, 0, run, said.append)
    three_steps(log)
    log.close()
    assert said == [] and log.failed == {}

    acc = EventAccumulator(run.tensorboard_dir)
    acc.Reload()
    assert set(METRICS) <= set(acc.Tags()["scalars"])
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("policy/actor/pg_loss")] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert set(acc.Tags()["tensors"]) >= {"val/generations/text_summary", "config/pipeline/text_summary"}

    records = json.loads((run.out_dir / trackers.RECORD_FILE).read_text())
    assert set(records) == {"mlflow", "wandb"}
    client = MlflowClient(records["mlflow"]["tracking_uri"])
    assert records["mlflow"]["tracking_uri"].startswith(f"sqlite:///{run.out_dir.resolve()}")
    found = client.get_run(records["mlflow"]["run_id"])
    assert found.info.run_name == "exp" and found.info.status == "FINISHED"
    assert client.get_experiment(found.info.experiment_id).name == "proj"
    assert set(METRICS) <= set(found.data.metrics) and found.data.params["trainer.total_steps"] == "3"
    history = client.get_metric_history(found.info.run_id, "policy/actor/pg_loss")
    assert [(m.step, round(m.value, 6)) for m in history] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    artifacts = {a.path for folder in ("config", "val_generations") for a in client.list_artifacts(found.info.run_id, folder)}
    assert artifacts == {"config/tiny_grpo_cpu.yaml", "config/resolved.json", "val_generations/step_2.json"}
    table = json.loads(Path(client.download_artifacts(found.info.run_id, "val_generations/step_2.json", str(tmp_path))).read_text())
    assert table["columns"] == list(trackers.GENERATION_COLUMNS) and table["data"][0][3] == "2 | done\nyes"

    rows = [r for r in wandb_history(run.out_dir) if "policy/actor/pg_loss" in r]
    assert [(r["training/global_step"], round(r["policy/actor/pg_loss"], 6)) for r in rows] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert set(METRICS) <= set(rows[0])
    (tables,) = [r for r in wandb_history(run.out_dir) if "val/generations/_type" in r]
    assert tables["val/generations/nrows"] == 2 and tables["training/global_step"] == 2
    (first,) = wandb_records(run.out_dir, "run")
    assert (first.run_id, first.project, first.display_name) == (records["wandb"]["id"], "proj", "exp")
    files = Path(glob.glob(str(run.out_dir / "wandb" / "offline-run-*" / "files"))[0])
    assert (files / "pipeline.yaml").read_text() == PIPELINE.read_text()
    assert json.loads((files / "resolved_config.json").read_text()) == run.config


def test_a_resumed_run_continues_the_same_tracker_runs(tmp_path, offline):
    from mlflow import MlflowClient

    run = run_info(tmp_path)
    log = MetricsLogger(("mlflow", "wandb"), run.tensorboard_dir, 6, 0, run)
    three_steps(log)
    log.close()
    first = json.loads((run.out_dir / trackers.RECORD_FILE).read_text())
    resumed = run_info(tmp_path, start_step=3, resumed=True, config={"trainer": {"total_steps": 6}, "name": "x"})
    log = MetricsLogger(("mlflow", "wandb"), run.tensorboard_dir, 6, 3, resumed)
    three_steps(log, first=4)
    log.close()
    assert log.failed == {} and json.loads((run.out_dir / trackers.RECORD_FILE).read_text()) == first
    client = MlflowClient(first["mlflow"]["tracking_uri"])
    history = client.get_metric_history(first["mlflow"]["run_id"], "policy/actor/pg_loss")
    assert [m.step for m in history] == [1, 2, 3, 4, 5, 6]
    assert len(client.search_runs([client.get_experiment_by_name("proj").experiment_id])) == 1
    # a parameter keeps its first value; the resumed configuration is uploaded beside the first
    assert client.get_run(first["mlflow"]["run_id"]).data.params["trainer.total_steps"] == "3"
    assert {a.path for a in client.list_artifacts(first["mlflow"]["run_id"], "config/resumed_at_step_3")} == \
        {"config/resumed_at_step_3/tiny_grpo_cpu.yaml", "config/resumed_at_step_3/resolved.json"}
    assert {r.run_id for r in wandb_records(run.out_dir, "run")} == {first["wandb"]["id"]}
    steps = [r["training/global_step"] for r in wandb_history(run.out_dir) if "policy/actor/pg_loss" in r]
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]  # two offline files (one per process start), one run id
    # a fresh run (no checkpoint to resume) starts new tracker runs
    log = MetricsLogger(("mlflow",), run.tensorboard_dir, 3, 0, run_info(tmp_path))
    log.close()
    assert json.loads((run.out_dir / trackers.RECORD_FILE).read_text())["mlflow"]["run_id"] != first["mlflow"]["run_id"]


def test_each_tracker_takes_its_own_variables_first_and_the_runs_folder_only_by_default(tmp_path, offline,
                                                                                      monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))  # not made yet: W&B makes it
    monkeypatch.setenv("WANDB_PROJECT", "wb-project")
    monkeypatch.setenv("WANDB_NAME", "wb-name")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "mlflow-experiment")
    run = run_info(tmp_path)
    log = MetricsLogger(("mlflow", "wandb"), run.tensorboard_dir, 3, 0, run)
    three_steps(log)
    log.close()
    assert log.failed == {}
    records = json.loads((run.out_dir / trackers.RECORD_FILE).read_text())
    assert wandb_files(tmp_path / "wandb_dir") and not (run.out_dir / "wandb").exists()
    (first,) = wandb_records(tmp_path / "wandb_dir", "run")
    assert (first.run_id, first.project, first.display_name) == (records["wandb"]["id"], "wb-project", "wb-name")
    assert records["wandb"]["project"] == "wb-project"
    steps = [r["training/global_step"] for r in wandb_history(tmp_path / "wandb_dir") if "policy/actor/pg_loss" in r]
    assert steps == [1, 2, 3]
    # MLflow: the experiment its variable names, in the default store (no MLFLOW_TRACKING_URI: the run's folder)
    client = MlflowClient(records["mlflow"]["tracking_uri"])
    found = client.get_run(records["mlflow"]["run_id"])
    assert records["mlflow"]["tracking_uri"].startswith(f"sqlite:///{run.out_dir.resolve()}")
    assert client.get_experiment(found.info.experiment_id).name == "mlflow-experiment"
    assert client.get_experiment_by_name("proj") is None and found.info.run_name == "exp"


class Flaky(Tracker):
    """Fails from step 2 on (a full disk, say)."""

    def log(self, step, metrics):
        if step >= 2:
            raise OSError(28, "No space left on device")


def test_a_tracker_failing_mid_run_is_reported_once_and_the_others_go_on(tmp_path, offline, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setitem(trackers.TRACKERS, "flaky", trackers.Entry(f"{__name__}:Flaky"))
    run = run_info(tmp_path)
    said = []
    log = MetricsLogger(("console", "flaky", "tensorboard"), run.tensorboard_dir, 3, 0, run, said.append)
    three_steps(log)
    log.close()
    assert said == ["[logger] flaky failed at step 2 (OSError: [Errno 28] No space left on device); the run goes on "
                    "without it (logging to: console, tensorboard)"]
    acc = EventAccumulator(run.tensorboard_dir)
    acc.Reload()
    assert [e.step for e in acc.Scalars("policy/actor/pg_loss")] == [1, 2, 3]


# -- a real MLflow tracking server ----------------------------------------------------------------
@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mlflow_server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no background job runner
    # `timeout` leads the server's process group (its uvicorn worker included) and ends it after 10 minutes
    server = subprocess.Popen(["timeout", "600", sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1",
                               "--port", str(port), "--workers", "1", "--backend-store-uri", f"sqlite:///{folder}/mlflow.db",
                               "--default-artifact-root", str(folder / "artifacts")],
                              stdout=open(folder / "server.log", "w"), stderr=subprocess.STDOUT, start_new_session=True,
                              env=env, cwd=folder)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(180):
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                assert server.poll() is None, (folder / "server.log").read_text()[-3000:]
                time.sleep(1)
        else:
            pytest.fail("the MLflow server did not start in 180 s: " + (folder / "server.log").read_text()[-3000:])
        yield url, server
    finally:
        stop(server)


def stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def test_mlflow_logs_to_a_tracking_server_and_a_server_gone_mid_run_stops_only_mlflow(tmp_path, offline, monkeypatch,
                                                                                     mlflow_server):
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    url, server = mlflow_server
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    run = run_info(tmp_path)
    said = []
    log = MetricsLogger(("tensorboard", "mlflow"), run.tensorboard_dir, 4, 0, run, said.append)
    log.log(1, METRICS)
    log.log(2, METRICS, generations=SAMPLES)
    record = json.loads((run.out_dir / trackers.RECORD_FILE).read_text())["mlflow"]
    assert record["tracking_uri"] == url and not (run.out_dir / "mlflow").exists()
    client = MlflowClient(url)
    found = client.get_run(record["run_id"])
    assert set(METRICS) <= set(found.data.metrics) and found.info.run_name == "exp"
    assert [m.step for m in client.get_metric_history(record["run_id"], "policy/actor/pg_loss")] == [1, 2]
    assert "val_generations/step_2.json" in {a.path for a in client.list_artifacts(record["run_id"], "val_generations")}

    stop(server)  # the server goes away mid-run
    began = time.monotonic()
    log.log(3, METRICS)
    log.log(4, METRICS)
    log.close()
    assert time.monotonic() - began < 60
    assert len(said) == 1 and said[0].startswith("[logger] mlflow failed at step 3 (") and \
        said[0].endswith("; the run goes on without it (logging to: tensorboard)"), said
    acc = EventAccumulator(run.tensorboard_dir)
    acc.Reload()
    assert [e.step for e in acc.Scalars("policy/actor/pg_loss")] == [1, 2, 3, 4]


# -- one run through the real pipeline ----------------------------------------------------------
@pytest.mark.engines
def test_a_run_logs_to_every_tracker_with_its_validation_samples(tmp_path, tiny_model_dir, demo_data, offline):
    from mlflow import MlflowClient
    from test_e2e import PIPELINE, SEPARATE

    f = tmp_path / "pipeline.yaml"
    f.write_text(PIPELINE.format(devices=2, model=tiny_model_dir, data=demo_data, meshes=SEPARATE, out=tmp_path,
                                 backend="local"))
    # in tmp_path: the run's output folder (outputs/e2e/run) is relative to where it starts
    res = subprocess.run([sys.executable, "-m", "siirl_dag.main", str(f), "--json", "trainer.total_steps=1",
                          "trainer.val_before_train=false", "trainer.export_hf=false", "trainer.log_val_generations=3",
                          "trainer.logger=[console,tensorboard,mlflow,wandb]"], capture_output=True, text=True,
                         timeout=600, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "WANDB_DIR": str(tmp_path / "wandb_dir")})
    assert res.returncode == 0, res.stderr[-4000:]
    history = json.loads(res.stdout)
    assert "[logger]" not in res.stderr, res.stderr[-3000:]
    out = tmp_path / "outputs" / "e2e" / "run"
    records = json.loads((out / trackers.RECORD_FILE).read_text())
    client = MlflowClient(records["mlflow"]["tracking_uri"])
    found = client.get_run(records["mlflow"]["run_id"])
    logged = {k for k, v in history["steps"]["1"].items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert logged <= set(found.data.metrics) and "val-core/demo/arith/acc" in logged
    assert found.data.params["trainer.log_val_generations"] == "3" and found.info.status == "FINISHED"
    table = json.loads(Path(client.download_artifacts(found.info.run_id, "val_generations/step_1.json",
                                                      str(tmp_path))).read_text())
    assert len(table["data"]) == 3 and all(row[0] == 1 and row[2] for row in table["data"])
    # W&B's files where WANDB_DIR says, not in the run's folder
    assert not (out / "wandb").exists()
    logged_by_wandb = wandb_history(tmp_path / "wandb_dir")
    rows = [r for r in logged_by_wandb if "critic/score/mean" in r]
    assert [r["training/global_step"] for r in rows] == [1] and logged <= set(rows[0]) | {"training/global_step"}
    assert [r["val/generations/nrows"] for r in logged_by_wandb if "val/generations/nrows" in r] == [3]
