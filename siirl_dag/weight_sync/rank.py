"""The rank-side half of a sync between separate meshes, one `RankSync` per rank process.

The driver calls these steps through `RankWorker.weight_sync(op, ...)`, all at once for a sync:
- the keeper (the trainer's rank 0) `send`s its export into a pipe, bucket by bucket, then the
  end; the other trainer ranks `export`, taking part in the same collective export to its end;
- every rollout rank `receive`s from the pipe into one engine load, in its own main thread, and
  the engine stamps the version once every bucket is in.
The pipe is made once per trainer -> rollout pair: a Ray shared-memory channel (`open_channel` on
the keeper, `attach` on the rollout ranks) or a process group (`join`); with
runtime.backend=local the rollout reads the keeper's export directly (`inline`).
A pipe's capacity (two channel buffers, or a broadcast's rendezvous) paces the trainer to the
rollout, so at most a few buckets exist at a time, whatever the model size.
"""

from __future__ import annotations

import time
from contextlib import suppress
from typing import Any

import torch

from siirl_dag.weight_sync.buckets import Aborted, Buckets, nbytes, timed
from siirl_dag.weight_sync.channel import ChannelPipe
from siirl_dag.weight_sync.collective import SyncGroup


class InlinePipe:
    """runtime.backend=local (one process): the reader pulls buckets straight from the export."""

    def __init__(self, buckets: Buckets):
        self.buckets = buckets

    def read(self) -> list | None:
        return self.buckets.next()


class RankSync:
    def __init__(self, engines: dict):
        self.engines = engines
        self.pipes: dict[str, Any] = {}  # name -> ChannelPipe | SyncGroup, kept from sync to sync

    # -- set-up, once per trainer -> rollout pair ------------------------------------------------
    def join(self, name: str, address: str, port: int, rank: int, world_size: int, device: str) -> None:
        if name not in self.pipes:
            self.pipes[name] = SyncGroup(address, port, rank, world_size, device)

    def open_channel(self, name: str, readers: list, bucket_bytes: int) -> ChannelPipe:
        """The keeper makes the channel; the driver hands it to the readers (`attach`)."""
        self.pipes[name] = ChannelPipe.create(readers, bucket_bytes)
        return self.pipes[name]

    def attach(self, name: str, pipe: ChannelPipe) -> None:
        self.pipes[name] = pipe

    def forget(self, name: str) -> None:
        """The pipe failed a sync: free this end (a channel's buffers, a group's sockets and thread)."""
        pipe = self.pipes.pop(name, None)
        if pipe is not None:
            with suppress(Exception):  # a channel the driver closed already
                pipe.close()

    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    # -- trainer ranks --------------------------------------------------------------------------
    def export(self, engine_key: str, bucket_bytes: int) -> dict:
        """Take part in the export's collectives, keeping nothing (every trainer rank but the keeper)."""
        return self._buckets(engine_key, bucket_bytes).drain()

    def send(self, engine_key: str, bucket_bytes: int, pipe: str) -> dict:
        """The keeper: every bucket into the pipe, then the end. `sync/send_s` is the time spent
        writing (the copy into shared memory, or the broadcast), including any wait for a slower reader."""
        pipe, buckets = self.pipes[pipe], self._buckets(engine_key, bucket_bytes)
        stats = {"sync/send_s": 0.0}
        try:
            while (bucket := buckets.next()) is not None:
                t0 = time.perf_counter()
                pipe.write(bucket)
                stats["sync/send_s"] += time.perf_counter() - t0
            pipe.write(None)
        except Exception as error:
            with suppress(Exception):  # the readers stop waiting for buckets
                pipe.write(Aborted(repr(error)))
            with suppress(Exception):  # the other trainer ranks finish their collective walk
                buckets.drain()
            raise
        return {**stats, **buckets.stats}

    def inline(self, engine_key: str, bucket_bytes: int) -> InlinePipe:
        return InlinePipe(self._buckets(engine_key, bucket_bytes))

    def _buckets(self, engine_key: str, bucket_bytes: int) -> Buckets:
        return Buckets(self.engines[engine_key].export_hf_weights(copy=False, first_rank_only=True), bucket_bytes)

    # -- rollout ranks --------------------------------------------------------------------------
    def receive(self, engine_key: str, version: int, pipe: str | InlinePipe) -> dict:
        """Load every bucket of the pipe into the engine, which stamps `version` at the end. If the
        engine fails, the rest of the stream is still read (and dropped), so the trainer finishes."""
        pipe = self.pipes[pipe] if isinstance(pipe, str) else pipe
        stats, ended = {"sync/wait_s": 0.0}, False
        reads = timed(iter(pipe.read, None), stats, "sync/wait_s")

        def tensors():
            nonlocal ended
            ended = True  # until a bucket is under way: a failed read ends the stream too
            for bucket in reads:
                if isinstance(bucket, Aborted):
                    raise bucket.error()
                ended = False
                yield from bucket
                ended = True

        def drop_the_rest() -> bool:
            if ended:
                return False
            with suppress(Exception):
                for _ in tensors():
                    pass
            return True

        t0 = time.perf_counter()
        try:
            with torch.no_grad():  # the engine loads in this thread's grad mode otherwise
                self.engines[engine_key].load_weights(tensors(), version)
        except Exception:
            drop_the_rest()
            raise
        if drop_the_rest():
            raise RuntimeError("the rollout engine stopped reading weights before the stream ended")
        stats["sync/load_s"] = time.perf_counter() - t0 - stats["sync/wait_s"]
        return stats


def handoff(src_engine: Any, dst_engine: Any, version: int) -> dict:
    """Colocated meshes: the rollout engine loads straight from the trainer's export, in process."""
    t0, stats = time.perf_counter(), {"sync/bytes": 0}

    def counted(named):
        for name, t in named:
            stats["sync/bytes"] += nbytes(t)
            yield name, t

    export = src_engine.export_hf_weights(copy=False)
    try:
        with torch.no_grad():  # the engine's loader runs in this thread's grad mode otherwise
            dst_engine.load_weights(counted(timed(export, stats, "sync/gather_s")), version)
    finally:  # a load that failed here must not leave the other trainer ranks in the export's collectives
        with suppress(Exception):
            for _ in export:
                pass
    total = time.perf_counter() - t0
    return {**stats, "sync/handoff_s": total, "sync/load_s": total - stats["sync/gather_s"]}
