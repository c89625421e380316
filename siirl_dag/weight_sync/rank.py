"""The rank's side of the weight flow: the calls a `SyncPath` and the driver's `WeightSyncs` make on a
rank (`backend.call(worker, SyncRank.send_weights, ...)`), mixed into `runtime.worker.RankWorker`.
`stream` holds the logic; the engines are called through `strategies.engines`' protocols.
"""

from __future__ import annotations

import socket
from contextlib import suppress
from typing import Any, Callable

from siirl_dag.strategies.engines import Engine, RolloutEngine, TrainerEngine
from siirl_dag.weight_sync import stream
from siirl_dag.weight_sync.delta import DeltaPipe


class SyncRank:
    """Needs of its host: `engines` by key, `pipes` by name, `active` (the engine on the device) and
    `_activate(key)` (put that engine on the device)."""

    engines: dict[str, Any]
    pipes: dict[str, Any]
    active: str | None

    def _activate(self, key: str | None) -> None:
        raise NotImplementedError

    def _trainer(self, key: str) -> TrainerEngine:
        self._activate(key)
        return self.engines[key]

    def _rollout(self, key: str) -> RolloutEngine:
        self._activate(key)
        return self.engines[key]

    # -- set-up of a pipe -----------------------------------------------------------------------
    def address(self) -> tuple[str, int]:
        """This host's address and a free port, for rank 0 to host a process-group rendezvous (a mesh's,
        or a weight-sync group's). Ray's node address, reachable from the cluster's other machines (a
        host name may resolve to a loopback address there); one process without Ray rendezvouses with itself."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return (ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"), port

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def open_pipe(self, name: str, make: Callable[[], Any], delta: bool = False) -> Any:
        """Make a pipe here (`make` runs on this rank) and keep it under `name` from sync to sync, with
        the bytes of what it carried if `delta` (`delta.DeltaPipe`). Returns it if other members may
        hold it too (a shared-memory channel, for its readers)."""
        pipe = make()
        self.pipes[name] = DeltaPipe(pipe) if delta else pipe
        return pipe if getattr(pipe, "shared", False) else None

    def close_pipe(self, name: str) -> None:
        """The pipe failed a sync or its pair was replaced: free this end (buffers, a group's sockets)."""
        pipe = self.pipes.pop(name, None)
        if pipe is not None:
            with suppress(Exception):  # a channel the driver closed already
                pipe.close()

    # -- one sync -------------------------------------------------------------------------------
    def send_weights(self, engine_key: str, pipe: str, bucket_bytes: int, verify: bool, payload: str, version: int,
                     full: bool = False) -> dict:
        """The trainer's rank 0: its export (the model, or its adapters) into the pipe, bucket by bucket
        (fingerprinted if `verify`); through a delta pipe as deltas against the version before, unless `full`."""
        end = self.pipes[pipe]
        if not isinstance(end, DeltaPipe):
            return stream.send(self._trainer(engine_key), end, bucket_bytes, verify, payload)
        sending = end.sending(version, full)
        stats = stream.send(self._trainer(engine_key), sending, bucket_bytes, verify, payload)
        stats["sync/send_s"] -= sending.stats["sync/encode_s"]
        return {**stats, **sending.stats}

    def walk_export(self, engine_key: str, payload: str) -> None:
        """The other trainer ranks: take part in the export's collectives."""
        stream.walk(self._trainer(engine_key), payload)

    def receive_weights(self, engine_key: str, version: int, pipe: str, verify: bool, payload: str) -> dict:
        """A rollout rank: the pipe's buckets into one load of its engine, checked if `verify`, stamped
        `version`; deltas applied on a delta pipe."""
        end = self.pipes[pipe]
        if not isinstance(end, DeltaPipe):
            return stream.receive(self._rollout(engine_key), end, version, verify, payload)
        receiving = end.receiving(version)
        stats = stream.receive(self._rollout(engine_key), receiving, version, verify, payload)
        stats["sync/wait_s"] -= receiving.stats["sync/decode_s"]
        return {**stats, **receiving.stats}

    def handoff_weights(self, src_key: str, dst_key: str, version: int, payload: str) -> dict:
        """Colocated: wake the rollout engine beside the trainer's (a third engine of this rank gives
        the device up first), load it from the trainer in memory, then free the trainer."""
        if self.active not in (None, src_key, dst_key):
            self.engines[self.active].offload()
        # the trainer's cached activations go back before the rollout wakes beside them: both at once is the
        # likely cause of the H200 gpu1 run's device peak, 11 GiB above the memory plan's figure
        if dst_key != self.active:
            free_allocator_cache()
        for key in (src_key, dst_key):
            if key != self.active:
                self.engines[key].onload()
        src: TrainerEngine = self.engines[src_key]
        stats = stream.handoff(src, self.engines[dst_key], version, payload)
        src.offload()
        self.active = dst_key
        return stats

    def probe_logprobs(self, engine_key: str, batch: dict) -> Any:
        """The engine's log-probs of a fixed batch (`weight_sync.probe`: verified sync's probe)."""
        engine: Engine = self.engines[engine_key]
        self._activate(engine_key)
        return engine.probe_logprobs(batch)


def free_allocator_cache() -> None:
    """Give back what this process's CUDA allocator caches and no tensor holds (a trainer's last activations)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
