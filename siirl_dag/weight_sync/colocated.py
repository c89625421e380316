"""Colocated meshes: the rollout's engines live in the trainer's rank processes, so each rank loads its
rollout engine straight from its trainer engine's export (`stream.handoff`), tensors by reference:
no bucket, no pipe, no copy but the loader's own."""

from __future__ import annotations

from typing import Callable

from siirl_dag.weight_sync.rank import SyncRank
from siirl_dag.weight_sync.path import Placed, wait_all


class Colocated:
    def __init__(self, pair: Placed):
        self.pair = pair

    def start(self, version: int) -> Callable[[], dict]:
        pair, backend = self.pair, self.pair.backend
        calls = [backend.call(worker, SyncRank.handoff_weights, src, dst, version, pair.payload)
                 for (worker, src), (_, dst) in zip(pair.trainer_ranks, pair.rollout_ranks)]
        return lambda: dict(wait_all(backend, calls)[0])

    def sync(self, version: int) -> dict:
        return self.start(version)()

    def close(self) -> None:
        pass
