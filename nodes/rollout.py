"""rollout: sample n responses per prompt with the vLLM strategy (in validation one each, at the options'
val_temperature: greedy by default)."""

from nodes import routing, templates
from siirl_dag.errors import Problem
from nodes.tools import resolve_tool
from siirl_dag.registry import node_kind

PRODUCES = ("prompts", "prompt_mask", "responses", "response_mask", "input_ids", "attention_mask",
            "position_ids", "rollout_logprobs", "response_length", "finish_reason", "weights_version",
            "token_weights_version")


def _consumes(params) -> tuple[str, ...]:
    """The prompts, or what a prompt template reads (the sample a second agent answers)."""
    if "prompt_template" not in params:
        return ("raw_prompt",)
    return templates.consumed(params["prompt_template"]) or ("raw_prompt",)


def _checks(node, pipeline) -> list[Problem]:
    problems = _lengths_fit(node, pipeline) + routing.problems(node, pipeline, "routed_experts")
    if "prompt_template" in node.params:
        try:
            templates.parse(node.params["prompt_template"])
        except ValueError as exc:
            problems.append(Problem(pipeline.node_path(node.id) + ("params", "prompt_template"), str(exc)))
    return problems


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


def temperature_differs(node, pipeline) -> list[Problem]:
    """Log-probs at another temperature than the samples were drawn at make every ratio against them
    off-policy, silently (verl hands the rollout's temperature to both): a warning at the node's."""
    import networkx as nx

    mine = node.params["temperature"]
    for up in sorted(nx.ancestors(pipeline.graph, node.id)):
        sampler = pipeline.nodes[up]
        if sampler.kind in ("rollout", "agent_rollout") and sampler.options["temperature"] != mine:
            theirs = sampler.options["temperature"]
            return [Problem(pipeline.node_path(node.id) + ("params", "temperature"), f"log-probs at temperature {mine}, "
                            f"but '{up}' samples at {theirs}, so every ratio against its samples is off-policy; "
                            f"expected temperature: {theirs}", severity="warning")]
    return []


def _prompt_lengths(node, pipeline, data) -> list[int]:
    """Each prompt's tokens as the engine will count them (a chat list through the template). Kept
    for later runs on the same files and tokenizer (`row_cache`), which then skip loading it."""
    from importlib.metadata import version

    from siirl_dag.data.row_cache import folder_identity, measured

    model, chat = pipeline.models[node.model], node.options["chat_template"]
    tools = [resolve_tool(ref).spec() for ref in node.params.get("tools", [])]  # an agent's, shown in the prompt
    tokenizer_files = folder_identity(model.tokenizer_path)
    what = None if tokenizer_files is None else \
        {"count": "prompt tokens", "tokenizer": tokenizer_files, "chat_template": chat, "transformers": version("transformers"),
         **({"tools": tools} if tools else {})}

    template = node.params.get("prompt_template")
    if template:  # the answered response is not known yet: its longest
        what = what and {**what, "prompt_template": template}

    def count(rows):
        from siirl_dag.strategies.samples import prompt_token_ids  # torch, as the tokenizer: only to count

        tokenizer = model.load_tokenizer()
        if not template:
            return [len(prompt_token_ids(tokenizer, row["raw_prompt"], chat, tools)) for row in rows]
        longest = pipeline.data.max_response_length if "response" in templates.fields(template) else 0
        return [len(prompt_token_ids(tokenizer, templates.render(template, {**row, "prompt": templates.prompt_text(
            row["raw_prompt"])}), chat, tools)) + longest for row in rows]

    return measured(data, what, count, f"prompt tokens for node '{node.id}'")


def _prompts_fit(node, pipeline, data) -> list[str]:
    """Every prompt within max_prompt_length: found here, not at the step that first draws it."""
    limit, chat = pipeline.data.max_prompt_length, node.options["chat_template"]
    template = node.params.get("prompt_template")
    lacking = templates.missing_extra(template, data) if template else []
    if lacking:
        return lacking
    bad = [(row["index"], n) for row, n in zip(data.rows, _prompt_lengths(node, pipeline, data)) if not 0 < n <= limit]
    if not bad:
        return []
    shown = "; ".join("'{}' row {} has {} tokens".format(*data.source(i), n) for i, n in bad[:3])
    built = " as its prompt_template builds them, with the longest response" if "prompt_template" in node.params else ""
    return [f"{len(bad)} of {len(data)} prompts{built} do not fit data.max_prompt_length = {limit} tokens "
            f"(chat_template: {str(chat).lower()}): {shown}{'; ...' if len(bad) > 3 else ''}; expected 1 to {limit} "
            "tokens: raise data.max_prompt_length (and max_model_len), drop those rows, or set "
            "data.filter_overlong_prompts: true"]


def weight_versions(out: dict, P: int, version: int, earlier=None) -> dict:
    """`token_weights_version`: each response token's weights, `version` but for the tokens `earlier`
    (the batch a partial rollout continues) had already; `weights_version`: each sample's oldest."""
    import torch

    tokens = out["attention_mask"][:, P:].bool()
    versions = tokens.long() * version
    if earlier is not None:
        versions = torch.where(earlier["attention_mask"][:, P:].bool(), earlier["token_weights_version"], versions)
    oldest = torch.where(tokens, versions, torch.iinfo(torch.long).max).min(dim=1).values.clamp(max=version)
    return {"token_weights_version": versions, "weights_version": oldest}


def _templated(template: str, batch, ctx, limit: int) -> list[str]:
    """Prompts built from the samples they answer, each within data.max_prompt_length tokens (a
    response too long is cut, counted in rollout/prompts_cut; the door checked the rest fits)."""
    built = templates.fitted_rows(template, templates.row_values(batch, ctx.tokenizer), ctx.engine, limit)
    ctx.metrics["rollout/prompts_cut"] = sum(cut for _, cut in built)
    return [text for text, _ in built]


@node_kind("rollout", consumes=_consumes, produces=lambda params: PRODUCES + routing.records(params),
           strategies=("vllm",), params_schema="rollout", check=_checks, expands=True, check_data=_prompts_fit,
           prompt_lengths=_prompt_lengths, resumes=True, engine_options=routing.recording_engine)
def rollout(batch, ctx):
    """Generate responses; rows are expanded n-fold (samples of one prompt adjacent), each token with
    the version of the weights that generated it (`token_weights_version`; `weights_version`: a
    sample's oldest). In a partial rollout (runtime.partial_rollout) a call generates a segment of
    `ctx.segment_tokens`, and the next call, given this node's own output, continues the samples it
    cut short with the weights held then."""
    from siirl_dag.strategies.samples import unpack_batch

    ctx.check_weights_version()
    sampling = {"validate": True, "seed": ctx.seed} if ctx.validating else {"seed": ctx.seed}
    P, R, version = ctx.data.max_prompt_length, ctx.data.max_response_length, ctx.engine.weights_version
    if ctx.resuming:
        out = ctx.engine.resume(*unpack_batch(batch), sampling, P, R, ctx.segment_tokens)
    else:
        template = ctx.params.get("prompt_template")
        prompts = _templated(template, batch, ctx, P) if template else batch["raw_prompt"]
        out = ctx.engine.generate(prompts, sampling, P, R, max_new_tokens=ctx.segment_tokens)
    out.update(weight_versions(out, P, version, batch if ctx.resuming else None))
    index = out.pop("sample_index")
    return dict(batch.merge(out)) if ctx.resuming else ctx.expand(index, out)
