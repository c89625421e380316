"""Each rank's side of a sync (`rank.SyncRank.send_weights` / `walk_export` / `receive_weights` /
`handoff_weights`): the trainer's HF-named export (a collective walk yielding a layer's full tensors
at a time), in buckets pulled only as far as the next needs, through a pipe that holds one or two,
into the rollout engine. A pipe (`ChannelPipe`, `SyncGroup`, `LocalPipe`: `write`, `read`, `close`)
carries the buckets of one sync, then an `End`, or an `Aborted` in place of the next bucket.
"""

from __future__ import annotations

import time
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

from siirl_dag.strategies.engines import Named, RolloutEngine, TrainerEngine
from siirl_dag.weight_sync.fingerprints import Fingerprints


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class End:
    fingerprints: dict[str, torch.Tensor] | None  # of what the trainer sent; None: not verified


@dataclass
class Aborted:
    reason: str  # why the trainer's side failed: the readers raise it

    def error(self) -> RuntimeError:
        return RuntimeError(f"the trainer's weight export failed: {self.reason}")


def exported(engine: TrainerEngine, stats: dict, payload: str, first_rank_only: bool = True) -> Iterator[Named]:
    """The trainer engine's HF export of the model (adapters merged in) or of its adapters alone (`payload`;
    views where no conversion is needed), timed into `stats`:
    sync/convert_s into HF's layout (split fused q/k/v, gate/up), sync/gather_s the rest (TP/EP shards,
    PP stages), once walked to its end."""
    timings, stats["sync/gather_s"] = {"convert_s": 0.0}, stats.get("sync/gather_s", 0.0)
    export = engine.export_hf_weights(copy=False, first_rank_only=first_rank_only, timings=timings,
                                      what="adapters" if payload == "adapters" else "merged")
    while True:
        t0 = time.perf_counter()
        item = next(export, None)
        stats["sync/gather_s"] += time.perf_counter() - t0
        if item is None:
            break
        yield item
    stats["sync/convert_s"] = timings["convert_s"]
    stats["sync/gather_s"] -= timings["convert_s"]


class Buckets:
    """(name, tensor) pairs in buckets of at most `bucket_bytes` (a larger tensor travels alone),
    bytes and buckets counted into `stats`."""

    def __init__(self, named_tensors: Iterable[Named], bucket_bytes: int, stats: dict):
        self.stats, self.bucket_bytes = stats, bucket_bytes
        self.stats.update({"sync/bytes": 0, "sync/buckets": 0})
        self._tensors, self._held = iter(named_tensors), None  # held: pulled, but did not fit the last bucket

    def next(self) -> list[Named] | None:
        """The next bucket, or None when the export is done."""
        bucket, size = [], 0
        while size < self.bucket_bytes:
            item, self._held = self._held or next(self._tensors, None), None
            if item is None:
                break
            if bucket and size + nbytes(item[1]) > self.bucket_bytes:
                self._held = item
                break
            bucket.append(item)
            size += nbytes(item[1])
        if not bucket:
            return None
        self.stats["sync/bytes"] += size
        self.stats["sync/buckets"] += 1
        return bucket


def send(engine: TrainerEngine, pipe: Any, bucket_bytes: int, verify: bool, payload: str) -> dict:
    """The trainer's rank 0: every bucket of its export into `pipe`, then the `End`. sync/send_s is the
    time spent writing (including any wait for a slower reader), sync/fingerprint_s the sampling."""
    stats: dict = {"sync/send_s": 0.0, "sync/fingerprint_s": 0.0}
    buckets, prints = Buckets(exported(engine, stats, payload), bucket_bytes, stats), Fingerprints() if verify else None
    try:
        while (bucket := buckets.next()) is not None:
            t0 = time.perf_counter()
            for name, t in bucket if prints else ():
                prints.add(name, t)
            t1 = time.perf_counter()
            pipe.write(bucket)
            stats["sync/fingerprint_s"] += t1 - t0
            stats["sync/send_s"] += time.perf_counter() - t1
        pipe.write(End(prints.on_host() if prints else None))
    except Exception as error:
        with suppress(Exception):  # the readers stop waiting for buckets
            pipe.write(Aborted(repr(error)))
        with suppress(Exception):  # the other trainer ranks finish the export's collectives
            while buckets.next() is not None:
                pass
        raise
    return stats


def walk(engine: TrainerEngine, payload: str) -> None:
    """Every trainer rank but the first: take part in the export's collectives, keeping nothing."""
    for _ in exported(engine, {}, payload):
        pass


def receive(engine: RolloutEngine, pipe: Any, version: int, verify: bool, payload: str) -> dict:
    """A rollout rank: the pipe's buckets into one load of `engine`, stamped `version` once the `End`
    has come and, if `verify`, its fingerprints match (sync/verify_s: sampling and comparing). If the
    engine fails, the rest of the stream is still read, so the trainer finishes. The first payload is
    read before the engine is touched: a stream refused at once (an export that failed at its start, a
    delta on a version this rank missed) leaves the engine as it was."""
    stats, prints, ended = {"sync/wait_s": 0.0, "sync/verify_s": 0.0}, Fingerprints(), False

    def read() -> Any:
        t0 = time.perf_counter()
        item = pipe.read()
        stats["sync/wait_s"] += time.perf_counter() - t0
        return item

    def tensors(item: Any) -> Iterator[Named]:
        nonlocal ended
        while True:
            t1 = time.perf_counter()
            ended = isinstance(item, (End, Aborted))
            if isinstance(item, Aborted):
                raise item.error()
            if ended:
                if verify and item.fingerprints is not None:
                    prints.check(item.fingerprints)
            else:
                for name, t in item if verify else ():
                    prints.add(name, t)
            stats["sync/verify_s"] += time.perf_counter() - t1
            if ended:
                return
            yield from item
            item = read()

    t0, first = time.perf_counter(), read()
    if isinstance(first, Aborted):
        raise first.error()
    stream = tensors(first)
    try:
        with torch.no_grad():  # the engine loads in this thread's grad mode otherwise
            (engine.load_adapters if payload == "adapters" else engine.load_weights)(stream, version)
        if not ended:
            raise RuntimeError("the rollout engine stopped reading weights before the stream ended")
    finally:
        with suppress(Exception):
            for _ in stream if not ended else ():
                pass
    stats["sync/load_s"] = time.perf_counter() - t0 - stats["sync/wait_s"] - stats["sync/verify_s"]
    return stats


def handoff(src_engine: TrainerEngine, dst_engine: RolloutEngine, version: int, payload: str) -> dict:
    """Colocated meshes: the rollout engine loads straight from the trainer engine's export, tensors by
    reference; the export is walked to its end whatever happens (the other trainer ranks take part in
    its collectives)."""
    stats, t0 = {"sync/bytes": 0}, time.perf_counter()
    export = exported(src_engine, stats, payload, first_rank_only=False)

    def counted() -> Iterator[Named]:
        for name, t in export:
            stats["sync/bytes"] += nbytes(t)
            yield name, t

    try:
        with torch.no_grad():
            (dst_engine.load_adapters if payload == "adapters" else dst_engine.load_weights)(counted(), version)
    finally:
        with suppress(Exception):
            for _ in export:
                pass
    stats["sync/handoff_s"] = time.perf_counter() - t0
    stats["sync/load_s"] = stats["sync/handoff_s"] - stats["sync/gather_s"] - stats["sync/convert_s"]
    return stats
