"""What a step is made of, as the scheduler and the dispatcher hand it to each other.

Steps are numbered one way everywhere: from 1, the number the metrics of the step are logged at.
A job's `step` is the step that trains its batch (a batch generated ahead carries the step it is
for); a validation job carries the number of steps trained before it (0: before training). Weight
syncs carry the step after which they run (0: at start-up).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, NamedTuple

import numpy as np

from siirl_dag.runtime.batch import Batch, row_tokens, version_counts
from siirl_dag.runtime.reshard import Shard

COMPUTE = "__compute__"  # the worker group of the nodes with no mesh: several of them run at once


class Span(NamedTuple):
    """One node's run in one job, as the driver saw it (perf_counter seconds)."""

    node: str
    step: int  # the step its batch is for
    part: int  # the dynamic-sampling round or partial-rollout segment (1: the first; 0: the job's only)
    start: float
    end: float


@dataclass
class NodeOutput:
    shards: list[Shard]
    keys: set
    rows: int
    tokens: np.ndarray  # per row (batch.row_tokens)
    versions: list = field(default_factory=list)  # its samples' weights versions (batch.version_counts)

    @classmethod
    def held(cls, batch: Batch, put) -> "NodeOutput":
        """A batch the driver holds (the prompts, the kept rows of dynamic sampling), as one shard that
        `put` (the backend's) stores once for every rank that reads it."""
        return cls([Shard(put(batch.to_wire()), 0, batch.num_rows)], set(batch), batch.num_rows, row_tokens(batch),
                   version_counts(batch))


@dataclass
class StepResult:
    metrics: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)  # node id -> NodeOutput
    spans: list[Span] = field(default_factory=list)  # every node run that produced it, in the order they ended
    writers: dict = field(default_factory=dict, repr=False)  # metric name -> the node that wrote it

    def span(self, node: str) -> Span:
        """The latest run of `node`."""
        return next(s for s in reversed(self.spans) if s.node == node)


@dataclass
class Job:
    """One batch through (part of) the DAG. Several jobs run at once on disjoint meshes: the rollout of
    the next step beside the training of this one (runtime.schedule: one_step_off)."""

    source: Batch | None  # the prompts; None: continue `given`, whose outputs hold them
    step: int  # the step its batch is for (see the module's docstring)
    nodes: Iterable[str] | None = None  # None: every node
    given: StepResult | None = None  # outputs of nodes that ran earlier (a rollout run ahead)
    # a segment of a partial rollout: the tokens a node that generates may add (None: to the end); a
    # node whose output `given` holds runs on that output, to continue it (`NodeContext.resuming`)
    segment_tokens: int | None = None
    part: int = 0  # its round of dynamic sampling, or segment (`Span.part`)


@dataclass
class Running:
    """A node dispatched to its ranks, not collected yet."""

    node: str
    calls: list  # per rank: (its output, its info) as results or refs; the output None off the output ranks
    ranks: list[tuple[int, int]]  # (dp_rank, output_rank flag) per call
    started: float
    job: int = 0  # its job's id (scheduler.Scheduler)
    remaining: list = field(default_factory=list)  # info refs not finished yet (Ray)
