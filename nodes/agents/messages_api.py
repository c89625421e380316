"""Anthropic's Messages API (`POST /v1/messages`), served as a chat turn: agents and harnesses written
against the `anthropic` client (an `AsyncAnthropic` at the episode's base URL without its `/v1`, or a
program given ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY).

A request is read into the chat request it amounts to (`openai_api.read` then checks it as it checks a
/v1/chat/completions call): `system` becomes the system message; an assistant message's `tool_use` blocks
its tool calls; a user message's `tool_result` blocks tool messages, before its text. The turn is the same
token-faithful chat turn (service.Service.chat); its answer is shaped back into a message (text and
`tool_use` blocks, `stop_reason` end_turn, tool_use or max_tokens) or its stream of events.
`/v1/messages/count_tokens` reads the same body and counts the prompt it renders, as a conversation's
first call would be prompted; `/v1/models` answers in Anthropic's shapes. Refused with
400: image and document blocks, extended thinking, a forced tool (`tool_choice` any or tool), an assistant
message last (a prefill: each call is a new turn); errors come in Anthropic's shape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from nodes.agents import openai_api
from nodes.agents.openai_api import ApiError, Request

BLOCK_SHAPE = ("expected content: a string or a list of blocks ({'type': 'text', 'text': ...}, {'type': 'tool_use', "
               "'id': ..., 'name': ..., 'input': {...}}, {'type': 'tool_result', 'tool_use_id': ..., 'content': ...})")
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}  # chat finish_reason -> stop_reason; else end_turn
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "request_too_large"}


@dataclass
class MessagesRequest:
    chat: Request  # the chat turn it amounts to


def read(body: Any, served: str, counting: bool = False) -> MessagesRequest:
    """A /v1/messages request to the model `served`, checked and read as a chat request; `counting`: a
    /v1/messages/count_tokens request (the same body, max_tokens left out)."""
    if not isinstance(body, dict):
        raise ApiError(400, "expected a JSON object as the request body")
    limit = openai_api.positive(body, "max_tokens")
    if limit is None and not counting:
        raise ApiError(400, "expected max_tokens: a positive integer (the Messages API requires it)", param="max_tokens")
    thinking = body.get("thinking")
    if thinking is not None and not (isinstance(thinking, dict) and thinking.get("type") == "disabled"):
        raise ApiError(400, "thinking is not served: the chat template decides how the model thinks; expected it left out",
                       param="thinking")
    choice = body.get("tool_choice") or {"type": "auto"}
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "none"):
        raise ApiError(400, f"tool_choice {json.dumps(choice)[:80]} is not served: forcing a call changes what is sampled; "
                            "expected {'type': 'auto'} or {'type': 'none'} (offer the tool; "
                            f"{openai_api.FORCED_CALL})", param="tool_choice")
    system = body.get("system")
    messages = ([{"role": "system", "content": openai_api.text_of(system, "system")}] if system else []) + \
        _messages(body.get("messages"))
    chat = {key: body[key] for key in ("model", "stream", "temperature", "top_p", "top_k") if key in body}
    chat.update(messages=messages, max_tokens=limit, stop=body.get("stop_sequences"), tool_choice=choice["type"],
                parallel_tool_calls=not choice.get("disable_parallel_tool_use", False))
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    return MessagesRequest(openai_api.read(chat, served, chat=True))


def _messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "expected messages: a non-empty list of {'role': 'user' or 'assistant', 'content': ...}",
                       param="messages")
    if isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
        raise ApiError(400, f"messages[{len(messages) - 1}]: a conversation that ends with the assistant's message "
                            "(a prefill to continue) is not served: each call is a new turn; expected a user message last",
                       param=f"messages.{len(messages) - 1}")
    out: list[dict] = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise ApiError(400, f"messages[{i}]: expected {{'role': 'user' or 'assistant', 'content': ...}}",
                           param=f"messages.{i}")
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list) or not all(isinstance(b, dict) for b in blocks):
            raise ApiError(400, f"messages[{i}]: {BLOCK_SHAPE}", param=f"messages.{i}.content")
        text, calls = [], []
        for j, block in enumerate(blocks):
            kind, at = block.get("type"), f"messages.{i}.content.{j}"
            if kind == "text" and isinstance(block.get("text"), str):
                text.append(block["text"])
            elif kind == "tool_use" and role == "assistant" and isinstance(block.get("id"), str) and \
                    isinstance(block.get("name"), str) and isinstance(block.get("input"), dict):
                calls.append({"id": block["id"], "type": "function",
                              "function": {"name": block["name"], "arguments": json.dumps(block["input"])}})
            elif kind == "tool_result" and role == "user" and isinstance(block.get("tool_use_id"), str):
                out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": openai_api.text_of(block.get("content"), at)})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue  # an earlier turn's thinking, which this endpoint never sends: nothing of the model's
            else:
                raise ApiError(400, f"messages[{i}].content[{j}]: blocks of type {kind!r} are not served here; {BLOCK_SHAPE}",
                               param=at)
        if role == "assistant":
            out.append({"role": "assistant", "content": "".join(text) or None, **({"tool_calls": calls} if calls else {})})
        elif text or not any(b.get("type") == "tool_result" for b in blocks):
            out.append({"role": "user", "content": "".join(text)})
    return out


def _tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise ApiError(400, "expected tools: a list of {'name': ..., 'input_schema': {...}}", param="tools")
    chat = []
    for i, tool in enumerate(tools):
        if not (isinstance(tool, dict) and isinstance(tool.get("name"), str) and tool.get("type") in (None, "custom")):
            raise ApiError(400, f"tools[{i}]: only client tools are served ({{'name': ..., 'input_schema': {{...}}}}); "
                                "the rollout runs no tool of its own", param=f"tools.{i}")
        function = {"name": tool["name"], "description": tool.get("description", "")}
        if "input_schema" in tool:
            function["parameters"] = tool["input_schema"]
        chat.append({"type": "function", "function": function})
    return chat


# -- answers ----------------------------------------------------------------------------------------
def answer(chat: dict, req: MessagesRequest) -> dict:  # noqa: ARG001 - read's request, as responses_api.answer takes it
    """The chat answer of the turn as an Anthropic message."""
    choice, usage = chat["choices"][0], chat["usage"]
    message = choice["message"]
    content = [{"type": "text", "text": message["content"]}] if message.get("content") else []
    for call in message.get("tool_calls") or ():
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": json.loads(call["function"]["arguments"])})
    return {"id": f"msg-{chat['id'].removeprefix('chatcmpl-')}", "type": "message", "role": "assistant",
            "model": chat["model"], "content": content or [{"type": "text", "text": ""}],
            "stop_reason": STOP_REASONS.get(choice["finish_reason"], "end_turn"), "stop_sequence": None,
            "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]}}


def stream_events(message: dict) -> list[dict]:
    """A whole message as the events of a stream: its start, each block (its text or input in one delta),
    the stop reason, the stop."""
    events = [{"type": "message_start", "message": {**message, "content": [], "stop_reason": None,
                                                    "usage": {**message["usage"], "output_tokens": 0}}}]
    for index, block in enumerate(message["content"]):
        if block["type"] == "text":
            start, delta = {**block, "text": ""}, {"type": "text_delta", "text": block["text"]}
        else:
            start, delta = {**block, "input": {}}, {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        events += [{"type": "content_block_start", "index": index, "content_block": start},
                   {"type": "content_block_delta", "index": index, "delta": delta},
                   {"type": "content_block_stop", "index": index}]
    return events + [{"type": "message_delta", "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
                      "usage": {"output_tokens": message["usage"]["output_tokens"]}},
                     {"type": "message_stop"}]


def models(served: str, asked: str | None) -> dict:
    """GET /v1/models (`asked` None) or /v1/models/{asked} in Anthropic's shapes: the one served model."""
    model = {"type": "model", "id": served, "display_name": served, "created_at": "1970-01-01T00:00:00Z"}
    if asked is None:
        return {"data": [model], "has_more": False, "first_id": served, "last_id": served}
    return model


def error_body(exc: ApiError) -> dict:
    """An error in Anthropic's shape."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(exc.status, "api_error"), "message": exc.message}}
