"""The trainer's HF-named export cut into buckets, one bucket at a time, and what travels in a pipe.

The export (`export_hf_weights`) is a collective walk that yields one layer's full tensors at a
time; `Buckets` pulls from it only as far as the next bucket needs, so a rank never holds more than
about one layer plus one bucket, however large the model.

A pipe (`channel.ChannelPipe`, `collective.SyncGroup`, `rank.InlinePipe`) carries, in order, the
buckets of one sync, then `None` (the end), or an `Aborted` in place of the next bucket.
"""

from __future__ import annotations

import time
from typing import Iterable, Iterator

import torch

from siirl_dag.runtime.batch import tensor_from_wire, tensor_to_wire

Named = tuple[str, torch.Tensor]


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def timed(items: Iterable, stats: dict, key: str) -> Iterator:
    """Yield from `items`, adding the seconds spent producing them to `stats[key]`."""
    it = iter(items)
    while True:
        t0 = time.perf_counter()
        item = next(it, None)
        stats[key] = stats.get(key, 0.0) + time.perf_counter() - t0
        if item is None:
            return
        yield item


class Aborted:
    """Sent in place of the next bucket when the trainer's export failed: the readers raise it."""

    def __init__(self, reason: str):
        self.reason = reason

    def error(self) -> RuntimeError:
        return RuntimeError(f"the trainer's weight export failed: {self.reason}")


def exported(engine, stats: dict, first_rank_only: bool = True) -> Iterator[Named]:
    """The trainer engine's HF export (views where no conversion is needed), its time in `stats`:
    sync/convert_s, into HF's layout (splitting fused q/k/v and gate/up, as the engine times it),
    and sync/gather_s, the rest (collecting TP/EP shards and PP stages), once walked to its end."""
    timings = {"convert_s": 0.0}
    yield from timed(engine.export_hf_weights(copy=False, first_rank_only=first_rank_only, timings=timings),
                     stats, "sync/gather_s")
    stats["sync/convert_s"] = timings["convert_s"]
    stats["sync/gather_s"] -= timings["convert_s"]


class Buckets:
    """Pulls (name, tensor) pairs from an export into buckets of at most `bucket_bytes`, so a pipe's
    fixed buffers fit them (a tensor is never split: one larger than that travels alone). Counts
    into `stats` (the dict the export's own timings go to, if any) the bytes and buckets."""

    def __init__(self, named_tensors: Iterable[Named], bucket_bytes: int, stats: dict | None = None):
        self.stats = {} if stats is None else stats
        self.stats.update({"sync/bytes": 0, "sync/buckets": 0})
        self._tensors = iter(named_tensors)
        self._held: Named | None = None  # pulled, but did not fit the last bucket
        self.bucket_bytes = bucket_bytes

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

    def drain(self) -> dict:
        """Walk the export to its end keeping nothing (ranks that only take part in the collectives)."""
        while self.next() is not None:
            pass
        return self.stats


def to_wire(bucket: list[Named]) -> dict:
    """{name: (numpy array, dtype)}: numpy crosses Ray's shared memory without a copy on the reader's side."""
    return {name: tensor_to_wire(t) for name, t in bucket}


def from_wire(wire: dict) -> Iterator[Named]:
    """Tensors viewing the wire arrays, read-only views of shared memory under Ray; the engine's
    loader only reads them (it copies into its own parameters), so no private copy is made."""
    for name, (array, dtype) in wire.items():
        yield name, tensor_from_wire(array, dtype, copy=False)
