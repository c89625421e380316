"""The OpenAI-compatible endpoint of one rollout, on the agents' event loop.

    GET  /v1/models, /v1/models/ID  the served model (in Anthropic's shapes when asked with `anthropic-version`)
    POST /v1/chat/completions       a turn of the episode the API key opens
    POST /v1/completions
    POST /v1/responses              a chat turn, asked and answered in the Responses API's shapes (responses_api)
    POST /v1/messages               a chat turn in Anthropic's Messages API's shapes (messages_api)
    POST /v1/messages/count_tokens  the tokens such a call's messages would take as a prompt
    (the same under /episodes/<i>/v1/...: each episode's own base URL, which checks the key is its own)

It is reached two ways that answer alike (`Endpoint.reply`): over HTTP (aiohttp, on an ephemeral port,
for agent programs and for any client an agent makes from its base URL), and, for the `openai` client
handed to a Python agent, which lives in this same process, through `transport()`: an httpx transport
that hands the request's bytes to `reply` without a socket, sparing each call the HTTP round trip
through two stacks (about half of a call's CPU here); `thread_transport` does it for a synchronous
agent's client, from the agent's thread. Bodies larger than `max_request_mb` are answered
413; errors come in OpenAI's JSON shape. Requests are parsed as JSON, never evaluated.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
from dataclasses import dataclass
from typing import Any, Mapping

import httpx
from aiohttp import web

from nodes import json_nesting
from nodes.agents import messages_api, openai_api, responses_api
from nodes.agents.openai_api import ApiError
from nodes.agents.service import Service

ROUTE = re.compile(r"(?:/episodes/(?P<episode>[^/]+))?/v1/(?:models/(?P<model>.+)|"
                   r"(?P<call>models|chat/completions|completions|responses|messages|messages/count_tokens))")
METHODS = {"models": "GET", "chat/completions": "POST", "completions": "POST", "responses": "POST", "messages": "POST",
           "messages/count_tokens": "POST"}
OTHER_APIS = {"responses": responses_api, "messages": messages_api}  # a chat turn in another API's shapes
MAX_DEPTH = 100  # nesting of a request's JSON (a tool's schema inside a message inside the body: a few levels)


@dataclass
class Reply:
    status: int
    body: dict[str, Any]
    chunks: list[dict[str, Any]] | None = None  # a streamed answer's server-sent events
    named: bool = False  # the events are named by their type (the Responses and Messages APIs' streams)

    def payload(self) -> tuple[bytes, str]:
        """The reply's bytes and content type."""
        if self.chunks is None:
            return json.dumps(self.body).encode(), "application/json"
        if self.named:  # each event named by its type; these streams end with their last event, no [DONE]
            events = "".join(f"event: {chunk['type']}\ndata: {json.dumps(chunk)}\n\n" for chunk in self.chunks)
            return events.encode(), "text/event-stream"
        events = "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in self.chunks)
        return (events + "data: [DONE]\n\n").encode(), "text/event-stream"


class Endpoint:
    def __init__(self, service: Service, host: str, max_request_mb: float):
        self.service, self.host = service, host
        self.max_bytes = int(max_request_mb * 2**20)
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> str:
        """Listen on an ephemeral port; the base URL (http://HOST:PORT)."""
        app = web.Application(client_max_size=self.max_bytes)
        app.router.add_route("*", "/{path:.*}", self._http)
        # a client that hangs up (its timeout) has its turn aborted: its retry continues the conversation.
        # Stopped, it waits a second for what is left (a client's half-sent request), not aiohttp's minute.
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://{self.host if ':' not in self.host else f'[{self.host}]'}:{port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def base_url(self, index: int) -> str:
        """Episode `index`'s own base URL (its key works there, and at the common one)."""
        return f"{self.url}/episodes/{index}/v1"

    def transport(self) -> httpx.AsyncBaseTransport:
        """Requests to this endpoint answered in this process, without a socket."""
        return _InProcess(self)

    def thread_transport(self, loop: asyncio.AbstractEventLoop) -> httpx.BaseTransport:
        """The same for a synchronous client on another thread, `loop` being the one this endpoint runs on."""
        return _FromThread(self, loop)

    async def reply(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> Reply:
        """The answer to one request, whichever way it came."""
        route = ROUTE.fullmatch(path)
        call = None if route is None else "models" if route["model"] is not None else route["call"]
        anthropic = call in ("messages", "messages/count_tokens") or "anthropic-version" in headers
        episode = None
        try:
            if route is None:
                raise ApiError(404, f"no such path: {path}; expected /v1/chat/completions, /v1/completions, "
                                    "/v1/responses, /v1/messages or /v1/models under the episode's base URL", "not_found")
            if method != METHODS[call]:
                raise ApiError(405, f"{path} answers {METHODS[call]}, not {method}", "method_not_allowed")
            episode = self._episode(headers, route["episode"])
            if call == "models":
                return Reply(200, self._models(route["model"], anthropic))
            if len(body) > self.max_bytes:
                raise _too_large(len(body), self.max_bytes)
            try:
                text = body.decode()  # JSON between machines is UTF-8 (RFC 8259)
                parsed = json_nesting.loads(text, MAX_DEPTH)
            except ValueError as exc:  # UnicodeDecodeError too
                raise ApiError(400, f"the request body cannot be read as JSON in UTF-8 ({exc})") from None
            if ("\\u" in text or "\\U" in text) and not _unicode(parsed):  # only escapes make a lone surrogate
                raise ApiError(400, "the request holds a lone UTF-16 surrogate escape (\\ud800 to \\udfff without its "
                                    "pair); expected valid Unicode text")
            if call == "messages/count_tokens":
                asked = messages_api.read(parsed, self.service.model, counting=True)
                return Reply(200, {"input_tokens": self.service.count(asked.chat)})
            if call in OTHER_APIS:
                api = OTHER_APIS[call]
                asked = api.read(parsed, self.service.model)
                shaped = api.answer(await self.service.chat(episode, asked.chat), asked)
                return Reply(200, shaped, api.stream_events(shaped) if asked.chat.stream else None, True)
            chat = call == "chat/completions"
            req = openai_api.read(parsed, self.service.model, chat)
            answer = await (self.service.chat if chat else self.service.complete)(episode, req)
        except ApiError as exc:
            if episode is not None:  # the episode's own call was refused (not a stranger's key)
                episode.refuse(f"{exc.status} {exc.message}")
            return Reply(exc.status, messages_api.error_body(exc) if anthropic else exc.body())
        return Reply(200, answer, openai_api.stream_chunks(answer, req.include_usage) if req.stream else None)

    def _models(self, asked: str | None, anthropic: bool) -> dict:
        served = self.service.model
        if asked is not None and asked != served:  # the path as received is decoded already
            raise ApiError(404, f"the model '{asked}' does not exist here; this endpoint serves '{served}'",
                           "model_not_found")
        return (messages_api if anthropic else openai_api).models(served, asked)

    async def _http(self, request: web.Request) -> web.Response:
        try:
            body = await _body(request, self.max_bytes)
        except ApiError as exc:
            reply = Reply(exc.status, exc.body())
        else:
            reply = await self.reply(request.method, request.path, request.headers, body)
        payload, kind = reply.payload()
        return web.Response(body=payload, status=reply.status, content_type=kind)

    def _episode(self, headers: Mapping[str, str], index: str | None):
        header = headers.get("Authorization", "")
        key = header[len("Bearer "):].strip() if header[:len("Bearer ")].lower() == "bearer " else \
            headers.get("api-key") or headers.get("x-api-key")  # Anthropic's clients
        return self.service.authorize(key, index)


class _InProcess(httpx.AsyncBaseTransport):
    def __init__(self, endpoint: Endpoint):
        self.endpoint = endpoint

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        answer = self.endpoint.reply(request.method, request.url.path, request.headers, body)
        try:  # the client's read timeout, as a socket would keep it: the call's turn is aborted
            return _response(await asyncio.wait_for(answer, _read_timeout(request)), request)
        except asyncio.TimeoutError:
            raise httpx.ReadTimeout("no answer within the client's read timeout", request=request) from None


class _FromThread(httpx.BaseTransport):
    """A synchronous client's calls, made on an agent's thread, answered on the endpoint's event loop."""

    def __init__(self, endpoint: Endpoint, loop: asyncio.AbstractEventLoop):
        self.endpoint, self.loop = endpoint, loop

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        body = request.read()
        answer = self.endpoint.reply(request.method, request.url.path, request.headers, body)
        call = asyncio.run_coroutine_threadsafe(answer, self.loop)
        try:
            return _response(call.result(_read_timeout(request)), request)
        except concurrent.futures.TimeoutError:
            call.cancel()  # its turn aborted
            raise httpx.ReadTimeout("no answer within the client's read timeout", request=request) from None
        except concurrent.futures.CancelledError:
            raise httpx.ReadError("the call was stopped: its episode has ended", request=request) from None


def _read_timeout(request: httpx.Request) -> float | None:
    return request.extensions.get("timeout", {}).get("read")


def _response(reply: Reply, request: httpx.Request) -> httpx.Response:
    payload, kind = reply.payload()
    return httpx.Response(reply.status, headers={"content-type": kind}, content=payload, request=request)


def _unicode(parsed: Any) -> bool:
    """Whether every string in it is valid Unicode (JSON's escapes can write half a surrogate pair)."""
    try:
        json.dumps(parsed, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return False
    return True


async def _body(request: web.Request, limit: int) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(request.content_length, limit)
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(None, limit) from None


def _too_large(size: int | None, limit: int) -> ApiError:
    what = f"{size} bytes" if size is not None else "larger"
    return ApiError(413, f"the request body is {what}; at most {limit} bytes are read (params.max_request_mb)",
                    "request_too_large")
