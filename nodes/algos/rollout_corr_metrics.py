"""The `rollout_corr/*` metrics of rollout correction, with verl's names and definitions: how far the
rollout's sampling is from the trainer's old policy, what the importance weights look like, and
how much each rejection option masked. Inputs are [B, R] float tensors, zero on padding where they
are log ratios; every exp runs on log ratios clamped to +-20."""

from __future__ import annotations

import torch

from nodes.algos.masked import masked_mean, masked_sum

SAFETY_BOUND = 20.0


def is_metrics(weights, raw, ratio_log, mask, level: str, upper: float, lower: float | None) -> dict[str, float]:
    """Statistics of the applied weights (before batch normalization); the high / low fractions count
    the raw ratios beyond upper and below lower (1 / upper for TIS), per token or per sequence;
    ESS is the effective sample size as a share of the tokens; `oob_ratio` the tokens IcePop zeroed."""
    low_bound = 1.0 / upper if lower is None else lower
    valid = mask.bool()
    out = {"rollout_is_mean": masked_mean(weights, mask).item()}
    if level == "sequence":  # ratio_log: [B, 1], one log ratio per row
        out["rollout_is_max"] = ratio_log.max().clamp(max=SAFETY_BOUND).exp().item()
        out["rollout_is_min"] = ratio_log.min().exp().item()
        out["rollout_is_ratio_fraction_high"] = (ratio_log > torch.log(torch.tensor(upper))).float().mean().item()
        out["rollout_is_ratio_fraction_low"] = (ratio_log < torch.log(torch.tensor(low_bound))).float().mean().item()
    else:
        out["rollout_is_max"] = weights.masked_fill(~valid, float("-inf")).max().item()
        out["rollout_is_min"] = weights.masked_fill(~valid, float("inf")).min().item()
        out["rollout_is_ratio_fraction_high"] = masked_mean((raw > upper).float(), mask).item()
        out["rollout_is_ratio_fraction_low"] = masked_mean((raw < low_bound).float(), mask).item()
    bounded = weights.clamp(min=0.0, max=upper)
    mean = masked_mean(bounded, mask)
    variance = masked_mean(bounded.square(), mask) - mean.square()
    out["rollout_is_std"] = variance.clamp(min=0.0).sqrt().item() if mask.sum() > 1 else 0.0
    second = masked_mean((bounded / (mean + 1e-8)).square(), mask).item()
    out["rollout_is_eff_sample_size"] = 1.0 / second if second > 0 else 0.0
    if lower is not None:
        out["rollout_is_oob_ratio"] = masked_mean(((raw < lower) | (raw > upper)).float(), mask).item()
    return out


def rs_metrics(option: str, stat, keep, mask, token_level: bool) -> dict[str, float]:
    """One rejection option: its statistic's mean (over tokens) and max (over tokens, or over rows
    for a sequence-level option), and the shares of tokens and of rows it masked."""
    valid = mask.bool()
    rows = valid.any(-1)
    peak = stat.masked_fill(~valid, float("-inf")).max() if token_level else stat[:, 0][rows].max()
    prefix = f"rollout_rs_{option}"
    return {f"{prefix}_mean": masked_mean(stat, mask).item(), f"{prefix}_max": peak.item(),
            f"{prefix}_masked_fraction": masked_mean((~keep).float(), mask).item(),
            f"{prefix}_seq_masked_fraction": ((~keep) & valid).any(-1)[rows].float().mean().item()}


def offpolicy_metrics(old_logprobs, rollout_logprobs, log_ratio, mask) -> dict[str, float]:
    """KL(rollout || old) as k1 and k3, each side's perplexity (mean over rows of exp of the row's mean
    negative log-prob) and their log difference per row, the chi-square divergences E[rho^2] - 1 per
    token and per sequence."""
    valid = mask.bool()
    train_lp = masked_mean(torch.where(valid, old_logprobs, torch.zeros_like(old_logprobs)), mask, dim=-1)
    rollout_lp = masked_mean(torch.where(valid, rollout_logprobs, torch.zeros_like(rollout_logprobs)), mask, dim=-1)
    log_ppl_diff = rollout_lp - train_lp
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    seq_log_ratio = masked_sum(log_ratio, mask, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "training_ppl": (-train_lp).exp().mean().item(),
        "training_log_ppl": (-train_lp).mean().item(),
        "kl": masked_mean(-log_ratio, mask).item(),
        "k3_kl": masked_mean(safe.exp() - safe - 1.0, mask).item(),
        "rollout_ppl": (-rollout_lp).exp().mean().item(),
        "rollout_log_ppl": (-rollout_lp).mean().item(),
        "log_ppl_diff": log_ppl_diff.mean().item(),
        "log_ppl_abs_diff": log_ppl_diff.abs().mean().item(),
        "log_ppl_diff_max": log_ppl_diff.max().item(),
        "log_ppl_diff_min": log_ppl_diff.min().item(),
        "ppl_ratio": log_ppl_diff.exp().mean().item(),
        "chi2_token": (masked_mean(safe.exp().square(), mask) - 1.0).item(),
        "chi2_seq": ((2.0 * seq_log_ratio).exp().mean() - 1.0).item(),
    }


def logprob_diff_metrics(old_logprobs, rollout_logprobs, mask) -> dict[str, float]:
    """How far the engine's log-probs of the sampled tokens are from the trainer's: |old - rollout| per
    token, its mean and max (verl's training/rollout_probs_diff_* take the same on probabilities). With
    the same weights on both sides (a synchronous step after a sync) this is the numerics alone."""
    valid = mask.bool()
    diff = (old_logprobs.float() - rollout_logprobs.float()).abs()[valid]
    if not diff.numel():
        return {}
    return {"training/rollout_logprob_diff_mean": diff.mean().item(), "training/rollout_logprob_diff_max": diff.max().item()}
