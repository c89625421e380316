"""verl's multi-turn rollouts (`rollout.multi_turn.*`, `rollout.agent.*`) as the agent_rollout node.

verl's tool agent loop is this engine's tool loop. Its tool config (`multi_turn.tool_config_path`,
`tools: [{class_name, config, tool_schema}]`) is read as YAML where it is found (`side_files`); a
tool class that behaves as a built-in tool carries over (SandboxFusion's code interpreter runs Python
code, as `python` does). Any other tool class, an Interaction (a simulated user answering each turn)
and a custom agent loop are verl's Python: listed as not carried, with what to write instead, and
when nothing of the agent carries the import stops saying so. verl ends a trajectory after
max_assistant_turns model turns or max_user_turns rounds of answers (the tools' or the user's): at
most min(assistant, user + 1) model turns, which is max_turns here.
"""

from __future__ import annotations

from pathlib import Path

from siirl_dag.importers import side_files
from siirl_dag.importers.agentic import WRITE_AGENT, WRITE_ENV, WRITE_TOOL, positive, refuse_agent, use_tools
from siirl_dag.importers.draft import Draft
from siirl_dag.importers.features import refuse
from siirl_dag.importers.source import Source, short

A = "actor_rollout_ref"
MT, AG = f"{A}.rollout.multi_turn", f"{A}.rollout.agent"
TOOLS, TALK, LOOPS = f"{MT}.tool_config_path", f"{MT}.interaction_config_path", f"{AG}.agent_loop_config_path"
OWN_LOOPS = ("single_turn_agent", "tool_agent")  # verl's; any other default_agent_loop is a custom one
SANDBOX = "verl.tools.sandbox_fusion_tools.SandboxFusionTool"
CHECKS = "checks the answer against the ground truth and answers with its reward (the reward node scores the final answer here)"
VERL_TOOLS = {"verl.tools.gsm8k_tool.Gsm8kTool": CHECKS, "verl.tools.geo3k_tool.Geo3kTool": CHECKS,
              "verl.tools.search_tool.SearchTool": "queries a retrieval service",
              "verl.tools.mcp_search_tool.MCPSearchTool": "calls the tools of an MCP server",
              "verl.tools.image_zoom_in_tool.ImageZoomInTool": "crops the sample's image"}
SANDBOX_CONFIG = {"sandbox_fusion_url": "the code runs in a bubblewrap sandbox on this machine, without network, not in "
                                        "a SandboxFusion service",
                  "rate_limit": "no rate limit here: tool_workers bounds the calls running at once",
                  "enable_global_rate_limit": "no rate limit here: tool_workers bounds the calls running at once",
                  "memory_limit_mb": "the sandbox's own limits apply (nodes/tools/sandbox_policy.py)"}
NO_COUNTERPART = {
    f"{MT}.max_parallel_calls": "every call of a turn runs here",
    f"{MT}.max_tool_response_length": "a tool's long answer is cut at its end here (nodes/tool_calls.py)",
    f"{MT}.tool_response_truncate_side": "a tool's long answer is cut at its end here (nodes/tool_calls.py)",
    f"{MT}.use_inference_chat_template": "a trajectory is the tokens generated, never rendered again (verl's false)",
    f"{MT}.tokenization_sanity_check_mode": "turns are never tokenized again here",
    f"{MT}.num_repeat_rollouts": "options.n trajectories per prompt",
    f"{AG}.num_workers": "the tool loop runs in the rollout's own process; tool_workers calls at once",
    f"{AG}.custom_async_server": "the rollout node serves its vLLM engine itself",
    f"{A}.rollout.trace": "trace a run with --trace",
}


def convert(src: Source, draft: Draft) -> None:
    """The draft's rollout becomes agent_rollout for a multi-turn source; refused where its agent is all
    verl's (or the user's) Python."""
    loop = src.value(f"{AG}.default_agent_loop", "single_turn_agent")
    given = [key for key in (TOOLS, TALK, LOOPS) if src.keys.get(key, (None,))[0] not in (None, "")]
    unread = _unread_config(src)
    if not (src.value(f"{MT}.enable") is True or given or loop != "single_turn_agent" or unread):
        src.take(f"{AG}.default_agent_loop")
        src.drop_under(MT, "multi-turn is off")
        return
    for key, why in NO_COUNTERPART.items():
        src.drop_under(key, why)
    src.drop(LOOPS, f"custom agent loops (verl's Python, picked per sample by its agent_name): each is {WRITE_AGENT}")
    for key in (f"{MT}.enable", f"{AG}.default_agent_loop", f"{A}.rollout.mode"):
        src.take(key)
    if src.take("data.return_raw_chat", True) is not True:
        src.remark("data.return_raw_chat", "prompts go through the chat template here, which shows the model its tools")
    if loop in OWN_LOOPS and not (unread or TOOLS in given or TALK in given):
        src.drop_under(MT, "no tools and no interaction: one turn, a plain rollout through the chat template")
        draft.rollout["chat_template"] = True
        return
    params = {"max_turns": _max_turns(src)}
    if loop not in OWN_LOOPS:
        refuse_agent(src, f"{AG}.default_agent_loop", f"the agent loop '{loop}' (a class named in {LOOPS})", WRITE_AGENT, params)
    if unread and not (TOOLS in given or TALK in given):
        refuse(src, "--config-name", f"{unread} names a multi-turn rollout whose settings (tool config, turn limits) are in "
                                     f"{unread}.yaml, which is not found; expected it beside the script, or "
                                     f"{TOOLS}=... on the command line")
    tools, missing = _tools(src, params) if TOOLS in given else ([], [])
    talk = _interaction(src) if TALK in given else None
    if missing and not tools:
        refuse_agent(src, TOOLS, "; ".join(missing), WRITE_TOOL, params)
    if talk and not tools:
        refuse_agent(src, TALK, talk, WRITE_ENV, params)
    if params["max_turns"] is None:
        src.remark(f"{MT}.max_assistant_turns", "verl sets no turn limit (only the response length ends a trajectory): "
                                                "max_turns is this engine's default, 4; raise it for longer trajectories")
    _format(src)
    use_tools(draft, {"tools": tools} | params)


def _unread_config(src: Source) -> str | None:
    """The script's named config when its name says multi-turn and it was not found (its settings unknown)."""
    name = str(src.value("--config-name", "")).removesuffix(".yaml").strip("'\"")
    read = any(Path(file).stem == name for file, _ in src.origins.values())
    return name if "multiturn" in name and not read else None


def _max_turns(src: Source) -> int | None:
    """Model turns per trajectory: verl stops after max_assistant_turns, or after max_user_turns rounds of answers."""
    assistant = positive(src, f"{MT}.max_assistant_turns", zero="no limit")
    user = positive(src, f"{MT}.max_user_turns", zero="no limit")
    limits = [t for t in (assistant, user + 1 if user else None) if t]
    if not limits:
        return None
    if user and user + 1 == min(limits) and user + 1 != assistant:
        src.remark(f"{MT}.max_user_turns", f"{user} rounds of answers: at most {user + 1} model turns, max_turns {user + 1}")
    return min(limits)


def _entries(src: Source, key: str, section: str, kind: str) -> tuple[str, list[int], str]:
    """Read the YAML file `key` names, a list of `section` entries: the prefix of its keys here, the
    entries' indices, and where it was read (for the audit)."""
    path, tried = side_files.find(src, key)
    if path is None:
        written = short(str(src.keys[key][0]).strip("'\""))
        where = (f"tried {', '.join(short(side_files.shown(src, p)) for p in tried)}" if tried else
                 f"only running the script gives its path: {src.unresolved.get(key)}")
        refuse(src, key, f"{written} cannot be read here ({where}); expected verl's {kind} config YAML at a path the "
                         "script sets (a relative one is read from its folder), or write the agent_rollout node by hand "
                         "(docs/AGENTS.md)")
    label, found = f"{path.name}:", side_files.shown(src, path)
    side_files.read(src, path, label, lists=True, whole=("tool_schema",))
    rows = src.under(label + section)
    indices = sorted({int(i) for i in (k[len(label + section) + 1:].split(".")[0] for k in rows) if i.isdigit()})
    if not indices or src.has(label + section):
        refuse(src, label + section if rows else key, f"{found} has no list of {section} entries; expected verl's "
                                                      f"{kind} config: {section}: [{{class_name: ..., config: {{...}}}}, ...]")
    for i in indices:
        name = f"{label}{section}.{i}.class_name"
        if not isinstance(src.value(name), str):
            src.problem(name if src.has(name) else src.under(f"{label}{section}.{i}")[0], f"{section} entry {i} has no "
                        "class_name; expected a class path such as verl.tools.search_tool.SearchTool")
    src.raise_problems()
    unknown = (f": the path starts with a value only running the script gives ({src.unresolved[key]}), and this is "
               "the file at the rest of it under the script's folder or a folder above; check it is the run's"
               if key in src.unresolved else "")
    return label, indices, f"read {found}{unknown}"


def _tools(src: Source, params: dict) -> tuple[list[str], list[str]]:
    """Our tools for the tool config's entries, and the entries no built-in matches (described for a refusal)."""
    label, indices, read = _entries(src, TOOLS, "tools", "tool")
    src.taken.add(TOOLS)
    src.remark(TOOLS, read)
    ours: list[str] = []
    missing: list[str] = []
    for i in indices:
        entry = f"{label}tools.{i}"
        cls = src.value(f"{entry}.class_name")
        name = _schema_name(src.value(f"{entry}.tool_schema")) or cls.rsplit(".", 1)[-1]
        language = src.value(f"{entry}.config.default_language", "python")
        if cls == SANDBOX and language == "python":
            _sandbox(src, entry, name, params)
            ours += [] if "python" in ours else ["python"]
            continue
        file, line = src.where(f"{entry}.class_name")
        why = f"runs {language} code (the python tool runs Python)" if cls == SANDBOX else VERL_TOOLS.get(cls, "no built-in tool matches")
        what = f"verl's tool {name} ({cls}, {Path(file).name}:{line}), which {why}"
        src.drop_under(entry, f"part of tool {name}, not carried")
        src.drop(f"{entry}.class_name", f"{what}: write {WRITE_TOOL}")
        missing.append(what)
    return ours, missing


def _schema_name(schema) -> str | None:
    """The function name in a tool's OpenAI schema ({type: function, function: {name: ...}})."""
    function = schema.get("function") if isinstance(schema, dict) else None
    return function.get("name") if isinstance(function, dict) and isinstance(function.get("name"), str) else None


def _sandbox(src: Source, entry: str, name: str, params: dict) -> None:
    """SandboxFusion's code interpreter is the python tool; its time limit and workers carry over."""
    for key in ("class_name", "config.type", "config.default_language"):
        src.take(f"{entry}.{key}")
    params["tool_timeout_s"] = positive(src, f"{entry}.config.default_timeout", (int, float))
    params["tool_workers"] = positive(src, f"{entry}.config.num_workers")
    for key, why in SANDBOX_CONFIG.items():
        src.drop(f"{entry}.config.{key}", why)
    src.drop(f"{entry}.tool_schema", f"the model is shown the python tool's own schema, python(code), not {name}")
    src.remark(f"{entry}.class_name", "becomes the python tool: the code runs in a bubblewrap sandbox on this machine "
                                      "(no network), which stops a program at its own time limit")


def _interaction(src: Source) -> str:
    """An Interaction is verl's Python (a simulated user): named and listed as not carried; returns what it is."""
    label, indices, read = _entries(src, TALK, "interaction", "interaction")
    names = []
    for i in indices:
        file, line = src.where(f"{label}interaction.{i}.class_name")
        names.append(f"{src.value(f'{label}interaction.{i}.name', i)} "
                     f"({src.value(f'{label}interaction.{i}.class_name')}, {Path(file).name}:{line})")
    what = f"verl's Interaction {', '.join(names)}, a simulated user answering each model turn"
    src.drop_under(label + "interaction", f"{what}; write {WRITE_ENV}")
    src.drop(TALK, f"{read}: {what}; write {WRITE_ENV}")
    return what


def _format(src: Source) -> None:
    if src.value(f"{MT}.format", "hermes") == "hermes":
        src.take(f"{MT}.format")
    else:
        src.drop(f"{MT}.format", "tool calls are read in Hermes format (<tool_call>{...}</tool_call>) here")
