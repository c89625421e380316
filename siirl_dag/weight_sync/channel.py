"""Separate meshes on CPU: buckets through a ring of shared-memory buffers in Ray's object store.

A fresh object per bucket (`ray.put`) lands on pages the writer has never touched: on a VM each
put of 32 MiB paid ~8,000 page faults, 10x the copy itself. A Ray shared-memory channel (the
mutable objects behind Ray's compiled graphs) is allocated once per trainer -> rollout pair and
written over at every sync, so after the first sync a bucket costs one warm copy in (the trainer's
rank 0) and none out (every rollout rank reads the buffer in place and copies it into the engine).

`SLOTS` buffers make a ring: the trainer fills one while the rollout loads the other; a write
waits until every reader has released that buffer. Ray releases a reader's buffer only once no
Python object references it, and vLLM's nested weight generators keep the last tensor of each
group alive long after loading it, which would stall the ring for good. So a reader holds the
current bucket's buffer itself (until its next read) and hands the engine views that do not own it
(`_view`): a view is valid while its bucket is the current one, and vLLM's loaders copy each
tensor into its parameter as it arrives.

A blocking read spins a core while it waits (a writer's wait does not); on a few cores that core
is the one the trainer's gather needs, so a reader polls instead, every `POLL_S`. Buffers start
small (`FIRST_BYTES`) and Ray grows one to the size of a bucket that does not fit (a new buffer),
so a pair holds two buffers of its largest bucket, whatever weight_sync_bucket_mb says: made at
that size up front (256 MiB by default), they took 2.6 s to make for the demo's 2 MB model. Ray's
channels reach readers on the writer's machine only; other clusters sync over a process group
(`collective`).

Each buffer has two named semaphores, files in /dev/shm named after the raylet that made them,
which Ray unlinks only in destructors that a stopped session does not always run: a run of
bench_weight_sync.py left 20 behind, and 3,000 had piled up here. So a new channel first removes
those whose raylet is gone, and so does the Ray backend once it has stopped the Ray it started.
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

import torch

from siirl_dag.weight_sync.buckets import from_wire, nbytes, to_wire
from siirl_dag.leftovers import sweep_dead

SLOTS = 2
POLL_S = 0.001
FIRST_BYTES = 2**20  # a buffer's size until a bucket needs more
# the two named semaphores of each channel buffer, named after the raylet that made the buffer
RAY_SEMAPHORES = r"sem\.(?:obj|hdr)(\d+)-\d+"


class ChannelPipe:
    """One direction, one writer (the trainer's rank 0), one or more readers (the rollout ranks).
    Made by the writer (`create`); each reader keeps the copy it is given once, since the ring's
    position is per process."""

    def __init__(self, channel: Any):
        self.channel = channel
        self._current: Any = None  # the bucket being loaded: its buffer stays the reader's until the next read

    @classmethod
    def create(cls, readers: list[tuple[Any, str]]) -> "ChannelPipe":
        """On the writer's process: `readers` are (actor handle, node id) pairs."""
        import ray
        from ray.experimental.channel.shared_memory_channel import BufferedSharedMemoryChannel

        here = ray.get_runtime_context()
        if any(node != here.get_node_id() for _, node in readers):
            raise ValueError("the object_store weight-sync transport reaches rollout ranks on the machine of the "
                             "trainer's rank 0 only; use the collective transport across machines")
        sweep_dead(RAY_SEMAPHORES)  # left by Ray sessions before this one (see the module doc)
        return cls(BufferedSharedMemoryChannel(here.current_actor, readers, SLOTS, FIRST_BYTES))

    def write(self, payload: Any) -> None:
        """A bucket ((name, tensor) pairs; one copy into shared memory), or an end/abort marker."""
        self.channel.write(to_wire(payload) if isinstance(payload, list) else payload)

    def read(self) -> Any:
        """The next bucket as tensors viewing the shared buffer (valid until the next read), or the
        marker the writer sent."""
        from ray.exceptions import RayChannelTimeoutError

        self._current = None
        while True:
            try:
                self._current = payload = self.channel.read(timeout=0)
                break
            except RayChannelTimeoutError:
                time.sleep(POLL_S)
        return [(name, _view(t)) for name, t in from_wire(payload)] if isinstance(payload, dict) else payload

    def close(self) -> None:
        """Wake a writer or reader blocked on the channel with an error (a sync failed elsewhere)."""
        self.channel.close()


def _view(t: torch.Tensor) -> torch.Tensor:
    """`t`'s memory, without a reference to the buffer that holds it (see the module doc)."""
    if t.numel() == 0 or not t.is_contiguous():
        return t.clone()
    return torch.frombuffer((ctypes.c_byte * nbytes(t)).from_address(t.data_ptr()), dtype=t.dtype).view(t.shape)
