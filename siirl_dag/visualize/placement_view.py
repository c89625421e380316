"""The placement view: machines x devices, each device listing the ranks on it.

Written twice from the same seats: as DOT (one HTML-like table, for .svg/.png/.pdf/.dot, with rank
coordinates as cell text) and as an HTML table for the page (the same text, full coordinates on
hover). Colocated meshes show as several coloured rows in one device cell.
"""

from __future__ import annotations

from html import escape

from siirl_dag.config import Pipeline
from siirl_dag.errors import ConfigError
from siirl_dag.visualize.diagram import (FONT, IDLE_FILL, MUTED, Seat, cluster_caption, device_seats, mesh_caption,
                                         mesh_colors, mesh_nodes)
from siirl_dag.visualize.dot import chip, font, header, quote

_CELL_BORDER = "#CED4DA"
_IDLE_SEAT = '<div class="seat idle">idle</div>'


def require_plan(pipe: Pipeline) -> None:
    if pipe.plan is None:
        raise ConfigError("the placement view needs a placed pipeline; placement failed or the pipeline has no meshes "
                          "(run `validate` to see why)", ("meshes",))


def seat_tooltip(pipe: Pipeline, seat: Seat, device: int) -> str:
    c = pipe.cluster
    machine, local = divmod(device, c.devices_per_node)
    return (f"{seat.mesh} rank {seat.rank} on device {device} (machine {machine}, local {local}); "
            f"{seat.long}; runs {', '.join(seat.nodes) or 'no node'}")


def legend_rows(pipe: Pipeline) -> list[tuple[str, str, str, str]]:
    """(mesh, colour, caption, nodes) per mesh, for both legends."""
    colors = mesh_colors(pipe)
    return [(m, colors[m], mesh_caption(pipe, m), ", ".join(mesh_nodes(pipe, m)) or "no node") for m in pipe.meshes]


def _cell_width(seats: dict[int, list[Seat]]) -> int:
    """One width for every cell (points), so coloured rows line up: Graphviz cannot stretch them."""
    longest = max((max(len(f"{s.mesh}:{s.rank}"), len(s.short) * 0.8) for ss in seats.values() for s in ss), default=4)
    return max(80, int(longest * 6.5) + 14)


def _seat_row(text: str, fill: str, width: int) -> str:
    return f'<TR><TD BGCOLOR="{fill}" ALIGN="LEFT" BALIGN="LEFT" WIDTH="{width}">{text}</TD></TR>'


def _dot_cell(device: int, seats: list[Seat], colors: dict, width: int, slots: int) -> str:
    """A device: its index, then one two-line row per rank; padded to `slots` rows so a machine's cells align."""
    rows = [f'<TR><TD ALIGN="LEFT">{font(f"device {device}", 8, MUTED)}</TD></TR>']
    rows += [_seat_row(font(f"{s.mesh}:{s.rank}", 10, bold=True) + f"<BR/>{font(s.short or ' ', 8)}",
                       colors[s.mesh], width) for s in seats]
    if not seats:
        rows.append(_seat_row(font("idle", 10, MUTED) + f"<BR/>{font(' ', 8)}", IDLE_FILL, width))
    rows += [_seat_row(f"{font(' ', 10)}<BR/>{font(' ', 8)}", "white", width)] * (slots - max(len(seats), 1))
    return (f'<TD VALIGN="TOP" BORDER="1" COLOR="{_CELL_BORDER}" BGCOLOR="white"><TABLE BORDER="0" CELLBORDER="0" '
            f'CELLSPACING="2" CELLPADDING="3">{"".join(rows)}</TABLE></TD>')


def placement_dot(pipe: Pipeline) -> str:
    """Machines as rows, local devices as columns, one HTML-like table."""
    require_plan(pipe)
    c, seats, colors = pipe.cluster, device_seats(pipe), mesh_colors(pipe)
    width = _cell_width(seats)
    head = "<TD></TD>" + "".join(f"<TD>{font(f'local {i}', 9, MUTED)}</TD>" for i in range(c.devices_per_node))
    rows = [f"<TR>{head}</TR>"]
    for m in range(c.nodes):
        devices = range(m * c.devices_per_node, (m + 1) * c.devices_per_node)
        slots = max(len(seats.get(d, [])) for d in devices) or 1
        cells = "".join(_dot_cell(d, seats.get(d, []), colors, width, slots) for d in devices)
        rows.append(f'<TR><TD ALIGN="RIGHT" VALIGN="MIDDLE">{font(f"machine {m}", 10, bold=True)}</TD>{cells}</TR>')
    grid = f'<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="4" CELLPADDING="0">{"".join(rows)}</TABLE>'
    legend = [chip(color, _CELL_BORDER) + f'<TD ALIGN="LEFT">{font(mesh, 10, bold=True)} '
              f'{font(f"{caption} · {nodes}", 9, MUTED)}</TD>' for mesh, color, caption, nodes in legend_rows(pipe)]
    return (f"digraph {quote(pipe.name + ' placement')} {{\n"
            f'  graph [fontname="{FONT}", pad=0.3, labelloc=t, labeljust=l, label=<{header(pipe, legend)}>];\n'
            f'  node [fontname="{FONT}", shape=plain];\n'
            f"  grid [label=<{grid}>, tooltip={quote(cluster_caption(pipe))}];\n}}\n")


def placement_table(pipe: Pipeline) -> str:
    """The same grid as an HTML table; every rank's full coordinates in its title (hover)."""
    require_plan(pipe)
    c, seats, colors = pipe.cluster, device_seats(pipe), mesh_colors(pipe)
    head = "<th></th>" + "".join(f"<th>local {i}</th>" for i in range(c.devices_per_node))
    body = []
    for m in range(c.nodes):
        cells = []
        for d in range(m * c.devices_per_node, (m + 1) * c.devices_per_node):
            inner = "".join(
                f'<div class="seat" style="background:{colors[s.mesh]}" title="{escape(seat_tooltip(pipe, s, d))}">'
                f'<b>{escape(s.mesh)}:{s.rank}</b><span>{escape(s.short)}</span></div>' for s in seats.get(d, []))
            cells.append(f'<td><div class="dev">device {d}</div>{inner or _IDLE_SEAT}</td>')
        body.append(f"<tr><th>machine {m}</th>{''.join(cells)}</tr>")
    legend = "".join(f'<li><span class="chip" style="background:{color}"></span><b>{escape(mesh)}</b> '
                     f'{escape(caption)} · runs {escape(nodes)}</li>'
                     for mesh, color, caption, nodes in legend_rows(pipe))
    return (f'<table class="placement"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'
            f'<ul class="legend">{legend}</ul>')
