"""Per-token log-probs and entropy from vocab-parallel logits (each TP rank holds V/tp columns)."""

from __future__ import annotations

import torch
import torch.distributed as dist

_PAD_LOGIT = -1e9  # padded vocab columns: exp() underflows to 0 and 0 * logit stays finite


def _mask_padded_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    local = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * local
    if start + local <= vocab_size:
        return logits
    cols = torch.arange(start, start + local, device=logits.device)
    return logits.masked_fill(cols >= vocab_size, _PAD_LOGIT)


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the full vocabulary, differentiable, from local shards."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as tp_sum

    peak = logits.detach().max(dim=-1).values
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    shifted = logits - peak.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = tp_sum(exp.sum(-1))
    return sum_exp.log() - tp_sum((exp * shifted).sum(-1)) / sum_exp


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets) and (optionally) entropy per position; logits [..., V/tp], targets [...]."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    scaled = _mask_padded_vocab(logits.float() / temperature, vocab_size)
    entropy = vocab_parallel_entropy(scaled) if with_entropy else None
    # megatron's cross entropy works in place on its input: give it its own copy.
    logp = -vocab_parallel_cross_entropy(scaled.clone() if with_entropy else scaled, targets)
    return logp, entropy
