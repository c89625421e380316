"""logprob: per-token log-probs of the responses under a Megatron model (old policy or reference)."""

from siirl_dag.registry import node_kind

INPUTS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")


def _produces(params):
    return (params["output"],) + (("entropy",) if params.get("return_entropy") else ())


@node_kind("logprob", consumes=INPUTS, produces=_produces, strategies=("megatron",), params_schema="logprob")
def logprob(batch, ctx):
    """Forward only; writes `params.output` (old_logprobs or ref_logprobs)."""
    out = ctx.engine.compute_logprobs(batch, temperature=ctx.params["temperature"], return_entropy=ctx.params["return_entropy"])
    result = {ctx.params["output"]: out["logprobs"]}
    if ctx.params["return_entropy"]:
        result["entropy"] = out["entropy"]
    return result
