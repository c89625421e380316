"""Composed pipelines end to end, two steps each, through real vLLM, Megatron and Ray: the shipped ones
(an LLM judge on its own mesh, on-policy distillation from a teacher, two policies trained together, also
under one_step_off and async) and ones written as a new user would with `from:` (tests/fixtures/compose:
three policies in a chain, a student of a judge, a rule and a teacher, a judge and the reference beside
the rollout). The models are the session's tiny random one (the graphs' own runs, which learn, are benchmarks)."""

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


def test_a_judge_on_its_own_mesh_is_the_reward(tmp_path, tiny_model_dir, demo_data):
    history = run_graph(tmp_path, "tiny_judge_cpu", ["policy", "judge"], tiny_model_dir, demo_data,
                        "nodes.actor_update.params.mini_batch_size=8")
    for metrics in history["steps"].values():
        assert {"judge/score/mean", "judge/parse_failures", "judge/overlong", "timing_s/judge",
                "critic/score/mean", "critic/advantages/mean", "actor/pg_loss"} <= set(metrics)
        # a random judge replies with anything: what it says no score with gets the default (0), never an error
        assert 0 <= metrics["judge/parse_failures"] <= 8 * 8
    assert "val-core/demo/arith/acc" in history["steps"]["2"]  # the rule's accuracy (trainer.val_score_key)


def test_distillation_from_a_teacher_logs_the_reverse_kl(tmp_path, tiny_model_dir, demo_data):
    from make_tiny_model import make_tiny_model

    teacher = make_tiny_model(tmp_path / "teacher", seed=1)  # another model of the same tokenizer
    history = run_graph(tmp_path, "tiny_distill_cpu", ["student"], tiny_model_dir, demo_data,
                        f"models.teacher.path={teacher}", "nodes.actor_update.params.mini_batch_size=8",
                        "nodes.actor_update.options.micro_batch_size=32")
    for metrics in history["steps"].values():
        # log p_student - log p_teacher of the student's own samples: positive on average (Gibbs)
        assert metrics["distill/reverse_kl"] > 0.01
        assert metrics["actor/grad_norm"] > 0 and "timing_s/teacher_logprob" in metrics


def test_two_agents_train_with_their_names_checkpoints_exports_and_resume(tmp_path, tiny_model_dir, demo_data):
    agents = ["nodes.solver_update.params.mini_batch_size=8", "nodes.reviewer_update.params.mini_batch_size=8"]
    history = run_graph(tmp_path, "tiny_two_agents_cpu", ["solver", "reviewer"], tiny_model_dir, demo_data, *agents)
    last = history["steps"]["2"]
    for policy in ("solver", "reviewer"):
        for name in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "critic/advantages/mean",
                     "val-core/demo/arith/acc"):
            assert f"{policy}/{name}" in last, (policy, name, sorted(last))
    assert not any(k.startswith(("actor/", "critic/", "val-core/")) for k in last)  # nothing unnamed, nothing lost
    assert "reviewer/rollout/prompts_cut" in last and "timing_s/reviewer" in last
    step = tmp_path / "ckpt" / "global_step_2"
    for trainer in ("solver_update", "reviewer_update"):
        assert (step / trainer / "metadata.json").is_file() and (step / f"{trainer}.hf" / "config.json").is_file()
    # a third step resumes both policies from the checkpoint of step 2
    resumed = run_graph(tmp_path, "tiny_two_agents_cpu", ["solver", "reviewer"], tiny_model_dir, demo_data, *agents,
                        "trainer.total_steps=3", "trainer.resume_mode=auto", "trainer.val_before_train=false")
    assert list(resumed["steps"]) == ["3"]
    assert {"solver/actor/pg_loss", "reviewer/actor/pg_loss"} <= set(resumed["steps"]["3"])


POLICY_METRICS = ("actor/pg_loss", "actor/grad_norm", "critic/advantages/mean")


@pytest.mark.parametrize("schedule", ["one_step_off", "async"])
def test_two_agents_train_ahead_of_their_rollouts(tmp_path, tiny_model_dir, demo_data, schedule):
    history = run_graph(tmp_path, "tiny_two_agents_cpu", ["solver", "reviewer"], tiny_model_dir, demo_data,
                        "nodes.solver_update.params.mini_batch_size=8", "nodes.reviewer_update.params.mini_batch_size=8",
                        f"runtime.schedule={schedule}", "trainer.save_freq=0")
    for metrics in history["steps"].values():
        for policy in ("solver", "reviewer"):
            assert {f"{policy}/{name}" for name in (*POLICY_METRICS, "critic/score/mean")} <= set(metrics)
        assert 0 <= metrics["async/staleness/max"] <= 1  # each policy's samples at most one version old


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
        assert {"reward_sum/rule/mean", "reward_sum/judge/mean", "judge/score/mean", *POLICY_METRICS} <= set(metrics)
        assert metrics["distill/reverse_kl"] > 0.01  # the distillation term is in the advantage
    assert "val-core/demo/arith/acc" in history["steps"]["2"]


def test_a_judge_and_the_reference_beside_the_rollout(tmp_path, tiny_model_dir, demo_data):
    history = run_graph(tmp_path, f"{COMPOSE}/judge_ref_colocated.yaml", ["policy", "judge"], tiny_model_dir, demo_data,
                        "trainer.save_freq=0")
    for metrics in history["steps"].values():
        assert {"judge/score/mean", "actor/kl_loss", "timing_s/ref", *POLICY_METRICS} <= set(metrics)
