"""The rank-side half of a sync between separate meshes, one `RankSync` per rank process.

The driver calls these steps through `RankWorker.weight_sync(op, ...)` (`stream` through
`RankWorker.weight_stream`):
- the keeper (the trainer's rank 0) `stream`s the export, a generator of bucket payloads that the
  driver forwards as they come; the other trainer ranks `export`, walking the same collective
  export to its end in one call; `stats` then gives the keeper's timings;
- every rollout rank `open`s a streaming load, takes buckets with `push`, and `close` waits for
  the engine to finish and stamps the version.
A bucket travels as the stream's item (under Ray, an object in the object store that a rollout
rank maps without a copy), or, over a `SyncGroup`, as its metadata while the tensors follow by
broadcast: the keeper yields bucket k's metadata, then sends its tensors, which the rollout ranks
receive in their `push` of bucket k.
"""

from __future__ import annotations

import time
from typing import Iterator

import torch

from siirl_dag.weight_sync.buckets import Buckets, from_wire, nbytes, timed, to_wire
from siirl_dag.weight_sync.collective import SyncGroup, meta_of
from siirl_dag.weight_sync.loader import StreamingLoad, loader_thread


class RankSync:
    def __init__(self, engines: dict):
        self.engines = engines
        self.groups: dict[str, SyncGroup] = {}
        self._stats: dict = {}  # the keeper's last stream
        self._load: StreamingLoad | None = None
        self._loader_thread = None  # made at the first load, kept for the next ones

    def join(self, name: str, address: str, port: int, rank: int, world_size: int, device: str) -> None:
        if name not in self.groups:
            self.groups[name] = SyncGroup(address, port, rank, world_size, device)

    # -- trainer ranks --------------------------------------------------------------------------
    def export(self, engine_key: str, bucket_bytes: int) -> dict:
        """Take part in the export's collectives, keeping nothing (every trainer rank but the keeper)."""
        return self._buckets(engine_key, bucket_bytes).drain()

    def stream(self, engine_key: str, bucket_bytes: int, group: str | None = None) -> Iterator:
        """The keeper: one payload per bucket, produced as fast as the consumer of the stream allows.
        `sync/send_s` is the time spent handing buckets over: storing them in the object store (or
        broadcasting them), and waiting while the consumer is the slower side."""
        buckets, sender = self._buckets(engine_key, bucket_bytes), self.groups[group] if group else None
        self._stats = {"sync/send_s": 0.0}
        while (bucket := buckets.next()) is not None:
            t0 = time.perf_counter()
            if sender is not None:
                yield meta_of(bucket)
                sender.send(t for _, t in bucket)
            else:
                yield to_wire(bucket)
            self._stats["sync/send_s"] += time.perf_counter() - t0
        self._stats.update(buckets.stats)

    def stats(self) -> dict:
        return self._stats

    def _buckets(self, engine_key: str, bucket_bytes: int) -> Buckets:
        return Buckets(self.engines[engine_key].export_hf_weights(copy=False, first_rank_only=True), bucket_bytes)

    # -- rollout ranks --------------------------------------------------------------------------
    def open(self, engine_key: str, version: int) -> None:
        self.abort()  # a sync that failed half-way may have left its stream open
        self._loader_thread = self._loader_thread or loader_thread()
        self._load = StreamingLoad(self.engines[engine_key], version, self._loader_thread)

    def push(self, payload: Any, group: str | None = None) -> None:
        """`payload`: a bucket's metadata (its tensors come by broadcast) or its wire form."""
        self._load.push(self.groups[group].receive(payload) if group is not None else from_wire(payload))

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
