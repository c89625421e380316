"""Rule-based scorers, score placement and the KL-in-reward penalty."""

import pytest
import torch

from nodes.algos.scorers import extract_gsm8k_answer, gsm8k_score, math_score, resolve_scorer, score
from nodes.algos.token_rewards import apply_kl_penalty, place_scores


@pytest.mark.parametrize("text, truth, expected", [
    ("so the total is 1,234 #### 1,234", "1234", 1.0),
    ("#### $1,000", "1000", 1.0),
    ("Q: 23+58=? A:####81", "81", 1.0),   # no space after ####
    ("#### 72.0", "72", 1.0),              # compared as numbers
    ("#### -3", "-3", 1.0),
    ("#### 5 ... actually #### 7", "7", 1.0),  # the last #### counts
    ("#### 5 ... actually #### 7", "5", 0.0),
    ("the answer is 72", "72", 0.0),       # strict needs ####
    ("#### seventy", "70", 0.0),
])
def test_gsm8k_strict(text, truth, expected):
    assert gsm8k_score(text, truth) == expected


def test_gsm8k_flexible_and_format_score():
    assert extract_gsm8k_answer("The answer is 42.", "flexible") == "42"
    assert gsm8k_score("The answer is 1,042.", "1042", method="flexible") == 1.0
    assert gsm8k_score("#### 71", "72", format_score=0.1) == 0.1  # extracted but wrong
    assert gsm8k_score("no number", "72", format_score=0.1) == 0.0  # nothing extracted
    with pytest.raises(ValueError, match="strict"):
        gsm8k_score("#### 1", "1", method="fuzzy")


@pytest.mark.parametrize("text, truth, expected", [
    ("thus \\boxed{\\dfrac{1}{2}}.", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{\\sqrt{2}}{2}", 1.0),   # nested braces
    ("\\boxed{ 3. }", "3", 1.0),
    ("\\boxed{0.5}", "0.50", 1.0),                                       # numeric equality
    ("\\boxed{\\left( 1,2 \\right)}", "(1,2)", 1.0),
    ("\\boxed{10^{\\circ}}", "10", 1.0),
    ("\\boxed{\\!5}", "\\boxed{5}", 1.0),                                # boxed ground truth
    ("first \\boxed{1} then \\boxed{2}", "2", 1.0),                      # the last box counts
    ("first \\boxed{1} then \\boxed{2}", "1", 0.0),
    ("the answer is 4", "4", 0.0),                                       # no box
    ("\\boxed{\\frac{1}{3}", "\\frac{1}{3}", 0.0),                       # unbalanced
])
def test_math(text, truth, expected):
    assert math_score(text, truth) == expected


def test_score_dispatch_by_data_source():
    assert score("demo/arith", " #### 81", "81") == 1.0
    assert score("openai/gsm8k", "about 81", "81", method="flexible") == 1.0
    assert score("lighteval/MATH", "\\boxed{2}", "2", extra_info={"split": "test"}) == 1.0
    with pytest.raises(ValueError, match="'my/data'.*openai/gsm8k.*lighteval/MATH"):
        score("my/data", "x", "1")


def test_resolve_scorer():
    assert resolve_scorer("nodes.algos.scorers:score") is score
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        resolve_scorer("no_such_module_xyz:fn")
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        resolve_scorer("nodes.algos.scorers:nope")
    with pytest.raises(ValueError, match="not a callable"):
        resolve_scorer("math:pi")
    with pytest.raises(ValueError, match="module:function"):
        resolve_scorer("nodes.algos.scorers.score")


def test_place_scores_on_last_token():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1], [1, 0, 0]])
    out = place_scores(torch.tensor([1.0, 2.0, 3.0, 4.0]), mask)
    assert out.tolist() == [[0, 1, 0], [0, 0, 0], [0, 0, 3], [4, 0, 0]]  # zero-length row stays empty
    assert out.dtype == torch.float32
    assert place_scores([0.5], torch.tensor([[1, 0]])).tolist() == [[0.5, 0.0]]


def test_apply_kl_penalty():
    scores = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    old = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-2.0, -1.5, -9.0], [-1.0, -1.0, -9.0]])  # -9.0 on padding must not count
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    rewards, kl_mean = apply_kl_penalty(scores, old, ref, mask, kl_coef=0.1, estimator="kl")
    # k1 = [1, 0.5] and [0, 0]; rewards = scores - 0.1 k1; kl_mean = mean(0.75, 0)
    assert rewards.tolist()[0] == pytest.approx([-0.1, 0.95, 0.0])
    assert rewards.tolist()[1] == pytest.approx([0.0, 0.0, 0.0])
    assert kl_mean == pytest.approx(0.375)


def test_overlong_penalty_falls_linearly_over_the_buffer():
    from nodes.algos.token_rewards import overlong_penalty

    lengths = torch.tensor([4, 6, 7, 8, 10])  # limit 10, buffer 4: free up to 6 tokens
    mask = (torch.arange(10)[None] < lengths[:, None]).long()
    assert overlong_penalty(mask, 10, 4, factor=0.5).tolist() == [0.0, 0.0, -0.125, -0.25, -0.5]
