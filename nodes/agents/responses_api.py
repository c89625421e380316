"""OpenAI's Responses API (`POST /v1/responses`), served as a chat turn: the OpenAI Agents SDK's default
model (`OpenAIResponsesModel`) and harnesses written against `client.responses` call it.

A request is read into the chat request it amounts to (`openai_api.read` then checks it as it checks a
/v1/chat/completions call): `instructions` becomes the system message, `input` (a string, or items:
messages, `function_call`s, `function_call_output`s) the messages, flat function `tools` the chat shape.
The turn is the same token-faithful chat turn (service.Service.chat); its answer is shaped back into a
Response (a `message` item, then one `function_call` item per call) or its stream of events. This endpoint
keeps no responses: `previous_response_id`, `conversation` and stored prompts are refused, as are
built-in tools (web search, files, computer use) and structured outputs; the whole conversation comes in
`input` each call, as the Agents SDK sends it unless told to chain responses. A turn cut by its length is
`status: incomplete` (`incomplete_details.reason: max_output_tokens`), as OpenAI answers it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nodes.agents import openai_api
from nodes.agents.openai_api import ApiError, Request

LOGPROBS = "message.output_text.logprobs"  # the `include` entry that asks for log-probs
STATELESS = {"previous_response_id": "a previous response", "conversation": "a conversation",
             "prompt": "a stored prompt"}
TEXT_PARTS = ("input_text", "output_text", "text")  # the content parts read as text
ITEM_SHAPE = ("expected input items: {'role': ..., 'content': ...} messages, {'type': 'function_call', 'call_id': ..., "
              "'name': ..., 'arguments': '...'} or {'type': 'function_call_output', 'call_id': ..., 'output': ...}")


@dataclass
class ResponsesRequest:
    chat: Request  # the chat turn it amounts to
    instructions: str | None
    tools: list[dict]  # as the request gave them (echoed in the Response)
    tool_choice: Any
    parallel_tool_calls: bool


def read(body: Any, served: str) -> ResponsesRequest:
    """A /v1/responses request to the model `served`, checked and read as a chat request."""
    if not isinstance(body, dict):
        raise ApiError(400, "expected a JSON object as the request body")
    for key, what in STATELESS.items():
        if body.get(key) is not None:
            raise ApiError(400, f"{key} is not served: this endpoint keeps no responses, so it cannot continue {what}; "
                                "expected the whole conversation in `input` (the OpenAI Agents SDK sends it so unless "
                                "told to chain responses)", param=key)
    if body.get("background"):
        raise ApiError(400, "background is not served: each call is one turn of an episode, answered when done",
                       param="background")
    text = body.get("text")
    if text is not None and not (isinstance(text, dict) and text.get("format", {"type": "text"}) in ({"type": "text"}, None)):
        raise ApiError(400, "text.format is not served: structured outputs constrain decoding, and the trainer would "
                            "score the unconstrained distribution; expected {'format': {'type': 'text'}}: ask for the "
                            "format in the prompt and parse the answer", param="text.format")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ApiError(400, "expected instructions: a string", param="instructions")
    limit = openai_api.positive(body, "max_output_tokens")
    include = body.get("include") or []
    if not (isinstance(include, list) and all(isinstance(i, str) for i in include)):
        raise ApiError(400, "expected include: a list of strings", param="include")
    tools = body.get("tools") or []
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + _messages(body.get("input"))
    chat = {key: body[key] for key in ("model", "stream", "tool_choice", "parallel_tool_calls", "temperature", "top_p")
            if key in body}
    chat.update(messages=messages, max_tokens=limit, logprobs=LOGPROBS in include,
                top_logprobs=body.get("top_logprobs") if LOGPROBS in include else None)
    if tools:
        chat["tools"] = _tools(tools)
    return ResponsesRequest(openai_api.read(chat, served, chat=True), instructions, tools,
                            body.get("tool_choice", "auto"), body.get("parallel_tool_calls", True) is not False)


def _messages(items: Any) -> list[dict]:
    """Input items as chat messages: a function call joins the assistant message just before it (the
    Response it came from held both), a function call's output is a tool message."""
    if isinstance(items, str) and items:
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ApiError(400, "expected input: a non-empty string or a non-empty list of items", param="input")
    messages: list[dict] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            if item.get("role") not in openai_api.ROLES:
                raise ApiError(400, f"input[{i}]: expected a message's role, one of {', '.join(openai_api.ROLES)}",
                               param=f"input.{i}")
            messages.append({"role": item["role"],
                             "content": openai_api.text_of(item.get("content"), f"input.{i}.content", TEXT_PARTS)})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise ApiError(400, f"input[{i}]: {ITEM_SHAPE}", param=f"input.{i}")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else {}
            if last.get("role") == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "reasoning":
            continue  # another model's reasoning (this endpoint sends none): nothing of this model's to render
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise ApiError(400, f"input[{i}]: {ITEM_SHAPE}", param=f"input.{i}")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": openai_api.text_of(item.get("output"), f"input.{i}.output", TEXT_PARTS)})
        else:
            raise ApiError(400, f"input[{i}]: items of type {kind!r} are not served; {ITEM_SHAPE}", param=f"input.{i}")
    return messages


def _tools(tools: Any) -> list[dict]:
    """Flat function tools in the chat shape, keys in the order the chat shape lists them (the chat template
    renders them as JSON: the same tools render the same whichever API offered them)."""
    if not isinstance(tools, list):
        raise ApiError(400, "expected tools: a list of function tools", param="tools")
    chat = []
    for i, tool in enumerate(tools):
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(tool.get("name"), str)):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise ApiError(400, f"tools[{i}]: only function tools are served ({{'type': 'function', 'name': ..., "
                                f"'parameters': {{...}}}}), not {kind!r}: the rollout runs no tool of its own",
                           param=f"tools.{i}")
        chat.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters", "strict")
                                                       if k in tool}})
    return chat


# -- answers ----------------------------------------------------------------------------------------
def answer(chat: dict, req: ResponsesRequest) -> dict:
    """The chat answer of the turn as a Response."""
    choice, usage = chat["choices"][0], chat["usage"]
    message, turn = choice["message"], chat["id"].removeprefix("chatcmpl-")
    incomplete = choice["finish_reason"] == "length"
    status = "incomplete" if incomplete else "completed"
    output = []
    if message.get("content") or not message.get("tool_calls"):
        part = {"type": "output_text", "text": message.get("content") or "", "annotations": []}
        if choice["logprobs"] is not None:
            part["logprobs"] = choice["logprobs"]["content"]
        output.append({"type": "message", "id": f"msg-{turn}", "role": "assistant", "status": status, "content": [part]})
    for call in message.get("tool_calls") or ():
        output.append({"type": "function_call", "id": f"fc-{call['id']}", "call_id": call["id"],
                       "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"})
    return {"id": f"resp-{turn}", "object": "response", "created_at": chat["created"], "model": chat["model"],
            "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.instructions, "output": output, "tools": req.tools, "tool_choice": req.tool_choice,
            "parallel_tool_calls": req.parallel_tool_calls, "temperature": None, "top_p": None, "metadata": {},
            "text": {"format": {"type": "text"}},
            "usage": {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": usage["total_tokens"]}}


def stream_events(response: dict) -> list[dict]:
    """A whole Response as the events of a stream: created, each output item (its text or arguments in one
    delta), then completed (or incomplete)."""
    events: list[dict] = []

    def event(kind: str, **fields) -> None:
        events.append({"type": kind, "sequence_number": len(events), **fields})

    event("response.created", response={**response, "status": "in_progress", "output": []})
    event("response.in_progress", response={**response, "status": "in_progress", "output": []})
    for index, item in enumerate(response["output"]):
        at = {"output_index": index, "item_id": item["id"]}
        if item["type"] == "message":
            event("response.output_item.added", output_index=index, item={**item, "status": "in_progress", "content": []})
            part = item["content"][0]
            event("response.content_part.added", **at, content_index=0, part={**part, "text": ""})
            event("response.output_text.delta", **at, content_index=0, delta=part["text"], logprobs=part.get("logprobs", []))
            event("response.output_text.done", **at, content_index=0, text=part["text"], logprobs=part.get("logprobs", []))
            event("response.content_part.done", **at, content_index=0, part=part)
        else:
            event("response.output_item.added", output_index=index, item={**item, "status": "in_progress", "arguments": ""})
            event("response.function_call_arguments.delta", **at, delta=item["arguments"])
            event("response.function_call_arguments.done", **at, name=item["name"], arguments=item["arguments"])
        event("response.output_item.done", output_index=index, item=item)
    event(f"response.{response['status']}", response=response)
    return events
