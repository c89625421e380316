"""Advantage estimators and batch metrics against hand-computed numbers."""

import pytest
import torch

from nodes.algos.advantages import ESTIMATORS, compute_advantage, discounted_returns
from nodes.algos.metrics import batch_metrics, mixed_groups, varied_groups

# Six samples: prompt a x3 (scores 1, 0, 0), b x2 (1, 1), c x1 (1); the score sits on the last token.
INDEX = ["a", "a", "a", "b", "b", "c"]
MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]])
REWARDS = torch.tensor([[0, 0, 1.0], [0, 0, 0], [0, 0, 0], [0, 0, 1.0], [1.0, 0, 0], [0, 1.0, 0]])


def per_sample(adv):
    """Check the advantage is constant over each response and zero on padding; return the constants."""
    first = adv[:, 0]
    assert torch.equal(adv, first.unsqueeze(1) * MASK)
    return first.tolist()


def test_grpo_normalised_by_group_std():
    adv, ret = compute_advantage("grpo", REWARDS, MASK, index=INDEX)
    # group a: mean 1/3, unbiased std sqrt(1/3): (2/3)/0.57735 = 1.1547, (-1/3)/0.57735 = -0.57735
    # group b: identical scores -> 0; group c: one sample -> mean 0, std 1 (verl) -> 1/(1+1e-6)
    assert per_sample(adv) == pytest.approx([1.1547005, -0.5773503, -0.5773503, 0.0, 0.0, 1.0], abs=1e-5)
    assert torch.equal(adv, ret)


def test_dr_grpo_without_std():
    adv, _ = compute_advantage("grpo", REWARDS, MASK, index=INDEX, norm_by_std=False)
    assert per_sample(adv) == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 1.0], abs=1e-6)


def test_rloo_leave_one_out():
    adv, _ = compute_advantage("rloo", REWARDS, MASK, index=INDEX)
    # a: 1 - mean(0,0) = 1; 0 - mean(1,0) = -0.5 (twice); b: 1 - 1 = 0; c alone keeps its score
    assert per_sample(adv) == pytest.approx([1.0, -0.5, -0.5, 0.0, 0.0, 1.0])
    rewards = torch.tensor([[3.0], [1.0]])
    adv, _ = compute_advantage("rloo", rewards, torch.ones(2, 1, dtype=torch.long), index=[7, 7])
    assert adv.squeeze(1).tolist() == pytest.approx([2.0, -2.0])


def test_discounted_returns_and_reinforce_plus_plus():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 5.0]])  # 5.0 sits on padding: must not count
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    ret = discounted_returns(rewards, mask, gamma=0.5)
    assert ret.tolist() == [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]]
    adv, ret2 = compute_advantage("reinforce_plus_plus", rewards, mask, gamma=0.5)
    assert torch.equal(ret, ret2)
    # whitened over the 5 real tokens: mean 0.95, unbiased std sqrt(0.45)
    assert adv[mask.bool()].tolist() == pytest.approx([-1.0434984, -0.6708204, 0.0745356, 0.0745356, 1.5652476], abs=1e-5)
    assert adv[1, 2].item() == 0.0


def test_reinforce_plus_plus_baseline():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 2.0], [2.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 0]])
    adv, _ = compute_advantage("reinforce_plus_plus_baseline", rewards, mask, index=["a", "a", "b", "b"])
    # minus group mean: 0.5, -0.5, 0, 0 -> tokens [.5 .5 -.5 0 0 0], whitened (mean 1/12, std 0.376386)
    assert adv[mask.bool()].tolist() == pytest.approx([1.1070186, 1.1070186, -1.5498260, -0.2214037, -0.2214037, -0.2214037],
                                                      abs=1e-5)
    assert adv[1, 1].item() == 0.0 and adv[3, 1].item() == 0.0


def test_gae_skips_padding():
    rewards = torch.tensor([[0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.8, 9.0]])  # 9.0 on padding must not leak
    mask = torch.tensor([[1, 1, 0]])
    adv, ret = compute_advantage("gae", rewards, mask, values=values, gamma=0.9, lam=0.8)
    # t1: delta = 1 - 0.8 = 0.2; t0: delta = 0.9*0.8 - 0.5 = 0.22, gae = 0.22 + 0.72*0.2 = 0.364
    assert ret.tolist()[0] == pytest.approx([0.864, 1.0, 0.0])
    assert adv.tolist()[0] == pytest.approx([0.7071068, -0.7071068, 0.0], abs=1e-5)  # two values whitened


def test_compute_advantage_errors():
    assert set(ESTIMATORS) == {"grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae"}
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'.*grpo"):
        compute_advantage("ppo", REWARDS, MASK)
    with pytest.raises(ValueError, match="needs 'index'"):
        compute_advantage("grpo", REWARDS, MASK)
    with pytest.raises(ValueError, match="needs 'values'"):
        compute_advantage("gae", REWARDS, MASK)
    with pytest.raises(ValueError, match="no parameter lam.*norm_by_std"):
        compute_advantage("grpo", REWARDS, MASK, index=INDEX, lam=0.9)
    with pytest.raises(ValueError, match="6"):
        compute_advantage("grpo", REWARDS, MASK, index=INDEX[:5])


def test_batch_metrics_names_and_values():
    batch = {
        "response_mask": torch.tensor([[1, 1, 0], [1, 1, 1]]),
        "prompt_mask": torch.tensor([[0, 1], [1, 1]]),
        "token_level_scores": torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]),
        "token_level_rewards": torch.tensor([[0.0, 0.9, 0.0], [0.0, 0.0, -0.1]]),
        "advantages": torch.tensor([[0.5, 0.5, 7.0], [-0.5, -0.5, -0.5]]),
    }
    m = batch_metrics(batch)
    assert (m["critic/score/mean"], m["critic/score/max"], m["critic/score/min"]) == (0.5, 1.0, 0.0)
    assert m["critic/rewards/mean"] == pytest.approx(0.4)
    assert (m["critic/advantages/max"], m["critic/advantages/min"]) == (0.5, -0.5)  # 7.0 is padding
    assert (m["response_length/mean"], m["response_length/max"], m["response_length/clip_ratio"]) == (2.5, 3.0, 0.5)
    assert (m["prompt_length/min"], m["prompt_length/clip_ratio"]) == (1.0, 0.5)
    assert not any(k.startswith("critic/values") for k in m)


def test_batch_metrics_with_critic():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    values = torch.tensor([[0.0, 1.0, 5.0], [2.0, 5.0, 5.0]])
    m = batch_metrics({"response_mask": mask, "values": values, "returns": values.clone()})
    assert (m["critic/values/mean"], m["critic/values/max"]) == (1.0, 2.0)  # 5.0 is padding
    assert m["critic/vf_explained_var"] == pytest.approx(1.0)  # returns == values: all variance explained
    m = batch_metrics({"response_mask": mask, "values": values, "returns": torch.tensor([[1.0, 0.0, 0.0], [2.0, 0.0, 0.0]])})
    # residual r - v = [1, -1, 0] (var 1) against var(returns [1, 0, 2]) = 1 -> 1 - 1/1 = 0
    assert m["critic/vf_explained_var"] == pytest.approx(0.0, abs=1e-4)
    assert "prompt_length/mean" not in m and "critic/score/mean" not in m


def test_returns_carry_across_a_masked_span():
    """An agent's response: model tokens, a tool's answer (masked), model tokens; the final reward
    reaches the first turn's tokens as GAE's would, and the tool's tokens get none."""

    mask = torch.tensor([[1, 1, 0, 0, 1, 0]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0, 0.0]])
    assert discounted_returns(rewards, mask, 0.5).tolist() == [[0.25, 0.5, 0.0, 0.0, 1.0, 0.0]]


def test_mixed_groups_counts_the_prompts_whose_samples_differ():
    per_seq = REWARDS.sum(dim=-1).tolist()  # a: 1, 0, 0 (mixed); b: 1, 1 (all right); c: 1 (alone)
    assert varied_groups(per_seq, INDEX) == {"a"}
    assert mixed_groups(per_seq, INDEX) == pytest.approx(1 / 3)
    assert mixed_groups([0.0, 0.0, 1.0, 1.0], ["x", "x", "y", "y"]) == 0.0  # all wrong, all right: nothing to learn
    assert mixed_groups([0.5, 0.5 + 1e-9, 0.0, 1.0], ["x", "x", "y", "y"]) == 0.5  # a float's noise is no difference
    assert mixed_groups([], []) == 0.0
