"""agent_rollout through the real stack (vLLM turns, the calculator, Megatron, Ray): a model warm-started
to call the calculator calls it, and the trainer's log-probs over rows with the tool's answers masked
equal vLLM's (token in, token out: nothing re-tokenized, nothing shifted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def agent_task(tmp_path_factory) -> Path:
    from make_agent_task import make_task

    out = tmp_path_factory.mktemp("agent")
    make_task(out, target=0.0, min_calls=0.9)  # the call format learnt; the sums need not be right yet
    return out


def run_agent(folder: Path, task: Path, *extra: str) -> dict:
    """The agent demo's pipeline, 2 steps on the session's task, cooler sampling than the demo's (a barely
    warm model then calls its tool), the trainer at the same temperature; its steps' metrics."""
    overrides = [f"models.policy.path={task / 'model'}", f"data.train_files={task / 'train.parquet'}",
                 f"data.val_files={task / 'test.parquet'}", "trainer.total_steps=2", "trainer.val_before_train=false",
                 "trainer.export_hf=false", f"trainer.default_local_dir={folder / 'ckpt'}",
                 f"trainer.tensorboard_dir={folder / 'tb'}", f"trainer.log_dir={folder / 'logs'}",
                 "nodes.actor_update.params.rollout_is=token", "trainer.logger=[tensorboard]",
                 "nodes.rollout.options.temperature=0.5", "nodes.old_logprob.params.temperature=0.5",
                 "nodes.ref_logprob.params.temperature=0.5", "nodes.actor_update.params.temperature=0.5",
                 "trainer.project_name=agent", "trainer.experiment_name=e2e", *extra]
    res = subprocess.run([sys.executable, "-m", "siirl_dag.main", str(ROOT / "graphs" / "tiny_agent_tools_cpu.yaml"),
                          "--json", *overrides], capture_output=True, text=True, timeout=600, cwd=folder)
    assert res.returncode == 0, res.stderr[-3000:]
    steps = json.loads(res.stdout)["steps"]
    for step in steps.values():
        assert step["agent/tool_calls/mean"] > 0 and step["agent/turns/max"] == 2 and step["agent/turns/mean"] > 1
        assert "agent/tool_time_s/mean" in step and "agent/tool_errors/mean" in step
    assert "val-core/demo/agent_sum/acc" in steps["2"]
    return steps


def test_agent_pipeline_calls_tools_and_trains_on_the_models_tokens(tmp_path, agent_task):
    steps = run_agent(tmp_path, agent_task, "trainer.log_trajectories=3")
    for step in steps.values():
        assert step["rollout_corr/log_ppl_abs_diff"] < 1e-4  # the trainer's log-probs are vLLM's, tool spans masked
    logged = [json.loads(line) for line in (tmp_path / "outputs/agent/e2e/trajectories.jsonl").read_text().splitlines()]
    assert len(logged) == 3 and all(row["step"] == 2 and row["prompt"] and row["response"] for row in logged)
    assert any(part["by"] == "tool" for row in logged for part in row["response"])  # an observation, not trained on
    assert all(row["model_tokens"] > 0 and (row["tool_tokens"] > 0) == any(p["by"] == "tool" for p in row["response"])
               for row in logged)


def test_agent_rollouts_one_step_off(tmp_path, agent_task):
    """The next step's agent rollouts (tool calls included) run while this step trains."""
    steps = run_agent(tmp_path, agent_task, "runtime.schedule=one_step_off", "runtime.staleness=1")
    assert [steps[s]["async/staleness/max"] for s in ("1", "2")] == [0, 1]
