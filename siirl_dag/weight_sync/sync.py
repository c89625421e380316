"""The driver's half: which path a sync takes, and the bucket stream between separate meshes.

Separate meshes, bucket by bucket: the trainer's rank 0 streams its buckets (a Ray streaming
generator, at most `AHEAD` buckets ahead of the driver) and the driver forwards each one to every
rollout rank, which loads it into the engine already running one streaming load. The driver waits
for bucket k to be taken before forwarding k+1, so export and load overlap and at most a few
buckets are in flight, whatever the model size.
"""

from __future__ import annotations

import time
from typing import Any

TRANSPORTS = ("object_store", "collective")
AHEAD = 2  # buckets the trainer may export before the driver has forwarded them


class WeightSync:
    """Pushes a trainer node's weights into a rollout node's engines (one per Runtime)."""

    def __init__(self, runtime: Any):
        self.rt = runtime
        self._groups: dict[tuple, tuple[str, list]] = {}  # member worker ids -> (group name, members)

    def __call__(self, src_node: str, dst_node: str, version: int, transport: str | None = None) -> dict:
        """Returns timing metrics. `transport` (separate meshes only): "collective" broadcasts over a
        process group (NCCL on GPUs, gloo on CPU), "object_store" goes through Ray's object store;
        the default is collective on GPUs under Ray and the object store otherwise."""
        t0 = time.perf_counter()
        src, dst = self.rt.roles[src_node], self.rt.roles[dst_node]
        src_workers = {id(w) for w, _ in src}
        if len(dst) == len(src) and all(id(w) in src_workers for w, _ in dst):
            backend = self.rt.backend
            calls = [backend.call(w, "sync_handoff", src[0][1].engine_key, r.engine_key, version) for w, r in dst]
            metrics = dict(backend.get(calls)[0])
        else:
            device = self.rt.pipe.cluster.device
            multi_process = self.rt.backend.name == "ray"
            transport = transport or ("collective" if device == "cuda" and multi_process else "object_store")
            if transport not in TRANSPORTS:
                raise ValueError(f"unknown weight-sync transport {transport!r}; expected one of {TRANSPORTS}")
            group = self._group(src_node, dst_node, device) if transport == "collective" else None
            metrics = self._stream(src, dst, version, group)
        metrics["timing_s/sync_weights"] = time.perf_counter() - t0
        return metrics

    def _stream(self, src: list, dst: list, version: int, group: str | None) -> dict:
        backend = self.rt.backend
        bucket_bytes = int(self.rt.pipe.runtime.weight_sync_bucket_mb * 2**20)
        (keeper, role), walkers = src[0], src[1:]
        backend.get([backend.call(w, "weight_sync", "open", r.engine_key, version) for w, r in dst])
        walks = [backend.call(w, "weight_sync", "export", r.engine_key, bucket_bytes) for w, r in walkers]
        payloads = backend.stream(keeper, "weight_stream", role.engine_key, bucket_bytes, group, ahead=AHEAD)
        taken: list = []
        try:
            for payload in payloads:
                backend.get(taken)
                taken = [backend.call(w, "weight_sync", "push", payload, group) for w, _ in dst]
            backend.get(taken)
        except Exception:
            if group is None:  # let the trainer ranks finish their collective walk, so the trainer stays usable
                _quietly(lambda: [None for _ in payloads])
            _quietly(lambda: backend.get([backend.call(w, "weight_sync", "abort") for w, _ in dst]))
            raise
        stats = dict(backend.get(backend.call(keeper, "weight_sync", "stats")))
        loads = backend.get([backend.call(w, "weight_sync", "close") for w, _ in dst])
        backend.get(walks)
        for key in ("sync/wait_s", "sync/load_s"):  # the slowest rollout rank
            stats[key] = max(load[key] for load in loads)
        return stats

    def _group(self, src_node: str, dst_node: str, device: str) -> str:
        """The sender (trainer rank 0) and every rollout rank in one process group, built once."""
        if self.rt.backend.name != "ray":
            raise ValueError("weight sync over a process group needs runtime.backend=ray (one process per rank)")
        members = [self.rt.roles[src_node][0][0]] + [w for w, _ in self.rt.roles[dst_node]]
        key = tuple(id(w) for w in members)  # a restarted worker group gives new workers: a new group
        if key not in self._groups:
            backend = self.rt.backend
            name = f"{src_node}->{dst_node}/{len(self._groups)}"
            address, port = backend.get(backend.call(members[0], "address"))
            backend.get([backend.call(w, "weight_sync", "join", name, address, port, rank, len(members), device)
                         for rank, w in enumerate(members)])
            self._groups[key] = (name, members)  # members kept alive, so their ids stay theirs
        return self._groups[key][0]


def _quietly(clean_up) -> None:
    """Clean-up after a failed sync: the original error is the one to report."""
    try:
        clean_up()
    except Exception:  # noqa: BLE001
        pass
