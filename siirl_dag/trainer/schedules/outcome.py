"""What a schedule's step hands the trainer loop: one trained step (`Schedule.step`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the runtime (torch) loads at `schedules.make`: a refused run never loads it
    from siirl_dag.runtime.step import Span, StepResult


@dataclass
class Outcome:
    """One trained step."""

    result: StepResult  # its training side's, holding its generating side's metrics too
    spans: list[Span]  # every node run that finished meanwhile (any batch's), and those still running, up to now
    metrics: dict  # the schedule's own: weight syncs, staleness
