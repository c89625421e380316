"""agent_rollout: multi-turn rollouts, by one of four kinds of agent:

- `tools`: the engine's own loop, in which the model calls tools (nodes/tools, or a user's
  `module:function` decorated with @siirl_dag.registry.tool) (nodes/agent_loop.py);
- `agent`: the user's `async def solve(client, sample)` (or a synchronous `def`, run in a thread)
  against an OpenAI-compatible endpoint served from the node's engine; `agent_command`: the same as a
  program; `env`: a gym-shaped environment driven by the engine's loop (nodes/agents).

It produces what `rollout` produces, so the log-prob, reward, advantage and loss nodes work unchanged:
`response_mask` covers the model's own tokens; tools' answers and the agents' messages are attended
to (`attention_mask`) but never trained on. The user's agents add `agent_reward` (what the agent
returned, NaN for none: the reward node scores those) and `episode` (the rows of one episode).
"""

from __future__ import annotations

import inspect
import os
import re
import shutil
import sys

from jinja2 import TemplateError

from nodes import agent_loop
from nodes.agents import FAILED, REFUSED, TIMEOUTS, agent_processes
from nodes.chat_render import ChatRender
from nodes.rollout import PRODUCES, _lengths_fit, _prompt_lengths, _prompts_fit, weight_versions
from nodes.tool_calls import Observations
from nodes.tools import resolve_tool
from siirl_dag.errors import NodeFailure, Problem
from siirl_dag.refs import user_ref
from siirl_dag.registry import node_kind

STOP = "</tool_call>"  # a turn with a call ends there, and the tools answer
AGENT_KEYS = ("agent_reward", "episode")
MODES = ("agent", "agent_command", "env")  # the user's own agents (nodes/agents)
INTERPRETER = re.compile(r"(python|pypy)[0-9.]*|node|bash|sh|zsh|ruby|perl|Rscript")  # argv[1]: the script it runs
ONE_OF = ("tools",) + MODES


def mode_of(params: dict) -> str | None:
    """Which kind of agent the params name: tools, agent, agent_command or env."""
    return next((m for m in ONE_OF if params.get(m) is not None), None)


def _produces(params) -> tuple[str, ...]:
    return PRODUCES + (AGENT_KEYS if mode_of(params) in MODES else ())


def _describe(params, pipeline) -> str:
    mode = mode_of(params)
    if mode == "tools":
        return f"the engine's tool loop: {', '.join(params['tools'])}; up to {params['max_turns']} turns"
    what = {"agent": f"agent {params.get('agent')}, through an OpenAI-compatible endpoint",
            "agent_command": f"agent program {' '.join(params.get('agent_command') or [])}, through an OpenAI-compatible endpoint",
            "env": f"environment {params.get('env')}, in the engine's loop"}[mode]
    count = agent_processes(params["agent_processes"], pipeline.cluster.device, params["concurrency"])
    processes = f" in {count} processes" if count > 1 else ""
    return (f"{what}; {params['concurrency']} episodes at once{processes}, up to {params['max_turns']} turns, "
            f"{params['timeout_s']:g} s each")


def _check(node, pipeline) -> list[Problem]:
    """One kind of agent; tools, agents and environments that exist and can run here; a turn that fits
    the response budget."""
    where = pipeline.node_path(node.id) + ("params",)
    given = [m for m in ONE_OF if node.params.get(m) is not None]
    if len(given) != 1:
        found = f"{' and '.join(given)} are given" if given else "none is given"
        swap = f"; to swap one for another by override, set the other to null (nodes.{node.id}.params.{given[0]}=null)" \
            if len(given) > 1 else ""
        return [Problem(where, f"an agent_rollout runs one kind of agent, but {found}; expected exactly one of "
                               "tools (the engine's tool loop), agent (module:function), agent_command (argv) or "
                               f"env (module:Class){swap}")]
    problems, mode = _lengths_fit(node, pipeline), given[0]
    problems += {"tools": _tools_run, "agent": _agent_runs, "agent_command": _command_runs, "env": _env_runs}[mode](
        node.params[mode], where + (mode,))
    per_turn, budget = node.params["max_tokens_per_turn"], pipeline.data.max_response_length
    if per_turn is not None and per_turn > budget:
        problems.append(Problem(where + ("max_tokens_per_turn",), f"{per_turn} tokens per turn exceed the response "
                                f"budget data.max_response_length = {budget}; expected at most {budget}"))
    return problems


def _tools_run(refs: list[str], path: tuple) -> list[Problem]:
    problems = []
    for i, ref in enumerate(refs):
        try:
            why = resolve_tool(ref).available
            why = why() if why else None
        except LookupError as exc:
            why = str(exc)
        if why:
            problems.append(Problem(path + (i,), why))
    return problems


def _agent_runs(ref: str, path: tuple) -> list[Problem]:
    try:
        solve = user_ref(ref, "agent", {})
    except LookupError as exc:
        return [Problem(path, str(exc))]
    try:
        inspect.signature(solve).bind(None, None)
    except TypeError:
        return [Problem(path, f"'{ref}' cannot be called as solve(client, sample): its arguments are "
                              f"{inspect.signature(solve)}; expected async def solve(client: openai.AsyncOpenAI, "
                              "sample: dict), or def solve(client: openai.OpenAI, sample: dict)")]
    except ValueError:  # no signature to read (a builtin): it is called and fails then, its episodes lost
        pass
    return []


def _command_runs(argv: list[str], path: tuple) -> list[Problem]:
    program = argv[0]
    found = shutil.which(program) if os.sep not in program else (program if os.access(program, os.X_OK) else None)
    if found is None and os.path.isfile(program):
        return [Problem(path + (0,), f"'{program}' is a file but not executable; expected an executable program "
                                     "(chmod +x it, with a #! line naming its interpreter; or name the interpreter "
                                     f"first, for a Python script the one whose packages it imports: [{sys.executable}, "
                                     f"{program}])")]
    if found is None:
        return [Problem(path + (0,), f"'{program}' is not a program found on PATH or an executable file; expected "
                                     "the agent's program (argv, run without a shell)")]
    script = argv[1] if len(argv) > 1 else ""
    if INTERPRETER.fullmatch(os.path.basename(program)) and script and not script.startswith("-") \
            and not os.path.isfile(script):
        return [Problem(path + (1,), f"'{script}' is not a file; expected the script {os.path.basename(program)} runs "
                                     "(its path from the folder the run starts in)")]
    return []


def _env_runs(ref: str, path: tuple) -> list[Problem]:
    try:
        env = user_ref(ref, "environment", {})
    except LookupError as exc:
        return [Problem(path, str(exc))]
    lacking = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
    if not callable(env) or lacking:
        return [Problem(path, f"'{ref}' has no {' or '.join(lacking) or 'constructor'}; expected a class with "
                              "reset(sample) -> observation and step(text) -> (observation, reward, done)")]
    return []


def _template_fits(node, pipeline, data) -> list[str]:
    """The prompts fit; and the chat template can show what follows a turn: the tools' answers, or the
    messages an agent or environment sends."""
    tokenizer = pipeline.models[node.model].load_tokenizer()
    try:
        if mode_of(node.params) == "tools":
            Observations(tokenizer).text(["1"], False)
        else:
            ChatRender(tokenizer).text_after_turn([{"role": "user", "content": "1"}])
    except (ValueError, TypeError, TemplateError) as exc:
        return [f"the chat template of model '{node.model}' cannot show the messages that follow a turn: {exc}; "
                "expected a tokenizer with a chat template"]
    return _prompts_fit(node, pipeline, data)


@node_kind("agent_rollout", consumes=("raw_prompt",), produces=_produces, strategies=("vllm",),
           params_schema="agent_rollout", check=_check, expands=True, check_data=_template_fits,
           prompt_lengths=_prompt_lengths, describe=_describe, shown=(FAILED, TIMEOUTS, REFUSED))
def agent_rollout(batch, ctx):
    """Trajectories of up to max_turns turns (n per prompt; one in validation, at val_temperature)."""
    ctx.check_weights_version()
    if mode_of(ctx.node.params) == "tools":
        return _tool_loop(batch, ctx)
    return _agents(batch, ctx)


def _tool_loop(batch, ctx):
    from siirl_dag.strategies.samples import Sample, pack_batch, prompt_token_ids

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


def _agents(batch, ctx):
    import torch

    from nodes.agents import rollout, rows
    from siirl_dag.strategies.samples import pack_batch, prompt_token_ids

    engine, data = ctx.engine, ctx.data
    n = 1 if ctx.validating else engine.options["n"]
    finished = rollout.run(ctx, rollout.samples_of(batch, ctx.node.model), n)
    rollout.log_failures(finished, ctx.node.id)
    found = rows.rows_of(finished, batch["uid"], n, ctx.validating,
                         lambda i: prompt_token_ids(engine.tokenizer, batch["raw_prompt"][i], True),
                         engine.tokenizer.eos_token_id)
    if not found.samples:
        raise NodeFailure(rows.lost_everything(finished))
    out = pack_batch(found.prompts, found.samples, data.max_prompt_length, data.max_response_length, engine.pad_token_id)
    out.pop("sample_index")
    out.update(weight_versions(out, data.max_prompt_length, engine.weights_version))
    out.update(agent_reward=torch.tensor(found.rewards, dtype=torch.float32), episode=found.episodes)
    ctx.metrics.update(rows.metrics(finished, found, batch.num_rows, ctx.validating))
    return ctx.expand(found.index, out)
