"""The pure helpers of scripts/make_compose_task.py (no model is trained here)."""

import numpy as np
import pytest

from make_compose_task import (JUDGE_TEMPLATE, judge_example, judge_examples, judge_label, malformed, near_miss,
                               reference_loss, weak_response)
from nodes.algos.scorers import gsm8k_score


@pytest.mark.parametrize("response, truth, label", [
    (" #### 81", "81", " 1"), (" #### 80", "81", " 0"), (" #### 811", "81", " 0"), (" 81", "81", " 0"),
    ("", "81", " 0"), (" #### 12 #### 81", "81", " 1"), (" #### 81 #### 12", "81", " 0"), (" ####81x", "81", " 1"),
])
def test_judge_label_follows_the_grader(response, truth, label):
    assert judge_label(response, truth) == label


def test_judge_example_renders_the_pipeline_template():
    prompt, completion, truth = judge_example("Q: 23+58=? A:", " #### 80", "81")
    assert prompt == " #### 80 R: 81 V:" == JUDGE_TEMPLATE.format(
        prompt="Q: 23+58=? A:", response=" #### 80", ground_truth="81")
    assert (completion, truth) == (" 0", "0")


def test_reference_loss_moves_the_reference_into_the_completion():
    example = judge_example("Q: 23+58=? A:", " #### 80 R: 5", "81")  # " R:" inside the response too
    prompt, completion, label = reference_loss(example)
    assert (prompt, completion, label) == (" #### 80 R: 5 R:", " 81 V: 0", "0")
    assert prompt + completion == example[0] + example[1]


def test_near_misses_and_malformed_responses_are_mostly_wrong():
    rng = np.random.default_rng(0)
    misses = [near_miss(rng, 81) for _ in range(500)]
    assert all(m >= 0 for m in misses) and sum(m != 81 for m in misses) > 450 and {80, 82, 71, 91, 18, 8} <= set(misses)
    bad = [malformed(rng, 81, 80) for _ in range(500)]
    assert "" in bad and sum(gsm8k_score(b, "81") for b in bad) < 250 and len(set(bad)) > 100


def test_weak_responses_are_right_about_as_often_as_asked():
    rng = np.random.default_rng(1)
    right = np.mean([gsm8k_score(weak_response(rng, 81, p_right=0.2), "81") for _ in range(2000)])
    assert 0.1 < right < 0.25


def test_judge_examples_are_balanced():
    rng = np.random.default_rng(2)
    questions = [(f"Q: {a}+{b}=? A:", "", str(a + b)) for a in range(10) for b in range(10)]
    examples = judge_examples(rng, questions, 200)
    assert [label for _, _, label in examples].count("1") == 100 and len(examples) == 200
    assert all(p.endswith(" V:") and c == f" {label}" for p, c, label in examples)
