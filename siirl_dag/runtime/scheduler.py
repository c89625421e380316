"""Which node runs when: batches in flight through parts of the DAG (`step.Job`). A `Scheduler` takes
new jobs at any time and hands back each as it finishes, so a schedule can keep a rollout generating
ahead while another batch trains (runtime.schedule one_step_off and async). Every node whose inputs
are ready and whose mesh is free is dispatched at once; a mesh runs one node at a time, the earlier
job's first. How a node reaches its ranks is the dispatcher's (`dispatch.Runtime`), handed in.
"""

from __future__ import annotations

import itertools
import time

from siirl_dag.dataflow import SOURCE
from siirl_dag.runtime.step import COMPUTE, Job, NodeOutput, Running, StepResult

HEARTBEAT_S = 60.0  # a wait this long with nothing finished says what is still running (an agents' rollout, say)


class Scheduler:
    def __init__(self, runtime, validating: bool = False):
        """`runtime`: the dispatcher (`dispatch.Runtime`: order, group_of, dispatch, finish, backend)."""
        self.rt, self.validating = runtime, validating
        self._ids = itertools.count()
        self.jobs: dict[int, Job] = {}
        self.results: dict[int, StepResult] = {}
        self.wanted: dict[int, set] = {}
        self.pending: list[tuple[int, str]] = []  # (job id, node) in submission, then DAG, order
        self.running: dict[tuple[int, str], Running] = {}
        self.busy: set = set()  # the anchor meshes running a node now

    def submit(self, job: Job) -> int:
        """Queue `job`'s nodes; returns its id, which `wait` hands back with its result."""
        i = next(self._ids)
        result = StepResult(outputs=dict(job.given.outputs) if job.given else {})
        if job.source is not None:  # the prompts, stored once for every rank that reads them
            result.outputs[SOURCE] = NodeOutput.held(job.source, self.rt.backend.put)
        self.jobs[i], self.results[i] = job, result
        self.wanted[i] = set(self.rt.order) if job.nodes is None else set(job.nodes)
        self.pending += [(i, n) for n in self.rt.order if n in self.wanted[i]]
        return i

    def idle(self) -> bool:
        return not self.jobs

    def started(self) -> list[tuple[str, Job, float]]:
        """The nodes running now: (node, its job, when it started (perf_counter))."""
        return [(node, self.jobs[i], run.started) for (i, node), run in self.running.items()]

    def ended(self) -> list:
        """The spans of the nodes that ended in jobs still running (a job's result hands them over only
        when it finishes, maybe a step later)."""
        return [span for i in self.jobs for span in self.results[i].spans]

    def wait(self) -> dict[int, StepResult]:
        """Run until at least one job has finished; the finished jobs' results by id ({} if none queued)."""
        while self.jobs:
            self.dispatch_ready()
            finished = {i for i in self.jobs if not any(j == i for j, _ in self.pending) and
                        not any(j == i for j, _ in self.running)}
            if finished:
                for i in finished:
                    del self.jobs[i], self.wanted[i]
                return {i: self.results.pop(i) for i in finished}
            waiting = [ref for run in self.running.values() for ref in run.remaining]
            ready = set(self.rt.backend.wait(waiting, HEARTBEAT_S)) if waiting else set()
            if waiting and not ready:
                now = time.perf_counter()
                self.rt.progress("[runtime] still running: " + ", ".join(
                    f"'{node}' ({(now - run.started) / 60:.1f} min)" for (_, node), run in self.running.items()))
            for key, run in list(self.running.items()):
                run.remaining = [ref for ref in run.remaining if ref not in ready]
                if not run.remaining:
                    del self.running[key]
                    self.busy.discard(self.rt.group_of(run.node))
                    retry = self.rt.finish(run, self.results[run.job], self.jobs[run.job], self.validating,
                                           list(self.running.values()))
                    if retry is not None:  # re-dispatched: its mesh is busy again
                        self.running[key] = retry
                        self._hold(retry.node)
        return {}

    def run(self, jobs: list[Job]) -> list[StepResult]:
        """Run `jobs` at once until every one has finished; their results in order."""
        ids, done = [self.submit(job) for job in jobs], {}
        while not self.idle():
            done.update(self.wait())
        return [done[i] for i in ids]

    def dispatch_ready(self) -> None:
        """Dispatch every node whose inputs are ready and whose mesh is free (`wait` does it too)."""
        for i, node_id in list(self.pending):
            group, result = self.rt.group_of(node_id), self.results[i]
            deps_done = all(d in result.outputs or d not in self.wanted[i] for d in self.rt.pipe.nodes[node_id].deps)
            if deps_done and group not in self.busy:
                self.running[i, node_id] = self.rt.dispatch(node_id, result, self.jobs[i], self.validating, i)
                self.pending.remove((i, node_id))
                self._hold(node_id)

    def _hold(self, node_id: str) -> None:
        if (group := self.rt.group_of(node_id)) != COMPUTE:
            self.busy.add(group)
