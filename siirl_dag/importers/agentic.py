"""A peer's multi-turn rollout as this engine's agent_rollout node, the same way for every importer.

Where the peer's agent is a loop whose behaviour a built-in tool matches (code run in a sandbox:
`python`; arithmetic: `calculator`), the draft's rollout node becomes agent_rollout with those tools.
Where it is the peer's or the user's own Python (an agent class, an environment, a simulated user),
an import cannot convert it: the class is named, never imported, and the import stops saying what to
write here (`agent: module:function` or `env: module:Class`), with the node's params that do carry.
"""

from __future__ import annotations

from typing import NoReturn

from siirl_dag.importers.draft import Draft
from siirl_dag.importers.features import refuse
from siirl_dag.importers.source import Source

WRITE_TOOL = "a module:function decorated with @siirl_dag.registry.tool(parameters=...), listed in the agent_rollout node's tools"
WRITE_AGENT = ("the agent_rollout node's agent: module:function, an `async def solve(client: openai.AsyncOpenAI, "
               "sample: dict) -> float | dict | None` run once per episode against the node's OpenAI-compatible endpoint")
WRITE_ENV = ("the agent_rollout node's env: module:Class, with reset(sample) -> observation and step(text) -> "
             "(observation, reward, done): the model's turn goes to step, the observation comes back as a user message")
PLACEHOLDERS = {WRITE_AGENT: ("agent", "your_module:solve"), WRITE_ENV: ("env", "your_module:YourEnv"),
                WRITE_TOOL: ("tools", "[your_module:your_tool]")}


def positive(src: Source, key: str, kind: type | tuple[type, ...] = int, zero: str = "") -> int | float | None:
    """A count or time of the agent_rollout node (turns, tokens, seconds, workers): above 0 (or 0 where
    the peer reads it as `zero`, e.g. no limit: then None); another value is a problem at its line."""
    value = src.take(key, kind=kind)
    if value is None or value > 0:
        return value
    if not (value == 0 and zero):
        src.problem(key, f"{value} is not a positive number; expected one above 0" + (f", or 0 ({zero})" if zero else ""))
    return None


def use_tools(draft: Draft, params: dict) -> None:
    """The draft's rollout node becomes agent_rollout with `params` (tools, limits); the tools are shown
    to the model by its chat template, so prompts go through it."""
    draft.agent = {key: value for key, value in params.items() if value is not None}
    draft.rollout["chat_template"] = True


def refuse_agent(src: Source, key: str, what: str, write: str, params: dict) -> NoReturn:
    """Stop at `key`: `what` is Python only its author can port; say what it becomes here (`write`,
    one of WRITE_*) and the agent_rollout params the source does give."""
    mode, placeholder = PLACEHOLDERS[write]
    hint = ", ".join(f"{k}: {v}" for k, v in ({mode: placeholder} | params).items() if v is not None)
    refuse(src, key, f"{what}: Python that an import cannot convert (it is never imported here); here it becomes "
                     f"{write}; write that, then the node by hand (docs/AGENTS.md), e.g. params {{{hint}}}")
