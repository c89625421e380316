"""Safe YAML loading that remembers where every key and value came from.

PyYAML's composer gives nodes with marks; we build plain Python data from them ourselves, so no
object is ever constructed from a tag, duplicate keys are caught (PyYAML silently keeps the last),
and every path maps to (line, col) for error messages. Nesting depth and what aliases expand to
are bounded, so a small file cannot exhaust the stack or take gigabytes; the file itself must be a
regular file of bounded size (`read_input`), so a FIFO or /dev/zero is refused without reading it.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any

import yaml

from siirl_dag.errors import OVERRIDE_FILE, ConfigError, Problem

Position = tuple[int, int]  # 1-based line, col
Positions = dict[tuple, Position]

MAX_DEPTH = 100  # nesting levels; deeper input would overflow Python's stack in the recursive composer
MAX_ALIASED = 100_000  # values that aliases may add to one file (a "billion laughs" file needs gigabytes)
MAX_BYTES = 2**20  # a pipeline is a few KB; a 50 MB one took minutes and gigabytes to compose
MAX_NODES = 20_000  # YAML values in one document (a pipeline has hundreds; PyYAML composes ~10k a second)

_CONSTRUCTOR = yaml.SafeLoader("")


class LimitError(yaml.MarkedYAMLError):
    """Input that is valid YAML but too deep or too large to build; `problem` says which limit."""


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return node.value if isinstance(node, yaml.SequenceNode) else []


def _size(node: yaml.Node, sizes: dict[int, int]) -> int:
    """Values in `node` once its aliases are expanded (memoized: aliases share nodes)."""
    if id(node) not in sizes:
        sizes[id(node)] = 1 + sum(_size(child, sizes) for child in _children(node))
    return sizes[id(node)]


class LimitedLoader(yaml.SafeLoader):
    """PyYAML's safe composer with limits on nesting depth and on what aliases expand to;
    an alias of a node that contains it (a cycle) is refused too."""

    def __init__(self, stream):
        super().__init__(stream)
        self._open: list[str | None] = []  # anchors of the nodes being composed, outermost first
        self._sizes: dict[int, int] = {}
        self._aliased = 0
        self._composed = 0

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            self._check_alias(event)
            return super().compose_node(parent, index)
        self._composed += 1
        if self._composed > MAX_NODES:
            raise LimitError(problem=f"more than {MAX_NODES} values in one document; expected a pipeline of "
                                     "hundreds of keys", problem_mark=event.start_mark)
        if len(self._open) >= MAX_DEPTH:
            raise LimitError(problem=f"more than {MAX_DEPTH} levels of nesting; expected a flatter document",
                              problem_mark=event.start_mark)
        self._open.append(event.anchor)
        try:
            return super().compose_node(parent, index)
        finally:
            self._open.pop()

    def _check_alias(self, event: yaml.AliasEvent) -> None:
        if event.anchor not in self.anchors:
            return  # PyYAML reports the undefined alias
        if event.anchor in self._open:
            raise LimitError(problem=f"alias '*{event.anchor}' is inside the node it names (a cycle); "
                                      "expected an alias of a finished node", problem_mark=event.start_mark)
        self._aliased += _size(self.anchors[event.anchor], self._sizes)
        if self._aliased > MAX_ALIASED:
            raise LimitError(problem=f"alias '*{event.anchor}' expands the document past {MAX_ALIASED} aliased "
                                      "values; expected aliases of small sections",
                              problem_mark=event.start_mark)


# YAML 1.1 reads `1e-6` (no dot) as a string; YAML 1.2, JSON and every RL config written for Python
# mean a float. Plain scalars only: a quoted '1e-6' stays a string.
LimitedLoader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
                                    list("-+0123456789"))


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
        inside = [text for path, text in touched.items() if p.path and tuple(path[:len(p.path)]) == tuple(p.path)]
        if p.file != OVERRIDE_FILE and inside:  # about a section an override changed: say which
            p.message = f"{p.message} (after override {', '.join(repr(t) for t in inside)}, which changed this section)"
    return problems


def read_input(path: str | Path, expected: str, max_bytes: int = MAX_BYTES, where: tuple = (),
               file: str | None = None) -> str:
    """The text of an input file, which must be a regular file of at most `max_bytes`: a FIFO, a device
    (/dev/zero) or a folder is refused from its metadata, before a byte is read. Problems are at
    `where` in `file` (default: the file itself)."""
    path = Path(path)

    def refuse(message: str) -> ConfigError:  # the file is named once: as the location, or in the message
        subject = "the file" if file is None else f"'{path}'"
        message = message.replace("no such file", f"{subject}: no such file") if message.startswith("no such") \
            else f"{subject} {message}"
        return ConfigError([Problem(tuple(where), message if file is not None or not message.startswith("the file:")
                                    else message[len("the file: "):], file=file or str(path))])

    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise refuse(f"no such file; expected {expected}") from None
    except OSError as exc:
        raise refuse(f"cannot be read ({exc.strerror}); expected {expected}") from None
    if not stat.S_ISREG(info.st_mode):
        what = "a folder" if stat.S_ISDIR(info.st_mode) else "a FIFO" if stat.S_ISFIFO(info.st_mode) else \
            "a device" if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode) else "not a regular file"
        raise refuse(f"is {what}; expected {expected} (a regular file)")
    if info.st_size > max_bytes:
        raise refuse(f"holds {info.st_size / 2**20:.1f} MiB; expected {expected} of at most "
                     f"{max_bytes / 2**20:g} MiB")
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)  # a file that grew since stat is still bounded
        if len(data) > max_bytes:
            raise refuse(f"holds more than {max_bytes / 2**20:g} MiB; expected {expected} of at most that")
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise refuse(f"is not UTF-8 text ({exc.reason} at byte {exc.start}); expected {expected}") from None
    except OSError as exc:
        raise refuse(f"cannot be read ({exc.strerror}); expected {expected}") from None


def load_yaml(path: str | Path, expected: str = "a pipeline YAML file") -> tuple[Any, Positions]:
    """Parse `path` safely; return (data, positions). Syntax errors become a ConfigError."""
    path = Path(path)
    text = read_input(path, expected)
    try:
        node = yaml.compose(text, Loader=LimitedLoader)
    except LimitError as exc:
        mark = exc.problem_mark
        raise ConfigError([Problem((), exc.problem, file=str(path), line=mark.line + 1, col=mark.column + 1)]) from None
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
