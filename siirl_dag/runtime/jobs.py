"""Batches in flight through parts of the DAG: `Jobs` takes new ones at any time and hands back each
as it finishes, so a caller can keep a rollout generating ahead while another batch trains
(runtime.schedule one_step_off and async). Every node whose inputs are ready and whose mesh is free
is dispatched at once; a mesh runs one node at a time, the earlier job's first.
"""

from __future__ import annotations

import itertools

from siirl_dag.runtime.batch import row_tokens
from siirl_dag.runtime.driver import COMPUTE, SOURCE, Job, NodeOutput, StepResult
from siirl_dag.runtime.reshard import Shard


class Jobs:
    def __init__(self, runtime, validating: bool = False):
        self.rt, self.validating = runtime, validating
        self._ids = itertools.count()
        self.jobs: dict[int, Job] = {}
        self.results: dict[int, StepResult] = {}
        self.wanted: dict[int, set] = {}
        self.pending: list[tuple[int, str]] = []  # (job id, node) in submission, then DAG, order
        self.running: dict = {}  # (job id, node) -> driver._Running
        self.busy: set = set()  # the anchor meshes running a node now

    def submit(self, job: Job) -> int:
        """Queue `job`'s nodes; returns its id, which `wait` hands back with its result."""
        i = next(self._ids)
        result = StepResult(outputs=dict(job.given.outputs) if job.given else {})
        if job.source is not None:  # the prompts are small: they travel inside the tasks that read them
            result.outputs[SOURCE] = NodeOutput([Shard(job.source.to_wire(), 0, job.source.num_rows)],
                                                set(job.source), job.source.num_rows, row_tokens(job.source))
        self.jobs[i], self.results[i] = job, result
        self.wanted[i] = set(self.rt.order) if job.nodes is None else set(job.nodes)
        self.pending += [(i, n) for n in self.rt.order if n in self.wanted[i]]
        return i

    def idle(self) -> bool:
        return not self.jobs

    def started(self) -> dict[str, float]:
        """The nodes running now and when each started (perf_counter): the busy time of unfinished work."""
        return {f"{node}#{i}": run.started for (i, node), run in self.running.items()}

    def wait(self) -> dict[int, StepResult]:
        """Run until at least one job has finished; the finished jobs' results by id ({} if none queued)."""
        while self.jobs:
            self._dispatch_ready()
            finished = {i for i in self.jobs if not any(j == i for j, _ in self.pending) and
                        not any(j == i for j, _ in self.running)}
            if finished:
                for i in finished:
                    del self.jobs[i], self.wanted[i]
                return {i: self.results.pop(i) for i in finished}
            waiting = [ref for run in self.running.values() for ref in run.remaining]
            ready = set(self.rt.backend.wait(waiting)) if waiting else set()
            for key, run in list(self.running.items()):
                run.remaining = [ref for ref in run.remaining if ref not in ready]
                if not run.remaining:
                    del self.running[key]
                    self.busy.discard(self.rt.group_of(run.node))
                    job = self.jobs[run.job]
                    self.rt.finish(run, self.results[run.job], job.step, self.validating, self.running)
        return {}

    def _dispatch_ready(self) -> None:
        for i, node_id in list(self.pending):
            group, result = self.rt.group_of(node_id), self.results[i]
            deps_done = all(d in result.outputs or d not in self.wanted[i] for d in self.rt.pipe.nodes[node_id].deps)
            if deps_done and group not in self.busy:
                job = self.jobs[i]
                self.running[i, node_id] = self.rt.dispatch(node_id, result, job.step, self.validating, i, job.segment_tokens)
                self.pending.remove((i, node_id))
                if group != COMPUTE:
                    self.busy.add(group)


def run_all(runtime, jobs: list[Job], validating: bool = False) -> list[StepResult]:
    """Several batches through their parts of the DAG at once, until every one has finished."""
    runner, done = Jobs(runtime, validating), {}
    ids = [runner.submit(job) for job in jobs]
    while not runner.idle():
        done.update(runner.wait())
    return [done[i] for i in ids]
