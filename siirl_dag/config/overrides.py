"""Command-line overrides: `a.b.c=value`, values typed as YAML (as in verl/siiRL scripts).

Applied to the raw document before validation. A path may name a node by its id
(`nodes.actor_update.params.lr=1e-6`) or by index (`nodes.3...`). Creating a key the schema does not
know is caught by the schema check (every object in the language is closed), and the problem then
points at the override rather than at a line of the file.

Entries of the language's own maps (a model, a mesh, an input binding) follow Hydra's convention: a
plain key must exist in the file, `+models.x.path=...` adds one (and must not exist), `++key=value`
sets it either way. So a misspelt model or mesh name is an error, not a silent new entry.
"""

from __future__ import annotations

from typing import Any

import yaml

from siirl_dag.config.yaml_loader import LimitedLoader, LimitError
from siirl_dag.errors import OVERRIDE_FILE, ConfigError, Problem



def _mode(text: str) -> tuple[str, str]:
    """('', 'a.b=1'), ('+', ...) adds a key, ('++', ...) adds or sets it (Hydra's prefixes)."""
    for prefix in ("++", "+"):
        if text.startswith(prefix):
            return prefix, text[len(prefix):]
    return "", text


def _branch(schema: dict | None, kind: str) -> dict | None:
    """The sub-schema of `schema` for an instance of `kind` ('object' or 'array'), $refs followed."""
    from siirl_dag.config.schema import load_schema

    while isinstance(schema, dict) and "$ref" in schema:
        ref = schema["$ref"].split("/")
        schema = load_schema("pipeline.schema.json")
        for part in ref[1:]:
            schema = schema[part]
    if not isinstance(schema, dict):
        return None
    for alternatives in (schema.get("oneOf"), schema.get("anyOf")):
        for alt in alternatives or ():
            found = _branch(alt, kind)
            if found is not None and found.get("type") == kind:
                return found
    return schema if schema.get("type") == kind or "properties" in schema else None


def _child(schema: dict | None, key) -> dict | None:
    """The schema of `key` inside an object or array schema (None: not known here)."""
    if schema is None:
        return None
    if isinstance(key, int):
        return _branch(schema.get("items"), "object") if schema.get("type") == "array" else None
    if key in schema.get("properties", {}):
        return schema["properties"][key]
    extra = schema.get("additionalProperties")
    return extra if isinstance(extra, dict) else None


def _is_map(schema: dict | None, key: str) -> bool:
    """Whether `key` would be a new entry of one of the language's maps (models, meshes, inputs)."""
    return schema is not None and key not in schema.get("properties", {}) \
        and isinstance(schema.get("additionalProperties"), dict)


def parse_override(text: str) -> tuple[list[str], Any]:
    key, sep, raw = _mode(text)[1].partition("=")
    if not sep or not key.strip():
        raise ValueError(f"'{text}' is not an override; expected key.path=value (+key.path=value adds a key)")
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
            mode = _mode(text)[0]
            parts, value = parse_override(text)
            node, path, schema, added = data, (), _branch({"$ref": "#"}, "object"), None
            for depth, part in enumerate(parts):
                key = _resolve_part(node, part, path)
                last = depth == len(parts) - 1
                dotted = ".".join(parts[: depth + 1])
                new = isinstance(node, dict) and key not in node
                if new and not mode and _is_map(schema, key):
                    have = ", ".join(map(str, node)) or "none"
                    raise KeyError(f"'{dotted}' is not in the file ({parts[depth - 1] if depth else 'keys'}: {have}); "
                                   f"expected an existing key, or '+{text}' to add one (a plain key must exist)")
                if last and mode == "+" and not new:
                    raise KeyError(f"'{dotted}' is already in the file; expected no '+' to change it ('+' adds a key)")
                schema = _branch(_child(schema, key), "array" if isinstance(node.get(key) if isinstance(node, dict)
                                                                             else None, list) else "object")
                if last:
                    node[key] = value
                else:
                    if new:
                        node[key] = {}
                    node = node[key]
                    if not isinstance(node, (dict, list)):
                        raise KeyError(f"'{dotted}' is a value, not a section")
                path = path + (key,)
                added = added or (path if new else None)  # a section the file does not have: all the override's
            touched[added or path] = text
            for p in [k for k in positions if k[: len(path)] == path]:
                del positions[p]
        except (KeyError, ValueError, TypeError) as exc:
            msg = exc.args[0] if exc.args else str(exc)
            problems.append(Problem(tuple(_mode(text)[1].partition("=")[0].split(".")), f"override #{index} '{text}': {msg}", file=OVERRIDE_FILE))
    if problems:
        raise ConfigError(problems)
    return touched
