"""LoRA on megatron-core's parallel linear layers (megatron-core has none of its own).

The base model is frozen; each target layer (a ColumnParallelLinear or RowParallelLinear, dense or a
SequentialMLP expert's) gets `lora_A` [r, in] and `lora_B` [out, r] as parameters of its own, and a
forward hook adds `scale * B(A x)` to its output, so every name megatron and the HF table know keeps
its meaning. Megatron's DDP and optimizer skip frozen parameters: only the adapters get gradient
buffers and optimizer state (the distributed optimizer shards them alone).

Tensor parallel, the low-rank path mirrors its layer (exact gradients on every rank):
- column (linear_qkv, linear_fc1: output dim sharded): A replicated, B sharded like the weight's
  rows; the rank-r activation enters the TP region as the layer's input does (copied, its gradient
  all-reduced), or under sequence parallel is gathered along the sequence (A's gradient then summed
  over TP, as megatron does for parameters tagged `sequence_parallel`);
- row (linear_proj, linear_fc2: input dim sharded): A sharded like the weight's columns, B
  replicated; the partial rank-r activation is all-reduced, or under sequence parallel the delta is
  reduce-scattered like the layer's output (B's gradient summed over TP).
Routed experts under expert tensor parallel: the token dispatcher gives every expert TP rank the same
tokens and sums their outputs, so the forward needs no communication; the replicated factor (A of
fc1, B of fc2) sees a partial gradient on each rank, summed over the expert TP group in backward.
Fused layers get one adapter (q/k/v share A, so do gate/up); B's rows follow the fused layout, so
the HF export splits B as it splits the weight and repeats A (PEFT's format holds that exactly), and
a merge `W + scale * B A` is local to each shard. A is drawn from a generator seeded per global
module and cut to this rank's shard: every TP/EP layout starts from the same adapters.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import types
from typing import Iterator

import torch
import torch.nn.functional as F

from siirl_dag.models.lora import LoraSpec

# megatron module (relative to a layer) -> (the HF projections it fuses, its parallel side); experts:
# `mlp.experts.local_experts.<i>.` + the same fc1/fc2 names
MODULES = {
    "self_attention.linear_qkv": (("q_proj", "k_proj", "v_proj"), "column"),
    "self_attention.linear_proj": (("o_proj",), "row"),
    "mlp.linear_fc1": (("gate_proj", "up_proj"), "column"),
    "mlp.linear_fc2": (("down_proj",), "row"),
}
_EXPERT_PREFIX = "mlp.experts.local_experts."


def inject(chunks: list[torch.nn.Module], spec: LoraSpec, seed: int) -> int:
    """Freeze every parameter of the model chunks, then give each target layer its adapters (A drawn
    from `seed`). Returns how many layers got one."""
    from megatron.core import parallel_state as ps

    for chunk in chunks:
        for p in chunk.parameters():
            p.requires_grad_(False)
    ep_rank, count = ps.get_expert_model_parallel_rank(), 0
    for chunk in chunks:
        for layer in getattr(chunk.decoder, "layers", []):
            number = layer.layer_number - 1  # global
            for name, module in layer.named_modules():
                expert, local = None, name
                if name.startswith(_EXPERT_PREFIX):
                    index, _, local = name[len(_EXPERT_PREFIX):].partition(".")
                    local = "mlp." + local
                    expert = ep_rank * layer.mlp.experts.num_local_experts + int(index)
                scope = "experts." if expert is not None else ""
                if local in MODULES and all(scope + p in spec.targets for p in MODULES[local][0]):
                    _attach(module, spec, MODULES[local][1], f"{seed}.{number}.{expert}.{local}")
                    count += 1
    return count


def _attach(module: torch.nn.Module, spec: LoraSpec, side: str, key: str) -> None:
    """`lora_A`, `lora_B` and the forward hook on one parallel linear layer."""
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    weight = module.weight
    out_local, in_local = weight.shape
    tp = module.tp_group.size()
    comm = tp > 1 and not module.explicit_expert_comm  # routed experts: the token dispatcher does it
    in_full = in_local * tp if side == "row" else in_local
    full_a = torch.empty(spec.rank, in_full, dtype=torch.float32)
    gen = torch.Generator().manual_seed(int(hashlib.sha256(key.encode()).hexdigest()[:15], 16))
    if spec.init == "gaussian":
        full_a.normal_(0.0, 1.0 / spec.rank, generator=gen)
    else:  # kaiming_uniform_(a=sqrt(5)), as PEFT and torch's Linear initialise A
        bound = 1.0 / math.sqrt(in_full)
        full_a.uniform_(-bound, bound, generator=gen)
    a = full_a.chunk(tp, dim=1)[module.tp_group.rank()] if side == "row" else full_a
    module.lora_A = torch.nn.Parameter(a.to(device=weight.device, dtype=weight.dtype).contiguous())
    module.lora_B = torch.nn.Parameter(torch.zeros(out_local, spec.rank, device=weight.device, dtype=weight.dtype))
    sharded = module.lora_A if side == "row" else module.lora_B
    replicated = module.lora_B if side == "row" else module.lora_A
    # the grad norm counts a parameter marked parallel on every rank, others on the attention's TP rank 0
    # only: experts at expert TP 1 are each rank's own, whatever the attention's TP
    own = module.is_expert and tp == 1
    set_tensor_model_parallel_attributes(sharded, tp > 1 or own, 1 if side == "row" else 0, 1)
    set_tensor_model_parallel_attributes(replicated, own, 0, 1)
    replicated.sequence_parallel = comm and module.sequence_parallel  # its gradient is summed over TP
    for p in (module.lora_A, module.lora_B):
        p.allreduce = getattr(weight, "allreduce", True)  # experts: reduced over the expert data-parallel group
    module.lora = types.SimpleNamespace(side=side, scale=spec.scale, dropout=spec.dropout, comm=comm, enabled=True,
                                        expert_tp=module.explicit_expert_comm and tp > 1)
    module.register_forward_hook(_add_delta)
    module.sharded_state_dict = types.MethodType(_sharded_state_dict, module)


def _add_delta(module: torch.nn.Module, inputs: tuple, output: tuple) -> tuple:
    from megatron.core import tensor_parallel as tpl

    lora = module.lora
    if not lora.enabled:
        return output
    x, group, a, b = inputs[0], module.tp_group, module.lora_A, module.lora_B
    x = F.dropout(x, lora.dropout, module.training) if lora.dropout else x
    if lora.expert_tp:  # the replicated factor sees a partial gradient on each expert TP rank: sum it
        a, b = (tpl.copy_to_tensor_model_parallel_region(a, group=group), b) if lora.side == "column" \
            else (a, tpl.copy_to_tensor_model_parallel_region(b, group=group))
    h = F.linear(x, a)
    if lora.side == "column":
        if lora.comm:
            h = tpl.gather_from_sequence_parallel_region(h, True, group=group) if module.sequence_parallel \
                else tpl.copy_to_tensor_model_parallel_region(h, group=group)
        delta = F.linear(h, b)
    elif not lora.comm:
        delta = F.linear(h, b)
    elif module.sequence_parallel:
        delta = tpl.reduce_scatter_to_sequence_parallel_region(F.linear(h, b), group=group)
    else:
        delta = F.linear(tpl.reduce_from_tensor_model_parallel_region(h, group=group), b)
    out, bias = output
    return out + lora.scale * delta, bias


def _sharded_state_dict(module: torch.nn.Module, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
    """The layer's own sharded state dict, its adapters sharded along the same axis as their weight."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    column = module.lora.side == "column"
    axes = {"weight": 0, "bias": 0, "lora_B": 0} if column else {"weight": 1, "lora_A": 1}
    return make_sharded_tensors_for_checkpoint(module.state_dict(prefix="", keep_vars=True), prefix, axes,
                                               sharded_offsets, tp_group=module.tp_group,
                                               dp_cp_group=metadata["dp_cp_group"])


def layers(chunks: list[torch.nn.Module]) -> Iterator[torch.nn.Module]:
    """Every layer of the chunks that holds an adapter."""
    for chunk in chunks:
        yield from (m for m in chunk.modules() if hasattr(m, "lora"))


@contextlib.contextmanager
def disabled(chunks: list[torch.nn.Module]) -> Iterator[None]:
    """Meanwhile the model computes as its frozen base (a reference model that holds no weights of its own)."""
    held = list(layers(chunks))
    for m in held:
        m.lora.enabled = False
    try:
        yield
    finally:
        for m in held:
            m.lora.enabled = True


def merged(module: torch.nn.Module) -> torch.Tensor:
    """This rank's shard of `W + scale * B A` of an adapted layer (a new tensor; the layer unchanged)."""
    delta = module.lora_B.float() @ module.lora_A.float()
    return (module.weight.float() + module.lora.scale * delta).to(module.weight.dtype)
