"""Rollout correction as verl and AReaL spell it -> actor_update's settings (verl's names, docs/ALGORITHMS.md).

verl's `algorithm.rollout_correction.*` carries over as written (the same names and threshold forms),
its `bypass_mode` as `old_logprobs: rollout`. AReaL's decoupled loss weighs by pi_prox / pi_behave
(`rollout_is: token`); its `rejection_sampling` becomes the `rollout_rs` option of the same level,
metric and aggregation. A setting whose form has no counterpart is listed with why, not guessed.
"""

from __future__ import annotations

import math

from nodes.algos.rollout_corr_settings import RS_OPTIONS, parse_is_threshold, parse_rs, parse_rs_thresholds
from siirl_dag.importers.draft import Draft
from siirl_dag.importers.source import Source

VERL = "algorithm.rollout_correction"
AREAL = "actor.rejection_sampling"
NO_LOWER = 1e9  # k1's band on pi_rollout / pi_old: no ratio passes it once log ratios are clamped to +-20


def _parsed(src: Source, key: str, parse, value) -> bool:
    """Whether `value` is a form this engine reads; if not, `key` is listed with why."""
    try:
        parse(value)
    except ValueError as e:
        src.drop(key, f"not a form read here ({e})")
        return False
    return True


def verl(src: Source, draft: Draft) -> None:
    """algorithm.rollout_correction: importance weights, rejection, bypass mode and its loss."""
    p = draft.actor_params
    level = src.take(f"{VERL}.rollout_is", kind=str)
    if level is not None:
        p |= {"rollout_is": level, "rollout_is_batch_normalize": src.take(f"{VERL}.rollout_is_batch_normalize", kind=bool)}
        threshold = src.value(f"{VERL}.rollout_is_threshold")
        if threshold is not None and _parsed(src, f"{VERL}.rollout_is_threshold", parse_is_threshold, threshold):
            p["rollout_is_threshold"] = src.take(f"{VERL}.rollout_is_threshold")
    options = src.value(f"{VERL}.rollout_rs")
    if options is not None and _parsed(src, f"{VERL}.rollout_rs", parse_rs, options):
        threshold = src.value(f"{VERL}.rollout_rs_threshold")
        if _parsed(src, f"{VERL}.rollout_rs_threshold", lambda t: parse_rs_thresholds(parse_rs(options), t), threshold):
            p |= {"rollout_rs": src.take(f"{VERL}.rollout_rs"), "rollout_rs_threshold": src.take(f"{VERL}.rollout_rs_threshold")}
    if src.take(f"{VERL}.bypass_mode", False, kind=bool):
        p |= {"old_logprobs": "rollout", "loss_type": src.take(f"{VERL}.loss_type", kind=str)}
        src.remark(f"{VERL}.bypass_mode", "becomes old_logprobs: rollout (the rollout's log-probs are the old policy; no "
                                          "old log-prob pass)")
        if p.get("rollout_is") and p.get("loss_type") in (None, "ppo_clip"):
            del p["rollout_is"]
            src.remark(f"{VERL}.rollout_is", "verl's bypass PPO-clip computes these weights for its metrics only (the "
                                             "ratio already is pi / pi_rollout): rollout_is off here")
    else:
        src.drop(f"{VERL}.loss_type", "it picks the loss of bypass mode only, which is off")
    for key in src.under(VERL):
        if key not in src.notes:  # a form not read here keeps its own why
            src.drop(key, "not read by this engine")
    src.take("actor_rollout_ref.rollout.calculate_log_probs")  # the rollout always returns them (rollout_logprobs)


def areal(src: Source, draft: Draft) -> None:
    """actor.use_decoupled_loss (the weights pi_prox / pi_behave) and its rejection_sampling, or the
    legacy behav(e)_imp_weight_cap (weights truncated to it)."""
    if not src.take("actor.use_decoupled_loss", False, kind=bool):
        src.drop_under(AREAL, "AReaL applies it only with actor.use_decoupled_loss, which is off")
        return
    cap = src.take("actor.behav_imp_weight_cap", src.take("actor.behave_imp_weight_cap"))
    draft.actor_params |= {"rollout_is": "token", "rollout_is_threshold": cap}
    src.remark("actor.use_decoupled_loss", "becomes rollout_is: token (the loss weighed by importance weights of the "
                                           "trainer's old policy over the rollout's)")
    if not src.under(AREAL):
        return
    level, metric = src.value(f"{AREAL}.level", "token"), src.value(f"{AREAL}.metric", "ratio")
    agg, action = src.value(f"{AREAL}.agg", "mean"), src.value(f"{AREAL}.action", "mask")
    upper, lower = src.value(f"{AREAL}.upper", 5.0), src.value(f"{AREAL}.lower")
    if action == "clamp" and level == "token" and metric == "ratio" and lower is None:
        draft.actor_params["rollout_is_threshold"] = upper  # truncated weights: TIS
        for key in src.under(AREAL):
            src.take(key)
        return
    estimator = "k1" if metric == "ratio" else str(metric).removeprefix("kl_")
    option = f"token_{estimator}" if level == "token" else f"seq_{agg}_{estimator}"
    if action != "mask" or option not in RS_OPTIONS:
        src.drop_under(AREAL, f"{action} by the {level} {metric} ({agg}) has no counterpart here; rollout_rs rejects "
                              "(mask) by the ratio, or by k2 / k3 (docs/ALGORITHMS.md)")
        return
    if option.endswith("k1"):  # k1's band is on pi_rollout / pi_old: AReaL's bounds on the ratio (or its log) turned over
        ratio = (lambda bound: bound) if metric == "ratio" else math.exp
        threshold = f"{1 / ratio(upper):.6g}_{NO_LOWER if lower is None else 1 / ratio(lower):.6g}"
    else:
        threshold = upper
        if lower is not None:
            src.remark(f"{AREAL}.lower", f"{metric} is a divergence >= 0 here; only its upper bound rejects")
    draft.actor_params |= {"rollout_rs": option, "rollout_rs_threshold": threshold}
    for key in src.under(AREAL):
        src.take(key)
    exact = option == "token_k1" and metric == "ratio"
    if exact:  # the weights of the tokens kept are <= upper: truncating there changes none
        draft.actor_params["rollout_is_threshold"] = upper
    src.remark(src.under(AREAL)[0], f"becomes rollout_rs: {option}, rollout_rs_threshold: {threshold}" + (
        "" if exact else f"; AReaL weighs by the untruncated ratio (by its geometric mean per sequence with level "
                         f"sequence and metric ratio), here token weights truncated at {cap or 2.0}"))
