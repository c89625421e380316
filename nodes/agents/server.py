"""The OpenAI-compatible HTTP endpoint of one rollout (aiohttp, on the agents' event loop).

    GET  /v1/models                 the served model
    POST /v1/chat/completions       a turn of the episode the API key opens
    POST /v1/completions
    (the same under /episodes/<i>/v1/...: each episode's own base URL, which checks the key is its own)

It lives as long as the rollout, on an ephemeral port; bodies larger than `max_request_mb` are answered
413; errors come in OpenAI's JSON shape. Requests are parsed as JSON, never evaluated.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from nodes.agents import openai_api
from nodes.agents.openai_api import ApiError
from nodes.agents.service import Service


class Endpoint:
    def __init__(self, service: Service, host: str, max_request_mb: float):
        self.service, self.host = service, host
        self.max_bytes = int(max_request_mb * 2**20)
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> str:
        """Listen on an ephemeral port; the base URL (http://HOST:PORT)."""
        app = web.Application(client_max_size=self.max_bytes)
        for prefix in ("", "/episodes/{episode}"):
            app.router.add_get(prefix + "/v1/models", self._models)
            app.router.add_post(prefix + "/v1/chat/completions", self._chat)
            app.router.add_post(prefix + "/v1/completions", self._completions)
        self._runner = web.AppRunner(app, access_log=None)
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

    async def _models(self, request: web.Request) -> web.StreamResponse:
        try:
            self._episode(request)
        except ApiError as exc:
            return _error(exc)
        return web.json_response({"object": "list", "data": [
            {"id": self.service.model, "object": "model", "created": 0, "owned_by": "siirl_dag"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._turn(request, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._turn(request, chat=False)

    async def _turn(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            episode = self._episode(request)
            raw = await _body(request, self.max_bytes)
            try:
                body = json.loads(raw)
            except ValueError as exc:
                raise ApiError(400, f"the request body is not JSON ({exc})") from None
            req = openai_api.read(body, self.service.model, chat)
            answer = await (self.service.chat if chat else self.service.complete)(episode, req)
        except ApiError as exc:
            return _error(exc)
        if not req.stream:
            return web.json_response(answer)
        return await _stream(request, openai_api.stream_chunks(answer, req.include_usage))

    def _episode(self, request: web.Request):
        header = request.headers.get("Authorization", "")
        key = header[len("Bearer "):].strip() if header.startswith("Bearer ") else request.headers.get("api-key")
        return self.service.authorize(key, request.match_info.get("episode"))


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


def _error(exc: ApiError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status)


async def _stream(request: web.Request, chunks: list[dict[str, Any]]) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    for chunk in chunks:
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
