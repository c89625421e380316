"""Batch layout (docs/ARCHITECTURE.md) -> megatron micro batches, and results back.

Prompts are left-padded and responses right-padded. Each row is shifted left so the prompt starts
at position 0: then a plain causal mask is exact for every real token (right padding is never
attended by earlier positions), which works with any attention kernel (local, TE, flash) and
needs no [s, s] mask. Rows are trimmed to the longest real sequence (rounded to the TP size for sequence parallel).
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch

from siirl_dag.errors import ConfigError
from siirl_dag.strategies.megatron import routing_replay


def rows(value: Any, index: slice | torch.Tensor) -> Any:
    if torch.is_tensor(value):
        return value[index]
    if isinstance(index, slice):
        return value[index]
    return [value[i] for i in index.tolist()]


def _lengths(batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Prompt lengths, the mask of response tokens trained on, and the padded prompt width. The
    response's attended tokens can be more than those trained on (an agent's tool answers)."""
    attn = batch["attention_mask"]
    prompt_len = attn.shape[1] - batch["responses"].shape[1]
    plen = attn[:, :prompt_len].sum(1)
    rmask = batch.get("response_mask", attn[:, prompt_len:]).to(torch.float32)
    if bool((plen < 1).any()):
        raise ValueError("every row needs at least one prompt token (the first response token's context)")
    return plen, rmask, prompt_len


def seq_length(batch: Mapping[str, Any], pad_to: int = 1) -> int:
    """Longest real (prompt + response) length, rounded up to a multiple of `pad_to`."""
    attn = batch["attention_mask"]
    seq = int(attn.sum(1).max())
    return -(-seq // pad_to) * pad_to


def source_positions(batch: Mapping[str, Any], seq: int) -> torch.Tensor:
    """[B, seq]: the position in the batch layout of each left-aligned row's token i."""
    plen, _, prompt_len = _lengths(batch)
    return torch.arange(seq)[None, :] + (prompt_len - plen)[:, None]


def align(batch: Mapping[str, Any], seq: int, pad_id: int = 0, replay_topk: int | None = None) -> dict[str, torch.Tensor]:
    """input_ids/position_ids [B, seq] of left-aligned rows, and where response tokens are predicted.

    `logit_index[i, j]` is the position whose logits predict response token j of row i
    (prompt_len_i + j - 1); `response_mask` marks the tokens to keep. With `replay_topk`, the
    batch's `routed_experts` moved alike (routing_replay.align).
    """
    plen, rmask, prompt_len = _lengths(batch)
    input_ids = batch["input_ids"]
    total, resp_len = input_ids.shape[1], batch["responses"].shape[1]
    pos = torch.arange(seq)
    src = source_positions(batch, seq)
    ids = input_ids.gather(1, src.clamp(max=total - 1))
    ids = torch.where(src < total, ids, torch.full_like(ids, pad_id))
    logit_index = (plen[:, None] - 1 + torch.arange(resp_len)[None, :]).clamp(max=seq - 1)
    out = {
        "input_ids": ids,
        "position_ids": pos.expand_as(ids).contiguous(),
        "logit_index": logit_index,
        "response_mask": rmask,
    }
    if replay_topk is not None:
        if "routed_experts" not in batch:
            raise ValueError("routing replay needs the batch's routed_experts (a rollout with routed_experts: true)")
        out["routed_experts"] = routing_replay.align(batch["routed_experts"], src, batch["attention_mask"].sum(1),
                                                     replay_topk)
    return out


def micro_batches(batch: Mapping[str, Any], aligned: dict[str, torch.Tensor], size: int) -> list[dict[str, Any]]:
    """Split rows into micro batches of `size`: the caller's keys plus the aligned tensors."""
    n = aligned["input_ids"].shape[0]
    out = []
    for start in range(0, n, size):
        sl = slice(start, start + size)
        mb = {k: rows(v, sl) for k, v in batch.items()}
        mb.update({f"_{k}": v[sl] for k, v in aligned.items()})
        out.append(mb)
    return out


def pad_rows(batch: Mapping[str, Any], aligned: dict[str, torch.Tensor], n: int):
    """Repeat the first row up to `n` rows (pipeline shapes need whole micro batches); dropped later."""
    have = aligned["input_ids"].shape[0]
    if n == have:
        return batch, aligned
    idx = torch.cat([torch.arange(have), torch.zeros(n - have, dtype=torch.long)])
    return ({k: rows(v, idx) for k, v in batch.items()}, {k: v[idx] for k, v in aligned.items()})


def iterate(mbs: list[dict[str, Any]], copies: int) -> list[Iterator[dict[str, Any]]] | Iterator[dict[str, Any]]:
    """megatron's data_iterator: one iterator, or one per model chunk with virtual pipelining."""
    return [iter(mbs) for _ in range(copies)] if copies > 1 else iter(mbs)


def micro_size(requested: int, seq: int, budget: int | None, vpp: int, pp: int, rows: int | None = None) -> int:
    """With a token `budget` (dynamic_micro_batch_tokens): as many rows as fit it at this batch's padded
    length `seq` (a divisor of `rows` for training); otherwise the requested size."""
    if not budget:
        return requested
    size = max(1, budget // seq)
    if rows is None:
        return size
    fits = [d for d in range(1, min(size, rows) + 1) if rows % d == 0]
    if vpp > 1:
        fits = [d for d in fits if (rows // d) % pp == 0] or fits
    return max(fits)


def train_layout(mini: int, micro: int, seq: int, dp: int, budget: int | None, vpp: int,
                 pp: int) -> tuple[int, int]:
    """Per-rank mini batch and micro batch size, or ConfigError saying which division fails."""
    local_mini = mini // dp
    if mini % dp or not local_mini:
        raise ConfigError(f"mini_batch_size {mini} must split into {dp} DP ranks", ("mini_batch_size",))
    micro = micro_size(micro, seq, budget, vpp, pp, local_mini)
    if local_mini % micro:
        raise ConfigError(f"a per-rank mini batch of {local_mini} samples does not split into micro batches of "
                          f"{micro}", ("micro_batch_size",))
    if vpp > 1 and (local_mini // micro) % pp:
        raise ConfigError(f"virtual pipelining runs micro batches in groups of pp={pp}; a mini batch "
                          f"has {local_mini // micro} per rank", ("mini_batch_size",))
    return local_mini, micro


def mini_batches(n_rows: int, total: int, widest: int, mini: int, micro: int, seq: int, dp: int,
                 budget: int | None, vpp: int, pp: int) -> tuple[list[tuple[int, int]], int, int]:
    """This rank's rows of each mini batch (start, stop), the rows each is padded to, and the micro batch
    size. `total`: the rows over all DP ranks, `widest`: the most any rank holds; `mini` rows over all
    ranks make a mini batch. A batch of whole mini batches on every rank is cut as it is; one that is not
    (an agent's episodes: lost ones give no rows, rewritten histories extra ones) is spread over the
    nearest number of mini batches, each padded with rows that train on nothing to the same whole micro
    batches on every rank (whose collectives must match)."""
    local_mini, size = train_layout(mini, micro, seq, dp, budget, vpp, pp)
    count = max(1, round(total / mini))
    if total == count * mini and n_rows == widest == count * local_mini:
        return [(j * local_mini, (j + 1) * local_mini) for j in range(count)], local_mini, size
    if not n_rows:
        raise ValueError(f"this data-parallel rank holds no rows of a batch of {total}; expected at least one per rank")
    size = micro_size(micro, seq, budget, vpp, pp)
    micros = _ceil(_ceil(widest, count), size)  # micro batches per padded mini batch
    if vpp > 1:
        micros = _ceil(micros, pp) * pp
    bounds = [round(j * n_rows / count) for j in range(count + 1)]
    return list(zip(bounds, bounds[1:])), micros * size, size


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def take(batch: Mapping[str, Any], aligned: dict[str, torch.Tensor], start: int, stop: int, size: int):
    """Rows start..stop of `batch` and `aligned`, padded to `size` rows with copies of row 0 whose
    response_mask is zero: they add nothing to the loss, nor to its token and sequence counts."""
    if stop - start == size:
        sl = slice(start, stop)
        return {k: rows(v, sl) for k, v in batch.items()}, {k: v[sl] for k, v in aligned.items()}
    idx = torch.cat([torch.arange(start, stop), torch.zeros(size - (stop - start), dtype=torch.long)])
    sub, sub_aligned = {k: rows(v, idx) for k, v in batch.items()}, {k: v[idx] for k, v in aligned.items()}
    for part in (sub, sub_aligned):
        if "response_mask" in part:
            part["response_mask"] = part["response_mask"].clone()
            part["response_mask"][stop - start:] = 0
    return sub, sub_aligned
