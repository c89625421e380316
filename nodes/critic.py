"""critic_value and critic_update: the value model of PPO on a Megatron mesh.

The critic's engine is built as a value model (`value_head: true` in the options of a node on its
mesh and model; nodes there share one engine and one set of options).
"""

from siirl_dag.errors import Problem
from siirl_dag.registry import node_kind

_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")


def _value_model(node, pipeline):
    if node.options.get("value_head"):
        return []
    return [Problem(pipeline.node_path(node.id) + ("options", "value_head"),
                    f"'{node.kind}' needs a value model; expected value_head: true in the options of a node on mesh "
                    f"'{node.mesh}' with model '{node.model}'")]


def _update_check(node, pipeline):
    """A value model, and mini batches that split like the actor's (mini_batch_size counts prompts)."""
    from nodes.actor_update import check_mini_batch

    return _value_model(node, pipeline) + check_mini_batch(node, pipeline)


@node_kind("critic_value", consumes=_INPUTS, produces=("values",), strategies=("megatron",),
           params_schema="critic_value", check=_value_model)
def critic_value(batch, ctx):
    """Per-token value estimates of the responses (the state before each token, as verl)."""
    return {"values": ctx.engine.compute_values(batch)}


@node_kind("critic_update", consumes=_INPUTS + ("values", "returns"), produces=(), strategies=("megatron",),
           params_schema="critic_update", trains=True, check=_update_check)
def critic_update(batch, ctx):
    """Mini-batch epochs of the clipped value loss towards the returns (old values: the critic_value output)."""
    from nodes.algos.losses import ppo_critic_loss

    p = ctx.params

    def loss_fn(values, mb, totals):
        return ppo_critic_loss(values, mb["values"], mb["returns"], mb["response_mask"],
                               cliprange_value=p["cliprange_value"], loss_agg_mode=p["loss_agg_mode"], totals=totals)

    metrics = ctx.engine.train_values(batch, loss_fn, mini_batch_size=p["mini_batch_size"] * ctx.samples_per_prompt,
                                      epochs=p["epochs"])
    ctx.metrics.update({k if "/" in k else f"critic/{k}": v for k, v in metrics.items()})
    return {}
