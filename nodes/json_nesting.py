"""How deeply JSON nests, measured without recursion: parsed JSON from a request or a model is checked
before anything recurses over it (json.dumps, a template's tojson), which Python does only ~1,000 deep."""

from __future__ import annotations

import json
import math
from typing import Any


def depth(value: Any, limit: int) -> int:
    """Nesting depth of parsed JSON (a scalar: 0), counted up to `limit` + 1 at most."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, level)
            if level <= limit:
                stack += [(child, level + 1) for child in (item.values() if isinstance(item, dict) else item)]
    return deepest


def loads(text: str, limit: int) -> Any:
    """`text` parsed; ValueError if it is not JSON (NaN and Infinity are not) or nests deeper than `limit`."""
    try:
        value = json.loads(text, **STRICT)
    except RecursionError:
        raise ValueError(f"nested deeper than {limit} levels") from None
    if depth(value, limit) > limit:
        raise ValueError(f"nested deeper than {limit} levels")
    return value


def _not_json(constant: str) -> None:
    raise ValueError(f"{constant} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of a float's range")
    return value


STRICT = {"parse_constant": _not_json, "parse_float": _finite}  # json.loads' options: finite numbers only
