"""Mesh -> megatron parallel_state, and HF model directory -> GPTModel chunks with HF weights
(a language model, or with `value_head` a critic: the same trunk under a 1-wide value head)."""

from __future__ import annotations

from typing import Any

import torch

from siirl_dag.models.lora import LoraSpec
from siirl_dag.errors import ConfigError
from siirl_dag.placement.parallel_dims import ParallelDims
from siirl_dag.strategies.megatron import cpu_compat, lora
from siirl_dag.strategies.megatron.hf_config import HFSpec, read_hf_config, transformer_config_kwargs
from siirl_dag.strategies.megatron.hf_convert import load_hf
from siirl_dag.strategies.megatron.spec import keywords


def init_parallel(mesh: ParallelDims, seed: int) -> None:
    """Create megatron's process groups once per process (re-use them when the mesh matches)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    cpu_compat.apply()
    cpu_compat.apply_without_te()
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_context_parallel_world_size(), ps.get_expert_model_parallel_world_size())
        if have != (mesh.tp, mesh.pp, mesh.cp, mesh.ep):
            raise ConfigError(f"this process already holds a megatron mesh (tp,pp,cp,ep)={have}; "
                              f"expected the same for every megatron node it hosts, got {mesh}")
    else:
        ps.initialize_model_parallel(**keywords(mesh))
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def use_transformer_engine() -> bool:
    """megatron-core builds its layers from Transformer Engine on a GPU that has it; else from its own."""
    return torch.cuda.is_available() and cpu_compat.te_installed()


class ValueHead(torch.nn.Linear):
    """The critic's output layer (verl's LinearForLastLayer): hidden -> one value per position.

    Replicated on TP ranks (a 1-wide output cannot be split); zero-initialised, so a critic
    without a trained head predicts 0. With sequence parallelism each TP rank sees a slice of
    the sequence: the values are gathered, and the weight's grads are summed over TP by
    megatron (the `sequence_parallel` tag), as for norm weights.
    """

    def __init__(self, config, device: torch.device):
        super().__init__(config.hidden_size, 1, bias=False, device=device, dtype=config.params_dtype)
        torch.nn.init.zeros_(self.weight)
        self.sequence_parallel = config.sequence_parallel
        self.weight.sequence_parallel = config.sequence_parallel
        self.weight.is_embedding_or_output_parameter = True

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None):  # GPTModel's call
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        values = super().forward(hidden)
        if self.sequence_parallel:
            values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False)
        return values, None


def build_model(spec: HFSpec, config, mesh: ParallelDims, device: torch.device,
                lora_spec: LoraSpec | None = None, seed: int = 0) -> list[torch.nn.Module]:
    """GPTModel chunks (one per virtual stage) of this rank on `device`, holding the HF weights, and
    frozen (a value model's head aside) under adapters with `lora_spec` (their layers local, not Transformer Engine's, which fuse the
    pre-norms into the linears an adapter must see the input of). megatron makes its parallel layers'
    weights on the GPU itself, but not the torch modules of its local spec (the RMSNorms without Apex
    or Transformer Engine): the chunks are moved as a whole. Without Transformer Engine the local spec's
    core attention and MLP are the leaner ones of local_layers.py."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from siirl_dag.strategies.megatron import local_layers

    cpu_compat.apply()  # megatron modules imported since init_parallel get the shims too
    vocab = -(-spec.vocab_size // mesh.tp) * mesh.tp
    with_te = use_transformer_engine() and lora_spec is None
    chunks = []
    for vp in range(mesh.vpp):
        vp_stage = vp if mesh.vpp > 1 else None
        layer_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=with_te, normalization="RMSNorm",
                                                vp_stage=vp_stage, pp_rank=ps.get_pipeline_model_parallel_rank())
        if not with_te:
            local_layers.use_lean_layers(layer_spec)
        chunk = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=vocab,
            max_sequence_length=spec.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=spec.tied,
            position_embedding_type="rope",
            rotary_base=spec.rotary_base,
            rope_scaling=spec.rope_scaling_factor is not None,
            rope_scaling_factor=spec.rope_scaling_factor or 8.0,
            parallel_output=True,
            vp_stage=vp_stage,
        )
        if spec.value_head and chunk.post_process:
            chunk.output_layer = ValueHead(config, chunk.output_layer.weight.device)
        chunk.to(device)
        # the local spec's torch norms are made in float32 whatever params_dtype (megatron's own loop casts the
        # whole model, Float16Module): every weight in params_dtype, as its mixed-precision optimizer expects
        for p in chunk.parameters():
            if p.dtype != config.params_dtype:
                p.data = p.data.to(config.params_dtype)
        chunks.append(chunk)
    load_hf(chunks, spec)
    if lora_spec is not None:
        lora.inject(chunks, lora_spec, seed)
        for chunk in chunks if spec.value_head else ():  # a critic's head is new: it trains beside the adapters
            if chunk.post_process:
                chunk.output_layer.weight.requires_grad_(True)
    return chunks


def model_config_kwargs(path: str, value_head: bool = False) -> tuple[HFSpec, dict[str, Any]]:
    spec = read_hf_config(path, value_head)
    return spec, transformer_config_kwargs(spec)
