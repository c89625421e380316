"""The `timeline` view: a run's trace (`trainer.trace` / `--trace`) drawn without Perfetto.

Steps run across, ranks down (the driver's own track first); the grey between spans is time a rank
waited. Each step's critical path is outlined: from the span that ended the step, back through the
span that ended last before it began, and so on: the chain a faster step must shorten.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from html import escape
from pathlib import Path

from siirl_dag.errors import ConfigError
from siirl_dag.visualize.diagram import DATA_STYLE, FONT, IDLE_FILL, MUTED, WEIGHT_SYNC_COLOR

TRACE_FILE = "trace.json"
DRIVER = "driver"
CRITICAL = "#C2255C"
# driver spans by what they do; nodes take the palette in order of first appearance
_DRIVER_COLORS = {"sync": "#E5DBFF", "save checkpoint": "#FFE3E3", "validation": "#E3FAFC", "load data": DATA_STYLE.fill}
_PALETTE = ("#A5D8FF", "#B2F2BB", "#FFD8A8", "#D0BFFF", "#99E9F2", "#FCC2D7", "#FFEC99", "#C3FAE8", "#BAC8FF", "#EEBEFA")
_EPS = 0.005  # s: spans on one machine's clock that touch within this count as one after the other
_ROW_H, _LABEL_W, _RIGHT_W, _TOP, _WIDTH = 22, 150, 90, 44, 1400


@dataclass
class Span:
    row: int
    name: str
    start: float  # s since the first span
    end: float
    args: dict
    critical: bool = False

    @property
    def step(self) -> int | None:
        return self.args.get("step")

    @property
    def validating(self) -> bool:
        return bool(self.args.get("validating")) or self.name == "validation"


@dataclass
class Step:
    start: float
    end: float
    critical: list[Span]  # first span first


@dataclass
class Timeline:
    source: Path
    rows: list[str]
    spans: list[Span]
    steps: dict[int, Step] = field(default_factory=dict)

    @property
    def length(self) -> float:
        return max((s.end for s in self.spans), default=0.0)

    def busy(self, row: int) -> float:
        """Seconds the row was doing something (overlapping spans counted once)."""
        total, reach = 0.0, 0.0
        for s in sorted((s for s in self.spans if s.row == row), key=lambda s: s.start):
            total += max(s.end - max(s.start, reach), 0.0)
            reach = max(reach, s.end)
        return total


def find_trace(path: str | Path) -> Path:
    """A run's trace.json: the file itself, or the newest one under a run's folder."""
    path = Path(path)
    if path.is_file() and path.suffix == ".json":
        return path
    found = sorted(path.rglob(TRACE_FILE), key=lambda p: p.stat().st_mtime) if path.is_dir() else []
    if not found:
        what = "has no trace.json under it" if path.is_dir() else "is not a run folder or a trace .json file"
        raise ConfigError(f"'{path}' {what}; expected the output of a run started with --trace (trainer.trace=true)",
                          ("pipeline",))
    return found[-1]


def load(path: Path) -> Timeline:
    """Parse a Trace Event file into rows and spans; ConfigError naming the file if it is not one."""
    try:
        events = json.loads(path.read_text())["traceEvents"]
        tracks = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
        raw = [(tracks.get(e["pid"], str(e["pid"])), str(e["tid"]), e) for e in events if e.get("ph") == "X"]
        t0 = min((float(e["ts"]) for *_, e in raw), default=0.0)
        pids = {name: pid for pid, name in tracks.items()}
        ordered = sorted({(track, tid) for track, tid, _ in raw}, key=lambda r: (r[0] != DRIVER, _order(pids, r)))
        rows = {r: i for i, r in enumerate(ordered)}
        spans = [Span(rows[(track, tid)], e["name"], (float(e["ts"]) - t0) / 1e6,
                      (float(e["ts"]) + float(e["dur"]) - t0) / 1e6, dict(e.get("args") or {})) for track, tid, e in raw]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path}: not a readable trace ({type(exc).__name__}: {exc}); expected the Trace Event "
                          "JSON a run writes with --trace", ("pipeline",)) from None
    labels = [track if track == tid else f"{_track_label(track)} · {tid}" for track, tid in ordered]
    timeline = Timeline(path, labels, spans)
    for step in sorted({s.step for s in spans if s.step and not s.validating}):
        # the step's own work: its checkpoint and validation come after it (and are not in timing_s/step)
        members = [s for s in spans if s.step == step and not s.validating and s.name != "save checkpoint"]
        timeline.steps[step] = Step(min(s.start for s in members), max(s.end for s in members), critical_path(members))
    return timeline


def critical_path(spans: list[Span]) -> list[Span]:
    """From the span that ended last, back through the span that ended last before each began."""
    path, cur = [], max(spans, key=lambda s: s.end, default=None)
    while cur is not None:
        cur.critical = True
        path.append(cur)
        cur = max((s for s in spans if s.end <= cur.start + _EPS and s is not cur and not s.critical),
                  key=lambda s: s.end, default=None)
    return path[::-1]


def _order(pids: dict, row: tuple[str, str]) -> tuple:
    """A row's place: its track's as the trace made them, then its rank's number."""
    rank = row[1].removeprefix("rank ")
    return pids.get(row[0], 0), int(rank) if rank.isdigit() else 0, row[1]


def _track_label(track: str) -> str:
    return "cpu compute" if track == "__compute__" else track


def _color(name: str, order: dict) -> str:
    for key, color in _DRIVER_COLORS.items():
        if name.startswith(key):
            return color
    return order.setdefault(name, _PALETTE[len(order) % len(_PALETTE)])


def _tick(length: float) -> float:
    """A round tick interval giving about ten ticks."""
    for unit in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600):
        if length / unit <= 12:
            return unit
    return 7200.0


def svg(tl: Timeline) -> str:
    """The picture as one SVG document; hover a span for its step, duration and arguments."""
    plot_w = _WIDTH - _LABEL_W - _RIGHT_W
    scale = plot_w / max(tl.length, 1e-9)
    height = _TOP + len(tl.rows) * _ROW_H + 34
    x = lambda t: _LABEL_W + t * scale  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{height}" viewBox="0 0 {_WIDTH} {height}" '
           f'font-family="{FONT}" font-size="11">']
    for step, info in tl.steps.items():  # a bracket per step in two lanes: one_step_off's steps overlap
        a, b, y = x(info.start), x(info.end), 8 + (step % 2) * 14
        out.append(f'<g><title>step {step}: {info.end - info.start:.3f} s; '
                   f'critical path {escape(" → ".join(s.name for s in info.critical))}</title>'
                   f'<path d="M{a:.1f},{y + 8} V{y + 3} H{b:.1f} V{y + 8}" fill="none" stroke="{MUTED}"/>'
                   f'<text x="{a + 3:.1f}" y="{y}" fill="{MUTED}">step {step}</text>'
                   f'<line x1="{a:.1f}" y1="{_TOP - 4}" x2="{a:.1f}" y2="{_TOP + len(tl.rows) * _ROW_H}" '
                   f'stroke="#CED4DA" stroke-dasharray="3,3"/></g>')
    for i, label in enumerate(tl.rows):
        y, busy = _TOP + i * _ROW_H, tl.busy(i)
        share = busy / tl.length if tl.length else 0.0
        out.append(f'<text x="{_LABEL_W - 8}" y="{y + 15}" text-anchor="end">{escape(label)}</text>'
                   f'<rect x="{_LABEL_W}" y="{y + 2}" width="{plot_w}" height="{_ROW_H - 4}" fill="{IDLE_FILL}">'
                   f'<title>{escape(label)}: busy {busy:.2f} s, idle {tl.length - busy:.2f} s</title></rect>'
                   f'<text x="{_WIDTH - _RIGHT_W + 8}" y="{y + 15}" fill="{MUTED}">busy {share:.0%}</text>')
    order: dict = {}
    for s in sorted(tl.spans, key=lambda s: s.critical):  # critical outlines drawn last, on top
        y, w = _TOP + s.row * _ROW_H, max((s.end - s.start) * scale, 0.8)
        stroke = f'stroke="{CRITICAL}" stroke-width="2"' if s.critical else 'stroke="#868E96" stroke-width="0.5"'
        args = ", ".join(f"{k}={v}" for k, v in s.args.items() if k != "step")
        tip = f"{s.name}, step {s.step}: {(s.end - s.start) * 1e3:.1f} ms at {s.start:.3f} s" + (f" ({args})" if args else "")
        out.append(f'<g class="span"><title>{escape(tip)}</title><rect x="{x(s.start):.2f}" y="{y + 3}" width="{w:.2f}" '
                   f'height="{_ROW_H - 6}" fill="{_color(s.name, order)}" {stroke}'
                   f'{" fill-opacity=" + chr(34) + "0.5" + chr(34) if s.validating else ""}/>'
                   + (f'<text x="{x(s.start) + 3:.1f}" y="{y + 15}" font-size="10">{escape(_fit(s.name, w))}</text>'
                      if w > 30 else "") + "</g>")
    axis_y, unit = _TOP + len(tl.rows) * _ROW_H + 4, _tick(tl.length)
    out.append(f'<line x1="{_LABEL_W}" y1="{axis_y}" x2="{_LABEL_W + plot_w}" y2="{axis_y}" stroke="{MUTED}"/>')
    for k in range(int(tl.length / unit) + 1):
        out.append(f'<text x="{x(k * unit):.1f}" y="{axis_y + 16}" text-anchor="middle" fill="{MUTED}">{k * unit:g} s</text>')
    out.append("</svg>")
    return "\n".join(out)


def _fit(name: str, width: float) -> str:
    room = int(width / 6)
    return name if len(name) <= room else name[:max(room - 1, 1)] + "…"


def summary_rows(tl: Timeline) -> list[tuple[int, float, str]]:
    """(step, seconds from its first span to its last, its critical path as text) for every step."""
    return [(step, info.end - info.start, " → ".join(f"{s.name} {s.end - s.start:.2f} s" for s in info.critical))
            for step, info in tl.steps.items()]


def page_body(tl: Timeline) -> str:
    """The HTML sections: the picture, each step's length and critical path, each row's busy time."""
    steps = "".join(f"<tr><td>{step}</td><td>{took:.2f} s</td><td>{escape(chain)}</td></tr>"
                    for step, took, chain in summary_rows(tl))
    rows = "".join(f"<tr><td>{escape(label)}</td><td>{tl.busy(i):.2f} s</td><td>{tl.length - tl.busy(i):.2f} s</td></tr>"
                   for i, label in enumerate(tl.rows))
    legend = (f'<p class="note">Hover a span for its step, duration, weight version and bytes. Grey: waiting. '
              f'<span style="color:{CRITICAL}">Outlined</span>: the step\'s critical path. Faded: validation. '
              f'Weight sync <span class="chip" style="background:{_DRIVER_COLORS["sync"]};border-color:'
              f'{WEIGHT_SYNC_COLOR}"></span></p>')
    return (f'<section id="timeline"><h2>Timeline</h2>{legend}<div class="figure">{svg(tl)}</div></section>'
            f'<section id="steps"><h2>Steps</h2><table class="nodes"><thead><tr><th>step</th><th>length</th>'
            f'<th>critical path</th></tr></thead><tbody>{steps}</tbody></table></section>'
            f'<section id="ranks"><h2>Ranks</h2><table class="nodes"><thead><tr><th>track</th><th>busy</th>'
            f'<th>idle</th></tr></thead><tbody>{rows}</tbody></table></section>')
