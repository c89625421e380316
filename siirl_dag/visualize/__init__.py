"""Pictures of a pipeline: its DAG (`graph` view) and where its ranks run (`placement` view).

The format follows the output file's extension: .svg .png .pdf (Graphviz `dot`), .dot (Graphviz
source), .mmd (Mermaid, for Markdown), .html (one self-contained page with both views).
"""

from __future__ import annotations

from pathlib import Path

from siirl_dag.config import Pipeline
from siirl_dag.errors import ConfigError
from siirl_dag.visualize import html, mermaid
from siirl_dag.visualize.dot import graph_dot, run_dot
from siirl_dag.visualize.placement_view import placement_dot

FORMATS = ("svg", "png", "pdf", "dot", "mmd", "html")
VIEWS = ("graph", "placement")


def output_format(path: str | Path) -> str:
    """The format named by a file's extension; ConfigError listing the supported ones otherwise."""
    fmt = Path(path).suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        got = f"extension '.{fmt}'" if fmt else "no extension"
        raise ConfigError(f"output '{path}' has {got}; expected one of: {', '.join('.' + f for f in FORMATS)}",
                          ("--output",))
    return fmt


def render(pipe: Pipeline, fmt: str, view: str = "graph") -> bytes:
    """The picture as bytes. The placement view needs `pipe.plan`."""
    if fmt == "html":
        return html.page(pipe, view).encode()
    if fmt == "mmd":
        return (mermaid.graph_mermaid(pipe) if view == "graph" else mermaid.placement_mermaid(pipe)).encode()
    dot_text = graph_dot(pipe) if view == "graph" else placement_dot(pipe)
    return dot_text.encode() if fmt == "dot" else run_dot(dot_text, fmt)


def write(pipe: Pipeline, path: str | Path, view: str = "graph") -> Path:
    """Render into `path` (format from its extension), creating its folder; ConfigError if it cannot."""
    path = Path(path)
    data = render(pipe, output_format(path), view)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    except OSError as exc:
        culprit = f": {exc.filename}" if exc.filename and str(exc.filename) != str(path) else ""
        raise ConfigError(f"cannot write '{path}' ({exc.strerror or exc}{culprit}); expected a file path in a "
                          "writable folder", ("--output",)) from None
    return path


__all__ = ["FORMATS", "VIEWS", "output_format", "render", "write", "graph_dot", "placement_dot"]
