"""actor_update: PPO-clip policy update (GRPO uses it with group advantages) on a Megatron mesh."""

from nodes import routing
from nodes.rollout import temperature_differs
from siirl_dag.errors import Problem
from siirl_dag.registry import node_kind

_BASE = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask", "advantages", "old_logprobs")


def _consumes(params):
    return _BASE + (("ref_logprobs",) if params["use_kl_loss"] else ()) + \
        (("rollout_logprobs",) if params["rollout_is"] != "off" else ()) + routing.replays(params)


def check_mini_batch(node, pipeline):
    """Mini batch (prompts) must split the step's prompts, and its samples the ranks x micro batches."""
    prompts = pipeline.data.train_batch_size
    mini = node.params["mini_batch_size"]
    n = pipeline.samples_per_prompt(node.id)
    path = pipeline.node_path(node.id) + ("params", "mini_batch_size")
    if prompts % mini:
        return [Problem(path, f"mini_batch_size {mini} does not divide data.train_batch_size {prompts}; "
                              f"expected a divisor of {prompts}")]
    dp, micro = pipeline.data_parallel_size(node.id), pipeline.micro_batch_size(node.id)
    if micro and (mini * n) % (dp * micro):
        return [Problem(path, f"a mini batch holds {mini} prompts x {n} samples = {mini * n} samples, which do not "
                              f"split into {dp} data-parallel ranks x micro_batch_size {micro}; expected mini_batch_size "
                              f"x n to be a multiple of {dp * micro}")]
    return []


def _checks(node, pipeline):
    return check_mini_batch(node, pipeline) + _stale_samples_corrected(node, pipeline) + \
        temperature_differs(node, pipeline) + routing.problems(node, pipeline, "routing_replay")


def _stale_samples_corrected(node, pipeline):
    """Samples of older weights train uncorrected without rollout_is: worth a warning (the demo learns
    under one_step_off with it and not without; docs/BENCHMARKS.md)."""
    if pipeline.runtime.schedule == "sync" or node.params["rollout_is"] != "off":
        return []
    return [Problem(pipeline.node_path(node.id) + ("params", "rollout_is"), f"schedule {pipeline.runtime.schedule} "
                    "trains on samples of older weights, and this update does not correct for them; expected "
                    "rollout_is: token (or sequence)", severity="warning")]


@node_kind("actor_update", consumes=_consumes, produces=(), strategies=("megatron",), params_schema="actor_update",
           trains=True, check=_checks)
def actor_update(batch, ctx):
    """Mini-batch epochs of the PPO clipped objective (+ optional KL loss and entropy bonus), per token
    or per sequence (GSPO), optionally weighted by the rollout's importance weights."""
    from nodes.algos.losses import ppo_actor_loss
    from nodes.algos.rollout_corr import rollout_corr_metrics, rollout_is_weights

    p = ctx.params

    def weights_of(rows):
        return rollout_is_weights(rows["old_logprobs"], rows["rollout_logprobs"], rows["response_mask"],
                                  p["rollout_is"], p["rollout_is_threshold"])

    def loss_fn(logprobs, entropy, mb, totals):
        weights = None if p["rollout_is"] == "off" else weights_of(mb)
        return ppo_actor_loss(logprobs, mb["old_logprobs"], mb["advantages"], mb["response_mask"], entropy=entropy,
                              ref_logprobs=mb.get("ref_logprobs"), clip_ratio_low=p["clip_ratio_low"],
                              clip_ratio_high=p["clip_ratio_high"], clip_ratio_c=p["clip_ratio_c"],
                              loss_agg_mode=p["loss_agg_mode"], entropy_coeff=p["entropy_coeff"],
                              use_kl_loss=p["use_kl_loss"], kl_loss_coef=p["kl_loss_coef"], kl_loss_type=p["kl_loss_type"],
                              policy_loss_mode=p["policy_loss"], rollout_is_weights=weights, totals=totals)

    metrics = ctx.engine.train(batch, loss_fn, mini_batch_size=p["mini_batch_size"] * ctx.samples_per_prompt,
                               micro_batch_size=ctx.engine.opts["micro_batch_size"], epochs=p["epochs"],
                               replay_routes=p["routing_replay"])
    ctx.metrics.update({k if "/" in k else f"actor/{k}": v for k, v in metrics.items()})
    if p["rollout_is"] != "off":  # this rank's rows (all of them on one data-parallel rank)
        ctx.metrics.update(rollout_corr_metrics(batch["old_logprobs"], batch["rollout_logprobs"], batch["response_mask"],
                                                weights_of(batch)))
    return {}
