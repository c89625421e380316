"""Safe YAML loading that remembers where every key and value came from.

PyYAML's composer gives nodes with marks; we build plain Python data from them ourselves, so no
object is ever constructed from a tag, duplicate keys are caught (PyYAML silently keeps the last),
and every path maps to (line, col) for error messages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from siirl_dag.errors import ConfigError, Problem

Position = tuple[int, int]  # 1-based line, col
Positions = dict[tuple, Position]


_CONSTRUCTOR = yaml.SafeLoader("")


def _scalar(node: yaml.ScalarNode) -> Any:
    """Resolve a scalar as the YAML 1.1 safe loader does (ints, floats, bools, null); tags refused."""
    return _CONSTRUCTOR.construct_object(node)


def _mark(node: yaml.Node) -> Position:
    return node.start_mark.line + 1, node.start_mark.column + 1


_PLAIN_TAGS = {f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null", "seq", "map", "timestamp")}


def _build(node: yaml.Node, path: tuple, positions: Positions, problems: list[Problem]) -> Any:
    positions.setdefault(path, _mark(node))
    if node.tag not in _PLAIN_TAGS:
        line, col = _mark(node)
        problems.append(Problem(path, f"tag '{node.tag}' is not allowed; only plain YAML (no tags) is accepted", line=line, col=col))
        return None
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                problems.append(Problem(path, "a mapping key must be a plain scalar", line=_mark(key_node)[0], col=_mark(key_node)[1]))
                continue
            if key_node.tag == "tag:yaml.org,2002:merge":
                problems.append(Problem(path, "merge keys ('<<') are not supported; write the keys out", line=_mark(key_node)[0], col=_mark(key_node)[1]))
                continue
            key = str(_scalar(key_node))
            if key in out:
                line, col = _mark(key_node)
                first = positions.get(path + (key,), ("?", "?"))[0]
                problems.append(Problem(path + (key,), f"duplicate key (first defined on line {first}); each key may appear once", line=line, col=col))
                continue
            positions[path + (key,)] = _mark(key_node)
            out[key] = _build(value_node, path + (key,), positions, problems)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_build(item, path + (i,), positions, problems) for i, item in enumerate(node.value)]
    return _scalar(node)


def locate(problems: list[Problem], file: str, positions: Positions, touched: dict) -> list[Problem]:
    """Attach FILE:LINE:COL (or the override that set the key) from the longest known path prefix."""
    from siirl_dag.config.overrides import OVERRIDE_FILE

    for p in problems:
        if p.file is not None and p.file != file:
            continue
        p.file = file
        for cut in range(len(p.path), -1, -1):
            prefix = tuple(p.path[:cut])
            if prefix in touched:
                p.file, p.line, p.col = OVERRIDE_FILE, None, None
                p.message = f"{p.message} (set by override '{touched[prefix]}')"
                break
            if prefix in positions:
                p.line, p.col = positions[prefix]
                break
    return problems


def load_yaml(path: str | Path) -> tuple[Any, Positions]:
    """Parse `path` safely; return (data, positions). Syntax errors become a ConfigError."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([Problem((), f"no such file; expected a pipeline YAML file", file=str(path))]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([Problem((), f"cannot read file ({exc})", file=str(path))]) from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (None, None)
        raise ConfigError([Problem((), f"YAML syntax error: {exc.problem or exc}; expected valid YAML", file=str(path), line=line, col=col)]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([Problem((), f"YAML error: {exc}", file=str(path))]) from None
    if node is None:
        raise ConfigError([Problem((), "the file is empty; expected a pipeline mapping", file=str(path), line=1, col=1)])
    positions: Positions = {}
    problems: list[Problem] = []
    try:
        data = _build(node, (), positions, problems)
    except yaml.constructor.ConstructorError as exc:
        mark = exc.problem_mark
        raise ConfigError([Problem((), f"{exc.problem}; only plain YAML (no tags) is accepted", file=str(path), line=mark.line + 1 if mark else None, col=mark.column + 1 if mark else None)]) from None
    for p in problems:
        p.file = str(path)
    if problems:
        raise ConfigError(problems)
    return data, positions
