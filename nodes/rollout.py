"""rollout: sample n responses per prompt with the vLLM strategy (greedy, one each, in validation)."""

from siirl_dag.registry import node_kind

PRODUCES = ("prompts", "prompt_mask", "responses", "response_mask", "input_ids", "attention_mask",
            "position_ids", "rollout_logprobs", "response_length", "finish_reason")


@node_kind("rollout", consumes=("raw_prompt",), produces=PRODUCES, strategies=("vllm",), params_schema="rollout")
def rollout(batch, ctx):
    """Generate responses; rows are expanded n-fold (samples of one prompt adjacent)."""
    ctx.check_weights_version()
    sampling = {"greedy": True} if ctx.validating else {"seed": ctx.seed}
    out = ctx.engine.generate(batch["raw_prompt"], sampling, ctx.data.max_prompt_length, ctx.data.max_response_length)
    return ctx.expand(out.pop("sample_index"), out)
