"""filter_groups: DAPO's dynamic sampling. A prompt whose samples all scored the same has zero group
advantage, so it teaches nothing and only dilutes the batch; this node marks its rows dropped, and the
driver draws more prompts until the step holds data.train_batch_size prompts that do teach."""

from siirl_dag.registry import node_kind


def _consumes(params):
    return (params["metric"], "uid")


@node_kind("filter_groups", consumes=_consumes, produces=("keep",), params_schema="filter_groups", filters_rows=True)
def filter_groups(batch, ctx):
    """keep[i] = the samples of row i's prompt do not all have the same `metric` (summed over a row)."""
    import torch

    from nodes.algos.metrics import varied_groups

    varied = varied_groups(batch[ctx.params["metric"]].sum(dim=-1).tolist(), batch["uid"])
    return {"keep": torch.tensor([uid in varied for uid in batch["uid"]], dtype=torch.long)}
