"""Routing replay: each MoE router takes the experts the rollout chose for a token instead of its own
top-k, so log-probs and the update compute what was sampled (R3); or those the old log-probs' forward
chose, so the update routes as they did (R2: `Record` and `recorded` give back what the routers of a
forward chose). Only the choice is replayed: the router's probabilities for the chosen experts come
from its live logits, so it still trains.

`routed_experts` [B, P+R, layers, topk] is vLLM's record in the batch layout (every decoder layer,
an expert id per slot; strategies/samples.py): it covers each row's real tokens but the last
one, which no kept log-prob depends on (causal attention), as no padding does either. Those
positions take experts 0..topk-1. megatron-core's RouterReplay (`moe_enable_routing_replay`) gives
each router the hook; this module hands each router its layer's ids for the tokens it sees: the
sequence-first [s, b] order of its input, this rank's share under sequence and context parallelism.
"""

from __future__ import annotations

import torch


def align(routes: torch.Tensor, src: torch.Tensor, lengths: torch.Tensor, topk: int) -> torch.Tensor:
    """[B, P+R, L, K] -> [B, seq, L, K] long, as batching.align moves the tokens: position i of a row
    is its token src[row, i]; positions from its last real token on take experts 0..K-1."""
    if routes.shape[-1] != topk:
        raise ValueError(f"routed_experts has {routes.shape[-1]} experts per token; the model routes to {topk}")
    B, seq = src.shape
    gathered = routes.long().gather(1, src.clamp(max=routes.shape[1] - 1)[:, :, None, None]
                                    .expand(B, seq, *routes.shape[2:]))
    uncovered = torch.arange(seq)[None, :] >= (lengths - 1)[:, None]
    return torch.where(uncovered[:, :, None, None], torch.arange(topk).expand_as(gathered), gathered)


def routers(chunk: torch.nn.Module) -> list[tuple[int, object]]:
    """(decoder layer index, RouterReplay) of each MoE router of a model chunk, in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [(m.layer_number - 1, m.router_replay) for m in chunk.modules()
            if isinstance(m, TopKRouter) and m.router_replay is not None]


def release(chunks: list[torch.nn.Module]) -> None:
    """megatron lists every RouterReplay of the process in one class-level list, which only its
    global calls use; the engine drives its own routers, so they leave that list (and the engine's
    memory goes with the engine)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    mine = {id(r) for chunk in chunks for _, r in routers(chunk)}
    RouterReplay.global_router_replay_instances[:] = [
        r for r in RouterReplay.global_router_replay_instances if id(r) not in mine]


def local_tokens(routes: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """A micro batch's aligned routes [b, s, L, K] -> [tokens, L, K] in the order this rank's routers
    see them: its context-parallel chunks, sequence-first, its tensor-parallel slice under SP."""
    from megatron.core import parallel_state as ps

    from siirl_dag.strategies.megatron import context_parallel

    tokens = context_parallel.local(routes).transpose(0, 1)
    if sequence_parallel:
        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        tokens = tokens.chunk(tp, dim=0)[rank]
    return tokens.reshape(-1, *routes.shape[2:])


def recorded(records: dict[tuple[int, int], torch.Tensor], rows: int, seq: int, layers: int, topk: int, experts: int,
             sequence_parallel: bool, src: torch.Tensor, lengths: torch.Tensor, total: int) -> torch.Tensor:
    """What the routers chose, {(micro batch, layer): [tokens, K]} of this rank, as the batch's
    `routed_experts` [rows, total, L, K]: the tokens of every TP / CP rank and the layers of every
    pipeline stage put together (each rank fills only its own entries of a zero tensor, then a sum),
    back in the batch layout (`src`: batching.source_positions); 0 on padding. uint8 up to 256
    `experts`, int32 past them, as a rollout's (strategies.samples)."""
    from megatron.core import parallel_state as ps

    positions = local_tokens(torch.arange(seq)[None, :, None, None], sequence_parallel).flatten()
    full = torch.zeros(rows, seq, layers, topk, dtype=torch.int32)
    for (micro, layer), chosen in records.items():
        b = chosen.shape[0] // len(positions)
        full[micro * b:(micro + 1) * b, positions, layer] = chosen.view(len(positions), b, topk).transpose(0, 1).int().cpu()
    groups = [ps.get_pipeline_model_parallel_group(), ps.get_context_parallel_group()]
    if sequence_parallel:
        groups.append(ps.get_tensor_model_parallel_group())
    for group in groups:
        if torch.distributed.get_world_size(group) > 1:
            device = "cuda" if torch.distributed.get_backend(group) == "nccl" else "cpu"
            on = full.to(device)
            torch.distributed.all_reduce(on, group=group)
            full = on.cpu()
    out = torch.zeros(rows, total, layers, topk, dtype=torch.uint8 if experts <= 256 else torch.int32)
    real = torch.arange(seq)[None, :] < lengths[:, None]
    row_of = torch.arange(rows)[:, None].expand_as(src)
    out[row_of[real], src[real]] = full[real].to(out.dtype)
    return out


class Record:
    """Keeps what a chunk's routers choose in the forward that follows: records[(micro, layer)]."""

    def __init__(self, found: list[tuple[int, object]], records: dict | None, micro: int | None):
        self.found, self.records, self.micro = (found, records, micro) if records is not None else ([], None, None)

    def __enter__(self):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for _, replay in self.found:
            replay.set_router_replay_action(RouterReplayAction.RECORD)
        return self

    def __exit__(self, *exc):
        for layer, replay in self.found:
            self.records[(self.micro, layer)] = replay.get_recorded_indices()
            replay.clear_indices()
            replay.clear_router_replay_action()


class Replay:
    """Sets a chunk's routers to replay one micro batch's routes for the forward that follows. With
    `recompute` (activation recompute re-runs the routers in the backward) the routes also queue for
    it: between forwards the routers replay the queue (megatron's REPLAY_BACKWARD), which the
    schedule's backwards take in the order the forwards came, per router; `reset` empties it."""

    def __init__(self, found: list[tuple[int, object]], routes: torch.Tensor | None, sequence_parallel: bool,
                 device: torch.device, recompute: bool = False):
        self.found, self.recompute = (found if routes is not None else []), recompute
        if self.found:
            tokens = local_tokens(routes, sequence_parallel).to(device)
            self.targets = [tokens[:, layer] for layer, _ in self.found]

    def __enter__(self):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for (_, replay), target in zip(self.found, getattr(self, "targets", ())):
            replay.target_topk_idx = target
            if self.recompute:
                replay.replay_backward_list.append(target)
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        return self

    def __exit__(self, *exc):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for _, replay in self.found:
            if self.recompute:
                replay.target_topk_idx = None
                replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
            else:
                reset([(None, replay)])


def reset(found: list[tuple[int, object]]) -> None:
    """Routers back to their own top-k, nothing kept (after a schedule's run)."""
    for _, replay in found:
        replay.clear_indices()
        replay.clear_router_replay_action()
