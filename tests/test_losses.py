"""Losses against hand-computed numbers (small tensors, values written out)."""

import math

import pytest
import torch

from nodes.algos.losses import agg_loss, kl_penalty, policy_loss, ppo_actor_loss, ppo_critic_loss, value_loss
from nodes.algos.rollout_corr import correct
from nodes.algos.rollout_corr_settings import parse

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
    tokens, clipfrac, ppo_kl, clipfrac_lower = policy_loss(NEW, OLD, ADV, PMASK, clip_ratio_low=0.2, clip_ratio_high=0.2,
                                                           clip_ratio_c=3.0)
    assert agg_loss(tokens, PMASK, "token-mean").item() == pytest.approx(0.525)  # (-1.2 - 0.5 + 0.8 + 3.0) / 4
    assert clipfrac.item() == pytest.approx(0.5)
    assert clipfrac_lower.item() == pytest.approx(0.25)
    assert ppo_kl.item() == pytest.approx(-0.157152165, abs=1e-6)  # -ln(1.5*0.5*0.5*5)/4


def test_policy_loss_asymmetric_clip_and_no_dual_clip():
    high, *_ = policy_loss(NEW, OLD, ADV, PMASK, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    assert agg_loss(high, PMASK, "token-mean").item() == pytest.approx(0.505)  # t1 at 1.28: (-1.28 - .5 + .8 + 3) / 4
    plain, _, _, lower = policy_loss(NEW, OLD, ADV, PMASK, clip_ratio_c=None)
    assert agg_loss(plain, PMASK, "token-mean").item() == pytest.approx(1.025)  # (-1.2 - 0.5 + 0.8 + 5) / 4
    assert lower.item() == 0.0
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(NEW, OLD, ADV, PMASK, clip_ratio_c=1.0)


def test_actor_loss_seq_mean_modes():
    loss, _ = ppo_actor_loss(NEW, OLD, ADV, PMASK, loss_agg_mode="seq-mean-token-mean")
    assert loss.item() == pytest.approx(0.525)  # rows: (-1.7/2 + 3.8/2) / 2
    loss, _ = ppo_actor_loss(NEW, OLD, ADV, PMASK, loss_agg_mode="seq-mean-token-sum")
    assert loss.item() == pytest.approx(1.05)  # (-1.7 + 3.8) / 2
    loss, _ = ppo_actor_loss(NEW, OLD, ADV, PMASK, loss_agg_mode="token-sum")
    assert loss.item() == pytest.approx(2.1)  # -1.2 - 0.5 + 0.8 + 3.0


def test_value_loss_clipping():
    #  v    old  R    clip(v)  (v-R)^2  (clip-R)^2  max
    #  2.0  1.0  0.0  1.5      4.0      2.25        4.0
    #  2.0  1.0  3.0  1.5      1.0      2.25        2.25 (clipped)
    #  0.2  0.0  1.0  0.2      0.64     0.64        0.64
    v = torch.tensor([[2.0, 2.0, 0.2, 7.0]])
    old = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    ret = torch.tensor([[0.0, 3.0, 1.0, -9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    vf_tokens, clipfrac = value_loss(v, old, ret, mask, cliprange_value=0.5)
    assert agg_loss(vf_tokens, mask, "token-mean").item() == pytest.approx(0.5 * 6.89 / 3)
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


@pytest.mark.parametrize("estimator", ["k1+", "kl+", "k3+", "low_var_kl+", "abs+", "mse+"])
def test_straight_through_kl_has_the_value_of_its_base_and_the_gradient_of_k2(estimator):
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-2.0, -1.0]])
    value = kl_penalty(logp, ref, estimator)
    torch.testing.assert_close(value, kl_penalty(logp, ref, estimator[:-1]))
    value.sum().backward()
    assert logp.grad.tolist() == [[1.0, -1.0]]  # d/dlogp 0.5 (logp - ref)^2 = logp - ref


def test_gspo_clips_whole_sequences_at_their_geometric_mean_ratio():
    # row 0: ratios 1.5, 0.5 -> s = sqrt(0.75) = 0.8660; row 1: 0.5, 5.0 -> s = sqrt(2.5) = 1.5811
    s0, s1 = math.sqrt(0.75), math.sqrt(2.5)
    logprobs = NEW.clone().requires_grad_(True)
    tokens, clipfrac, _, lower = policy_loss(logprobs, OLD, ADV, PMASK, clip_ratio_low=0.2, clip_ratio_high=0.2,
                                             mode="gspo")
    # A = +1: -s0 (inside the clip range); A = -1: max(s1, 1.2) = s1 (no dual-clip in GSPO)
    torch.testing.assert_close(tokens[:, :2], torch.tensor([[-s0, -s0], [s1, s1]]))
    assert clipfrac.item() == 0.0 and lower.item() == 0.0
    loss = agg_loss(tokens, PMASK, "seq-mean-token-mean")
    assert loss.item() == pytest.approx((s1 - s0) / 2)
    loss.backward()  # d/dlogp_t = -A s_i / (G |y_i|), G = 2 sequences of 2 tokens
    torch.testing.assert_close(logprobs.grad[:, :2], torch.tensor([[-s0 / 4, -s0 / 4], [s1 / 4, s1 / 4]]))
    # with A = +1 on row 1 its ratio 1.58 is clipped at 1.2: the whole sequence gets no gradient
    logprobs.grad = None
    tokens, clipfrac, *_ = policy_loss(logprobs, OLD, ADV.abs(), PMASK, mode="gspo")
    agg_loss(tokens, PMASK, "seq-mean-token-mean").backward()
    assert logprobs.grad[1].abs().sum().item() == 0.0 and logprobs.grad[0, 0].item() != 0.0
    assert clipfrac.item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="vanilla, gspo"):
        policy_loss(NEW, OLD, ADV, PMASK, mode="gpso")


def test_reinforce_is_minus_advantage_times_logprob_weighted_without_a_ratio():
    logprobs = NEW.clone().requires_grad_()
    weights = torch.tensor([[2.0, 1.0, 0.0], [0.5, 1.0, 0.0]])
    tokens, clipfrac, ppo_kl, clipfrac_lower = policy_loss(logprobs, OLD, ADV, PMASK, loss_type="reinforce",
                                                           rollout_is_weights=weights)
    torch.testing.assert_close(tokens, -ADV * NEW * weights)
    assert clipfrac.item() == clipfrac_lower.item() == 0.0  # no clipping, however far the ratio
    assert ppo_kl.item() == pytest.approx(-NEW[:, :2].mean().item())  # KL(rollout || policy), old = the rollout's
    agg_loss(tokens, PMASK, "token-mean").backward()
    torch.testing.assert_close(logprobs.grad, -ADV * weights * PMASK / 4)


def test_rollout_importance_weights_are_truncated_per_token_or_per_sequence():
    old = torch.zeros(1, 3)
    rollout = torch.tensor([[math.log(0.5), math.log(2.0), 7.0]])  # pi_old / pi_rollout = 2, 0.5; padding
    mask = torch.tensor([[1, 1, 0]])
    token, kept, m = correct(old, rollout, mask, parse(rollout_is="token", rollout_is_threshold=1.5))
    torch.testing.assert_close(token, torch.tensor([[1.5, 0.5, 0.0]]))
    assert kept is mask  # no rejection asked for
    sequence = correct(old, rollout, mask, parse(rollout_is="sequence", rollout_is_threshold=1.5))[0]
    torch.testing.assert_close(sequence, torch.tensor([[1.0, 1.0, 0.0]]))
    assert m["rollout_corr/kl"] == pytest.approx(0.0, abs=1e-6)  # log rho = ln 2, -ln 2
    assert m["rollout_corr/k3_kl"] == pytest.approx((2 - math.log(2) - 1 + 0.5 + math.log(2) - 1) / 2)
    assert m["rollout_corr/chi2_token"] == pytest.approx((4 + 0.25) / 2 - 1)
    assert m["rollout_corr/chi2_seq"] == pytest.approx(0.0, abs=1e-6)  # the sequence's ratio is 1
    assert m["rollout_corr/log_ppl_diff"] == pytest.approx(0.0, abs=1e-6)
    assert m["rollout_corr/training_ppl"] == pytest.approx(1.0)  # old log-probs 0
    assert m["rollout_corr/rollout_ppl"] == pytest.approx(math.exp(-(math.log(0.5) + math.log(2)) / 2))
    assert (m["rollout_corr/rollout_is_max"], m["rollout_corr/rollout_is_min"]) == (1.5, 0.5)
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(4 / 2.5 / 2)
    weights = torch.tensor([[2.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    tokens, *_ = policy_loss(NEW, OLD, ADV, PMASK, rollout_is_weights=weights)
    assert agg_loss(tokens, PMASK, "token-mean").item() == pytest.approx((-2.4 - 0.5 + 0.8 + 3.0) / 4)


@pytest.mark.parametrize("mode", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_shares_over_the_mini_batch_totals_add_up_to_the_whole(mode):
    from siirl_dag.strategies.base import MiniBatchTotals

    totals = MiniBatchTotals(tokens=float(MASK.sum()), sequences=float((MASK.sum(-1) > 0).sum()))
    shares = [agg_loss(LOSS[i:i + 1], MASK[i:i + 1], mode, totals=totals) for i in range(3)]
    assert sum(s.item() for s in shares) == pytest.approx(agg_loss(LOSS, MASK, mode).item())


def test_loss_modes_and_estimators_are_the_schema_enums():
    import json
    from pathlib import Path

    from nodes.algos.losses import KL_ESTIMATORS, LOSS_AGG_MODES, LOSS_TYPES, POLICY_LOSS_MODES

    schema = json.loads(Path("siirl_dag/schemas/nodes/actor_update.schema.json").read_text())["properties"]
    assert schema["loss_agg_mode"]["enum"] == list(LOSS_AGG_MODES)
    assert schema["kl_loss_type"]["enum"] == list(KL_ESTIMATORS)
    assert schema["policy_loss"]["enum"] == list(POLICY_LOSS_MODES)
    assert schema["loss_type"]["enum"] == list(LOSS_TYPES)
