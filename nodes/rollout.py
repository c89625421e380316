"""rollout: sample n responses per prompt with the vLLM strategy."""

from siirl_dag.registry import node_kind

PRODUCES = ("prompts", "prompt_mask", "responses", "response_mask", "input_ids", "attention_mask",
            "position_ids", "rollout_logprobs", "finish_reason")


@node_kind("rollout", consumes=("raw_prompt",), produces=PRODUCES, strategies=("vllm",), params_schema="rollout")
def rollout(batch, ctx):
    """Generate responses; rows are expanded n-fold (samples of one prompt adjacent)."""
    out = ctx.engine.generate(batch["raw_prompt"], greedy=ctx.validating, **ctx.params)
    return ctx.expand(out.pop("sample_index"), out)
