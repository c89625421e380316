"""agent_rollout: multi-turn rollouts in which the model calls tools (nodes/tools, or a user's
`module:function` decorated with @siirl_dag.registry.tool). Produces what `rollout` produces, so the
log-prob, reward, advantage and loss nodes work unchanged: `response_mask` covers the model's own
tokens, and the tools' answers are attended to (`attention_mask`) but never trained on."""

from nodes import agent_loop
from nodes.rollout import PRODUCES, _lengths_fit, _prompt_lengths, _prompts_fit, weight_versions
from nodes.tool_calls import Observations
from nodes.tools import resolve_tool
from siirl_dag.errors import Problem
from siirl_dag.registry import node_kind

STOP = "</tool_call>"  # a turn with a call ends there, and the tools answer


def _check(node, pipeline) -> list[Problem]:
    """Tools that exist and can run here; a turn that fits the response budget."""
    problems, where = _lengths_fit(node, pipeline), pipeline.node_path(node.id) + ("params",)
    for i, ref in enumerate(node.params["tools"]):
        try:
            why = resolve_tool(ref).available
            why = why() if why else None
        except LookupError as exc:
            why = str(exc)
        if why:
            problems.append(Problem(where + ("tools", i), why))
    per_turn, budget = node.params["max_tokens_per_turn"], pipeline.data.max_response_length
    if per_turn is not None and per_turn > budget:
        problems.append(Problem(where + ("max_tokens_per_turn",), f"{per_turn} tokens per turn exceed the response "
                                f"budget data.max_response_length = {budget}; expected at most {budget}"))
    return problems


def _template_fits(node, pipeline, data) -> list[str]:
    """The prompts fit; and the chat template can show the tools' answers after a turn."""
    try:
        Observations(pipeline.models[node.model].load_tokenizer()).text(["1"], False)
    except (ValueError, TypeError) as exc:
        return [f"the chat template of model '{node.model}' cannot show tool answers: {exc}"]
    return _prompts_fit(node, pipeline, data)


@node_kind("agent_rollout", consumes=("raw_prompt",), produces=PRODUCES, strategies=("vllm",),
           params_schema="agent_rollout", check=_check, expands=True, check_data=_template_fits, prompt_lengths=_prompt_lengths)
def agent_rollout(batch, ctx):
    """Trajectories of up to max_turns turns (n per prompt; one in validation, at val_temperature)."""
    from siirl_dag.strategies.samples import Sample, pack_batch, prompt_token_ids

    ctx.check_weights_version()
    engine, p, data = ctx.engine, ctx.node.params, ctx.data
    tools = {tool.name: tool for tool in map(resolve_tool, p["tools"])}
    specs = [tool.spec() for tool in tools.values()]
    prompts = [prompt_token_ids(engine.tokenizer, x, engine.options["chat_template"], specs) for x in batch["raw_prompt"]]
    sampling = {"validate": True} if ctx.validating else {}  # one sample at val_temperature (default 0: greedy)
    limits = agent_loop.AgentLimits(p["max_turns"], p["max_tokens_per_turn"] or data.max_response_length,
                                    data.max_response_length, p["tool_timeout_s"], p["tool_workers"])
    turns = engine.turns(sampling, data.max_response_length, [STOP])
    n = 1 if ctx.validating else engine.options["n"]
    trajectories = agent_loop.run(turns, prompts, n, tools, limits, engine.tokenizer, ctx.seed)
    samples = [Sample(t.prompt_index, t.ids, t.logprobs, t.finish_reason, t.mask) for t in trajectories]
    out = pack_batch(prompts, samples, data.max_prompt_length, data.max_response_length, engine.pad_token_id)
    out.update(weight_versions(out, data.max_prompt_length, engine.weights_version))
    ctx.metrics.update(agent_loop.metrics(trajectories))
    return ctx.expand(out.pop("sample_index"), out)
