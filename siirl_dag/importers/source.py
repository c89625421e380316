"""A peer's configuration as dotted keys with their lines, and what an importer makes of it.

Importers `take` each key they carry over; `dropped` names a key with the reason it has no
counterpart; whatever is neither taken nor dropped is listed by `not_carried()`, so nothing is
silently lost. A value the reader could not resolve (a shell variable the script does not set, an
OmegaConf resolver) is never written as if it were one: `take` leaves it out (the engine's default
is used, and the key is listed), `take_path` writes it as written and says so. Problems (a size
that does not divide, a key of the wrong type) name FILE:LINE.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from siirl_dag.config.yaml_loader import load_yaml
from siirl_dag.errors import ConfigError, Problem

_MISSING = object()


@dataclass
class Left:
    """A source key not carried over, with why (empty: the importer does not know it)."""

    key: str
    value: Any
    line: int | None
    why: str = ""

    def __str__(self) -> str:
        return f"{self.key}={short(self.value)}" + (f" ({self.why})" if self.why else " (no counterpart known)")


def short(value: Any) -> str:
    """A value as the audit shows it: at most 60 characters."""
    text = repr(value) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass
class Source:
    """Flat `a.b.c -> (value, line)` of one source file."""

    file: str
    keys: dict[str, tuple[Any, int | None]]
    taken: set[str] = field(default_factory=set)
    notes: dict[str, str] = field(default_factory=dict)
    remarks: list[Left] = field(default_factory=list)  # carried over, but not exactly
    problems: list[Problem] = field(default_factory=list)
    unresolved: dict[str, str] = field(default_factory=dict)  # key -> why its value is not known
    origins: dict[str, tuple[str, int | None]] = field(default_factory=dict)  # key -> (file, line) read from another file

    @classmethod
    def from_yaml(cls, path: str | Path, *, lists: bool = False, whole: tuple[str, ...] = (), resolve: bool = True) -> Source:
        """A YAML file, flattened (`lists`: lists of mappings too, by index: `tools.0.class_name`; keys
        named in `whole` keep their value whole, one row; `resolve`: False leaves OmegaConf references for
        after the files it inherits are included); a file that is not a mapping is refused at its line."""
        doc, positions = load_yaml(path, "a YAML configuration file")
        if not isinstance(doc, dict):
            raise ConfigError(Problem((), "expected a YAML mapping of configuration keys", file=str(path), line=1))
        flat: dict[str, tuple[Any, int | None]] = {}
        _flatten(doc, (), positions, flat, lists, whole)
        return cls(str(path), flat).resolve() if resolve else cls(str(path), flat)

    def include(self, other: Source, prefix: str = "") -> None:
        """Another file's keys (a file this one names), under `prefix`; keys this source sets itself win.
        Their lines are the other file's, so they are kept as origins (problems point there)."""
        for key, (value, line) in other.keys.items():
            if prefix + key not in self.keys and not self._shadows(prefix + key):
                self.keys[prefix + key] = (value, None)
                self.origins[prefix + key] = (other.file, line)
                if key in other.unresolved:
                    self.unresolved[prefix + key] = other.unresolved[key]

    def _shadows(self, key: str) -> bool:
        """Whether this source replaces `key` of a file it includes, as OmegaConf merges: by a value (not a
        mapping) at a key above it (`optimizer: null`), or by keys under it."""
        parts = key.split(".")
        above = (".".join(parts[:i]) for i in range(1, len(parts)))
        return any(k in self.keys and self.keys[k][0] != {} for k in above) or any(k.startswith(key + ".") for k in self.keys)

    def resolve(self) -> Source:
        """OmegaConf references resolved; a value still holding one (a resolver, an unknown key) is unresolved."""
        resolve_references(self.keys)
        for key, (value, _) in self.keys.items():
            if isinstance(value, str) and _REF_ANY.search(value) and key not in self.notes:
                self.unresolved.setdefault(key, f"{short(value)} is an OmegaConf interpolation that is not resolved here")
        return self

    def has(self, key: str) -> bool:
        return key in self.keys

    def where(self, key: str) -> tuple[str, int | None]:
        """The file and line that set `key` (this source's, or the file it was included from)."""
        return self.origins.get(key, (self.file, self.line(key)))

    def line(self, key: str) -> int | None:
        return self.keys.get(key, (None, None))[1]

    def take(self, key: str, default: Any = None, *, kind: type | tuple[type, ...] | None = None) -> Any:
        """The value at `key` (marked as carried over), else `default`; a value not of `kind` is a problem."""
        value, _ = self.keys.get(key, (_MISSING, None))
        if key in self.unresolved:
            self.notes.setdefault(key, f"{self.unresolved[key]}; the engine's default is used")
            return default
        if value is _MISSING or value is None:
            self.taken.add(key)
            return default
        self.taken.add(key)
        if kind is not None and (not isinstance(value, kind) or (isinstance(value, bool) and bool not in _tuple(kind))):
            names = " or ".join(k.__name__ for k in _tuple(kind))
            self.problem(key, f"{value!r} is not a {names}; expected a {names}")
            return default
        return value

    def take_path(self, key: str, default: Any = None) -> Any:
        """A path or name: an unresolved one is written as in the source, and the user told to fix it."""
        if key not in self.unresolved:
            return self.take(key, default)
        self.taken.add(key)
        self.remark(key, f"{self.unresolved[key]}; written as in the source: replace it")
        return self.keys[key][0]

    def value(self, key: str, default: Any = None) -> Any:
        """The value at `key` without taking it (None and unresolved values read as `default`)."""
        value = self.keys.get(key, (None, None))[0]
        return default if value is None or key in self.unresolved else value

    def drop(self, key: str, why: str) -> None:
        """Mark a present key as not carried over, for a reason shown to the user."""
        if key in self.keys and key not in self.taken:
            self.notes[key] = why

    def drop_under(self, prefix: str, why: str) -> None:
        for key in self.under(prefix):
            self.drop(key, why)

    def remark(self, key: str, why: str) -> None:
        """A key carried over with a difference the user should know about."""
        value, line = self.keys.get(key, (None, None))
        self.remarks.append(Left(key, value, line, why))

    def under(self, prefix: str) -> list[str]:
        return [k for k in self.keys if k == prefix or k.startswith(prefix + ".")]

    def problem(self, key: str, message: str) -> None:
        file, line = self.where(key)
        self.problems.append(Problem((key,), message, file=file, line=line))

    def carried(self) -> list[Left]:
        """Keys carried over as written (taken, present, and not remarked)."""
        remarked = {x.key for x in self.remarks}
        return [Left(k, v, line, "carried over") for k, (v, line) in self.keys.items() if k in self.taken and k not in remarked]

    def not_carried(self) -> list[Left]:
        """Keys neither taken nor dropped silently: each with its value, line and reason."""
        return [Left(k, v, line, self.notes.get(k) or self.unresolved.get(k, "")) for k, (v, line) in self.keys.items()
                if k not in self.taken]

    def raise_problems(self) -> None:
        if self.problems:
            raise ConfigError(self.problems)


def _tuple(kind) -> tuple:
    return kind if isinstance(kind, tuple) else (kind,)


def _flatten(value: Any, path: tuple, positions: dict, out: dict, lists: bool = False, whole: tuple = ()) -> None:
    kept = bool(path) and path[-1] in whole  # one row for the whole value
    if isinstance(value, dict) and value and not kept:
        for k, v in value.items():
            _flatten(v, path + (k,), positions, out, lists, whole)
        return
    if lists and isinstance(value, list) and value and not kept and all(isinstance(v, dict) for v in value):
        for i, v in enumerate(value):
            _flatten(v, path + (i,), positions, out, lists, whole)
        return
    pos = positions.get(path)
    out[".".join(str(p) for p in path)] = (value, pos[0] if pos else None)


_REF = re.compile(r"\$\{([A-Za-z_][\w.]*)\}")
_REF_ANY = re.compile(r"\$\{[^}]*\}")
_RELATIVE = re.compile(r"\$\{(\.+)([A-Za-z_][\w.]*)\}")


def _absolute(key: str, m: re.Match) -> str:
    """OmegaConf's relative reference in `key`'s value: one dot a sibling, each more dot a level up."""
    parent = key.split(".")[:-1]
    up = len(m.group(1)) - 1
    return f"${{{'.'.join((parent[:len(parent) - up] if up else parent) + [m.group(2)])}}}" if up <= len(parent) else m.group(0)


def resolve_references(keys: dict[str, tuple[Any, int | None]]) -> None:
    """OmegaConf's `${a.b}` (AReaL, ROLL, NeMo-RL; `${.b}` relative) replaced by the value at a.b, in place: a whole-value
    reference keeps its type, one inside text is substituted as text; resolvers (`${oc.env:X}`) and
    unknown keys stay as written (they are then reported with the key)."""
    for key, (value, line) in keys.items():  # relative ones (${.temperature}: a sibling) made absolute
        if isinstance(value, str) and "${." in value:
            keys[key] = (_RELATIVE.sub(lambda m: _absolute(key, m), value), line)
    for _ in range(8):  # chains of references; a cycle stays unresolved
        changed = False
        for key, (value, line) in keys.items():
            if not isinstance(value, str) or "${" not in value:
                continue
            whole = _REF.fullmatch(value)
            if whole and whole.group(1) in keys:
                new = keys[whole.group(1)][0]
            else:
                new = _REF.sub(lambda m: str(keys[m.group(1)][0]) if m.group(1) in keys else m.group(0), value)
            if new != value:
                keys[key], changed = (new, line), True
        if not changed:
            return


@dataclass
class Imported:
    """A pipeline document (plain data, written as YAML) and the source keys it does not carry."""

    source: Source
    peer: str
    pipeline: dict
    left: list[Left]
    remarks: list[Left]
