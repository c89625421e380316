"""Composed pipelines end to end through real vLLM, Megatron and Ray: two policies trained together one
step off, checkpointed and resumed for a third step under async (the shipped tiny_two_agents_cpu graph), and
ones written as a new user would with `from:` (tests/fixtures/compose: three policies in a chain; a student of
a judge on its own mesh, a rule and a teacher, which stands in for the shipped judge and distillation graphs,
themselves validated in test_config; a judge and the reference beside the rollout). The models are the
session's tiny random one (the graphs' own runs, which learn, are benchmarks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
COMPOSE = "tests/fixtures/compose"


def run_graph(tmp_path, graph: str, models: list[str], model_dir: str, data, *overrides) -> dict:
    common = [f"models.{m}.path={model_dir}" for m in models] + [
        f"data.train_files={data}/train.parquet", f"data.val_files={data}/test.parquet", "data.train_batch_size=8",
        "trainer.total_steps=2", "trainer.save_freq=2", "trainer.logger=[tensorboard]",
        f"trainer.default_local_dir={tmp_path}/ckpt", f"trainer.tensorboard_dir={tmp_path}/tb",
        f"trainer.log_dir={tmp_path}/logs", "runtime.verify_probe_every=1"]
    path = graph if "/" in graph else f"graphs/{graph}.yaml"
    res = subprocess.run([sys.executable, "-m", "siirl_dag.main", path, "--json", *common, *overrides],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout)


POLICY_METRICS = ("actor/pg_loss", "actor/grad_norm", "critic/advantages/mean")
TWO_AGENTS = ["solver", "reviewer"]
TWO_AGENTS_BATCHES = ["nodes.solver_update.params.mini_batch_size=8", "nodes.reviewer_update.params.mini_batch_size=8"]


@pytest.mark.timeout(1200)  # two runs, the second resuming the first's checkpoint
def test_two_agents_train_one_step_off_with_their_names_and_checkpoints(tmp_path, tiny_model_dir, demo_data):
    history = run_graph(tmp_path, "tiny_two_agents_cpu", TWO_AGENTS, tiny_model_dir, demo_data, *TWO_AGENTS_BATCHES,
                        "runtime.schedule=one_step_off")
    def both_trained(metrics: dict) -> None:
        for policy in TWO_AGENTS:
            assert {f"{policy}/{name}" for name in (*POLICY_METRICS, "critic/score/mean")} <= set(metrics)
        assert 0 <= metrics["async/staleness/max"] <= 1  # each policy's samples at most one version old

    for metrics in history["steps"].values():
        both_trained(metrics)
    last = history["steps"]["2"]
    for policy in TWO_AGENTS:
        for name in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "critic/advantages/mean",
                     "val-core/demo/arith/acc"):
            assert f"{policy}/{name}" in last, (policy, name, sorted(last))
    assert not any(k.startswith(("actor/", "critic/", "val-core/")) for k in last)  # nothing unnamed, nothing lost
    assert "reviewer/rollout/prompts_cut" in last and "timing_s/reviewer" in last
    step = tmp_path / "ckpt" / "global_step_2"
    for trainer in ("solver_update", "reviewer_update"):
        assert (step / trainer / "metadata.json").is_file() and (step / f"{trainer}.hf" / "config.json").is_file()
    # a third step, under async, resumes both policies from the checkpoint one_step_off wrote at step 2
    resumed = run_graph(tmp_path, "tiny_two_agents_cpu", TWO_AGENTS, tiny_model_dir, demo_data, *TWO_AGENTS_BATCHES,
                        "runtime.schedule=async", "trainer.total_steps=3", "trainer.resume_mode=auto",
                        "trainer.val_before_train=false")
    assert list(resumed["steps"]) == ["3"]
    both_trained(resumed["steps"]["3"])


def test_a_chain_of_three_policies_trains_each_on_the_final_answer(tmp_path, tiny_model_dir, demo_data):
    chain = ["drafter", "editor", "finisher"]
    history = run_graph(tmp_path, f"{COMPOSE}/chain_of_three.yaml", chain, tiny_model_dir, demo_data, "trainer.save_freq=0")
    for metrics in history["steps"].values():
        for policy in chain:
            assert {f"{policy}/{name}" for name in POLICY_METRICS} <= set(metrics), (policy, sorted(metrics))
            assert f"sync/{policy}/bytes" in metrics  # each policy's weights reach its own rollout
        assert {"editor/rollout/prompts_cut", "finisher/rollout/prompts_cut", "finisher/critic/score/mean"} <= set(metrics)
    assert "finisher/val-core/demo/arith/acc" in history["steps"]["2"]


def test_a_student_of_a_judge_a_rule_and_a_teacher(tmp_path, tiny_model_dir, demo_data):
    from make_tiny_model import make_tiny_model

    teacher = make_tiny_model(tmp_path / "teacher", seed=1)
    history = run_graph(tmp_path, f"{COMPOSE}/judge_rule_teacher.yaml", ["student", "judge"], tiny_model_dir,
                        demo_data, f"models.teacher.path={teacher}", "trainer.save_freq=0")
    for metrics in history["steps"].values():
        assert {"reward_sum/rule/mean", "reward_sum/judge/mean", "judge/score/mean", "judge/parse_failures",
                "judge/overlong", "timing_s/judge", "timing_s/teacher", *POLICY_METRICS} <= set(metrics), sorted(metrics)
        # a random judge replies with anything: what it says no score with gets the default (0), never an error
        assert 0 <= metrics["judge/parse_failures"] <= 8 * 4
        # log p_student - log p_teacher of the student's own samples: positive on average (Gibbs); in the advantage
        assert metrics["distill/reverse_kl"] > 0.01
        assert metrics["actor/grad_norm"] > 0
    assert "val-core/demo/arith/acc" in history["steps"]["2"]


def test_a_judge_and_the_reference_beside_the_rollout(tmp_path, tiny_model_dir, demo_data):
    history = run_graph(tmp_path, f"{COMPOSE}/judge_ref_colocated.yaml", ["policy", "judge"], tiny_model_dir, demo_data,
                        "trainer.save_freq=0")
    for metrics in history["steps"].values():
        assert {"judge/score/mean", "actor/kl_loss", "timing_s/ref", *POLICY_METRICS} <= set(metrics)
