"""Dynamic sampling: a node kind that filters rows (`filters_rows`; DAPO's filter_groups) marks with
`keep` the rows a step trains on. The filter and its ancestors (the first phase, graph.phases_of)
run again on more prompts until the kept rows cover data.train_batch_size prompts, at most
`max_gen_batches` rounds; the nodes after them run once on exactly that many prompts' rows, handed
to them as their source batch. `Kept` gathers the rounds' kept rows; `generation.Generation` runs
the rounds, under every schedule.
"""

from __future__ import annotations

from siirl_dag.errors import PipelineError
from siirl_dag.graph import Phases
from siirl_dag.runtime.step import StepResult


class Kept:
    """The rows the filter kept over the rounds of one step, in order."""

    def __init__(self, rt, phases: Phases, prompts: int, step: int):
        self.rt, self.phases, self.prompts, self.step = rt, phases, prompts, step
        self.parts, self.uids, self.rounds, self.drawn = [], {}, 0, 0  # uids: the kept prompts, in order

    def add(self, result: StepResult) -> bool:
        """Take a round's kept rows; whether the step is full. Raises PipelineError after the last round
        that leaves it short."""
        from siirl_dag.dataflow import SOURCE

        self.rounds += 1
        self.drawn += result.outputs[SOURCE].rows
        output = result.outputs[self.phases.filter]
        batch = self.rt.collect(result, {k for o in result.outputs.values() if o.rows == output.rows for k in o.keys},
                                rows=output.rows)
        chosen = batch.select(batch["keep"].nonzero().squeeze(1))
        self.parts.append(chosen.only([k for k in chosen if k != "keep"]))
        self.uids.update(dict.fromkeys(chosen["uid"]))
        if len(self.uids) >= self.prompts:
            return True
        if self.rounds >= self.phases.max_rounds:
            raise PipelineError(f"step {self.step}: dynamic sampling kept {len(self.uids)} of the {self.prompts} "
                                f"prompts a step needs after {self.phases.max_rounds} generation rounds (max_gen_batches "
                                f"of '{self.phases.filter}'): too few prompts have samples that score differently; "
                                "raise max_gen_batches, or make the task's rewards vary more (more samples per "
                                "prompt, a higher temperature)")
        return False

    def batch(self):
        """The kept rows of the first `prompts` kept prompts."""
        from siirl_dag.runtime import Batch

        batch, wanted = Batch.concat(self.parts), set(list(self.uids)[:self.prompts])
        return batch.select([i for i, u in enumerate(batch["uid"]) if u in wanted])

    def metrics(self) -> dict:
        return {"dynamic_sampling/rounds": self.rounds, "dynamic_sampling/kept_groups": len(self.uids),
                "dynamic_sampling/kept_ratio": len(self.uids) / self.drawn}
