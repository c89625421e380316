"""Schedules (runtime.schedule): what a training step runs, in which order, on which meshes.

The trainer loop picks one at the start of a run (`make`) and knows only its interface (`Schedule`),
whose step returns an `outcome.Outcome`.
Every schedule generates a step's batch the same way (`generation.Generation`, dynamic sampling
included), then trains on it:
- `sync.Sync`: generate, train, sync the weights; one batch at a time.
- `overlapped.Overlapped` (one_step_off, async): the generating side runs ahead of the training
  side, into a queue of generated batches, on meshes of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

from siirl_dag.trainer.schedules.outcome import Outcome

if TYPE_CHECKING:  # the runtime (torch) loads at `make`: a refused run never loads it
    from siirl_dag.trainer.schedules.generation import Generated


class Schedule(Protocol):
    def step(self, next_source: Callable) -> Outcome:
        """Run until the next batch has trained; `next_source(step)` draws the prompts of a step's batch."""

    def drain(self, next_source: Callable) -> dict:
        """Finish what is generating and bring every rollout to its trainer's weights (before validation
        and checkpoints); the syncs' metrics."""

    def in_flight(self) -> list[Generated]:
        """The batches generated and not trained yet, in order (checkpoints keep them)."""


def make(pipe, rt, trained: int, total: int, in_flight: list[Generated]) -> Schedule:
    """The schedule of `pipe.runtime.schedule`, after `trained` of `total` steps, with the batches a
    checkpoint held generated ahead."""
    if pipe.runtime.schedule == "sync":
        from siirl_dag.trainer.schedules.sync import Sync

        return Sync(pipe, rt, trained)
    from siirl_dag.trainer.schedules.overlapped import Overlapped

    return Overlapped(pipe, rt, trained, total, in_flight)
