"""actor_update: PPO-clip policy update (GRPO uses it with group advantages) on a Megatron mesh."""

from nodes import routing
from nodes.rollout import temperature_differs
from siirl_dag.errors import Problem
from siirl_dag.registry import node_kind

_BASE = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask", "advantages")


def _consumes(params):
    return _BASE + (("old_logprobs",) if params["old_logprobs"] == "input" else ()) + \
        (("ref_logprobs",) if params["use_kl_loss"] else ()) + \
        (("rollout_logprobs",) if params["rollout_is"] != "off" or params["old_logprobs"] == "rollout" else ()) + \
        routing.replays(params)


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
    return check_mini_batch(node, pipeline) + _stale_samples_corrected(node, pipeline) + _old_policy(node, pipeline) + \
        temperature_differs(node, pipeline) + routing.problems(node, pipeline, "routing_replay")


def _old_policy(node, pipeline):
    """old_logprobs: update is exact only when the policy has not moved before any row's loss: one
    epoch, one mini batch, and a forward that drops nothing out; rollout leaves rollout_is nothing to weigh."""
    p, path = node.params, pipeline.node_path(node.id) + ("params", "old_logprobs")
    lora = pipeline.models[node.model].lora
    if p["old_logprobs"] == "update" and (p["epochs"] > 1 or p["mini_batch_size"] < pipeline.data.train_batch_size):
        return [Problem(path, f"update: the update's forward gives the old policy only before its first optimizer "
                              f"step, and this one takes {p['epochs']} epoch(s) of mini batches of {p['mini_batch_size']} "
                              f"of the step's {pipeline.data.train_batch_size} prompts; expected epochs 1 and "
                              f"mini_batch_size {pipeline.data.train_batch_size}, or old_logprobs: input (a logprob node)")]
    if p["old_logprobs"] == "update" and lora is not None and lora.dropout:
        return [Problem(path, f"update: model '{node.model}' drops LoRA inputs out ({lora.dropout}) in training, so the "
                              "update's forward is not the old policy's; expected lora dropout 0, or old_logprobs: input")]
    if p["old_logprobs"] == "rollout" and p["rollout_is"] != "off":
        return [Problem(path, "rollout: the old policy is the rollout's, so rollout_is would weigh every token by 1; "
                              "expected rollout_is: off (the PPO ratio corrects for the rollout), or old_logprobs: input")]
    return []


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
    seen = []  # with old_logprobs: update, each micro batch's (old, rollout log-probs, mask), for the metrics

    def weights_of(old, rollout, mask):
        return rollout_is_weights(old, rollout, mask, p["rollout_is"], p["rollout_is_threshold"])

    def loss_fn(logprobs, entropy, mb, totals):
        old = {"input": mb.get("old_logprobs"), "update": logprobs.detach(), "rollout": mb.get("rollout_logprobs")}[
            p["old_logprobs"]]
        weights = None if p["rollout_is"] == "off" else weights_of(old, mb["rollout_logprobs"], mb["response_mask"])
        if weights is not None and p["old_logprobs"] == "update":
            seen.append((old, mb["rollout_logprobs"], mb["response_mask"]))
        return ppo_actor_loss(logprobs, old, mb["advantages"], mb["response_mask"], entropy=entropy,
                              ref_logprobs=mb.get("ref_logprobs"), clip_ratio_low=p["clip_ratio_low"],
                              clip_ratio_high=p["clip_ratio_high"], clip_ratio_c=p["clip_ratio_c"],
                              loss_agg_mode=p["loss_agg_mode"], entropy_coeff=p["entropy_coeff"],
                              use_kl_loss=p["use_kl_loss"], kl_loss_coef=p["kl_loss_coef"], kl_loss_type=p["kl_loss_type"],
                              policy_loss_mode=p["policy_loss"], rollout_is_weights=weights, totals=totals)

    metrics = ctx.engine.train(batch, loss_fn, mini_batch_size=p["mini_batch_size"] * ctx.samples_per_prompt,
                               micro_batch_size=ctx.engine.opts["micro_batch_size"], epochs=p["epochs"],
                               replay_routes=p["routing_replay"], entropy_grad=p["entropy_coeff"] != 0)
    ctx.metrics.update({k if "/" in k else f"actor/{k}": v for k, v in metrics.items()})
    if p["rollout_is"] != "off" and p["old_logprobs"] == "input":  # this rank's rows (all of them on one DP rank)
        rows = batch["old_logprobs"], batch["rollout_logprobs"], batch["response_mask"]
    elif seen:  # the micro batches' rows, on the last pipeline stage (where the loss is computed)
        rows = tuple(_rows([s[i] for s in seen]) for i in range(3))
    else:
        return {}
    ctx.metrics.update(rollout_corr_metrics(*rows, weights_of(*rows)))
    return {}


def _rows(parts):
    """Micro batches' [b, R_i] tensors as one [sum b, max R], padded with zeros (masked out)."""
    import torch

    width = max(t.shape[1] for t in parts)
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in parts])
