"""The memory estimate of a Megatron mesh: GiB on its busiest rank (siirl_dag.placement.memory).

Weights on the fullest pipeline stage (the embedding on the first, the LM head on the last); fp32
gradients (megatron's DDP buffer); Adam's two moments plus fp32 master weights when training in bf16,
sharded over the data-parallel ranks by the distributed optimizer; a LoRA adapter's own gradients and
state only, its base frozen. Activations after Korthikanti et al. (2022), per layer
sbh(10 + 24/t) + 5as²b/t bytes at 16 bit, /t for all with sequence parallelism, 2sbh with full
recompute, no s² term with flash attention (CUDA) or selective recompute; the first stage holds p
micro batches in flight under 1F1B, i.e. every layer's for one; plus fp32 logits on the last stage.
"""

from __future__ import annotations

from siirl_dag.models.shape import DTYPE_BYTES
from siirl_dag.placement.memory import GIB, MeshMemory, MeshWork
from siirl_dag.strategies.megatron.options import resolve

HINTS = {
    "weights": "more tensor or pipeline parallel (t, p; e for experts), or a smaller model",
    "gradients": "more t or p, or LoRA adapters instead of training every weight (models.<name>.lora)",
    "optimizer": "use_distributed_optimizer: true with more d, or more t or p",
    "activations": "a smaller micro_batch_size (or dynamic_micro_batch_tokens), recompute_granularity: full, or "
                   "sequence_parallel with t > 1",
    "logits": "a smaller micro_batch_size, or more t, which splits the vocabulary",
    "held": "param_offload, grad_offload and optimizer_offload on its nodes free the device while it is idle",
}

OFFLOADS = {"param_offload": "weights", "grad_offload": "gradients", "optimizer_offload": "optimizer"}
_OFFLOAD_OF = {term: option for option, term in OFFLOADS.items()}


def estimate(work: MeshWork) -> MeshMemory:
    m, d, opts = work.shape, work.dims, resolve(work.options)
    bf16 = opts["bf16"] if "bf16" in work.options else work.dtype == "bfloat16"
    width = DTYPE_BYTES["bfloat16" if bf16 else "float32"]
    vocab = -(-m.vocab // d.tp) * d.tp
    layers = -(-m.layers // d.pp)
    layer = (m.attention_params + m.dense_mlp_params) / d.tp + m.expert_params / (d.ep * d.etp)
    embedding = vocab * m.hidden / d.tp
    # the output layer: a value head's one column, or the LM head (a tied one is the embedding, but a
    # last stage apart from the first keeps its own copy); the final norm beside it
    head = m.hidden if opts["value_head"] else 0 if m.tied and d.pp == 1 else embedding
    params = layers * layer + max(embedding, head + m.hidden) if d.pp > 1 else layers * layer + embedding + head + m.hidden
    terms = {"weights": params * width}
    if work.trains:
        trainable, expert_share = _trainable(work, layers, params)
        dense_shard = d.dp * d.cp if opts["use_distributed_optimizer"] else 1
        expert_shard = d.edp if opts["use_distributed_optimizer"] else 1
        state = 12 if bf16 else 8  # fp32 moments (+ fp32 master weights for bf16 training)
        terms["weights"] += trainable * width if work.lora else 0
        terms["gradients"] = trainable * 4
        terms["optimizer"] = state * ((trainable - expert_share) / dense_shard + expert_share / expert_shard)
    terms.update(_activations(work, opts, width, vocab))
    gib = {k: v / GIB for k, v in terms.items()}
    resident = tuple(t for t in gib if t in OFFLOADS.values() and not (work.device == "cuda" and opts[_OFFLOAD_OF[t]]))
    return MeshMemory(gib, resident, HINTS, fixes=_fixes(work, opts))


def _fixes(work: MeshWork, opts: dict) -> list[dict]:
    """Option changes that keep the layout, the least intrusive first."""
    out = []
    if work.device == "cuda" and work.colocated and not all(opts[k] for k in OFFLOADS):
        out.append({k: True for k in OFFLOADS})
    if work.trains and not opts["use_distributed_optimizer"] and work.dims.dp * work.dims.cp > 1:
        out.append({"use_distributed_optimizer": True})
    if work.trains and opts["recompute_granularity"] != "full":
        out.append({"recompute_granularity": "full"})
    size = opts["micro_batch_size"]
    out += [{"micro_batch_size": size >> k} for k in range(1, size.bit_length())] if not opts["dynamic_micro_batch_tokens"] else []
    return out


def _trainable(work: MeshWork, layers: int, params: float) -> tuple[float, float]:
    """(trainable parameters on the rank, of them in routed experts)."""
    m, d = work.shape, work.dims
    if work.lora is None:
        return params, layers * m.expert_params / (d.ep * d.etp)
    dense, experts = m.lora_params(work.lora)
    return layers * (dense / d.tp + experts / (d.ep * d.etp)), layers * experts / (d.ep * d.etp)


def _activations(work: MeshWork, opts: dict, width: int, vocab: int) -> dict[str, float]:
    m, d = work.shape, work.dims
    tokens = opts["dynamic_micro_batch_tokens"] or opts["micro_batch_size"] * work.seq_len
    tokens /= d.cp
    sbh, t, sp = tokens * m.hidden, d.tp, opts["sequence_parallel"] and d.tp > 1
    mlp = 0.25 + 0.75 * m.active_ffn / (4 * m.hidden)  # 24/t is about 1/4 attention, 3/4 a 4h MLP
    full = sbh * (10 / t if sp else 10) + sbh * 24 * mlp / t
    if work.device != "cuda" and opts["recompute_granularity"] != "selective":  # no flash attention: s² scores
        full += 5 * m.heads * tokens * work.seq_len / d.cp / t
    scale = width / 2  # the coefficients count 16-bit activations
    logits = 2 * tokens * vocab / t * 4  # fp32 logits and their softmax (or its gradient)
    if not work.trains:
        return {"activations": 2 * full * scale, "logits": logits}
    stored = 2 * sbh / (t if sp else 1) if opts["recompute_granularity"] == "full" else full
    layers_held = -(-m.layers // d.pp) * d.pp  # 1F1B: p micro batches of a stage's layers on the first stage
    return {"activations": (layers_held * stored + full) * scale, "logits": logits}


def measured(chunks: list, train_state) -> dict[str, float]:
    """GiB this rank holds in what the estimate's first three terms count, from its tensors: distinct
    storages of the parameters, of their gradients (megatron's `main_grad` buffer), and of the
    optimizer's state and fp32 master weights (those that are not the parameters themselves)."""
    import torch

    seen: set[int] = set()

    def size(tensors) -> float:
        total = 0
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
        return total / GIB

    params = [p for chunk in chunks for p in chunk.parameters()]
    out = {"weights": size(params)}
    if train_state is not None:
        out["gradients"] = size(getattr(p, "main_grad", p.grad) for p in params)
        inner = [o.optimizer for o in getattr(train_state.optimizer, "chained_optimizers", [train_state.optimizer])]
        out["optimizer"] = size([t for o in inner for state in o.state.values() for t in state.values()]
                                + [p for o in inner for g in o.param_groups for p in g["params"]])
    return out
