"""The driver's half: which path a sync takes, and the pipe between separate meshes.

Separate meshes: the driver starts every rank's part of a sync at once (the keeper sends, the
other trainer ranks walk the export's collectives, every rollout rank receives) and waits for all
of them; the buckets flow rank to rank through the pipe, never through the driver. If one part
fails, the driver closes the pipe so no other part waits for it forever, and the ranks let it go.
Over a shared-memory channel the first sync also records the rollout's load, and later ones have
the keeper write straight into the rollout's parameters (`direct`), still started and awaited here.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from contextlib import suppress
from typing import Any

log = logging.getLogger(__name__)
TRANSPORTS = ("object_store", "collective")
_NAMES = itertools.count()  # pipes are named on the ranks; unique across WeightSync instances


class WeightSync:
    """Pushes a trainer node's weights into a rollout node's engines (one per Runtime)."""

    def __init__(self, runtime: Any, direct: bool = True):
        """`direct`: between separate meshes on one CPU machine, record the rollout's first load
        and write later syncs straight into its parameters (`direct`); False keeps the channel."""
        self.rt, self.direct = runtime, direct
        self._direct: dict[tuple[str, str], list[str] | None] = {}  # pair -> rollout ranks' files, None: not possible
        # (trainer node, rollout node) -> (what it was made for: transport, member ids;
        # its name on the ranks; the channel, or None for a group; its members)
        self._pipes: dict[tuple[str, str], tuple[tuple, str, Any, list]] = {}

    def __call__(self, src_node: str, dst_node: str, version: int, transport: str | None = None) -> dict:
        """Returns timing metrics. `transport` (separate meshes only): "collective" broadcasts over a
        process group (NCCL on GPUs, gloo on CPU), "object_store" goes through shared memory in Ray's
        object store (rollout ranks on the machine of the trainer's rank 0); the default is the object
        store on one CPU machine, and collective otherwise."""
        t0 = time.perf_counter()
        src, dst = self.rt.roles[src_node], self.rt.roles[dst_node]
        src_workers = {id(w) for w, _ in src}
        if len(dst) == len(src) and all(id(w) in src_workers for w, _ in dst):
            backend = self.rt.backend
            calls = [backend.call(w, "sync_handoff", src[0][1].engine_key, r.engine_key, version, cores)
                     for (w, r), cores in zip(dst, self._cores(dst_node))]
            metrics = dict(backend.get(calls)[0])
        else:
            cluster = self.rt.pipe.cluster
            processes = self.rt.backend.name == "ray"
            transport = transport or ("collective" if processes and (cluster.device == "cuda" or cluster.nodes > 1)
                                      else "object_store")
            if transport not in TRANSPORTS:
                raise ValueError(f"unknown weight-sync transport {transport!r}; expected one of {TRANSPORTS}")
            if transport == "collective" and self.rt.backend.name != "ray":
                raise ValueError("weight sync over a process group needs runtime.backend=ray (one process per rank)")
            metrics = self._stream(src_node, dst_node, version, transport)
        metrics["timing_s/sync_weights"] = time.perf_counter() - t0
        return metrics

    def _stream(self, src_node: str, dst_node: str, version: int, transport: str) -> dict:
        backend, pair = self.rt.backend, (src_node, dst_node)
        src, dst = self.rt.roles[src_node], self.rt.roles[dst_node]
        bucket_bytes = int(self.rt.pipe.runtime.weight_sync_bucket_mb * 2**20)
        (keeper, role), walkers = src[0], src[1:]
        local = backend.name == "local"
        # the pipe first: if it cannot be made, no trainer rank has entered the export's collectives
        pipe = None if local else self._pipe(src_node, dst_node, transport)
        record = False
        if transport == "object_store" and not local and self.direct:
            paths = self._direct.get(pair, [])
            if paths and (written := self._write(pair, version, pipe, bucket_bytes, paths)) is not None:
                return written
            if paths is not None:  # never recorded, or a rollout rank moved its parameters since: record
                record = None not in backend.get([backend.call(w, "weight_sync", "share", r.engine_key) for w, r in dst])
                if not record:  # the engine has no CPU parameters to share
                    self._direct[pair] = None
        calls = [backend.call(w, "weight_sync", "export", r.engine_key, bucket_bytes) for w, r in walkers]
        if local:  # one process, one rank each: the rollout reads the trainer's export
            pipe = backend.get(backend.call(keeper, "weight_sync", "inline", role.engine_key, bucket_bytes))
        else:
            calls.append(backend.call(keeper, "weight_sync", "send", role.engine_key, bucket_bytes, pipe))
        loads = [backend.call(w, "weight_sync", "receive", r.engine_key, version, pipe, record, cores)
                 for (w, r), cores in zip(dst, self._cores(dst_node))]
        try:
            results = self._all(calls + loads)
        except Exception:
            if not local:
                self._discard(pair)
            raise
        stats = dict(pipe.buckets.stats if local else results[len(walkers)])
        loads = results[-len(dst):]
        for key in ("sync/wait_s", "sync/load_s"):  # the slowest rollout rank
            stats[key] = max(load[key] for load in loads)
        if record:
            self._target(pair, keeper, pipe, loads)
        return stats

    def _target(self, pair: tuple[str, str], keeper: Any, pipe: str, loads: list[dict]) -> None:
        """After a recorded load: the keeper maps every rollout rank's plan, so later syncs write
        straight into the rollout (`direct`); a pair that cannot keeps the channel, said once."""
        plans = [load.pop("plan") for load in loads]
        problems = {load.pop("plan_problem") for load in loads} - {None}
        if not problems:
            try:
                self.rt.backend.get(self.rt.backend.call(keeper, "weight_sync", "target", pipe, plans))
                self._direct[pair] = [plan.path for plan in plans]
                return
            except Exception as exc:  # noqa: BLE001 - the sync itself succeeded
                problems = {f"the trainer could not map the rollout's memory: {exc}"}
        self._direct[pair] = None
        log.warning("weight sync %s -> %s stays on the shared-memory channel (two copies per tensor): %s",
                    *pair, "; ".join(sorted(problems)))

    def _write(self, pair: tuple[str, str], version: int, pipe: str, bucket_bytes: int, paths: list[str]) -> dict | None:
        """All at once: the keeper writes its export into the rollout ranks' parameters (`paths`,
        their shared files) and says so over the pipe, the other trainer ranks walk the export, and
        every rollout rank waits for that word, then finishes and stamps (`take`). None if a rollout
        rank's parameters moved since they were recorded: the caller records anew."""
        backend, (src_node, dst_node) = self.rt.backend, pair
        (keeper, role), walkers = self.rt.roles[src_node][0], self.rt.roles[src_node][1:]
        calls = [backend.call(w, "weight_sync", "export", r.engine_key, bucket_bytes) for w, r in walkers]
        machine = self._machine_cores()  # the keeper writes while every other rank waits for it
        calls.append(backend.call(keeper, "weight_sync", "write", role.engine_key, pipe, machine and max(1, int(machine))))
        loads = [backend.call(w, "weight_sync", "take", r.engine_key, path, version, pipe, cores)
                 for (w, r), path, cores in zip(self.rt.roles[dst_node], paths, self._cores(dst_node))]
        try:
            results = self._all(calls + loads)
        except Exception:
            self._discard(pair)  # the rollout ranks keep refusing to generate until a sync succeeds
            raise
        loads = results[len(calls):]
        if any(load.get("moved") for load in loads):
            return None
        stats = dict(results[len(calls) - 1])
        stats["sync/load_s"] = max(load["sync/load_s"] for load in loads)
        return stats

    def _cores(self, dst_node: str) -> list[int | None]:
        """The threads each rollout rank may finish its load with (vLLM re-packs its weights on CPU): a
        sync runs between steps, when the other ranks of its machine wait, so their cores are split
        among the rollout ranks there. None (each keeps its own) on GPUs and in one process
        (backend=local). In the order of the rollout's roles (its mesh's ranks)."""
        pipe, cores = self.rt.pipe, self._machine_cores()
        mesh = pipe.plan.meshes[pipe.nodes[dst_node].mesh]
        if cores is None:
            return [None] * len(mesh.ranks)
        sharing = Counter(slot.machine for slot in mesh.ranks)
        return [max(1, int(cores // sharing[slot.machine])) for slot in mesh.ranks]

    def _machine_cores(self) -> float | None:
        """The cores of one machine, for its ranks (`weight_sync.cores`); None on GPUs and in one process."""
        pipe = self.rt.pipe
        if pipe.cluster.device != "cpu" or self.rt.backend.name != "ray":
            return None
        return pipe.cluster.devices_per_node * pipe.runtime.cpus_per_rank

    def _all(self, calls: list) -> list:
        """Every call's result, raising the first failure as soon as it happens (not after the calls
        blocked behind it)."""
        backend, pending = self.rt.backend, list(calls)
        while pending:
            for ready in backend.wait(pending):
                backend.get(ready)
                pending.remove(ready)
        return backend.get(calls)

    def _discard(self, pair: tuple[str, str]) -> None:
        """A pipe that failed a sync, or whose members were replaced, is never used again (a part may
        have stopped half-way through a bucket): closing a channel wakes the parts still blocked on
        it, each rank lets its end go once done with what it runs now (not awaited: a rank may be
        dead), and the next sync makes a new pipe."""
        _, name, closer, members = self._pipes.pop(pair)
        self._direct.pop(pair, None)
        if closer is not None:
            with suppress(Exception):
                closer.close()
        for worker in members:
            self.rt.backend.call(worker, "weight_sync", "forget", name)

    def _pipe(self, src_node: str, dst_node: str, transport: str) -> str:
        """The pipe's name on the ranks, made once per pair (and again for new members after a
        restart, the old pipe let go): a shared-memory channel (kept here too, to close it if a sync
        fails), or a process group of the sender (the trainer's rank 0) and every rollout rank."""
        backend, pair = self.rt.backend, (src_node, dst_node)
        members = [self.rt.roles[src_node][0][0]] + [w for w, _ in self.rt.roles[dst_node]]
        made_for = (transport, *(id(w) for w in members))  # new workers after a restart: a new pipe
        if pair in self._pipes and self._pipes[pair][0] != made_for:
            self._discard(pair)
        if pair not in self._pipes:
            name = f"{src_node}->{dst_node}/{next(_NAMES)}"
            if transport == "collective":
                closer = None
                address, port = backend.get(backend.call(members[0], "address"))
                backend.get([backend.call(w, "weight_sync", "join", name, address, port, rank, len(members),
                                          self.rt.pipe.cluster.device) for rank, w in enumerate(members)])
            else:
                nodes = backend.get([backend.call(w, "weight_sync", "node") for w in members[1:]])
                closer = backend.get(backend.call(members[0], "weight_sync", "open_channel", name,
                                                  list(zip(members[1:], nodes))))
                backend.get([backend.call(w, "weight_sync", "attach", name, closer) for w in members[1:]])
            self._pipes[pair] = (made_for, name, closer, members)  # members kept alive, so their ids stay theirs
        return self._pipes[pair][1]
