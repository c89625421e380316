"""Chat messages as the token ids a model reads, each message rendered once and never again.

A conversation's first request is rendered whole by the chat template; every later one only its new
messages: the text the template writes after an assistant turn's content (its close, the new
messages, the generation prompt), cut from a rendering of them after a stand-in turn. The tokens of
earlier turns stay what they were, so the model's own tokens are never re-tokenized (a round trip
through text can merge or split them differently), and what a template would write differently in
them once more messages follow (Qwen3 drops an earlier turn's thinking) is left as the model saw it.
The new text is tokenized whole, as the model's tokenizer read such text in training (a content's
last characters and the template's next ones may be one token). A content that holds one of the
template's control tokens (`<|im_end|>`: text from a tool, an environment or an agent) is tokenized
apart, the control token as plain text, so it cannot end a turn or fake a role; the template's own
text keeps its control tokens, so what else a conversation puts in it (its tools, tool calls' names
and arguments) may hold none of them (ValueError). The stand-ins cut
out of a rendering carry a random tag, which no request can hold.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import secrets
from typing import Any

from nodes import json_nesting

_TAG = secrets.token_hex(8)
_USER, _ASSISTANT = f"U{_TAG}", f"A{_TAG}"  # stand-ins of the turn new messages follow
_CONTENT = "C{}x" + _TAG  # stand-in of the i-th message content, cut out of the rendering
ARGUMENTS_DEPTH = 100  # a tool call's arguments nested deeper are shown as their text
# what the rendering sets itself, never a request's chat_template_kwargs: the conversation, its tools, the prompt
_RENDER_SETS = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


class ChatRender:
    """A tokenizer's chat template, rendering conversations and their continuations as token ids."""

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.template_variables = _template_variables(tokenizer)
        # where contents are tokenized apart (one holds a control token), the template's own text between
        # them (the system prompt with the tools, a turn's close) is the same in every episode: tokenized once
        self._template_ids = functools.lru_cache(maxsize=256)(self._template_text_ids)
        # so is a rendering of stand-ins (a tool's answer after a turn): rendered once, by the messages' shape,
        # less the fields the template never names (a tool answer's tool_call_id, new in every call)
        self._rendered_shape = functools.lru_cache(maxsize=256)(self._render_shape)
        source = tokenizer.chat_template
        self._source = "".join(source.values()) if isinstance(source, dict) else source

    def prompt(self, messages: list[dict], tools: list[dict] | None = None, **template_kwargs: Any) -> list[int]:
        """The whole conversation and the generation prompt."""
        ready = _template_ready(messages)
        self._check_plain(ready, tools, template_kwargs)
        masked, contents = _stand_ins(ready)
        rendered = self._rendered_shape(self._shape(False, masked, tools, template_kwargs))
        text = self._render(ready, tools, True, template_kwargs)
        pieces = _pieces(rendered, contents, text)
        if pieces is None:  # the template changed a content: the whole text, tokenized as vLLM's server does
            self._check_contents_plain(contents)
            return self._encode([(text, False)])
        return self._encode(pieces)

    def after_turn(self, messages: list[dict], ended_with_eos: bool, tools: list[dict] | None = None,
                   **template_kwargs: Any) -> list[int]:
        """What follows an assistant turn: the template's close of the turn (less the EOS the model
        sampled, when it ended with one), the new `messages`, and the generation prompt."""
        ready = _template_ready(messages)
        self._check_plain(ready, tools, template_kwargs)
        masked, contents = _stand_ins(ready)
        rendered = self._rendered_shape(self._shape(True, masked, tools, template_kwargs))
        text = self._after_turn_text(ready, tools, template_kwargs)
        pieces = _pieces(rendered, contents, text)
        if pieces is None:
            self._check_contents_plain(contents)
            if _TAG in text:
                raise ValueError("the chat template writes the turn's content again after it; expected a template "
                                 "that writes each message once")
            pieces = [(text, False)]
        eos = self.tokenizer.eos_token or ""
        if ended_with_eos and eos:  # the model wrote the close's EOS itself
            pieces[0] = (pieces[0][0].removeprefix(eos), False)
        return self._encode(pieces)

    def _after_turn_text(self, messages: list[dict], tools, template_kwargs: dict) -> str:
        """The text after a stand-in assistant turn's content in a rendering of it followed by `messages`."""
        rendered = self._render(_turn() + messages, tools, True, template_kwargs)
        at = rendered.find(_ASSISTANT)
        if at == -1:
            raise ValueError("the chat template does not show an assistant turn's content as it is; expected a "
                             "template that writes it unchanged")
        if _TAG in rendered[:at].replace(_USER, ""):  # a new message's content before the turn it follows
            raise ValueError("the chat template writes a message that follows a turn before that turn (a system "
                             "message moved to the top, say), so the conversation cannot go on from the model's own "
                             "tokens; expected such a message first, or none")
        return rendered[at + len(_ASSISTANT):]

    def _shape(self, after_turn: bool, masked: list[dict], tools, template_kwargs: dict) -> str:
        named = [{k: v for k, v in m.items() if k in ("role", "content") or k in self._source} for m in masked]
        return json.dumps([after_turn, named, tools, template_kwargs], default=str)

    def _render_shape(self, shape: str) -> str:
        """The rendering of stand-in messages (`shape`: JSON of [after a turn?, messages, tools, template
        kwargs]). Should the shape miss what the template reads (a value JSON does not carry, a field read
        only by going over a message's items), the pieces cut from it do not make the messages' own
        rendering, which is then used whole (`_pieces`)."""
        after_turn, messages, tools, template_kwargs = json.loads(shape)
        if after_turn:
            return self._after_turn_text(messages, tools, template_kwargs)
        return self._render(messages, tools, True, template_kwargs)

    @functools.cached_property
    def max_token_id(self) -> int:
        """The largest token id the tokenizer knows (its added tokens included)."""
        return max(self.tokenizer.get_vocab().values())

    def text_after_turn(self, messages: list[dict], ended_with_eos: bool = False) -> str:
        """`after_turn`'s text (to check a template can show such messages at all)."""
        return self.tokenizer.decode(self.after_turn(messages, ended_with_eos), skip_special_tokens=False)

    @functools.cached_property
    def _control_tokens(self) -> tuple[str, ...]:
        special = {t.content for t in self.tokenizer.added_tokens_decoder.values() if t.special}
        return tuple(sorted(special | set(self.tokenizer.all_special_tokens)))

    def _check_plain(self, ready: list[dict], tools, template_kwargs: dict) -> None:
        """What the template writes as its own text besides the contents (the tools, tool calls with their
        arguments as it reads them: `ready`, a message's other fields) must not hold a control token."""
        fields = [{k: v for k, v in m.items() if k != "content" or not isinstance(v, str)} for m in ready]
        token = self._control_token_in([json.dumps([tools, template_kwargs, fields], ensure_ascii=False, default=str)])
        if token:
            raise ValueError(f"the model's control token {token!r} is in the tools, a tool call, a content that is "
                             "not text (a list of parts) or a message's other fields, which the template writes as "
                             "its own text; expected plain text there")

    def _check_contents_plain(self, contents: list[str]) -> None:
        """Contents this template changes as it shows them are tokenized with its text: none may hold a control token."""
        token = self._control_token_in(contents)
        if token:
            raise ValueError(f"a message's content holds the model's control token {token!r}, and this chat template "
                             "changes contents as it shows them, so it cannot be kept plain text; expected contents "
                             "without it")

    def _control_token_in(self, texts: list[str]) -> str | None:
        return next((token for token in self._control_tokens if any(token in text for text in texts)), None)

    def _render(self, messages: list[dict], tools, generation_prompt: bool, template_kwargs: dict) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=generation_prompt,
                                                  tokenize=False, **template_kwargs)

    def _encode(self, pieces: list[tuple[str, bool]]) -> list[int]:
        """The pieces' tokens as the model's tokenizer reads their whole text, as in its training (where a
        content ends, its last characters and the template's next ones may be one token: "." and "\n\n"
        are ".\n\n" in Qwen's vocabulary), when every control token read is the template's own. Else (a
        content holds one) each content is tokenized apart, its control tokens as plain text."""
        if self._control_token_in([text for text, content in pieces if content]) is None:
            ids = self.tokenizer.encode("".join(text for text, _ in pieces), add_special_tokens=False)
            own = [self._control_ids[token] for text, content in pieces if not content
                   for token in self._control_pattern.findall(text)]
            if [i for i in ids if i in self._control_id_set] == own:
                return ids
        return [i for text, content in pieces if text
                for i in (self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True) if content
                          else self._template_ids(text))]

    @functools.cached_property
    def _control_ids(self) -> dict[str, int]:
        return {token: self.tokenizer.convert_tokens_to_ids(token) for token in self._control_tokens}

    @functools.cached_property
    def _control_id_set(self) -> frozenset[int]:
        return frozenset(self._control_ids.values())

    @functools.cached_property
    def _control_pattern(self) -> re.Pattern:
        return re.compile("|".join(re.escape(t) for t in sorted(self._control_tokens, key=len, reverse=True)))

    def _template_text_ids(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=False))


def _template_variables(tokenizer: Any) -> frozenset[str]:
    """The chat template's variables a request may set (Qwen3's enable_thinking, say): the names it reads
    that neither the rendering, Jinja, the tokenizer's special tokens nor the template itself (`set`, a
    loop's variable) provide. Nothing else may be passed to the template (`chat_template` itself, `tokenize`, ...)."""
    from jinja2 import meta, nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:  # transformers' own environment, with its extensions and globals
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        _compile_jinja_template = None
    source = tokenizer.chat_template
    names: set[str] = set()
    for text in source.values() if isinstance(source, dict) else [source]:
        env = _compile_jinja_template(text).environment if _compile_jinja_template else \
            ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
        tree = env.parse(text)
        own = {name.name for name in tree.find_all(nodes.Name) if name.ctx in ("store", "param")}
        names |= meta.find_undeclared_variables(tree) - set(env.globals) - own
    return frozenset(names - _RENDER_SETS - set(tokenizer.special_tokens_map))


def _turn() -> list[dict]:
    return [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}]


def _template_ready(messages: list[dict]) -> list[dict]:
    """Messages as HF chat templates read them: a tool call's arguments as an object, not JSON text."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": _arguments(c["function"])}}
                                     if isinstance(c.get("function"), dict) else c for c in calls]}
        out.append(m)
    return out


def _arguments(function: dict) -> Any:
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            return json_nesting.loads(args, ARGUMENTS_DEPTH)
        except ValueError:  # not JSON, or nested too deeply to write again: shown as text
            return args
    return args


def _stand_ins(ready: list[dict]) -> tuple[list[dict], list[str]]:
    """Template-ready messages with each text content replaced by a stand-in; the contents, in order."""
    masked, contents = [], []
    for m in ready:
        m = copy.copy(m)
        if isinstance(m.get("content"), str) and m["content"]:
            contents.append(m["content"])
            m["content"] = _CONTENT.format(len(contents) - 1)
        masked.append(m)
    return masked, contents


def _pieces(rendered: str, contents: list[str], text: str) -> list[tuple[str, bool]] | None:
    """`rendered`'s pieces (`_cut`) where they make `text`, the rendering of the messages themselves; None
    where the template wrote a content changed, or wrote otherwise for what a content holds (Qwen3 moves an
    assistant content's thinking, and a user message that is tool responses changes how it shows a turn)."""
    pieces = _cut(rendered, contents)
    return pieces if pieces is not None and "".join(piece for piece, _ in pieces) == text else None


def _cut(rendered: str, contents: list[str]) -> list[tuple[str, bool]] | None:
    """(text, is a message's content) pieces, the stand-ins replaced by their contents; None when the
    template did not show each content once, as it is."""
    pieces, at = [], 0
    for i, content in enumerate(contents):
        stand_in = _CONTENT.format(i)
        found = rendered.find(stand_in, at)
        if found == -1:
            return None
        pieces += [(rendered[at:found], False), (content, True)]
        at = found + len(stand_in)
    pieces.append((rendered[at:], False))
    return None if any(_TAG in text for text, content in pieces if not content) else pieces
