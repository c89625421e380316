"""The rank-side half of a sync between separate meshes, one `RankSync` per rank process.

The driver calls these steps through `RankWorker.weight_sync(op, ...)`:
- every trainer rank `export`s (the export is collective); the keeper (rank 0) holds the walk open
  and hands out one bucket per `next`, the others walk it to the end in that same call;
- every rollout rank `open`s a streaming load, takes buckets with `push`, and `close` waits for
  the engine to finish and stamps the version.
A bucket travels as an object-store reference, or, over a `SyncGroup`, as its metadata while the
tensors follow by broadcast: the keeper sends bucket k at its next `next`, while the rollout ranks
receive it in their `push` of bucket k (the driver keeps both calls in flight together).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from siirl_dag.weight_sync.buckets import Buckets, from_wire, nbytes, timed, to_wire
from siirl_dag.weight_sync.collective import SyncGroup, meta_of
from siirl_dag.weight_sync.loader import StreamingLoad, loader_thread


class RankSync:
    def __init__(self, engines: dict, put: Callable = lambda x: x, fetch: Callable = lambda x: x):
        self.engines, self._put, self._fetch = engines, put, fetch
        self.groups: dict[str, SyncGroup] = {}
        self._export: tuple[Buckets, SyncGroup | None] | None = None
        self._pending: list | None = None  # the keeper's last bucket, broadcast at the next `next`
        self._put_s = 0.0
        self._load: StreamingLoad | None = None
        self._loader_thread = None  # made at the first load, kept for the next ones

    def join(self, name: str, address: str, port: int, rank: int, world_size: int, device: str) -> None:
        if name not in self.groups:
            self.groups[name] = SyncGroup(address, port, rank, world_size, device)

    # -- trainer ranks --------------------------------------------------------------------------
    def export(self, engine_key: str, bucket_bytes: int, keep: bool, group: str | None = None) -> dict:
        buckets = Buckets(self.engines[engine_key].export_hf_weights(copy=False), bucket_bytes)
        if not keep:
            return buckets.drain()
        self._export, self._pending, self._put_s = (buckets, self.groups[group] if group else None), None, 0.0
        return {}

    def next(self) -> tuple[Any, dict | None]:
        """(bucket payload, None), or (None, the export's stats) once the export is done."""
        buckets, group = self._export
        if self._pending is not None:
            group.send(t for _, t in self._pending)
            self._pending = None
        bucket = buckets.next()
        if bucket is None:
            self._export = None
            return None, {**buckets.stats, "sync/put_s": self._put_s}
        if group is not None:
            self._pending = bucket
            return meta_of(bucket), None
        t0 = time.perf_counter()
        ref = self._put(to_wire(bucket))
        self._put_s += time.perf_counter() - t0
        return ref, None

    # -- rollout ranks --------------------------------------------------------------------------
    def open(self, engine_key: str, version: int) -> None:
        self.abort()  # a sync that failed half-way may have left its stream open
        self._loader_thread = self._loader_thread or loader_thread()
        self._load = StreamingLoad(self.engines[engine_key], version, self._loader_thread)

    def push(self, payload: Any, group: str | None = None) -> None:
        if group is not None:
            self._load.push(self.groups[group].receive(payload))
        else:
            stats = self._load.stats
            self._load.push(lambda: self._fetched(payload, stats))

    def _fetched(self, ref, stats: dict):
        """In the loading thread: map the bucket from the object store (zero-copy for numpy)."""
        t0 = time.perf_counter()
        wire = self._fetch(ref)
        stats["sync/fetch_s"] += time.perf_counter() - t0
        return from_wire(wire)

    def close(self) -> dict:
        load, self._load = self._load, None
        return load.close()

    def abort(self) -> None:
        load, self._load = self._load, None
        if load is not None:
            load.abort()


def handoff(src_engine: Any, dst_engine: Any, version: int) -> dict:
    """Colocated meshes: the rollout engine loads straight from the trainer's export, in process."""
    t0, stats = time.perf_counter(), {"sync/bytes": 0}

    def counted(named):
        for name, t in named:
            stats["sync/bytes"] += nbytes(t)
            yield name, t

    with torch.no_grad():  # the engine's loader runs in this thread's grad mode otherwise
        dst_engine.load_weights(counted(timed(src_engine.export_hf_weights(copy=False), stats, "sync/gather_s")),
                                version)
    total = time.perf_counter() - t0
    return {**stats, "sync/handoff_s": total, "sync/load_s": total - stats["sync/gather_s"]}
