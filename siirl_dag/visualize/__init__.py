"""Pictures of a pipeline: its DAG (`graph` view) and where its ranks run (`placement` view); and of a
run: its `timeline` (from the trace a run writes with --trace).

The format follows the output file's extension: .svg .png .pdf (Graphviz `dot`), .dot (Graphviz
source), .mmd (Mermaid, for Markdown), .html (one self-contained page with both views); a timeline
is .svg or .html.
"""

from __future__ import annotations

from pathlib import Path

from siirl_dag.config import Pipeline
from siirl_dag.errors import ConfigError
from siirl_dag.visualize import html, mermaid, timeline
from siirl_dag.visualize.dot import graph_dot, run_dot
from siirl_dag.visualize.placement_view import placement_dot

FORMATS = ("svg", "png", "pdf", "dot", "mmd", "html")
TIMELINE_FORMATS = ("svg", "html")
VIEWS = ("graph", "placement", "timeline")


def output_format(path: str | Path, formats: tuple[str, ...] = FORMATS) -> str:
    """The format named by a file's extension; ConfigError listing the supported ones otherwise."""
    fmt = Path(path).suffix.lower().lstrip(".")
    if fmt not in formats:
        got = f"extension '.{fmt}'" if fmt else "no extension"
        raise ConfigError(f"output '{path}' has {got}; expected one of: {', '.join('.' + f for f in formats)}",
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
    return _write_bytes(Path(path), render(pipe, output_format(path), view))


def write_timeline(run: str | Path, path: str | Path) -> tuple[Path, timeline.Timeline]:
    """Draw the trace of the run in folder (or trace file) `run` into `path`, .svg or .html."""
    fmt = output_format(path, TIMELINE_FORMATS)
    tl = timeline.load(timeline.find_trace(run))
    if fmt == "svg":
        data = '<?xml version="1.0" encoding="UTF-8"?>\n' + timeline.svg(tl)
    else:
        data = html.document("timeline", str(tl.source), timeline.page_body(tl), "visualize --view timeline")
    return _write_bytes(Path(path), data.encode()), tl


def _write_bytes(path: Path, data: bytes) -> Path:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    except OSError as exc:
        culprit = f": {exc.filename}" if exc.filename and str(exc.filename) != str(path) else ""
        raise ConfigError(f"cannot write '{path}' ({exc.strerror or exc}{culprit}); expected a file path in a "
                          "writable folder", ("--output",)) from None
    return path


__all__ = ["FORMATS", "VIEWS", "output_format", "render", "write", "write_timeline", "graph_dot", "placement_dot"]
