"""actor_update with the rollout correction, on test_balance's one-logit-per-token engine: rejected tokens
leave the loss (and, corrected before the update, the mask the mini batch's count is taken from); the
same tokens go whether the old log-probs are an input or the update's own forward; bypass REINFORCE is
-A log pi weighed by the sequence weights."""

from __future__ import annotations

import pytest
import torch

from pipeline_files import load
from test_balance import TEXT, _update

ROWS, WIDTH = 8, 5


def _batch(logits):
    torch.manual_seed(1)
    old = torch.nn.functional.logsigmoid(logits)
    noise = torch.where(torch.arange(ROWS)[:, None] % 2 == 0, 0.01, 1.0) * torch.randn(ROWS, WIDTH)
    return {"responses": torch.zeros(ROWS, WIDTH, dtype=torch.long), "response_mask": torch.ones(ROWS, WIDTH),
            "advantages": torch.randn(ROWS, WIDTH), "ref_logprobs": -torch.rand(ROWS, WIDTH),
            "rollout_logprobs": old - noise}, old


def _params(tmp_path, **extra):
    return {**load(tmp_path, TEXT).nodes["actor_update"].params, **extra}


def test_rejected_tokens_leave_the_loss_and_the_mask_of_the_update(tmp_path):
    logits = torch.randn(ROWS, WIDTH)
    batch, old = _batch(logits)
    params = _params(tmp_path, rollout_rs="seq_max_k3", rollout_rs_threshold=0.05)
    grad_in, m_in, given = _update({**params, "old_logprobs": "input"}, dict(batch, old_logprobs=old), logits)
    kept = given["response_mask"]
    assert 0 < kept.sum() < ROWS * WIDTH and bool((kept[::2] == 1).all())  # the rows far off went, whole
    assert bool((grad_in[kept == 0] == 0).all()) and grad_in[kept == 1].abs().sum() > 0
    assert m_in["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1 - kept[:, 0].mean().item())
    grad_up, m_up, seen = _update(params, batch, logits)  # the update's own forward: corrected in its loss
    assert bool((seen["response_mask"] == 1).all())  # the mini batch's mask as given
    torch.testing.assert_close(grad_up, grad_in)  # the same tokens out, the same loss (this engine counts per call)
    assert m_up["rollout_corr/rollout_rs_masked_fraction"] == m_in["rollout_corr/rollout_rs_masked_fraction"]


def test_batch_normalized_weights_before_the_update(tmp_path):
    logits = torch.randn(ROWS, WIDTH)
    batch, old = _batch(logits)
    params = _params(tmp_path, old_logprobs="input", rollout_is="sequence", rollout_is_threshold="0.2_5.0",
                     rollout_is_batch_normalize=True)
    _, metrics, given = _update(params, dict(batch, old_logprobs=old), logits)
    weights = given["rollout_is_weights"]
    assert weights[:, 0].mean().item() == pytest.approx(1.0)  # one weight per sequence, their mean 1
    assert metrics["rollout_corr/rollout_is_batch_norm_factor"] > 0


def test_bypass_reinforce_is_minus_advantage_log_pi_times_the_sequence_weight(tmp_path):
    logits = torch.randn(ROWS, WIDTH)
    batch, _ = _batch(logits)
    params = _params(tmp_path, old_logprobs="rollout", loss_type="reinforce", rollout_is="sequence",
                     rollout_is_threshold=2.0, use_kl_loss=False)
    grad, metrics, _ = _update(params, batch, logits)
    logprobs = torch.nn.functional.logsigmoid(logits)
    weight = (logprobs - batch["rollout_logprobs"]).sum(-1, keepdim=True).exp().clamp(max=2.0)
    d_logprob = torch.sigmoid(-logits)  # d logsigmoid(x) / dx
    expected = -batch["advantages"] * weight * d_logprob / (ROWS // 2 * WIDTH)  # token-mean per micro batch of 4 rows
    torch.testing.assert_close(grad, expected)
    assert metrics["actor/pg_clipfrac"] == 0 and "rollout_corr/rollout_is_mean" in metrics
