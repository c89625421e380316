"""advantage: GRPO / Dr.GRPO / RLOO / REINFORCE++ / GAE advantages from token-level rewards."""

from siirl_dag.registry import node_kind

_BASE = ("token_level_rewards", "response_mask", "uid")


def _consumes(params):
    return _BASE + (("values",) if params["estimator"] == "gae" else ())


@node_kind("advantage", consumes=_consumes, produces=("advantages", "returns"), params_schema="advantage")
def advantage(batch, ctx):
    """Advantages and returns with the estimator named in params (each takes only its own params)."""
    import inspect

    from nodes.algos.advantages import ESTIMATORS, compute_advantage
    from nodes.algos.metrics import batch_metrics

    name = ctx.params["estimator"]
    takes = inspect.signature(ESTIMATORS[name]).parameters
    params = {k: v for k, v in ctx.params.items() if k in takes}
    advantages, returns = compute_advantage(name, batch["token_level_rewards"], batch["response_mask"],
                                            index=batch["uid"], values=batch.get("values"), **params)
    out = {"advantages": advantages, "returns": returns}
    # the whole batch is here: value statistics (PPO) are exact, whatever the critic's data parallelism
    seen = {"response_mask": batch["response_mask"], **({"values": batch["values"]} if "values" in batch else {})}
    ctx.metrics.update(batch_metrics({**out, **seen}))
    return out
