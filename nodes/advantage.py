"""advantage: GRPO / Dr.GRPO / RLOO / REINFORCE++ / GAE advantages from token-level rewards, and
on-policy distillation: the reverse KL to a teacher per sampled token, alone (estimator: none) or
added to the task advantage (distill_coef)."""

from siirl_dag.errors import Problem
from siirl_dag.registry import node_kind

_BASE = ("token_level_rewards", "response_mask", "uid")
DISTILL = ("old_logprobs", "teacher_logprobs")


def _consumes(params):
    task = ("response_mask",) if params["estimator"] == "none" else \
        _BASE + (("values",) if params["estimator"] == "gae" else ())
    return task + (DISTILL if params["distill_coef"] > 0 else ())


def _checks(node, pipeline) -> list[Problem]:
    if node.params["estimator"] == "none" and node.params["distill_coef"] == 0:
        return [Problem(pipeline.node_path(node.id) + ("params", "estimator"), "estimator none and distill_coef 0 leave "
                        "nothing to learn from; expected an estimator, or distill_coef > 0 with a teacher's log-probs")]
    return []


@node_kind("advantage", consumes=_consumes, produces=("advantages", "returns"), params_schema="advantage", check=_checks)
def advantage(batch, ctx):
    """Advantages and returns with the estimator named in params (each takes only its own params),
    plus -distill_coef x (student - teacher log-prob) per token when distilling; critic/mixed_groups, the
    share of prompts whose samples' rewards differ (those a group baseline learns from)."""
    import inspect

    import torch

    from nodes.algos.advantages import ESTIMATORS, compute_advantage
    from nodes.algos.masked import masked_mean
    from nodes.algos.metrics import batch_metrics, mixed_groups

    name, mask = ctx.params["estimator"], batch["response_mask"]
    if name == "none":
        advantages = returns = torch.zeros(mask.shape, dtype=torch.float32)
    else:
        takes = inspect.signature(ESTIMATORS[name]).parameters
        params = {k: v for k, v in ctx.params.items() if k in takes}
        advantages, returns = compute_advantage(name, batch["token_level_rewards"], mask, index=batch["uid"],
                                                values=batch.get("values"), **params)
        ctx.metrics["critic/mixed_groups"] = mixed_groups((batch["token_level_rewards"] * mask).sum(dim=-1).tolist(),
                                                          batch["uid"])
    if ctx.params["distill_coef"] > 0:
        reverse_kl = (batch["old_logprobs"] - batch["teacher_logprobs"]) * mask
        advantages = advantages - ctx.params["distill_coef"] * reverse_kl
        ctx.metrics["distill/reverse_kl"] = masked_mean(reverse_kl, mask).item()
    out = {"advantages": advantages, "returns": returns}
    # the whole batch is here: value statistics (PPO) are exact, whatever the critic's data parallelism
    seen = {"response_mask": mask, **({"values": batch["values"]} if "values" in batch else {})}
    ctx.metrics.update(batch_metrics({**out, **seen}))
    return out
