"""The OpenAI API's requests and answers, as far as the agent endpoint serves them: requests checked
and read into typed values (never evaluated), answers and errors built in OpenAI's JSON shapes.

Sampling is the policy's: the node's options (temperature, top_p, top_k) decide every turn, since
the trainer's log-probs must be those of the distribution the tokens were drawn from; a request's own
sampling fields are overridden and counted (agent/sampling_overridden). A request may ask for fewer
tokens (max_tokens, max_completion_tokens), add stop strings, ask for log-probs, stream (answered in
one chunk once the turn is done) and offer tools (the model's `<tool_call>` blocks come back as
OpenAI tool_calls). What would change what is sampled without the trainer knowing (n > 1, a forced
tool_choice, response_format) is refused with 400.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from nodes.agents.episode import content_text
from nodes.tool_calls import OPEN, call_spans

OVERRIDDEN = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
              "repetition_penalty", "logit_bias")
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_TOP_LOGPROBS = 20

# what an agent that structures the model's output does instead (LangChain's with_structured_output, a router)
FREE_TEXT = "expected free text: ask for the format in the prompt and parse the answer"
FORCED_CALL = "a turn without the call is the episode's to handle"


class ApiError(Exception):
    """An error answer: HTTP status, OpenAI error type and code, message, the parameter at fault."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.type = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                     404: "invalid_request_error", 405: "invalid_request_error",
                     413: "invalid_request_error"}.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Request:
    """What a call asks, checked."""

    messages: list[dict] | None = None  # chat
    prompt: str | list[int] | None = None  # completions
    tools: list[dict] | None = None
    parse_tool_calls: bool = False
    stop: list[str] = field(default_factory=list)  # the request's own, cut from the text it gets back
    max_tokens: int | None = None
    top_logprobs: int = 0
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False
    template_kwargs: dict = field(default_factory=dict)
    one_call_per_turn: bool = False  # parallel_tool_calls: false (the turn ends at its first call)
    overridden: bool = False  # it set sampling fields the policy's options decide


def read(body: Any, served: str, chat: bool) -> Request:
    """The request of a /v1/chat/completions (`chat`) or /v1/completions call to the model `served`."""
    if not isinstance(body, dict):
        raise ApiError(400, "expected a JSON object as the request body")
    model = body.get("model")
    if model != served:
        raise ApiError(404, f"the model '{_short(model)}' does not exist here; this endpoint serves '{served}' "
                            "(the `model` of each episode's sample)", "model_not_found", "model")
    if body.get("n", 1) not in (1, None) or isinstance(body.get("n"), bool):
        raise ApiError(400, "n must be 1: each call is one turn of one episode (more samples per prompt: the "
                            "rollout's options.n; several candidates in an episode: as many calls at once, each "
                            "a segment of its own)", param="n")
    for key in ("response_format", "guided_json", "guided_regex", "guided_choice", "structured_outputs"):
        if body.get(key) not in (None, {"type": "text"}):
            raise ApiError(400, f"{key} is not served: constrained decoding changes what is sampled, and the "
                                f"trainer would score the unconstrained distribution; {FREE_TEXT}", param=key)
    req = Request(overridden=any(body.get(k) is not None for k in OVERRIDDEN))
    req.max_tokens = positive(body, "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens")
    req.stop = _stop(body.get("stop"))
    req.stream = _flag(body, "stream")
    req.include_usage = bool(isinstance(body.get("stream_options"), dict) and body["stream_options"].get("include_usage"))
    if chat:
        _chat_fields(body, req)
    else:
        _completion_fields(body, req)
    return req


def _chat_fields(body: dict, req: Request) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "expected messages: a non-empty list of {'role': ..., 'content': ...}", param="messages")
    req.messages = [message(m, i) for i, m in enumerate(messages)]
    tools, choice = body.get("tools"), body.get("tool_choice", "auto")
    if tools is not None:
        if not (isinstance(tools, list) and all(isinstance(t, dict) and t.get("type") == "function" and
                                                isinstance(t.get("function"), dict) and
                                                isinstance(t["function"].get("name"), str) for t in tools)):
            raise ApiError(400, "expected tools: a list of {'type': 'function', 'function': {'name': ..., "
                                "'parameters': {...}}}", param="tools")
        req.tools = tools or None
    if choice not in ("auto", "none", None):
        raise ApiError(400, f"tool_choice {_short(choice)} is not served: forcing a call changes what is sampled; "
                            f"expected 'auto' or 'none' (offer the tool; {FORCED_CALL})", param="tool_choice")
    req.parse_tool_calls = bool(req.tools) and choice != "none"
    req.one_call_per_turn = req.parse_tool_calls and body.get("parallel_tool_calls") is False
    req.logprobs = _flag(body, "logprobs")
    req.top_logprobs = _top(body.get("top_logprobs"), req.logprobs)
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ApiError(400, "expected chat_template_kwargs: an object", param="chat_template_kwargs")
    req.template_kwargs = kwargs or {}


def message(m: Any, i: int) -> dict:
    """A message as the chat template reads it: its content as text."""
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise ApiError(400, f"messages[{i}]: expected {{'role': one of {', '.join(ROLES)}, 'content': ...}}",
                       param=f"messages.{i}")
    try:
        text = content_text(m.get("content"))
    except ValueError as exc:
        raise ApiError(400, f"messages[{i}].content: {exc}", param=f"messages.{i}.content") from None
    calls = m.get("tool_calls")
    if calls is not None and not (isinstance(calls, list) and all(
            isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
            for c in calls)):
        raise ApiError(400, f"messages[{i}].tool_calls: expected a list of {{'id': ..., 'type': 'function', "
                            "'function': {'name': ..., 'arguments': '...'}}", param=f"messages.{i}.tool_calls")
    return {**m, "role": "system" if m["role"] == "developer" else m["role"], "content": text}


def _completion_fields(body: dict, req: Request) -> None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list) and not (prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                        for t in prompt)):
        raise ApiError(400, "expected prompt: a string or a list of token ids (one prompt per call)", param="prompt")
    if not isinstance(prompt, (str, list)) or not prompt:
        raise ApiError(400, "expected prompt: a non-empty string or a list of token ids (one prompt per call)",
                       param="prompt")
    for key in ("echo", "suffix"):
        if body.get(key):
            raise ApiError(400, f"{key} is not served", param=key)
    if body.get("best_of", 1) not in (1, None) or isinstance(body.get("best_of"), bool):
        raise ApiError(400, "best_of must be 1: each call is one turn of one episode", param="best_of")
    req.prompt = prompt
    logprobs = body.get("logprobs")
    req.logprobs = logprobs is not None and logprobs is not False
    req.top_logprobs = _top(0 if logprobs is True else logprobs, req.logprobs)


def positive(body: dict, key: str) -> int | None:
    """`body[key]`: absent, or a positive integer (400 for anything else)."""
    value = body.get(key)
    if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        raise ApiError(400, f"expected {key}: a positive integer", param=key)
    return value


def text_of(content: Any, param: str, parts: tuple[str, ...] = ("text",)) -> str:
    """Content (a string or text parts of the types `parts`) as text; 400 naming `param` for anything else."""
    try:
        return content_text(content, parts)
    except ValueError as exc:
        raise ApiError(400, f"{param}: {exc}", param=param) from None


def _flag(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if not isinstance(value, bool) and value is not None:
        raise ApiError(400, f"expected {key}: true or false", param=key)
    return bool(value)


def _top(value: Any, wanted: bool) -> int:
    if not wanted or value is None:
        return 0
    if not (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOP_LOGPROBS):
        raise ApiError(400, f"expected top_logprobs: an integer from 0 to {MAX_TOP_LOGPROBS}", param="top_logprobs")
    return value


def _stop(value: Any) -> list[str]:
    stops = [value] if isinstance(value, str) else value or []
    if not (isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)):
        raise ApiError(400, "expected stop: a string or a list of non-empty strings", param="stop")
    return stops


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 80 else text[:80] + "..."


# -- answers ----------------------------------------------------------------------------------------
def models(served: str, asked: str | None) -> dict:
    """GET /v1/models (`asked` None) or /v1/models/{asked}: the one served model."""
    model = {"id": served, "object": "model", "created": 0, "owned_by": "siirl_dag"}
    return {"object": "list", "data": [model]} if asked is None else model


def turn_text(req: Request, text: str, finish_reason: str) -> str:
    """The text a turn gets back: a stop string of the request's own cut off, as OpenAI does."""
    if finish_reason == "stop":
        for stop in req.stop:
            if text.endswith(stop):
                return text[:-len(stop)]
    return text


def assistant_message(req: Request, text: str, call_id: str) -> tuple[dict, str | None]:
    """The reply as an assistant message: its text, and where tools were offered, its well-formed
    `<tool_call>` blocks as tool_calls (a malformed one stays in the text); and the finish_reason it
    implies ('tool_calls', or None: the engine's)."""
    if not req.parse_tool_calls or OPEN not in text:
        return {"role": "assistant", "content": text}, None
    kept, calls, at = [], [], 0
    for start, end, call in call_spans(text):
        if call.error is None:
            kept.append(text[at:start])
            calls.append({"id": f"{call_id}-{len(calls)}", "type": "function",
                          "function": {"name": call.name, "arguments": json.dumps(call.arguments)}})
            at = end
    content = ("".join(kept) + text[at:]).strip()
    if not calls:
        return {"role": "assistant", "content": text}, None
    return {"role": "assistant", "content": content or None, "tool_calls": calls}, "tool_calls"


def logprobs_content(tokenizer: Any, sample: Any) -> list[dict]:
    """OpenAI's `logprobs.content`: each sampled token, its log-prob and the most likely alternatives."""
    def entry(token_id: int, logprob: float) -> dict:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    tops = sample.top_logprobs or [[] for _ in sample.token_ids]
    return [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top]}
            for t, lp, top in zip(sample.token_ids, sample.logprobs, tops)]


def chat_answer(answer_id: str, model: str, message: dict, finish_reason: str, usage: dict,
                logprobs: list[dict] | None) -> dict:
    return {"id": answer_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason,
                         "logprobs": None if logprobs is None else {"content": logprobs}}], "usage": usage}


def completion_answer(answer_id: str, model: str, text: str, finish_reason: str, usage: dict,
                      logprobs: list[dict] | None) -> dict:
    legacy = None if logprobs is None else {
        "tokens": [e["token"] for e in logprobs], "token_logprobs": [e["logprob"] for e in logprobs],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in logprobs], "text_offset": []}
    return {"id": answer_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": legacy}], "usage": usage}


def stream_chunks(answer: dict, include_usage: bool) -> list[dict]:
    """A whole answer as the chunks of a stream: the message in one, the finish in the next."""
    choice, chat = answer["choices"][0], answer["object"] == "chat.completion"
    base = {k: answer[k] for k in ("id", "created", "model")}
    base["object"] = "chat.completion.chunk" if chat else "text_completion"
    if chat:
        delta = {k: v for k, v in choice["message"].items() if v is not None}
        if "tool_calls" in delta:
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(delta["tool_calls"])]
        first = {"index": 0, "delta": delta, "logprobs": choice["logprobs"], "finish_reason": None}
        last = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}
    else:
        first = {"index": 0, "text": choice["text"], "logprobs": choice["logprobs"], "finish_reason": None}
        last = {"index": 0, "text": "", "logprobs": None, "finish_reason": choice["finish_reason"]}
    chunks = [{**base, "choices": [first]}, {**base, "choices": [last]}]
    if include_usage:
        chunks.append({**base, "choices": [], "usage": answer["usage"]})
    return chunks
