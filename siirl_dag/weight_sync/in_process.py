"""runtime.backend=local (every rank in this process): the trainer's rank sends every bucket into a queue
in memory, then the rollout's rank loads them (the backend runs calls one after the other)."""

from __future__ import annotations

from collections import deque

from siirl_dag.weight_sync.rank import SyncRank
from siirl_dag.weight_sync.path import Streamed


class LocalPipe(deque):
    write, read, close = deque.append, deque.popleft, deque.clear


class InProcess(Streamed):
    def _open(self) -> LocalPipe:
        pipe, backend = LocalPipe(), self.pair.backend
        backend.get([backend.call(worker, SyncRank.open_pipe, self.name, lambda: pipe, self.pair.delta)
                     for worker in self.members])
        return pipe
