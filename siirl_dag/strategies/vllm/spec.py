"""The vLLM strategy: rollouts (generation, and the probe's log-probs), `rollout.VllmRollout`."""

from __future__ import annotations

from siirl_dag.strategies.spec import StrategySpec

SPEC = StrategySpec(
    name="vllm",
    engine="siirl_dag.strategies.vllm.rollout:VllmRollout",
    parallel_options={"tp": "tensor_parallel_size", "pp": "pipeline_parallel_size"},  # vllm.LLM's arguments
    lora=True,
    option_rules="siirl_dag.strategies.vllm.options:resolve_options",
    dtype_rule="siirl_dag.strategies.vllm.options:dtype_options",
    memory_model="siirl_dag.strategies.vllm.memory:estimate",
)
