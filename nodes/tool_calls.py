"""Tool calls in a model's turn, and the tools' answers as the tokens the model reads next.

Calls are parsed in the Qwen / Hermes format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
any number per turn (up to MAX_CALLS), with plain string search (linear in the turn's length) and caps
on a call's size and nesting depth; a malformed one (unclosed, too large or deep, bad JSON, an unknown
tool, arguments against the tool's JSON Schema, an exception, a timeout) becomes an error observation,
never a crash or a stall. Observations are the chat template's own rendering of tool messages after an
assistant turn (`chat_render`): only the new text is tokenized, once (earlier turns are never
re-tokenized), and the tools' text with special tokens split, so an answer holding the template's
control text (`<|im_end|>`) cannot end the turn or fake a role.
"""

from __future__ import annotations

import contextvars
import json
import time
from dataclasses import dataclass
from typing import Any

import jsonschema

from nodes import json_nesting
from nodes.chat_render import ChatRender
from siirl_dag.registry import Tool

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_CALLS = 16  # per turn; those beyond are answered with one error
MAX_CALL_CHARS = 4 * 2**20  # one call's JSON (a python program of MAX_CODE bytes, escaped, fits)
MAX_DEPTH = 32  # nesting of a call's JSON
MAX_ANSWER = 32 * 1024  # characters of an answer or an error; the rest is cut
_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("tool_deadline", default=None)


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
    """Every `<tool_call>...</tool_call>` of a turn, in order; never raises."""
    return [call for _, _, call in call_spans(text)]


def call_spans(text: str) -> list[tuple[int, int, Call]]:
    """`parse_calls` with where each call's text starts and ends in `text`."""
    spans, at = [], 0
    while (start := text.find(OPEN, at)) != -1:
        if len(spans) == MAX_CALLS:
            spans.append((start, len(text), Call(None, None, f"more than {MAX_CALLS} tool calls in one turn; "
                                                              "the rest are not made")))
            break
        end = text.find(CLOSE, start + len(OPEN))
        if end == -1:
            spans.append((start, len(text), Call(None, None, f"a {OPEN} without {CLOSE} (cut off?)")))
            break
        at = end + len(CLOSE)
        spans.append((start, at, _parse_one(text[start + len(OPEN):end])))
    return spans


def _parse_one(body: str) -> Call:
    if len(body) > MAX_CALL_CHARS:
        return Call(None, None, f"the tool call has {len(body)} characters; at most {MAX_CALL_CHARS} are read")
    try:
        call = json.loads(body, **json_nesting.STRICT)  # NaN and Infinity would be answered as invalid JSON
        args = call.get("arguments", {}) if isinstance(call, dict) else None
        args = json.loads(args, **json_nesting.STRICT) if isinstance(args, str) else args
    except json.JSONDecodeError as exc:
        return Call(None, None, f"the tool call is not valid JSON ({exc.msg} at character {exc.pos})")
    except RecursionError:
        return Call(None, None, f"the tool call is nested deeper than {MAX_DEPTH} levels")
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        return Call(None, None, f"the tool call cannot be read: {_cut(str(exc), 200)}")
    if not (isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(args, dict)):
        return Call(None, None, 'expected {"name": "<tool>", "arguments": {...}}')
    if json_nesting.depth(args, MAX_DEPTH) > MAX_DEPTH:
        return Call(None, None, f"the tool call is nested deeper than {MAX_DEPTH} levels")
    return Call(call["name"], args)


def _cut(text: str, limit: int = MAX_ANSWER) -> str:
    return text if len(text) <= limit else text[:limit] + f"\n[cut at {limit} characters]"


def time_left(default: float) -> float:
    """Seconds a tool may still run: `default`, or less when the caller's deadline (`make_call`) is nearer."""
    deadline = _DEADLINE.get()
    return default if deadline is None else max(min(default, deadline - time.monotonic()), 0.0)


def make_call(call: Call, tools: dict[str, Tool], deadline: float | None = None) -> Answer:
    """Run one call by `deadline` (time.monotonic(); tools read it with `time_left`); anything that goes
    wrong is the answer's text, marked as an error. Never raises."""
    began, error = time.perf_counter(), call.error
    if error is None and call.name not in tools:
        error = f"unknown tool '{_cut(str(call.name), 200)}'; the tools are: {', '.join(sorted(tools))}"
    if error is None:
        try:
            problem = next(iter(jsonschema.Draft202012Validator(tools[call.name].parameters).iter_errors(call.arguments)), None)
        except Exception as exc:  # noqa: BLE001 - hostile arguments must not break the loop
            problem = exc
        if problem is not None:
            error = f"arguments of '{call.name}': {_cut(getattr(problem, 'message', str(problem)), 500)}"
    if error is None and deadline is not None and time.monotonic() >= deadline:
        error = "no time left to make the call"
    if error is not None:
        return Answer(f"error: {error}", True, time.perf_counter() - began)
    token = _DEADLINE.set(deadline)
    try:
        return Answer(_cut(str(tools[call.name].fn(**call.arguments))), False, time.perf_counter() - began)
    except Exception as exc:  # noqa: BLE001 - a tool's failure is the model's observation
        return Answer(_cut(f"error: {type(exc).__name__}: {exc}"), True, time.perf_counter() - began)
    finally:
        _DEADLINE.reset(token)


class Observations:
    """Tool answers as the tokens the model reads after its turn: `tool` messages, rendered by the chat
    template after the turn (`chat_render.ChatRender`: an answer's control tokens as plain text)."""

    def __init__(self, tokenizer: Any) -> None:
        self.render = ChatRender(tokenizer)

    def token_ids(self, answers: list[str], ended_with_eos: bool) -> list[int]:
        return self.render.after_turn([{"role": "tool", "content": a} for a in answers], ended_with_eos)

    def text(self, answers: list[str], ended_with_eos: bool) -> str:
        return self.render.text_after_turn([{"role": "tool", "content": a} for a in answers], ended_with_eos)
