"""Scores onto the token grid (on each response's last token), and the KL-in-reward penalty
(PPO-RLHF style), which turns scores into rewards."""

from __future__ import annotations

import torch

from nodes.algos.losses import kl_penalty
from nodes.algos.masked import masked_mean


def place_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B] scores -> [B, R] token_level_scores with each score on the last response token
    (the last 1 of the mask). A zero-length response has no token to hold it and gets all zeros."""
    mask = response_mask.bool()
    length = mask.shape[1]
    positions = torch.arange(length, device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).max(dim=1).values
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    has_token = last >= 0
    rows = torch.nonzero(has_token).squeeze(1)
    out[rows, last[has_token]] = torch.as_tensor(scores, dtype=torch.float32, device=out.device)[has_token]
    return out


def overlong_penalty(response_mask: torch.Tensor, max_length: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment, [B]: 0 up to `max_length - buffer` tokens, then falling linearly
    to -factor at `max_length` (a response the engine cut at the limit gets all of it)."""
    exceed = response_mask.sum(dim=-1).float() - (max_length - buffer)
    return (-exceed / buffer * factor).clamp(max=0.0)


def apply_kl_penalty(token_level_scores, old_logprobs, ref_logprobs, response_mask, kl_coef: float, estimator: str = "kl"):
    """rewards = scores - kl_coef * KL per token (masked). Returns (token_level_rewards, kl_mean),
    kl_mean being the batch mean of per-sequence mean KL, the quantity an adaptive controller tracks."""
    kld = kl_penalty(old_logprobs, ref_logprobs, estimator) * response_mask
    rewards = token_level_scores - kl_coef * kld
    kl_mean = masked_mean(kld, response_mask, dim=-1).mean()
    return rewards, kl_mean.item()
