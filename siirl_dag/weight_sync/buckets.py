"""The trainer's HF-named export cut into buckets, one bucket at a time, and the buckets' wire form.

The export (`export_hf_weights`) is a collective walk that yields one layer's full tensors at a
time; `Buckets` pulls from it only as far as the next bucket needs, so a rank never holds more than
about one layer plus one bucket, however large the model.
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


class Buckets:
    """Pulls (name, tensor) pairs from an export into buckets of at least `bucket_bytes`
    (a tensor is never split: one larger than the bucket makes a bucket of its own)."""

    def __init__(self, named_tensors: Iterable[Named], bucket_bytes: int):
        self.stats = {"sync/gather_s": 0.0, "sync/bytes": 0, "sync/buckets": 0}
        self._tensors = timed(named_tensors, self.stats, "sync/gather_s")
        self.bucket_bytes = bucket_bytes

    def next(self) -> list[Named] | None:
        """The next bucket, or None when the export is done."""
        bucket, size = [], 0
        while size < self.bucket_bytes:
            item = next(self._tensors, None)
            if item is None:
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
    """{name: (numpy array, dtype)}: numpy crosses the object store without a copy on the reader's side."""
    return {name: tensor_to_wire(t) for name, t in bucket}


def from_wire(wire: dict) -> Iterator[Named]:
    """Tensors viewing the wire arrays. Object-store arrays are read-only views of shared memory; the
    engine's loader only reads them (it copies into its own parameters), so no private copy is made."""
    for name, (array, dtype) in wire.items():
        yield name, tensor_from_wire(array, dtype, copy=False)
