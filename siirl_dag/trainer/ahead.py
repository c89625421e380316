"""runtime.schedule one_step_off and async: the generating side (`config.schedule.ahead_nodes`) runs
ahead of the training side, into a queue of generated batches, on meshes of its own.

Whenever a job finishes, the loop applies, in order:
1. both sides between batches and a rollout's weights behind its trainer's: sync them (weights
   travel only then, so a generation never sees them change half-way; under partial rollouts
   also between two segments of a batch, and new weights hold the training side until the
   segment running ends, so that they go first);
2. the training side free and the next batch generated: train on it, once every sample's
   `weights_version` is checked against runtime.staleness;
3. the generating side free and the bound leaving room: generate the next batch with the weights
   the rollouts hold. Batch b trains after b - 1 steps, on weights at most that many versions newer
   than the rollouts' now, so it may start while b <= trained + 1 + depth - lag (depth:
   `schedule.depth`; lag: how many versions the rollouts' weights are behind now).
With depth 0 this is the sync schedule's order, one side at a time.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from siirl_dag.config import schedule
from siirl_dag.errors import PipelineError
from siirl_dag.runtime.driver import Job, StepResult
from siirl_dag.runtime.jobs import Jobs
from siirl_dag.strategies.rollout_layout import PARTIAL


@dataclass
class Generated:
    """A batch the generating side produced (or, partial, is producing), waiting for the step that trains it."""

    batch: int  # the step that trains it (1: the first)
    result: StepResult
    segments: int = 1  # the generating jobs it took (runtime.partial_rollout)


class Ahead:
    def __init__(self, pipe, trained: int, total: int, in_flight: list[Generated]):
        self.pipe, self.trained, self.total = pipe, trained, total
        self.depth, self.nodes = schedule.depth(pipe.runtime), schedule.ahead_nodes(pipe)
        self.pairs = [(n.id, n.weights_from) for n in pipe.nodes.values() if n.weights_from]
        self.segment = pipe.runtime.partial_rollout_tokens if pipe.runtime.partial_rollout else None
        self.queue = deque(in_flight)
        self.next_batch = trained + len(in_flight) + 1
        self.rt = self.jobs = None
        self.generating: tuple[int, Generated | None] | None = None  # (job id, the batch it continues)
        self.partial: tuple[Generated, list[str]] | None = None  # a batch between two segments, the nodes to resume
        self.training: int | None = None  # job id

    def start(self, rt) -> None:
        self.rt, self.jobs = rt, Jobs(rt)

    def _lag(self) -> int:
        return max(self.rt.versions[src] - self.rt.synced[dst] for dst, src in self.pairs)

    def step(self, next_source) -> tuple[StepResult, dict, dict]:
        """Run until the next batch has trained. Returns its result, the spans of everything that ran
        meanwhile (the nodes still running: up to now), and the staleness and sync metrics."""
        metrics, spans, done = {}, {}, None
        while done is None:
            metrics.update(self._sync_if_idle())
            # under a partial rollout, new weights wait for the segment running to end, then go first
            held = self.segment and self.generating is not None and self._lag() > 0
            if self.training is None and not held and self.queue and self.queue[0].batch == self.trained + 1:
                given = self.queue.popleft()
                metrics.update(self._staleness(given))
                self.training = self.jobs.submit(Job(None, self.trained, set(self.pipe.nodes) - self.nodes, given.result))
            self._generate(next_source)
            if self.jobs.idle():  # the rules above always leave one side something to do
                raise PipelineError(f"step {self.trained + 1}: the {self.pipe.runtime.schedule} schedule has nothing "
                                    "to run (a bug in siirl_dag: please report it)")
            for job, result in self.jobs.wait().items():
                if job == self.training:
                    done, self.training = result, None
                    spans.update(result.spans)
                else:
                    g = self._generated(result)
                    spans.update({f"{n}#{g.batch}.{g.segments}": s for n, s in result.spans.items()})
        self.trained += 1
        metrics.update(self._sync_if_idle())
        now = time.perf_counter()
        spans.update({name: (began, now) for name, began in self.jobs.started().items()})
        return done, spans, metrics

    def drain(self) -> dict:
        """Let the generation in flight finish into the queue (its later segments on the newest weights)
        and bring the rollouts to the trainer's weights: before validation and checkpoints. Returns the
        sync's metrics."""
        metrics = {}
        while self.generating is not None or self.partial is not None:
            if self.generating is None:
                metrics.update(self._sync_if_idle())
                self._generate(None)
            for _, result in self.jobs.wait().items():
                self._generated(result)
        return {**metrics, **self._sync_if_idle()}

    def _sync_if_idle(self) -> dict:
        if self.training is None and self.generating is None and self._lag() > 0:
            return self.rt.sync_weights(self.trained)
        return {}

    def _generate(self, next_source) -> None:
        """The next segment of the batch between segments, else a new batch if the bound leaves room."""
        if self.generating is not None:
            return
        if self.partial is not None:
            (g, resumed), self.partial = self.partial, None
            self.generating = (self.jobs.submit(Job(None, g.batch - 1, resumed, g.result, self.segment)), g)
            return
        b = self.next_batch
        if b <= self.total and b <= self.trained + 1 + self.depth - self._lag():
            self.generating = (self.jobs.submit(Job(next_source(b), b - 1, self.nodes, segment_tokens=self.segment)), None)
            self.next_batch = b + 1

    def _generated(self, result: StepResult) -> Generated:
        """A generating job's result: its batch queued, or, with samples a segment cut short, held
        between segments."""
        (_, before), batch = self.generating, self.next_batch - 1
        if before is not None:  # a later segment: the batch's metrics from its first
            result.metrics = {**before.result.metrics, **result.metrics}
        g = Generated(batch, result) if before is None else Generated(before.batch, result, before.segments + 1)
        self.generating = None
        cut = [dst for dst, _ in self.pairs if self.segment and PARTIAL in self._columns(result, dst, "finish_reason")[0]]
        if cut:
            self.partial = (g, cut)
        else:
            self.queue.append(g)
        return g

    def _columns(self, result: StepResult, node: str, *keys: str) -> list:
        """Columns of a node's output, brought to the driver in one fetch of its shards."""
        batch = self.rt.gather(result.outputs[node], keys)
        return [batch[k] for k in keys]

    def _staleness(self, given: Generated) -> dict:
        """Every sample's weights against the trainer's now (the version this step updates from): its
        oldest token's, checked against the bound."""
        lags, mixed = [], []
        for dst, src in self.pairs:
            versions, tokens = self._columns(given.result, dst, "weights_version", "token_weights_version")
            lags += (self.rt.versions[src] - versions).tolist()
            mixed += (tokens.max(dim=1).values > versions).tolist()  # tokens of more than one weight version
        if max(lags) > self.pipe.runtime.staleness:  # the schedule's bound, checked, not assumed
            raise PipelineError(f"step {given.batch}: samples {max(lags)} weight versions old exceed "
                                f"runtime.staleness = {self.pipe.runtime.staleness}")
        metrics = {**given.result.metrics, "async/staleness/mean": sum(lags) / len(lags), "async/staleness/max": max(lags),
                   "async/queued": len(self.queue)}
        if self.segment:
            metrics.update({"async/partial/segments": given.segments, "async/partial/mixed": sum(mixed) / len(mixed)})
        return metrics
