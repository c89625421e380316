"""actor_update: PPO-clip policy update (GRPO uses it with group advantages) on a Megatron mesh, with
verl's rollout correction (importance weights and rejection, nodes/algos/rollout_corr.py)."""

from nodes import routing
from nodes.algos.rollout_corr_settings import parse, parse_is_threshold, parse_rs, parse_rs_thresholds
from nodes.rollout import temperature_differs
from siirl_dag.errors import Problem
from siirl_dag.registry import node_kind

_BASE = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask", "advantages")


def correction(params) -> dict | None:
    """The settings of rollout_corr_settings.parse, None where the update corrects nothing."""
    rollout_is = None if params["rollout_is"] == "off" else params["rollout_is"]
    rollout_rs = None if params["rollout_rs"] in (None, "off") else params["rollout_rs"]
    if rollout_is is None and rollout_rs is None:
        return None
    return {"rollout_is": rollout_is, "rollout_is_threshold": params["rollout_is_threshold"], "rollout_rs": rollout_rs,
            "rollout_is_batch_normalize": params["rollout_is_batch_normalize"],
            "rollout_rs_threshold": params["rollout_rs_threshold"]}


def _consumes(params):
    return _BASE + (("old_logprobs",) if params["old_logprobs"] == "input" else ()) + \
        (("ref_logprobs",) if params["use_kl_loss"] else ()) + \
        (("rollout_logprobs",) if correction(params) or params["old_logprobs"] == "rollout" else ()) + \
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
        _thresholds(node, pipeline) + temperature_differs(node, pipeline) + routing.problems(node, pipeline, "routing_replay")


def _thresholds(node, pipeline):
    """The correction's settings parsed as the update parses them, each refusal at its key."""
    p, base = node.params, pipeline.node_path(node.id) + ("params",)
    out = []
    try:
        parse_is_threshold(p["rollout_is_threshold"])
    except ValueError as e:
        out.append(Problem(base + ("rollout_is_threshold",), str(e)))
    if p["rollout_rs"] in (None, "off"):
        return out
    try:
        options = parse_rs(p["rollout_rs"])
    except ValueError as e:
        return out + [Problem(base + ("rollout_rs",), str(e))]
    if p["rollout_rs_threshold"] is None:
        return out + [Problem(base + ("rollout_rs",), f"{p['rollout_rs']!r} rejects against rollout_rs_threshold, which "
                              "is not set; expected rollout_rs_threshold: a number, \"lower_upper\" for k1 options (e.g. "
                              "\"0.999_1.001\"), or a comma list with one entry per option")]
    try:
        parse_rs_thresholds(options, p["rollout_rs_threshold"])
    except ValueError as e:
        out.append(Problem(base + ("rollout_rs_threshold",), str(e)))
    return out


def _old_policy(node, pipeline):
    """old_logprobs: update is exact only when the policy has not moved before any row's loss: one
    epoch, one mini batch, and a forward that drops nothing out; rollout (verl's bypass mode) weighs by
    rollout_is only in its REINFORCE loss (the PPO ratio already is pi / pi_rollout), which needs it."""
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
    if p["old_logprobs"] == "rollout" and p["rollout_is"] != "off" and p["loss_type"] == "ppo_clip":
        return [Problem(path, "rollout: the old policy is the rollout's, so the PPO ratio already weighs by pi / pi_rollout "
                              "and rollout_is would count it twice; expected rollout_is: off (rollout_rs still rejects), "
                              "loss_type: reinforce (its weights, no ratio), or old_logprobs: input")]
    if p["loss_type"] == "reinforce" and (p["old_logprobs"] != "rollout" or p["policy_loss"] != "vanilla"):
        return [Problem(pipeline.node_path(node.id) + ("params", "loss_type"), "reinforce is the loss of verl's bypass "
                        "mode: -A log pi against the rollout's own log-probs, without a ratio; expected old_logprobs: "
                        "rollout and policy_loss: vanilla with it, or loss_type: ppo_clip")]
    return []


def _stale_samples_corrected(node, pipeline):
    """Samples of older weights train uncorrected without rollout correction (or the rollout's own
    log-probs as the old policy): worth a warning (the demo learns under one_step_off with it and not
    without; docs/BENCHMARKS.md)."""
    if pipeline.runtime.schedule == "sync" or correction(node.params) or node.params["old_logprobs"] == "rollout":
        return []
    return [Problem(pipeline.node_path(node.id) + ("params", "rollout_is"), f"schedule {pipeline.runtime.schedule} "
                    "trains on samples of older weights, and this update does not correct for them; expected "
                    "rollout_is: token (or sequence)", severity="warning")]


@node_kind("actor_update", consumes=_consumes, produces=(), strategies=("megatron",), params_schema="actor_update",
           trains=True, check=_checks)
def actor_update(batch, ctx):
    """Mini-batch epochs of the PPO clipped objective (+ optional KL loss and entropy bonus), per token
    or per sequence (GSPO), or REINFORCE in bypass mode, with the rollout correction: from the batch's
    old log-probs once before the update (verl's decoupled mode: rejected tokens leave the mini batch's
    token count too), else in each micro batch's loss from its forward (as verl's bypass mode: the
    count keeps them, and batch normalization is the micro batch's)."""
    from nodes.algos.losses import ppo_actor_loss
    from nodes.algos.rollout_corr import correct
    from nodes.algos.rollout_corr_metrics import logprob_diff_metrics

    p, raw = ctx.params, correction(ctx.params)
    settings = parse(**raw) if raw else None  # once, not in every micro batch's loss (the door checked them)
    mode = p["old_logprobs"]
    if settings and mode == "input":  # this rank's rows; batch normalization over all ranks' rows
        weights, mask, metrics = correct(batch["old_logprobs"], batch["rollout_logprobs"], batch["response_mask"],
                                         settings, group=ctx.engine.dp_group)
        ctx.metrics.update(metrics | logprob_diff_metrics(batch["old_logprobs"], batch["rollout_logprobs"],
                                                          batch["response_mask"]))
        batch = {**batch, "response_mask": mask} | ({} if weights is None else {"rollout_is_weights": weights})
    seen = []  # corrected in the loss: each micro batch's (log-probs, rollout log-probs, mask), for the metrics

    def loss_fn(logprobs, entropy, mb, totals):
        old = {"input": mb.get("old_logprobs"), "update": logprobs.detach(), "rollout": mb.get("rollout_logprobs")}[mode]
        mask, weights = mb["response_mask"], mb.get("rollout_is_weights")
        if settings and mode != "input":
            seen.append((logprobs.detach(), mb["rollout_logprobs"], mask))
            weights, mask, _ = correct(*seen[-1], settings)
        return ppo_actor_loss(logprobs, old, mb["advantages"], mask, entropy=entropy,
                              ref_logprobs=mb.get("ref_logprobs"), clip_ratio_low=p["clip_ratio_low"],
                              clip_ratio_high=p["clip_ratio_high"], clip_ratio_c=p["clip_ratio_c"],
                              loss_agg_mode=p["loss_agg_mode"], entropy_coeff=p["entropy_coeff"],
                              use_kl_loss=p["use_kl_loss"], kl_loss_coef=p["kl_loss_coef"], kl_loss_type=p["kl_loss_type"],
                              policy_loss_mode=p["policy_loss"], loss_type=p["loss_type"], rollout_is_weights=weights,
                              totals=totals)

    metrics = ctx.engine.train(batch, loss_fn, mini_batch_size=p["mini_batch_size"] * ctx.samples_per_prompt,
                               micro_batch_size=ctx.engine.opts["micro_batch_size"], epochs=p["epochs"],
                               replay_routes=p["routing_replay"], entropy_grad=p["entropy_coeff"] != 0)
    ctx.metrics.update({k if "/" in k else f"actor/{k}": v for k, v in metrics.items()})
    if seen:  # the micro batches' rows, on the last pipeline stage (where the loss is computed)
        rows = [_rows([s[i] for s in seen]) for i in range(3)]
        ctx.metrics.update(correct(*rows, settings)[2] | logprob_diff_metrics(*rows))
    return {}


def _rows(parts):
    """Micro batches' [b, R_i] tensors as one [sum b, max R], padded with zeros (masked out)."""
    import torch

    width = max(t.shape[1] for t in parts)
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in parts])
