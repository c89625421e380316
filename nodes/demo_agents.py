"""The CPU agent demo's agent as a user writes one, against the `openai` client (graphs/tiny_agent_openai_cpu.yaml):
it offers the model a calculator through OpenAI `tools`, runs the calls the model makes, sends the answers
back as `tool` messages, and scores the final answer itself.

    params: {agent: nodes.demo_agents:solve}

Nothing here knows it is being trained: the endpoint records the tokens, the engine trains on them.
"""

from __future__ import annotations

import json

from nodes.algos.scorers import gsm8k_score
from nodes.tools.calculator import evaluate

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression, e.g. 123+456*2.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
MAX_CALLS = 1  # rounds of tool calls before the answer


async def solve(client, sample: dict) -> dict:
    """Ask; answer the model's calculator calls; ask again; score the answer against the ground truth."""
    messages, calls = list(sample["messages"]), 0
    for _ in range(MAX_CALLS + 1):
        reply = await client.chat.completions.create(model=sample["model"], messages=messages, tools=[CALCULATOR],
                                                     parallel_tool_calls=False)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(call.function.arguments)})
            calls += 1
    answer = message.content or ""
    return {"reward": gsm8k_score(answer, sample["ground_truth"]), "info": {"tool_calls": calls}}


def calculate(arguments: str) -> str:
    """The calculator's answer to one call (its arguments as JSON text), or what was wrong with it."""
    try:
        return str(evaluate(str(json.loads(arguments)["expression"])))
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: {exc}"
