"""logprob: per-token log-probs of the responses under a Megatron model (old policy or reference)."""

from nodes import routing
from siirl_dag.registry import node_kind

INPUTS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")


def _produces(params):
    return (params["output"],) + (("entropy",) if params.get("return_entropy") else ()) + routing.records(params)


def _checks(node, pipeline) -> list:
    """`adapters: off` on a model without adapters is a mistake worth naming; so is a temperature
    other than the rollout's."""
    from nodes.rollout import temperature_differs
    from siirl_dag.errors import Problem

    problems = temperature_differs(node, pipeline) + routing.problems(node, pipeline, "routing_replay") + \
        routing.problems(node, pipeline, "routed_experts")
    if not node.params["adapters"] and pipeline.models[node.model].lora is None:
        problems.append(Problem(pipeline.node_path(node.id) + ("params", "adapters"), f"model '{node.model}' has no "
                                "LoRA adapters to switch off; expected models.<name>.lora, or adapters: on"))
    return problems


@node_kind("logprob", consumes=lambda params: INPUTS + routing.replays(params), produces=_produces,
           strategies=("megatron",), params_schema="logprob", check=_checks)
def logprob(batch, ctx):
    """Forward only; writes `params.output` (old_logprobs or ref_logprobs), and `entropy` /
    `routed_experts` when asked."""
    out = ctx.engine.compute_logprobs(batch, temperature=ctx.params["temperature"], return_entropy=ctx.params["return_entropy"],
                                      adapters=ctx.params["adapters"], replay_routes=ctx.params["routing_replay"],
                                      record_routes=ctx.params["routed_experts"])
    out[ctx.params["output"]] = out.pop("logprobs")
    return out
