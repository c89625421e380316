"""Losses against hand-computed numbers (small tensors, values written out)."""

import math

import pytest
import torch

from nodes.algos.losses import agg_loss, kl_penalty, policy_loss, ppo_actor_loss, ppo_critic_loss, value_loss

# Per-token loss with padding set to 100 so any leak of padding shows up.
LOSS = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 100.0, 100.0, 100.0], [100.0, 100.0, 100.0, 100.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])  # lengths 3, 1, 0


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", 2.5),               # (1+2+3+4)/4
    ("seq-mean-token-sum", 5.0),       # (6+4)/2, empty row not counted
    ("seq-mean-token-mean", 3.0),      # (6/3 + 4/1)/2
    ("seq-mean-token-sum-norm", 1.25),  # (6/4 + 4/4)/2, divisor = R = 4
])
def test_agg_loss_modes(mode, expected):
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_agg_loss_norm_constant_and_unknown_mode():
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_constant=2.0).item() == pytest.approx(2.5)  # (3+2)/2
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(LOSS, MASK, "sum")


def test_agg_loss_all_empty_is_zero_not_nan():
    empty = torch.zeros(2, 3, dtype=torch.long)
    for mode in ("token-mean", "seq-mean-token-mean"):
        assert agg_loss(torch.ones(2, 3), empty, mode).item() == 0.0


@pytest.mark.parametrize("estimator, forward, backward", [
    # logp - ref = +1 (forward), -1 (backward)
    ("kl", 1.0, -1.0), ("k1", 1.0, -1.0),
    ("mse", 0.5, 0.5), ("k2", 0.5, 0.5),
    ("abs", 1.0, 1.0),
    ("low_var_kl", 0.36787944117, 0.71828182846),  # e^-1 - (-1) - 1 ; e^1 - 1 - 1
    ("k3", 0.36787944117, 0.71828182846),
])
def test_kl_estimators(estimator, forward, backward):
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-2.0, -1.0]])
    out = kl_penalty(logp, ref, estimator)
    assert out[0, 0].item() == pytest.approx(forward, abs=1e-6)
    assert out[0, 1].item() == pytest.approx(backward, abs=1e-6)


def test_low_var_kl_clamped_to_10_and_unknown_estimator():
    out = kl_penalty(torch.tensor([0.0, -30.0]), torch.tensor([-30.0, 0.0]), "low_var_kl")
    assert out.tolist() == [10.0, 10.0]
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


# Four real tokens (two rows of two) + one padding column with absurd values.
#   tok  A   ratio  -A*r   -A*clip(r,.8,1.2)  max    dual (bound -3A for A<0)
#   t1   1   1.5    -1.5   -1.2               -1.2   (clipped)
#   t2   1   0.5    -0.5   -0.8               -0.5
#   t3  -1   0.5     0.5    0.8                0.8   (clipped) bound 3 -> 0.8
#   t4  -1   5.0     5.0    1.2                5.0   bound 3 -> 3.0 (lower clip)
ADV = torch.tensor([[1.0, 1.0, 100.0], [-1.0, -1.0, 100.0]])
RATIO = torch.tensor([[1.5, 0.5, 50.0], [0.5, 5.0, 50.0]])
OLD = torch.zeros(2, 3)
NEW = RATIO.log()
PMASK = torch.tensor([[1, 1, 0], [1, 1, 0]])


def test_policy_loss_clip_and_dual_clip():
    pg_loss, clipfrac, ppo_kl, clipfrac_lower = policy_loss(NEW, OLD, ADV, PMASK, clip_ratio_low=0.2, clip_ratio_high=0.2,
                                                            clip_ratio_c=3.0)
    assert pg_loss.item() == pytest.approx(0.525)  # (-1.2 - 0.5 + 0.8 + 3.0) / 4
    assert clipfrac.item() == pytest.approx(0.5)
    assert clipfrac_lower.item() == pytest.approx(0.25)
    assert ppo_kl.item() == pytest.approx(-0.157152165, abs=1e-6)  # -ln(1.5*0.5*0.5*5)/4


def test_policy_loss_asymmetric_clip_and_no_dual_clip():
    high, *_ = policy_loss(NEW, OLD, ADV, PMASK, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    assert high.item() == pytest.approx(0.505)  # t1 clipped at 1.28: (-1.28 - 0.5 + 0.8 + 3) / 4
    plain, _, _, lower = policy_loss(NEW, OLD, ADV, PMASK, clip_ratio_c=None)
    assert plain.item() == pytest.approx(1.025)  # (-1.2 - 0.5 + 0.8 + 5) / 4
    assert lower.item() == 0.0
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(NEW, OLD, ADV, PMASK, clip_ratio_c=1.0)


def test_policy_loss_seq_mean_token_mean():
    loss, *_ = policy_loss(NEW, OLD, ADV, PMASK, loss_agg_mode="seq-mean-token-mean")
    assert loss.item() == pytest.approx(0.525)  # rows: (-1.7/2 + 3.8/2) / 2
    loss, *_ = policy_loss(NEW, OLD, ADV, PMASK, loss_agg_mode="seq-mean-token-sum")
    assert loss.item() == pytest.approx(1.05)  # (-1.7 + 3.8) / 2


def test_value_loss_clipping():
    #  v    old  R    clip(v)  (v-R)^2  (clip-R)^2  max
    #  2.0  1.0  0.0  1.5      4.0      2.25        4.0
    #  2.0  1.0  3.0  1.5      1.0      2.25        2.25 (clipped)
    #  0.2  0.0  1.0  0.2      0.64     0.64        0.64
    v = torch.tensor([[2.0, 2.0, 0.2, 7.0]])
    old = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    ret = torch.tensor([[0.0, 3.0, 1.0, -9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    vf_loss, clipfrac = value_loss(v, old, ret, mask, cliprange_value=0.5)
    assert vf_loss.item() == pytest.approx(0.5 * 6.89 / 3)
    assert clipfrac.item() == pytest.approx(1 / 3)
    loss, metrics = ppo_critic_loss(v, old, ret, mask, cliprange_value=0.5)
    assert metrics["critic/vf_loss"] == pytest.approx(loss.item())
    assert metrics["critic/vpred_mean"] == pytest.approx(4.2 / 3)


def test_actor_loss_combines_entropy_and_kl_and_reports_metrics():
    entropy = torch.tensor([[1.0, 2.0, 99.0], [3.0, 4.0, 99.0]])  # token mean 2.5
    ref = NEW - 0.5  # k1 = 0.5 on every token
    logprobs = NEW.clone().requires_grad_(True)
    loss, m = ppo_actor_loss(logprobs, OLD, ADV, PMASK, entropy, ref,
                             clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, loss_agg_mode="token-mean",
                             entropy_coeff=0.1, use_kl_loss=True, kl_loss_coef=0.2, kl_loss_type="kl")
    assert loss.item() == pytest.approx(0.525 - 0.1 * 2.5 + 0.2 * 0.5)
    assert m["actor/pg_loss"] == pytest.approx(0.525)
    assert m["actor/pg_clipfrac"] == pytest.approx(0.5)
    assert m["actor/ppo_kl"] == pytest.approx(-math.log(1.875) / 4, abs=1e-6)
    assert m["actor/kl_loss"] == pytest.approx(0.5)
    assert m["actor/entropy"] == pytest.approx(2.5)
    loss.backward()
    assert logprobs.grad[:, 2].abs().sum().item() == 0.0  # padding gets no gradient
    assert logprobs.grad[0, 1].item() != 0.0


def test_actor_loss_refuses_missing_inputs():
    with pytest.raises(ValueError, match="ref_logprobs"):
        ppo_actor_loss(NEW, OLD, ADV, PMASK, use_kl_loss=True)
    with pytest.raises(ValueError, match="entropy"):
        ppo_actor_loss(NEW, OLD, ADV, PMASK, entropy_coeff=0.01)
    _, m = ppo_actor_loss(NEW, OLD, ADV, PMASK)
    assert "actor/kl_loss" not in m and "actor/entropy" not in m
