"""Command-line overrides: `a.b.c=value`, values typed as YAML (as in verl/siiRL scripts).

Applied to the raw document before validation. A path may name a node by its id
(`nodes.actor_update.params.lr=1e-6`) or by index (`nodes.3...`). Creating a key the schema does not
know is caught by the schema check (every object in the language is closed), and the problem then
points at the override rather than at a line of the file.
"""

from __future__ import annotations

from typing import Any

import yaml

from siirl_dag.config.yaml_loader import LimitedLoader, LimitError
from siirl_dag.errors import ConfigError, Problem

OVERRIDE_FILE = "<command line>"


def parse_override(text: str) -> tuple[list[str], Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"'{text}' is not an override; expected key.path=value")
    try:
        value = yaml.load(raw, Loader=LimitedLoader) if raw.strip() else ""
    except LimitError as exc:
        raise ValueError(f"value of '{key}': {exc.problem}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"value of '{key}' is not valid YAML ({exc.__class__.__name__}); quote it") from None
    parts = key.strip().split(".")
    if not all(parts):
        raise ValueError(f"key '{key.strip()}' has an empty part; expected names joined by single dots (a.b.c=value)")
    return parts, value


def _resolve_part(container: Any, part: str, path: tuple) -> Any:
    """Map one dotted part to a real key: list index, or node id inside `nodes`."""
    if isinstance(container, list):
        if part.isdigit() and int(part) < len(container):
            return int(part)
        if path == ("nodes",):
            for i, item in enumerate(container):
                if isinstance(item, dict) and item.get("id") == part:
                    return i
            ids = [n.get("id") for n in container if isinstance(n, dict)]
            raise KeyError(f"no node with id '{part}' (nodes: {', '.join(map(str, ids))})")
        raise KeyError(f"'{part}' is not an index of this list (length {len(container)})")
    return part


def apply_overrides(data: dict, overrides: list[str], positions: dict) -> dict[tuple, str]:
    """Apply overrides in order, in place; forget the file positions under each touched path.

    Returns {touched path: override text}; raises ConfigError naming every bad override.
    """
    problems: list[Problem] = []
    touched: dict[tuple, str] = {}
    for index, text in enumerate(overrides, start=1):
        try:
            parts, value = parse_override(text)
            node, path = data, ()
            for depth, part in enumerate(parts):
                key = _resolve_part(node, part, path)
                last = depth == len(parts) - 1
                if last:
                    node[key] = value
                else:
                    if isinstance(node, dict) and key not in node:
                        node[key] = {}
                    node = node[key]
                    if not isinstance(node, (dict, list)):
                        raise KeyError(f"'{'.'.join(parts[: depth + 1])}' is a value, not a section")
                path = path + (key,)
            touched[path] = text
            for p in [k for k in positions if k[: len(path)] == path]:
                del positions[p]
        except (KeyError, ValueError, TypeError) as exc:
            msg = exc.args[0] if exc.args else str(exc)
            problems.append(Problem(tuple(text.partition("=")[0].split(".")), f"override #{index} '{text}': {msg}", file=OVERRIDE_FILE))
    if problems:
        raise ConfigError(problems)
    return touched
