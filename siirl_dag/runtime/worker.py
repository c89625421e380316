"""One rank process: holds the roles (node kinds + strategy engines) placed on its device.

The same class runs in-process (runtime.backend=local) and as a Ray actor (ray). Colocated meshes
share the process of each rank, so one device holds several roles, as verl's hybrid engine does;
nodes bound to the same mesh and model share one engine (old log-probs come from the actor itself).
"""

from __future__ import annotations

import gc
import os
import resource
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any

from siirl_dag import console
from siirl_dag.errors import NodeFailure
from siirl_dag.refs import import_ref
from siirl_dag.runtime import fan_out, host_malloc
from siirl_dag.runtime.batch import Batch, row_tokens, version_counts
from siirl_dag.runtime.context import NodeContext
from siirl_dag.strategies.base import RankContext
from siirl_dag.strategies.engines import TrainerEngine
from siirl_dag.weight_sync.rank import SyncRank


@dataclass(frozen=True)
class RoleSpec:
    """Everything a rank needs to run one node (picklable; sent once at set-up)."""

    node: Any  # NodeSpec
    kind: Any  # NodeKind
    engine_key: str | None  # "<mesh>/<model>/<strategy>", shared by nodes on the same engine
    strategy_ref: str | None  # "module:Class" of the engine, resolved by the driver from the registry
    model: Any  # ModelSpec or None
    data: Any  # DataSpec
    tokenizer_model: Any  # ModelSpec (its tokenizer) or None
    rank_ctx: RankContext
    dp_rank: int
    dp_size: int
    output_rank: bool  # this rank's outputs stand for its data-parallel group
    samples_per_prompt: int = 1


class NodeError(RuntimeError):
    """A node raised on a rank; carries where and the remote traceback."""

    def __init__(self, node: str, rank: int, host: str, detail: str):
        self.node, self.rank, self.host, self.detail = node, rank, host, detail
        super().__init__(f"node '{node}' failed on rank {rank} ({host}):\n{detail}")

    def __reduce__(self):  # crosses process boundaries (Ray) intact
        return NodeError, (self.node, self.rank, self.host, self.detail)


class RankWorker(SyncRank):
    """The weight flow's calls (`address`, `open_pipe`, `send_weights`, ...) are `SyncRank`'s."""

    def __init__(self, group: str, rank: int, world_size: int, device: str = "cpu", threads: int = 1,
                 log_dir: str | None = None, own_process: bool = False):
        """`log_dir`: the run's log folder; a rank process (not the driver, quiet already) logs to a
        file of its own there, whose last lines go with its errors. `own_process`: the worker is its
        process's only tenant (a Ray actor), so what its engines build lives as long as the process."""
        self.group, self.rank, self.world_size, self.device = group, rank, world_size, device
        self.own_process = own_process
        self.log_file = None
        console.log_format()
        if log_dir:
            self.log_file = os.path.join(log_dir, "driver.log")
            if not console.quieted():
                self.log_file = os.path.join(log_dir, f"{group.strip('_')}-rank{rank}-{os.getpid()}.log")
                console.redirect(self.log_file)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        if own_process and device == "cpu":
            host_malloc.keep_freed_memory()
        import torch

        torch.set_num_threads(threads)
        self.roles: dict[str, RoleSpec] = {}
        self.engines: dict[str, Any] = {}
        self.active: str | None = None  # the engine that holds the device now (hybrid engine)
        self.pipes: dict[str, Any] = {}  # weight-sync pipes by name (SyncRank.open_pipe)

    # -- set-up ---------------------------------------------------------------------------------
    def init_distributed(self, master_addr: str, master_port: int) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            return
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world_size), LOCAL_RANK="0")
        dist.init_process_group("nccl" if self.device == "cuda" else "gloo", rank=self.rank, world_size=self.world_size)

    def add_roles(self, roles: list[RoleSpec]) -> list[str]:
        """Register roles and build their engines (model loading happens here, once)."""
        for role in roles:
            self.roles[role.node.id] = role
        for role in roles:
            if role.engine_key and role.engine_key not in self.engines:
                try:
                    cls = import_ref(role.strategy_ref)
                    # nodes sharing an engine carry one merged set of options (config.loader)
                    self.engines[role.engine_key] = cls(role.rank_ctx, role.model, dict(role.node.options))
                except Exception:  # noqa: BLE001 - say which engine on which rank, with the traceback
                    raise NodeError(f"{role.node.id} (building engine {role.engine_key})", self.rank,
                                    socket.gethostname(), self._with_log(traceback.format_exc())) from None
        if self.own_process:  # the engines' start-up objects out of the collector's reach: a full
            gc.collect()      # collection in a step walks what the steps made, not every module of the engines
            gc.freeze()
        return sorted(self.engines)

    # -- work -----------------------------------------------------------------------------------
    def run(self, node_id: str, inputs: list, step: int, validating: bool, seed: int, min_weights_version: int,
            segment_tokens: int | None, resuming: bool, *shards):
        """Assemble this rank's input from shard pieces, run the node, return (wire, info) on an output
        rank and info alone on the others (an object fewer to make, send and count). The shards come as
        top-level arguments, so Ray fetches them before the call (and no reference is borrowed); those a
        leader's round returned (`fan_out.Held`: a compute node reading a large mesh's) it brings here."""
        role, began = self.roles[node_id], time.time()
        try:
            self._activate(role.engine_key)
            batch = _assemble(inputs, fan_out.values(shards))
            ctx = NodeContext(node=role.node, batch=batch, engine=self.engines.get(role.engine_key), data=role.data,
                              tokenizer_model=role.tokenizer_model, step=step, validating=validating, rank=self.rank,
                              dp_rank=role.dp_rank, dp_size=role.dp_size, seed=seed,
                              samples_per_prompt=role.samples_per_prompt, min_weights_version=min_weights_version,
                              segment_tokens=segment_tokens, resuming=resuming)
            out = role.kind.fn(batch, ctx) or {}
            result = _checked(role, batch, out)
        except NodeFailure as exc:  # its message tells it: the engine's traceback and log would only hide it
            where = f"\n(the rank's log: {self.log_file})" if self.log_file else ""
            raise NodeError(node_id, self.rank, socket.gethostname(), f"{exc}{where}") from None
        except Exception:  # noqa: BLE001 - report any failure of user code with where it happened
            raise NodeError(node_id, self.rank, socket.gethostname(), self._with_log(traceback.format_exc())) from None
        info = {"rows": result.num_rows, "keys": sorted(result), "metrics": ctx.metrics,
                "tokens": row_tokens(result) if role.output_rank else None, "output_rank": role.output_rank,
                "versions": version_counts(result) if role.output_rank else [],
                "span": (began, time.time()), "weights_version": getattr(ctx.engine, "weights_version", None),
                "peak_gb": _peak_gb()}
        return (result.to_wire(), info) if role.output_rank else info

    def _with_log(self, detail: str) -> str:
        """An error's traceback, with the last lines this rank logged before it (when it logs to a file)."""
        lines = console.tail(self.log_file) if self.log_file else ""
        return f"{detail}\nthe last lines of its log ({self.log_file}):\n{lines}" if lines else detail

    def _activate(self, key: str | None) -> None:
        """Colocated roles take turns on the device: offload the engine that held it, onload this one."""
        if key is None or key == self.active or len(self.engines) < 2:
            return
        if self.active is not None:
            self.engines[self.active].offload()
        self.engines[key].onload()
        self.active = key

    # -- checkpoints and export (trainer/loop.py, through Runtime.engine_call) ----------------------
    def save_checkpoint(self, engine_key: str, folder: str) -> None:
        engine: TrainerEngine = self.engines[engine_key]
        engine.save_checkpoint(folder)

    def load_checkpoint(self, engine_key: str, folder: str) -> None:
        engine: TrainerEngine = self.engines[engine_key]
        engine.load_checkpoint(folder)

    def save_adapters(self, engine_key: str, folder: str) -> None:
        engine: TrainerEngine = self.engines[engine_key]
        engine.save_adapters(folder)

    def save_hf(self, engine_key: str, folder: str) -> None:
        engine: TrainerEngine = self.engines[engine_key]
        engine.save_hf(folder)

    def pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        for engine in self.engines.values():
            engine.close()
        self.engines.clear()


def _assemble(inputs: list, shards: tuple) -> Batch:
    """inputs: [([(key there, key here), ...], [(shard index, lo, hi), ...]), ...] -> one Batch with all
    keys, each under the name this node reads it by (a binding may rename it)."""
    batch = None
    for names, pieces in inputs:
        parts = [Batch.from_wire(shards[i], [there for there, _ in names], lo, hi) for i, lo, hi in pieces]
        part = (Batch.concat(parts) if parts else Batch()).renamed(names)
        batch = part if batch is None else batch.merge(part)
    return batch if batch is not None else Batch()


def _checked(role: RoleSpec, batch: Batch, out) -> Batch:
    """The node must return exactly what its kind declares (input keys may be re-emitted when it expands rows)."""
    out = out if isinstance(out, Batch) else Batch.from_dict(out)
    declared = set(role.kind.produced(role.node.params))
    missing = declared - set(out)
    extra = set(out) - declared - set(batch)
    if missing or extra:
        parts = ([f"did not return declared key(s) {sorted(missing)}"] if missing else []) + \
                ([f"returned undeclared key(s) {sorted(extra)}"] if extra else [])
        raise ValueError(f"node '{role.node.id}' (kind {role.kind.name}) " + " and ".join(parts) +
                         f"; its kind declares {sorted(declared)}")
    if out.num_rows not in (batch.num_rows, 0) and not (role.kind.expands and set(out) & set(batch)):
        raise ValueError(f"node '{role.node.id}' returned {out.num_rows} rows for {batch.num_rows} input rows; "
                         "a node that changes the row count must declare expands=True and re-emit its input keys "
                         "(ctx.expand): later nodes read them from it (dataflow)")
    return out


def _peak_gb() -> float:
    """This rank's peak memory in GiB: on a GPU the allocator's since the last reading (then reset, so
    each node reads its own); on CPU the process's peak resident set since it started (no finer one)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        return peak / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
