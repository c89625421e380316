"""runtime.backend=local (every rank in this process): the trainer's rank sends every bucket into a queue
in memory, then the rollout's rank loads them (the backend runs calls one after the other)."""

from __future__ import annotations

from collections import deque
from typing import Any

from siirl_dag.runtime.worker import RankWorker
from siirl_dag.weight_sync.path import Streamed


class LocalPipe:
    def __init__(self) -> None:
        self._items: deque = deque()

    def write(self, payload: Any) -> None:
        self._items.append(payload)

    def read(self) -> Any:
        return self._items.popleft()

    def close(self) -> None:
        self._items.clear()


class InProcess(Streamed):
    def _open(self) -> LocalPipe:
        pipe, backend = LocalPipe(), self.pair.backend
        backend.get([backend.call(worker, RankWorker.open_pipe, self.name, lambda: pipe) for worker in self.members])
        return pipe
