"""The single controller's dispatcher: builds worker groups from the plan, sends a node to its ranks
and collects its output (which node runs when: `scheduler`; a node that failed: `recovery`).

The driver holds references only: a node's output stays with the workers (Ray object store) as
per-rank shards, and each consumer rank fetches the row ranges it needs (`reshard`).
"""

from __future__ import annotations

import gc
import time
from collections import Counter
from dataclasses import replace
from typing import Callable, Iterable

import networkx as nx
import numpy as np

from siirl_dag.errors import PipelineError
from siirl_dag.dataflow import SOURCE, SOURCE_KEYS
from siirl_dag.refs import import_ref
from siirl_dag.registry import STRATEGIES
from siirl_dag.runtime import machines
from siirl_dag.runtime.backends import BACKENDS
from siirl_dag.runtime.batch import Batch
from siirl_dag.runtime.recovery import Recovery
from siirl_dag.runtime.reshard import Shard, balanced_ranges, equal_ranges, split
from siirl_dag.runtime.scheduler import Scheduler
from siirl_dag.runtime.step import COMPUTE, Job, NodeOutput, Running, Span, StepResult
from siirl_dag.runtime.trace import Trace
from siirl_dag.runtime.worker import RankWorker, RoleSpec
from siirl_dag.strategies.base import RankContext
from siirl_dag.weight_sync.syncs import WeightSyncs
from siirl_dag.weight_sync.versions import WeightVersions

COMPUTE_WORKERS = 2  # single-threaded actors for compute nodes; independent ones run on different actors
# the collector's thresholds while steps run: a step makes and drops millions of objects at thousands of
# ranks, and Python's (700, 10, 10) would walk them in full every few thousand (a third of the driver's
# time at 4,096 simulated ranks, docs/BENCHMARKS.md); refcounting frees them, cycles wait a little longer
STEP_GC_THRESHOLD = (50_000, 20, 20)


class Runtime:
    def __init__(self, pipeline, address: str | None = None, progress=print, on_built=None, log_dir=None):
        """`on_built(runtime)` runs once the engines are built, before the start-up weight sync
        (a resume loads the checkpoint there, so the rollouts are synced once, to its weights).
        `log_dir`: the folder every rank process logs to, a file each (None: they print as they go)."""
        self.pipe, self.progress, self.on_built, self.log_dir = pipeline, progress, on_built, log_dir
        self._gc_threshold = gc.get_threshold()  # restored at shutdown (start raises it for the steps)
        self.backend = import_ref(BACKENDS[pipeline.runtime.backend])(pipeline, address, log_dir)
        self.workers: dict[str, list] = {}  # anchor mesh (or COMPUTE) -> workers by rank
        self.roles: dict[str, list[tuple]] = {}  # node id -> [(worker, RoleSpec)]
        self.order = list(pipeline.nodes)
        # each node's ancestors, nearest (latest in DAG order) first: the row space of a node that reads nothing,
        # the model whose tokenizer it falls back to (what it reads: `pipe.reads`)
        self.upstream = {n: [u for u in reversed(self.order) if u in nx.ancestors(pipeline.graph, n)] for n in self.order}
        self.recovery = Recovery(self)  # a failed node's retries, the restarts of a group whose process died
        self.said: set = set()  # (metric, node) collisions reported
        self.versions = WeightVersions.of(pipeline)  # the trainers' and, moved up by `weight_syncs`, their consumers'
        self.weight_syncs = WeightSyncs(self)
        self.routes = self.weight_syncs.routes
        self.trace = Trace() if pipeline.trainer.trace else None  # trainer.trace: the run's timeline

    # -- set-up ---------------------------------------------------------------------------------
    def __enter__(self) -> "Runtime":
        try:
            self.start()
        except BaseException:  # a start that failed half-way leaves no workers behind
            self.shutdown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def start(self) -> None:
        pipe, progress = self.pipe, self.progress
        self._check_local()
        self.backend.start()
        if pipe.cluster.nodes > 1 and getattr(self.backend, "machines", None):
            progress(f"[runtime] machines: {machines.describe(self.backend.machines)}")
        for name, mesh in pipe.plan.meshes.items():
            if mesh.colocated_with is None:
                self.workers[name] = self.create_group(name)
                self.init_group(self.workers[name])
        self.workers[COMPUTE] = self.create_group(COMPUTE)
        self.roles = {node.id: self._roles_of(node) for node in pipe.nodes.values()}
        t = time.perf_counter()
        busy = {id(w) for pairs in self.roles.values() for w, _ in pairs}
        progress(f"[runtime] {self.backend.name}: building engines on {len(busy)} worker(s) ...")
        try:
            self.add_roles([w for workers in self.workers.values() for w in workers])
        except Exception as exc:  # noqa: BLE001 - model loading failed on some rank
            cause = getattr(exc, "cause", None) or exc
            raise PipelineError(f"building the engines failed: {cause}") from None
        # the start-up's objects (the plan, every rank's roles and handles) out of the collector's reach: a
        # full collection in a step then walks what the steps made, not what grows with the rank count
        gc.collect()
        gc.freeze()
        gc.set_threshold(*STEP_GC_THRESHOLD)
        if self.on_built:
            self.on_built(self)
        # every consumer starts from its trainer's own weights (a rollout with load_format dummy has none)
        if self.versions.held:
            pairs = ", ".join(f"{dst} <- {src} v{self.versions.trainer[src]}" for dst, src in self.versions.source.items())
            progress(f"[runtime] syncing weights: {pairs} ...")
            took = self.sync_weights().get("timing_s/sync_weights", 0.0)
            progress(f"[runtime] weights synced in {took:.2f} s")
        progress(f"[runtime] ready in {time.perf_counter() - t:.1f} s")

    def create_group(self, group: str) -> list:
        """The workers of an anchor mesh (one per rank), or the pool of one-rank compute workers."""
        if group == COMPUTE:
            return [self.backend.create_worker(COMPUTE, 0, 1, None) for _ in range(self._compute_workers())]
        mesh = self.pipe.plan.meshes[group]
        world = mesh.dims.world_size
        return [self.backend.create_worker(group, r, world, mesh.ranks[r].device) for r in range(world)]

    def _compute_workers(self) -> int:
        """COMPUTE_WORKERS where two compute nodes can run at once (neither upstream of the other, or the
        batches of an overlapped schedule); else one: a process fewer to start, with nothing lost."""
        compute = [n.id for n in self.pipe.nodes.values() if not n.mesh]
        chained = all(a in self.upstream[b] or b in self.upstream[a] for i, a in enumerate(compute) for b in compute[i + 1:])
        return 1 if chained and self.pipe.runtime.schedule == "sync" else COMPUTE_WORKERS

    def init_group(self, workers: list) -> None:
        """One torch.distributed group over a mesh's workers, rendezvous at rank 0."""
        addr, port = self.backend.get(self.backend.call(workers[0], RankWorker.address))
        self.backend.get([self.backend.call(w, RankWorker.init_distributed, addr, port) for w in workers])

    def add_roles(self, workers: list) -> None:
        """Send each of `workers` its roles (in node order) and let it build its engines."""
        wanted, per_worker = {id(w) for w in workers}, {}
        for pairs in self.roles.values():
            for w, role in pairs:
                if id(w) in wanted:
                    per_worker.setdefault(id(w), (w, []))[1].append(role)
        self.backend.get([self.backend.call(w, RankWorker.add_roles, roles) for w, roles in per_worker.values()])

    def _check_local(self) -> None:
        if self.backend.name != "local":
            return
        for node in self.pipe.nodes.values():
            if node.mesh and self.pipe.plan.meshes[node.mesh].dims.world_size > 1:
                from siirl_dag.errors import ConfigError

                raise ConfigError(f"runtime.backend=local runs every rank in this process, but mesh '{node.mesh}' of "
                                  f"node '{node.id}' has several ranks; use runtime.backend=ray",
                                  ("runtime", "backend"))

    def _roles_of(self, node):
        pipe = self.pipe
        kind = pipe.kinds[node.id]
        tokenizer = self._tokenizer_for(node)
        if not node.mesh:
            role = RoleSpec(node, kind, None, None, None, pipe.data, tokenizer,
                            RankContext(0, seed=pipe.trainer.seed), 0, 1, True, pipe.samples_per_prompt(node.id))
            pool = self.workers[COMPUTE]
            return [(pool[node.index % len(pool)], role)]
        mesh = pipe.plan.meshes[node.mesh]
        dims = replace(mesh.dims, vpp=node.options.get("virtual_pipeline_model_parallel_size") or 1)
        key = f"{node.mesh}/{node.model}/{node.strategy}"
        out = []
        for slot in mesh.ranks:
            c = slot.coords
            output_rank = c.get("tp", 0) == 0 and c.get("cp", 0) == 0 and c.get("pp", 0) == dims.pp - 1
            ctx = RankContext(slot.rank, dims, pipe.cluster.device, slot.local_device, pipe.trainer.seed)
            role = RoleSpec(node, kind, key, STRATEGIES[node.strategy].engine, pipe.models[node.model], pipe.data, tokenizer,
                            ctx, c.get("dp", 0), dims.dp, output_rank, pipe.samples_per_prompt(node.id))
            out.append((self.workers[mesh.anchor][slot.rank], role))
        return out

    def _tokenizer_for(self, node):
        """The model whose tokenizer decodes what a node reads: the writer of the responses it reads
        (a judge's or a second agent's are another model's); else its own; else its nearest upstream model's."""
        writer = self.pipe.reads[node.id].get("responses", (SOURCE,))[0]
        model = (self.pipe.nodes[writer].model if writer != SOURCE else None) or node.model or \
            next((self.pipe.nodes[up].model for up in self.upstream[node.id] if self.pipe.nodes[up].model), None)
        return self.pipe.models[model] if model else None

    # -- one step -------------------------------------------------------------------------------
    def run_step(self, source: Batch, step: int, validating: bool = False, nodes: Iterable[str] | None = None) -> StepResult:
        """Run the DAG (or the sub-graph `nodes`) on one batch of prompts, for `step` (`runtime.step`)."""
        return self.run_jobs([Job(source, step, nodes)], validating)[0]

    def run_jobs(self, jobs: list[Job], validating: bool = False) -> list[StepResult]:
        """Run several batches through their parts of the DAG at once (`scheduler.Scheduler`), until all finish."""
        return Scheduler(self, validating).run(jobs)

    def group_of(self, node_id: str) -> str:
        mesh = self.pipe.nodes[node_id].mesh
        return self.pipe.plan.meshes[mesh].anchor if mesh else COMPUTE

    def dispatch(self, node_id: str, result: StepResult, job: Job, validating: bool, job_id: int = 0) -> Running:
        """Send `node_id` to its ranks, each with its rows of the outputs it reads from `result`."""
        pipe, outputs, step, segment_tokens = self.pipe, result.outputs, job.step, job.segment_tokens
        resuming = node_id in outputs  # a partial rollout's next segment: its own output in, to continue
        # per output read: (its key, the key as this node sees it)
        owners: dict[str, list[tuple[str, str]]] = {node_id: [(k, k) for k in sorted(outputs[node_id].keys)]} \
            if resuming else {}
        for key, (owner, name) in ({} if resuming else pipe.reads[node_id]).items():  # decided at load (dataflow)
            if owner not in outputs:  # its producer did not run in this job: the job's source holds the rows
                owner = SOURCE  # (the second phase of dynamic sampling gets the kept rows as its source)
            if name in outputs[owner].keys:
                owners.setdefault(owner, []).append((name, key))
            elif name not in SOURCE_KEYS:  # else an optional data column (extra_info, say) absent from this data set
                raise KeyError(f"no output holds '{name}' for node '{node_id}'")
        if not owners:  # consumes nothing: sees the row space of its nearest upstream output
            owners[self._owner_of_rows(node_id, outputs)] = []
        space = outputs[next(iter(owners))]
        roles = self.roles[node_id]
        dp = roles[0][1].dp_size
        trains = pipe.kinds[node_id].trains
        ranges = equal_ranges(space.rows, dp) if trains else balanced_ranges(space.tokens, dp)
        # seeded per data-parallel rank: the ranks of one tensor-parallel engine must draw the same samples;
        # by the steps trained before the job, so that a seed draws what it drew before steps were
        # numbered from 1 everywhere (`runtime.step`); and by the job's part, so that each round of dynamic
        # sampling (and each segment) draws afresh rather than the same noise again
        trained = step if validating else step - 1
        seed_base = (pipe.trainer.seed * 1_000_003 + trained * 1_009 + pipe.nodes[node_id].index * 97
                     + job.part * 104_729) % (2**31)
        src = pipe.nodes[node_id].weights_from
        min_version = max(0, self.versions.trainer[src] - pipe.runtime.staleness) if src else 0
        plans = {u: split(outputs[u].shards, ranges) for u in owners}  # per data-parallel rank, its pieces
        args = []  # per data-parallel rank: inputs (indexing the shards), then the shards as top-level arguments
        for dp_rank in range(dp):
            refs, inputs = [], []
            for u, keys in owners.items():
                parts = plans[u][dp_rank]
                inputs.append((keys, [(len(refs) + i, a, b) for i, (_, a, b) in enumerate(parts)]))
                refs += [ref for ref, _, _ in parts]
            args.append((inputs, refs))
        calls, ranks = [], []  # per rank: (its output's reference, its info's); an output rank's alone returns both
        for worker, role in roles:
            inputs, refs = args[role.dp_rank]
            call = self.backend.call(worker, RankWorker.run, node_id, inputs, step, validating,
                                     (seed_base + role.dp_rank) % (2**31), min_version, segment_tokens, resuming,
                                     *refs, num_returns=2 if role.output_rank else 1)
            calls.append(tuple(call) if role.output_rank else (None, call))
            ranks.append((role.dp_rank, role.output_rank))
        remaining = [] if self.backend.immediate else [c[1] for c in calls]
        return Running(node_id, calls, ranks, time.perf_counter(), job=job_id, remaining=remaining)

    def _owner_of_rows(self, node_id: str, outputs: dict) -> str:
        return next((up for up in self.upstream[node_id] if up in outputs and outputs[up].rows), SOURCE)

    def finish(self, run: Running, result: StepResult, job: Job, validating: bool, others: list[Running]) -> Running | None:
        """Collect a node's output into `result`; a failed node is re-dispatched (the new run returned)
        while its retries last. `others`: the other nodes running now (a restart waits for their updates)."""
        step = job.step
        try:
            infos = self.backend.get([c[1] for c in run.calls])
        except Exception as exc:  # noqa: BLE001 - a node failure, a dead actor, or a lost object
            return self.recovery.retry_or_raise(run, exc, result, job, validating, others)
        end = time.perf_counter()
        by_dp = sorted(((dp, self.backend.output(call[0]), info)
                        for (dp, is_out), call, info in zip(run.ranks, run.calls, infos) if is_out), key=lambda x: x[0])
        if self.trace is not None:  # a span per rank, on the rank's own clock
            for rank, ((dp, _), info) in enumerate(zip(run.ranks, infos)):
                self.trace.span(self.group_of(run.node), f"rank {rank}", run.node, *info["span"], step=step, dp_rank=dp,
                                rows=info["rows"], validating=validating,
                                weights_version=self.versions.trainer.get(run.node, info["weights_version"]))
        mesh = self.pipe.nodes[run.node].mesh
        if mesh and not validating:  # the mesh's fullest rank in this step (the plan's estimate is printed at start)
            key = f"memory/{mesh}/peak_gb"
            result.metrics[key] = max([result.metrics.get(key, 0.0)] + [info["peak_gb"] for info in infos])
        shards, tokens, start, keys, versions = [], [np.zeros(0, dtype=np.int64)], 0, set(), Counter()
        for _, wire, info in by_dp:
            shards.append(Shard(wire, start, start + info["rows"]))
            start += info["rows"]
            tokens.append(info["tokens"])
            keys |= set(info["keys"])
            versions.update({(a, b): n for a, b, n in info["versions"]})
        result.outputs[run.node] = NodeOutput(shards, keys, start, np.concatenate(tokens),
                                              [(a, b, n) for (a, b), n in sorted(versions.items())])
        if run.node in self.versions.trainer and not validating:
            self.versions.trainer[run.node] += 1
        self._add_metrics(result, run.node, by_dp[0][2]["metrics"] if by_dp else {})
        result.metrics[f"timing_s/{run.node}"] = end - run.started
        result.spans.append(Span(run.node, step, job.part, run.started, end))
        return None

    def _add_metrics(self, result: StepResult, node: str, metrics: dict) -> None:
        """A node's metrics into its step's, under its policy's prefix when several train (dataflow);
        a name another node of the step wrote already with another value is kept under `<node>/` as
        well, never lost (the same value twice, response lengths seen by two nodes say, is one)."""
        prefix = self.pipe.metric_prefix(node)
        for name, value in metrics.items():
            key = prefix + name
            writer = result.writers.setdefault(key, node)
            if writer != node and result.metrics.get(key) == value:
                continue
            if writer != node:
                if (key, node) not in self.said:
                    self.said.add((key, node))
                    self.progress(f"[metrics] '{key}' is written by '{writer}' and '{node}'; '{node}'s is logged as "
                                  f"'{prefix}{node}/{name}'")
                key = f"{prefix}{node}/{name}"
            result.metrics[key] = value

    def sync_weights(self, step: int = 0) -> dict:
        """Every `weights_from` consumer up to its trainer's latest version (`weight_sync.syncs.WeightSyncs.run`)."""
        return self.weight_syncs.run(step)

    def start_sync(self, step: int = 0):
        """`sync_weights` started, its wait returned (`weight_sync.syncs.WeightSyncs.start`): nodes dispatched
        before the wait run on their ranks after the sync's parts."""
        return self.weight_syncs.start(step)

    # -- results and teardown -------------------------------------------------------------------
    def collect(self, result: StepResult, keys: Iterable[str], rows: int | None = None) -> Batch:
        """Bring named keys of a finished step to the driver, each from the latest output holding it
        (with `rows`: the latest in that row space)."""
        batch = None
        for key in keys:
            owner = next(n for n in reversed([SOURCE] + self.order) if n in result.outputs and key in result.outputs[n].keys
                         and rows in (None, result.outputs[n].rows))
            part = self.gather(result.outputs[owner], [key])
            batch = part if batch is None else batch.merge(part)
        return batch if batch is not None else Batch()

    def gather(self, output: NodeOutput, keys: Iterable[str] | None = None) -> Batch:
        """Bring a node's output to the driver (validation scores, tests); not used on the hot path."""
        parts = [Batch.from_wire(self.backend.fetch(s.ref)) for s in output.shards]
        batch = Batch.concat(parts)
        return batch.only(keys) if keys is not None else batch

    def engine_call(self, node_id: str, method: Callable, *args) -> list:
        """A RankWorker method that takes the engine key first (`RankWorker.save_checkpoint`, ...) on
        every rank of a node, for that node's engine."""
        return self.backend.get([self.backend.call(w, method, role.engine_key, *args) for w, role in self.roles[node_id]])

    def shutdown(self) -> None:
        """Close every engine (a worker still busy, after Ctrl-C say, gets `runtime.stop_grace_s`, and
        the user is told so), then kill all workers."""
        grace_s = self.pipe.runtime.stop_grace_s
        try:
            calls = [self.backend.call(w, RankWorker.shutdown) for workers in self.workers.values() for w in workers]
            deadline = time.perf_counter() + grace_s
            # closing an engine takes 1-2 s at a normal end
            busy = self._unfinished(calls, time.perf_counter() + min(grace_s, 5.0))
            if busy:
                self.progress(f"[runtime] stopping: {len(busy)} worker(s) still busy, given {grace_s:.0f} s to "
                              "close their engines before they are killed ...")
                self._unfinished(busy, deadline)
        finally:
            self.workers.clear()
            self.backend.shutdown()
            gc.unfreeze()  # what start froze is the collector's again (a process may start another runtime)
            gc.set_threshold(*self._gc_threshold)

    def _unfinished(self, calls: list, deadline: float) -> list:
        """The calls still running at `deadline` (one that failed is finished: dead, or stuck, the
        backend kills it next)."""
        running = []
        for call in calls:
            try:
                self.backend.get(call, timeout=max(deadline - time.perf_counter(), 0.01))
            except TimeoutError:  # Ray's GetTimeoutError is one
                running.append(call)
            except Exception:  # noqa: BLE001
                pass
        return running
