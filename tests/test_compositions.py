"""Compositions written as a new user would (tests/fixtures/compose, run end to end in test_e2e_compose):
each validates and reads what its picture says; the same chain with deps alone is refused with `from:`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeline_files import messages
from siirl_dag.config import load_pipeline

COMPOSE = Path(__file__).parent / "fixtures" / "compose"


@pytest.mark.parametrize("name", ["chain_of_three", "judge_rule_teacher", "judge_ref_colocated"])
def test_each_composition_validates(name):
    pipe = load_pipeline(COMPOSE / f"{name}.yaml", [])
    assert pipe.plan is not None


def test_a_chain_reads_each_link_from_the_one_before_and_trains_each_policy_on_its_own_samples():
    pipe = load_pipeline(COMPOSE / "chain_of_three.yaml", [])
    assert pipe.policies == ("drafter", "editor", "finisher")
    assert pipe.reads["editor"]["responses"] == ("drafter", "responses")
    assert pipe.reads["finisher"]["responses"] == ("editor", "responses")
    assert pipe.reads["final_reward"]["responses"] == ("finisher", "responses")
    for policy in pipe.policies:
        update = f"{policy}_update"
        assert {pipe.reads[update][k][0] for k in ("input_ids", "responses", "response_mask")} == {policy}
        assert pipe.reads[update]["advantages"][0] == f"{policy}_advantage"
        assert pipe.reads[f"{policy}_advantage"]["token_level_rewards"][0] == "final_reward"
        assert pipe.metric_prefix(update) == f"{policy}/"
    assert pipe.samples_per_prompt("finisher_update") == 4  # the drafter's 4 samples, answered once each


def test_a_student_reads_the_summed_reward_its_own_and_the_teachers_log_probs():
    pipe = load_pipeline(COMPOSE / "judge_rule_teacher.yaml", [])
    reads = pipe.reads["advantage"]
    assert (reads["token_level_rewards"][0], reads["old_logprobs"][0], reads["teacher_logprobs"][0]) == \
           ("reward", "old", "teacher")


def test_the_chain_with_deps_alone_is_refused_with_the_from_line_that_fixes_it(tmp_path):
    written = (COMPOSE / "chain_of_three.yaml").read_text().replace(" from: [", " deps: [")
    text = re.sub(r"(?<!\w)from: (\w+)", r"deps: [\1]", written)
    msg = messages(tmp_path, text)
    assert "'finisher' consumes 'responses', produced by several upstream nodes (drafter, editor); " \
           "expected exactly one: say which with `from: editor`" in msg
    assert "'drafter_update' consumes 'input_ids'" in msg
    fixed = text.replace("{id: finisher, kind: rollout, deps: [editor]", "{id: finisher, kind: rollout, from: editor")
    assert "'finisher' consumes" not in messages(tmp_path, fixed)
