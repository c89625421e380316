"""Rollout correction, with verl's names and semantics (its `rollout_corr_helper`): the rollout engine
samples from its own distribution (other kernels, other precision, MoE routing, or older weights
under one_step_off / async), so the trainer weighs and filters its tokens by rho = pi_old / pi_rollout
of each sampled token, from `old_logprobs` (the trainer's) and `rollout_logprobs` (the engine's).

- Importance weights (`rollout_is`: token | sequence, one weight per token or the product per
  sequence): `rollout_is_threshold` one number truncates them to it (TIS); "lower_upper" zeroes those
  outside the band (IcePop); `rollout_is_batch_normalize` rescales them to mean 1.
- Rejection (`rollout_rs`, options chained with commas, all must pass): a divergence per token
  (`token_k1..k3`) or per sequence (`seq_sum_*`, `seq_mean_*`, `seq_max_k2|k3`) against
  `rollout_rs_threshold`, one entry for all options or one per option; k1 (the log ratio) takes a
  band "lower_upper" of the ratio (one number u: [1/u, u]), k2 and k3 an upper bound. A rejected
  token leaves the response mask, so the loss and its normalization.

Every exp runs on log ratios clamped to +-20, as verl's. The settings are parsed in
rollout_corr_settings.py (the door's, without torch), the `rollout_corr/*` metrics are verl's
(rollout_corr_metrics.py).
"""

from __future__ import annotations

import math

import torch

from nodes.algos.masked import masked_mean, masked_sum
from nodes.algos.rollout_corr_metrics import SAFETY_BOUND, is_metrics, offpolicy_metrics, rs_metrics
from nodes.algos.rollout_corr_settings import Correction


def correct(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor,
            settings: Correction, group=None):
    """(importance weights [B, R] or None without an IS level, the response mask with rejected tokens
    out, the `rollout_corr/*` metrics), all detached. `settings`: rollout_corr_settings.parse's, once
    per update (this runs in every micro batch's loss); `group`: the torch.distributed group whose
    rows the batch normalization averages over (None: these rows)."""
    mask = response_mask
    if not bool(mask.any()):
        return (torch.zeros_like(old_logprobs) if settings.level else None), mask, {}
    with torch.no_grad():
        log_ratio = torch.where(mask.bool(), old_logprobs - rollout_logprobs, torch.zeros_like(old_logprobs)).float()
        maskf = mask.float()
        metrics: dict[str, float] = {}
        weights = None
        if settings.level is not None:
            weights = _weights(log_ratio, maskf, settings.level, settings.upper, settings.lower,
                               settings.batch_normalize, group, metrics)
        if settings.rs_bands is not None:
            keep = _keep(log_ratio, maskf, settings.rs_bands, metrics)
            mask = (mask * keep).to(response_mask.dtype)
        metrics.update(offpolicy_metrics(old_logprobs.float(), rollout_logprobs.float(), log_ratio, maskf))
    return weights, mask, {f"rollout_corr/{k}": v for k, v in metrics.items()}


def _weights(log_ratio, mask, level, upper, lower, normalize, group, metrics):
    """Truncated (TIS) or band-masked (IcePop) weights, optionally rescaled to mean 1."""
    if level == "token":
        ratio_log = log_ratio
        raw = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()
    else:
        ratio_log = masked_sum(log_ratio, mask, dim=-1).unsqueeze(-1)
        raw = ratio_log.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp().expand_as(log_ratio)
    raw = raw * mask
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    metrics.update(is_metrics(weights, raw, ratio_log, mask, level, upper, lower))
    if normalize:
        if level == "token":
            total, count = masked_sum(weights, mask), mask.sum()
        else:
            rows = (mask.sum(-1) > 0).float()
            total, count = (masked_mean(weights, mask, dim=-1) * rows).sum(), rows.sum()
        if group is not None:
            both = torch.stack([total, count])
            torch.distributed.all_reduce(both, group=group)
            total, count = both[0], both[1]
        mean = total / count.clamp(min=1)
        metrics["rollout_is_batch_norm_factor"] = mean.item() if mean > 1e-8 else 1.0
        if mean > 1e-8:
            weights = weights / mean
    return weights


def _keep(log_ratio, mask, bands, metrics) -> torch.Tensor:
    """[B, R] 1 where every option passes; a sequence-level option keeps or rejects a row whole."""
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    divergence = {"k1": -safe, "k2": 0.5 * safe.square(), "k3": safe.exp() - 1.0 - safe}
    keep_all = torch.ones_like(mask)
    for option, (lower, upper) in bands.items():
        scope, k = option.rsplit("_", 1)
        per_token = divergence[k]
        if scope == "token":
            stat = per_token
        elif scope == "seq_sum":
            stat = masked_sum(per_token, mask, dim=-1)
        elif scope == "seq_mean":
            stat = masked_mean(per_token, mask, dim=-1)
        else:  # seq_max: over the row's tokens (0 for a row without any)
            peak = per_token.masked_fill(~mask.bool(), float("-inf")).max(-1).values
            stat = torch.where(torch.isinf(peak), torch.zeros_like(peak), peak)
        keep = (stat >= math.log(lower)) & (stat <= math.log(upper)) if k == "k1" else stat <= upper
        if scope != "token":
            stat, keep = stat.unsqueeze(-1).expand_as(mask), keep.unsqueeze(-1).expand_as(mask)
        metrics.update(rs_metrics(option, stat, keep, mask, scope == "token"))
        keep_all = keep_all * keep.float()
    rejected = (keep_all < 0.5) & mask.bool()
    metrics["rollout_rs_masked_fraction"] = masked_mean(1.0 - keep_all, mask).item()
    metrics["rollout_rs_seq_masked_fraction"] = rejected.any(-1).float().mean().item()
    return keep_all
