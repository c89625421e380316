"""Per-token log-probs and entropy from vocab-parallel logits (each TP rank holds V/tp columns), and
a micro batch's model output -> its response tokens' log-probs or values."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from siirl_dag.strategies.megatron import context_parallel

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
    with_entropy: bool = False, entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets) and (optionally) entropy per position; logits [..., V/tp], targets [...].
    `entropy_grad=False`: the entropy as a metric, outside autograd (no backward through the vocabulary)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    scaled = _mask_padded_vocab(logits.float() / temperature, vocab_size)
    entropy = None
    if with_entropy:
        with contextlib.nullcontext() if entropy_grad else torch.no_grad():
            entropy = vocab_parallel_entropy(scaled if entropy_grad else scaled.detach())
    # megatron's cross entropy works in place on its input: a copy where the entropy's graph holds it
    logp = -vocab_parallel_cross_entropy(scaled.clone() if with_entropy and entropy_grad else scaled, targets)
    return logp, entropy


def response_logprobs(mb: dict, logits: torch.Tensor, vocab_size: int, cp: int, temperature: float,
                      entropy: bool, entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [b, s(/cp), V/tp] of a micro batch (batching.micro_batches), or [b, R, V/tp] already at the
    response positions (`_at_responses`: response_head.py) -> log-probs (and entropy, differentiable or
    not: `token_logprobs`) of its response tokens, [b, R]; 0 on response padding."""
    idx = mb["_logit_index"]
    narrowed = mb.get("_at_responses")
    if narrowed or cp == 1:  # only the response positions go through the vocab-wide softmax
        picked = logits if narrowed else logits.gather(1, idx.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
        lp, ent = token_logprobs(picked, mb["responses"], vocab_size, temperature, entropy, entropy_grad)
    else:  # this rank's positions, then the whole sequence from every CP rank
        ids = mb["_input_ids"]
        labels = context_parallel.local(torch.cat([ids[:, 1:], ids[:, :1]], 1))
        lp, ent = token_logprobs(logits, labels, vocab_size, temperature, entropy, entropy_grad)
        lp = context_parallel.gather(lp).gather(1, idx)
        ent = context_parallel.gather(ent).gather(1, idx) if ent is not None else None
    mask = mb["_response_mask"]
    return lp * mask, (ent * mask if ent is not None else None)


def response_values(mb: dict, values: torch.Tensor) -> torch.Tensor:
    """Value-head output [b, s(/cp), 1], or [b, R, 1] at the response positions -> the value of the state
    before each response token, [b, R]."""
    if mb.get("_at_responses"):
        return values.squeeze(-1).float() * mb["_response_mask"]
    full = context_parallel.gather(values.squeeze(-1).float())
    return full.gather(1, mb["_logit_index"]) * mb["_response_mask"]
