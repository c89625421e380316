"""Meshes -> devices of a cluster, checked before anything starts.

- A mesh with an explicit device list (ROLL's device_mapping) gets exactly those: rank r on
  devices[r]. They must exist, be distinct, be as many as the mesh's world size, and not
  overlap another mesh unless it is colocated with it.
- Other meshes take free devices first fit, in request order, a tensor-parallel block at a time
  (lcm of t and expert t consecutive ranks), each block inside one machine: TP all-reduces on every
  layer and must stay on the fast intra-machine links. A TP group across machines is an error,
  or a warning with allow_tp_across_machines.
- A colocated mesh (colocate_with) shares its anchor's devices, rank r on the anchor's rank r
  device; world sizes must be equal.
Every problem is collected and raised together in one ConfigError; warnings go to plan.warnings.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

from siirl_dag.errors import ConfigError, PathPart, Problem
from siirl_dag.placement.allocation import Component
from siirl_dag.placement.plan import ClusterSpec, MeshPlan, Plan, RankSlot
from siirl_dag.placement.ranks import inference_coords, rank_coords, rank_groups
from siirl_dag.placement.rules import strategy_problems

INFERENCE_BACKENDS = ("vllm", "sglang")


@dataclass
class MeshRequest:
    """One device mesh of the pipeline, as the config layer read it."""

    name: str
    components: list[Component]  # exactly one (a folded MoE layout is one Component)
    devices: list[int] | None = None  # explicit global device indices, devices[rank]
    colocate_with: str | None = None  # another mesh's name: share its devices
    options: dict[str, Any] = field(default_factory=dict)  # strategy options of the nodes bound to it
    model_info: dict[str, Any] | None = None  # num_layers, num_heads, num_kv_heads, num_experts when known
    allow_tp_across_machines: bool = False
    path: tuple[PathPart, ...] = ()  # where the mesh is written, e.g. ("meshes", "train")
    options_path: tuple[PathPart, ...] | None = None  # where the options are written (default: path)

    @property
    def component(self) -> Component:
        return self.components[0]


def place(cluster: ClusterSpec, requests: Sequence[MeshRequest]) -> Plan:
    """Assign devices to every mesh; raise ConfigError listing all problems."""
    problems: list[Problem] = []
    warnings: list[Problem] = []
    if cluster.nodes < 1 or cluster.devices_per_node < 1 or cluster.device not in ("cuda", "cpu"):
        raise ConfigError(f"bad cluster {cluster}: nodes and devices_per_node must be >= 1, device cuda or cpu")

    # the mesh set itself; if it is inconsistent, no device assignment is attempted
    by_name: dict[str, MeshRequest] = {}
    for req in requests:
        if req.name in by_name:
            problems.append(Problem(req.path, f"mesh name {req.name!r} is used twice"))
        elif len(req.components) != 1:
            problems.append(Problem(req.path, (
                f"mesh {req.name!r} needs exactly one component, got {len(req.components)}; "
                "give each model its own mesh and share devices with colocate_with")))
        else:
            by_name[req.name] = req
    valid = list(by_name.values())
    anchors = _resolve_anchors(valid, by_name, problems)
    own = [r for r in valid if anchors[r.name] == r.name]
    need = sum(r.component.dims.world_size for r in own)
    if need > cluster.total:
        detail = ", ".join(f"{r.name}: {r.component.dims.world_size}" for r in own)
        problems.append(Problem((), f"the pipeline needs {need} devices ({detail}; colocated meshes "
                                    f"share), the cluster has {cluster.total} ({cluster.describe()})"))
    devices = {} if problems else _assign(cluster, valid, anchors, problems, warnings)
    for req in valid:
        opts_path = req.path + ("options",) if req.options_path is None else req.options_path
        problems += strategy_problems(req.component, req.options, req.model_info, cluster.device,
                                      req.path, opts_path)
    if problems:
        raise ConfigError(problems)
    meshes = {}
    for req in requests:
        anchor = anchors[req.name]
        meshes[req.name] = _mesh_plan(cluster, req, devices[req.name], None if anchor == req.name else anchor)
    return Plan(cluster=cluster, meshes=meshes, warnings=warnings)


def _resolve_anchors(requests, by_name, problems) -> dict[str, str]:
    """Mesh name -> the mesh owning its devices (itself, or the end of its colocate_with chain)."""
    anchors: dict[str, str] = {}
    for req in requests:
        seen, cur = [req.name], req
        while cur.colocate_with is not None:
            target = by_name.get(cur.colocate_with)
            if target is None:
                if cur is req:  # a broken link further down the chain is reported by its owner
                    problems.append(Problem(cur.path + ("colocate_with",), (
                        f"{cur.colocate_with!r} is not a mesh (meshes: {', '.join(by_name)})")))
                break
            if target.name in seen:
                if target is req:
                    problems.append(Problem(req.path + ("colocate_with",),
                                            f"colocate_with forms a cycle: {' -> '.join(seen + [req.name])}"))
                break
            seen.append(target.name)
            cur = target
        anchors[req.name] = cur.name
        if cur is not req and cur.component.dims.world_size != req.component.dims.world_size:
            problems.append(Problem(req.path, (
                f"mesh {req.name!r} ({req.component.dims.world_size} devices) is colocated with {cur.name!r} "
                f"({cur.component.dims.world_size} devices); colocated meshes need equal world sizes")))
    return anchors


def _assign(cluster, requests, anchors, problems, warnings) -> dict[str, list[int]]:
    """Explicit lists first, then first fit for the other anchors, then colocated meshes."""
    dpn = cluster.devices_per_node
    taken: dict[int, str] = {}
    out: dict[str, list[int]] = {}
    for req in requests:
        if req.devices is None or anchors[req.name] != req.name:
            continue
        if _explicit_ok(cluster, req, problems):
            clash = sorted(d for d in req.devices if d in taken)
            if clash:
                owners = sorted({taken[d] for d in clash})
                problems.append(Problem(req.path + ("devices",), (
                    f"devices {clash} are already used by mesh(es) {', '.join(owners)}; use other "
                    "devices, or colocate_with that mesh to share them")))
            taken.update((d, req.name) for d in req.devices)
            out[req.name] = list(req.devices)
    free = [[d for d in range(n * dpn, (n + 1) * dpn) if d not in taken] for n in range(cluster.nodes)]
    for req in requests:
        if req.devices is not None or anchors[req.name] != req.name:
            continue
        c = req.component.dims
        block = math.lcm(c.tp, c.etp)
        got = _first_fit(free, c.world_size, block) if block <= dpn else None
        if got is None and req.allow_tp_across_machines:
            got = _first_fit(free, c.world_size, 1)
        if got is None:
            left = [len(f) for f in free]
            problems.append(Problem(req.path, (
                f"mesh {req.name!r} needs {c.world_size // block} block(s) of {block} devices on one "
                f"machine each (its tensor-parallel groups, t{c.tp}/expert t{c.etp}); free devices per "
                f"machine: {left}; use fewer devices elsewhere, a smaller t, or allow_tp_across_machines")))
            continue
        out[req.name] = got
    for req in requests:
        anchor = anchors[req.name]
        if anchor == req.name or anchor not in out:
            continue
        if req.devices is not None:
            if not _explicit_ok(cluster, req, problems):
                continue
            if sorted(req.devices) != sorted(out[anchor]):
                problems.append(Problem(req.path + ("devices",), (
                    f"mesh {req.name!r} is colocated with {anchor!r} but lists other devices; "
                    f"expected a reordering of {out[anchor]} or no list")))
            out[req.name] = list(req.devices)
        else:
            out[req.name] = list(out[anchor])
    for req in requests:
        if req.name in out:
            _check_tp_groups(cluster, req, out[req.name], problems, warnings)
    return out


def _explicit_ok(cluster, req, problems) -> bool:
    devs, path = req.devices, req.path + ("devices",)
    bad = []
    if not all(isinstance(d, int) and not isinstance(d, bool) for d in devs):
        bad.append("device indices must be integers")
    else:
        outside = [d for d in devs if not 0 <= d < cluster.total]
        if outside:
            bad.append(f"devices {outside} do not exist ({cluster.describe()}: 0..{cluster.total - 1})")
        dup = sorted(d for d, n in Counter(devs).items() if n > 1)
        if dup:
            bad.append(f"devices {dup} are listed more than once")
    if len(devs) != req.component.dims.world_size:
        bad.append(f"{len(devs)} devices listed, the allocation {req.component.text!r} needs "
                   f"{req.component.dims.world_size}")
    problems += [Problem(path, f"mesh {req.name!r}: {b}") for b in bad]
    return not bad


def _first_fit(free: list[list[int]], world: int, block: int) -> list[int] | None:
    """Take `world` devices, `block` consecutive ranks at a time on the first machine with room."""
    trial = [list(f) for f in free]
    got: list[int] = []
    for _ in range(world // block):
        node = next((n for n, f in enumerate(trial) if len(f) >= block), None)
        if node is None:
            return None
        got += trial[node][:block]
        del trial[node][:block]
    free[:] = trial
    return got


def _tp_groups(c: Component) -> list[list[int]]:
    d = c.dims
    if c.backend in INFERENCE_BACKENDS:
        return [list(range(i, i + d.tp)) for i in range(0, d.world_size, d.tp)]
    groups = rank_groups(d)
    return groups["tp"] + (groups["etp"] if d.etp != d.tp else [])


def _check_tp_groups(cluster, req, devices, problems, warnings) -> None:
    dpn = cluster.devices_per_node
    spanning = [g for g in _tp_groups(req.component) if len({devices[r] // dpn for r in g}) > 1]
    if not spanning:
        return
    g = spanning[0]
    text = (f"mesh {req.name!r}: {len(spanning)} tensor-parallel group(s) span machines, e.g. ranks {g} on "
            f"devices {[devices[r] for r in g]} (machines of {dpn})")
    if req.allow_tp_across_machines:
        warnings.append(Problem(req.path, text + "; allowed by allow_tp_across_machines, expect slow TP",
                                severity="warning"))
    else:
        problems.append(Problem(req.path, text + "; keep each TP group on one machine or set "
                                                 "allow_tp_across_machines: true"))


def _mesh_plan(cluster, req, devices, colocated_with) -> MeshPlan:
    c, dpn = req.component, cluster.devices_per_node
    ranks = []
    for r, d in enumerate(devices):
        coords = inference_coords(r, c.dims) if c.backend in INFERENCE_BACKENDS else rank_coords(r, c.dims)
        ranks.append(RankSlot(rank=r, device=d, machine=d // dpn, local_device=d % dpn, coords=coords))
    return MeshPlan(name=req.name, component=c, devices=list(devices), ranks=ranks, colocated_with=colocated_with)
