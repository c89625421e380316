"""Prompt templates over a sample's fields, for a judge's prompt or a rollout that answers another
model's samples: `{prompt}` (the question: a text prompt, or a chat prompt's last user turn),
`{response}` (the sample's response, decoded), `{ground_truth}`, `{data_source}` and
`{extra_info.KEY}` (any data column kept in extra_info). `{{` and `}}` are literal braces.

Parsed, never evaluated: a field is a name from this list, nothing else (no format specs, no
attribute or index access), so a template cannot run code.
"""

from __future__ import annotations

import re
from typing import Any

# field -> the batch keys it is read from
FIELDS = {"prompt": ("raw_prompt",), "response": ("responses", "response_mask"), "ground_truth": ("ground_truth",),
          "data_source": ("data_source",)}
EXTRA = "extra_info."
_PIECE = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")
EXPECTED = ("expected fields {prompt}, {response}, {ground_truth}, {data_source} or {extra_info.KEY}, "
            "and {{ }} for literal braces")


def parse(template: str) -> list[str | tuple[str]]:
    """Literal text (str) and fields ((name,)) in order; ValueError naming what is wrong."""
    out: list[str | tuple[str]] = []
    at = 0
    for m in _PIECE.finditer(template):
        out.append(template[at:m.start()])
        at = m.end()
        piece, name = m.group(0), m.group(1)
        if piece in ("{{", "}}"):
            out.append(piece[0])
        elif name is None:
            raise ValueError(f"a lone '{piece}' at character {m.start()}; {EXPECTED}")
        elif name.strip() not in FIELDS and not (name.startswith(EXTRA) and re.fullmatch(r"\w+", name[len(EXTRA):])):
            raise ValueError(f"unknown field '{{{name}}}'; {EXPECTED}")
        else:
            out.append((name.strip(),))
    out.append(template[at:])
    return [p for p in out if p != ""]


def fields(template: str) -> list[str]:
    return [p[0] for p in parse(template) if isinstance(p, tuple)]


def consumed(template: str) -> tuple[str, ...]:
    """The batch keys a template reads (a template that does not parse reads none: its node's check says why)."""
    try:
        names = fields(template)
    except ValueError:
        return ()
    keys: list[str] = []
    for name in names:
        for key in FIELDS.get(name, ("extra_info",)):
            if key not in keys:
                keys.append(key)
    return tuple(keys)


def prompt_text(raw_prompt: Any) -> str:
    """A text prompt as it is; a chat prompt's last user turn."""
    if isinstance(raw_prompt, str):
        return raw_prompt
    turns = [t for t in raw_prompt if isinstance(t, dict) and t.get("role") == "user"]
    return str(turns[-1].get("content", "")) if turns else ""


def render(template: str, values: dict) -> str:
    """The template with each field's value (`values`: field name -> text; extra_info: a mapping)."""
    out = []
    for piece in parse(template):
        if isinstance(piece, str):
            out.append(piece)
        elif piece[0].startswith(EXTRA):
            out.append(str((values.get("extra_info") or {}).get(piece[0][len(EXTRA):], "")))
        else:
            out.append(str(values.get(piece[0], "")))
    return "".join(out)


def row_values(batch, tokenizer) -> list[dict]:
    """Each row's fields as text; responses decoded (the tokens its mask marks) with `tokenizer`."""
    rows = batch.num_rows
    responses = None
    if "responses" in batch:
        responses = [tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=True)
                     for ids, mask in zip(batch["responses"], batch["response_mask"])]
    out = []
    for i in range(rows):
        values = {key: batch[key][i] for key in ("ground_truth", "data_source", "extra_info") if key in batch}
        if "raw_prompt" in batch:
            values["prompt"] = prompt_text(batch["raw_prompt"][i])
        if responses is not None:
            values["response"] = responses[i]
        out.append(values)
    return out


def fitted(template: str, values: dict, count, limit: int) -> tuple[str | None, bool]:
    """The template rendered within `limit` by `count` (text -> tokens): as it is, else with the
    response cut to its longest start that fits (a decoded response may take more tokens than it
    had). Returns (text or None if even an empty response does not fit, whether it was cut)."""
    text = render(template, values)
    if count(text) <= limit:
        return text, False
    response, lo, hi = str(values.get("response", "")), 0, len(str(values.get("response", ""))) - 1
    while lo < hi:  # the longest prefix that fits
        mid = (lo + hi + 1) // 2
        if count(render(template, {**values, "response": response[:mid]})) <= limit:
            lo = mid
        else:
            hi = mid - 1
    text = render(template, {**values, "response": response[:lo]})
    return (text if count(text) <= limit else None), True


def fitted_rows(template: str, rows: list[dict], engine, limit: int) -> list[tuple[str | None, bool]]:
    """`fitted` for each row's values, counted as `engine` (a vLLM rollout strategy) tokenizes a prompt."""
    from siirl_dag.strategies.samples import prompt_token_ids  # torch: only where an engine runs

    def count(text: str) -> int:
        return len(prompt_token_ids(engine.tokenizer, text, engine.options["chat_template"]))

    return [fitted(template, values, count, limit) for values in rows]


def missing_extra(template: str, data) -> list[str]:
    """The {extra_info.KEY} fields some rows of a dataset lack (checked before a run starts)."""
    keys = [f[len(EXTRA):] for f in fields(template) if f.startswith(EXTRA)]
    out = []
    for key in keys:
        lacking = sum(1 for row in data.rows if key not in (row.get("extra_info") or {}))
        if lacking:
            out.append(f"{lacking} of {len(data)} rows have no extra_info.{key}, which the template reads; "
                       "expected every row to have it")
    return out
