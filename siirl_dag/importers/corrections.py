"""Rollout correction as the peers spell it -> actor_update's settings (verl's names, docs/ALGORITHMS.md).

verl's `algorithm.rollout_correction.*` carries over as written (the same names and threshold forms),
its `bypass_mode` as `old_logprobs: rollout`. AReaL's decoupled loss weighs by pi_prox / pi_behave
(`rollout_is: token`); its `rejection_sampling` becomes the `rollout_rs` option of the same level,
metric and aggregation. NeMo-RL's and OpenRLHF's correction types (`tis`, `icepop`, `seq-mask-tis`
on a [min, max] band) and slime's `--use-tis` (its vanilla TIS, IcePop and MIS functions) map onto the
same settings (`typed`, `slime`). All weigh by rho = pi_old / pi_rollout, as verl does. A setting
whose form has no counterpart is listed with why, not guessed.
"""

from __future__ import annotations

import math

from nodes.algos.rollout_corr_settings import RS_OPTIONS, parse_is_threshold, parse_rs, parse_rs_thresholds
from siirl_dag.importers.draft import Draft
from siirl_dag.importers.source import Source

VERL = "algorithm.rollout_correction"
AREAL = "actor.rejection_sampling"
NO_LOWER = 1e9  # k1's band on pi_rollout / pi_old: no ratio passes it once log ratios are clamped to +-20
TINY = 1e-9  # likewise no weight falls below it: a band without a lower bound
SLIME_LEVELS = {"token": "token", "sequence": "sequence"}  # its "geometric" weights have no counterpart
SLIME_RS = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}


def k1_band(lower: float | None, upper: float) -> str:
    """A band [lower, upper] of the ratio pi_old / pi_rollout as k1's (a band of its inverse, verl's form)."""
    return f"{1 / upper:.6g}_{NO_LOWER if not lower else 1 / lower:.6g}"


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
        threshold = k1_band(None if lower is None else ratio(lower), ratio(upper))
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


def typed(src: Source, draft: Draft, kind: str | None, lower: float | None, upper: float | None, key: str,
          level: str = "token") -> None:
    """NeMo-RL's and OpenRLHF's types on rho: `tis` clamps the weights to [lower, upper], `icepop` zeroes
    those outside, `seq-mask-tis` drops sequences whose geometric-mean rho leaves the band and keeps the
    raw token weights of the rest; None: raw weights. `key`: the setting the audit names."""
    p = draft.actor_params
    if kind is None:
        p |= {"rollout_is": level, "rollout_is_threshold": NO_LOWER}
        src.remark(key, f"becomes rollout_is: {level} with untruncated weights (rollout_is_threshold {NO_LOWER:g}, "
                        "which no weight reaches)")
    elif kind == "tis" and upper:
        p |= {"rollout_is": level, "rollout_is_threshold": upper}
        if lower:
            src.remark(key, f"weights below {lower} are raised to it in the source; TIS here truncates from above only")
    elif kind == "icepop" and upper:
        p |= {"rollout_is": level, "rollout_is_threshold": f"{lower or TINY:g}_{upper:g}"}
    elif kind == "seq-mask-tis" and upper and level == "token":
        p |= {"rollout_is": "token", "rollout_is_threshold": NO_LOWER, "rollout_rs": "seq_mean_k1",
              "rollout_rs_threshold": k1_band(lower, upper)}
        src.remark(key, f"becomes rollout_rs: seq_mean_k1 with the band [{lower}, {upper}] turned over onto k1's "
                        f"({p['rollout_rs_threshold']}), and untruncated token weights (rollout_is_threshold {NO_LOWER:g})")
    else:
        src.drop(key, f"{kind} at the {level} level, bounds [{lower}, {upper}], has no counterpart here; expected tis, "
                      "icepop or seq-mask-tis (token level) with an upper bound")


def slime(src: Source, draft: Draft, config: str = "") -> None:
    """slime's --use-tis: vanilla TIS (--tis-clip, --tis-clip-low), IcePop (its icepop_function) or its MIS
    example (compute_mis_weights*) read from the --custom-config-path file's keys (`config`: their prefix,
    which override the flags as slime's setattr does); --use-rollout-logprobs is bypass mode."""
    def setting(name: str, default=None):
        value = src.take(config + name) if config and src.has(config + name) else None
        flag = src.take("--" + name.replace("_", "-"))
        return value if value is not None else flag if flag is not None else default

    function = str(src.take("--custom-tis-function-path") or "")
    use_tis = setting("use_tis", False)
    if src.take("--use-rollout-logprobs", False):
        draft.actor_params["old_logprobs"] = "rollout"
        src.remark("--use-rollout-logprobs", "becomes old_logprobs: rollout (the rollout's log-probs are the old policy)")
    src.drop("--get-mismatch-metrics", "no counterpart alone: the rollout_corr/* metrics come with a correction here")
    if not use_tis:
        for key in [k for k in src.keys if k.startswith(config) and config] + ["--tis-clip", "--tis-clip-low"]:
            src.drop(key, "--use-tis is off (slime then measures the mismatch only)")
        return
    upper, lower = setting("tis_clip", 2.0), setting("tis_clip_low", 0)
    if not function:
        typed(src, draft, "tis", lower, upper, "--use-tis")
    elif function.endswith("icepop_function"):
        typed(src, draft, "icepop", lower, upper, "--custom-tis-function-path")
    elif function.rsplit(".", 1)[-1].startswith("compute_mis_weights"):
        _mis(src, draft, setting, [config + "rs_veto_threshold", "--rs-veto-threshold"])
    else:
        src.drop("--custom-tis-function-path", "a function of your own: not read here")
        src.drop("--use-tis", "its weights come from a function of your own (--custom-tis-function-path)")


def _mis(src: Source, draft: Draft, setting, veto: list[str]) -> None:
    """slime's MIS example: weights of a level truncated, clipped or masked; rejection of a level by a band."""
    upper = setting("tis_upper_bound", 2.0)
    lower = setting("tis_lower_bound") or 1.0 / upper
    level, mode = setting("tis_level", "token"), setting("tis_mode", "truncate")
    key = "--custom-tis-function-path"
    if level not in SLIME_LEVELS:
        src.remark(key, f"tis_level {level} weights have no counterpart (token and sequence do): no weights here")
    elif mode in ("truncate", "clip"):
        typed(src, draft, "tis", lower if mode == "clip" else None, upper, key, level)
    elif mode == "mask":
        typed(src, draft, "icepop", lower, upper, key, level)
    if setting("tis_batch_normalize", False) and draft.actor_params.get("rollout_is"):
        draft.actor_params["rollout_is_batch_normalize"] = True
    if setting("use_rs", False):
        rs_level = setting("rs_level", "token")
        band = k1_band(setting("rs_lower_bound") or lower, setting("rs_upper_bound") or upper)
        if rs_level in SLIME_RS:
            draft.actor_params |= {"rollout_rs": SLIME_RS[rs_level], "rollout_rs_threshold": band}
    for key in veto:  # a sequence rejected for one token's ratio below it
        src.drop(key, "no counterpart here: rollout_rs rejects by a divergence per token or per sequence")
