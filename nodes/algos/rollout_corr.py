"""The rollout engine samples from its own distribution (other kernels, other precision, or older
weights under one_step_off); these correct for it and measure it, with verl's names.

Per token: rho = pi_old / pi_rollout of the sampled token, from `old_logprobs` (the trainer's) and
`rollout_logprobs` (the engine's).
"""

from __future__ import annotations

import math

import torch

from nodes.algos.masked import masked_mean


def rollout_is_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor,
                       level: str = "token", threshold: float = 2.0) -> torch.Tensor:
    """Truncated importance weights [B, R] of the trainer's old policy against the rollout engine's
    sampling distribution (the two differ: other kernels, other precision, or an older policy when
    training runs asynchronously): min(pi_old / pi_rollout, threshold), per token or one per sequence
    (the product of its token ratios). Detached: they weigh the loss, they are not trained."""
    log_ratio = ((old_logprobs - rollout_logprobs) * response_mask).detach()
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
    return log_ratio.clamp(max=math.log(threshold)).exp() * response_mask


def rollout_corr_metrics(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor,
                         weights: torch.Tensor) -> dict[str, float]:
    """How far the rollout's sampling is from the trainer's old policy (`rollout_corr/*`): KL(rollout ||
    old) as k1 and k3, each side's perplexity and their log difference per sequence, the chi-square
    divergences (E[rho^2] - 1, per token and per sequence), and the weights' statistics."""
    mask = response_mask.float()
    diff = ((old_logprobs - rollout_logprobs) * mask).detach()  # log rho
    seqs = mask.sum(-1) > 0
    lengths = mask.sum(-1).clamp(min=1)
    training_log_ppl = -(old_logprobs * mask).sum(-1) / lengths
    rollout_log_ppl = -(rollout_logprobs * mask).sum(-1) / lengths
    log_ppl_diff = (training_log_ppl - rollout_log_ppl)[seqs]
    rho = diff.clamp(max=20.0).exp()
    w = weights[mask.bool()]
    return {
        "rollout_corr/kl": masked_mean(-diff, mask).item(),
        "rollout_corr/k3_kl": masked_mean(rho - diff - 1.0, mask).item(),
        "rollout_corr/training_ppl": training_log_ppl[seqs].exp().mean().item(),
        "rollout_corr/rollout_ppl": rollout_log_ppl[seqs].exp().mean().item(),
        "rollout_corr/log_ppl_diff": log_ppl_diff.mean().item(),
        "rollout_corr/log_ppl_abs_diff": log_ppl_diff.abs().mean().item(),
        "rollout_corr/log_ppl_diff_max": log_ppl_diff.max().item(),
        "rollout_corr/log_ppl_diff_min": log_ppl_diff.min().item(),
        "rollout_corr/chi2_token": (masked_mean(rho.square(), mask) - 1.0).item(),
        "rollout_corr/chi2_seq": (diff.sum(-1)[seqs].clamp(max=20.0).mul(2).exp().mean() - 1.0).item(),
        "rollout_corr/rollout_is_mean": w.mean().item(),
        "rollout_corr/rollout_is_std": w.std().item() if w.numel() > 1 else 0.0,
        "rollout_corr/rollout_is_max": w.max().item(),
        "rollout_corr/rollout_is_min": w.min().item(),
        # effective sample size of the normalized weights, as a share of the tokens
        "rollout_corr/rollout_is_eff_sample_size": (w.sum().square() / w.square().sum() / w.numel()).item(),
    }
