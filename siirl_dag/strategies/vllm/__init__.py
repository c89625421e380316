"""vLLM rollout strategy."""

from siirl_dag.strategies.vllm.rollout import VllmRollout

__all__ = ["VllmRollout"]
