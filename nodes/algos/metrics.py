"""Per-step data metrics under the names verl/siiRL users read in TensorBoard.

Works on any batch that answers `batch[key]` (a KeyError for absent keys); each group of metrics
is reported when its tensors are present, so GRPO batches simply have no critic/values.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch


def _get(batch, key):
    try:
        return batch[key]
    except KeyError:
        return None


def _stats(prefix: str, values: torch.Tensor) -> dict:
    values = values.detach().float()
    if values.numel() == 0:
        return {}
    return {f"{prefix}/mean": values.mean().item(), f"{prefix}/max": values.max().item(), f"{prefix}/min": values.min().item()}


def _lengths(prefix: str, mask: torch.Tensor) -> dict:
    lengths = mask.sum(dim=-1).float()
    out = _stats(prefix, lengths)
    out[f"{prefix}/clip_ratio"] = (lengths == mask.shape[-1]).float().mean().item()
    return out


def batch_metrics(batch) -> dict:
    """critic/score, critic/rewards (sequence sums), critic/advantages, critic/returns, critic/values
    (over response tokens), critic/vf_explained_var, response_length/*, prompt_length/*.
    clip_ratio is the share of samples that filled the whole length budget (truncated)."""
    mask = batch["response_mask"]
    valid = mask.bool()
    out: dict = {}
    for key, name in (("token_level_scores", "critic/score"), ("token_level_rewards", "critic/rewards")):
        tensor = _get(batch, key)
        if tensor is not None:
            out.update(_stats(name, (tensor * mask).sum(dim=-1)))
    for key, name in (("advantages", "critic/advantages"), ("returns", "critic/returns"), ("values", "critic/values")):
        tensor = _get(batch, key)
        if tensor is not None:
            out.update(_stats(name, tensor[valid]))
    returns, values = _get(batch, "returns"), _get(batch, "values")
    if returns is not None and values is not None and valid.sum() > 1:
        ret, val = returns[valid].float(), values[valid].float()
        out["critic/vf_explained_var"] = (1.0 - (ret - val).var() / (ret.var() + 1e-5)).item()
    out.update(_lengths("response_length", mask))
    prompt_mask = _get(batch, "prompt_mask")
    if prompt_mask is not None:
        out.update(_lengths("prompt_length", prompt_mask))
    return out


def varied_groups(per_sample: Sequence[float], index: Sequence[Hashable]) -> set:
    """The groups (uids in `index`) whose samples do not all have the same value."""
    groups: dict = {}
    for uid, value in zip(index, per_sample):
        groups.setdefault(uid, []).append(value)
    return {uid for uid, values in groups.items() if max(values) - min(values) > 1e-6}


def mixed_groups(per_sample: Sequence[float], index: Sequence[Hashable]) -> float:
    """critic/mixed_groups: the share of groups whose samples' values differ, the groups from which a group
    baseline (GRPO, RLOO) gets a non-zero advantage; 0 for an empty batch."""
    return len(varied_groups(per_sample, index)) / max(len(set(index)), 1)
