"""Advantage estimators: [B, R] token rewards (+ prompt uids / values) -> (advantages, returns).

Outcome estimators (GRPO, RLOO, REINFORCE++-baseline) compare the n samples of one prompt,
grouped by the `uid` metadata; a group of one sample has no peers, so its baseline is 0 and its
std 1 (verl's convention). Every output is zero on padding.
"""

from __future__ import annotations

import inspect
from typing import Hashable, Optional, Sequence

import torch

from nodes.algos.masked import masked_whiten


def _group_ids(index: Sequence[Hashable], batch_size: int) -> torch.Tensor:
    if len(index) != batch_size:
        raise ValueError(f"index (uid per sample) has {len(index)} entries for a batch of {batch_size}")
    ids: dict = {}
    return torch.tensor([ids.setdefault(u, len(ids)) for u in index], dtype=torch.long)


def group_mean_std(scores: torch.Tensor, index: Sequence[Hashable]):
    """Per-sample (mean, unbiased std, size) of its uid group; singletons get mean 0, std 1."""
    gid = _group_ids(index, scores.shape[0]).to(scores.device)
    n_groups = int(gid.max()) + 1 if gid.numel() else 0
    zeros = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device)
    count = zeros.index_add(0, gid, torch.ones_like(scores))
    mean = zeros.index_add(0, gid, scores) / count
    sq_dev = zeros.index_add(0, gid, (scores - mean[gid]).square())
    std = (sq_dev / (count - 1).clamp(min=1)).sqrt()
    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean[gid], std[gid], count[gid]


def _sequence_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return (token_level_rewards * response_mask).sum(dim=-1)


def _broadcast(per_seq: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return per_seq.unsqueeze(-1) * response_mask


def grpo_advantage(token_level_rewards, response_mask, index, *, norm_by_std: bool = True, eps: float = 1e-6):
    """GRPO: (score - group mean) / (group std + eps); norm_by_std=False is Dr.GRPO (no std division)."""
    scores = _sequence_scores(token_level_rewards, response_mask)
    mean, std, _ = group_mean_std(scores, index)
    adv = scores - mean
    if norm_by_std:
        adv = adv / (std + eps)
    adv = _broadcast(adv, response_mask)
    return adv, adv


def rloo_advantage(token_level_rewards, response_mask, index):
    """RLOO: score minus the mean of the other samples of the same prompt, n/(n-1) (s - mean)."""
    scores = _sequence_scores(token_level_rewards, response_mask)
    mean, _, count = group_mean_std(scores, index)
    adv = torch.where(count > 1, (scores - mean) * count / (count - 1).clamp(min=1), scores)
    adv = _broadcast(adv, response_mask)
    return adv, adv


def discounted_returns(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t'} along the model's tokens, t' the next one: a masked span (a tool's
    answer inside an agent's response, padding after it) passes the return through unchanged, as GAE
    does, and has none of its own."""
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[1])):
        mask = response_mask[:, t].to(running.dtype)
        running = mask * (token_level_rewards[:, t] + gamma * running) + (1 - mask) * running
        returns[:, t] = running * mask
    return returns


def reinforce_plus_plus_advantage(token_level_rewards, response_mask, *, gamma: float = 1.0):
    """REINFORCE++: discounted return per token, whitened over all response tokens of the batch."""
    returns = discounted_returns(token_level_rewards, response_mask, gamma)
    adv = masked_whiten(returns, response_mask) * response_mask
    return adv, returns


def reinforce_plus_plus_baseline_advantage(token_level_rewards, response_mask, index):
    """REINFORCE++-baseline: subtract the prompt-group mean score, then whiten over the batch."""
    scores = _sequence_scores(token_level_rewards, response_mask)
    mean, _, _ = group_mean_std(scores, index)
    adv = _broadcast(scores - mean, response_mask)
    adv = masked_whiten(adv, response_mask) * response_mask
    return adv, adv


def gae_advantage(token_level_rewards, response_mask, values, *, gamma: float = 1.0, lam: float = 1.0):
    """GAE for PPO. Padding tokens are skipped: the recursion carries the next *real* token's value
    and advantage across them. Returns (whitened advantages, returns = raw advantages + values)."""
    mask = response_mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    last_gae = torch.zeros_like(values[:, 0])
    raw = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * last_gae
        next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
        last_gae = gae * mask[:, t] + (1 - mask[:, t]) * last_gae
        raw[:, t] = last_gae
    returns = (raw + values) * mask
    adv = masked_whiten(raw, mask) * mask
    return adv, returns


ESTIMATORS = {
    "grpo": grpo_advantage,
    "rloo": rloo_advantage,
    "reinforce_plus_plus": reinforce_plus_plus_advantage,
    "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline_advantage,
    "gae": gae_advantage,
}


def compute_advantage(
    name: str,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: Optional[Sequence[Hashable]] = None,
    values: Optional[torch.Tensor] = None,
    **params,
):
    """Run estimator `name`, handing it `index` (uids) / `values` only when it takes them.

    Clear errors for an unknown estimator, a missing input it needs, or a parameter it does not take.
    """
    fn = ESTIMATORS.get(name)
    if fn is None:
        raise ValueError(f"unknown advantage estimator {name!r}; expected one of {', '.join(ESTIMATORS)}")
    sig = inspect.signature(fn).parameters
    inputs = {}
    for key, value in (("index", index), ("values", values)):
        if key in sig:
            if value is None:
                raise ValueError(f"advantage estimator {name!r} needs {key!r}, which was not given")
            inputs[key] = value
    takes = [p.name for p in sig.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    unknown = sorted(set(params) - set(takes))
    if unknown:
        raise ValueError(f"advantage estimator {name!r} takes no parameter {', '.join(unknown)}; it takes: {', '.join(takes) or 'none'}")
    return fn(token_level_rewards, response_mask, **inputs, **params)
