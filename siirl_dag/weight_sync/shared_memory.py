"""Separate CPU meshes on one machine: buckets through a ring of `SLOTS` shared-memory buffers of Ray's
object store, made once per pair and written over at every sync (a fresh `ray.put` per bucket lands
on pages never touched, and pays their faults). A bucket costs one copy in (the trainer's rank 0);
every rollout rank hands its engine views of the buffer, which the loader copies from.

The trainer fills one buffer while the rollout loads the other; a write waits until every reader
has released that buffer, which Ray does only once no Python object references it. vLLM's nested
weight generators keep the last tensor of a group alive long after loading it, so a reader holds
the current bucket itself (until its next read) and gives the engine views that do not own the
buffer (`_view`). Readers poll (a blocking read spins the core the trainer's gather needs). Each
buffer has two semaphores in /dev/shm named after its raylet, which Ray does not always unlink: a
new channel sweeps those of raylets gone (so does `backends.stop_ray`).
"""

from __future__ import annotations

import ctypes
import functools
import time
from typing import Any

import torch

from siirl_dag.orphan_files import RAY_SEMAPHORES, sweep_dead
from siirl_dag.runtime.batch import tensor_from_wire, tensor_to_wire
from siirl_dag.weight_sync.rank import SyncRank
from siirl_dag.weight_sync.path import Streamed
from siirl_dag.weight_sync.stream import nbytes

SLOTS = 2
POLL_S = 0.001
FIRST_BYTES = 2**20  # a buffer's size until a bucket needs more


class ChannelPipe:
    """One writer (the trainer's rank 0), one or more readers (the rollout ranks), on one machine."""

    shared = True  # SyncRank.open_pipe hands it back, for the driver to give the readers

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
            raise ValueError("the shared_memory weight-sync path reaches rollout ranks on the machine of the "
                             "trainer's rank 0 only; use runtime.weight_sync_path=process_group across machines")
        sweep_dead(RAY_SEMAPHORES)
        return cls(BufferedSharedMemoryChannel(here.current_actor, readers, SLOTS, FIRST_BYTES))

    def reader(self) -> "ChannelPipe":
        """This pipe, as a reader keeps it (a copy per reader process: the ring's position is per process)."""
        return self

    def write(self, payload: Any) -> None:
        """A bucket ((name, tensor) pairs; one copy into shared memory), or an end / abort marker."""
        self.channel.write({n: tensor_to_wire(t) for n, t in payload} if isinstance(payload, list) else payload)

    def read(self) -> Any:
        """The next bucket as tensors viewing the shared buffer (valid until the next read), or a marker."""
        from ray.exceptions import RayChannelTimeoutError

        self._current = None
        while True:
            try:
                self._current = payload = self.channel.read(timeout=0)
                break
            except RayChannelTimeoutError:
                time.sleep(POLL_S)
        if not isinstance(payload, dict):
            return payload
        return [(name, _view(tensor_from_wire(array, dtype, copy=False))) for name, (array, dtype) in payload.items()]

    def close(self) -> None:
        """Wake a writer or reader blocked on the channel with an error (a sync failed elsewhere)."""
        self.channel.close()


def _view(t: torch.Tensor) -> torch.Tensor:
    """`t`'s memory, without a reference to the buffer that holds it (see the module doc)."""
    if t.numel() == 0 or not t.is_contiguous():
        return t.clone()
    return torch.frombuffer((ctypes.c_byte * nbytes(t)).from_address(t.data_ptr()), dtype=t.dtype).view(t.shape)


class SharedMemory(Streamed):
    def _open(self) -> ChannelPipe:
        backend, (keeper, *readers) = self.pair.backend, self.members
        nodes = backend.get([backend.call(w, SyncRank.node_id) for w in readers])
        make = functools.partial(ChannelPipe.create, list(zip(readers, nodes)))
        channel = backend.get(backend.call(keeper, SyncRank.open_pipe, self.name, make, self.pair.delta))
        backend.get([backend.call(w, SyncRank.open_pipe, self.name, channel.reader, self.pair.delta) for w in readers])
        return channel
