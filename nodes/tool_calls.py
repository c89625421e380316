"""Tool calls in a model's turn, and the tools' answers as the tokens the model reads next.

Calls are parsed in the Qwen / Hermes format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
any number per turn (up to MAX_CALLS), with plain string search (linear in the turn's length) and caps
on a call's size and nesting depth; a malformed one (unclosed, too large or deep, bad JSON, an unknown
tool, arguments against the tool's JSON Schema, an exception, a timeout) becomes an error observation,
never a crash or a stall. Observations are the chat template's own rendering of tool messages after an
assistant turn, cut from a rendering of the conversation so far: only the new text is tokenized, once
(earlier turns are never re-tokenized), and the tools' text with special tokens split, so an answer
holding the template's control text (`<|im_end|>`) cannot end the turn or fake a role.
"""

from __future__ import annotations

import contextvars
import json
import time
from dataclasses import dataclass
from typing import Any

import jsonschema

from siirl_dag.registry import Tool

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_CALLS = 16  # per turn; those beyond are answered with one error
MAX_CALL_CHARS = 4 * 2**20  # one call's JSON (a python program of MAX_CODE bytes, escaped, fits)
MAX_DEPTH = 32  # nesting of a call's JSON
MAX_ANSWER = 32 * 1024  # characters of an answer or an error; the rest is cut
_USER, _ASSISTANT, _TOOL = "U7f3a", "A7f3a", "T{}x7f3a"  # stand-ins whose rendering is cut around
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
    calls, at = [], 0
    while (start := text.find(OPEN, at)) != -1:
        if len(calls) == MAX_CALLS:
            calls.append(Call(None, None, f"more than {MAX_CALLS} tool calls in one turn; the rest are not made"))
            break
        end = text.find(CLOSE, start + len(OPEN))
        if end == -1:
            calls.append(Call(None, None, f"a {OPEN} without {CLOSE} (cut off?)"))
            break
        calls.append(_parse_one(text[start + len(OPEN):end]))
        at = end + len(CLOSE)
    return calls


def _parse_one(body: str) -> Call:
    if len(body) > MAX_CALL_CHARS:
        return Call(None, None, f"the tool call has {len(body)} characters; at most {MAX_CALL_CHARS} are read")
    try:
        call = json.loads(body)
        args = call.get("arguments", {}) if isinstance(call, dict) else None
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError as exc:
        return Call(None, None, f"the tool call is not valid JSON ({exc.msg} at character {exc.pos})")
    except RecursionError:
        return Call(None, None, f"the tool call is nested deeper than {MAX_DEPTH} levels")
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        return Call(None, None, f"the tool call cannot be read: {_cut(str(exc), 200)}")
    if not (isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(args, dict)):
        return Call(None, None, 'expected {"name": "<tool>", "arguments": {...}}')
    if _depth(args) > MAX_DEPTH:
        return Call(None, None, f"the tool call is nested deeper than {MAX_DEPTH} levels")
    return Call(call["name"], args)


def _depth(value: Any) -> int:
    """Nesting depth of parsed JSON, without recursion (stops counting past MAX_DEPTH)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth <= MAX_DEPTH:
                stack += [(child, depth + 1) for child in (item.values() if isinstance(item, dict) else item)]
    return deepest


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

    def pieces(self, answers: list[str], ended_with_eos: bool) -> list[tuple[str, bool]]:
        """The text after the turn as (text, is a tool's answer) pieces: the template's and the tools'."""
        stand_ins = [_TOOL.format(i) for i in range(len(answers))]
        rendered = self._render(stand_ins, True)
        if not rendered.startswith(self.before):
            raise ValueError("the chat template renders earlier turns differently once tool messages follow; "
                             "expected a template that appends tool messages")
        rest, pieces = rendered[len(self.before):], [(self.close_after_eos if ended_with_eos else self.close, False)]
        for stand_in, answer in zip(stand_ins, answers):
            at = rest.find(stand_in)
            if at == -1:
                raise ValueError("the chat template does not show a tool message's content as it is")
            pieces += [(rest[:at], False), (answer, True)]
            rest = rest[at + len(stand_in):]
        return [p for p in pieces + [(rest, False)] if p[0]]

    def text(self, answers: list[str], ended_with_eos: bool) -> str:
        return "".join(text for text, _ in self.pieces(answers, ended_with_eos))

    def token_ids(self, answers: list[str], ended_with_eos: bool) -> list[int]:
        """The template's text with its special tokens; the tools' with theirs split into plain text."""
        return [i for text, tool in self.pieces(answers, ended_with_eos)
                for i in self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=tool)]
