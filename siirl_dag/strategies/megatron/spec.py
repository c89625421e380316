"""The Megatron strategy: training (and log-probs, values) on megatron-core, `engine.MegatronEngine`."""

from __future__ import annotations

from siirl_dag.strategies.spec import StrategySpec

SPEC = StrategySpec(
    name="megatron",
    engine="siirl_dag.strategies.megatron.engine:MegatronEngine",
    # megatron-core's keywords (parallel_state.initialize_model_parallel, TransformerConfig)
    parallel_options={"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
                      "vpp": "virtual_pipeline_model_parallel_size", "cp": "context_parallel_size",
                      "ep": "expert_model_parallel_size", "etp": "expert_tensor_parallel_size"},
    lora=True,
    option_rules="siirl_dag.strategies.megatron.options:resolve",
    dtype_rule="siirl_dag.strategies.megatron.options:dtype_options",
    memory_model="siirl_dag.strategies.megatron.memory:estimate",
    aliases=("megatron_train", "megatron_infer"),
)


def keywords(dims) -> dict[str, int | None]:
    """A mesh's sizes (ParallelDims) as megatron-core's keywords (None for no virtual pipeline, as it expects)."""
    return {key: None if size == "vpp" and dims.vpp == 1 else getattr(dims, size)
            for size, key in SPEC.parallel_options.items()}
