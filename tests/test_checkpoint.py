"""Checkpoints as input: nothing another run wrote is overwritten or pruned, and a damaged or
mismatched checkpoint is refused before any process starts, located at the key that chose it.
No Ray, no engines: Trainer.__init__ does every check, on fabricated checkpoint folders."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import traceback
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from siirl_dag.config import load_pipeline
from siirl_dag.errors import ConfigError
from siirl_dag.runtime import PipelineError
from siirl_dag.trainer import checkpoint
from siirl_dag.trainer.loop import Trainer
from siirl_dag.weight_sync.versions import WeightVersions

MODEL = {"model_type": "qwen2", "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 64, "tie_word_embeddings": True}
ENGINE_FOLDER = ("metadata.json", ".metadata", "common.pt", "__0_0.distcp")  # what megatron's dist checkpoint holds
PIPELINE = """\
name: ck
cluster: {{nodes: 1, devices_per_node: 2, device: cpu}}
models:
  policy: {{path: {tmp}/model, dtype: float32}}
data:
  train_files: {tmp}/train.parquet
  train_batch_size: 4
  seed: 1
meshes: {{gen: "vllm:d1", train: "megatron:d1"}}
nodes:
  - {{id: rollout, kind: rollout, mesh: gen, model: policy, weights_from: actor_update, options: {{n: 2}}}}
  - {{id: reward, kind: reward, deps: [rollout]}}
  - {{id: advantage, kind: advantage, deps: [reward]}}
  - {{id: old_logprob, kind: logprob, deps: [rollout], mesh: train, model: policy, params: {{output: old_logprobs}}}}
  - {{id: actor_update, kind: actor_update, deps: [advantage, old_logprob], mesh: train, model: policy,
     params: {{mini_batch_size: 4}}}}
trainer:
  total_steps: 6
  default_local_dir: {tmp}/ckpt
  tensorboard_dir: {tmp}/tb
"""


class FakeRuntime:
    """What Trainer.save and _restore_engines use of the runtime; engine calls write placeholder files."""

    def __init__(self, fail: BaseException | None = None):
        self.versions, self.fail = WeightVersions({"actor_update": 0}, {"rollout": 0}, {"rollout": "actor_update"}), fail

    def engine_call(self, node, method, folder):
        if self.fail:
            raise self.fail
        Path(folder).mkdir(parents=True)
        for name in ENGINE_FOLDER:
            Path(folder, name).write_text("x")


@pytest.fixture
def tmp(tmp_path, tiny_model_dir):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(MODEL))
    for f in Path(tiny_model_dir).iterdir():  # a real tokenizer: the trainer counts prompt tokens
        if f.name != "config.json" and f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / "model")
    write_data(tmp_path, 20)
    return tmp_path


def write_data(tmp, rows):
    pq.write_table(pa.table({"prompt": [f"q{i}" for i in range(rows)], "data_source": ["gsm8k"] * rows,
                             "ground_truth": ["1"] * rows}), tmp / "train.parquet")


def pipeline(tmp, *overrides):
    (tmp / "p.yaml").write_text(PIPELINE.format(tmp=tmp))
    return load_pipeline(tmp / "p.yaml", list(overrides))


def write_checkpoint(tmp, step) -> Path:
    """The checkpoint a run of this pipeline saves into ckpt/ after `step` steps (engines faked)."""
    trainer = Trainer(pipeline(tmp, f"trainer.default_local_dir={tmp}/staging"))
    trainer.rt, trainer.step, trainer.ckpt_dir = FakeRuntime(), step, tmp / "ckpt"
    for _ in range(step):
        trainer.loader.next_batch()
    return trainer.save()


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def refused(tmp, *overrides) -> str:
    with pytest.raises(ConfigError) as err:
        Trainer(pipeline(tmp, *overrides))
    (problem,) = err.value.problems
    return str(problem)


def test_pruning_keeps_the_checkpoint_just_written_and_removes_only_older_ones(tmp_path):
    write = lambda folder: (folder / "engine").mkdir()  # noqa: E731
    for step in (30, 60):
        checkpoint.save(tmp_path, step, {"step": step}, write, keep=None)
    first = checkpoint.save(tmp_path, 1, {"step": 1}, write, keep=2)
    assert first.is_dir() and sorted(checkpoint.steps(tmp_path)) == [1, 30, 60], "nothing newer is pruned"
    checkpoint.save(tmp_path, 61, {"step": 61}, write, keep=2)
    assert sorted(checkpoint.steps(tmp_path)) == [60, 61]
    with pytest.raises(FileExistsError, match="global_step_61 appeared during this run"):
        checkpoint.save(tmp_path, 61, {"step": 0}, write, keep=2)
    assert json.loads((tmp_path / "global_step_61" / "trainer_state.json").read_text()) == {"step": 61}


@pytest.mark.parametrize("mode, complete", [("disable", True), ("auto", False)])
def test_a_fresh_run_refuses_a_folder_holding_checkpoints(tmp, mode, complete):
    write_checkpoint(tmp, 2)
    write_checkpoint(tmp, 4)
    if not complete:  # auto finds no complete checkpoint, so it would start afresh
        for step in (2, 4):
            (tmp / "ckpt" / f"global_step_{step}" / "trainer_state.json").unlink()
    before = snapshot(tmp / "ckpt")
    message = refused(tmp, f"trainer.resume_mode={mode}")
    assert f"trainer.resume_mode: checkpoint folder {tmp}/ckpt already holds global_step_2, global_step_4, which " \
           "this fresh run would overwrite or prune" in message
    assert "trainer.experiment_name or trainer.default_local_dir, or remove them" in message
    assert ("continue from global_step_4 with trainer.resume_mode=auto" in message) is complete
    assert snapshot(tmp / "ckpt") == before


def test_resuming_refuses_later_steps_it_would_overwrite_and_keeps_its_own_history(tmp):
    write_checkpoint(tmp, 2)
    write_checkpoint(tmp, 4)
    trainer = Trainer(pipeline(tmp))  # auto: the newest, with the older one as its own history
    assert trainer.resume.path == tmp / "ckpt" / "global_step_4" and trainer.step == 4
    assert trainer.loader.state_dict()["position"] == 16
    message = refused(tmp, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={tmp}/ckpt/global_step_2")
    assert "trainer.resume_from_path: " in message and "already holds global_step_4, which this run, resumed at step 2," in message


def test_resume_path_needs_resume_from_path(tmp):
    message = refused(tmp, "trainer.resume_mode=resume_path")
    assert message.startswith(f"{tmp}/p.yaml:") and "trainer.resume_from_path: is required when trainer.resume_mode " \
        "is resume_path; expected the path of a checkpoint folder" in message


def _state(folder: Path, **changes) -> None:
    f = folder / checkpoint.STATE_FILE
    state = json.loads(f.read_text())
    state.update(changes)
    f.write_text(json.dumps({k: v for k, v in state.items() if v is not None}))


DAMAGE = {  # what goes wrong -> (where the message points, what it says)
    "no engine folder": (lambda c: shutil.rmtree(c / "actor_update"),
                         "actor_update", "the checkpoint folder of node 'actor_update' does not exist"),
    "empty engine folder": (lambda c: [p.unlink() for p in (c / "actor_update").iterdir()],
                            "actor_update", "lacks metadata.json, .metadata, common.pt, *.distcp"),
    "no metadata.json": (lambda c: (c / "actor_update" / "metadata.json").unlink(), "actor_update", "lacks metadata.json;"),
    "no .metadata": (lambda c: (c / "actor_update" / ".metadata").unlink(), "actor_update", "lacks .metadata;"),
    "no loader": (lambda c: _state(c, loader=None), "trainer_state.json", "lacks the mapping(s) loader"),
    "step true": (lambda c: _state(c, step=True), "trainer_state.json", "has step True, not a non-negative 64-bit integer"),
    "step negative": (lambda c: _state(c, step=-5), "trainer_state.json", "has step -5"),
    "step huge": (lambda c: _state(c, step=10**400), "trainer_state.json", "has step 1000000000000000000000000000000000000000,"),
    "position out of range": (lambda c: _state(c, loader={**json.loads((c / "trainer_state.json").read_text())["loader"],
                                                          "position": 999}),
                              "trainer_state.json", "data loader state in"),
    "bad version": (lambda c: _state(c, versions={"actor_update": "2"}), "trainer_state.json", "has a weight version"),
    "not json": (lambda c: (c / "trainer_state.json").write_text("{"), "trainer_state.json", "is unreadable"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_checkpoint_is_refused_before_start_naming_the_file(tmp, damage):
    damage_fn, where, what = DAMAGE[damage]
    folder = write_checkpoint(tmp, 2)
    damage_fn(folder)
    message = refused(tmp)
    assert message.startswith(f"{folder / where}: trainer.resume_mode: ") and what in message, message


def test_a_checkpoint_of_another_model_is_refused_at_the_model(tmp):
    folder = write_checkpoint(tmp, 2)
    assert json.loads((folder / "trainer_state.json").read_text())["models"] == {"actor_update": {**MODEL, "lora": None}}
    (tmp / "model" / "config.json").write_text(json.dumps({**MODEL, "hidden_size": 64}))
    message = refused(tmp)
    assert message.startswith(f"{tmp}/p.yaml:4:12: models.policy.path: node 'actor_update' was trained from another "
                              f"model in checkpoint {folder} (hidden_size 128 then, 64 now)"), message
    _state(folder, models=None)  # written before the record existed: nothing to compare
    assert Trainer(pipeline(tmp)).step == 2


def test_a_checkpoint_of_other_adapters_or_of_the_whole_model_is_refused_at_lora(tmp):
    lora = "models.policy.lora={rank: 8, target_modules: [q_proj, k_proj, v_proj]}"
    folder = write_checkpoint(tmp, 2)  # the whole model trained
    message = refused(tmp, lora)
    assert message.startswith(f"<command line>: models.policy.lora: node 'actor_update' was trained from another model "
                              f"in checkpoint {folder} (lora None then, {{'rank': 8, 'targets': ['k_proj', 'q_proj', "
                              "'v_proj']} now)"), message
    shutil.rmtree(tmp / "ckpt")
    trainer = Trainer(pipeline(tmp, f"trainer.default_local_dir={tmp}/staging", lora))
    trainer.rt, trainer.step, trainer.ckpt_dir = FakeRuntime(), 2, tmp / "ckpt"
    folder = trainer.save()
    assert sorted(p.name for p in folder.iterdir()) == ["actor_update", "actor_update.lora", "trainer_state.json"]
    other = refused(tmp, lora.replace("rank: 8", "rank: 16"))
    assert "(lora {'rank': 8, 'targets': ['k_proj', 'q_proj', 'v_proj']} then, {'rank': 16, " in other, other
    assert Trainer(pipeline(tmp, lora)).step == 2  # the same adapters resume


@pytest.mark.parametrize("override, key, what", [("data.seed=2", "data.seed", "seed 1 then, 2 now"),
                                                 ("data.shuffle=false", "data.shuffle", "shuffle True then, False now")])
def test_changed_data_settings_are_refused_at_their_key(tmp, override, key, what):
    folder = write_checkpoint(tmp, 2)
    message = refused(tmp, override)
    assert message.startswith(f"<command line>: {key}: checkpoint {folder} cannot resume with this data: {what}"), message


def test_changed_data_files_are_refused_at_train_files(tmp):
    folder = write_checkpoint(tmp, 2)
    write_data(tmp, 24)
    message = refused(tmp)
    assert message.startswith(f"{tmp}/p.yaml:6:3: data.train_files: checkpoint {folder} cannot resume with this data: "
                              "num_rows 20 then, 24 now"), message


def test_an_engine_that_cannot_load_fails_as_one_line(tmp):
    """A truncated shard shows only when the engines load: a PipelineError (exit 1), no traceback."""
    from torch.distributed.checkpoint.api import CheckpointException

    folder = write_checkpoint(tmp, 2)
    trainer = Trainer(pipeline(tmp))
    assert trainer.resume.path == folder
    # what torch's loader raises for a shard cut short: a BaseException, carrying each rank's traceback
    with pytest.raises(PipelineError) as err:
        trainer._restore_engines(FakeRuntime(fail=CheckpointException("read", {0: (EOFError(), traceback.extract_stack())})))
    assert str(err.value).startswith(f"resuming from {folder}: node 'actor_update' could not load "
                                     f"{(folder / 'actor_update').resolve()} (CheckpointException: EOFError); "
                                     "expected an intact checkpoint")
    assert "Traceback" not in str(err.value) and "\n" not in str(err.value)


def test_the_cli_refuses_with_exit_2_and_loses_nothing(tmp, tiny_model_dir):
    write_checkpoint(tmp, 2)
    before = snapshot(tmp / "ckpt")
    res = subprocess.run([sys.executable, "-m", "siirl_dag.main", str(tmp / "p.yaml"), f"models.policy.path={tiny_model_dir}",
                          "trainer.resume_mode=disable"],
                         capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], timeout=300)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.splitlines()[-2:] == [
        f"<command line>: trainer.resume_mode: checkpoint folder {tmp}/ckpt already holds global_step_2, which this fresh "
        "run would overwrite or prune; expected a folder of its own: continue from global_step_2 with "
        "trainer.resume_mode=auto, or set a new trainer.experiment_name or trainer.default_local_dir, or remove them "
        "(set by override 'trainer.resume_mode=disable')", "1 error(s); nothing was started."]
    assert snapshot(tmp / "ckpt") == before
