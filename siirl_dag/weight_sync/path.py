"""The driver's side of a sync: the `SyncPath` interface, and `Streamed`, which the paths between
separate meshes share.

The runtime makes one SyncPath per trainer -> rollout pair, of the class its route names
(`routes.TABLE`), at the pair's first sync, and calls `sync(version)` after every update. A path that
failed a sync, or whose ranks were replaced after a restart, is closed and the next sync makes a new
one: a part may have stopped half-way through a bucket, so its pipe is never used again.
"""

from __future__ import annotations

import itertools
import logging
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from siirl_dag.weight_sync.fingerprints import SyncMismatch
from siirl_dag.weight_sync.rank import SyncRank

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placed:
    """A pair's ranks as they run now, (worker, engine key) in mesh rank order, and how to sync them."""

    trainer: str
    rollout: str
    backend: Any  # runtime.backends.LocalBackend or RayBackend
    trainer_ranks: list[tuple[Any, str]]
    rollout_ranks: list[tuple[Any, str]]
    bucket_bytes: int
    verify: bool
    device: str
    payload: str = "model"  # "model" (its weights) or "adapters" (LoRA adapters alone): routes.Route.payload
    delta: bool = False  # send deltas after a first full sync (routes.Route.mode; `delta`)


class SyncPath(Protocol):
    """One way weights travel from a trainer node's ranks into a rollout node's engines."""

    def __init__(self, pair: Placed) -> None: ...

    def start(self, version: int) -> Callable[[], dict]:
        """Send every part its call at once: each rank runs its part after what it was asked before and
        before what it is asked after (a rollout's next generate, a trainer's next update). Returns the
        wait: the trainer's weights are in every rollout engine, stamped `version`, and these are the
        `sync/<stat>` metrics; or the first part's failure is raised (the rollout then refuses to generate)."""

    def sync(self, version: int) -> dict:
        """`start(version)`, waited for."""

    def close(self) -> None:
        """Let go of what the path holds on every rank (not awaited: a rank may be dead)."""


def wait_all(backend: Any, calls: list) -> list:
    """Every call's result; the first failure raised as soon as it happens (others may wait for it forever)."""
    pending = list(calls)
    while pending:
        ready = backend.wait(pending)
        backend.get(ready)
        finished = set(ready)
        pending = [call for call in pending if call not in finished]
    return backend.get(calls)


class Streamed:
    """Separate meshes: the trainer's rank 0 sends its export through a pipe that every rollout rank
    reads into one load, all parts started at once, while the other trainer ranks walk the export's
    collectives; buckets go rank to rank, never through the driver. A subclass makes the pipe on the
    members (`_open`, returning what the driver closes to wake parts blocked on it, or None).

    With `pair.delta` each member's pipe keeps the bytes of the last version (`delta.DeltaPipe`): a
    sync after the first sends deltas, and one that does not verify (a version missed, bytes or
    tensors that differ) is sent again at once in full (`sync/delta_fallback` 1)."""

    _names = itertools.count()  # pipes are named on the ranks, which may serve several pairs

    def __init__(self, pair: Placed):
        self.pair, self.name, self.closer = pair, f"{pair.trainer}->{pair.rollout}/{next(self._names)}", None
        self.synced = False  # a sync went through whole: the members hold its bytes (with pair.delta)
        self.members = [pair.trainer_ranks[0][0]] + [worker for worker, _ in pair.rollout_ranks]
        try:
            self.closer = self._open()
        except BaseException:
            self.close()  # members that made their end already let it go
            raise

    def _open(self) -> Any:
        raise NotImplementedError

    def start(self, version: int, full: bool = False) -> Callable[[], dict]:
        pair, backend = self.pair, self.pair.backend
        (keeper, key), walkers = pair.trainer_ranks[0], pair.trainer_ranks[1:]
        calls = [backend.call(w, SyncRank.walk_export, k, pair.payload) for w, k in walkers]
        calls.append(backend.call(keeper, SyncRank.send_weights, key, self.name, pair.bucket_bytes, pair.verify,
                                  pair.payload, version, full))
        calls += [backend.call(w, SyncRank.receive_weights, k, version, self.name, pair.verify, pair.payload)
                  for w, k in pair.rollout_ranks]

        deltas = pair.delta and self.synced and not full

        def wait() -> dict:
            try:
                results = wait_all(backend, calls)
            except Exception as exc:  # noqa: BLE001 - a rank's error, re-raised unless a delta did not verify
                cause = getattr(exc, "cause", None) or exc  # Ray wraps the rank's exception
                if not (deltas and isinstance(cause, SyncMismatch)):
                    raise
                log.warning("weight sync %s -> %s: the delta to version %d did not verify (%s); sending it in full",
                            pair.trainer, pair.rollout, version, cause)
                return {**self.start(version, full=True)(), "sync/delta_fallback": 1}
            self.synced = True
            stats, loads = dict(results[len(walkers)]), results[len(walkers) + 1:]
            stats.update({stat: max(load[stat] for load in loads)  # the slowest rollout rank
                          for stat in ("sync/wait_s", "sync/load_s", "sync/verify_s", "sync/decode_s")
                          if stat in loads[0]})
            if pair.delta:
                stats["sync/delta_fallback"] = 0
            return stats

        return wait

    def sync(self, version: int) -> dict:
        return self.start(version)()

    def close(self) -> None:
        if self.closer is not None:
            with suppress(Exception):
                self.closer.close()
        for worker in self.members:
            self.pair.backend.call(worker, SyncRank.close_pipe, self.name)
