"""runtime.schedule sync: a step generates its batch, trains on it, then syncs the weights. Without
dynamic sampling the whole DAG is one job, so any node whose inputs are ready runs at once."""

from __future__ import annotations

from siirl_dag.graph import phases_of
from siirl_dag.runtime.step import Job
from siirl_dag.trainer.schedules.outcome import Outcome
from siirl_dag.trainer.schedules.generation import Generation


class Sync:
    def __init__(self, pipe, rt, trained: int):
        self.rt, self.trained, self.phases = rt, trained, phases_of(pipe)
        self.generating = self.phases.first if self.phases else frozenset(pipe.nodes)
        self.training = frozenset(pipe.nodes) - self.generating

    def step(self, next_source) -> Outcome:
        step, spans = self.trained + 1, []
        generation = Generation(self.rt, step, self.generating, self.phases)
        while not generation.done:
            (result,) = self.rt.run_jobs([generation.next_job(next_source)])
            spans += result.spans
            generation.took(result)
        result = generation.result
        if self.training:
            (trained,) = self.rt.run_jobs([Job(None, step, self.training, result)])
            spans += trained.spans
            trained.metrics, result = {**result.metrics, **trained.metrics}, trained
        self.trained = step
        return Outcome(result, spans, self.rt.sync_weights(step))

    def drain(self, next_source) -> dict:
        return {}

    def in_flight(self) -> list:
        return []
