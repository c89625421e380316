"""The agent demos' agent as a user writes one, against the `openai` client: it offers the model a
calculator through OpenAI `tools`, runs the calls the model makes, sends the answers back as `tool`
messages, and scores the final answer itself (`solve`) or leaves that to the reward node (`solve_unscored`).

    params: {agent: nodes.demo_agents:solve}           (graphs/tiny_agent_openai_cpu.yaml)
    params: {agent: nodes.demo_agents:solve_unscored}  (graphs/qwen3_8b_agent.yaml: the reward node scores)

Nothing here knows it is being trained: the endpoint records the tokens, the engine trains on them.
"""

from __future__ import annotations

import json

from nodes.algos.scorers import gsm8k_score
from nodes.tools.calculator import evaluate

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression, e.g. 123+456*2.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
MAX_CALLS = 1  # rounds of tool calls before the answer (the CPU demo's)
UNSCORED_MAX_CALLS = 6  # solve_unscored's


async def solve(client, sample: dict) -> dict:
    """Ask; answer the model's calculator calls; ask again; score the answer against the ground truth."""
    answer, calls = await converse(client, sample, MAX_CALLS)
    return {"reward": gsm8k_score(answer, sample["ground_truth"]), "info": {"tool_calls": calls}}


async def solve_unscored(client, sample: dict) -> dict:
    """The same agent, with more rounds of calls, leaving the reward to the reward node: it scores the final
    answer by the sample's data_source (a math dataset's boxed answer, say), as it scores a plain rollout's."""
    _, calls = await converse(client, sample, UNSCORED_MAX_CALLS)
    return {"reward": None, "info": {"tool_calls": calls}}


async def converse(client, sample: dict, max_calls: int) -> tuple[str, int]:
    """The conversation: up to `max_calls` rounds of the model's calculator calls, each answered; the final
    answer's text and the calls made."""
    messages, calls = list(sample["messages"]), 0
    for _ in range(max_calls + 1):
        reply = await client.chat.completions.create(model=sample["model"], messages=messages, tools=[CALCULATOR],
                                                     parallel_tool_calls=False)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(call.function.arguments)})
            calls += 1
    return message.content or "", calls


def calculate(arguments: str) -> str:
    """The calculator's answer to one call (its arguments as JSON text), or what was wrong with it."""
    try:
        return str(evaluate(str(json.loads(arguments)["expression"])))
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: {exc}"
