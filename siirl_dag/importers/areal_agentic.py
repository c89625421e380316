"""AReaL's agent workflows as the agent_rollout node, where a built-in matches what the workflow does:
TIR's tools (`tir.enable_tools: python;calculator`), AReaL's math agents that call calculator
functions (MathToolAgent), and the one that answers once (MathAgent: a plain rollout through the chat
template). Any other workflow (the user's class, a retry loop with feedback, tau2's simulated user) is
Python an import cannot convert: refused, saying what to write, with the limits that do carry.

The limits: model turns (`max_turns`, `agent_run_args.max_turns`, `econfig.max_steps`; TIR counts tool
calls, and one more turn answers), tokens per turn (`gconfig.max_new_tokens`), and the trajectory's
tokens, the prompt's included (`max_tokens_per_trajectory`, TIR's `max_length`, `gconfig.max_tokens`):
the response may have what the prompt (`train_dataset.max_length`) leaves of them.
"""

from __future__ import annotations

from siirl_dag.config import schema
from siirl_dag.importers.agentic import WRITE_AGENT, WRITE_ENV, positive, refuse_agent, use_tools
from siirl_dag.importers.draft import Draft
from siirl_dag.importers.source import Source

W = "areal.workflow"
CALCULATOR_AGENTS = {f"{W}.openai.math_agent.MathToolAgent", f"{W}.langchain.math_agent.MathToolAgent",
                     f"{W}.anthropic.claude_math_agent.MathToolAgent"}
CHAT_AGENTS = {f"{W}.{kind}.math_agent.MathAgent" for kind in ("openai", "anthropic", "langchain")}
ENVIRONMENTS = {f"{W}.multi_turn.MultiTurnWorkflow"}  # answer, be told it is wrong, answer again: an environment
TIR_TOOLS = {"python": "python", "daytona_python": "python", "calculator": "calculator"}
MARKERS = ("workflow", "econfig", "agent_run_args", "tir", "max_turns", "max_tokens_per_trajectory", "agent_builder_path",
           "n_trajs", "agent", "env", "tau2", "rollout.agent")  # the most telling first: the refusal points there
TURNS = ("max_turns", "agent_run_args.max_turns", "econfig.max_steps")
TRAJECTORY = ("max_tokens_per_trajectory", "gconfig.max_tokens", "rollout.agent.engine_max_tokens")
DEFAULT_TURNS, DEFAULT_TOKENS = 10, 32768  # AReaL's AgentConfig.max_turns and gconfig.max_tokens
PROMPT_DEFAULT = schema.load_schema("pipeline.schema.json")["properties"]["data"]["properties"]["max_prompt_length"]["default"]
PROXY = {"tool_call_parser": ("qwen", "qwen25", "hermes"), "export_style": ("concat",), "turn_discount": (1, 1.0),
         "chat_template_type": ("hf",)}
PROXY_WHY = {"tool_call_parser": "tool calls are read in Hermes format (<tool_call>{...}</tool_call>) here",
             "export_style": "a trajectory is one sample here (AReaL's concat); turns as samples of their own have no counterpart",
             "turn_discount": "rewards are not discounted by turn here",
             "chat_template_type": "the conversation is the tokens generated, never rendered again"}


def convert(src: Source, draft: Draft) -> None:
    """The draft's rollout becomes agent_rollout for a workflow a built-in matches; refused otherwise."""
    workflow = str(src.value("workflow", ""))
    markers = [] if "rlvr" in workflow.lower() else [k for k in MARKERS if src.under(k)]  # RLVR: one plain turn
    if not markers:
        _workflows(src, workflow)
        return
    tir = workflow.endswith("TIRWorkflow") or (not workflow and bool(src.under("tir")))
    if workflow in CHAT_AGENTS:
        src.remark("workflow", "one chat completion per episode, scored by its math answer: a plain rollout through "
                               "the chat template, scored by the reward node")
        draft.rollout["chat_template"] = True
        for key in TURNS:
            src.drop(key, "one turn per episode: MathAgent answers once")
        _proxy(src)
        return
    params = _limits(src, draft, tir)
    if tir:
        tools = _tir_tools(src, params)
    elif workflow in CALCULATOR_AGENTS:
        tools = ["calculator"]
        src.remark("workflow", "its arithmetic functions (add, subtract, multiply, divide, power, sqrt) become the "
                               "calculator tool, one expression per call; its instructions are the prompt's to give here")
    else:
        key = "workflow" if workflow else src.under(markers[0])[0]
        what = f"the workflow {workflow}" if workflow else f"the agent your training script builds ({key})"
        refuse_agent(src, key, what, WRITE_ENV if workflow in ENVIRONMENTS else WRITE_AGENT, params)
    _workflows(src, workflow)
    _proxy(src)
    use_tools(draft, {"tools": tools} | params)


def _workflows(src: Source, workflow: str) -> None:
    """The workflow is carried (as the node it became); validation runs the same node here."""
    src.take("workflow")
    if src.value("eval_workflow") in (None, workflow):
        src.take("eval_workflow")
    else:
        src.drop("eval_workflow", "validation runs the same rollout node as training (at options.val_temperature)")


def _limits(src: Source, draft: Draft, tir: bool) -> dict:
    """max_turns and max_tokens_per_turn; the trajectory's token budget becomes data.max_response_length."""
    if tir:
        calls = positive(src, "tir.max_turns", zero="no tool call") if src.has("tir.max_turns") else 2  # TIR's default
        calls = calls or 0
        turns = calls + 1
        src.remark("tir.max_turns", f"TIR counts tool calls: {calls} call(s) and the answer, max_turns {turns}")
    else:
        key = next((k for k in TURNS if src.value(k) is not None), None)
        turns = positive(src, key) if key else DEFAULT_TURNS
        if key is None:
            src.remark("max_turns", f"not given: AReaL's default, {DEFAULT_TURNS} turns")
    per_turn, given = draft.data.get("max_response_length"), draft.data.get("max_prompt_length")
    prompt = given or PROMPT_DEFAULT
    key = "tir.max_length" if tir else next((k for k in TRAJECTORY if src.value(k) is not None), None)
    budget = positive(src, key) if key else DEFAULT_TOKENS
    if budget is not None and budget <= prompt:
        src.problem(key, f"a trajectory of {budget} tokens leaves no response after prompts of {prompt} "
                         "(train_dataset.max_length); expected more tokens than the prompt's")
    if budget is None or budget <= prompt:  # reported at its line
        return {"max_turns": turns, "max_tokens_per_turn": per_turn}
    response = budget - prompt
    draft.data["max_response_length"] = response
    draft.rollout["max_tokens"] = None  # the response's budget, as data.max_response_length
    src.remark(key or "gconfig.max_tokens", f"{budget} tokens a trajectory{'' if key else ' (AReaL default)'}, the "
               f"prompt's {prompt} included{'' if given else ' (the default prompt length)'}: data.max_response_length "
               f"{response}, the model's turns and the tools' answers")
    per_turn = min(per_turn, response) if per_turn else None
    if per_turn:
        src.remark("gconfig.max_new_tokens", f"tokens per request: max_tokens_per_turn {per_turn}")
    return {"max_turns": turns, "max_tokens_per_turn": per_turn}


def _tir_tools(src: Source, params: dict) -> list[str]:
    """TIR's tools (`python;calculator`): the same behaviour here, called in another format."""
    names = [n.strip() for n in src.take("tir.enable_tools", "python", kind=str).replace(",", ";").split(";") if n.strip()]
    unknown = [n for n in names if n not in TIR_TOOLS]
    if unknown:
        src.problem("tir.enable_tools", f"{', '.join(unknown)} is not a TIR tool; expected {', '.join(TIR_TOOLS)}, "
                                        "separated by ';'")
    src.raise_problems()
    params["tool_timeout_s"] = positive(src, "tir.tool_timeout", (int, float))
    src.remark("tir.enable_tools", "TIR's markers (```python blocks, <calculator> tags) become tool calls in Hermes format "
                                   "(<tool_call>{...}</tool_call>), shown to the model by the chat template: a prompt or "
                                   "warm start teaching the markers does not carry" +
               ("; daytona_python runs in the local python sandbox" if "daytona_python" in names else ""))
    if src.take("tir.is_chat_model", False) is False:
        src.remark("tir.is_chat_model", "prompts go through the chat template here: it shows the model the tools")
    return list(dict.fromkeys(TIR_TOOLS[n] for n in names))


def _proxy(src: Source) -> None:
    """AReaL's agent proxy (`rollout.agent.*`, `export_style`): what matches this engine's loop is carried."""
    src.drop_under("rollout.agent", "AReaL's agent proxy; the rollout node runs the model's turns and the tools itself")
    for prefix in ("rollout.agent.", ""):
        for key, same in PROXY.items():
            if src.value(prefix + key) is None or src.value(prefix + key) in same:
                src.take(prefix + key)
            else:
                src.drop(prefix + key, PROXY_WHY[key])
    src.drop("rollout.agent.reasoning_parser", "<think> text stays in the response here, trained on as the model's tokens")
