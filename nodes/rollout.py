"""rollout: sample n responses per prompt with the vLLM strategy (greedy, one each, in validation)."""

import weakref

from siirl_dag.errors import Problem
from siirl_dag.registry import node_kind

PRODUCES = ("prompts", "prompt_mask", "responses", "response_mask", "input_ids", "attention_mask",
            "position_ids", "rollout_logprobs", "response_length", "finish_reason")
_COUNTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # dataset -> {(node id, row index): tokens}


def _lengths_fit(node, pipeline) -> list[Problem]:
    """Prompt + response must fit the engine's context (max_model_len, or the model's own limit)."""
    need = pipeline.data.max_prompt_length + pipeline.data.max_response_length
    limit = node.options.get("max_model_len")
    source = "max_model_len"
    if limit is None:
        limit, source = (pipeline.models[node.model].hf_config() or {}).get("max_position_embeddings"), \
            "the model's max_position_embeddings (max_model_len: null)"
    if limit is None or need <= limit:
        return []
    return [Problem(pipeline.node_path(node.id) + ("options", "max_model_len"),
                    f"data.max_prompt_length + data.max_response_length = {need} do not fit {source} = {limit}; "
                    f"expected max_model_len >= {need}, or shorter lengths")]


def _prompt_lengths(node, pipeline, data) -> list[int]:
    """Each prompt's tokens as the engine will count them (a chat list through the template). Counted
    once per row and node: data.filter_overlong_prompts asks, then `_prompts_fit` asks again."""
    from siirl_dag.strategies.vllm.layout import prompt_token_ids

    counted = _COUNTED.setdefault(data, {})
    missing = [row for row in data.rows if (node.id, row["index"]) not in counted]
    if missing:
        tokenizer, chat = pipeline.models[node.model].load_tokenizer(), node.options["chat_template"]
        for row in missing:
            counted[node.id, row["index"]] = len(prompt_token_ids(tokenizer, row["raw_prompt"], chat))
    return [counted[node.id, row["index"]] for row in data.rows]


def _prompts_fit(node, pipeline, data) -> list[str]:
    """Every prompt within max_prompt_length: found here, not at the step that first draws it."""
    limit, chat = pipeline.data.max_prompt_length, node.options["chat_template"]
    bad = [(row["index"], n) for row, n in zip(data.rows, _prompt_lengths(node, pipeline, data)) if not 0 < n <= limit]
    if not bad:
        return []
    shown = "; ".join("'{}' row {} has {} tokens".format(*data.source(i), n) for i, n in bad[:3])
    return [f"{len(bad)} of {len(data)} prompts do not fit data.max_prompt_length = {limit} tokens "
            f"(chat_template: {str(chat).lower()}): {shown}{'; ...' if len(bad) > 3 else ''}; expected 1 to {limit} "
            "tokens: raise data.max_prompt_length (and max_model_len), drop those rows, or set "
            "data.filter_overlong_prompts: true"]


@node_kind("rollout", consumes=("raw_prompt",), produces=PRODUCES, strategies=("vllm",), params_schema="rollout",
           check=_lengths_fit, check_data=_prompts_fit, prompt_lengths=_prompt_lengths)
def rollout(batch, ctx):
    """Generate responses; rows are expanded n-fold (samples of one prompt adjacent)."""
    ctx.check_weights_version()
    sampling = {"greedy": True} if ctx.validating else {"seed": ctx.seed}
    out = ctx.engine.generate(batch["raw_prompt"], sampling, ctx.data.max_prompt_length, ctx.data.max_response_length)
    return ctx.expand(out.pop("sample_index"), out)
