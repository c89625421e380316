"""advantage: GRPO / Dr.GRPO / RLOO / REINFORCE++ / GAE advantages from token-level rewards."""

from siirl_dag.registry import node_kind

_BASE = ("token_level_rewards", "response_mask", "uid")


def _consumes(params):
    return _BASE + (("values",) if params["estimator"] == "gae" else ())


@node_kind("advantage", consumes=_consumes, produces=("advantages", "returns"), params_schema="advantage")
def advantage(batch, ctx):
    """Compute advantages and returns with the estimator named in params."""
    from nodes.algos.advantages import ESTIMATORS

    p = dict(ctx.params)
    estimator = ESTIMATORS[p.pop("estimator")]
    advantages, returns = estimator(batch, **p)
    return {"advantages": advantages, "returns": returns}
