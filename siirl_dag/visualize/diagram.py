"""What every picture shows, computed once from a `Pipeline`: edge keys, mesh nesting, colours.

The DOT, Mermaid and HTML writers only spell these facts in their own syntax, so the three
formats cannot disagree about what flows where or which device a rank sits on.
"""

from __future__ import annotations

from dataclasses import dataclass

from siirl_dag.config import Pipeline
from siirl_dag.dataflow import SOURCE_KEYS, producer, read_via_from
from siirl_dag.graph import phases_of
from siirl_dag.placement import Component, parse_allocation


@dataclass(frozen=True)
class Style:
    fill: str
    border: str
    legend: str


# Node colours by where a node runs; model nodes by strategy, compute nodes on the driver's CPU.
STRATEGY_STYLES = {
    "vllm": Style("#E7F5FF", "#1C7ED6", "vLLM (generation)"),
    "megatron": Style("#EBFBEE", "#2F9E44", "Megatron-core (training, log-probs)"),
    None: Style("#FFF4E6", "#E8590C", "CPU compute (driver side)"),
}
DATA_STYLE = Style("#F1F3F5", "#868E96", "data loader")
WEIGHT_SYNC_COLOR = "#AE3EC9"
RESAMPLE_COLOR = "#E03131"
EDGE_COLOR = "#495057"
MUTED = "#6A737D"
IDLE_FILL = "#F8F9FA"
CLUSTER_FILL = ("#FAFBFC", "#F1F3F5")  # a mesh, a mesh colocated inside it
CLUSTER_BORDER = "#ADB5BD"
FONT = "Helvetica,Arial,sans-serif"
DATA_NODE = "(data)"  # id of the source box: parentheses keep it apart from every node id

# Placement cells: one colour per mesh, shades of its strategy's hue family first.
_MESH_PALETTES = {
    "vllm": ("#A5D8FF", "#99E9F2", "#BAC8FF", "#74C0FC"),
    "megatron": ("#B2F2BB", "#D0BFFF", "#FFD8A8", "#96F2D7", "#FCC2D7", "#FFEC99"),
}
_OTHER_PALETTE = ("#DEE2E6", "#E9ECEF")

# Rank coordinates in reading order; etp/edp are shown only where they differ from tp/dp (MoE folding).
COORD_ORDER = ("dp", "pp", "tp", "cp", "ep", "etp", "edp")
_SHADOWS = {"etp": "tp", "edp": "dp"}


def node_style(pipe: Pipeline, node_id: str) -> Style:
    return STRATEGY_STYLES.get(pipe.nodes[node_id].strategy, STRATEGY_STYLES[None])


def strategies_used(pipe: Pipeline) -> list[Style]:
    used = {n.strategy for n in pipe.nodes.values()}
    return [style for key, style in STRATEGY_STYLES.items() if key in used]


def edge_keys(pipe: Pipeline, src: str, dst: str) -> list[str]:
    """Keys that flow along src -> dst (what dst reads from src, dataflow.producer); a key bound in
    dst's `inputs` shows its binding: `key ← src.key`; the keys of a `from: src` come first, after 'from:'."""
    via = read_via_from(pipe, dst).get(src, [])
    keys = [f"from: {key}" if i == 0 else key for i, key in enumerate(via)]
    for key in pipe.consumes(dst):
        node, there = producer(pipe, dst, key)
        if node == src and key not in via:
            keys.append(f"{key} ← {src}.{there}" if key in pipe.nodes[dst].inputs else key)
    return keys


def data_edges(pipe: Pipeline) -> list[tuple[str, list[str]]]:
    """(node, loader keys it reads) for the source nodes: the "data" box feeds them."""
    return [(n, [k for k in pipe.consumes(n) if k in SOURCE_KEYS])
            for n in pipe.nodes if pipe.graph.in_degree(n) == 0]


def weight_syncs(pipe: Pipeline) -> list[tuple[str, str]]:
    """(trainer, receiver) pairs: weights flow back after each update, outside the DAG's order."""
    return [(n.weights_from, n.id) for n in pipe.nodes.values() if n.weights_from]


def dynamic_sampling_edge(pipe: Pipeline) -> tuple[str, str] | None:
    """(the filtering node, its label) where dynamic sampling loops back to the data for more prompts."""
    phases = phases_of(pipe)
    if phases is None:
        return None
    return phases.filter, f"more prompts until {pipe.data.train_batch_size} kept (≤ {phases.max_rounds} rounds)"


def mesh_children(pipe: Pipeline) -> dict[str | None, list[str]]:
    """Mesh nesting: a colocated mesh sits inside the mesh it shares devices with; None holds the roots."""
    children: dict[str | None, list[str]] = {}
    for m in pipe.meshes.values():
        children.setdefault(m.colocate_with, []).append(m.name)
    return children


def mesh_nodes(pipe: Pipeline, mesh: str) -> list[str]:
    return [n.id for n in pipe.nodes.values() if n.mesh == mesh]


def mesh_component(pipe: Pipeline, mesh: str) -> Component:
    """The placed component, or (placement failed) the parsed allocation string."""
    if pipe.plan and mesh in pipe.plan.meshes:
        return pipe.plan.meshes[mesh].component
    return parse_allocation(pipe.meshes[mesh].alloc, ("meshes", mesh))[0]


def device_ranges(devices: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    spans: list[list[int]] = []
    for d in sorted(set(devices)):
        if spans and d == spans[-1][1] + 1:
            spans[-1][1] = d
        else:
            spans.append([d, d])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def mesh_caption(pipe: Pipeline, mesh: str) -> str:
    """'megatron:d1t2p4 · 8 devices (0-7) · colocated with actor' (devices only once placed)."""
    spec, size = pipe.meshes[mesh], mesh_component(pipe, mesh).dims.world_size
    placed = pipe.plan is not None and mesh in pipe.plan.meshes
    where = device_ranges(pipe.plan.meshes[mesh].devices) if placed else ""
    devices = f"device {where}" if placed and size == 1 else plural(size, "device") + (f" ({where})" if placed else "")
    parts = [spec.alloc, devices]
    if spec.colocate_with:
        parts.append(f"colocated with {spec.colocate_with}")
    return " · ".join(parts)


def mesh_colors(pipe: Pipeline) -> dict[str, str]:
    used: dict[str, int] = {}
    colors = {}
    for name in pipe.meshes:
        backend = mesh_component(pipe, name).backend
        palette = _MESH_PALETTES.get(backend, _OTHER_PALETTE)
        colors[name] = palette[used.get(backend, 0) % len(palette)]
        used[backend] = used.get(backend, 0) + 1
    return colors


def shown_coords(pipe: Pipeline, mesh: str) -> list[str]:
    """Coordinates worth printing in a cell: dimensions of size > 1 (etp/edp only when folded)."""
    sizes = pipe.plan.meshes[mesh].dims.to_json()
    return [k for k in COORD_ORDER
            if sizes.get(k, 1) > 1 and not (k in _SHADOWS and sizes[k] == sizes[_SHADOWS[k]])]


@dataclass(frozen=True)
class Seat:
    """One rank of one mesh on one device."""

    mesh: str
    rank: int
    short: str  # e.g. 'dp1 tp0', the coordinates that vary in this mesh
    long: str  # every coordinate, for hover text
    nodes: tuple[str, ...]


def device_seats(pipe: Pipeline) -> dict[int, list[Seat]]:
    """Global device index -> the ranks on it (several where meshes are colocated)."""
    seats: dict[int, list[Seat]] = {}
    for name, mp in pipe.plan.meshes.items():
        shown, nodes = shown_coords(pipe, name), tuple(mesh_nodes(pipe, name))
        for r in mp.ranks:
            short = " ".join(f"{k}{r.coords[k]}" for k in shown if k in r.coords)
            long = " ".join(f"{k}={r.coords[k]}" for k in COORD_ORDER if k in r.coords)
            seats.setdefault(r.device, []).append(Seat(name, r.rank, short, long, nodes))
    return seats


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def cluster_caption(pipe: Pipeline) -> str:
    c = pipe.cluster
    return f"{plural(c.nodes, 'machine')} × {plural(c.devices_per_node, c.device + ' device')}"
