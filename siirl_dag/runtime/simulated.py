"""runtime.backend=simulated: the driver alone, over as many ranks as the pipeline places, with no
process, model or device behind them. A worker is a handle (`SimulatedRank`); a call finishes when
made, answering what the real rank would in shape: a node's rows (a rollout's times its n), the keys
its kind declares, the weights version of the engine it ran on; a sync stamps the rollout engines.
So the real dispatcher, scheduler, re-sharding, weight-sync paths and trainer run unchanged, and what
the driver spends per step at thousands of ranks can be measured (scripts/bench_control_plane.py).

What a node computed is not simulated: its output is a `SimulatedShard`, made into zeros of the
batch layout's shapes only where the driver reads it (`SimulatedBackend.fetch`: a staleness check,
validation), its metrics are none and its time is nil.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from siirl_dag.dataflow import SOURCE_KEYS, expansion
from siirl_dag.runtime.backends import LocalBackend, _Done
from siirl_dag.runtime.batch import Batch
from siirl_dag.runtime.fan_out import FanOut
from siirl_dag.runtime.worker import NodeError, RankWorker, RoleSpec

META_KEYS = (*SOURCE_KEYS, "finish_reason")  # per-row lists, not tensors
ROW_KEYS = ("weights_version", "keep")  # one number per row; every other tensor is [rows, response length]


@dataclass(frozen=True)
class SimulatedShard:
    """One rank's part of a node's output, described: what `Batch.from_wire` would find in a real one."""

    keys: tuple[str, ...]
    rows: int
    weights_version: int
    response_length: int

    def to_wire(self) -> dict:
        """The shard as zeros of the batch layout's shapes, its samples stamped with their weights version."""
        tensors = {}
        for key in self.keys:
            if key in META_KEYS:
                continue
            shape = (self.rows,) if key in ROW_KEYS else (self.rows, self.response_length)
            fill = 1 if key == "keep" else self.weights_version if "weights_version" in key else 0
            tensors[key] = torch.full(shape, fill, dtype=torch.long if fill or key in ROW_KEYS else torch.float32)
        meta = {key: ["stop" if key == "finish_reason" else ""] * self.rows for key in self.keys if key in META_KEYS}
        return Batch(tensors, meta).to_wire()


class SimulatedRank:
    """A rank's handle: its roles, and the weights version of each engine a sync has loaded."""

    def __init__(self, group: str, rank: int, pipeline):
        self.group, self.rank, self.pipe = group, rank, pipeline
        self.roles: dict[str, RoleSpec] = {}
        self.versions: dict[str, int] = {}  # engine key -> the version of the weights it holds

    def add_roles(self, roles: list[RoleSpec]) -> list[str]:
        self.roles.update((role.node.id, role) for role in roles)
        return sorted({role.engine_key for role in self.roles.values() if role.engine_key})

    def run(self, node_id: str, inputs: list, step: int, validating: bool, seed: int, min_weights_version: int,
            segment_tokens: int | None, resuming: bool, *shards):
        role, now = self.roles[node_id], time.time()
        version = self.versions.get(role.engine_key)
        if version is not None and version < min_weights_version:  # as `NodeContext.check_weights_version`
            raise NodeError(node_id, self.rank, "simulated", f"weights version {version} is older than {min_weights_version}")
        rows = sum(hi - lo for _, pieces in inputs[:1] for _, lo, hi in pieces)
        if not resuming:
            rows *= expansion(self.pipe, node_id)
        keys = tuple(sorted(set(role.kind.produced(role.node.params)) | {k for names, _ in inputs for _, k in names}
                            if role.kind.expands else role.kind.produced(role.node.params)))
        rows = rows if keys else 0  # a batch's rows are its keys' (an update returns metrics alone)
        data = self.pipe.data
        per_row = data.max_prompt_length + data.max_response_length if "attention_mask" in keys else \
            data.max_response_length if "response_mask" in keys else 1
        tokens = np.full(rows, per_row, dtype=np.int64)
        stamped = role.output_rank and rows and "weights_version" in keys
        info = {"rows": rows, "keys": list(keys), "metrics": {}, "tokens": tokens if role.output_rank else None,
                "output_rank": role.output_rank, "span": (now, now), "weights_version": version, "peak_gb": 0.0,
                "versions": [(version or 0, version or 0, rows)] if stamped else []}
        return (SimulatedShard(keys, rows, version or 0, data.max_response_length), info) if role.output_rank else info

    def open_pipe(self, name: str, make, delta: bool = False) -> "SimulatedPipe":
        return SimulatedPipe()  # `make` would build a real channel or group: not here

    def send_weights(self, engine_key: str, pipe: str, bucket_bytes: int, verify: bool, payload: str, version: int,
                     full: bool = False) -> dict:
        return {}

    def receive_weights(self, engine_key: str, version: int, pipe: str, verify: bool, payload: str) -> dict:
        self.versions[engine_key] = version
        return {"sync/wait_s": 0.0, "sync/load_s": 0.0, "sync/verify_s": 0.0}

    def handoff_weights(self, src_key: str, dst_key: str, version: int, payload: str) -> dict:
        self.versions[dst_key] = version
        return {}

    def probe_logprobs(self, engine_key: str, batch: dict) -> torch.Tensor:
        return torch.zeros(batch["responses"].shape, dtype=torch.float32)

    def address(self) -> tuple[str, int]:
        return "127.0.0.1", 0

    def node_id(self) -> str:
        return "simulated"

    def nothing(self, *args) -> None:
        """A call with no answer here: set-up of a group, closing, checkpoints (their files are not written)."""


class SimulatedPipe:
    """A pipe no bytes go through (a shared-memory channel's readers are handed `reader`)."""

    reader = None

    def close(self) -> None:
        pass


# RankWorker's method -> the handle's answer: every call the driver makes, typed; a new one fails loudly here
ANSWERS = {
    RankWorker.add_roles: SimulatedRank.add_roles,
    RankWorker.run: SimulatedRank.run,
    RankWorker.open_pipe: SimulatedRank.open_pipe,
    RankWorker.send_weights: SimulatedRank.send_weights,
    RankWorker.receive_weights: SimulatedRank.receive_weights,
    RankWorker.handoff_weights: SimulatedRank.handoff_weights,
    RankWorker.probe_logprobs: SimulatedRank.probe_logprobs,
    RankWorker.address: SimulatedRank.address,
    RankWorker.node_id: SimulatedRank.node_id,
    RankWorker.init_distributed: SimulatedRank.nothing,
    RankWorker.walk_export: SimulatedRank.nothing,
    RankWorker.close_pipe: SimulatedRank.nothing,
    RankWorker.shutdown: SimulatedRank.nothing,
    RankWorker.save_checkpoint: SimulatedRank.nothing,
    RankWorker.load_checkpoint: SimulatedRank.nothing,
    RankWorker.save_adapters: SimulatedRank.nothing,
    RankWorker.save_hf: SimulatedRank.nothing,
}


class SimulatedBackend(LocalBackend):
    """Handles for workers; counts what a Ray driver would call: `direct` calls to ranks and compute
    workers, `rounds` of a block's calls sent to its leader (runtime.fan_out, `fan_out.FanOut`), the
    `fanned` calls those rounds hold and how many of them return a shard's reference as well
    (`fanned_shards`), the largest round (`round_max`); and the CPU seconds the handles took to answer
    (`answer_s`: the ranks' share, not the driver's). Its calls return references the driver waits for
    and keeps, as Ray's do, so the driver takes Ray's paths."""

    name = "simulated"
    immediate = False

    def __init__(self, pipeline, address: str | None = None, log_dir=None):
        super().__init__(pipeline, address, log_dir)
        self.direct, self.rounds, self.fanned, self.fanned_shards, self.round_max, self.answer_s = 0, 0, 0, 0, 0, 0.0
        self.fan = FanOut(pipeline.runtime.fan_out, lambda workers, device: None, self._round, get=None)

    @property
    def calls(self) -> int:
        """The calls the driver makes: one per direct call, one per round."""
        return self.direct + self.rounds

    def create_worker(self, group: str, rank: int, world: int, device: int | None) -> SimulatedRank:
        worker = SimulatedRank(group, rank, self.pipeline)
        self.fan.add(worker, group, rank, world, device)
        return worker

    def _round(self, leader, number: int, calls: list) -> None:
        self.rounds += 1
        self.round_max = max(self.round_max, len(calls))

    def call(self, worker, method, *args, num_returns: int = 1, **kwargs):
        if self.fan.fanned(worker):
            self.fan.call(worker, method.__name__, (), {}, num_returns)  # counted in its round; answered here
            self.fanned += 1
            self.fanned_shards += num_returns > 1
        else:
            self.direct += 1
        t = time.process_time()
        try:
            return super().call(worker, ANSWERS[method], *args, num_returns=num_returns, **kwargs)
        finally:
            self.answer_s += time.process_time() - t

    def get(self, done, timeout: float | None = None):
        self.fan.flush()  # where a Ray driver sends its rounds
        return super().get(done, timeout)

    def wait(self, pending: list, timeout: float | None = None) -> list:
        self.fan.flush()
        return super().wait(pending, timeout)

    def fetch(self, ref):
        value = self.get(ref) if isinstance(ref, _Done) else ref
        return value.to_wire() if isinstance(value, SimulatedShard) else value
