"""Which way a trainer's weights travel to each rollout that takes them: one decision table, read once
per trainer -> rollout pair when the run starts, and by `plan` and `validate --json` (no torch here).

The first row whose rule holds gives the pair its path; a new path is one file (a `SyncPath`) plus
one row. `runtime.weight_sync_path` may ask for a path between separate meshes; one that cannot
serve the pair is refused at the door (`problems`). `weight_sync.mode=delta` sends deltas
(`delta`) on the rows that move bytes; the others hand tensors over in process and stay full.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from siirl_dag.errors import Problem
from siirl_dag.models.lora import payload


@dataclass(frozen=True)
class Pair:
    """What the table reads of a trainer -> rollout pair."""

    trainer: str
    rollout: str
    colocated: bool  # the rollout's mesh shares the trainer's rank processes
    backend: str  # runtime.backend
    device: str  # "cpu" or "cuda"
    machines: int  # machines of the trainer's rank 0 and every rollout rank
    requested: str  # runtime.weight_sync_path: auto, shared_memory or process_group
    mode: str = "full"  # weight_sync.mode: full or delta


@dataclass(frozen=True)
class Route:
    path: str  # the name of a row
    reason: str
    payload: str = "model"  # what travels: models.lora.payload
    payload_reason: str = "the model's weights"
    mode: str = "full"  # what each sync sends: every tensor, or after a first full sync a delta (`delta`)
    mode_reason: str = "weight_sync.mode=full: every tensor at every sync"


def _colocated(p: Pair) -> str | None:
    return "the rollout's engines live in the trainer's rank processes: tensors handed over by reference" \
        if p.colocated else None


def _one_process(p: Pair) -> str | None:
    return "runtime.backend=local: the rollout loads the trainer's export in this process" if p.backend == "local" else None


def _shared_memory(p: Pair) -> str | None:
    if p.requested == "shared_memory":
        return "runtime.weight_sync_path asks for it"
    if p.requested == "auto" and p.device == "cpu" and p.machines == 1:
        return "separate CPU meshes on one machine: buckets through shared-memory buffers of Ray's object store"
    return None


def _process_group(p: Pair) -> str:
    if p.requested == "process_group":
        return "runtime.weight_sync_path asks for it"
    where = "on GPUs: an NCCL" if p.device == "cuda" else f"across {p.machines} machines: a gloo"
    return f"{where} broadcast from the trainer's rank 0 to every rollout rank"


@dataclass(frozen=True)
class Row:
    name: str
    ref: str  # "module:Class" of its SyncPath, imported only by the runtime
    rule: Callable[[Pair], str | None]  # why it serves the pair, or None
    moves_bytes: bool = True  # copies buckets between processes (a delta saves bytes there)


TABLE = (
    Row("colocated", "siirl_dag.weight_sync.colocated:Colocated", _colocated, moves_bytes=False),
    Row("in_process", "siirl_dag.weight_sync.in_process:InProcess", _one_process, moves_bytes=False),
    Row("shared_memory", "siirl_dag.weight_sync.shared_memory:SharedMemory", _shared_memory),
    Row("process_group", "siirl_dag.weight_sync.process_group:ProcessGroup", _process_group),
)


def pair_of(pipe: Any, rollout: str) -> Pair:
    """The pair a rollout node (one with `weights_from`) makes with its trainer, as placed."""
    trainer = pipe.nodes[rollout].weights_from
    src, dst = (pipe.plan.meshes[pipe.nodes[n].mesh] for n in (trainer, rollout))
    machines = {src.ranks[0].machine} | {slot.machine for slot in dst.ranks}
    colocated = src.anchor == dst.anchor
    return Pair(trainer, rollout, colocated, pipe.runtime.backend, pipe.cluster.device, len(machines),
                pipe.runtime.weight_sync_path, pipe.weight_sync.mode)


def _mode(row: Row, p: Pair) -> tuple[str, str]:
    """What the pair's syncs send along `row`, and why."""
    if p.mode == "full":
        return Route.mode, Route.mode_reason
    if not row.moves_bytes:
        return "full", "tensors handed over in process: no bytes for a delta to save, only its work added"
    return "delta", ("weight_sync.mode=delta: after a full sync, each bucket as the compressed XOR "
                     "against the version the engines hold, checked bit for bit")


def _route(p: Pair, payload: tuple[str, str]) -> Route:
    row, why = next((row, why) for row in TABLE if (why := row.rule(p)))
    return Route(row.name, why, *payload, *_mode(row, p))


def routes(pipe: Any) -> dict[str, Route]:
    """rollout node -> the route of its weights, for every node with `weights_from` (once placed)."""
    pairs = [pair_of(pipe, n.id) for n in pipe.nodes.values() if n.weights_from and pipe.plan]
    what = {p.rollout: payload(pipe.models[pipe.nodes[p.rollout].model].lora, p.device) for p in pairs}
    return {p.rollout: _route(p, what[p.rollout]) for p in pairs}


def routes_json(pipe: Any) -> list[dict]:
    """Each pair's route, as `plan --json` and `validate --json` print it."""
    return [{"trainer": pipe.nodes[rollout].weights_from, "rollout": rollout, "path": r.path, "reason": r.reason,
             "payload": r.payload, "payload_reason": r.payload_reason, "mode": r.mode, "mode_reason": r.mode_reason}
            for rollout, r in routes(pipe).items()]


def problems(pipe: Any) -> list[Problem]:
    """A requested path that cannot serve a pair: the shared-memory channel reaches one machine only."""
    pairs = [pair_of(pipe, rollout) for rollout in routes(pipe)]
    return [Problem(("runtime", "weight_sync_path"), f"shared_memory reaches one machine, but '{p.trainer}' -> "
                    f"'{p.rollout}' spans {p.machines}; expected auto or process_group")
            for p in pairs if p.requested == "shared_memory" and not p.colocated and p.backend == "ray" and p.machines > 1]
