"""Per-step data metrics under the names verl/siiRL users read in TensorBoard.

Works on any batch that answers `batch[key]` (a KeyError for absent keys); each group of metrics
is reported when its tensors are present, so GRPO batches simply have no critic/values.
"""

from __future__ import annotations

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

