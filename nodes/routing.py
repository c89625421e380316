"""Routing replay, as the YAML asks for it: a node records the experts each token was routed to
(params.routed_experts: true, the `routed_experts` key) and Megatron nodes replay them
(params.routing_replay: true, consuming it). R3 records in the rollout (vLLM, GPU only); R2 in the
old log-probs (Megatron), so the update routes as they did. Checks shared by both ends, run by `validate`."""

from siirl_dag.errors import Problem
from siirl_dag.strategies.vllm.options import ROUTES_NEED_GPU

KEY = "routed_experts"


def records(params: dict) -> tuple[str, ...]:
    """The key a recording node (a rollout, or the old log-probs) adds to what it produces."""
    return (KEY,) if params.get("routed_experts") else ()


def recording_engine(params: dict) -> dict:
    """The engine option a recording rollout needs: vLLM records routes only if started to."""
    return {"return_routed_experts": True} if params["routed_experts"] else {}


def replays(params: dict) -> tuple[str, ...]:
    """The key a replaying node consumes."""
    return (KEY,) if params.get("routing_replay") else ()


def problems(node, pipeline, param: str) -> list[Problem]:
    """An MoE model, a device whose vLLM records routes, one role per node."""
    if not node.params.get(param):
        return []
    where = pipeline.node_path(node.id) + ("params", param)
    if param == "routed_experts" and node.params.get("routing_replay"):
        return [Problem(where, "a node records the routes or replays them, not both; expected routed_experts: false "
                               "here (a replaying node's routes are the ones it was given)")]
    config = pipeline.models[node.model].hf_config() or {}
    if config and not (config.get("num_experts") or config.get("num_local_experts")):
        return [Problem(where, f"model '{node.model}' has no routed experts to replay; expected an MoE model, or "
                               f"{param}: false")]
    if node.strategy == "vllm" and pipeline.cluster.device != "cuda":
        return [Problem(where, f"{ROUTES_NEED_GPU}; this cluster's device is {pipeline.cluster.device}; expected a "
                               f"CUDA cluster, or {param}: false")]
    return []
