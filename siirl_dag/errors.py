"""The one error type of bad input, and the problems it carries.

Every check (schema, graph, placement, batch arithmetic) reports `Problem`s against a key path of
the pipeline document; the config layer attaches FILE:LINE:COL from the YAML positions, and the CLI
prints them all and exits 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence, Union

PathPart = Union[str, int]


def format_path(path: Sequence[PathPart]) -> str:
    """('nodes', 2, 'params', 'x') -> 'nodes[2].params.x'."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "<root>"


OVERRIDE_FILE = "<command line>"  # where a problem an override caused is located


@dataclass
class Problem:
    """One thing wrong (or suspicious, when severity is 'warning') with the input."""

    path: tuple[PathPart, ...]
    message: str
    severity: str = "error"
    file: str | None = None
    line: int | None = None  # 1-based
    col: int | None = None  # 1-based

    def __str__(self) -> str:
        where = ":".join(str(x) for x in (self.file, self.line, self.col) if x is not None)
        prefix = f"{where}: " if where else ""
        tag = "warning: " if self.severity == "warning" else ""
        return f"{prefix}{tag}{format_path(self.path)}: {self.message}"

    def to_json(self) -> dict:
        return {
            "file": self.file,
            "line": self.line,
            "col": self.col,
            "path": format_path(self.path),
            "message": self.message,
            "severity": self.severity,
        }


class ConfigError(ValueError):
    """Bad input. Carries every problem found, not only the first."""

    def __init__(self, problems: Union[str, Problem, Iterable[Problem]], path: Sequence[PathPart] = ()):
        if isinstance(problems, str):
            problems = [Problem(tuple(path), problems)]
        elif isinstance(problems, Problem):
            problems = [problems]
        self.problems: list[Problem] = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


class NodeFailure(RuntimeError):
    """Raised by a node whose failure its message tells whole, the fault being the user's agent, data or
    settings (a rollout that lost every episode): reported with that message and where the rank's log is,
    without the engine's traceback."""


class PipelineError(RuntimeError):
    """A run failed for good (a node after its retries, a weight sync, a resume); names what failed
    and where. Here, not in the runtime, so the CLI can catch it without loading torch."""
