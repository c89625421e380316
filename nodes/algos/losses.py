"""PPO-family losses on [B, R] response-aligned tensors (verl semantics, names users know).

Every function takes a `response_mask` and ignores padded tokens. `agg_loss` turns a per-token loss
matrix into a scalar; the aggregation mode decides how long and short responses are weighted,
which is what separates GRPO/DAPO (token-mean), the original PPO-RLHF (seq-mean-token-mean) and
Dr.GRPO (seq-mean-token-sum-norm). In training the denominators are the whole mini batch's
(`totals`: over every micro batch and data-parallel rank), so a loss and its gradient do not depend
on how the batch is split; without `totals` they are this call's own (tests, metrics).
"""

from __future__ import annotations

from typing import Optional

import torch

from nodes.algos.masked import masked_mean, masked_sum
from siirl_dag.strategies.base import MiniBatchTotals

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

# Estimator names: verl's names and the k1/k2/k3 names of Schulman's note on KL approximation; a
# trailing "+" is verl's straight-through form: the value of the estimator, the gradient of k2.
KL_ESTIMATORS = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3", "abs": "abs"}
KL_ESTIMATORS.update({f"{name}+": f"{kind}+" for name, kind in list(KL_ESTIMATORS.items())})


def agg_loss(loss_mat: torch.Tensor, response_mask: torch.Tensor, mode: str, norm_constant: Optional[float] = None,
             totals: Optional[MiniBatchTotals] = None) -> torch.Tensor:
    """Reduce a [B, R] per-token loss to a scalar (this batch's share of the mini batch's, with `totals`).

    token-mean: mean over all response tokens of the mini batch (long answers weigh more).
    token-sum: sum over all response tokens (verl's; the scale grows with the batch).
    seq-mean-token-sum: per-sequence token sum, mean over sequences.
    seq-mean-token-mean: per-sequence token mean, mean over sequences (every answer weighs the same).
    seq-mean-token-sum-norm: per-sequence token sum / `norm_constant` (default: R, the max response
    length), mean over sequences; a constant divisor removes the length bias (Dr.GRPO).
    Sequence means run over sequences with at least one response token.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; expected one of {', '.join(LOSS_AGG_MODES)}")
    if mode == "token-sum":
        return masked_sum(loss_mat, response_mask)
    if mode == "token-mean":
        tokens = response_mask.sum() if totals is None else totals.tokens
        return masked_sum(loss_mat, response_mask) / max(float(tokens), 1.0)
    if mode == "seq-mean-token-sum":
        per_seq = masked_sum(loss_mat, response_mask, dim=-1)
    elif mode == "seq-mean-token-mean":
        per_seq = masked_mean(loss_mat, response_mask, dim=-1)
    else:
        divisor = response_mask.shape[-1] if norm_constant is None else norm_constant
        per_seq = masked_sum(loss_mat, response_mask, dim=-1) / divisor
    nonempty = (response_mask.sum(dim=-1) > 0).to(loss_mat.dtype)
    sequences = nonempty.sum() if totals is None else totals.sequences
    return (per_seq * nonempty).sum() / max(float(sequences), 1.0)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "low_var_kl") -> torch.Tensor:
    """Per-token estimate of KL(policy || ref) from the log-probs of the sampled tokens.

    k1 ("kl"): log p - log q (unbiased, high variance, can be negative).
    k2 ("mse"): 0.5 (log p - log q)^2.
    k3 ("low_var_kl"): q/p - log(q/p) - 1 >= 0, clamped to [-10, 10] as verl does for stability.
    "abs": |log p - log q|.
    "<name>+": the value of <name> with the gradient of k2, whose gradient is an unbiased estimate of
    the KL's (verl's straight-through estimators).
    """
    kind = KL_ESTIMATORS.get(estimator)
    if kind is None:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {', '.join(KL_ESTIMATORS)}")
    diff = logprobs - ref_logprobs
    if kind.endswith("+"):
        value, grad = kl_penalty(logprobs, ref_logprobs, kind[:-1]), 0.5 * diff.square()
        return grad - grad.detach() + value.detach()
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff.square()
    if kind == "abs":
        return diff.abs()
    log_ratio = (-diff).clamp(-20.0, 20.0)  # log(q/p); clamp keeps exp finite
    return (log_ratio.exp() - log_ratio - 1.0).clamp(-10.0, 10.0)


POLICY_LOSS_MODES = ("vanilla", "gspo")
LOSS_TYPES = ("ppo_clip", "reinforce")  # reinforce: verl's bypass-mode loss, without a ratio


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: Optional[float] = 3.0,
    mode: str = "vanilla",
    loss_type: str = "ppo_clip",
    rollout_is_weights: Optional[torch.Tensor] = None,
):
    """PPO clipped surrogate with asymmetric clipping and dual-clip, per token or per sequence.

    vanilla: ratio r = exp(logprobs - old_logprobs) per token; loss = max(-A r, -A clip(r, 1-low, 1+high)).
    Dual-clip (Ye et al. 2020) bounds the loss of negative-advantage tokens at -A * clip_ratio_c so a
    huge ratio on a bad token cannot blow up the update; None disables it.
    gspo (Zheng et al. 2025): one ratio per sequence, the geometric mean of its token ratios, clipped as a
    whole (GSPO-token: each token carries the sequence's value with its own gradient); no dual-clip.
    loss_type reinforce (verl's bypass mode, old_logprobs the rollout's): -A log pi, no ratio, no clipping.
    `rollout_is_weights` [B, R] (importance weights of the rollout engine's sampling against the
    trainer's old policy) multiply each token's loss.
    Returns (the per-token loss [B, R], pg_clipfrac, ppo_kl, pg_clipfrac_lower), the last three detached
    scalars.
    """
    if mode not in POLICY_LOSS_MODES or loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown policy loss {mode!r} / loss type {loss_type!r}; expected one of "
                         f"{', '.join(POLICY_LOSS_MODES)} / {', '.join(LOSS_TYPES)}")
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 (dual-clip lower bound), got {clip_ratio_c}")
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)
    ppo_kl = masked_mean(-log_ratio, response_mask)
    if loss_type == "reinforce":
        loss = -advantages * logprobs
        zero = torch.zeros((), dtype=loss.dtype, device=loss.device)
        return (loss if rollout_is_weights is None else loss * rollout_is_weights), zero, ppo_kl.detach(), zero
    if mode == "gspo":
        seq_log_ratio = masked_mean(log_ratio, response_mask, dim=-1).unsqueeze(-1)
        log_ratio = (logprobs - logprobs.detach() + seq_log_ratio.detach()).clamp(max=10.0)
        clip_ratio_c = None
    ratio = log_ratio.exp()

    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss = torch.maximum(loss_unclipped, loss_clipped)
    pg_clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), response_mask)

    if clip_ratio_c is not None:
        bound = -advantages * clip_ratio_c
        negative = advantages < 0
        pg_clipfrac_lower = masked_mean(((loss > bound) & negative).float(), response_mask)
        loss = torch.where(negative, torch.minimum(loss, bound), loss)
    else:
        pg_clipfrac_lower = torch.zeros((), dtype=loss.dtype, device=loss.device)
    if rollout_is_weights is not None:
        loss = loss * rollout_is_weights
    return loss, pg_clipfrac.detach(), ppo_kl.detach(), pg_clipfrac_lower.detach()


def value_loss(
    values_pred: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cliprange_value: float = 0.5,
):
    """Clipped critic loss 0.5 * max((v - R)^2, (clip(v, v_old +- c) - R)^2) per token, as in PPO.

    Returns (the per-token loss [B, R], vf_clipfrac); vf_clipfrac is the share of tokens where the
    clipped term won.
    """
    clipped = old_values + (values_pred - old_values).clamp(-cliprange_value, cliprange_value)
    loss_unclipped = (values_pred - returns).square()
    loss_clipped = (clipped - returns).square()
    vf_clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), response_mask)
    return 0.5 * torch.maximum(loss_unclipped, loss_clipped), vf_clipfrac.detach()


def ppo_actor_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    entropy: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: Optional[float] = 3.0,
    loss_agg_mode: str = "token-mean",
    entropy_coeff: float = 0.0,
    use_kl_loss: bool = False,
    kl_loss_coef: float = 0.001,
    kl_loss_type: str = "low_var_kl",
    norm_constant: Optional[float] = None,
    policy_loss_mode: str = "vanilla",
    loss_type: str = "ppo_clip",
    rollout_is_weights: Optional[torch.Tensor] = None,
    totals: Optional[MiniBatchTotals] = None,
):
    """The actor objective: pg_loss - entropy_coeff * entropy + kl_loss_coef * KL(policy || ref).

    Returns (loss, metrics) with metrics as floats under the actor/* names of verl; metrics are this
    batch's own means (the loss, with `totals`, its share of the mini batch's).
    """
    def term(per_token):  # (its part of the loss, its metric: this batch's own mean)
        shown = agg_loss(per_token.detach(), response_mask, loss_agg_mode, norm_constant).item()
        return agg_loss(per_token, response_mask, loss_agg_mode, norm_constant, totals), shown

    pg_tokens, pg_clipfrac, ppo_kl, pg_clipfrac_lower = policy_loss(
        logprobs, old_logprobs, advantages, response_mask, clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c, mode=policy_loss_mode, loss_type=loss_type,
        rollout_is_weights=rollout_is_weights)
    metrics: dict = {}
    loss, metrics["actor/pg_loss"] = term(pg_tokens)
    metrics.update({"actor/pg_clipfrac": pg_clipfrac.item(), "actor/ppo_kl": ppo_kl.item(),
                    "actor/pg_clipfrac_lower": pg_clipfrac_lower.item()})
    if entropy is not None:
        entropy_loss, metrics["actor/entropy"] = term(entropy)
        loss = loss - entropy_coeff * entropy_loss
    elif entropy_coeff != 0.0:
        raise ValueError(f"entropy_coeff={entropy_coeff} needs the per-token entropy; none was given")
    if use_kl_loss:
        if ref_logprobs is None:
            raise ValueError("use_kl_loss needs ref_logprobs; none were given (is a reference log-prob node upstream?)")
        kl_loss, metrics["actor/kl_loss"] = term(kl_penalty(logprobs, ref_logprobs, kl_loss_type))
        loss = loss + kl_loss_coef * kl_loss
        metrics["actor/kl_coef"] = kl_loss_coef
    return loss, metrics


def ppo_critic_loss(
    values_pred: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cliprange_value: float = 0.5,
    loss_agg_mode: str = "token-mean",
    norm_constant: Optional[float] = None,
    totals: Optional[MiniBatchTotals] = None,
):
    """The critic objective with its critic/* metrics (floats, this batch's own means)."""
    vf_tokens, vf_clipfrac = value_loss(values_pred, old_values, returns, response_mask, cliprange_value=cliprange_value)
    metrics = {
        "critic/vf_loss": agg_loss(vf_tokens.detach(), response_mask, loss_agg_mode, norm_constant).item(),
        "critic/vf_clipfrac": vf_clipfrac.item(),
        "critic/vpred_mean": masked_mean(values_pred, response_mask).item(),
    }
    return agg_loss(vf_tokens, response_mask, loss_agg_mode, norm_constant, totals), metrics
