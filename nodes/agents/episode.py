"""One agent episode as the token ids the engine sampled and the ones it was shown.

Token faithful: a call's context is the previous call's tokens plus only its new messages rendered
(`chat_render`), so the model's tokens are trained as sampled, never re-tokenized from text. An episode
may hold several conversations at once (a framework's sub-agents, parallel branches, an agent used as
a tool): a call continues the segment whose conversation its messages extend, and runs beside the calls
continuing others. A call whose messages extend none (the agent rewrote or dropped turns, switched
between chat and completions, or forked a conversation another call is continuing) starts a new
segment: its whole conversation is the new prompt. Each segment becomes one training row; its mask
covers the model's tokens only.
"""

from __future__ import annotations

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


@dataclass(eq=False)  # each is itself: two alike (two forks of one conversation) are two rows
class Segment:
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)  # after the prompt: the model's turns and the messages between
    mask: list[int] = field(default_factory=list)  # 1: a token the model sampled, 0: one it was shown
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "stop"  # its last turn's
    finished: int = -1  # the episode's turns finished before its latest: rows are in this order, the final answer last

    def extend(self, ids: list[int], sampled: bool, logprobs: list[float] | None = None) -> None:
        self.ids += ids
        self.mask += [int(sampled)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)


@dataclass(eq=False)
class Conversation:
    """A segment as calls continue it: what a call's messages (chat) or prompt (completions) must begin
    with, None until its first turn; busy while one of its turns is generated."""

    segment: Segment
    chat: bool  # continued by chat calls (history: normalized messages), or by completions (text or ids)
    opening: Any = None  # its first message (chat calls): another that opens alike rewrote or forked it
    history: list | str | list[int] | None = None
    ended_with_eos: bool = False  # its last turn ended with EOS (the template's close then starts after it)
    busy: bool = False


@dataclass
class Planned:
    """The episode's call number `number`: a turn to generate after `context` (up to `max_tokens`) and append
    to `conversation`; or, with no context, none: the episode has no turn or no room left, and the call is
    answered with an empty completion (finish_reason length)."""

    context: list[int] | None
    number: int  # its call's, unique in the episode: its turn's seed, its answer's ids
    max_tokens: int = 0
    shown: list[int] = field(default_factory=list)  # the new messages' tokens, appended with the turn
    history: Any = None  # what the conversation will hold once the turn is appended
    conversation: Conversation | None = None


class Episode:
    """What one episode said and was told, segment by segment. A call plans its turn, then finishes it
    (appended) or releases it (refused, cancelled): one conversation's turns one at a time, several
    conversations' at once."""

    def __init__(self, index: int, prompt_index: int, key: str, render: ChatRender, limits: Limits):
        self.index, self.prompt_index, self.key, self.render, self.limits = index, prompt_index, key, render, limits
        self.conversations: list[Conversation] = []  # each a segment, in the order they began
        self.ended = False  # the agent returned, failed or ran out of time: its key is revoked
        self.turns = self.tool_calls = self.sampling_overridden = 0
        self.past_limits = 0  # calls answered empty: past max_turns, or no room left in the response budget
        self.refused, self.first_refusal = 0, ""  # calls answered with an error (a conversation too long, a bad request)
        self._calls = 0  # calls planned: each call's number (its turn's seed, its answer's ids) is its own
        self.endpoint_seconds: list[float] = []
        self.calls: set = set()  # its calls in flight (asyncio tasks), cancelled when it ends

    # -- chat (/v1/chat/completions) -------------------------------------------------------------
    def plan_chat(self, messages: list[dict], tools: list[dict] | None, template_kwargs: dict) -> Planned:
        normalized = [normalize(m) for m in messages]
        known = self._continued(True, lambda h: normalized[:len(h)] == h)
        if known is not None:
            shown = self.render.after_turn(messages[len(known.history):], known.ended_with_eos, tools, **template_kwargs)
            return self._planned(known, shown, normalized)
        return self._new_segment(self.render.prompt(messages, tools, **template_kwargs), normalized, True)

    def finish_chat(self, planned: Planned, sample: Any, reply: dict) -> None:
        """Append the turn (`sample`, as the engine sampled it) and the reply the agent was sent."""
        self._append(planned, sample, planned.history + [normalize(reply)])

    # -- completions (/v1/completions) -----------------------------------------------------------
    def plan_text(self, prompt: str | list[int]) -> Planned:
        tok = self.render.tokenizer
        known = self._continued(False, lambda h: type(h) is type(prompt) and prompt[:len(h)] == h)
        if known is not None:
            rest = prompt[len(known.history):]
            shown = list(rest) if isinstance(rest, list) else tok.encode(rest, add_special_tokens=False) if rest else []
            return self._planned(known, shown, prompt)
        return self._new_segment(list(prompt) if isinstance(prompt, list) else tok.encode(prompt), prompt, False)

    def finish_text(self, planned: Planned, sample: Any, text: str) -> None:
        self._append(planned, sample,
                     planned.history + (list(sample.token_ids) if isinstance(planned.history, list) else text))

    # -- common ----------------------------------------------------------------------------------
    @property
    def segments(self) -> list[Segment]:
        return [c.segment for c in self.conversations]

    @property
    def in_flight(self) -> int:
        """Turns planned and not yet finished or released: one per busy conversation."""
        return sum(c.busy for c in self.conversations)

    @property
    def prefix_breaks(self) -> int:
        """Segments that open as an earlier one does (their first message; any after another for completions):
        the agent rewrote, trimmed or forked a conversation. A segment that opens otherwise is another
        conversation (a sub-agent's, a worker's with its own system prompt), no break."""
        return sum(any(d.chat is c.chat and d.opening == c.opening for d in self.conversations[:i])
                   for i, c in enumerate(self.conversations))

    def release(self, planned: Planned) -> None:
        """The call of `planned` is over (a no-op once its turn is finished): its conversation may be
        continued again. A conversation that never got a turn is forgotten, its segment too."""
        known, planned.conversation = planned.conversation, None
        if known is not None:
            known.busy = False
            if known.history is None:
                self.conversations.remove(known)

    def _continued(self, chat: bool, extends) -> Conversation | None:
        """The conversation a chat (or completions) call continues: of the idle ones whose history
        `extends` holds for, the longest (of equals, the latest)."""
        found = [c for c in self.conversations
                 if c.chat is chat and not c.busy and c.history is not None and extends(c.history)]
        return max(reversed(found), key=lambda c: len(c.history), default=None)

    def _new_segment(self, prompt_ids: list[int], history: Any, chat: bool) -> Planned:
        if len(prompt_ids) > self.limits.max_prompt:
            raise TooLong(f"this conversation is {len(prompt_ids)} tokens, more than the {self.limits.max_prompt} "
                          "a prompt may have (data.max_prompt_length); expected a shorter conversation, or a larger "
                          "data.max_prompt_length")
        return self._planned(Conversation(Segment(prompt_ids), chat, history[:1] if chat else None), [], history, new=True)

    def _planned(self, known: Conversation, shown: list[int], history: Any, new: bool = False) -> Planned:
        segment, number = known.segment, self._calls
        self._calls += 1
        room = self.limits.budget - len(segment.ids) - len(shown)
        if self.turns + self.in_flight >= self.limits.max_turns or room < 1:
            self.past_limits += 1
            return Planned(None, number)
        if new:
            self.conversations.append(known)
        known.busy = True
        return Planned(segment.prompt_ids + segment.ids + shown, number, min(room, self.limits.max_tokens_per_turn),
                       shown, history, known)

    def _append(self, planned: Planned, sample: Any, history: Any) -> None:
        known = planned.conversation
        segment = known.segment
        segment.extend(planned.shown, False)
        segment.extend(list(sample.token_ids), True, list(sample.logprobs))
        segment.finish_reason, segment.finished = sample.finish_reason, self.turns
        eos = self.render.tokenizer.eos_token_id
        known.history, known.ended_with_eos = history, bool(sample.token_ids) and sample.token_ids[-1] == eos
        self.turns += 1
        self.release(planned)

    def refuse(self, why: str) -> None:
        """One of its calls was answered with an error (`why`)."""
        self.refused += 1
        self.first_refusal = self.first_refusal or why

    def record(self) -> EpisodeRecord:
        return EpisodeRecord(self.index, self.prompt_index, self.segments, self.turns, self.tool_calls,
                             self.prefix_breaks, self.sampling_overridden, self.endpoint_seconds, self.past_limits,
                             self.refused, self.first_refusal)


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
    past_limits: int
    refused: int  # calls answered with an error
    first_refusal: str  # the first one's message

    @classmethod
    def unheard(cls, index: int, prompt_index: int) -> EpisodeRecord:
        """An episode whose record never came back (its agents' process was stopped or died)."""
        return cls(index, prompt_index, [], 0, 0, 0, 0, [], 0, 0, "")

    def rows(self) -> list[Segment]:
        """The segments that hold a turn of the model's: the episode's training rows, the one with its
        latest turn (its final answer) last."""
        return sorted((s for s in self.segments if any(s.mask)), key=lambda s: s.finished)


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
