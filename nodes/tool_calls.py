"""Tool calls in a model's turn, and the tools' answers as the tokens the model reads next.

Calls are parsed in the Qwen / Hermes format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
any number per turn; a malformed one (bad JSON, an unknown tool, arguments against the tool's JSON
Schema, an exception, a timeout) becomes an error observation, never a crash. Observations are the
chat template's own rendering of tool messages after an assistant turn, cut from a rendering of the
conversation so far: only the new text is tokenized, once (earlier turns are never re-tokenized).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any

import jsonschema

from siirl_dag.registry import Tool

CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_USER, _ASSISTANT = "U7f3a", "A7f3a"  # stand-ins whose rendering is cut around


@dataclass
class Call:
    name: str | None
    arguments: dict | None
    error: str | None = None  # why it cannot be made (then it is not)


@dataclass
class Answer:
    text: str
    error: bool
    seconds: float


def parse_calls(text: str) -> list[Call]:
    """Every `<tool_call>...</tool_call>` of a turn, in order."""
    calls = []
    for body in CALL.findall(text):
        try:
            call = json.loads(body)
            args = call.get("arguments", {}) if isinstance(call, dict) else None
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError as exc:
            calls.append(Call(None, None, f"the tool call is not valid JSON ({exc.msg} at character {exc.pos})"))
            continue
        if not (isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(args, dict)):
            calls.append(Call(None, None, 'expected {"name": "<tool>", "arguments": {...}}'))
            continue
        calls.append(Call(call["name"], args))
    return calls


def make_call(call: Call, tools: dict[str, Tool]) -> Answer:
    """Run one call; anything that goes wrong is the answer's text, marked as an error."""
    began = time.perf_counter()
    if call.error is None and call.name not in tools:
        call.error = f"unknown tool '{call.name}'; the tools are: {', '.join(sorted(tools))}"
    if call.error is None:
        problem = next(iter(jsonschema.Draft202012Validator(tools[call.name].parameters).iter_errors(call.arguments)), None)
        if problem is not None:
            call.error = f"arguments of '{call.name}': {problem.message}"
    if call.error is not None:
        return Answer(f"error: {call.error}", True, time.perf_counter() - began)
    try:
        return Answer(str(tools[call.name].fn(**call.arguments)), False, time.perf_counter() - began)
    except Exception as exc:  # noqa: BLE001 - a tool's failure is the model's observation
        return Answer(f"error: {type(exc).__name__}: {exc}", True, time.perf_counter() - began)


class Observations:
    """Renders tool answers with the model's chat template: the text that follows an assistant turn."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        before = self._render([], False)
        after_turn = before[before.rindex(_ASSISTANT) + len(_ASSISTANT):]
        eos = tokenizer.eos_token or ""
        # what closes an assistant turn (Qwen: "<|im_end|>\n"); a turn that ended with EOS has its first part
        self.close, self.close_after_eos = after_turn, after_turn.removeprefix(eos) if eos else after_turn
        self.before = before

    def _render(self, answers: list[str], generation_prompt: bool) -> str:
        messages = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}]
        messages += [{"role": "tool", "content": a} for a in answers]
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)

    def text(self, answers: list[str], ended_with_eos: bool) -> str:
        rendered = self._render(answers, True)
        if not rendered.startswith(self.before):
            raise ValueError("the chat template renders earlier turns differently once tool messages follow; "
                             "expected a template that appends tool messages")
        return (self.close_after_eos if ended_with_eos else self.close) + rendered[len(self.before):]

    def token_ids(self, answers: list[str], ended_with_eos: bool) -> list[int]:
        return self.tokenizer.encode(self.text(answers, ended_with_eos), add_special_tokens=False)
