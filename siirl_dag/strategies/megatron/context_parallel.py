"""Context parallelism: each CP rank holds 2 of the 2*cp sequence chunks (r and 2*cp-1-r, megatron's
load-balanced causal split, which its rotary embedding and TE attention assume).

Log-probs are computed on the local positions and all-gathered, so every CP rank sees the whole
sequence and computes the same loss; the gather's backward keeps this rank's slice of the grad.
megatron scales a CP rank's loss by cp and averages grads over dp*cp, so the sum is exact.
GPU only (TE attention); refused on CPU before anything here runs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _group():
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_group(), ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()


def _chunks(rank: int, size: int) -> tuple[int, int]:
    return rank, 2 * size - 1 - rank


def local(t: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """This CP rank's part of a [b, s, ...] tensor (s divisible by 2*cp)."""
    _, rank, size = _group()
    if size == 1:
        return t
    parts = t.chunk(2 * size, dim=dim)
    return torch.cat([parts[i] for i in _chunks(rank, size)], dim=dim)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, part: torch.Tensor) -> torch.Tensor:
        group, rank, size = _group()
        ctx.rank, ctx.size = rank, size
        pieces = [torch.empty_like(part) for _ in range(size)]
        dist.all_gather(pieces, part.contiguous(), group=group)
        full = [None] * (2 * size)
        for r, piece in enumerate(pieces):
            first, second = piece.chunk(2, dim=1)
            a, b = _chunks(r, size)
            full[a], full[b] = first, second
        return torch.cat(full, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        parts = grad.chunk(2 * ctx.size, dim=1)
        return torch.cat([parts[i] for i in _chunks(ctx.rank, ctx.size)], dim=1)


def gather(part: torch.Tensor) -> torch.Tensor:
    """Inverse of `local` over the CP group ([b, s_local] -> [b, s]), differentiable."""
    return part if _group()[2] == 1 else _Gather.apply(part)
