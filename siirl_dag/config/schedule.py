"""`runtime.schedule`: which part of a step runs ahead, how far, and what a schedule needs of the meshes.

The rollouts (the nodes that take weights from a trainer) and their ancestors, with dynamic sampling
the filter and its ancestors, and the nodes that read only what those made and compute with no weights
a trainer moves (rewards and advantages on the driver's side; a reference model's log-probs, a judge,
on devices off the training side's) are the generating side; they run ahead of the rest, the
training side, into a queue of generated batches:
- one_step_off: one batch ahead, generated while the step before it trains; a sample trains one
  weight version after the one that generated it (runtime.staleness >= 1).
- async: up to runtime.staleness batches ahead, as far as the bound lets the rollouts' weights lag
  (0: the sync schedule's order, one side at a time).
Both sides must own their devices to overlap.
"""

from __future__ import annotations

import networkx as nx

from siirl_dag.errors import Problem
from siirl_dag.graph import phases_of


def generating_nodes(pipe) -> frozenset:
    """The generating side, which runs ahead: every weights_from consumer and its ancestors, with dynamic
    sampling the filter and its ancestors (`graph.phases_of`: what each round re-runs), then, in order,
    each node that reads only those and computes with no weights a trainer moves: driver-side nodes
    (rewards, advantages) and a frozen model's nodes on a mesh off the training side's devices. A
    frozen reference on the rollout's devices thus computes beside the update, and the update starts
    on rows whose rewards and advantages are ready (docs/BENCHMARKS.md)."""
    rollouts = [n.id for n in pipe.nodes.values() if n.weights_from]
    ahead = set(rollouts).union(*(nx.ancestors(pipe.graph, r) for r in rollouts))
    phases = phases_of(pipe)
    ahead |= phases.first if phases else set()
    trained = {(n.mesh, n.model) for n in pipe.nodes.values() if pipe.kinds[n.id].trains}
    moving = {n for n in pipe.nodes if n not in ahead and (pipe.nodes[n].mesh, pipe.nodes[n].model) in trained}
    held = moving.union(*(nx.descendants(pipe.graph, n) for n in moving))  # they read weights a trainer moves
    training_devices = _devices(pipe, held)
    for n in nx.topological_sort(pipe.graph):
        if n not in ahead | held and set(pipe.graph.predecessors(n)) <= ahead and \
                not _devices(pipe, [n]) & training_devices:
            ahead.add(n)
    return frozenset(ahead)


def _devices(pipe, ids) -> set:
    """The devices the nodes `ids` run on (none before placement, or without a mesh)."""
    if pipe.plan is None:
        return set()
    return {d for n in ids if pipe.nodes[n].mesh for d in pipe.plan.meshes[pipe.nodes[n].mesh].devices}


def depth(runtime) -> int:
    """How many batches the generating side may run ahead of the one training (0: none)."""
    return {"sync": 0, "one_step_off": 1}.get(runtime.schedule, runtime.staleness)


def describe(pipe) -> str | None:
    """What the schedule runs ahead, for `plan` (None: sync)."""
    rt, ahead = pipe.runtime, generating_nodes(pipe)
    if rt.schedule == "sync":
        return None
    front, behind = [n for n in pipe.nodes if n in ahead], ", ".join(n for n in pipe.nodes if n not in ahead)
    bound = f"samples at most {rt.staleness} weight version{'s' if rt.staleness != 1 else ''} old"
    if rt.partial_rollout:
        bound += f"; partial rollouts: segments of {rt.partial_rollout_tokens} tokens, new weights between them"
    return (f"schedule {rt.schedule}: {', '.join(front)} run{'s' if len(front) == 1 else ''} up to "
            f"{depth(rt)} batch{'es' if depth(rt) != 1 else ''} ahead of {behind}; {bound}")


def edge_label(runtime) -> str:
    """The weight-sync edge's label in the pictures."""
    if runtime.schedule == "sync":
        return "weights (sync)"
    return f"weights ({runtime.schedule}, ≤ {runtime.staleness} version{'s' if runtime.staleness != 1 else ''} behind)"


def problems(pipe) -> list[Problem]:
    """What one_step_off and async cannot run (each at the key to change)."""
    rt = pipe.runtime
    if rt.schedule == "sync":
        return [Problem(("runtime", "partial_rollout"), "segments of a batch generated ahead take new weights between "
                        "them, and schedule sync generates nothing ahead; expected runtime.schedule one_step_off or "
                        "async, or partial_rollout: false")] if rt.partial_rollout else []
    out = []
    for n in pipe.nodes.values() if rt.partial_rollout else ():
        if n.weights_from and not pipe.kinds[n.id].resumes:
            out.append(Problem(pipe.node_path(n.id) + ("kind",), f"'{n.id}' (kind {n.kind}) cannot continue its samples "
                               "in segments (runtime.partial_rollout); expected kind rollout, or partial_rollout: false"))
    if rt.schedule == "one_step_off" and rt.staleness < 1:
        out.append(Problem(("runtime", "staleness"), f"{rt.staleness}: under schedule {rt.schedule} a sample trains "
                           "one weight version after the one that generated it; expected runtime.staleness >= 1"))
    ahead = generating_nodes(pipe)
    if not any(n.weights_from for n in pipe.nodes.values()):
        out.append(Problem(("runtime", "schedule"), f"{rt.schedule} runs the rollouts ahead, and no node takes "
                           "weights from a trainer (weights_from); expected schedule sync"))
    if pipe.plan is None:
        return out
    shared = _devices(pipe, ahead) & _devices(pipe, set(pipe.nodes) - ahead)
    for n in sorted(n for n in ahead if pipe.nodes[n].mesh and _devices(pipe, [n]) & shared):
        out.append(Problem(pipe.node_path(n) + ("mesh",), f"'{n}' runs ahead under {rt.schedule}, but its "
                           f"mesh '{pipe.nodes[n].mesh}' shares devices {sorted(_devices(pipe, [n]) & shared)} with the "
                           "training side, so the two cannot overlap; expected meshes on devices of their own "
                           "(no colocate_with), or schedule sync"))
    return out
