"""One agent episode as the token ids the engine sampled and the ones it was shown.

Token faithful: a call's context is the previous call's tokens plus only its new messages rendered
(`chat_render`), so the model's tokens are trained as sampled, never re-tokenized from text. A call
whose messages do not extend the episode's history (the agent rewrote or dropped turns, or switched
between chat and completions) starts a new segment: its whole conversation is the new prompt. Each
segment becomes one training row; its mask covers the model's tokens only.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from nodes import json_nesting
from nodes.chat_render import ARGUMENTS_DEPTH, ChatRender


class TooLong(ValueError):
    """A conversation that does not fit the prompt length (OpenAI's context_length_exceeded)."""


@dataclass(frozen=True)
class Limits:
    max_prompt: int  # tokens of a segment's prompt (data.max_prompt_length)
    budget: int  # tokens after it: the model's turns and the messages between them (data.max_response_length)
    max_turns: int  # completions per episode
    max_tokens_per_turn: int


@dataclass
class Segment:
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)  # after the prompt: the model's turns and the messages between
    mask: list[int] = field(default_factory=list)  # 1: a token the model sampled, 0: one it was shown
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "stop"  # its last turn's

    def extend(self, ids: list[int], sampled: bool, logprobs: list[float] | None = None) -> None:
        self.ids += ids
        self.mask += [int(sampled)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)


@dataclass
class Planned:
    """A turn to generate after `context` (up to `max_tokens`), or, with no context, none: the episode has
    no turn or no room left, and the call is answered with an empty completion (finish_reason length)."""

    context: list[int] | None
    max_tokens: int = 0
    shown: list[int] = field(default_factory=list)  # the new messages' tokens, appended with the turn
    history: Any = None  # what the segment will hold once the turn is appended


class Episode:
    """What one episode said and was told, segment by segment; one call at a time (`lock`)."""

    def __init__(self, index: int, prompt_index: int, key: str, render: ChatRender, limits: Limits):
        self.index, self.prompt_index, self.key, self.render, self.limits = index, prompt_index, key, render, limits
        self.segments: list[Segment] = []
        self.lock = asyncio.Lock()
        self.ended = False  # the agent returned, failed or ran out of time: its key is revoked
        self.turns = self.prefix_breaks = self.tool_calls = self.sampling_overridden = 0
        self.endpoint_seconds: list[float] = []
        self.calls: set = set()  # its calls in flight (asyncio tasks), cancelled when it ends
        self._chat: list | None = None  # the current segment's messages, normalized (chat calls)
        self._text: str | list[int] | None = None  # its prompt and completions as text or ids (completions calls)
        self._ended_with_eos = False  # its last turn ended with EOS (the template's close then starts after it)

    # -- chat (/v1/chat/completions) -------------------------------------------------------------
    def plan_chat(self, messages: list[dict], tools: list[dict] | None, template_kwargs: dict) -> Planned:
        normalized = [normalize(m) for m in messages]
        known = self._chat
        if self.segments and known is not None and normalized[:len(known)] == known:
            shown = self.render.after_turn(messages[len(known):], self._ended_with_eos, tools, **template_kwargs)
            return self._planned(shown, normalized)
        return self._new_segment(self.render.prompt(messages, tools, **template_kwargs), normalized)

    def finish_chat(self, planned: Planned, sample: Any, reply: dict) -> None:
        """Append the turn (`sample`, as the engine sampled it) and the reply the agent was sent."""
        self._append(planned, sample)
        self._chat, self._text = planned.history + [normalize(reply)], None

    # -- completions (/v1/completions) -----------------------------------------------------------
    def plan_text(self, prompt: str | list[int]) -> Planned:
        tok, known = self.render.tokenizer, self._text
        if self.segments and type(known) is type(prompt) and prompt[:len(known)] == known:
            rest = prompt[len(known):]
            shown = list(rest) if isinstance(rest, list) else tok.encode(rest, add_special_tokens=False) if rest else []
            return self._planned(shown, prompt)
        return self._new_segment(list(prompt) if isinstance(prompt, list) else tok.encode(prompt), prompt)

    def finish_text(self, planned: Planned, sample: Any, text: str) -> None:
        self._append(planned, sample)
        self._text = planned.history + (list(sample.token_ids) if isinstance(planned.history, list) else text)
        self._chat = None

    # -- common ----------------------------------------------------------------------------------
    def _new_segment(self, prompt_ids: list[int], history: Any) -> Planned:
        if len(prompt_ids) > self.limits.max_prompt:
            raise TooLong(f"this conversation is {len(prompt_ids)} tokens, more than the {self.limits.max_prompt} "
                          "a prompt may have (data.max_prompt_length); expected a shorter conversation, or a larger "
                          "data.max_prompt_length")
        if self.segments:
            self.prefix_breaks += 1
        self.segments.append(Segment(prompt_ids))
        self._chat = self._text = None
        return self._planned([], history)

    def _planned(self, shown: list[int], history: Any) -> Planned:
        segment = self.segments[-1]
        room = self.limits.budget - len(segment.ids) - len(shown)
        if self.turns >= self.limits.max_turns or room < 1:
            return Planned(None)
        return Planned(segment.prompt_ids + segment.ids + shown, min(room, self.limits.max_tokens_per_turn), shown, history)

    def _append(self, planned: Planned, sample: Any) -> None:
        segment = self.segments[-1]
        segment.extend(planned.shown, False)
        segment.extend(list(sample.token_ids), True, list(sample.logprobs))
        segment.finish_reason = sample.finish_reason
        eos = self.render.tokenizer.eos_token_id
        self._ended_with_eos = bool(sample.token_ids) and sample.token_ids[-1] == eos
        self.turns += 1

    def record(self) -> EpisodeRecord:
        return EpisodeRecord(self.index, self.prompt_index, self.segments, self.turns, self.tool_calls,
                             self.prefix_breaks, self.sampling_overridden, self.endpoint_seconds)


@dataclass
class EpisodeRecord:
    """What an episode leaves behind (it crosses from the agents' process to the rank's)."""

    index: int
    prompt_index: int
    segments: list[Segment]
    turns: int
    tool_calls: int
    prefix_breaks: int
    sampling_overridden: int
    endpoint_seconds: list[float]

    def rows(self) -> list[Segment]:
        """The segments that hold a turn of the model's: the episode's training rows."""
        return [s for s in self.segments if any(s.mask)]


def normalize(message: dict) -> tuple:
    """What a message says, for comparing histories: role, text, tool calls (name, parsed arguments);
    not ids, names or fields a client adds."""
    calls = tuple((c.get("function", {}).get("name"), _json_value(c.get("function", {}).get("arguments")))
                  for c in message.get("tool_calls") or ())
    return message.get("role"), content_text(message.get("content")), calls


def content_text(content: Any, parts: tuple[str, ...] = ("text",)) -> str:
    """A message's content as text: a string, None, or a list of text parts, of the types `parts` (the
    APIs name them differently); ValueError for others."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in parts and isinstance(p.get("text"), str)
                                         for p in content):
        return "".join(p["text"] for p in content)
    raise ValueError(f"expected a string or a list of text parts ({{'type': '{parts[0]}', 'text': ...}}); "
                     "this endpoint serves text only")


def _json_value(arguments: Any) -> Any:
    import json

    if isinstance(arguments, str):
        try:
            return json.dumps(json_nesting.loads(arguments, ARGUMENTS_DEPTH), sort_keys=True)
        except ValueError:  # not JSON, or nested too deeply to walk: compared as text
            return arguments
    return json.dumps(arguments, sort_keys=True)
