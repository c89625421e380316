"""What placement produces: every mesh's devices and, per rank, its machine, device and coordinates.

The runtime starts one worker per rank from this; `siirl_dag plan` prints `Plan.table()`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from siirl_dag.errors import Problem
from siirl_dag.placement.allocation import Component, component_to_json
from siirl_dag.placement.parallel_dims import ParallelDims


@dataclass(frozen=True)
class ClusterSpec:
    """Identical machines; global device index = machine * devices_per_node + local index."""

    nodes: int
    devices_per_node: int
    device: str = "cuda"  # "cuda" or "cpu"
    device_memory_gb: float | None = None  # None: the device kind's (memory_gb)

    @property
    def total(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def memory_gb(self) -> float:
        """GiB one device holds: as written; else an H100's 80, or on CPU this machine's memory shared
        among its rank slots (they all live in it)."""
        if self.device_memory_gb:
            return self.device_memory_gb
        if self.device == "cuda":
            return 80.0
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 / self.devices_per_node

    def describe(self) -> str:
        return f"{self.nodes} machine(s) x {self.devices_per_node} {self.device} device(s) = {self.total}"


@dataclass(frozen=True)
class RankSlot:
    rank: int
    device: int  # global index
    machine: int
    local_device: int
    coords: dict[str, int]  # megatron grids (tp, cp, dp, pp, etp, ep, edp) or vLLM (dp, tp, pp)


@dataclass
class MeshPlan:
    name: str
    component: Component
    devices: list[int]  # devices[rank]
    ranks: list[RankSlot]
    colocated_with: str | None = None  # the anchor mesh whose devices this one shares

    @property
    def anchor(self) -> str:
        """The mesh whose processes host this one's ranks: its anchor, or itself."""
        return self.colocated_with or self.name

    @property
    def backend(self) -> str:
        return self.component.backend

    @property
    def dims(self) -> ParallelDims:
        return self.component.dims

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "backend": self.backend,
            "sizes": component_to_json(self.component),
            "colocated_with": self.colocated_with,
            "devices": list(self.devices),
            "ranks": [
                {"rank": r.rank, "machine": r.machine, "local_device": r.local_device, "device": r.device,
                 "coords": dict(r.coords)}
                for r in self.ranks
            ],
        }


@dataclass
class Plan:
    cluster: ClusterSpec
    meshes: dict[str, MeshPlan]
    warnings: list[Problem] = field(default_factory=list)

    @property
    def devices_used(self) -> int:
        return len({d for m in self.meshes.values() for d in m.devices})

    def to_json(self) -> dict:
        return {
            "cluster": {"nodes": self.cluster.nodes, "devices_per_node": self.cluster.devices_per_node,
                        "device": self.cluster.device},
            "devices_used": self.devices_used,
            "meshes": [m.to_json() for m in self.meshes.values()],
            "warnings": [w.to_json() for w in self.warnings],
        }

    def table(self) -> str:
        """Machines as rows, local devices as columns; a cell lists `mesh:rank` of everyone there."""
        c = self.cluster
        cells: dict[int, list[str]] = {}
        for m in self.meshes.values():
            for r in m.ranks:
                cells.setdefault(r.device, []).append(f"{m.name}:{r.rank}")
        texts = [" ".join(cells.get(d, ["."])) for d in range(c.total)]
        width = max([len(t) for t in texts] + [len(str(c.devices_per_node - 1))])
        head_w = max(len("machine"), len(str(c.nodes - 1)))
        lines = [f"cluster: {c.describe()}, {self.devices_used} used"]
        for m in self.meshes.values():
            shared = f", on the devices of {m.colocated_with}" if m.colocated_with else ""
            lines.append(f"  {m.name}: {m.backend} {m.dims.describe()}, {m.dims.world_size} device(s){shared}")
        lines.append("")
        header = " ".join(str(i).ljust(width) for i in range(c.devices_per_node))
        lines.append(("machine".rjust(head_w) + " | " + header).rstrip())
        lines.append("-" * (head_w + 1) + "+" + "-" * ((width + 1) * c.devices_per_node))
        for node in range(c.nodes):
            row = texts[node * c.devices_per_node:(node + 1) * c.devices_per_node]
            lines.append(str(node).rjust(head_w) + " | " + " ".join(t.ljust(width) for t in row).rstrip())
        for w in self.warnings:
            lines.append(str(w))
        return "\n".join(lines)
