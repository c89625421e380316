"""On GPUs and between machines: each bucket broadcast over a process group of the trainer's rank 0
(group rank 0, the writer) and every rollout rank: NCCL on GPUs, the tensors never leaving the
devices; gloo on CPUs. The group is built directly on a TCPStore hosted by the trainer's rank 0,
beside each member's default group of its own mesh. Each payload goes as a pickled header first (a
bucket's names, shapes and dtypes, or the end / abort marker; two broadcasts, length and bytes), so
readers allocate before the tensors follow.
"""

from __future__ import annotations

import datetime
import functools
import pickle
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from siirl_dag.weight_sync.rank import SyncRank
from siirl_dag.weight_sync.path import Streamed


class SyncGroup:
    def __init__(self, address: str, port: int, rank: int, world_size: int, device: str, timeout_s: float = 600):
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.PrefixStore("siirl_weight_sync", dist.TCPStore(address, port, world_size, is_master=rank == 0,
                                                                    timeout=timeout))
        if device == "cuda":
            if not (torch.cuda.is_available() and dist.is_nccl_available()):
                raise RuntimeError("weight sync over NCCL needs CUDA and a torch build with NCCL on every rank "
                                   "of the trainer's rank 0 and the rollout mesh")
            self.device = torch.device("cuda", torch.cuda.current_device())
            self.pg = dist.ProcessGroupNCCL(store, rank, world_size)
        else:
            self.device = torch.device("cpu")
            self.pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        self.rank = rank
        self._receiver: ThreadPoolExecutor | None = None
        self._next: Future | None = None  # the payload being received ahead
        # NCCL builds its communicator at the first collective, which blocks until every member
        # calls it: do it now, while every member is joining anyway.
        self._broadcast(torch.zeros(1, device=self.device))

    def _broadcast(self, t: torch.Tensor) -> None:
        self.pg.broadcast(t, 0).wait()

    def write(self, payload: Any) -> None:
        """A bucket or a marker to every member. A bucket's tensors are on the device before its header
        goes: once readers have a header, only its tensors may follow (a marker would desync the group)."""
        if not isinstance(payload, list):
            self._header(payload)
            return
        tensors = [t.detach().to(self.device).contiguous() for _, t in payload]
        self._header([(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in payload])
        for t in tensors:
            self._broadcast(t)
        self._synchronize()

    def read(self) -> Any:
        """The next payload; the one after it is received meanwhile, in a thread (a broadcast completes only
        once every member takes part: receiving after loading would stall the sender at every load)."""
        if self._next is None:
            self._receiver = self._receiver or ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-receive")
            self._next = self._receiver.submit(self._receive)
        receiving, self._next = self._next, None
        payload = receiving.result()
        if isinstance(payload, list):
            self._next = self._receiver.submit(self._receive)
        return payload

    def close(self) -> None:
        """Tear the group down, waking a receive blocked on it. gloo's abort leaves the connections open
        (a reader whose writer failed would wait out the timeout): dropping the group closes them."""
        self.pg.abort()
        self.pg = None
        if self._receiver is not None:
            self._receiver.shutdown(wait=False, cancel_futures=True)

    def _receive(self) -> Any:
        header = self._header()
        if not isinstance(header, list):
            return header
        out = []
        for name, shape, dtype in header:
            t = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
            self._broadcast(t)
            out.append((name, t))
        self._synchronize()
        return out

    def _header(self, obj: Any = None) -> Any:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if self.rank == 0 else None
        size = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64, device=self.device)
        self._broadcast(size)
        buf = data.to(self.device) if data is not None else torch.empty(int(size.item()), dtype=torch.uint8,
                                                                         device=self.device)
        self._broadcast(buf)
        return obj if self.rank == 0 else pickle.loads(buf.cpu().numpy().tobytes())

    def _synchronize(self) -> None:
        """NCCL work is asynchronous on the device: finish it before the buffers change hands."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()


class ProcessGroup(Streamed):
    def _open(self) -> None:
        backend, members = self.pair.backend, self.members
        address, port = backend.get(backend.call(members[0], SyncRank.address))
        backend.get([backend.call(w, SyncRank.open_pipe, self.name,
                                  functools.partial(SyncGroup, address, port, rank, len(members), self.pair.device),
                                  self.pair.delta)
                     for rank, w in enumerate(members)])
        return None  # each member's close tears its group down
