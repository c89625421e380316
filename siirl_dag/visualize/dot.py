"""The graph view as Graphviz DOT, and the one place that runs Graphviz's `dot` binary.

DOT is written by hand (it is small) with HTML-like labels, so the picture needs nothing but
`dot`: boxes coloured by strategy, meshes as clusters (a colocated mesh nested inside the mesh
whose devices it shares), edges labelled with the batch keys that flow, the weight sync dashed.
"""

from __future__ import annotations

import shutil
import subprocess
import textwrap
from html import escape

from siirl_dag.config import Pipeline, schedule
from siirl_dag.errors import ConfigError
from siirl_dag.visualize.diagram import (CLUSTER_BORDER, CLUSTER_FILL, DATA_NODE, DATA_STYLE, EDGE_COLOR, FONT, MUTED,
                                         RESAMPLE_COLOR, WEIGHT_SYNC_COLOR, cluster_caption, data_edges,
                                         dynamic_sampling_edge, edge_keys, mesh_caption, mesh_children, mesh_nodes,
                                         node_style, strategies_used, weight_syncs)

# Raster output at print resolution; vector formats ignore it.
_PNG_DPI = 192
_ALERT = "#C92A2A"


def quote(text: str) -> str:
    """A DOT double-quoted string."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def font(text: str, size: int | None = None, color: str | None = None, bold: bool = False) -> str:
    """HTML-like label text, escaped."""
    out = f"<B>{escape(text)}</B>" if bold else escape(text)
    attrs = (f' POINT-SIZE="{size}"' if size else "") + (f' COLOR="{color}"' if color else "")
    return f"<FONT{attrs}>{out}</FONT>" if attrs else out


def chip(fill: str, border: str) -> str:
    """A small colour swatch for legends."""
    return f'<TD BGCOLOR="{fill}" COLOR="{border}" BORDER="1" WIDTH="16" HEIGHT="10" FIXEDSIZE="TRUE"></TD>'


def header(pipe: Pipeline, legend: list[str]) -> str:
    """Graph label: the pipeline's name and cluster, then a one-row legend of (swatch, text) cells."""
    cells = "<TD WIDTH=\"10\"></TD>".join(legend)
    title = font(pipe.name, 15, bold=True) + "  " + font(cluster_caption(pipe), 11, MUTED)
    if pipe.meshes and pipe.plan is None:
        title += font("  · placement failed: no devices shown", 11, _ALERT)
    return (f'<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="0" CELLPADDING="2">'
            f'<TR><TD ALIGN="LEFT">{title}</TD></TR>'
            f'<TR><TD ALIGN="LEFT"><TABLE BORDER="0" CELLBORDER="0" CELLSPACING="3" CELLPADDING="0">'
            f'<TR>{cells}</TR></TABLE></TD></TR></TABLE>')


def _legend(pipe: Pipeline) -> list[str]:
    items = [chip(s.fill, s.border) + f'<TD ALIGN="LEFT">{font(s.legend, 10)}</TD>' for s in strategies_used(pipe)]
    if weight_syncs(pipe):
        items.append(f'<TD>{font("- - ▸", 10, WEIGHT_SYNC_COLOR, bold=True)}</TD>'
                     f'<TD ALIGN="LEFT">{font("weight sync (not a dependency)", 10)}</TD>')
    if dynamic_sampling_edge(pipe):
        items.append(f'<TD>{font("- - ▸", 10, RESAMPLE_COLOR, bold=True)}</TD>'
                     f'<TD ALIGN="LEFT">{font("dynamic sampling (re-runs its upstream)", 10)}</TD>')
    items.append(f'<TD>{font("—▸", 10, EDGE_COLOR, bold=True)}</TD>'
                 f'<TD ALIGN="LEFT">{font("batch keys that flow", 10)}</TD>')
    return items


def _box(pipe: Pipeline, node_id: str) -> str:
    n, style = pipe.nodes[node_id], node_style(pipe, node_id)
    rows = [font(node_id, 12, bold=True), font(f"{n.kind} · {n.strategy or 'cpu'}", 9, MUTED)]
    if n.mesh:
        rows.append(font(pipe.meshes[n.mesh].alloc, 8, MUTED))
    label = "".join(f"<TR><TD>{r}</TD></TR>" for r in rows)
    tip = (f"{node_id} ({n.kind})\nconsumes: {', '.join(pipe.consumes(node_id)) or '-'}\n"
           f"produces: {', '.join(pipe.produces(node_id)) or '-'}")
    return (f'{quote(node_id)} [label=<<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="0" CELLPADDING="1">{label}'
            f'</TABLE>>, fillcolor="{style.fill}", color="{style.border}", tooltip={quote(tip)}];')


def _keys_label(keys: list[str]) -> str:
    return "\n".join(textwrap.wrap(", ".join(keys), 28))


def _cluster(pipe: Pipeline, mesh: str, children: dict, depth: int) -> list[str]:
    pad = "  " * (depth + 1)
    caption = font(f"mesh {mesh}", 10, bold=True) + "  " + font(mesh_caption(pipe, mesh), 9, MUTED)
    lines = [f"{pad}subgraph {quote('cluster_' + mesh)} {{",
             f'{pad}  label=<{caption}>; tooltip={quote("mesh " + mesh + ": " + mesh_caption(pipe, mesh))};',
             f'{pad}  style="rounded,filled{",dashed" if depth else ""}"; fillcolor="{CLUSTER_FILL[min(depth, 1)]}"; '
             f'color="{CLUSTER_BORDER}"; penwidth=1; margin=10;']
    lines += [f"{pad}  {_box(pipe, n)}" for n in mesh_nodes(pipe, mesh)]
    for child in children.get(mesh, []):
        lines += _cluster(pipe, child, children, depth + 1)
    return lines + [f"{pad}}}"]


def _data_box(pipe: Pipeline) -> str:
    files = ", ".join(f.rsplit("/", 1)[-1] for f in pipe.data.train_files) or "train files"
    rows = [font("data", 12, bold=True), font(files, 9, MUTED),
            font(f"{pipe.data.train_batch_size} prompts / step", 9, MUTED)]
    label = "".join(f"<TR><TD>{r}</TD></TR>" for r in rows)
    return (f'{quote(DATA_NODE)} [shape=cylinder, style=filled, label=<<TABLE BORDER="0" CELLBORDER="0" '
            f'CELLSPACING="0" CELLPADDING="1">{label}</TABLE>>, fillcolor="{DATA_STYLE.fill}", '
            f'color="{DATA_STYLE.border}", '
            f'tooltip={quote("the data loader: " + ", ".join(pipe.data.train_files))}];')


def graph_dot(pipe: Pipeline) -> str:
    """The pipeline's DAG as DOT text."""
    lines = [f"digraph {quote(pipe.name)} {{",
             f'  graph [rankdir=LR, newrank=true, fontname="{FONT}", nodesep=0.3, ranksep=0.5, pad=0.3, '
             f'labelloc=t, labeljust=l, label=<{header(pipe, _legend(pipe))}>];',
             f'  node [shape=box, style="rounded,filled", fontname="{FONT}", penwidth=1.4, margin="0.12,0.05"];',
             f'  edge [fontname="{FONT}", fontsize=9, color="{EDGE_COLOR}", fontcolor="{EDGE_COLOR}", arrowsize=0.7];',
             f"  {_data_box(pipe)}"]
    children = mesh_children(pipe)
    for root in children.get(None, []):
        lines += _cluster(pipe, root, children, 0)
    lines += [f"  {_box(pipe, n.id)}" for n in pipe.nodes.values() if not n.mesh]
    for node_id, keys in data_edges(pipe):
        lines.append(f"  {quote(DATA_NODE)} -> {quote(node_id)} [label={quote(_keys_label(keys))}, "
                     f'color="{DATA_STYLE.border}"];')
    for src, dst in pipe.graph.edges:
        keys = edge_keys(pipe, src, dst)
        tip = f"{src} -> {dst}: " + (", ".join(keys) or "ordering only")
        lines.append(f"  {quote(src)} -> {quote(dst)} [label={quote(_keys_label(keys))}, tooltip={quote(tip)}];")
    for src, dst in weight_syncs(pipe):
        lines.append(f"  {quote(src)} -> {quote(dst)} [label={quote(schedule.edge_label(pipe.runtime))}, style=dashed, "
                     "constraint=false, "
                     f'color="{WEIGHT_SYNC_COLOR}", fontcolor="{WEIGHT_SYNC_COLOR}", penwidth=1.6, '
                     f'tooltip={quote(f"{src} pushes its updated weights to {dst} after every step")}];')
    if resampled := dynamic_sampling_edge(pipe):
        lines.append(f"  {quote(resampled[0])} -> {quote(DATA_NODE)} [label={quote(_keys_label([resampled[1]]))}, "
                     f'style=dashed, constraint=false, color="{RESAMPLE_COLOR}", fontcolor="{RESAMPLE_COLOR}", '
                     f'penwidth=1.6, tooltip={quote(resampled[0] + " drops rows; its upstream runs again on more prompts")}];')
    return "\n".join(lines + ["}"]) + "\n"


def run_dot(text: str, fmt: str) -> bytes:
    """Render DOT text with Graphviz. A missing `dot` is bad input of the environment: ConfigError."""
    exe = shutil.which("dot")
    if exe is None:
        raise ConfigError(f"writing .{fmt} needs Graphviz's `dot`, which is not installed; install it with "
                          "`apt-get install graphviz` (Debian/Ubuntu) or `brew install graphviz` (macOS), "
                          "or write .dot or .mmd instead", ("--output",))
    extra = [f"-Gdpi={_PNG_DPI}"] if fmt == "png" else []
    proc = subprocess.run([exe, f"-T{fmt}", *extra], input=text.encode(), capture_output=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"Graphviz rejected the generated DOT: {proc.stderr.decode(errors='replace').strip()}")
    return proc.stdout

