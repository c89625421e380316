"""critic_value and critic_update: the value model of PPO on a Megatron mesh."""

from siirl_dag.registry import node_kind

_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")


@node_kind("critic_value", consumes=_INPUTS, produces=("values",), strategies=("megatron",), params_schema="critic_value")
def critic_value(batch, ctx):
    """Per-token value estimates of the responses."""
    return {"values": ctx.engine.compute_values(batch)}


@node_kind("critic_update", consumes=_INPUTS + ("values", "returns"), produces=(), strategies=("megatron",),
           params_schema="critic_update", trains=True)
def critic_update(batch, ctx):
    """Clipped value-loss regression towards the returns."""
    from functools import partial

    from nodes.algos.losses import value_loss

    p = ctx.params
    loss_fn = partial(value_loss, cliprange_value=p["cliprange_value"], loss_agg_mode=p["loss_agg_mode"])
    ctx.metrics.update(ctx.engine.train_values(batch, loss_fn, mini_batch_size=p["mini_batch_size"], epochs=p["epochs"]))
    return {}
