"""Delta weight sync (weight_sync.mode=delta, on the paths that move bytes: `routes`): after a
first full sync, each bucket travels as the zstd-compressed XOR of its bytes against the bytes of the
same bucket at the version before. A small step leaves most bits of most weights as they were (bf16
weights after an Adam step at lr 1e-6 barely change at all), so the XOR is mostly zero bytes and
compresses well.

Both ends keep those bytes: the trainer's rank 0 and every rollout rank hold one copy of the synced
weights (or adapters) in host memory, the price of a delta. `DeltaPipe` wraps a path's pipe on each
member and keeps them from sync to sync; `sending` / `receiving` give one sync's view of it, which
`stream` reads and writes like any pipe. The receiver refuses a delta whose base is not the version
it holds (a missed version) and proves every bucket it rebuilds bit-identical to the trainer's (a
CRC32 of its bytes): `DeltaMismatch`, after the rest of the stream is read, and before its engine is
touched when the first bucket is refused. The driver's path then sends the version again in full
(`path.Streamed`).
"""

from __future__ import annotations

import math
import time
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zstandard

from siirl_dag.strategies.engines import Named
from siirl_dag.weight_sync.fingerprints import SyncMismatch
from siirl_dag.weight_sync.stream import Aborted, End

LEVEL = 1  # zstd's fastest positive level: the XOR of a small step is mostly zero bytes at any level


class DeltaMismatch(SyncMismatch):
    """A delta that cannot be applied: its base is not the receiver's, or what it rebuilt differs."""


Layout = list  # (name, shape, dtype name) of each tensor of a bucket, in order


@dataclass
class Delta:
    """One bucket, as its change since version `base`."""

    index: int  # the bucket's place in its sync
    base: int  # the version whose bytes it is XORed against
    layout: Layout
    data: bytes  # zstd(new bytes XOR base bytes)
    crc: int  # CRC32 of the new bytes


def layout_of(bucket: list[Named]) -> Layout:
    return [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in bucket]


def to_bytes(bucket: list[Named]) -> np.ndarray:
    """The bucket's tensors' bytes one after the other, in host memory (a copy)."""
    flat = [t.detach().reshape(-1).view(torch.uint8) for _, t in bucket]
    return torch.cat(flat).cpu().numpy() if flat else np.empty(0, np.uint8)


def from_bytes(layout: Layout, raw: np.ndarray) -> list[Named]:
    """The bucket's tensors, viewing `raw`."""
    out, at, buf = [], 0, torch.from_numpy(raw)
    for name, shape, dtype in layout:
        dt = getattr(torch, dtype)
        n = math.prod(shape) * dt.itemsize
        out.append((name, buf[at:at + n].view(dt).view(shape)))
        at += n
    return out


def encode(index: int, base_version: int, base: np.ndarray, raw: np.ndarray, layout: Layout) -> Delta:
    return Delta(index, base_version, layout, zstandard.ZstdCompressor(level=LEVEL).compress(np.bitwise_xor(raw, base)),
                 zlib.crc32(raw))


def decode(delta: Delta, base: np.ndarray) -> np.ndarray:
    """The new bytes of `delta`'s bucket (a fresh array: the engine may still hold views of `base`)."""
    raw = np.bitwise_xor(np.frombuffer(zstandard.ZstdDecompressor().decompress(delta.data), np.uint8), base)
    if zlib.crc32(raw) != delta.crc:
        raise DeltaMismatch(f"bucket {delta.index} (first tensor {delta.layout[0][0]!r}) was rebuilt from its delta "
                            "with other bytes than the trainer's: the bytes it was applied to differ from those it "
                            f"was made against (version {delta.base})")
    return raw


class DeltaPipe:
    """A path's pipe on one member, and the bytes of every bucket of the last version it carried."""

    def __init__(self, pipe: Any):
        self.pipe = pipe
        self.bases: list[np.ndarray] = []
        self.layouts: list[Layout] = []
        self.version: int | None = None  # the version `bases` hold whole; None: none (send in full)

    def sending(self, version: int, full: bool) -> "Sending":
        """The trainer's view of the pipe for one sync of `version`: in full if `full` or nothing is held."""
        return Sending(self, version, full or self.version is None)

    def receiving(self, version: int) -> "Receiving":
        return Receiving(self, version)

    def forget(self) -> None:
        self.bases, self.layouts, self.version = [], [], None

    def keep(self, index: int, raw: np.ndarray, layout: Layout) -> None:
        if index == len(self.bases):
            self.bases.append(raw)
            self.layouts.append(layout)
        else:
            self.bases[index], self.layouts[index] = raw, layout

    def close(self) -> None:
        self.forget()
        self.pipe.close()


class Sending:
    """One sync's writes: each bucket in full or as a delta; stats `sync/sent_bytes` (on the wire),
    `sync/delta_buckets`, `sync/encode_s`."""

    def __init__(self, owner: DeltaPipe, version: int, full: bool):
        self.owner, self.version, self.full, self.index = owner, version, full, 0
        self.stats = {"sync/sent_bytes": 0, "sync/delta_buckets": 0, "sync/encode_s": 0.0}

    def write(self, payload: Any) -> None:
        owner = self.owner
        if isinstance(payload, list):
            t0, i = time.perf_counter(), self.index
            raw, layout = to_bytes(payload), layout_of(payload)
            if self.full or i >= len(owner.bases) or owner.layouts[i] != layout:
                sent = raw.nbytes
            else:
                payload = encode(i, owner.version, owner.bases[i], raw, layout)
                sent = len(payload.data)
                self.stats["sync/delta_buckets"] += 1
            owner.keep(i, raw, layout)
            self.index += 1
            self.stats["sync/sent_bytes"] += sent
            self.stats["sync/encode_s"] += time.perf_counter() - t0
        elif isinstance(payload, End):
            del owner.bases[self.index:], owner.layouts[self.index:]
            owner.version = self.version
        else:
            owner.forget()  # an abort: the readers' bytes are now partly new
        owner.pipe.write(payload)


class Receiving:
    """One sync's reads: full buckets kept as they pass, deltas applied to what is kept; stat
    `sync/decode_s`. A delta that cannot be applied forgets what is kept, reads the stream to its end
    and raises DeltaMismatch."""

    def __init__(self, owner: DeltaPipe, version: int):
        self.owner, self.version, self.index = owner, version, 0
        self.stats = {"sync/decode_s": 0.0}

    def read(self) -> Any:
        owner, item = self.owner, self.owner.pipe.read()
        t0 = time.perf_counter()
        try:
            if isinstance(item, list):
                owner.keep(self.index, to_bytes(item), layout_of(item))
            elif isinstance(item, Delta):
                item = from_bytes(item.layout, self._apply(item))
            elif isinstance(item, End):
                del owner.bases[self.index:], owner.layouts[self.index:]
                owner.version = self.version
                return item
            else:
                owner.forget()
                return item
        except DeltaMismatch:
            owner.forget()
            self._drain()
            raise
        finally:
            self.stats["sync/decode_s"] += time.perf_counter() - t0
        self.index += 1
        return item

    def _apply(self, delta: Delta) -> np.ndarray:
        owner, i = self.owner, self.index
        if owner.version != delta.base or delta.index != i or i >= len(owner.bases) \
                or owner.bases[i].nbytes != sum(math.prod(s) * getattr(torch, d).itemsize for _, s, d in delta.layout):
            held = "none" if owner.version is None else f"version {owner.version}"
            raise DeltaMismatch(f"bucket {delta.index} came as a delta from version {delta.base}, but this rank holds "
                                f"{held} of bucket {i}: a version or a bucket was missed")
        raw = decode(delta, owner.bases[i])
        owner.keep(i, raw, delta.layout)
        return raw

    def _drain(self) -> None:
        while not isinstance(self.owner.pipe.read(), (End, Aborted)):
            pass
