"""How a step's batch is generated, under every schedule: `Generation` hands out the jobs that make
batch `step` on the generating nodes, one at a time, and takes back their results:
- one job of the generating nodes;
- under partial rollouts, a job per segment while some samples are cut short (`PARTIAL`), each
  continuing the rollouts that cut them;
- with a node that filters rows (dynamic sampling), a round of the filter and its ancestors on new
  prompts per job (under partial rollouts: the rollouts' segments, then the rest of the round)
  until the kept rows fill the batch (`dynamic_sampling.Kept`), then the other generating nodes,
  if any, on those rows.
What comes out (`Generated`) is what the training side's job starts from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import networkx as nx

from siirl_dag.dataflow import SOURCE
from siirl_dag.graph import Phases
from siirl_dag.runtime.step import Job, NodeOutput, StepResult
from siirl_dag.strategies.samples import PARTIAL
from siirl_dag.trainer.schedules.dynamic_sampling import Kept


@dataclass
class Generated:
    """A batch generated (on the generating side) and not trained yet."""

    batch: int  # the step that trains it (1: the first)
    result: StepResult
    segments: int = 1  # the generating jobs it took (partial rollouts' segments, dynamic sampling's rounds)


class Generation:
    def __init__(self, rt, step: int, nodes, phases: Phases | None = None, segment_tokens: int | None = None):
        """`nodes`: the generating nodes; `phases`: dynamic sampling's, if the pipeline filters rows;
        `segment_tokens`: a partial rollout's segment (None: whole samples)."""
        self.rt, self.step, self.segment = rt, step, segment_tokens
        self.nodes = frozenset(nodes)
        self.rollouts = [n for n in rt.order if n in self.nodes and rt.pipe.nodes[n].weights_from]
        self.kept = Kept(rt, phases, rt.pipe.data.train_batch_size, step) if phases and phases.filter in self.nodes \
            else None
        self.first = phases.first if self.kept else self.nodes  # what each round runs
        # under partial rollouts a round's rollouts (with their ancestors) finish their samples, segment
        # after segment, before the rest of the round (the reward, the filter) reads them
        rolled = [n for n in self.rollouts if n in self.first] if self.kept and self.segment else []
        self.rolling = self.first & frozenset(rolled).union(*(nx.ancestors(rt.pipe.graph, n) for n in rolled)) \
            if rolled else self.first
        self.metrics: dict = {}  # of every job so far, the later's first
        self.jobs = 0
        self.result: StepResult | None = None  # once generated
        self.rounding = self.kept is not None  # dynamic sampling's rounds still running
        self.scoring = False  # the rest of a round running, after its rollouts (`rolling`)
        # the next job: (nodes, a new batch of prompts or the given rows, the outputs it continues)
        self._next: tuple | None = (self.rolling, None, None)

    @property
    def done(self) -> bool:
        return self._next is None

    def next_job(self, next_source: Callable) -> Job:
        """The next job to run; `next_source(step)` draws prompts when it starts a round."""
        nodes, source, given = self._next
        self.jobs += 1
        if source is None and given is None:
            source = next_source(self.step)
        return Job(source, self.step, nodes, given, self.segment, part=self.jobs)

    def took(self, result: StepResult) -> None:
        """A job of this batch finished: decide the next one, or the batch is generated."""
        result.metrics = self.metrics = {**self.metrics, **result.metrics}
        cut = [n for n in self.rollouts if self.segment and n in result.outputs and PARTIAL in self._reasons(result, n)]
        if cut:  # the next segment: the cut rollouts continue their samples
            self._next = (cut, None, result)
        elif self.rounding and not self.scoring and self.rolling != self.first:
            self.scoring = True  # the rest of the round, on whole samples
            self._next = (self.first - self.rolling, None, result)
        elif self.rounding:
            self.scoring = False
            if not self.kept.add(result):
                self._next = (self.rolling, None, None)
                return
            self.rounding = False
            self.metrics.update(self.kept.metrics())
            rows, then = self.kept.batch(), self.nodes - self.first
            if then:  # generating nodes after the filter: once, on the kept rows
                self._next = (then, rows, None)
            else:
                self._finish(StepResult(metrics=self.metrics, outputs={SOURCE: NodeOutput.held(rows, self.rt.backend.put)}))
        else:
            self._finish(result)

    def generated(self) -> Generated:
        return Generated(self.step, self.result, self.jobs)

    def _finish(self, result: StepResult) -> None:
        result.metrics, self.result, self._next = self.metrics, result, None

    def _reasons(self, result: StepResult, node: str) -> list:
        return self.rt.gather(result.outputs[node], ["finish_reason"])["finish_reason"]
