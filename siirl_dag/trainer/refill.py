"""Dynamic sampling: a node kind that filters rows (`filters_rows`; DAPO's filter_groups) marks with
`keep` the rows a step trains on. The filter and its ancestors (the first phase, graph.phases_of)
run again on more prompts until the kept rows cover data.train_batch_size prompts, at most
`max_gen_batches` rounds; then the rest of the DAG (the second phase) runs once on exactly that many
prompts' rows, handed to it as the step's source batch.
"""

from __future__ import annotations

from typing import Callable

from siirl_dag.errors import PipelineError
from siirl_dag.graph import Phases


def run_step(rt, phases: Phases, next_source: Callable, prompts: int, step: int):
    """One training step with dynamic sampling; returns the second phase's StepResult, carrying the
    metrics of the last round of the first and `dynamic_sampling/*`."""
    from siirl_dag.runtime import Batch

    kept, uids, spans, metrics, drawn = [], {}, {}, {}, 0  # uids: the kept prompts, in order
    for round_ in range(1, phases.max_rounds + 1):
        source = next_source()
        drawn += source.num_rows
        result = rt.run_step(source, step, nodes=phases.first)
        metrics.update(result.metrics)
        spans.update({f"{node}#{round_}": span for node, span in result.spans.items()})
        output = result.outputs[phases.filter]
        batch = rt.collect(result, {k for o in result.outputs.values() if o.rows == output.rows for k in o.keys},
                           rows=output.rows)
        chosen = batch.select(batch["keep"].nonzero().squeeze(1))
        kept.append(chosen.only([k for k in chosen if k != "keep"]))
        uids.update(dict.fromkeys(chosen["uid"]))
        if len(uids) >= prompts:
            break
    else:
        raise PipelineError(f"step {step + 1}: dynamic sampling kept {len(uids)} of the {prompts} prompts a step needs "
                            f"after {phases.max_rounds} generation rounds (max_gen_batches of '{phases.filter}'): "
                            "too few prompts have samples that score differently; raise max_gen_batches, or make "
                            "the task's rewards vary more (more samples per prompt, a higher temperature)")
    batch = Batch.concat(kept)
    wanted = set(list(uids)[:prompts])
    batch = batch.select([i for i, u in enumerate(batch["uid"]) if u in wanted])
    result = rt.run_step(batch, step, nodes=phases.rest)
    result.metrics = {**metrics, **result.metrics, "dynamic_sampling/rounds": round_,
                      "dynamic_sampling/kept_groups": len(uids), "dynamic_sampling/kept_ratio": len(uids) / drawn}
    result.spans.update(spans)
    return result
