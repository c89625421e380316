"""The calls of one rollout's episodes, answered from the engine: the agent endpoint's handlers and the
environment loop both come here, so every path is the same token-faithful one (episode.py).

An episode is reached by its key (401 for a key that is unknown or whose episode has ended, 403 for a
live key used on another episode's address); its calls may run at once (each continues a conversation
of its own, or starts one: episode.py).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

from jinja2 import TemplateError

from nodes.agents import openai_api
from nodes.agents.episode import Episode, Limits, TooLong
from nodes.agents.engine_link import AgentsEnd, TurnRefused
from nodes.agents.openai_api import ApiError, Request
from nodes.chat_render import ChatRender

STOP_AT_CALL = "</tool_call>"  # parallel_tool_calls: false ends the turn at its first call


class Service:
    def __init__(self, turns: AgentsEnd, render: ChatRender, model: str, limits: Limits, seed: int | None):
        self.turns, self.render, self.model, self.limits, self.seed = turns, render, model, limits, seed
        self._by_key: dict[str, Episode] = {}
        self._revoked: set[str] = set()

    def open(self, index: int, prompt_index: int) -> Episode:
        """Episode `index` of the rollout (its address, its seeds), on sample `prompt_index`."""
        key = "sk-episode-" + secrets.token_urlsafe(24)
        episode = Episode(index, prompt_index, key, self.render, self.limits)
        self._by_key[key] = episode
        return episode

    def end(self, episode: Episode) -> None:
        """The episode is over (returned, failed, out of time): its key stops working and its calls in
        flight are cancelled (their turns aborted on the engine)."""
        episode.ended = True
        self._by_key.pop(episode.key, None)
        self._revoked.add(episode.key)
        for task in list(episode.calls):
            task.cancel()

    def authorize(self, key: str | None, index: str | None = None) -> Episode:
        """The episode `key` opens; `index`: the episode the address names."""
        episode = self._by_key.get(key or "")
        if episode is None:
            why = "its episode has ended" if key in self._revoked else "no episode has it"
            raise ApiError(401, f"this API key does not open an episode ({why}); expected the key the episode was "
                                "given (OPENAI_API_KEY)", "invalid_api_key")
        if index is not None and index != str(episode.index):
            raise ApiError(403, f"this API key belongs to episode {episode.index}, not to episode {index}; an episode "
                                "may only add to its own conversation", "wrong_episode")
        return episode

    async def chat(self, episode: Episode, req: Request) -> dict:
        """A /v1/chat/completions call: the next turn after `req.messages`."""
        self._check_template_kwargs(req.template_kwargs)
        async with _Call(episode) as call:
            planned = call.planned = self._plan(lambda: episode.plan_chat(req.messages, req.tools, req.template_kwargs),
                                                "messages")
            if planned.context is None:
                message, finish, sample = {"role": "assistant", "content": ""}, "length", None
            else:
                stop = req.stop + ([STOP_AT_CALL] if req.one_call_per_turn else [])
                sample = await self._generate(episode, planned, req, stop)
                text = openai_api.turn_text(req, sample.text, sample.finish_reason)
                message, calls = openai_api.assistant_message(req, text, f"call-{episode.index}-{planned.number}")
                finish = calls or sample.finish_reason
                episode.finish_chat(planned, sample, message)
                episode.tool_calls += len(message.get("tool_calls", ()))
            call.answer = openai_api.chat_answer(f"chatcmpl-{episode.index}-{planned.number}", self.model, message,
                                                 finish, _usage(planned, sample), self._logprobs(req, sample))
            episode.sampling_overridden += req.overridden
            return call.answer

    async def complete(self, episode: Episode, req: Request) -> dict:
        """A /v1/completions call: the continuation of `req.prompt`."""
        if isinstance(req.prompt, list) and max(req.prompt) > self.render.max_token_id:
            raise ApiError(400, f"token id {max(req.prompt)} is not in the model's vocabulary; expected ids from 0 to "
                                f"{self.render.max_token_id}", param="prompt")
        async with _Call(episode) as call:
            planned = call.planned = self._plan(lambda: episode.plan_text(req.prompt), "prompt")
            text, finish, sample = "", "length", None
            if planned.context is not None:
                sample = await self._generate(episode, planned, req, req.stop)
                text, finish = openai_api.turn_text(req, sample.text, sample.finish_reason), sample.finish_reason
                episode.finish_text(planned, sample, text)
            call.answer = openai_api.completion_answer(f"cmpl-{episode.index}-{planned.number}", self.model, text, finish,
                                                       _usage(planned, sample), self._logprobs(req, sample))
            episode.sampling_overridden += req.overridden
            return call.answer

    def _check_template_kwargs(self, kwargs: dict) -> None:
        """Only the chat template's own variables: a request may not hand the template a template of its
        own (Jinja run on the agents' process, and control tokens written as the model's) or the render's arguments."""
        unknown = sorted(set(kwargs) - self.render.template_variables)
        if unknown:
            known = ", ".join(sorted(self.render.template_variables)) or "none"
            raise ApiError(400, f"chat_template_kwargs: {', '.join(map(repr, unknown))} is not a variable of this model's "
                                f"chat template; expected only its variables ({known})", param="chat_template_kwargs")

    def count(self, req: Request) -> int:
        """The tokens `req.messages` take as a prompt (Anthropic's count_tokens): rendered whole, as a
        conversation's first call is; no episode is changed."""
        self._check_template_kwargs(req.template_kwargs)
        return len(self._plan(lambda: self.render.prompt(req.messages, req.tools, **req.template_kwargs), "messages"))

    def _plan(self, plan, param: str):
        try:
            return plan()
        except TooLong as exc:
            raise ApiError(400, str(exc), "context_length_exceeded", param) from None
        except (ValueError, TypeError, TemplateError) as exc:  # the chat template refused these messages
            raise ApiError(400, f"the chat template cannot render these messages: {exc}", param=param) from None

    async def _generate(self, episode: Episode, planned, req: Request, stop: list[str]):
        seed = None if self.seed is None else turn_seed(self.seed, episode.index, planned.number, self.limits.max_turns)
        max_tokens = min(planned.max_tokens, req.max_tokens or planned.max_tokens)
        try:
            return await self.turns.generate(planned.context, max_tokens, seed, stop, req.top_logprobs)
        except TurnRefused as exc:
            raise ApiError(400, f"the engine refused this turn ({exc}); expected a request it can sample") from None

    def _logprobs(self, req: Request, sample: Any) -> list[dict] | None:
        if not req.logprobs:
            return None
        return [] if sample is None else openai_api.logprobs_content(self.render.tokenizer, sample)


class _Call:
    """One call of an episode: timed, cancelled when the episode ends, its planned turn released after."""

    def __init__(self, episode: Episode):
        self.episode, self.answer, self.planned = episode, None, None

    async def __aenter__(self) -> _Call:
        if self.episode.ended:
            raise ApiError(401, "this episode has ended; expected calls only while its agent runs", "invalid_api_key")
        self.began, self.task = time.perf_counter(), asyncio.current_task()
        self.episode.calls.add(self.task)
        return self

    async def __aexit__(self, kind, exc, tb) -> None:
        self.episode.calls.discard(self.task)
        if self.planned is not None:
            self.episode.release(self.planned)
        if exc is None:
            self.episode.endpoint_seconds.append(time.perf_counter() - self.began)


def turn_seed(seed: int, episode: int, number: int, max_turns: int) -> int:
    """The seed of an episode's call `number`: the engine's own loop's for its turns (agent_loop), and, for a
    number past max_turns (calls released before it: refused, cancelled), one apart from the next
    episode's, which would otherwise sample the same turn after the same prompt."""
    if number < max_turns:
        return (seed + episode * max_turns + number) % 2**31
    return hash((seed, episode, number)) % 2**31  # ints hash alike in every process


def _usage(planned, sample) -> dict:
    prompt = len(planned.context or ())
    completion = len(sample.token_ids) if sample is not None else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
