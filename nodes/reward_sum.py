"""reward_sum: a weighted sum of rewards on the same samples, e.g. a rule reward and a judge's.

Each term is a key it consumes, bound to a reward node's output:

    - {id: total, kind: reward_sum, params: {weights: {rule: 1.0, judge: 0.5}},
       inputs: {rule: reward.token_level_rewards, judge: judge.token_level_rewards}}
"""

from siirl_dag.registry import node_kind


def _consumes(params) -> tuple[str, ...]:
    return tuple(params["weights"]) + ("response_mask",)


@node_kind("reward_sum", consumes=_consumes, produces=("token_level_scores", "token_level_rewards"),
           params_schema="reward_sum")
def reward_sum(batch, ctx):
    """Token by token: the terms' rewards sit on the same response tokens."""
    weights = ctx.params["weights"]
    total = sum(w * batch[name].float() for name, w in weights.items())
    mask = batch["response_mask"]
    ctx.metrics.update({f"reward_sum/{name}/mean": (batch[name] * mask).sum(-1).mean().item() for name in weights})
    ctx.metrics["reward_sum/total/mean"] = (total * mask).sum(-1).mean().item()
    return {"token_level_scores": total, "token_level_rewards": total}
